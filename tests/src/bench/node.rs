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
    // The Jobs end within the same second as they started: their quits.
    let (quits, v_lost) = jobs.quits()?;
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
/// the agent's router, by its log), and where the difference goes: the API stand-in's own
/// delivery (a bare watch client's receipt) and what is left, the agent's own receipt; beside it,
/// the bench's earlier figure, read from the agent's count on `/metrics` back to back.
fn watch_row(with: &str, quiet: &WatchLag, full: &WatchLag, table: &mut Table) {
    let own = |l: &WatchLag| l.logged.iter().zip(&l.api).map(|(a, b)| a - b).collect::<Vec<f64>>();
    let qw = report("pod-watch latency, no pods", quiet.logged.clone());
    let fw = report(&format!("pod-watch latency, {with}"), full.logged.clone());
    let qa = report("  the API stand-in's delivery to a bare watch, no pods", quiet.api.clone());
    let fa = report("  the API stand-in's delivery to a bare watch, full", full.api.clone());
    let qo = report("  the agent's part (latency less the bare watch's), no pods", own(quiet));
    let fo = report("  the agent's part (latency less the bare watch's), full", own(full));
    let qm = report("  read from the agent's count on /metrics back to back, no pods", quiet.agent.clone());
    let fm = report("  read from the agent's count on /metrics back to back, full", full.agent.clone());
    let qs = report("  one read of the agent's /metrics, no pods", quiet.scrape.clone());
    let fs = report("  one read of the agent's /metrics, full", full.scrape.clone());
    println!(
        "  the agent over the samples read from its log, per sample: CPU {:.0} / {:.0} µs, its threads waiting for a \
         CPU {:.0} / {:.0} µs (no pods / {with})\n  no pods: {}\n  {with}: {}",
        quiet.cpu, full.cpu, quiet.waited, full.waited, quiet.threads, full.threads
    );
    let ratio = fw.median / qw.median;
    let own_ratio = fo.median / qo.median;
    table.add(
        &format!("[8] pod-watch latency with {with}, to the agent's router by its log (median / p99)"),
        fw.ms(),
        &format!(
            "no pods {}; of it (medians, no pods / full): the API stand-in's delivery to a bare watch client \
             {:.2} / {:.2} ms, the rest (the agent's receipt) {:.2} / {:.2} ms; per sample, the agent's CPU \
             {:.0} / {:.0} µs and its threads' wait for a CPU {:.0} / {:.0} µs; read from its count on /metrics \
             back to back instead, {:.2} / {:.2} ms ({:.2}×), one read {:.2} / {:.2} ms",
            qw.ms(),
            qa.median / 1e3,
            fa.median / 1e3,
            qo.median / 1e3,
            fo.median / 1e3,
            quiet.cpu,
            full.cpu,
            quiet.waited,
            full.waited,
            qm.median / 1e3,
            fm.median / 1e3,
            fm.median / qm.median,
            qs.median / 1e3,
            fs.median / 1e3,
        ),
        "no lag (≤ 1.2× no pods), or a measurement that puts the difference outside the agent",
        format!("{ratio:.2}×; the rest alone {own_ratio:.2}×: {}", met(ratio <= 1.2 || own_ratio <= 1.2)),
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
