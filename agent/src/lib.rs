//! valet's node agent as a library: the binary in `main.rs` only wires these parts together.
//!
//! Data flow: kernel events (`kernel`) and API events (`kube`) come in, the pure decision step
//! (`pod`) says what to do, small actuators do it (`sidecar` quits a proxy, `gate` holds and
//! releases apps and publishes the readiness condition), `metrics` observes every step.

pub mod cgroup;
pub mod error;
pub mod kernel;

pub use error::{Error, Result};
