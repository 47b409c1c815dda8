//! Quitting sidecars: the pod's network opened for its requests, each quit request sent (or
//! taken over from the one sent ahead), a signal where a sidecar has no quit endpoint, and the
//! quits armed for the kernel event reader ([`ahead`](super::ahead)).

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::mpsc;
use tracing::debug;

use super::ahead::QuitsAhead;
use super::{PodFeedback, Settings};
use crate::cgroup::CgroupFs;
use crate::cgroup::signal::signal_cgroup;
use crate::effect::Feedback;
use crate::ended_by_valet::EndedByValet;
use crate::metrics::Metrics;
use crate::pod::state::QuitAhead;
use crate::sidecar::http::Limits;
use crate::sidecar::quit_request::{first_attempt, quit};
use crate::sidecar::{PodTarget, SidecarLink};
use crate::vocab::Endpoint;

/// Sends the quits and signals that end every pod's sidecars (effects `OpenNetwork`,
/// `CloseNetwork`, `Quit`, `Signal`), and arms quits for the kernel event reader.
pub struct QuitSender<L> {
    link: Arc<L>,
    /// For the sidecars quit by a signal.
    cgroups: CgroupFs,
    /// Where each quit's outcome goes.
    reports: mpsc::UnboundedSender<PodFeedback>,
    /// One quit request's time limit.
    timeout: Duration,
    /// How long a quit is tried again.
    retry_for: Duration,
    ahead: Arc<QuitsAhead<L>>,
    /// Each pod's arm as last set in `ahead` (set again only when it changes).
    armed: HashMap<String, QuitAhead>,
    /// The pods a quit or a signal was sent to, for observe mode.
    ended_by_valet: Arc<EndedByValet>,
}

impl<L: SidecarLink> QuitSender<L> {
    /// Each pod a quit or a signal is sent to is recorded in `ended_by_valet` (the observer's).
    pub fn new(
        link: Arc<L>,
        cgroups: CgroupFs,
        reports: mpsc::UnboundedSender<PodFeedback>,
        metrics: Arc<Metrics>,
        ended_by_valet: Arc<EndedByValet>,
        settings: &Settings,
    ) -> QuitSender<L> {
        QuitSender {
            ahead: Arc::new(QuitsAhead::new(link.clone(), metrics)),
            link,
            cgroups,
            reports,
            timeout: settings.quit_timeout,
            retry_for: settings.quit_retry_for,
            armed: HashMap::new(),
            ended_by_valet,
        }
    }

    /// The quits armed for the kernel event reader ([`ahead`](super::ahead)).
    pub fn ahead(&self) -> Arc<QuitsAhead<L>> {
        self.ahead.clone()
    }

    /// Sets pod `uid`'s quit ahead (after each of its transitions; `None` disarms).
    pub fn arm_ahead(&mut self, uid: &str, arm: Option<QuitAhead>) {
        if self.armed.get(uid) == arm.as_ref() {
            return;
        }
        match &arm {
            Some(a) => self.armed.insert(uid.to_owned(), a.clone()),
            None => self.armed.remove(uid),
        };
        self.ahead.set(uid, arm);
    }

    /// After a container end's transition: requests sent ahead to the pod that it did not take
    /// over (dropped and counted), how many.
    pub fn unclaimed_ahead(&self, uid: &str) -> usize {
        self.ahead.unclaimed(uid)
    }

    /// Opens pod `uid`'s network for its quits and probes (effect `OpenNetwork`).
    pub fn open_network(&self, uid: &str, pod_rel: &str) -> Feedback {
        let opened = self.link.open(uid, pod_rel);
        Feedback::Network { ok: opened.is_ok(), detail: opened.err().unwrap_or_default() }
    }

    /// Closes pod `uid`'s network (effect `CloseNetwork`).
    pub fn close_network(&self, uid: &str) {
        // A quit the event reader sent ahead and no transition took over goes with the
        // network: counted as such.
        self.ahead.unclaimed(uid);
        self.link.close(uid);
    }

    /// Asks `sidecar` of pod `uid` to quit at `endpoint` (effect `Quit`); the outcome is
    /// reported.
    pub fn quit(
        &self,
        uid: &str,
        sidecar: String,
        instance: Option<String>,
        endpoint: Endpoint,
        pod_rel: String,
        pod_ip: Option<&str>,
    ) {
        // For observe mode's tax: this pod's sidecars end because valet acted.
        self.ended_by_valet.record(uid);
        // A sandboxed pod's quit goes to its IP (no pod cgroup to enter: see `quit`).
        let target = match pod_ip.and_then(|ip| ip.parse::<IpAddr>().ok()) {
            Some(ip) => PodTarget { uid: uid.to_owned(), pod_rel: None, pod_ip: Some(ip) },
            None => PodTarget { uid: uid.to_owned(), pod_rel: Some(pod_rel), pod_ip: None },
        };
        let limits = Limits { total_timeout: self.timeout, ..Limits::default() };
        let (link, reports, retry_for, uid) = (self.link.clone(), self.reports.clone(), self.retry_for, uid.to_owned());
        debug!(%uid, %sidecar, ?instance, "asking sidecar to quit");
        // Started here: on a kept connection the request is on its way before this returns.
        let first = first_attempt(link.as_ref(), &target, &endpoint, limits);
        tokio::spawn(async move {
            let outcome = quit(link.as_ref(), &target, &endpoint, limits, retry_for, Some(first)).await;
            let _ = reports.send((uid, Feedback::QuitDone { sidecar, outcome }));
        });
    }

    /// Sends `signal` to the processes of `sidecar`'s container cgroup in pod `uid` (effect
    /// `Signal`).
    pub fn signal(&self, uid: &str, sidecar: String, container_rel: &str, signal: i32) -> Feedback {
        let signalled = if self.cgroups.procs_recursive(container_rel).is_empty() {
            0
        } else {
            signal_cgroup(&self.cgroups, container_rel, signal)
        };
        // For observe mode's tax, as a quit: a signal that reached the sidecar is valet acting
        // (a helper whose quit is a signal, or an escalation). One that reached no process found
        // the sidecar already gone: something else ended it.
        if signalled > 0 {
            self.ended_by_valet.record(uid);
        }
        Feedback::Signalled { sidecar, signal, signalled }
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::process::ExitStatusExt as _;

    use super::*;
    use crate::sidecar::testing::TestLink;

    fn settings() -> Settings {
        Settings::quick("/proc".into())
    }

    #[test]
    fn a_sidecar_quit_by_a_signal_is_recorded_as_acted_on() {
        // A helper's container cgroup (a tree of plain files: membership is read from
        // cgroup.procs) holding one process, and an empty one whose helper has already ended.
        let dir = std::env::temp_dir().join(format!("valet-quits-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let (rel, gone_rel) = ("/kubepods/pod1/logs", "/kubepods/pod2/logs");
        std::fs::create_dir_all(dir.join("kubepods/pod1/logs")).expect("mkdir");
        std::fs::create_dir_all(dir.join("kubepods/pod2/logs")).expect("mkdir");
        let mut helper = std::process::Command::new("sleep").arg("30").spawn().expect("spawn sleep");
        std::fs::write(dir.join("kubepods/pod1/logs/cgroup.procs"), format!("{}\n", helper.id())).expect("procs");
        std::fs::write(dir.join("kubepods/pod2/logs/cgroup.procs"), "").expect("procs");
        let ended_by_valet = Arc::new(EndedByValet::default());
        ended_by_valet.start();
        let (reports, _keep) = mpsc::unbounded_channel();
        let sender = QuitSender::new(
            Arc::new(TestLink::default()),
            CgroupFs::new(&dir),
            reports,
            Arc::new(Metrics::new()),
            ended_by_valet.clone(),
            &settings(),
        );

        let signalled = sender.signal("pod1", "logs".into(), rel, libc::SIGTERM);
        let status = helper.wait().expect("wait");
        let gone = sender.signal("pod2", "logs".into(), gone_rel, libc::SIGTERM);
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(status.signal(), Some(libc::SIGTERM), "the helper got the signal");
        assert!(matches!(signalled, Feedback::Signalled { signalled: 1, .. }), "{signalled:?}");
        assert!(ended_by_valet.contains("pod1"), "valet ended the helper: acted");
        assert!(matches!(gone, Feedback::Signalled { signalled: 0, .. }), "{gone:?}");
        assert!(!ended_by_valet.contains("pod2"), "a signal that reached no one is not valet acting");
    }
}
