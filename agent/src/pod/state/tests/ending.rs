use super::*;

#[test]
fn the_apps_end_quits_the_sidecar_once() {
    let mut d = Drive::new(true);
    d.found(pod("Never", &[], &[]));
    let fx = d.exit(APP, 0);
    assert_eq!(quits(&fx), [("istio-proxy".to_owned(), Some(id(PROXY)))]);
    assert!(has(&fx, &Effect::StopProbe), "no probing once the work is done: {fx:?}");
    assert!(has(&fx, &Effect::Count(Count::ContainerEnd(Some(ProcessEnd::Exited(0))))));
    // The API catching up, a repeated exit, ticks: never a second quit.
    let mut later = d.pod(pod("Never", &[("report", APP, terminated(0)), ("istio-proxy", PROXY, running())], &[]));
    later.extend(d.exit(APP, 0));
    assert!(quits(&later).is_empty(), "{later:?}");
    d.now += 3 * SEC / 1000;
    let fx = d.feed(Feedback::QuitDone { sidecar: "istio-proxy".into(), outcome: accepted() });
    assert!(has(&fx, &Effect::Count(Count::Quit { kind: "istio", result: "ok" })), "{fx:?}");
    assert!(
        fx.iter().any(|e| matches!(e, Effect::Count(Count::QuitLatency(s)) if (*s - 0.003).abs() < 1e-9)),
        "{fx:?}"
    );
    assert!(fx.iter().any(|e| matches!(e, Effect::Publish { reason: "SidecarQuit", warning: false, .. })));
    assert!(!has(&fx, &Effect::CloseNetwork), "kept until the sidecar has ended: {fx:?}");
    assert!(quits(&d.after(250)).is_empty());
    // The sidecar exits: the node's resources for the pod go (its object may stay for days).
    let fx = d.exit(PROXY, 0);
    assert!(has(&fx, &Effect::Unwatch { pod_cgroup: POD_CG }), "{fx:?}");
    assert!(has(&fx, &Effect::CloseNetwork), "{fx:?}");
    for cg in [SANDBOX, APP, PROXY] {
        assert!(has(&fx, &Effect::ForgetContainer { container_cgroup: cg }), "{cg}: {fx:?}");
    }
    assert!(d.after(20_000).is_empty(), "the sidecar ended: no escalation");
    // A container found once the resources were let go (a scan that was under way) leaves
    // nothing behind in the kernel, and is not tracked again.
    let fx = d.feed(Feedback::Containers(vec![seen(APP2, None)]));
    assert_eq!(fx, vec![Effect::ForgetContainer { container_cgroup: APP2 }]);
}

fn quit_endpoints(fx: &[Effect]) -> Vec<Endpoint> {
    fx.iter()
        .filter_map(|e| match e {
            Effect::Quit { endpoint, .. } => Some(endpoint.clone()),
            _ => None,
        })
        .collect()
}

/// What is armed ahead is exactly what the end then decides: the same endpoints, for each
/// way the app can end, under each restart policy; and nothing once the work is done.
#[test]
fn the_quit_armed_ahead_is_the_quit_the_end_then_decides() {
    let ends = [
        Some(ProcessEnd::Exited(0)),
        Some(ProcessEnd::Exited(1)),
        Some(ProcessEnd::Signaled { signal: 9, core_dumped: false }),
        None,
    ];
    for policy in ["Never", "OnFailure"] {
        for end in ends {
            let mut d = Drive::new(true);
            d.found(pod(policy, &[], &[]));
            d.feed(Feedback::Network { ok: false, detail: "no process yet".into() });
            assert_eq!(d.s.quit_ahead(), None, "not while the pod's network is not open");
            d.feed(Feedback::Network { ok: true, detail: String::new() });
            let arm = d.s.quit_ahead().expect("armed once the network is open");
            assert_eq!((arm.uid.as_str(), arm.pod_cgroup, arm.container_cgroup), (fixtures::UID, POD_CG, APP));
            assert_eq!(arm.pod_rel, POD_REL);
            let istio = vec![Endpoint { port: 15020, path: "/quitquitquit".into() }];
            assert_eq!(arm.on_success, istio, "{policy}");
            let on_failure = if policy == "Never" { istio.clone() } else { Vec::new() };
            assert_eq!(arm.on_failure, on_failure, "{policy}: the kubelet restarts a failed app");
            let armed = if end == Some(ProcessEnd::Exited(0)) { &arm.on_success } else { &arm.on_failure };
            let exit =
                ExitSeen { container_cgroup: APP, tgid: 7, end, ktime: d.now, cgroup_name: None, ns_child: false };
            let fx = d.s.exit(exit, d.now);
            assert_eq!(&quit_endpoints(&fx), armed, "{policy} {end:?}: {fx:?}");
            if !armed.is_empty() {
                assert_eq!(d.s.quit_ahead(), None, "{policy} {end:?}: the work is done");
            }
        }
    }
}

#[test]
fn a_quit_is_armed_ahead_only_when_one_end_can_complete_the_work() {
    let network = || Feedback::Network { ok: true, detail: String::new() };
    // Two apps: neither end alone completes the work; once one has ended, the other's does.
    let two_apps = || {
        let mut json = serde_json::to_value(pod("Never", &[], &[])).unwrap_or_default();
        if let Some(containers) = json["spec"]["containers"].as_array_mut() {
            containers.push(json!({"name": "upload", "image": "example/upload:1"}));
        }
        fixtures::from_json(json)
    };
    let mut d = Drive::new(true);
    d.found(two_apps());
    d.feed(Feedback::Containers(vec![seen(APP2, named("upload"))]));
    d.feed(network());
    assert_eq!(d.s.quit_ahead(), None, "two apps running");
    assert!(quit_endpoints(&d.exit(APP2, 0)).is_empty());
    assert_eq!(d.s.quit_ahead().map(|a| a.container_cgroup), Some(APP), "the last app running");

    // Deleting, terminal, released, shutting down: nothing armed.
    let mut d = Drive::new(true);
    d.found(pod("Never", &[], &[]));
    d.feed(network());
    assert!(d.s.quit_ahead().is_some());
    let mut json = serde_json::to_value(pod("Never", &[], &[])).unwrap_or_default();
    json["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
    d.pod(fixtures::from_json(json));
    assert_eq!(d.s.quit_ahead(), None, "deleting");

    let mut d = Drive::new(true);
    d.found(pod("Never", &[], &[]));
    d.feed(network());
    d.s.shutdown();
    assert_eq!(d.s.quit_ahead(), None, "shutting down");

    let mut d = Drive::new(true);
    d.found(pod("Never", &[], &[]));
    d.feed(network());
    d.s.removed();
    assert_eq!(d.s.quit_ahead(), None, "released");

    // The API already reports the app's end: nothing left to arm.
    let mut d = Drive::new(true);
    d.found(pod("Never", &[("report", APP, terminated(0)), ("istio-proxy", PROXY, running())], &[]));
    d.feed(network());
    assert_eq!(d.s.quit_ahead(), None, "already done");
}

#[test]
fn on_failure_waits_for_success_and_follows_the_restarted_instance() {
    let mut d = Drive::new(true);
    d.found(pod("OnFailure", &[], &[]));
    assert!(quits(&d.exit(APP, 1)).is_empty(), "the kubelet restarts it: the proxy is still needed");
    // The API shows the failed instance; the kubelet restarts the container in a new cgroup
    // the runtime names before the API does.
    let api = pod("OnFailure", &[("report", APP, terminated(1)), ("istio-proxy", PROXY, running())], &[]);
    assert!(quits(&d.pod(api)).is_empty());
    let fx = d.feed(scan_with(APP2, "report"));
    assert!(quits(&fx).is_empty(), "the new instance runs: {fx:?}");
    let fx = d.exit(APP2, 0);
    assert_eq!(quits(&fx), [("istio-proxy".to_owned(), Some(id(PROXY)))], "the newest instance counts: {fx:?}");
}

#[test]
fn the_api_has_the_last_word_on_an_instance_it_reports_terminated() {
    let mut d = Drive::new(true);
    d.found(pod("OnFailure", &[("report", APP, running()), ("istio-proxy", PROXY, running())], &[]));
    // The kernel could not read the exit code (255, never success)...
    let exit = ExitSeen { container_cgroup: APP, tgid: 7, end: None, ktime: d.now, cgroup_name: None, ns_child: false };
    assert!(quits(&d.s.exit(exit, d.now)).is_empty());
    // ...the API says it exited 0: the work is done.
    let fx = d.pod(pod("OnFailure", &[("report", APP, terminated(0)), ("istio-proxy", PROXY, running())], &[]));
    assert_eq!(quits(&fx).len(), 1, "{fx:?}");
    // And the other way round: the kernel saw 0 but the API says 3 (the API wins).
    let mut d = Drive::new(true);
    d.found(pod("OnFailure", &[("report", APP, terminated(3)), ("istio-proxy", PROXY, running())], &[]));
    assert!(quits(&d.exit(APP, 0)).is_empty());
}

#[test]
fn a_sidecar_restarted_after_its_quit_is_quit_again() {
    let mut d = Drive::new(true);
    d.found(pod("OnFailure", &[], &[]));
    assert_eq!(quits(&d.exit(APP, 0)).len(), 1);
    d.feed(Feedback::QuitDone { sidecar: "istio-proxy".into(), outcome: accepted() });
    // SIGTERMed, it exited 143; the kubelet restarted it as a new instance.
    d.exit(PROXY, 143);
    let api = pod("OnFailure", &[("report", APP, terminated(0)), ("istio-proxy", PROXY2, running())], &[]);
    let mut fx = d.pod(api);
    fx.extend(d.feed(Feedback::Containers(vec![seen(PROXY2, named("istio-proxy"))])));
    assert_eq!(quits(&fx), [("istio-proxy".to_owned(), Some(id(PROXY2)))], "{fx:?}");
}

#[test]
fn a_failed_quit_is_escalated_or_retried_with_backoff_never_in_a_loop() {
    let failed = || QuitOutcome::Failed { last: "connection refused".into(), label: "refused", attempts: 9 };
    // Escalation on: SIGTERM at once.
    let mut d = Drive::new(true);
    d.found(pod("Never", &[], &[]));
    d.exit(APP, 0);
    let fx = d.feed(Feedback::QuitDone { sidecar: "istio-proxy".into(), outcome: failed() });
    assert_eq!(signals(&fx), [("istio-proxy".to_owned(), libc::SIGTERM)], "{fx:?}");
    assert!(fx.iter().any(|e| matches!(e, Effect::Publish { reason: "SidecarQuitFailed", warning: true, .. })));
    assert!(quits(&d.after(120_000)).is_empty(), "escalated: not retried");
    // Escalation off: retried after 1 s, 2 s, 4 s ... and at most QUIT_RETRIES times.
    let mut d = Drive::new(false);
    d.found(pod("Never", &[], &[]));
    d.exit(APP, 0);
    let mut sent = 1;
    let mut waited = Vec::new();
    for _ in 0..30 {
        d.feed(Feedback::QuitDone { sidecar: "istio-proxy".into(), outcome: failed() });
        let mut ms = 0;
        loop {
            ms += 250;
            let fx = d.after(250);
            if !quits(&fx).is_empty() {
                sent += 1;
                waited.push(ms);
                break;
            }
            if ms > 120_000 {
                break;
            }
        }
    }
    assert_eq!(sent, 1 + QUIT_RETRIES as usize, "bounded retries");
    assert_eq!(&waited[..4], [1000, 2000, 4000, 8000], "backoff doubles: {waited:?}");
    assert!(waited.iter().all(|ms| *ms <= 60_000), "{waited:?}");
}

#[test]
fn an_accepted_quit_is_escalated_only_if_the_sidecar_is_still_there() {
    for sidecar_exits in [false, true] {
        let mut d = Drive::new(true);
        d.found(pod("Never", &[], &[]));
        d.exit(APP, 0);
        d.feed(Feedback::QuitDone { sidecar: "istio-proxy".into(), outcome: accepted() });
        assert!(signals(&d.after(14_000)).is_empty(), "before the deadline");
        if sidecar_exits {
            d.exit(PROXY, 0);
        }
        let fx = d.after(1_000);
        let want: Vec<(String, i32)> = if sidecar_exits { vec![] } else { vec![("istio-proxy".into(), libc::SIGTERM)] };
        assert_eq!(signals(&fx), want, "sidecar exits: {sidecar_exits}");
        assert!(signals(&d.after(60_000)).is_empty(), "once");
    }
}

#[test]
fn a_signal_sidecar_is_ended_with_its_signal() {
    let mut d = Drive::new(true);
    let mut p = pod(
        "Never",
        &[],
        &[
            ("valet.dev/sidecars", "istio-proxy"),
            ("valet.dev/sidecar-kind.istio-proxy", "signal"),
            ("valet.dev/quit-signal.istio-proxy", "SIGINT"),
        ],
    );
    if let Some(s) = p.spec.as_mut() {
        s.containers[1].name = "istio-proxy".into();
    }
    let fx = d.found(p);
    assert!(!fx.iter().any(|e| matches!(e, Effect::StartProbe { .. })), "no readiness endpoint: no probe");
    let fx = d.exit(APP, 0);
    assert!(quits(&fx).is_empty());
    assert_eq!(signals(&fx), [("istio-proxy".to_owned(), libc::SIGINT)]);
    let fx = d.feed(Feedback::Signalled { sidecar: "istio-proxy".into(), signal: libc::SIGINT, signalled: 1 });
    assert!(has(&fx, &Effect::Count(Count::Quit { kind: "signal", result: "ok" })), "{fx:?}");
    assert!(signals(&d.after(60_000)).is_empty(), "no escalation of a signal quit");
}

#[test]
fn a_quit_waits_for_the_pod_cgroup_and_goes_out_once_it_is_found() {
    let mut d = Drive::new(true);
    d.pod(pod("Never", &[("report", APP, terminated(0)), ("istio-proxy", PROXY, running())], &[]));
    assert!(d.after(250).contains(&Effect::FindPodCgroup), "still looking");
    let fx = d.feed(Feedback::PodCgroup { rel: POD_REL.into(), id: POD_CG });
    assert_eq!(quits(&fx), [("istio-proxy".to_owned(), Some(id(PROXY)))], "{fx:?}");
    let _ = Endpoint { port: 1, path: String::new() };
}

/// What the README promises for `restartPolicy: Always`: never a quit, but the pod is still
/// watched, its proxy probed and the condition written, and with `hold-app` its app is held.
#[test]
fn a_restart_always_pod_is_held_and_probed_but_never_quit() {
    let mut d = Drive::new(true);
    let fx = d.found(pod("Always", &[], &[("valet.dev/hold-app", "true")]));
    assert!(has(&fx, &Effect::Count(Count::Skip(SkipReason::RestartAlways))), "{fx:?}");
    assert!(has(&fx, &watch(true, true)), "{fx:?}");
    assert!(has(&fx, &Effect::ClassifyExec { container_cgroup: APP, hold: true }), "{fx:?}");
    assert!(fx.iter().any(|e| matches!(e, Effect::StartProbe { .. })), "{fx:?}");
    d.held(APP, 42, "report");
    let fx = d.feed(Feedback::Probed { ready: true, detail: String::new() });
    assert_eq!(releases(&fx), [(42, "ready")]);
    assert_eq!(writes(&fx), [(true, "ProxyReady")]);
    let mut fx = d.exit(APP, 0);
    let hold = [("valet.dev/hold-app", "true")];
    fx.extend(d.pod(pod("Always", &[("report", APP, terminated(0)), ("istio-proxy", PROXY, running())], &hold)));
    fx.extend(d.after(60_000));
    assert!(quits(&fx).is_empty() && signals(&fx).is_empty(), "never quit: {fx:?}");
}

/// The pod cgroup as the kubelet names it for [`fixtures::UID`] (a path `classify` reads).
fn real_pod_rel() -> String {
    format!("/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{}.slice", fixtures::UID.replace('-', "_"))
}

/// An end read late: the container's cgroup is gone and was never seen; only the kernel's event
/// names it (`cgroup_name`).
fn late_end(cg: u64, name: Option<String>, now: Nanos) -> ExitSeen {
    ExitSeen {
        container_cgroup: cg,
        tgid: 7,
        end: Some(ProcessEnd::Exited(0)),
        ktime: now,
        cgroup_name: name,
        ns_child: false,
    }
}

/// [`late_end`] of container `cg` under its containerd cgroup name, the one the kernel read.
fn stalled_end(d: &mut Drive, cg: u64) -> Vec<Effect> {
    let name = format!("cri-containerd-{}.scope", id(cg));
    d.s.exit(late_end(cg, Some(name), d.now), d.now)
}

/// A scan of the node that finds the sandbox, the proxy and container `cg` named `name`.
fn scan_with(cg: u64, name: &str) -> Feedback {
    Feedback::Containers(vec![
        seen(SANDBOX, Some(RuntimeName::Sandbox)),
        seen(cg, named(name)),
        seen(PROXY, named("istio-proxy")),
    ])
}

/// A pod the API knows nothing of yet (Pending, no ids), found on the node with its sandbox
/// and sidecar: its app started and ended while the agent was stopped.
fn found_without_the_app(d: &mut Drive, apps: &[&str]) {
    let mut pod = pod("Never", &[], &[]);
    if apps.len() > 1 {
        let spec = pod.spec.as_mut().expect("spec");
        let mut more = spec.containers[0].clone();
        more.name = apps[1].into();
        spec.containers.insert(1, more);
    }
    if let Some(s) = pod.status.as_mut() {
        s.phase = Some("Pending".into());
    }
    d.pod(pod);
    d.feed(Feedback::PodCgroup { rel: real_pod_rel(), id: POD_CG });
    d.feed(Feedback::Containers(vec![seen(SANDBOX, Some(RuntimeName::Sandbox)), seen(PROXY, named("istio-proxy"))]));
}

#[test]
fn an_end_read_after_a_stall_waits_for_the_api_to_name_the_container() {
    // The end of a container the agent never named (it started and ended while the agent was
    // stopped, and the runtime removed its cgroup) is kept by the id in the cgroup name the
    // kernel read. Though everything else of the pod is known and one app is not, it is not
    // taken for that app: a container the spec does not list ends the same way. Once the API
    // names the id, the end is the app's (the kernel saw it before the API says so).
    let mut d = Drive::new(true);
    found_without_the_app(&mut d, &["report"]);
    let fx = stalled_end(&mut d, APP);
    assert!(quits(&fx).is_empty(), "an unnamed end taken for the app: {fx:?}");
    assert!(has(&fx, &Effect::Count(Count::ContainerEnd(Some(ProcessEnd::Exited(0))))), "{fx:?}");
    let fx = d.pod(pod("Never", &[("report", APP, running()), ("istio-proxy", PROXY, running())], &[]));
    assert_eq!(quits(&fx), [("istio-proxy".to_owned(), Some(id(PROXY)))], "{fx:?}");
    // Its kernel record is freed with the pod's.
    let fx = d.exit(PROXY, 0);
    assert!(has(&fx, &Effect::ForgetContainer { container_cgroup: APP }), "{fx:?}");
}

#[test]
fn an_end_read_after_a_stall_is_named_by_the_kubelets_log_link() {
    // The same end, with the kubelet's log link for its id still there: the link names it, and
    // its end quits the proxy without waiting for the API.
    let mut d = Drive::new(true);
    found_without_the_app(&mut d, &["report"]);
    let fx = stalled_end(&mut d, APP);
    assert!(has(&fx, &Effect::NameEnded { container_cgroup: APP, id: id(APP) }), "{fx:?}");
    assert!(quits(&fx).is_empty(), "quit before the name: {fx:?}");
    let fx = d.feed(Feedback::EndedNamed { container_cgroup: APP, name: Some("report".into()) });
    assert_eq!(quits(&fx), [("istio-proxy".to_owned(), Some(id(PROXY)))], "{fx:?}");
}

#[test]
fn a_link_naming_another_container_or_none_quits_nothing() {
    // A debug container's link names it: not the app. No link: the API names it later.
    for name in [Some("debugger-x1"), None] {
        let mut d = Drive::new(true);
        found_without_the_app(&mut d, &["report"]);
        stalled_end(&mut d, APP2);
        let fx = d.feed(Feedback::EndedNamed { container_cgroup: APP2, name: name.map(str::to_owned) });
        assert!(quits(&fx).is_empty() && signals(&fx).is_empty(), "{name:?}: {fx:?}");
        assert!(quits(&d.feed(scan_with(APP, "report"))).is_empty(), "{name:?}");
        let fx = d.exit(APP, 0);
        assert_eq!(quits(&fx), [("istio-proxy".to_owned(), Some(id(PROXY)))], "{name:?}: {fx:?}");
    }
}

#[test]
fn a_linked_end_of_one_of_two_apps_waits_for_the_other() {
    let mut d = Drive::new(true);
    found_without_the_app(&mut d, &["report", "upload"]);
    stalled_end(&mut d, APP);
    let fx = d.feed(Feedback::EndedNamed { container_cgroup: APP, name: Some("report".into()) });
    assert!(quits(&fx).is_empty(), "upload may still run: {fx:?}");
    assert!(quits(&d.feed(scan_with(APP2, "upload"))).is_empty());
    let fx = d.exit(APP2, 0);
    assert_eq!(quits(&fx), [("istio-proxy".to_owned(), Some(id(PROXY)))], "{fx:?}");
}

#[test]
fn a_child_taken_for_the_main_process_ends_its_container_only_in_a_shared_pid_namespace() {
    // The app's container started before its pod was watched and was not adopted: the kernel
    // recorded a later exec (a child of its pid 1) as its main process and reports the child's
    // exit. With a pid namespace per container the main process is pid 1 there: no end, no quit
    // until the init's own exit. With shareProcessNamespace no main process is pid 1: it ends.
    for shared in [false, true] {
        let mut d = Drive::new(true);
        let mut api = pod("Never", &[], &[]);
        api.spec.as_mut().expect("spec").share_process_namespace = Some(shared);
        d.found(api);
        let child = ExitSeen {
            container_cgroup: APP,
            tgid: 8,
            end: Some(ProcessEnd::Exited(0)),
            ktime: d.now,
            cgroup_name: None,
            ns_child: true,
        };
        let fx = d.s.exit(child, d.now);
        if shared {
            assert_eq!(quits(&fx), [("istio-proxy".to_owned(), Some(id(PROXY)))], "shared: {fx:?}");
            continue;
        }
        assert!(fx.is_empty(), "a child's exit taken for the container's end: {fx:?}");
        assert!(d.s.quit_ahead().is_some_and(|a| a.init_only), "the arm waits for the init too");
        let fx = d.exit(APP, 0);
        assert_eq!(quits(&fx), [("istio-proxy".to_owned(), Some(id(PROXY)))], "the init's exit: {fx:?}");
    }
}

#[test]
fn the_end_of_a_debug_container_unseen_is_never_the_apps() {
    // `kubectl debug` adds an ephemeral container: not in the spec's containers, its own pid
    // namespace, its pid 1 an init the kernel reports at its end. It ended while the agent was
    // stopped, with the one app of the pod still unknown to the agent: no quit, also once the
    // API lists it among the ephemeral containers; the app's own end quits the proxy.
    const DEBUG: u64 = 107;
    let mut d = Drive::new(true);
    found_without_the_app(&mut d, &["report"]);
    let fx = stalled_end(&mut d, DEBUG);
    assert!(quits(&fx).is_empty() && signals(&fx).is_empty(), "the debug container's end quit the proxy: {fx:?}");
    let mut api = pod("Never", &[("istio-proxy", PROXY, running())], &[]);
    let debug = json!([{"name": "debugger-x1", "ready": false, "restartCount": 0, "image": "busybox", "imageID": "",
                        "containerID": format!("containerd://{}", id(DEBUG)), "state": terminated(0)}]);
    api.status.as_mut().expect("status").ephemeral_container_statuses =
        Some(serde_json::from_value(debug).expect("ephemeral statuses"));
    let fx = d.pod(api);
    assert!(quits(&fx).is_empty(), "the API's ephemeral container taken for an app: {fx:?}");
    assert!(quits(&d.feed(scan_with(APP, "report"))).is_empty());
    let fx = d.exit(APP, 0);
    assert_eq!(quits(&fx), [("istio-proxy".to_owned(), Some(id(PROXY)))], "{fx:?}");
}

#[test]
fn an_end_without_a_name_is_left_to_the_api_and_its_record_freed() {
    let mut d = Drive::new(true);
    found_without_the_app(&mut d, &["report"]);
    let fx = d.s.exit(late_end(APP, None, d.now), d.now);
    assert!(quits(&fx).is_empty(), "{fx:?}");
    assert_eq!(fx, vec![Effect::ForgetContainer { container_cgroup: APP }]);
    // A name that is not a container of this pod tells nothing either.
    let other = "cri-containerd-zz.scope".to_owned();
    let fx = d.s.exit(late_end(APP2, Some(other), d.now), d.now);
    assert_eq!(fx, vec![Effect::ForgetContainer { container_cgroup: APP2 }]);
}

#[test]
fn an_unseen_end_among_two_unknown_apps_waits_for_the_api_to_name_its_id() {
    let mut d = Drive::new(true);
    found_without_the_app(&mut d, &["report", "upload"]);
    let fx = stalled_end(&mut d, APP);
    assert!(quits(&fx).is_empty(), "either app could have ended: {fx:?}");
    // The API names both: `report` is the one that ended (by the kernel's word, before the API
    // says so), `upload` still runs.
    let two = |upload: Value| {
        let mut p = pod(
            "Never",
            &[("report", APP, running()), ("upload", APP2, upload), ("istio-proxy", PROXY, running())],
            &[],
        );
        let spec = p.spec.as_mut().expect("spec");
        let mut more = spec.containers[0].clone();
        more.name = "upload".into();
        spec.containers.insert(1, more);
        p
    };
    assert!(quits(&d.pod(two(running()))).is_empty());
    assert!(quits(&d.feed(scan_with(APP2, "upload"))).is_empty());
    let fx = d.exit(APP2, 0);
    assert_eq!(quits(&fx), [("istio-proxy".to_owned(), Some(id(PROXY)))], "{fx:?}");
}

#[test]
fn a_container_the_api_calls_running_with_no_cgroup_left_has_ended() {
    // The app ended while no agent watched the pod; the API still says running. A
    // scan of the node that finds no cgroup (or an empty one) for it is its end.
    for live_but_empty in [false, true] {
        let mut d = Drive::new(true);
        let api = pod("Never", &[("report", APP, running()), ("istio-proxy", PROXY, running())], &[]);
        d.pod(api);
        d.feed(Feedback::PodCgroup { rel: POD_REL.into(), id: POD_CG });
        let mut app = seen(APP, named("report"));
        app.live = false;
        let mut scan = vec![seen(SANDBOX, Some(RuntimeName::Sandbox)), seen(PROXY, named("istio-proxy"))];
        if live_but_empty {
            scan.push(app);
        }
        let fx = d.feed(Feedback::Containers(scan));
        assert_eq!(quits(&fx), [("istio-proxy".to_owned(), Some(id(PROXY)))], "empty={live_but_empty}: {fx:?}");
    }
}

#[test]
fn an_empty_scan_proves_no_end_and_a_recheck_looks_again() {
    let mut d = Drive::new(true);
    d.pod(pod("Never", &[("report", APP, running()), ("istio-proxy", PROXY, running())], &[]));
    d.feed(Feedback::PodCgroup { rel: POD_REL.into(), id: POD_CG });
    let fx = d.feed(Feedback::Containers(Vec::new()));
    assert!(quits(&fx).is_empty(), "{fx:?}");
    let fx = d.feed(scan_with(APP, "report"));
    assert!(quits(&fx).is_empty(), "all running: {fx:?}");
    // At a resume or a re-list, the node is looked at again while the API calls a container
    // running that nothing said ended.
    assert_eq!(d.s.recheck_ends(), vec![Effect::ScanContainers { pod_rel: POD_REL.into(), adopt: false }]);
    let fx = d
        .feed(Feedback::Containers(vec![seen(SANDBOX, Some(RuntimeName::Sandbox)), seen(PROXY, named("istio-proxy"))]));
    assert_eq!(quits(&fx), [("istio-proxy".to_owned(), Some(id(PROXY)))], "{fx:?}");
}

/// Linkerd's proxy answers 404 on `/shutdown` while its shutdown endpoint is off, as current
/// Linkerd releases ship it: its way out is SIGTERM, which is no failure of the quit. The pod gets
/// a Normal Event saying what was done, and the quit counts as one that ended the sidecar.
#[test]
fn linkerd_with_its_shutdown_endpoint_off_is_sigtermed_without_a_warning() {
    let linkerd = [("valet.dev/sidecar-kind.istio-proxy", "linkerd")];
    let off = || QuitOutcome::Rejected { status: 404, body: String::new() };
    let mut d = Drive::new(true);
    d.found(pod("Never", &[], &linkerd));
    assert_eq!(quit_endpoints(&d.exit(APP, 0)), [Endpoint { port: 4191, path: "/shutdown".into() }]);
    let fx = d.feed(Feedback::QuitDone { sidecar: "istio-proxy".into(), outcome: off() });
    assert_eq!(signals(&fx), [("istio-proxy".to_owned(), libc::SIGTERM)], "{fx:?}");
    assert!(!fx.iter().any(|e| matches!(e, Effect::Publish { warning: true, .. })), "no Warning: {fx:?}");
    assert!(!fx.iter().any(|e| matches!(e, Effect::Count(Count::Quit { .. }))), "counted once signalled: {fx:?}");
    let fx = d.feed(Feedback::Signalled { sidecar: "istio-proxy".into(), signal: libc::SIGTERM, signalled: 1 });
    assert!(has(&fx, &Effect::Count(Count::Quit { kind: "linkerd", result: "ok" })), "{fx:?}");
    assert!(!fx.iter().any(|e| matches!(e, Effect::Count(Count::Escalation { .. }))), "not an escalation: {fx:?}");
    let said = fx.iter().find_map(|e| match e {
        Effect::Publish { warning: false, reason: "SidecarQuit", note, .. } => Some(note.clone()),
        _ => None,
    });
    assert!(said.as_deref().is_some_and(|n| n.contains("SIGTERM") && n.contains("/shutdown")), "{fx:?}");
    assert!(signals(&d.after(60_000)).is_empty() && quits(&d.after(60_000)).is_empty(), "once");

    // Any other refusal is still one (a 403: not from the pod's loopback).
    let mut d = Drive::new(true);
    d.found(pod("Never", &[], &linkerd));
    d.exit(APP, 0);
    let forbidden = QuitOutcome::Rejected { status: 403, body: "Requests are only permitted from localhost.".into() };
    let fx = d.feed(Feedback::QuitDone { sidecar: "istio-proxy".into(), outcome: forbidden });
    assert!(fx.iter().any(|e| matches!(e, Effect::Publish { reason: "SidecarQuitFailed", warning: true, .. })));
    // A 404 from another kind too.
    let mut d = Drive::new(true);
    d.found(pod("Never", &[], &[]));
    d.exit(APP, 0);
    let fx = d.feed(Feedback::QuitDone { sidecar: "istio-proxy".into(), outcome: off() });
    assert!(has(&fx, &Effect::Count(Count::Quit { kind: "istio", result: "rejected" })), "{fx:?}");
    assert!(fx.iter().any(|e| matches!(e, Effect::Publish { reason: "SidecarQuitFailed", warning: true, .. })));
    // With --no-escalation valet sends no signal, so it cannot end such a proxy: said as before.
    let mut d = Drive::new(false);
    d.found(pod("Never", &[], &linkerd));
    d.exit(APP, 0);
    let fx = d.feed(Feedback::QuitDone { sidecar: "istio-proxy".into(), outcome: off() });
    assert!(signals(&fx).is_empty(), "{fx:?}");
    assert!(fx.iter().any(|e| matches!(e, Effect::Publish { reason: "SidecarQuitFailed", warning: true, .. })));
}

#[test]
fn an_accepted_quit_is_published_only_with_quit_events_on() {
    let mut d = Drive::with_rules(Rules { quit_events: false, ..rules(true) });
    d.found(pod("Never", &[], &[]));
    let fx = d.exit(APP, 0);
    assert_eq!(quits(&fx), [("istio-proxy".to_owned(), Some(id(PROXY)))]);
    let fx = d.feed(Feedback::QuitDone { sidecar: "istio-proxy".into(), outcome: accepted() });
    assert!(has(&fx, &Effect::Count(Count::Quit { kind: "istio", result: "ok" })), "still counted: {fx:?}");
    assert!(!fx.iter().any(|e| matches!(e, Effect::Publish { .. })), "no Event, no API write: {fx:?}");
}
