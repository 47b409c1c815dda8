//! The stops of crash test v3 besides SIGKILL, as the kubelet makes them: a SIGTERM restart of
//! the agent container, a liveness restart, rollouts without and with surge.
use super::*;

/// The pod's `terminationGracePeriodSeconds` in these runs (the manifest's is 30 s): the kubelet
/// SIGKILLs a container still running at its end.
pub(crate) const GRACE: Duration = Duration::from_secs(10);

/// How a turn stops (or disturbs) the agent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Stop {
    /// SIGKILL (an OOM kill, a crash).
    Kill,
    /// The kubelet restarts the agent container alone: SIGTERM, the grace period, SIGKILL at its
    /// end; the pod is not deleted, the deadline keeper runs on.
    Sigterm,
    /// A liveness probe failed: the agent hung (SIGSTOPped) or not, then as `Sigterm` with the
    /// probe's short grace period (0.1–2.5 s), SIGKILL at its end.
    Liveness,
    /// The DaemonSet's rollout: the old pod marked for deletion, SIGTERM to both containers,
    /// SIGKILL at the grace period's end, the new pod's containers started 0–2 s after.
    Rollout,
    /// The same with surge: the new pod's containers start (the agent ready) before the old
    /// pod is deleted.
    RolloutSurge,
    /// A held app's cgroup made unreadable to valet for 0.2–1 s (by its owner), its proxy
    /// turning ready meanwhile; half the time across a SIGKILL restart.
    ReadFault,
    /// A held app's pod deleted, its app killed, and its host pid given to the next held app
    /// at once (`ns_last_pid`), before a pass drops the old record.
    PidReuse,
}

pub(crate) const STOPS: [Stop; 7] =
    [Stop::Kill, Stop::Sigterm, Stop::Liveness, Stop::Rollout, Stop::RolloutSurge, Stop::ReadFault, Stop::PidReuse];

/// Stops drawn: a SIGKILL 3 times in 10, each other kind 1 in 6 of the rest... (weights below).
const WEIGHTS: [u64; 7] = [30, 14, 12, 11, 11, 11, 11];

impl Stop {
    /// The first turns cover every kind once (a short run too), then the seeded draw. Read
    /// faults only with `read_faults` (on unless `VALET_CHAOS_READ_FAULTS=0`).
    pub(crate) fn draw(rng: &mut Rng, n: usize, read_faults: bool) -> Stop {
        let kinds: Vec<Stop> = STOPS.iter().copied().filter(|s| read_faults || *s != Stop::ReadFault).collect();
        if n < kinds.len() {
            return kinds[n];
        }
        let weight = |s: &Stop, w: u64| if read_faults || *s != Stop::ReadFault { w } else { 0 };
        let mut at = rng.below(STOPS.iter().zip(WEIGHTS).map(|(s, w)| weight(s, w)).sum());
        for (stop, w) in STOPS.iter().zip(WEIGHTS) {
            let w = weight(stop, w);
            if at < w {
                return *stop;
            }
            at -= w;
        }
        Stop::Kill
    }
}

/// Sends `sig` to a process of the test's (a container's main process).
pub(crate) fn signal(pid: Option<u32>, sig: i32) {
    if let Some(pid) = pid {
        // SAFETY: plain syscall on a child of this test, not reaped yet.
        unsafe { libc::kill(pid as i32, sig) };
    }
}

impl Chaos<'_> {
    /// The kubelet stops the agent container: SIGTERM, then SIGKILL if it still runs at the end
    /// of `grace`. Whether it exited on its own.
    pub(crate) fn stop_gracefully(&mut self, agent: &mut Agent, grace: Duration) -> bool {
        let exited = agent.stop(libc::SIGTERM, grace);
        match exited {
            Ok(Some(s)) if s.success() => {
                self.tally.graceful_exits += 1;
                true
            }
            Ok(status) => {
                println!("chaos: the agent exited {status:?} at SIGTERM; its log:\n{}", agent.log_text());
                self.tally.bad_exits += 1;
                true
            }
            // `stop` SIGKILLed it at the deadline.
            Err(_) => {
                self.tally.killed_at_grace += 1;
                false
            }
        }
    }

    /// The same for the keeper container.
    fn stop_keeper(&mut self, grace: Duration) {
        let Some(mut keeper) = self.keeper.take() else { return };
        signal(keeper.pid(), libc::SIGTERM);
        if keeper.wait_exit(grace).is_none() {
            keeper.kill();
            self.tally.killed_at_grace += 1;
        }
    }

    /// A SIGTERM restart of the agent container, or a liveness restart: the agent stops with a
    /// grace period (hung first, for a liveness failure, half the time); the pod stays, the
    /// keeper runs on. While it is down, pods change as after a kill.
    pub(crate) fn container_restart(&mut self, agent: &mut Agent, liveness: bool) -> (Agent, Instant, u64) {
        let grace = if liveness {
            if self.rng.chance(50) {
                // Hung: it fails its probe, and cannot act on the SIGTERM either.
                signal(agent.pid(), libc::SIGSTOP);
                self.tally.hung += 1;
            }
            Duration::from_millis(100) + self.rng.millis(2400)
        } else {
            GRACE
        };
        let stopped_ns = monotonic_ns();
        self.stop_gracefully(agent, grace);
        self.count_in_flight(stopped_ns);
        self.while_down();
        self.restart()
    }

    /// While no agent runs: the disruption of this turn's kind to one pod, 0–200 ms.
    pub(crate) fn while_down(&mut self) {
        let kind = DISRUPTIONS[self.tally.kills % DISRUPTIONS.len()];
        self.disrupt(kind);
        let wait = self.rng.millis(200);
        self.wait_observing(wait, None);
    }

    /// A rollout as the DaemonSet controller and the kubelet make it. Without surge: the old pod
    /// marked for deletion, both containers SIGTERMed (SIGKILL at the grace period's end), the
    /// pod removed, then the new pod's keeper and agent 0–2 s later. With surge: the new pod's
    /// containers first (its agent ready), then the old pod's stop.
    pub(crate) fn rollout(&mut self, agent: &mut Agent, surge: bool) -> (Agent, Instant, u64) {
        let old = self.pod.clone();
        let old_keeper = self.keeper.take();
        let mut next = None;
        if surge {
            self.pod = self.node.daemonset_pod().expect("the new pod");
            self.start_keeper();
            next = Some(self.restart());
        }
        let api = &self.node.api;
        api.begin_pod_deletion(AGENT_NAMESPACE, &old, Some(GRACE.as_secs() as i64)).expect("delete the old pod");
        let new_keeper = std::mem::replace(&mut self.keeper, old_keeper);
        signal(self.keeper.as_ref().and_then(DeadlineKeeper::pid), libc::SIGTERM);
        let stopped_ns = monotonic_ns();
        self.stop_gracefully(agent, GRACE);
        self.stop_keeper(GRACE);
        self.keeper = new_keeper;
        let _ = self.node.api.delete_pod(AGENT_NAMESPACE, &old);
        if let Some((new, _, _)) = next {
            // Measured from the old agent's exit: both ran until then.
            self.tally.surges += 1;
            return (new, Instant::now(), monotonic_ns());
        }
        self.count_in_flight(stopped_ns);
        self.while_down();
        // The new pod's scheduling, image and start.
        let gap = self.rng.millis(2000);
        self.wait_observing(gap, None);
        self.pod = self.node.daemonset_pod().expect("the new pod");
        self.start_keeper();
        self.tally.rollouts += 1;
        self.restart()
    }
}
