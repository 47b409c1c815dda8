use super::*;

#[test]
fn a_found_pod_is_watched_named_opened_and_probed() {
    let mut d = Drive::new(true);
    let fx = d.found(pod("Never", &[], &[]));
    assert!(has(&fx, &watch(true, false)), "{fx:?}");
    assert!(has(&fx, &Effect::ScanContainers { pod_rel: POD_REL.into(), adopt: true }));
    assert!(has(&fx, &Effect::OpenNetwork { pod_rel: POD_REL.into() }));
    assert!(fx.iter().any(|e| matches!(e, Effect::StartProbe { pace: Pace::Normal, .. })), "{fx:?}");
    assert!(
        !fx.iter().any(|e| matches!(e, Effect::ClassifyExec { .. } | Effect::FindLeftHeld { .. })),
        "not held: {fx:?}"
    );
    // Nothing new: nothing asked.
    let again = d.after(250);
    assert!(again.is_empty(), "idempotent: {again:?}");
}

#[test]
fn a_host_pid_pod_takes_its_ends_from_the_api_and_is_never_held() {
    let mut d = Drive::new(true);
    let mut p = pod("Never", &[], &[("valet.dev/hold-app", "true")]);
    p.spec.as_mut().expect("spec").host_pid = Some(true);
    let fx = d.found(p);
    assert!(has(&fx, &watch(false, false)), "{fx:?}");
    assert!(has(&fx, &Effect::ScanContainers { pod_rel: POD_REL.into(), adopt: false }), "{fx:?}");
    assert!(
        !fx.iter().any(|e| matches!(e, Effect::ClassifyExec { .. } | Effect::FindLeftHeld { .. })),
        "not held: {fx:?}"
    );
    // The API's word ends the app, and the proxy is quit on it.
    let mut done = pod("Never", &[("report", APP, terminated(0)), ("istio-proxy", PROXY, running())], &[]);
    done.spec.as_mut().expect("spec").host_pid = Some(true);
    let fx = d.pod(done);
    assert!(fx.iter().any(|e| matches!(e, Effect::Quit { .. })), "{fx:?}");
}

#[test]
fn a_held_pod_classifies_known_containers_before_they_exec() {
    let mut d = Drive::new(true);
    let fx = d.found(pod("Never", &[], &[("valet.dev/hold-app", "true")]));
    assert!(has(&fx, &watch(true, true)), "{fx:?}");
    assert!(has(&fx, &Effect::FindLeftHeld { pod_rel: POD_REL.into() }));
    for (cg, hold) in [(SANDBOX, false), (APP, true), (PROXY, false)] {
        assert!(has(&fx, &Effect::ClassifyExec { container_cgroup: cg, hold }), "{cg} {hold}: {fx:?}");
    }
    // A container the runtime did not name is judged at exec (held by default).
    let fx = d.feed(Feedback::Containers(vec![seen(APP2, None)]));
    assert!(!fx.iter().any(|e| matches!(e, Effect::ClassifyExec { container_cgroup: APP2, .. })), "{fx:?}");
}

#[test]
fn pods_valet_leaves_alone_are_counted_once() {
    let with = |policy: &str, a: &[(&str, &str)]| pod(policy, &[], a);
    let mut d = Drive::new(true);
    let fx = d.pod(with("Always", &[]));
    assert!(has(&fx, &Effect::Count(Count::Skip(SkipReason::RestartAlways))), "{fx:?}");
    assert!(!d.pod(with("Always", &[])).iter().any(|e| matches!(e, Effect::Count(_))));
    let mut d = Drive::new(true);
    let mut p = with("Never", &[]);
    if let Some(s) = p.spec.as_mut() {
        s.host_network = Some(true);
    }
    let fx = d.pod(p);
    assert!(has(&fx, &Effect::Count(Count::Skip(SkipReason::HostNetwork))), "{fx:?}");
    assert!(!fx.contains(&Effect::FindPodCgroup), "a hostNetwork pod's loopback is the node's");
}

// A pod whose plan goes (a malformed annotation) lets go of everything; when its plan comes
// back it is watched again from scratch, and a pod whose work was done before stays done.
#[test]
fn a_pod_that_stood_down_is_watched_again_from_scratch_when_its_plan_comes_back() {
    let held = [("valet.dev/hold-app", "true")];
    let broken = [("valet.dev/hold-app", "yes please")];
    let mut d = Drive::new(true);
    d.found(pod("Never", &[], &held));
    assert!(d.s.holding());
    let fx = d.pod(pod("Never", &[], &broken));
    assert!(has(&fx, &Effect::Unwatch { pod_cgroup: POD_CG }) && has(&fx, &Effect::CloseNetwork), "{fx:?}");
    assert!(d.s.is_released() && !d.s.holding());
    assert_eq!(releases(&d.held(APP, 40, "report")), [(40, "not_app")], "no plan: nothing held");
    let fx = d.pod(pod("Never", &[], &held));
    assert!(has(&fx, &watch(true, true)), "watched again: {fx:?}");
    assert!(has(&fx, &Effect::FindLeftHeld { pod_rel: POD_REL.into() }), "{fx:?}");
    assert!(has(&fx, &Effect::OpenNetwork { pod_rel: POD_REL.into() }), "{fx:?}");
    assert!(fx.iter().any(|e| matches!(e, Effect::StartProbe { .. })), "{fx:?}");
    assert!(d.s.holding() && !d.s.is_released());
    assert!(releases(&d.held(APP, 41, "report")).is_empty(), "held again");

    // Done, stood down, back: watched (its sidecar's end still matters), never probed, opened
    // or held again, and its sidecar is not quit twice.
    let mut d = Drive::new(true);
    d.found(pod("Never", &[], &held));
    assert_eq!(quits(&d.exit(APP, 0)).len(), 1);
    d.pod(pod("Never", &[], &broken));
    assert!(d.s.is_released());
    let fx = d.pod(pod("Never", &[], &held));
    assert!(fx.iter().any(|e| matches!(e, Effect::Watch { .. })), "{fx:?}");
    assert!(
        !fx.iter().any(|e| matches!(e, Effect::OpenNetwork { .. } | Effect::StartProbe { .. })),
        "the work is done: {fx:?}"
    );
    assert!(quits(&fx).is_empty(), "{fx:?}");
    assert!(!d.s.holding() && !d.s.is_released());
    assert_eq!(releases(&d.held(APP, 42, "report")), [(42, "not_app")], "nothing is held once the work is done");
}
