//! The actuators: small pieces that carry out what a pod's state machine decided. Reads of the
//! node (cgroups, bundles, `/proc`) and kernel map updates happen here, at once, and their result
//! is handed straight back; network calls (quits, probes, API writes) run as tasks that report
//! back on the feedback channel.
//!
//! One executor per kind of effect, each owning only what it uses: [`PodCgroups`] (a pod's
//! cgroups and the kernel's watch), [`Releases`] (held apps, pinned and released),
//! [`QuitSender`] (quits, signals, quits armed ahead), [`Probes`] (readiness probes) and
//! [`ApiWrites`] (condition, Events). [`Actuators`] hands each effect to its executor.

pub mod ahead;
mod answer;
mod api_writes;
mod held_conn;
mod held_pace;
mod held_poll;
pub mod held_prober;
mod pod_cgroups;
pub mod probe;
mod quit_sender;
mod records;
pub(crate) mod release;

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use tokio::sync::mpsc;
use tracing::warn;

use crate::api::events::EventSink;
use crate::cgroup::CgroupFs;
use crate::cgroup::created::Creations;
use crate::effect::{Count, Effect, Feedback, Nanos};
use crate::ended_by_valet::EndedByValet;
use crate::kernel::KernelControl;
use crate::metrics::{self, KindLabels, Metrics, QuitLabels, ReasonLabels, ResultLabels};
use crate::pod::state::QuitAhead;
use crate::runtime::RuntimeBundles;
use crate::sidecar::SidecarLink;

pub use api_writes::ApiWrites;
pub use pod_cgroups::PodCgroups;
pub use probe::Probes;
pub use quit_sender::QuitSender;
pub use release::{Releases, held_at_exec};

/// Feedback addressed to one pod (its uid), from a task.
pub type PodFeedback = (String, Feedback);

/// The next multiple of `period` after `elapsed` (on a clock started at 0): where the probe
/// loops and the held pods' prober put their next slot.
fn next_multiple(elapsed: Duration, period: Duration) -> Duration {
    let period_ns = period.as_nanos().max(1);
    let slots = elapsed.as_nanos() / period_ns + 1;
    Duration::from_nanos(u64::try_from(slots.saturating_mul(period_ns)).unwrap_or(u64::MAX))
}

/// What the actuators need to know of the agent's configuration.
#[derive(Clone, Debug)]
pub struct Settings {
    pub host_proc: PathBuf,
    pub quit_timeout: Duration,
    pub quit_retry_for: Duration,
    pub probe_interval: Duration,
    pub ready_probe_interval: Duration,
    /// How often, at most, a held pod's proxy is asked.
    pub held_probe_interval: Duration,
    /// The held pods' prober's CPU, at most, as a share of one core.
    pub held_probe_cpu: f64,
    /// Most probes per second across the held pods on their own loops (no prober).
    pub held_probe_budget: u32,
    /// Held pods are probed by [`held_prober::HeldProber`] (the default), else by their own loops.
    pub held_prober: bool,
    /// The release thread's SCHED_FIFO priority (0: the normal class).
    pub release_priority: u8,
    /// The decision path's (the held pods' prober's, the loop's) SCHED_FIFO priority (0: the
    /// normal class).
    pub decide_priority: u8,
    /// The held pods' prober's SCHED_FIFO priority while the asks a release waits on are out (a
    /// pod handed over, a listen's, a sweep's): the loop's (0: it stays in its class).
    pub urgent_priority: u8,
    /// Where the runtime's records of containers are read first (besides those reached through
    /// the runtime processes found).
    pub record_dirs: Vec<crate::runtime_record::RecordDir>,
    /// Where the kubelet's container log links are read (a container never seen is named there).
    pub log_links: PathBuf,
}

impl Settings {
    /// Settings for loops run without a node (the pod loops' tests): quits of a second, probes
    /// every 20 ms, held pods on their own loops, the release thread in the normal class.
    pub fn quick(host_proc: PathBuf) -> Settings {
        Settings {
            log_links: crate::log_links::default_dir(&host_proc),
            host_proc,
            quit_timeout: Duration::from_secs(1),
            quit_retry_for: Duration::from_secs(1),
            probe_interval: Duration::from_millis(20),
            ready_probe_interval: Duration::from_secs(5),
            held_probe_interval: Duration::from_millis(10),
            held_probe_cpu: 0.03,
            held_probe_budget: 2000,
            held_prober: false,
            release_priority: 0,
            decide_priority: 0,
            urgent_priority: 0,
            record_dirs: Vec::new(),
        }
    }
}

/// What the actuators are made of: the node, the kernel, the sidecars' network, the API, and
/// where they count and report.
pub struct Parts<K, L> {
    pub settings: Settings,
    pub cgroups: CgroupFs,
    pub bundles: RuntimeBundles,
    pub kernel: K,
    pub link: Arc<L>,
    pub client: Client,
    pub events: EventSink,
    pub metrics: Arc<Metrics>,
    /// Where tasks send their feedback.
    pub feedback: mpsc::UnboundedSender<PodFeedback>,
    /// Where each pod a quit or a signal is sent to is recorded (the observer's; anything else keeps it for
    /// no one).
    pub ended_by_valet: Arc<EndedByValet>,
}

/// Everything that acts on the world, for every pod: each effect goes to its executor.
pub struct Actuators<K, L> {
    pod_cgroups: PodCgroups<K>,
    releases: Releases,
    quit_sender: QuitSender<L>,
    probes: Probes<L>,
    api: ApiWrites,
    records: records::Records,
    metrics: Arc<Metrics>,
}

impl<K: KernelControl, L: SidecarLink> Actuators<K, L> {
    pub fn new(parts: Parts<K, L>) -> Actuators<K, L> {
        let Parts { settings, cgroups, bundles, kernel, link, client, events, metrics, feedback, ended_by_valet } =
            parts;
        let ledger = kernel.held_ledger();
        Actuators {
            releases: Releases::new(
                cgroups.clone(),
                settings.host_proc.clone(),
                metrics.clone(),
                ledger,
                settings.release_priority,
            ),
            quit_sender: QuitSender::new(
                link.clone(),
                cgroups.clone(),
                feedback.clone(),
                metrics.clone(),
                ended_by_valet,
                &settings,
            ),
            probes: Probes::new(link, feedback.clone(), &settings),
            records: records::Records::new(settings.host_proc.clone(), settings.record_dirs.clone(), feedback.clone()),
            api: ApiWrites::new(client, events, feedback),
            pod_cgroups: PodCgroups::new(cgroups, bundles, kernel, settings.host_proc)
                .with_log_links(settings.log_links),
            metrics,
        }
    }

    /// The quits armed for the kernel event reader ([`ahead`]).
    pub fn quits_ahead(&self) -> Arc<ahead::QuitsAhead<L>> {
        self.quit_sender.ahead()
    }

    /// Sets pod `uid`'s quit ahead (after each of its transitions; `None` disarms).
    pub fn arm_ahead(&mut self, uid: &str, arm: Option<QuitAhead>) {
        self.quit_sender.arm_ahead(uid, arm);
    }

    /// After a container end's transition: requests sent ahead to the pod that it did not take
    /// over (dropped and counted), how many.
    pub fn unclaimed_ahead(&self, uid: &str) -> usize {
        self.quit_sender.unclaimed_ahead(uid)
    }

    /// Probes held pod `uid`'s proxies at once (a socket started listening there), if the held
    /// pods' prober has it; a pod on its own loop keeps its pace.
    pub fn probe_now(&self, uid: &str) {
        self.probes.probe_now(uid);
    }

    /// New container cgroups in held pods.
    pub fn creations(&mut self) -> &mut Creations {
        self.pod_cgroups.creations()
    }

    pub fn kernel(&mut self) -> &mut K {
        self.pod_cgroups.kernel()
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Keeps the releases of the effects applied from now on, and their probes' pace changes,
    /// until [`Actuators::flush_releases`] (a batch of probe answers: their apps go on together).
    pub fn batch_releases(&mut self) {
        self.releases.keep_batch();
        self.probes.keep_paces();
    }

    /// Sends the releases of the batch decided so far, a chunk at a time (see
    /// [`Releases::send_decided`]).
    pub fn send_decided(&mut self) {
        self.releases.send_decided();
    }

    /// Carries out the releases kept since [`Actuators::batch_releases`], then starts the batch's
    /// other tasks (see [`Releases::flush`]) and makes its pace changes.
    pub fn flush_releases(&mut self) {
        self.releases.flush();
        self.probes.flush_paces();
    }

    /// Returns once every release handed to the release thread is sent (before the agent
    /// exits: no app is left stopped). Releases after this go out from the caller.
    pub fn finish_releases(&mut self) {
        self.releases.finish();
    }

    /// Releases the processes the kernel's record names that no tracked pod will (see
    /// [`Releases::release_orphans`]); how many.
    pub fn release_orphans(&mut self, held: HashSet<u32>, holding_pods: &[String], now: Nanos) -> usize {
        self.releases.release_orphans(held, holding_pods, now)
    }

    /// Whether the kernel's record of held processes is pinned (outlives this agent), or there is
    /// no record to lose (no kernel programs: nothing is ever held).
    pub fn held_record_pinned(&self) -> bool {
        self.releases.held_record_pinned()
    }

    /// Whether the kernel's record names any process.
    pub fn any_held_record(&self) -> bool {
        self.releases.any_held_record()
    }

    /// Pinned processes that exited while held (their pod's state forgot them): their fds go.
    pub fn prune_pinned(&mut self) {
        self.releases.prune_pinned();
    }

    /// Carries out one effect of pod `uid` (`pod`: its latest object, for Events and the
    /// condition). Returns the feedback that is available at once. The one place that says which
    /// part carries out which effect.
    // table: one arm per kind of effect, each handed to its executor
    pub fn apply(&mut self, uid: &str, pod: Option<&Pod>, effect: Effect, now: Nanos) -> Option<Feedback> {
        match effect {
            Effect::FindPodCgroup => self.pod_cgroups.find_pod(uid),
            Effect::ScanContainers { pod_rel, adopt } => {
                Some(Feedback::Containers(self.pod_cgroups.scan(uid, &pod_rel, adopt, &self.releases)))
            }
            Effect::NameEnded { container_cgroup, id } => {
                Some(self.pod_cgroups.name_ended(uid, pod, container_cgroup, &id))
            }
            Effect::FindLeftHeld { pod_rel } => {
                let (found, complete) = self.releases.left_held(&pod_rel, now);
                Some(Feedback::LeftHeld { found, complete })
            }
            Effect::Watch { pod_cgroup, pod_rel, exits, hold, hold_timeout } => {
                // No hold that could outlive this agent unrecorded: without a pinned record a
                // crash would leave the app stopped with no deadline anyone keeps.
                let hold = hold && self.holds_allowed(uid, pod);
                self.pod_cgroups.watch(uid, pod_cgroup, &pod_rel, exits, hold.then_some(hold_timeout));
                None
            }
            Effect::Unwatch { pod_cgroup } => {
                self.pod_cgroups.unwatch(uid, pod_cgroup);
                None
            }
            Effect::ClassifyExec { container_cgroup, hold } => {
                self.pod_cgroups.classify_exec(uid, container_cgroup, hold);
                None
            }
            Effect::ForgetContainer { container_cgroup } => {
                self.pod_cgroups.forget_container(container_cgroup);
                None
            }
            Effect::OpenNetwork { pod_rel } => Some(self.quit_sender.open_network(uid, &pod_rel)),
            Effect::CloseNetwork => {
                self.quit_sender.close_network(uid);
                None
            }
            Effect::Quit { sidecar, instance, endpoint, pod_rel, pod_ip } => {
                self.quit_sender.quit(uid, sidecar, instance, endpoint, pod_rel, pod_ip.as_deref());
                None
            }
            Effect::Signal { sidecar, container_rel, signal } => {
                Some(self.quit_sender.signal(uid, sidecar, &container_rel, signal))
            }
            Effect::StartProbe { sidecars, pod_rel, pod_ip, pace } => {
                self.probes.start(uid, sidecars, pod_rel, pod_ip.as_deref(), pace);
                None
            }
            Effect::SetPace(pace) => {
                self.probes.set_pace(uid, pace);
                None
            }
            Effect::StopProbe => {
                self.probes.stop(uid);
                None
            }
            Effect::Pin { tgid, container_rel } => {
                self.releases.pin(uid, tgid, &container_rel);
                None
            }
            Effect::Release { tgid, container_rel, reason, since } => {
                self.releases.release_one(tgid, container_rel, reason, now.saturating_sub(since));
                None
            }
            Effect::WriteCondition(want) => {
                // Held back while a batch's releases are kept: they go first.
                self.releases.after_releases(self.api.write_condition(uid, pod, want));
                None
            }
            Effect::Publish { warning, reason, action, note } => {
                self.api.publish(pod, warning, reason, action, note);
                None
            }
            Effect::WatchRecord { container_id, pod_rel } => {
                self.records.watch(uid, container_id, self.pod_cgroups.record_dirs(pod_rel.as_deref()));
                None
            }
            Effect::Count(c) => {
                count(&self.metrics, c);
                None
            }
        }
    }

    /// Whether apps may be held: only with the kernel's record of holds pinned (it outlives this
    /// agent, with each hold's deadline). Otherwise the pod's apps run at once, and an Event on
    /// the pod says why.
    fn holds_allowed(&mut self, uid: &str, pod: Option<&Pod>) -> bool {
        if self.pod_cgroups.kernel().held_record_pinned() {
            return true;
        }
        warn!(%uid, "the record of held apps is not pinned (no bpffs): this pod's apps are not held");
        self.metrics.holds_refused.inc();
        self.api.publish(
            pod,
            true,
            "HoldUnavailable",
            "Run",
            "valet cannot pin its record of held apps on this node (no bpffs): the app starts without waiting \
             for its proxy, so that no agent crash can leave it stopped"
                .to_owned(),
        );
        false
    }
}

/// Counts what a pod's state machine asks to be counted (effect `Count`).
fn count(m: &Metrics, count: Count) {
    match count {
        Count::ContainerEnd(end) => {
            let outcome = match end {
                Some(crate::kernel::ProcessEnd::Exited(0)) => metrics::ExitOutcome::Success,
                Some(crate::kernel::ProcessEnd::Signaled { .. }) => metrics::ExitOutcome::Signal,
                _ => metrics::ExitOutcome::Failure,
            };
            m.exits.get_or_create(&metrics::ExitLabels { outcome }).inc();
        }
        Count::Skip(reason) => m.skip(reason),
        Count::Hold => {
            m.holds.inc();
        }
        Count::FailOpen => {
            m.fail_opens.inc();
        }
        Count::Quit { kind, result } => {
            m.quits.get_or_create(&QuitLabels { kind, result }).inc();
        }
        Count::QuitLatency(seconds) => m.quit_latency.observe(seconds),
        Count::Escalation { kind } => {
            m.escalations.get_or_create(&KindLabels { kind }).inc();
        }
        Count::ConditionPatch { ok } => {
            m.condition_patches.get_or_create(&ResultLabels { result: if ok { "ok" } else { "error" } }).inc();
        }
        Count::ApiPath(reason) => {
            m.api_path.get_or_create(&ReasonLabels { reason }).inc();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_next_slot_is_the_next_multiple_of_the_period() {
        let ms = Duration::from_millis;
        assert_eq!(next_multiple(ms(0), ms(10)), ms(10));
        assert_eq!(next_multiple(ms(25), ms(10)), ms(30));
        assert_eq!(next_multiple(ms(30), ms(10)), ms(40), "a slot's own instant is past: the next one");
        assert_eq!(next_multiple(Duration::from_nanos(5), Duration::ZERO), Duration::from_nanos(6));
    }
}
