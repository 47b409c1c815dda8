//! End to end, issue 34: a node where valet's kernel programs cannot run is served degraded,
//! never crash-looped. The real agent binary, the fake API server, real cgroups and network
//! namespaces, the stand-in pilot-agent.
//!
//! On the host the agent is made to fail its load by `--kernel-btf` naming a file that does not
//! exist, the first thing a kernel without BTF fails on. In qemu (`cargo xtask kernels`) the node
//! itself cannot run the programs: `VALET_DEGRADED_NODE=<reason>` says so and which reason the
//! agent must report (`no_btf` with an empty tmpfs over `/sys/kernel/btf`, `lockdown` on a
//! kernel booted with `lockdown=confidentiality`); the agent then gets no flag at all.
//!
//! Both reasons are among those `--degraded-ok` expects by default, so such an agent is ready;
//! told to expect only another reason, the same node is not ready, and `/readyz` and the log say
//! why, while the node is still served.

use std::time::Instant;

use valet_sim::util::monotonic_ns;
use valet_tests::harness::{Agent, HANG_GUARD, JobSpec, Node, eventually};

/// The reason the agent must report, and the flags that make this node degraded.
fn degraded_node(node: &Node) -> (String, Vec<String>) {
    match std::env::var("VALET_DEGRADED_NODE") {
        Ok(reason) if !reason.is_empty() => (reason, Vec::new()),
        _ => {
            let missing = node.scratch.path("no-btf-here/vmlinux");
            ("no_btf".into(), vec!["--kernel-btf".into(), missing.to_string_lossy().into_owned()])
        }
    }
}

fn start_degraded(node: &Node) -> (Agent, String) {
    let (reason, flags) = degraded_node(node);
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    // Waits for /readyz: a degraded agent is ready once it listed its pods.
    let agent = node.start_agent(&flags).expect("the agent stays up and turns ready");
    (agent, reason)
}

/// The pod's `valet.dev/ProxyReady` condition as (status, reason).
fn condition(node: &Node, job: &valet_tests::harness::JobPod) -> Option<(String, String)> {
    let pod = node.pod(job)?;
    pod["status"]["conditions"].as_array()?.iter().find(|c| c["type"] == "valet.dev/ProxyReady").map(|c| {
        (c["status"].as_str().unwrap_or_default().to_owned(), c["reason"].as_str().unwrap_or_default().to_owned())
    })
}

#[test]
fn a_node_that_cannot_run_the_kernel_programs_is_served_from_the_api() {
    let node = Node::new().expect("node");
    let (agent, reason) = start_degraded(&node);

    // An expected reason: ready (start_agent waited for it), and served degraded.
    assert_eq!(agent.get("/readyz").expect("/readyz"), (200, "ready\n".to_owned()));
    // The node's mode and why, on /metrics (every series exposed, one at 1) and in the log.
    assert_eq!(agent.metric(&format!("valet_node_info{{mode=\"degraded\",reason=\"{reason}\"}} ")), 1.0);
    assert_eq!(agent.metric("valet_node_info{mode=\"kernel\",reason=\"none\"} "), 0.0);
    let log = agent.log_text();
    assert!(
        log.lines().any(|l| l.contains("kernel programs not loaded") && l.contains(&format!("reason=\"{reason}\""))),
        "the log says why, once:\n{log}"
    );

    // A pod asking for a hold: the test plays the kubelet's status writes, to know the instant
    // of the report the quit must follow.
    let gate = node.scratch.path("let-the-app-end");
    let mut job =
        node.job_pod(JobSpec::new("unheld").annotation("valet.dev/hold-app", "true").manual_status()).expect("pod");
    agent.wait_tracked(1, HANG_GUARD).expect("tracked");
    let script = format!("while [ ! -e {} ]; do sleep 0.02; done; exit 0", gate.display());
    job.run_app("app", &script).expect("app");
    job.publish_status().expect("the kubelet reports the app running");

    // It runs unheld, and says why: a Warning Event and the condition's reason.
    let said = eventually(HANG_GUARD, || {
        node.events_for(&job).iter().any(|(r, note)| r == "HoldUnavailable" && note.contains(&format!("({reason})")))
    });
    assert!(said, "a HoldUnavailable Event naming {reason}: {:?}\n{}", node.events_for(&job), agent.log_text());
    assert!(
        eventually(HANG_GUARD, || condition(&node, &job).is_some_and(|(_, r)| r == "HoldUnavailable")),
        "condition: {:?}",
        condition(&node, &job)
    );

    // The app ends; nothing quits the proxy until the kubelet reports it.
    std::fs::write(&gate, b"").expect("gate");
    let app = job.apps[0].clone();
    assert!(app.wait_timeout(HANG_GUARD).expect("wait").is_some(), "the app ran unheld and ended");
    // The runtime has recorded the end (the kubelet reaps on a thread of its own): its next
    // status write reports it.
    let recorded = |job: &valet_tests::harness::JobPod| {
        job.runtime_status().ok().is_some_and(|st| {
            st["containerStatuses"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|c| c["name"] == "app" && c["state"]["terminated"]["exitCode"].as_i64() == Some(0))
        })
    };
    assert!(eventually(HANG_GUARD, || recorded(&job)), "the runtime saw the app end");
    assert!(job.quits().is_empty(), "no quit before the kubelet's report: {:?}", job.quits());
    let reported = monotonic_ns();
    let started = Instant::now();
    job.publish_status().expect("the kubelet reports the app terminated");
    let code = job.wait_proxy_exit(HANG_GUARD).expect("wait");
    assert_eq!(code, Some(0), "the proxy was quit; the API shows {:?}\n{}", job.api_status("app"), agent.log_text());
    let quits = job.quits();
    assert_eq!(quits.len(), 1, "one quit: {quits:?}");
    assert!(quits[0].peer.ip().is_loopback(), "from the pod's loopback: {:?}", quits[0].peer);
    assert!(quits[0].mono_ns >= reported, "the quit came from the API's report, not before it");
    println!(
        "degraded ({reason}): quit {:.1} ms after the kubelet's report ({:?} until the proxy exited)",
        (quits[0].mono_ns - reported) as f64 / 1e6,
        started.elapsed()
    );

    assert!(agent.wait_metric("valet_sidecar_quits_total{kind=\"istio\",result=\"ok\"} ", 1.0));
    assert_eq!(agent.metric("valet_pods_api_path_total{reason=\"node_degraded\"} "), 1.0);
    assert_eq!(agent.metric("valet_app_holds_total "), 0.0, "nothing held");
    assert_eq!(agent.metric("valet_container_exits_total{outcome=\"Success\"} "), 0.0, "no kernel ends");
}

#[test]
fn a_node_degraded_for_a_reason_not_expected_is_served_but_not_ready() {
    let node = Node::new().expect("node");
    let (reason, mut flags) = degraded_node(&node);
    // The operator expects another reason only (a pool of nodes without BTF, say): this node's
    // reason is a surprise, as a release whose programs or privileges fail everywhere would be.
    let other = if reason == "no_btf" { "lockdown" } else { "no_btf" };
    flags.push(format!("--degraded-ok={other}"));
    let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
    let agent = node.spawn_agent(&flags).expect("the agent stays up");

    // Still served degraded: a labelled pod is tracked (so the pods are listed), from the API.
    let _job = node.job_pod(JobSpec::new("surprise")).expect("pod");
    agent.wait_tracked(1, HANG_GUARD).expect("tracked while not ready");
    assert_eq!(agent.metric(&format!("valet_node_info{{mode=\"degraded\",reason=\"{reason}\"}} ")), 1.0);

    // Not ready, with the pods listed: /readyz says which reason and what was expected.
    let (status, body) = agent.get("/readyz").expect("/readyz");
    assert_eq!(status, 503, "{body}");
    assert!(
        body.contains(&format!("not expected: {reason} (")) && body.contains(&format!("--degraded-ok={other}")),
        "/readyz says why: {body}"
    );
    let (status, _) = agent.get("/healthz").expect("/healthz");
    assert_eq!(status, 200, "alive: not restarted for it");
    let log = agent.log_text();
    assert!(
        log.lines().any(|l| l.contains("not ready: degraded for a reason not expected") && l.contains(reason.as_str())),
        "the log says why:\n{log}"
    );
}
