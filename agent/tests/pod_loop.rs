//! Scenario tests of the whole loop, without root: the real pod router and actuators against a
//! mocked API (`tower-test`), a stand-in for the kernel programs and for the pod's network, a
//! kubelet-shaped cgroup tree in a temporary directory, and real (unprivileged) child processes
//! for the holds. Every wait has a timeout, so a missing or an extra action fails the test; the
//! timeout only guards against a hang: a test waits for the event itself, and proves that
//! something did not happen by a later event that would have come after it, never by a quiet
//! moment (which a busy machine stretches or shortens).

mod rig;

use std::process::Child;
use std::time::Duration;

use serde_json::json;
use valet_agent::api::successor::{Stop, Successor};
use valet_agent::kernel::Event;
use valet_common::watch_flags;

use rig::*;

#[tokio::test]
async fn the_apps_exit_quits_the_proxy_and_releases_the_pods_resources() {
    let node = TempNode::new("quit");
    let _sandbox = node.container(1, "POD");
    let app = node.container(2, "app");
    let proxy = node.container(3, "istio-proxy");
    let lp = start(&node, Duration::from_secs(120));
    lp.apply(job_pod(json!({})));
    let pod_cg = node.pod_id();
    lp.until("the pod cgroup watched", |l| lock(&l.kernel.0).watched.get(&pod_cg) == Some(&watch_flags::EXITS)).await;
    assert!(lock(&lp.link.0).opened.contains(&UID.to_owned()), "network namespace opened ahead of time");
    lp.exit(pod_cg, app, 0);
    lp.until("the quit", |l| l.link.quits() == 1).await;
    let quit = lock(&lp.link.0).requests.iter().find(|r| r.1 == "POST").cloned().expect("a quit");
    assert_eq!((quit.2, quit.3.as_str()), (15020, "/quitquitquit"));
    lp.until("the quit counted", |l| quit_metric(&l.metrics).ends_with(" 1")).await;
    // The proxy exits: kernel maps and the namespace are released while the pod object stays.
    lp.exit(pod_cg, proxy, 0);
    lp.until("resources released", |l| lock(&l.kernel.0).watched.is_empty() && lock(&l.link.0).opened.is_empty()).await;
    assert!(lock(&lp.kernel.0).forgotten.contains(&app));
    // Once the loop has ended, every quit it ever decided is on record (the first attempt is
    // made as the transition is applied).
    let (kernel, link) = lp.stop().await;
    assert_eq!(link.quits(), 1, "never twice");
    assert!(lock(&kernel.0).detached);
    assert_path(&node.dir);
}

/// A Job pod found by a running loop whose link keeps a connection to its proxy, once its quit
/// is armed ahead: the node, the loop, and the sandbox's and the app's container cgroups.
async fn armed_job(tag: &str) -> (TempNode, Loop, [u64; 2]) {
    let node = TempNode::new(tag);
    let sandbox = node.container(1, "POD");
    let app = node.container(2, "app");
    let _proxy = node.container(3, "istio-proxy");
    let lp = start(&node, Duration::from_secs(120));
    lock(&lp.link.0).kept = true;
    lp.apply(job_pod(json!({})));
    lp.until("armed", |l| l.ahead.armed() == 1).await;
    (node, lp, [sandbox, app])
}

/// The quit sent ahead by the event reader is the one the loop's transition decides: taken over,
/// never sent twice, not counted unclaimed, even when another end of the pod is handled just
/// before it (read in the same batch). A pod that changed before its end (deleting) has nothing
/// armed; a request sent ahead the transition did not call for is counted unclaimed.
#[tokio::test]
async fn a_quit_sent_ahead_by_the_event_reader_is_taken_over_by_the_loop() {
    let (node, lp, [sandbox, app]) = armed_job("ahead").await;
    let pod_cg = node.pod_id();
    // Another end of the pod first (the sandbox's), then the app's, fired by the reader.
    assert_eq!(lp.ahead.fire(&end_of(pod_cg, sandbox, 0)), 0, "not the armed container");
    lp.exit(pod_cg, sandbox, 0);
    assert_eq!(lp.exit_read(pod_cg, app, 0), 1, "sent ahead");
    lp.until("the quit counted", |l| quit_metric(&l.metrics).ends_with(" 1")).await;
    {
        let s = lock(&lp.link.0);
        assert_eq!(s.taken_over, 1, "the loop's quit took the request over");
        assert_eq!(s.requests.iter().filter(|r| r.1 == "POST").count(), 1, "one quit: {:?}", s.requests);
    }
    let text = lp.metrics.encode();
    assert!(text.contains("valet_quits_sent_ahead_total{result=\"sent\"} 1\n"), "{text}");
    assert!(text.contains("valet_quits_sent_ahead_total{result=\"unclaimed\"} 0\n"), "{text}");
    assert_eq!(lp.ahead.armed(), 0, "nothing armed once the work is done");
    lp.stop().await;

    // Armed, then the pod is deleted: disarmed. A request the reader had already sent for an
    // end the loop then does not quit for is dropped and counted.
    let (node, lp, [_, app]) = armed_job("ahead-gone").await;
    let pod_cg = node.pod_id();
    let mut exit = end_of(pod_cg, app, 0);
    exit.quits_sent_ahead = lp.ahead.fire(&exit);
    assert_eq!(exit.quits_sent_ahead, 1);
    let mut deleting = serde_json::to_value(job_pod(json!({}))).expect("json");
    deleting["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
    lp.apply(serde_json::from_value(deleting).expect("pod"));
    // Handled once the pod stood down (the firing above disarmed it already).
    lp.until("stood down for the deletion", |l| {
        lock(&l.kernel.0).watched.is_empty() && lock(&l.link.0).opened.is_empty()
    })
    .await;
    let _ = lp.events.send(Event::Exit(exit));
    lp.until("counted unclaimed", |l| {
        l.metrics.encode().contains("valet_quits_sent_ahead_total{result=\"unclaimed\"} 1\n")
    })
    .await;
    assert_eq!(lock(&lp.link.0).taken_over, 0);
    assert_eq!(lp.ahead.armed(), 0);
    lp.stop().await;
}

#[tokio::test]
async fn a_container_is_named_when_its_cgroup_appears_not_when_it_ends() {
    // A real runtime removes a container's cgroup and bundle tens of milliseconds after its
    // main process exits; an agent that reads the exit later than that must already know the
    // container's name, learnt when its cgroup appeared.
    let node = TempNode::new("named");
    node.container(1, "POD");
    node.container(3, "istio-proxy");
    let lp = start(&node, Duration::from_secs(120));
    lp.apply(job_pod(json!({})));
    let pod_cg = node.pod_id();
    lp.until("the pod cgroup watched", |l| lock(&l.kernel.0).watched.get(&pod_cg) == Some(&watch_flags::EXITS)).await;
    let app = node.container(2, "app");
    // The loop reads a new container's bundle, then asks the kernel about it, in one step.
    lp.until("the new container read", |l| lock(&l.kernel.0).exec_asked.contains(&app)).await;
    // The app ran and ended; the runtime removed its cgroup and bundle before the agent read the
    // exit (the API has not named the container either).
    std::fs::remove_dir_all(node.cgroups.abs(&node.container_rel(2))).expect("rm cgroup");
    std::fs::remove_dir_all(node.dir.join("bundles").join("02".repeat(32))).expect("rm bundle");
    lp.exit(pod_cg, app, 0);
    lp.until("the quit", |l| l.link.quits() == 1).await;
    lp.stop().await;
}

// On a paused clock: the runtime's time moves only when nothing can run, so "no write within
// 400 ms" means none after the probes of 400 ms (20 ms apart) and all they caused, however busy
// the machine is. Nothing here waits on another thread or the kernel.
#[tokio::test(start_paused = true)]
async fn condition_writes_never_overtake_each_other() {
    let node = TempNode::new("cond");
    node.container(1, "POD");
    node.container(2, "app");
    node.container(3, "istio-proxy");
    let mut lp = start(&node, Duration::from_secs(120));
    lp.apply(job_pod(json!({})));
    // Probed not ready for 400 ms: no write (a gate reads an absent condition as False).
    assert!(no_patch(&mut lp.api, Duration::from_millis(400)).await, "a False before the first True");
    lock(&lp.link.0).ready = true;
    let first = next_patch(&mut lp.api).await.expect("first condition write");
    assert_eq!(condition_of(&first), ("True".into(), "ProxyReady".into()));
    // The proxy turns unready while the first write is still unanswered: no second write yet.
    lock(&lp.link.0).ready = false;
    assert!(no_patch(&mut lp.api, Duration::from_millis(400)).await, "a second write overtook the first");
    let _ = first.answer.send(());
    let second = next_patch(&mut lp.api).await.expect("second condition write");
    assert_eq!(condition_of(&second), ("False".into(), "ProxyNotReady".into()), "a False after a True");
    let _ = second.answer.send(());
    assert!(no_patch(&mut lp.api, Duration::from_millis(300)).await, "written once per change");
    lp.stop().await;
}

#[tokio::test]
async fn a_held_app_fails_open_at_the_hold_timeout() {
    let node = TempNode::new("timeout");
    node.container(1, "POD");
    let app = node.container(2, "app");
    node.container(3, "istio-proxy");
    let lp = start(&node, Duration::from_secs(1));
    lp.apply(job_pod(json!({"valet.dev/hold-app": "true"})));
    let pod_cg = node.pod_id();
    lp.until("the pod watched with hold", |l| {
        lock(&l.kernel.0).watched.get(&pod_cg).map(|f| f & 0xff) == Some(watch_flags::EXITS | watch_flags::HOLD)
    })
    .await;
    assert_eq!(lock(&lp.kernel.0).classified.get(&app), Some(&true), "the app is classified before it execs");
    assert_eq!(
        lock(&lp.kernel.0).watched.get(&pod_cg).map(|f| f >> watch_flags::HOLD_TIMEOUT_SHIFT),
        Some(1000),
        "the kernel is told the 1 s hold timeout (ms), for the deadline in its record"
    );
    let child = stopped_child().await;
    node.add_process(2, child.id());
    // The hold counts from the kernel's stop, which the event says is now: before this instant.
    let held = std::time::Instant::now();
    lp.held(pod_cg, app, child.id());
    assert!(wait_state(child.id(), 'S').await, "released after the 1 s hold timeout");
    let released_after = held.elapsed();
    // A lower bound only: a busy machine makes a release late, never early.
    assert!(released_after >= Duration::from_secs(1), "released {released_after:?} after it was held");
    lp.until("fail-open counted", |l| l.metrics.encode().contains("valet_app_hold_fail_opens_total 1")).await;
    lp.until("the release counted", |l| metric(&l.metrics, "valet_app_releases_total{reason=\"timeout\"}") == 1.0)
        .await;
    lp.stop().await;
    kill(child);
}

#[tokio::test]
async fn without_a_pinned_record_of_holds_the_app_is_not_held() {
    let node = TempNode::new("unpinned");
    node.container(1, "POD");
    node.container(2, "app");
    node.container(3, "istio-proxy");
    let lp = start(&node, Duration::from_secs(1));
    lock(&lp.kernel.0).unpinned = true;
    lp.apply(job_pod(json!({"valet.dev/hold-app": "true"})));
    let pod_cg = node.pod_id();
    lp.until("the pod watched", |l| lock(&l.kernel.0).watched.contains_key(&pod_cg)).await;
    assert_eq!(lock(&lp.kernel.0).watched.get(&pod_cg), Some(&watch_flags::EXITS), "watched without the hold bit");
    lp.until("the refusal counted", |l| metric(&l.metrics, "valet_app_holds_refused_total") == 1.0).await;
    lp.stop().await;
}

#[tokio::test]
async fn processes_an_earlier_agent_left_held_are_adopted_and_released_when_ready() {
    let node = TempNode::new("adopt");
    node.container(1, "POD");
    node.container(2, "app");
    node.container(3, "istio-proxy");
    let app_child = stopped_child().await;
    let proxy_child = stopped_child().await;
    node.add_process(2, app_child.id());
    node.add_process(3, proxy_child.id());
    node.fake_held_at_exec(app_child.id());
    node.fake_held_at_exec(proxy_child.id());
    let lp = start(&node, Duration::from_secs(120));
    lp.apply(job_pod(json!({"valet.dev/hold-app": "true"})));
    assert!(wait_state(proxy_child.id(), 'S').await, "the sidecar left held is released at once");
    // Probes that answered "not ready" came after the adoption that released the sidecar.
    let probes = |l: &Loop| lock(&l.link.0).requests.iter().filter(|r| r.1 == "GET").count();
    lp.until("three probes answered not ready", |l| probes(l) >= 3).await;
    assert_eq!(state(app_child.id()), Some('T'), "the app stays held until the proxy is ready");
    lock(&lp.link.0).ready = true;
    assert!(wait_state(app_child.id(), 'S').await, "released when the proxy is ready");
    // Released once, for the proxy's readiness: not at its adoption.
    lp.until("the releases counted", |l| {
        metric(&l.metrics, "valet_app_releases_total{reason=\"ready\"}") == 1.0
            && metric(&l.metrics, "valet_app_releases_total{reason=\"not_app\"}") == 1.0
    })
    .await;
    lp.stop().await;
    kill(app_child);
    kill(proxy_child);
}

#[tokio::test]
async fn containers_made_after_a_held_pod_is_watched_are_classified_before_they_exec() {
    let node = TempNode::new("made");
    node.container(1, "POD");
    let lp = start(&node, Duration::from_secs(120));
    lp.apply(job_pod(json!({"valet.dev/hold-app": "true"})));
    let pod_cg = node.pod_id();
    lp.until("the pod watched with hold", |l| {
        lock(&l.kernel.0).watched.get(&pod_cg).map(|f| f & 0xff) == Some(watch_flags::EXITS | watch_flags::HOLD)
    })
    .await;
    // The runtime creates the containers; nothing has exec'd, the kernel has said nothing. The
    // proxy's init process already waits in its cgroup, in its own pid namespace (as `runc
    // init` does until `runc start`): it is not the container's main process yet.
    let waiting = stopped_child().await;
    node.fake_held_at_exec(waiting.id());
    let proxy = node.container_with(3, "istio-proxy", Some(waiting.id()));
    let app = node.container(2, "app");
    lp.until("both classified from their bundles", |l| {
        let k = lock(&l.kernel.0);
        k.classified.contains_key(&proxy) && k.classified.contains_key(&app)
    })
    .await;
    {
        let k = lock(&lp.kernel.0);
        assert_eq!(k.classified.get(&proxy), Some(&false), "the sidecar's first exec runs");
        assert_eq!(k.classified.get(&app), Some(&true), "the app's first exec is held");
        assert!(
            !k.recorded.iter().any(|(cg, _)| *cg == proxy),
            "a process waiting to exec is never recorded as the main process: {:?}",
            k.recorded
        );
    }
    lp.stop().await;
    kill(waiting);
}

/// A held Job pod on `node` (sandbox, app, istio-proxy) whose app process is stopped and counted
/// held by the loop.
async fn holding_an_app(node: &TempNode) -> (Loop, Child) {
    node.container(1, "POD");
    let app = node.container(2, "app");
    node.container(3, "istio-proxy");
    let lp = start(node, Duration::from_secs(120));
    lp.apply(job_pod(json!({"valet.dev/hold-app": "true"})));
    let pod_cg = node.pod_id();
    lp.until("the pod watched", |l| lock(&l.kernel.0).watched.contains_key(&pod_cg)).await;
    let child = stopped_child().await;
    node.add_process(2, child.id());
    lp.held(pod_cg, app, child.id());
    lp.until("the hold counted", |l| metric(&l.metrics, "valet_app_holds_total") == 1.0).await;
    (lp, child)
}

#[tokio::test]
async fn shutdown_releases_everything_held() {
    let node = TempNode::new("shutdown");
    let (lp, child) = holding_an_app(&node).await;
    assert_eq!(state(child.id()), Some('T'), "released before the shutdown");
    let (kernel, _) = lp.stop().await;
    assert!(wait_state(child.id(), 'S').await, "released on shutdown");
    assert!(lock(&kernel.0).detached);
    kill(child);
}

/// A successor comes (a container restart, a rollout), or the API could not say: the held app
/// stays stopped once the loop has returned, for the successor (and the deadline keeper).
#[tokio::test]
async fn shutdown_with_a_successor_or_no_answer_leaves_the_held_app_stopped() {
    for (tag, why) in [
        ("restart", Stop::HandOver(Successor::ContainerRestart)),
        ("rollout", Stop::HandOver(Successor::Rollout)),
        ("unanswered", Stop::Keep("no answer within 2s".into())),
    ] {
        let node = TempNode::new(&format!("handover-{tag}"));
        let (lp, child) = holding_an_app(&node).await;
        let metrics = lp.metrics.clone();
        let (kernel, _, done) = lp.stop_with(why.clone()).await;
        assert_eq!(done, Some(why), "{tag}: the loop returned what it was told");
        assert_eq!(state(child.id()), Some('T'), "{tag}: released at shutdown");
        assert_eq!(metric(&metrics, "valet_app_releases_total{reason=\"shutdown\"}"), 0.0, "{tag}: a release counted");
        assert!(lock(&kernel.0).detached, "{tag}");
        kill(child);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn liveness_fails_while_the_loop_is_wedged_and_recovers_with_it() {
    let node = TempNode::new("wedge");
    let l = start(&node, Duration::from_secs(60));
    let live = |l: &Loop| l.health.stalled(now_ns()).is_none();
    // A pod arrives; its first step asks the kernel to watch its cgroup, and that call never
    // returns: the loop's thread is stuck in it.
    l.kernel.wedge(true);
    l.apply(job_pod(json!({})));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while live(&l) {
        assert!(tokio::time::Instant::now() < deadline, "liveness never failed while the loop was wedged");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(lock(&l.kernel.0).watched.is_empty(), "the call is still stuck");
    // The call returns: the loop turns again, and liveness with it.
    l.kernel.wedge(false);
    l.until("the pod watched", |l| !lock(&l.kernel.0).watched.is_empty()).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !live(&l) {
        assert!(tokio::time::Instant::now() < deadline, "liveness did not come back with the loop");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    l.stop().await;
}
