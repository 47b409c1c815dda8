//! Privileged tests of the kernel programs: real programs, real cgroups in the kubelet's
//! layouts, real processes, exact events.

use std::process::Command;
use std::time::{Duration, Instant};

use valet_agent::kernel::{Attach, Event, EventStream, ProcessEnd, ProcessExit, Programs};
use valet_common::watch_flags;
use valet_tests::cgroups::{TestCgroups, require_root};

const SYSTEMD_POD: &str = "kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{U}.slice";
const CGROUPFS_POD: &str = "kubepods/burstable/pod{U}";

fn uid() -> String {
    let n = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let x = n.as_nanos() as u64 ^ ((std::process::id() as u64) << 20);
    format!(
        "{:08x}-{:04x}-4{:03x}-8{:03x}-{:012x}",
        x as u32,
        (x >> 32) as u16,
        x & 0xfff,
        (x >> 12) & 0xfff,
        x & 0xffff_ffff_ffff
    )
}

fn container_id(n: u8) -> String {
    format!("{:02x}", n).repeat(32)
}

struct Pod {
    cgroups: TestCgroups,
    pod_rel: String,
    container_rel: String,
}

fn make_pod(systemd: bool, n: u8) -> Pod {
    let mut cgroups = TestCgroups::new().expect("cgroup2 root");
    let u = uid();
    let (pod_rel, container_rel) = if systemd {
        let pod = SYSTEMD_POD.replace("{U}", &u.replace('-', "_"));
        let c = format!("{pod}/cri-containerd-{}.scope", container_id(n));
        (pod, c)
    } else {
        let pod = CGROUPFS_POD.replace("{U}", &u);
        let c = format!("{pod}/{}", container_id(n));
        (pod, c)
    };
    cgroups.create(&container_rel).expect("create container cgroup");
    Pod { cgroups, pod_rel, container_rel }
}

fn load() -> (Programs, EventStream) {
    require_root();
    let mut programs = Programs::load(std::path::Path::new("/"), Attach::default()).expect("load programs");
    let ring = programs.take_events().expect("ring buffer");
    let stream = EventStream::new(ring).expect("event stream");
    (programs, stream)
}

/// Collects exit events from `cgroup` until `want` arrived or `wait` passed.
async fn exits(stream: &mut EventStream, cgroup: u64, want: usize, wait: Duration) -> Vec<ProcessExit> {
    let deadline = Instant::now() + wait;
    let mut out = Vec::new();
    while out.len() < want {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break;
        }
        match tokio::time::timeout(left, stream.next_batch()).await {
            Ok(Ok(batch)) => out.extend(batch.into_iter().filter_map(|e| match e {
                Event::Exit(x) if x.cgroup_id == cgroup => Some(x),
                _ => None,
            })),
            Ok(Err(e)) => panic!("event stream: {e}"),
            Err(_) => break,
        }
    }
    out
}

async fn run_and_expect(systemd: bool, n: u8, cmd: &mut Command, expect: ProcessEnd) {
    let (mut programs, mut stream) = load();
    let pod = make_pod(systemd, n);
    let pod_id = pod.cgroups.id(&pod.pod_rel).expect("pod id");
    let container_id = pod.cgroups.id(&pod.container_rel).expect("container id");
    programs.watch(pod_id, watch_flags::EXITS).expect("watch");
    let mut child = pod.cgroups.spawn_in(&pod.container_rel, cmd).expect("spawn");
    let pid = child.id();
    let got = exits(&mut stream, container_id, 1, Duration::from_secs(5)).await;
    let _ = child.wait();
    assert_eq!(got.len(), 1, "exactly one exit event: {got:?}");
    let exit = &got[0];
    assert_eq!(exit.tgid, pid);
    assert_eq!(exit.end, Some(expect));
    assert_eq!(exit.watched_cgroup_id, pod_id, "matched through the pod cgroup (an ancestor)");
    assert!(!exit.ns_init, "not in its own pid namespace");
    assert!(!exit.child_pid_ns, "in the host's pid namespace");
    // Nothing else arrives for that cgroup.
    assert!(exits(&mut stream, container_id, 1, Duration::from_millis(200)).await.is_empty());
}

#[tokio::test]
async fn exit_zero_systemd_layout() {
    run_and_expect(true, 1, &mut Command::new("/bin/true"), ProcessEnd::Exited(0)).await;
}

#[tokio::test]
async fn exit_42_cgroupfs_layout() {
    run_and_expect(false, 2, Command::new("/bin/sh").args(["-c", "exit 42"]), ProcessEnd::Exited(42)).await;
}

#[tokio::test]
async fn killed_by_sigkill() {
    run_and_expect(
        true,
        3,
        Command::new("/bin/sh").args(["-c", "kill -KILL $$"]),
        ProcessEnd::Signaled { signal: 9, core_dumped: false },
    )
    .await;
}

#[tokio::test]
async fn killed_by_sigterm() {
    run_and_expect(
        false,
        4,
        Command::new("/bin/sh").args(["-c", "kill -TERM $$"]),
        ProcessEnd::Signaled { signal: 15, core_dumped: false },
    )
    .await;
}

#[tokio::test]
async fn multithreaded_process_reports_once_when_workers_exit_first() {
    // Worker threads exit first (thread exits, not process exits); then the process exits 5.
    run_and_expect(
        true,
        5,
        Command::new(env!("CARGO_BIN_EXE_valet-test-threads")).arg("workers-first"),
        ProcessEnd::Exited(5),
    )
    .await;
}

#[tokio::test]
async fn multithreaded_process_reports_once_when_the_leader_exits_first() {
    // The main thread ends alone; the process ends when the last worker calls exit(6).
    run_and_expect(
        false,
        11,
        Command::new(env!("CARGO_BIN_EXE_valet-test-threads")).arg("leader-first"),
        ProcessEnd::Exited(6),
    )
    .await;
}

#[tokio::test]
async fn pid_namespace_init_is_the_container_end_and_children_are_not() {
    let (mut programs, mut stream) = load();
    let pod = make_pod(false, 6);
    let pod_id = pod.cgroups.id(&pod.pod_rel).expect("pod id");
    let container_id = pod.cgroups.id(&pod.container_rel).expect("container id");
    programs.watch(pod_id, watch_flags::EXITS).expect("watch");
    // unshare (host pid ns) forks pid 1 of a new namespace (sh), which runs a child that exits 7
    // first, then exits 3 itself.
    let mut child = pod
        .cgroups
        .spawn_in(
            &pod.container_rel,
            Command::new("unshare").args([
                "--pid",
                "--fork",
                "/bin/sh",
                "-c",
                "/bin/sh -c 'exit 7'; sleep 0.05; exit 3",
            ]),
        )
        .expect("spawn");
    let unshare_pid = child.id();
    // Events: the child (exit 7), sleep (exit 0), the namespace init (exit 3), unshare.
    let got = exits(&mut stream, container_id, 4, Duration::from_secs(5)).await;
    let _ = child.wait();
    assert_eq!(got.len(), 4, "child, sleep, init and unshare: {got:?}");
    let inner = &got[0];
    assert_eq!(inner.end, Some(ProcessEnd::Exited(7)));
    assert!(!inner.ns_init, "a child of the init is not the container's end");
    assert_eq!(inner.ns_pid, 2);
    assert_eq!(got[1].end, Some(ProcessEnd::Exited(0)));
    assert!(!got[1].ns_init);
    let init = &got[2];
    assert_eq!(init.end, Some(ProcessEnd::Exited(3)));
    assert!(init.ns_init, "pid 1 of the namespace");
    assert_eq!(init.ns_pid, 1);
    assert_eq!(got.iter().filter(|e| e.ns_init).count(), 1, "one container end");
    assert!(inner.child_pid_ns && got[1].child_pid_ns && init.child_pid_ns, "inside the new namespace");
    let outer = &got[3];
    assert!(!outer.child_pid_ns, "unshare itself runs in the host's namespace");
    assert_eq!(outer.tgid, unshare_pid);
    assert!(!outer.ns_init);
    assert!(inner.ktime_ns < init.ktime_ns && init.ktime_ns <= outer.ktime_ns);
}

#[tokio::test]
async fn no_events_from_unregistered_cgroups() {
    let (mut programs, mut stream) = load();
    let watched = make_pod(true, 7);
    let other = make_pod(true, 8);
    let watched_pod = watched.cgroups.id(&watched.pod_rel).expect("id");
    programs.watch(watched_pod, watch_flags::EXITS).expect("watch");
    let other_container = other.cgroups.id(&other.container_rel).expect("id");
    for _ in 0..20 {
        let mut c = other.cgroups.spawn_in(&other.container_rel, &mut Command::new("/bin/true")).expect("spawn");
        let _ = c.wait();
    }
    // Processes outside any pod cgroup (this test's own children) are not reported either.
    for _ in 0..20 {
        let _ = Command::new("/bin/true").status();
    }
    let deadline = Instant::now() + Duration::from_millis(500);
    let mut seen = Vec::new();
    while let Ok(Ok(batch)) =
        tokio::time::timeout(deadline.saturating_duration_since(Instant::now()), stream.next_batch()).await
    {
        seen.extend(batch);
    }
    assert!(seen.is_empty(), "no events at all, got {seen:?}");
    assert_eq!(programs.counter(valet_common::Counter::ExitsReported), 0);
    let _ = other_container;
    // And unwatching stops reporting the watched pod too.
    programs.unwatch(watched_pod).expect("unwatch");
    let watched_container = watched.cgroups.id(&watched.container_rel).expect("id");
    let mut c = watched.cgroups.spawn_in(&watched.container_rel, &mut Command::new("/bin/true")).expect("spawn");
    let _ = c.wait();
    assert!(exits(&mut stream, watched_container, 1, Duration::from_millis(300)).await.is_empty());
}

#[tokio::test]
async fn exec_hold_stops_the_container_init_before_it_runs() {
    let (mut programs, mut stream) = load();
    let pod = make_pod(true, 9);
    let pod_id = pod.cgroups.id(&pod.pod_rel).expect("pod id");
    let container_id = pod.cgroups.id(&pod.container_rel).expect("container id");
    programs.watch(pod_id, watch_flags::EXITS | watch_flags::HOLD).expect("watch");
    let dir = std::env::temp_dir().join(format!("valet-hold-{}", std::process::id()));
    let _ = std::fs::remove_file(&dir);
    let script = format!("echo ran > {}; exit 4", dir.display());
    let mut child = pod
        .cgroups
        .spawn_in(&pod.container_rel, Command::new("unshare").args(["--pid", "--fork", "/bin/sh", "-c", &script]))
        .expect("spawn");
    // The held event names the namespace init.
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut held = None;
    while held.is_none() && Instant::now() < deadline {
        if let Ok(Ok(batch)) = tokio::time::timeout(Duration::from_secs(5), stream.next_batch()).await {
            held = batch.into_iter().find_map(|e| match e {
                Event::Held(h) if h.cgroup_id == container_id => Some(h),
                _ => None,
            });
        }
    }
    let held = held.expect("held event");
    std::thread::sleep(Duration::from_millis(300));
    assert!(!dir.exists(), "the held process must not have run");
    let state = std::fs::read_to_string(format!("/proc/{}/stat", held.tgid)).expect("stat");
    let state = state.rsplit(')').next().and_then(|s| s.split_whitespace().next()).map(str::to_owned);
    assert_eq!(state.as_deref(), Some("T"), "stopped");
    // SAFETY: plain syscall.
    assert_eq!(unsafe { libc::kill(held.tgid as i32, libc::SIGCONT) }, 0);
    let got = exits(&mut stream, container_id, 2, Duration::from_secs(5)).await;
    let _ = child.wait();
    assert!(dir.exists(), "released process ran");
    let _ = std::fs::remove_file(&dir);
    let init = got.iter().find(|e| e.ns_init).expect("init exit");
    assert_eq!(init.end, Some(ProcessEnd::Exited(4)));
    assert_eq!(programs.counter(valet_common::Counter::Held), 1);
}

#[tokio::test]
async fn exec_hold_skips_cgroups_classified_as_pass() {
    let (mut programs, mut stream) = load();
    let pod = make_pod(false, 10);
    let pod_id = pod.cgroups.id(&pod.pod_rel).expect("pod id");
    let container_id = pod.cgroups.id(&pod.container_rel).expect("container id");
    programs.watch(pod_id, watch_flags::EXITS | watch_flags::HOLD).expect("watch");
    programs.classify_exec(container_id, false).expect("classify");
    let started = Instant::now();
    let mut child = pod
        .cgroups
        .spawn_in(&pod.container_rel, Command::new("unshare").args(["--pid", "--fork", "/bin/sh", "-c", "exit 0"]))
        .expect("spawn");
    let status = child.wait().expect("wait");
    assert!(status.success());
    assert!(started.elapsed() < Duration::from_secs(5));
    let got = exits(&mut stream, container_id, 2, Duration::from_secs(2)).await;
    assert!(got.iter().any(|e| e.ns_init), "ran to completion: {got:?}");
    assert_eq!(programs.counter(valet_common::Counter::Held), 0);
}
