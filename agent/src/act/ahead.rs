//! Quits sent ahead: the moment the kernel event reader decodes the end of a pod's last running
//! app, it sends the quit the pod's state machine has already said that end would call for, on
//! the connection kept to the sidecar's quit endpoint. The event then goes to the loop as usual;
//! its transition decides the same quit, and the request to send it takes over the connection
//! with the request already written, and reads the answer.
//!
//! Why: on a busy node the loop may be in the middle of something else when an app ends (a watch
//! event, another pod's transition), and getting the event to it is one more thread to wake.
//! The reader thread blocks on the ring buffer alone, so the quit costs one wake-up after the
//! exit, as the in-pod wrapper's does.
//!
//! Safety of the shortcut: an arm is what [`PodState::quit_ahead`] returns after the pod's last
//! transition, for one container of one watched pod cgroup, and is replaced after every
//! transition of that pod (after a batch of probe reports, once the batch's releases are out).
//! It fires only for an end reported under that same pod cgroup and
//! container cgroup, and only once. If the loop's transition then does not quit (the pod changed
//! between the arm and the end: it was deleted, opted out), the request sent ahead is counted
//! `unclaimed` (and logged, when the end's transition finds it).
//!
//! [`PodState::quit_ahead`]: crate::pod::state::PodState::quit_ahead

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use tracing::debug;

use crate::kernel::ring::OnExit;
use crate::kernel::{ProcessEnd, ProcessExit};
use crate::metrics::{Metrics, ResultLabels};
use crate::pod::state::QuitAhead;
use crate::sidecar::SidecarLink;

/// The armed quits, by the container cgroup whose end fires them.
pub struct QuitsAhead<L> {
    link: Arc<L>,
    metrics: Arc<Metrics>,
    arms: Mutex<HashMap<u64, QuitAhead>>,
}

impl<L: SidecarLink> QuitsAhead<L> {
    pub fn new(link: Arc<L>, metrics: Arc<Metrics>) -> QuitsAhead<L> {
        QuitsAhead { link, metrics, arms: Mutex::new(HashMap::new()) }
    }

    /// Replaces pod `uid`'s arm (`None`: disarms it).
    pub fn set(&self, uid: &str, arm: Option<QuitAhead>) {
        let mut arms = self.arms.lock().unwrap_or_else(PoisonError::into_inner);
        arms.retain(|_, a| a.uid != uid);
        if let Some(arm) = arm {
            arms.insert(arm.container_cgroup, arm);
        }
    }

    /// How many arms are set (all pods).
    pub fn armed(&self) -> usize {
        self.arms.lock().unwrap_or_else(PoisonError::into_inner).len()
    }

    /// Sends the quits armed for this end, if any; how many went out.
    pub fn fire(&self, exit: &ProcessExit) -> usize {
        let arm = {
            let mut arms = self.arms.lock().unwrap_or_else(PoisonError::into_inner);
            match arms.get(&exit.cgroup_id) {
                // Not a child the kernel took for the main process (see `QuitAhead::init_only`).
                Some(a) if a.pod_cgroup == exit.watched_cgroup_id && (exit.ns_init || !a.init_only) => {
                    arms.remove(&exit.cgroup_id)
                }
                _ => None,
            }
        };
        let Some(arm) = arm else { return 0 };
        let success = matches!(exit.end, Some(ProcessEnd::Exited(0)));
        let endpoints = if success { &arm.on_success } else { &arm.on_failure };
        let sent = endpoints.iter().filter(|e| self.link.send_ahead(&arm.uid, e.port, &e.path)).count();
        if sent > 0 {
            self.metrics.quits_ahead.get_or_create(&ResultLabels { result: "sent" }).inc_by(sent as u64);
        }
        debug!(uid = %arm.uid, pid = exit.tgid, sent, "quit sent ahead from the kernel event");
        sent
    }

    /// Requests sent ahead for pod `uid` that no quit took over (how many; dropped and counted).
    /// Called after the loop's transition for the very end they were sent for (not after another
    /// end of the pod handled before it, read in the same batch), and when the pod's network is
    /// closed.
    pub fn unclaimed(&self, uid: &str) -> usize {
        let n = self.link.drop_sent_ahead(uid);
        if n > 0 {
            self.metrics.quits_ahead.get_or_create(&ResultLabels { result: "unclaimed" }).inc_by(n as u64);
        }
        n
    }
}

impl<L: SidecarLink> OnExit for QuitsAhead<L> {
    fn on_exit(&self, exit: &ProcessExit) -> usize {
        self.fire(exit)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;

    use super::*;
    use crate::pod::spec::Endpoint;
    use crate::sidecar::testing::TestLink;

    fn arm(uid: &str, pod_cgroup: u64, container_cgroup: u64, on_failure: bool) -> QuitAhead {
        let istio = vec![Endpoint { port: 15020, path: "/quitquitquit".into() }];
        QuitAhead {
            uid: uid.into(),
            pod_rel: format!("/kubepods/pod{uid}"),
            pod_cgroup,
            container_cgroup,
            on_success: istio.clone(),
            on_failure: if on_failure { istio } else { Vec::new() },
            init_only: true,
        }
    }

    fn end(pod_cgroup: u64, container_cgroup: u64, end: Option<ProcessEnd>) -> ProcessExit {
        ProcessExit::of_container_main(pod_cgroup, container_cgroup, end, 1)
    }

    fn sent_total(metrics: &Metrics, result: &'static str) -> u64 {
        metrics.quits_ahead.get_or_create(&ResultLabels { result }).get()
    }

    #[test]
    fn an_arm_fires_once_for_its_own_container_of_its_own_pod() {
        let link = Arc::new(TestLink::default());
        let metrics = Arc::new(Metrics::new());
        let ahead = QuitsAhead::new(link.clone(), metrics.clone());
        ahead.set("a", Some(arm("a", 10, 11, true)));
        ahead.set("b", Some(arm("b", 20, 21, false)));
        assert_eq!(ahead.armed(), 2);
        let ok = Some(ProcessEnd::Exited(0));
        // Another container of the pod, the same container id under another pod cgroup: nothing.
        assert_eq!(ahead.fire(&end(10, 12, ok)), 0);
        assert_eq!(ahead.fire(&end(20, 11, ok)), 0);
        // Its own end: the quit goes, once.
        assert_eq!(ahead.fire(&end(10, 11, ok)), 1);
        assert_eq!(ahead.fire(&end(10, 11, ok)), 0, "once");
        // Pod b quits only on success: a failure leaves it to the loop (the kubelet restarts it).
        assert_eq!(ahead.fire(&end(20, 21, Some(ProcessEnd::Exited(3)))), 0);
        let sent = link.sent_ahead.lock().unwrap_or_else(PoisonError::into_inner).clone();
        assert_eq!(sent, [("a".to_owned(), 15020, "/quitquitquit".to_owned())]);
        assert_eq!(sent_total(&metrics, "sent"), 1);
        assert_eq!(ahead.armed(), 0);
    }

    #[test]
    fn a_signal_or_an_unknown_code_is_a_failure_and_a_new_arm_replaces_the_old() {
        let link = Arc::new(TestLink::default());
        let ahead = QuitsAhead::new(link.clone(), Arc::new(Metrics::new()));
        for e in [Some(ProcessEnd::Signaled { signal: 9, core_dumped: false }), None, Some(ProcessEnd::Exited(1))] {
            ahead.set("b", Some(arm("b", 20, 21, false)));
            assert_eq!(ahead.fire(&end(20, 21, e)), 0, "{e:?}");
        }
        // The restarted app's container replaces the old one; disarming leaves nothing.
        ahead.set("b", Some(arm("b", 20, 21, false)));
        ahead.set("b", Some(arm("b", 20, 22, false)));
        assert_eq!(ahead.armed(), 1);
        assert_eq!(ahead.fire(&end(20, 21, Some(ProcessEnd::Exited(0)))), 0, "the old container");
        ahead.set("b", None);
        assert_eq!(ahead.fire(&end(20, 22, Some(ProcessEnd::Exited(0)))), 0, "disarmed");
        assert!(link.sent_ahead.lock().unwrap_or_else(PoisonError::into_inner).is_empty());
    }

    #[test]
    fn a_child_the_kernel_took_for_the_main_process_fires_only_where_the_pod_shares_its_pid_namespace() {
        let link = Arc::new(TestLink::default());
        let ahead = QuitsAhead::new(link.clone(), Arc::new(Metrics::new()));
        let ok = Some(ProcessEnd::Exited(0));
        let child = |pod, container| ProcessExit { ns_pid: 7, ns_init: false, ..end(pod, container, ok) };
        // Its own pid namespace: the child's end is not the container's; the init's is.
        ahead.set("a", Some(arm("a", 10, 11, true)));
        assert_eq!(ahead.fire(&child(10, 11)), 0, "a child's exit sent the quit ahead");
        assert_eq!(ahead.armed(), 1, "still armed for the init's exit");
        assert_eq!(ahead.fire(&end(10, 11, ok)), 1);
        // shareProcessNamespace: the main process is never pid 1 there.
        ahead.set("b", Some(QuitAhead { init_only: false, ..arm("b", 20, 21, true) }));
        assert_eq!(ahead.fire(&child(20, 21)), 1);
    }

    #[test]
    fn requests_no_quit_took_over_are_counted_unclaimed() {
        let link = Arc::new(TestLink::default());
        let metrics = Arc::new(Metrics::new());
        let ahead = QuitsAhead::new(link.clone(), metrics.clone());
        assert_eq!(ahead.unclaimed("a"), 0);
        link.unclaimed.store(2, Ordering::SeqCst);
        assert_eq!(ahead.unclaimed("a"), 2);
        assert_eq!(sent_total(&metrics, "unclaimed"), 2);
    }
}
