//! End to end with the sidecars users run in Jobs beside the meshes: Vault Agent, consul-dataplane,
//! the AlloyDB Auth Proxy, kuma-dp, and Linkerd's proxy with its `/shutdown` off. Each is the
//! stand-in of its kind (`valet-standin-proxy --kind ...`), which answers, refuses and exits as
//! the real one does (its source: docs/sidecars.md), under the container name its injector gives
//! it. The real agent quits it when the app ends, and the pod completes: the sidecar exits 0.
//!
//! Every test starts its own node and agent. Waits are for events; their timeout is a hang guard.

use std::path::PathBuf;
use std::time::Duration;

use valet_sim::standin::{ProxyKind, RequestEvent, StandinOptions, read_events};
use valet_tests::harness::{Agent, HANG_GUARD, JobPod, JobSpec, Node, eventually};

/// A Job pod whose sidecar is the stand-in `opts` in a container named `container`, with pod
/// `annotations` (the injectors' own, which valet reads), and the file the stand-in's requests are
/// written to. A container valet does not take as a sidecar by its name is listed for it.
fn pod_with(
    node: &Node,
    name: &str,
    container: &str,
    mut opts: StandinOptions,
    annotations: &[(&str, &str)],
) -> (JobPod, PathBuf) {
    let events = node.scratch.path(&format!("{name}.{container}.events"));
    opts.events = Some(events.clone());
    let bin = valet_sim::standin::binary_path().expect("valet-standin-proxy");
    let cmd = std::iter::once(bin.to_string_lossy().into_owned()).chain(opts.to_args()).collect();
    let mut spec = JobSpec::new(name).without_readiness_probe();
    let by_default = ["vault-agent", "consul-dataplane", "kuma-sidecar", "linkerd-proxy"];
    if !by_default.contains(&container) {
        spec = spec.annotation("valet.dev/sidecars", container);
    }
    for (k, v) in annotations {
        spec = spec.annotation(k, v);
    }
    spec.sidecar = Some((container.into(), cmd));
    (node.job_pod(spec).expect("pod"), events)
}

/// Requests of `method path` the stand-in received.
fn received(events: &PathBuf, method: &str, path: &str) -> Vec<RequestEvent> {
    read_events(events).unwrap_or_default().into_iter().filter(|e| e.method == method && e.path == path).collect()
}

/// Runs the app to `exit 0` and returns the sidecar's exit code; when it is 0, the pod completes
/// (`Succeeded`, as the kubelet reports it).
fn app_ends(node: &Node, job: &mut JobPod, agent: &Agent) -> Option<i32> {
    agent.wait_tracked(1, HANG_GUARD).expect("tracked");
    job.run_app("app", "exit 0").expect("app");
    let code = job.wait_proxy_exit(HANG_GUARD).expect("wait proxy");
    if code == Some(0) {
        let succeeded = || node.pod(job).is_some_and(|p| p["status"]["phase"] == "Succeeded");
        assert!(eventually(HANG_GUARD, succeeded), "{:?}", node.pod(job).map(|p| p["status"].clone()));
    }
    code
}

/// Waits until the stand-in has blocked SIGTERM (a thread of it shows it in `SigBlk`: its main
/// thread blocks it before any other starts, which inherit the mask, and then takes it with
/// sigwait, which unblocks it while waiting): from then on SIGTERM is its way out, as for the real
/// sidecar once it runs.
fn wait_takes_sigterm(job: &JobPod) {
    let pid = job.proxy.host_pid();
    let sigterm = 1u64 << (libc::SIGTERM - 1);
    let blocks = |status: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix("SigBlk:"))
            .and_then(|mask| u64::from_str_radix(mask.trim(), 16).ok())
            .is_some_and(|mask| mask & sigterm != 0)
    };
    let any_thread_blocks = || {
        std::fs::read_dir(format!("/proc/{pid}/task"))
            .into_iter()
            .flatten()
            .flatten()
            .any(|task| std::fs::read_to_string(task.path().join("status")).is_ok_and(|s| blocks(&s)))
    };
    assert!(eventually(HANG_GUARD, any_thread_blocks), "the stand-in runs");
}

/// The quit's outcome as the pod's Events and the metrics say it: one `SidecarQuit`, no
/// `SidecarQuitFailed`, counted `ok` for `kind`, no escalation.
fn quit_told_and_counted(node: &Node, agent: &Agent, job: &JobPod, kind: &str) {
    assert!(
        agent.wait_metric(&format!("valet_sidecar_quits_total{{kind=\"{kind}\",result=\"ok\"}} "), 1.0),
        "{}",
        agent.log_text()
    );
    assert_eq!(agent.metric(&format!("valet_sidecar_escalations_total{{kind=\"{kind}\"}} ")), 0.0);
    for result in ["rejected", "refused"] {
        let sample = format!("valet_sidecar_quits_total{{kind=\"{kind}\",result=\"{result}\"}} ");
        assert_eq!(agent.metric(&sample), 0.0, "{sample}");
    }
    let events = node.events_for(job);
    assert!(!events.iter().any(|(r, _)| r == "SidecarQuitFailed"), "{events:?}");
}

fn wait_event(node: &Node, job: &JobPod, reason: &str) -> String {
    let mut note = None;
    let found = eventually(HANG_GUARD, || {
        note = node.events_for(job).into_iter().find(|(r, _)| r == reason).map(|(_, n)| n);
        note.is_some()
    });
    assert!(found, "a {reason} Event: {:?}", node.events_for(job));
    note.unwrap_or_default()
}

/// A Job pod whose sidecar, the ready stand-in `opts` in `container`, is quit with `POST path`:
/// the app ends, valet sends that one request from the pod's loopback, the sidecar exits 0, and
/// the pod's Event and the metrics say so (`kind`). The pod, its stand-in's requests and the agent.
fn quit_by_request(
    node: &Node,
    container: &str,
    opts: StandinOptions,
    annotations: &[(&str, &str)],
    path: &str,
    kind: &str,
) -> (JobPod, PathBuf, Agent) {
    let agent = node.start_agent(&[]).expect("agent");
    let (mut job, events) = pod_with(node, kind, container, opts.clone(), annotations);
    job.sim.wait_standin_ready(&opts, HANG_GUARD).expect("ready");
    assert_eq!(app_ends(node, &mut job, &agent), Some(0), "{}", agent.log_text());
    let quits = received(&events, "POST", path);
    assert_eq!(quits.len(), 1, "one quit: {:?}", read_events(&events));
    assert!(quits[0].peer.ip().is_loopback(), "from the pod's loopback: {quits:?}");
    wait_event(node, &job, "SidecarQuit");
    quit_told_and_counted(node, &agent, &job, kind);
    (job, events, agent)
}

#[test]
fn vault_agent_with_enable_quit_exits_0_on_agent_v1_quit() {
    let node = Node::new().expect("node");
    let annotations = [("vault.hashicorp.com/agent-enable-quit", "true")];
    let opts = StandinOptions::new(ProxyKind::Vault);
    quit_by_request(&node, "vault-agent", opts, &annotations, "/agent/v1/quit", "vault");
}

/// Without vault-k8s's `agent-enable-quit` there is no quit to ask for (no listener at all without
/// a cache): valet sends the agent SIGTERM, on which it exits 0, and never a request.
#[test]
fn vault_agent_without_enable_quit_is_sigtermed_and_exits_0() {
    let node = Node::new().expect("node");
    let agent = node.start_agent(&[]).expect("agent");
    let mut opts = StandinOptions::new(ProxyKind::Vault);
    opts.quit_disabled = true;
    let (mut job, events) = pod_with(&node, "vault-off", "vault-agent", opts, &[]);
    wait_takes_sigterm(&job);
    assert_eq!(app_ends(&node, &mut job, &agent), Some(0), "{}", agent.log_text());
    quit_told_and_counted(&node, &agent, &job, "vault");
    assert!(read_events(&events).unwrap_or_default().is_empty(), "no request: nothing listens");
}

/// consul-dataplane's own `/graceful_shutdown` (127.0.0.1:20600), never Envoy's `/quitquitquit`
/// (consul-k8s's liveness probe would restart the container without Envoy).
#[test]
fn consul_dataplane_exits_0_on_graceful_shutdown() {
    let node = Node::new().expect("node");
    let opts = StandinOptions::new(ProxyKind::Consul);
    let (_job, events, _agent) = quit_by_request(&node, "consul-dataplane", opts, &[], "/graceful_shutdown", "consul");
    assert!(received(&events, "POST", "/quitquitquit").is_empty(), "not Envoy's quit");
}

#[test]
fn alloydb_auth_proxy_with_quitquitquit_exits_0() {
    let node = Node::new().expect("node");
    let opts = StandinOptions::new(ProxyKind::AlloyDb);
    quit_by_request(&node, "alloydb-auth-proxy", opts, &[], "/quitquitquit", "alloydb");
}

/// Without `--quitquitquit` nothing listens on the admin port: the quit is refused until
/// `--quit-retry-for` has passed, then valet falls back on SIGTERM, says so in a Warning and
/// counts it; with `--exit-zero-sigterm` the proxy exits 0 (without it, 143).
#[test]
fn alloydb_auth_proxy_without_quitquitquit_ends_in_a_counted_refusal_and_sigterm() {
    let node = Node::new().expect("node");
    let agent = node.start_agent(&["--quit-retry-for", "1s"]).expect("agent");
    let mut opts = StandinOptions::new(ProxyKind::AlloyDb);
    opts.quit_disabled = true;
    opts.sigterm_exit_code = Some(0);
    let (mut job, _) = pod_with(&node, "alloydb-off", "alloydb-auth-proxy", opts.clone(), &[]);
    job.sim.wait_standin_ready(&opts, HANG_GUARD).expect("ready");
    assert_eq!(app_ends(&node, &mut job, &agent), Some(0), "{}", agent.log_text());
    let note = wait_event(&node, &job, "SidecarQuitFailed");
    assert!(note.contains("alloydb-auth-proxy"), "{note}");
    assert!(agent.wait_metric("valet_sidecar_quits_total{kind=\"alloydb\",result=\"refused\"} ", 1.0));
    assert!(agent.wait_metric("valet_sidecar_escalations_total{kind=\"alloydb\"} ", 1.0), "{}", agent.log_text());
}

/// kuma-dp has no quit endpoint of its own: SIGTERM starts its drain (`kuma.io/sidecar-drain-time`,
/// short here), then it exits 0.
#[test]
fn kuma_sidecar_is_sigtermed_and_exits_0() {
    let node = Node::new().expect("node");
    let agent = node.start_agent(&[]).expect("agent");
    let mut opts = StandinOptions::new(ProxyKind::Kuma);
    opts.drain = Some(Duration::from_millis(200));
    let (mut job, events) = pod_with(&node, "kuma", "kuma-sidecar", opts.clone(), &[]);
    job.sim.wait_standin_ready(&opts, HANG_GUARD).expect("ready");
    wait_takes_sigterm(&job);
    assert_eq!(app_ends(&node, &mut job, &agent), Some(0), "{}", agent.log_text());
    quit_told_and_counted(&node, &agent, &job, "kuma");
    let posts = read_events(&events).unwrap_or_default().into_iter().filter(|e| e.method == "POST").count();
    assert_eq!(posts, 0, "no quit request: {:?}", read_events(&events));
}

/// Linkerd's proxy with `/shutdown` off, as Linkerd ships it: the refusal (404) is its normal
/// case, and SIGTERM its way out. The pod gets a Normal Event saying so, no Warning, and the quit
/// counts as ok, not as an escalation.
#[test]
fn linkerd_with_shutdown_off_is_sigtermed_without_a_warning() {
    let node = Node::new().expect("node");
    let agent = node.start_agent(&[]).expect("agent");
    let mut opts = StandinOptions::new(ProxyKind::Linkerd);
    opts.linkerd_shutdown_disabled = true;
    let (mut job, events) = pod_with(&node, "linkerd-off", "linkerd-proxy", opts.clone(), &[]);
    job.sim.wait_standin_ready(&opts, HANG_GUARD).expect("ready");
    wait_takes_sigterm(&job);
    assert_eq!(app_ends(&node, &mut job, &agent), Some(0), "{}", agent.log_text());
    assert_eq!(received(&events, "POST", "/shutdown").len(), 1, "{:?}", read_events(&events));
    let note = wait_event(&node, &job, "SidecarQuit");
    assert!(note.contains("SIGTERM") && note.contains("/shutdown"), "{note}");
    let warnings: Vec<_> = node.events_about(&job).into_iter().filter(|e| e["type"] == "Warning").collect();
    assert!(warnings.is_empty(), "{warnings:?}");
    quit_told_and_counted(&node, &agent, &job, "linkerd");
}

/// A RuntimeClass named otherwise whose handler is a sandbox's (`secure`, handler `kata`): its
/// pods take their ends from the API, as a `kata` class's do, once the agent has listed the
/// RuntimeClasses from the API server; a class whose handler is runc keeps the kernel path.
#[test]
fn a_sandbox_is_known_by_its_runtime_class_handler() {
    use valet_sim::apiserver::Kind;
    let node = Node::new().expect("node");
    for (name, handler) in [("secure", "kata"), ("plain", "runc")] {
        let class = serde_json::json!({"metadata": {"name": name}, "handler": handler});
        node.api.put_object(Kind::RuntimeClass, class).expect("a RuntimeClass");
    }
    let agent = node.start_agent(&[]).expect("agent");
    let sandboxed = node.job_pod(JobSpec::new("secure-job").runtime_class("secure")).expect("pod");
    let note = wait_event(&node, &sandboxed, "EndsFromApi");
    assert!(note.contains("runtimeClassName secure, handler kata"), "{note}");
    assert_eq!(agent.metric("valet_pods_api_path_total{reason=\"sandboxed\"} "), 1.0);
    // The runc class's pod is tracked on the kernel path: counted nowhere, told nothing.
    let plain = node.job_pod(JobSpec::new("plain-job").runtime_class("plain")).expect("pod");
    agent.wait_tracked(2, HANG_GUARD).expect("both pods tracked");
    assert_eq!(agent.metric("valet_pods_api_path_total{reason=\"sandboxed\"} "), 1.0, "{}", agent.log_text());
    assert!(!node.events_for(&plain).iter().any(|(r, _)| r == "EndsFromApi"), "{:?}", node.events_for(&plain));
}

/// A RuntimeClass made after the agent listed them: the first pod naming it is decided without a
/// guess (its ends from the API, counted as an unknown class) and makes the agent list again; a
/// pod after that list is decided by the class's handler.
#[test]
fn a_runtime_class_made_after_the_list_is_never_guessed_and_is_listed_again() {
    use valet_sim::apiserver::Kind;
    let node = Node::new().expect("node");
    let agent = node.start_agent(&[]).expect("agent");
    let class = serde_json::json!({"metadata": {"name": "late"}, "handler": "kata"});
    node.api.put_object(Kind::RuntimeClass, class).expect("a RuntimeClass");
    let first = node.job_pod(JobSpec::new("first-job").runtime_class("late")).expect("pod");
    let note = wait_event(&node, &first, "EndsFromApi");
    assert!(note.contains("runtimeClassName late was not in the agent's last list"), "{note}");
    assert_eq!(agent.metric("valet_pods_api_path_total{reason=\"unknown_runtime_class\"} "), 1.0);
    let listed = eventually(HANG_GUARD, || agent.log_text().contains("listed the RuntimeClasses again"));
    assert!(listed, "no list after the miss: {}", agent.log_text());
    let second = node.job_pod(JobSpec::new("second-job").runtime_class("late")).expect("pod");
    let note = wait_event(&node, &second, "EndsFromApi");
    assert!(note.contains("runtimeClassName late, handler kata"), "{note}");
    assert_eq!(agent.metric("valet_pods_api_path_total{reason=\"sandboxed\"} "), 1.0, "{}", agent.log_text());
}

/// A node whose default runtime is a sandbox (`--default-runtime-handler kata`, as containerd's
/// `default_runtime_name = "kata"`): a pod without a runtimeClassName takes its ends from the API,
/// as a `kata` class's does; a pod whose class names runc keeps the kernel path.
#[test]
fn on_a_node_whose_default_runtime_is_a_sandbox_a_pod_without_a_class_is_sandboxed() {
    use valet_sim::apiserver::Kind;
    let node = Node::new().expect("node");
    let class = serde_json::json!({"metadata": {"name": "plain"}, "handler": "runc"});
    node.api.put_object(Kind::RuntimeClass, class).expect("a RuntimeClass");
    let agent = node.start_agent(&["--default-runtime-handler", "kata"]).expect("agent");
    let unset = node.job_pod(JobSpec::new("default-job")).expect("pod");
    let note = wait_event(&node, &unset, "EndsFromApi");
    assert!(note.contains("runtimeClassName unset, the node's default handler kata"), "{note}");
    assert_eq!(agent.metric("valet_pods_api_path_total{reason=\"sandboxed\"} "), 1.0);
    let plain = node.job_pod(JobSpec::new("plain-job").runtime_class("plain")).expect("pod");
    agent.wait_tracked(2, HANG_GUARD).expect("both pods tracked");
    assert_eq!(agent.metric("valet_pods_api_path_total{reason=\"sandboxed\"} "), 1.0, "{}", agent.log_text());
    assert!(!node.events_for(&plain).iter().any(|(r, _)| r == "EndsFromApi"), "{:?}", node.events_for(&plain));
}
