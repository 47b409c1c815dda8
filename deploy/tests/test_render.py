"""(a) Every kustomization renders offline, with the objects it should have."""

from __future__ import annotations

import pytest

from conftest import COMPONENTS, Render

BASE_OBJECTS = {
    ("Namespace", "valet-system"),
    ("ServiceAccount", "valet-agent"),
    ("ClusterRole", "valet-agent"),
    ("ClusterRoleBinding", "valet-agent"),
    ("DaemonSet", "valet-agent"),
}


def kinds_names(render: Render) -> set[tuple[str, str]]:
    return {(d["kind"], d["metadata"]["name"]) for d in render.docs}


def test_components_are_found() -> None:
    assert {c.name for c in COMPONENTS} >= {"podmonitor"}


def test_every_target_renders(renders: dict[str, Render]) -> None:
    expected = {"base", "example", "base+components"} | {f"base+{c.name}" for c in COMPONENTS}
    assert set(renders) == expected
    for r in renders.values():
        assert r.docs, f"{r.name} rendered nothing"
        for d in r.docs:
            assert {"apiVersion", "kind", "metadata"} <= d.keys(), f"{r.name}: malformed {d}"


def test_base_has_exactly_the_agent_objects(renders: dict[str, Render]) -> None:
    assert kinds_names(renders["base"]) == BASE_OBJECTS


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
