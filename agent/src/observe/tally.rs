//! The observer's bookkeeping, pure: one small record per observed pod, fed each `Look` the
//! watch brings, answering with what to count. No clock, no I/O: the caller gives "now" and
//! carries the notes out (metrics, readiness probes).

use std::collections::{BTreeSet, HashMap};

use chrono::{DateTime, Utc};

use super::look::{Look, OwnerKind, ProxySeen, SidecarMode};
use super::namespaces::Namespaces;
use crate::vocab::Endpoint;

/// The labels an observed pod's series carry: its namespace's label value (bounded, see
/// [`Namespaces`]), owner kind and sidecar mode.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PodKey {
    pub namespace: String,
    pub owner_kind: OwnerKind,
    pub mode: SidecarMode,
}

/// What the observer saw but did not count, and why (`valet_observe_uncounted_total{reason}`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Uncounted {
    /// The proxy of an app that started before it was reported ready could not be asked (its
    /// network namespace could not be entered).
    RaceUnknown,
    /// The proxy was not ready when asked, and ended without the kubelet ever reporting it
    /// ready: it was stopping (the app's own `quitquitquit`, valet's quit, a deletion) as likely
    /// as starting, so the app's start is not counted as a race.
    RaceUnconfirmed,
    /// A pod whose apps had ended went while the watch was down (missing from a re-list): when
    /// its sidecars ended is unknown, so its tax is not counted.
    TaxUnseen,
}

impl Uncounted {
    pub const ALL: [Uncounted; 3] = [Uncounted::RaceUnknown, Uncounted::RaceUnconfirmed, Uncounted::TaxUnseen];

    pub fn as_str(self) -> &'static str {
        match self {
            Uncounted::RaceUnknown => "race_unknown",
            Uncounted::RaceUnconfirmed => "race_unconfirmed",
            Uncounted::TaxUnseen => "tax_unseen",
        }
    }
}

/// What the caller counts or does.
#[derive(Clone, Debug, PartialEq)]
pub enum Note {
    /// The pod started (+1) or stopped (-1) waiting on its sidecars.
    Waiting(PodKey, i64),
    /// The pod's sidecars ended this long after its apps (valet quit or signalled one: `acted`).
    Tax { key: PodKey, seconds: f64, acted: bool },
    /// Apps started while the kubelet did not report the proxy ready: ask the proxy once whether
    /// it is ready now, and give the answer to [`Tally::probe_answered`].
    Probe { uid: String, endpoint: Endpoint, apps: u64 },
    /// `apps` apps started before their proxy was ready: the proxy, not ready when asked, was
    /// reported ready later (it was starting, not stopping).
    Race { key: PodKey, apps: u64 },
    /// Seen, not counted.
    Uncounted(Uncounted),
    /// A native proxy runs and no app has started: ask it until it is ready and give the moment
    /// to [`Tally::proxy_ready_at`] (the startup tax runs from then to the kubelet's move to the
    /// apps).
    WatchReady { uid: String, endpoint: Endpoint },
    /// Stop asking that proxy (its app started, it ended, or the pod went).
    Unwatch { uid: String },
    /// What the native proxy cost the apps' start: from its readiness to the kubelet's move to
    /// the apps (the pod's `Initialized` condition).
    StartupTax { key: PodKey, seconds: f64 },
    /// What the apps' own start cost after that: from the kubelet's move to the apps to the
    /// first app's `startedAt` (the app's image pull, its container's creation and start).
    AppStart { key: PodKey, seconds: f64 },
    /// A new pod whose mesh proxy was injected as a regular container, on a node where native
    /// sidecars run.
    ClassicOnNative(PodKey),
}

/// Whether the startup race is still to be judged.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Race {
    Open {
        /// Apps already judged (or seen started when the pod was first seen: their order with
        /// the proxy is unknown, and an agent restart must not count them again).
        judged: BTreeSet<String>,
        /// Apps whose probe has not answered yet.
        asking: u64,
        /// Apps found started while their proxy was not ready, until it is seen ready (then they
        /// are counted) or ends (then they are not).
        unconfirmed: u64,
        /// The proxy was seen ready: reported by the kubelet, or answering a probe.
        ready_seen: bool,
        /// Every sidecar has ended.
        ended: bool,
    },
    /// Nothing more to judge.
    Settled,
}

impl Race {
    fn open(judged: BTreeSet<String>) -> Race {
        Race::Open { judged, asking: 0, unconfirmed: 0, ready_seen: false, ended: false }
    }

    /// Confirms or drops the unconfirmed apps once the proxy was seen ready or ended, and
    /// settles once no probe is out.
    fn conclude(&mut self, notes: &mut Vec<Note>, key: &PodKey) {
        let Race::Open { asking, unconfirmed, ready_seen, ended, .. } = self else { return };
        if *unconfirmed > 0 && *ready_seen {
            notes.push(Note::Race { key: key.clone(), apps: std::mem::take(unconfirmed) });
        } else if *unconfirmed > 0 && *ended {
            *unconfirmed = 0;
            notes.push(Note::Uncounted(Uncounted::RaceUnconfirmed));
        }
        if *asking == 0 && *unconfirmed == 0 && (*ready_seen || *ended) {
            *self = Race::Settled;
        }
    }
}

/// The native proxy's startup, for the startup tax and the apps' own start after it.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Startup {
    /// Not measured: not native, an app had started (or the proxy was ready) at first sight, or a
    /// run-to-completion init container follows the proxy.
    Unmeasured,
    /// Its proxy is asked until ready.
    Watching,
    /// Found ready then; taxed when the kubelet moves on to the apps.
    Ready(DateTime<Utc>),
    /// The kubelet moved on to the apps then (the proxy's part taxed); the apps' own start is
    /// measured from then to the first app's start.
    Initialized(DateTime<Utc>),
}

#[derive(Clone, Debug)]
struct Seen {
    key: PodKey,
    waiting: bool,
    apps_ended: Option<DateTime<Utc>>,
    taxed: bool,
    race: Race,
    startup: Startup,
    /// Counted in [`Note::ClassicOnNative`], or not to be.
    classic_judged: bool,
}

/// Every observed pod, by uid.
#[derive(Debug)]
pub struct Tally {
    pods: HashMap<String, Seen>,
    namespaces: Namespaces,
    /// A native sidecar has run on this node (since the agent started).
    native_node: bool,
}

impl Tally {
    /// `max_namespaces`: how many namespaces get series of their own ([`Namespaces`]).
    pub fn new(namespace_label: bool, max_namespaces: usize) -> Tally {
        Tally { pods: HashMap::new(), namespaces: Namespaces::new(max_namespaces, namespace_label), native_node: false }
    }

    pub fn len(&self) -> usize {
        self.pods.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pods.is_empty()
    }

    pub fn uids(&self) -> impl Iterator<Item = &String> {
        self.pods.keys()
    }

    /// The oldest wait of each key's waiting pods, in seconds at `now`.
    pub fn longest_waits(&self, now: DateTime<Utc>) -> HashMap<PodKey, f64> {
        let mut longest: HashMap<PodKey, f64> = HashMap::new();
        for seen in self.pods.values().filter(|s| s.waiting) {
            let Some(since) = seen.apps_ended else { continue };
            let wait = seconds_between(since, now);
            let entry = longest.entry(seen.key.clone()).or_insert(wait);
            *entry = entry.max(wait);
        }
        longest
    }

    /// A new look at a pod. `acted`: valet sent one of its sidecars a quit or a signal.
    pub fn look(&mut self, look: Look, acted: bool) -> Vec<Note> {
        let mut notes = Vec::new();
        self.native_node |= look.sidecars.native_running;
        let first = !self.pods.contains_key(&look.uid);
        let native_node = self.native_node;
        let namespaces = &mut self.namespaces;
        let seen = self.pods.entry(look.uid.clone()).or_insert_with(|| {
            let nothing_started = look.apps.started.is_empty();
            Seen {
                key: PodKey {
                    namespace: namespaces.admit(&look.namespace),
                    owner_kind: look.owner_kind,
                    mode: look.mode,
                },
                waiting: false,
                apps_ended: None,
                // Sidecars that had ended before the first look (a finished pod kept until its
                // Job's TTL, an agent restart): taxed before, or never seen paying; not counted.
                taxed: look.sidecars.ended.is_some(),
                race: if look.proxy_ready() { Race::Settled } else { Race::open(look.apps.started.clone()) },
                startup: Startup::Unmeasured,
                // Only pods seen before their apps start: an agent restart must not count the
                // node's pods again.
                classic_judged: !nothing_started,
            }
        });
        if first
            && look.mode == SidecarMode::Native
            && look.apps.started.is_empty()
            && !look.proxy_ready()
            && look.initialized_at.is_none()
            && let Some(ProxySeen { endpoint, init_after: false, .. }) = &look.proxy
        {
            seen.startup = Startup::Watching;
            notes.push(Note::WatchReady { uid: look.uid.clone(), endpoint: endpoint.clone() });
        }
        if !seen.classic_judged && look.sidecars.mesh_classic && native_node {
            seen.classic_judged = true;
            notes.push(Note::ClassicOnNative(seen.key.clone()));
        }
        let waiting = look.waiting() && !seen.taxed;
        if waiting != seen.waiting {
            notes.push(Note::Waiting(seen.key.clone(), if waiting { 1 } else { -1 }));
            seen.waiting = waiting;
        }
        if seen.apps_ended.is_none() {
            seen.apps_ended = look.apps.ended;
        }
        if let (Some(apps), Some(sidecars), false) = (seen.apps_ended, look.sidecars.ended, seen.taxed) {
            seen.taxed = true;
            notes.push(Note::Tax { key: seen.key.clone(), seconds: seconds_between(apps, sidecars), acted });
        }
        seen.startup_look(&look, &mut notes);
        seen.race_look(&look, &mut notes);
        notes
    }

    /// A [`Note::Probe`]'s answer: `Some(ready)`, or None when the proxy could not be asked.
    /// Not ready counts the apps once the proxy is seen ready (before or after this answer).
    pub fn probe_answered(&mut self, uid: &str, apps: u64, answer: Option<bool>) -> Vec<Note> {
        let Some(seen) = self.pods.get_mut(uid) else { return Vec::new() };
        let Race::Open { asking, unconfirmed, ready_seen, .. } = &mut seen.race else { return Vec::new() };
        *asking = asking.saturating_sub(apps);
        let mut notes = Vec::new();
        match answer {
            None => notes.push(Note::Uncounted(Uncounted::RaceUnknown)),
            Some(true) => *ready_seen = true,
            Some(false) => *unconfirmed += apps,
        }
        seen.race.conclude(&mut notes, &seen.key);
        notes
    }

    /// The proxy a [`Note::WatchReady`] asked about answered ready at `at`.
    pub fn proxy_ready_at(&mut self, uid: &str, at: DateTime<Utc>) {
        if let Some(seen) = self.pods.get_mut(uid)
            && seen.startup == Startup::Watching
        {
            seen.startup = Startup::Ready(at);
        }
    }

    /// The pod was deleted, and the deletion is seen at `now` (the caller looked at its last
    /// object first: sidecars' ends it shows were taxed from their own times). A pod still
    /// waiting ended with its deletion: taxed up to `now`, or its `deletionTimestamp` if earlier
    /// (an event seen late after a watch restart).
    pub fn gone(&mut self, uid: &str, acted: bool, now: DateTime<Utc>, deleted_at: Option<DateTime<Utc>>) -> Vec<Note> {
        let Some(seen) = self.remove(uid, now) else { return Vec::new() };
        let mut notes = seen.leave(uid);
        if let (Some(apps), false) = (seen.apps_ended, seen.taxed) {
            let end = deleted_at.map_or(now, |d| d.min(now));
            notes.push(Note::Tax { key: seen.key, seconds: seconds_between(apps, end), acted });
        }
        notes
    }

    /// The pod went while the watch was down (missing from a re-list): nothing tells when its
    /// sidecars ended, so a pod whose apps had ended is not taxed (counted as [`Uncounted`]).
    pub fn vanished(&mut self, uid: &str, now: DateTime<Utc>) -> Vec<Note> {
        let Some(seen) = self.remove(uid, now) else { return Vec::new() };
        let mut notes = seen.leave(uid);
        if seen.apps_ended.is_some() && !seen.taxed {
            notes.push(Note::Uncounted(Uncounted::TaxUnseen));
        }
        notes
    }

    /// The namespace label values no observed pod has held for an hour: their series go.
    pub fn sweep(&mut self, now: DateTime<Utc>) -> Vec<String> {
        self.namespaces.sweep(now)
    }

    fn remove(&mut self, uid: &str, now: DateTime<Utc>) -> Option<Seen> {
        let seen = self.pods.remove(uid)?;
        self.namespaces.release(&seen.key.namespace, now);
        Some(seen)
    }
}

impl Seen {
    /// What a pod's going ends: its wait, a watch of its proxy, a race never confirmed.
    fn leave(&self, uid: &str) -> Vec<Note> {
        let mut notes = Vec::new();
        if self.waiting {
            notes.push(Note::Waiting(self.key.clone(), -1));
        }
        if matches!(self.race, Race::Open { unconfirmed: 1.., .. }) {
            notes.push(Note::Uncounted(Uncounted::RaceUnconfirmed));
        }
        if self.startup == Startup::Watching {
            notes.push(Note::Unwatch { uid: uid.to_owned() });
        }
        notes
    }

    fn startup_look(&mut self, look: &Look, notes: &mut Vec<Note>) {
        // The kubelet moved on to the apps: what the proxy cost ends here (a proxy found ready
        // after that, in the same second, cost nothing).
        if let (Startup::Ready(ready), Some(initialized)) = (&self.startup, look.initialized_at) {
            notes.push(Note::StartupTax { key: self.key.clone(), seconds: seconds_between(*ready, initialized) });
            self.startup = Startup::Initialized(initialized);
        }
        let Some(started) = look.apps.first_started else {
            if self.startup == Startup::Watching
                && !look.proxy.as_ref().is_some_and(|p| p.running)
                && look.sidecars.ended.is_some()
            {
                self.startup = Startup::Unmeasured;
                notes.push(Note::Unwatch { uid: look.uid.clone() });
            }
            return;
        };
        match std::mem::replace(&mut self.startup, Startup::Unmeasured) {
            Startup::Initialized(initialized) => {
                notes.push(Note::AppStart { key: self.key.clone(), seconds: seconds_between(initialized, started) });
            }
            // An app started with no `Initialized` condition True: nothing tells where the
            // proxy's part ends and the app's begins, so neither is measured.
            Startup::Ready(_) => {}
            // The app started before the proxy answered ready: not measured.
            Startup::Watching => notes.push(Note::Unwatch { uid: look.uid.clone() }),
            Startup::Unmeasured => {}
        }
    }

    fn race_look(&mut self, look: &Look, notes: &mut Vec<Note>) {
        if look.hold_app {
            self.race = Race::Settled;
        }
        let Race::Open { judged, asking, ready_seen, ended, .. } = &mut self.race else { return };
        *ready_seen |= look.proxy_ready();
        *ended |= look.sidecars.ended.is_some();
        match &look.proxy {
            None => *ended = true,
            // Only apps running now are asked about: one that already ended (and may have told
            // its proxy to quit, as apps do without valet) says nothing about the proxy's start.
            Some(ProxySeen { endpoint, .. }) if !*ready_seen && !*ended => {
                let new: Vec<String> = look.apps.started.iter().filter(|a| !judged.contains(*a)).cloned().collect();
                let apps = new.iter().filter(|a| look.apps.running.contains(*a)).count() as u64;
                judged.extend(new);
                if apps > 0 {
                    *asking += apps;
                    notes.push(Note::Probe { uid: look.uid.clone(), endpoint: endpoint.clone(), apps });
                }
            }
            Some(_) => {}
        }
        self.race.conclude(notes, &self.key);
    }
}

fn seconds_between(from: DateTime<Utc>, to: DateTime<Utc>) -> f64 {
    ((to - from).num_milliseconds().max(0) as f64) / 1000.0
}

#[cfg(test)]
mod tests {
    use super::super::look::{look, tests::*};
    use super::*;
    use crate::pod::spec::SidecarDefaults;

    fn seen(app: serde_json::Value, proxy: serde_json::Value, ready: bool) -> Look {
        look(&pod(app, proxy, ready), &SidecarDefaults::default()).expect("ok").expect("observed")
    }

    fn native(app: serde_json::Value, proxy: serde_json::Value, ready: bool) -> Look {
        look(&native_pod(app, proxy, ready), &SidecarDefaults::default()).expect("ok").expect("observed")
    }

    fn time(s: &str) -> DateTime<Utc> {
        s.parse().expect("time")
    }

    fn races(notes: &[Note]) -> Vec<u64> {
        notes.iter().filter_map(|n| if let Note::Race { apps, .. } = n { Some(*apps) } else { None }).collect()
    }

    fn key() -> PodKey {
        PodKey { namespace: "jobs".into(), owner_kind: OwnerKind::Job, mode: SidecarMode::Classic }
    }

    fn probes(notes: &[Note]) -> Vec<u64> {
        notes.iter().filter_map(|n| if let Note::Probe { apps, .. } = n { Some(*apps) } else { None }).collect()
    }

    #[test]
    fn waiting_then_taxed_when_the_proxy_ends() {
        let mut t = Tally::new(true, 50);
        assert_eq!(t.look(seen(running(), running(), true), false), []);
        let notes = t.look(seen(ended("2026-01-01T00:01:00Z"), running(), true), false);
        assert_eq!(notes, [Note::Waiting(key(), 1)]);
        // The same status again changes nothing.
        assert_eq!(t.look(seen(ended("2026-01-01T00:01:00Z"), running(), true), false), []);
        let notes = t.look(seen(ended("2026-01-01T00:01:00Z"), ended("2026-01-01T00:11:30Z"), false), false);
        assert_eq!(notes, [Note::Waiting(key(), -1), Note::Tax { key: key(), seconds: 630.0, acted: false }]);
        // Counted once, and not again when the pod goes.
        assert_eq!(t.look(seen(ended("2026-01-01T00:01:00Z"), ended("2026-01-01T00:11:30Z"), false), false), []);
        let later = "2026-01-01T01:00:00Z".parse().expect("time");
        assert_eq!(t.gone("u1", false, later, None), []);
        assert!(t.is_empty());
    }

    #[test]
    fn a_pod_already_finished_when_first_seen_is_not_taxed() {
        // Completed pods stay until deleted: an agent restart must not count them again.
        let mut t = Tally::new(true, 50);
        assert_eq!(t.look(seen(ended("2026-01-01T00:01:00Z"), ended("2026-01-01T00:02:00Z"), false), false), []);
        let later = "2026-01-02T00:00:00Z".parse().expect("time");
        assert_eq!(t.gone("u1", false, later, None), []);
        // Waiting when first seen: its wait is witnessed, and taxed from the app's end.
        let mut t = Tally::new(true, 50);
        assert_eq!(t.look(seen(ended("2026-01-01T00:01:00Z"), running(), true), false), [Note::Waiting(key(), 1)]);
        let notes = t.look(seen(ended("2026-01-01T00:01:00Z"), ended("2026-01-01T00:02:00Z"), false), false);
        assert_eq!(notes, [Note::Waiting(key(), -1), Note::Tax { key: key(), seconds: 60.0, acted: false }]);
    }

    #[test]
    fn an_ended_proxy_is_not_asked() {
        let mut t = Tally::new(true, 50);
        t.look(seen(waiting(), running(), false), false);
        let notes = t.look(seen(ended("2026-01-01T00:01:00Z"), ended("2026-01-01T00:01:00Z"), false), true);
        assert_eq!(probes(&notes), Vec::<u64>::new());
    }

    #[test]
    fn an_app_valet_holds_is_never_probed() {
        let mut t = Tally::new(true, 50);
        let mut l = seen(waiting(), running(), false);
        l.hold_app = true;
        t.look(l.clone(), false);
        l.apps.started.insert("app".into());
        assert_eq!(probes(&t.look(l, false)), Vec::<u64>::new());
    }

    #[test]
    fn a_quit_is_taxed_as_acted_and_a_deletion_ends_the_wait() {
        let mut t = Tally::new(false, 50);
        let k = PodKey { namespace: String::new(), owner_kind: OwnerKind::Job, mode: SidecarMode::Classic };
        t.look(seen(ended("2026-01-01T00:01:00Z"), running(), true), false);
        let notes = t.look(seen(ended("2026-01-01T00:01:00Z"), ended("2026-01-01T00:01:00Z"), false), true);
        assert_eq!(notes, [Note::Waiting(k.clone(), -1), Note::Tax { key: k.clone(), seconds: 0.0, acted: true }]);

        let mut t = Tally::new(false, 50);
        t.look(seen(ended("2026-01-01T00:01:00Z"), running(), true), false);
        let now = "2026-01-01T00:31:00Z".parse().expect("time");
        assert_eq!(
            t.gone("u1", false, now, None),
            [Note::Waiting(k.clone(), -1), Note::Tax { key: k, seconds: 1800.0, acted: false }]
        );
        assert!(t.gone("u1", false, now, None).is_empty(), "once");
    }

    #[test]
    fn an_app_started_before_the_proxy_reported_ready_is_probed_once() {
        let mut t = Tally::new(true, 50);
        assert_eq!(probes(&t.look(seen(waiting(), running(), false), false)), Vec::<u64>::new());
        assert_eq!(probes(&t.look(seen(running(), running(), false), false)), [1]);
        assert_eq!(probes(&t.look(seen(running(), running(), false), false)), Vec::<u64>::new(), "judged once");
        assert_eq!(probes(&t.look(seen(running(), running(), true), false)), Vec::<u64>::new());
    }

    #[test]
    fn a_proxy_reported_ready_first_or_answering_ready_settles_the_race() {
        let mut t = Tally::new(true, 50);
        t.look(seen(waiting(), running(), false), false);
        t.look(seen(waiting(), running(), true), false);
        assert_eq!(probes(&t.look(seen(running(), running(), false), false)), Vec::<u64>::new());

        let mut t = Tally::new(true, 50);
        t.look(seen(waiting(), running(), false), false);
        assert_eq!(t.probe_answered("u1", 0, Some(true)), []);
        assert_eq!(probes(&t.look(seen(running(), running(), false), false)), Vec::<u64>::new());
    }

    #[test]
    fn apps_already_started_when_first_seen_are_not_judged() {
        // An agent (re)started after the app: the order is unknown, nothing is counted.
        let mut t = Tally::new(true, 50);
        assert_eq!(probes(&t.look(seen(running(), running(), false), false)), Vec::<u64>::new());
        assert_eq!(t.len(), 1);
        assert_eq!(t.uids().collect::<Vec<_>>(), ["u1"]);
    }

    #[test]
    fn a_race_counts_once_the_proxy_found_not_ready_is_seen_ready_in_either_order() {
        // Answered not ready, then reported ready: it was starting.
        let mut t = Tally::new(true, 50);
        t.look(seen(waiting(), running(), false), false);
        assert_eq!(probes(&t.look(seen(running(), running(), false), false)), [1]);
        assert_eq!(t.probe_answered("u1", 1, Some(false)), []);
        assert_eq!(races(&t.look(seen(running(), running(), true), false)), [1]);
        assert_eq!(races(&t.look(seen(running(), running(), true), false)), Vec::<u64>::new(), "once");

        // Reported ready while the probe was out, then answered not ready.
        let mut t = Tally::new(true, 50);
        t.look(seen(waiting(), running(), false), false);
        t.look(seen(running(), running(), false), false);
        assert_eq!(races(&t.look(seen(running(), running(), true), false)), Vec::<u64>::new());
        assert_eq!(races(&t.probe_answered("u1", 1, Some(false))), [1]);
    }

    #[test]
    fn an_app_that_quits_its_own_proxy_is_not_counted_as_a_race() {
        // Seen running while the kubelet has not reported the proxy ready; by the time it is
        // asked the app has told it to quit. The proxy ends without ever being seen ready.
        let mut t = Tally::new(true, 50);
        t.look(seen(waiting(), running(), false), false);
        assert_eq!(probes(&t.look(seen(running(), running(), false), false)), [1]);
        assert_eq!(t.probe_answered("u1", 1, Some(false)), []);
        let notes = t.look(seen(ended("2026-01-01T00:01:00Z"), ended("2026-01-01T00:01:00Z"), false), false);
        assert_eq!(races(&notes), Vec::<u64>::new());
        assert!(notes.contains(&Note::Uncounted(Uncounted::RaceUnconfirmed)), "{notes:?}");

        // First seen started once it had already ended: not asked at all.
        let mut t = Tally::new(true, 50);
        t.look(seen(waiting(), running(), false), false);
        assert_eq!(probes(&t.look(seen(ended("2026-01-01T00:01:00Z"), running(), false), false)), Vec::<u64>::new());

        // Not ready, and the pod deleted before the proxy was ever seen ready.
        let mut t = Tally::new(true, 50);
        t.look(seen(waiting(), running(), false), false);
        t.look(seen(running(), running(), false), false);
        t.probe_answered("u1", 1, Some(false));
        let notes = t.gone("u1", false, time("2026-01-01T00:05:00Z"), None);
        assert_eq!(notes, [Note::Uncounted(Uncounted::RaceUnconfirmed)]);
    }

    #[test]
    fn a_proxy_that_cannot_be_asked_counts_as_unknown() {
        let mut t = Tally::new(true, 50);
        t.look(seen(waiting(), running(), false), false);
        t.look(seen(running(), running(), false), false);
        assert_eq!(t.probe_answered("u1", 1, None), [Note::Uncounted(Uncounted::RaceUnknown)]);
        assert_eq!(races(&t.look(seen(running(), running(), true), false)), Vec::<u64>::new());
    }

    #[test]
    fn a_pod_gone_during_a_watch_outage_is_not_taxed_and_a_deletion_is_taxed_to_its_own_time() {
        let mut t = Tally::new(true, 50);
        t.look(seen(ended("2026-01-01T00:01:00Z"), running(), true), false);
        let notes = t.vanished("u1", time("2026-01-02T00:00:00Z"));
        assert_eq!(notes, [Note::Waiting(key(), -1), Note::Uncounted(Uncounted::TaxUnseen)]);
        assert!(t.is_empty());

        // A deletion seen late (a watch restart): taxed to the pod's deletionTimestamp.
        let mut t = Tally::new(true, 50);
        t.look(seen(ended("2026-01-01T00:01:00Z"), running(), true), false);
        let notes = t.gone("u1", false, time("2026-01-02T00:00:00Z"), Some(time("2026-01-01T00:02:00Z")));
        assert_eq!(notes, [Note::Waiting(key(), -1), Note::Tax { key: key(), seconds: 60.0, acted: false }]);
    }

    #[test]
    fn native_sidecars_are_taxed_with_their_mode() {
        let mut t = Tally::new(true, 50);
        let k = PodKey { mode: SidecarMode::Native, ..key() };
        t.look(native(started("2026-01-01T00:00:05Z"), running(), true), false);
        assert_eq!(
            t.look(native(ended("2026-01-01T00:01:00Z"), running(), true), false),
            [Note::Waiting(k.clone(), 1)]
        );
        // The kubelet's SIGTERM, the proxy's 5 s drain, a second's report.
        let notes = t.look(native(ended("2026-01-01T00:01:00Z"), ended("2026-01-01T00:01:06Z"), false), false);
        assert_eq!(notes, [Note::Waiting(k.clone(), -1), Note::Tax { key: k, seconds: 6.0, acted: false }]);
    }

    /// `native`, with the pod's `Initialized` condition True since `at`.
    fn native_initialized(app: serde_json::Value, proxy: serde_json::Value, ready: bool, at: &str) -> Look {
        let p = initialized(native_pod(app, proxy, ready), "True", at);
        look(&p, &SidecarDefaults::default()).expect("ok").expect("observed")
    }

    #[test]
    fn the_startup_tax_runs_from_the_native_proxys_readiness_to_the_kubelets_move_to_the_apps() {
        let mut t = Tally::new(true, 50);
        let k = PodKey { mode: SidecarMode::Native, ..key() };
        let notes = t.look(native(waiting(), running(), false), false);
        assert!(matches!(&notes[..], [Note::WatchReady { uid, endpoint }] if uid == "u1" && endpoint.port == 15021));
        t.proxy_ready_at("u1", time("2026-01-01T00:00:02.300Z"));
        // The kubelet's startupProbe (10 s by default) passed at 00:00:12: it moved on to the app.
        let notes = t.look(native_initialized(waiting(), running(), true, "2026-01-01T00:00:12Z"), false);
        assert_eq!(notes, [Note::StartupTax { key: k.clone(), seconds: 9.7 }]);
        // The app's image took 40 s to pull: the app's own cost, not the proxy's.
        let notes =
            t.look(native_initialized(started("2026-01-01T00:00:52Z"), running(), true, "2026-01-01T00:00:12Z"), false);
        assert_eq!(notes, [Note::AppStart { key: k.clone(), seconds: 40.0 }]);
        let again = native_initialized(started("2026-01-01T00:00:52Z"), running(), true, "2026-01-01T00:00:12Z");
        assert_eq!(t.look(again, false), [], "once");

        // Both seen in one status: both parts at once.
        let mut t = Tally::new(true, 50);
        t.look(native(waiting(), running(), false), false);
        t.proxy_ready_at("u1", time("2026-01-01T00:00:02.300Z"));
        let notes =
            t.look(native_initialized(started("2026-01-01T00:00:04Z"), running(), true, "2026-01-01T00:00:03Z"), false);
        assert_eq!(notes, [Note::StartupTax { key: k.clone(), seconds: 0.7 }, Note::AppStart { key: k, seconds: 1.0 }]);

        // The app started and no Initialized condition says when the kubelet moved on to it:
        // neither part is measured.
        let mut t = Tally::new(true, 50);
        t.look(native(waiting(), running(), false), false);
        t.proxy_ready_at("u1", time("2026-01-01T00:00:02.300Z"));
        assert_eq!(t.look(native(started("2026-01-01T00:00:12Z"), running(), true), false), []);

        // The app seen started before the proxy answered ready: not measured, the asking stops.
        let mut t = Tally::new(true, 50);
        t.look(native(waiting(), running(), false), false);
        let notes = t.look(native(started("2026-01-01T00:00:12Z"), running(), true), false);
        assert_eq!(notes, [Note::Unwatch { uid: "u1".into() }]);

        // Seen first with the app started (an agent restart), or already initialized: nothing asked.
        let mut t = Tally::new(true, 50);
        assert_eq!(t.look(native(started("2026-01-01T00:00:12Z"), running(), true), false), []);
        let mut t = Tally::new(true, 50);
        assert_eq!(t.look(native_initialized(waiting(), running(), true, "2026-01-01T00:00:12Z"), false), []);
        // A run-to-completion init container after the proxy: its run is neither part.
        let mut t = Tally::new(true, 50);
        let mut l = native(waiting(), running(), false);
        l.proxy.as_mut().expect("a proxy").init_after = true;
        assert_eq!(t.look(l, false), []);
        // Classic pods are not asked: their apps start beside the proxy (the race counter's case).
        let mut t = Tally::new(true, 50);
        assert_eq!(t.look(seen(waiting(), running(), false), false), []);
    }

    #[test]
    fn classic_mesh_pods_are_counted_once_native_sidecars_run_on_the_node() {
        let mut t = Tally::new(true, 50);
        // No native sidecar seen yet: the node may not support them.
        assert_eq!(t.look(seen(waiting(), running(), false), false), []);
        let mut n = native(started("2026-01-01T00:00:05Z"), running(), true);
        n.uid = "native".into();
        t.look(n, false);
        let mut c = seen(waiting(), running(), false);
        c.uid = "classic".into();
        assert_eq!(t.look(c.clone(), false), [Note::ClassicOnNative(key())]);
        assert_eq!(t.look(c, false), [], "once a pod");
        // A classic pod first seen running (an agent restart) is not counted again.
        let mut old = seen(running(), running(), true);
        old.uid = "old".into();
        assert_eq!(t.look(old, false), []);
    }

    #[test]
    fn a_flood_of_namespaces_keeps_a_bounded_set_of_label_values() {
        let mut t = Tally::new(true, 3);
        let mut values = std::collections::BTreeSet::new();
        for i in 0..500 {
            let mut l = seen(ended("2026-01-01T00:01:00Z"), running(), true);
            (l.uid, l.namespace) = (format!("u{i}"), format!("ci-{i}"));
            for note in t.look(l, false) {
                if let Note::Waiting(k, _) = note {
                    values.insert(k.namespace);
                }
            }
        }
        assert_eq!(values.into_iter().collect::<Vec<_>>(), ["_other", "ci-0", "ci-1", "ci-2"]);
        for i in 0..500 {
            t.gone(&format!("u{i}"), false, time("2026-01-01T00:02:00Z"), None);
        }
        assert_eq!(t.sweep(time("2026-01-01T00:30:00Z")), Vec::<String>::new(), "not quiet yet");
        assert_eq!(t.sweep(time("2026-01-01T03:00:00Z")).len(), 4, "every value dropped");
    }

    #[test]
    fn the_longest_wait_per_key() {
        let mut t = Tally::new(true, 50);
        t.look(seen(ended("2026-01-01T00:01:00Z"), running(), true), false);
        let mut l = seen(ended("2026-01-01T00:03:00Z"), running(), true);
        l.uid = "u2".into();
        t.look(l, false);
        let longest = t.longest_waits(time("2026-01-01T00:11:00Z"));
        assert_eq!(longest.into_iter().collect::<Vec<_>>(), [(key(), 600.0)]);
    }
}
