"""The node VM's DaemonSet runner (tests/node/daemonset_cri.py, tests/node/pod_rules.py): each of
the kubelet's and the runtime's rules it applies, against a fake host root, and its refusal of a
manifest field it does not translate."""

from __future__ import annotations

import copy
import os
import socket
import stat
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests/node"))
import daemonset_cri  # noqa: E402
import pod_rules  # noqa: E402
from pod_rules import PodWouldNotStart  # noqa: E402

MANIFEST = ROOT / "deploy/base/daemonset.yaml"


def daemonset() -> dict:
    return next(d for d in yaml.safe_load_all(MANIFEST.read_text()) if d and d.get("kind") == "DaemonSet")


def translate(ds: dict) -> dict:
    return daemonset_cri.translate(ds, "node-1", "image:1")


# hostPath types (host_path.go checkType).


def test_unset_type_checks_nothing(tmp_path):
    assert pod_rules.check_host_path("/missing", "", str(tmp_path)) is None
    assert pod_rules.check_host_path("/missing", None, str(tmp_path)) is None
    assert not (tmp_path / "missing").exists(), "the kubelet makes nothing for an unset type"


def test_directory_must_exist_and_be_one(tmp_path):
    with pytest.raises(PodWouldNotStart, match="hostPath /sys/kernel/btf doesn't exist"):
        pod_rules.check_host_path("/sys/kernel/btf", "Directory", str(tmp_path))
    (tmp_path / "f").write_text("")
    with pytest.raises(PodWouldNotStart, match="is not a directory, it's a File"):
        pod_rules.check_host_path("/f", "Directory", str(tmp_path))
    (tmp_path / "d").mkdir()
    assert pod_rules.check_host_path("/d", "Directory", str(tmp_path)) is None


def test_directory_or_create_makes_it_and_checks_what_exists(tmp_path):
    assert pod_rules.check_host_path("/a/b/c", "DirectoryOrCreate", str(tmp_path)) is None
    made = tmp_path / "a/b/c"
    assert made.is_dir() and stat.S_IMODE(made.stat().st_mode) == 0o755 & ~_umask()
    (tmp_path / "f").write_text("")
    with pytest.raises(PodWouldNotStart, match="is not a directory"):
        pod_rules.check_host_path("/f", "DirectoryOrCreate", str(tmp_path))
    # Where mkdir fails (sysfs refuses it; here a file in the way), the pod does not start.
    with pytest.raises(PodWouldNotStart, match="mkdir /f/valet"):
        pod_rules.check_host_path("/f/valet", "DirectoryOrCreate", str(tmp_path))


def test_file_and_file_or_create(tmp_path):
    with pytest.raises(PodWouldNotStart, match="doesn't exist"):
        pod_rules.check_host_path("/vmlinux", "File", str(tmp_path))
    (tmp_path / "d").mkdir()
    with pytest.raises(PodWouldNotStart, match="is not a file, it's a Directory"):
        pod_rules.check_host_path("/d", "File", str(tmp_path))
    assert pod_rules.check_host_path("/made", "FileOrCreate", str(tmp_path)) is None
    assert (tmp_path / "made").is_file()
    with pytest.raises(PodWouldNotStart, match="is not a file"):
        pod_rules.check_host_path("/d", "FileOrCreate", str(tmp_path))


def test_socket_char_and_block_devices(tmp_path):
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(tmp_path / "sock"))
        assert pod_rules.check_host_path("/sock", "Socket", str(tmp_path)) is None
        with pytest.raises(PodWouldNotStart, match="is not a character device, it's a Socket"):
            pod_rules.check_host_path("/sock", "CharDevice", str(tmp_path))
    # Followed as stat(2) follows it: a symlink to /dev/null is a character device.
    os.symlink("/dev/null", tmp_path / "null")
    assert pod_rules.check_host_path("/null", "CharDevice", str(tmp_path)) is None
    with pytest.raises(PodWouldNotStart, match="is not a block device, it's a CharDevice"):
        pod_rules.check_host_path("/null", "BlockDevice", str(tmp_path))
    with pytest.raises(PodWouldNotStart, match="is not a socket file, it's a CharDevice"):
        pod_rules.check_host_path("/null", "Socket", str(tmp_path))
    # A dangling symlink does not exist.
    os.symlink("/nowhere", tmp_path / "dangling")
    with pytest.raises(PodWouldNotStart, match="doesn't exist"):
        pod_rules.check_host_path("/dangling", "CharDevice", str(tmp_path))


def test_an_unknown_type_is_invalid(tmp_path):
    with pytest.raises(PodWouldNotStart, match="Dir is an invalid volume type"):
        pod_rules.check_host_path("/", "Dir", str(tmp_path))


# The runtime's bind source (containerd's withMounts).


def test_the_runtime_makes_a_missing_source_a_directory(tmp_path):
    assert pod_rules.runtime_source("/var/lib/x", str(tmp_path)) is None
    assert (tmp_path / "var/lib/x").is_dir()
    (tmp_path / "f").write_text("")
    with pytest.raises(PodWouldNotStart, match="failed to (mkdir|stat)"):
        pod_rules.runtime_source("/f/x", str(tmp_path))


# readOnly and recursiveReadOnly (the API server's validation, the kubelet's makeMounts).


def test_recursive_read_only():
    assert pod_rules.resolve_rro("Disabled", False, True) is False
    assert pod_rules.resolve_rro(None, True, True) is False
    assert pod_rules.resolve_rro("IfPossible", True, True) is True
    assert pod_rules.resolve_rro("IfPossible", True, False) is False, "falls back to a plain read-only mount"
    assert pod_rules.resolve_rro("Enabled", True, True) is True
    with pytest.raises(PodWouldNotStart, match="not supported by the runtime"):
        pod_rules.resolve_rro("Enabled", True, False, "host-cgroup")
    for mode in ("Enabled", "IfPossible"):
        with pytest.raises(PodWouldNotStart, match="only be specified when readOnly is true"):
            pod_rules.resolve_rro(mode, False, True)
    with pytest.raises(PodWouldNotStart, match="supported values"):
        pod_rules.resolve_rro("Always", True, True)


# Liveness (prober/worker.go).


def test_liveness_restarts_after_the_threshold_of_consecutive_failures():
    live = pod_rules.Liveness(3)
    assert [live.result(ok) for ok in (False, False, True, False, False)] == [False] * 5, "a success resets"
    assert live.result(False) is True, "the third failure in a row restarts"
    assert [live.result(False) for _ in range(2)] == [False, False], "counted again from zero after a restart"
    assert live.result(False) is True


# The manifest, translated.


def test_the_manifest_translates_with_every_field_it_uses():
    pod = translate(daemonset())
    agent, keeper = pod["container"], pod["more_containers"][0]
    assert agent["name"] == "valet-agent" and keeper["name"] == "valet-deadlines"
    assert agent["liveness"] == {"path": "/healthz", "port": 9090, "period_s": 10, "timeout_s": 2,
                                 "failure_threshold": 3}
    assert agent["readiness"]["path"] == "/readyz" and keeper["liveness"] is None
    sc = agent["security_context"]
    assert sc["capabilities"]["drop_capabilities"] == ["ALL"]
    assert "SYS_ADMIN" in sc["capabilities"]["add_capabilities"], "names without CAP_, as the kubelet passes them"
    assert sc["seccomp"] == {"profile_type": "RuntimeDefault"} and sc["apparmor"] == {"profile_type": "Unconfined"}
    assert sc["no_new_privs"] is True and sc["readonly_rootfs"] is True
    assert agent["resources"]["memory_limit_in_bytes"] == 128 << 20
    assert agent["resources"]["cpu_quota"] == 20000 and agent["resources"]["cpu_shares"] == 20
    assert agent["qos"] == "burstable"
    assert {v["name"] for v in pod["volumes"]} >= {"host-cgroup", "tracefs"}
    cgroup = next(m for m in agent["mounts"] if m["volume"] == "host-cgroup")
    assert cgroup["readonly"] is True


def test_apparmor_default_and_localhost():
    ds = daemonset()
    del ds["spec"]["template"]["metadata"]["annotations"][daemonset_cri.APPARMOR + "valet-deadlines"]
    keeper = translate(ds)["more_containers"][0]
    assert keeper["security_context"]["apparmor"] == {"profile_type": "RuntimeDefault"}
    ds["spec"]["template"]["metadata"]["annotations"][daemonset_cri.APPARMOR + "valet-agent"] = "localhost/x"
    with pytest.raises(daemonset_cri.NotTranslated, match="localhost/x"):
        translate(ds)


def _at(ds: dict, path: str):
    node = ds
    for part in path.split("."):
        node = node[int(part)] if part.isdigit() else node[part]
    return node


@pytest.mark.parametrize(
    "where, field, value",
    [
        ("spec.template.spec", "runtimeClassName", "kata"),
        ("spec.template.spec", "initContainers", []),
        ("spec.template.spec.securityContext", "sysctls", []),
        ("spec.template.spec.containers.0", "startupProbe", {}),
        ("spec.template.spec.containers.0", "lifecycle", {}),
        ("spec.template.spec.containers.1.securityContext", "procMount", "Unmasked"),
        ("spec.template.spec.containers.0.securityContext", "appArmorProfile", {"type": "Unconfined"}),
        ("spec.template.spec.containers.0.volumeMounts.0", "mountPropagation", "HostToContainer"),
        ("spec.template.spec.containers.0.volumeMounts.0", "subPath", "x"),
        ("spec.template.spec.volumes.0.hostPath", "readOnly", True),
        ("spec.template.spec.volumes.0", "emptyDir", {}),
        ("spec.template.spec.containers.0.livenessProbe", "initialDelaySeconds", 5),
        ("spec.template.spec.containers.0.resources.limits", "ephemeral-storage", "1Gi"),
        ("spec.template.spec.containers.0.env.0.valueFrom.fieldRef", "resourceVersion", "1"),
        ("spec.template.metadata.annotations", "seccomp.security.alpha.kubernetes.io/pod", "unconfined"),
    ],
)
def test_a_field_not_translated_is_refused_by_name(where, field, value):
    ds = daemonset()
    _at(ds, where)[field] = value
    with pytest.raises(daemonset_cri.NotTranslated) as e:
        translate(ds)
    assert field in str(e.value), f"the error names the field: {e.value}"


def test_values_not_translated_are_refused():
    for change in (
        lambda s: s["containers"][0]["securityContext"].update(privileged=True),
        lambda s: s["containers"][0]["livenessProbe"].update(httpGet=None, exec={"command": ["true"]}),
        lambda s: s.update(enableServiceLinks=True),
        lambda s: s["securityContext"]["seccompProfile"].update(type="Localhost"),
    ):
        ds = daemonset()
        change(ds["spec"]["template"]["spec"])
        with pytest.raises(daemonset_cri.NotTranslated):
            translate(ds)


def _node(tmp_path: Path, *, btf: bool, bpffs_dir: bool) -> str:
    """A fake node root: what the kernel and systemd make on every node, and BTF or /sys/fs/bpf
    only when asked."""
    for d in ("sys/fs/cgroup", "sys/kernel/tracing", "sys/kernel/security", "var/lib"):
        (tmp_path / d).mkdir(parents=True)
    if btf:
        (tmp_path / "sys/kernel/btf").mkdir()
        (tmp_path / "sys/kernel/btf/vmlinux").write_text("")
    if bpffs_dir:
        (tmp_path / "sys/fs/bpf").mkdir()
    return str(tmp_path)


def _start(ds: dict, root: str, rro: bool = False) -> dict:
    pod = translate(ds)
    everyone = [pod["container"]] + pod["more_containers"]
    return pod_rules.start_pod(pod["volumes"], {c["name"]: c["mounts"] for c in everyone}, root, rro)


def test_a_hostpath_check_that_fails_keeps_the_pod_from_starting(tmp_path):
    ds = daemonset()
    ds["spec"]["template"]["spec"]["volumes"].append({"name": "btf", "hostPath": {"path": "/sys/kernel/btf",
                                                                                 "type": "Directory"}})
    with pytest.raises(PodWouldNotStart, match="volume 'btf'.*/sys/kernel/btf doesn't exist"):
        _start(ds, _node(tmp_path, btf=False, bpffs_dir=True))


def _umask() -> int:
    old = os.umask(0)
    os.umask(old)
    return old


def test_the_translation_does_not_change_the_manifest():
    ds = daemonset()
    before = copy.deepcopy(ds)
    translate(ds)
    assert ds == before


def test_the_shipped_manifest_starts_on_a_node_without_btf_or_bpffs(tmp_path):
    # No /sys/kernel/btf at all, and /sys/fs/bpf the kernel's empty sysfs directory (no bpffs).
    root = _node(tmp_path, btf=False, bpffs_dir=True)
    mounts = _start(daemonset(), root)
    assert not (tmp_path / "sys/kernel/btf").exists() and not (tmp_path / "sys/fs/bpf/valet").exists(), \
        "nothing is made in the host's sysfs"
    keeper = {m["container_path"]: m for m in mounts["valet-deadlines"]}
    assert keeper["/host/sys/fs/bpf"]["readonly"], "the keeper cannot make or remove pins"
    agent = {m["container_path"]: m for m in mounts["valet-agent"]}
    assert not agent["/host/sys/fs/bpf"]["readonly"], "the agent pins its record there"
    assert agent["/host/var/lib/valet/btf"]["readonly"]
    assert (tmp_path / "var/lib/valet/btf").is_dir(), "the --kernel-btf directory, made by the kubelet"


def test_the_shipped_manifest_starts_on_a_node_with_btf_and_bpffs(tmp_path):
    _start(daemonset(), _node(tmp_path, btf=True, bpffs_dir=True), rro=True)
