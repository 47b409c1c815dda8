//! End to end: container ends that no kernel event reported are still found. A pod
//! came, and its app ended, while the agent was stopped: the kernel never watched it, and the
//! API still says the app runs (its kubelet published the pod once, with the app running, and
//! nothing since). The node has the truth: the app's cgroup is gone. The quit comes at the
//! agent's resume, from that, not from the API.

use std::time::{Duration, Instant};

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
    resume();
    let job = made.expect("pod");
    assert!(job.quits().is_empty(), "a quit while the agent was stopped?");
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
