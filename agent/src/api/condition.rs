//! The `valet.dev/ProxyReady` pod condition, written through `pods/status` with a strategic merge
//! patch (conditions merge by `type`, so the kubelet's own conditions are untouched).

use std::time::Duration;

use k8s_openapi::api::core::v1::{Pod, PodCondition};
use kube::api::{Patch, PatchParams};
use kube::{Client, Resource as _};

use crate::error::Result;
pub use crate::vocab::ProxyReady;

pub const CONDITION_TYPE: &str = "valet.dev/ProxyReady";

/// How long after its `failures`-th failure in a row a pod's condition write is tried again:
/// 1 s, doubling up to 30 s. A write that fails fast (a 500) was otherwise made again at every
/// tick, four times a second per pod, for as long as the API server failed.
pub fn retry_after(failures: u32) -> Duration {
    Duration::from_secs(1u64 << failures.saturating_sub(1).min(5)).min(Duration::from_secs(30))
}

/// Whether the pod already carries this condition with the same status and reason: then no
/// write is needed.
pub fn already_set(pod: &Pod, want: &ProxyReady) -> bool {
    current(pod).is_some_and(|c| {
        c.status == if want.ready { "True" } else { "False" } && c.reason.as_deref() == Some(want.reason)
    })
}

/// The pod's current valet condition, if any.
pub fn current(pod: &Pod) -> Option<&PodCondition> {
    pod.status.as_ref()?.conditions.as_ref()?.iter().find(|c| c.type_ == CONDITION_TYPE)
}

/// The strategic merge patch body for `want`.
pub fn patch_body(want: &ProxyReady, now: &str) -> serde_json::Value {
    serde_json::json!({
        "status": {
            "conditions": [{
                "type": CONDITION_TYPE,
                "status": if want.ready { "True" } else { "False" },
                "reason": want.reason,
                "message": want.message,
                "lastTransitionTime": now,
                "lastProbeTime": serde_json::Value::Null,
            }]
        }
    })
}

/// What the agent reads of a write's answer: the pod's version. The rest of the pod the server
/// sends back (its spec, status and managedFields, kilobytes) is skipped unread: decoded whole
/// into a `Pod` (`Api::patch_status`), it was the runtime's largest CPU in a 110-pod round.
#[derive(serde::Deserialize)]
struct Written {
    #[serde(default)]
    metadata: WrittenMeta,
}

#[derive(serde::Deserialize, Default)]
struct WrittenMeta {
    #[serde(rename = "resourceVersion")]
    resource_version: Option<String>,
}

/// Writes the condition; returns the pod's resourceVersion after the write, if the server said.
pub async fn write(client: Client, namespace: &str, name: &str, want: &ProxyReady) -> Result<Option<String>> {
    let now = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    let patch = Patch::Strategic(patch_body(want, &now));
    // `Api::patch_status`'s request, its answer read as `Written`.
    let mut req = kube::core::Request::new(Pod::url_path(&(), Some(namespace)))
        .patch_subresource("status", name, &PatchParams::default(), &patch)
        .map_err(kube::Error::BuildRequest)?;
    req.extensions_mut().insert("patch_status");
    let written: Written = client.request(req).await?;
    Ok(written.metadata.resource_version)
}

/// Whether the pod version `seen` is the version `written` or a later one. resourceVersions are
/// opaque to clients, but every server in use (etcd's revision, the fake API server) writes them
/// as increasing integers; anything else is taken as later only when equal.
pub fn at_or_after(seen: &str, written: &str) -> bool {
    match (seen.parse::<u64>(), written.parse::<u64>()) {
        (Ok(s), Ok(w)) => s >= w,
        _ => seen == written,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The write is `Api::patch_status`'s request (a strategic merge patch of `pods/status`), and
    /// of the whole pod the server sends back it reads the version; a refusal is an error.
    #[tokio::test]
    async fn a_write_patches_the_status_and_reads_the_version_back() {
        let (service, mut handle) =
            tower_test::mock::pair::<http::Request<kube::client::Body>, http::Response<kube::client::Body>>();
        let client = Client::new(service, "default");
        let server = tokio::spawn(async move {
            let (request, send) = handle.next_request().await.expect("the write");
            let seen = (request.method().clone(), request.uri().path().to_owned(), request.headers().clone());
            let answer = serde_json::json!({"kind": "Pod", "apiVersion": "v1",
                "metadata": {"name": "p", "namespace": "jobs", "uid": "u1", "resourceVersion": "42",
                    "managedFields": [{"manager": "valet", "operation": "Update", "fieldsType": "FieldsV1",
                        "fieldsV1": {"f:status": {}}}]},
                "spec": {"containers": [{"name": "app", "image": "a"}]},
                "status": {"conditions": [{"type": CONDITION_TYPE, "status": "True"}]}});
            send.send_response(http::Response::new(kube::client::Body::from(
                serde_json::to_vec(&answer).expect("json"),
            )));
            let (_, send) = handle.next_request().await.expect("the second write");
            let refusal = serde_json::json!({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                "message": "pods \"q\" not found", "reason": "NotFound", "code": 404});
            let mut response =
                http::Response::new(kube::client::Body::from(serde_json::to_vec(&refusal).expect("json")));
            *response.status_mut() = http::StatusCode::NOT_FOUND;
            send.send_response(response);
            seen
        });
        let want = ProxyReady { ready: true, reason: "ProxyReady", message: "m".into() };
        let version = write(client.clone(), "jobs", "p", &want).await.expect("written");
        assert_eq!(version.as_deref(), Some("42"));
        assert!(write(client, "jobs", "q", &want).await.is_err(), "a 404 is an error");
        let (method, path, headers) = server.await.expect("server");
        assert_eq!(method, http::Method::PATCH);
        assert_eq!(path, "/api/v1/namespaces/jobs/pods/p/status");
        assert_eq!(
            headers.get("content-type").and_then(|v| v.to_str().ok()),
            Some("application/strategic-merge-patch+json")
        );
    }

    #[test]
    fn failed_writes_back_off_up_to_half_a_minute() {
        let secs: Vec<u64> = (1..=8).map(|n| retry_after(n).as_secs()).collect();
        assert_eq!(secs, [1, 2, 4, 8, 16, 30, 30, 30]);
        assert_eq!(retry_after(u32::MAX), Duration::from_secs(30));
    }

    #[test]
    fn detects_an_unchanged_condition() {
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p"},
            "status": {"conditions": [
                {"type": "Ready", "status": "False"},
                {"type": CONDITION_TYPE, "status": "True", "reason": "ProxyReady"}
            ]}
        }))
        .expect("pod");
        let ready = ProxyReady { ready: true, reason: "ProxyReady", message: "m".into() };
        assert!(already_set(&pod, &ready));
        assert!(!already_set(&pod, &ProxyReady { ready: false, ..ready.clone() }));
        assert!(!already_set(&pod, &ProxyReady { reason: "HoldTimeout", ..ready }));
        let body = patch_body(&ProxyReady { ready: false, reason: "ProxyNotReady", message: "x".into() }, "t");
        assert_eq!(body["status"]["conditions"][0]["type"], CONDITION_TYPE);
        assert_eq!(body["status"]["conditions"][0]["status"], "False");
    }
}
