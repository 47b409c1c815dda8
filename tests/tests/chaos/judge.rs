use super::*;

impl Chaos<'_> {
    /// The counts after a restart (or the end of a fault), from `ready_at`.
    pub(crate) fn check(&mut self, agent: &Agent, ready_at: Instant, ready_ns: u64) {
        self.check_stopped(agent, ready_at);
        self.check_quits(agent, ready_at, ready_ns);
        self.check_conditions(agent, ready_at);
    }

    /// Apps that should run and are still stopped or frozen 2 s after the agent is back.
    fn check_stopped(&mut self, agent: &Agent, ready_at: Instant) {
        let root = self.cgroup_root.clone();
        for pod in &mut self.pods {
            let (Some(why), Some(pid)) = (pod.must_run(), pod.app) else { continue };
            if pod.failed {
                continue;
            }
            self.tally.should_run += 1;
            let deadline = ready_at + RUN_WITHIN;
            let ran = loop {
                if !stuck(&root, pid) {
                    break true;
                }
                if Instant::now() > deadline {
                    break false;
                }
                std::thread::sleep(Duration::from_millis(5));
            };
            if !ran {
                self.tally.left_stopped += 1;
                pod.failed = true;
                println!(
                    "VIOLATION stopped: {} ({:?} pid namespace, {why}): app {pid} in state {:?} (frozen: {}) \
                     {RUN_WITHIN:?} after the agent was back; agent log:\n{}",
                    pod.name(),
                    pod.pidns,
                    state(pid),
                    frozen(&root, pid),
                    Chaos::log_about(agent, pod)
                );
            }
        }
    }

    /// Finished Jobs not quit by then: the quit must come within 1 s of the restart.
    fn check_quits(&mut self, agent: &Agent, ready_at: Instant, ready_ns: u64) {
        for pod in &mut self.pods {
            if !pod.owed_quit() || pod.failed {
                continue;
            }
            let quit_before = pod.job.loopback_quits().iter().any(|q| q.mono_ns < ready_ns);
            if quit_before {
                continue;
            }
            self.tally.owed_quits += 1;
            let mut first = None;
            eventually((ready_at + GUARD).saturating_duration_since(Instant::now()), || {
                first = pod.job.loopback_quits().iter().map(|q| q.mono_ns).min();
                first.is_some()
            });
            let late = first.is_none_or(|t| t > ready_ns + QUIT_WITHIN.as_nanos() as u64);
            if late {
                self.tally.late_quits += 1;
                pod.failed = true;
                let after = first.map(|t| Duration::from_nanos(t.saturating_sub(ready_ns)));
                println!(
                    "VIOLATION quit: {} ({:?} pid namespace, ended {:?} before the restart): quit {} after the \
                     agent was back; agent log:\n{}",
                    pod.name(),
                    pod.pidns,
                    Duration::from_nanos(ready_ns.saturating_sub(pod.ended_ns.unwrap_or(ready_ns))),
                    after.map_or("never (10 s guard)".to_owned(), |d| format!("{d:?}")),
                    Chaos::log_about(agent, pod)
                );
            }
        }
    }

    /// Conditions of the pods still valet's, whose proxy runs: True exactly when it is ready.
    fn check_conditions(&mut self, agent: &Agent, ready_at: Instant) {
        for pod in &mut self.pods {
            if pod.deleted || !pod.labelled || pod.failed || !pod.proxy_alive() || !pod.job.quits().is_empty() {
                continue;
            }
            self.tally.conditions_checked += 1;
            let want = if pod.ready { "True" } else { "False" };
            // Not ready: False, or no condition yet (none is written False before its first True:
            // a readiness gate reads an absent condition as False).
            let (ready, told) = (pod.ready, |have: &Option<String>| {
                have.as_deref() == Some(want) || (want == "False" && have.is_none())
            });
            let mut have = None;
            let settled = eventually((ready_at + SETTLE).saturating_duration_since(Instant::now()), || {
                have = condition(self.node, &pod.job);
                // A True while the proxy is not ready is false at once, not a matter of settling.
                told(&have) || (!ready && have.as_deref() == Some("True"))
            });
            // The proxy may have been quit meanwhile (its app ended just before the kill).
            let quit_meanwhile = !pod.proxy_alive() || !pod.job.quits().is_empty();
            if (!settled || !told(&have)) && !quit_meanwhile {
                self.tally.false_conditions += 1;
                pod.failed = true;
                println!(
                    "VIOLATION condition: {} ({:?} pid namespace): {CONDITION} {have:?} while the proxy is {}; \
                     agent log:\n{}",
                    pod.name(),
                    pod.pidns,
                    if pod.ready { "ready" } else { "not ready" },
                    Chaos::log_about(agent, pod)
                );
            }
        }
    }

    /// Looks at every held app: reads its deadline from the kernel's record while it is held,
    /// counts it when it is still stopped more than 2 s past that deadline, and judges its
    /// release once it ran (early: before its proxy was ready, its pod let it go, and its
    /// deadline). Called between every step, and every 50 ms while the test waits.
    pub(crate) fn observe(&mut self, agent: Option<&Agent>) {
        let root = self.cgroup_root.clone();
        let pin_dir = self.node.pin_dir().to_path_buf();
        let now = monotonic_ns();
        for pod in &mut self.pods {
            let Some(pid) = pod.app else { continue };
            if pod.deadline_ns.is_none()
                && state(pid) == Some('T')
                && let Some(r) = record(&pin_dir, pid)
            {
                pod.deadline_ns = Some(r.ktime_ns + pod.timeout.as_nanos() as u64);
                self.tally.deadlines_known += 1;
            }
            if !pod.late_counted
                && let Some(deadline) = pod.deadline_ns
                && now > deadline + DEADLINE_WITHIN.as_nanos() as u64
                && stuck(&root, pid)
            {
                pod.late_counted = true;
                self.tally.past_deadline += 1;
                println!(
                    "VIOLATION past deadline: {} ({:?} pid namespace): app {pid} still stopped {:?} after its \
                     deadline{}",
                    pod.name(),
                    pod.pidns,
                    Duration::from_nanos(now - deadline),
                    agent.map(|a| format!("; agent log:\n{}", Chaos::log_about(a, pod))).unwrap_or_default()
                );
            }
            if !pod.lost_counted && lost_record(&pin_dir, &self.old_pin_dirs, pod, pid) {
                pod.lost_counted = true;
                self.tally.records_lost += 1;
                println!(
                    "VIOLATION record lost: {} ({:?} pid namespace): app {pid} stopped, its record gone{}",
                    pod.name(),
                    pod.pidns,
                    agent.map(|a| format!("; agent log:\n{}", Chaos::log_about(a, pod))).unwrap_or_default()
                );
            }
            if !pod.release_judged
                && let Some(ran) = written_ns(&pod.ran, self.offset)
            {
                pod.release_judged = true;
                judge_release(&mut self.tally, pod, pid, ran);
            }
        }
    }

    /// Waits `d`, looking at the held apps every 50 ms.
    pub(crate) fn wait_observing(&mut self, d: Duration, agent: Option<&Agent>) {
        let end = Instant::now() + d;
        while Instant::now() < end {
            self.observe(agent);
            std::thread::sleep(Duration::from_millis(50).min(end.saturating_duration_since(Instant::now())));
        }
    }

    /// Quits that reached a pod's proxy before its app ended (or with no end at all).
    pub(crate) fn count_early_quits(&mut self, i: usize) {
        let pod = &self.pods[i];
        let quits = pod.job.loopback_quits();
        self.tally.quits += quits.len();
        let early: Vec<u64> = quits.iter().map(|q| q.mono_ns).filter(|&t| pod.ended_ns.is_none_or(|e| t < e)).collect();
        if !early.is_empty() {
            self.tally.early_quits += early.len();
            println!(
                "VIOLATION early quit: {} ({:?} pid namespace): {} quit(s) before the app's end (app ended: {}; its \
                 cgroup made unreadable by a read fault: {})",
                pod.name(),
                pod.pidns,
                early.len(),
                pod.ended_ns.is_some(),
                pod.read_faulted
            );
        }
    }

    /// Retires pods that are done with, or old: their processes are killed and their objects
    /// deleted, as the kubelet and the Job controller would.
    pub(crate) fn retire(&mut self, all: bool) {
        let mut i = 0;
        while i < self.pods.len() {
            let pod = &self.pods[i];
            let done = all
                || pod.deleted
                || !pod.labelled
                || pod.failed
                || pod.age >= MAX_AGE
                || (pod.ended_ns.is_some() && !pod.proxy_alive());
            if !done {
                i += 1;
                continue;
            }
            self.count_early_quits(i);
            let pod = self.pods.swap_remove(i);
            let (name, deleted) = (pod.name().to_owned(), pod.deleted);
            drop(pod);
            if !deleted {
                let _ = self.node.api.delete_pod("jobs", &name);
            }
        }
    }
}

/// Whether `pod`'s app is stopped with no record of its hold in any pin an agent reads. Every
/// release sends SIGCONT before it drops the record, so a stopped app seen after a missing
/// record (read twice) lost it.
fn lost_record(pin_dir: &Path, old_dirs: &[PathBuf], pod: &Pod, pid: u32) -> bool {
    let started = pod.started_ns.unwrap_or(0);
    let missing = || recorded_stop(pin_dir, old_dirs, pid).is_none_or(|stop| stop < started);
    state(pid) == Some('T') && missing() && state(pid) == Some('T') && missing() && state(pid) == Some('T')
}

/// Judges an app's release once it ran (at `ran`): before its proxy was ready (as the stand-in
/// logged it), its pod let it go and its deadline (its start plus its hold timeout) is early.
fn judge_release(tally: &mut Tally, pod: &Pod, pid: u32, ran: u64) {
    tally.releases_judged += 1;
    let deadline = pod.deadline_at_least().unwrap_or(u64::MAX);
    let ready = pod.job.proxy_ready_at().unwrap_or(u64::MAX);
    let let_go = pod.allowed_ns.unwrap_or(u64::MAX);
    let allowed = ready.min(let_go).min(deadline);
    if ran + STAMP_SLACK_NS < allowed {
        tally.early_releases += 1;
        println!(
            "VIOLATION ran before its proxy was ready: {} ({:?} pid namespace): app {pid} ran {:?} before its proxy \
             served ready, its pod let it go or its app's start plus its hold timeout",
            pod.name(),
            pod.pidns,
            Duration::from_nanos(allowed - ran),
        );
    } else if ready.min(let_go) > deadline {
        tally.deadline_releases += 1;
    }
}
