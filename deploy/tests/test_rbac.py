"""(c) RBAC grants exactly what the agent uses.

Fails if any Role or ClusterRole in any render grants pods/exec, pods/attach,
pods/portforward, secrets, a `*` anywhere, a nonResourceURL, an aggregation, or any
(apiGroup, resource, verb) outside ALLOWED; or if a binding reaches a role that is not
ours or a subject that is not the agent.
"""

from __future__ import annotations

import pytest

from conftest import Render

# (apiGroup, resource) -> verbs. Everything valet calls, nothing else.
ALLOWED: dict[tuple[str, str], set[str]] = {
    ("", "pods"): {"get", "list", "watch"},
    ("", "pods/status"): {"get", "patch"},
    ("", "events"): {"create", "patch"},
    ("events.k8s.io", "events"): {"create", "patch"},
    ("", "nodes"): {"get"},
    # The RuntimeClasses' handlers (a sandbox known by its handler, not only its name): listed
    # at start and every 30 s (agent/src/api/runtime_classes.rs); no get, no watch.
    ("node.k8s.io", "runtimeclasses"): {"list"},
}
# role.yaml: get of the agent's own DaemonSet, by name only, in its namespace.
OWN_DAEMONSET = (("apps", "daemonsets"), {"get"}, ["valet-agent"])
# components/openshift: `use` of the agent's own SecurityContextConstraints, by name only.
SCC_USE = (("security.openshift.io", "securitycontextconstraints"), {"use"}, ["valet-agent"])
FORBIDDEN_RESOURCES = {"pods/exec", "pods/attach", "pods/portforward", "secrets"}
ROLE_KINDS = {"Role", "ClusterRole"}
BINDING_KINDS = {"RoleBinding", "ClusterRoleBinding"}
AGENT_SA = {"kind": "ServiceAccount", "name": "valet-agent", "namespace": "valet-system"}


def rbac_violations(role: dict) -> list[str]:
    """Everything wrong with one Role/ClusterRole, as messages (empty: acceptable)."""
    name = f"{role['kind']}/{role['metadata']['name']}"
    out = []
    if "aggregationRule" in role:
        out.append(f"{name}: aggregationRule (grants whatever other roles match)")
    for i, rule in enumerate(role.get("rules") or []):
        where = f"{name} rule {i}"
        groups = rule.get("apiGroups") or []
        resources = rule.get("resources") or []
        verbs = rule.get("verbs") or []
        if rule.get("nonResourceURLs"):
            out.append(f"{where}: nonResourceURLs {rule['nonResourceURLs']}")
        for field, values in (("apiGroups", groups), ("resources", resources), ("verbs", verbs)):
            if any("*" in v for v in values):
                out.append(f"{where}: wildcard in {field}: {values}")
        for res in resources:
            base = res.split("/")[0]
            if res in FORBIDDEN_RESOURCES or base == "secrets":
                out.append(f"{where}: forbidden resource {res!r}")
        ds_key, ds_verbs, ds_names = OWN_DAEMONSET
        if [(g, r) for g in groups for r in resources] == [ds_key]:
            if set(verbs) != ds_verbs or rule.get("resourceNames") != ds_names or role["kind"] != "Role":
                out.append(f"{where}: DaemonSets: only a Role's `get` of {ds_names}, by resourceNames")
            continue
        scc_key, scc_verbs, scc_names = SCC_USE
        if [(g, r) for g in groups for r in resources] == [scc_key]:
            if set(verbs) != scc_verbs or rule.get("resourceNames") != scc_names:
                out.append(f"{where}: SCCs: only `use` of {scc_names}, by resourceNames")
            continue
        for g in groups:
            for res in resources:
                for v in verbs:
                    if v not in ALLOWED.get((g, res), set()):
                        out.append(f"{where}: not allowed: {v} {g or 'core'}/{res}")
    return out


def grants(role: dict) -> dict[tuple[str, str], set[str]]:
    out: dict[tuple[str, str], set[str]] = {}
    for rule in role.get("rules") or []:
        for g in rule.get("apiGroups") or []:
            for res in rule.get("resources") or []:
                out.setdefault((g, res), set()).update(rule.get("verbs") or [])
    return out


def roles(renders: dict[str, Render]) -> list[tuple[str, dict]]:
    return [(r.name, d) for r in renders.values() for d in r.docs if d["kind"] in ROLE_KINDS]


def test_no_role_grants_more_than_allowed(renders: dict[str, Render]) -> None:
    found = roles(renders)
    assert found, "no Role/ClusterRole rendered"
    problems = [f"{render}: {p}" for render, role in found for p in rbac_violations(role)]
    assert not problems, "\n".join(problems)


def test_agent_role_grants_exactly_what_it_needs(renders: dict[str, Render]) -> None:
    role = renders["base"].one("ClusterRole", "valet-agent")
    assert grants(role) == ALLOWED


def test_agent_namespace_role_reads_only_its_own_daemonset(renders: dict[str, Render]) -> None:
    role = renders["base"].one("Role", "valet-agent")
    assert role["metadata"]["namespace"] == "valet-system"
    assert role["rules"] == [
        {"apiGroups": ["apps"], "resources": ["daemonsets"], "resourceNames": ["valet-agent"], "verbs": ["get"]}
    ]
    ds = renders["base"].one("DaemonSet", "valet-agent")
    assert ds["metadata"]["namespace"] == role["metadata"]["namespace"]


def test_only_the_agent_role_exists(renders: dict[str, Render]) -> None:
    names = {(render, d["kind"], d["metadata"]["name"]) for render, d in roles(renders)}
    assert {(k, n) for _, k, n in names} == {
        ("ClusterRole", "valet-agent"), ("Role", "valet-agent"), ("Role", "valet-agent-scc")
    }
    # The SCC's Role only where the OpenShift component is.
    assert {render for render, k, n in names if n == "valet-agent-scc"} == {"base+openshift", "base+components"}


def test_bindings_give_our_role_to_the_agent_only(renders: dict[str, Render]) -> None:
    for r in renders.values():
        ours = {(d["kind"], d["metadata"]["name"]) for d in r.docs if d["kind"] in ROLE_KINDS}
        for b in (d for d in r.docs if d["kind"] in BINDING_KINDS):
            ref = b["roleRef"]
            # A binding to a built-in role (cluster-admin, edit, ...) would bypass the checks
            # above: only roles rendered here may be bound.
            assert (ref["kind"], ref["name"]) in ours, f"{r.name}: binds {ref}"
            assert b["subjects"] == [AGENT_SA], f"{r.name}: subjects {b['subjects']}"
    ds = renders["base"].one("DaemonSet", "valet-agent")
    assert ds["spec"]["template"]["spec"]["serviceAccountName"] == AGENT_SA["name"]
    sa = renders["base"].one("ServiceAccount", "valet-agent")
    assert sa["metadata"]["namespace"] == AGENT_SA["namespace"]


def _role(*rules: dict) -> dict:
    return {"kind": "ClusterRole", "metadata": {"name": "t"}, "rules": list(rules)}


@pytest.mark.parametrize(
    "rule",
    [
        {"apiGroups": [""], "resources": ["pods/exec"], "verbs": ["create"]},
        {"apiGroups": [""], "resources": ["pods/attach"], "verbs": ["get"]},
        {"apiGroups": [""], "resources": ["pods/portforward"], "verbs": ["create"]},
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"]},
        {"apiGroups": ["*"], "resources": ["pods"], "verbs": ["get"]},
        {"apiGroups": [""], "resources": ["*"], "verbs": ["get"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["*"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["delete"]},
        {"apiGroups": [""], "resources": ["pods/status"], "verbs": ["update"]},
        {"apiGroups": [""], "resources": ["pods/ephemeralcontainers"], "verbs": ["patch"]},
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["list"]},
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["patch"]},
        {"apiGroups": ["apps"], "resources": ["daemonsets"], "verbs": ["get"]},
        {"apiGroups": ["apps"], "resources": ["daemonsets"], "resourceNames": ["valet-agent"], "verbs": ["get", "update"]},
        {"apiGroups": ["apps"], "resources": ["daemonsets"], "resourceNames": ["other"], "verbs": ["get"]},
        {"apiGroups": ["apps"], "resources": ["pods"], "verbs": ["get"]},
        {"apiGroups": ["events.k8s.io"], "resources": ["events"], "verbs": ["delete"]},
        {"nonResourceURLs": ["/metrics"], "verbs": ["get"]},
        {"apiGroups": ["security.openshift.io"], "resources": ["securitycontextconstraints"], "verbs": ["use"]},
        {"apiGroups": ["security.openshift.io"], "resources": ["securitycontextconstraints"],
         "resourceNames": ["privileged"], "verbs": ["use"]},
        {"apiGroups": ["security.openshift.io"], "resources": ["securitycontextconstraints"],
         "resourceNames": ["valet-agent"], "verbs": ["use", "update"]},
    ],
    ids=lambda rule: "-".join(rule.get("resources") or rule.get("nonResourceURLs")) + ":"
    + ",".join(rule["verbs"]),
)
def test_checker_rejects(rule: dict) -> None:
    assert rbac_violations(_role(rule))


def test_checker_rejects_aggregation() -> None:
    role = _role()
    role["aggregationRule"] = {"clusterRoleSelectors": [{"matchLabels": {"x": "y"}}]}
    assert rbac_violations(role)


def test_checker_accepts_the_allowed_set() -> None:
    rules = [
        {"apiGroups": [g], "resources": [r], "verbs": sorted(v)} for (g, r), v in ALLOWED.items()
    ]
    assert rbac_violations(_role(*rules)) == []
