//! [5]'s agent stall: many container ends while the agent is stopped (SIGSTOP, as CPU throttling
//! under its limit or a paused process would stop it), with the kubelet's reports of them held
//! past the stall, so that only the kernel path (the ring buffer) can carry them in time.
use std::collections::HashMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use valet_agent::host::clock::monotonic_ns;
use valet_sim::node::SpawnOptions;
use valet_tests::harness::{Agent, JobPod, Node};

#[allow(clippy::wildcard_imports, reason = "the bench's parts share one namespace")]
use super::*;

/// How long the API's reports of the ends are held after the agent resumed: a quit later than
/// this may have come from the API's report, so it counts as an end the kernel path lost.
const REPORTS_AFTER_RESUME: Duration = Duration::from_secs(5);
/// How long each app runs: it starts and ends within the stall.
const APP_MS: u64 = 100;

pub(crate) struct Stalled {
    /// Apps that ended while the agent was stopped.
    pub(crate) ends: usize,
    /// From the SIGCONT to each quit the proxy received before the API's reports (µs).
    pub(crate) after_resume: Vec<f64>,
    /// From the SIGCONT to the agent's write of each of those quits (µs), from its log.
    pub(crate) sent_after_resume: Vec<f64>,
    /// Quits received whose send time the agent's log does not give.
    pub(crate) unsent: usize,
    /// Ends whose quit did not come before the API's reports.
    pub(crate) lost: usize,
    /// `valet_kernel_events_lost_total` across the stall.
    pub(crate) events_lost: f64,
    /// Ends the agent named by the kubelet's log link of their id (it never saw them start).
    pub(crate) named_by_link: usize,
    /// Whether the SIGCONT's time is the kernel's (`signal:signal_generate`), not ours.
    pub(crate) traced: bool,
    /// When the agent was let go on.
    pub(crate) resumed_at: Instant,
    /// The ring buffer's size and what one end takes in it (bytes).
    pub(crate) ring_bytes: u64,
    pub(crate) end_bytes: u64,
}

impl Stalled {
    pub(crate) fn ring_capacity(&self) -> u64 {
        self.ring_bytes / self.end_bytes
    }
}

/// The agent's line for an end it named by the kubelet's log link.
const NAMED_BY_LINK: &str = "named by the kubelet's log link";

/// `n` Jobs made and tracked, then the agent is stopped for `stall` while every one of their
/// apps ends; with `start_in_stall` the apps also start while it is stopped (Jobs shorter than
/// the stall), else they start before it (the agent saw them start). `tracked` pods are tracked
/// besides them.
pub(crate) fn stall_ends(
    node: &Node,
    agent: &Agent,
    n: usize,
    stall: Duration,
    start_in_stall: bool,
    tracked: usize,
) -> Result<Stalled> {
    let app = bin("valet-bench-app")?;
    let app = app.to_str().context("path")?.to_owned();
    let pid = agent.pid().context("agent pid")?;
    // An exit event in the ring buffer: the record and its 8-byte header, rounded up to 8 bytes
    // (BPF_RINGBUF_HDR_SZ). The size is the agent's own map's, read from the kernel.
    let end_bytes = (std::mem::size_of::<valet_common::ExitRecord>() as u64 + 8).next_multiple_of(8);
    let ring_bytes =
        map_max_entries(pid, valet_common::MAP_EVENTS).map_or(u64::from(valet_common::EVENTS_RING_BYTES), u64::from);
    let t = Instant::now();
    let mut jobs = make_jobs(node, "stalled", n)?;
    agent.wait_tracked(tracked + n, Duration::from_secs(60))?;
    println!("  {n} Jobs for the stall made and tracked in {:.1} s", t.elapsed().as_secs_f64());
    let trace = SignalTrace::start().map_err(|e| println!("  (the SIGCONT's time not traced: {e:#})")).ok();
    if let Some(trace) = &trace {
        trace.sent();
    }
    let lost_before = agent.metric("valet_kernel_events_lost_total ");
    let named_before = agent.log_text().matches(NAMED_BY_LINK).count();
    let stop = stop_while_apps_end(node, &mut jobs, &app, pid, stall, start_in_stall)?;
    let resumed = trace.as_ref().and_then(|t| t.sent().get(&pid).copied());
    let traced = resumed.is_some();
    let resumed = resumed.unwrap_or(stop.resumed_here);
    println!(
        "  agent stopped {:.2} s; {n} apps started in {:.2} s, {} the stop",
        resumed.saturating_sub(stop.stopped_ns) as f64 / 1e9,
        stop.all_started.as_secs_f64(),
        if start_in_stall { "after" } else { "before" }
    );
    let reports_ns = stop.stopped_ns + (stall + REPORTS_AFTER_RESUME).as_nanos() as u64;
    let (mut after_resume, mut lost, mut ends) = (Vec::new(), Vec::new(), 0);
    for (i, (job, stamp)) in jobs.iter_mut().zip(&stop.stamps).enumerate() {
        let Some(ended) = read_stamp(stamp) else { bail!("stalled app {i} left no stamp") };
        if ended >= resumed || ended <= stop.stopped_ns {
            bail!("stalled app {i} ended outside the stall");
        }
        ends += 1;
        let left = Duration::from_nanos(reports_ns.saturating_sub(monotonic_ns()));
        let _ = job.wait_proxy_exit(left)?;
        match job.quits().first() {
            Some(q) if q.mono_ns < reports_ns => after_resume.push(q.mono_ns.saturating_sub(resumed) as f64 / 1e3),
            _ => lost.push(i),
        }
    }
    let (sent_after_resume, unsent) = send_times(agent, &jobs, reports_ns, resumed);
    let events_lost = agent.metric("valet_kernel_events_lost_total ") - lost_before;
    let named_by_link = agent.log_text().matches(NAMED_BY_LINK).count().saturating_sub(named_before);
    if !lost.is_empty() {
        late_quits(&mut jobs, &lost)?;
    }
    let lost = lost.len();
    remove_jobs(node, jobs);
    agent.wait_tracked(tracked, Duration::from_secs(60))?;
    Ok(Stalled {
        ends,
        after_resume,
        sent_after_resume,
        unsent,
        lost,
        events_lost,
        named_by_link,
        traced,
        resumed_at: stop.resumed_at,
        ring_bytes,
        end_bytes,
    })
}

/// The agent's stop: when it began (ns), when it ended (ours: `Instant` and ns), how long the
/// apps took to start, and each app's stamp (written as it ends).
struct Stop {
    stamps: Vec<PathBuf>,
    stopped_ns: u64,
    resumed_at: Instant,
    resumed_here: u64,
    all_started: Duration,
}

/// Starts every Job's app (before or after the stop) and stops the agent (SIGSTOP) for `stall`,
/// the API's reports of the ends held past it; the agent is always let go on (SIGCONT).
fn stop_while_apps_end(
    node: &Node,
    jobs: &mut [JobPod],
    app: &str,
    pid: u32,
    stall: Duration,
    start_in_stall: bool,
) -> Result<Stop> {
    let n = jobs.len();
    let stop = || {
        // SAFETY: plain syscall on our own child.
        unsafe { libc::kill(pid as i32, libc::SIGSTOP) };
        (Instant::now(), monotonic_ns())
    };
    // Started before the stall, the apps end at moments spread over 2 s from `budget` after
    // the first start: the stop comes once all are started, before the first end.
    let launch = Instant::now();
    let budget = Duration::from_millis(1_000 + 15 * n as u64);
    let (mut stopped_at, mut stopped_ns) = (launch, 0);
    if start_in_stall {
        (stopped_at, stopped_ns) = stop();
        node.kubelet.hold_status_writes(stopped_at + stall + REPORTS_AFTER_RESUME);
    }
    let mut stamps = Vec::with_capacity(n);
    let mut started = Ok(());
    for (i, job) in jobs.iter_mut().enumerate() {
        let run = if start_in_stall {
            Duration::from_millis(APP_MS)
        } else {
            (budget + Duration::from_secs(2).mul_f64(i as f64 / n as f64)).saturating_sub(launch.elapsed())
        };
        // The last app must end well inside the stall (or start before its end is due).
        if (start_in_stall && stopped_at.elapsed() + run + Duration::from_millis(500) > stall)
            || (!start_in_stall && launch.elapsed() + Duration::from_millis(200) > budget)
        {
            started = Err(anyhow::anyhow!("only {i} of {n} apps started in time for the {stall:?} stall"));
            break;
        }
        let stamp = node.scratch.path(&format!("stalled-{start_in_stall}-{i}"));
        let stamp_s = stamp.to_str().context("path")?.to_owned();
        let run_ms = run.as_millis().to_string();
        if let Err(e) = job.start_app("app", &[app, &stamp_s, "0", &run_ms], &SpawnOptions::default()) {
            started = Err(e);
            break;
        }
        stamps.push(stamp);
    }
    let all_started = launch.elapsed();
    if !start_in_stall && started.is_ok() {
        (stopped_at, stopped_ns) = stop();
        node.kubelet.hold_status_writes(stopped_at + stall + REPORTS_AFTER_RESUME);
    }
    std::thread::sleep(stall.saturating_sub(stopped_at.elapsed()));
    let (resumed_at, resumed_here) = (Instant::now(), monotonic_ns());
    // SAFETY: as above; the agent is never left stopped.
    unsafe { libc::kill(pid as i32, libc::SIGCONT) };
    started?;
    Ok(Stop { stamps, stopped_ns, resumed_at, resumed_here, all_started })
}

/// The agent's own send times of the quits the proxies received before the API's reports, from
/// the agent's resume (µs), and how many of those have none in its log. A send time is logged
/// when the agent has read the answer and its loop has taken the outcome in, which may come after
/// the proxy exited: the log is read again until every quit a proxy received has its send time,
/// or 5 s passed.
fn send_times(agent: &Agent, jobs: &[JobPod], reports_ns: u64, resumed: u64) -> (Vec<f64>, usize) {
    let received: Vec<String> = jobs
        .iter()
        .filter(|job| job.quits().first().is_some_and(|q| q.mono_ns < reports_ns))
        .map(|job| job.name.clone())
        .collect();
    let uids: HashMap<&str, &str> =
        jobs.iter().map(|job| (job.name.as_str(), job.json["metadata"]["uid"].as_str().unwrap_or_default())).collect();
    let logged = Instant::now() + Duration::from_secs(5);
    let (log, sent) = loop {
        let log = agent.log_text();
        let sent = quits_sent(&log);
        let all = received.iter().all(|name| sent.contains_key(name) || sent.contains_key(uids[name.as_str()]));
        if all || Instant::now() > logged {
            break (log, sent);
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut sent_after_resume = Vec::new();
    let mut unsent = 0;
    for job in jobs {
        let uid = job.json["metadata"]["uid"].as_str().unwrap_or_default();
        match (job.quits().first(), sent.get(&job.name).or_else(|| sent.get(uid))) {
            (Some(q), Some(&at)) if q.mono_ns < reports_ns => {
                sent_after_resume.push((at as f64 - resumed as f64) / 1e3);
            }
            (Some(q), None) if q.mono_ns < reports_ns => {
                unsent += 1;
                if unsent == 1 {
                    println!("  a quit received with no send time in the agent's log, pod {}; its lines:", job.name);
                    for line in log.lines().filter(|l| l.contains(&job.name) || (!uid.is_empty() && l.contains(uid))) {
                        println!("    {line}");
                    }
                }
            }
            _ => {}
        }
    }
    (sent_after_resume, unsent)
}

/// Whether the API's late reports bring the lost ends' quits at all: printed.
fn late_quits(jobs: &mut [JobPod], lost: &[usize]) -> Result<()> {
    let until = Instant::now() + REPORTS_AFTER_RESUME;
    let mut late = 0;
    for &i in lost {
        if jobs[i].wait_proxy_exit(until.saturating_duration_since(Instant::now()))?.is_some() {
            late += 1;
        }
    }
    println!("  of the {} ends the kernel path lost, {late} were quit within 5 s of the API's reports", lost.len());
    Ok(())
}

/// The agent's send time (CLOCK_MONOTONIC ns) of each quit, from its log: by pod name from the
/// `sidecar accepted quit` lines (`pod=<namespace>/<name>`, `sent_ns=<ns>`), and by pod uid from
/// the `quit sent ahead, its answer not read` ones (`uid=<uid>`), a quit the event reader sent
/// whose pod ended before the answer was read.
pub(crate) fn quits_sent(log: &str) -> HashMap<String, u64> {
    quit_moments(log, "sent_ns=")
}

/// The kernel's moment (CLOCK_MONOTONIC ns) of the app's end each quit was for (`ended_ns=`), by
/// pod name from the agent's `sidecar accepted quit` lines.
pub(crate) fn quits_ended(log: &str) -> HashMap<String, u64> {
    quit_moments(log, "ended_ns=")
}

/// A moment (`key`, ns; 0 is none) of the agent's quit lines ([`quits_sent`]), by pod name or
/// uid.
fn quit_moments(log: &str, key: &str) -> HashMap<String, u64> {
    log.lines()
        .filter(|l| l.contains("sidecar accepted quit") || l.contains("quit sent ahead, its answer not read"))
        .filter_map(|l| {
            let field = |key: &str| l.split_whitespace().find_map(|w| w.strip_prefix(key));
            let pod = match field("pod=") {
                Some(pod) => pod.rsplit('/').next()?.to_string(),
                None => field("uid=")?.to_string(),
            };
            let at: u64 = field(key)?.parse().ok()?;
            (at > 0).then_some((pod, at))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #[test]
    fn send_times_come_from_the_accepted_quits_lines() {
        let log = "2026-11-29T08:00:00.000001Z  INFO valet_agent::pod::state::ending: sidecar accepted quit \
                   pod=default/stalled-1a2b sidecar=istio-proxy status=200 attempts=1 quit_after_us=812 sent_ns=123456\n\
                   2026-11-29T08:00:00.000002Z  INFO valet_agent::pod::state::ending: sidecar accepted quit \
                   pod=default/stalled-3c4d sidecar=istio-proxy status=200 attempts=1 sent_ns=0\n\
                   2026-11-29T08:00:00.000003Z  INFO valet_agent: asked pod=default/stalled-5e6f sent_ns=9\n\
                   2026-11-29T08:00:00.000004Z  INFO valet_agent::sidecar::netns: quit sent ahead, its answer not read \
                   uid=0c1d-2e port=15020 sent_ns=777";
        let sent = super::quits_sent(log);
        assert_eq!(sent.get("stalled-1a2b"), Some(&123_456));
        assert_eq!(sent.get("0c1d-2e"), Some(&777));
        assert_eq!(sent.len(), 2, "no time (0) is no send time, and other lines are not quits: {sent:?}");
    }
}
