//! Pods the node's kernel cannot see (a degraded node, a sandboxed runtime class, hostPID):
//! ends from the API, no hold, and said once with a count, an Event and the condition's reason.

use super::*;
use crate::vocab::DegradedReason;

const HOLD: (&str, &str) = ("valet.dev/hold-app", "true");

fn degraded() -> Drive {
    Drive::with_rules(Rules { mode: NodeMode::Degraded(DegradedReason::NoBtf), ..rules(true) })
}

fn with_class(mut p: Pod, class: &str) -> Pod {
    p.spec.as_mut().expect("spec").runtime_class_name = Some(class.into());
    p
}

fn publishes(fx: &[Effect]) -> Vec<(bool, &'static str)> {
    fx.iter()
        .filter_map(|e| match e {
            Effect::Publish { warning, reason, .. } => Some((*warning, *reason)),
            _ => None,
        })
        .collect()
}

fn counted(fx: &[Effect]) -> Vec<&'static str> {
    fx.iter()
        .filter_map(|e| match e {
            Effect::Count(Count::ApiPath(r)) => Some(*r),
            _ => None,
        })
        .collect()
}

fn never_held(fx: &[Effect]) -> bool {
    !fx.iter().any(|e| {
        matches!(e, Effect::ClassifyExec { .. } | Effect::FindLeftHeld { .. } | Effect::Watch { hold: true, .. })
    })
}

#[test]
fn on_a_degraded_node_a_pod_asking_for_a_hold_runs_unheld_and_is_told_why() {
    let mut d = degraded();
    let fx = d.found(pod("Never", &[], &[HOLD]));
    assert!(has(&fx, &watch(false, false)), "{fx:?}");
    assert!(has(&fx, &Effect::ScanContainers { pod_rel: POD_REL.into(), adopt: false }), "{fx:?}");
    assert!(never_held(&fx), "{fx:?}");
    assert_eq!(counted(&fx), ["node_degraded"], "counted once: {fx:?}");
    assert_eq!(publishes(&fx), [(true, "HoldUnavailable")], "{fx:?}");
    let note = fx.iter().find_map(|e| match e {
        Effect::Publish { note, .. } => Some(note.clone()),
        _ => None,
    });
    assert!(note.as_deref().is_some_and(|n| n.contains("no BTF") && n.contains("no_btf")), "{note:?}");
    // The condition says so at once, before any probe answered.
    assert_eq!(writes(&fx), [(false, "HoldUnavailable")], "{fx:?}");
    let fx = d.feed(Feedback::ConditionWritten {
        want: ProxyReady { ready: false, reason: "HoldUnavailable", message: String::new() },
        error: None,
        version: None,
    });
    assert!(counted(&fx).is_empty() && publishes(&fx).is_empty(), "said once: {fx:?}");
    // The proxy's readiness still shows, under the same reason.
    let fx = d.feed(Feedback::Probed { ready: true, detail: String::new() });
    assert_eq!(writes(&fx), [(true, "HoldUnavailable")], "{fx:?}");
    // A process the kernel would have stopped (none does here) is let go, never held.
    let fx = d.held(APP, 42, "report");
    assert_eq!(releases(&fx), [(42, "not_app")], "{fx:?}");
    // The API's word ends the app, and the proxy is quit on it.
    let fx = d.pod(pod("Never", &[("report", APP, terminated(0)), ("istio-proxy", PROXY, running())], &[HOLD]));
    assert_eq!(quits(&fx), [("istio-proxy".to_owned(), Some(id(PROXY)))], "{fx:?}");
}

#[test]
fn on_a_degraded_node_a_pod_without_a_hold_is_counted_without_an_event() {
    let mut d = degraded();
    let fx = d.found(pod("Never", &[], &[]));
    assert_eq!(counted(&fx), ["node_degraded"], "{fx:?}");
    assert!(publishes(&fx).is_empty(), "one Event per pod on a degraded node would be noise: {fx:?}");
    assert!(has(&fx, &watch(false, false)));
    let fx = d.pod(pod("Never", &[("report", APP, terminated(0)), ("istio-proxy", PROXY, running())], &[]));
    assert_eq!(quits(&fx).len(), 1, "{fx:?}");
}

#[test]
fn a_sandboxed_pod_takes_its_ends_from_the_api_and_says_so() {
    for class in ["kata", "kata-qemu", "gvisor", "runsc"] {
        let mut d = Drive::new(true);
        let fx = d.found(with_class(pod("Never", &[], &[]), class));
        assert_eq!(counted(&fx), ["sandboxed"], "{class}: {fx:?}");
        assert_eq!(publishes(&fx), [(false, "EndsFromApi")], "{class}: {fx:?}");
        assert!(has(&fx, &watch(false, false)), "{class}: {fx:?}");
        let done =
            with_class(pod("Never", &[("report", APP, terminated(0)), ("istio-proxy", PROXY, running())], &[]), class);
        assert_eq!(quits(&d.pod(done)).len(), 1, "{class}");
    }
    // Asking for a hold: refused, with a warning and the condition's reason.
    let mut d = Drive::new(true);
    let fx = d.found(with_class(pod("Never", &[], &[HOLD]), "kata-clh"));
    assert_eq!(publishes(&fx), [(true, "HoldUnavailable")], "{fx:?}");
    assert_eq!(writes(&fx), [(false, "HoldUnavailable")], "{fx:?}");
    assert!(never_held(&fx), "{fx:?}");
}

#[test]
fn a_runtime_class_is_known_by_its_handler_too() {
    use crate::api::runtime_classes::RuntimeHandlers;
    let handlers = RuntimeHandlers::of(&[("secure", "kata"), ("isolated", "runsc"), ("plain", "runc")]);
    let r = Rules { runtime_handlers: handlers, ..rules(true) };
    for (class, want) in [("secure", "secure, handler kata"), ("isolated", "isolated, handler runsc")] {
        let mut d = Drive::with_rules(r.clone());
        let fx = d.found(with_class(pod("Never", &[], &[HOLD]), class));
        assert_eq!(counted(&fx), ["sandboxed"], "{class}: {fx:?}");
        assert_eq!(publishes(&fx), [(true, "HoldUnavailable")], "{class}: {fx:?}");
        assert!(never_held(&fx), "{class}: {fx:?}");
        let p = plan(&with_class(pod("Never", &[], &[]), class), &r.defaults).expect("plan");
        assert_eq!(r.api_path(&p), Some(ApiPath::Sandboxed { runtime_class: want.into() }));
    }
    // A class whose handler is no sandbox keeps the kernel path.
    let mut d = Drive::with_rules(r.clone());
    let fx = d.found(with_class(pod("Never", &[], &[HOLD]), "plain"));
    assert!(counted(&fx).is_empty() && publishes(&fx).is_empty(), "{fx:?}");
    // A class the last list did not have: its handler is unknown, so its ends come from the API
    // (no guess), the hold is refused and said, and the lister is asked for a list.
    let mut d = Drive::with_rules(r.clone());
    let fx = d.found(with_class(pod("Never", &[], &[HOLD]), "unlisted"));
    assert_eq!(counted(&fx), ["unknown_runtime_class"], "{fx:?}");
    assert_eq!(publishes(&fx), [(true, "HoldUnavailable")], "{fx:?}");
    assert!(never_held(&fx), "{fx:?}");
    let p = plan(&with_class(pod("Never", &[], &[]), "unlisted"), &r.defaults).expect("plan");
    assert_eq!(r.api_path(&p), Some(ApiPath::UnknownRuntimeClass { runtime_class: "unlisted".into() }));
}

#[test]
fn on_a_node_whose_default_runtime_is_a_sandbox_pods_without_a_class_are_sandboxed() {
    use crate::api::runtime_classes::RuntimeHandlers;
    let r = Rules {
        default_handler: Some("kata".into()),
        runtime_handlers: RuntimeHandlers::of(&[("runc", "runc")]),
        ..rules(true)
    };
    let mut d = Drive::with_rules(r.clone());
    let fx = d.found(pod("Never", &[], &[HOLD]));
    assert_eq!(counted(&fx), ["sandboxed"], "{fx:?}");
    assert_eq!(publishes(&fx), [(true, "HoldUnavailable")], "{fx:?}");
    assert!(never_held(&fx), "{fx:?}");
    let p = plan(&pod("Never", &[], &[]), &r.defaults).expect("plan");
    let why = ApiPath::Sandboxed { runtime_class: "unset, the node's default handler kata".into() };
    assert_eq!(r.api_path(&p), Some(why));
    // A class of its own decides: runc's keeps the kernel path there.
    let mut d = Drive::with_rules(r.clone());
    let fx = d.found(with_class(pod("Never", &[], &[HOLD]), "runc"));
    assert!(counted(&fx).is_empty() && publishes(&fx).is_empty(), "{fx:?}");
    // A default handler that is no sandbox changes nothing.
    for handler in ["runc", "crun", ""] {
        let r = Rules { default_handler: Some(handler.into()), ..rules(true) };
        let fx = Drive::with_rules(r).found(pod("Never", &[], &[HOLD]));
        assert!(counted(&fx).is_empty() && publishes(&fx).is_empty(), "{handler:?}: {fx:?}");
    }
}

#[test]
fn other_runtime_classes_keep_the_kernel_path() {
    use crate::api::runtime_classes::RuntimeHandlers;
    let handlers = RuntimeHandlers::of(&[("runc", "runc"), ("crun", "crun"), ("nvidia", "nvidia"), ("katana", "runc")]);
    let r = Rules { runtime_handlers: handlers, ..rules(true) };
    for class in ["runc", "crun", "nvidia", "katana", ""] {
        let mut d = Drive::with_rules(r.clone());
        let fx = d.found(with_class(pod("Never", &[], &[HOLD]), class));
        assert!(counted(&fx).is_empty() && publishes(&fx).is_empty(), "{class:?}: {fx:?}");
        assert!(has(&fx, &watch(true, true)), "{class:?}: {fx:?}");
    }
}

#[test]
fn a_host_pid_pod_asking_for_a_hold_is_told_it_runs_unheld() {
    let mut d = Drive::new(true);
    let mut p = pod("Never", &[], &[HOLD]);
    p.spec.as_mut().expect("spec").host_pid = Some(true);
    let fx = d.found(p);
    assert_eq!(counted(&fx), ["host_pid"], "{fx:?}");
    assert_eq!(publishes(&fx), [(true, "HoldUnavailable")], "{fx:?}");
    assert_eq!(writes(&fx), [(false, "HoldUnavailable")], "{fx:?}");
    assert!(never_held(&fx), "{fx:?}");
}

#[test]
fn the_pods_own_reason_comes_before_the_nodes() {
    let r = Rules { mode: NodeMode::Degraded(DegradedReason::Lockdown), ..rules(true) };
    let mut p = plan(&pod("Never", &[], &[]), &r.defaults).expect("plan");
    assert_eq!(r.api_path(&p), Some(ApiPath::NodeDegraded(DegradedReason::Lockdown)));
    p.runtime_class = Some("gvisor".into());
    assert_eq!(r.api_path(&p), Some(ApiPath::Sandboxed { runtime_class: "gvisor".into() }));
    p.host_pid = true;
    assert_eq!(r.api_path(&p), Some(ApiPath::HostPid));
    p.host_pid = false;
    p.runtime_class = None;
    assert_eq!(rules(true).api_path(&p), None);
}

#[test]
fn runtime_class_patterns_match_names_and_prefixes() {
    let pats: Vec<String> = ["kata", "kata-*", "gvisor"].map(String::from).to_vec();
    for (class, want) in [
        ("kata", true),
        ("kata-qemu", true),
        ("kata-", true),
        ("katana", false),
        ("gvisor", true),
        ("gvisor2", false),
        ("", false),
    ] {
        assert_eq!(sandboxed(&pats, class), want, "{class:?}");
    }
    assert!(!sandboxed(&[], "kata"));
}

#[test]
fn a_sandboxed_pods_sidecars_are_reached_at_its_ip_and_never_signalled() {
    let mut d = Drive::new(true);
    let fx = d.found(with_class(pod("Never", &[], &[]), "kata"));
    assert!(!fx.iter().any(|e| matches!(e, Effect::OpenNetwork { .. })), "its netns is not the sandbox's: {fx:?}");
    assert!(
        fx.iter().any(|e| matches!(e, Effect::StartProbe { pod_rel: None, pod_ip: Some(ip), .. } if ip == "10.1.2.3")),
        "probed at the pod IP: {fx:?}"
    );
    let done =
        with_class(pod("Never", &[("report", APP, terminated(0)), ("istio-proxy", PROXY, running())], &[]), "kata");
    let fx = d.pod(done);
    assert!(
        fx.iter().any(|e| matches!(e, Effect::Quit { pod_ip: Some(ip), .. } if ip == "10.1.2.3")),
        "quit at the pod IP: {fx:?}"
    );
    // Refused (Istio's quit endpoint takes loopback callers only): said, never signalled.
    let fx = d.feed(Feedback::QuitDone {
        sidecar: "istio-proxy".into(),
        outcome: QuitOutcome::Rejected { status: 403, body: "only from localhost".into() },
    });
    assert!(signals(&fx).is_empty(), "the node would signal the sandbox: {fx:?}");
    assert_eq!(publishes(&fx), [(true, "SidecarQuitFailed")], "{fx:?}");
    assert!(signals(&d.after(30_000)).is_empty());
}

#[test]
fn a_host_pid_pods_quit_stays_on_its_loopback() {
    let mut d = Drive::new(true);
    let mut p = pod("Never", &[], &[]);
    p.spec.as_mut().expect("spec").host_pid = Some(true);
    let fx = d.found(p);
    assert!(fx.iter().any(|e| matches!(e, Effect::OpenNetwork { .. })), "{fx:?}");
    let mut done = pod("Never", &[("report", APP, terminated(0)), ("istio-proxy", PROXY, running())], &[]);
    done.spec.as_mut().expect("spec").host_pid = Some(true);
    let fx = d.pod(done);
    assert!(fx.iter().any(|e| matches!(e, Effect::Quit { pod_ip: None, .. })), "{fx:?}");
}
