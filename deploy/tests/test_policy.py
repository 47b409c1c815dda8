"""(f) The node-scoped-writes ValidatingAdmissionPolicy, evaluated on admission requests.

The policy and its CEL expressions are read from the rendered manifests (`kubectl kustomize
deploy/`), never copied here, and evaluated with cel-python (`celpy`) the way the API server
evaluates a ValidatingAdmissionPolicy: the resource rules and match conditions select the
request, the variables are computed, every validation must be true; an expression that errors
denies (failurePolicy: Fail).

Where celpy and the API server's CEL differ, the policy keeps to what both understand:
- no optional types (`obj.?field`, `map[?key]`, `.orValue()`): the API server has them from
  1.29 (cel-go's OptionalTypes), celpy 0.5 does not parse them; `has()` is used instead;
- no Kubernetes extension libraries (`isSorted()`, `url()`, `quantity()`, regex `find()`),
  which celpy lacks;
- `has(m.key)` on a map tests the key, `k in m` too, and `m.all(k, ...)` iterates a map's
  keys in both. In a ValidatingAdmissionPolicy `object` and `oldObject` are untyped (dyn)
  maps (the API server declares them `cel.DynType` and passes the object as unstructured
  JSON), so these work on them exactly as on the plain dicts given to celpy here;
- errors: the API server fails an expression that reads a missing key; celpy raises
  (or returns an error value) too. Both count as "deny" here, as failurePolicy Fail does.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import celpy
import pytest

from conftest import Render

AGENT = "system:serviceaccount:valet-system:valet-agent"
NODE = "node-a"
OTHER_NODE = "node-b"
NODE_KEY = "authentication.kubernetes.io/node-name"
CONDITION = "valet.dev/ProxyReady"
POLICY = "valet-agent-node-scoped-writes"


@dataclass
class Decision:
    matched: bool
    allowed: bool
    why: list[str]


def policy_of(render: Render) -> dict:
    return render.one("ValidatingAdmissionPolicy", POLICY)


@pytest.fixture(scope="module")
def policy(renders: dict[str, Render]) -> dict:
    return policy_of(renders["base"])


_ENV = celpy.Environment()


def cel_value(expression: str, activation: dict):
    """The CEL value of one expression, or an Exception when it errors."""
    try:
        value = _ENV.program(_ENV.compile(expression)).evaluate(activation)
    except Exception as e:  # noqa: BLE001 - any failure is an evaluation error
        return e
    if isinstance(value, celpy.CELEvalError):
        return RuntimeError(str(value)[:200])
    return value


def evaluate(expression: str, activation: dict):
    """Like cel_value, with a CEL bool as a Python bool (true/false, never truthiness)."""
    value = cel_value(expression, activation)
    if isinstance(value, celpy.celtypes.BoolType):
        return bool(value)
    return value


def rule_matches(rule: dict, request: dict) -> bool:
    res = request["resource"]
    resource = res["resource"] + ("/" + request["subResource"] if request.get("subResource") else "")
    return (
        res["group"] in rule["apiGroups"]
        and res["version"] in rule["apiVersions"]
        and resource in rule["resources"]
        and request["operation"] in rule["operations"]
    )


def admit(policy: dict, request: dict, obj: dict | None, old: dict | None) -> Decision:
    spec = policy["spec"]
    assert spec["failurePolicy"] == "Fail"
    if not any(rule_matches(r, request) for r in spec["matchConstraints"]["resourceRules"]):
        return Decision(False, True, [])
    activation = {
        "request": celpy.json_to_cel(request),
        "object": celpy.json_to_cel(obj),
        "oldObject": celpy.json_to_cel(old),
    }
    for cond in spec.get("matchConditions", []):
        result = evaluate(cond["expression"], activation)
        if isinstance(result, Exception):
            return Decision(True, False, [f"match condition {cond['name']} errored: {result}"])
        if result is not True:
            return Decision(False, True, [])
    # Variables in order, each seeing the ones before it. One that errors is left out, so an
    # expression that reads it errors too (the API server evaluates variables lazily: only
    # their readers fail).
    variables = celpy.celtypes.MapType({})
    for var in spec.get("variables", []):
        value = cel_value(var["expression"], dict(activation, variables=variables))
        if not isinstance(value, Exception):
            variables[celpy.celtypes.StringType(var["name"])] = value
    activation["variables"] = variables
    why = []
    for v in spec["validations"]:
        result = evaluate(v["expression"], activation)
        if result is not True:
            reason = f"error: {str(result)[:200]}" if isinstance(result, Exception) else "false"
            why.append(f"{v.get('message') or v.get('messageExpression')} ({reason})")
    return Decision(True, not why, why)


# ---- admission requests -------------------------------------------------------------------


def request(
    resource: str,
    operation: str,
    *,
    group: str = "",
    sub: str = "",
    user: str = AGENT,
    node: str | None = NODE,
    extra: dict | None = None,
) -> dict:
    info: dict = {"username": user, "uid": "u-1", "groups": ["system:serviceaccounts"]}
    if extra is not None:
        info["extra"] = extra
    elif node is not None:
        info["extra"] = {
            NODE_KEY: [node],
            "authentication.kubernetes.io/pod-name": ["valet-agent-x1"],
            "authentication.kubernetes.io/pod-uid": ["7c0e1d2a-0000-4000-8000-000000000001"],
        }
    return {
        "uid": "r-1",
        "kind": {"group": group, "version": "v1", "kind": "Pod" if resource == "pods" else "Event"},
        "resource": {"group": group, "version": "v1", "resource": resource},
        "subResource": sub,
        "operation": operation,
        "name": "job-1",
        "namespace": "team-a",
        "userInfo": info,
    }


def pod(node: str | None = NODE) -> dict:
    p = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "job-1",
            "namespace": "team-a",
            "uid": "0f5c9b6e-3a7d-4e21-9b8a-1c2d3e4f5a6b",
            "resourceVersion": "1001",
            "creationTimestamp": "2026-11-23T10:00:00Z",
            "labels": {"valet.dev/enabled": "true", "app": "job"},
            "annotations": {"valet.dev/hold-app": "true"},
            "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": "job", "uid": "j-1"}],
            "managedFields": [{"manager": "kube-controller-manager", "operation": "Update"}],
        },
        "spec": {
            "containers": [{"name": "app", "image": "curl"}, {"name": "istio-proxy", "image": "proxyv2"}],
            "readinessGates": [{"conditionType": CONDITION}],
            "restartPolicy": "Never",
        },
        "status": {
            "phase": "Running",
            "hostIP": "10.0.0.5",
            "hostIPs": [{"ip": "10.0.0.5"}],
            "podIP": "10.244.1.7",
            "podIPs": [{"ip": "10.244.1.7"}],
            "startTime": "2026-11-23T10:00:01Z",
            "qosClass": "BestEffort",
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Initialized", "status": "True"},
                {"type": "ContainersReady", "status": "True"},
                {"type": "Ready", "status": "False", "reason": "ReadinessGatesNotReady"},
            ],
            "containerStatuses": [
                {"name": "app", "ready": True, "restartCount": 0, "containerID": "containerd://" + "a" * 64},
                {"name": "istio-proxy", "ready": True, "restartCount": 0, "containerID": "containerd://" + "b" * 64},
            ],
        },
    }
    if node is not None:
        p["spec"]["nodeName"] = node
    return p


def with_condition(p: dict, status: str = "True", reason: str = "ProxyReady") -> dict:
    """What the agent's strategic-merge patch makes of the pod (plus the field manager's entry)."""
    out = copy.deepcopy(p)
    conditions = out["status"].setdefault("conditions", [])
    new = {"type": CONDITION, "status": status, "reason": reason, "message": "proxy ready",
           "lastTransitionTime": "2026-11-23T10:00:03Z", "lastProbeTime": None}
    for i, c in enumerate(conditions):
        if c["type"] == CONDITION:
            conditions[i] = new
            break
    else:
        conditions.append(new)
    out["metadata"]["managedFields"] = out["metadata"]["managedFields"] + [
        {"manager": "valet-agent", "operation": "Update", "subresource": "status"}
    ]
    out["metadata"]["resourceVersion"] = "1002"
    return out


def status_write(old: dict, new: dict, **kw) -> tuple[dict, dict, dict]:
    return request("pods", "UPDATE", sub="status", **kw), new, old


def event(kind: str, group: str = "events.k8s.io", operation: str = "CREATE") -> tuple[dict, dict, dict | None]:
    if group == "events.k8s.io":
        obj = {
            "apiVersion": "events.k8s.io/v1",
            "kind": "Event",
            "metadata": {"name": "job-1.1", "namespace": "team-a"},
            "regarding": {"apiVersion": "v1", "kind": kind, "name": "job-1", "namespace": "team-a"},
            "reason": "SidecarQuit",
            "action": "Quit",
            "type": "Normal",
            "reportingController": "valet-agent",
            "reportingInstance": NODE,
            "eventTime": "2026-11-23T10:00:04.000000Z",
        }
    else:
        obj = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": "job-1.1", "namespace": "team-a"},
            "involvedObject": {"apiVersion": "v1", "kind": kind, "name": "job-1", "namespace": "team-a"},
            "reason": "SidecarQuit",
            "type": "Normal",
        }
    old = None
    if operation == "UPDATE":
        old = copy.deepcopy(obj)
        obj = dict(obj, series={"count": 2, "lastObservedTime": "2026-11-23T10:01:04.000000Z"})
    return request("events", operation, group=group), obj, old


def changed(p: dict, edit) -> dict:
    out = with_condition(p)
    edit(out)
    return out


def _set(path: list, value):
    def edit(o: dict) -> None:
        for k in path[:-1]:
            o = o[k]
        o[path[-1]] = value

    return edit


def _del(path: list):
    def edit(o: dict) -> None:
        for k in path[:-1]:
            o = o[k]
        del o[path[-1]]

    return edit


def without_conditions(p: dict) -> dict:
    del p["status"]["conditions"]
    return p


def _append_condition(c: dict):
    def edit(o: dict) -> None:
        o["status"]["conditions"].append(c)

    return edit


ALLOWED = {
    "own node: ProxyReady added": status_write(pod(), with_condition(pod())),
    "own node: ProxyReady flipped": status_write(
        with_condition(pod(), "False", "ProxyNotReady"), with_condition(pod(), "True")
    ),
    "own node: pod without conditions gets ProxyReady": status_write(
        without_conditions(pod()), with_condition(without_conditions(pod()))
    ),
    "event about a pod (events.k8s.io)": event("Pod"),
    "event about a pod (core v1)": event("Pod", group=""),
    "event series update about a pod": event("Pod", operation="UPDATE"),
    "another user changes podIP anywhere": status_write(
        pod(OTHER_NODE),
        changed(pod(OTHER_NODE), _set(["status", "podIP"], "10.9.9.9")),
        user="system:node:node-b",
        node=None,
    ),
    "another service account named like ours elsewhere": status_write(
        pod(OTHER_NODE),
        changed(pod(OTHER_NODE), _set(["status", "podIP"], "10.9.9.9")),
        user="system:serviceaccount:other:valet-agent",
        node=None,
    ),
}

DENIED = {
    "another node's pod": status_write(pod(OTHER_NODE), with_condition(pod(OTHER_NODE))),
    "an unscheduled pod": status_write(pod(None), with_condition(pod(None))),
    "changed podIP": status_write(pod(), changed(pod(), _set(["status", "podIP"], "10.9.9.9"))),
    "changed podIPs": status_write(pod(), changed(pod(), _set(["status", "podIPs"], [{"ip": "10.9.9.9"}]))),
    "changed hostIP": status_write(pod(), changed(pod(), _set(["status", "hostIP"], "10.9.9.9"))),
    "changed phase": status_write(pod(), changed(pod(), _set(["status", "phase"], "Succeeded"))),
    "removed podIP": status_write(pod(), changed(pod(), _del(["status", "podIP"]))),
    "added status field": status_write(pod(), changed(pod(), _set(["status", "nominatedNodeName"], "x"))),
    "changed container status": status_write(
        pod(), changed(pod(), _set(["status", "containerStatuses"], [{"name": "app", "ready": False}]))
    ),
    "another condition added": status_write(
        pod(), changed(pod(), _append_condition({"type": "example.com/Other", "status": "True"}))
    ),
    "another condition changed": status_write(
        pod(), changed(pod(), _set(["status", "conditions", 3], {"type": "Ready", "status": "True"}))
    ),
    "another condition removed": status_write(pod(), changed(pod(), _del(["status", "conditions", 0]))),
    "a label changed": status_write(pod(), changed(pod(), _set(["metadata", "labels", "app"], "evil"))),
    "a label removed": status_write(pod(), changed(pod(), _del(["metadata", "labels", "valet.dev/enabled"]))),
    "an annotation added": status_write(pod(), changed(pod(), _set(["metadata", "annotations", "x"], "y"))),
    "annotations dropped": status_write(pod(), changed(pod(), _del(["metadata", "annotations"]))),
    "spec moved to another node": status_write(pod(), changed(pod(), _set(["spec", "nodeName"], OTHER_NODE))),
    "spec changed": status_write(pod(), changed(pod(), _set(["spec", "containers", 0, "image"], "evil"))),
    "node name of the old pod differs": status_write(pod(OTHER_NODE), with_condition(pod())),
    "no node-name extra": status_write(pod(), with_condition(pod()), extra={"other": ["x"]}),
    "no extra at all": status_write(pod(), with_condition(pod()), node=None),
    "empty node-name extra": status_write(pod(), with_condition(pod()), extra={NODE_KEY: []}),
    "two node names": status_write(pod(), with_condition(pod()), extra={NODE_KEY: [NODE, OTHER_NODE]}),
    "event about a node (events.k8s.io)": event("Node"),
    "event about a secret (core v1)": event("Secret", group=""),
    "event update about a service": event("Service", operation="UPDATE"),
    "event without a subject": (
        request("events", "CREATE", group="events.k8s.io"),
        {"apiVersion": "events.k8s.io/v1", "kind": "Event", "metadata": {"name": "e"}, "reason": "x"},
        None,
    ),
    "event without node name": (
        request("events", "CREATE", group="events.k8s.io", node=None),
        event("Pod")[1],
        None,
    ),
}


@pytest.mark.parametrize("case", list(ALLOWED))
def test_allowed(policy: dict, case: str) -> None:
    d = admit(policy, *ALLOWED[case])
    assert d.allowed, f"{case}: denied: {d.why}"


@pytest.mark.parametrize("case", list(DENIED))
def test_denied(policy: dict, case: str) -> None:
    d = admit(policy, *DENIED[case])
    assert d.matched and not d.allowed, f"{case}: allowed"


def test_the_agents_writes_are_matched(policy: dict) -> None:
    """The match is not vacuous: the agent's legitimate writes are evaluated, not skipped."""
    for case in ("own node: ProxyReady added", "event about a pod (events.k8s.io)", "event about a pod (core v1)"):
        assert admit(policy, *ALLOWED[case]).matched, case
    assert not admit(policy, *ALLOWED["another user changes podIP anywhere"]).matched


def test_every_validation_is_needed(policy: dict) -> None:
    """Each validation denies some request the others allow: none is dead or untested."""
    validations = policy["spec"]["validations"]
    for i, v in enumerate(validations):
        weaker = copy.deepcopy(policy)
        del weaker["spec"]["validations"][i]
        flipped = [name for name, args in DENIED.items() if admit(weaker, *args).allowed]
        assert flipped, f"validation {i} ({v['expression'][:60]}...) denies nothing the others allow"


def test_match_names_the_rendered_service_account(renders: dict[str, Render]) -> None:
    base = renders["base"]
    ds = base.one("DaemonSet", "valet-agent")
    sa = base.one("ServiceAccount", ds["spec"]["template"]["spec"]["serviceAccountName"])
    username = f"system:serviceaccount:{sa['metadata']['namespace']}:{sa['metadata']['name']}"
    assert username == AGENT
    (cond,) = policy_of(base)["spec"]["matchConditions"]
    assert f"'{username}'" in cond["expression"]


def test_binding_denies_with_the_policy(renders: dict[str, Render]) -> None:
    base = renders["base"]
    binding = base.one("ValidatingAdmissionPolicyBinding", POLICY)
    assert binding["spec"]["policyName"] == POLICY
    assert binding["spec"]["validationActions"] == ["Deny"]
    # No paramRef or matchResources: the binding applies the policy to every request it matches.
    assert set(binding["spec"]) == {"policyName", "validationActions"}


def test_policy_covers_every_write_the_role_grants(renders: dict[str, Render], policy: dict) -> None:
    """Every mutating verb the ClusterRole grants is matched by the policy."""
    role = renders["base"].one("ClusterRole", "valet-agent")
    verbs = {"create": "CREATE", "patch": "UPDATE", "update": "UPDATE", "delete": "DELETE"}
    rules = policy["spec"]["matchConstraints"]["resourceRules"]
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    if verb not in verbs:
                        continue
                    resource_name, _, sub = resource.partition("/")
                    req = request(resource_name, verbs[verb], group=group, sub=sub)
                    assert any(rule_matches(r, req) for r in rules), f"{verb} {group}/{resource} unmatched"


def test_expressions_use_the_common_subset(policy: dict) -> None:
    spec = policy["spec"]
    exprs = [c["expression"] for c in spec["matchConditions"]]
    exprs += [v["expression"] for v in spec["variables"]]
    exprs += [v["expression"] for v in spec["validations"]]
    exprs += [v["messageExpression"] for v in spec["validations"] if "messageExpression" in v]
    for e in exprs:
        assert ".?" not in e and "[?" not in e and "orValue" not in e, e
        _ENV.compile(e)  # celpy parses it


def test_message_expression_renders(policy: dict) -> None:
    args = DENIED["another node's pod"]
    spec = policy["spec"]
    (node_check,) = [v for v in spec["validations"] if "messageExpression" in v]
    msg = cel_value(node_check["messageExpression"], {"variables": celpy.json_to_cel({"nodeName": NODE})})
    assert msg == f"valet-agent on node {NODE} may only write the status of pods bound to that node"
    assert admit(policy, *args).why


def test_before_130_has_no_policy(renders: dict[str, Render]) -> None:
    kinds = {d["kind"] for d in renders["before-1.30"].docs}
    assert not kinds & {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}
    assert {(d["kind"], d["metadata"]["name"]) for d in renders["before-1.30"].docs} | {
        ("ValidatingAdmissionPolicy", POLICY),
        ("ValidatingAdmissionPolicyBinding", POLICY),
    } == {(d["kind"], d["metadata"]["name"]) for d in renders["base"].docs}
