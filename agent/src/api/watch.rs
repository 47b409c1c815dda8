//! The pod router's watch on the opted-in pods of this node, and the observer's on all of them:
//! one watch of every pod shared by both when the observer runs, else the router's own of the
//! labelled pods (list, then watch; re-list on `410 Gone` and after dropped connections, with
//! backoff), through kube-runtime's watcher.

use std::collections::HashSet;
use std::time::Duration;

use futures::{Stream, TryStreamExt as _};
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::{WatchStreamExt as _, watcher};
use kube::{Api, Client};

use super::lean_pod::LeanPod;

/// The opt-in label.
pub const ENABLED_LABEL: &str = "valet.dev/enabled";

/// Whether `pod` carries the opt-in label (`valet.dev/enabled: "true"`): the one check the
/// pod router, the observer and its looks share, so that the server's label filter is checked
/// again on our side.
pub fn opted_in(pod: &Pod) -> bool {
    pod.metadata.labels.as_ref().and_then(|l| l.get(ENABLED_LABEL)).map(String::as_str) == Some("true")
}

/// A re-list's bookkeeping, for the pod router and the observer alike: the pods a list named,
/// so that the pods known before it and absent from it are found gone when it ends.
#[derive(Debug, Default)]
pub struct Relist(Option<HashSet<String>>);

impl Relist {
    /// A list begins (`watcher::Event::Init`).
    pub fn begin(&mut self) {
        self.0 = Some(HashSet::new());
    }

    /// The list named `pod` (`watcher::Event::InitApply`).
    pub fn saw(&mut self, pod: &Pod) {
        if let (Some(seen), Some(uid)) = (self.0.as_mut(), pod.metadata.uid.as_ref()) {
            seen.insert(uid.clone());
        }
    }

    /// The list ended (`watcher::Event::InitDone`): those of the `known` pods it did not name.
    /// Nothing when no list had begun.
    pub fn end<'a>(&mut self, known: impl Iterator<Item = &'a String>) -> Vec<String> {
        match self.0.take() {
            Some(seen) => known.filter(|u| !seen.contains(*u)).cloned().collect(),
            None => Vec::new(),
        }
    }
}

/// Label selector for opted-in pods.
pub fn label_selector() -> String {
    format!("{ENABLED_LABEL}=true")
}

/// Field selector for pods scheduled to `node`.
pub fn field_selector(node: &str) -> String {
    format!("spec.nodeName={node}")
}

/// The watch stream of opted-in pods on `node`. Errors are yielded (to be logged and counted)
/// and the stream retries on its own with backoff.
///
/// Each watch request asks the server to end it after `timeout` (whole seconds); the watcher
/// then watches on from the last resourceVersion it saw. A watch that sends nothing for
/// `timeout` + 5 s, not even a bookmark, is given up the same way: that is the longest a stalled
/// watch leaves new pods unseen.
pub fn pods_on_node(
    client: Client,
    node: &str,
    timeout: Duration,
) -> impl Stream<Item = Result<watcher::Event<Pod>, watcher::Error>> + Send + 'static {
    bounded(client, watcher::Config::default().labels(&label_selector()).fields(&field_selector(node)), timeout)
}

/// The watch stream of every pod on `node`, labelled or not (the observer's: it never acts).
/// Bounded like [`pods_on_node`].
pub fn all_pods_on_node(
    client: Client,
    node: &str,
    timeout: Duration,
) -> impl Stream<Item = Result<watcher::Event<Pod>, watcher::Error>> + Send + 'static {
    bounded(client, watcher::Config::default().fields(&field_selector(node)), timeout)
}

/// The router's part of a watch of every pod on the node, its observer's part, and which
/// labelled pods the router was given (a pod that loses its label, or is deleted, reaches the
/// router once more, so that it lets the pod go).
#[derive(Debug, Default)]
pub struct Split {
    labelled: HashSet<String>,
}

impl Split {
    /// Whether the pod router gets `event` (the observer gets every one): every re-list's begin and
    /// end, the labelled pods, and the last event of a pod given before (its label gone, deleted).
    pub fn for_router(&mut self, event: &watcher::Event<Pod>) -> bool {
        let uid = |pod: &Pod| pod.metadata.uid.clone().unwrap_or_default();
        match event {
            watcher::Event::Init => {
                // The router lets go, at the list's end, of the pods the list did not name.
                self.labelled.clear();
                true
            }
            watcher::Event::InitDone => true,
            watcher::Event::InitApply(pod) | watcher::Event::Apply(pod) if opted_in(pod) => {
                self.labelled.insert(uid(pod));
                true
            }
            watcher::Event::InitApply(_) => false,
            watcher::Event::Apply(pod) => self.labelled.remove(&uid(pod)),
            watcher::Event::Delete(pod) => self.labelled.remove(&uid(pod)) || opted_in(pod),
        }
    }
}

/// One watch of every pod on `node` for both of the agent's readers, instead of a second one of
/// the labelled pods: the pod router's stream (the labelled pods' events, as [`pods_on_node`]
/// gives them, [`Split`]) and the observer's (every event, as [`all_pods_on_node`]). A labelled
/// pod's events and a restart's list are then sent by the API server once, not twice. An error
/// reaches both (the observer's as its text). The watch ends once neither reads it.
pub fn shared_pods_on_node(
    client: Client,
    node: &str,
    timeout: Duration,
) -> (
    impl Stream<Item = Result<watcher::Event<Pod>, watcher::Error>> + Send + 'static,
    impl Stream<Item = Result<watcher::Event<Pod>, String>> + Send + 'static,
) {
    let all = all_pods_on_node(client, node, timeout);
    let (router_tx, router_rx) = tokio::sync::mpsc::unbounded_channel();
    let (observer_tx, observer_rx) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut all = std::pin::pin!(all);
        let mut split = Split::default();
        while let Some(item) = futures::StreamExt::next(&mut all).await {
            let (to_router, to_observer) = match item {
                Ok(event) => (split.for_router(&event).then(|| Ok(event.clone())), Ok(event)),
                Err(e) => {
                    let text = e.to_string();
                    (Some(Err(e)), Err(text))
                }
            };
            let observer_gone = observer_tx.send(to_observer).is_err();
            let router_gone = match to_router {
                Some(item) => router_tx.send(item).is_err(),
                None => router_tx.is_closed(),
            };
            if observer_gone && router_gone {
                break;
            }
        }
    });
    (receiver_stream(router_rx), receiver_stream(observer_rx))
}

fn receiver_stream<T: Send + 'static>(
    rx: tokio::sync::mpsc::UnboundedReceiver<T>,
) -> impl Stream<Item = T> + Send + 'static {
    futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|item| (item, rx)) })
}

/// The pods `config` selects, each watch request ended by the server after `timeout`.
///
/// Lists ask for `resourceVersion=0`, as client-go's informers do: the API server answers them
/// from its watch cache instead of reading every pod of the node from etcd (a quorum read). A
/// DaemonSet's rollout re-lists on every node at once; from the cache that costs etcd nothing.
/// The list may then be a moment behind the latest write; the watch that follows catches up.
/// Without a page size: kube sends `resourceVersion=0` only on a list without `limit` (the
/// watch cache ignores it anyway), and with its default of 500 the list is a quorum read again.
fn bounded(
    client: Client,
    config: watcher::Config,
    timeout: Duration,
) -> impl Stream<Item = Result<watcher::Event<Pod>, watcher::Error>> + Send + 'static {
    let api: Api<LeanPod> = Api::all(client);
    let seconds = u32::try_from(timeout.as_secs()).unwrap_or(u32::MAX).max(1);
    // The pods are read without their `managedFields`, which the agent never reads ([`LeanPod`]).
    watcher(api, from_watch_cache(config).timeout(seconds)).default_backoff().map_ok(into_pods)
}

/// A watch event of [`LeanPod`]s as one of [`Pod`]s.
fn into_pods(event: watcher::Event<LeanPod>) -> watcher::Event<Pod> {
    use watcher::Event::{Apply, Delete, Init, InitApply, InitDone};
    match event {
        Init => Init,
        InitApply(pod) => InitApply(pod.into_pod()),
        InitDone => InitDone,
        Apply(pod) => Apply(pod.into_pod()),
        Delete(pod) => Delete(pod.into_pod()),
    }
}

/// `config` with its lists read from the API server's watch cache ([`bounded`]).
fn from_watch_cache(config: watcher::Config) -> watcher::Config {
    watcher::Config { page_size: None, ..config.any_semantic() }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(labels: serde_json::Value) -> Pod {
        serde_json::from_value(serde_json::json!({"metadata": {"name": "p", "labels": labels}}))
            .expect("a pod from JSON")
    }

    fn with_uid(uid: &str) -> Pod {
        serde_json::from_value(serde_json::json!({"metadata": {"name": uid, "uid": uid}})).expect("a pod from JSON")
    }

    fn labelled(uid: &str, on: bool) -> Pod {
        let labels = if on { serde_json::json!({ENABLED_LABEL: "true"}) } else { serde_json::json!({}) };
        serde_json::from_value(serde_json::json!({"metadata": {"name": uid, "uid": uid, "labels": labels}}))
            .expect("a pod from JSON")
    }

    /// The router's part of the shared watch is what a watch of the labelled pods would give it:
    /// their events, each list's begin and end, and one last event of a pod once its label went
    /// or it was deleted (what the label-selected watch sends as its DELETED).
    #[test]
    fn the_router_gets_the_labelled_pods_of_the_shared_watch() {
        use watcher::Event::{Apply, Delete, Init, InitApply, InitDone};
        let mut split = Split::default();
        let steps = [
            (Init, true),
            (InitApply(labelled("a", true)), true),
            (InitApply(labelled("b", false)), false),
            (InitDone, true),
            (Apply(labelled("b", false)), false),
            (Apply(labelled("a", true)), true),
            // The label removed: once, so that the router lets it go.
            (Apply(labelled("a", false)), true),
            (Apply(labelled("a", false)), false),
            (Delete(labelled("a", false)), false),
            (Apply(labelled("c", true)), true),
            (Delete(labelled("c", true)), true),
            (Apply(labelled("d", true)), true),
            (Delete(labelled("d", false)), true),
            (Delete(labelled("e", false)), false),
            // A re-list after an outage in which "f" lost its label: the list does not name it,
            // and the router lets it go at the list's end.
            (Apply(labelled("f", true)), true),
            (Init, true),
            (InitApply(labelled("f", false)), false),
            (InitDone, true),
            (Apply(labelled("f", false)), false),
        ];
        for (i, (event, want)) in steps.into_iter().enumerate() {
            assert_eq!(split.for_router(&event), want, "step {i}: {event:?}");
        }
    }

    /// The pods a watch yields come without their `managedFields`, as listed and as watched.
    #[tokio::test]
    async fn the_watched_pods_come_without_their_managed_fields() {
        use futures::StreamExt as _;
        let (service, mut handle) =
            tower_test::mock::pair::<http::Request<kube::client::Body>, http::Response<kube::client::Body>>();
        let client = Client::new(service, "default");
        let managed = serde_json::json!([{"manager": "kubelet", "operation": "Update", "apiVersion": "v1",
            "subresource": "status", "fieldsType": "FieldsV1",
            "fieldsV1": {"f:status": {"f:phase": {}, "f:podIP": {}}}}]);
        let server = tokio::spawn(async move {
            let (request, send) = handle.next_request().await.expect("the list");
            assert!(!request.uri().query().unwrap_or_default().contains("watch=true"), "{}", request.uri());
            let list = serde_json::json!({"kind": "PodList", "apiVersion": "v1",
                "metadata": {"resourceVersion": "10"},
                "items": [{"metadata": {"name": "p", "namespace": "jobs", "uid": "u1", "resourceVersion": "9",
                                        "managedFields": managed}}]});
            send.send_response(http::Response::new(kube::client::Body::from(serde_json::to_vec(&list).expect("json"))));
            // The watch: one more pod, then the server ends it.
            let (_, send) = handle.next_request().await.expect("the watch");
            let line = serde_json::json!({"type": "ADDED", "object": {"kind": "Pod", "apiVersion": "v1",
                "metadata": {"name": "q", "namespace": "jobs", "uid": "u2", "resourceVersion": "11",
                             "managedFields": managed}}});
            let mut body = serde_json::to_vec(&line).expect("json");
            body.push(b'\n');
            send.send_response(http::Response::new(kube::client::Body::from(body)));
            handle
        });
        let mut stream = std::pin::pin!(all_pods_on_node(client, "n1", Duration::from_secs(290)));
        let mut pods = Vec::new();
        while pods.len() < 2 {
            match stream.next().await.expect("the stream goes on").expect("no error") {
                watcher::Event::InitApply(pod) | watcher::Event::Apply(pod) => pods.push(pod),
                _ => {}
            }
        }
        let names: Vec<_> = pods.iter().map(|p| p.metadata.name.clone().unwrap_or_default()).collect();
        assert_eq!(names, ["p", "q"]);
        for pod in &pods {
            assert_eq!(pod.metadata.managed_fields, None, "{pod:?}");
        }
        drop(server);
    }

    #[test]
    fn lists_ask_for_the_watch_cache() {
        // What kube sends: resourceVersion=0 only on a list without a limit.
        let config = from_watch_cache(watcher::Config::default().labels(&label_selector()));
        assert_eq!((config.list_semantic.clone(), config.page_size), (watcher::ListSemantic::Any, None));
    }

    #[test]
    fn a_relist_finds_gone_the_known_pods_it_did_not_name() {
        let mut relist = Relist::default();
        let known: Vec<String> = ["a", "b", "c"].map(String::from).to_vec();
        assert!(relist.end(known.iter()).is_empty(), "no list begun: nothing is gone");
        relist.begin();
        relist.saw(&with_uid("a"));
        relist.saw(&with_uid("new"));
        relist.saw(&pod(serde_json::json!({})));
        assert_eq!(relist.end(known.iter()), ["b", "c"]);
        assert!(relist.end(known.iter()).is_empty(), "each list ends once");
    }

    #[test]
    fn only_the_exact_label_value_true_opts_a_pod_in() {
        assert!(opted_in(&pod(serde_json::json!({"valet.dev/enabled": "true"}))));
        for labels in [
            serde_json::json!({"valet.dev/enabled": "True"}),
            serde_json::json!({"valet.dev/enabled": "yes"}),
            serde_json::json!({"valet.dev/enabled": ""}),
            serde_json::json!({"valet.dev/enable": "true"}),
            serde_json::json!({}),
            serde_json::Value::Null,
        ] {
            assert!(!opted_in(&pod(labels.clone())), "{labels}");
        }
    }
}
