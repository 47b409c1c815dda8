//! The agent's own small HTTP server: `/metrics`, `/healthz` (process alive), `/readyz`
//! (programs attached and the first pod list done).

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use bytes::Bytes;
use http_body_util::Full;
use hyper::{Request, Response, StatusCode, body::Incoming, service::service_fn};
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;
use tracing::{debug, info};

use crate::error::{Error, Result};
use crate::metrics::Metrics;

/// Readiness shared between the agent loop and the server.
#[derive(Default)]
pub struct Health {
    pub programs_attached: AtomicBool,
    pub pods_listed: AtomicBool,
}

impl Health {
    pub fn ready(&self) -> bool {
        self.programs_attached.load(Ordering::Relaxed) && self.pods_listed.load(Ordering::Relaxed)
    }
}

fn reply(status: StatusCode, content_type: &str, body: String) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(Bytes::from(body)));
    *r.status_mut() = status;
    if let Ok(v) = content_type.parse() {
        r.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
    }
    r
}

fn route(req: &Request<Incoming>, metrics: &Metrics, health: &Health) -> Response<Full<Bytes>> {
    match (req.method().as_str(), req.uri().path()) {
        ("GET", "/metrics") => {
            reply(StatusCode::OK, "application/openmetrics-text; version=1.0.0; charset=utf-8", metrics.encode())
        }
        ("GET", "/healthz") => reply(StatusCode::OK, "text/plain", "ok\n".into()),
        ("GET", "/readyz") if health.ready() => reply(StatusCode::OK, "text/plain", "ready\n".into()),
        ("GET", "/readyz") => {
            let why = if health.programs_attached.load(Ordering::Relaxed) {
                "waiting for the first pod list\n"
            } else {
                "kernel programs not attached\n"
            };
            reply(StatusCode::SERVICE_UNAVAILABLE, "text/plain", why.into())
        }
        (_, "/metrics" | "/healthz" | "/readyz") => {
            reply(StatusCode::METHOD_NOT_ALLOWED, "text/plain", "method not allowed\n".into())
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
