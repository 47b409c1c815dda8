//! The kernel side seen from user space: layout discovery (BTF), program loading, event stream,
//! and the two traits the pod router works through, so its loop can run against a stand-in.
pub mod btf;
pub mod held_ledger;
pub mod loader;
pub mod map_batch;
pub mod mode;
pub mod offsets;
pub mod programs;
pub mod ring;

use std::future::Future;

use valet_common::Counter;

pub use crate::host::container_main::MainProcess;
pub use programs::{Attach, Programs, RecordOutcome};
pub use ring::{Event, EventReader, EventStream, HeldProcess, Listening, ProcessEnd, ProcessExit};

use crate::error::Result;

/// What the pod router tells the loaded kernel programs and reads back from them.
pub trait KernelControl: Send {
    /// Starts watching a pod cgroup with [`valet_common::watch_flags`].
    fn watch(&mut self, cgroup_id: u64, flags: u32) -> Result<()>;
    fn unwatch(&mut self, cgroup_id: u64) -> Result<()>;
    /// Whether the first exec of a container's main process is held.
    fn classify_exec(&mut self, container_cgroup_id: u64, hold: bool) -> Result<()>;
    /// Whether the kernel already judged a container's first exec.
    fn exec_seen(&self, container_cgroup_id: u64) -> bool;
    /// Drops every map entry of a container cgroup.
    fn forget_container(&mut self, container_cgroup_id: u64);
    /// Tells the kernel which process is the main one of a container that was already running
    /// when its pod was watched (so its exit is reported as the container's end).
    fn record_container_main(&mut self, container_cgroup_id: u64, main: &MainProcess) -> Result<RecordOutcome>;
    fn counter(&self, counter: Counter) -> u64;
    fn detach(&mut self);
    /// The record of processes the kernel stopped at exec, where there is one (not in tests
    /// that run the loop without a kernel).
    fn held_ledger(&self) -> Option<std::sync::Arc<held_ledger::HeldLedger>> {
        None
    }
    /// Whether the record of held processes outlives this agent (pinned on bpffs): apps are held
    /// only then. Fakes that stand in for a kernel say yes unless a test says otherwise.
    fn held_record_pinned(&self) -> bool {
        true
    }
}

/// Batches of decoded kernel events.
pub trait EventSource: Send {
    /// Waits for the next batch (never empty).
    fn next_batch(&mut self) -> impl Future<Output = Result<Vec<Event>>> + Send;
}

impl KernelControl for Programs {
    fn watch(&mut self, cgroup_id: u64, flags: u32) -> Result<()> {
        Programs::watch(self, cgroup_id, flags)
    }

    fn unwatch(&mut self, cgroup_id: u64) -> Result<()> {
        Programs::unwatch(self, cgroup_id)
    }

    fn classify_exec(&mut self, container_cgroup_id: u64, hold: bool) -> Result<()> {
        Programs::classify_exec(self, container_cgroup_id, hold)
    }

    fn exec_seen(&self, container_cgroup_id: u64) -> bool {
        Programs::exec_seen(self, container_cgroup_id)
    }

    fn forget_container(&mut self, container_cgroup_id: u64) {
        Programs::forget_container(self, container_cgroup_id);
    }

    fn record_container_main(&mut self, container_cgroup_id: u64, main: &MainProcess) -> Result<RecordOutcome> {
        Programs::record_container_main(self, container_cgroup_id, main)
    }

    fn counter(&self, counter: Counter) -> u64 {
        Programs::counter(self, counter)
    }

    fn detach(&mut self) {
        Programs::detach(self);
    }

    fn held_ledger(&self) -> Option<std::sync::Arc<held_ledger::HeldLedger>> {
        Some(Programs::held_ledger(self))
    }

    fn held_record_pinned(&self) -> bool {
        Programs::held_ledger(self).pinned().is_some()
    }
}

impl EventSource for EventReader {
    fn next_batch(&mut self) -> impl Future<Output = Result<Vec<Event>>> + Send {
        EventReader::next_batch(self)
    }
}

impl EventSource for EventStream {
    fn next_batch(&mut self) -> impl Future<Output = Result<Vec<Event>>> + Send {
        EventStream::next_batch(self)
    }
}
