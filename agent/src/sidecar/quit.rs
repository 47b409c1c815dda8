//! Quitting a sidecar through its own admin endpoint, from inside the pod's network namespace,
//! with bounded retries; and the escalation (SIGTERM) when that does not end it.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::debug;

use super::http::{self, Limits, Response};
use super::netns::{PodNetns, open_pod_netns};
use crate::cgroup::CgroupFs;

/// Where and how to reach one sidecar.
#[derive(Clone, Debug)]
pub struct QuitRequest {
    /// The pod's network namespace if already open; otherwise (and for retries) it is found
    /// through the processes of `pod_cgroup`.
    pub netns: Option<Arc<PodNetns>>,
    pub host_proc: PathBuf,
    pub cgroups: CgroupFs,
    /// The pod's cgroup (relative path): the network namespace is found through its processes.
    pub pod_cgroup: String,
    pub port: u16,
    pub path: String,
    pub limits: Limits,
    /// Keep retrying failures (with backoff) this long.
    pub retry_for: Duration,
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

/// One POST to the quit endpoint inside the pod's network namespace.
async fn attempt(req: &QuitRequest, first: bool) -> Result<Response, (String, &'static str)> {
    let netns = match (&req.netns, first) {
        (Some(netns), true) => netns.clone(),
        _ => Arc::new(
            open_pod_netns(&req.host_proc, &req.cgroups, &req.pod_cgroup).map_err(|e| (e.to_string(), "no_netns"))?,
        ),
    };
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, req.port));
    let (path, limits) = (req.path.clone(), req.limits);
    match netns.run(move || http::request(addr, "POST", &path, limits)).await {
        Ok(Ok(response)) => Ok(response),
        Ok(Err(failure)) => Err((failure.to_string(), failure.label())),
        Err(e) => Err((e.to_string(), "netns")),
    }
}

/// Asks the sidecar to quit, retrying transient failures with backoff for `retry_for`.
pub async fn quit(req: &QuitRequest) -> QuitOutcome {
    let started = Instant::now();
    let mut backoff = Duration::from_millis(25);
    let mut attempts = 0;
    loop {
        attempts += 1;
        let (last, label) = match attempt(req, attempts == 1).await {
            Ok(r) if (200..300).contains(&r.status) => return QuitOutcome::Accepted { status: r.status, attempts },
            // 408/429 are worth another try; any other 4xx is the endpoint saying no.
            Ok(r) if (400..500).contains(&r.status) && r.status != 408 && r.status != 429 => {
                return QuitOutcome::Rejected { status: r.status, body: r.body.chars().take(200).collect() };
            }
            Ok(r) => (format!("HTTP {}", r.status), "http_error"),
            Err(e) => e,
        };
        debug!(attempts, %last, "quit attempt failed");
        if started.elapsed() + backoff > req.retry_for {
            return QuitOutcome::Failed { last, label, attempts };
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(1));
    }
}
