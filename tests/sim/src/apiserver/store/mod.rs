//! The object store behind the fake API server: pods with a change history (for watches and
//! consistent paginated/exact lists), events, and the DaemonSets and Nodes a node agent reads;
//! one global resourceVersion like etcd's revision.

use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

use base64::Engine as _;
use serde_json::{Map, Value, json};

use super::patch::{PatchKind, Schema, apply_patch};
use super::selector::{FieldKind, FieldSelector, LabelSelector};
use super::status::ApiError;
use crate::util;

mod events;
mod managed;
mod objects;
mod reads;

pub use managed::Writer;
pub use objects::{Kind, Propagation};

/// What a watch event says happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChangeType {
    Added,
    Modified,
    Deleted,
}

impl ChangeType {
    pub fn as_str(self) -> &'static str {
        match self {
            ChangeType::Added => "ADDED",
            ChangeType::Modified => "MODIFIED",
            ChangeType::Deleted => "DELETED",
        }
    }
}

/// One pod write, kept so watches can resume and old list snapshots can be rebuilt.
#[derive(Debug, Clone)]
pub(crate) struct Change {
    pub rv: u64,
    pub key: String,
    pub ty: ChangeType,
    /// The object after the change (for a delete: its last state, stamped with the delete's RV).
    pub object: Arc<Value>,
    /// The object before the change (None for an add).
    pub prev: Option<Arc<Value>>,
}

/// One event for a watch stream: its type and the object.
pub type WatchEvent = (ChangeType, Arc<Value>);

/// Namespace and selectors of a list or watch.
#[derive(Debug, Clone, Default)]
pub struct Filter {
    pub namespace: Option<String>,
    pub labels: LabelSelector,
    pub fields: FieldSelector,
}

impl Filter {
    pub fn matches(&self, obj: &Value, kind: FieldKind) -> bool {
        if let Some(ns) = &self.namespace
            && obj.pointer("/metadata/namespace").and_then(Value::as_str) != Some(ns.as_str())
        {
            return false;
        }
        self.labels.matches(obj) && self.fields.matches(obj, kind)
    }

    fn has_selectors(&self) -> bool {
        !self.labels.is_empty() || !self.fields.is_empty()
    }
}

/// Which part of a pod a write may change.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Subresource {
    /// The main resource: status changes are dropped, spec is mostly immutable.
    Main,
    /// `/status`: only status changes are kept.
    Status,
    /// Test control (the "kubelet"): anything goes.
    Control,
}

/// The two Event API groups.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum EventGroup {
    /// `/api/v1` Events
    Core,
    /// `/apis/events.k8s.io/v1` Events
    EventsV1,
}

impl EventGroup {
    pub fn api_version(self) -> &'static str {
        match self {
            EventGroup::Core => "v1",
            EventGroup::EventsV1 => "events.k8s.io/v1",
        }
    }
}

/// Parameters of a list call.
#[derive(Debug, Clone, Default)]
pub struct ListParams {
    pub resource_version: Option<String>,
    pub resource_version_match: Option<String>,
    pub limit: Option<usize>,
    pub continue_token: Option<String>,
}

pub(crate) struct Store {
    pub rv: u64,
    pods: BTreeMap<String, Arc<Value>>,
    events: BTreeMap<(EventGroup, String), Value>,
    /// DaemonSets and Nodes by kind and `namespace/name` (`/name` for a Node).
    objects: BTreeMap<(Kind, String), Value>,
    history: VecDeque<Change>,
    /// New watches and exact/continued lists may start from any RV >= floor.
    floor: u64,
    /// Live watches that have seen everything up to this RV have lost nothing.
    live_floor: u64,
    history_limit: usize,
    pub schema: Schema,
    /// Who makes the next pod write (its managedFields), then test control again.
    writer: Writer,
}

pub(crate) fn key_of(ns: &str, name: &str) -> String {
    format!("{ns}/{name}")
}

fn meta_str<'a>(obj: &'a Value, field: &str) -> Option<&'a str> {
    obj.get("metadata").and_then(|m| m.get(field)).and_then(Value::as_str)
}

fn meta_mut(obj: &mut Value) -> Result<&mut Map<String, Value>, ApiError> {
    let m = obj.as_object_mut().ok_or_else(|| ApiError::bad_request("the object must be a JSON object"))?;
    let meta = m.entry("metadata").or_insert_with(|| json!({}));
    if !meta.is_object() {
        *meta = json!({});
    }
    meta.as_object_mut().ok_or_else(|| ApiError::bad_request("metadata must be an object"))
}

/// The QoS class the API server derives from container resources.
pub fn qos_class(pod: &Value) -> &'static str {
    let containers: Vec<&Value> = ["containers", "initContainers"]
        .iter()
        .filter_map(|k| pod.pointer(&format!("/spec/{k}")).and_then(Value::as_array))
        .flatten()
        .collect();
    let mut any = false;
    let mut guaranteed = !containers.is_empty();
    for c in &containers {
        let req = c.pointer("/resources/requests").and_then(Value::as_object);
        let lim = c.pointer("/resources/limits").and_then(Value::as_object);
        if req.is_some_and(|r| !r.is_empty()) || lim.is_some_and(|l| !l.is_empty()) {
            any = true;
        }
        for res in ["cpu", "memory"] {
            let l = lim.and_then(|l| l.get(res));
            let r = req.and_then(|r| r.get(res)).or(l);
            if l.is_none() || r != l {
                guaranteed = false;
            }
        }
    }
    if !any {
        "BestEffort"
    } else if guaranteed {
        "Guaranteed"
    } else {
        "Burstable"
    }
}

impl Store {
    pub(crate) fn new(history_limit: usize, schema: Schema) -> Store {
        Store {
            rv: 1,
            pods: BTreeMap::new(),
            events: BTreeMap::new(),
            objects: BTreeMap::new(),
            history: VecDeque::new(),
            floor: 1,
            live_floor: 1,
            history_limit: history_limit.max(1),
            schema,
            writer: Writer::control(),
        }
    }

    fn bump(&mut self) -> u64 {
        self.rv += 1;
        self.rv
    }

    fn record(&mut self, change: Change) {
        self.history.push_back(change);
        while self.history.len() > self.history_limit {
            if let Some(old) = self.history.pop_front() {
                // Watches and snapshots that need `old` can no longer be served.
                self.floor = self.floor.max(old.rv);
                self.live_floor = self.live_floor.max(old.rv);
            }
        }
    }

    /// Forgets the history, like a compaction plus a restart of the watch cache: every RV handed
    /// out so far becomes too old to resume from; watches that are caught up keep going.
    pub(crate) fn expire_history(&mut self) {
        self.live_floor = self.rv;
        self.history.clear();
        let rv = self.bump();
        self.floor = rv;
    }

    pub(crate) fn pods(&self) -> Vec<Value> {
        self.pods.values().map(|p| (**p).clone()).collect()
    }

    pub(crate) fn get_pod(&self, ns: &str, name: &str) -> Option<Value> {
        self.pods.get(&key_of(ns, name)).map(|p| (**p).clone())
    }

    pub(crate) fn events(&self) -> Vec<Value> {
        self.events.values().cloned().collect()
    }

    /// The next pod write is `writer`'s.
    pub(crate) fn as_writer(&mut self, writer: Writer) -> &mut Store {
        self.writer = writer;
        self
    }

    fn commit_pod(&mut self, key: String, ty: ChangeType, mut obj: Value, prev: Option<Arc<Value>>) -> Arc<Value> {
        let writer = std::mem::replace(&mut self.writer, Writer::control());
        if ty != ChangeType::Deleted {
            if ty == ChangeType::Added
                && let Some(meta) = obj.get_mut("metadata").and_then(Value::as_object_mut)
            {
                meta.remove("managedFields");
            }
            managed::record(&mut obj, prev.as_deref(), &writer, &util::now_rfc3339());
        }
        let rv = self.bump();
        if let Ok(meta) = meta_mut(&mut obj) {
            meta.insert("resourceVersion".into(), Value::String(rv.to_string()));
        }
        let obj = Arc::new(obj);
        match ty {
            ChangeType::Deleted => {
                self.pods.remove(&key);
            }
            _ => {
                self.pods.insert(key.clone(), obj.clone());
            }
        }
        self.record(Change { rv, key, ty, object: obj.clone(), prev });
        obj
    }

    /// Creates a pod. `from_api` applies what the real server does to a POST (status reset to
    /// Pending); test control keeps the given status, as a kubelet would have written it.
    pub(crate) fn create_pod(
        &mut self,
        path_ns: Option<&str>,
        mut obj: Value,
        from_api: bool,
    ) -> Result<Value, ApiError> {
        let ns = {
            let meta = meta_mut(&mut obj)?;
            let body_ns = meta.get("namespace").and_then(Value::as_str).map(str::to_string);
            let ns = match (path_ns, body_ns) {
                (Some(p), Some(b)) if p != b => {
                    return Err(ApiError::bad_request(
                        "the namespace of the provided object does not match the namespace sent on the request",
                    ));
                }
                (Some(p), _) => p.to_string(),
                (None, Some(b)) => b,
                (None, None) => "default".to_string(),
            };
            meta.insert("namespace".into(), Value::String(ns.clone()));
            ns
        };
        let name = self.assign_name(&mut obj, "pods", |s, n| s.pods.contains_key(&key_of(&ns, n)))?;
        let key = key_of(&ns, &name);
        if self.pods.contains_key(&key) {
            return Err(ApiError::already_exists("pods", &name));
        }
        // Test control may bring the uid the simulated kubelet named the pod's cgroups after;
        // a create through the API always gets a fresh one, as on a real server.
        let given_uid = if from_api { None } else { meta_str(&obj, "uid").map(str::to_string) };
        stamp_new_object(&mut obj, "v1", "Pod")?;
        if let Some(uid) = given_uid {
            meta_mut(&mut obj)?.insert("uid".into(), Value::String(uid));
        }
        default_pod_spec(&mut obj);
        let has_status = obj.get("status").is_some_and(|s| s.as_object().is_some_and(|m| !m.is_empty()));
        if from_api || !has_status {
            let qos = qos_class(&obj);
            if let Some(m) = obj.as_object_mut() {
                m.insert("status".into(), json!({"phase": "Pending", "qosClass": qos}));
            }
        }
        let out = self.commit_pod(key, ChangeType::Added, obj, None);
        Ok((*out).clone())
    }

    /// Fills `metadata.name` from `generateName` when needed; returns the name.
    fn assign_name(
        &self,
        obj: &mut Value,
        resource: &str,
        taken: impl Fn(&Store, &str) -> bool,
    ) -> Result<String, ApiError> {
        let meta = meta_mut(obj)?;
        if let Some(n) = meta.get("name").and_then(Value::as_str).filter(|n| !n.is_empty()) {
            return Ok(n.to_string());
        }
        let Some(prefix) = meta.get("generateName").and_then(Value::as_str).map(str::to_string) else {
            return Err(ApiError::invalid(
                resource,
                "",
                "metadata.name: Required value: name or generateName is required",
            ));
        };
        let mut name = format!("{prefix}{}", util::name_suffix());
        while taken(self, &name) {
            name = format!("{prefix}{}", util::name_suffix());
        }
        meta.insert("name".into(), Value::String(name.clone()));
        Ok(name)
    }

    /// Replaces a pod (PUT, or the result of a PATCH, or test control). `precondition_rv` is the
    /// resourceVersion the writer based its change on, if it sent one.
    pub(crate) fn update_pod(
        &mut self,
        ns: &str,
        name: &str,
        mut new: Value,
        sub: Subresource,
        precondition_rv: Option<&str>,
    ) -> Result<Value, ApiError> {
        let key = key_of(ns, name);
        let old = self.pods.get(&key).cloned().ok_or_else(|| ApiError::not_found("pods", name))?;
        if let Some(want) = precondition_rv.filter(|s| !s.is_empty())
            && Some(want) != meta_str(&old, "resourceVersion")
        {
            return Err(ApiError::conflict("pods", name));
        }
        if !new.is_object() {
            return Err(ApiError::bad_request("the object must be a JSON object"));
        }
        if let Some(n) = meta_str(&new, "name").filter(|n| *n != name) {
            return Err(ApiError::bad_request(format!(
                "the name of the object ({n}) does not match the name on the URL ({name})"
            )));
        }
        if let Some(n) = meta_str(&new, "namespace").filter(|n| *n != ns) {
            return Err(ApiError::bad_request(format!(
                "the namespace of the object ({n}) does not match the namespace on the URL ({ns})"
            )));
        }
        match sub {
            Subresource::Main => {
                // The pod strategy ignores status on the main resource and forbids most spec edits.
                set_field(&mut new, "status", old.get("status").cloned());
                check_spec_update(&old, &new, name)?;
            }
            Subresource::Status => {
                let status = new.get("status").cloned();
                new = (*old).clone();
                set_field(&mut new, "status", status);
            }
            Subresource::Control => {}
        }
        // Identity and server-owned metadata always come from the stored object.
        for field in [
            "name",
            "namespace",
            "uid",
            "creationTimestamp",
            "deletionTimestamp",
            "deletionGracePeriodSeconds",
            "managedFields",
        ] {
            let v = old.get("metadata").and_then(|m| m.get(field)).cloned();
            if let Ok(meta) = meta_mut(&mut new) {
                match v {
                    Some(v) => {
                        meta.insert(field.into(), v);
                    }
                    None if sub != Subresource::Control => {
                        meta.remove(field);
                    }
                    None => {}
                }
            }
        }
        set_field(&mut new, "kind", Some(json!("Pod")));
        set_field(&mut new, "apiVersion", Some(json!("v1")));
        if let Ok(meta) = meta_mut(&mut new) {
            meta.insert("resourceVersion".into(), old["metadata"]["resourceVersion"].clone());
        }
        if new == *old {
            // A write that changes nothing is not persisted: same RV, no watch event.
            self.writer = Writer::control();
            return Ok(new);
        }
        let out = self.commit_pod(key, ChangeType::Modified, new, Some(old));
        if finalize_ready(&out) {
            return self.remove_pod(ns, name);
        }
        Ok((*out).clone())
    }

    /// Applies a PATCH body to a pod (or creates it for a server-side apply of a missing pod).
    pub(crate) fn patch_pod(
        &mut self,
        ns: &str,
        name: &str,
        kind: PatchKind,
        body: &[u8],
        sub: Subresource,
    ) -> Result<(Value, bool), ApiError> {
        let Some(old) = self.pods.get(&key_of(ns, name)).cloned() else {
            if kind == PatchKind::Apply && sub == Subresource::Main {
                let mut obj: Value = serde_json::from_slice(body)
                    .map_err(|e| ApiError::bad_request(format!("error decoding YAML: {e}")))?;
                if let Ok(meta) = meta_mut(&mut obj) {
                    meta.insert("name".into(), json!(name));
                }
                return self.create_pod(Some(ns), obj, true).map(|v| (v, true));
            }
            return Err(ApiError::not_found("pods", name));
        };
        let patched = apply_patch(kind, &old, body, &self.schema).map_err(|e| match e.code {
            400 => ApiError::bad_request(e.message),
            _ => ApiError::new(422, "Invalid", e.message),
        })?;
        // A resourceVersion inside the patch is an optimistic-concurrency precondition.
        let patched_rv = meta_str(&patched, "resourceVersion").map(str::to_string);
        let precondition = patched_rv.filter(|rv| Some(rv.as_str()) != meta_str(&old, "resourceVersion"));
        let out = self.update_pod(ns, name, patched, sub, precondition.as_deref())?;
        Ok((out, false))
    }

    /// DELETE with the pod strategy's graceful deletion: a scheduled, non-terminal pod only gets
    /// `deletionTimestamp` (the kubelet deletes it for good); `grace = Some(0)` removes it now.
    pub(crate) fn delete_pod(
        &mut self,
        ns: &str,
        name: &str,
        grace: Option<i64>,
        pre_uid: Option<&str>,
        pre_rv: Option<&str>,
    ) -> Result<Value, ApiError> {
        let key = key_of(ns, name);
        let old = self.pods.get(&key).cloned().ok_or_else(|| ApiError::not_found("pods", name))?;
        if let Some(u) = pre_uid
            && Some(u) != meta_str(&old, "uid")
        {
            return Err(ApiError::new(
                409,
                "Conflict",
                format!(
                    "Operation cannot be fulfilled on pods \"{name}\": Precondition failed: UID in precondition: {u}, UID in object meta: {}",
                    meta_str(&old, "uid").unwrap_or_default()
                ),
            ));
        }
        if let Some(r) = pre_rv
            && Some(r) != meta_str(&old, "resourceVersion")
        {
            return Err(ApiError::new(
                409,
                "Conflict",
                format!(
                    "Operation cannot be fulfilled on pods \"{name}\": Precondition failed: ResourceVersion in precondition: {r}, ResourceVersion in object meta: {}",
                    meta_str(&old, "resourceVersion").unwrap_or_default()
                ),
            ));
        }
        let scheduled = old.pointer("/spec/nodeName").and_then(Value::as_str).is_some_and(|n| !n.is_empty());
        let terminal = matches!(old.pointer("/status/phase").and_then(Value::as_str), Some("Succeeded" | "Failed"));
        let default_grace = old.pointer("/spec/terminationGracePeriodSeconds").and_then(Value::as_i64).unwrap_or(30);
        let mut grace = grace.unwrap_or(default_grace).max(0);
        if !scheduled || terminal {
            grace = 0;
        }
        let finalizers = old.pointer("/metadata/finalizers").and_then(Value::as_array).is_some_and(|f| !f.is_empty());
        let existing = old.pointer("/metadata/deletionGracePeriodSeconds").and_then(Value::as_i64);
        if grace == 0 && !finalizers {
            return self.remove_pod(ns, name);
        }
        if existing.is_some_and(|e| e <= grace) {
            // Already terminating with a grace no longer than asked: nothing changes.
            return Ok((*old).clone());
        }
        let mut new = (*old).clone();
        let at = chrono::Utc::now() + chrono::Duration::seconds(grace);
        if let Ok(meta) = meta_mut(&mut new) {
            meta.insert("deletionTimestamp".into(), json!(at.format("%Y-%m-%dT%H:%M:%SZ").to_string()));
            meta.insert("deletionGracePeriodSeconds".into(), json!(grace));
        }
        let out = self.commit_pod(key, ChangeType::Modified, new, Some(old));
        Ok((*out).clone())
    }

    /// Removes a pod now (what the kubelet's final grace-0 delete does).
    pub(crate) fn remove_pod(&mut self, ns: &str, name: &str) -> Result<Value, ApiError> {
        let key = key_of(ns, name);
        let old = self.pods.get(&key).cloned().ok_or_else(|| ApiError::not_found("pods", name))?;
        let out = self.commit_pod(key, ChangeType::Deleted, (*old).clone(), Some(old));
        Ok((*out).clone())
    }
}

fn parse_rv(s: &str) -> Result<u64, ApiError> {
    s.parse::<u64>().map_err(|_| {
        ApiError::bad_request(format!(
            "invalid resource version: {s:?}: strconv.ParseUint: parsing {s:?}: invalid syntax"
        ))
    })
}

fn too_large(n: u64, current: u64) -> ApiError {
    ApiError::new(504, "Timeout", format!("Too large resource version: {n}, current: {current}")).with_details(json!({
        "causes": [{"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}],
        "retryAfterSeconds": 1
    }))
}

/// Items of a list carry no kind/apiVersion on the real server.
fn strip_type_meta(v: &Value) -> Value {
    let mut v = v.clone();
    if let Some(m) = v.as_object_mut() {
        m.remove("kind");
        m.remove("apiVersion");
    }
    v
}

fn set_field(obj: &mut Value, field: &str, v: Option<Value>) {
    if let Some(m) = obj.as_object_mut() {
        match v {
            Some(v) => {
                m.insert(field.into(), v);
            }
            None => {
                m.remove(field);
            }
        }
    }
}

fn stamp_new_object(obj: &mut Value, api_version: &str, kind: &str) -> Result<(), ApiError> {
    set_field(obj, "apiVersion", Some(json!(api_version)));
    set_field(obj, "kind", Some(json!(kind)));
    let meta = meta_mut(obj)?;
    meta.insert("uid".into(), json!(util::uuid_v4()));
    meta.insert("creationTimestamp".into(), json!(util::now_rfc3339()));
    meta.remove("resourceVersion");
    meta.remove("deletionTimestamp");
    meta.remove("deletionGracePeriodSeconds");
    Ok(())
}

/// The defaults the API server fills into a pod spec (the ones clients look at).
fn default_pod_spec(pod: &mut Value) {
    let Some(spec) = pod.get_mut("spec").and_then(Value::as_object_mut) else {
        return;
    };
    for (k, v) in [
        ("restartPolicy", json!("Always")),
        ("terminationGracePeriodSeconds", json!(30)),
        ("dnsPolicy", json!("ClusterFirst")),
        ("schedulerName", json!("default-scheduler")),
    ] {
        spec.entry(k).or_insert(v);
    }
}

/// A pod whose deletion was requested and whose finalizers are gone is removed.
fn finalize_ready(pod: &Value) -> bool {
    pod.pointer("/metadata/deletionTimestamp").is_some()
        && pod.pointer("/metadata/deletionGracePeriodSeconds").and_then(Value::as_i64) == Some(0)
        && pod.pointer("/metadata/finalizers").and_then(Value::as_array).is_none_or(|f| f.is_empty())
}

/// The pod strategy's update validation: only a few spec fields may change.
fn check_spec_update(old: &Value, new: &Value, name: &str) -> Result<(), ApiError> {
    fn normalise(spec: Option<&Value>) -> Value {
        let mut s = spec.cloned().unwrap_or(json!({}));
        if let Some(m) = s.as_object_mut() {
            for k in [
                "activeDeadlineSeconds",
                "tolerations",
                "terminationGracePeriodSeconds",
                "schedulingGates",
                "ephemeralContainers",
            ] {
                m.remove(k);
            }
            for list in ["containers", "initContainers"] {
                if let Some(Value::Array(cs)) = m.get_mut(list) {
                    for c in cs {
                        if let Some(cm) = c.as_object_mut() {
                            cm.remove("image");
                        }
                    }
                }
            }
        }
        s
    }
    if normalise(old.get("spec")) != normalise(new.get("spec")) {
        return Err(ApiError::invalid(
            "Pod",
            name,
            "spec: Forbidden: pod updates may not change fields other than `spec.containers[*].image`,`spec.initContainers[*].image`,`spec.activeDeadlineSeconds`,`spec.tolerations` (only additions to existing tolerations),`spec.terminationGracePeriodSeconds` (allow it to be set to 1 if it was previously negative)",
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(ns: &str, name: &str, labels: Value) -> Value {
        json!({"metadata": {"name": name, "namespace": ns, "labels": labels},
               "spec": {"nodeName": "n1", "containers": [{"name": "c", "image": "i"}]},
               "status": {"phase": "Running"}})
    }

    fn store_with(n: usize) -> Store {
        let mut s = Store::new(1000, Schema::pod());
        for i in 0..n {
            s.create_pod(None, pod("ns", &format!("p{i:02}"), json!({"i": i.to_string()})), false).expect("create");
        }
        s
    }

    fn names(list: &Value) -> Vec<String> {
        list["items"]
            .as_array()
            .expect("items")
            .iter()
            .map(|i| i["metadata"]["name"].as_str().unwrap_or_default().to_string())
            .collect()
    }

    #[test]
    fn pagination_with_continue_is_a_consistent_snapshot() {
        let mut s = store_with(5);
        let f = Filter::default();
        let p1 = s.list_pods(&f, &ListParams { limit: Some(2), ..Default::default() }).expect("page 1");
        assert_eq!(names(&p1), ["p00", "p01"]);
        assert_eq!(p1["metadata"]["remainingItemCount"], 3);
        assert!(p1["items"][0].get("kind").is_none(), "list items carry no type meta");
        let rv1 = p1["metadata"]["resourceVersion"].clone();
        let token = p1["metadata"]["continue"].as_str().expect("token").to_string();
        // Writes between pages do not show up in later pages.
        s.remove_pod("ns", "p03").expect("delete");
        s.create_pod(None, pod("ns", "p02a", json!({})), false).expect("create");
        let p2 = s
            .list_pods(&f, &ListParams { limit: Some(2), continue_token: Some(token), ..Default::default() })
            .expect("page 2");
        assert_eq!(names(&p2), ["p02", "p03"]);
        assert_eq!(p2["metadata"]["resourceVersion"], rv1);
        let token = p2["metadata"]["continue"].as_str().expect("token").to_string();
        let p3 = s
            .list_pods(&f, &ListParams { limit: Some(2), continue_token: Some(token), ..Default::default() })
            .expect("page 3");
        assert_eq!(names(&p3), ["p04"]);
        assert!(p3["metadata"].get("continue").is_none());
        assert!(p3["metadata"].get("remainingItemCount").is_none());
    }

    #[test]
    fn continue_token_expires_with_history() {
        let mut s = store_with(3);
        let p1 = s.list_pods(&Filter::default(), &ListParams { limit: Some(1), ..Default::default() }).expect("list");
        let token = p1["metadata"]["continue"].as_str().expect("token").to_string();
        s.expire_history();
        let err = s
            .list_pods(
                &Filter::default(),
                &ListParams { limit: Some(1), continue_token: Some(token), ..Default::default() },
            )
            .expect_err("expired");
        assert_eq!(err.code, 410);
    }

    #[test]
    fn selector_pages_have_no_remaining_count() {
        let s = store_with(4);
        let f = Filter { labels: LabelSelector::parse("i").expect("selector"), ..Default::default() };
        let p = s.list_pods(&f, &ListParams { limit: Some(1), ..Default::default() }).expect("list");
        assert!(p["metadata"]["continue"].is_string());
        assert!(p["metadata"].get("remainingItemCount").is_none());
    }

    #[test]
    fn rv_zero_ignores_limit_and_exact_lists_rebuild_the_past() {
        let mut s = store_with(3);
        let l = s
            .list_pods(
                &Filter::default(),
                &ListParams { resource_version: Some("0".into()), limit: Some(1), ..Default::default() },
            )
            .expect("list");
        assert_eq!(names(&l).len(), 3);
        let rv = s.rv;
        s.remove_pod("ns", "p00").expect("delete");
        s.modify_labels("ns", "p01");
        let exact = ListParams {
            resource_version: Some(rv.to_string()),
            resource_version_match: Some("Exact".into()),
            ..Default::default()
        };
        let l = s.list_pods(&Filter::default(), &exact).expect("exact");
        assert_eq!(names(&l), ["p00", "p01", "p02"]);
        assert_eq!(l["items"][1]["metadata"]["labels"], json!({"i": "1"}));
        s.expire_history();
        assert_eq!(s.list_pods(&Filter::default(), &exact).expect_err("too old").code, 410);
        let future = ListParams { resource_version: Some("999".into()), ..Default::default() };
        assert_eq!(s.list_pods(&Filter::default(), &future).expect_err("too large").code, 504);
    }

    impl Store {
        fn modify_labels(&mut self, ns: &str, name: &str) {
            let mut p = self.get_pod(ns, name).expect("exists");
            p["metadata"]["labels"] = json!({"changed": "yes"});
            self.update_pod(ns, name, p, Subresource::Control, None).expect("update");
        }
    }

    #[test]
    fn watch_drain_translates_selector_transitions() {
        let mut s = store_with(1);
        let f = Filter { labels: LabelSelector::parse("i=0").expect("selector"), ..Default::default() };
        let rv = s.rv;
        s.modify_labels("ns", "p00"); // stops matching -> DELETED
        let mut p = s.get_pod("ns", "p00").expect("exists");
        p["metadata"]["labels"] = json!({"i": "0"});
        s.update_pod("ns", "p00", p, Subresource::Control, None).expect("update"); // matches again -> ADDED
        s.create_pod(None, pod("ns", "other", json!({})), false).expect("create"); // never matches
        let (events, last) = s.watch_drain(&f, rv).expect("drain");
        let types: Vec<_> = events.iter().map(|(t, _)| *t).collect();
        assert_eq!(types, [ChangeType::Deleted, ChangeType::Added]);
        assert_eq!(last, s.rv);
    }

    #[test]
    fn watch_start_too_old_and_history_limit() {
        let mut s = Store::new(2, Schema::pod());
        for i in 0..4 {
            s.create_pod(None, pod("ns", &format!("p{i}"), json!({})), false).expect("create");
        }
        let err = s.watch_start(&Filter::default(), Some("1"), false).expect_err("trimmed");
        assert_eq!(err.code, 410);
        assert!(err.message.starts_with("too old resource version: 1 ("), "{}", err.message);
        let (init, _) = s.watch_start(&Filter::default(), Some("0"), false).expect("rv 0");
        assert_eq!(init.len(), 4);
    }

    #[test]
    fn status_subresource_and_main_resource_split() {
        let mut s = store_with(1);
        let body = json!({"status": {"phase": "Succeeded"}, "metadata": {"labels": {"x": "y"}}}).to_string();
        let (out, _) =
            s.patch_pod("ns", "p00", PatchKind::Merge, body.as_bytes(), Subresource::Status).expect("status patch");
        assert_eq!(out["status"]["phase"], "Succeeded");
        assert_eq!(out["metadata"]["labels"], json!({"i": "0"}));
        let (out, _) =
            s.patch_pod("ns", "p00", PatchKind::Merge, body.as_bytes(), Subresource::Main).expect("main patch");
        assert_eq!(out["status"]["phase"], "Succeeded", "status unchanged through main resource");
        assert_eq!(out["metadata"]["labels"], json!({"i": "0", "x": "y"}));
        let bad = json!({"spec": {"nodeName": "elsewhere"}}).to_string();
        let err = s.patch_pod("ns", "p00", PatchKind::Merge, bad.as_bytes(), Subresource::Main).expect_err("immutable");
        assert_eq!(err.code, 422);
    }

    #[test]
    fn noop_write_keeps_rv_and_stale_rv_conflicts() {
        let mut s = store_with(1);
        let rv = s.rv;
        let (out, _) = s
            .patch_pod("ns", "p00", PatchKind::Merge, b"{\"status\":{\"phase\":\"Running\"}}", Subresource::Status)
            .expect("noop");
        assert_eq!(s.rv, rv);
        assert_eq!(out["metadata"]["resourceVersion"], rv.to_string());
        let stale = json!({"metadata": {"resourceVersion": "1"}, "status": {"phase": "Failed"}}).to_string();
        let err =
            s.patch_pod("ns", "p00", PatchKind::Merge, stale.as_bytes(), Subresource::Status).expect_err("conflict");
        assert_eq!(err.code, 409);
    }

    #[test]
    fn graceful_delete() {
        let mut s = store_with(1);
        let out = s.delete_pod("ns", "p00", None, None, None).expect("delete");
        assert!(out["metadata"]["deletionTimestamp"].is_string());
        assert_eq!(out["metadata"]["deletionGracePeriodSeconds"], 30);
        assert!(s.get_pod("ns", "p00").is_some());
        s.delete_pod("ns", "p00", Some(0), None, None).expect("force");
        assert!(s.get_pod("ns", "p00").is_none());
    }

    #[test]
    fn qos() {
        let mut p = pod("ns", "p", json!({}));
        assert_eq!(qos_class(&p), "BestEffort");
        p["spec"]["containers"][0]["resources"] = json!({"requests": {"cpu": "1"}});
        assert_eq!(qos_class(&p), "Burstable");
        p["spec"]["containers"][0]["resources"] = json!({"limits": {"cpu": "1", "memory": "1Gi"}});
        assert_eq!(qos_class(&p), "Guaranteed");
    }
}
