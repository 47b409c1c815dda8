//! The controller's watch on the opted-in pods of this node, and the observer's on all of them.
//! Each is one watch per agent (list, then watch; re-list on `410 Gone`
//! and after dropped connections, with backoff), through kube-runtime's watcher.

use std::time::Duration;

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

/// The pods `config` selects, each watch request ended by the server after `timeout`.
fn bounded(
    client: Client,
    config: watcher::Config,
    timeout: Duration,
) -> impl Stream<Item = Result<watcher::Event<Pod>, watcher::Error>> + Send + 'static {
    let api: Api<Pod> = Api::all(client);
    let seconds = u32::try_from(timeout.as_secs()).unwrap_or(u32::MAX).max(1);
    watcher(api, config.timeout(seconds)).default_backoff()
}
