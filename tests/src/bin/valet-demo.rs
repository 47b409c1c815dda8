//! `cargo xtask demo`: the real agent on this host against a simulated node, with a timeline.
//!
//! Part 1: an Istio-injected Job pod whose app exits; valet sees it in the kernel and quits the
//! stand-in pilot-agent through the pod's own loopback, so the proxy exits 0.
//! Part 2: a pod with `valet.dev/hold-app`: the app is stopped before its first instruction and
//! released the moment the proxy turns ready.
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use valet_agent::host::clock::monotonic_ns;
use valet_sim::node::SpawnOptions;
use valet_tests::harness::{JobSpec, Node, eventually};

fn bin(name: &str) -> Result<String> {
    let p = std::env::current_exe()?.parent().context("exe dir")?.join(name);
    if !p.is_file() {
        bail!("{} missing: build with `cargo build --release -p valet-tests`", p.display());
    }
    Ok(p.to_string_lossy().into_owned())
}

fn stamp(path: &std::path::Path) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.lines().next()?.trim().parse().ok()
}

fn ms(from: u64, to: u64) -> String {
    let d = to as i128 - from as i128;
    if d.abs() < 10_000_000 { format!("{:+.3} ms", d as f64 / 1e6) } else { format!("{:+.1} ms", d as f64 / 1e6) }
}

/// `seen_after_us=N` from the agent's log line about the app's exit.
fn seen_after_us(log: &str) -> Option<u64> {
    log.lines()
        .filter(|l| l.contains("container exited"))
        .find_map(|l| l.split("seen_after_us=").nth(1)?.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok())
}

fn part1(node: &Node, agent: &valet_tests::harness::Agent, app: &str) -> Result<()> {
    println!("\n━━ 1. A Job's app exits; its Istio sidecar must go ━━");
    let mut job = node.job_pod(JobSpec::new("pi"))?;
    let ip = job.sim.pod_ip().context("pod IP")?;
    println!("pod jobs/{}: containers app + istio-proxy, pod IP {ip}, cgroup", job.name);
    println!("    {}", job.sim.pod_cgroup_path().display());
    agent.wait_tracked(1, Duration::from_secs(5))?;

    // Why valet enters the pod's network namespace: pilot-agent refuses non-loopback callers.
    let r = valet_sim::client::post(SocketAddr::from((ip, 15020)), "/quitquitquit", Duration::from_secs(2))?;
    println!("POST http://{ip}:15020/quitquitquit from the node → {} {:?}", r.status, r.text().trim());

    let stamp_file = node.scratch.path("app-exit");
    let stamp_s = stamp_file.to_string_lossy().into_owned();
    println!("starting the app (works 300 ms, then exits 0) …");
    job.start_app("app", &[app, &stamp_s, "0", "300"], &SpawnOptions::default())?;
    let code = job.wait_proxy_exit(Duration::from_secs(10))?;
    let proxy_gone = monotonic_ns();
    // The kubelet's view: it reports the app's exit on its next relist (every second).
    let api_exit = job.wait_api_terminated("app", Duration::from_secs(5)).map(|_| monotonic_ns());
    let exited = stamp(&stamp_file).context("app stamp")?;
    let quit = job.loopback_quits().first().map(|q| (q.mono_ns, q.peer)).context("the proxy got no quit")?;
    // The agent logs after it acted; give its log a moment to reach the file.
    std::thread::sleep(Duration::from_millis(100));
    let log = agent.log_text();
    println!("\ntimeline (CLOCK_MONOTONIC, from the app's last instruction):");
    println!("  {:>12}  app exited (code 0)", "0");
    if let Some(us) = seen_after_us(&log) {
        println!("  {:>12}  valet saw the exit in the kernel (event delivered {us} µs after the exit)", "");
    }
    println!("  {:>12}  quit received by pilot-agent, from {}", ms(exited, quit.0), quit.1);
    println!("  {:>12}  proxy exited with code {}", ms(exited, proxy_gone), code.map_or("?".into(), |c| c.to_string()));
    match api_exit {
        Some(t) => println!("  {:>12}  the API shows the app terminated (the kubelet's 1 s relist)", ms(exited, t)),
        None => println!("  {:>12}  the API did not show the app terminated within 5 s", ""),
    }
    if code != Some(0) {
        bail!("the proxy did not exit 0\n{log}");
    }
    let events = node.events_for(&job);
    for (reason, note) in &events {
        println!("  Event {reason}: {note}");
    }
    println!("→ all containers exited 0: the Job pod succeeds.");
    Ok(())
}

/// The status of the pod's `valet.dev/ProxyReady` condition, if set.
fn condition(node: &Node, job: &valet_tests::harness::JobPod) -> Option<String> {
    let pod = node.pod(job)?;
    let conditions = pod["status"]["conditions"].as_array()?;
    let c = conditions.iter().find(|c| c["type"] == "valet.dev/ProxyReady")?;
    c["status"].as_str().map(str::to_owned)
}

fn part2(node: &Node, agent: &valet_tests::harness::Agent, app: &str) -> Result<()> {
    println!("\n━━ 2. The app must not start before its proxy is ready ━━");
    let ready = node.scratch.path("proxy-ready");
    let mut spec = JobSpec::new("migrate").annotation("valet.dev/hold-app", "true");
    spec.ready_file = Some(ready.clone());
    let mut job = node.job_pod(spec)?;
    // The first pod is still on the node: the agent tracks both once it has seen this one.
    agent.wait_tracked(2, Duration::from_secs(5))?;
    // It has placed the pod (its cgroup registered for holding) once it logs the proxy's first
    // answer (no condition says "not ready": a readiness gate reads an absent one as False).
    let probed = eventually(Duration::from_secs(5), || {
        valet_tests::harness::says_about(&agent.log_text(), "proxy not ready", &format!("jobs/{}", job.name))
    });
    if !probed {
        bail!("the agent never reported the proxy of the held pod\n{}", agent.log_text());
    }
    println!("pod jobs/{} (valet.dev/hold-app: \"true\"); the proxy is not ready yet", job.name);
    let shown = condition(node, &job).unwrap_or_else(|| "absent (a readiness gate reads it as False)".into());
    println!("pod condition valet.dev/ProxyReady: {shown}");
    let ran = node.scratch.path("app-ran");
    let ran_s = ran.to_string_lossy().into_owned();
    let pid = job.start_app("app", &[app, &ran_s, "0"], &SpawnOptions::default())?.host_pid();
    let held = eventually(Duration::from_secs(5), || valet_tests::harness::process_state(pid) == Some('T'));
    if !held {
        bail!("the app was not held\n{}", agent.log_text());
    }
    std::thread::sleep(Duration::from_millis(500));
    println!("app process {pid} is stopped before its first instruction (state T); it has run: {}", ran.exists());
    let t_ready = monotonic_ns();
    std::fs::write(&ready, b"")?;
    if !eventually(Duration::from_secs(5), || stamp(&ran).is_some()) {
        bail!("the app was not released\n{}", agent.log_text());
    }
    let started = stamp(&ran).context("stamp")?;
    println!("\ntimeline:");
    println!("  {:>12}  proxy turns ready", "0");
    println!("  {:>12}  app runs its first instruction", ms(t_ready, started));
    println!("  (Istio's holdApplicationUntilProxyStarts polls every 500 ms: 250 ms late on average)");
    let got_condition = eventually(Duration::from_secs(3), || condition(node, &job).as_deref() == Some("True"));
    println!("pod condition valet.dev/ProxyReady=True: {got_condition}");
    let kubelet_ready = job.api_status("istio-proxy").is_some_and(|s| s["ready"] == true);
    println!(
        "the kubelet's own ready flag for istio-proxy: {kubelet_ready} (its readinessProbe runs every 15 s, as Istio injects it)"
    );
    Ok(())
}

fn main() -> Result<()> {
    valet_tests::cgroups::require_root();
    let app = bin("valet-bench-app")?;
    println!("valet demo: the real agent, real eBPF, real cgroups and network namespaces, a fake API server");
    let node = Node::new()?;
    println!("fake Kubernetes API server at {} (node {})", node.api.url(), node.name);
    let agent = node.start_agent(&[])?;
    println!(
        "valet-agent running: kernel programs attached, pods listed (metrics at http://{}/metrics)",
        agent.metrics
    );
    part1(&node, &agent, &app)?;
    part2(&node, &agent, &app)?;
    println!("\nmetrics excerpt:");
    for line in agent.metrics_text()?.lines() {
        if !line.starts_with('#')
            && (line.contains("quits_total") || line.contains("app_releases_total") || line.contains("holds_total"))
        {
            println!("  {line}");
        }
    }
    Ok(())
}
