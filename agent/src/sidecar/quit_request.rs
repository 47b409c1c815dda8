//! One quit request: a sidecar asked to quit through its own admin endpoint, from inside the pod's network namespace,
//! with bounded retries.

use std::time::{Duration, Instant};

use tracing::debug;

use super::http::Limits;
use super::http::Response;
use super::{Failed, Pending, PodRequest, PodTarget, SidecarLink};
use crate::vocab::Endpoint;
pub use crate::vocab::QuitOutcome;

/// The first attempt of a quit, started at once: on a connection kept open ahead of time the
/// request is written before this returns.
pub fn first_attempt(link: &dyn SidecarLink, target: &PodTarget, endpoint: &Endpoint, limits: Limits) -> Attempt {
    attempt(link, target, endpoint, limits, false)
}

/// One quit request; `fresh`: in a namespace entered anew, on a new connection. A target without
/// a pod cgroup (a sandboxed pod, whose loopback the node cannot reach) is sent to its pod IP.
fn attempt(link: &dyn SidecarLink, target: &PodTarget, endpoint: &Endpoint, limits: Limits, fresh: bool) -> Attempt {
    let to_pod_ip = target.pod_rel.is_none() && target.pod_ip.is_some();
    link.request(PodRequest {
        target: target.clone(),
        port: endpoint.port,
        method: "POST",
        path: endpoint.path.clone(),
        limits,
        fresh,
        pod_ip_fallback: to_pod_ip,
    })
}

/// How soon a quit is tried again when nothing listens on the endpoint yet: the app ended while
/// its proxy was still starting (pilot-agent listens a second or two after its start), and the
/// quit should land as soon as the proxy listens. A refused connect on the pod's loopback costs
/// about 0.1 ms (a thread entering the namespace): 40 a second for a pod in that state. Other
/// failures (a timeout, an HTTP error) back off, doubling up to a second.
const REFUSED_RETRY: Duration = Duration::from_millis(25);

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
            Ok(r) if (200..300).contains(&r.status) => {
                return QuitOutcome::Accepted { status: r.status, attempts, sent_ns: r.sent_ns };
            }
            // 408/429 are worth another try; any other 4xx is the endpoint saying no.
            Ok(r) if (400..500).contains(&r.status) && r.status != 408 && r.status != 429 => {
                return QuitOutcome::Rejected { status: r.status, body: r.body.chars().take(200).collect() };
            }
            Ok(r) => (format!("HTTP {}", r.status), "http_error"),
            Err(e) => e,
        };
        debug!(attempts, %last, "quit attempt failed");
        let wait = if label == "refused" { REFUSED_RETRY } else { backoff };
        if started.elapsed() + wait > retry_for {
            return QuitOutcome::Failed { last, label, attempts };
        }
        tokio::time::sleep(wait).await;
        if label != "refused" {
            backoff = (backoff * 2).min(Duration::from_secs(1));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sidecar::http::Failure;
    use crate::sidecar::testing::TestLink;

    /// On a paused clock: how long (in the runtime's time) a quit takes to be accepted after
    /// `failures` failed attempts.
    async fn accepted_after(failures: usize, failure: Failure) -> (Duration, QuitOutcome) {
        let link = TestLink::default();
        *link.failing.lock().expect("lock") = Some((failures, failure));
        let target = PodTarget { uid: "u".into(), pod_rel: Some("pod".into()), pod_ip: None };
        let endpoint = Endpoint { port: 15020, path: "/quitquitquit".into() };
        let start = tokio::time::Instant::now();
        let outcome = quit(&link, &target, &endpoint, Limits::default(), Duration::from_secs(20), None).await;
        (start.elapsed(), outcome)
    }

    // A proxy that does not listen yet is asked again every 25 ms, so the quit lands within 25 ms
    // of its listening (the backoff, doubling to 1 s, gave up on these 40 at its 20 s).
    #[tokio::test(start_paused = true)]
    async fn a_proxy_not_listening_yet_is_asked_again_at_a_steady_pace() {
        let (took, outcome) = accepted_after(40, Failure::Refused).await;
        assert_eq!(outcome, QuitOutcome::Accepted { status: 200, attempts: 41, sent_ns: 0 });
        assert_eq!(took, REFUSED_RETRY * 40);
    }

    // Any other failure backs off, doubling from 25 ms.
    #[tokio::test(start_paused = true)]
    async fn other_failures_back_off() {
        let (took, outcome) = accepted_after(5, Failure::Timeout).await;
        assert_eq!(outcome, QuitOutcome::Accepted { status: 200, attempts: 6, sent_ns: 0 });
        assert_eq!(took, Duration::from_millis(25 + 50 + 100 + 200 + 400));
    }
}
