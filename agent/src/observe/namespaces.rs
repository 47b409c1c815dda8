//! The `namespace` label values of the observed pods' series, bounded: at most `max` namespaces
//! have series of their own at a time, the rest share [`OVERFLOW`]; a namespace none of whose
//! pods has been observed for [`QUIET`] gives its value back, and its series are dropped.
//! Short-lived namespaces (a CI run's) thus neither grow the agent's memory nor Prometheus's
//! without bound. Pure: the caller gives "now".

use std::collections::HashMap;

use chrono::{DateTime, TimeDelta, Utc};

/// The value pods of namespaces beyond the cap share. A namespace name is a DNS label, which
/// never holds `_`: no namespace can be mistaken for it.
pub const OVERFLOW: &str = "_other";

/// How long a namespace keeps its value (and its series) after its last observed pod went: an
/// hour, so that a namespace whose Jobs run hourly keeps its series, and `increase()` over a
/// dashboard's range sees counters that only move.
pub const QUIET: TimeDelta = TimeDelta::hours(1);

#[derive(Clone, Debug, Default)]
struct Slot {
    /// Observed pods that carry this value now.
    pods: usize,
    /// When the last of them went (while `pods` is 0).
    left: Option<DateTime<Utc>>,
}

/// The values handed out, with the pods that hold each.
#[derive(Debug)]
pub struct Namespaces {
    max: usize,
    /// Every pod gets the empty value (`--observe-namespace-label=false`).
    none: bool,
    slots: HashMap<String, Slot>,
}

impl Namespaces {
    /// `max`: how many namespaces may have a value of their own (0: all share [`OVERFLOW`]).
    pub fn new(max: usize, namespace_label: bool) -> Namespaces {
        Namespaces { max, none: !namespace_label, slots: HashMap::new() }
    }

    /// The value for a new pod of `namespace`; the pod holds it until [`Namespaces::release`].
    pub fn admit(&mut self, namespace: &str) -> String {
        let value = if self.none {
            String::new()
        } else if self.slots.contains_key(namespace) || self.own_values() < self.max {
            namespace.to_owned()
        } else {
            OVERFLOW.to_owned()
        };
        let slot = self.slots.entry(value.clone()).or_default();
        slot.pods += 1;
        slot.left = None;
        value
    }

    /// A pod that held `value` is no longer observed.
    pub fn release(&mut self, value: &str, now: DateTime<Utc>) {
        if let Some(slot) = self.slots.get_mut(value) {
            slot.pods = slot.pods.saturating_sub(1);
            if slot.pods == 0 {
                slot.left = Some(now);
            }
        }
    }

    /// The values no pod has held for [`QUIET`] by `now`: forgotten here, and the caller drops
    /// their series.
    pub fn sweep(&mut self, now: DateTime<Utc>) -> Vec<String> {
        let quiet: Vec<String> = self
            .slots
            .iter()
            .filter(|(_, s)| s.pods == 0 && s.left.is_some_and(|left| now - left >= QUIET))
            .map(|(v, _)| v.clone())
            .collect();
        for value in &quiet {
            self.slots.remove(value);
        }
        quiet
    }

    /// Values handed out now, [`OVERFLOW`] included.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    fn own_values(&self) -> usize {
        self.slots.keys().filter(|v| *v != OVERFLOW).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(minute: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(1_767_225_600 + minute * 60, 0).expect("time")
    }

    #[test]
    fn a_flood_of_namespaces_shares_the_overflow_value() {
        let mut n = Namespaces::new(3, true);
        let values: Vec<String> = (0..100).map(|i| n.admit(&format!("ci-{i}"))).collect();
        assert_eq!(values[..3], ["ci-0", "ci-1", "ci-2"]);
        assert!(values[3..].iter().all(|v| v == OVERFLOW), "{values:?}");
        assert_eq!(n.len(), 4, "three namespaces and the overflow");
        // A namespace that has a value keeps giving it to its new pods.
        assert_eq!(n.admit("ci-1"), "ci-1");
    }

    #[test]
    fn a_quiet_namespace_gives_its_value_back_and_a_busy_one_keeps_it() {
        let mut n = Namespaces::new(2, true);
        let (a, b) = (n.admit("a"), n.admit("b"));
        assert_eq!(n.admit("c"), OVERFLOW);
        n.release(&a, at(0));
        assert_eq!(n.sweep(at(59)), Vec::<String>::new(), "not quiet for an hour yet");
        // A pod of `a` comes back in time: the hour starts again when it goes.
        let a2 = n.admit("a");
        assert_eq!(a2, "a");
        assert_eq!(n.sweep(at(61)), Vec::<String>::new(), "a pod holds it");
        n.release(&a2, at(70));
        n.release(&b, at(70));
        n.release(OVERFLOW, at(70));
        let mut gone = n.sweep(at(130));
        gone.sort();
        assert_eq!(gone, ["_other", "a", "b"]);
        assert!(n.is_empty());
        // Their places are free again.
        assert_eq!((n.admit("c"), n.admit("d")), ("c".to_owned(), "d".to_owned()));
    }

    #[test]
    fn without_the_label_every_pod_shares_the_empty_value() {
        let mut n = Namespaces::new(0, false);
        assert_eq!(n.admit("a"), "");
        assert_eq!(n.admit("b"), "");
        assert_eq!(n.len(), 1);
        let mut capped = Namespaces::new(0, true);
        assert_eq!(capped.admit("a"), OVERFLOW, "a cap of 0: only the overflow value");
    }
}
