//! The agent binary under exactly the capabilities `deploy/base/daemonset.yaml` adds, as a
//! container runtime gives them to a root container with `drop: [ALL]` and
//! `allowPrivilegeEscalation: false`: uid 0, those capabilities in the bounding, permitted and
//! effective sets and nothing else, no inheritable or ambient ones, no_new_privs. `setpriv`
//! (util-linux) sets that up. Then each capability is dropped in turn and the thing it is for
//! breaks: it is needed. Where the kernel programs then cannot load, the agent does not exit: it
//! stays up, degraded (issue 34), and says why on `/metrics` (`valet_node_info`) and in its log;
//! the tests check that reason. Those reasons (`bpf_denied`, `memlock`) are ones a release can
//! cause, which `--degraded-ok` does not expect by default: `/readyz` fails and says so.
//!
//! - SYS_ADMIN: entering a pod's network namespace (setns) to quit its proxy; also loading
//!   the tracing programs (it implies CAP_BPF and CAP_PERFMON, so those two add nothing and
//!   are not in the DaemonSet: shown by the agent working without them). BPF and PERFMON
//!   alone load them too, except on Debian's kernels (5.10, 6.1, 6.12 in qemu), whose
//!   perf_event_paranoid 3 asks CAP_SYS_ADMIN for perf_event_open itself.
//! - SYS_PTRACE: opening `/proc/<pid>/ns/net` of a pod process (a ptrace read check).
//! - KILL: SIGCONT to a held app of another uid (in its own session).
//! - SYS_NICE: the release thread's real-time class (SCHED_FIFO 1), so that the apps it wakes
//!   do not take its CPU before the rest of a batch is out; without it the thread keeps the
//!   normal class and the apps are released all the same.
//! - SYS_RESOURCE: lifting RLIMIT_MEMLOCK, which kernels older than 5.11 charge BPF maps and
//!   programs to (summed over every process of the user); 5.11+ charge the memory cgroup.
//!   The agent is run without it under the limits a container inherits (64 KiB: systemd
//!   < 253 and kernels < 5.16; 8 MiB: later ones). Shown on Debian's 5.10.223 in qemu
//!   (`cargo xtask kernels 5.10`): the agent's maps and programs are charged 6048 KiB; under
//!   64 KiB it fails to load (degraded, `memlock`), under 8 MiB it loads alone but not
//!   beside another root BPF user of that size. On 5.11 and later (6.1, 6.12 in qemu; this host, whose root has no
//!   CAP_SYS_RESOURCE at all) it loads under both.
//!
//! One test at a time: each starts its own agent, and the quit and hold checks time out on a
//! loaded 2-core machine otherwise. `cargo xtask kernels` runs them in each guest too.

use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use valet_sim::node::SpawnOptions;
use valet_tests::capabilities::{manifest_capabilities, with_capabilities};
use valet_tests::harness::{Agent, JobPod, JobSpec, Node, eventually, process_state as state};
use valet_tests::mounts::{any_thread_holds, bound_top_read_only, mounts_below, writes_that_succeed};

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(PoisonError::into_inner)
}

/// How long a "does not happen" check watches.
const QUIET: Duration = Duration::from_secs(2);
/// A hang guard for the agent's start, which loads its programs: parsing BTF and the verifier
/// take tens of seconds in an emulated guest (`cargo xtask kernels`) on a busy machine.
const START: Duration = Duration::from_secs(180);
/// The uid of the apps in these tests (a container's `runAsUser`; istio-proxy is 1337).
const APP_UID: u32 = 65534;

/// Capability numbers (`linux/capability.h`) of the ones this test deals with.
fn cap_bit(name: &str) -> u32 {
    match name {
        "KILL" => 5,
        "SYS_PTRACE" => 19,
        "SYS_ADMIN" => 21,
        "SYS_RESOURCE" => 24,
        "SYS_NICE" => 23,
        "PERFMON" => 38,
        "BPF" => 39,
        other => panic!("capability {other} is not known to this test: add it with a test of what needs it"),
    }
}

/// The capabilities the DaemonSet adds to the agent's container (after `drop: [ALL]`), read from
/// the manifest.
fn daemonset_capabilities() -> Vec<String> {
    manifest_capabilities().swap_remove(0)
}

fn status_field(pid: u32, field: &str) -> Option<String> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix(field).map(|v| v.trim().to_owned()))
}

fn mask(caps: &[&str]) -> u64 {
    caps.iter().fold(0, |m, c| m | 1 << cap_bit(c))
}

/// This process's bounding set: what `setpriv` can keep.
fn own_bounding_set() -> u64 {
    let hex = status_field(std::process::id(), "CapBnd:").expect("CapBnd");
    u64::from_str_radix(&hex, 16).expect("hex")
}

fn kernel_at_least(major: u32, minor: u32) -> bool {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").expect("osrelease");
    let mut parts = release.trim().split(['.', '-']).map(|p| p.parse::<u32>().unwrap_or(0));
    let have = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    have >= (major, minor)
}

/// The RLIMIT_MEMLOCK a container inherits: runc sets none unless the pod spec's runtime does,
/// so it is the one of the runtime's service. 64 KiB: the kernel's default before 5.16 and
/// systemd's before 253 (Debian bullseye's 247, bookworm's 252); 8 MiB: both defaults after.
const INHERITED_MEMLOCK: [u64; 2] = [64 << 10, 8 << 20];

/// `prlimit` arguments that set RLIMIT_MEMLOCK (soft and hard) to `bytes` before what follows
/// runs: the limit a runtime's container starts with, before its capabilities are set.
fn with_memlock(bytes: u64) -> Vec<String> {
    vec!["prlimit".into(), format!("--memlock={bytes}:{bytes}"), "--".into()]
}

/// The agent's soft RLIMIT_MEMLOCK in bytes, `None` for unlimited.
fn memlock_of(pid: u32) -> Option<u64> {
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).expect("limits");
    let line = limits.lines().find(|l| l.starts_with("Max locked memory")).expect("Max locked memory");
    let soft = line.split_whitespace().nth(3).expect("soft limit");
    (soft != "unlimited").then(|| soft.parse().expect("a number"))
}

/// The agent's `BPF memory` log line: (maps, programs) in KiB, as the kernel reports them in
/// fdinfo (`memlock:`), which is what kernels before 5.11 charge to RLIMIT_MEMLOCK.
fn logged_memlock_kib(agent: &Agent) -> Option<(u64, u64)> {
    let log = agent.log_text();
    let line = log.lines().find(|l| l.contains("BPF memory"))?;
    let field = |name: &str| {
        let at = line.find(&format!("{name}="))? + name.len() + 1;
        line[at..].split(|c: char| !c.is_ascii_digit()).next()?.parse::<u64>().ok()
    };
    Some((field("map_kib")?, field("program_kib")?))
}

/// Starts the agent with `caps` and checks the kernel gave it exactly those.
fn start(node: &Node, caps: &[&str]) -> Agent {
    let mut agent = spawn(node, None, caps);
    agent.wait_ready(START).expect("ready");
    agent
}

/// Spawns the agent with `caps` (under RLIMIT_MEMLOCK `memlock` when given, else this process's)
/// and checks, once it runs, that the kernel gave it exactly those capabilities.
fn spawn(node: &Node, memlock: Option<u64>, caps: &[&str]) -> Agent {
    spawn_with(node, memlock, caps, &[])
}

/// [`spawn`] with `extra` flags.
fn spawn_with(node: &Node, memlock: Option<u64>, caps: &[&str], extra: &[&str]) -> Agent {
    let mut wrapper = memlock.map(with_memlock).unwrap_or_default();
    wrapper.extend(with_capabilities(caps));
    let agent = node.spawn_agent_under(&wrapper, extra).expect("spawn agent");
    let pid = agent.pid().expect("pid");
    // The wrappers exec the agent: wait until the agent runs (its first log line; /proc shows
    // the new executable before the exec has given it its capabilities), then read them.
    assert!(
        eventually(START, || agent.log_text().contains("starting valet-agent")),
        "the wrappers did not exec the agent\n{}",
        agent.log_text()
    );
    let want = format!("{:016x}", mask(caps));
    for field in ["CapEff:", "CapPrm:", "CapBnd:"] {
        assert_eq!(status_field(pid, field).as_deref(), Some(want.as_str()), "{field} of the agent");
    }
    for field in ["CapInh:", "CapAmb:"] {
        assert_eq!(status_field(pid, field).as_deref(), Some("0000000000000000"), "{field} of the agent");
    }
    assert_eq!(status_field(pid, "NoNewPrivs:").as_deref(), Some("1"));
    assert_eq!(status_field(pid, "Uid:").map(|u| u.split_whitespace().all(|x| x == "0")), Some(true));
    agent
}

/// Issue 28: the agent's resident memory from its start, loading included (`VmHWM`), at most
/// this. The DaemonSet's memory limit is sized from it (deploy/README.md, docs/dev/memory.md).
const PEAK_RESIDENT_KIB: u64 = 24 << 10;

/// The agent's peak resident memory so far, loading included, fits [`PEAK_RESIDENT_KIB`], and
/// its BPF loader did not parse the kernel's BTF (which alone took ~22 MiB).
fn assert_peak_memory_fits(agent: &Agent) {
    let pid = agent.pid().expect("pid");
    let kib = |field: &str| -> u64 {
        let value = status_field(pid, field).unwrap_or_else(|| panic!("{field} of the agent"));
        value.trim_end_matches("kB").trim().parse().expect("KiB")
    };
    let (peak, now) = (kib("VmHWM:"), kib("VmRSS:"));
    println!("agent resident memory: peak {peak} KiB from start, loading included (VmHWM), now {now} KiB");
    let log = agent.log_text();
    assert!(!log.contains("parsed the kernel's BTF"), "the loader parsed the kernel's BTF\n{log}");
    assert!(peak <= PEAK_RESIDENT_KIB, "peak {peak} KiB > {PEAK_RESIDENT_KIB} KiB\n{log}");
}

/// How the agent serves the node, from `/metrics`: the `(mode, reason)` of the one
/// `valet_node_info` series at 1 (`("kernel", "none")` where its programs run).
fn node_mode(agent: &Agent) -> Option<(String, String)> {
    let text = agent.metrics_text().ok()?;
    let ones: Vec<(String, String)> = text
        .lines()
        .filter_map(|l| {
            let (labels, value) = l.strip_prefix("valet_node_info{")?.split_once("} ")?;
            (value.trim() == "1").then_some(labels)?;
            let label = |name: &str| {
                labels.split(',').find_map(|kv| kv.strip_prefix(name)?.strip_prefix("=\"")?.strip_suffix('"'))
            };
            Some((label("mode")?.to_owned(), label("reason")?.to_owned()))
        })
        .collect();
    assert!(ones.len() <= 1, "one node_info series at 1: {ones:?}\n{text}");
    ones.into_iter().next()
}

/// Issue 34: where the programs cannot load, the agent stays up, degraded for `reason`, and says
/// so on `/metrics` and in one log line; `reason` is not one `--degraded-ok` expects by default,
/// so `/readyz` fails, naming it.
fn assert_degraded(agent: &mut Agent, reason: &str) {
    assert_eq!(node_mode(agent), Some(("degraded".into(), reason.into())), "{}", agent.log_text());
    let log = agent.log_text();
    assert!(
        log.lines().any(|l| l.contains("kernel programs not loaded") && l.contains(&format!("reason=\"{reason}\""))),
        "the log says why\n{log}"
    );
    // Still running, and not ready: a rollout that did this to a node stops there.
    agent.wait_served(START).expect("the agent stays up");
    let (status, body) = agent.get("/readyz").expect("/readyz");
    assert_eq!(status, 503, "{body}");
    assert!(body.contains(&format!("not expected: {reason} (")), "/readyz names {reason}: {body}");
}

/// After the app's exit was seen and no quit arrived: the quit the agent tried, and failed,
/// by its metric label (waits for the agent's retries to end).
fn failed_quit_label(agent: &Agent) -> Option<String> {
    let prefix = "valet_sidecar_quits_total{kind=\"istio\",result=\"";
    let mut found = None;
    eventually(Duration::from_secs(40), || {
        found = agent.metrics_text().unwrap_or_default().lines().find_map(|l| {
            let (label, value) = l.strip_prefix(prefix)?.split_once("\"} ")?;
            (label != "ok" && value.trim() != "0").then(|| label.to_owned())
        });
        found.is_some()
    });
    found
}

fn assert_exit_seen(agent: &Agent) {
    assert!(
        eventually(Duration::from_secs(5), || agent.metric("valet_container_exits_total{outcome=\"Success\"} ") >= 1.0),
        "the agent saw the app's exit (the programs work)\n{}",
        agent.log_text()
    );
}

/// A held Job pod (app runs as [`APP_UID`]); its proxy is ready once `ready` exists.
fn held_pod(node: &Node, name: &str) -> (JobPod, std::path::PathBuf, std::path::PathBuf) {
    let shared = node.scratch.path(&format!("{name}-shared"));
    std::fs::create_dir_all(&shared).expect("mkdir");
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    let ready = shared.join("ready");
    let marker = shared.join("ran");
    let mut spec = JobSpec::new(name).annotation("valet.dev/hold-app", "true");
    spec.ready_file = Some(ready.clone());
    (node.job_pod(spec).expect("pod"), ready, marker)
}

fn run_app_as_other_uid(job: &mut JobPod, marker: &Path) {
    let opts = SpawnOptions { uid: Some(APP_UID), ..SpawnOptions::default() };
    let script = format!("echo ran > {}; sleep 0.2", marker.display());
    job.start_app("app", &["/bin/sh", "-c", &script], &opts).expect("app");
}

/// The app exits; whether its proxy got a quit (from inside the pod) and exited 0.
fn quit_after_app_exit(agent: &Agent, job: &mut JobPod, timeout: Duration) -> bool {
    job.run_app("app", "sleep 0.1; exit 0").expect("app");
    let code = job.wait_proxy_exit(timeout).expect("wait proxy");
    let quits = job.quits();
    assert!(quits.iter().all(|q| q.peer.ip().is_loopback()), "quits from inside the pod only: {quits:?}");
    if code.is_some() {
        assert_eq!(code, Some(0), "{}", agent.log_text());
        assert_eq!(quits.len(), 1, "{quits:?}");
    }
    code.is_some()
}

/// Held at exec and released on readiness, for an app of another uid: needs KILL (and the
/// programs loaded, and the pod's cgroup found).
fn held_then_released(agent: &Agent, node: &Node, name: &str) -> bool {
    let (mut job, ready, marker) = held_pod(node, name);
    agent.wait_tracked(1, Duration::from_secs(10)).expect("tracked");
    run_app_as_other_uid(&mut job, &marker);
    let pid = job.apps[0].host_pid();
    assert!(
        eventually(Duration::from_secs(5), || state(pid) == Some('T')),
        "the app is held at exec\n{}",
        agent.log_text()
    );
    assert!(!marker.exists(), "a held app runs nothing");
    std::fs::write(&ready, "").expect("ready");
    let released = eventually(Duration::from_secs(5), || marker.exists());
    if !released {
        // Leave nothing stopped behind.
        // SAFETY: plain syscall on a process this test started.
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    }
    released
}

/// The DaemonSet's capabilities that this host can give, but `drop`.
fn others(drop: &str) -> Vec<&'static str> {
    let wanted = daemonset_capabilities();
    let bounding = own_bounding_set();
    ["SYS_ADMIN", "SYS_PTRACE", "KILL", "SYS_RESOURCE", "SYS_NICE"]
        .into_iter()
        .filter(|c| *c != drop && wanted.iter().any(|w| w == c) && bounding & (1 << cap_bit(c)) != 0)
        .collect()
}

#[test]
fn the_daemonsets_capabilities_are_enough() {
    let _serial = serial();
    let wanted = daemonset_capabilities();
    let bounding = own_bounding_set();
    let (have, missing): (Vec<&str>, Vec<&str>) =
        wanted.iter().map(String::as_str).partition(|c| bounding & (1 << cap_bit(c)) != 0);
    println!("DaemonSet capabilities {wanted:?}; not in this host's bounding set: {missing:?}");
    // Only SYS_RESOURCE may be missing here, and only where the kernel does not need it.
    assert!(missing.iter().all(|c| *c == "SYS_RESOURCE"), "cannot test without {missing:?}");
    if !missing.is_empty() {
        assert!(kernel_at_least(5, 11), "kernels before 5.11 need SYS_RESOURCE (RLIMIT_MEMLOCK for maps)");
    }
    assert!(!have.contains(&"BPF") && !have.contains(&"PERFMON"), "SYS_ADMIN implies BPF and PERFMON");

    // Under the lowest memlock limit a container inherits: with SYS_RESOURCE the agent lifts it.
    let node = Node::new().expect("node");
    let mut agent = spawn(&node, Some(INHERITED_MEMLOCK[0]), &have);
    agent.wait_ready(START).expect("ready");
    let raised = memlock_of(agent.pid().expect("pid")).is_none();
    assert_eq!(raised, have.contains(&"SYS_RESOURCE"), "RLIMIT_MEMLOCK lifted exactly with SYS_RESOURCE");
    println!("BPF memory of the agent (maps, programs), KiB: {:?}", logged_memlock_kib(&agent));
    let mut job = node.job_pod(JobSpec::new("quit")).expect("pod");
    agent.wait_tracked(1, Duration::from_secs(10)).expect("tracked");
    assert!(quit_after_app_exit(&agent, &mut job, Duration::from_secs(10)), "quit\n{}", agent.log_text());
    assert_peak_memory_fits(&agent);
    // A second node (API server) and agent for the hold, so that the pod counts stay simple.
    let node = Node::new().expect("node");
    let agent = start(&node, &have);
    assert!(held_then_released(&agent, &node, "held"), "released\n{}", agent.log_text());
    // Counted once the signal is out, which may be after the app ran.
    assert!(agent.wait_metric("valet_app_releases_total{reason=\"ready\"} ", 1.0), "{}", agent.log_text());
}

#[test]
fn without_sys_admin_programs_load_with_bpf_and_perfmon_but_no_pod_netns_is_entered() {
    let _serial = serial();
    let node = Node::new().expect("node");
    // Ready means the programs are loaded and attached: BPF and PERFMON do that, except where
    // perf_event_paranoid is above 2 under Debian's patch that then asks CAP_SYS_ADMIN itself
    // for perf_event_open (seen on Debian's 5.10, 6.1 and 6.12): there only SYS_ADMIN
    // attaches them.
    // Where they cannot, the agent stays up degraded (issue 34), not ready (`bpf_denied`).
    let mut agent = spawn(&node, None, &[others("SYS_ADMIN"), vec!["BPF", "PERFMON"]].concat());
    let paranoid = perf_event_paranoid();
    agent.wait_served(START).expect("ready with the programs, or degraded");
    let mode = node_mode(&agent);
    println!("without SYS_ADMIN, with BPF and PERFMON (perf_event_paranoid {paranoid}): {mode:?}");
    let mut job = node.job_pod(JobSpec::new("nosysadmin")).expect("pod");
    agent.wait_tracked(1, Duration::from_secs(10)).expect("tracked");
    assert!(!quit_after_app_exit(&agent, &mut job, QUIET), "no quit without setns\n{}", agent.log_text());
    if mode.as_ref().is_some_and(|(m, _)| m == "kernel") {
        assert_exit_seen(&agent);
    } else {
        assert_degraded(&mut agent, "bpf_denied");
        assert!(paranoid > 2, "BPF and PERFMON attach the programs at perf_event_paranoid {paranoid}");
        let log = agent.log_text();
        assert!(log.contains("perf_event_open_trace_point` failed: Permission denied"), "{log}");
    }
    // Either way the app's end was known (from the kernel, or from the API degraded), the quit
    // was tried, and it failed: the pod's network namespace cannot be entered.
    assert!(job.quits().is_empty());
    let label = failed_quit_label(&agent);
    println!("without SYS_ADMIN the quit failed: {label:?}");
    assert!(label.is_some(), "the agent tried and failed to quit\n{}", agent.log_text());

    // Without BPF, PERFMON and SYS_ADMIN nothing loads at all: degraded, not ready.
    let node = Node::new().expect("node");
    let mut bare = spawn(&node, None, &others("SYS_ADMIN"));
    bare.wait_served(START).expect("degraded without BPF/PERFMON/SYS_ADMIN");
    assert_degraded(&mut bare, "bpf_denied");
    println!("without BPF, PERFMON and SYS_ADMIN: {:?}", node_mode(&bare));
}

/// `kernel.perf_event_paranoid`.
fn perf_event_paranoid() -> i32 {
    let text = std::fs::read_to_string("/proc/sys/kernel/perf_event_paranoid").expect("perf_event_paranoid");
    text.trim().parse().expect("a number")
}

#[test]
fn without_sys_ptrace_the_pods_network_namespace_cannot_be_opened() {
    let _serial = serial();
    let node = Node::new().expect("node");
    // As in the DaemonSet, which mounts no runtime state directory: a runtime's record is
    // reached through its processes (`/proc/<shim>/cwd` and `root`), a pod's namespace through
    // `/proc/<pid>/ns/net`, all of which need ptrace-read on another's process. (The simulated
    // node's runtime directory, which the other tests read as a fixed directory, would open a
    // recorded path with no procfs in between.)
    let none = node.scratch.path("no-runtime-state");
    std::fs::create_dir_all(&none).expect("an empty runtime state directory");
    let none = format!("--runtime-state-dirs={}", none.display());
    let mut agent = spawn_with(&node, None, &others("SYS_PTRACE"), &[&none]);
    agent.wait_ready(START).expect("ready");
    let mut job = node.job_pod(JobSpec::new("noptrace")).expect("pod");
    agent.wait_tracked(1, Duration::from_secs(10)).expect("tracked");
    assert!(!quit_after_app_exit(&agent, &mut job, QUIET), "no quit without ptrace-read\n{}", agent.log_text());
    assert_exit_seen(&agent);
    assert!(job.quits().is_empty());
    let label = failed_quit_label(&agent);
    println!("without SYS_PTRACE the quit failed: {label:?}");
    assert!(label.is_some(), "the agent tried and failed to quit\n{}", agent.log_text());
}

#[test]
fn without_kill_a_held_app_of_another_uid_stays_stopped() {
    let _serial = serial();
    let node = Node::new().expect("node");
    let agent = start(&node, &others("KILL"));
    assert!(!held_then_released(&agent, &node, "nokill"), "released without CAP_KILL?\n{}", agent.log_text());
    assert_eq!(agent.metric("valet_app_releases_total{reason=\"ready\"} "), 0.0);
}

/// The scheduling policy and real-time priority of the agent's release thread
/// (`/proc/<pid>/task/<tid>/stat` fields 41 and 40), once it is there.
fn release_thread_sched(pid: u32) -> Option<(u32, u32)> {
    thread_sched(pid, "valet-release")
}

/// [`release_thread_sched`] of the agent's thread named `name`.
fn thread_sched(pid: u32, name: &str) -> Option<(u32, u32)> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    let task =
        tasks.flatten().find(|t| std::fs::read_to_string(t.path().join("comm")).is_ok_and(|c| c.trim_end() == name))?;
    let stat = std::fs::read_to_string(task.path().join("stat")).ok()?;
    // Fields from the third (the state) on, after the command's closing parenthesis.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    Some((fields.get(41 - 3)?.parse().ok()?, fields.get(40 - 3)?.parse().ok()?))
}

/// [`release_thread_sched`] of `agent`, once its release thread is there (panics at [`START`]).
fn wait_release_thread_sched(agent: &Agent) -> Option<(u32, u32)> {
    let pid = agent.pid().expect("pid");
    let mut sched = None;
    assert!(
        eventually(START, || {
            sched = release_thread_sched(pid);
            sched.is_some()
        }),
        "no valet-release thread\n{}",
        agent.log_text()
    );
    sched
}

#[test]
fn without_sys_nice_the_release_thread_stays_in_the_normal_class() {
    let _serial = serial();
    const FIFO: (u32, u32) = (libc::SCHED_FIFO as u32, 1);
    let node = Node::new().expect("node");
    let agent = start(&node, &others(""));
    let sched = wait_release_thread_sched(&agent);
    assert_eq!(sched, Some(FIFO), "with SYS_NICE: SCHED_FIFO, priority 1\n{}", agent.log_text());
    // Without it the thread keeps the normal class, says so, and releases all the same.
    let node = Node::new().expect("node");
    let agent = start(&node, &others("SYS_NICE"));
    let sched = wait_release_thread_sched(&agent);
    assert_eq!(sched, Some((libc::SCHED_OTHER as u32, 0)), "without SYS_NICE\n{}", agent.log_text());
    assert!(agent.log_text().contains("the release thread stays in the normal class"), "{}", agent.log_text());
    assert!(
        eventually(START, || {
            let log = agent.log_text();
            log.contains("the loop stays in the normal class")
                && log.contains("the kernel event reader stays in the normal class")
        }),
        "{}",
        agent.log_text()
    );
    assert!(held_then_released(&agent, &node, "nonice"), "released\n{}", agent.log_text());
}

#[test]
fn with_decide_priority_the_prober_and_the_loop_run_real_time_and_by_default_the_loop_and_event_reader() {
    let _serial = serial();
    const FIFO: (u32, u32) = (libc::SCHED_FIFO as u32, 1);
    let node = Node::new().expect("node");
    let mut agent = spawn_with(&node, None, &others(""), &["--decide-priority", "1"]);
    agent.wait_ready(START).expect("ready");
    let pid = agent.pid().expect("pid");
    // The loop's thread is the main one (`valet-agent`); it changes its class once started.
    let mut sched = (None, None);
    let both = eventually(START, || {
        sched = (thread_sched(pid, "valet-held"), thread_sched(pid, "valet-agent"));
        sched == (Some(FIFO), Some(FIFO))
    });
    assert!(both, "the prober, the loop: {sched:?}\n{}", agent.log_text());
    assert!(held_then_released(&agent, &node, "decide"), "released\n{}", agent.log_text());
    // Without the flag the loop and its kernel event reader alone run real-time
    // (`--loop-priority`'s default, 1).
    let node = Node::new().expect("node");
    let agent = start(&node, &others(""));
    let normal = Some((libc::SCHED_OTHER as u32, 0));
    let _ = wait_release_thread_sched(&agent);
    let pid = agent.pid().expect("pid");
    let mut three = (None, None, None);
    let loop_only = eventually(START, || {
        three = (thread_sched(pid, "valet-held"), thread_sched(pid, "valet-agent"), thread_sched(pid, "valet-events"));
        three == (normal, Some(FIFO), Some(FIFO))
    });
    assert!(loop_only, "the prober, the loop, the event reader: {three:?}\n{}", agent.log_text());
    assert!(agent.log_text().contains("the kernel event reader runs SCHED_FIFO"), "{}", agent.log_text());
    // `--loop-priority 0`: all in the normal class.
    let node = Node::new().expect("node");
    let mut agent = spawn_with(&node, None, &others(""), &["--loop-priority", "0"]);
    agent.wait_ready(START).expect("ready");
    let _ = wait_release_thread_sched(&agent);
    let pid = agent.pid().expect("pid");
    let all = [thread_sched(pid, "valet-held"), thread_sched(pid, "valet-agent"), thread_sched(pid, "valet-events")];
    assert_eq!(all, [normal, normal, normal], "the prober, the loop, the event reader");
    let log = agent.log_text();
    assert!(!log.contains("the loop runs SCHED_FIFO") && !log.contains("event reader runs SCHED_FIFO"), "{log}");
}

/// Whether the agent's maps fit RLIMIT_MEMLOCK `limit` without CAP_SYS_RESOURCE here: always
/// from 5.11 (maps are charged to the memory cgroup); before, found on Debian's 5.10 in qemu
/// (`cargo xtask kernels 5.10`): the agent's maps and programs alone are charged 6048 KiB,
/// more than 64 KiB and less than 8 MiB.
fn loads_without_sys_resource(limit: u64) -> bool {
    kernel_at_least(5, 11) || limit >= 8 << 20
}

#[test]
fn without_sys_resource_the_inherited_memlock_limit_holds_the_maps_only_from_5_11() {
    let _serial = serial();
    let caps = others("SYS_RESOURCE");
    for limit in INHERITED_MEMLOCK {
        let kib = limit >> 10;
        let node = Node::new().expect("node");
        let mut agent = spawn(&node, Some(limit), &caps);
        // Loaded or not, the agent stays up (issue 34: degraded, not exited).
        agent.wait_served(START).unwrap_or_else(|e| panic!("the agent stays up under {kib} KiB: {e}"));
        let loaded = node_mode(&agent) == Some(("kernel".into(), "none".into()));
        let expected = loads_without_sys_resource(limit);
        println!(
            "without SYS_RESOURCE, RLIMIT_MEMLOCK {kib} KiB: {} (expected {}); BPF memory (maps, programs), KiB: {:?}",
            if loaded { "loaded" } else { "degraded" },
            if expected { "loaded" } else { "degraded" },
            logged_memlock_kib(&agent)
        );
        if loaded {
            assert!(expected, "the maps fit {kib} KiB on this kernel\n{}", agent.log_text());
            // The raise to unlimited needs the capability: the agent kept what it was given.
            assert_eq!(memlock_of(agent.pid().expect("pid")), Some(limit), "{}", agent.log_text());
            let mut job = node.job_pod(JobSpec::new("memlock")).expect("pod");
            agent.wait_tracked(1, Duration::from_secs(10)).expect("tracked");
            assert!(quit_after_app_exit(&agent, &mut job, Duration::from_secs(10)), "quit\n{}", agent.log_text());
        } else {
            assert!(!expected, "degraded under {kib} KiB\n{}", agent.log_text());
            assert_degraded(&mut agent, "memlock");
            // It says why: the map the limit could not hold, and the limit.
            let log = agent.log_text();
            assert!(log.contains("failed to create map"), "{log}");
            assert!(log.contains(&format!("RLIMIT_MEMLOCK is {kib} KiB and could not be raised")), "{log}");
        }
    }
    // Before 5.11 the charge is per user: every root process's BPF maps and programs on the
    // node count against the agent's limit. Another agent (with the DaemonSet's capabilities)
    // stands in for the node's other BPF users (runc's device filters, systemd, CNI agents):
    // beside it, 8 MiB no longer holds the maps.
    let other_node = Node::new().expect("node");
    let other = start(&other_node, &others(""));
    let held = logged_memlock_kib(&other);
    let limit = INHERITED_MEMLOCK[1];
    let node = Node::new().expect("node");
    let mut agent = spawn(&node, Some(limit), &caps);
    agent.wait_served(START).expect("the agent stays up beside another BPF user");
    let loaded = node_mode(&agent) == Some(("kernel".into(), "none".into()));
    println!(
        "without SYS_RESOURCE, RLIMIT_MEMLOCK {} KiB beside another root BPF user (maps, programs, KiB: {held:?}): {}",
        limit >> 10,
        if loaded { "loaded" } else { "degraded" },
    );
    if loaded {
        assert!(kernel_at_least(5, 11), "the user's charge is not summed?\n{}", agent.log_text());
    } else {
        assert!(!kernel_at_least(5, 11), "{}", agent.log_text());
        assert_degraded(&mut agent, "memlock");
        let log = agent.log_text();
        assert!(log.contains("could not be raised"), "{log}");
    }
    drop(other);
}

/// Whether process `pid` holds a BPF map's file descriptor (the pin it opened).
fn holds_a_bpf_map(pid: u32) -> bool {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .into_iter()
        .flatten()
        .flatten()
        .any(|fd| std::fs::read_link(fd.path()).is_ok_and(|target| target.to_string_lossy() == "anon_inode:bpf-map"))
}

/// The deadline keeper with exactly the DaemonSet's capabilities for it (BPF, KILL, and SYS_ADMIN,
/// which it gives up at start) opens the agent's pinned record. Where the kernel refuses that
/// bpf(2) (here the pin's mode: 0000, and the keeper has no CAP_DAC_OVERRIDE; on a node, an LSM),
/// the keeper exits saying why rather than keep no deadline while it looks alive (its container
/// restarted, the pod not ready).
#[test]
fn a_deadline_keeper_refused_bpf_exits_and_says_why() {
    let _serial = serial();
    let node = Node::new().expect("node");
    let agent = node.start_agent(&[]).expect("agent");
    let pin = node.pin_dir().join("held_v2");
    assert!(eventually(START, || pin.exists()), "the agent pinned no record\n{}", agent.log_text());
    let caps = manifest_capabilities().swap_remove(1);

    std::fs::set_permissions(&pin, std::fs::Permissions::from_mode(0o000)).expect("chmod the pin");
    let mut refused = node.start_deadline_keeper_under(&with_capabilities(&caps)).expect("keeper");
    let status = refused.wait_exit(START);
    std::fs::set_permissions(&pin, std::fs::Permissions::from_mode(0o600)).expect("chmod the pin back");
    assert_eq!(status.and_then(|s| s.code()), Some(1), "{status:?}\n{}", refused.log_text());
    assert!(
        refused.log_text().contains("bpf(2) on the pinned record of held apps is refused"),
        "it says why:\n{}",
        refused.log_text()
    );

    let keeper = node.start_deadline_keeper_under(&with_capabilities(&caps)).expect("keeper");
    let pid = keeper.pid().expect("pid");
    assert!(eventually(START, || holds_a_bpf_map(pid)), "the pin never opened\n{}", keeper.log_text());
    assert!(!keeper.log_text().contains("refused"), "{}", keeper.log_text());
}

/// On a runtime without recursive read-only mounts (containerd before 2.0, CRI-O before 1.30) the
/// DaemonSet's `readOnly` cgroup volume is read-only at its top only: on v1 and hybrid nodes (this
/// host is hybrid) the controllers' mounts below stay writable. Laid out so here (a read-only
/// tmpfs, the cgroup fs mounted writable below it), the keeper with the manifest's capabilities makes every
/// one of them read-only itself at start (mount_setattr; a bind remount each on 5.10, which has
/// no mount_setattr: `cargo xtask kernels`), then holds no CAP_SYS_ADMIN in any thread; with BPF
/// and KILL alone they stay writable and it says so.
#[test]
fn the_keeper_makes_every_cgroup_mount_read_only_then_gives_up_sys_admin() {
    let _serial = serial();
    let node = Node::new().expect("node");
    let view = node.scratch.path("host-cgroup");
    std::fs::create_dir_all(&view).expect("a mount point");
    let caps = manifest_capabilities().swap_remove(1);
    assert!(caps.iter().any(|c| c == "SYS_ADMIN"), "the keeper's capabilities in the manifest: {caps:?}");

    let keeper =
        node.start_deadline_keeper_under(&bound_top_read_only(&view, &with_capabilities(&caps))).expect("keeper");
    let pid = keeper.pid().expect("pid");
    assert!(
        eventually(START, || keeper.log_text().contains("the host's cgroup fs is read-only here")),
        "{}",
        keeper.log_text()
    );
    let mounts = mounts_below(pid, &view);
    assert!(mounts.len() > 1, "no mount below {}: {mounts:?}", view.display());
    assert!(mounts.iter().all(|(_, ro)| *ro), "{mounts:?}");
    let wrote = writes_that_succeed(pid, &view);
    assert!(wrote.is_empty(), "writable from the keeper: {wrote:?}");
    assert!(!any_thread_holds(pid, cap_bit("SYS_ADMIN")), "a thread of the keeper holds CAP_SYS_ADMIN");
    drop(keeper);

    let without: Vec<&str> = caps.iter().map(String::as_str).filter(|c| *c != "SYS_ADMIN").collect();
    let keeper =
        node.start_deadline_keeper_under(&bound_top_read_only(&view, &with_capabilities(&without))).expect("keeper");
    let pid = keeper.pid().expect("pid");
    assert!(eventually(START, || keeper.log_text().contains("stay writable")), "it says so:\n{}", keeper.log_text());
    let mounts = mounts_below(pid, &view);
    assert!(mounts.iter().any(|(_, ro)| !ro), "a mount below stays writable: {mounts:?}");
}
