//! The cluster's RuntimeClasses (node.k8s.io/v1), by name: the runtime handler each one names.
//! A pod's `runtimeClassName` is whatever its cluster's admins called it; the handler is what the
//! node's runtime runs it with (`kata`, `runsc`...), so a sandbox is known by its handler too.
//!
//! Listed once at start (before the pods, so the first pods are decided with them), again every
//! [`RELIST`], and at once (at most every [`MIN_GAP`]) when a pod names a class the last list did
//! not have. A pod can only name a RuntimeClass that exists when it is created (the RuntimeClass
//! admission plugin refuses it otherwise) and a class's handler cannot change, so a miss is the
//! one case where the map is behind: that pod, unless its class name alone says sandbox, takes
//! its ends from the API (`ApiPath::UnknownRuntimeClass`: no guess of its handler); the pods
//! after the list are decided by the handler. Every list is read from the watch cache (`list_params`):
//! at 5,000 nodes a list every 30 s was 167 requests a second, more than the Jobs' own traffic.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use k8s_openapi::api::node::v1::RuntimeClass;
use kube::api::ListParams;
use kube::{Api, Client};
use tokio::sync::Notify;
use tracing::{info, warn};

/// How often the RuntimeClasses are listed again without a miss (a class deleted and made
/// again under its name with another handler is seen within this).
pub const RELIST: Duration = Duration::from_secs(300);
/// The shortest time between two lists (a pod naming a class that cannot be listed, the
/// ClusterRole without `runtimeclasses`, must not turn into a list per lookup).
pub const MIN_GAP: Duration = Duration::from_secs(10);
/// How long the first list may take before the agent goes on without it (the API unreachable,
/// or the ClusterRole without `runtimeclasses`).
pub const FIRST_LIST_BUDGET: Duration = Duration::from_secs(10);

/// RuntimeClass name -> handler, shared between the lister and the pods' rules; a lookup that
/// misses wakes the lister.
#[derive(Clone, Debug, Default)]
pub struct RuntimeHandlers {
    map: Arc<RwLock<HashMap<String, String>>>,
    missed: Arc<Notify>,
}

impl RuntimeHandlers {
    /// A fixed map (tests).
    pub fn of(pairs: &[(&str, &str)]) -> Self {
        let me = Self::default();
        me.replace(pairs.iter().map(|(c, h)| ((*c).to_owned(), (*h).to_owned())).collect());
        me
    }

    /// The handler of the RuntimeClass `class`, if it was listed.
    /// A miss asks the lister for a list now (at most every [`MIN_GAP`]).
    pub fn handler(&self, class: &str) -> Option<String> {
        let found = self.map.read().ok()?.get(class).cloned();
        if found.is_none() {
            self.missed.notify_one();
        }
        found
    }

    fn replace(&self, map: HashMap<String, String>) {
        if let Ok(mut m) = self.map.write() {
            *m = map;
        }
    }

    /// One list of the RuntimeClasses into the map (replacing it whole).
    pub async fn list(&self, client: Client) -> kube::Result<usize> {
        let api: Api<RuntimeClass> = Api::all(client);
        let list = api.list(&list_params()).await?;
        let map: HashMap<String, String> =
            list.items.into_iter().filter_map(|rc| Some((rc.metadata.name?, rc.handler))).collect();
        let n = map.len();
        self.replace(map);
        Ok(n)
    }

    /// The first list, awaited for at most [`FIRST_LIST_BUDGET`], then a list every [`RELIST`] on
    /// a task of its own. A failed list keeps the last map (logged).
    pub async fn start(&self, client: Client) {
        match tokio::time::timeout(FIRST_LIST_BUDGET, self.list(client.clone())).await {
            Ok(Ok(n)) => {
                info!(runtime_classes = n, "listed the RuntimeClasses: sandboxes are known by their handler too")
            }
            Ok(Err(e)) => warn!(
                "cannot list RuntimeClasses ({e}): sandboxed pods are known by their runtimeClassName alone \
                 (--sandboxed-runtime-classes) until a list succeeds"
            ),
            Err(_) => warn!("no RuntimeClass list within {FIRST_LIST_BUDGET:?}: retried every {RELIST:?}"),
        }
        let me = self.clone();
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(MIN_GAP).await;
                if tokio::time::timeout(RELIST.saturating_sub(MIN_GAP), me.missed.notified()).await.is_ok() {
                    info!("a pod names a RuntimeClass the last list did not have: listing them again");
                }
                match me.list(client.clone()).await {
                    Ok(n) => info!(runtime_classes = n, "listed the RuntimeClasses again"),
                    Err(e) => warn!("cannot list RuntimeClasses ({e}): the last list stays in use"),
                }
            }
        });
    }
}

/// Every node lists the RuntimeClasses every [`RELIST`]: from the API server's watch cache
/// (`resourceVersion=0`, any version not older), never a quorum read of etcd. A class may then be
/// a moment behind its latest write, which the next list catches up.
fn list_params() -> ListParams {
    ListParams::default().match_any()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_miss_wakes_the_lister_and_a_hit_does_not() {
        let handlers = RuntimeHandlers::of(&[("secure", "kata")]);
        assert_eq!(handlers.handler("secure").as_deref(), Some("kata"));
        let wait = Duration::from_millis(50);
        assert!(tokio::time::timeout(wait, handlers.missed.notified()).await.is_err(), "a hit wakes nobody");
        assert_eq!(handlers.handler("new-class"), None);
        assert!(tokio::time::timeout(wait, handlers.missed.notified()).await.is_ok(), "a miss asks for a list");
    }

    #[test]
    fn the_list_is_read_from_the_watch_cache() {
        let p = list_params();
        assert_eq!(p.resource_version.as_deref(), Some("0"));
        assert_eq!(p.limit, None, "with a limit the API server reads etcd again");
        assert_eq!(p.version_match, Some(kube::api::VersionMatch::NotOlderThan));
    }

    #[test]
    fn a_class_is_looked_up_by_name() {
        let h = RuntimeHandlers::of(&[("secure", "kata"), ("fast", "runc")]);
        assert_eq!(h.handler("secure").as_deref(), Some("kata"));
        assert_eq!(h.handler("fast").as_deref(), Some("runc"));
        assert_eq!(h.handler("other"), None);
        h.replace(HashMap::new());
        assert_eq!(h.handler("secure"), None, "a list replaces the map whole");
    }
}
