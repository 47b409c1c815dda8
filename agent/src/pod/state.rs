//! Everything the agent knows about one opted-in pod, and the transitions that change it.
//!
//! Each transition takes plain inputs (the pod object, an exit or a hold the kernel saw, the
//! result of an effect, a tick with the current time) and returns the [`Effect`]s to carry out.
//! No I/O and no clock reads here: the controller routes inputs in and hands effects to `act`.
//!
//! A pod goes through: found (its cgroup watched, its containers named, its network namespace
//! opened) → apps held until the proxy is ready (or the hold times out) → the work is done and
//! the sidecars are asked to quit → resources released. The API can move it anywhere at any time
//! (a label removed, annotations broken, the pod deleted): then nothing it held stays held.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::{ContainerStatus, Pod};
use tracing::{debug, info, warn};

use super::decide::{AppState, Decision, ExitOutcome, IgnoreReason, Observed, SidecarState, decide};
use super::spec::{Endpoint, PodPlan, SidecarDefaults, plan};
use super::status::{self, hex_id, pod_name};
use crate::api::condition::{self, ProxyReady};
use crate::effect::{ContainerSeen, Count, Effect, ExitSeen, Feedback, HeldSeen, LeftHeld, Nanos, Pace, RuntimeName};
use crate::kernel::ProcessEnd;
use crate::sidecar::quit::QuitOutcome;

/// The longest any app is held, whatever the annotation says.
const MAX_HOLD: Duration = Duration::from_secs(3600);
/// Backoff between retries of a failed quit when escalation is off: from 1 s, doubling, to 60 s,
/// at most this many retries.
const QUIT_RETRY_FIRST: Duration = Duration::from_secs(1);
const QUIT_RETRY_MAX: Duration = Duration::from_secs(60);
const QUIT_RETRIES: u32 = 10;

/// Agent-wide rules every pod follows.
#[derive(Clone, Debug)]
pub struct Rules {
    pub defaults: SidecarDefaults,
    /// SIGTERM a sidecar still running this long after it accepted a quit; `None`: never signal.
    pub escalate_after: Option<Duration>,
}

/// A quit to send the moment a container's end is read from the kernel ([`PodState::quit_ahead`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QuitAhead {
    pub uid: String,
    pub pod_rel: String,
    /// The watched pod cgroup the end must be reported under.
    pub pod_cgroup: u64,
    /// The container whose end completes the pod's work.
    pub container_cgroup: u64,
    /// The endpoints to quit when it ends with `exit(0)`.
    pub on_success: Vec<Endpoint>,
    /// The endpoints to quit when it ends any other way (a code, a signal, or unknown).
    pub on_failure: Vec<Endpoint>,
}

/// A container cgroup of the pod.
#[derive(Clone, Debug)]
struct Container {
    id: String,
    rel: String,
    runtime_name: Option<RuntimeName>,
    /// Told the kernel whether to hold its first exec.
    classified: bool,
    /// Its first exec happened before this agent could judge it: what it execs later runs.
    exec_done: bool,
    /// Its main process ended, as the kernel saw it.
    end: Option<KernelEnd>,
}

#[derive(Clone, Copy, Debug)]
struct KernelEnd {
    end: Option<ProcessEnd>,
    ktime: Nanos,
}

/// A process held at exec.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Held {
    tgid: u32,
    container_cgroup: u64,
    since: Nanos,
    /// Counted in `valet_app_holds_total` (app processes only: an unnamed container's process is
    /// counted once it is known to be an app, or released as one).
    counted: bool,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum QuitState {
    InFlight,
    Accepted {
        escalate_at: Option<Nanos>,
    },
    /// Not accepted; retried at `retry_at` (none: out of retries).
    Failed {
        retry_at: Option<Nanos>,
    },
    Escalated,
}

/// The quit of one sidecar container instance.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Quit {
    /// The container id it was sent to (none: the instance was not known yet).
    instance: Option<String>,
    state: QuitState,
    /// Failed attempts so far.
    failures: u32,
}

/// The one instance of a container that counts now.
struct Instance<'a> {
    id: String,
    /// The API's status, when the API shows this very instance as current.
    api: Option<&'a ContainerStatus>,
}

/// Everything the agent knows about one opted-in pod.
pub struct PodState {
    uid: String,
    pod: Option<Pod>,
    plan: Option<PodPlan>,
    /// The last spec error reported (reported again only when it changes).
    spec_error: Option<String>,
    /// Why the pod is ignored, once counted.
    ignored: Option<&'static str>,
    pod_cgroup: Option<(String, u64)>,
    /// The hold flag the kernel watches the pod cgroup with.
    watching: Option<bool>,
    /// Container cgroup id → what is known of it.
    containers: BTreeMap<u64, Container>,
    network_open: bool,
    held: Vec<Held>,
    left_held_searched: bool,
    failed_open: bool,
    /// The running probe's target and pace.
    probe: Option<(ProbeTarget, Pace)>,
    ready: Option<bool>,
    quits: BTreeMap<String, Quit>,
    /// Kernel time of the end that completed the work (for the latency figure).
    done_ktime: Option<Nanos>,
    /// The work is done: no more probing, holding, or condition downgrades.
    finished: bool,
    /// Kernel maps, network namespace and probe are released.
    released: bool,
    /// Released because the plan is gone (bad annotations, hostNetwork): attached again if it
    /// comes back.
    stood_down: bool,
    shutting_down: bool,
    written: Option<ProxyReady>,
    writing: bool,
    /// The last tick asked for nothing and nothing has come in since: until something does (or
    /// a deadline is pending), a tick has nothing to do. A full node's idle pods cost no CPU.
    settled: bool,
}

impl PodState {
    pub fn new(uid: &str) -> PodState {
        PodState {
            uid: uid.to_owned(),
            pod: None,
            plan: None,
            spec_error: None,
            ignored: None,
            pod_cgroup: None,
            watching: None,
            containers: BTreeMap::new(),
            network_open: false,
            held: Vec::new(),
            left_held_searched: false,
            failed_open: false,
            probe: None,
            ready: None,
            quits: BTreeMap::new(),
            done_ktime: None,
            finished: false,
            released: false,
            stood_down: false,
            shutting_down: false,
            written: None,
            writing: false,
            settled: false,
        }
    }

    pub fn uid(&self) -> &str {
        &self.uid
    }

    /// `namespace/name` for logs.
    pub fn name(&self) -> String {
        self.pod.as_ref().map_or_else(|| self.uid.clone(), pod_name)
    }

    pub fn pod(&self) -> Option<&Pod> {
        self.pod.as_ref()
    }

    pub fn pod_cgroup(&self) -> Option<(&str, u64)> {
        self.pod_cgroup.as_ref().map(|(rel, id)| (rel.as_str(), *id))
    }

    /// Whether a container cgroup is one this pod knows.
    pub fn knows_container(&self, cgroup_id: u64) -> bool {
        self.containers.contains_key(&cgroup_id)
    }

    /// The kind of a sidecar, as a metric label.
    pub fn sidecar_kind(&self, sidecar: &str) -> &'static str {
        self.plan
            .as_ref()
            .and_then(|p| p.sidecars.iter().find(|s| s.name == sidecar))
            .map_or("unknown", |s| s.kind.as_str())
    }

    /// Whether a quit is still on its way (shutdown waits for those).
    pub fn quit_in_flight(&self) -> bool {
        self.quits.values().any(|q| q.state == QuitState::InFlight)
    }

    /// Whether the node's resources for this pod (cgroup search, kernel maps, network namespace)
    /// are still needed.
    pub fn is_released(&self) -> bool {
        self.released
    }

    // ---- transitions ----

    /// A new version of the pod object from the API.
    pub fn observe_pod(&mut self, pod: Pod, rules: &Rules, now: Nanos) -> Vec<Effect> {
        self.settled = false;
        let mut fx = Vec::new();
        let host_network = pod.spec.as_ref().and_then(|s| s.host_network).unwrap_or(false);
        let planned = plan(&pod, &rules.defaults);
        self.pod = Some(pod);
        match planned {
            Ok(_) if host_network => {
                if self.ignored != Some("host_network") {
                    info!(pod = %self.name(), "hostNetwork pod: its sidecar's loopback is the node's; leaving it alone");
                    fx.push(Effect::Count(Count::Skip("host_network")));
                    self.ignored = Some("host_network");
                }
                self.plan = None;
            }
            Ok(p) => {
                self.spec_error = None;
                self.plan = Some(p);
                if std::mem::take(&mut self.stood_down) {
                    // Watched again, from scratch.
                    self.released = false;
                    self.watching = None;
                    self.network_open = false;
                    self.left_held_searched = false;
                }
            }
            Err(e) => {
                let text = e.to_string();
                if self.spec_error.as_deref() != Some(text.as_str()) {
                    warn!(pod = %self.name(), "skipping pod: {text}");
                    fx.push(Effect::Count(Count::Skip("bad_annotation")));
                    fx.push(Effect::Publish {
                        warning: true,
                        reason: e.reason(),
                        action: "Skip",
                        note: format!("valet ignores this pod: {text}"),
                    });
                    self.spec_error = Some(text);
                }
                self.plan = None;
            }
        }
        if self.plan.is_none() {
            // Nothing valet started for this pod may outlive its opt-in.
            fx.extend(self.stand_down("invalid_spec"));
            return fx;
        }
        fx.extend(self.step(now));
        fx
    }

    /// The pod is gone from valet's view (deleted, label removed, moved off the node).
    pub fn removed(&mut self) -> Vec<Effect> {
        self.settled = false;
        let mut fx = self.release_all("pod_gone");
        fx.extend(self.release_resources());
        fx
    }

    /// The agent stops: let every held process run. Processes the kernel stopped whose events
    /// are still on their way are found in the pod's cgroup.
    pub fn shutdown(&mut self) -> Vec<Effect> {
        self.settled = false;
        self.shutting_down = true;
        let mut fx = self.release_all("shutdown");
        if self.watching == Some(true)
            && let Some((rel, _)) = &self.pod_cgroup
        {
            fx.push(Effect::FindLeftHeld { pod_rel: rel.clone() });
        }
        fx
    }

    /// A container's main process ended. The caller logs it ([`PodState::log_end`]) once the
    /// effects are applied, so that a quit is on its way before the log line's write.
    pub fn exit(&mut self, exit: ExitSeen, now: Nanos) -> Vec<Effect> {
        self.settled = false;
        let Some(c) = self.containers.get_mut(&exit.container_cgroup) else {
            debug!(pod = %self.name(), cgroup = exit.container_cgroup, "exit in an unknown container cgroup");
            return Vec::new();
        };
        if c.end.is_some() {
            return Vec::new();
        }
        c.end = Some(KernelEnd { end: exit.end, ktime: exit.ktime });
        // A held process whose container ended is gone.
        self.held.retain(|h| h.container_cgroup != exit.container_cgroup);
        let mut fx = vec![Effect::Count(Count::ContainerEnd(exit.end))];
        fx.extend(self.step(now));
        fx
    }

    /// The quit this pod's state machine would send the moment one more container ends, when
    /// that is already certain: [`PodState::exit`] on that container would decide to quit these
    /// sidecars through their endpoints, and the pod's network is open. The kernel event reader
    /// sends it from there as soon as the end is read, before the event reaches the loop (see
    /// `act::ahead`); the loop's own transition then takes that request over. `None` whenever
    /// anything else could happen on that end: more than one app left, a restart policy that
    /// depends on how it ends and no quit either way, a sidecar quit by signal only, a pod done,
    /// deleting, shutting down or released.
    pub fn quit_ahead(&self) -> Option<QuitAhead> {
        let plan = self.plan.as_ref()?;
        if self.finished || self.released || self.shutting_down || !self.network_open || plan.deleting {
            return None;
        }
        let (pod_rel, pod_cgroup) = self.pod_cgroup.as_ref()?;
        if self.pod.as_ref().is_some_and(status::terminal) {
            return None;
        }
        let observed = self.observe(plan);
        if !matches!(decide(plan, &observed), Decision::Wait(_)) {
            return None;
        }
        // Only an app still running can be the one whose end completes the work.
        let mut running = observed.apps.iter().filter(|(_, s)| !matches!(s, AppState::Exited(_)));
        let (Some((app, _)), None) = (running.next(), running.next()) else { return None };
        let instance = self.current(app)?;
        let (&container_cgroup, _) = self.containers.iter().find(|(_, c)| c.id == instance.id && c.end.is_none())?;
        let quits = |ended: ExitOutcome| -> Vec<Endpoint> {
            match decide(plan, &self.observe_assuming(plan, Some((&instance.id, ended)))) {
                Decision::Quit(sidecars) => sidecars
                    .iter()
                    // A sidecar quit before (an earlier instance) goes through the loop.
                    .filter(|name| !self.quits.contains_key(*name))
                    .filter_map(|name| plan.sidecars.iter().find(|s| &s.name == name)?.quit.clone())
                    .collect(),
                _ => Vec::new(),
            }
        };
        let (on_success, on_failure) = (quits(ExitOutcome::Code(0)), quits(ExitOutcome::Code(1)));
        if on_success.is_empty() && on_failure.is_empty() {
            return None;
        }
        Some(QuitAhead {
            uid: self.uid.clone(),
            pod_rel: pod_rel.clone(),
            pod_cgroup: *pod_cgroup,
            container_cgroup,
            on_success,
            on_failure,
        })
    }

    /// Whether the container's end was seen already.
    pub fn container_ended(&self, container_cgroup: u64) -> bool {
        self.containers.get(&container_cgroup).is_some_and(|c| c.end.is_some())
    }

    /// Logs the end [`PodState::exit`] recorded for the container.
    pub fn log_end(&self, container_cgroup: u64) {
        let Some(c) = self.containers.get(&container_cgroup) else { return };
        let Some(end) = &c.end else { return };
        let container = self.name_of(&c.id);
        info!(
            pod = %self.name(),
            container = container.as_deref().unwrap_or("<not named yet>"),
            end = ?end.end,
            "container exited"
        );
    }

    /// The kernel stopped a process at its first exec.
    pub fn held(&mut self, held: HeldSeen, now: Nanos) -> Vec<Effect> {
        self.settled = false;
        let rel = self.containers.get(&held.container_cgroup).map(|c| c.rel.clone());
        let Some(rel) = rel else {
            warn!(pod = %self.name(), pid = held.tgid, "held process in an unknown container: releasing");
            return vec![Effect::Release {
                tgid: held.tgid,
                container_rel: String::new(),
                reason: "untracked",
                since: held.ktime,
            }];
        };
        let release =
            |reason| Effect::Release { tgid: held.tgid, container_rel: rel.clone(), reason, since: held.ktime };
        let Some(plan) = self.plan.as_ref().filter(|p| wants_hold(p)) else {
            return vec![release("not_app")];
        };
        if self.finished || self.shutting_down {
            return vec![release("not_app")];
        }
        let role = self.role(held.container_cgroup);
        // The sandbox's pause starts before any container the API could name.
        let app = match &role {
            Role::Sandbox => false,
            Role::Named(name) => plan.apps.contains(name),
            Role::Unnamed => held.comm != "pause" && self.may_be_app(plan),
        };
        // Surely an app: named one, or unnamed while every other kind of container is known.
        let surely_app = match &role {
            Role::Named(_) => app,
            Role::Unnamed => {
                app && plan.init_containers.is_empty() && plan.sidecars.iter().all(|s| self.current(&s.name).is_some())
            }
            Role::Sandbox => false,
        };
        if !app {
            return vec![release("not_app")];
        }
        if self.held.iter().any(|h| h.tgid == held.tgid) {
            return Vec::new();
        }
        // An app process the kernel stopped: counted even when it runs again at once.
        if self.ready == Some(true) {
            return vec![Effect::Count(Count::Hold), release("ready")];
        }
        if self.failed_open {
            return vec![Effect::Count(Count::Hold), release("timeout")];
        }
        let counted = surely_app;
        info!(
            pod = %self.name(),
            container = role.name().unwrap_or("<not named yet>"),
            pid = held.tgid,
            "holding app until the proxy is ready"
        );
        self.held.push(Held { tgid: held.tgid, container_cgroup: held.container_cgroup, since: held.ktime, counted });
        let mut fx = if counted { vec![Effect::Count(Count::Hold)] } else { Vec::new() };
        fx.push(Effect::Pin { tgid: held.tgid, container_rel: rel });
        fx.extend(self.step(now));
        fx
    }

    /// The result of an effect.
    pub fn feedback(&mut self, fb: Feedback, rules: &Rules, now: Nanos) -> Vec<Effect> {
        self.settled = false;
        let mut fx = Vec::new();
        match fb {
            Feedback::PodCgroup { rel, id } => {
                if self.pod_cgroup.as_ref().map(|(_, i)| *i) != Some(id) {
                    debug!(pod = %self.name(), cgroup = %rel, "found pod cgroup");
                    self.pod_cgroup = Some((rel, id));
                    self.watching = None;
                    self.network_open = false;
                }
            }
            Feedback::Containers(seen) => self.merge_containers(seen),
            Feedback::LeftHeld(found) => fx.extend(self.adopt(found)),
            Feedback::Network { ok, detail } => {
                if !ok {
                    debug!(pod = %self.name(), "pod network namespace not open yet: {detail}");
                }
                self.network_open = ok;
                return fx;
            }
            Feedback::Probed { ready, detail } => {
                if self.finished && !ready {
                    // The proxy going away after the work is done says nothing about the pod.
                    return fx;
                }
                if self.ready != Some(ready) {
                    debug!(pod = %self.name(), %detail, ready, "proxy readiness changed");
                }
                self.ready = Some(ready);
                if ready {
                    fx.extend(self.release_all("ready"));
                }
            }
            Feedback::QuitDone { sidecar, outcome } => fx.extend(self.quit_done(&sidecar, outcome, rules, now)),
            Feedback::Signalled { sidecar, signal, signalled } => {
                let kind = self.sidecar_kind(&sidecar);
                let is_quit = self
                    .plan
                    .as_ref()
                    .and_then(|p| p.sidecars.iter().find(|s| s.name == sidecar))
                    .is_some_and(|s| s.quit.is_none());
                if is_quit {
                    info!(pod = %self.name(), %sidecar, signal, signalled, "signalled sidecar to quit");
                    fx.push(Effect::Count(Count::Quit { kind, result: if signalled > 0 { "ok" } else { "gone" } }));
                } else if signalled > 0 {
                    warn!(pod = %self.name(), %sidecar, signalled, "sidecar still running: sent SIGTERM");
                    fx.push(Effect::Count(Count::Escalation { kind }));
                    fx.push(Effect::Publish {
                        warning: true,
                        reason: "SidecarTerminated",
                        action: "Escalate",
                        note: format!("{sidecar} did not exit after the quit: sent SIGTERM to {signalled} process(es)"),
                    });
                }
                return fx;
            }
            Feedback::ConditionWritten { want, error } => {
                self.writing = false;
                fx.push(Effect::Count(Count::ConditionPatch { ok: error.is_none() }));
                if let Some(e) = error {
                    warn!(pod = %self.name(), "write {} condition: {e}", condition::CONDITION_TYPE);
                    // Let the next probe result retry (never a loop against the API).
                    if self.written.as_ref() == Some(&want) {
                        self.written = None;
                    }
                    return fx;
                }
            }
        }
        fx.extend(self.step(now));
        fx
    }

    /// Periodic work: retry what could not be done yet, and act on deadlines.
    pub fn tick(&mut self, now: Nanos) -> Vec<Effect> {
        let mut fx = Vec::new();
        let deadlines = !self.held.is_empty()
            || self.quits.values().any(|q| {
                matches!(
                    q.state,
                    QuitState::Failed { retry_at: Some(_) } | QuitState::Accepted { escalate_at: Some(_) }
                )
            });
        if self.settled && !deadlines {
            return fx;
        }
        let Some(plan) = self.plan.clone() else { return fx };
        // Hold timeouts, each from the moment the kernel stopped the process.
        let timeout = plan.hold_timeout.min(MAX_HOLD).as_nanos() as u64;
        let (expired, kept): (Vec<Held>, Vec<Held>) =
            self.held.drain(..).partition(|h| now.saturating_sub(h.since) >= timeout);
        self.held = kept;
        if !expired.is_empty() {
            let secs = plan.hold_timeout.min(MAX_HOLD).as_secs();
            warn!(pod = %self.name(), waited_s = secs, "proxy not ready in time: releasing the app anyway");
            if !self.failed_open {
                fx.push(Effect::Count(Count::FailOpen));
                fx.push(Effect::Publish {
                    warning: true,
                    reason: "HoldTimeout",
                    action: "Release",
                    note: format!("the sidecar proxy was not ready after {secs}s; released the app anyway"),
                });
            }
            self.failed_open = true;
            for h in expired {
                fx.extend(self.release_counted(&h, "timeout"));
            }
        }
        // Sidecars still running after they accepted a quit. (Quits to retry are re-issued by
        // the decision below.)
        let due: Vec<String> = self
            .quits
            .iter()
            .filter(|(_, q)| matches!(q.state, QuitState::Accepted { escalate_at: Some(at) } if now >= at))
            .map(|(n, _)| n.clone())
            .collect();
        for sidecar in due {
            fx.extend(self.escalate(&sidecar));
        }
        fx.extend(self.step(now));
        self.settled = fx.is_empty();
        fx
    }

    // ---- the decision step ----

    /// Brings the effects in line with what is known now. Idempotent: with nothing new, it asks
    /// for nothing.
    fn step(&mut self, now: Nanos) -> Vec<Effect> {
        let mut fx = Vec::new();
        let Some(plan) = self.plan.clone() else { return fx };
        let terminal = self.pod.as_ref().is_some_and(status::terminal);
        if terminal || plan.deleting {
            // Every container has ended, or the kubelet is stopping them: nothing to quit.
            fx.extend(self.release_all(if plan.deleting { "deleting" } else { "pod_done" }));
            fx.extend(self.stop_probe());
            fx.extend(self.release_resources());
            fx.extend(self.count_ignore(&plan));
            fx.extend(self.sync_condition());
            return fx;
        }
        let hold = wants_hold(&plan) && !self.shutting_down;
        if !self.released {
            fx.extend(self.attach(&plan, hold));
        }
        // Held processes whose container turned out not to be an app.
        let not_app: Vec<Held> = self
            .held
            .iter()
            .filter(|h| match self.role(h.container_cgroup) {
                Role::Sandbox => true,
                Role::Named(n) => !plan.apps.contains(&n),
                Role::Unnamed => !self.may_be_app(&plan),
            })
            .cloned()
            .collect();
        for h in not_app {
            self.held.retain(|x| x.tgid != h.tgid);
            fx.push(self.release(&h, "not_app"));
        }
        if !hold {
            fx.extend(self.release_all("not_held"));
        }
        match decide(&plan, &self.observe(&plan)) {
            Decision::Ignore(_) => fx.extend(self.count_ignore(&plan)),
            Decision::Wait(_) => {}
            Decision::Done => {
                self.finish();
                fx.extend(self.release_all("done"));
                fx.extend(self.stop_probe());
                // Kept until every sidecar has ended (or was signalled): an escalation still
                // needs to see whether it did.
                let ended = plan.sidecars.iter().all(|s| {
                    self.current(&s.name).is_none_or(|i| self.instance_ended(&i))
                        || self.quits.get(&s.name).is_some_and(|q| q.state == QuitState::Escalated)
                });
                if ended {
                    fx.extend(self.release_resources());
                }
            }
            Decision::Quit(sidecars) => {
                self.finish();
                fx.extend(self.release_all("done"));
                fx.extend(self.stop_probe());
                if self.done_ktime.is_none() {
                    self.done_ktime = plan
                        .apps
                        .iter()
                        .filter_map(|a| self.current(a))
                        .filter_map(|i| self.kernel_end(&i.id))
                        .map(|e| e.ktime)
                        .max();
                }
                for name in sidecars {
                    fx.extend(self.start_quit(&plan, &name, now));
                }
            }
        }
        fx.extend(self.manage_probe(&plan));
        fx.extend(self.sync_condition());
        fx
    }

    /// Finds, watches and names what the pod is made of on the node.
    fn attach(&mut self, plan: &PodPlan, hold: bool) -> Vec<Effect> {
        let mut fx = Vec::new();
        let Some((rel, id)) = self.pod_cgroup.clone() else {
            return vec![Effect::FindPodCgroup];
        };
        if self.watching != Some(hold) {
            // Containers already running are recorded with the kernel before it watches the pod.
            fx.push(Effect::ScanContainers { pod_rel: rel.clone(), adopt: true });
            fx.push(Effect::Watch { pod_cgroup: id, pod_rel: rel.clone(), hold });
            self.watching = Some(hold);
        }
        if hold && !self.left_held_searched {
            self.left_held_searched = true;
            fx.push(Effect::FindLeftHeld { pod_rel: rel.clone() });
        }
        if !self.network_open && !self.finished {
            // Opened ahead of time, so the quit needs no search; retried on ticks until the pod
            // has a live process.
            self.network_open = true;
            fx.push(Effect::OpenNetwork { pod_rel: rel });
        }
        if hold {
            // Classify known containers before they exec: sidecars, init containers and the
            // sandbox are never held; unnamed containers are held and judged at exec.
            let names: Vec<(u64, bool, Role)> = self
                .containers
                .iter()
                .filter(|(_, c)| !c.classified)
                .map(|(cg, c)| (*cg, c.exec_done, self.role(*cg)))
                .collect();
            for (cg, exec_done, role) in names {
                let hold_it = match role {
                    // Its first exec is past (an earlier agent held it): later ones run.
                    _ if exec_done => false,
                    Role::Sandbox => false,
                    Role::Named(n) => plan.apps.contains(&n),
                    Role::Unnamed => continue,
                };
                if let Some(c) = self.containers.get_mut(&cg) {
                    c.classified = true;
                }
                fx.push(Effect::ClassifyExec { container_cgroup: cg, hold: hold_it });
            }
        }
        fx
    }

    fn merge_containers(&mut self, seen: Vec<ContainerSeen>) {
        for s in seen {
            let c = self.containers.entry(s.cgroup_id).or_insert_with(|| Container {
                id: s.id.clone(),
                rel: s.rel.clone(),
                runtime_name: None,
                classified: false,
                exec_done: false,
                end: None,
            });
            if s.runtime_name.is_some() {
                c.runtime_name = s.runtime_name;
            }
            c.exec_done |= s.exec_done;
        }
    }

    /// Takes over processes an earlier agent left stopped at exec: apps (and containers not
    /// named yet) are held again with their original deadline; the rest run at once.
    fn adopt(&mut self, found: Vec<LeftHeld>) -> Vec<Effect> {
        let mut fx = Vec::new();
        for f in found {
            if let Some(c) = self.containers.get_mut(&f.container_cgroup) {
                // Its first exec is past: classified (again) so that later execs run.
                c.exec_done = true;
                c.classified = false;
            }
            if self.held.iter().any(|h| h.tgid == f.tgid) {
                continue;
            }
            // Counted by the agent that held it.
            let h = Held { tgid: f.tgid, container_cgroup: f.container_cgroup, since: f.since, counted: true };
            let app = match (&self.plan, self.role(f.container_cgroup)) {
                (_, Role::Sandbox) | (None, _) => false,
                (Some(p), Role::Named(n)) => p.apps.contains(&n),
                (Some(p), Role::Unnamed) => self.may_be_app(p),
            };
            if !app || self.shutting_down || self.finished || self.ready == Some(true) {
                let reason = if self.shutting_down {
                    "shutdown"
                } else if app && self.ready == Some(true) {
                    "ready"
                } else {
                    "not_app"
                };
                fx.push(self.release(&h, reason));
                continue;
            }
            info!(pod = %self.name(), pid = f.tgid, "found a process left held by an earlier agent");
            if let Some(c) = self.containers.get(&f.container_cgroup) {
                fx.push(Effect::Pin { tgid: f.tgid, container_rel: c.rel.clone() });
            }
            self.held.push(h);
        }
        fx
    }

    // ---- quits ----

    fn start_quit(&mut self, plan: &PodPlan, name: &str, now: Nanos) -> Vec<Effect> {
        let instance = self.current(name).map(|i| i.id);
        let mut failures = 0;
        if let Some(q) = self.quits.get(name)
            && (q.instance.is_none() || q.instance == instance)
        {
            // The same instance: only a failed quit whose retry is due goes again.
            match q.state {
                QuitState::Failed { retry_at: Some(at) } if now >= at => failures = q.failures,
                _ => return Vec::new(),
            }
        }
        let Some(sidecar) = plan.sidecars.iter().find(|s| s.name == name) else { return Vec::new() };
        let Some((pod_rel, _)) = self.pod_cgroup.clone() else {
            debug!(pod = %self.name(), "work done but the pod cgroup is not found yet");
            return Vec::new();
        };
        let (state, effect) = match (&sidecar.quit, sidecar.quit_signal) {
            (Some(endpoint), _) => (
                QuitState::InFlight,
                Some(Effect::Quit {
                    sidecar: name.to_owned(),
                    instance: instance.clone(),
                    endpoint: endpoint.clone(),
                    pod_rel,
                }),
            ),
            // A helper without a quit endpoint: its signal is the quit.
            (None, signal) => (
                QuitState::Escalated,
                self.container_rel(name).map(|container_rel| Effect::Signal {
                    sidecar: name.to_owned(),
                    container_rel,
                    signal,
                }),
            ),
        };
        self.quits.insert(name.to_owned(), Quit { instance, state, failures });
        effect.into_iter().collect()
    }

    fn quit_done(&mut self, sidecar: &str, outcome: QuitOutcome, rules: &Rules, now: Nanos) -> Vec<Effect> {
        let kind = self.sidecar_kind(sidecar);
        let mut fx = vec![Effect::Count(Count::Quit { kind, result: outcome.label() })];
        let name = self.name();
        let done_ktime = self.done_ktime;
        let Some(q) = self.quits.get_mut(sidecar) else { return fx };
        match &outcome {
            QuitOutcome::Accepted { status, attempts } => {
                q.state = QuitState::Accepted {
                    escalate_at: rules.escalate_after.map(|d| now.saturating_add(d.as_nanos() as u64)),
                };
                let after = done_ktime.map(|k| now.saturating_sub(k));
                if let Some(ns) = after {
                    fx.push(Effect::Count(Count::QuitLatency(ns as f64 / 1e9)));
                }
                let after_text = after.map(|ns| format!(" {}µs after the app finished", ns / 1000)).unwrap_or_default();
                info!(pod = %name, %sidecar, status, attempts, quit_after_us = after.map(|n| n / 1000), "sidecar accepted quit");
                fx.push(Effect::Publish {
                    warning: false,
                    reason: "SidecarQuit",
                    action: "Quit",
                    note: format!("asked {sidecar} to quit: HTTP {status}{after_text}"),
                });
            }
            QuitOutcome::Rejected { status, body } => {
                let note = format!("{sidecar} refused to quit: HTTP {status} {body}");
                fx.extend(failed_quit(q, &name, note, rules, now));
                if q.state == QuitState::Escalated {
                    fx.extend(self.escalate_now(sidecar));
                }
            }
            QuitOutcome::Failed { last, attempts, .. } => {
                let note = format!("could not quit {sidecar} after {attempts} attempts: {last}");
                fx.extend(failed_quit(q, &name, note, rules, now));
                if q.state == QuitState::Escalated {
                    fx.extend(self.escalate_now(sidecar));
                }
            }
        }
        fx
    }

    /// The escalation deadline of an accepted quit passed.
    fn escalate(&mut self, sidecar: &str) -> Vec<Effect> {
        if let Some(q) = self.quits.get_mut(sidecar) {
            q.state = QuitState::Escalated;
        }
        // Already gone: nothing to signal.
        if self.current(sidecar).is_some_and(|i| self.instance_ended(&i)) {
            return Vec::new();
        }
        self.escalate_now(sidecar)
    }

    fn escalate_now(&mut self, sidecar: &str) -> Vec<Effect> {
        match self.container_rel(sidecar) {
            Some(container_rel) => {
                vec![Effect::Signal { sidecar: sidecar.to_owned(), container_rel, signal: libc::SIGTERM }]
            }
            None => {
                debug!(pod = %self.name(), %sidecar, "cannot signal a sidecar whose cgroup is not known");
                Vec::new()
            }
        }
    }

    // ---- holding ----

    fn release(&self, h: &Held, reason: &'static str) -> Effect {
        let container_rel = self.containers.get(&h.container_cgroup).map(|c| c.rel.clone()).unwrap_or_default();
        Effect::Release { tgid: h.tgid, container_rel, reason, since: h.since }
    }

    /// Releases a held process; one not counted yet is counted now unless it turned out not to
    /// be an app.
    fn release_counted(&self, h: &Held, reason: &'static str) -> Vec<Effect> {
        let mut fx = Vec::new();
        if !h.counted && reason != "not_app" {
            fx.push(Effect::Count(Count::Hold));
        }
        fx.push(self.release(h, reason));
        fx
    }

    fn release_all(&mut self, reason: &'static str) -> Vec<Effect> {
        let held = std::mem::take(&mut self.held);
        held.iter().flat_map(|h| self.release_counted(h, reason)).collect()
    }

    /// The pod's plan is gone (bad annotations, hostNetwork): stop everything valet started.
    fn stand_down(&mut self, reason: &'static str) -> Vec<Effect> {
        let mut fx = self.release_all(reason);
        fx.extend(self.stop_probe());
        fx.extend(self.release_resources());
        self.stood_down = true;
        fx
    }

    fn finish(&mut self) {
        if !self.finished {
            debug!(pod = %self.name(), "work done");
        }
        self.finished = true;
    }

    /// Kernel maps, the network namespace and the probe go when the pod's work is done, not
    /// when the pod object is deleted (Jobs without a TTL keep it for days).
    fn release_resources(&mut self) -> Vec<Effect> {
        let mut fx = self.stop_probe();
        if self.released {
            return fx;
        }
        self.released = true;
        if self.watching.take().is_some()
            && let Some((_, id)) = &self.pod_cgroup
        {
            fx.push(Effect::Unwatch { pod_cgroup: *id });
        }
        for cg in self.containers.keys() {
            fx.push(Effect::ForgetContainer { container_cgroup: *cg });
        }
        // Always: a probe or a quit may have entered the namespace even when opening it ahead
        // of time did not work.
        self.network_open = false;
        fx.push(Effect::CloseNetwork);
        fx
    }

    // ---- probing and the condition ----

    fn manage_probe(&mut self, plan: &PodPlan) -> Vec<Effect> {
        let probed: Vec<_> = plan.sidecars.iter().filter(|s| s.ready.is_some()).cloned().collect();
        if self.finished || self.released || probed.is_empty() {
            return self.stop_probe();
        }
        let target = (self.pod_cgroup.as_ref().map(|(r, _)| r.clone()), plan.pod_ip.clone());
        let pace = if !self.held.is_empty() {
            Pace::Urgent
        } else if self.ready == Some(true) {
            Pace::Relaxed
        } else {
            Pace::Normal
        };
        match &mut self.probe {
            Some((t, p)) if *t == target => {
                if *p == pace {
                    return Vec::new();
                }
                *p = pace;
                vec![Effect::SetPace(pace)]
            }
            probe => {
                *probe = Some((target.clone(), pace));
                vec![Effect::StartProbe { sidecars: probed, pod_rel: target.0, pod_ip: target.1, pace }]
            }
        }
    }

    fn stop_probe(&mut self) -> Vec<Effect> {
        match self.probe.take() {
            Some(_) => vec![Effect::StopProbe],
            None => Vec::new(),
        }
    }

    /// Writes the condition when what we want differs from what the pod shows and what we
    /// wrote; one write at a time, so writes never overtake each other.
    fn sync_condition(&mut self) -> Vec<Effect> {
        let want = match (self.ready, self.failed_open) {
            (Some(true), _) => {
                ProxyReady { ready: true, reason: "ProxyReady", message: "the sidecar proxy reports ready".into() }
            }
            (_, true) => ProxyReady {
                ready: false,
                reason: "HoldTimeout",
                message: "the proxy was not ready in time; the app was released anyway".into(),
            },
            (Some(false), false) => ProxyReady {
                ready: false,
                reason: "ProxyNotReady",
                message: "the sidecar proxy is not ready yet".into(),
            },
            (None, false) => return Vec::new(),
        };
        if self.writing {
            return Vec::new();
        }
        let on_pod = self.pod.as_ref().is_some_and(|p| condition::already_set(p, &want));
        if self.written.as_ref() == Some(&want) || on_pod {
            self.written = Some(want);
            return Vec::new();
        }
        self.written = Some(want.clone());
        self.writing = true;
        vec![Effect::WriteCondition(want)]
    }

    fn count_ignore(&mut self, plan: &PodPlan) -> Vec<Effect> {
        let Decision::Ignore(reason) = decide(plan, &Observed::default()) else { return Vec::new() };
        let label = ignore_label(reason);
        if self.ignored == Some(label) {
            return Vec::new();
        }
        info!(pod = %self.name(), reason = ?reason, "no sidecar shutdown for this pod");
        self.ignored = Some(label);
        vec![Effect::Count(Count::Skip(label))]
    }

    // ---- what is known of containers ----

    /// Merges the API's view and the kernel's into the decision's input.
    fn observe(&self, plan: &PodPlan) -> Observed {
        self.observe_assuming(plan, None)
    }

    /// What [`PodState::observe`] would see once the container instance `assumed.0` ended as
    /// `assumed.1` (the kernel's word for it, as [`PodState::exit`] records it).
    fn observe_assuming(&self, plan: &PodPlan, assumed: Option<(&str, ExitOutcome)>) -> Observed {
        let mut observed = Observed::default();
        for name in &plan.apps {
            observed.apps.insert(name.clone(), self.app_state_assuming(name, assumed));
        }
        for sidecar in &plan.sidecars {
            let state = match self.app_state_assuming(&sidecar.name, assumed) {
                AppState::Exited(_) => SidecarState::Exited,
                AppState::Running => SidecarState::Running,
                AppState::Waiting => SidecarState::Unknown,
            };
            observed.sidecars.insert(sidecar.name.clone(), state);
        }
        observed.quits_done = self
            .quits
            .iter()
            .filter(|(name, q)| {
                matches!(q.state, QuitState::Accepted { .. } | QuitState::Escalated)
                    && (q.instance.is_none() || q.instance == self.current(name).map(|i| i.id))
            })
            .map(|(n, _)| n.clone())
            .collect();
        observed
    }

    /// The state of a container's current instance. The API has the last word on an instance it
    /// reports terminated; the kernel is faster for everything else. `assumed`: an instance taken
    /// as ended that way when neither has said it ended ([`PodState::observe_assuming`]).
    fn app_state_assuming(&self, name: &str, assumed: Option<(&str, ExitOutcome)>) -> AppState {
        let Some(instance) = self.current(name) else { return AppState::Waiting };
        if let Some(t) = instance.api.and_then(|s| s.state.as_ref()).and_then(|s| s.terminated.as_ref()) {
            return AppState::Exited(ExitOutcome::Code(t.exit_code));
        }
        if let Some(end) = self.kernel_end(&instance.id) {
            return AppState::Exited(outcome(end.end));
        }
        if let Some((id, ended)) = assumed
            && id == instance.id
        {
            return AppState::Exited(ended);
        }
        match instance.api.and_then(|s| s.state.as_ref()) {
            Some(s) if s.running.is_some() => AppState::Running,
            Some(_) => AppState::Waiting,
            // Known from its cgroup only: it has started.
            None if instance.api.is_none() && self.containers.values().any(|c| c.id == instance.id) => {
                AppState::Running
            }
            None => AppState::Waiting,
        }
    }

    fn instance_ended(&self, instance: &Instance<'_>) -> bool {
        instance.api.and_then(|s| s.state.as_ref()).is_some_and(|s| s.terminated.is_some())
            || self.kernel_end(&instance.id).is_some()
    }

    fn kernel_end(&self, id: &str) -> Option<KernelEnd> {
        self.containers.values().find(|c| c.id == id).and_then(|c| c.end)
    }

    /// The instance of container `name` that counts now: the newest one known to the API or to
    /// the node. The API reports a new instance about a second after the runtime started it; a
    /// restarted container's new cgroup has a higher id than the old one's.
    fn current(&self, name: &str) -> Option<Instance<'_>> {
        let pod = self.pod.as_ref()?;
        let api = status::statuses(pod).find(|s| s.name == name);
        let api_id = api.and_then(|s| hex_id(s.container_id.as_deref()));
        let newest = self
            .containers
            .iter()
            .filter(|(_, c)| self.name_of(&c.id).as_deref() == Some(name))
            .max_by_key(|(cg, _)| **cg)
            .map(|(cg, c)| (*cg, c.id.clone()));
        let from_api = |id: String| Instance { id, api };
        Some(match (api_id, newest) {
            (None, None) => return None,
            (Some(a), None) => from_api(a),
            (None, Some((_, k))) => Instance { id: k, api: None },
            (Some(a), Some((_, k))) if a == k => from_api(a),
            (Some(a), Some((kcg, k))) => {
                let a_cgroup = self.containers.iter().find(|(_, c)| c.id == a).map(|(cg, _)| *cg);
                let previous = api
                    .and_then(|s| s.last_state.as_ref())
                    .and_then(|l| l.terminated.as_ref())
                    .and_then(|t| hex_id(t.container_id.as_deref()));
                let api_terminated = api.and_then(|s| s.state.as_ref()).is_some_and(|s| s.terminated.is_some());
                let node_is_newer = match a_cgroup {
                    Some(acg) => kcg > acg,
                    // The API's instance ended and another one of the same name exists that is
                    // not the one before it: the kubelet restarted the container.
                    None => previous.as_deref() != Some(k.as_str()) && api_terminated,
                };
                if node_is_newer { Instance { id: k, api: None } } else { from_api(a) }
            }
        })
    }

    /// The container name an id belongs to: from the API (current or previous instance), else
    /// from the runtime's bundle.
    fn name_of(&self, id: &str) -> Option<String> {
        if let Some(name) = self.pod.as_ref().and_then(|p| status::name_of_id(p, id)) {
            return Some(name);
        }
        self.containers.values().find(|c| c.id == id).and_then(|c| match &c.runtime_name {
            Some(RuntimeName::Container(n)) => Some(n.clone()),
            _ => None,
        })
    }

    fn role(&self, cgroup: u64) -> Role {
        let Some(c) = self.containers.get(&cgroup) else { return Role::Unnamed };
        if c.runtime_name == Some(RuntimeName::Sandbox) {
            return Role::Sandbox;
        }
        self.name_of(&c.id).map_or(Role::Unnamed, Role::Named)
    }

    /// Whether an unnamed container may be one of the apps: some app's instance is not known
    /// yet. Once every app is known, an unnamed container is the sandbox, an init container or
    /// a sidecar.
    fn may_be_app(&self, plan: &PodPlan) -> bool {
        plan.apps.iter().any(|app| self.current(app).is_none())
    }

    /// The cgroup of a container's current instance.
    fn container_rel(&self, name: &str) -> Option<String> {
        let id = self.current(name)?.id;
        self.containers.values().find(|c| c.id == id).map(|c| c.rel.clone())
    }
}

/// Where a probe reaches the pod: its cgroup (for the network namespace) and its IP.
type ProbeTarget = (Option<String>, Option<String>);

enum Role {
    Sandbox,
    Named(String),
    Unnamed,
}

impl Role {
    fn name(&self) -> Option<&str> {
        match self {
            Role::Named(n) => Some(n),
            Role::Sandbox => Some("<sandbox>"),
            Role::Unnamed => None,
        }
    }
}

/// Whether the kernel should hold this pod's app containers at their first exec.
pub fn wants_hold(plan: &PodPlan) -> bool {
    plan.hold_app
        && !plan.istio_holds_app
        && plan.native_sidecars.is_empty()
        && plan.sidecars.iter().any(|s| s.ready.is_some())
        && !plan.apps.is_empty()
        && !plan.deleting
}

/// A quit that was refused or never answered: escalate when allowed, else retry with backoff a
/// bounded number of times.
fn failed_quit(q: &mut Quit, pod: &str, note: String, rules: &Rules, now: Nanos) -> Vec<Effect> {
    warn!(%pod, "could not quit sidecar: {note}");
    q.failures += 1;
    q.state = if rules.escalate_after.is_some() {
        QuitState::Escalated
    } else {
        let backoff = QUIT_RETRY_FIRST.saturating_mul(1 << (q.failures - 1).min(6)).min(QUIT_RETRY_MAX);
        QuitState::Failed {
            retry_at: (q.failures <= QUIT_RETRIES).then(|| now.saturating_add(backoff.as_nanos() as u64)),
        }
    };
    vec![Effect::Publish { warning: true, reason: "SidecarQuitFailed", action: "Quit", note }]
}

fn outcome(end: Option<ProcessEnd>) -> ExitOutcome {
    match end {
        Some(ProcessEnd::Exited(code)) => ExitOutcome::Code(code),
        Some(ProcessEnd::Signaled { signal, .. }) => ExitOutcome::Signal(signal),
        // Unreadable exit code: never claim success (the API's code replaces it).
        None => ExitOutcome::Code(255),
    }
}

fn ignore_label(reason: IgnoreReason) -> &'static str {
    match reason {
        IgnoreReason::RestartAlways => "restart_always",
        IgnoreReason::NativeSidecars => "native_sidecars",
        IgnoreReason::NoSidecars => "no_sidecars",
        IgnoreReason::NoApps => "no_apps",
        IgnoreReason::Deleting => "deleting",
    }
}

#[cfg(test)]
mod tests {
    //! Table tests of every transition, on plain pods: the effects a transition returns are the
    //! whole of what it does.
    use serde_json::{Value, json};

    use super::*;
    use crate::pod::fixtures;
    use crate::pod::spec::Endpoint;

    const POD_REL: &str = "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod6b1f.slice";
    const POD_CG: u64 = 100;
    const SANDBOX: u64 = 101;
    const APP: u64 = 102;
    const PROXY: u64 = 103;
    const APP2: u64 = 104;
    const PROXY2: u64 = 105;
    const SEC: Nanos = 1_000_000_000;

    fn id(cg: u64) -> String {
        format!("{cg:064x}")
    }

    fn rules(escalate: bool) -> Rules {
        Rules { defaults: SidecarDefaults::default(), escalate_after: escalate.then_some(Duration::from_secs(15)) }
    }

    /// A Job pod with an app `report` and `istio-proxy`; `statuses` as (name, cgroup of its
    /// current instance, state JSON), `extra` merged into metadata.annotations.
    fn pod(policy: &str, statuses: &[(&str, u64, Value)], annotations: &[(&str, &str)]) -> Pod {
        let statuses: Vec<Value> = statuses
            .iter()
            .map(|(name, cg, state)| {
                json!({"name": name, "ready": false, "restartCount": 0, "image": "i", "imageID": "",
                       "containerID": format!("containerd://{}", id(*cg)), "state": state})
            })
            .collect();
        let pod = fixtures::from_json(json!({
            "metadata": {"name": "job-x", "namespace": "batch", "uid": fixtures::UID,
                         "labels": {"valet.dev/enabled": "true"}},
            "spec": {"restartPolicy": policy, "nodeName": "n1", "containers": [
                {"name": "report", "image": "example/report:1"},
                {"name": "istio-proxy", "image": "docker.io/istio/proxyv2:1.22.0"}
            ]},
            "status": {"phase": "Running", "podIP": "10.1.2.3", "containerStatuses": statuses}
        }));
        fixtures::with_annotations(pod, annotations)
    }

    fn running() -> Value {
        json!({"running": {"startedAt": "2026-01-01T00:00:00Z"}})
    }

    fn terminated(code: i32) -> Value {
        json!({"terminated": {"exitCode": code, "reason": if code == 0 { "Completed" } else { "Error" }}})
    }

    fn seen(cg: u64, name: Option<RuntimeName>) -> ContainerSeen {
        ContainerSeen {
            cgroup_id: cg,
            rel: format!("{POD_REL}/cri-containerd-{}.scope", id(cg)),
            id: id(cg),
            runtime_name: name,
            exec_done: false,
        }
    }

    fn named(n: &str) -> Option<RuntimeName> {
        Some(RuntimeName::Container(n.into()))
    }

    /// A pod state and a clock.
    struct Drive {
        s: PodState,
        rules: Rules,
        now: Nanos,
    }

    impl Drive {
        fn new(escalate: bool) -> Drive {
            Drive { s: PodState::new(fixtures::UID), rules: rules(escalate), now: 1000 * SEC }
        }
        fn pod(&mut self, pod: Pod) -> Vec<Effect> {
            self.s.observe_pod(pod, &self.rules, self.now)
        }
        fn feed(&mut self, fb: Feedback) -> Vec<Effect> {
            self.s.feedback(fb, &self.rules, self.now)
        }
        fn exit(&mut self, cg: u64, code: i32) -> Vec<Effect> {
            let exit = ExitSeen { container_cgroup: cg, tgid: 7, end: Some(ProcessEnd::Exited(code)), ktime: self.now };
            self.s.exit(exit, self.now)
        }
        fn held(&mut self, cg: u64, tgid: u32, comm: &str) -> Vec<Effect> {
            let held = HeldSeen { container_cgroup: cg, tgid, ktime: self.now, comm: comm.into() };
            self.s.held(held, self.now)
        }
        fn after(&mut self, ms: u64) -> Vec<Effect> {
            self.now += ms * 1_000_000;
            self.s.tick(self.now)
        }
        /// The pod found on the node: cgroup, then its containers (named by the runtime).
        fn found(&mut self, pod: Pod) -> Vec<Effect> {
            let mut fx = self.pod(pod);
            assert!(fx.contains(&Effect::FindPodCgroup), "looks for the pod cgroup first: {fx:?}");
            fx.extend(self.feed(Feedback::PodCgroup { rel: POD_REL.into(), id: POD_CG }));
            fx.extend(self.feed(Feedback::Containers(vec![
                seen(SANDBOX, Some(RuntimeName::Sandbox)),
                seen(APP, named("report")),
                seen(PROXY, named("istio-proxy")),
            ])));
            fx
        }
    }

    fn quits(fx: &[Effect]) -> Vec<(String, Option<String>)> {
        fx.iter()
            .filter_map(|e| match e {
                Effect::Quit { sidecar, instance, .. } => Some((sidecar.clone(), instance.clone())),
                _ => None,
            })
            .collect()
    }

    fn releases(fx: &[Effect]) -> Vec<(u32, &'static str)> {
        fx.iter()
            .filter_map(|e| match e {
                Effect::Release { tgid, reason, .. } => Some((*tgid, *reason)),
                _ => None,
            })
            .collect()
    }

    fn writes(fx: &[Effect]) -> Vec<(bool, &'static str)> {
        fx.iter()
            .filter_map(|e| match e {
                Effect::WriteCondition(c) => Some((c.ready, c.reason)),
                _ => None,
            })
            .collect()
    }

    fn signals(fx: &[Effect]) -> Vec<(String, i32)> {
        fx.iter()
            .filter_map(|e| match e {
                Effect::Signal { sidecar, signal, .. } => Some((sidecar.clone(), *signal)),
                _ => None,
            })
            .collect()
    }

    fn has(fx: &[Effect], want: &Effect) -> bool {
        fx.contains(want)
    }

    fn accepted() -> QuitOutcome {
        QuitOutcome::Accepted { status: 200, attempts: 1 }
    }

    #[test]
    fn a_found_pod_is_watched_named_opened_and_probed() {
        let mut d = Drive::new(true);
        let fx = d.found(pod("Never", &[], &[]));
        assert!(has(&fx, &Effect::Watch { pod_cgroup: POD_CG, pod_rel: POD_REL.into(), hold: false }), "{fx:?}");
        assert!(has(&fx, &Effect::ScanContainers { pod_rel: POD_REL.into(), adopt: true }));
        assert!(has(&fx, &Effect::OpenNetwork { pod_rel: POD_REL.into() }));
        assert!(fx.iter().any(|e| matches!(e, Effect::StartProbe { pace: Pace::Normal, .. })), "{fx:?}");
        assert!(
            !fx.iter().any(|e| matches!(e, Effect::ClassifyExec { .. } | Effect::FindLeftHeld { .. })),
            "not held: {fx:?}"
        );
        // Nothing new: nothing asked.
        let again = d.after(250);
        assert!(again.is_empty(), "idempotent: {again:?}");
    }

    #[test]
    fn a_held_pod_classifies_known_containers_before_they_exec() {
        let mut d = Drive::new(true);
        let fx = d.found(pod("Never", &[], &[("valet.dev/hold-app", "true")]));
        assert!(has(&fx, &Effect::Watch { pod_cgroup: POD_CG, pod_rel: POD_REL.into(), hold: true }), "{fx:?}");
        assert!(has(&fx, &Effect::FindLeftHeld { pod_rel: POD_REL.into() }));
        for (cg, hold) in [(SANDBOX, false), (APP, true), (PROXY, false)] {
            assert!(has(&fx, &Effect::ClassifyExec { container_cgroup: cg, hold }), "{cg} {hold}: {fx:?}");
        }
        // A container the runtime did not name is judged at exec (held by default).
        let fx = d.feed(Feedback::Containers(vec![seen(APP2, None)]));
        assert!(!fx.iter().any(|e| matches!(e, Effect::ClassifyExec { container_cgroup: APP2, .. })), "{fx:?}");
    }

    #[test]
    fn the_apps_end_quits_the_sidecar_once() {
        let mut d = Drive::new(true);
        d.found(pod("Never", &[], &[]));
        let fx = d.exit(APP, 0);
        assert_eq!(quits(&fx), [("istio-proxy".to_owned(), Some(id(PROXY)))]);
        assert!(has(&fx, &Effect::StopProbe), "no probing once the work is done: {fx:?}");
        assert!(has(&fx, &Effect::Count(Count::ContainerEnd(Some(ProcessEnd::Exited(0))))));
        // The API catching up, a repeated exit, ticks: never a second quit.
        let mut later = d.pod(pod("Never", &[("report", APP, terminated(0)), ("istio-proxy", PROXY, running())], &[]));
        later.extend(d.exit(APP, 0));
        assert!(quits(&later).is_empty(), "{later:?}");
        d.now += 3 * SEC / 1000;
        let fx = d.feed(Feedback::QuitDone { sidecar: "istio-proxy".into(), outcome: accepted() });
        assert!(has(&fx, &Effect::Count(Count::Quit { kind: "istio", result: "ok" })), "{fx:?}");
        assert!(
            fx.iter().any(|e| matches!(e, Effect::Count(Count::QuitLatency(s)) if (*s - 0.003).abs() < 1e-9)),
            "{fx:?}"
        );
        assert!(fx.iter().any(|e| matches!(e, Effect::Publish { reason: "SidecarQuit", warning: false, .. })));
        assert!(!has(&fx, &Effect::CloseNetwork), "kept until the sidecar has ended: {fx:?}");
        assert!(quits(&d.after(250)).is_empty());
        // The sidecar exits: the node's resources for the pod go (its object may stay for days).
        let fx = d.exit(PROXY, 0);
        assert!(has(&fx, &Effect::Unwatch { pod_cgroup: POD_CG }), "{fx:?}");
        assert!(has(&fx, &Effect::CloseNetwork), "{fx:?}");
        for cg in [SANDBOX, APP, PROXY] {
            assert!(has(&fx, &Effect::ForgetContainer { container_cgroup: cg }), "{cg}: {fx:?}");
        }
        assert!(d.after(20_000).is_empty(), "the sidecar ended: no escalation");
    }

    fn quit_endpoints(fx: &[Effect]) -> Vec<Endpoint> {
        fx.iter()
            .filter_map(|e| match e {
                Effect::Quit { endpoint, .. } => Some(endpoint.clone()),
                _ => None,
            })
            .collect()
    }

    /// What is armed ahead is exactly what the end then decides: the same endpoints, for each
    /// way the app can end, under each restart policy; and nothing once the work is done.
    #[test]
    fn the_quit_armed_ahead_is_the_quit_the_end_then_decides() {
        let ends = [
            Some(ProcessEnd::Exited(0)),
            Some(ProcessEnd::Exited(1)),
            Some(ProcessEnd::Signaled { signal: 9, core_dumped: false }),
            None,
        ];
        for policy in ["Never", "OnFailure"] {
            for end in ends {
                let mut d = Drive::new(true);
                d.found(pod(policy, &[], &[]));
                d.feed(Feedback::Network { ok: false, detail: "no process yet".into() });
                assert_eq!(d.s.quit_ahead(), None, "not while the pod's network is not open");
                d.feed(Feedback::Network { ok: true, detail: String::new() });
                let arm = d.s.quit_ahead().expect("armed once the network is open");
                assert_eq!((arm.uid.as_str(), arm.pod_cgroup, arm.container_cgroup), (fixtures::UID, POD_CG, APP));
                assert_eq!(arm.pod_rel, POD_REL);
                let istio = vec![Endpoint { port: 15020, path: "/quitquitquit".into() }];
                assert_eq!(arm.on_success, istio, "{policy}");
                let on_failure = if policy == "Never" { istio.clone() } else { Vec::new() };
                assert_eq!(arm.on_failure, on_failure, "{policy}: the kubelet restarts a failed app");
                let armed = if end == Some(ProcessEnd::Exited(0)) { &arm.on_success } else { &arm.on_failure };
                let fx = d.s.exit(ExitSeen { container_cgroup: APP, tgid: 7, end, ktime: d.now }, d.now);
                assert_eq!(&quit_endpoints(&fx), armed, "{policy} {end:?}: {fx:?}");
                if !armed.is_empty() {
                    assert_eq!(d.s.quit_ahead(), None, "{policy} {end:?}: the work is done");
                }
            }
        }
    }

    #[test]
    fn a_quit_is_armed_ahead_only_when_one_end_can_complete_the_work() {
        let network = || Feedback::Network { ok: true, detail: String::new() };
        // Two apps: neither end alone completes the work; once one has ended, the other's does.
        let two_apps = || {
            let mut json = serde_json::to_value(pod("Never", &[], &[])).unwrap_or_default();
            if let Some(containers) = json["spec"]["containers"].as_array_mut() {
                containers.push(json!({"name": "upload", "image": "example/upload:1"}));
            }
            fixtures::from_json(json)
        };
        let mut d = Drive::new(true);
        d.found(two_apps());
        d.feed(Feedback::Containers(vec![seen(APP2, named("upload"))]));
        d.feed(network());
        assert_eq!(d.s.quit_ahead(), None, "two apps running");
        assert!(quit_endpoints(&d.exit(APP2, 0)).is_empty());
        assert_eq!(d.s.quit_ahead().map(|a| a.container_cgroup), Some(APP), "the last app running");

        // Deleting, terminal, released, shutting down: nothing armed.
        let mut d = Drive::new(true);
        d.found(pod("Never", &[], &[]));
        d.feed(network());
        assert!(d.s.quit_ahead().is_some());
        let mut json = serde_json::to_value(pod("Never", &[], &[])).unwrap_or_default();
        json["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
        d.pod(fixtures::from_json(json));
        assert_eq!(d.s.quit_ahead(), None, "deleting");

        let mut d = Drive::new(true);
        d.found(pod("Never", &[], &[]));
        d.feed(network());
        d.s.shutdown();
        assert_eq!(d.s.quit_ahead(), None, "shutting down");

        let mut d = Drive::new(true);
        d.found(pod("Never", &[], &[]));
        d.feed(network());
        d.s.removed();
        assert_eq!(d.s.quit_ahead(), None, "released");

        // The API already reports the app's end: nothing left to arm.
        let mut d = Drive::new(true);
        d.found(pod("Never", &[("report", APP, terminated(0)), ("istio-proxy", PROXY, running())], &[]));
        d.feed(network());
        assert_eq!(d.s.quit_ahead(), None, "already done");
    }

    #[test]
    fn on_failure_waits_for_success_and_follows_the_restarted_instance() {
        let mut d = Drive::new(true);
        d.found(pod("OnFailure", &[], &[]));
        assert!(quits(&d.exit(APP, 1)).is_empty(), "the kubelet restarts it: the proxy is still needed");
        // The API shows the failed instance; the kubelet restarts the container in a new cgroup
        // the runtime names before the API does.
        let api = pod("OnFailure", &[("report", APP, terminated(1)), ("istio-proxy", PROXY, running())], &[]);
        assert!(quits(&d.pod(api)).is_empty());
        let fx = d.feed(Feedback::Containers(vec![seen(APP2, named("report"))]));
        assert!(quits(&fx).is_empty(), "the new instance runs: {fx:?}");
        let fx = d.exit(APP2, 0);
        assert_eq!(quits(&fx), [("istio-proxy".to_owned(), Some(id(PROXY)))], "the newest instance counts: {fx:?}");
    }

    #[test]
    fn the_api_has_the_last_word_on_an_instance_it_reports_terminated() {
        let mut d = Drive::new(true);
        d.found(pod("OnFailure", &[("report", APP, running()), ("istio-proxy", PROXY, running())], &[]));
        // The kernel could not read the exit code (255, never success)...
        let exit = ExitSeen { container_cgroup: APP, tgid: 7, end: None, ktime: d.now };
        assert!(quits(&d.s.exit(exit, d.now)).is_empty());
        // ...the API says it exited 0: the work is done.
        let fx = d.pod(pod("OnFailure", &[("report", APP, terminated(0)), ("istio-proxy", PROXY, running())], &[]));
        assert_eq!(quits(&fx).len(), 1, "{fx:?}");
        // And the other way round: the kernel saw 0 but the API says 3 (the API wins).
        let mut d = Drive::new(true);
        d.found(pod("OnFailure", &[("report", APP, terminated(3)), ("istio-proxy", PROXY, running())], &[]));
        assert!(quits(&d.exit(APP, 0)).is_empty());
    }

    #[test]
    fn a_sidecar_restarted_after_its_quit_is_quit_again() {
        let mut d = Drive::new(true);
        d.found(pod("OnFailure", &[], &[]));
        assert_eq!(quits(&d.exit(APP, 0)).len(), 1);
        d.feed(Feedback::QuitDone { sidecar: "istio-proxy".into(), outcome: accepted() });
        // SIGTERMed, it exited 143; the kubelet restarted it as a new instance.
        d.exit(PROXY, 143);
        let api = pod("OnFailure", &[("report", APP, terminated(0)), ("istio-proxy", PROXY2, running())], &[]);
        let mut fx = d.pod(api);
        fx.extend(d.feed(Feedback::Containers(vec![seen(PROXY2, named("istio-proxy"))])));
        assert_eq!(quits(&fx), [("istio-proxy".to_owned(), Some(id(PROXY2)))], "{fx:?}");
    }

    #[test]
    fn a_failed_quit_is_escalated_or_retried_with_backoff_never_in_a_loop() {
        let failed = || QuitOutcome::Failed { last: "connection refused".into(), label: "refused", attempts: 9 };
        // Escalation on: SIGTERM at once.
        let mut d = Drive::new(true);
        d.found(pod("Never", &[], &[]));
        d.exit(APP, 0);
        let fx = d.feed(Feedback::QuitDone { sidecar: "istio-proxy".into(), outcome: failed() });
        assert_eq!(signals(&fx), [("istio-proxy".to_owned(), libc::SIGTERM)], "{fx:?}");
        assert!(fx.iter().any(|e| matches!(e, Effect::Publish { reason: "SidecarQuitFailed", warning: true, .. })));
        assert!(quits(&d.after(120_000)).is_empty(), "escalated: not retried");
        // Escalation off: retried after 1 s, 2 s, 4 s ... and at most QUIT_RETRIES times.
        let mut d = Drive::new(false);
        d.found(pod("Never", &[], &[]));
        d.exit(APP, 0);
        let mut sent = 1;
        let mut waited = Vec::new();
        for _ in 0..30 {
            d.feed(Feedback::QuitDone { sidecar: "istio-proxy".into(), outcome: failed() });
            let mut ms = 0;
            loop {
                ms += 250;
                let fx = d.after(250);
                if !quits(&fx).is_empty() {
                    sent += 1;
                    waited.push(ms);
                    break;
                }
                if ms > 120_000 {
                    break;
                }
            }
        }
        assert_eq!(sent, 1 + QUIT_RETRIES as usize, "bounded retries");
        assert_eq!(&waited[..4], [1000, 2000, 4000, 8000], "backoff doubles: {waited:?}");
        assert!(waited.iter().all(|ms| *ms <= 60_000), "{waited:?}");
    }

    #[test]
    fn an_accepted_quit_is_escalated_only_if_the_sidecar_is_still_there() {
        for sidecar_exits in [false, true] {
            let mut d = Drive::new(true);
            d.found(pod("Never", &[], &[]));
            d.exit(APP, 0);
            d.feed(Feedback::QuitDone { sidecar: "istio-proxy".into(), outcome: accepted() });
            assert!(signals(&d.after(14_000)).is_empty(), "before the deadline");
            if sidecar_exits {
                d.exit(PROXY, 0);
            }
            let fx = d.after(1_000);
            let want: Vec<(String, i32)> =
                if sidecar_exits { vec![] } else { vec![("istio-proxy".into(), libc::SIGTERM)] };
            assert_eq!(signals(&fx), want, "sidecar exits: {sidecar_exits}");
            assert!(signals(&d.after(60_000)).is_empty(), "once");
        }
    }

    #[test]
    fn held_apps_run_when_the_proxy_is_ready_and_the_condition_says_so() {
        let mut d = Drive::new(true);
        d.found(pod("Never", &[], &[("valet.dev/hold-app", "true")]));
        let fx = d.held(APP, 42, "report");
        assert!(has(&fx, &Effect::Count(Count::Hold)));
        assert!(has(&fx, &Effect::SetPace(Pace::Urgent)), "{fx:?}");
        assert!(
            fx.iter().any(|e| matches!(e, Effect::Pin { tgid: 42, container_rel } if !container_rel.is_empty())),
            "pinned when held, in its container: {fx:?}"
        );
        assert!(releases(&fx).is_empty());
        let fx = d.feed(Feedback::Probed { ready: false, detail: String::new() });
        assert_eq!(writes(&fx), [(false, "ProxyNotReady")]);
        // The kubelet's `ready` flag (at once for a container without a readinessProbe) is not
        // the proxy's answer: it releases nothing.
        let api = pod("Never", &[("istio-proxy", PROXY, running())], &[("valet.dev/hold-app", "true")]);
        let mut api = api;
        if let Some(s) = api.status.as_mut().and_then(|s| s.container_statuses.as_mut()) {
            s[0].ready = true;
        }
        assert!(releases(&d.pod(api)).is_empty());
        d.feed(Feedback::ConditionWritten {
            want: ProxyReady {
                ready: false,
                reason: "ProxyNotReady",
                message: "the sidecar proxy is not ready yet".into(),
            },
            error: None,
        });
        let fx = d.feed(Feedback::Probed { ready: true, detail: String::new() });
        assert_eq!(releases(&fx), [(42, "ready")]);
        assert_eq!(writes(&fx), [(true, "ProxyReady")]);
        assert!(has(&fx, &Effect::SetPace(Pace::Relaxed)), "{fx:?}");
        // A later app of the pod runs at once.
        assert_eq!(releases(&d.held(APP, 43, "report")), [(43, "ready")]);
    }

    #[test]
    fn the_sandbox_sidecars_and_init_containers_are_never_held() {
        let mut d = Drive::new(true);
        d.found(pod("Never", &[], &[("valet.dev/hold-app", "true")]));
        assert_eq!(releases(&d.held(SANDBOX, 1, "pause")), [(1, "not_app")]);
        assert_eq!(releases(&d.held(PROXY, 2, "pilot-agent")), [(2, "not_app")]);
        // Unnamed by the runtime: a `pause` is the sandbox; once every app is known, any other
        // unnamed container is not an app either.
        d.feed(Feedback::Containers(vec![seen(APP2, None)]));
        assert_eq!(releases(&d.held(APP2, 3, "pause")), [(3, "not_app")]);
        assert_eq!(releases(&d.held(APP2, 4, "istio-iptables")), [(4, "not_app")], "every app's instance is known");
    }

    #[test]
    fn a_hold_times_out_from_the_kernels_stop_time_and_fails_open() {
        let mut d = Drive::new(true);
        d.found(pod("Never", &[], &[("valet.dev/hold-app", "true"), ("valet.dev/hold-timeout", "2s")]));
        d.held(APP, 42, "report");
        assert!(releases(&d.after(1_750)).is_empty());
        let fx = d.after(250);
        assert_eq!(releases(&fx), [(42, "timeout")]);
        assert!(has(&fx, &Effect::Count(Count::FailOpen)));
        assert!(fx.iter().any(|e| matches!(e, Effect::Publish { reason: "HoldTimeout", warning: true, .. })));
        assert_eq!(writes(&fx), [(false, "HoldTimeout")]);
        // Later apps of a pod that failed open are not held either.
        assert_eq!(releases(&d.held(APP, 43, "report")), [(43, "timeout")]);
    }

    #[test]
    fn adopted_processes_keep_their_original_deadline() {
        let mut d = Drive::new(true);
        let annotations = [("valet.dev/hold-app", "true"), ("valet.dev/hold-timeout", "10s")];
        d.found(pod("Never", &[], &annotations));
        // An earlier agent stopped this app 9.5 s ago; the sidecar's was stopped too.
        let fx = d.feed(Feedback::LeftHeld(vec![
            LeftHeld { tgid: 50, container_cgroup: APP, since: d.now - 9_500_000_000 },
            LeftHeld { tgid: 51, container_cgroup: PROXY, since: d.now - 9_500_000_000 },
        ]));
        assert_eq!(releases(&fx), [(51, "not_app")]);
        assert!(has(&fx, &Effect::ClassifyExec { container_cgroup: APP, hold: false }), "its later execs run: {fx:?}");
        assert!(releases(&d.after(250)).is_empty());
        assert_eq!(releases(&d.after(250)), [(50, "timeout")], "10 s after it was stopped, not after adoption");
    }

    #[test]
    fn nothing_stays_frozen_when_the_pod_changes_under_a_hold() {
        type Change = fn(&mut Drive) -> Vec<Effect>;
        let annotations = [("valet.dev/hold-app", "true")];
        let cases: [(&str, Change, &str); 5] = [
            (
                "malformed annotation",
                |d| d.pod(pod("Never", &[], &[("valet.dev/hold-app", "yes please")])),
                "invalid_spec",
            ),
            ("hold removed", |d| d.pod(pod("Never", &[], &[])), "not_held"),
            ("label removed or pod deleted", |d| d.s.removed(), "pod_gone"),
            ("agent shutdown", |d| d.s.shutdown(), "shutdown"),
            (
                "deletion started",
                |d| {
                    let mut p = pod("Never", &[], &[("valet.dev/hold-app", "true")]);
                    let mut json = serde_json::to_value(&p).unwrap_or_default();
                    json["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
                    p = fixtures::from_json(json);
                    d.pod(p)
                },
                "deleting",
            ),
        ];
        for (what, change, reason) in cases {
            let mut d = Drive::new(true);
            d.found(pod("Never", &[], &annotations));
            d.held(APP, 42, "report");
            let fx = change(&mut d);
            assert_eq!(releases(&fx), [(42, reason)], "{what}: {fx:?}");
            assert!(releases(&d.after(200_000)).is_empty(), "{what}: released once");
        }
        // The malformed annotation is reported once, with the kernel told to stop holding.
        let mut d = Drive::new(true);
        d.found(pod("Never", &[], &annotations));
        let fx = d.pod(pod("Never", &[], &[("valet.dev/hold-app", "yes please")]));
        assert!(has(&fx, &Effect::Unwatch { pod_cgroup: POD_CG }), "{fx:?}");
        assert!(has(&fx, &Effect::StopProbe));
        assert!(fx.iter().any(|e| matches!(e, Effect::Publish { reason: "MalformedAnnotation", .. })));
        assert!(d.pod(pod("Never", &[], &[("valet.dev/hold-app", "yes please")])).is_empty(), "once");
    }

    #[test]
    fn shutdown_also_releases_what_the_kernel_stopped_after_the_last_event() {
        let mut d = Drive::new(true);
        d.found(pod("Never", &[], &[("valet.dev/hold-app", "true")]));
        let fx = d.s.shutdown();
        assert!(has(&fx, &Effect::FindLeftHeld { pod_rel: POD_REL.into() }), "{fx:?}");
        let fx = d.feed(Feedback::LeftHeld(vec![LeftHeld { tgid: 60, container_cgroup: APP, since: d.now }]));
        assert_eq!(releases(&fx), [(60, "shutdown")]);
        assert_eq!(releases(&d.held(APP, 61, "report")), [(61, "not_app")], "nothing is held any more");
    }

    #[test]
    fn condition_writes_never_overtake_each_other() {
        let mut d = Drive::new(true);
        d.found(pod("Never", &[], &[]));
        let not_ready = d.feed(Feedback::Probed { ready: false, detail: String::new() });
        assert_eq!(writes(&not_ready), [(false, "ProxyNotReady")]);
        // Ready while the first write is in flight: nothing until it is answered.
        assert!(writes(&d.feed(Feedback::Probed { ready: true, detail: String::new() })).is_empty());
        assert!(writes(&d.after(250)).is_empty());
        let want =
            ProxyReady { ready: false, reason: "ProxyNotReady", message: "the sidecar proxy is not ready yet".into() };
        let fx = d.feed(Feedback::ConditionWritten { want, error: None });
        assert_eq!(writes(&fx), [(true, "ProxyReady")], "then the newest state: {fx:?}");
        // A failed write is retried by the next probe, not in a loop.
        let want = ProxyReady { ready: true, reason: "ProxyReady", message: "the sidecar proxy reports ready".into() };
        let fx = d.feed(Feedback::ConditionWritten { want, error: Some("503".into()) });
        assert!(writes(&fx).is_empty());
        assert!(has(&fx, &Effect::Count(Count::ConditionPatch { ok: false })));
        assert_eq!(writes(&d.feed(Feedback::Probed { ready: true, detail: String::new() })), [(true, "ProxyReady")]);
    }

    #[test]
    fn the_condition_tells_the_truth_after_the_work_is_done() {
        let mut d = Drive::new(true);
        d.found(pod("Never", &[], &[]));
        d.feed(Feedback::Probed { ready: false, detail: String::new() });
        // A short Job: the app ends while "not ready" is being written, then the last probe
        // result (sent before the probe stopped) says ready.
        d.exit(APP, 0);
        assert!(
            writes(&d.feed(Feedback::Probed { ready: true, detail: String::new() })).is_empty(),
            "one write at a time"
        );
        let want =
            ProxyReady { ready: false, reason: "ProxyNotReady", message: "the sidecar proxy is not ready yet".into() };
        assert_eq!(writes(&d.feed(Feedback::ConditionWritten { want, error: None })), [(true, "ProxyReady")]);
        let ready = ProxyReady { ready: true, reason: "ProxyReady", message: "the sidecar proxy reports ready".into() };
        d.feed(Feedback::ConditionWritten { want: ready, error: None });
        // The proxy going away after its quit never flips it back.
        assert!(writes(&d.feed(Feedback::Probed { ready: false, detail: String::new() })).is_empty());
    }

    #[test]
    fn pods_valet_leaves_alone_are_counted_once() {
        let with = |policy: &str, a: &[(&str, &str)]| pod(policy, &[], a);
        let mut d = Drive::new(true);
        let fx = d.pod(with("Always", &[]));
        assert!(has(&fx, &Effect::Count(Count::Skip("restart_always"))), "{fx:?}");
        assert!(!d.pod(with("Always", &[])).iter().any(|e| matches!(e, Effect::Count(_))));
        let mut d = Drive::new(true);
        let mut p = with("Never", &[]);
        if let Some(s) = p.spec.as_mut() {
            s.host_network = Some(true);
        }
        let fx = d.pod(p);
        assert!(has(&fx, &Effect::Count(Count::Skip("host_network"))), "{fx:?}");
        assert!(!fx.contains(&Effect::FindPodCgroup), "a hostNetwork pod's loopback is the node's");
    }

    /// What the README promises for `restartPolicy: Always`: never a quit, but the pod is still
    /// watched, its proxy probed and the condition written, and with `hold-app` its app is held.
    #[test]
    fn a_restart_always_pod_is_held_and_probed_but_never_quit() {
        let mut d = Drive::new(true);
        let fx = d.found(pod("Always", &[], &[("valet.dev/hold-app", "true")]));
        assert!(has(&fx, &Effect::Count(Count::Skip("restart_always"))), "{fx:?}");
        assert!(has(&fx, &Effect::Watch { pod_cgroup: POD_CG, pod_rel: POD_REL.into(), hold: true }), "{fx:?}");
        assert!(has(&fx, &Effect::ClassifyExec { container_cgroup: APP, hold: true }), "{fx:?}");
        assert!(fx.iter().any(|e| matches!(e, Effect::StartProbe { .. })), "{fx:?}");
        d.held(APP, 42, "report");
        let fx = d.feed(Feedback::Probed { ready: true, detail: String::new() });
        assert_eq!(releases(&fx), [(42, "ready")]);
        assert_eq!(writes(&fx), [(true, "ProxyReady")]);
        let mut fx = d.exit(APP, 0);
        let hold = [("valet.dev/hold-app", "true")];
        fx.extend(d.pod(pod("Always", &[("report", APP, terminated(0)), ("istio-proxy", PROXY, running())], &hold)));
        fx.extend(d.after(60_000));
        assert!(quits(&fx).is_empty() && signals(&fx).is_empty(), "never quit: {fx:?}");
    }

    #[test]
    fn a_signal_sidecar_is_ended_with_its_signal() {
        let mut d = Drive::new(true);
        let mut p = pod(
            "Never",
            &[],
            &[
                ("valet.dev/sidecars", "istio-proxy"),
                ("valet.dev/sidecar-kind.istio-proxy", "signal"),
                ("valet.dev/quit-signal.istio-proxy", "SIGINT"),
            ],
        );
        if let Some(s) = p.spec.as_mut() {
            s.containers[1].name = "istio-proxy".into();
        }
        let fx = d.found(p);
        assert!(!fx.iter().any(|e| matches!(e, Effect::StartProbe { .. })), "no readiness endpoint: no probe");
        let fx = d.exit(APP, 0);
        assert!(quits(&fx).is_empty());
        assert_eq!(signals(&fx), [("istio-proxy".to_owned(), libc::SIGINT)]);
        let fx = d.feed(Feedback::Signalled { sidecar: "istio-proxy".into(), signal: libc::SIGINT, signalled: 1 });
        assert!(has(&fx, &Effect::Count(Count::Quit { kind: "signal", result: "ok" })), "{fx:?}");
        assert!(signals(&d.after(60_000)).is_empty(), "no escalation of a signal quit");
    }

    #[test]
    fn a_quit_waits_for_the_pod_cgroup_and_goes_out_once_it_is_found() {
        let mut d = Drive::new(true);
        d.pod(pod("Never", &[("report", APP, terminated(0)), ("istio-proxy", PROXY, running())], &[]));
        assert!(d.after(250).contains(&Effect::FindPodCgroup), "still looking");
        let fx = d.feed(Feedback::PodCgroup { rel: POD_REL.into(), id: POD_CG });
        assert_eq!(quits(&fx), [("istio-proxy".to_owned(), Some(id(PROXY)))], "{fx:?}");
        let _ = Endpoint { port: 1, path: String::new() };
    }
}
