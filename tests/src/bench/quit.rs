use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use valet_agent::host::clock::monotonic_ns;
use valet_sim::node::SpawnOptions;
use valet_tests::harness::{JobSpec, Node};

#[allow(clippy::wildcard_imports, reason = "the bench's parts share one namespace")]
use super::*;

/// The stand-in proxy's own part of a quit figure: from the client's first byte (a kept
/// connection) or its connect (a fresh one) until the stand-in has read the request head and
/// taken its timestamp. Measured on a stand-in on the host's loopback with `GET /healthz/ready`
/// (which, unlike the quit, leaves it running). Returns (kept, fresh) in µs.
pub(crate) fn standin_cost(runs: usize, scratch: &Path) -> Result<(Stats, Stats)> {
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
pub(crate) fn quit_latency(runs: usize, table: &mut Table) -> Result<()> {
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
