#!/usr/bin/env python3
"""Translates the agent's DaemonSet (deploy/base/daemonset.yaml) into the CRI requests the kubelet
would make for its pod, as JSON for the node VM (which has no YAML parser):

- the pod: hostPID -> `namespace_options.pid = NODE`, the pod's seccompProfile, network `POD`
  unless hostNetwork, the AppArmor annotation;
- each container (the agent first, then the deadline keeper): its image and command, its env (`fieldRef: spec.nodeName` resolved to the node's
  name), its volumeMounts resolved against the hostPath volumes (read-only where the DaemonSet
  says so), its securityContext (capabilities `drop`/`add` as the kubelet passes them: the names
  without `CAP_`, which containerd adds; `CAP_SYS_ADMIN` would become `CAP_CAP_SYS_ADMIN`, which
  runc ignores with a warning, leaving the container without it),
  runAsUser/Group, readOnlyRootFilesystem, allowPrivilegeEscalation: false -> no_new_privs,
  RuntimeDefault seccomp), its resource limits.

Anything in the DaemonSet this translation does not know fails loudly rather than being dropped.

    daemonset_cri.py <daemonset.yaml> <node name> <image> > agent-pod.json
"""
import json
import sys

import yaml

KNOWN_CONTAINER_KEYS = {"name", "image", "imagePullPolicy", "command", "args", "env", "ports", "livenessProbe",
                        "readinessProbe", "resources", "securityContext", "volumeMounts"}
KNOWN_SECURITY_KEYS = {"privileged", "runAsUser", "runAsGroup", "runAsNonRoot", "readOnlyRootFilesystem",
                       "allowPrivilegeEscalation", "capabilities", "seccompProfile"}


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


def seccomp(profile):
    kind = (profile or {}).get("type", "Unconfined")
    if kind == "RuntimeDefault":
        return {"profile_type": "RuntimeDefault"}
    if kind == "Unconfined":
        return {"profile_type": "Unconfined"}
    raise ValueError(f"seccompProfile type {kind} is not translated")


def translate_container(c, spec, meta, node, image, ns_opts):
    unknown = set(c) - KNOWN_CONTAINER_KEYS
    if unknown:
        raise ValueError(f"container fields not translated: {sorted(unknown)}")
    sc = c.get("securityContext", {})
    unknown = set(sc) - KNOWN_SECURITY_KEYS
    if unknown:
        raise ValueError(f"securityContext fields not translated: {sorted(unknown)}")
    if sc.get("privileged"):
        raise ValueError("privileged is not translated")
    pod_sc = spec.get("securityContext", {})
    apparmor = meta.get("annotations", {}).get(f"container.apparmor.security.beta.kubernetes.io/{c['name']}")
    env = []
    # The downward API fields the kubelet fills in, from the pod this translation makes.
    fields = {"spec.nodeName": node, "metadata.name": POD_NAME, "metadata.namespace": meta.get("namespace", "")}
    for e in c.get("env", []):
        if "value" in e:
            env.append({"key": e["name"], "value": str(e["value"])})
        elif e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") in fields:
            env.append({"key": e["name"], "value": fields[e["valueFrom"]["fieldRef"]["fieldPath"]]})
        else:
            raise ValueError(f"env {e['name']}: only values and the fieldRefs {sorted(fields)} are translated")
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    mounts, host_dirs = [], []
    for m in c.get("volumeMounts", []):
        hp = volumes[m["name"]].get("hostPath")
        if hp is None:
            raise ValueError(f"volume {m['name']}: only hostPath volumes are translated")
        if hp.get("type") == "DirectoryOrCreate":
            host_dirs.append(hp["path"])
        mounts.append({"container_path": m["mountPath"], "host_path": hp["path"],
                       "readonly": bool(m.get("readOnly", False))})
    caps = sc.get("capabilities", {})
    limits = c.get("resources", {}).get("limits", {})
    requests = c.get("resources", {}).get("requests", {})
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
        "seccomp": seccomp(sc.get("seccompProfile") or pod_sc.get("seccompProfile")),
    }
    if "runAsUser" in sc:
        container_sc["run_as_user"] = {"value": sc["runAsUser"]}
    if "runAsGroup" in sc:
        container_sc["run_as_group"] = {"value": sc["runAsGroup"]}
    if apparmor == "unconfined":
        container_sc["apparmor"] = {"profile_type": "Unconfined"}
    translated = {"name": c["name"], "image": image, "command": c.get("command", []), "args": c.get("args", []),
                  "envs": env, "mounts": mounts, "security_context": container_sc, "resources": resources}
    return translated, host_dirs, requests == limits and bool(limits)


def translate(ds, node, image):
    """The pod, its first container (the agent, whose metrics port the scenarios scrape) as
    `container`, the others (the deadline keeper) as `more_containers`, in the DaemonSet's order."""
    tmpl = ds["spec"]["template"]
    spec, meta = tmpl["spec"], dict(tmpl["metadata"], namespace=ds["metadata"]["namespace"])
    if spec.get("initContainers"):
        raise ValueError("init containers are not translated")
    ns_opts = {"network": "NODE" if spec.get("hostNetwork") else "POD",
               "pid": "NODE" if spec.get("hostPID") else "CONTAINER",
               "ipc": "NODE" if spec.get("hostIPC") else "POD"}
    pod_sc = spec.get("securityContext", {})
    containers, host_dirs, guaranteed = [], [], True
    for c in spec["containers"]:
        t, dirs, g = translate_container(c, spec, meta, node, image, ns_opts)
        containers.append(t)
        host_dirs += [d for d in dirs if d not in host_dirs]
        guaranteed = guaranteed and g
    # The pod's QoS class, from every container (guaranteed only if each one's requests equal its limits).
    qos = "guaranteed" if guaranteed else "burstable"
    for t in containers:
        t["qos"] = qos
    first = spec["containers"][0]
    return {
        "pod": {"name": POD_NAME, "namespace": ds["metadata"]["namespace"], "uid": "d5e7a9e2-0000-4000-8000-0000000000a1",
                "labels": dict(meta.get("labels", {})), "annotations": dict(meta.get("annotations", {})),
                "namespace_options": ns_opts,
                "seccomp": seccomp(pod_sc.get("seccompProfile"))},
        "container": containers[0],
        "more_containers": containers[1:],
        "host_dirs": host_dirs,
        "metrics_port": next(p["containerPort"] for p in first.get("ports", []) if p.get("name") == "metrics"),
    }


def main():
    path, node, image = sys.argv[1], sys.argv[2], sys.argv[3]
    ds = next(d for d in yaml.safe_load_all(open(path)) if d and d.get("kind") == "DaemonSet")
    json.dump(translate(ds, node, image), sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
