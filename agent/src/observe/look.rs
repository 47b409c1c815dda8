//! What one pod's API object shows about its sidecars' cost: whether its apps ended while a
//! sidecar still runs, when they ended, when the last sidecar ended, which apps have started,
//! when the kubelet moved on to them, and whether it already reported the proxy ready. Pure
//! functions over the Pod object.
//!
//! Times come from the kubelet's container statuses (`startedAt`, `finishedAt`) and conditions
//! (`lastTransitionTime`), all whole seconds: the observer must not need the kernel path, which
//! only pods valet acts on have.

use std::collections::BTreeSet;

use chrono::{DateTime, Utc};
use k8s_openapi::api::core::v1::{ContainerStatus, Pod};

use crate::api::watch::opted_in;
use crate::pod::decide::ExitOutcome;
use crate::pod::spec::{self, Endpoint, PodPlan, SidecarDefaults, SpecError};
use crate::vocab::{Sidecar, SidecarKind};

/// What owns the pod, as the `owner_kind` label says it: bounded to three values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OwnerKind {
    Job,
    /// A Job a CronJob made.
    CronJob,
    Other,
}

impl OwnerKind {
    pub const ALL: [OwnerKind; 3] = [OwnerKind::Job, OwnerKind::CronJob, OwnerKind::Other];

    pub fn as_str(self) -> &'static str {
        match self {
            OwnerKind::Job => "Job",
            OwnerKind::CronJob => "CronJob",
            OwnerKind::Other => "other",
        }
    }
}

/// How long after its Job's scheduled time a CronJob's pod may be created: the CronJob
/// controller makes the Job at the scheduled minute (or, after missed schedules, within its
/// `startingDeadlineSeconds`), and the Job controller makes a pod at once and new ones after
/// failures with a back-off capped at 6 minutes (`backoffLimit` 6 by default: under an hour). A
/// day covers late schedules with room to spare while a date-like suffix (`migrate-20240115`,
/// minutes since the epoch of 2008) stays years away.
const CRON_POD_LAG: chrono::TimeDelta = chrono::TimeDelta::days(1);
/// Clocks disagree: the scheduled minute may be slightly after the pod's creation as stamped.
const CRON_CLOCK_SKEW: chrono::TimeDelta = chrono::TimeDelta::minutes(5);

/// The owner kind from the pod's controller reference. A pod names only its Job; the CronJob
/// controller names the Jobs it makes `<cronjob>-<scheduled time in minutes since the epoch>`,
/// which tells a CronJob's Job without reading Job objects (which the agent's RBAC does not
/// allow). The suffix must be a scheduled time the pod's own creation follows within
/// [`CRON_POD_LAG`] (a pod without a creation time is a Job's): a hand-made Job named with the
/// minute of its own pod's creation (or of the day before) is still counted as a CronJob's.
pub fn owner_kind(pod: &Pod) -> OwnerKind {
    let owners = pod.metadata.owner_references.as_deref().unwrap_or_default();
    let Some(owner) = owners.iter().find(|o| o.controller == Some(true)).or(owners.first()) else {
        return OwnerKind::Other;
    };
    if owner.kind != "Job" || !owner.api_version.starts_with("batch/") {
        return OwnerKind::Other;
    }
    let Some(created) = pod.metadata.creation_timestamp.as_ref().and_then(|t| to_utc(&t.0)) else {
        return OwnerKind::Job;
    };
    let scheduled = owner
        .name
        .rsplit_once('-')
        .filter(|(_, tail)| tail.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|(_, tail)| tail.parse::<i64>().ok())
        .and_then(|minutes| minutes.checked_mul(60))
        .and_then(|seconds| DateTime::from_timestamp(seconds, 0));
    match scheduled {
        Some(at) if at - CRON_CLOCK_SKEW <= created && created - at <= CRON_POD_LAG => OwnerKind::CronJob,
        _ => OwnerKind::Job,
    }
}

fn to_utc(at: &k8s_openapi::jiff::Timestamp) -> Option<DateTime<Utc>> {
    DateTime::from_timestamp(at.as_second(), at.subsec_nanosecond().try_into().ok()?)
}

/// How a pod's sidecars run, as the `sidecar_mode` label says it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SidecarMode {
    /// Regular containers in `spec.containers`: nothing ends them but a quit, a signal or the
    /// pod's deletion.
    Classic,
    /// Init containers with `restartPolicy: Always` (KEP-753): the kubelet ends them once every
    /// regular container has ended.
    Native,
}

impl SidecarMode {
    pub const ALL: [SidecarMode; 2] = [SidecarMode::Classic, SidecarMode::Native];

    pub fn as_str(self) -> &'static str {
        match self {
            SidecarMode::Classic => "classic",
            SidecarMode::Native => "native",
        }
    }
}

/// One pod as the observer sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Look {
    pub uid: String,
    pub namespace: String,
    pub owner_kind: OwnerKind,
    /// Native when the pod has a native sidecar (the kubelet then ends them all after its apps).
    pub mode: SidecarMode,
    /// Carries the opt-in label.
    pub labelled: bool,
    pub apps: AppsSeen,
    pub sidecars: SidecarsSeen,
    /// The first sidecar with a readiness endpoint (a regular one first).
    pub proxy: Option<ProxySeen>,
    /// When the kubelet moved on to the apps: the pod's `Initialized` condition turned True
    /// (its `lastTransitionTime`, whole seconds). The kubelet's `GeneratePodInitializedCondition`
    /// makes it True once every regular init container has succeeded and every native sidecar
    /// has `started` (passed its startupProbe); its status manager stamps the time when it sets
    /// the status at the top of the pod's sync, before that sync pulls, creates and starts the
    /// app containers. None while False or absent.
    pub initialized_at: Option<DateTime<Utc>>,
    /// `metadata.deletionTimestamp`: the pod is gone by then at the latest.
    pub deleted_at: Option<DateTime<Utc>>,
    /// `valet.dev/hold-app: "true"` (the observer keeps it only where valet acts).
    pub hold_app: bool,
}

/// The pod's app containers, as the API shows them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AppsSeen {
    /// Every app container has ended for good (a Job's pod: `restartPolicy` Never, or OnFailure
    /// and exit code 0): the latest end. None while one runs or may run again, and always for
    /// `restartPolicy: Always`.
    pub ended: Option<DateTime<Utc>>,
    /// App containers the API shows started at least once.
    pub started: BTreeSet<String>,
    /// App containers the API shows running now.
    pub running: BTreeSet<String>,
    /// The earliest start of an app container the API shows (`startedAt`, whole seconds).
    pub first_started: Option<DateTime<Utc>>,
}

/// The pod's sidecars, as the API shows them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SidecarsSeen {
    /// Every sidecar has ended (the regular containers valet knows as sidecars, and every native
    /// sidecar): the latest end.
    pub ended: Option<DateTime<Utc>>,
    /// One of those sidecars runs now.
    pub running: bool,
    /// A mesh's proxy (Istio's or Linkerd's) runs as a regular container: injected classic.
    pub mesh_classic: bool,
    /// A native sidecar runs now: this node's kubelet supports them.
    pub native_running: bool,
}

/// The pod's proxy: the first sidecar with a readiness endpoint, as the API shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProxySeen {
    pub name: String,
    pub endpoint: Endpoint,
    /// The kubelet reports it ready.
    pub ready: bool,
    /// It runs now.
    pub running: bool,
    /// A run-to-completion init container is declared after it (a native proxy): it runs
    /// between the proxy's readiness and the kubelet's move to the apps, so that wait is not the
    /// proxy's.
    pub init_after: bool,
}

impl Look {
    /// The apps have ended and a sidecar still runs: the pod waits on its sidecars.
    pub fn waiting(&self) -> bool {
        self.apps.ended.is_some() && self.sidecars.running
    }

    /// The kubelet reports the proxy ready (false: not, or no proxy).
    pub fn proxy_ready(&self) -> bool {
        self.proxy.as_ref().is_some_and(|p| p.ready)
    }
}

/// `metadata.deletionTimestamp`: the pod is gone by then at the latest.
pub fn deleted_at(pod: &Pod) -> Option<DateTime<Utc>> {
    pod.metadata.deletion_timestamp.as_ref().and_then(|t| to_utc(&t.0))
}

fn status<'a>(pod: &'a Pod, name: &str) -> Option<&'a ContainerStatus> {
    pod.status.as_ref()?.container_statuses.as_ref()?.iter().find(|s| s.name == name)
}

fn init_status<'a>(pod: &'a Pod, name: &str) -> Option<&'a ContainerStatus> {
    pod.status.as_ref()?.init_container_statuses.as_ref()?.iter().find(|s| s.name == name)
}

/// When the container's current instance ended, if it did.
fn finished(s: &ContainerStatus) -> Option<DateTime<Utc>> {
    to_utc(&s.state.as_ref()?.terminated.as_ref()?.finished_at.as_ref()?.0)
}

/// When the container's current instance (or, once it ended, its last one) started.
fn started_at(s: &ContainerStatus) -> Option<DateTime<Utc>> {
    let state = s.state.as_ref()?;
    let at = state.running.as_ref().and_then(|r| r.started_at.as_ref());
    to_utc(&at.or_else(|| state.terminated.as_ref().and_then(|t| t.started_at.as_ref()))?.0)
}

/// When the pod's `Initialized` condition turned True, if it is True.
fn initialized_at(pod: &Pod) -> Option<DateTime<Utc>> {
    let conditions = pod.status.as_ref()?.conditions.as_ref()?;
    let initialized = conditions.iter().find(|c| c.type_ == "Initialized" && c.status == "True")?;
    to_utc(&initialized.last_transition_time.as_ref()?.0)
}

fn running(s: Option<&ContainerStatus>) -> bool {
    s.and_then(|s| s.state.as_ref()).is_some_and(|st| st.running.is_some())
}

/// Reads a pod. `Ok(None)`: it has no sidecar valet knows (nothing to observe). `Err`: its
/// valet annotations are wrong (the same error the controller reports for a labelled pod).
///
/// A native sidecar is known as a regular one is: by the agent's sidecar names, or listed in
/// `valet.dev/sidecars`. Once a pod has one, every native sidecar of it counts: the kubelet ends
/// them all after the apps, and the pod waits on each.
pub fn look(pod: &Pod, defaults: &SidecarDefaults) -> Result<Option<Look>, SpecError> {
    let plan = spec::plan(pod, defaults)?;
    let native: BTreeSet<&str> = plan.native_sidecars.iter().map(String::as_str).collect();
    // Regular containers only (should the plan come to list native sidecars too).
    let classic: Vec<&Sidecar> = plan.sidecars.iter().filter(|s| !native.contains(s.name.as_str())).collect();
    // Known by the default names, or listed as the pod's sidecars (where the plan lists native
    // ones among them).
    let known_native = native.iter().any(|n| defaults.names.iter().any(|d| d == n))
        || plan.sidecars.iter().any(|s| native.contains(s.name.as_str()));
    if classic.is_empty() && !known_native {
        return Ok(None);
    }
    let native: Vec<&str> = if known_native { native.into_iter().collect() } else { Vec::new() };
    Ok(Some(Look {
        owner_kind: owner_kind(pod),
        mode: if native.is_empty() { SidecarMode::Classic } else { SidecarMode::Native },
        labelled: opted_in(pod),
        apps: apps_seen(pod, &plan),
        sidecars: sidecars_seen(pod, &plan, &classic, &native),
        proxy: proxy_seen(pod, &plan, &classic, &native),
        initialized_at: initialized_at(pod),
        deleted_at: deleted_at(pod),
        hold_app: plan.hold_app,
        uid: plan.uid,
        namespace: plan.namespace,
    }))
}

fn apps_seen(pod: &Pod, plan: &PodPlan) -> AppsSeen {
    let runs_to_completion = !plan.apps_never_end();
    let mut seen = AppsSeen {
        ended: (runs_to_completion && !plan.apps.is_empty()).then_some(DateTime::<Utc>::MIN_UTC),
        ..AppsSeen::default()
    };
    for app in &plan.apps {
        let s = status(pod, app);
        let state = s.and_then(|s| s.state.as_ref());
        let started = state.is_some_and(|st| st.running.is_some() || st.terminated.is_some())
            || s.is_some_and(|s| s.restart_count > 0);
        if started {
            seen.started.insert(app.clone());
        }
        if running(s) {
            seen.running.insert(app.clone());
        }
        if let Some(at) = s.and_then(started_at) {
            seen.first_started = Some(seen.first_started.map_or(at, |first: DateTime<Utc>| first.min(at)));
        }
        let code = state.and_then(|st| st.terminated.as_ref()).map(|t| t.exit_code);
        let for_good = code.is_some_and(|c| plan.after_exit(app, ExitOutcome::Code(c)).stays());
        seen.ended = match (seen.ended, s.and_then(finished)) {
            (Some(latest), Some(end)) if for_good => Some(latest.max(end)),
            _ => None,
        };
    }
    seen
}

/// `classic`: the regular containers valet knows as sidecars; `native`: the native sidecars
/// that count.
fn sidecars_seen(pod: &Pod, plan: &PodPlan, classic: &[&Sidecar], native: &[&str]) -> SidecarsSeen {
    let statuses = classic.iter().map(|s| status(pod, &s.name)).chain(native.iter().map(|n| init_status(pod, n)));
    let mut ended = Some(DateTime::<Utc>::MIN_UTC);
    let mut running_now = false;
    for s in statuses {
        running_now |= running(s);
        ended = match (ended, s.and_then(finished)) {
            (Some(latest), Some(end)) => Some(latest.max(end)),
            _ => None,
        };
    }
    SidecarsSeen {
        ended,
        running: running_now,
        mesh_classic: classic.iter().any(|s| matches!(s.kind, SidecarKind::Istio | SidecarKind::Linkerd)),
        native_running: plan.native_sidecars.iter().any(|n| running(init_status(pod, n))),
    }
}

/// The first sidecar with a readiness endpoint: a regular one first, else a native one of a
/// kind whose readiness valet knows.
fn proxy_seen(pod: &Pod, plan: &PodPlan, classic: &[&Sidecar], native: &[&str]) -> Option<ProxySeen> {
    let native_proxy = || {
        native.iter().find_map(|n| {
            let endpoint = spec::kind_from_name(n)?.ready_endpoint()?;
            Some(((*n).to_owned(), endpoint, init_status(pod, n)))
        })
    };
    let (name, endpoint, s) = match classic.iter().find_map(|s| s.ready.clone().map(|e| (s.name.clone(), e))) {
        Some((name, e)) => {
            let s = status(pod, &name);
            (name, e, s)
        }
        None => native_proxy()?,
    };
    // Only a native proxy's startup is measured (a classic one starts beside the apps).
    let init_after =
        plan.init_containers.iter().skip_while(|c| **c != name).skip(1).any(|c| !plan.native_sidecars.contains(c));
    Some(ProxySeen { ready: s.is_some_and(|s| s.ready), running: running(s), init_after, name, endpoint })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use serde_json::{Value, json};

    /// An Istio Job pod; `app`/`proxy`: the containers' `state` objects, `ready`: the proxy's.
    pub(crate) fn pod(app: Value, proxy: Value, ready: bool) -> Pod {
        serde_json::from_value(json!({
            "metadata": {
                "name": "p", "namespace": "jobs", "uid": "u1", "creationTimestamp": "2026-01-01T00:00:00Z",
                "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": "report", "uid": "j",
                                     "controller": true}]
            },
            "spec": {"restartPolicy": "Never", "containers": [{"name": "app"}, {"name": "istio-proxy", "image": "istio/proxyv2"}]},
            "status": {"containerStatuses": [
                {"name": "app", "image": "i", "imageID": "", "ready": false, "restartCount": 0, "state": app},
                {"name": "istio-proxy", "image": "i", "imageID": "", "ready": ready, "restartCount": 0, "state": proxy}
            ]}
        }))
        .expect("pod")
    }

    /// An Istio Job pod whose proxy is a native sidecar (Istio 1.27's injection on a 1.33 node).
    pub(crate) fn native_pod(app: Value, proxy: Value, ready: bool) -> Pod {
        let mut p = serde_json::to_value(pod(app.clone(), proxy.clone(), ready)).expect("json");
        p["spec"]["containers"] = json!([{"name": "app"}]);
        p["spec"]["initContainers"] = json!([
            {"name": "istio-validation", "image": "istio/proxyv2"},
            {"name": "istio-proxy", "image": "istio/proxyv2", "restartPolicy": "Always"}
        ]);
        p["status"]["containerStatuses"] =
            json!([{"name": "app", "image": "i", "imageID": "", "ready": false, "restartCount": 0, "state": app}]);
        p["status"]["initContainerStatuses"] = json!([
            {"name": "istio-validation", "image": "i", "imageID": "", "ready": false, "restartCount": 0,
             "state": {"terminated": {"exitCode": 0, "finishedAt": "2026-01-01T00:00:00Z"}}},
            {"name": "istio-proxy", "image": "i", "imageID": "", "ready": ready, "restartCount": 0, "state": proxy}
        ]);
        serde_json::from_value(p).expect("pod")
    }

    pub(crate) fn started(at: &str) -> Value {
        json!({"running": {"startedAt": at}})
    }

    pub(crate) fn ended(at: &str) -> Value {
        json!({"terminated": {"exitCode": 0, "finishedAt": at}})
    }

    pub(crate) fn running() -> Value {
        json!({"running": {"startedAt": "2026-01-01T00:00:00Z"}})
    }

    pub(crate) fn waiting() -> Value {
        json!({"waiting": {"reason": "ContainerCreating"}})
    }

    fn at(s: &str) -> DateTime<Utc> {
        s.parse().expect("time")
    }

    #[test]
    fn a_job_whose_app_ended_waits_on_its_running_proxy() {
        let d = SidecarDefaults::default();
        let l = look(&pod(ended("2026-01-01T00:01:00Z"), running(), true), &d).expect("ok").expect("observed");
        assert!(l.waiting());
        assert_eq!(l.apps.ended, Some(at("2026-01-01T00:01:00Z")));
        assert_eq!(l.sidecars.ended, None);
        assert_eq!(l.owner_kind, OwnerKind::Job);
        assert!(!l.labelled);
        assert!(l.proxy_ready());
        assert_eq!(l.proxy.as_ref().map(|p| (p.name.as_str(), p.endpoint.port)), Some(("istio-proxy", 15021)));
        assert_eq!(l.apps.started.iter().collect::<Vec<_>>(), ["app"]);

        let done = look(&pod(ended("2026-01-01T00:01:00Z"), ended("2026-01-01T00:11:30Z"), false), &d)
            .expect("ok")
            .expect("observed");
        assert!(!done.waiting());
        assert_eq!(done.sidecars.ended, Some(at("2026-01-01T00:11:30Z")));
    }

    #[test]
    fn apps_that_run_or_may_restart_have_not_ended() {
        let d = SidecarDefaults::default();
        let l = look(&pod(running(), running(), true), &d).expect("ok").expect("observed");
        assert!(!l.waiting());
        let l = look(&pod(waiting(), running(), false), &d).expect("ok").expect("observed");
        assert!(l.apps.started.is_empty());
        assert!(!l.proxy_ready());

        // OnFailure and a failed exit: the kubelet starts the app again.
        let mut p = pod(json!({"terminated": {"exitCode": 1, "finishedAt": "2026-01-01T00:01:00Z"}}), running(), true);
        p.spec.as_mut().expect("spec").restart_policy = Some("OnFailure".into());
        assert!(!look(&p, &d).expect("ok").expect("observed").waiting());
        // Always: never a finished Job.
        let mut p = pod(ended("2026-01-01T00:01:00Z"), running(), true);
        p.spec.as_mut().expect("spec").restart_policy = Some("Always".into());
        assert!(!look(&p, &d).expect("ok").expect("observed").waiting());
        // No finishedAt: not known to have ended.
        let p = pod(json!({"terminated": {"exitCode": 0}}), running(), true);
        assert!(!look(&p, &d).expect("ok").expect("observed").waiting());
    }

    #[test]
    fn pods_without_a_known_sidecar_are_not_observed_and_bad_annotations_are_errors() {
        let d = SidecarDefaults::default();
        let mut p = pod(running(), running(), true);
        p.spec.as_mut().expect("spec").containers[1].name = "logger".into();
        assert_eq!(look(&p, &d), Ok(None));
        let mut p = pod(running(), running(), true);
        p.metadata.annotations = Some([("valet.dev/hold-app".to_owned(), "maybe".to_owned())].into());
        assert_eq!(look(&p, &d).map_err(|e| e.reason()), Err("MalformedAnnotation"));
    }

    #[test]
    fn a_native_sidecar_pod_is_observed_and_waits_on_its_native_proxy() {
        let d = SidecarDefaults::default();
        let l = look(&native_pod(waiting(), running(), false), &d).expect("ok").expect("observed");
        assert_eq!(l.mode, SidecarMode::Native);
        assert!(l.sidecars.native_running && !l.sidecars.mesh_classic);
        assert!(l.proxy.as_ref().is_some_and(|p| p.running) && !l.proxy_ready());
        assert_eq!(l.proxy.as_ref().map(|p| (p.name.as_str(), p.endpoint.port)), Some(("istio-proxy", 15021)));
        assert_eq!(l.apps.first_started, None);
        // The validation init container ended long ago: not a sidecar, not a sidecar's end.
        let l = look(&native_pod(ended("2026-01-01T00:01:00Z"), running(), true), &d).expect("ok").expect("observed");
        assert!(l.waiting());
        assert_eq!(l.sidecars.ended, None);
        let l = look(&native_pod(ended("2026-01-01T00:01:00Z"), ended("2026-01-01T00:01:06Z"), false), &d)
            .expect("ok")
            .expect("observed");
        assert!(!l.waiting());
        assert_eq!(l.sidecars.ended, Some(at("2026-01-01T00:01:06Z")));
        let l = look(&native_pod(started("2026-01-01T00:00:10Z"), running(), true), &d).expect("ok").expect("observed");
        assert_eq!(l.apps.first_started, Some(at("2026-01-01T00:00:10Z")));
        assert_eq!(l.apps.running.iter().collect::<Vec<_>>(), ["app"]);

        // A classic Istio pod: a mesh proxy injected as a regular container.
        let l = look(&pod(waiting(), running(), false), &d).expect("ok").expect("observed");
        assert_eq!(l.mode, SidecarMode::Classic);
        assert!(l.sidecars.mesh_classic && !l.sidecars.native_running);

        // A native sidecar valet does not know, alone: nothing to observe.
        let mut p = native_pod(waiting(), running(), false);
        p.spec.as_mut().expect("spec").init_containers.as_mut().expect("init")[1].name = "log-shipper".into();
        assert_eq!(look(&p, &d), Ok(None));
    }

    /// `native_pod` whose `Initialized` condition is `status`, turned so at `at`.
    pub(crate) fn initialized(mut p: Pod, status: &str, at: &str) -> Pod {
        let condition = json!({"type": "Initialized", "status": status, "lastTransitionTime": at});
        let conditions = vec![
            serde_json::from_value(json!({"type": "PodScheduled", "status": "True",
                                          "lastTransitionTime": "2026-01-01T00:00:00Z"}))
            .expect("condition"),
            serde_json::from_value(condition).expect("condition"),
        ];
        p.status.as_mut().expect("status").conditions = Some(conditions);
        p
    }

    #[test]
    fn the_kubelets_move_to_the_apps_is_its_initialized_condition() {
        let d = SidecarDefaults::default();
        let l = look(&native_pod(waiting(), running(), false), &d).expect("ok").expect("observed");
        assert_eq!(l.initialized_at, None, "no condition yet");
        let p = initialized(native_pod(waiting(), running(), false), "False", "2026-01-01T00:00:01Z");
        assert_eq!(look(&p, &d).expect("ok").expect("observed").initialized_at, None, "not initialized");
        let p = initialized(native_pod(waiting(), running(), true), "True", "2026-01-01T00:00:03Z");
        let l = look(&p, &d).expect("ok").expect("observed");
        assert_eq!(l.initialized_at, Some(at("2026-01-01T00:00:03Z")));
        assert!(!l.proxy.as_ref().expect("a proxy").init_after, "istio-validation runs before the proxy");

        // A migration declared after the proxy runs between its readiness and the apps.
        let mut p = native_pod(waiting(), running(), false);
        let init = p.spec.as_mut().expect("spec").init_containers.as_mut().expect("init");
        init.push(serde_json::from_value(json!({"name": "migrate"})).expect("container"));
        assert!(look(&p, &d).expect("ok").expect("observed").proxy.expect("a proxy").init_after);
        // Another native sidecar after it does not run to completion: still measured.
        let init = p.spec.as_mut().expect("spec").init_containers.as_mut().expect("init");
        init[2] = serde_json::from_value(json!({"name": "logs", "restartPolicy": "Always"})).expect("container");
        assert!(!look(&p, &d).expect("ok").expect("observed").proxy.expect("a proxy").init_after);
    }

    #[test]
    fn owner_kinds() {
        // The fixture pod was created at 2026-01-01T00:00:00Z: minute 29,453,760 since the epoch.
        let with_owner = |api: &str, kind: &str, name: &str| {
            let mut p = pod(running(), running(), true);
            let o = &mut p.metadata.owner_references.as_mut().expect("owners")[0];
            (o.api_version, o.kind, o.name) = (api.into(), kind.into(), name.into());
            owner_kind(&p)
        };
        assert_eq!(with_owner("batch/v1", "Job", "report"), OwnerKind::Job);
        assert_eq!(with_owner("batch/v1", "Job", "report-29453760"), OwnerKind::CronJob, "scheduled at its creation");
        assert_eq!(with_owner("batch/v1", "Job", "report-29452320"), OwnerKind::CronJob, "a day late at most");
        assert_eq!(with_owner("batch/v1", "Job", "report-29453763"), OwnerKind::CronJob, "clock skew");
        assert_eq!(with_owner("batch/v1", "Job", "report-29452319"), OwnerKind::Job, "over a day before");
        assert_eq!(with_owner("batch/v1", "Job", "report-29453770"), OwnerKind::Job, "after its pod");
        // Date-like names are not scheduled times (20240115 minutes: 2008-06-26).
        for dated in ["migrate-20240115", "backup-202401151200", "etl-2024", "v-20260101", "report-12"] {
            assert_eq!(with_owner("batch/v1", "Job", dated), OwnerKind::Job, "{dated}");
        }
        assert_eq!(with_owner("batch/v1", "Job", "report-99999999999999999999"), OwnerKind::Job, "overflow");
        assert_eq!(with_owner("batch/v1", "Job", "report-+29431440"), OwnerKind::Job, "digits only");
        assert_eq!(with_owner("apps/v1", "ReplicaSet", "web-5d8f9"), OwnerKind::Other);
        assert_eq!(with_owner("example.com/v1", "Job", "x"), OwnerKind::Other);
        let mut p = pod(running(), running(), true);
        p.metadata.owner_references = None;
        assert_eq!(owner_kind(&p), OwnerKind::Other);
        // No creation time: nothing to compare the suffix with.
        let mut p = pod(running(), running(), true);
        p.metadata.owner_references.as_mut().expect("owners")[0].name = "report-29453760".into();
        p.metadata.creation_timestamp = None;
        assert_eq!(owner_kind(&p), OwnerKind::Job);
    }
}
