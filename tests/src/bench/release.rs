//! [4] proxy ready → held app runs. The proxy turns ready at a moment drawn uniformly over the
//! 2 s after the hold (after the app's start for the reference), so neither side is measured at
//! its best moment: valet with the proxy listening from the start (readiness flips), with a
//! stand-in that starts listening late, with a real Envoy started late, and with an Istio-like
//! Envoy that turns ready when its listeners arrive by filesystem xDS. Then again with the held
//! pods' poll forced to one probe a second, so that only the kernel's sight of a listen can
//! release within the target (the flipping stand-in, which no listen marks, shows the poll's
//! own pace). Istio's `pilot-agent wait` (a 500 ms poller) is the reference, measured beside
//! each row.
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use valet_agent::host::clock::monotonic_ns;
use valet_sim::node::{SimPod, SpawnOptions};
use valet_tests::envoy;
use valet_tests::harness::{Agent, JobSpec, Node, eventually};

#[allow(clippy::wildcard_imports, reason = "the bench's parts share one namespace")]
use super::*;

/// The ready moment is drawn uniformly over this long after the hold.
pub(crate) const READY_WINDOW: Duration = Duration::from_secs(2);
/// Release targets from the proxy's first ready answer to the released app's first instruction.
const MEDIAN_TARGET_US: f64 = 12_500.0;
const P99_TARGET_US: f64 = 25_000.0;

/// Uniform draws from a seeded xorshift, so that a run's moments can be replayed
/// (`VALET_BENCH_SEED`).
pub(crate) struct Draw(u64);

impl Draw {
    pub(crate) fn from_env() -> Draw {
        let seed = std::env::var("VALET_BENCH_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64)
        });
        println!("  ready moments drawn with VALET_BENCH_SEED={seed}");
        Draw(seed | 1)
    }

    /// A duration uniform in `[0, max)`.
    pub(crate) fn uniform(&mut self, max: Duration) -> Duration {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        max.mul_f64((self.0 >> 11) as f64 / (1u64 << 53) as f64)
    }
}

/// How the held pod's proxy turns ready.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Proxy {
    /// The stand-in listens from the start and answers 503 until its ready file appears.
    Flips,
    /// The stand-in is started at the ready moment: its ports are closed until it listens, and
    /// it is ready as soon as it does.
    ListensLate,
    /// A real Envoy started at the ready moment (admin on 127.0.0.1:15000, `GET /ready`).
    Envoy,
    /// A real Envoy started with the pod, Istio-like ([`envoy::IstioLike`]): its listeners are
    /// delivered at the ready moment, and `:15021/healthz/ready` turns 200 with them.
    IstioLike,
}

/// What a tight poller of the bench's own saw of a proxy turning ready: when it sent the request
/// that got the first 200, and when it sent the last one that did not (CLOCK_MONOTONIC ns).
struct FirstReady {
    sent: u64,
    last_not_ready: Option<u64>,
}

/// Polls `GET path` on `addr` inside the pod's network namespace every millisecond (a refused
/// connection fails at once) until it answers 200, for at most `limit`.
fn watch_first_ready(
    sim: Arc<SimPod>,
    addr: SocketAddr,
    path: &'static str,
    limit: Duration,
) -> std::thread::JoinHandle<Result<FirstReady>> {
    std::thread::spawn(move || {
        sim.in_netns(|| {
            let started = Instant::now();
            let mut last_not_ready = None;
            while started.elapsed() < limit {
                let sent = monotonic_ns();
                match valet_sim::client::get(addr, path, Duration::from_secs(1)) {
                    Ok(r) if r.status == 200 => return Ok(FirstReady { sent, last_not_ready }),
                    _ => last_not_ready = Some(sent),
                }
                std::thread::sleep(Duration::from_millis(1));
            }
            bail!("{addr}{path} never answered 200 in {limit:?}")
        })?
    })
}

/// The held pod's spec for `proxy`, its proxy gated on the file `ready` where it starts late;
/// the Istio-like proxy's configuration server, which delivers its listeners; and the address
/// and path of the proxy's ready answer.
fn release_spec(
    node: &Node,
    proxy: Proxy,
    ready: &Path,
    i: usize,
) -> Result<(JobSpec, Option<envoy::IstioLike>, (SocketAddr, &'static str))> {
    let gate = bin("valet-bench-gate")?;
    let mut spec = JobSpec::new("bench-hold").annotation("valet.dev/hold-app", "true");
    let gated = |cmd: Vec<String>| -> Vec<String> {
        let mut c = vec![gate.display().to_string(), ready.display().to_string(), "--".into()];
        c.extend(cmd);
        c
    };
    let mut delivery = None;
    let (addr, path): (SocketAddr, &'static str) = match proxy {
        Proxy::Flips => {
            spec.ready_file = Some(ready.to_path_buf());
            (([127, 0, 0, 1], 15021).into(), "/healthz/ready")
        }
        Proxy::ListensLate => {
            let standin = valet_sim::standin::binary_path()?.display().to_string();
            spec.sidecar = Some(("istio-proxy".into(), gated(vec![standin, "--kind".into(), "istio".into()])));
            (([127, 0, 0, 1], 15021).into(), "/healthz/ready")
        }
        Proxy::Envoy => {
            let envoy = envoy::binary().context("no Envoy")?;
            let config = node.scratch.path(&format!("envoy-{i}.yaml"));
            std::fs::write(&config, envoy::BOOTSTRAP)?;
            let log = node.scratch.path(&format!("envoy-{i}.log"));
            spec = envoy::as_sidecar(spec, gated(envoy::command(&envoy, &config, &log)));
            (([127, 0, 0, 1], 15000).into(), "/ready")
        }
        Proxy::IstioLike => {
            let envoy = envoy::binary().context("no Envoy")?;
            let dir = node.scratch.path(&format!("xds-{i}"));
            let xds = envoy::IstioLike::new(&dir)?;
            let log = node.scratch.path(&format!("xds-envoy-{i}.log"));
            spec = envoy::as_istio_like_sidecar(spec, envoy::command(&envoy, &xds.bootstrap(), &log));
            delivery = Some(xds);
            (([127, 0, 0, 1], envoy::IstioLike::READY_PORT).into(), envoy::IstioLike::READY_PATH)
        }
    };
    Ok((spec, delivery, (addr, path)))
}

/// One held pod's release ([`held_release`]).
pub(crate) struct Released {
    /// From the ready moment to the app's first instruction (µs; signed, see below).
    pub(crate) us: f64,
    /// Whether the agent saw a listen in the pod between the ready moment and the app's run.
    pub(crate) listened: bool,
    /// The app's pid (its SIGCONT's target) and the ready moment (CLOCK_MONOTONIC ns).
    pub(crate) pid: u32,
    pub(crate) ready_at: u64,
}

/// One held pod: its app is held, the proxy turns ready `delay` after the hold ([`Released`]).
/// The app lives `life_ms` after its first instruction (its end quits the proxy): long enough
/// for the bench's ready poller to see the proxy's first 200 before.
pub(crate) fn held_release(
    node: &Node,
    agent: &Agent,
    (proxy, life_ms): (Proxy, &str),
    delay: Duration,
    i: usize,
) -> Result<Released> {
    let tag = match proxy {
        Proxy::Flips => "flips",
        Proxy::ListensLate => "late",
        Proxy::Envoy => "envoy",
        Proxy::IstioLike => "xds",
    };
    let app = bin("valet-bench-app")?;
    let ready = node.scratch.path(&format!("ready-{tag}-{i}"));
    let (spec, delivery, (addr, path)) = release_spec(node, proxy, &ready, i)?;
    let mut job = node.job_pod(spec)?;
    agent.wait_tracked(1, Duration::from_secs(10))?;
    let stamp = node.scratch.path(&format!("ran-{tag}-{i}"));
    let stamp_s = stamp.to_str().context("path")?.to_owned();
    let app_s = app.to_str().context("path")?;
    // The app lives `life_ms` after its stamp: its end quits the proxy, and the ready poller
    // below must see a 200 before that (a loaded machine once starved it past a window of a few
    // ms; [4s]'s busy loops, past 100 ms).
    let pid = job.start_app("app", &[app_s, &stamp_s, "0", "0", life_ms], &SpawnOptions::default())?.host_pid();
    // Held: stopped by the kernel before its first instruction (it cannot have run).
    if !eventually(Duration::from_secs(10), || stopped(pid)) || stamp.exists() {
        bail!("run {i}: the app was not held\n{}", agent.log_text());
    }
    if delivery.is_some()
        && !eventually(HANG_GUARD, || {
            job.sim
                .in_netns(|| valet_sim::client::get(addr, path, Duration::from_millis(500)).map(|r| r.status))
                .is_ok_and(|r| r.is_ok_and(|status| status == 503))
        })
    {
        bail!("run {i}: the Istio-like Envoy's health port never answered 503");
    }
    // From the hold (the Istio-like Envoy: from its start, with no listeners yet).
    let held = Instant::now();
    let watcher = (proxy != Proxy::Flips).then(|| watch_first_ready(job.sim.clone(), addr, path, delay + HANG_GUARD));
    std::thread::sleep(delay.saturating_sub(held.elapsed()));
    // Listening from the start, the stand-in answers 200 only after the file exists: the moment
    // before it is made is at or before its first ready answer.
    let listens = agent.metric("valet_proxy_listens_total ");
    let flipped = monotonic_ns();
    match &delivery {
        Some(xds) => xds.deliver()?,
        None => std::fs::write(&ready, b"")?,
    }
    if !eventually(HANG_GUARD, || read_stamp(&stamp).is_some()) {
        bail!("run {i}: the app was not released\n{}", agent.log_text());
    }
    let ran = read_stamp(&stamp).context("stamp")?;
    let listened = agent.metric("valet_proxy_listens_total ") > listens;
    let ready_at = match watcher {
        None => flipped,
        Some(w) => {
            let seen = w.join().map_err(|_| anyhow::anyhow!("the ready poller panicked"))??;
            if seen.last_not_ready.is_some_and(|t| ran < t) {
                bail!("run {i}: the app ran before the proxy last answered not ready\n{}", agent.log_text());
            }
            seen.sent
        }
    };
    // The app's end (`life_ms` after its stamp) quits the proxy; deleted before it, the pod's proxy
    // would be left to the deletion and each sample would wait out `wait_proxy_exit`.
    if let Some(app) = job.apps.last_mut() {
        let _ = app.wait_timeout(Duration::from_secs(5));
    }
    node.api.delete_pod("jobs", &job.name).ok();
    let _ = job.wait_proxy_exit(Duration::from_secs(5));
    drop(job);
    agent.wait_tracked(0, Duration::from_secs(10))?;
    // Signed: an app released between the poller's last 503 and its first 200 counts below 0.
    Ok(Released { us: (ran as f64 - ready_at as f64) / 1000.0, listened, pid, ready_at })
}

/// The hang guard of one release: far beyond any target, only so that a lost release fails.
const HANG_GUARD: Duration = Duration::from_secs(20);

/// The agent's flags of the rows with the held pods' poll forced to one probe a second.
const POLL_FORCED: [&str; 4] = ["--probe-interval", "1s", "--held-probe-interval", "1s"];

/// Section 4.
pub(crate) fn release_latency(plan: &Plan, table: &mut Table) -> Result<()> {
    let runs = plan.release_runs;
    println!(
        "\n[4] proxy ready → held app runs ({runs} pods each, ready moment uniform over 0–2 s after the hold; \
         the reference beside each)"
    );
    let mut draw = Draw::from_env();
    let envoy_rows = match envoy::binary() {
        Some(_) => true,
        None if plan.quick => {
            println!("  no Envoy at {} (VALET_ENVOY): its rows are left out of this smoke run", envoy::CACHED);
            false
        }
        None => bail!("no Envoy at {} (VALET_ENVOY): `cargo xtask setup` installs it", envoy::CACHED),
    };
    let mut variants = vec![
        (Proxy::Flips, "listening from the start, readiness flips"),
        (Proxy::ListensLate, "stand-in starts listening late"),
    ];
    if envoy_rows {
        variants.push((Proxy::Envoy, "real Envoy 1.40 started late"));
        variants.push((Proxy::IstioLike, "Istio-like Envoy 1.40, listeners by filesystem xDS"));
    }
    for forced in [false, true] {
        let node = Node::new()?;
        let agent = node.start_agent(if forced { &POLL_FORCED[..] } else { &[] })?;
        let poll = if forced { ", poll forced to 1 s" } else { "" };
        for &(proxy, what) in &variants {
            let t = Instant::now();
            let (mut samples, mut polled, mut listened) = (Vec::with_capacity(runs), Vec::with_capacity(runs), 0);
            for i in 0..runs {
                let r = held_release(&node, &agent, (proxy, "100"), draw.uniform(READY_WINDOW), i)?;
                samples.push(r.us);
                listened += usize::from(r.listened);
                polled.push(reference(&node, &agent, &mut draw, i)?);
            }
            let s = report(&format!("valet, {what}{poll}"), samples);
            let r = report("  reference beside it: pilot-agent wait (500 ms polling)", polled);
            println!(
                "  ({what}{poll}: a listen seen at the ready moment in {listened} of {runs} pods, {:.0} s)",
                t.elapsed().as_secs_f64()
            );
            let ok = s.median <= MEDIAN_TARGET_US && s.p99 <= P99_TARGET_US;
            let (target, result) = match (forced, proxy) {
                // No listen marks the flip: the poll's own pace, the control that the poll was 1 s.
                (true, Proxy::Flips) => {
                    ("— (the forced poll's pace)", "no listen to see: released by the poll".to_owned())
                }
                (true, _) => (
                    "median ≤ 12.5 ms, p99 ≤ 25 ms; a listen seen at the ready moment in every pod",
                    format!(
                        "{}; listens in {listened} of {runs} pods: {}",
                        against(s.median, r.median),
                        met(ok && listened == runs)
                    ),
                ),
                (false, _) => {
                    ("median ≤ 12.5 ms, p99 ≤ 25 ms", format!("{}: {}", against(s.median, r.median), met(ok)))
                }
            };
            table.add(
                &format!("[4] proxy ready → held app runs, {what}{poll} (median / p99, n={})", s.n),
                s.ms(),
                &format!("`pilot-agent wait` (500 ms poll) {}", r.ms()),
                target,
                result,
            );
        }
    }
    Ok(())
}

/// One sample of the reference, against the same stand-in: Istio's holdApplicationUntilProxyStarts
/// (`pilot-agent wait` polls the readiness endpoint every 500 ms, then the app starts); a closed
/// port is not ready to it, as a 503 is. The time from the ready moment to the app's start (µs).
pub(crate) fn reference(node: &Node, agent: &Agent, draw: &mut Draw, i: usize) -> Result<f64> {
    let poller = bin("valet-bench-poller")?;
    let poller = poller.to_str().context("path")?;
    let app = bin("valet-bench-app")?;
    let app = app.to_str().context("path")?;
    let ready = node.scratch.path(&format!("poll-ready-{i}"));
    let _ = std::fs::remove_file(&ready);
    let mut spec = JobSpec::new("bench-poll");
    spec.labelled = false;
    spec.ready_file = Some(ready.clone());
    let mut job = node.job_pod(spec)?;
    let stamp = node.scratch.path(&format!("polled-{i}"));
    let _ = std::fs::remove_file(&stamp);
    let stamp_s = stamp.to_str().context("path")?;
    job.start_app(
        "app",
        &[poller, "15021", "/healthz/ready", "500", "--", app, stamp_s, "0"],
        &SpawnOptions::default(),
    )?;
    let started = Instant::now();
    std::thread::sleep(draw.uniform(READY_WINDOW).saturating_sub(started.elapsed()));
    let t_ready = monotonic_ns();
    std::fs::write(&ready, b"")?;
    if !eventually(HANG_GUARD, || read_stamp(&stamp).is_some()) {
        bail!("poll run {i}: the app never started");
    }
    let ran = read_stamp(&stamp).context("stamp")?;
    node.api.delete_pod("jobs", &job.name).ok();
    drop(job);
    agent.wait_tracked(0, Duration::from_secs(10))?;
    Ok(ran.saturating_sub(t_ready) as f64 / 1000.0)
}

/// valet's median against the reference's, as a fraction when it is smaller.
pub(crate) fn against(valet: f64, reference: f64) -> String {
    if valet < reference {
        format!("1/{:.0} of the reference", reference / valet)
    } else {
        format!("{:.1}× the reference", valet / reference)
    }
}
