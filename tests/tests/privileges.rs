//! The agent binary under exactly the capabilities `deploy/base/daemonset.yaml` adds, as a
//! container runtime gives them to a root container with `drop: [ALL]` and
//! `allowPrivilegeEscalation: false`: uid 0, those capabilities in the bounding, permitted and
//! effective sets and nothing else, no inheritable or ambient ones, no_new_privs. `setpriv`
//! (util-linux) sets that up. Then each capability is dropped in turn and the thing it is for
//! breaks: it is needed.
//!
//! - SYS_ADMIN: entering a pod's network namespace (setns) to quit its proxy; also loading
//!   the tracing programs (it implies CAP_BPF and CAP_PERFMON, so those two add nothing and
//!   are not in the DaemonSet: shown by the agent working without them).
//! - SYS_PTRACE: opening `/proc/<pid>/ns/net` of a pod process (a ptrace read check).
//! - KILL: SIGCONT to a held app of another uid (in its own session).
//! - SYS_RESOURCE: RLIMIT_MEMLOCK for BPF maps on kernels older than 5.11 only; on 5.11+ maps
//!   are charged to the memory cgroup. Where the test runs without it (this host's root has
//!   no CAP_SYS_RESOURCE at all), the kernel must be 5.11 or later, and the agent works.
//!
//! One test at a time: each starts its own agent, and the quit and hold checks time out on a
//! loaded 2-core machine otherwise.

use std::os::unix::fs::PermissionsExt as _;
use std::path::Path;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use valet_sim::node::SpawnOptions;
use valet_tests::harness::{Agent, HANG_GUARD, JobPod, JobSpec, Node, eventually};

static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The uid of the apps in these tests (a container's `runAsUser`; istio-proxy is 1337).
const APP_UID: u32 = 65534;

/// Capability numbers (`linux/capability.h`) of the ones this test deals with.
fn cap_bit(name: &str) -> u32 {
    match name {
        "KILL" => 5,
        "SYS_PTRACE" => 19,
        "SYS_ADMIN" => 21,
        "SYS_RESOURCE" => 24,
        "PERFMON" => 38,
        "BPF" => 39,
        other => panic!("capability {other} is not known to this test: add it with a test of what needs it"),
    }
}

/// The capabilities the DaemonSet adds (after `drop: [ALL]`), read from the manifest.
fn daemonset_capabilities() -> Vec<String> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/base/daemonset.yaml");
    let text = std::fs::read_to_string(&path).expect("read the DaemonSet");
    let mut lines = text.lines().skip_while(|l| l.trim() != "capabilities:");
    assert!(lines.next().is_some(), "no capabilities in {}", path.display());
    let mut caps = Vec::new();
    let mut in_add = false;
    for line in lines {
        let t = line.trim();
        if t.starts_with('#') || t.is_empty() {
            continue;
        }
        if t == "add:" {
            in_add = true;
        } else if let Some(cap) = t.strip_prefix("- ").filter(|_| in_add) {
            caps.push(cap.to_owned());
        } else if in_add {
            break;
        }
    }
    assert!(!caps.is_empty(), "capabilities.add is empty in {}", path.display());
    caps
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

/// `setpriv` arguments that run the agent as uid 0 with exactly `caps`, like the runtime does.
fn with_capabilities(caps: &[&str]) -> Vec<String> {
    let list: String = caps.iter().map(|c| format!(",+{}", c.to_lowercase())).collect();
    vec![
        "setpriv".into(),
        format!("--bounding-set=-all{list}"),
        "--inh-caps=-all".into(),
        "--ambient-caps=-all".into(),
        "--no-new-privs".into(),
        "--".into(),
    ]
}

/// Starts the agent with `caps` and checks the kernel gave it exactly those.
fn start(node: &Node, caps: &[&str]) -> Agent {
    let mut agent = node.spawn_agent_under(&with_capabilities(caps), &[]).expect("spawn agent");
    let pid = agent.pid().expect("pid");
    // The wrapper execs the agent: wait for the exec, then read what the agent holds.
    assert!(
        eventually(HANG_GUARD, || std::fs::read_link(format!("/proc/{pid}/exe"))
            .is_ok_and(|p| p.ends_with("valet-agent"))),
        "setpriv did not exec the agent\n{}",
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
    agent.wait_ready(HANG_GUARD).expect("ready");
    agent
}

/// After the app's exit was seen and no quit arrived: the quit the agent tried, and failed,
/// by its metric label (waits for the agent's retries to end).
fn failed_quit_label(agent: &Agent) -> Option<String> {
    let prefix = "valet_sidecar_quits_total{kind=\"istio\",result=\"";
    let mut found = None;
    // Past the agent's retries (30 s by default) with room to spare: only a hang guard.
    eventually(HANG_GUARD + Duration::from_secs(10), || {
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
        eventually(HANG_GUARD, || agent.metric("valet_container_exits_total{outcome=\"Success\"} ") >= 1.0),
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

fn state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit(')').next()?.split_whitespace().next()?.chars().next()
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
    agent.wait_tracked(1, HANG_GUARD).expect("tracked");
    run_app_as_other_uid(&mut job, &marker);
    let pid = job.apps[0].host_pid();
    assert!(eventually(HANG_GUARD, || state(pid) == Some('T')), "the app is held at exec\n{}", agent.log_text());
    assert!(!marker.exists(), "a held app runs nothing");
    std::fs::write(&ready, "").expect("ready");
    let released = eventually(HANG_GUARD, || marker.exists());
    if !released {
        // Leave nothing stopped behind.
        // SAFETY: plain syscall on a process this test started.
        unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    }
    released
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

    let node = Node::new().expect("node");
    let agent = start(&node, &have);
    let mut job = node.job_pod(JobSpec::new("quit")).expect("pod");
    agent.wait_tracked(1, HANG_GUARD).expect("tracked");
    assert!(quit_after_app_exit(&agent, &mut job, Duration::from_secs(10)), "quit\n{}", agent.log_text());
    // A second node (API server) and agent for the hold, so that the pod counts stay simple.
    let node = Node::new().expect("node");
    let agent = start(&node, &have);
    assert!(held_then_released(&agent, &node, "held"), "released\n{}", agent.log_text());
    assert!(agent.wait_metric("valet_app_releases_total{reason=\"ready\"} ", 1.0));
}

#[test]
fn without_sys_admin_programs_load_with_bpf_and_perfmon_but_no_pod_netns_is_entered() {
    let _serial = serial();
    let node = Node::new().expect("node");
    // Ready means the programs are loaded and attached: BPF and PERFMON do that.
    let agent = start(&node, &["BPF", "PERFMON", "SYS_PTRACE", "KILL"]);
    let mut job = node.job_pod(JobSpec::new("nosysadmin")).expect("pod");
    agent.wait_tracked(1, HANG_GUARD).expect("tracked");
    // The quit the agent tried and failed is the later event: no quit came before it.
    assert!(!quit_after_app_exit(&agent, &mut job, Duration::ZERO), "no quit without setns\n{}", agent.log_text());
    assert_exit_seen(&agent);
    let label = failed_quit_label(&agent);
    println!("without SYS_ADMIN the quit failed: {label:?}");
    assert!(label.is_some(), "the agent tried and failed to quit\n{}", agent.log_text());
    assert!(job.quits().is_empty());
    assert_eq!(job.wait_proxy_exit(Duration::ZERO).expect("poll"), None, "the proxy was quit");
    // Without BPF, PERFMON and SYS_ADMIN nothing loads at all.
    let node = Node::new().expect("node");
    let mut bare = node.spawn_agent_under(&with_capabilities(&["SYS_PTRACE", "KILL"]), &[]).expect("spawn");
    let err = bare.wait_ready(HANG_GUARD).expect_err("no program loads without BPF/PERFMON/SYS_ADMIN");
    println!("without BPF, PERFMON and SYS_ADMIN: {err}");
}

#[test]
fn without_sys_ptrace_the_pods_network_namespace_cannot_be_opened() {
    let _serial = serial();
    let node = Node::new().expect("node");
    let agent = start(&node, &["SYS_ADMIN", "KILL"]);
    let mut job = node.job_pod(JobSpec::new("noptrace")).expect("pod");
    agent.wait_tracked(1, HANG_GUARD).expect("tracked");
    assert!(
        !quit_after_app_exit(&agent, &mut job, Duration::ZERO),
        "no quit without ptrace-read\n{}",
        agent.log_text()
    );
    assert_exit_seen(&agent);
    let label = failed_quit_label(&agent);
    println!("without SYS_PTRACE the quit failed: {label:?}");
    assert!(label.is_some(), "the agent tried and failed to quit\n{}", agent.log_text());
    assert!(job.quits().is_empty());
    assert_eq!(job.wait_proxy_exit(Duration::ZERO).expect("poll"), None, "the proxy was quit");
}

#[test]
fn without_kill_a_held_app_of_another_uid_stays_stopped() {
    let _serial = serial();
    let node = Node::new().expect("node");
    let agent = start(&node, &["SYS_ADMIN", "SYS_PTRACE"]);
    let (mut job, ready, marker) = held_pod(&node, "nokill");
    // The witness: an app of the agent's own uid (root) in another held pod, which it may
    // signal without KILL. Its release, decided after the other's, goes out after it.
    let (mut witness, witness_ready, witness_marker) = held_pod(&node, "nokill-witness");
    agent.wait_tracked(2, HANG_GUARD).expect("tracked");
    run_app_as_other_uid(&mut job, &marker);
    witness.run_app("app", &format!("echo ran > {}; sleep 0.2", witness_marker.display())).expect("witness app");
    let (pid, witness_pid) = (job.apps[0].host_pid(), witness.apps[0].host_pid());
    for (p, what) in [(pid, "the app"), (witness_pid, "the witness")] {
        assert!(eventually(HANG_GUARD, || state(p) == Some('T')), "{what} is held at exec\n{}", agent.log_text());
    }
    // The proxy turns ready: the agent decides the release and writes the condition after it.
    std::fs::write(&ready, "").expect("ready");
    let condition_true = || {
        node.pod(&job).is_some_and(|p| {
            p["status"]["conditions"]
                .as_array()
                .is_some_and(|cs| cs.iter().any(|c| c["type"] == "valet.dev/ProxyReady" && c["status"] == "True"))
        })
    };
    assert!(eventually(HANG_GUARD, condition_true), "the proxy seen ready\n{}", agent.log_text());
    std::fs::write(&witness_ready, "").expect("witness ready");
    assert!(eventually(HANG_GUARD, || witness_marker.exists()), "the witness released\n{}", agent.log_text());
    let stopped = state(pid) == Some('T') && !marker.exists();
    // Leave nothing stopped behind.
    // SAFETY: plain syscall on a process this test started.
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
    assert!(stopped, "released without CAP_KILL?\n{}", agent.log_text());
    assert!(agent.wait_metric("valet_app_releases_total{reason=\"ready\"} ", 1.0), "the witness only");
}
