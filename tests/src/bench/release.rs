use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use valet_agent::kernel::events::monotonic_ns;
use valet_sim::node::SpawnOptions;
use valet_tests::harness::{JobSpec, Node, eventually};

#[allow(clippy::wildcard_imports)]
use super::*;

/// 4. Proxy ready → held app released.
pub(crate) fn release_latency(runs: usize, table: &mut Table) -> Result<()> {
    println!("\n[4] proxy ready → held app released ({runs} pods)");
    let app = bin("valet-bench-app")?;
    let app = app.to_str().context("path")?.to_owned();
    let node = Node::new()?;
    let agent = node.start_agent(&[])?;
    let mut samples = Vec::new();
    for i in 0..runs {
        let ready = node.scratch.path(&format!("ready-{i}"));
        let mut spec = JobSpec::new("bench-hold").annotation("valet.dev/hold-app", "true");
        spec.ready_file = Some(ready.clone());
        let mut job = node.job_pod(spec)?;
        agent.wait_tracked(1, Duration::from_secs(5))?;
        let stamp = node.scratch.path(&format!("ran-{i}"));
        let stamp_s = stamp.to_str().context("path")?.to_owned();
        let pid = job.start_app("app", &[&app, &stamp_s, "0"], &SpawnOptions::default())?.host_pid();
        // Wait until the kernel stopped it (state T); it cannot have run.
        let held = eventually(Duration::from_secs(5), || stopped(pid));
        if !held || stamp.exists() {
            bail!("run {i}: app was not held\n{}", agent.log_text());
        }
        let t_ready = monotonic_ns();
        std::fs::write(&ready, b"")?;
        if !eventually(Duration::from_secs(5), || read_stamp(&stamp).is_some()) {
            bail!("run {i}: app not released\n{}", agent.log_text());
        }
        let ran = read_stamp(&stamp).context("stamp")?;
        samples.push(ran.saturating_sub(t_ready) as f64 / 1000.0);
        node.api.delete_pod("jobs", &job.name).ok();
        drop(job);
        agent.wait_tracked(0, Duration::from_secs(5))?;
    }
    let m = report("valet: held app runs after its proxy is ready", samples);

    // The reference, measured here against the same stand-in: Istio's holdApplicationUntilProxyStarts
    // (`pilot-agent wait` polling the readiness endpoint every 500 ms, then the app starts).
    let poller = bin("valet-bench-poller")?;
    let poller = poller.to_str().context("path")?.to_owned();
    let poll_runs = (runs / 2).clamp(10, 30);
    let mut polled = Vec::new();
    for i in 0..poll_runs {
        let ready = node.scratch.path(&format!("poll-ready-{i}"));
        let mut spec = JobSpec::new("bench-poll");
        spec.labelled = false;
        spec.ready_file = Some(ready.clone());
        let mut job = node.job_pod(spec)?;
        let stamp = node.scratch.path(&format!("polled-{i}"));
        let stamp_s = stamp.to_str().context("path")?.to_owned();
        job.start_app(
            "app",
            &[&poller, "15021", "/healthz/ready", "500", "--", &app, &stamp_s, "0"],
            &SpawnOptions::default(),
        )?;
        // The proxy turns ready at a point of the poll period that varies from run to run.
        std::thread::sleep(Duration::from_millis(200 + (i as u64 * 137) % 500));
        let t_ready = monotonic_ns();
        std::fs::write(&ready, b"")?;
        if !eventually(Duration::from_secs(5), || read_stamp(&stamp).is_some()) {
            bail!("poll run {i}: app never started");
        }
        let ran = read_stamp(&stamp).context("stamp")?;
        polled.push(ran.saturating_sub(t_ready) as f64 / 1000.0);
        node.api.delete_pod("jobs", &job.name).ok();
        drop(job);
    }
    let r = report("reference: pilot-agent wait (500 ms polling)", polled);
    table.add(
        "[4] proxy ready → held app runs, one pod (median / p99)",
        m.ms(),
        &format!("`pilot-agent wait` (500 ms poll) {}", r.ms()),
        "—",
        format!("1/{:.0} of the reference", r.median / m.median),
    );
    Ok(())
}
