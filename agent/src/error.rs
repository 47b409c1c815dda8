//! The agent library's error type. `anyhow` is only used at the binary's edge.

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
    #[error("kernel programs: {0}")]
    Ebpf(String),
    #[error("cgroup: {0}")]
    Cgroup(String),
    #[error("configuration: {0}")]
    Config(String),
    #[error("Kubernetes API: {0}")]
    Kube(#[source] kube::Error),
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

    /// A short, fixed label for metrics and logs.
    pub fn metric_label(&self) -> &'static str {
        match self {
            Error::Io { .. } => "io",
            Error::Btf(_) => "btf",
            Error::Ebpf(_) => "ebpf",
            Error::Cgroup(_) => "cgroup",
            Error::Config(_) => "config",
            Error::Kube(_) => "kube",
            Error::Endpoint(_) => "endpoint",
            Error::UnknownPod(_) => "unknown_pod",
        }
    }
}

impl From<kube::Error> for Error {
    fn from(e: kube::Error) -> Self {
        Error::Kube(e)
    }
}
