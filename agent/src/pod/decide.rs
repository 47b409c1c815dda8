//! The decision: given a pod's plan and what has been observed of its containers, should valet
//! quit the sidecars now, keep waiting, or leave the pod alone?
//!
//! Kubernetes facts behind the rules: a Job pod succeeds only once every container has exited 0;
//! with `restartPolicy: Never` an exited app stays exited, with `OnFailure` the kubelet restarts
//! an app that failed in place (so its sidecar is still needed), with `Always` nothing finishes.

use std::collections::{BTreeMap, BTreeSet};

use super::spec::{PodPlan, RestartPolicy};

/// How a container's main process ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ExitOutcome {
    /// Exited with this status (the API's `exitCode`; 137 there usually means SIGKILL).
    Code(i32),
    /// Killed by this signal (seen by the kernel path before the runtime turns it into 128+n).
    Signal(i32),
}

impl ExitOutcome {
    /// Only a clean `exit(0)` counts as success.
    pub fn success(&self) -> bool {
        matches!(self, ExitOutcome::Code(0))
    }
}

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
}

/// Why valet does nothing for a pod, ever (until its plan changes).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum IgnoreReason {
    /// The pod is being deleted: the kubelet is stopping every container anyway.
    Deleting,
    /// `restartPolicy: Always`: the containers never finish.
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
    /// `restartPolicy: OnFailure` and these apps (spec order) failed: the kubelet restarts them
    /// in place, and they will need the proxy again.
    AppFailedWillRestart(Vec<String>),
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

    let failed: Vec<String> = plan
        .apps
        .iter()
        .filter(|app| matches!(state(app), AppState::Exited(outcome) if !outcome.success()))
        .cloned()
        .collect();
    // A failure is reported first under OnFailure: it explains the wait even when other apps run.
    if plan.restart_policy == RestartPolicy::OnFailure && !failed.is_empty() {
        return Decision::Wait(WaitReason::AppFailedWillRestart(failed));
    }
    let unfinished: Vec<String> =
        plan.apps.iter().filter(|app| !matches!(state(app), AppState::Exited(_))).cloned().collect();
    if !unfinished.is_empty() {
        return Decision::Wait(WaitReason::AppsRunning(unfinished));
    }

    let to_quit: Vec<String> = plan
        .sidecars
        .iter()
        .map(|s| &s.name)
        .filter(|name| !observed.quits_done.contains(*name))
        .filter(|name| observed.sidecars.get(*name) != Some(&SidecarState::Exited))
        .cloned()
        .collect();
    if to_quit.is_empty() { Decision::Done } else { Decision::Quit(to_quit) }
}

fn ignore_reason(plan: &PodPlan) -> Option<IgnoreReason> {
    if plan.deleting {
        Some(IgnoreReason::Deleting)
    } else if plan.restart_policy == RestartPolicy::Always {
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
    use crate::pod::spec::{self, DEFAULT_HOLD_TIMEOUT, Sidecar, SidecarDefaults, SidecarKind};

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
            hold_app: false,
            hold_timeout: DEFAULT_HOLD_TIMEOUT,
            istio_holds_app: false,
            host_pid: false,
            runtime_class: None,
            pod_ip: None,
            deleting: false,
        }
    }

    fn observed(apps: &[(&str, AppState)], sidecars: &[(&str, SidecarState)], quits_done: &[&str]) -> Observed {
        Observed {
            apps: apps.iter().map(|(n, s)| ((*n).to_owned(), *s)).collect(),
            sidecars: sidecars.iter().map(|(n, s)| ((*n).to_owned(), *s)).collect(),
            quits_done: quits_done.iter().map(|n| (*n).to_owned()).collect(),
        }
    }

    fn quit(list: &[&str]) -> Decision {
        Decision::Quit(names(list))
    }

    fn running(list: &[&str]) -> Decision {
        Decision::Wait(WaitReason::AppsRunning(names(list)))
    }

    fn failed(list: &[&str]) -> Decision {
        Decision::Wait(WaitReason::AppFailedWillRestart(names(list)))
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
}
