//! [4s] a release on a saturated node: [4]'s rows of the stand-in proxy (readiness flips, and
//! listening late) again, with a busy loop on every CPU beside them (nodes are often busy when
//! Jobs start). The loops are ordinary processes (SCHED_OTHER, nice 0) outside the held pods,
//! started before the round and killed after it; the bench's own stand-ins, ready poller and app
//! compete with them as the agent does. Beside the rows: how long each of the agent's threads
//! waited for a CPU in the round (the kernel's schedstat), to tell which of them the loops held up.
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};
use valet_tests::harness::Node;

#[allow(clippy::wildcard_imports, reason = "the bench's parts share one namespace")]
use super::*;

/// The targets for a release on a saturated node (#53).
const MEDIAN_TARGET_US: f64 = 25_000.0;
const P99_TARGET_US: f64 = 100_000.0;

/// One busy loop per CPU, killed when dropped.
struct Hogs(Vec<Child>);

impl Hogs {
    fn start() -> Result<Hogs> {
        let cpus = std::thread::available_parallelism().map_or(1, usize::from);
        let mut hogs = Hogs(Vec::with_capacity(cpus));
        for _ in 0..cpus {
            // `chrt --other 0`: SCHED_OTHER whatever the bench runs in; the niceness is the
            // bench's, checked below.
            let child = Command::new("chrt")
                .args(["--other", "0", "/bin/sh", "-c", "while :; do :; done"])
                .stdin(Stdio::null())
                .spawn()
                .context("start a busy loop (chrt, sh)")?;
            hogs.0.push(child);
        }
        std::thread::sleep(Duration::from_millis(200));
        for c in &hogs.0 {
            let (policy, nice) = policy_nice(c.id()).context("a busy loop's /proc stat")?;
            anyhow::ensure!(policy == 0 && nice == 0, "busy loop {}: policy {policy}, nice {nice}", c.id());
        }
        println!("  {cpus} busy loops (SCHED_OTHER, nice 0) started");
        Ok(hogs)
    }
}

impl Drop for Hogs {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// The change of [`thread_waits`] from `before` to `after`, one line per thread name that ran.
pub(crate) fn waits_line(before: &Waits, after: &Waits) -> String {
    let mut words = Vec::new();
    for (name, &(cpu, wait, runs, policy)) in after {
        let (c0, w0, r0, _) = before.get(name).copied().unwrap_or_default();
        if cpu > c0 {
            let class = if policy == 1 { " FIFO" } else { "" };
            let (wait, runs) = (wait.saturating_sub(w0) as f64, runs.saturating_sub(r0).max(1) as f64);
            words.push(format!(
                "{name}{class} {:.1} ms CPU, {:.1} ms waiting for a CPU ({:.0} µs a run)",
                (cpu - c0) as f64 / 1e6,
                wait / 1e6,
                wait / runs / 1e3
            ));
        }
    }
    words.join("; ")
}

/// Section [4s].
pub(crate) fn saturated_release(plan: &Plan, table: &mut Table) -> Result<()> {
    let runs = plan.release_runs;
    println!("\n[4s] proxy ready → held app runs on a saturated node ({runs} pods each, a busy loop on every CPU)");
    let mut draw = Draw::from_env();
    let node = Node::new()?;
    let agent = node.start_agent(&[])?;
    let pid = agent.pid().context("agent pid")?;
    let variants = [
        (Proxy::Flips, "listening from the start, readiness flips", "the bench's flip of the ready file"),
        (Proxy::ListensLate, "stand-in starts listening late", "the bench's poller's first 200 (1 ms apart)"),
    ];
    let trace = SignalTrace::start().map_err(|e| println!("  (SIGCONT times not traced: {e:#})")).ok();
    for (proxy, what, ready) in variants {
        let t = Instant::now();
        let (mut samples, mut signalled, mut polled) = (Vec::new(), Vec::new(), Vec::new());
        let before = thread_waits(pid);
        let hogs = Hogs::start()?;
        for i in 0..runs {
            let _ = trace.as_ref().map(SignalTrace::sent);
            let r = held_release(&node, &agent, (proxy, "1000"), draw.uniform(READY_WINDOW), i)?;
            samples.push(r.us);
            if let Some(sent) = trace.as_ref().and_then(|t| t.sent().get(&r.pid).copied()) {
                signalled.push((sent as f64 - r.ready_at as f64) / 1000.0);
            }
            polled.push(reference(&node, &agent, &mut draw, i)?);
        }
        drop(hogs);
        let waits = waits_line(&before, &thread_waits(pid));
        let s = report(&format!("valet, {what}, saturated"), samples);
        let g = report("  of it: SIGCONT sent (the kernel's signal_generate)", signalled);
        let r = report("  reference beside it: pilot-agent wait (500 ms polling)", polled);
        println!(
            "  ({what}, saturated: {:.0} s)\n  the agent's threads in the round: {waits}",
            t.elapsed().as_secs_f64()
        );
        let ok = s.median <= MEDIAN_TARGET_US && s.p99 <= P99_TARGET_US;
        table.add(
            &format!(
                "[4s] proxy ready → held app runs, {what}, a busy loop on each CPU (median / p99, n={}): from {ready} \
                 to the app's first instruction; the stand-ins, the poller and the app compete with the loops too",
                s.n
            ),
            s.ms(),
            &format!("`pilot-agent wait` (500 ms poll), same loops {}", r.ms()),
            "median ≤ 25 ms, p99 ≤ 100 ms",
            format!("{}: {}", against(s.median, r.median), met(ok)),
        );
        table.add(
            &format!("[4s] … of it, the agent's part: SIGCONT sent after the ready moment (median / p99, n={})", g.n),
            g.ms(),
            "—",
            "—",
            "the app's own wait for a CPU after it is the rest".into(),
        );
    }
    Ok(())
}
