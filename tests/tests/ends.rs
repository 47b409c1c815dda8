//! End to end: container ends that no kernel event reported are still found. A pod
//! came, and its app ended, while the agent was stopped: the kernel never watched it, and the
//! API still says the app runs (its kubelet published the pod once, with the app running, and
//! nothing since). The node has the truth: the app's cgroup is gone. The quit comes at the
//! agent's resume, from that, not from the API.

use std::time::{Duration, Instant};

use valet_sim::node::SpawnOptions;
use valet_tests::checks::{metric_sum, witness};
use valet_tests::harness::{HANG_GUARD, JobSpec, Node, eventually};

#[test]
fn an_app_that_ended_while_the_agent_was_stopped_is_quit_at_its_resume() {
    let node = Node::new().expect("node");
    let agent = node.start_agent(&[]).expect("agent");
    let pid = agent.pid().expect("agent pid") as i32;
    // SAFETY: plain syscall on our own child; it is let go below whatever happens.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    let stopped = Instant::now();
    let resume = || {
        // SAFETY: as above.
        unsafe { libc::kill(pid, libc::SIGCONT) };
    };
    let made = (|| -> anyhow::Result<valet_tests::harness::JobPod> {
        let spec = JobSpec::new("unseen-end").manual_status().app_command("app", "sleep 0.3");
        let job = node.job_pod(spec)?;
        // The kubelet publishes the pod once while the app runs, then never again.
        job.publish_status()?;
        anyhow::ensure!(job.api_status("app").is_some_and(|s| s["state"]["running"].is_object()), "app running");
        job.apps[0].wait_timeout(HANG_GUARD)?.ok_or_else(|| anyhow::anyhow!("the app never ended"))?;
        // The runtime removes the ended container's cgroup.
        let cgroup = job.sim.container_cgroup_path("app")?;
        anyhow::ensure!(eventually(HANG_GUARD, || !cgroup.exists()), "the app's cgroup was kept");
        Ok(job)
    })();
    std::thread::sleep(Duration::from_secs(4).saturating_sub(stopped.elapsed()));
    // Read before the resume: once resumed, the agent may quit before this thread runs again.
    let quiet = made.as_ref().is_ok_and(|job| job.quits().is_empty());
    resume();
    let job = made.expect("pod");
    assert!(quiet, "a quit while the agent was stopped?");
    assert!(
        eventually(HANG_GUARD, || !job.loopback_quits().is_empty()),
        "no quit after the resume\n{}",
        agent.log_text()
    );
    // The API never said the app ended: the quit came from the node.
    assert!(job.api_status("app").is_some_and(|s| s["state"]["running"].is_object()), "the API still says running");
    assert!(agent.log_text().contains("container ended unseen"), "{}", agent.log_text());
    println!("quit {:?} after the stop began (the agent was stopped 4 s)", stopped.elapsed());
}

/// A tracked Job's app started and ended while the agent was stopped, with the kubelet's
/// reports held past the stop (a kubelet behind): the runtime removed the app's cgroup and
/// bundle, the API has not named it, and only the kubelet's log link names its id. The agent
/// quits the proxy at its resume, before the API's report. With the links unreadable the same
/// end waits for that report.
#[test]
fn an_app_that_started_and_ended_in_a_stall_is_named_by_the_kubelets_log_link() {
    const STALL: Duration = Duration::from_secs(3);
    for links in [true, false] {
        let node = Node::new().expect("node");
        let unreadable = format!("--container-log-links={}", node.scratch.path("no-such-dir").display());
        let extra: Vec<&str> = if links { Vec::new() } else { vec![unreadable.as_str()] };
        let agent = node.start_agent(&extra).expect("agent");
        let mut job = node.job_pod(JobSpec::new("in-stall")).expect("pod");
        assert!(eventually(HANG_GUARD, || node.proxy_ready_condition(&job)), "placed\n{}", agent.log_text());
        // The API's reports come well after the resume: long with the links (a quit before them
        // is the links'), short without (the quit must wait for them).
        let held = if links { Duration::from_secs(30) } else { Duration::from_secs(2) };
        let pid = agent.pid().expect("agent pid") as i32;
        // SAFETY: plain syscall on our own child; it is let go below whatever happens.
        unsafe { libc::kill(pid, libc::SIGSTOP) };
        let (stopped, stopped_ns) = (Instant::now(), valet_test_support::monotonic_ns());
        node.kubelet.hold_status_writes(stopped + STALL + held);
        let reports_ns = stopped_ns + (STALL + held).as_nanos() as u64;
        let ran = (|| -> anyhow::Result<()> {
            job.run_app("app", "exit 0")?;
            job.apps[0].wait_timeout(HANG_GUARD)?.ok_or_else(|| anyhow::anyhow!("the app never ended"))?;
            let cgroup = job.sim.container_cgroup_path("app")?;
            anyhow::ensure!(eventually(HANG_GUARD, || !cgroup.exists()), "the app's cgroup was kept");
            let bundle = node.runtime_state_dir().join(job.apps[0].id());
            anyhow::ensure!(eventually(HANG_GUARD, || !bundle.exists()), "the app's bundle was kept");
            Ok(())
        })();
        std::thread::sleep(STALL.saturating_sub(stopped.elapsed()));
        // SAFETY: as above.
        unsafe { libc::kill(pid, libc::SIGCONT) };
        ran.expect("the app ran in the stall");
        assert!(eventually(HANG_GUARD + held, || !job.quits().is_empty()), "never quit\n{}", agent.log_text());
        let quit_ns = job.quits()[0].mono_ns;
        let named = agent.log_text().contains("named by the kubelet's log link");
        if links {
            assert!(quit_ns < reports_ns, "the quit waited for the API's report\n{}", agent.log_text());
            assert!(named, "{}", agent.log_text());
            let api = job.api_status("app");
            assert!(api.as_ref().is_none_or(|s| s.get("containerID").is_none()), "the API named the app: {api:?}");
        } else {
            assert!(quit_ns >= reports_ns, "quit before the API's report with no links\n{}", agent.log_text());
            assert!(!named, "{}", agent.log_text());
            assert!(agent.log_text().contains("cannot read the kubelet's container log links"), "{}", agent.log_text());
        }
        println!("links {links}: quit {:?} after the stop began", stopped.elapsed());
    }
}

#[test]
fn the_end_of_a_debug_container_quits_nothing_and_the_apps_end_does() {
    // `kubectl debug` adds an ephemeral container to a running pod: one the pod's spec does not
    // list, in a cgroup of the pod, pid 1 of a pid namespace of its own, whose end the kernel
    // reports as a container init's. Its end quits nothing; the app's own end quits the proxy.
    let node = Node::new().expect("node");
    let agent = node.start_agent(&[]).expect("agent");
    let stop = node.scratch.path("stop");
    let script = format!("while [ ! -e {} ]; do sleep 0.05; done", stop.display());
    let mut spec = JobSpec::new("debugged").app_command("app", &script);
    spec.extra_containers = vec!["debugger".into()];
    let job = node.job_pod(spec).expect("pod");
    assert!(eventually(HANG_GUARD, || node.proxy_ready_condition(&job)), "the pod was placed\n{}", agent.log_text());
    let exits = "valet_container_exits_total{outcome=\"Success\"} ";
    let before = agent.metric(exits);
    let debugger = job.sim.container("debugger").expect("the debug container");
    job.sim.make_container_cgroup(&debugger).expect("its cgroup");
    let mut shell = job.sim.spawn("debugger", &["/bin/sh", "-c", "exit 0"], &SpawnOptions::default()).expect("spawn");
    assert!(shell.wait_timeout(HANG_GUARD).expect("wait").is_some(), "the debug shell ended");
    // The kernel's report of its end reached the pod's state (counted as a container's end).
    assert!(
        agent.wait_metric(exits, before + 1.0),
        "the debug container's end was never handled\n{}",
        agent.log_text()
    );
    assert!(job.quits().is_empty(), "the debug container's end quit the proxy\n{}", agent.log_text());
    std::fs::write(&stop, "").expect("stop file");
    assert!(
        eventually(HANG_GUARD, || !job.loopback_quits().is_empty()),
        "the app's end did not quit the proxy\n{}",
        agent.log_text()
    );
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
