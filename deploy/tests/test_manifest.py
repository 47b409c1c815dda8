"""The agent's pod spec keeps the properties its comments promise (least privilege, the
wiring between env, ports and probes). Schemas and checkov cannot see these."""

from __future__ import annotations

import pytest

from conftest import COMPONENTS, DEPLOY, Render

CAPABILITIES = {"SYS_ADMIN", "SYS_PTRACE", "KILL", "SYS_RESOURCE", "SYS_NICE"}
ENV = {
    "VALET_HOST_PROC": "/proc",
    # The host's /sys/fs/cgroup, looked at (v2, v1 or hybrid), never a fixed hierarchy root.
    "VALET_CGROUP_MOUNT": "/host/sys/fs/cgroup",
    "VALET_METRICS_ADDR": "0.0.0.0:9090",
    "VALET_LOG_FORMAT": "json",
    "RUST_LOG": "info",
    "VALET_PIN_DIR": "/host/sys/fs/bpf/valet",
    # What records of the previous format (no deadline) get: the keeper's is the same entry.
    "VALET_OLD_RECORD_TIMEOUT": "120s",
}
# hostPath -> mount path, in the base. All read-only but one. No /sys/kernel/btf: the container's
# own /sys shows the kernel's BTF, and a hostPath of it keeps the pod from starting where it is
# missing.
HOST_PATHS = {
    "/sys/fs/cgroup": "/host/sys/fs/cgroup",
    "/sys/kernel/tracing": "/sys/kernel/tracing",
    # The lockdown level, read where securityfs says it.
    "/sys/kernel/security": "/sys/kernel/security",
    # --kernel-btf's file, for a kernel without BTF of its own.
    "/var/lib/valet/btf": "/host/var/lib/valet/btf",
    # No runtime state directory: bundles are read through the runtime's own processes.
    # The one writable host path: the host's bpffs, where the agent makes valet/.
    "/sys/fs/bpf": "/host/sys/fs/bpf",
}
WRITABLE_HOST_PATHS = {"/sys/fs/bpf"}
# hostPath -> its type: each one passes the kubelet's check on a node without BTF and without
# bpffs (deploy/tests/test_node_runner.py runs the check).
HOST_PATH_TYPES = {
    "/sys/fs/cgroup": "Directory",
    "/sys/kernel/tracing": "Directory",
    "/sys/kernel/security": "Directory",
    "/var/lib/valet/btf": "DirectoryOrCreate",
    "/sys/fs/bpf": "Directory",
}
RUNTIME_STATE = ("/run/containerd", "/var/run/containerd", "/run/containers", "/var/run/crio", "/run/crio",
                 "/run/k3s", "/var/snap")
CLUSTER_SCOPED = (
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
)
AGENT_RENDERS = ["base", "before-1.30", "base+components"] + [f"base+{c.name}" for c in COMPONENTS]


def agent(render: Render) -> tuple[dict, dict]:
    ds = render.one("DaemonSet", "valet-agent")
    pod = ds["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["valet-agent", "valet-deadlines"]
    return pod, pod["containers"][0]


def deadlines(render: Render) -> dict:
    return render.one("DaemonSet", "valet-agent")["spec"]["template"]["spec"]["containers"][1]


@pytest.mark.parametrize("name", AGENT_RENDERS)
def test_the_deadline_keeper_has_less_than_the_agent(renders: dict[str, Render], name: str) -> None:
    pod, a = agent(renders[name])
    k = deadlines(renders[name])
    assert k["image"] == a["image"]
    assert k["command"] == [a["command"][0], "deadlines"]
    sc = k["securityContext"]
    assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"]["drop"] == ["ALL"]
    # SYS_ADMIN only to make its cgroup mounts read-only at start (VALET_CGROUP_READ_ONLY), given
    # up before anything else (tests/tests/privileges.rs): it runs with BPF and KILL.
    assert set(sc["capabilities"]["add"]) == {"BPF", "KILL", "SYS_ADMIN"}
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in k["env"]}
    assert env["VALET_CGROUP_READ_ONLY"] == "true"
    agent_env = {e["name"]: e.get("value", e.get("valueFrom")) for e in a["env"]}
    # The same pins, the same old records' timeout, and the same downward API: at SIGTERM both
    # decide alike whether a successor comes (the node, their pod, its DaemonSet).
    for key in ("VALET_HOST_PROC", "VALET_CGROUP_MOUNT", "VALET_CGROUP_READ_ONLY", "VALET_PIN_DIR", "VALET_OLD_RECORD_TIMEOUT", "NODE_NAME",
                "POD_NAME", "POD_NAMESPACE"):
        assert env[key] == agent_env[key], key
    assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    host_volumes = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    # Nothing writable: the pinned map is opened and changed through bpf(2), which a read-only
    # mount allows; no pin is made or removed.
    for m in k["volumeMounts"]:
        assert m.get("readOnly") is True, m
    assert {host_volumes[m["name"]] for m in k["volumeMounts"]} == {"/sys/fs/cgroup", "/sys/fs/bpf"}


def test_the_old_record_timeout_is_set_once_for_both_containers() -> None:
    """The agent and the deadline keeper give a record of the previous format the same
    deadline: one entry in the manifest, which the keeper's env takes by a YAML alias."""
    text = (DEPLOY / "base/daemonset.yaml").read_text()
    assert text.count("name: VALET_OLD_RECORD_TIMEOUT") == 1
    assert text.count("- *old-record-timeout") == 1


@pytest.mark.parametrize("name", AGENT_RENDERS)
def test_least_privilege(renders: dict[str, Render], name: str) -> None:
    pod, c = agent(renders[name])
    sc = c["securityContext"]
    assert sc["privileged"] is False
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["runAsUser"] == 0
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert set(sc["capabilities"]["add"]) == CAPABILITIES
    # The API rejects allowPrivilegeEscalation=false with "CAP_SYS_ADMIN"; keep the short form.
    assert not any(cap.startswith("CAP_") for cap in sc["capabilities"]["add"])
    assert pod["hostPID"] is True
    assert not pod.get("hostNetwork") and not pod.get("hostIPC")
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    assert "initContainers" not in pod
    for v in pod["volumes"]:
        path = v["hostPath"]["path"]
        assert path not in ("/", "/proc", "/run", "/var/run") and not path.endswith(".sock")
        assert not path.startswith(RUNTIME_STATE), f"{path}: no runtime state, and never the runtime's socket"
    host_volumes = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    for m in c["volumeMounts"]:
        if m["name"] in host_volumes and host_volumes[m["name"]] not in WRITABLE_HOST_PATHS:
            assert m.get("readOnly") is True, f"{name}: {m['mountPath']} is writable"
    writable = {host_volumes[m["name"]] for m in c["volumeMounts"] if m["name"] in host_volumes and not m.get("readOnly")}
    assert writable <= WRITABLE_HOST_PATHS, f"{name}: writable host paths {writable}"


def test_apparmor_annotation_names_the_container(renders: dict[str, Render]) -> None:
    # The API rejects a pod whose AppArmor annotation names a container it does not have.
    ds = renders["base"].one("DaemonSet", "valet-agent")
    annotations = ds["spec"]["template"]["metadata"]["annotations"]
    _, c = agent(renders["base"])
    prefix = "container.apparmor.security.beta.kubernetes.io/"
    apparmor = {k[len(prefix):]: v for k, v in annotations.items() if k.startswith(prefix)}
    assert apparmor == {c["name"]: "unconfined", "valet-deadlines": "unconfined"}
    assert "appArmorProfile" not in c["securityContext"]  # not in the 1.29 API


def test_base_host_paths(renders: dict[str, Render]) -> None:
    pod, c = agent(renders["base"])
    by_name = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"]}
    mounts = {by_name[m["name"]]: m["mountPath"] for m in c["volumeMounts"]}
    assert mounts == HOST_PATHS
    assert {v["hostPath"]["path"]: v["hostPath"].get("type", "") for v in pod["volumes"]} == HOST_PATH_TYPES


@pytest.mark.parametrize("name", AGENT_RENDERS)
def test_the_cgroup_fs_is_read_only_below_its_top_too(renders: dict[str, Render], name: str) -> None:
    """readOnly makes only the top mount read-only; recursiveReadOnly the v1 controllers' and
    hybrid's unified/ below it, where the runtime can (IfPossible: Enabled keeps the pod from
    starting on runtimes that cannot). Not before 1.30, whose API has no such field."""
    pod, _ = agent(renders[name])
    host_volumes = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"]}
    for c in pod["containers"]:
        for m in c["volumeMounts"]:
            if host_volumes[m["name"]] == "/sys/fs/cgroup":
                want = None if name == "before-1.30" else "IfPossible"
                assert m.get("readOnly") is True and m.get("recursiveReadOnly") == want, (name, c["name"], m)


def test_scheduling(renders: dict[str, Render]) -> None:
    ds = renders["base"].one("DaemonSet", "valet-agent")
    pod, _ = agent(renders["base"])
    assert pod["tolerations"] == [{"operator": "Exists"}]
    assert pod["priorityClassName"] == "system-node-critical"
    assert pod["terminationGracePeriodSeconds"] == 30
    assert pod["automountServiceAccountToken"] is True
    assert ds["spec"]["updateStrategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": "10%"},
    }
    selector = ds["spec"]["selector"]["matchLabels"]
    assert selector.items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    assert ds["metadata"]["labels"]["app.kubernetes.io/name"] == "valet"


def image_architectures() -> list[str]:
    """The architectures `cargo xtask image` puts in the image index (xtask/src/image.rs)."""
    import re
    from pathlib import Path

    source = (Path(__file__).resolve().parents[2] / "xtask/src/image.rs").read_text()
    found = re.search(r"pub(?:\(crate\))? const ARCHITECTURES: \[&str; \d+\] = \[([^\]]*)\];", source)
    assert found, "xtask/src/image.rs names no ARCHITECTURES"
    return re.findall(r'"([^"]+)"', found.group(1))


@pytest.mark.parametrize("name", AGENT_RENDERS)
def test_runs_only_where_the_image_runs(renders: dict[str, Render], name: str) -> None:
    pod, _ = agent(renders[name])
    assert pod.get("nodeSelector") == {"kubernetes.io/os": "linux"}
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    # Terms are ORed: every one of them must hold the architecture requirement.
    assert terms
    for term in terms:
        arch = [e for e in term["matchExpressions"] if e["key"] == "kubernetes.io/arch"]
        assert arch == [{"key": "kubernetes.io/arch", "operator": "In", "values": image_architectures()}]


def test_env_ports_and_probes(renders: dict[str, Render]) -> None:
    _, c = agent(renders["base"])
    assert c["image"] == "ghcr.io/valet-dev/valet-agent:0.1.0"
    assert c["command"] == ["/usr/local/bin/valet-agent"]
    env = {e["name"]: e for e in c["env"]}
    assert env["NODE_NAME"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert {k: env[k]["value"] for k in ENV} == ENV
    assert c["ports"] == [{"name": "metrics", "containerPort": 9090, "protocol": "TCP"}]
    port = ENV["VALET_METRICS_ADDR"].rsplit(":", 1)[1]
    assert str(c["ports"][0]["containerPort"]) == port
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    res = c["resources"]
    assert set(res) == {"requests", "limits"}
    assert set(res["requests"]) == set(res["limits"]) == {"cpu", "memory"}


def test_namespace_admits_the_agent(renders: dict[str, Render]) -> None:
    ns = renders["base"].one("Namespace", "valet-system")
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    for d in renders["base"].docs:
        if d["kind"] not in CLUSTER_SCOPED:
            assert d["metadata"]["namespace"] == "valet-system", d["kind"]


def test_image_and_dockerfile_agree(renders: dict[str, Render]) -> None:
    from pathlib import Path

    dockerfile = (Path(__file__).resolve().parents[2] / "Dockerfile").read_text()
    _, c = agent(renders["base"])
    stages = [line.split()[-3 if " AS " in line else -1] for line in dockerfile.splitlines() if line.startswith("FROM ")]
    assert stages[0] == "rust:${RUST_VERSION}-bookworm"
    assert stages[-1].startswith("gcr.io/distroless/cc-debian12")
    assert f'ENTRYPOINT ["{c["command"][0]}"]' in dockerfile
    assert "COPY --from=build /out/valet-agent /usr/local/bin/valet-agent" in dockerfile
    # The BPF toolchain: rust-src, and bpf-linker built against the LLVM of that rustc.
    assert "rustup component add rust-src" in dockerfile
    assert "--features llvm-22" in dockerfile and "llvm-22-dev" in dockerfile
