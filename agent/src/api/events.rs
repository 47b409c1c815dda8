//! Kubernetes Events on pods (what `kubectl describe pod` shows), published off the hot path.
//!
//! Each Event is one `create` of an `events.k8s.io/v1` Event, as kube's `Recorder` makes them, but
//! without its series cache: that cache keeps every Event for six minutes to count repeats, and on
//! a node running Jobs back to back it grew the agent by megabytes (the soak benchmark saw 15 →
//! 28 MiB over 3,000 Jobs). valet says each thing about a pod once or twice, so a series would
//! count nothing.

use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use k8s_openapi::api::events::v1::Event;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::{MicroTime, ObjectMeta};
use k8s_openapi::jiff::Timestamp;
use kube::Client;
use kube::api::{Api, PostParams};
use tracing::debug;

const CONTROLLER: &str = "valet-agent";

/// Publishes Events about pods as `valet-agent` on this node.
#[derive(Clone)]
pub struct EventSink {
    client: Option<Client>,
    node: String,
}

/// A reference to a pod for an Event.
pub fn pod_reference(pod: &Pod) -> ObjectReference {
    ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Pod".into()),
        name: pod.metadata.name.clone(),
        namespace: pod.metadata.namespace.clone(),
        uid: pod.metadata.uid.clone(),
        resource_version: pod.metadata.resource_version.clone(),
        ..Default::default()
    }
}

/// The Event about `reference`, named as kube's `Recorder` names them (`<object>.<time in hex>`).
fn event(reference: ObjectReference, node: &str, warning: bool, reason: &str, action: &str, note: String) -> Event {
    let now = Timestamp::now();
    Event {
        action: Some(action.to_owned()),
        reason: Some(reason.to_owned()),
        event_time: Some(MicroTime(now)),
        note: Some(note.chars().take(1000).collect()),
        metadata: ObjectMeta {
            namespace: reference.namespace.clone(),
            name: Some(format!("{}.{:x}", reference.name.as_deref().unwrap_or(CONTROLLER), now.as_nanosecond())),
            ..Default::default()
        },
        regarding: Some(reference),
        reporting_controller: Some(CONTROLLER.into()),
        reporting_instance: Some(node.to_owned()),
        type_: Some(if warning { "Warning" } else { "Normal" }.into()),
        ..Default::default()
    }
}

impl EventSink {
    pub fn new(client: Client, node: &str) -> EventSink {
        EventSink { client: Some(client), node: node.to_owned() }
    }

    /// A sink that drops everything (unit tests).
    pub fn disabled() -> EventSink {
        EventSink { client: None, node: String::new() }
    }

    /// Publishes in the background; failures are logged, never block or fail the caller.
    pub fn publish(&self, reference: ObjectReference, warning: bool, reason: &str, action: &str, note: String) {
        let Some(client) = self.client.clone() else { return };
        let namespace = reference.namespace.clone().unwrap_or_else(|| "default".into());
        let event = event(reference, &self.node, warning, reason, action, note);
        tokio::spawn(async move {
            let events: Api<Event> = Api::namespaced(client, &namespace);
            if let Err(e) = events.create(&PostParams::default(), &event).await {
                debug!("publish Event {}: {e}", event.reason.as_deref().unwrap_or_default());
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_event_names_its_pod_reporter_and_node() {
        let reference = ObjectReference {
            name: Some("job-1".into()),
            namespace: Some("jobs".into()),
            kind: Some("Pod".into()),
            ..Default::default()
        };
        let e = event(reference, "node-a", true, "HoldTimeout", "Release", "x".repeat(2000));
        assert_eq!(e.type_.as_deref(), Some("Warning"));
        assert_eq!((e.reason.as_deref(), e.action.as_deref()), (Some("HoldTimeout"), Some("Release")));
        assert_eq!(e.reporting_controller.as_deref(), Some("valet-agent"));
        assert_eq!(e.reporting_instance.as_deref(), Some("node-a"));
        assert_eq!(e.metadata.namespace.as_deref(), Some("jobs"));
        assert!(e.metadata.name.as_deref().is_some_and(|n| n.starts_with("job-1.")), "{:?}", e.metadata.name);
        assert_eq!(e.regarding.and_then(|r| r.name).as_deref(), Some("job-1"));
        assert_eq!(e.note.map(|n| n.len()), Some(1000));
    }
}
