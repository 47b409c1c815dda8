use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use valet_agent::host::clock::monotonic_ns;
use valet_sim::node::SpawnOptions;
use valet_tests::harness::{Agent, JobPod, JobSpec, Node};

#[allow(clippy::wildcard_imports, reason = "the bench's parts share one namespace")]
use super::*;

/// Waits until the agent's `valet_pods_tracked` is `n`, polling its metrics as fast as it
/// answers; the time it took.
pub(crate) fn tracked_after(agent: &Agent, n: f64, since: Instant) -> Result<Duration> {
    while agent.metric("valet_pods_tracked ") != n {
        if since.elapsed() > Duration::from_secs(10) {
            bail!("the agent never tracked {n} pods");
        }
    }
    Ok(since.elapsed())
}

/// Pod-watch latency, and where it goes: the samples (µs) of each part.
#[derive(Default)]
pub(crate) struct WatchLag {
    /// From the pod's create until the pod's first event reached the agent's pod router, by the
    /// router's own `tracking` line (its CLOCK_MONOTONIC time, read from the agent's log, which
    /// the bench reads every millisecond: the agent is asked nothing meanwhile).
    pub(crate) logged: Vec<f64>,
    /// From the create until a bare watch client of the bench's (the agent's selectors, on the
    /// same API stand-in) has read the pod's ADDED line: the stand-in's own part (the samples
    /// above).
    pub(crate) api: Vec<f64>,
    /// As `logged`, until the agent's tracked count shows the pod, read from its `/metrics` back
    /// to back (the bench's earlier way: each read is the agent's work too, on the same CPUs).
    pub(crate) agent: Vec<f64>,
    /// One read of the agent's `/metrics`: each sample above ends with one, begun after the count
    /// changed or before.
    pub(crate) scrape: Vec<f64>,
    /// The agent's CPU and its threads' time waiting for a CPU (the kernel's schedstat) over
    /// the `logged` samples, per sample (µs), and the same per thread for the log.
    pub(crate) cpu: f64,
    pub(crate) waited: f64,
    pub(crate) threads: String,
}

/// The agent's log as it grows: its pod router's `tracking` and `stopped tracking` lines (at
/// debug: the agent runs with `valet_agent::pod_router=debug`, [`ROUTER_LOG`]), each with the
/// moment the pod's event reached the router (`seen_ns=`, CLOCK_MONOTONIC).
pub(crate) struct RouterLog {
    path: PathBuf,
    offset: u64,
    partial: String,
    /// (gone, `namespace/name`) → seen_ns.
    seen: std::collections::HashMap<(bool, String), u64>,
}

/// The agent's `RUST_LOG` for [`RouterLog`].
pub(crate) const ROUTER_LOG: &str = "info,kube=warn,valet_agent::pod_router=debug";

impl RouterLog {
    /// From the log's present end.
    pub(crate) fn new(agent: &Agent) -> RouterLog {
        let offset = std::fs::metadata(&agent.log).map(|m| m.len()).unwrap_or(0);
        RouterLog { path: agent.log.clone(), offset, partial: String::new(), seen: Default::default() }
    }

    /// Waits until the router logged pod `jobs/<name>` tracked (or, `gone`, no longer tracked):
    /// its `seen_ns`. The log is read every millisecond; the time is the agent's own.
    pub(crate) fn wait(&mut self, name: &str, gone: bool) -> Result<u64> {
        let key = (gone, format!("jobs/{name}"));
        let since = Instant::now();
        loop {
            self.read()?;
            if let Some(&at) = self.seen.get(&key) {
                return Ok(at);
            }
            if since.elapsed() > Duration::from_secs(10) {
                bail!(
                    "the agent never logged {} {}: is its log at debug for the router?",
                    key.1,
                    if gone { "gone" } else { "tracked" }
                );
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    fn read(&mut self) -> Result<()> {
        use std::io::{Read as _, Seek as _};
        let mut f = std::fs::File::open(&self.path)?;
        f.seek(std::io::SeekFrom::Start(self.offset))?;
        let mut bytes = Vec::new();
        f.read_to_end(&mut bytes)?;
        self.offset += bytes.len() as u64;
        self.partial.push_str(&String::from_utf8_lossy(&bytes));
        while let Some(end) = self.partial.find('\n') {
            let line: String = self.partial.drain(..=end).collect();
            if let Some((gone, pod, at)) = router_line(&line) {
                self.seen.insert((gone, pod), at);
            }
        }
        Ok(())
    }
}

/// A router line: (gone, `namespace/name`, seen_ns).
fn router_line(line: &str) -> Option<(bool, String, u64)> {
    let gone = if line.contains("pod_router: tracking ") {
        false
    } else if line.contains("pod_router: stopped tracking ") {
        true
    } else {
        return None;
    };
    let field = |key: &str| line.split_whitespace().find_map(|w| w.strip_prefix(key));
    Some((gone, field("pod=")?.to_owned(), field("seen_ns=")?.parse().ok()?))
}

/// A bare watch client on `node`'s API stand-in, with the agent's label and field selectors: the
/// moment it reads each ADDED line of a `watch-probe-` pod, by name.
fn bare_watch(node: &Node) -> Result<std::sync::mpsc::Receiver<(String, Instant)>> {
    let target = format!(
        "/api/v1/pods?watch=true&timeoutSeconds=600&labelSelector=valet.dev%2Fenabled%3Dtrue&fieldSelector=spec.nodeName%3D{}",
        node.name
    );
    let mut stream = valet_sim::client::watch(node.api.addr(), &target, Duration::from_secs(10))?;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        while let Ok(Some(event)) = stream.next_event(Duration::from_secs(600)) {
            let at = Instant::now();
            let name = event["object"]["metadata"]["name"].as_str().unwrap_or_default();
            if event["type"] == "ADDED" && name.starts_with("watch-probe-") && tx.send((name.to_owned(), at)).is_err() {
                return;
            }
        }
    });
    Ok(rx)
}

/// Pod-watch latency: a labelled pod object appears on the node (and is deleted again); the time
/// until the pod's event reached the agent's router, by its log, `samples` times, beside the API
/// stand-in's own part; then `samples` more read the bench's earlier way, until the agent's
/// tracked count shows the pod, with the cost of that read ([`WatchLag`]). The agent must log at
/// [`ROUTER_LOG`].
pub(crate) fn watch_latency(node: &Node, agent: &Agent, base: f64, samples: usize) -> Result<WatchLag> {
    let mut out = WatchLag::default();
    let bare = bare_watch(node)?;
    let pid = agent.pid().context("agent pid")?;
    let probe_pod = |i: usize| {
        let name = format!("watch-probe-{i}-{}", valet_sim::util::random_hex(3));
        let pod = serde_json::json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": "jobs", "uid": valet_sim::util::uuid_v4(),
                         "labels": {"valet.dev/enabled": "true"}},
            "spec": {"nodeName": node.name, "restartPolicy": "Never", "containers": [
                {"name": "app", "image": "example/app:1"},
                {"name": "istio-proxy", "image": "docker.io/istio/proxyv2:1.22.0"}]},
            "status": {"phase": "Pending"}
        });
        (name, pod)
    };
    let mut log = RouterLog::new(agent);
    let before = thread_waits(pid);
    for i in 0..samples {
        let (name, pod) = probe_pod(i);
        let (t0, t0_ns) = (Instant::now(), monotonic_ns());
        node.api.create_pod(pod)?;
        loop {
            let (seen, at) = bare.recv_timeout(Duration::from_secs(10)).context("the bare watch never saw the pod")?;
            if seen == name {
                out.api.push(at.saturating_duration_since(t0).as_secs_f64() * 1e6);
                break;
            }
        }
        out.logged.push(log.wait(&name, false)?.saturating_sub(t0_ns) as f64 / 1e3);
        node.api.delete_pod("jobs", &name)?;
        log.wait(&name, true)?;
    }
    let after = thread_waits(pid);
    for i in 0..samples {
        let (name, pod) = probe_pod(samples + i);
        let scrape = Instant::now();
        agent.metrics_text()?;
        out.scrape.push(scrape.elapsed().as_secs_f64() * 1e6);
        let t0 = Instant::now();
        node.api.create_pod(pod)?;
        out.agent.push(tracked_after(agent, base + 1.0, t0)?.as_secs_f64() * 1e6);
        node.api.delete_pod("jobs", &name)?;
        tracked_after(agent, base, Instant::now())?;
    }
    let sum = |w: &Waits, f: fn(&(u64, u64, u64, i64)) -> u64| w.values().map(f).sum::<u64>() as f64;
    let per = samples.max(1) as f64 * 1e3;
    out.cpu = (sum(&after, |t| t.0) - sum(&before, |t| t.0)) / per;
    out.waited = (sum(&after, |t| t.1) - sum(&before, |t| t.1)) / per;
    out.threads = waits_line(&before, &after);
    Ok(out)
}

/// A pod-watch row's cells ([`watch_split`]).
pub(crate) struct WatchSplit {
    pub(crate) latency: String,
    pub(crate) reference: String,
    pub(crate) verdict: String,
}

/// A pod-watch row ([8]'s and [5]'s): the latency by the agent's log under load (`full`) against
/// its reference (`quiet`), and where the difference goes: the API stand-in's own delivery (a bare
/// watch client's receipt of the same pod) and what is left, the agent's own receipt; beside it
/// the agent's CPU and its threads' wait for one per sample, and the bench's earlier figure, read
/// from the agent's count on `/metrics` back to back. Met at ≤ 1.2× the reference, or when the part
/// left after the bare watch's delivery is itself ≤ 1.2× its reference: the difference then lies
/// outside the agent. `names` name the two (`("no pods", "full")`), `with` the load.
pub(crate) fn watch_split(names: (&str, &str), with: &str, quiet: &WatchLag, full: &WatchLag) -> WatchSplit {
    let (q, f) = names;
    let own = |l: &WatchLag| l.logged.iter().zip(&l.api).map(|(a, b)| a - b).collect::<Vec<f64>>();
    let qw = report(&format!("pod-watch latency, {q}"), quiet.logged.clone());
    let fw = report(&format!("pod-watch latency, {with}"), full.logged.clone());
    let qa = report(&format!("  the API stand-in's delivery to a bare watch, {q}"), quiet.api.clone());
    let fa = report(&format!("  the API stand-in's delivery to a bare watch, {f}"), full.api.clone());
    let qo = report(&format!("  the agent's part (latency less the bare watch's), {q}"), own(quiet));
    let fo = report(&format!("  the agent's part (latency less the bare watch's), {f}"), own(full));
    let qm = report(&format!("  read from the agent's count on /metrics back to back, {q}"), quiet.agent.clone());
    let fm = report(&format!("  read from the agent's count on /metrics back to back, {f}"), full.agent.clone());
    let qs = report(&format!("  one read of the agent's /metrics, {q}"), quiet.scrape.clone());
    let fs = report(&format!("  one read of the agent's /metrics, {f}"), full.scrape.clone());
    println!(
        "  the agent over the samples read from its log, per sample: CPU {:.0} / {:.0} µs, its threads waiting for a \
         CPU {:.0} / {:.0} µs ({q} / {with})\n  {q}: {}\n  {with}: {}",
        quiet.cpu, full.cpu, quiet.waited, full.waited, quiet.threads, full.threads
    );
    let ratio = fw.median / qw.median;
    let split = split_verdict(qo.median, fo.median);
    WatchSplit {
        latency: fw.ms(),
        reference: format!(
            "{q} {}; of it (medians, {q} / {f}): the API stand-in's delivery to a bare watch client \
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
        verdict: format!("{ratio:.2}×; the rest alone {}: {}", split.0, met(ratio <= 1.2 || split.1)),
    }
}

/// The split's words and whether it puts the difference outside the agent: its part (the latency
/// less the bare watch's, medians in µs) under load at most 1.2× its part with no load. A part
/// with no load that is not above zero (the bare watch read the pod as late as the agent or
/// later: noise at this scale) gives no ratio, and judges nothing.
fn split_verdict(quiet: f64, full: f64) -> (String, bool) {
    if quiet > 0.0 {
        let ratio = full / quiet;
        (format!("{ratio:.2}×"), ratio <= 1.2)
    } else {
        (format!("{:.2} ms with no pods, no ratio", quiet / 1e3), false)
    }
}

/// One 0.3 s Job: the time from its app's exit to the quit its proxy received, or None when the
/// proxy was not asked to quit within 5 s (a container end lost). `during` runs after the app
/// started (e.g. stalling the agent).
pub(crate) fn one_job(
    node: &Node,
    agent: &Agent,
    app: &str,
    tag: &str,
    tracked: usize,
    during: impl FnOnce() -> Result<()>,
) -> Result<Option<f64>> {
    let mut job = node.job_pod(JobSpec::new(tag))?;
    let stamp = node.scratch.path(&format!("stamp-{tag}"));
    let stamp_s = stamp.to_str().context("path")?.to_owned();
    // The agent knows the pod (its container ends come from the kernel from then on).
    agent.wait_tracked(tracked, Duration::from_secs(5))?;
    job.start_app("app", &[app, &stamp_s, "0", JOB_MS], &SpawnOptions::default())?;
    during()?;
    let quit = match job.wait_proxy_exit(Duration::from_secs(5))? {
        Some(_) => job.quits().first().map(|q| q.mono_ns),
        None => None,
    };
    let exited = read_stamp(&stamp);
    node.api.delete_pod("jobs", &job.name).ok();
    drop(job);
    agent.wait_tracked(tracked - 1, Duration::from_secs(5))?;
    Ok(match (quit, exited) {
        (Some(q), Some(e)) => Some(q.saturating_sub(e) as f64 / 1000.0),
        _ => None,
    })
}

/// Threads making or tearing down simulated pods at once.
pub(crate) const LANES: usize = 10;

/// Starts `n` labelled Job pods (proxy ready) as fast as the simulated node makes them (a few
/// at a time: making one is mostly waiting for processes).
pub(crate) fn make_jobs(node: &Node, tag: &str, n: usize) -> Result<Vec<JobPod>> {
    make_pods(node, tag, n, true)
}

/// [`make_jobs`], opted in or not.
pub(crate) fn make_pods(node: &Node, tag: &str, n: usize, labelled: bool) -> Result<Vec<JobPod>> {
    let spec = || {
        let mut spec = JobSpec::new(tag);
        spec.labelled = labelled;
        spec
    };
    std::thread::scope(|s| {
        let lanes: Vec<_> = (0..LANES)
            .map(|lane| {
                let count = n / LANES + usize::from(lane < n % LANES);
                s.spawn(move || (0..count).map(|_| node.job_pod(spec())).collect::<Result<Vec<_>>>())
            })
            .collect();
        let mut jobs = Vec::with_capacity(n);
        for lane in lanes {
            jobs.extend(lane.join().map_err(|_| anyhow::anyhow!("a pod-making thread panicked"))??);
        }
        Ok(jobs)
    })
}

/// Deletes the pods from the API, then tears them down ([`drop_jobs`]).
pub(crate) fn remove_jobs(node: &Node, jobs: Vec<JobPod>) {
    for job in &jobs {
        node.api.delete_pod("jobs", &job.name).ok();
    }
    drop_jobs(jobs);
}

/// Tears pods down a few at a time.
pub(crate) fn drop_jobs(jobs: Vec<JobPod>) {
    let mut lanes: Vec<Vec<JobPod>> = (0..LANES).map(|_| Vec::new()).collect();
    for (i, job) in jobs.into_iter().enumerate() {
        lanes[i % LANES].push(job);
    }
    std::thread::scope(|s| {
        for lane in lanes {
            s.spawn(move || drop(lane));
        }
    });
}

/// Jobs made in a burst, their apps then started within about one second; each app runs `run`.
pub(crate) struct Burst {
    pub(crate) jobs: Vec<JobPod>,
    pub(crate) stamps: Vec<PathBuf>,
    pub(crate) run: Duration,
    /// When the first app was started.
    pub(crate) started: Instant,
}

impl Burst {
    /// `wrapped`: each app runs under the in-pod wrapper (pods not opted in), else bare (opted in).
    pub(crate) fn start(node: &Node, tag: &str, n: usize, run: Duration, wrapped: bool) -> Result<Burst> {
        let app = bin("valet-bench-app")?;
        let wrapper = bin("valet-bench-wrapper")?;
        let (app, wrapper) = (app.to_str().context("path")?, wrapper.to_str().context("path")?);
        let t = Instant::now();
        let mut jobs = make_pods(node, tag, n, !wrapped)?;
        let made = t.elapsed();
        let started = Instant::now();
        let run_ms = run.as_millis().to_string();
        let mut stamps = Vec::new();
        for (i, job) in jobs.iter_mut().enumerate() {
            let stamp = node.scratch.path(&format!("{tag}-{i}"));
            let stamp_s = stamp.to_str().context("path")?;
            let mut cmd = Vec::new();
            if wrapped {
                cmd.push(wrapper);
                cmd.extend(WRAPPER_ARGS);
            }
            cmd.extend([app, stamp_s, "0", &run_ms]);
            job.start_app("app", &cmd, &SpawnOptions::default())?;
            stamps.push(stamp);
        }
        println!(
            "  {n} {} Job pods made in {:.1} s, their apps started within {:.2} s",
            if wrapped { "wrapper" } else { "opted-in" },
            made.as_secs_f64(),
            started.elapsed().as_secs_f64()
        );
        Ok(Burst { jobs, stamps, run, started })
    }

    /// Waits for the apps to end: each one's exit → quit (µs), and how many were not quit.
    pub(crate) fn quits(&mut self) -> Result<(Vec<f64>, usize)> {
        let (timed, lost) = self.timed_quits()?;
        Ok((timed.iter().map(TimedQuit::us).collect(), lost))
    }

    /// As [`Burst::quits`], each quit with its pod's name and its two moments (CLOCK_MONOTONIC
    /// ns): the app's exit stamp and the proxy's receipt of the quit.
    pub(crate) fn timed_quits(&mut self) -> Result<(Vec<TimedQuit>, usize)> {
        let (mut quits, mut lost) = (Vec::new(), 0);
        for (job, stamp) in self.jobs.iter_mut().zip(&self.stamps) {
            let left = self.run.saturating_sub(self.started.elapsed());
            let quit = match job.wait_proxy_exit(left + Duration::from_secs(5))? {
                Some(_) => job.quits().first().map(|q| q.mono_ns),
                None => None,
            };
            match (quit, read_stamp(stamp)) {
                (Some(received), Some(exited)) => quits.push(TimedQuit { pod: job.name.clone(), exited, received }),
                _ => lost += 1,
            }
        }
        Ok((quits, lost))
    }
}

/// One Job's quit in a burst: its pod's name, its app's exit stamp and its proxy's receipt of the
/// quit (CLOCK_MONOTONIC ns).
pub(crate) struct TimedQuit {
    pub(crate) pod: String,
    pub(crate) exited: u64,
    pub(crate) received: u64,
}

impl TimedQuit {
    /// Its exit → quit (µs).
    pub(crate) fn us(&self) -> f64 {
        self.received.saturating_sub(self.exited) as f64 / 1e3
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_split_with_no_part_to_compare_to_judges_nothing() {
        assert_eq!(super::split_verdict(40.0, 48.0), ("1.20×".to_owned(), true));
        assert!(!super::split_verdict(40.0, 49.0).1);
        assert!(super::split_verdict(140.0, -250.0).1, "the agent's part fell below the bare watch's");
        // With no pods the bare watch read the pod later than the agent: a negative ratio
        // would pass whatever the part under load.
        assert_eq!(super::split_verdict(-130.0, 90.0), ("-0.13 ms with no pods, no ratio".to_owned(), false));
        assert!(!super::split_verdict(0.0, 0.0).1);
    }

    #[test]
    fn router_lines_give_each_pods_tracking_and_its_end() {
        let lines = [
            "2026-12-05T19:00:00.000001Z DEBUG valet_agent::pod_router: tracking pod=jobs/watch-probe-0-ab seen_ns=1200",
            "2026-12-05T19:00:00.000002Z DEBUG valet_agent::pod_router: stopped tracking pod=jobs/watch-probe-0-ab seen_ns=1900",
            "2026-12-05T19:00:00.000003Z  INFO valet_agent::pod::state: tracking pod=jobs/other seen_ns=5",
            "2026-12-05T19:00:00.000004Z DEBUG valet_agent::pod_router: tracking pod=jobs/no-time",
        ];
        let got: Vec<_> = lines.iter().filter_map(|l| super::router_line(l)).collect();
        assert_eq!(
            got,
            [(false, "jobs/watch-probe-0-ab".to_owned(), 1200), (true, "jobs/watch-probe-0-ab".to_owned(), 1900)],
            "only the router's lines with a time"
        );
    }
}
