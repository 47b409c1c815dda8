//! Realistic pods as the API server returns them (trimmed to what matters), for the tests of
//! `spec` and `decide`.

use k8s_openapi::api::core::v1::Pod;
use serde_json::{Value, json};

pub(super) const UID: &str = "6b1f2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d";

/// A pod from JSON (`apiVersion` and `kind` added when absent); panics (test only) when the
/// JSON is not a pod.
pub(super) fn from_json(mut value: Value) -> Pod {
    if let Some(object) = value.as_object_mut() {
        object.entry("apiVersion").or_insert_with(|| json!("v1"));
        object.entry("kind").or_insert_with(|| json!("Pod"));
    }
    match serde_json::from_value(value) {
        Ok(pod) => pod,
        Err(e) => panic!("fixture is not a Pod: {e}"),
    }
}

/// A minimal pod around a `spec`.
pub(super) fn pod(spec: Value) -> Pod {
    from_json(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", "namespace": "default", "uid": UID},
        "spec": spec,
    }))
}

/// The pod with these annotations added (or replaced).
pub(super) fn with_annotations(mut pod: Pod, annotations: &[(&str, &str)]) -> Pod {
    let map = pod.metadata.annotations.get_or_insert_default();
    for (k, v) in annotations {
        map.insert((*k).to_owned(), (*v).to_owned());
    }
    pod
}

/// A CronJob's pod in an Istio-injected namespace (Istio 1.22, sidecar as a regular container).
// table: one pod object as the API server returns it (JSON data, no logic), kept whole so that it reads as `kubectl get pod -o json` shows it.
pub(super) fn istio_job() -> Pod {
    from_json(json!({
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "report-28712345-x7k2p",
            "generateName": "report-28712345-",
            "namespace": "batch",
            "uid": UID,
            "labels": {
                "batch.kubernetes.io/controller-uid": "0d4c2b7a-5e6f-4c1d-9a8b-7c6d5e4f3a2b",
                "batch.kubernetes.io/job-name": "report-28712345",
                "job-name": "report-28712345",
                "security.istio.io/tlsMode": "istio",
                "service.istio.io/canonical-name": "report",
                "service.istio.io/canonical-revision": "latest",
                "valet.dev/enabled": "true"
            },
            "annotations": {
                "istio.io/rev": "default",
                "kubectl.kubernetes.io/default-container": "report",
                "kubectl.kubernetes.io/default-logs-container": "report",
                "prometheus.io/path": "/stats/prometheus",
                "prometheus.io/port": "15020",
                "prometheus.io/scrape": "true",
                "sidecar.istio.io/status": "{\"initContainers\":[\"istio-init\"],\"containers\":[\"istio-proxy\"],\"volumes\":[\"workload-socket\",\"credential-socket\",\"workload-certs\",\"istio-envoy\",\"istio-data\",\"istio-podinfo\",\"istio-token\",\"istiod-ca-cert\"],\"imagePullSecrets\":null,\"revision\":\"default\"}"
            },
            "ownerReferences": [{
                "apiVersion": "batch/v1", "kind": "Job", "name": "report-28712345",
                "uid": "0d4c2b7a-5e6f-4c1d-9a8b-7c6d5e4f3a2b", "controller": true, "blockOwnerDeletion": true
            }]
        },
        "spec": {
            "restartPolicy": "Never",
            "serviceAccountName": "report",
            "nodeName": "worker-1",
            "initContainers": [{
                "name": "istio-init",
                "image": "docker.io/istio/proxyv2:1.22.0",
                "args": ["istio-iptables", "-p", "15001", "-z", "15006", "-u", "1337", "-m", "REDIRECT",
                         "-i", "*", "-x", "", "-b", "*", "-d", "15090,15021,15020", "--log_output_level=default:info"],
                "securityContext": {
                    "allowPrivilegeEscalation": false,
                    "capabilities": {"add": ["NET_ADMIN", "NET_RAW"], "drop": ["ALL"]},
                    "runAsGroup": 0, "runAsNonRoot": false, "runAsUser": 0
                }
            }],
            "containers": [
                {
                    "name": "report",
                    "image": "registry.example.com/batch/report:2024.06",
                    "command": ["/bin/report", "--since=24h"],
                    "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}}
                },
                {
                    "name": "istio-proxy",
                    "image": "docker.io/istio/proxyv2:1.22.0",
                    "args": ["proxy", "sidecar", "--domain", "$(POD_NAMESPACE).svc.cluster.local",
                             "--proxyLogLevel=warning", "--proxyComponentLogLevel=misc:error", "--log_output_level=default:info"],
                    "env": [
                        {"name": "PILOT_CERT_PROVIDER", "value": "istiod"},
                        {"name": "CA_ADDR", "value": "istiod.istio-system.svc:15012"},
                        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.name"}}},
                        {"name": "POD_NAMESPACE", "valueFrom": {"fieldRef": {"apiVersion": "v1", "fieldPath": "metadata.namespace"}}},
                        {"name": "ISTIO_META_APP_CONTAINERS", "value": "report"},
                        {"name": "ISTIO_META_CLUSTER_ID", "value": "Kubernetes"}
                    ],
                    "ports": [
                        {"containerPort": 15090, "name": "http-envoy-prom", "protocol": "TCP"}
                    ],
                    "readinessProbe": {
                        "failureThreshold": 4,
                        "httpGet": {"path": "/healthz/ready", "port": 15021, "scheme": "HTTP"},
                        "periodSeconds": 15, "timeoutSeconds": 3
                    },
                    "startupProbe": {
                        "failureThreshold": 600,
                        "httpGet": {"path": "/healthz/ready", "port": 15021, "scheme": "HTTP"},
                        "periodSeconds": 1, "timeoutSeconds": 3
                    },
                    "resources": {
                        "limits": {"cpu": "2", "memory": "1Gi"},
                        "requests": {"cpu": "100m", "memory": "128Mi"}
                    },
                    "securityContext": {
                        "allowPrivilegeEscalation": false,
                        "capabilities": {"drop": ["ALL"]},
                        "privileged": false, "readOnlyRootFilesystem": true,
                        "runAsGroup": 1337, "runAsNonRoot": true, "runAsUser": 1337
                    }
                }
            ]
        },
        "status": {
            "phase": "Running",
            "podIP": "10.244.1.17",
            "podIPs": [{"ip": "10.244.1.17"}],
            "qosClass": "Burstable",
            "containerStatuses": [
                {
                    "name": "istio-proxy", "ready": true, "restartCount": 0, "started": true,
                    "image": "docker.io/istio/proxyv2:1.22.0", "imageID": "docker.io/istio/proxyv2@sha256:0f7c",
                    "containerID": "containerd://8b1e3f4a5c6d7e8f9a0b1c2d3e4f5a6b7c8d9e0f1a2b3c4d5e6f7a8b9c0d1e2f",
                    "state": {"running": {"startedAt": "2024-06-01T12:00:03Z"}}
                },
                {
                    "name": "report", "ready": false, "restartCount": 0, "started": false,
                    "image": "registry.example.com/batch/report:2024.06", "imageID": "",
                    "containerID": "containerd://1a2b3c4d5e6f7a8b9c0d1e2f3a4b5c6d7e8f9a0b1c2d3e4f5a6b7c8d9e0f1a2b",
                    "state": {"terminated": {"exitCode": 0, "reason": "Completed",
                              "startedAt": "2024-06-01T12:00:02Z", "finishedAt": "2024-06-01T12:00:09Z"}}
                }
            ]
        }
    }))
}

/// A Job pod meshed by Linkerd (proxy injected first, with its linkerd-await postStart hook).
pub(super) fn linkerd_job() -> Pod {
    from_json(json!({
        "metadata": {
            "name": "migrate-4hq9z",
            "namespace": "shop",
            "uid": UID,
            "labels": {"job-name": "migrate", "linkerd.io/control-plane-ns": "linkerd", "linkerd.io/workload-ns": "shop"},
            "annotations": {
                "linkerd.io/created-by": "linkerd/proxy-injector edge-24.5.1",
                "linkerd.io/inject": "enabled",
                "linkerd.io/proxy-version": "edge-24.5.1",
                "config.linkerd.io/proxy-enable-shutdown-endpoint": "true"
            }
        },
        "spec": {
            "restartPolicy": "OnFailure",
            "initContainers": [{
                "name": "linkerd-init",
                "image": "cr.l5d.io/linkerd/proxy-init:v2.4.0",
                "args": ["--incoming-proxy-port", "4143", "--outgoing-proxy-port", "4140", "--proxy-uid", "2102",
                         "--inbound-ports-to-ignore", "4190,4191,4567,4568"]
            }],
            "containers": [
                {
                    "name": "linkerd-proxy",
                    "image": "cr.l5d.io/linkerd/proxy:edge-24.5.1",
                    "env": [
                        {"name": "LINKERD2_PROXY_ADMIN_LISTEN_ADDR", "value": "0.0.0.0:4191"},
                        {"name": "LINKERD2_PROXY_SHUTDOWN_ENDPOINT_ENABLED", "value": "true"}
                    ],
                    "lifecycle": {"postStart": {"exec": {"command": ["/usr/lib/linkerd/linkerd-await", "--timeout=2m"]}}},
                    "ports": [{"containerPort": 4143, "name": "linkerd-proxy"}, {"containerPort": 4191, "name": "linkerd-admin"}],
                    "readinessProbe": {"httpGet": {"path": "/ready", "port": 4191}, "initialDelaySeconds": 2},
                    "securityContext": {"runAsUser": 2102, "readOnlyRootFilesystem": true}
                },
                {"name": "migrate", "image": "ghcr.io/example/shop-migrate:1.4.2", "args": ["up"]}
            ]
        },
        "status": {"phase": "Pending"}
    }))
}

/// A Job pod with Google's Cloud SQL Auth Proxy v2 (quit endpoint enabled), two app containers,
/// and valet's hold annotations.
pub(super) fn cloud_sql_job() -> Pod {
    from_json(json!({
        "metadata": {
            "name": "etl-nightly-b2m4v",
            "namespace": "data",
            "uid": UID,
            "labels": {"valet.dev/enabled": "true"},
            "annotations": {"valet.dev/hold-app": "true", "valet.dev/hold-timeout": "90s"}
        },
        "spec": {
            "restartPolicy": "Never",
            "containers": [
                {"name": "etl", "image": "ghcr.io/example/etl:3.2.0"},
                {"name": "notify", "image": "curlimages/curl:8.11.1"},
                {
                    "name": "cloud-sql-proxy",
                    "image": "gcr.io/cloud-sql-connectors/cloud-sql-proxy:2.11.0",
                    "args": ["--structured-logs", "--health-check", "--http-address=0.0.0.0", "--http-port=9090",
                             "--quitquitquit", "--admin-port=9091", "--exit-zero-on-sigterm",
                             "example-project:europe-west1:warehouse"],
                    "readinessProbe": {"httpGet": {"path": "/readiness", "port": 9090}},
                    "securityContext": {"runAsNonRoot": true}
                }
            ]
        },
        "status": {"phase": "Running", "podIP": "10.4.2.9"}
    }))
}

/// A pod that names its own sidecars (`valet.dev/sidecars`, spaces included), with kinds from an
/// annotation and from images, and port overrides.
pub(super) fn override_job() -> Pod {
    from_json(json!({
        "metadata": {
            "name": "worker-0",
            "namespace": "edge",
            "uid": UID,
            "annotations": {
                "valet.dev/sidecars": " l5d , mesh,db-proxy",
                "valet.dev/sidecar-kind.mesh": "envoy",
                "valet.dev/quit-port.mesh": "9901",
                "valet.dev/ready-port.mesh": "9901",
                "valet.dev/ready-port.db-proxy": "8090"
            }
        },
        "spec": {
            "containers": [
                {"name": "worker", "image": "ghcr.io/example/worker:1"},
                {"name": "mesh", "image": "ghcr.io/example/gateway-envoy:1.30"},
                {"name": "db-proxy", "image": "gcr.io/cloud-sql-connectors/cloud-sql-proxy:2.11.0"},
                {"name": "istio-proxy", "image": "docker.io/istio/proxyv2:1.22.0"},
                {"name": "l5d", "image": "cr.l5d.io/linkerd/proxy:stable-2.14.10"}
            ]
        }
    }))
}

/// Istio 1.27 on Kubernetes 1.33: istio-proxy is a native sidecar (init container, restartPolicy Always).
pub(super) fn native_sidecar_job() -> Pod {
    from_json(json!({
        "metadata": {"name": "train-5t6zq", "namespace": "ml", "uid": UID},
        "spec": {
            "restartPolicy": "Never",
            "initContainers": [
                {"name": "istio-validation", "image": "docker.io/istio/proxyv2:1.27.0",
                 "args": ["istio-iptables", "--run-validation", "--skip-rule-apply"]},
                {
                    "name": "istio-proxy",
                    "image": "docker.io/istio/proxyv2:1.27.0",
                    "restartPolicy": "Always",
                    "args": ["proxy", "sidecar", "--domain", "$(POD_NAMESPACE).svc.cluster.local"],
                    "lifecycle": {"postStart": {"exec": {"command": ["pilot-agent", "wait", "--url=http://localhost:15020/healthz/ready"]}}},
                    "startupProbe": {"httpGet": {"path": "/healthz/ready", "port": 15021}, "periodSeconds": 1}
                }
            ],
            "containers": [{"name": "train", "image": "ghcr.io/example/train:0.9"}]
        }
    }))
}

/// Istio with holdApplicationUntilProxyStarts: istio-proxy moved first, `pilot-agent wait` hook,
/// and the per-pod ProxyConfig annotation that asked for it.
pub(super) fn istio_hold_job() -> Pod {
    from_json(json!({
        "metadata": {
            "name": "report-hold-9xk3d",
            "namespace": "batch",
            "uid": UID,
            "annotations": {
                "proxy.istio.io/config": "holdApplicationUntilProxyStarts: true\nterminationDrainDuration: 10s\n",
                "sidecar.istio.io/status": "{\"initContainers\":[\"istio-init\"],\"containers\":[\"istio-proxy\"]}"
            }
        },
        "spec": {
            "restartPolicy": "OnFailure",
            "initContainers": [{"name": "istio-init", "image": "docker.io/istio/proxyv2:1.22.0"}],
            "containers": [
                {
                    "name": "istio-proxy",
                    "image": "docker.io/istio/proxyv2:1.22.0",
                    "args": ["proxy", "sidecar"],
                    "lifecycle": {"postStart": {"exec": {"command": ["pilot-agent", "wait"]}}}
                },
                {"name": "report", "image": "registry.example.com/batch/report:2024.06"}
            ]
        }
    }))
}
