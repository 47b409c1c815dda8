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
    let fx = d.feed(Feedback::ConditionWritten { want, error: None });
    assert_eq!(writes(&fx), [(true, "ProxyReady")], "then the newest state: {fx:?}");
    // A failed write is retried after a backoff, not in a loop: not at the next tick, nor at a
    // probe result before the backoff's end; at the first tick after it.
    let want = ProxyReady { ready: true, reason: "ProxyReady", message: "the sidecar proxy reports ready".into() };
    let fx = d.feed(Feedback::ConditionWritten { want: want.clone(), error: Some("500".into()) });
    assert!(writes(&fx).is_empty());
    assert!(has(&fx, &Effect::Count(Count::ConditionPatch { ok: false })));
    assert!(writes(&d.after(250)).is_empty(), "no write at the next tick");
    assert!(writes(&d.feed(Feedback::Probed { ready: true, detail: String::new() })).is_empty());
    assert!(writes(&d.after(500)).is_empty());
    assert_eq!(writes(&d.after(250)), [(true, "ProxyReady")], "1 s after the failure");
    // The next failure in a row waits twice as long; a success starts over.
    d.feed(Feedback::ConditionWritten { want: want.clone(), error: Some("500".into()) });
    assert!(writes(&d.after(1000)).is_empty());
    assert_eq!(writes(&d.after(1000)), [(true, "ProxyReady")], "2 s after the second failure");
    d.feed(Feedback::ConditionWritten { want, error: None });
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
    assert_eq!(writes(&d.feed(Feedback::ConditionWritten { want, error: None })), [(true, "ProxyReady")]);
    let ready = ProxyReady { ready: true, reason: "ProxyReady", message: "the sidecar proxy reports ready".into() };
    d.feed(Feedback::ConditionWritten { want: ready, error: None });
    // The proxy going away after its quit never flips it back.
    assert!(writes(&d.feed(Feedback::Probed { ready: false, detail: String::new() })).is_empty());
}
