//! valet's node agent as a library: the binary in `main.rs` only wires these parts together.
//!
//! Data flow: kernel events (`kernel`) and API events (`api`) come in; the `pod_router` routes
//! each to one pod's state machine (`pod::state`, pure: it decides with `pod::decide` and returns
//! `effect`s); small actuators (`act`) carry the effects out — ask a sidecar to quit (`sidecar`),
//! release a held app, write the readiness condition — and feed their results back; `metrics`
//! observes every step. `vocab` holds the words they all share (sidecar kinds, endpoints, how
//! a process or a quit ended) and imports none of them.
//! `observe` watches every pod with a known sidecar, labelled or not, and only counts what the
//! sidecars cost.
//!
//! Unsafe code and libc calls live in one module, `host::sys`, behind safe functions: the crate
//! denies `unsafe_code` everywhere else.
#![deny(unsafe_code)]

pub mod act;
pub mod api;
pub mod cgroup;
pub mod config;
pub mod deadline_keeper;
pub mod effect;
pub mod ended_by_valet;
pub mod error;
pub mod host;
pub mod kernel;
pub mod log_links;
pub mod metrics;
pub mod observe;
pub mod pod;
pub mod pod_router;
pub mod runtime;
pub mod runtime_record;
pub mod server;
pub mod sidecar;
pub mod vocab;

pub use error::{Error, Result};
