//! The actuators: small pieces that carry out what a pod's state machine decided. Reads of the
//! node (cgroups, bundles, `/proc`) and kernel map updates happen here, at once, and their result
//! is handed straight back; network calls (quits, probes, API writes) run as tasks that report
//! back on the feedback channel.

pub mod ahead;
mod answer;
pub mod held;
pub mod probe;
mod release;

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use tokio::sync::mpsc;
use tracing::{debug, info, warn};
use valet_common::watch_flags;

use crate::api::condition;
use crate::api::events::{EventSink, pod_reference};
use crate::cgroup::CgroupFs;
use crate::cgroup::created::Creations;
use crate::cgroup::signal::{Pinned, pin_in_cgroup, signal_cgroup};
use crate::effect::{ContainerSeen, Count, Effect, Feedback, LeftHeld, Nanos, Pace, RuntimeName};
use crate::kernel::container_main::main_among;
use crate::kernel::held::HeldLedger;
use crate::kernel::{KernelControl, RecordOutcome};
use crate::metrics::{self, KindLabels, Metrics, QuitLabels, ReasonLabels, ResultLabels};
use crate::pod::state::QuitAhead;
use crate::runtime::{BundleRole, RuntimeBundles, name_of_process};
use crate::sidecar::http::Limits;
use crate::sidecar::quit::{first_attempt, quit};
use crate::sidecar::{Pending, PodTarget, SidecarLink};

use release::Releaser;
pub use release::held_at_exec;

/// Feedback for one pod, from a task.
pub type Report = (String, Feedback);

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
    /// Most probes per second across the pods whose app is held.
    pub held_probe_budget: u32,
    /// Held pods are probed by [`held::HeldProber`] (the default), else by their own loops.
    pub held_prober: bool,
}

/// Everything that acts on the world, for every pod.
pub struct Actuators<K, L> {
    settings: Settings,
    cgroups: CgroupFs,
    bundles: RuntimeBundles,
    kernel: K,
    link: Arc<L>,
    client: Client,
    events: EventSink,
    metrics: Arc<Metrics>,
    reports: mpsc::UnboundedSender<Report>,
    probes: HashMap<String, probe::Handle>,
    probe_reports: Arc<probe::Reports>,
    held_prober: Option<Arc<held::HeldProber>>,
    /// Releases kept for [`Actuators::flush_releases`] while a batch of reports is handled.
    releases: Option<Batch>,
    releaser: Option<Releaser>,
    /// The kernel's record of the processes it stopped (pinned: it outlives this agent).
    ledger: Option<Arc<HeldLedger>>,
    /// Held processes checked and pinned when they were held, by pid: a release is only the
    /// signal (checking a batch of them at release took half a millisecond).
    pinned: HashMap<u32, Pinned>,
    creations: Creations,
    ahead: Arc<ahead::QuitsAhead<L>>,
    /// Each pod's arm as last set in `ahead` (set again only when it changes).
    armed: HashMap<String, QuitAhead>,
}

/// At most this many held processes are pinned ahead (one fd each); more are pinned at release.
const PINNED_MAX: usize = 1024;

/// A release to carry out.
struct Release {
    tgid: u32,
    container_rel: String,
    reason: &'static str,
    held_ns: u64,
}

type PinnedRelease = (Release, Result<Option<Pinned>, String>);

/// What a batch of reports decided: its releases, and the tasks of the same decisions (API
/// writes of the pods' condition), held back until the releases are out so that they do not
/// take the CPUs from them.
#[derive(Default)]
struct Batch {
    releases: Vec<Release>,
    tasks: Vec<Pending<()>>,
}

/// Starts `task` now, or once the releases of the batch kept are out.
fn spawn_after_releases(batch: &mut Option<Batch>, task: Pending<()>) {
    match batch {
        Some(batch) => batch.tasks.push(task),
        None => {
            tokio::spawn(task);
        }
    }
}

impl<K: KernelControl, L: SidecarLink> Actuators<K, L> {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        settings: Settings,
        cgroups: CgroupFs,
        bundles: RuntimeBundles,
        kernel: K,
        link: Arc<L>,
        client: Client,
        events: EventSink,
        metrics: Arc<Metrics>,
        reports: mpsc::UnboundedSender<Report>,
    ) -> Actuators<K, L> {
        let held_prober =
            settings.held_prober.then(|| held::HeldProber::start(link.clone(), reports.clone())).flatten();
        let ahead = Arc::new(ahead::QuitsAhead::new(link.clone(), metrics.clone()));
        let ledger = kernel.held_ledger();
        Actuators {
            settings,
            cgroups,
            bundles,
            kernel,
            link,
            client,
            events,
            metrics: metrics.clone(),
            probe_reports: probe::Reports::new(reports.clone()),
            held_prober,
            reports,
            probes: HashMap::new(),
            releases: None,
            releaser: Releaser::start(metrics.clone(), ledger.clone()),
            ledger,
            pinned: HashMap::new(),
            creations: Creations::new(),
            ahead,
            armed: HashMap::new(),
        }
    }

    /// The quits armed for the kernel event reader ([`ahead`]).
    pub fn quits_ahead(&self) -> Arc<ahead::QuitsAhead<L>> {
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

    /// Probes held pod `uid`'s proxies at once (a socket started listening there), if the held
    /// pods' prober has it; a pod on its own loop keeps its pace.
    pub fn probe_now(&self, uid: &str) {
        if let Some(p) = &self.held_prober {
            p.probe_now(uid);
        }
    }

    /// Spreads the held pods' probes over the budget: their interval follows how many are held.
    fn pace_held_probes(&mut self) {
        let held = self.probes.values().filter(|p| p.pace() == Pace::Urgent).count();
        let interval = self.probe_reports.set_held(held, self.settings.held_probe_budget);
        if let Some(p) = &self.held_prober {
            p.set_interval(interval);
        }
    }

    /// New container cgroups in held pods.
    pub fn creations(&mut self) -> &mut Creations {
        &mut self.creations
    }

    pub fn kernel(&mut self) -> &mut K {
        &mut self.kernel
    }

    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Carries out one effect of pod `uid` (`pod`: its latest object, for Events and the
    /// condition). Returns the feedback that is available at once.
    pub fn apply(&mut self, uid: &str, pod: Option<&Pod>, effect: Effect, now: Nanos) -> Option<Feedback> {
        match effect {
            Effect::FindPodCgroup => {
                self.cgroups.find_pod(uid).map(|dir| Feedback::PodCgroup { rel: dir.rel, id: dir.id })
            }
            Effect::ScanContainers { pod_rel, adopt } => Some(Feedback::Containers(self.scan(uid, &pod_rel, adopt))),
            Effect::FindLeftHeld { pod_rel } => Some(Feedback::LeftHeld(self.left_held(&pod_rel, now))),
            Effect::Watch { pod_cgroup, pod_rel, exits, hold } => {
                let flags = if exits { watch_flags::EXITS } else { 0 } | if hold { watch_flags::HOLD } else { 0 };
                if let Err(e) = self.kernel.watch(pod_cgroup, flags) {
                    warn!(%uid, "register pod cgroup with the kernel: {}", e.chain());
                }
                // Every tracked pod: a container is named when its cgroup appears, not when it
                // ends (the runtime removes cgroup and bundle tens of milliseconds after the end,
                // which a busy agent can miss); in a held pod, before its first exec.
                if let Err(e) = self.creations.watch(pod_cgroup, &self.cgroups.abs(&pod_rel)) {
                    debug!(%uid, ?hold, "new containers are named when the kernel reports them: {e}");
                }
                None
            }
            Effect::Unwatch { pod_cgroup } => {
                self.creations.unwatch(pod_cgroup);
                if let Err(e) = self.kernel.unwatch(pod_cgroup) {
                    debug!(%uid, "unwatch pod cgroup: {}", e.chain());
                }
                None
            }
            Effect::ClassifyExec { container_cgroup, hold } => {
                if let Err(e) = self.kernel.classify_exec(container_cgroup, hold) {
                    debug!(%uid, "classify container cgroup: {}", e.chain());
                }
                None
            }
            Effect::ForgetContainer { container_cgroup } => {
                self.kernel.forget_container(container_cgroup);
                None
            }
            Effect::OpenNetwork { pod_rel } => {
                let opened = self.link.open(uid, &pod_rel);
                Some(Feedback::Network { ok: opened.is_ok(), detail: opened.err().unwrap_or_default() })
            }
            Effect::CloseNetwork => {
                // A quit the event reader sent ahead and no transition took over goes with the
                // network: counted as such.
                self.ahead.unclaimed(uid);
                self.link.close(uid);
                None
            }
            Effect::Quit { sidecar, instance, endpoint, pod_rel } => {
                // For observe mode's tax: this pod's sidecars end because valet acted.
                self.metrics.quit_pods.record(uid);
                let target = PodTarget { uid: uid.to_owned(), pod_rel: Some(pod_rel), pod_ip: None };
                let limits = Limits { total_timeout: self.settings.quit_timeout, ..Limits::default() };
                let (link, reports, retry_for, uid) =
                    (self.link.clone(), self.reports.clone(), self.settings.quit_retry_for, uid.to_owned());
                debug!(%uid, %sidecar, ?instance, "asking sidecar to quit");
                // Started here: on a kept connection the request is on its way before this returns.
                let first = first_attempt(link.as_ref(), &target, &endpoint, limits);
                tokio::spawn(async move {
                    let outcome = quit(link.as_ref(), &target, &endpoint, limits, retry_for, Some(first)).await;
                    let _ = reports.send((uid, Feedback::QuitDone { sidecar, outcome }));
                });
                None
            }
            Effect::Signal { sidecar, container_rel, signal } => {
                let signalled = if self.cgroups.procs_recursive(&container_rel).is_empty() {
                    0
                } else {
                    signal_cgroup(&self.cgroups, &container_rel, signal)
                };
                Some(Feedback::Signalled { sidecar, signal, signalled })
            }
            Effect::StartProbe { sidecars, pod_rel, pod_ip, pace } => {
                let target = PodTarget {
                    uid: uid.to_owned(),
                    pod_rel,
                    pod_ip: pod_ip.as_deref().and_then(|ip| ip.parse::<IpAddr>().ok()),
                };
                let handle = probe::start(
                    self.link.clone(),
                    target,
                    sidecars,
                    pace,
                    (self.settings.probe_interval, self.settings.ready_probe_interval),
                    self.probe_reports.clone(),
                    self.held_prober.clone(),
                );
                self.probes.insert(uid.to_owned(), handle);
                self.pace_held_probes();
                None
            }
            Effect::SetPace(pace) => {
                if let Some(p) = self.probes.get(uid) {
                    p.set_pace(pace);
                }
                self.pace_held_probes();
                None
            }
            Effect::StopProbe => {
                self.probes.remove(uid);
                self.pace_held_probes();
                None
            }
            Effect::Pin { tgid, container_rel } => {
                // Whatever was pinned under this pid before is another process.
                self.pinned.remove(&tgid);
                if self.pinned.len() < PINNED_MAX {
                    match pin_in_cgroup(&self.cgroups, tgid, &container_rel) {
                        Ok(pinned) => {
                            self.pinned.insert(tgid, pinned);
                        }
                        Err(e) => debug!(%uid, "pin held process: {} (checked again at release)", e.chain()),
                    }
                }
                None
            }
            Effect::Release { tgid, container_rel, reason, since } => {
                let release = Release { tgid, container_rel, reason, held_ns: now.saturating_sub(since) };
                match &mut self.releases {
                    Some(batch) => batch.releases.push(release),
                    None => self.release(vec![release], false),
                }
                None
            }
            Effect::WriteCondition(want) => {
                let (client, reports, uid) = (self.client.clone(), self.reports.clone(), uid.to_owned());
                let (namespace, name) = pod.map_or_else(Default::default, |p| {
                    (p.metadata.namespace.clone().unwrap_or_default(), p.metadata.name.clone().unwrap_or_default())
                });
                let write = async move {
                    let error =
                        condition::write(client, &namespace, &name, &want).await.err().map(|e| e.chain().to_string());
                    let _ = reports.send((uid, Feedback::ConditionWritten { want, error }));
                };
                spawn_after_releases(&mut self.releases, Box::pin(write));
                None
            }
            Effect::Publish { warning, reason, action, note } => {
                if let Some(pod) = pod {
                    self.events.publish(pod_reference(pod), warning, reason, action, note);
                }
                None
            }
            Effect::Count(count) => {
                self.count(count);
                None
            }
        }
    }

    /// The pod's container cgroups, named from the runtime's bundles where they exist.
    fn scan(&mut self, uid: &str, pod_rel: &str, adopt: bool) -> Vec<ContainerSeen> {
        let containers: Vec<_> = self
            .cgroups
            .containers(pod_rel)
            .into_iter()
            .map(|c| {
                let procs = self.cgroups.container_procs(&c.rel);
                (c, procs)
            })
            .collect();
        let mut searched = false;
        let mut seen = Vec::with_capacity(containers.len());
        for (i, (c, procs)) in containers.iter().enumerate() {
            // A container already running when its pod was first looked at: tell the kernel
            // which process is its main one (the exec that would have recorded it is past).
            if adopt && !procs.is_empty() && !self.kernel.exec_seen(c.id) {
                self.record_main(uid, &c.rel, c.id);
            }
            let mut role = self.bundles.role(&c.container.id, uid);
            if role.is_none() && !searched {
                // Not where the bundles were looked for: ask the runtime that started the pod,
                // up from this container's processes, then the others' (the sandbox's pause
                // runs as long as the pod).
                searched = true;
                let pod_procs: HashSet<u32> = containers.iter().flat_map(|(_, p)| p.iter().copied()).collect();
                let starts: Vec<u32> = procs
                    .iter()
                    .copied()
                    .chain(
                        containers
                            .iter()
                            .enumerate()
                            .filter(|(j, _)| *j != i)
                            .filter_map(|(_, (_, p))| p.first().copied()),
                    )
                    .collect();
                if self.bundles.find_runtime(&starts, &pod_procs) {
                    role = self.bundles.role(&c.container.id, uid);
                }
            }
            // The runtime's bundle first; else the kubelet's per-container mount, as a process
            // of the container sees it.
            let runtime_name = role
                .map(|role| match role {
                    BundleRole::Sandbox => RuntimeName::Sandbox,
                    BundleRole::Container(name) => RuntimeName::Container(name),
                })
                .or_else(|| {
                    procs
                        .iter()
                        .find_map(|pid| name_of_process(&self.settings.host_proc, *pid, uid))
                        .map(RuntimeName::Container)
                });
            let exec_done = self.kernel.exec_seen(c.id)
                || procs.iter().any(|pid| held_at_exec(&self.settings.host_proc, *pid))
                || self.recorded_held(&c.rel).next().is_some();
            seen.push(ContainerSeen {
                cgroup_id: c.id,
                rel: c.rel.clone(),
                id: c.container.id.clone(),
                runtime_name,
                exec_done,
                live: !procs.is_empty(),
            });
        }
        seen
    }

    fn record_main(&mut self, uid: &str, rel: &str, cgroup_id: u64) {
        // The whole subtree: a main process may have moved below the container's cgroup (a
        // nested runtime's), and its processes' pid namespaces tell the main one apart.
        let pids = self.cgroups.procs_recursive(rel);
        let Some(main) = main_among(&self.settings.host_proc, &pids) else { return };
        match self.kernel.record_container_main(cgroup_id, &main) {
            Ok(RecordOutcome::MapFull) => {
                warn!(%uid, cgroup = %rel, "the kernel's container map is full: this container's end is seen by the API only");
            }
            Ok(_) => debug!(%uid, cgroup = %rel, pid = main.tgid, "recorded a running container's main process"),
            Err(e) => debug!(%uid, "record container main: {}", e.chain()),
        }
    }

    fn count(&self, count: Count) {
        let m = &self.metrics;
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
        }
    }
}

#[cfg(test)]
mod tests {
    use super::release::*;
    use super::*;

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
    fn the_next_slot_is_the_next_multiple_of_the_period() {
        let ms = Duration::from_millis;
        assert_eq!(next_multiple(ms(0), ms(10)), ms(10));
        assert_eq!(next_multiple(ms(25), ms(10)), ms(30));
        assert_eq!(next_multiple(ms(30), ms(10)), ms(40), "a slot's own instant is past: the next one");
        assert_eq!(next_multiple(Duration::from_nanos(5), Duration::ZERO), Duration::from_nanos(6));
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
        // SAFETY: as above.
        let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as u64;
        let since = stopped_since(&dir, 42, u64::MAX);
        let missing = stopped_since(&dir, 43, 7);
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(since, 500 * 1_000_000_000 / ticks);
        assert_eq!(missing, 7, "unknown start: now");
    }

    fn stopped_child() -> std::process::Child {
        let child = std::process::Command::new("sleep").arg("30").spawn().expect("spawn sleep");
        // SAFETY: plain syscall to our own child.
        unsafe { libc::kill(child.id() as i32, libc::SIGSTOP) };
        let deadline = std::time::Instant::now() + HANG_GUARD;
        while !process_stopped(Path::new("/proc"), child.id()) {
            assert!(std::time::Instant::now() < deadline, "child {} never stopped", child.id());
            std::thread::sleep(Duration::from_millis(5));
        }
        child
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
            .map(|pid| {
                let pin = pin_in_cgroup(&cgroups, pid, rel).map(Some).map_err(|e| e.chain().to_string());
                (release(pid), pin)
            })
            .collect();
        let metrics = Arc::new(Metrics::new());
        let releaser = Releaser::start(metrics.clone(), None).expect("release thread");
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
}
