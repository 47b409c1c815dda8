//! The node's cgroup v2 tree: where kubelet puts pods and containers, and how to read it.
pub mod created;
pub mod layout;
pub mod root;
pub mod signal;
pub mod tree;

pub use tree::{CgroupFs, ContainerDir, PodDir, Search, cgroup_of_pid};
