use super::*;

#[test]
fn condition_writes_never_overtake_each_other() {
    let mut d = Drive::new(true);
    d.found(pod("Never", &[], &[]));
    let not_ready = d.feed(Feedback::Probed { ready: false, detail: String::new() });
    assert_eq!(writes(&not_ready), [(false, "ProxyNotReady")]);
    // Ready while the first write is in flight: nothing until it is answered.
    assert!(writes(&d.feed(Feedback::Probed { ready: true, detail: String::new() })).is_empty());
    assert!(writes(&d.after(250)).is_empty());
    let want =
        ProxyReady { ready: false, reason: "ProxyNotReady", message: "the sidecar proxy is not ready yet".into() };
    let fx = d.feed(Feedback::ConditionWritten { want, error: None, version: None });
    assert_eq!(writes(&fx), [(true, "ProxyReady")], "then the newest state: {fx:?}");
    // A failed write is retried after a backoff, not in a loop: not at the next tick, nor at a
    // probe result before the backoff's end; at the first tick after it.
    let want = ProxyReady { ready: true, reason: "ProxyReady", message: "the sidecar proxy reports ready".into() };
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
    d.feed(Feedback::Probed { ready: false, detail: String::new() });
    // A short Job: the app ends while "not ready" is being written, then the last probe
    // result (sent before the probe stopped) says ready.
    d.exit(APP, 0);
    assert!(writes(&d.feed(Feedback::Probed { ready: true, detail: String::new() })).is_empty(), "one write at a time");
    let want =
        ProxyReady { ready: false, reason: "ProxyNotReady", message: "the sidecar proxy is not ready yet".into() };
    assert_eq!(
        writes(&d.feed(Feedback::ConditionWritten { want, error: None, version: None })),
        [(true, "ProxyReady")]
    );
    let ready = ProxyReady { ready: true, reason: "ProxyReady", message: "the sidecar proxy reports ready".into() };
    d.feed(Feedback::ConditionWritten { want: ready, error: None, version: None });
    // The proxy going away after its quit never flips it back.
    assert!(writes(&d.feed(Feedback::Probed { ready: false, detail: String::new() })).is_empty());
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
