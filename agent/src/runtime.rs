//! Container names from the container runtime's OCI bundles. The runtime writes a container's
//! `config.json` (with the kubelet's annotations) before it starts the container's process, about
//! a second before the API reports the container's id: with the bundles in reach, valet knows a
//! container as soon as its process exits or execs.
//!
//! Where the bundles are, the runtime's own processes say, whatever the node's state paths
//! (kubeadm's `/run/containerd`, k3s's and RKE2's `/run/k3s/containerd`, microk8s's under
//! `/var/snap`): containerd's shim runs with a bundle (`<state>/io.containerd.runtime.v2.task/
//! <namespace>/<id>`) as its working directory, and CRI-O's conmon gets its bundle
//! (`<storage>/overlay-containers/<id>/userdata`) with `-b`. Either is the parent of a container's
//! processes (the grandparent while `runc create` still runs), which the pod's cgroups list: a
//! few reads of `/proc/<pid>/status` up from one of them find it, never a walk of all of `/proc`.
//! The bundles are then read through that process's own procfs links (`/proc/<pid>/root`), so
//! nothing of the runtime's state is mounted into the agent's container: hostPID and
//! CAP_SYS_PTRACE reach them. Fixed directories (`--runtime-state-dirs`, else the well-known ones
//! under the host root) are tried first.
//!
//! Only the annotations that name a container are read from a `config.json`: the rest (the
//! process's environment holds secrets) is skipped by the parser, never kept. A bundle whose pod
//! uid differs from the pod's is ignored. Layouts: containerd `<dir>/<id>/config.json`, CRI-O
//! `<dir>/<id>/userdata/config.json`.

use std::collections::HashSet;
use std::io::Read as _;
use std::path::{Component, Path, PathBuf};

use serde::Deserialize;

use crate::cgroup::layout::is_container_id;
use crate::host::container_main::start_time;

/// The most of a `config.json` read (they are tens of kilobytes; environments can be large, and
/// containerd writes the annotations after the process).
const MAX_CONFIG_BYTES: u64 = 4 * 1024 * 1024;
/// The most of a `mountinfo` read.
const MAX_MOUNTINFO_BYTES: u64 = 1024 * 1024;
/// How many parents up from a container's process the runtime's is looked for: the shim or
/// conmon is the parent, or the grandparent while `runc create` (or crun's) still runs.
const RUNTIME_SEARCH_DEPTH: usize = 4;
/// How many of a pod's processes the runtime's is looked for from, per search.
const MAX_SEARCH_STARTS: usize = 8;
/// How many runtime processes are kept to read bundles through (one serves every pod of its
/// runtime's namespace; more than one runtime on a node is rare).
const MAX_REACHES: usize = 4;

/// Where the runtimes keep the bundles of Kubernetes containers, relative to the host root:
/// containerd's CRI namespace (kubeadm's, k3s's and RKE2's, microk8s's) and CRI-O's storage.
pub const WELL_KNOWN_STATE_DIRS: [&str; 4] = [
    "run/containerd/io.containerd.runtime.v2.task/k8s.io",
    "run/k3s/containerd/io.containerd.runtime.v2.task/k8s.io",
    "var/snap/microk8s/common/run/containerd/io.containerd.runtime.v2.task/k8s.io",
    "run/containers/storage/overlay-containers",
];

/// The name the kubelet gives the pod sandbox (infra container). Container names are DNS-1123
/// labels, lower case: no app or sidecar can be called this.
pub const SANDBOX_NAME: &str = "POD";

/// What a bundle says about a container.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BundleRole {
    /// The pod sandbox (pause).
    Sandbox,
    /// A container of the pod spec, by name.
    Container(String),
}

/// A container's network namespace, as its runtime's record says (`config.json`'s
/// `linux.namespaces`, written by the runtime before the container runs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NetRecord {
    /// No network namespace entry: the runtime's own, the node's (a hostNetwork pod).
    Node,
    /// A new namespace, made with the container: the sandbox's (pause) where nothing pins it.
    Own,
    /// The namespace at this path in the runtime's mount namespace: CRI-O's pinned
    /// `/var/run/netns/<uuid>` (every container's, with or without an infra container),
    /// containerd's `/proc/<pause pid>/ns/net` for the pod's containers.
    Path(PathBuf),
}

/// What a bundle says about a container: its role, its pod's uid, its network namespace (`None`:
/// the record has no `linux.namespaces`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bundle {
    pub role: BundleRole,
    pub uid: Option<String>,
    pub net: Option<NetRecord>,
}

/// The part of a `config.json` valet reads. Every other field (`process`, with its `env`;
/// `mounts`; the rest of `linux`) is skipped by the parser without being built or kept.
#[derive(Deserialize)]
struct OciConfig {
    #[serde(default)]
    annotations: KubeAnnotations,
    #[serde(default)]
    linux: Option<OciLinux>,
}

#[derive(Deserialize)]
struct OciLinux {
    #[serde(default)]
    namespaces: Option<Vec<OciNamespace>>,
}

#[derive(Deserialize)]
struct OciNamespace {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    path: Option<String>,
}

impl OciLinux {
    /// The network namespace entry as a [`NetRecord`]; `None` without a namespaces list, or
    /// with a path that is not absolute.
    fn net(self) -> Option<NetRecord> {
        let namespaces = self.namespaces?;
        let Some(net) = namespaces.into_iter().find(|n| n.kind == "network") else { return Some(NetRecord::Node) };
        match net.path.filter(|p| !p.is_empty()) {
            None => Some(NetRecord::Own),
            Some(path) => Path::new(&path).is_absolute().then(|| NetRecord::Path(PathBuf::from(path))),
        }
    }
}

/// The kubelet's annotations, as containerd's CRI plugin and CRI-O spell them; others skipped.
#[derive(Default, Deserialize)]
struct KubeAnnotations {
    #[serde(rename = "io.kubernetes.cri.container-type")]
    cri_type: Option<String>,
    #[serde(rename = "io.kubernetes.cri-o.ContainerType")]
    crio_type: Option<String>,
    #[serde(rename = "io.kubernetes.cri.container-name")]
    cri_name: Option<String>,
    #[serde(rename = "io.kubernetes.container.name")]
    crio_name: Option<String>,
    #[serde(rename = "io.kubernetes.cri.sandbox-uid")]
    cri_uid: Option<String>,
    #[serde(rename = "io.kubernetes.pod.uid")]
    crio_uid: Option<String>,
}

/// Reads the role and pod uid from a `config.json`'s annotations (containerd or CRI-O keys), and
/// the container's network namespace entry, streaming at most `limit` bytes of it: a longer or
/// malformed file names nothing.
pub fn parse_bundle(reader: impl std::io::Read, limit: u64) -> Option<Bundle> {
    let config: OciConfig = serde_json::from_reader(std::io::BufReader::new(reader.take(limit))).ok()?;
    let a = config.annotations;
    let role = match a.cri_type.or(a.crio_type)?.as_str() {
        "sandbox" => BundleRole::Sandbox,
        "container" => BundleRole::Container(a.cri_name.or(a.crio_name)?),
        _ => return None,
    };
    Some(Bundle { role, uid: a.cri_uid.or(a.crio_uid), net: config.linux.and_then(OciLinux::net) })
}

impl BundleRole {
    /// The container's name, the sandbox as [`SANDBOX_NAME`].
    pub fn name(&self) -> &str {
        match self {
            BundleRole::Sandbox => SANDBOX_NAME,
            BundleRole::Container(name) => name,
        }
    }
}

/// The container a process belongs to, from the kubelet's per-container mounts in its
/// `mountinfo`: the kubelet bind-mounts `/var/lib/kubelet/pods/<uid>/containers/<name>/<n>` as
/// the container's termination log. Only mounts of pod `pod_uid` count.
pub fn name_from_mountinfo(mountinfo: &str, pod_uid: &str) -> Option<String> {
    let marker = format!("/pods/{pod_uid}/containers/");
    mountinfo.lines().find_map(|line| {
        // Field 4 is the mount's root within its file system.
        let root = line.split(' ').nth(3)?;
        let rest = &root[root.find(&marker)? + marker.len()..];
        let name = rest.split('/').next()?;
        let valid = !name.is_empty()
            && name.len() <= 63
            && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
        valid.then(|| name.to_owned())
    })
}

/// [`name_from_mountinfo`] for a live process, read from `<host_proc>/<pid>/mountinfo`.
pub fn name_of_process(host_proc: &std::path::Path, pid: u32, pod_uid: &str) -> Option<String> {
    let file = std::fs::File::open(host_proc.join(pid.to_string()).join("mountinfo")).ok()?;
    let mut text = String::new();
    file.take(MAX_MOUNTINFO_BYTES).read_to_string(&mut text).ok()?;
    name_from_mountinfo(&text, pod_uid)
}

/// A runtime process through which bundles are read.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Reach {
    pid: u32,
    /// Its start time (clock ticks after boot): the same pid with another start time is another
    /// process, whose links lead elsewhere.
    start: u64,
    /// The directory of the bundles, through the process's `root` link.
    dir: PathBuf,
}

/// Where the paths a bundle names are resolved: in the host root of the fixed directories, or in
/// the mount namespace of the runtime process the bundle was read through (while it is the one
/// found: `start` is its start time).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RecordRoot {
    Dir(PathBuf),
    Process { pid: u32, start: u64 },
}

/// Where container bundles are read from.
#[derive(Clone, Debug, Default)]
pub struct RuntimeBundles {
    /// Fixed directories, tried first.
    dirs: Vec<PathBuf>,
    /// The host's root, where the paths of the fixed directories' bundles are resolved.
    root: PathBuf,
    /// The host's procfs (runtime processes are found and read through it); none: fixed
    /// directories only.
    host_proc: Option<PathBuf>,
    /// Runtime processes found so far, newest first.
    reaches: Vec<Reach>,
}

/// The directory holding a bundle's siblings: the part of an absolute bundle path before its
/// container id component (`…/k8s.io/<id>` and `…/overlay-containers/<id>/userdata` alike).
pub fn state_dir_of_bundle(bundle: &Path) -> Option<PathBuf> {
    let parts: Vec<Component<'_>> = bundle.components().collect();
    if parts.first() != Some(&Component::RootDir)
        || parts.iter().any(|c| !matches!(c, Component::Normal(_) | Component::RootDir))
    {
        return None;
    }
    let at = parts.iter().rposition(|c| c.as_os_str().to_str().is_some_and(is_container_id))?;
    Some(parts[..at].iter().collect())
}

/// A process's parent (`PPid`) and how many pid namespaces see it (the length of `NSpid`: 1 for a
/// process of the host's), from its `status`.
fn parent_and_depth(host_proc: &Path, pid: u32) -> Option<(u32, usize)> {
    let status = std::fs::read_to_string(host_proc.join(pid.to_string()).join("status")).ok()?;
    let ppid = status.lines().find_map(|l| l.strip_prefix("PPid:"))?.trim().parse().ok()?;
    let depth = crate::host::proc::nspid(&status)?.len();
    Some((ppid, depth))
}

/// The bundle a runtime process works on: a containerd shim's working directory, or conmon's
/// `-b`/`--bundle` argument. `None` for any other process.
fn runtime_bundle(host_proc: &Path, pid: u32) -> Option<PathBuf> {
    let dir = host_proc.join(pid.to_string());
    // The executable, not `comm` (which any process may set); a shim left running by an upgrade
    // of its binary shows as "<path> (deleted)".
    let exe = std::fs::read_link(dir.join("exe")).ok()?;
    let exe = exe.file_name()?.to_str()?;
    let exe = exe.strip_suffix(" (deleted)").unwrap_or(exe);
    if exe.starts_with("containerd-shim") {
        return std::fs::read_link(dir.join("cwd")).ok();
    }
    if exe != "conmon" {
        return None;
    }
    let mut cmdline = Vec::new();
    std::fs::File::open(dir.join("cmdline")).ok()?.take(64 * 1024).read_to_end(&mut cmdline).ok()?;
    let args: Vec<&str> = cmdline.split(|b| *b == 0).filter_map(|a| std::str::from_utf8(a).ok()).collect();
    args.iter().enumerate().find_map(|(i, arg)| match *arg {
        "-b" | "--bundle" => args.get(i + 1).map(PathBuf::from),
        _ => arg.strip_prefix("--bundle=").map(PathBuf::from),
    })
}

impl RuntimeBundles {
    /// `dirs`: fixed directories; `host_proc`: where runtime processes are looked for.
    pub fn new(dirs: Vec<PathBuf>, host_proc: Option<PathBuf>) -> RuntimeBundles {
        RuntimeBundles { dirs, root: PathBuf::from("/"), host_proc, reaches: Vec::new() }
    }

    /// The host's root (where the fixed directories' bundles name paths), `/` unless set.
    pub fn with_root(mut self, root: PathBuf) -> RuntimeBundles {
        self.root = root;
        self
    }

    /// The role of container `id` in the pod with uid `pod_uid`, if a bundle says so: from the
    /// fixed directories, else through a runtime process found before.
    pub fn role(&mut self, id: &str, pod_uid: &str) -> Option<BundleRole> {
        self.bundle(id, pod_uid).map(|(bundle, _)| bundle.role)
    }

    /// Container `id`'s bundle, if it is of pod `pod_uid`, and where the paths it names are.
    pub fn bundle(&mut self, id: &str, pod_uid: &str) -> Option<(Bundle, RecordRoot)> {
        // Only a container id is ever joined to a directory.
        if !is_container_id(id) {
            return None;
        }
        if let Some(bundle) = self.dirs.iter().find_map(|dir| read_bundle(dir, id, pod_uid)) {
            return Some((bundle, RecordRoot::Dir(self.root.clone())));
        }
        let proc = self.host_proc.clone()?;
        let mut found = None;
        self.reaches.retain(|r| {
            if found.is_some() {
                return true;
            }
            let (bundle, alive) = read_bundle_through(&proc, r, id, pod_uid);
            found = bundle.map(|b| (b, RecordRoot::Process { pid: r.pid, start: r.start }));
            alive
        });
        found
    }

    /// The container records (containerd's CRI checkpoints) below the root of each runtime
    /// process found so far that still lives.
    pub fn record_dirs(&self) -> Vec<crate::runtime_record::RecordDir> {
        let mut dirs = Vec::new();
        if let Some(proc) = &self.host_proc {
            for r in self.reaches.iter().filter(|r| start_time(proc, r.pid) == Some(r.start)) {
                let root = proc.join(r.pid.to_string()).join("root");
                dirs.extend(crate::runtime_record::dirs_under(&root, Some((r.pid, r.start))));
            }
        }
        dirs
    }

    /// How many runtime processes bundles are read through (each alive when last used).
    pub fn reaches(&self) -> usize {
        self.reaches.len()
    }

    /// Looks for the runtime process that started a pod's containers, up from its processes
    /// (`starts`, the container's own first; `pod_procs`: every process of the pod, never taken
    /// for the runtime's). Returns whether one was found that was not known yet.
    pub fn find_runtime(&mut self, starts: &[u32], pod_procs: &HashSet<u32>) -> bool {
        let Some(proc) = self.host_proc.clone() else { return false };
        for &start in starts.iter().take(MAX_SEARCH_STARTS) {
            let mut pid = start;
            for _ in 0..RUNTIME_SEARCH_DEPTH {
                let Some((parent, _)) = parent_and_depth(&proc, pid) else { break };
                // 0: the kernel's; 1: the node's init, never a runtime process.
                if parent <= 1 {
                    break;
                }
                pid = parent;
                if pod_procs.contains(&pid) {
                    continue;
                }
                // The host's pid namespace only: a process in a pod's namespace is a pod's.
                if parent_and_depth(&proc, pid).map(|(_, depth)| depth) != Some(1) {
                    break;
                }
                let Some(bundle) = runtime_bundle(&proc, pid) else { continue };
                let Some(state) = state_dir_of_bundle(&bundle) else { break };
                let Some(started) = start_time(&proc, pid) else { break };
                // Read through its root: the path is the runtime's, in its mount namespace.
                let dir = proc.join(pid.to_string()).join("root").join(state.strip_prefix("/").unwrap_or(&state));
                let reach = Reach { pid, start: started, dir };
                if self.reaches.contains(&reach) {
                    return false;
                }
                self.reaches.insert(0, reach);
                self.reaches.truncate(MAX_REACHES);
                return true;
            }
        }
        false
    }
}

/// Reads container `id`'s bundle in `dir` (either runtime's layout); its role if it is of pod
/// `pod_uid`.
fn read_bundle(dir: &Path, id: &str, pod_uid: &str) -> Option<Bundle> {
    [dir.join(id).join("config.json"), dir.join(id).join("userdata/config.json")].into_iter().find_map(|path| {
        let file = std::fs::File::open(path).ok()?;
        parse_bundle(file, MAX_CONFIG_BYTES).filter(|b| b.uid.as_deref() == Some(pod_uid))
    })
}

/// [`read_bundle`] through a runtime process's links, and whether that process is still the one
/// found (checked after the open: what was opened was reached through it).
fn read_bundle_through(host_proc: &Path, reach: &Reach, id: &str, pod_uid: &str) -> (Option<Bundle>, bool) {
    let alive = || start_time(host_proc, reach.pid) == Some(reach.start);
    let files = [reach.dir.join(id).join("config.json"), reach.dir.join(id).join("userdata/config.json")];
    for path in files {
        let Ok(file) = std::fs::File::open(path) else { continue };
        if !alive() {
            return (None, false);
        }
        return (parse_bundle(file, MAX_CONFIG_BYTES).filter(|b| b.uid.as_deref() == Some(pod_uid)), true);
    }
    (None, alive())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::fake_proc::FakeProc;

    const CONTAINERD: &str = r#"{"ociVersion":"1.1.0","annotations":{
        "io.kubernetes.cri.container-type":"container",
        "io.kubernetes.cri.container-name":"istio-proxy",
        "io.kubernetes.cri.sandbox-uid":"0b5e1f6e-2a4b-4c3d-8e9f-0a1b2c3d4e5f"}}"#;
    const CRIO_SANDBOX: &str = r#"{"annotations":{
        "io.kubernetes.cri-o.ContainerType":"sandbox",
        "io.kubernetes.pod.uid":"0b5e1f6e-2a4b-4c3d-8e9f-0a1b2c3d4e5f"}}"#;
    const UID: &str = "0b5e1f6e-2a4b-4c3d-8e9f-0a1b2c3d4e5f";

    fn parse(text: &str) -> Option<(BundleRole, Option<String>)> {
        parse_limited(text, MAX_CONFIG_BYTES)
    }

    /// The role and pod uid of a record read with at most `limit` bytes.
    fn parse_limited(text: &str, limit: u64) -> Option<(BundleRole, Option<String>)> {
        parse_bundle(text.as_bytes(), limit).map(|b| (b.role, b.uid))
    }

    #[test]
    fn names_a_container_from_the_kubelets_mounts() {
        let info = format!(
            "1301 1290 0:112 / / rw,relatime - overlay overlay rw\n\
             1320 1301 8:1 /var/lib/kubelet/pods/{UID}/etc-hosts /etc/hosts rw - ext4 /dev/sda1 rw\n\
             1321 1301 8:1 /var/lib/kubelet/pods/{UID}/containers/istio-proxy/5a1c2e3f /dev/termination-log rw - ext4 /dev/sda1 rw\n"
        );
        assert_eq!(name_from_mountinfo(&info, UID).as_deref(), Some("istio-proxy"));
        assert_eq!(name_from_mountinfo(&info, "11111111-2222-4333-8444-555555555555"), None, "another pod's");
        let odd = format!("1 1 8:1 /var/lib/kubelet/pods/{UID}/containers/Bad_Name/1 /x rw - ext4 /dev/sda1 rw\n");
        assert_eq!(name_from_mountinfo(&odd, UID), None);
        assert_eq!(name_from_mountinfo("garbage", UID), None);
        assert_eq!(name_of_process(std::path::Path::new("/proc"), std::process::id(), UID), None);
    }

    #[test]
    fn parses_both_runtimes_and_rejects_the_rest() {
        assert_eq!(parse(CONTAINERD), Some((BundleRole::Container("istio-proxy".into()), Some(UID.into()))));
        assert_eq!(parse(CRIO_SANDBOX), Some((BundleRole::Sandbox, Some(UID.into()))));
        assert_eq!(parse("not json"), None);
        assert_eq!(parse(r#"{"annotations":{}}"#), None);
        assert_eq!(parse(r#"{"annotations":{"io.kubernetes.cri.container-type":"container"}}"#), None);
        assert_eq!(parse(r#"{"annotations":{"io.kubernetes.cri.container-type":"weird"}}"#), None);
    }

    #[test]
    fn reads_the_network_namespace_the_record_names() {
        let net = |namespaces: &str| {
            let text = format!(
                r#"{{"annotations":{{"io.kubernetes.cri-o.ContainerType":"container",
                "io.kubernetes.container.name":"app","io.kubernetes.pod.uid":"{UID}"}},
                "process":{{"env":["SECRET=x"]}},"linux":{{"resources":{{}},"namespaces":{namespaces}}}}}"#
            );
            parse_bundle(text.as_bytes(), MAX_CONFIG_BYTES).expect("parsed").net
        };
        // CRI-O, with or without an infra container: the pinned namespace.
        let pinned = r#"[{"type":"pid"},{"type":"network","path":"/var/run/netns/1502d2b9"},{"type":"ipc"}]"#;
        assert_eq!(net(pinned), Some(NetRecord::Path("/var/run/netns/1502d2b9".into())));
        // The sandbox that makes it; a hostNetwork pod's container (no entry).
        assert_eq!(net(r#"[{"type":"network"},{"type":"uts"}]"#), Some(NetRecord::Own));
        assert_eq!(net(r#"[{"type":"network","path":""}]"#), Some(NetRecord::Own));
        assert_eq!(net(r#"[{"type":"pid"},{"type":"mount"}]"#), Some(NetRecord::Node));
        // A relative path names nothing; no namespaces list is no record.
        assert_eq!(net(r#"[{"type":"network","path":"netns/x"}]"#), None);
        assert_eq!(net("null"), None);
        assert_eq!(parse_bundle(CONTAINERD.as_bytes(), MAX_CONFIG_BYTES).expect("parsed").net, None);
        // A malformed entry is a malformed record: nothing read from it.
        let text =
            r#"{"annotations":{"io.kubernetes.cri-o.ContainerType":"sandbox"},"linux":{"namespaces":[{"path":"/x"}]}}"#;
        assert_eq!(parse_bundle(text.as_bytes(), MAX_CONFIG_BYTES), None);
    }

    #[test]
    fn only_the_naming_annotations_are_read_and_the_read_is_bounded() {
        // containerd writes `process` (and its environment) before the annotations. Whatever it
        // holds, in whatever shape, is skipped: only the declared annotations are built.
        let secret = "s3cr3t-".repeat(10_000);
        let config = format!(
            r#"{{"ociVersion":"1.2.0","process":{{"env":["PATH=/bin","DB_PASSWORD={secret}"],"args":[1,{{"x":null}}]}},
               "mounts":[{{"destination":"/run/secrets","options":["ro"]}}],
               "annotations":{{"io.kubernetes.cri.container-type":"container",
                 "io.kubernetes.cri.container-name":"app","io.kubernetes.cri.sandbox-uid":"{UID}",
                 "io.kubernetes.cri.sandbox-namespace":"batch","other":"{{\"nested\":1}}"}},
               "linux":{{"namespaces":[{{"type":"pid"}}]}}}}"#
        );
        assert_eq!(parse(&config), Some((BundleRole::Container("app".into()), Some(UID.into()))));
        // A file longer than the bound names nothing (no partial read taken for a whole one).
        assert_eq!(parse_limited(&config, config.len() as u64 - 1), None);
        assert_eq!(parse_limited(&config, 64), None);
    }

    #[test]
    fn looks_up_bundles_on_disk_and_checks_the_pod() {
        let dir = std::env::temp_dir().join(format!("valet-bundles-{}", std::process::id()));
        let a = "a".repeat(64);
        let b = "b".repeat(64);
        std::fs::create_dir_all(dir.join(&a)).expect("mkdir");
        std::fs::create_dir_all(dir.join(&b).join("userdata")).expect("mkdir");
        std::fs::write(dir.join(&a).join("config.json"), CONTAINERD).expect("write");
        std::fs::write(dir.join(&b).join("userdata/config.json"), CRIO_SANDBOX).expect("write");
        let mut bundles = RuntimeBundles::new(vec![dir.clone()], None);
        let found = (
            bundles.role(&a, UID),
            bundles.role(&b, UID),
            bundles.role(&a, "11111111-2222-4333-8444-555555555555"),
            bundles.role("../../etc/passwd", UID),
            bundles.role(&"c".repeat(64), UID),
            bundles.role(&"A".repeat(64), UID),
        );
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(found.0, Some(BundleRole::Container("istio-proxy".into())));
        assert_eq!(found.1, Some(BundleRole::Sandbox));
        assert_eq!(found.2, None, "a bundle of another pod is ignored");
        assert_eq!(found.3, None, "only container ids are looked up");
        assert_eq!(found.4, None);
        assert_eq!(found.5, None);
        assert!(!bundles.find_runtime(&[1, 2], &HashSet::new()), "no procfs given: no search");
    }

    #[test]
    fn a_bundles_state_directory_is_before_its_container_id() {
        let id = "0123456789abcdef".repeat(4);
        let some = |s: &str| Some(s.to_owned());
        let cases = [
            (
                format!("/run/k3s/containerd/io.containerd.runtime.v2.task/k8s.io/{id}"),
                some("/run/k3s/containerd/io.containerd.runtime.v2.task/k8s.io"),
            ),
            (
                format!("/run/containers/storage/overlay-containers/{id}/userdata"),
                some("/run/containers/storage/overlay-containers"),
            ),
            (format!("/a/{id}/b/{id}/userdata"), Some(format!("/a/{id}/b"))),
            ("/run/containerd/io.containerd.runtime.v2.task/k8s.io/not-an-id".to_owned(), None),
            (format!("relative/{id}"), None),
            (format!("/x/../{id}"), None),
            (format!("/x/{}", id.to_uppercase()), None),
        ];
        for (bundle, want) in cases {
            assert_eq!(state_dir_of_bundle(Path::new(&bundle)), want.map(PathBuf::from), "{bundle}");
        }
    }

    fn config(name: &str, uid: &str) -> String {
        format!(
            r#"{{"annotations":{{"io.kubernetes.cri.container-type":"container",
                "io.kubernetes.cri.container-name":"{name}","io.kubernetes.cri.sandbox-uid":"{uid}"}}}}"#
        )
    }

    #[test]
    fn finds_the_bundles_through_the_shim_that_started_the_pod() {
        let fake = FakeProc::new("shim");
        // k3s's state path, which no fixed directory names.
        let state = fake.root.join("run/k3s/containerd/io.containerd.runtime.v2.task/k8s.io");
        let (sandbox, app, other) = ("5".repeat(64), "a".repeat(64), "b".repeat(64));
        fake.bundle(&state, &sandbox, r#"{"annotations":{"io.kubernetes.cri.container-type":"sandbox"}}"#);
        fake.bundle(&state, &app, &config("report", UID));
        fake.bundle(&state, &other, &config("istio-proxy", UID));
        fake.shim(50, 1000, &state.join(&sandbox));
        // The app's init (pid 1 of its namespace), started by `runc create` (pid 60, the host's
        // namespace), which the shim started.
        fake.process(60, 50, "60", 1001);
        fake.process(100, 60, "100\t1", 1002);
        let mut bundles = RuntimeBundles::new(vec![fake.root.join("run/containerd/nothing-here")], Some(fake.proc()));
        assert_eq!(bundles.role(&app, UID), None, "not in the fixed directories");
        let pod: HashSet<u32> = [100].into();
        assert!(bundles.find_runtime(&[100], &pod), "the shim, two parents up");
        assert!(!bundles.find_runtime(&[100], &pod), "already known");
        assert_eq!(bundles.role(&app, UID), Some(BundleRole::Container("report".into())));
        // One shim reaches every bundle of its namespace, other pods' containers too.
        assert_eq!(bundles.role(&other, UID), Some(BundleRole::Container("istio-proxy".into())));
        assert_eq!(bundles.role(&other, "11111111-2222-4333-8444-555555555555"), None, "another pod's uid");
        // The shim exits and its pid goes to another process: its links are not followed.
        fake.process(50, 1, "50", 2000);
        assert_eq!(bundles.role(&app, UID), None);
        assert_eq!(bundles.reaches(), 0, "a runtime process that is gone is dropped");
    }

    /// containerd's CRI records are read through the shim found, below its root (the host's,
    /// from the shim's mount namespace), while the shim is the one found.
    #[test]
    fn the_runtimes_records_are_read_through_the_shim_that_started_the_pod() {
        use crate::runtime_record::{Record, read_any};
        let fake = FakeProc::new("records");
        let app = "a".repeat(64);
        fake.k3s_shim_with_ended_record(50, 1000, &app);
        fake.process(100, 50, "100\t1", 1002);
        let mut bundles = RuntimeBundles::new(Vec::new(), Some(fake.proc()));
        assert!(bundles.record_dirs().is_empty(), "no runtime process found yet");
        assert!(bundles.find_runtime(&[100], &[100].into()), "the shim");
        assert_eq!(read_any(&fake.proc(), &bundles.record_dirs(), &app), Record::Ended);
        // The shim's pid goes to another process: nothing is read through it.
        fake.process(50, 1, "50", 2000);
        assert_eq!(read_any(&fake.proc(), &bundles.record_dirs(), &app), Record::Absent);
    }

    #[test]
    fn a_pods_own_process_is_never_taken_for_the_runtime() {
        let fake = FakeProc::new("forged");
        let state = fake.root.join("run/containerd/io.containerd.runtime.v2.task/k8s.io");
        let forged = fake.root.join("forged/k8s.io");
        let (sandbox, app) = ("5".repeat(64), "a".repeat(64));
        fake.bundle(&state, &sandbox, "{}");
        fake.bundle(&state, &app, &config("report", UID));
        fake.bundle(&forged, &sandbox, "{}");
        fake.bundle(&forged, &app, &config("istio-proxy", UID));
        fake.shim(50, 1000, &state.join(&sandbox));
        // A hostPID pod's process (the host's namespace) running a binary named like a shim, with
        // a forged bundle as its working directory, parent of the pod's other process.
        fake.shim(70, 1001, &forged.join(&sandbox));
        let status = fake.proc().join("70/status");
        std::fs::write(&status, "PPid:\t50\nNSpid:\t70\n").expect("status");
        fake.process(100, 70, "100", 1002);
        // A container process's parent in a pod's pid namespace is not a runtime's either.
        fake.process(200, 201, "200\t2", 1003);
        let deep = fake.process(201, 50, "201\t1", 1004);
        std::os::unix::fs::symlink("/usr/bin/conmon", deep.join("exe")).expect("exe");
        let mut bundles = RuntimeBundles::new(Vec::new(), Some(fake.proc()));
        assert!(!bundles.find_runtime(&[200], &HashSet::from([200])), "its parent is in a pod's namespace");
        assert!(bundles.find_runtime(&[100], &HashSet::from([100, 70])));
        assert_eq!(bundles.role(&app, UID), Some(BundleRole::Container("report".into())), "the real shim's");
    }

    #[test]
    fn finds_the_bundles_through_a_live_shims_procfs_links() {
        // A real process tree: a shell run as `containerd-shim-runc-v2` from a bundle directory,
        // and its child, read through this host's /proc.
        let fake = FakeProc::new("live");
        let state = fake.root.join("run/k3s/containerd/io.containerd.runtime.v2.task/k8s.io");
        let (sandbox, app) = ("5".repeat(64), "a".repeat(64));
        fake.bundle(&state, &sandbox, "{}");
        fake.bundle(&state, &app, &config("report", UID));
        let shim_exe = fake.root.join("containerd-shim-runc-v2");
        std::fs::copy("/bin/sh", &shim_exe).expect("copy sh");
        let mut shim = std::process::Command::new(&shim_exe)
            .args(["-c", "sleep 30 & echo $!; wait"])
            .current_dir(state.join(&sandbox))
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("spawn shim");
        let mut line = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(shim.stdout.as_mut().expect("stdout")), &mut line)
            .expect("child pid");
        let child: u32 = line.trim().parse().expect("pid");
        let mut bundles = RuntimeBundles::new(Vec::new(), Some(PathBuf::from("/proc")));
        let found = bundles.find_runtime(&[child], &HashSet::from([child]));
        let role = bundles.role(&app, UID);
        let _ = shim.kill();
        let _ = shim.wait();
        let _ = crate::host::sys::kill(child, libc::SIGKILL);
        assert!(found, "the shim, the child's parent");
        assert_eq!(role, Some(BundleRole::Container("report".into())));
        assert_eq!(bundles.role(&app, UID), None, "the shim is gone: not read through any more");
    }

    #[test]
    fn finds_cri_o_bundles_through_conmon() {
        let fake = FakeProc::new("conmon");
        let storage = fake.root.join("var/lib/crio/overlay-containers");
        let (app, other) = ("a".repeat(64), "b".repeat(64));
        for (id, name) in [(&app, "report"), (&other, "istio-proxy")] {
            std::fs::create_dir_all(storage.join(id).join("userdata")).expect("mkdir");
            std::fs::write(storage.join(id).join("userdata/config.json"), config(name, UID)).expect("config");
        }
        let dir = fake.process(40, 1, "40", 500);
        std::os::unix::fs::symlink("/usr/libexec/crio/conmon (deleted)", dir.join("exe")).expect("exe");
        std::os::unix::fs::symlink("/", dir.join("root")).expect("root");
        let bundle = storage.join(&app).join("userdata");
        let cmdline = format!("/usr/libexec/crio/conmon\0-c\0{app}\0-b\0{}\0--log-level\0info\0", bundle.display());
        std::fs::write(dir.join("cmdline"), cmdline).expect("cmdline");
        fake.process(100, 40, "100\t1", 501);
        let mut bundles = RuntimeBundles::new(Vec::new(), Some(fake.proc()));
        assert!(bundles.find_runtime(&[100], &HashSet::from([100])));
        assert_eq!(bundles.role(&other, UID), Some(BundleRole::Container("istio-proxy".into())));
    }
}
