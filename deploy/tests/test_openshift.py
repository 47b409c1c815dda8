"""(e) components/openshift: the SecurityContextConstraints allow exactly what the DaemonSet
uses, and only the agent's ServiceAccount may use them.

Every allowance of the SCC is derived here from the rendered DaemonSet (its pod spec, each
container's securityContext, its volumes) and compared both ways: a capability, volume type or
host namespace the DaemonSet stops using must leave the SCC too, and one it starts using must be
added. The checker is also fed SCCs that grant more (privileged, a host namespace, another
capability or volume type, any uid, an SELinux type other than spc_t) and must refuse each.
"""

from __future__ import annotations

import copy

import pytest

from conftest import Render

RENDER = "base+openshift"
SCC = "valet-agent"
AGENT_SA = {"kind": "ServiceAccount", "name": "valet-agent", "namespace": "valet-system"}
# What the API server mounts in every pod that uses its ServiceAccount token.
TOKEN_VOLUME = "projected"


def daemonset_pod(render: Render) -> dict:
    return render.one("DaemonSet", "valet-agent")["spec"]["template"]


def expected_scc(pod_template: dict) -> dict:
    """What an SCC must allow for this pod template, no more: the fields it is compared on."""
    spec = pod_template["spec"]
    containers = spec["containers"] + spec.get("initContainers", [])
    contexts = [c.get("securityContext", {}) for c in containers]
    volume_types = {next(k for k in v if k != "name") for v in spec.get("volumes", [])}
    if spec.get("automountServiceAccountToken", True):
        volume_types.add(TOKEN_VOLUME)
    uids = {sc.get("runAsUser") for sc in contexts}
    assert len(uids) == 1 and None not in uids, f"every container names its uid: {uids}"
    seccomp = {(sc.get("seccompProfile") or spec.get("securityContext", {}).get("seccompProfile", {})).get("type")
               for sc in contexts}
    assert seccomp == {"RuntimeDefault"}, seccomp
    return {
        "allowHostPID": bool(spec.get("hostPID")),
        "allowHostNetwork": bool(spec.get("hostNetwork")),
        "allowHostIPC": bool(spec.get("hostIPC")),
        "allowHostPorts": any("hostPort" in p for c in containers for p in c.get("ports", [])),
        "allowPrivilegedContainer": any(sc.get("privileged") for sc in contexts),
        "allowPrivilegeEscalation": any(sc.get("allowPrivilegeEscalation", True) for sc in contexts),
        "allowedCapabilities": sorted({cap for sc in contexts for cap in sc.get("capabilities", {}).get("add", [])}),
        "requiredDropCapabilities": ["ALL"] if all(sc.get("capabilities", {}).get("drop") == ["ALL"] for sc in contexts)
        else [],
        "allowHostDirVolumePlugin": "hostPath" in volume_types,
        "volumes": sorted(volume_types),
        "readOnlyRootFilesystem": all(sc.get("readOnlyRootFilesystem") for sc in contexts),
        "runAsUser": {"type": "MustRunAs", "uid": uids.pop()},
        "seccompProfiles": ["runtime/default"],
    }


def scc_violations(scc: dict, pod_template: dict) -> list[str]:
    """Everything in `scc` that differs from what the pod template uses, as messages."""
    out = []
    want = expected_scc(pod_template)
    for key, value in want.items():
        got = scc.get(key)
        if isinstance(value, list):
            got = sorted(got or [])
        if got != value:
            out.append(f"{key}: {got!r}, the DaemonSet uses {value!r}")
    if scc.get("defaultAddCapabilities"):
        out.append(f"defaultAddCapabilities: {scc['defaultAddCapabilities']} (capabilities nobody asked for)")
    if scc.get("defaultAllowPrivilegeEscalation") is not False:
        out.append("defaultAllowPrivilegeEscalation is not false")
    selinux = scc.get("seLinuxContext", {})
    if selinux.get("type") != "MustRunAs" or selinux.get("seLinuxOptions", {}).get("type") != "spc_t":
        out.append(f"seLinuxContext {selinux}: MustRunAs spc_t (docs/openshift.md)")
    if scc.get("users") or scc.get("groups"):
        out.append(f"users {scc.get('users')} / groups {scc.get('groups')}: access is through RBAC only")
    if scc.get("allowedUnsafeSysctls") or scc.get("forbiddenSysctls") != ["*"]:
        out.append("sysctls: none may be set")
    if scc.get("allowedFlexVolumes"):
        out.append("allowedFlexVolumes")
    return out


def test_the_component_renders_the_scc_and_its_rbac(renders: dict[str, Render]) -> None:
    r = renders[RENDER]
    scc = r.one("SecurityContextConstraints", SCC)
    assert "namespace" not in scc["metadata"], "SCCs are cluster-scoped"
    assert r.one("Role", "valet-agent-scc")["metadata"]["namespace"] == "valet-system"
    assert r.one("RoleBinding", "valet-agent-scc")["metadata"]["namespace"] == "valet-system"
    # Only here: the other renders have no SCC (nor anything OpenShift-only).
    for name, other in renders.items():
        if name not in (RENDER, "base+components"):
            assert not other.of_kind("SecurityContextConstraints"), name


def test_scc_allows_exactly_what_the_daemonset_uses(renders: dict[str, Render]) -> None:
    r = renders[RENDER]
    scc = r.one("SecurityContextConstraints", SCC)
    problems = scc_violations(scc, daemonset_pod(r))
    assert not problems, "\n".join(problems)
    # And the DaemonSet is the base's, unchanged but for the annotation that names the SCC.
    base = copy.deepcopy(daemonset_pod(renders["base"]))
    ours = copy.deepcopy(daemonset_pod(r))
    assert ours["metadata"]["annotations"].pop("openshift.io/required-scc") == SCC
    assert ours == base


def test_only_the_agent_may_use_the_scc(renders: dict[str, Render]) -> None:
    r = renders[RENDER]
    role = r.one("Role", "valet-agent-scc")
    assert role["rules"] == [{"apiGroups": ["security.openshift.io"], "resources": ["securitycontextconstraints"],
                              "resourceNames": [SCC], "verbs": ["use"]}]
    binding = r.one("RoleBinding", "valet-agent-scc")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "valet-agent-scc"}
    assert binding["subjects"] == [AGENT_SA]
    # Nothing else in the render mentions SCCs (no ClusterRole `use` of another one).
    for d in r.docs:
        if d["kind"] in ("Role", "ClusterRole") and d["metadata"]["name"] != "valet-agent-scc":
            for rule in d.get("rules", []):
                assert "securitycontextconstraints" not in rule.get("resources", []), d["metadata"]["name"]


def _grant(field: str, value) -> tuple[str, object]:
    return field, value


@pytest.mark.parametrize(
    "field,value",
    [
        _grant("allowPrivilegedContainer", True),
        _grant("allowHostNetwork", True),
        _grant("allowHostIPC", True),
        _grant("allowHostPorts", True),
        _grant("allowHostPID", False),
        _grant("allowPrivilegeEscalation", True),
        _grant("defaultAllowPrivilegeEscalation", True),
        _grant("allowedCapabilities", ["SYS_ADMIN", "SYS_PTRACE", "KILL", "SYS_RESOURCE", "SYS_NICE", "BPF", "NET_ADMIN"]),
        _grant("allowedCapabilities", ["*"]),
        _grant("defaultAddCapabilities", ["NET_RAW"]),
        _grant("requiredDropCapabilities", []),
        _grant("volumes", ["hostPath", "projected", "secret"]),
        _grant("volumes", ["*"]),
        _grant("readOnlyRootFilesystem", False),
        _grant("runAsUser", {"type": "RunAsAny"}),
        _grant("seLinuxContext", {"type": "RunAsAny"}),
        _grant("seLinuxContext", {"type": "MustRunAs", "seLinuxOptions": {"type": "unconfined_t"}}),
        _grant("seccompProfiles", ["*"]),
        _grant("users", ["system:serviceaccount:default:default"]),
        _grant("groups", ["system:authenticated"]),
        _grant("allowedUnsafeSysctls", ["*"]),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_checker_rejects_an_scc_that_grants_more(renders: dict[str, Render], field: str, value) -> None:
    r = renders[RENDER]
    scc = copy.deepcopy(r.one("SecurityContextConstraints", SCC))
    scc[field] = value
    assert scc_violations(scc, daemonset_pod(r))


def test_checker_follows_the_daemonset(renders: dict[str, Render]) -> None:
    """A capability the DaemonSet stops using must leave the SCC (the comparison is both ways)."""
    r = renders[RENDER]
    scc = r.one("SecurityContextConstraints", SCC)
    pod = copy.deepcopy(daemonset_pod(r))
    pod["spec"]["containers"][0]["securityContext"]["capabilities"]["add"].remove("SYS_RESOURCE")
    assert any(p.startswith("allowedCapabilities") for p in scc_violations(scc, pod))
    pod = copy.deepcopy(daemonset_pod(r))
    pod["spec"]["hostPID"] = False
    assert any(p.startswith("allowHostPID") for p in scc_violations(scc, pod))
