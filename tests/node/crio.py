#!/usr/bin/env python3
"""CRI-O's node layout, without CRI-O (Debian packages none): the subset of the CRI the kubelet
stand-in (kubelet.py) calls, answered by running pods exactly as CRI-O does with
`conmon_cgroup = "pod"` (OpenShift's setting), from Debian's conmon and crun:

- RunPodSandbox: a network namespace pinned under /var/run/netns/<uuid> (CRI-O's pinns), set up
  by the CNI plugins of /etc/cni/net.d (bridge, loopback); then the infra container (pause) as
  any other container below, its config.json annotated `io.kubernetes.cri-o.ContainerType:
  sandbox`;
- CreateContainer: the bundle `config.json` written to
  `/run/containers/storage/overlay-containers/<id>/userdata` (and the same under
  /var/lib/containers/storage, CRI-O's persist dir), annotated with the kubelet's labels and
  annotations as CRI-O does (`io.kubernetes.container.name`, `io.kubernetes.pod.uid`, ...), its
  root an overlay of the image on `/var/lib/containers/storage/overlay/<id>/merged`; then conmon
  is started with CRI-O's flags (`-b <bundle> -c <id> -u <id> -r crun --exit-dir
  /var/run/crio/exits -p <pidfile> -P <conmon pidfile> --persist-dir ...`, `-s` under the
  systemd driver), held on its start pipe (`_OCI_STARTPIPE`) until it is moved into its cgroup,
  `crio-conmon-<id>.scope` in the pod's slice (a transient scope through systemd's D-Bus
  StartTransientUnit, as CRI-O's systemd manager does), or `<pod cgroup>/crio-conmon-<id>` under
  cgroupfs; it then runs `crun create`, whose `cgroupsPath` is `<pod slice>:crio:<id>` (crun
  makes `crio-<id>.scope`) or `<pod cgroup>/crio-<id>`, and reports the container's pid on its
  sync pipe (`_OCI_SYNCPIPE`). conmon stays in the node's namespaces, the container's parent,
  and started before it;
- StartContainer: `crun start <id>`; the container's end is conmon's exit file
  (`/var/run/crio/exits/<id>`, its mtime the finish time), an OOM kill its `oom` file;
- StopContainer: `crun kill` TERM, KILL after the timeout; RemoveContainer: `crun delete`, the
  overlay and the directories removed; StopPodSandbox/RemovePodSandbox: every container of the
  pod, then the infra container, the CNI DEL and the netns.

`drop_infra` (CRI-O's `drop_infra_ctr = true`, OpenShift 4.7+'s default): as CRI-O's
`Sandbox.NeedsInfra` (internal/lib/sandbox), a sandbox gets an infra container only when its pod
shares one pid namespace (`shareProcessNamespace`); otherwise no pause runs: the network namespace
is still pinned under /var/run/netns/<uuid> (pinns), and each container's config.json names it
(`linux.namespaces[{type: network, path: /var/run/netns/<uuid>}]`), the only record of the pod's
network namespace. (CRI-O's pinns also pins the IPC and UTS namespaces for the containers to share;
here each container gets new ones: nothing valet reads.)

Container ids are 64 hex digits; the API's `containerID` is `cri-o://<id>` (SCHEME).
"""
import base64
import json
import os
import secrets
import select
import subprocess
import tarfile
import time
import uuid

import kubelet

pb = kubelet.pb
SCHEME = "cri-o"
RUN = "/run/containers/storage/overlay-containers"
PERSIST = "/var/lib/containers/storage/overlay-containers"
LAYERS = "/var/lib/containers/storage/overlay"
IMAGES = "/var/lib/containers/storage/valet-images"
EXITS = "/var/run/crio/exits"
SOCKETS = "/var/run/crio"
CRUN_ROOT = "/run/crun"
CNI_CONF = "/etc/cni/net.d/10-valet.conflist"
CNI_PATH = "/usr/lib/cni"
APPARMOR_PROFILE = "crio-default"
# CRI-O's default capabilities (its `default_capabilities`).
DEFAULT_CAPS = ["CHOWN", "DAC_OVERRIDE", "FSETID", "FOWNER", "SETGID", "SETUID", "SETPCAP", "NET_BIND_SERVICE",
                "KILL"]
ALL_CAPS = sorted((
    "CHOWN DAC_OVERRIDE DAC_READ_SEARCH FOWNER FSETID KILL SETGID SETUID SETPCAP LINUX_IMMUTABLE NET_BIND_SERVICE "
    "NET_BROADCAST NET_ADMIN NET_RAW IPC_LOCK IPC_OWNER SYS_MODULE SYS_RAWIO SYS_CHROOT SYS_PTRACE SYS_PACCT "
    "SYS_ADMIN SYS_BOOT SYS_NICE SYS_RESOURCE SYS_TIME SYS_TTY_CONFIG MKNOD LEASE AUDIT_WRITE AUDIT_CONTROL SETFCAP "
    "MAC_OVERRIDE MAC_ADMIN SYSLOG WAKE_ALARM BLOCK_SUSPEND AUDIT_READ PERFMON BPF CHECKPOINT_RESTORE").split())
# As CRI-O's template (docker-default's): confined, signals from the node and from its own, and
# from the OCI runtime: Debian's apparmor labels /usr/bin/crun `crun` (an unconfined-mode
# profile), and without `peer=crun` its `crun kill` got "send signal to pidfd: Permission
# denied" (containerd's profile has the same rule).
APPARMOR = f"""#include <tunables/global>
profile {APPARMOR_PROFILE} flags=(attach_disconnected,mediate_deleted) {{
  #include <abstractions/base>
  network,
  capability,
  file,
  umount,
  signal (receive) peer=unconfined,
  signal (receive) peer=crun,
  signal (receive) peer=runc,
  signal (send,receive) peer={APPARMOR_PROFILE},
  deny @{{PROC}}/* w,
  deny @{{PROC}}/sys/[^k]** w,
  deny @{{PROC}}/sysrq-trigger rwklx,
  deny @{{PROC}}/kcore rwklx,
  deny mount,
  deny /sys/[^f]*/** wklx,
  deny /sys/f[^s]*/** wklx,
  deny /sys/fs/[^c]*/** wklx,
  deny /sys/firmware/** rwklx,
  deny /sys/kernel/security/** rwklx,
  ptrace (trace,read,tracedby,readby) peer={APPARMOR_PROFILE},
}}
"""


def run(*args, **kw):
    out = subprocess.run(args, capture_output=True, text=True, **kw)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:3])}... exited {out.returncode}: {(out.stderr or out.stdout).strip()}")
    return out


def apparmor_enabled():
    try:
        return open("/sys/module/apparmor/parameters/enabled").read().strip() == "Y"
    except OSError:
        return False


def in_scope(pid, unit):
    try:
        return any(line.rstrip().endswith("/" + unit) for line in open(f"/proc/{pid}/cgroup"))
    except OSError:
        return False


class Container:
    def __init__(self, cid, name, sandbox, bundle):
        self.id, self.name, self.sandbox, self.bundle = cid, name, sandbox, bundle
        self.pid = 0
        self.created_ns = time.time_ns()
        self.started_ns = 0
        self.image_ref = ""
        self.conmon = None
        self.sync = None
        self.persist = None


class Sandbox:
    def __init__(self, sid, config, driver):
        self.id, self.config, self.driver = sid, config, driver
        self.netns = None
        self.ip = ""
        self.infra = None
        self.containers = []

    def needs_infra(self, drop_infra):
        """CRI-O's Sandbox.NeedsInfra: always without drop_infra_ctr; with it, only for a pod that
        shares one pid namespace."""
        pid = self.config["linux"]["security_context"]["namespace_options"].get("pid", "CONTAINER")
        return not drop_infra or pid == "POD"


class Crio:
    """The CRI methods kubelet.PodRun and the scenarios call, as `runtime(method, request)`."""

    scheme = SCHEME

    def __init__(self, images_dir, driver="systemd", drop_infra=False):
        self.driver = driver
        # CRI-O's drop_infra_ctr, for the sandboxes made from now on.
        self.drop_infra = drop_infra
        self.sandboxes, self.containers = {}, {}
        self.images = {}
        for d in (RUN, PERSIST, LAYERS, IMAGES, EXITS, SOCKETS, CRUN_ROOT, "/var/run/netns"):
            os.makedirs(d, exist_ok=True)
        for tar in sorted(os.listdir(images_dir)):
            if tar.endswith(".tar"):
                self.load_image(os.path.join(images_dir, tar))
        self.apparmor = apparmor_enabled()
        if self.apparmor:
            subprocess.run(["apparmor_parser", "-Kr"], input=APPARMOR, text=True, check=True)

    # Images: an OCI layout tar (tests/node/oci_image.py) unpacked once, an overlay lower dir.
    def load_image(self, path):
        with tarfile.open(path) as t:
            def blob(digest):
                return t.extractfile("blobs/" + digest.replace(":", "/"))
            index = json.load(t.extractfile("index.json"))
            for m in index["manifests"]:
                name = m.get("annotations", {}).get("io.containerd.image.name")
                if not name:
                    continue
                manifest = json.load(blob(m["digest"]))
                config = json.load(blob(manifest["config"]["digest"]))
                rootfs = f"{IMAGES}/{manifest['config']['digest'].split(':')[1]}"
                if not os.path.isdir(rootfs):
                    tmp = rootfs + ".tmp"
                    os.makedirs(tmp, exist_ok=True)
                    for layer in manifest["layers"]:
                        with tarfile.open(fileobj=blob(layer["digest"])) as lt:
                            lt.extractall(tmp, filter="tar") if hasattr(tarfile, "data_filter") else lt.extractall(tmp)
                    os.rename(tmp, rootfs)
                self.images[name] = {"rootfs": rootfs, "config": config.get("config", {}),
                                     "ref": manifest["config"]["digest"]}

    def runtime(self, method, request, timeout=60):
        return getattr(self, method)(request)

    # The cgroups.
    def pod_parent(self, sb):
        return sb.config["linux"]["cgroup_parent"]

    def cgroups_path(self, sb, cid):
        parent = self.pod_parent(sb)
        return f"{parent}:crio:{cid}" if sb.driver == "systemd" else f"{parent}/crio-{cid}"

    def move_conmon(self, sb, cid, pid):
        """conmon into `crio-conmon-<id>.scope` in the pod's slice (CRI-O's MoveConmonToCgroup with
        conmon_cgroup = "pod"), or `<pod cgroup>/crio-conmon-<id>` under cgroupfs."""
        parent = self.pod_parent(sb)
        if sb.driver == "systemd":
            unit = f"crio-conmon-{cid}.scope"
            run("busctl", "call", "org.freedesktop.systemd1", "/org/freedesktop/systemd1",
                "org.freedesktop.systemd1.Manager", "StartTransientUnit", "ssa(sv)a(sa(sv))", unit, "fail", "4",
                "PIDs", "au", "1", str(pid), "Slice", "s", parent, "Delegate", "b", "true",
                "DefaultDependencies", "b", "false", "0")
            end = time.monotonic() + 30
            while not in_scope(pid, unit):
                if time.monotonic() > end:
                    raise RuntimeError(f"conmon {pid} not in {unit} after 30 s")
                time.sleep(0.01)
            return
        roots = ["/sys/fs/cgroup"] if kubelet.CGROUP_MODE == "v2" else kubelet.v1_hierarchies()
        for root in roots:
            d = f"{root}{parent}/crio-conmon-{cid}"
            os.makedirs(d, exist_ok=True)
            if os.path.exists(f"{root}/cpuset.cpus"):
                # v1's cpuset: a new cgroup has none (libcontainer copies its parent's, each level).
                path = root
                for part in f"{parent}/crio-conmon-{cid}".strip("/").split("/"):
                    for f in ("cpuset.cpus", "cpuset.mems"):
                        if not open(f"{path}/{part}/{f}").read().strip():
                            with open(f"{path}/{part}/{f}", "w") as out:
                                out.write(open(f"{path}/{f}").read().strip())
                    path = f"{path}/{part}"
            with open(f"{d}/cgroup.procs", "w") as f:
                f.write(str(pid))

    # Bundles.
    def spec(self, sb, cid, image, args, envs, mounts, sc, ns_opts, annotations, resources, infra=False):
        img = image["config"]
        env = list(img.get("Env") or ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"])
        env += [f"{e['key']}={base64.b64decode(e['value']).decode() if isinstance(e['value'], str) else e['value']}"
                for e in envs]
        privileged = bool(sc.get("privileged"))
        caps = ALL_CAPS if privileged else sorted(
            (set(DEFAULT_CAPS) | set(sc.get("capabilities", {}).get("add_capabilities", [])))
            - set(sc.get("capabilities", {}).get("drop_capabilities", [])))
        if "ALL" in sc.get("capabilities", {}).get("drop_capabilities", []):
            caps = sorted(set(sc.get("capabilities", {}).get("add_capabilities", [])))
        caps = [f"CAP_{c}" for c in caps]
        user = {"uid": int(sc.get("run_as_user", {}).get("value", 0)),
                "gid": int(sc.get("run_as_group", {}).get("value", 0))}
        namespaces = [{"type": "mount"}, {"type": "network", "path": sb.netns}]
        pid = ns_opts.get("pid", "CONTAINER")
        if infra:
            namespaces += [{"type": "ipc"}, {"type": "uts"}]
            if pid != "NODE":
                namespaces.append({"type": "pid"})
        elif sb.infra is None:
            # drop_infra_ctr: no infra to join (pid POD always has one: needs_infra).
            namespaces += [{"type": "ipc"}, {"type": "uts"}]
            if pid == "CONTAINER":
                namespaces.append({"type": "pid"})
        else:
            ipid = sb.infra.pid
            namespaces += [{"type": "ipc", "path": f"/proc/{ipid}/ns/ipc"},
                           {"type": "uts", "path": f"/proc/{ipid}/ns/uts"}]
            if pid == "POD":
                namespaces.append({"type": "pid", "path": f"/proc/{ipid}/ns/pid"})
            elif pid == "CONTAINER":
                namespaces.append({"type": "pid"})
        if not privileged:
            namespaces.append({"type": "cgroup"})
        oci_mounts = [
            {"destination": "/proc", "type": "proc", "source": "proc", "options": ["nosuid", "noexec", "nodev"]},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs",
             "options": ["nosuid", "strictatime", "mode=755", "size=65536k"]},
            {"destination": "/dev/pts", "type": "devpts", "source": "devpts",
             "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620"]},
            {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue", "options": ["nosuid", "noexec", "nodev"]},
            {"destination": "/dev/shm", "type": "tmpfs", "source": "shm",
             "options": ["nosuid", "noexec", "nodev", "mode=1777", "size=65536k"]},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs",
             "options": ["nosuid", "noexec", "nodev"] + ([] if privileged else ["ro"])},
            {"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup",
             "options": ["nosuid", "noexec", "nodev", "relatime"] + ([] if privileged else ["ro"])},
        ]
        for m in mounts:
            oci_mounts.append({"destination": m["container_path"], "type": "bind", "source": m["host_path"],
                               "options": ["rbind", "rprivate"] + (["ro"] if m.get("readonly") else ["rw"])})
        linux = {"namespaces": namespaces, "cgroupsPath": self.cgroups_path(sb, cid), "resources": resources}
        if not privileged:
            linux["maskedPaths"] = ["/proc/acpi", "/proc/kcore", "/proc/keys", "/proc/latency_stats",
                                    "/proc/timer_list", "/proc/timer_stats", "/proc/sched_debug", "/proc/scsi",
                                    "/sys/firmware"]
            linux["readonlyPaths"] = ["/proc/asound", "/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys",
                                      "/proc/sysrq-trigger"]
        process = {"terminal": False, "user": user, "args": args, "env": env, "cwd": img.get("WorkingDir") or "/",
                   "capabilities": {k: caps for k in ("bounding", "effective", "permitted")},
                   "noNewPrivileges": bool(sc.get("no_new_privs")), "oomScoreAdj": 1000 if infra else 0}
        apparmor = sc.get("apparmor", {}).get("profile_type")
        if self.apparmor and not privileged and apparmor != "Unconfined":
            process["apparmorProfile"] = APPARMOR_PROFILE
        return {"ociVersion": "1.0.2", "process": process,
                "root": {"path": f"{LAYERS}/{cid}/merged", "readonly": bool(sc.get("readonly_rootfs"))},
                "hostname": sb.config.get("hostname", ""), "mounts": oci_mounts, "annotations": annotations,
                "linux": linux}

    def create(self, sb, name, image_name, args, envs, mounts, sc, ns_opts, annotations, resources, infra=False,
               log_path="/dev/null"):
        image = self.images.get(image_name)
        if image is None:
            raise RuntimeError(f"image {image_name} not loaded")
        # The infra container's id is the sandbox's (CRI-O's crio-<sandbox id>.scope).
        cid = sb.id if infra else secrets.token_hex(32)
        bundle, persist, layer = f"{RUN}/{cid}/userdata", f"{PERSIST}/{cid}/userdata", f"{LAYERS}/{cid}"
        for d in (bundle, persist, f"{layer}/diff", f"{layer}/work", f"{layer}/merged"):
            os.makedirs(d, exist_ok=True)
        run("mount", "-t", "overlay", "overlay", "-o",
            f"lowerdir={image['rootfs']},upperdir={layer}/diff,workdir={layer}/work", f"{layer}/merged")
        annotations = {**annotations, "io.container.manager": "cri-o", "io.kubernetes.cri-o.ContainerID": cid,
                       "io.kubernetes.cri-o.ContainerType": "sandbox" if infra else "container",
                       "io.kubernetes.cri-o.SandboxID": sb.id, "io.kubernetes.cri-o.MountPoint": f"{layer}/merged",
                       "io.kubernetes.cri-o.Image": image["ref"], "io.kubernetes.cri-o.ImageName": image_name}
        config = self.spec(sb, cid, image, args, envs, mounts, sc, ns_opts, annotations, resources, infra)
        text = json.dumps(config)
        for d in (bundle, persist):
            with open(f"{d}/config.json", "w") as f:
                f.write(text)
        c = Container(cid, name, sb, bundle)
        c.image_ref = image["ref"]
        c.persist = persist
        # conmon, as CRI-O starts it; its start pipe holds it until it is in its cgroup.
        start_r, start_w = os.pipe()
        sync_r, sync_w = os.pipe()
        cmd = ["conmon", "-b", bundle, "-c", cid, "--exit-dir", EXITS, "-l", log_path, "--log-level", "info",
               "-n", f"k8s_{name}_{sb.config['metadata']['name']}", "-P", f"{persist}/conmon-pidfile",
               "-p", f"{persist}/pidfile", "--persist-dir", persist, "-r", "/usr/bin/crun",
               "--runtime-arg", f"--root={CRUN_ROOT}", "--socket-dir-path", SOCKETS, "-u", cid]
        if sb.driver == "systemd":
            cmd.append("-s")
        env = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
               "_OCI_STARTPIPE": str(start_r), "_OCI_SYNCPIPE": str(sync_w)}
        with open(f"{persist}/conmon.log", "w") as out:
            proc = subprocess.Popen(cmd, env=env, pass_fds=(start_r, sync_w), stdin=subprocess.DEVNULL,
                                    stdout=out, stderr=subprocess.STDOUT)
        os.close(start_r)
        os.close(sync_w)
        # Kept open for the container's life: conmon may write to it again.
        c.sync = sync_r
        try:
            self.move_conmon(sb, cid, proc.pid)
            os.write(start_w, b"0")
        finally:
            os.close(start_w)
        # One message: `{"data": <pid>}` once `crun create` returned (a negative one, and a
        # message, if it failed).
        data, end = b"", time.monotonic() + 120
        while not data.endswith(b"\n") and time.monotonic() < end:
            ready, _, _ = select.select([sync_r], [], [], 1)
            if ready:
                chunk = os.read(sync_r, 1)
                if not chunk:
                    break
                data += chunk
        proc.wait(timeout=60)  # conmon's first process exits once its monitor runs
        try:
            reply = json.loads(data)
        except ValueError:
            reply = None
        # `{"pid": N}` (conmon's API version 0, CRI-O's) or `{"data": N}` (version 1).
        pid = (reply or {}).get("data", (reply or {}).get("pid", -1))
        if pid <= 0:
            log = open(f"{persist}/conmon.log").read()[-800:]
            raise RuntimeError(f"conmon could not create {name}: {reply or data!r} {log}")
        c.pid = pid
        c.conmon = int(open(f"{persist}/conmon-pidfile").read().strip())
        self.containers[cid] = c
        return c

    def start(self, c):
        run("crun", f"--root={CRUN_ROOT}", "start", c.id)
        c.started_ns = time.time_ns()

    def exit_code(self, c):
        try:
            return int(open(f"{EXITS}/{c.id}").read().strip() or 0), os.stat(f"{EXITS}/{c.id}").st_mtime_ns
        except (OSError, ValueError):
            return None, 0

    # The CRI.
    def Status(self, req):
        return pb.StatusResponse(status={"conditions": [{"type": "RuntimeReady", "status": True},
                                                        {"type": "NetworkReady", "status": True}]})

    def RunPodSandbox(self, req):
        config = req["config"]
        sid = secrets.token_hex(32)
        sb = Sandbox(sid, config, self.driver)
        ns_opts = config["linux"]["security_context"]["namespace_options"]
        if ns_opts.get("network") != "NODE":
            name = str(uuid.uuid4())
            run("ip", "netns", "add", name)
            sb.netns = f"/var/run/netns/{name}"
            sb.ip = self.cni("ADD", sb)
        else:
            sb.netns = "/proc/1/ns/net"
        meta = config["metadata"]
        labels = dict(config.get("labels", {}))
        annotations = {**config.get("annotations", {}), **labels, "io.kubernetes.container.name": "POD",
                       "io.kubernetes.cri-o.Labels": json.dumps(labels),
                       "io.kubernetes.cri-o.Namespace": meta["namespace"], "io.kubernetes.cri-o.Name":
                           f"k8s_POD_{meta['name']}_{meta['namespace']}_{meta['uid']}_{meta.get('attempt', 0)}"}
        if sb.netns.startswith("/var/run/netns/"):
            annotations["io.kubernetes.cri-o.NamespaceOptions"] = json.dumps(ns_opts)
        if not sb.needs_infra(self.drop_infra):
            self.sandboxes[sid] = sb
            return pb.RunPodSandboxResponse(pod_sandbox_id=sid)
        image = self.images["docker.io/valet/pause:1"]
        args = (image["config"].get("Entrypoint") or []) + (image["config"].get("Cmd") or [])
        sc = {"privileged": config["linux"]["security_context"].get("privileged", False), "readonly_rootfs": True,
              "no_new_privs": True, "capabilities": {"drop_capabilities": ["ALL"]}}
        sb.infra = self.create(sb, "POD", "docker.io/valet/pause:1", args, [], [], sc, ns_opts, annotations,
                               {}, infra=True)
        self.start(sb.infra)
        self.sandboxes[sid] = sb
        return pb.RunPodSandboxResponse(pod_sandbox_id=sid)

    def cni(self, command, sb):
        conf = json.load(open(CNI_CONF))
        ip = ""
        plugins = [{"type": "loopback"}] + [p for p in conf["plugins"] if p["type"] == "bridge"]
        for plugin in plugins:
            net = {"cniVersion": conf["cniVersion"], "name": conf["name"], **plugin}
            env = {"PATH": os.environ.get("PATH", ""), "CNI_COMMAND": command, "CNI_CONTAINERID": sb.id,
                   "CNI_NETNS": sb.netns, "CNI_IFNAME": "lo" if plugin["type"] == "loopback" else "eth0",
                   "CNI_PATH": CNI_PATH}
            out = subprocess.run([f"{CNI_PATH}/{plugin['type']}"], input=json.dumps(net), env=env,
                                 capture_output=True, text=True)
            if out.returncode != 0:
                if command == "DEL":
                    continue
                raise RuntimeError(f"CNI {plugin['type']} {command}: {out.stdout} {out.stderr}")
            if command == "ADD" and plugin["type"] == "bridge":
                ip = json.loads(out.stdout)["ips"][0]["address"].split("/")[0]
        return ip

    def PodSandboxStatus(self, req):
        sb = self.sandboxes[req["pod_sandbox_id"]]
        return pb.PodSandboxStatusResponse(status={"id": sb.id, "network": {"ip": sb.ip}})

    def CreateContainer(self, req):
        sb = self.sandboxes[req["pod_sandbox_id"]]
        cfg = req["config"]
        image = self.images.get(cfg["image"]["image"])
        if image is None:
            raise RuntimeError(f"image {cfg['image']['image']} not loaded")
        # The kubelet's command replaces the image's entrypoint, its args the image's cmd.
        img = image["config"]
        command = cfg.get("command") or img.get("Entrypoint") or []
        args = cfg.get("args") or ([] if cfg.get("command") else img.get("Cmd") or [])
        linux = cfg.get("linux", {})
        sc = linux.get("security_context", {})
        res = linux.get("resources", {})
        resources = {}
        if res.get("memory_limit_in_bytes"):
            resources["memory"] = {"limit": int(res["memory_limit_in_bytes"])}
        if res.get("cpu_quota"):
            resources["cpu"] = {"quota": int(res["cpu_quota"]), "period": int(res.get("cpu_period", 100000))}
        if res.get("unified") and kubelet.CGROUP_MODE == "v2":
            resources["unified"] = dict(res["unified"])
        sandbox_meta = sb.config["metadata"]
        annotations = {**cfg.get("annotations", {}), **cfg.get("labels", {}),
                       "io.kubernetes.cri-o.Name": f"k8s_{cfg['metadata']['name']}_{sandbox_meta['name']}_"
                                                   f"{sandbox_meta['namespace']}_{sandbox_meta['uid']}_"
                                                   f"{cfg['metadata'].get('attempt', 0)}",
                       "io.kubernetes.cri-o.Labels": json.dumps(cfg.get("labels", {})),
                       "io.kubernetes.cri-o.Annotations": json.dumps(cfg.get("annotations", {}))}
        log_path = os.path.join(sb.config.get("log_directory", "/var/log/pods"), cfg.get("log_path", "x.log"))
        os.makedirs(os.path.dirname(log_path), exist_ok=True)
        ns_opts = sc.get("namespace_options", sb.config["linux"]["security_context"]["namespace_options"])
        c = self.create(sb, cfg["metadata"]["name"], cfg["image"]["image"], list(command) + list(args),
                        cfg.get("envs", []), cfg.get("mounts", []), sc, ns_opts, annotations, resources,
                        log_path=log_path)
        sb.containers.append(c)
        return pb.CreateContainerResponse(container_id=c.id)

    def StartContainer(self, req):
        self.start(self.containers[req["container_id"]])
        return pb.StartContainerResponse()

    def ContainerStatus(self, req):
        c = self.containers[req["container_id"]]
        code, finished = self.exit_code(c)
        status = {"id": c.id, "metadata": {"name": c.name}, "image_ref": c.image_ref, "created_at": c.created_ns,
                  "started_at": c.started_ns}
        if code is not None:
            oom = os.path.exists(f"{c.persist}/oom")
            status.update(state=pb.CONTAINER_EXITED, exit_code=code, finished_at=finished,
                          reason="OOMKilled" if oom else "Completed" if code == 0 else "Error")
        elif c.started_ns:
            status["state"] = pb.CONTAINER_RUNNING
        else:
            status["state"] = pb.CONTAINER_CREATED
        return pb.ContainerStatusResponse(status=status)

    def kill(self, c, sig):
        """`crun kill`, as CRI-O stops a container; a failure is printed (the stop then times out)."""
        out = subprocess.run(["crun", f"--root={CRUN_ROOT}", "kill", c.id, sig], capture_output=True, text=True)
        if out.returncode != 0 and self.exit_code(c)[0] is None:
            print(f"node crio: crun kill {c.name} {c.id[:12]} {sig}: exit {out.returncode}: "
                  f"{(out.stderr or out.stdout).strip()[:300]}", flush=True)

    def StopContainer(self, req):
        c = self.containers.get(req["container_id"])
        if c is None or self.exit_code(c)[0] is not None:
            return pb.StopContainerResponse()
        self.kill(c, "TERM")
        end = time.monotonic() + int(req.get("timeout", 0))
        while self.exit_code(c)[0] is None and time.monotonic() < end:
            time.sleep(0.05)
        if self.exit_code(c)[0] is None:
            self.kill(c, "KILL")
            end = time.monotonic() + 30
            while self.exit_code(c)[0] is None and time.monotonic() < end:
                time.sleep(0.05)
        return pb.StopContainerResponse()

    def RemoveContainer(self, req):
        c = self.containers.pop(req["container_id"], None)
        if c is None:
            return pb.RemoveContainerResponse()
        self.StopContainer({"container_id": c.id, "timeout": 0})
        subprocess.run(["crun", f"--root={CRUN_ROOT}", "delete", "--force", c.id], capture_output=True)
        # conmon exits once the container's end is written; it is gone before its scope is.
        if c.conmon:
            end = time.monotonic() + 10
            while os.path.exists(f"/proc/{c.conmon}") and time.monotonic() < end:
                time.sleep(0.05)
        subprocess.run(["umount", f"{LAYERS}/{c.id}/merged"], capture_output=True)
        for d in (f"{RUN}/{c.id}", f"{PERSIST}/{c.id}", f"{LAYERS}/{c.id}"):
            subprocess.run(["rm", "-rf", "--one-file-system", d])
        try:
            os.remove(f"{EXITS}/{c.id}")
        except OSError:
            pass
        if c.sync is not None:
            os.close(c.sync)
            c.sync = None
        if c.sandbox.driver == "cgroupfs":
            roots = ["/sys/fs/cgroup"] if kubelet.CGROUP_MODE == "v2" else kubelet.v1_hierarchies()
            for root in roots:
                d = f"{root}{self.pod_parent(c.sandbox)}/crio-conmon-{c.id}"
                try:
                    os.rmdir(d)
                except OSError:
                    pass
        if c in c.sandbox.containers:
            c.sandbox.containers.remove(c)
        return pb.RemoveContainerResponse()

    def StopPodSandbox(self, req):
        sb = self.sandboxes.get(req["pod_sandbox_id"])
        if sb is None:
            return pb.StopPodSandboxResponse()
        for c in list(sb.containers):
            self.StopContainer({"container_id": c.id, "timeout": 0})
        if sb.infra is not None:
            self.StopContainer({"container_id": sb.infra.id, "timeout": 0})
        if sb.netns and sb.netns.startswith("/var/run/netns/"):
            self.cni("DEL", sb)
        return pb.StopPodSandboxResponse()

    def RemovePodSandbox(self, req):
        sb = self.sandboxes.pop(req["pod_sandbox_id"], None)
        if sb is None:
            return pb.RemovePodSandboxResponse()
        for c in list(sb.containers):
            self.RemoveContainer({"container_id": c.id})
        if sb.infra is not None:
            self.RemoveContainer({"container_id": sb.infra.id})
        if sb.netns and sb.netns.startswith("/var/run/netns/"):
            subprocess.run(["ip", "netns", "delete", os.path.basename(sb.netns)], capture_output=True)
        return pb.RemovePodSandboxResponse()

    def describe(self):
        """Each live container's state, for a failed scenario's console: its process and conmon,
        their cgroups, its exit file, conmon's log."""
        out = []
        for c in self.containers.values():
            def cg(pid):
                try:
                    return open(f"/proc/{pid}/cgroup").read().strip().split("::")[-1]
                except OSError:
                    return "gone"
            log = ""
            try:
                log = " ".join(open(f"{c.persist}/conmon.log").read().split())[-300:]
            except OSError:
                pass
            out.append(f"crio {c.name} {c.id[:12]}: pid {c.pid} in {cg(c.pid)}, conmon {c.conmon} in {cg(c.conmon)}, "
                       f"exit {self.exit_code(c)[0]}, conmon log {log!r}")
        return out

    def kill_all(self):
        """Leaves nothing behind (the host test)."""
        for sid in list(self.sandboxes):
            self.StopPodSandbox({"pod_sandbox_id": sid})
            self.RemovePodSandbox({"pod_sandbox_id": sid})

