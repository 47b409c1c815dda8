//! valet's node agent as a library: the binary in `main.rs` only wires these parts together.
//!
//! Data flow: kernel events (`kernel`) and API events (`api`) come in, the pure decision step
//! (`pod`) says what to do, small actuators do it (`sidecar` quits a proxy, `gate` holds and
//! releases apps and publishes the readiness condition), `metrics` observes every step.

pub mod api;
pub mod cgroup;
pub mod config;
pub mod controller;
pub mod error;
pub mod gate;
pub mod kernel;
pub mod metrics;
pub mod pod;
pub mod runtime;
pub mod server;
pub mod sidecar;

pub use error::{Error, Result};
