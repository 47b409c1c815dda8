//! End to end, issue 26 "API faults": the API server answers 500 or 429 for 30 s, the pod watch
//! stalls without closing, PATCHes hang, reads (lists, the start of watches) hang. The real agent
//! binary, real kernel programs, cgroups and network namespaces, the simulated node; only the API
//! server misbehaves. `docs/dev/api-faults.md` says what the agent does behind its bounds.
//!
//! In each case, on one node:
//! - a Job whose app ends during the fault is quit (the kernel path needs no API);
//! - a Job whose pod is created during the fault, and whose app ends during it, is quit once the
//!   agent can see it (the API shows the app terminated by then);
//! - the `valet.dev/ProxyReady` condition of pods whose proxy turned ready during the fault
//!   reaches True once the API is back;
//! - memory stays bounded: writes in flight never exceed the agent's four (the server's count),
//!   the agent tracks the pods there are, and its RSS stays within twice what it was.
//!
//! The tests measure no latency, so they run in parallel, each on its own node and agent; the
//! waits for what must happen are hang guards, generous for a loaded 2-core machine.

use std::time::{Duration, Instant};

use valet_sim::apiserver::{Fault, FaultStats};
use valet_tests::harness::{Agent, HANG_GUARD, JobPod, JobSpec, Node, eventually};
use valet_tests::held::wait_probed_not_ready;

const CONDITION: &str = "valet.dev/ProxyReady";
/// How long a fault lasts.
const FAULT: Duration = Duration::from_secs(30);
/// The agent's bound on writes in flight (`valet_agent::api::MAX_WRITES_IN_FLIGHT`).
const MAX_WRITES: u64 = valet_agent::api::MAX_WRITES_IN_FLIGHT as u64;
/// Pods whose proxy turns ready during the fault: more than the writes the agent lets out at
/// once, so that some wait their turn.
const GATED: usize = 6;
/// Hang guard for what follows the end of a fault: the watch's backoff (up to 30 s), a ready
/// proxy's next probe (every 30 s) and a hung write's 10 s, with room to spare.
const CONVERGE: Duration = Duration::from_secs(150);

/// The agent's `valet.dev/ProxyReady` condition on the pod, as (status, reason).
fn condition(node: &Node, job: &JobPod) -> Option<(String, String)> {
    let pod = node.pod(job)?;
    pod["status"]["conditions"].as_array()?.iter().find(|c| c["type"] == CONDITION).map(|c| {
        (c["status"].as_str().unwrap_or_default().to_owned(), c["reason"].as_str().unwrap_or_default().to_owned())
    })
}

fn wait_condition(node: &Node, job: &JobPod, agent: &Agent, status: &str, reason: &str, guard: Duration) {
    let want = Some((status.to_owned(), reason.to_owned()));
    assert!(
        eventually(guard, || condition(node, job) == want),
        "condition {CONDITION} {status}/{reason} on {}: have {:?}\n{}",
        job.name,
        condition(node, job),
        agent.log_text()
    );
}

/// The agent's resident memory in KiB.
fn rss_kib(agent: &Agent) -> u64 {
    let pid = agent.pid().expect("the agent runs");
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("agent status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
        .expect("VmRSS")
}

/// A node with its agent, pods whose proxy is not ready yet (probed so, no condition yet), and a ready
/// Job pod whose app has not started.
struct Scene {
    node: Node,
    agent: Agent,
    gated: Vec<(JobPod, std::path::PathBuf)>,
    ending: JobPod,
    rss_before: u64,
}

impl Scene {
    fn new(tag: &str, agent_flags: &[&str]) -> Scene {
        let node = Node::new().expect("node");
        let agent = node.start_agent(agent_flags).expect("agent");
        let mut gated = Vec::new();
        for i in 0..GATED {
            let ready = node.scratch.path(&format!("ready-{i}"));
            let mut spec = JobSpec::new(&format!("{tag}-gated-{i}"));
            spec.ready_file = Some(ready.clone());
            gated.push((node.job_pod(spec).expect("gated pod"), ready));
        }
        let ending = node.job_pod(JobSpec::new(&format!("{tag}-ending"))).expect("pod");
        agent.wait_tracked(GATED + 1, Duration::from_secs(30)).expect("tracked");
        for (job, _) in &gated {
            wait_probed_not_ready(&node, job, &agent);
        }
        let rss_before = rss_kib(&agent);
        Scene { node, agent, gated, ending, rss_before }
    }

    /// What happens during the fault, whatever it is: the gated proxies turn ready, the ending
    /// Job's app ends and its proxy is quit, a new Job's pod appears and its app ends. Returns
    /// that new Job.
    fn during_the_fault(&mut self, tag: &str) -> JobPod {
        for (_, ready) in &self.gated {
            std::fs::write(ready, "").expect("ready file");
        }
        self.ending.run_app("app", "exit 0").expect("app");
        let code = self.ending.wait_proxy_exit(Duration::from_secs(30)).expect("wait");
        assert_eq!(code, Some(0), "{tag}: the proxy is quit during the fault\n{}", self.agent.log_text());
        assert_eq!(self.ending.quits().len(), 1, "{tag}: exactly one quit: {:?}", self.ending.quits());
        let mut late = self.node.job_pod(JobSpec::new(&format!("{tag}-late"))).expect("late pod");
        late.run_app("app", "exit 0").expect("late app");
        assert_eq!(late.wait_api_terminated("app", Duration::from_secs(30)), Some(0), "{tag}: the API shows the end");
        late
    }

    /// Once the API is back: the conditions reach the truth, the new Job is quit, memory is
    /// what it was. Prints the figures.
    fn after_the_fault(&self, tag: &str, late: &mut JobPod, fault_end: Instant) -> FaultStats {
        for (job, _) in &self.gated {
            wait_condition(&self.node, job, &self.agent, "True", "ProxyReady", CONVERGE);
        }
        let conditions_true = fault_end.elapsed();
        let code = late.wait_proxy_exit(CONVERGE).expect("wait");
        let late_quit = fault_end.elapsed();
        assert_eq!(code, Some(0), "{tag}: the Job that ended unseen is quit\n{}", self.agent.log_text());
        assert_eq!(late.quits().len(), 1, "{tag}: exactly one quit: {:?}", late.quits());
        assert_eq!(self.ending.quits().len(), 1, "{tag}: no second quit: {:?}", self.ending.quits());
        // An Event is sent once: one refused is lost, one waiting for a slot goes out later.
        let quit_events = |job: &JobPod| self.node.events_for(job).iter().filter(|(r, _)| r == "SidecarQuit").count();
        let (ending_events, late_events) = (quit_events(&self.ending), quit_events(late));
        let tracked = self.agent.metric("valet_pods_tracked ");
        let rss_after = rss_kib(&self.agent);
        let stats = self.node.api.fault_stats();
        let patches = self.agent.metric("valet_condition_patches_total{result=\"ok\"} ");
        let failed = self.agent.metric("valet_condition_patches_total{result=\"error\"} ");
        let restarts = self.agent.metric("valet_watch_restarts_total ");
        println!(
            "{tag}: refused {} hung {} stalled watches {}, peak in flight: PATCHes {} writes {} (open {}); \
             condition writes ok {patches} failed {failed}; watch restarts {restarts}; \
             SidecarQuit Events: ending {ending_events}, late {late_events} (not asserted); \
             pods tracked {tracked}; RSS {} -> {} KiB; after the fault (not asserted): conditions \
             True by {conditions_true:.1?}, the Job that ended unseen quit by {late_quit:.1?}",
            stats.refused,
            stats.hung,
            stats.stalled_watches,
            stats.peak_patches_in_flight,
            stats.peak_writes_in_flight,
            stats.peak_writes_open,
            self.rss_before,
            rss_after
        );
        assert!(stats.peak_writes_in_flight <= MAX_WRITES, "{tag}: writes in flight at once: {stats:?}");
        // A failed write is retried after 1, 2, 4, 8, 16 s: at most six tries per pod in a 30 s
        // fault (fewer on a slow machine, never more).
        let writers = (GATED + 2) as f64;
        assert!(failed <= writers * 6.0, "{tag}: {failed} failed condition writes: retried in a loop?");
        assert_eq!(tracked as usize, GATED + 2, "{tag}: the pods there are, no more\n{}", self.agent.log_text());
        assert!(rss_after <= 2 * self.rss_before, "{tag}: RSS {} -> {rss_after} KiB", self.rss_before);
        assert!(!self.agent.log_text().contains("panicked"), "{}", self.agent.log_text());
        stats
    }
}

/// 500 or 429 on every request for 30 s; the pod watch is cut as it starts, so the agent has to
/// list and watch again through the refusals.
fn refused_for_30s(code: u16, tag: &str) {
    let mut scene = Scene::new(tag, &[]);
    let restarts = scene.agent.metric("valet_watch_restarts_total ");
    let fault_end = Instant::now() + FAULT;
    scene.node.api.set_fault(Fault::Status { code, verbs: Vec::new(), until: Some(fault_end) });
    scene.node.api.drop_watches();
    let mut late = scene.during_the_fault(tag);
    assert!(
        eventually(Duration::from_secs(30), || scene.node.api.fault_stats().refused > 0),
        "{tag}: requests were refused"
    );
    let stats = scene.after_the_fault(tag, &mut late, fault_end);
    // kube's client retries a 429 itself, for longer than 30 s: the watch never sees it fail.
    if code != 429 {
        assert!(scene.agent.metric("valet_watch_restarts_total ") > restarts, "{tag}: the watch restart is counted");
    }
    assert!(stats.refused > 0, "{stats:?}");
}

#[test]
fn internal_errors_for_30s() {
    refused_for_30s(500, "500");
}

/// kube's client retries a 429 itself (after the server's Retry-After, up to 15 times), within
/// the agent's 10 s bound on each write.
#[test]
fn too_many_requests_for_30s() {
    refused_for_30s(429, "429");
}

/// The pod watch stalls: open, nothing sent. Writes still work. A pod created meanwhile is not
/// seen while every watch stalls; the agent gives a silent watch up after its watch timeout plus
/// 5 s (here 5 + 5 s) and watches again, and sees the pod once watches flow again.
#[test]
fn stalled_watch() {
    let tag = "stall";
    let mut scene = Scene::new(tag, &["--watch-timeout", "5s"]);
    let api = &scene.node.api;
    api.set_fault(Fault::StallWatches);
    assert!(eventually(Duration::from_secs(10), || api.fault_stats().stalled_watches >= 1), "the open watch stalls");
    let started = Instant::now();
    let mut late = scene.during_the_fault(tag);
    // The agent gave the stalled watch up and watched again: that one stalls too, and the new
    // pod is still unseen.
    let api = &scene.node.api;
    let watches = api.watch_count();
    assert!(
        eventually(Duration::from_secs(60), || api.watch_count() > watches && api.fault_stats().stalled_watches >= 2),
        "a stalled watch is given up and watched again: {:?}\n{}",
        api.fault_stats(),
        scene.agent.log_text()
    );
    assert_eq!(scene.agent.metric("valet_pods_tracked ") as usize, GATED + 1, "the new pod is unseen");
    if let Some(rest) = FAULT.checked_sub(started.elapsed()) {
        std::thread::sleep(rest);
    }
    api.clear_faults();
    let fault_end = Instant::now();
    scene.agent.wait_tracked(GATED + 2, CONVERGE).expect("the new pod is seen once watches flow");
    println!("stall: the pod created during the stall seen {:.1?} after it", fault_end.elapsed());
    scene.after_the_fault(tag, &mut late, fault_end);
}

/// Reads hang for 30 s: lists and the start of watches are read and never answered, not even a
/// status line. The watch open when it begins is cut, so the agent has to start one into the
/// fault; writes work. A pod created meanwhile is seen once the agent gave that request up and
/// the API answers again.
#[test]
fn hanging_reads() {
    let tag = "hang-reads";
    let mut scene = Scene::new(tag, &[]);
    let started = Instant::now();
    scene.node.api.set_fault(Fault::HangReads);
    scene.node.api.drop_watches();
    let mut late = scene.during_the_fault(tag);
    let api = &scene.node.api;
    assert!(eventually(Duration::from_secs(30), || api.fault_stats().hung >= 1), "the agent's watch request hangs");
    if let Some(rest) = FAULT.checked_sub(started.elapsed()) {
        std::thread::sleep(rest);
    }
    api.clear_faults();
    scene.after_the_fault(tag, &mut late, Instant::now());
}

/// PATCHes hang for 30 s: each condition write holds one of the agent's four slots for its 10 s
/// bound, the others (and the Events) wait their turn; then each pod's write is retried at its
/// proxy's next probe.
#[test]
fn hanging_patches() {
    let tag = "hang";
    let mut scene = Scene::new(tag, &[]);
    let restarts = scene.agent.metric("valet_watch_restarts_total ");
    let started = Instant::now();
    scene.node.api.set_fault(Fault::HangPatches);
    let mut late = scene.during_the_fault(tag);
    let api = &scene.node.api;
    assert!(
        eventually(Duration::from_secs(30), || api.fault_stats().hung > MAX_WRITES),
        "more writes than the bound were made and hung: {:?}\n{}",
        api.fault_stats(),
        scene.agent.log_text()
    );
    if let Some(rest) = FAULT.checked_sub(started.elapsed()) {
        std::thread::sleep(rest);
    }
    api.clear_faults();
    let stats = scene.after_the_fault(tag, &mut late, Instant::now());
    // The quit's Event waited behind the hung PATCHes for a slot, and went out.
    assert!(
        eventually(CONVERGE, || scene.node.events_for(&scene.ending).iter().any(|(r, _)| r == "SidecarQuit")),
        "the Event of the quit during the fault: {:?}",
        scene.node.events_for(&scene.ending)
    );
    assert!(stats.peak_patches_in_flight <= MAX_WRITES, "{stats:?}");
    // The watch, open all along (longer than a request may take to be answered), was not cut.
    assert_eq!(scene.agent.metric("valet_watch_restarts_total "), restarts, "{}", scene.agent.log_text());
    assert_eq!(stats.peak_patches_in_flight, MAX_WRITES, "the slots were all taken: {stats:?}");
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
