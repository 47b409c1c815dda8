//! Releasing held apps: the kernel's record of what it stopped, the processes found held in a
//! pod (an earlier agent's holds included), the orphans no pod holds any more, and the signals
//! themselves, sent back to back from a thread of their own.

use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::{debug, info, warn};
use valet_common::HeldRecord;

use crate::cgroup::signal::{
    Pinned, Placed, pin_in_cgroup, pin_in_cgroup_id, pin_pid, pin_pid_placed, place_in_cgroup, place_pinned,
};
use crate::cgroup::{CgroupFs, Search};
use crate::effect::{LeftHeld, Nanos};
use crate::host::proc::{nspid, process_stopped, stopped};
use crate::kernel::held_ledger::HeldLedger;
use crate::metrics::{Metrics, ReasonLabels};
use crate::sidecar::Pending;

/// At most this many held processes are pinned ahead (one fd each); more are pinned at release.
const PINNED_MAX: usize = 1024;

/// A release to carry out.
struct Release {
    tgid: u32,
    container_rel: String,
    reason: &'static str,
    held_ns: u64,
}

type PinnedRelease = (Release, Placed);

/// What a batch of reports decided: its releases, and the tasks of the same decisions (API
/// writes of the pods' condition), held back until the releases are out so that they do not
/// take the CPUs from them.
#[derive(Default)]
struct Batch {
    releases: Vec<Release>,
    tasks: Vec<Pending<()>>,
    /// Its releases go out as they are decided, [`RELEASE_CHUNK`] at a time (see
    /// [`Releases::send_decided`]).
    chunked: bool,
}

/// A batch's releases go out this many at a time while the rest of it is decided, when the
/// caller runs in the real-time class: a 110-pod round's decisions took the loop 1.0-2.7 ms, and
/// the first apps of the round waited for the last decision.
const RELEASE_CHUNK: usize = 16;

/// Starts `task` now, or once the releases of the batch kept are out.
fn spawn_after_releases(batch: &mut Option<Batch>, task: Pending<()>) {
    match batch {
        Some(batch) => batch.tasks.push(task),
        None => {
            tokio::spawn(task);
        }
    }
}

/// A record of a process that is not stopped is dropped only once it is this old: the exec
/// program writes it just before the stop takes effect.
const ORPHAN_RECORD_GRACE_NS: u64 = 2_000_000_000;
/// Most cgroup directories looked at to find the one a held process was stopped in (a node's
/// whole tree is a few thousand at most).
const CGROUP_SEARCH_BUDGET: usize = 50_000;

/// How often, and after how long at first, a failed SIGCONT is tried again (the wait doubles).
const RETRY_FIRST: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(5);

/// What came of one release.
enum Sent {
    Released,
    /// The app is gone (exited, killed, or its pid another process's): nothing to release.
    Gone(String),
    /// A real failure, with the pidfd when the process is still there (to retry).
    Failed(String, Option<Pinned>),
    /// Its cgroup could not be read (a read error): not signalled, the process pinned to place
    /// it again later.
    Unplaced(String, Pinned),
}

/// A SIGCONT that failed, or a release whose process could not be placed, to try again at `at`.
struct Retry {
    release: Release,
    pinned: Pinned,
    /// Whether the pinned process was found in the release's cgroup (else it is placed first).
    placed: bool,
    tries: u32,
    at: Instant,
}

/// Sends the SIGCONTs of a batch of releases, back to back, then counts and logs them. The
/// ones that failed come back, to be tried again after a backoff: their records stay (a
/// successor, or the deadline keeper, finds them), and nothing takes them for released.
fn send_releases(metrics: &Metrics, ledger: Option<&HeldLedger>, batch: Vec<PinnedRelease>) -> Vec<Retry> {
    account_releases(metrics, ledger, signal_releases(batch))
}

/// The SIGCONTs of a batch, back to back; what became of each.
fn signal_releases(batch: Vec<PinnedRelease>) -> Vec<(Release, Sent)> {
    batch
        .into_iter()
        .map(|(r, placed)| {
            let sent = match placed {
                Placed::In(pinned) => match pinned.signal(libc::SIGCONT) {
                    Ok(()) => Sent::Released,
                    Err(e) if pinned.exited() => Sent::Gone(format!("{}: the process exited", e.chain())),
                    Err(e) => Sent::Failed(e.chain().to_string(), Some(pinned)),
                },
                Placed::Elsewhere(why) => Sent::Gone(why),
                // Placed again later: the cgroup may turn readable (an app whose release was
                // decided is not released by the sweep, which leaves a holding pod's apps to it).
                Placed::Unsure(why) if !r.container_rel.is_empty() => match pin_pid_placed(r.tgid) {
                    Ok(pinned) => Sent::Unplaced(why, pinned),
                    Err(Placed::Elsewhere(gone)) => Sent::Gone(gone),
                    Err(_) => Sent::Failed(why, None),
                },
                Placed::Unsure(why) => Sent::Failed(why, None),
            };
            (r, sent)
        })
        .collect()
}

/// Counts and logs what [`signal_releases`] did, and drops the records of the processes
/// released; the ones that failed come back as retries.
fn account_releases(metrics: &Metrics, ledger: Option<&HeldLedger>, sent: Vec<(Release, Sent)>) -> Vec<Retry> {
    let mut retries = Vec::new();
    for (release, sent) in sent {
        let Release { tgid, reason, held_ns, .. } = release;
        match sent {
            Sent::Released => {
                // Only once the signal is out: an agent that dies before leaves the record to
                // its successor.
                if let Some(ledger) = ledger {
                    ledger.forget_released(tgid);
                }
                let held_for = held_ns as f64 / 1e9;
                // How long apps waited: the sandbox, sidecars and strays run again at once.
                if !matches!(reason, "not_app" | "untracked") {
                    metrics.hold_duration.observe(held_for);
                }
                metrics.releases.get_or_create(&ReasonLabels { reason }).inc();
                info!(pid = tgid, reason, held_ms = held_for * 1e3, "released app");
            }
            Sent::Failed(e, Some(pinned)) => {
                metrics.release_failures.inc();
                warn!(pid = tgid, reason, "SIGCONT failed (tried again after a backoff; its record is kept): {e}");
                retries.push(Retry { release, pinned, placed: true, tries: 1, at: Instant::now() + RETRY_FIRST });
            }
            Sent::Unplaced(e, pinned) => {
                metrics.release_failures.inc();
                warn!(
                    pid = tgid,
                    reason, "release not sent, its cgroup cannot be read (tried again; its record is kept): {e}"
                );
                retries.push(Retry { release, pinned, placed: false, tries: 1, at: Instant::now() + RETRY_FIRST });
            }
            Sent::Failed(e, None) => {
                // Not signalled and nothing to retry through: it could not be placed (a read
                // error). Its record stays for the sweep and the deadline keeper.
                metrics.release_failures.inc();
                warn!(pid = tgid, reason, "release failed (its record is kept): {e}");
            }
            Sent::Gone(why) => {
                // Exited or killed while held, or its pid is another process's by now: nothing
                // to release. Its record stays for the sweep and the deadline keeper, which drop
                // it once they can tell it names no one.
                metrics.gone_before_release.inc();
                info!(pid = tgid, reason, "held app gone before its release: {why}");
            }
        }
    }
    retries
}

/// Places a retry's process that could not be placed before: `Err` when it is gone or elsewhere
/// (nothing to release), or still cannot be placed (tried again later).
fn place_retry(cgroups: &CgroupFs, mut r: Retry, now: Instant) -> Result<Retry, Option<Retry>> {
    if r.placed {
        return Ok(r);
    }
    let Retry { release, pinned, tries, .. } = r;
    if pinned.exited() {
        info!(pid = release.tgid, "held app gone before its cgroup could be read");
        return Err(None);
    }
    match place_pinned(cgroups, pinned, &release.container_rel) {
        Placed::In(pinned) => Ok(Retry { release, pinned, placed: true, tries, at: now }),
        Placed::Elsewhere(why) => {
            info!(pid = release.tgid, "held app gone before its release: {why}");
            Err(None)
        }
        Placed::Unsure(why) => {
            // Pinned again: the pidfd went into the attempt.
            let Ok(pinned) = pin_pid(release.tgid) else { return Err(None) };
            r = Retry { release, pinned, placed: false, tries: tries + 1, at: now + backoff(tries + 1) };
            debug!(pid = r.release.tgid, tries = r.tries, "the held app's cgroup still cannot be read: {why}");
            Err(Some(r))
        }
    }
}

/// The wait before try `tries + 1`.
fn backoff(tries: u32) -> Duration {
    RETRY_FIRST.saturating_mul(1 << tries.min(8)).min(RETRY_MAX)
}

/// Tries the due retries again; returns those still failing.
fn retry_releases(
    cgroups: &CgroupFs,
    metrics: &Metrics,
    ledger: Option<&HeldLedger>,
    retries: Vec<Retry>,
) -> Vec<Retry> {
    let now = Instant::now();
    let (due, mut waiting): (Vec<Retry>, Vec<Retry>) = retries.into_iter().partition(|r| r.at <= now);
    for r in due {
        let mut r = match place_retry(cgroups, r, now) {
            Ok(r) => r,
            Err(again) => {
                waiting.extend(again);
                continue;
            }
        };
        match r.pinned.signal(libc::SIGCONT) {
            Ok(()) => {
                if let Some(ledger) = ledger {
                    ledger.forget_released(r.release.tgid);
                }
                metrics.releases.get_or_create(&ReasonLabels { reason: r.release.reason }).inc();
                info!(pid = r.release.tgid, reason = r.release.reason, tries = r.tries + 1, "released app");
            }
            Err(_) if r.pinned.exited() => {
                metrics.gone_before_release.inc();
                info!(pid = r.release.tgid, "held app gone before its release went through");
            }
            Err(e) => {
                metrics.release_failures.inc();
                r.tries += 1;
                let wait = backoff(r.tries);
                warn!(pid = r.release.tgid, tries = r.tries, "SIGCONT failed again: {}", e.chain());
                r.at = now + wait;
                waiting.push(r);
            }
        }
    }
    waiting
}

/// A thread of its own for the signals of a batch of releases. It wakes for the batch, with
/// its scheduler slice ahead of it, so the apps it signals do not take its CPU before the last
/// signal (a runtime thread busy with the slot's probes and decisions was preempted by the
/// first apps it released, and the rest of the batch waited milliseconds for its CPU). It also
/// tries failed SIGCONTs again, with backoff.
struct Releaser {
    tx: std::sync::mpsc::Sender<Vec<PinnedRelease>>,
    thread: std::thread::JoinHandle<()>,
}

impl Releaser {
    /// `priority`: the thread's SCHED_FIFO priority (0: the normal class).
    fn start(
        cgroups: CgroupFs,
        metrics: Arc<Metrics>,
        ledger: Option<Arc<HeldLedger>>,
        priority: u8,
    ) -> Option<Releaser> {
        let (tx, rx) = std::sync::mpsc::channel::<Vec<PinnedRelease>>();
        let thread = std::thread::Builder::new()
            .name("valet-release".into())
            .spawn(move || {
                // An app it wakes no longer takes its CPU before the rest of the batch is out.
                crate::host::sys::enter_real_time("the release thread", priority);
                let mut retries: Vec<Retry> = Vec::new();
                loop {
                    let batch = match retries.iter().map(|r| r.at).min() {
                        None => match rx.recv() {
                            Ok(batch) => Some(batch),
                            Err(_) => break,
                        },
                        Some(at) => match rx.recv_timeout(at.saturating_duration_since(Instant::now())) {
                            Ok(batch) => Some(batch),
                            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => None,
                            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
                        },
                    };
                    if let Some(batch) = batch {
                        // The batches the loop handed over meanwhile are signalled before any
                        // is counted and logged (a record dropped, a line written: tens of µs
                        // each, which the next batch's apps would wait for).
                        let mut sent = signal_releases(batch);
                        while let Ok(more) = rx.try_recv() {
                            sent.extend(signal_releases(more));
                        }
                        retries.extend(account_releases(&metrics, ledger.as_deref(), sent));
                    }
                    retries = retry_releases(&cgroups, &metrics, ledger.as_deref(), retries);
                }
                // The agent stops: one last try each (placed first); a record left is its
                // successor's.
                let now = Instant::now();
                for r in retries.into_iter().filter_map(|r| place_retry(&cgroups, r, now).ok()) {
                    let _ = r.pinned.signal(libc::SIGCONT);
                }
            })
            .map_err(|e| warn!("no release thread, releases go out from the runtime: {e}"))
            .ok()?;
        Some(Releaser { tx, thread })
    }

    /// Hands `batch` to the thread; if it is gone, gives it back.
    fn send(&self, batch: Vec<PinnedRelease>) -> Result<(), Vec<PinnedRelease>> {
        self.tx.send(batch).map_err(|std::sync::mpsc::SendError(batch)| batch)
    }

    /// Returns once every batch handed over is sent.
    fn finish(self) {
        drop(self.tx);
        let _ = self.thread.join();
    }
}

/// The holds and releases of apps (effects `Pin`, `Release`, `FindLeftHeld`): the kernel's
/// record of what it stopped, the processes pinned when they were held, and the release thread.
pub struct Releases {
    cgroups: CgroupFs,
    host_proc: PathBuf,
    metrics: Arc<Metrics>,
    /// The kernel's record of the processes it stopped (pinned: it outlives this agent).
    ledger: Option<Arc<HeldLedger>>,
    releaser: Option<Releaser>,
    /// Held processes checked and pinned when they were held, by pid: a release is only the
    /// signal (checking a batch of them at release took half a millisecond).
    pinned: HashMap<u32, Pinned>,
    /// Releases kept for [`Releases::flush`] while a batch of reports is handled.
    batch: Option<Batch>,
}

impl Releases {
    /// `ledger`: the kernel's record of held processes, where there is one.
    pub fn new(
        cgroups: CgroupFs,
        host_proc: PathBuf,
        metrics: Arc<Metrics>,
        ledger: Option<Arc<HeldLedger>>,
        priority: u8,
    ) -> Releases {
        Releases {
            releaser: Releaser::start(cgroups.clone(), metrics.clone(), ledger.clone(), priority),
            cgroups,
            host_proc,
            metrics,
            ledger,
            pinned: HashMap::new(),
            batch: None,
        }
    }

    /// Pins held process `tgid` of container cgroup `container_rel` ahead of its release (effect
    /// `Pin`).
    pub fn pin(&mut self, uid: &str, tgid: u32, container_rel: &str) {
        // Whatever was pinned under this pid before is another process.
        self.pinned.remove(&tgid);
        if self.pinned.len() < PINNED_MAX {
            match pin_in_cgroup(&self.cgroups, tgid, container_rel) {
                Ok(pinned) => {
                    self.pinned.insert(tgid, pinned);
                }
                Err(e) => debug!(%uid, "pin held process: {} (checked again at release)", e.chain()),
            }
        }
    }

    /// Releases held process `tgid` of container cgroup `container_rel` (effect `Release`), held
    /// `held_ns`: at once, or with the batch kept.
    pub fn release_one(&mut self, tgid: u32, container_rel: String, reason: &'static str, held_ns: u64) {
        let release = Release { tgid, container_rel, reason, held_ns };
        match &mut self.batch {
            Some(batch) => batch.releases.push(release),
            None => self.release(vec![release], false),
        }
    }

    /// Starts `task` now, or once the releases of the batch kept are out.
    pub fn after_releases(&mut self, task: Pending<()>) {
        spawn_after_releases(&mut self.batch, task);
    }

    /// Keeps the releases of the effects applied from now on, until [`Releases::flush`] (a
    /// batch of probe answers: their apps go on together).
    pub fn keep_batch(&mut self) {
        if self.batch.is_none() {
            // In the normal class, the apps a chunk wakes would take the caller's CPU from the
            // rest of the batch's decisions: they go out together then.
            let chunked = self.releaser.is_some() && crate::host::sys::in_real_time();
            self.batch = Some(Batch { chunked, ..Batch::default() });
        }
    }

    /// Sends the releases of the batch kept decided so far, if it goes out in chunks and a
    /// chunk's worth is there (its other tasks still wait for [`Releases::flush`]). The apps
    /// they wake take the other CPUs, not the caller's: it is in the real-time class.
    pub fn send_decided(&mut self) {
        let Some(batch) = &mut self.batch else { return };
        if batch.chunked && batch.releases.len() >= RELEASE_CHUNK {
            let releases = std::mem::take(&mut batch.releases);
            self.release(releases, true);
        }
    }

    /// Carries out the releases kept since [`Releases::keep_batch`]: every process is pinned
    /// first (when it was held, or checked and pinned now), then all are signalled back to back,
    /// and only then the batch's other tasks start. A signalled app takes a CPU at once; work
    /// between the signals gave it the time to push the rest back.
    pub fn flush(&mut self) {
        if let Some(Batch { releases, tasks, .. }) = self.batch.take() {
            self.release(releases, true);
            for task in tasks {
                tokio::spawn(task);
            }
        }
    }

    /// Returns once every release handed to the release thread is sent (before the agent
    /// exits: no app is left stopped). Releases after this go out from the caller.
    pub fn finish(&mut self) {
        self.flush();
        if let Some(releaser) = self.releaser.take() {
            releaser.finish();
        }
    }

    /// Processes stopped at exec in the pod's containers: those the kernel's record names (any
    /// process: a shareProcessNamespace app is not its namespace's init), and stopped
    /// namespace inits (held by an agent without a pinned record). Effect `FindLeftHeld`. The
    /// bool: whether every container's processes could be read (a cgroup that cannot be read is
    /// not an empty one: what is held there is found by a later search).
    pub fn left_held(&self, pod_rel: &str, now: Nanos) -> (Vec<LeftHeld>, bool) {
        let proc = &self.host_proc;
        let records = self.ledger.as_ref().map(|l| l.records()).unwrap_or_default();
        let mut found = Vec::new();
        let mut complete = true;
        for c in self.cgroups.containers(pod_rel) {
            let procs = match self.cgroups.procs_recursive_proven(&c.rel) {
                Ok(procs) => procs,
                Err(e) => {
                    warn!(cgroup = %c.rel, "cannot read a container's processes: what an earlier agent held there is looked for again later: {e}");
                    complete = false;
                    continue;
                }
            };
            for (tgid, since) in stopped_among(proc, &records, &procs) {
                found.push(LeftHeld { tgid, container_cgroup: c.id, since });
            }
            for pid in procs {
                if held_at_exec(proc, pid) && !found.iter().any(|f| f.tgid == pid) {
                    found.push(LeftHeld { tgid: pid, container_cgroup: c.id, since: stopped_since(proc, pid, now) });
                }
            }
        }
        (found, complete)
    }

    /// Whether a process in container cgroup `rel` (or below it) is stopped and the kernel's
    /// record says it stopped it.
    pub fn holds_recorded(&self, rel: &str) -> bool {
        let records = self.ledger.as_ref().map(|l| l.records()).unwrap_or_default();
        if records.is_empty() {
            return false;
        }
        let procs = self.cgroups.procs_recursive(rel);
        stopped_among(&self.host_proc, &records, &procs).next().is_some()
    }

    /// Releases the processes the kernel's record names that no tracked pod will: their pod was
    /// deleted, relabelled, stripped of its hold or is done, or they were left by an agent that
    /// died while holding them. Records of processes gone, or running again for a while, are
    /// dropped. `held`: the pids tracked pods hold; `holding_pods`: the cgroups of the pods that
    /// hold their apps (they find what an earlier agent left in them). Returns how many were
    /// released.
    pub fn release_orphans(&mut self, held: HashSet<u32>, holding_pods: &[String], now: Nanos) -> usize {
        let Some(ledger) = self.ledger.clone() else { return 0 };
        let proc = self.host_proc.clone();
        // The holding pods' processes, read only for a stopped record no tracked pod holds: a
        // sweep of a node whose held apps are all known reads no cgroup (with 110 held pods,
        // reading theirs every second was most of the agent's own CPU beside the probes).
        let mut in_holding_pods: Option<(HashSet<u32>, Vec<&String>)> = None;
        let mut orphans = Vec::new();
        for (tgid, record) in ledger.records() {
            if held.contains(&tgid) {
                continue;
            }
            // Only what is proven drops a record: a state that cannot be read keeps it.
            match stopped(&proc, tgid) {
                Ok(true) => {}
                Ok(false) => {
                    // Released and running (a record younger than this may be of a stop still on
                    // its way to taking effect).
                    if now.saturating_sub(record.ktime_ns) > ORPHAN_RECORD_GRACE_NS {
                        ledger.forget(tgid, &record);
                    }
                    continue;
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    ledger.forget(tgid, &record);
                    continue;
                }
                Err(e) => {
                    warn!(pid = tgid, "cannot read the state of a held process (its record is kept): {e}");
                    continue;
                }
            }
            let (claimed, unread) = in_holding_pods.get_or_insert_with(|| claimed_by(&self.cgroups, holding_pods));
            if claimed.contains(&tgid) {
                continue;
            }
            // The signal goes only to the process in the cgroup it was stopped in (no reused pid).
            match self.cgroups.search_by_id(record.cgroup_id, "/", CGROUP_SEARCH_BUDGET) {
                // In a holding pod whose processes could not all be read: it may be the pod's
                // (its search for what an earlier agent left held is made again until it reads
                // them), and a release of it here could not place it either.
                Search::Found(rel) if unread.iter().any(|p| Path::new(&rel).starts_with(p)) => {
                    debug!(pid = tgid, cgroup = %rel, "held in a pod whose processes cannot be read: left to its pod");
                }
                Search::Found(rel) => orphans.push(Release {
                    tgid,
                    container_rel: rel,
                    reason: "orphaned",
                    held_ns: now.saturating_sub(record.ktime_ns),
                }),
                Search::Gone => {
                    debug!(pid = tgid, "held record of a cgroup that is gone: another process by now");
                    ledger.forget(tgid, &record);
                }
                // The cgroup may still be there: the record stays, the next sweep looks again
                // (and the deadline keeper releases it at its deadline).
                Search::Unsure => warn!(pid = tgid, "cannot find the cgroup a held process was stopped in: kept"),
            }
        }
        let n = orphans.len();
        for r in &orphans {
            warn!(pid = r.tgid, cgroup = %r.container_rel, "a process stopped at exec that no tracked pod holds: releasing");
        }
        if n > 0 {
            self.release(orphans, false);
        }
        n
    }

    /// Whether the kernel's record of held processes is pinned (outlives this agent), or there is
    /// no record to lose (no kernel programs: nothing is ever held).
    pub fn held_record_pinned(&self) -> bool {
        self.ledger.as_ref().is_none_or(|l| l.pinned().is_some())
    }

    /// Whether the kernel's record names any process.
    pub fn any_held_record(&self) -> bool {
        self.ledger.as_ref().is_some_and(|l| !l.is_empty())
    }

    /// Pinned processes that exited while held (their pod's state forgot them): their fds go.
    pub fn prune_pinned(&mut self) {
        self.pinned.retain(|_, p| !p.exited());
    }

    /// Checks and pins every process of `batch` not pinned yet, then signals them (see
    /// [`Releaser`]).
    fn release(&mut self, batch: Vec<Release>, on_releaser: bool) {
        let pinned: Vec<PinnedRelease> = batch
            .into_iter()
            .map(|r| {
                // Pinned when held, and still there (else pinned now: a new process may have the
                // pid of one that exited while held).
                if let Some(pinned) = self.pinned.remove(&r.tgid).filter(|p| !p.exited()) {
                    return (r, Placed::In(pinned));
                }
                let placed = if r.container_rel.is_empty() {
                    // Held in a container the pod does not name (untracked): checked against the
                    // cgroup the kernel's record says it was stopped in.
                    self.pin_recorded(r.tgid)
                } else {
                    place_in_cgroup(&self.cgroups, r.tgid, &r.container_rel)
                };
                (r, placed)
            })
            .collect();
        let pinned = match &self.releaser {
            Some(releaser) if on_releaser => match releaser.send(pinned) {
                Ok(()) => return,
                Err(pinned) => {
                    warn!("the release thread is gone: releasing from the runtime");
                    pinned
                }
            },
            _ => pinned,
        };
        // From the runtime (no release thread): the failures are tried again by the sweep and
        // the deadline keeper, which find their records.
        let _ = send_releases(&self.metrics, self.ledger.as_deref(), pinned);
    }

    /// Pins `tgid` if it lives in the cgroup its held record names; without a record, if it is
    /// still a process stopped at exec (pinned first, so the check is of the process signalled).
    fn pin_recorded(&self, tgid: u32) -> Placed {
        let proc = &self.host_proc;
        match self.ledger.as_ref().and_then(|l| l.get(tgid)) {
            Some(record) => pin_in_cgroup_id(&self.cgroups, proc, tgid, record.cgroup_id, CGROUP_SEARCH_BUDGET),
            None => {
                let pinned = match pin_pid_placed(tgid) {
                    Ok(pinned) => pinned,
                    Err(placed) => return placed,
                };
                match stopped(proc, tgid) {
                    Ok(true) => Placed::In(pinned),
                    Ok(false) => Placed::Elsewhere(format!("pid {tgid} is not stopped: not signalled")),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                        Placed::Elsewhere(format!("pid {tgid} is gone"))
                    }
                    Err(e) => Placed::Unsure(format!("read the state of pid {tgid}: {e}")),
                }
            }
        }
    }
}

/// Of the processes the kernel's `records` name, those among `procs` that are stopped, with when
/// the kernel stopped them.
fn stopped_among<'a>(
    host_proc: &'a Path,
    records: &'a [(u32, HeldRecord)],
    procs: &'a [u32],
) -> impl Iterator<Item = (u32, Nanos)> + 'a {
    records
        .iter()
        .filter(move |(pid, _)| procs.contains(pid) && process_stopped(host_proc, *pid))
        .map(|(pid, r)| (*pid, r.ktime_ns))
}

/// The processes of the holding pods' cgroups, and the pods whose processes could not all be
/// read (what is held there is not proven anyone else's).
fn claimed_by<'a>(cgroups: &CgroupFs, holding_pods: &'a [String]) -> (HashSet<u32>, Vec<&'a String>) {
    let mut claimed = HashSet::new();
    let mut unread = Vec::new();
    for rel in holding_pods {
        match cgroups.procs_recursive_proven(rel) {
            Ok(procs) => claimed.extend(procs),
            Err(e) => {
                debug!(pod_cgroup = %rel, "cannot read a holding pod's processes: {e}");
                unread.push(rel);
            }
        }
    }
    (claimed, unread)
}

/// Whether a process is pid 1 of a pid namespace below the host's (the last `NSpid` entry is 1),
/// that is a container's init, the only kind of process the kernel holds.
fn is_ns_init(host_proc: &Path, pid: u32) -> bool {
    std::fs::read_to_string(host_proc.join(pid.to_string()).join("status"))
        .ok()
        .and_then(|s| nspid(&s))
        .is_some_and(|ids| ids.len() > 1 && ids.last() == Some(&1))
}

/// Whether a process looks held at exec: a container's init, stopped. A killed agent leaves
/// such processes behind; its successor takes them over.
pub fn held_at_exec(host_proc: &Path, pid: u32) -> bool {
    process_stopped(host_proc, pid) && is_ns_init(host_proc, pid)
}

/// When a process left stopped at exec was stopped, on the monotonic clock: it is held right
/// after it starts, so its start time (boot-relative, as the monotonic clock on a node that never
/// suspends) stands for it. Unknown: now.
fn stopped_since(host_proc: &Path, pid: u32, now: Nanos) -> Nanos {
    let Some(ticks) = crate::host::sys::clock_ticks() else { return now };
    let Some(start) = crate::host::container_main::start_time(host_proc, pid) else { return now };
    let started = start.saturating_mul(1_000_000_000) / ticks;
    started.min(now)
}

#[cfg(test)]
mod tests {
    use tokio::sync::mpsc;

    use super::*;
    use crate::host::proc::tests::stopped_child;

    /// Only a guard against a hang: the tests wait for events, never for a time.
    const HANG_GUARD: Duration = Duration::from_secs(30);

    #[tokio::test]
    async fn the_tasks_of_a_batch_start_once_its_releases_are_out() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let task = |n: u32| -> Pending<()> {
            let tx = tx.clone();
            Box::pin(async move {
                let _ = tx.send(n);
            })
        };
        let mut batch = Some(Batch::default());
        spawn_after_releases(&mut batch, task(1));
        // A task spawned after it: on this single-threaded runtime, spawned tasks run in order,
        // so had the batch's task started, its message would come first.
        tokio::spawn(task(0));
        assert_eq!(tokio::time::timeout(HANG_GUARD, rx.recv()).await.ok().flatten(), Some(0));
        assert!(rx.try_recv().is_err(), "a task of the batch ran before its releases");
        // What flush_releases does once the releases are handed over.
        for task in batch.take().map(|b| b.tasks).unwrap_or_default() {
            tokio::spawn(task);
        }
        assert_eq!(tokio::time::timeout(HANG_GUARD, rx.recv()).await.ok().flatten(), Some(1));
        // No batch kept: at once.
        spawn_after_releases(&mut batch, task(2));
        assert_eq!(tokio::time::timeout(HANG_GUARD, rx.recv()).await.ok().flatten(), Some(2));
    }

    #[test]
    fn only_stopped_namespace_inits_look_held() {
        let proc = Path::new("/proc");
        let me = std::process::id();
        // This test process is neither stopped nor (normally) a pid namespace's init.
        assert!(!process_stopped(proc, me));
        assert!(!held_at_exec(proc, me));
        assert!(!held_at_exec(proc, u32::MAX), "a missing process is not held");
    }

    #[test]
    fn a_left_held_process_keeps_its_start_as_its_hold_start() {
        let dir = std::env::temp_dir().join(format!("valet-proc-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("42")).expect("mkdir");
        // Field 22 (start time) = 500 ticks.
        let fields: Vec<String> = (3..=22).map(|i| if i == 22 { "500".into() } else { "0".into() }).collect();
        std::fs::write(dir.join("42/stat"), format!("42 (a (b) c) {}", fields.join(" "))).expect("write");
        let ticks = crate::host::sys::clock_ticks().expect("clock ticks");
        let since = stopped_since(&dir, 42, u64::MAX);
        let missing = stopped_since(&dir, 43, 7);
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(since, 500 * 1_000_000_000 / ticks);
        assert_eq!(missing, 7, "unknown start: now");
    }

    #[test]
    fn a_batch_of_releases_goes_out_from_the_release_thread_and_only_to_its_cgroups() {
        // Two held apps in a container cgroup (a tree of plain files: membership is read from
        // cgroup.procs), and a stopped process outside it that a release names by mistake.
        let dir = std::env::temp_dir().join(format!("valet-release-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let rel = "/kubepods/pod1/c1";
        std::fs::create_dir_all(dir.join("kubepods/pod1/c1")).expect("mkdir");
        let (a, b, stranger) = (stopped_child(), stopped_child(), stopped_child());
        std::fs::write(dir.join("kubepods/pod1/c1/cgroup.procs"), format!("{}\n{}\n", a.id(), b.id())).expect("procs");
        let cgroups = CgroupFs::new(&dir);
        let release = |pid: u32| Release { tgid: pid, container_rel: rel.into(), reason: "ready", held_ns: 1 };
        let batch: Vec<PinnedRelease> = [a.id(), b.id(), stranger.id()]
            .into_iter()
            .map(|pid| (release(pid), place_in_cgroup(&cgroups, pid, rel)))
            .collect();
        let metrics = Arc::new(Metrics::new());
        let releaser = Releaser::start(cgroups.clone(), metrics.clone(), None, 0).expect("release thread");
        assert!(releaser.send(batch).is_ok());
        // Shutdown waits for what was handed over: nothing is left stopped behind the agent.
        releaser.finish();
        let proc = Path::new("/proc");
        let (a_stopped, b_stopped, stranger_stopped) =
            (process_stopped(proc, a.id()), process_stopped(proc, b.id()), process_stopped(proc, stranger.id()));
        let released = metrics.releases.get_or_create(&ReasonLabels { reason: "ready" }).get();
        for mut child in [a, b, stranger] {
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = std::fs::remove_dir_all(&dir);
        assert!(!a_stopped && !b_stopped, "the held apps were not released");
        assert!(stranger_stopped, "a process outside the container's cgroup was signalled");
        assert_eq!(released, 2);
    }

    #[tokio::test]
    async fn a_chunked_batch_sends_each_chunk_as_it_is_decided_and_its_tasks_at_the_end() {
        let tree = crate::cgroup::tree::TempTree::new("release-chunks");
        let rel = "/kubepods/pod1/c1";
        tree.mkdir(rel);
        let mut apps: Vec<std::process::Child> = (0..=RELEASE_CHUNK).map(|_| stopped_child()).collect();
        let pids: Vec<u32> = apps.iter().map(std::process::Child::id).collect();
        tree.procs(rel, &pids);
        let mut releases =
            Releases::new(CgroupFs::new(&tree.0), PathBuf::from("/proc"), Arc::new(Metrics::new()), None, 0);
        let proc = Path::new("/proc");
        let running = |pids: &[u32]| pids.iter().filter(|p| !process_stopped(proc, **p)).count();
        let (tx, mut rx) = mpsc::unbounded_channel();
        // In the normal class (this test's thread): the batch goes out whole, at its flush.
        releases.keep_batch();
        assert!(releases.batch.as_ref().is_some_and(|b| !b.chunked), "chunked in the normal class");
        // As in the real-time class.
        releases.batch = Some(Batch { chunked: true, ..Batch::default() });
        releases.after_releases(Box::pin(async move {
            let _ = tx.send(());
        }));
        for &pid in &pids[..RELEASE_CHUNK - 1] {
            releases.release_one(pid, rel.into(), "ready", 1);
            releases.send_decided();
        }
        let one_short = running(&pids);
        releases.release_one(pids[RELEASE_CHUNK - 1], rel.into(), "ready", 1);
        releases.send_decided();
        let chunk = &pids[..RELEASE_CHUNK];
        let deadline = Instant::now() + HANG_GUARD;
        while running(chunk) < RELEASE_CHUNK && Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let (chunk_out, last_held) = (running(chunk), process_stopped(proc, pids[RELEASE_CHUNK]));
        tokio::task::yield_now().await;
        let task_early = rx.try_recv().is_ok();
        releases.release_one(pids[RELEASE_CHUNK], rel.into(), "ready", 1);
        releases.flush();
        releases.finish();
        let task_ran = tokio::time::timeout(HANG_GUARD, rx.recv()).await.ok().flatten().is_some();
        let all_out = running(&pids);
        for app in &mut apps {
            let _ = app.kill();
            let _ = app.wait();
        }
        assert_eq!(one_short, 0, "released before a chunk's worth was decided");
        assert_eq!(chunk_out, RELEASE_CHUNK, "a chunk's worth was decided, and not released");
        assert!(last_held, "released before it was decided");
        assert!(!task_early, "a task of the batch started before its flush");
        assert!(task_ran && all_out == pids.len(), "the flush sends the rest and starts the tasks");
    }

    #[test]
    fn an_app_gone_before_its_release_is_no_release_failure_and_one_not_placed_is_placed_again() {
        let tree = crate::cgroup::tree::TempTree::new("release-gone");
        let (rel, unreadable) = ("/kubepods/pod1/c1", "/kubepods/pod2/c1");
        tree.mkdir(rel);
        tree.procs(rel, &[]);
        tree.mkdir(unreadable);
        // A cgroup.procs that cannot be read (a directory: EISDIR, even for root).
        std::fs::create_dir(tree.0.join("kubepods/pod2/c1/cgroup.procs")).expect("mkdir cgroup.procs");
        let cgroups = CgroupFs::new(&tree.0);
        // Killed while held (its pid no one's), and a held app whose cgroup cannot be read.
        let mut killed = std::process::Command::new("true").spawn().expect("spawn true");
        let killed_pid = killed.id();
        let _ = killed.wait();
        let mut unplaced = stopped_child();
        let release =
            |pid: u32, rel: &str| Release { tgid: pid, container_rel: rel.into(), reason: "ready", held_ns: 1 };
        let batch: Vec<PinnedRelease> = vec![
            (release(killed_pid, rel), place_in_cgroup(&cgroups, killed_pid, rel)),
            (release(unplaced.id(), unreadable), place_in_cgroup(&cgroups, unplaced.id(), unreadable)),
        ];
        let metrics = Metrics::new();
        let mut retries = send_releases(&metrics, None, batch);
        let still_stopped = process_stopped(Path::new("/proc"), unplaced.id());
        // Tried again while the cgroup still cannot be read: kept, not signalled.
        retries.iter_mut().for_each(|r| r.at = Instant::now());
        retries = retry_releases(&cgroups, &metrics, None, retries);
        let stopped_after_retry = process_stopped(Path::new("/proc"), unplaced.id());
        // The cgroup reads again (and names the app): the next try releases it.
        std::fs::remove_dir(tree.0.join("kubepods/pod2/c1/cgroup.procs")).expect("rmdir cgroup.procs");
        tree.procs(unreadable, &[unplaced.id()]);
        retries.iter_mut().for_each(|r| r.at = Instant::now());
        let left = retry_releases(&cgroups, &metrics, None, retries).len();
        let released = !process_stopped(Path::new("/proc"), unplaced.id());
        let _ = unplaced.kill();
        let _ = unplaced.wait();
        assert!(still_stopped && stopped_after_retry, "a process whose cgroup could not be read was signalled");
        assert_eq!(metrics.gone_before_release.get(), 1, "the app killed while held");
        assert_eq!(metrics.release_failures.get(), 1, "only the app that could not be placed");
        assert!(released && left == 0, "the app whose cgroup could not be read is released once it can be");
        assert_eq!(metrics.releases.get_or_create(&ReasonLabels { reason: "ready" }).get(), 1);
    }
}
