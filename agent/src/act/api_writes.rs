//! Writes to the API server: the pod's condition, and Events on the pod.

use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use tokio::sync::mpsc;

use super::PodFeedback;
use crate::api::condition;
use crate::api::events::{EventSink, pod_reference};
use crate::effect::Feedback;
use crate::sidecar::Pending;
use crate::vocab::ProxyReady;

/// The API writes of every pod (effects `WriteCondition`, `Publish`).
pub struct ApiWrites {
    client: Client,
    events: EventSink,
    /// Where each condition write's outcome goes.
    reports: mpsc::UnboundedSender<PodFeedback>,
}

impl ApiWrites {
    pub fn new(client: Client, events: EventSink, reports: mpsc::UnboundedSender<PodFeedback>) -> ApiWrites {
        ApiWrites { client, events, reports }
    }

    /// The write of pod `uid`'s condition (effect `WriteCondition`; `pod`: its latest object),
    /// which reports its outcome: a task for the caller to start (after a batch's releases).
    pub fn write_condition(&self, uid: &str, pod: Option<&Pod>, want: ProxyReady) -> Pending<()> {
        let (client, reports, uid) = (self.client.clone(), self.reports.clone(), uid.to_owned());
        let (namespace, name) = pod.map_or_else(Default::default, |p| {
            (p.metadata.namespace.clone().unwrap_or_default(), p.metadata.name.clone().unwrap_or_default())
        });
        Box::pin(async move {
            let (error, version) = match condition::write(client, &namespace, &name, &want).await {
                Ok(version) => (None, version),
                Err(e) => (Some(e.chain().to_string()), None),
            };
            let _ = reports.send((uid, Feedback::ConditionWritten { want, error, version }));
        })
    }

    /// Publishes an Event on `pod` (effect `Publish`), if there is its object.
    pub fn publish(&self, pod: Option<&Pod>, warning: bool, reason: &str, action: &str, note: String) {
        if let Some(pod) = pod {
            self.events.publish(pod_reference(pod), warning, reason, action, note);
        }
    }
}
