//! The fake API server driven by the real client valet uses: kube-rs (Api<Pod>, watcher,
//! event recorder).

use std::time::Duration;

use futures::{Stream, StreamExt as _};
use k8s_openapi::api::core::v1::{ObjectReference, Pod};
use kube::api::{Api, ListParams, Patch, PatchParams, PostParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::runtime::events::{Event as KEvent, EventType, Recorder, Reporter};
use kube::runtime::watcher::{self, Event};
use kube::{Client, Config};
use serde_json::{Value, json};
use valet_sim::apiserver::{FakeApiServer, ServerOptions};

fn pod(name: &str) -> Value {
    json!({
        "metadata": {"name": name, "namespace": "default", "labels": {"app": "job"}},
        "spec": {"nodeName": "node-a", "restartPolicy": "Never",
                 "containers": [{"name": "app", "image": "busybox"}, {"name": "istio-proxy", "image": "proxyv2"}]},
        "status": {"phase": "Running", "conditions": [
            {"type": "Ready", "status": "True"},
            {"type": "PodScheduled", "status": "True"}]}
    })
}

async fn client_for(server: &FakeApiServer) -> Client {
    let dir = std::env::temp_dir().join(format!("valet-sim-kc-{}", valet_sim::util::random_hex(6)));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let path = dir.join("kubeconfig");
    server.write_kubeconfig(&path).expect("kubeconfig");
    let kc = Kubeconfig::read_from(&path).expect("kubeconfig parses");
    let config = Config::from_custom_kubeconfig(kc, &KubeConfigOptions::default()).await.expect("config");
    let _ = std::fs::remove_dir_all(&dir);
    Client::try_from(config).expect("client")
}

/// The next watcher event that is not an error, as a short label.
async fn next(stream: &mut (impl Stream<Item = watcher::Result<Event<Pod>>> + Unpin)) -> String {
    loop {
        let item = tokio::time::timeout(Duration::from_secs(30), stream.next())
            .await
            .expect("watcher event in time")
            .expect("watcher stream continues");
        let name = |p: &Pod| p.metadata.name.clone().unwrap_or_default();
        match item {
            Ok(Event::Init) => return "Init".into(),
            Ok(Event::InitApply(p)) => return format!("InitApply {}", name(&p)),
            Ok(Event::InitDone) => return "InitDone".into(),
            Ok(Event::Apply(p)) => return format!("Apply {}", name(&p)),
            Ok(Event::Delete(p)) => return format!("Delete {}", name(&p)),
            Err(_) => continue, // dropped/expired watches surface as errors, then recover
        }
    }
}

fn list_requests(server: &FakeApiServer) -> usize {
    server.requests().iter().filter(|r| r.method == "GET" && r.path.ends_with("/pods") && !r.is_watch()).count()
}

#[tokio::test]
async fn watcher_sees_changes_and_survives_drops_and_expiry() {
    let server =
        FakeApiServer::start_with(ServerOptions { bookmark_interval: Duration::from_secs(5), ..Default::default() })
            .expect("server");
    server.create_pod(pod("p1")).expect("create");
    let client = client_for(&server).await;
    let api: Api<Pod> = Api::namespaced(client, "default");
    let mut w = watcher::watcher(api, watcher::Config::default().labels("app=job")).boxed();

    assert_eq!(next(&mut w).await, "Init");
    assert_eq!(next(&mut w).await, "InitApply p1");
    assert_eq!(next(&mut w).await, "InitDone");

    server.create_pod(pod("p2")).expect("create");
    assert_eq!(next(&mut w).await, "Apply p2");
    server.modify_pod("default", "p2", |p| p["status"]["phase"] = json!("Succeeded")).expect("modify");
    assert_eq!(next(&mut w).await, "Apply p2");
    server.delete_pod("default", "p2").expect("delete");
    assert_eq!(next(&mut w).await, "Delete p2");
    assert_eq!(list_requests(&server), 1);

    // A dropped connection: the watcher re-watches from its last RV without re-listing.
    let watches = server.watch_count();
    server.drop_watches();
    server.create_pod(pod("p3")).expect("create");
    assert_eq!(next(&mut w).await, "Apply p3");
    assert!(server.watch_count() > watches);
    assert_eq!(list_requests(&server), 1);

    // Expired history plus a drop: the resumed watch gets 410 and the watcher re-lists.
    server.expire_history();
    server.drop_watches();
    assert_eq!(next(&mut w).await, "Init");
    let mut init = vec![next(&mut w).await, next(&mut w).await];
    init.sort();
    assert_eq!(init, ["InitApply p1", "InitApply p3"]);
    assert_eq!(next(&mut w).await, "InitDone");
    assert_eq!(list_requests(&server), 2);
    server.create_pod(pod("p4")).expect("create");
    assert_eq!(next(&mut w).await, "Apply p4");
    // The resumed watch saw the ERROR event the real server sends (HTTP 200, then 410 Status).
    assert!(
        server.requests().iter().any(|r| r.is_watch() && r.query_param("resourceVersion").is_some_and(|rv| rv != "0"))
    );
}

#[tokio::test]
async fn streaming_list_watcher() {
    let server = FakeApiServer::start().expect("server");
    server.create_pod(pod("p1")).expect("create");
    let api: Api<Pod> = Api::namespaced(client_for(&server).await, "default");
    let mut w = watcher::watcher(api, watcher::Config::default().streaming_lists()).boxed();
    assert_eq!(next(&mut w).await, "Init");
    assert_eq!(next(&mut w).await, "InitApply p1");
    assert_eq!(next(&mut w).await, "InitDone");
    server.create_pod(pod("p2")).expect("create");
    assert_eq!(next(&mut w).await, "Apply p2");
    assert_eq!(list_requests(&server), 0);
}

#[tokio::test]
async fn patch_status_strategic_merges_conditions_by_type() {
    let server = FakeApiServer::start().expect("server");
    server.create_pod(pod("p1")).expect("create");
    let api: Api<Pod> = Api::namespaced(client_for(&server).await, "default");

    let patch = json!({"status": {"conditions": [
        {"type": "Ready", "status": "False", "reason": "SidecarsQuit"},
        {"type": "valet.dev/SidecarsQuit", "status": "True"}]}});
    let out = api.patch_status("p1", &PatchParams::default(), &Patch::Strategic(&patch)).await.expect("patch");
    let conds = out.status.and_then(|s| s.conditions).expect("conditions");
    let summary: Vec<(String, String)> = conds.iter().map(|c| (c.type_.clone(), c.status.clone())).collect();
    assert_eq!(
        summary,
        [
            ("Ready".to_string(), "False".to_string()),
            ("PodScheduled".to_string(), "True".to_string()),
            ("valet.dev/SidecarsQuit".to_string(), "True".to_string())
        ]
    );
    let rec = server.requests().into_iter().rev().find(|r| r.method == "PATCH").expect("recorded");
    assert_eq!(rec.path, "/api/v1/namespaces/default/pods/p1/status");
    assert_eq!(rec.content_type.as_deref(), Some("application/strategic-merge-patch+json"));

    // Status patches leave spec and metadata alone; main-resource patches leave status alone.
    let out = api
        .patch_status(
            "p1",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"x": "y"}}, "status": {"phase": "Succeeded"}})),
        )
        .await
        .expect("patch");
    assert_eq!(out.status.as_ref().and_then(|s| s.phase.as_deref()), Some("Succeeded"));
    assert!(out.metadata.labels.as_ref().is_some_and(|l| !l.contains_key("x")));
    let out = api
        .patch(
            "p1",
            &PatchParams::default(),
            &Patch::Merge(json!({"metadata": {"labels": {"x": "y"}}, "status": {"phase": "Failed"}})),
        )
        .await
        .expect("patch");
    assert_eq!(out.status.as_ref().and_then(|s| s.phase.as_deref()), Some("Succeeded"));
    assert_eq!(out.metadata.labels.as_ref().and_then(|l| l.get("x")).map(String::as_str), Some("y"));

    // Server-side apply and JSON patch.
    let out = api
        .patch_status(
            "p1",
            &PatchParams::apply("valet").force(),
            &Patch::Apply(json!({"apiVersion": "v1", "kind": "Pod", "status": {"conditions": [{"type": "valet.dev/Applied", "status": "True"}]}})),
        )
        .await
        .expect("apply");
    assert_eq!(out.status.and_then(|s| s.conditions).map(|c| c.len()), Some(4));
    // JSON patch (kube needs its `jsonpatch` feature for it; send it raw).
    let r = valet_sim::client::request(
        server.addr(),
        "PATCH",
        "/api/v1/namespaces/default/pods/p1/status",
        Some("application/json-patch+json"),
        br#"[{"op":"replace","path":"/status/phase","value":"Failed"}]"#,
        Duration::from_secs(5),
    )
    .expect("json patch");
    assert_eq!(r.status, 200);
    assert_eq!(api.get_status("p1").await.expect("get").status.and_then(|s| s.phase), Some("Failed".into()));

    errors_are_kube_api_errors(&server, &api).await;
}

/// Errors come back as kube::Error::Api with the Status fields: not found, a conflict, a fault.
async fn errors_are_kube_api_errors(server: &FakeApiServer, api: &Api<Pod>) {
    match api.get("nope").await {
        Err(kube::Error::Api(s)) => {
            assert_eq!(s.code, 404);
            assert_eq!(s.reason, "NotFound");
        }
        other => panic!("expected a 404, got {other:?}"),
    }
    let mut stale = api.get("p1").await.expect("get");
    stale.metadata.resource_version = Some("2".into());
    match api.replace("p1", &PostParams::default(), &stale).await {
        Err(kube::Error::Api(s)) => assert_eq!(s.code, 409),
        other => panic!("expected a 409, got {other:?}"),
    }
    server.fail_next(1, 500);
    assert!(api.get("p1").await.is_err());
    assert!(api.get("p1").await.is_ok());
}

#[tokio::test]
async fn paginated_list_and_selectors() {
    let server = FakeApiServer::start().expect("server");
    for i in 0..7 {
        let mut p = pod(&format!("p{i}"));
        if i % 2 == 0 {
            p["spec"]["nodeName"] = json!("node-b");
        }
        server.create_pod(p).expect("create");
    }
    let api: Api<Pod> = Api::all(client_for(&server).await);
    let mut names = Vec::new();
    let mut lp = ListParams::default().limit(3);
    loop {
        let page = api.list(&lp).await.expect("list");
        names.extend(page.items.iter().filter_map(|p| p.metadata.name.clone()));
        match page.metadata.continue_ {
            Some(c) if !c.is_empty() => lp = lp.continue_token(&c),
            _ => break,
        }
    }
    assert_eq!(names.len(), 7);
    let b = api.list(&ListParams::default().fields("spec.nodeName=node-b")).await.expect("list");
    assert_eq!(b.items.len(), 4);
    let none = api.list(&ListParams::default().labels("app!=job")).await.expect("list");
    assert!(none.items.is_empty());
}

#[tokio::test]
async fn event_recorder_creates_then_patches_series() {
    let server = FakeApiServer::start().expect("server");
    let client = client_for(&server).await;
    let recorder = Recorder::new(client, Reporter { controller: "valet".into(), instance: Some("node-a".into()) });
    let reference = ObjectReference {
        api_version: Some("v1".into()),
        kind: Some("Pod".into()),
        name: Some("p1".into()),
        namespace: Some("default".into()),
        ..Default::default()
    };
    let ev = KEvent {
        type_: EventType::Normal,
        reason: "SidecarQuit".into(),
        note: Some("istio-proxy quit".into()),
        action: "Quit".into(),
        secondary: None,
    };
    recorder.publish(&ev, &reference).await.expect("first publish");
    recorder.publish(&ev, &reference).await.expect("second publish");
    let events = server.events();
    assert_eq!(events.len(), 1);
    assert_eq!(events[0]["apiVersion"], "events.k8s.io/v1");
    assert_eq!(events[0]["series"]["count"], 2);
    let methods: Vec<String> = server.requests().iter().map(|r| r.method.clone()).collect();
    assert_eq!(methods, ["POST", "PATCH"]);
}

/// What a node agent reads at SIGTERM: its DaemonSet (apps/v1) and its node, through kube's
/// typed `Api`; 404s, a foreground deletion and writes refused as RBAC refuses them to it.
#[tokio::test]
async fn daemonsets_and_nodes_are_read_as_a_real_server_serves_them() {
    use k8s_openapi::api::apps::v1::DaemonSet;
    use k8s_openapi::api::core::v1::Node;
    use valet_sim::apiserver::{Kind, Propagation};
    let server = FakeApiServer::start().expect("server");
    let client = client_for(&server).await;
    let sets: Api<DaemonSet> = Api::namespaced(client.clone(), "valet-system");
    let nodes: Api<Node> = Api::all(client);
    assert!(sets.get_opt("valet-agent").await.expect("a 404 is an answer").is_none());
    let missing = sets.get("valet-agent").await.expect_err("absent");
    assert!(
        matches!(&missing, kube::Error::Api(s) if s.code == 404 && s.message == "daemonsets.apps \"valet-agent\" not found"),
        "{missing:?}"
    );
    let ds = json!({"metadata": {"name": "valet-agent", "namespace": "valet-system", "labels": {"app": "valet"}},
        "spec": {"selector": {"matchLabels": {"app": "valet"}},
                 "template": {"metadata": {"labels": {"app": "valet"}}, "spec": {"containers": [{"name": "a"}]}}}});
    server.put_object(Kind::DaemonSet, ds).expect("put");
    server
        .put_object(Kind::Node, json!({"metadata": {"name": "node-a", "labels": {"kubernetes.io/os": "linux"}}}))
        .expect("put node");
    let got = sets.get("valet-agent").await.expect("get");
    assert_eq!(got.metadata.generation, Some(1));
    assert!(got.metadata.uid.is_some() && got.metadata.deletion_timestamp.is_none());
    let listed = sets.list(&ListParams::default().labels("app=valet")).await.expect("list");
    assert_eq!(listed.items.len(), 1);
    assert!(sets.list(&ListParams::default().labels("app=other")).await.expect("list").items.is_empty());
    let node = nodes.get("node-a").await.expect("node");
    assert_eq!(node.metadata.labels.unwrap_or_default().get("kubernetes.io/os").map(String::as_str), Some("linux"));
    assert!(nodes.get_opt("node-b").await.expect("a 404 is an answer").is_none());
    // Writes are the admin's (test control); the agent's role grants none.
    let refused = sets.delete("valet-agent", &Default::default()).await.expect_err("forbidden");
    assert!(matches!(&refused, kube::Error::Api(s) if s.code == 403), "{refused:?}");

    server
        .delete_object(Kind::DaemonSet, Some("valet-system"), "valet-agent", Propagation::Foreground)
        .expect("delete");
    let deleting = sets.get("valet-agent").await.expect("kept while its pods go");
    assert!(deleting.metadata.deletion_timestamp.is_some());
    assert_eq!(deleting.metadata.finalizers, Some(vec!["foregroundDeletion".to_owned()]));
    server.delete_object(Kind::DaemonSet, Some("valet-system"), "valet-agent", Propagation::Background).expect("gone");
    assert!(sets.get_opt("valet-agent").await.expect("a 404 is an answer").is_none());
}
