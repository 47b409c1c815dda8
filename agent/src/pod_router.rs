//! The agent's event loop, the pod router. It only routes: kernel events, pod watch events, actuator feedback
//! and a timer come in; each is turned into a transition of one pod's state machine
//! (`pod::state`), found by uid or cgroup id; the effects the transition returns go to the
//! actuators (`act`), whose immediate results are fed straight back.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use futures::{Stream, StreamExt as _};
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::watcher;
use tokio::sync::mpsc;
use tracing::{debug, info, warn};
use valet_common::Counter;

use crate::act::{Actuators, PodFeedback};
use crate::api::successor::{Stop, Uninstall};
use crate::api::watch::{Relist, opted_in};
use crate::effect::{Effect, ExitSeen, Feedback, HeldSeen, Nanos};
use crate::host::clock::monotonic_ns;
use crate::kernel::{Event, EventSource, HeldProcess, KernelControl, Listening, ProcessExit};
use crate::pod::state::{PodState, Rules};
use crate::pod::status::pod_name;
use crate::server::Health;
use crate::sidecar::SidecarLink;

/// How often deadlines are checked and missing cgroups looked for.
const TICK: Duration = Duration::from_millis(250);
/// The kernel's record of held processes is checked for orphans every this many ticks (while
/// it names any): a pod that stops holding its apps releases those it knows, this releases the
/// rest within a second. The pinned fds of apps that exited while held are dropped as often.
const SWEEP_TICKS: u32 = 4;
/// A tick this much later than the one before means the agent did not run meanwhile (stopped,
/// throttled, its node suspended): every pod is looked at again for ends no event reported.
const STALL: Duration = Duration::from_secs(1);
/// Most reports handled in one turn of the loop once one has arrived (the rest waits a turn: a
/// kernel batch or a watch event is never starved by a flood of reports). A full node's round of
/// probe answers is decided in one turn and its releases go out together: at 64, the loop
/// decided the rest of 110 while the apps released first took the CPUs.
const REPORT_BATCH: usize = 256;

/// The running agent: every tracked pod's state, and the actuators.
pub struct PodRouter<K, L> {
    node: String,
    rules: Rules,
    pods: HashMap<String, PodState>,
    /// Watched pod cgroup id → pod uid.
    by_cgroup: HashMap<u64, String>,
    act: Actuators<K, L>,
    reports: mpsc::UnboundedReceiver<PodFeedback>,
    health: Arc<Health>,
    /// Pods seen during a re-list, to drop the ones that vanished meanwhile.
    relist: Relist,
    /// A watch error was counted and its re-list is still to come (one restart, counted once).
    watch_error_counted: bool,
    lists_done: u64,
    events_lost_seen: u64,
    map_full_seen: u64,
    /// Ticks since the kernel's record of held processes was last swept for orphans.
    ticks_since_sweep: u32,
    /// When the last tick ran (monotonic ns).
    last_tick: Option<u64>,
    /// While a batch of reports is decided: the pods whose quit ahead is armed anew once its
    /// releases are out ([`PodRouter::arm_batch`]).
    arms_due: Option<Vec<String>>,
}

impl<K: KernelControl, L: SidecarLink> PodRouter<K, L> {
    pub fn new(
        node: &str,
        rules: Rules,
        act: Actuators<K, L>,
        reports: mpsc::UnboundedReceiver<PodFeedback>,
        health: Arc<Health>,
    ) -> PodRouter<K, L> {
        PodRouter {
            node: node.to_owned(),
            rules,
            pods: HashMap::new(),
            by_cgroup: HashMap::new(),
            act,
            reports,
            health,
            relist: Relist::default(),
            watch_error_counted: false,
            lists_done: 0,
            events_lost_seen: 0,
            map_full_seen: 0,
            ticks_since_sweep: 0,
            last_tick: None,
            arms_due: None,
        }
    }

    /// Runs until `shutdown` resolves or the watch ends; then, unless `shutdown` says a
    /// successor takes the holds over (or the API could not say), releases every held app; and
    /// lets in-flight quits finish (bounded by `drain`). Returns what was done with the holds.
    /// `shutdown` is polled with the other inputs: while it looks up whether a successor will
    /// come, the agent goes on releasing at readiness and quitting. No input can starve another:
    /// the select is fair and a kernel batch is bounded.
    pub async fn run(
        mut self,
        mut kernel: impl EventSource,
        watch: impl Stream<Item = Result<watcher::Event<Pod>, watcher::Error>>,
        shutdown: impl Future<Output = Stop>,
        drain: Duration,
    ) -> Stop {
        let mut watch = std::pin::pin!(watch);
        let mut shutdown = std::pin::pin!(shutdown);
        let mut tick = tokio::time::interval(TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        self.health.programs_attached.store(true, Ordering::Relaxed);
        if !self.act.held_record_pinned() && matches!(self.rules.mode, crate::vocab::NodeMode::Kernel) {
            warn!(
                "the record of held apps is not pinned: no app is held on this node (a hold no successor could find might outlive its deadline); each pod that asks gets a HoldUnavailable Event"
            );
        }
        let stop = loop {
            self.health.turned(monotonic_ns());
            tokio::select! {
                stop = &mut shutdown => break stop,
                batch = kernel.next_batch() => match batch {
                    Ok(batch) => for event in batch { self.on_kernel(event) },
                    Err(e) => { warn!("kernel event stream: {}", e.chain()); tokio::time::sleep(Duration::from_millis(100)).await; }
                },
                Some((uid, feedback)) = self.reports.recv() => {
                    // Whatever else has come in: one slot's probes answer together, and their
                    // releases go out together, back to back as they are decided (a chunk at a
                    // time while this thread is in the real-time class, else once all are),
                    // rather than each after another turn of the select (a watch event to parse,
                    // a kernel batch).
                    self.act.batch_releases();
                    self.arms_due = Some(Vec::new());
                    self.on_feedback(&uid, feedback);
                    for _ in 0..REPORT_BATCH {
                        let Ok((uid, feedback)) = self.reports.try_recv() else { break };
                        self.on_feedback(&uid, feedback);
                        self.act.send_decided();
                    }
                    self.act.flush_releases();
                    self.arm_batch();
                }
                pods = self.act.creations().next() => for pod in pods { self.on_container_made(pod) },
                event = watch.next() => match event {
                    Some(Ok(event)) => self.on_watch(event),
                    Some(Err(e)) => {
                        if !self.watch_error_counted {
                            self.act.metrics().watch_restarts.inc();
                            self.watch_error_counted = true;
                        }
                        warn!("pod watch: {e} (retrying)");
                    }
                    None => { warn!("pod watch ended"); break Stop::Release(Uninstall::WatchEnded); }
                },
                _ = tick.tick() => self.on_tick(),
            }
        };
        self.shutdown(&stop, drain).await;
        stop
    }

    async fn shutdown(&mut self, stop: &Stop, drain: Duration) {
        // Releases already decided go out either way.
        self.act.finish_releases();
        if stop.releases() {
            info!("shutting down: releasing held apps and finishing in-flight quits");
            let uids: Vec<String> = self.pods.keys().cloned().collect();
            for uid in &uids {
                let fx = self.pods.get_mut(uid).map(PodState::shutdown).unwrap_or_default();
                self.apply(uid, fx);
            }
        } else {
            // The held apps stay stopped in the pinned record, for a successor to take over as
            // after a crash (and for the deadline keeper meanwhile).
            let held: usize = self.pods.values().map(|s| s.held_pids().count()).sum();
            info!(held, verdict = stop.verdict(), "shutting down: leaving held apps pinned, finishing in-flight quits");
        }
        let deadline = Instant::now() + drain;
        while self.pods.values().any(PodState::quit_in_flight) {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, self.reports.recv()).await {
                Ok(Some((uid, feedback))) => self.on_feedback(&uid, feedback),
                _ => break,
            }
        }
        self.act.kernel().detach();
    }

    /// Hands effects to the actuators; what they answer at once goes back to the pod.
    fn apply(&mut self, uid: &str, effects: Vec<Effect>) {
        let mut queue = VecDeque::from(effects);
        while let Some(effect) = queue.pop_front() {
            match &effect {
                Effect::Watch { pod_cgroup, .. } => {
                    self.by_cgroup.insert(*pod_cgroup, uid.to_owned());
                }
                Effect::Unwatch { pod_cgroup } => {
                    self.by_cgroup.remove(pod_cgroup);
                }
                _ => {}
            }
            let now = monotonic_ns();
            let pod = self.pods.get(uid).and_then(PodState::pod);
            let Some(feedback) = self.act.apply(uid, pod, effect, now) else { continue };
            if let Some(state) = self.pods.get_mut(uid) {
                queue.extend(state.feedback(feedback, &self.rules, now));
            }
        }
        // Whatever changed, the quit the pod's next end would call for is armed anew (in a
        // batch of reports, once its releases are out).
        match &mut self.arms_due {
            Some(due) => due.push(uid.to_owned()),
            None => self.arm(uid),
        }
    }

    fn arm(&mut self, uid: &str) {
        let arm = self.pods.get(uid).and_then(PodState::quit_ahead);
        self.act.arm_ahead(uid, arm);
    }

    /// Arms the quits ahead of the pods a batch of reports changed, after its releases: in a
    /// 110-pod round's batch they took 0.5-0.7 ms, against 1.5 ms for its decisions. A pod's
    /// arm meanwhile is the one before the batch: an app that ends first fires that one (for a
    /// release, the same quit) or its end goes through the loop (see `act::ahead` for why an arm
    /// left from an earlier transition is safe).
    fn arm_batch(&mut self) {
        let mut due = self.arms_due.take().unwrap_or_default();
        due.sort_unstable();
        due.dedup();
        for uid in due {
            self.arm(&uid);
        }
    }

    fn on_feedback(&mut self, uid: &str, feedback: Feedback) {
        let now = monotonic_ns();
        let Some(state) = self.pods.get_mut(uid) else { return };
        let fx = state.feedback(feedback, &self.rules, now);
        if fx.is_empty() && state.is_settled() {
            // Nothing changed: the quit armed ahead stands.
            return;
        }
        self.apply(uid, fx);
    }

    fn on_watch(&mut self, event: watcher::Event<Pod>) {
        if !matches!(event, watcher::Event::Init) {
            // The watch is flowing again: the next error is a new restart.
            self.watch_error_counted = false;
        }
        match event {
            watcher::Event::Init => {
                if self.lists_done > 0 {
                    // A re-list after an error is the same restart the error already counted.
                    if !self.watch_error_counted {
                        self.act.metrics().watch_restarts.inc();
                    }
                    info!("pod watch restarted: re-listing");
                }
                self.watch_error_counted = false;
                self.relist.begin();
            }
            watcher::Event::InitApply(pod) => {
                self.relist.saw(&pod);
                self.upsert(pod);
            }
            watcher::Event::InitDone => {
                for uid in self.relist.end(self.pods.keys()) {
                    self.remove(&uid);
                }
                if self.lists_done > 0 {
                    // Ends while the watch was down are not all in the kernel's events (a pod
                    // that came meanwhile was not watched): the node is looked at again.
                    self.recheck_ends();
                }
                self.lists_done += 1;
                // Every pod on the node is known now: what the kernel stopped that none of them
                // holds (an earlier agent's holds in pods deleted, relabelled or no longer
                // held meanwhile) runs again before the agent says it is ready.
                self.release_orphans();
                self.health.pods_listed.store(true, Ordering::Relaxed);
            }
            watcher::Event::Apply(pod) => self.upsert(pod),
            watcher::Event::Delete(pod) => {
                if let Some(uid) = pod.metadata.uid.as_deref() {
                    self.remove(uid);
                }
            }
        }
    }

    fn upsert(&mut self, pod: Pod) {
        let Some(uid) = pod.metadata.uid.clone() else { return };
        // The server filters by node and label; checked again so a misbehaving server can never
        // make us act on another node's pod.
        let on_node = pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(self.node.as_str());
        let labelled = opted_in(&pod);
        if !on_node || !labelled {
            self.remove(&uid);
            return;
        }
        let now = monotonic_ns();
        let state = self.pods.entry(uid.clone()).or_insert_with(|| {
            // `seen_ns`: when the pod's first event reached the router (CLOCK_MONOTONIC), which
            // the bench's pod-watch latency reads instead of polling the agent's count.
            debug!(pod = %pod_name(&pod), seen_ns = now, "tracking");
            PodState::new(&uid)
        });
        let fx = state.observe_pod(pod, &self.rules, now);
        self.act.metrics().pods_tracked.set(self.pods.len() as i64);
        self.apply(&uid, fx);
    }

    fn remove(&mut self, uid: &str) {
        let fx = self.pods.get_mut(uid).map(PodState::removed).unwrap_or_default();
        self.apply(uid, fx);
        if let Some(state) = self.pods.remove(uid) {
            debug!(pod = %state.name(), seen_ns = monotonic_ns(), "stopped tracking");
        }
        self.by_cgroup.retain(|_, u| u != uid);
        self.act.arm_ahead(uid, None);
        self.act.metrics().pods_tracked.set(self.pods.len() as i64);
    }

    /// Level-triggered ends: every pod with a container the API calls running looks at its
    /// cgroups again ([`PodState::recheck_ends`]).
    fn recheck_ends(&mut self) {
        let due: Vec<(String, Vec<Effect>)> =
            self.pods.iter().map(|(uid, s)| (uid.clone(), s.recheck_ends())).filter(|(_, fx)| !fx.is_empty()).collect();
        for (uid, fx) in due {
            self.apply(&uid, fx);
        }
    }

    /// See [`Actuators::release_orphans`]. Only once the pods have been listed: before that,
    /// every pod would look gone.
    fn release_orphans(&mut self) {
        self.ticks_since_sweep = 0;
        if self.lists_done == 0 {
            return;
        }
        let held = self.pods.values().flat_map(PodState::held_pids).collect();
        let holding: Vec<String> = self
            .pods
            .values()
            .filter(|s| s.holding())
            .filter_map(|s| s.pod_cgroup().map(|(rel, _)| rel.to_owned()))
            .collect();
        let released = self.act.release_orphans(held, &holding, monotonic_ns());
        if released > 0 {
            info!(released, "released processes stopped at exec that no tracked pod holds");
        }
    }

    fn on_tick(&mut self) {
        let now = monotonic_ns();
        let stalled = self.last_tick.is_some_and(|t| now.saturating_sub(t) > STALL.as_nanos() as u64);
        self.last_tick = Some(now);
        if stalled {
            info!("the agent did not run for a while: looking for container ends no event reported");
            self.recheck_ends();
        }
        self.ticks_since_sweep += 1;
        if self.ticks_since_sweep >= SWEEP_TICKS {
            // A poll of each pinned fd: with 110 held apps, four times a second led the idle
            // loop's profile. A fd of an app that exited while held lingers a second at most
            // (a release checks its pin anyway).
            self.act.prune_pinned();
            if self.act.any_held_record() {
                self.release_orphans();
            } else {
                self.ticks_since_sweep = 0;
            }
        }
        // Most pods of a full node are settled and have nothing to do: only the others' uids are
        // copied (copying all 110 four times a second was about a fifth of the idle agent's CPU).
        let due: Vec<(String, Vec<Effect>)> = self
            .pods
            .iter_mut()
            .filter_map(|(uid, state)| {
                let fx = state.tick(now);
                (!fx.is_empty()).then(|| (uid.clone(), fx))
            })
            .collect();
        for (uid, fx) in due {
            self.apply(&uid, fx);
        }
        let lost = self.act.kernel().counter(Counter::EventsLost);
        if lost > self.events_lost_seen {
            self.act.metrics().events_lost.inc_by(lost - self.events_lost_seen);
            warn!(lost = lost - self.events_lost_seen, "kernel events lost (ring buffer full)");
            self.events_lost_seen = lost;
        }
        let full = self.act.kernel().counter(Counter::MapFull);
        if full > self.map_full_seen {
            self.act.metrics().map_full.inc_by(full - self.map_full_seen);
            warn!(
                times = full - self.map_full_seen,
                "a kernel map is full: new containers' ends are seen through the API only (seconds later)"
            );
            self.map_full_seen = full;
            // A Warning on every pod still in progress: their containers may be among them.
            let warn_on: Vec<String> =
                self.pods.iter().filter(|(_, s)| !s.is_released()).map(|(u, _)| u.clone()).collect();
            for uid in warn_on {
                let note = "valet's kernel map of containers is full: this pod's container ends are seen \
                            through the API only (raise the map size or spread the pods)"
                    .to_owned();
                self.apply(
                    &uid,
                    vec![Effect::Publish { warning: true, reason: "KernelMapFull", action: "Watch", note }],
                );
            }
        }
    }

    fn on_kernel(&mut self, event: Event) {
        match event {
            Event::Exit(exit) => self.on_exit(exit),
            Event::Held(held) => self.on_held(held),
            Event::Listen(listening) => self.on_listen(&listening),
        }
    }

    /// A socket started listening in a pod watched for holds: while it holds an app, its proxy
    /// is asked at once whether it is ready, not at the next slot of the held pods' poll.
    fn on_listen(&mut self, listening: &Listening) {
        let Some(uid) = self.by_cgroup.get(&listening.watched_cgroup_id).cloned() else { return };
        if self.pods.get(&uid).is_none_or(|s| s.held_pids().next().is_none()) {
            return;
        }
        debug!(%uid, port = listening.port, comm = %listening.comm, "a socket listens in a pod holding its app: probing it now");
        self.act.metrics().proxy_listens.inc();
        self.act.probe_now(&uid);
    }

    /// The pod a kernel event belongs to, with its container cgroup known to the pod's state
    /// (a container that started since the last look is read from the node first).
    fn route(&mut self, watched: u64, container_cgroup: u64) -> Option<String> {
        let uid = self.by_cgroup.get(&watched)?.clone();
        let state = self.pods.get(&uid)?;
        if !state.knows_container(container_cgroup)
            && let Some((rel, _)) = state.pod_cgroup()
        {
            let scan = vec![Effect::ScanContainers { pod_rel: rel.to_owned(), adopt: false }];
            self.apply(&uid, scan);
        }
        Some(uid)
    }

    /// A pod got a new container cgroup: name it from its bundle now (in a held pod, so that its
    /// first exec is classified before it happens).
    fn on_container_made(&mut self, pod_cgroup: u64) {
        let Some(uid) = self.by_cgroup.get(&pod_cgroup).cloned() else { return };
        let Some(rel) = self.pods.get(&uid).and_then(PodState::pod_cgroup).map(|(rel, _)| rel.to_owned()) else {
            return;
        };
        self.apply(&uid, vec![Effect::ScanContainers { pod_rel: rel, adopt: false }]);
    }

    fn on_exit(&mut self, exit: ProcessExit) {
        // The kernel reports only exits that end a container: its recorded main process, or pid 1
        // of a container's own pid namespace; never a process of a sandbox an app made.
        let Some(uid) = self.route(exit.watched_cgroup_id, exit.cgroup_id) else {
            // The pod is gone (its resources let go): its container's record goes with the end.
            if exit.container_main {
                self.act.kernel().forget_container(exit.cgroup_id);
            }
            return;
        };
        let seen = ExitSeen {
            container_cgroup: exit.cgroup_id,
            tgid: exit.tgid,
            end: exit.end,
            ktime: exit.ktime_ns,
            cgroup_name: exit.cgroup_name.clone(),
            ns_child: exit.child_pid_ns && !exit.ns_init,
        };
        let seen_before = self.pods.get(&uid).is_some_and(|s| s.container_ended(exit.cgroup_id));
        self.transition(&uid, |state, now| state.exit(seen, now));
        // The line is written once the quit the end may call for is on its way: a log write
        // (60 µs to a file here, and a pipe a slow reader can fill) never delays it.
        if !seen_before && let Some(state) = self.pods.get(&uid) {
            state.log_end(exit.cgroup_id);
        }
        let unclaimed = if exit.quits_sent_ahead > 0 { self.act.unclaimed_ahead(&uid) } else { 0 };
        if unclaimed > 0 {
            warn!(
                pod = %self.pods.get(&uid).map(PodState::name).unwrap_or_default(),
                unclaimed,
                "a quit sent ahead on this end was not what the pod's state called for by the time the end was handled"
            );
        }
    }

    fn on_held(&mut self, held: HeldProcess) {
        let seen = HeldSeen {
            container_cgroup: held.cgroup_id,
            tgid: held.tgid,
            ktime: held.ktime_ns,
            comm: held.comm.clone(),
        };
        match self.route(held.watched_cgroup_id, held.cgroup_id) {
            Some(uid) => self.transition(&uid, |state, now| state.held(seen, now)),
            None => {
                // Held in a pod valet no longer tracks: never leave it stopped.
                let release = Effect::Release {
                    tgid: held.tgid,
                    container_rel: String::new(),
                    reason: "untracked",
                    since: held.ktime_ns,
                };
                self.act.apply("", None, release, monotonic_ns());
            }
        }
    }

    fn transition(&mut self, uid: &str, f: impl FnOnce(&mut PodState, Nanos) -> Vec<Effect>) {
        let Some(state) = self.pods.get_mut(uid) else { return };
        let fx = f(state, monotonic_ns());
        self.apply(uid, fx);
    }
}
