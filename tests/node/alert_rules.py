#!/usr/bin/env python3
"""The PrometheusRule of the rendered monitoring manifests (`kubectl kustomize deploy/monitoring` on
stdin) as a promtool rule file: its `spec` (the rule groups), as JSON, which promtool reads as YAML
and the node VM (no YAML parser there) as JSON. The node scenarios evaluate the alerts' expressions
on what the agent exported there (tests/node/scenarios.py `alert_check`).

    kubectl kustomize deploy/monitoring | alert_rules.py > valet-rules.json
"""
import json
import sys

import yaml


def rules(stream):
    found = [d for d in yaml.safe_load_all(stream) if d and d.get("kind") == "PrometheusRule"]
    if len(found) != 1:
        raise SystemExit(f"expected one PrometheusRule in the rendered manifests, found {len(found)}")
    return found[0]["spec"]


if __name__ == "__main__":
    json.dump(rules(sys.stdin), sys.stdout, indent=1)
    print()
