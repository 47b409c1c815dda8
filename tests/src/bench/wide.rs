use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};
use valet_sim::node::SpawnOptions;
use valet_tests::harness::Node;

#[allow(clippy::wildcard_imports, reason = "the bench's parts share one namespace")]
use super::*;

/// The most pods some providers allow a node (the kubelet's `--max-pods`), beyond its default 110.
pub(crate) const MAX_PODS: usize = 250;

/// Section 12, a node at 250 pods: every one opted in, its app running; the agent's RSS, its peak
/// RSS since its start, and its idle CPU once the kubelet has reported every app started.
pub(crate) fn widest_node(plan: &Plan, table: &mut Table) -> Result<()> {
    let pods = if plan.quick { 40 } else { MAX_PODS };
    println!("\n[12] a node at {pods} pods, all opted in, every app running");
    let node = Node::new()?;
    let agent = node.start_agent(&[])?;
    let pid = agent.pid().context("agent pid")?;
    let t = Instant::now();
    let mut services = make_jobs(&node, "wide", pods)?;
    for pod in &mut services {
        pod.start_app("app", &["/bin/sleep", "3600"], &SpawnOptions::default())?;
    }
    agent.wait_tracked(pods, Duration::from_secs(300))?;
    println!("  {pods} pods up and tracked in {:.1} s", t.elapsed().as_secs_f64());
    // Idle: the kubelet has reported every app started and every proxy ready, and the agent has
    // written the conditions; it keeps them current, one probe round per interval.
    wait_at_rest(&node, &services)?;
    let idle_mc = cpu_share(pid, plan.idle) * 1e3;
    let (rss, peak) = (rss_kib(pid), peak_rss_kib(pid));
    println!(
        "  idle with {pods} pods: CPU {idle_mc:.2} millicores over {:.0} s, RSS {:.1} MiB ({}; peak {:.1} MiB), {} fds",
        plan.idle.as_secs_f64(),
        rss as f64 / 1024.0,
        rss_parts(pid),
        peak as f64 / 1024.0,
        open_fds(pid)
    );
    remove_jobs(&node, services);
    let mib = |kib: u64| kib as f64 / 1024.0;
    table.add(
        &format!("[12] agent RSS, {pods} pods tracked (peak since its start)"),
        format!("{:.1} MiB ({:.1} MiB)", mib(rss), mib(peak)),
        "—",
        "≤ 24 MiB",
        met(rss > 0 && rss <= 24 * 1024).into(),
    );
    table.add(
        &format!("[12] agent CPU, idle with {pods} pods (over {:.0} s)", plan.idle.as_secs_f64()),
        format!("{idle_mc:.2} millicores"),
        "—",
        "≤ 3 millicores",
        met(idle_mc <= 3.0).into(),
    );
    Ok(())
}
