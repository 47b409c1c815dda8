use super::*;

#[test]
fn held_apps_run_when_the_proxy_is_ready_and_the_condition_says_so() {
    let mut d = Drive::new(true);
    d.found(pod("Never", &[], &[("valet.dev/hold-app", "true")]));
    let fx = d.held(APP, 42, "report");
    assert!(has(&fx, &Effect::Count(Count::Hold)));
    assert!(has(&fx, &Effect::SetPace(Pace::Urgent)), "{fx:?}");
    assert!(
        fx.iter().any(|e| matches!(e, Effect::Pin { tgid: 42, container_rel } if !container_rel.is_empty())),
        "pinned when held, in its container: {fx:?}"
    );
    assert!(releases(&fx).is_empty());
    let fx = d.feed(Feedback::Probed { ready: false, detail: String::new() });
    assert!(writes(&fx).is_empty(), "no False before the first True: {fx:?}");
    // The kubelet's `ready` flag (at once for a container without a readinessProbe) is not
    // the proxy's answer: it releases nothing.
    let api = pod("Never", &[("istio-proxy", PROXY, running())], &[("valet.dev/hold-app", "true")]);
    let mut api = api;
    if let Some(s) = api.status.as_mut().and_then(|s| s.container_statuses.as_mut()) {
        s[0].ready = true;
    }
    assert!(releases(&d.pod(api)).is_empty());
    let fx = d.feed(Feedback::Probed { ready: true, detail: String::new() });
    assert_eq!(releases(&fx), [(42, "ready")]);
    assert_eq!(writes(&fx), [(true, "ProxyReady")]);
    assert!(has(&fx, &Effect::SetPace(Pace::Relaxed)), "{fx:?}");
    // A later app of the pod runs at once.
    assert_eq!(releases(&d.held(APP, 43, "report")), [(43, "ready")]);
}

#[test]
fn the_sandbox_sidecars_and_init_containers_are_never_held() {
    let mut d = Drive::new(true);
    d.found(pod("Never", &[], &[("valet.dev/hold-app", "true")]));
    assert_eq!(releases(&d.held(SANDBOX, 1, "pause")), [(1, "not_app")]);
    assert_eq!(releases(&d.held(PROXY, 2, "pilot-agent")), [(2, "not_app")]);
    // Unnamed by the runtime: a `pause` is the sandbox; once every app is known, any other
    // unnamed container is not an app either.
    d.feed(Feedback::Containers(vec![seen(APP2, None)]));
    assert_eq!(releases(&d.held(APP2, 3, "pause")), [(3, "not_app")]);
    assert_eq!(releases(&d.held(APP2, 4, "istio-iptables")), [(4, "not_app")], "every app's instance is known");
}

#[test]
fn a_hold_times_out_from_the_kernels_stop_time_and_fails_open() {
    let mut d = Drive::new(true);
    d.found(pod("Never", &[], &[("valet.dev/hold-app", "true"), ("valet.dev/hold-timeout", "2s")]));
    d.held(APP, 42, "report");
    assert!(releases(&d.after(1_750)).is_empty());
    let fx = d.after(250);
    assert_eq!(releases(&fx), [(42, "timeout")]);
    assert!(has(&fx, &Effect::Count(Count::FailOpen)));
    assert!(fx.iter().any(|e| matches!(e, Effect::Publish { reason: "HoldTimeout", warning: true, .. })));
    assert_eq!(writes(&fx), [(false, "HoldTimeout")]);
    // Later apps of a pod that failed open are not held either.
    assert_eq!(releases(&d.held(APP, 43, "report")), [(43, "timeout")]);
}

#[test]
fn adopted_processes_keep_their_original_deadline() {
    let mut d = Drive::new(true);
    let annotations = [("valet.dev/hold-app", "true"), ("valet.dev/hold-timeout", "10s")];
    d.found(pod("Never", &[], &annotations));
    // An earlier agent stopped this app 9.5 s ago; the sidecar's was stopped too.
    let fx = d.feed(Feedback::LeftHeld {
        found: vec![
            LeftHeld { tgid: 50, container_cgroup: APP, since: d.now - 9_500_000_000 },
            LeftHeld { tgid: 51, container_cgroup: PROXY, since: d.now - 9_500_000_000 },
        ],
        complete: true,
    });
    assert_eq!(releases(&fx), [(51, "not_app")]);
    assert!(has(&fx, &Effect::ClassifyExec { container_cgroup: APP, hold: false }), "its later execs run: {fx:?}");
    assert!(releases(&d.after(250)).is_empty());
    assert_eq!(releases(&d.after(250)), [(50, "timeout")], "10 s after it was stopped, not after adoption");
}

#[test]
fn a_search_for_left_held_apps_that_could_not_read_a_container_is_made_again() {
    let mut d = Drive::new(true);
    let search = Effect::FindLeftHeld { pod_rel: POD_REL.into() };
    let fx = d.found(pod("Never", &[], &[("valet.dev/hold-app", "true")]));
    assert!(has(&fx, &search), "{fx:?}");
    // An earlier agent's held app is in a cgroup that cannot be read now (its owner made it
    // unreadable): nothing found, and the search says it is not complete. Not again at once
    // (no loop of searches), and the proxy turns ready meanwhile.
    let fx = d.feed(Feedback::LeftHeld { found: Vec::new(), complete: false });
    assert!(!has(&fx, &search), "{fx:?}");
    d.feed(Feedback::Probed { ready: true, detail: String::new() });
    // A tick later the search is made again; the cgroup reads now, and the app is found and
    // released (its proxy is ready), not left stopped until its deadline.
    let fx = d.after(250);
    assert!(has(&fx, &search), "searched again: {fx:?}");
    let found = vec![LeftHeld { tgid: 70, container_cgroup: APP, since: d.now - SEC }];
    let fx = d.feed(Feedback::LeftHeld { found, complete: true });
    assert_eq!(releases(&fx), [(70, "ready")]);
    // Complete: never searched again.
    for _ in 0..4 {
        assert!(!has(&d.after(250), &search));
    }
}

#[test]
fn nothing_stays_frozen_when_the_pod_changes_under_a_hold() {
    type Change = fn(&mut Drive) -> Vec<Effect>;
    let annotations = [("valet.dev/hold-app", "true")];
    let cases: [(&str, Change, &str); 5] = [
        ("malformed annotation", |d| d.pod(pod("Never", &[], &[("valet.dev/hold-app", "yes please")])), "invalid_spec"),
        ("hold removed", |d| d.pod(pod("Never", &[], &[])), "not_held"),
        ("label removed or pod deleted", |d| d.s.removed(), "pod_gone"),
        ("agent shutdown", |d| d.s.shutdown(), "shutdown"),
        (
            "deletion started",
            |d| {
                let mut p = pod("Never", &[], &[("valet.dev/hold-app", "true")]);
                let mut json = serde_json::to_value(&p).unwrap_or_default();
                json["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
                p = fixtures::from_json(json);
                d.pod(p)
            },
            "deleting",
        ),
    ];
    for (what, change, reason) in cases {
        let mut d = Drive::new(true);
        d.found(pod("Never", &[], &annotations));
        d.held(APP, 42, "report");
        let fx = change(&mut d);
        assert_eq!(releases(&fx), [(42, reason)], "{what}: {fx:?}");
        assert!(releases(&d.after(200_000)).is_empty(), "{what}: released once");
    }
    // The malformed annotation is reported once, with the kernel told to stop holding.
    let mut d = Drive::new(true);
    d.found(pod("Never", &[], &annotations));
    let fx = d.pod(pod("Never", &[], &[("valet.dev/hold-app", "yes please")]));
    assert!(has(&fx, &Effect::Unwatch { pod_cgroup: POD_CG }), "{fx:?}");
    assert!(has(&fx, &Effect::StopProbe));
    assert!(fx.iter().any(|e| matches!(e, Effect::Publish { reason: "MalformedAnnotation", .. })));
    assert!(d.pod(pod("Never", &[], &[("valet.dev/hold-app", "yes please")])).is_empty(), "once");
}

#[test]
fn shutdown_also_releases_what_the_kernel_stopped_after_the_last_event() {
    let mut d = Drive::new(true);
    d.found(pod("Never", &[], &[("valet.dev/hold-app", "true")]));
    let fx = d.s.shutdown();
    assert!(has(&fx, &Effect::FindLeftHeld { pod_rel: POD_REL.into() }), "{fx:?}");
    let found = vec![LeftHeld { tgid: 60, container_cgroup: APP, since: d.now }];
    let fx = d.feed(Feedback::LeftHeld { found, complete: true });
    assert_eq!(releases(&fx), [(60, "shutdown")]);
    assert_eq!(releases(&d.held(APP, 61, "report")), [(61, "not_app")], "nothing is held any more");
}

// The held pods' prober repeats an unchanged answer once a second. To a pod with nothing left to
// decide it is nothing (no step, no effect); a changed answer, or a condition write to retry,
// still is.
#[test]
fn a_repeated_answer_to_a_settled_held_pod_decides_nothing() {
    let mut d = Drive::new(true);
    // Restarted: the pod shows its predecessor's True, so "not ready" is written.
    let mut p = pod("Never", &[], &[("valet.dev/hold-app", "true")]);
    let shown = json!({"type": condition::CONDITION_TYPE, "status": "True", "reason": "ProxyReady"});
    p.status.get_or_insert_with(Default::default).conditions = Some(vec![serde_json::from_value(shown).expect("c")]);
    d.found(p);
    d.held(APP, 42, "report");
    let not_ready = || Feedback::Probed { ready: false, detail: "istio-proxy answered 503".into() };
    let want =
        ProxyReady { ready: false, reason: "ProxyNotReady", message: "the sidecar proxy is not ready yet".into() };
    assert_eq!(writes(&d.feed(not_ready())), [(false, "ProxyNotReady")]);
    // The write fails: it is retried after its backoff, on a tick, whatever the answers say.
    d.feed(Feedback::ConditionWritten { want: want.clone(), error: Some("503".into()), version: None });
    assert!(!d.s.is_settled());
    assert!(d.feed(not_ready()).is_empty());
    let mut rewritten = Vec::new();
    for _ in 0..8 {
        rewritten.extend(writes(&d.after(250)));
    }
    assert_eq!(rewritten, [(false, "ProxyNotReady")], "the failed write retried on a tick");
    d.feed(Feedback::ConditionWritten { want, error: None, version: None });
    // Settled once a tick finds nothing to do.
    let mut ticks = 0;
    while !(d.after(250).is_empty() && d.s.is_settled()) {
        ticks += 1;
        assert!(ticks < 8, "never settled");
    }
    assert!(d.feed(not_ready()).is_empty());
    assert!(d.s.is_settled(), "the same answer unsettled the pod");
    // A changed answer releases.
    assert_eq!(releases(&d.feed(Feedback::Probed { ready: true, detail: String::new() })), [(42, "ready")]);
}

/// An app restarted after the proxy was last seen ready (its proxy may have crashed and been
/// restarted with it, not ready yet) waits for a ready answer that came after it stopped.
#[test]
fn a_restarted_app_waits_for_a_ready_answer_from_after_its_stop() {
    let mut d = Drive::new(true);
    d.found(pod("Never", &[], &[("valet.dev/hold-app", "true")]));
    assert_eq!(releases(&d.feed(Feedback::Probed { ready: true, detail: String::new() })), []);
    d.after(2000);
    let fx = d.held(APP, 44, "report");
    assert!(releases(&fx).is_empty(), "the last ready answer is older than the stop: {fx:?}");
    assert!(has(&fx, &Effect::SetPace(Pace::Urgent)), "probed at once: {fx:?}");
    // The restarted proxy is not ready: still held.
    assert!(releases(&d.feed(Feedback::Probed { ready: false, detail: "istio-proxy answered 503".into() })).is_empty());
    assert_eq!(releases(&d.feed(Feedback::Probed { ready: true, detail: String::new() })), [(44, "ready")]);
}

/// The same answer as the cached one still releases a process held after it, also once the pod
/// settled: the probe loop reports the first answer of a pod that turned held.
#[test]
fn a_ready_answer_like_the_last_one_releases_an_app_held_since() {
    let mut d = Drive::new(true);
    d.found(pod("Never", &[], &[("valet.dev/hold-app", "true")]));
    d.feed(Feedback::Probed { ready: true, detail: String::new() });
    d.after(2000);
    d.held(APP, 45, "report");
    let mut ticks = 0;
    while !(d.after(250).is_empty() && d.s.is_settled()) {
        ticks += 1;
        assert!(ticks < 8, "never settled");
    }
    assert_eq!(releases(&d.feed(Feedback::Probed { ready: true, detail: String::new() })), [(45, "ready")]);
}
