//! What one pod's API object shows about its sidecars' cost: whether its apps ended while a
//! sidecar still runs, when they ended, when the last sidecar ended, which apps have started and
//! whether the kubelet already reported the proxy ready. Pure functions over the Pod object.
//!
//! Times come from the kubelet's container statuses (`finishedAt`, whole seconds): the observer
//! must not need the kernel path, which only pods valet acts on have.

use std::collections::BTreeSet;

use chrono::{DateTime, Utc};
use k8s_openapi::api::core::v1::{ContainerStatus, Pod};

use crate::api::watch::ENABLED_LABEL;
use crate::pod::spec::{self, Endpoint, RestartPolicy, SidecarDefaults, SpecError};

/// What owns the pod, as the `owner_kind` label says it: bounded to three values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OwnerKind {
    Job,
    /// A Job a CronJob made.
    CronJob,
    Other,
}

impl OwnerKind {
    pub fn as_str(self) -> &'static str {
        match self {
            OwnerKind::Job => "Job",
            OwnerKind::CronJob => "CronJob",
            OwnerKind::Other => "other",
        }
    }
}

/// Minutes since the Unix epoch that a CronJob's Job name may end with: 2000-01-01 to 2100-01-01.
const CRON_MINUTES: std::ops::RangeInclusive<u64> = 15_778_080..=68_374_080;

/// The owner kind from the pod's controller reference. A pod names only its Job; the CronJob
/// controller names the Jobs it makes `<cronjob>-<scheduled time in minutes since the epoch>`,
/// which tells a CronJob's Job without reading Job objects (which the agent's RBAC does not
/// allow). A hand-made Job named like that is counted as a CronJob's.
pub fn owner_kind(pod: &Pod) -> OwnerKind {
    let owners = pod.metadata.owner_references.as_deref().unwrap_or_default();
    let Some(owner) = owners.iter().find(|o| o.controller == Some(true)).or(owners.first()) else {
        return OwnerKind::Other;
    };
    if owner.kind != "Job" || !owner.api_version.starts_with("batch/") {
        return OwnerKind::Other;
    }
    let scheduled = owner.name.rsplit_once('-').and_then(|(_, tail)| tail.parse::<u64>().ok());
    match scheduled {
        Some(minutes) if CRON_MINUTES.contains(&minutes) => OwnerKind::CronJob,
        _ => OwnerKind::Job,
    }
}

/// One pod as the observer sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Look {
    pub uid: String,
    pub namespace: String,
    pub owner_kind: OwnerKind,
    /// Carries the opt-in label.
    pub labelled: bool,
    /// Every app container has ended for good (a Job's pod: `restartPolicy` Never, or OnFailure
    /// and exit code 0): the latest end. None while one runs or may run again, and always for
    /// `restartPolicy: Always`.
    pub apps_ended: Option<DateTime<Utc>>,
    /// Every regular sidecar has ended: the latest end.
    pub sidecars_ended: Option<DateTime<Utc>>,
    /// A regular sidecar runs now.
    pub sidecar_running: bool,
    /// App containers the API shows started at least once.
    pub apps_started: BTreeSet<String>,
    /// The first sidecar with a readiness endpoint: its name and endpoint.
    pub proxy: Option<(String, Endpoint)>,
    /// The kubelet reports that proxy ready.
    pub proxy_ready: bool,
    /// `valet.dev/hold-app: "true"` (the observer keeps it only where valet acts).
    pub hold_app: bool,
}

impl Look {
    /// The apps have ended and a sidecar still runs: the pod waits on its sidecars.
    pub fn waiting(&self) -> bool {
        self.apps_ended.is_some() && self.sidecar_running
    }
}

fn status<'a>(pod: &'a Pod, name: &str) -> Option<&'a ContainerStatus> {
    pod.status.as_ref()?.container_statuses.as_ref()?.iter().find(|s| s.name == name)
}

/// When the container's current instance ended, if it did.
fn finished(s: &ContainerStatus) -> Option<DateTime<Utc>> {
    let at = s.state.as_ref()?.terminated.as_ref()?.finished_at.as_ref()?.0;
    DateTime::from_timestamp(at.as_second(), at.subsec_nanosecond().try_into().ok()?)
}

/// Reads a pod. `Ok(None)`: it has no sidecar valet knows (nothing to observe). `Err`: its
/// valet annotations are wrong (the same error the controller reports for a labelled pod).
pub fn look(pod: &Pod, defaults: &SidecarDefaults) -> Result<Option<Look>, SpecError> {
    let plan = spec::plan(pod, defaults)?;
    if plan.sidecars.is_empty() {
        return Ok(None);
    }
    let runs_to_completion = plan.restart_policy != RestartPolicy::Always;
    let mut apps_ended = (runs_to_completion && !plan.apps.is_empty()).then_some(DateTime::<Utc>::MIN_UTC);
    let mut apps_started = BTreeSet::new();
    for app in &plan.apps {
        let s = status(pod, app);
        let state = s.and_then(|s| s.state.as_ref());
        let started = state.is_some_and(|st| st.running.is_some() || st.terminated.is_some())
            || s.is_some_and(|s| s.restart_count > 0);
        if started {
            apps_started.insert(app.clone());
        }
        let code = state.and_then(|st| st.terminated.as_ref()).map(|t| t.exit_code);
        let for_good = plan.restart_policy == RestartPolicy::Never || code == Some(0);
        apps_ended = match (apps_ended, s.and_then(finished)) {
            (Some(latest), Some(end)) if for_good => Some(latest.max(end)),
            _ => None,
        };
    }
    let mut sidecars_ended = Some(DateTime::<Utc>::MIN_UTC);
    let mut sidecar_running = false;
    for sidecar in &plan.sidecars {
        let s = status(pod, &sidecar.name);
        sidecar_running |= s.and_then(|s| s.state.as_ref()).is_some_and(|st| st.running.is_some());
        sidecars_ended = match (sidecars_ended, s.and_then(finished)) {
            (Some(latest), Some(end)) => Some(latest.max(end)),
            _ => None,
        };
    }
    let proxy = plan.sidecars.iter().find_map(|s| s.ready.clone().map(|e| (s.name.clone(), e)));
    let proxy_ready = proxy.as_ref().and_then(|(name, _)| status(pod, name)).is_some_and(|s| s.ready);
    Ok(Some(Look {
        uid: plan.uid,
        namespace: plan.namespace,
        owner_kind: owner_kind(pod),
        labelled: pod.metadata.labels.as_ref().and_then(|l| l.get(ENABLED_LABEL)).map(String::as_str) == Some("true"),
        apps_ended,
        sidecars_ended,
        sidecar_running,
        apps_started,
        proxy,
        proxy_ready,
        hold_app: plan.hold_app,
    }))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use serde_json::{Value, json};

    /// An Istio Job pod; `app`/`proxy`: the containers' `state` objects, `ready`: the proxy's.
    pub fn pod(app: Value, proxy: Value, ready: bool) -> Pod {
        serde_json::from_value(json!({
            "metadata": {
                "name": "p", "namespace": "jobs", "uid": "u1",
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

    pub fn ended(at: &str) -> Value {
        json!({"terminated": {"exitCode": 0, "finishedAt": at}})
    }

    pub fn running() -> Value {
        json!({"running": {"startedAt": "2026-01-01T00:00:00Z"}})
    }

    pub fn waiting() -> Value {
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
        assert_eq!(l.apps_ended, Some(at("2026-01-01T00:01:00Z")));
        assert_eq!(l.sidecars_ended, None);
        assert_eq!(l.owner_kind, OwnerKind::Job);
        assert!(!l.labelled);
        assert!(l.proxy_ready);
        assert_eq!(l.proxy.as_ref().map(|(n, e)| (n.as_str(), e.port)), Some(("istio-proxy", 15021)));
        assert_eq!(l.apps_started.iter().collect::<Vec<_>>(), ["app"]);

        let done = look(&pod(ended("2026-01-01T00:01:00Z"), ended("2026-01-01T00:11:30Z"), false), &d)
            .expect("ok")
            .expect("observed");
        assert!(!done.waiting());
        assert_eq!(done.sidecars_ended, Some(at("2026-01-01T00:11:30Z")));
    }

    #[test]
    fn apps_that_run_or_may_restart_have_not_ended() {
        let d = SidecarDefaults::default();
        let l = look(&pod(running(), running(), true), &d).expect("ok").expect("observed");
        assert!(!l.waiting());
        let l = look(&pod(waiting(), running(), false), &d).expect("ok").expect("observed");
        assert!(l.apps_started.is_empty());
        assert!(!l.proxy_ready);

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
    fn owner_kinds() {
        let with_owner = |api: &str, kind: &str, name: &str| {
            let mut p = pod(running(), running(), true);
            let o = &mut p.metadata.owner_references.as_mut().expect("owners")[0];
            (o.api_version, o.kind, o.name) = (api.into(), kind.into(), name.into());
            owner_kind(&p)
        };
        assert_eq!(with_owner("batch/v1", "Job", "report"), OwnerKind::Job);
        assert_eq!(with_owner("batch/v1", "Job", "report-29412345"), OwnerKind::CronJob);
        assert_eq!(with_owner("batch/v1", "Job", "report-12"), OwnerKind::Job, "not a time in minutes");
        assert_eq!(with_owner("batch/v1", "Job", "report-99999999999"), OwnerKind::Job, "beyond 2100");
        assert_eq!(with_owner("apps/v1", "ReplicaSet", "web-5d8f9"), OwnerKind::Other);
        assert_eq!(with_owner("example.com/v1", "Job", "x"), OwnerKind::Other);
        let mut p = pod(running(), running(), true);
        p.metadata.owner_references = None;
        assert_eq!(owner_kind(&p), OwnerKind::Other);
    }
}
