//! The pod loop tests' rig: stand-ins for the kernel programs, the pod's network and the API
//! (`tower-test`), a kubelet-shaped cgroup tree in a temporary directory, the loop started on them,
//! and the waits the tests use.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use futures::StreamExt as _;
use http::{Request, Response};
use k8s_openapi::api::core::v1::Pod;
use kube::client::Body;
use kube::runtime::watcher;
use serde_json::{Value, json};
use tokio::sync::{mpsc, oneshot};
use valet_agent::act::ahead::QuitsAhead;
use valet_agent::act::{Actuators, Parts, Settings};
use valet_agent::api::events::EventSink;
use valet_agent::api::successor::{Stop, Uninstall};
use valet_agent::cgroup::CgroupFs;
use valet_agent::kernel::{Event, EventSource, HeldProcess, KernelControl, ProcessEnd, ProcessExit};
use valet_agent::metrics::Metrics;
use valet_agent::pod::spec::SidecarDefaults;
use valet_agent::pod::state::Rules;
use valet_agent::pod_router::PodRouter;
use valet_agent::runtime::RuntimeBundles;
use valet_agent::server::Health;
use valet_agent::sidecar::http::Response as HttpResponse;
use valet_agent::sidecar::{Failed, Pending, PodRequest, SidecarLink};
use valet_common::Counter;

pub(crate) const UID: &str = "6b1f2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d";
pub(crate) const NODE: &str = "n1";
/// Only a guard against a hang.
pub(crate) const WAIT: Duration = Duration::from_secs(30);

pub(crate) fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

// ---- the kernel programs' stand-in ----

#[derive(Default)]
pub(crate) struct KernelState {
    pub(crate) watched: HashMap<u64, u32>,
    pub(crate) classified: HashMap<u64, bool>,
    pub(crate) forgotten: Vec<u64>,
    pub(crate) recorded: Vec<(u64, u32)>,
    /// Container cgroups the agent asked about (it does so as it reads a container's cgroup).
    pub(crate) exec_asked: Vec<u64>,
    pub(crate) detached: bool,
    /// The record of holds is not pinned (no bpffs).
    pub(crate) unpinned: bool,
}

#[derive(Clone, Default)]
pub(crate) struct FakeKernel(pub(crate) Arc<Mutex<KernelState>>, pub(crate) Arc<(Mutex<bool>, std::sync::Condvar)>);

impl FakeKernel {
    /// While wedged, a call to watch a cgroup blocks the thread that makes it (the loop's): a
    /// kernel call that never returns.
    pub(crate) fn wedge(&self, wedged: bool) {
        *lock(&self.1.0) = wedged;
        self.1.1.notify_all();
    }
}

impl KernelControl for FakeKernel {
    fn watch(&mut self, cgroup_id: u64, flags: u32) -> valet_agent::Result<()> {
        let mut wedged = lock(&self.1.0);
        while *wedged {
            wedged = self.1.1.wait(wedged).unwrap_or_else(PoisonError::into_inner);
        }
        drop(wedged);
        lock(&self.0).watched.insert(cgroup_id, flags);
        Ok(())
    }
    fn unwatch(&mut self, cgroup_id: u64) -> valet_agent::Result<()> {
        lock(&self.0).watched.remove(&cgroup_id);
        Ok(())
    }
    fn classify_exec(&mut self, container_cgroup_id: u64, hold: bool) -> valet_agent::Result<()> {
        lock(&self.0).classified.insert(container_cgroup_id, hold);
        Ok(())
    }
    fn exec_seen(&self, container_cgroup_id: u64) -> bool {
        lock(&self.0).exec_asked.push(container_cgroup_id);
        false
    }
    fn forget_container(&mut self, container_cgroup_id: u64) {
        lock(&self.0).forgotten.push(container_cgroup_id);
    }
    fn record_container_main(
        &mut self,
        cgroup_id: u64,
        main: &valet_agent::kernel::MainProcess,
    ) -> valet_agent::Result<valet_agent::kernel::RecordOutcome> {
        lock(&self.0).recorded.push((cgroup_id, main.tgid));
        Ok(valet_agent::kernel::RecordOutcome::Recorded)
    }
    fn counter(&self, _: Counter) -> u64 {
        0
    }
    fn detach(&mut self) {
        lock(&self.0).detached = true;
    }
    fn held_record_pinned(&self) -> bool {
        !lock(&self.0).unpinned
    }
}

pub(crate) struct FakeEvents(pub(crate) mpsc::UnboundedReceiver<Event>);

impl EventSource for FakeEvents {
    async fn next_batch(&mut self) -> valet_agent::Result<Vec<Event>> {
        match self.0.recv().await {
            Some(e) => Ok(vec![e]),
            None => std::future::pending().await,
        }
    }
}

// ---- the pod network's stand-in: a proxy that answers ready when told, and quits ----

#[derive(Default)]
pub(crate) struct LinkState {
    pub(crate) ready: bool,
    pub(crate) requests: Vec<(String, &'static str, u16, String)>,
    pub(crate) opened: Vec<String>,
    /// Quits sent ahead (uid, port) and not taken over yet; `kept`: a connection is kept to
    /// send them on.
    pub(crate) ahead: Vec<(String, u16)>,
    pub(crate) kept: bool,
    /// Quits sent ahead that a quit request took over.
    pub(crate) taken_over: usize,
}

#[derive(Clone, Default)]
pub(crate) struct FakeLink(pub(crate) Arc<Mutex<LinkState>>);

impl FakeLink {
    pub(crate) fn quits(&self) -> usize {
        lock(&self.0).requests.iter().filter(|r| r.1 == "POST").count()
    }
}

impl SidecarLink for FakeLink {
    fn open(&self, uid: &str, _: &str) -> Result<(), String> {
        lock(&self.0).opened.push(uid.to_owned());
        Ok(())
    }
    fn close(&self, uid: &str) {
        lock(&self.0).opened.retain(|u| u != uid);
    }
    fn send_ahead(&self, uid: &str, port: u16, path: &str) -> bool {
        let mut s = lock(&self.0);
        if !s.kept {
            return false;
        }
        s.requests.push((uid.to_owned(), "POST", port, path.to_owned()));
        s.ahead.push((uid.to_owned(), port));
        true
    }
    fn drop_sent_ahead(&self, uid: &str) -> usize {
        let mut s = lock(&self.0);
        let before = s.ahead.len();
        s.ahead.retain(|(u, _)| u != uid);
        before - s.ahead.len()
    }
    fn request(&self, request: PodRequest) -> Pending<Result<HttpResponse, Failed>> {
        let PodRequest { target, port, method, path, .. } = request;
        let mut s = lock(&self.0);
        let key = (target.uid.clone(), port);
        if method == "POST" && s.ahead.contains(&key) {
            // Sent already: taken over, the answer read.
            s.ahead.retain(|k| *k != key);
            s.taken_over += 1;
        } else {
            s.requests.push((target.uid, method, port, path));
        }
        let status = if method == "POST" || s.ready { 200 } else { 503 };
        Box::pin(async move { Ok(HttpResponse { status, body: String::new(), sent_ns: 0 }) })
    }
}

// ---- the API server: PATCH pods/status and Events, answered by the test ----

pub(crate) struct ApiCall {
    pub(crate) method: String,
    pub(crate) path: String,
    pub(crate) body: Value,
    pub(crate) answer: oneshot::Sender<()>,
}

pub(crate) fn mock_api() -> (kube::Client, mpsc::UnboundedReceiver<ApiCall>) {
    let (service, mut handle) = tower_test::mock::pair::<Request<Body>, Response<Body>>();
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(async move {
        while let Some((request, send)) = handle.next_request().await {
            let (parts, body) = request.into_parts();
            let bytes = body.collect_bytes().await.unwrap_or_default();
            let body: Value = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
            let (answer, answered) = oneshot::channel();
            let call = ApiCall {
                method: parts.method.to_string(),
                path: parts.uri.path().to_owned(),
                body: body.clone(),
                answer,
            };
            let events = call.path.contains("/events");
            let _ = tx.send(call);
            tokio::spawn(async move {
                // Events are answered at once; status patches when the test says so.
                if !events {
                    let _ = answered.await;
                }
                let reply = if events {
                    body
                } else {
                    json!({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "job-x"}})
                };
                let response = Response::builder()
                    .status(if events { 201 } else { 200 })
                    .body(Body::from(serde_json::to_vec(&reply).unwrap_or_default()))
                    .unwrap_or_else(|_| Response::new(Body::empty()));
                send.send_response(response);
            });
        }
    });
    (kube::Client::new(service, "default"), rx)
}

/// The next status patch (Events are skipped), within the wait.
pub(crate) async fn next_patch(api: &mut mpsc::UnboundedReceiver<ApiCall>) -> Option<ApiCall> {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let call = tokio::time::timeout_at(deadline, api.recv()).await.ok()??;
        if call.method == "PATCH" && call.path.ends_with("/status") {
            return Some(call);
        }
    }
}

/// No status patch within `d`.
pub(crate) async fn no_patch(api: &mut mpsc::UnboundedReceiver<ApiCall>, d: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + d;
    loop {
        match tokio::time::timeout_at(deadline, api.recv()).await {
            Err(_) | Ok(None) => return true,
            Ok(Some(call)) if call.method == "PATCH" => return false,
            Ok(Some(_)) => {}
        }
    }
}

pub(crate) fn condition_of(call: &ApiCall) -> (String, String) {
    let c = &call.body["status"]["conditions"][0];
    (c["status"].as_str().unwrap_or_default().to_owned(), c["reason"].as_str().unwrap_or_default().to_owned())
}

// ---- a kubelet-shaped node in a temporary directory ----

pub(crate) struct TempNode {
    pub(crate) dir: PathBuf,
    pub(crate) cgroups: CgroupFs,
    pub(crate) pod_rel: String,
}

impl TempNode {
    pub(crate) fn new(tag: &str) -> TempNode {
        let dir = std::env::temp_dir().join(format!("valet-loop-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let pod_rel =
            format!("/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{}.slice", UID.replace('-', "_"));
        let cgroups = CgroupFs::new(dir.join("cgroup"));
        std::fs::create_dir_all(cgroups.abs(&pod_rel)).expect("pod cgroup");
        std::fs::create_dir_all(dir.join("proc")).expect("proc");
        std::fs::create_dir_all(dir.join("bundles")).expect("bundles");
        TempNode { dir, cgroups, pod_rel }
    }

    /// A container as a runtime creates it: its bundle, then its cgroup; the cgroup's id.
    pub(crate) fn container(&self, n: u8, name: &str) -> u64 {
        self.container_with(n, name, None)
    }

    /// [`Self::container`], with `pid` in the cgroup from the moment it exists (a runtime's init
    /// process waiting there for `runc start`).
    pub(crate) fn container_with(&self, n: u8, name: &str, pid: Option<u32>) -> u64 {
        let id = format!("{:02x}", n).repeat(32);
        let rel = self.container_rel(n);
        let (kind, name) = if name == "POD" { ("sandbox", "POD") } else { ("container", name) };
        let bundle = self.dir.join("bundles").join(&id);
        std::fs::create_dir_all(&bundle).expect("bundle");
        let config = json!({"annotations": {
            "io.kubernetes.cri.container-type": kind,
            "io.kubernetes.cri.container-name": name,
            "io.kubernetes.cri.sandbox-uid": UID}});
        std::fs::write(bundle.join("config.json"), config.to_string()).expect("config.json");
        // Made aside and renamed in, so that it appears with its process list (cgroupfs makes
        // `cgroup.procs` with the directory; here it is a plain file).
        let tmp = self.dir.join(format!("new-{id}"));
        std::fs::create_dir_all(&tmp).expect("container cgroup");
        std::fs::write(tmp.join("cgroup.procs"), pid.map(|p| format!("{p}\n")).unwrap_or_default()).expect("procs");
        std::fs::rename(&tmp, self.cgroups.abs(&rel)).expect("container cgroup in place");
        self.cgroups.id_of(&rel).expect("id")
    }

    pub(crate) fn container_rel(&self, n: u8) -> String {
        format!("{}/cri-containerd-{}.scope", self.pod_rel, format!("{:02x}", n).repeat(32))
    }

    pub(crate) fn pod_id(&self) -> u64 {
        self.cgroups.id_of(&self.pod_rel).expect("pod id")
    }

    /// Puts a real process into a container's `cgroup.procs` (it is a plain file here).
    pub(crate) fn add_process(&self, n: u8, pid: u32) {
        std::fs::write(self.cgroups.abs(&self.container_rel(n)).join("cgroup.procs"), format!("{pid}\n"))
            .expect("procs");
    }

    /// Makes `pid` look, in this node's `/proc`, like a container's init stopped at exec.
    pub(crate) fn fake_held_at_exec(&self, pid: u32) {
        let dir = self.dir.join("proc").join(pid.to_string());
        std::fs::create_dir_all(&dir).expect("proc dir");
        // The real stat (state `T`, the real start time), and a status saying pid 1 of its own
        // pid namespace, which an unprivileged test cannot make for real.
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("stat");
        std::fs::write(dir.join("stat"), stat).expect("stat");
        std::fs::write(dir.join("status"), format!("Name:\tapp\nNSpid:\t{pid}\t1\n")).expect("status");
    }
}

impl Drop for TempNode {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

pub(crate) fn job_pod(annotations: Value) -> Pod {
    serde_json::from_value(json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": "job-x", "namespace": "batch", "uid": UID,
                     "labels": {"valet.dev/enabled": "true"}, "annotations": annotations},
        "spec": {"restartPolicy": "Never", "nodeName": NODE, "containers": [
            {"name": "app", "image": "example/app:1"},
            {"name": "istio-proxy", "image": "docker.io/istio/proxyv2:1.22.0"}
        ]},
        "status": {"phase": "Running"}
    }))
    .expect("pod")
}

/// A container's end as the kernel reports it.
pub(crate) fn end_of(pod_cg: u64, cg: u64, code: i32) -> ProcessExit {
    ProcessExit::of_container_main(pod_cg, cg, Some(ProcessEnd::Exited(code)), now_ns())
}

/// The running loop and its stand-ins.
pub(crate) struct Loop {
    pub(crate) kernel: FakeKernel,
    pub(crate) link: FakeLink,
    /// What the kernel event reader fires.
    pub(crate) ahead: Arc<QuitsAhead<FakeLink>>,
    pub(crate) events: mpsc::UnboundedSender<Event>,
    pub(crate) watch: mpsc::UnboundedSender<watcher::Event<Pod>>,
    pub(crate) api: mpsc::UnboundedReceiver<ApiCall>,
    pub(crate) metrics: Arc<Metrics>,
    pub(crate) health: Arc<Health>,
    pub(crate) stop: Option<oneshot::Sender<Stop>>,
    pub(crate) done: tokio::task::JoinHandle<Stop>,
}

/// How long the loop may go without turning in these tests before liveness fails.
pub(crate) const STALL: Duration = Duration::from_millis(500);

pub(crate) fn start(node: &TempNode, hold_timeout: Duration) -> Loop {
    let (client, api) = mock_api();
    let kernel = FakeKernel::default();
    let link = FakeLink::default();
    let metrics = Arc::new(Metrics::new());
    let (feedback_tx, feedback_rx) = mpsc::unbounded_channel();
    let act = Actuators::new(Parts {
        settings: Settings::quick(node.dir.join("proc")),
        cgroups: node.cgroups.clone(),
        bundles: RuntimeBundles::new(vec![node.dir.join("bundles")], None),
        kernel: kernel.clone(),
        link: Arc::new(link.clone()),
        client: client.clone(),
        events: EventSink::new(client, NODE),
        metrics: metrics.clone(),
        feedback: feedback_tx,
        // No observer here: a record of the pods quit that nothing reads.
        ended_by_valet: Arc::default(),
    });
    let rules = Rules {
        defaults: SidecarDefaults { hold_timeout, ..SidecarDefaults::default() },
        escalate_after: Some(Duration::from_secs(15)),
        mode: valet_agent::vocab::NodeMode::Kernel,
        sandboxed_classes: vec!["kata*".into(), "gvisor".into()],
        quit_events: true,
        runtime_handlers: Default::default(),
        default_handler: None,
    };
    let ahead = act.quits_ahead();
    let health = Arc::new(Health::new(STALL));
    let router = PodRouter::new(NODE, rules, act, feedback_rx, health.clone());
    let (events_tx, events_rx) = mpsc::unbounded_channel();
    let (watch_tx, watch_rx) = mpsc::unbounded_channel();
    let watch = tokio_stream_of(watch_rx);
    let (stop_tx, stop_rx) = oneshot::channel::<Stop>();
    let done = tokio::spawn(router.run(
        FakeEvents(events_rx),
        watch,
        async move { stop_rx.await.unwrap_or(Stop::Release(Uninstall::NotInPod)) },
        Duration::from_secs(2),
    ));
    Loop { kernel, link, ahead, events: events_tx, watch: watch_tx, api, metrics, health, stop: Some(stop_tx), done }
}

pub(crate) fn tokio_stream_of(
    mut rx: mpsc::UnboundedReceiver<watcher::Event<Pod>>,
) -> impl futures::Stream<Item = Result<watcher::Event<Pod>, watcher::Error>> {
    futures::stream::poll_fn(move |cx| rx.poll_recv(cx)).map(Ok)
}

impl Loop {
    pub(crate) fn apply(&self, pod: Pod) {
        let _ = self.watch.send(watcher::Event::Apply(pod));
    }

    pub(crate) async fn until(&self, what: &str, mut f: impl FnMut(&Loop) -> bool) {
        let deadline = tokio::time::Instant::now() + WAIT;
        while !f(self) {
            assert!(tokio::time::Instant::now() < deadline, "timed out waiting for {what}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    pub(crate) fn exit(&self, pod_cg: u64, cg: u64, code: i32) {
        let _ = self.events.send(Event::Exit(end_of(pod_cg, cg, code)));
    }

    /// As the event reader does: fires what is armed for the end, then hands it to the loop.
    pub(crate) fn exit_read(&self, pod_cg: u64, cg: u64, code: i32) -> usize {
        let mut exit = end_of(pod_cg, cg, code);
        exit.quits_sent_ahead = self.ahead.fire(&exit);
        let sent = exit.quits_sent_ahead;
        let _ = self.events.send(Event::Exit(exit));
        sent
    }

    pub(crate) fn held(&self, pod_cg: u64, cg: u64, pid: u32) {
        let _ = self.events.send(Event::Held(HeldProcess {
            ktime_ns: now_ns(),
            cgroup_id: cg,
            watched_cgroup_id: pod_cg,
            tgid: pid,
            comm: "app".into(),
        }));
    }

    /// Stops the loop as a SIGTERM outside a pod does (every hold released).
    pub(crate) async fn stop(self) -> (FakeKernel, FakeLink) {
        let (kernel, link, _) = self.stop_with(Stop::Release(Uninstall::NotInPod)).await;
        (kernel, link)
    }

    /// Stops the loop with what the lookup at SIGTERM decided; what the loop returned, once it
    /// has returned.
    pub(crate) async fn stop_with(mut self, why: Stop) -> (FakeKernel, FakeLink, Option<Stop>) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(why);
        }
        let done = tokio::time::timeout(WAIT, &mut self.done).await.ok().and_then(Result::ok);
        (self.kernel, self.link, done)
    }
}

pub(crate) fn now_ns() -> u64 {
    valet_agent::host::clock::monotonic_ns()
}

/// A real process, stopped as the kernel would stop a held app.
pub(crate) async fn stopped_child() -> Child {
    let child = Command::new("sleep").arg("30").spawn().expect("spawn sleep");
    valet_agent::host::sys::kill(child.id(), libc::SIGSTOP).expect("stop our own child");
    assert!(wait_state(child.id(), 'T').await, "child stopped");
    child
}

pub(crate) fn state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    valet_agent::host::proc::stat_field(&stat, 3)?.chars().next()
}

/// Polls (without blocking the runtime the loop runs on) until `pid` is in state `want`.
pub(crate) async fn wait_state(pid: u32, want: char) -> bool {
    let deadline = std::time::Instant::now() + WAIT;
    while std::time::Instant::now() < deadline {
        if state(pid) == Some(want) {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    false
}

/// The value of the metric line that starts with `series ` (0 when absent).
pub(crate) fn metric(metrics: &Metrics, series: &str) -> f64 {
    metrics.encode().lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok()).unwrap_or(0.0)
}

pub(crate) fn kill(mut child: Child) {
    let _ = child.kill();
    let _ = child.wait();
}

pub(crate) fn quit_metric(metrics: &Metrics) -> String {
    metrics
        .encode()
        .lines()
        .find(|l| l.starts_with("valet_sidecar_quits_total{kind=\"istio\",result=\"ok\"}"))
        .unwrap_or_default()
        .to_owned()
}

pub(crate) fn assert_path(p: &Path) {
    assert!(p.exists(), "{}", p.display());
}
