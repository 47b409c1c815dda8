use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use valet_sim::node::SpawnOptions;
use valet_tests::harness::{Agent, Node, eventually};

#[allow(clippy::wildcard_imports, reason = "the bench's parts share one namespace")]
use super::*;

/// What [8]'s repetitions measured, over all of them.
struct Reps {
    wrapper_all: Vec<f64>,
    valet_all: Vec<f64>,
    lost: usize,
    wrapper_lost: usize,
    /// The slowest quit of each repetition: valet's and the wrapper's (µs).
    slowest: Vec<(f64, f64)>,
    /// Each valet quit's [`Parts`], by the agent's moments in its log; per repetition, its
    /// slowest quit's.
    parts: Vec<Parts>,
    slowest_parts: Vec<Option<Parts>>,
    /// From the first repetition: the pod-watch latency with every pod tracked, in the second
    /// the burst's Jobs start and at rest (after the idle window), idle CPU (millicores) and RSS
    /// (KiB).
    burst_watch: WatchLag,
    rest_watch: WatchLag,
    idle_mc: f64,
    rss: u64,
}

/// Section 8, a full node: the kubelet's default maximum of pods, all opted in, 50 Jobs starting
/// at once. The reference for their quits is measured on the same node: as many Jobs in the same
/// kind of burst, each app under the in-pod wrapper, beside the same long-running pods.
pub(crate) fn full_node(plan: &Plan, table: &mut Table) -> Result<()> {
    let total = plan.services + plan.jobs;
    println!("\n[8] a full node: {total} opted-in pods tracked, {} Jobs started within one second", plan.jobs);
    let node = Node::new()?;
    let agent = node.start_agent_env(&[], &[("RUST_LOG", ROUTER_LOG)])?;
    let pid = agent.pid().context("agent pid")?;
    let quiet_watch = watch_latency(&node, &agent, 0.0, 20)?;
    // Long-running pods: a service's app and its proxy, tracked the whole time.
    let t = Instant::now();
    let mut services = make_jobs(&node, "service", plan.services)?;
    for pod in &mut services {
        pod.start_app("app", &["/bin/sleep", "3600"], &SpawnOptions::default())?;
    }
    agent.wait_tracked(plan.services, Duration::from_secs(60))?;
    println!("  {} long-running pods up and tracked in {:.1} s", plan.services, t.elapsed().as_secs_f64());
    let peak_at_start = peak_rss_kib(pid);
    // Repetitions: the slowest of 50 quits is one sample, so the comparison of the slowest is
    // made again and again on the same node (the first repetition also holds the idle window).
    let mut reps = Reps {
        wrapper_all: Vec::new(),
        valet_all: Vec::new(),
        lost: 0,
        wrapper_lost: 0,
        slowest: Vec::new(),
        parts: Vec::new(),
        slowest_parts: Vec::new(),
        burst_watch: WatchLag::default(),
        rest_watch: WatchLag::default(),
        idle_mc: f64::NAN,
        rss: 0,
    };
    for rep in 0..plan.node_reps {
        node_rep(plan, &node, &agent, rep, &mut reps)?;
    }
    let w =
        report(&format!("in-pod wrapper, all {} repetitions", plan.node_reps), std::mem::take(&mut reps.wrapper_all));
    let q = report(&format!("valet, all {} repetitions", plan.node_reps), std::mem::take(&mut reps.valet_all));
    let (burst_watch, rest_watch) = (std::mem::take(&mut reps.burst_watch), std::mem::take(&mut reps.rest_watch));
    if let Some(quiet) = table.wrapper_median {
        println!("  slowest valet quit against [3]'s wrapper median (one Job at a time): {:.1}×", q.max / quiet);
    }
    let slowest = &reps.slowest;
    let slowest_met = slowest.iter().filter(|(v, w)| v <= w).count();
    let words: Vec<String> = slowest.iter().map(|(v, w)| format!("{:.2}/{:.2}", v / 1e3, w / 1e3)).collect();
    println!(
        "  slowest of {} quits, valet/wrapper (ms) per repetition: {}; valet at or below the wrapper in {slowest_met} of {}",
        plan.jobs,
        words.join(", "),
        slowest.len()
    );
    print_quit_parts(&reps, q.n);
    let peak = peak_rss_kib(pid);
    println!(
        "  agent peak RSS (VmHWM): {:.1} MiB once started (loading included), {:.1} MiB at the end",
        peak_at_start as f64 / 1024.0,
        peak as f64 / 1024.0
    );
    node_rows(plan, &reps, peak, [&q, &w], table);
    watch_row(&format!("{total} pods at rest"), &quiet_watch, &rest_watch, table);
    watch_row(&format!("{total} pods, in the second {} of them start", plan.jobs), &quiet_watch, &burst_watch, table);
    drop(services);
    Ok(())
}

/// One repetition of [8]: the wrapper's burst, then valet's (in the first, the idle window with
/// every pod tracked), their quits into `reps`.
fn node_rep(plan: &Plan, node: &Node, agent: &Agent, rep: usize, reps: &mut Reps) -> Result<()> {
    let total = plan.services + plan.jobs;
    let pid = agent.pid().context("agent pid")?;
    // The reference first: the same burst with the wrapper quitting each proxy. Its apps run
    // long enough for the kubelet to have reported them started and ready before they end,
    // as the Jobs' below have.
    let mut wrapped = Burst::start(node, &format!("wrapped-{rep}"), plan.jobs, Duration::from_secs(10), true)?;
    let (wrapper_quits, w_lost) = wrapped.quits()?;
    remove_jobs(node, wrapped.jobs);
    // The kubelet's reports of their ends (~1 s after), before the opted-in burst.
    std::thread::sleep(Duration::from_secs(2));
    // The Jobs: pods made in a burst, then every app started within one second; in the first
    // repetition each runs past the idle window.
    let settle = Duration::from_secs(8);
    let run = if rep == 0 { settle + plan.idle + Duration::from_secs(6) } else { Duration::from_secs(10) };
    let mut jobs = Burst::start(node, &format!("burst-{rep}"), plan.jobs, run, false)?;
    agent.wait_tracked(total, Duration::from_secs(30))?;
    if rep == 0 {
        println!("  {total} tracked {:.2} s after the first app", jobs.started.elapsed().as_secs_f64());
        reps.burst_watch = watch_latency(node, agent, total as f64, 20)?;
        // Idle: every proxy ready, every app running, the kubelet done reporting them (ids
        // ~1 s after the start, ready after the probes); the agent only keeps the
        // conditions current.
        std::thread::sleep(settle.saturating_sub(jobs.started.elapsed()));
        let window = plan.idle;
        reps.idle_mc = cpu_share(pid, window) * 1e3;
        reps.rss = rss_kib(pid);
        reps.rest_watch = watch_latency(node, agent, total as f64, 20)?;
        if jobs.started.elapsed() >= jobs.run {
            println!("  (the Jobs' apps ended before the idle window did: the idle figure includes their ends)");
        }
        println!(
            "  idle with {total} pods: CPU {:.2} millicores over {:.0} s, RSS {:.1} MiB ({}), {} fds",
            reps.idle_mc,
            window.as_secs_f64(),
            reps.rss as f64 / 1024.0,
            rss_parts(pid),
            open_fds(pid)
        );
    }
    // The Jobs end within the same second as they started: their quits, each split at the
    // agent's send time.
    let (timed, v_lost) = jobs.timed_quits()?;
    let quits: Vec<f64> = timed.iter().map(TimedQuit::us).collect();
    let (parts, slowest_parts) = split_quits(&timed, &agent.log_text());
    reps.parts.extend(parts);
    reps.slowest_parts.push(slowest_parts);
    remove_jobs(node, jobs.jobs);
    agent.wait_tracked(plan.services, Duration::from_secs(30))?;
    let w = report(
        &format!("repetition {}: in-pod wrapper, {} Jobs ending together", rep + 1, plan.jobs),
        wrapper_quits.clone(),
    );
    let q = report(&format!("repetition {}: valet, {} Jobs ending together", rep + 1, plan.jobs), quits.clone());
    reps.slowest.push((q.max, w.max));
    reps.wrapper_all.extend(wrapper_quits);
    reps.valet_all.extend(quits);
    reps.lost += v_lost;
    reps.wrapper_lost += w_lost;
    Ok(())
}

/// A quit's three parts (µs): the app's exit stamp → the kernel's moment of its end (the app's
/// own exit), that → the agent's write of the quit, the write → the proxy's receipt.
type Parts = (f64, f64, f64);

/// A repetition's valet quits split at the agent's moments in its log (`sidecar accepted quit ...
/// sent_ns= ended_ns=`): each quit's [`Parts`], and the slowest quit's. A quit without both
/// moments in the log is left out (and the slowest has none when it is that one).
fn split_quits(timed: &[TimedQuit], log: &str) -> (Vec<Parts>, Option<Parts>) {
    let sent = quits_sent(log);
    let ended = quits_ended(log);
    let parts = |t: &TimedQuit| {
        let (s, e) = (*sent.get(&t.pod)?, *ended.get(&t.pod)?);
        let us = |from: u64, to: u64| to.saturating_sub(from) as f64 / 1e3;
        Some((us(t.exited, e), us(e, s), us(s, t.received)))
    };
    let slowest = timed.iter().max_by(|a, b| a.us().total_cmp(&b.us()));
    (timed.iter().filter_map(parts).collect(), slowest.and_then(parts))
}

/// Where valet's quits went, over the repetitions: the median / p99 of each [`Parts`], and each
/// repetition's slowest split in three.
fn print_quit_parts(reps: &Reps, quits: usize) {
    let part = |label: &str, f: fn(&Parts) -> f64| report(label, reps.parts.iter().map(f).collect());
    let e = part("  valet: the app's exit stamp → the kernel's moment of its end", |p| p.0);
    let w = part("  valet: the kernel's moment → the agent's write of the quit", |p| p.1);
    let r = part("  valet: the agent's write → the proxy's receipt", |p| p.2);
    let each: Vec<String> = reps
        .slowest_parts
        .iter()
        .zip(&reps.slowest)
        .map(|(p, (v, _))| match p {
            Some((e, w, r)) => format!("{:.2} = {:.2} + {:.2} + {:.2}", v / 1e3, e / 1e3, w / 1e3, r / 1e3),
            None => format!("{:.2} (no moments in the log)", v / 1e3),
        })
        .collect();
    println!(
        "  valet's quits, split at the agent's moments ({} of {quits} with both in its log): the app's own exit {}, \
         the agent's write {}, the proxy's read {}; each repetition's slowest (ms) = the exit + the write + the \
         read: {}",
        reps.parts.len(),
        e.ms(),
        w.ms(),
        r.ms(),
        each.join(", ")
    );
}

/// [8]'s rows, from the repetitions, the agent's peak RSS and the quits' figures (valet's, the
/// wrapper's).
fn node_rows(plan: &Plan, reps: &Reps, peak: u64, [q, w]: [&Stats; 2], table: &mut Table) {
    let total = plan.services + plan.jobs;
    let Reps { lost, wrapper_lost, idle_mc, rss, ref slowest, .. } = *reps;
    let slowest_met = slowest.iter().filter(|(v, w)| v <= w).count();
    table.add(
        &format!("[8] agent RSS, {total} pods tracked"),
        format!("{:.1} MiB", rss as f64 / 1024.0),
        "—",
        "≤ 20 MiB",
        met(rss <= 20 * 1024).into(),
    );
    table.add(
        "[8] agent peak RSS since its start, loading included (VmHWM)",
        format!("{:.1} MiB", peak as f64 / 1024.0),
        "—",
        "≤ 24 MiB (a DaemonSet's limit must fit the peak)",
        met(peak > 0 && peak <= 24 * 1024).into(),
    );
    table.add(
        &format!("[8] agent CPU, idle with {total} pods (over {:.0} s)", plan.idle.as_secs_f64()),
        format!("{idle_mc:.2} millicores"),
        "—",
        "≤ 2 millicores",
        met(idle_mc <= 2.0).into(),
    );
    table.add(
        &format!(
            "[8] exit → quit, {} Jobs started within one second, {} repetitions (median / p99, max)",
            plan.jobs, plan.node_reps
        ),
        format!("{}, {:.2} ms; {lost} not quit", q.ms(), q.max / 1e3),
        &format!(
            "in-pod wrapper, same bursts on this node: {}, {:.2} ms; {wrapper_lost} not quit",
            w.ms(),
            w.max / 1e3
        ),
        "≤ 1.0× wrapper: the median, and the slowest of each repetition",
        format!(
            "median {:.2}×; slowest at or below the wrapper's in {slowest_met} of {}: {}",
            q.median / w.median,
            slowest.len(),
            met(lost == 0 && q.median <= w.median && slowest_met == slowest.len())
        ),
    );
}

/// [8]'s pod-watch row: the latency with no pods and with `total` (until the pod's event reached
/// the agent's router, by its log), and where the difference goes ([`watch_split`]).
fn watch_row(with: &str, quiet: &WatchLag, full: &WatchLag, table: &mut Table) {
    let split = watch_split(("no pods", "full"), with, quiet, full);
    table.add(
        &format!("[8] pod-watch latency with {with}, to the agent's router by its log (median / p99)"),
        split.latency,
        &split.reference,
        "no lag (≤ 1.2× no pods), or a measurement that puts the difference outside the agent",
        split.verdict,
    );
}

/// Section 10, observe mode on a full node: as many pods as [8], a tenth of them opted in and the
/// rest only observed (the observer's own watch of every pod, its records, and one readiness
/// probe per app the API showed started before its proxy was reported ready), every app running.
/// The agent's RSS and idle CPU against [8]'s targets, beside the same node with observation off.
pub(crate) fn observed_node(plan: &Plan, table: &mut Table) -> Result<()> {
    let total = plan.services + plan.jobs;
    let labelled = total / 10;
    println!("\n[10] observe mode on a full node: {total} pods, {labelled} opted in, the rest only observed");
    let (off_rss, off_mc) = observed_idle(plan, total, labelled, false)?;
    let (rss, idle_mc) = observed_idle(plan, total, labelled, true)?;
    let mib = |kib: u64| kib as f64 / 1024.0;
    table.add(
        &format!("[10] agent RSS, {total} pods observed, {labelled} of them tracked"),
        format!("{:.1} MiB", mib(rss)),
        &format!("observation off, same pods: {:.1} MiB", mib(off_rss)),
        "≤ 20 MiB",
        met(rss <= 20 * 1024).into(),
    );
    table.add(
        &format!("[10] agent CPU, idle with {total} pods observed (over {:.0} s)", plan.idle.as_secs_f64()),
        format!("{idle_mc:.2} millicores"),
        &format!("observation off, same pods: {off_mc:.2} millicores"),
        "≤ 2 millicores",
        met(idle_mc <= 2.0).into(),
    );
    Ok(())
}

/// One agent on a new node with `total` pods, `labelled` of them opted in, every app running:
/// its RSS (KiB) and idle CPU (millicores) once the kubelet has reported the apps started.
pub(crate) fn observed_idle(plan: &Plan, total: usize, labelled: usize, observe: bool) -> Result<(u64, f64)> {
    let node = Node::new()?;
    let agent = node.start_agent(if observe { &[] } else { &["--observe=false"] })?;
    let pid = agent.pid().context("agent pid")?;
    let t = Instant::now();
    let mut pods = make_pods(&node, "observed", total - labelled, false)?;
    pods.extend(make_pods(&node, "service", labelled, true)?);
    for pod in &mut pods {
        pod.start_app("app", &["/bin/sleep", "3600"], &SpawnOptions::default())?;
    }
    agent.wait_tracked(labelled, Duration::from_secs(60))?;
    let want = if observe { total } else { 0 };
    if !eventually(Duration::from_secs(60), || agent.metric("valet_pods_observed ") as usize == want) {
        bail!("the agent observes {} pods, want {want}:\n{}", agent.metric("valet_pods_observed "), agent.log_text());
    }
    // Idle: the kubelet has reported every app started (about a second after), and the observer
    // has asked the proxies it had to; the agent keeps the opted-in pods' conditions current.
    std::thread::sleep(Duration::from_secs(3));
    let idle_mc = cpu_share(pid, plan.idle) * 1e3;
    let rss = rss_kib(pid);
    let races: u64 = agent
        .metrics_text()
        .unwrap_or_default()
        .lines()
        .filter(|l| l.starts_with("valet_app_started_before_proxy_ready_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .map(|v| v as u64)
        .sum();
    println!(
        "  observation {}: {total} pods up in {:.1} s; idle CPU {idle_mc:.2} millicores over {:.0} s, RSS {:.1} MiB, \
         {} fds; {races} apps counted started before their proxy was ready",
        if observe { "on" } else { "off" },
        t.elapsed().as_secs_f64(),
        plan.idle.as_secs_f64(),
        rss as f64 / 1024.0,
        open_fds(pid)
    );
    remove_jobs(&node, pods);
    Ok((rss, idle_mc))
}

#[cfg(test)]
mod tests {
    use super::{TimedQuit, split_quits};

    #[test]
    fn a_bursts_quits_split_at_the_agents_moments() {
        let log = "2026-12-06T22:00:00.000001Z  INFO valet_agent::pod::state::ending: sidecar accepted quit \
                   pod=jobs/burst-0-a sidecar=istio-proxy status=200 attempts=1 quit_after_us=9 sent_ns=1300000 \
                   ended_ns=1100000\n\
                   2026-12-06T22:00:00.000002Z  INFO valet_agent::pod::state::ending: sidecar accepted quit \
                   pod=jobs/burst-0-b sidecar=istio-proxy status=200 attempts=1 sent_ns=2100000 ended_ns=2050000\n\
                   2026-12-06T22:00:00.000003Z  INFO valet_agent::pod::state::ending: sidecar accepted quit \
                   pod=jobs/burst-0-c sidecar=istio-proxy status=200 attempts=1 sent_ns=3050000\n";
        let quit = |pod: &str, exited: u64, received: u64| TimedQuit { pod: pod.into(), exited, received };
        let timed = [
            quit("burst-0-a", 1_000_000, 1_500_000),
            quit("burst-0-b", 2_000_000, 4_000_000),
            quit("burst-0-c", 3_000_000, 3_100_000),
            quit("burst-0-d", 3_000_000, 3_200_000),
        ];
        let (parts, slowest) = split_quits(&timed, log);
        assert_eq!(
            parts,
            [(100.0, 200.0, 200.0), (50.0, 50.0, 1900.0)],
            "a quit without both moments in the log has no parts"
        );
        assert_eq!(slowest, Some((50.0, 50.0, 1900.0)), "the slowest quit is b's (2 ms)");
        let (_, slowest) = split_quits(&timed[..2], "");
        assert_eq!(slowest, None, "no moments in the log: no parts");
    }
}
