#!/usr/bin/env python3
"""When the runtime records an exit, measured on the node (inside the VM; `cargo xtask node --lag N`).

The kubelet decides from the runtime's record of a container (CRI ContainerStatus, read on its PLEG
relist, or GetContainerEvents), not from the kernel's. containerd's CRI plugin records an exit only
after its exit handler ran `task.Delete` (the shim, `runc delete`, the IO drain), each container in
its own goroutine, and then `Status.UpdateSync`, which writes the container's status checkpoint
(`<containerd root>/io.containerd.grpc.v1.cri/containers/<id>/status`) atomically and then sets the
in-memory status, under the lock every ContainerStatus takes. This measures, per run, a Job-shaped
pod (one sandbox for all runs): a native sidecar (an init container with `restartPolicy: Always`: a
shell that exits 0 on SIGTERM, with a background sleep in its cgroup) and an app (a shell with three
background sleeps that it kills and reaps before it exits 0, released through a FIFO). All moments
are CLOCK_REALTIME nanoseconds in the VM (containerd's FinishedAt is on that clock), per container:

- kernel: the main process's exit: the wake-up of a pidfd poll in a process of its own at
  SCHED_FIFO (`--kernel-watch`, started before the app is released), which also sends today's quit;
- shim: containerd's FinishedAt (the shim's reap of the main process);
- cgroup: its cgroup directory gone; bundle: the shim's bundle directory
  (`<state>/io.containerd.runtime.v2.task/k8s.io/<id>`) gone; status_file: its CRI status file
  first shows a FinishedAt: all three polled every 1 ms by one thread, from the main process's exit;
- cri: the first ContainerStatus answer that says EXITED (each container polled by its own thread,
  a call every 1 ms plus the call's own time, from the main process's exit: the moment is the
  answer's receipt, and `cri_sent` the sending of that call, before which the state was not yet
  known to be EXITED);
- event: the CONTAINER_STOPPED_EVENT received from GetContainerEvents (containerd 1.7+);
- quit (the sidecar's): its SIGTERM, sent by one of three ways, taken in turn run after run:
  `kernel` (today's agent: at the app's kernel exit), `status_file` (once the app's status file
  records its exit), `cri` (once the CRI reports the app EXITED).

An inversion is a run in which the CRI reported the sidecar EXITED before the app: a kubelet sync
in that window sees "sidecar exited, app running" and restarts the native sidecar.

    runtime_lag.py <images dir> <out dir> <runs per way> [way,way]
    runtime_lag.py --table <lag.jsonl>      (the tables again, from a run's moments)

Prints `node lag ...` lines (the tables) and writes every run's moments to <out>/lag.jsonl.
"""
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
# grpc, kubelet (which compiles the CRI's proto at import) and scenarios.py's helpers only where
# the runs are made: the kernel watcher and `--table` need none of them.
grpc = kubelet = pb = scenarios = None
WAYS = ("kernel", "status_file", "cri")
WORK = "/run/valet-lag"
STATE = os.environ.get("VALET_NODE_STATE", "/run/containerd")
RUN_DEADLINE_S = 60
POLL_S = 0.001
APP = ("sleep 2147483647 & a=$!; sleep 2147483647 & b=$!; sleep 2147483647 & c=$!; "
       "read go < /lag/go; kill $a $b $c; wait; exit 0")
SIDECAR = "trap 'exit 0' TERM; sleep 2147483647 & touch /lag/sidecar-ready; wait"


def now():
    return time.time_ns()


def log(msg):
    print(f"node lag [{time.monotonic():9.3f}] {msg}", flush=True)


class NoApi:
    """The pod lives in the CRI only: nothing mirrors it into an API server here."""

    def patch_status(self, pod, status):
        pass


class Events(threading.Thread):
    """GetContainerEvents, followed for the whole measurement: the first STOPPED event per
    container, stamped on receipt. `available` is False where the runtime does not have it."""

    def __init__(self, cri):
        super().__init__(daemon=True)
        self.cri, self.stopped, self.available, self.error = cri, {}, None, None
        self.start()

    def run(self):
        call = self.cri.channel.unary_stream(
            "/runtime.v1.RuntimeService/GetContainerEvents",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=pb.ContainerEventResponse.FromString)
        try:
            for event in call(pb.GetEventsRequest()):
                self.available = True
                if event.container_event_type == pb.CONTAINER_STOPPED_EVENT:
                    self.stopped.setdefault(event.container_id, now())
        except grpc.RpcError as e:
            self.available = False
            self.error = f"{e.code().name}: {e.details()}"


class Watch:
    """One container's moments and where to look for them."""

    def __init__(self, cri, cid, root):
        self.cid = cid
        info = json.loads(cri.runtime("ContainerStatus", {"container_id": cid, "verbose": True}).info["info"])
        self.pid = info["pid"]
        self.pidfd = os.pidfd_open(self.pid)
        self.cgroup = scenarios.container_cgroup_dir(cid)
        if self.cgroup is None:
            raise RuntimeError(f"no cgroup found for {cid[:12]}")
        self.bundle = f"{STATE}/io.containerd.runtime.v2.task/k8s.io/{cid}"
        if not os.path.isdir(self.bundle):
            raise RuntimeError(f"no bundle at {self.bundle}")
        self.status_file = f"{root}/containers/{cid}/status"
        if not os.path.exists(self.status_file):
            raise RuntimeError(f"no CRI status file at {self.status_file}")
        self.at = {}


def status_file_exited(path):
    """The CRI status checkpoint's FinishedAt (ns), or 0; it is replaced atomically (rename)."""
    try:
        with open(path) as f:
            # versionedStatus embeds Status: its fields are at the top level.
            return json.load(f).get("FinishedAt", 0)
    except (OSError, ValueError):
        return 0


class Run:
    def __init__(self, cri, pod, index, way, root, events):
        self.cri, self.pod, self.index, self.way, self.root, self.events = cri, pod, index, way, root, events
        self.quit_lock = threading.Lock()
        self.checks = []
        self.done = threading.Event()

    def quit_sidecar(self):
        with self.quit_lock:
            if "quit" in self.side.at:
                return
            self.side.at["quit"] = now()
            os.kill(self.side.pid, signal.SIGTERM)

    def kernel_watcher(self):
        """The kernel moments (and today's quit) come from a process of their own, at SCHED_FIFO:
        in this one, a thread woken by the pidfd would wait for the interpreter's lock and for CPU
        behind the pollers (measured: up to ~100 ms late under TCG)."""
        quit_pid = self.side.pid if self.way == "kernel" else 0
        proc = subprocess.Popen(["chrt", "-f", "50", sys.executable, os.path.abspath(__file__), "--kernel-watch",
                                 str(self.app.pid), str(self.side.pid), str(quit_pid)],
                                stdout=subprocess.PIPE, text=True)
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError(f"the kernel watcher did not start ({proc.wait()})")
        return proc

    def exited(self, w, timeout_ms):
        """Whether the container's main process has exited (its pidfd readable)."""
        poller = select.poll()
        poller.register(w.pidfd, select.POLLIN)
        return bool(poller.poll(timeout_ms))

    def files(self):
        end = time.monotonic() + RUN_DEADLINE_S
        watches = (self.app, self.side)
        last = {}
        while time.monotonic() < end and not self.done.is_set():
            for w in watches:
                # Nothing of these changes before the main process's exit: no polling before it.
                if "exited" not in w.at:
                    if not self.exited(w, 0):
                        continue
                    w.at["exited"] = True
                if "cgroup" not in w.at and not os.path.exists(w.cgroup):
                    w.at["cgroup"] = now()
                if "bundle" not in w.at and not os.path.exists(w.bundle):
                    w.at["bundle"] = now()
                if "status_file" not in w.at:
                    # Replaced by a rename: read only when it is a new file.
                    try:
                        st = os.stat(w.status_file)
                        key = (st.st_ino, st.st_mtime_ns)
                    except OSError:
                        key = None
                    if key != last.get(w.cid) and status_file_exited(w.status_file):
                        w.at["status_file"] = now()
                        if w is self.app and self.way == "status_file":
                            self.quit_sidecar()
                        # What the signal promises: a ContainerStatus asked after it says EXITED.
                        check = threading.Thread(target=self.state_after_file, args=(w,), daemon=True)
                        check.start()
                        self.checks.append(check)
                    last[w.cid] = key
            if all(k in w.at for w in watches for k in ("cgroup", "bundle", "status_file")):
                return
            time.sleep(POLL_S)

    def state_after_file(self, w):
        st = self.cri.runtime("ContainerStatus", {"container_id": w.cid}, timeout=30).status
        w.at["after_file"] = pb.ContainerState.Name(st.state)

    def cri_poll(self, w):
        """ContainerStatus every 1 ms from the main process's exit on (a CRI record of the exit
        cannot come before it), each call made once and sent as is."""
        end = time.monotonic() + RUN_DEADLINE_S
        while not self.exited(w, 100):
            if time.monotonic() > end:
                return
        call = self.cri.channel.unary_unary(
            "/runtime.v1.RuntimeService/ContainerStatus",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=pb.ContainerStatusResponse.FromString)
        request = pb.ContainerStatusRequest(container_id=w.cid)
        while time.monotonic() < end:
            sent = now()
            st = call(request, timeout=30).status
            if st.state == pb.CONTAINER_EXITED:
                w.at["cri"], w.at["cri_sent"] = now(), sent
                w.at["shim"], w.exit_code = st.finished_at, st.exit_code
                if w is self.app and self.way == "cri":
                    self.quit_sidecar()
                return
            w.at["cri_running_sent"] = sent
            time.sleep(POLL_S)

    def go(self):
        fifo = f"{self.pod.dir}/go"
        for name in ("go", "sidecar-ready"):
            if os.path.lexists(f"{self.pod.dir}/{name}"):
                os.unlink(f"{self.pod.dir}/{name}")
        os.mkfifo(fifo)
        run = self.pod.run
        run.start_container(self.pod.sidecar, run.sandbox_cfg, attempt=self.index, native=True)
        side_id = run.containers["sidecar"]["id"]
        scenarios.wait_for(f"the sidecar of run {self.index} ready",
                           lambda: os.path.exists(f"{self.pod.dir}/sidecar-ready"), 60, step=0.01)
        run.start_container(self.pod.app, run.sandbox_cfg, attempt=self.index)
        app_id = run.containers["app"]["id"]
        self.side, self.app = Watch(self.cri, side_id, self.root), Watch(self.cri, app_id, self.root)
        watcher = self.kernel_watcher()
        threads = [threading.Thread(target=f, args=a, daemon=True) for f, a in
                   ((self.files, ()), (self.cri_poll, (self.app,)), (self.cri_poll, (self.side,)))]
        for t in threads:
            t.start()
        # Once the app has opened the FIFO (ENXIO before), it reads the line and ends.
        end = time.monotonic() + RUN_DEADLINE_S
        while True:
            try:
                fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
                break
            except OSError:
                if time.monotonic() > end:
                    raise RuntimeError(f"the app of run {self.index} never opened its FIFO")
                time.sleep(0.01)
        os.write(fd, b"go\n")
        os.close(fd)
        released = now()
        files, *cri = threads
        for t in cri:
            t.join(RUN_DEADLINE_S + 5)
        try:
            kernel = json.loads(watcher.communicate(timeout=RUN_DEADLINE_S)[0])
        except (subprocess.TimeoutExpired, ValueError) as e:
            watcher.kill()
            raise RuntimeError(f"the kernel watcher: {e}")
        self.app.at["kernel"], self.side.at["kernel"] = kernel["app"], kernel["sidecar"]
        if kernel.get("quit"):
            self.side.at["quit"] = kernel["quit"]
        # The file moments come before the CRI's but are polled apart: 5 s more at most.
        files.join(5)
        self.done.set()
        files.join()
        for check in self.checks:
            check.join(30)
        # The events of both containers may come a little after the status (2 s at most).
        end = time.monotonic() + 2
        while self.events.available is True and time.monotonic() < end and \
                not all(w.cid in self.events.stopped for w in (self.app, self.side)):
            time.sleep(0.01)
        os.close(self.app.pidfd)
        os.close(self.side.pidfd)
        out = {"run": self.index, "way": self.way, "released": released}
        for name, w in (("app", self.app), ("sidecar", self.side)):
            at = {k: v for k, v in w.at.items() if k != "exited"}
            if w.cid in self.events.stopped:
                at["event"] = self.events.stopped[w.cid]
            out[name] = {"id": w.cid, "exit_code": getattr(w, "exit_code", None), **at}
        return out


class Pod:
    """The Job-shaped pod's sandbox, made once; every run adds a sidecar and an app to it."""

    def __init__(self, cri):
        self.dir = f"{WORK}/pod"
        os.makedirs(self.dir, exist_ok=True)
        volume = [{"name": "lag", "mountPath": "/lag"}]
        self.sidecar = {"name": "sidecar", "image": "docker.io/valet/busybox:1", "restartPolicy": "Always",
                        "command": ["/bin/sh", "-c", SIDECAR], "volumeMounts": volume}
        self.app = {"name": "app", "image": "docker.io/valet/busybox:1", "command": ["/bin/sh", "-c", APP],
                    "volumeMounts": volume}
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": "lag-x1", "namespace": "default", "uid": "6c61672d-0000-4000-8000-000000000001"},
               "spec": {"restartPolicy": "Never", "volumes": [{"name": "lag", "hostPath": {"path": self.dir}}],
                        "initContainers": [self.sidecar], "containers": [self.app]}}
        self.run = kubelet.PodRun(cri, NoApi(), pod, log=lambda m: None)
        self.run.sandbox_cfg = self.run.sandbox_config()
        os.makedirs(self.run.sandbox_cfg["log_directory"], exist_ok=True)
        self.run.sandbox_id = cri.runtime("RunPodSandbox", {"config": self.run.sandbox_cfg}).pod_sandbox_id


def ms(ns):
    return ns / 1e6


def quantile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def row(label, values, signed=False):
    """median, p90, p99, max (and min) in ms, with how many of the values were below zero."""
    if not values:
        return f"  {label:<46} (none)"
    v = [ms(x) for x in values]
    text = (f"  {label:<46} n={len(v):<4} median {quantile(v, 0.5):8.1f}  p90 {quantile(v, 0.9):8.1f}  "
            f"p99 {quantile(v, 0.99):8.1f}  max {max(v):8.1f}  min {min(v):8.1f}")
    if signed:
        text += f"  before:{sum(x < 0 for x in values)} after:{sum(x > 0 for x in values)}"
    return text


def diffs(runs, a, b):
    """b - a per run where both moments were seen; a and b are (container, moment)."""
    out = []
    for r in runs:
        x, y = r[a[0]].get(a[1]), r[b[0]].get(b[1])
        if x and y:
            out.append(y - x)
    return out


def table(runs, way, events_available):
    complete = [r for r in runs if all(k in r[c] for c in ("app", "sidecar") for k in ("kernel", "cri"))]
    lines = [f"node lag way={way}: {len(runs)} runs, {len(complete)} with both exits seen by kernel and CRI "
             f"(ms; CLOCK_REALTIME in the VM)"]
    for c in ("app", "sidecar"):
        lines.append(row(f"{c}: kernel exit -> CRI EXITED", diffs(complete, (c, "kernel"), (c, "cri"))))
    for c in ("app", "sidecar"):
        lines.append(row(f"{c}: shim's FinishedAt - kernel exit", diffs(complete, (c, "kernel"), (c, "shim")), True))
        for sig in ("cgroup", "bundle", "status_file") + (("event",) if events_available else ()):
            lines.append(row(f"{c}: {sig} - CRI EXITED", diffs(complete, (c, "cri"), (c, sig)), True))
        lines.append(row(f"{c}: status_file - CRI EXITED's call sent", diffs(complete, (c, "cri_sent"),
                                                                           (c, "status_file")), True))
    lines.append(row("app kernel exit -> sidecar quit", diffs(complete, ("app", "kernel"), ("sidecar", "quit"))))
    lines.append(row("app kernel exit -> sidecar kernel exit", diffs(complete, ("app", "kernel"),
                                                                      ("sidecar", "kernel"))))
    gap = diffs(complete, ("app", "cri"), ("sidecar", "cri"))
    lines.append(row("app CRI EXITED -> sidecar CRI EXITED", gap, True))
    # The two containers' polls run apart, so their answers can straddle the records: counted
    # are the runs whose sidecar EXITED answer came before the app's (the answers' order), before
    # the app's first EXITED call was even sent, and (certain) before the sending of a call that
    # the CRI then answered with the app still RUNNING.
    first = sum(1 for r in complete if r["sidecar"]["cri"] < r["app"]["cri"])
    before_sent = sum(1 for r in complete if r["sidecar"]["cri"] < r["app"]["cri_sent"])
    certain = [r for r in complete if "cri_running_sent" in r["app"] or "after_file" in r["app"]]
    certain_n = sum(1 for r in certain if r["sidecar"]["cri"] < r["app"].get("cri_running_sent", 0))
    ev = [r for r in complete if "event" in r["app"] and "event" in r["sidecar"]]
    by_events = sum(1 for r in ev if r["sidecar"]["event"] < r["app"]["event"])
    checked = [r[c]["after_file"] for r in complete for c in ("app", "sidecar") if "after_file" in r[c]]
    if checked:
        lines.append(f"  ContainerStatus asked right after the status file showed the exit: "
                     f"{sum(s == 'CONTAINER_EXITED' for s in checked)} of {len(checked)} EXITED")
    codes = sum(1 for r in complete if r["app"].get("exit_code") == 0 and r["sidecar"].get("exit_code") == 0)
    lines.append(f"  INVERSIONS (sidecar EXITED in the CRI before the app): {first} of {len(complete)} by the "
                 f"answers' order, {before_sent} before the app's EXITED call was sent"
                 + (f", {certain_n} of {len(certain)} certain (before a call answered RUNNING for the app was sent)"
                    if certain else "")
                 + (f"; by GetContainerEvents {by_events} of {len(ev)}" if events_available else "")
                 + f"; both exited 0 in {codes}")
    if way != "kernel":
        lines.append(targets(complete, first))
    return lines


def targets(complete, inversions):
    """The issue's targets for a quit at the app's record, each met or NOT met: 200 runs or more, no
    inversion, and the app's end -> the sidecar's exit at most 1500 ms at p99 (beside it, the
    runtime's own kernel exit -> CRI EXITED of the app, which no quit at the record can beat)."""
    verdict = lambda ok: "met" if ok else "NOT met"
    ends = [ms(x) for x in diffs(complete, ("app", "kernel"), ("sidecar", "kernel"))]
    own = [ms(x) for x in diffs(complete, ("app", "kernel"), ("app", "cri"))]
    p99 = quantile(ends, 0.99) if ends else float("inf")
    floor = f", the runtime's own record of the app p99 {quantile(own, 0.99):.0f} ms" if own else ""
    return (f"  TARGETS: runs {len(complete)} (>= 200: {verdict(len(complete) >= 200)}); inversions {inversions} "
            f"(0: {verdict(inversions == 0)}); app's end -> sidecar's exit p99 {p99:.0f} ms, median "
            f"{quantile(ends, 0.5) if ends else float('nan'):.0f}, max {max(ends, default=float('nan')):.0f} "
            f"(<= 1500 at p99: {verdict(p99 <= 1500)}{floor})")


def kernel_watch(app_pid, side_pid, quit_pid):
    """`--kernel-watch <app pid> <sidecar pid> <pid to SIGTERM at the app's exit, or 0>` (run at
    SCHED_FIFO): prints `ready` once both pidfds are open, then, once both processes have exited,
    one JSON line of their moments (and the quit's)."""
    fds = {os.pidfd_open(app_pid): "app", os.pidfd_open(side_pid): "sidecar"}
    print("ready", flush=True)
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    at = {}
    end = time.monotonic() + RUN_DEADLINE_S
    while not {"app", "sidecar"} <= at.keys() and time.monotonic() < end:
        for fd, _ in poller.poll(1000):
            at[fds[fd]] = now()
            poller.unregister(fd)
            if fds[fd] == "app" and quit_pid:
                at["quit"] = now()
                os.kill(quit_pid, signal.SIGTERM)
    print(json.dumps(at), flush=True)


def import_cri():
    global grpc, kubelet, pb, scenarios
    sys.path.insert(0, HERE)
    import grpc
    import kubelet
    import scenarios
    pb = kubelet.pb


def main():
    if sys.argv[1] == "--kernel-watch":
        kernel_watch(*(int(a) for a in sys.argv[2:5]))
        return 0
    if sys.argv[1] == "--table":
        # The tables again, from a run's lag.jsonl (on the host, say).
        runs = [json.loads(line) for line in open(sys.argv[2])]
        events = any("event" in r["app"] for r in runs)
        for way in (w for w in WAYS if any(r["way"] == w for r in runs)):
            for line in table([r for r in runs if r["way"] == way], way, events):
                print(line if line.startswith("node lag") else f"node lag {line}")
        return 0
    import_cri()
    images, out, runs = sys.argv[1], sys.argv[2], int(sys.argv[3])
    # Only these ways (VALET_LAG_WAYS on the host, e.g. "kernel,cri": today's quit and one after
    # the record), else all three in turn.
    ways = tuple(w for w in sys.argv[4].split(",") if w in WAYS) if len(sys.argv) > 4 else WAYS
    if not ways:
        raise SystemExit(f"no known way in {sys.argv[4]!r}: {', '.join(WAYS)}")
    os.makedirs(WORK, exist_ok=True)
    sys.setswitchinterval(0.0002)
    t0 = time.monotonic()
    for name in ("busybox.tar", "pause.tar"):
        subprocess.run(["ctr", "-n", "k8s.io", "images", "import", f"{images}/{name}"], check=True,
                       stdout=subprocess.DEVNULL)
    cri = kubelet.Cri()
    status = scenarios.wait_for("containerd's CRI ready", lambda: scenarios.cri_ready(cri), 120, step=0.5)
    config = json.loads(status.info["config"])
    root = config["rootDir"]
    log(f"images imported in {time.monotonic() - t0:.1f}s; CRI root {root}, state {config.get('stateDir')}, "
        f"cgroup {kubelet.CGROUP_MODE}")
    events = Events(kubelet.Cri())
    pod = Pod(cri)
    log(f"sandbox {pod.run.sandbox_id[:12]} in {time.monotonic() - t0:.1f}s")
    results = {w: [] for w in ways}
    failures = 0
    t_all = time.monotonic()
    with open(f"{out}/lag.jsonl", "w") as jsonl:
        for i in range(runs * len(ways)):
            way = ways[i % len(ways)]
            try:
                r = Run(cri, pod, i, way, root, events).go()
            except Exception as e:
                failures += 1
                log(f"run {i} ({way}) failed: {' '.join(str(e).split())}")
                if failures > max(5, runs // 10):
                    break
                continue
            results[way].append(r)
            jsonl.write(json.dumps(r) + "\n")
            jsonl.flush()
            if i % 30 == 29:
                log(f"{i + 1} runs in {time.monotonic() - t_all:.0f}s")
    # The VM's shutdown would otherwise wait for the sandbox's processes.
    try:
        cri.runtime("StopPodSandbox", {"pod_sandbox_id": pod.run.sandbox_id})
        cri.runtime("RemovePodSandbox", {"pod_sandbox_id": pod.run.sandbox_id})
    except grpc.RpcError as e:
        log(f"the sandbox's teardown: {e.code().name}")
    available = events.available is True
    log(f"{sum(len(v) for v in results.values())} runs in {time.monotonic() - t_all:.0f}s, {failures} failed; "
        f"GetContainerEvents: {'followed' if available else 'not available (' + str(events.error) + ')'}")
    for way in ways:
        for line in table(results[way], way, available):
            print(line if line.startswith("node lag") else f"node lag {line}", flush=True)
    print(f"node lag done: {sum(len(v) for v in results.values())} runs, {failures} failed", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
