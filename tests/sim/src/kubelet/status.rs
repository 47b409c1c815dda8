//! The pod status the kubelet writes: each container's, the phase (`getPhase`) and the
//! conditions, from the last relist; and the pod as the API shows it before any sync.
use std::sync::atomic::Ordering;

use anyhow::Result;
use serde_json::{Value, json};

use super::*;
use crate::util;

impl Inner {
    /// The status the last relist (and the current probe results) make.
    pub(super) fn status_json(&self, kpod: &KPod) -> Value {
        let statuses = container_statuses(kpod);
        let (phase, init_done) = phase(kpod, &statuses);
        let main: Vec<_> = statuses.iter().filter(|s| s.0 == ContainerKind::Main).collect();
        let all_ready = !main.is_empty() && main.iter().all(|s| s.3);
        let terminal = matches!(phase, "Succeeded" | "Failed");
        let b = |x: bool| if x { "True" } else { "False" };
        let mut conditions = vec![
            ("PodReadyToStartContainers", b(kpod.seen_sandbox && !terminal), None),
            ("Initialized", b(init_done), None),
            ("Ready", b(all_ready), (terminal).then_some("PodCompleted")),
            ("ContainersReady", b(all_ready), (terminal).then_some("PodCompleted")),
            ("PodScheduled", "True", None),
        ];
        if !all_ready && !terminal {
            conditions[2].2 = Some("ContainersNotReady");
            conditions[3].2 = Some("ContainersNotReady");
        }
        let conditions: Vec<Value> = conditions
            .into_iter()
            .map(|(t, s, r)| {
                let mut c = json!({"type": t, "status": s});
                if let Some(r) = r {
                    c["reason"] = json!(r);
                }
                c
            })
            .collect();
        let mut status = json!({
            "phase": phase,
            "conditions": conditions,
            "containerStatuses": statuses.iter().filter(|s| s.0 == ContainerKind::Main).map(|s| s.1.clone()).collect::<Vec<_>>(),
        });
        let init: Vec<Value> = statuses.iter().filter(|s| s.0 != ContainerKind::Main).map(|s| s.1.clone()).collect();
        if !init.is_empty() {
            status["initContainerStatuses"] = json!(init);
        }
        if kpod.seen_sandbox
            && kpod.spec.report_pod_ip
            && let Some(ip) = kpod.sim.pod_ip()
        {
            status["podIP"] = json!(ip.to_string());
            status["podIPs"] = json!([{"ip": ip.to_string()}]);
        }
        status
    }

    /// Writes the status to the API if it changed (the kubelet's conditions merged by type,
    /// other writers' conditions kept).
    pub(super) fn write(&self, kpod: &mut KPod) -> Result<()> {
        let status = self.status_json(kpod);
        if kpod.last_written.as_ref() == Some(&status) {
            return Ok(());
        }
        let (ns, name) = (kpod.sim.namespace().to_string(), kpod.sim.name().to_string());
        let now = util::now_rfc3339();
        let fresh = status.clone();
        self.api.modify_pod(&ns, &name, move |pod| {
            let old = pod["status"].clone();
            let st = &mut pod["status"];
            if !st.is_object() {
                *st = json!({});
            }
            for key in ["phase", "containerStatuses", "initContainerStatuses", "podIP", "podIPs"] {
                match fresh.get(key) {
                    Some(v) => st[key] = v.clone(),
                    None => {
                        if let Some(o) = st.as_object_mut() {
                            o.remove(key);
                        }
                    }
                }
            }
            let mut conds: Vec<Value> = old["conditions"].as_array().cloned().unwrap_or_default();
            for c in fresh["conditions"].as_array().into_iter().flatten() {
                let mut c = c.clone();
                match conds.iter_mut().find(|o| o["type"] == c["type"]) {
                    Some(o) => {
                        c["lastProbeTime"] = Value::Null;
                        c["lastTransitionTime"] =
                            if o["status"] == c["status"] { o["lastTransitionTime"].clone() } else { json!(now) };
                        *o = c;
                    }
                    None => {
                        c["lastProbeTime"] = Value::Null;
                        c["lastTransitionTime"] = json!(now);
                        conds.push(c);
                    }
                }
            }
            st["conditions"] = json!(conds);
        })?;
        kpod.last_written = Some(status);
        Ok(())
    }
}

/// Whether the last relist saw every regular container done for good: exited, and not to be
/// restarted (restartPolicy Never, or OnFailure after exit 0; never with Always). The kubelet
/// then kills the pod (`computePodActions`: no container to keep or start).
pub(super) fn regular_done(kpod: &KPod) -> bool {
    let policy = kpod.spec.json.restart_policy.as_str();
    let mut regular = kpod.containers.iter().zip(kpod.seen.iter()).filter(|(k, _)| k.spec.kind == ContainerKind::Main);
    kpod.containers.iter().any(|k| k.spec.kind == ContainerKind::Main)
        && regular.all(|(k, seen)| {
            seen.exit.as_ref().is_some_and(|e| !k.spec.should_restart(policy, e.code))
                && k.current.as_ref().is_some_and(|c| Some(&c.c.id) == seen.id.as_ref())
        })
}

pub(super) fn reason(exit: &Exit) -> &'static str {
    match (exit.code, exit.signal) {
        (0, _) => "Completed",
        _ => "Error",
    }
}

pub(super) fn terminated_json(inst: &Instance, exit: &Exit, scheme: &str) -> Value {
    json!({
        "exitCode": exit.code,
        "reason": reason(exit),
        "startedAt": inst.started,
        "finishedAt": exit.finished,
        "containerID": format!("{scheme}://{}", inst.c.id),
    })
}

/// One container's status as the kubelet reports it, with what the pod's phase is made of: its
/// kind, its status object, running, ready, its exit code, and waiting ("pending" in the
/// kubelet's `getPhase`).
type Row = (ContainerKind, Value, bool, bool, Option<i32>, bool);

/// Every container's status from the last relist, in spec order.
fn container_statuses(kpod: &KPod) -> Vec<Row> {
    let scheme = kpod.sim.runtime().id_scheme();
    let mut statuses: Vec<Row> = Vec::new();
    for (k, seen) in kpod.containers.iter().zip(kpod.seen.iter()) {
        let ready_flag = match (&k.current, &seen.id) {
            (Some(inst), Some(id)) if inst.c.id == *id && inst.exit.is_none() => {
                k.spec.readiness.is_none() || inst.ready.load(Ordering::SeqCst)
            }
            _ => false,
        };
        let mut v = json!({
            "name": k.spec.name, "image": k.image,
            "imageID": format!("{}@sha256:{}", k.image, "0".repeat(64)),
            "restartCount": seen.restart_count,
            "lastState": seen.last_terminated.clone().map_or(json!({}), |t| json!({"terminated": t})),
        });
        let (running, ready, code, waiting) = match (&seen.id, &seen.exit) {
            (None, _) => {
                v["state"] = json!({"waiting": {"reason": "ContainerCreating"}});
                (false, false, None, seen.last_terminated.is_none())
            }
            (Some(id), None) => {
                v["containerID"] = json!(format!("{scheme}://{id}"));
                v["state"] = json!({"running": {"startedAt": seen.started}});
                (true, ready_flag, None, false)
            }
            (Some(id), Some(exit)) => {
                v["containerID"] = json!(format!("{scheme}://{id}"));
                let term = json!({
                    "exitCode": exit.code,
                    "reason": reason(exit),
                    "startedAt": seen.started,
                    "finishedAt": exit.finished,
                    "containerID": format!("{scheme}://{id}"),
                });
                if seen.restart_pending {
                    v["state"] = json!({"waiting": {"reason": "CrashLoopBackOff",
                            "message": format!("back-off restarting failed container {} in pod {}", k.spec.name, kpod.sim.name())}});
                    v["lastState"] = json!({"terminated": term});
                } else {
                    v["state"] = json!({"terminated": term});
                }
                (false, false, Some(exit.code), false)
            }
        };
        // `started`: running and past its startupProbe (the kubelet's startup manager).
        let started = running
            && k.current
                .as_ref()
                .is_some_and(|c| Some(&c.c.id) == seen.id.as_ref() && c.started_ok.load(Ordering::SeqCst));
        v["ready"] = json!(ready);
        v["started"] = json!(started);
        // For native sidecars, `waiting` is "pending" in the kubelet's `getPhase`: not seen yet
        // (and never terminated), or running but not started.
        let waiting = match k.spec.kind {
            ContainerKind::NativeSidecar => waiting || (running && !started),
            _ => waiting,
        };
        statuses.push((k.spec.kind, v, running, ready, code, waiting));
    }
    statuses
}

/// The pod's phase (`getPhase`) and whether it is initialized.
fn phase(kpod: &KPod, statuses: &[Row]) -> (&'static str, bool) {
    let any_regular_seen =
        kpod.seen.iter().zip(kpod.containers.iter()).any(|(s, k)| k.spec.kind == ContainerKind::Main && s.id.is_some());
    // `GeneratePodInitializedCondition`: regular init containers succeeded, and the native
    // sidecars started (or a regular container has started already).
    let init_done = statuses.iter().all(|(kind, v, _, _, code, _)| match kind {
        ContainerKind::Init => *code == Some(0),
        ContainerKind::NativeSidecar => any_regular_seen || v["started"] == true,
        ContainerKind::Main => true,
    });
    let policy = kpod.spec.json.restart_policy.as_str();
    let main: Vec<_> = statuses.iter().filter(|s| s.0 == ContainerKind::Main).collect();
    // `getPhase`: a failed container the kubelet will restart keeps the pod Running.
    let restarting = kpod.containers.iter().zip(kpod.seen.iter()).any(|(k, seen)| {
        k.spec.kind == ContainerKind::Main && seen.exit.as_ref().is_some_and(|e| k.spec.should_restart(policy, e.code))
    });
    let waiting = main.iter().filter(|s| s.5).count();
    // `getPhase`: a running native sidecar keeps the pod Running; a pending one keeps it
    // Pending; a terminated one does not count (its exit code never fails the pod).
    let native_pending = statuses.iter().filter(|s| s.0 == ContainerKind::NativeSidecar && s.5).count();
    let running = statuses.iter().filter(|s| s.0 != ContainerKind::Init && s.2).count();
    let init_failed =
        statuses.iter().any(|s| s.0 == ContainerKind::Init && s.4.is_some_and(|c| c != 0) && policy == "Never");
    let phase = if init_failed {
        "Failed"
    } else if !init_done || waiting > 0 || native_pending > 0 {
        "Pending"
    } else if running > 0 {
        "Running"
    } else if main.iter().all(|s| s.4 == Some(0)) {
        "Succeeded"
    } else if !restarting {
        "Failed"
    } else {
        "Running"
    };
    (phase, init_done)
}

/// The pod object as the API shows it before the kubelet synced anything: Pending, containers
/// waiting, no ids, no pod IP; readinessProbes and init containers in the spec.
pub(super) fn initial_pod(sim: &SimPod, spec: &KubeletPod) -> Value {
    let mut json_opts = spec.json.clone();
    json_opts.container_ids = false;
    for c in &spec.containers {
        match c.kind {
            ContainerKind::NativeSidecar if !json_opts.native_sidecars.contains(&c.name) => {
                json_opts.native_sidecars.push(c.name.clone())
            }
            ContainerKind::Init if !json_opts.init_containers.contains(&c.name) => {
                json_opts.init_containers.push(c.name.clone())
            }
            _ => {}
        }
    }
    let mut pod = sim.pod_json(&json_opts);
    // A container of the node's pod that the spec does not list (an ephemeral one, as `kubectl
    // debug` adds, started by the test) is not in the object.
    let listed = |c: &Value| spec.containers.iter().any(|s| c["name"].as_str() == Some(s.name.as_str()));
    for (part, list) in [("spec", "containers"), ("spec", "initContainers"), ("status", "containerStatuses")] {
        if let Some(items) = pod[part][list].as_array_mut() {
            items.retain(listed);
        }
    }
    for list in ["containers", "initContainers"] {
        for c in pod["spec"][list].as_array_mut().into_iter().flatten() {
            let name = c["name"].as_str().unwrap_or_default().to_string();
            let Some(cs) = spec.containers.iter().find(|s| s.name == name) else { continue };
            if let Some(probe) = &cs.readiness {
                c["readinessProbe"] = probe.json();
            }
            if let Some(probe) = &cs.startup {
                c["startupProbe"] = probe.json();
            }
            if let Some(cmd) = &cs.pre_stop {
                c["lifecycle"] = json!({"preStop": {"exec": {"command": cmd}}});
            }
            if let Some(policy) = &cs.restart_policy {
                c["restartPolicy"] = json!(policy);
            }
            if !cs.restart_rules.is_empty() {
                let rules: Vec<Value> = cs
                    .restart_rules
                    .iter()
                    .map(|(action, operator, values)| {
                        json!({"action": action, "exitCodes": {"operator": operator, "values": values}})
                    })
                    .collect();
                c["restartPolicyRules"] = json!(rules);
            }
        }
    }
    pod["spec"]["terminationGracePeriodSeconds"] = json!(spec.grace_period.as_secs());
    let waiting = |c: &Value| {
        json!({"name": c["name"], "image": c["image"], "imageID": "", "ready": false, "started": false,
               "restartCount": 0, "state": {"waiting": {"reason": "ContainerCreating"}}, "lastState": {}})
    };
    let st = &mut pod["status"];
    st["phase"] = json!("Pending");
    if let Some(o) = st.as_object_mut() {
        o.remove("podIP");
        o.remove("podIPs");
    }
    let now = util::now_rfc3339();
    let cond = |t: &str, s: &str| json!({"type": t, "status": s, "lastProbeTime": null, "lastTransitionTime": now});
    let has_init = spec.containers.iter().any(|c| c.kind != ContainerKind::Main);
    st["conditions"] = json!([
        cond("PodReadyToStartContainers", "False"),
        cond("Initialized", if has_init { "False" } else { "True" }),
        cond("Ready", "False"),
        cond("ContainersReady", "False"),
        cond("PodScheduled", "True"),
    ]);
    let main: Vec<Value> = pod["spec"]["containers"].as_array().into_iter().flatten().map(waiting).collect();
    let init: Vec<Value> = pod["spec"]["initContainers"].as_array().into_iter().flatten().map(waiting).collect();
    pod["status"]["containerStatuses"] = json!(main);
    if !init.is_empty() {
        pod["status"]["initContainerStatuses"] = json!(init);
    }
    pod
}
