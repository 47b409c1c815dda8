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
use valet_test_support::wait_for;

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
    std::fs::create_dir_all(dir.join("links")).expect("links dir");
    let opts = KubeletOptions {
        runtime_state_dir: Some(dir.join("state")),
        container_log_links: Some(dir.join("links")),
        ..opts
    };
    let kubelet = Kubelet::start(api.handle(), opts).expect("kubelet");
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
    // The kubelet's log link, made once the container started; none for the sandbox.
    let link = s.dir.join("links").join(format!("{}_{}_app-{}.log", sim.name(), sim.namespace(), p.id()));
    assert!(link.symlink_metadata().is_ok(), "the container's log link once it started");
    let links = || std::fs::read_dir(s.dir.join("links")).expect("links").count();
    assert_eq!(links(), 1, "one link: the container's");
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
    assert!(link.symlink_metadata().is_ok(), "the log link outlives the container's cgroup and bundle");

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
    s.kubelet.remove_pod(sim.namespace(), sim.name());
    assert_eq!(links(), 0, "the log link goes with the container");
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

// Native sidecars (init containers with `restartPolicy: Always`): the rules modelled and their
// sources are in docs/dev/native-sidecars.md.

use valet_sim::kubelet::ContainerKind;

/// The stand-in pilot-agent's command line with these extra flags.
fn standin_cmd(standin: &StandinOptions) -> Vec<String> {
    let mut cmd = vec![valet_sim::standin::binary_path().expect("bin").to_string_lossy().into_owned()];
    cmd.extend(standin.to_args());
    cmd
}

fn native(name: &str, cmd: Vec<String>) -> ContainerSpec {
    ContainerSpec { command: Some(cmd), ..ContainerSpec::new(name) }.kind(ContainerKind::NativeSidecar)
}

fn init_status(api: &FakeApiServer, sim: &SimPod, container: &str) -> Option<Value> {
    let pod = api.get_pod(sim.namespace(), sim.name())?;
    pod["status"]["initContainerStatuses"].as_array()?.iter().find(|c| c["name"] == container).cloned()
}

/// `/proc/uptime` in ms, as the shell scripts below stamp their events.
fn uptime_ms() -> u64 {
    let text = std::fs::read_to_string("/proc/uptime").expect("uptime");
    stamp_ms(&text).expect("uptime parses")
}

fn stamp_ms(text: &str) -> Option<u64> {
    let secs: f64 = text.split_whitespace().next()?.parse().ok()?;
    Some((secs * 1000.0) as u64)
}

fn read_stamp(path: &Path) -> Option<u64> {
    stamp_ms(&std::fs::read_to_string(path).ok()?)
}

#[test]
fn native_sidecar_starts_first_and_its_startup_probe_holds_the_app() {
    require_root();
    let s = setup(KubeletOptions::default());
    let sim = sim_pod(&["istio-proxy", "app"]);
    let (ready_file, events) = (s.dir.join("ready"), s.dir.join("proxy-events"));
    let mut standin = StandinOptions::new(ProxyKind::Istio);
    standin.ready_file = Some(ready_file.clone());
    standin.events = Some(events.clone());
    let proxy = native("istio-proxy", standin_cmd(&standin)).startup(HttpProbe::istio_startup());
    let pod = KubeletPod::new(PodJsonOptions::node("n1"), vec![proxy, sh("exec sleep 30")]);
    s.kubelet.add_pod(sim.clone(), pod).expect("add");
    let posted = s.api.get_pod(sim.namespace(), sim.name()).expect("pod");
    let spec = &posted["spec"]["initContainers"][0];
    assert_eq!(
        (spec["name"].as_str(), spec["restartPolicy"].as_str()),
        (Some("istio-proxy"), Some("Always")),
        "{posted}"
    );
    assert_eq!(spec["startupProbe"]["periodSeconds"], 1, "{posted}");
    assert_eq!(posted["spec"]["containers"][0]["name"], "app");

    // The kubelet probes the proxy, which is not ready: the app waits, the pod is Pending.
    let probes = || {
        valet_sim::standin::read_events(&events)
            .unwrap_or_default()
            .iter()
            .filter(|e| e.method == "GET" && e.path == "/healthz/ready")
            .count()
    };
    assert!(wait_for(HANG_GUARD, || probes() >= 2).is_some(), "the startup probe runs");
    assert!(s.kubelet.process(sim.namespace(), sim.name(), "app").is_none(), "the app waits for the startup probe");
    let st = init_status(&s.api, &sim, "istio-proxy").expect("init status");
    assert!(st["state"]["running"].is_object(), "{st}");
    assert_eq!(st["started"], false, "{st}");
    assert_eq!(phase(&s.api, &sim), "Pending");

    std::fs::write(&ready_file, "").expect("ready");
    assert!(
        wait_for(HANG_GUARD, || s.kubelet.process(sim.namespace(), sim.name(), "app").is_some()).is_some(),
        "the app starts once the startup probe passed"
    );
    assert!(
        wait_for(HANG_GUARD, || phase(&s.api, &sim) == "Running"
            && init_status(&s.api, &sim, "istio-proxy").is_some_and(|st| st["started"] == true))
        .is_some(),
        "{:?}",
        s.api.get_pod(sim.namespace(), sim.name())
    );
}

#[test]
fn native_sidecar_that_exits_while_the_app_runs_is_restarted() {
    require_root();
    let s = setup(KubeletOptions { restart_backoff: Duration::ZERO, ..KubeletOptions::default() });
    let sim = sim_pod(&["logs", "app"]);
    std::fs::create_dir_all(&s.dir).expect("dir");
    let marker = s.dir.join("logs-ran");
    let script = format!("if [ -e {m} ]; then exec sleep 30; else touch {m}; exit 3; fi", m = marker.display());
    let logs = native("logs", vec!["/bin/sh".into(), "-c".into(), script]);
    let pod = KubeletPod::new(PodJsonOptions::node("n1"), vec![logs, sh("exec sleep 30")]);
    s.kubelet.add_pod(sim.clone(), pod).expect("add");
    let first = s.kubelet.process(sim.namespace(), sim.name(), "logs").expect("logs started");
    assert_eq!(first.wait_timeout(HANG_GUARD).expect("wait").and_then(|s| s.code()), Some(3));
    let mut second = None;
    assert!(
        wait_for(HANG_GUARD, || {
            second = s.kubelet.process(sim.namespace(), sim.name(), "logs").filter(|p| p.id() != first.id());
            second.is_some()
        })
        .is_some(),
        "restarted"
    );
    let second = second.expect("second");
    assert!(second.try_wait().expect("poll").is_none(), "the new instance runs");
    let want = format!("containerd://{}", second.id());
    assert!(
        wait_for(HANG_GUARD, || init_status(&s.api, &sim, "logs")
            .is_some_and(|st| st["containerID"] == want.as_str() && st["restartCount"] == 1))
        .is_some(),
        "{:?}",
        init_status(&s.api, &sim, "logs")
    );
    // The app starts once the restarted sidecar is seen running, and runs on.
    assert!(wait_for(HANG_GUARD, || phase(&s.api, &sim) == "Running").is_some(), "{}", phase(&s.api, &sim));
    let app = s.kubelet.process(sim.namespace(), sim.name(), "app").expect("app");
    assert!(app.try_wait().expect("poll").is_none(), "the app runs");
}

#[test]
fn once_the_app_ended_native_sidecars_stop_last_first_with_pre_stop_sigterm_and_drain() {
    require_root();
    let s = setup(KubeletOptions { restart_backoff: Duration::ZERO, ..KubeletOptions::default() });
    let sim = sim_pod(&["istio-proxy", "logs", "app"]);
    std::fs::create_dir_all(&s.dir).expect("dir");
    let (pre_stop, logs_term) = (s.dir.join("pre-stop"), s.dir.join("logs-term"));
    let mut standin = StandinOptions::new(ProxyKind::Istio);
    standin.drain = Some(Duration::from_millis(1500));
    let proxy = native("istio-proxy", standin_cmd(&standin)).pre_stop(&[
        "/bin/sh",
        "-c",
        &format!("cat /proc/uptime > {}", pre_stop.display()),
    ]);
    let logs = native(
        "logs",
        vec![
            "/bin/sh".into(),
            "-c".into(),
            format!("trap 'cat /proc/uptime > {}; exit 0' TERM; while true; do sleep 0.05; done", logs_term.display()),
        ],
    );
    let go = s.dir.join("go");
    let app = sh(&format!("while [ ! -e {} ]; do sleep 0.01; done; exit 0", go.display()));
    let pod = KubeletPod::new(PodJsonOptions::node("n1"), vec![proxy, logs, app]);
    s.kubelet.add_pod(sim.clone(), pod).expect("add");
    assert!(
        wait_for(HANG_GUARD, || s.kubelet.process(sim.namespace(), sim.name(), "app").is_some()).is_some(),
        "the app starts after both sidecars"
    );
    let (proxy_p, logs_p, app_p) = (
        s.kubelet.process(sim.namespace(), sim.name(), "istio-proxy").expect("proxy"),
        s.kubelet.process(sim.namespace(), sim.name(), "logs").expect("logs"),
        s.kubelet.process(sim.namespace(), sim.name(), "app").expect("app"),
    );
    std::fs::write(&go, "").expect("go");
    assert_eq!(app_p.wait_timeout(HANG_GUARD).expect("wait").and_then(|s| s.code()), Some(0));
    let app_end = uptime_ms();

    // The later sidecar first, then the proxy: its preStop hook, its SIGTERM, its 1.5 s drain.
    assert_eq!(logs_p.wait_timeout(HANG_GUARD).expect("wait").map(valet_sim::kubelet::exit_code), Some(0));
    assert_eq!(proxy_p.wait_timeout(HANG_GUARD).expect("wait").map(valet_sim::kubelet::exit_code), Some(0));
    let proxy_end = uptime_ms();
    let term = read_stamp(&logs_term).expect("logs got SIGTERM");
    let hook = read_stamp(&pre_stop).expect("the proxy's preStop hook ran");
    println!(
        "after the app's end: logs SIGTERM {} ms, proxy preStop {} ms, proxy exit {} ms",
        term.saturating_sub(app_end),
        hook.saturating_sub(app_end),
        proxy_end.saturating_sub(app_end)
    );
    assert!(term + 10 >= app_end, "not before the app's end");
    assert!(proxy_end >= term + 1_500, "the proxy's SIGTERM came after the logs sidecar had ended, and it drained");
    assert!(proxy_end >= hook + 1_500, "its SIGTERM came after its preStop hook");

    assert!(wait_for(HANG_GUARD, || phase(&s.api, &sim) == "Succeeded").is_some(), "{}", phase(&s.api, &sim));
    // Neither sidecar was restarted (the back-off is 0: a restart would have come at once).
    for (name, p) in [("istio-proxy", &proxy_p), ("logs", &logs_p)] {
        let st = init_status(&s.api, &sim, name).expect("status");
        assert_eq!(st["restartCount"], 0, "{st}");
        assert_eq!(st["state"]["terminated"]["exitCode"], 0, "{st}");
        assert_eq!(
            s.kubelet.process(sim.namespace(), sim.name(), name).map(|c| c.id().to_string()),
            Some(p.id().to_string())
        );
    }
}

/// A native istio-proxy that drains 60 s on SIGTERM (longer than any wait here: only a quit
/// ends it in time) and an app that exits 0 once `go` exists; the kubelet restarts at once (no
/// back-off, as the real kubelet's first restart). Returns the pod, the go file and the proxy's
/// quit address.
fn quit_pod(s: &Setup) -> (std::sync::Arc<SimPod>, PathBuf, std::net::SocketAddr) {
    quit_pod_recorded(s, None)
}

/// [`quit_pod`], with the runtime recording the app's and the proxy's exits these long after them.
fn quit_pod_recorded(
    s: &Setup,
    lags: Option<(Duration, Duration)>,
) -> (std::sync::Arc<SimPod>, PathBuf, std::net::SocketAddr) {
    let sim = sim_pod(&["istio-proxy", "app"]);
    std::fs::create_dir_all(&s.dir).expect("dir");
    let mut standin = StandinOptions::new(ProxyKind::Istio);
    standin.drain = Some(Duration::from_secs(60));
    let proxy = native("istio-proxy", standin_cmd(&standin)).startup(HttpProbe::istio_startup());
    let go = s.dir.join(format!("go-{}", sim.name()));
    let app = sh(&format!("while [ ! -e {} ]; do sleep 0.01; done; exit 0", go.display()));
    let (proxy, app) = match lags {
        Some((app_lag, proxy_lag)) => (proxy.record_lag(proxy_lag), app.record_lag(app_lag)),
        None => (proxy, app),
    };
    let mut pod = KubeletPod::new(PodJsonOptions::node("n1"), vec![proxy, app]);
    pod.grace_period = Duration::from_secs(120);
    s.kubelet.add_pod(sim.clone(), pod).expect("add");
    assert!(
        wait_for(HANG_GUARD, || status(&s.api, &sim, "app").is_some_and(|st| st["state"]["running"].is_object()))
            .is_some(),
        "the app starts and the kubelet reports it running"
    );
    let (port, path) = standin.quit_endpoint();
    assert_eq!(path, "/quitquitquit");
    (sim, go, std::net::SocketAddr::from((std::net::Ipv4Addr::LOCALHOST, port)))
}

fn quit(sim: &SimPod, addr: std::net::SocketAddr) {
    let r = sim.in_netns(|| valet_sim::client::post(addr, "/quitquitquit", HANG_GUARD)).expect("netns").expect("quit");
    assert_eq!(r.status, 200);
}

/// The quit sidecar exits 0, is never restarted, and the pod succeeds.
fn assert_quit_sidecar_not_restarted(s: &Setup, sim: &SimPod, proxy: &valet_sim::ContainerProcess) {
    assert_eq!(
        proxy.wait_timeout(HANG_GUARD).expect("wait").map(valet_sim::kubelet::exit_code),
        Some(0),
        "the quit ends the drain"
    );
    assert!(wait_for(HANG_GUARD, || phase(&s.api, sim) == "Succeeded").is_some(), "{}", phase(&s.api, sim));
    // Two more syncs: a restart (at once, no back-off) would show by then.
    let t = s.kubelet.next_tick_after(s.kubelet.next_tick_after(Instant::now()));
    std::thread::sleep(t.saturating_duration_since(Instant::now()) + Duration::from_millis(100));
    let current = s.kubelet.process(sim.namespace(), sim.name(), "istio-proxy").expect("proxy");
    assert_eq!(current.id(), proxy.id(), "the quit sidecar was restarted");
    let st = init_status(&s.api, sim, "istio-proxy").expect("status");
    assert_eq!(st["restartCount"], 0, "{st}");
    assert_eq!(st["state"]["terminated"]["exitCode"], 0, "{st}");
    assert_eq!(phase(&s.api, sim), "Succeeded");
}

/// The hazard of quitting a native sidecar at the kernel's moment: the runtime records each
/// container's exit on its own, so the sidecar's exit can be recorded before the app's. A kubelet
/// sync in between (here an evented PLEG's, on the sidecar's exit) sees "sidecar exited, app
/// running" and restarts the sidecar, at once (its first restart has no back-off).
#[test]
fn native_sidecar_quit_before_the_runtime_recorded_the_apps_end_is_restarted() {
    require_root();
    let s = setup(KubeletOptions { evented_pleg: true, ..KubeletOptions::default() });
    // The app's exit recorded 400 ms late (a busy node's containerd: ~100 ms in a TCG VM), the
    // proxy's 5 ms late.
    let (sim, go, addr) = quit_pod_recorded(&s, Some((Duration::from_millis(400), Duration::from_millis(5))));
    let proxy = s.kubelet.process(sim.namespace(), sim.name(), "istio-proxy").expect("proxy");
    let app = s.kubelet.process(sim.namespace(), sim.name(), "app").expect("app");
    std::fs::write(&go, "").expect("go");
    assert_eq!(app.wait_timeout(HANG_GUARD).expect("wait").and_then(|s| s.code()), Some(0));
    quit(&sim, addr);
    assert_eq!(proxy.wait_timeout(HANG_GUARD).expect("wait").map(valet_sim::kubelet::exit_code), Some(0));
    let mut restarted = None;
    assert!(
        wait_for(HANG_GUARD, || {
            restarted = s.kubelet.process(sim.namespace(), sim.name(), "istio-proxy").filter(|p| p.id() != proxy.id());
            restarted.is_some()
        })
        .is_some(),
        "the kubelet restarted the quit sidecar"
    );
    assert!(
        wait_for(HANG_GUARD, || init_status(&s.api, &sim, "istio-proxy").is_some_and(|st| st["restartCount"] == 1))
            .is_some(),
        "{:?}",
        init_status(&s.api, &sim, "istio-proxy")
    );
}

#[test]
fn native_sidecar_quit_after_the_kubelet_saw_the_apps_end_is_not_restarted() {
    require_root();
    let s = setup(KubeletOptions { restart_backoff: Duration::ZERO, ..KubeletOptions::default() });
    let (sim, go, addr) = quit_pod(&s);
    let proxy = s.kubelet.process(sim.namespace(), sim.name(), "istio-proxy").expect("proxy");
    let app = s.kubelet.process(sim.namespace(), sim.name(), "app").expect("app");
    std::fs::write(&go, "").expect("go");
    assert_eq!(app.wait_timeout(HANG_GUARD).expect("wait").and_then(|s| s.code()), Some(0));
    // The kubelet saw the app's end (and sent the proxy its SIGTERM: it drains for 60 s).
    assert!(
        wait_for(HANG_GUARD, || status(&s.api, &sim, "app").is_some_and(|st| st["state"]["terminated"].is_object()))
            .is_some(),
        "the kubelet reports the app's end"
    );
    assert!(proxy.try_wait().expect("poll").is_none(), "the proxy drains");
    quit(&sim, addr);
    assert_quit_sidecar_not_restarted(&s, &sim, &proxy);
}
