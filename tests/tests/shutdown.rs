//! End to end, issue "exec-free sidecar shutdown": the real agent binary against the fake API
//! server, real cgroups, network namespaces and a stand-in Istio pilot-agent.

use std::time::Duration;

use valet_tests::harness::{JobSpec, Node, eventually};

#[test]
fn labelled_job_pod_proxy_quits_when_the_app_exits() {
    let node = Node::new().expect("node");
    let agent = node.start_agent(&[]).expect("agent");
    let mut job = node.job_pod(JobSpec::new("quick")).expect("pod");
    agent.wait_tracked(1, Duration::from_secs(5)).expect("tracked");
    job.run_app("app", "sleep 0.1; exit 0").expect("app");
    let code = job.wait_proxy_exit(Duration::from_secs(5)).expect("wait");
    assert_eq!(code, Some(0), "proxy exited 0 after the quit\n{}", agent.log_text());
    let quits = job.quits();
    assert_eq!(quits.len(), 1, "exactly one quit: {quits:?}");
    assert!(quits[0].peer.ip().is_loopback(), "sent from inside the pod: {:?}", quits[0].peer);
    assert!(
        eventually(Duration::from_secs(3), || node.events_for(&job).iter().any(|(r, _)| r == "SidecarQuit")),
        "a SidecarQuit Event: {:?}",
        node.events_for(&job)
    );
    assert_eq!(agent.metric("valet_sidecar_quits_total{kind=\"istio\",result=\"ok\"} "), 1.0);
}
