//! Every libc call of the agent and every `unsafe` block, behind safe functions: the one module
//! allowed `unsafe_code` (the crate denies it everywhere else). Each function names what it does
//! (open a pidfd, poll descriptors, read a kernel record); its SAFETY comment says why the call is
//! sound for every input the safe signature admits.
//!
//! The kernel loader's needs from aya are here too: reading a ring buffer record as the plain
//! struct it is ([`read_pod`]), and registering aya's descriptors (the event ring buffer, the
//! kernel log) with tokio's reactor ([`readable`]).

use std::ffi::CString;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd as _, OwnedFd, RawFd};
use std::path::Path;
use std::time::Duration;

use tokio::io::unix::AsyncFd;

/// Sends `signal` to process `pid` (kill(2)): only for processes the agent made or pinned itself.
pub fn kill(pid: u32, signal: i32) -> io::Result<()> {
    let pid = libc::pid_t::try_from(pid).map_err(|_| io::Error::from_raw_os_error(libc::ESRCH))?;
    // SAFETY: kill takes no pointers.
    if unsafe { libc::kill(pid, signal) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// A pidfd for `pid` (pidfd_open(2)): signals through it reach that process or none.
pub fn pidfd_open(pid: u32) -> io::Result<OwnedFd> {
    // SAFETY: plain syscall; a non-negative return is a new fd we own.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is valid and owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// Sends `signal` through a pidfd (pidfd_send_signal(2)).
pub fn pidfd_send_signal(fd: BorrowedFd<'_>, signal: i32) -> io::Result<()> {
    // SAFETY: plain syscall on a valid pidfd, no siginfo.
    let r = unsafe {
        libc::syscall(libc::SYS_pidfd_send_signal, fd.as_raw_fd(), signal, std::ptr::null::<libc::siginfo_t>(), 0)
    };
    if r < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// poll(2) on `fds` for at most `timeout_ms` (0: no wait, negative: no limit). Returns how many
/// have events (their `revents` set).
pub fn poll(fds: &mut [libc::pollfd], timeout_ms: i32) -> io::Result<usize> {
    // SAFETY: `fds` is a valid array of pollfds of the length passed.
    let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, timeout_ms) };
    usize::try_from(n).map_err(|_| io::Error::last_os_error())
}

/// Whether `fd` has events among `events` now (poll(2) with no wait).
pub fn ready_now(fd: BorrowedFd<'_>, events: i16) -> bool {
    poll(&mut [libc::pollfd { fd: fd.as_raw_fd(), events, revents: 0 }], 0).is_ok_and(|n| n == 1)
}

/// ppoll(2) on `fds` for at most `timeout`, no signal mask. Returns how many have events.
pub fn ppoll(fds: &mut [libc::pollfd], timeout: Duration) -> io::Result<usize> {
    let ts = libc::timespec {
        tv_sec: libc::time_t::try_from(timeout.as_secs()).unwrap_or(libc::time_t::MAX),
        tv_nsec: libc::c_long::from(timeout.subsec_nanos()),
    };
    // SAFETY: `fds` is a valid array of pollfds and `ts` a valid timespec for the call;
    // no signal mask.
    let n = unsafe { libc::ppoll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, &ts, std::ptr::null()) };
    usize::try_from(n).map_err(|_| io::Error::last_os_error())
}

/// A new non-blocking, close-on-exec eventfd(2), counter 0.
pub fn eventfd() -> io::Result<OwnedFd> {
    // SAFETY: eventfd takes no pointers; a non-negative result is a new descriptor, owned here.
    let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just made and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// `clock`'s time now (clock_gettime(2)); `None` when it cannot be read.
fn clock(clock: libc::clockid_t) -> Option<Duration> {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid timespec for the call to fill; no other pointer is passed.
    if unsafe { libc::clock_gettime(clock, &mut ts) } != 0 {
        return None;
    }
    Some(Duration::new(u64::try_from(ts.tv_sec).ok()?, u32::try_from(ts.tv_nsec).ok()?))
}

/// CLOCK_MONOTONIC now, the clock `bpf_ktime_get_ns` stamps kernel events with.
pub fn monotonic() -> Duration {
    clock(libc::CLOCK_MONOTONIC).unwrap_or_default()
}

/// The calling thread's CPU time (zero if the clock cannot be read).
pub fn thread_cpu() -> Duration {
    clock(libc::CLOCK_THREAD_CPUTIME_ID).unwrap_or_default()
}

/// The kernel's clock ticks per second (`_SC_CLK_TCK`, the unit of `/proc/<pid>/stat`'s times).
pub fn clock_ticks() -> Option<u64> {
    // SAFETY: sysconf has no preconditions.
    u64::try_from(unsafe { libc::sysconf(libc::_SC_CLK_TCK) }).ok().filter(|t| *t > 0)
}

/// The page size (`_SC_PAGESIZE`), 4096 when it cannot be read.
pub fn page_size() -> u32 {
    // SAFETY: sysconf has no preconditions.
    u32::try_from(unsafe { libc::sysconf(libc::_SC_PAGESIZE) }).unwrap_or(4096)
}

/// The file system type of `path` (`statfs(2)`'s `f_type`).
pub fn fs_magic(path: &Path) -> Option<i64> {
    let c = CString::new(path.as_os_str().as_encoded_bytes()).ok()?;
    // SAFETY: a zeroed statfs is a valid out-buffer.
    let mut buf: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: the path is NUL-terminated, `buf` a valid statfs to fill.
    let rc = unsafe { libc::statfs(c.as_ptr(), &mut buf) };
    #[allow(clippy::unnecessary_cast, reason = "f_type's width differs between targets")]
    (rc == 0).then_some(buf.f_type as i64)
}

/// Gives freed heap back to the node (glibc keeps it otherwise).
pub fn malloc_trim() {
    // SAFETY: glibc's malloc_trim only releases free memory.
    unsafe { libc::malloc_trim(0) };
}

/// Unmaps this process's pages of its own executable whose content is the file's
/// (`MADV_DONTNEED` on each mapping [`super::smaps::clean_exe_mappings`] picks from
/// `/proc/self/smaps`): the code and read-only data that start-up ran through. Each page maps
/// again from the page cache (or the file) on its next use. Returns the KiB that were resident
/// in those mappings.
pub fn unmap_clean_exe_pages() -> io::Result<u64> {
    let exe = std::fs::read_link("/proc/self/exe")?;
    let smaps = std::fs::read_to_string("/proc/self/smaps")?;
    let mut kib = 0;
    for m in super::smaps::clean_exe_mappings(&smaps, &exe.to_string_lossy()) {
        // SAFETY: the range is one whole mapping of this process, as the kernel lists it: private,
        // file-backed, not writable, with no page of its own in memory or in swap (no
        // copy-on-write copy, so no relocated RELRO page): every page it drops reads back the
        // same bytes from the file, as after the kernel's own reclaim of a clean page. The
        // mapping is not writable, so no page of its own can appear between the listing and
        // this call.
        if unsafe { libc::madvise(m.start as *mut libc::c_void, m.len, libc::MADV_DONTNEED) } != 0 {
            return Err(io::Error::last_os_error());
        }
        kib += m.rss_kib;
    }
    Ok(kib)
}

/// Lifts RLIMIT_MEMLOCK, which kernels before 5.11 charge BPF maps and programs to (above the
/// hard limit it needs CAP_SYS_RESOURCE; short of that, up to the hard limit). Returns the soft
/// limit in effect after, `None` for unlimited.
pub fn raise_memlock_limit() -> Option<u64> {
    let unlimited = libc::rlimit { rlim_cur: libc::RLIM_INFINITY, rlim_max: libc::RLIM_INFINITY };
    // SAFETY: plain syscalls with valid pointers.
    unsafe {
        if libc::setrlimit(libc::RLIMIT_MEMLOCK, &unlimited) != 0 {
            tracing::debug!("setrlimit(RLIMIT_MEMLOCK, unlimited) failed: {}", io::Error::last_os_error());
            // Up to the hard limit needs no capability.
            let mut have = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
            if libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut have) == 0 && have.rlim_cur < have.rlim_max {
                have.rlim_cur = have.rlim_max;
                let _ = libc::setrlimit(libc::RLIMIT_MEMLOCK, &have);
            }
        }
        let mut now = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
        if libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut now) != 0 || now.rlim_cur == libc::RLIM_INFINITY {
            return None;
        }
        Some(now.rlim_cur)
    }
}

/// Puts the calling thread (`what`, for the log) in SCHED_FIFO at `priority` (0: leaves it as it
/// is): the processes it wakes (released apps, probed proxies) no longer take its CPU. Its
/// children would start in the normal class (`SCHED_RESET_ON_FORK`). Without CAP_SYS_NICE (or,
/// where the kernel groups real-time time by cgroup, without a share for the agent's) the thread
/// stays as it was, and the log says so.
pub fn enter_real_time(what: &str, priority: u8) {
    if priority == 0 {
        return;
    }
    match real_time(priority) {
        Ok(()) => tracing::info!(priority, "{what} runs SCHED_FIFO"),
        Err(e) => tracing::warn!(
            priority,
            "{what} stays in the normal class (releases may wait for a CPU on a busy node): SCHED_FIFO: {e} (it \
             needs CAP_SYS_NICE)"
        ),
    }
}

/// Puts the calling thread in SCHED_FIFO at `priority`, its children back in the normal class
/// (SCHED_RESET_ON_FORK). Needs CAP_SYS_NICE.
pub fn real_time(priority: u8) -> io::Result<()> {
    real_time_thread(0, priority)
}

/// As [`real_time`], for thread `tid` of this process (0: the calling thread; another thread
/// raises it before it wakes it, so that it wakes in the class, not behind the normal class's
/// runnable tasks).
pub fn real_time_thread(tid: i32, priority: u8) -> io::Result<()> {
    set_thread_scheduler(tid, libc::SCHED_FIFO | libc::SCHED_RESET_ON_FORK, priority)
}

/// Puts the calling thread back in the normal class (SCHED_OTHER; no privilege needed).
pub fn normal_class() -> io::Result<()> {
    set_thread_scheduler(0, libc::SCHED_OTHER, 0)
}

/// The calling thread's id (gettid(2)).
pub fn gettid() -> i32 {
    // SAFETY: gettid takes no argument and cannot fail.
    unsafe { libc::gettid() }
}

/// sched_setscheduler(2) on thread `tid` (0: the calling thread).
fn set_thread_scheduler(tid: i32, policy: i32, priority: u8) -> io::Result<()> {
    let param = libc::sched_param { sched_priority: i32::from(priority) };
    // SAFETY: `param` is a valid sched_param for the call; `tid` is a thread id or 0 (the caller).
    if unsafe { libc::sched_setscheduler(tid, policy, &param) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Whether the calling thread runs in a real-time class (`SCHED_FIFO` or `SCHED_RR`); false if
/// its policy cannot be read.
pub fn in_real_time() -> bool {
    sched_policy().is_ok_and(|p| p == libc::SCHED_FIFO || p == libc::SCHED_RR)
}

/// The calling thread's scheduling policy (`SCHED_OTHER`, `SCHED_FIFO`, ...; without the
/// `SCHED_RESET_ON_FORK` flag).
pub fn sched_policy() -> io::Result<i32> {
    // SAFETY: no pointer is passed; pid 0 is the calling thread.
    match unsafe { libc::sched_getscheduler(0) } {
        -1 => Err(io::Error::last_os_error()),
        policy => Ok(policy & !libc::SCHED_RESET_ON_FORK),
    }
}

/// Asks the scheduler for a slice of `slice` for the calling thread (sched_setattr(2)'s
/// `sched_runtime` under SCHED_OTHER: Linux 6.12+, EEVDF; unprivileged, nice unchanged).
pub fn short_slice(slice: Duration) -> io::Result<()> {
    #[repr(C)]
    struct SchedAttr {
        size: u32,
        policy: u32,
        flags: u64,
        nice: i32,
        priority: u32,
        runtime: u64,
        deadline: u64,
        period: u64,
    }
    let attr = SchedAttr {
        size: size_of::<SchedAttr>() as u32,
        policy: libc::SCHED_OTHER as u32,
        flags: 0,
        nice: 0,
        priority: 0,
        runtime: u64::try_from(slice.as_nanos()).unwrap_or(u64::MAX),
        deadline: 0,
        period: 0,
    };
    // SAFETY: a valid sched_attr of the size it declares, for the calling thread (pid 0).
    if unsafe { libc::syscall(libc::SYS_sched_setattr, 0, &attr as *const SchedAttr, 0) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Sets no_new_privs and installs the classic BPF seccomp `filter` on the calling thread alone
/// (no SECCOMP_FILTER_FLAG_TSYNC), for the rest of its life.
pub fn seccomp_this_thread(filter: &[libc::sock_filter]) -> io::Result<()> {
    let len = u16::try_from(filter.len()).map_err(|_| io::Error::other("seccomp filter too long"))?;
    let prog = libc::sock_fprog { len, filter: filter.as_ptr() as *mut _ };
    // SAFETY: prctl with these options reads only `prog` (and the filter it points to), which
    // outlive the call; no_new_privs is what lets a process without CAP_SYS_ADMIN install it.
    unsafe {
        if libc::prctl(libc::PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0
            || libc::prctl(libc::PR_SET_SECCOMP, libc::SECCOMP_MODE_FILTER, &prog as *const libc::sock_fprog) != 0
        {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Makes the mount at `path` and every mount below it read-only in the calling process's mount
/// namespace, in one step (mount_setattr(2) with AT_RECURSIVE and MOUNT_ATTR_RDONLY: Linux 5.12+;
/// needs CAP_SYS_ADMIN). Only the mounts' own flags change, not their file systems'.
pub fn mount_setattr_read_only(path: &Path) -> io::Result<()> {
    #[repr(C)]
    struct MountAttr {
        attr_set: u64,
        attr_clr: u64,
        propagation: u64,
        userns_fd: u64,
    }
    const MOUNT_ATTR_RDONLY: u64 = 0x1;
    const AT_RECURSIVE: libc::c_uint = 0x8000;
    let c_path = CString::new(path.as_os_str().as_encoded_bytes()).map_err(io::Error::other)?;
    let attr = MountAttr { attr_set: MOUNT_ATTR_RDONLY, attr_clr: 0, propagation: 0, userns_fd: 0 };
    // SAFETY: a NUL-terminated path and a mount_attr of the size passed, both alive for the call.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_mount_setattr,
            libc::AT_FDCWD,
            c_path.as_ptr(),
            AT_RECURSIVE,
            &attr as *const MountAttr,
            size_of::<MountAttr>(),
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Removes capability `cap` (a `CAP_*` number) from the calling thread's effective, permitted and
/// inheritable sets (capset(2)): for good, since no_new_privs or an empty bounding set keeps an
/// exec from giving it back. Threads made after the call inherit the sets without it; threads
/// made before keep theirs.
pub fn drop_capability(cap: u32) -> io::Result<()> {
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Clone, Copy, Default)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    const VERSION_3: u32 = 0x2008_0522;
    if cap >= 64 {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    }
    let mut header = Header { version: VERSION_3, pid: 0 };
    let mut data = [Data::default(); 2];
    // SAFETY: capget with version 3 writes two Data structs, which `data` holds.
    if unsafe { libc::syscall(libc::SYS_capget, &mut header as *mut Header, data.as_mut_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let (word, bit) = ((cap / 32) as usize, 1u32 << (cap % 32));
    data[word].effective &= !bit;
    data[word].permitted &= !bit;
    data[word].inheritable &= !bit;
    // SAFETY: capset with version 3 reads the two Data structs `data` holds.
    if unsafe { libc::syscall(libc::SYS_capset, &mut header as *mut Header, data.as_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// What one `BPF_MAP_LOOKUP_BATCH` call read: how many entries it wrote, where the next call
/// starts, and whether the walk reached the map's end (`ENOENT`, with these entries the last).
#[derive(Clone, Copy, Debug)]
pub struct BatchRead {
    pub count: usize,
    pub next: u32,
    pub end: bool,
}

/// `BPF_MAP_LOOKUP_BATCH` (Linux 5.6+) on hash map `map` (aya checked its key and value sizes
/// against `u32` and `V` when it was made): up to `keys.len()` entries from position `from`
/// (None: the start), the keys into `keys` and the values, back to back, into `values` (room for
/// at least `keys.len()` values). `ENOSPC`: a bucket holds more entries than `keys` has room for.
pub fn bpf_map_lookup_batch<V: aya::Pod>(
    map: &aya::maps::HashMap<aya::maps::MapData, u32, V>,
    from: Option<u32>,
    keys: &mut [u32],
    values: &mut [u8],
) -> io::Result<BatchRead> {
    use aya::maps::IterableMap as _;
    /// `union bpf_attr`'s part for the batch commands.
    #[repr(C)]
    struct BatchAttr {
        in_batch: u64,
        out_batch: u64,
        keys: u64,
        values: u64,
        count: u32,
        map_fd: u32,
        elem_flags: u64,
        flags: u64,
    }
    const BPF_MAP_LOOKUP_BATCH: libc::c_long = 24;
    let value_size = size_of::<V>();
    if values.len() < keys.len().saturating_mul(value_size) || value_size == 0 {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    }
    let token = from.unwrap_or(0);
    let mut next: u32 = 0;
    let mut attr = BatchAttr {
        in_batch: if from.is_some() { &raw const token as u64 } else { 0 },
        out_batch: &raw mut next as u64,
        keys: keys.as_mut_ptr() as u64,
        values: values.as_mut_ptr() as u64,
        count: u32::try_from(keys.len()).unwrap_or(u32::MAX),
        map_fd: map.map().fd().as_fd().as_raw_fd() as u32,
        elem_flags: 0,
        flags: 0,
    };
    // SAFETY: `attr` points at `count` keys and at room for `count` values of the map's value
    // size (checked above: aya made `map` only with `V`'s size), and at two u32 positions, all
    // live for the call; the kernel writes nothing else.
    let rc =
        unsafe { libc::syscall(libc::SYS_bpf, BPF_MAP_LOOKUP_BATCH, &raw mut attr, size_of::<BatchAttr>() as u32) };
    let count = (attr.count as usize).min(keys.len());
    if rc == 0 {
        return Ok(BatchRead { count, next, end: false });
    }
    let e = io::Error::last_os_error();
    match e.raw_os_error() {
        Some(libc::ENOENT) => Ok(BatchRead { count, next, end: true }),
        _ => Err(e),
    }
}

/// A BPF hash map made by `BPF_MAP_CREATE` (keys of `key_size`, values of `value_size` bytes,
/// at most `max_entries`): tests make one as the kernel programs' maps are.
#[cfg(test)]
pub fn bpf_hash_map_create(key_size: u32, value_size: u32, max_entries: u32) -> io::Result<OwnedFd> {
    #[repr(C)]
    struct CreateAttr {
        map_type: u32,
        key_size: u32,
        value_size: u32,
        max_entries: u32,
        map_flags: u32,
    }
    const BPF_MAP_CREATE: libc::c_long = 0;
    const BPF_MAP_TYPE_HASH: u32 = 1;
    let mut attr = CreateAttr { map_type: BPF_MAP_TYPE_HASH, key_size, value_size, max_entries, map_flags: 0 };
    // SAFETY: a valid attr of the size passed.
    let fd = unsafe { libc::syscall(libc::SYS_bpf, BPF_MAP_CREATE, &raw mut attr, size_of::<CreateAttr>() as u32) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the fd was just made and nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// A plain struct read from the start of `bytes` (a ring buffer record), unaligned; `None` when
/// `bytes` is too short.
pub fn read_pod<T: aya::Pod>(bytes: &[u8]) -> Option<T> {
    if bytes.len() < size_of::<T>() {
        return None;
    }
    // SAFETY: length checked; `aya::Pod` types are plain data valid for any bit pattern; the read
    // is unaligned-safe.
    Some(unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast()) })
}

/// A plain struct's bytes, as the kernel writes it into a ring buffer.
pub fn pod_bytes<T: aya::Pod>(value: &T) -> &[u8] {
    // SAFETY: `aya::Pod` types are plain data that may be viewed as bytes; the slice borrows it.
    unsafe { std::slice::from_raw_parts((value as *const T).cast::<u8>(), size_of::<T>()) }
}

/// A descriptor owner whose descriptor stays open and the same for as long as it lives: what
/// tokio's reactor may watch ([`readable`]). Implemented here, for the owners the agent has.
pub trait OwnsFd: AsRawFd + sealed::Sealed {}

mod sealed {
    pub trait Sealed {}
}

/// An inotify instance as tokio's reactor wants it.
pub struct Inotify(pub nix::sys::inotify::Inotify);

impl AsRawFd for Inotify {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_fd().as_raw_fd()
    }
}

impl sealed::Sealed for Inotify {}
impl OwnsFd for Inotify {}
impl sealed::Sealed for aya::maps::RingBuf<aya::maps::MapData> {}
impl OwnsFd for aya::maps::RingBuf<aya::maps::MapData> {}
impl sealed::Sealed for aya_log::EbpfLogger<&'static dyn log::Log> {}
impl OwnsFd for aya_log::EbpfLogger<&'static dyn log::Log> {}

/// Registers `inner`'s descriptor with the current tokio runtime's reactor, for reading.
pub fn readable<T: OwnsFd>(inner: T) -> io::Result<AsyncFd<T>> {
    // SAFETY: `OwnsFd` is implemented only for owners whose descriptor stays open and the same
    // while they live: the inotify instance, aya's ring buffer and its logger own theirs.
    unsafe { AsyncFd::register_with_interest(inner, tokio::io::Interest::READABLE) }.map_err(|e| e.into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clocks_and_sizes_read() {
        assert!(monotonic() > Duration::ZERO);
        assert!(clock_ticks().is_some_and(|t| t > 0));
        assert!(page_size() >= 4096);
        assert_eq!(fs_magic(Path::new("/proc")), Some(libc::PROC_SUPER_MAGIC));
        assert_eq!(fs_magic(Path::new("/no/such/path")), None);
    }

    #[test]
    fn pidfd_of_a_gone_process_and_of_ourselves() {
        let me = pidfd_open(std::process::id()).expect("our own pidfd");
        assert!(!ready_now(me.as_fd(), libc::POLLIN), "we have not exited");
        assert!(pidfd_send_signal(me.as_fd(), 0).is_ok(), "signal 0 checks the target");
        assert!(pidfd_open(u32::MAX).is_err());
        assert!(kill(u32::MAX, 0).is_err());
    }

    #[test]
    fn records_read_back_and_short_ones_do_not() {
        let mut raw = valet_common::KernelEvent::zeroed();
        raw.tgid = 77;
        let read: Option<valet_common::KernelEvent> = read_pod(pod_bytes(&raw));
        assert_eq!(read.map(|r| r.tgid), Some(77));
        assert!(read_pod::<valet_common::KernelEvent>(&pod_bytes(&raw)[..3]).is_none());
    }
}
