//! The pods whose sidecars valet ended (it sent them a quit or a quitting signal), for observe
//! mode's sidecar tax (its `acted` label): the actuators record, the observer asks and forgets.
//! One `EndedByValet` is made in `main` and handed to both; it imports nothing of the crate, so
//! neither side imports the other.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, PoisonError};

/// Nothing is kept until an observer starts (no one would forget it).
#[derive(Debug, Default)]
pub struct EndedByValet {
    on: AtomicBool,
    uids: Mutex<HashSet<String>>,
}

impl EndedByValet {
    /// valet asked one of this pod's sidecars to quit, or signalled it.
    pub fn record(&self, uid: &str) {
        if self.on.load(Ordering::Relaxed) {
            self.uids.lock().unwrap_or_else(PoisonError::into_inner).insert(uid.to_owned());
        }
    }

    /// An observer runs: record from now on.
    pub(crate) fn start(&self) {
        self.on.store(true, Ordering::Relaxed);
    }

    pub(crate) fn contains(&self, uid: &str) -> bool {
        self.uids.lock().unwrap_or_else(PoisonError::into_inner).contains(uid)
    }

    pub(crate) fn forget(&self, uid: &str) {
        self.uids.lock().unwrap_or_else(PoisonError::into_inner).remove(uid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kept_only_while_an_observer_runs_and_until_forgotten() {
        let q = EndedByValet::default();
        q.record("a");
        assert!(!q.contains("a"), "no observer: nothing kept");
        q.start();
        q.record("a");
        assert!(q.contains("a"));
        q.forget("a");
        assert!(!q.contains("a"));
    }
}
