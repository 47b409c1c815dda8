//! Reading a pod's container statuses as the API reports them: which container an id belongs
//! to, a container's current id, the pod's display name. Pure functions over the Pod object.

use k8s_openapi::api::core::v1::{ContainerStatus, Pod};

use crate::cgroup::layout::split_container_id;

/// Statuses of app/sidecar containers and init containers.
pub fn statuses(pod: &Pod) -> impl Iterator<Item = &ContainerStatus> {
    let status = pod.status.as_ref();
    status
        .and_then(|s| s.container_statuses.as_ref())
        .into_iter()
        .flatten()
        .chain(status.and_then(|s| s.init_container_statuses.as_ref()).into_iter().flatten())
}

/// The 64-hex id in a status's `containerID` (`containerd://<id>`).
pub fn hex_id(status_id: Option<&str>) -> Option<&str> {
    status_id.and_then(split_container_id).map(|(_, id)| id)
}

/// The current container id (64 hex) of a container, from the API.
pub fn current_id(pod: &Pod, name: &str) -> Option<String> {
    statuses(pod).find(|s| s.name == name).and_then(|s| hex_id(s.container_id.as_deref())).map(str::to_owned)
}

/// The container a container id belongs to, from the API: its current instance or the one
/// before (`lastState.terminated`, a container the kubelet restarted).
pub fn name_of_id<'p>(pod: &'p Pod, id: &str) -> Option<&'p str> {
    // A status id that does not end with `id` is not its: the scheme and the id's form are
    // checked only on one that does (the loop asks this for each container of a pod, many times
    // a step).
    let is = |status_id: Option<&str>| status_id.is_some_and(|s| s.ends_with(id)) && hex_id(status_id) == Some(id);
    statuses(pod).find_map(|s| {
        let previous =
            s.last_state.as_ref().and_then(|l| l.terminated.as_ref()).and_then(|t| t.container_id.as_deref());
        (is(s.container_id.as_deref()) || is(previous)).then_some(s.name.as_str())
    })
}

/// The pod has finished for good (phase Succeeded or Failed): every container has ended and
/// nothing is left to quit, hold or probe.
pub fn terminal(pod: &Pod) -> bool {
    matches!(pod.status.as_ref().and_then(|s| s.phase.as_deref()), Some("Succeeded" | "Failed"))
}

/// `namespace/name` for logs.
pub fn pod_name(pod: &Pod) -> String {
    format!(
        "{}/{}",
        pod.metadata.namespace.as_deref().unwrap_or("default"),
        pod.metadata.name.as_deref().unwrap_or("?")
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn maps_ids_to_names_across_restarts() {
        let a = "a".repeat(64);
        let b = "b".repeat(64);
        let c = "c".repeat(64);
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "p", "namespace": "jobs"},
            "status": {
                "containerStatuses": [{
                    "name": "app", "image": "i", "imageID": "", "ready": false, "restartCount": 1,
                    "containerID": format!("containerd://{b}"),
                    "lastState": {"terminated": {"exitCode": 1, "containerID": format!("containerd://{a}")}}
                }],
                "initContainerStatuses": [{
                    "name": "istio-init", "image": "i", "imageID": "", "ready": false, "restartCount": 0,
                    "containerID": format!("cri-o://{c}")
                }]
            }
        }))
        .expect("pod");
        assert_eq!(current_id(&pod, "app").as_deref(), Some(b.as_str()));
        assert_eq!(name_of_id(&pod, &a), Some("app"), "the instance before the restart");
        assert_eq!(name_of_id(&pod, &b), Some("app"));
        assert_eq!(name_of_id(&pod, &c), Some("istio-init"));
        assert_eq!(name_of_id(&pod, &"d".repeat(64)), None);
        assert_eq!(current_id(&pod, "nope"), None);
        assert_eq!(pod_name(&pod), "jobs/p");
        assert!(!terminal(&pod), "no phase yet");
        for (phase, done) in [("Pending", false), ("Running", false), ("Succeeded", true), ("Failed", true)] {
            let p: Pod = serde_json::from_value(serde_json::json!({"status": {"phase": phase}})).expect("pod");
            assert_eq!(terminal(&p), done, "{phase}");
        }
    }
}
