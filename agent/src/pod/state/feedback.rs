//! The results of effects: what the node, the proxy's probe, the sidecars and the API answered.

use super::*;

impl PodState {
    /// The result of an effect.
    pub fn feedback(&mut self, fb: Feedback, rules: &Rules, now: Nanos) -> Vec<Effect> {
        if self.repeats_settled_answer(&fb) {
            return Vec::new();
        }
        self.settled = false;
        let mut fx = Vec::new();
        match fb {
            Feedback::PodCgroup { rel, id } => self.found_pod_cgroup(rel, id),
            // Found after the pod's resources were let go: what the kernel may hold of them goes
            // too (the soak left a few container records behind).
            Feedback::Containers(seen) if self.is_released() => {
                fx.extend(seen.into_iter().map(|s| Effect::ForgetContainer { container_cgroup: s.cgroup_id }));
            }
            Feedback::Containers(seen) => {
                self.note_vanished(&seen);
                self.merge_containers(seen);
            }
            Feedback::EndedNamed { container_cgroup, name } => self.name_ended(container_cgroup, name),
            Feedback::LeftHeld { found, complete } => fx.extend(self.adopt(found, complete, now)),
            Feedback::Network { ok, detail } => {
                if !ok {
                    debug!(pod = %self.name(), "pod network namespace not open yet: {detail}");
                }
                if let Some(node) = self.node_mut() {
                    node.network_open = ok;
                }
                return fx;
            }
            Feedback::Probed { ready, detail } => {
                if self.done().is_some() && !ready {
                    // The proxy going away after the work is done says nothing about the pod.
                    return fx;
                }
                fx.extend(self.probed(ready, &detail, now));
            }
            Feedback::QuitDone { sidecar, outcome } => fx.extend(self.quit_done(&sidecar, outcome, rules, now)),
            Feedback::Signalled { sidecar, signal, signalled } => {
                return self.signalled(&sidecar, signal, signalled, rules);
            }
            Feedback::Recorded { container_id } => self.note_recorded(container_id),
            Feedback::ConditionWritten { want, error, version } => {
                let failed = error.is_some();
                fx.push(Effect::Count(Count::ConditionPatch { ok: !failed }));
                self.condition_written(want, error, version, now);
                if failed {
                    return fx;
                }
            }
        }
        fx.extend(self.step(now));
        fx
    }

    /// The same probe answer again (an unchanged answer is repeated once a second) to a pod with
    /// nothing left to decide: with 110 held pods, deciding each anyway was most of the agent's
    /// loop. It stays settled.
    fn repeats_settled_answer(&self, fb: &Feedback) -> bool {
        let Feedback::Probed { ready, .. } = fb else { return false };
        self.settled
            && (self.readiness.answer() == Some(*ready) || (self.done().is_some() && !*ready))
            // A ready answer still releases what was held since the last one.
            && (!*ready || self.held_now().is_empty())
    }

    fn found_pod_cgroup(&mut self, rel: String, id: u64) {
        if self.pod_cgroup.as_ref().map(|(_, i)| *i) != Some(id) {
            debug!(pod = %self.name(), cgroup = %rel, "found pod cgroup");
            self.pod_cgroup = Some((rel, id));
            if let Some(node) = self.node_mut() {
                node.watching = None;
                node.network_open = false;
            }
        }
    }

    /// A probe answer: a ready one releases what is held.
    fn probed(&mut self, ready: bool, detail: &str, now: Nanos) -> Vec<Effect> {
        match (self.readiness.answer(), ready) {
            // Said at each change: before the first ready answer no condition says it.
            (answer, false) if answer != Some(false) => info!(pod = %self.name(), %detail, "proxy not ready"),
            (answer, true) if answer != Some(true) => debug!(pod = %self.name(), "proxy ready"),
            _ => {}
        }
        if !ready {
            self.readiness = Readiness::NotReady;
            return Vec::new();
        }
        self.readiness = Readiness::Ready { at: now };
        self.release_all("ready")
    }

    /// A sidecar was signalled: its own way to quit, the way out of one that has no quit
    /// endpoint on, or an escalation.
    fn signalled(&self, sidecar: &str, signal: i32, signalled: usize, rules: &Rules) -> Vec<Effect> {
        let mut fx = Vec::new();
        let kind = self.sidecar_kind(sidecar);
        let is_quit = self
            .plan
            .as_ref()
            .and_then(|p| p.sidecars.iter().find(|s| s.name == sidecar))
            .is_some_and(|s| s.quit.is_none());
        let signal_quit = self.quits.get(sidecar).is_some_and(|q| q.signal_quit);
        if is_quit {
            info!(pod = %self.name(), %sidecar, signal, signalled, "signalled sidecar to quit");
            fx.push(Effect::Count(Count::Quit { kind, result: if signalled > 0 { "ok" } else { "gone" } }));
        } else if signal_quit {
            info!(pod = %self.name(), %sidecar, signal, signalled, "signalled sidecar to quit: its quit endpoint is off");
            fx.push(Effect::Count(Count::Quit { kind, result: if signalled > 0 { "ok" } else { "gone" } }));
            fx.extend(rules.quit_events.then(|| Effect::Publish {
                warning: false,
                reason: "SidecarQuit",
                action: "Quit",
                note: format!(
                    "sent SIGTERM to {sidecar} ({signalled} process(es)), Linkerd's proxy's own way out: \
                     its /shutdown endpoint is off, as Linkerd ships it"
                ),
            }));
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
        fx
    }

    /// A write of the condition came back; a failed one is retried after a backoff (never a loop
    /// against the API).
    fn condition_written(&mut self, want: ProxyReady, error: Option<String>, version: Option<String>, now: Nanos) {
        let w = &mut self.writes;
        w.state = WriteState::Idle;
        w.written_version = version;
        let Some(e) = error else {
            w.failures = 0;
            return;
        };
        if w.written.as_ref() == Some(&want) {
            w.written = None;
        }
        w.failures = w.failures.saturating_add(1);
        let backoff = condition::retry_after(w.failures).as_nanos() as u64;
        w.state = WriteState::RetryAt(now.saturating_add(backoff));
        warn!(pod = %self.name(), "write {} condition: {e}", condition::CONDITION_TYPE);
    }
}
