//! Shared plumbing for valet's privileged integration tests (run as root through
//! `cargo xtask test`): small cgroup and process helpers on top of `valet-sim`.

pub mod cgroups;
pub mod envoy;
pub mod harness;
pub mod pins;
