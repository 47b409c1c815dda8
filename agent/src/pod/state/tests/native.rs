//! Native sidecars (init containers with `restartPolicy: Always`): quit once the pod's status
//! reports every app's end (the kubelet has seen it: a native sidecar that exits while the kubelet
//! still sees the app running is restarted), last first; a regular init container's end is never
//! taken for the app's.

use super::*;

const INIT: u64 = 106;

/// Istio 1.27's native layout: `istio-validation` (runs to completion), `istio-proxy` (native),
/// then the app `report`. `statuses` and `init_statuses` as in [`pod`].
fn native_pod(policy: &str, statuses: &[(&str, u64, Value)], init_statuses: &[(&str, u64, Value)]) -> Pod {
    let list = |l: &[(&str, u64, Value)]| -> Vec<Value> {
        l.iter()
            .map(|(name, cg, state)| {
                json!({"name": name, "ready": false, "restartCount": 0, "image": "i", "imageID": "",
                       "containerID": format!("containerd://{}", id(*cg)), "state": state})
            })
            .collect()
    };
    fixtures::from_json(json!({
        "metadata": {"name": "job-n", "namespace": "batch", "uid": fixtures::UID,
                     "labels": {"valet.dev/enabled": "true"}},
        "spec": {"restartPolicy": policy, "nodeName": "n1",
            "initContainers": [
                {"name": "istio-validation", "image": "docker.io/istio/proxyv2:1.27.0"},
                {"name": "istio-proxy", "image": "docker.io/istio/proxyv2:1.27.0", "restartPolicy": "Always"}
            ],
            "containers": [{"name": "report", "image": "example/report:1"}]},
        "status": {"phase": "Running", "podIP": "10.1.2.3", "containerStatuses": list(statuses),
                   "initContainerStatuses": list(init_statuses)}
    }))
}

/// The pod found on the node with its containers named by the runtime's bundles, before the API
/// named any.
fn found_native(d: &mut Drive, policy: &str) {
    let fx = d.pod(native_pod(policy, &[], &[]));
    assert!(fx.contains(&Effect::FindPodCgroup), "{fx:?}");
    d.feed(Feedback::PodCgroup { rel: POD_REL.into(), id: POD_CG });
    d.feed(Feedback::Containers(vec![
        seen(SANDBOX, Some(RuntimeName::Sandbox)),
        seen(INIT, named("istio-validation")),
        seen(PROXY, named("istio-proxy")),
        seen(APP, named("report")),
    ]));
    d.feed(Feedback::Network { ok: true, detail: String::new() });
}

#[test]
fn the_apps_end_quits_the_native_sidecar_and_the_init_containers_end_does_not() {
    for policy in ["Never", "OnFailure"] {
        let mut d = Drive::new(true);
        found_native(&mut d, policy);
        // The regular init container ran to completion before the app: not the app's end.
        let fx = d.exit(INIT, 0);
        assert!(quits(&fx).is_empty(), "{policy}: {fx:?}");
        // Nothing is armed for the kernel's moment: the quit waits for the kubelet's report.
        assert_eq!(d.s.quit_ahead(), None, "{policy}");
        let fx = d.exit(APP, 0);
        assert!(quits(&fx).is_empty(), "{policy}: the kubelet has not reported the app's end: {fx:?}");
        let fx = d.pod(app_ended_reported(policy, APP, PROXY, 0));
        assert_eq!(quits(&fx), [("istio-proxy".to_owned(), Some(id(PROXY)))], "{policy}: {fx:?}");
    }
}

/// The runtime's record of the app's end comes before the API's report of it (about a second
/// sooner): the kernel's end has the record watched, and the record quits the native sidecar. A
/// record of another instance, or one never asked for, quits nothing.
#[test]
fn the_runtimes_record_of_the_apps_end_quits_the_native_sidecar_before_the_apis_report() {
    let mut d = Drive::new(true);
    found_native(&mut d, "Never");
    let fx = d.exit(APP, 0);
    assert!(quits(&fx).is_empty(), "{fx:?}");
    let watched: Vec<&Effect> = fx.iter().filter(|e| matches!(e, Effect::WatchRecord { .. })).collect();
    let want = Effect::WatchRecord { container_id: id(APP), pod_rel: Some(POD_REL.into()) };
    assert_eq!(watched, [&want], "{fx:?}");
    // A tick asks for no second watch.
    let fx = d.after(300);
    assert!(!fx.iter().any(|e| matches!(e, Effect::WatchRecord { .. })), "{fx:?}");
    // Another instance's record (an earlier one of the sidecar's): not the app's end.
    let fx = d.feed(Feedback::Recorded { container_id: id(PROXY) });
    assert!(quits(&fx).is_empty(), "{fx:?}");
    let fx = d.feed(Feedback::Recorded { container_id: id(APP) });
    assert_eq!(quits(&fx), [("istio-proxy".to_owned(), Some(id(PROXY)))], "{fx:?}");
    // The API's report that follows quits nothing more.
    let fx = d.pod(app_ended_reported("Never", APP, PROXY, 0));
    assert!(quits(&fx).is_empty(), "{fx:?}");
}

/// An app the kubelet restarts is no end: its record is never watched, and a record of it that
/// comes anyway quits nothing.
#[test]
fn a_restarted_apps_record_quits_nothing() {
    let mut d = Drive::new(true);
    found_native(&mut d, "OnFailure");
    let fx = d.exit(APP, 3);
    assert!(!fx.iter().any(|e| matches!(e, Effect::WatchRecord { .. })), "{fx:?}");
    let fx = d.feed(Feedback::Recorded { container_id: id(APP) });
    assert!(quits(&fx).is_empty(), "{fx:?}");
}

/// The pod as the API shows it once the kubelet reported the app's end (`code`), the proxy
/// instance `proxy` running.
fn app_ended_reported(policy: &str, app: u64, proxy: u64, code: i32) -> Pod {
    native_pod(
        policy,
        &[("report", app, terminated(code))],
        &[("istio-validation", INIT, terminated(0)), ("istio-proxy", proxy, running())],
    )
}

#[test]
fn a_failed_app_under_on_failure_keeps_the_native_sidecar() {
    let mut d = Drive::new(true);
    found_native(&mut d, "OnFailure");
    let fx = d.exit(APP, 1);
    assert!(quits(&fx).is_empty(), "the kubelet restarts the app: {fx:?}");
    let fx = d.exit(APP, 0);
    assert!(quits(&fx).is_empty(), "the same instance's end is counted once: {fx:?}");
    // Its restarted instance ends well: once the kubelet reported that, the sidecar goes.
    d.feed(Feedback::Containers(vec![seen(APP2, named("report"))]));
    let fx = d.exit(APP2, 0);
    assert!(quits(&fx).is_empty(), "{fx:?}");
    let fx = d.pod(app_ended_reported("OnFailure", APP2, PROXY, 0));
    assert_eq!(quits(&fx), [("istio-proxy".to_owned(), Some(id(PROXY)))], "{fx:?}");
}

#[test]
fn a_native_sidecar_restarted_while_the_app_runs_is_not_quit() {
    let mut d = Drive::new(true);
    found_native(&mut d, "Never");
    d.exit(INIT, 0);
    // The proxy crashes; the kubelet restarts it (a new instance) while the app runs.
    let fx = d.exit(PROXY, 1);
    assert!(quits(&fx).is_empty(), "{fx:?}");
    d.feed(Feedback::Containers(vec![seen(PROXY2, named("istio-proxy"))]));
    let fx = d.pod(native_pod(
        "Never",
        &[("report", APP, running())],
        &[("istio-validation", INIT, terminated(0)), ("istio-proxy", PROXY2, running())],
    ));
    assert!(quits(&fx).is_empty(), "{fx:?}");
    // The app's end, once reported, quits the instance that runs now.
    assert!(quits(&d.exit(APP, 0)).is_empty());
    let fx = d.pod(app_ended_reported("Never", APP, PROXY2, 0));
    assert_eq!(quits(&fx), [("istio-proxy".to_owned(), Some(id(PROXY2)))], "{fx:?}");
}

/// The kubelet saw the app's end first (its report came before the kernel's event reached the
/// agent, or the agent was busy): the proxy, which the kubelet is draining, is quit all the same.
#[test]
fn the_kubelets_report_first_still_quits_the_draining_sidecar() {
    let mut d = Drive::new(true);
    found_native(&mut d, "Never");
    let fx = d.pod(native_pod(
        "Never",
        &[("report", APP, terminated(0))],
        &[("istio-validation", INIT, terminated(0)), ("istio-proxy", PROXY, running())],
    ));
    assert_eq!(quits(&fx), [("istio-proxy".to_owned(), Some(id(PROXY)))], "{fx:?}");
    // Then the kernel's event: no second quit.
    assert!(quits(&d.exit(APP, 0)).is_empty());
}

#[test]
fn a_native_sidecar_the_kubelet_stopped_first_is_not_quit() {
    let mut d = Drive::new(true);
    found_native(&mut d, "Never");
    d.exit(INIT, 0);
    let fx = d.pod(native_pod(
        "Never",
        &[("report", APP, terminated(0))],
        &[("istio-validation", INIT, terminated(0)), ("istio-proxy", PROXY, terminated(0))],
    ));
    assert!(quits(&fx).is_empty(), "{fx:?}");
    // Every container has ended: the node's resources for the pod go.
    assert!(has(&fx, &Effect::CloseNetwork), "{fx:?}");
    let mut done = native_pod(
        "Never",
        &[("report", APP, terminated(0))],
        &[("istio-validation", INIT, terminated(0)), ("istio-proxy", PROXY, terminated(0))],
    );
    if let Some(st) = done.status.as_mut() {
        st.phase = Some("Succeeded".into());
    }
    let fx = d.pod(done);
    assert!(quits(&fx).is_empty(), "{fx:?}");
}

/// A native proxy with a startupProbe holds the apps itself (the kubelet starts them once the
/// probe passed): valet does not, and says so; without one (the kubelet starts the apps as soon as
/// the proxy started) valet holds them.
#[test]
fn native_pods_are_held_only_without_a_startup_probe() {
    let asking = |probe: bool| {
        let mut pod = fixtures::with_annotations(native_pod("Never", &[], &[]), &[("valet.dev/hold-app", "true")]);
        if probe {
            let init = pod.spec.as_mut().and_then(|s| s.init_containers.as_mut()).expect("init containers");
            init[1].startup_probe = Some(
                serde_json::from_value(json!({"httpGet": {"path": "/healthz/ready", "port": 15021}})).expect("probe"),
            );
        }
        pod
    };
    let plan = |pod: &Pod| crate::pod::spec::plan(pod, &SidecarDefaults::default()).expect("plan");
    assert!(!wants_hold(&plan(&asking(true))));
    assert!(wants_hold(&plan(&asking(false))));
    let mut d = Drive::new(true);
    let fx = d.pod(asking(true));
    assert!(
        fx.iter().any(|e| matches!(e, Effect::Publish { warning: false, reason: "HoldNotNeeded", note, .. } if note.contains("startupProbe"))),
        "{fx:?}"
    );
    // Said once.
    let fx = d.pod(asking(true));
    assert!(!fx.iter().any(|e| matches!(e, Effect::Publish { reason: "HoldNotNeeded", .. })), "{fx:?}");
}

/// A regular proxy beside a native helper (a log shipper): the kubelet starts the apps after the
/// helper, never after the proxy, so the hold is valet's to make.
#[test]
fn a_regular_proxy_beside_a_native_helper_is_held() {
    let pod = fixtures::from_json(json!({
        "metadata": {"name": "job-h", "namespace": "batch", "uid": fixtures::UID,
                     "labels": {"valet.dev/enabled": "true"}, "annotations": {"valet.dev/hold-app": "true"}},
        "spec": {"restartPolicy": "Never", "nodeName": "n1",
            "initContainers": [{"name": "logs", "image": "fluent/fluent-bit:3.0", "restartPolicy": "Always",
                                "startupProbe": {"exec": {"command": ["true"]}}}],
            "containers": [{"name": "report", "image": "example/report:1"},
                           {"name": "istio-proxy", "image": "docker.io/istio/proxyv2:1.22.0"}]},
    }));
    let plan = crate::pod::spec::plan(&pod, &SidecarDefaults::default()).expect("plan");
    assert!(wants_hold(&plan), "{plan:?}");
}

/// Two native sidecars valet quits: the one declared last goes first, the other once it has exited.
#[test]
fn native_sidecars_are_quit_last_first() {
    let two = |proxy: Value, logs: Value| {
        fixtures::with_annotations(
            fixtures::from_json(json!({
                "metadata": {"name": "job-n", "namespace": "batch", "uid": fixtures::UID,
                             "labels": {"valet.dev/enabled": "true"}},
                "spec": {"restartPolicy": "Never", "nodeName": "n1",
                    "initContainers": [
                        {"name": "istio-proxy", "image": "docker.io/istio/proxyv2:1.27.0", "restartPolicy": "Always"},
                        {"name": "logs", "image": "fluent/fluent-bit:3.0", "restartPolicy": "Always"}
                    ],
                    "containers": [{"name": "report", "image": "example/report:1"}]},
                "status": {"phase": "Running", "podIP": "10.1.2.3",
                    "containerStatuses": [{"name": "report", "ready": false, "restartCount": 0, "image": "i", "imageID": "",
                        "containerID": format!("containerd://{}", id(APP)), "state": terminated(0)}],
                    "initContainerStatuses": [
                        {"name": "istio-proxy", "ready": false, "restartCount": 0, "image": "i", "imageID": "",
                         "containerID": format!("containerd://{}", id(PROXY)), "state": proxy},
                        {"name": "logs", "ready": false, "restartCount": 0, "image": "i", "imageID": "",
                         "containerID": format!("containerd://{}", id(PROXY2)), "state": logs}]}
            })),
            &[("valet.dev/sidecars", "istio-proxy,logs"), ("valet.dev/sidecar-kind.logs", "signal")],
        )
    };
    let mut d = Drive::new(true);
    d.pod(two(running(), running()));
    // The signal quit is decided here already, and goes once the containers are known.
    d.feed(Feedback::PodCgroup { rel: POD_REL.into(), id: POD_CG });
    let fx = d.feed(Feedback::Containers(vec![
        seen(SANDBOX, Some(RuntimeName::Sandbox)),
        seen(PROXY, named("istio-proxy")),
        seen(PROXY2, named("logs")),
        seen(APP, named("report")),
    ]));
    assert_eq!(signals(&fx), [("logs".to_owned(), libc::SIGTERM)], "the last one first: {fx:?}");
    assert!(quits(&fx).is_empty(), "istio-proxy waits for its turn: {fx:?}");
    let fx = d.exit(PROXY2, 0);
    assert_eq!(quits(&fx), [("istio-proxy".to_owned(), Some(id(PROXY)))], "its turn: {fx:?}");
}
