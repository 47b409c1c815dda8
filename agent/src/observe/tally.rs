//! The observer's bookkeeping, pure: one small record per observed pod, fed each `Look` the
//! watch brings, answering with what to count. No clock, no I/O: the caller gives "now" and
//! carries the notes out (metrics, one readiness probe).

use std::collections::{BTreeSet, HashMap};

use chrono::{DateTime, Utc};

use super::look::{Look, OwnerKind};
use crate::vocab::Endpoint;

/// The labels an observed pod's series carry (the namespace is empty when the agent drops it).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PodKey {
    pub namespace: String,
    pub owner_kind: OwnerKind,
}

/// What the caller counts or does.
#[derive(Clone, Debug, PartialEq)]
pub enum Note {
    /// The pod started (+1) or stopped (-1) waiting on its sidecars.
    Waiting(PodKey, i64),
    /// The pod's sidecars ended this long after its apps (valet quit one: `acted`).
    Tax { key: PodKey, seconds: f64, acted: bool },
    /// Apps started while the kubelet did not report the proxy ready: ask the proxy once whether
    /// it is ready now. Not ready: `apps` apps started before it was ([`Tally::proxy_answered`]).
    Probe { uid: String, key: PodKey, endpoint: Endpoint, apps: u64 },
}

/// Whether the startup race is still to be judged.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Race {
    /// Apps already judged (or seen started when the pod was first seen: their order with the
    /// proxy is unknown, and an agent restart must not count them again).
    Open(BTreeSet<String>),
    /// The proxy was ready before any app still to start: nothing more to judge.
    Settled,
}

#[derive(Clone, Debug)]
struct Seen {
    key: PodKey,
    waiting: bool,
    apps_ended: Option<DateTime<Utc>>,
    taxed: bool,
    race: Race,
}

/// Every observed pod, by uid.
#[derive(Debug, Default)]
pub struct Tally {
    pods: HashMap<String, Seen>,
    /// Drop the namespace label (clusters with very many namespaces).
    no_namespace: bool,
}

impl Tally {
    pub fn new(namespace_label: bool) -> Tally {
        Tally { pods: HashMap::new(), no_namespace: !namespace_label }
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

    /// A new look at a pod. `acted`: valet sent one of its sidecars a quit.
    pub fn look(&mut self, look: Look, acted: bool) -> Vec<Note> {
        let key = PodKey {
            namespace: if self.no_namespace { String::new() } else { look.namespace.clone() },
            owner_kind: look.owner_kind,
        };
        let mut notes = Vec::new();
        let seen = self.pods.entry(look.uid.clone()).or_insert_with(|| Seen {
            key: key.clone(),
            waiting: false,
            apps_ended: None,
            // Sidecars that had ended before the first look (a finished pod kept until its
            // Job's TTL, an agent restart): taxed before, or never seen paying; not counted.
            taxed: look.sidecars_ended.is_some(),
            race: if look.proxy_ready { Race::Settled } else { Race::Open(look.apps_started.clone()) },
        });
        let waiting = look.waiting() && !seen.taxed;
        if waiting != seen.waiting {
            notes.push(Note::Waiting(seen.key.clone(), if waiting { 1 } else { -1 }));
            seen.waiting = waiting;
        }
        if seen.apps_ended.is_none() {
            seen.apps_ended = look.apps_ended;
        }
        if let (Some(apps), Some(sidecars), false) = (seen.apps_ended, look.sidecars_ended, seen.taxed) {
            seen.taxed = true;
            notes.push(Note::Tax { key: seen.key.clone(), seconds: seconds_between(apps, sidecars), acted });
        }
        if look.hold_app {
            seen.race = Race::Settled;
        }
        if let Race::Open(judged) = &mut seen.race {
            let new: Vec<String> = look.apps_started.iter().filter(|a| !judged.contains(*a)).cloned().collect();
            match &look.proxy {
                None => seen.race = Race::Settled,
                // Reported ready before the apps still to come started.
                Some(_) if new.is_empty() => {
                    if look.proxy_ready {
                        seen.race = Race::Settled;
                    }
                }
                // The proxy has ended: there is nothing left to ask.
                Some(_) if look.sidecars_ended.is_some() => judged.extend(new),
                Some((_, endpoint)) => {
                    let apps = new.len() as u64;
                    judged.extend(new);
                    notes.push(Note::Probe {
                        uid: look.uid.clone(),
                        key: seen.key.clone(),
                        endpoint: endpoint.clone(),
                        apps,
                    });
                }
            }
        }
        notes
    }

    /// The probe a [`Note::Probe`] asked for answered ready: no later app can start before it.
    pub fn proxy_answered(&mut self, uid: &str) {
        if let Some(seen) = self.pods.get_mut(uid) {
            seen.race = Race::Settled;
        }
    }

    /// The pod is gone (deleted, or missing from a re-list) at `now`. If it was still waiting,
    /// its sidecars ended with it: the tax runs to `now`.
    pub fn gone(&mut self, uid: &str, acted: bool, now: DateTime<Utc>) -> Vec<Note> {
        let Some(seen) = self.pods.remove(uid) else { return Vec::new() };
        let mut notes = Vec::new();
        if seen.waiting {
            notes.push(Note::Waiting(seen.key.clone(), -1));
        }
        if let (Some(apps), false) = (seen.apps_ended, seen.taxed) {
            notes.push(Note::Tax { key: seen.key, seconds: seconds_between(apps, now), acted });
        }
        notes
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

    fn key() -> PodKey {
        PodKey { namespace: "jobs".into(), owner_kind: OwnerKind::Job }
    }

    fn probes(notes: &[Note]) -> Vec<u64> {
        notes.iter().filter_map(|n| if let Note::Probe { apps, .. } = n { Some(*apps) } else { None }).collect()
    }

    #[test]
    fn waiting_then_taxed_when_the_proxy_ends() {
        let mut t = Tally::new(true);
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
        assert_eq!(t.gone("u1", false, later), []);
        assert!(t.is_empty());
    }

    #[test]
    fn a_pod_already_finished_when_first_seen_is_not_taxed() {
        // Completed pods stay until deleted: an agent restart must not count them again.
        let mut t = Tally::new(true);
        assert_eq!(t.look(seen(ended("2026-01-01T00:01:00Z"), ended("2026-01-01T00:02:00Z"), false), false), []);
        let later = "2026-01-02T00:00:00Z".parse().expect("time");
        assert_eq!(t.gone("u1", false, later), []);
        // Waiting when first seen: its wait is witnessed, and taxed from the app's end.
        let mut t = Tally::new(true);
        assert_eq!(t.look(seen(ended("2026-01-01T00:01:00Z"), running(), true), false), [Note::Waiting(key(), 1)]);
        let notes = t.look(seen(ended("2026-01-01T00:01:00Z"), ended("2026-01-01T00:02:00Z"), false), false);
        assert_eq!(notes, [Note::Waiting(key(), -1), Note::Tax { key: key(), seconds: 60.0, acted: false }]);
    }

    #[test]
    fn an_ended_proxy_is_not_asked() {
        let mut t = Tally::new(true);
        t.look(seen(waiting(), running(), false), false);
        let notes = t.look(seen(ended("2026-01-01T00:01:00Z"), ended("2026-01-01T00:01:00Z"), false), true);
        assert_eq!(probes(&notes), Vec::<u64>::new());
    }

    #[test]
    fn an_app_valet_holds_is_never_probed() {
        let mut t = Tally::new(true);
        let mut l = seen(waiting(), running(), false);
        l.hold_app = true;
        t.look(l.clone(), false);
        l.apps_started.insert("app".into());
        assert_eq!(probes(&t.look(l, false)), Vec::<u64>::new());
    }

    #[test]
    fn a_quit_is_taxed_as_acted_and_a_deletion_ends_the_wait() {
        let mut t = Tally::new(false);
        let k = PodKey { namespace: String::new(), owner_kind: OwnerKind::Job };
        t.look(seen(ended("2026-01-01T00:01:00Z"), running(), true), false);
        let notes = t.look(seen(ended("2026-01-01T00:01:00Z"), ended("2026-01-01T00:01:00Z"), false), true);
        assert_eq!(notes, [Note::Waiting(k.clone(), -1), Note::Tax { key: k.clone(), seconds: 0.0, acted: true }]);

        let mut t = Tally::new(false);
        t.look(seen(ended("2026-01-01T00:01:00Z"), running(), true), false);
        let now = "2026-01-01T00:31:00Z".parse().expect("time");
        assert_eq!(
            t.gone("u1", false, now),
            [Note::Waiting(k.clone(), -1), Note::Tax { key: k, seconds: 1800.0, acted: false }]
        );
        assert!(t.gone("u1", false, now).is_empty(), "once");
    }

    #[test]
    fn an_app_started_before_the_proxy_reported_ready_is_probed_once() {
        let mut t = Tally::new(true);
        assert_eq!(probes(&t.look(seen(waiting(), running(), false), false)), Vec::<u64>::new());
        assert_eq!(probes(&t.look(seen(running(), running(), false), false)), [1]);
        assert_eq!(probes(&t.look(seen(running(), running(), false), false)), Vec::<u64>::new(), "judged once");
        assert_eq!(probes(&t.look(seen(running(), running(), true), false)), Vec::<u64>::new());
    }

    #[test]
    fn a_proxy_reported_ready_first_or_answering_ready_settles_the_race() {
        let mut t = Tally::new(true);
        t.look(seen(waiting(), running(), false), false);
        t.look(seen(waiting(), running(), true), false);
        assert_eq!(probes(&t.look(seen(running(), running(), false), false)), Vec::<u64>::new());

        let mut t = Tally::new(true);
        t.look(seen(waiting(), running(), false), false);
        t.proxy_answered("u1");
        assert_eq!(probes(&t.look(seen(running(), running(), false), false)), Vec::<u64>::new());
    }

    #[test]
    fn apps_already_started_when_first_seen_are_not_judged() {
        // An agent (re)started after the app: the order is unknown, nothing is counted.
        let mut t = Tally::new(true);
        assert_eq!(probes(&t.look(seen(running(), running(), false), false)), Vec::<u64>::new());
        assert_eq!(t.len(), 1);
        assert_eq!(t.uids().collect::<Vec<_>>(), ["u1"]);
    }
}
