//! The node's cgroup tree (v2, or a v1 controller's hierarchy on v1 and hybrid nodes): where the
//! kubelet puts pods and containers, and how to read it.
pub mod created;
pub mod layout;
pub mod root;
pub mod signal;
pub mod tree;

pub use tree::{CgroupFs, ContainerDir, PodDir, Search, cgroup_of_pid};
