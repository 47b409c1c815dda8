//! Shared plumbing for valet's privileged integration tests (run as root through
//! `cargo xtask test`): small cgroup and process helpers on top of `valet-sim`.

pub mod capabilities;
pub mod cgroups;
pub mod checks;
pub mod envoy;
pub mod harness;
pub mod held;
pub mod kernel_suite;
pub mod mounts;
pub mod pins;
pub mod unreadable;
