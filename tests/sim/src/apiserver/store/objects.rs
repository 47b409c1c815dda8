//! The kinds besides pods and events: DaemonSets, Nodes and RuntimeClasses, read-mostly.

use serde_json::{Value, json};

use super::*;

/// The kinds besides pods and events the server keeps, read-mostly: what a node agent reads of
/// its own DaemonSet (apps/v1), of its node (v1) and of the cluster's RuntimeClasses
/// (node.k8s.io/v1), with no watch and no change history.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    DaemonSet,
    Node,
    RuntimeClass,
}

impl Kind {
    pub fn api_version(self) -> &'static str {
        match self {
            Kind::DaemonSet => "apps/v1",
            Kind::Node => "v1",
            Kind::RuntimeClass => "node.k8s.io/v1",
        }
    }
    pub fn kind(self) -> &'static str {
        match self {
            Kind::DaemonSet => "DaemonSet",
            Kind::Node => "Node",
            Kind::RuntimeClass => "RuntimeClass",
        }
    }
    /// The resource's plural name.
    pub fn resource(self) -> &'static str {
        match self {
            Kind::DaemonSet => "daemonsets",
            Kind::Node => "nodes",
            Kind::RuntimeClass => "runtimeclasses",
        }
    }
    pub fn group(self) -> &'static str {
        match self {
            Kind::DaemonSet => "apps",
            Kind::Node => "",
            Kind::RuntimeClass => "node.k8s.io",
        }
    }
    pub fn namespaced(self) -> bool {
        matches!(self, Kind::DaemonSet)
    }

    /// The 404 the real server sends: `daemonsets.apps "x" not found`, details with the group.
    pub fn not_found(self, name: &str) -> ApiError {
        let qualified = match self.group() {
            "" => self.resource().to_owned(),
            g => format!("{}.{g}", self.resource()),
        };
        let mut details = json!({"name": name, "kind": self.resource()});
        if !self.group().is_empty() {
            details["group"] = json!(self.group());
        }
        ApiError::new(404, "NotFound", format!("{qualified} \"{name}\" not found")).with_details(details)
    }
}

/// How a DaemonSet or Node is deleted ([`Store::delete_object`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Propagation {
    /// Gone at once (its dependents are then deleted by the garbage collector).
    Background,
    /// Kept with a `deletionTimestamp` and the `foregroundDeletion` finalizer until its
    /// dependents are gone.
    Foreground,
}

impl Store {
    fn object_key(kind: Kind, ns: Option<&str>, name: &str) -> (Kind, String) {
        let ns = if kind.namespaced() { ns.unwrap_or("default") } else { "" };
        (kind, key_of(ns, name))
    }

    /// Creates or replaces a DaemonSet or Node (test control, as an admin's `kubectl apply`): a
    /// new object gets a uid, creationTimestamp and generation 1; a replaced one keeps its uid
    /// and creation time, and its generation moves when its spec changed. Each write gets the
    /// next resourceVersion.
    pub(crate) fn put_object(&mut self, kind: Kind, mut obj: Value) -> Result<Value, ApiError> {
        let name = meta_str(&obj, "name").filter(|n| !n.is_empty()).map(str::to_owned).ok_or_else(|| {
            ApiError::invalid(kind.resource(), "", "metadata.name: Required value: name or generateName is required")
        })?;
        let ns = kind.namespaced().then(|| meta_str(&obj, "namespace").unwrap_or("default").to_owned());
        let key = Store::object_key(kind, ns.as_deref(), &name);
        let old = self.objects.get(&key).cloned();
        set_field(&mut obj, "apiVersion", Some(json!(kind.api_version())));
        set_field(&mut obj, "kind", Some(json!(kind.kind())));
        let rv = self.bump();
        let meta = meta_mut(&mut obj)?;
        if let Some(ns) = ns {
            meta.insert("namespace".into(), json!(ns));
        }
        match &old {
            Some(old) => {
                for field in ["uid", "creationTimestamp"] {
                    if let Some(v) = old.pointer(&format!("/metadata/{field}")) {
                        meta.insert(field.into(), v.clone());
                    }
                }
            }
            None => {
                meta.insert("uid".into(), json!(util::uuid_v4()));
                meta.insert("creationTimestamp".into(), json!(util::now_rfc3339()));
            }
        }
        meta.insert("resourceVersion".into(), json!(rv.to_string()));
        if kind == Kind::DaemonSet {
            let generation = match &old {
                Some(old) if old.get("spec") == obj.get("spec") => old.pointer("/metadata/generation").cloned(),
                Some(old) => Some(json!(old.pointer("/metadata/generation").and_then(Value::as_i64).unwrap_or(0) + 1)),
                None => Some(json!(1)),
            };
            meta_mut(&mut obj)?.insert("generation".into(), generation.unwrap_or(json!(1)));
        }
        self.objects.insert(key, obj.clone());
        Ok(obj)
    }

    pub(crate) fn get_object(&self, kind: Kind, ns: Option<&str>, name: &str) -> Result<Value, ApiError> {
        self.objects.get(&Store::object_key(kind, ns, name)).cloned().ok_or_else(|| kind.not_found(name))
    }

    /// The objects of a kind (in `ns` when namespaced and given) matching `labels`, as a list.
    pub(crate) fn list_objects(&self, kind: Kind, ns: Option<&str>, labels: &LabelSelector) -> Value {
        let items: Vec<Value> = self
            .objects
            .iter()
            .filter(|((k, _), o)| {
                *k == kind
                    && (!kind.namespaced()
                        || ns.is_none_or(|ns| o.pointer("/metadata/namespace").and_then(Value::as_str) == Some(ns)))
                    && labels.matches(o)
            })
            .map(|(_, o)| o.clone())
            .collect();
        json!({"kind": format!("{}List", kind.kind()), "apiVersion": kind.api_version(),
               "metadata": {"resourceVersion": self.rv.to_string()}, "items": items})
    }

    /// Deletes a DaemonSet or Node as `kubectl delete` would, with `propagation`.
    pub(crate) fn delete_object(
        &mut self,
        kind: Kind,
        ns: Option<&str>,
        name: &str,
        propagation: Propagation,
    ) -> Result<Value, ApiError> {
        let key = Store::object_key(kind, ns, name);
        let Some(mut obj) = self.objects.get(&key).cloned() else { return Err(kind.not_found(name)) };
        match propagation {
            Propagation::Background => {
                self.bump();
                self.objects.remove(&key);
                Ok(obj)
            }
            Propagation::Foreground => {
                if obj.pointer("/metadata/deletionTimestamp").is_some() {
                    return Ok(obj);
                }
                let rv = self.bump();
                let meta = meta_mut(&mut obj)?;
                meta.insert("deletionTimestamp".into(), json!(util::now_rfc3339()));
                meta.insert("deletionGracePeriodSeconds".into(), json!(0));
                let finalizers = meta.entry("finalizers").or_insert_with(|| json!([]));
                if let Some(list) = finalizers.as_array_mut() {
                    list.push(json!("foregroundDeletion"));
                }
                meta.insert("resourceVersion".into(), json!(rv.to_string()));
                self.objects.insert(key, obj.clone());
                Ok(obj)
            }
        }
    }
}
