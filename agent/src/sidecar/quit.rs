//! Quitting a sidecar through its own admin endpoint, from inside the pod's network namespace,
//! with bounded retries.

use std::time::{Duration, Instant};

use tracing::debug;

use super::http::Limits;
use super::http::Response;
use super::{Failed, Pending, PodTarget, SidecarLink};
use crate::vocab::Endpoint;
pub use crate::vocab::QuitOutcome;

/// The first attempt of a quit, started at once: on a connection kept open ahead of time the
/// request is written before this returns.
pub fn first_attempt(link: &dyn SidecarLink, target: &PodTarget, endpoint: &Endpoint, limits: Limits) -> Attempt {
    attempt(link, target, endpoint, limits, false)
}

/// One quit request; `fresh`: in a namespace entered anew, on a new connection.
fn attempt(link: &dyn SidecarLink, target: &PodTarget, endpoint: &Endpoint, limits: Limits, fresh: bool) -> Attempt {
    link.request(target.clone(), endpoint.port, "POST", endpoint.path.clone(), limits, fresh, false)
}

/// One pending quit request.
pub type Attempt = Pending<Result<Response, Failed>>;

/// Asks the sidecar to quit (`POST` to its endpoint on the pod's loopback), retrying transient
/// failures with backoff for `retry_for`. The first attempt (`first`, else made here) uses the
/// namespace and connection opened ahead of time; retries enter the namespace anew.
pub async fn quit(
    link: &dyn SidecarLink,
    target: &PodTarget,
    endpoint: &Endpoint,
    limits: Limits,
    retry_for: Duration,
    mut first: Option<Attempt>,
) -> QuitOutcome {
    let started = Instant::now();
    let mut backoff = Duration::from_millis(25);
    let mut attempts = 0;
    loop {
        attempts += 1;
        let answer = match first.take() {
            Some(pending) => pending,
            None => attempt(link, target, endpoint, limits, attempts > 1),
        }
        .await;
        let (last, label) = match answer {
            Ok(r) if (200..300).contains(&r.status) => return QuitOutcome::Accepted { status: r.status, attempts },
            // 408/429 are worth another try; any other 4xx is the endpoint saying no.
            Ok(r) if (400..500).contains(&r.status) && r.status != 408 && r.status != 429 => {
                return QuitOutcome::Rejected { status: r.status, body: r.body.chars().take(200).collect() };
            }
            Ok(r) => (format!("HTTP {}", r.status), "http_error"),
            Err(e) => e,
        };
        debug!(attempts, %last, "quit attempt failed");
        if started.elapsed() + backoff > retry_for {
            return QuitOutcome::Failed { last, label, attempts };
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(1));
    }
}
