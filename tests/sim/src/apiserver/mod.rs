//! A fake Kubernetes API server for Pods and Events (and reads of DaemonSets and Nodes) over plain HTTP/1.1, faithful to the wire
//! protocol kube-rs and client-go speak (lists, watches with bookmarks and 410 expiry, the four
//! PATCH flavours, Status errors), plus a synchronous test-control API.
//!
//! The server runs on its own thread with its own tokio runtime, so tests can drive it from
//! plain `#[test]`s and from any async runtime alike.

mod http;
pub mod patch;
pub mod selector;
pub mod status;
pub mod store;
pub mod traffic;
mod watch;

use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, anyhow};
use serde_json::Value;

pub use patch::{PatchKind, Schema};
pub use selector::{FieldSelector, LabelSelector};
pub use status::ApiError;
pub use store::{ChangeType, EventGroup, Filter, Kind, ListParams, Propagation, Subresource};
pub use traffic::{Cost, Flow, ListRead, Traffic};

use store::Store;

/// Knobs of a [`FakeApiServer`].
#[derive(Debug, Clone)]
pub struct ServerOptions {
    /// How often a watch with `allowWatchBookmarks=true` gets a BOOKMARK (real servers: ~1 min).
    pub bookmark_interval: Duration,
    /// How many pod changes the watch history keeps; older RVs become "too old".
    pub history_limit: usize,
    /// Deviation from the real server (which treats the list as atomic): merge
    /// `status.containerStatuses` by `name` in strategic merge patches.
    pub container_statuses_merge_by_name: bool,
    /// Worker threads of the server's runtime.
    pub worker_threads: usize,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            bookmark_interval: Duration::from_secs(1),
            history_limit: 10_000,
            container_statuses_merge_by_name: false,
            worker_threads: 2,
        }
    }
}

/// One request as the server received it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RecordedRequest {
    pub method: String,
    pub path: String,
    /// The raw query string (without `?`), percent-encoded as sent.
    pub query: String,
    pub content_type: Option<String>,
    /// The body as text (lossy UTF-8).
    pub body: String,
}

impl RecordedRequest {
    /// The decoded value of a query parameter.
    pub fn query_param(&self, name: &str) -> Option<String> {
        form_urlencoded::parse(self.query.as_bytes()).find(|(k, _)| k == name).map(|(_, v)| v.into_owned())
    }

    /// Whether this was a watch request.
    pub fn is_watch(&self) -> bool {
        matches!(self.query_param("watch").as_deref(), Some("true" | "1")) || self.path.starts_with("/api/v1/watch/")
    }

    /// The body parsed as JSON, if it is JSON.
    pub fn json(&self) -> Option<Value> {
        serde_json::from_str(&self.body).ok()
    }
}

/// A failure of the API server that a test turns on with [`FakeApiServer::set_fault`] and off with
/// [`FakeApiServer::clear_faults`]. Faults of different kinds can be on at once.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fault {
    /// Requests whose Kubernetes verb (`get`, `list`, `watch`, `create`, `update`, `patch`,
    /// `delete`) is in `verbs` (empty: every verb) are refused with a `Status` of `code`, as the
    /// real server words it (500 `InternalError`, 429 `TooManyRequests` with `Retry-After: 1`
    /// as API Priority and Fairness sends it, 503, 504), until `until` (None: until cleared).
    /// Watches already open are not cut (see [`FakeApiServer::drop_watches`]).
    Status { code: u16, verbs: Vec<&'static str>, until: Option<Instant> },
    /// Every open watch stops sending (no events, no bookmarks) and keeps its chunked response
    /// open, ignoring its `timeoutSeconds`; watches started while this is on do the same from
    /// their first line. A stalled stream stays silent for good, like a dead connection, also
    /// after the fault is cleared: only watches started afterwards flow.
    StallWatches,
    /// PATCH requests are read and never answered: each stays open until its client gives up.
    HangPatches,
    /// GET requests (gets, lists, the start of watches) are read and never answered, not even a
    /// status line: each stays open until its client gives up. Watches already open go on.
    HangReads,
}

/// What the faults did, and the write concurrency the server saw.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FaultStats {
    /// Requests answered with a [`Fault::Status`].
    pub refused: u64,
    /// Requests left unanswered ([`Fault::HangPatches`], [`Fault::HangReads`]).
    pub hung: u64,
    /// Watch streams that stalled ([`Fault::StallWatches`]).
    pub stalled_watches: u64,
    /// PATCHes in flight now: received, not answered, their connection still open.
    pub patches_in_flight: u64,
    /// The most PATCHes in flight at once since the server started, a request given up by its
    /// client counted as ended [`GIVE_UP_SLACK`] before the server saw its connection close.
    pub peak_patches_in_flight: u64,
    /// The same for all writes (POST, PUT, PATCH, DELETE).
    pub peak_writes_in_flight: u64,
    /// The most writes whose connection was open at once, without that slack.
    pub peak_writes_open: u64,
}

/// How much earlier than the server saw its connection close a client is taken to have given up
/// on a request. A client that keeps N requests in flight frees a slot when it gives up on one,
/// and may send the next on another connection a moment before it closes the one it gave up on
/// (and the server notices the close a moment later still): the server would see N + 1 open for
/// that moment. A client over its bound keeps the extra one open for as long as it waits.
pub const GIVE_UP_SLACK: Duration = Duration::from_millis(250);

/// One write the server received: when, and when it was answered or given up by its client.
#[derive(Debug, Clone, Copy)]
pub(crate) struct WriteSpan {
    pub patch: bool,
    pub start: Instant,
    /// (when, given up by the client)
    pub end: Option<(Instant, bool)>,
}

/// The most of `spans` (PATCHes only, or all) in flight at once; see [`GIVE_UP_SLACK`].
fn peak_in_flight(spans: &[WriteSpan], patches_only: bool) -> u64 {
    let mut edges: Vec<(Instant, i8)> = Vec::new();
    for s in spans.iter().filter(|s| s.patch || !patches_only) {
        edges.push((s.start, 1));
        if let Some((end, given_up)) = s.end {
            let end = if given_up { end.checked_sub(GIVE_UP_SLACK).unwrap_or(s.start).max(s.start) } else { end };
            edges.push((end, -1));
        }
    }
    // At the same instant an end comes before a start.
    edges.sort();
    let (mut now, mut peak) = (0i64, 0i64);
    for (_, d) in edges {
        now += i64::from(d);
        peak = peak.max(now);
    }
    u64::try_from(peak).unwrap_or(0)
}

/// The faults that are on.
#[derive(Debug, Default)]
pub(crate) struct Faults {
    /// (code, verbs, until) of a [`Fault::Status`].
    pub status: Option<(u16, Vec<&'static str>, Option<Instant>)>,
    pub hang_patches: bool,
    pub hang_reads: bool,
}

impl Faults {
    /// The code to refuse a request of `verb` with now, if any; an expired fault is forgotten.
    pub(crate) fn refusal(&mut self, verb: &str) -> Option<u16> {
        let (code, verbs, until) = self.status.as_ref()?;
        if until.is_some_and(|u| Instant::now() >= u) {
            self.status = None;
            return None;
        }
        (verbs.is_empty() || verbs.contains(&verb)).then_some(*code)
    }
}

/// Counters of [`FaultStats`].
#[derive(Debug, Default)]
pub(crate) struct FaultCounters {
    pub refused: AtomicU64,
    pub hung: AtomicU64,
    pub stalled_watches: AtomicU64,
    pub patches: AtomicU64,
    pub writes: AtomicU64,
    pub peak_writes_open: AtomicU64,
    pub spans: Mutex<Vec<WriteSpan>>,
}

/// State shared between the control API and the server tasks.
pub(crate) struct Shared {
    pub store: Mutex<Store>,
    /// Latest RV, so watch tasks wake up on changes.
    pub rv_tx: tokio::sync::watch::Sender<u64>,
    /// Bumped by `drop_watches`.
    pub drop_tx: tokio::sync::watch::Sender<u64>,
    pub requests: Mutex<Vec<RecordedRequest>>,
    /// (remaining, code) of injected failures.
    pub fail: Mutex<(u32, u16)>,
    pub faults: Mutex<Faults>,
    /// Whether watches stall ([`Fault::StallWatches`]); open streams learn it here.
    pub stall_tx: tokio::sync::watch::Sender<bool>,
    pub fault_counters: FaultCounters,
    /// What each client's requests cost ([`FakeApiServer::traffic`]).
    pub traffic: traffic::Meters,
    pub watch_count: AtomicU64,
    pub opts: ServerOptions,
    pub addr: SocketAddr,
}

/// Locks ignoring poisoning: a panicking test must not wedge the server for the others.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Shared {
    /// Runs `f` on the store and wakes the watches if the RV moved.
    pub(crate) fn mutate<T>(&self, f: impl FnOnce(&mut Store) -> T) -> T {
        let (out, rv) = {
            let mut st = lock(&self.store);
            let out = f(&mut st);
            (out, st.rv)
        };
        self.rv_tx.send_if_modified(|cur| {
            let changed = *cur != rv;
            *cur = rv;
            changed
        });
        out
    }
}

/// The fake API server. Dropping it shuts it down.
pub struct FakeApiServer {
    shared: Arc<Shared>,
    shutdown_tx: tokio::sync::watch::Sender<bool>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl FakeApiServer {
    /// Starts a server with default options on 127.0.0.1 and a free port.
    pub fn start() -> Result<FakeApiServer> {
        FakeApiServer::start_with(ServerOptions::default())
    }

    /// Starts a server with the given options.
    pub fn start_with(opts: ServerOptions) -> Result<FakeApiServer> {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").context("bind 127.0.0.1:0")?;
        listener.set_nonblocking(true).context("nonblocking listener")?;
        let addr = listener.local_addr()?;
        let schema = Schema { container_statuses_by_name: opts.container_statuses_merge_by_name, ..Schema::pod() };
        let shared = Arc::new(Shared {
            store: Mutex::new(Store::new(opts.history_limit, schema)),
            rv_tx: tokio::sync::watch::Sender::new(1),
            drop_tx: tokio::sync::watch::Sender::new(0),
            requests: Mutex::new(Vec::new()),
            fail: Mutex::new((0, 0)),
            faults: Mutex::new(Faults::default()),
            stall_tx: tokio::sync::watch::Sender::new(false),
            fault_counters: FaultCounters::default(),
            traffic: traffic::Meters::default(),
            watch_count: AtomicU64::new(0),
            opts: opts.clone(),
            addr,
        });
        let (shutdown_tx, shutdown_rx) = tokio::sync::watch::channel(false);
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(opts.worker_threads.max(1))
            .thread_name("fake-apiserver")
            .enable_all()
            .build()
            .context("build the server runtime")?;
        let srv = shared.clone();
        let thread = std::thread::Builder::new()
            .name("fake-apiserver".into())
            .spawn(move || {
                rt.block_on(http::serve(srv, listener, shutdown_rx));
                // Dropping the runtime aborts open connections and watch tasks.
                rt.shutdown_timeout(Duration::from_millis(200));
            })
            .context("spawn the server thread")?;
        Ok(FakeApiServer { shared, shutdown_tx, thread: Mutex::new(Some(thread)) })
    }

    /// `http://127.0.0.1:<port>`
    pub fn url(&self) -> String {
        format!("http://{}", self.shared.addr)
    }

    pub fn addr(&self) -> SocketAddr {
        self.shared.addr
    }

    /// Writes a kubeconfig whose current context points at this server (plain HTTP, no credentials).
    pub fn write_kubeconfig(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let text = format!(
            "apiVersion: v1\n\
             kind: Config\n\
             clusters:\n\
             - name: valet-sim\n  cluster:\n    server: {url}\n    insecure-skip-tls-verify: true\n\
             users:\n\
             - name: valet-sim\n  user: {{}}\n\
             contexts:\n\
             - name: valet-sim\n  context:\n    cluster: valet-sim\n    user: valet-sim\n    namespace: default\n\
             current-context: valet-sim\n\
             preferences: {{}}\n",
            url = self.url()
        );
        std::fs::write(path, text).with_context(|| format!("write kubeconfig {}", path.display()))
    }

    /// The current global resourceVersion.
    pub fn resource_version(&self) -> u64 {
        lock(&self.shared.store).rv
    }

    /// Stores a pod as the kubelet/scheduler would have it (status kept). Fills uid,
    /// creationTimestamp, resourceVersion, namespace ("default") and spec defaults.
    pub fn create_pod(&self, pod: Value) -> Result<Value> {
        self.handle().create_pod(pod)
    }

    /// Changes a pod in place (any field, like the kubelet writing status); one MODIFIED event.
    pub fn modify_pod(&self, namespace: &str, name: &str, f: impl FnOnce(&mut Value)) -> Result<Value> {
        self.shared
            .mutate(|st| {
                let mut pod = st.get_pod(namespace, name).ok_or_else(|| ApiError::not_found("pods", name))?;
                f(&mut pod);
                st.update_pod(namespace, name, pod, Subresource::Control, None)
            })
            .map_err(|e| anyhow!(e))
    }

    /// Starts a pod's graceful deletion, as `kubectl delete pod` or a controller does: the pod
    /// gets its `deletionTimestamp` (`grace` seconds on; the pod's own grace period when None)
    /// and stays until removed ([`FakeApiServer::delete_pod`], the kubelet's final delete).
    pub fn begin_pod_deletion(&self, namespace: &str, name: &str, grace: Option<i64>) -> Result<Value> {
        self.shared.mutate(|st| st.delete_pod(namespace, name, grace, None, None)).map_err(|e| anyhow!(e))
    }

    /// Creates or replaces a DaemonSet or Node ([`store::Store::put_object`]).
    pub fn put_object(&self, kind: Kind, object: Value) -> Result<Value> {
        self.shared.mutate(|st| st.put_object(kind, object)).map_err(|e| anyhow!(e))
    }

    /// Deletes a DaemonSet or Node: gone at once (`Background`), or kept with a
    /// `deletionTimestamp` while its dependents go (`Foreground`).
    pub fn delete_object(
        &self,
        kind: Kind,
        namespace: Option<&str>,
        name: &str,
        propagation: Propagation,
    ) -> Result<Value> {
        self.shared.mutate(|st| st.delete_object(kind, namespace, name, propagation)).map_err(|e| anyhow!(e))
    }

    pub fn get_object(&self, kind: Kind, namespace: Option<&str>, name: &str) -> Option<Value> {
        lock(&self.shared.store).get_object(kind, namespace, name).ok()
    }

    /// Removes a pod at once (DELETED event), like the kubelet's final delete.
    pub fn delete_pod(&self, namespace: &str, name: &str) -> Result<Value> {
        self.shared.mutate(|st| st.remove_pod(namespace, name)).map_err(|e| anyhow!(e))
    }

    pub fn get_pod(&self, namespace: &str, name: &str) -> Option<Value> {
        lock(&self.shared.store).get_pod(namespace, name)
    }

    /// All pods, ordered by namespace/name.
    pub fn pods(&self) -> Vec<Value> {
        lock(&self.shared.store).pods()
    }

    /// All events, core/v1 first then events.k8s.io/v1.
    pub fn events(&self) -> Vec<Value> {
        lock(&self.shared.store).events()
    }

    /// Every request received so far, in order.
    pub fn requests(&self) -> Vec<RecordedRequest> {
        lock(&self.shared.requests).clone()
    }

    pub fn clear_requests(&self) {
        lock(&self.shared.requests).clear();
    }

    /// Abruptly ends every open watch stream (connection aborted mid-stream).
    pub fn drop_watches(&self) {
        self.shared.drop_tx.send_modify(|g| *g += 1);
    }

    /// Forgets the change history: watches (and continue tokens, exact lists) resuming from any
    /// RV handed out so far get 410 Expired. Open, caught-up watches keep going.
    pub fn expire_history(&self) {
        self.shared.mutate(Store::expire_history);
    }

    /// The next `n` requests (of any kind) fail with `status_code` and a Status body.
    pub fn fail_next(&self, n: u32, status_code: u16) {
        *lock(&self.shared.fail) = (n, status_code);
    }

    /// Turns a fault on (a [`Fault::Status`] replaces the one before).
    pub fn set_fault(&self, fault: Fault) {
        match fault {
            Fault::Status { code, verbs, until } => lock(&self.shared.faults).status = Some((code, verbs, until)),
            Fault::StallWatches => {
                self.shared.stall_tx.send_replace(true);
            }
            Fault::HangPatches => lock(&self.shared.faults).hang_patches = true,
            Fault::HangReads => lock(&self.shared.faults).hang_reads = true,
        }
    }

    /// Turns every fault off. Requests already hung stay hung and streams already stalled stay
    /// silent (their clients have to give up on them); new requests are served.
    pub fn clear_faults(&self) {
        *lock(&self.shared.faults) = Faults::default();
        self.shared.stall_tx.send_replace(false);
    }

    /// What the faults did so far, and the peaks of writes in flight.
    pub fn fault_stats(&self) -> FaultStats {
        let c = &self.shared.fault_counters;
        let load = |a: &AtomicU64| a.load(Ordering::SeqCst);
        let spans = lock(&c.spans).clone();
        FaultStats {
            refused: load(&c.refused),
            hung: load(&c.hung),
            stalled_watches: load(&c.stalled_watches),
            patches_in_flight: load(&c.patches),
            peak_patches_in_flight: peak_in_flight(&spans, true),
            peak_writes_in_flight: peak_in_flight(&spans, false),
            peak_writes_open: load(&c.peak_writes_open),
        }
    }

    /// What the requests so far cost, per user agent, verb and resource (also served at
    /// `/debug/counters`). Test-control calls are not counted, except the writes of a
    /// [`FakeApiServer::kubelet_handle`].
    pub fn traffic(&self) -> Traffic {
        self.shared.traffic.snapshot()
    }

    /// How many watch streams were started.
    pub fn watch_count(&self) -> u64 {
        self.shared.watch_count.load(Ordering::SeqCst)
    }

    /// Stops the server (idempotent); open connections are cut.
    pub fn shutdown(&self) {
        self.shutdown_tx.send_replace(true);
        if let Some(t) = lock(&self.thread).take() {
            let _ = t.join();
        }
    }
}

/// A cloneable handle on a [`FakeApiServer`]'s pods, for writers on other threads (the
/// simulated kubelet). It does not keep the server running.
#[derive(Clone)]
pub struct ApiHandle {
    shared: Arc<Shared>,
    /// Counts each [`ApiHandle::modify_pod`] as the kubelet's status sync of the pod.
    kubelet: bool,
}

impl ApiHandle {
    /// See [`FakeApiServer::create_pod`].
    pub fn create_pod(&self, pod: Value) -> Result<Value> {
        // Its managedFields as the Job controller's, which creates a Job's pods.
        let writer = store::Writer::from_user_agent("kube-controller-manager/v1.33.0", false);
        self.shared.mutate(|st| st.as_writer(writer).create_pod(None, pod, false)).map_err(|e| anyhow!(e))
    }
    /// See [`FakeApiServer::modify_pod`]. From a [`FakeApiServer::kubelet_handle`], counted as
    /// the kubelet's status manager syncs a pod: a `get` of the pod, then a `patch` of
    /// `pods/status` carrying the status fields that changed.
    pub fn modify_pod(&self, namespace: &str, name: &str, f: impl FnOnce(&mut Value)) -> Result<Value> {
        let (pod, before) = self
            .shared
            .mutate(|st| {
                let mut pod = st.get_pod(namespace, name).ok_or_else(|| ApiError::not_found("pods", name))?;
                let before = self.kubelet.then(|| pod.clone());
                f(&mut pod);
                let writer = match self.kubelet {
                    true => store::Writer::from_user_agent("kubelet/v1.33.0", true),
                    false => store::Writer::control(),
                };
                st.as_writer(writer).update_pod(namespace, name, pod, Subresource::Control, None).map(|p| (p, before))
            })
            .map_err(|e| anyhow!(e))?;
        if let Some(before) = before {
            self.count_status_sync(&before, &pod);
        }
        Ok(pod)
    }

    /// The kubelet's GET and status PATCH of a pod that went from `before` to `after`.
    fn count_status_sync(&self, before: &Value, after: &Value) {
        let flow = |verb: &str, resource: &str| Flow {
            user_agent: "kubelet".into(),
            verb: verb.into(),
            resource: resource.into(),
            read: ListRead::NotAList,
        };
        let pod_bytes = |p: &Value| p.to_string().len();
        let get = self.shared.traffic.meter(flow("get", "pods"));
        get.request(0);
        get.response(pod_bytes(before));
        let mut changed = serde_json::Map::new();
        let (old, new) = (&before["status"], &after["status"]);
        for (k, v) in new.as_object().into_iter().flatten() {
            if old.get(k) != Some(v) {
                changed.insert(k.clone(), v.clone());
            }
        }
        for k in old.as_object().into_iter().flatten().map(|(k, _)| k) {
            if new.get(k).is_none() {
                changed.insert(k.clone(), Value::Null);
            }
        }
        let patch = serde_json::json!({"metadata": {"uid": after["metadata"]["uid"]}, "status": changed});
        let write = self.shared.traffic.meter(flow("patch", "pods/status"));
        write.request(patch.to_string().len());
        write.response(pod_bytes(after));
    }

    pub fn get_pod(&self, namespace: &str, name: &str) -> Option<Value> {
        lock(&self.shared.store).get_pod(namespace, name)
    }
}

impl FakeApiServer {
    /// A cloneable handle for other threads.
    pub fn handle(&self) -> ApiHandle {
        ApiHandle { shared: self.shared.clone(), kubelet: false }
    }

    /// A handle for the simulated kubelet: its pod writes are counted in [`FakeApiServer::traffic`]
    /// as the real kubelet's status syncs (user agent `kubelet`).
    pub fn kubelet_handle(&self) -> ApiHandle {
        ApiHandle { shared: self.shared.clone(), kubelet: true }
    }
}

impl Drop for FakeApiServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_write_given_up_is_counted_as_ended_a_moment_before_its_close_was_seen() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let span = |start, end: Option<(u64, bool)>| WriteSpan {
            patch: true,
            start: at(start),
            end: end.map(|(e, given_up)| (at(e), given_up)),
        };
        // Four hung for 10 s; the first is given up at 10 s and the next is read 1 ms before the
        // server saw that close: still four.
        let mut spans: Vec<WriteSpan> = (0..4).map(|i| span(i, Some((10_000 + i, true)))).collect();
        spans.push(span(9_999, None));
        assert_eq!(peak_in_flight(&spans, true), 4);
        // An answered write ends when it is answered: a fifth read before the answers is five.
        for (i, s) in spans.iter_mut().take(4).enumerate() {
            *s = span(i as u64, Some((10_000 + i as u64, false)));
        }
        assert_eq!(peak_in_flight(&spans, true), 5);
        // A fifth that stays open while the four wait is five.
        let mut over: Vec<WriteSpan> = (0..5).map(|i| span(i, Some((10_000 + i, true)))).collect();
        assert_eq!(peak_in_flight(&over, true), 5);
        // POSTs count in the writes, not the PATCHes.
        over[4].patch = false;
        assert_eq!((peak_in_flight(&over, true), peak_in_flight(&over, false)), (4, 5));
    }
}
