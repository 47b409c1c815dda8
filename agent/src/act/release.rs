//! Releasing held apps: the kernel's record of what it stopped, the processes found held in a
//! pod (an earlier agent's holds included), the orphans no pod holds any more, and the signals
//! themselves, sent back to back from a thread of their own.

use super::*;

/// A record of a process that is not stopped is dropped only once it is this old: the exec
/// program writes it just before the stop takes effect.
pub(super) const ORPHAN_RECORD_GRACE_NS: u64 = 2_000_000_000;
/// Most cgroup directories looked at to find the one a held process was stopped in (a node's
/// whole tree is a few thousand at most).
pub(super) const CGROUP_SEARCH_BUDGET: usize = 50_000;

/// How often, and after how long at first, a failed SIGCONT is tried again (the wait doubles).
const RETRY_FIRST: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(5);

/// A SIGCONT that failed, to try again at `at`.
pub(super) struct Retry {
    release: Release,
    pinned: Pinned,
    tries: u32,
    at: Instant,
}

/// Sends the SIGCONTs of a batch of releases, back to back, then counts and logs them. The
/// ones that failed come back, to be tried again after a backoff: their records stay (a
/// successor, or the deadline keeper, finds them), and nothing takes them for released.
pub(super) fn send_releases(metrics: &Metrics, ledger: Option<&HeldLedger>, batch: Vec<PinnedRelease>) -> Vec<Retry> {
    // A failure says why, and keeps the pidfd when the process is still there (to retry).
    type Sent = Result<(), (String, Option<Pinned>)>;
    let sent: Vec<(Release, Sent)> = batch
        .into_iter()
        .map(|(r, pin)| {
            let sent = match pin {
                Ok(pinned) => match pinned.signal(libc::SIGCONT) {
                    Ok(()) => Ok(()),
                    Err(e) if pinned.exited() => Err((format!("{}: the process exited", e.chain()), None)),
                    Err(e) => Err((e.chain().to_string(), Some(pinned))),
                },
                Err(e) => Err((e, None)),
            };
            (r, sent)
        })
        .collect();
    let mut retries = Vec::new();
    for (release, sent) in sent {
        let Release { tgid, reason, held_ns, .. } = release;
        match sent {
            Ok(()) => {
                // Only once the signal is out: an agent that dies before leaves the record to
                // its successor.
                if let Some(ledger) = ledger {
                    ledger.forget(tgid);
                }
                let held_for = held_ns as f64 / 1e9;
                // How long apps waited: the sandbox, sidecars and strays run again at once.
                if !matches!(reason, "not_app" | "untracked") {
                    metrics.hold_duration.observe(held_for);
                }
                metrics.releases.get_or_create(&ReasonLabels { reason }).inc();
                info!(pid = tgid, reason, held_ms = held_for * 1e3, "released app");
            }
            Err((e, Some(pinned))) => {
                metrics.release_failures.inc();
                warn!(pid = tgid, reason, "SIGCONT failed (tried again after a backoff; its record is kept): {e}");
                retries.push(Retry { release, pinned, tries: 1, at: Instant::now() + RETRY_FIRST });
            }
            Err((e, None)) => {
                // Not signalled and nothing to retry through: the process is gone, or it is not
                // (or no longer) where it was held. Its record stays for the sweep and the
                // deadline keeper, which drop it once they can tell it names no one.
                metrics.release_failures.inc();
                warn!(pid = tgid, reason, "release: {e}");
            }
        }
    }
    retries
}

/// Tries the due retries again; returns those still failing.
fn retry_releases(metrics: &Metrics, ledger: Option<&HeldLedger>, retries: Vec<Retry>) -> Vec<Retry> {
    let now = Instant::now();
    let (due, mut waiting): (Vec<Retry>, Vec<Retry>) = retries.into_iter().partition(|r| r.at <= now);
    for mut r in due {
        match r.pinned.signal(libc::SIGCONT) {
            Ok(()) => {
                if let Some(ledger) = ledger {
                    ledger.forget(r.release.tgid);
                }
                metrics.releases.get_or_create(&ReasonLabels { reason: r.release.reason }).inc();
                info!(pid = r.release.tgid, reason = r.release.reason, tries = r.tries + 1, "released app");
            }
            Err(_) if r.pinned.exited() => debug!(pid = r.release.tgid, "exited before its release went through"),
            Err(e) => {
                metrics.release_failures.inc();
                r.tries += 1;
                let wait = RETRY_FIRST.saturating_mul(1 << r.tries.min(8)).min(RETRY_MAX);
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
pub(super) struct Releaser {
    tx: std::sync::mpsc::Sender<Vec<PinnedRelease>>,
    thread: std::thread::JoinHandle<()>,
}

impl Releaser {
    pub(super) fn start(metrics: Arc<Metrics>, ledger: Option<Arc<HeldLedger>>) -> Option<Releaser> {
        let (tx, rx) = std::sync::mpsc::channel::<Vec<PinnedRelease>>();
        let thread = std::thread::Builder::new()
            .name("valet-release".into())
            .spawn(move || {
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
                        retries.extend(send_releases(&metrics, ledger.as_deref(), batch));
                    }
                    retries = retry_releases(&metrics, ledger.as_deref(), retries);
                }
                // The agent stops: one last try each; a record left is its successor's.
                for r in retries {
                    let _ = r.pinned.signal(libc::SIGCONT);
                }
            })
            .map_err(|e| warn!("no release thread, releases go out from the runtime: {e}"))
            .ok()?;
        Some(Releaser { tx, thread })
    }

    /// Hands `batch` to the thread; if it is gone, gives it back.
    pub(super) fn send(&self, batch: Vec<PinnedRelease>) -> Result<(), Vec<PinnedRelease>> {
        self.tx.send(batch).map_err(|std::sync::mpsc::SendError(batch)| batch)
    }

    /// Returns once every batch handed over is sent.
    pub(super) fn finish(self) {
        drop(self.tx);
        let _ = self.thread.join();
    }
}

impl<K: KernelControl, L: SidecarLink> Actuators<K, L> {
    /// Keeps the releases of the effects applied from now on, until [`Actuators::flush_releases`]
    /// (a batch of probe answers: their apps go on together).
    pub fn batch_releases(&mut self) {
        self.releases.get_or_insert_with(Batch::default);
    }

    /// Carries out the releases kept since [`Actuators::batch_releases`]: every process is
    /// pinned first (when it was held, or checked and pinned now), then all are signalled back
    /// to back, and only then the batch's other tasks start. A signalled app takes a CPU at once;
    /// work between the signals gave it the time to push the rest back.
    pub fn flush_releases(&mut self) {
        if let Some(Batch { releases, tasks }) = self.releases.take() {
            self.release(releases, true);
            for task in tasks {
                tokio::spawn(task);
            }
        }
    }

    /// Returns once every release handed to the release thread is sent (before the agent
    /// exits: no app is left stopped). Releases after this go out from the caller.
    pub fn finish_releases(&mut self) {
        self.flush_releases();
        if let Some(releaser) = self.releaser.take() {
            releaser.finish();
        }
    }

    /// Processes stopped at exec in the pod's containers: those the kernel's record names (any
    /// process: a shareProcessNamespace app is not its namespace's init), and stopped
    /// namespace inits (held by an agent without a pinned record).
    pub(super) fn left_held(&self, pod_rel: &str, now: Nanos) -> Vec<LeftHeld> {
        let proc = &self.settings.host_proc;
        let mut found = Vec::new();
        for c in self.cgroups.containers(pod_rel) {
            for (pid, since) in self.recorded_held(&c.rel) {
                found.push(LeftHeld { tgid: pid, container_cgroup: c.id, since });
            }
            for pid in self.cgroups.container_procs(&c.rel) {
                if held_at_exec(proc, pid) && !found.iter().any(|f| f.tgid == pid) {
                    found.push(LeftHeld { tgid: pid, container_cgroup: c.id, since: stopped_since(proc, pid, now) });
                }
            }
        }
        found
    }

    /// Stopped processes in container cgroup `rel` (or below it) that the kernel's record says
    /// it stopped, with when.
    pub(super) fn recorded_held(&self, rel: &str) -> impl Iterator<Item = (u32, Nanos)> + '_ {
        let records = match &self.ledger {
            Some(ledger) => ledger.records(),
            None => Vec::new(),
        };
        let procs: Vec<u32> = if records.is_empty() { Vec::new() } else { self.cgroups.procs_recursive(rel) };
        records
            .into_iter()
            .filter(move |(pid, _)| procs.contains(pid) && process_stopped(&self.settings.host_proc, *pid))
            .map(|(pid, r)| (pid, r.ktime_ns))
    }

    /// Releases the processes the kernel's record names that no tracked pod will: their pod was
    /// deleted, relabelled, stripped of its hold or is done, or they were left by an agent that
    /// died while holding them. Records of processes gone, or running again for a while, are
    /// dropped. `held`: the pids tracked pods hold; `holding_pods`: the cgroups of the pods that
    /// hold their apps (they find what an earlier agent left in them). Returns how many were
    /// released.
    pub fn release_orphans(&mut self, held: HashSet<u32>, holding_pods: &[String], now: Nanos) -> usize {
        let Some(ledger) = self.ledger.clone() else { return 0 };
        let proc = self.settings.host_proc.clone();
        let mut claimed = held;
        for rel in holding_pods {
            claimed.extend(self.cgroups.procs_recursive(rel));
        }
        let mut orphans = Vec::new();
        for (tgid, record) in ledger.records() {
            if claimed.contains(&tgid) {
                continue;
            }
            if !proc.join(tgid.to_string()).exists() {
                ledger.forget(tgid);
                continue;
            }
            if !process_stopped(&proc, tgid) {
                // Released and running (a record younger than this may be of a stop still on its
                // way to taking effect).
                if now.saturating_sub(record.ktime_ns) > ORPHAN_RECORD_GRACE_NS {
                    ledger.forget(tgid);
                }
                continue;
            }
            // The signal goes only to the process in the cgroup it was stopped in (no reused pid).
            match self.cgroups.search_by_id(record.cgroup_id, "/", CGROUP_SEARCH_BUDGET) {
                Search::Found(rel) => orphans.push(Release {
                    tgid,
                    container_rel: rel,
                    reason: "orphaned",
                    held_ns: now.saturating_sub(record.ktime_ns),
                }),
                Search::Gone => {
                    debug!(pid = tgid, "held record of a cgroup that is gone: another process by now");
                    ledger.forget(tgid);
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
        self.ledger.as_ref().is_some_and(|l| !l.records().is_empty())
    }

    /// Pinned processes that exited while held (their pod's state forgot them): their fds go.
    pub fn prune_pinned(&mut self) {
        self.pinned.retain(|_, p| !p.exited());
    }

    /// Checks and pins every process of `batch` not pinned yet, then signals them (see
    /// [`Releaser`]).
    pub(super) fn release(&mut self, batch: Vec<Release>, on_releaser: bool) {
        let pinned: Vec<PinnedRelease> = batch
            .into_iter()
            .map(|r| {
                // Pinned when held, and still there (else pinned now: a new process may have the
                // pid of one that exited while held).
                if let Some(pinned) = self.pinned.remove(&r.tgid).filter(|p| !p.exited()) {
                    return (r, Ok(pinned));
                }
                let pin = if r.container_rel.is_empty() {
                    // Held in a container the pod does not name (untracked): checked against the
                    // cgroup the kernel's record says it was stopped in.
                    self.pin_recorded(r.tgid)
                } else {
                    pin_in_cgroup(&self.cgroups, r.tgid, &r.container_rel).map_err(|e| e.chain().to_string())
                };
                (r, pin)
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
    fn pin_recorded(&self, tgid: u32) -> Result<Pinned, String> {
        let proc = &self.settings.host_proc;
        match self.ledger.as_ref().and_then(|l| l.get(tgid)) {
            Some(record) => match pin_in_cgroup_id(&self.cgroups, proc, tgid, record.cgroup_id, CGROUP_SEARCH_BUDGET) {
                Placed::In(pinned) => Ok(pinned),
                Placed::Elsewhere => {
                    Err(format!("pid {tgid} is no longer in the cgroup it was held in: not signalled"))
                }
                Placed::Unsure(why) => Err(why),
            },
            None => {
                let pinned = pin_pid(tgid).map_err(|e| e.chain().to_string())?;
                if held_at_exec(proc, tgid) || process_stopped(proc, tgid) {
                    Ok(pinned)
                } else {
                    Err(format!("pid {tgid} is not stopped: not signalled"))
                }
            }
        }
    }
}

/// Whether a process is stopped (state `T` in /proc/<pid>/stat).
pub(super) fn process_stopped(host_proc: &Path, pid: u32) -> bool {
    std::fs::read_to_string(host_proc.join(pid.to_string()).join("stat"))
        .ok()
        .and_then(|s| s.rsplit(')').next().and_then(|r| r.split_whitespace().next()).map(|st| st == "T"))
        .unwrap_or(false)
}

/// Whether a process is pid 1 of a pid namespace below the host's (the last `NSpid` entry is 1),
/// that is a container's init, the only kind of process the kernel holds.
pub(super) fn is_ns_init(host_proc: &Path, pid: u32) -> bool {
    std::fs::read_to_string(host_proc.join(pid.to_string()).join("status"))
        .ok()
        .and_then(|s| {
            let ids: Vec<&str> = s.lines().find_map(|l| l.strip_prefix("NSpid:"))?.split_whitespace().collect();
            Some(ids.len() > 1 && ids.last() == Some(&"1"))
        })
        .unwrap_or(false)
}

/// Whether a process looks held at exec: a container's init, stopped. A killed agent leaves
/// such processes behind; its successor takes them over.
pub fn held_at_exec(host_proc: &Path, pid: u32) -> bool {
    process_stopped(host_proc, pid) && is_ns_init(host_proc, pid)
}

/// When a process left stopped at exec was stopped, on the monotonic clock: it is held right
/// after it starts, so its start time (boot-relative, as the monotonic clock on a node that never
/// suspends) stands for it. Unknown: now.
pub(super) fn stopped_since(host_proc: &Path, pid: u32, now: Nanos) -> Nanos {
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let Some(start) = crate::host::container_main::start_time(host_proc, pid) else { return now };
    if ticks <= 0 {
        return now;
    }
    let started = start.saturating_mul(1_000_000_000) / ticks as u64;
    started.min(now)
}
