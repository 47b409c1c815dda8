//! The words every part of the agent shares, and nothing else: what a sidecar is and where it
//! is reached, how a process or a quit ended, what condition a pod should carry, a duration as
//! flags and annotations spell it. A leaf: it imports no module of the agent's, so the decisions (`pod`), the effects they return
//! (`effect`) and the parts that carry them out (`sidecar`, `api`, `act`) can all speak it
//! without depending on each other.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

/// Parses Go-style durations as Kubernetes users write them: `500ms`, `2s`, `1m30s`, `1h`.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    if text.is_empty() {
        return Err("empty duration".into());
    }
    let mut total = Duration::ZERO;
    let mut rest = text;
    while !rest.is_empty() {
        let digits = rest.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(rest.len());
        if digits == 0 {
            return Err(format!("{text:?}: expected a number"));
        }
        let value: f64 = rest[..digits].parse().map_err(|_| format!("{text:?}: bad number"))?;
        rest = &rest[digits..];
        let unit_len = rest.find(|c: char| c.is_ascii_digit() || c == '.').unwrap_or(rest.len());
        let unit = &rest[..unit_len];
        rest = &rest[unit_len..];
        let seconds = match unit {
            "ms" => value / 1000.0,
            "s" => value,
            "m" => value * 60.0,
            "h" => value * 3600.0,
            "" => return Err(format!("{text:?}: missing unit (ms, s, m, h)")),
            other => return Err(format!("{text:?}: unknown unit {other:?}")),
        };
        if !seconds.is_finite() || seconds > 1e9 {
            return Err(format!("{text:?}: out of range"));
        }
        total += Duration::from_secs_f64(seconds);
    }
    Ok(total)
}

/// The sidecars valet knows how to quit and probe: proxies and agents with known endpoints (each
/// one's source is named in docs/sidecars.md), any helper with an HTTP quit endpoint the pod names
/// (`http`), and any helper that ends on a signal (`signal`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SidecarKind {
    Istio,
    Envoy,
    Linkerd,
    CloudSql,
    /// Vault Agent as vault-k8s injects it (`vault-agent`).
    Vault,
    /// Consul's `consul-dataplane` as consul-k8s injects it.
    Consul,
    /// The AlloyDB Auth Proxy.
    AlloyDb,
    /// Kuma's `kuma-sidecar` (kuma-dp).
    Kuma,
    Http,
    Signal,
}

/// An HTTP endpoint on the pod's loopback.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Endpoint {
    pub port: u16,
    pub path: String,
}

impl Endpoint {
    pub fn new(port: u16, path: &str) -> Endpoint {
        Endpoint { port, path: path.to_owned() }
    }
}

impl SidecarKind {
    pub const ALL: [SidecarKind; 10] = [
        SidecarKind::Istio,
        SidecarKind::Envoy,
        SidecarKind::Linkerd,
        SidecarKind::CloudSql,
        SidecarKind::Vault,
        SidecarKind::Consul,
        SidecarKind::AlloyDb,
        SidecarKind::Kuma,
        SidecarKind::Http,
        SidecarKind::Signal,
    ];

    /// The name used in annotations, logs and metric labels.
    pub fn as_str(&self) -> &'static str {
        match self {
            SidecarKind::Istio => "istio",
            SidecarKind::Envoy => "envoy",
            SidecarKind::Linkerd => "linkerd",
            SidecarKind::CloudSql => "cloudsql",
            SidecarKind::Vault => "vault",
            SidecarKind::Consul => "consul",
            SidecarKind::AlloyDb => "alloydb",
            SidecarKind::Kuma => "kuma",
            SidecarKind::Http => "http",
            SidecarKind::Signal => "signal",
        }
    }

    /// Where the proxy accepts `POST` to exit cleanly (exit code 0); none for the generic kinds
    /// (`http` takes it from the pod's annotations, `signal` has none) and for Kuma, whose kuma-dp
    /// ends on SIGTERM (its Envoy admin sits on a Unix socket by default).
    pub fn quit_endpoint(&self) -> Option<Endpoint> {
        match self {
            // pilot-agent, not Envoy: pilot-agent would restart an Envoy that quit alone.
            SidecarKind::Istio => Some(Endpoint::new(15020, "/quitquitquit")),
            SidecarKind::Envoy => Some(Endpoint::new(15000, "/quitquitquit")),
            SidecarKind::Linkerd => Some(Endpoint::new(4191, "/shutdown")),
            SidecarKind::CloudSql | SidecarKind::AlloyDb => Some(Endpoint::new(9091, "/quitquitquit")),
            // The agent's listener (vault-k8s: 127.0.0.1:8200), served with `agent-enable-quit`.
            SidecarKind::Vault => Some(Endpoint::new(8200, "/agent/v1/quit")),
            // consul-dataplane's own lifecycle server, not Envoy's admin: with Envoy gone alone,
            // consul-k8s's liveness probe restarts the container. Port as consul-k8s sets it.
            SidecarKind::Consul => Some(Endpoint::new(20600, "/graceful_shutdown")),
            SidecarKind::Kuma | SidecarKind::Http | SidecarKind::Signal => None,
        }
    }

    /// Where `GET` answers 2xx once the proxy can carry the app's traffic; none for the generic
    /// kinds unless the pod names one.
    pub fn ready_endpoint(&self) -> Option<Endpoint> {
        match self {
            SidecarKind::Istio => Some(Endpoint::new(15021, "/healthz/ready")),
            SidecarKind::Envoy => Some(Endpoint::new(15000, "/ready")),
            SidecarKind::Linkerd => Some(Endpoint::new(4191, "/ready")),
            SidecarKind::CloudSql | SidecarKind::AlloyDb => Some(Endpoint::new(9090, "/readiness")),
            // Envoy's admin under consul-dataplane (what its `-check-proxy-health` asks).
            SidecarKind::Consul => Some(Endpoint::new(19000, "/ready")),
            // kuma-dp's readiness reporter.
            SidecarKind::Kuma => Some(Endpoint::new(9902, "/ready")),
            // Vault Agent has no readiness endpoint of its own (its listener proxies to Vault).
            SidecarKind::Vault | SidecarKind::Http | SidecarKind::Signal => None,
        }
    }
}

/// Every kind's name, for errors and Events.
pub const KIND_NAMES: &str = "istio, envoy, linkerd, cloudsql, vault, consul, alloydb, kuma, http, signal";

impl fmt::Display for SidecarKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A kind name valet does not know.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown sidecar kind {0:?} (valet knows {KIND_NAMES})")]
pub struct UnknownKind(pub String);

/// Parses a kind name. ASCII case and surrounding spaces are ignored (`Istio` is `istio`): the
/// names cannot be confused with each other, so being lenient here cannot pick a wrong proxy.
impl FromStr for SidecarKind {
    type Err = UnknownKind;

    fn from_str(text: &str) -> Result<SidecarKind, UnknownKind> {
        let wanted = text.trim();
        SidecarKind::ALL
            .into_iter()
            .find(|k| k.as_str().eq_ignore_ascii_case(wanted))
            .ok_or_else(|| UnknownKind(text.to_owned()))
    }
}

/// One sidecar of a pod and how to end it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Sidecar {
    pub name: String,
    pub kind: SidecarKind,
    /// Its HTTP quit endpoint; none: it is ended with `quit_signal`.
    pub quit: Option<Endpoint>,
    /// Its readiness endpoint; none: valet cannot tell when it is ready (no hold, no condition).
    pub ready: Option<Endpoint>,
    /// The signal that ends a sidecar without a quit endpoint.
    pub quit_signal: i32,
}

/// How a quit ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum QuitOutcome {
    /// 2xx: the sidecar will exit. `sent_ns`: when the accepted request's last byte was written
    /// (CLOCK_MONOTONIC, the kernel's event clock; 0 if not known).
    Accepted { status: u16, attempts: u32, sent_ns: u64 },
    /// A definitive refusal (4xx): the endpoint is not there or not allowed; retrying won't help.
    Rejected { status: u16, body: String },
    /// Never got an acceptance in the retry window.
    Failed { last: String, label: &'static str, attempts: u32 },
}

impl QuitOutcome {
    /// Short label for metrics.
    pub fn label(&self) -> &'static str {
        match self {
            QuitOutcome::Accepted { .. } => "ok",
            QuitOutcome::Rejected { .. } => "rejected",
            QuitOutcome::Failed { label, .. } => label,
        }
    }
}

/// The condition valet wants on a pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProxyReady {
    pub ready: bool,
    pub reason: &'static str,
    pub message: String,
}

/// How a process ended, decoded from a wait(2) status.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProcessEnd {
    /// `exit(n)` or return from main.
    Exited(i32),
    /// Killed by a signal.
    Signaled { signal: i32, core_dumped: bool },
}

impl ProcessEnd {
    /// Decodes `task_struct.exit_code`: status in bits 8–15, signal in bits 0–6, core in bit 7.
    pub fn from_wait_status(raw: u32) -> ProcessEnd {
        let signal = (raw & 0x7f) as i32;
        if signal == 0 {
            ProcessEnd::Exited(((raw >> 8) & 0xff) as i32)
        } else {
            ProcessEnd::Signaled { signal, core_dumped: raw & 0x80 != 0 }
        }
    }

    /// The exit code a container runtime reports for this end (128 + signal for signals).
    pub fn container_exit_code(&self) -> i32 {
        match *self {
            ProcessEnd::Exited(code) => code,
            ProcessEnd::Signaled { signal, .. } => 128 + signal,
        }
    }
}

/// Why the kernel programs could not run on this node. The agent then runs degraded: every
/// pod's ends come from the API's container status, and no app is held. Bounded: these are the
/// `reason` label values of `valet_node_info`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DegradedReason {
    /// No kernel BTF (`/sys/kernel/btf/vmlinux` missing, or `--kernel-btf` names no file):
    /// the programs' struct offsets cannot be read.
    NoBtf,
    /// The kernel is locked down (`lockdown=confidentiality`): `bpf_probe_read_kernel` and
    /// tracefs are taken away.
    Lockdown,
    /// The kernel refused BPF itself (EPERM/EACCES: a missing capability, a seccomp profile,
    /// an LSM policy, `kernel.unprivileged_bpf_disabled`).
    BpfDenied,
    /// The locked-memory limit is too low for the maps (kernels before 5.11).
    Memlock,
    /// No tracefs mounted, and it could not be mounted: the tracepoints cannot be attached.
    NoTracefs,
    /// The verifier rejected the programs: a kernel too old, or built without what they use.
    KernelUnsupported,
    /// Anything else; the log says what.
    LoadFailed,
}

impl DegradedReason {
    pub const ALL: [DegradedReason; 7] = [
        DegradedReason::NoBtf,
        DegradedReason::Lockdown,
        DegradedReason::BpfDenied,
        DegradedReason::Memlock,
        DegradedReason::NoTracefs,
        DegradedReason::KernelUnsupported,
        DegradedReason::LoadFailed,
    ];

    /// The metric label and log word.
    pub fn as_str(&self) -> &'static str {
        match self {
            DegradedReason::NoBtf => "no_btf",
            DegradedReason::Lockdown => "lockdown",
            DegradedReason::BpfDenied => "bpf_denied",
            DegradedReason::Memlock => "memlock",
            DegradedReason::NoTracefs => "no_tracefs",
            DegradedReason::KernelUnsupported => "kernel_unsupported",
            DegradedReason::LoadFailed => "load_failed",
        }
    }

    /// What an operator reads in Events and the log.
    pub fn explain(&self) -> &'static str {
        match self {
            DegradedReason::NoBtf => "the node's kernel has no BTF (/sys/kernel/btf/vmlinux)",
            DegradedReason::Lockdown => "the node's kernel is locked down (lockdown=confidentiality)",
            DegradedReason::BpfDenied => "the node denies BPF to the agent (capabilities, seccomp or LSM policy)",
            DegradedReason::Memlock => "the locked-memory limit is too low for the kernel programs",
            DegradedReason::NoTracefs => "tracefs is not mounted and could not be mounted",
            DegradedReason::KernelUnsupported => "the node's kernel rejects valet's kernel programs",
            DegradedReason::LoadFailed => "valet's kernel programs could not be loaded",
        }
    }
}

impl fmt::Display for DegradedReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a pod valet was asked to look after is left alone: the `reason` label values of
/// `valet_pod_skips_total`, each explained in docs/monitoring.md. Counted once per pod and
/// reason.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SkipReason {
    /// The pod's valet annotations cannot be read (an Event says why).
    BadAnnotation,
    /// A `hostNetwork` pod: its sidecar's loopback is the node's.
    HostNetwork,
    /// `restartPolicy: Always`: the apps never finish, so nothing is quit (holds still apply).
    RestartAlways,
    /// Its only sidecars are native ones valet does not know: the kubelet ends them.
    NativeSidecars,
    /// No container is a sidecar valet knows.
    NoSidecars,
    /// Every container is a sidecar: no app whose end would mean anything.
    NoApps,
    /// The pod is being deleted: the kubelet stops every container anyway.
    Deleting,
    /// An app's `restartPolicyRules` name an operator or action valet does not know (a newer
    /// API's): the exits such a rule could decide are left to the kubelet (no quit after them).
    UnknownRestartRule,
}

impl SkipReason {
    pub const ALL: [SkipReason; 8] = [
        SkipReason::BadAnnotation,
        SkipReason::HostNetwork,
        SkipReason::RestartAlways,
        SkipReason::NativeSidecars,
        SkipReason::NoSidecars,
        SkipReason::NoApps,
        SkipReason::Deleting,
        SkipReason::UnknownRestartRule,
    ];

    /// The metric label and log word.
    pub fn as_str(self) -> &'static str {
        match self {
            SkipReason::BadAnnotation => "bad_annotation",
            SkipReason::HostNetwork => "host_network",
            SkipReason::RestartAlways => "restart_always",
            SkipReason::NativeSidecars => "native_sidecars",
            SkipReason::NoSidecars => "no_sidecars",
            SkipReason::NoApps => "no_apps",
            SkipReason::Deleting => "deleting",
            SkipReason::UnknownRestartRule => "unknown_restart_rule",
        }
    }
}

impl fmt::Display for SkipReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How the agent sees this node's containers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NodeMode {
    /// The kernel programs run: ends as they happen, holds.
    Kernel,
    /// The kernel programs could not run: ends from the API, no holds.
    Degraded(DegradedReason),
}

impl NodeMode {
    /// The `mode` label of `valet_node_info`.
    pub fn label(&self) -> &'static str {
        match self {
            NodeMode::Kernel => "kernel",
            NodeMode::Degraded(_) => "degraded",
        }
    }

    /// The `reason` label of `valet_node_info` (`none` in kernel mode).
    pub fn reason_label(&self) -> &'static str {
        match self {
            NodeMode::Kernel => "none",
            NodeMode::Degraded(r) => r.as_str(),
        }
    }
}

/// Why the node's kernel cannot see a pod's app, so that its ends come from the API's container
/// status (about a second after the kubelet notices them) and it is never held.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ApiPath {
    /// `spec.hostPID`: nothing tells its containers' main processes from the node's.
    HostPid,
    /// A sandboxed `runtimeClassName` (Kata, gVisor, GKE Sandbox): its app runs in a VM or a
    /// user-space kernel the node's kernel does not see.
    Sandboxed { runtime_class: String },
    /// A `runtimeClassName` the agent's last list of RuntimeClasses did not have (made since, or
    /// the list refused): its handler, a sandbox's or not, is unknown, so no guess.
    UnknownRuntimeClass { runtime_class: String },
    /// The whole node runs degraded.
    NodeDegraded(DegradedReason),
}

impl ApiPath {
    /// The `reason` label of `valet_pods_api_path_total`.
    pub fn label(&self) -> &'static str {
        match self {
            ApiPath::HostPid => "host_pid",
            ApiPath::Sandboxed { .. } => "sandboxed",
            ApiPath::UnknownRuntimeClass { .. } => "unknown_runtime_class",
            ApiPath::NodeDegraded(_) => "node_degraded",
        }
    }

    /// Why, in a sentence for Events and logs.
    pub fn explain(&self) -> String {
        match self {
            ApiPath::HostPid => "the pod runs in the node's pid namespace (hostPID), where the node's kernel cannot \
                                 tell its containers' processes from the node's"
                .into(),
            ApiPath::Sandboxed { runtime_class } => {
                format!("the pod runs sandboxed (runtimeClassName {runtime_class}), out of the node's kernel's sight")
            }
            ApiPath::UnknownRuntimeClass { runtime_class } => format!(
                "the pod's runtimeClassName {runtime_class} was not in the agent's last list of RuntimeClasses: \
                 whether it runs sandboxed, out of the node's kernel's sight, is unknown (listed again now)"
            ),
            ApiPath::NodeDegraded(reason) => {
                format!("valet runs degraded on this node: {} ({reason})", reason.explain())
            }
        }
    }
}
