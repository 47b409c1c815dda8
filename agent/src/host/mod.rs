//! What the agent reads of the host it runs on, apart from the kernel programs: processes in
//! `/proc` (a container's main process, start times), the clock the kernel stamps its events with,
//! and the agent's own resident memory.
pub mod clock;
pub mod container_main;
#[cfg(test)]
pub(crate) mod fake_proc;
pub mod proc;
pub mod read_only;
pub mod resident;
pub mod smaps;
#[allow(unsafe_code, reason = "the one module of libc calls and unsafe blocks, behind safe functions")]
pub mod sys;
