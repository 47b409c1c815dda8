//! The agent library's error type. `anyhow` is only used at the binary's edge.
//!
//! Errors that wrap another library's error keep it as their `source()`, beside a short
//! `what` that says what was being done; the plain-message variants are for problems valet
//! finds itself.

/// Errors of the agent library, each with a low-cardinality label for metrics.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{what}: {source}")]
    Io {
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("BTF: {0}")]
    Btf(String),
    /// A problem with the kernel programs that valet found itself (a missing map or program).
    #[error("kernel programs: {0}")]
    Ebpf(String),
    /// Boxed: aya's object errors are large, and every `Result` of the crate would carry them.
    #[error("kernel programs, {what}: {source}")]
    EbpfObject {
        what: String,
        #[source]
        source: Box<aya::EbpfError>,
    },
    #[error("kernel programs, {what}: {source}")]
    EbpfProgram {
        what: String,
        #[source]
        source: aya::programs::ProgramError,
    },
    #[error("kernel programs, {what}: {source}")]
    EbpfMap {
        what: String,
        #[source]
        source: aya::maps::MapError,
    },
    #[error("cgroup: {0}")]
    Cgroup(String),
    #[error("configuration: {0}")]
    Config(String),
    #[error("Kubernetes API, {what}: {source}")]
    Kube {
        what: String,
        #[source]
        source: kube::Error,
    },
    #[error("sidecar endpoint: {0}")]
    Endpoint(String),
    #[error("pod {0} is not on this node or not tracked")]
    UnknownPod(String),
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub fn io(what: impl Into<String>, source: std::io::Error) -> Self {
        Error::Io { what: what.into(), source }
    }

    pub fn kube(what: impl Into<String>, source: kube::Error) -> Self {
        Error::Kube { what: what.into(), source }
    }

    pub fn ebpf_object(what: impl Into<String>, source: aya::EbpfError) -> Self {
        Error::EbpfObject { what: what.into(), source: Box::new(source) }
    }

    pub fn ebpf_map(what: impl Into<String>, source: aya::maps::MapError) -> Self {
        Error::EbpfMap { what: what.into(), source }
    }

    pub fn ebpf_program(what: impl Into<String>, source: aya::programs::ProgramError) -> Self {
        Error::EbpfProgram { what: what.into(), source }
    }

    /// A short, fixed label for metrics and logs.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::Io { .. } => "io",
            Error::Btf(_) => "btf",
            Error::Ebpf(_) | Error::EbpfObject { .. } | Error::EbpfProgram { .. } | Error::EbpfMap { .. } => "ebpf",
            Error::Cgroup(_) => "cgroup",
            Error::Config(_) => "config",
            Error::Kube { .. } => "kube",
            Error::Endpoint(_) => "endpoint",
            Error::UnknownPod(_) => "unknown_pod",
        }
    }
}

/// For `?` on a Kubernetes call; [`Error::kube`] says which call.
impl From<kube::Error> for Error {
    fn from(source: kube::Error) -> Self {
        Error::kube("request", source)
    }
}

#[cfg(test)]
mod tests {
    use std::error::Error as _;

    use super::*;

    #[test]
    fn wrapped_errors_keep_their_source() {
        let map = Error::ebpf_map("map WATCHED", aya::maps::MapError::KeyNotFound);
        assert_eq!(map.to_string(), "kernel programs, map WATCHED: key not found");
        assert!(map.source().and_then(|s| s.downcast_ref::<aya::maps::MapError>()).is_some());
        assert_eq!(map.metric_label(), "ebpf");

        let program = Error::ebpf_program("load valet_exit", aya::programs::ProgramError::NotLoaded);
        assert!(program.source().and_then(|s| s.downcast_ref::<aya::programs::ProgramError>()).is_some());

        let io = Error::io("read /x", std::io::Error::from(std::io::ErrorKind::NotFound));
        let kind = io.source().and_then(|s| s.downcast_ref::<std::io::Error>()).map(std::io::Error::kind);
        assert_eq!(kind, Some(std::io::ErrorKind::NotFound));

        let kube: Error = kube::Error::LinesCodecMaxLineLengthExceeded.into();
        assert!(kube.source().and_then(|s| s.downcast_ref::<kube::Error>()).is_some());
        assert_eq!(kube.metric_label(), "kube");
        assert!(kube.to_string().starts_with("Kubernetes API, request: "), "{kube}");

        let object = Error::ebpf_object("load object", aya::EbpfError::NoBTF);
        assert_eq!(object.to_string(), "kernel programs, load object: no BTF parsed for object");
        assert!(object.source().is_some());

        // A plain message has no cause to keep.
        assert!(Error::Cgroup("x".into()).source().is_none());
    }
}
