//! The `valet.dev/ProxyReady` pod condition, written through `pods/status` with a strategic merge
//! patch (conditions merge by `type`, so the kubelet's own conditions are untouched).

use std::time::Duration;

use k8s_openapi::api::core::v1::{Pod, PodCondition};
use kube::api::{Patch, PatchParams};
use kube::{Api, Client};

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

/// Writes the condition; returns the pod's resourceVersion after the write, if the server said.
pub async fn write(client: Client, namespace: &str, name: &str, want: &ProxyReady) -> Result<Option<String>> {
    let api: Api<Pod> = Api::namespaced(client, namespace);
    let now = chrono::Utc::now().to_rfc3339_opts(chrono::SecondsFormat::Secs, true);
    let pod = api.patch_status(name, &PatchParams::default(), &Patch::Strategic(patch_body(want, &now))).await?;
    Ok(pod.metadata.resource_version)
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
