//! The one place where the kernel programs and the user-space agent agree on layouts.
//!
//! Everything here is `#[repr(C)]`, fixed-size and `no_std`, so the BPF object and the agent read
//! the same bytes. Map names and global names are constants so neither side can misspell them.
#![no_std]
// Stricter than the workspace: the layouts both sides depend on deserve it.
#![warn(clippy::pedantic)]

/// Name of the hash map of watched cgroups (key: cgroup id, value: [`WatchFlags`] bits).
/// A process matches when its own cgroup or any ancestor is in this map.
pub const MAP_WATCHED: &str = "WATCHED";
/// Name of the ring buffer that carries [`KernelEvent`]s to user space.
pub const MAP_EVENTS: &str = "EVENTS";
/// Name of the per-CPU array of counters, indexed by [`Counter`].
pub const MAP_COUNTERS: &str = "COUNTERS";
/// Name of the LRU map of container cgroups whose first init exec was already judged.
pub const MAP_EXEC_SEEN: &str = "EXEC_SEEN";
/// Name of the hash map where user space classifies container cgroups before they exec
/// (key: cgroup id, value: [`EXEC_CLASS_HOLD`] or [`EXEC_CLASS_PASS`]).
pub const MAP_EXEC_CLASS: &str = "EXEC_CLASS";
/// Name of the hash map of container main processes (key: container cgroup id, value:
/// [`ContainerMain`]). The exec program records the first exec in a container cgroup by a
/// process deeper than the host's pid namespace; user space records containers it finds
/// already running.
pub const MAP_CONTAINERS: &str = "CONTAINERS";

/// Name of the hash map of the processes the exec program stopped (key: thread-group id as the
/// host sees it, value: [`HeldRecord`]). The agent pins it (file [`PIN_HELD`] in its pin
/// directory on bpffs) so that it outlives the agent: a successor of an agent that crashed while
/// holding apps finds every one of them, whatever has become of their pods meanwhile. The
/// program writes the record before the stop, so no stop goes unrecorded.
pub const MAP_HELD: &str = "HELD";
/// File name of the pinned [`MAP_HELD`]; the suffix changes with [`HeldRecord`]'s layout (a pin
/// of another layout is never reused: the kernel would take the old map as it is).
pub const PIN_HELD: &str = "held_v2";
/// File name of the previous version's pinned record ([`HeldRecordV1`]). Version N reads version
/// N−1's records: an agent finds them at start, releases those past their deadline and moves the
/// rest into [`PIN_HELD`], then removes this pin (docs/dev/deadlines.md, "Upgrades").
pub const PIN_HELD_V1: &str = "held_v1";

/// Name of the exit tracepoint program (`sched/sched_process_exit`) that finds a cgroup's
/// ancestors with `bpf_get_current_ancestor_cgroup_id` (not allowed in tracepoints on 5.10).
pub const PROG_EXIT: &str = "valet_exit";
/// Name of the exec tracepoint program (`sched/sched_process_exec`), helper variant.
pub const PROG_EXEC: &str = "valet_exec";
/// The exit program that walks `cgroup->kn->parent` instead (any kernel with BTF).
pub const PROG_EXIT_WALK: &str = "valet_exit_walk";
/// The exec program that walks `cgroup->kn->parent` instead.
pub const PROG_EXEC_WALK: &str = "valet_exec_walk";
/// Name of the listen tracepoint program (`sock/inet_sock_set_state`), helper variant: a socket
/// of a held pod starts listening (its proxy comes up), and the pod is probed at once.
pub const PROG_LISTEN: &str = "valet_listen";
/// The listen program that walks `cgroup->kn->parent`.
pub const PROG_LISTEN_WALK: &str = "valet_listen_walk";
/// Calibration program (tracepoint `sched/sched_process_exit`, loaded alone before the others):
/// records in [`MAP_CALIBRATION`] the absolute level of the pid namespace whose inode number is
/// [`KernelLayout::host_pidns_inum`], from any task that lives in it.
pub const PROG_CALIBRATE: &str = "valet_calibrate";
/// One `u32`: 0 until [`PROG_CALIBRATE`] saw a task of the namespace, then its level + 1.
pub const MAP_CALIBRATION: &str = "CALIBRATION";

/// Ring buffer size in bytes (a power of two, a multiple of the page size).
pub const EVENTS_RING_BYTES: u32 = 256 * 1024;
/// Capacity of [`MAP_WATCHED`]: pod and container cgroups of one node.
pub const WATCHED_CAPACITY: u32 = 16 * 1024;
/// Capacity of [`MAP_EXEC_SEEN`] and [`MAP_EXEC_CLASS`].
pub const EXEC_CAPACITY: u32 = 16 * 1024;
/// Capacity of [`MAP_HELD`]: processes stopped at once on one node. With no room left, execs
/// are not held (a stop nobody recorded could outlive the agent).
pub const HELD_CAPACITY: u32 = 4096;
/// Capacity of [`MAP_CONTAINERS`]: container cgroups of one node's watched pods.
pub const CONTAINERS_CAPACITY: u32 = 16 * 1024;
/// Deepest level of the host's pid namespace accepted (a node inside a node inside a host fits).
pub const MAX_HOST_PIDNS_LEVEL: u32 = 8;
/// How many cgroup ancestor levels the kernel programs look at (kubelet pods sit at depth 2–4;
/// nested or hybrid hosts add a few).
pub const MAX_CGROUP_DEPTH: u32 = 12;

/// Bits of a [`MAP_WATCHED`] value.
pub mod watch_flags {
    /// Report whole-process exits of processes in or below this cgroup.
    pub const EXITS: u32 = 1;
    /// Stop (SIGSTOP) the exec that records a container's main process (the first exec deeper
    /// than the host's pid namespace) in each child cgroup of this cgroup.
    pub const HOLD: u32 = 2;
    /// With [`HOLD`]: bits from here up hold the pod's hold timeout in milliseconds (at most
    /// [`HOLD_TIMEOUT_MAX_MS`]), which the exec program turns into the [`super::HeldRecord`]'s
    /// deadline. 0: [`super::HELD_DEFAULT_TIMEOUT_MS`].
    pub const HOLD_TIMEOUT_SHIFT: u32 = 8;
    /// Largest hold timeout the watched value carries (24 bits of milliseconds, 4.6 hours).
    pub const HOLD_TIMEOUT_MAX_MS: u32 = (1 << 24) - 1;
    // Neither bit: the cgroup is known (an exit or exec there is routed no further) but nothing
    // is recorded, reported or held: a hostPID pod, whose ends come from the API.
}

/// [`MAP_EXEC_CLASS`] value: stop the first init exec in this cgroup (an app container).
pub const EXEC_CLASS_HOLD: u32 = 1;
/// [`MAP_EXEC_CLASS`] value: never stop execs in this cgroup (sidecar, init container, sandbox).
pub const EXEC_CLASS_PASS: u32 = 2;

/// Kinds of [`KernelEvent`].
pub mod event_kind {
    /// A whole process (its thread group) exited.
    pub const EXIT: u32 = 1;
    /// A process was stopped with SIGSTOP right after exec, before its first instruction.
    pub const HELD: u32 = 2;
    /// A TCP socket of a process in a pod watched with [`super::watch_flags::HOLD`] started
    /// listening; [`super::KernelEvent::exit_status`] holds the port.
    pub const LISTEN: u32 = 3;
}

/// Bits of [`KernelEvent::flags`].
pub mod event_flags {
    /// The process was pid 1 of a pid namespace below the host's. Exit events carry it only for
    /// the namespace one level below the host's (a container's own); its exit ends that
    /// namespace (the kernel kills the rest of it).
    pub const NS_INIT: u32 = 1;
    /// The kernel offsets needed to read the exit code were not available; `exit_status` is 0.
    pub const NO_EXIT_CODE: u32 = 2;
    /// The kernel offsets needed to tell a pid-namespace init were not available.
    pub const NO_NS_INFO: u32 = 4;
    /// The process lived in a pid namespace below the host's (a container with a pid namespace
    /// of its own): its container ends with that namespace's init, not with it.
    pub const CHILD_PID_NS: u32 = 8;
    /// The process is its container's recorded main process (see [`super::MAP_CONTAINERS`]):
    /// its exit ends the container. Without it, an exit event is that of pid 1 of a pid
    /// namespace one level below the host's ([`NS_INIT`] set) in a container with no record (or
    /// a record of another process).
    pub const CONTAINER_MAIN: u32 = 16;
}

/// Bits of [`ContainerMain::flags`].
pub mod container_flags {
    /// Recorded by the exec program at the process's exec.
    pub const BY_EXEC: u32 = 1;
    /// Recorded by user space for a container found already running.
    pub const ADOPTED: u32 = 2;
    /// The main process is pid 1 of its pid namespace (a container with a pid namespace of its
    /// own); otherwise it shares a pid namespace (shareProcessNamespace).
    pub const NS_INIT: u32 = 4;
    /// The exec program stopped it (SIGSTOP) at that exec.
    pub const HELD: u32 = 8;
}

/// A [`MAP_CONTAINERS`] value: a container's main process.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ContainerMain {
    /// The process's thread-group id as seen from the host's pid namespace (the agent's: with
    /// hostPID that is the node's, which on kind/k3d nodes is not the kernel's initial one).
    pub tgid: u32,
    /// How many pid namespaces below the host's the process lives (1: a container's own
    /// namespace or the pod's shared one).
    pub pidns_depth: u32,
    /// Inode number of the process's pid namespace (`/proc/<pid>/ns/pid`), 0 when unknown.
    pub pidns_inum: u32,
    /// Bits of [`container_flags`].
    pub flags: u32,
    /// `bpf_ktime_get_ns()` when recorded by the kernel (`CLOCK_MONOTONIC`); 0 when adopted.
    pub ktime_ns: u64,
}

/// A [`MAP_HELD`] value: where and when a process was stopped at exec, and until when.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeldRecord {
    /// The cgroup (v2) id of the container it was stopped in (the pod cgroup's child, however
    /// deep below it the process sat).
    pub cgroup_id: u64,
    /// `bpf_ktime_get_ns()` when it was stopped (`CLOCK_MONOTONIC`).
    pub ktime_ns: u64,
    /// `CLOCK_MONOTONIC` time by which it runs again whatever else happens: `ktime_ns` plus the
    /// pod's hold timeout as known when the pod was watched for holding. Any valet process that
    /// can read the pinned map releases it then, with or without the API.
    pub deadline_ns: u64,
}

/// The record of [`PIN_HELD_V1`] (valet before deadlines were kept in the kernel).
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeldRecordV1 {
    pub cgroup_id: u64,
    pub ktime_ns: u64,
}

/// Hold timeout of a record whose watched value carried none (a [`watch_flags::HOLD`] written
/// without one) or that came from [`PIN_HELD_V1`]: the agent's default `--hold-timeout`.
pub const HELD_DEFAULT_TIMEOUT_MS: u32 = 120_000;

/// The [`MAP_WATCHED`] value for `flags` with a hold timeout of `timeout_ms` (clamped to
/// [`watch_flags::HOLD_TIMEOUT_MAX_MS`]).
#[must_use]
pub const fn watched_value(flags: u32, timeout_ms: u32) -> u32 {
    let ms = if timeout_ms > watch_flags::HOLD_TIMEOUT_MAX_MS { watch_flags::HOLD_TIMEOUT_MAX_MS } else { timeout_ms };
    (flags & ((1 << watch_flags::HOLD_TIMEOUT_SHIFT) - 1)) | (ms << watch_flags::HOLD_TIMEOUT_SHIFT)
}

/// The hold timeout in nanoseconds a [`MAP_WATCHED`] value carries.
#[must_use]
pub const fn watched_hold_timeout_ns(value: u32) -> u64 {
    let ms = value >> watch_flags::HOLD_TIMEOUT_SHIFT;
    let ms = if ms == 0 { HELD_DEFAULT_TIMEOUT_MS } else { ms };
    ms as u64 * 1_000_000
}

/// One event from the kernel programs.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelEvent {
    /// One of [`event_kind`].
    pub kind: u32,
    /// Bits of [`event_flags`].
    pub flags: u32,
    /// `bpf_ktime_get_ns()` when the program ran (`CLOCK_MONOTONIC`).
    pub ktime_ns: u64,
    /// The container's cgroup (v2) id: the watched cgroup's child that holds the process, at any
    /// depth below it (crun runs a container one level below its scope, nested runtimes deeper).
    pub cgroup_id: u64,
    /// The watched cgroup that matched: the process's own or one of its ancestors (the pod).
    pub watched_cgroup_id: u64,
    /// Thread-group id (the pid user space sees).
    pub tgid: u32,
    /// Id of the thread that ran the program (the last thread of the group for exits).
    pub pid: u32,
    /// Raw `task_struct.exit_code`: a wait(2) status (exit status in bits 8–15, terminating
    /// signal in bits 0–6, core dump in bit 7). Zero for [`event_kind::HELD`]; the port listened
    /// on for [`event_kind::LISTEN`].
    pub exit_status: u32,
    /// Pid of the process inside its own pid namespace.
    pub ns_pid: u32,
    /// `comm` of the task, NUL padded.
    pub comm: [u8; 16],
}

/// Bytes of a container cgroup's name an exit event carries, NUL padded: the longest kubelet
/// container cgroup name (`cri-containerd-<64 hex>.scope`, 85 bytes) and room to spare. A longer
/// name is cut, and user space then cannot tell the container by it.
pub const CGROUP_NAME_BYTES: usize = 96;

/// What an [`event_kind::EXIT`] record carries: the event and the name of the container cgroup
/// ([`KernelEvent::cgroup_id`]) as the process left it. The name holds the container's id, so
/// an end read late (after a stall of the agent) is matched to its container even when the
/// runtime has removed the cgroup meanwhile and the agent never saw it. Other kinds are a bare
/// [`KernelEvent`].
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExitRecord {
    pub event: KernelEvent,
    /// The container cgroup's name (its kernfs node's), NUL terminated unless it fills the
    /// array; empty when the kernel layout did not allow reading it.
    pub cgroup_name: [u8; CGROUP_NAME_BYTES],
}

impl KernelEvent {
    #[must_use]
    pub const fn zeroed() -> Self {
        KernelEvent {
            kind: 0,
            flags: 0,
            ktime_ns: 0,
            cgroup_id: 0,
            watched_cgroup_id: 0,
            tgid: 0,
            pid: 0,
            exit_status: 0,
            ns_pid: 0,
            comm: [0; 16],
        }
    }
}

/// Indexes of the [`MAP_COUNTERS`] per-CPU array.
#[repr(u32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Counter {
    /// Events that matched a watched cgroup but did not fit in the ring buffer.
    EventsLost = 0,
    /// Whole-process exits reported.
    ExitsReported = 1,
    /// Processes stopped at exec.
    Held = 2,
    /// Kernel reads that failed (bad offsets, unexpected layout).
    ReadErrors = 3,
    /// Whole-process exits in watched pods dropped in the kernel: not a container's main
    /// process (build steps, test runners, nested sandboxes, runtime helpers).
    ExitsFiltered = 4,
    /// Inserts into [`MAP_CONTAINERS`] or [`MAP_HELD`] that failed for want of room
    /// (E2BIG/ENOMEM): that container's main process is unknown to the kernel, or its exec was
    /// not held.
    MapFull = 5,
    /// Listening sockets reported in held pods.
    Listens = 6,
    /// Listening sockets not reported: the ring buffer was over a quarter full (its room is kept
    /// for container ends; the pod's 10 ms probe still finds the proxy).
    ListensSkipped = 7,
}

/// Number of entries in [`MAP_COUNTERS`].
pub const COUNTER_SLOTS: u32 = 8;

/// Kernel layout facts the programs need, read by user space from the running kernel's BTF
/// (and the tracepoint format file) and written into the object as read-only globals before load.
/// A value of [`OFFSET_UNKNOWN`] switches the feature off instead of reading garbage.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelLayout {
    /// `task_struct.exit_code`.
    pub task_exit_code: u32,
    /// `task_struct.thread_pid` (a `struct pid *`).
    pub task_thread_pid: u32,
    /// `task_struct.signal` (a `struct signal_struct *`).
    pub task_signal: u32,
    /// `signal_struct.live` (an `atomic_t`), used when the tracepoint has no `group_dead`.
    pub signal_live: u32,
    /// `struct pid.level`.
    pub pid_level: u32,
    /// `struct pid.numbers` (array of `struct upid`).
    pub pid_numbers: u32,
    /// `sizeof(struct upid)`.
    pub upid_size: u32,
    /// `struct upid.nr`.
    pub upid_nr: u32,
    /// Offset of `group_dead` in the `sched_process_exit` tracepoint record.
    pub tp_exit_group_dead: u32,
    /// `task_struct.group_leader` (a `struct task_struct *`): the last thread of a process to
    /// exit need not be its leader, and only the leader is "pid 1" of a container's namespace.
    pub task_group_leader: u32,
    /// `struct upid.ns` (a `struct pid_namespace *`).
    pub upid_ns: u32,
    /// `pid_namespace.ns.inum`: offset of the namespace's inode number in `struct pid_namespace`.
    pub pidns_inum: u32,
    /// `task_struct.cgroups` (a `struct css_set *`), for the ancestor walk.
    pub task_cgroups: u32,
    /// `css_set.dfl_cgrp` (the task's cgroup v2 `struct cgroup *`).
    pub css_set_dfl_cgrp: u32,
    /// `cgroup.kn` (a `struct kernfs_node *`; a cgroup's id is its kernfs node's id).
    pub cgroup_kn: u32,
    /// `kernfs_node.parent` (`__parent` since 6.15).
    pub kernfs_node_parent: u32,
    /// `kernfs_node.id` (a u64 since 5.5).
    pub kernfs_node_id: u32,
    /// `kernfs_node.name` (a `const char *`): a container cgroup's name, for exit events.
    pub kernfs_node_name: u32,
    /// Inode number of the host's pid namespace: the agent's own (it runs with hostPID). Not an
    /// offset. 0: unknown, the kernel's initial namespace is taken for the host's.
    pub host_pidns_inum: u32,
    /// Absolute level of the host's pid namespace (0 on a plain host, 1 on a kind/k3d node,
    /// where the node is itself a container). Not an offset. A procfs only shows levels relative
    /// to itself, so user space learns it from [`PROG_CALIBRATE`] before loading the programs:
    /// a constant keeps a loop over a task's namespaces out of them (the 6.1 verifier gives up
    /// on that loop: "sequence of 8193 jumps is too complex").
    pub host_pidns_level: u32,
    /// Offsets of `newstate`, `sport` and `protocol` in the `sock/inet_sock_set_state`
    /// tracepoint record.
    pub tp_sock_newstate: u32,
    pub tp_sock_sport: u32,
    pub tp_sock_protocol: u32,
    /// `css_set.subsys` (an array of `struct cgroup_subsys_state *`, one per controller id).
    pub css_set_subsys: u32,
    /// `cgroup_subsys_state.cgroup` (the `struct cgroup *` of a controller's hierarchy).
    pub css_cgroup: u32,
    /// Not an offset: on a cgroup v1 or hybrid node, the id (`enum cgroup_subsys_id`) of the v1
    /// controller whose hierarchy holds the kubelet's pods and containers. The programs then
    /// find a task's cgroup as `task->cgroups->subsys[id]->cgroup` and walk that hierarchy, and
    /// every cgroup id they report or look up is that hierarchy's. [`CGROUP_V2`] (the default):
    /// the v2 hierarchy.
    pub cgroup_v1_subsys: u32,
}

/// [`KernelLayout::cgroup_v1_subsys`] on a cgroup v2 node: pods are found in the v2 hierarchy.
pub const CGROUP_V2: u32 = u32::MAX;
/// Highest controller id accepted in [`KernelLayout::cgroup_v1_subsys`] (the kernel has about
/// fifteen; a bound keeps the computed offset small).
pub const MAX_CGROUP_SUBSYS: u32 = 63;

/// Marks an offset the running kernel does not provide.
pub const OFFSET_UNKNOWN: u32 = u32::MAX;

impl KernelLayout {
    #[must_use]
    pub const fn unknown() -> Self {
        KernelLayout {
            task_exit_code: OFFSET_UNKNOWN,
            task_thread_pid: OFFSET_UNKNOWN,
            task_signal: OFFSET_UNKNOWN,
            signal_live: OFFSET_UNKNOWN,
            pid_level: OFFSET_UNKNOWN,
            pid_numbers: OFFSET_UNKNOWN,
            upid_size: OFFSET_UNKNOWN,
            upid_nr: OFFSET_UNKNOWN,
            tp_exit_group_dead: OFFSET_UNKNOWN,
            task_group_leader: OFFSET_UNKNOWN,
            upid_ns: OFFSET_UNKNOWN,
            pidns_inum: OFFSET_UNKNOWN,
            task_cgroups: OFFSET_UNKNOWN,
            css_set_dfl_cgrp: OFFSET_UNKNOWN,
            cgroup_kn: OFFSET_UNKNOWN,
            kernfs_node_parent: OFFSET_UNKNOWN,
            tp_sock_newstate: OFFSET_UNKNOWN,
            tp_sock_sport: OFFSET_UNKNOWN,
            tp_sock_protocol: OFFSET_UNKNOWN,
            kernfs_node_id: OFFSET_UNKNOWN,
            kernfs_node_name: OFFSET_UNKNOWN,
            host_pidns_inum: 0,
            host_pidns_level: 0,
            css_set_subsys: OFFSET_UNKNOWN,
            css_cgroup: OFFSET_UNKNOWN,
            cgroup_v1_subsys: CGROUP_V2,
        }
    }
}

/// Name of the global in the BPF object that holds the [`KernelLayout`].
pub const GLOBAL_LAYOUT: &str = "LAYOUT";

#[cfg(feature = "user")]
mod user {
    // SAFETY: plain-old-data, repr(C), no padding-dependent invariants.
    unsafe impl aya::Pod for super::KernelEvent {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::KernelLayout {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::ContainerMain {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::HeldRecord {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::HeldRecordV1 {}
    // SAFETY: as above.
    unsafe impl aya::Pod for super::ExitRecord {}
}
