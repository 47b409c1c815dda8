//! Events (core v1 and events.k8s.io/v1, one store): created, read, written, deleted, listed.

use serde_json::{Value, json};

use super::*;

impl Store {
    pub(crate) fn create_event(&mut self, group: EventGroup, path_ns: &str, mut obj: Value) -> Result<Value, ApiError> {
        {
            let meta = meta_mut(&mut obj)?;
            match meta.get("namespace").and_then(Value::as_str) {
                Some(b) if b != path_ns => {
                    return Err(ApiError::bad_request(
                        "the namespace of the provided object does not match the namespace sent on the request",
                    ));
                }
                _ => {
                    meta.insert("namespace".into(), json!(path_ns));
                }
            }
        }
        let name = self.assign_name(&mut obj, "events", |s, n| s.events.contains_key(&(group, key_of(path_ns, n))))?;
        let key = (group, key_of(path_ns, &name));
        if self.events.contains_key(&key) {
            return Err(ApiError::already_exists(&event_resource(group), &name));
        }
        stamp_new_object(&mut obj, group.api_version(), "Event")?;
        let rv = self.bump();
        meta_mut(&mut obj)?.insert("resourceVersion".into(), json!(rv.to_string()));
        self.events.insert(key, obj.clone());
        Ok(obj)
    }

    pub(crate) fn get_event(&self, group: EventGroup, ns: &str, name: &str) -> Result<Value, ApiError> {
        self.events
            .get(&(group, key_of(ns, name)))
            .cloned()
            .ok_or_else(|| ApiError::not_found(&event_resource(group), name))
    }

    /// PUT (`replace = Some(body)`) or PATCH of an event.
    pub(crate) fn write_event(
        &mut self,
        group: EventGroup,
        ns: &str,
        name: &str,
        patch: Option<(PatchKind, &[u8])>,
        replace: Option<Value>,
    ) -> Result<Value, ApiError> {
        let key = (group, key_of(ns, name));
        let old = self.events.get(&key).cloned().ok_or_else(|| ApiError::not_found(&event_resource(group), name))?;
        let mut new = match (patch, replace) {
            (Some((kind, body)), _) => apply_patch(kind, &old, body, &Schema::event()).map_err(|e| match e.code {
                400 => ApiError::bad_request(e.message),
                _ => ApiError::new(422, "Invalid", e.message),
            })?,
            (None, Some(v)) => {
                if let Some(want) = meta_str(&v, "resourceVersion").filter(|s| !s.is_empty())
                    && Some(want) != meta_str(&old, "resourceVersion")
                {
                    return Err(ApiError::conflict(&event_resource(group), name));
                }
                v
            }
            (None, None) => old.clone(),
        };
        for field in ["name", "namespace", "uid", "creationTimestamp"] {
            let v = old["metadata"][field].clone();
            meta_mut(&mut new)?.insert(field.into(), v);
        }
        set_field(&mut new, "kind", Some(json!("Event")));
        set_field(&mut new, "apiVersion", Some(json!(group.api_version())));
        let rv = self.bump();
        meta_mut(&mut new)?.insert("resourceVersion".into(), json!(rv.to_string()));
        self.events.insert(key, new.clone());
        Ok(new)
    }

    pub(crate) fn delete_event(&mut self, group: EventGroup, ns: &str, name: &str) -> Result<Value, ApiError> {
        let out = self
            .events
            .remove(&(group, key_of(ns, name)))
            .ok_or_else(|| ApiError::not_found(&event_resource(group), name))?;
        self.bump();
        Ok(out)
    }

    pub(crate) fn list_events(&self, group: EventGroup, filter: &Filter) -> Value {
        let items: Vec<Value> = self
            .events
            .iter()
            .filter(|((g, _), e)| *g == group && filter.matches(e, FieldKind::Event))
            .map(|(_, e)| strip_type_meta(e))
            .collect();
        self.list_object("EventList", group.api_version(), self.rv, items, None, true)
    }
}

pub(super) fn event_resource(group: EventGroup) -> String {
    match group {
        EventGroup::Core => "events".into(),
        EventGroup::EventsV1 => "events.events.k8s.io".into(),
    }
}
