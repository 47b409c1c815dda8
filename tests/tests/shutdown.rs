//! End to end, issue "exec-free sidecar shutdown": the real agent binary against the fake API
//! server, real cgroups, network namespaces and a stand-in Istio pilot-agent.
//!
//! The node's kubelet is as unhelpful as a real one (see `valet_sim::kubelet`): the API names a
//! container about a second after it started and reports its exit about a second later; the
//! runtime writes OCI bundles before a container starts and removes bundle and cgroup at its exit.
//! Tests that need a kinder node say so.
//!
//! Every test starts its own node (API server) and agent, so they run in parallel. Negative
//! checks ("no quit") always run next to a pod that does quit in the same agent, or check an
//! exact metric, so a dead agent cannot pass them; and they run after a later event that the
//! agent handles after what they check (a witness pod's quit), never after a quiet moment. Waits
//! are for events; their timeout is only a hang guard.

use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde_json::Value;
use valet_sim::apiserver::{Fault, Kind, Propagation};
use valet_sim::node::{CgroupDriver, QosClass, Runtime};
use valet_tests::harness::{
    AGENT_DAEMONSET, AGENT_NAMESPACE, Agent, HANG_GUARD, JobPod, JobSpec, Node, eventually, process_state, wait_file,
};

/// The later event of a "nothing happened" check: a labelled pod added now, whose app exits and
/// whose proxy the agent quits. The agent learns of it through the same pod watch, after every
/// update before it, and of its end through the same ring buffer, after every end before it:
/// once it is quit, whatever came before was handled (and any quit it called for was sent).
fn witness(node: &Node, agent: &Agent, name: &str) {
    let mut job = node.job_pod(JobSpec::new(name)).expect("witness pod");
    job.run_app("app", "exit 0").expect("witness app");
    assert_eq!(job.wait_proxy_exit(HANG_GUARD).expect("wait"), Some(0), "the witness quit\n{}", agent.log_text());
    // The proxy exits once it answered; the agent counts the quit (and posts this Event after
    // it) when it has read the answer.
    assert!(
        eventually(HANG_GUARD, || node.events_for(&job).iter().any(|(r, _)| r == "SidecarQuit")),
        "the witness's quit handled\n{}",
        agent.log_text()
    );
}

/// Readiness probes from the pod's own loopback (the agent's; the kubelet probes the pod IP).
fn loopback_probes(job: &JobPod) -> usize {
    job.requests()
        .iter()
        .filter(|e| e.method == "GET" && e.path == "/healthz/ready" && e.peer.ip().is_loopback())
        .count()
}

#[test]
fn labelled_job_pod_proxy_quits_when_the_app_exits() {
    let node = Node::new().expect("node");
    let agent = node.start_agent(&[]).expect("agent");
    let mut job = node.job_pod(JobSpec::new("quick")).expect("pod");
    agent.wait_tracked(1, HANG_GUARD).expect("tracked");
    job.run_app("app", "sleep 0.1; exit 0").expect("app");
    let code = job.wait_proxy_exit(HANG_GUARD).expect("wait");
    assert_eq!(code, Some(0), "proxy exited 0 after the quit\n{}", agent.log_text());
    let quits = job.quits();
    assert_eq!(quits.len(), 1, "exactly one quit: {quits:?}");
    assert!(quits[0].peer.ip().is_loopback(), "sent from inside the pod: {:?}", quits[0].peer);
    assert!(
        eventually(HANG_GUARD, || node.events_for(&job).iter().any(|(r, _)| r == "SidecarQuit")),
        "a SidecarQuit Event: {:?}",
        node.events_for(&job)
    );
    assert!(agent.wait_metric("valet_sidecar_quits_total{kind=\"istio\",result=\"ok\"} ", 1.0));
    // The app's end is logged once, with its container's name and how it ended.
    let ended = |log: &str| {
        log.lines()
            .filter(|l| l.contains("container exited") && l.contains("container=\"app\"") && l.contains("Exited(0)"))
            .count()
    };
    assert!(eventually(HANG_GUARD, || ended(&agent.log_text()) == 1), "{}", agent.log_text());
}

/// The quit is one write on a connection the agent opened to the proxy's quit port while the app
/// ran (after the proxy was seen ready), and the agent's readiness probes share a connection:
/// no connect, thread or `setns` stands between the app's exit and the quit.
#[test]
fn the_quit_goes_on_a_connection_opened_before_the_app_exited() {
    let node = Node::new().expect("node");
    let agent = node.start_agent(&["--probe-interval", "100ms"]).expect("agent");
    let ready = node.scratch.path("kept-ready");
    let mut spec = JobSpec::new("kept");
    spec.ready_file = Some(ready.clone());
    let mut job = node.job_pod(spec).expect("pod");
    agent.wait_tracked(1, HANG_GUARD).expect("tracked");
    // Probed a few times while not ready, then ready.
    assert!(eventually(HANG_GUARD, || loopback_probes(&job) >= 3), "probed\n{}", agent.log_text());
    std::fs::write(&ready, "").expect("ready file");
    assert!(
        eventually(HANG_GUARD, || {
            let pod = node.pod(&job).unwrap_or_default();
            pod["status"]["conditions"]
                .as_array()
                .is_some_and(|cs| cs.iter().any(|c| c["type"] == "valet.dev/ProxyReady" && c["status"] == "True"))
        }),
        "the proxy was seen ready\n{}",
        agent.log_text()
    );
    // The connection for the quit: from the pod's loopback, carrying no probe (the probes share
    // theirs, made before).
    let standby = || {
        let events = job.requests();
        let used: std::collections::HashSet<_> =
            events.iter().filter(|e| e.method != "ACCEPT").map(|e| e.peer).collect();
        events.iter().any(|e| e.method == "ACCEPT" && e.peer.ip().is_loopback() && !used.contains(&e.peer))
    };
    assert!(eventually(HANG_GUARD, standby), "no connection opened for the quit\n{}", agent.log_text());
    let before_exit = valet_agent::host::clock::monotonic_ns();
    job.run_app("app", "exit 0").expect("app");
    assert_eq!(job.wait_proxy_exit(HANG_GUARD).expect("wait"), Some(0), "{}", agent.log_text());
    // Sent by the kernel event reader as soon as it read the end, and taken over by the loop.
    assert_eq!(job.quits().len(), 1, "exactly one quit: {:?}", job.quits());
    assert!(agent.wait_metric("valet_quits_sent_ahead_total{result=\"sent\"} ", 1.0));
    assert_eq!(agent.metric("valet_quits_sent_ahead_total{result=\"unclaimed\"} "), 0.0);
    assert!(
        eventually(HANG_GUARD, || { agent.metric("valet_sidecar_quits_total{kind=\"istio\",result=\"ok\"} ") == 1.0 }),
        "the answer to the quit sent ahead was read\n{}",
        agent.log_text()
    );
    let events = valet_sim::standin::read_events(&job.events).expect("events");
    let quit = job.loopback_quits().first().cloned().expect("a quit from the pod's loopback");
    let accepted = events
        .iter()
        .find(|e| e.method == "ACCEPT" && e.peer == quit.peer)
        .map(|e| e.mono_ns)
        .expect("the quit's connection was accepted");
    assert!(
        accepted < before_exit,
        "the quit's connection was opened {} µs after the app started to exit: {events:?}",
        (accepted - before_exit) / 1000
    );
    // The agent's probes (from the pod's loopback; the kubelet probes the pod IP) reuse one
    // connection while the proxy keeps it open.
    let probes: Vec<_> = events
        .iter()
        .filter(|e| e.method == "GET" && e.path == "/healthz/ready" && e.peer.ip().is_loopback())
        .collect();
    let connections: std::collections::HashSet<_> = probes.iter().map(|e| e.peer).collect();
    assert!(probes.len() >= 3, "probed a few times: {probes:?}");
    assert!(connections.len() < probes.len(), "{} probes on {} connections", probes.len(), connections.len());
}

/// restartPolicy Never: the app failing (exit 3) still ends the work; the proxy is quit and exits
/// 0 (the Job's failure is the app's, not the sidecar's). Also the cgroupfs driver, CRI-O's
/// `crio-<ID>` leaves and a Guaranteed pod (no QoS level in the path).
#[test]
fn never_policy_failed_app_still_quits_cgroupfs_crio_guaranteed() {
    let node = Node::new().expect("node");
    let agent = node.start_agent(&[]).expect("agent");
    let spec = JobSpec::new("fails").cgroup_layout(CgroupDriver::Cgroupfs, Runtime::Crio, QosClass::Guaranteed);
    let mut job = node.job_pod(spec).expect("pod");
    assert!(
        job.sim.pod_cgroup_path().to_string_lossy().contains(&format!("/kubepods/pod{}", job.sim.uid())),
        "cgroupfs Guaranteed layout: {}",
        job.sim.pod_cgroup_path().display()
    );
    agent.wait_tracked(1, HANG_GUARD).expect("tracked");
    job.run_app("app", "sleep 0.1; exit 3").expect("app");
    let app = job.apps[0].wait_timeout(HANG_GUARD).expect("wait app").expect("app exited");
    assert_eq!(app.code(), Some(3));
    let code = job.wait_proxy_exit(HANG_GUARD).expect("wait");
    assert_eq!(code, Some(0), "proxy quit and exited 0\n{}", agent.log_text());
    let quits = job.quits();
    assert_eq!(quits.len(), 1, "exactly one quit: {quits:?}");
    assert!(quits[0].peer.ip().is_loopback(), "sent from inside the pod: {:?}", quits[0].peer);
    // The kernel path saw the app's failure and the proxy's clean end.
    assert!(agent.wait_metric("valet_container_exits_total{outcome=\"Failure\"} ", 1.0));
    assert!(
        eventually(HANG_GUARD, || agent.metric("valet_container_exits_total{outcome=\"Success\"} ") == 1.0),
        "{}",
        agent.metrics_text().unwrap_or_default()
    );
    assert_eq!(agent.metric("valet_container_exits_total{outcome=\"Signal\"} "), 0.0);
    assert!(agent.wait_metric("valet_sidecar_quits_total{kind=\"istio\",result=\"ok\"} ", 1.0));
}

/// Pods without the label and pods of another node are never touched, while a labelled pod of
/// this node, in the same agent at the same time, is.
#[test]
fn unlabelled_and_other_node_pods_are_left_alone() {
    let node = Node::new().expect("node");
    let agent = node.start_agent(&[]).expect("agent");
    let mut unlabelled = JobSpec::new("unlabelled");
    unlabelled.labelled = false;
    let mut unlabelled = node.job_pod(unlabelled).expect("unlabelled pod");
    let mut foreign = JobSpec::new("foreign");
    foreign.node = Some("other".into());
    let mut foreign = node.job_pod(foreign).expect("foreign pod");
    let mut good = node.job_pod(JobSpec::new("good")).expect("good pod");
    agent.wait_tracked(1, HANG_GUARD).expect("tracked");

    for job in [&mut unlabelled, &mut foreign, &mut good] {
        job.run_app("app", "exit 0").expect("app");
    }
    assert_eq!(good.wait_proxy_exit(HANG_GUARD).expect("wait"), Some(0), "{}", agent.log_text());
    assert_eq!(good.quits().len(), 1);
    // The kubelet reports the other apps terminated a second later; still nothing happens.
    for job in [&unlabelled, &foreign] {
        assert_eq!(job.wait_api_terminated("app", HANG_GUARD), Some(0), "{}", job.name);
    }

    witness(&node, &agent, "witness");
    for job in [&mut unlabelled, &mut foreign] {
        assert_eq!(job.wait_proxy_exit(Duration::ZERO).expect("poll"), None, "{} proxy must still run", job.name);
        assert!(job.quits().is_empty(), "{}: no quit at all: {:?}", job.name, job.quits());
        assert!(node.events_for(job).is_empty(), "{}: no Events: {:?}", job.name, node.events_for(job));
    }
    // Only the labelled pod's cgroup is watched by the kernel programs: its app's and its proxy's
    // ends are seen, none of the other pods'.
    assert!(agent.wait_metric("valet_pods_tracked ", 2.0), "the good pod and the witness");
    // The witness proxy's own end is counted once the kernel reported it, after its exit.
    assert!(
        eventually(HANG_GUARD, || agent.metric("valet_container_exits_total{outcome=\"Success\"} ") == 4.0),
        "{}",
        agent.metrics_text().unwrap_or_default()
    );
    assert!(eventually(HANG_GUARD, || metric_sum(&agent, "valet_sidecar_quits_total") == 2.0));
}

/// restartPolicy OnFailure: an app that failed is restarted in place by the kubelet (new container
/// id and cgroup, after the back-off), so its proxy stays; an app that succeeded ends the work.
#[test]
fn on_failure_policy_quits_only_after_success() {
    let node = Node::new().expect("node");
    let agent = node.start_agent(&[]).expect("agent");
    let mut failing = node.job_pod(JobSpec::new("retry").restart_policy("OnFailure")).expect("pod");
    let mut ok = node.job_pod(JobSpec::new("retry-ok").restart_policy("OnFailure")).expect("pod");
    agent.wait_tracked(2, HANG_GUARD).expect("tracked");
    // Both proxies seen ready: a connection to each quit endpoint is kept, and a quit would go
    // ahead from the kernel event on it. Only the success calls for one.
    for job in [&failing, &ok] {
        assert!(
            eventually(HANG_GUARD, || node.proxy_ready_condition(job)),
            "{} seen ready\n{}",
            job.name,
            agent.log_text()
        );
    }
    // ... and a quit connection kept to each (opened once the proxy was seen ready).
    for job in [&failing, &ok] {
        let kept = || {
            let events = job.requests();
            let used: std::collections::HashSet<_> =
                events.iter().filter(|e| e.method != "ACCEPT").map(|e| e.peer).collect();
            events.iter().any(|e| e.method == "ACCEPT" && e.peer.ip().is_loopback() && !used.contains(&e.peer))
        };
        assert!(eventually(HANG_GUARD, kept), "{}: no quit connection\n{}", job.name, agent.log_text());
    }

    failing.run_app("app", "exit 1").expect("app");
    let status = failing.apps[0].wait_timeout(HANG_GUARD).expect("wait app").expect("exited");
    assert_eq!(status.code(), Some(1));
    assert!(
        eventually(HANG_GUARD, || agent.metric("valet_container_exits_total{outcome=\"Failure\"} ") == 1.0),
        "the agent saw the failure\n{}",
        agent.log_text()
    );
    // The kubelet restarts it in place (and it fails again): still no quit.
    let first_id = failing.apps[0].id().to_owned();
    assert!(
        eventually(HANG_GUARD, || failing.process("app").is_some_and(|p| p.id() != first_id)),
        "the kubelet restarted the app"
    );
    assert!(
        eventually(HANG_GUARD, || failing.api_status("app").is_some_and(|s| s["restartCount"] == 1)),
        "the API shows the restart: {:?}",
        failing.api_status("app")
    );
    // The other pod's app ends after all this: its quit is the later event.
    ok.run_app("app", "exit 0").expect("app");
    assert_eq!(ok.wait_proxy_exit(HANG_GUARD).expect("wait"), Some(0), "{}", agent.log_text());
    assert_eq!(ok.quits().len(), 1);
    assert!(failing.quits().is_empty(), "still no quit for the failed pod: {:?}", failing.quits());
    assert_eq!(failing.wait_proxy_exit(Duration::ZERO).expect("poll"), None);
    // Counted once the agent read the answer (the proxy may exit before).
    assert!(eventually(HANG_GUARD, || metric_sum(&agent, "valet_sidecar_quits_total") == 1.0), "one quit");
    assert!(agent.wait_metric("valet_quits_sent_ahead_total{result=\"sent\"} ", 1.0), "the success's, ahead");
    assert_eq!(agent.metric("valet_quits_sent_ahead_total{result=\"unclaimed\"} "), 0.0);
}

/// Container restart rules (KEP-5307, on by default from Kubernetes 1.35): an app's own
/// `restartPolicy` or `restartPolicyRules` override the pod's `Never`. An exit the kubelet answers
/// with a restart is no end: the proxy stays through it, and is quit once the restarted app
/// exits in a way that stays.
#[test]
fn an_exit_the_apps_restart_rule_restarts_keeps_the_proxy() {
    let node = Node::new().expect("node");
    let agent = node.start_agent(&[]).expect("agent");
    let rule =
        JobSpec::new("rule-42").app_restart_policy("app", "Never").app_restart_rule("app", "Restart", "In", &[42]);
    let own = JobSpec::new("own-onfailure").app_restart_policy("app", "OnFailure");
    let mut jobs = Vec::new();
    for (spec, first_code) in [(rule, 42), (own, 1)] {
        let name = spec.name.clone();
        let (go, again, marker) = (
            node.scratch.path(&format!("{name}.go")),
            node.scratch.path(&format!("{name}.again")),
            node.scratch.path(&format!("{name}.ran")),
        );
        // The first instance exits `first_code`; the restarted one waits for `again`, then exits 0.
        let script = format!(
            "while [ ! -e {go} ]; do sleep 0.02; done; \
             if [ -e {marker} ]; then while [ ! -e {again} ]; do sleep 0.02; done; exit 0; fi; \
             touch {marker}; exit {first_code}",
            go = go.display(),
            again = again.display(),
            marker = marker.display(),
        );
        let job = node.job_pod(spec.app_command("app", &script)).expect("pod");
        jobs.push((job, go, again, first_code));
    }
    agent.wait_tracked(2, HANG_GUARD).expect("tracked");
    for (job, go, _, first_code) in &jobs {
        // Seen ready first, so that a quit would be armed ahead of the exit, were it judged an end.
        assert!(eventually(HANG_GUARD, || node.proxy_ready_condition(job)), "{} ready\n{}", job.name, agent.log_text());
        let first = job.process("app").expect("the app runs");
        std::fs::write(go, b"").expect("go");
        let status = first.wait_timeout(HANG_GUARD).expect("wait").expect("the first instance exited");
        assert_eq!(valet_sim::kubelet::exit_code(status), *first_code);
        let first_id = first.id().to_owned();
        assert!(
            eventually(HANG_GUARD, || job.process("app").is_some_and(|p| p.id() != first_id)),
            "{}: the kubelet restarted the app",
            job.name
        );
        assert!(
            eventually(HANG_GUARD, || job.api_status("app").is_some_and(|s| s["restartCount"] == 1)),
            "{}: the API shows the restart: {:?}",
            job.name,
            job.api_status("app")
        );
    }
    // Both first exits were read from the kernel long before the restarts the API showed.
    assert!(
        eventually(HANG_GUARD, || agent.metric("valet_container_exits_total{outcome=\"Failure\"} ") == 2.0),
        "the agent saw both first exits\n{}",
        agent.metrics_text().unwrap_or_default()
    );
    witness(&node, &agent, "witness");
    for (job, ..) in jobs.iter_mut() {
        assert!(
            job.quits().is_empty(),
            "{}: no quit at the first exit: {:?}\n{}",
            job.name,
            job.quits(),
            agent.log_text()
        );
        assert_eq!(job.wait_proxy_exit(Duration::ZERO).expect("poll"), None, "{}: the proxy still runs", job.name);
    }
    for (job, _, again, _) in jobs.iter_mut() {
        let second = job.process("app").expect("the restarted app");
        std::fs::write(&*again, b"").expect("again");
        let status = second.wait_timeout(HANG_GUARD).expect("wait").expect("the restarted app exited");
        let ended = Instant::now();
        assert_eq!(valet_sim::kubelet::exit_code(status), 0);
        assert_eq!(job.wait_proxy_exit(HANG_GUARD).expect("wait"), Some(0), "{}\n{}", job.name, agent.log_text());
        println!("{}: proxy exited {:?} after the restarted app's exit 0 was seen here", job.name, ended.elapsed());
        assert_eq!(job.quits().len(), 1, "{}: one quit", job.name);
    }
}

/// Several app containers: the proxy is quit only after the last one, exactly once.
#[test]
fn multi_container_pod_quits_after_the_last_app() {
    let node = Node::new().expect("node");
    let agent = node.start_agent(&[]).expect("agent");
    let mut job = node.job_pod(JobSpec::new("multi").apps(&["a", "b"])).expect("pod");
    agent.wait_tracked(1, HANG_GUARD).expect("tracked");
    let go = node.scratch.path(&format!("{}.b-go", job.name));
    job.run_app("a", "exit 0").expect("app a");
    job.run_app("b", &format!("while [ ! -e {} ]; do sleep 0.02; done; exit 0", go.display())).expect("app b");

    assert!(job.apps[0].wait_timeout(HANG_GUARD).expect("wait a").is_some(), "a exited");
    assert!(
        eventually(HANG_GUARD, || agent.metric("valet_container_exits_total{outcome=\"Success\"} ") == 1.0),
        "the agent saw a's exit\n{}",
        agent.log_text()
    );
    witness(&node, &agent, "multi-witness");
    assert!(job.quits().is_empty(), "no quit while b runs: {:?}", job.quits());
    assert_eq!(job.wait_proxy_exit(Duration::ZERO).expect("poll"), None);

    std::fs::write(&go, b"").expect("release b");
    assert_eq!(job.wait_proxy_exit(HANG_GUARD).expect("wait"), Some(0), "{}", agent.log_text());
    // The kubelet reports both a moment later: nothing more happens.
    assert_eq!(job.wait_api_terminated("a", HANG_GUARD), Some(0));
    assert_eq!(job.wait_api_terminated("b", HANG_GUARD), Some(0));
    witness(&node, &agent, "multi-witness-2");
    assert_eq!(job.quits().len(), 1, "exactly one quit: {:?}", job.quits());
    assert!(
        eventually(HANG_GUARD, || metric_sum(&agent, "valet_sidecar_quits_total") == 3.0),
        "the pod's and the witnesses'"
    );
    assert!(agent.wait_metric("valet_sidecar_quits_total{kind=\"istio\",result=\"ok\"} ", 3.0));
}

/// A multi-threaded app whose process is ended by a worker thread after the main thread is gone
/// (as Go's `os.Exit` or a runtime's exit path can do), with a child process still running: the
/// container ends with the app's own exit (6), not with its child's (killed by the kernel when
/// the namespace's init is gone). Seen by the kernel path; the API is never told here.
#[test]
fn multithreaded_app_ended_by_a_worker_thread_quits() {
    let node = Node::new().expect("node");
    let agent = node.start_agent(&[]).expect("agent");
    let mut job = node.job_pod(JobSpec::new("threads")).expect("pod");
    agent.wait_tracked(1, HANG_GUARD).expect("tracked");
    let threads = env!("CARGO_BIN_EXE_valet-test-threads");
    job.run_app("app", &format!("sleep 30 & exec {threads} leader-first")).expect("app");
    let status = job.apps[0].wait_timeout(HANG_GUARD).expect("wait app").expect("exited");
    assert_eq!(status.code(), Some(6));
    assert_eq!(job.wait_proxy_exit(HANG_GUARD).expect("wait"), Some(0), "{}", agent.log_text());
    assert_eq!(job.quits().len(), 1);
    assert!(agent.wait_metric("valet_container_exits_total{outcome=\"Failure\"} ", 1.0), "{}", agent.log_text());
    assert_eq!(agent.metric("valet_container_exits_total{outcome=\"Signal\"} "), 0.0, "{}", agent.log_text());
}

/// The app ends before the API shows its containerID (the kubelet syncs statuses about a second
/// later) and the runtime writes no bundles: the kernel's end is kept by container ID and used as
/// soon as the API names the container, even while the API still shows it running (the relist saw
/// it running just before the exit). The test writes that status itself.
#[test]
fn exit_before_the_api_shows_container_ids_is_used_when_they_arrive() {
    let node = Node::new().expect("node");
    let agent = node.start_agent(&[]).expect("agent");
    let mut job = node.job_pod(JobSpec::new("no-ids").manual_status().no_bundles()).expect("pod");
    agent.wait_tracked(1, HANG_GUARD).expect("tracked");

    job.run_app("app", "exit 0").expect("app");
    assert!(
        eventually(HANG_GUARD, || agent.metric("valet_container_exits_total{outcome=\"Success\"} ") == 1.0),
        "the agent saw the exit\n{}",
        agent.log_text()
    );
    witness(&node, &agent, "no-ids-witness");
    assert!(job.quits().is_empty(), "which container ended is not known yet: {:?}", job.quits());

    // The kubelet's next status sync names the containers (the app still shown running).
    let mut status = job.runtime_status().expect("status");
    for c in status["containerStatuses"].as_array_mut().expect("statuses") {
        if c["name"] == "app" {
            let started = c["state"]["terminated"]["startedAt"].clone();
            c["state"] = serde_json::json!({"running": {"startedAt": started}});
            c["ready"] = Value::Bool(true);
            c["started"] = Value::Bool(true);
        }
    }
    assert!(status["containerStatuses"][0]["containerID"].is_string(), "{status}");
    let ids = status["containerStatuses"].clone();
    node.api.modify_pod("jobs", &job.name, |pod| pod["status"]["containerStatuses"] = ids).expect("sync");
    assert_eq!(job.wait_proxy_exit(HANG_GUARD).expect("wait"), Some(0), "{}", agent.log_text());
    assert_eq!(job.quits().len(), 1);
}

/// The app exited while no agent ran: the API shows it terminated, and the agent quits the proxy
/// soon after it starts.
#[test]
fn agent_started_after_the_app_exited_quits_from_the_api_view() {
    let node = Node::new().expect("node");
    let mut spec = JobSpec::new("late");
    spec.already_exited = vec!["app".into()];
    let mut job = node.job_pod(spec).expect("pod");
    let agent = node.start_agent(&[]).expect("agent");
    let code = job.wait_proxy_exit(HANG_GUARD).expect("wait");
    assert_eq!(code, Some(0), "quit after the agent's start\n{}", agent.log_text());
    assert_eq!(job.quits().len(), 1, "{:?}", job.quits());
    // Counted once the agent read the answer (the proxy may exit before).
    assert!(
        eventually(HANG_GUARD, || agent.metric("valet_sidecar_quits_total{kind=\"istio\",result=\"ok\"} ") == 1.0),
        "the quit counted\n{}",
        agent.log_text()
    );
    // The only container end the kernel saw is the proxy's own: the app's came from the API.
    assert!(
        eventually(HANG_GUARD, || agent.metric("valet_container_exits_total{outcome=\"Success\"} ") == 1.0),
        "{}",
        agent.metrics_text().unwrap_or_default()
    );
    assert!(eventually(HANG_GUARD, || metric_sum(&agent, "valet_container_exits_total") == 1.0));
}

/// The pod object (its app already shown terminated) arrives before the kubelet made the pod's
/// cgroup: the agent quits the proxy once the cgroup appears, without waiting for another update.
#[test]
fn pod_seen_before_its_cgroup_is_quit_once_the_cgroup_appears() {
    use valet_sim::node::{ContainerOptions, PodJsonOptions, SimPod, SimPodOptions, SpawnOptions};
    use valet_sim::standin::{ProxyKind, StandinOptions};

    let node = Node::new().expect("node");
    let name = format!("early-{}", valet_sim::util::random_hex(3));
    let uid = valet_sim::util::uuid_v4();
    let (app_id, proxy_id) = (valet_sim::util::random_container_id(), valet_sim::util::random_container_id());
    let options = || {
        SimPodOptions::new(&name)
            .namespace("jobs")
            .uid(&uid)
            .container_with(ContainerOptions { id: Some(app_id.clone()), ..ContainerOptions::new("app") })
            .container_with(ContainerOptions { id: Some(proxy_id.clone()), ..ContainerOptions::new("istio-proxy") })
    };
    // The pod object as the API will show it; its cgroups are removed again at once.
    let mut pod = SimPod::create(options())
        .expect("sim pod")
        .pod_json(&PodJsonOptions::node(&node.name).label("valet.dev/enabled", "true").job("early"));
    valet_sim::node::mark_container_terminated(&mut pod, "app", 0).expect("terminated");
    node.api.create_pod(pod).expect("post");
    let agent = node.start_agent(&[]).expect("agent");
    agent.wait_tracked(1, HANG_GUARD).expect("tracked");
    std::thread::sleep(Duration::from_millis(600));

    // Now the kubelet's cgroups, the sandbox and the proxy.
    let sim = SimPod::create(options()).expect("sim pod again");
    let _pause = sim.spawn_pause().expect("pause");
    let events = node.scratch.path(&format!("{name}.proxy-events"));
    let mut standin = StandinOptions::new(ProxyKind::Istio);
    standin.events = Some(events.clone());
    let mut proxy = sim.spawn_standin("istio-proxy", &standin, &SpawnOptions::default()).expect("proxy");
    let status = proxy.wait_timeout(HANG_GUARD).expect("wait");
    assert_eq!(status.and_then(|s| s.code()), Some(0), "proxy quit once its cgroup appeared\n{}", agent.log_text());
    let quits = valet_sim::standin::read_events(&events).expect("events");
    assert_eq!(quits.iter().filter(|e| e.path == "/quitquitquit").count(), 1, "{quits:?}");
}

/// The watch is cut and its history expired (the agent must re-list): a pod added afterwards is
/// still handled, and the restart is counted.
#[test]
fn watch_dropped_and_history_expired_pod_added_afterwards_is_handled() {
    let node = Node::new().expect("node");
    let agent = node.start_agent(&[]).expect("agent");
    let _before = node.job_pod(JobSpec::new("before")).expect("pod");
    agent.wait_tracked(1, HANG_GUARD).expect("tracked");
    let restarts = agent.metric("valet_watch_restarts_total ");
    let watches = node.api.watch_count();

    node.api.expire_history();
    node.api.drop_watches();
    let mut job = node.job_pod(JobSpec::new("after")).expect("pod");
    job.run_app("app", "sleep 0.2; exit 0").expect("app");
    assert!(job.apps[0].wait_timeout(HANG_GUARD).expect("wait app").is_some());
    assert_eq!(job.wait_proxy_exit(HANG_GUARD).expect("wait"), Some(0), "{}", agent.log_text());
    assert_eq!(job.quits().len(), 1);
    assert!(agent.wait_metric("valet_pods_tracked ", 2.0));
    assert!(node.api.watch_count() > watches, "the agent watched again");
    assert!(
        eventually(HANG_GUARD, || agent.metric("valet_watch_restarts_total ") > restarts),
        "watch restart counted: {} → {}",
        restarts,
        agent.metric("valet_watch_restarts_total ")
    );
    // It re-listed (the old resourceVersion was gone) rather than resuming.
    let lists = node.api.requests().into_iter().filter(|r| r.path == "/api/v1/pods" && !r.is_watch()).count();
    assert!(lists >= 2, "initial list and a re-list: {lists}");
}

/// A stand-in that accepts connections and never answers: its quit times out and is retried for
/// `--quit-retry-for` while another pod is handled at once; then it is escalated (SIGTERM).
/// The retry window is long (10 s) so that "at once" is an order, not a time: the other pod's
/// proxy is gone while the hung one is still being retried.
#[test]
fn hung_proxy_does_not_block_other_pods_and_is_escalated() {
    let node = Node::new().expect("node");
    let agent = node.start_agent(&["--quit-retry-for", "10s", "--escalate-after", "1s"]).expect("agent");
    let mut hung = JobSpec::new("hung");
    hung.proxy_hangs = true;
    // A hung stand-in never answers its readiness endpoint either.
    hung.ready_file = Some(node.scratch.path("hung-never-ready"));
    let mut hung = node.job_pod(hung).expect("hung pod");
    wait_listening(&hung, 15020);
    let mut normal = node.job_pod(JobSpec::new("normal")).expect("pod");
    agent.wait_tracked(2, HANG_GUARD).expect("tracked");

    hung.run_app("app", "exit 0").expect("app");
    assert!(eventually(HANG_GUARD, || !hung.quits().is_empty()), "the hung proxy got a quit\n{}", agent.log_text());
    normal.run_app("app", "exit 0").expect("app");
    assert_eq!(normal.wait_proxy_exit(HANG_GUARD).expect("wait"), Some(0), "{}", agent.log_text());
    // Meanwhile the hung pod's quit is still timing out.
    assert_eq!(hung.wait_proxy_exit(Duration::ZERO).expect("poll"), None);
    assert_eq!(agent.metric("valet_sidecar_escalations_total{kind=\"istio\"} "), 0.0);
    assert!(agent.metrics_text().is_ok(), "the agent answers while a quit hangs");

    // After the retry window: SIGTERM; the stand-in drains (5 s, as pilot-agent) and exits 0.
    assert!(agent.metric("valet_sidecar_quits_total{kind=\"istio\",result=\"timeout\"} ") == 0.0, "retried");
    assert_eq!(hung.wait_proxy_exit(HANG_GUARD).expect("wait"), Some(0), "{}", agent.log_text());
    assert!(agent.wait_metric("valet_sidecar_escalations_total{kind=\"istio\"} ", 1.0));
    assert!(agent.wait_metric("valet_sidecar_quits_total{kind=\"istio\",result=\"timeout\"} ", 1.0));
    assert!(agent.wait_metric("valet_sidecar_quits_total{kind=\"istio\",result=\"ok\"} ", 1.0));
    assert!(
        eventually(HANG_GUARD, || {
            let events = node.events_for(&hung);
            events.iter().any(|(r, _)| r == "SidecarTerminated") && events.iter().any(|(r, _)| r == "SidecarQuitFailed")
        }),
        "SidecarQuitFailed and SidecarTerminated Events: {:?}",
        node.events_for(&hung)
    );
    assert!(!node.events_for(&normal).iter().any(|(r, _)| r == "SidecarTerminated"));
    assert!(normal.quits().len() == 1, "{:?}", normal.quits());
}

/// A stand-in that answers quit with an endless body: the agent reads a capped amount, takes the
/// 200, handles another pod meanwhile, and escalates when the proxy is still running.
#[test]
fn endlessly_answering_proxy_is_capped_and_escalated() {
    let node = Node::new().expect("node");
    let agent = node.start_agent(&["--quit-retry-for", "2s", "--escalate-after", "1s"]).expect("agent");
    let mut flood = JobSpec::new("flood");
    flood.proxy_floods = true;
    flood.ready_file = Some(node.scratch.path("flood-ready"));
    let mut flood = node.job_pod(flood).expect("flood pod");
    wait_listening(&flood, 15020);
    let mut normal = node.job_pod(JobSpec::new("normal")).expect("pod");
    agent.wait_tracked(2, HANG_GUARD).expect("tracked");

    flood.run_app("app", "exit 0").expect("app");
    normal.run_app("app", "exit 0").expect("app");
    assert_eq!(normal.wait_proxy_exit(HANG_GUARD).expect("wait"), Some(0), "{}", agent.log_text());
    assert!(
        eventually(HANG_GUARD, || agent.metric("valet_sidecar_quits_total{kind=\"istio\",result=\"ok\"} ") == 2.0),
        "both quits answered 200\n{}",
        agent.log_text()
    );
    assert_eq!(flood.quits().len(), 1, "{:?}", flood.quits());
    assert_eq!(flood.wait_proxy_exit(HANG_GUARD).expect("wait"), Some(0), "{}", agent.log_text());
    assert!(agent.wait_metric("valet_sidecar_escalations_total{kind=\"istio\"} ", 1.0));
    assert_eq!(flood.quits().len(), 1, "never sent twice after a success");
}

/// A stand-in that says 200 to the quit but keeps running: SIGTERM after `--escalate-after`, and
/// the quit is never sent a second time.
#[test]
fn proxy_that_ignores_the_quit_is_escalated_after_the_delay() {
    let node = Node::new().expect("node");
    let agent = node.start_agent(&["--quit-retry-for", "2s", "--escalate-after", "1s"]).expect("agent");
    let mut spec = JobSpec::new("stubborn");
    spec.proxy_ignores_quit = true;
    let mut job = node.job_pod(spec).expect("pod");
    agent.wait_tracked(1, HANG_GUARD).expect("tracked");
    job.run_app("app", "exit 0").expect("app");
    assert!(eventually(HANG_GUARD, || job.quits().len() == 1), "quit sent\n{}", agent.log_text());
    let quit_ns = job.quits()[0].mono_ns;
    // Running on: SIGTERM comes at the earliest 1 s after the quit, and the drain takes 5 s.
    assert_eq!(job.wait_proxy_exit(Duration::ZERO).expect("poll"), None, "the proxy ignored the quit");

    assert!(
        eventually(HANG_GUARD, || agent.metric("valet_sidecar_escalations_total{kind=\"istio\"} ") == 1.0),
        "escalated\n{}",
        agent.log_text()
    );
    // Not before --escalate-after: a lower bound (measured once the escalation was seen, so a
    // busy machine only makes it longer).
    let after = Duration::from_nanos(valet_sim::util::monotonic_ns().saturating_sub(quit_ns));
    assert!(after >= Duration::from_millis(950), "escalated {after:?} after the quit, want >= 1 s");
    // SIGTERM: pilot-agent drains 5 s and exits 0.
    assert_eq!(job.wait_proxy_exit(HANG_GUARD).expect("wait"), Some(0), "{}", agent.log_text());
    assert_eq!(job.quits().len(), 1, "never sent twice after a success: {:?}", job.quits());
    assert!(eventually(HANG_GUARD, || metric_sum(&agent, "valet_sidecar_quits_total") == 1.0));
    assert!(
        eventually(HANG_GUARD, || node.events_for(&job).iter().any(|(r, _)| r == "SidecarTerminated")),
        "a SidecarTerminated Event: {:?}",
        node.events_for(&job)
    );
}

/// Malformed valet annotations: the pod is skipped with one Warning Event naming the problem and
/// a counted skip; other pods are handled as usual.
#[test]
fn malformed_annotations_skip_the_pod_with_one_warning() {
    let node = Node::new().expect("node");
    let agent = node.start_agent(&[]).expect("agent");
    let cases = [
        ("bad-kind", "valet.dev/sidecar-kind.istio-proxy", "nonsense", "UnknownSidecarKind"),
        ("bad-hold", "valet.dev/hold-app", "maybe", "MalformedAnnotation"),
        ("bad-key", "valet.dev/typo", "1", "UnknownAnnotation"),
    ];
    let mut bad: Vec<(JobPod, &str)> = cases
        .iter()
        .map(|(name, k, v, reason)| (node.job_pod(JobSpec::new(name).annotation(k, v)).expect("pod"), *reason))
        .collect();
    let mut good = node.job_pod(JobSpec::new("good")).expect("pod");
    agent.wait_tracked(4, HANG_GUARD).expect("tracked");

    for (job, _) in bad.iter_mut() {
        job.run_app("app", "exit 0").expect("app");
    }
    good.run_app("app", "exit 0").expect("app");
    assert_eq!(good.wait_proxy_exit(HANG_GUARD).expect("wait"), Some(0), "{}", agent.log_text());
    // Updates with the same error are not reported again (the kubelet's and others').
    for (job, _) in &bad {
        assert_eq!(job.wait_api_terminated("app", HANG_GUARD), Some(0), "{}", job.name);
        node.api
            .modify_pod("jobs", &job.name, |pod| pod["metadata"]["labels"]["touched"] = Value::from("yes"))
            .expect("touch");
    }
    witness(&node, &agent, "witness");
    for (job, reason) in bad.iter_mut() {
        assert!(job.quits().is_empty(), "{}: no quit: {:?}", job.name, job.quits());
        assert_eq!(job.wait_proxy_exit(Duration::ZERO).expect("poll"), None, "{}", job.name);
        let events = typed_events(&node, job);
        assert_eq!(events.len(), 1, "{}: exactly one Event: {events:?}", job.name);
        assert_eq!((events[0].0.as_str(), events[0].1.as_str()), ("Warning", *reason), "{}", job.name);
    }
    assert!(agent.wait_metric("valet_pod_skips_total{reason=\"bad_annotation\"} ", 3.0));
    assert_eq!(good.quits().len(), 1);
    assert!(
        eventually(HANG_GUARD, || metric_sum(&agent, "valet_sidecar_quits_total") == 2.0),
        "the good pod's and the witness's"
    );
}

/// API errors (500s) while a pod is handled: the agent keeps running, retries its watch, handles
/// the pod and a pod created while the API failed.
#[test]
fn api_errors_do_not_stop_the_agent() {
    let node = Node::new().expect("node");
    let mut agent = node.start_agent(&[]).expect("agent");
    let mut first = node.job_pod(JobSpec::new("first")).expect("pod");
    agent.wait_tracked(1, HANG_GUARD).expect("tracked");
    let restarts = agent.metric("valet_watch_restarts_total ");

    node.api.fail_next(3, 500);
    node.api.drop_watches();
    let mut second = node.job_pod(JobSpec::new("second")).expect("pod");
    first.run_app("app", "exit 0").expect("app");
    assert_eq!(first.wait_proxy_exit(HANG_GUARD).expect("wait"), Some(0), "{}", agent.log_text());

    // The watch comes back through the failures (with backoff) and finds the new pod.
    agent.wait_tracked(2, HANG_GUARD).expect("second pod tracked after the errors");
    second.run_app("app", "exit 0").expect("app");
    assert_eq!(second.wait_proxy_exit(HANG_GUARD).expect("wait"), Some(0), "{}", agent.log_text());
    assert_eq!(first.quits().len() + second.quits().len(), 2);
    assert!(agent.metric("valet_watch_restarts_total ") > restarts, "the failed watch was counted");
    agent.wait_ready(HANG_GUARD).expect("the agent is alive and ready");
    assert!(!agent.log_text().contains("panicked"), "{}", agent.log_text());
}

/// restartPolicy Always: never act, and count (and log) the skip once per pod however often the
/// pod changes (the kubelet restarts the app after each exit, too).
#[test]
fn restart_always_pod_is_skipped_once() {
    let node = Node::new().expect("node");
    let agent = node.start_agent(&[]).expect("agent");
    let mut job = node.job_pod(JobSpec::new("deploy").restart_policy("Always")).expect("pod");
    agent.wait_tracked(1, HANG_GUARD).expect("tracked");
    assert!(
        eventually(HANG_GUARD, || agent.metric("valet_pod_skips_total{reason=\"restart_always\"} ") == 1.0),
        "skip counted\n{}",
        agent.log_text()
    );
    // String values, as the API server allows no other (a number made the agent's watch fail to
    // decode the pod, and the witness below was never seen).
    for i in 0..3 {
        node.api
            .modify_pod("jobs", &job.name, |pod| {
                pod["metadata"]["annotations"]["example.com/rev"] = Value::from(i.to_string())
            })
            .expect("update");
    }
    job.run_app("app", "exit 0").expect("app");
    assert!(job.apps[0].wait_timeout(HANG_GUARD).expect("wait app").is_some());
    assert!(
        eventually(HANG_GUARD, || agent.metric("valet_container_exits_total{outcome=\"Success\"} ") == 1.0),
        "the agent saw the exit\n{}",
        agent.log_text()
    );
    assert!(
        eventually(HANG_GUARD, || job
            .api_status("app")
            .is_some_and(|s| s["lastState"]["terminated"].is_object() || s["state"]["terminated"].is_object())),
        "the API shows the exit: {:?}",
        job.api_status("app")
    );
    witness(&node, &agent, "witness");
    assert!(job.quits().is_empty(), "no quit: {:?}", job.quits());
    assert_eq!(job.wait_proxy_exit(Duration::ZERO).expect("poll"), None);
    assert!(agent.wait_metric("valet_pod_skips_total{reason=\"restart_always\"} ", 1.0));
    assert!(eventually(HANG_GUARD, || metric_sum(&agent, "valet_sidecar_quits_total") == 1.0), "the witness's only");
    let log = agent.log_text();
    let said = log.lines().filter(|l| l.contains(&job.name) && l.contains("no sidecar shutdown")).count();
    assert_eq!(said, 1, "logged once:\n{log}");
}

/// SIGTERM (the kubelet stopping the DaemonSet pod): the agent exits 0 (how fast is the bench's).
#[test]
fn sigterm_stops_the_agent_cleanly() {
    let node = Node::new().expect("node");
    let mut agent = node.start_agent(&[]).expect("agent");
    let _job = node.job_pod(JobSpec::new("idle")).expect("pod");
    agent.wait_tracked(1, HANG_GUARD).expect("tracked");
    let status = agent.stop(libc::SIGTERM, HANG_GUARD).expect("stopped").expect("was running");
    assert_eq!(status.code(), Some(0), "exit 0: {status:?}\n{}", agent.log_text());
    assert!(agent.log_text().contains("stopped"), "{}", agent.log_text());
}

/// SIGTERM while a quit hangs: the agent gives the in-flight quit its bounded time (here
/// `--quit-retry-for 2s`) and still exits 0.
#[test]
fn sigterm_with_a_hung_quit_in_flight_exits_after_the_bounded_wait() {
    let node = Node::new().expect("node");
    let mut agent = node.start_agent(&["--quit-retry-for", "2s", "--escalate-after", "1s"]).expect("agent");
    let mut spec = JobSpec::new("hung-at-stop");
    spec.proxy_hangs = true;
    spec.ready_file = Some(node.scratch.path("hung-at-stop-never-ready"));
    let mut job = node.job_pod(spec).expect("pod");
    wait_listening(&job, 15020);
    agent.wait_tracked(1, HANG_GUARD).expect("tracked");
    job.run_app("app", "exit 0").expect("app");
    assert!(eventually(HANG_GUARD, || !job.quits().is_empty()), "quit in flight\n{}", agent.log_text());
    // Bounded: an agent that waited for the hung quit would never exit (the hang guard is 30 s,
    // the bound 2 s); the quit's failure is logged before the exit.
    let status = agent.stop(libc::SIGTERM, HANG_GUARD).expect("stopped").expect("was running");
    assert_eq!(status.code(), Some(0), "exit 0: {status:?}\n{}", agent.log_text());
    assert!(agent.log_text().contains("could not quit sidecar"), "the quit finished first:\n{}", agent.log_text());
}

/// The sum of every sample of a metric family (all label sets).
fn metric_sum(agent: &Agent, family: &str) -> f64 {
    agent
        .metrics_text()
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(family)?;
            if !(rest.starts_with('{') || rest.starts_with(' ')) {
                return None;
            }
            l.rsplit(' ').next()?.parse::<f64>().ok()
        })
        .sum()
}

/// Events about a pod as (type, reason).
fn typed_events(node: &Node, job: &JobPod) -> Vec<(String, String)> {
    node.events_about(job)
        .into_iter()
        .map(|e| {
            (e["type"].as_str().unwrap_or_default().to_owned(), e["reason"].as_str().unwrap_or_default().to_owned())
        })
        .collect()
}

/// Waits until something listens on `port` on the pod's loopback (a bare connect sends no request).
fn wait_listening(job: &JobPod, port: u16) {
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let up = eventually(HANG_GUARD, || {
        job.sim.in_netns(|| TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok()).unwrap_or(false)
    });
    assert!(up, "{}: nothing listens on {addr}", job.name);
}

/// With the runtime's state directory, the agent names a container from its OCI bundle: an app
/// that exits before the API names it is acted on at once, although the runtime removes its
/// bundle and cgroup as soon as it exited. Here the API never names it (the kubelet writes no
/// status), so the quit can only have come from the bundle, however long anything took.
#[test]
fn runtime_bundles_name_an_app_that_exits_before_the_api_shows_its_id() {
    let node = Node::new().expect("node");
    let agent = node.start_agent(&[]).expect("agent");
    let mut job = node.job_pod(JobSpec::new("bundled").manual_status()).expect("pod");
    agent.wait_tracked(1, HANG_GUARD).expect("tracked");

    let started = Instant::now();
    job.run_app("app", "exit 0").expect("app");
    let code = job.wait_proxy_exit(HANG_GUARD).expect("wait");
    println!("quit {:?} after the app started", started.elapsed());
    assert_eq!(code, Some(0), "the proxy was quit\n{}", agent.log_text());
    assert!(
        job.api_status("app").is_none_or(|s| s.get("containerID").is_none()),
        "the API named the app: {:?}",
        job.api_status("app")
    );
    assert_eq!(job.loopback_quits().len(), 1);
}

/// A bundle of another pod never names a container of this one. (The runtime writes none for this
/// pod and the API never names its containers: the test writes a foreign bundle under the app's id.)
#[test]
fn runtime_bundles_of_another_pod_are_ignored() {
    let node = Node::new().expect("node");
    let agent = node.start_agent(&[]).expect("agent");
    let mut job = node.job_pod(JobSpec::new("foreign").manual_status().no_bundles()).expect("pod");
    let app = job.sim.container("app").expect("app");
    let bundle = node.runtime_state_dir().join(&app.id);
    std::fs::create_dir_all(&bundle).expect("bundle dir");
    let config = serde_json::json!({"ociVersion": "1.1.0", "annotations": {
        "io.kubernetes.cri.container-type": "container",
        "io.kubernetes.cri.container-name": "app",
        "io.kubernetes.cri.sandbox-uid": "11111111-2222-4333-8444-555555555555",
        "io.kubernetes.cri.sandbox-name": job.name,
        "io.kubernetes.cri.sandbox-namespace": "jobs"}});
    std::fs::write(bundle.join("config.json"), config.to_string()).expect("write");
    agent.wait_tracked(1, HANG_GUARD).expect("tracked");
    job.run_app("app", "exit 0").expect("app");
    assert!(job.apps[0].wait_timeout(HANG_GUARD).expect("wait app").is_some(), "the app exited");
    witness(&node, &agent, "witness");
    assert_eq!(job.wait_proxy_exit(Duration::ZERO).expect("poll"), None, "no quit on a foreign bundle's word");
    assert!(job.quits().is_empty());
}

/// A container without a pid namespace of its own (shareProcessNamespace pods) has no namespace
/// init: it ends when its last process leaves its cgroup.
#[test]
fn container_without_its_own_pid_namespace_ends_with_its_last_process() {
    let node = Node::new().expect("node");
    let agent = node.start_agent(&[]).expect("agent");
    let mut job = node.job_pod(JobSpec::new("shared-pidns").restart_policy("OnFailure")).expect("pod");
    agent.wait_tracked(1, HANG_GUARD).expect("tracked");
    let opts = valet_sim::node::SpawnOptions { pid_namespace: false, ..Default::default() };
    // A child exits first (the container goes on), then the main process exits 0.
    let started = Instant::now();
    job.start_app("app", &["/bin/sh", "-c", "/bin/sh -c 'exit 0'; sleep 0.3; exit 0"], &opts).expect("app");
    assert_eq!(job.wait_proxy_exit(HANG_GUARD).expect("wait"), Some(0), "{}", agent.log_text());
    assert!(started.elapsed() >= Duration::from_millis(300), "not before the main process ended");
    assert_eq!(job.loopback_quits().len(), 1);
}

/// A pod's `valet.dev/ProxyReady` condition has the status `status`.
fn condition_is(node: &Node, job: &JobPod, status: &str) -> bool {
    node.pod(job).is_some_and(|pod| {
        pod["status"]["conditions"]
            .as_array()
            .is_some_and(|cs| cs.iter().any(|c| c["type"] == "valet.dev/ProxyReady" && c["status"] == status))
    })
}

/// A held pod whose proxy is ready once `ready` exists, its app started once the agent placed
/// the pod and stopped at exec by the kernel; the app writes `marker` the moment it runs.
struct HeldApp {
    job: JobPod,
    ready: PathBuf,
    marker: PathBuf,
    /// Before the app started (so before the kernel stopped it).
    started: Instant,
}

impl HeldApp {
    fn new(node: &Node, agent: &Agent, name: &str, hold_timeout: &str) -> HeldApp {
        let ready = node.scratch.path(&format!("{name}-ready"));
        let marker = node.scratch.path(&format!("{name}-ran"));
        let mut spec = JobSpec::new(name)
            .annotation("valet.dev/hold-app", "true")
            .annotation("valet.dev/hold-timeout", hold_timeout);
        spec.ready_file = Some(ready.clone());
        let mut job = node.job_pod(spec).expect("held pod");
        assert!(eventually(HANG_GUARD, || condition_is(node, &job, "False")), "placed\n{}", agent.log_text());
        let started = Instant::now();
        job.run_app("app", &format!("echo ran > {}; exec sleep 0.3", marker.display())).expect("app");
        let app = HeldApp { job, ready, marker, started };
        assert!(eventually(HANG_GUARD, || app.stopped()), "never stopped\n{}", agent.log_text());
        assert!(
            eventually(HANG_GUARD, || agent.metric("valet_app_holds_total ") == 1.0),
            "the hold counted\n{}",
            agent.log_text()
        );
        app
    }

    fn pid(&self) -> u32 {
        self.job.apps[0].host_pid()
    }

    /// Stopped at exec and not having run a single line.
    fn stopped(&self) -> bool {
        process_state(self.pid()) == Some('T') && !self.marker.exists()
    }
}

/// A line of the log saying what was decided at SIGTERM.
fn decided(log: &str, verdict: &str) -> bool {
    log.lines().any(|l| l.contains("at SIGTERM") && l.contains(&format!("verdict=\"{verdict}\"")))
}

/// The successor `agent` took the held app over: it probes the proxy (still not ready) while the
/// app stays stopped; once the proxy is ready it releases the app. The ready → ran latency.
fn successor_releases_at_readiness(app: &HeldApp, agent: &Agent, what: &str) -> Duration {
    let before = loopback_probes(&app.job);
    assert!(
        eventually(HANG_GUARD, || loopback_probes(&app.job) >= before + 3),
        "{what}: the successor probes the proxy\n{}",
        agent.log_text()
    );
    assert!(app.stopped(), "{what}: released before the proxy was ready\n{}", agent.log_text());
    std::fs::write(&app.ready, "").expect("ready file");
    let latency = wait_file(&app.marker, HANG_GUARD)
        .unwrap_or_else(|| panic!("{what}: never released once ready\n{}", agent.log_text()));
    assert!(agent.wait_metric("valet_app_releases_total{reason=\"ready\"} ", 1.0), "{what}: by the successor");
    assert!(
        agent.log_text().contains("found a process left held by an earlier agent"),
        "{what}: adopted\n{}",
        agent.log_text()
    );
    latency
}

/// A SIGTERM restart of the agent container (its pod not deleted, the DaemonSet present, the
/// deadline keeper running on): the held app stays stopped through the restart until its proxy
/// is ready, and the restarted agent releases it then.
#[test]
fn sigterm_restart_hands_held_apps_to_the_restarted_agent() {
    let node = Node::new().expect("node");
    node.install_daemonset().expect("daemonset");
    let pod = node.daemonset_pod().expect("agent pod");
    let _keeper = node.start_deadline_keeper_in(&pod).expect("keeper");
    let mut agent = node.start_agent_in(&pod, &[]).expect("agent");
    let app = HeldApp::new(&node, &agent, "restart", "60s");

    let status = agent.stop(libc::SIGTERM, HANG_GUARD).expect("stopped").expect("was running");
    assert!(app.stopped(), "released at the SIGTERM of a restart\n{}", agent.log_text());
    assert_eq!(status.code(), Some(0), "{}", agent.log_text());
    assert!(decided(&agent.log_text(), "handed over"), "{}", agent.log_text());

    let agent = node.start_agent_in(&pod, &[]).expect("restarted agent");
    let latency = successor_releases_at_readiness(&app, &agent, "restart");
    println!("container restart: proxy ready -> app ran (released by the restarted agent): {latency:?}");
}

/// A rollout: the old pod deleted (both containers SIGTERMed) while the DaemonSet stays, the new
/// pod's agent and keeper started 2 s later. The held app stays stopped until its proxy is
/// ready; the new agent releases it.
#[test]
fn rollout_hands_held_apps_to_the_new_pod() {
    let node = Node::new().expect("node");
    node.install_daemonset().expect("daemonset");
    let old = node.daemonset_pod().expect("old pod");
    let mut keeper = node.start_deadline_keeper_in(&old).expect("keeper");
    let mut agent = node.start_agent_in(&old, &[]).expect("agent");
    let app = HeldApp::new(&node, &agent, "rollout", "60s");

    // The DaemonSet's controller deletes the old pod; the kubelet SIGTERMs both containers.
    node.api.begin_pod_deletion(AGENT_NAMESPACE, &old, None).expect("delete the old pod");
    let keeper_pid = keeper.pid().expect("keeper runs");
    // SAFETY: plain syscall on a child of this test.
    unsafe { libc::kill(keeper_pid as i32, libc::SIGTERM) };
    let status = agent.stop(libc::SIGTERM, HANG_GUARD).expect("stopped").expect("was running");
    assert_eq!(status.code(), Some(0), "{}", agent.log_text());
    let kept = keeper.stop().expect("keeper stopped");
    assert!(kept.is_none_or(|s| s.success()), "{kept:?}\n{}", keeper.log_text());
    assert!(app.stopped(), "released at the rollout's SIGTERM\n{}\n{}", agent.log_text(), keeper.log_text());
    assert!(decided(&agent.log_text(), "handed over"), "{}", agent.log_text());
    assert!(decided(&keeper.log_text(), "handed over"), "{}", keeper.log_text());
    node.api.delete_pod(AGENT_NAMESPACE, &old).expect("the kubelet's final delete");

    // The new pod, its containers started 2 s later (scheduling, the image, the start).
    let new = node.daemonset_pod().expect("new pod");
    std::thread::sleep(Duration::from_secs(2));
    assert!(app.stopped(), "released while no agent ran");
    let _keeper = node.start_deadline_keeper_in(&new).expect("new keeper");
    let agent = node.start_agent_in(&new, &[]).expect("new agent");
    let latency = successor_releases_at_readiness(&app, &agent, "rollout");
    println!("rollout: proxy ready -> app ran (released by the new pod's agent): {latency:?}");
}

/// An uninstall: the DaemonSet deleted (foreground: kept while its pods go; background: gone at
/// once), or the node drained of it (relabelled so that the DaemonSet's affinity no longer
/// takes it), the agent's pod deleted, both containers SIGTERMed: the held app runs at the
/// SIGTERM, before the agent exits.
#[test]
fn uninstall_releases_held_apps_at_sigterm() {
    for how in ["foreground", "background", "node unfit"] {
        let node = Node::new().expect("node");
        node.install_daemonset().expect("daemonset");
        let pod = node.daemonset_pod().expect("agent pod");
        let mut keeper = node.start_deadline_keeper_in(&pod).expect("keeper");
        let mut agent = node.start_agent_in(&pod, &[]).expect("agent");
        let app = HeldApp::new(&node, &agent, "uninstall", "60s");

        if how == "node unfit" {
            let mut n = node.api.get_object(Kind::Node, None, &node.name).expect("the node");
            n["metadata"]["labels"]["kubernetes.io/arch"] = Value::from("s390x");
            node.api.put_object(Kind::Node, n).expect("relabel the node");
        } else {
            let propagation = if how == "foreground" { Propagation::Foreground } else { Propagation::Background };
            node.api
                .delete_object(Kind::DaemonSet, Some(AGENT_NAMESPACE), AGENT_DAEMONSET, propagation)
                .expect("delete");
        }
        node.api.begin_pod_deletion(AGENT_NAMESPACE, &pod, None).expect("delete the pod");
        let sigterm = Instant::now();
        let keeper_pid = keeper.pid().expect("keeper runs");
        // SAFETY: plain syscall on a child of this test.
        unsafe { libc::kill(keeper_pid as i32, libc::SIGTERM) };
        // SAFETY: as above.
        unsafe { libc::kill(agent.pid().expect("agent runs") as i32, libc::SIGTERM) };
        let latency = wait_file(&app.marker, HANG_GUARD).map(|_| sigterm.elapsed());
        let status = agent.stop(libc::SIGTERM, HANG_GUARD).expect("stopped").expect("was running");
        keeper.stop().expect("keeper stopped");
        println!("uninstall ({how}): SIGTERM -> app ran: {latency:?}");
        assert!(latency.is_some(), "{how}: left stopped\n{}\n{}", agent.log_text(), keeper.log_text());
        assert_eq!(status.code(), Some(0), "{}", agent.log_text());
        assert!(decided(&agent.log_text(), "released: uninstall"), "{}", agent.log_text());
        assert!(decided(&keeper.log_text(), "released: uninstall"), "{}", keeper.log_text());
    }
}

/// The API does not answer during the SIGTERM (reads hang): the agent keeps the hold within its
/// bounded lookup and exits; the app stays stopped, and the deadline keeper releases it at its
/// deadline (4 s from the kernel's stop), not before.
#[test]
fn api_down_at_sigterm_keeps_held_apps_until_their_deadline() {
    let node = Node::new().expect("node");
    node.install_daemonset().expect("daemonset");
    let pod = node.daemonset_pod().expect("agent pod");
    let keeper = node.start_deadline_keeper_in(&pod).expect("keeper");
    let mut agent = node.start_agent_in(&pod, &[]).expect("agent");
    let app = HeldApp::new(&node, &agent, "unanswered", "4s");

    node.api.set_fault(Fault::HangReads);
    let sigterm = Instant::now();
    let status = agent.stop(libc::SIGTERM, HANG_GUARD).expect("stopped").expect("was running");
    println!("API unanswered: SIGTERM -> agent exited: {:?}", sigterm.elapsed());
    assert!(app.stopped(), "released with no answer from the API\n{}", agent.log_text());
    assert_eq!(status.code(), Some(0), "{}", agent.log_text());
    assert!(decided(&agent.log_text(), "kept: API unanswered"), "{}", agent.log_text());

    let ran = wait_file(&app.marker, HANG_GUARD).map(|_| app.started.elapsed());
    println!("API unanswered: the app ran {ran:?} after its start (hold timeout 4 s)");
    let ran = ran.unwrap_or_else(|| panic!("never released\n{}", keeper.log_text()));
    // A lower bound only (from before the stop): the deadline is the stop + 4 s.
    assert!(ran >= Duration::from_millis(3900), "released before its deadline: {ran:?}\n{}", keeper.log_text());
    let pid = app.pid();
    // The keeper logs after its SIGCONT returns: the app may have written its marker first.
    let logged = || {
        keeper
            .log_text()
            .lines()
            .any(|l| l.contains("released a held app at its deadline") && l.contains(&format!("pid={pid} ")))
    };
    assert!(eventually(HANG_GUARD, logged), "released by the keeper at the deadline\n{}", keeper.log_text());
}
