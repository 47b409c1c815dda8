"""(b) Every rendered object validates against the Kubernetes OpenAPI schemas (strict: unknown
fields are errors) of every release from 1.29 to the newest kubernetes-validate ships, except
the node-scoped-writes policy objects (admissionregistration.k8s.io/v1, GA in 1.30): they are
validated from 1.30 on, and deploy/before-1.30 (the render for older clusters) has none.

kubernetes-validate carries its schemas in the package, so this runs offline. Custom
resources have no schema there; the only ones allowed are the PodMonitor, checked by hand, and the
PrometheusRule, checked by promtool (test_monitoring.py).
"""

from __future__ import annotations

import copy

import kubernetes_validate
import pytest
from kubernetes_validate.utils import all_versions
from packaging.version import Version

from conftest import Render

OLDEST = Version("1.29")
VERSIONS = sorted({v for v in all_versions() if Version(v) >= OLDEST}, key=Version)

# (apiVersion, kind) of custom resources: no schema in kubernetes-validate.
CUSTOM_RESOURCES = {("monitoring.coreos.com/v1", "PodMonitor"), ("monitoring.coreos.com/v1", "PrometheusRule"),
                    ("security.openshift.io/v1", "SecurityContextConstraints")}
# (apiVersion, kind) -> the first release that serves it.
INTRODUCED = {
    ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicy"): Version("1.30"),
    ("admissionregistration.k8s.io/v1", "ValidatingAdmissionPolicyBinding"): Version("1.30"),
}


def test_version_range() -> None:
    assert VERSIONS[0] == "1.29.0"
    assert Version(VERSIONS[-1]) >= Version("1.32"), VERSIONS
    # No gap between the oldest and the newest minor release.
    minors = [Version(v).minor for v in VERSIONS]
    assert minors == list(range(minors[0], minors[-1] + 1))


@pytest.mark.parametrize("version", VERSIONS)
def test_rendered_objects_validate(renders: dict[str, Render], version: str) -> None:
    errors = []
    for r in renders.values():
        for doc in r.docs:
            key = (doc["apiVersion"], doc["kind"])
            what = f"{r.name}: {doc['kind']}/{doc['metadata']['name']}"
            if key in INTRODUCED and Version(version) < INTRODUCED[key]:
                assert r.name != "before-1.30", f"{what}: not served before {INTRODUCED[key]}"
                continue
            # The base's DaemonSet mounts the cgroup fs with recursiveReadOnly, a field from 1.30:
            # before it, deploy/before-1.30 is the one to apply (it takes the field off).
            if doc["kind"] == "DaemonSet" and Version(version) < Version("1.30") and r.name != "before-1.30":
                continue
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.SchemaNotFoundError:
                if key not in CUSTOM_RESOURCES:
                    errors.append(f"{what}: no schema for {key} in {version}")
            except kubernetes_validate.ValidationError as e:
                path = ".".join(str(p) for p in e.path)
                errors.append(f"{what}: {path}: {e.message}")
            else:
                assert key not in CUSTOM_RESOURCES, f"{key} unexpectedly has a schema"
    assert not errors, f"Kubernetes {version}:\n" + "\n".join(errors)


def test_strict_validation_catches_a_typo(renders: dict[str, Render]) -> None:
    """The validator is not a no-op: an unknown field in the pod template is an error."""
    ds = copy.deepcopy(renders["base"].one("DaemonSet", "valet-agent"))
    ds["spec"]["template"]["spec"]["hostPid"] = True  # sic: hostPID
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ds, VERSIONS[-1], strict=True)


def test_podmonitor_by_hand(renders: dict[str, Render]) -> None:
    """The PodMonitor (no schema above) selects the agent pods and scrapes a port they have."""
    r = renders["base+podmonitor"]
    pm = r.one("PodMonitor", "valet-agent")
    ds = r.one("DaemonSet", "valet-agent")
    assert pm["metadata"]["namespace"] == ds["metadata"]["namespace"] == "valet-system"
    selector = pm["spec"]["selector"]["matchLabels"]
    assert selector.items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    port_names = {
        p["name"] for c in ds["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])
    }
    endpoints = pm["spec"]["podMetricsEndpoints"]
    assert endpoints and all(e["port"] in port_names for e in endpoints)
    assert all(e.get("path", "/metrics") == "/metrics" for e in endpoints)
    known = {"port", "path", "interval", "scrapeTimeout", "honorLabels", "relabelings", "metricRelabelings"}
    for e in endpoints:
        assert set(e) <= known, f"unexpected PodMonitor endpoint fields: {set(e) - known}"


@pytest.mark.parametrize("key", sorted(INTRODUCED))
def test_policy_kinds_start_at_130(key: tuple[str, str]) -> None:
    """Why deploy/before-1.30 exists: 1.29 has no schema (no API) for the policy kinds."""
    api_version, kind = key
    doc = {"apiVersion": api_version, "kind": kind, "metadata": {"name": "x"}}
    older = [v for v in VERSIONS if Version(v) < INTRODUCED[key]]
    assert older, "no release before the policy in the tested range"
    for v in older:
        with pytest.raises(kubernetes_validate.SchemaNotFoundError):
            kubernetes_validate.validate(doc, v, strict=True)
    first = min(v for v in VERSIONS if Version(v) >= INTRODUCED[key])
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dict(doc, spec={"noSuchField": 1}), first, strict=True)
