//! A simulated kubelet and container runtime for [`SimPod`]s, as unhelpful as the real ones by
//! default:
//!
//! - it starts a pod's containers like the kubelet: the sandbox first, then the init containers
//!   one after another, then the containers in spec order (a container without a command is left
//!   waiting until the test starts it with [`Kubelet::start_container`]);
//! - like containerd, it writes each container's OCI bundle (`<state dir>/<id>/config.json` with
//!   the CRI annotations; CRI-O pods: `<id>/userdata/config.json`) *before* the container's
//!   process starts, removes the container's cgroup ~25 ms after its main process exited and its
//!   last process left, and the bundle 50–340 ms after that; the pod's cgroup stays until the pod
//!   is removed;
//! - it reports to the API only what its PLEG relist saw: relists happen on a per-node clock
//!   ticking every second, and each is written a status-sync delay (tens of ms) later. So a
//!   container's `containerID` and `state.running` appear at the first tick after its start (never
//!   earlier), `terminated` at the first tick after its exit;
//! - `ready` follows the container's readinessProbe (httpGet on the pod IP from the host, with its
//!   periodSeconds and initialDelaySeconds, probed once the kubelet saw the container running) and is
//!   true at once for a container without one;
//! - pod phase as the kubelet computes it; restartPolicy OnFailure (and Always, and native
//!   sidecars) restarts an exited container in place: a new container id, a new cgroup,
//!   `restartCount` + 1, `lastState.terminated` holding the old instance. The back-off before a
//!   restart is [`KubeletOptions::restart_backoff`] doubling per restart: **1 s by default, kinder
//!   than the real kubelet's 10 s** (a test can set 10 s).
//! - native sidecars (init containers with `restartPolicy: Always`, KEP-753) as
//!   `computePodActions` runs them, deciding on what the last relist saw (the rules and their
//!   sources: `docs/dev/native-sidecars.md`): each starts in spec order and holds the next container
//!   until a sync saw it running and its startupProbe passed; one seen exited while a regular
//!   container runs (or is to be restarted) is restarted; once a sync sees every regular
//!   container done (Never, or OnFailure after exit 0), the pod is killed: no sidecar is
//!   restarted, whatever the relist saw of it, and the running ones are stopped last first, each
//!   with its preStop hook, its turn, SIGTERM and SIGKILL at the end of the grace period. They
//!   are reported in `initContainerStatuses`, with `started` false until their startupProbe
//!   passed; their exit codes never fail the pod.
//!
//! Kinder behaviour is opt-in per pod: [`StatusTiming::AtOnce`] (status written the moment a
//! container starts or exits), [`StatusTiming::Manual`] (the pod object is posted once and the
//! test writes statuses itself), no bundles ([`KubeletPod::bundles`]).

use std::collections::BTreeMap;
use std::os::unix::process::ExitStatusExt as _;
use std::path::PathBuf;
use std::process::ExitStatus;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, anyhow, bail};
use serde_json::{Value, json};

mod bundle;
mod probe;
mod status;
mod sync_loop;

use bundle::pause_binary;
pub use bundle::{write_bundle, write_record};
use probe::probe_loop;
use status::initial_pod;
use status::{regular_done, terminated_json};

use crate::apiserver::ApiHandle;
use crate::node::{PodJsonOptions, Runtime, SimContainer, SimPod, SimProcess, SpawnOptions};
use crate::util;

/// Node-wide settings of the simulated kubelet and runtime.
#[derive(Debug, Clone)]
pub struct KubeletOptions {
    /// PLEG relist period (the kubelet's generic PLEG: 1 s).
    pub relist_period: Duration,
    /// Delay between a relist (or a probe result) and its status write: uniform in this range.
    pub status_sync_delay: (Duration, Duration),
    /// Where the runtime writes its OCI bundles (None: nowhere).
    pub runtime_state_dir: Option<PathBuf>,
    /// Where containerd's CRI plugin keeps its container records (`<dir>/<id>/status`, for the
    /// pods of the containerd runtime only; None: nowhere): written when a container starts,
    /// and again with its `FinishedAt` at the moment its exit is recorded (`exit_record_lag`),
    /// each a new file renamed over the old, as containerd's `Status.UpdateSync` does.
    pub runtime_record_dir: Option<PathBuf>,
    /// Where the kubelet makes its container log links (`/var/log/containers`:
    /// `<pod>_<namespace>_<container>-<id>.log`, cut to 251 bytes before `.log`), each right
    /// after the container's start, as `startContainer` does once the runtime's `StartContainer`
    /// returned, and removed with the pod (None: nowhere).
    pub container_log_links: Option<PathBuf>,
    /// Time from a container's exit (its last process gone) to the removal of its cgroup.
    pub cgroup_removal_delay: Duration,
    /// Time from the cgroup's removal to the bundle's: uniform in this range.
    pub bundle_removal_delay: (Duration, Duration),
    /// Back-off before the first restart of a container, doubled per restart up to
    /// `max_restart_backoff`. The real kubelet uses 10 s; the default here, 1 s, is kinder.
    pub restart_backoff: Duration,
    pub max_restart_backoff: Duration,
    /// Time a container's process waits in its cgroup and pid namespace before its exec: from
    /// the runtime's create (cgroup made, bundle written) to its start, two CRI calls apart. A
    /// real node takes longer.
    pub create_start_gap: Duration,
    /// Time from a container's exit (its main process gone, as the kernel sees it) to the
    /// runtime's record of it (CRI `ContainerStatus` EXITED), drawn per exit, uniform in this
    /// range; a container's own [`ContainerSpec::record_lag`] replaces it. containerd records
    /// each container's exit in a goroutine of its own after `task.Delete`, so two exits can be
    /// recorded in either order. Everything the kubelet decides reads this record, never the
    /// kernel.
    pub exit_record_lag: (Duration, Duration),
    /// Evented PLEG (`EventedPLEG`, off by default in real kubelets): each recorded exit syncs
    /// its pod at once, besides the relist.
    pub evented_pleg: bool,
}

impl Default for KubeletOptions {
    fn default() -> Self {
        KubeletOptions {
            relist_period: Duration::from_secs(1),
            status_sync_delay: (Duration::from_millis(10), Duration::from_millis(60)),
            runtime_state_dir: None,
            runtime_record_dir: None,
            container_log_links: None,
            cgroup_removal_delay: Duration::from_millis(25),
            bundle_removal_delay: (Duration::from_millis(50), Duration::from_millis(340)),
            restart_backoff: Duration::from_secs(1),
            max_restart_backoff: Duration::from_secs(300),
            create_start_gap: Duration::from_millis(5),
            // containerd 1.6 and 2.1 with runc, CRI polled at 1 ms: about 47 ms on a bare host,
            // ~100 ms in a TCG VM (shared/notes, "When the runtime records an exit").
            exit_record_lag: (Duration::from_millis(5), Duration::from_millis(120)),
            evented_pleg: false,
        }
    }
}

/// When the kubelet writes container statuses to the API.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StatusTiming {
    /// As a real kubelet: what the last 1 s relist saw, tens of ms after the tick.
    #[default]
    Relist,
    /// Kinder than any kubelet: the moment a container starts or exits (probes still apply).
    AtOnce,
    /// The pod object is posted once (Pending, no ids) and never updated by the kubelet; the test
    /// writes statuses itself (see [`Kubelet::publish_status`]).
    Manual,
}

/// A readinessProbe (`httpGet` on the pod IP).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpProbe {
    pub port: u16,
    pub path: String,
    pub period: Duration,
    pub initial_delay: Duration,
    pub timeout: Duration,
    pub failure_threshold: u32,
}

impl HttpProbe {
    /// The startupProbe Istio's injector gives a native `istio-proxy` (Istio 1.27
    /// `injection-template.yaml`): `GET :15021/healthz/ready`, periodSeconds 1, timeoutSeconds 3,
    /// failureThreshold 600.
    pub fn istio_startup() -> HttpProbe {
        HttpProbe { period: Duration::from_secs(1), failure_threshold: 600, ..HttpProbe::istio() }
    }
    /// The readinessProbe Istio's injector gives `istio-proxy`: `GET :15021/healthz/ready`,
    /// periodSeconds 15, timeoutSeconds 3, failureThreshold 4.
    pub fn istio() -> HttpProbe {
        HttpProbe {
            port: 15021,
            path: "/healthz/ready".into(),
            period: Duration::from_secs(15),
            initial_delay: Duration::ZERO,
            timeout: Duration::from_secs(3),
            failure_threshold: 4,
        }
    }
    pub fn http(port: u16, path: &str) -> HttpProbe {
        HttpProbe { port, path: path.into(), period: Duration::from_secs(10), ..HttpProbe::istio() }
    }
    pub fn period(mut self, period: Duration) -> Self {
        self.period = period;
        self
    }
    pub fn initial_delay(mut self, d: Duration) -> Self {
        self.initial_delay = d;
        self
    }
    fn json(&self) -> Value {
        let secs = |d: Duration| d.as_secs().max(if d.is_zero() { 0 } else { 1 });
        json!({
            "httpGet": {"path": self.path, "port": self.port, "scheme": "HTTP"},
            "initialDelaySeconds": secs(self.initial_delay),
            "periodSeconds": secs(self.period).max(1),
            "timeoutSeconds": secs(self.timeout).max(1),
            "successThreshold": 1,
            "failureThreshold": self.failure_threshold,
        })
    }
}

/// What kind of container of the pod spec.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ContainerKind {
    /// `spec.containers`.
    #[default]
    Main,
    /// `spec.initContainers`, run to completion one after another before the main containers.
    Init,
    /// `spec.initContainers` with `restartPolicy: Always` (KEP-753): started in order, the next
    /// init step starts once it runs; always restarted.
    NativeSidecar,
}

/// One of a container's `restartPolicyRules`: (action, exit code operator, values).
pub type RestartRule = (String, String, Vec<i32>);

/// One container of a [`KubeletPod`]; the [`SimPod`] must have a container of that name.
#[derive(Debug, Clone, Default)]
pub struct ContainerSpec {
    pub name: String,
    pub kind: ContainerKind,
    /// Its main process; None: left waiting until [`Kubelet::start_container`].
    pub command: Option<Vec<String>>,
    pub spawn: SpawnOptions,
    pub readiness: Option<HttpProbe>,
    /// A startupProbe (`httpGet` on the pod IP): a native sidecar holds the next container until
    /// it passes (KEP-753); `started` is false in the status until then.
    pub startup: Option<HttpProbe>,
    /// A preStop `exec` hook, run in the container's pid and network namespaces when the kubelet
    /// stops the container, before its SIGTERM.
    pub pre_stop: Option<Vec<String>>,
    /// A regular container's own `restartPolicy` (KEP-5307), overriding the pod's.
    pub restart_policy: Option<String>,
    /// Its `restartPolicyRules`, in order.
    pub restart_rules: Vec<RestartRule>,
    /// The runtime records this container's exits this long after them (in place of
    /// [`KubeletOptions::exit_record_lag`]).
    pub record_lag: Option<Duration>,
}

impl ContainerSpec {
    pub fn new(name: &str) -> ContainerSpec {
        ContainerSpec { name: name.into(), ..Default::default() }
    }
    pub fn command(mut self, cmd: &[&str]) -> Self {
        self.command = Some(cmd.iter().map(|s| s.to_string()).collect());
        self
    }
    pub fn readiness(mut self, probe: HttpProbe) -> Self {
        self.readiness = Some(probe);
        self
    }
    pub fn kind(mut self, kind: ContainerKind) -> Self {
        self.kind = kind;
        self
    }
    pub fn startup(mut self, probe: HttpProbe) -> Self {
        self.startup = Some(probe);
        self
    }
    pub fn pre_stop(mut self, cmd: &[&str]) -> Self {
        self.pre_stop = Some(cmd.iter().map(|s| s.to_string()).collect());
        self
    }
    /// The runtime records its exits this long after them.
    pub fn record_lag(mut self, lag: Duration) -> Self {
        self.record_lag = Some(lag);
        self
    }
    /// The container's own `restartPolicy` (KEP-5307).
    pub fn restart_policy(mut self, policy: &str) -> Self {
        self.restart_policy = Some(policy.into());
        self
    }
    /// One more `restartPolicyRules` entry: `action` when the exit code is (`In`) or is not
    /// (`NotIn`) among `values`.
    pub fn restart_rule(mut self, action: &str, operator: &str, values: &[i32]) -> Self {
        self.restart_rules.push((action.into(), operator.into(), values.to_vec()));
        self
    }

    /// Whether the kubelet restarts this regular container after it exited with `code` in a pod
    /// whose `restartPolicy` is `pod_policy`, as `ContainerShouldRestart`
    /// (`pkg/api/v1/pod/util.go`, with `ContainerRestartRules` on, beta from 1.35) decides: with a
    /// restartPolicy of its own, the first rule whose exit codes match decides (`Restart`: yes; an
    /// action it does not know: no; a rule whose operator it does not know is skipped), else the
    /// container's policy; without one, the pod's.
    pub fn should_restart(&self, pod_policy: &str, code: i32) -> bool {
        let by_policy = |policy: &str| match policy {
            "Always" => true,
            "OnFailure" => code != 0,
            _ => false,
        };
        let Some(own) = &self.restart_policy else { return by_policy(pod_policy) };
        for (action, operator, values) in &self.restart_rules {
            let matched = match operator.as_str() {
                "In" => values.contains(&code),
                "NotIn" => !values.contains(&code),
                _ => false,
            };
            if matched {
                return action == "Restart";
            }
        }
        by_policy(own)
    }
}

/// A pod handed to the kubelet.
#[derive(Debug, Clone)]
pub struct KubeletPod {
    /// Metadata and spec of the pod object (node, labels, annotations, restart policy, job).
    pub json: PodJsonOptions,
    /// In spec order.
    pub containers: Vec<ContainerSpec>,
    pub status: StatusTiming,
    /// Write OCI bundles into the node's runtime state dir (default true).
    pub bundles: bool,
    /// Report `status.podIP` (default true; false: the API never shows it).
    pub report_pod_ip: bool,
    /// Post the pod object when the kubelet takes the pod (default true; false: the test posts
    /// it, the kubelet's status writes go to it once it exists).
    pub post: bool,
    /// `terminationGracePeriodSeconds` (default 30 s): how long the kubelet waits for a container
    /// it stops (preStop hook, its turn, SIGTERM) before its SIGKILL.
    pub grace_period: Duration,
}

impl KubeletPod {
    pub fn new(json: PodJsonOptions, containers: Vec<ContainerSpec>) -> KubeletPod {
        KubeletPod {
            json,
            containers,
            status: StatusTiming::Relist,
            bundles: true,
            report_pod_ip: true,
            post: true,
            grace_period: Duration::from_secs(30),
        }
    }
}

/// A container's main process started by the kubelet; clones share it. The kubelet reaps it, so
/// wait through this handle, never on the pid.
#[derive(Debug, Clone)]
pub struct ContainerProcess {
    inner: Arc<Mutex<SimProcess>>,
    pid: u32,
    container: SimContainer,
}

impl ContainerProcess {
    fn new(p: SimProcess, container: SimContainer) -> ContainerProcess {
        ContainerProcess { pid: p.host_pid(), inner: Arc::new(Mutex::new(p)), container }
    }
    pub fn host_pid(&self) -> u32 {
        self.pid
    }
    /// The container instance it runs in (id, cgroup).
    pub fn container(&self) -> &SimContainer {
        &self.container
    }
    pub fn id(&self) -> &str {
        &self.container.id
    }
    pub fn try_wait(&self) -> Result<Option<ExitStatus>> {
        lock(&self.inner).try_wait()
    }
    /// Whether it has been reaped already (by a test's wait or kill, say), without a syscall.
    fn reaped(&self) -> bool {
        lock(&self.inner).reaped()
    }
    pub fn wait_timeout(&self, timeout: Duration) -> Result<Option<ExitStatus>> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = self.try_wait()? {
                return Ok(Some(s));
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    pub fn signal(&self, sig: i32) -> Result<()> {
        lock(&self.inner).signal(sig)
    }
    pub fn kill(&self) -> Result<ExitStatus> {
        lock(&self.inner).kill()
    }
}

/// A horizon past every exit's record: what a test-driven status shows (every exit the kernel saw).
const RECORDED_ALL: Duration = Duration::from_secs(3600);

/// The exit code the kubelet reports for a status: the code, or 128 + the signal.
pub fn exit_code(s: ExitStatus) -> i32 {
    s.code().unwrap_or_else(|| 128 + s.signal().unwrap_or(0))
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn uniform(range: (Duration, Duration)) -> Duration {
    let (lo, hi) = range;
    if hi <= lo {
        return lo;
    }
    let mut b = [0u8; 8];
    util::random_bytes(&mut b);
    let span = (hi - lo).as_nanos() as u64;
    lo + Duration::from_nanos(u64::from_le_bytes(b) % span.max(1))
}

#[derive(Debug, Clone)]
struct Exit {
    code: i32,
    signal: Option<i32>,
    at: Instant,
    finished: String,
    /// When the runtime records it: the kubelet sees the exit from then on.
    recorded_at: Instant,
}

impl Exit {
    /// Whether the runtime has recorded it by `now`.
    fn recorded(&self, now: Instant) -> bool {
        now >= self.recorded_at
    }
}

#[derive(Debug)]
struct Instance {
    c: SimContainer,
    proc_: ContainerProcess,
    started: String,
    exit: Option<Exit>,
    /// The kubelet has seen it running (a relist did): probes may start.
    seen: Arc<AtomicBool>,
    ready: Arc<AtomicBool>,
    /// Its startupProbe passed (true from the start without one).
    started_ok: Arc<AtomicBool>,
    /// Stops its probe thread.
    stop: Arc<probe::Stop>,
    cgroup_removed: bool,
    bundle_remove_at: Option<Instant>,
    bundle_removed: bool,
    /// Its exit's record was noticed (an evented PLEG's event).
    record_noticed: bool,
}

impl Instance {
    fn done(&self) -> bool {
        self.exit.is_some() && self.cgroup_removed && self.bundle_removed
    }
}

impl Drop for Instance {
    fn drop(&mut self) {
        self.stop.set();
    }
}

#[derive(Debug)]
struct KContainer {
    spec: ContainerSpec,
    image: String,
    current: Option<Instance>,
    /// Exited instances whose cgroup or bundle is still to be removed.
    old: Vec<Instance>,
    restart_count: u32,
    last_terminated: Option<Value>,
    restart_at: Option<Instant>,
    /// The kubelet is stopping its current instance (native sidecars once the pod's regular
    /// containers are done).
    stopping: Option<Stopping>,
}

/// One container the kubelet stops, as `killContainer` does (`kuberuntime_container.go`): the
/// preStop hook, then its turn (`terminationOrdering.waitForTurn`: a native sidecar waits for the
/// regular containers and the sidecars after it), then `StopContainer` (SIGTERM, SIGKILL when the
/// grace period is over), each step taking from one grace period.
#[derive(Debug)]
struct Stopping {
    pre_stop: Option<SimProcess>,
    /// The end of the grace period.
    deadline: Instant,
    sigterm_at: Option<Instant>,
    kill_at: Option<Instant>,
}

/// What a relist saw of one container.
#[derive(Debug, Clone)]
struct Seen {
    id: Option<String>,
    started: Option<String>,
    exit: Option<Exit>,
    restart_pending: bool,
    restart_count: u32,
    last_terminated: Option<Value>,
}

#[derive(Debug)]
struct KPod {
    sim: Arc<SimPod>,
    spec: KubeletPod,
    sandbox: Option<Instance>,
    containers: Vec<KContainer>,
    /// Last relist's view: the sandbox was seen, and each container.
    seen_sandbox: bool,
    seen: Vec<Seen>,
    pending_write: Option<Instant>,
    last_written: Option<Value>,
    /// A probe result changed (set by probe threads).
    dirty: Arc<AtomicBool>,
    /// A runtime change happened since the last relist (AtOnce writes at once).
    changed: bool,
    /// When the next init/main container may start (the kubelet acts on relists).
    next_step_at: Option<Instant>,
    /// When a sync found every regular container done and killed the pod (`computePodActions`:
    /// `KillPod`, no init container restarted): its native sidecars are being stopped.
    killing: Option<Instant>,
    /// The runtime recorded an exit since the last relist (an evented PLEG syncs on it).
    recorded_now: bool,
}

struct Inner {
    api: ApiHandle,
    opts: KubeletOptions,
    epoch: Instant,
    pods: Mutex<BTreeMap<(String, String), KPod>>,
    /// No status write before this moment (see [`Kubelet::hold_status_writes`]).
    writes_held_until: Mutex<Option<Instant>>,
}

/// The simulated kubelet of one node. Clones share it; its thread ends when the last clone is
/// dropped, taking every pod's processes with it.
#[derive(Clone)]
pub struct Kubelet {
    inner: Arc<Inner>,
}

impl Kubelet {
    /// Starts the kubelet's loop (a thread polling every few ms).
    pub fn start(api: ApiHandle, opts: KubeletOptions) -> Result<Kubelet> {
        if let Some(d) = &opts.runtime_state_dir {
            std::fs::create_dir_all(d).with_context(|| format!("mkdir {}", d.display()))?;
        }
        let inner = Arc::new(Inner {
            api,
            opts,
            epoch: Instant::now(),
            pods: Mutex::new(BTreeMap::new()),
            writes_held_until: Mutex::new(None),
        });
        let weak = Arc::downgrade(&inner);
        std::thread::Builder::new().name("sim-kubelet".into()).spawn(move || run(weak)).context("kubelet thread")?;
        Ok(Kubelet { inner })
    }

    /// Holds every pod's status writes until `until`, as a kubelet behind on its work or an API
    /// server too slow to take them would: what happens meanwhile reaches the API late, from the
    /// relist after `until` (nothing is lost; a container that started and ended meanwhile is
    /// reported terminated).
    pub fn hold_status_writes(&self, until: Instant) {
        *lock(&self.inner.writes_held_until) = Some(until);
    }

    pub fn options(&self) -> &KubeletOptions {
        &self.inner.opts
    }

    /// The first relist tick strictly after `t`.
    pub fn next_tick_after(&self, t: Instant) -> Instant {
        self.inner.next_tick_after(t)
    }

    /// Takes a pod: posts its object (Pending, no container ids yet) unless `spec.post` is off,
    /// starts the sandbox, then the containers that have a command. Returns the pod object.
    pub fn add_pod(&self, sim: Arc<SimPod>, spec: KubeletPod) -> Result<Value> {
        for c in &spec.containers {
            sim.container(&c.name)?;
        }
        let key = (sim.namespace().to_string(), sim.name().to_string());
        let pod = initial_pod(&sim, &spec);
        if spec.post {
            self.inner.api.create_pod(pod.clone())?;
        }
        let containers = spec
            .containers
            .iter()
            .map(|c| KContainer {
                spec: c.clone(),
                image: sim.container(&c.name).map(|x| x.image).unwrap_or_default(),
                current: None,
                old: Vec::new(),
                restart_count: 0,
                last_terminated: None,
                restart_at: None,
                stopping: None,
            })
            .collect();
        let n = spec.containers.len();
        let mut kpod = KPod {
            sim,
            spec,
            sandbox: None,
            containers,
            seen_sandbox: false,
            seen: vec![
                Seen {
                    id: None,
                    started: None,
                    exit: None,
                    restart_pending: false,
                    restart_count: 0,
                    last_terminated: None
                };
                n
            ],
            pending_write: None,
            last_written: None,
            dirty: Arc::new(AtomicBool::new(false)),
            changed: true,
            next_step_at: Some(Instant::now()),
            killing: None,
            recorded_now: false,
        };
        // The sandbox's process is named `pause`, like the real one (its comm is what a node
        // shows for it before any name is known).
        let pause = pause_binary()?.to_string_lossy().into_owned();
        let sandbox = self.inner.start_instance(&kpod, None, &[pause, "infinity".into()], &Default::default())?;
        kpod.sandbox = Some(sandbox);
        let mut pods = lock(&self.inner.pods);
        if pods.contains_key(&key) {
            bail!("the kubelet already runs pod {}/{}", key.0, key.1);
        }
        self.inner.step(&mut kpod, Instant::now(), true);
        pods.insert(key, kpod);
        Ok(pod)
    }

    /// Starts container `name` of a pod now with `cmd` (it must not be running); its command is
    /// kept for restarts. Init ordering is the test's business here.
    pub fn start_container(
        &self,
        namespace: &str,
        pod: &str,
        name: &str,
        cmd: &[&str],
        spawn: &SpawnOptions,
    ) -> Result<ContainerProcess> {
        let mut pods = lock(&self.inner.pods);
        let kpod = pods
            .get_mut(&(namespace.to_string(), pod.to_string()))
            .ok_or_else(|| anyhow!("the kubelet has no pod {namespace}/{pod}"))?;
        let i = kpod
            .containers
            .iter()
            .position(|c| c.spec.name == name)
            .ok_or_else(|| anyhow!("pod {pod} has no container {name} for the kubelet"))?;
        if kpod.containers[i].current.as_ref().is_some_and(|c| c.exit.is_none()) {
            bail!("container {name} of {pod} is running already");
        }
        let cmd: Vec<String> = cmd.iter().map(|s| s.to_string()).collect();
        kpod.containers[i].spec.command = Some(cmd.clone());
        kpod.containers[i].spec.spawn = spawn.clone();
        self.inner.start_container_at(kpod, i, &cmd)
    }

    /// The current instance's process of a container (None before it started).
    pub fn process(&self, namespace: &str, pod: &str, name: &str) -> Option<ContainerProcess> {
        let pods = lock(&self.inner.pods);
        let kpod = pods.get(&(namespace.to_string(), pod.to_string()))?;
        if name == "POD" {
            return kpod.sandbox.as_ref().map(|s| s.proc_.clone());
        }
        kpod.containers.iter().find(|c| c.spec.name == name)?.current.as_ref().map(|c| c.proc_.clone())
    }

    /// Writes the runtime's current truth to the API now (ids, states, readiness), whatever the
    /// pod's [`StatusTiming`]: for tests that drive the API view themselves.
    pub fn publish_status(&self, namespace: &str, pod: &str) -> Result<()> {
        let mut pods = lock(&self.inner.pods);
        let kpod = pods
            .get_mut(&(namespace.to_string(), pod.to_string()))
            .ok_or_else(|| anyhow!("the kubelet has no pod {namespace}/{pod}"))?;
        // Every exit the kernel saw counts as recorded: the test drives the API view itself.
        self.inner.relist(kpod, Instant::now() + RECORDED_ALL);
        self.inner.write(kpod)
    }

    /// The `status` the runtime's current truth makes (what [`Kubelet::publish_status`] would
    /// write), without writing it: for tests that write a doctored status in one update.
    pub fn runtime_status(&self, namespace: &str, pod: &str) -> Result<Value> {
        let mut pods = lock(&self.inner.pods);
        let kpod = pods
            .get_mut(&(namespace.to_string(), pod.to_string()))
            .ok_or_else(|| anyhow!("the kubelet has no pod {namespace}/{pod}"))?;
        // Every exit the kernel saw counts as recorded: the test drives the API view itself.
        self.inner.relist(kpod, Instant::now() + RECORDED_ALL);
        Ok(self.inner.status_json(kpod))
    }

    /// Forgets a pod: kills its processes, removes its bundles (the cgroups go with the
    /// [`SimPod`]). The pod object stays in the API.
    pub fn remove_pod(&self, namespace: &str, pod: &str) {
        let removed = lock(&self.inner.pods).remove(&(namespace.to_string(), pod.to_string()));
        if let Some(kpod) = removed {
            self.inner.teardown(kpod);
        }
    }
}

fn run(weak: Weak<Inner>) {
    let mut next_tick = match weak.upgrade() {
        Some(inner) => inner.next_tick_after(Instant::now()),
        None => return,
    };
    loop {
        let Some(inner) = weak.upgrade() else { return };
        let now = Instant::now();
        let relist = now >= next_tick;
        if relist {
            next_tick = inner.next_tick_after(now);
        }
        inner.tick(now, relist);
        drop(inner);
        std::thread::sleep(Duration::from_millis(3));
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        let pods = std::mem::take(&mut *lock(&self.pods));
        for (_, kpod) in pods {
            self.teardown(kpod);
        }
    }
}
