//! The words every part of the agent shares, and nothing else: what a sidecar is and where it
//! is reached, how a process or a quit ended, what condition a pod should carry. A leaf: it
//! imports no module of the agent's, so the decisions (`pod`), the effects they return
//! (`effect`) and the parts that carry them out (`sidecar`, `api`, `act`) can all speak it
//! without depending on each other.

use std::fmt;
use std::str::FromStr;

/// The sidecars valet knows how to quit and probe: proxies with known endpoints, any helper with
/// an HTTP quit endpoint the pod names (`http`), and any helper that ends on a signal (`signal`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum SidecarKind {
    Istio,
    Envoy,
    Linkerd,
    CloudSql,
    Http,
    Signal,
}

/// An HTTP endpoint on the pod's loopback.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Endpoint {
    pub port: u16,
    pub path: String,
}

impl Endpoint {
    pub fn new(port: u16, path: &str) -> Endpoint {
        Endpoint { port, path: path.to_owned() }
    }
}

impl SidecarKind {
    pub const ALL: [SidecarKind; 6] = [
        SidecarKind::Istio,
        SidecarKind::Envoy,
        SidecarKind::Linkerd,
        SidecarKind::CloudSql,
        SidecarKind::Http,
        SidecarKind::Signal,
    ];

    /// The name used in annotations, logs and metric labels.
    pub fn as_str(&self) -> &'static str {
        match self {
            SidecarKind::Istio => "istio",
            SidecarKind::Envoy => "envoy",
            SidecarKind::Linkerd => "linkerd",
            SidecarKind::CloudSql => "cloudsql",
            SidecarKind::Http => "http",
            SidecarKind::Signal => "signal",
        }
    }

    /// Where the proxy accepts `POST` to exit cleanly (exit code 0); none for the generic kinds
    /// (`http` takes it from the pod's annotations, `signal` has none).
    pub fn quit_endpoint(&self) -> Option<Endpoint> {
        match self {
            // pilot-agent, not Envoy: pilot-agent would restart an Envoy that quit alone.
            SidecarKind::Istio => Some(Endpoint::new(15020, "/quitquitquit")),
            SidecarKind::Envoy => Some(Endpoint::new(15000, "/quitquitquit")),
            SidecarKind::Linkerd => Some(Endpoint::new(4191, "/shutdown")),
            SidecarKind::CloudSql => Some(Endpoint::new(9091, "/quitquitquit")),
            SidecarKind::Http | SidecarKind::Signal => None,
        }
    }

    /// Where `GET` answers 2xx once the proxy can carry the app's traffic; none for the generic
    /// kinds unless the pod names one.
    pub fn ready_endpoint(&self) -> Option<Endpoint> {
        match self {
            SidecarKind::Istio => Some(Endpoint::new(15021, "/healthz/ready")),
            SidecarKind::Envoy => Some(Endpoint::new(15000, "/ready")),
            SidecarKind::Linkerd => Some(Endpoint::new(4191, "/ready")),
            SidecarKind::CloudSql => Some(Endpoint::new(9090, "/readiness")),
            SidecarKind::Http | SidecarKind::Signal => None,
        }
    }
}

impl fmt::Display for SidecarKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A kind name that is none of `istio`, `envoy`, `linkerd`, `cloudsql`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown sidecar kind {0:?} (valet knows istio, envoy, linkerd, cloudsql, http, signal)")]
pub struct UnknownKind(pub String);

/// Parses a kind name. ASCII case and surrounding spaces are ignored (`Istio` is `istio`): the
/// names cannot be confused with each other, so being lenient here cannot pick a wrong proxy.
impl FromStr for SidecarKind {
    type Err = UnknownKind;

    fn from_str(text: &str) -> Result<SidecarKind, UnknownKind> {
        let wanted = text.trim();
        SidecarKind::ALL
            .into_iter()
            .find(|k| k.as_str().eq_ignore_ascii_case(wanted))
            .ok_or_else(|| UnknownKind(text.to_owned()))
    }
}

/// One sidecar of a pod and how to end it.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Sidecar {
    pub name: String,
    pub kind: SidecarKind,
    /// Its HTTP quit endpoint; none: it is ended with `quit_signal`.
    pub quit: Option<Endpoint>,
    /// Its readiness endpoint; none: valet cannot tell when it is ready (no hold, no condition).
    pub ready: Option<Endpoint>,
    /// The signal that ends a sidecar without a quit endpoint.
    pub quit_signal: i32,
}

/// How a quit ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum QuitOutcome {
    /// 2xx: the sidecar will exit.
    Accepted { status: u16, attempts: u32 },
    /// A definitive refusal (4xx): the endpoint is not there or not allowed; retrying won't help.
    Rejected { status: u16, body: String },
    /// Never got an acceptance in the retry window.
    Failed { last: String, label: &'static str, attempts: u32 },
}

impl QuitOutcome {
    /// Short label for metrics.
    pub fn label(&self) -> &'static str {
        match self {
            QuitOutcome::Accepted { .. } => "ok",
            QuitOutcome::Rejected { .. } => "rejected",
            QuitOutcome::Failed { label, .. } => label,
        }
    }
}

/// The condition valet wants on a pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProxyReady {
    pub ready: bool,
    pub reason: &'static str,
    pub message: String,
}

/// How a process ended, decoded from a wait(2) status.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProcessEnd {
    /// `exit(n)` or return from main.
    Exited(i32),
    /// Killed by a signal.
    Signaled { signal: i32, core_dumped: bool },
}

impl ProcessEnd {
    /// Decodes `task_struct.exit_code`: status in bits 8–15, signal in bits 0–6, core in bit 7.
    pub fn from_wait_status(raw: u32) -> ProcessEnd {
        let signal = (raw & 0x7f) as i32;
        if signal == 0 {
            ProcessEnd::Exited(((raw >> 8) & 0xff) as i32)
        } else {
            ProcessEnd::Signaled { signal, core_dumped: raw & 0x80 != 0 }
        }
    }

    /// The exit code a container runtime reports for this end (128 + signal for signals).
    pub fn container_exit_code(&self) -> i32 {
        match *self {
            ProcessEnd::Exited(code) => code,
            ProcessEnd::Signaled { signal, .. } => 128 + signal,
        }
    }
}
