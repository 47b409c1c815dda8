//! End to end with native sidecars (init containers with `restartPolicy: Always`, KEP-753): the
//! real agent, real kernel programs, and the simulated kubelet that starts the sidecar before the
//! app, restarts it while the app runs and, once the app has ended, stops it with SIGTERM on its
//! next relist (see `docs/dev/native-sidecars.md`). The stand-in pilot-agent drains 5 s on SIGTERM,
//! as pilot-agent's default `terminationDrainDuration`: left to the kubelet, the proxy exits more
//! than 5 s after the app. valet quits it once the kubelet reports the app's end (a native sidecar
//! that exits while the kubelet still sees the app running is restarted): it exits about a second
//! after the app, well before the drain's end. The delays are printed, not asserted: the figure
//! (at most 1.5 s at p99) is the bench's.

use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use valet_tests::envoy;
use valet_tests::harness::{HANG_GUARD, JobPod, JobSpec, Node, eventually};

/// pilot-agent's drain on SIGTERM: a proxy that exits before it was quit, not stopped by the
/// kubelet.
const DRAIN: Duration = Duration::from_secs(5);

static SERIAL: Mutex<()> = Mutex::new(());

/// One Envoy at a time (a 100 MB binary, several threads).
fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Pods per measuring test: 1, or `VALET_NATIVE_SAMPLES` (how the figures in docs/sidecars.md
/// were taken).
fn samples() -> usize {
    std::env::var("VALET_NATIVE_SAMPLES").ok().and_then(|v| v.parse().ok()).filter(|n| *n > 0).unwrap_or(1)
}

/// min / median / max of the delays, in ms.
fn summary(what: &str, mut delays: Vec<Duration>) {
    delays.sort();
    let ms = |d: &Duration| d.as_secs_f64() * 1e3;
    if let (Some(first), Some(last)) = (delays.first(), delays.last()) {
        println!(
            "{what}: n={} min {:.1} ms, median {:.1} ms, max {:.1} ms",
            delays.len(),
            ms(first),
            ms(&delays[delays.len() / 2]),
            ms(last)
        );
    }
}

/// Runs the app to its end, then waits for the proxy's: the proxy's exit code and how long after
/// the app's end it came (both seen by polling every 2 ms, the proxy's right after the app's).
fn app_then_proxy(job: &mut JobPod, script: &str) -> (Option<i32>, Duration) {
    job.run_app("app", script).expect("app");
    let app = job.apps.last().cloned().expect("app process");
    assert!(app.wait_timeout(HANG_GUARD).expect("wait app").is_some(), "the app ended");
    let app_end = Instant::now();
    let code = job.wait_proxy_exit(HANG_GUARD).expect("wait proxy");
    (code, app_end.elapsed())
}

#[test]
fn a_native_proxy_that_drains_5s_is_quit_once_the_runtime_recorded_the_apps_end() {
    let node = Node::new().expect("node");
    let agent = node.start_agent(&[]).expect("agent");
    let mut delays = Vec::new();
    for n in 0..samples() {
        let mut job = node.job_pod(JobSpec::new(&format!("native-quit-{n}")).native_sidecar()).expect("pod");
        let pod = node.pod(&job).expect("pod object");
        assert_eq!(pod["spec"]["initContainers"][0]["restartPolicy"], "Always", "{pod}");
        agent.wait_tracked(1, HANG_GUARD).expect("tracked");
        let kernel_quits = agent.metric("valet_quit_latency_seconds_count ");

        let (code, after) = app_then_proxy(&mut job, "exit 0");
        println!("native istio-proxy exited {code:?} {after:?} after the app");
        assert_eq!(code, Some(0), "the quit ends pilot-agent with 0, not the kubelet's SIGTERM\n{}", agent.log_text());
        assert!(after < DRAIN, "the proxy exited {after:?} after the app: not quit\n{}", agent.log_text());
        let quits = job.loopback_quits();
        assert_eq!(quits.len(), 1, "one quit, on the pod's loopback: {:?}", job.requests());
        // Timed from the app's end in the kernel, not from the kubelet's report.
        assert!(agent.wait_metric("valet_quit_latency_seconds_count ", kernel_quits + 1.0), "{}", agent.log_text());

        // The kubelet never restarts it, and the pod completes: Succeeded, the proxy's exit 0 in
        // initContainerStatuses.
        assert!(
            eventually(HANG_GUARD, || node.pod(&job).is_some_and(|p| p["status"]["phase"] == "Succeeded")),
            "{:?}",
            node.pod(&job)
        );
        let st = job.api_status("istio-proxy").expect("proxy status");
        assert_eq!(st["state"]["terminated"]["exitCode"], 0, "{st}");
        assert_eq!(st["restartCount"], 0, "{st}");
        assert_eq!(job.process("istio-proxy").map(|p| p.id().to_string()), Some(job.proxy.id().to_string()));
        delays.push(after);
        // The Job's pod removed (as its TTL would): the next sample is the only pod tracked.
        node.api.delete_pod("jobs", &job.name).expect("delete");
        drop(job);
        agent.wait_tracked(0, HANG_GUARD).expect("the deleted pod is let go");
    }
    summary("valet: native istio-proxy exit after the app's", delays);
}

/// Without valet (the pod not labelled), the same pod's proxy is the kubelet's: SIGTERM once its
/// relist saw the app's end, then the 5 s drain. What valet's figure is compared with.
#[test]
fn left_to_the_kubelet_a_native_proxy_exits_after_its_5s_drain() {
    let node = Node::new().expect("node");
    let agent = node.start_agent(&[]).expect("agent");
    let mut delays = Vec::new();
    for n in 0..samples() {
        let spec = JobSpec { labelled: false, ..JobSpec::new(&format!("native-kubelet-{n}")).native_sidecar() };
        let mut job = node.job_pod(spec).expect("pod");
        let (code, after) = app_then_proxy(&mut job, "exit 0");
        println!("left to the kubelet, native istio-proxy exited {code:?} {after:?} after the app");
        assert_eq!(code, Some(0), "pilot-agent exits 0 after its drain");
        assert!(after >= Duration::from_secs(5), "the drain alone is 5 s: {after:?}");
        assert!(job.loopback_quits().is_empty(), "valet leaves an unlabelled pod alone\n{}", agent.log_text());
        assert!(
            eventually(HANG_GUARD, || node.pod(&job).is_some_and(|p| p["status"]["phase"] == "Succeeded")),
            "{:?}",
            node.pod(&job)
        );
        delays.push(after);
    }
    summary("kubelet: native istio-proxy exit after the app's", delays);
}

/// A native log shipper named in `valet.dev/sidecars` with kind `signal` is ended once the kubelet
/// reports the app's end: valet's SIGTERM then meets the kubelet's own (whichever comes first ends
/// it; valet's finds it gone or running, and says which), and nothing restarts it.
#[test]
fn a_native_log_shipper_listed_as_a_signal_sidecar_is_ended_at_the_apps_end() {
    let node = Node::new().expect("node");
    let agent = node.start_agent(&[]).expect("agent");
    let term = node.scratch.path("shipper-term");
    let script = format!("trap 'cat /proc/uptime > {}; exit 0' TERM; while true; do sleep 0.05; done", term.display());
    let mut spec = JobSpec::new("native-shipper")
        .annotation("valet.dev/sidecars", "shipper")
        .annotation("valet.dev/sidecar-kind.shipper", "signal")
        .without_readiness_probe()
        .native_sidecar();
    spec.sidecar = Some(("shipper".into(), vec!["/bin/sh".into(), "-c".into(), script]));
    let mut job = node.job_pod(spec).expect("pod");
    agent.wait_tracked(1, HANG_GUARD).expect("tracked");
    // The kubelet names the shipper before the agent can tell its processes from the app's.
    assert!(eventually(HANG_GUARD, || job.api_status("shipper").is_some_and(|s| s["containerID"].is_string())));
    let (code, after) = app_then_proxy(&mut job, "exit 0");
    println!("native shipper exited {code:?} {after:?} after the app");
    assert_eq!(code, Some(0), "{}", agent.log_text());
    assert!(term.exists(), "it got a SIGTERM");
    assert!(
        eventually(HANG_GUARD, || node.pod(&job).is_some_and(|p| p["status"]["phase"] == "Succeeded")),
        "{:?}",
        node.pod(&job)
    );
    assert_eq!(job.api_status("shipper").expect("status")["restartCount"], 0);
    // valet's SIGTERM went out at most once (none when the kubelet's had ended it already), and
    // nothing was escalated or warned about.
    let signalled = agent.metric("valet_sidecar_quits_total{kind=\"signal\",result=\"ok\"} ")
        + agent.metric("valet_sidecar_quits_total{kind=\"signal\",result=\"gone\"} ");
    assert!(signalled <= 1.0, "{}", agent.metrics_text().unwrap_or_default());
    assert_eq!(agent.metric("valet_sidecar_escalations_total{kind=\"signal\"} "), 0.0);
    let warnings: Vec<_> = node.events_for(&job).into_iter().filter(|(r, _)| r.contains("Failed")).collect();
    assert!(warnings.is_empty(), "{warnings:?}");
}

fn envoy_binary() -> PathBuf {
    envoy::binary()
        .unwrap_or_else(|| panic!("no Envoy at {} (VALET_ENVOY): `cargo xtask setup` installs it", envoy::CACHED))
}

/// A real Envoy as the native sidecar: quit through its admin once the kubelet reported the app's
/// end (the kubelet's own SIGTERM, which Envoy also obeys at once, may come first); it exits 0 and
/// is never restarted.
#[test]
fn a_real_envoy_as_a_native_sidecar_exits_0_and_is_never_restarted() {
    let _serial = serial();
    let node = Node::new().expect("node");
    let agent = node.start_agent(&[]).expect("agent");
    let config = node.scratch.path("native-envoy.yaml");
    std::fs::write(&config, envoy::BOOTSTRAP).expect("envoy bootstrap");
    let log = node.scratch.path("native-envoy.log");
    let spec = envoy::as_sidecar(JobSpec::new("native-envoy"), envoy::command(&envoy_binary(), &config, &log))
        .native_sidecar();
    let mut job = node.job_pod(spec).expect("pod");
    let admin = std::net::SocketAddr::from((std::net::Ipv4Addr::LOCALHOST, 15000));
    let ready = || {
        job.sim
            .in_netns(|| valet_sim::client::get(admin, "/ready", Duration::from_millis(500)).ok().map(|r| r.status))
            .ok()
            .flatten()
    };
    assert!(
        eventually(HANG_GUARD, || ready() == Some(200)),
        "Envoy never ready: {}",
        std::fs::read_to_string(&log).unwrap_or_default()
    );
    agent.wait_tracked(1, HANG_GUARD).expect("tracked");
    // valet quits a proxy it has seen ready through the connection it keeps: wait for its probe.
    assert!(eventually(HANG_GUARD, || node.proxy_ready_condition(&job)), "{}", agent.log_text());
    let (code, after) = app_then_proxy(&mut job, "exit 0");
    println!("native Envoy exited {code:?} {after:?} after the app");
    assert_eq!(code, Some(0), "Envoy exits 0 on valet's quit or the kubelet's SIGTERM\n{}", agent.log_text());
    assert!(
        eventually(HANG_GUARD, || node.pod(&job).is_some_and(|p| p["status"]["phase"] == "Succeeded")),
        "{:?}",
        node.pod(&job)
    );
    assert_eq!(job.api_status("envoy").expect("status")["restartCount"], 0);
}

/// The runtime records the app's exit 400 ms after it and the proxy's 5 ms after, and the kubelet
/// syncs on every recorded exit (evented PLEG): a native proxy quit at the kernel's moment would be
/// recorded exited while the kubelet still sees the app running, and restarted at once. valet
/// waits for the kubelet's report of the app's end, so the proxy is never restarted.
#[test]
fn a_native_proxy_is_not_restarted_when_the_runtime_records_the_apps_end_late() {
    let opts = valet_sim::kubelet::KubeletOptions { evented_pleg: true, ..Default::default() };
    let node = Node::with_kubelet(opts).expect("node");
    let agent = node.start_agent(&[]).expect("agent");
    let mut delays = Vec::new();
    for n in 0..samples().max(3) {
        let spec = JobSpec::new(&format!("native-late-{n}"))
            .native_sidecar()
            .record_lags(Duration::from_millis(400), Duration::from_millis(5));
        let mut job = node.job_pod(spec).expect("pod");
        agent.wait_tracked(1, HANG_GUARD).expect("tracked");
        assert!(eventually(HANG_GUARD, || node.proxy_ready_condition(&job)), "{}", agent.log_text());
        let (code, after) = app_then_proxy(&mut job, "exit 0");
        println!("native istio-proxy (app's exit recorded 400 ms late) exited {code:?} {after:?} after the app");
        assert_eq!(code, Some(0), "{}", agent.log_text());
        assert_eq!(job.loopback_quits().len(), 1, "one quit: {:?}\n{}", job.requests(), agent.log_text());
        assert!(
            eventually(HANG_GUARD, || node.pod(&job).is_some_and(|p| p["status"]["phase"] == "Succeeded")),
            "{:?}",
            node.pod(&job)
        );
        let st = job.api_status("istio-proxy").expect("proxy status");
        assert_eq!(st["restartCount"], 0, "the quit proxy was restarted: {st}\n{}", agent.log_text());
        assert_eq!(job.process("istio-proxy").map(|p| p.id().to_string()), Some(job.proxy.id().to_string()));
        delays.push(after);
        node.api.delete_pod("jobs", &job.name).expect("delete");
        drop(job);
        agent.wait_tracked(0, HANG_GUARD).expect("the deleted pod is let go");
    }
    summary("valet: native istio-proxy exit after the app's, the app's end recorded 400 ms late", delays);
}

/// The runtime records the app's end (its CRI record, `<root>/io.containerd.grpc.v1.cri/
/// containers/<id>/status`, as containerd writes it: 5–120 ms after the exit) long before the
/// kubelet's status write reaches the API (held here for 3 s from the app's start, as a kubelet
/// behind on its work or a loaded API server would). valet quits the native proxy at the record,
/// so the proxy has exited while the API still shows the app running. With no record to read
/// (`--runtime-record-dirs` elsewhere: CRI-O, another containerd root) the quit waits for the
/// API's report, and the proxy exits after it.
#[test]
fn a_native_proxy_is_quit_at_the_runtimes_record_of_the_apps_end() {
    let node = Node::new().expect("node");
    let nowhere = format!("--runtime-record-dirs={}", node.scratch.path("no-records").display());
    for (n, extra) in [vec![], vec![nowhere.as_str()]].into_iter().enumerate() {
        let records = extra.is_empty();
        let agent = node.start_agent(&extra).expect("agent");
        let mut job = node.job_pod(JobSpec::new(&format!("native-record-{n}")).native_sidecar()).expect("pod");
        agent.wait_tracked(1, HANG_GUARD).expect("tracked");
        assert!(eventually(HANG_GUARD, || node.proxy_ready_condition(&job)), "{}", agent.log_text());
        node.kubelet.hold_status_writes(Instant::now() + Duration::from_secs(3));
        let (code, after) = app_then_proxy(&mut job, "exit 0");
        let app_in_api = job.api_status("app").map(|s| s["state"].clone()).unwrap_or_default();
        println!(
            "records {records}: native istio-proxy exited {code:?} {after:?} after the app; the API: {app_in_api}"
        );
        assert_eq!(code, Some(0), "quit, not drained\n{}", agent.log_text());
        assert_eq!(job.loopback_quits().len(), 1, "one quit: {:?}\n{}", job.requests(), agent.log_text());
        let log = agent.log_text();
        if records {
            assert!(app_in_api["terminated"].is_null(), "quit only after the API's report: {app_in_api}\n{log}");
            assert!(log.contains("the runtime recorded the app's end"), "{log}");
        } else {
            assert!(app_in_api["terminated"].is_object(), "quit before the API's report with no record: {app_in_api}");
            assert!(!log.contains("the runtime recorded the app's end"), "{log}");
        }
        assert!(
            eventually(HANG_GUARD, || node.pod(&job).is_some_and(|p| p["status"]["phase"] == "Succeeded")),
            "{:?}",
            node.pod(&job)
        );
        let st = job.api_status("istio-proxy").expect("proxy status");
        assert_eq!(st["restartCount"], 0, "the quit proxy was restarted: {st}\n{log}");
        node.api.delete_pod("jobs", &job.name).expect("delete");
        drop(job);
        agent.wait_tracked(0, HANG_GUARD).expect("the deleted pod is let go");
    }
}

/// Two native sidecars, the proxy declared first and a log shipper after it: the kubelet stops
/// them last first, each once the one declared after it has exited, so that the shipper can still
/// send through the proxy while it flushes. valet keeps that order: it ends the shipper once the
/// kubelet reported the app's end, and quits the proxy only after the shipper has exited (it takes
/// 0.5 s to flush on SIGTERM). Quitting both at once would have the proxy gone while the shipper
/// still flushes.
#[test]
fn two_native_sidecars_are_ended_last_first() {
    let node = Node::new().expect("node");
    let agent = node.start_agent(&[]).expect("agent");
    let term = node.scratch.path("last-first-term");
    let bye = node.scratch.path("last-first-bye");
    let script = format!(
        "trap 'trap \"\" TERM; touch {t}; sleep 0.5; touch {b}; exit 0' TERM; while true; do sleep 0.05; done",
        t = term.display(),
        b = bye.display()
    );
    let spec = JobSpec::new("last-first")
        .annotation("valet.dev/sidecars", "istio-proxy,shipper")
        .annotation("valet.dev/sidecar-kind.shipper", "signal")
        .native_after("shipper", &script);
    let mut job = node.job_pod(spec).expect("pod");
    let pod = node.pod(&job).expect("pod object");
    let inits: Vec<_> =
        pod["spec"]["initContainers"].as_array().expect("init containers").iter().map(|c| c["name"].clone()).collect();
    assert_eq!(inits, ["istio-proxy", "shipper"], "{pod}");
    agent.wait_tracked(1, HANG_GUARD).expect("tracked");
    assert!(eventually(HANG_GUARD, || node.proxy_ready_condition(&job)), "{}", agent.log_text());
    assert!(eventually(HANG_GUARD, || job.api_status("shipper").is_some_and(|s| s["containerID"].is_string())));

    let (code, after) = app_then_proxy(&mut job, "exit 0");
    println!("last first: istio-proxy exited {code:?} {after:?} after the app");
    assert_eq!(code, Some(0), "valet's quit ends pilot-agent with 0, not the kubelet's drain\n{}", agent.log_text());
    assert!(after < DRAIN, "the proxy exited {after:?} after the app: not quit\n{}", agent.log_text());
    let quits = job.loopback_quits();
    assert_eq!(quits.len(), 1, "one quit: {:?}\n{}", job.requests(), agent.log_text());

    // The shipper had its SIGTERM, flushed, and exited before the proxy's quit came: the proxy
    // stayed up all the while. Its files' times are CLOCK_REALTIME, the stand-in's CLOCK_MONOTONIC.
    let mtime = |p: &std::path::Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
    let (Some(termed), Some(flushed)) = (mtime(&term), mtime(&bye)) else {
        panic!("the shipper never had its SIGTERM or never finished its flush\n{}", agent.log_text())
    };
    let mono_to_real = |mono_ns: u64| {
        let now_mono = valet_sim::util::monotonic_ns();
        std::time::SystemTime::now() - Duration::from_nanos(now_mono.saturating_sub(mono_ns))
    };
    let quit_at = mono_to_real(quits[0].mono_ns);
    // File times are taken from the coarse clock (a tick, up to 10 ms, behind).
    let slack = Duration::from_millis(20);
    assert!(
        quit_at + slack >= flushed,
        "the proxy was quit {:?} before the shipper had exited (SIGTERM at {termed:?}, exit at {flushed:?})\n{}",
        flushed.duration_since(quit_at).unwrap_or_default(),
        agent.log_text()
    );
    assert!(
        eventually(HANG_GUARD, || node.pod(&job).is_some_and(|p| p["status"]["phase"] == "Succeeded")),
        "{:?}",
        node.pod(&job)
    );
    for c in ["istio-proxy", "shipper"] {
        let st = job.api_status(c).expect("status");
        assert_eq!(st["restartCount"], 0, "{c}: {st}");
        assert_eq!(st["state"]["terminated"]["exitCode"], 0, "{c}: {st}");
    }
}
