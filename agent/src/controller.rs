//! The agent's event loop: pod watch events and kernel events come in, each touched pod is
//! re-evaluated through the pure decision (`pod::decide`), and actuator tasks (quit a sidecar,
//! release a held app, write the readiness condition) report back on a channel.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use k8s_openapi::api::core::v1::{ContainerStatus, Pod};
use kube::Client;
use kube::runtime::watcher;
use tokio::sync::mpsc;
use tracing::{debug, info, warn};
use valet_common::{Counter, watch_flags};

use crate::api::events::{EventSink, pod_reference};
use crate::cgroup::signal::signal_cgroup;
use crate::cgroup::{CgroupFs, ContainerDir, PodDir};
use crate::config::Config;
use crate::gate::{Gate, GateAction};
use crate::kernel::events::monotonic_ns;
use crate::kernel::{Event, EventStream, HeldProcess, ProcessEnd, ProcessExit, Programs};
use crate::metrics::{self, KindLabels, Metrics, QuitLabels};
use crate::pod::decide::{AppState, Decision, ExitOutcome, IgnoreReason, Observed, SidecarState, decide};
use crate::pod::spec::{PodPlan, SidecarDefaults, plan};
use crate::pod::status;
use crate::runtime::RuntimeBundles;
use crate::server::Health;
use crate::sidecar::http::Limits;
use crate::sidecar::netns::{PodNetns, open_pod_netns};
use crate::sidecar::quit::{QuitOutcome, QuitRequest, quit};

/// Results of actuator tasks, fed back into the loop.
#[derive(Debug)]
pub enum ActionResult {
    Quit { uid: String, sidecar: String, outcome: QuitOutcome },
    Escalated { uid: String, sidecar: String, signalled: usize },
    Gate(GateAction),
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum QuitState {
    InFlight,
    Accepted,
    Failed,
}

/// A container end seen by the kernel.
#[derive(Clone, Copy, Debug)]
struct KernelEnd {
    end: Option<ProcessEnd>,
    ktime_ns: u64,
    /// Its pid namespace's init exited (final); otherwise its last process left the cgroup.
    by_init: bool,
}

/// What the agent knows about one opted-in pod.
struct Tracked {
    pod: Pod,
    plan: Option<PodPlan>,
    /// The last spec error reported (reported again only when it changes).
    spec_error: Option<String>,
    pod_dir: Option<PodDir>,
    /// Container cgroup id → its directory (path, container id), from the pod's cgroup directory.
    containers: HashMap<u64, ContainerDir>,
    /// The pod's network namespace, opened ahead of time so a quit does not search for it.
    netns: Option<Arc<PodNetns>>,
    /// Container id → its end as the kernel saw it (the container's init exit).
    kernel_ends: HashMap<String, KernelEnd>,
    /// Container id → name from the runtime's bundle, for ids the API does not show yet.
    bundle_names: HashMap<String, String>,
    quits: BTreeMap<String, QuitState>,
    /// Kernel time of the exit that completed the work (for the latency figure).
    done_ktime: Option<u64>,
    /// Why the pod is ignored, once logged.
    ignored: Option<String>,
}

impl Tracked {
    fn new(pod: Pod) -> Tracked {
        Tracked {
            pod,
            plan: None,
            spec_error: None,
            pod_dir: None,
            containers: HashMap::new(),
            netns: None,
            kernel_ends: HashMap::new(),
            bundle_names: HashMap::new(),
            quits: BTreeMap::new(),
            done_ktime: None,
            ignored: None,
        }
    }

    fn name(&self) -> String {
        status::pod_name(&self.pod)
    }

    fn statuses(&self) -> impl Iterator<Item = &ContainerStatus> {
        status::statuses(&self.pod)
    }

    /// Current container id (hex) of a container, from the API.
    fn current_id(&self, name: &str) -> Option<String> {
        status::current_id(&self.pod, name)
    }

    /// Which container a container id belongs to: from the API (current or previous instance),
    /// else from the runtime's bundle (the sandbox is [`SANDBOX_NAME`]).
    fn name_of_id(&self, id: &str) -> Option<String> {
        status::name_of_id(&self.pod, id).or_else(|| self.bundle_names.get(id).cloned())
    }

    /// The kind of a sidecar, as a metric label.
    fn sidecar_kind(&self, sidecar: &str) -> &'static str {
        self.plan
            .as_ref()
            .and_then(|p| p.sidecars.iter().find(|s| s.name == sidecar))
            .map_or("unknown", |s| s.kind.as_str())
    }

    /// Merges the API's view and the kernel's into the decision's input.
    fn observe(&self, plan: &PodPlan) -> Observed {
        let mut observed = Observed::default();
        for name in &plan.apps {
            observed.apps.insert(name.clone(), self.app_state(name));
        }
        for sidecar in &plan.sidecars {
            let state = match self.app_state(&sidecar.name) {
                AppState::Exited(_) => SidecarState::Exited,
                AppState::Running => SidecarState::Running,
                AppState::Waiting => SidecarState::Unknown,
            };
            observed.sidecars.insert(sidecar.name.clone(), state);
        }
        observed.quits_done = self
            .quits
            .iter()
            .filter(|(_, s)| **s == QuitState::Accepted)
            .map(|(n, _)| n.clone())
            .collect::<BTreeSet<_>>();
        observed
    }

    fn app_state(&self, name: &str) -> AppState {
        let status = self.statuses().find(|s| s.name == name);
        let current = self.current_id(name);
        // The kernel is faster than the API: its end of the current instance wins over "running".
        if let Some(id) = &current
            && let Some(end) = self.kernel_ends.get(id)
        {
            return AppState::Exited(outcome(end.end));
        }
        // The API shows no instance yet: an end the runtime's bundle names is the first one's.
        if current.is_none()
            && let Some(end) = self
                .kernel_ends
                .iter()
                .find(|(id, _)| self.bundle_names.get(*id).is_some_and(|n| n == name))
                .map(|(_, end)| end)
        {
            return AppState::Exited(outcome(end.end));
        }
        let Some(state) = status.and_then(|s| s.state.as_ref()) else { return AppState::Waiting };
        if let Some(t) = &state.terminated {
            return AppState::Exited(ExitOutcome::Code(t.exit_code));
        }
        if state.running.is_some() {
            return AppState::Running;
        }
        AppState::Waiting
    }
}

fn outcome(end: Option<ProcessEnd>) -> ExitOutcome {
    match end {
        Some(ProcessEnd::Exited(code)) => ExitOutcome::Code(code),
        Some(ProcessEnd::Signaled { signal, .. }) => ExitOutcome::Signal(signal),
        // Unreadable exit code: never claim success.
        None => ExitOutcome::Code(255),
    }
}

/// The running agent.
pub struct Controller {
    cfg: Arc<Config>,
    client: Client,
    cgroups: CgroupFs,
    programs: Programs,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    events: EventSink,
    defaults: SidecarDefaults,
    pods: HashMap<String, Tracked>,
    pod_by_cgroup: HashMap<u64, String>,
    bundles: RuntimeBundles,
    gate: Gate,
    results_tx: mpsc::UnboundedSender<ActionResult>,
    results_rx: mpsc::UnboundedReceiver<ActionResult>,
    /// Pods seen during a re-list, to drop the ones that vanished meanwhile.
    relist: Option<HashSet<String>>,
    /// A watch error was counted and its re-list is still to come (one restart, counted once).
    watch_error_counted: bool,
    lists_done: u64,
    events_lost_seen: u64,
}

impl Controller {
    pub fn new(
        cfg: Arc<Config>,
        client: Client,
        cgroups: CgroupFs,
        programs: Programs,
        metrics: Arc<Metrics>,
        health: Arc<Health>,
    ) -> Controller {
        let (results_tx, results_rx) = mpsc::unbounded_channel();
        let bundles = RuntimeBundles::new(cfg.runtime_state_dirs.clone());
        let events = EventSink::new(client.clone(), &cfg.node_name);
        let defaults = SidecarDefaults { names: cfg.sidecar_names.clone(), hold_timeout: cfg.hold_timeout };
        let gate = Gate::new(
            cfg.clone(),
            client.clone(),
            cgroups.clone(),
            metrics.clone(),
            events.clone(),
            results_tx.clone(),
        );
        Controller {
            cfg,
            client,
            cgroups,
            programs,
            metrics,
            health,
            events,
            defaults,
            pods: HashMap::new(),
            pod_by_cgroup: HashMap::new(),
            bundles,
            gate,
            results_tx,
            results_rx,
            relist: None,
            watch_error_counted: false,
            lists_done: 0,
            events_lost_seen: 0,
        }
    }

    /// Runs until `shutdown` resolves; then releases held apps and lets in-flight quits finish
    /// (bounded by `drain`).
    pub async fn run(
        mut self,
        mut kernel: EventStream,
        shutdown: impl std::future::Future<Output = ()>,
        drain: Duration,
    ) {
        let watch = crate::api::watch::pods_on_node(self.client.clone(), &self.cfg.node_name);
        let mut watch = std::pin::pin!(watch);
        let mut shutdown = std::pin::pin!(shutdown);
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        self.health.programs_attached.store(true, Ordering::Relaxed);
        loop {
            tokio::select! {
                biased;
                _ = &mut shutdown => break,
                batch = kernel.next_batch() => match batch {
                    Ok(batch) => for event in batch { self.on_kernel(event) },
                    Err(e) => { warn!("kernel event stream: {e}"); tokio::time::sleep(Duration::from_millis(100)).await; }
                },
                Some(result) = self.results_rx.recv() => self.on_result(result),
                event = watch.next() => match event {
                    Some(Ok(event)) => self.on_watch(event),
                    Some(Err(e)) => {
                        if !self.watch_error_counted {
                            self.metrics.watch_restarts.inc();
                            self.watch_error_counted = true;
                        }
                        warn!("pod watch: {e} (retrying)");
                    }
                    None => { warn!("pod watch ended"); break; }
                },
                _ = tick.tick() => self.on_tick(),
            }
        }
        self.shutdown(drain).await;
    }

    async fn shutdown(&mut self, drain: Duration) {
        info!("shutting down: releasing held apps and finishing in-flight quits");
        // Hold nothing more: containers that start while the agent stops run freely.
        for t in self.pods.values() {
            if let Some(dir) = &t.pod_dir {
                let _ = self.programs.watch(dir.id, watch_flags::EXITS);
            }
        }
        self.gate.release_all("shutdown");
        let deadline = Instant::now() + drain;
        while self.pods.values().any(|p| p.quits.values().any(|q| *q == QuitState::InFlight)) {
            let left = deadline.saturating_duration_since(Instant::now());
            match tokio::time::timeout(left, self.results_rx.recv()).await {
                Ok(Some(result)) => self.on_result(result),
                _ => break,
            }
        }
        self.programs.detach();
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
                        self.metrics.watch_restarts.inc();
                    }
                    info!("pod watch restarted: re-listing");
                }
                self.watch_error_counted = false;
                self.relist = Some(HashSet::new());
            }
            watcher::Event::InitApply(pod) => {
                if let (Some(seen), Some(uid)) = (self.relist.as_mut(), pod.metadata.uid.clone()) {
                    seen.insert(uid);
                }
                self.upsert(pod);
            }
            watcher::Event::InitDone => {
                if let Some(seen) = self.relist.take() {
                    let gone: Vec<String> = self.pods.keys().filter(|u| !seen.contains(*u)).cloned().collect();
                    for uid in gone {
                        self.remove(&uid);
                    }
                }
                self.lists_done += 1;
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
        let on_node = pod.spec.as_ref().and_then(|s| s.node_name.as_deref()) == Some(self.cfg.node_name.as_str());
        let labelled =
            pod.metadata.labels.as_ref().and_then(|l| l.get(crate::api::watch::ENABLED_LABEL)).map(String::as_str)
                == Some("true");
        if !on_node || !labelled {
            self.remove(&uid);
            return;
        }
        let host_network = pod.spec.as_ref().and_then(|s| s.host_network).unwrap_or(false);
        let tracked = self.pods.entry(uid.clone()).or_insert_with(|| Tracked::new(pod.clone()));
        tracked.pod = pod;
        match plan(&tracked.pod, &self.defaults) {
            Ok(p) => {
                tracked.spec_error = None;
                tracked.plan = Some(p);
            }
            Err(e) => {
                let text = e.to_string();
                if tracked.spec_error.as_deref() != Some(text.as_str()) {
                    warn!(pod = %tracked.name(), "skipping pod: {text}");
                    self.metrics.skip("bad_annotation");
                    self.events.publish(
                        pod_reference(&tracked.pod),
                        true,
                        e.reason(),
                        "Skip",
                        format!("valet ignores this pod: {text}"),
                    );
                    tracked.spec_error = Some(text);
                }
                tracked.plan = None;
            }
        }
        if host_network && tracked.plan.is_some() {
            if tracked.ignored.is_none() {
                info!(pod = %tracked.name(), "hostNetwork pod: its sidecar's loopback is the node's; leaving it alone");
                self.metrics.skip("host_network");
                tracked.ignored = Some("host_network".into());
            }
            tracked.plan = None;
        }
        self.metrics.pods_tracked.set(self.pods.len() as i64);
        self.attach_cgroup(&uid);
        self.evaluate(&uid);
    }

    fn remove(&mut self, uid: &str) {
        if let Some(tracked) = self.pods.remove(uid) {
            if let Some(dir) = &tracked.pod_dir {
                let _ = self.programs.unwatch(dir.id);
                self.pod_by_cgroup.remove(&dir.id);
                for cg in tracked.containers.keys() {
                    self.programs.forget_exec(*cg);
                }
            }
            self.gate.forget(uid);
            debug!(pod = %tracked.name(), "stopped tracking");
        }
        self.metrics.pods_tracked.set(self.pods.len() as i64);
    }

    /// Finds the pod's cgroup (once the kubelet made it) and registers it with the kernel.
    fn attach_cgroup(&mut self, uid: &str) {
        let Some(tracked) = self.pods.get_mut(uid) else { return };
        let Some(plan) = &tracked.plan else { return };
        let hold = self.gate.wants_hold(plan);
        if tracked.pod_dir.is_none() {
            let Some(dir) = self.cgroups.find_pod(uid) else { return };
            debug!(pod = %tracked.name(), cgroup = %dir.rel, "found pod cgroup");
            tracked.pod_dir = Some(dir);
        }
        let Some(dir) = &tracked.pod_dir else { return };
        let flags = watch_flags::EXITS | if hold { watch_flags::HOLD } else { 0 };
        if let Err(e) = self.programs.watch(dir.id, flags) {
            warn!(pod = %tracked.name(), "register pod cgroup with the kernel: {e}");
            return;
        }
        self.pod_by_cgroup.insert(dir.id, uid.to_owned());
        let rel = dir.rel.clone();
        for c in self.cgroups.containers(&rel) {
            if hold
                && self.bundles.enabled()
                && tracked.name_of_id(&c.container.id).is_none()
                && let Some(role) = self.bundles.role(&c.container.id, uid)
            {
                tracked.bundle_names.insert(c.container.id.clone(), role.name().to_owned());
            }
            // Classify known containers before they exec: sidecars, init containers and the
            // sandbox are never held. A container whose init an earlier agent left held has had
            // its first exec: what it execs once released runs freely.
            if hold && !self.programs.exec_seen(c.id) {
                let hold_it = if self.gate.exec_done_before(uid, &c) {
                    Some(false)
                } else {
                    tracked.name_of_id(&c.container.id).map(|name| plan.apps.contains(&name))
                };
                if let Some(hold_it) = hold_it
                    && let Err(e) = self.programs.classify_exec(c.id, hold_it)
                {
                    debug!("classify container cgroup: {e}");
                }
            }
            tracked.containers.insert(c.id, c);
        }
        // Opened ahead of time: the quit then needs no search (retries open it afresh).
        if tracked.netns.is_none() {
            match open_pod_netns(&self.cfg.host_proc, &self.cgroups, &rel) {
                Ok(netns) => tracked.netns = Some(Arc::new(netns)),
                Err(e) => debug!(pod = %tracked.name(), "pod network namespace not open yet: {e}"),
            }
        }
    }

    fn on_tick(&mut self) {
        let missing: Vec<String> = self
            .pods
            .iter()
            // A finished pod (its cgroup gone or empty) is not searched for again every tick.
            .filter(|(_, t)| {
                (t.pod_dir.is_none() || t.netns.is_none()) && t.plan.is_some() && !status::terminal(&t.pod)
            })
            .map(|(u, _)| u.clone())
            .collect();
        for uid in missing {
            self.attach_cgroup(&uid);
            // The work may have been done already (the API showed it) while the cgroup was
            // missing: decide again now that the quit has somewhere to go.
            if self.pods.get(&uid).is_some_and(|t| t.pod_dir.is_some()) {
                self.evaluate(&uid);
            }
        }
        let lost = self.programs.counter(Counter::EventsLost);
        if lost > self.events_lost_seen {
            self.metrics.events_lost.inc_by(lost - self.events_lost_seen);
            warn!(lost = lost - self.events_lost_seen, "kernel events lost (ring buffer full)");
            self.events_lost_seen = lost;
        }
        let pods: Vec<_> = self
            .pods
            .iter()
            .filter_map(|(uid, t)| Some((uid.as_str(), &t.pod, t.plan.as_ref()?, t.pod_dir.as_ref())))
            .collect();
        let actions = self.gate.tick(&pods);
        for action in actions {
            self.on_result(ActionResult::Gate(action));
        }
    }

    /// The container id (hex) of a container cgroup of a tracked pod; learns the container's
    /// name from the runtime's bundle when the API does not show the id yet.
    fn container_id(&mut self, uid: &str, cgroup_id: u64) -> Option<String> {
        let tracked = self.pods.get_mut(uid)?;
        if !tracked.containers.contains_key(&cgroup_id) {
            let dir = tracked.pod_dir.as_ref()?;
            for c in self.cgroups.containers(&dir.rel) {
                tracked.containers.insert(c.id, c);
            }
        }
        let id = tracked.containers.get(&cgroup_id)?.container.id.clone();
        if self.bundles.enabled()
            && tracked.name_of_id(&id).is_none()
            && let Some(role) = self.bundles.role(&id, uid)
        {
            tracked.bundle_names.insert(id.clone(), role.name().to_owned());
        }
        Some(id)
    }

    fn on_kernel(&mut self, event: Event) {
        match event {
            Event::Exit(exit) => self.on_exit(exit),
            Event::Held(held) => self.on_held(held),
        }
    }

    fn on_exit(&mut self, exit: ProcessExit) {
        let seen_after_us = monotonic_ns().saturating_sub(exit.ktime_ns) / 1000;
        let Some(uid) = self.pod_by_cgroup.get(&exit.watched_cgroup_id).cloned() else { return };
        let Some(id) = self.container_id(&uid, exit.cgroup_id) else {
            debug!(cgroup = exit.cgroup_id, "exit in an unknown container cgroup of a tracked pod");
            return;
        };
        let Some(tracked) = self.pods.get_mut(&uid) else { return };
        if tracked.kernel_ends.get(&id).is_some_and(|e| e.by_init) {
            // Already ended (its init exited); these are the rest of its processes going.
            return;
        }
        // A container ends when its pid namespace's init exits (the kernel then kills the rest).
        // A process inside such a namespace never ends it. Without a pid namespace of its own
        // (shareProcessNamespace) a container ends when its last process leaves its cgroup; as
        // the cgroup is read after the fact, a later exit of the same container replaces the
        // end recorded from an earlier one.
        if !exit.ns_init {
            if exit.child_pid_ns {
                return;
            }
            let Some(dir) = tracked.containers.get(&exit.cgroup_id) else { return };
            let left = self.cgroups.procs_recursive(&dir.rel);
            if left.iter().any(|pid| *pid != exit.tgid) {
                return;
            }
        }
        let name = tracked.name_of_id(&id);
        info!(
            pod = %tracked.name(),
            container = name.as_deref().unwrap_or("<not yet in the API>"),
            end = ?exit.end,
            seen_after_us,
            "container exited"
        );
        let label = match exit.end {
            Some(ProcessEnd::Exited(0)) => metrics::ExitOutcome::Success,
            Some(ProcessEnd::Signaled { .. }) => metrics::ExitOutcome::Signal,
            _ => metrics::ExitOutcome::Failure,
        };
        self.metrics.exits.get_or_create(&metrics::ExitLabels { outcome: label }).inc();
        tracked.kernel_ends.insert(id, KernelEnd { end: exit.end, ktime_ns: exit.ktime_ns, by_init: exit.ns_init });
        self.evaluate(&uid);
    }

    fn on_held(&mut self, held: HeldProcess) {
        let uid = self.pod_by_cgroup.get(&held.watched_cgroup_id).cloned();
        let id = uid.as_deref().and_then(|u| self.container_id(u, held.cgroup_id));
        let context = uid.as_deref().and_then(|u| {
            let t = self.pods.get(u)?;
            let name = id.as_deref().and_then(|i| t.name_of_id(i));
            Some((t.pod.clone(), t.plan.clone()?, t.pod_dir.clone()?, name))
        });
        for action in self.gate.on_held(held, uid, context) {
            self.on_result(ActionResult::Gate(action));
        }
    }

    fn on_result(&mut self, result: ActionResult) {
        match result {
            ActionResult::Quit { uid, sidecar, outcome } => {
                let Some(tracked) = self.pods.get_mut(&uid) else { return };
                let kind = tracked.sidecar_kind(&sidecar);
                self.metrics.quits.get_or_create(&QuitLabels { kind, result: outcome.label() }).inc();
                let reference = pod_reference(&tracked.pod);
                match &outcome {
                    QuitOutcome::Accepted { status, attempts } => {
                        tracked.quits.insert(sidecar.clone(), QuitState::Accepted);
                        let after = tracked.done_ktime.map(|k| monotonic_ns().saturating_sub(k));
                        if let Some(ns) = after {
                            self.metrics.quit_latency.observe(ns as f64 / 1e9);
                        }
                        let after_text =
                            after.map(|ns| format!(" {}µs after the app finished", ns / 1000)).unwrap_or_default();
                        info!(pod = %tracked.name(), %sidecar, status, attempts, quit_after_us = after.map(|n| n / 1000), "sidecar accepted quit");
                        self.events.publish(
                            reference,
                            false,
                            "SidecarQuit",
                            "Quit",
                            format!("asked {sidecar} to quit: HTTP {status}{after_text}"),
                        );
                    }
                    QuitOutcome::Rejected { status, body } => {
                        tracked.quits.insert(sidecar.clone(), QuitState::Failed);
                        warn!(pod = %tracked.name(), %sidecar, status, %body, "sidecar refused to quit");
                        self.events.publish(
                            reference,
                            true,
                            "SidecarQuitFailed",
                            "Quit",
                            format!("{sidecar} refused to quit: HTTP {status} {body}"),
                        );
                    }
                    QuitOutcome::Failed { last, attempts, .. } => {
                        tracked.quits.insert(sidecar.clone(), QuitState::Failed);
                        warn!(pod = %tracked.name(), %sidecar, attempts, %last, "could not quit sidecar");
                        self.events.publish(
                            reference,
                            true,
                            "SidecarQuitFailed",
                            "Quit",
                            format!("could not quit {sidecar} after {attempts} attempts: {last}"),
                        );
                    }
                }
            }
            ActionResult::Escalated { uid, sidecar, signalled } => {
                let Some(tracked) = self.pods.get(&uid) else { return };
                let kind = tracked.sidecar_kind(&sidecar);
                self.metrics.escalations.get_or_create(&KindLabels { kind }).inc();
                warn!(pod = %tracked.name(), %sidecar, signalled, "sidecar still running: sent SIGTERM");
                self.events.publish(
                    pod_reference(&tracked.pod),
                    true,
                    "SidecarTerminated",
                    "Escalate",
                    format!("{sidecar} did not exit after the quit: sent SIGTERM to {signalled} process(es)"),
                );
            }
            ActionResult::Gate(action) => {
                let pods = &self.pods;
                self.gate.on_action(action, |uid| pods.get(uid).map(|t| t.pod.clone()));
            }
        }
    }

    /// Runs the decision for one pod and starts what it asks for.
    fn evaluate(&mut self, uid: &str) {
        let Some(tracked) = self.pods.get_mut(uid) else { return };
        let Some(plan) = tracked.plan.clone() else { return };
        self.gate.on_pod(uid, &tracked.pod, &plan, tracked.pod_dir.as_ref());
        let observed = tracked.observe(&plan);
        match decide(&plan, &observed) {
            Decision::Ignore(reason) => {
                let label = ignore_label(&reason);
                if tracked.ignored.as_deref() != Some(label) {
                    info!(pod = %tracked.name(), reason = ?reason, "no sidecar shutdown for this pod");
                    self.metrics.skip(label);
                    tracked.ignored = Some(label.to_owned());
                }
            }
            Decision::Wait(_) => {}
            Decision::Done => self.gate.finish(uid),
            Decision::Quit(sidecars) => {
                self.gate.finish(uid);
                if tracked.done_ktime.is_none() {
                    tracked.done_ktime = plan
                        .apps
                        .iter()
                        .filter_map(|a| tracked.current_id(a))
                        .filter_map(|id| tracked.kernel_ends.get(&id))
                        .map(|e| e.ktime_ns)
                        .max();
                }
                let Some(dir) = tracked.pod_dir.clone() else {
                    debug!(pod = %tracked.name(), "work done but the pod cgroup is not found yet");
                    return;
                };
                let mut start = Vec::new();
                for name in sidecars {
                    if tracked.quits.contains_key(&name) {
                        continue;
                    }
                    let Some(sidecar) = plan.sidecars.iter().find(|s| s.name == name) else { continue };
                    tracked.quits.insert(name.clone(), QuitState::InFlight);
                    let sidecar_cgroup = tracked.current_id(&name).and_then(|id| {
                        let cached = tracked.containers.values().find(|c| c.container.id == id).map(|c| c.rel.clone());
                        cached.or_else(|| {
                            self.cgroups.containers(&dir.rel).into_iter().find(|c| c.container.id == id).map(|c| c.rel)
                        })
                    });
                    start.push((name, sidecar.quit.port, sidecar.quit.path.clone(), sidecar_cgroup));
                }
                let netns = tracked.netns.clone();
                for (name, port, path, sidecar_cgroup) in start {
                    let req = QuitRequest {
                        netns: netns.clone(),
                        host_proc: self.cfg.host_proc.clone(),
                        cgroups: self.cgroups.clone(),
                        pod_cgroup: dir.rel.clone(),
                        port,
                        path,
                        limits: Limits { total_timeout: self.cfg.quit_timeout, ..Limits::default() },
                        retry_for: self.cfg.quit_retry_for,
                    };
                    self.spawn_quit(uid.to_owned(), name, req, sidecar_cgroup);
                }
            }
        }
    }

    /// Quits one sidecar in the background; escalates with SIGTERM when the quit does not end it.
    fn spawn_quit(&self, uid: String, sidecar: String, req: QuitRequest, sidecar_cgroup: Option<String>) {
        let tx = self.results_tx.clone();
        let escalate = (!self.cfg.no_escalation).then_some(self.cfg.escalate_after);
        tokio::spawn(async move {
            let outcome = quit(&req).await;
            let accepted = matches!(outcome, QuitOutcome::Accepted { .. });
            let _ = tx.send(ActionResult::Quit { uid: uid.clone(), sidecar: sidecar.clone(), outcome });
            let (Some(wait), Some(rel)) = (escalate, sidecar_cgroup) else { return };
            if accepted {
                // Give the sidecar its time to exit on its own.
                tokio::time::sleep(wait).await;
            }
            if req.cgroups.procs_recursive(&rel).is_empty() {
                return;
            }
            let signalled = signal_cgroup(&req.cgroups, &rel, libc::SIGTERM);
            let _ = tx.send(ActionResult::Escalated { uid, sidecar, signalled });
        });
    }
}

fn ignore_label(reason: &IgnoreReason) -> &'static str {
    match reason {
        IgnoreReason::RestartAlways => "restart_always",
        IgnoreReason::NativeSidecars => "native_sidecars",
        IgnoreReason::NoSidecars => "no_sidecars",
        IgnoreReason::NoApps => "no_apps",
        IgnoreReason::Deleting => "deleting",
    }
}
