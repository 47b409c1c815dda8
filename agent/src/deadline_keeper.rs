//! The deadline keeper: releases every process in the pinned record of holds whose deadline has
//! passed, with nothing but bpffs, `/proc` and the cgroup tree. No API, no kernel programs, no
//! pod: it runs first thing at every agent start (before anything that can fail), then on a
//! thread of the agent for its whole life, and as `valet-deadlines`, the DaemonSet pod's second
//! container, which outlives agent crash loops (docs/dev/deadlines.md says why each).
//!
//! It reads this version's pin ([`valet_common::PIN_HELD`], deadlines in the record) and the previous one's
//! ([`PIN_HELD_V1`], no deadline: the record's time plus `--old-record-timeout`), in the pin
//! directory and in each old one (`--old-pin-dirs`).

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::time::Duration;

use aya::maps::{HashMap as BpfHashMap, Map, MapData};
use std::sync::Arc;
use tracing::{debug, error, info, warn};
use valet_common::{HeldRecord, HeldRecordV1, PIN_HELD_V1};

use crate::cgroup::CgroupFs;
use crate::cgroup::signal::{Placed, pin_in_cgroup_id};
use crate::host::clock::monotonic_ns;
use crate::kernel::held_ledger::{Forgot, HeldMap, forget_if};
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
    /// The pins to read ([`crate::kernel::held_ledger::pin_paths`]); a [`PIN_HELD_V1`] file name is read in
    /// that layout.
    pub pins: Vec<PathBuf>,
    pub host_proc: PathBuf,
    /// Hold timeout of records that carry no deadline ([`PIN_HELD_V1`]): `--old-record-timeout`,
    /// the same in the agent and in `valet-agent deadlines`.
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

/// One hold, as a record names it: the pid, and the cgroup and time of its stop. Two holds of
/// one pid differ in their stop time; the retry state is kept by hold, not by pid.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
struct HoldId {
    tgid: u32,
    cgroup_id: u64,
    ktime_ns: u64,
}

/// A record read from a pin of either format, with its deadline.
#[derive(Clone, Copy, Debug)]
struct Held {
    id: HoldId,
    deadline_ns: u64,
}

/// One pinned map of either format.
enum Pin {
    V2(Box<dyn HeldMap<HeldRecord>>),
    V1(Box<dyn HeldMap<HeldRecordV1>>),
}

impl Pin {
    /// Every record, an old one's deadline its stop plus `old_timeout_ns`.
    fn records(&self, old_timeout_ns: u64) -> Vec<Held> {
        match self {
            Pin::V2(m) => m
                .snapshot()
                .into_iter()
                .map(|(tgid, r)| Held {
                    id: HoldId { tgid, cgroup_id: r.cgroup_id, ktime_ns: r.ktime_ns },
                    deadline_ns: r.deadline_ns,
                })
                .collect(),
            Pin::V1(m) => m
                .snapshot()
                .into_iter()
                .map(|(tgid, r)| Held {
                    id: HoldId { tgid, cgroup_id: r.cgroup_id, ktime_ns: r.ktime_ns },
                    deadline_ns: r.ktime_ns.saturating_add(old_timeout_ns),
                })
                .collect(),
        }
    }

    /// Drops the record of `held` if the pid's record is still that one.
    fn forget(&mut self, held: &Held) -> Forgot {
        let HoldId { tgid, cgroup_id, ktime_ns } = held.id;
        match self {
            Pin::V2(m) => {
                forget_if(m.as_mut(), tgid, &HeldRecord { cgroup_id, ktime_ns, deadline_ns: held.deadline_ns })
            }
            Pin::V1(m) => forget_if(m.as_mut(), tgid, &HeldRecordV1 { cgroup_id, ktime_ns }),
        }
    }
}

/// Whether `e` (or an error it wraps) is the kernel's refusal of the call (EPERM, EACCES): no
/// capability for bpf(2), a seccomp profile or an LSM denying it. The caller cannot do better
/// by trying again.
fn refused(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut at = Some(e);
    while let Some(err) = at {
        if err.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::PermissionDenied) {
            return true;
        }
        at = err.source();
    }
    false
}

/// Opens the pinned map at `path` if there is one. `Ok(None)`: none there (or unreadable,
/// logged); `Err`: bpf(2) refused, and why.
fn open_pin(path: &Path, v1: bool) -> Result<Option<Pin>, String> {
    if !path.exists() {
        return Ok(None);
    }
    let data = match MapData::from_pin(path) {
        Ok(data) => data,
        Err(e) if refused(&e) => return Err(format!("{}: {e}", path.display())),
        Err(e) => {
            warn!(path = %path.display(), "cannot open the pinned record of held apps: {e}");
            return Ok(None);
        }
    };
    let map = Map::HashMap(data);
    let pin = if v1 {
        BpfHashMap::<MapData, u32, HeldRecordV1>::try_from(map).map(|m| Pin::V1(Box::new(m)))
    } else {
        BpfHashMap::<MapData, u32, HeldRecord>::try_from(map).map(|m| Pin::V2(Box::new(m)))
    };
    match pin {
        Ok(pin) => Ok(Some(pin)),
        Err(e) => {
            warn!(path = %path.display(), "the pinned record of held apps has another layout: {e}");
            Ok(None)
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
    /// Failures in a row and the time of the next try, by hold (a pid held again is tried at
    /// once, whatever its earlier hold's backoff).
    retry: HashMap<HoldId, (u32, u64)>,
    /// Most cgroup directories one record's search looks at.
    search_budget: usize,
    /// The agent's metrics: failed SIGCONTs and releases at the deadline are counted there.
    metrics: Option<Arc<Metrics>>,
    /// How long past a deadline to leave the release to the pod loops, now.
    defer: Box<dyn Fn() -> Duration + Send>,
    /// bpf(2) on a pin refused, and why (cleared when a pin opens).
    refused: Option<String>,
    /// Exit (status 1) once bpf(2) is refused ([`Keeper::exit_when_refused`]).
    exit_when_refused: bool,
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
        Keeper {
            settings,
            cgroups,
            pins: HashMap::new(),
            retry: HashMap::new(),
            search_budget: SEARCH_BUDGET,
            metrics,
            defer: Box::new(defer),
            refused: None,
            exit_when_refused: false,
        }
    }

    /// The deadline keeper's container: a keeper that cannot open the pinned record (bpf(2)
    /// refused: a seccomp profile that allows it only with CAP_SYS_ADMIN, a missing CAP_BPF, an
    /// LSM) would keep no deadline while looking alive. It exits instead, saying why, so that
    /// the kubelet restarts it and the pod is not ready (CrashLoopBackOff, the container's
    /// restarts counted by kube-state-metrics) and a rollout stops there.
    pub fn exit_when_refused(mut self) -> Keeper {
        self.exit_when_refused = true;
        self
    }

    /// Why bpf(2) on a pin was refused, if it was at the last try.
    pub fn refused(&self) -> Option<&str> {
        self.refused.as_deref()
    }

    fn give_up_if_refused(&self) {
        if let (true, Some(why)) = (self.exit_when_refused, &self.refused) {
            error!(
                "bpf(2) on the pinned record of held apps is refused ({why}): no deadline can be kept on this \
                 node; the container needs CAP_BPF and a seccomp profile that allows bpf(2) with it (the \
                 runtime's default profile of containerd >= 1.7 or CRI-O does). Exiting"
            );
            std::process::exit(1);
        }
    }

    fn open_pins(&mut self) {
        for path in &self.settings.pins {
            if !path.exists() {
                // Removed (an upgrade moved its records): let the map go.
                self.pins.remove(path);
                continue;
            }
            let v1 = path.file_name().is_some_and(|n| n == PIN_HELD_V1);
            if self.pins.contains_key(path) {
                continue;
            }
            match open_pin(path, v1) {
                Ok(Some(pin)) => {
                    self.refused = None;
                    self.pins.insert(path.clone(), pin);
                }
                Ok(None) => {}
                Err(why) => {
                    if self.refused.as_ref() != Some(&why) {
                        warn!("bpf(2) refused on the pinned record of held apps: {why}");
                    }
                    self.refused = Some(why);
                }
            }
        }
    }

    /// Releases every record past its deadline `now` (`CLOCK_MONOTONIC`). A record is dropped
    /// only once its process is released or proven gone, and only if the pid's record is still
    /// the one read ([`forget_if`]): a read error keeps it, and so does a newer hold of its pid.
    pub fn pass(&mut self, now: u64) -> Pass {
        self.open_pins();
        let old_ns = u64::try_from(self.settings.default_timeout.as_nanos()).unwrap_or(u64::MAX);
        let mut pass = Pass::default();
        let defer = u64::try_from((self.defer)().as_nanos()).unwrap_or(u64::MAX);
        let mut seen = HashSet::new();
        for (path, pin) in &mut self.pins {
            for held in pin.records(old_ns) {
                pass.records += 1;
                let id = held.id;
                seen.insert(id);
                if held.deadline_ns.saturating_add(defer) > now {
                    continue;
                }
                if self.retry.get(&id).is_some_and(|(_, at)| *at > now) {
                    continue;
                }
                let tgid = id.tgid;
                let placed =
                    pin_in_cgroup_id(&self.cgroups, &self.settings.host_proc, tgid, id.cgroup_id, self.search_budget);
                let failed = match placed {
                    Placed::In(pinned) => match pinned.signal(libc::SIGCONT) {
                        Ok(()) => {
                            pin.forget(&held);
                            pass.released += 1;
                            if let Some(m) = &self.metrics {
                                m.releases.get_or_create(&ReasonLabels { reason: "deadline" }).inc();
                            }
                            info!(
                                pid = tgid,
                                late_ms = now.saturating_sub(held.deadline_ns) / 1_000_000,
                                pin = %path.display(),
                                "released a held app at its deadline"
                            );
                            None
                        }
                        // Gone before its release: nothing failed, its record names no one.
                        Err(_) if pinned.exited() => gone(pin, &held, "it exited", &mut pass),
                        Err(e) => {
                            if let Some(m) = &self.metrics {
                                m.release_failures.inc();
                            }
                            Some(format!("SIGCONT at the deadline failed: {}", e.chain()))
                        }
                    },
                    Placed::Elsewhere(why) => gone(pin, &held, &why, &mut pass),
                    Placed::Unsure(why) => Some(format!("cannot place a held app past its deadline: {why}")),
                };
                match failed {
                    None => {
                        self.retry.remove(&id);
                    }
                    Some(why) => {
                        pass.failed += 1;
                        let tries = self.retry.get(&id).map_or(1, |(n, _)| n + 1);
                        self.retry.insert(id, (tries, now.saturating_add(backoff(tries))));
                        warn!(pid = tgid, tries, "{why} (kept, retried)");
                    }
                }
            }
        }
        // Holds no pin names any more (released by the agent, or by a pass) need no retry.
        self.retry.retain(|id, _| seen.contains(id));
        pass
    }

    /// Passes every [`KEEP_EVERY`] until `stop` says so (checked after each pass).
    pub fn run(mut self, stop: impl Fn() -> bool) {
        loop {
            let _ = self.pass(monotonic_ns());
            self.give_up_if_refused();
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
        self.give_up_if_refused();
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
        let old_ns = u64::try_from(self.settings.default_timeout.as_nanos()).unwrap_or(u64::MAX);
        let latest = self.pins.values().flat_map(|p| p.records(old_ns)).map(|h| h.deadline_ns).max().unwrap_or(0);
        let kept = std::mem::replace(&mut self.defer, Box::new(|| Duration::ZERO));
        self.retry.clear();
        let pass = self.pass(latest.max(monotonic_ns()));
        self.defer = kept;
        pass
    }
}

/// Drops the record of `held`, whose process is gone (`why`), unless its pid was held again
/// since it was read. `Some`: it could not be dropped (kept, retried).
fn gone(pin: &mut Pin, held: &Held, why: &str, pass: &mut Pass) -> Option<String> {
    let tgid = held.id.tgid;
    match pin.forget(held) {
        Forgot::Dropped | Forgot::Absent => {
            debug!(pid = tgid, "held record of a process that is gone ({why}): dropped");
            pass.dropped += 1;
            None
        }
        Forgot::Newer => {
            debug!(pid = tgid, "held record of a process that is gone ({why}); its pid is held again: kept");
            None
        }
        Forgot::Failed => Some(format!("cannot drop the held record of a process that is gone ({why})")),
    }
}

/// The wait before try `tries` + 1.
fn backoff(tries: u32) -> u64 {
    let d = RETRY_FIRST.saturating_mul(1u32 << tries.saturating_sub(1).min(8)).min(RETRY_MAX);
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;
    use std::sync::Mutex;

    use super::*;
    use crate::cgroup::tree::TempTree;
    use crate::host::proc::process_stopped;
    use crate::host::proc::tests::stopped_child;

    /// The record map the keeper reads, standing in for the pinned BPF map (the same lookup,
    /// delete and walk). `later`: a record the kernel writes after the pass's snapshot (the pid
    /// held again), there from the pass's first lookup or delete on.
    #[derive(Clone, Default)]
    struct Records {
        map: Arc<Mutex<BTreeMap<u32, HeldRecord>>>,
        later: Arc<Mutex<Option<(u32, HeldRecord)>>>,
        /// Lookups and deletes fail (as a bpf(2) call on the pin may), the walk still reads.
        broken: Arc<std::sync::atomic::AtomicBool>,
    }

    impl Records {
        fn put(&self, tgid: u32, r: HeldRecord) {
            self.map.lock().expect("records").insert(tgid, r);
        }

        fn get(&self, tgid: u32) -> Option<HeldRecord> {
            self.map.lock().expect("records").get(&tgid).copied()
        }

        fn kernel_writes(&self) {
            if let Some((tgid, r)) = self.later.lock().expect("later").take() {
                self.put(tgid, r);
            }
        }
    }

    impl HeldMap<HeldRecord> for Records {
        fn snapshot(&self) -> Vec<(u32, HeldRecord)> {
            self.map.lock().expect("records").iter().map(|(t, r)| (*t, *r)).collect()
        }

        fn lookup(&self, tgid: u32) -> Result<Option<HeldRecord>, String> {
            self.kernel_writes();
            if self.broken.load(std::sync::atomic::Ordering::Relaxed) {
                return Err("EIO".into());
            }
            Ok(self.get(tgid))
        }

        fn delete(&mut self, tgid: u32) -> Result<(), String> {
            self.kernel_writes();
            if self.broken.load(std::sync::atomic::Ordering::Relaxed) {
                return Err("EIO".into());
            }
            self.map.lock().expect("records").remove(&tgid);
            Ok(())
        }
    }

    /// A process stopped as a held app is, killed when the test ends.
    struct Stopped(std::process::Child);

    impl Stopped {
        fn new() -> Stopped {
            Stopped(stopped_child())
        }

        fn pid(&self) -> u32 {
            self.0.id()
        }

        fn stopped(&self) -> bool {
            process_stopped(Path::new("/proc"), self.pid())
        }
    }

    impl Drop for Stopped {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    const NOW: u64 = 1_000_000_000_000;

    /// A record of a hold in `cgroup_id` stopped at `ktime_ns`, due `timeout_ns` later.
    fn hold(cgroup_id: u64, ktime_ns: u64, timeout_ns: u64) -> HeldRecord {
        HeldRecord { cgroup_id, ktime_ns, deadline_ns: ktime_ns + timeout_ns }
    }

    /// A keeper of `records` over the cgroup tree `tree`, nothing deferred.
    fn keeper(tree: &TempTree, records: &Records) -> Keeper {
        let settings =
            KeeperSettings { pins: Vec::new(), host_proc: PathBuf::from("/proc"), default_timeout: Duration::ZERO };
        let mut keeper = Keeper::new(settings, CgroupFs::new(&tree.0), None, || Duration::ZERO);
        keeper.pins.insert(PathBuf::from("held_v2"), Pin::V2(Box::new(records.clone())));
        keeper
    }

    /// A container cgroup holding `pids`, and its id.
    fn container(tree: &TempTree, rel: &str, pids: &[u32]) -> u64 {
        tree.mkdir(rel);
        tree.procs(rel, pids);
        CgroupFs::new(&tree.0).id_of(rel).expect("id")
    }

    #[test]
    fn a_pass_releases_an_app_in_its_cgroup_and_drops_what_is_proven_elsewhere() {
        let tree = TempTree::new("keeper-pass");
        let (app, stranger, early) = (Stopped::new(), Stopped::new(), Stopped::new());
        let c = container(&tree, "/kubepods/pod1/app", &[app.pid(), early.pid()]);
        // A pid no process has: a child run to its end and reaped.
        let gone = std::process::Command::new("true").spawn().expect("spawn true");
        let gone_pid = gone.id();
        let _ = { gone }.wait();
        let records = Records::default();
        records.put(app.pid(), hold(c, 1, 10));
        // The stranger's pid was held in the app's cgroup once; it lives elsewhere now (a reused pid).
        records.put(stranger.pid(), hold(c, 2, 10));
        records.put(gone_pid, hold(c, 3, 10));
        records.put(early.pid(), hold(c, 4, NOW));
        let pass = keeper(&tree, &records).pass(NOW);
        let (app_stopped, stranger_stopped, early_stopped) = (app.stopped(), stranger.stopped(), early.stopped());
        assert!(!app_stopped, "the app in its cgroup past its deadline was not released");
        assert!(stranger_stopped, "a process outside the recorded cgroup was signalled");
        assert!(early_stopped, "an app was released before its deadline");
        assert_eq!(pass, Pass { records: 4, released: 1, dropped: 2, failed: 0 });
        assert_eq!(records.snapshot(), vec![(early.pid(), hold(c, 4, NOW))], "only the record not due is left");
    }

    #[test]
    fn a_membership_that_cannot_be_read_keeps_the_record_and_is_retried() {
        let tree = TempTree::new("keeper-read-error");
        let app = Stopped::new();
        let rel = "/kubepods/pod1/app";
        tree.mkdir(rel);
        let c = CgroupFs::new(&tree.0).id_of(rel).expect("id");
        // cgroup.procs that cannot be read (a directory: EISDIR, even for root).
        let procs = tree.0.join("kubepods/pod1/app/cgroup.procs");
        std::fs::create_dir(&procs).expect("mkdir cgroup.procs");
        let records = Records::default();
        records.put(app.pid(), hold(c, 1, 10));
        let mut keeper = keeper(&tree, &records);
        let first = keeper.pass(NOW);
        assert_eq!(first, Pass { records: 1, released: 0, dropped: 0, failed: 1 });
        assert!(records.get(app.pid()).is_some(), "a read error dropped the record");
        assert!(app.stopped());
        // Within the backoff: not tried again.
        assert_eq!(keeper.pass(NOW + 1), Pass { records: 1, ..Pass::default() });
        // Readable again, past the backoff: released.
        std::fs::remove_dir(&procs).expect("rmdir");
        tree.procs(rel, &[app.pid()]);
        let later = keeper.pass(NOW + backoff(1));
        assert_eq!(later, Pass { records: 1, released: 1, dropped: 0, failed: 0 });
        assert!(!app.stopped(), "not released once its cgroup could be read");
        assert!(records.get(app.pid()).is_none());
    }

    #[test]
    fn a_record_that_cannot_be_read_again_is_kept_and_retried() {
        let tree = TempTree::new("keeper-map-error");
        let c = container(&tree, "/kubepods/pod1/app", &[]);
        // Its process is gone (a pid no process has): proven, but the record cannot be read
        // again before the delete (the compare of compare-and-delete), so it is kept.
        let gone = std::process::Command::new("true").spawn().expect("spawn true");
        let gone_pid = gone.id();
        let _ = { gone }.wait();
        let records = Records::default();
        records.put(gone_pid, hold(c, 1, 10));
        records.broken.store(true, std::sync::atomic::Ordering::Relaxed);
        let mut keeper = keeper(&tree, &records);
        assert_eq!(keeper.pass(NOW), Pass { records: 1, released: 0, dropped: 0, failed: 1 });
        assert!(records.get(gone_pid).is_some(), "a record that could not be read again was deleted");
        // Within the backoff: not tried again; after it, with the map answering: dropped.
        assert_eq!(keeper.pass(NOW + 1), Pass { records: 1, ..Pass::default() });
        records.broken.store(false, std::sync::atomic::Ordering::Relaxed);
        assert_eq!(keeper.pass(NOW + backoff(1)), Pass { records: 1, dropped: 1, ..Pass::default() });
        assert!(records.get(gone_pid).is_none());
    }

    #[test]
    fn a_search_that_cannot_finish_keeps_the_record() {
        let tree = TempTree::new("keeper-unsure");
        let stray = Stopped::new();
        for i in 0..4 {
            tree.mkdir(&format!("/kubepods/pod{i}/c"));
        }
        let records = Records::default();
        // Its cgroup is gone, but a search within too small a budget cannot tell.
        records.put(stray.pid(), hold(u64::MAX, 1, 10));
        let mut keeper = keeper(&tree, &records);
        keeper.search_budget = 2;
        assert_eq!(keeper.pass(NOW), Pass { records: 1, released: 0, dropped: 0, failed: 1 });
        assert!(records.get(stray.pid()).is_some(), "a search that could not finish dropped the record");
        // With the budget to look everywhere, the cgroup is proven gone: dropped, never signalled.
        keeper.search_budget = SEARCH_BUDGET;
        assert_eq!(keeper.pass(NOW + RETRY_MAX.as_nanos() as u64), Pass { records: 1, dropped: 1, ..Pass::default() });
        assert!(records.get(stray.pid()).is_none());
        assert!(stray.stopped(), "a process outside the recorded cgroup was signalled");
    }

    #[test]
    fn a_pid_held_again_keeps_its_new_record_and_its_own_retry_state() {
        let tree = TempTree::new("keeper-reuse");
        let (reused, other) = (Stopped::new(), Stopped::new());
        let old = container(&tree, "/kubepods/pod1/app", &[]);
        let new = container(&tree, "/kubepods/pod2/app", &[reused.pid()]);
        let records = Records::default();
        // The pid's old hold, in a cgroup it no longer lives in; the kernel holds the pid again
        // (its new container's first exec) between the pass's snapshot and its delete.
        records.put(reused.pid(), hold(old, 1, 10));
        let newer = hold(new, 5, NOW);
        *records.later.lock().expect("later") = Some((reused.pid(), newer));
        let pass = keeper(&tree, &records).pass(NOW);
        assert_eq!(records.get(reused.pid()), Some(newer), "the newer hold's record was deleted: {pass:?}");
        assert!(reused.stopped(), "the newer hold was released before its deadline");
        // The retry state goes by hold: a hold that could not be placed (its cgroup unreadable)
        // backs off, and the pid's next hold is tried at once.
        let unreadable = "/kubepods/pod3/app";
        tree.mkdir(unreadable);
        std::fs::create_dir(tree.0.join("kubepods/pod3/app/cgroup.procs")).expect("mkdir cgroup.procs");
        let unreadable = CgroupFs::new(&tree.0).id_of(unreadable).expect("id");
        let records = Records::default();
        records.put(other.pid(), hold(unreadable, 1, 10));
        let mut keeper = keeper(&tree, &records);
        assert_eq!(keeper.pass(NOW).failed, 1);
        let next = container(&tree, "/kubepods/pod4/app", &[other.pid()]);
        records.put(other.pid(), hold(next, 7, 10));
        let pass = keeper.pass(NOW + 1);
        assert_eq!(pass.released, 1, "the pid's new hold waited for its old hold's backoff: {pass:?}");
        assert!(!other.stopped());
    }

    #[test]
    fn a_refusal_is_told_from_other_errors_through_their_sources() {
        #[derive(Debug)]
        struct Wrapped(std::io::Error);
        impl std::fmt::Display for Wrapped {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                write!(f, "bpf_obj_get failed")
            }
        }
        impl std::error::Error for Wrapped {
            fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
                Some(&self.0)
            }
        }
        for errno in [nix::libc::EPERM, nix::libc::EACCES] {
            assert!(refused(&Wrapped(std::io::Error::from_raw_os_error(errno))), "{errno}");
        }
        for errno in [nix::libc::ENOENT, nix::libc::EINVAL, nix::libc::EMFILE] {
            assert!(!refused(&Wrapped(std::io::Error::from_raw_os_error(errno))), "{errno}");
        }
    }

    #[test]
    fn backoff_doubles_up_to_its_cap() {
        assert_eq!(backoff(1), 250_000_000);
        assert_eq!(backoff(2), 500_000_000);
        assert_eq!(backoff(3), 1_000_000_000);
        assert_eq!(backoff(20), 5_000_000_000);
    }
}
