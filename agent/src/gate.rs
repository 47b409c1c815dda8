//! Startup gating: learn when each opted-in pod's proxy is ready, publish it as the
//! `valet.dev/ProxyReady` condition, and release app processes the kernel held at exec
//! (`valet.dev/hold-app`) as soon as the proxy is ready, or when the hold times out (fail open).

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::time::{Duration, Instant};

use k8s_openapi::api::core::v1::Pod;
use kube::Client;
use tokio::sync::{mpsc, watch};
use tracing::{debug, info, warn};

use crate::api::condition::{self, ProxyReady};
use crate::api::events::{EventSink, pod_reference};
use crate::cgroup::signal::signal_in_cgroup;
use crate::cgroup::{CgroupFs, ContainerDir, PodDir};
use crate::config::Config;
use crate::controller::ActionResult;
use crate::kernel::HeldProcess;
use crate::kernel::events::monotonic_ns;
use crate::metrics::{Metrics, ReasonLabels, ResultLabels};
use crate::pod::spec::{PodPlan, Sidecar, SidecarKind};
use crate::pod::status::{current_id, name_of_id, pod_name};
use crate::sidecar::http::{self, Limits};
use crate::sidecar::netns::open_pod_netns;

/// Probe interval while an app is held: the release latency is about half of it.
const HELD_PROBE_INTERVAL: Duration = Duration::from_millis(5);
/// Probe interval once the proxy was seen ready (keeps the condition current, cheaply).
const READY_PROBE_INTERVAL: Duration = Duration::from_secs(5);

/// Results of the gate's background tasks.
#[derive(Debug)]
pub enum GateAction {
    Probed { uid: String, ready: bool, detail: String },
    ConditionWritten { uid: String, want: ProxyReady, ok: bool, error: Option<String> },
}

/// How a probe loop should pace itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pace {
    /// An app is held: probe fast.
    Urgent,
    /// Not ready yet, nothing held.
    Normal,
    /// Seen ready: refresh slowly.
    Relaxed,
    /// Pod done: stop.
    Stop,
}

/// A process held at exec.
#[derive(Clone, Debug)]
struct Held {
    tgid: u32,
    container_rel: String,
    container_id: Option<String>,
    since_ktime: u64,
}

#[derive(Default)]
struct GatePod {
    ready: Option<bool>,
    held: Vec<Held>,
    hold_started: Option<Instant>,
    failed_open: bool,
    /// Last condition written (or being written), to write only on change.
    written: Option<ProxyReady>,
    /// A condition write is in flight: the next one waits for it, so writes never overtake each
    /// other and leave an older state on the pod.
    writing: bool,
    /// The pod's work is done (its sidecars are being quit): no more probes or condition writes,
    /// so the proxy going away does not flip the condition back.
    finished: bool,
    pace: Option<watch::Sender<Pace>>,
    /// What the running probe loop was started with (pod IP, pod cgroup); a change restarts it.
    probe_target: (Option<String>, Option<String>),
    adopted: bool,
    /// Container cgroups whose init an earlier agent held: their first exec is done.
    adopted_from: Vec<u64>,
    /// Whether the kernel holds this pod's containers, and the pod's cgroup (for the sweep at
    /// shutdown).
    hold: bool,
    pod_rel: Option<String>,
}

/// The startup gate of every tracked pod.
pub struct Gate {
    cfg: Arc<Config>,
    client: Client,
    cgroups: CgroupFs,
    metrics: Arc<Metrics>,
    events: EventSink,
    results: mpsc::UnboundedSender<ActionResult>,
    pods: HashMap<String, GatePod>,
}

fn sidecar_ready_in_api(pod: &Pod, plan: &PodPlan) -> bool {
    let statuses = pod.status.as_ref().and_then(|s| s.container_statuses.as_ref());
    !plan.sidecars.is_empty()
        && plan.sidecars.iter().all(|sc| statuses.into_iter().flatten().any(|s| s.name == sc.name && s.ready))
}

fn all_apps_finished(pod: &Pod, plan: &PodPlan) -> bool {
    let statuses = pod.status.as_ref().and_then(|s| s.container_statuses.as_ref());
    !plan.apps.is_empty()
        && plan.apps.iter().all(|a| {
            statuses
                .into_iter()
                .flatten()
                .any(|s| s.name == *a && s.state.as_ref().is_some_and(|st| st.terminated.is_some()))
        })
}

/// One readiness probe of one sidecar.
fn probe_once(
    sidecar: &Sidecar,
    pod_ip: Option<IpAddr>,
    host_proc: &std::path::Path,
    cgroups: &CgroupFs,
    pod_rel: Option<&str>,
) -> (bool, String) {
    let limits = Limits {
        connect_timeout: Duration::from_millis(200),
        total_timeout: Duration::from_millis(500),
        max_response_bytes: 4096,
    };
    let path = sidecar.ready.path.clone();
    let port = sidecar.ready.port;
    // From inside the pod's network namespace first: health listeners bound to loopback
    // (Envoy's admin, cloud-sql-proxy's default) answer there, and no network policy or routing
    // stands between. The pod IP, as the kubelet probes, until the pod's processes are found.
    let in_pod = pod_rel.and_then(|rel| open_pod_netns(host_proc, cgroups, rel).ok());
    let result = match (in_pod, pod_ip) {
        (Some(netns), _) => {
            let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
            match netns.run_blocking(move || http::request(addr, "GET", &path, limits)) {
                Ok(r) => r,
                Err(e) => return (false, e.to_string()),
            }
        }
        (None, Some(ip)) if !matches!(sidecar.kind, SidecarKind::Envoy) => {
            http::request(SocketAddr::new(ip, port), "GET", &path, limits)
        }
        _ => return (false, "no live process of the pod and no reachable pod IP yet".into()),
    };
    match result {
        Ok(r) if (200..300).contains(&r.status) => (true, format!("{} answered {}", sidecar.name, r.status)),
        Ok(r) => (false, format!("{} answered {}", sidecar.name, r.status)),
        Err(f) => (false, format!("{}: {f}", sidecar.name)),
    }
}

impl Gate {
    pub fn new(
        cfg: Arc<Config>,
        client: Client,
        cgroups: CgroupFs,
        metrics: Arc<Metrics>,
        events: EventSink,
        results: mpsc::UnboundedSender<ActionResult>,
    ) -> Gate {
        Gate { cfg, client, cgroups, metrics, events, results, pods: HashMap::new() }
    }

    /// Whether the kernel should hold this pod's app containers.
    pub fn wants_hold(&self, plan: &PodPlan) -> bool {
        plan.hold_app
            && !plan.istio_holds_app
            && plan.native_sidecars.is_empty()
            && !plan.sidecars.is_empty()
            && !plan.apps.is_empty()
    }

    /// Called whenever the pod changed: starts probing, re-classifies held processes, adopts
    /// processes an earlier agent left stopped.
    pub fn on_pod(&mut self, uid: &str, pod: &Pod, plan: &PodPlan, pod_dir: Option<&PodDir>) {
        if plan.sidecars.is_empty() || plan.deleting {
            self.stop(uid);
            return;
        }
        let hold = self.wants_hold(plan);
        let done = all_apps_finished(pod, plan) || self.pods.get(uid).is_some_and(|p| p.finished);
        let target = (plan.pod_ip.clone(), pod_dir.map(|d| d.rel.clone()));
        let needs_probe = !done && self.pods.get(uid).is_none_or(|p| p.pace.is_none() || p.probe_target != target);
        let probe = needs_probe.then(|| self.spawn_probe(uid, plan, pod_dir));
        let entry = self.pods.entry(uid.to_owned()).or_default();
        entry.hold = hold;
        if let Some(dir) = pod_dir {
            entry.pod_rel = Some(dir.rel.clone());
        }
        if done {
            if let Some(pace) = &entry.pace {
                let _ = pace.send(Pace::Stop);
            }
        } else if let Some(probe) = probe {
            if let Some(old) = entry.pace.replace(probe) {
                let _ = old.send(Pace::Stop);
            }
            entry.probe_target = target;
        }
        if hold && let Some(dir) = pod_dir {
            self.adopt(uid, pod, plan, dir);
        }
        let Some(entry) = self.pods.get_mut(uid) else { return };
        // Held processes whose container turned out not to be an app: release now.
        let mut release = Vec::new();
        entry.held.retain(|h| {
            if h.container_id.as_deref().is_some_and(|id| !may_be_app(pod, plan, id)) {
                release.push((h.clone(), "not_app"));
                false
            } else {
                true
            }
        });
        // The kubelet's own readiness probe of the sidecar passed: the proxy has been ready, so
        // nothing is left to wait for. Only a release trigger: the condition reflects the agent's
        // own probe, so a lagging API view can never make it flap.
        if sidecar_ready_in_api(pod, plan) {
            release.extend(std::mem::take(&mut entry.held).into_iter().map(|h| (h, "ready")));
        }
        if entry.held.is_empty() {
            entry.hold_started = None;
        }
        for (h, why) in release {
            self.release(uid, pod, &h, why);
        }
        self.update_pace(uid);
        self.sync_condition(uid, pod);
    }

    /// Takes over processes an earlier instance of the agent left stopped at exec (it was killed
    /// while holding them), once per pod, as soon as the pod's cgroup is known: those of app
    /// containers and of containers the API does not name yet are held again (released on
    /// readiness or the hold timeout, never left stopped); those of known non-app containers
    /// (the sidecar, init containers) are released at once.
    fn adopt(&mut self, uid: &str, pod: &Pod, plan: &PodPlan, dir: &PodDir) {
        let Some(entry) = self.pods.get_mut(uid) else { return };
        if entry.adopted {
            return;
        }
        entry.adopted = true;
        let mut release = Vec::new();
        for c in self.cgroups.containers(&dir.rel) {
            let name = name_of_id(pod, &c.container.id);
            let is_app = name.as_ref().is_some_and(|n| plan.apps.contains(n));
            for pid in self.cgroups.procs(&c.rel) {
                if entry.held.iter().any(|h| h.tgid == pid) || !held_at_exec(&self.cfg.host_proc, pid) {
                    continue;
                }
                entry.adopted_from.push(c.id);
                let h = Held {
                    tgid: pid,
                    container_rel: c.rel.clone(),
                    container_id: Some(c.container.id.clone()),
                    since_ktime: monotonic_ns(),
                };
                if name.is_some() && !is_app {
                    release.push(h);
                    continue;
                }
                info!(
                    pod = %pod_name(pod),
                    container = name.as_deref().unwrap_or("<not yet in the API>"),
                    pid,
                    "found a process left held by an earlier agent"
                );
                entry.held.push(h);
                entry.hold_started.get_or_insert_with(Instant::now);
            }
        }
        for h in release {
            self.release(uid, pod, &h, "not_app");
        }
    }

    /// Whether a container's first exec happened before this agent could judge it (an earlier
    /// agent held its init): then what it execs later must never be held.
    pub fn exec_done_before(&self, uid: &str, container: &ContainerDir) -> bool {
        self.pods.get(uid).is_some_and(|p| p.adopted_from.contains(&container.id))
            || self.cgroups.procs(&container.rel).into_iter().any(|pid| held_at_exec(&self.cfg.host_proc, pid))
    }

    fn spawn_probe(&self, uid: &str, plan: &PodPlan, pod_dir: Option<&PodDir>) -> watch::Sender<Pace> {
        let (tx, mut rx) = watch::channel(Pace::Normal);
        let sidecars = plan.sidecars.clone();
        let pod_ip: Option<IpAddr> = plan.pod_ip.as_deref().and_then(|ip| ip.parse().ok());
        let host_proc = self.cfg.host_proc.clone();
        let cgroups = self.cgroups.clone();
        let pod_rel = pod_dir.map(|d| d.rel.clone());
        let results = self.results.clone();
        let uid = uid.to_owned();
        let normal = self.cfg.probe_interval;
        tokio::spawn(async move {
            let mut backoff = normal;
            loop {
                let pace = *rx.borrow();
                if pace == Pace::Stop {
                    return;
                }
                let (sidecars, host_proc, cgroups, pod_rel) =
                    (sidecars.clone(), host_proc.clone(), cgroups.clone(), pod_rel.clone());
                let probed = tokio::task::spawn_blocking(move || {
                    let mut detail = Vec::new();
                    let mut ready = true;
                    for sc in &sidecars {
                        let (ok, why) = probe_once(sc, pod_ip, &host_proc, &cgroups, pod_rel.as_deref());
                        ready &= ok;
                        detail.push(why);
                    }
                    (ready, detail.join("; "))
                })
                .await;
                let (ready, detail) = probed.unwrap_or((false, "probe task failed".into()));
                if results.send(ActionResult::Gate(GateAction::Probed { uid: uid.clone(), ready, detail })).is_err() {
                    return;
                }
                let wait = match *rx.borrow() {
                    Pace::Urgent => HELD_PROBE_INTERVAL,
                    Pace::Relaxed => READY_PROBE_INTERVAL,
                    Pace::Stop => return,
                    Pace::Normal => {
                        // Back off while nothing waits on the answer.
                        backoff = (backoff * 2).min(Duration::from_secs(2));
                        backoff
                    }
                };
                tokio::select! {
                    _ = tokio::time::sleep(wait) => {}
                    changed = rx.changed() => if changed.is_err() { return },
                }
            }
        });
        tx
    }

    fn update_pace(&mut self, uid: &str) {
        let Some(p) = self.pods.get(uid) else { return };
        let Some(pace) = &p.pace else { return };
        let want = if !p.held.is_empty() {
            Pace::Urgent
        } else if p.ready == Some(true) {
            Pace::Relaxed
        } else {
            Pace::Normal
        };
        if *pace.borrow() != Pace::Stop && *pace.borrow() != want {
            let _ = pace.send(want);
        }
    }

    /// A process was stopped by the kernel at exec.
    pub fn on_held(
        &mut self,
        held: HeldProcess,
        uid: Option<String>,
        context: Option<(Pod, PodPlan, PodDir, Option<String>)>,
    ) -> Vec<GateAction> {
        self.metrics.holds.inc();
        let container_rel = context.as_ref().and_then(|(_, _, dir, _)| {
            self.cgroups
                .containers(&dir.rel)
                .into_iter()
                .find(|c| c.id == held.cgroup_id)
                .map(|c| (c.rel, c.container.id))
        });
        let (Some(uid), Some((pod, plan, _, name)), Some((rel, container_id))) = (uid, context, container_rel) else {
            // Held in a pod we no longer track, or a container we cannot place: never leave it.
            warn!(pid = held.tgid, "held process outside a tracked pod: releasing");
            // SAFETY: plain syscall on a pid the kernel just reported, still stopped.
            unsafe { libc::kill(held.tgid as i32, libc::SIGCONT) };
            self.metrics.releases.get_or_create(&ReasonLabels { reason: "untracked" }).inc();
            return Vec::new();
        };
        let h = Held {
            tgid: held.tgid,
            container_rel: rel,
            container_id: Some(container_id.clone()),
            since_ktime: held.ktime_ns,
        };
        // The pod sandbox's pause process starts before any container the API could name.
        let sandbox = name.is_none() && held.comm == "pause";
        let could_be_app = match &name {
            Some(n) => plan.apps.contains(n),
            None => may_be_app(&pod, &plan, &container_id),
        };
        if sandbox || !could_be_app {
            self.release(&uid, &pod, &h, "not_app");
            return Vec::new();
        }
        let entry = self.pods.entry(uid.clone()).or_default();
        if entry.held.iter().any(|x| x.tgid == h.tgid) {
            // Already adopted from the cgroup before its event arrived.
            return Vec::new();
        }
        if entry.ready == Some(true) {
            self.release(&uid, &pod, &h, "ready");
            return Vec::new();
        }
        if entry.failed_open {
            // The pod already failed open: its later containers do not wait either.
            self.release(&uid, &pod, &h, "timeout");
            return Vec::new();
        }
        info!(pod = %pod_name(&pod), container = name.as_deref().unwrap_or("<not yet in the API>"), pid = held.tgid, "holding app until the proxy is ready");
        entry.hold_started.get_or_insert_with(Instant::now);
        entry.held.push(h);
        self.update_pace(&uid);
        Vec::new()
    }

    fn release(&mut self, uid: &str, pod: &Pod, h: &Held, reason: &'static str) {
        match signal_in_cgroup(&self.cgroups, h.tgid, &h.container_rel, libc::SIGCONT) {
            Ok(()) => {
                let held_for = monotonic_ns().saturating_sub(h.since_ktime) as f64 / 1e9;
                self.metrics.hold_duration.observe(held_for);
                self.metrics.releases.get_or_create(&ReasonLabels { reason }).inc();
                info!(pod = %pod_name(pod), pid = h.tgid, reason, held_ms = held_for * 1e3, "released app");
            }
            Err(e) => debug!(pod = %pod_name(pod), pid = h.tgid, "release: {e}"),
        }
        let _ = uid;
    }

    fn on_ready(&mut self, uid: &str, pod: &Pod, detail: String) {
        let Some(entry) = self.pods.get_mut(uid) else { return };
        if entry.ready != Some(true) {
            debug!(pod = %pod_name(pod), %detail, "proxy ready");
        }
        entry.ready = Some(true);
        entry.hold_started = None;
        let held = std::mem::take(&mut entry.held);
        for h in &held {
            self.release(uid, pod, h, "ready");
        }
    }

    /// Results of probe and condition tasks.
    pub fn on_action(&mut self, action: GateAction, pod_of: impl Fn(&str) -> Option<Pod>) {
        match action {
            GateAction::Probed { uid, ready, detail } => {
                let Some(pod) = pod_of(&uid) else { return };
                if self.pods.get(&uid).is_some_and(|p| p.finished) {
                    return;
                }
                if ready {
                    self.on_ready(&uid, &pod, detail);
                } else if let Some(entry) = self.pods.get_mut(&uid) {
                    if entry.ready == Some(true) {
                        debug!(pod = %pod_name(&pod), %detail, "proxy no longer ready");
                    }
                    entry.ready = Some(false);
                }
                self.update_pace(&uid);
                self.sync_condition(&uid, &pod);
            }
            GateAction::ConditionWritten { uid, want, ok, error } => {
                let result = if ok { "ok" } else { "error" };
                self.metrics.condition_patches.get_or_create(&ResultLabels { result }).inc();
                if !ok {
                    warn!(%uid, "write {} condition: {}", condition::CONDITION_TYPE, error.unwrap_or_default());
                }
                if let Some(entry) = self.pods.get_mut(&uid) {
                    entry.writing = false;
                    // Let the next change retry a failed write.
                    if !ok && entry.written.as_ref() == Some(&want) {
                        entry.written = None;
                    }
                }
                // What changed while the write was in flight is written now, in order (a failed
                // write is retried by the next probe result, not in a loop against the API).
                if ok && let Some(pod) = pod_of(&uid) {
                    self.sync_condition(&uid, &pod);
                }
            }
        }
    }

    /// Writes the condition when what we want differs from what the pod shows and what we wrote.
    fn sync_condition(&mut self, uid: &str, pod: &Pod) {
        let Some(entry) = self.pods.get_mut(uid) else { return };
        let want = match (entry.ready, entry.failed_open) {
            (Some(true), _) => {
                ProxyReady { ready: true, reason: "ProxyReady", message: "the sidecar proxy reports ready".into() }
            }
            (_, true) => ProxyReady {
                ready: false,
                reason: "HoldTimeout",
                message: "the proxy was not ready in time; the app was released anyway".into(),
            },
            (Some(false), false) => ProxyReady {
                ready: false,
                reason: "ProxyNotReady",
                message: "the sidecar proxy is not ready yet".into(),
            },
            (None, false) => return,
        };
        if entry.writing {
            return;
        }
        if entry.written.as_ref() == Some(&want) || condition::already_set(pod, &want) {
            entry.written = Some(want);
            return;
        }
        entry.written = Some(want.clone());
        entry.writing = true;
        let client = self.client.clone();
        let results = self.results.clone();
        let (namespace, name) = (
            pod.metadata.namespace.clone().unwrap_or_else(|| "default".into()),
            pod.metadata.name.clone().unwrap_or_default(),
        );
        let uid = uid.to_owned();
        tokio::spawn(async move {
            let r = condition::write(client, &namespace, &name, &want).await;
            let (ok, error) = match r {
                Ok(()) => (true, None),
                Err(e) => (false, Some(e.to_string())),
            };
            let _ = results.send(ActionResult::Gate(GateAction::ConditionWritten { uid, want, ok, error }));
        });
    }

    /// Periodic work: catch up with pod cgroups found since the last pod update (probe through
    /// the pod's netns, adopt processes an earlier agent left held); fail open on hold timeouts.
    pub fn tick(&mut self, pods: &[(&str, &Pod, &PodPlan, Option<&PodDir>)]) -> Vec<GateAction> {
        for &(uid, pod, plan, dir) in pods {
            let Some(dir) = dir else { continue };
            let Some(entry) = self.pods.get(uid) else { continue };
            let probing = entry.pace.as_ref().is_some_and(|p| *p.borrow() != Pace::Stop);
            let stale_probe = probing && entry.probe_target.1.as_deref() != Some(dir.rel.as_str());
            if !plan.deleting && (stale_probe || (!entry.adopted && self.wants_hold(plan))) {
                self.on_pod(uid, pod, plan, Some(dir));
            }
        }
        for &(uid, pod, plan, _) in pods {
            let timeout = plan.hold_timeout.min(Duration::from_secs(3600));
            let Some(entry) = self.pods.get_mut(uid) else { continue };
            let expired = entry.hold_started.is_some_and(|t| t.elapsed() >= timeout);
            if !expired || entry.held.is_empty() || entry.failed_open {
                continue;
            }
            entry.failed_open = true;
            entry.hold_started = None;
            let held = std::mem::take(&mut entry.held);
            warn!(pod = %pod_name(pod), waited_s = timeout.as_secs(), "proxy not ready in time: releasing the app anyway");
            self.metrics.fail_opens.inc();
            self.events.publish(
                pod_reference(pod),
                true,
                "HoldTimeout",
                "Release",
                format!("the sidecar proxy was not ready after {}s; released the app anyway", timeout.as_secs()),
            );
            for h in &held {
                self.release(uid, pod, h, "timeout");
            }
            self.update_pace(uid);
            self.sync_condition(uid, pod);
        }
        Vec::new()
    }

    /// The pod's work is done (the controller decided to quit its sidecars): stop probing and
    /// leave the condition as it is.
    pub fn finish(&mut self, uid: &str) {
        self.stop(uid);
        if let Some(p) = self.pods.get_mut(uid) {
            p.finished = true;
        }
    }

    /// Releases everything held (agent shutdown). Call after the kernel was told to hold nothing
    /// more: this also releases processes it stopped whose events were still on their way.
    pub fn release_all(&mut self, reason: &'static str) {
        let mut all: Vec<Held> = self.pods.values_mut().flat_map(|p| std::mem::take(&mut p.held)).collect();
        for p in self.pods.values().filter(|p| p.hold) {
            let Some(rel) = &p.pod_rel else { continue };
            for c in self.cgroups.containers(rel) {
                for pid in self.cgroups.procs(&c.rel) {
                    if !all.iter().any(|h| h.tgid == pid) && held_at_exec(&self.cfg.host_proc, pid) {
                        all.push(Held { tgid: pid, container_rel: c.rel.clone(), container_id: None, since_ktime: 0 });
                    }
                }
            }
        }
        for h in all {
            match signal_in_cgroup(&self.cgroups, h.tgid, &h.container_rel, libc::SIGCONT) {
                Ok(()) => {
                    self.metrics.releases.get_or_create(&ReasonLabels { reason }).inc();
                    info!(pid = h.tgid, reason, "released app");
                }
                Err(e) => debug!(pid = h.tgid, "release: {e}"),
            }
        }
    }

    fn stop(&mut self, uid: &str) {
        if let Some(p) = self.pods.get(uid)
            && let Some(pace) = &p.pace
        {
            let _ = pace.send(Pace::Stop);
        }
    }

    /// The pod is gone: stop probing, release anything still held.
    pub fn forget(&mut self, uid: &str) {
        self.stop(uid);
        if let Some(p) = self.pods.remove(uid) {
            for h in p.held {
                let _ = signal_in_cgroup(&self.cgroups, h.tgid, &h.container_rel, libc::SIGCONT);
            }
        }
    }
}

/// Whether a container (by id) may be one of the pod's app containers: it is named one in the
/// API, or it is not named yet and some app container's id is still unknown. A container the
/// API does not name while every app's id is known is the sandbox, an init container or a
/// sidecar.
fn may_be_app(pod: &Pod, plan: &PodPlan, container_id: &str) -> bool {
    match name_of_id(pod, container_id) {
        Some(name) => plan.apps.contains(&name),
        None => plan.apps.iter().any(|app| current_id(pod, app).is_none()),
    }
}

/// Whether a process is stopped (state `T` in /proc/<pid>/stat).
fn process_stopped(host_proc: &std::path::Path, pid: u32) -> bool {
    std::fs::read_to_string(host_proc.join(pid.to_string()).join("stat"))
        .ok()
        .and_then(|s| s.rsplit(')').next().and_then(|r| r.split_whitespace().next()).map(|st| st == "T"))
        .unwrap_or(false)
}

/// Whether a process is pid 1 of a pid namespace below the host's (the last `NSpid` entry is 1),
/// that is a container's init, the only kind of process the kernel holds.
fn is_ns_init(host_proc: &std::path::Path, pid: u32) -> bool {
    std::fs::read_to_string(host_proc.join(pid.to_string()).join("status"))
        .ok()
        .and_then(|s| {
            let ids: Vec<&str> = s.lines().find_map(|l| l.strip_prefix("NSpid:"))?.split_whitespace().collect();
            Some(ids.len() > 1 && ids.last() == Some(&"1"))
        })
        .unwrap_or(false)
}

/// Whether a process looks held at exec: a container's init, stopped. A killed agent leaves
/// such processes behind; its successor takes them over.
fn held_at_exec(host_proc: &std::path::Path, pid: u32) -> bool {
    process_stopped(host_proc, pid) && is_ns_init(host_proc, pid)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_stopped_namespace_inits_look_held() {
        let proc = std::path::Path::new("/proc");
        let me = std::process::id();
        // This test process is neither stopped nor (normally) a pid namespace's init.
        assert!(!process_stopped(proc, me));
        assert!(!held_at_exec(proc, me));
        assert!(!held_at_exec(proc, u32::MAX), "a missing process is not held");
    }
}
