//! What the kernel suite (tests/tests/kernel.rs) runs its scenarios on: pods and containers as a
//! runtime makes them (cgroups in the kubelet's layouts, the container's main process in a pid
//! namespace of its own or the pod's), the programs loaded each way they find pod cgroups, their
//! events collected, the processes reaped.
use std::path::Path;
use std::process::{Child, Command};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use valet_agent::cgroup::root::{Controller, Hierarchy};
use valet_agent::kernel::programs::{AncestorMode, RecordOutcome};
use valet_agent::kernel::{Attach, Event, EventStream, HeldProcess, ProcessEnd, ProcessExit, Programs};
use valet_common::{ContainerMain, Counter, container_flags, watch_flags};

use crate::cgroups::{TestCgroups, require_root};

pub const SYSTEMD_POD: &str = "kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{U}.slice";
pub const CGROUPFS_POD: &str = "kubepods/burstable/pod{U}";
/// Only a guard against a hang: the tests wait for events. "Nothing else was reported" is read
/// from the programs' exact counters once every process that could be reported was reaped (the
/// exit tracepoint fires before a parent can reap the process), not from a quiet moment.
pub const WAIT: Duration = Duration::from_secs(30);

pub fn uid() -> String {
    static SEQ: AtomicU32 = AtomicU32::new(0);
    let n = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let x = n.as_nanos() as u64
        ^ ((std::process::id() as u64) << 20)
        ^ ((SEQ.fetch_add(1, Ordering::Relaxed) as u64) << 40);
    format!(
        "{:08x}-{:04x}-4{:03x}-8{:03x}-{:012x}",
        x as u32,
        (x >> 32) as u16,
        x & 0xfff,
        (x >> 12) & 0xfff,
        x & 0xffff_ffff_ffff
    )
}

pub fn container_id(n: u8) -> String {
    format!("{:02x}", n).repeat(32)
}

pub struct Pod {
    pub cgroups: TestCgroups,
    pub systemd: bool,
    pub pod_rel: String,
    pub container_rel: String,
}

impl Pod {
    pub fn new(way: Way, systemd: bool, n: u8) -> Pod {
        let cgroups = TestCgroups::in_hierarchy(way.hierarchy).expect("the hierarchy's root");
        let u = uid();
        let pod_rel =
            if systemd { SYSTEMD_POD.replace("{U}", &u.replace('-', "_")) } else { CGROUPFS_POD.replace("{U}", &u) };
        let mut pod = Pod { cgroups, systemd, pod_rel, container_rel: String::new() };
        pod.container_rel = pod.add_container(n);
        pod
    }

    /// Creates one more container cgroup in the pod; returns its relative path.
    pub fn add_container(&mut self, n: u8) -> String {
        let rel = if self.systemd {
            format!("{}/cri-containerd-{}.scope", self.pod_rel, container_id(n))
        } else {
            format!("{}/{}", self.pod_rel, container_id(n))
        };
        self.cgroups.create(&rel).expect("create container cgroup");
        rel
    }

    pub fn id(&self, rel: &str) -> u64 {
        self.cgroups.id(rel).expect("cgroup id")
    }

    pub fn pod_id(&self) -> u64 {
        self.id(&self.pod_rel)
    }

    pub fn container(&self) -> u64 {
        self.id(&self.container_rel)
    }

    /// Starts a container in `rel` with its own pid namespace, whose main process runs `main`.
    pub fn start(&self, rel: &str, main: &[&str]) -> Child {
        let mut cmd = Command::new("unshare");
        cmd.args(["--pid", "--fork", "--"]).args(main);
        self.cgroups.spawn_in(rel, &mut cmd).expect("spawn container")
    }

    /// Starts a container in `rel` whose main process joins the pid namespace of `pid`
    /// (shareProcessNamespace: the pod's pid 1 is the sandbox's pause).
    pub fn start_shared(&self, rel: &str, pid: u32, main: &[&str]) -> Child {
        let mut cmd = Command::new("nsenter");
        cmd.arg(format!("--pid=/proc/{pid}/ns/pid")).arg("--").args(main);
        self.cgroups.spawn_in(rel, &mut cmd).expect("spawn container")
    }
}

/// The running kernel's (major, minor).
pub fn kernel_version() -> (u32, u32) {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").expect("osrelease");
    let mut parts = release.trim().split(|c: char| !c.is_ascii_digit()).filter_map(|p| p.parse().ok());
    (parts.next().unwrap_or(0), parts.next().unwrap_or(0))
}

/// Tracepoint programs may call `bpf_get_current_ancestor_cgroup_id` from 5.11 on.
pub fn kernel_allows_the_helper() -> bool {
    kernel_version() >= (5, 11)
}

/// How a scenario's programs find pod cgroups, and in which hierarchy its cgroups are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Way {
    pub ancestors: AncestorMode,
    pub hierarchy: Hierarchy,
}

impl Way {
    pub const HELPER: Way = Way { ancestors: AncestorMode::Helper, hierarchy: Hierarchy::V2 };
    pub const WALK: Way = Way { ancestors: AncestorMode::Walk, hierarchy: Hierarchy::V2 };
    /// A cgroup v1 (or hybrid) node: pods in the pids controller's hierarchy, which the walk
    /// reads from `task->cgroups->subsys[pids]`.
    pub const V1: Way = Way { ancestors: AncestorMode::Walk, hierarchy: Hierarchy::V1(Controller::Pids) };

    /// A word for file names and messages.
    pub fn tag(self) -> &'static str {
        match (self.ancestors, self.hierarchy) {
            (_, Hierarchy::V1(_)) => "v1",
            (AncestorMode::Helper, _) => "helper",
            _ => "walk",
        }
    }
}

pub fn load(way: Way) -> (Programs, EventStream) {
    load_with(way, None)
}

/// Loads the programs; `host_pidns_of`: a process whose pid namespace plays the host's.
pub fn load_with(way: Way, host_pidns_of: Option<u32>) -> (Programs, EventStream) {
    require_root();
    let mode = way.ancestors;
    let attach = Attach { ancestors: mode, host_pidns_of, hierarchy: way.hierarchy, ..Attach::default() };
    let mut programs = if mode == AncestorMode::Helper && !kernel_allows_the_helper() {
        // 5.10: the verifier must refuse the helper variant, and `Auto` must fall back to the
        // walk; the scenario then runs with what production would load.
        let refused = Programs::load(Path::new("/"), attach).err().expect("the helper variant is refused before 5.11");
        eprintln!("kernel {:?}: helper variant refused ({refused}); scenario runs with Auto", kernel_version());
        let programs =
            Programs::load(Path::new("/"), Attach { ancestors: AncestorMode::Auto, ..attach }).expect("load");
        assert_eq!(programs.ancestor_mode(), AncestorMode::Walk, "Auto falls back to the walk");
        programs
    } else {
        let programs = Programs::load(Path::new("/"), attach).expect("load programs");
        assert_eq!(programs.ancestor_mode(), mode, "the variant asked for is the one attached");
        programs
    };
    let ring = programs.take_events().expect("ring buffer");
    let stream = EventStream::new(ring).expect("event stream");
    (programs, stream)
}

/// Collects events until `want` of them match `keep` or `wait` passed.
pub async fn collect<T>(
    stream: &mut EventStream,
    want: usize,
    wait: Duration,
    keep: impl Fn(Event) -> Option<T>,
) -> Vec<T> {
    let deadline = Instant::now() + wait;
    let mut out = Vec::new();
    while out.len() < want {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        match tokio::time::timeout(left, stream.next_batch()).await {
            Ok(Ok(batch)) => out.extend(batch.into_iter().filter_map(&keep)),
            Ok(Err(e)) => panic!("event stream: {e}"),
            Err(_) => break,
        }
    }
    out
}

/// Collects exit events from `cgroup` until `want` arrived or `wait` passed.
pub async fn exits(stream: &mut EventStream, cgroup: u64, want: usize, wait: Duration) -> Vec<ProcessExit> {
    collect(stream, want, wait, |e| match e {
        Event::Exit(x) if x.cgroup_id == cgroup => Some(x),
        _ => None,
    })
    .await
}

/// Waits for the kernel's record of a container's main process.
pub async fn recorded_main(programs: &Programs, cgroup: u64) -> ContainerMain {
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(main) = programs.container_main(cgroup) {
            return main;
        }
        assert!(Instant::now() < deadline, "no main process recorded for cgroup {cgroup}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits for a spawned runtime process (bounded: a hang fails the test with what still runs
/// and in which state, instead of hanging the run).
pub fn reap(child: &mut Child) -> std::process::ExitStatus {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return status,
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
            Ok(None) => {
                let mut tree = Vec::new();
                let mut todo = vec![child.id()];
                while let Some(pid) = todo.pop() {
                    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
                    tree.push(format!("{pid} {:?}", nspid_or_empty(pid)) + " " + stat.trim());
                    todo.extend(children(pid));
                }
                let _ = child.kill();
                panic!("process {} still runs after 30 s: {tree:#?}", child.id());
            }
            Err(e) => panic!("wait {}: {e}", child.id()),
        }
    }
}

/// Like [`reap`] for `nsenter`, which stops itself when its child is stopped (util-linux
/// propagates job control) and stays stopped after the child is continued: continue it too.
/// (A real runtime does no such thing.)
pub fn reap_nsenter(child: &mut Child) -> std::process::ExitStatus {
    let deadline = Instant::now() + Duration::from_secs(30);
    while Instant::now() < deadline {
        if let Ok(Some(status)) = child.try_wait() {
            return status;
        }
        let stat = std::fs::read_to_string(format!("/proc/{}/stat", child.id())).unwrap_or_default();
        if stat.rsplit(')').next().and_then(|s| s.split_whitespace().next()) == Some("T") {
            kill(child.id(), libc::SIGCONT);
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    reap(child)
}

pub fn nspid_or_empty(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))
        .map(|l| l.split_whitespace().filter_map(|p| p.parse().ok()).collect())
        .unwrap_or_default()
}

pub fn kill(pid: u32, signal: i32) {
    // SAFETY: plain syscall.
    assert_eq!(unsafe { libc::kill(pid as i32, signal) }, 0, "kill {pid}");
}

pub fn nspid(pid: u32) -> Vec<u32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    let line = status.lines().find_map(|l| l.strip_prefix("NSpid:")).expect("NSpid");
    line.split_whitespace().map(|p| p.parse().expect("pid")).collect()
}

pub fn children(pid: u32) -> Vec<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .collect()
}

/// The only child of `pid` (the process an `unshare --fork` or `nsenter` started), once it is
/// there and has exec'd away from its parent's `comm`.
pub async fn only_child(pid: u32) -> u32 {
    let parent = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
    let deadline = Instant::now() + WAIT;
    loop {
        if let [child] = children(pid)[..]
            && std::fs::read_to_string(format!("/proc/{child}/comm")).is_ok_and(|c| c != parent)
        {
            return child;
        }
        assert!(Instant::now() < deadline, "no child of {pid}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The first held event (of `cgroup` when given) within the hang guard; empty when none came.
pub async fn held(stream: &mut EventStream, cgroup: Option<u64>) -> Vec<HeldProcess> {
    collect(stream, 1, WAIT, |e| match e {
        Event::Held(h) if cgroup.is_none_or(|c| h.cgroup_id == c) => Some(h),
        _ => None,
    })
    .await
}

/// Waits until `pid` is stopped (state `T`): the hold's signal takes effect as the exec returns,
/// before any of its code runs.
pub async fn wait_stopped(pid: u32) {
    let state = || {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("stat");
        stat.rsplit(')').next().and_then(|s| s.split_whitespace().next()).map(str::to_owned)
    };
    let deadline = Instant::now() + WAIT;
    while state().as_deref() != Some("T") {
        assert!(Instant::now() < deadline, "never stopped: {:?}", state());
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Fills the containers map with records of cgroup ids no cgroup has (the highest ids); how many
/// it took.
pub fn fill_containers_map(programs: &mut Programs) -> u64 {
    let filler = valet_agent::host::container_main::MainProcess {
        tgid: 1,
        ns_depth: 1,
        ns_init: true,
        pidns_inum: 0,
        start_ticks: 0,
    };
    let mut n = 0u64;
    loop {
        match programs.record_container_main(u64::MAX - n, &filler).expect("record") {
            RecordOutcome::Recorded => n += 1,
            RecordOutcome::MapFull => break,
            RecordOutcome::AlreadyRecorded => panic!("fresh key {n} already recorded"),
        }
        assert!(n <= u64::from(valet_common::CONTAINERS_CAPACITY), "the map never fills");
    }
    n
}

/// Runs a container whose main process runs `main` (killed with `signal` from the host when
/// given) and expects exactly one exit event: its main process's, with `expect`.
pub async fn run_and_expect(mode: Way, systemd: bool, n: u8, main: &[&str], signal: Option<i32>, expect: ProcessEnd) {
    let (mut programs, mut stream) = load(mode);
    let pod = Pod::new(mode, systemd, n);
    let container = pod.container();
    programs.watch(pod.pod_id(), watch_flags::EXITS).expect("watch");
    let mut child = pod.start(&pod.container_rel, main);
    let runtime_pid = child.id();
    let record = recorded_main(&programs, container).await;
    assert_ne!(record.tgid, runtime_pid, "the runtime's exec in the host namespace is not the main");
    assert_eq!(record.pidns_depth, 1);
    assert_eq!(record.flags, container_flags::BY_EXEC | container_flags::NS_INIT);
    assert_ne!(record.pidns_inum, 0);
    if let Some(signal) = signal {
        kill(record.tgid, signal);
    }
    let got = exits(&mut stream, container, 1, WAIT).await;
    reap(&mut child);
    assert_eq!(got.len(), 1, "exactly one exit event: {got:?}");
    let exit = &got[0];
    assert_eq!(exit.tgid, record.tgid);
    assert_eq!(exit.end, Some(expect));
    assert_eq!(exit.watched_cgroup_id, pod.pod_id(), "matched through the pod cgroup (an ancestor)");
    assert!(exit.container_main && exit.ns_init && exit.child_pid_ns, "{exit:?}");
    assert_eq!(exit.ns_pid, 1);
    // The container cgroup's own name, read by the kernel at the end (in the hierarchy watched).
    let name = pod.container_rel.rsplit('/').next().map(str::to_owned);
    assert_eq!(exit.cgroup_name, name, "{exit:?}");
    // Nothing else arrives for that cgroup: the runtime process's exit is filtered.
    assert_eq!(programs.counter(Counter::ExitsReported), 1);
    assert!(programs.counter(Counter::ExitsFiltered) >= 1, "the runtime process (unshare) exit");
    assert_eq!(programs.counter(Counter::EventsLost), 0);
}
