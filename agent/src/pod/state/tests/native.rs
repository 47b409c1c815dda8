//! Native sidecars (init containers with `restartPolicy: Always`): quit like regular ones once
//! every app has ended; a regular init container's end is never taken for the app's.

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
        let arm = d.s.quit_ahead().expect("armed on the app");
        assert_eq!(arm.container_cgroup, APP, "{policy}");
        assert_eq!(arm.on_success, vec![Endpoint { port: 15020, path: "/quitquitquit".into() }]);
        let fx = d.exit(APP, 0);
        assert_eq!(quits(&fx), [("istio-proxy".to_owned(), Some(id(PROXY)))], "{policy}: {fx:?}");
    }
}

#[test]
fn a_failed_app_under_on_failure_keeps_the_native_sidecar() {
    let mut d = Drive::new(true);
    found_native(&mut d, "OnFailure");
    let fx = d.exit(APP, 1);
    assert!(quits(&fx).is_empty(), "the kubelet restarts the app: {fx:?}");
    let fx = d.exit(APP, 0);
    assert!(quits(&fx).is_empty(), "the same instance's end is counted once: {fx:?}");
    // Its restarted instance ends well: now the sidecar goes.
    d.feed(Feedback::Containers(vec![seen(APP2, named("report"))]));
    let fx = d.exit(APP2, 0);
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
    // The app's end quits the instance that runs now.
    let fx = d.exit(APP, 0);
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

/// Native pods are never held: the kubelet starts the app only once the sidecar's startupProbe
/// passed.
#[test]
fn native_pods_are_not_held() {
    let plan = crate::pod::spec::plan(
        &fixtures::with_annotations(native_pod("Never", &[], &[]), &[("valet.dev/hold-app", "true")]),
        &SidecarDefaults::default(),
    )
    .expect("plan");
    assert!(!wants_hold(&plan));
}
