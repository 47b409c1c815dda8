//! Configuration: flags, each also readable from a `VALET_*` environment variable (the node name
//! from `NODE_NAME`, set by the downward API), validated at start with clear errors.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, ValueEnum};

use crate::error::{Error, Result};
use crate::kernel::programs::AncestorMode;

/// Default of `--old-record-timeout`: the `--hold-timeout` default of the version that wrote
/// `held_v1` records ([`valet_common::HELD_DEFAULT_TIMEOUT_MS`]), shared by the agent and the
/// deadline keeper.
pub const OLD_RECORD_TIMEOUT: &str = "120s";

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    Text,
    Json,
}

pub use crate::vocab::parse_duration;

/// Default of `--sidecar-names`: the proxies and agents valet knows by their container's name.
const DEFAULT_SIDECAR_NAMES: &str =
    "istio-proxy,linkerd-proxy,cloud-sql-proxy,vault-agent,consul-dataplane,kuma-sidecar";

/// Default of `--sandboxed-runtime-classes`: Kata's and gVisor's.
const SANDBOXED_CLASSES: &str = "kata,kata-*,gvisor,gvisor-*,runsc,runsc-*";

/// valet node agent: ends sidecar proxies when a pod's work is done and holds apps until the
/// proxy is ready, for pods labelled valet.dev/enabled=true on this node.
///
/// Each setting is declared once, in the small record of the part it configures; the deadline
/// keeper (`valet-agent deadlines`) reads the records it shares ([`NodeFlags`], [`HostPaths`],
/// [`PinFlags`]) from the same definitions.
#[derive(Clone, Debug, Parser)]
#[command(name = "valet-agent", version, about, long_about = None)]
pub struct Config {
    #[command(flatten)]
    pub node: NodeFlags,
    #[command(flatten)]
    pub server: ServerFlags,
    #[command(flatten)]
    pub host: HostPaths,
    #[command(flatten)]
    pub kernel: KernelFlags,
    #[command(flatten)]
    pub pins: PinFlags,
    #[command(flatten)]
    pub pods: PodFlags,
    #[command(flatten)]
    pub quits: QuitFlags,
    #[command(flatten)]
    pub probes: ProbeFlags,
    #[command(flatten)]
    pub holds: HoldFlags,
    #[command(flatten)]
    pub observe: ObserveFlags,
}

/// This node, and the agent's own pod on it (the downward API).
#[derive(Clone, Debug, Args)]
pub struct NodeFlags {
    /// This node's name (the DaemonSet sets it).
    ///
    /// This node's name (the DaemonSet sets NODE_NAME from spec.nodeName).
    #[arg(long, env = "NODE_NAME")]
    pub node_name: String,

    /// The agent's own pod (the DaemonSet sets POD_NAME): at SIGTERM, whether a successor comes.
    /// Unset outside a pod.
    #[arg(long, env = "POD_NAME", hide = true)]
    pub pod_name: Option<String>,

    /// The own pod's namespace (the DaemonSet sets POD_NAMESPACE); unset: the API client's.
    #[arg(long, env = "POD_NAMESPACE", hide = true)]
    pub pod_namespace: Option<String>,
}

/// The metrics and health server, and the log.
#[derive(Clone, Debug, Args)]
pub struct ServerFlags {
    /// Address of `/metrics`, `/healthz` and `/readyz`.
    ///
    /// Address for /metrics, /healthz and /readyz.
    #[arg(long, env = "VALET_METRICS_ADDR", default_value = "0.0.0.0:9090")]
    pub metrics_addr: SocketAddr,

    /// Log format: `text` or `json` (the DaemonSet sets `json`).
    ///
    /// Log format.
    #[arg(long, env = "VALET_LOG_FORMAT", value_enum, default_value = "text")]
    pub log_format: LogFormat,
}

/// Where the host's processes and cgroups are seen.
#[derive(Clone, Debug, Args)]
pub struct HostPaths {
    /// Where the host's `/proc` is.
    ///
    /// Where the host's /proc is visible (the agent finds pod processes and namespaces there).
    #[arg(long, env = "VALET_HOST_PROC", default_value = "/proc")]
    pub host_proc: PathBuf,

    /// One cgroup hierarchy (cgroup2 or a v1 controller), when not found by looking.
    ///
    /// The root of the cgroup hierarchy the kubelet's cgroups are read from: the cgroup2 mount,
    /// or a v1 controller's mount (`/sys/fs/cgroup/memory`). When not given, found by looking
    /// at `--cgroup-mount`.
    #[arg(long, env = "VALET_CGROUP_ROOT")]
    pub cgroup_root: Option<PathBuf>,

    /// Where the host's `/sys/fs/cgroup` is (hierarchies are found there).
    ///
    /// Where the host's `/sys/fs/cgroup` is visible: the cgroup2 mount on a v2 node; on a v1 or
    /// hybrid node, the directory of the v1 controllers' mounts (and of `unified`).
    #[arg(long, env = "VALET_CGROUP_MOUNT", default_value = "/sys/fs/cgroup")]
    pub cgroup_mount: PathBuf,

    /// Make every mount at and below `--cgroup-mount` read-only in this container, at start.
    ///
    /// For the DaemonSet's containers, on runtimes that bind the host's cgroup fs read-only at
    /// its top only (containerd before 2.0, CRI-O before 1.30): the v1 controllers' mounts below
    /// stay writable there. Changes this container's own mounts only (needs CAP_SYS_ADMIN);
    /// refused for the host's own `/sys/fs/cgroup`.
    #[arg(long, env = "VALET_CGROUP_READ_ONLY", default_value_t = false, action = clap::ArgAction::Set)]
    pub cgroup_read_only: bool,
}

/// The kernel programs: where their inputs are, how they find pod cgroups, and which reasons for
/// running without them leave the node ready.
#[derive(Clone, Debug, Args)]
pub struct KernelFlags {
    /// Where the host's `/sys` is found.
    ///
    /// Where the host's /sys is visible under (tracefs and BTF are looked up below it).
    #[arg(long, env = "VALET_HOST_ROOT", default_value = "/")]
    pub host_root: PathBuf,

    /// A BTF file for a kernel without one of its own.
    ///
    /// The kernel's BTF, where the kernel programs' struct offsets are read (default: the host's
    /// /sys/kernel/btf/vmlinux). For a kernel without BTF of its own, a BTF file made for it
    /// (e.g. from BTFHub). Where the programs cannot load (no BTF, lockdown, BPF denied...), the
    /// agent runs degraded rather than exit: ends from the API, no holds (see valet_node_info).
    #[arg(long, env = "VALET_KERNEL_BTF")]
    pub kernel_btf: Option<PathBuf>,

    /// Degraded-mode reasons that still leave the node ready (`all`, `none`).
    ///
    /// The reasons for degraded mode (valet_node_info's `reason`) that the operator expects on
    /// some nodes: a node degraded for one of them is ready; one degraded for any other is not
    /// (`/readyz` says why), so that a rollout that degrades its nodes stops at the first ones.
    /// Either way the node is served degraded. Comma-separated reasons, `all`, or `none`. The
    /// default expects what a node's kernel decides (no BTF, lockdown), not what a release can
    /// cause (programs rejected, BPF denied by the manifest's privileges, memlock, tracefs).
    #[arg(
        long,
        env = "VALET_DEGRADED_OK",
        value_delimiter = ',',
        default_value = crate::kernel::mode::DEFAULT_DEGRADED_OK
    )]
    pub degraded_ok: Vec<String>,

    /// How the kernel programs find a process's pod cgroup: `auto`, `helper` or `walk`.
    ///
    /// `auto`: the helper (`bpf_get_current_ancestor_cgroup_id`) where the kernel allows it
    /// (5.11+), else a walk up the cgroup tree with offsets from BTF (5.10). `helper` or `walk`
    /// force one; a forced helper on a kernel or hierarchy that cannot use it is an error.
    #[arg(long, env = "VALET_CGROUP_ANCESTORS", value_enum, default_value = "auto")]
    pub cgroup_ancestors: AncestorMode,
}

/// The pinned record of held apps, this version's and earlier ones'.
#[derive(Clone, Debug, Args)]
pub struct PinFlags {
    /// The bpffs directory of the record of held apps.
    ///
    /// A directory on bpffs (the host's, shared with the agent's successors) where the record of
    /// the processes the kernel stopped at exec is pinned: an agent that dies while holding
    /// apps leaves its successor every one of them to release. `/sys/fs/bpf` is mounted as
    /// bpffs first if it is not yet.
    #[arg(long, env = "VALET_PIN_DIR", default_value = "/sys/fs/bpf/valet")]
    pub pin_dir: PathBuf,

    /// A previous version's pin directories, read and moved.
    ///
    /// Pin directories an earlier version used (an upgrade that changes `--pin-dir`): the
    /// records of holds found there are released at their deadline, and moved into `--pin-dir`.
    #[arg(long = "old-pin-dirs", visible_alias = "old-pin-dir", env = "VALET_OLD_PIN_DIRS", value_delimiter = ',')]
    pub old_pin_dirs: Vec<PathBuf>,

    /// Hold timeout of a previous version's records.
    ///
    /// Hold timeout of the records an earlier version wrote without a deadline (`held_v1`):
    /// they run again at their stop plus this. The deadline keeper (`valet-agent deadlines`)
    /// reads the same setting: set it once for both (the manifest does).
    #[arg(long, env = "VALET_OLD_RECORD_TIMEOUT", default_value = OLD_RECORD_TIMEOUT, value_parser = parse_duration)]
    pub old_record_timeout: Duration,
}

/// Which pods are watched, and how their containers are known.
#[derive(Clone, Debug, Args)]
pub struct PodFlags {
    /// Container names that are sidecars by default.
    ///
    /// Container names treated as sidecars unless a pod's valet.dev/sidecars annotation says otherwise.
    #[arg(long, env = "VALET_SIDECAR_NAMES", value_delimiter = ',', default_value = DEFAULT_SIDECAR_NAMES)]
    pub sidecar_names: Vec<String>,

    /// RuntimeClass names or handlers of sandboxed pods (ends from the API, no holds).
    ///
    /// runtimeClassNames whose pods run out of the node's kernel's sight (VM or user-space
    /// kernel sandboxes: Kata, gVisor, GKE Sandbox). Their ends are taken from the API and their
    /// apps are never held. A trailing `*` matches any suffix.
    #[arg(long, env = "VALET_SANDBOXED_RUNTIME_CLASSES", value_delimiter = ',', default_value = SANDBOXED_CLASSES)]
    pub sandboxed_runtime_classes: Vec<String>,

    /// The node's default runtime handler, for pods without a runtimeClassName.
    ///
    /// What the runtime runs a pod without a runtimeClassName with: containerd's
    /// `default_runtime_name`, CRI-O's `default_runtime` (unset: runc or crun, the node's kernel
    /// sees those pods). Matched against --sandboxed-runtime-classes: on a node pool whose default
    /// runtime is a sandbox (`kata`, `runsc`), set it there, and those pods take their ends from the
    /// API and are never held, as a sandboxed class's are. The agent does not read the runtime's
    /// configuration: its pod mounts neither the runtime's config nor its socket.
    #[arg(long, env = "VALET_DEFAULT_RUNTIME_HANDLER")]
    pub default_runtime_handler: Option<String>,

    /// Runtime state directories where containers' bundles are looked for first (unset:
    /// containerd's, k3s's and CRI-O's).
    ///
    /// Container runtime state directories holding the containers' OCI bundles (config.json),
    /// to know a container by name before the API reports its id (about a second later), tried
    /// first. By default the well-known ones under --host-root: containerd's
    /// /run/containerd/io.containerd.runtime.v2.task/k8s.io (and k3s's and microk8s's
    /// equivalents) and CRI-O's /run/containers/storage/overlay-containers. A bundle in none of
    /// them is read through the runtime process that started the pod (containerd's shim, CRI-O's
    /// conmon, found up from the pod's processes in --host-proc), wherever the runtime keeps it.
    #[arg(long, env = "VALET_RUNTIME_STATE_DIRS", value_delimiter = ',')]
    pub runtime_state_dirs: Vec<PathBuf>,

    /// Directories of containerd's container records, where an app's recorded end is read
    /// first (unset: kubeadm's, k3s's and microk8s's).
    ///
    /// Directories holding containerd's CRI container records (<dir>/<id>/status), where a
    /// native sidecar's quit waits for the runtime's record of the app's end instead of the
    /// API's report of it (about a second sooner). By default
    /// /var/lib/containerd/io.containerd.grpc.v1.cri/containers (and k3s's and microk8s's
    /// equivalents) under --host-root, and the same paths through the runtime process that
    /// started the pod (found as for bundles). Where no record is found (CRI-O, another root),
    /// the quit waits for the API's report.
    #[arg(long, env = "VALET_RUNTIME_RECORD_DIRS", value_delimiter = ',')]
    pub runtime_record_dirs: Vec<PathBuf>,

    /// Where the kubelet's container log links are (unset: its /var/log/containers, through the
    /// host's pid 1).
    ///
    /// The directory of the kubelet's container log links
    /// (<pod>_<namespace>_<container>-<id>.log, made by every kubelet when it starts a container
    /// and removed with the container), where a container that started and ended while the agent
    /// could not look (stopped, throttled) is named by its id once the runtime has removed its
    /// cgroup and bundle, so that its end quits the sidecars without waiting for the API's report.
    /// By default /var/log/containers through the host's pid 1 in --host-proc (no host path
    /// mounted). Where it cannot be read, such an end waits for the API's report.
    #[arg(long, env = "VALET_CONTAINER_LOG_LINKS")]
    pub container_log_links: Option<PathBuf>,

    /// Length of one pod watch request.
    ///
    /// How long one pod watch request lasts (its `timeoutSeconds`, whole seconds): the API server
    /// then ends it and the agent watches on from where it was, without a re-list. It also bounds
    /// a watch that goes silent without closing (a dead connection, a stalled server): kube's
    /// watcher gives it up after this plus 5 s without an event or a bookmark and watches again,
    /// so pods created meanwhile are seen by then.
    #[arg(long, env = "VALET_WATCH_TIMEOUT", default_value = "290s", value_parser = parse_duration)]
    pub watch_timeout: Duration,
}

/// Quitting sidecars: the request, its retries, the signal after it, and its Event.
#[derive(Clone, Debug, Args)]
pub struct QuitFlags {
    /// Time for one quit request, connect included.
    ///
    /// Total time for one quit request (connect included).
    #[arg(long, env = "VALET_QUIT_TIMEOUT", default_value = "2s", value_parser = parse_duration)]
    pub quit_timeout: Duration,

    /// Retry a failing quit this long, then escalate.
    ///
    /// How long to keep retrying a quit that fails (with backoff) before escalating.
    #[arg(long, env = "VALET_QUIT_RETRY_FOR", default_value = "20s", value_parser = parse_duration)]
    pub quit_retry_for: Duration,

    /// SIGTERM a sidecar still running this long after its quit.
    ///
    /// Send SIGTERM to a sidecar still running this long after it accepted a quit.
    #[arg(long, env = "VALET_ESCALATE_AFTER", default_value = "15s", value_parser = parse_duration)]
    pub escalate_after: Duration,

    /// Never signal sidecars, only ask them to quit.
    ///
    /// Never signal sidecars; only ask them to quit.
    #[arg(long, env = "VALET_NO_ESCALATION")]
    pub no_escalation: bool,

    /// Publish a Normal `SidecarQuit` Event for each quit a sidecar accepted (one more write a Job).
    ///
    /// Publish a Normal Event `SidecarQuit` on the pod for each quit a sidecar accepted. Off by
    /// default: it is one more API write per Job beside the `valet.dev/ProxyReady` condition's,
    /// and the quits are counted in `valet_sidecar_quits_total` either way. Warnings (a quit
    /// refused, a sidecar signalled) are always published.
    #[arg(long, env = "VALET_QUIT_EVENTS", default_value_t = false, action = clap::ArgAction::Set)]
    pub quit_events: bool,
}

/// Readiness probes of proxies: before and after ready, and of held apps' proxies.
#[derive(Clone, Debug, Args)]
pub struct ProbeFlags {
    /// Interval of readiness probes until the proxy is ready.
    ///
    /// Interval between readiness probes of a proxy that is not ready yet.
    #[arg(long, env = "VALET_PROBE_INTERVAL", default_value = "100ms", value_parser = parse_duration)]
    pub probe_interval: Duration,

    /// Interval of probes once the proxy was ready.
    ///
    /// Interval between probes of a proxy once it was seen ready: they keep the ProxyReady
    /// condition and the connection to the quit endpoint current, and are a full node's idle cost.
    #[arg(long, env = "VALET_READY_PROBE_INTERVAL", default_value = "30s", value_parser = parse_duration)]
    pub ready_probe_interval: Duration,

    /// How often, at most, a held app's proxy is asked.
    ///
    /// How often, at most, the proxy of a pod whose app is held is asked whether it is ready.
    /// A proxy that turns ready with no listen the kernel sees is released about half of this
    /// after (or half of the longer period the CPU budget below sets).
    #[arg(long, env = "VALET_HELD_PROBE_INTERVAL", default_value = "10ms", value_parser = parse_duration)]
    pub held_probe_interval: Duration,

    /// CPU of the held pods' prober, at most, in % of one core.
    ///
    /// The held pods' prober's CPU, at most, in percent of one core: it measures its own CPU and
    /// asks the held pods less often than --held-probe-interval when that would cost more (a
    /// burst of held pods on a busy node). Releases set off by a listen in the pod are not
    /// delayed by it.
    #[arg(long, env = "VALET_HELD_PROBE_CPU", default_value_t = 4.0)]
    pub held_probe_cpu: f64,

    /// With `--held-prober false`: probes a second, at most.
    ///
    /// With --held-prober false: probes per second, at most, across the pods whose app is held,
    /// each on its own loop (at the default, up to 15 held pods every 10 ms, 20 every 13.3 ms).
    #[arg(long, env = "VALET_HELD_PROBE_BUDGET", default_value_t = 1500)]
    pub held_probe_budget: u32,

    /// Held pods' proxies asked from one thread (`false`: a loop per pod).
    ///
    /// Probe the held pods' proxies from one thread of their own: every request of a slot
    /// written back to back on kept connections made in the pods' namespaces, the answers read
    /// as they come, the slot's news sent together (on the runtime, each probe cost wake-ups of
    /// its threads: about twice the CPU). A pod is probed at once when its app is held. Pods
    /// whose network namespace cannot be entered yet stay with their own loops (pod-IP
    /// fallback). `false`: every pod is probed by its own loop on the runtime.
    #[arg(long, env = "VALET_HELD_PROBER", default_value_t = true, action = clap::ArgAction::Set)]
    pub held_prober: bool,
}

/// Holding apps until their proxy is ready: for how long, and how fast they are let go.
#[derive(Clone, Debug, Args)]
pub struct HoldFlags {
    /// Default `valet.dev/hold-timeout`: how long an app is held at most.
    ///
    /// Default time an app is held before it is released anyway (valet.dev/hold-timeout overrides).
    #[arg(long, env = "VALET_HOLD_TIMEOUT", default_value = "120s", value_parser = parse_duration)]
    pub hold_timeout: Duration,

    /// Real-time priority of the release thread (0: none).
    ///
    /// The release thread's real-time priority (SCHED_FIFO, 1-99; 0: it stays in the normal
    /// class). It sends the SIGCONTs of held apps whose proxies turned ready: the apps it wakes
    /// take its CPU otherwise, and on a busy node the last of a batch waited tens of
    /// milliseconds for it. It runs for microseconds per release. Needs CAP_SYS_NICE; without,
    /// the thread keeps the normal class and the log says so.
    #[arg(long, env = "VALET_RELEASE_PRIORITY", default_value_t = 1)]
    pub release_priority: u8,

    /// Real-time priority of the decision path: the held pods' prober and the loop (0: none).
    ///
    /// The real-time priority (SCHED_FIFO, 1-99; 0: the normal class) of the threads between a
    /// held pod's proxy turning ready and its release: the held pods' prober and the agent's
    /// loop, which decides the release. Without it the apps released first take their CPUs
    /// from the decisions of the rest of a round. Needs CAP_SYS_NICE, as --release-priority.
    #[arg(long, env = "VALET_DECIDE_PRIORITY", default_value_t = 0)]
    pub decide_priority: u8,

    /// Real-time priority of the agent's loop and its kernel event reader, and of the held pods'
    /// prober while a release waits on its asks (0: none).
    ///
    /// The real-time priority (SCHED_FIFO, 1-99; 0: the normal class) of the agent's loop, the
    /// thread that decides every pod's next step (a release, a quit) from what the kernel, the
    /// API and the probes report, and of the thread that reads the kernel's events and sends
    /// the quits armed ahead: the processes their decisions wake (released apps, proxies told to
    /// quit) and a busy node's other work take their CPU otherwise, and the rest of a batch
    /// waits for them (after a stall of the agent, the last quits of 200 Jobs went out 60-118 ms
    /// after its resume in the normal class, 40 ms in this one). They use their CPU in bursts of
    /// milliseconds; the kernel's real-time throttling bounds them. The held pods' prober takes it
    /// too while a release waits on its asks (a pod handed over, a listen's, a sweep's after a
    /// pod turned ready), 10 ms at most at a time. The higher of this and --decide-priority. Needs CAP_SYS_NICE, as --release-priority; without, both keep the
    /// normal class and the log says so.
    #[arg(long, env = "VALET_LOOP_PRIORITY", default_value_t = 1)]
    pub loop_priority: u8,
}

/// Acting on labelled pods and observing the others.
#[derive(Clone, Debug, Args)]
pub struct ObserveFlags {
    /// Act on labelled pods (`false`: act on no pod, only observe).
    ///
    /// Act on the pods labelled valet.dev/enabled=true (quit their sidecars, hold their apps,
    /// write their condition and Events). `false`: a look-only install; every pod is only
    /// observed.
    #[arg(long, env = "VALET_ACT", default_value_t = true, action = clap::ArgAction::Set)]
    pub act: bool,

    /// Observe unlabelled pods too (`false`: watch and probe labelled pods only).
    ///
    /// Observe every pod on the node that has a sidecar valet knows, labelled or not, and export
    /// what its sidecars cost (valet_pods_waiting_on_sidecars, valet_sidecar_tax_seconds,
    /// valet_app_started_before_proxy_ready_total). Observing never acts on a pod.
    #[arg(long, env = "VALET_OBSERVE", default_value_t = true, action = clap::ArgAction::Set)]
    pub observe: bool,

    /// Give observed pods' series a `namespace` label (`false`: an empty one).
    ///
    /// Give the observed pods' series a `namespace` label (`false`: an empty one, for clusters
    /// with very many namespaces).
    #[arg(long, env = "VALET_OBSERVE_NAMESPACE_LABEL", default_value_t = true, action = clap::ArgAction::Set)]
    pub observe_namespace_label: bool,

    /// How many namespaces have series of their own.
    ///
    /// How many namespaces the observed pods' series name at a time; pods of namespaces beyond
    /// it share `namespace="_other"`. A namespace with no observed pod for an hour gives its
    /// place back and its series are dropped.
    #[arg(long, env = "VALET_OBSERVE_MAX_NAMESPACES", default_value_t = 50)]
    pub observe_max_namespaces: usize,
}

impl Config {
    /// The runtime state directories to read bundles from: the flag's, else the well-known ones
    /// under the host root.
    pub fn runtime_dirs(&self) -> Vec<PathBuf> {
        if !self.pods.runtime_state_dirs.is_empty() {
            return self.pods.runtime_state_dirs.clone();
        }
        crate::runtime::WELL_KNOWN_STATE_DIRS.iter().map(|d| self.kernel.host_root.join(d)).collect()
    }

    /// The container record directories read first: the flag's, else the well-known ones under
    /// the host root.
    pub fn record_dirs(&self) -> Vec<crate::runtime_record::RecordDir> {
        if !self.pods.runtime_record_dirs.is_empty() {
            let dirs = self.pods.runtime_record_dirs.iter();
            return dirs.map(|d| crate::runtime_record::RecordDir { dir: d.clone(), through: None }).collect();
        }
        crate::runtime_record::dirs_under(&self.kernel.host_root, None)
    }

    /// Where the kubelet's container log links are read: the flag's, else the kubelet's
    /// directory through the host's pid 1.
    pub fn log_links_dir(&self) -> PathBuf {
        self.pods.container_log_links.clone().unwrap_or_else(|| crate::log_links::default_dir(&self.host.host_proc))
    }

    /// Checks what clap cannot.
    pub fn validate(&self) -> Result<()> {
        self.kernel.expected_degraded()?;
        if self.node.node_name.trim().is_empty() {
            return Err(Error::Config("--node-name / NODE_NAME is empty".into()));
        }
        if !self.host.host_proc.join("self").exists() {
            return Err(Error::Config(format!(
                "--host-proc {} is not a proc file system",
                self.host.host_proc.display()
            )));
        }
        self.pods.validate()?;
        self.probes.validate()?;
        if self.holds.release_priority > 99 {
            return Err(Error::Config("--release-priority must be 0 (normal) to 99".into()));
        }
        if self.holds.decide_priority > 99 {
            return Err(Error::Config("--decide-priority must be 0 (normal) to 99".into()));
        }
        if self.holds.loop_priority > 99 {
            return Err(Error::Config("--loop-priority must be 0 (normal) to 99".into()));
        }
        for (flag, d) in [
            ("--quit-timeout", self.quits.quit_timeout),
            ("--probe-interval", self.probes.probe_interval),
            ("--ready-probe-interval", self.probes.ready_probe_interval),
            ("--held-probe-interval", self.probes.held_probe_interval),
            ("--hold-timeout", self.holds.hold_timeout),
            ("--old-record-timeout", self.pins.old_record_timeout),
        ] {
            if d.is_zero() {
                return Err(Error::Config(format!("{flag} must be greater than zero")));
            }
        }
        Ok(())
    }
}

impl KernelFlags {
    /// Where the kernel programs' BTF is read from.
    pub fn btf_path(&self) -> PathBuf {
        self.kernel_btf.clone().unwrap_or_else(|| self.host_root.join(crate::kernel::programs::KERNEL_BTF))
    }

    /// The degraded reasons `--degraded-ok` expects.
    pub fn expected_degraded(&self) -> Result<crate::kernel::mode::ExpectedDegraded> {
        crate::kernel::mode::ExpectedDegraded::parse(&self.degraded_ok)
            .map_err(|e| Error::Config(format!("--degraded-ok: {e}")))
    }
}

impl NodeFlags {
    /// The names the lookup at SIGTERM needs.
    pub fn own_pod(&self) -> crate::api::successor::OwnPodNames<'_> {
        crate::api::successor::OwnPodNames {
            node_name: &self.node_name,
            pod_name: self.pod_name.as_deref(),
            pod_namespace: self.pod_namespace.as_deref(),
        }
    }
}

impl PodFlags {
    fn validate(&self) -> Result<()> {
        if let Some(dir) = self.runtime_state_dirs.iter().find(|d| !d.is_dir()) {
            return Err(Error::Config(format!("--runtime-state-dirs: {} is not a directory", dir.display())));
        }
        // Zero would turn kube's silent-watch timeout off.
        if self.watch_timeout < Duration::from_secs(1) || self.watch_timeout > Duration::from_secs(u64::from(u32::MAX))
        {
            return Err(Error::Config("--watch-timeout must be at least 1s".into()));
        }
        if self.sandboxed_runtime_classes.iter().any(|n| n.trim().is_empty() || n.trim() == "*") {
            return Err(Error::Config(
                "--sandboxed-runtime-classes has an empty entry or a bare * (every pod would be taken as sandboxed)"
                    .into(),
            ));
        }
        if self.sidecar_names.iter().any(|n| n.trim().is_empty()) {
            return Err(Error::Config("--sidecar-names has an empty entry".into()));
        }
        Ok(())
    }
}

impl ProbeFlags {
    fn validate(&self) -> Result<()> {
        if self.held_probe_budget == 0 {
            return Err(Error::Config("--held-probe-budget must be greater than zero".into()));
        }
        if !(self.held_probe_cpu > 0.0 && self.held_probe_cpu <= 100.0) {
            return Err(Error::Config("--held-probe-cpu must be a percentage above 0 and at most 100".into()));
        }
        Ok(())
    }
}

/// Releases held apps at their deadline (see the agent's flags of the same names).
///
/// The deadline keeper's flags (`valet-agent deadlines`): the agent's records it shares, the same
/// flags and variables.
#[derive(Clone, Debug, Parser)]
#[command(name = "valet-agent deadlines", version)]
pub struct KeeperConfig {
    #[command(flatten)]
    pub node: NodeFlags,
    #[command(flatten)]
    pub host: HostPaths,
    #[command(flatten)]
    pub pins: PinFlags,
}

impl KeeperConfig {
    /// Parses `args` (the first the program's name), exiting with clap's message on an error.
    /// The node's name is optional here (empty: whether the node still fits the DaemonSet is not
    /// asked at SIGTERM).
    pub fn parse_from_args<I, T>(args: I) -> KeeperConfig
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        KeeperConfig::try_parse_from_args(args).unwrap_or_else(|e| e.exit())
    }

    fn try_parse_from_args<I, T>(args: I) -> std::result::Result<KeeperConfig, clap::Error>
    where
        I: IntoIterator<Item = T>,
        T: Into<std::ffi::OsString> + Clone,
    {
        use clap::{CommandFactory as _, FromArgMatches as _};
        let command = KeeperConfig::command().mut_arg("node_name", |a| a.required(false).default_value(""));
        KeeperConfig::from_arg_matches(&command.try_get_matches_from(args)?)
    }
}

/// docs/configure.md's table of the agent's flags, made from their definitions: the flag, its
/// environment variable, its default and its short help.
pub fn flag_table() -> String {
    use clap::CommandFactory;
    let mut out = String::from("| flag | environment | default | what |\n|---|---|---|---|\n");
    // Hidden: the downward API's names of the own pod, set by the manifest, no operator's setting.
    for arg in Config::command().get_arguments().filter(|a| !a.is_hide_set()) {
        let Some(long) = arg.get_long().filter(|l| !matches!(*l, "help" | "version")) else { continue };
        let env = arg.get_env().map_or("(none)".to_owned(), |e| format!("`{}`", e.to_string_lossy()));
        let defaults: Vec<String> = arg.get_default_values().iter().map(|v| v.to_string_lossy().into_owned()).collect();
        let default = if !defaults.is_empty() {
            format!("`{}`", defaults.join(","))
        } else if arg.is_required_set() {
            "required".to_owned()
        } else if !arg.get_action().takes_values() {
            "off".to_owned()
        } else {
            "unset".to_owned()
        };
        let what = arg.get_help().map(|h| h.to_string()).unwrap_or_default().replace('|', "\\|");
        out.push_str(&format!("| `--{long}` | {env} | {default} | {what} |\n"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const FLAGS_BEGIN: &str =
        "<!-- flags: made by `VALET_BLESS=1 cargo test -p valet-agent flag_table`; edit config.rs -->\n";
    const FLAGS_END: &str = "<!-- end of flags -->";

    /// docs/configure.md's flag table is the one `valet-agent --help` describes: made from the same
    /// definitions. `VALET_BLESS=1` writes it.
    #[test]
    fn flag_table_in_the_readme_is_the_flags() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/configure.md");
        let readme = std::fs::read_to_string(&path).expect("docs/configure.md");
        let (Some(begin), Some(end)) = (readme.find(FLAGS_BEGIN), readme.find(FLAGS_END)) else {
            panic!("docs/configure.md has no flag table between {FLAGS_BEGIN:?} and {FLAGS_END:?}")
        };
        let table = flag_table();
        let current = &readme[begin + FLAGS_BEGIN.len()..end];
        if std::env::var_os("VALET_BLESS").is_some() {
            let written = format!("{}{table}{}", &readme[..begin + FLAGS_BEGIN.len()], &readme[end..]);
            std::fs::write(&path, written).expect("write docs/configure.md");
            return;
        }
        assert_eq!(
            current, table,
            "docs/configure.md's flag table differs from the flags: VALET_BLESS=1 cargo test -p valet-agent flag_table"
        );
        for (env, flag) in
            [("`VALET_HOLD_TIMEOUT`", "`--hold-timeout`"), ("`VALET_CGROUP_ANCESTORS`", "`--cgroup-ancestors`")]
        {
            assert!(table.lines().any(|l| l.contains(env) && l.contains(flag)), "{env}: {table}");
        }
    }

    /// The keeper reads the agent's flags of the same names (declared once), with the node's name
    /// optional.
    #[test]
    fn the_keeper_shares_the_agents_flags() {
        let keeper = KeeperConfig::try_parse_from_args(["valet-agent deadlines", "--old-pin-dir", "/a,/b"])
            .expect("no node name needed");
        assert_eq!(keeper.node.node_name, "");
        assert_eq!(keeper.pins.old_pin_dirs, [PathBuf::from("/a"), PathBuf::from("/b")]);
        assert_eq!(keeper.pins.pin_dir, PathBuf::from("/sys/fs/bpf/valet"));
        assert_eq!(keeper.pins.old_record_timeout, Duration::from_secs(120));
        assert_eq!(keeper.host.host_proc, PathBuf::from("/proc"));
        let keeper = KeeperConfig::try_parse_from_args([
            "valet-agent deadlines",
            "--node-name",
            "n1",
            "--cgroup-root",
            "/r",
            "--old-record-timeout",
            "5s",
        ])
        .expect("parse");
        assert_eq!(keeper.node.node_name, "n1");
        assert_eq!(keeper.host.cgroup_root, Some(PathBuf::from("/r")));
        assert_eq!(keeper.pins.old_record_timeout, Duration::from_secs(5));
        assert!(KeeperConfig::try_parse_from_args(["valet-agent deadlines", "--hold-timeout", "5s"]).is_err());
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("2s"), Ok(Duration::from_secs(2)));
        assert_eq!(parse_duration("1m30s"), Ok(Duration::from_secs(90)));
        assert_eq!(parse_duration("1.5h"), Ok(Duration::from_secs(5400)));
        for bad in ["", "10", "s", "5x", "-1s", "1e99h"] {
            assert!(parse_duration(bad).is_err(), "{bad:?} must be rejected");
        }
    }

    #[test]
    fn degraded_reasons_expected() {
        use crate::vocab::{DegradedReason, NodeMode};
        let parse = |extra: &[&str]| {
            let mut args = vec!["valet-agent", "--node-name", "n1"];
            args.extend(extra);
            Config::try_parse_from(args).expect("parse")
        };
        let default = parse(&[]);
        assert_eq!(default.kernel.degraded_ok, ["no_btf", "lockdown"]);
        let expected = default.kernel.expected_degraded().expect("the default is valid");
        assert_eq!(expected.unready(NodeMode::Degraded(DegradedReason::Lockdown)), None);
        assert!(expected.unready(NodeMode::Degraded(DegradedReason::KernelUnsupported)).is_some());
        let none = parse(&["--degraded-ok="]);
        assert!(none.validate().is_ok());
        assert!(
            none.kernel.expected_degraded().expect("none").unready(NodeMode::Degraded(DegradedReason::NoBtf)).is_some()
        );
        let bad = parse(&["--degraded-ok", "no_btf,old_kernel"]);
        let err = bad.validate().expect_err("an unknown reason is refused at start").to_string();
        assert!(err.contains("--degraded-ok") && err.contains("old_kernel"), "{err}");
    }

    #[test]
    fn old_records_get_the_hold_timeout_of_the_version_that_wrote_them() {
        let ms = u128::from(valet_common::HELD_DEFAULT_TIMEOUT_MS);
        assert_eq!(parse_duration(OLD_RECORD_TIMEOUT).map(|d| d.as_millis()), Ok(ms));
    }

    #[test]
    fn flags_and_validation() {
        let cfg = Config::try_parse_from(["valet-agent", "--node-name", "n1", "--metrics-addr", "127.0.0.1:0"])
            .expect("parse");
        // The same names a pod plan falls back on.
        assert_eq!(cfg.pods.sidecar_names, crate::pod::spec::DEFAULT_SIDECAR_NAMES);
        assert!(cfg.validate().is_ok());
        assert!(Config::try_parse_from(["valet-agent", "--node-name", "n1", "--metrics-addr", "nope"]).is_err());
        assert!(Config::try_parse_from(["valet-agent", "--node-name", "n1", "--quit-timeout", "forever"]).is_err());
        let mut bad = cfg.clone();
        bad.host.host_proc = "/nonexistent".into();
        assert!(bad.validate().is_err());
        assert_eq!(cfg.probes.held_probe_budget, 1500);
        assert!(cfg.probes.held_prober);
        assert!(
            cfg.observe.act && cfg.observe.observe && cfg.observe.observe_namespace_label,
            "acting and observing by default"
        );
        assert!(
            !cfg.quits.quit_events,
            "no Normal Event per quit by default: the condition is what a Job needs written"
        );
        let events = Config::try_parse_from(["valet-agent", "--node-name", "n1", "--quit-events=true"]).expect("parse");
        assert!(events.quits.quit_events);
        let look_only = Config::try_parse_from(["valet-agent", "--node-name", "n1", "--act=false"]).expect("parse");
        assert!(!look_only.observe.act && look_only.observe.observe);
        let blind = Config::try_parse_from(["valet-agent", "--node-name", "n1", "--observe", "false"]).expect("parse");
        assert!(blind.observe.act && !blind.observe.observe);
        let off =
            Config::try_parse_from(["valet-agent", "--node-name", "n1", "--held-prober", "false"]).expect("parse");
        assert!(!off.probes.held_prober);
        let mut bad = cfg.clone();
        bad.probes.held_probe_budget = 0;
        assert!(bad.validate().is_err());
        assert!(Config::try_parse_from(["valet-agent", "--node-name", "n1", "--held-probe-budget", "-1"]).is_err());
        assert_eq!((cfg.probes.held_probe_interval, cfg.probes.held_probe_cpu), (Duration::from_millis(10), 4.0));
        for cpu in [0.0, -1.0, 100.5, f64::NAN] {
            let mut bad = cfg.clone();
            bad.probes.held_probe_cpu = cpu;
            assert!(bad.validate().is_err(), "--held-probe-cpu {cpu}");
        }
        let mut bad = cfg.clone();
        bad.probes.held_probe_interval = Duration::ZERO;
        assert!(bad.validate().is_err(), "--held-probe-interval 0");
        assert_eq!(cfg.holds.release_priority, 1);
        assert_eq!((cfg.holds.loop_priority, cfg.holds.decide_priority), (1, 0));
        for (priority, ok) in [(0, true), (99, true), (100, false)] {
            let mut c = cfg.clone();
            c.holds.release_priority = priority;
            assert_eq!(c.validate().is_ok(), ok, "--release-priority {priority}");
            let mut c = cfg.clone();
            c.holds.decide_priority = priority;
            assert_eq!(c.validate().is_ok(), ok, "--decide-priority {priority}");
            let mut c = cfg.clone();
            c.holds.loop_priority = priority;
            assert_eq!(c.validate().is_ok(), ok, "--loop-priority {priority}");
        }
        assert_eq!(cfg.pods.watch_timeout, Duration::from_secs(290));
        assert_eq!(cfg.pods.sandboxed_runtime_classes, ["kata", "kata-*", "gvisor", "gvisor-*", "runsc", "runsc-*"]);
        assert_eq!(cfg.kernel.btf_path(), PathBuf::from("/sys/kernel/btf/vmlinux"));
        let custom = Config::try_parse_from([
            "valet-agent",
            "--node-name",
            "n1",
            "--kernel-btf",
            "/b",
            "--sandboxed-runtime-classes",
            "x,y*",
        ])
        .expect("parse");
        assert_eq!(custom.kernel.btf_path(), PathBuf::from("/b"));
        assert_eq!(custom.pods.sandboxed_runtime_classes, ["x", "y*"]);
        let mut bad = cfg.clone();
        bad.pods.sandboxed_runtime_classes = vec!["*".into()];
        assert!(bad.validate().is_err());
        let mut bad = cfg.clone();
        bad.pods.watch_timeout = Duration::from_millis(500);
        assert!(bad.validate().is_err());
    }
}
