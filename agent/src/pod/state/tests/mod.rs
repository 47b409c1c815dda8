//! Table tests of every transition, on plain pods: the effects a transition returns are the
//! whole of what it does. One driver ([`Drive`]) feeds a pod its inputs; each concern's tests
//! are in the file named after it (`containers`, `ending`, `hold`, `ready`; `api_path` and
//! `native` for the pods whose ends come from the API and those with native sidecars).

use serde_json::{Value, json};

use super::*;
pub(super) use crate::pod::fixtures;
pub(super) use crate::pod::spec::{DEFAULT_HOLD_TIMEOUT, Endpoint};

pub(super) const POD_REL: &str = "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod6b1f.slice";
pub(super) const POD_CG: u64 = 100;
pub(super) const SANDBOX: u64 = 101;
pub(super) const APP: u64 = 102;
pub(super) const PROXY: u64 = 103;
pub(super) const APP2: u64 = 104;
pub(super) const PROXY2: u64 = 105;
pub(super) const SEC: Nanos = 1_000_000_000;

pub(super) fn id(cg: u64) -> String {
    format!("{cg:064x}")
}

pub(super) fn rules(escalate: bool) -> Rules {
    Rules {
        defaults: SidecarDefaults::default(),
        escalate_after: escalate.then_some(Duration::from_secs(15)),
        mode: NodeMode::Kernel,
        sandboxed_classes: vec!["kata".into(), "kata-*".into(), "gvisor".into(), "runsc".into()],
        quit_events: true,
        runtime_handlers: Default::default(),
        default_handler: None,
    }
}

/// A Job pod with an app `report` and `istio-proxy`; `statuses` as (name, cgroup of its
/// current instance, state JSON), `extra` merged into metadata.annotations.
pub(super) fn pod(policy: &str, statuses: &[(&str, u64, Value)], annotations: &[(&str, &str)]) -> Pod {
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

pub(super) fn running() -> Value {
    json!({"running": {"startedAt": "2026-01-01T00:00:00Z"}})
}

pub(super) fn terminated(code: i32) -> Value {
    json!({"terminated": {"exitCode": code, "reason": if code == 0 { "Completed" } else { "Error" }}})
}

pub(super) fn seen(cg: u64, name: Option<RuntimeName>) -> ContainerSeen {
    ContainerSeen {
        cgroup_id: cg,
        rel: format!("{POD_REL}/cri-containerd-{}.scope", id(cg)),
        id: id(cg),
        runtime_name: name,
        exec_done: false,
        live: true,
    }
}

pub(super) fn named(n: &str) -> Option<RuntimeName> {
    Some(RuntimeName::Container(n.into()))
}

/// A pod state and a clock.
pub(super) struct Drive {
    s: PodState,
    rules: Rules,
    now: Nanos,
}

impl Drive {
    pub(super) fn new(escalate: bool) -> Drive {
        Drive::with_rules(rules(escalate))
    }
    pub(super) fn with_rules(rules: Rules) -> Drive {
        Drive { s: PodState::new(fixtures::UID), rules, now: 1000 * SEC }
    }
    pub(super) fn pod(&mut self, pod: Pod) -> Vec<Effect> {
        self.s.observe_pod(pod, &self.rules, self.now)
    }
    pub(super) fn feed(&mut self, fb: Feedback) -> Vec<Effect> {
        self.s.feedback(fb, &self.rules, self.now)
    }
    pub(super) fn exit(&mut self, cg: u64, code: i32) -> Vec<Effect> {
        let exit = ExitSeen {
            container_cgroup: cg,
            tgid: 7,
            end: Some(ProcessEnd::Exited(code)),
            ktime: self.now,
            cgroup_name: None,
            ns_child: false,
        };
        self.s.exit(exit, self.now)
    }
    pub(super) fn held(&mut self, cg: u64, tgid: u32, comm: &str) -> Vec<Effect> {
        let held = HeldSeen { container_cgroup: cg, tgid, ktime: self.now, comm: comm.into() };
        self.s.held(held, self.now)
    }
    pub(super) fn after(&mut self, ms: u64) -> Vec<Effect> {
        self.now += ms * 1_000_000;
        self.s.tick(self.now)
    }
    /// The pod found on the node: cgroup, then its containers (named by the runtime).
    pub(super) fn found(&mut self, pod: Pod) -> Vec<Effect> {
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

/// The watch of the test pod's cgroup, with exits and holds on or off.
pub(super) fn watch(exits: bool, hold: bool) -> Effect {
    Effect::Watch { pod_cgroup: POD_CG, pod_rel: POD_REL.into(), exits, hold, hold_timeout: DEFAULT_HOLD_TIMEOUT }
}

pub(super) fn quits(fx: &[Effect]) -> Vec<(String, Option<String>)> {
    fx.iter()
        .filter_map(|e| match e {
            Effect::Quit { sidecar, instance, .. } => Some((sidecar.clone(), instance.clone())),
            _ => None,
        })
        .collect()
}

pub(super) fn releases(fx: &[Effect]) -> Vec<(u32, &'static str)> {
    fx.iter()
        .filter_map(|e| match e {
            Effect::Release { tgid, reason, .. } => Some((*tgid, *reason)),
            _ => None,
        })
        .collect()
}

pub(super) fn writes(fx: &[Effect]) -> Vec<(bool, &'static str)> {
    fx.iter()
        .filter_map(|e| match e {
            Effect::WriteCondition(c) => Some((c.ready, c.reason)),
            _ => None,
        })
        .collect()
}

pub(super) fn signals(fx: &[Effect]) -> Vec<(String, i32)> {
    fx.iter()
        .filter_map(|e| match e {
            Effect::Signal { sidecar, signal, .. } => Some((sidecar.clone(), *signal)),
            _ => None,
        })
        .collect()
}

pub(super) fn has(fx: &[Effect], want: &Effect) -> bool {
    fx.contains(want)
}

pub(super) fn accepted() -> QuitOutcome {
    QuitOutcome::Accepted { status: 200, attempts: 1, sent_ns: 0 }
}

mod api_path;
mod containers;
mod ending;
mod hold;
mod native;
mod ready;
