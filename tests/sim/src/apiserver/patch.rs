//! PATCH bodies as the API server applies them: JSON merge patch (RFC 7386), strategic merge
//! patch (Kubernetes' per-field list strategies), JSON patch (RFC 6902) and server-side apply
//! (treated as strategic merge).

use serde_json::{Map, Value};

/// The four PATCH content types.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PatchKind {
    Merge,
    Strategic,
    Json,
    Apply,
}

impl PatchKind {
    /// Maps a Content-Type header (parameters ignored) to a patch kind.
    pub fn from_content_type(ct: &str) -> Option<PatchKind> {
        let base = ct.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
        match base.as_str() {
            "application/merge-patch+json" => Some(PatchKind::Merge),
            "application/strategic-merge-patch+json" => Some(PatchKind::Strategic),
            "application/json-patch+json" => Some(PatchKind::Json),
            "application/apply-patch+yaml" | "application/apply-patch+json" => Some(PatchKind::Apply),
            _ => None,
        }
    }
}

/// Why a patch failed, with the HTTP code the real server uses (400 undecodable, 422 not applicable).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PatchError {
    pub code: u16,
    pub message: String,
}

impl PatchError {
    fn bad_request(message: impl Into<String>) -> PatchError {
        PatchError { code: 400, message: message.into() }
    }
    fn invalid(message: impl Into<String>) -> PatchError {
        PatchError { code: 422, message: message.into() }
    }
}

/// How a list field merges under a strategic merge patch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ListStrategy {
    /// No patch strategy: the patch's list replaces the original (atomic lists).
    Replace,
    /// `patchStrategy:"merge"` with `patchMergeKey`.
    MergeByKey(&'static str),
    /// `patchStrategy:"merge"` on a list of scalars (set union, e.g. finalizers).
    MergePrimitives,
}

/// Per-kind knowledge of list strategies (the Go struct tags of k8s.io/api).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Schema {
    pub kind: SchemaKind,
    /// Deviation knob: merge `status.containerStatuses` by `name`. The real server treats that
    /// list as atomic (no patch strategy), so this is off by default.
    pub container_statuses_by_name: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SchemaKind {
    Pod,
    Event,
    Other,
}

impl Schema {
    pub fn pod() -> Schema {
        Schema { kind: SchemaKind::Pod, container_statuses_by_name: false }
    }
    pub fn event() -> Schema {
        Schema { kind: SchemaKind::Event, container_statuses_by_name: false }
    }

    /// The strategy for the list at `path` (dotted, list items collapsed: `spec.containers.env`).
    pub fn list_strategy(&self, path: &str) -> ListStrategy {
        use ListStrategy::*;
        // ObjectMeta applies to every kind.
        match path {
            "metadata.finalizers" => return MergePrimitives,
            "metadata.ownerReferences" => return MergeByKey("uid"),
            _ => {}
        }
        if self.kind != SchemaKind::Pod {
            return Replace;
        }
        let container_lists = ["spec.containers", "spec.initContainers", "spec.ephemeralContainers"];
        for c in container_lists {
            if path == c {
                return MergeByKey("name");
            }
            if let Some(rest) = path.strip_prefix(c).and_then(|r| r.strip_prefix('.')) {
                return match rest {
                    "env" => MergeByKey("name"),
                    "ports" => MergeByKey("containerPort"),
                    "volumeMounts" => MergeByKey("mountPath"),
                    "volumeDevices" => MergeByKey("devicePath"),
                    _ => Replace,
                };
            }
        }
        match path {
            "spec.volumes" | "spec.imagePullSecrets" | "spec.resourceClaims" | "spec.schedulingGates" => {
                MergeByKey("name")
            }
            "spec.hostAliases" => MergeByKey("ip"),
            "spec.topologySpreadConstraints" => MergeByKey("topologyKey"),
            "status.conditions" => MergeByKey("type"),
            "status.podIPs" | "status.hostIPs" => MergeByKey("ip"),
            "status.resourceClaimStatuses" => MergeByKey("name"),
            "status.containerStatuses" | "status.initContainerStatuses" | "status.ephemeralContainerStatuses"
                if self.container_statuses_by_name =>
            {
                MergeByKey("name")
            }
            _ => Replace,
        }
    }
}

/// Parses `body` and applies it to a copy of `target`.
pub fn apply_patch(kind: PatchKind, target: &Value, body: &[u8], schema: &Schema) -> Result<Value, PatchError> {
    match kind {
        PatchKind::Json => {
            let ops: json_patch::Patch = serde_json::from_slice(body)
                .map_err(|e| PatchError::bad_request(format!("error decoding patch: {e}")))?;
            let mut out = target.clone();
            json_patch::patch(&mut out, &ops).map_err(|e| PatchError::invalid(e.to_string()))?;
            Ok(out)
        }
        PatchKind::Merge => {
            let p = decode_object(body)?;
            let mut out = target.clone();
            json_patch::merge(&mut out, &p);
            Ok(out)
        }
        PatchKind::Strategic | PatchKind::Apply => {
            let p = decode_object(body)?;
            let mut out = target.clone();
            strategic_merge(&mut out, &p, schema).map_err(PatchError::invalid)?;
            Ok(out)
        }
    }
}

fn decode_object(body: &[u8]) -> Result<Value, PatchError> {
    let v: Value =
        serde_json::from_slice(body).map_err(|e| PatchError::bad_request(format!("error decoding patch: {e}")))?;
    if !v.is_object() {
        return Err(PatchError::bad_request("error decoding patch: the patch must be a JSON object"));
    }
    Ok(v)
}

/// Applies a strategic merge patch in place.
pub fn strategic_merge(target: &mut Value, patch: &Value, schema: &Schema) -> Result<(), String> {
    match (target, patch) {
        (Value::Object(t), Value::Object(p)) => merge_map(t, p, "", schema),
        (t, p) => {
            *t = strip_directives(p);
            Ok(())
        }
    }
}

fn join(path: &str, key: &str) -> String {
    if path.is_empty() { key.to_string() } else { format!("{path}.{key}") }
}

fn merge_map(
    orig: &mut Map<String, Value>,
    patch: &Map<String, Value>,
    path: &str,
    schema: &Schema,
) -> Result<(), String> {
    if patch.get("$patch").and_then(Value::as_str) == Some("replace") {
        *orig = strip_map(patch);
        return Ok(());
    }
    for (k, v) in patch {
        if k == "$patch" || k == "$retainKeys" || k.starts_with("$setElementOrder/") {
            // `$setElementOrder` only orders lists; the merged content is the same without it.
            continue;
        }
        if let Some(field) = k.strip_prefix("$deleteFromPrimitiveList/") {
            if let (Some(Value::Array(list)), Some(remove)) = (orig.get_mut(field), v.as_array()) {
                list.retain(|x| !remove.contains(x));
            }
            continue;
        }
        let child_path = join(path, k);
        if v.is_null() {
            orig.remove(k);
            continue;
        }
        if let Value::Object(pm) = v {
            match pm.get("$patch").and_then(Value::as_str) {
                Some("delete") => {
                    orig.remove(k);
                    continue;
                }
                Some("replace") => {
                    orig.insert(k.clone(), Value::Object(strip_map(pm)));
                    continue;
                }
                _ => {}
            }
        }
        match (orig.get_mut(k), v) {
            (Some(Value::Object(om)), Value::Object(pm)) => merge_map(om, pm, &child_path, schema)?,
            (Some(Value::Array(ol)), Value::Array(pl)) => merge_list(ol, pl, &child_path, schema)?,
            (_, Value::Array(pl)) => {
                // No original list: the result is the patch list minus directives/deletions.
                let mut fresh = Vec::new();
                merge_list(&mut fresh, pl, &child_path, schema)?;
                orig.insert(k.clone(), Value::Array(fresh));
            }
            (_, v) => {
                orig.insert(k.clone(), strip_directives(v));
            }
        }
    }
    if let Some(Value::Array(keep)) = patch.get("$retainKeys") {
        let keep: Vec<&str> = keep.iter().filter_map(Value::as_str).collect();
        orig.retain(|k, _| keep.contains(&k.as_str()));
    }
    Ok(())
}

fn merge_list(orig: &mut Vec<Value>, patch: &[Value], path: &str, schema: &Schema) -> Result<(), String> {
    match schema.list_strategy(path) {
        ListStrategy::Replace => {
            *orig = patch.iter().map(strip_directives).collect();
        }
        ListStrategy::MergePrimitives => {
            for v in patch {
                if !orig.contains(v) {
                    orig.push(v.clone());
                }
            }
        }
        ListStrategy::MergeByKey(key) => {
            if patch.iter().any(|i| i.get("$patch").and_then(Value::as_str) == Some("replace")) {
                *orig = patch.iter().filter(|i| i.get("$patch").is_none()).map(strip_directives).collect();
                return Ok(());
            }
            for item in patch {
                let Value::Object(pm) = item else {
                    return Err(format!("{path}: expected a list of objects with merge key {key:?}"));
                };
                let Some(kv) = pm.get(key) else {
                    return Err(format!("map: {item} does not contain declared merge key: {key}"));
                };
                let pos = orig.iter().position(|o| o.get(key) == Some(kv));
                if pm.get("$patch").and_then(Value::as_str) == Some("delete") {
                    orig.retain(|o| o.get(key) != Some(kv));
                    continue;
                }
                match pos {
                    Some(i) => {
                        if let Value::Object(om) = &mut orig[i] {
                            merge_map(om, pm, path, schema)?;
                        }
                    }
                    None => orig.push(Value::Object(strip_map(pm))),
                }
            }
        }
    }
    Ok(())
}

fn strip_map(m: &Map<String, Value>) -> Map<String, Value> {
    m.iter()
        .filter(|(k, v)| !k.starts_with('$') && !v.is_null())
        .map(|(k, v)| (k.clone(), strip_directives(v)))
        .collect()
}

fn strip_directives(v: &Value) -> Value {
    match v {
        Value::Object(m) => Value::Object(strip_map(m)),
        Value::Array(a) => Value::Array(a.iter().map(strip_directives).collect()),
        other => other.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod() -> Value {
        json!({
            "metadata": {"name": "p", "labels": {"a": "1", "b": "2"}, "finalizers": ["x"],
                         "ownerReferences": [{"uid": "u1", "name": "job"}]},
            "spec": {"containers": [
                {"name": "app", "image": "app:1", "env": [{"name": "A", "value": "1"}]},
                {"name": "istio-proxy", "image": "proxy:1"}],
                "tolerations": [{"key": "t1"}]},
            "status": {
                "phase": "Running",
                "conditions": [
                    {"type": "Ready", "status": "True"},
                    {"type": "PodScheduled", "status": "True"}],
                "containerStatuses": [
                    {"name": "app", "ready": true},
                    {"name": "istio-proxy", "ready": true}]}
        })
    }

    fn smp(patch: Value) -> Value {
        apply_patch(PatchKind::Strategic, &pod(), patch.to_string().as_bytes(), &Schema::pod()).expect("patch applies")
    }

    #[test]
    fn strategic_conditions_merge_by_type() {
        let out = smp(json!({"status": {"conditions": [
            {"type": "Ready", "status": "False", "reason": "ContainersNotReady"},
            {"type": "valet.dev/SidecarsQuit", "status": "True"}]}}));
        let conds = out["status"]["conditions"].as_array().expect("list");
        assert_eq!(conds.len(), 3);
        assert_eq!(conds[0], json!({"type": "Ready", "status": "False", "reason": "ContainersNotReady"}));
        assert_eq!(conds[1]["type"], "PodScheduled");
        assert_eq!(conds[2]["type"], "valet.dev/SidecarsQuit");
    }

    #[test]
    fn strategic_container_statuses_are_atomic_like_the_real_server() {
        let out = smp(json!({"status": {"containerStatuses": [{"name": "app", "ready": false}]}}));
        assert_eq!(out["status"]["containerStatuses"], json!([{"name": "app", "ready": false}]));
        let by_name = Schema { container_statuses_by_name: true, ..Schema::pod() };
        let p = json!({"status": {"containerStatuses": [{"name": "app", "ready": false}]}});
        let out = apply_patch(PatchKind::Strategic, &pod(), p.to_string().as_bytes(), &by_name).expect("applies");
        assert_eq!(out["status"]["containerStatuses"].as_array().map(Vec::len), Some(2));
    }

    #[test]
    fn strategic_containers_env_owner_refs_finalizers() {
        let out = smp(json!({
            "metadata": {"finalizers": ["y", "x"], "ownerReferences": [{"uid": "u2", "name": "other"}],
                         "labels": {"a": null, "c": "3"}},
            "spec": {"containers": [{"name": "app", "env": [{"name": "B", "value": "2"}]}],
                     "tolerations": [{"key": "t2"}]}}));
        assert_eq!(out["metadata"]["finalizers"], json!(["x", "y"]));
        assert_eq!(out["metadata"]["ownerReferences"].as_array().map(Vec::len), Some(2));
        assert_eq!(out["metadata"]["labels"], json!({"b": "2", "c": "3"}));
        let app = &out["spec"]["containers"][0];
        assert_eq!(app["image"], "app:1");
        assert_eq!(app["env"].as_array().map(Vec::len), Some(2));
        assert_eq!(out["spec"]["containers"].as_array().map(Vec::len), Some(2));
        // tolerations have no strategy: replaced
        assert_eq!(out["spec"]["tolerations"], json!([{"key": "t2"}]));
    }

    #[test]
    fn strategic_directives() {
        let out = smp(json!({"status": {"conditions": [{"type": "Ready", "$patch": "delete"}]},
                             "metadata": {"$deleteFromPrimitiveList/finalizers": ["x"]}}));
        assert_eq!(out["status"]["conditions"], json!([{"type": "PodScheduled", "status": "True"}]));
        assert_eq!(out["metadata"]["finalizers"], json!([]));
        let out = smp(json!({"status": {"conditions": [{"$patch": "replace"}, {"type": "X", "status": "True"}]}}));
        assert_eq!(out["status"]["conditions"], json!([{"type": "X", "status": "True"}]));
        let out = smp(json!({"metadata": {"labels": {"$patch": "replace", "z": "9"}}}));
        assert_eq!(out["metadata"]["labels"], json!({"z": "9"}));
        let out =
            smp(json!({"$setElementOrder/spec": [], "status": {"$setElementOrder/conditions": [{"type": "Ready"}]}}));
        assert_eq!(out, pod());
    }

    #[test]
    fn strategic_missing_merge_key_is_invalid() {
        let err = apply_patch(
            PatchKind::Strategic,
            &pod(),
            json!({"status": {"conditions": [{"status": "True"}]}}).to_string().as_bytes(),
            &Schema::pod(),
        )
        .expect_err("must fail");
        assert_eq!(err.code, 422);
    }

    #[test]
    fn merge_patch_replaces_lists() {
        let p = json!({"status": {"conditions": [{"type": "X", "status": "True"}], "phase": null}});
        let out = apply_patch(PatchKind::Merge, &pod(), p.to_string().as_bytes(), &Schema::pod()).expect("applies");
        assert_eq!(out["status"]["conditions"], json!([{"type": "X", "status": "True"}]));
        assert!(out["status"].get("phase").is_none());
    }

    #[test]
    fn json_patch_ops_and_errors() {
        let p = json!([
            {"op": "replace", "path": "/status/phase", "value": "Succeeded"},
            {"op": "add", "path": "/metadata/labels/c", "value": "3"},
            {"op": "remove", "path": "/spec/tolerations"}
        ]);
        let out = apply_patch(PatchKind::Json, &pod(), p.to_string().as_bytes(), &Schema::pod()).expect("applies");
        assert_eq!(out["status"]["phase"], "Succeeded");
        assert_eq!(out["metadata"]["labels"]["c"], "3");
        assert!(out["spec"].get("tolerations").is_none());
        let bad = json!([{"op": "test", "path": "/status/phase", "value": "Failed"}]);
        let err = apply_patch(PatchKind::Json, &pod(), bad.to_string().as_bytes(), &Schema::pod())
            .expect_err("test op fails");
        assert_eq!(err.code, 422);
        let err = apply_patch(PatchKind::Json, &pod(), b"{not json", &Schema::pod()).expect_err("undecodable");
        assert_eq!(err.code, 400);
    }

    #[test]
    fn content_types() {
        assert_eq!(PatchKind::from_content_type("application/merge-patch+json"), Some(PatchKind::Merge));
        assert_eq!(
            PatchKind::from_content_type("application/strategic-merge-patch+json; charset=utf-8"),
            Some(PatchKind::Strategic)
        );
        assert_eq!(PatchKind::from_content_type("application/json-patch+json"), Some(PatchKind::Json));
        assert_eq!(PatchKind::from_content_type("application/apply-patch+yaml"), Some(PatchKind::Apply));
        assert_eq!(PatchKind::from_content_type("application/json"), None);
    }
}
