//! Privileged tests of the kubelet-shaped pods (cgroups, netns, pid namespaces) with stand-in
//! proxies inside. They fail when not run as root.

use std::net::{Ipv4Addr, SocketAddr};
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use valet_sim::client;
use valet_sim::node::{
    CgroupDriver, CgroupRoot, PodJsonOptions, QosClass, Runtime, SimPod, SimPodOptions, SpawnOptions, cgroup_id,
    mark_container_terminated,
};
use valet_sim::standin::{ProxyKind, StandinOptions, read_events};
use valet_sim::util::require_root;

/// Only a guard against a hang: the waits are for events.
const T: Duration = Duration::from_secs(30);

fn standin_env() {
    // Integration tests know where cargo put the binary.
    valet_sim::standin::set_binary_path(env!("CARGO_BIN_EXE_valet-standin-proxy"));
}

fn temp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("valet-sim-{tag}-{}", valet_sim::util::random_hex(4)));
    std::fs::create_dir_all(&d).expect("temp dir");
    d
}

fn same_netns(pid: u32, netns: &Path) -> bool {
    let a = std::fs::metadata(format!("/proc/{pid}/ns/net")).expect("ns of pid");
    let b = std::fs::metadata(netns).expect("netns file");
    (a.dev(), a.ino()) == (b.dev(), b.ino())
}

fn nspid(pid: u32) -> String {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    status
        .lines()
        .find(|l| l.starts_with("NSpid:"))
        .expect("NSpid line")
        .split_whitespace()
        .skip(1)
        .collect::<Vec<_>>()
        .join(" ")
}

/// The proxy's cgroup as the kubelet lays it out for `driver` and `qos` (the cases covered).
fn expected_cgroup(pod: &SimPod, driver: CgroupDriver, qos: QosClass, runtime: Runtime, proxy_id: &str) -> String {
    let uid_ = pod.uid().replace('-', "_");
    match (driver, qos) {
        (CgroupDriver::Systemd, QosClass::Burstable) => format!(
            "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid_}.slice/{}{}.scope",
            runtime.scope_prefix(),
            proxy_id
        ),
        (CgroupDriver::Systemd, QosClass::Guaranteed) => {
            format!("/kubepods.slice/kubepods-pod{uid_}.slice/{}{}.scope", runtime.scope_prefix(), proxy_id)
        }
        (CgroupDriver::Cgroupfs, QosClass::BestEffort) => {
            format!("/kubepods/besteffort/pod{}/{}", pod.uid(), proxy_id)
        }
        (CgroupDriver::Cgroupfs, QosClass::Guaranteed) => {
            format!("/kubepods/pod{}/{}", pod.uid(), proxy_id)
        }
        other => panic!("case not covered: {other:?}"),
    }
}

/// Drops `pod` and checks that what it made is gone: its cgroup, its netns (`netns`), its veth.
fn drop_removes_everything(pod: SimPod, netns: &Path) {
    let pod_cg = pod.pod_cgroup_path().to_path_buf();
    let ns_name = pod.netns_name().expect("ns name").to_string();
    let host_if = pod.host_interface().expect("if").to_string();
    drop(pod);
    assert!(!pod_cg.exists(), "pod cgroup removed");
    assert!(!netns.exists(), "netns removed");
    // The kernel removes the pair with the namespace, in its own time.
    wait_link_gone(&host_if);
    let links = std::process::Command::new("ip").args(["-o", "link"]).output().expect("ip link");
    assert!(!String::from_utf8_lossy(&links.stdout).contains(&host_if));
    let nss = std::process::Command::new("ip").args(["netns", "list"]).output().expect("ip netns");
    assert!(!String::from_utf8_lossy(&nss.stdout).contains(&ns_name));
}

/// The whole story for one driver: layout, pid-1 container in cgroup+netns, host reachability,
/// loopback-only quit.
fn istio_pod(driver: CgroupDriver, qos: QosClass, runtime: Runtime) {
    standin_env();
    let dir = temp_dir("istio");
    let events = dir.join("events");
    let opts =
        SimPodOptions::new("job-1").driver(driver).qos(qos).runtime(runtime).container("app").container("istio-proxy");
    let pod = SimPod::create(opts).expect("pod");
    let root = CgroupRoot::detect().expect("cgroup2 root");
    assert_eq!(pod.cgroup_root(), root);

    // Exactly the kubelet's layout.
    let proxy = pod.container("istio-proxy").expect("container").clone();
    let expected = expected_cgroup(&pod, driver, qos, runtime, &proxy.id);
    let proxy_cg = pod.container_cgroup_path("istio-proxy").expect("path").to_path_buf();
    assert_eq!(pod.relative_cgroup(&proxy_cg).expect("relative"), expected);
    assert!(proxy_cg.is_dir());
    assert!(pod.sandbox().cgroup.is_dir());
    assert_eq!(cgroup_id(&proxy_cg).expect("id"), std::fs::metadata(&proxy_cg).expect("stat").ino());
    let pod_ip = pod.pod_ip().expect("pod ip");
    assert_eq!(pod_ip.octets()[..2], [10, 244]);
    let netns = pod.netns_path().expect("netns").to_path_buf();

    // The proxy: pid 1 of its pid namespace, in its container cgroup and the pod netns.
    let mut so = StandinOptions::new(ProxyKind::Istio);
    so.events = Some(events.clone());
    let mut proc = pod.spawn_standin("istio-proxy", &so, &SpawnOptions::default()).expect("spawn proxy");
    let pid = proc.host_pid();
    assert_eq!(proc.ns_pid(), 1);
    assert_eq!(nspid(pid), format!("{pid} 1"));
    let cg = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).expect("cgroup file");
    assert!(cg.lines().any(|l| l == format!("0::{expected}")), "{cg}");
    assert!(same_netns(pid, &netns));

    // Reachable from the host on the pod IP, like the kubelet's probes.
    pod.wait_standin_ready(&so, T).expect("ready");
    let status = SocketAddr::from((pod_ip, 15020));
    let r = client::post(status, "/quitquitquit", T).expect("host quit");
    assert_eq!(r.status, 403);
    assert_eq!(r.text(), "Only requests from localhost are allowed\n");
    assert!(proc.try_wait().expect("wait").is_none(), "a refused quit must not stop the proxy");

    // From inside the pod's netns on loopback: 200 OK, then exit 0.
    let lo = SocketAddr::from((Ipv4Addr::LOCALHOST, 15020));
    let r = pod.in_netns(|| client::get(lo, "/quitquitquit", T)).expect("netns").expect("GET quit");
    assert_eq!(r.status, 405);
    let r = pod.in_netns(|| client::post(lo, "/quitquitquit", T)).expect("netns").expect("POST quit");
    assert_eq!((r.status, r.text().as_str()), (200, "OK"));
    let st = proc.wait_timeout(T).expect("wait").expect("proxy exited");
    assert_eq!(st.code(), Some(0));

    // The events file saw every request with its peer.
    let evs = read_events(&events).expect("events");
    let quits: Vec<String> =
        evs.iter().filter(|e| e.path == "/quitquitquit").map(|e| format!("{} {}", e.method, e.peer.ip())).collect();
    let host_ip = pod.host_ip().expect("host ip");
    assert_eq!(quits, [format!("POST {host_ip}"), "GET 127.0.0.1".into(), "POST 127.0.0.1".into()]);
    assert!(evs.windows(2).all(|w| w[0].mono_ns <= w[1].mono_ns));

    // The app: exit code comes through; pod JSON carries the same ids.
    let mut app = pod.spawn("app", &["sh", "-c", "exit 3"], &SpawnOptions::default()).expect("spawn app");
    assert_eq!(app.wait_timeout(T).expect("wait").and_then(|s| s.code()), Some(3));
    let mut json = pod.pod_json(&PodJsonOptions::node("node-a").job("job").label("app", "batch"));
    let statuses = json["status"]["containerStatuses"].as_array().expect("statuses");
    assert_eq!(statuses[1]["containerID"], format!("{}://{}", runtime.id_scheme(), proxy.id));
    assert_eq!(json["status"]["podIP"], pod_ip.to_string());
    assert_eq!(json["status"]["qosClass"], qos.as_str());
    assert_eq!(json["metadata"]["uid"], pod.uid());
    mark_container_terminated(&mut json, "app", 3).expect("mark");
    assert_eq!(json["status"]["containerStatuses"][0]["state"]["terminated"]["reason"], "Error");

    // Drop removes everything it made.
    drop_removes_everything(pod, &netns);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn systemd_burstable_containerd() {
    require_root();
    istio_pod(CgroupDriver::Systemd, QosClass::Burstable, Runtime::Containerd);
}

#[test]
fn systemd_guaranteed_crio() {
    require_root();
    istio_pod(CgroupDriver::Systemd, QosClass::Guaranteed, Runtime::Crio);
}

#[test]
fn cgroupfs_besteffort_docker() {
    require_root();
    istio_pod(CgroupDriver::Cgroupfs, QosClass::BestEffort, Runtime::Docker);
}

#[test]
fn cgroupfs_guaranteed_containerd() {
    require_root();
    istio_pod(CgroupDriver::Cgroupfs, QosClass::Guaranteed, Runtime::Containerd);
}

#[test]
fn other_meshes_in_one_pod() {
    require_root();
    standin_env();
    let pod = SimPod::create(
        SimPodOptions::new("meshes")
            .driver(CgroupDriver::Cgroupfs)
            .container("envoy")
            .container("linkerd-proxy")
            .container("cloud-sql-proxy"),
    )
    .expect("pod");
    let ip = pod.pod_ip().expect("ip");
    let envoy = StandinOptions::new(ProxyKind::Envoy);
    let mut linkerd = StandinOptions::new(ProxyKind::Linkerd);
    linkerd.ready_after = Some(Duration::from_millis(300));
    let cloudsql = StandinOptions::new(ProxyKind::CloudSql);
    let mut pe = pod.spawn_standin("envoy", &envoy, &SpawnOptions::default()).expect("envoy");
    let mut pl = pod.spawn_standin("linkerd-proxy", &linkerd, &SpawnOptions::default()).expect("linkerd");
    let mut pc = pod.spawn_standin("cloud-sql-proxy", &cloudsql, &SpawnOptions::default()).expect("cloudsql");

    // Linkerd: not ready at first, ready later.
    pod.wait_standin_ready(&cloudsql, T).expect("cloudsql ready");
    let first = client::get(SocketAddr::from((ip, 4191)), "/ready", T);
    if let Ok(r) = &first {
        assert!(r.status == 503 || r.status == 200);
    }
    pod.wait_standin_ready(&linkerd, T).expect("linkerd ready");
    pod.wait_standin_ready(&envoy, T).expect("envoy ready");

    // Envoy admin binds loopback: not reachable on the pod IP at all.
    assert!(client::post(SocketAddr::from((ip, 15000)), "/quitquitquit", Duration::from_millis(500)).is_err());
    // Linkerd: non-loopback refused, loopback accepted.
    let r = client::post(SocketAddr::from((ip, 4191)), "/shutdown", T).expect("host shutdown");
    assert_eq!(r.status, 403);
    let lo = |port| SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    let r = pod.in_netns(|| client::post(lo(4191), "/shutdown", T)).expect("netns").expect("shutdown");
    assert_eq!((r.status, r.text().as_str()), (200, "shutdown\n"));
    assert_eq!(pl.wait_timeout(T).expect("wait").and_then(|s| s.code()), Some(0));
    let r = pod.in_netns(|| client::post(lo(15000), "/quitquitquit", T)).expect("netns").expect("quit");
    assert_eq!(r.status, 200);
    assert_eq!(pe.wait_timeout(T).expect("wait").and_then(|s| s.code()), Some(0));
    // cloud-sql-proxy without --exit-zero-on-sigterm: SIGTERM fails the container with 143,
    // even as pid 1 of its namespace.
    pc.signal(libc::SIGTERM).expect("sigterm");
    assert_eq!(pc.wait_timeout(T).expect("wait").and_then(|s| s.code()), Some(143));
}

#[test]
fn kill_and_no_pid_namespace_and_pause() {
    require_root();
    let pod = SimPod::create(SimPodOptions::new("plain").container("app").netns(false)).expect("pod");
    assert!(pod.pod_ip().is_none());
    let no_ns = SpawnOptions { pid_namespace: false, ..Default::default() };
    let mut p = pod.spawn("app", &["sleep", "30"], &no_ns).expect("spawn");
    assert_eq!(p.ns_pid(), p.host_pid());
    assert_eq!(nspid(p.host_pid()), p.host_pid().to_string());
    let mut pause = pod.spawn_pause().expect("pause");
    let cg = std::fs::read_to_string(format!("/proc/{}/cgroup", pause.host_pid())).expect("cgroup");
    assert!(cg.contains(&pod.sandbox().id), "{cg}");
    // A container's init killed: the status says so; dropping the pod kills the rest.
    let st = p.kill().expect("kill");
    assert_eq!(std::os::unix::process::ExitStatusExt::signal(&st), Some(libc::SIGKILL));
    drop(pod);
    let st = pause.wait_timeout(T).expect("wait").expect("pause killed with its pod");
    assert_eq!(std::os::unix::process::ExitStatusExt::signal(&st), Some(libc::SIGKILL));
}

/// Container processes start through `valet-sim-exec` (posix_spawn, not a fork of the test
/// process): pid 1 of its namespace under it, as a container's init is under its shim; the
/// status mirrors how the process ended; a failure before the exec fails the spawn with its cause.
#[test]
fn container_processes_start_through_valet_sim_exec() {
    require_root();
    let helper = valet_sim::node::exec_helper().expect("valet-sim-exec is built next to the tests");
    assert_eq!(helper.file_name().and_then(|f| f.to_str()), Some("valet-sim-exec"));
    let pod =
        SimPod::create(SimPodOptions::new("exec").container("app").container("late").lazy_cgroups(true)).expect("pod");
    pod.make_container_cgroup(&pod.container("app").expect("app")).expect("cgroup");
    let mut p = pod.spawn("app", &["sleep", "30"], &SpawnOptions::default()).expect("spawn");
    let status = std::fs::read_to_string(format!("/proc/{}/status", p.host_pid())).expect("status");
    let ppid = status.lines().find_map(|l| l.strip_prefix("PPid:")).expect("PPid").trim().to_string();
    let parent = std::fs::read_to_string(format!("/proc/{ppid}/comm")).expect("comm");
    assert_eq!(parent.trim(), "valet-sim-exec");
    assert_eq!(nspid(p.host_pid()), format!("{} 1", p.host_pid()));
    let st = p.kill().expect("kill");
    assert_eq!(std::os::unix::process::ExitStatusExt::signal(&st), Some(libc::SIGKILL));
    let mut code = pod.spawn("app", &["sh", "-c", "exit 7"], &SpawnOptions::default()).expect("spawn");
    assert_eq!(code.wait_timeout(T).expect("wait").and_then(|s| s.code()), Some(7));

    for pid_namespace in [true, false] {
        let o = SpawnOptions { pid_namespace, ..Default::default() };
        let e = pod.spawn("app", &["/nonexistent/valet-prog"], &o).expect_err("no such program");
        let text = format!("{e:#}");
        assert!(text.contains("exec /nonexistent/valet-prog") && text.contains("No such file"), "{text}");
        let e = pod.spawn("late", &["true"], &o).expect_err("no cgroup yet");
        let text = format!("{e:#}");
        assert!(text.contains("cgroup.procs") && text.contains("No such file"), "{text}");
    }
    // Nothing was left running in the container's cgroup.
    let procs = pod.container_cgroup_path("app").expect("path").join("cgroup.procs");
    assert_eq!(std::fs::read_to_string(procs).expect("procs").trim(), "");
}

/// shareProcessNamespace: a container's process joins the sandbox's pid namespace (pid N there,
/// the pause is pid 1), in its own cgroup, under `valet-sim-exec` as under the runtime's shim;
/// the pause's end takes it along.
#[test]
fn a_container_process_joins_the_sandboxs_pid_namespace() {
    require_root();
    let pod = SimPod::create(SimPodOptions::new("shared").container("app").netns(false)).expect("pod");
    let mut pause = pod.spawn_pause().expect("pause");
    let ns = PathBuf::from(format!("/proc/{}/ns/pid", pause.host_pid()));
    let o = SpawnOptions { join_pid_namespace: Some(ns.clone()), ..Default::default() };
    let mut app = pod.spawn("app", &["sleep", "30"], &o).expect("spawn");
    let ids = nspid(app.host_pid());
    let ids: Vec<&str> = ids.split_whitespace().collect();
    assert_eq!(ids.len(), 2, "one namespace below the host's: {ids:?}");
    assert_ne!(ids[1], "1", "not the namespace's init");
    let inode = |pid: u32| std::fs::metadata(format!("/proc/{pid}/ns/pid")).expect("ns").ino();
    assert_eq!(inode(app.host_pid()), inode(pause.host_pid()), "the sandbox's namespace");
    let cg = std::fs::read_to_string(format!("/proc/{}/cgroup", app.host_pid())).expect("cgroup");
    assert!(cg.contains(&pod.container("app").expect("app").id), "its own container's cgroup: {cg}");
    let ppid = std::fs::read_to_string(format!("/proc/{}/status", app.host_pid())).expect("status");
    let ppid = ppid.lines().find_map(|l| l.strip_prefix("PPid:")).expect("PPid").trim().to_string();
    assert_eq!(std::fs::read_to_string(format!("/proc/{ppid}/comm")).expect("comm").trim(), "valet-sim-exec");
    // The namespace's init ends: the kernel kills the rest of it.
    pause.kill().expect("kill the pause");
    let st = app.wait_timeout(T).expect("wait").expect("ended with the pause");
    assert_eq!(std::os::unix::process::ExitStatusExt::signal(&st), Some(libc::SIGKILL));
    let e = pod.spawn("app", &["true"], &o).expect_err("the pause and its namespace are gone");
    assert!(format!("{e:#}").contains(&format!("open {}", ns.display())), "{e:#}");
}

#[test]
fn stale_leases_of_dead_processes_are_reaped() {
    require_root();
    let cg_root = CgroupRoot::detect().expect("root");
    let short = valet_sim::util::random_hex(4);
    let dir = cg_root.join(format!("valet-stale-{short}"));
    std::fs::create_dir(&dir).expect("mkdir");
    let ns = format!("valet-{short}");
    assert!(std::process::Command::new("ip").args(["netns", "add", &ns]).status().expect("ip").success());
    let mut dead = std::process::Command::new("true").spawn().expect("spawn");
    let pid = dead.id();
    dead.wait().expect("wait");
    let lease = serde_json::json!({"pid": pid, "start": 1, "dirs": [dir], "shared": [], "netns": ns, "host_if": null});
    let leases = valet_sim::node::lease_dir();
    std::fs::create_dir_all(&leases).expect("mkdir");
    std::fs::write(leases.join(&short), lease.to_string()).expect("lease");
    valet_sim::node::reap_stale_leases();
    assert!(!dir.exists());
    assert!(!Path::new(&format!("/run/netns/{ns}")).exists());
    assert!(!leases.join(&short).exists());
}

/// Pods made at once (threads here; test processes alike) each get their own subnet, and a
/// subnet claimed by a process that is gone is used again.
#[test]
fn pods_made_at_once_get_their_own_subnets_and_dead_claims_are_taken_over() {
    require_root();
    let subnet = |p: &SimPod| -> [u8; 3] {
        let o = p.pod_ip().expect("pod ip").octets();
        [o[0], o[1], o[2]]
    };
    let pods: Vec<SimPod> = std::thread::scope(|s| {
        let made: Vec<_> = (0..8)
            .map(|i| s.spawn(move || SimPod::create(SimPodOptions::new(&format!("ipam-{i}")).container("app"))))
            .collect();
        made.into_iter().map(|h| h.join().expect("thread").expect("pod")).collect()
    });
    let distinct: std::collections::BTreeSet<[u8; 3]> = pods.iter().map(subnet).collect();
    assert_eq!(distinct.len(), pods.len(), "{distinct:?}");
    drop(pods);

    // Every unclaimed subnet claimed by a process that does not exist: a new pod still gets one.
    let dir = valet_sim::node::subnet_dir();
    let dead = "0 1";
    let mut planted = Vec::new();
    for n in 1..=254u8 {
        let path = dir.join(n.to_string());
        if !path.exists() {
            std::fs::write(&path, dead).expect("plant a dead claim");
            planted.push(path);
        }
    }
    let pod = SimPod::create(SimPodOptions::new("ipam-dead").container("app"));
    for path in planted {
        // Only the planted claims that nobody took over.
        if std::fs::read_to_string(&path).is_ok_and(|t| t == dead) {
            let _ = std::fs::remove_file(path);
        }
    }
    let pod = pod.expect("a pod on a subnet whose claim's owner is gone");
    let claim = dir.join(subnet(&pod)[2].to_string());
    assert_ne!(std::fs::read_to_string(&claim).expect("the pod's claim"), dead);
    let host_if = pod.host_interface().expect("host interface").to_string();
    drop(pod);
    // Released at once; handed out again only once the kernel removed the device with the pod's
    // namespace (claim_state's unit test covers a device that is still there).
    assert_eq!(std::fs::read_to_string(&claim).expect("the claim"), format!("released {host_if}"));
    wait_link_gone(&host_if);
}

/// Waits until the host's end of a dropped pod's veth pair is gone (up to 10 s).
fn wait_link_gone(host_if: &str) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while Path::new("/sys/class/net").join(host_if).exists() {
        assert!(std::time::Instant::now() < deadline, "{host_if} outlived its namespace by 30 s");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}
