//! `metadata.managedFields`, as a real API server keeps them on every pod it writes: an entry
//! per field manager, operation and subresource, with the set of fields that manager last set
//! (`FieldsV1`). A field one manager sets is taken from every other manager's set; an entry whose
//! set is empty is dropped. The manager is the writer's user agent up to its first `/`, as the
//! API server's default field manager is (`prefixFromUserAgent`).
//!
//! The field paths follow structured-merge-diff's keys closely enough for their size: `f:<name>`
//! for an object's field, `k:{...}` for an item of a list keyed by `name`, `type`,
//! `containerPort` (with `protocol`) or `mountPath`, and `.` for a new list item or map (labels,
//! annotations) itself. Other lists (a container's args and command) are atomic: owned whole.

use serde_json::{Map, Value, json};

/// Who writes: the field manager and the subresource written (`None`: the pod itself).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Writer {
    pub manager: String,
    pub subresource: Option<&'static str>,
}

impl Writer {
    /// The writer of a request with `user_agent` (its product, before the first `/`).
    pub fn from_user_agent(user_agent: &str, status: bool) -> Writer {
        let manager = user_agent.split('/').next().unwrap_or_default().trim();
        let manager = if manager.is_empty() { "unknown" } else { manager };
        Writer { manager: manager.to_owned(), subresource: status.then_some("status") }
    }

    /// The writer of a request: its `fieldManager` if it names one, else its user agent's.
    pub fn of_request(field_manager: Option<&str>, user_agent: &str, status: bool) -> Writer {
        Writer::from_user_agent(field_manager.filter(|m| !m.is_empty()).unwrap_or(user_agent), status)
    }

    /// The test's own writes, which no real component makes.
    pub fn control() -> Writer {
        Writer { manager: "test-control".into(), subresource: None }
    }
}

/// Metadata the server owns: never in a manager's set.
const SERVER_OWNED: [&str; 9] = [
    "name",
    "namespace",
    "uid",
    "resourceVersion",
    "creationTimestamp",
    "generation",
    "managedFields",
    "deletionTimestamp",
    "deletionGracePeriodSeconds",
];

/// Records `writer`'s write of `new` (over `old`, None for a create) in `new`'s managedFields,
/// carried over from `old`. A create's status is the server's, not the creator's.
pub(super) fn record(new: &mut Value, old: Option<&Value>, writer: &Writer, now: &str) {
    let mut entries: Vec<Value> =
        old.and_then(|o| o.pointer("/metadata/managedFields")).and_then(Value::as_array).cloned().unwrap_or_default();
    let mut set = Map::new();
    let mut gone = Map::new();
    match old {
        Some(old) => {
            changed(&managed_view(old), &managed_view(new), &mut set, false);
            changed(&managed_view(new), &managed_view(old), &mut gone, true);
        }
        None => {
            let mut view = managed_view(new);
            if let Some(m) = view.as_object_mut() {
                m.remove("status");
            }
            changed(&Value::Null, &view, &mut set, false);
        }
    }
    for entry in &mut entries {
        if let Some(fields) = entry.get_mut("fieldsV1").and_then(Value::as_object_mut) {
            subtract(fields, &set);
            subtract(fields, &gone);
        }
    }
    let subresource = writer.subresource.map(Value::from);
    let mine = entries.iter().position(|e| {
        e["manager"] == writer.manager.as_str()
            && e["operation"] == "Update"
            && e.get("subresource").cloned().unwrap_or(Value::Null) == subresource.clone().unwrap_or(Value::Null)
    });
    if !set.is_empty() {
        let entry = match mine {
            Some(i) => &mut entries[i],
            None => {
                let mut e = json!({"manager": writer.manager, "operation": "Update", "apiVersion": "v1",
                                   "fieldsType": "FieldsV1", "fieldsV1": {}});
                if let Some(s) = subresource {
                    e["subresource"] = s;
                }
                entries.push(e);
                entries.last_mut().expect("just pushed")
            }
        };
        entry["time"] = json!(now);
        if let Some(fields) = entry.get_mut("fieldsV1").and_then(Value::as_object_mut) {
            union(fields, &set);
        }
    }
    entries.retain(|e| e.get("fieldsV1").and_then(Value::as_object).is_some_and(|f| !f.is_empty()));
    if let Some(meta) = new.get_mut("metadata").and_then(Value::as_object_mut) {
        if entries.is_empty() {
            meta.remove("managedFields");
        } else {
            meta.insert("managedFields".into(), Value::Array(entries));
        }
    }
}

/// The object as managers own it: without kind, apiVersion and the server's metadata.
fn managed_view(obj: &Value) -> Value {
    let mut view = obj.clone();
    if let Some(m) = view.as_object_mut() {
        m.remove("kind");
        m.remove("apiVersion");
        if let Some(meta) = m.get_mut("metadata").and_then(Value::as_object_mut) {
            for field in SERVER_OWNED {
                meta.remove(field);
            }
        }
    }
    view
}

/// Adds to `out` the paths of `new` that are not in `old` as they are (with `leaves_only`: the
/// paths of `new` missing from `old` entirely, for what a write removed).
fn changed(old: &Value, new: &Value, out: &mut Map<String, Value>, leaves_only: bool) {
    let Some(fields) = new.as_object() else { return };
    for (name, value) in fields {
        let before = old.get(name);
        if before == Some(value) || (leaves_only && before.is_some() && !value.is_object()) {
            continue;
        }
        let key = format!("f:{name}");
        let mut node = Map::new();
        path_of(before.unwrap_or(&Value::Null), value, &mut node, leaves_only, is_map(name));
        if !leaves_only || before.is_none() || !node.is_empty() {
            merge_into(out, key, node);
        }
    }
}

/// The set below one field: its own changed paths.
fn path_of(old: &Value, new: &Value, node: &mut Map<String, Value>, leaves_only: bool, map: bool) {
    match new {
        Value::Object(_) => {
            // The map itself, where it is new.
            if map && old.is_null() {
                node.insert(".".into(), json!({}));
            }
            changed(old, new, node, leaves_only);
        }
        Value::Array(items) => {
            for item in items {
                let Some(key) = item_key(item) else {
                    // An atomic list: owned whole.
                    node.clear();
                    return;
                };
                let before = old.as_array().and_then(|list| list.iter().find(|o| item_key(o).as_ref() == Some(&key)));
                if before == Some(item) {
                    continue;
                }
                let mut child = Map::new();
                if before.is_none() {
                    // The item itself, where it is new.
                    child.insert(".".into(), json!({}));
                }
                if item.is_object() {
                    changed(before.unwrap_or(&Value::Null), item, &mut child, leaves_only);
                }
                if !leaves_only || before.is_none() {
                    merge_into(node, key, child);
                }
            }
        }
        _ => {}
    }
}

/// Fields whose value is a map of the user's keys (a `.` marks the map itself).
fn is_map(name: &str) -> bool {
    matches!(name, "labels" | "annotations" | "nodeSelector" | "limits" | "requests")
}

/// A list item's key: `k:{...}` by its merge key; None: an atomic list.
fn item_key(item: &Value) -> Option<String> {
    match item {
        Value::Object(m) => {
            let keyed: Map<String, Value> = if let Some(port) = m.get("containerPort") {
                let protocol = m.get("protocol").cloned().unwrap_or_else(|| json!("TCP"));
                [("containerPort".to_owned(), port.clone()), ("protocol".to_owned(), protocol)].into_iter().collect()
            } else {
                let field = ["name", "type", "mountPath"].into_iter().find(|f| m.contains_key(*f))?;
                [(field.to_owned(), m[field].clone())].into_iter().collect()
            };
            Some(format!("k:{}", Value::Object(keyed)))
        }
        // Lists of scalars (a container's args and command) are atomic in a pod.
        _ => None,
    }
}

fn merge_into(out: &mut Map<String, Value>, key: String, node: Map<String, Value>) {
    match out.get_mut(&key).and_then(Value::as_object_mut) {
        Some(existing) => union(existing, &node),
        None => {
            out.insert(key, Value::Object(node));
        }
    }
}

fn union(into: &mut Map<String, Value>, from: &Map<String, Value>) {
    for (k, v) in from {
        merge_into(into, k.clone(), v.as_object().cloned().unwrap_or_default());
    }
}

/// Takes `set`'s paths out of `from`: a leaf of `set` takes the whole subtree; a node emptied
/// by it goes too.
fn subtract(from: &mut Map<String, Value>, set: &Map<String, Value>) {
    for (k, v) in set {
        let below = v.as_object().filter(|m| !m.is_empty());
        match below {
            None => {
                from.remove(k);
            }
            Some(below) => {
                if let Some(node) = from.get_mut(k).and_then(Value::as_object_mut) {
                    subtract(node, below);
                    if node.is_empty() || (node.len() == 1 && node.contains_key(".")) {
                        from.remove(k);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod() -> Value {
        json!({"kind": "Pod", "apiVersion": "v1",
               "metadata": {"name": "p", "namespace": "jobs", "uid": "u", "resourceVersion": "3",
                            "labels": {"valet.dev/enabled": "true"}},
               "spec": {"nodeName": "n1", "containers": [{"name": "app", "image": "a:1", "args": ["x", "y"]}]},
               "status": {"phase": "Pending"}})
    }

    fn fields(obj: &Value, manager: &str) -> Value {
        obj["metadata"]["managedFields"]
            .as_array()
            .and_then(|es| es.iter().find(|e| e["manager"] == manager))
            .map(|e| e["fieldsV1"].clone())
            .unwrap_or(Value::Null)
    }

    #[test]
    fn a_create_owns_what_its_creator_sent_and_not_the_status() {
        let mut p = pod();
        record(&mut p, None, &Writer::from_user_agent("kube-controller-manager/v1.33.0 (linux/amd64)", false), "t");
        assert_eq!(
            fields(&p, "kube-controller-manager"),
            json!({"f:metadata": {"f:labels": {".": {}, "f:valet.dev/enabled": {}}},
                   "f:spec": {"f:nodeName": {}, "f:containers": {"k:{\"name\":\"app\"}": {".": {}, "f:name": {},
                              "f:image": {}, "f:args": {}}}}})
        );
        assert_eq!(p["metadata"]["managedFields"][0]["operation"], "Update");
        assert!(p["metadata"]["managedFields"][0].get("subresource").is_none());
    }

    #[test]
    fn a_status_write_is_its_managers_and_a_field_set_again_changes_hands() {
        let mut created = pod();
        record(&mut created, None, &Writer::from_user_agent("kube-controller-manager/v1", false), "t0");
        let mut ran = created.clone();
        ran["status"] = json!({"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]});
        record(&mut ran, Some(&created), &Writer::from_user_agent("kubelet/v1.33.0", true), "t1");
        let kubelet = ran["metadata"]["managedFields"].as_array().expect("entries").last().cloned().expect("entry");
        assert_eq!((kubelet["manager"].clone(), kubelet["subresource"].clone()), (json!("kubelet"), json!("status")));
        assert_eq!(
            kubelet["fieldsV1"],
            json!({"f:status": {"f:phase": {}, "f:conditions": {"k:{\"type\":\"Ready\"}": {".": {}, "f:type": {},
                   "f:status": {}}}}})
        );
        // The agent's condition: its own entry; the kubelet keeps what it set.
        let mut gated = ran.clone();
        gated["status"]["conditions"]
            .as_array_mut()
            .expect("conditions")
            .push(json!({"type": "valet.dev/ProxyReady", "status": "True"}));
        record(&mut gated, Some(&ran), &Writer::from_user_agent("valet-agent/0.1.0", true), "t2");
        assert_eq!(
            fields(&gated, "valet-agent"),
            json!({"f:status": {"f:conditions": {"k:{\"type\":\"valet.dev/ProxyReady\"}": {".": {}, "f:type": {},
                   "f:status": {}}}}})
        );
        assert_eq!(fields(&gated, "kubelet"), kubelet["fieldsV1"]);
        // The label set again by someone else: theirs now, and gone from the creator's set.
        let mut relabelled = gated.clone();
        relabelled["metadata"]["labels"]["valet.dev/enabled"] = json!("false");
        record(&mut relabelled, Some(&gated), &Writer::control(), "t3");
        assert_eq!(
            fields(&relabelled, "test-control"),
            json!({"f:metadata": {"f:labels": {"f:valet.dev/enabled": {}}}})
        );
        assert!(fields(&relabelled, "kube-controller-manager")["f:metadata"].is_null(), "{relabelled:#}");
        // A write that changes nothing leaves the entries as they were.
        let mut same = relabelled.clone();
        record(&mut same, Some(&relabelled), &Writer::control(), "t4");
        assert_eq!(same["metadata"]["managedFields"], relabelled["metadata"]["managedFields"]);
    }
}
