//! The stream of kernel events, decoded from the programs' ring buffer into domain types: read by
//! a thread of its own in the agent ([`EventReader`], which sends the quits armed ahead), or by
//! an async reader on the caller's runtime ([`EventStream`], for tests and the bench's kernel
//! figures). Both are woken by the ring buffer's fd; neither polls.

use std::os::fd::AsRawFd as _;
use std::sync::Arc;

use aya::maps::{MapData, RingBuf};
use tokio::io::unix::AsyncFd;
use valet_common::{ExitRecord, KernelEvent, event_flags, event_kind};

use crate::error::{Error, Result};
pub use crate::vocab::ProcessEnd;

/// A whole-process exit in a watched pod that can end its container. The kernel reports only:
/// * the exit of a container's recorded main process (`container_main`): the container ended;
/// * the exit of pid 1 of a pid namespace one level below the host's (`ns_init`): the init of
///   a container's own namespace, whose exit ends the namespace. Usually that is the recorded
///   main too; without `container_main` the container has no record (it started before its pod
///   was watched and was not adopted) or a wrong one: user space decides.
///
/// Every other exit (children, nested sandboxes, runtime helpers) is dropped in the kernel and
/// counted as [`valet_common::Counter::ExitsFiltered`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcessExit {
    pub ktime_ns: u64,
    pub cgroup_id: u64,
    pub watched_cgroup_id: u64,
    /// The process's pid as seen from the host's pid namespace (the agent's).
    pub tgid: u32,
    /// The thread that ended the group.
    pub pid: u32,
    pub ns_pid: u32,
    /// `None` when the kernel layout did not allow reading the exit code.
    pub end: Option<ProcessEnd>,
    /// The process was pid 1 of a pid namespace below the host's.
    pub ns_init: bool,
    /// The process lived in a pid namespace below the host's.
    pub child_pid_ns: bool,
    /// The process was its container's recorded main process: the container ended.
    pub container_main: bool,
    pub comm: String,
    /// The container cgroup's name as the process left it (it holds the container's id), when
    /// the kernel could read it: the end is matched to its container by it even once the
    /// cgroup is gone and the agent never saw it.
    pub cgroup_name: Option<String>,
    /// Quits the event reader sent ahead the moment it read this end ([`OnExit`]); 0 when read
    /// any other way.
    pub quits_sent_ahead: usize,
}

impl ProcessExit {
    /// The end of a container's recorded main process (`comm` `app`, pid 1 of its namespace,
    /// host pid 4242) in `container_cgroup` of the pod cgroup `pod_cgroup` at `ktime_ns`: the
    /// exit tests of the loops and of the quits ahead feed without a kernel.
    pub fn of_container_main(pod_cgroup: u64, container_cgroup: u64, end: Option<ProcessEnd>, ktime_ns: u64) -> Self {
        ProcessExit {
            ktime_ns,
            cgroup_id: container_cgroup,
            watched_cgroup_id: pod_cgroup,
            tgid: 4242,
            pid: 4242,
            ns_pid: 1,
            end,
            ns_init: true,
            child_pid_ns: true,
            container_main: true,
            comm: "app".into(),
            cgroup_name: None,
            quits_sent_ahead: 0,
        }
    }
}

/// A process stopped at exec, waiting for user space to release it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeldProcess {
    pub ktime_ns: u64,
    pub cgroup_id: u64,
    pub watched_cgroup_id: u64,
    /// The process's pid as seen from the host's pid namespace (the agent's).
    pub tgid: u32,
    pub comm: String,
}

/// A TCP socket started listening in a pod watched for holds: its proxy may answer now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Listening {
    pub ktime_ns: u64,
    pub cgroup_id: u64,
    pub watched_cgroup_id: u64,
    pub tgid: u32,
    pub port: u16,
    pub comm: String,
}

/// One decoded kernel event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    Exit(ProcessExit),
    Held(HeldProcess),
    Listen(Listening),
}

fn comm(raw: &[u8; 16]) -> String {
    let end = raw.iter().position(|&b| b == 0).unwrap_or(raw.len());
    String::from_utf8_lossy(&raw[..end]).into_owned()
}

/// The container cgroup's name of an exit record; `None` for a bare event (an older kernel
/// object), an empty name, or one that is not a plain file name.
fn cgroup_name(bytes: &[u8]) -> Option<String> {
    if bytes.len() < size_of::<ExitRecord>() {
        return None;
    }
    let raw = &bytes[size_of::<KernelEvent>()..size_of::<ExitRecord>()];
    let end = raw.iter().position(|&b| b == 0)?;
    let name = std::str::from_utf8(&raw[..end]).ok()?;
    let plain =
        !name.is_empty() && name != "." && name != ".." && name.bytes().all(|b| b.is_ascii_graphic() && b != b'/');
    plain.then(|| name.to_owned())
}

impl Event {
    /// Decodes one ring buffer record; `None` for records of unknown kind or size.
    pub fn decode(bytes: &[u8]) -> Option<Event> {
        let raw: KernelEvent = crate::host::sys::read_pod(bytes)?;
        match raw.kind {
            event_kind::EXIT => Some(Event::Exit(ProcessExit {
                cgroup_name: cgroup_name(bytes),
                ktime_ns: raw.ktime_ns,
                cgroup_id: raw.cgroup_id,
                watched_cgroup_id: raw.watched_cgroup_id,
                tgid: raw.tgid,
                pid: raw.pid,
                ns_pid: raw.ns_pid,
                end: (raw.flags & event_flags::NO_EXIT_CODE == 0)
                    .then(|| ProcessEnd::from_wait_status(raw.exit_status)),
                ns_init: raw.flags & event_flags::NS_INIT != 0,
                child_pid_ns: raw.flags & event_flags::CHILD_PID_NS != 0,
                container_main: raw.flags & event_flags::CONTAINER_MAIN != 0,
                comm: comm(&raw.comm),
                quits_sent_ahead: 0,
            })),
            event_kind::HELD => Some(Event::Held(HeldProcess {
                ktime_ns: raw.ktime_ns,
                cgroup_id: raw.cgroup_id,
                watched_cgroup_id: raw.watched_cgroup_id,
                tgid: raw.tgid,
                comm: comm(&raw.comm),
            })),
            event_kind::LISTEN => Some(Event::Listen(Listening {
                ktime_ns: raw.ktime_ns,
                cgroup_id: raw.cgroup_id,
                watched_cgroup_id: raw.watched_cgroup_id,
                tgid: raw.tgid,
                port: u16::try_from(raw.exit_status).ok()?,
                comm: comm(&raw.comm),
            })),
            _ => None,
        }
    }
}

/// The most events one batch hands to the loop.
const MAX_BATCH: usize = 256;

/// Async reader of kernel events.
pub struct EventStream {
    fd: AsyncFd<RingBuf<MapData>>,
    /// Records that could not be decoded (a kernel/user layout mismatch).
    pub undecodable: u64,
}

impl EventStream {
    pub fn new(ring: RingBuf<MapData>) -> Result<EventStream> {
        let fd = crate::host::sys::readable(ring).map_err(|e| Error::io("poll ring buffer", e))?;
        Ok(EventStream { fd, undecodable: 0 })
    }

    /// Waits for the next batch of events and returns it (never empty).
    pub async fn next_batch(&mut self) -> Result<Vec<Event>> {
        loop {
            let mut guard = self.fd.readable_mut().await.map_err(|e| Error::io("poll ring buffer", e))?;
            let ring = guard.get_inner_mut();
            let mut batch = Vec::new();
            let mut more = false;
            while let Some(item) = ring.next() {
                match Event::decode(&item) {
                    Some(event) => batch.push(event),
                    None => self.undecodable += 1,
                }
                // A bounded batch, so the loop's other inputs get their turn; what is left stays
                // readable and comes with the next call.
                if batch.len() >= MAX_BATCH {
                    more = true;
                    break;
                }
            }
            if !more {
                guard.clear_ready();
            }
            if !batch.is_empty() {
                return Ok(batch);
            }
        }
    }
}

/// What the event reader does with a container's end the moment it is decoded, on its own
/// thread, before the batch goes to the loop.
pub trait OnExit: Send + Sync + 'static {
    /// How many quits it sent for this end.
    fn on_exit(&self, exit: &ProcessExit) -> usize;
}

/// Batches the reader thread has decoded and not yet handed over, at most.
const READER_QUEUE: usize = 64;
/// How often the reader thread looks whether the loop is still there while no event comes.
const READER_CHECK: libc::c_int = 1000;

/// Kernel events read by a thread of their own (`valet-events`), blocked on the ring buffer's
/// fd and nothing else: an end is seen, and handed to [`OnExit`], one wake-up after the kernel
/// reported it, whatever the loop is busy with. The batches then go to the loop
/// ([`crate::kernel::EventSource`]). When the loop lags, the queue fills, the thread waits,
/// and the ring buffer holds the rest as before (what does not fit is counted lost).
///
/// The thread runs in the loop's class (`priority`, SCHED_FIFO; 0: the normal class): the quits
/// it sends ahead are the ends the loop would otherwise send, and in the normal class a loop
/// in SCHED_FIFO and the proxies it wakes took its CPU (after a stall of the agent, the last
/// quit sent ahead went out 22-132 ms after the resume, against 8-11 ms with the loop also in
/// the normal class).
pub struct EventReader {
    rx: tokio::sync::mpsc::Receiver<Vec<Event>>,
}

impl EventReader {
    pub fn spawn(ring: RingBuf<MapData>, on_exit: Arc<dyn OnExit>, priority: u8) -> Result<EventReader> {
        let (tx, rx) = tokio::sync::mpsc::channel(READER_QUEUE);
        std::thread::Builder::new()
            .name("valet-events".into())
            .spawn(move || {
                short_slice();
                crate::host::sys::enter_real_time("the kernel event reader", priority);
                read_events(ring, &tx, on_exit.as_ref())
            })
            .map_err(|e| Error::io("start the kernel event reader", e))?;
        Ok(EventReader { rx })
    }

    /// The next batch of events (never empty).
    pub async fn next_batch(&mut self) -> Result<Vec<Event>> {
        self.rx.recv().await.ok_or_else(|| Error::Ebpf("the kernel event reader stopped".into()))
    }
}

fn read_events(mut ring: RingBuf<MapData>, tx: &tokio::sync::mpsc::Sender<Vec<Event>>, on_exit: &dyn OnExit) {
    let fd = ring.as_raw_fd();
    loop {
        let polled = crate::host::sys::poll(&mut [libc::pollfd { fd, events: libc::POLLIN, revents: 0 }], READER_CHECK);
        if tx.is_closed() {
            return;
        }
        if let Err(e) = polled {
            if e.kind() != std::io::ErrorKind::Interrupted {
                tracing::warn!("poll the kernel event ring buffer: {e}");
                std::thread::sleep(std::time::Duration::from_millis(100));
            }
            continue;
        }
        let mut batch = Vec::new();
        while let Some(item) = ring.next() {
            // Records of unknown kind or size are dropped.
            if let Some(mut event) = Event::decode(&item) {
                if let Event::Exit(exit) = &mut event {
                    exit.quits_sent_ahead = on_exit.on_exit(exit);
                }
                batch.push(event);
            }
            if batch.len() >= MAX_BATCH && tx.blocking_send(std::mem::take(&mut batch)).is_err() {
                return;
            }
        }
        if !batch.is_empty() && tx.blocking_send(batch).is_err() {
            return;
        }
    }
}

/// Asks the scheduler for the shortest slice (0.1 ms) for the calling thread, so that once woken
/// it gets a CPU ahead of a task running out a longer one (Linux 6.12+, EEVDF; unprivileged,
/// nice unchanged). The reader runs for microseconds per wake-up; older kernels ignore or refuse
/// it, and the thread runs as any other. (Of use in the normal class only: without a priority,
/// or without CAP_SYS_NICE.)
fn short_slice() {
    if let Err(e) = crate::host::sys::short_slice(std::time::Duration::from_micros(100)) {
        tracing::debug!("event reader: no short scheduler slice: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_wait_statuses() {
        assert_eq!(ProcessEnd::from_wait_status(0), ProcessEnd::Exited(0));
        assert_eq!(ProcessEnd::from_wait_status(42 << 8), ProcessEnd::Exited(42));
        assert_eq!(ProcessEnd::from_wait_status(255 << 8), ProcessEnd::Exited(255));
        assert_eq!(ProcessEnd::from_wait_status(9), ProcessEnd::Signaled { signal: 9, core_dumped: false });
        assert_eq!(ProcessEnd::from_wait_status(0x80 | 11), ProcessEnd::Signaled { signal: 11, core_dumped: true });
        assert_eq!(ProcessEnd::from_wait_status(15).container_exit_code(), 143);
    }

    #[test]
    fn decodes_records_and_rejects_short_ones() {
        let mut raw = KernelEvent::zeroed();
        raw.kind = event_kind::EXIT;
        raw.flags = event_flags::NS_INIT | event_flags::CONTAINER_MAIN;
        raw.exit_status = 3 << 8;
        raw.tgid = 77;
        raw.comm[..4].copy_from_slice(b"app\0");
        let bytes = crate::host::sys::pod_bytes(&raw);
        match Event::decode(bytes) {
            Some(Event::Exit(exit)) => {
                assert_eq!(exit.end, Some(ProcessEnd::Exited(3)));
                assert!(exit.ns_init);
                assert!(exit.container_main);
                assert!(!exit.child_pid_ns);
                assert_eq!(exit.tgid, 77);
                assert_eq!(exit.comm, "app");
            }
            other => panic!("unexpected {other:?}"),
        }
        assert_eq!(exit_name(bytes), None, "a bare event carries no name");
        assert_eq!(Event::decode(&bytes[..10]), None);
        let mut unknown = raw;
        unknown.kind = 99;
        let bytes = crate::host::sys::pod_bytes(&unknown);
        assert_eq!(Event::decode(bytes), None);
    }

    fn exit_name(bytes: &[u8]) -> Option<String> {
        match Event::decode(bytes) {
            Some(Event::Exit(exit)) => exit.cgroup_name,
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn an_exit_record_carries_its_container_cgroups_name() {
        let mut rec = ExitRecord { event: KernelEvent::zeroed(), cgroup_name: [0; valet_common::CGROUP_NAME_BYTES] };
        rec.event.kind = event_kind::EXIT;
        let as_bytes = |rec: &ExitRecord| crate::host::sys::pod_bytes(rec).to_vec();
        let name = format!("cri-containerd-{}.scope", "ab".repeat(32));
        rec.cgroup_name[..name.len()].copy_from_slice(name.as_bytes());
        assert_eq!(exit_name(&as_bytes(&rec)), Some(name));
        // Empty (unreadable), cut (no NUL), or not a file name: no name.
        rec.cgroup_name = [0; valet_common::CGROUP_NAME_BYTES];
        assert_eq!(exit_name(&as_bytes(&rec)), None);
        rec.cgroup_name = [b'a'; valet_common::CGROUP_NAME_BYTES];
        assert_eq!(exit_name(&as_bytes(&rec)), None);
        rec.cgroup_name = [0; valet_common::CGROUP_NAME_BYTES];
        rec.cgroup_name[..4].copy_from_slice(b"a/..");
        assert_eq!(exit_name(&as_bytes(&rec)), None);
        rec.cgroup_name[..4].copy_from_slice(b"..\0\0");
        assert_eq!(exit_name(&as_bytes(&rec)), None);
    }
}
