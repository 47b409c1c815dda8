//! What is known of the pod's containers on the node, and the node's resources for the pod
//! (its cgroup watched, containers named, network namespace opened; all let go at the end).

use super::*;

impl PodState {
    /// Finds, watches and names what the pod is made of on the node.
    pub(super) fn attach(&mut self, plan: &PodPlan, hold: bool) -> Vec<Effect> {
        let mut fx = Vec::new();
        let Some((rel, id)) = self.pod_cgroup.clone() else {
            return vec![Effect::FindPodCgroup];
        };
        let exits = self.api_path().is_none();
        let sandboxed = self.sandboxed();
        let working = matches!(self.phase, Phase::Working { .. });
        let Some(node) = self.node_mut() else { return fx };
        if node.watching != Some(hold) {
            // Containers already running are recorded with the kernel before it watches the pod
            // (not a pod the node's kernel cannot see: it reports none of its ends).
            fx.push(Effect::ScanContainers { pod_rel: rel.clone(), adopt: exits });
            fx.push(Effect::Watch {
                pod_cgroup: id,
                pod_rel: rel.clone(),
                exits,
                hold,
                hold_timeout: plan.hold_timeout.min(MAX_HOLD),
            });
            node.watching = Some(hold);
        }
        if hold && !node.left_held_searched {
            node.left_held_searched = true;
            fx.push(Effect::FindLeftHeld { pod_rel: rel.clone() });
        }
        // A sandboxed pod's loopback is inside its sandbox: its sidecars are reached at its IP.
        if !node.network_open && working && !sandboxed {
            // Opened ahead of time, so the quit needs no search; retried on ticks until the pod
            // has a live process.
            node.network_open = true;
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

    pub(super) fn merge_containers(&mut self, seen: Vec<ContainerSeen>) {
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

    /// Level-triggered ends: `seen` is everything the node has of the pod's containers now (a
    /// scan of the pod cgroup). A container the API calls running whose instance has no cgroup
    /// left, or only an empty one, has ended, whether or not any kernel event said so (it ended
    /// while no agent watched the pod: before a restart, during a stall, before the pod was
    /// seen). An empty scan proves nothing (the pod cgroup is gone or unreadable, and with it
    /// the sandbox every live pod has).
    pub(super) fn note_vanished(&mut self, seen: &[ContainerSeen]) {
        let (Some(plan), Some(pod)) = (&self.plan, &self.pod) else { return };
        if seen.is_empty() {
            return;
        }
        let names = plan.apps.iter().chain(plan.sidecars.iter().map(|s| &s.name));
        let mut ended = Vec::new();
        for name in names {
            let Some(s) = status::statuses(pod).find(|s| &s.name == name) else { continue };
            if s.state.as_ref().is_none_or(|st| st.running.is_none()) {
                continue;
            }
            let Some(id) = hex_id(s.container_id.as_deref()) else { continue };
            if self.vanished.contains(id) || self.kernel_end(id).is_some() {
                continue;
            }
            let on_node = seen.iter().find(|c| c.id == id);
            if on_node.is_none_or(|c| !c.live) {
                ended.push((name.clone(), id.to_owned(), on_node.is_some()));
            }
        }
        for (name, id, empty) in ended {
            info!(
                pod = %self.name(),
                container = %name,
                "container ended unseen: the API says running, its cgroup is {}",
                if empty { "empty" } else { "gone" }
            );
            self.vanished.insert(id);
        }
    }

    /// The scan that finds ends no kernel event reported ([`PodState::note_vanished`]), when the
    /// API calls a container of the pod running and nothing says it ended.
    pub fn recheck_ends(&self) -> Vec<Effect> {
        self.scan_for_ends(false)
    }

    /// The scan [`PodState::recheck_ends`] asks for; with `unknown_only`, only when the API calls
    /// running an instance the node has not shown yet (the API caught up with a container that
    /// started and may have ended while no agent watched: looked at once).
    pub(super) fn scan_for_ends(&self, unknown_only: bool) -> Vec<Effect> {
        let (Some(plan), Some(pod), Some((rel, _))) = (&self.plan, &self.pod, &self.pod_cgroup) else {
            return Vec::new();
        };
        if self.is_released() {
            return Vec::new();
        }
        let open = plan.apps.iter().chain(plan.sidecars.iter().map(|s| &s.name)).any(|name| {
            status::statuses(pod)
                .find(|s| &s.name == name)
                .filter(|s| s.state.as_ref().is_some_and(|st| st.running.is_some()))
                .and_then(|s| hex_id(s.container_id.as_deref()))
                .is_some_and(|id| {
                    self.kernel_end(id).is_none()
                        && !self.vanished.contains(id)
                        && (!unknown_only || !self.containers.values().any(|c| c.id == id))
                })
        });
        if open { vec![Effect::ScanContainers { pod_rel: rel.clone(), adopt: false }] } else { Vec::new() }
    }

    /// The work is done: what is held runs, and the proxy is no longer probed.
    pub(super) fn finish(&mut self) -> Vec<Effect> {
        let mut fx = self.release_all("done");
        fx.extend(self.stop_probe());
        let done = Done { ktime: None };
        match &mut self.phase {
            Phase::Working { node, .. } => {
                let node = std::mem::take(node);
                self.phase = Phase::Done { done, node };
                debug!(pod = %self.name(), "work done");
            }
            Phase::Released { done: was @ None, .. } => *was = Some(done),
            Phase::Done { .. } | Phase::Released { .. } => {}
        }
        fx
    }

    /// Kernel maps, the network namespace and the probe go when the pod's work is done, not
    /// when the pod object is deleted (Jobs without a TTL keep it for days).
    pub(super) fn release_resources(&mut self, why: LetGo) -> Vec<Effect> {
        // Callers release what is held first, each with its own reason.
        let mut fx = self.release_all("not_held");
        fx.extend(self.stop_probe());
        let Some(node) = self.node().cloned() else { return fx };
        self.phase = Phase::Released { done: self.done(), why };
        if node.watching.is_some()
            && let Some((_, id)) = &self.pod_cgroup
        {
            fx.push(Effect::Unwatch { pod_cgroup: *id });
        }
        for cg in self.containers.keys() {
            fx.push(Effect::ForgetContainer { container_cgroup: *cg });
        }
        // Always: a probe or a quit may have entered the namespace even when opening it ahead
        // of time did not work.
        fx.push(Effect::CloseNetwork);
        fx
    }

    /// Merges the API's view and the kernel's into the decision's input.
    pub(super) fn observe(&self, plan: &PodPlan) -> Observed {
        self.observe_assuming(plan, None)
    }

    /// What [`PodState::observe`] would see once the container instance `assumed.0` ended as
    /// `assumed.1` (the kernel's word for it, as [`PodState::exit`] records it).
    pub(super) fn observe_assuming(&self, plan: &PodPlan, assumed: Option<(&str, ExitOutcome)>) -> Observed {
        let mut observed = Observed::default();
        for name in &plan.apps {
            observed.apps.insert(name.clone(), self.app_state_assuming(name, assumed));
        }
        let sidecar_state = |name: &str| match self.app_state_assuming(name, assumed) {
            AppState::Exited(_) => SidecarState::Exited,
            AppState::Running => SidecarState::Running,
            AppState::Waiting => SidecarState::Unknown,
        };
        for sidecar in &plan.sidecars {
            observed.sidecars.insert(sidecar.name.clone(), sidecar_state(&sidecar.name));
        }
        for name in &plan.native_sidecars {
            observed.natives.insert(name.clone(), sidecar_state(name));
        }
        // Reported ended by the API, or recorded ended by the runtime.
        observed.recorded = plan
            .apps
            .iter()
            .filter(|a| {
                self.current(a).is_some_and(|i| {
                    self.recorded.contains(&i.id)
                        || i.api.and_then(|s| s.state.as_ref()).is_some_and(|st| st.terminated.is_some())
                })
            })
            .cloned()
            .collect();
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
    pub(super) fn app_state_assuming(&self, name: &str, assumed: Option<(&str, ExitOutcome)>) -> AppState {
        let Some(instance) = self.current(name) else { return AppState::Waiting };
        if let Some(t) = instance.api.and_then(|s| s.state.as_ref()).and_then(|s| s.terminated.as_ref()) {
            return AppState::Exited(ExitOutcome::Code(t.exit_code));
        }
        if let Some(end) = self.kernel_end(&instance.id) {
            return AppState::Exited(outcome(end.end));
        }
        if self.vanished.contains(&instance.id) {
            // How it ended is unknown: never claimed a success.
            return AppState::Exited(outcome(None));
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

    pub(super) fn instance_ended(&self, instance: &Instance<'_>) -> bool {
        instance.api.and_then(|s| s.state.as_ref()).is_some_and(|s| s.terminated.is_some())
            || self.kernel_end(&instance.id).is_some()
            || self.vanished.contains(&instance.id)
    }

    /// Has the runtime's record of each of `apps`' current instances watched, once each: the
    /// kernel saw them end, and a native sidecar's quit waits for the kubelet to see it too.
    pub(super) fn watch_records(&mut self, apps: &[String]) -> Vec<Effect> {
        let ids: Vec<String> = apps.iter().filter_map(|a| self.current(a)).map(|i| i.id).collect();
        let pod_rel = self.pod_cgroup.as_ref().map(|(rel, _)| rel.clone());
        ids.into_iter()
            .filter(|id| self.records_watched.insert(id.clone()))
            .map(|container_id| Effect::WatchRecord { container_id, pod_rel: pod_rel.clone() })
            .collect()
    }

    /// The runtime recorded container instance `id`'s end.
    pub(super) fn note_recorded(&mut self, id: String) {
        if self.records_watched.contains(&id) && self.recorded.insert(id.clone()) {
            info!(pod = %self.name(), container = %id, "the runtime recorded the app's end");
        }
    }

    pub(super) fn kernel_end(&self, id: &str) -> Option<KernelEnd> {
        self.containers.values().find(|c| c.id == id).and_then(|c| c.end)
    }

    /// The instance of container `name` that counts now: the newest one known to the API or to
    /// the node. The API reports a new instance about a second after the runtime started it; a
    /// restarted container's new cgroup has a higher id than the old one's.
    pub(super) fn current(&self, name: &str) -> Option<Instance<'_>> {
        let pod = self.pod.as_ref()?;
        let api = status::statuses(pod).find(|s| s.name == name);
        let api_id = api.and_then(|s| hex_id(s.container_id.as_deref()));
        let newest = self
            .containers
            .iter()
            .filter(|(_, c)| self.is_named(&c.id, name))
            .max_by_key(|(cg, _)| **cg)
            .map(|(cg, c)| (*cg, c.id.clone()));
        let from_api = |id: &str| Instance { id: id.to_owned(), api };
        Some(match (api_id, newest) {
            (None, None) => return None,
            (Some(a), None) => from_api(a),
            (None, Some((_, k))) => Instance { id: k, api: None },
            (Some(a), Some((_, k))) if a == k.as_str() => from_api(a),
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
                    None => previous != Some(k.as_str()) && api_terminated,
                };
                if node_is_newer { Instance { id: k, api: None } } else { from_api(a) }
            }
        })
    }

    /// The container name an id belongs to: from the API (current or previous instance), else
    /// from the runtime's bundle.
    pub(super) fn name_of(&self, id: &str) -> Option<String> {
        self.name_ref(id).map(str::to_owned)
    }

    /// Whether container id `id` belongs to container `name` ([`PodState::name_of`], without a
    /// copy of the name).
    fn is_named(&self, id: &str, name: &str) -> bool {
        self.name_ref(id) == Some(name)
    }

    fn name_ref(&self, id: &str) -> Option<&str> {
        if let Some(name) = self.pod.as_ref().and_then(|p| status::name_of_id(p, id)) {
            return Some(name);
        }
        self.containers.values().find(|c| c.id == id).and_then(|c| match &c.runtime_name {
            Some(RuntimeName::Container(n)) => Some(n.as_str()),
            _ => None,
        })
    }

    pub(super) fn role(&self, cgroup: u64) -> Role {
        let Some(c) = self.containers.get(&cgroup) else { return Role::Unnamed };
        if c.runtime_name == Some(RuntimeName::Sandbox) {
            return Role::Sandbox;
        }
        self.name_of(&c.id).map_or(Role::Unnamed, Role::Named)
    }

    /// Whether an unnamed container may be one of the apps: some app's instance is not known
    /// yet. Once every app is known, an unnamed container is the sandbox, an init container or
    /// a sidecar.
    pub(super) fn may_be_app(&self, plan: &PodPlan) -> bool {
        plan.apps.iter().any(|app| self.current(app).is_none())
    }

    /// The cgroup of a container's current instance.
    pub(super) fn container_rel(&self, name: &str) -> Option<String> {
        let id = self.current(name)?.id;
        self.containers.values().find(|c| c.id == id).map(|c| c.rel.clone())
    }
}

pub(super) enum Role {
    Sandbox,
    Named(String),
    Unnamed,
}

impl Role {
    pub(super) fn name(&self) -> Option<&str> {
        match self {
            Role::Named(n) => Some(n),
            Role::Sandbox => Some("<sandbox>"),
            Role::Unnamed => None,
        }
    }
}

pub(super) fn outcome(end: Option<ProcessEnd>) -> ExitOutcome {
    match end {
        Some(ProcessEnd::Exited(code)) => ExitOutcome::Code(code),
        Some(ProcessEnd::Signaled { signal, .. }) => ExitOutcome::Signal(signal),
        // Unreadable exit code: never claim success (the API's code replaces it).
        None => ExitOutcome::Unknown,
    }
}
