//! The cluster's RuntimeClasses (node.k8s.io/v1), by name: the runtime handler each one names.
//! A pod's `runtimeClassName` is whatever its cluster's admins called it; the handler is what the
//! node's runtime runs it with (`kata`, `runsc`...), so a sandbox is known by its handler too.
//!
//! Listed once at start (before the pods, so the first pods are decided with them) and again
//! every [`RELIST`]. A pod can only name a RuntimeClass that exists when it is created (the
//! RuntimeClass admission plugin refuses it otherwise), so a class created since the last list
//! is the one case decided by the pod's class name alone until the next list; that is logged.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use k8s_openapi::api::node::v1::RuntimeClass;
use kube::api::ListParams;
use kube::{Api, Client};
use tracing::{info, warn};

/// How often the RuntimeClasses are listed again.
pub const RELIST: Duration = Duration::from_secs(30);
/// How long the first list may take before the agent goes on without it (the API unreachable,
/// or the ClusterRole without `runtimeclasses`).
pub const FIRST_LIST_BUDGET: Duration = Duration::from_secs(10);

/// RuntimeClass name -> handler, shared between the lister and the pods' rules.
#[derive(Clone, Debug, Default)]
pub struct RuntimeHandlers(Arc<RwLock<HashMap<String, String>>>);

impl RuntimeHandlers {
    /// A fixed map (tests).
    pub fn of(pairs: &[(&str, &str)]) -> Self {
        let me = Self::default();
        me.replace(pairs.iter().map(|(c, h)| ((*c).to_owned(), (*h).to_owned())).collect());
        me
    }

    /// The handler of the RuntimeClass `class`, if it was listed.
    pub fn handler(&self, class: &str) -> Option<String> {
        self.0.read().ok()?.get(class).cloned()
    }

    fn replace(&self, map: HashMap<String, String>) {
        if let Ok(mut m) = self.0.write() {
            *m = map;
        }
    }

    /// One list of the RuntimeClasses into the map (replacing it whole).
    pub async fn list(&self, client: Client) -> kube::Result<usize> {
        let api: Api<RuntimeClass> = Api::all(client);
        let list = api.list(&ListParams::default()).await?;
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
                tokio::time::sleep(RELIST).await;
                if let Err(e) = me.list(client.clone()).await {
                    warn!("cannot list RuntimeClasses ({e}): the last list stays in use");
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
