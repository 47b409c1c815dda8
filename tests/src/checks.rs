//! Checks the end-to-end suites share: the witness pod of a "nothing happened" check, a metric
//! family's sum, a pod's Events by type, a port listening in a pod.
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::time::Duration;

use crate::harness::{Agent, HANG_GUARD, JobPod, JobSpec, Node, eventually};

/// The later event of a "nothing happened" check: a labelled pod added now, whose app exits and
/// whose proxy the agent quits. The agent learns of it through the same pod watch, after every
/// update before it, and of its end through the same ring buffer, after every end before it:
/// once it is quit, whatever came before was handled (and any quit it called for was sent).
pub fn witness(node: &Node, agent: &Agent, name: &str) {
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

/// The sum of every sample of a metric family (all label sets).
pub fn metric_sum(agent: &Agent, family: &str) -> f64 {
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
pub fn typed_events(node: &Node, job: &JobPod) -> Vec<(String, String)> {
    node.events_about(job)
        .into_iter()
        .map(|e| {
            (e["type"].as_str().unwrap_or_default().to_owned(), e["reason"].as_str().unwrap_or_default().to_owned())
        })
        .collect()
}

/// Waits until something listens on `port` on the pod's loopback (a bare connect sends no request).
pub fn wait_listening(job: &JobPod, port: u16) {
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let up = eventually(HANG_GUARD, || {
        job.sim.in_netns(|| TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok()).unwrap_or(false)
    });
    assert!(up, "{}: nothing listens on {addr}", job.name);
}
