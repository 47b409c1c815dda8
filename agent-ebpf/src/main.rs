//! valet's kernel programs.
//!
//! * `valet_exit` (tracepoint `sched/sched_process_exit`): reports whole-process exits of
//!   processes in watched cgroups, with the decoded-later wait status and whether the process was
//!   its pid namespace's init (a container's main process).
//! * `valet_exec` (tracepoint `sched/sched_process_exec`): stops the first pid-namespace-init exec
//!   of each container cgroup in a held pod with SIGSTOP, before it runs one instruction of its own.
//!
//! Both filter in the kernel: a process outside every watched cgroup costs a few map lookups and
//! never wakes user space. Kernel struct offsets come from user space (read from BTF at load time)
//! through the read-only global `LAYOUT`; nothing here hard-codes a kernel layout.
#![no_std]
#![no_main]

use aya_ebpf::{
    helpers::{
        bpf_get_current_comm, bpf_get_current_pid_tgid, bpf_ktime_get_ns, bpf_probe_read_kernel,
        generated::{
            bpf_get_current_ancestor_cgroup_id, bpf_get_current_cgroup_id, bpf_get_current_task, bpf_send_signal,
        },
    },
    macros::{map, tracepoint},
    maps::{HashMap, LruHashMap, PerCpuArray, RingBuf},
    programs::TracePointContext,
};
use aya_log_ebpf::warn;
use valet_common::{
    COUNTER_SLOTS, Counter, EVENTS_RING_BYTES, EXEC_CAPACITY, EXEC_CLASS_PASS, KernelEvent, KernelLayout,
    MAX_CGROUP_DEPTH, OFFSET_UNKNOWN, WATCHED_CAPACITY, event_flags, event_kind, watch_flags,
};

const SIGSTOP: u32 = 19;

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

/// Returns (own cgroup id, matched watched cgroup id, its flags) when the current task's cgroup
/// or one of its ancestors is watched.
#[inline(always)]
fn watched_match() -> Option<(u64, u64, u32)> {
    // SAFETY: helpers without pointer arguments.
    let own = unsafe { bpf_get_current_cgroup_id() };
    // SAFETY: map lookup by value; the reference is copied out at once.
    if let Some(flags) = unsafe { WATCHED.get(own) } {
        return Some((own, own, *flags));
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
            return Some((own, ancestor, *flags));
        }
        level += 1;
    }
    None
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

/// Pid of the current task inside its own pid namespace: `thread_pid->numbers[level].nr`.
/// Returns (nr, level).
#[inline(always)]
fn ns_pid(l: &KernelLayout, task: u64) -> Option<(u32, u32)> {
    if l.upid_size == OFFSET_UNKNOWN || l.upid_nr == OFFSET_UNKNOWN {
        return None;
    }
    let pid = read_u64(task, l.task_thread_pid)?;
    let level = read_u32(pid, l.pid_level)?;
    if level > 64 {
        return None;
    }
    let off = l.pid_numbers.checked_add(level * l.upid_size)?.checked_add(l.upid_nr)?;
    let nr = read_u32(pid, off)?;
    Some((nr, level))
}

#[inline(always)]
fn fill_common(event: &mut KernelEvent, kind: u32, own: u64, watched: u64) {
    let pid_tgid = bpf_get_current_pid_tgid();
    event.kind = kind;
    // SAFETY: helper without arguments.
    event.ktime_ns = unsafe { bpf_ktime_get_ns() };
    event.cgroup_id = own;
    event.watched_cgroup_id = watched;
    event.tgid = (pid_tgid >> 32) as u32;
    event.pid = pid_tgid as u32;
    event.comm = bpf_get_current_comm().unwrap_or([0; 16]);
}

#[tracepoint]
pub fn valet_exit(ctx: TracePointContext) -> u32 {
    let l = layout();
    // SAFETY: helper without arguments; the value is only used as a kernel address for probe reads.
    let task = unsafe { bpf_get_current_task() };

    // Whole-process exits only: the tracepoint fires once per thread, and group_dead is true for
    // the thread that ends the group. Older kernels lack the field: then signal->live == 0.
    let group_dead = if l.tp_exit_group_dead != OFFSET_UNKNOWN {
        // SAFETY: reading the tracepoint record at an offset from its format file.
        match unsafe { ctx.read_at::<u8>(l.tp_exit_group_dead as usize) } {
            Ok(v) => v != 0,
            Err(_) => return 0,
        }
    } else {
        match read_u64(task, l.task_signal).and_then(|sig| read_u32(sig, l.signal_live)) {
            Some(live) => live == 0,
            None => {
                // Without either source we would report every thread: report only leaders.
                let pid_tgid = bpf_get_current_pid_tgid();
                (pid_tgid >> 32) as u32 == pid_tgid as u32
            }
        }
    };
    if !group_dead {
        return 0;
    }
    let Some((own, watched, flags)) = watched_match() else {
        return 0;
    };
    if flags & watch_flags::EXITS == 0 {
        return 0;
    }

    let Some(mut entry) = EVENTS.reserve::<KernelEvent>(0) else {
        count(Counter::EventsLost);
        return 0;
    };
    let mut event = KernelEvent::zeroed();
    fill_common(&mut event, event_kind::EXIT, own, watched);
    match read_u32(task, l.task_exit_code) {
        Some(code) => event.exit_status = code,
        None => {
            event.flags |= event_flags::NO_EXIT_CODE;
            count(Counter::ReadErrors);
        }
    }
    // The thread that ends the group is not always its leader (a worker thread calling
    // exit_group, or the last one left after the leader exited alone); the process's pid in its
    // namespace is the leader's. A leader that exited first stays a zombie with its pid until the
    // whole group is gone, so it can still be read here.
    let leader = read_u64(task, l.task_group_leader).unwrap_or(task);
    match ns_pid(&l, leader).or_else(|| ns_pid(&l, task)) {
        Some((nr, level)) => {
            event.ns_pid = nr;
            if level > 0 {
                event.flags |= event_flags::CHILD_PID_NS;
            }
            if nr == 1 && level > 0 {
                event.flags |= event_flags::NS_INIT;
            }
        }
        None => {
            event.flags |= event_flags::NO_NS_INFO;
            count(Counter::ReadErrors);
            warn!(&ctx, "valet: cannot read pid namespace of exiting task {}", event.tgid);
        }
    }
    entry.write(event);
    entry.submit(0);
    count(Counter::ExitsReported);
    0
}

#[tracepoint]
pub fn valet_exec(ctx: TracePointContext) -> u32 {
    let _ = ctx;
    let Some((own, watched, flags)) = watched_match() else {
        return 0;
    };
    // Hold only inside a child cgroup (a container) of a held pod cgroup.
    if flags & watch_flags::HOLD == 0 || own == watched {
        return 0;
    }
    let l = layout();
    // SAFETY: see valet_exit.
    let task = unsafe { bpf_get_current_task() };
    // A container's entrypoint is exec'd by the pid namespace's init; runtime helpers (runc init,
    // conmon) exec in the host namespace and must never be stopped.
    let Some((nr, level)) = ns_pid(&l, task) else {
        count(Counter::ReadErrors);
        return 0;
    };
    if nr != 1 || level == 0 {
        return 0;
    }
    // Only the first init exec of each container; later execs (an entrypoint script exec'ing the
    // real binary) run freely.
    // SAFETY: map lookup by value.
    if unsafe { EXEC_SEEN.get(own) }.is_some() {
        return 0;
    }
    let _ = EXEC_SEEN.insert(own, 1, 0);
    // SAFETY: map lookup by value.
    if let Some(class) = unsafe { EXEC_CLASS.get(own) }
        && *class == EXEC_CLASS_PASS
    {
        return 0;
    }
    let Some(mut entry) = EVENTS.reserve::<KernelEvent>(0) else {
        // No one would learn of the hold, so no one would release it: do not hold.
        count(Counter::EventsLost);
        return 0;
    };
    // SAFETY: signals the current task's thread group; takes effect before it returns to user space.
    let sent = unsafe { bpf_send_signal(SIGSTOP) };
    if sent != 0 {
        entry.discard(0);
        count(Counter::ReadErrors);
        return 0;
    }
    let mut event = KernelEvent::zeroed();
    fill_common(&mut event, event_kind::HELD, own, watched);
    event.ns_pid = nr;
    event.flags = event_flags::NS_INIT;
    entry.write(event);
    entry.submit(0);
    count(Counter::Held);
    0
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}
