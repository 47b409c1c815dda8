//! Privileged tests of the simulated kubelet and runtime on their own (no agent): statuses come
//! as late as a real kubelet's, readiness follows the probe, the runtime cleans up at exit like
//! containerd, OnFailure restarts in place. They fail when not run as root.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::Value;
use valet_sim::kubelet::{ContainerSpec, HttpProbe, Kubelet, KubeletOptions, KubeletPod, StatusTiming};
use valet_sim::node::{PodJsonOptions, SimPod, SimPodOptions, SpawnOptions, cgroup_id};
use valet_sim::standin::{ProxyKind, StandinOptions};
use valet_sim::util::require_root;
use valet_sim::{FakeApiServer, ServerOptions};

struct Setup {
    api: FakeApiServer,
    kubelet: Kubelet,
    dir: PathBuf,
}

impl Drop for Setup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn setup(opts: KubeletOptions) -> Setup {
    valet_sim::standin::set_binary_path(env!("CARGO_BIN_EXE_valet-standin-proxy"));
    let dir = std::env::temp_dir().join(format!("valet-kubelet-{}", valet_sim::util::random_hex(4)));
    let api = FakeApiServer::start_with(ServerOptions::default()).expect("api");
    let kubelet = Kubelet::start(api.handle(), KubeletOptions { runtime_state_dir: Some(dir.join("state")), ..opts })
        .expect("kubelet");
    Setup { api, kubelet, dir }
}

fn sim_pod(containers: &[&str]) -> std::sync::Arc<SimPod> {
    let mut o = SimPodOptions::new(&format!("kp-{}", valet_sim::util::random_hex(3))).lazy_cgroups(true);
    for c in containers {
        o = o.container(c);
    }
    std::sync::Arc::new(SimPod::create(o).expect("sim pod"))
}

fn status(api: &FakeApiServer, sim: &SimPod, container: &str) -> Option<Value> {
    let pod = api.get_pod(sim.namespace(), sim.name())?;
    pod["status"]["containerStatuses"].as_array()?.iter().find(|c| c["name"] == container).cloned()
}

fn phase(api: &FakeApiServer, sim: &SimPod) -> String {
    api.get_pod(sim.namespace(), sim.name())
        .and_then(|p| p["status"]["phase"].as_str().map(str::to_owned))
        .unwrap_or_default()
}

/// Only a guard against a hang: the waits are for events.
const HANG_GUARD: Duration = Duration::from_secs(30);

/// Polls every 2 ms; the time it took, None on timeout.
fn wait_for(timeout: Duration, mut f: impl FnMut() -> bool) -> Option<Duration> {
    let start = Instant::now();
    while start.elapsed() < timeout {
        if f() {
            return Some(start.elapsed());
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    None
}

/// Sleeps until just after the kubelet's next relist tick, so the following start has a whole
/// period before the next one.
fn just_after_a_tick(k: &Kubelet) {
    let tick = k.next_tick_after(Instant::now());
    std::thread::sleep(tick.saturating_duration_since(Instant::now()) + Duration::from_millis(20));
}

fn sh(script: &str) -> ContainerSpec {
    ContainerSpec::new("app").command(&["/bin/sh", "-c", script])
}

#[test]
fn container_id_and_running_appear_on_the_next_relist_not_at_start() {
    require_root();
    let s = setup(KubeletOptions::default());
    let sim = sim_pod(&["app"]);
    let pod = KubeletPod::new(PodJsonOptions::node("n1"), vec![ContainerSpec::new("app")]);
    s.kubelet.add_pod(sim.clone(), pod).expect("add");
    // Posted at once: Pending, waiting, no id.
    let st = status(&s.api, &sim, "app").expect("posted");
    assert!(st.get("containerID").is_none(), "{st}");
    assert_eq!(st["state"]["waiting"]["reason"], "ContainerCreating");
    assert_eq!(phase(&s.api, &sim), "Pending");

    just_after_a_tick(&s.kubelet);
    let started = Instant::now();
    let p = s
        .kubelet
        .start_container(sim.namespace(), sim.name(), "app", &["sleep", "30"], &SpawnOptions::default())
        .expect("start");
    let tick = s.kubelet.next_tick_after(started);
    // The runtime wrote the bundle and made the cgroup before the process ran.
    let bundle = s.dir.join("state").join(p.id()).join("config.json");
    let config: Value = serde_json::from_str(&std::fs::read_to_string(&bundle).expect("bundle")).expect("json");
    assert_eq!(config["annotations"]["io.kubernetes.cri.container-name"], "app");
    assert_eq!(config["annotations"]["io.kubernetes.cri.sandbox-uid"], sim.uid());
    assert!(p.container().cgroup.is_dir());

    // Read before the tick (the instant after the read says so): the API must not name it yet.
    // (On a machine so busy that a second passed since the start, there is nothing to check.)
    let st = status(&s.api, &sim, "app").expect("status");
    if Instant::now() < tick {
        assert!(st.get("containerID").is_none(), "before the next relist the API must not name it: {st}");
    } else {
        println!("read after the next relist tick: not checked");
    }
    let want = format!("containerd://{}", p.id());
    let seen =
        wait_for(HANG_GUARD, || status(&s.api, &sim, "app").is_some_and(|st| st["containerID"] == want.as_str()));
    let at = Instant::now();
    println!("containerID visible {:?} after the start (tick at {:?})", started.elapsed(), tick - started);
    assert!(seen.is_some(), "the id appears");
    assert!(at >= tick, "never before the next relist tick");
    let st = status(&s.api, &sim, "app").expect("status");
    assert!(st["state"]["running"]["startedAt"].is_string(), "{st}");
    assert_eq!(st["ready"], true, "no readinessProbe: ready with the running state");
    assert_eq!(phase(&s.api, &sim), "Running");
    let pod = s.api.get_pod(sim.namespace(), sim.name()).expect("pod");
    assert_eq!(pod["status"]["podIP"], sim.pod_ip().expect("ip").to_string());
}

#[test]
fn ready_only_after_the_readiness_probe_passed() {
    require_root();
    let s = setup(KubeletOptions::default());
    let sim = sim_pod(&["istio-proxy"]);
    let ready_file = s.dir.join("ready");
    let events = s.dir.join("proxy-events");
    let mut standin = StandinOptions::new(ProxyKind::Istio);
    standin.ready_file = Some(ready_file.clone());
    standin.events = Some(events.clone());
    let mut cmd = vec![valet_sim::standin::binary_path().expect("bin").to_string_lossy().into_owned()];
    cmd.extend(standin.to_args());
    let proxy = ContainerSpec {
        command: Some(cmd),
        readiness: Some(HttpProbe::istio().period(Duration::from_secs(1))),
        ..ContainerSpec::new("istio-proxy")
    };
    s.kubelet.add_pod(sim.clone(), KubeletPod::new(PodJsonOptions::node("n1"), vec![proxy])).expect("add");
    let pod = s.api.get_pod(sim.namespace(), sim.name()).expect("pod");
    assert_eq!(pod["spec"]["containers"][0]["readinessProbe"]["httpGet"]["port"], 15021, "{pod}");
    assert!(
        wait_for(HANG_GUARD, || status(&s.api, &sim, "istio-proxy")
            .is_some_and(|st| st["state"]["running"].is_object()))
        .is_some(),
        "running"
    );
    // Running, probed and failing: not ready, for as long as the proxy is not (two probes
    // answered 503, a second apart).
    let probes = || {
        valet_sim::standin::read_events(&events)
            .unwrap_or_default()
            .iter()
            .filter(|e| e.method == "GET" && e.path == "/healthz/ready")
            .count()
    };
    assert!(wait_for(HANG_GUARD, || probes() >= 2).is_some(), "probed");
    let st = status(&s.api, &sim, "istio-proxy").expect("status");
    assert_eq!(st["ready"], false, "{st}");
    let pod = s.api.get_pod(sim.namespace(), sim.name()).expect("pod");
    let ready_cond =
        pod["status"]["conditions"].as_array().expect("conds").iter().find(|c| c["type"] == "Ready").cloned();
    assert_eq!(ready_cond.expect("Ready")["status"], "False");

    std::fs::write(&ready_file, "").expect("ready");
    let took = wait_for(HANG_GUARD, || status(&s.api, &sim, "istio-proxy").is_some_and(|st| st["ready"] == true));
    println!("ready in the API {took:?} after the proxy turned ready (probe period 1 s)");
    assert!(took.is_some(), "ready once a probe passed");
}

#[test]
fn istio_default_period_keeps_a_late_proxy_unready_for_long() {
    require_root();
    // Istio's 15 s period: a proxy that was not ready at the first probe stays unready in the
    // API long after it turned ready. It turns ready once the first probe has failed (an event,
    // not a time), and is looked at well within the 15 s before the next.
    let s = setup(KubeletOptions::default());
    let sim = sim_pod(&["istio-proxy"]);
    let (ready_file, events) = (s.dir.join("ready"), s.dir.join("proxy-events"));
    let mut standin = StandinOptions::new(ProxyKind::Istio);
    standin.ready_file = Some(ready_file.clone());
    standin.events = Some(events.clone());
    let mut cmd = vec![valet_sim::standin::binary_path().expect("bin").to_string_lossy().into_owned()];
    cmd.extend(standin.to_args());
    let proxy =
        ContainerSpec { command: Some(cmd), readiness: Some(HttpProbe::istio()), ..ContainerSpec::new("istio-proxy") };
    s.kubelet.add_pod(sim.clone(), KubeletPod::new(PodJsonOptions::node("n1"), vec![proxy])).expect("add");
    let first_probe = || {
        valet_sim::standin::read_events(&events)
            .unwrap_or_default()
            .iter()
            .find(|e| e.method == "GET" && e.path == "/healthz/ready")
            .map(|e| e.mono_ns)
    };
    assert!(wait_for(HANG_GUARD, || first_probe().is_some()).is_some(), "the kubelet probed the proxy");
    std::fs::write(&ready_file, "").expect("ready");
    sim.wait_standin_ready(&standin, HANG_GUARD).expect("the proxy serves ready");
    // A status sync after the probe's result, at most 60 ms later (the sync delay).
    let probed_at = first_probe().unwrap_or_default();
    while valet_sim::util::monotonic_ns() < probed_at + 100_000_000 {
        std::thread::sleep(Duration::from_millis(10));
    }
    let st = status(&s.api, &sim, "istio-proxy").expect("status");
    let since_probe = Duration::from_nanos(valet_sim::util::monotonic_ns().saturating_sub(probed_at));
    assert!(since_probe < Duration::from_secs(15), "looked {since_probe:?} after the first probe: too late to tell");
    assert!(st["state"]["running"].is_object(), "{st}");
    assert_eq!(st["ready"], false, "not before the next probe, 15 s after the first: {st}");
}

#[test]
fn terminated_on_the_relist_after_the_exit_and_the_runtime_cleans_up() {
    require_root();
    let s = setup(KubeletOptions::default());
    let sim = sim_pod(&["app"]);
    let pod = KubeletPod::new(PodJsonOptions::node("n1"), vec![sh("sleep 0.3; exit 3")]);
    s.kubelet.add_pod(sim.clone(), pod).expect("add");
    let p = s.kubelet.process(sim.namespace(), sim.name(), "app").expect("started by the kubelet");
    let cgroup = p.container().cgroup.clone();
    let bundle = s.dir.join("state").join(p.id());
    let sandbox_bundle = s.dir.join("state").join(&sim.sandbox().id);
    assert!(sandbox_bundle.join("config.json").is_file(), "the sandbox has a bundle too");
    let status_code = p.wait_timeout(HANG_GUARD).expect("wait").expect("exited");
    let exited = Instant::now();
    assert_eq!(status_code.code(), Some(3));
    // The kubelet may have reaped it a few ms before this thread saw the status.
    let tick = s.kubelet.next_tick_after(exited - Duration::from_millis(20));

    // containerd: the cgroup goes ~25 ms after the exit, the bundle 50-340 ms after that.
    let cg_gone = wait_for(HANG_GUARD, || !cgroup.exists());
    let bundle_gone = wait_for(HANG_GUARD, || !bundle.exists());
    println!("after the exit: cgroup removed {cg_gone:?}, bundle {bundle_gone:?}");
    assert!(cg_gone.is_some(), "cgroup removed at exit");
    assert!(bundle_gone.is_some(), "bundle removed at exit");
    let (cg, b) = (cg_gone.unwrap_or_default(), exited.elapsed());
    assert!(cg >= Duration::from_millis(15), "not before the runtime's delay: {cg:?}");
    assert!(b >= Duration::from_millis(60), "the bundle outlives the cgroup by 50 ms at least: {b:?}");
    assert!(sim.pod_cgroup_path().is_dir(), "the pod cgroup stays");
    assert!(sandbox_bundle.is_dir(), "the sandbox's bundle stays");

    let want = format!("containerd://{}", p.id());
    let seen =
        wait_for(HANG_GUARD, || status(&s.api, &sim, "app").is_some_and(|st| st["state"]["terminated"].is_object()));
    assert!(seen.is_some(), "terminated within 2.5 s of the exit");
    assert!(Instant::now() >= tick, "not before the relist after the exit");
    let st = status(&s.api, &sim, "app").expect("status");
    let t = &st["state"]["terminated"];
    assert_eq!((t["exitCode"].as_i64(), t["reason"].as_str()), (Some(3), Some("Error")), "{st}");
    assert_eq!(t["containerID"], want.as_str());
    assert!(t["finishedAt"].is_string());
    assert_eq!(st["ready"], false);
    assert!(wait_for(HANG_GUARD, || phase(&s.api, &sim) == "Failed").is_some(), "restartPolicy Never");
}

#[test]
fn pod_succeeds_when_every_container_exited_zero() {
    require_root();
    let s = setup(KubeletOptions::default());
    let sim = sim_pod(&["app", "helper"]);
    let helper = ContainerSpec::new("helper").command(&["/bin/sh", "-c", "sleep 0.2"]);
    let pod = KubeletPod::new(PodJsonOptions::node("n1"), vec![sh("exit 0"), helper]);
    s.kubelet.add_pod(sim.clone(), pod).expect("add");
    assert!(wait_for(HANG_GUARD, || phase(&s.api, &sim) == "Succeeded").is_some(), "{}", phase(&s.api, &sim));
    let st = status(&s.api, &sim, "app").expect("status");
    assert_eq!(st["state"]["terminated"]["reason"], "Completed");
}

#[test]
fn on_failure_restarts_in_place_with_a_new_id_and_cgroup() {
    require_root();
    let s = setup(KubeletOptions { restart_backoff: Duration::from_millis(500), ..KubeletOptions::default() });
    let sim = sim_pod(&["app"]);
    let marker = Path::new(&s.dir).join("ran-once");
    std::fs::create_dir_all(&s.dir).expect("dir");
    let script =
        format!("if [ -e {m} ]; then exec sleep 30; else touch {m}; sleep 0.1; exit 1; fi", m = marker.display());
    let pod = KubeletPod::new(PodJsonOptions::node("n1").restart_policy("OnFailure"), vec![sh(&script)]);
    s.kubelet.add_pod(sim.clone(), pod).expect("add");
    let first = s.kubelet.process(sim.namespace(), sim.name(), "app").expect("first");
    let first_cgroup = first.container().cgroup.clone();
    let first_cgroup_id = cgroup_id(&first_cgroup).expect("cgroup id");
    assert_eq!(first.wait_timeout(HANG_GUARD).expect("wait").and_then(|s| s.code()), Some(1));

    let mut second = None;
    let took = wait_for(HANG_GUARD, || {
        second = s.kubelet.process(sim.namespace(), sim.name(), "app").filter(|p| p.id() != first.id());
        second.is_some()
    });
    println!("restarted {took:?} after the exit (back-off 0.5 s after the relist)");
    let second = second.expect("restarted");
    assert_ne!(second.container().cgroup, first_cgroup, "a new cgroup");
    assert!(second.container().cgroup.is_dir());
    assert_ne!(cgroup_id(&second.container().cgroup).expect("id"), first_cgroup_id);
    assert!(!first_cgroup.exists(), "the old cgroup is gone");
    assert!(second.try_wait().expect("poll").is_none(), "the new instance runs");

    let new_id = format!("containerd://{}", second.id());
    let old_id = format!("containerd://{}", first.id());
    assert!(
        wait_for(HANG_GUARD, || status(&s.api, &sim, "app")
            .is_some_and(|st| st["containerID"] == new_id.as_str() && st["state"]["running"].is_object()))
        .is_some(),
        "the API shows the new instance running: {:?}",
        status(&s.api, &sim, "app")
    );
    let st = status(&s.api, &sim, "app").expect("status");
    assert_eq!(st["restartCount"], 1, "{st}");
    let last = &st["lastState"]["terminated"];
    assert_eq!(last["exitCode"], 1, "{st}");
    assert_eq!(last["containerID"], old_id.as_str());
    assert_eq!(phase(&s.api, &sim), "Running");
}

#[test]
fn at_once_timing_is_kinder_on_request() {
    require_root();
    // The next relist is an hour away, far past the hang guard: what the API shows came at once.
    let s = setup(KubeletOptions { relist_period: Duration::from_secs(3600), ..KubeletOptions::default() });
    let sim = sim_pod(&["app"]);
    let mut pod = KubeletPod::new(PodJsonOptions::node("n1"), vec![ContainerSpec::new("app")]);
    pod.status = StatusTiming::AtOnce;
    pod.bundles = false;
    s.kubelet.add_pod(sim.clone(), pod).expect("add");
    let p = s
        .kubelet
        .start_container(sim.namespace(), sim.name(), "app", &["sleep", "30"], &SpawnOptions::default())
        .expect("start");
    let want = format!("containerd://{}", p.id());
    let took =
        wait_for(HANG_GUARD, || status(&s.api, &sim, "app").is_some_and(|st| st["containerID"] == want.as_str()));
    assert!(took.is_some(), "at once");
    assert!(!s.dir.join("state").join(p.id()).exists(), "no bundle asked for");
}

#[test]
fn init_containers_run_to_completion_before_the_containers() {
    require_root();
    let s = setup(KubeletOptions::default());
    let sim = sim_pod(&["init", "app"]);
    let init = ContainerSpec::new("init").kind(valet_sim::kubelet::ContainerKind::Init).command(&[
        "/bin/sh",
        "-c",
        "sleep 0.2",
    ]);
    let pod = KubeletPod::new(PodJsonOptions::node("n1"), vec![init, sh("exec sleep 30")]);
    s.kubelet.add_pod(sim.clone(), pod).expect("add");
    let posted = s.api.get_pod(sim.namespace(), sim.name()).expect("pod");
    assert_eq!(posted["spec"]["initContainers"][0]["name"], "init", "{posted}");
    assert!(posted["spec"]["initContainers"][0].get("restartPolicy").is_none());
    assert!(s.kubelet.process(sim.namespace(), sim.name(), "app").is_none(), "not before the init container ended");
    let init_p = s.kubelet.process(sim.namespace(), sim.name(), "init").expect("init started");
    init_p.wait_timeout(HANG_GUARD).expect("wait").expect("init exited");
    // The kubelet may have reaped it a few ms before this thread saw the status.
    let ended = Instant::now() - Duration::from_millis(20);
    let started = wait_for(HANG_GUARD, || s.kubelet.process(sim.namespace(), sim.name(), "app").is_some());
    assert!(started.is_some(), "the app starts after the init container");
    assert!(Instant::now() >= s.kubelet.next_tick_after(ended), "on the relist after the init container's exit");
    assert!(wait_for(HANG_GUARD, || phase(&s.api, &sim) == "Running").is_some(), "{}", phase(&s.api, &sim));
    let pod = s.api.get_pod(sim.namespace(), sim.name()).expect("pod");
    assert_eq!(pod["status"]["initContainerStatuses"][0]["state"]["terminated"]["exitCode"], 0, "{pod}");
}
