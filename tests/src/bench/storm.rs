use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};
use valet_sim::node::SpawnOptions;
use valet_tests::harness::{Agent, JobSpec, Node};

#[allow(clippy::wildcard_imports)]
use super::*;

/// 5. A watched pod forks short processes as fast as the machine allows.
pub(crate) fn storm(plan: &Plan, table: &mut Table) -> Result<()> {
    let jobs = plan.storm_jobs;
    println!(
        "\n[5] a watched pod forking as fast as it can: {jobs} other 0.3 s Jobs, pod-watch latency, an agent stall"
    );
    let app = bin("valet-bench-app")?;
    let app = app.to_str().context("path")?.to_owned();
    let forker = bin("valet-bench-forker")?;
    let forker = forker.to_str().context("path")?.to_owned();
    let node = Node::new()?;
    let agent = node.start_agent(&[])?;
    let events_lost = |a: &Agent| a.metric("valet_kernel_events_lost_total ");

    // Quiet machine first: the references.
    let quiet_watch = watch_latency(&node, &agent, 0.0, 30)?;
    let mut quiet_quits = Vec::new();
    for i in 0..jobs {
        if let Some(us) = one_job(&node, &agent, &app, &format!("quiet-{i}"), 1, || Ok(()))? {
            quiet_quits.push(us);
        }
    }

    // The storm: a labelled pod whose app forks in two processes for long enough.
    let mut busy = node.job_pod(JobSpec::new("busy"))?;
    agent.wait_tracked(1, Duration::from_secs(5))?;
    let count = node.scratch.path("forks");
    let count_s = count.to_str().context("path")?.to_owned();
    let storm_ms = plan.storm.as_millis() as u64;
    let started = Instant::now();
    busy.start_app("app", &[&forker, &storm_ms.to_string(), "2", &count_s], &SpawnOptions::default())?;
    std::thread::sleep(Duration::from_secs(1));
    let lost_before = events_lost(&agent);
    let mut storm_quits = Vec::new();
    let mut ends_lost = 0;
    for i in 0..jobs {
        match one_job(&node, &agent, &app, &format!("storm-{i}"), 2, || Ok(()))? {
            Some(us) => storm_quits.push(us),
            None => ends_lost += 1,
        }
    }
    let storm_watch = watch_latency(&node, &agent, 1.0, 30)?;
    // The agent stalled for 3 s (as CPU throttling under its limit would stall it) while another
    // pod's app ends: its quit must come from the kernel path right after the agent resumes.
    let pid = agent.pid().context("agent pid")? as i32;
    let stall = plan.stall;
    let stalled = one_job(&node, &agent, &app, "stalled", 2, || {
        // SAFETY: plain syscalls on our own child.
        unsafe { libc::kill(pid, libc::SIGSTOP) };
        std::thread::sleep(stall);
        unsafe { libc::kill(pid, libc::SIGCONT) };
        Ok(())
    })?;
    let lost_during = events_lost(&agent) - lost_before;
    let left = Duration::from_millis(storm_ms).saturating_sub(started.elapsed());
    if left.is_zero() {
        println!("  (the storm ended before the measurements: figures below are partly without it)");
    }
    let _ = busy.wait_proxy_exit(left + Duration::from_secs(10))?;
    let forks: f64 = std::fs::read_to_string(&count).ok().and_then(|c| c.trim().parse().ok()).unwrap_or(0.0);
    let rate = forks / (storm_ms as f64 / 1000.0);
    drop(busy);
    println!(
        "  storm: {forks:.0} processes in {:.1} s = {rate:.0} exits/s in the watched pod",
        storm_ms as f64 / 1000.0
    );
    let qw = report("pod-watch latency, quiet", quiet_watch);
    let sw = report("pod-watch latency, during the storm", storm_watch);
    let qq = report("exit → quit, 0.3 s Job, quiet", quiet_quits);
    let sq = report("exit → quit, 0.3 s Job, during the storm", storm_quits);
    // The quit of the app that ended while the agent was stopped, counted from the end of the stall.
    let after_stall =
        stalled.map(|us| (us / 1e3 - (stall.as_secs_f64() * 1e3 - JOB_MS.parse::<f64>().unwrap_or(0.0))).max(0.0));
    match after_stall {
        Some(ms) => println!(
            "  app ended during a {:.0} s agent stall: quit {ms:.0} ms after the agent resumed",
            stall.as_secs_f64()
        ),
        None => {
            ends_lost += 1;
            println!("  app ended during a {:.0} s agent stall: its proxy was NOT quit", stall.as_secs_f64());
        }
    }
    println!(
        "  container ends lost: {ends_lost} of {}; valet_kernel_events_lost_total during the storm: {lost_during:.0}",
        jobs + 1
    );
    table.add(
        "[5] fork storm in a watched pod (2 processes fork+_exit)",
        format!("{rate:.0} exits/s for {:.0} s", storm_ms as f64 / 1e3),
        "—",
        "as fast as the machine allows",
        "—".into(),
    );
    table.add(
        &format!(
            "[5] container ends lost ({jobs} Jobs in the storm + 1 during a {:.0} s agent stall)",
            stall.as_secs_f64()
        ),
        format!("{ends_lost} of {}", jobs + 1),
        "—",
        "0",
        met(ends_lost == 0).into(),
    );
    table.add(
        "[5] app ended during the agent stall: quit after the agent resumed",
        after_stall.map_or_else(|| "never".into(), |ms| format!("{ms:.0} ms")),
        "—",
        "right after it resumes (≤ 100 ms)",
        met(after_stall.is_some_and(|ms| ms <= 100.0)).into(),
    );
    table.add(
        "[5] valet_kernel_events_lost_total during the storm",
        format!("{lost_during:.0}"),
        "—",
        "only exits that cannot matter",
        (if ends_lost == 0 { "no container end among them" } else { "container ends lost" }).into(),
    );
    table.add(
        "[5] exit → quit, 0.3 s Job, during the storm (median / p99)",
        sq.ms(),
        &format!("quiet {}", qq.ms()),
        "—",
        format!("{:.2}× quiet", sq.median / qq.median),
    );
    table.add(
        "[5] pod-watch latency during the storm (median / p99)",
        sw.ms(),
        &format!("quiet {}", qw.ms()),
        "no lag (≤ 1.2× quiet)",
        format!("{:.2}× quiet: {}", sw.median / qw.median, met(sw.median <= 1.2 * qw.median)),
    );
    Ok(())
}
