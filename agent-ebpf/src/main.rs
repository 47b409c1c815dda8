//! valet's kernel programs.
//!
//! * `valet_exit` (tracepoint `sched/sched_process_exit`): reports the whole-process exit of each
//!   container's main process in watched pods, with the decoded-later wait status, and that of
//!   pid 1 of a pid namespace one level below the host's (a container's own namespace). Every other
//!   exit in a watched pod (build steps, test runners, nested sandboxes, runtime helpers) is
//!   dropped here and only counted, so a fork storm never reaches user space.
//! * `valet_exec` (tracepoint `sched/sched_process_exec`): records each container's main process
//!   — the first exec in a container cgroup by a process deeper than the host's pid namespace —
//!   and, in a held pod, stops that exec with SIGSTOP before it runs one instruction of its own.
//!
//! * `valet_listen` (tracepoint `sock/inet_sock_set_state`): reports a TCP socket that starts
//!   listening in a pod watched for holds (the pod's proxy comes up), so that user space probes
//!   the proxy at once instead of at its next poll. Every other state change of every socket of
//!   the node passes through it: it returns after one read of the record for those.
//!
//! A container is the watched pod cgroup's child and everything below it (crun's `/container`
//! leaf, a nested runtime's cgroups): events and map keys always name that child.
//!
//! A container's main process: the runtime starts it in the container's cgroup and pid namespace
//! (pid 1 there, or any pid in a pod-wide shared namespace). Runtime helpers exec in the host's
//! pid namespace first (runc ≥ 1.2 starts `runc init` inside the container cgroup with
//! CLONE_INTO_CGROUP) and are never taken for it; nor is anything the main process starts later
//! (its exec is not the first), such as pid 1 of a sandbox's nested pid namespace. "The host's
//! pid namespace" is the agent's own (it runs with hostPID), which user space names by its inode
//! number and its absolute level (on kind/k3d nodes the node is itself a container and that level
//! is not 0), learnt before loading from `valet_calibrate`, which records the level of a task of
//! that namespace. A constant level keeps loops over a task's namespaces out of the programs.
//!
//! Each program comes in two variants that differ only in how they find a process's pod cgroup:
//! `bpf_get_current_ancestor_cgroup_id` (the verifier refuses it in tracepoints before 5.11) or a
//! walk up `cgroup->kn->parent` with probe reads (`*_walk`). User space loads the helper variant
//! and falls back to the walk when the verifier refuses it. The variant is a const generic, so
//! the unused path is not in the other variant's code at all.
//!
//! Kernel struct offsets come from user space (read from BTF at load time) through the read-only
//! global `LAYOUT`; nothing here hard-codes a kernel layout.
#![no_std]
#![no_main]
#![allow(
    unreachable_pub,
    reason = "aya-ebpf's program attributes take a `pub fn` (its documented form); the object exports them by name"
)]

use aya_ebpf::{
    helpers::{
        bpf_get_current_comm, bpf_get_current_pid_tgid, bpf_ktime_get_ns, bpf_probe_read_kernel,
        bpf_probe_read_kernel_str_bytes,
        generated::{
            bpf_get_current_ancestor_cgroup_id, bpf_get_current_cgroup_id, bpf_get_current_task, bpf_send_signal,
        },
    },
    macros::{map, tracepoint},
    maps::{Array, HashMap, LruHashMap, PerCpuArray, RingBuf, ring_buf::RingBufEntry},
    programs::TracePointContext,
};
use valet_common::{
    CGROUP_V2, CONTAINERS_CAPACITY, COUNTER_SLOTS, ContainerMain, Counter, EVENTS_RING_BYTES, EXEC_CAPACITY,
    EXEC_CLASS_PASS, ExitRecord, HELD_CAPACITY, HeldRecord, KernelEvent, KernelLayout, MAX_CGROUP_DEPTH,
    MAX_CGROUP_SUBSYS, MAX_HOST_PIDNS_LEVEL, OFFSET_UNKNOWN, WATCHED_CAPACITY, container_flags, event_flags,
    event_kind, watch_flags, watched_hold_timeout_ns,
};

const SIGSTOP: u32 = 19;
/// `BPF_NOEXIST`: insert only when the key is absent.
const BPF_NOEXIST: u64 = 1;
const EEXIST: i32 = 17;
const E2BIG: i32 = 7;
const ENOMEM: i32 = 12;
/// The kernel's MAX_PID_NS_LEVEL.
const MAX_PID_NS_LEVEL: u32 = 32;
/// The kernel's `TCP_LISTEN` socket state and `IPPROTO_TCP`.
const TCP_LISTEN: i32 = 10;
const IPPROTO_TCP: u16 = 6;
/// `BPF_RB_AVAIL_DATA`: bytes in the ring buffer not yet consumed.
const BPF_RB_AVAIL_DATA: u64 = 0;

#[unsafe(no_mangle)]
static LAYOUT: KernelLayout = KernelLayout::unknown();

#[map(name = "WATCHED")]
static WATCHED: HashMap<u64, u32> = HashMap::with_max_entries(WATCHED_CAPACITY, 0);

#[map(name = "EVENTS")]
static EVENTS: RingBuf = RingBuf::with_byte_size(EVENTS_RING_BYTES, 0);

#[map(name = "COUNTERS")]
static COUNTERS: PerCpuArray<u64> = PerCpuArray::with_max_entries(COUNTER_SLOTS, 0);

#[map(name = "EXEC_SEEN")]
static EXEC_SEEN: LruHashMap<u64, u8> = LruHashMap::with_max_entries(EXEC_CAPACITY, 0);

#[map(name = "EXEC_CLASS")]
static EXEC_CLASS: HashMap<u64, u32> = HashMap::with_max_entries(EXEC_CAPACITY, 0);

#[map(name = "CALIBRATION")]
static CALIBRATION: Array<u32> = Array::with_max_entries(1, 0);

#[map(name = "CONTAINERS")]
static CONTAINERS: HashMap<u64, ContainerMain> = HashMap::with_max_entries(CONTAINERS_CAPACITY, 0);

/// Every process stopped at exec, pinned by user space so that it outlives the agent.
#[map(name = "HELD")]
static HELD: HashMap<u32, HeldRecord> = HashMap::with_max_entries(HELD_CAPACITY, 0);

#[inline(always)]
fn layout() -> KernelLayout {
    // SAFETY: LAYOUT is a valid static; read_volatile keeps the compiler from folding the
    // load-time value into the compile-time default.
    unsafe { core::ptr::read_volatile(&LAYOUT) }
}

#[inline(always)]
fn count(counter: Counter) {
    if let Some(slot) = COUNTERS.get_ptr_mut(counter as u32) {
        // SAFETY: per-CPU slot, no concurrent writer on this CPU.
        unsafe { *slot += 1 };
    }
}

/// Writes `event` into its reserved slot and submits it, counted first: a reader that has the
/// event sees its count too.
#[inline(always)]
fn submit_counted(mut entry: RingBufEntry<KernelEvent>, event: KernelEvent, counter: Counter) {
    entry.write(event);
    submit_written(entry, counter);
}

/// Submits a record already written in place, counted first (as [`submit_counted`]).
#[inline(always)]
fn submit_written<T: 'static>(entry: RingBufEntry<T>, counter: Counter) {
    count(counter);
    entry.submit(0);
}

#[inline(always)]
fn read_u32(base: u64, off: u32) -> Option<u32> {
    if off == OFFSET_UNKNOWN || base == 0 {
        return None;
    }
    // SAFETY: bpf_probe_read_kernel checks the address and fails softly.
    unsafe { bpf_probe_read_kernel((base + off as u64) as *const u32).ok() }
}

#[inline(always)]
fn read_u64(base: u64, off: u32) -> Option<u64> {
    if off == OFFSET_UNKNOWN || base == 0 {
        return None;
    }
    // SAFETY: as above.
    unsafe { bpf_probe_read_kernel((base + off as u64) as *const u64).ok() }
}

/// Returns (container cgroup id, matched watched cgroup id, its flags) when the current task's
/// cgroup or one of its ancestors is watched. The container cgroup is the watched (pod) cgroup's
/// child on the task's path, however deep the task sits below it: crun runs a container's
/// processes one level below its scope (`…/cri-containerd-<id>.scope/container`), and nested
/// runtimes (dind, podman in a CI runner) make cgroups of their own under the container. All of
/// them are that one container, and only its id ever becomes a map key, so sub-cgroups never
/// grow the maps. 0 when the task is in the watched cgroup itself.
#[inline(always)]
fn watched_match<const WALK: bool>(l: &KernelLayout, task: u64) -> Option<(u64, u64, u32)> {
    // A v1 node (LAYOUT is read-only: the verifier drops the branch not taken). Only the walk
    // reads a v1 hierarchy: user space loads nothing else there.
    if WALK && l.cgroup_v1_subsys != CGROUP_V2 {
        return watched_match_v1(l, task);
    }
    // SAFETY: helper without pointer arguments (4.18+, allowed in tracepoints).
    let own = unsafe { bpf_get_current_cgroup_id() };
    // SAFETY: map lookup by value; the reference is copied out at once.
    if let Some(flags) = unsafe { WATCHED.get(own) } {
        return Some((0, own, *flags));
    }
    if WALK {
        // task->cgroups->dfl_cgrp->kn, then up kn->parent.
        let kn = task_cgroup_kn(l, task)?;
        return walk_up(l, kn, own);
    }
    let mut level = 0u32;
    while level < MAX_CGROUP_DEPTH {
        // SAFETY: helper without pointer arguments.
        let ancestor = unsafe { bpf_get_current_ancestor_cgroup_id(level as i32) };
        if ancestor == 0 || ancestor == own {
            break;
        }
        // SAFETY: as above.
        if let Some(flags) = unsafe { WATCHED.get(ancestor) } {
            // The next level down is at most the task's own cgroup (the loop stopped before it).
            // SAFETY: helper without pointer arguments.
            let child = unsafe { bpf_get_current_ancestor_cgroup_id(level as i32 + 1) };
            return Some((if child == 0 { own } else { child }, ancestor, *flags));
        }
        level += 1;
    }
    None
}

/// [`watched_match`] on a cgroup v1 or hybrid node, where the kubelet's cgroups live in the v1
/// hierarchies and `bpf_get_current_cgroup_id()` names the task's v2 cgroup (an id of another
/// hierarchy, which could even equal a watched v1 id): the task's cgroup in the hierarchy of
/// controller `cgroup_v1_subsys` is `task->cgroups->subsys[id]->cgroup`, and the walk goes up its
/// `kn->parent` as on v2. Ids are kernfs node ids of that hierarchy, the inode numbers user
/// space reads from its directories.
#[inline(always)]
fn watched_match_v1(l: &KernelLayout, task: u64) -> Option<(u64, u64, u32)> {
    let kn = task_cgroup_kn(l, task)?;
    let own = read_u64(kn, l.kernfs_node_id)?;
    // SAFETY: map lookup by value; the reference is copied out at once.
    if let Some(flags) = unsafe { WATCHED.get(own) } {
        return Some((0, own, *flags));
    }
    walk_up(l, kn, own)
}

/// The kernfs node of the task's cgroup in the hierarchy the kubelet's cgroups live in: the v2
/// one (`task->cgroups->dfl_cgrp`), or on a v1 or hybrid node controller `cgroup_v1_subsys`'s
/// (`task->cgroups->subsys[id]->cgroup`).
#[inline(always)]
fn task_cgroup_kn(l: &KernelLayout, task: u64) -> Option<u64> {
    let cset = read_u64(task, l.task_cgroups)?;
    let cgrp = if l.cgroup_v1_subsys != CGROUP_V2 {
        if l.cgroup_v1_subsys > MAX_CGROUP_SUBSYS || l.css_set_subsys == OFFSET_UNKNOWN {
            return None;
        }
        let css = read_u64(cset, l.css_set_subsys.wrapping_add(l.cgroup_v1_subsys * 8))?;
        read_u64(css, l.css_cgroup)?
    } else {
        read_u64(cset, l.css_set_dfl_cgrp)?
    };
    read_u64(cgrp, l.cgroup_kn)
}

/// Walks up from the kernfs node `kn` of a task's cgroup `own` (not watched itself) through
/// `kn->parent`: a cgroup's id is its kernfs node's. Returns what [`watched_match`] does.
#[inline(always)]
fn walk_up(l: &KernelLayout, mut kn: u64, own: u64) -> Option<(u64, u64, u32)> {
    let mut child = own;
    let mut depth = 0u32;
    while depth < MAX_CGROUP_DEPTH {
        kn = read_u64(kn, l.kernfs_node_parent)?;
        if kn == 0 {
            break;
        }
        let id = read_u64(kn, l.kernfs_node_id)?;
        // SAFETY: map lookup by value; the reference is copied out at once.
        if let Some(flags) = unsafe { WATCHED.get(id) } {
            return Some((child, id, *flags));
        }
        child = id;
        depth += 1;
    }
    None
}

/// A task's pid as seen from its own pid namespace and from the host's.
struct PidInfo {
    /// Pid in its own (deepest) pid namespace.
    nr: u32,
    /// How many pid namespaces below the host's it lives (0: in the host's).
    depth: u32,
    /// Pid in the host's pid namespace (the agent's).
    host_nr: u32,
    /// Inode number of its own pid namespace; 0 when unknown.
    inum: u32,
}

/// Largest `struct upid` and offset of `struct pid.numbers` accepted: keeps every offset below
/// computed without overflow (real kernels: 16 and 64..=96 bytes).
const MAX_UPID_SIZE: u32 = 64;
const MAX_PID_NUMBERS: u32 = 4096;

/// Offset of field `field` of `thread_pid->numbers[level]`; `level` ≤ MAX_PID_NS_LEVEL.
#[inline(always)]
fn upid_field(l: &KernelLayout, level: u32, field: u32) -> u32 {
    l.pid_numbers.wrapping_add(level.wrapping_mul(l.upid_size)).wrapping_add(field)
}

/// Inode number of the pid namespace of `thread_pid->numbers[level]`.
#[inline(always)]
fn upid_ns_inum(l: &KernelLayout, pid: u64, level: u32) -> Option<u32> {
    read_u64(pid, upid_field(l, level, l.upid_ns)).and_then(|ns| read_u32(ns, l.pidns_inum))
}

/// Whether the layout allows reading `struct pid.numbers[]`.
#[inline(always)]
fn pid_layout_ok(l: &KernelLayout) -> bool {
    l.upid_size != OFFSET_UNKNOWN
        && l.upid_nr != OFFSET_UNKNOWN
        && l.pid_numbers != OFFSET_UNKNOWN
        && l.upid_size <= MAX_UPID_SIZE
        && l.pid_numbers <= MAX_PID_NUMBERS
        && l.upid_nr < MAX_UPID_SIZE
        && (l.upid_ns == OFFSET_UNKNOWN || l.upid_ns < MAX_UPID_SIZE)
}

/// Reads `task->thread_pid->numbers[]`. `None` when the layout is unknown or the task does not
/// live in the host's pid namespace or below it (another node's process on a kind host). The
/// host's level is a constant from user space: no loop here.
#[inline(always)]
fn pid_info(l: &KernelLayout, task: u64) -> Option<PidInfo> {
    if !pid_layout_ok(l) || l.host_pidns_level > MAX_HOST_PIDNS_LEVEL {
        return None;
    }
    let pid = read_u64(task, l.task_thread_pid)?;
    let level = read_u32(pid, l.pid_level)?;
    let host = l.host_pidns_level;
    if level > MAX_PID_NS_LEVEL || level < host {
        return None;
    }
    let ns_known = l.upid_ns != OFFSET_UNKNOWN && l.pidns_inum != OFFSET_UNKNOWN;
    if l.host_pidns_inum != 0 && ns_known && upid_ns_inum(l, pid, host)? != l.host_pidns_inum {
        return None;
    }
    let nr = read_u32(pid, upid_field(l, level, l.upid_nr))?;
    let host_nr = read_u32(pid, upid_field(l, host, l.upid_nr))?;
    let inum = if ns_known { upid_ns_inum(l, pid, level).unwrap_or(0) } else { 0 };
    Some(PidInfo { nr, depth: level - host, host_nr, inum })
}

#[inline(always)]
fn fill_common(event: &mut KernelEvent, kind: u32, container: u64, watched: u64) {
    let pid_tgid = bpf_get_current_pid_tgid();
    event.kind = kind;
    // SAFETY: helper without arguments.
    event.ktime_ns = unsafe { bpf_ktime_get_ns() };
    event.cgroup_id = container;
    event.watched_cgroup_id = watched;
    event.tgid = (pid_tgid >> 32) as u32;
    event.pid = pid_tgid as u32;
    event.comm = bpf_get_current_comm().unwrap_or([0; 16]);
}

/// Copies the name of the current task's cgroup ancestor `container` (its own cgroup or one
/// above it) into `out` (zeroed by the caller), NUL terminated; leaves it empty when the layout
/// does not allow it.
/// The cgroup exists while the exiting task is in it (`cgroup_exit` comes after the exit
/// tracepoint), so its kernfs node and name are alive here.
#[inline(always)]
fn container_name(l: &KernelLayout, task: u64, container: u64, out: &mut [u8; valet_common::CGROUP_NAME_BYTES]) {
    if l.kernfs_node_name == OFFSET_UNKNOWN {
        return;
    }
    let Some(mut kn) = task_cgroup_kn(l, task) else {
        return;
    };
    let mut depth = 0u32;
    while depth < MAX_CGROUP_DEPTH && kn != 0 {
        let Some(id) = read_u64(kn, l.kernfs_node_id) else { return };
        if id == container {
            if let Some(name) = read_u64(kn, l.kernfs_node_name)
                && name != 0
            {
                // SAFETY: bpf_probe_read_kernel_str checks the address and fails softly; it
                // writes at most `out.len()` bytes, NUL included.
                if unsafe { bpf_probe_read_kernel_str_bytes(name as *const u8, out) }.is_err() {
                    out[0] = 0;
                }
            }
            return;
        }
        let Some(parent) = read_u64(kn, l.kernfs_node_parent) else { return };
        kn = parent;
        depth += 1;
    }
}

#[inline(always)]
fn exit_impl<const WALK: bool>(ctx: &TracePointContext) -> u32 {
    let l = layout();
    // SAFETY: helper without arguments; the value is only used as a kernel address for probe reads.
    let task = unsafe { bpf_get_current_task() };

    if group_dead(&l, ctx, task) != Some(true) {
        return 0;
    }
    let Some((container, watched, flags)) = watched_match::<WALK>(&l, task) else {
        return 0;
    };
    if flags & watch_flags::EXITS == 0 {
        return 0;
    }
    if container == 0 {
        // A process in the pod cgroup itself belongs to no container.
        count(Counter::ExitsFiltered);
        return 0;
    }
    // The thread that ends the group is not always its leader (a worker thread calling
    // exit_group, or the last one left after the leader exited alone); the process's pids are
    // the leader's. A leader that exited first stays a zombie with its pid until the whole group
    // is gone, so it can still be read here.
    let leader = read_u64(task, l.task_group_leader).unwrap_or(task);
    let Some(info) = pid_info(&l, leader).or_else(|| pid_info(&l, task)) else {
        count(Counter::ExitsFiltered);
        return 0;
    };
    // SAFETY: map lookup by value; the fields are copied out at once.
    let recorded = unsafe { CONTAINERS.get(container) }.map(|r| r.tgid);
    let main = match recorded {
        Some(tgid) => info.host_nr == tgid,
        None => false,
    };
    // Pid 1 of a pid namespace exactly one level below the host's is the init of the namespace
    // the runtime made for a container (runtimes run in the host's pid namespace): its exit ends
    // every process of that namespace, so it is always reported. That covers containers with no
    // record (started before their pod was watched and not adopted) and a record that is not
    // the init (a later exec taken for the main process after an agent restart): user space
    // decides. Deeper inits are sandboxes the app made, and never reported.
    let container_init = info.nr == 1 && info.depth == 1;
    if !main && !container_init {
        count(Counter::ExitsFiltered);
        return 0;
    }
    report_exit(&l, task, (container, watched), &info, main);
    0
}

/// Whether the exiting thread ends its process: the tracepoint fires once per thread, and
/// group_dead is true for the thread that ends the group. Older kernels lack the field: then
/// signal->live == 0. None: the tracepoint's record could not be read.
#[inline(always)]
fn group_dead(l: &KernelLayout, ctx: &TracePointContext, task: u64) -> Option<bool> {
    if l.tp_exit_group_dead != OFFSET_UNKNOWN {
        // SAFETY: reading the tracepoint record at an offset from its format file.
        return match unsafe { ctx.read_at::<u8>(l.tp_exit_group_dead as usize) } {
            Ok(v) => Some(v != 0),
            Err(_) => None,
        };
    }
    Some(match read_u64(task, l.task_signal).and_then(|sig| read_u32(sig, l.signal_live)) {
        Some(live) => live == 0,
        None => {
            // Without either source we would report every thread: report only leaders.
            let pid_tgid = bpf_get_current_pid_tgid();
            (pid_tgid >> 32) as u32 == pid_tgid as u32
        }
    })
}

/// Sends the exit of the process `info` of `container` (under the watched pod cgroup) to user
/// space, with the container's name; `main`: it is the container's recorded main process.
#[inline(always)]
fn report_exit(l: &KernelLayout, task: u64, (container, watched): (u64, u64), info: &PidInfo, main: bool) {
    let Some(mut entry) = EVENTS.reserve::<ExitRecord>(0) else {
        count(Counter::EventsLost);
        return;
    };
    // The name goes straight into the reserved record (no second copy on the 512-byte stack).
    // SAFETY: the reserved record is ours until submitted; the field is zeroed in place before
    // a reference to it is made.
    let name = unsafe {
        let name = core::ptr::addr_of_mut!((*entry.as_mut_ptr()).cgroup_name);
        name.write([0; valet_common::CGROUP_NAME_BYTES]);
        &mut *name
    };
    container_name(l, task, container, name);
    let mut event = KernelEvent::zeroed();
    fill_common(&mut event, event_kind::EXIT, container, watched);
    event.tgid = info.host_nr;
    match read_u32(task, l.task_exit_code) {
        Some(code) => event.exit_status = code,
        None => {
            event.flags |= event_flags::NO_EXIT_CODE;
            count(Counter::ReadErrors);
        }
    }
    event.ns_pid = info.nr;
    if main {
        event.flags |= event_flags::CONTAINER_MAIN;
    }
    if info.depth > 0 {
        event.flags |= event_flags::CHILD_PID_NS;
        if info.nr == 1 {
            event.flags |= event_flags::NS_INIT;
        }
    }
    // SAFETY: as above; the event field is written whole.
    unsafe { core::ptr::addr_of_mut!((*entry.as_mut_ptr()).event).write(event) };
    submit_written(entry, Counter::ExitsReported);
}

#[inline(always)]
fn exec_impl<const WALK: bool>() -> u32 {
    let l = layout();
    // SAFETY: see exit_impl.
    let task = unsafe { bpf_get_current_task() };
    let Some((container, watched, flags)) = watched_match::<WALK>(&l, task) else {
        return 0;
    };
    // Containers are child cgroups of the pod cgroup. A pod watched with neither flag (hostPID:
    // its containers have no pid namespace that tells their main process) records nothing.
    if container == 0 || flags & (watch_flags::EXITS | watch_flags::HOLD) == 0 {
        return 0;
    }
    // After exec the current task is its process's leader.
    let Some(info) = pid_info(&l, task) else {
        count(Counter::ReadErrors);
        return 0;
    };
    // Runtime helpers (runc init, conmon) exec in the host's pid namespace.
    if info.depth == 0 {
        return 0;
    }
    // SAFETY: map lookup by value.
    if unsafe { CONTAINERS.get(container) }.is_some() {
        return 0;
    }
    // SAFETY: helper without arguments.
    let now = unsafe { bpf_ktime_get_ns() };
    if !record_main(container, &info, now) || flags & watch_flags::HOLD == 0 {
        return 0;
    }
    hold(container, watched, flags, &info, now);
    0
}

/// Records the process `info` as the main process of `container`, first come; false when it is
/// not (another was first, or the map is full).
#[inline(always)]
fn record_main(container: u64, info: &PidInfo, now: u64) -> bool {
    let mut record = ContainerMain {
        tgid: info.host_nr,
        pidns_depth: info.depth,
        pidns_inum: info.inum,
        flags: container_flags::BY_EXEC,
        ktime_ns: now,
    };
    if info.nr == 1 {
        record.flags |= container_flags::NS_INIT;
    }
    // Two threads of different processes may race here: the insert decides.
    match CONTAINERS.insert(container, record, BPF_NOEXIST) {
        Ok(()) => true,
        Err(e) if e == -EEXIST => false,
        Err(e) if e == -E2BIG || e == -ENOMEM => {
            // Unknown main: its exit is not reported as one and its exec is never held (a held
            // process no one knows of would stay frozen).
            count(Counter::MapFull);
            false
        }
        Err(_) => {
            count(Counter::ReadErrors);
            false
        }
    }
}

/// Holds the container's main process `info` at its first exec, unless user space said to let
/// the container pass: records the hold, stops the process and tells user space.
#[inline(always)]
fn hold(container: u64, watched: u64, flags: u32, info: &PidInfo, now: u64) {
    let _ = EXEC_SEEN.insert(container, 1, 0);
    // SAFETY: map lookup by value.
    if let Some(class) = unsafe { EXEC_CLASS.get(container) }
        && *class == EXEC_CLASS_PASS
    {
        return;
    }
    let Some(entry) = EVENTS.reserve::<KernelEvent>(0) else {
        // No one would learn of the hold, so no one would release it: do not hold.
        count(Counter::EventsLost);
        return;
    };
    // Recorded before the stop: an agent that dies from here on leaves a record its successor
    // releases by. A pid held before (it exited while no agent ran) is overwritten.
    // The deadline travels with the record: whatever becomes of the agent, any valet process
    // that reads the pinned map releases the process by then.
    let deadline_ns = now.saturating_add(watched_hold_timeout_ns(flags));
    let record = HeldRecord { cgroup_id: container, ktime_ns: now, deadline_ns };
    match HELD.insert(info.host_nr, record, 0) {
        Ok(()) => {}
        Err(e) => {
            entry.discard(0);
            count(if e == -E2BIG || e == -ENOMEM { Counter::MapFull } else { Counter::ReadErrors });
            return;
        }
    }
    // SAFETY: signals the current task's thread group; takes effect before it returns to user space.
    let sent = unsafe { bpf_send_signal(SIGSTOP) };
    if sent != 0 {
        let _ = HELD.remove(info.host_nr);
        entry.discard(0);
        count(Counter::ReadErrors);
        return;
    }
    if let Some(stored) = CONTAINERS.get_ptr_mut(container) {
        // SAFETY: a valid map value pointer; only this field changes.
        unsafe { (*stored).flags |= container_flags::HELD };
    }
    let mut event = KernelEvent::zeroed();
    fill_common(&mut event, event_kind::HELD, container, watched);
    event.tgid = info.host_nr;
    event.ns_pid = info.nr;
    event.flags = event_flags::CONTAINER_MAIN | event_flags::CHILD_PID_NS;
    if info.nr == 1 {
        event.flags |= event_flags::NS_INIT;
    }
    submit_counted(entry, event, Counter::Held);
}

#[inline(always)]
fn listen_impl<const WALK: bool>(ctx: &TracePointContext) -> u32 {
    let l = layout();
    if l.tp_sock_newstate == OFFSET_UNKNOWN || l.tp_sock_sport == OFFSET_UNKNOWN {
        return 0;
    }
    // SAFETY: reading the tracepoint record at offsets from its format file.
    match unsafe { ctx.read_at::<i32>(l.tp_sock_newstate as usize) } {
        Ok(TCP_LISTEN) => {}
        _ => return 0,
    }
    if l.tp_sock_protocol != OFFSET_UNKNOWN {
        // SAFETY: as above.
        match unsafe { ctx.read_at::<u16>(l.tp_sock_protocol as usize) } {
            Ok(IPPROTO_TCP) => {}
            _ => return 0,
        }
    }
    // SAFETY: see exit_impl.
    let task = unsafe { bpf_get_current_task() };
    let Some((container, watched, flags)) = watched_match::<WALK>(&l, task) else {
        return 0;
    };
    if flags & watch_flags::HOLD == 0 {
        return 0;
    }
    // Listens never take the room container ends need: at most a quarter of the ring.
    if EVENTS.query(BPF_RB_AVAIL_DATA) > u64::from(EVENTS_RING_BYTES / 4) {
        count(Counter::ListensSkipped);
        return 0;
    }
    // SAFETY: as above.
    let Ok(port) = (unsafe { ctx.read_at::<u16>(l.tp_sock_sport as usize) }) else {
        return 0;
    };
    let Some(entry) = EVENTS.reserve::<KernelEvent>(0) else {
        count(Counter::ListensSkipped);
        return 0;
    };
    let mut event = KernelEvent::zeroed();
    fill_common(&mut event, event_kind::LISTEN, container, watched);
    event.exit_status = u32::from(port);
    submit_counted(entry, event, Counter::Listens);
    0
}

#[tracepoint]
pub fn valet_listen(ctx: TracePointContext) -> u32 {
    listen_impl::<false>(&ctx)
}

#[tracepoint]
pub fn valet_listen_walk(ctx: TracePointContext) -> u32 {
    listen_impl::<true>(&ctx)
}

#[tracepoint]
pub fn valet_calibrate(ctx: TracePointContext) -> u32 {
    let _ = ctx;
    let l = layout();
    if !pid_layout_ok(&l) || l.upid_ns == OFFSET_UNKNOWN || l.pidns_inum == OFFSET_UNKNOWN {
        return 0;
    }
    // SAFETY: see exit_impl.
    let task = unsafe { bpf_get_current_task() };
    let Some(pid) = read_u64(task, l.task_thread_pid) else { return 0 };
    let Some(level) = read_u32(pid, l.pid_level) else { return 0 };
    if level > MAX_HOST_PIDNS_LEVEL {
        return 0;
    }
    if upid_ns_inum(&l, pid, level) == Some(l.host_pidns_inum)
        && let Some(slot) = CALIBRATION.get_ptr_mut(0)
    {
        // SAFETY: a valid map value pointer.
        unsafe { *slot = level + 1 };
    }
    0
}

#[tracepoint]
pub fn valet_exit(ctx: TracePointContext) -> u32 {
    exit_impl::<false>(&ctx)
}

#[tracepoint]
pub fn valet_exit_walk(ctx: TracePointContext) -> u32 {
    exit_impl::<true>(&ctx)
}

#[tracepoint]
pub fn valet_exec(ctx: TracePointContext) -> u32 {
    let _ = ctx;
    exec_impl::<false>()
}

#[tracepoint]
pub fn valet_exec_walk(ctx: TracePointContext) -> u32 {
    let _ = ctx;
    exec_impl::<true>()
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}
