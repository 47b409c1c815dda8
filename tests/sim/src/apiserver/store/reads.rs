//! Reads of the pods at a resourceVersion: lists (consistent pages with continue tokens, exact
//! lists of the past rebuilt from the change history) and watches (their start and each drain).
use std::collections::BTreeMap;
use std::sync::Arc;

use serde_json::{Map, Value, json};

use super::*;

impl Store {
    /// The pods as they were at `rv` (rebuilt by undoing later changes).
    pub(super) fn pods_at(&self, rv: u64) -> BTreeMap<String, Arc<Value>> {
        let mut pods = self.pods.clone();
        for c in self.history.iter().rev() {
            if c.rv <= rv {
                break;
            }
            match (&c.ty, &c.prev) {
                (ChangeType::Added, _) | (_, None) => {
                    pods.remove(&c.key);
                }
                (_, Some(prev)) => {
                    pods.insert(c.key.clone(), prev.clone());
                }
            }
        }
        pods
    }

    /// Where a list starts: the resourceVersion of its snapshot, the key it continues after, and
    /// its limit, from the list's parameters (the real server's errors for the ones it refuses).
    fn list_start(&self, p: &ListParams) -> Result<(u64, Option<String>, Option<usize>), ApiError> {
        let rv_param = p.resource_version.as_deref().filter(|s| !s.is_empty());
        let rv_match = p.resource_version_match.as_deref().filter(|s| !s.is_empty());
        let start = if let Some(token) = p.continue_token.as_deref().filter(|s| !s.is_empty()) {
            if rv_param.is_some() && rv_param != Some("0") {
                return Err(ApiError::bad_request("specifying resource version is not allowed when using continue"));
            }
            let (rv, start) = decode_continue(token)?;
            if rv < self.floor {
                return Err(ApiError::expired(
                    "The provided continue parameter is too old to display a consistent list result. You can start a new list without the continue parameter, or use the continue token in this response to retrieve the remainder of the results. Continuing with the provided token results in an inconsistent list - objects that were created, modified, or deleted between the time the first chunk was returned and now may show up in the list.",
                ));
            }
            (rv, Some(start), p.limit)
        } else {
            if rv_match.is_some() && rv_param.is_none() {
                return Err(ApiError::bad_request(
                    "resourceVersionMatch is forbidden unless resourceVersion is provided",
                ));
            }
            match (rv_param, rv_match) {
                (None, _) => (self.rv, None, p.limit),
                (Some("0"), Some("Exact")) => {
                    return Err(ApiError::new(
                        422,
                        "Invalid",
                        "ListOptions.meta.k8s.io \"\" is invalid: resourceVersionMatch: Forbidden: resourceVersionMatch \"exact\" is forbidden for resourceVersion \"0\"",
                    ));
                }
                // RV 0 is served from the watch cache, which ignores limit.
                (Some("0"), _) => (self.rv, None, None),
                (Some(s), m) => {
                    let n = parse_rv(s)?;
                    if n > self.rv {
                        return Err(too_large(n, self.rv));
                    }
                    match m {
                        Some("Exact") => {
                            if n < self.floor {
                                return Err(ApiError::expired("The resourceVersion for the provided list is too old."));
                            }
                            (n, None, p.limit)
                        }
                        None | Some("NotOlderThan") => (self.rv, None, p.limit),
                        Some(other) => {
                            return Err(ApiError::new(
                                422,
                                "Invalid",
                                format!(
                                    "ListOptions.meta.k8s.io \"\" is invalid: resourceVersionMatch: Unsupported value: \"{other}\": supported values: \"Exact\", \"NotOlderThan\", \"\""
                                ),
                            ));
                        }
                    }
                }
            }
        };
        Ok(start)
    }

    /// A PodList, with the real server's resourceVersion/limit/continue semantics.
    pub(crate) fn list_pods(&self, filter: &Filter, p: &ListParams) -> Result<Value, ApiError> {
        let (snapshot_rv, start_after, limit) = self.list_start(p)?;
        let snapshot;
        let pods = if snapshot_rv == self.rv {
            &self.pods
        } else {
            snapshot = self.pods_at(snapshot_rv);
            &snapshot
        };
        let range: Box<dyn Iterator<Item = (&String, &Arc<Value>)>> = match (&start_after, &filter.namespace) {
            (Some(start), _) => {
                Box::new(pods.range::<String, _>((std::ops::Bound::Excluded(start), std::ops::Bound::Unbounded)))
            }
            (None, Some(ns)) => Box::new(pods.range::<String, _>(format!("{ns}/")..)),
            (None, None) => Box::new(pods.iter()),
        };
        let mut matching = range.filter(|(_, p)| filter.matches(p, FieldKind::Pod));
        let mut items = Vec::new();
        let mut last_key = None;
        let limit = limit.filter(|l| *l > 0);
        for (k, pod) in matching.by_ref() {
            if limit.is_some_and(|l| items.len() >= l) {
                // There is at least one more: put it back by counting it below.
                let remaining = 1 + matching.count();
                return Ok(self.list_object(
                    "PodList",
                    "v1",
                    snapshot_rv,
                    items,
                    last_key.map(|k: &String| (encode_continue(snapshot_rv, k), remaining)),
                    filter.has_selectors(),
                ));
            }
            items.push(strip_type_meta(pod));
            last_key = Some(k);
        }
        Ok(self.list_object("PodList", "v1", snapshot_rv, items, None, filter.has_selectors()))
    }

    pub(super) fn list_object(
        &self,
        kind: &str,
        api_version: &str,
        rv: u64,
        items: Vec<Value>,
        more: Option<(String, usize)>,
        has_selectors: bool,
    ) -> Value {
        let mut meta = Map::new();
        meta.insert("resourceVersion".into(), json!(rv.to_string()));
        if let Some((token, remaining)) = more {
            meta.insert("continue".into(), json!(token));
            // The real server only knows the remaining count when no selector filters the range.
            if !has_selectors {
                meta.insert("remainingItemCount".into(), json!(remaining));
            }
        }
        json!({"kind": kind, "apiVersion": api_version, "metadata": meta, "items": items})
    }

    /// Where a new watch starts: the synthetic ADDED objects and the RV after which changes follow.
    pub(crate) fn watch_start(
        &self,
        filter: &Filter,
        rv_param: Option<&str>,
        send_initial: bool,
    ) -> Result<(Vec<Arc<Value>>, u64), ApiError> {
        let rv_param = rv_param.filter(|s| !s.is_empty());
        let initial = |s: &Store| -> Vec<Arc<Value>> {
            let iter: Box<dyn Iterator<Item = &Arc<Value>>> = match &filter.namespace {
                Some(ns) => Box::new(s.pods.range::<String, _>(format!("{ns}/")..).map(|(_, v)| v)),
                None => Box::new(s.pods.values()),
            };
            iter.filter(|p| filter.matches(p, FieldKind::Pod)).cloned().collect()
        };
        match rv_param {
            None | Some("0") => Ok((initial(self), self.rv)),
            Some(s) => {
                let n = parse_rv(s)?;
                if send_initial {
                    if n > self.rv {
                        return Err(too_large(n, self.rv));
                    }
                    return Ok((initial(self), self.rv));
                }
                if n < self.floor {
                    return Err(ApiError::expired(format!("too old resource version: {n} ({})", self.floor)));
                }
                Ok((Vec::new(), n))
            }
        }
    }

    /// The events a watch that has seen everything up to `last_rv` must get next, and the RV it
    /// has then seen. A pod that stops matching is sent as DELETED, one that starts as ADDED.
    pub(crate) fn watch_drain(&self, filter: &Filter, last_rv: u64) -> Result<(Vec<WatchEvent>, u64), ApiError> {
        if last_rv < self.live_floor {
            return Err(ApiError::expired(format!("too old resource version: {last_rv} ({})", self.floor)));
        }
        let start = self.history.partition_point(|c| c.rv <= last_rv);
        let mut out = Vec::new();
        for c in self.history.iter().skip(start) {
            let now = c.ty != ChangeType::Deleted && filter.matches(&c.object, FieldKind::Pod);
            let before = match c.ty {
                ChangeType::Added => false,
                ChangeType::Deleted => filter.matches(&c.object, FieldKind::Pod),
                ChangeType::Modified => c.prev.as_ref().is_some_and(|p| filter.matches(p, FieldKind::Pod)),
            };
            let ty = match (before, now) {
                (false, true) => ChangeType::Added,
                (true, true) => ChangeType::Modified,
                (true, false) => ChangeType::Deleted,
                (false, false) => continue,
            };
            out.push((ty, c.object.clone()));
        }
        Ok((out, self.rv.max(last_rv)))
    }

    // ---- events ----
}

/// Continue tokens look like the real server's: base64 of `{"v":"meta.k8s.io/v1","rv":N,"start":"ns/name\u0000"}`.
pub(super) fn encode_continue(rv: u64, last_key: &str) -> String {
    let body = json!({"v": "meta.k8s.io/v1", "rv": rv, "start": format!("{last_key}\u{0}")});
    base64::engine::general_purpose::URL_SAFE.encode(body.to_string())
}

pub(super) fn decode_continue(token: &str) -> Result<(u64, String), ApiError> {
    let bad = || ApiError::bad_request(format!("continue key is not valid: {token}"));
    let bytes = base64::engine::general_purpose::URL_SAFE
        .decode(token)
        .or_else(|_| base64::engine::general_purpose::STANDARD.decode(token))
        .map_err(|_| bad())?;
    let v: Value = serde_json::from_slice(&bytes).map_err(|_| bad())?;
    let rv = v.get("rv").and_then(Value::as_u64).ok_or_else(bad)?;
    let start = v.get("start").and_then(Value::as_str).ok_or_else(bad)?;
    // The token names the first key to return ("last\0"); the range is exclusive of "last".
    Ok((rv, start.trim_end_matches('\u{0}').to_string()))
}
