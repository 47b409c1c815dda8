//! Watch streams: one JSON object per line over a chunked HTTP/1.1 response.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::BodyExt as _;
use hyper::{Response, StatusCode};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::http::{Body, BoxError, ChannelBody, Req, count_watch};
use super::status::ApiError;
use super::store::Filter;
use super::traffic::Meter;
use super::{Shared, lock};

struct WatchParams {
    rv: Option<String>,
    bookmarks: bool,
    send_initial: bool,
    timeout: Option<Duration>,
}

/// Validates the watch parameters and starts the stream task.
pub(crate) fn start(shared: &Arc<Shared>, filter: Filter, r: &Req) -> Result<Response<Body>, ApiError> {
    let q = |k: &str| r.query.get(k).map(String::as_str);
    let flag = |k: &str| matches!(q(k), Some("true" | "1"));
    let send_initial = flag("sendInitialEvents");
    let rv_match = q("resourceVersionMatch").filter(|s| !s.is_empty());
    let invalid = |m: &str| ApiError::new(422, "Invalid", format!("ListOptions.meta.k8s.io \"\" is invalid: {m}"));
    if send_initial {
        if rv_match != Some("NotOlderThan") {
            return Err(invalid(
                "resourceVersionMatch: Forbidden: sendInitialEvents requires setting resourceVersionMatch to NotOlderThan",
            ));
        }
        if !flag("allowWatchBookmarks") {
            return Err(invalid(
                "allowWatchBookmarks: Required value: sendInitialEvents requires allowWatchBookmarks=true",
            ));
        }
    } else if rv_match.is_some() {
        return Err(invalid(
            "resourceVersionMatch: Forbidden: resourceVersionMatch is forbidden for watch unless sendInitialEvents is provided",
        ));
    }
    let timeout = match q("timeoutSeconds").filter(|s| !s.is_empty()) {
        Some(t) => {
            let secs: u64 = t.parse().map_err(|_| ApiError::bad_request(format!("invalid timeoutSeconds: {t}")))?;
            Some(Duration::from_secs(secs))
        }
        None => None,
    };
    // An unparseable RV fails the request itself; only a parsed but too old one becomes an
    // ERROR event inside a 200 stream (as the watch cache does it).
    if let Some(rv) = q("resourceVersion").filter(|s| !s.is_empty())
        && rv.parse::<u64>().is_err()
    {
        return Err(ApiError::bad_request(format!("invalid resource version: {rv:?}")));
    }
    let params = WatchParams {
        rv: q("resourceVersion").map(str::to_string),
        bookmarks: flag("allowWatchBookmarks"),
        send_initial,
        timeout,
    };
    count_watch(shared);
    let (tx, rx) = mpsc::channel(256);
    tokio::spawn(run(shared.clone(), filter, params, Lines { tx, meter: r.meter.clone() }));
    let mut resp = Response::new(ChannelBody(rx).boxed());
    *resp.status_mut() = StatusCode::OK;
    resp.headers_mut().insert(hyper::header::CONTENT_TYPE, hyper::header::HeaderValue::from_static("application/json"));
    Ok(resp)
}

/// A watch's response: its lines, each counted to the watch's flow.
struct Lines {
    tx: mpsc::Sender<Result<Bytes, BoxError>>,
    meter: std::sync::Arc<Meter>,
}

impl Lines {
    /// Sends one line; false when the client has gone. `type` first, as kube-apiserver writes
    /// its watch events (a `json!` map sorts its keys: `object` came first, which made a client's
    /// serde buffer the whole object before it knew what the event was).
    async fn send(&self, ty: &str, object: &Value) -> bool {
        let mut s = format!("{{\"type\":{},\"object\":{}}}", Value::from(ty), object);
        s.push('\n');
        self.meter.watch_line(ty);
        self.tx.send(Ok(Bytes::from(s))).await.is_ok()
    }
}

fn bookmark(rv: u64, initial_end: bool) -> Value {
    let mut meta = json!({"resourceVersion": rv.to_string()});
    if initial_end {
        meta["annotations"] = json!({"k8s.io/initial-events-end": "true"});
    }
    json!({"kind": "Pod", "apiVersion": "v1", "metadata": meta})
}

/// A stalled stream ([`crate::apiserver::Fault::StallWatches`]): nothing more is sent, and the
/// response stays open until the client goes or the test drops the watches.
async fn stall(shared: &Shared, tx: &Lines, drop_rx: &mut tokio::sync::watch::Receiver<u64>) {
    shared.fault_counters.stalled_watches.fetch_add(1, Ordering::SeqCst);
    tokio::select! {
        _ = drop_rx.changed() => {
            let _ = tx.tx.send(Err("watch dropped by the test".into())).await;
        }
        _ = tx.tx.closed() => {}
    }
}

/// The watch's initial events (those the client asked for) and, when asked, the bookmark that
/// ends them; or the ERROR event of a resource version too old. The version it starts from;
/// `None` when the stream is over.
async fn send_start(shared: &Shared, filter: &Filter, p: &WatchParams, tx: &Lines) -> Option<u64> {
    let start = lock(&shared.store).watch_start(filter, p.rv.as_deref(), p.send_initial);
    match start {
        Err(e) => {
            // The real server answers 200 and reports expiry as an ERROR event, then closes.
            let _ = tx.send("ERROR", &e.to_status()).await;
            None
        }
        Ok((initial, rv)) => {
            for obj in initial {
                if !tx.send("ADDED", &obj).await {
                    return None;
                }
            }
            if p.send_initial && !tx.send("BOOKMARK", &bookmark(rv, true)).await {
                return None;
            }
            Some(rv)
        }
    }
}

/// The events since `last_rv`, sent; the version they reach. `None` when the stream is over
/// (the client went, or the version expired: an ERROR event sent).
async fn send_drained(shared: &Shared, filter: &Filter, last_rv: u64, tx: &Lines) -> Option<u64> {
    let drained = lock(&shared.store).watch_drain(filter, last_rv);
    match drained {
        Err(e) => {
            let _ = tx.send("ERROR", &e.to_status()).await;
            None
        }
        Ok((events, rv)) => {
            for (ty, obj) in events {
                if !tx.send(ty.as_str(), &obj).await {
                    return None;
                }
            }
            Some(rv)
        }
    }
}

async fn run(shared: Arc<Shared>, filter: Filter, p: WatchParams, tx: Lines) {
    let mut rv_rx = shared.rv_tx.subscribe();
    let mut drop_rx = shared.drop_tx.subscribe();
    let mut stall_rx = shared.stall_tx.subscribe();
    drop_rx.borrow_and_update();
    rv_rx.borrow_and_update();
    if *stall_rx.borrow_and_update() {
        return stall(&shared, &tx, &mut drop_rx).await;
    }
    let Some(mut last_rv) = send_start(&shared, &filter, &p, &tx).await else { return };
    let deadline = p.timeout.map(|t| tokio::time::Instant::now() + t);
    let interval = shared.opts.bookmark_interval.max(Duration::from_millis(10));
    let mut ticker = tokio::time::interval_at(tokio::time::Instant::now() + interval, interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        rv_rx.borrow_and_update();
        let Some(rv) = send_drained(&shared, &filter, last_rv, &tx).await else { return };
        last_rv = rv;
        let timeout = async {
            match deadline {
                Some(d) => tokio::time::sleep_until(d).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            biased;
            _ = drop_rx.changed() => {
                // Abort mid-stream: hyper cuts the connection without the final chunk.
                let _ = tx.tx.send(Err("watch dropped by the test".into())).await;
                return;
            }
            _ = tx.tx.closed() => return,
            _ = stall_rx.changed() => {
                if *stall_rx.borrow_and_update() {
                    return stall(&shared, &tx, &mut drop_rx).await;
                }
            }
            _ = timeout => return,
            r = rv_rx.changed() => {
                if r.is_err() {
                    return;
                }
            }
            _ = ticker.tick(), if p.bookmarks => {
                if !tx.send("BOOKMARK", &bookmark(last_rv, false)).await {
                    return;
                }
            }
        }
    }
}
