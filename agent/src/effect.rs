//! The messages between a pod's state machine (`pod::state`) and the actuators (`act`): the
//! effects a transition asks for, and the feedback their results come back as. Plain data only;
//! this module imports no caller, so neither side depends on the other. (The words every part
//! shares, such as a sidecar or an endpoint, are `vocab`'s.)

use crate::vocab::{Endpoint, ProcessEnd, ProxyReady, QuitOutcome, Sidecar, SkipReason};

/// A time on the kernel's monotonic clock (`bpf_ktime_get_ns`, `CLOCK_MONOTONIC`), in ns. Every
/// transition gets "now" as an argument; nothing in `pod::state` reads a clock.
pub type Nanos = u64;

/// How often a pod's readiness probe runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pace {
    /// An app is held: as fast as useful (the release latency is about half the interval).
    Urgent,
    /// Not ready yet, nothing held: the configured probe interval.
    Normal,
    /// Seen ready: a slow refresh that keeps the condition current.
    Relaxed,
}

/// A container cgroup of the pod, as read from the node (cgroup tree, runtime bundle).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ContainerSeen {
    pub cgroup_id: u64,
    /// Path relative to the cgroup2 root.
    pub rel: String,
    /// The runtime's container id (64 hex).
    pub id: String,
    /// The runtime's own name for it (OCI bundle annotations), read before the API shows it.
    pub runtime_name: Option<RuntimeName>,
    /// Its first exec already happened before this agent could judge it (an earlier agent held
    /// it, or the kernel recorded it): it must never be held now.
    pub exec_done: bool,
    /// Some process lives in it (or below it).
    pub live: bool,
}

/// What the runtime's bundle says a container is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RuntimeName {
    Sandbox,
    Container(String),
}

/// A process found stopped at exec in one of the pod's containers: an earlier agent held it and
/// died (or its event is still on the way).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LeftHeld {
    pub tgid: u32,
    pub container_cgroup: u64,
    /// When it was stopped, as well as the node can tell (its start time): the hold deadline
    /// counts from there, so an agent restart never extends a hold.
    pub since: Nanos,
}

/// A container's main process ended, as the kernel saw it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExitSeen {
    pub container_cgroup: u64,
    pub tgid: u32,
    /// `None`: the exit code could not be read.
    pub end: Option<ProcessEnd>,
    pub ktime: Nanos,
    /// The container cgroup's name the kernel read at the end (it holds the container's id).
    pub cgroup_name: Option<String>,
    /// The process lived in a pid namespace below the host's and was not its pid 1: in a pod
    /// whose containers each have a pid namespace of their own, never a container's main process
    /// (the kernel took a later exec for it: the container started before its pod was watched).
    pub ns_child: bool,
}

/// A process the kernel stopped at its first exec.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeldSeen {
    pub container_cgroup: u64,
    pub tgid: u32,
    pub ktime: Nanos,
    pub comm: String,
}

/// What a transition asks the outside world to do.
#[derive(Clone, Debug, PartialEq)]
pub enum Effect {
    /// Look for the pod's cgroup (answered with [`Feedback::PodCgroup`]).
    FindPodCgroup,
    /// List the pod's container cgroups and name them from the runtime's bundles (answered with
    /// [`Feedback::Containers`]). With `adopt` (the look before the kernel watches the pod), the
    /// main process of a container already running is recorded with the kernel; later looks never
    /// do, since the watching kernel records it at its first exec (a runtime's init process waits
    /// in the container's cgroup and pid namespace before that exec, and must not be taken for it).
    ScanContainers {
        pod_rel: String,
        adopt: bool,
    },
    /// Name a container the agent never saw from the kubelet's log link of its id, `id` (answered
    /// with [`Feedback::EndedNamed`]): it started and ended while the agent could not look.
    NameEnded {
        container_cgroup: u64,
        id: String,
    },
    /// Look for processes an earlier agent left stopped at exec (answered with
    /// [`Feedback::LeftHeld`]).
    FindLeftHeld {
        pod_rel: String,
    },
    /// Tell the kernel about the pod's cgroup: report its containers' ends (`exits`); hold apps'
    /// first exec (`hold`). New container cgroups are also watched for as they are made, so that
    /// each is named (and, in a held pod, its first exec classified) before it runs.
    Watch {
        pod_cgroup: u64,
        pod_rel: String,
        exits: bool,
        hold: bool,
        /// The pod's hold timeout: the kernel's record of each process it holds carries the
        /// deadline it makes (released then even with no agent, or no API).
        hold_timeout: std::time::Duration,
    },
    Unwatch {
        pod_cgroup: u64,
    },
    /// Tell the kernel, before a container's first exec, whether to hold it.
    ClassifyExec {
        container_cgroup: u64,
        hold: bool,
    },
    /// Drop every kernel map entry of a container cgroup.
    ForgetContainer {
        container_cgroup: u64,
    },
    /// Open the pod's network namespace ahead of time (answered with [`Feedback::Network`]).
    OpenNetwork {
        pod_rel: String,
    },
    /// Close it: the pod's work is done.
    CloseNetwork,
    /// Ask a sidecar to quit (answered with [`Feedback::QuitDone`]).
    Quit {
        sidecar: String,
        instance: Option<String>,
        endpoint: Endpoint,
        pod_rel: String,
        /// Set for a sandboxed pod: its loopback is inside the sandbox, out of the node's reach,
        /// so the quit goes to the pod IP instead.
        pod_ip: Option<String>,
    },
    /// Signal a sidecar's processes: a helper whose quit is a signal, or a sidecar still running
    /// after its quit (answered with [`Feedback::Signalled`]).
    Signal {
        sidecar: String,
        container_rel: String,
        signal: i32,
    },
    /// Start probing the sidecars' readiness (results come as [`Feedback::Probed`]); replaces a
    /// running probe.
    StartProbe {
        sidecars: Vec<Sidecar>,
        pod_rel: Option<String>,
        pod_ip: Option<String>,
        pace: Pace,
    },
    SetPace(Pace),
    StopProbe,
    /// A process was held: check it against its container's cgroup and pin it now, so that its
    /// release is only the signal.
    Pin {
        tgid: u32,
        container_rel: String,
    },
    /// Let a held process run (SIGCONT, checked against its container's cgroup).
    Release {
        tgid: u32,
        container_rel: String,
        reason: &'static str,
        since: Nanos,
    },
    /// Write the `valet.dev/ProxyReady` condition (answered with [`Feedback::ConditionWritten`]).
    WriteCondition(ProxyReady),
    /// Publish a Kubernetes Event about the pod.
    Publish {
        warning: bool,
        reason: &'static str,
        action: &'static str,
        note: String,
    },
    /// Watch the runtime's record of container instance `container_id` (an app whose end the
    /// kernel saw) until it shows the end (answered with [`Feedback::Recorded`], or not at all:
    /// no record, or no end in it).
    WatchRecord {
        container_id: String,
        /// The pod's cgroup, where the runtime that started it is looked for.
        pod_rel: Option<String>,
    },
    /// Count something in the metrics.
    Count(Count),
}

/// Metric observations a transition makes.
#[derive(Clone, Debug, PartialEq)]
pub enum Count {
    /// A container's end seen by the kernel.
    ContainerEnd(Option<ProcessEnd>),
    /// The pod is skipped, with a low-cardinality reason.
    Skip(SkipReason),
    /// An app process is held.
    Hold,
    FailOpen,
    Quit {
        kind: &'static str,
        result: &'static str,
    },
    /// Seconds from the end of the work to the sidecar's acceptance of the quit.
    QuitLatency(f64),
    Escalation {
        kind: &'static str,
    },
    ConditionPatch {
        ok: bool,
    },
    /// A pod the node's kernel cannot see, served from the API, with the reason's label.
    ApiPath(&'static str),
}

/// Results of effects, fed back into the pod's state. `ConditionWritten::version` is the pod's
/// resourceVersion the write produced, when the server said it.
#[derive(Clone, Debug)]
pub enum Feedback {
    PodCgroup {
        rel: String,
        id: u64,
    },
    /// Every container cgroup the pod has on the node now (a scan of the pod cgroup): one the
    /// API calls running that is not among them has ended.
    Containers(Vec<ContainerSeen>),
    /// What [`Effect::NameEnded`] found: the container's name, `None` when no link names it.
    EndedNamed {
        container_cgroup: u64,
        name: Option<String>,
    },
    /// What [`Effect::FindLeftHeld`] found. `complete`: every container's processes were read;
    /// when one could not be (a read error), a process left held there may be missing from
    /// `found`, and the search is made again later.
    LeftHeld {
        found: Vec<LeftHeld>,
        complete: bool,
    },
    Network {
        ok: bool,
        detail: String,
    },
    Probed {
        ready: bool,
        detail: String,
    },
    QuitDone {
        sidecar: String,
        outcome: QuitOutcome,
    },
    Signalled {
        sidecar: String,
        signal: i32,
        signalled: usize,
    },
    ConditionWritten {
        want: ProxyReady,
        error: Option<String>,
        version: Option<String>,
    },
    /// The runtime has recorded container instance `container_id`'s end: every look of the
    /// kubelet's from now on sees it ended.
    Recorded {
        container_id: String,
    },
}
