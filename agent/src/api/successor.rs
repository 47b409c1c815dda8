//! What a SIGTERM means for the apps held on this node: whether a successor agent will come and
//! take the holds over (the pinned record of holds, as after a crash), or nothing will and they
//! must run now.
//!
//! The kubelet SIGTERMs the agent for a container restart (a failed liveness probe: the pod is
//! not being deleted, the same pod starts the container again), for a rollout (the DaemonSet's
//! controller deletes the old pod and makes a new one on the node) and for an uninstall (the
//! DaemonSet is deleted, then its pods; or the node no longer fits the DaemonSet and its pod is
//! deleted there). Only the last has no successor. The agent knows its own pod from the
//! downward API (`POD_NAME`, `POD_NAMESPACE`) and its DaemonSet from the pod's controller
//! reference. When the API does not answer in time the holds are kept: the deadline keeper and
//! each record's deadline still bound them; releasing could let an app start before its proxy,
//! which is what valet exists to prevent.

use std::collections::BTreeMap;
use std::time::Duration;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::{Node, NodeSelectorRequirement, NodeSelectorTerm, Pod, PodSpec, Taint, Toleration};
use kube::{Api, Client};
use tracing::{info, warn};

/// How long the lookup at SIGTERM may take, well inside the pod's grace period (30 s): an API
/// server that answers none of it within this keeps the holds.
pub const LOOKUP_BUDGET: Duration = Duration::from_secs(2);

/// The agent's own pod, from the downward API.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnPod {
    pub namespace: String,
    pub name: String,
    /// The node the pod runs on (`NODE_NAME`).
    pub node: String,
}

impl OwnPod {
    /// From `POD_NAME`, `POD_NAMESPACE` (the client's namespace when unset) and `NODE_NAME`;
    /// `None` outside a pod (no `POD_NAME`).
    pub fn of(own: &OwnPodNames, client_namespace: &str) -> Option<OwnPod> {
        let name = own.pod_name.filter(|n| !n.trim().is_empty())?.to_owned();
        let namespace = own.pod_namespace.filter(|n| !n.trim().is_empty()).unwrap_or(client_namespace).to_owned();
        Some(OwnPod { namespace, name, node: own.node_name.to_owned() })
    }
}

/// The downward API's names of this node and of the agent's own pod, as configured
/// (`NODE_NAME`, `POD_NAME`, `POD_NAMESPACE`).
#[derive(Clone, Copy, Debug)]
pub struct OwnPodNames<'a> {
    pub node_name: &'a str,
    pub pod_name: Option<&'a str>,
    pub pod_namespace: Option<&'a str>,
}

/// Why a successor will come.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Successor {
    /// The pod is not being deleted: the kubelet restarts the container in it.
    ContainerRestart,
    /// The pod is being deleted while its DaemonSet stays and the node still fits it.
    Rollout,
}

/// Why nothing will come after this agent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Uninstall {
    /// Not run in a pod (no `POD_NAME`): nothing restarts it.
    NotInPod,
    /// The pod is gone or going and has no DaemonSet for a controller.
    NoDaemonSet,
    DaemonSetGone,
    DaemonSetDeleting,
    /// The node object is gone (the node leaves the cluster).
    NodeGone,
    /// The node no longer fits the DaemonSet's scheduling (selector, affinity, taints): its
    /// controller takes its pod off the node and makes none.
    NodeUnfit,
    /// The pod object is gone already (deleted without a grace period): its DaemonSet is unknown.
    PodGone,
    /// Not a SIGTERM: the agent's pod watch ended (nothing says a successor comes).
    WatchEnded,
}

/// What the agent does with its holds at SIGTERM.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Stop {
    /// A successor takes the holds over: they stay pinned.
    HandOver(Successor),
    /// Nothing will come: every held app runs now.
    Release(Uninstall),
    /// The API did not say in time: the holds stay, bounded by the keeper and their deadlines.
    Keep(String),
}

impl Stop {
    /// Whether every held app is released now.
    pub fn releases(&self) -> bool {
        matches!(self, Stop::Release(_))
    }

    /// The decision, as logged.
    pub fn verdict(&self) -> &'static str {
        match self {
            Stop::HandOver(_) => "handed over",
            Stop::Release(Uninstall::NotInPod) => "released: not in a pod",
            Stop::Release(_) => "released: uninstall",
            Stop::Keep(_) => "kept: API unanswered",
        }
    }

    /// Why, in a few words.
    pub fn why(&self) -> String {
        match self {
            Stop::HandOver(Successor::ContainerRestart) => "own pod not being deleted: a container restart".into(),
            Stop::HandOver(Successor::Rollout) => "own pod being deleted, its DaemonSet stays and fits the node".into(),
            Stop::Release(u) => match u {
                Uninstall::NotInPod => "no POD_NAME".into(),
                Uninstall::NoDaemonSet => "own pod has no DaemonSet controller".into(),
                Uninstall::DaemonSetGone => "its DaemonSet is gone".into(),
                Uninstall::DaemonSetDeleting => "its DaemonSet is being deleted".into(),
                Uninstall::NodeGone => "the node object is gone".into(),
                Uninstall::NodeUnfit => "the node no longer fits the DaemonSet's scheduling".into(),
                Uninstall::PodGone => "own pod object gone".into(),
                Uninstall::WatchEnded => "the pod watch ended".into(),
            },
            Stop::Keep(why) => why.clone(),
        }
    }

    /// Logs the decision at SIGTERM (`who`: the agent or the deadline keeper).
    pub fn log(&self, who: &str) {
        let (verdict, why) = (self.verdict(), self.why());
        match self {
            Stop::Keep(_) => {
                warn!(who, verdict, why = %why, "at SIGTERM: holds kept for the deadline keeper and a successor")
            }
            _ => info!(who, verdict, why = %why, "at SIGTERM: {verdict}"),
        }
    }
}

/// [`at_sigterm`] with a client made from the environment (in the pod: its service account;
/// else `KUBECONFIG`), all within [`LOOKUP_BUDGET`]. `node`: the downward API's names of this
/// node and of the own pod.
pub async fn at_sigterm_from_env(node: &OwnPodNames<'_>) -> Stop {
    if node.pod_name.is_none_or(str::is_empty) {
        return Stop::Release(Uninstall::NotInPod);
    }
    let started = tokio::time::Instant::now();
    let config = match tokio::time::timeout(LOOKUP_BUDGET, kube::Config::infer()).await {
        Ok(Ok(config)) => config,
        Ok(Err(e)) => return Stop::Keep(format!("no API client: {e}")),
        Err(_) => return Stop::Keep(format!("no API client within {LOOKUP_BUDGET:?}")),
    };
    let own = OwnPod::of(node, &config.default_namespace);
    let client = match Client::try_from(config) {
        Ok(client) => client,
        Err(e) => return Stop::Keep(format!("no API client: {e}")),
    };
    at_sigterm(Some(client), own.as_ref(), LOOKUP_BUDGET.saturating_sub(started.elapsed())).await
}

/// Finds out, within `budget`, whether a successor will come; see the module's description.
/// `own`: `None` outside a pod (released at once, no lookup).
pub async fn at_sigterm(client: Option<Client>, own: Option<&OwnPod>, budget: Duration) -> Stop {
    let Some(own) = own else { return Stop::Release(Uninstall::NotInPod) };
    let Some(client) = client else { return Stop::Keep("no API client".into()) };
    match tokio::time::timeout(budget, look(client, own)).await {
        Ok(Ok(stop)) => stop,
        Ok(Err(e)) => Stop::Keep(format!("API error: {e}")),
        Err(_) => Stop::Keep(format!("no answer within {budget:?}")),
    }
}

async fn look(client: Client, own: &OwnPod) -> Result<Stop, kube::Error> {
    let pods: Api<Pod> = Api::namespaced(client.clone(), &own.namespace);
    let Some(pod) = pods.get_opt(&own.name).await? else { return Ok(Stop::Release(Uninstall::PodGone)) };
    let phase = pod.status.as_ref().and_then(|s| s.phase.as_deref());
    // A failed pod (evicted) is not restarted in place: its DaemonSet replaces it, as a rollout.
    if pod.metadata.deletion_timestamp.is_none() && !matches!(phase, Some("Failed" | "Succeeded")) {
        return Ok(Stop::HandOver(Successor::ContainerRestart));
    }
    let owner = pod
        .metadata
        .owner_references
        .iter()
        .flatten()
        .find(|o| o.controller == Some(true) && o.kind == "DaemonSet" && o.api_version.starts_with("apps/"));
    let Some(owner) = owner else { return Ok(Stop::Release(Uninstall::NoDaemonSet)) };
    let sets: Api<DaemonSet> = Api::namespaced(client.clone(), &own.namespace);
    let Some(set) = sets.get_opt(&owner.name).await? else { return Ok(Stop::Release(Uninstall::DaemonSetGone)) };
    if set.metadata.deletion_timestamp.is_some() {
        return Ok(Stop::Release(Uninstall::DaemonSetDeleting));
    }
    if own.node.is_empty() {
        return Ok(Stop::Keep("NODE_NAME unset: whether the node still fits the DaemonSet is unknown".into()));
    }
    let nodes: Api<Node> = Api::all(client);
    let Some(node) = nodes.get_opt(&own.node).await? else { return Ok(Stop::Release(Uninstall::NodeGone)) };
    let fits = set.spec.template.spec.as_ref().is_some_and(|spec| node_fits(spec, &node));
    Ok(if fits { Stop::HandOver(Successor::Rollout) } else { Stop::Release(Uninstall::NodeUnfit) })
}

/// Tolerations the DaemonSet controller adds to every pod it makes (`AddOrUpdateDaemonPodTolerations`).
const DAEMON_TOLERATIONS: [(&str, &str); 6] = [
    ("node.kubernetes.io/not-ready", "NoExecute"),
    ("node.kubernetes.io/unreachable", "NoExecute"),
    ("node.kubernetes.io/disk-pressure", "NoSchedule"),
    ("node.kubernetes.io/memory-pressure", "NoSchedule"),
    ("node.kubernetes.io/pid-pressure", "NoSchedule"),
    ("node.kubernetes.io/unschedulable", "NoSchedule"),
];

/// Whether the DaemonSet controller places a pod of this template on `node`: its node selector,
/// its required node affinity, and every `NoSchedule` / `NoExecute` taint tolerated (by the
/// template or by the tolerations the controller adds).
pub fn node_fits(spec: &PodSpec, node: &Node) -> bool {
    let empty = BTreeMap::new();
    let labels = node.metadata.labels.as_ref().unwrap_or(&empty);
    let name = node.metadata.name.as_deref().unwrap_or_default();
    let selected = spec.node_selector.iter().flatten().all(|(k, v)| labels.get(k) == Some(v));
    let required = spec
        .affinity
        .as_ref()
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|a| a.required_during_scheduling_ignored_during_execution.as_ref());
    let affine = required.is_none_or(|r| r.node_selector_terms.iter().any(|t| term_matches(t, labels, name)));
    let taints = node.spec.as_ref().and_then(|s| s.taints.as_deref()).unwrap_or_default();
    let tolerations = spec.tolerations.as_deref().unwrap_or_default();
    let tolerated = taints.iter().filter(|t| t.effect == "NoSchedule" || t.effect == "NoExecute").all(|t| {
        tolerations.iter().any(|tol| tolerates(tol, t))
            || DAEMON_TOLERATIONS.iter().any(|(k, e)| t.key == *k && t.effect == *e)
    });
    selected && affine && tolerated
}

/// A term with neither expressions nor fields matches nothing, as the scheduler has it.
fn term_matches(term: &NodeSelectorTerm, labels: &BTreeMap<String, String>, name: &str) -> bool {
    let exprs = term.match_expressions.as_deref().unwrap_or_default();
    let fields = term.match_fields.as_deref().unwrap_or_default();
    if exprs.is_empty() && fields.is_empty() {
        return false;
    }
    let fields_ok = fields.iter().all(|f| {
        let value = (f.key == "metadata.name").then_some(name);
        requirement_matches(f, value)
    });
    fields_ok && exprs.iter().all(|e| requirement_matches(e, labels.get(&e.key).map(String::as_str)))
}

fn requirement_matches(req: &NodeSelectorRequirement, value: Option<&str>) -> bool {
    let values = req.values.as_deref().unwrap_or_default();
    let number = |s: &str| s.parse::<i64>().ok();
    match req.operator.as_str() {
        "In" => value.is_some_and(|v| values.iter().any(|x| x == v)),
        "NotIn" => value.is_none_or(|v| !values.iter().any(|x| x == v)),
        "Exists" => value.is_some(),
        "DoesNotExist" => value.is_none(),
        "Gt" => matches!((value.and_then(number), values.first().and_then(|x| number(x))), (Some(v), Some(x)) if v > x),
        "Lt" => matches!((value.and_then(number), values.first().and_then(|x| number(x))), (Some(v), Some(x)) if v < x),
        _ => false,
    }
}

/// `v1.Toleration.ToleratesTaint`.
fn tolerates(tol: &Toleration, taint: &Taint) -> bool {
    if tol.effect.as_deref().is_some_and(|e| !e.is_empty() && e != taint.effect) {
        return false;
    }
    let key = tol.key.as_deref().unwrap_or_default();
    if !key.is_empty() && key != taint.key {
        return false;
    }
    match tol.operator.as_deref().unwrap_or("Equal") {
        "Exists" => true,
        "Equal" | "" => tol.value.as_deref().unwrap_or_default() == taint.value.as_deref().unwrap_or_default(),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use kube::client::{Body, ClientBuilder};
    use serde_json::{Value, json};

    use super::*;

    type Handle = tower_test::mock::Handle<http::Request<Body>, http::Response<Body>>;

    const NODE: &str = "node-a";

    fn own() -> OwnPod {
        OwnPod { namespace: "valet-system".into(), name: "valet-agent-x1".into(), node: NODE.into() }
    }

    /// The agent's pod as the DaemonSet's controller makes it; `deleting`: a deletionTimestamp.
    fn pod(deleting: bool) -> Value {
        let mut p = json!({
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": "valet-agent-x1", "namespace": "valet-system", "uid": "p-1",
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": "valet-agent",
                    "uid": "ds-1", "controller": true, "blockOwnerDeletion": true}]},
            "spec": {"nodeName": NODE, "containers": [{"name": "valet-agent"}]},
            "status": {"phase": "Running"}
        });
        if deleting {
            p["metadata"]["deletionTimestamp"] = json!("2026-12-04T22:00:00Z");
            p["metadata"]["deletionGracePeriodSeconds"] = json!(30);
        }
        p
    }

    /// The manifest's scheduling: Linux, amd64 or arm64, every taint tolerated.
    fn daemonset(deleting: bool) -> Value {
        let mut d = json!({
            "apiVersion": "apps/v1", "kind": "DaemonSet",
            "metadata": {"name": "valet-agent", "namespace": "valet-system", "uid": "ds-1"},
            "spec": {
                "selector": {"matchLabels": {"app.kubernetes.io/name": "valet"}},
                "template": {"metadata": {"labels": {"app.kubernetes.io/name": "valet"}}, "spec": {
                    "containers": [{"name": "valet-agent"}],
                    "nodeSelector": {"kubernetes.io/os": "linux"},
                    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                        "nodeSelectorTerms": [{"matchExpressions": [
                            {"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64", "arm64"]}]}]}}},
                    "tolerations": [{"operator": "Exists"}]
                }}
            }
        });
        if deleting {
            d["metadata"]["deletionTimestamp"] = json!("2026-12-04T22:00:00Z");
            d["metadata"]["finalizers"] = json!(["foregroundDeletion"]);
        }
        d
    }

    fn node(labels: Value) -> Value {
        json!({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE, "labels": labels}})
    }

    fn linux_amd64() -> Value {
        json!({"kubernetes.io/os": "linux", "kubernetes.io/arch": "amd64", "kubernetes.io/hostname": NODE})
    }

    fn not_found(what: &str) -> (u16, Value) {
        let status = json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": format!("{what} not found"), "reason": "NotFound", "code": 404});
        (404, status)
    }

    /// What the mock API server answers for a path; `None`: it never answers.
    type Answers = Vec<(&'static str, Option<(u16, Value)>)>;

    const POD_PATH: &str = "/api/v1/namespaces/valet-system/pods/valet-agent-x1";
    const DS_PATH: &str = "/apis/apps/v1/namespaces/valet-system/daemonsets/valet-agent";
    const NODE_PATH: &str = "/api/v1/nodes/node-a";

    /// Runs the decision against a mock API server answering `answers`; the decision and the
    /// paths asked, in order. A path not in `answers` fails the test.
    async fn decide(answers: Answers) -> (Stop, Vec<String>) {
        let (service, mut handle): (_, Handle) = tower_test::mock::pair();
        let client = ClientBuilder::new(service, "default").build();
        let server = tokio::spawn(async move {
            let mut asked = Vec::new();
            let mut hung = Vec::new();
            while let Some((request, send)) = handle.next_request().await {
                let path = request.uri().path().to_owned();
                assert_eq!(request.method(), http::Method::GET, "{path}: the decision only reads");
                asked.push(path.clone());
                let answer = answers.iter().find(|(p, _)| *p == path).unwrap_or_else(|| panic!("unexpected {path}"));
                match &answer.1 {
                    Some((status, body)) => send.send_response(
                        http::Response::builder()
                            .status(*status)
                            .body(Body::from(body.to_string().into_bytes()))
                            .expect("a response"),
                    ),
                    None => hung.push(send),
                }
            }
            asked
        });
        let stop = at_sigterm(Some(client), Some(&own()), LOOKUP_BUDGET).await;
        let asked = server.await.expect("mock server");
        (stop, asked)
    }

    #[tokio::test]
    async fn outside_a_pod_it_releases_without_asking() {
        assert_eq!(at_sigterm(None, None, LOOKUP_BUDGET).await, Stop::Release(Uninstall::NotInPod));
        assert_eq!(Stop::Release(Uninstall::NotInPod).verdict(), "released: not in a pod");
    }

    #[tokio::test]
    async fn a_pod_not_being_deleted_is_a_container_restart() {
        let (stop, asked) = decide(vec![(POD_PATH, Some((200, pod(false))))]).await;
        assert_eq!(stop, Stop::HandOver(Successor::ContainerRestart));
        assert_eq!(asked, [POD_PATH], "nothing more is needed");
        assert!(!stop.releases());
        assert_eq!(stop.verdict(), "handed over");
    }

    #[tokio::test]
    async fn a_pod_deleted_while_its_daemonset_stays_on_a_fitting_node_is_a_rollout() {
        let answers = vec![
            (POD_PATH, Some((200, pod(true)))),
            (DS_PATH, Some((200, daemonset(false)))),
            (NODE_PATH, Some((200, node(linux_amd64())))),
        ];
        let (stop, asked) = decide(answers).await;
        assert_eq!(stop, Stop::HandOver(Successor::Rollout));
        assert_eq!(asked, [POD_PATH, DS_PATH, NODE_PATH]);
    }

    #[tokio::test]
    async fn an_evicted_pod_is_replaced_by_its_daemonset() {
        let mut evicted = pod(false);
        evicted["status"] = json!({"phase": "Failed", "reason": "Evicted"});
        let answers = vec![
            (POD_PATH, Some((200, evicted))),
            (DS_PATH, Some((200, daemonset(false)))),
            (NODE_PATH, Some((200, node(linux_amd64())))),
        ];
        assert_eq!(decide(answers).await.0, Stop::HandOver(Successor::Rollout));
    }

    #[tokio::test]
    async fn a_daemonset_being_deleted_or_gone_is_an_uninstall() {
        let deleting = vec![(POD_PATH, Some((200, pod(true)))), (DS_PATH, Some((200, daemonset(true))))];
        let (stop, _) = decide(deleting).await;
        assert_eq!(stop, Stop::Release(Uninstall::DaemonSetDeleting));
        assert_eq!(stop.verdict(), "released: uninstall");
        let gone =
            vec![(POD_PATH, Some((200, pod(true)))), (DS_PATH, Some(not_found("daemonsets.apps \"valet-agent\"")))];
        assert_eq!(decide(gone).await.0, Stop::Release(Uninstall::DaemonSetGone));
    }

    #[tokio::test]
    async fn a_node_the_daemonset_no_longer_fits_or_gone_is_an_uninstall() {
        let mut labels = linux_amd64();
        labels["kubernetes.io/arch"] = json!("s390x");
        let unfit = vec![
            (POD_PATH, Some((200, pod(true)))),
            (DS_PATH, Some((200, daemonset(false)))),
            (NODE_PATH, Some((200, node(labels)))),
        ];
        assert_eq!(decide(unfit).await.0, Stop::Release(Uninstall::NodeUnfit));
        let gone = vec![
            (POD_PATH, Some((200, pod(true)))),
            (DS_PATH, Some((200, daemonset(false)))),
            (NODE_PATH, Some(not_found("nodes \"node-a\""))),
        ];
        assert_eq!(decide(gone).await.0, Stop::Release(Uninstall::NodeGone));
    }

    #[tokio::test]
    async fn a_pod_without_a_daemonset_or_gone_is_released() {
        let mut bare = pod(true);
        bare["metadata"]["ownerReferences"] = json!([]);
        let (stop, asked) = decide(vec![(POD_PATH, Some((200, bare)))]).await;
        assert_eq!(stop, Stop::Release(Uninstall::NoDaemonSet));
        assert_eq!(asked, [POD_PATH]);
        assert_eq!(decide(vec![(POD_PATH, Some(not_found("pods")))]).await.0, Stop::Release(Uninstall::PodGone));
    }

    #[tokio::test]
    async fn an_api_error_keeps_the_holds() {
        let error = json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": "etcdserver: request timed out", "reason": "InternalError", "code": 500});
        let (stop, _) = decide(vec![(POD_PATH, Some((500, error)))]).await;
        assert!(matches!(stop, Stop::Keep(_)), "{stop:?}");
        assert_eq!(stop.verdict(), "kept: API unanswered");
        // The DaemonSet's lookup failing keeps them too, whatever the pod said.
        let forbidden = json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": "forbidden", "reason": "Forbidden", "code": 403});
        let answers = vec![(POD_PATH, Some((200, pod(true)))), (DS_PATH, Some((403, forbidden)))];
        assert!(matches!(decide(answers).await.0, Stop::Keep(_)));
    }

    #[tokio::test(start_paused = true)]
    async fn an_api_that_does_not_answer_in_time_keeps_the_holds() {
        let started = tokio::time::Instant::now();
        let answers = vec![(POD_PATH, Some((200, pod(true)))), (DS_PATH, None)];
        let (stop, asked) = decide(answers).await;
        assert!(matches!(&stop, Stop::Keep(why) if why.contains("no answer")), "{stop:?}");
        assert_eq!(asked, [POD_PATH, DS_PATH]);
        assert!(started.elapsed() >= LOOKUP_BUDGET, "gave up after {:?}", started.elapsed());
    }

    fn spec(v: Value) -> PodSpec {
        serde_json::from_value(v).expect("a pod spec")
    }

    fn tainted(labels: Value, taints: Value) -> Node {
        let mut n = node(labels);
        n["spec"] = json!({"taints": taints});
        serde_json::from_value(n).expect("a node")
    }

    #[test]
    fn node_fit_follows_selector_affinity_and_taints() {
        let manifest = || spec(daemonset(false)["spec"]["template"]["spec"].clone());
        let plain = |labels: Value| tainted(labels, json!([]));
        assert!(node_fits(&manifest(), &plain(linux_amd64())));
        let mut windows = linux_amd64();
        windows["kubernetes.io/os"] = json!("windows");
        assert!(!node_fits(&manifest(), &plain(windows)), "node selector");
        let mut no_arch = linux_amd64();
        no_arch.as_object_mut().map(|l| l.remove("kubernetes.io/arch"));
        assert!(!node_fits(&manifest(), &plain(no_arch)), "In needs the label");
        // Every taint tolerated by the manifest's `operator: Exists`.
        let taints = json!([{"key": "dedicated", "value": "gpu", "effect": "NoExecute"}]);
        assert!(node_fits(&manifest(), &tainted(linux_amd64(), taints.clone())));

        // Without that toleration: only the taints the DaemonSet controller tolerates anyway.
        let narrow = || {
            spec(json!({"containers": [{"name": "a"}],
            "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"}]}))
        };
        let cordoned = json!([{"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}]);
        assert!(node_fits(&narrow(), &tainted(linux_amd64(), cordoned)), "a cordoned node keeps its daemons");
        assert!(!node_fits(&narrow(), &tainted(linux_amd64(), taints)), "NoExecute not tolerated");
        let gpu = json!([{"key": "dedicated", "value": "gpu", "effect": "NoSchedule"}]);
        assert!(node_fits(&narrow(), &tainted(linux_amd64(), gpu)));
        let other = json!([{"key": "dedicated", "value": "db", "effect": "NoSchedule"}]);
        assert!(!node_fits(&narrow(), &tainted(linux_amd64(), other)), "another value");
        let soft = json!([{"key": "dedicated", "value": "db", "effect": "PreferNoSchedule"}]);
        assert!(node_fits(&narrow(), &tainted(linux_amd64(), soft)), "PreferNoSchedule never keeps a pod off");

        // matchFields on the node's name, NotIn, DoesNotExist, Gt; terms are ORed.
        let by_name = |op: &str| {
            spec(json!({"containers": [{"name": "a"}], "affinity": {"nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
                    {"matchFields": [{"key": "metadata.name", "operator": op, "values": [NODE]}]},
                    {"matchExpressions": [{"key": "pool", "operator": "Gt", "values": ["3"]},
                                          {"key": "spot", "operator": "DoesNotExist"}]}]}}}}))
        };
        assert!(node_fits(&by_name("In"), &plain(linux_amd64())));
        assert!(!node_fits(&by_name("NotIn"), &plain(linux_amd64())));
        let mut pool = linux_amd64();
        pool["pool"] = json!("4");
        assert!(node_fits(&by_name("NotIn"), &plain(pool.clone())), "the second term");
        pool["spot"] = json!("true");
        assert!(!node_fits(&by_name("NotIn"), &plain(pool)), "DoesNotExist");
        let empty_term = spec(json!({"containers": [{"name": "a"}], "affinity": {"nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{}]}}}}));
        assert!(!node_fits(&empty_term, &plain(linux_amd64())), "an empty term matches nothing");
    }
}
