//! Scenario tests of the whole loop, without root: the real controller and actuators against a
//! mocked API (`tower-test`), a stand-in for the kernel programs and for the pod's network, a
//! kubelet-shaped cgroup tree in a temporary directory, and real (unprivileged) child processes
//! for the holds. Every wait has a timeout, so a missing or an extra action fails the test; the
//! timeout only guards against a hang: a test waits for the event itself, and proves that
//! something did not happen by a later event that would have come after it, never by a quiet
//! moment (which a busy machine stretches or shortens).

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
use valet_agent::api::successor::{Stop, Successor, Uninstall};
use valet_agent::cgroup::CgroupFs;
use valet_agent::controller::Controller;
use valet_agent::kernel::{Event, EventSource, HeldProcess, KernelControl, ProcessEnd, ProcessExit};
use valet_agent::metrics::Metrics;
use valet_agent::pod::spec::SidecarDefaults;
use valet_agent::pod::state::Rules;
use valet_agent::runtime::RuntimeBundles;
use valet_agent::server::Health;
use valet_agent::sidecar::http::{Limits, Response as HttpResponse};
use valet_agent::sidecar::{Failed, Pending, PodTarget, SidecarLink};
use valet_common::{Counter, watch_flags};

const UID: &str = "6b1f2c3d-4e5f-4a6b-8c7d-9e0f1a2b3c4d";
const NODE: &str = "n1";
/// Only a guard against a hang.
const WAIT: Duration = Duration::from_secs(30);

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

// ---- the kernel programs' stand-in ----

#[derive(Default)]
struct KernelState {
    watched: HashMap<u64, u32>,
    classified: HashMap<u64, bool>,
    forgotten: Vec<u64>,
    recorded: Vec<(u64, u32)>,
    /// Container cgroups the agent asked about (it does so as it reads a container's cgroup).
    exec_asked: Vec<u64>,
    detached: bool,
    /// The record of holds is not pinned (no bpffs).
    unpinned: bool,
}

#[derive(Clone, Default)]
struct FakeKernel(Arc<Mutex<KernelState>>, Arc<(Mutex<bool>, std::sync::Condvar)>);

impl FakeKernel {
    /// While wedged, a call to watch a cgroup blocks the thread that makes it (the loop's): a
    /// kernel call that never returns.
    fn wedge(&self, wedged: bool) {
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

struct FakeEvents(mpsc::UnboundedReceiver<Event>);

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
struct LinkState {
    ready: bool,
    requests: Vec<(String, &'static str, u16, String)>,
    opened: Vec<String>,
    /// Quits sent ahead (uid, port) and not taken over yet; `kept`: a connection is kept to
    /// send them on.
    ahead: Vec<(String, u16)>,
    kept: bool,
    /// Quits sent ahead that a quit request took over.
    taken_over: usize,
}

#[derive(Clone, Default)]
struct FakeLink(Arc<Mutex<LinkState>>);

impl FakeLink {
    fn quits(&self) -> usize {
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
    fn request(
        &self,
        target: PodTarget,
        port: u16,
        method: &'static str,
        path: String,
        _: Limits,
        _: bool,
        _: bool,
    ) -> Pending<Result<HttpResponse, Failed>> {
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

struct ApiCall {
    method: String,
    path: String,
    body: Value,
    answer: oneshot::Sender<()>,
}

fn mock_api() -> (kube::Client, mpsc::UnboundedReceiver<ApiCall>) {
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
async fn next_patch(api: &mut mpsc::UnboundedReceiver<ApiCall>) -> Option<ApiCall> {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let call = tokio::time::timeout_at(deadline, api.recv()).await.ok()??;
        if call.method == "PATCH" && call.path.ends_with("/status") {
            return Some(call);
        }
    }
}

/// No status patch within `d`.
async fn no_patch(api: &mut mpsc::UnboundedReceiver<ApiCall>, d: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + d;
    loop {
        match tokio::time::timeout_at(deadline, api.recv()).await {
            Err(_) | Ok(None) => return true,
            Ok(Some(call)) if call.method == "PATCH" => return false,
            Ok(Some(_)) => {}
        }
    }
}

fn condition_of(call: &ApiCall) -> (String, String) {
    let c = &call.body["status"]["conditions"][0];
    (c["status"].as_str().unwrap_or_default().to_owned(), c["reason"].as_str().unwrap_or_default().to_owned())
}

// ---- a kubelet-shaped node in a temporary directory ----

struct TempNode {
    dir: PathBuf,
    cgroups: CgroupFs,
    pod_rel: String,
}

impl TempNode {
    fn new(tag: &str) -> TempNode {
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
    fn container(&self, n: u8, name: &str) -> u64 {
        self.container_with(n, name, None)
    }

    /// [`Self::container`], with `pid` in the cgroup from the moment it exists (a runtime's init
    /// process waiting there for `runc start`).
    fn container_with(&self, n: u8, name: &str, pid: Option<u32>) -> u64 {
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

    fn container_rel(&self, n: u8) -> String {
        format!("{}/cri-containerd-{}.scope", self.pod_rel, format!("{:02x}", n).repeat(32))
    }

    fn pod_id(&self) -> u64 {
        self.cgroups.id_of(&self.pod_rel).expect("pod id")
    }

    /// Puts a real process into a container's `cgroup.procs` (it is a plain file here).
    fn add_process(&self, n: u8, pid: u32) {
        std::fs::write(self.cgroups.abs(&self.container_rel(n)).join("cgroup.procs"), format!("{pid}\n"))
            .expect("procs");
    }

    /// Makes `pid` look, in this node's `/proc`, like a container's init stopped at exec.
    fn fake_held_at_exec(&self, pid: u32) {
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

fn job_pod(annotations: Value) -> Pod {
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
fn end_of(pod_cg: u64, cg: u64, code: i32) -> ProcessExit {
    ProcessExit {
        ktime_ns: now_ns(),
        cgroup_id: cg,
        watched_cgroup_id: pod_cg,
        tgid: 4242,
        pid: 4242,
        ns_pid: 1,
        end: Some(ProcessEnd::Exited(code)),
        ns_init: true,
        child_pid_ns: true,
        container_main: true,
        comm: "app".into(),
        cgroup_name: None,
        quits_sent_ahead: 0,
    }
}

/// The running loop and its stand-ins.
struct Loop {
    kernel: FakeKernel,
    link: FakeLink,
    /// What the kernel event reader fires.
    ahead: Arc<QuitsAhead<FakeLink>>,
    events: mpsc::UnboundedSender<Event>,
    watch: mpsc::UnboundedSender<watcher::Event<Pod>>,
    api: mpsc::UnboundedReceiver<ApiCall>,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
    stop: Option<oneshot::Sender<Stop>>,
    done: tokio::task::JoinHandle<Stop>,
}

/// How long the loop may go without turning in these tests before liveness fails.
const STALL: Duration = Duration::from_millis(500);

fn start(node: &TempNode, hold_timeout: Duration) -> Loop {
    let (client, api) = mock_api();
    let kernel = FakeKernel::default();
    let link = FakeLink::default();
    let metrics = Arc::new(Metrics::new());
    let (reports_tx, reports_rx) = mpsc::unbounded_channel();
    let act = Actuators::new(Parts {
        settings: Settings {
            host_proc: node.dir.join("proc"),
            quit_timeout: Duration::from_secs(1),
            quit_retry_for: Duration::from_secs(1),
            probe_interval: Duration::from_millis(20),
            ready_probe_interval: Duration::from_secs(5),
            held_probe_interval: Duration::from_millis(10),
            held_probe_cpu: 0.03,
            held_probe_budget: 2000,
            held_prober: false,
            release_priority: 0,
        },
        cgroups: node.cgroups.clone(),
        bundles: RuntimeBundles::new(vec![node.dir.join("bundles")], None),
        kernel: kernel.clone(),
        link: Arc::new(link.clone()),
        client: client.clone(),
        events: EventSink::new(client, NODE),
        metrics: metrics.clone(),
        reports: reports_tx,
        // No observer here: a record of the pods quit that nothing reads.
        quit_pods: Arc::default(),
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
    let controller = Controller::new(NODE, rules, act, reports_rx, health.clone());
    let (events_tx, events_rx) = mpsc::unbounded_channel();
    let (watch_tx, watch_rx) = mpsc::unbounded_channel();
    let watch = tokio_stream_of(watch_rx);
    let (stop_tx, stop_rx) = oneshot::channel::<Stop>();
    let done = tokio::spawn(controller.run(
        FakeEvents(events_rx),
        watch,
        async move { stop_rx.await.unwrap_or(Stop::Release(Uninstall::NotInPod)) },
        Duration::from_secs(2),
    ));
    Loop { kernel, link, ahead, events: events_tx, watch: watch_tx, api, metrics, health, stop: Some(stop_tx), done }
}

fn tokio_stream_of(
    mut rx: mpsc::UnboundedReceiver<watcher::Event<Pod>>,
) -> impl futures::Stream<Item = Result<watcher::Event<Pod>, watcher::Error>> {
    futures::stream::poll_fn(move |cx| rx.poll_recv(cx)).map(Ok)
}

impl Loop {
    fn apply(&self, pod: Pod) {
        let _ = self.watch.send(watcher::Event::Apply(pod));
    }

    async fn until(&self, what: &str, mut f: impl FnMut(&Loop) -> bool) {
        let deadline = tokio::time::Instant::now() + WAIT;
        while !f(self) {
            assert!(tokio::time::Instant::now() < deadline, "timed out waiting for {what}");
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    fn exit(&self, pod_cg: u64, cg: u64, code: i32) {
        let _ = self.events.send(Event::Exit(end_of(pod_cg, cg, code)));
    }

    /// As the event reader does: fires what is armed for the end, then hands it to the loop.
    fn exit_read(&self, pod_cg: u64, cg: u64, code: i32) -> usize {
        let mut exit = end_of(pod_cg, cg, code);
        exit.quits_sent_ahead = self.ahead.fire(&exit);
        let sent = exit.quits_sent_ahead;
        let _ = self.events.send(Event::Exit(exit));
        sent
    }

    fn held(&self, pod_cg: u64, cg: u64, pid: u32) {
        let _ = self.events.send(Event::Held(HeldProcess {
            ktime_ns: now_ns(),
            cgroup_id: cg,
            watched_cgroup_id: pod_cg,
            tgid: pid,
            comm: "app".into(),
        }));
    }

    /// Stops the loop as a SIGTERM outside a pod does (every hold released).
    async fn stop(self) -> (FakeKernel, FakeLink) {
        let (kernel, link, _) = self.stop_with(Stop::Release(Uninstall::NotInPod)).await;
        (kernel, link)
    }

    /// Stops the loop with what the lookup at SIGTERM decided; what the loop returned, once it
    /// has returned.
    async fn stop_with(mut self, why: Stop) -> (FakeKernel, FakeLink, Option<Stop>) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(why);
        }
        let done = tokio::time::timeout(WAIT, &mut self.done).await.ok().and_then(Result::ok);
        (self.kernel, self.link, done)
    }
}

fn now_ns() -> u64 {
    valet_agent::host::clock::monotonic_ns()
}

/// A real process, stopped as the kernel would stop a held app.
async fn stopped_child() -> Child {
    let child = Command::new("sleep").arg("30").spawn().expect("spawn sleep");
    valet_agent::host::sys::kill(child.id(), libc::SIGSTOP).expect("stop our own child");
    assert!(wait_state(child.id(), 'T').await, "child stopped");
    child
}

fn state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    valet_agent::host::proc::stat_field(&stat, 3)?.chars().next()
}

/// Polls (without blocking the runtime the loop runs on) until `pid` is in state `want`.
async fn wait_state(pid: u32, want: char) -> bool {
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
fn metric(metrics: &Metrics, series: &str) -> f64 {
    metrics.encode().lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok()).unwrap_or(0.0)
}

fn kill(mut child: Child) {
    let _ = child.kill();
    let _ = child.wait();
}

fn quit_metric(metrics: &Metrics) -> String {
    metrics
        .encode()
        .lines()
        .find(|l| l.starts_with("valet_sidecar_quits_total{kind=\"istio\",result=\"ok\"}"))
        .unwrap_or_default()
        .to_owned()
}

fn assert_path(p: &Path) {
    assert!(p.exists(), "{}", p.display());
}

#[tokio::test]
async fn the_apps_exit_quits_the_proxy_and_releases_the_pods_resources() {
    let node = TempNode::new("quit");
    let _sandbox = node.container(1, "POD");
    let app = node.container(2, "app");
    let proxy = node.container(3, "istio-proxy");
    let lp = start(&node, Duration::from_secs(120));
    lp.apply(job_pod(json!({})));
    let pod_cg = node.pod_id();
    lp.until("the pod cgroup watched", |l| lock(&l.kernel.0).watched.get(&pod_cg) == Some(&watch_flags::EXITS)).await;
    assert!(lock(&lp.link.0).opened.contains(&UID.to_owned()), "network namespace opened ahead of time");
    lp.exit(pod_cg, app, 0);
    lp.until("the quit", |l| l.link.quits() == 1).await;
    let quit = lock(&lp.link.0).requests.iter().find(|r| r.1 == "POST").cloned().expect("a quit");
    assert_eq!((quit.2, quit.3.as_str()), (15020, "/quitquitquit"));
    lp.until("the quit counted", |l| quit_metric(&l.metrics).ends_with(" 1")).await;
    // The proxy exits: kernel maps and the namespace are released while the pod object stays.
    lp.exit(pod_cg, proxy, 0);
    lp.until("resources released", |l| lock(&l.kernel.0).watched.is_empty() && lock(&l.link.0).opened.is_empty()).await;
    assert!(lock(&lp.kernel.0).forgotten.contains(&app));
    // Once the loop has ended, every quit it ever decided is on record (the first attempt is
    // made as the transition is applied).
    let (kernel, link) = lp.stop().await;
    assert_eq!(link.quits(), 1, "never twice");
    assert!(lock(&kernel.0).detached);
    assert_path(&node.dir);
}

/// A Job pod found by a running loop whose link keeps a connection to its proxy, once its quit
/// is armed ahead: the node, the loop, and the sandbox's and the app's container cgroups.
async fn armed_job(tag: &str) -> (TempNode, Loop, [u64; 2]) {
    let node = TempNode::new(tag);
    let sandbox = node.container(1, "POD");
    let app = node.container(2, "app");
    let _proxy = node.container(3, "istio-proxy");
    let lp = start(&node, Duration::from_secs(120));
    lock(&lp.link.0).kept = true;
    lp.apply(job_pod(json!({})));
    lp.until("armed", |l| l.ahead.armed() == 1).await;
    (node, lp, [sandbox, app])
}

/// The quit sent ahead by the event reader is the one the loop's transition decides: taken over,
/// never sent twice, not counted unclaimed, even when another end of the pod is handled just
/// before it (read in the same batch). A pod that changed before its end (deleting) has nothing
/// armed; a request sent ahead the transition did not call for is counted unclaimed.
#[tokio::test]
async fn a_quit_sent_ahead_by_the_event_reader_is_taken_over_by_the_loop() {
    let (node, lp, [sandbox, app]) = armed_job("ahead").await;
    let pod_cg = node.pod_id();
    // Another end of the pod first (the sandbox's), then the app's, fired by the reader.
    assert_eq!(lp.ahead.fire(&end_of(pod_cg, sandbox, 0)), 0, "not the armed container");
    lp.exit(pod_cg, sandbox, 0);
    assert_eq!(lp.exit_read(pod_cg, app, 0), 1, "sent ahead");
    lp.until("the quit counted", |l| quit_metric(&l.metrics).ends_with(" 1")).await;
    {
        let s = lock(&lp.link.0);
        assert_eq!(s.taken_over, 1, "the loop's quit took the request over");
        assert_eq!(s.requests.iter().filter(|r| r.1 == "POST").count(), 1, "one quit: {:?}", s.requests);
    }
    let text = lp.metrics.encode();
    assert!(text.contains("valet_quits_sent_ahead_total{result=\"sent\"} 1\n"), "{text}");
    assert!(text.contains("valet_quits_sent_ahead_total{result=\"unclaimed\"} 0\n"), "{text}");
    assert_eq!(lp.ahead.armed(), 0, "nothing armed once the work is done");
    lp.stop().await;

    // Armed, then the pod is deleted: disarmed. A request the reader had already sent for an
    // end the loop then does not quit for is dropped and counted.
    let (node, lp, [_, app]) = armed_job("ahead-gone").await;
    let pod_cg = node.pod_id();
    let mut exit = end_of(pod_cg, app, 0);
    exit.quits_sent_ahead = lp.ahead.fire(&exit);
    assert_eq!(exit.quits_sent_ahead, 1);
    let mut deleting = serde_json::to_value(job_pod(json!({}))).expect("json");
    deleting["metadata"]["deletionTimestamp"] = json!("2026-01-01T00:00:00Z");
    lp.apply(serde_json::from_value(deleting).expect("pod"));
    // Handled once the pod stood down (the firing above disarmed it already).
    lp.until("stood down for the deletion", |l| {
        lock(&l.kernel.0).watched.is_empty() && lock(&l.link.0).opened.is_empty()
    })
    .await;
    let _ = lp.events.send(Event::Exit(exit));
    lp.until("counted unclaimed", |l| {
        l.metrics.encode().contains("valet_quits_sent_ahead_total{result=\"unclaimed\"} 1\n")
    })
    .await;
    assert_eq!(lock(&lp.link.0).taken_over, 0);
    assert_eq!(lp.ahead.armed(), 0);
    lp.stop().await;
}

#[tokio::test]
async fn a_container_is_named_when_its_cgroup_appears_not_when_it_ends() {
    // A real runtime removes a container's cgroup and bundle tens of milliseconds after its
    // main process exits; an agent that reads the exit later than that must already know the
    // container's name, learnt when its cgroup appeared.
    let node = TempNode::new("named");
    node.container(1, "POD");
    node.container(3, "istio-proxy");
    let lp = start(&node, Duration::from_secs(120));
    lp.apply(job_pod(json!({})));
    let pod_cg = node.pod_id();
    lp.until("the pod cgroup watched", |l| lock(&l.kernel.0).watched.get(&pod_cg) == Some(&watch_flags::EXITS)).await;
    let app = node.container(2, "app");
    // The loop reads a new container's bundle, then asks the kernel about it, in one step.
    lp.until("the new container read", |l| lock(&l.kernel.0).exec_asked.contains(&app)).await;
    // The app ran and ended; the runtime removed its cgroup and bundle before the agent read the
    // exit (the API has not named the container either).
    std::fs::remove_dir_all(node.cgroups.abs(&node.container_rel(2))).expect("rm cgroup");
    std::fs::remove_dir_all(node.dir.join("bundles").join("02".repeat(32))).expect("rm bundle");
    lp.exit(pod_cg, app, 0);
    lp.until("the quit", |l| l.link.quits() == 1).await;
    lp.stop().await;
}

// On a paused clock: the runtime's time moves only when nothing can run, so "no write within
// 400 ms" means none after the probes of 400 ms (20 ms apart) and all they caused, however busy
// the machine is. Nothing here waits on another thread or the kernel.
#[tokio::test(start_paused = true)]
async fn condition_writes_never_overtake_each_other() {
    let node = TempNode::new("cond");
    node.container(1, "POD");
    node.container(2, "app");
    node.container(3, "istio-proxy");
    let mut lp = start(&node, Duration::from_secs(120));
    lp.apply(job_pod(json!({})));
    let first = next_patch(&mut lp.api).await.expect("first condition write");
    assert_eq!(condition_of(&first), ("False".into(), "ProxyNotReady".into()));
    // The proxy turns ready while the first write is still unanswered: no second write yet.
    lock(&lp.link.0).ready = true;
    assert!(no_patch(&mut lp.api, Duration::from_millis(400)).await, "a second write overtook the first");
    let _ = first.answer.send(());
    let second = next_patch(&mut lp.api).await.expect("second condition write");
    assert_eq!(condition_of(&second), ("True".into(), "ProxyReady".into()));
    let _ = second.answer.send(());
    assert!(no_patch(&mut lp.api, Duration::from_millis(300)).await, "written once per change");
    lp.stop().await;
}

#[tokio::test]
async fn a_held_app_fails_open_at_the_hold_timeout() {
    let node = TempNode::new("timeout");
    node.container(1, "POD");
    let app = node.container(2, "app");
    node.container(3, "istio-proxy");
    let lp = start(&node, Duration::from_secs(1));
    lp.apply(job_pod(json!({"valet.dev/hold-app": "true"})));
    let pod_cg = node.pod_id();
    lp.until("the pod watched with hold", |l| {
        lock(&l.kernel.0).watched.get(&pod_cg).map(|f| f & 0xff) == Some(watch_flags::EXITS | watch_flags::HOLD)
    })
    .await;
    assert_eq!(lock(&lp.kernel.0).classified.get(&app), Some(&true), "the app is classified before it execs");
    assert_eq!(
        lock(&lp.kernel.0).watched.get(&pod_cg).map(|f| f >> watch_flags::HOLD_TIMEOUT_SHIFT),
        Some(1000),
        "the kernel is told the 1 s hold timeout (ms), for the deadline in its record"
    );
    let child = stopped_child().await;
    node.add_process(2, child.id());
    // The hold counts from the kernel's stop, which the event says is now: before this instant.
    let held = std::time::Instant::now();
    lp.held(pod_cg, app, child.id());
    assert!(wait_state(child.id(), 'S').await, "released after the 1 s hold timeout");
    let released_after = held.elapsed();
    // A lower bound only: a busy machine makes a release late, never early.
    assert!(released_after >= Duration::from_secs(1), "released {released_after:?} after it was held");
    lp.until("fail-open counted", |l| l.metrics.encode().contains("valet_app_hold_fail_opens_total 1")).await;
    lp.until("the release counted", |l| metric(&l.metrics, "valet_app_releases_total{reason=\"timeout\"}") == 1.0)
        .await;
    lp.stop().await;
    kill(child);
}

#[tokio::test]
async fn without_a_pinned_record_of_holds_the_app_is_not_held() {
    let node = TempNode::new("unpinned");
    node.container(1, "POD");
    node.container(2, "app");
    node.container(3, "istio-proxy");
    let lp = start(&node, Duration::from_secs(1));
    lock(&lp.kernel.0).unpinned = true;
    lp.apply(job_pod(json!({"valet.dev/hold-app": "true"})));
    let pod_cg = node.pod_id();
    lp.until("the pod watched", |l| lock(&l.kernel.0).watched.contains_key(&pod_cg)).await;
    assert_eq!(lock(&lp.kernel.0).watched.get(&pod_cg), Some(&watch_flags::EXITS), "watched without the hold bit");
    lp.until("the refusal counted", |l| metric(&l.metrics, "valet_app_holds_refused_total") == 1.0).await;
    lp.stop().await;
}

#[tokio::test]
async fn processes_an_earlier_agent_left_held_are_adopted_and_released_when_ready() {
    let node = TempNode::new("adopt");
    node.container(1, "POD");
    node.container(2, "app");
    node.container(3, "istio-proxy");
    let app_child = stopped_child().await;
    let proxy_child = stopped_child().await;
    node.add_process(2, app_child.id());
    node.add_process(3, proxy_child.id());
    node.fake_held_at_exec(app_child.id());
    node.fake_held_at_exec(proxy_child.id());
    let lp = start(&node, Duration::from_secs(120));
    lp.apply(job_pod(json!({"valet.dev/hold-app": "true"})));
    assert!(wait_state(proxy_child.id(), 'S').await, "the sidecar left held is released at once");
    // Probes that answered "not ready" came after the adoption that released the sidecar.
    let probes = |l: &Loop| lock(&l.link.0).requests.iter().filter(|r| r.1 == "GET").count();
    lp.until("three probes answered not ready", |l| probes(l) >= 3).await;
    assert_eq!(state(app_child.id()), Some('T'), "the app stays held until the proxy is ready");
    lock(&lp.link.0).ready = true;
    assert!(wait_state(app_child.id(), 'S').await, "released when the proxy is ready");
    // Released once, for the proxy's readiness: not at its adoption.
    lp.until("the releases counted", |l| {
        metric(&l.metrics, "valet_app_releases_total{reason=\"ready\"}") == 1.0
            && metric(&l.metrics, "valet_app_releases_total{reason=\"not_app\"}") == 1.0
    })
    .await;
    lp.stop().await;
    kill(app_child);
    kill(proxy_child);
}

#[tokio::test]
async fn containers_made_after_a_held_pod_is_watched_are_classified_before_they_exec() {
    let node = TempNode::new("made");
    node.container(1, "POD");
    let lp = start(&node, Duration::from_secs(120));
    lp.apply(job_pod(json!({"valet.dev/hold-app": "true"})));
    let pod_cg = node.pod_id();
    lp.until("the pod watched with hold", |l| {
        lock(&l.kernel.0).watched.get(&pod_cg).map(|f| f & 0xff) == Some(watch_flags::EXITS | watch_flags::HOLD)
    })
    .await;
    // The runtime creates the containers; nothing has exec'd, the kernel has said nothing. The
    // proxy's init process already waits in its cgroup, in its own pid namespace (as `runc
    // init` does until `runc start`): it is not the container's main process yet.
    let waiting = stopped_child().await;
    node.fake_held_at_exec(waiting.id());
    let proxy = node.container_with(3, "istio-proxy", Some(waiting.id()));
    let app = node.container(2, "app");
    lp.until("both classified from their bundles", |l| {
        let k = lock(&l.kernel.0);
        k.classified.contains_key(&proxy) && k.classified.contains_key(&app)
    })
    .await;
    {
        let k = lock(&lp.kernel.0);
        assert_eq!(k.classified.get(&proxy), Some(&false), "the sidecar's first exec runs");
        assert_eq!(k.classified.get(&app), Some(&true), "the app's first exec is held");
        assert!(
            !k.recorded.iter().any(|(cg, _)| *cg == proxy),
            "a process waiting to exec is never recorded as the main process: {:?}",
            k.recorded
        );
    }
    lp.stop().await;
    kill(waiting);
}

/// A held Job pod on `node` (sandbox, app, istio-proxy) whose app process is stopped and counted
/// held by the loop.
async fn holding_an_app(node: &TempNode) -> (Loop, Child) {
    node.container(1, "POD");
    let app = node.container(2, "app");
    node.container(3, "istio-proxy");
    let lp = start(node, Duration::from_secs(120));
    lp.apply(job_pod(json!({"valet.dev/hold-app": "true"})));
    let pod_cg = node.pod_id();
    lp.until("the pod watched", |l| lock(&l.kernel.0).watched.contains_key(&pod_cg)).await;
    let child = stopped_child().await;
    node.add_process(2, child.id());
    lp.held(pod_cg, app, child.id());
    lp.until("the hold counted", |l| metric(&l.metrics, "valet_app_holds_total") == 1.0).await;
    (lp, child)
}

#[tokio::test]
async fn shutdown_releases_everything_held() {
    let node = TempNode::new("shutdown");
    let (lp, child) = holding_an_app(&node).await;
    assert_eq!(state(child.id()), Some('T'), "released before the shutdown");
    let (kernel, _) = lp.stop().await;
    assert!(wait_state(child.id(), 'S').await, "released on shutdown");
    assert!(lock(&kernel.0).detached);
    kill(child);
}

/// A successor comes (a container restart, a rollout), or the API could not say: the held app
/// stays stopped once the loop has returned, for the successor (and the deadline keeper).
#[tokio::test]
async fn shutdown_with_a_successor_or_no_answer_leaves_the_held_app_stopped() {
    for (tag, why) in [
        ("restart", Stop::HandOver(Successor::ContainerRestart)),
        ("rollout", Stop::HandOver(Successor::Rollout)),
        ("unanswered", Stop::Keep("no answer within 2s".into())),
    ] {
        let node = TempNode::new(&format!("handover-{tag}"));
        let (lp, child) = holding_an_app(&node).await;
        let metrics = lp.metrics.clone();
        let (kernel, _, done) = lp.stop_with(why.clone()).await;
        assert_eq!(done, Some(why), "{tag}: the loop returned what it was told");
        assert_eq!(state(child.id()), Some('T'), "{tag}: released at shutdown");
        assert_eq!(metric(&metrics, "valet_app_releases_total{reason=\"shutdown\"}"), 0.0, "{tag}: a release counted");
        assert!(lock(&kernel.0).detached, "{tag}");
        kill(child);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn liveness_fails_while_the_loop_is_wedged_and_recovers_with_it() {
    let node = TempNode::new("wedge");
    let l = start(&node, Duration::from_secs(60));
    let live = |l: &Loop| l.health.stalled(now_ns()).is_none();
    // A pod arrives; its first step asks the kernel to watch its cgroup, and that call never
    // returns: the loop's thread is stuck in it.
    l.kernel.wedge(true);
    l.apply(job_pod(json!({})));
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while live(&l) {
        assert!(tokio::time::Instant::now() < deadline, "liveness never failed while the loop was wedged");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(lock(&l.kernel.0).watched.is_empty(), "the call is still stuck");
    // The call returns: the loop turns again, and liveness with it.
    l.kernel.wedge(false);
    l.until("the pod watched", |l| !lock(&l.kernel.0).watched.is_empty()).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while !live(&l) {
        assert!(tokio::time::Instant::now() < deadline, "liveness did not come back with the loop");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    l.stop().await;
}
