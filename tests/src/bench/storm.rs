use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};
use valet_sim::node::SpawnOptions;
use valet_tests::harness::{Agent, JobSpec, Node};

#[allow(clippy::wildcard_imports, reason = "the bench's parts share one namespace")]
use super::*;

/// A row of [5]'s stall: the agent's send times of its quits after the resume (`sent`), the
/// proxies' receipts beside (`received`). Met when every end's quit was written within 100 ms of
/// the resume, each with its send time in the agent's log.
fn add_sent_row(table: &mut Table, what: &str, target: &str, sent: &Stats, received: &Stats, stalled: &Stalled) {
    let verdict = met(sent.n == stalled.ends && stalled.unsent == 0 && sent.max <= 100_000.0);
    table.add(
        &format!(
            "[5] … their quits after the agent resumed{what}: the agent's writes (median / p99, max; n={})",
            sent.n
        ),
        format!("{}, {:.1} ms", sent.ms(), sent.max / 1e3),
        &format!("the proxies' receipts {}, {:.1} ms", received.ms(), received.max / 1e3),
        target,
        if stalled.unsent > 0 {
            format!("{verdict} ({} quits without a send time)", stalled.unsent)
        } else {
            verdict.into()
        },
    );
}

/// What [5] measured: the references on a quiet machine, then the same during the storm, and the
/// two agent stalls in it.
struct Storm {
    quiet_watch: WatchLag,
    quiet_quits: Vec<f64>,
    storm_watch: WatchLag,
    storm_quits: Vec<f64>,
    ends_lost: usize,
    lost_during: f64,
    rate: f64,
    storm_ms: u64,
    stalled: Stalled,
    short: Stalled,
}

/// 5. A watched pod forks short processes as fast as the machine allows.
pub(crate) fn storm(plan: &Plan, table: &mut Table) -> Result<()> {
    let jobs = plan.storm_jobs;
    println!(
        "\n[5] a watched pod forking as fast as it can: {jobs} other 0.3 s Jobs, pod-watch latency, {} ends in an agent stall (twice)",
        plan.stall_ends
    );
    let app = bin("valet-bench-app")?;
    let app = app.to_str().context("path")?.to_owned();
    let node = Node::new()?;
    let agent = node.start_agent_env(&[], &[("RUST_LOG", ROUTER_LOG)])?;

    // Quiet machine first: the references.
    let quiet_watch = watch_latency(&node, &agent, 0.0, 30)?;
    let mut quiet_quits = Vec::new();
    for i in 0..jobs {
        if let Some(us) = one_job(&node, &agent, &app, &format!("quiet-{i}"), 1, || Ok(()))? {
            quiet_quits.push(us);
        }
    }
    let storm = in_storm(plan, &node, &agent, &app, quiet_watch, quiet_quits)?;
    storm_rows(plan, &storm, table);
    Ok(())
}

/// The storm: a labelled pod whose app forks in two processes for long enough; meanwhile `jobs`
/// Jobs, the pod-watch latency and two agent stalls.
fn in_storm(
    plan: &Plan,
    node: &Node,
    agent: &Agent,
    app: &str,
    quiet_watch: WatchLag,
    quiet_quits: Vec<f64>,
) -> Result<Storm> {
    let jobs = plan.storm_jobs;
    let forker = bin("valet-bench-forker")?;
    let forker = forker.to_str().context("path")?.to_owned();
    let events_lost = |a: &Agent| a.metric("valet_kernel_events_lost_total ");
    let mut busy = node.job_pod(JobSpec::new("busy"))?;
    agent.wait_tracked(1, Duration::from_secs(5))?;
    let count = node.scratch.path("forks");
    let count_s = count.to_str().context("path")?.to_owned();
    let storm_ms = plan.storm.as_millis() as u64;
    let started = Instant::now();
    busy.start_app("app", &[&forker, &storm_ms.to_string(), "2", &count_s], &SpawnOptions::default())?;
    std::thread::sleep(Duration::from_secs(1));
    let lost_before = events_lost(agent);
    let mut storm_quits = Vec::new();
    let mut ends_lost = 0;
    for i in 0..jobs {
        match one_job(node, agent, app, &format!("storm-{i}"), 2, || Ok(()))? {
            Some(us) => storm_quits.push(us),
            None => ends_lost += 1,
        }
    }
    let storm_watch = watch_latency(node, agent, 1.0, 30)?;
    // The agent stalled while many other pods' apps end, their reports held past the stall.
    let stalled = stall_ends(node, agent, plan.stall_ends, plan.stall, false, 1)?;
    // The same with Jobs shorter than the stall: they start and end while the agent is stopped.
    let short = stall_ends(node, agent, plan.stall_ends, plan.stall, true, 1)?;
    if short.resumed_at >= started + plan.storm {
        bail!("the storm ended before the stall did: the stall's figures would be without it");
    }
    let lost_during = events_lost(agent) - lost_before;
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
    Ok(Storm {
        quiet_watch,
        quiet_quits,
        storm_watch,
        storm_quits,
        ends_lost,
        lost_during,
        rate,
        storm_ms,
        stalled,
        short,
    })
}

/// [5]'s figures, reported and printed, then its rows.
fn storm_rows(plan: &Plan, storm: &Storm, table: &mut Table) {
    let Storm { storm_ms, rate, ends_lost, lost_during, ref stalled, ref short, .. } = *storm;
    let jobs = plan.storm_jobs;
    let qq = report("exit → quit, 0.3 s Job, quiet", storm.quiet_quits.clone());
    let sq = report("exit → quit, 0.3 s Job, during the storm", storm.storm_quits.clone());
    let resumed = report(
        &format!("quit after the agent resumed (from its SIGCONT{})", if stalled.traced { "" } else { ", our clock" }),
        stalled.after_resume.clone(),
    );
    let short_resumed = report("… apps started in the stall: quit after the agent resumed", short.after_resume.clone());
    let sent = report("quit written by the agent after it resumed", stalled.sent_after_resume.clone());
    let short_sent = report(
        "… apps started in the stall: quit written by the agent after it resumed",
        short.sent_after_resume.clone(),
    );
    println!(
        "  apps started and ended in the stall: {} lost of {}, {} named by the kubelet's log link; \
         valet_kernel_events_lost_total across it: {:.0}",
        short.lost, short.ends, short.named_by_link, short.events_lost
    );
    println!(
        "  {} container ends during a {:.0} s agent stall: {} lost (not quit before the API's reports); \
         ring buffer {} KiB, {} bytes an end: {} ends; valet_kernel_events_lost_total across the stall: {:.0}",
        stalled.ends,
        plan.stall.as_secs_f64(),
        stalled.lost,
        stalled.ring_bytes / 1024,
        stalled.end_bytes,
        stalled.ring_capacity(),
        stalled.events_lost
    );
    println!(
        "  container ends lost in the storm: {ends_lost} of {jobs}; valet_kernel_events_lost_total during it: {lost_during:.0}"
    );
    table.add(
        "[5] fork storm in a watched pod (2 processes fork+_exit)",
        format!("{rate:.0} exits/s for {:.0} s", storm_ms as f64 / 1e3),
        "—",
        "as fast as the machine allows",
        "—".into(),
    );
    stall_rows(plan, stalled, short, (&sent, &resumed), (&short_sent, &short_resumed), table);
    table.add(
        &format!("[5] container ends lost, {jobs} Jobs in the storm"),
        format!("{ends_lost} of {jobs}"),
        "—",
        "0",
        met(ends_lost == 0).into(),
    );
    table.add(
        "[5] valet_kernel_events_lost_total during the storm, and across the stall",
        format!("{lost_during:.0}, {:.0}", stalled.events_lost + short.events_lost),
        "—",
        "only exits that cannot matter",
        (if ends_lost + stalled.lost + short.lost == 0 {
            "no container end among them"
        } else {
            "container ends lost"
        })
        .into(),
    );
    table.add(
        "[5] exit → quit, 0.3 s Job, during the storm (median / p99)",
        sq.ms(),
        &format!("quiet {}", qq.ms()),
        "—",
        format!("{:.2}× quiet", sq.median / qq.median),
    );
    storm_watch_row(storm, table);
}

/// [5]'s pod-watch row: during the storm against quiet, by the agent's log, and where the
/// difference goes ([`watch_split`]): the storm's processes take the CPUs from the API stand-in
/// and a bare watch client as much as from the agent.
fn storm_watch_row(storm: &Storm, table: &mut Table) {
    let split = watch_split(("quiet", "storm"), "during the storm", &storm.quiet_watch, &storm.storm_watch);
    table.add(
        "[5] pod-watch latency during the storm, to the agent's router by its log (median / p99)",
        split.latency,
        &split.reference,
        "no lag (≤ 1.2× quiet), or a measurement that puts the difference outside the agent",
        split.verdict,
    );
}

/// [5]'s rows of the two stalls: ends lost, and the quits' send times after the agent resumed
/// (each as (sent, received)).
fn stall_rows(
    plan: &Plan,
    stalled: &Stalled,
    short: &Stalled,
    (sent, resumed): (&Stats, &Stats),
    (short_sent, short_resumed): (&Stats, &Stats),
    table: &mut Table,
) {
    table.add(
        &format!(
            "[5] container ends while the agent was stopped {:.0} s in the storm, the API's reports held past it: lost",
            plan.stall.as_secs_f64()
        ),
        format!("{} of {}", stalled.lost, stalled.ends),
        &format!(
            "ring buffer: {} ends ({} KiB, {} bytes an end)",
            stalled.ring_capacity(),
            stalled.ring_bytes / 1024,
            stalled.end_bytes
        ),
        "0",
        met(stalled.lost == 0 && stalled.ends >= plan.stall_ends).into(),
    );
    add_sent_row(
        table,
        ", from its SIGCONT",
        "right after it resumes: every one ≤ 100 ms, by the agent's send times",
        sent,
        resumed,
        stalled,
    );
    table.add(
        "[5] … the same with Jobs shorter than the stall (started and ended while the agent was stopped): lost",
        format!("{} of {}", short.lost, short.ends),
        &format!(
            "named by the kubelet's log link of their id: {} of {} (their cgroups and bundles removed by then)",
            short.named_by_link, short.ends
        ),
        "0",
        met(short.lost == 0 && short.ends >= plan.stall_ends).into(),
    );
    add_sent_row(table, "", "every one ≤ 100 ms, by the agent's send times", short_sent, short_resumed, short);
}
