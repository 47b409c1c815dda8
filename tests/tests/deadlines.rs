//! End to end, issue 36: a held app's deadline holds even when no agent can list pods. The real
//! agent binary, real kernel programs, cgroups and processes; the fake API server refuses every
//! request where a test says so.
//!
//! Each test holds an app, takes away what used to release it (the agent, the API, the record's
//! format) and watches the app's state: it must stay stopped until its deadline, and run right
//! after it. Beside it, a record due at once names a stopped process outside the app's cgroup
//! (a pid given to another process): it must never be signalled, and its record is dropped. The deadline is the kernel's stop plus the hold timeout; the tests read the stop
//! time from the record the kernel wrote (`CLOCK_MONOTONIC`, the clock they poll with), so "not
//! before the deadline" is exact. How late after it the app ran is printed, not asserted (a
//! loaded machine makes it late; the crash test counts apps later than 2 s).
//!
//! The tests run one at a time (a file-wide lock): each stops and starts agents whose startup a
//! busy 2-core machine would otherwise stretch past the short deadlines used here.

use std::path::Path;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use aya::maps::{HashMap as BpfHashMap, Map, MapData};
use valet_common::{HeldRecord, HeldRecordV1, PIN_HELD, PIN_HELD_V1};
use valet_sim::apiserver::Fault;
use valet_test_support::monotonic_ns;
use valet_tests::harness::{Agent, HANG_GUARD, JobPod, JobSpec, Node, eventually, process_state as state};
use valet_tests::pins;

const HOLD: &str = "valet.dev/hold-app";
const HOLD_TIMEOUT: &str = "valet.dev/hold-timeout";

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A held Job pod whose proxy never turns ready.
fn held_spec(name: &str, never: &Path, timeout: &str) -> JobSpec {
    let mut spec = JobSpec::new(name).annotation(HOLD, "true").annotation(HOLD_TIMEOUT, timeout);
    spec.ready_file = Some(never.to_path_buf());
    spec
}

fn app_pid(job: &JobPod) -> u32 {
    job.apps[0].host_pid()
}

/// The record of `pid` in the pinned map of this version.
fn record(pin_dir: &Path, pid: u32) -> Option<HeldRecord> {
    let data = MapData::from_pin(pin_dir.join(PIN_HELD)).ok()?;
    let map: BpfHashMap<MapData, u32, HeldRecord> = BpfHashMap::try_from(Map::HashMap(data)).ok()?;
    map.get(&pid, 0).ok()
}

/// Polls every 2 ms until `pid` is no longer stopped; the monotonic time it saw it run.
fn wait_running(pid: u32, timeout: Duration) -> Option<u64> {
    let start = Instant::now();
    while start.elapsed() < timeout {
        if state(pid) != Some('T') {
            return Some(monotonic_ns());
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    None
}

/// Holds an app of a pod with hold timeout `timeout`; returns the pod and its record.
fn hold_one(node: &Node, agent: &Agent, name: &str, timeout: &str) -> (JobPod, HeldRecord) {
    let never = node.scratch.path(&format!("never-{name}"));
    let mut job = node.job_pod(held_spec(name, &never, timeout)).expect("pod");
    // The agent placed the pod: probed its proxy, not ready.
    valet_tests::held::wait_probed_not_ready(node, &job, agent);
    job.run_app("app", "exec sleep 0.3").expect("app");
    let pid = app_pid(&job);
    assert!(eventually(HANG_GUARD, || state(pid) == Some('T')), "{name}: held\n{}", agent.log_text());
    let held = record(node.pin_dir(), pid);
    let held = held.unwrap_or_else(|| panic!("{name}: no record of the hold\n{}", agent.log_text()));
    (job, held)
}

/// A stopped process that is not a held app: a stand-in for a process that was given a held
/// app's pid after that app was gone. It lives in the test's own cgroup. Killed when dropped.
struct Stranger(std::process::Child);

impl Stranger {
    /// Starts it, stops it, and records it in the pinned map as held in `cgroup_id` (the held
    /// app's container), due now: a keeper that signals a record's pid without checking its
    /// cgroup releases it.
    fn recorded_in(pin_dir: &Path, cgroup_id: u64) -> Stranger {
        let stranger = Stranger::stopped();
        let data = MapData::from_pin(pin_dir.join(PIN_HELD)).expect("open the pinned record");
        let mut map: BpfHashMap<MapData, u32, HeldRecord> =
            BpfHashMap::try_from(Map::HashMap(data)).expect("the record map");
        let now = monotonic_ns();
        map.insert(stranger.pid(), HeldRecord { cgroup_id, ktime_ns: now, deadline_ns: now }, 0).expect("record");
        stranger
    }

    /// Starts it and stops it.
    fn stopped() -> Stranger {
        let child = std::process::Command::new("sleep").arg("600").spawn().expect("spawn sleep");
        let stranger = Stranger(child);
        // SAFETY: plain syscall to the test's own child.
        unsafe { libc::kill(stranger.pid() as i32, libc::SIGSTOP) };
        assert!(eventually(HANG_GUARD, || state(stranger.pid()) == Some('T')), "the stranger stopped");
        stranger
    }

    fn pid(&self) -> u32 {
        self.0.id()
    }

    /// Asserts it was never signalled and its record, which names no one, is dropped.
    fn assert_left_alone(&self, pin_dir: &Path, logs: impl Fn() -> String) {
        assert!(
            eventually(HANG_GUARD, || record(pin_dir, self.pid()).is_none()),
            "the record of a pid living outside its cgroup was kept\n{}",
            logs()
        );
        assert_eq!(state(self.pid()), Some('T'), "a process outside the recorded cgroup was released\n{}", logs());
    }
}

impl Drop for Stranger {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Waits until `pid` runs; asserts it did not before `deadline_ns`, and prints how late it was.
fn assert_runs_at_deadline(pid: u32, deadline_ns: u64, what: &str, logs: impl Fn() -> String) {
    assert_eq!(state(pid), Some('T'), "{what}: still held before its deadline\n{}", logs());
    let ran = wait_running(pid, HANG_GUARD + Duration::from_secs(10));
    let ran = ran.unwrap_or_else(|| panic!("{what}: left stopped past its deadline\n{}", logs()));
    println!("{what}: ran {} ms after its deadline", ran.saturating_sub(deadline_ns) as f64 / 1e6);
    assert!(
        ran >= deadline_ns,
        "{what}: released {} ms before its deadline\n{}",
        (deadline_ns - ran) as f64 / 1e6,
        logs()
    );
}

#[test]
fn deadline_kept_by_a_restarted_agent_while_the_api_refuses_everything() {
    let _serial = serial();
    let node = Node::new().expect("node");
    let mut agent = node.start_agent(&[]).expect("agent");
    let (job, held) = hold_one(&node, &agent, "outage", "6s");
    assert_eq!(held.deadline_ns - held.ktime_ns, 6_000_000_000, "the record carries the pod's 6 s hold timeout");
    let stranger = Stranger::recorded_in(node.pin_dir(), held.cgroup_id);
    agent.stop(libc::SIGKILL, HANG_GUARD).expect("kill the agent");
    // The case: the successor starts into an API that answers 503 to everything.
    node.api.set_fault(Fault::Status { code: 503, verbs: Vec::new(), until: None });
    let agent = node.spawn_agent(&[]).expect("second agent");
    assert_runs_at_deadline(app_pid(&job), held.deadline_ns, "held app, API down", || agent.log_text());
    assert!(
        eventually(HANG_GUARD, || agent.log_text().contains("released a held app at its deadline")),
        "the agent's deadline keeper released it\n{}",
        agent.log_text()
    );
    assert!(record(node.pin_dir(), app_pid(&job)).is_none(), "its record dropped once released");
    stranger.assert_left_alone(node.pin_dir(), || agent.log_text());
    node.api.clear_faults();
}

#[test]
fn deadline_kept_by_the_second_container_while_no_agent_runs() {
    let _serial = serial();
    let node = Node::new().expect("node");
    let mut keeper = node.start_deadline_keeper().expect("deadline keeper");
    let mut agent = node.start_agent(&[]).expect("agent");
    let (job, held) = hold_one(&node, &agent, "crashloop", "4s");
    let stranger = Stranger::recorded_in(node.pin_dir(), held.cgroup_id);
    // A crash loop: the agent dies and is not back before the deadline.
    agent.stop(libc::SIGKILL, HANG_GUARD).expect("kill the agent");
    assert_runs_at_deadline(app_pid(&job), held.deadline_ns, "held app, no agent", || keeper.log_text());
    assert!(
        eventually(HANG_GUARD, || keeper.log_text().contains("released a held app at its deadline")),
        "{}",
        keeper.log_text()
    );
    stranger.assert_left_alone(node.pin_dir(), || keeper.log_text());
    let status = keeper.stop().expect("stop the keeper");
    assert!(status.is_some_and(|s| s.success()), "the keeper stops at SIGTERM: {status:?}\n{}", keeper.log_text());
}

#[test]
fn deadline_keeper_releases_every_hold_at_sigterm() {
    let _serial = serial();
    let node = Node::new().expect("node");
    let mut keeper = node.start_deadline_keeper().expect("deadline keeper");
    let mut agent = node.start_agent(&[]).expect("agent");
    let (job, _) = hold_one(&node, &agent, "uninstall", "1h");
    agent.stop(libc::SIGKILL, HANG_GUARD).expect("kill the agent");
    // The DaemonSet is deleted while its agent is down: the pod's containers get SIGTERM.
    let status = keeper.stop().expect("stop the keeper");
    assert!(status.is_some_and(|s| s.success()), "{status:?}\n{}", keeper.log_text());
    assert_ne!(state(app_pid(&job)), Some('T'), "an uninstall left the app stopped\n{}", keeper.log_text());
}

#[test]
fn deadline_of_a_record_in_the_previous_format_is_kept_across_an_upgrade() {
    let _serial = serial();
    let node = Node::new().expect("node");
    // The pin directory the previous agent left, with its record of one held app: a Job whose
    // app was stopped (by the test here, by the kernel then).
    std::fs::create_dir_all(node.pin_dir()).expect("pin dir on bpffs");
    let never = node.scratch.path("never");
    let marker = node.scratch.path("marker");
    let mut job = node.job_pod(held_spec("upgrade", &never, "8s")).expect("pod");
    job.run_app("app", &format!("sleep 1; echo ran > {}; exec sleep 0.3", marker.display())).expect("app");
    let pid = app_pid(&job);
    // SAFETY: plain syscall to the test's own app (a namespace's init ignores a stop from inside).
    unsafe { libc::kill(pid as i32, libc::SIGSTOP) };
    assert!(eventually(HANG_GUARD, || state(pid) == Some('T')), "the app stopped");
    let cgroup_id = valet_sim::node::cgroup_id(&job.apps[0].container().cgroup).expect("cgroup id");
    let mut v1 = pins::pin_held_v1(&node.pin_dir().join(PIN_HELD_V1));
    let ktime_ns = monotonic_ns();
    v1.insert(pid, HeldRecordV1 { cgroup_id, ktime_ns }, 0).expect("v1 record");
    // Beside it, an old record due at once (stopped 8 s ago) naming a process outside the app's
    // cgroup: a keeper that signals an old record's pid with no cgroup check releases it.
    let stranger = Stranger::stopped();
    let stale = HeldRecordV1 { cgroup_id, ktime_ns: ktime_ns.saturating_sub(8_000_000_000) };
    v1.insert(stranger.pid(), stale, 0).expect("the stranger's v1 record");
    drop(v1);
    // The new version starts with the API down, and the pod's 8 s hold timeout as the one old
    // records get (they carry none).
    node.api.set_fault(Fault::Status { code: 503, verbs: Vec::new(), until: None });
    let agent = node.spawn_agent(&["--old-record-timeout", "8s"]).expect("the new version");
    let deadline_ns = ktime_ns + 8_000_000_000;
    assert!(
        eventually(HANG_GUARD, || !node.pin_dir().join(PIN_HELD_V1).exists()),
        "the old pin moved into the new one\n{}",
        agent.log_text()
    );
    let moved = record(node.pin_dir(), pid);
    assert_eq!(moved, Some(HeldRecord { cgroup_id, ktime_ns, deadline_ns }), "{}", agent.log_text());
    assert_runs_at_deadline(pid, deadline_ns, "v1 record", || agent.log_text());
    assert!(eventually(HANG_GUARD, || marker.exists()), "the app ran");
    stranger.assert_left_alone(node.pin_dir(), || agent.log_text());
    node.api.clear_faults();
}

#[test]
fn deadline_without_a_pinned_record_means_no_hold() {
    let _serial = serial();
    let node = Node::new().expect("node");
    // A pin directory off bpffs: the record of holds would die with the agent.
    let off_bpffs = node.scratch.path("not-bpffs");
    let agent = node.start_agent(&["--pin-dir", off_bpffs.to_str().expect("utf-8")]).expect("agent");
    let never = node.scratch.path("never");
    let marker = node.scratch.path("marker");
    let mut job = node.job_pod(held_spec("unpinned", &never, "1h")).expect("pod");
    assert!(
        eventually(HANG_GUARD, || node.events_for(&job).iter().any(|(reason, _)| reason == "HoldUnavailable")),
        "an Event says why the app is not held: {:?}\n{}",
        node.events_for(&job),
        agent.log_text()
    );
    job.run_app("app", &format!("echo ran > {}; exec sleep 0.3", marker.display())).expect("app");
    assert!(eventually(HANG_GUARD, || marker.exists()), "the app ran without its proxy\n{}", agent.log_text());
    assert_eq!(agent.metric("valet_app_holds_total "), 0.0);
    assert!(agent.metric("valet_app_holds_refused_total ") >= 1.0, "{}", agent.log_text());
}
