//! What the end-to-end tests of held apps share: the hold annotations, a held pod's spec, its
//! app's marker, and checks that an app is held, probed, released, and what the condition says.
use std::path::Path;

use valet_sim::RecordedRequest;

use crate::harness::{Agent, HANG_GUARD, JobPod, JobSpec, Node, eventually, process_state as state};

pub const HOLD: &str = "valet.dev/hold-app";
pub const HOLD_TIMEOUT: &str = "valet.dev/hold-timeout";
pub const CONDITION: &str = "valet.dev/ProxyReady";

/// An app script that writes `marker` the moment it runs, then lives a little.
pub fn marker_script(marker: &Path) -> String {
    format!("echo ran > {}; sleep 0.2", marker.display())
}

/// A held Job pod whose stand-in proxy is ready only once `ready` exists.
pub fn held_spec(name: &str, ready: &Path) -> JobSpec {
    let mut spec = JobSpec::new(name).annotation(HOLD, "true");
    spec.ready_file = Some(ready.to_path_buf());
    spec
}

/// The agent's `valet.dev/ProxyReady` condition on the pod, as (status, reason).
pub fn condition(node: &Node, job: &JobPod) -> Option<(String, String)> {
    let pod = node.pod(job)?;
    pod["status"]["conditions"].as_array()?.iter().find(|c| c["type"] == CONDITION).map(|c| {
        (c["status"].as_str().unwrap_or_default().to_owned(), c["reason"].as_str().unwrap_or_default().to_owned())
    })
}

pub fn wait_condition(node: &Node, job: &JobPod, agent: &Agent, status: &str, reason: &str) {
    let want = Some((status.to_owned(), reason.to_owned()));
    assert!(
        eventually(HANG_GUARD, || condition(node, job) == want),
        "condition {CONDITION} {status}/{reason} on {}: have {:?}\n{}",
        job.name,
        condition(node, job),
        agent.log_text()
    );
}

/// Waits until the agent probed the pod's proxy and found it not ready: it knows the pod, its
/// cgroup and its network. Its log says so; the condition does not (no False before the first
/// True: a readiness gate reads an absent condition as False).
pub fn wait_probed_not_ready(node: &Node, job: &JobPod, agent: &Agent) {
    assert!(
        agent.wait_pod_line("proxy not ready", &format!("jobs/{}", job.name)),
        "{}: never probed not ready\n{}",
        job.name,
        agent.log_text()
    );
    assert_eq!(
        condition(node, job),
        None,
        "{}: no condition before the proxy is ready\n{}",
        job.name,
        agent.log_text()
    );
}

/// PATCH requests to the pod's status subresource (the agent's condition writes).
pub fn status_patches(node: &Node, job: &JobPod) -> Vec<RecordedRequest> {
    let path = format!("/api/v1/namespaces/jobs/pods/{}/status", job.name);
    node.api.requests().into_iter().filter(|r| r.method == "PATCH" && r.path == path).collect()
}

/// The app container's main process of a job (its first `run_app`).
pub fn app_pid(job: &JobPod) -> u32 {
    job.apps[0].host_pid()
}

/// Waits until the app is stopped at exec and the agent counted `holds` holds, then asserts it
/// is held.
pub fn wait_held(job: &JobPod, marker: &Path, agent: &Agent, holds: f64, what: &str) {
    assert!(eventually(HANG_GUARD, || state(app_pid(job)) == Some('T')), "{what}: never stopped\n{}", agent.log_text());
    // The kernel stops the process and reports it in one step; the agent counts the report a
    // moment later.
    assert!(
        eventually(HANG_GUARD, || agent.metric("valet_app_holds_total ") == holds),
        "{what}: {holds} holds counted: {}\n{}",
        agent.metric("valet_app_holds_total "),
        agent.log_text()
    );
    assert_held(job, marker, agent, what);
}

/// Readiness probes the stand-in proxy of `job` answered from the pod's own loopback so far.
pub fn loopback_probes(job: &JobPod) -> usize {
    valet_sim::standin::read_events(&job.events)
        .unwrap_or_default()
        .into_iter()
        .filter(|e| e.method == "GET" && e.path == "/healthz/ready" && e.peer.ip().is_loopback())
        .count()
}

/// Waits until the agent probed `job`'s proxy `n` more times than `before` (each probe answered
/// "not ready" is a decision not to release, made after whatever came before it).
pub fn wait_probes(job: &JobPod, before: usize, n: usize, agent: &Agent) {
    assert!(
        eventually(HANG_GUARD, || loopback_probes(job) >= before + n),
        "{}: {} probes, want {}\n{}",
        job.name,
        loopback_probes(job),
        before + n,
        agent.log_text()
    );
}

/// Asserts the app is held: stopped at exec and not having run a single line.
pub fn assert_held(job: &JobPod, marker: &Path, agent: &Agent, what: &str) {
    assert!(!marker.exists(), "{what}: the held app must not have run\n{}", agent.log_text());
    assert_eq!(state(app_pid(job)), Some('T'), "{what}: the app is stopped\n{}", agent.log_text());
}
