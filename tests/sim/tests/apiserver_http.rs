//! The fake API server's wire protocol, checked with a raw HTTP client.

use std::time::{Duration, Instant};

use serde_json::{Value, json};
use valet_sim::apiserver::{FakeApiServer, Fault, ServerOptions};
use valet_sim::client;

/// Only a guard against a hang: the waits are for events.
const T: Duration = Duration::from_secs(30);

fn pod(name: &str, labels: Value, node: &str) -> Value {
    json!({
        "metadata": {"name": name, "namespace": "ns", "labels": labels},
        "spec": {"nodeName": node, "containers": [{"name": "app", "image": "busybox"}]},
        "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True"}]}
    })
}

fn server(bookmark_ms: u64) -> FakeApiServer {
    FakeApiServer::start_with(ServerOptions {
        bookmark_interval: Duration::from_millis(bookmark_ms),
        ..Default::default()
    })
    .expect("server starts")
}

fn names(list: &Value) -> Vec<String> {
    list["items"]
        .as_array()
        .expect("items")
        .iter()
        .map(|p| p["metadata"]["name"].as_str().expect("name").to_string())
        .collect()
}

#[test]
fn server_is_shareable_across_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<FakeApiServer>();
    let s = std::sync::Arc::new(server(1000));
    let handles: Vec<_> = (0..4)
        .map(|i| {
            let s = s.clone();
            std::thread::spawn(move || s.create_pod(pod(&format!("t{i}"), json!({}), "n1")).map(|_| ()))
        })
        .collect();
    for h in handles {
        h.join().expect("thread").expect("create");
    }
    assert_eq!(s.pods().len(), 4);
    s.shutdown();
    assert!(client::get(s.addr(), "/version", Duration::from_millis(500)).is_err());
}

#[test]
fn list_selectors_and_pagination() {
    let s = server(1000);
    s.create_pod(pod("a", json!({"app": "web"}), "n1")).expect("create");
    s.create_pod(pod("b", json!({"app": "db"}), "n1")).expect("create");
    s.create_pod(pod("c", json!({"app": "web", "canary": "1"}), "n2")).expect("create");
    s.create_pod(json!({"metadata": {"name": "d", "namespace": "other"}, "spec": {"containers": []}})).expect("create");

    let get = |target: &str| client::get(s.addr(), target, T).expect("request");
    let all = get("/api/v1/pods").json().expect("json");
    assert_eq!(all["kind"], "PodList");
    assert_eq!(all["apiVersion"], "v1");
    assert_eq!(all["metadata"]["resourceVersion"], s.resource_version().to_string());
    assert_eq!(names(&all), ["a", "b", "c", "d"]);
    assert_eq!(names(&get("/api/v1/namespaces/ns/pods").json().expect("json")), ["a", "b", "c"]);
    assert_eq!(names(&get("/api/v1/pods?labelSelector=app%3Dweb").json().expect("json")), ["a", "c"]);
    assert_eq!(names(&get("/api/v1/pods?labelSelector=app%3Dweb%2C%21canary").json().expect("json")), ["a"]);
    assert_eq!(names(&get("/api/v1/pods?labelSelector=app%21%3Dweb").json().expect("json")), ["b", "d"]);
    assert_eq!(names(&get("/api/v1/pods?fieldSelector=spec.nodeName%3Dn2").json().expect("json")), ["c"]);
    assert_eq!(names(&get("/api/v1/pods?fieldSelector=spec.nodeName%3D").json().expect("json")), ["d"]);
    assert_eq!(
        names(
            &get("/api/v1/pods?fieldSelector=metadata.namespace%21%3Dns,status.phase%3DPending").json().expect("json")
        ),
        ["d"]
    );
    let bad = get("/api/v1/pods?fieldSelector=spec.bogus%3Dx");
    assert_eq!(bad.status, 400);
    assert_eq!(bad.json().expect("status")["reason"], "BadRequest");

    // Pagination: continue token + remainingItemCount.
    let p1 = get("/api/v1/pods?limit=3").json().expect("json");
    assert_eq!(names(&p1), ["a", "b", "c"]);
    assert_eq!(p1["metadata"]["remainingItemCount"], 1);
    let token = p1["metadata"]["continue"].as_str().expect("continue").to_string();
    let p2 = get(&format!("/api/v1/pods?limit=3&continue={token}")).json().expect("json");
    assert_eq!(names(&p2), ["d"]);
    assert!(p2["metadata"].get("continue").is_none());

    // Exact list of a compacted RV: 410.
    let rv = s.resource_version();
    s.expire_history();
    let gone = get(&format!("/api/v1/pods?resourceVersion={rv}&resourceVersionMatch=Exact"));
    assert_eq!(gone.status, 410);
    assert_eq!(gone.json().expect("status")["reason"], "Expired");
}

#[test]
fn errors_discovery_and_injected_failures() {
    let s = server(1000);
    let r = client::get(s.addr(), "/api/v1/namespaces/ns/pods/nope", T).expect("request");
    assert_eq!(r.status, 404);
    let st = r.json().expect("status");
    assert_eq!(
        st,
        json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
               "message": "pods \"nope\" not found", "reason": "NotFound",
               "details": {"name": "nope", "kind": "pods"}, "code": 404})
    );
    let r = client::get(s.addr(), "/apis/apps/v1/deployments", T).expect("request");
    assert_eq!(r.status, 404);
    assert_eq!(r.json().expect("status")["reason"], "NotFound");
    assert_eq!(client::get(s.addr(), "/version", T).expect("request").json().expect("json")["major"], "1");
    assert_eq!(client::get(s.addr(), "/api", T).expect("request").json().expect("json")["versions"], json!(["v1"]));
    let apis = client::get(s.addr(), "/apis", T).expect("request").json().expect("json");
    let groups: Vec<&str> =
        apis["groups"].as_array().into_iter().flatten().filter_map(|g| g["name"].as_str()).collect();
    assert_eq!(groups, ["apps", "events.k8s.io"], "{apis}");

    s.fail_next(2, 503);
    assert_eq!(client::get(s.addr(), "/api/v1/pods", T).expect("request").status, 503);
    assert_eq!(client::get(s.addr(), "/api/v1/pods", T).expect("request").status, 503);
    assert_eq!(client::get(s.addr(), "/api/v1/pods", T).expect("request").status, 200);

    // Patch errors: unknown content type 415, undecodable 400, inapplicable 422, unknown pod 404.
    s.create_pod(pod("a", json!({}), "n1")).expect("create");
    let patch = |ct: &str, body: &str| {
        client::request(s.addr(), "PATCH", "/api/v1/namespaces/ns/pods/a/status", Some(ct), body.as_bytes(), T)
            .expect("request")
    };
    assert_eq!(patch("application/json", "{}").status, 415);
    assert_eq!(patch("application/merge-patch+json", "{nope").status, 400);
    assert_eq!(
        patch("application/json-patch+json", r#"[{"op":"test","path":"/status/phase","value":"Failed"}]"#).status,
        422
    );
    let r = client::request(
        s.addr(),
        "PATCH",
        "/api/v1/namespaces/ns/pods/zz/status",
        Some("application/merge-patch+json"),
        b"{}",
        T,
    )
    .expect("request");
    assert_eq!(r.status, 404);
    // Apply needs a field manager.
    assert_eq!(patch("application/apply-patch+yaml", r#"{"status":{}}"#).status, 422);

    // PUT with a stale resourceVersion: 409.
    let mut cur = s.get_pod("ns", "a").expect("exists");
    cur["metadata"]["resourceVersion"] = json!("1");
    let r = client::request(
        s.addr(),
        "PUT",
        "/api/v1/namespaces/ns/pods/a",
        Some("application/json"),
        cur.to_string().as_bytes(),
        T,
    )
    .expect("request");
    assert_eq!(r.status, 409);
    assert_eq!(r.json().expect("status")["reason"], "Conflict");

    // Recorded requests carry method, path, query, content type and body.
    let reqs = s.requests();
    let last_patch = reqs.iter().rev().find(|r| r.method == "PATCH").expect("a patch was recorded");
    assert_eq!(last_patch.content_type.as_deref(), Some("application/apply-patch+yaml"));
    assert_eq!(last_patch.json(), Some(json!({"status": {}})));
}

/// With no resourceVersion: a synthetic ADDED for what exists, then the changes (a pod leaving
/// and re-entering the selector, another created, the first deleted); bookmarks when allowed.
fn watch_sends_what_exists_then_changes(s: &FakeApiServer) {
    let mut w = client::watch(
        s.addr(),
        "/api/v1/namespaces/ns/pods?watch=true&allowWatchBookmarks=true&labelSelector=app%3Dweb",
        T,
    )
    .expect("watch");
    assert_eq!(w.header_value("content-type"), Some("application/json"));
    assert_eq!(w.header_value("transfer-encoding"), Some("chunked"));
    // As kube-apiserver writes it: the type first, then the object.
    let line = w.next_line(T).expect("read").expect("event");
    assert!(line.starts_with(r#"{"type":"ADDED","object":{"#), "{line}");
    let e: serde_json::Value = serde_json::from_str(&line).expect("JSON");
    assert_eq!(e["type"], "ADDED");
    assert_eq!(e["object"]["kind"], "Pod");
    s.modify_pod("ns", "a", |p| p["status"]["phase"] = json!("Succeeded")).expect("modify");
    s.modify_pod("ns", "a", |p| p["metadata"]["labels"] = json!({"app": "other"})).expect("modify");
    s.modify_pod("ns", "a", |p| p["metadata"]["labels"] = json!({"app": "web"})).expect("modify");
    s.create_pod(pod("x", json!({"app": "db"}), "n1")).expect("create");
    s.delete_pod("ns", "a").expect("delete");
    let mut types = Vec::new();
    let mut bookmark = None;
    while types.len() < 4 {
        let e = w.next_event(T).expect("read").expect("event");
        if e["type"] == "BOOKMARK" {
            bookmark = Some(e);
            continue;
        }
        types.push(e["type"].as_str().expect("type").to_string());
    }
    assert_eq!(types, ["MODIFIED", "DELETED", "ADDED", "DELETED"]);
    let bm = match bookmark {
        Some(b) => b,
        None => loop {
            let e = w.next_event(T).expect("read").expect("event");
            if e["type"] == "BOOKMARK" {
                break e;
            }
        },
    };
    assert_eq!(bm["object"]["kind"], "Pod");
    assert!(bm["object"]["metadata"]["resourceVersion"].as_str().is_some_and(|r| !r.is_empty()));
}

/// From a resourceVersion: exactly the later changes; once the history expired, one ERROR event
/// with a 410 Status, then the end of the stream.
fn watch_resumes_from_a_version_until_it_expires(s: &FakeApiServer, rv0: u64) {
    // Resume from an RV: exactly the later changes.
    let mut w = client::watch(s.addr(), &format!("/api/v1/pods?watch=1&resourceVersion={rv0}"), T).expect("watch");
    let mut seen = Vec::new();
    for _ in 0..5 {
        let e = w.next_event(T).expect("read").expect("event");
        seen.push(format!(
            "{} {}",
            e["type"].as_str().unwrap_or(""),
            e["object"]["metadata"]["name"].as_str().unwrap_or("")
        ));
    }
    assert_eq!(seen, ["MODIFIED a", "MODIFIED a", "MODIFIED a", "ADDED x", "DELETED a"]);
    drop(w);

    // Too old: HTTP 200, one ERROR event with a 410 Status, then the end of the stream.
    s.expire_history();
    let mut w = client::watch(s.addr(), &format!("/api/v1/pods?watch=true&resourceVersion={rv0}"), T).expect("watch");
    let e = w.next_event(T).expect("read").expect("event");
    assert_eq!(e["type"], "ERROR");
    let floor = s.resource_version();
    assert_eq!(
        e["object"],
        json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
               "message": format!("too old resource version: {rv0} ({floor})"), "reason": "Expired", "code": 410})
    );
    assert!(w.next_event(T).expect("clean end").is_none());
}

#[test]
fn watch_protocol() {
    let s = server(100);
    s.create_pod(pod("a", json!({"app": "web"}), "n1")).expect("create");
    let rv0 = s.resource_version();

    watch_sends_what_exists_then_changes(&s);
    watch_resumes_from_a_version_until_it_expires(&s, rv0);

    // An unparseable RV fails the request itself.
    assert!(client::watch(s.addr(), "/api/v1/pods?watch=true&resourceVersion=abc", T).is_err());
    // Legacy watch path for one pod.
    s.create_pod(pod("solo", json!({}), "n1")).expect("create");
    let mut w = client::watch(s.addr(), "/api/v1/watch/namespaces/ns/pods/solo", T).expect("watch");
    let e = w.next_event(T).expect("read").expect("event");
    assert_eq!((e["type"].as_str(), e["object"]["metadata"]["name"].as_str()), (Some("ADDED"), Some("solo")));
    drop(w);

    // timeoutSeconds closes the stream cleanly.
    let started = Instant::now();
    let mut w =
        client::watch(s.addr(), "/api/v1/pods?watch=true&timeoutSeconds=1&resourceVersion=0", T).expect("watch");
    while w.next_event(T).expect("read").is_some() {}
    assert!(started.elapsed() >= Duration::from_millis(900));

    // Streaming list: ADDED..., then a BOOKMARK marking the end of the initial events.
    let mut w = client::watch(
        s.addr(),
        "/api/v1/pods?watch=true&sendInitialEvents=true&resourceVersionMatch=NotOlderThan&allowWatchBookmarks=true",
        T,
    )
    .expect("watch");
    let mut added = 0;
    let e = loop {
        let e = w.next_event(T).expect("read").expect("event");
        if e["type"] != "ADDED" {
            break e;
        }
        added += 1;
    };
    assert_eq!(added, 2, "x and solo");
    assert_eq!(e["type"], "BOOKMARK");
    assert_eq!(e["object"]["metadata"]["annotations"]["k8s.io/initial-events-end"], "true");

    // drop_watches cuts the connection mid-stream (no clean end).
    let before = s.watch_count();
    s.drop_watches();
    let mut ended_abruptly = false;
    for _ in 0..10 {
        match w.next_event(T) {
            Ok(Some(_)) => continue,
            Ok(None) => break,
            Err(_) => {
                ended_abruptly = true;
                break;
            }
        }
    }
    assert!(ended_abruptly, "a dropped watch must not end with the final chunk");
    assert_eq!(s.watch_count(), before);
}

#[test]
fn events_both_groups() {
    let s = server(1000);
    let core = json!({"metadata": {"generateName": "valet-"}, "reason": "SidecarQuit", "message": "m",
                      "involvedObject": {"kind": "Pod", "name": "a", "namespace": "ns"}, "type": "Normal"});
    let r = client::request(
        s.addr(),
        "POST",
        "/api/v1/namespaces/ns/events",
        Some("application/json"),
        core.to_string().as_bytes(),
        T,
    )
    .expect("request");
    assert_eq!(r.status, 201);
    let created = r.json().expect("json");
    assert!(created["metadata"]["name"].as_str().is_some_and(|n| n.starts_with("valet-") && n.len() == 11));
    assert!(created["metadata"]["uid"].is_string());
    assert!(created["metadata"]["resourceVersion"].is_string());
    let newer = json!({"apiVersion": "events.k8s.io/v1", "kind": "Event", "metadata": {"name": "a.1"},
                       "reason": "SidecarQuit", "action": "Quit", "regarding": {"kind": "Pod", "name": "a"},
                       "reportingController": "valet", "reportingInstance": "n1", "eventTime": "2025-01-01T00:00:00.000000Z"});
    let path = "/apis/events.k8s.io/v1/namespaces/ns/events";
    assert_eq!(
        client::request(s.addr(), "POST", path, Some("application/json"), newer.to_string().as_bytes(), T)
            .expect("request")
            .status,
        201
    );
    let r = client::request(
        s.addr(),
        "PATCH",
        &format!("{path}/a.1"),
        Some("application/merge-patch+json"),
        br#"{"series":{"count":2,"lastObservedTime":"2025-01-01T00:00:01.000000Z"}}"#,
        T,
    )
    .expect("request");
    assert_eq!(r.status, 200);
    assert_eq!(r.json().expect("json")["series"]["count"], 2);
    assert_eq!(s.events().len(), 2);
    let list = client::get(s.addr(), path, T).expect("request").json().expect("json");
    assert_eq!(list["kind"], "EventList");
    assert_eq!(list["apiVersion"], "events.k8s.io/v1");
    assert_eq!(list["items"].as_array().map(Vec::len), Some(1));
    let list = client::get(s.addr(), "/api/v1/events?fieldSelector=involvedObject.name%3Da", T)
        .expect("request")
        .json()
        .expect("json");
    assert_eq!(list["items"].as_array().map(Vec::len), Some(1));
}

#[test]
fn fault_status_refusals_are_worded_as_the_real_server_words_them() {
    let s = server(1000);
    s.create_pod(pod("a", json!({}), "n1")).expect("create");
    s.set_fault(Fault::Status { code: 429, verbs: Vec::new(), until: None });
    let r = client::get(s.addr(), "/api/v1/namespaces/ns/pods/a", T).expect("request");
    assert_eq!(r.status, 429);
    assert_eq!(r.header("retry-after"), Some("1"));
    assert_eq!(
        r.json().expect("status"),
        json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
               "message": "Too many requests, please try again later.", "reason": "TooManyRequests",
               "details": {"retryAfterSeconds": 1}, "code": 429})
    );
    // A watch is refused before its stream starts.
    let w = client::watch(s.addr(), "/api/v1/pods?watch=true", T);
    assert!(w.is_err_and(|e| e.to_string().contains("429")));

    // Only the verbs named: a PATCH fails with 500, a GET and a list are served.
    s.set_fault(Fault::Status { code: 500, verbs: vec!["patch"], until: None });
    let r = client::request(
        s.addr(),
        "PATCH",
        "/api/v1/namespaces/ns/pods/a/status",
        Some("application/merge-patch+json"),
        b"{}",
        T,
    )
    .expect("request");
    assert_eq!(r.status, 500);
    assert_eq!(r.header("retry-after"), None);
    let st = r.json().expect("status");
    assert_eq!((st["reason"].as_str(), st["code"].as_u64()), (Some("InternalError"), Some(500)));
    assert!(st["message"].as_str().is_some_and(|m| m.starts_with("Internal error occurred: ")), "{st}");
    assert_eq!(client::get(s.addr(), "/api/v1/namespaces/ns/pods/a", T).expect("request").status, 200);
    assert_eq!(client::get(s.addr(), "/api/v1/pods", T).expect("request").status, 200);
    assert_eq!(s.fault_stats().refused, 3);

    // A fault past its end refuses nothing; cleared faults neither.
    s.set_fault(Fault::Status { code: 503, verbs: Vec::new(), until: Some(Instant::now()) });
    assert_eq!(client::get(s.addr(), "/api/v1/pods", T).expect("request").status, 200);
    s.set_fault(Fault::Status { code: 503, verbs: Vec::new(), until: None });
    assert_eq!(client::get(s.addr(), "/api/v1/pods", T).expect("request").status, 503);
    s.clear_faults();
    assert_eq!(client::get(s.addr(), "/api/v1/pods", T).expect("request").status, 200);
    assert_eq!(s.fault_stats().refused, 4);
}

/// A stalled watch sends nothing, not even the bookmarks and the end its `timeoutSeconds` would
/// bring, while a watch started after the fault was cleared gets all of them: read up to its end,
/// it is the clock that shows the stalled one had its chance.
#[test]
fn a_stalled_watch_sends_nothing_and_stays_open() {
    let s = server(10);
    let rv = s.resource_version();
    let target = format!("/api/v1/pods?watch=true&allowWatchBookmarks=true&timeoutSeconds=1&resourceVersion={rv}");
    let mut open = client::watch(s.addr(), &target, T).expect("watch");
    s.set_fault(Fault::StallWatches);
    assert!(eventually(|| s.fault_stats().stalled_watches == 1), "{:?}", s.fault_stats());
    let mut stalled_from_start = client::watch(s.addr(), &target, T).expect("a stalled watch still answers 200");
    assert_eq!(stalled_from_start.header_value("transfer-encoding"), Some("chunked"));
    assert!(eventually(|| s.fault_stats().stalled_watches == 2), "{:?}", s.fault_stats());
    s.create_pod(pod("a", json!({}), "n1")).expect("create");
    s.clear_faults();
    let mut flowing = client::watch(s.addr(), &target, T).expect("watch");
    let mut lines = Vec::new();
    while let Some(e) = flowing.next_event(T).expect("read") {
        lines.push(e["type"].as_str().unwrap_or_default().to_owned());
    }
    assert_eq!(lines.first().map(String::as_str), Some("ADDED"), "{lines:?}");
    assert!(lines.iter().any(|l| l == "BOOKMARK"), "{lines:?}");
    // The stalled ones are still open: cut, they show the abort, not a clean end, and no line
    // sent after the stall (the one opened before may have had bookmarks until then).
    s.drop_watches();
    let mut before_stall = Vec::new();
    let end = loop {
        match open.next_event(T) {
            Ok(Some(e)) => before_stall.push(e),
            other => break other,
        }
    };
    assert!(end.is_err(), "cut, not ended: {end:?}");
    assert!(before_stall.iter().all(|e| e["type"] == "BOOKMARK"), "{before_stall:?}");
    let next = stalled_from_start.next_event(T);
    assert!(next.is_err(), "a watch stalled from its start sends not one line: {next:?}");
}

#[test]
fn a_hung_patch_is_held_until_its_client_gives_up() {
    use std::io::Write as _;
    let s = server(1000);
    s.create_pod(pod("a", json!({}), "n1")).expect("create");
    s.set_fault(Fault::HangPatches);
    let body = br#"{"status":{"phase":"Succeeded"}}"#;
    let mut held = Vec::new();
    for _ in 0..3 {
        let mut c = std::net::TcpStream::connect(s.addr()).expect("connect");
        write!(
            c,
            "PATCH /api/v1/namespaces/ns/pods/a/status HTTP/1.1\r\nHost: x\r\n\
             Content-Type: application/merge-patch+json\r\nContent-Length: {}\r\n\r\n",
            body.len()
        )
        .expect("head");
        c.write_all(body).expect("body");
        held.push(c);
    }
    assert!(eventually(|| s.fault_stats().patches_in_flight == 3), "{:?}", s.fault_stats());
    // Read, recorded, not applied; other verbs are served.
    assert_eq!(s.requests().iter().filter(|r| r.method == "PATCH").count(), 3);
    assert_eq!(s.get_pod("ns", "a").expect("pod")["status"]["phase"], "Running");
    assert_eq!(client::get(s.addr(), "/api/v1/namespaces/ns/pods/a", T).expect("request").status, 200);
    // Clearing the fault answers none of them; each ends when its client closes.
    s.clear_faults();
    let ok = client::request(
        s.addr(),
        "PATCH",
        "/api/v1/namespaces/ns/pods/a/status",
        Some("application/merge-patch+json"),
        body,
        T,
    )
    .expect("request");
    assert_eq!(ok.status, 200);
    held.pop();
    assert!(eventually(|| s.fault_stats().patches_in_flight == 2), "{:?}", s.fault_stats());
    held.clear();
    assert!(eventually(|| s.fault_stats().patches_in_flight == 0), "{:?}", s.fault_stats());
    let stats = s.fault_stats();
    assert_eq!((stats.hung, stats.peak_writes_open), (3, 4), "{stats:?}");
}

/// Polls until `f` holds, with a generous hang guard.
fn eventually(f: impl FnMut() -> bool) -> bool {
    valet_test_support::eventually(Duration::from_secs(10), f)
}

#[test]
fn hung_reads_answer_nothing_while_open_watches_go_on() {
    use std::io::{Read as _, Write as _};
    let s = server(1000);
    let mut open = client::watch(s.addr(), "/api/v1/pods?watch=true", T).expect("watch");
    s.set_fault(Fault::HangReads);
    let mut c = std::net::TcpStream::connect(s.addr()).expect("connect");
    c.write_all(b"GET /api/v1/pods HTTP/1.1\r\nHost: x\r\n\r\n").expect("request");
    assert!(eventually(|| s.fault_stats().hung == 1), "{:?}", s.fault_stats());
    c.set_nonblocking(true).expect("nonblocking");
    let read = c.read(&mut [0; 64]);
    assert!(read.as_ref().is_err_and(|e| e.kind() == std::io::ErrorKind::WouldBlock), "not a byte: {read:?}");
    // The watch opened before goes on; a write is served.
    s.create_pod(pod("a", json!({}), "n1")).expect("create");
    assert_eq!(open.next_event(T).expect("read").expect("event")["type"], "ADDED");
    s.clear_faults();
    assert_eq!(client::get(s.addr(), "/api/v1/pods", T).expect("request").status, 200);
}

#[test]
fn each_flow_is_counted_with_its_bytes_events_and_where_its_list_is_read() {
    use valet_sim::apiserver::{Flow, ListRead};
    let s = server(50);
    s.create_pod(pod("a", json!({"app": "web"}), "n1")).expect("create");
    let cached = client::get(s.addr(), "/api/v1/pods?resourceVersion=0", T).expect("list");
    let quorum = client::get(s.addr(), "/api/v1/namespaces/ns/pods?limit=500", T).expect("list");
    let mut w = client::watch(
        s.addr(),
        &format!("/api/v1/pods?watch=1&allowWatchBookmarks=true&resourceVersion={}", s.resource_version()),
        T,
    )
    .expect("watch");
    s.modify_pod("ns", "a", |p| p["status"]["phase"] = json!("Succeeded")).expect("modify");
    let mut lines = 0;
    loop {
        let e = w.next_event(T).expect("read").expect("event");
        lines += 1;
        if e["type"] == "MODIFIED" {
            break;
        }
    }
    let t = s.traffic();
    let flow = |verb: &str, resource: &str, read| Flow {
        user_agent: String::new(),
        verb: verb.into(),
        resource: resource.into(),
        read,
    };
    let list = |read| t.0.get(&flow("list", "pods", read)).copied().unwrap_or_default();
    assert_eq!(list(ListRead::WatchCache).requests, 1, "{t:?}");
    assert_eq!(list(ListRead::WatchCache).response_bytes, cached.body.len() as u64);
    assert_eq!(list(ListRead::Quorum).requests, 1, "{t:?}");
    assert_eq!(list(ListRead::Quorum).response_bytes, quorum.body.len() as u64);
    let watch = t.0.get(&flow("watch", "pods", ListRead::NotAList)).copied().expect("the watch is counted");
    assert_eq!(watch.requests, 1);
    assert_eq!(watch.watch_events, 1, "one MODIFIED: {watch:?}");
    // Bookmarks go on every 50 ms: one may be sent and counted before the client reads it.
    assert!(watch.watch_events + watch.bookmarks >= lines, "every line read is counted ({lines}): {watch:?}");
    assert!(watch.response_bytes > 0);
    // The kubelet's writes are counted as its status syncs; test control's are not.
    s.kubelet_handle().modify_pod("ns", "a", |p| p["status"]["podIP"] = json!("10.0.0.9")).expect("modify");
    let t = s.traffic().since(&t);
    let kubelet = t.total(|f| f.user_agent == "kubelet");
    assert_eq!(kubelet.requests, 2, "a get and a status patch: {t:?}");
    let patch = t.total(|f| f.user_agent == "kubelet" && f.resource == "pods/status");
    assert!(patch.request_bytes > 0 && patch.request_bytes < patch.response_bytes, "{patch:?}");
    assert_eq!(t.total(|f| f.verb == "create").requests, 0, "test control is not counted");
    // Over HTTP, with the user agent a client names.
    let r = client::request(s.addr(), "GET", "/debug/counters", None, b"", T).expect("counters");
    let served = r.json().expect("json");
    let rows = served.as_array().expect("an array");
    assert!(
        rows.iter().any(|r| r["verb"] == "list"
            && r["read"] == "quorum"
            && r["requests"] == 1
            && r["responseBytes"] == quorum.body.len()),
        "{served}"
    );
    let before = s.traffic();
    client::request(s.addr(), "GET", "/debug/counters", None, b"", T).expect("counters");
    assert_eq!(s.traffic().since(&before).total(|_| true).requests, 0, "reading the counters is not counted");
}
