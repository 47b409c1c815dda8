//! The agent library's error type. `anyhow` is only used at the binary's edge.
//!
//! Errors that wrap another library's error keep it as their `source()`, beside a short
//! `what` that says what was being done; the plain-message variants are for problems valet
//! finds itself. A message never repeats its source (the chain would print it twice): log
//! lines and Events print [`Error::chain`], the message with its causes.

use std::fmt;

/// Errors of the agent library, each with a low-cardinality label for metrics.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("{what}")]
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
    #[error("kernel programs, {what}")]
    EbpfObject {
        what: String,
        #[source]
        source: Box<aya::EbpfError>,
    },
    #[error("kernel programs, {what}")]
    EbpfProgram {
        what: String,
        #[source]
        source: aya::programs::ProgramError,
    },
    #[error("kernel programs, {what}")]
    EbpfMap {
        what: String,
        #[source]
        source: aya::maps::MapError,
    },
    #[error("cgroup: {0}")]
    Cgroup(String),
    #[error("configuration: {0}")]
    Config(String),
    #[error("Kubernetes API, {what}")]
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

    /// The message with its causes, for log lines and Events.
    pub fn chain(&self) -> Chain<'_> {
        Chain(self)
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

/// An error and its causes on one line, `: ` between them. A cause whose text the line already
/// ends with is left out: other libraries' errors may print their source in their own message.
pub struct Chain<'a>(pub &'a (dyn std::error::Error + 'static));

impl fmt::Display for Chain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut line = self.0.to_string();
        let mut cause = self.0.source();
        while let Some(c) = cause {
            let text = c.to_string();
            if !line.ends_with(&text) {
                line.push_str(": ");
                line.push_str(&text);
            }
            cause = c.source();
        }
        f.write_str(&line)
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
        assert_eq!(map.to_string(), "kernel programs, map WATCHED", "the message leaves the source to the chain");
        assert_eq!(map.chain().to_string(), "kernel programs, map WATCHED: key not found");
        assert!(map.source().and_then(|s| s.downcast_ref::<aya::maps::MapError>()).is_some());
        assert_eq!(map.metric_label(), "ebpf");

        let program = Error::ebpf_program("load valet_exit", aya::programs::ProgramError::NotLoaded);
        assert!(program.source().and_then(|s| s.downcast_ref::<aya::programs::ProgramError>()).is_some());

        let io = Error::io("read /x", std::io::Error::from(std::io::ErrorKind::NotFound));
        let kind = io.source().and_then(|s| s.downcast_ref::<std::io::Error>()).map(std::io::Error::kind);
        assert_eq!(kind, Some(std::io::ErrorKind::NotFound));
        assert_eq!(io.chain().to_string(), "read /x: entity not found");

        let kube: Error = kube::Error::LinesCodecMaxLineLengthExceeded.into();
        assert!(kube.source().and_then(|s| s.downcast_ref::<kube::Error>()).is_some());
        assert_eq!(kube.metric_label(), "kube");
        assert_eq!(kube.to_string(), "Kubernetes API, request");
        assert!(kube.chain().to_string().starts_with("Kubernetes API, request: "), "{}", kube.chain());

        let object = Error::ebpf_object("load object", aya::EbpfError::NoBTF);
        assert_eq!(object.chain().to_string(), "kernel programs, load object: no BTF parsed for object");
        assert!(object.source().is_some());

        // A plain message has no cause to keep.
        assert!(Error::Cgroup("x".into()).source().is_none());
        assert_eq!(Error::Cgroup("x".into()).chain().to_string(), "cgroup: x");
    }

    /// Through anyhow, as the binary reports a failed start: each cause once, even one whose
    /// own message already printed its source.
    #[test]
    fn a_chain_prints_each_cause_once() {
        #[derive(Debug, thiserror::Error)]
        #[error("parse BTF: {0}")]
        struct Repeats(#[source] std::io::Error);
        let inner = std::io::Error::other("bad magic");
        let e = anyhow::Error::new(Error::io("read /sys/kernel/btf/vmlinux", std::io::Error::other(Repeats(inner))))
            .context("load kernel programs");
        assert_eq!(
            Chain(e.as_ref()).to_string(),
            "load kernel programs: read /sys/kernel/btf/vmlinux: parse BTF: bad magic"
        );
    }
}
