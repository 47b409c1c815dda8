//! HTTP plumbing and routing of the fake API server.

use std::collections::HashMap;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};
use std::time::Instant;

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full, combinators::BoxBody};
use hyper::body::{Frame, Incoming};
use hyper::server::conn::http1;
use hyper::service::service_fn;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};

use super::patch::PatchKind;
use super::selector::{FieldKind, FieldSelector, LabelSelector};
use super::status::ApiError;
use super::store::{EventGroup, Filter, Kind, ListParams, Subresource, Writer};
use super::traffic::{self, Flow, ListRead, Meter};
use super::{RecordedRequest, Shared, WriteSpan, lock, watch};

pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;
pub(crate) type Body = BoxBody<Bytes, BoxError>;

/// A response body fed by a channel (watch streams); an `Err` item aborts the connection.
pub(crate) struct ChannelBody(pub tokio::sync::mpsc::Receiver<Result<Bytes, BoxError>>);

impl hyper::body::Body for ChannelBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        self.0.poll_recv(cx).map(|o| o.map(|r| r.map(Frame::data)))
    }
}

/// A response body whose bytes are counted to its flow as they are sent.
struct CountedBody {
    inner: Body,
    meter: Arc<Meter>,
}

impl hyper::body::Body for CountedBody {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(Some(Ok(frame))) = &polled
            && let Some(data) = frame.data_ref()
        {
            self.meter.response(data.len());
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

pub(crate) async fn serve(
    shared: Arc<Shared>,
    listener: std::net::TcpListener,
    mut shutdown: tokio::sync::watch::Receiver<bool>,
) {
    let listener = match tokio::net::TcpListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => {
            tracing::error!("fake apiserver: cannot use listener: {e}");
            return;
        }
    };
    loop {
        tokio::select! {
            _ = shutdown.changed() => break,
            acc = listener.accept() => {
                let Ok((stream, _)) = acc else {
                    // EMFILE and friends: back off instead of spinning.
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                    continue;
                };
                let _ = stream.set_nodelay(true);
                let shared = shared.clone();
                tokio::spawn(async move {
                    let svc = service_fn(move |req| handle(shared.clone(), req));
                    let _ = http1::Builder::new().serve_connection(TokioIo::new(stream), svc).await;
                });
            }
        }
    }
}

pub(crate) fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into()).map_err(|never: Infallible| match never {}).boxed()
}

fn json_response(code: u16, v: &Value) -> Response<Body> {
    let mut resp = Response::new(full(v.to_string()));
    *resp.status_mut() = StatusCode::from_u16(code).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    resp.headers_mut().insert(hyper::header::CONTENT_TYPE, hyper::header::HeaderValue::from_static("application/json"));
    resp
}

pub(crate) fn error_response(e: &ApiError) -> Response<Body> {
    json_response(e.code, &e.to_status())
}

fn text_response(code: u16, text: &'static str) -> Response<Body> {
    let mut resp = Response::new(full(text));
    *resp.status_mut() = StatusCode::from_u16(code).unwrap_or(StatusCode::OK);
    resp.headers_mut()
        .insert(hyper::header::CONTENT_TYPE, hyper::header::HeaderValue::from_static("text/plain; charset=utf-8"));
    resp
}

/// A parsed request, handed to the route handlers.
pub(crate) struct Req {
    pub method: Method,
    /// The counters of this request's flow (a watch counts its lines there).
    pub meter: Arc<Meter>,
    pub query: HashMap<String, String>,
    pub content_type: String,
    pub body: Bytes,
    /// Who writes, for the pods' managedFields (with the `fieldManager` asked for).
    pub user_agent: String,
}

impl Req {
    fn q(&self, k: &str) -> Option<&str> {
        self.query.get(k).map(String::as_str)
    }
    fn flag(&self, k: &str) -> bool {
        matches!(self.q(k), Some("true" | "1"))
    }
    fn json_body(&self) -> Result<Value, ApiError> {
        serde_json::from_slice(&self.body)
            .map_err(|e| ApiError::bad_request(format!("the body of the request could not be decoded: {e}")))
    }
}

async fn handle(shared: Arc<Shared>, req: Request<Incoming>) -> Result<Response<Body>, Infallible> {
    // A write is counted in flight from when it was read until it is answered, or until its
    // client gives up on it (hyper drops this future when the connection closes under it).
    let mut in_flight = None;
    let response = answer(&shared, req, &mut in_flight).await;
    if let Some(write) = in_flight.as_mut() {
        write.answered = true;
    }
    response
}

async fn answer(
    shared: &Arc<Shared>,
    req: Request<Incoming>,
    in_flight: &mut Option<InFlight>,
) -> Result<Response<Body>, Infallible> {
    let (parts, body) = req.into_parts();
    let body = match body.collect().await {
        Ok(b) => b.to_bytes(),
        Err(_) => Bytes::new(),
    };
    let path = parts.uri.path().to_string();
    let raw_query = parts.uri.query().unwrap_or("").to_string();
    if path == "/debug/counters" {
        return Ok(json_response(200, &shared.traffic.snapshot().to_json()));
    }
    let content_type = parts.headers.get(hyper::header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).map(str::to_string);
    *in_flight = InFlight::start(shared, &parts.method);
    let recorded = RecordedRequest {
        method: parts.method.to_string(),
        path: path.clone(),
        query: raw_query.clone(),
        content_type: content_type.clone(),
        body: String::from_utf8_lossy(&body).into_owned(),
    };
    let verb = verb(&parts.method, &path, recorded.is_watch());
    let user_agent = parts.headers.get(hyper::header::USER_AGENT).and_then(|v| v.to_str().ok()).unwrap_or_default();
    let meter = shared.traffic.meter(Flow {
        user_agent: traffic::product(user_agent),
        verb: verb.to_owned(),
        resource: traffic::resource(&path),
        read: ListRead::of(verb, |k| recorded.query_param(k)),
    });
    meter.request(body.len());
    lock(&shared.requests).push(recorded);
    let ua = (content_type, user_agent.to_owned());
    let response = respond(shared, parts.method, &path, &raw_query, ua, body, verb, meter.clone()).await;
    Ok(response.map(|inner| CountedBody { inner, meter }.boxed()))
}

/// The answer to a request, faults first.
#[allow(clippy::too_many_arguments, reason = "each is one part of the request as the server read it")]
async fn respond(
    shared: &Arc<Shared>,
    method: Method,
    path: &str,
    raw_query: &str,
    (content_type, user_agent): (Option<String>, String),
    body: Bytes,
    verb: &'static str,
    meter: Arc<Meter>,
) -> Response<Body> {
    {
        let mut fail = lock(&shared.fail);
        if fail.0 > 0 {
            fail.0 -= 1;
            return error_response(&ApiError::injected(fail.1));
        }
    }
    let (refusal, hang) = {
        let mut faults = lock(&shared.faults);
        let hang = match method {
            Method::PATCH => faults.hang_patches,
            Method::GET => faults.hang_reads,
            _ => false,
        };
        (faults.refusal(verb), hang)
    };
    if let Some(code) = refusal {
        shared.fault_counters.refused.fetch_add(1, Ordering::SeqCst);
        let mut resp = error_response(&ApiError::fault(code));
        if code == 429 {
            resp.headers_mut().insert(hyper::header::RETRY_AFTER, hyper::header::HeaderValue::from_static("1"));
        }
        return resp;
    }
    if hang {
        shared.fault_counters.hung.fetch_add(1, Ordering::SeqCst);
        return std::future::pending().await;
    }
    let query: HashMap<String, String> = form_urlencoded::parse(raw_query.as_bytes()).into_owned().collect();
    let r = Req { method, meter, query, content_type: content_type.unwrap_or_default(), body, user_agent };
    route(shared, path, r).unwrap_or_else(|e| error_response(&e))
}

/// The Kubernetes verb of a request, as RBAC and API Priority and Fairness name it.
fn verb(method: &Method, path: &str, watch: bool) -> &'static str {
    match *method {
        Method::GET if watch => "watch",
        Method::GET
            if matches!(
                path.trim_end_matches('/').rsplit('/').next(),
                Some("pods" | "events" | "daemonsets" | "nodes" | "runtimeclasses")
            ) =>
        {
            "list"
        }
        Method::GET => "get",
        Method::POST => "create",
        Method::PUT => "update",
        Method::PATCH => "patch",
        Method::DELETE => "delete",
        _ => "",
    }
}

/// A write the server holds, counted in flight while it lives.
struct InFlight {
    shared: Arc<Shared>,
    span: usize,
    patch: bool,
    /// Answered (else its client gave up on it).
    answered: bool,
}

impl InFlight {
    /// Starts counting a write; None for reads.
    fn start(shared: &Arc<Shared>, method: &Method) -> Option<InFlight> {
        let patch = *method == Method::PATCH;
        if !patch && !matches!(*method, Method::POST | Method::PUT | Method::DELETE) {
            return None;
        }
        let c = &shared.fault_counters;
        let open = c.writes.fetch_add(1, Ordering::SeqCst) + 1;
        c.peak_writes_open.fetch_max(open, Ordering::SeqCst);
        if patch {
            c.patches.fetch_add(1, Ordering::SeqCst);
        }
        let mut spans = lock(&c.spans);
        spans.push(WriteSpan { patch, start: Instant::now(), end: None });
        Some(InFlight { shared: shared.clone(), span: spans.len() - 1, patch, answered: false })
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let c = &self.shared.fault_counters;
        if let Some(span) = lock(&c.spans).get_mut(self.span) {
            span.end = Some((Instant::now(), !self.answered));
        }
        c.writes.fetch_sub(1, Ordering::SeqCst);
        if self.patch {
            c.patches.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

// table: the server's routes, one arm a path (discovery, then each resource's collection and item)
/// The answer to a request for `path`: its route's, or a 404 when none matches.
fn route(shared: &Arc<Shared>, path: &str, r: Req) -> Result<Response<Body>, ApiError> {
    let segs: Vec<&str> = path.trim_matches('/').split('/').filter(|s| !s.is_empty()).collect();
    let get_only = |r: &Req| {
        if r.method == Method::GET { Ok(()) } else { Err(ApiError::method_not_allowed()) }
    };
    match segs.as_slice() {
        ["version"] => {
            get_only(&r)?;
            Ok(json_response(200, &version()))
        }
        ["healthz"] | ["livez"] | ["readyz"] => Ok(text_response(200, "ok")),
        ["api"] => {
            get_only(&r)?;
            Ok(json_response(
                200,
                &json!({"kind": "APIVersions", "versions": ["v1"],
                        "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": shared.addr.to_string()}]}),
            ))
        }
        ["api", "v1"] => {
            get_only(&r)?;
            Ok(json_response(200, &core_resources()))
        }
        ["apis"] => {
            get_only(&r)?;
            Ok(json_response(
                200,
                &json!({"kind": "APIGroupList", "apiVersion": "v1", "groups": [apps_group(), events_group()]}),
            ))
        }
        ["apis", "apps"] => {
            get_only(&r)?;
            let mut g = apps_group();
            if let Some(m) = g.as_object_mut() {
                m.insert("kind".into(), json!("APIGroup"));
                m.insert("apiVersion".into(), json!("v1"));
            }
            Ok(json_response(200, &g))
        }
        ["apis", "apps", "v1"] => {
            get_only(&r)?;
            Ok(json_response(200, &apps_resources()))
        }
        // DaemonSets and Nodes: read (get, list) over the API; written by test control.
        ["apis", "apps", "v1", "daemonsets"] => objects_collection(shared, Kind::DaemonSet, None, &r),
        ["apis", "apps", "v1", "namespaces", ns, "daemonsets"] => {
            objects_collection(shared, Kind::DaemonSet, Some(ns), &r)
        }
        ["apis", "apps", "v1", "namespaces", ns, "daemonsets", name] => {
            object_item(shared, Kind::DaemonSet, Some(ns), name, &r)
        }
        ["api", "v1", "nodes"] => objects_collection(shared, Kind::Node, None, &r),
        ["apis", "node.k8s.io", "v1", "runtimeclasses"] => objects_collection(shared, Kind::RuntimeClass, None, &r),
        ["apis", "node.k8s.io", "v1", "runtimeclasses", name] => {
            object_item(shared, Kind::RuntimeClass, None, name, &r)
        }
        ["api", "v1", "nodes", name] => object_item(shared, Kind::Node, None, name, &r),
        ["apis", "events.k8s.io"] => {
            get_only(&r)?;
            let mut g = events_group();
            if let Some(m) = g.as_object_mut() {
                m.insert("kind".into(), json!("APIGroup"));
                m.insert("apiVersion".into(), json!("v1"));
            }
            Ok(json_response(200, &g))
        }
        ["apis", "events.k8s.io", "v1"] => {
            get_only(&r)?;
            Ok(json_response(200, &events_resources()))
        }
        // pods
        ["api", "v1", "pods"] => pods_collection(shared, None, r, false),
        ["api", "v1", "namespaces", ns, "pods"] => pods_collection(shared, Some(ns), r, false),
        ["api", "v1", "watch", "pods"] => pods_collection(shared, None, r, true),
        ["api", "v1", "watch", "namespaces", ns, "pods"] => pods_collection(shared, Some(ns), r, true),
        ["api", "v1", "watch", "namespaces", ns, "pods", name] => {
            let mut r = r;
            let sel = match r.q("fieldSelector").filter(|s| !s.is_empty()) {
                Some(s) => format!("{s},metadata.name={name}"),
                None => format!("metadata.name={name}"),
            };
            r.query.insert("fieldSelector".into(), sel);
            pods_collection(shared, Some(ns), r, true)
        }
        ["api", "v1", "namespaces", ns, "pods", name] => pod_item(shared, ns, name, r, Subresource::Main),
        ["api", "v1", "namespaces", ns, "pods", name, "status"] => pod_item(shared, ns, name, r, Subresource::Status),
        // events
        ["api", "v1", "events"] => events_collection(shared, EventGroup::Core, None, r),
        ["api", "v1", "namespaces", ns, "events"] => events_collection(shared, EventGroup::Core, Some(ns), r),
        ["api", "v1", "namespaces", ns, "events", name] => event_item(shared, EventGroup::Core, ns, name, r),
        ["apis", "events.k8s.io", "v1", "events"] => events_collection(shared, EventGroup::EventsV1, None, r),
        ["apis", "events.k8s.io", "v1", "namespaces", ns, "events"] => {
            events_collection(shared, EventGroup::EventsV1, Some(ns), r)
        }
        ["apis", "events.k8s.io", "v1", "namespaces", ns, "events", name] => {
            event_item(shared, EventGroup::EventsV1, ns, name, r)
        }
        _ => Err(ApiError::no_route()),
    }
}

/// A list of DaemonSets or Nodes (label selector only; watches of them are not simulated).
/// Writes are refused as forbidden, as RBAC refuses them to a node agent.
fn objects_collection(shared: &Arc<Shared>, kind: Kind, ns: Option<&str>, r: &Req) -> Result<Response<Body>, ApiError> {
    if r.method != Method::GET {
        return Err(forbidden(kind, r));
    }
    if r.flag("watch") {
        return Err(ApiError::method_not_allowed());
    }
    if r.q("fieldSelector").is_some_and(|f| !f.is_empty()) {
        return Err(ApiError::bad_request(format!("field selectors on {} are not simulated", kind.resource())));
    }
    let labels = LabelSelector::parse(r.q("labelSelector").unwrap_or("")).map_err(ApiError::bad_request)?;
    Ok(json_response(200, &lock(&shared.store).list_objects(kind, ns, &labels)))
}

fn object_item(
    shared: &Arc<Shared>,
    kind: Kind,
    ns: Option<&str>,
    name: &str,
    r: &Req,
) -> Result<Response<Body>, ApiError> {
    if r.method != Method::GET {
        return Err(forbidden(kind, r));
    }
    Ok(json_response(200, &lock(&shared.store).get_object(kind, ns, name)?))
}

/// The 403 the real server sends a service account whose role does not grant the verb.
fn forbidden(kind: Kind, r: &Req) -> ApiError {
    let verb = verb(&r.method, "", false);
    let group = if kind.group().is_empty() { String::new() } else { format!(" in API group \"{}\"", kind.group()) };
    ApiError::new(
        403,
        "Forbidden",
        format!("{} is forbidden: cannot {verb} resource \"{}\"{group}", kind.resource(), kind.resource()),
    )
}

fn filter_from(r: &Req, ns: Option<&str>, kind: FieldKind) -> Result<Filter, ApiError> {
    let labels = LabelSelector::parse(r.q("labelSelector").unwrap_or("")).map_err(ApiError::bad_request)?;
    let fields = FieldSelector::parse(r.q("fieldSelector").unwrap_or("")).map_err(ApiError::bad_request)?;
    fields.validate(kind).map_err(|m| {
        let resource = if kind == FieldKind::Pod { "pods" } else { "events" };
        ApiError::bad_request(format!(
            "Unable to find \"/v1, Resource={resource}\" that match label selector \"{}\", field selector \"{}\": {m}",
            r.q("labelSelector").unwrap_or(""),
            r.q("fieldSelector").unwrap_or("")
        ))
    })?;
    Ok(Filter { namespace: ns.map(str::to_string), labels, fields })
}

fn pods_collection(
    shared: &Arc<Shared>,
    ns: Option<&str>,
    r: Req,
    force_watch: bool,
) -> Result<Response<Body>, ApiError> {
    match r.method {
        Method::GET => {
            let filter = filter_from(&r, ns, FieldKind::Pod)?;
            if force_watch || r.flag("watch") {
                return watch::start(shared, filter, &r);
            }
            let p = ListParams {
                resource_version: r.q("resourceVersion").map(str::to_string),
                resource_version_match: r.q("resourceVersionMatch").map(str::to_string),
                limit: match r.q("limit").filter(|s| !s.is_empty()) {
                    Some(l) => Some(l.parse().map_err(|_| ApiError::bad_request(format!("invalid limit: {l}")))?),
                    None => None,
                },
                continue_token: r.q("continue").map(str::to_string),
            };
            let list = lock(&shared.store).list_pods(&filter, &p)?;
            Ok(json_response(200, &list))
        }
        Method::POST => {
            let Some(ns) = ns else {
                return Err(ApiError::method_not_allowed());
            };
            let body = r.json_body()?;
            let writer = Writer::of_request(r.q("fieldManager"), &r.user_agent, false);
            let pod = shared.mutate(|st| st.as_writer(writer).create_pod(Some(ns), body, true))?;
            Ok(json_response(201, &pod))
        }
        _ => Err(ApiError::method_not_allowed()),
    }
}

fn patch_kind(r: &Req) -> Result<PatchKind, ApiError> {
    PatchKind::from_content_type(&r.content_type).ok_or_else(|| {
        ApiError::new(
            415,
            "UnsupportedMediaType",
            format!(
                "the body of the request was in an unknown format - accepted media types include: application/json-patch+json, application/merge-patch+json, application/apply-patch+yaml, application/strategic-merge-patch+json (got {:?})",
                r.content_type
            ),
        )
    })
}

fn pod_item(shared: &Arc<Shared>, ns: &str, name: &str, r: Req, sub: Subresource) -> Result<Response<Body>, ApiError> {
    match r.method {
        Method::GET => {
            let pod = lock(&shared.store).get_pod(ns, name).ok_or_else(|| ApiError::not_found("pods", name))?;
            Ok(json_response(200, &pod))
        }
        Method::PUT => {
            let body = r.json_body()?;
            let pre = body.pointer("/metadata/resourceVersion").and_then(Value::as_str).map(str::to_string);
            let writer = Writer::of_request(r.q("fieldManager"), &r.user_agent, sub == Subresource::Status);
            let pod = shared.mutate(|st| st.as_writer(writer).update_pod(ns, name, body, sub, pre.as_deref()))?;
            Ok(json_response(200, &pod))
        }
        Method::PATCH => {
            let kind = patch_kind(&r)?;
            if kind == PatchKind::Apply && r.q("fieldManager").is_none_or(str::is_empty) {
                return Err(ApiError::new(
                    422,
                    "Invalid",
                    "PatchOptions.meta.k8s.io \"\" is invalid: fieldManager: Required value: is required for apply patch",
                ));
            }
            let writer = Writer::of_request(r.q("fieldManager"), &r.user_agent, sub == Subresource::Status);
            let (pod, created) = shared.mutate(|st| st.as_writer(writer).patch_pod(ns, name, kind, &r.body, sub))?;
            Ok(json_response(if created { 201 } else { 200 }, &pod))
        }
        Method::DELETE if sub == Subresource::Main => {
            let opts: Value = if r.body.is_empty() { json!({}) } else { r.json_body()? };
            let grace = match r.q("gracePeriodSeconds") {
                Some(g) => Some(
                    g.parse::<i64>().map_err(|_| ApiError::bad_request(format!("invalid gracePeriodSeconds: {g}")))?,
                ),
                None => opts.get("gracePeriodSeconds").and_then(Value::as_i64),
            };
            let pre_uid = opts.pointer("/preconditions/uid").and_then(Value::as_str);
            let pre_rv = opts.pointer("/preconditions/resourceVersion").and_then(Value::as_str);
            let pod = shared.mutate(|st| st.delete_pod(ns, name, grace, pre_uid, pre_rv))?;
            Ok(json_response(200, &pod))
        }
        _ => Err(ApiError::method_not_allowed()),
    }
}

fn events_collection(
    shared: &Arc<Shared>,
    group: EventGroup,
    ns: Option<&str>,
    r: Req,
) -> Result<Response<Body>, ApiError> {
    match r.method {
        Method::GET => {
            if r.flag("watch") {
                // Only pod watches are simulated.
                return Err(ApiError::method_not_allowed());
            }
            let filter = filter_from(&r, ns, FieldKind::Event)?;
            Ok(json_response(200, &lock(&shared.store).list_events(group, &filter)))
        }
        Method::POST => {
            let Some(ns) = ns else {
                return Err(ApiError::method_not_allowed());
            };
            let body = r.json_body()?;
            let ev = shared.mutate(|st| st.create_event(group, ns, body))?;
            Ok(json_response(201, &ev))
        }
        _ => Err(ApiError::method_not_allowed()),
    }
}

fn event_item(
    shared: &Arc<Shared>,
    group: EventGroup,
    ns: &str,
    name: &str,
    r: Req,
) -> Result<Response<Body>, ApiError> {
    match r.method {
        Method::GET => Ok(json_response(200, &lock(&shared.store).get_event(group, ns, name)?)),
        Method::PATCH => {
            let kind = patch_kind(&r)?;
            let ev = shared.mutate(|st| st.write_event(group, ns, name, Some((kind, &r.body)), None))?;
            Ok(json_response(200, &ev))
        }
        Method::PUT => {
            let body = r.json_body()?;
            let ev = shared.mutate(|st| st.write_event(group, ns, name, None, Some(body)))?;
            Ok(json_response(200, &ev))
        }
        Method::DELETE => {
            shared.mutate(|st| st.delete_event(group, ns, name))?;
            Ok(json_response(
                200,
                &json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                        "details": {"name": name, "kind": "events"}}),
            ))
        }
        _ => Err(ApiError::method_not_allowed()),
    }
}

/// Counts a served watch (the control API reports it).
pub(crate) fn count_watch(shared: &Shared) {
    shared.watch_count.fetch_add(1, Ordering::SeqCst);
}

fn version() -> Value {
    json!({
        "major": "1", "minor": "33", "gitVersion": "v1.33.0-valet-sim",
        "gitCommit": "0000000000000000000000000000000000000000", "gitTreeState": "clean",
        "buildDate": "2025-04-23T00:00:00Z", "goVersion": "go1.24.2", "compiler": "gc",
        "platform": "linux/amd64"
    })
}

fn apps_group() -> Value {
    json!({"name": "apps",
           "versions": [{"groupVersion": "apps/v1", "version": "v1"}],
           "preferredVersion": {"groupVersion": "apps/v1", "version": "v1"}})
}

fn apps_resources() -> Value {
    json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": "apps/v1", "resources": [
        resource("daemonsets", "DaemonSet", true, &["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]),
        resource("daemonsets/status", "DaemonSet", true, &["get", "patch", "update"]),
    ]})
}

fn events_group() -> Value {
    json!({"name": "events.k8s.io",
           "versions": [{"groupVersion": "events.k8s.io/v1", "version": "v1"}],
           "preferredVersion": {"groupVersion": "events.k8s.io/v1", "version": "v1"}})
}

fn resource(name: &str, kind: &str, namespaced: bool, verbs: &[&str]) -> Value {
    let singular = if name.contains('/') { "" } else { kind };
    json!({"name": name, "singularName": singular.to_lowercase(), "namespaced": namespaced, "kind": kind, "verbs": verbs})
}

fn core_resources() -> Value {
    json!({"kind": "APIResourceList", "groupVersion": "v1", "resources": [
        resource("pods", "Pod", true, &["create", "delete", "get", "list", "patch", "update", "watch"]),
        resource("pods/status", "Pod", true, &["get", "patch", "update"]),
        resource("events", "Event", true, &["create", "delete", "get", "list", "patch", "update"]),
        resource("nodes", "Node", false, &["create", "delete", "get", "list", "patch", "update", "watch"]),
    ]})
}

fn events_resources() -> Value {
    json!({"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": "events.k8s.io/v1", "resources": [
        resource("events", "Event", true, &["create", "delete", "get", "list", "patch", "update"]),
    ]})
}
