//! What each client cost the server: requests, bytes and watch events per user agent, verb and
//! resource, and for each list whether a real server would serve it from its watch cache or read
//! it from etcd. Read by tests and the bench through [`super::FakeApiServer::traffic`], and over
//! HTTP at `/debug/counters` (a path of this server only, outside the real API's).

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use serde::Serialize;

use super::lock;

/// Where a real API server reads a list from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "camelCase")]
pub enum ListRead {
    /// Not a list (nor a watch that begins with one).
    NotAList,
    /// From the watch cache: `resourceVersion=0` (or any other RV without `Exact`), or a
    /// streaming list (a watch with `sendInitialEvents=true`).
    WatchCache,
    /// From etcd: no `resourceVersion` (a quorum read), `resourceVersionMatch=Exact`, or the
    /// next page of a paginated list (`continue`).
    Quorum,
}

impl ListRead {
    /// How the request of `verb` with `query` (its decoded parameters) is read.
    pub fn of(verb: &str, query: impl Fn(&str) -> Option<String>) -> ListRead {
        let set = |k: &str| query(k).filter(|v| !v.is_empty());
        match verb {
            "list" => {
                if set("continue").is_some()
                    || set("resourceVersionMatch").as_deref() == Some("Exact")
                    || set("resourceVersion").is_none()
                {
                    ListRead::Quorum
                } else {
                    ListRead::WatchCache
                }
            }
            "watch" if matches!(set("sendInitialEvents").as_deref(), Some("true" | "1")) => ListRead::WatchCache,
            _ => ListRead::NotAList,
        }
    }
}

/// One kind of request: who sent it, and what it asked for.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Flow {
    /// The product of the `User-Agent` header (`valet-agent` of `valet-agent/0.1.0`), empty when
    /// there was none. The simulated kubelet's writes, made in-process, are `kubelet`.
    pub user_agent: String,
    /// The Kubernetes verb (`get`, `list`, `watch`, `create`, `patch`, ...).
    pub verb: String,
    /// `pods`, `pods/status`, `events`, `events.k8s.io/events`, ...; empty for discovery.
    pub resource: String,
    pub read: ListRead,
}

/// What the requests of one [`Flow`] cost.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Cost {
    pub requests: u64,
    /// Request bodies (headers not counted).
    pub request_bytes: u64,
    /// Response bodies, a watch's lines included (headers not counted).
    pub response_bytes: u64,
    /// Watch events sent (ADDED, MODIFIED, DELETED, ERROR), a streaming list's included.
    pub watch_events: u64,
    /// Watch BOOKMARKs sent.
    pub bookmarks: u64,
}

impl Cost {
    fn add(&mut self, o: &Cost) {
        self.requests += o.requests;
        self.request_bytes += o.request_bytes;
        self.response_bytes += o.response_bytes;
        self.watch_events += o.watch_events;
        self.bookmarks += o.bookmarks;
    }

    fn minus(&self, o: &Cost) -> Cost {
        Cost {
            requests: self.requests.saturating_sub(o.requests),
            request_bytes: self.request_bytes.saturating_sub(o.request_bytes),
            response_bytes: self.response_bytes.saturating_sub(o.response_bytes),
            watch_events: self.watch_events.saturating_sub(o.watch_events),
            bookmarks: self.bookmarks.saturating_sub(o.bookmarks),
        }
    }
}

/// The live counters of one flow.
#[derive(Debug, Default)]
pub(crate) struct Meter {
    requests: AtomicU64,
    request_bytes: AtomicU64,
    response_bytes: AtomicU64,
    watch_events: AtomicU64,
    bookmarks: AtomicU64,
}

impl Meter {
    pub(crate) fn request(&self, body_bytes: usize) {
        self.requests.fetch_add(1, Ordering::Relaxed);
        self.request_bytes.fetch_add(body_bytes as u64, Ordering::Relaxed);
    }

    pub(crate) fn response(&self, bytes: usize) {
        self.response_bytes.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    /// One watch line of `ty` sent.
    pub(crate) fn watch_line(&self, ty: &str) {
        let counter = if ty == "BOOKMARK" { &self.bookmarks } else { &self.watch_events };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    fn cost(&self) -> Cost {
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        Cost {
            requests: load(&self.requests),
            request_bytes: load(&self.request_bytes),
            response_bytes: load(&self.response_bytes),
            watch_events: load(&self.watch_events),
            bookmarks: load(&self.bookmarks),
        }
    }
}

/// Every flow's meter.
#[derive(Debug, Default)]
pub(crate) struct Meters(std::sync::Mutex<BTreeMap<Flow, Arc<Meter>>>);

impl Meters {
    pub(crate) fn meter(&self, flow: Flow) -> Arc<Meter> {
        lock(&self.0).entry(flow).or_default().clone()
    }

    pub(crate) fn snapshot(&self) -> Traffic {
        Traffic(lock(&self.0).iter().map(|(f, m)| (f.clone(), m.cost())).collect())
    }
}

/// The counters at one moment, per flow.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Traffic(pub BTreeMap<Flow, Cost>);

impl Traffic {
    /// What was counted after `earlier` was taken.
    pub fn since(&self, earlier: &Traffic) -> Traffic {
        let zero = Cost::default();
        Traffic(
            self.0
                .iter()
                .map(|(f, c)| (f.clone(), c.minus(earlier.0.get(f).unwrap_or(&zero))))
                .filter(|(_, c)| *c != zero)
                .collect(),
        )
    }

    /// The sum of the flows `pick` selects.
    pub fn total(&self, pick: impl Fn(&Flow) -> bool) -> Cost {
        let mut sum = Cost::default();
        for (_, c) in self.0.iter().filter(|(f, _)| pick(f)) {
            sum.add(c);
        }
        sum
    }

    /// The flows as JSON objects (what `/debug/counters` answers).
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::Value::Array(
            self.0
                .iter()
                .map(|(f, c)| {
                    let mut v = serde_json::to_value(f).unwrap_or_default();
                    if let (Some(o), Ok(serde_json::Value::Object(cost))) = (v.as_object_mut(), serde_json::to_value(c))
                    {
                        o.extend(cost);
                    }
                    v
                })
                .collect(),
        )
    }
}

/// The product token of a `User-Agent` header: `valet-agent` of `valet-agent/0.1.0 (linux)`.
pub fn product(user_agent: &str) -> String {
    user_agent.split(['/', ' ']).next().unwrap_or_default().to_owned()
}

/// The resource a request path names: `pods`, `pods/status`, `events.k8s.io/events`; empty for
/// discovery and other paths outside the API's resources.
pub fn resource(path: &str) -> String {
    let segs: Vec<&str> = path.trim_matches('/').split('/').filter(|s| !s.is_empty()).collect();
    let (group, mut rest) = match segs.as_slice() {
        ["api", "v1", rest @ ..] => ("", rest),
        ["apis", group, _version, rest @ ..] => (*group, rest),
        _ => return String::new(),
    };
    if rest.first() == Some(&"watch") {
        rest = &rest[1..];
    }
    if rest.first() == Some(&"namespaces") && rest.len() > 2 {
        rest = &rest[2..];
    }
    let Some(name) = rest.first() else { return String::new() };
    let mut out = if group.is_empty() { (*name).to_owned() } else { format!("{group}/{name}") };
    if let Some(sub) = rest.get(2) {
        out = format!("{out}/{sub}");
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_name_their_resource() {
        for (path, want) in [
            ("/api/v1/pods", "pods"),
            ("/api/v1/namespaces/jobs/pods/p-1", "pods"),
            ("/api/v1/namespaces/jobs/pods/p-1/status", "pods/status"),
            ("/api/v1/watch/namespaces/jobs/pods", "pods"),
            ("/apis/events.k8s.io/v1/namespaces/jobs/events", "events.k8s.io/events"),
            ("/apis/apps/v1/namespaces/valet-system/daemonsets/valet", "apps/daemonsets"),
            ("/api/v1/namespaces/jobs", "namespaces"),
            ("/api/v1", ""),
            ("/apis", ""),
            ("/version", ""),
        ] {
            assert_eq!(resource(path), want, "{path}");
        }
    }

    #[test]
    fn lists_are_read_from_the_watch_cache_only_with_a_resource_version_and_no_exact_match() {
        let read = |verb: &str, q: &[(&str, &str)]| {
            let q: Vec<(String, String)> = q.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect();
            ListRead::of(verb, |k| q.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone()))
        };
        assert_eq!(read("list", &[]), ListRead::Quorum);
        assert_eq!(read("list", &[("resourceVersion", ""), ("limit", "500")]), ListRead::Quorum);
        assert_eq!(read("list", &[("resourceVersion", "0")]), ListRead::WatchCache);
        assert_eq!(
            read("list", &[("resourceVersion", "0"), ("resourceVersionMatch", "NotOlderThan")]),
            ListRead::WatchCache
        );
        assert_eq!(read("list", &[("resourceVersion", "12"), ("resourceVersionMatch", "Exact")]), ListRead::Quorum);
        assert_eq!(read("list", &[("resourceVersion", "12"), ("continue", "abc")]), ListRead::Quorum);
        assert_eq!(read("watch", &[("resourceVersion", "12")]), ListRead::NotAList);
        assert_eq!(read("watch", &[("sendInitialEvents", "true")]), ListRead::WatchCache);
        assert_eq!(read("patch", &[]), ListRead::NotAList);
    }

    #[test]
    fn a_later_snapshot_less_an_earlier_one_is_what_came_between() {
        let flow = |verb: &str| Flow {
            user_agent: "valet-agent".into(),
            verb: verb.into(),
            resource: "pods".into(),
            read: ListRead::NotAList,
        };
        let meters = Meters::default();
        meters.meter(flow("watch")).request(0);
        let before = meters.snapshot();
        let watch = meters.meter(flow("watch"));
        watch.watch_line("MODIFIED");
        watch.watch_line("BOOKMARK");
        watch.response(300);
        meters.meter(flow("patch")).request(120);
        let between = meters.snapshot().since(&before);
        assert_eq!(between.0.len(), 2, "{between:?}");
        let w = between.total(|f| f.verb == "watch");
        assert_eq!((w.requests, w.watch_events, w.bookmarks, w.response_bytes), (0, 1, 1, 300));
        let all = between.total(|_| true);
        assert_eq!((all.requests, all.request_bytes), (1, 120));
        let json = between.to_json();
        assert_eq!(json[0]["verb"], "patch");
        assert_eq!(json[0]["requestBytes"], 120);
        assert_eq!(json[1]["read"], "notAList");
    }
}
