//! Probing the proxies and the `valet.dev/ProxyReady` condition.

use super::*;

impl PodState {
    pub(super) fn manage_probe(&mut self, plan: &PodPlan) -> Vec<Effect> {
        let probed: Vec<_> = plan.sidecars.iter().filter(|s| s.ready.is_some()).cloned().collect();
        if probed.is_empty() {
            return self.stop_probe();
        }
        // A sandboxed pod is probed at its IP (no cgroup given: no namespace to enter).
        let pod_rel = if self.sandboxed() { None } else { self.pod_cgroup.as_ref().map(|(r, _)| r.clone()) };
        let target = (pod_rel, plan.pod_ip.clone());
        let ready = self.readiness.answer();
        // Only a pod whose work is to come is probed.
        let Phase::Working { held, probe, .. } = &mut self.phase else { return Vec::new() };
        let pace = if !held.is_empty() {
            Pace::Urgent
        } else if ready == Some(true) {
            Pace::Relaxed
        } else {
            Pace::Normal
        };
        match probe {
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

    pub(super) fn stop_probe(&mut self) -> Vec<Effect> {
        let Phase::Working { probe, .. } = &mut self.phase else { return Vec::new() };
        match probe.take() {
            Some(_) => vec![Effect::StopProbe],
            None => Vec::new(),
        }
    }

    /// Writes the condition when what we want differs from what the pod shows and what we
    /// wrote; one write at a time, so writes never overtake each other.
    pub(super) fn sync_condition(&mut self, now: Nanos) -> Vec<Effect> {
        let want = match (self.readiness.answer(), self.failed_open) {
            // Said whatever the proxy's state: the pod asked for a hold it did not get.
            (ready, _) if self.hold_refused() => {
                let why = self.api_path().map(ApiPath::explain).unwrap_or_default();
                let proxy = if ready == Some(true) { "ready" } else { "not ready yet" };
                ProxyReady {
                    ready: ready == Some(true),
                    reason: "HoldUnavailable",
                    message: format!("the app was not held: {why}; the sidecar proxy is {proxy}"),
                }
            }
            (Some(true), _) => {
                ProxyReady { ready: true, reason: "ProxyReady", message: "the sidecar proxy reports ready".into() }
            }
            (_, true) => ProxyReady {
                ready: false,
                reason: "HoldTimeout",
                message: "the proxy was not ready in time; the app was released anyway".into(),
            },
            // A readiness gate reads an absent condition as False: a False before the first True
            // would tell it nothing and cost a write per Job. Once the condition is on the record
            // (written, or shown on the pod), it follows the proxy: a proxy gone unready is said.
            (Some(false), false) if self.condition_on_record() => ProxyReady {
                ready: false,
                reason: "ProxyNotReady",
                message: "the sidecar proxy is not ready yet".into(),
            },
            (Some(false) | None, false) => return Vec::new(),
        };
        match self.writes.state {
            WriteState::InFlight => return Vec::new(),
            WriteState::RetryAt(at) if now < at => return Vec::new(),
            WriteState::RetryAt(_) | WriteState::Idle => self.writes.state = WriteState::Idle,
        }
        let on_pod = self.pod.as_ref().is_some_and(|p| condition::already_set(p, &want));
        if on_pod {
            self.writes.written = Some(want);
            return Vec::new();
        }
        if self.writes.written.as_ref() == Some(&want) && !self.written_over() {
            return Vec::new();
        }
        self.writes.written = Some(want.clone());
        self.writes.state = WriteState::InFlight;
        vec![Effect::WriteCondition(want)]
    }

    /// Whether the condition was written by us or is shown on the pod (by a predecessor's write).
    fn condition_on_record(&self) -> bool {
        self.writes.written.is_some() || self.pod.as_ref().is_some_and(|p| condition::current(p).is_some())
    }

    /// Whether the pod, seen at or after our last write, shows something else: written over.
    fn written_over(&self) -> bool {
        let seen = self.pod.as_ref().and_then(|p| p.metadata.resource_version.as_deref());
        match (seen, self.writes.written_version.as_deref()) {
            (Some(seen), Some(written)) => condition::at_or_after(seen, written),
            _ => false,
        }
    }

    pub(super) fn count_ignore(&mut self, plan: &PodPlan) -> Vec<Effect> {
        let Decision::Ignore(reason) = decide(plan, &Observed::default()) else { return Vec::new() };
        let label = ignore_label(reason);
        if self.ignored == Some(label) {
            return Vec::new();
        }
        info!(pod = %self.name(), reason = ?reason, "no sidecar shutdown for this pod");
        self.ignored = Some(label);
        vec![Effect::Count(Count::Skip(label))]
    }
}

pub(super) fn ignore_label(reason: IgnoreReason) -> SkipReason {
    match reason {
        IgnoreReason::RestartAlways => SkipReason::RestartAlways,
        IgnoreReason::NativeSidecars => SkipReason::NativeSidecars,
        IgnoreReason::NoSidecars => SkipReason::NoSidecars,
        IgnoreReason::NoApps => SkipReason::NoApps,
        IgnoreReason::Deleting => SkipReason::Deleting,
    }
}
