//! The hold: apps stopped at their first exec, adopted from an earlier agent, released.

use super::*;

impl PodState {
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
        let Some(plan) = self.plan.as_ref().filter(|p| self.can_hold(p)) else {
            return vec![release("not_app")];
        };
        match self.phase {
            Phase::Working { .. } if !self.stopping => {}
            // The work is over or the agent stops: nothing is held any more.
            Phase::Working { .. } | Phase::Done { .. } => return vec![release("not_app")],
            Phase::Released { .. } => return vec![release("pod_done")],
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
        if self.held_now().iter().any(|h| h.tgid == held.tgid) {
            return Vec::new();
        }
        // An app process the kernel stopped: counted even when it runs again at once. Released
        // at once only on a ready answer that came after it was stopped: a restarted app's proxy
        // may have been restarted too, and an older answer was the old proxy's.
        if self.readiness.ready_since(held.ktime) {
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
        if let Some(list) = self.held_mut() {
            list.push(Held { tgid: held.tgid, container_cgroup: held.container_cgroup, since: held.ktime, counted });
        }
        let mut fx = if counted { vec![Effect::Count(Count::Hold)] } else { Vec::new() };
        fx.push(Effect::Pin { tgid: held.tgid, container_rel: rel });
        fx.extend(self.step(now));
        fx
    }

    /// Takes over processes an earlier agent left stopped at exec: apps (and containers not
    /// named yet) are held again with their original deadline; the rest run at once. Not
    /// `complete` (a container's processes could not be read): the search is made again a
    /// little later, until it reads them all (a process left held there would otherwise stay
    /// stopped until its deadline: the sweep leaves a holding pod's processes to the pod).
    pub(super) fn adopt(&mut self, found: Vec<LeftHeld>, complete: bool, now: Nanos) -> Vec<Effect> {
        if !complete
            && !self.stopping
            && let Some(node) = self.node_mut()
        {
            node.left_held_again_at = Some(now + LEFT_HELD_AGAIN_NS);
        }
        let mut fx = Vec::new();
        for f in found {
            if let Some(c) = self.containers.get_mut(&f.container_cgroup) {
                // Its first exec is past: classified (again) so that later execs run.
                c.exec_done = true;
                c.classified = false;
            }
            if self.held_now().iter().any(|h| h.tgid == f.tgid) {
                continue;
            }
            // Counted by the agent that held it.
            let h = Held { tgid: f.tgid, container_cgroup: f.container_cgroup, since: f.since, counted: true };
            let app = match (&self.plan, self.role(f.container_cgroup)) {
                (_, Role::Sandbox) | (None, _) => false,
                (Some(p), Role::Named(n)) => p.apps.contains(&n),
                (Some(p), Role::Unnamed) => self.may_be_app(p),
            };
            let working = matches!(self.phase, Phase::Working { .. });
            let ready = self.readiness.ready_since(f.since);
            if !app || self.stopping || !working || ready {
                let reason = if self.stopping {
                    "shutdown"
                } else if app && ready {
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
            if let Some(held) = self.held_mut() {
                held.push(h);
            }
        }
        fx
    }

    /// Whether this pod's apps are held: it asks, and the node's kernel sees them.
    pub(super) fn can_hold(&self, plan: &PodPlan) -> bool {
        wants_hold(plan) && self.api_path().is_none()
    }

    /// Whether the pod runs in a sandbox (its loopback and processes out of the node's reach).
    pub(super) fn sandboxed(&self) -> bool {
        matches!(self.api_path(), Some(ApiPath::Sandboxed { .. }))
    }

    /// Whether the pod asks for a hold that the node's kernel cannot give it.
    pub(super) fn hold_refused(&self) -> bool {
        self.api_path().is_some() && self.plan.as_ref().is_some_and(asks_hold)
    }

    /// Says once, when a pod is first planned, that its ends come from the API (counted, logged,
    /// and an Event when it is the pod's own doing or it asked for a hold).
    pub(super) fn announce_api_path(&mut self) -> Vec<Effect> {
        let EndsFrom::Api { why, told } = &mut self.ends_from else { return Vec::new() };
        if *told {
            return Vec::new();
        }
        *told = true;
        let path = why.clone();
        let mut why = path.explain();
        if self.sandboxed() {
            why.push_str(
                "; its sidecars are asked to quit at the pod IP (the sandbox's loopback is out of the node's reach), \
                 so their quit endpoint must listen there, and they are never signalled",
            );
        }
        let mut fx = vec![Effect::Count(Count::ApiPath(path.label()))];
        if self.hold_refused() {
            warn!(pod = %self.name(), reason = path.label(), "hold asked for but unavailable: the app runs unheld; {why}");
            fx.push(Effect::Publish {
                warning: true,
                reason: "HoldUnavailable",
                action: "Run",
                note: format!(
                    "valet cannot hold the app until the proxy is ready: {why}. The app runs unheld; its \
                     end is taken from the pod's status (about a second after the kubelet sees it)"
                ),
            });
        } else if !matches!(path, ApiPath::NodeDegraded(_)) {
            info!(pod = %self.name(), reason = path.label(), "ends taken from the API: {why}");
            fx.push(Effect::Publish {
                warning: false,
                reason: "EndsFromApi",
                action: "Watch",
                note: format!(
                    "{why}: valet takes its containers' ends from the pod's status (about a second after the \
                     kubelet sees them) and holds nothing"
                ),
            });
        } else {
            debug!(pod = %self.name(), "ends taken from the API: {why}");
        }
        fx
    }

    pub(super) fn release(&self, h: &Held, reason: &'static str) -> Effect {
        let container_rel = self.containers.get(&h.container_cgroup).map(|c| c.rel.clone()).unwrap_or_default();
        Effect::Release { tgid: h.tgid, container_rel, reason, since: h.since }
    }

    /// Releases a held process; one not counted yet is counted now unless it turned out not to
    /// be an app.
    pub(super) fn release_counted(&self, h: &Held, reason: &'static str) -> Vec<Effect> {
        let mut fx = Vec::new();
        if !h.counted && reason != "not_app" {
            fx.push(Effect::Count(Count::Hold));
        }
        fx.push(self.release(h, reason));
        fx
    }

    pub(super) fn release_all(&mut self, reason: &'static str) -> Vec<Effect> {
        let held = self.held_mut().map(std::mem::take).unwrap_or_default();
        held.iter().flat_map(|h| self.release_counted(h, reason)).collect()
    }

    /// The pod's plan is gone (bad annotations, hostNetwork): stop everything valet started.
    pub(super) fn stand_down(&mut self, reason: &'static str) -> Vec<Effect> {
        let mut fx = self.release_all(reason);
        fx.extend(self.stop_probe());
        fx.extend(self.release_resources(LetGo::StoodDown));
        if let Phase::Released { why, .. } = &mut self.phase {
            *why = LetGo::StoodDown;
        }
        fx
    }
}

/// How soon a search for processes left held that could not read every container is made again.
const LEFT_HELD_AGAIN_NS: Nanos = 100_000_000;

/// Whether the kernel should hold this pod's app containers at their first exec (a hostPID pod's
/// cannot be; [`asks_hold`] says whether the pod asks).
pub fn wants_hold(plan: &PodPlan) -> bool {
    asks_hold(plan) && !plan.host_pid
}

/// Whether the pod asks valet to hold its apps until the proxy is ready, and the hold would mean
/// something (a proxy with a readiness endpoint, apps, no other hold).
pub fn asks_hold(plan: &PodPlan) -> bool {
    plan.hold_app && !plan.deleting && hold_needless(plan).is_none()
}

/// Why a hold would mean nothing for this pod, if it would not: another hold starts the app after
/// the proxy, or there is no proxy to wait for or no app to hold. A native proxy holds the apps
/// only with a startupProbe (the kubelet starts the containers after it once the probe passed,
/// else as soon as it started); a regular proxy beside native helpers holds nothing.
pub(super) fn hold_needless(plan: &PodPlan) -> Option<HoldNeedless> {
    let probed = || plan.sidecars.iter().filter(|s| s.ready.is_some());
    if plan.istio_holds_app {
        Some(HoldNeedless::IstioHolds)
    } else if plan.apps.is_empty() {
        Some(HoldNeedless::NoApps)
    } else if probed().next().is_none() {
        Some(HoldNeedless::NoReadiness)
    } else if probed().all(|s| plan.native_startup_probed.contains(&s.name)) {
        Some(HoldNeedless::StartupProbe)
    } else {
        None
    }
}

/// Why a hold asked for is not made ([`hold_needless`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum HoldNeedless {
    IstioHolds,
    NoApps,
    NoReadiness,
    StartupProbe,
}

impl HoldNeedless {
    /// Whether the pod loses something it asked for (else another part of it holds the app).
    pub(super) fn is_loss(self) -> bool {
        matches!(self, HoldNeedless::NoReadiness)
    }

    pub(super) fn explain(self) -> &'static str {
        match self {
            HoldNeedless::IstioHolds => {
                "Istio already holds the app until its proxy starts (holdApplicationUntilProxyStarts)"
            }
            HoldNeedless::NoApps => "the pod has no app container to hold",
            HoldNeedless::NoReadiness => "none of its sidecars has a readiness endpoint valet can probe",
            HoldNeedless::StartupProbe => {
                "its proxy is a native sidecar with a startupProbe: the kubelet starts the app only once that probe passed"
            }
        }
    }
}
