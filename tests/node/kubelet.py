#!/usr/bin/env python3
"""A kubelet stand-in for the real-node VM: runs a pod through containerd's CRI gRPC API the way
the kubelet does, and mirrors the CRI state into the (fake) API server with the kubelet's timing.

- RunPodSandbox with the kubelet's cgroup parent for the pod's QoS class and a CNI network namespace
  (pod IP). Either cgroup driver, as the runtime is configured (containerd's `SystemdCgroup`):
  systemd, a slice (`kubepods-besteffort-pod<uid_>.slice`, systemd makes it); or cgroupfs, a path
  (`/kubepods/besteffort/pod<uid>`) that the stand-in makes first, as the kubelet does, with the
  controllers enabled on every level above it;
- the pod's pid namespace as its spec says: the container's own, the pod's (`shareProcessNamespace`,
  the sandbox's pause is pid 1) or the node's (`hostPID`); `privileged` containers (and then a
  privileged sandbox, as containerd requires);
- native sidecars (init containers with `restartPolicy: Always`) first, each started before the
  next container, then CreateContainer/StartContainer per container, in spec order; once every
  regular container of a pod that does not restart them has exited, the native sidecars are
  stopped (StopContainer, in reverse order), as the kubelet does;
- once StartContainer returned, the container's log linked as
  `/var/log/containers/<pod>_<namespace>_<container>-<id>.log` (`legacyLogSymlink`, when the runtime
  made the log file), the links removed with the pod;
- a status sync every second (the PLEG relist period), the first one a relist after the pod's
  containers started, never right away: ContainerStatus for every container, the container id in
  `status.containerStatuses` (`initContainerStatuses` for native sidecars) once it runs, `ready`
  only after the container's readinessProbe passed (httpGet on the pod IP, every `periodSeconds`), `terminated` once exited;
- a container that exited is restarted as the pod's `restartPolicy` says (`Always`, or `OnFailure`
  after a non-zero exit): a new container through the CRI (`attempt` + 1) after a back-off
  (the kubelet's first one is 10 s; RESTART_BACKOFF here), its `restartCount` and `lastState` kept;
- every container gets `memory.oom.group=1` (the kubelet does so on cgroup v2 since 1.28), so an
  OOM kill ends the whole container; on cgroup v1 and hybrid nodes (the v1 controllers hold the
  pods there) the cgroupfs driver's pod path is made in every v1 hierarchy;
- StopPodSandbox/RemovePodSandbox once every container of a `restartPolicy: Never` pod ended (and,
  with cgroupfs, the pod's cgroup removed, as the kubelet's housekeeping does).

The CRI messages come from kubernetes/cri-api's api.proto (vendored in cri/), compiled with
Debian's protoc at start; calls go through grpcio's generic unary API, so no generated stubs.
"""
import base64
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import grpc
from google.protobuf import json_format

HERE = os.path.dirname(os.path.abspath(__file__))
# `ctr` reads the same variable: the node VM's k3s layout moves the socket.
CONTAINERD = "unix://" + os.environ.get("CONTAINERD_ADDRESS", "/run/containerd/containerd.sock")
# The node's runtime: containerd through its CRI, or CRI-O's layout (crio.py: conmon and crun).
CRI_RUNTIME = os.environ.get("VALET_NODE_CRI", "containerd")
RELIST = 1.0
# Where the kubelet links each container's log (`legacyContainerLogsDir`).
CONTAINER_LOGS = "/var/log/containers"
RESTART_BACKOFF = 2.0
DRIVERS = ("systemd", "cgroupfs")


def cgroup_mode(base="/sys/fs/cgroup"):
    """The node's cgroup mode, as the kubelet and runc tell it: "v2" when /sys/fs/cgroup is the
    cgroup2 mount; otherwise the v1 controllers' hierarchies hold the pods, on a "hybrid" node
    (systemd's controller-less cgroup2 at unified/) as on a pure "v1" one."""
    if os.path.exists(f"{base}/cgroup.controllers"):
        return "v2"
    return "hybrid" if os.path.exists(f"{base}/unified/cgroup.procs") else "v1"


CGROUP_MODE = cgroup_mode()
# The hierarchy the pods' cgroups are read in: the v2 one, or (v1, hybrid) the memory controller's,
# the one the agent takes there too.
CGROUP_ROOT = "/sys/fs/cgroup" if CGROUP_MODE == "v2" else "/sys/fs/cgroup/memory"


def v1_hierarchies(base="/sys/fs/cgroup"):
    """Every v1 hierarchy's mount (`cpu,cpuacct`, `memory`, ..., the named `systemd`), without the
    symlinks systemd adds (`cpu` -> `cpu,cpuacct`) or the unified one."""
    return sorted(f"{base}/{d}" for d in os.listdir(base)
                  if d != "unified" and not os.path.islink(f"{base}/{d}") and os.path.exists(f"{base}/{d}/cgroup.procs"))


def load_api():
    out = tempfile.mkdtemp(prefix="cri-")
    # `debug_redact` (a field option newer than Debian's protoc 3.21) only changes how text formats
    # print a field, never the wire format: drop it.
    text = open(f"{HERE}/cri/api.proto").read().replace(" [debug_redact = true]", "")
    with open(f"{out}/api.proto", "w") as f:
        f.write(text)
    subprocess.run(["protoc", f"--proto_path={out}", f"--python_out={out}", "api.proto"], check=True)
    sys.path.insert(0, out)
    import api_pb2  # noqa: E402

    return api_pb2


pb = load_api()


class Cri:
    scheme = "containerd"

    def __init__(self, address=CONTAINERD):
        self.channel = grpc.insecure_channel(address)

    def call(self, service, method, request: dict, timeout=60):
        req = json_format.ParseDict(request, getattr(pb, f"{method}Request")())
        resp_cls = getattr(pb, f"{method}Response")
        fn = self.channel.unary_unary(
            f"/runtime.v1.{service}/{method}",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=resp_cls.FromString,
        )
        return fn(req, timeout=timeout)

    def runtime(self, method, request, timeout=60):
        return self.call("RuntimeService", method, request, timeout)


class Api:
    """The few API server calls a kubelet makes for its pods."""

    def __init__(self, url):
        self.url = url.rstrip("/")

    def request(self, method, path, body=None, content_type="application/json"):
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.url + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", content_type)
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.load(resp)

    def create_pod(self, pod):
        ns = pod["metadata"].get("namespace", "default")
        return self.request("POST", f"/api/v1/namespaces/{ns}/pods", pod)

    def patch_status(self, pod, status):
        ns, name = pod["metadata"].get("namespace", "default"), pod["metadata"]["name"]
        return self.request(
            "PATCH", f"/api/v1/namespaces/{ns}/pods/{name}/status", {"status": status}, "application/merge-patch+json"
        )


def env_values(envs):
    """CRI `KeyValue` carries `bytes value` (api.proto): protobuf's JSON form of bytes is base64."""
    return [{"key": e["key"], "value": base64.b64encode(e["value"].encode()).decode()} for e in envs]


def rfc3339(ns):
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(ns / 1e9)) if ns else None


def qos_class(pod):
    reqs = [c.get("resources", {}) for c in pod["spec"]["containers"]]
    if not any(r.get("requests") or r.get("limits") for r in reqs):
        return "besteffort"
    if all(r.get("limits") and r.get("requests", r["limits"]) == r["limits"] for r in reqs):
        return "guaranteed"
    return "burstable"


def cgroup_parent(pod, driver="systemd"):
    """The pod's cgroup as the kubelet names it in RunPodSandbox. systemd driver: a slice per pod
    under its QoS class's slice; cgroupfs driver: its path below the cgroup2 root."""
    uid, qos = pod["metadata"]["uid"], qos_class(pod)
    if driver == "cgroupfs":
        return f"/kubepods/pod{uid}" if qos == "guaranteed" else f"/kubepods/{qos}/pod{uid}"
    uid = uid.replace("-", "_")
    return f"kubepods-pod{uid}.slice" if qos == "guaranteed" else f"kubepods-{qos}-pod{uid}.slice"


def container_cgroup(pod, driver, cid):
    """Where the runtime puts a container (or the sandbox) of the pod, relative to the cgroup2 root:
    what `/proc/<pid>/cgroup` says for its processes."""
    if driver == "cgroupfs":
        leaf = f"crio-{cid}" if CRI_RUNTIME == "crio" else cid
        return f"{cgroup_parent(pod, driver)}/{leaf}"
    qos, uid = qos_class(pod), pod["metadata"]["uid"].replace("-", "_")
    pod_slice = f"kubepods-pod{uid}.slice" if qos == "guaranteed" else \
        f"kubepods-{qos}.slice/kubepods-{qos}-pod{uid}.slice"
    scope = f"crio-{cid}.scope" if CRI_RUNTIME == "crio" else f"cri-containerd-{cid}.scope"
    return f"/kubepods.slice/{pod_slice}/{scope}"


def make_cgroupfs_parent(path, root=CGROUP_ROOT):
    """What the kubelet's cgroupfs driver does before RunPodSandbox (its pod container manager,
    through libcontainer's cgroup v2 `CreateCgroupPath`): every level of the pod's cgroup is made,
    and every level above the pod's enables in its `cgroup.subtree_control` the controllers it
    has, so that the pod's cgroup gets them all. On cgroup v1 (and hybrid), the pod's path is
    made in every v1 hierarchy, as libcontainer's v1 cgroupfs manager does. Returns the pod
    cgroup's controllers."""
    if CGROUP_MODE != "v2":
        controllers = []
        for hierarchy in v1_hierarchies():
            os.makedirs(hierarchy + path, exist_ok=True)
            controllers += os.path.basename(hierarchy).split(",")
        return controllers
    current = root
    for part in path.strip("/").split("/"):
        have = open(f"{current}/cgroup.controllers").read().split()
        enabled = open(f"{current}/cgroup.subtree_control").read().split()
        missing = [f"+{c}" for c in have if c not in enabled]
        if missing:
            try:
                with open(f"{current}/cgroup.subtree_control", "w") as f:
                    f.write(" ".join(missing))
            except OSError:
                # As libcontainer does: one at a time, keeping whatever the kernel accepts.
                for c in missing:
                    try:
                        with open(f"{current}/cgroup.subtree_control", "w") as f:
                            f.write(c)
                    except OSError:
                        pass
        current = f"{current}/{part}"
        os.makedirs(current, exist_ok=True)
    return open(f"{current}/cgroup.controllers").read().split()


def memory_limit(resources):
    value = resources.get("limits", {}).get("memory")
    if not value:
        return 0
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30}
    for suffix, mult in units.items():
        if value.endswith(suffix):
            return int(value[: -len(suffix)]) * mult
    return int(value)


def should_restart(container, pod_policy, code):
    """Whether the kubelet restarts a regular container that exited with `code`, as
    `ContainerShouldRestart` (`pkg/api/v1/pod/util.go`, `ContainerRestartRules` on: beta and on by
    default from 1.35) decides: with a restartPolicy of its own, the first of its
    restartPolicyRules whose exit codes match decides (`Restart`: yes; another action: no; a rule
    whose operator it does not know is skipped), else its own policy; without one, the pod's."""
    def by_policy(policy):
        return policy == "Always" or (policy == "OnFailure" and code != 0)
    own = container.get("restartPolicy")
    if own is None:
        return by_policy(pod_policy)
    for rule in container.get("restartPolicyRules", []):
        codes = rule.get("exitCodes") or {}
        op, values = codes.get("operator"), codes.get("values", [])
        matched = (code in values) if op == "In" else (code not in values) if op == "NotIn" else False
        if matched:
            return rule.get("action") == "Restart"
    return by_policy(own)


class PodRun:
    """One pod on the node: its sandbox, containers, and the status the kubelet reports."""

    def __init__(self, cri: Cri, api: Api, pod, log=print, driver="systemd"):
        if driver not in DRIVERS:
            raise ValueError(f"cgroup driver {driver!r}: one of {DRIVERS}")
        self.cri, self.api, self.pod, self.log, self.driver = cri, api, pod, log, driver
        self.meta = pod["metadata"]
        self.containers = {}  # name -> {"id":..., "ready": bool, "next_probe": t, "status": CRI status dict}
        self.sandbox_id = None
        self.sandbox_cfg = None
        self.pod_ip = None
        self.next_relist = None
        self.exited_at = {}  # name -> monotonic time the status sync first reported it terminated
        # A kubelet behind, or an API server too slow to take its writes: no status write before
        # this monotonic time (what happened meanwhile is in the first write after it).
        self.hold_status_until = None
        # Called with a container's name before the kubelet creates it (a scenario's gate).
        self.before_start = None
        spec = pod["spec"]
        self.native = [c for c in spec.get("initContainers", []) if c.get("restartPolicy") == "Always"]
        if len(self.native) != len(spec.get("initContainers", [])):
            raise ValueError("init containers: only native sidecars (restartPolicy: Always) are run")

    def namespace_options(self):
        """As the kubelet's namespacesForPod: the node's pid namespace for hostPID, the pod's for
        shareProcessNamespace, else each container its own."""
        spec = self.pod["spec"]
        pid = "NODE" if spec.get("hostPID") else "POD" if spec.get("shareProcessNamespace") else "CONTAINER"
        return {"network": "POD", "pid": pid, "ipc": "POD"}

    def privileged(self, c=None):
        specs = [c] if c is not None else self.native + self.pod["spec"]["containers"]
        return any(x.get("securityContext", {}).get("privileged") for x in specs)

    def sandbox_config(self):
        m = self.meta
        ns = m.get("namespace", "default")
        labels = dict(m.get("labels", {}))
        labels.update({
            "io.kubernetes.pod.name": m["name"],
            "io.kubernetes.pod.namespace": ns,
            "io.kubernetes.pod.uid": m["uid"],
        })
        return {
            "metadata": {"name": m["name"], "uid": m["uid"], "namespace": ns, "attempt": 0},
            "hostname": m["name"],
            "log_directory": f"/var/log/pods/{ns}_{m['name']}_{m['uid']}",
            "labels": labels,
            "annotations": m.get("annotations", {}),
            "linux": {
                "cgroup_parent": cgroup_parent(self.pod, self.driver),
                # containerd refuses a privileged container in an unprivileged sandbox.
                "security_context": {"namespace_options": self.namespace_options(), "privileged": self.privileged()},
            },
        }

    def start(self):
        t = time.monotonic()
        config = self.sandbox_config()
        self.sandbox_cfg = config
        os.makedirs(config["log_directory"], exist_ok=True)
        if self.driver == "cgroupfs":
            parent = config["linux"]["cgroup_parent"]
            controllers = make_cgroupfs_parent(parent)
            if not {"cpu", "memory", "pids"} <= set(controllers):
                raise RuntimeError(f"the pod cgroup {parent} has only the controllers {controllers}")
        self.sandbox_id = self.cri.runtime("RunPodSandbox", {"config": config}).pod_sandbox_id
        status = self.cri.runtime("PodSandboxStatus", {"pod_sandbox_id": self.sandbox_id}).status
        self.pod_ip = status.network.ip
        self.log(f"kubelet: RunPodSandbox {self.sandbox_id[:12]} in {time.monotonic() - t:.3f}s, pod IP {self.pod_ip}")
        self.api.patch_status(self.pod, {"phase": "Pending", "podIP": self.pod_ip, "hostIP": "10.88.0.1"})
        for c in self.native:
            self.start_container(c, config, native=True)
            # The kubelet starts the next container only once a native sidecar has started and its
            # startupProbe (if any) passed.
            cid = self.containers[c["name"]]["id"]
            end = time.monotonic() + 60
            while self.cri.runtime("ContainerStatus", {"container_id": cid}).status.state != pb.CONTAINER_RUNNING:
                if time.monotonic() > end:
                    raise RuntimeError(f"native sidecar {c['name']} not running after 60 s")
                time.sleep(0.05)
            startup = c.get("startupProbe")
            while startup is not None and not self.http_probe(startup):
                if time.monotonic() > end:
                    raise RuntimeError(f"native sidecar {c['name']}'s startupProbe did not pass in 60 s")
                time.sleep(startup.get("periodSeconds", 10))
        for c in self.pod["spec"]["containers"]:
            self.start_container(c, config)
        # The kubelet learns of its containers on its next relist, not as it starts them.
        self.next_relist = time.monotonic() + RELIST

    def start_container(self, c, sandbox_config, attempt=0, last=None, native=False):
        m = self.meta
        ns = m.get("namespace", "default")
        linux = {"security_context": {"namespace_options": self.namespace_options(), "privileged": self.privileged(c)}}
        # securityContext.appArmorProfile, as the kubelet hands it to the runtime (the default:
        # the runtime's own profile).
        apparmor = c.get("securityContext", {}).get("appArmorProfile", {}).get("type")
        if apparmor == "Unconfined":
            linux["security_context"]["apparmor"] = {"profile_type": "Unconfined"}
        elif apparmor not in (None, "RuntimeDefault"):
            raise ValueError(f"appArmorProfile type {apparmor}: only Unconfined and RuntimeDefault are run")
        # securityContext.capabilities, as the kubelet hands them to the runtime (on top of its defaults).
        caps = c.get("securityContext", {}).get("capabilities", {})
        if caps:
            linux["security_context"]["capabilities"] = {"add_capabilities": list(caps.get("add", [])),
                                                         "drop_capabilities": list(caps.get("drop", []))}
        # cgroup v2 only: runc refuses unified resources on v1 and hybrid nodes.
        linux["resources"] = {"unified": {"memory.oom.group": "1"}} if CGROUP_MODE == "v2" else {}
        limit = memory_limit(c.get("resources", {}))
        if limit:
            linux["resources"]["memory_limit_in_bytes"] = limit
        config = {
            "metadata": {"name": c["name"], "attempt": attempt},
            "image": {"image": c["image"]},
            "command": c.get("command", []),
            "args": c.get("args", []),
            "envs": env_values([{"key": e["name"], "value": e.get("value", "")} for e in c.get("env", [])]),
            "mounts": self.mounts(c),
            "labels": {
                "io.kubernetes.container.name": c["name"],
                "io.kubernetes.pod.name": m["name"],
                "io.kubernetes.pod.namespace": ns,
                "io.kubernetes.pod.uid": m["uid"],
            },
            "annotations": {"io.kubernetes.container.restartCount": str(attempt)},
            "log_path": f"{c['name']}/{attempt}.log",
            "linux": linux,
        }
        if self.before_start is not None:
            self.before_start(c["name"])
        t = time.monotonic()
        cid = self.cri.runtime(
            "CreateContainer", {"pod_sandbox_id": self.sandbox_id, "config": config, "sandbox_config": sandbox_config}
        ).container_id
        # Its process cannot run before this; containerd's startedAt is stamped after the start
        # returned, later than the process may already serve.
        start_asked_ns = time.monotonic_ns()
        self.cri.runtime("StartContainer", {"container_id": cid})
        self.log(f"kubelet: container {c['name']} {cid[:12]} (attempt {attempt}) created and started in "
                 f"{time.monotonic() - t:.3f}s")
        self.link_log(c["name"], cid, os.path.join(sandbox_config["log_directory"], config["log_path"]))
        self.containers[c["name"]] = {"id": cid, "ready": False, "next_probe": 0.0, "spec": c, "status": None,
                                      "attempt": attempt, "last": last, "restart_at": None, "ids": [],
                                      "native": native, "stopped": False, "start_asked_ns": start_asked_ns}
        if last is not None:
            self.containers[c["name"]]["ids"] = last["ids"] + [last["id"]]

    def log_link(self, name, cid):
        """The kubelet's log link of a container (`legacyLogSymlink`: cut to 251 bytes, then `.log`)."""
        m = self.meta
        return os.path.join(CONTAINER_LOGS, f"{m['name']}_{m.get('namespace', 'default')}_{name}-{cid}"[:251] + ".log")

    def link_log(self, name, cid, log):
        """As the kubelet does once StartContainer returned: links the container's log under
        /var/log/containers, only if the runtime made the log file."""
        if not os.path.exists(log):
            return
        os.makedirs(CONTAINER_LOGS, exist_ok=True)
        link = self.log_link(name, cid)
        try:
            os.symlink(log, link)
        except OSError as e:
            self.log(f"kubelet: failed to create legacy symbolic link {link}: {e}")

    def restart_due(self, entry, st, mains_done=False):
        """Whether an exited container is to be restarted, per its restart rules. A native
        sidecar: while a regular container runs or is to be restarted, as the same relist shows them
        (`computePodActions`: once none is, the pod is killed and no init container restarted)."""
        if entry["native"]:
            return not entry["stopped"] and not mains_done
        return should_restart(entry["spec"], self.pod["spec"].get("restartPolicy", "Always"), st.exit_code)

    def mounts(self, c):
        """hostPath volumes, as the kubelet hands them to the runtime."""
        volumes = {v["name"]: v for v in self.pod["spec"].get("volumes", [])}
        out = []
        for m in c.get("volumeMounts", []):
            path = volumes.get(m["name"], {}).get("hostPath", {}).get("path")
            if path is None:
                raise ValueError(f"volume {m['name']}: only hostPath volumes are supported")
            out.append({"container_path": m["mountPath"], "host_path": path, "readonly": m.get("readOnly", False)})
        return out

    def probe(self, entry):
        probe = entry["spec"].get("readinessProbe")
        if probe is None:
            return True
        now = time.monotonic()
        if entry["ready"] or now < entry["next_probe"]:
            return entry["ready"]
        entry["next_probe"] = now + probe.get("periodSeconds", 10)
        return self.http_probe(probe)

    def http_probe(self, probe):
        get = probe["httpGet"]
        try:
            with urllib.request.urlopen(f"http://{self.pod_ip}:{get['port']}{get.get('path', '/')}", timeout=1) as r:
                return 200 <= r.status < 400
        except Exception:
            return False

    def sync(self):
        """One relist + status sync, at the relist period (it waits for the next one); returns True
        once every container has exited."""
        if self.next_relist is not None:
            time.sleep(max(0.0, self.next_relist - time.monotonic()))
        self.next_relist = time.monotonic() + RELIST
        statuses, natives, all_exited = [], [], True
        # The relist: every container's state first, then what to do with them.
        for entry in list(self.containers.values()):
            entry["status"] = self.cri.runtime("ContainerStatus", {"container_id": entry["id"]}).status
        mains = [e for e in self.containers.values() if not e["native"]]
        mains_done = all(e["status"].state == pb.CONTAINER_EXITED and not self.restart_due(e, e["status"])
                         for e in mains)
        for name, entry in list(self.containers.items()):
            st = entry["status"]
            cs = {"name": name, "image": entry["spec"]["image"], "imageID": st.image_ref,
                  "containerID": f"{self.cri.scheme}://{entry['id']}", "restartCount": entry["attempt"]}
            if entry["last"] is not None:
                cs["lastState"] = {"terminated": entry["last"]["terminated"]}
            if st.state == pb.CONTAINER_RUNNING:
                all_exited = False
                entry["ready"] = self.probe(entry)
                cs.update(started=True, ready=entry["ready"], state={"running": {"startedAt": rfc3339(st.started_at)}})
            elif st.state == pb.CONTAINER_EXITED:
                terminated = {
                    "exitCode": st.exit_code, "reason": st.reason or ("Completed" if st.exit_code == 0 else "Error"),
                    "startedAt": rfc3339(st.started_at), "finishedAt": rfc3339(st.finished_at),
                    "containerID": f"{self.cri.scheme}://{entry['id']}"}
                cs.update(started=False, ready=False, state={"terminated": terminated})
                if self.restart_due(entry, st, mains_done):
                    all_exited = False
                    now = time.monotonic()
                    if entry["restart_at"] is None:
                        entry["restart_at"] = now + RESTART_BACKOFF
                        cs["state"] = {"waiting": {"reason": "CrashLoopBackOff"}}
                        cs["lastState"] = {"terminated": terminated}
                    elif now >= entry["restart_at"]:
                        last = dict(entry, terminated=terminated)
                        self.start_container(entry["spec"], self.sandbox_cfg, entry["attempt"] + 1, last,
                                             native=entry["native"])
            else:
                all_exited = False
                cs.update(started=False, ready=False, state={"waiting": {"reason": "ContainerCreating"}})
            if "terminated" in cs["state"]:
                self.exited_at.setdefault(name, time.monotonic())
            (natives if entry["native"] else statuses).append(cs)
        to_stop = []
        if mains_done:
            # The kubelet ends native sidecars once the regular containers are done, last first,
            # each once the ones after it have exited, with the pod's grace period (SIGTERM,
            # SIGKILL at its end). It does so beside its status write, not before it: the sync
            # that sees the regular containers done publishes that status (`SetPodStatus`) and
            # kills the pod's containers in goroutines of their own.
            for entry in reversed([e for e in self.containers.values() if e["native"] and not e["stopped"]]):
                entry["stopped"] = True
                if entry["status"].state != pb.CONTAINER_EXITED:
                    to_stop.append(entry["id"])
                    all_exited = False
        phase = "Running"
        if all_exited:
            codes = [e["status"].exit_code for e in mains]
            phase = "Succeeded" if all(c == 0 for c in codes) else "Failed"
        status = {"phase": phase, "podIP": self.pod_ip, "containerStatuses": statuses}
        if self.native:
            status["initContainerStatuses"] = natives
        if self.hold_status_until is None or time.monotonic() >= self.hold_status_until:
            self.api.patch_status(self.pod, status)
        if to_stop:
            grace = self.pod["spec"].get("terminationGracePeriodSeconds", 30)
            threading.Thread(target=self.stop_in_turn, args=(to_stop, grace), daemon=True).start()
        return all_exited

    def stop_in_turn(self, ids, grace):
        """StopContainer on each, in order, each once the one before has exited (StopContainer
        returns then)."""
        for cid in ids:
            try:
                self.cri.runtime("StopContainer", {"container_id": cid, "timeout": grace}, timeout=grace + 30)
            except grpc.RpcError as e:
                print(f"kubelet: StopContainer {cid[:12]}: {e}", file=sys.stderr)

    def run_until_done(self, deadline_s):
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            if self.sync():
                return True
        return False

    def teardown(self):
        for name, entry in self.containers.items():
            # RemoveContainer's removeContainerLog takes the link with the container.
            for cid in entry["ids"] + [entry["id"]]:
                try:
                    os.unlink(self.log_link(name, cid))
                except FileNotFoundError:
                    pass
            for old in entry["ids"]:
                try:
                    self.cri.runtime("RemoveContainer", {"container_id": old})
                except grpc.RpcError as e:
                    self.log(f"kubelet: RemoveContainer {old[:12]}: {e.code()}")
            try:
                self.cri.runtime("StopContainer", {"container_id": entry["id"], "timeout": 2})
            except grpc.RpcError as e:
                self.log(f"kubelet: StopContainer {entry['id'][:12]}: {e.code()}")
        if self.sandbox_id:
            self.cri.runtime("StopPodSandbox", {"pod_sandbox_id": self.sandbox_id})
            self.cri.runtime("RemovePodSandbox", {"pod_sandbox_id": self.sandbox_id})
        if self.driver == "cgroupfs":
            roots = ["/sys/fs/cgroup"] if CGROUP_MODE == "v2" else v1_hierarchies()
            for root in roots:
                pod_cgroup = root + cgroup_parent(self.pod, self.driver)
                try:
                    os.rmdir(pod_cgroup)
                except FileNotFoundError:
                    pass
                except OSError as e:
                    self.log(f"kubelet: rmdir {pod_cgroup}: {e}")
