//! End to end: held apps and quits through the agent's own end. The agent killed while it holds
//! apps, or SIGTERMed (as a container restart, a rollout, an uninstall, with the API unanswered,
//! with a quit in flight): what it leaves to its successor or to the deadline keeper, and that no
//! held app is left stopped.
//!
//! The tests from the gate suite run one at a time (a file-wide lock: they print release
//! latencies); each waits for the event itself, bounded only by a hang guard.

use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use serde_json::Value;
use valet_sim::apiserver::{Fault, Kind, Propagation};
use valet_tests::capabilities::{manifest_capabilities, with_capabilities};
use valet_tests::checks::wait_listening;
use valet_tests::harness::{
    AGENT_DAEMONSET, AGENT_NAMESPACE, Agent, HANG_GUARD, JobPod, JobSpec, Node, eventually, process_state,
    process_state as state, wait_file,
};
use valet_tests::held::{
    HOLD, HOLD_TIMEOUT, app_pid, assert_held, held_spec, loopback_probes, marker_script, wait_probed_not_ready,
    wait_probes,
};
use valet_tests::unreadable::Unreadable;
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(PoisonError::into_inner)
}

#[test]
fn agent_killed_while_holding_leaves_apps_to_its_successor() {
    let _serial = serial();
    let node = Node::new().expect("node");
    let mut agent = node.start_agent(&[]).expect("agent");
    // a: the proxy turns ready after the restart; c: it turns ready while no agent runs;
    // b: the API never reports the app's container ID (nor a bundle) and the proxy never turns ready.
    let paths = |tag: &str| (node.scratch.path(&format!("ready-{tag}")), node.scratch.path(&format!("marker-{tag}")));
    let ((ready_a, marker_a), (ready_b, marker_b), (ready_c, marker_c)) = (paths("a"), paths("b"), paths("c"));
    let script = |marker: &PathBuf| format!("echo ran > {}; exec sleep 0.3", marker.display());
    let mut a = node.job_pod(held_spec("restart-a", &ready_a)).expect("pod a");
    let mut c = node.job_pod(held_spec("restart-c", &ready_c)).expect("pod c");
    let spec_b = held_spec("restart-b", &ready_b).annotation(HOLD_TIMEOUT, "3s").manual_status().no_bundles();
    let mut b = node.job_pod(spec_b).expect("pod b");
    // The API names the proxy (the app has not started); it never shows more.
    b.publish_status().expect("b's status");
    agent.wait_tracked(3, HANG_GUARD).expect("tracked");
    for job in [&a, &b, &c] {
        wait_probed_not_ready(&node, job, &agent);
    }
    // b's hold counts from the kernel's stop, after this instant.
    let b_started = Instant::now();
    for (job, marker) in [(&mut a, &marker_a), (&mut b, &marker_b), (&mut c, &marker_c)] {
        job.run_app("app", &script(marker)).expect("app");
    }
    for (job, marker, what) in [(&a, &marker_a, "a"), (&b, &marker_b, "b"), (&c, &marker_c, "c")] {
        assert!(eventually(HANG_GUARD, || state(app_pid(job)) == Some('T')), "{what} held");
        assert!(!marker.exists());
    }
    // b was stopped by the kernel no later than now.
    let b_seen_held = Instant::now();
    // The kernel stops the process and reports it in one step; the agent counts the report a
    // moment later.
    assert!(
        eventually(HANG_GUARD, || agent.metric("valet_app_holds_total ") == 3.0),
        "three holds counted: {}\n{}",
        agent.metric("valet_app_holds_total "),
        agent.log_text()
    );

    agent.stop(libc::SIGKILL, HANG_GUARD).expect("kill the agent");
    std::fs::write(&ready_c, "").expect("ready c");
    // The agent is reaped: nothing releases them now.
    for (job, marker, what) in [(&a, &marker_a, "a"), (&b, &marker_b, "b"), (&c, &marker_c, "c")] {
        assert_held(job, marker, &agent, &format!("{what}, the agent killed"));
    }
    // The successor starts once b's 3 s hold is over (at least: a later start only widens the
    // gap): a successor that counted b's hold from its own start would hold b 3 s more, and
    // report a hold of about 3 s; one that counts from the kernel's stop reports the whole hold.
    while b_seen_held.elapsed() < Duration::from_millis(3500) {
        std::thread::sleep(Duration::from_millis(50));
    }

    let restarted = Instant::now();
    let agent = node.start_agent(&[]).expect("second agent");
    // c: its proxy is already ready: released right away.
    let c_after = wait_file(&marker_c, HANG_GUARD).map(|_| restarted.elapsed());
    println!("c released {c_after:?} after the new agent was ready");
    assert!(c_after.is_some(), "c released by the new agent\n{}", agent.log_text());
    // a: adopted and still held while its proxy is not ready (probed by the new agent).
    wait_probes(&a, loopback_probes(&a), 3, &agent);
    assert_held(&a, &marker_a, &agent, "a, adopted by the new agent");
    std::fs::write(&ready_a, "").expect("ready a");
    let a_delay = wait_file(&marker_a, HANG_GUARD);
    println!("a: proxy ready -> app ran after the restart: {a_delay:?}");
    assert!(a_delay.is_some(), "a released once its proxy is ready\n{}", agent.log_text());
    b_released_at_its_deadline(&agent, &b, &marker_b, b_started, b_seen_held, restarted);

    // Every app ran to its end: the released processes' later execs were not held again.
    for (job, what) in [(&mut a, "a"), (&mut b, "b"), (&mut c, "c")] {
        let status = job.apps[0].wait_timeout(HANG_GUARD).expect("wait");
        assert!(status.is_some_and(|s| s.success()), "{what} finished: {status:?}\n{}", agent.log_text());
    }
    assert_eq!(agent.metric("valet_app_holds_total "), 0.0, "no new holds after the restart\n{}", agent.log_text());
    assert!(agent.wait_metric("valet_app_releases_total{reason=\"ready\"} ", 2.0));
}

/// b (in a container the API does not name yet) is still released, by the hold timeout, which
/// counts from when the kernel stopped it (`b_started` before, `b_seen_held` after): the restart
/// (at `restarted`) does not extend it.
fn b_released_at_its_deadline(
    agent: &Agent,
    b: &JobPod,
    marker_b: &Path,
    b_started: Instant,
    b_seen_held: Instant,
    restarted: Instant,
) {
    let b_after = wait_file(marker_b, HANG_GUARD).map(|_| restarted.elapsed());
    println!("b (container unknown to the API) released {b_after:?} after the restart (hold timeout 3 s)");
    assert!(b_after.is_some(), "b left stopped\n{}", agent.log_text());
    // Lower bounds only. b_started is before the stop (the process start, which the successor
    // takes as the stop, to the clock's 10 ms tick).
    let b_held_for = b_started.elapsed();
    assert!(b_held_for >= Duration::from_millis(2500), "b released before its hold timeout: held {b_held_for:?}");
    let b_pid = app_pid(b);
    // b's deadline (from the kernel's stop, not the restart) had passed when the successor
    // started: its first act, before it needs the API, was to release b.
    assert!(
        eventually(HANG_GUARD, || agent
            .log_text()
            .lines()
            .any(|l| l.contains("released a held app at its deadline") && l.contains(&format!("pid={b_pid} ")))),
        "b released at start by the deadline keeper\n{}",
        agent.log_text()
    );
    let gap = restarted.duration_since(b_seen_held);
    println!("b: released at the successor's start ({gap:?} after b was held)");
    assert!(agent.wait_metric("valet_app_releases_total{reason=\"deadline\"} ", 1.0));
}

#[test]
fn apps_held_by_a_killed_agent_run_once_their_pod_no_longer_holds_them() {
    let _serial = serial();
    let node = Node::new().expect("node");
    let mut agent = node.start_agent(&[]).expect("agent");
    // While no agent runs: d loses its opt-in label (the watch no longer shows it at all),
    // e loses its hold annotation, f keeps both (its proxy never turns ready: still held).
    let paths = |tag: &str| (node.scratch.path(&format!("ready-{tag}")), node.scratch.path(&format!("marker-{tag}")));
    let ((ready_d, marker_d), (ready_e, marker_e), (ready_f, marker_f)) = (paths("d"), paths("e"), paths("f"));
    let mut d = node.job_pod(held_spec("unlabelled", &ready_d)).expect("pod d");
    let mut e = node.job_pod(held_spec("unheld", &ready_e)).expect("pod e");
    let mut f = node.job_pod(held_spec("still-held", &ready_f)).expect("pod f");
    agent.wait_tracked(3, Duration::from_secs(10)).expect("tracked");
    for job in [&d, &e, &f] {
        wait_probed_not_ready(&node, job, &agent);
    }
    for (job, marker) in [(&mut d, &marker_d), (&mut e, &marker_e), (&mut f, &marker_f)] {
        job.run_app("app", &format!("echo ran > {}; exec sleep 0.3", marker.display())).expect("app");
    }
    for (job, what) in [(&d, "d"), (&e, "e"), (&f, "f")] {
        assert!(eventually(Duration::from_secs(10), || state(app_pid(job)) == Some('T')), "{what} held");
    }
    assert!(
        eventually(Duration::from_secs(10), || agent.metric("valet_app_holds_total ") == 3.0),
        "three holds counted\n{}",
        agent.log_text()
    );
    agent.stop(libc::SIGKILL, Duration::from_secs(5)).expect("kill the agent");
    node.api
        .modify_pod("jobs", &d.name, |p| {
            p["metadata"]["labels"].as_object_mut().map(|l| l.remove("valet.dev/enabled"));
        })
        .expect("relabel d");
    node.api
        .modify_pod("jobs", &e.name, |p| {
            p["metadata"]["annotations"].as_object_mut().map(|a| a.remove(HOLD));
        })
        .expect("unhold e");
    for (job, marker, what) in [(&d, &marker_d, "d"), (&e, &marker_e, "e"), (&f, &marker_f, "f")] {
        assert_held(job, marker, &agent, &format!("{what}, with no agent running"));
    }

    let agent = node.start_agent(&[]).expect("second agent");
    let restarted = Instant::now();
    // Ready means the pods were listed and what none of them holds was released.
    for (marker, what) in [(&marker_d, "d (label removed)"), (&marker_e, "e (hold annotation removed)")] {
        let after = wait_file(marker, Duration::from_secs(10)).map(|_| restarted.elapsed());
        println!("{what}: its app ran {after:?} after the new agent was ready");
        assert!(after.is_some(), "{what}: left stopped by the new agent\n{}", agent.log_text());
    }
    assert!(
        eventually(Duration::from_secs(10), || agent.metric("valet_app_releases_total{reason=\"orphaned\"} ") == 2.0),
        "d and e released as orphans (no pod holds them)\n{}",
        agent.log_text()
    );
    // f is still held, by the new agent, until its proxy is ready.
    assert_held(&f, &marker_f, &agent, "f, adopted by the new agent");
    std::fs::write(&ready_f, "").expect("ready f");
    assert!(wait_file(&marker_f, Duration::from_secs(10)).is_some(), "f released once ready\n{}", agent.log_text());
    for (job, what) in [(&mut d, "d"), (&mut e, "e"), (&mut f, "f")] {
        let status = job.apps[0].wait_timeout(Duration::from_secs(10)).expect("wait");
        assert!(status.is_some_and(|s| s.success()), "{what} finished: {status:?}\n{}", agent.log_text());
    }
    assert_eq!(agent.metric("valet_app_holds_total "), 0.0, "no new holds after the restart");
}

#[test]
fn sigterm_releases_held_apps_before_the_agent_exits() {
    let _serial = serial();
    let node = Node::new().expect("node");
    let mut agent = node.start_agent(&[]).expect("agent");
    let ready = node.scratch.path("ready");
    let marker = node.scratch.path("marker");
    let mut job = node.job_pod(held_spec("graceful", &ready)).expect("pod");
    wait_probed_not_ready(&node, &job, &agent);
    job.run_app("app", &marker_script(&marker)).expect("app");
    assert!(eventually(HANG_GUARD, || state(app_pid(&job)) == Some('T')), "held");
    assert_held(&job, &marker, &agent, "before SIGTERM");

    let status = agent.stop(libc::SIGTERM, HANG_GUARD).expect("agent stops");
    // Checked the moment the agent is gone: the release happened before its exit.
    let after_exit = state(app_pid(&job));
    assert!(status.is_some_and(|s| s.success()), "agent exit status {status:?}\n{}", agent.log_text());
    assert_ne!(after_exit, Some('T'), "the app was still stopped when the agent exited\n{}", agent.log_text());
    assert!(wait_file(&marker, HANG_GUARD).is_some(), "the app ran");
    let log = agent.log_text();
    assert!(
        log.lines().any(|l| l.contains("released app") && l.contains("shutdown")),
        "the agent logged the shutdown release:\n{log}"
    );
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
        // Placed: probed, not ready.
        wait_probed_not_ready(node, &job, agent);
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

/// A held app whose cgroup cannot be read when a successor starts (its owner made it unreadable
/// to valet: another uid, mode 0700; the agents run with the manifest's capabilities, without
/// CAP_DAC_OVERRIDE), its proxy turning ready meanwhile. The successor cannot find the app then;
/// once the cgroup reads again it must find and release it, not leave it stopped until its
/// deadline (120 s here, far past the hang guard). The crash test's read faults found this: an
/// agent that searched the pod once, read the unreadable cgroup as empty and never looked again.
#[test]
fn an_app_held_in_a_cgroup_unreadable_at_a_restart_runs_once_it_reads_again() {
    let _serial = serial();
    let node = Node::new().expect("node");
    let caps = with_capabilities(&manifest_capabilities()[0]);
    let start = |what: &str| {
        let mut agent = node.spawn_agent_under(&caps, &[]).unwrap_or_else(|e| panic!("{what}: {e}"));
        agent.wait_ready(HANG_GUARD).unwrap_or_else(|e| panic!("{what} not ready: {e}\n{}", agent.log_text()));
        agent
    };
    let mut agent = start("agent");
    let app = HeldApp::new(&node, &agent, "unreadable", "120s");
    agent.stop(libc::SIGKILL, HANG_GUARD).expect("kill the agent");
    let root = valet_agent::cgroup::root::find_cgroup2_root(None, Path::new("/proc")).expect("the cgroup2 root");
    let unreadable = Unreadable::make(&root, app.pid()).expect("the app's cgroup made unreadable");
    std::fs::write(&app.ready, "").expect("ready file");
    let agent = start("successor");
    // It looked, and could not read the app's cgroup: the app is still stopped (the fault holds).
    assert!(
        eventually(HANG_GUARD, || agent.log_text().contains("cannot read the container's processes")),
        "the successor read the unreadable cgroup\n{}",
        agent.log_text()
    );
    assert!(app.stopped(), "released while its cgroup could not be read\n{}", agent.log_text());
    unreadable.restore();
    let ran = wait_file(&app.marker, HANG_GUARD);
    assert!(ran.is_some(), "left stopped once its cgroup read again, its proxy ready\n{}", agent.log_text());
    println!("unreadable at the restart: app ran {ran:?} after its cgroup read again");
    // By the successor's pod loop (its proxy ready), not at a deadline.
    let released = format!("released app pid={} reason=\"ready\"", app.pid());
    assert!(
        eventually(HANG_GUARD, || agent.log_text().contains(&released)),
        "released by the successor as ready\n{}",
        agent.log_text()
    );
}
