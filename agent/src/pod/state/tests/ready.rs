use super::*;

fn not_ready() -> ProxyReady {
    ProxyReady { ready: false, reason: "ProxyNotReady", message: "the sidecar proxy is not ready yet".into() }
}

fn ready() -> ProxyReady {
    ProxyReady { ready: true, reason: "ProxyReady", message: "the sidecar proxy reports ready".into() }
}

fn probed(ready: bool) -> Feedback {
    Feedback::Probed { ready, detail: String::new() }
}

#[test]
fn condition_writes_never_overtake_each_other() {
    let mut d = Drive::new(true);
    d.found(pod("Never", &[], &[]));
    assert_eq!(writes(&d.feed(probed(true))), [(true, "ProxyReady")]);
    // Not ready while the first write is in flight: nothing until it is answered.
    assert!(writes(&d.feed(probed(false))).is_empty());
    assert!(writes(&d.after(250)).is_empty());
    let fx = d.feed(Feedback::ConditionWritten { want: ready(), error: None, version: None });
    assert_eq!(writes(&fx), [(false, "ProxyNotReady")], "then the newest state: {fx:?}");
    assert!(writes(&d.feed(probed(true))).is_empty(), "one write at a time");
    let fx = d.feed(Feedback::ConditionWritten { want: not_ready(), error: None, version: None });
    assert_eq!(writes(&fx), [(true, "ProxyReady")], "then the newest state: {fx:?}");
    // A failed write is retried after a backoff, not in a loop: not at the next tick, nor at a
    // probe result before the backoff's end; at the first tick after it.
    let want = ready();
    let fx = d.feed(Feedback::ConditionWritten { want: want.clone(), error: Some("500".into()), version: None });
    assert!(writes(&fx).is_empty());
    assert!(has(&fx, &Effect::Count(Count::ConditionPatch { ok: false })));
    assert!(writes(&d.after(250)).is_empty(), "no write at the next tick");
    assert!(writes(&d.feed(Feedback::Probed { ready: true, detail: String::new() })).is_empty());
    assert!(writes(&d.after(500)).is_empty());
    assert_eq!(writes(&d.after(250)), [(true, "ProxyReady")], "1 s after the failure");
    // The next failure in a row waits twice as long; a success starts over.
    d.feed(Feedback::ConditionWritten { want: want.clone(), error: Some("500".into()), version: None });
    assert!(writes(&d.after(1000)).is_empty());
    assert_eq!(writes(&d.after(1000)), [(true, "ProxyReady")], "2 s after the second failure");
    d.feed(Feedback::ConditionWritten { want, error: None, version: None });
    assert!(writes(&d.after(30_000)).is_empty(), "written: nothing more to do");
}

#[test]
fn the_condition_tells_the_truth_after_the_work_is_done() {
    let mut d = Drive::new(true);
    d.found(pod("Never", &[], &[]));
    d.feed(probed(true));
    // A short Job: the app ends while "ready" is being written, then the proxy is quit and its
    // last probe result (sent before the probe stopped) says not ready.
    d.exit(APP, 0);
    assert!(writes(&d.feed(probed(false))).is_empty(), "one write at a time");
    let fx = d.feed(Feedback::ConditionWritten { want: ready(), error: None, version: None });
    assert!(writes(&fx).is_empty(), "the proxy going away after its quit never flips it back: {fx:?}");
    assert!(writes(&d.after(30_000)).is_empty());
}

/// A readiness gate reads an absent condition as False: the agent writes no False before the
/// condition's first True, held or not, however long the proxy stays not ready and whatever the
/// pod's updates.
#[test]
fn no_false_is_written_before_the_first_true() {
    for hold in [false, true] {
        let annotations: &[(&str, &str)] = if hold { &[("valet.dev/hold-app", "true")] } else { &[] };
        let mut d = Drive::new(true);
        let mut fx = d.found(pod("Never", &[], annotations));
        if hold {
            fx.extend(d.held(APP, 42, "report"));
        }
        fx.extend(d.feed(probed(false)));
        let running = [("report", APP, running()), ("istio-proxy", PROXY, running())];
        fx.extend(d.pod(pod("Never", &running, annotations)));
        for _ in 0..8 {
            fx.extend(d.after(250));
            fx.extend(d.feed(probed(false)));
        }
        assert!(writes(&fx).is_empty(), "hold={hold}: {fx:?}");
        assert!(releases(&fx).is_empty(), "hold={hold}: still held: {fx:?}");
        // The first True is the first write.
        assert_eq!(writes(&d.feed(probed(true))), [(true, "ProxyReady")], "hold={hold}");
    }
}

/// Once the condition said True, a proxy gone unready is said: a gate needs that transition.
/// And so is one a predecessor's True shows on the pod (an agent restarted in between).
#[test]
fn a_false_after_a_true_is_written() {
    let mut d = Drive::new(true);
    d.found(pod("Never", &[], &[]));
    assert_eq!(writes(&d.feed(probed(true))), [(true, "ProxyReady")]);
    d.feed(Feedback::ConditionWritten { want: ready(), error: None, version: None });
    assert_eq!(writes(&d.feed(probed(false))), [(false, "ProxyNotReady")]);
    d.feed(Feedback::ConditionWritten { want: not_ready(), error: None, version: None });
    assert!(writes(&d.after(250)).is_empty(), "written once");
    assert_eq!(writes(&d.feed(probed(true))), [(true, "ProxyReady")], "and back");

    let mut d = Drive::new(true);
    d.found(shown("7", "True", "ProxyReady"));
    assert_eq!(writes(&d.feed(probed(false))), [(false, "ProxyNotReady")], "a predecessor's True");
}

/// A labelled Job's whole life on the normal path, held or not: one write, its True.
#[test]
fn a_job_costs_one_condition_write() {
    for hold in [false, true] {
        let annotations: &[(&str, &str)] = if hold { &[("valet.dev/hold-app", "true")] } else { &[] };
        let mut d = Drive::new(true);
        let mut fx = d.found(pod("Never", &[], annotations));
        fx.extend(d.feed(probed(false)));
        if hold {
            fx.extend(d.held(APP, 42, "report"));
        }
        fx.extend(d.after(250));
        fx.extend(d.feed(probed(false)));
        let ready_fx = d.feed(probed(true));
        if hold {
            assert_eq!(releases(&ready_fx), [(42, "ready")]);
        }
        fx.extend(ready_fx);
        fx.extend(d.feed(Feedback::ConditionWritten { want: ready(), error: None, version: Some("5".into()) }));
        fx.extend(d.pod(shown("6", "True", "ProxyReady")));
        fx.extend(d.after(250));
        // The app's end quits the proxy; the proxy going away is not written.
        fx.extend(d.exit(APP, 0));
        fx.extend(d.feed(Feedback::QuitDone { sidecar: "istio-proxy".into(), outcome: accepted() }));
        fx.extend(d.feed(probed(false)));
        fx.extend(d.exit(PROXY, 0));
        fx.extend(d.after(30_000));
        assert_eq!(writes(&fx), [(true, "ProxyReady")], "hold={hold}: {fx:?}");
    }
}

/// The pod as the watch shows it at `version`, with the valet condition `status`/`reason`.
fn shown(version: &str, status: &str, reason: &str) -> Pod {
    let mut p = pod("Never", &[], &[]);
    p.metadata.resource_version = Some(version.into());
    let condition = json!({"type": condition::CONDITION_TYPE, "status": status, "reason": reason});
    p.status.get_or_insert_with(Default::default).conditions =
        Some(vec![serde_json::from_value(condition).expect("c")]);
    p
}

#[test]
fn a_condition_written_over_after_our_write_is_written_again() {
    let mut d = Drive::new(true);
    d.found(pod("Never", &[], &[]));
    assert_eq!(writes(&d.feed(Feedback::Probed { ready: true, detail: String::new() })), [(true, "ProxyReady")]);
    let ready = ProxyReady { ready: true, reason: "ProxyReady", message: "the sidecar proxy reports ready".into() };
    assert!(
        writes(&d.feed(Feedback::ConditionWritten { want: ready, error: None, version: Some("10".into()) })).is_empty()
    );
    // A pod version from before our write still shows the old condition: not ours to correct.
    assert!(writes(&d.pod(shown("9", "False", "ProxyNotReady"))).is_empty(), "older than our write");
    assert!(writes(&d.pod(shown("10", "True", "ProxyReady"))).is_empty(), "our write");
    // A predecessor's late write lands after ours: the pod says not ready while the proxy is.
    assert_eq!(writes(&d.pod(shown("12", "False", "ProxyNotReady"))), [(true, "ProxyReady")], "written over");
    // Only one write at a time, however many versions show it.
    assert!(writes(&d.pod(shown("13", "False", "ProxyNotReady"))).is_empty(), "one write at a time");
}

#[test]
fn pod_versions_compare_as_numbers_and_otherwise_only_when_equal() {
    assert!(condition::at_or_after("10", "9"));
    assert!(condition::at_or_after("10", "10"));
    assert!(!condition::at_or_after("9", "10"));
    assert!(condition::at_or_after("abc", "abc"));
    assert!(!condition::at_or_after("abd", "abc"));
}
