//! The decision: given a pod's plan and what has been observed of its containers, should valet
//! quit the sidecars now, keep waiting, or leave the pod alone?
//!
//! Kubernetes facts behind the rules: a Job pod succeeds only once every container has exited 0;
//! an app the kubelet restarts after its exit (`OnFailure` after a failure, a container's own
//! `restartPolicy` or `restartPolicyRules`: [`super::restart`]) still needs its sidecar; with
//! `Always` nothing finishes. A classic sidecar the kubelet would restart after a quit is not quit.

use std::collections::{BTreeMap, BTreeSet};

use super::restart::AfterExit;
pub use super::restart::ExitOutcome;
use super::spec::PodPlan;

/// What is known of an app container.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AppState {
    /// Not started yet, or nothing known.
    Waiting,
    Running,
    Exited(ExitOutcome),
}

/// What is known of a sidecar container.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SidecarState {
    Running,
    Exited,
    Unknown,
}

/// The containers' states, merged from the kernel and the API by the caller.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Observed {
    /// By app container name; a missing app counts as `Waiting`.
    pub apps: BTreeMap<String, AppState>,
    /// By sidecar container name; a missing sidecar counts as `Unknown`.
    pub sidecars: BTreeMap<String, SidecarState>,
    /// Sidecars that already accepted a quit.
    pub quits_done: BTreeSet<String>,
    /// Apps whose current instance's end the API reports: the kubelet has seen it (the runtime
    /// recorded it, and every later look of the kubelet's sees the app exited).
    pub recorded: BTreeSet<String>,
    /// Every native sidecar of the pod (valet's or not), by name; a missing one counts as
    /// `Unknown`.
    pub natives: BTreeMap<String, SidecarState>,
}

/// Why valet does nothing for a pod, ever (until its plan changes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum IgnoreReason {
    /// The pod is being deleted: the kubelet is stopping every container anyway.
    Deleting,
    /// `restartPolicy: Always` (the pod's, or every app's own): the apps never finish; or every
    /// sidecar valet could quit would be restarted by the kubelet after its quit.
    RestartAlways,
    /// The only sidecars are native ones (init containers with `restartPolicy: Always`) that
    /// valet does not quit (neither a default name nor listed in `valet.dev/sidecars`): the
    /// kubelet ends them once the apps have.
    NativeSidecars,
    /// No container is a sidecar.
    NoSidecars,
    /// Every container is a sidecar: there is no work whose end to wait for.
    NoApps,
}

/// Why the sidecars are still needed.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum WaitReason {
    /// These apps (spec order) have not exited yet, or nothing is known of them.
    AppsRunning(Vec<String>),
    /// These apps (spec order) ended in a way the kubelet answers with a restart in place (of
    /// the app, or of every container of the pod): they will need the proxy again.
    AppWillRestart(Vec<String>),
    /// These apps (spec order) ended in a way only the kubelet can judge: a restart rule valet
    /// does not know matches it, or its exit code, which decides, is not known yet.
    AppEndUnsure(Vec<String>),
    /// These native sidecars (spec order) wait for the kubelet to report these apps' ends: a
    /// native sidecar that exits while the kubelet still sees an app running is restarted.
    KubeletBehind { sidecars: Vec<String>, apps: Vec<String> },
    /// These native sidecars (spec order) wait for their turn: the kubelet stops native sidecars
    /// last first, each once every native sidecar declared after it has exited.
    SidecarsAfter(Vec<String>),
}

/// What to do for a pod now.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Decision {
    Wait(WaitReason),
    /// Quit these sidecars (spec order): the work is done, they are neither exited nor quit yet.
    Quit(Vec<String>),
    /// The work is done and every sidecar has exited or been quit.
    Done,
    Ignore(IgnoreReason),
}

/// Decides for one pod. Pure: the same plan and observation always give the same decision.
pub fn decide(plan: &PodPlan, observed: &Observed) -> Decision {
    if let Some(reason) = ignore_reason(plan) {
        return Decision::Ignore(reason);
    }
    let state = |app: &String| observed.apps.get(app).copied().unwrap_or(AppState::Waiting);

    let (mut restarting, mut unsure, mut unfinished) = (Vec::new(), Vec::new(), Vec::new());
    for app in &plan.apps {
        match state(app) {
            AppState::Exited(outcome) => match plan.after_exit(app, outcome) {
                AfterExit::Stays => {}
                AfterExit::Restart | AfterExit::RestartAll => restarting.push(app.clone()),
                AfterExit::Unsure(_) => unsure.push(app.clone()),
            },
            AppState::Waiting | AppState::Running => unfinished.push(app.clone()),
        }
    }
    // A restart is reported first: it explains the wait even when other apps run.
    if !restarting.is_empty() {
        return Decision::Wait(WaitReason::AppWillRestart(restarting));
    }
    if !unsure.is_empty() {
        return Decision::Wait(WaitReason::AppEndUnsure(unsure));
    }
    if !unfinished.is_empty() {
        return Decision::Wait(WaitReason::AppsRunning(unfinished));
    }

    // Apps whose end the kubelet has not reported: a native sidecar quit now could exit while a
    // look of the kubelet's still shows the app running, and be restarted. Regular sidecars are
    // never restarted once their app's end is final (the kernel's word is enough for them).
    let unrecorded: Vec<String> = plan.apps.iter().filter(|a| !observed.recorded.contains(*a)).cloned().collect();
    let (mut to_quit, mut behind, mut turn) = (Vec::new(), Vec::new(), Vec::new());
    for name in quittable(plan) {
        if observed.quits_done.contains(name) || observed.sidecars.get(name) == Some(&SidecarState::Exited) {
            continue;
        }
        if let Some(i) = plan.native_sidecars.iter().position(|n| n == name) {
            if !unrecorded.is_empty() {
                behind.push(name.clone());
                continue;
            }
            // Last first: each once every native sidecar declared after it has exited (a quit
            // accepted is not enough: the kubelet waits for the exit). One that never exits is
            // stopped by the kubelet at the end of its wait, and then this one's turn comes.
            let later_running =
                plan.native_sidecars[i + 1..].iter().any(|n| observed.natives.get(n) != Some(&SidecarState::Exited));
            if later_running {
                turn.push(name.clone());
                continue;
            }
        }
        to_quit.push(name.clone());
    }
    if !to_quit.is_empty() {
        Decision::Quit(to_quit)
    } else if !behind.is_empty() {
        Decision::Wait(WaitReason::KubeletBehind { sidecars: behind, apps: unrecorded })
    } else if !turn.is_empty() {
        Decision::Wait(WaitReason::SidecarsAfter(turn))
    } else {
        Decision::Done
    }
}

/// The sidecars a quit would end for good (spec order): native ones (the kubelet restarts none
/// once the apps are done), and regular ones whose clean exit the kubelet does not answer with a
/// restart.
fn quittable(plan: &PodPlan) -> impl Iterator<Item = &String> {
    plan.sidecars
        .iter()
        .map(|s| &s.name)
        .filter(|name| plan.native_sidecars.contains(*name) || plan.after_exit(name, ExitOutcome::Code(0)).stays())
}

fn ignore_reason(plan: &PodPlan) -> Option<IgnoreReason> {
    if plan.deleting {
        Some(IgnoreReason::Deleting)
    } else if plan.apps_never_end() || (!plan.sidecars.is_empty() && quittable(plan).next().is_none()) {
        Some(IgnoreReason::RestartAlways)
    } else if plan.sidecars.is_empty() && !plan.native_sidecars.is_empty() {
        // Native sidecars valet does not quit are ended by the kubelet, seconds later.
        Some(IgnoreReason::NativeSidecars)
    } else if plan.sidecars.is_empty() {
        Some(IgnoreReason::NoSidecars)
    } else if plan.apps.is_empty() {
        Some(IgnoreReason::NoApps)
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pod::fixtures;
    use crate::pod::spec::{self, DEFAULT_HOLD_TIMEOUT, RestartPolicy, Sidecar, SidecarDefaults, SidecarKind};

    const OUTCOMES: [ExitOutcome; 5] = [
        ExitOutcome::Code(0),
        ExitOutcome::Code(1),
        ExitOutcome::Code(137),
        ExitOutcome::Signal(9),
        ExitOutcome::Signal(15),
    ];
    const POLICIES: [RestartPolicy; 3] = [RestartPolicy::Never, RestartPolicy::OnFailure, RestartPolicy::Always];

    fn names(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| (*s).to_owned()).collect()
    }

    fn plan(policy: RestartPolicy, apps: &[&str], sidecars: &[&str]) -> PodPlan {
        let kind = SidecarKind::Istio;
        PodPlan {
            uid: fixtures::UID.into(),
            namespace: "ns".into(),
            name: "pod".into(),
            restart_policy: policy,
            own_restarts: BTreeMap::new(),
            apps: names(apps),
            sidecars: sidecars
                .iter()
                .map(|n| Sidecar {
                    name: (*n).to_owned(),
                    kind,
                    quit: kind.quit_endpoint(),
                    ready: kind.ready_endpoint(),
                    quit_signal: libc::SIGTERM,
                })
                .collect(),
            init_containers: Vec::new(),
            native_sidecars: Vec::new(),
            native_startup_probed: BTreeSet::new(),
            hold_app: false,
            hold_timeout: DEFAULT_HOLD_TIMEOUT,
            istio_holds_app: false,
            host_pid: false,
            shares_pid_namespace: false,
            runtime_class: None,
            pod_ip: None,
            deleting: false,
        }
    }

    /// What is seen, every app's end as the API reports it too (the kubelet has seen it), and
    /// each sidecar also as a native one.
    fn observed(apps: &[(&str, AppState)], sidecars: &[(&str, SidecarState)], quits_done: &[&str]) -> Observed {
        let sidecars: BTreeMap<String, SidecarState> = sidecars.iter().map(|(n, s)| ((*n).to_owned(), *s)).collect();
        Observed {
            apps: apps.iter().map(|(n, s)| ((*n).to_owned(), *s)).collect(),
            natives: sidecars.clone(),
            sidecars,
            quits_done: quits_done.iter().map(|n| (*n).to_owned()).collect(),
            recorded: apps
                .iter()
                .filter(|(_, s)| matches!(s, AppState::Exited(_)))
                .map(|(n, _)| (*n).to_owned())
                .collect(),
        }
    }

    fn quit(list: &[&str]) -> Decision {
        Decision::Quit(names(list))
    }

    fn running(list: &[&str]) -> Decision {
        Decision::Wait(WaitReason::AppsRunning(names(list)))
    }

    fn failed(list: &[&str]) -> Decision {
        Decision::Wait(WaitReason::AppWillRestart(names(list)))
    }

    /// What the rules say once every app has exited with `outcome`.
    fn expected_after_all_exit(policy: RestartPolicy, outcome: ExitOutcome, apps: &[&str]) -> Decision {
        match policy {
            RestartPolicy::Always => Decision::Ignore(IgnoreReason::RestartAlways),
            RestartPolicy::Never => quit(&["istio-proxy"]),
            RestartPolicy::OnFailure if outcome.success() => quit(&["istio-proxy"]),
            RestartPolicy::OnFailure => failed(apps),
        }
    }

    #[test]
    fn exit_outcomes() {
        assert!(ExitOutcome::Code(0).success());
        for o in [
            ExitOutcome::Code(1),
            ExitOutcome::Code(137),
            ExitOutcome::Code(-1),
            ExitOutcome::Signal(9),
            ExitOutcome::Signal(0),
        ] {
            assert!(!o.success(), "{o:?}");
        }
    }

    #[test]
    fn one_app_every_policy_and_outcome() {
        let sc = [("istio-proxy", SidecarState::Running)];
        for policy in POLICIES {
            let p = plan(policy, &["app"], &["istio-proxy"]);
            let before = if policy == RestartPolicy::Always {
                Decision::Ignore(IgnoreReason::RestartAlways)
            } else {
                running(&["app"])
            };
            for state in [AppState::Waiting, AppState::Running] {
                assert_eq!(decide(&p, &observed(&[("app", state)], &sc, &[])), before, "{policy:?} {state:?}");
            }
            for outcome in OUTCOMES {
                let o = observed(&[("app", AppState::Exited(outcome))], &sc, &[]);
                assert_eq!(
                    decide(&p, &o),
                    expected_after_all_exit(policy, outcome, &["app"]),
                    "{policy:?} {outcome:?}"
                );
            }
        }
    }

    #[test]
    fn several_apps_quit_only_after_the_last() {
        let apps = ["a", "b", "c"];
        let orders = [[0, 1, 2], [0, 2, 1], [1, 0, 2], [1, 2, 0], [2, 0, 1], [2, 1, 0]];
        let sc = [("istio-proxy", SidecarState::Running)];
        for policy in [RestartPolicy::Never, RestartPolicy::OnFailure] {
            let p = plan(policy, &apps, &["istio-proxy"]);
            for outcome in OUTCOMES {
                for order in orders {
                    let mut states: Vec<(&str, AppState)> = apps.iter().map(|a| (*a, AppState::Running)).collect();
                    for (step, &i) in order.iter().enumerate() {
                        states[i].1 = AppState::Exited(outcome);
                        let got = decide(&p, &observed(&states, &sc, &[]));
                        let exited: Vec<&str> = order[..=step].iter().map(|&j| apps[j]).collect();
                        let still: Vec<&str> = apps.iter().copied().filter(|a| !exited.contains(a)).collect();
                        let want = if policy == RestartPolicy::OnFailure && !outcome.success() {
                            // Spec order, not exit order.
                            let mut f = exited.clone();
                            f.sort_unstable();
                            failed(&f)
                        } else if still.is_empty() {
                            quit(&["istio-proxy"])
                        } else {
                            running(&still)
                        };
                        assert_eq!(got, want, "{policy:?} {outcome:?} order {order:?} step {step}");
                    }
                }
            }
        }
    }

    #[test]
    fn mixed_outcomes() {
        let sc = [("istio-proxy", SidecarState::Running)];
        let ok = AppState::Exited(ExitOutcome::Code(0));
        let bad = AppState::Exited(ExitOutcome::Code(1));
        let killed = AppState::Exited(ExitOutcome::Signal(9));
        let apps = [("a", ok), ("b", bad), ("c", AppState::Running), ("d", killed)];
        let never = plan(RestartPolicy::Never, &["a", "b", "c", "d"], &["istio-proxy"]);
        let on_failure = plan(RestartPolicy::OnFailure, &["a", "b", "c", "d"], &["istio-proxy"]);
        assert_eq!(decide(&never, &observed(&apps, &sc, &[])), running(&["c"]));
        // Under OnFailure the failures explain the wait, even with an app still running.
        assert_eq!(decide(&on_failure, &observed(&apps, &sc, &[])), failed(&["b", "d"]));
        let all_exited = [("a", ok), ("b", bad), ("c", ok), ("d", killed)];
        assert_eq!(decide(&never, &observed(&all_exited, &sc, &[])), quit(&["istio-proxy"]));
        assert_eq!(decide(&on_failure, &observed(&all_exited, &sc, &[])), failed(&["b", "d"]));
        // The kubelet restarted them and they succeeded this time.
        let restarted = [("a", ok), ("b", ok), ("c", ok), ("d", ok)];
        assert_eq!(decide(&on_failure, &observed(&restarted, &sc, &[])), quit(&["istio-proxy"]));
        let restarting = [("a", ok), ("b", AppState::Running), ("c", ok), ("d", AppState::Waiting)];
        assert_eq!(decide(&on_failure, &observed(&restarting, &sc, &[])), running(&["b", "d"]));
    }

    #[test]
    fn missing_app_state_counts_as_waiting() {
        let exited = AppState::Exited(ExitOutcome::Code(0));
        for policy in [RestartPolicy::Never, RestartPolicy::OnFailure] {
            let p = plan(policy, &["a", "b"], &["istio-proxy"]);
            assert_eq!(decide(&p, &Observed::default()), running(&["a", "b"]), "{policy:?}");
            assert_eq!(decide(&p, &observed(&[("b", exited)], &[], &[])), running(&["a"]), "{policy:?}");
            // State of containers the plan does not know is irrelevant.
            let o = observed(&[("a", exited), ("zzz", AppState::Running)], &[], &[]);
            assert_eq!(decide(&p, &o), running(&["b"]), "{policy:?}");
        }
    }

    #[test]
    fn sidecars_already_exited_or_quit() {
        let done = [("app", AppState::Exited(ExitOutcome::Code(0)))];
        let sidecars = ["istio-proxy", "cloud-sql-proxy", "envoy"];
        for policy in [RestartPolicy::Never, RestartPolicy::OnFailure] {
            let p = plan(policy, &["app"], &sidecars);
            let all_running: Vec<_> = sidecars.iter().map(|s| (*s, SidecarState::Running)).collect();
            assert_eq!(decide(&p, &observed(&done, &all_running, &[])), quit(&sidecars));
            // Unknown and missing sidecars are quit too (they may well be running).
            let o = observed(&done, &[("istio-proxy", SidecarState::Unknown)], &[]);
            assert_eq!(decide(&p, &o), quit(&sidecars));
            let o = observed(&done, &[("cloud-sql-proxy", SidecarState::Exited)], &["envoy"]);
            assert_eq!(decide(&p, &o), quit(&["istio-proxy"]), "{policy:?}");
            // Spec order, whatever was quit before.
            let o = observed(&done, &[], &["cloud-sql-proxy"]);
            assert_eq!(decide(&p, &o), quit(&["istio-proxy", "envoy"]));
            let o = observed(&done, &[("istio-proxy", SidecarState::Exited)], &["cloud-sql-proxy", "envoy"]);
            assert_eq!(decide(&p, &o), Decision::Done);
            let o = observed(&done, &[], &sidecars);
            assert_eq!(decide(&p, &o), Decision::Done);
            let all_exited: Vec<_> = sidecars.iter().map(|s| (*s, SidecarState::Exited)).collect();
            assert_eq!(decide(&p, &observed(&done, &all_exited, &[])), Decision::Done);
            // Quit but still running (it is on its way out): not asked again.
            let o = observed(&done, &all_running, &sidecars);
            assert_eq!(decide(&p, &o), Decision::Done);
        }
    }

    #[test]
    fn sidecars_gone_before_the_work_is_done_still_wait() {
        // A crashed sidecar does not make the pod done: the app's end is what valet waits for.
        let p = plan(RestartPolicy::Never, &["app"], &["istio-proxy"]);
        let o = observed(&[("app", AppState::Running)], &[("istio-proxy", SidecarState::Exited)], &[]);
        assert_eq!(decide(&p, &o), running(&["app"]));
        let o = observed(&[("app", AppState::Running)], &[], &["istio-proxy"]);
        assert_eq!(decide(&p, &o), running(&["app"]));
    }

    #[test]
    fn ignored_pods() {
        let all_done = observed(
            &[("app", AppState::Exited(ExitOutcome::Code(0)))],
            &[("istio-proxy", SidecarState::Running)],
            &[],
        );
        for policy in POLICIES {
            let mut p = plan(policy, &["app"], &["istio-proxy"]);
            p.deleting = true;
            assert_eq!(decide(&p, &all_done), Decision::Ignore(IgnoreReason::Deleting), "{policy:?}");

            let mut p = plan(policy, &["app"], &[]);
            p.native_sidecars = names(&["istio-proxy"]);
            let want = if policy == RestartPolicy::Always {
                IgnoreReason::RestartAlways
            } else {
                IgnoreReason::NativeSidecars
            };
            assert_eq!(decide(&p, &all_done), Decision::Ignore(want), "{policy:?}");
            // A native sidecar valet does not quit beside a regular one: the native one is the
            // kubelet's business, the regular one is quit (otherwise the Job hangs on it).
            let mut p = plan(policy, &["app"], &["cloud-sql-proxy"]);
            p.native_sidecars = names(&["istio-proxy"]);
            let want_mixed = if policy == RestartPolicy::Always {
                Decision::Ignore(IgnoreReason::RestartAlways)
            } else {
                quit(&["cloud-sql-proxy"])
            };
            let mixed_done = observed(
                &[("app", AppState::Exited(ExitOutcome::Code(0)))],
                &[("cloud-sql-proxy", SidecarState::Running)],
                &[],
            );
            assert_eq!(decide(&p, &mixed_done), want_mixed, "{policy:?}");

            let want = |r| {
                if policy == RestartPolicy::Always { IgnoreReason::RestartAlways } else { r }
            };
            let p = plan(policy, &["app"], &[]);
            assert_eq!(decide(&p, &all_done), Decision::Ignore(want(IgnoreReason::NoSidecars)), "{policy:?}");
            let p = plan(policy, &[], &["istio-proxy"]);
            assert_eq!(decide(&p, &all_done), Decision::Ignore(want(IgnoreReason::NoApps)), "{policy:?}");
        }
    }

    #[test]
    fn always_never_acts() {
        let p = plan(RestartPolicy::Always, &["a", "b"], &["istio-proxy"]);
        for outcome in OUTCOMES {
            for sc in [SidecarState::Running, SidecarState::Exited, SidecarState::Unknown] {
                let o = observed(
                    &[("a", AppState::Exited(outcome)), ("b", AppState::Exited(outcome))],
                    &[("istio-proxy", sc)],
                    &[],
                );
                assert_eq!(decide(&p, &o), Decision::Ignore(IgnoreReason::RestartAlways));
            }
        }
    }

    /// From real pod JSON through `spec::plan` to the decision.
    #[test]
    fn fixtures_end_to_end() {
        let defaults = SidecarDefaults::default();
        let plan_of = |pod| match spec::plan(&pod, &defaults) {
            Ok(p) => p,
            Err(e) => panic!("{e}"),
        };
        let istio = plan_of(fixtures::istio_job());
        let o = observed(&[("report", AppState::Exited(ExitOutcome::Code(3)))], &[], &[]);
        assert_eq!(decide(&istio, &o), quit(&["istio-proxy"]));

        let linkerd = plan_of(fixtures::linkerd_job());
        let o = observed(&[("migrate", AppState::Exited(ExitOutcome::Code(3)))], &[], &[]);
        assert_eq!(decide(&linkerd, &o), failed(&["migrate"]));
        let o = observed(&[("migrate", AppState::Exited(ExitOutcome::Code(0)))], &[], &[]);
        assert_eq!(decide(&linkerd, &o), quit(&["linkerd-proxy"]));

        let sql = plan_of(fixtures::cloud_sql_job());
        let o = observed(&[("etl", AppState::Exited(ExitOutcome::Code(0)))], &[], &[]);
        assert_eq!(decide(&sql, &o), running(&["notify"]));

        // The native istio-proxy is quit once the app has ended, however it ended (Never); the
        // regular init container before it is no app.
        let native = plan_of(fixtures::native_sidecar_job());
        assert_eq!(decide(&native, &Observed::default()), running(&["train"]));
        let o = observed(&[("train", AppState::Running)], &[("istio-proxy", SidecarState::Running)], &[]);
        assert_eq!(decide(&native, &o), running(&["train"]));
        for outcome in OUTCOMES {
            let o = observed(&[("train", AppState::Exited(outcome))], &[("istio-proxy", SidecarState::Running)], &[]);
            assert_eq!(decide(&native, &o), quit(&["istio-proxy"]), "{outcome:?}");
            let o = observed(&[("train", AppState::Exited(outcome))], &[("istio-proxy", SidecarState::Exited)], &[]);
            assert_eq!(decide(&native, &o), Decision::Done, "stopped by the kubelet first: {outcome:?}");
        }

        let overridden = plan_of(fixtures::override_job());
        assert_eq!(decide(&overridden, &Observed::default()), Decision::Ignore(IgnoreReason::RestartAlways));
    }

    /// A pod as the API serves it: `restartPolicy: Never`, an app with the given container
    /// fields, and an Istio proxy.
    fn rules_plan(app: serde_json::Value) -> PodPlan {
        let mut c = serde_json::json!({"name": "app", "image": "busybox"});
        c.as_object_mut().expect("object").extend(app.as_object().expect("object").clone());
        let pod = fixtures::pod(serde_json::json!({
            "restartPolicy": "Never",
            "containers": [c, {"name": "istio-proxy", "image": "docker.io/istio/proxyv2:1.26.0"}],
        }));
        spec::plan(&pod, &SidecarDefaults::default()).expect("plan")
    }

    fn app_ended(outcome: ExitOutcome) -> Observed {
        observed(&[("app", AppState::Exited(outcome))], &[("istio-proxy", SidecarState::Running)], &[])
    }

    #[test]
    fn an_exit_the_apps_rule_restarts_keeps_the_proxy() {
        let p = rules_plan(serde_json::json!({"restartPolicy": "Never", "restartPolicyRules": [
            {"action": "Restart", "exitCodes": {"operator": "In", "values": [42]}}]}));
        assert_eq!(
            decide(&p, &app_ended(ExitOutcome::Code(42))),
            Decision::Wait(WaitReason::AppWillRestart(names(&["app"])))
        );
        for outcome in [ExitOutcome::Code(0), ExitOutcome::Code(1), ExitOutcome::Signal(9), ExitOutcome::Code(137)] {
            assert_eq!(decide(&p, &app_ended(outcome)), quit(&["istio-proxy"]), "{outcome:?}");
        }
        // A signal is 128 + n to the kubelet's rules.
        let p = rules_plan(serde_json::json!({"restartPolicy": "Never", "restartPolicyRules": [
            {"action": "Restart", "exitCodes": {"operator": "In", "values": [137]}}]}));
        assert_eq!(
            decide(&p, &app_ended(ExitOutcome::Signal(9))),
            Decision::Wait(WaitReason::AppWillRestart(names(&["app"])))
        );
        // An end whose code is not known yet cannot be judged against a rule.
        assert_eq!(
            decide(&p, &app_ended(ExitOutcome::Unknown)),
            Decision::Wait(WaitReason::AppEndUnsure(names(&["app"])))
        );
    }

    #[test]
    fn the_apps_own_on_failure_overrides_the_pods_never() {
        let p = rules_plan(serde_json::json!({"restartPolicy": "OnFailure"}));
        assert_eq!(decide(&p, &app_ended(ExitOutcome::Code(1))), failed(&["app"]));
        assert_eq!(decide(&p, &app_ended(ExitOutcome::Signal(15))), failed(&["app"]));
        assert_eq!(decide(&p, &app_ended(ExitOutcome::Code(0))), quit(&["istio-proxy"]));
    }

    #[test]
    fn restart_all_containers_keeps_the_proxy() {
        let p = rules_plan(serde_json::json!({"restartPolicy": "Never", "restartPolicyRules": [
            {"action": "RestartAllContainers", "exitCodes": {"operator": "NotIn", "values": [0]}}]}));
        assert_eq!(decide(&p, &app_ended(ExitOutcome::Code(3))), failed(&["app"]));
        assert_eq!(decide(&p, &app_ended(ExitOutcome::Code(0))), quit(&["istio-proxy"]));
    }

    #[test]
    fn an_unknown_action_leaves_the_exits_it_matches_to_the_kubelet() {
        let p = rules_plan(serde_json::json!({"restartPolicy": "Never", "restartPolicyRules": [
            {"action": "RestartSandbox", "exitCodes": {"operator": "In", "values": [7]}}]}));
        assert_eq!(
            decide(&p, &app_ended(ExitOutcome::Code(7))),
            Decision::Wait(WaitReason::AppEndUnsure(names(&["app"])))
        );
        assert_eq!(decide(&p, &app_ended(ExitOutcome::Code(0))), quit(&["istio-proxy"]));
        assert_eq!(
            p.unknown_restart_rules(),
            vec!["container \"app\" restartPolicyRules[0].action \"RestartSandbox\"".to_owned()]
        );
    }

    #[test]
    fn an_app_that_always_restarts_never_finishes_and_a_sidecar_that_would_is_not_quit() {
        let p = rules_plan(serde_json::json!({"restartPolicy": "Always"}));
        assert_eq!(decide(&p, &app_ended(ExitOutcome::Code(0))), Decision::Ignore(IgnoreReason::RestartAlways));
        // A pod-level Always, an app that ends for good: the proxy (the pod's Always) would be
        // restarted after its quit, so it is not quit.
        let pod = fixtures::pod(serde_json::json!({
            "restartPolicy": "Always",
            "containers": [{"name": "app", "image": "busybox", "restartPolicy": "Never"},
                           {"name": "istio-proxy", "image": "docker.io/istio/proxyv2:1.26.0"}],
        }));
        let p = spec::plan(&pod, &SidecarDefaults::default()).expect("plan");
        assert_eq!(decide(&p, &app_ended(ExitOutcome::Code(0))), Decision::Ignore(IgnoreReason::RestartAlways));
        // ... unless the proxy's own policy lets it end.
        let pod = fixtures::pod(serde_json::json!({
            "restartPolicy": "Always",
            "containers": [{"name": "app", "image": "busybox", "restartPolicy": "Never"},
                           {"name": "istio-proxy", "image": "docker.io/istio/proxyv2:1.26.0", "restartPolicy": "OnFailure"}],
        }));
        let p = spec::plan(&pod, &SidecarDefaults::default()).expect("plan");
        assert_eq!(decide(&p, &app_ended(ExitOutcome::Code(0))), quit(&["istio-proxy"]));
    }

    /// Istio's native proxy beside a log shipper declared after it, both native sidecars valet
    /// quits.
    fn two_natives() -> PodPlan {
        let pod = fixtures::pod(serde_json::json!({
            "restartPolicy": "Never",
            "initContainers": [
                {"name": "istio-proxy", "image": "docker.io/istio/proxyv2:1.27.0", "restartPolicy": "Always"},
                {"name": "logs", "image": "fluent/fluent-bit:3.0", "restartPolicy": "Always"},
            ],
            "containers": [{"name": "app", "image": "busybox"}],
        }));
        let pod = fixtures::with_annotations(
            pod,
            &[(spec::SIDECARS, "istio-proxy,logs"), ("valet.dev/sidecar-kind.logs", "signal")],
        );
        spec::plan(&pod, &SidecarDefaults::default()).expect("plan")
    }

    #[test]
    fn a_native_sidecar_waits_for_the_kubelet_to_report_the_apps_end() {
        let p = plan_of_native();
        let mut o = observed(
            &[("train", AppState::Exited(ExitOutcome::Code(0)))],
            &[("istio-proxy", SidecarState::Running)],
            &[],
        );
        o.recorded.clear();
        assert_eq!(
            decide(&p, &o),
            Decision::Wait(WaitReason::KubeletBehind { sidecars: names(&["istio-proxy"]), apps: names(&["train"]) })
        );
        o.recorded.insert("train".into());
        assert_eq!(decide(&p, &o), quit(&["istio-proxy"]));
    }

    fn plan_of_native() -> PodPlan {
        spec::plan(&fixtures::native_sidecar_job(), &SidecarDefaults::default()).expect("plan")
    }

    #[test]
    fn a_regular_sidecar_is_quit_at_the_kernels_word() {
        let p = plan(RestartPolicy::Never, &["app"], &["istio-proxy"]);
        let mut o = app_ended(ExitOutcome::Code(0));
        o.recorded.clear();
        o.natives.clear();
        assert_eq!(decide(&p, &o), quit(&["istio-proxy"]));
    }

    #[test]
    fn native_sidecars_are_quit_last_first() {
        let p = two_natives();
        let ended = AppState::Exited(ExitOutcome::Code(0));
        let both_running = observed(
            &[("app", ended)],
            &[("istio-proxy", SidecarState::Running), ("logs", SidecarState::Running)],
            &[],
        );
        assert_eq!(decide(&p, &both_running), quit(&["logs"]));
        // Accepted is not exited: istio-proxy still waits.
        let logs_quit = observed(
            &[("app", ended)],
            &[("istio-proxy", SidecarState::Running), ("logs", SidecarState::Running)],
            &["logs"],
        );
        assert_eq!(decide(&p, &logs_quit), Decision::Wait(WaitReason::SidecarsAfter(names(&["istio-proxy"]))));
        let logs_gone = observed(
            &[("app", ended)],
            &[("istio-proxy", SidecarState::Running), ("logs", SidecarState::Exited)],
            &["logs"],
        );
        assert_eq!(decide(&p, &logs_gone), quit(&["istio-proxy"]));
        // A later native sidecar valet does not quit: its exit (the kubelet's doing) opens the turn.
        let mut only_istio = p.clone();
        only_istio.sidecars.retain(|s| s.name == "istio-proxy");
        assert_eq!(
            decide(&only_istio, &both_running),
            Decision::Wait(WaitReason::SidecarsAfter(names(&["istio-proxy"])))
        );
        assert_eq!(decide(&only_istio, &logs_gone), quit(&["istio-proxy"]));
    }
}
