"""(d) checkov static scan of every render (and of the Dockerfile): zero failed checks.

Each finding we accept is suppressed in the manifest itself (a `checkov.io/skipN:
CKV_...=reason` annotation on the object) and listed in ACCEPTED below, so a new
suppression, or a suppression that no longer fires, fails this test until it is reviewed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import Render

# (kind, namespace, name) -> check ids suppressed in place, with the reason in the manifest.
ACCEPTED: dict[tuple[str, str, str], set[str]] = {
    ("DaemonSet", "valet-system", "valet-agent"): {
        "CKV_K8S_15",  # imagePullPolicy IfNotPresent
        "CKV_K8S_17",  # hostPID
        "CKV_K8S_23",  # root
        "CKV_K8S_25",  # added capabilities
        "CKV_K8S_38",  # service account token mounted
        "CKV_K8S_39",  # CAP_SYS_ADMIN
        "CKV_K8S_40",  # uid below 10000 (0)
        "CKV_K8S_43",  # tag, not digest
        "CKV_K8S_8",  # no liveness probe on the deadline keeper
        "CKV_K8S_9",  # no readiness probe on the deadline keeper
    },
    # checkov's graph check names the DaemonSet's pod template "Pod.<ns>.<name>.<labels>".
    ("Pod", "valet-system", "valet-agent"): {"CKV2_K8S_6"},  # no NetworkPolicy
    ("Job", "valet-example", "valet-example"): {"CKV_K8S_43"},
    ("Pod", "valet-example", "valet-example"): {"CKV2_K8S_6"},
}
# Dockerfile findings accepted with a `# checkov:skip=ID: reason` comment in the Dockerfile.
ACCEPTED_DOCKERFILE = {"CKV_DOCKER_2", "CKV_DOCKER_7"}  # no HEALTHCHECK; distroless :latest
DOCKERFILE = Path(__file__).resolve().parents[2] / "Dockerfile"


def checkov_command() -> list[str]:
    beside = Path(sys.executable).parent / "checkov"
    exe = str(beside) if beside.exists() else shutil.which("checkov")
    if not exe:
        pytest.fail("checkov not found: install deploy/tests/requirements.txt")
    return [exe]


def resource_key(resource: str) -> tuple[str, str, str]:
    kind, namespace, name = resource.split(".")[:3]
    return kind, namespace, name


def run_checkov(framework: str, *target: str) -> dict:
    env = dict(os.environ, CKV_SKIP_PACKAGE_UPDATE_CHECK="true", BC_SKIP_MAPPING="TRUE")
    proc = subprocess.run(
        checkov_command()
        + [*target, "--framework", framework, "--skip-download", "-o", "json"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    # Exit code 1 just means failed checks; the JSON tells. Anything else is a crash.
    assert proc.returncode in (0, 1), f"checkov exited {proc.returncode}:\n{proc.stderr}"
    report = json.loads(proc.stdout)
    assert isinstance(report, dict) and report["check_type"] == framework, proc.stdout[:500]
    return report


def failures(report: dict) -> list[str]:
    return [
        f"{c['check_id']} {c['check_name']}: {c['resource']} ({c['file_path']})"
        for c in report["results"]["failed_checks"]
    ]


@pytest.fixture(scope="session")
def checkov_report(renders: dict[str, Render], tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("rendered")
    for r in renders.values():
        (out / f"{r.name}.yaml").write_text(r.text)
    return run_checkov("kubernetes", "-d", str(out))


def test_no_failed_checks(checkov_report: dict) -> None:
    results = checkov_report["results"]
    failed = failures(checkov_report)
    assert not results["parsing_errors"], results["parsing_errors"]
    assert not failed, "checkov failed checks:\n" + "\n".join(failed)
    assert checkov_report["summary"]["passed"] > 0


def test_suppressions_are_exactly_the_accepted_ones(checkov_report: dict) -> None:
    skipped: dict[tuple[str, str, str], set[str]] = {}
    for c in checkov_report["results"]["skipped_checks"]:
        skipped.setdefault(resource_key(c["resource"]), set()).add(c["check_id"])
    assert skipped == ACCEPTED


def test_every_suppression_gives_a_reason(checkov_report: dict) -> None:
    for c in checkov_report["results"]["skipped_checks"]:
        reason = (c["check_result"].get("suppress_comment") or "").strip()
        assert len(reason) >= 30 and reason != "No comment provided", (
            f"{c['check_id']} on {c['resource']}: reason too thin: {reason!r}"
        )


def test_dockerfile() -> None:
    report = run_checkov("dockerfile", "-f", str(DOCKERFILE))
    assert not report["results"]["parsing_errors"]
    assert not failures(report), "checkov failed checks:\n" + "\n".join(failures(report))
    skipped = report["results"]["skipped_checks"]
    assert {c["check_id"] for c in skipped} == ACCEPTED_DOCKERFILE
    for c in skipped:
        assert len((c["check_result"].get("suppress_comment") or "").strip()) >= 30, c["check_id"]
