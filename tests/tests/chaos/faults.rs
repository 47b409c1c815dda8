//! Faults of crash test v3 that are not stops: reads of a held app's cgroup failing for a
//! while, and a held app's pid reused by the next held app.
use valet_tests::unreadable::Unreadable;

use super::*;

impl Chaos<'_> {
    /// A held app: one of the population's, or one made now (placed, holding, proxy not ready).
    fn held_app(&mut self) -> Option<usize> {
        let held = |p: &Pod| !p.deleted && !p.failed && p.app.is_some_and(|pid| state(pid) == Some('T'));
        if let Some(i) = (0..self.pods.len()).find(|&i| held(&self.pods[i])) {
            return Some(i);
        }
        let i = *self.placed_unstarted(|p| p.hold && !p.ready).first()?;
        self.start_app(i);
        let pid = self.pods[i].app;
        eventually(GUARD, || pid.is_some_and(|p| state(p) == Some('T')) || self.pods[i].app_ran());
        held(&self.pods[i]).then_some(i)
    }

    /// Reads of held apps' cgroups fail for 0.2–1 s: one or two held apps' cgroups made
    /// unreadable, their proxies turning ready meanwhile (a release falls due while the
    /// membership check cannot be made) half the time, the agent SIGKILLed and restarted during
    /// it (its adoption reads them) half the time. Returns the moment the fault ended: the
    /// apps that must run are judged from there.
    pub(crate) fn read_fault(&mut self, agent: &mut Agent) -> (Instant, u64) {
        self.tally.read_faults += 1;
        let mut faulted = Vec::new();
        for _ in 0..1 + self.rng.below(2) {
            let Some(i) = self.held_app() else { break };
            let pid = self.pods[i].app.expect("held");
            if faulted.iter().any(|(j, _)| *j == i) {
                break;
            }
            if let Some(u) = Unreadable::make(&self.cgroup_root, pid) {
                faulted.push((i, u));
            }
        }
        self.tally.read_faulted_apps += faulted.len();
        for (i, _) in &faulted {
            self.pods[*i].read_faulted = true;
            if self.rng.chance(50) {
                self.pods[*i].make_ready();
                self.tally.read_fault_releases_due += 1;
            }
        }
        let length = Duration::from_millis(200) + self.rng.millis(800);
        let until = Instant::now() + length;
        if self.rng.chance(50) {
            let killed_ns = monotonic_ns();
            agent.stop(libc::SIGKILL, GUARD).expect("kill the agent");
            self.count_in_flight(killed_ns);
            self.tally.read_fault_restarts += 1;
            *agent = self.restart().0;
        }
        self.wait_observing(until.saturating_duration_since(Instant::now()), Some(agent));
        for (_, u) in faulted {
            u.restore();
        }
        (Instant::now(), monotonic_ns())
    }

    /// Pid reuse between passes: a held app's pod is deleted and its app killed (the kubelet
    /// kills a deleted pod's containers), and the next app of a holding pod is started at once
    /// with that host pid (`ns_last_pid` set right before its fork): the kernel records the new
    /// hold under the pid whose old record a pass may be deciding on. The new app must stay
    /// held with its record until its proxy is ready.
    pub(crate) fn pid_reuse(&mut self) {
        self.tally.pid_reuses_tried += 1;
        let Some(a) = self.held_app() else { return };
        let Some(&b) = self.placed_unstarted(|p| p.hold && !p.ready).iter().find(|&&b| b != a) else { return };
        let pid = self.pods[a].app.expect("held");
        let pod = &mut self.pods[a];
        pod.allow_release();
        let _ = self.node.api.delete_pod("jobs", pod.name());
        pod.deleted = true;
        // Its pid is the next app's from now on: nothing more is judged of this one. Killed, it
        // has ended: a quit from now on is not early.
        pod.app = None;
        pod.ended_ns = Some(monotonic_ns());
        signal(Some(pid), libc::SIGKILL);
        // Reaped by its parent (the pod's valet-sim-exec, as a shim reaps a container's init).
        eventually(GUARD, || !Path::new(&format!("/proc/{pid}")).exists());
        let old_record = record(self.node.pin_dir(), pid).is_some();
        self.start_app_as(b, Some(pid));
        if self.pods[b].app == Some(pid) {
            self.tally.pids_reused += 1;
            self.tally.reused_over_old_record += usize::from(old_record);
        }
        let (app, ran) = (self.pods[b].app, self.pods[b].ran.clone());
        eventually(GUARD, || app.is_some_and(|p| state(p) == Some('T')) || ran.exists());
    }
}
