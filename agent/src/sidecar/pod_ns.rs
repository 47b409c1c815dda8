//! Which network namespace is a pod's: the one its runtime's record names. Each container's OCI
//! bundle (`config.json`, read as [`crate::runtime`] reads it: from the fixed directories, or
//! through the runtime process that started the pod) says, in `linux.namespaces`, which network
//! namespace the container joins:
//!
//! * a path: CRI-O's pinned `/var/run/netns/<uuid>` in every container's record, with or without
//!   an infra container (`drop_infra_ctr = true`, OpenShift 4.7+'s default, runs none: no pause,
//!   and the pod's oldest process may be an app in a namespace of its own); containerd's
//!   `/proc/<pause pid>/ns/net` in its containers'. The path is resolved in the mount namespace of
//!   the runtime process the record was read through (`openat2` with `RESOLVE_IN_ROOT` on its
//!   `/proc/<pid>/root`, so an absolute symlink such as Debian's `/var/run -> /run` stays in
//!   it), or under the host root for the fixed directories; `/proc/<pid>/ns/net` through the
//!   host's procfs, the pid checked to be one of the pod's after the open;
//! * an entry without a path: the container made the namespace (the sandbox's pause, where
//!   nothing pins it): the namespace of that container's main process, the oldest of its cgroup;
//! * no entry: the node's (a hostNetwork pod): refused.
//!
//! No record with a namespaces list in reach (a runtime whose bundles valet cannot find): the
//! oldest process of the pod's container cgroups, as before records were read, logged as such.
//! A namespace the record names is never second-guessed by a process, and the node's own is
//! always refused: a quit sent to the node's loopback could reach another pod's sidecar.

use std::collections::HashSet;
use std::fs::File;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};

use nix::fcntl::{OFlag, OpenHow, ResolveFlag};
use tracing::info;

use crate::cgroup::{CgroupFs, ContainerDir};
use crate::error::{Error, Result};
use crate::host::container_main::start_time;
use crate::runtime::{Bundle, BundleRole, NetRecord, RecordRoot, RuntimeBundles};

/// How a pod's network namespace was found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Via {
    /// The path a container's record names.
    Record(PathBuf),
    /// The main process of the container whose record says it made the namespace.
    Sandbox(u32),
    /// No record in reach: the oldest process of the pod's containers.
    Oldest(u32),
}

/// A pod's network namespace, opened.
#[derive(Debug)]
pub(super) struct Found {
    pub file: File,
    /// Inode of the namespace (its identity).
    pub inode: u64,
    pub via: Via,
}

/// A container of the pod, with its runtime's record.
struct Recorded {
    container: ContainerDir,
    bundle: Bundle,
    root: RecordRoot,
}

/// Opens the network namespace of pod `uid`, whose cgroup is `pod_rel` (see the module's
/// comment). Refused, not kept: the next attempt looks again.
pub(super) fn find_pod_netns(
    host_proc: &Path,
    cgroups: &CgroupFs,
    bundles: &mut RuntimeBundles,
    uid: &str,
    pod_rel: &str,
) -> Result<Found> {
    let containers = cgroups.containers(pod_rel);
    let mut records = records_of(bundles, &containers, uid);
    if records.is_empty() {
        // Not found yet: look for the runtime up from the pod's processes (its conmon or shim
        // is their parent), then again.
        let members = pod_members(cgroups, pod_rel);
        let all: HashSet<u32> = members.iter().copied().collect();
        if bundles.find_runtime(&members, &all) {
            records = records_of(bundles, &containers, uid);
        }
    }
    let node = node_namespaces(host_proc);
    let netns = if records.iter().any(|r| r.bundle.net.is_some()) {
        from_records(host_proc, cgroups, pod_rel, &records, node)?
    } else {
        oldest(host_proc, cgroups, pod_rel, node)?
    };
    info!(%uid, via = ?netns.via, inode = netns.inode, "the pod's network namespace");
    Ok(netns)
}

/// The records of the pod's containers, the sandbox's first.
fn records_of(bundles: &mut RuntimeBundles, containers: &[ContainerDir], uid: &str) -> Vec<Recorded> {
    let mut records: Vec<Recorded> = containers
        .iter()
        .filter_map(|c| {
            let (bundle, root) = bundles.bundle(&c.container.id, uid)?;
            Some(Recorded { container: c.clone(), bundle, root })
        })
        .collect();
    records.sort_by_key(|r| r.bundle.role != BundleRole::Sandbox);
    records
}

/// The inodes of the node's network namespace: pid 1's, where readable; the agent's own, the
/// node's for its hostNetwork DaemonSet, where it is not (a pid 1 that is not dumpable).
fn node_namespaces(host_proc: &Path) -> [Option<u64>; 2] {
    let ns_of = |who: &str| std::fs::metadata(host_proc.join(who).join("ns/net")).map(|m| m.ino()).ok();
    [ns_of("1"), ns_of("self")]
}

/// The namespace the records name (see the module's comment).
fn from_records(
    host_proc: &Path,
    cgroups: &CgroupFs,
    pod_rel: &str,
    records: &[Recorded],
    node: [Option<u64>; 2],
) -> Result<Found> {
    if let Some(r) = records.iter().find(|r| r.bundle.net == Some(NetRecord::Node)) {
        return Err(Error::Endpoint(format!(
            "the runtime's record of container {} names no network namespace: the pod uses the node's \
             (hostNetwork); refusing to call its loopback",
            r.container.container.id
        )));
    }
    let mut failures = Vec::new();
    for r in records {
        let opened = match &r.bundle.net {
            Some(NetRecord::Path(path)) => {
                open_recorded(host_proc, cgroups, pod_rel, &r.root, path).map(|file| (file, Via::Record(path.clone())))
            }
            Some(NetRecord::Own) => main_process_ns(host_proc, cgroups, pod_rel, &r.container.rel),
            Some(NetRecord::Node) | None => continue,
        };
        match opened.and_then(|(file, via)| checked(file, via, node)) {
            Ok(netns) => return Ok(netns),
            Err(e) => failures.push(format!("container {}: {}", r.container.container.id, e.chain())),
        }
    }
    Err(Error::Endpoint(format!(
        "no network namespace the runtime's records name could be opened: {}",
        failures.join("; ")
    )))
}

/// A namespace file as [`Found`], unless it is the node's (or not a namespace at all).
fn checked(file: File, via: Via, node: [Option<u64>; 2]) -> Result<Found> {
    let meta = file.metadata().map_err(|e| Error::io("stat the namespace", e))?;
    let nsfs = std::fs::metadata("/proc/thread-self/ns/net").map(|m| m.dev()).ok();
    if nsfs != Some(meta.dev()) {
        return Err(Error::Endpoint(format!("{via:?} is not a namespace file")));
    }
    if node.contains(&Some(meta.ino())) {
        return Err(Error::Endpoint(format!(
            "{via:?} is the node's network namespace (hostNetwork, or a container not moved into the pod's \
             yet): refusing to call its loopback"
        )));
    }
    Ok(Found { file, inode: meta.ino(), via })
}

/// Opens the namespace at `path`, a record's: `/proc/<pid>/ns/net` through the host's procfs (the
/// pid one of the pod's after the open), any other path in the record's root.
fn open_recorded(host_proc: &Path, cgroups: &CgroupFs, pod_rel: &str, root: &RecordRoot, path: &Path) -> Result<File> {
    if let Some(pid) = proc_ns_pid(path) {
        let file = File::open(host_proc.join(pid.to_string()).join("ns/net"))
            .map_err(|e| Error::io(format!("open {}", path.display()), e))?;
        if !pod_members(cgroups, pod_rel).contains(&pid) {
            return Err(Error::Endpoint(format!("{} is no longer a process of the pod", path.display())));
        }
        return Ok(file);
    }
    let dir = match root {
        RecordRoot::Dir(dir) => dir.clone(),
        RecordRoot::Process { pid, .. } => host_proc.join(pid.to_string()).join("root"),
    };
    let file =
        open_in_root(&dir, path).map_err(|e| Error::io(format!("open {} in {}", path.display(), dir.display()), e))?;
    // Checked after the open: what was opened was reached through the runtime's own root.
    if let RecordRoot::Process { pid, start } = root
        && start_time(host_proc, *pid) != Some(*start)
    {
        return Err(Error::Endpoint(format!("the runtime process {pid} the record was read through is gone")));
    }
    Ok(file)
}

/// The pid of a `/proc/<pid>/ns/net` path.
fn proc_ns_pid(path: &Path) -> Option<u32> {
    let rest = path.to_str()?.strip_prefix("/proc/")?.strip_suffix("/ns/net")?;
    rest.parse().ok().filter(|pid| *pid > 0)
}

/// Opens `path` with `root` as the root directory: `..` and absolute symlinks stay below it,
/// magic links (`/proc/<pid>/...`) are not followed.
fn open_in_root(root: &Path, path: &Path) -> std::io::Result<File> {
    let dir =
        nix::fcntl::open(root, OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC, nix::sys::stat::Mode::empty())?;
    let how = OpenHow::new()
        .flags(OFlag::O_RDONLY | OFlag::O_CLOEXEC)
        .resolve(ResolveFlag::RESOLVE_IN_ROOT | ResolveFlag::RESOLVE_NO_MAGICLINKS);
    Ok(File::from(nix::fcntl::openat2(&dir, path, how)?))
}

/// The namespace of a container's main process: the oldest of its cgroup (a member after the
/// open: a pid reused in between is not).
fn main_process_ns(host_proc: &Path, cgroups: &CgroupFs, pod_rel: &str, container_rel: &str) -> Result<(File, Via)> {
    let pid = oldest_first(host_proc, cgroups.procs_recursive(container_rel))
        .first()
        .copied()
        .ok_or_else(|| Error::Endpoint("the sandbox has no process".into()))?;
    let file = File::open(host_proc.join(pid.to_string()).join("ns/net"))
        .map_err(|e| Error::io(format!("open the namespace of the sandbox's process {pid}"), e))?;
    if !pod_members(cgroups, pod_rel).contains(&pid) {
        return Err(Error::Endpoint(format!("the sandbox's process {pid} is gone")));
    }
    Ok((file, Via::Sandbox(pid)))
}

/// No record: the pod's oldest process, of its cgroup or its container cgroups (the sandbox's
/// among them; CRI-O's `crio-conmon-<id>` monitors, in the node's namespaces, are in neither).
fn oldest(host_proc: &Path, cgroups: &CgroupFs, pod_rel: &str, node: [Option<u64>; 2]) -> Result<Found> {
    for pid in oldest_first(host_proc, pod_members(cgroups, pod_rel)) {
        let Ok(file) = File::open(host_proc.join(pid.to_string()).join("ns/net")) else { continue };
        // Checked after opening: if the pid was reused in between, it is no longer a member.
        // (Read from the cgroup files: /proc/<pid>/cgroup is relative to our cgroup namespace.)
        if !pod_members(cgroups, pod_rel).contains(&pid) {
            continue;
        }
        return checked(file, Via::Oldest(pid), node);
    }
    Err(Error::Endpoint("no runtime record of the pod's network namespace, and no live process of the pod".into()))
}

/// `pids` still running, oldest first (by their start time).
fn oldest_first(host_proc: &Path, pids: Vec<u32>) -> Vec<u32> {
    let mut aged: Vec<(u64, u32)> =
        pids.into_iter().filter_map(|pid| Some((start_time(host_proc, pid)?, pid))).collect();
    aged.sort_unstable();
    aged.into_iter().map(|(_, pid)| pid).collect()
}

/// The processes of a pod: those in its cgroup itself and in its container cgroups (the
/// sandbox's and the containers', however deep), not those of any other cgroup below it (CRI-O's
/// `crio-conmon-<id>` monitors, anything a runtime or a privileged container made there).
pub(super) fn pod_members(cgroups: &CgroupFs, pod_rel: &str) -> Vec<u32> {
    let mut pids = cgroups.procs(pod_rel);
    for container in cgroups.containers(pod_rel) {
        pids.extend(cgroups.procs_recursive(&container.rel));
    }
    pids
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    const UID: &str = "0f5c9b6e-3a7d-4e21-9b8a-1c2d3e4f5a6b";
    const POD: &str =
        "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod0f5c9b6e_3a7d_4e21_9b8a_1c2d3e4f5a6b.slice";

    /// A node of its own: a procfs of fake processes whose `ns/net` link to real namespace files
    /// (this test's network namespace stands for the pod's, its UTS namespace for an app's own
    /// network namespace, nsfs both), the pod's cgroups, and a runtime state directory.
    struct Node {
        dir: PathBuf,
        cgroups: CgroupFs,
    }

    impl Node {
        fn new(tag: &str) -> Node {
            let dir = std::env::temp_dir().join(format!("valet-podns-{tag}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&dir);
            std::fs::create_dir_all(dir.join("proc")).expect("proc");
            std::fs::create_dir_all(dir.join("state")).expect("state");
            let cgroups = CgroupFs::new(dir.join("cgroup"));
            Node { dir, cgroups }
        }

        fn proc(&self) -> PathBuf {
            self.dir.join("proc")
        }

        /// Process `pid`, started at `start`, in `scope` of the pod, its namespace `ns`.
        fn process(&self, pid: u32, start: u64, scope: &str, ns: &str) {
            let dir = self.proc().join(pid.to_string());
            std::fs::create_dir_all(dir.join("ns")).expect("mkdir");
            let fields: Vec<String> = (3..=22).map(|i| if i == 22 { start.to_string() } else { "0".into() }).collect();
            std::fs::write(dir.join("stat"), format!("{pid} (x) {}", fields.join(" "))).expect("stat");
            symlink(ns, dir.join("ns/net")).expect("ns");
            let cg = self.cgroups.abs(&format!("{POD}/{scope}"));
            std::fs::create_dir_all(&cg).expect("cgroup");
            let procs = cg.join("cgroup.procs");
            let before = std::fs::read_to_string(&procs).unwrap_or_default();
            std::fs::write(&procs, format!("{before}{pid}\n")).expect("procs");
        }

        /// The node's own namespace (pid 1's): this test's.
        fn node_is_this_tests(&self) {
            std::fs::create_dir_all(self.proc().join("1/ns")).expect("mkdir");
            symlink("/proc/self/ns/net", self.proc().join("1/ns/net")).expect("ns");
        }

        /// Container `id`'s record, CRI-O's layout, its `linux.namespaces` as given.
        fn record(&self, id: &str, kind: &str, namespaces: &str) {
            let dir = self.dir.join("state").join(id).join("userdata");
            std::fs::create_dir_all(&dir).expect("mkdir");
            let config = format!(
                r#"{{"annotations":{{"io.kubernetes.cri-o.ContainerType":"{kind}","io.kubernetes.container.name":"app",
                "io.kubernetes.pod.uid":"{UID}"}},"linux":{{"namespaces":{namespaces}}}}}"#
            );
            std::fs::write(dir.join("config.json"), config).expect("config");
        }

        fn open(&self) -> Result<Found> {
            let mut bundles = RuntimeBundles::new(vec![self.dir.join("state")], None);
            find_pod_netns(&self.proc(), &self.cgroups, &mut bundles, UID, POD)
        }
    }

    impl Drop for Node {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    fn id(c: char) -> String {
        c.to_string().repeat(64)
    }

    fn inode(path: &str) -> u64 {
        std::fs::metadata(path).expect("stat").ino()
    }

    const POD_NS: &str = "/proc/self/ns/net";
    const APP_OWN_NS: &str = "/proc/self/ns/uts";
    /// The node's, where conmon runs.
    const CONMON_NS: &str = "/proc/self/ns/ipc";

    /// drop_infra_ctr: no pause; conmon (in the node's namespace) started first, then the app,
    /// which made a network namespace of its own, then the proxy, in the pod's.
    fn no_infra(node: &Node) {
        let (app, proxy) = (id('a'), id('b'));
        node.process(50, 1, &format!("crio-conmon-{app}.scope"), CONMON_NS);
        node.process(100, 2, &format!("crio-{app}.scope"), APP_OWN_NS);
        node.process(200, 3, &format!("crio-{proxy}.scope"), POD_NS);
    }

    #[test]
    fn without_a_record_the_oldest_container_process_and_never_conmon() {
        let node = Node::new("oldest");
        no_infra(&node);
        let netns = node.open().expect("opened");
        // The guess records were made to replace: the app's own namespace.
        assert_eq!(netns.via, Via::Oldest(100));
        assert_eq!(netns.inode, inode(APP_OWN_NS));
    }

    #[test]
    fn the_record_names_the_pods_namespace_whatever_the_oldest_process() {
        let node = Node::new("record");
        no_infra(&node);
        // containerd's form of a path (CRI-O's pinned /var/run/netns/<uuid> needs a mount: the
        // node cell's); the pid must be one of the pod's.
        node.record(&id('a'), "container", r#"[{"type":"pid"},{"type":"network","path":"/proc/200/ns/net"}]"#);
        let netns = node.open().expect("opened");
        assert_eq!(netns.via, Via::Record(PathBuf::from("/proc/200/ns/net")));
        assert_eq!(netns.inode, inode(POD_NS));
    }

    #[test]
    fn a_record_naming_a_process_not_of_the_pod_is_refused_not_replaced_by_a_guess() {
        let node = Node::new("conmon");
        no_infra(&node);
        node.record(&id('a'), "container", r#"[{"type":"network","path":"/proc/50/ns/net"}]"#);
        let e = node.open().expect_err("conmon's namespace").to_string();
        assert!(e.contains("no longer a process of the pod"), "{e}");
        // A record naming something that is no namespace: refused too.
        node.record(&id('a'), "container", r#"[{"type":"network","path":"/etc/hostname"}]"#);
        let e = node.open().expect_err("a plain file").to_string();
        assert!(e.contains("records name could be opened"), "{e}");
    }

    #[test]
    fn a_hostnetwork_record_is_refused() {
        let node = Node::new("host");
        no_infra(&node);
        node.record(&id('b'), "container", r#"[{"type":"pid"},{"type":"mount"}]"#);
        let e = node.open().expect_err("hostNetwork").to_string();
        assert!(e.contains("hostNetwork"), "{e}");
    }

    #[test]
    fn the_node_namespace_is_refused_from_a_record_too() {
        let node = Node::new("node");
        node.node_is_this_tests();
        no_infra(&node);
        node.record(&id('b'), "container", r#"[{"type":"network","path":"/proc/200/ns/net"}]"#);
        let e = node.open().expect_err("the node's").to_string();
        assert!(e.contains("node's network namespace"), "{e}");
    }

    #[test]
    fn a_sandbox_that_made_the_namespace_is_entered_through_its_own_process() {
        let node = Node::new("sandbox");
        let (sandbox, app) = (id('c'), id('a'));
        node.process(100, 1, &format!("crio-{app}.scope"), APP_OWN_NS);
        node.process(300, 5, &format!("crio-{sandbox}.scope"), POD_NS);
        node.record(&sandbox, "sandbox", r#"[{"type":"network"},{"type":"ipc"}]"#);
        node.record(&app, "container", r#"[{"type":"network","path":"/proc/999/ns/net"}]"#);
        let netns = node.open().expect("opened");
        assert_eq!(netns.via, Via::Sandbox(300));
        assert_eq!(netns.inode, inode(POD_NS));
    }

    #[test]
    fn paths_resolve_inside_the_root() {
        let node = Node::new("root");
        let root = node.dir.join("runtime-root");
        std::fs::create_dir_all(root.join("run/netns")).expect("mkdir");
        std::fs::create_dir_all(root.join("var")).expect("mkdir");
        std::fs::write(root.join("run/netns/pinned"), "inside").expect("write");
        // Debian's absolute /var/run -> /run: resolved in the root, not the agent's.
        symlink("/run", root.join("var/run")).expect("link");
        let mut text = String::new();
        let mut file = open_in_root(&root, Path::new("/var/run/netns/pinned")).expect("open");
        std::io::Read::read_to_string(&mut file, &mut text).expect("read");
        assert_eq!(text, "inside");
        let escaped = open_in_root(&root, Path::new("/var/run/../../../../etc/hostname"));
        assert!(escaped.is_err(), "`..` left the root");
        assert!(open_in_root(Path::new("/"), Path::new("/proc/self/ns/net")).is_err(), "a magic link followed");
    }
}
