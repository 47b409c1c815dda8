//! The agent's own small HTTP server: `/metrics`, `/healthz` (the loop turns), `/readyz`
//! (programs attached, or the node degraded for a reason the operator expects, and the first pod
//! list done).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::header::{self, HeaderValue};
use hyper::{Method, Request, Response, StatusCode, service::service_fn};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tracing::{debug, info};

use crate::error::{Error, Result};
use crate::metrics::{Format, Metrics};

/// Liveness and readiness, shared between the agent loop and the server.
pub struct Health {
    pub programs_attached: AtomicBool,
    pub pods_listed: AtomicBool,
    /// Why the node is never ready: it degraded for a reason the operator did not expect
    /// (`--degraded-ok`). Set once, at start.
    degraded_unexpectedly: OnceLock<String>,
    /// When the loop last turned (`CLOCK_MONOTONIC` ns; 0: it has not started). It always has
    /// work (its tick), so a loop that stops turning is wedged: a deadlock, a blocked call.
    loop_turned: AtomicU64,
    /// How long the loop may go without turning before `/healthz` fails.
    stall: Duration,
}

impl Default for Health {
    fn default() -> Self {
        Health::new(DEFAULT_STALL)
    }
}

/// `/healthz` fails once the loop has not turned for this long (it turns at least four times a
/// second).
pub const DEFAULT_STALL: Duration = Duration::from_secs(5);

impl Health {
    pub fn new(stall: Duration) -> Health {
        Health {
            programs_attached: AtomicBool::new(false),
            pods_listed: AtomicBool::new(false),
            degraded_unexpectedly: OnceLock::new(),
            loop_turned: AtomicU64::new(0),
            stall,
        }
    }

    pub fn ready(&self) -> bool {
        self.programs_attached.load(Ordering::Relaxed)
            && self.pods_listed.load(Ordering::Relaxed)
            && self.degraded_unexpectedly.get().is_none()
    }

    /// The node degraded for a reason the operator did not expect: `/readyz` fails from now on,
    /// saying `why` (the agent still serves the node degraded).
    pub fn degraded_unexpectedly(&self, why: String) {
        let _ = self.degraded_unexpectedly.set(why);
    }

    /// The loop turned at `now` (monotonic ns).
    pub fn turned(&self, now: u64) {
        self.loop_turned.store(now, Ordering::Relaxed);
    }

    /// How long the loop has gone without turning at `now`, if longer than allowed. A loop that
    /// has not started yet (the kernel programs are loading) is not stalled.
    pub fn stalled(&self, now: u64) -> Option<Duration> {
        let last = self.loop_turned.load(Ordering::Relaxed);
        let since = Duration::from_nanos(now.saturating_sub(last));
        (last != 0 && since > self.stall).then_some(since)
    }
}

fn reply(status: StatusCode, content_type: &str, body: String) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    if let Ok(v) = content_type.parse() {
        r.headers_mut().insert(header::CONTENT_TYPE, v);
    }
    r
}

/// `/metrics` in the format the request's `Accept` header negotiates: OpenMetrics for
/// Prometheus (which asks for it first), the classic text format for everything else.
fn metrics_reply<B>(req: &Request<B>, metrics: &Metrics) -> Response<Full<Bytes>> {
    let accept: Vec<&str> = req.headers().get_all(header::ACCEPT).iter().filter_map(|v| v.to_str().ok()).collect();
    let format = Format::negotiate((!accept.is_empty()).then(|| accept.join(",")).as_deref());
    let mut r = match metrics.render(format) {
        Ok(body) => reply(StatusCode::OK, format.content_type(), body),
        Err(_) => reply(StatusCode::INTERNAL_SERVER_ERROR, "text/plain", "cannot encode metrics\n".into()),
    };
    r.headers_mut().insert(header::VARY, HeaderValue::from_static("accept"));
    r
}

fn route<B>(req: &Request<B>, metrics: &Metrics, health: &Health) -> Response<Full<Bytes>> {
    let path = req.uri().path();
    let known = matches!(path, "/metrics" | "/healthz" | "/readyz");
    if known && !matches!(*req.method(), Method::GET | Method::HEAD) {
        let mut r = reply(StatusCode::METHOD_NOT_ALLOWED, "text/plain", "method not allowed\n".into());
        r.headers_mut().insert(header::ALLOW, HeaderValue::from_static("GET, HEAD"));
        return r;
    }
    match path {
        "/metrics" => metrics_reply(req, metrics),
        "/healthz" => match health.stalled(crate::host::clock::monotonic_ns()) {
            None => reply(StatusCode::OK, "text/plain", "ok\n".into()),
            Some(since) => reply(
                StatusCode::SERVICE_UNAVAILABLE,
                "text/plain",
                format!("the agent's loop has not turned for {:.1}s\n", since.as_secs_f64()),
            ),
        },
        "/readyz" if health.ready() => reply(StatusCode::OK, "text/plain", "ready\n".into()),
        "/readyz" => {
            let why = if let Some(why) = health.degraded_unexpectedly.get() {
                format!("{why}\n")
            } else if health.programs_attached.load(Ordering::Relaxed) {
                "waiting for the first pod list\n".to_owned()
            } else {
                "kernel programs not attached\n".to_owned()
            };
            reply(StatusCode::SERVICE_UNAVAILABLE, "text/plain", why)
        }
        _ => reply(StatusCode::NOT_FOUND, "text/plain", "not found\n".into()),
    }
}

/// Binds `addr` (fails fast on a bad or busy address) and serves until the task is dropped.
pub async fn bind(addr: SocketAddr) -> Result<TcpListener> {
    TcpListener::bind(addr).await.map_err(|e| Error::io(format!("bind metrics address {addr}"), e))
}

pub async fn serve(listener: TcpListener, metrics: Arc<Metrics>, health: Arc<Health>) {
    if let Ok(addr) = listener.local_addr() {
        info!(%addr, "serving /metrics, /healthz, /readyz");
    }
    loop {
        let Ok((stream, _)) = listener.accept().await else { continue };
        let (metrics, health) = (metrics.clone(), health.clone());
        tokio::spawn(async move {
            let service = service_fn(move |req| {
                let r = route(&req, &metrics, &health);
                async move { Ok::<_, std::convert::Infallible>(r) }
            });
            if let Err(e) = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(std::time::Duration::from_secs(5))
                .serve_connection(TokioIo::new(stream), service)
                .await
            {
                debug!("metrics connection: {e}");
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(method: &str, path: &str, accept: &[&str]) -> Request<()> {
        let mut b = Request::builder().method(method).uri(path);
        for a in accept {
            b = b.header(header::ACCEPT, *a);
        }
        b.body(()).expect("request")
    }

    fn ready_health() -> Health {
        let h = Health::default();
        h.programs_attached.store(true, Ordering::Relaxed);
        h.pods_listed.store(true, Ordering::Relaxed);
        h
    }

    fn content_type(r: &Response<Full<Bytes>>) -> &str {
        r.headers().get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or_default()
    }

    #[test]
    fn metrics_format_follows_the_accept_header() {
        let (m, h) = (Metrics::new(), ready_health());
        let prometheus = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,\
                          text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
        let r = route(&request("GET", "/metrics", &[prometheus]), &m, &h);
        assert_eq!(r.status(), StatusCode::OK);
        assert_eq!(content_type(&r), "application/openmetrics-text; version=1.0.0; charset=utf-8");
        assert_eq!(r.headers().get(header::VARY).map(|v| v.as_bytes()), Some(&b"accept"[..]));
        for accept in [&[][..], &["text/plain;version=0.0.4"], &["application/json", "*/*"]] {
            let r = route(&request("GET", "/metrics", accept), &m, &h);
            assert_eq!(content_type(&r), "text/plain; version=0.0.4; charset=utf-8", "{accept:?}");
        }
        // Several Accept headers count as one list.
        let r = route(&request("GET", "/metrics", &["text/plain;q=0.1", "application/openmetrics-text"]), &m, &h);
        assert_eq!(content_type(&r), "application/openmetrics-text; version=1.0.0; charset=utf-8");
    }

    #[test]
    fn routes_and_methods() {
        let (m, h) = (Metrics::new(), ready_health());
        for (method, path, status) in [
            ("GET", "/healthz", StatusCode::OK),
            ("HEAD", "/healthz", StatusCode::OK),
            ("GET", "/readyz", StatusCode::OK),
            ("HEAD", "/metrics", StatusCode::OK),
            ("GET", "/nope", StatusCode::NOT_FOUND),
            ("POST", "/nope", StatusCode::NOT_FOUND),
            ("POST", "/metrics", StatusCode::METHOD_NOT_ALLOWED),
            ("PUT", "/healthz", StatusCode::METHOD_NOT_ALLOWED),
            ("DELETE", "/readyz", StatusCode::METHOD_NOT_ALLOWED),
        ] {
            let r = route(&request(method, path, &[]), &m, &h);
            assert_eq!(r.status(), status, "{method} {path}");
            if status == StatusCode::METHOD_NOT_ALLOWED {
                assert_eq!(r.headers().get(header::ALLOW).map(|v| v.as_bytes()), Some(&b"GET, HEAD"[..]));
            }
        }
        let unready = Health::default();
        assert_eq!(route(&request("GET", "/readyz", &[]), &m, &unready).status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(route(&request("GET", "/healthz", &[]), &m, &unready).status(), StatusCode::OK);
    }

    #[test]
    fn readyz_fails_on_a_node_degraded_for_a_reason_not_expected_and_says_why() {
        use crate::kernel::mode::{DEFAULT_DEGRADED_OK, ExpectedDegraded};
        use crate::vocab::{DegradedReason, NodeMode};
        let m = Metrics::new();
        let expected = ExpectedDegraded::parse(&DEFAULT_DEGRADED_OK.split(',').map(str::to_owned).collect::<Vec<_>>())
            .expect("default");
        let body = |r: Response<Full<Bytes>>| {
            let bytes = futures::executor::block_on(http_body_util::BodyExt::collect(r.into_body())).expect("body");
            String::from_utf8_lossy(&bytes.to_bytes()).into_owned()
        };
        for (mode, ready) in [
            (NodeMode::Kernel, true),
            (NodeMode::Degraded(DegradedReason::NoBtf), true),
            (NodeMode::Degraded(DegradedReason::KernelUnsupported), false),
        ] {
            // As the agent's start sets it: the programs' stand-in attached, the pods listed.
            let h = ready_health();
            if let Some(why) = expected.unready(mode) {
                h.degraded_unexpectedly(why);
            }
            let r = route(&request("GET", "/readyz", &[]), &m, &h);
            assert_eq!(r.status() == StatusCode::OK, ready, "{mode:?}");
            assert_eq!(h.ready(), ready, "{mode:?}");
            let text = body(r);
            if !ready {
                assert!(text.contains("kernel_unsupported") && text.contains("--degraded-ok="), "{text}");
            }
            // Liveness is not readiness: a degraded node's agent is never restarted for it.
            assert_eq!(route(&request("GET", "/healthz", &[]), &m, &h).status(), StatusCode::OK);
        }
    }

    #[test]
    fn healthz_fails_once_the_loop_stops_turning() {
        let m = Metrics::new();
        let h = Health::new(Duration::from_secs(5));
        let now = crate::host::clock::monotonic_ns();
        assert_eq!(h.stalled(now), None, "a loop that has not started is not stalled");
        h.turned(now);
        assert_eq!(h.stalled(now + 5_000_000_000), None);
        assert_eq!(h.stalled(now + 5_000_000_001), Some(Duration::from_nanos(5_000_000_001)));
        // The route reads the clock: a turn 6 s ago is a wedged loop.
        h.turned(now.saturating_sub(6_000_000_000));
        let r = route(&request("GET", "/healthz", &[]), &m, &h);
        assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
        h.turned(crate::host::clock::monotonic_ns());
        assert_eq!(route(&request("GET", "/healthz", &[]), &m, &h).status(), StatusCode::OK);
    }
}
