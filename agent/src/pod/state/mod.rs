//! Everything the agent knows about one opted-in pod, and the transitions that change it.
//!
//! Each transition takes plain inputs (the pod object, an exit or a hold the kernel saw, the
//! result of an effect, a tick with the current time) and returns the [`Effect`]s to carry out.
//! No I/O and no clock reads here: the controller routes inputs in and hands effects to `act`.
//!
//! A pod goes through the [`Phase`]s: working (its cgroup watched, its containers named, its
//! network namespace opened, its apps held until the proxy is ready or the hold times out) →
//! done (the sidecars asked to quit) → released (the node's resources let go). The API can move
//! it to released at any time (a label removed, annotations broken, the pod deleted): then
//! nothing it held stays held.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::core::v1::{ContainerStatus, Pod};
use tracing::{debug, info, warn};

use super::decide::{AppState, Decision, ExitOutcome, IgnoreReason, Observed, SidecarState, WaitReason, decide};
use super::spec::{Endpoint, PodPlan, SidecarDefaults, plan};
use super::status::{self, hex_id, pod_name};
use crate::api::condition;
use crate::api::runtime_classes::RuntimeHandlers;
use crate::effect::{ContainerSeen, Count, Effect, ExitSeen, Feedback, HeldSeen, LeftHeld, Nanos, Pace, RuntimeName};
use crate::vocab::{ApiPath, NodeMode, ProcessEnd, ProxyReady, QuitOutcome, SkipReason};

mod containers;
mod ending;
mod feedback;
mod hold;
mod ready;

use containers::Role;
pub use hold::{asks_hold, wants_hold};

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
    /// Whether the node's kernel programs run (else every pod's ends come from the API).
    pub mode: NodeMode,
    /// `runtimeClassName`s whose pods run out of the node's kernel's sight (`--sandboxed-runtime-classes`),
    /// matched against a class's name and against its runtime handler.
    pub sandboxed_classes: Vec<String>,
    /// Whether each quit a sidecar accepted gets a Normal `SidecarQuit` Event (`--quit-events`):
    /// one more API write per Job. Warnings are published either way.
    pub quit_events: bool,
    /// The cluster's RuntimeClasses: the handler each name stands for.
    pub runtime_handlers: RuntimeHandlers,
    /// The node's default runtime handler (`--default-runtime-handler`): what a pod without a
    /// runtimeClassName runs with.
    pub default_handler: Option<String>,
}

impl Rules {
    /// Why a pod's ends must come from the API, if they must: the pod's own reason first.
    pub fn api_path(&self, plan: &PodPlan) -> Option<ApiPath> {
        if plan.host_pid {
            return Some(ApiPath::HostPid);
        }
        if let Some(class) = plan.runtime_class.as_deref() {
            // By its name, or by the handler it names (a class `secure` with handler `kata`).
            if sandboxed(&self.sandboxed_classes, class) {
                return Some(ApiPath::Sandboxed { runtime_class: class.to_owned() });
            }
            match self.runtime_handlers.handler(class) {
                Some(handler) if sandboxed(&self.sandboxed_classes, &handler) => {
                    return Some(ApiPath::Sandboxed { runtime_class: format!("{class}, handler {handler}") });
                }
                Some(_) => {}
                None => return Some(ApiPath::UnknownRuntimeClass { runtime_class: class.to_owned() }),
            }
        } else if let Some(handler) = self.default_handler.as_deref().filter(|h| sandboxed(&self.sandboxed_classes, h))
        {
            // No class: the node's default runtime runs it.
            return Some(ApiPath::Sandboxed { runtime_class: format!("unset, the node's default handler {handler}") });
        }
        match self.mode {
            NodeMode::Kernel => None,
            NodeMode::Degraded(reason) => Some(ApiPath::NodeDegraded(reason)),
        }
    }
}

/// Whether `class` is one of `patterns` (exact names; a trailing `*` matches any suffix).
pub fn sandboxed(patterns: &[String], class: &str) -> bool {
    patterns.iter().any(|p| match p.strip_suffix('*') {
        Some(prefix) => class.starts_with(prefix),
        None => p == class,
    })
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
    /// Only the exit of pid 1 of the container's own pid namespace ends it (the pod does not
    /// share its process namespace): a child the kernel took for the main process does not.
    pub init_only: bool,
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
    /// The SIGTERM that follows is the sidecar's own way out, not an escalation: Linkerd's proxy
    /// whose `/shutdown` is off, as it is by default.
    signal_quit: bool,
}

/// What valet keeps on the node for a pod it watches (besides the kernel's records of its
/// containers, which go with it).
#[derive(Clone, Debug, Default)]
struct Attached {
    /// The hold flag the kernel watches the pod cgroup with (none: not watched yet).
    watching: Option<bool>,
    /// The pod's network namespace is open, or its opening is on its way.
    network_open: bool,
    /// Processes an earlier agent left stopped in the pod were looked for.
    left_held_searched: bool,
    /// The search could not read every container's processes: when to look again.
    left_held_again_at: Option<Nanos>,
}

/// The work done: the apps ended as the plan needs, and the sidecars were asked to quit (or had
/// ended already).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Done {
    /// Kernel time of the end that completed the work (for the latency figure).
    ktime: Option<Nanos>,
}

/// Why the node's resources for a pod were let go.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum LetGo {
    /// The work is done and every sidecar has ended (or was signalled).
    WorkDone,
    /// The pod ended, is being deleted, or is gone from valet's view.
    PodEnded,
    /// The pod's plan is gone (bad annotations, hostNetwork): watched again, from scratch, if it
    /// comes back.
    StoodDown,
}

/// Where a pod is in valet's work: watched and held → done → let go. The API can move it from
/// any phase to [`Phase::Released`]; only a pod that stood down comes back from there.
#[derive(Clone, Debug)]
enum Phase {
    /// The work is to come: the pod is watched, its proxy probed, its apps held until the proxy
    /// is ready.
    Working {
        node: Attached,
        /// The processes held now.
        held: Vec<Held>,
        /// The running probe's target and pace.
        probe: Option<(ProbeTarget, Pace)>,
    },
    /// The work is done. Nothing is held or probed any more; the node's resources stay until
    /// every sidecar has ended (an escalation must see whether it did).
    Done { done: Done, node: Attached },
    /// The node's resources are let go: kernel maps, network namespace, probe.
    Released {
        /// The work was done before (a pod that stood down and comes back stays done).
        done: Option<Done>,
        why: LetGo,
    },
}

impl Phase {
    fn working() -> Phase {
        Phase::Working { node: Attached::default(), held: Vec::new(), probe: None }
    }
}

/// The `valet.dev/ProxyReady` writes: one at a time, so that writes never overtake each other.
#[derive(Clone, Debug, Default)]
struct Writes {
    /// What the last write asked for (or the pod was seen to show already).
    written: Option<ProxyReady>,
    /// The pod's resourceVersion our last successful write produced: a pod seen at or after it
    /// that shows another condition was written over (a killed predecessor's late write), and
    /// is written again.
    written_version: Option<String>,
    state: WriteState,
    /// Writes failed in a row.
    failures: u32,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum WriteState {
    #[default]
    Idle,
    /// A write is on its way.
    InFlight,
    /// The last write failed: the next may be made at this time.
    RetryAt(Nanos),
}

/// The one instance of a container that counts now.
struct Instance<'a> {
    id: String,
    /// The API's status, when the API shows this very instance as current.
    api: Option<&'a ContainerStatus>,
}

/// Where a pod's container ends come from: the node's kernel, or the API (and why, said once).
#[derive(Clone, Debug, PartialEq, Eq)]
enum EndsFrom {
    /// The node's kernel sees the pod: its ends as they happen, and holds.
    Kernel,
    /// The node's kernel cannot see it: its ends come from the API's container statuses.
    Api {
        why: ApiPath,
        /// That was counted (and published).
        told: bool,
    },
}

/// What the probe of the pod's proxy last answered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Readiness {
    /// No answer yet.
    Unknown,
    NotReady,
    /// Ready. `at`: when the last answer that said so came in: a process held after it waits for
    /// an answer that came later (its proxy may have been restarted since, and not be ready).
    Ready {
        at: Nanos,
    },
}

impl Readiness {
    /// The last answer, if there was one.
    fn answer(self) -> Option<bool> {
        match self {
            Readiness::Unknown => None,
            Readiness::NotReady => Some(false),
            Readiness::Ready { .. } => Some(true),
        }
    }

    /// Whether the proxy is ready by an answer that came at or after `since`.
    fn ready_since(self, since: Nanos) -> bool {
        matches!(self, Readiness::Ready { at } if at >= since)
    }
}

/// Everything the agent knows about one opted-in pod.
///
/// Its lifecycles are enums ([`Phase`], [`EndsFrom`], [`Readiness`], [`WriteState`], each
/// quit's [`QuitState`]); the three bools left are independent of them, each said why.
pub struct PodState {
    uid: String,
    pod: Option<Pod>,
    plan: Option<PodPlan>,
    /// The last spec error reported (reported again only when it changes).
    spec_error: Option<String>,
    /// Where its ends come from (changes with the plan: a runtime class, `hostPID`).
    ends_from: EndsFrom,
    /// What was said once for the pod's plan (the Events' reasons): restart rules valet does not
    /// know, a hold asked for and not made.
    announced: std::collections::BTreeSet<&'static str>,
    /// Why the pod is ignored, once counted.
    ignored: Option<SkipReason>,
    pod_cgroup: Option<(String, u64)>,
    /// Container cgroup id → what is known of it.
    containers: BTreeMap<u64, Container>,
    /// Container instances the API calls running that had ended when the node was looked at
    /// (their cgroup gone or empty): ends no kernel event reported (they came while no agent
    /// watched the pod).
    vanished: std::collections::BTreeSet<String>,
    /// App instances whose end the kernel saw and whose runtime record is watched, and those
    /// the runtime has recorded ended ([`Feedback::Recorded`]): ends every look of the kubelet's
    /// sees, before the API reports them.
    records_watched: std::collections::BTreeSet<String>,
    recorded: std::collections::BTreeSet<String>,
    /// Where the pod is in valet's work, with what each stage keeps.
    phase: Phase,
    /// A held app was released because its proxy was not ready in time (said by the condition).
    /// A latch, not a phase: it outlives the work (the condition still says why after the work is
    /// done, and after a stand-down and return), and a proxy ready later does not undo it.
    failed_open: bool,
    readiness: Readiness,
    quits: BTreeMap<String, Quit>,
    /// The agent stops: nothing is held any more, quits already decided still go out. The
    /// agent's lifecycle, not the pod's: it comes to a pod in any [`Phase`], and stays when a pod
    /// that stood down comes back.
    stopping: bool,
    /// The `valet.dev/ProxyReady` condition's writes.
    writes: Writes,
    /// The last tick asked for nothing and nothing has come in since: until something does (or
    /// a deadline is pending), a tick has nothing to do. A full node's idle pods cost no CPU. Not
    /// a phase: a memo of the last decision, cleared by every input in every phase.
    settled: bool,
}

impl PodState {
    pub fn new(uid: &str) -> PodState {
        PodState {
            uid: uid.to_owned(),
            pod: None,
            plan: None,
            spec_error: None,
            ends_from: EndsFrom::Kernel,
            announced: std::collections::BTreeSet::new(),
            ignored: None,
            pod_cgroup: None,
            containers: BTreeMap::new(),
            vanished: std::collections::BTreeSet::new(),
            records_watched: std::collections::BTreeSet::new(),
            recorded: std::collections::BTreeSet::new(),
            phase: Phase::working(),
            failed_open: false,
            readiness: Readiness::Unknown,
            quits: BTreeMap::new(),
            stopping: false,
            writes: Writes::default(),
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

    /// Whether this pod holds its apps until its proxy is ready, and so looks after what the
    /// kernel stopped in its cgroups (an earlier agent's holds included, found at attach).
    pub fn holding(&self) -> bool {
        matches!(self.phase, Phase::Working { .. })
            && !self.stopping
            && self.plan.as_ref().is_some_and(|p| self.can_hold(p))
    }

    /// The processes this pod holds now.
    pub fn held_pids(&self) -> impl Iterator<Item = u32> + '_ {
        self.held_now().iter().map(|h| h.tgid)
    }

    /// Whether the node's resources for this pod (cgroup search, kernel maps, network namespace)
    /// are let go.
    pub fn is_released(&self) -> bool {
        matches!(self.phase, Phase::Released { .. })
    }

    // ---- the phase ----

    /// Why the node's kernel cannot see this pod, if it cannot (its ends then come from the API).
    fn api_path(&self) -> Option<&ApiPath> {
        match &self.ends_from {
            EndsFrom::Kernel => None,
            EndsFrom::Api { why, .. } => Some(why),
        }
    }

    /// The processes held now (only a pod whose work is to come holds any).
    fn held_now(&self) -> &[Held] {
        match &self.phase {
            Phase::Working { held, .. } => held,
            _ => &[],
        }
    }

    /// The processes held now, to change (none once the work is over or the pod let go).
    fn held_mut(&mut self) -> Option<&mut Vec<Held>> {
        match &mut self.phase {
            Phase::Working { held, .. } => Some(held),
            _ => None,
        }
    }

    /// What is kept on the node for the pod, until it is let go.
    fn node(&self) -> Option<&Attached> {
        match &self.phase {
            Phase::Working { node, .. } | Phase::Done { node, .. } => Some(node),
            Phase::Released { .. } => None,
        }
    }

    fn node_mut(&mut self) -> Option<&mut Attached> {
        match &mut self.phase {
            Phase::Working { node, .. } | Phase::Done { node, .. } => Some(node),
            Phase::Released { .. } => None,
        }
    }

    /// The work done, once it is.
    fn done(&self) -> Option<Done> {
        match self.phase {
            Phase::Working { .. } => None,
            Phase::Done { done, .. } => Some(done),
            Phase::Released { done, .. } => done,
        }
    }

    fn done_mut(&mut self) -> Option<&mut Done> {
        match &mut self.phase {
            Phase::Working { .. } => None,
            Phase::Done { done, .. } => Some(done),
            Phase::Released { done, .. } => done.as_mut(),
        }
    }

    /// Says once that some of the apps' exits are left to the kubelet: their restart rules name
    /// an operator or action valet does not know, so it cannot tell whether they end the work.
    fn announce_unknown_rules(&mut self, plan: &PodPlan) -> Vec<Effect> {
        let unknown = plan.unknown_restart_rules();
        if unknown.is_empty() || !self.announced.insert("RestartRuleUnknown") {
            return Vec::new();
        }
        let parts = unknown.join(", ");
        warn!(pod = %self.name(), rules = %parts, "restart rules valet does not know: the exits they match are left to the kubelet");
        vec![
            Effect::Count(Count::Skip(SkipReason::UnknownRestartRule)),
            Effect::Publish {
                warning: true,
                reason: "RestartRuleUnknown",
                action: "Wait",
                note: format!(
                    "valet does not know {parts} (a newer Kubernetes API's): it cannot tell whether the kubelet \
                     restarts an app after an exit such a rule matches, so it quits no sidecar after one; the \
                     kubelet decides"
                ),
            },
        ]
    }

    /// Says once why a hold the pod asks for is not made (another hold starts the app after
    /// the proxy, or there is nothing to wait for).
    fn announce_needless_hold(&mut self, plan: &PodPlan) -> Vec<Effect> {
        let Some(why) = hold::hold_needless(plan).filter(|_| plan.hold_app && !plan.deleting) else {
            return Vec::new();
        };
        let reason = if why.is_loss() { "HoldUnavailable" } else { "HoldNotNeeded" };
        if !self.announced.insert(reason) {
            return Vec::new();
        }
        info!(pod = %self.name(), "hold asked for and not made: {}", why.explain());
        vec![Effect::Publish {
            warning: why.is_loss(),
            reason,
            action: "Run",
            note: format!("valet does not hold the app: {}", why.explain()),
        }]
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
                if self.ignored != Some(SkipReason::HostNetwork) {
                    info!(pod = %self.name(), "hostNetwork pod: its sidecar's loopback is the node's; leaving it alone");
                    fx.push(Effect::Count(Count::Skip(SkipReason::HostNetwork)));
                    self.ignored = Some(SkipReason::HostNetwork);
                }
                self.plan = None;
            }
            Ok(p) => {
                self.spec_error = None;
                let path = rules.api_path(&p);
                if path.as_ref() != self.api_path() {
                    self.ends_from = path.map_or(EndsFrom::Kernel, |why| EndsFrom::Api { why, told: false });
                }
                fx.extend(self.announce_unknown_rules(&p));
                fx.extend(self.announce_needless_hold(&p));
                self.plan = Some(p);
                if let Phase::Released { done, why: LetGo::StoodDown } = self.phase {
                    // Watched again, from scratch.
                    self.phase = match done {
                        Some(done) => Phase::Done { done, node: Attached::default() },
                        None => Phase::working(),
                    };
                }
            }
            Err(e) => {
                let text = e.to_string();
                if self.spec_error.as_deref() != Some(text.as_str()) {
                    warn!(pod = %self.name(), "skipping pod: {text}");
                    fx.push(Effect::Count(Count::Skip(SkipReason::BadAnnotation)));
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
        fx.extend(self.scan_for_ends(true));
        fx
    }

    /// The pod is gone from valet's view (deleted, label removed, moved off the node).
    pub fn removed(&mut self) -> Vec<Effect> {
        self.settled = false;
        let mut fx = self.release_all("pod_gone");
        fx.extend(self.release_resources(LetGo::PodEnded));
        fx
    }

    /// The agent stops: let every held process run. Processes the kernel stopped whose events
    /// are still on their way are found in the pod's cgroup.
    pub fn shutdown(&mut self) -> Vec<Effect> {
        self.settled = false;
        self.stopping = true;
        let mut fx = self.release_all("shutdown");
        if self.node().is_some_and(|n| n.watching == Some(true))
            && let Some((rel, _)) = &self.pod_cgroup
        {
            fx.push(Effect::FindLeftHeld { pod_rel: rel.clone() });
        }
        fx
    }

    /// Nothing has come in since the last tick asked for nothing: the pod has nothing to decide
    /// until something does (or a deadline comes).
    pub fn is_settled(&self) -> bool {
        self.settled
    }

    /// Periodic work: retry what could not be done yet, and act on deadlines.
    pub fn tick(&mut self, now: Nanos) -> Vec<Effect> {
        let mut fx = Vec::new();
        // Deadlines the decision itself keeps (a write or a quit to retry, an escalation).
        let timed = matches!(self.writes.state, WriteState::RetryAt(_))
            || self.quits.values().any(|q| {
                matches!(
                    q.state,
                    QuitState::Failed { retry_at: Some(_) } | QuitState::Accepted { escalate_at: Some(_) }
                )
            });
        // A search for what an earlier agent left held that could not read everything.
        let search_again = self.node().and_then(|n| n.left_held_again_at).is_some_and(|at| now >= at);
        if search_again && let Some(node) = self.node_mut() {
            node.left_held_again_at = None;
            node.left_held_searched = false;
        }
        let timed = timed || search_again;
        if self.settled && !timed && self.held_now().is_empty() {
            return fx;
        }
        let Some(hold_timeout) = self.plan.as_ref().map(|p| p.hold_timeout.min(MAX_HOLD)) else { return fx };
        // Hold timeouts, each from the moment the kernel stopped the process.
        let timeout = hold_timeout.as_nanos() as u64;
        if let Some(held) = self.held_mut()
            && held.iter().any(|h| now.saturating_sub(h.since) >= timeout)
        {
            let (expired, kept): (Vec<Held>, Vec<Held>) =
                held.drain(..).partition(|h| now.saturating_sub(h.since) >= timeout);
            *held = kept;
            let secs = hold_timeout.as_secs();
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
        // A settled pod that only holds (its hold deadlines were looked at above) decides
        // nothing new: with 110 held pods, deciding each four times a second was most of the
        // agent's loop.
        if !self.settled || timed || !fx.is_empty() {
            fx.extend(self.step(now));
        }
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
            fx.extend(self.release_resources(LetGo::PodEnded));
            fx.extend(self.count_ignore(&plan));
            fx.extend(self.sync_condition(now));
            return fx;
        }
        let hold = self.can_hold(&plan) && !self.stopping;
        fx.extend(self.announce_api_path());
        if self.node().is_some() {
            fx.extend(self.attach(&plan, hold));
        }
        // Held processes whose container turned out not to be an app.
        let not_app: Vec<Held> = self
            .held_now()
            .iter()
            .filter(|h| match self.role(h.container_cgroup) {
                Role::Sandbox => true,
                Role::Named(n) => !plan.apps.contains(&n),
                Role::Unnamed => !self.may_be_app(&plan),
            })
            .cloned()
            .collect();
        for h in not_app {
            if let Some(held) = self.held_mut() {
                held.retain(|x| x.tgid != h.tgid);
            }
            fx.push(self.release(&h, "not_app"));
        }
        if !hold {
            fx.extend(self.release_all("not_held"));
        }
        match decide(&plan, &self.observe(&plan)) {
            Decision::Ignore(_) => fx.extend(self.count_ignore(&plan)),
            Decision::Wait(WaitReason::KubeletBehind { apps, .. }) => fx.extend(self.watch_records(&apps)),
            Decision::Wait(_) => {}
            Decision::Done => {
                fx.extend(self.finish());
                // Kept until every sidecar has ended (or was signalled): an escalation still
                // needs to see whether it did.
                let ended = plan.sidecars.iter().all(|s| {
                    self.current(&s.name).is_none_or(|i| self.instance_ended(&i))
                        || self.quits.get(&s.name).is_some_and(|q| q.state == QuitState::Escalated)
                });
                if ended {
                    fx.extend(self.release_resources(LetGo::WorkDone));
                }
            }
            Decision::Quit(sidecars) => {
                fx.extend(self.finish());
                if self.done().is_some_and(|d| d.ktime.is_none()) {
                    let ktime = plan
                        .apps
                        .iter()
                        .filter_map(|a| self.current(a))
                        .filter_map(|i| self.kernel_end(&i.id))
                        .map(|e| e.ktime)
                        .max();
                    if let Some(done) = self.done_mut() {
                        done.ktime = ktime;
                    }
                }
                for name in sidecars {
                    fx.extend(self.start_quit(&plan, &name, now));
                }
            }
        }
        fx.extend(self.manage_probe(&plan));
        fx.extend(self.sync_condition(now));
        fx
    }
}

/// Where a probe reaches the pod: its cgroup (for the network namespace) and its IP.
type ProbeTarget = (Option<String>, Option<String>);

#[cfg(test)]
mod tests;
