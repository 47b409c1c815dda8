//! The controller's watch on the opted-in pods of this node, and the observer's on all of them.
//! Each is one watch per agent (list, then watch; re-list on `410 Gone`
//! and after dropped connections, with backoff), through kube-runtime's watcher.

use futures::Stream;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::{WatchStreamExt as _, watcher};
use kube::{Api, Client};

/// The opt-in label.
pub const ENABLED_LABEL: &str = "valet.dev/enabled";

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
pub fn pods_on_node(
    client: Client,
    node: &str,
) -> impl Stream<Item = Result<watcher::Event<Pod>, watcher::Error>> + Send + 'static {
    let api: Api<Pod> = Api::all(client);
    let config = watcher::Config::default().labels(&label_selector()).fields(&field_selector(node));
    watcher(api, config).default_backoff()
}

/// The watch stream of every pod on `node`, labelled or not (the observer's: it never acts).
pub fn all_pods_on_node(
    client: Client,
    node: &str,
) -> impl Stream<Item = Result<watcher::Event<Pod>, watcher::Error>> + Send + 'static {
    let api: Api<Pod> = Api::all(client);
    watcher(api, watcher::Config::default().fields(&field_selector(node))).default_backoff()
}
