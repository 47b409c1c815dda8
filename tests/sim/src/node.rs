//! Kubelet-shaped pods made of real kernel objects (needs root): the kubelet's cgroup layout
//! for either cgroup driver and runtime, a network namespace with a veth to the host, and
//! container processes placed in their cgroup, netns and (optionally) their own pid namespace
//! before they exec.

use std::collections::BTreeMap;
use std::fs::File;
use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, anyhow, bail};
use serde_json::{Map, Value, json};

use crate::util;

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

/// Where container processes' output goes.
#[derive(Debug, Clone, Default)]
pub enum Output {
    Inherit,
    #[default]
    Null,
    /// Appended to this file.
    File(PathBuf),
}

impl Output {
    fn stdio(&self) -> Result<Stdio> {
        Ok(match self {
            Output::Inherit => Stdio::inherit(),
            Output::Null => Stdio::null(),
            Output::File(p) => Stdio::from(
                File::options().create(true).append(true).open(p).with_context(|| format!("open {}", p.display()))?,
            ),
        })
    }
}

/// How [`SimPod::spawn`] starts a process.
#[derive(Debug, Clone)]
pub struct SpawnOptions {
    /// Start as pid 1 of a new pid namespace, like a container's main process (default true).
    pub pid_namespace: bool,
    /// Start in this existing pid namespace instead (`/proc/<pid>/ns/pid`; shareProcessNamespace:
    /// the sandbox's), as pid N there, with `valet-sim-exec` as its parent as the shim is a real
    /// container's. Takes precedence over `pid_namespace`.
    pub join_pid_namespace: Option<PathBuf>,
    pub env: Vec<(String, String)>,
    pub stdout: Output,
    pub stderr: Output,
    pub cwd: Option<PathBuf>,
    /// Run as this uid and gid (no supplementary groups) from the first exec, like a container
    /// with `runAsUser`; `None`: as the caller.
    pub uid: Option<u32>,
    /// Wait this long in the container's cgroup (and pid namespace) before the exec, as `runc
    /// init` waits from `runc create` to `runc start`.
    pub exec_delay: Option<Duration>,
    /// With a pid namespace (own or joined): give the command this host pid, freed just before
    /// (`ns_last_pid` set right before `valet-sim-exec`'s fork; the caller checks the pid it got).
    pub host_pid: Option<u32>,
}

impl Default for SpawnOptions {
    fn default() -> Self {
        SpawnOptions {
            pid_namespace: true,
            join_pid_namespace: None,
            env: Vec::new(),
            stdout: Output::Null,
            stderr: Output::Inherit,
            cwd: None,
            uid: None,
            exec_delay: None,
            host_pid: None,
        }
    }
}

/// Where [`SimProcess::signal`] sends its signals.
#[derive(Debug)]
enum Target {
    /// `host_pid` is our child: it cannot be recycled before we reap it.
    Child,
    /// The process is `valet-sim-exec`'s child (pid 1 of its pid namespace, or pid N of one it
    /// joined): through its pidfd.
    Pidfd(OwnedFd),
    /// It was gone before a pidfd could be opened.
    Gone,
}

/// A running container process.
#[derive(Debug)]
pub struct SimProcess {
    /// The process itself, or the `valet-sim-exec` that waits for it and ends as it ended.
    child: Child,
    target: Target,
    host_pid: u32,
    pid_namespace: bool,
    container: String,
    status: Option<ExitStatus>,
}

impl SimProcess {
    /// Its pid in the host (initial) pid namespace.
    pub fn host_pid(&self) -> u32 {
        self.host_pid
    }
    /// Its pid inside its own pid namespace (1 when it has one; else its host pid, also when it
    /// joined another's namespace).
    pub fn ns_pid(&self) -> u32 {
        if self.pid_namespace { 1 } else { self.host_pid }
    }
    pub fn container(&self) -> &str {
        &self.container
    }
    /// The exit status if it has exited (reaps it).
    pub fn try_wait(&mut self) -> Result<Option<ExitStatus>> {
        if self.status.is_none() {
            self.status = self.child.try_wait().context("waitpid")?;
        }
        Ok(self.status)
    }
    /// Waits up to `timeout` for the exit; None if still running.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Result<Option<ExitStatus>> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = self.try_wait()? {
                return Ok(Some(s));
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    /// [`Self::wait_timeout`] without blocking an async runtime's thread.
    pub async fn wait_timeout_async(&mut self, timeout: Duration) -> Result<Option<ExitStatus>> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = self.try_wait()? {
                return Ok(Some(s));
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
    /// Sends a signal (a no-op once it has been reaped, so a recycled pid is never hit).
    pub fn signal(&mut self, sig: i32) -> Result<()> {
        if self.try_wait()?.is_some() {
            return Ok(());
        }
        let sent = match &self.target {
            // SAFETY: plain syscall; the pid is our unreaped child, so it cannot have been recycled.
            Target::Child => unsafe { libc::kill(self.host_pid as i32, sig) },
            // SAFETY: plain syscall on a pidfd we own.
            Target::Pidfd(fd) => unsafe {
                libc::syscall(libc::SYS_pidfd_send_signal, fd.as_raw_fd(), sig, std::ptr::null::<u8>(), 0) as i32
            },
            Target::Gone => return Ok(()),
        };
        if sent != 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::ESRCH) {
                return Err(e).context("kill");
            }
        }
        Ok(())
    }
    /// SIGKILL and reap. Killing a pid namespace's init also kills the rest of the namespace.
    pub fn kill(&mut self) -> Result<ExitStatus> {
        self.signal(libc::SIGKILL)?;
        if let Some(s) = self.status {
            return Ok(s);
        }
        let s = self.child.wait().context("waitpid")?;
        self.status = Some(s);
        Ok(s)
    }
}

impl Drop for SimProcess {
    fn drop(&mut self) {
        let _ = self.kill();
    }
}

/// `valet-sim-exec`, which starts every container process (see [`SimPod::spawn`]):
/// `$VALET_SIM_EXEC`, else next to the running executable (`target/<profile>/`, also from
/// `target/<profile>/deps/`) or to the stand-in proxy.
pub fn exec_helper() -> Result<&'static Path> {
    static HELPER: std::sync::OnceLock<Option<PathBuf>> = std::sync::OnceLock::new();
    HELPER
        .get_or_init(|| {
            if let Some(p) = std::env::var_os("VALET_SIM_EXEC") {
                return Some(PathBuf::from(p));
            }
            util::next_to_exe("valet-sim-exec").or_else(|| {
                let standin = crate::standin::binary_path().ok()?;
                Some(standin.parent()?.join("valet-sim-exec")).filter(|p| p.is_file())
            })
        })
        .as_deref()
        .ok_or_else(|| {
            anyhow!("valet-sim-exec not found: build it (`cargo build -p valet-sim --bins`) or set VALET_SIM_EXEC")
        })
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
        let uid_ = uid.replace('-', "_");
        let (shared, pod_dir): (Vec<String>, String) = match (opts.driver, opts.qos.cgroup_name()) {
            (CgroupDriver::Systemd, Some(q)) => {
                (vec!["kubepods.slice".into(), format!("kubepods-{q}.slice")], format!("kubepods-{q}-pod{uid_}.slice"))
            }
            (CgroupDriver::Systemd, None) => (vec!["kubepods.slice".into()], format!("kubepods-pod{uid_}.slice")),
            (CgroupDriver::Cgroupfs, Some(q)) => (vec!["kubepods".into(), q.into()], format!("pod{uid}")),
            (CgroupDriver::Cgroupfs, None) => (vec!["kubepods".into()], format!("pod{uid}")),
        };
        let mut parent = root.clone();
        for s in &shared {
            parent.push(s);
        }
        let pod_cgroup = parent.join(&pod_dir);
        let leaf = |id: &str| -> String {
            match (opts.driver, opts.runtime) {
                (CgroupDriver::Systemd, rt) => format!("{}{id}.scope", rt.scope_prefix()),
                // CRI-O names its cgroupfs leaves crio-<ID> too; containerd and Docker use the bare ID.
                (CgroupDriver::Cgroupfs, Runtime::Crio) => format!("crio-{id}"),
                (CgroupDriver::Cgroupfs, _) => id.to_string(),
            }
        };
        let sandbox_id = util::random_container_id();
        let sandbox = SimContainer {
            name: "POD".into(),
            image: "registry.k8s.io/pause:3.10".into(),
            ports: Vec::new(),
            cgroup: pod_cgroup.join(leaf(&sandbox_id)),
            id: sandbox_id,
        };
        let mut containers = Vec::new();
        for c in &opts.containers {
            let id = match &c.id {
                Some(id) if id.len() == 64 && id.chars().all(|x| x.is_ascii_hexdigit()) => id.to_ascii_lowercase(),
                Some(id) => bail!("container {} id {id:?} is not 64 hex characters", c.name),
                None => util::random_container_id(),
            };
            if containers.iter().any(|x: &SimContainer| x.name == c.name) {
                bail!("duplicate container name {}", c.name);
            }
            containers.push(SimContainer {
                name: c.name.clone(),
                image: c.image.clone().unwrap_or_else(|| default_image(&c.name)),
                ports: c.ports.clone(),
                cgroup: pod_cgroup.join(leaf(&id)),
                id,
            });
        }
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

    fn setup_net(&mut self) -> Result<()> {
        let short = self.short.clone();
        let ns_name = format!("valet-{short}");
        let host_if = format!("vh-{short}");
        ip(&["netns", "add", &ns_name])?;
        self.netns_created = Some(ns_name.clone());
        // A claimed subnet: pods made in parallel set their networks up without waiting for
        // each other.
        let claim = SubnetClaim::claim(&host_if)?;
        let n = claim.n;
        self.subnet = Some(claim);
        let host_ip = Ipv4Addr::new(10, 244, n, 1);
        let pod_ip = Ipv4Addr::new(10, 244, n, 2);
        // Two `ip -batch` runs (the host's side, then the pod's) rather than ten processes: pod
        // setup is what bounds the benchmarks' Jobs per second. The pod's end is made in its
        // namespace as `eth0`, as CNI's bridge and ptp plugins do: moving a device between
        // namespaces waits for an RCU grace period under the kernel's rtnl lock (about 20 ms a
        // pod here, and pods made at once wait for each other's).
        ip_batch(
            &[],
            &[
                format!("link add {host_if} type veth peer name eth0 netns {ns_name}"),
                format!("addr add {host_ip}/24 dev {host_if}"),
                format!("link set {host_if} up"),
            ],
        )?;
        ip_batch(
            &["-n", &ns_name],
            &[
                format!("addr add {pod_ip}/24 dev eth0"),
                "link set eth0 up".into(),
                "link set lo up".into(),
                format!("route add default via {host_ip}"),
            ],
        )?;
        self.net =
            Some(PodNet { ns_path: PathBuf::from(format!("/run/netns/{ns_name}")), ns_name, host_if, pod_ip, host_ip });
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

    /// Starts `cmd` as a process of `container` (`POD` = the sandbox): it joins the container's
    /// cgroup and the pod's netns before exec, and with `pid_namespace` it is pid 1 of a new
    /// pid namespace while the returned handle holds its host pid and can wait for its status.
    /// The steps before the exec run in `valet-sim-exec`, which std starts with `posix_spawn` (a
    /// vfork), not in a fork of this (large, many-threaded) process.
    pub fn spawn(&self, container: &str, cmd: &[&str], opts: &SpawnOptions) -> Result<SimProcess> {
        let helper = exec_helper()?;
        let c = self.container(container)?;
        let (prog, args) = cmd.split_first().ok_or_else(|| anyhow!("empty command"))?;
        let procs_path = self.procs_cgroup(&c).join("cgroup.procs");
        let (mut status, status_w) = io::pipe().context("pipe")?;
        let mut command = Command::new(helper);
        command.arg("--cgroup-procs").arg(&procs_path);
        if let Some(p) = self.netns_path() {
            command.arg("--netns").arg(p);
        }
        if let Some(id) = opts.uid {
            command.arg("--uid").arg(id.to_string());
        }
        if let Some(d) = opts.exec_delay {
            command.arg("--delay-ns").arg(d.as_nanos().to_string());
        }
        if let Some(d) = &opts.cwd {
            command.arg("--cwd").arg(d);
        }
        if let Some(ns) = &opts.join_pid_namespace {
            command.arg("--join-pidns").arg(ns);
        } else if opts.pid_namespace {
            command.arg("--pidns");
        }
        let child_of_helper = opts.pid_namespace || opts.join_pid_namespace.is_some();
        if let Some(pid) = opts.host_pid.filter(|_| child_of_helper) {
            command.arg("--host-pid").arg(pid.to_string());
        }
        command.arg("--").arg(prog).args(args);
        command.stdin(status_w).stdout(opts.stdout.stdio()?).stderr(opts.stderr.stdio()?);
        for (k, v) in &opts.env {
            command.env(k, v);
        }
        let mut child = command.spawn().with_context(|| format!("spawn {} for {prog}", helper.display()))?;
        // The command holds our copy of the pipe's write end: end of file needs it closed.
        drop(command);
        let mut said = String::new();
        io::Read::read_to_string(&mut status, &mut said).context("read valet-sim-exec's status")?;
        let mut pid = None;
        for line in said.lines() {
            if let Some(n) = line.strip_prefix("pid ") {
                pid = n.trim().parse::<u32>().ok();
            } else if let Some(rest) = line.strip_prefix("err ") {
                let (errno, what) = rest.split_once(' ').unwrap_or((rest, ""));
                let _ = child.wait();
                let err = io::Error::from_raw_os_error(errno.parse().unwrap_or(libc::EIO));
                return Err(
                    anyhow::Error::new(err).context(format!("{what}: spawn {prog} in {}/{container}", self.name))
                );
            }
        }
        let (host_pid, target) = if child_of_helper {
            let pid = pid.ok_or_else(|| anyhow!("valet-sim-exec said no pid for {prog}: {said:?}"))?;
            // The command is valet-sim-exec's child: signals go through a pidfd, which cannot hit
            // a recycled pid. Gone already (it ended at once and was reaped): nothing to signal.
            // SAFETY: plain syscall; a valid fd it returns is ours.
            let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
            let target = if fd >= 0 {
                // SAFETY: a new fd that nothing else owns.
                Target::Pidfd(unsafe { OwnedFd::from_raw_fd(fd as i32) })
            } else {
                Target::Gone
            };
            (pid, target)
        } else {
            (child.id(), Target::Child)
        };
        Ok(SimProcess {
            host_pid,
            child,
            target,
            pid_namespace: opts.pid_namespace && opts.join_pid_namespace.is_none(),
            container: container.to_string(),
            status: None,
        })
    }

    /// Starts a pause-like process (`sleep infinity`) in the sandbox, so the pod has a live
    /// process holding its namespaces as a real sandbox does.
    pub fn spawn_pause(&self) -> Result<SimProcess> {
        self.spawn("POD", &["sleep", "infinity"], &SpawnOptions::default())
    }

    /// A realistic v1 Pod for this pod, as the kubelet would have reported it.
    pub fn pod_json(&self, o: &PodJsonOptions) -> Value {
        let now = util::now_rfc3339();
        let resources = match self.qos {
            QosClass::Guaranteed => {
                json!({"requests": {"cpu": "100m", "memory": "64Mi"}, "limits": {"cpu": "100m", "memory": "64Mi"}})
            }
            QosClass::Burstable => json!({"requests": {"cpu": "50m", "memory": "32Mi"}}),
            QosClass::BestEffort => json!({}),
        };
        let spec_of = |c: &SimContainer, sidecar: bool| {
            let mut v = json!({
                "name": c.name, "image": c.image, "imagePullPolicy": "IfNotPresent",
                "resources": resources,
                "terminationMessagePath": "/dev/termination-log", "terminationMessagePolicy": "File",
            });
            if !c.ports.is_empty() {
                v["ports"] = c.ports.iter().map(|p| json!({"containerPort": p, "protocol": "TCP"})).collect();
            }
            if sidecar {
                v["restartPolicy"] = json!("Always");
            }
            v
        };
        let status_of = |c: &SimContainer| {
            let mut v = json!({
                "name": c.name, "image": c.image, "imageID": format!("{}@sha256:{}", c.image, util::random_hex(32)),
                "ready": true, "started": true, "restartCount": 0,
                "state": {"running": {"startedAt": now}}, "lastState": {},
            });
            if o.container_ids {
                v["containerID"] = json!(format!("{}://{}", self.runtime.id_scheme(), c.id));
            }
            v
        };
        let is_sidecar = |c: &SimContainer| o.native_sidecars.contains(&c.name);
        let is_init = |c: &SimContainer| is_sidecar(c) || o.init_containers.contains(&c.name);
        let all = self.containers();
        let main: Vec<&SimContainer> = all.iter().filter(|c| !is_init(c)).collect();
        let init: Vec<&SimContainer> = all.iter().filter(|c| is_init(c)).collect();
        let mut labels: Map<String, Value> = o.labels.iter().map(|(k, v)| (k.clone(), json!(v))).collect();
        let mut meta = json!({"name": self.name, "namespace": self.namespace, "uid": self.uid});
        if let Some(job) = &o.job_name {
            let job_uid = util::uuid_v4();
            for (k, v) in [
                ("batch.kubernetes.io/controller-uid", job_uid.as_str()),
                ("batch.kubernetes.io/job-name", job.as_str()),
                ("controller-uid", job_uid.as_str()),
                ("job-name", job.as_str()),
            ] {
                labels.entry(k).or_insert(json!(v));
            }
            meta["ownerReferences"] = json!([{"apiVersion": "batch/v1", "kind": "Job", "name": job, "uid": job_uid,
                                               "controller": true, "blockOwnerDeletion": true}]);
            meta["generateName"] = json!(format!("{job}-"));
        }
        meta["labels"] = Value::Object(labels);
        meta["annotations"] = Value::Object(o.annotations.iter().map(|(k, v)| (k.clone(), json!(v))).collect());
        let pod_ip = self.pod_ip().map(|i| i.to_string());
        let host_ip =
            o.host_ip.clone().or_else(|| self.host_ip().map(|i| i.to_string())).unwrap_or_else(|| "10.0.0.10".into());
        let cond = |t: &str| json!({"type": t, "status": "True", "lastProbeTime": null, "lastTransitionTime": now});
        let mut status = json!({
            "phase": o.phase,
            "qosClass": self.qos.as_str(),
            "hostIP": host_ip,
            "hostIPs": [{"ip": host_ip}],
            "startTime": now,
            "conditions": [cond("PodReadyToStartContainers"), cond("Initialized"), cond("Ready"), cond("ContainersReady"), cond("PodScheduled")],
            "containerStatuses": main.iter().map(|c| status_of(c)).collect::<Vec<_>>(),
        });
        if let Some(ip) = &pod_ip {
            status["podIP"] = json!(ip);
            status["podIPs"] = json!([{"ip": ip}]);
        }
        let mut spec = json!({
            "nodeName": o.node_name,
            "restartPolicy": o.restart_policy,
            "terminationGracePeriodSeconds": 30,
            "dnsPolicy": "ClusterFirst",
            "schedulerName": "default-scheduler",
            "serviceAccountName": "default",
            "enableServiceLinks": true,
            "priority": 0,
            "securityContext": {},
            "containers": main.iter().map(|c| spec_of(c, false)).collect::<Vec<_>>(),
            "tolerations": [
                {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300},
                {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300}],
        });
        if let Some(class) = &o.runtime_class {
            spec["runtimeClassName"] = json!(class);
        }
        if o.share_process_namespace {
            spec["shareProcessNamespace"] = json!(true);
        }
        if !init.is_empty() {
            spec["initContainers"] = init.iter().map(|c| spec_of(c, is_sidecar(c))).collect();
            status["initContainerStatuses"] = init.iter().map(|c| status_of(c)).collect();
        }
        json!({"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec, "status": status})
    }
}

/// Inputs of [`SimPod::pod_json`].
#[derive(Debug, Clone)]
pub struct PodJsonOptions {
    pub node_name: String,
    pub labels: BTreeMap<String, String>,
    pub annotations: BTreeMap<String, String>,
    /// `Never` (default), `OnFailure` or `Always`.
    pub restart_policy: String,
    /// `status.phase` (default `Running`).
    pub phase: String,
    /// `status.hostIP`; default: the host end of the pod's veth.
    pub host_ip: Option<String>,
    /// Make it a Job's pod: ownerReferences and the job labels.
    pub job_name: Option<String>,
    /// Containers declared as native sidecars (init containers with `restartPolicy: Always`).
    pub native_sidecars: Vec<String>,
    /// Containers declared as plain init containers (run to completion before the others).
    pub init_containers: Vec<String>,
    /// Report containerIDs in the statuses (false: the kubelet has not synced them yet).
    pub container_ids: bool,
    /// `spec.runtimeClassName`.
    pub runtime_class: Option<String>,
    /// `spec.shareProcessNamespace`: the containers' processes are started in the sandbox's pid
    /// namespace ([`SpawnOptions::join_pid_namespace`]).
    pub share_process_namespace: bool,
}

impl Default for PodJsonOptions {
    fn default() -> Self {
        PodJsonOptions {
            node_name: "sim-node".into(),
            labels: BTreeMap::new(),
            annotations: BTreeMap::new(),
            restart_policy: "Never".into(),
            phase: "Running".into(),
            host_ip: None,
            job_name: None,
            native_sidecars: Vec::new(),
            init_containers: Vec::new(),
            container_ids: true,
            runtime_class: None,
            share_process_namespace: false,
        }
    }
}

impl PodJsonOptions {
    pub fn node(node_name: &str) -> PodJsonOptions {
        PodJsonOptions { node_name: node_name.to_string(), ..Default::default() }
    }
    pub fn share_process_namespace(mut self, on: bool) -> Self {
        self.share_process_namespace = on;
        self
    }
    pub fn label(mut self, k: &str, v: &str) -> Self {
        self.labels.insert(k.into(), v.into());
        self
    }
    pub fn annotation(mut self, k: &str, v: &str) -> Self {
        self.annotations.insert(k.into(), v.into());
        self
    }
    pub fn restart_policy(mut self, p: &str) -> Self {
        self.restart_policy = p.into();
        self
    }
    pub fn job(mut self, name: &str) -> Self {
        self.job_name = Some(name.into());
        self
    }
    pub fn native_sidecar(mut self, container: &str) -> Self {
        self.native_sidecars.push(container.into());
        self
    }
    pub fn without_container_ids(mut self) -> Self {
        self.container_ids = false;
        self
    }
}

fn container_status_mut<'a>(pod: &'a mut Value, container: &str) -> Option<&'a mut Value> {
    let status = pod.get_mut("status")?;
    for list in ["containerStatuses", "initContainerStatuses"] {
        if let Some(Value::Array(items)) = status.get(list)
            && let Some(i) = items.iter().position(|c| c["name"] == container)
        {
            return status.get_mut(list).and_then(|l| l.get_mut(i));
        }
    }
    None
}

/// Marks a container terminated in a pod JSON as the kubelet reports it (reason `Completed` for
/// exit 0, `Error` otherwise), keeping its containerID and start time.
pub fn mark_container_terminated(pod: &mut Value, container: &str, exit_code: i32) -> Result<()> {
    let pod_name = pod.pointer("/metadata/name").and_then(Value::as_str).unwrap_or("").to_string();
    let cs = container_status_mut(pod, container)
        .ok_or_else(|| anyhow!("pod {pod_name} has no status for container {container}"))?;
    let now = util::now_rfc3339();
    let started = cs.pointer("/state/running/startedAt").cloned().unwrap_or_else(|| json!(now));
    let mut term = json!({
        "exitCode": exit_code,
        "reason": if exit_code == 0 { "Completed" } else { "Error" },
        "startedAt": started,
        "finishedAt": now,
    });
    if let Some(id) = cs.get("containerID") {
        term["containerID"] = id.clone();
    }
    cs["state"] = json!({"terminated": term});
    cs["ready"] = json!(false);
    cs["started"] = json!(false);
    Ok(())
}

/// Sets `status.phase` (and, for terminal phases, the Ready conditions to False).
pub fn set_pod_phase(pod: &mut Value, phase: &str) {
    pod["status"]["phase"] = json!(phase);
    if matches!(phase, "Succeeded" | "Failed")
        && let Some(Value::Array(conds)) = pod.pointer_mut("/status/conditions")
    {
        for c in conds {
            if matches!(c["type"].as_str(), Some("Ready" | "ContainersReady")) {
                c["status"] = json!("False");
                c["reason"] = json!("PodCompleted");
            }
        }
    }
}

fn default_image(name: &str) -> String {
    match name {
        "istio-proxy" => "docker.io/istio/proxyv2:1.26.0".into(),
        "linkerd-proxy" => "cr.l5d.io/linkerd/proxy:edge-25.4.1".into(),
        "cloud-sql-proxy" => "gcr.io/cloud-sql-connectors/cloud-sql-proxy:2.15.0".into(),
        "envoy" => "docker.io/envoyproxy/envoy:v1.34.0".into(),
        "vault-agent" => "docker.io/hashicorp/vault:1.18.1".into(),
        "consul-dataplane" => "docker.io/hashicorp/consul-dataplane:1.6.1".into(),
        "alloydb-auth-proxy" => "gcr.io/alloydb-connectors/alloydb-auth-proxy:1.13.3".into(),
        "kuma-sidecar" => "docker.io/kumahq/kuma-dp:2.9.3".into(),
        other => format!("docker.io/library/{other}:latest"),
    }
}

fn ip(args: &[&str]) -> Result<()> {
    let out = Command::new("ip").args(args).output().context("run ip (iproute2)")?;
    if !out.status.success() {
        bail!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

/// Runs `ip <opts> -batch -` with `lines` as its commands.
fn ip_batch(opts: &[&str], lines: &[String]) -> Result<()> {
    use std::io::Write as _;
    let mut child = Command::new("ip")
        .args(opts)
        .args(["-batch", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .context("run ip (iproute2)")?;
    let script: String = lines.iter().map(|l| format!("{l}\n")).collect();
    child.stdin.take().context("ip's stdin")?.write_all(script.as_bytes()).context("write to ip -batch")?;
    let out = child.wait_with_output().context("wait for ip")?;
    if !out.status.success() {
        bail!("ip {} -batch: {}: {}", opts.join(" "), lines.join("; "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(())
}

fn ip_output(args: &[&str]) -> Result<String> {
    let out = Command::new("ip").args(args).output().context("run ip (iproute2)")?;
    if !out.status.success() {
        bail!("ip {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// A host-wide lock (flock) around subnet allocation, shared by all test processes.
struct IpamLock {
    _file: File,
}

impl IpamLock {
    fn acquire() -> Result<IpamLock> {
        let dir = sim_state_dir();
        std::fs::create_dir_all(&dir).with_context(|| format!("mkdir {}", dir.display()))?;
        let f = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(dir.join("ipam.lock"))
            .context("open the ipam lock")?;
        // SAFETY: plain syscall on a valid fd; the lock is released when the file closes.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } != 0 {
            return Err(io::Error::last_os_error()).context("flock");
        }
        Ok(IpamLock { _file: f })
    }
}

/// Where the simulated node keeps host-wide state shared by test processes (leases, subnet
/// claims, the ipam lock): on a tmpfs like a node's `/run` ([`util::state_base`]).
pub fn sim_state_dir() -> PathBuf {
    util::state_base().join("valet-sim")
}

/// Subnet claims, one file per claimed `10.244.N.0/24`.
pub fn subnet_dir() -> PathBuf {
    sim_state_dir().join("subnets")
}

/// Leases: what each pod created, for [`reap_stale_leases`].
pub fn lease_dir() -> PathBuf {
    sim_state_dir().join("leases")
}

/// A pod's 10.244.N.0/24, claimed by a file naming its owner process (pid and start time) and the
/// host's end of its veth pair, so that pods made at once in threads and processes never share
/// one and run their `ip` commands in parallel. A claim whose owner died is taken over once its
/// device is gone; the host's own addresses and routes are read once per process and never
/// claimed. A pod's drop releases its claim (`released DEVICE`), but the subnet is only used
/// again once the kernel has removed that device with the pod's namespace: until then its
/// address and route are still there.
#[derive(Debug)]
struct SubnetClaim {
    n: u8,
    path: PathBuf,
    host_if: String,
}

/// Whether a network device of this name is in the host's namespace.
fn link_exists(name: &str) -> bool {
    !name.is_empty() && !name.contains('/') && Path::new("/sys/class/net").join(name).exists()
}

/// What a subnet's claim file says.
#[derive(Debug, PartialEq, Eq)]
enum ClaimState {
    Free,
    Taken,
    /// Released or its owner is gone, but its device is still there.
    Draining,
}

fn claim_state(text: &str) -> ClaimState {
    let fields: Vec<&str> = text.split_whitespace().collect();
    let device_gone = |d: Option<&&str>| d.is_none_or(|d| !link_exists(d));
    match fields.as_slice() {
        ["released", rest @ ..] => {
            if device_gone(rest.first()) {
                ClaimState::Free
            } else {
                ClaimState::Draining
            }
        }
        [pid, start, rest @ ..] => match (pid.parse::<u32>(), start.parse::<u64>()) {
            (Ok(pid), Ok(start)) if process_start_time(pid) == Some(start) => ClaimState::Taken,
            (Ok(_), Ok(_)) if !device_gone(rest.first()) => ClaimState::Draining,
            _ => ClaimState::Free,
        },
        _ => ClaimState::Free,
    }
}

impl SubnetClaim {
    /// Claims a free subnet for a pod whose host device is `host_if`; waits up to 10 s while
    /// released ones are still draining.
    fn claim(host_if: &str) -> Result<SubnetClaim> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match SubnetClaim::try_claim(host_if)? {
                Ok(claim) => return Ok(claim),
                Err(draining) if draining > 0 && Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(draining) => bail!("no free 10.244.N.0/24 subnet left ({draining} waiting for their device to go)"),
            }
        }
    }

    /// A claim, or how many subnets are draining.
    fn try_claim(host_if: &str) -> Result<std::result::Result<SubnetClaim, usize>> {
        static HOST_USED: std::sync::OnceLock<std::collections::BTreeSet<u8>> = std::sync::OnceLock::new();
        let _lock = IpamLock::acquire()?;
        let subnets = subnet_dir();
        std::fs::create_dir_all(&subnets).with_context(|| format!("mkdir {}", subnets.display()))?;
        let host_used = match HOST_USED.get() {
            Some(used) => used,
            None => {
                let text = ip_output(&["-4", "-o", "addr", "show"])? + &ip_output(&["-4", "route", "show"])?;
                // Subnets with a claim file are pods' (released with them), not the host's.
                let used = (1..=254u8)
                    .filter(|n| text.contains(&format!("10.244.{n}.")))
                    .filter(|n| !subnets.join(n.to_string()).exists())
                    .collect();
                HOST_USED.get_or_init(|| used)
            }
        };
        let me = std::process::id();
        let owner = format!("{me} {} {host_if}", process_start_time(me).unwrap_or(0));
        let mut draining = 0;
        for n in (1..=254u8).filter(|n| !host_used.contains(n)) {
            let path = subnets.join(n.to_string());
            let state = match std::fs::read_to_string(&path) {
                Err(e) if e.kind() == io::ErrorKind::NotFound => ClaimState::Free,
                Err(e) => return Err(e).with_context(|| format!("read {}", path.display())),
                Ok(text) => claim_state(&text),
            };
            match state {
                ClaimState::Free => {
                    std::fs::write(&path, &owner).with_context(|| format!("write {}", path.display()))?;
                    return Ok(Ok(SubnetClaim { n, path, host_if: host_if.to_string() }));
                }
                ClaimState::Draining => draining += 1,
                ClaimState::Taken => {}
            }
        }
        Ok(Err(draining))
    }
}

impl Drop for SubnetClaim {
    fn drop(&mut self) {
        let _lock = IpamLock::acquire();
        let _ = std::fs::write(&self.path, format!("released {}", self.host_if));
    }
}

/// Kills what runs in a cgroup and waits until it is empty.
fn kill_cgroup(dir: &Path) {
    let kill_file = dir.join("cgroup.kill");
    let have_kill = std::fs::write(&kill_file, "1").is_ok();
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let procs = std::fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default();
        let pids: Vec<i32> = procs.lines().filter_map(|l| l.trim().parse().ok()).collect();
        if pids.is_empty() || Instant::now() >= deadline {
            return;
        }
        if !have_kill {
            for p in pids {
                // SAFETY: plain syscall.
                unsafe { libc::kill(p, libc::SIGKILL) };
            }
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Kills what runs in a cgroup and below it, and removes the whole subtree, children first.
fn remove_tree(dir: &Path) {
    if !dir.is_dir() {
        return;
    }
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                remove_tree(&e.path());
            }
        }
    }
    kill_cgroup(dir);
    rmdir_retry(dir);
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

fn rmdir_retry(dir: &Path) {
    for _ in 0..100 {
        match std::fs::remove_dir(dir) {
            Ok(()) => return,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return,
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => std::thread::sleep(Duration::from_millis(10)),
            Err(_) => return,
        }
    }
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

/// Field 22 of /proc/PID/stat (start time in clock ticks): tells a live owner from a recycled pid.
fn process_start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may contain spaces and parentheses: count fields after the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// Removes what sim pods of dead processes left behind (a test killed by a timeout, say).
pub fn reap_stale_leases() {
    let Ok(entries) = std::fs::read_dir(lease_dir()) else {
        return;
    };
    for e in entries.flatten() {
        let path = e.path();
        let Ok(text) = std::fs::read_to_string(&path) else {
            continue;
        };
        let Ok(lease) = serde_json::from_str::<Value>(&text) else {
            let _ = std::fs::remove_file(&path);
            continue;
        };
        let pid = lease["pid"].as_u64().unwrap_or(0) as u32;
        let alive = pid != 0 && process_start_time(pid).is_some() && process_start_time(pid) == lease["start"].as_u64();
        if alive {
            continue;
        }
        let paths = |k: &str| -> Vec<PathBuf> {
            lease[k]
                .as_array()
                .map(|a| a.iter().filter_map(Value::as_str).map(PathBuf::from).collect())
                .unwrap_or_default()
        };
        for d in paths("dirs").iter().rev() {
            remove_tree(d);
        }
        for d in paths("shared").iter().rev() {
            // Only goes if empty: other pods may still live there.
            let _ = std::fs::remove_dir(d);
        }
        if let Some(ns) = lease["netns"].as_str() {
            let _ = Command::new("ip").args(["netns", "del", ns]).stderr(Stdio::null()).status();
        }
        if let Some(h) = lease["host_if"].as_str() {
            let _ = Command::new("ip").args(["link", "del", h]).stderr(Stdio::null()).status();
        }
        let _ = std::fs::remove_file(&path);
    }
}

#[cfg(test)]
mod tests {
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
