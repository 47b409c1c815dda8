//! Kubernetes Events on pods (what `kubectl describe pod` shows), published off the hot path.

use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use kube::Client;
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use tracing::debug;

/// Publishes Events about pods as `valet-agent` on this node.
#[derive(Clone)]
pub struct EventSink {
    recorder: Option<Recorder>,
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

impl EventSink {
    pub fn new(client: Client, node: &str) -> EventSink {
        let reporter = Reporter { controller: "valet-agent".into(), instance: Some(node.to_owned()) };
        EventSink { recorder: Some(Recorder::new(client, reporter)) }
    }

    /// A sink that drops everything (unit tests).
    pub fn disabled() -> EventSink {
        EventSink { recorder: None }
    }

    /// Publishes in the background; failures are logged, never block or fail the caller.
    pub fn publish(&self, reference: ObjectReference, warning: bool, reason: &str, action: &str, note: String) {
        let Some(recorder) = self.recorder.clone() else { return };
        let event = Event {
            type_: if warning { EventType::Warning } else { EventType::Normal },
            reason: reason.to_owned(),
            note: Some(note.chars().take(1000).collect()),
            action: action.to_owned(),
            secondary: None,
        };
        tokio::spawn(async move {
            if let Err(e) = recorder.publish(&event, &reference).await {
                debug!("publish Event {}: {e}", event.reason);
            }
        });
    }
}
