//! Actuators that talk to sidecar proxies: quit them, probe their readiness.
pub mod http;
pub mod netns;
pub mod quit;
