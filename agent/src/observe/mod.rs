//! Observe mode: what sidecars cost on this node, measured without touching a pod.
//!
//! The observer has a watch of its own on every pod of the node (labelled or not) and keeps a few
//! bytes per pod with a sidecar valet knows. It never acts: no quit, no hold, no condition, no
//! Event. It exports how many pods wait on their sidecars now, the sidecar tax (apps' end → last
//! sidecar's end, from the kubelet's container statuses) and how often an app started before its
//! proxy was ready. For that last one it asks the proxy once, when the API first shows an app
//! started while the kubelet did not yet report the proxy ready: a proxy that is not ready then
//! was not ready at the app's start either, so the count is a lower bound and never a guess.
//! It runs on its own task: the controller's loop neither waits for it nor knows it.

pub mod look;
pub mod tally;

use std::collections::HashSet;
use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;

use futures::{Stream, StreamExt as _};
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::watcher;
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use self::tally::{Note, PodKey, Tally};
use crate::cgroup::CgroupFs;
use crate::metrics::{Metrics, ObservedLabels, TaxLabels};
use crate::pod::spec::{Endpoint, SidecarDefaults};
use crate::sidecar::Pending;
use crate::sidecar::http::{self, Limits};

/// Asks a pod's proxy once whether it is ready. `None`: it could not be asked (the pod's
/// network namespace could not be entered).
pub trait ReadyProbe: Send + Sync + 'static {
    fn ready(&self, uid: &str, endpoint: &Endpoint) -> Pending<Option<bool>>;
}

/// The production probe: one GET from inside the pod's network namespace, as the controller's
/// probes make, on a connection of its own that is closed at once.
pub struct NetnsProbe {
    pub host_proc: PathBuf,
    pub cgroups: CgroupFs,
}

impl ReadyProbe for NetnsProbe {
    fn ready(&self, uid: &str, endpoint: &Endpoint) -> Pending<Option<bool>> {
        let (host_proc, cgroups, uid) = (self.host_proc.clone(), self.cgroups.clone(), uid.to_owned());
        let (addr, path) = (SocketAddr::from((Ipv4Addr::LOCALHOST, endpoint.port)), endpoint.path.clone());
        Box::pin(async move {
            let netns = tokio::task::spawn_blocking(move || {
                let pod = cgroups.find_pod(&uid)?;
                crate::sidecar::netns::open_pod_netns(&host_proc, &cgroups, &pod.rel).ok()
            })
            .await
            .ok()
            .flatten()?;
            let answer = netns.run(move || http::request(addr, "GET", &path, Limits::default())).await.ok()?;
            // Refused, timed out or an error status: not ready.
            Some(answer.is_ok_and(|r| (200..300).contains(&r.status)))
        })
    }
}

/// What the observer needs to know.
pub struct Settings {
    pub node: String,
    pub defaults: SidecarDefaults,
    /// Series carry the pod's namespace (false: empty, for clusters with very many).
    pub namespace_label: bool,
    /// valet acts on labelled pods (`--act`): they report their own spec errors, and an app valet
    /// holds cannot start before its proxy.
    pub act: bool,
}

/// The observer task's state.
pub struct Observer {
    settings: Settings,
    tally: Tally,
    metrics: Arc<Metrics>,
    probe: Arc<dyn ReadyProbe>,
    answered: (mpsc::UnboundedSender<String>, mpsc::UnboundedReceiver<String>),
    /// Pods whose annotations could not be read, reported once each.
    unreadable: HashSet<String>,
    relist: Option<HashSet<String>>,
}

impl Observer {
    pub fn new(settings: Settings, metrics: Arc<Metrics>, probe: Arc<dyn ReadyProbe>) -> Observer {
        metrics.quit_pods.start();
        Observer {
            tally: Tally::new(settings.namespace_label),
            settings,
            metrics,
            probe,
            answered: mpsc::unbounded_channel(),
            unreadable: HashSet::new(),
            relist: None,
        }
    }

    /// Runs until the watch ends.
    pub async fn run(mut self, watch: impl Stream<Item = Result<watcher::Event<Pod>, watcher::Error>>) {
        let mut watch = std::pin::pin!(watch);
        loop {
            tokio::select! {
                event = watch.next() => match event {
                    Some(Ok(event)) => self.on_watch(event),
                    Some(Err(e)) => warn!("observer's pod watch: {e} (retrying)"),
                    None => break,
                },
                Some(uid) = self.answered.1.recv() => self.tally.proxy_answered(&uid),
            }
        }
        warn!("observer's pod watch ended");
    }

    fn on_watch(&mut self, event: watcher::Event<Pod>) {
        match event {
            watcher::Event::Init => self.relist = Some(HashSet::new()),
            watcher::Event::InitApply(pod) => {
                if let (Some(seen), Some(uid)) = (self.relist.as_mut(), pod.metadata.uid.clone()) {
                    seen.insert(uid);
                }
                self.on_pod(&pod);
            }
            watcher::Event::InitDone => {
                if let Some(seen) = self.relist.take() {
                    let gone: Vec<String> = self.tally.uids().filter(|u| !seen.contains(*u)).cloned().collect();
                    for uid in gone {
                        self.gone(&uid);
                    }
                }
            }
            watcher::Event::Apply(pod) => self.on_pod(&pod),
            watcher::Event::Delete(pod) => {
                if let Some(uid) = pod.metadata.uid.as_deref() {
                    self.gone(uid);
                }
            }
        }
    }

    fn on_pod(&mut self, pod: &Pod) {
        let Some(uid) = pod.metadata.uid.as_deref() else { return };
        // The server filters by node; checked again, as the controller does.
        if pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) != Some(self.settings.node.as_str()) {
            self.gone(uid);
            return;
        }
        match look::look(pod, &self.settings.defaults) {
            Ok(Some(mut seen)) => {
                // An app valet holds cannot start before its proxy is ready.
                seen.hold_app &= seen.labelled && self.settings.act;
                let acted = self.metrics.quit_pods.contains(uid);
                let notes = self.tally.look(seen, acted);
                self.count(notes);
                self.metrics.pods_observed.set(self.tally.len() as i64);
            }
            Ok(None) => {}
            Err(e) => {
                let labelled = pod.metadata.labels.as_ref().and_then(|l| l.get(crate::api::watch::ENABLED_LABEL))
                    == Some(&"true".to_owned());
                // A labelled pod valet acts on has its error reported by the controller.
                if self.unreadable.insert(uid.to_owned()) && !(labelled && self.settings.act) {
                    info!(pod = %crate::pod::status::pod_name(pod), "not observed: {e}");
                    self.metrics.skip(e.reason());
                }
            }
        }
    }

    fn gone(&mut self, uid: &str) {
        let acted = self.metrics.quit_pods.contains(uid);
        let notes = self.tally.gone(uid, acted, chrono::Utc::now());
        self.count(notes);
        self.metrics.pods_observed.set(self.tally.len() as i64);
        self.metrics.quit_pods.forget(uid);
        self.unreadable.remove(uid);
    }

    fn count(&self, notes: Vec<Note>) {
        let m = &self.metrics;
        for note in notes {
            match note {
                Note::Waiting(key, change) => {
                    let labels = observed(&key);
                    let gauge = m.pods_waiting.get_or_create(&labels);
                    let now = gauge.inc_by(change) + change;
                    drop(gauge);
                    // A namespace with no waiting pod keeps no series (namespaces come and go).
                    if now <= 0 {
                        m.pods_waiting.remove(&labels);
                    }
                }
                Note::Tax { key, seconds, acted } => {
                    let labels = TaxLabels {
                        namespace: key.namespace.clone(),
                        owner_kind: key.owner_kind.as_str(),
                        acted: if acted { "true" } else { "false" },
                    };
                    m.sidecar_tax.get_or_create(&labels).observe(seconds);
                }
                Note::Probe { uid, key, endpoint, apps } => {
                    debug!(%uid, apps, "an app started before the kubelet reported its proxy ready: asking the proxy");
                    let (probe, metrics, answered) = (self.probe.clone(), m.clone(), self.answered.0.clone());
                    tokio::spawn(async move {
                        match probe.ready(&uid, &endpoint).await {
                            // Unless valet quit the proxy meanwhile (its app ended): then a proxy
                            // that does not answer says nothing about the app's start.
                            Some(false) if !metrics.quit_pods.contains(&uid) => {
                                metrics.started_before_ready.get_or_create(&observed(&key)).inc_by(apps)
                            }
                            Some(true) => {
                                let _ = answered.send(uid);
                                0
                            }
                            Some(false) | None => {
                                metrics.skip("RaceUnknown");
                                0
                            }
                        };
                    });
                }
            }
        }
    }
}

fn observed(key: &PodKey) -> ObservedLabels {
    ObservedLabels { namespace: key.namespace.clone(), owner_kind: key.owner_kind.as_str() }
}

#[cfg(test)]
mod tests {
    use std::sync::{Mutex, PoisonError};

    use super::look::tests::{ended, pod, running, waiting};
    use super::*;

    /// Answers every question with `answer`, after a quit for the pod if `quit_first`.
    struct Answer {
        answer: Option<bool>,
        quit_first: Option<Arc<Metrics>>,
        asked: Mutex<Vec<(String, u16)>>,
    }

    impl ReadyProbe for Answer {
        fn ready(&self, uid: &str, endpoint: &Endpoint) -> Pending<Option<bool>> {
            self.asked.lock().unwrap_or_else(PoisonError::into_inner).push((uid.to_owned(), endpoint.port));
            if let Some(m) = &self.quit_first {
                m.quit_pods.record(uid);
            }
            let answer = self.answer;
            Box::pin(async move { answer })
        }
    }

    fn observer(answer: Option<bool>, quit_first: bool) -> (Observer, Arc<Metrics>, Arc<Answer>) {
        let metrics = Arc::new(Metrics::new());
        let probe =
            Arc::new(Answer { answer, quit_first: quit_first.then(|| metrics.clone()), asked: Mutex::default() });
        let settings =
            Settings { node: "n1".into(), defaults: SidecarDefaults::default(), namespace_label: true, act: true };
        (Observer::new(settings, metrics.clone(), probe.clone()), metrics, probe)
    }

    fn on_node(mut p: Pod) -> Pod {
        p.spec.as_mut().expect("spec").node_name = Some("n1".into());
        p
    }

    fn exposition(m: &Metrics) -> String {
        m.render(crate::metrics::Format::Text).expect("render")
    }

    /// Lets the spawned probe tasks run to the end.
    async fn settle() {
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
    }

    const LABELS: &str = "namespace=\"jobs\",owner_kind=\"Job\"";

    #[tokio::test]
    async fn waiting_pods_are_gauged_and_their_series_go_with_them() {
        let (mut o, m, _) = observer(Some(true), false);
        o.on_watch(watcher::Event::Apply(on_node(pod(running(), running(), true))));
        assert!(exposition(&m).contains("valet_pods_observed 1"));
        o.on_watch(watcher::Event::Apply(on_node(pod(ended("2026-01-01T00:01:00Z"), running(), true))));
        assert!(
            exposition(&m).contains(&format!("valet_pods_waiting_on_sidecars{{{LABELS}}} 1")),
            "{}",
            exposition(&m)
        );
        o.on_watch(watcher::Event::Delete(on_node(pod(ended("2026-01-01T00:01:00Z"), running(), true))));
        let text = exposition(&m);
        assert!(!text.contains("valet_pods_waiting_on_sidecars{"), "no series left: {text}");
        assert!(text.contains(&format!("valet_sidecar_tax_seconds_count{{{LABELS},acted=\"false\"}} 1")), "{text}");
        assert!(text.contains("valet_pods_observed 0"));
    }

    #[tokio::test]
    async fn a_proxy_not_ready_when_asked_counts_the_race_and_another_nodes_pod_is_ignored() {
        let (mut o, m, probe) = observer(Some(false), false);
        o.on_watch(watcher::Event::Apply(on_node(pod(waiting(), running(), false))));
        o.on_watch(watcher::Event::Apply(on_node(pod(running(), running(), false))));
        settle().await;
        assert_eq!(*probe.asked.lock().expect("lock"), [("u1".to_owned(), 15021)]);
        let text = exposition(&m);
        assert!(text.contains(&format!("valet_app_started_before_proxy_ready_total{{{LABELS}}} 1")), "{text}");

        let (mut o, m, probe) = observer(Some(false), false);
        o.on_watch(watcher::Event::Apply(pod(waiting(), running(), false)));
        o.on_watch(watcher::Event::Apply(pod(running(), running(), false)));
        settle().await;
        assert!(probe.asked.lock().expect("lock").is_empty());
        assert!(exposition(&m).contains("valet_pods_observed 0"));
    }

    #[tokio::test]
    async fn a_proxy_valet_quit_or_could_not_ask_counts_no_race() {
        for (answer, quit) in [(Some(false), true), (None, false)] {
            let (mut o, m, probe) = observer(answer, quit);
            o.on_watch(watcher::Event::Apply(on_node(pod(waiting(), running(), false))));
            o.on_watch(watcher::Event::Apply(on_node(pod(running(), running(), false))));
            settle().await;
            assert_eq!(probe.asked.lock().expect("lock").len(), 1);
            let text = exposition(&m);
            assert!(!text.contains("valet_app_started_before_proxy_ready_total{"), "{text}");
            assert!(text.contains("valet_pod_skips_total{reason=\"RaceUnknown\"} 1"), "{text}");
        }
    }
}
