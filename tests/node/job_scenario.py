#!/usr/bin/env python3
"""End-to-end on the real node (inside the VM): a Job-shaped pod (an app and an Istio stand-in proxy,
each from an OCI image imported into containerd) run through the CRI by the kubelet stand-in, the
fake API server mirroring it, and the host-built valet-agent running as root on the node.

Passes when the proxy received `POST /quitquitquit` after the app exited and then exited itself.
Prints how long after the app's exit the quit arrived, and what containerd did with the app's
bundle and cgroup meanwhile.

    job_scenario.py <repo root as seen in the VM> <images dir>
"""
import glob
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kubelet  # noqa: E402

NODE = "valet-node"
WORK = "/run/valet"


def log(msg):
    print(f"node [{time.monotonic():9.3f}] {msg}", flush=True)


def wait_http(url, deadline_s, proc):
    end = time.monotonic() + deadline_s
    while time.monotonic() < end and proc.poll() is None:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return True
        except Exception:
            pass
        time.sleep(0.2)
    return False


def real_to_mono_ns(real_ns):
    return real_ns - (time.time_ns() - time.monotonic_ns())


class Watcher(threading.Thread):
    """Notes when an exited container's cgroup and bundle directory disappear (5 ms polling)."""

    def __init__(self, cid):
        super().__init__(daemon=True)
        self.cid = cid
        self.gone = {}
        self.paths = {}
        self.stop = False

    def run(self):
        bundle = f"/run/containerd/io.containerd.runtime.v2.task/k8s.io/{self.cid}"
        cgroup = None
        while not self.stop and len(self.gone) < 2:
            if cgroup is None:
                found = glob.glob(f"/sys/fs/cgroup/kubepods.slice/*/*/cri-containerd-{self.cid}.scope")
                cgroup = found[0] if found else None
                if cgroup:
                    self.paths["cgroup"] = cgroup
            for what, path in (("cgroup", cgroup), ("bundle", bundle)):
                if path and what not in self.gone and not os.path.exists(path):
                    self.gone[what] = time.time_ns()
            time.sleep(0.005)


def main():
    repo, images = sys.argv[1], sys.argv[2]
    release = os.path.join(repo, "target/release")
    os.makedirs(f"{WORK}/events", exist_ok=True)
    t0 = time.monotonic()
    for tar in sorted(glob.glob(f"{images}/*.tar")):
        subprocess.run(["ctr", "-n", "k8s.io", "images", "import", tar], check=True, stdout=subprocess.DEVNULL)
    log(f"images imported in {time.monotonic() - t0:.1f}s")

    api_proc = subprocess.Popen([f"{release}/valet-fake-apiserver", f"{WORK}/kubeconfig"], stdout=subprocess.PIPE, text=True)
    url = api_proc.stdout.readline().strip()
    api = kubelet.Api(url)
    agent_log = open(f"{WORK}/agent.log", "w")
    t0 = time.monotonic()
    agent = subprocess.Popen(
        [f"{release}/valet-agent", "--node-name", NODE, "--metrics-addr", "127.0.0.1:9090"],
        env={**os.environ, "KUBECONFIG": f"{WORK}/kubeconfig", "RUST_LOG": "info"},
        stdout=agent_log, stderr=subprocess.STDOUT,
    )
    ok = False
    try:
        if not wait_http("http://127.0.0.1:9090/readyz", 180, agent):
            log(f"FAIL: the agent never became ready (exit status {agent.poll()})")
            return False
        log(f"agent ready in {time.monotonic() - t0:.1f}s")
        pod = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "job-1-abcde", "namespace": "default",
                         "labels": {"valet.dev/enabled": "true", "job-name": "job-1"}},
            "spec": {
                "nodeName": NODE, "restartPolicy": "Never",
                "volumes": [{"name": "events", "hostPath": {"path": f"{WORK}/events"}}],
                "containers": [
                    # The app does its "work" once the proxy is ready (under TCG a container takes
                    # seconds to start): it waits for the driver's go file, then exits 0.
                    {"name": "app", "image": "docker.io/valet/busybox:1",
                     "command": ["/bin/sh", "-c", "while [ ! -e /events/go ]; do sleep 1; done; cat /proc/uptime > /events/app-exit; exit 0"],
                     "volumeMounts": [{"name": "events", "mountPath": "/events"}]},
                    {"name": "istio-proxy", "image": "docker.io/valet/standin:1",
                     "command": ["/valet-standin-proxy", "--kind", "istio", "--events", "/events/proxy.log"],
                     "readinessProbe": {"httpGet": {"port": 15021, "path": "/healthz/ready"}, "periodSeconds": 1},
                     "volumeMounts": [{"name": "events", "mountPath": "/events"}]},
                ],
            },
        }
        created = api.create_pod(pod)
        run = kubelet.PodRun(kubelet.Cri(), api, created, log=log)
        run.start()
        watcher = Watcher(run.containers["app"]["id"])
        watcher.start()
        end = time.monotonic() + 120
        while not run.containers["istio-proxy"]["ready"] and time.monotonic() < end:
            run.sync()
            time.sleep(kubelet.RELIST)
        log(f"proxy ready: {run.containers['istio-proxy']['ready']}; the app may finish")
        open(f"{WORK}/events/go", "w").close()
        done = run.run_until_done(120)
        watcher.stop = True
        app, proxy = run.containers["app"]["status"], run.containers["istio-proxy"]["status"]
        events = []
        if os.path.exists(f"{WORK}/events/proxy.log"):
            events = [line.split() for line in open(f"{WORK}/events/proxy.log") if line.strip()]
        quits = [int(e[0]) for e in events if len(e) >= 3 and e[1] == "POST" and e[2] == "/quitquitquit"]
        if not done:
            log("FAIL: the pod's containers did not all exit within 120 s (no quit?)")
        elif app.exit_code != 0:
            log(f"FAIL: the app exited {app.exit_code}")
        elif not quits:
            log("FAIL: the proxy exited without a POST /quitquitquit")
        else:
            # The app's last act: /proc/uptime (10 ms resolution; CLOCK_BOOTTIME, which is
            # CLOCK_MONOTONIC in a VM that never suspends), the clock of the proxy's events.
            exit_mono = int(float(open(f"{WORK}/events/app-exit").read().split()[0]) * 1e9)
            delay_ms = (quits[0] - exit_mono) / 1e6
            finished_mono = real_to_mono_ns(app.finished_at)
            log(f"quit arrived {delay_ms:.0f} ms after the app's exit (±10 ms); the proxy exited "
                f"{(real_to_mono_ns(proxy.finished_at) - exit_mono) / 1e6:.0f} ms after the app (exit {proxy.exit_code})")
            log(f"containerd's finishedAt for the app is {(finished_mono - exit_mono) / 1e6:.0f} ms after its exit")
            for what in ("cgroup", "bundle"):
                if what in watcher.gone:
                    gone = real_to_mono_ns(watcher.gone[what])
                    log(f"containerd removed the app's {what} {(gone - exit_mono) / 1e6:.0f} ms after its exit")
                elif what in watcher.paths or what == "bundle":
                    log(f"the app's {what} was still there when the pod ended")
                else:
                    log(f"the app's {what} was never seen")
            ok = delay_ms >= -10
            if not ok:
                log("FAIL: the quit arrived before the app's exit")
        run.teardown()
        return ok
    finally:
        agent.send_signal(signal.SIGTERM)
        try:
            agent.wait(30)
        except subprocess.TimeoutExpired:
            agent.kill()
        api_proc.kill()
        if not ok:
            agent_log.flush()
            print("--- agent log ---")
            print(open(f"{WORK}/agent.log").read()[-6000:])


if __name__ == "__main__":
    passed = main()
    print(f"node scenario job_pod_proxy_quits_when_the_app_exits: {'ok' if passed else 'FAILED'}", flush=True)
    sys.exit(0 if passed else 1)
