//! Observe mode: what sidecars cost on this node, measured without touching a pod.
//!
//! The observer has a watch of its own on every pod of the node (labelled or not) and keeps a few
//! bytes per pod with a sidecar valet knows. It never acts: no quit, no hold, no condition, no
//! Event. It exports how many pods wait on their sidecars now and for how long, the sidecar tax
//! (apps' end → last sidecar's end, from the kubelet's container statuses, classic and native
//! sidecars apart), the startup tax of native proxies (readiness → the kubelet's move to the
//! apps, its `Initialized` condition) apart from the apps' own start after it (their image pull,
//! creation and start), the pods a mesh gave classic sidecars on a node that runs native ones,
//! and how often an app started before its proxy was ready.
//!
//! For the race it asks the proxy once, when the API first shows an app running while the
//! kubelet did not yet report the proxy ready, and counts the app once the proxy, not ready
//! then, is seen ready: it was starting, so the app started first. A proxy that ends instead was
//! as likely stopping (an app may quit its own proxy), and nothing is counted: the count is a
//! lower bound and never a guess. For the startup tax it asks a native proxy until it is ready.
//! It runs on its own task: the pod router's loop neither waits for it nor knows it.

pub mod look;
pub mod namespaces;
pub mod tally;

use std::collections::{HashMap, HashSet};
use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures::{Stream, StreamExt as _};
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::watcher;
use tokio::sync::mpsc;
use tracing::{debug, info, warn};

use self::look::{OwnerKind, SidecarMode};
use self::tally::{Note, PodKey, Tally, Uncounted};
use crate::api::watch::Relist;
use crate::cgroup::CgroupFs;
use crate::ended_by_valet::EndedByValet;
use crate::metrics::{Metrics, NamespaceLabels, ObservedLabels, ReasonLabels, TaxLabels};
use crate::pod::spec::{Endpoint, SidecarDefaults};
use crate::sidecar::Pending;
use crate::sidecar::http::{self, Limits};
use crate::vocab::SkipReason;

/// Asks a pod's proxy once whether it is ready. `None`: it could not be asked (the pod's
/// network namespace could not be entered).
pub trait ReadyProbe: Send + Sync + 'static {
    fn ready(&self, uid: &str, endpoint: &Endpoint) -> Pending<Option<bool>>;
}

/// The production probe: one GET from inside the pod's network namespace, as the pod router's
/// probes make, on a connection of its own that is closed at once.
pub struct NetnsProbe {
    pub host_proc: PathBuf,
    pub cgroups: CgroupFs,
    /// The runtime's records, where each pod's network namespace is named.
    pub bundles: Arc<std::sync::Mutex<crate::runtime::RuntimeBundles>>,
}

impl ReadyProbe for NetnsProbe {
    fn ready(&self, uid: &str, endpoint: &Endpoint) -> Pending<Option<bool>> {
        let (host_proc, cgroups, uid) = (self.host_proc.clone(), self.cgroups.clone(), uid.to_owned());
        let bundles = self.bundles.clone();
        let (addr, path) = (SocketAddr::from((Ipv4Addr::LOCALHOST, endpoint.port)), endpoint.path.clone());
        Box::pin(async move {
            let netns = tokio::task::spawn_blocking(move || {
                let pod = cgroups.find_pod(&uid)?;
                let mut bundles = bundles.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                crate::sidecar::netns::open_pod_netns(&host_proc, &cgroups, &mut bundles, &uid, &pod.rel).ok()
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
    /// How many namespaces have series of their own at a time; the rest share
    /// [`namespaces::OVERFLOW`].
    pub max_namespaces: usize,
    /// valet acts on labelled pods (`--act`): they report their own spec errors, and an app valet
    /// holds cannot start before its proxy.
    pub act: bool,
}

/// How often the longest waits are gauged and quiet namespaces swept.
const TICK: Duration = Duration::from_secs(15);
/// How often a native proxy is asked whether it is ready, while its pod's apps wait for it.
const READY_POLL: Duration = Duration::from_millis(250);
/// How long a native proxy is asked at most (its pod's apps start, or it ends, well before).
const READY_POLL_FOR: Duration = Duration::from_secs(600);

/// A probe's answer, back on the observer's task.
enum Answer {
    Probe { uid: String, apps: u64, ready: Option<bool> },
    ReadyAt { uid: String, at: DateTime<Utc> },
}

/// The observer task's state.
pub struct Observer {
    settings: Settings,
    tally: Tally,
    metrics: Arc<Metrics>,
    probe: Arc<dyn ReadyProbe>,
    answers: (mpsc::UnboundedSender<Answer>, mpsc::UnboundedReceiver<Answer>),
    /// The native proxies asked until ready, by pod uid.
    watches: HashMap<String, tokio::task::JoinHandle<()>>,
    /// The series of `valet_pods_waiting_longest_seconds` set at the last tick.
    gauged: HashSet<ObservedLabels>,
    /// Pods whose annotations could not be read, reported once each.
    unreadable: HashSet<String>,
    relist: Relist,
    ended_by_valet: Arc<EndedByValet>,
}

impl Observer {
    /// `ended_by_valet` is the record the actuators keep of the pods they quit (for the tax's
    /// `acted` label); the observer turns it on.
    pub fn new(
        settings: Settings,
        metrics: Arc<Metrics>,
        probe: Arc<dyn ReadyProbe>,
        ended_by_valet: Arc<EndedByValet>,
    ) -> Observer {
        ended_by_valet.start();
        // Known in advance: start at 0, so that rates see 0 rather than nothing.
        for reason in Uncounted::ALL {
            let _ = metrics.uncounted.get_or_create(&ReasonLabels { reason: reason.as_str() });
        }
        Observer {
            tally: Tally::new(settings.namespace_label, settings.max_namespaces),
            settings,
            metrics,
            ended_by_valet,
            probe,
            answers: mpsc::unbounded_channel(),
            watches: HashMap::new(),
            gauged: HashSet::new(),
            unreadable: HashSet::new(),
            relist: Relist::default(),
        }
    }

    /// Runs until the watch ends.
    pub async fn run<E: std::fmt::Display>(mut self, watch: impl Stream<Item = Result<watcher::Event<Pod>, E>>) {
        let mut watch = std::pin::pin!(watch);
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                event = watch.next() => match event {
                    Some(Ok(event)) => self.on_watch(event),
                    Some(Err(e)) => warn!("observer's pod watch: {e} (retrying)"),
                    None => break,
                },
                Some(answer) = self.answers.1.recv() => self.on_answer(answer),
                _ = tick.tick() => self.on_tick(Utc::now()),
            }
        }
        for (_, watch) in self.watches.drain() {
            watch.abort();
        }
        warn!("observer's pod watch ended");
    }

    fn on_watch(&mut self, event: watcher::Event<Pod>) {
        match event {
            watcher::Event::Init => self.relist.begin(),
            watcher::Event::InitApply(pod) => {
                self.relist.saw(&pod);
                self.on_pod(&pod);
            }
            watcher::Event::InitDone => {
                for uid in self.relist.end(self.tally.uids()) {
                    let notes = self.tally.vanished(&uid, Utc::now());
                    self.forget(&uid, notes);
                }
            }
            watcher::Event::Apply(pod) => self.on_pod(&pod),
            watcher::Event::Delete(pod) => {
                if let Some(uid) = pod.metadata.uid.as_deref() {
                    // The last object may show the sidecars' own ends: counted from those.
                    self.on_pod(&pod);
                    let deleted_at = look::deleted_at(&pod);
                    self.gone(uid, deleted_at);
                }
            }
        }
    }

    fn on_pod(&mut self, pod: &Pod) {
        let Some(uid) = pod.metadata.uid.as_deref() else { return };
        // The server filters by node; checked again, as the pod router does.
        if pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) != Some(self.settings.node.as_str()) {
            self.gone(uid, None);
            return;
        }
        match look::look(pod, &self.settings.defaults) {
            Ok(Some(mut seen)) => {
                // An app valet holds cannot start before its proxy is ready.
                seen.hold_app &= seen.labelled && self.settings.act;
                let acted = self.ended_by_valet.contains(uid);
                let notes = self.tally.look(seen, acted);
                self.count(notes);
                self.metrics.pods_observed.set(self.tally.len() as i64);
            }
            Ok(None) => {}
            Err(e) => {
                let labelled = crate::api::watch::opted_in(pod);
                // A labelled pod valet acts on has its error reported by the pod router.
                if self.unreadable.insert(uid.to_owned()) && !(labelled && self.settings.act) {
                    info!(pod = %crate::pod::status::pod_name(pod), "not observed: {e}");
                    self.metrics.skip(SkipReason::BadAnnotation);
                }
            }
        }
    }

    fn gone(&mut self, uid: &str, deleted_at: Option<DateTime<Utc>>) {
        let acted = self.ended_by_valet.contains(uid);
        let notes = self.tally.gone(uid, acted, Utc::now(), deleted_at);
        self.forget(uid, notes);
    }

    fn forget(&mut self, uid: &str, notes: Vec<Note>) {
        self.count(notes);
        if let Some(watch) = self.watches.remove(uid) {
            watch.abort();
        }
        self.metrics.pods_observed.set(self.tally.len() as i64);
        self.ended_by_valet.forget(uid);
        self.unreadable.remove(uid);
    }

    fn on_answer(&mut self, answer: Answer) {
        match answer {
            Answer::Probe { uid, apps, ready } => {
                let notes = self.tally.probe_answered(&uid, apps, ready);
                self.count(notes);
            }
            Answer::ReadyAt { uid, at } => {
                self.watches.remove(&uid);
                self.tally.proxy_ready_at(&uid, at);
            }
        }
    }

    /// Gauges the longest waits and drops the series of namespaces gone quiet.
    fn on_tick(&mut self, now: DateTime<Utc>) {
        let m = &self.metrics;
        let mut longest: HashMap<ObservedLabels, f64> = HashMap::new();
        for (key, seconds) in self.tally.longest_waits(now) {
            let entry = longest.entry(observed(&key)).or_insert(seconds);
            *entry = entry.max(seconds);
        }
        for labels in self.gauged.drain() {
            if !longest.contains_key(&labels) {
                m.waiting_longest.remove(&labels);
            }
        }
        for (labels, seconds) in longest {
            m.waiting_longest.get_or_create(&labels).set(seconds);
            self.gauged.insert(labels);
        }
        for namespace in self.tally.sweep(now) {
            debug!(namespace, "no pod of this namespace observed for an hour: its series go");
            for owner_kind in OwnerKind::ALL.map(OwnerKind::as_str) {
                let observed = ObservedLabels { namespace: namespace.clone(), owner_kind };
                m.started_before_ready.remove(&observed);
                m.startup_tax.remove(&observed);
                m.app_start.remove(&observed);
                m.waiting_longest.remove(&observed);
                for acted in ["true", "false"] {
                    for sidecar_mode in SidecarMode::ALL.map(SidecarMode::as_str) {
                        let tax = TaxLabels { namespace: namespace.clone(), owner_kind, acted, sidecar_mode };
                        m.sidecar_tax.remove(&tax);
                    }
                }
            }
            m.classic_on_native.remove(&NamespaceLabels { namespace });
        }
    }

    fn count(&mut self, notes: Vec<Note>) {
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
                        m.waiting_longest.remove(&labels);
                    }
                }
                Note::Tax { key, seconds, acted } => {
                    let labels = TaxLabels {
                        namespace: key.namespace.clone(),
                        owner_kind: key.owner_kind.as_str(),
                        acted: if acted { "true" } else { "false" },
                        sidecar_mode: key.mode.as_str(),
                    };
                    m.sidecar_tax.get_or_create(&labels).observe(seconds);
                }
                Note::Probe { uid, endpoint, apps } => {
                    debug!(%uid, apps, "an app started before the kubelet reported its proxy ready: asking the proxy");
                    let (probe, answers) = (self.probe.clone(), self.answers.0.clone());
                    tokio::spawn(async move {
                        let ready = probe.ready(&uid, &endpoint).await;
                        let _ = answers.send(Answer::Probe { uid, apps, ready });
                    });
                }
                Note::Race { key, apps } => {
                    m.started_before_ready.get_or_create(&observed(&key)).inc_by(apps);
                }
                Note::Uncounted(reason) => {
                    m.uncounted.get_or_create(&ReasonLabels { reason: reason.as_str() }).inc();
                }
                Note::WatchReady { uid, endpoint } => {
                    let (probe, answers) = (self.probe.clone(), self.answers.0.clone());
                    let task_uid = uid.clone();
                    let watch = tokio::spawn(async move {
                        let deadline = tokio::time::Instant::now() + READY_POLL_FOR;
                        while tokio::time::Instant::now() < deadline {
                            if probe.ready(&task_uid, &endpoint).await == Some(true) {
                                let _ = answers.send(Answer::ReadyAt { uid: task_uid, at: Utc::now() });
                                return;
                            }
                            tokio::time::sleep(READY_POLL).await;
                        }
                    });
                    if let Some(old) = self.watches.insert(uid, watch) {
                        old.abort();
                    }
                }
                Note::Unwatch { uid } => {
                    if let Some(watch) = self.watches.remove(&uid) {
                        watch.abort();
                    }
                }
                Note::StartupTax { key, seconds } => m.startup_tax.get_or_create(&observed(&key)).observe(seconds),
                Note::AppStart { key, seconds } => m.app_start.get_or_create(&observed(&key)).observe(seconds),
                Note::ClassicOnNative(key) => {
                    m.classic_on_native.get_or_create(&NamespaceLabels { namespace: key.namespace }).inc();
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

    use super::look::tests::{ended, initialized, native_pod, pod, running, started, waiting};
    use super::*;

    /// Answers every question with `answer`.
    struct Answer {
        answer: Option<bool>,
        asked: Mutex<Vec<(String, u16)>>,
    }

    impl ReadyProbe for Answer {
        fn ready(&self, uid: &str, endpoint: &Endpoint) -> Pending<Option<bool>> {
            self.asked.lock().unwrap_or_else(PoisonError::into_inner).push((uid.to_owned(), endpoint.port));
            let answer = self.answer;
            Box::pin(async move { answer })
        }
    }

    fn observer_with(answer: Option<bool>, max_namespaces: usize) -> (Observer, Arc<Metrics>, Arc<Answer>) {
        let metrics = Arc::new(Metrics::new());
        let probe = Arc::new(Answer { answer, asked: Mutex::default() });
        let settings = Settings {
            node: "n1".into(),
            defaults: SidecarDefaults::default(),
            namespace_label: true,
            max_namespaces,
            act: true,
        };
        (Observer::new(settings, metrics.clone(), probe.clone(), Arc::default()), metrics, probe)
    }

    fn observer(answer: Option<bool>) -> (Observer, Arc<Metrics>, Arc<Answer>) {
        observer_with(answer, 50)
    }

    fn on_node(mut p: Pod) -> Pod {
        p.spec.as_mut().expect("spec").node_name = Some("n1".into());
        p
    }

    fn exposition(m: &Metrics) -> String {
        m.render(crate::metrics::Format::Text).expect("render")
    }

    /// Lets the spawned probe tasks run, and hands their answers to the observer.
    async fn settle(o: &mut Observer) {
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
        while let Ok(answer) = o.answers.1.try_recv() {
            o.on_answer(answer);
        }
    }

    const LABELS: &str = "namespace=\"jobs\",owner_kind=\"Job\"";

    #[tokio::test]
    async fn waiting_pods_are_gauged_and_their_series_go_with_them() {
        let (mut o, m, _) = observer(Some(true));
        o.on_watch(watcher::Event::Apply(on_node(pod(running(), running(), true))));
        assert!(exposition(&m).contains("valet_pods_observed 1"));
        o.on_watch(watcher::Event::Apply(on_node(pod(ended("2026-01-01T00:01:00Z"), running(), true))));
        assert!(
            exposition(&m).contains(&format!("valet_pods_waiting_on_sidecars{{{LABELS}}} 1")),
            "{}",
            exposition(&m)
        );
        o.on_tick("2026-01-01T00:11:00Z".parse().expect("time"));
        let text = exposition(&m);
        assert!(text.contains(&format!("valet_pods_waiting_longest_seconds{{{LABELS}}} 600")), "{text}");
        o.on_watch(watcher::Event::Delete(on_node(pod(ended("2026-01-01T00:01:00Z"), running(), true))));
        let text = exposition(&m);
        assert!(!text.contains("valet_pods_waiting_on_sidecars{"), "no series left: {text}");
        assert!(!text.contains("valet_pods_waiting_longest_seconds{"), "no series left: {text}");
        let tax = format!("valet_sidecar_tax_seconds_count{{{LABELS},acted=\"false\",sidecar_mode=\"classic\"}} 1");
        assert!(text.contains(&tax), "{text}");
        assert!(text.contains("valet_pods_observed 0"));
    }

    #[tokio::test]
    async fn a_proxy_not_ready_when_asked_and_then_reported_ready_counts_the_race() {
        let (mut o, m, probe) = observer(Some(false));
        o.on_watch(watcher::Event::Apply(on_node(pod(waiting(), running(), false))));
        o.on_watch(watcher::Event::Apply(on_node(pod(running(), running(), false))));
        settle(&mut o).await;
        assert_eq!(*probe.asked.lock().expect("lock"), [("u1".to_owned(), 15021)]);
        let text = exposition(&m);
        assert!(!text.contains("valet_app_started_before_proxy_ready_total{"), "not before it is seen ready: {text}");
        o.on_watch(watcher::Event::Apply(on_node(pod(running(), running(), true))));
        let text = exposition(&m);
        assert!(text.contains(&format!("valet_app_started_before_proxy_ready_total{{{LABELS}}} 1")), "{text}");

        // Another node's pod is not observed.
        let (mut o, m, probe) = observer(Some(false));
        o.on_watch(watcher::Event::Apply(pod(waiting(), running(), false)));
        o.on_watch(watcher::Event::Apply(pod(running(), running(), false)));
        settle(&mut o).await;
        assert!(probe.asked.lock().expect("lock").is_empty());
        assert!(exposition(&m).contains("valet_pods_observed 0"));
    }

    #[tokio::test]
    async fn a_self_quitting_app_or_a_proxy_that_cannot_be_asked_counts_no_race() {
        for (answer, reason) in [(Some(false), "race_unconfirmed"), (None, "race_unknown")] {
            let (mut o, m, probe) = observer(answer);
            o.on_watch(watcher::Event::Apply(on_node(pod(waiting(), running(), false))));
            o.on_watch(watcher::Event::Apply(on_node(pod(running(), running(), false))));
            settle(&mut o).await;
            assert_eq!(probe.asked.lock().expect("lock").len(), 1);
            // The app ends and its proxy with it (the app told it to quit): never seen ready.
            let done = pod(ended("2026-01-01T00:01:00Z"), ended("2026-01-01T00:01:00Z"), false);
            o.on_watch(watcher::Event::Apply(on_node(done)));
            let text = exposition(&m);
            assert!(!text.contains("valet_app_started_before_proxy_ready_total{"), "{text}");
            assert!(text.contains(&format!("valet_observe_uncounted_total{{reason=\"{reason}\"}} 1")), "{text}");
            assert!(!text.contains("valet_pod_skips_total{"), "not a skip: {text}");
        }
    }

    #[tokio::test]
    async fn a_pod_with_bad_annotations_is_a_counted_skip() {
        let (mut o, m, _) = observer(Some(true));
        let mut p = on_node(pod(running(), running(), true));
        p.metadata.annotations = Some([("valet.dev/hold-app".to_owned(), "maybe".to_owned())].into());
        o.on_watch(watcher::Event::Apply(p.clone()));
        o.on_watch(watcher::Event::Apply(p));
        let text = exposition(&m);
        assert!(text.contains("valet_pod_skips_total{reason=\"bad_annotation\"} 1"), "once: {text}");
    }

    #[tokio::test]
    async fn a_relist_does_not_tax_pods_gone_meanwhile() {
        let (mut o, m, _) = observer(Some(true));
        o.on_watch(watcher::Event::Apply(on_node(pod(ended("2026-01-01T00:01:00Z"), running(), true))));
        o.on_watch(watcher::Event::Init);
        o.on_watch(watcher::Event::InitDone);
        let text = exposition(&m);
        assert!(!text.contains("valet_sidecar_tax_seconds_count{"), "{text}");
        assert!(text.contains("valet_observe_uncounted_total{reason=\"tax_unseen\"} 1"), "{text}");
        assert!(text.contains("valet_pods_observed 0"));
    }

    #[tokio::test]
    async fn a_namespace_flood_stays_bounded_and_quiet_namespaces_lose_their_series() {
        let (mut o, m, _) = observer_with(Some(true), 5);
        let series = |m: &Metrics| {
            let text = exposition(m);
            let namespaces: HashSet<String> = text
                .lines()
                .filter(|l| l.starts_with("valet_sidecar_tax_seconds_count{"))
                .filter_map(|l| l.split("namespace=\"").nth(1)?.split('"').next().map(str::to_owned))
                .collect();
            (namespaces, text.lines().filter(|l| l.starts_with("valet_sidecar_tax_seconds")).count())
        };
        for i in 0..300 {
            let mut p = on_node(pod(ended("2026-01-01T00:01:00Z"), running(), true));
            (p.metadata.uid, p.metadata.namespace) = (Some(format!("u{i}")), Some(format!("ci-{i}")));
            o.on_watch(watcher::Event::Apply(p.clone()));
            let done = on_node(pod(ended("2026-01-01T00:01:00Z"), ended("2026-01-01T00:01:05Z"), false));
            let mut done = done;
            (done.metadata.uid, done.metadata.namespace) = (Some(format!("u{i}")), Some(format!("ci-{i}")));
            o.on_watch(watcher::Event::Apply(done.clone()));
            o.on_watch(watcher::Event::Delete(done));
        }
        let (namespaces, lines) = series(&m);
        let mut want: HashSet<String> = (0..5).map(|i| format!("ci-{i}")).collect();
        want.insert("_other".into());
        assert_eq!(namespaces, want);
        let text = exposition(&m);
        assert!(
            text.contains("namespace=\"_other\",owner_kind=\"Job\",acted=\"false\",sidecar_mode=\"classic\"} 295"),
            "{text}"
        );
        // Quiet for an hour (by the pods' gone time, now): every series goes.
        o.on_tick(Utc::now() + chrono::TimeDelta::minutes(61));
        let (namespaces, after) = series(&m);
        assert!(lines > 0 && namespaces.is_empty() && after == 0, "{}", exposition(&m));
        assert!(exposition(&m).contains("# TYPE valet_sidecar_tax_seconds histogram"), "the family stays declared");
    }

    #[tokio::test]
    async fn native_sidecars_show_their_shutdown_and_startup_tax() {
        let (mut o, m, probe) = observer(Some(true));
        o.on_watch(watcher::Event::Apply(on_node(native_pod(waiting(), running(), false))));
        // Its proxy is asked until ready; the answer comes back to the observer.
        for _ in 0..100 {
            settle(&mut o).await;
            if o.tally.len() == 1 && o.watches.is_empty() {
                break;
            }
        }
        assert!(o.watches.is_empty(), "asked once, answered ready");
        assert_eq!(probe.asked.lock().expect("lock").first().map(|a| a.1), Some(15021));
        // The kubelet moves on to the app 3 s after the answer (its startupProbe's period), and
        // the app's image takes a minute to pull.
        let secs = |from_now: i64| {
            (Utc::now() + chrono::TimeDelta::seconds(from_now)).to_rfc3339_opts(chrono::SecondsFormat::Secs, true)
        };
        let (moved, start) = (secs(3), secs(63));
        o.on_watch(watcher::Event::Apply(on_node(initialized(native_pod(waiting(), running(), true), "True", &moved))));
        let text = exposition(&m);
        assert!(text.contains(&format!("valet_sidecar_startup_tax_seconds_count{{{LABELS}}} 1")), "{text}");
        // At least the 2 s between the answer and the move (whole seconds, truncated).
        assert!(text.contains(&format!("valet_sidecar_startup_tax_seconds_bucket{{le=\"1.0\",{LABELS}}} 0")), "{text}");
        assert!(text.contains(&format!("valet_sidecar_startup_tax_seconds_bucket{{le=\"5.0\",{LABELS}}} 1")), "{text}");
        assert!(!text.contains("valet_app_container_start_seconds_count{"), "the app has not started: {text}");
        let app = initialized(native_pod(started(&start), running(), true), "True", &moved);
        o.on_watch(watcher::Event::Apply(on_node(app)));
        let text = exposition(&m);
        assert!(text.contains(&format!("valet_sidecar_startup_tax_seconds_count{{{LABELS}}} 1")), "once: {text}");
        assert!(text.contains(&format!("valet_app_container_start_seconds_sum{{{LABELS}}} 60.0")), "the pull: {text}");

        o.on_watch(watcher::Event::Apply(on_node(native_pod(ended("2026-01-01T00:01:00Z"), running(), true))));
        let done = native_pod(ended("2026-01-01T00:01:00Z"), ended("2026-01-01T00:01:06Z"), false);
        o.on_watch(watcher::Event::Apply(on_node(done)));
        let text = exposition(&m);
        let native = format!("valet_sidecar_tax_seconds_sum{{{LABELS},acted=\"false\",sidecar_mode=\"native\"}} 6.0");
        assert!(text.contains(&native), "{text}");

        // Native sidecars run on this node: a new classic Istio pod is Istio's fallback.
        let mut classic = on_node(pod(waiting(), running(), false));
        classic.metadata.uid = Some("u2".into());
        o.on_watch(watcher::Event::Apply(classic));
        let text = exposition(&m);
        assert!(text.contains("valet_classic_sidecar_pods_on_native_node_total{namespace=\"jobs\"} 1"), "{text}");
    }
}
