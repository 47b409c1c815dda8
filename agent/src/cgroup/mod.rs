//! The node's cgroup v2 tree: where kubelet puts pods and containers, and how to read it.
pub mod root;
