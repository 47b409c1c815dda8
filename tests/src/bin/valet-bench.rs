//! `cargo xtask bench`: valet's performance figures, each beside its reference measured in the same
//! run and its target, printed as one table at the end (figures are printed, never asserted).
//!
//! 1. kernel → user latency of an exit event;
//! 3. app exit → quit received by the stand-in proxy for a 0.3 s Job, valet vs an in-pod wrapper
//!    (waitpid, then POST), and the stand-in's own part of each;
//! 4. proxy ready → held app released, valet vs Istio's `pilot-agent wait` poller;
//! 5. a watched pod forking short processes as fast as the machine allows: container ends lost,
//!    exit → quit and pod-watch latency during the storm and without it, and an app that ends
//!    while the agent is stalled (SIGSTOP) in the middle of the storm;
//! 6. the exit program's own cost per exit, from the kernel's BPF statistics, and a tight exit
//!    loop's rate with and without the programs;
//! 7. 20 pods held at once, in rounds: release latency and the agent's CPU while it probes them;
//! 8. a full node: 110 opted-in pods tracked, 50 Jobs started within one second: RSS, idle CPU,
//!    exit → quit of the 50 beside as many Jobs under the in-pod wrapper in the same kind of burst
//!    on the same node, pod-watch latency;
//! 9. soak: 10,000 short Jobs through one node in batches: RSS, open fds and kernel map entries at
//!    the start and the end;
//! 10. observe mode on a full node: 110 pods, a tenth opted in and the rest only observed, every
//!     app running: RSS and idle CPU against [8]'s targets.
//!
//! `--quick` runs every section small (a smoke test for CI, not figures for the README).
//! Pods run on the simulated node's kubelet as unhelpful as a real one (container ids and exits
//! reach the API about a second late; bundles and cgroups go at exit).
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use valet_agent::kernel::{Attach, Event, EventStream, Programs, events::monotonic_ns};
use valet_common::watch_flags;
use valet_sim::node::SpawnOptions;
use valet_tests::cgroups::TestCgroups;
use valet_tests::harness::{Agent, JobPod, JobSpec, Node, eventually};

const SECTIONS: &str = "exit|quit|release|storm|kernel|together|node|soak|observe";

struct Args {
    runs: Option<usize>,
    soak: Option<usize>,
    quick: bool,
    only: Option<String>,
}

fn parse_args() -> Result<Args> {
    let mut args = Args { runs: None, soak: None, quick: false, only: None };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--runs" => args.runs = Some(it.next().context("--runs N")?.parse()?),
            "--soak" => args.soak = Some(it.next().context("--soak JOBS")?.parse()?),
            "--quick" => args.quick = true,
            "--only" => {
                let only = it.next().context(SECTIONS)?;
                if !SECTIONS.split('|').any(|s| s == only) {
                    bail!("--only {only}: one of {SECTIONS}");
                }
                args.only = Some(only);
            }
            "-h" | "--help" => {
                println!("valet-bench [--quick] [--runs N] [--soak JOBS] [--only {SECTIONS}]");
                std::process::exit(0);
            }
            other => bail!("unknown argument {other}"),
        }
    }
    Ok(args)
}

/// How big each section is: the full run (about 15 minutes on 2 cores) or `--quick`.
struct Plan {
    quick: bool,
    /// Pods per side in [3], holds in [4].
    runs: usize,
    /// The fork storm's length and the agent stall in it.
    storm: Duration,
    stall: Duration,
    /// Other Jobs during the storm.
    storm_jobs: usize,
    /// [8]: long-running pods, and Jobs started within one second beside them.
    services: usize,
    jobs: usize,
    /// [8]: how long the agent's idle CPU is measured.
    idle: Duration,
    /// [9]: Jobs in all, and per batch.
    soak: usize,
    batch: usize,
}

impl Plan {
    fn new(args: &Args) -> Plan {
        let mut plan = if args.quick {
            Plan {
                quick: true,
                runs: 20,
                storm: Duration::from_secs(12),
                stall: Duration::from_secs(2),
                storm_jobs: 5,
                services: 20,
                jobs: 10,
                idle: Duration::from_secs(8),
                soak: 200,
                batch: 50,
            }
        } else {
            Plan {
                quick: false,
                runs: 60,
                storm: Duration::from_secs(60),
                stall: Duration::from_secs(3),
                storm_jobs: 20,
                services: 60,
                jobs: 50,
                idle: READY_PROBE_INTERVAL,
                soak: 10_000,
                batch: 50,
            }
        };
        if let Some(runs) = args.runs {
            plan.runs = runs;
        }
        if let Some(soak) = args.soak {
            plan.soak = soak;
        }
        plan
    }
}

/// The summary: one row per figure, with its reference (measured in the same run) and target.
#[derive(Default)]
struct Table {
    rows: Vec<[String; 5]>,
    /// The in-pod wrapper's exit → quit median (µs), the reference of later quit figures.
    wrapper_median: Option<f64>,
}

impl Table {
    fn add(&mut self, figure: &str, valet: String, reference: &str, target: &str, result: String) {
        self.rows.push([figure.to_owned(), valet, reference.to_owned(), target.to_owned(), result]);
    }

    /// Prints the table in Markdown, ready for the README.
    fn print(&self, machine: &str, took: Duration, quick: bool) {
        println!("\n## valet bench{}: {machine}, {:.0} s", if quick { " --quick" } else { "" }, took.as_secs_f64());
        println!();
        println!("| figure | valet | reference (same run) | target | result |");
        println!("|---|---|---|---|---|");
        for [figure, valet, reference, target, result] in &self.rows {
            println!("| {figure} | {valet} | {reference} | {target} | {result} |");
        }
    }
}

fn met(ok: bool) -> &'static str {
    if ok { "met" } else { "NOT met" }
}

/// The date, CPU, core count and kernel this run is on.
fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find_map(|l| l.strip_prefix("model name").map(|v| v.trim_start_matches([' ', '\t', ':']).to_owned()))
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let date = Command::new("date")
        .args(["-u", "+%Y-%m-%d"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default();
    format!(
        "{date}, {} cores ({cpu}), kernel {}",
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        kernel.trim()
    )
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

/// Median, p99 and maximum of microsecond samples.
#[derive(Clone, Copy)]
struct Stats {
    median: f64,
    p99: f64,
    max: f64,
    n: usize,
}

impl Stats {
    /// `median / p99` in milliseconds.
    fn ms(&self) -> String {
        format!("{:.2} / {:.2} ms", self.median / 1e3, self.p99 / 1e3)
    }

    fn us(&self) -> String {
        format!("{:.0} / {:.0} µs", self.median, self.p99)
    }
}

/// Prints median, p99, min and max of microsecond samples.
fn report(label: &str, mut us: Vec<f64>) -> Stats {
    us.sort_by(|a, b| a.total_cmp(b));
    let (median, p99) = (percentile(&us, 0.5), percentile(&us, 0.99));
    let max = us.last().copied().unwrap_or(f64::NAN);
    println!(
        "  {label:<46} n={:<5} median {:>9.1} µs   p99 {:>9.1} µs   min {:>8.1} µs   max {:>9.1} µs",
        us.len(),
        median,
        p99,
        us.first().copied().unwrap_or(f64::NAN),
        max
    );
    Stats { median, p99, max, n: us.len() }
}

fn bin(name: &str) -> Result<std::path::PathBuf> {
    let exe = std::env::current_exe()?;
    let p = exe.parent().context("exe dir")?.join(name);
    if !p.is_file() {
        bail!("{} missing: build with `cargo build --release -p valet-tests`", p.display());
    }
    Ok(p)
}

/// 1. Exit events: kernel timestamp to user-space receipt.
fn exit_latency(runs: usize, table: &mut Table) -> Result<()> {
    println!("\n[1] kernel → user latency of exit events ({runs} processes)");
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async {
        let mut programs = Programs::load(Path::new("/"), Attach { exits: true, execs: false, ..Attach::default() })?;
        let mut stream = EventStream::new(programs.take_events().context("ring")?)?;
        let mut cgroups = TestCgroups::new()?;
        let pod = format!("kubepods/besteffort/pod{}", valet_sim::util::uuid_v4());
        let rel = format!("{pod}/{}", "ab".repeat(32));
        cgroups.create(&pod)?;
        cgroups.create(&rel)?;
        programs.watch(cgroups.id(&pod)?, watch_flags::EXITS)?;
        let mut samples = Vec::with_capacity(runs);
        for _ in 0..runs {
            // Pid 1 of a pid namespace of its own, as a container's main process: the kernel
            // reports only exits that can end a container.
            let mut cmd = Command::new("unshare");
            cmd.args(["--pid", "--fork", "/bin/true"]).stdout(std::process::Stdio::null());
            let mut child = cgroups.spawn_in(&rel, &mut cmd)?;
            let batch = tokio::time::timeout(Duration::from_secs(2), stream.next_batch()).await??;
            let now = monotonic_ns();
            let _ = child.wait();
            for event in batch {
                if let Event::Exit(e) = event {
                    samples.push(now.saturating_sub(e.ktime_ns) as f64 / 1000.0);
                }
            }
        }
        let st = report("exit event latency", samples);
        table.add("[1] exit event, kernel → agent (median / p99)", st.us(), "—", "—", "—".into());
        Ok::<_, anyhow::Error>(())
    })
}

/// The agent's memory and CPU, to size the DaemonSet's requests and limits from measurement.
fn print_resources(pid: u32, wall: Duration, pods: usize) {
    let field = |name: &str| status_field(pid, name).unwrap_or_default();
    let cpu = cpu_time(pid).as_secs_f64();
    println!(
        "  agent resources over {:.0} s and {pods} pods: RSS {} (peak {}), CPU {:.2} s = {:.1} millicores on average",
        wall.as_secs_f64(),
        field("VmRSS:"),
        field("VmHWM:"),
        cpu,
        cpu / wall.as_secs_f64() * 1000.0
    );
}

/// CPU time (user + system) of a process so far.
fn cpu_time(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let fields: Vec<&str> = stat.rsplit(')').next().unwrap_or_default().split_whitespace().collect();
    // utime and stime are fields 14 and 15 of stat, 12 and 13 after the command name.
    let ticks: u64 = fields.get(11).and_then(|u| u.parse().ok()).unwrap_or(0)
        + fields.get(12).and_then(|s| s.parse().ok()).unwrap_or(0);
    // SAFETY: plain sysconf query.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    Duration::from_secs_f64(ticks as f64 / hz)
}

/// The CPU share (of one core) process `pid` used over `window`, from each thread's
/// `schedstat` (ns on a CPU), read every 50 ms so threads that come and go in the window count
/// too: precise where `/proc/<pid>/stat`'s clock ticks are 10 ms.
fn cpu_share(pid: u32, window: Duration) -> f64 {
    let read = || -> Vec<(u32, u64)> {
        let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return Vec::new() };
        dir.flatten()
            .filter_map(|t| {
                let tid = t.file_name().to_str()?.parse().ok()?;
                let stat = std::fs::read_to_string(t.path().join("schedstat")).ok()?;
                Some((tid, stat.split_whitespace().next()?.parse().ok()?))
            })
            .collect()
    };
    let mut threads: std::collections::HashMap<u32, (u64, u64)> =
        read().into_iter().map(|(t, v)| (t, (v, v))).collect();
    let started = Instant::now();
    while started.elapsed() < window {
        std::thread::sleep(Duration::from_millis(50));
        for (tid, v) in read() {
            // A thread born in the window counts from zero.
            threads.entry(tid).or_insert((0, v)).1 = v;
        }
    }
    let ns: u64 = threads.values().map(|(first, last)| last.saturating_sub(*first)).sum();
    // VALET_BENCH_THREADS=1: where the time went, by thread name.
    if std::env::var_os("VALET_BENCH_THREADS").is_some() {
        let mut by_name: std::collections::BTreeMap<String, u64> = std::collections::BTreeMap::new();
        for (tid, (first, last)) in &threads {
            let comm =
                std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/comm")).unwrap_or_else(|_| "(gone)".into());
            *by_name.entry(comm.trim().to_owned()).or_default() += last.saturating_sub(*first);
        }
        let secs = started.elapsed().as_secs_f64();
        let words: Vec<String> =
            by_name.iter().map(|(n, v)| format!("{n} {:.2} %", *v as f64 / 1e9 / secs * 100.0)).collect();
        println!("  threads: {}", words.join(", "));
    }
    ns as f64 / 1e9 / started.elapsed().as_secs_f64()
}

/// Whether `pid` is stopped (state `T`): held by the kernel before its first instruction.
fn stopped(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map(|s| s.rsplit(')').next().and_then(|r| r.split_whitespace().next()) == Some("T"))
        .unwrap_or(false)
}

fn read_stamp(path: &Path) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.lines().next()?.trim().parse().ok()
}

/// How long the Job's app runs in [3] and [5]: a short Job, over before the API names it.
const JOB_MS: &str = "300";

/// The in-pod wrapper's arguments before the app's command: the port and path it POSTs to once
/// the app exited (Istio's quit endpoint).
const WRAPPER_ARGS: [&str; 3] = ["15020", "/quitquitquit", "--"];

/// The agent's default `--ready-probe-interval`: every pod whose proxy was seen ready is probed
/// again once per interval, all in the same round. An idle figure is measured over one whole
/// interval, so that it holds one round, as the agent's average does; a shorter window counts
/// the round's cost not at all or several times over, depending on whether a round falls in it.
const READY_PROBE_INTERVAL: Duration = Duration::from_secs(30);

/// A free TCP port on the host's loopback.
fn free_port() -> Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// The stand-in proxy's own part of a quit figure: from the client's first byte (a kept
/// connection) or its connect (a fresh one) until the stand-in has read the request head and
/// taken its timestamp. Measured on a stand-in on the host's loopback with `GET /healthz/ready`
/// (which, unlike the quit, leaves it running). Returns (kept, fresh) in µs.
fn standin_cost(runs: usize, scratch: &Path) -> Result<(Stats, Stats)> {
    use std::io::{Read as _, Write as _};
    use valet_sim::standin::{ProxyKind, StandinOptions, read_events};
    let events = scratch.join("standin-cost.events");
    let mut opts = StandinOptions::new(ProxyKind::Istio);
    opts.events = Some(events.clone());
    let status = free_port()?;
    opts.status_port = Some(status);
    opts.health_port = Some(free_port()?);
    opts.admin_port = Some(free_port()?);
    let mut proxy = Command::new(valet_sim::standin::binary_path()?).args(opts.to_args()).spawn()?;
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], status));
    let result = (|| {
        valet_sim::standin::wait_http_ok(addr, "/healthz/ready", Duration::from_secs(5))?;
        let request = b"GET /healthz/ready HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n";
        let answer = |stream: &mut std::net::TcpStream| -> Result<()> {
            let mut buf = [0u8; 1024];
            let n = stream.read(&mut buf)?;
            if !buf[..n].starts_with(b"HTTP/1.1 200") {
                bail!("stand-in answered {:?}", String::from_utf8_lossy(&buf[..n]));
            }
            Ok(())
        };
        let stamps = |sent: &[(u64, std::net::SocketAddr)]| -> Result<Vec<f64>> {
            let logged = read_events(&events)?;
            Ok(sent
                .iter()
                .filter_map(|(t0, peer)| {
                    logged
                        .iter()
                        .find(|e| e.method == "GET" && e.peer == *peer)
                        .map(|e| e.mono_ns.saturating_sub(*t0) as f64 / 1e3)
                })
                .collect())
        };
        // Kept: one connection, a request at a time with a pause between them (as a quit comes
        // long after the connection was opened). Each request is on its own connection's log line
        // by peer, so one connection per request, opened ahead.
        let mut kept = Vec::new();
        for _ in 0..runs {
            let mut stream = std::net::TcpStream::connect(addr)?;
            stream.set_nodelay(true)?;
            std::thread::sleep(Duration::from_millis(2));
            let t0 = monotonic_ns();
            stream.write_all(request)?;
            answer(&mut stream)?;
            kept.push((t0, stream.local_addr()?));
        }
        let mut fresh = Vec::new();
        for _ in 0..runs {
            std::thread::sleep(Duration::from_millis(2));
            let t0 = monotonic_ns();
            let mut stream = std::net::TcpStream::connect(addr)?;
            stream.set_nodelay(true)?;
            stream.write_all(request)?;
            answer(&mut stream)?;
            fresh.push((t0, stream.local_addr()?));
        }
        let kept = report("stand-in's own receipt, kept connection", stamps(&kept)?);
        let fresh = report("stand-in's own receipt, fresh connection", stamps(&fresh)?);
        Ok((kept, fresh))
    })();
    let _ = proxy.kill();
    let _ = proxy.wait();
    result
}

/// 3. App exit → quit received, valet vs an in-pod wrapper.
fn quit_latency(runs: usize, table: &mut Table) -> Result<()> {
    println!("\n[3] app exit → quit received by the proxy, 0.3 s Jobs ({runs} pods each)");
    let app = bin("valet-bench-app")?;
    let wrapper = bin("valet-bench-wrapper")?;
    let app = app.to_str().context("path")?.to_owned();
    let wrapper = wrapper.to_str().context("path")?.to_owned();
    let node = Node::new()?;
    let agent = node.start_agent(&[])?;
    let one = |with_valet: bool, i: usize| -> Result<(f64, bool)> {
        let mut spec = JobSpec::new(if with_valet { "bench-valet" } else { "bench-wrapper" });
        spec.labelled = with_valet;
        let mut job = node.job_pod(spec)?;
        if with_valet {
            agent.wait_tracked(1, Duration::from_secs(5))?;
        }
        let stamp = node.scratch.path(&format!("stamp-{with_valet}-{i}"));
        let stamp_s = stamp.to_str().context("path")?.to_owned();
        let mut cmd: Vec<&str> = Vec::new();
        if !with_valet {
            cmd.push(&wrapper);
            cmd.extend(WRAPPER_ARGS);
        }
        cmd.extend([app.as_str(), &stamp_s, "0", JOB_MS]);
        job.start_app("app", &cmd, &SpawnOptions::default())?;
        if job.wait_proxy_exit(Duration::from_secs(5))?.is_none() {
            bail!("run {i}: proxy still running\n{}", agent.log_text());
        }
        let quit = job.quits().into_iter().next().context("no quit recorded")?;
        let exited = read_stamp(&stamp).context("no app stamp")?;
        // Whether the quit went on a connection that was open before the app exited.
        let kept = job.accepted(&quit).is_some_and(|at| at < exited);
        node.api.delete_pod("jobs", &job.name).ok();
        drop(job);
        if with_valet {
            agent.wait_tracked(0, Duration::from_secs(5))?;
        }
        Ok((quit.mono_ns.saturating_sub(exited) as f64 / 1000.0, kept))
    };
    let started = Instant::now();
    // Interleaved, so drift in the machine's load touches both sides alike.
    let (mut wrapper_samples, mut valet_samples) = (Vec::new(), Vec::new());
    for i in 0..runs {
        wrapper_samples.push(one(false, i)?);
        valet_samples.push(one(true, i)?);
    }
    if let Some(pid) = agent.pid() {
        print_resources(pid, started.elapsed(), 2 * runs);
    }
    let w = report("in-pod wrapper (waitpid, then POST)", wrapper_samples.drain(..).map(|s| s.0).collect());
    let v = report("valet (eBPF exit → POST)", valet_samples.iter().map(|s| s.0).collect());
    let kept = valet_samples.iter().filter(|s| s.1).count();
    let fresh: Vec<f64> = valet_samples.drain(..).filter(|s| !s.1).map(|s| s.0).collect();
    println!("  valet quits on a connection opened before the exit: {kept} of {}", v.n);
    if !fresh.is_empty() {
        report("valet, quits on a fresh connection", fresh);
    }
    let (own_kept, own_fresh) = standin_cost(runs.min(100), &node.scratch.0)?;
    let ratio = v.median / w.median;
    table.wrapper_median = Some(w.median);
    table.add(
        "[3] app exit → quit received, 0.3 s Job (median / p99)",
        v.ms(),
        &format!("in-pod wrapper {}", w.ms()),
        "≤ 1.0× wrapper",
        format!("{ratio:.2}× ({:+.0} µs): {}", v.median - w.median, met(ratio <= 1.0)),
    );
    table.add(
        "[3] … of which the stand-in proxy's own receipt (median)",
        format!("{:.0} µs (kept connection)", own_kept.median),
        &format!("{:.0} µs (fresh connection)", own_fresh.median),
        "—",
        format!("valet's quits on a connection opened before the exit: {kept} of {}", v.n),
    );
    Ok(())
}

/// 4. Proxy ready → held app released.
fn release_latency(runs: usize, table: &mut Table) -> Result<()> {
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

/// Waits until the agent's `valet_pods_tracked` is `n`, polling its metrics as fast as it
/// answers; the time it took.
fn tracked_after(agent: &Agent, n: f64, since: Instant) -> Result<Duration> {
    while agent.metric("valet_pods_tracked ") != n {
        if since.elapsed() > Duration::from_secs(10) {
            bail!("the agent never tracked {n} pods");
        }
    }
    Ok(since.elapsed())
}

/// Pod-watch latency: a labelled pod object appears on the node (and is deleted again); the time
/// until the agent's tracked count shows it, `samples` times.
fn watch_latency(node: &Node, agent: &Agent, base: f64, samples: usize) -> Result<Vec<f64>> {
    let mut out = Vec::with_capacity(samples);
    for i in 0..samples {
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
        let t0 = Instant::now();
        node.api.create_pod(pod)?;
        out.push(tracked_after(agent, base + 1.0, t0)?.as_secs_f64() * 1e6);
        node.api.delete_pod("jobs", &name)?;
        tracked_after(agent, base, Instant::now())?;
    }
    Ok(out)
}

/// One 0.3 s Job: the time from its app's exit to the quit its proxy received, or None when the
/// proxy was not asked to quit within 5 s (a container end lost). `during` runs after the app
/// started (e.g. stalling the agent).
fn one_job(
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

/// 5. A watched pod forks short processes as fast as the machine allows.
fn storm(plan: &Plan, table: &mut Table) -> Result<()> {
    let jobs = plan.storm_jobs;
    println!(
        "\n[5] a watched pod forking as fast as it can: {jobs} other 0.3 s Jobs, pod-watch latency, an agent stall"
    );
    let app = bin("valet-bench-app")?;
    let app = app.to_str().context("path")?.to_owned();
    let forker = bin("valet-bench-forker")?;
    let forker = forker.to_str().context("path")?.to_owned();
    let node = Node::new()?;
    let agent = node.start_agent(&[])?;
    let events_lost = |a: &Agent| a.metric("valet_kernel_events_lost_total ");

    // Quiet machine first: the references.
    let quiet_watch = watch_latency(&node, &agent, 0.0, 30)?;
    let mut quiet_quits = Vec::new();
    for i in 0..jobs {
        if let Some(us) = one_job(&node, &agent, &app, &format!("quiet-{i}"), 1, || Ok(()))? {
            quiet_quits.push(us);
        }
    }

    // The storm: a labelled pod whose app forks in two processes for long enough.
    let mut busy = node.job_pod(JobSpec::new("busy"))?;
    agent.wait_tracked(1, Duration::from_secs(5))?;
    let count = node.scratch.path("forks");
    let count_s = count.to_str().context("path")?.to_owned();
    let storm_ms = plan.storm.as_millis() as u64;
    let started = Instant::now();
    busy.start_app("app", &[&forker, &storm_ms.to_string(), "2", &count_s], &SpawnOptions::default())?;
    std::thread::sleep(Duration::from_secs(1));
    let lost_before = events_lost(&agent);
    let mut storm_quits = Vec::new();
    let mut ends_lost = 0;
    for i in 0..jobs {
        match one_job(&node, &agent, &app, &format!("storm-{i}"), 2, || Ok(()))? {
            Some(us) => storm_quits.push(us),
            None => ends_lost += 1,
        }
    }
    let storm_watch = watch_latency(&node, &agent, 1.0, 30)?;
    // The agent stalled for 3 s (as CPU throttling under its limit would stall it) while another
    // pod's app ends: its quit must come from the kernel path right after the agent resumes.
    let pid = agent.pid().context("agent pid")? as i32;
    let stall = plan.stall;
    let stalled = one_job(&node, &agent, &app, "stalled", 2, || {
        // SAFETY: plain syscalls on our own child.
        unsafe { libc::kill(pid, libc::SIGSTOP) };
        std::thread::sleep(stall);
        unsafe { libc::kill(pid, libc::SIGCONT) };
        Ok(())
    })?;
    let lost_during = events_lost(&agent) - lost_before;
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
    let qw = report("pod-watch latency, quiet", quiet_watch);
    let sw = report("pod-watch latency, during the storm", storm_watch);
    let qq = report("exit → quit, 0.3 s Job, quiet", quiet_quits);
    let sq = report("exit → quit, 0.3 s Job, during the storm", storm_quits);
    // The quit of the app that ended while the agent was stopped, counted from the end of the stall.
    let after_stall =
        stalled.map(|us| (us / 1e3 - (stall.as_secs_f64() * 1e3 - JOB_MS.parse::<f64>().unwrap_or(0.0))).max(0.0));
    match after_stall {
        Some(ms) => println!(
            "  app ended during a {:.0} s agent stall: quit {ms:.0} ms after the agent resumed",
            stall.as_secs_f64()
        ),
        None => {
            ends_lost += 1;
            println!("  app ended during a {:.0} s agent stall: its proxy was NOT quit", stall.as_secs_f64());
        }
    }
    println!(
        "  container ends lost: {ends_lost} of {}; valet_kernel_events_lost_total during the storm: {lost_during:.0}",
        jobs + 1
    );
    table.add(
        "[5] fork storm in a watched pod (2 processes fork+_exit)",
        format!("{rate:.0} exits/s for {:.0} s", storm_ms as f64 / 1e3),
        "—",
        "as fast as the machine allows",
        "—".into(),
    );
    table.add(
        &format!(
            "[5] container ends lost ({jobs} Jobs in the storm + 1 during a {:.0} s agent stall)",
            stall.as_secs_f64()
        ),
        format!("{ends_lost} of {}", jobs + 1),
        "—",
        "0",
        met(ends_lost == 0).into(),
    );
    table.add(
        "[5] app ended during the agent stall: quit after the agent resumed",
        after_stall.map_or_else(|| "never".into(), |ms| format!("{ms:.0} ms")),
        "—",
        "right after it resumes (≤ 100 ms)",
        met(after_stall.is_some_and(|ms| ms <= 100.0)).into(),
    );
    table.add(
        "[5] valet_kernel_events_lost_total during the storm",
        format!("{lost_during:.0}"),
        "—",
        "only exits that cannot matter",
        (if ends_lost == 0 { "no container end among them" } else { "container ends lost" }).into(),
    );
    table.add(
        "[5] exit → quit, 0.3 s Job, during the storm (median / p99)",
        sq.ms(),
        &format!("quiet {}", qq.ms()),
        "—",
        format!("{:.2}× quiet", sq.median / qq.median),
    );
    table.add(
        "[5] pod-watch latency during the storm (median / p99)",
        sw.ms(),
        &format!("quiet {}", qw.ms()),
        "unchanged (≤ 2× quiet)",
        format!("{:.2}× quiet: {}", sw.median / qw.median, met(sw.median <= 2.0 * qw.median)),
    );
    Ok(())
}

/// When each SIGCONT was sent, from the kernel's `signal:signal_generate` tracepoint in a tracefs
/// instance of the bench's own (CLOCK_MONOTONIC): the release itself, before the released app
/// gets a CPU.
struct SignalTrace {
    dir: std::path::PathBuf,
}

impl SignalTrace {
    fn start() -> Result<SignalTrace> {
        let root = ["/sys/kernel/tracing", "/sys/kernel/debug/tracing"]
            .into_iter()
            .map(Path::new)
            .find(|p| p.join("instances").is_dir())
            .context("no tracefs (cargo xtask setup mounts it)")?;
        let dir = root.join("instances").join(format!("valet-bench-{}", std::process::id()));
        std::fs::create_dir(&dir).with_context(|| format!("mkdir {}", dir.display()))?;
        let trace = SignalTrace { dir };
        let event = trace.dir.join("events/signal/signal_generate");
        std::fs::write(trace.dir.join("trace_clock"), "mono").context("trace_clock mono")?;
        std::fs::write(event.join("filter"), format!("sig == {}", libc::SIGCONT)).context("event filter")?;
        std::fs::write(event.join("enable"), "1").context("enable signal_generate")?;
        Ok(trace)
    }

    /// The first SIGCONT sent to each pid since the last call (the buffer is cleared).
    fn sent(&self) -> std::collections::HashMap<u32, u64> {
        let text = std::fs::read_to_string(self.dir.join("trace")).unwrap_or_default();
        let _ = std::fs::write(self.dir.join("trace"), "");
        let mut sent = std::collections::HashMap::new();
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            // "<comm>-<tid> [001] d..2. 42197.312565: signal_generate: sig=18 ... pid=16835 grp=1 res=1"
            let Some((head, rest)) = line.split_once(": signal_generate:") else { continue };
            let at = head.rsplit(' ').next().and_then(|t| {
                let (s, us) = t.split_once('.')?;
                Some(s.parse::<u64>().ok()? * 1_000_000_000 + us.parse::<u64>().ok()? * 1_000)
            });
            let pid = rest.split_whitespace().find_map(|f| f.strip_prefix("pid=")?.parse::<u32>().ok());
            if let (Some(at), Some(pid)) = (at, pid) {
                sent.entry(pid).or_insert(at);
            }
        }
        sent
    }
}

impl Drop for SignalTrace {
    fn drop(&mut self) {
        let _ = std::fs::write(self.dir.join("events/signal/signal_generate/enable"), "0");
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// Section 7, many held pods at once: their proxies turn ready together. Over `rounds` rounds of
/// `pods` new pods each: the moment the proxies turn ready falls at a new place in the agent's
/// probe period each round (one round is one draw of it).
fn held_together(pods: usize, rounds: usize, table: &mut Table) -> Result<()> {
    const CPU_ROUNDS: usize = 3;
    println!("\n[7] {pods} pods held at once, their proxies ready at the same moment ({rounds} rounds)");
    let app = bin("valet-bench-app")?;
    let app = app.to_str().context("path")?.to_owned();
    let node = Node::new()?;
    let agent = node.start_agent(&[])?;
    let pid = agent.pid().context("agent pid")?;
    let trace = SignalTrace::start().map_err(|e| println!("  (SIGCONT times not traced: {e:#})")).ok();
    let (mut samples, mut released, mut cpu) = (Vec::new(), Vec::new(), Vec::new());
    for round in 0..rounds {
        let mut jobs = Vec::new();
        // One file for every stand-in of the round: made once, it turns them all ready at the same
        // instant (a file each, written one after another, spread the moment over milliseconds
        // whenever the writer lost its CPU to the probes it set off).
        let ready = node.scratch.path(&format!("together-ready-{round}"));
        for i in 0..pods {
            let mut spec = JobSpec::new("together").annotation("valet.dev/hold-app", "true");
            spec.ready_file = Some(ready.clone());
            let mut job = node.job_pod(spec)?;
            let stamp = node.scratch.path(&format!("together-ran-{round}-{i}"));
            let stamp_s = stamp.to_str().context("path")?.to_owned();
            let app_pid =
                job.start_app("app", &[&app, &stamp_s, "0", "0", "2000"], &SpawnOptions::default())?.host_pid();
            jobs.push((job, stamp, app_pid));
        }
        agent.wait_tracked(pods, Duration::from_secs(10))?;
        let all_held = eventually(Duration::from_secs(10), || jobs.iter().all(|(_, _, p)| stopped(*p)));
        if !all_held {
            bail!("not every app was held\n{}", agent.log_text());
        }
        // Once the kubelet has reported the containers (about a second after they started, and
        // the agent's work of naming them and opening their networks is done), the agent only
        // probes every held pod's proxy until it is ready: its CPU over 5 s of that, in the
        // first rounds. The later ones are more draws of the moment in the probe period.
        std::thread::sleep(Duration::from_millis(1500));
        if round < CPU_ROUNDS {
            // VALET_BENCH_CPU_SECS: a longer window, to look at the agent meanwhile.
            let secs = std::env::var("VALET_BENCH_CPU_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(5);
            cpu.push(cpu_share(pid, Duration::from_secs(secs)));
        }
        if let Some(trace) = &trace {
            trace.sent();
        }
        let t_ready = monotonic_ns();
        std::fs::write(&ready, b"")?;
        for (i, (_, stamp, _)) in jobs.iter().enumerate() {
            if !eventually(Duration::from_secs(5), || read_stamp(stamp).is_some()) {
                bail!("round {round}, pod {i}: app not released\n{}", agent.log_text());
            }
            samples.push(read_stamp(stamp).context("stamp")?.saturating_sub(t_ready) as f64 / 1000.0);
        }
        if let Some(trace) = &trace {
            let sent = trace.sent();
            for (i, (.., app_pid)) in jobs.iter().enumerate() {
                match sent.get(app_pid) {
                    Some(at) => released.push(at.saturating_sub(t_ready) as f64 / 1000.0),
                    None => println!("  round {round}, pod {i}: its SIGCONT was not traced (left out)"),
                }
            }
        }
        remove_jobs(&node, jobs.into_iter().map(|j| j.0).collect());
        agent.wait_tracked(0, Duration::from_secs(30))?;
    }
    let r = (!released.is_empty()).then(|| report("released (SIGCONT sent) after its proxy is ready", released));
    let m = report("held app runs after its proxy is ready", samples);
    let cpu = cpu.iter().sum::<f64>() / cpu.len().max(1) as f64;
    println!("  agent CPU while probing {pods} held pods: {:.1} % of one core", cpu * 100.0);
    table.add(
        &format!("[7] {pods} pods held at once, proxies ready together: released, SIGCONT sent (median / p99)"),
        r.as_ref().map_or_else(|| "—".into(), Stats::ms),
        "—",
        "median ≤ 12.5 ms",
        r.as_ref().map_or_else(|| "not traced".into(), |r| met(r.median <= 12_500.0).into()),
    );
    table.add(
        "[7] … the released app runs (median / p99)",
        m.ms(),
        "—",
        "—",
        format!("its own start included: {pods} apps start at once"),
    );
    table.add(
        &format!("[7] agent CPU while probing {pods} held pods"),
        format!("{:.1} % of one core", cpu * 100.0),
        "—",
        "≤ 5 %",
        met(cpu <= 0.05).into(),
    );
    Ok(())
}

/// Sum of `run_time_ns` and `run_cnt` over the loaded programs named `valet_exit*`.
fn exit_program_stats() -> (u64, u64) {
    let mut time = 0u64;
    let mut count = 0u64;
    for info in aya::programs::loaded_programs().flatten() {
        if info.name_as_str().is_some_and(|n| n.starts_with("valet_exit")) {
            time += info.run_time().as_nanos() as u64;
            count += info.run_count();
        }
    }
    (time, count)
}

/// Runs the forker for `ms` in `cgroup` (None: the bench's own cgroup); exits per second.
fn fork_rate(cgroups: &TestCgroups, cgroup: Option<&str>, ms: u64) -> Result<f64> {
    let forker = bin("valet-bench-forker")?;
    let out = std::env::temp_dir().join(format!("valet-forks-{}", std::process::id()));
    let mut cmd = Command::new(&forker);
    cmd.args([&ms.to_string(), "2", out.to_str().context("path")?]);
    let mut child = match cgroup {
        Some(rel) => cgroups.spawn_in(rel, &mut cmd)?,
        None => cmd.spawn()?,
    };
    child.wait()?;
    let n: f64 = std::fs::read_to_string(&out)?.trim().parse()?;
    let _ = std::fs::remove_file(&out);
    Ok(n / (ms as f64 / 1000.0))
}

/// 6. What the kernel programs cost each exit, from the kernel's own BPF statistics.
fn kernel_cost(table: &mut Table) -> Result<()> {
    println!("\n[6] cost of the exit program per process exit (kernel.bpf_stats_enabled: run_time_ns ÷ run_cnt)");
    // Keeps the kernel's statistics on while held (as sysctl kernel.bpf_stats_enabled=1).
    let _stats = aya::sys::enable_stats(aya::sys::Stats::RunTime).context("enable BPF run-time statistics")?;
    let mut cgroups = TestCgroups::new()?;
    let pod = format!("kubepods/besteffort/pod{}", valet_sim::util::uuid_v4());
    let container = format!("{pod}/{}", "cd".repeat(32));
    cgroups.create(&pod)?;
    cgroups.create(&container)?;
    let ms = 3000;
    let detached = fork_rate(&cgroups, None, ms)?;
    let mut programs = Programs::load(Path::new("/"), Attach::default())?;
    for id in 0..110u64 {
        programs.watch(u64::MAX - id, watch_flags::EXITS | watch_flags::HOLD)?;
    }
    programs.watch(cgroups.id(&pod)?, watch_flags::EXITS)?;
    let measure = |cgroup: Option<&str>| -> Result<(f64, f64)> {
        let (t0, c0) = exit_program_stats();
        let rate = fork_rate(&cgroups, cgroup, ms)?;
        let (t1, c1) = exit_program_stats();
        let per = (t1 - t0) as f64 / (c1 - c0).max(1) as f64;
        Ok((rate, per))
    };
    let (outside_rate, outside_ns) = measure(None)?;
    let (inside_rate, inside_ns) = measure(Some(&container))?;
    drop(programs);
    let detached_again = fork_rate(&cgroups, None, ms)?;
    let reference = (detached + detached_again) / 2.0;
    println!("  exits outside watched pods (110 pods watched): {outside_ns:>6.0} ns per exit");
    println!("  exits inside a watched pod (filtered there):   {inside_ns:>6.0} ns per exit");
    println!(
        "  fork+_exit loop, 2 processes: detached {reference:.0}/s, attached {outside_rate:.0}/s outside and \
         {inside_rate:.0}/s inside a watched pod (ratio {:.3} / {:.3})",
        outside_rate / reference,
        inside_rate / reference
    );
    table.add(
        "[6] exit program per exit, outside / inside a watched pod (BPF stats)",
        format!("{outside_ns:.0} / {inside_ns:.0} ns"),
        "—",
        "—",
        "—".into(),
    );
    table.add(
        "[6] tight fork+_exit loop (2 processes), programs attached: outside / inside a watched pod",
        format!("{outside_rate:.0} / {inside_rate:.0} exits/s"),
        &format!("detached {reference:.0} exits/s"),
        "—",
        format!("{:.3} / {:.3} of detached", outside_rate / reference, inside_rate / reference),
    );
    Ok(())
}

/// One field of `/proc/<pid>/status` (`name` with its colon), trimmed.
fn status_field(pid: u32, name: &str) -> Option<String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status.lines().find_map(|l| l.strip_prefix(name)).map(|v| v.trim().to_owned())
}

/// Resident set size of a process, in KiB.
fn rss_kib(pid: u32) -> u64 {
    status_field(pid, "VmRSS:").and_then(|v| v.split_whitespace().next()?.parse().ok()).unwrap_or(0)
}

/// Open file descriptors of a process.
fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map(|d| d.count()).unwrap_or(0)
}

/// Entries in the hash maps a process holds open (found through its fds' `map_id`), by map name.
fn map_entries(pid: u32) -> std::collections::BTreeMap<String, usize> {
    use std::os::fd::{AsFd as _, AsRawFd as _};
    let mut out = std::collections::BTreeMap::new();
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fdinfo")) else { return out };
    let mut ids: Vec<u32> = dir
        .flatten()
        .filter_map(|e| std::fs::read_to_string(e.path()).ok())
        .filter_map(|info| info.lines().find_map(|l| l.strip_prefix("map_id:")?.trim().parse().ok()))
        .collect();
    ids.sort_unstable();
    ids.dedup();
    for id in ids {
        let Ok(info) = aya::maps::MapInfo::from_id(id) else { continue };
        if !matches!(info.map_type(), Ok(aya::maps::MapType::Hash | aya::maps::MapType::LruHash)) {
            continue;
        }
        let (Ok(fd), Some(name)) = (info.fd(), info.name_as_str().map(str::to_owned)) else { continue };
        let mut key = vec![0u8; info.key_size() as usize];
        let mut next = vec![0u8; info.key_size() as usize];
        let mut n = 0usize;
        let mut first = true;
        loop {
            // BPF_MAP_GET_NEXT_KEY: union bpf_attr { u32 map_fd; u64 key; u64 next_key; ... }.
            let mut attr = [0u64; 4];
            attr[0] = fd.as_fd().as_raw_fd() as u64;
            attr[1] = if first { 0 } else { key.as_ptr() as u64 };
            attr[2] = next.as_mut_ptr() as u64;
            // SAFETY: attr is a valid bpf_attr prefix for this command; key and next are key_size long.
            let r = unsafe { libc::syscall(libc::SYS_bpf, 4, attr.as_ptr(), std::mem::size_of_val(&attr)) };
            if r != 0 || n > 1_000_000 {
                break;
            }
            n += 1;
            first = false;
            key.copy_from_slice(&next);
        }
        *out.entry(name).or_insert(0) += n;
    }
    out
}

fn entries_text(entries: &std::collections::BTreeMap<String, usize>) -> String {
    entries.iter().map(|(k, v)| format!("{k} {v}")).collect::<Vec<_>>().join(", ")
}

/// Threads making or tearing down simulated pods at once.
const LANES: usize = 10;

/// Starts `n` labelled Job pods (proxy ready) as fast as the simulated node makes them (a few
/// at a time: making one is mostly waiting for processes).
fn make_jobs(node: &Node, tag: &str, n: usize) -> Result<Vec<JobPod>> {
    make_pods(node, tag, n, true)
}

/// [`make_jobs`], opted in or not.
fn make_pods(node: &Node, tag: &str, n: usize, labelled: bool) -> Result<Vec<JobPod>> {
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
fn remove_jobs(node: &Node, jobs: Vec<JobPod>) {
    for job in &jobs {
        node.api.delete_pod("jobs", &job.name).ok();
    }
    drop_jobs(jobs);
}

/// Tears pods down a few at a time.
fn drop_jobs(jobs: Vec<JobPod>) {
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
struct Burst {
    jobs: Vec<JobPod>,
    stamps: Vec<PathBuf>,
    run: Duration,
    /// When the first app was started.
    started: Instant,
}

impl Burst {
    /// `wrapped`: each app runs under the in-pod wrapper (pods not opted in), else bare (opted in).
    fn start(node: &Node, tag: &str, n: usize, run: Duration, wrapped: bool) -> Result<Burst> {
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
    fn quits(&mut self) -> Result<(Vec<f64>, usize)> {
        let (mut quits, mut lost) = (Vec::new(), 0);
        for (job, stamp) in self.jobs.iter_mut().zip(&self.stamps) {
            let left = self.run.saturating_sub(self.started.elapsed());
            let quit = match job.wait_proxy_exit(left + Duration::from_secs(5))? {
                Some(_) => job.quits().first().map(|q| q.mono_ns),
                None => None,
            };
            match (quit, read_stamp(stamp)) {
                (Some(q), Some(e)) => quits.push(q.saturating_sub(e) as f64 / 1e3),
                _ => lost += 1,
            }
        }
        Ok((quits, lost))
    }
}

/// Section 8, a full node: the kubelet's default maximum of pods, all opted in, 50 Jobs starting
/// at once. The reference for their quits is measured on the same node: as many Jobs in the same
/// kind of burst, each app under the in-pod wrapper, beside the same long-running pods.
fn full_node(plan: &Plan, table: &mut Table) -> Result<()> {
    let total = plan.services + plan.jobs;
    println!("\n[8] a full node: {total} opted-in pods tracked, {} Jobs started within one second", plan.jobs);
    let node = Node::new()?;
    let agent = node.start_agent(&[])?;
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
    // The reference first: the same burst with the wrapper quitting each proxy. Its apps run long
    // enough for the kubelet to have reported them started and ready before they end, as the
    // Jobs' below have.
    let mut wrapped = Burst::start(&node, "wrapped", plan.jobs, Duration::from_secs(10), true)?;
    let (wrapper_quits, wrapper_lost) = wrapped.quits()?;
    remove_jobs(&node, wrapped.jobs);
    // The kubelet's reports of their ends (~1 s after), before the opted-in burst.
    std::thread::sleep(Duration::from_secs(2));
    // The Jobs: pods made in a burst, then every app started within one second; each runs past
    // the idle window.
    let settle = Duration::from_secs(8);
    let mut jobs = Burst::start(&node, "burst", plan.jobs, settle + plan.idle + Duration::from_secs(4), false)?;
    agent.wait_tracked(total, Duration::from_secs(30))?;
    println!("  {total} tracked {:.2} s after the first app", jobs.started.elapsed().as_secs_f64());
    let full_watch = watch_latency(&node, &agent, total as f64, 20)?;
    // Idle: every proxy ready, every app running, the kubelet done reporting them (ids ~1 s after
    // the start, ready after the probes); the agent only keeps the conditions current.
    std::thread::sleep(settle.saturating_sub(jobs.started.elapsed()));
    let window = plan.idle;
    let idle_mc = cpu_share(pid, window) * 1e3;
    let rss = rss_kib(pid);
    if jobs.started.elapsed() >= jobs.run {
        println!("  (the Jobs' apps ended before the idle window did: the idle figure includes their ends)");
    }
    println!(
        "  idle with {total} pods: CPU {idle_mc:.2} millicores over {:.0} s, RSS {:.1} MiB, {} fds",
        window.as_secs_f64(),
        rss as f64 / 1024.0,
        open_fds(pid)
    );
    // The Jobs end within the same second as they started: their quits.
    let (quits, lost) = jobs.quits()?;
    let w = report(&format!("in-pod wrapper, {} Jobs ending together", plan.jobs), wrapper_quits);
    let q = report(&format!("valet, {} Jobs ending together", plan.jobs), quits);
    let qw = report("pod-watch latency, no pods", quiet_watch);
    let fw = report(&format!("pod-watch latency, {total} pods"), full_watch);
    if let Some(quiet) = table.wrapper_median {
        println!("  slowest valet quit against [3]'s wrapper median (one Job at a time): {:.1}×", q.max / quiet);
    }
    drop_jobs(jobs.jobs);
    drop(services);
    table.add(
        &format!("[8] agent RSS, {total} pods tracked"),
        format!("{:.1} MiB", rss as f64 / 1024.0),
        "—",
        "≤ 20 MiB",
        met(rss <= 20 * 1024).into(),
    );
    table.add(
        &format!("[8] agent CPU, idle with {total} pods (over {:.0} s)", plan.idle.as_secs_f64()),
        format!("{idle_mc:.2} millicores"),
        "—",
        "≤ 2 millicores",
        met(idle_mc <= 2.0).into(),
    );
    table.add(
        &format!("[8] exit → quit, {} Jobs started within one second (median / p99, max)", plan.jobs),
        format!("{}, {:.2} ms; {lost} not quit", q.ms(), q.max / 1e3),
        &format!("in-pod wrapper, same burst on this node: {}, {:.2} ms; {wrapper_lost} not quit", w.ms(), w.max / 1e3),
        "≤ 1.0× wrapper, median and slowest",
        format!(
            "median {:.2}×, slowest {:.2}×: {}",
            q.median / w.median,
            q.max / w.max,
            met(lost == 0 && q.median <= w.median && q.max <= w.max)
        ),
    );
    table.add(
        &format!("[8] pod-watch latency with {total} pods (median / p99)"),
        fw.ms(),
        &format!("no pods {}", qw.ms()),
        "no lag (≤ 2× no pods)",
        format!("{:.2}×: {}", fw.median / qw.median, met(fw.median <= 2.0 * qw.median)),
    );
    Ok(())
}

/// Section 10, observe mode on a full node: as many pods as [8], a tenth of them opted in and the
/// rest only observed (the observer's own watch of every pod, its records, and one readiness
/// probe per app the API showed started before its proxy was reported ready), every app running.
/// The agent's RSS and idle CPU against [8]'s targets, beside the same node with observation off.
fn observed_node(plan: &Plan, table: &mut Table) -> Result<()> {
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
fn observed_idle(plan: &Plan, total: usize, labelled: usize, observe: bool) -> Result<(u64, f64)> {
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

/// Section 9, the soak: many short Jobs through one node, a batch at a time; what the agent
/// holds at the start and at the end.
fn soak(plan: &Plan, table: &mut Table) -> Result<()> {
    println!("\n[9] soak: {} short Jobs through one node, {} at a time", plan.soak, plan.batch);
    let node = Node::new()?;
    let agent = node.start_agent(&[])?;
    let pid = agent.pid().context("agent pid")?;
    let snapshot = || (rss_kib(pid), open_fds(pid), map_entries(pid));
    let started = Instant::now();
    let (mut first, mut lost, mut done) = (None, 0usize, 0usize);
    let batches = plan.soak.div_ceil(plan.batch);
    let mut phases = [Duration::ZERO; 5];
    for b in 0..batches {
        let n = plan.batch.min(plan.soak - done);
        let mut t = Instant::now();
        let mut lap = |i: usize| {
            phases[i] += t.elapsed();
            t = Instant::now();
        };
        let mut jobs = make_jobs(&node, "soak", n)?;
        lap(0);
        agent.wait_tracked(n, Duration::from_secs(30))?;
        lap(1);
        if b == 0 {
            println!("  map entries with {n} Jobs tracked: {}", entries_text(&map_entries(pid)));
        }
        for job in &mut jobs {
            job.start_app("app", &["/bin/true"], &SpawnOptions::default())?;
        }
        for job in &mut jobs {
            if job.wait_proxy_exit(Duration::from_secs(10))?.is_none() {
                lost += 1;
            }
        }
        lap(2);
        remove_jobs(&node, jobs);
        // The fake API server runs in this process and records every request for tests to
        // inspect: kept, the record would grow by ~150 kB a Job and slow every fork.
        node.api.clear_requests();
        lap(3);
        agent.wait_tracked(0, Duration::from_secs(30))?;
        lap(4);
        done += n;
        if b == 0 {
            // After one batch: the runtime's pools and the kernel's maps are warm.
            first = Some(snapshot());
        }
        if (b + 1) % 20 == 0 || b + 1 == batches {
            let (rss, fds, maps) = snapshot();
            println!(
                "  {done:>6} Jobs, {:>5.0} s: RSS {:.1} MiB, {fds} fds, map entries: {}",
                started.elapsed().as_secs_f64(),
                rss as f64 / 1024.0,
                entries_text(&maps)
            );
        }
    }
    println!(
        "  time per Job: making {:.1} ms, until tracked {:.1} ms, app run and quit {:.1} ms, teardown {:.1} ms, \
         until untracked {:.1} ms",
        phases[0].as_secs_f64() * 1e3 / done as f64,
        phases[1].as_secs_f64() * 1e3 / done as f64,
        phases[2].as_secs_f64() * 1e3 / done as f64,
        phases[3].as_secs_f64() * 1e3 / done as f64,
        phases[4].as_secs_f64() * 1e3 / done as f64,
    );
    let (rss0, fds0, maps0) = first.context("no batch ran")?;
    let (rss1, fds1, maps1) = snapshot();
    let entries = |m: &std::collections::BTreeMap<String, usize>| m.values().sum::<usize>();
    table.add(
        &format!("[9] soak, {done} Jobs ({lost} not quit): agent RSS after the first batch → at the end"),
        format!("{:.1} → {:.1} MiB", rss0 as f64 / 1024.0, rss1 as f64 / 1024.0),
        "—",
        "flat (≤ +2 MiB), every Job quit",
        met(lost == 0 && rss1 <= rss0 + 2048).into(),
    );
    table.add(
        "[9] soak: open fds → at the end",
        format!("{fds0} → {fds1}"),
        "—",
        "flat (≤ +4: a request's socket may be open at the moment)",
        met(fds1 <= fds0 + 4).into(),
    );
    table.add(
        "[9] soak: kernel map entries → at the end",
        format!("{} → {} ({})", entries(&maps0), entries(&maps1), entries_text(&maps1)),
        "—",
        "flat",
        met(entries(&maps1) <= entries(&maps0)).into(),
    );
    Ok(())
}

fn main() -> Result<()> {
    let args = parse_args()?;
    valet_tests::cgroups::require_root();
    let plan = Plan::new(&args);
    let want = |s: &str| args.only.as_deref().is_none_or(|o| o == s);
    let machine = machine();
    println!("valet benchmarks{}: {machine}", if plan.quick { " (--quick: a smoke run, not figures)" } else { "" });
    let started = Instant::now();
    let mut table = Table::default();
    type Section<'a> = &'a dyn Fn(&mut Table) -> Result<()>;
    let sections: [(&str, Section); 9] = [
        ("exit", &|t| exit_latency(if plan.quick { 50 } else { 500 }, t)),
        ("quit", &|t| quit_latency(plan.runs, t)),
        ("release", &|t| release_latency(plan.runs / 2, t)),
        ("storm", &|t| storm(&plan, t)),
        ("kernel", &|t| kernel_cost(t)),
        ("together", &|t| held_together(20, if plan.quick { 1 } else { 20 }, t)),
        ("node", &|t| full_node(&plan, t)),
        ("soak", &|t| soak(&plan, t)),
        ("observe", &|t| observed_node(&plan, t)),
    ];
    for (name, section) in sections {
        if want(name) {
            let t = Instant::now();
            section(&mut table)?;
            println!("  ({name}: {:.0} s)", t.elapsed().as_secs_f64());
        }
    }
    table.print(&machine, started.elapsed(), plan.quick);
    Ok(())
}
