"""(a) Every kustomization renders offline, with the objects it should have."""

from __future__ import annotations

import copy

import pytest

from conftest import COMPONENTS, Render

AGENT_OBJECTS = {
    ("Namespace", "valet-system"),
    ("ServiceAccount", "valet-agent"),
    ("ClusterRole", "valet-agent"),
    ("ClusterRoleBinding", "valet-agent"),
    ("Role", "valet-agent"),
    ("RoleBinding", "valet-agent"),
    ("DaemonSet", "valet-agent"),
}
POLICY_OBJECTS = {
    ("ValidatingAdmissionPolicy", "valet-agent-node-scoped-writes"),
    ("ValidatingAdmissionPolicyBinding", "valet-agent-node-scoped-writes"),
}
BASE_OBJECTS = AGENT_OBJECTS | POLICY_OBJECTS


def kinds_names(render: Render) -> set[tuple[str, str]]:
    return {(d["kind"], d["metadata"]["name"]) for d in render.docs}


def test_components_are_found() -> None:
    assert {c.name for c in COMPONENTS} >= {"podmonitor", "openshift"}


def test_every_target_renders(renders: dict[str, Render]) -> None:
    expected = {"base", "before-1.30", "example", "base+components"} | {f"base+{c.name}" for c in COMPONENTS}
    assert set(renders) == expected
    for r in renders.values():
        assert r.docs, f"{r.name} rendered nothing"
        for d in r.docs:
            assert {"apiVersion", "kind", "metadata"} <= d.keys(), f"{r.name}: malformed {d}"


def test_base_has_exactly_the_agent_objects(renders: dict[str, Render]) -> None:
    assert kinds_names(renders["base"]) == BASE_OBJECTS


def test_before_130_is_the_agent_without_the_policy(renders: dict[str, Render]) -> None:
    assert kinds_names(renders["before-1.30"]) == AGENT_OBJECTS
    before = {(d["kind"], d["metadata"]["name"]): d for d in renders["before-1.30"].docs}
    base = {(d["kind"], d["metadata"]["name"]): d for d in renders["base"].docs}
    for key, doc in before.items():
        want = copy.deepcopy(base[key])
        if key == ("DaemonSet", "valet-agent"):
            # Without recursiveReadOnly, a field the API has from 1.30 only.
            for c in want["spec"]["template"]["spec"]["containers"]:
                for m in c["volumeMounts"]:
                    m.pop("recursiveReadOnly", None)
            assert want != base[key], "the base's DaemonSet has recursiveReadOnly"
        assert want == doc, f"{key} differs between deploy/ and deploy/before-1.30"


def test_cluster_scoped_policy_has_no_namespace(renders: dict[str, Render]) -> None:
    for kind, name in POLICY_OBJECTS:
        assert "namespace" not in renders["base"].one(kind, name)["metadata"], kind


@pytest.mark.parametrize("component", [c.name for c in COMPONENTS])
def test_component_only_adds_or_patches(renders: dict[str, Render], component: str) -> None:
    objects = kinds_names(renders[f"base+{component}"])
    assert objects >= BASE_OBJECTS


def test_podmonitor_component(renders: dict[str, Render]) -> None:
    r = renders["base+podmonitor"]
    assert kinds_names(r) == BASE_OBJECTS | {("PodMonitor", "valet-agent")}


def test_example_is_an_opted_in_job(renders: dict[str, Render]) -> None:
    r = renders["example"]
    assert kinds_names(r) == {("Namespace", "valet-example"), ("Job", "valet-example")}
    pod = r.one("Job", "valet-example")["spec"]["template"]
    labels, annotations = pod["metadata"]["labels"], pod["metadata"]["annotations"]
    assert labels["valet.dev/enabled"] == "true"
    assert labels["sidecar.istio.io/inject"] == "true"
    assert annotations["valet.dev/hold-app"] == "true"
    assert pod["spec"]["restartPolicy"] == "Never"
    assert {"conditionType": "valet.dev/ProxyReady"} in pod["spec"]["readinessGates"]
    assert pod["spec"]["containers"][0]["command"][0] == "curl"
