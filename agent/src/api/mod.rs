//! The Kubernetes API side: the pod watch, Events, and the readiness condition.
pub mod condition;
pub mod events;
pub mod watch;
