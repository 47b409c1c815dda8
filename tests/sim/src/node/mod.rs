//! Kubelet-shaped pods made of real kernel objects (needs root): the kubelet's cgroup layout
//! for either cgroup driver and runtime, a network namespace with a veth to the host, and
//! container processes placed in their cgroup, netns and (optionally) their own pid namespace
//! before they exec.

use std::collections::BTreeMap;
use std::fs::File;
use std::io;
use std::net::Ipv4Addr;
use std::os::fd::AsRawFd as _;
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use anyhow::{Context as _, Result, anyhow};
use serde_json::json;

use crate::util;

mod cgroups;
mod leases;
mod net;
mod podjson;
mod process;

use cgroups::{cgroup_names, leaf_name, remove_tree, sim_containers};
use leases::process_start_time;
pub use leases::{lease_dir, reap_stale_leases, sim_state_dir, subnet_dir};
use net::{SubnetClaim, ip};
use podjson::default_image;
pub use podjson::{PodJsonOptions, mark_container_terminated, set_pod_phase};
pub use process::{Output, SimProcess, SpawnOptions, exec_helper};

/// Finds the cgroup2 mount.
pub struct CgroupRoot;

impl CgroupRoot {
    /// The cgroup2 mount point from `/proc/self/mountinfo` (`/sys/fs/cgroup` on cgroup v2 hosts,
    /// `/sys/fs/cgroup/unified` on hybrid ones).
    pub fn detect() -> Result<PathBuf> {
        let text = std::fs::read_to_string("/proc/self/mountinfo").context("read /proc/self/mountinfo")?;
        CgroupRoot::from_mountinfo(&text).ok_or_else(|| anyhow!("no cgroup2 filesystem is mounted"))
    }

    /// Parses mountinfo text; prefers the usual locations when several cgroup2 mounts exist.
    pub fn from_mountinfo(text: &str) -> Option<PathBuf> {
        let mut found = Vec::new();
        for line in text.lines() {
            let Some((left, right)) = line.split_once(" - ") else {
                continue;
            };
            if right.split_whitespace().next() != Some("cgroup2") {
                continue;
            }
            if let Some(mp) = left.split_whitespace().nth(4) {
                found.push(PathBuf::from(unescape_mountinfo(mp)));
            }
        }
        for preferred in ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"] {
            if let Some(p) = found.iter().find(|p| p.as_os_str() == preferred) {
                return Some(p.clone());
            }
        }
        found.into_iter().next()
    }
}

/// mountinfo escapes space, tab, newline and backslash as `\ooo`.
fn unescape_mountinfo(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c)) {
            out.push((b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0'));
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The cgroup id the kernel reports (`bpf_get_current_cgroup_id`): the directory's inode.
pub fn cgroup_id(path: impl AsRef<Path>) -> Result<u64> {
    let p = path.as_ref();
    Ok(std::fs::metadata(p).with_context(|| format!("stat {}", p.display()))?.ino())
}

/// Runs `f` on a fresh thread that has joined the network namespace at `netns` (a
/// `/run/netns/NAME` or `/proc/PID/ns/net` path), the way valet reaches a pod's loopback.
pub fn in_netns<T: Send>(netns: impl AsRef<Path>, f: impl FnOnce() -> T + Send) -> Result<T> {
    let path = netns.as_ref();
    let file = File::open(path).with_context(|| format!("open {}", path.display()))?;
    std::thread::scope(|s| {
        s.spawn(move || -> Result<T> {
            // SAFETY: plain syscall on a valid fd; it only changes this short-lived thread.
            if unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
                return Err(io::Error::last_os_error()).context("setns(CLONE_NEWNET)");
            }
            Ok(f())
        })
        .join()
        .map_err(|_| anyhow!("the closure run in the netns panicked"))?
    })
}

/// Kubernetes QoS class of a pod (decides the cgroup parent).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QosClass {
    Guaranteed,
    Burstable,
    BestEffort,
}

impl QosClass {
    /// As `status.qosClass` spells it.
    pub fn as_str(self) -> &'static str {
        match self {
            QosClass::Guaranteed => "Guaranteed",
            QosClass::Burstable => "Burstable",
            QosClass::BestEffort => "BestEffort",
        }
    }
    /// As the cgroup names spell it; None for Guaranteed (no QoS level in the path).
    fn cgroup_name(self) -> Option<&'static str> {
        match self {
            QosClass::Guaranteed => None,
            QosClass::Burstable => Some("burstable"),
            QosClass::BestEffort => Some("besteffort"),
        }
    }
}

/// The kubelet's cgroup driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CgroupDriver {
    Systemd,
    Cgroupfs,
}

/// The container runtime (decides scope prefixes and the containerID scheme).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Runtime {
    Containerd,
    Crio,
    Docker,
}

impl Runtime {
    /// The systemd scope prefix.
    pub fn scope_prefix(self) -> &'static str {
        match self {
            Runtime::Containerd => "cri-containerd-",
            Runtime::Crio => "crio-",
            Runtime::Docker => "docker-",
        }
    }
    /// The scheme of `status.containerStatuses[].containerID`.
    pub fn id_scheme(self) -> &'static str {
        match self {
            Runtime::Containerd => "containerd",
            Runtime::Crio => "cri-o",
            Runtime::Docker => "docker",
        }
    }
}

/// One container to create.
#[derive(Debug, Clone, Default)]
pub struct ContainerOptions {
    pub name: String,
    /// 64 hex characters; random when None.
    pub id: Option<String>,
    /// Image for the pod JSON (defaults from the name: `istio-proxy` → an Istio proxy image).
    pub image: Option<String>,
    /// Container ports for the pod JSON.
    pub ports: Vec<u16>,
}

impl ContainerOptions {
    pub fn new(name: &str) -> ContainerOptions {
        ContainerOptions { name: name.to_string(), ..Default::default() }
    }
}

/// What [`SimPod::create`] builds.
#[derive(Debug, Clone)]
pub struct SimPodOptions {
    pub name: String,
    pub namespace: String,
    /// Pod UID; a random UUID v4 when None.
    pub uid: Option<String>,
    pub qos: QosClass,
    pub driver: CgroupDriver,
    pub runtime: Runtime,
    pub containers: Vec<ContainerOptions>,
    /// Create a network namespace with a veth pair and a pod IP.
    pub netns: bool,
    /// Override the cgroup2 root (default: [`CgroupRoot::detect`]).
    pub cgroup_root: Option<PathBuf>,
    /// Create only the pod's cgroup: the sandbox's and the containers' are made when they start
    /// ([`SimPod::make_container_cgroup`]), as the runtime does (the simulated kubelet does this).
    pub lazy_cgroups: bool,
    /// Run container processes as crun does (systemd driver, containerd or CRI-O): one cgroup
    /// below the container's, in `<scope>/container`, the scope itself left empty.
    pub crun: bool,
}

impl SimPodOptions {
    /// A Burstable containerd pod with the systemd driver, a netns and no containers yet.
    pub fn new(name: &str) -> SimPodOptions {
        SimPodOptions {
            name: name.to_string(),
            namespace: "default".into(),
            uid: None,
            qos: QosClass::Burstable,
            driver: CgroupDriver::Systemd,
            runtime: Runtime::Containerd,
            containers: Vec::new(),
            netns: true,
            cgroup_root: None,
            lazy_cgroups: false,
            crun: false,
        }
    }
    pub fn namespace(mut self, ns: &str) -> Self {
        self.namespace = ns.to_string();
        self
    }
    pub fn uid(mut self, uid: &str) -> Self {
        self.uid = Some(uid.to_string());
        self
    }
    pub fn qos(mut self, qos: QosClass) -> Self {
        self.qos = qos;
        self
    }
    pub fn driver(mut self, driver: CgroupDriver) -> Self {
        self.driver = driver;
        self
    }
    pub fn runtime(mut self, runtime: Runtime) -> Self {
        self.runtime = runtime;
        self
    }
    pub fn container(mut self, name: &str) -> Self {
        self.containers.push(ContainerOptions::new(name));
        self
    }
    pub fn container_with(mut self, c: ContainerOptions) -> Self {
        self.containers.push(c);
        self
    }
    pub fn netns(mut self, on: bool) -> Self {
        self.netns = on;
        self
    }
    pub fn cgroup_root(mut self, root: impl Into<PathBuf>) -> Self {
        self.cgroup_root = Some(root.into());
        self
    }
    pub fn lazy_cgroups(mut self, on: bool) -> Self {
        self.lazy_cgroups = on;
        self
    }
    pub fn crun(mut self, on: bool) -> Self {
        self.crun = on;
        self
    }
}

/// A created container (or the sandbox).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimContainer {
    pub name: String,
    /// 64 hex characters.
    pub id: String,
    pub image: String,
    pub ports: Vec<u16>,
    /// Absolute path of its cgroup directory.
    pub cgroup: PathBuf,
}

#[derive(Debug)]
struct PodNet {
    ns_name: String,
    ns_path: PathBuf,
    host_if: String,
    pod_ip: Ipv4Addr,
    host_ip: Ipv4Addr,
}

/// Cgroup directories shared by pods of this process (`kubepods.slice`, the QoS level) with the
/// number of pods using each: the last user removes a directory the sim created.
static SHARED_DIRS: Mutex<BTreeMap<PathBuf, usize>> = Mutex::new(BTreeMap::new());

/// A pod made of kernel objects; everything it created is removed on drop.
#[derive(Debug)]
pub struct SimPod {
    name: String,
    namespace: String,
    uid: String,
    qos: QosClass,
    driver: CgroupDriver,
    runtime: Runtime,
    /// Container processes run in crun's `container` cgroup below the container's.
    crun: bool,
    root: PathBuf,
    pod_cgroup: PathBuf,
    sandbox: SimContainer,
    /// The current instance of each container, in spec order (a restart gives a new one).
    containers: Mutex<Vec<SimContainer>>,
    /// Shared ancestors this pod holds a reference on, root first.
    shared_held: Vec<PathBuf>,
    /// Directories this pod created, parents first.
    owned: Mutex<Vec<PathBuf>>,
    net: Option<PodNet>,
    /// Whether the network setup got as far as creating it.
    netns_created: Option<String>,
    /// Random id naming the netns and veth.
    short: String,
    /// The lease file recording what this pod created.
    lease: Option<PathBuf>,
    /// The pod network's subnet, claimed until the host's end of the pair is gone.
    subnet: Option<SubnetClaim>,
}

impl SimPod {
    /// Creates the cgroups (and the netns when asked). On error, whatever was made is removed.
    pub fn create(opts: SimPodOptions) -> Result<SimPod> {
        let root = match &opts.cgroup_root {
            Some(r) => r.clone(),
            None => CgroupRoot::detect()?,
        };
        let uid = opts.uid.clone().unwrap_or_else(util::uuid_v4);
        let (shared, pod_dir) = cgroup_names(&opts, &uid);
        let mut parent = root.clone();
        for s in &shared {
            parent.push(s);
        }
        let pod_cgroup = parent.join(&pod_dir);
        let leaf = |id: &str| leaf_name(&opts, id);
        let sandbox_id = util::random_container_id();
        let sandbox = SimContainer {
            name: "POD".into(),
            image: "registry.k8s.io/pause:3.10".into(),
            ports: Vec::new(),
            cgroup: pod_cgroup.join(leaf(&sandbox_id)),
            id: sandbox_id,
        };
        let containers = sim_containers(&opts, &pod_cgroup)?;
        let mut pod = SimPod {
            name: opts.name.clone(),
            namespace: opts.namespace.clone(),
            uid,
            qos: opts.qos,
            driver: opts.driver,
            runtime: opts.runtime,
            crun: opts.crun,
            root: root.clone(),
            pod_cgroup: pod_cgroup.clone(),
            sandbox,
            containers: Mutex::new(containers),
            shared_held: Vec::new(),
            owned: Mutex::new(Vec::new()),
            net: None,
            netns_created: None,
            short: util::random_hex(4),
            lease: None,
            subnet: None,
        };
        reap_stale_leases();
        // From here on, an early return drops `pod`, which undoes what was done so far.
        pod.write_lease(&shared, &root, opts.netns)?;
        let mut path = root;
        for s in &shared {
            path.push(s);
            pod.acquire_shared(&path)?;
        }
        pod.make_owned_dir(&pod_cgroup)?;
        if !opts.lazy_cgroups {
            let mut all = vec![pod.sandbox.clone()];
            all.extend(pod.containers());
            for c in &all {
                pod.make_container_cgroup(c)?;
            }
        }
        if opts.netns {
            pod.setup_net()?;
        }
        Ok(pod)
    }

    fn acquire_shared(&mut self, path: &Path) -> Result<()> {
        let mut reg = SHARED_DIRS.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(n) = reg.get_mut(path) {
            *n += 1;
            self.shared_held.push(path.to_path_buf());
            return Ok(());
        }
        match std::fs::create_dir(path) {
            Ok(()) => {
                reg.insert(path.to_path_buf(), 1);
                self.shared_held.push(path.to_path_buf());
                Ok(())
            }
            // Someone else's (the host's or another process'): use it, never remove it.
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(()),
            Err(e) => Err(e).with_context(|| format!("mkdir {}", path.display())),
        }
    }

    /// CRI-O's cgroup for a container's conmon with `conmon_cgroup = "pod"`: a sibling of the
    /// container's in the pod cgroup, `crio-conmon-<id>.scope` (systemd driver) or
    /// `crio-conmon-<id>` (cgroupfs), as the node VM's CRI-O layout cell makes them.
    fn conmon_cgroup(&self, c: &SimContainer) -> Option<PathBuf> {
        (self.runtime == Runtime::Crio).then(|| {
            let suffix = if self.driver == CgroupDriver::Systemd { ".scope" } else { "" };
            self.pod_cgroup.join(format!("crio-conmon-{}{suffix}", c.id))
        })
    }

    /// Creates a container's (or the sandbox's) cgroup, and CRI-O's sibling conmon cgroup;
    /// nothing when it exists already.
    pub fn make_container_cgroup(&self, c: &SimContainer) -> Result<()> {
        let mut dirs = vec![c.cgroup.clone()];
        if self.crun {
            dirs.push(self.procs_cgroup(c));
        }
        if let Some(conmon) = self.conmon_cgroup(c) {
            dirs.push(conmon);
        }
        for d in dirs {
            if !d.is_dir() {
                self.make_owned_dir(&d)?;
            }
        }
        Ok(())
    }

    /// Removes a container's cgroup (and CRI-O's conmon scope) as the runtime does once its last
    /// process left; false while processes remain in it.
    pub fn remove_container_cgroup(&self, c: &SimContainer) -> bool {
        let procs = std::fs::read_to_string(self.procs_cgroup(c).join("cgroup.procs")).unwrap_or_default();
        if !procs.trim().is_empty() {
            return false;
        }
        // crun's cgroup goes first: a cgroup with a child cannot be removed.
        let mut dirs = if self.crun { vec![self.procs_cgroup(c)] } else { Vec::new() };
        dirs.push(c.cgroup.clone());
        if let Some(conmon) = self.conmon_cgroup(c) {
            dirs.push(conmon);
        }
        for d in &dirs {
            match std::fs::remove_dir(d) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(_) => return false,
            }
        }
        lock(&self.owned).retain(|o| !dirs.contains(o));
        true
    }

    /// A new instance of container `name` (as the kubelet makes when it restarts a container):
    /// a new random id and a new cgroup path (not created yet). It becomes the current one.
    pub fn new_instance(&self, name: &str) -> Result<SimContainer> {
        let id = util::random_container_id();
        let mut containers = lock(&self.containers);
        let c = containers
            .iter_mut()
            .find(|c| c.name == name)
            .ok_or_else(|| anyhow!("pod {} has no container {name}", self.name))?;
        let leaf = c.cgroup.file_name().map(|f| f.to_string_lossy().replace(&c.id, &id)).unwrap_or_default();
        c.cgroup = self.pod_cgroup.join(leaf);
        c.id = id;
        Ok(c.clone())
    }

    /// The cgroup a container's processes run in: its own, or crun's one below it.
    pub fn procs_cgroup(&self, c: &SimContainer) -> PathBuf {
        if self.crun { c.cgroup.join("container") } else { c.cgroup.clone() }
    }

    fn make_owned_dir(&self, path: &Path) -> Result<()> {
        let mut tries = 0;
        loop {
            match std::fs::create_dir(path) {
                Ok(()) => {
                    lock(&self.owned).push(path.to_path_buf());
                    return Ok(());
                }
                // A parent removed by another process between our mkdirs: recreate and retry.
                Err(e) if e.kind() == io::ErrorKind::NotFound && tries < 3 => {
                    tries += 1;
                    if let Some(p) = path.parent() {
                        let _ = std::fs::create_dir_all(p);
                    }
                }
                Err(e) => return Err(e).with_context(|| format!("mkdir {}", path.display())),
            }
        }
    }

    /// Records what this pod is about to create, so a later run can clean up after a test
    /// process that died without dropping it.
    fn write_lease(&mut self, shared: &[String], root: &Path, netns: bool) -> Result<()> {
        // Everything below the pod's cgroup goes with it (see remove_tree), instances made later too.
        let dirs = vec![self.pod_cgroup.clone()];
        let mut shared_paths = Vec::new();
        let mut p = root.to_path_buf();
        for s in shared {
            p.push(s);
            shared_paths.push(p.clone());
        }
        let pid = std::process::id();
        let lease = json!({
            "pid": pid,
            "start": process_start_time(pid),
            "dirs": dirs,
            "shared": shared_paths,
            "netns": netns.then(|| format!("valet-{}", self.short)),
            "host_if": netns.then(|| format!("vh-{}", self.short)),
        });
        let dir = lease_dir();
        std::fs::create_dir_all(&dir).with_context(|| format!("mkdir {}", dir.display()))?;
        let path = dir.join(&self.short);
        std::fs::write(&path, lease.to_string()).with_context(|| format!("write {}", path.display()))?;
        self.lease = Some(path);
        Ok(())
    }

    pub fn name(&self) -> &str {
        &self.name
    }
    pub fn namespace(&self) -> &str {
        &self.namespace
    }
    pub fn uid(&self) -> &str {
        &self.uid
    }
    pub fn qos(&self) -> QosClass {
        self.qos
    }
    pub fn driver(&self) -> CgroupDriver {
        self.driver
    }
    pub fn runtime(&self) -> Runtime {
        self.runtime
    }
    /// The cgroup2 mount the pod lives under.
    pub fn cgroup_root(&self) -> &Path {
        &self.root
    }
    /// Absolute path of the pod-level cgroup.
    pub fn pod_cgroup_path(&self) -> &Path {
        &self.pod_cgroup
    }
    /// The sandbox ("pause") container.
    pub fn sandbox(&self) -> &SimContainer {
        &self.sandbox
    }
    /// The current instance of every container, in spec order.
    pub fn containers(&self) -> Vec<SimContainer> {
        lock(&self.containers).clone()
    }
    /// The current instance of a container (`POD` names the sandbox).
    pub fn container(&self, name: &str) -> Result<SimContainer> {
        if name == "POD" {
            return Ok(self.sandbox.clone());
        }
        lock(&self.containers)
            .iter()
            .find(|c| c.name == name)
            .cloned()
            .ok_or_else(|| anyhow!("pod {} has no container {name}", self.name))
    }
    /// Absolute path of a container's cgroup (`POD` names the sandbox).
    pub fn container_cgroup_path(&self, name: &str) -> Result<PathBuf> {
        Ok(self.container(name)?.cgroup)
    }
    /// A cgroup path as `/proc/<pid>/cgroup` shows it (`/kubepods.slice/...`).
    pub fn relative_cgroup(&self, abs: &Path) -> Result<String> {
        let rel = abs
            .strip_prefix(&self.root)
            .with_context(|| format!("{} is not under {}", abs.display(), self.root.display()))?;
        Ok(format!("/{}", rel.display()))
    }
    /// `containerd://<ID>` (or `cri-o://`, `docker://`).
    pub fn container_id_uri(&self, name: &str) -> Result<String> {
        Ok(format!("{}://{}", self.runtime.id_scheme(), self.container(name)?.id))
    }
    /// The pod IP, when the pod has a network namespace.
    pub fn pod_ip(&self) -> Option<Ipv4Addr> {
        self.net.as_ref().map(|n| n.pod_ip)
    }
    /// The host end of the veth (the pod's default gateway).
    pub fn host_ip(&self) -> Option<Ipv4Addr> {
        self.net.as_ref().map(|n| n.host_ip)
    }
    /// `/run/netns/valet-<short>`.
    pub fn netns_path(&self) -> Option<&Path> {
        self.net.as_ref().map(|n| n.ns_path.as_path())
    }
    pub fn netns_name(&self) -> Option<&str> {
        self.net.as_ref().map(|n| n.ns_name.as_str())
    }
    /// The host-side veth interface name.
    pub fn host_interface(&self) -> Option<&str> {
        self.net.as_ref().map(|n| n.host_if.as_str())
    }

    /// Runs `f` inside the pod's network namespace (on a fresh thread).
    pub fn in_netns<T: Send>(&self, f: impl FnOnce() -> T + Send) -> Result<T> {
        let p = self.netns_path().ok_or_else(|| anyhow!("pod {} has no network namespace", self.name))?;
        in_netns(p, f)
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Drop for SimPod {
    fn drop(&mut self) {
        let owned = std::mem::take(&mut *lock(&self.owned));
        for dir in owned.iter().rev() {
            remove_tree(dir);
        }
        {
            let mut reg = SHARED_DIRS.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            for dir in self.shared_held.iter().rev() {
                if let Some(n) = reg.get_mut(dir) {
                    *n -= 1;
                    if *n == 0 {
                        reg.remove(dir);
                        // Not empty if another process put things there: then it stays.
                        let _ = std::fs::remove_dir(dir);
                    }
                }
            }
        }
        // The pair goes with the namespace once its last user is gone (the kernel's cleanup work
        // removes the devices of many namespaces at once). Deleting the host's end here as well
        // took the rtnl lock for an RCU grace period per pod: 40 ms a pod. Its subnet stays
        // claimed until the host's end is gone (see `SubnetClaim`).
        if let Some(ns) = self.netns_created.take() {
            let _ = ip(&["netns", "del", &ns]);
        }
        self.subnet.take();
        if let Some(l) = self.lease.take() {
            let _ = std::fs::remove_file(l);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::net::{ClaimState, claim_state};
    use super::*;

    #[test]
    fn mountinfo_hybrid_and_unified() {
        let hybrid = "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n\
                      41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n";
        assert_eq!(CgroupRoot::from_mountinfo(hybrid), Some(PathBuf::from("/sys/fs/cgroup/unified")));
        let unified = "30 23 0:26 / /sys/fs/cgroup rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate\n";
        assert_eq!(CgroupRoot::from_mountinfo(unified), Some(PathBuf::from("/sys/fs/cgroup")));
        let odd = "30 23 0:26 / /mnt/my\\040cg rw - cgroup2 none rw\n";
        assert_eq!(CgroupRoot::from_mountinfo(odd), Some(PathBuf::from("/mnt/my cg")));
        assert_eq!(CgroupRoot::from_mountinfo("31 23 0:28 / /x rw - tmpfs tmpfs rw\n"), None);
    }

    #[test]
    fn subnet_claims_are_free_once_their_owner_and_device_are_gone() {
        let me = std::process::id();
        let start = process_start_time(me).expect("own start time");
        // "lo" always exists; "vh-zz-none" never does.
        assert_eq!(claim_state(""), ClaimState::Free);
        assert_eq!(claim_state("garbage"), ClaimState::Free);
        assert_eq!(claim_state(&format!("{me} {start}")), ClaimState::Taken);
        assert_eq!(claim_state(&format!("{me} {start} vh-zz-none")), ClaimState::Taken);
        assert_eq!(claim_state("0 1"), ClaimState::Free);
        assert_eq!(claim_state("0 1 vh-zz-none"), ClaimState::Free);
        assert_eq!(claim_state("0 1 lo"), ClaimState::Draining);
        assert_eq!(claim_state(&format!("{me} {} lo", start + 1)), ClaimState::Draining);
        assert_eq!(claim_state("released vh-zz-none"), ClaimState::Free);
        assert_eq!(claim_state("released lo"), ClaimState::Draining);
        assert_eq!(claim_state("released"), ClaimState::Free);
        assert_eq!(claim_state("released ../lo"), ClaimState::Free);
    }

    #[test]
    fn terminated_marking() {
        let mut pod = json!({"metadata": {"name": "p"}, "status": {"containerStatuses": [
            {"name": "app", "containerID": "containerd://abc", "ready": true, "started": true,
             "state": {"running": {"startedAt": "2025-01-01T00:00:00Z"}}}]}});
        mark_container_terminated(&mut pod, "app", 1).expect("marked");
        let t = &pod["status"]["containerStatuses"][0]["state"]["terminated"];
        assert_eq!(t["exitCode"], 1);
        assert_eq!(t["reason"], "Error");
        assert_eq!(t["startedAt"], "2025-01-01T00:00:00Z");
        assert_eq!(t["containerID"], "containerd://abc");
        assert!(mark_container_terminated(&mut pod, "nope", 0).is_err());
    }
}
