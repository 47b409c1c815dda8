//! One readiness probe loop per pod: asks every probed sidecar of the pod whether it is ready,
//! reports the answer, and waits as the pod's pace says. Dropping the handle stops the loop.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, watch};

use super::Report;
use crate::effect::{Feedback, Pace};
use crate::pod::spec::{Sidecar, SidecarKind};
use crate::sidecar::http::Limits;
use crate::sidecar::{PodTarget, SidecarLink};

/// Probe interval while an app is held: the release latency is about half of it.
const URGENT: Duration = Duration::from_millis(10);
/// An unchanged answer is reported at most this often (a failed condition write is retried on
/// the next report); once the proxy was seen ready, at most every `REPEAT_READY` (each report
/// is a decision step of the pod: on a full node, the cost of probing ready proxies).
const REPEAT: Duration = Duration::from_secs(1);
const REPEAT_READY: Duration = Duration::from_secs(60);
/// How often a proxy that is not ready yet gets a connection to its quit endpoint tried.
const STANDBY_EARLY: Duration = Duration::from_secs(1);

const LIMITS: Limits = Limits {
    connect_timeout: Duration::from_millis(200),
    total_timeout: Duration::from_millis(500),
    max_response_bytes: 4096,
};

/// A running probe loop; it stops when this is dropped.
pub struct Handle {
    pace: watch::Sender<Pace>,
    task: tokio::task::JoinHandle<()>,
}

impl Handle {
    pub fn set_pace(&self, pace: Pace) {
        let _ = self.pace.send(pace);
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Starts probing `sidecars` of the pod at `target`, every `normal` until they are ready, then
/// every `relaxed`.
pub fn start<L: SidecarLink>(
    link: Arc<L>,
    target: PodTarget,
    sidecars: Vec<Sidecar>,
    pace: Pace,
    (normal, relaxed): (Duration, Duration),
    reports: mpsc::UnboundedSender<Report>,
) -> Handle {
    let (tx, mut rx) = watch::channel(pace);
    let task = tokio::spawn(async move {
        let mut last: Option<(bool, String, tokio::time::Instant)> = None;
        let mut standby_at: Option<tokio::time::Instant> = None;
        loop {
            let (ready, detail) = probe_all(link.as_ref(), &target, &sidecars).await;
            // Have a connection to each quit endpoint open before the work is done, so the quit
            // is one write: once the proxy serves, and already before (at most every second:
            // pilot-agent's status port listens well before Envoy is ready), so a burst of
            // proxies turning ready does not also open a burst of connections.
            if ready || standby_at.is_none_or(|at| at.elapsed() >= STANDBY_EARLY) {
                standby_at = Some(tokio::time::Instant::now());
                for endpoint in sidecars.iter().filter_map(|sc| sc.quit.as_ref()) {
                    link.standby(&target, endpoint.port);
                }
            }
            // Only news goes to the pod's state machine (the loop runs every 10 ms while an app is
            // held): a changed answer, or the same one after a while.
            let repeat = if *rx.borrow() == Pace::Relaxed { REPEAT_READY } else { REPEAT };
            let news = last.as_ref().is_none_or(|(r, d, at)| *r != ready || *d != detail || at.elapsed() >= repeat);
            if news {
                last = Some((ready, detail.clone(), tokio::time::Instant::now()));
                if reports.send((target.uid.clone(), Feedback::Probed { ready, detail })).is_err() {
                    return;
                }
            }
            let wait = match *rx.borrow() {
                Pace::Urgent => URGENT,
                Pace::Normal => normal,
                Pace::Relaxed => relaxed.max(normal),
            };
            tokio::select! {
                () = tokio::time::sleep_until(next_slot(wait)) => {}
                changed = rx.changed() => if changed.is_err() { return },
            }
        }
    });
    Handle { pace: tx, task }
}

/// The next multiple of `period` on a clock shared by every probe loop: the loops of a pace
/// wake together, so a node's probes cost one wake-up of the agent per period, not one per pod.
fn next_slot(period: Duration) -> tokio::time::Instant {
    static ORIGIN: std::sync::OnceLock<tokio::time::Instant> = std::sync::OnceLock::new();
    let origin = *ORIGIN.get_or_init(tokio::time::Instant::now);
    let period_ns = period.as_nanos().max(1);
    let slots = tokio::time::Instant::now().duration_since(origin).as_nanos() / period_ns + 1;
    origin + Duration::from_nanos(u64::try_from(slots * period_ns).unwrap_or(u64::MAX))
}

/// One probe of every sidecar: ready when all answer 2xx.
async fn probe_all(link: &dyn SidecarLink, target: &PodTarget, sidecars: &[Sidecar]) -> (bool, String) {
    let mut ready = true;
    let mut detail = Vec::new();
    for sc in sidecars {
        let Some(endpoint) = &sc.ready else { continue };
        // From inside the pod's network namespace first: health listeners bound to loopback
        // (Envoy's admin, cloud-sql-proxy's default) answer there. The pod IP, as the kubelet
        // probes, until the pod's processes are found — never for Envoy's loopback-only admin.
        let fallback = !matches!(sc.kind, SidecarKind::Envoy);
        let answer =
            link.request(target.clone(), endpoint.port, "GET", endpoint.path.clone(), LIMITS, false, fallback).await;
        match answer {
            Ok(r) if (200..300).contains(&r.status) => detail.push(format!("{} answered {}", sc.name, r.status)),
            Ok(r) => {
                ready = false;
                detail.push(format!("{} answered {}", sc.name, r.status));
            }
            Err((why, _)) => {
                ready = false;
                detail.push(format!("{}: {why}", sc.name));
            }
        }
    }
    (ready, detail.join("; "))
}
