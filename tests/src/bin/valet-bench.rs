//! `cargo xtask bench`: valet's performance figures, printed, never asserted.
//!
//! 1. kernel → user latency of an exit event (median, p99);
//! 2. fork+exec+exit throughput of unrelated processes with the programs attached ÷ without;
//! 3. app exit → quit received by the stand-in proxy for a 0.3 s Job, valet vs an in-pod wrapper;
//! 4. proxy ready → held app released (what the hold adds beyond the proxy's own readiness);
//! 5. a watched pod forking short processes as fast as the machine allows: container ends lost,
//!    exit → quit and pod-watch latency during the storm and without it, and an app that ends
//!    while the agent is stalled (SIGSTOP) in the middle of the storm;
//! 6. the exit program's own cost per exit, from the kernel's BPF statistics;
//! 7. 20 pods held at once: release latency and the agent's CPU while it probes them.
//!
//! Pods run on the simulated node's kubelet as unhelpful as a real one (container ids and exits
//! reach the API about a second late; bundles and cgroups go at exit).
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use valet_agent::kernel::{Attach, Event, EventStream, Programs, events::monotonic_ns};
use valet_common::watch_flags;
use valet_sim::node::SpawnOptions;
use valet_tests::cgroups::TestCgroups;
use valet_tests::harness::{JobSpec, Node, eventually};

struct Args {
    runs: usize,
    only: Option<String>,
}

fn parse_args() -> Result<Args> {
    let mut args = Args { runs: 200, only: None };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--runs" => args.runs = it.next().context("--runs N")?.parse()?,
            "--only" => args.only = Some(it.next().context("--only exit|overhead|quit|release|storm|kernel|together")?),
            "-h" | "--help" => {
                println!("valet-bench [--runs N] [--only exit|overhead|quit|release|storm|kernel|together]");
                std::process::exit(0);
            }
            other => bail!("unknown argument {other}"),
        }
    }
    Ok(args)
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

/// Prints median and p99 of microsecond samples; returns the median.
fn report(label: &str, mut us: Vec<f64>) -> f64 {
    us.sort_by(|a, b| a.total_cmp(b));
    let (median, p99) = (percentile(&us, 0.5), percentile(&us, 0.99));
    println!(
        "  {label:<44} n={:<4} median {:>9.1} µs   p99 {:>9.1} µs   min {:>8.1} µs   max {:>9.1} µs",
        us.len(),
        median,
        p99,
        us.first().copied().unwrap_or(f64::NAN),
        us.last().copied().unwrap_or(f64::NAN)
    );
    median
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
fn exit_latency(runs: usize) -> Result<()> {
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
        report("exit event latency", samples);
        Ok::<_, anyhow::Error>(())
    })
}

/// fork+exec+exit of /bin/true for `window`; processes per second.
fn spawn_rate(window: Duration) -> f64 {
    let start = Instant::now();
    let mut n = 0u64;
    while start.elapsed() < window {
        if Command::new("/bin/true").status().is_ok() {
            n += 1;
        }
    }
    n as f64 / start.elapsed().as_secs_f64()
}

/// Overhead on unrelated processes (figure 2): alternating detached/attached windows; the ratio
/// of each adjacent pair cancels slow drift in machine load, and the median of the pairs is
/// reported.
fn overhead() -> Result<()> {
    println!("\n[2] fork+exec+exit throughput of unrelated processes, attached ÷ detached");
    let pairs = 10;
    let window = Duration::from_millis(1000);
    let mut programs = Programs::load(Path::new("/"), Attach::default())?;
    programs.detach();
    drop(programs);
    let _ = spawn_rate(Duration::from_millis(500)); // warm-up
    let (mut off, mut on, mut ratios) = (Vec::new(), Vec::new(), Vec::new());
    for pair in 0..pairs {
        let detached = spawn_rate(window);
        let mut programs = Programs::load(Path::new("/"), Attach::default())?;
        // A node's worth of watched pod cgroups, none of them the benchmark's.
        for id in 0..200u64 {
            programs.watch(u64::MAX - id, watch_flags::EXITS | watch_flags::HOLD)?;
        }
        let attached = spawn_rate(window);
        drop(programs);
        println!(
            "  pair {pair}: detached {detached:>7.0}/s   attached {attached:>7.0}/s   ratio {:.3}",
            attached / detached
        );
        off.push(detached);
        on.push(attached);
        ratios.push(attached / detached);
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(|a, b| a.total_cmp(b));
        percentile(v, 0.5)
    };
    let (m_off, m_on, m_ratio) = (median(&mut off), median(&mut on), median(&mut ratios));
    println!("  median detached {m_off:.0}/s, attached {m_on:.0}/s; median pair ratio {m_ratio:.3} (goal ≥ 0.99)");
    Ok(())
}

/// The agent's memory and CPU, to size the DaemonSet's requests and limits from measurement.
fn print_resources(pid: u32, wall: Duration, pods: usize) {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let field =
        |name: &str| status.lines().find_map(|l| l.strip_prefix(name)).map(|v| v.trim().to_owned()).unwrap_or_default();
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

/// 3. App exit → quit received, valet vs an in-pod wrapper.
fn quit_latency(runs: usize) -> Result<()> {
    println!("\n[3] app exit → quit received by the proxy, 0.3 s Jobs ({runs} pods each)");
    let app = bin("valet-bench-app")?;
    let wrapper = bin("valet-bench-wrapper")?;
    let app = app.to_str().context("path")?.to_owned();
    let wrapper = wrapper.to_str().context("path")?.to_owned();
    let node = Node::new()?;
    let agent = node.start_agent(&[])?;
    let measure = |with_valet: bool| -> Result<Vec<f64>> {
        let mut samples = Vec::new();
        for i in 0..runs {
            let mut spec = JobSpec::new(if with_valet { "bench-valet" } else { "bench-wrapper" });
            spec.labelled = with_valet;
            let mut job = node.job_pod(spec)?;
            if with_valet {
                agent.wait_tracked(1, Duration::from_secs(5))?;
            }
            let stamp = node.scratch.path(&format!("stamp-{with_valet}-{i}"));
            let stamp_s = stamp.to_str().context("path")?.to_owned();
            let cmd: Vec<&str> = if with_valet {
                vec![&app, &stamp_s, "0", JOB_MS]
            } else {
                vec![&wrapper, "15020", "/quitquitquit", "--", &app, &stamp_s, "0", JOB_MS]
            };
            job.start_app("app", &cmd, &SpawnOptions::default())?;
            if job.wait_proxy_exit(Duration::from_secs(5))?.is_none() {
                bail!("run {i}: proxy still running\n{}", agent.log_text());
            }
            let quit = job.quits().first().map(|q| q.mono_ns).context("no quit recorded")?;
            let exited = read_stamp(&stamp).context("no app stamp")?;
            samples.push(quit.saturating_sub(exited) as f64 / 1000.0);
            node.api.delete_pod("jobs", &job.name).ok();
            drop(job);
            if with_valet {
                agent.wait_tracked(0, Duration::from_secs(5))?;
            }
        }
        Ok(samples)
    };
    let started = Instant::now();
    let wrapper_samples = measure(false)?;
    let valet_samples = measure(true)?;
    if let Some(pid) = agent.pid() {
        print_resources(pid, started.elapsed(), 2 * runs);
    }
    let w = report("in-pod wrapper (waitpid, then POST)", wrapper_samples);
    let v = report("valet (eBPF exit → POST on a kept connection)", valet_samples);
    println!("  valet median ÷ wrapper median = {:.2} (goal ≤ 1.5)", v / w);
    Ok(())
}

/// 4. Proxy ready → held app released.
fn release_latency(runs: usize) -> Result<()> {
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
    println!(
        "  valet median is 1/{:.0} of the reference's (goal ≤ 12.5 ms: {})",
        r / m,
        if m <= 12_500.0 { "met" } else { "NOT met" }
    );
    Ok(())
}

/// Waits until the agent's `valet_pods_tracked` is `n`, polling its metrics as fast as it
/// answers; the time it took.
fn tracked_after(agent: &valet_tests::harness::Agent, n: f64, since: Instant) -> Result<Duration> {
    while agent.metric("valet_pods_tracked ") != n {
        if since.elapsed() > Duration::from_secs(10) {
            bail!("the agent never tracked {n} pods");
        }
    }
    Ok(since.elapsed())
}

/// Pod-watch latency: a labelled pod object appears on the node (and is deleted again); the time
/// until the agent's tracked count shows it, `samples` times.
fn watch_latency(node: &Node, agent: &valet_tests::harness::Agent, base: f64, samples: usize) -> Result<Vec<f64>> {
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
    agent: &valet_tests::harness::Agent,
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
fn storm(runs: usize) -> Result<()> {
    let jobs = runs.clamp(5, 20);
    println!(
        "\n[5] a watched pod forking as fast as it can: {jobs} other 0.3 s Jobs, pod-watch latency, an agent stall"
    );
    let app = bin("valet-bench-app")?;
    let app = app.to_str().context("path")?.to_owned();
    let forker = bin("valet-bench-forker")?;
    let forker = forker.to_str().context("path")?.to_owned();
    let node = Node::new()?;
    let agent = node.start_agent(&[])?;
    let events_lost = |a: &valet_tests::harness::Agent| a.metric("valet_kernel_events_lost_total ");

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
    let storm_ms: u64 = 25_000 + jobs as u64 * 1_500;
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
    let stall = Duration::from_secs(3);
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
    report("pod-watch latency, quiet", quiet_watch);
    report("pod-watch latency, during the storm", storm_watch);
    report("exit → quit, 0.3 s Job, quiet", quiet_quits);
    report("exit → quit, 0.3 s Job, during the storm", storm_quits);
    match stalled {
        Some(us) => println!(
            "  app ended during a {:.0} s agent stall: quit {:.0} ms after its exit (the stall ended {:.0} ms after it)",
            stall.as_secs_f64(),
            us / 1000.0,
            (stall.as_secs_f64() * 1e3 - 300.0).max(0.0)
        ),
        None => {
            ends_lost += 1;
            println!("  app ended during a {:.0} s agent stall: its proxy was NOT quit", stall.as_secs_f64());
        }
    }
    println!(
        "  container ends lost: {ends_lost} of {} (goal 0); valet_kernel_events_lost_total during the storm: {lost_during:.0}",
        jobs + 1
    );
    Ok(())
}

/// 7. Many held pods at once: their proxies turn ready together.
fn held_together(pods: usize) -> Result<()> {
    println!("\n[7] {pods} pods held at once, their proxies ready at the same moment");
    let app = bin("valet-bench-app")?;
    let app = app.to_str().context("path")?.to_owned();
    let node = Node::new()?;
    let agent = node.start_agent(&[])?;
    let pid = agent.pid().context("agent pid")?;
    let mut jobs = Vec::new();
    for i in 0..pods {
        let ready = node.scratch.path(&format!("together-ready-{i}"));
        let mut spec = JobSpec::new("together").annotation("valet.dev/hold-app", "true");
        spec.ready_file = Some(ready.clone());
        let mut job = node.job_pod(spec)?;
        let stamp = node.scratch.path(&format!("together-ran-{i}"));
        let stamp_s = stamp.to_str().context("path")?.to_owned();
        let app_pid = job.start_app("app", &[&app, &stamp_s, "0"], &SpawnOptions::default())?.host_pid();
        jobs.push((job, ready, stamp, app_pid));
    }
    agent.wait_tracked(pods, Duration::from_secs(10))?;
    let all_held = eventually(Duration::from_secs(10), || jobs.iter().all(|(_, _, _, p)| stopped(*p)));
    if !all_held {
        bail!("not every app was held\n{}", agent.log_text());
    }
    // The agent probes every held pod's proxy until it is ready: its CPU over 5 s of that.
    let window = Duration::from_secs(5);
    let (cpu0, t0) = (cpu_time(pid), Instant::now());
    std::thread::sleep(window);
    let cpu = (cpu_time(pid) - cpu0).as_secs_f64() / t0.elapsed().as_secs_f64();
    let t_ready = monotonic_ns();
    for (_, ready, _, _) in &jobs {
        std::fs::write(ready, b"")?;
    }
    let mut samples = Vec::new();
    for (i, (_, _, stamp, _)) in jobs.iter().enumerate() {
        if !eventually(Duration::from_secs(5), || read_stamp(stamp).is_some()) {
            bail!("pod {i}: app not released\n{}", agent.log_text());
        }
        samples.push(read_stamp(stamp).context("stamp")?.saturating_sub(t_ready) as f64 / 1000.0);
    }
    let m = report("held app runs after its proxy is ready", samples);
    println!(
        "  agent CPU while probing {pods} held pods: {:.1} % of one core (goal ≤ 5 %); release median goal ≤ 12.5 ms: {}",
        cpu * 100.0,
        if m <= 12_500.0 { "met" } else { "NOT met" }
    );
    drop(jobs);
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
fn kernel_cost() -> Result<()> {
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
    Ok(())
}

fn main() -> Result<()> {
    let args = parse_args()?;
    valet_tests::cgroups::require_root();
    let want = |s: &str| args.only.as_deref().is_none_or(|o| o == s);
    println!("valet benchmarks ({} cores)", std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1));
    if want("exit") {
        exit_latency(args.runs.max(200))?;
    }
    if want("overhead") {
        overhead()?;
    }
    if want("quit") {
        quit_latency(args.runs)?;
    }
    if want("release") {
        release_latency((args.runs / 2).max(50))?;
    }
    if want("storm") {
        storm(args.runs)?;
    }
    if want("kernel") {
        kernel_cost()?;
    }
    if want("together") {
        held_together(20)?;
    }
    Ok(())
}
