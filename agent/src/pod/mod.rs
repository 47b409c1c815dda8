//! The pure part of the agent: a pod's spec as plain data (`spec`), its container statuses
//! (`status`), what to do given what has been observed (`decide`), and the per-pod state machine
//! that holds it all (`state`). No I/O here.
pub mod decide;
pub mod restart;
pub mod spec;
pub mod state;
pub mod status;

#[cfg(test)]
mod fixtures;
