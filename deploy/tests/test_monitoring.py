"""deploy/monitoring: the PrometheusRule's alerts pass their promtool unit tests (every alert has a
case that fires and one that does not), every alert links a runbook paragraph that exists, the
dashboard's PromQL parses, and the monitoring component installs both.

Whether the metric names used here are ones the agent exports is checked against a real agent's
/metrics by the end-to-end test tests/tests/metrics.rs (dashboard_and_rules_use_exported_metrics).

promtool comes from the Debian package `prometheus` (`cargo xtask setup`): these tests fail,
never skip, without it.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from conftest import DEPLOY, Render

MONITORING = DEPLOY / "monitoring"
RULE = MONITORING / "prometheusrule.yaml"
RULE_TESTS = MONITORING / "tests" / "rules-test.yaml"
DASHBOARD = MONITORING / "valet-dashboard.json"
RUNBOOK = DEPLOY.parent / "docs" / "monitoring.md"
ALERTS = {
    "ValetAgentDown",
    "ValetKernelEventsLost",
    "ValetKernelMapFull",
    "ValetQuitsFailing",
    "ValetHoldsFailingOpen",
    "ValetPodsWaitingOnSidecars",
    "ValetNativeSidecarShutdownTax",
    "ValetSlowSidecarStartup",
    "ValetClassicSidecarsOnNativeNodes",
    "ValetNodeDegraded",
}
# What the dashboard shows (issue 30): a panel title per topic, matched case-insensitively.
TOPICS = [
    "sidecar tax",
    "waiting on sidecars",
    "shutdown tax by sidecar mode",
    "startup tax of native proxies",
    "longest wait on sidecars",
    "classic sidecars on native nodes",
    "quits by kind and result",
    "hold time",
    "fail-opens",
    "quit latency",
    "kernel events lost",
    "agent rss per node",
    "agent cpu per node",
]


def promtool() -> str:
    exe = shutil.which("promtool")
    if not exe:
        pytest.fail("promtool not found: install the Debian package `prometheus` (cargo xtask setup)")
    return exe


def rule_spec() -> dict:
    doc = yaml.safe_load(RULE.read_text())
    assert doc["kind"] == "PrometheusRule"
    return doc["spec"]


def alerts() -> list[dict]:
    return [r for g in rule_spec()["groups"] for r in g["rules"] if "alert" in r]


def run(args: list[str], cwd: Path) -> str:
    proc = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(args)} failed:\n{out}"
    return out


def test_the_issues_alerts_and_no_others() -> None:
    assert {a["alert"] for a in alerts()} == ALERTS


def test_rules_pass_promtool_check_and_unit_tests(tmp_path: Path) -> None:
    (tmp_path / "valet-rules.yaml").write_text(yaml.safe_dump(rule_spec()))
    shutil.copy(RULE_TESTS, tmp_path / "rules-test.yaml")
    out = run([promtool(), "check", "rules", "valet-rules.yaml"], tmp_path)
    assert f"SUCCESS: {len(alerts())} rules found" in out, out
    out = run([promtool(), "test", "rules", "rules-test.yaml"], tmp_path)
    assert "SUCCESS" in out, out


def test_every_alert_has_a_case_that_fires_and_one_that_does_not() -> None:
    cases = [c for t in yaml.safe_load(RULE_TESTS.read_text())["tests"] for c in t.get("alert_rule_test", [])]
    for alert in ALERTS:
        mine = [c for c in cases if c["alertname"] == alert]
        assert any(c["exp_alerts"] for c in mine), f"{alert}: no test case where it fires"
        assert any(not c["exp_alerts"] for c in mine), f"{alert}: no test case where it stays quiet"


def test_every_alert_links_its_runbook_paragraph() -> None:
    anchors = {
        re.sub(r"[^a-z0-9 -]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        for line in RUNBOOK.read_text().splitlines()
        if line.startswith("#")
    }
    for a in alerts():
        url = a["annotations"]["runbook_url"]
        assert url.endswith("docs/monitoring.md#" + a["alert"].lower()), url
        assert a["alert"].lower() in anchors, f"{a['alert']}: no heading for it in {RUNBOOK}"
        assert a["labels"]["severity"] in {"info", "warning", "critical"}
        assert a["annotations"]["summary"] and a["annotations"]["description"]


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def targets(d: dict) -> list[tuple[str, str]]:
    return [(p["title"], t["expr"]) for p in d["panels"] for t in p.get("targets", [])]


def test_dashboard_shape() -> None:
    d = dashboard()
    assert d["uid"] == "valet-agent"
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    titles = " | ".join(p["title"].lower() for p in d["panels"])
    for topic in TOPICS:
        assert topic in titles, f"no panel about {topic!r}: {titles}"
    for p in d["panels"]:
        pos = p["gridPos"]
        assert pos["x"] + pos["w"] <= 24, p["title"]
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}", p["title"]
            assert p["targets"] and p.get("description"), p["title"]
    variables = {v["name"] for v in d["templating"]["list"]}
    assert variables == {"datasource", "node", "namespace"}


def test_dashboard_promql_parses(tmp_path: Path) -> None:
    """Each panel query, with Grafana's variables filled in, as a recording rule promtool checks."""
    fill = {"$__rate_interval": "5m", "$__range": "1d", "$node": ".*", "$namespace": ".*"}
    rules = []
    for i, (title, expr) in enumerate(targets(dashboard())):
        for var, value in fill.items():
            expr = expr.replace(var, value)
        assert "$" not in expr, f"{title}: unknown variable in {expr}"
        rules.append({"record": f"dashboard:panel_{i}", "expr": expr})
    (tmp_path / "dashboard-rules.yaml").write_text(yaml.safe_dump({"groups": [{"name": "d", "rules": rules}]}))
    out = run([promtool(), "check", "rules", "dashboard-rules.yaml"], tmp_path)
    assert f"SUCCESS: {len(rules)} rules found" in out, out


def test_monitoring_component(renders: dict[str, Render]) -> None:
    r = renders["base+monitoring"]
    rule = r.one("PrometheusRule", "valet-agent")
    assert rule["metadata"]["namespace"] == "valet-system"
    assert rule["spec"] == rule_spec()
    cm = r.one("ConfigMap", "valet-dashboard")
    assert cm["metadata"]["namespace"] == "valet-system"
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["valet-dashboard.json"]) == dashboard()
    # Not in the base install: monitoring is opt-in.
    assert not renders["base"].of_kind("PrometheusRule")
