//! The v1 Pod object of a sim pod, as the kubelet would have reported it, and the changes tests
//! make to one (a container terminated, the pod's phase).
use std::collections::BTreeMap;

use anyhow::{Result, anyhow};
use serde_json::{Map, Value, json};

use super::*;
use crate::util;

impl SimPod {
    /// The pod's metadata: its labels and annotations, and a Job's owner and labels.
    fn metadata(&self, o: &PodJsonOptions) -> Value {
        let mut labels: Map<String, Value> = o.labels.iter().map(|(k, v)| (k.clone(), json!(v))).collect();
        let mut meta = json!({"name": self.name, "namespace": self.namespace, "uid": self.uid});
        if let Some(job) = &o.job_name {
            let job_uid = util::uuid_v4();
            for (k, v) in [
                ("batch.kubernetes.io/controller-uid", job_uid.as_str()),
                ("batch.kubernetes.io/job-name", job.as_str()),
                ("controller-uid", job_uid.as_str()),
                ("job-name", job.as_str()),
            ] {
                labels.entry(k).or_insert(json!(v));
            }
            meta["ownerReferences"] = json!([{"apiVersion": "batch/v1", "kind": "Job", "name": job, "uid": job_uid,
                                               "controller": true, "blockOwnerDeletion": true}]);
            meta["generateName"] = json!(format!("{job}-"));
        }
        meta["labels"] = Value::Object(labels);
        meta["annotations"] = Value::Object(o.annotations.iter().map(|(k, v)| (k.clone(), json!(v))).collect());
        meta
    }

    /// A realistic v1 Pod for this pod, as the kubelet would have reported it.
    pub fn pod_json(&self, o: &PodJsonOptions) -> Value {
        let now = util::now_rfc3339();
        let resources = resources(self.qos);
        let spec_of = |c: &SimContainer, sidecar: bool| {
            let mut v = json!({
                "name": c.name, "image": c.image, "imagePullPolicy": "IfNotPresent",
                "resources": resources,
                "terminationMessagePath": "/dev/termination-log", "terminationMessagePolicy": "File",
            });
            if !c.ports.is_empty() {
                v["ports"] = c.ports.iter().map(|p| json!({"containerPort": p, "protocol": "TCP"})).collect();
            }
            if sidecar {
                v["restartPolicy"] = json!("Always");
            }
            v
        };
        let status_of = |c: &SimContainer| {
            let mut v = json!({
                "name": c.name, "image": c.image, "imageID": format!("{}@sha256:{}", c.image, util::random_hex(32)),
                "ready": true, "started": true, "restartCount": 0,
                "state": {"running": {"startedAt": now}}, "lastState": {},
            });
            if o.container_ids {
                v["containerID"] = json!(format!("{}://{}", self.runtime.id_scheme(), c.id));
            }
            v
        };
        let is_sidecar = |c: &SimContainer| o.native_sidecars.contains(&c.name);
        let is_init = |c: &SimContainer| is_sidecar(c) || o.init_containers.contains(&c.name);
        let all = self.containers();
        let main: Vec<&SimContainer> = all.iter().filter(|c| !is_init(c)).collect();
        let init: Vec<&SimContainer> = all.iter().filter(|c| is_init(c)).collect();
        let meta = self.metadata(o);
        let pod_ip = self.pod_ip().map(|i| i.to_string());
        let host_ip =
            o.host_ip.clone().or_else(|| self.host_ip().map(|i| i.to_string())).unwrap_or_else(|| "10.0.0.10".into());
        let cond = |t: &str| json!({"type": t, "status": "True", "lastProbeTime": null, "lastTransitionTime": now});
        let mut status = json!({
            "phase": o.phase,
            "qosClass": self.qos.as_str(),
            "hostIP": host_ip,
            "hostIPs": [{"ip": host_ip}],
            "startTime": now,
            "conditions": [cond("PodReadyToStartContainers"), cond("Initialized"), cond("Ready"), cond("ContainersReady"), cond("PodScheduled")],
            "containerStatuses": main.iter().map(|c| status_of(c)).collect::<Vec<_>>(),
        });
        if let Some(ip) = &pod_ip {
            status["podIP"] = json!(ip);
            status["podIPs"] = json!([{"ip": ip}]);
        }
        let mut spec = json!({
            "nodeName": o.node_name,
            "restartPolicy": o.restart_policy,
            "terminationGracePeriodSeconds": 30,
            "dnsPolicy": "ClusterFirst",
            "schedulerName": "default-scheduler",
            "serviceAccountName": "default",
            "enableServiceLinks": true,
            "priority": 0,
            "securityContext": {},
            "containers": main.iter().map(|c| spec_of(c, false)).collect::<Vec<_>>(),
            "tolerations": [
                {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300},
                {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": 300}],
        });
        if let Some(class) = &o.runtime_class {
            spec["runtimeClassName"] = json!(class);
        }
        if o.share_process_namespace {
            spec["shareProcessNamespace"] = json!(true);
        }
        if !init.is_empty() {
            spec["initContainers"] = init.iter().map(|c| spec_of(c, is_sidecar(c))).collect();
            status["initContainerStatuses"] = init.iter().map(|c| status_of(c)).collect();
        }
        json!({"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": spec, "status": status})
    }
}

/// The containers' resources that make the pod's QoS class.
fn resources(qos: QosClass) -> Value {
    match qos {
        QosClass::Guaranteed => {
            json!({"requests": {"cpu": "100m", "memory": "64Mi"}, "limits": {"cpu": "100m", "memory": "64Mi"}})
        }
        QosClass::Burstable => json!({"requests": {"cpu": "50m", "memory": "32Mi"}}),
        QosClass::BestEffort => json!({}),
    }
}

/// Inputs of [`SimPod::pod_json`].
#[derive(Debug, Clone)]
pub struct PodJsonOptions {
    pub node_name: String,
    pub labels: BTreeMap<String, String>,
    pub annotations: BTreeMap<String, String>,
    /// `Never` (default), `OnFailure` or `Always`.
    pub restart_policy: String,
    /// `status.phase` (default `Running`).
    pub phase: String,
    /// `status.hostIP`; default: the host end of the pod's veth.
    pub host_ip: Option<String>,
    /// Make it a Job's pod: ownerReferences and the job labels.
    pub job_name: Option<String>,
    /// Containers declared as native sidecars (init containers with `restartPolicy: Always`).
    pub native_sidecars: Vec<String>,
    /// Containers declared as plain init containers (run to completion before the others).
    pub init_containers: Vec<String>,
    /// Report containerIDs in the statuses (false: the kubelet has not synced them yet).
    pub container_ids: bool,
    /// `spec.runtimeClassName`.
    pub runtime_class: Option<String>,
    /// `spec.shareProcessNamespace`: the containers' processes are started in the sandbox's pid
    /// namespace ([`SpawnOptions::join_pid_namespace`]).
    pub share_process_namespace: bool,
}

impl Default for PodJsonOptions {
    fn default() -> Self {
        PodJsonOptions {
            node_name: "sim-node".into(),
            labels: BTreeMap::new(),
            annotations: BTreeMap::new(),
            restart_policy: "Never".into(),
            phase: "Running".into(),
            host_ip: None,
            job_name: None,
            native_sidecars: Vec::new(),
            init_containers: Vec::new(),
            container_ids: true,
            runtime_class: None,
            share_process_namespace: false,
        }
    }
}

impl PodJsonOptions {
    pub fn node(node_name: &str) -> PodJsonOptions {
        PodJsonOptions { node_name: node_name.to_string(), ..Default::default() }
    }
    pub fn share_process_namespace(mut self, on: bool) -> Self {
        self.share_process_namespace = on;
        self
    }
    pub fn label(mut self, k: &str, v: &str) -> Self {
        self.labels.insert(k.into(), v.into());
        self
    }
    pub fn annotation(mut self, k: &str, v: &str) -> Self {
        self.annotations.insert(k.into(), v.into());
        self
    }
    pub fn restart_policy(mut self, p: &str) -> Self {
        self.restart_policy = p.into();
        self
    }
    pub fn job(mut self, name: &str) -> Self {
        self.job_name = Some(name.into());
        self
    }
    pub fn native_sidecar(mut self, container: &str) -> Self {
        self.native_sidecars.push(container.into());
        self
    }
    pub fn without_container_ids(mut self) -> Self {
        self.container_ids = false;
        self
    }
}

pub(super) fn container_status_mut<'a>(pod: &'a mut Value, container: &str) -> Option<&'a mut Value> {
    let status = pod.get_mut("status")?;
    for list in ["containerStatuses", "initContainerStatuses"] {
        if let Some(Value::Array(items)) = status.get(list)
            && let Some(i) = items.iter().position(|c| c["name"] == container)
        {
            return status.get_mut(list).and_then(|l| l.get_mut(i));
        }
    }
    None
}

/// Marks a container terminated in a pod JSON as the kubelet reports it (reason `Completed` for
/// exit 0, `Error` otherwise), keeping its containerID and start time.
pub fn mark_container_terminated(pod: &mut Value, container: &str, exit_code: i32) -> Result<()> {
    let pod_name = pod.pointer("/metadata/name").and_then(Value::as_str).unwrap_or("").to_string();
    let cs = container_status_mut(pod, container)
        .ok_or_else(|| anyhow!("pod {pod_name} has no status for container {container}"))?;
    let now = util::now_rfc3339();
    let started = cs.pointer("/state/running/startedAt").cloned().unwrap_or_else(|| json!(now));
    let mut term = json!({
        "exitCode": exit_code,
        "reason": if exit_code == 0 { "Completed" } else { "Error" },
        "startedAt": started,
        "finishedAt": now,
    });
    if let Some(id) = cs.get("containerID") {
        term["containerID"] = id.clone();
    }
    cs["state"] = json!({"terminated": term});
    cs["ready"] = json!(false);
    cs["started"] = json!(false);
    Ok(())
}

/// Sets `status.phase` (and, for terminal phases, the Ready conditions to False).
pub fn set_pod_phase(pod: &mut Value, phase: &str) {
    pod["status"]["phase"] = json!(phase);
    if matches!(phase, "Succeeded" | "Failed")
        && let Some(Value::Array(conds)) = pod.pointer_mut("/status/conditions")
    {
        for c in conds {
            if matches!(c["type"].as_str(), Some("Ready" | "ContainersReady")) {
                c["status"] = json!("False");
                c["reason"] = json!("PodCompleted");
            }
        }
    }
}

pub(super) fn default_image(name: &str) -> String {
    match name {
        "istio-proxy" => "docker.io/istio/proxyv2:1.26.0".into(),
        "linkerd-proxy" => "cr.l5d.io/linkerd/proxy:edge-25.4.1".into(),
        "cloud-sql-proxy" => "gcr.io/cloud-sql-connectors/cloud-sql-proxy:2.15.0".into(),
        "envoy" => "docker.io/envoyproxy/envoy:v1.34.0".into(),
        "vault-agent" => "docker.io/hashicorp/vault:1.18.1".into(),
        "consul-dataplane" => "docker.io/hashicorp/consul-dataplane:1.6.1".into(),
        "alloydb-auth-proxy" => "gcr.io/alloydb-connectors/alloydb-auth-proxy:1.13.3".into(),
        "kuma-sidecar" => "docker.io/kumahq/kuma-dp:2.9.3".into(),
        other => format!("docker.io/library/{other}:latest"),
    }
}
