//! [4s] a release on a saturated node: [4]'s rows of the stand-in proxy (readiness flips, and
//! listening late) again, with a busy loop on every CPU beside them (nodes are often busy when
//! Jobs start). The loops are ordinary processes (SCHED_OTHER, nice 0) outside the held pods,
//! started before the round and killed after it; the bench's own stand-ins, ready poller and app
//! compete with them as the agent does. Beside the rows: how long each of the agent's threads
//! waited for a CPU in the round (the kernel's schedstat), to tell which of them the loops held up.
use std::collections::BTreeMap;
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

/// A task's scheduling policy and niceness, from `/proc/<pid>/stat` (fields 41 and 19).
fn policy_nice(pid: u32) -> Option<(i64, i64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    // `rest[0]` is field 3 (the state).
    Some((rest.get(38)?.parse().ok()?, rest.get(16)?.parse().ok()?))
}

/// Per thread name of process `pid`: CPU time and time waiting on a run queue (ns), the times
/// it ran, and the policy of the last thread of that name seen (0 normal, 1 FIFO).
type Waits = BTreeMap<String, (u64, u64, u64, i64)>;

fn thread_waits(pid: u32) -> Waits {
    let mut out = Waits::new();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return out };
    for task in tasks.flatten() {
        let dir = task.path();
        let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default().trim().to_owned();
        let sched = std::fs::read_to_string(dir.join("schedstat")).unwrap_or_default();
        let mut f = sched.split_whitespace().map(|v| v.parse::<u64>().unwrap_or(0));
        let (cpu, wait, runs) = (f.next().unwrap_or(0), f.next().unwrap_or(0), f.next().unwrap_or(0));
        let tid = dir.file_name().and_then(|n| n.to_str()?.parse().ok()).unwrap_or(0);
        let policy = policy_nice(tid).map_or(-1, |(p, _)| p);
        let e = out.entry(comm).or_default();
        e.0 += cpu;
        e.1 += wait;
        e.2 += runs;
        e.3 = policy;
    }
    out
}

/// The change of [`thread_waits`] from `before` to `after`, one line per thread name that ran.
fn waits_line(before: &Waits, after: &Waits) -> String {
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
    for (proxy, what, ready) in variants {
        let t = Instant::now();
        let (mut samples, mut polled) = (Vec::with_capacity(runs), Vec::with_capacity(runs));
        let before = thread_waits(pid);
        let hogs = Hogs::start()?;
        for i in 0..runs {
            samples.push(held_release(&node, &agent, proxy, draw.uniform(READY_WINDOW), i)?.0);
            polled.push(reference(&node, &agent, &mut draw, i)?);
        }
        drop(hogs);
        let waits = waits_line(&before, &thread_waits(pid));
        let s = report(&format!("valet, {what}, saturated"), samples);
        let r = report("  reference beside it: pilot-agent wait (500 ms polling)", polled);
        println!("  ({what}, saturated: {:.0} s)\n  the agent's threads in the round: {waits}", t.elapsed().as_secs_f64());
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
    }
    Ok(())
}
