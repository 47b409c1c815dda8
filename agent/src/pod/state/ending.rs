//! The end of the work: containers' ends, the quits they call for (sent ahead or not), their
//! outcomes and escalations.

use super::*;

impl PodState {
    /// A container's main process ended. The caller logs it ([`PodState::log_end`]) once the
    /// effects are applied, so that a quit is on its way before the log line's write.
    pub fn exit(&mut self, exit: ExitSeen, now: Nanos) -> Vec<Effect> {
        self.settled = false;
        if exit.ns_child && self.plan.as_ref().is_some_and(|p| !p.shares_pid_namespace) {
            // Each container's main process is pid 1 of its own namespace here: the kernel took a
            // later exec (a child's, an exec probe's) for the main process of a container that
            // started before its pod was watched. Its init's exit, always reported, is the end.
            debug!(pod = %self.name(), pid = exit.tgid, cgroup = exit.container_cgroup, "exit of a process the kernel took for its container's main one; not its pid 1: not the container's end");
            return Vec::new();
        }
        let unseen = !self.containers.contains_key(&exit.container_cgroup);
        if unseen && (self.is_released() || !self.identify_ended(&exit)) {
            // A pod already let go of, or nothing tells which container it was (the API's report
            // ends it): the kernel's record of the container has nothing more to do.
            debug!(pod = %self.name(), cgroup = exit.container_cgroup, "exit in an unknown container cgroup");
            return vec![Effect::ForgetContainer { container_cgroup: exit.container_cgroup }];
        }
        let Some(c) = self.containers.get_mut(&exit.container_cgroup) else { return Vec::new() };
        if c.end.is_some() {
            return Vec::new();
        }
        c.end = Some(KernelEnd { end: exit.end, ktime: exit.ktime });
        // A held process whose container ended is gone.
        if let Some(held) = self.held_mut() {
            held.retain(|h| h.container_cgroup != exit.container_cgroup);
        }
        let mut fx = vec![Effect::Count(Count::ContainerEnd(exit.end))];
        if unseen && let Some(c) = self.containers.get(&exit.container_cgroup) {
            // The kubelet's log link names it, if any does.
            fx.push(Effect::NameEnded { container_cgroup: exit.container_cgroup, id: c.id.clone() });
        }
        fx.extend(self.step(now));
        fx
    }

    /// A container the agent never saw ended (read after a stall of the agent, its cgroup
    /// already removed by the runtime): it is known from then on by the id in its cgroup's name,
    /// as the kernel read it at the end. Its name is the kubelet's log link's for that id
    /// ([`Effect::NameEnded`], [`PodState::name_ended`]) or the API's once the API reports that
    /// id, and only then does its end count: an unseen container is never taken for the one app
    /// the agent does not know yet (a `kubectl debug` container, an ephemeral one the pod's spec
    /// does not list, ends the same way). Whether it could be recorded.
    pub(super) fn identify_ended(&mut self, exit: &ExitSeen) -> bool {
        let (Some(name), Some((pod_rel, _))) = (exit.cgroup_name.as_deref(), self.pod_cgroup.as_ref()) else {
            return false;
        };
        let rel = format!("{}/{name}", pod_rel.trim_end_matches('/'));
        let crate::cgroup::layout::CgroupKind::Container(c) = crate::cgroup::layout::classify(&rel) else {
            return false;
        };
        if c.pod.uid != self.uid || self.containers.values().any(|k| k.id == c.id) {
            return false;
        }
        debug!(pod = %self.name(), cgroup = exit.container_cgroup, id = %c.id, "end of a container never seen (its name waits for the API)");
        self.containers.insert(
            exit.container_cgroup,
            Container { id: c.id, rel, runtime_name: None, classified: true, exec_done: true, end: None },
        );
        true
    }

    /// The kubelet's log link named a container the agent never saw ([`Effect::NameEnded`]):
    /// the kubelet's own name for that id, as the API will report it.
    pub(super) fn name_ended(&mut self, container_cgroup: u64, name: Option<String>) {
        let pod = self.name();
        let Some(c) = self.containers.get_mut(&container_cgroup) else { return };
        match name {
            Some(name) if c.runtime_name.is_none() => {
                info!(pod = %pod, container = %name, id = %c.id, "a container that ended unseen, named by the kubelet's log link");
                c.runtime_name = Some(RuntimeName::Container(name));
            }
            Some(_) => {}
            None => {
                debug!(pod = %pod, id = %c.id, "no kubelet log link names a container that ended unseen: its name waits for the API")
            }
        }
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
        let network_open = matches!(&self.phase, Phase::Working { node, .. } if node.network_open);
        if !network_open || self.stopping || plan.deleting {
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
        let on_success = quits(ExitOutcome::Code(0));
        // Failures armed only when every one of them calls for the same quits (no restart rule
        // singles out a code): the reader tells a clean exit from the rest, nothing finer.
        let on_failure = if plan.failures_alike(app) { quits(ExitOutcome::Code(1)) } else { Vec::new() };
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
            init_only: !plan.shares_pid_namespace,
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

    pub(super) fn start_quit(&mut self, plan: &PodPlan, name: &str, now: Nanos) -> Vec<Effect> {
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
        let sandboxed = self.sandboxed();
        let (state, effect) = match (&sidecar.quit, sidecar.quit_signal) {
            (Some(endpoint), _) => (
                QuitState::InFlight,
                Some(Effect::Quit {
                    sidecar: name.to_owned(),
                    instance: instance.clone(),
                    endpoint: endpoint.clone(),
                    pod_rel,
                    pod_ip: if sandboxed { plan.pod_ip.clone() } else { None },
                }),
            ),
            // The node's processes in a sandboxed pod's cgroups are the sandbox's (its VM, its
            // user-space kernel), never the sidecar: a signal there would end the whole pod.
            (None, _) if sandboxed => {
                warn!(pod = %self.name(), sidecar = name, "a sandboxed pod's sidecar without a quit endpoint cannot be ended");
                self.quits.insert(
                    name.to_owned(),
                    Quit { instance, state: QuitState::Escalated, failures, signal_quit: false },
                );
                return vec![Effect::Publish {
                    warning: true,
                    reason: "SidecarQuitFailed",
                    action: "Quit",
                    note: format!(
                        "{name} has no quit endpoint, and a sandboxed pod's processes cannot be signalled from the node"
                    ),
                }];
            }
            // A helper without a quit endpoint: its signal is the quit, sent once its cgroup is
            // known (decided again on the step the node's containers come in).
            (None, signal) => match self.container_rel(name) {
                Some(container_rel) => {
                    (QuitState::Escalated, Some(Effect::Signal { sidecar: name.to_owned(), container_rel, signal }))
                }
                None => {
                    debug!(pod = %self.name(), sidecar = name, "signal quit waits for the container's cgroup");
                    return Vec::new();
                }
            },
        };
        self.quits.insert(name.to_owned(), Quit { instance, state, failures, signal_quit: false });
        effect.into_iter().collect()
    }

    pub(super) fn quit_done(&mut self, sidecar: &str, outcome: QuitOutcome, rules: &Rules, now: Nanos) -> Vec<Effect> {
        let kind = self.sidecar_kind(sidecar);
        if let Some(signal) = self.quit_off_by_default(sidecar, &outcome, rules) {
            // Counted, and told in a Normal Event, once the signal is sent.
            info!(pod = %self.name(), %sidecar, "Linkerd's /shutdown is off: its proxy ends on SIGTERM");
            if let Some(q) = self.quits.get_mut(sidecar) {
                q.state = QuitState::Escalated;
                q.signal_quit = true;
            }
            return signal;
        }
        let mut fx = vec![Effect::Count(Count::Quit { kind, result: outcome.label() })];
        let name = self.name();
        let done_ktime = self.done().and_then(|d| d.ktime);
        let Some(q) = self.quits.get_mut(sidecar) else {
            // The pod's state moved on before the answer came (a relist found the sidecar
            // ended): the acceptance is still the sidecar's, logged with its request's moment.
            if let QuitOutcome::Accepted { status, attempts, sent_ns } = &outcome {
                info!(pod = %name, %sidecar, status, attempts, sent_ns, ended_ns = done_ktime, "sidecar accepted quit");
            }
            return fx;
        };
        match &outcome {
            QuitOutcome::Accepted { status, attempts, sent_ns } => {
                q.state = QuitState::Accepted {
                    escalate_at: rules.escalate_after.map(|d| now.saturating_add(d.as_nanos() as u64)),
                };
                let after = done_ktime.map(|k| now.saturating_sub(k));
                if let Some(ns) = after {
                    fx.push(Effect::Count(Count::QuitLatency(ns as f64 / 1e9)));
                }
                let after_text = after.map(|ns| format!(" {}µs after the app finished", ns / 1000)).unwrap_or_default();
                // `sent_ns`: the request's own moment, beside the answer's (`quit_after_us` counts
                // to the answer's processing); `ended_ns`: the kernel's moment of the app's end
                // (CLOCK_MONOTONIC, as `sent_ns`).
                info!(
                    pod = %name,
                    %sidecar,
                    status,
                    attempts,
                    quit_after_us = after.map(|n| n / 1000),
                    sent_ns,
                    ended_ns = done_ktime,
                    "sidecar accepted quit"
                );
                fx.extend(rules.quit_events.then(|| Effect::Publish {
                    warning: false,
                    reason: "SidecarQuit",
                    action: "Quit",
                    note: format!("asked {sidecar} to quit: HTTP {status}{after_text}"),
                }));
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

    /// Linkerd's proxy answers 404 on `/shutdown` unless its shutdown endpoint is turned on
    /// (`LINKERD2_PROXY_SHUTDOWN_ENDPOINT_ENABLED`), which current Linkerd releases leave off: its
    /// way out is then SIGTERM, as the kubelet's. The SIGTERM to send when this quit's refusal is
    /// that, and signals are allowed (`--no-escalation` keeps the refusal a failure).
    fn quit_off_by_default(&mut self, sidecar: &str, outcome: &QuitOutcome, rules: &Rules) -> Option<Vec<Effect>> {
        let linkerd = self
            .plan
            .as_ref()
            .and_then(|p| p.sidecars.iter().find(|s| s.name == sidecar))
            .is_some_and(|s| s.kind == crate::vocab::SidecarKind::Linkerd);
        let off = matches!(outcome, QuitOutcome::Rejected { status: 404, .. });
        if !(linkerd && off && rules.escalate_after.is_some() && self.quits.contains_key(sidecar)) {
            return None;
        }
        let signal = self.escalate_now(sidecar);
        (!signal.is_empty()).then_some(signal)
    }

    /// The escalation deadline of an accepted quit passed.
    pub(super) fn escalate(&mut self, sidecar: &str) -> Vec<Effect> {
        if let Some(q) = self.quits.get_mut(sidecar) {
            q.state = QuitState::Escalated;
        }
        // Already gone: nothing to signal.
        if self.current(sidecar).is_some_and(|i| self.instance_ended(&i)) {
            return Vec::new();
        }
        self.escalate_now(sidecar)
    }

    pub(super) fn escalate_now(&mut self, sidecar: &str) -> Vec<Effect> {
        if self.sandboxed() {
            // See `start_quit`: the node would signal the sandbox, not the sidecar.
            warn!(pod = %self.name(), %sidecar, "not signalling a sandboxed pod's sidecar: the node sees only the sandbox");
            return Vec::new();
        }
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
}

/// A quit that was refused or never answered: escalate when allowed, else retry with backoff a
/// bounded number of times.
pub(super) fn failed_quit(q: &mut Quit, pod: &str, note: String, rules: &Rules, now: Nanos) -> Vec<Effect> {
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
