#!/usr/bin/env python3
"""Translates the agent's DaemonSet (deploy/base/daemonset.yaml) into the CRI requests the kubelet
would make for its pod, as JSON for the node VM (which has no YAML parser); the VM's runner
(scenarios.py's ContainerAgent) then applies what the kubelet and the runtime check at start
(tests/node/pod_rules.py: hostPath types, missing sources, recursive read-only, liveness).

What each field becomes, as the kubelet makes it (kubernetes/kubernetes):
- hostPID/hostNetwork/hostIPC -> the sandbox's and containers' `namespace_options` NODE, else POD
  (CONTAINER for pid) (pkg/kubelet/kuberuntime/helpers_linux.go `namespacesForPod`);
- image, command, args as given; env `value`, and `fieldRef` of spec.nodeName, metadata.name,
  metadata.namespace resolved from the pod (pkg/kubelet/kubelet_pods.go `makeEnvironmentVariables`,
  `podFieldSelectorRuntimeValue`); enableServiceLinks false: no service variables;
- volumeMounts: hostPath volumes only, `readOnly`, `recursiveReadOnly` (pod_rules.resolve_rro),
  the hostPath's `type` (pod_rules.check_host_path); no subPath, no mountPropagation;
- securityContext: `capabilities` add/drop passed as written, without `CAP_` (the runtime adds
  it: containerd's `WithCapabilities`; `CAP_SYS_ADMIN` would become `CAP_CAP_SYS_ADMIN`, which
  runc ignores with a warning, leaving the container without it) (kuberuntime/security_context.go
  `convertToRuntimeSecurityContext`); runAsUser/runAsGroup; readOnlyRootFilesystem; no_new_privs
  = allowPrivilegeEscalation false (`AddNoNewPrivileges`); `privileged` false only;
- seccomp: the container's profile, else the pod's, else Unconfined; RuntimeDefault and Unconfined
  (kuberuntime_sandbox/security_context: `getSeccompProfile`, fieldProfile); a Localhost profile
  is refused here;
- AppArmor: the `container.apparmor.security.beta.kubernetes.io/<name>` annotation: `unconfined`
  -> Unconfined, `runtime/default` or none -> RuntimeDefault (pkg/security/apparmor `GetProfile`,
  kuberuntime `getAppArmorProfile`); `localhost/...` refused;
- resources: limits.memory -> memory_limit_in_bytes, limits.cpu -> cpu_quota over a 100 ms
  period, requests.cpu -> cpu_shares (at least 2) (pkg/kubelet/cm/helpers_linux.go
  `MilliCPUToQuota`, `MilliCPUToShares`; kuberuntime_container_linux.go `calculateLinuxResources`);
  the QoS class from every container (pkg/apis/core/v1/helper/qos `GetPodQOS`); only cpu and
  memory;
- livenessProbe/readinessProbe: httpGet (path, a named or numbered port), periodSeconds,
  timeoutSeconds, failureThreshold (pod_rules.Liveness);
- ports: the metrics port the scenarios scrape.

The DaemonSet's own fields (selector, updateStrategy, labels and annotations of the object) and the
scheduler's (nodeSelector, affinity, tolerations, priorityClassName) do not reach the kubelet's
start of the pod and are passed over by name. Any other field, at any depth, is refused with its
path: a field this file does not translate never reaches the VM as if it were honoured.

    daemonset_cri.py <daemonset.yaml> <node name> <image> > agent-pod.json
    kubectl kustomize deploy/base | daemonset_cri.py - <node name> <image> > agent-pod.json
"""
import json
import sys

# The pod-level fields and what the kubelet does with them here. None: passed over (not the
# kubelet's start of the pod, or given to it through another field).
POD_KEYS = {"serviceAccountName", "automountServiceAccountToken", "priorityClassName", "hostPID", "hostNetwork",
            "hostIPC", "enableServiceLinks", "terminationGracePeriodSeconds", "nodeSelector", "affinity",
            "tolerations", "securityContext", "containers", "volumes"}
POD_SECURITY_KEYS = {"seccompProfile"}
CONTAINER_KEYS = {"name", "image", "imagePullPolicy", "command", "args", "env", "ports", "livenessProbe",
                  "readinessProbe", "resources", "securityContext", "volumeMounts"}
SECURITY_KEYS = {"privileged", "runAsUser", "runAsGroup", "runAsNonRoot", "readOnlyRootFilesystem",
                 "allowPrivilegeEscalation", "capabilities", "seccompProfile"}
CAPABILITY_KEYS = {"add", "drop"}
SECCOMP_KEYS = {"type"}
MOUNT_KEYS = {"name", "mountPath", "readOnly", "recursiveReadOnly"}
VOLUME_KEYS = {"name", "hostPath"}
HOST_PATH_KEYS = {"path", "type"}
RESOURCE_KEYS = {"requests", "limits"}
RESOURCE_NAMES = {"cpu", "memory"}
PROBE_KEYS = {"httpGet", "periodSeconds", "timeoutSeconds", "failureThreshold"}
HTTP_GET_KEYS = {"path", "port"}
PORT_KEYS = {"name", "containerPort", "protocol"}
ENV_KEYS = {"name", "value", "valueFrom"}
TEMPLATE_KEYS = {"metadata", "spec"}
TEMPLATE_META_KEYS = {"labels", "annotations"}
DAEMONSET_SPEC_KEYS = {"selector", "updateStrategy", "template"}
APPARMOR = "container.apparmor.security.beta.kubernetes.io/"
# The template's annotations the kubelet reads (AppArmor, above) or that are only for kubectl.
KNOWN_ANNOTATIONS = {"kubectl.kubernetes.io/default-container"}


# The name of the agent's pod this translation makes (its downward API's metadata.name).
POD_NAME = "valet-agent-x1"

def quantity(value, binary=True):
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30} if binary else {}
    value = str(value)
    for suffix, mult in units.items():
        if value.endswith(suffix):
            return int(value[: -len(suffix)]) * mult
    return int(value)


def millicores(value):
    value = str(value)
    return int(value[:-1]) if value.endswith("m") else int(float(value) * 1000)


class NotTranslated(ValueError):
    """A field of the DaemonSet this translation does not make into what the kubelet would."""


def only(obj, known, where):
    """`obj` (a mapping at `where`) has no key outside `known`, else NotTranslated naming it."""
    if not isinstance(obj, dict):
        raise NotTranslated(f"{where}: expected a mapping, got {type(obj).__name__}")
    unknown = sorted(set(obj) - set(known))
    if unknown:
        raise NotTranslated(f"{where}: field(s) not translated by the node VM's runner: "
                            + ", ".join(f"{where}.{k}" for k in unknown))
    return obj


def seccomp(profile, where):
    only(profile or {}, SECCOMP_KEYS, where)
    kind = (profile or {}).get("type", "Unconfined")
    if kind == "RuntimeDefault":
        return {"profile_type": "RuntimeDefault"}
    if kind == "Unconfined":
        return {"profile_type": "Unconfined"}
    raise NotTranslated(f"{where}.type {kind} is not translated")


def apparmor(value, where):
    """The annotation's value as the kubelet hands it to the runtime."""
    if value is None or value == "runtime/default":
        return {"profile_type": "RuntimeDefault"}
    if value == "unconfined":
        return {"profile_type": "Unconfined"}
    raise NotTranslated(f"{where}: AppArmor profile {value!r} is not translated")


def probe(p, ports, where):
    """An httpGet probe, its port resolved to a number (a named port from the container's ports)."""
    if p is None:
        return None
    only(p, PROBE_KEYS, where)
    if "httpGet" not in p:
        raise NotTranslated(f"{where}: only httpGet probes are translated")
    get = only(p["httpGet"], HTTP_GET_KEYS, f"{where}.httpGet")
    port = get["port"]
    if isinstance(port, str):
        if port not in ports:
            raise NotTranslated(f"{where}.httpGet.port: no container port named {port!r}")
        port = ports[port]
    return {"path": get.get("path", "/"), "port": int(port), "period_s": int(p.get("periodSeconds", 10)),
            "timeout_s": int(p.get("timeoutSeconds", 1)), "failure_threshold": int(p.get("failureThreshold", 3))}


def resource_list(values, where):
    only(values or {}, RESOURCE_NAMES, where)
    return values or {}


def translate_container(c, i, spec, meta, node, image, ns_opts):
    where = f"spec.template.spec.containers[{i}]"
    only(c, CONTAINER_KEYS, where)
    sc = only(c.get("securityContext", {}), SECURITY_KEYS, f"{where}.securityContext")
    if sc.get("privileged"):
        raise NotTranslated(f"{where}.securityContext.privileged: true is not translated")
    pod_sc = spec.get("securityContext", {})
    env = []
    # The downward API fields the kubelet fills in, from the pod this translation makes.
    fields = {"spec.nodeName": node, "metadata.name": POD_NAME, "metadata.namespace": meta.get("namespace", "")}
    for j, e in enumerate(c.get("env", [])):
        only(e, ENV_KEYS, f"{where}.env[{j}]")
        if "value" in e:
            env.append({"key": e["name"], "value": str(e["value"])})
            continue
        ref = only(only(e.get("valueFrom", {}), {"fieldRef"}, f"{where}.env[{j}].valueFrom").get("fieldRef", {}),
                   {"fieldPath", "apiVersion"}, f"{where}.env[{j}].valueFrom.fieldRef")
        if ref.get("fieldPath") in fields:
            env.append({"key": e["name"], "value": fields[ref["fieldPath"]]})
        else:
            raise NotTranslated(f"{where}.env[{j}] ({e['name']}): only values and the fieldRefs {sorted(fields)} "
                                "are translated")
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    mounts = []
    for j, m in enumerate(c.get("volumeMounts", [])):
        only(m, MOUNT_KEYS, f"{where}.volumeMounts[{j}]")
        if m["name"] not in volumes:
            raise NotTranslated(f"{where}.volumeMounts[{j}]: no volume {m['name']!r}")
        mounts.append({"volume": m["name"], "container_path": m["mountPath"],
                       "host_path": volumes[m["name"]]["hostPath"]["path"],
                       "readonly": bool(m.get("readOnly", False)),
                       "recursive_read_only": m.get("recursiveReadOnly", "Disabled")})
    caps = only(sc.get("capabilities", {}), CAPABILITY_KEYS, f"{where}.securityContext.capabilities")
    res = only(c.get("resources", {}), RESOURCE_KEYS, f"{where}.resources")
    limits = resource_list(res.get("limits"), f"{where}.resources.limits")
    requests = resource_list(res.get("requests"), f"{where}.resources.requests")
    resources = {"unified": {"memory.oom.group": "1"}}
    if "memory" in limits:
        resources["memory_limit_in_bytes"] = quantity(limits["memory"])
    if "cpu" in limits:
        resources["cpu_period"] = 100000
        resources["cpu_quota"] = millicores(limits["cpu"]) * 100
    if "cpu" in requests:
        resources["cpu_shares"] = max(2, millicores(requests["cpu"]) * 1024 // 1000)
    container_sc = {
        "capabilities": {
            "drop_capabilities": list(caps.get("drop", [])),
            "add_capabilities": list(caps.get("add", [])),
        },
        "namespace_options": ns_opts,
        "readonly_rootfs": bool(sc.get("readOnlyRootFilesystem", False)),
        "no_new_privs": sc.get("allowPrivilegeEscalation") is False,
        "seccomp": seccomp(sc.get("seccompProfile") or pod_sc.get("seccompProfile"),
                           f"{where}.securityContext.seccompProfile"),
        "apparmor": apparmor(meta.get("annotations", {}).get(APPARMOR + c["name"]),
                             f"spec.template.metadata.annotations[{APPARMOR + c['name']}]"),
    }
    if "runAsUser" in sc:
        container_sc["run_as_user"] = {"value": sc["runAsUser"]}
    if "runAsGroup" in sc:
        container_sc["run_as_group"] = {"value": sc["runAsGroup"]}
    ports = {}
    for j, p in enumerate(c.get("ports", [])):
        only(p, PORT_KEYS, f"{where}.ports[{j}]")
        if p.get("protocol", "TCP") != "TCP":
            raise NotTranslated(f"{where}.ports[{j}].protocol {p['protocol']} is not translated")
        if "name" in p:
            ports[p["name"]] = p["containerPort"]
    translated = {"name": c["name"], "image": image, "command": c.get("command", []), "args": c.get("args", []),
                  "envs": env, "mounts": mounts, "security_context": container_sc, "resources": resources,
                  "liveness": probe(c.get("livenessProbe"), ports, f"{where}.livenessProbe"),
                  "readiness": probe(c.get("readinessProbe"), ports, f"{where}.readinessProbe"),
                  "ports": ports}
    return translated, requests == limits and bool(limits)


def translate(ds, node, image):
    """The pod, its first container (the agent, whose metrics port the scenarios scrape) as
    `container`, the others (the deadline keeper) as `more_containers`, in the DaemonSet's order;
    the pod's hostPath volumes as `volumes` (the runner checks them on the node, as the kubelet)."""
    only(ds, {"apiVersion", "kind", "metadata", "spec"}, "DaemonSet")
    dspec = only(ds["spec"], DAEMONSET_SPEC_KEYS, "spec")
    tmpl = only(dspec["template"], TEMPLATE_KEYS, "spec.template")
    only(tmpl.get("metadata", {}), TEMPLATE_META_KEYS, "spec.template.metadata")
    spec = only(tmpl["spec"], POD_KEYS, "spec.template.spec")
    meta = dict(tmpl.get("metadata", {}), namespace=ds["metadata"]["namespace"])
    for a in meta.get("annotations", {}):
        if not (a in KNOWN_ANNOTATIONS or a.startswith(APPARMOR)):
            raise NotTranslated(f"spec.template.metadata.annotations[{a}] is not translated")
        if a.startswith(APPARMOR) and a[len(APPARMOR):] not in {c["name"] for c in spec["containers"]}:
            raise NotTranslated(f"spec.template.metadata.annotations[{a}]: no such container")
    if spec.get("enableServiceLinks", True):
        raise NotTranslated("spec.template.spec.enableServiceLinks: the service variables are not translated")
    pod_sc = only(spec.get("securityContext", {}), POD_SECURITY_KEYS, "spec.template.spec.securityContext")
    volumes = []
    for i, v in enumerate(spec.get("volumes", [])):
        only(v, VOLUME_KEYS, f"spec.template.spec.volumes[{i}]")
        if "hostPath" not in v:
            raise NotTranslated(f"spec.template.spec.volumes[{i}] ({v['name']}): only hostPath volumes are translated")
        hp = only(v["hostPath"], HOST_PATH_KEYS, f"spec.template.spec.volumes[{i}].hostPath")
        volumes.append({"name": v["name"], "path": hp["path"], "type": hp.get("type", "")})
    ns_opts = {"network": "NODE" if spec.get("hostNetwork") else "POD",
               "pid": "NODE" if spec.get("hostPID") else "CONTAINER",
               "ipc": "NODE" if spec.get("hostIPC") else "POD"}
    containers, guaranteed = [], True
    for i, c in enumerate(spec["containers"]):
        t, g = translate_container(c, i, spec, meta, node, image, ns_opts)
        containers.append(t)
        guaranteed = guaranteed and g
    # The pod's QoS class, from every container (guaranteed only if each one's requests equal its limits).
    qos = "guaranteed" if guaranteed else "burstable"
    for t in containers:
        t["qos"] = qos
    return {
        "pod": {"name": POD_NAME, "namespace": ds["metadata"]["namespace"], "uid": "d5e7a9e2-0000-4000-8000-0000000000a1",
                "labels": dict(meta.get("labels", {})), "annotations": dict(meta.get("annotations", {})),
                "namespace_options": ns_opts,
                "seccomp": seccomp(pod_sc.get("seccompProfile"), "spec.template.spec.securityContext.seccompProfile"),
                "termination_grace_s": int(spec.get("terminationGracePeriodSeconds", 30))},
        "container": containers[0],
        "more_containers": containers[1:],
        "volumes": volumes,
        "metrics_port": containers[0]["ports"]["metrics"],
    }


def main():
    import yaml

    path, node, image = sys.argv[1], sys.argv[2], sys.argv[3]
    # `-`: the rendered manifests on stdin (`kubectl kustomize deploy/base`, as cargo xtask node runs it).
    stream = sys.stdin if path == "-" else open(path)
    ds = next(d for d in yaml.safe_load_all(stream) if d and d.get("kind") == "DaemonSet")
    json.dump(translate(ds, node, image), sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
