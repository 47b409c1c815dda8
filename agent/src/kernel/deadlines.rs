//! The deadline keeper: releases every process in the pinned record of holds whose deadline has
//! passed, with nothing but bpffs, `/proc` and the cgroup tree. No API, no kernel programs, no
//! pod: it runs first thing at every agent start (before anything that can fail), then on a
//! thread of the agent for its whole life, and as `valet-deadlines`, the DaemonSet pod's second
//! container, which outlives agent crash loops (docs/deadlines.md says why each).
//!
//! It reads this version's pin ([`valet_common::PIN_HELD`], deadlines in the record) and the previous one's
//! ([`PIN_HELD_V1`], no deadline: the record's time plus the default hold timeout), in the pin
//! directory and in each old one (`--old-pin-dir`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use aya::maps::{HashMap as BpfHashMap, Map, MapData};
use std::sync::Arc;
use tracing::{debug, info, warn};
use valet_common::{HeldRecord, HeldRecordV1, PIN_HELD_V1};

use crate::cgroup::CgroupFs;
use crate::cgroup::signal::{Placed, pin_in_cgroup_id};
use crate::host::clock::monotonic_ns;
use crate::metrics::{Metrics, ReasonLabels};

/// How long past a deadline the pod loops of a running agent have to release an app
/// themselves (with its condition, Event and counts) before a keeper does: the keeper is the
/// net, not the first hand. Within the 2 s a held app may outlive its deadline.
pub const DEFER: Duration = Duration::from_secs(1);

/// How often the keeper looks at the records.
pub const KEEP_EVERY: Duration = Duration::from_millis(250);
/// Most cgroup directories one record's search looks at (a node's tree is a few thousand).
const SEARCH_BUDGET: usize = 50_000;
/// Backoff of a failed SIGCONT (or of a search that could not finish): doubled per failure.
const RETRY_FIRST: Duration = Duration::from_millis(250);
const RETRY_MAX: Duration = Duration::from_secs(5);

/// Where to look and what an old record's deadline is.
#[derive(Clone, Debug)]
pub struct KeeperSettings {
    /// The pins to read ([`super::held_ledger::pin_paths`]); a [`PIN_HELD_V1`] file name is read in
    /// that layout.
    pub pins: Vec<PathBuf>,
    pub host_proc: PathBuf,
    /// Hold timeout of records that carry no deadline ([`PIN_HELD_V1`]).
    pub default_timeout: Duration,
}

/// What one pass did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Pass {
    /// Records read (both formats).
    pub records: usize,
    /// Past their deadline and released now.
    pub released: usize,
    /// Dropped: the process is gone or another one has its pid.
    pub dropped: usize,
    /// SIGCONTs that failed, or processes that could not be placed: kept, retried.
    pub failed: usize,
}

/// One pinned map of either format.
enum Pin {
    V2(BpfHashMap<MapData, u32, HeldRecord>),
    V1(BpfHashMap<MapData, u32, HeldRecordV1>),
}

impl Pin {
    fn records(&self, default_timeout_ns: u64) -> Vec<(u32, u64, u64)> {
        match self {
            Pin::V2(m) => m.iter().filter_map(Result::ok).map(|(t, r)| (t, r.cgroup_id, r.deadline_ns)).collect(),
            Pin::V1(m) => m
                .iter()
                .filter_map(Result::ok)
                .map(|(t, r)| (t, r.cgroup_id, r.ktime_ns.saturating_add(default_timeout_ns)))
                .collect(),
        }
    }

    fn forget(&mut self, tgid: u32) {
        let _ = match self {
            Pin::V2(m) => m.remove(&tgid),
            Pin::V1(m) => m.remove(&tgid),
        };
    }
}

/// Opens the pinned map at `path` if there is one. `None`: none there (or unreadable, logged).
fn open_pin(path: &Path, v1: bool) -> Option<Pin> {
    if !path.exists() {
        return None;
    }
    let data = match MapData::from_pin(path) {
        Ok(data) => data,
        Err(e) => {
            warn!(path = %path.display(), "cannot open the pinned record of held apps: {e}");
            return None;
        }
    };
    let map = Map::HashMap(data);
    let pin = if v1 { BpfHashMap::try_from(map).map(Pin::V1) } else { BpfHashMap::try_from(map).map(Pin::V2) };
    match pin {
        Ok(pin) => Some(pin),
        Err(e) => {
            warn!(path = %path.display(), "the pinned record of held apps has another layout: {e}");
            None
        }
    }
}

/// Releases the records past their deadline, pass after pass.
pub struct Keeper {
    settings: KeeperSettings,
    cgroups: CgroupFs,
    /// Open pins by path (opened again when they appear: a first agent makes its pin after the
    /// keeper's first pass).
    pins: HashMap<PathBuf, Pin>,
    /// Failures in a row and the time of the next try, by pid.
    retry: HashMap<u32, (u32, u64)>,
    /// The agent's metrics: failed SIGCONTs and releases at the deadline are counted there.
    metrics: Option<Arc<Metrics>>,
    /// How long past a deadline to leave the release to the pod loops, now.
    defer: Box<dyn Fn() -> Duration + Send>,
}

impl Keeper {
    /// `defer` says, at each pass, how long past a deadline the pod loops are left to release
    /// first ([`DEFER`] where they run, 0 where none does).
    pub fn new(
        settings: KeeperSettings,
        cgroups: CgroupFs,
        metrics: Option<Arc<Metrics>>,
        defer: impl Fn() -> Duration + Send + 'static,
    ) -> Keeper {
        Keeper { settings, cgroups, pins: HashMap::new(), retry: HashMap::new(), metrics, defer: Box::new(defer) }
    }

    fn open_pins(&mut self) {
        for path in &self.settings.pins {
            if !path.exists() {
                // Removed (an upgrade moved its records): let the map go.
                self.pins.remove(path);
                continue;
            }
            let v1 = path.file_name().is_some_and(|n| n == PIN_HELD_V1);
            if !self.pins.contains_key(path)
                && let Some(pin) = open_pin(path, v1)
            {
                self.pins.insert(path.clone(), pin);
            }
        }
    }

    /// Releases every record past its deadline `now` (`CLOCK_MONOTONIC`).
    pub fn pass(&mut self, now: u64) -> Pass {
        self.open_pins();
        let default_ns = u64::try_from(self.settings.default_timeout.as_nanos()).unwrap_or(u64::MAX);
        let mut pass = Pass::default();
        let defer = u64::try_from((self.defer)().as_nanos()).unwrap_or(u64::MAX);
        for (path, pin) in &mut self.pins {
            for (tgid, cgroup_id, deadline) in pin.records(default_ns) {
                pass.records += 1;
                if deadline.saturating_add(defer) > now {
                    continue;
                }
                if self.retry.get(&tgid).is_some_and(|(_, at)| *at > now) {
                    continue;
                }
                match pin_in_cgroup_id(&self.cgroups, &self.settings.host_proc, tgid, cgroup_id, SEARCH_BUDGET) {
                    Placed::In(pinned) => match pinned.signal(libc::SIGCONT) {
                        Ok(()) => {
                            pin.forget(tgid);
                            self.retry.remove(&tgid);
                            pass.released += 1;
                            if let Some(m) = &self.metrics {
                                m.releases.get_or_create(&ReasonLabels { reason: "deadline" }).inc();
                            }
                            info!(
                                pid = tgid,
                                late_ms = now.saturating_sub(deadline) / 1_000_000,
                                pin = %path.display(),
                                "released a held app at its deadline"
                            );
                        }
                        Err(e) => {
                            if let Some(m) = &self.metrics {
                                m.release_failures.inc();
                            }
                            pass.failed += 1;
                            let tries = self.retry.get(&tgid).map_or(1, |(n, _)| n + 1);
                            self.retry.insert(tgid, (tries, now.saturating_add(backoff(tries))));
                            warn!(pid = tgid, tries, "SIGCONT at the deadline failed (retried): {}", e.chain());
                        }
                    },
                    Placed::Elsewhere => {
                        debug!(pid = tgid, "held record of a process that is gone: dropped");
                        pin.forget(tgid);
                        self.retry.remove(&tgid);
                        pass.dropped += 1;
                    }
                    Placed::Unsure(why) => {
                        pass.failed += 1;
                        let tries = self.retry.get(&tgid).map_or(1, |(n, _)| n + 1);
                        self.retry.insert(tgid, (tries, now.saturating_add(backoff(tries))));
                        warn!(pid = tgid, tries, "cannot place a held app past its deadline (kept, retried): {why}");
                    }
                }
            }
        }
        pass
    }

    /// Passes every [`KEEP_EVERY`] until `stop` says so (checked after each pass).
    pub fn run(mut self, stop: impl Fn() -> bool) {
        loop {
            let _ = self.pass(monotonic_ns());
            if stop() {
                return;
            }
            std::thread::sleep(KEEP_EVERY);
        }
    }

    /// One pass now (no deferral: nothing else can release yet), then a thread that keeps
    /// passing for the process's life. The first pass is done before this returns: an agent
    /// start releases what is past its deadline before it does anything that can fail or wait.
    pub fn start(mut self) -> Pass {
        let first = self.pass_now(0);
        if first.records > 0 {
            info!(
                records = first.records,
                released = first.released,
                dropped = first.dropped,
                failed = first.failed,
                "held records at start (those past their deadline released before anything else)"
            );
        }
        if let Err(e) = std::thread::Builder::new().name("valet-deadlines".into()).spawn(move || self.run(|| false)) {
            warn!("no deadline thread (held apps are released at their deadline by the pod loops only): {e}");
        }
        first
    }

    /// A pass with `defer` in place of the one configured (0 at start, `u64::MAX` now: every
    /// record, at shutdown).
    pub fn pass_now(&mut self, defer_ns: u64) -> Pass {
        let kept = std::mem::replace(&mut self.defer, Box::new(move || Duration::from_nanos(defer_ns)));
        let pass = self.pass(monotonic_ns());
        self.defer = kept;
        pass
    }

    /// Releases every record, whatever its deadline (the pod is being deleted).
    pub fn release_all(&mut self) -> Pass {
        self.open_pins();
        let default_ns = u64::try_from(self.settings.default_timeout.as_nanos()).unwrap_or(u64::MAX);
        let latest =
            self.pins.values().flat_map(|p| p.records(default_ns)).map(|(_, _, deadline)| deadline).max().unwrap_or(0);
        let kept = std::mem::replace(&mut self.defer, Box::new(|| Duration::ZERO));
        self.retry.clear();
        let pass = self.pass(latest.max(monotonic_ns()));
        self.defer = kept;
        pass
    }
}

/// The wait before try `tries` + 1.
fn backoff(tries: u32) -> u64 {
    let d = RETRY_FIRST.saturating_mul(1u32 << tries.saturating_sub(1).min(8)).min(RETRY_MAX);
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_up_to_its_cap() {
        assert_eq!(backoff(1), 250_000_000);
        assert_eq!(backoff(2), 500_000_000);
        assert_eq!(backoff(3), 1_000_000_000);
        assert_eq!(backoff(20), 5_000_000_000);
    }
}
