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
use std::net::{Ipv4Addr, SocketAddr};
use std::os::unix::process::ExitStatusExt as _;
use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, anyhow, bail};
use serde_json::{Value, json};

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
    stop: Arc<AtomicBool>,
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
        self.stop.store(true, Ordering::SeqCst);
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
        self.inner.step(&mut kpod, Instant::now());
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

impl Inner {
    fn next_tick_after(&self, t: Instant) -> Instant {
        let p = self.opts.relist_period.as_nanos().max(1);
        let since = t.saturating_duration_since(self.epoch).as_nanos();
        let k = since / p + 1;
        self.epoch + Duration::from_nanos((k * p) as u64)
    }

    fn bundle_dir(&self, kpod: &KPod, id: &str) -> Option<PathBuf> {
        if !kpod.spec.bundles {
            return None;
        }
        let dir = self.opts.runtime_state_dir.as_ref()?;
        Some(dir.join(id))
    }

    /// Writes the bundle, makes the cgroup, spawns the process (`spec` None: the sandbox).
    fn start_instance(
        &self,
        kpod: &KPod,
        spec: Option<&ContainerSpec>,
        cmd: &[String],
        spawn: &SpawnOptions,
    ) -> Result<Instance> {
        let name = spec.map_or("POD", |s| s.name.as_str());
        let c = kpod.sim.container(name)?;
        if let Some(dir) = self.bundle_dir(kpod, &c.id) {
            write_bundle(&dir, &kpod.sim, &c, spec.is_none())?;
        }
        kpod.sim.make_container_cgroup(&c)?;
        let args: Vec<&str> = cmd.iter().map(String::as_str).collect();
        let mut spawn = spawn.clone();
        if spawn.exec_delay.is_none() && !self.opts.create_start_gap.is_zero() {
            spawn.exec_delay = Some(self.opts.create_start_gap);
        }
        let p = kpod.sim.spawn(name, &args, &spawn)?;
        let proc_ = ContainerProcess::new(p, c.clone());
        let inst = Instance {
            c,
            proc_,
            started: util::now_rfc3339(),
            exit: None,
            seen: Arc::new(AtomicBool::new(false)),
            ready: Arc::new(AtomicBool::new(false)),
            started_ok: Arc::new(AtomicBool::new(spec.is_none_or(|s| s.startup.is_none()))),
            stop: Arc::new(AtomicBool::new(false)),
            cgroup_removed: false,
            bundle_remove_at: None,
            bundle_removed: false,
            record_noticed: false,
        };
        if let Some(probe) = spec.and_then(|s| s.readiness.clone()) {
            let ip = kpod.sim.pod_ip();
            let (seen, ready, stop, dirty) =
                (inst.seen.clone(), inst.ready.clone(), inst.stop.clone(), kpod.dirty.clone());
            let started = Instant::now();
            std::thread::Builder::new()
                .name("sim-prober".into())
                .spawn(move || probe_loop(probe, ip, started, seen, ready, stop, dirty, false))
                .context("probe thread")?;
        }
        if let Some(probe) = spec.and_then(|s| s.startup.clone()) {
            let ip = kpod.sim.pod_ip();
            let (seen, started_ok, stop, dirty) =
                (inst.seen.clone(), inst.started_ok.clone(), inst.stop.clone(), kpod.dirty.clone());
            let started = Instant::now();
            std::thread::Builder::new()
                .name("sim-startup".into())
                .spawn(move || probe_loop(probe, ip, started, seen, started_ok, stop, dirty, true))
                .context("startup probe thread")?;
        }
        Ok(inst)
    }

    fn start_container_at(&self, kpod: &mut KPod, i: usize, cmd: &[String]) -> Result<ContainerProcess> {
        let k = &kpod.containers[i];
        let restarting = k.current.is_some();
        if restarting {
            kpod.sim.new_instance(&k.spec.name)?;
        }
        let spec = k.spec.clone();
        let inst = self.start_instance(kpod, Some(&spec), cmd, &spec.spawn)?;
        let proc_ = inst.proc_.clone();
        let k = &mut kpod.containers[i];
        if let Some(old) = k.current.take() {
            let scheme = kpod.sim.runtime().id_scheme();
            k.last_terminated = old.exit.as_ref().map(|e| terminated_json(&old, e, scheme));
            k.restart_count += 1;
            k.old.push(old);
        }
        k.restart_at = None;
        k.current = Some(inst);
        kpod.changed = true;
        Ok(proc_)
    }

    /// What the kubelet does on its own: reaps, restarts, starts the next containers, removes
    /// cgroups and bundles of exited containers.
    fn step(&self, kpod: &mut KPod, now: Instant) {
        // Exits, as the kernel has them, and their records, as the runtime makes them later.
        let lag_range = self.opts.exit_record_lag;
        let (mut exited_now, mut recorded_now) = (false, false);
        let mut look = |inst: &mut Instance, lag: Option<Duration>| {
            if let Some(exit) = &inst.exit
                && !inst.record_noticed
                && exit.recorded(now)
            {
                inst.record_noticed = true;
                recorded_now = true;
            }
            if inst.exit.is_none()
                && let Ok(Some(status)) = inst.proc_.try_wait()
            {
                inst.exit = Some(Exit {
                    code: exit_code(status),
                    signal: status.signal(),
                    at: now,
                    finished: util::now_rfc3339(),
                    recorded_at: now + lag.unwrap_or_else(|| uniform(lag_range)),
                });
                inst.stop.store(true, Ordering::SeqCst);
                inst.ready.store(false, Ordering::SeqCst);
                exited_now = true;
            }
        };
        if let Some(sandbox) = kpod.sandbox.as_mut() {
            look(sandbox, None);
        }
        for k in kpod.containers.iter_mut() {
            let lag = k.spec.record_lag;
            for inst in k.current.iter_mut().chain(k.old.iter_mut()) {
                look(inst, lag);
            }
        }
        if exited_now {
            kpod.changed = true;
        }
        if recorded_now {
            kpod.changed = true;
            kpod.recorded_now = true;
        }
        // Restarts (decided from the exit; the back-off counts from the relist that saw it).
        let policy = kpod.spec.json.restart_policy.clone();
        for k in kpod.containers.iter_mut() {
            let Some(cur) = &k.current else { continue };
            let Some(exit) = cur.exit.as_ref().filter(|e| e.recorded(now)) else { continue };
            if k.restart_at.is_some() {
                continue;
            }
            let restart = match k.spec.kind {
                // Decided by the sync that sees the exit (see `sync`): not if the pod is done.
                ContainerKind::NativeSidecar => false,
                _ => k.spec.should_restart(&policy, exit.code),
            };
            if restart && k.spec.command.is_some() {
                let shift = k.restart_count.min(16);
                let backoff = self.opts.restart_backoff.saturating_mul(1 << shift).min(self.opts.max_restart_backoff);
                k.restart_at = Some(self.next_tick_after(exit.at) + backoff);
            }
        }
        let done = regular_done(kpod);
        for i in 0..kpod.containers.len() {
            if kpod.containers[i].spec.kind == ContainerKind::NativeSidecar
                && kpod.containers[i].restart_at.is_some()
                && (done || kpod.killing.is_some())
            {
                // The sync at the end of the back-off sees every regular container done: it kills
                // the pod instead (`computePodActions` drops `InitContainersToStart`).
                kpod.containers[i].restart_at = None;
            }
            if kpod.containers[i].restart_at.is_some_and(|t| now >= t) {
                let cmd = kpod.containers[i].spec.command.clone().unwrap_or_default();
                if let Err(e) = self.start_container_at(kpod, i, &cmd) {
                    tracing::warn!("sim kubelet: restart of {} failed: {e:#}", kpod.containers[i].spec.name);
                    kpod.containers[i].restart_at = Some(now + Duration::from_secs(1));
                }
            }
        }
        // Start what comes next, in spec order: init steps one at a time, then every container.
        if kpod.next_step_at.is_some_and(|t| now >= t) && kpod.killing.is_some() {
            kpod.next_step_at = None;
        }
        if kpod.next_step_at.is_some_and(|t| now >= t) {
            kpod.next_step_at = None;
            let mut blocked = false;
            for i in 0..kpod.containers.len() {
                let k = &kpod.containers[i];
                let is_init = k.spec.kind != ContainerKind::Main;
                if blocked {
                    break;
                }
                if k.current.is_none() && k.spec.command.is_some() {
                    let cmd = k.spec.command.clone().unwrap_or_default();
                    if let Err(e) = self.start_container_at(kpod, i, &cmd) {
                        tracing::warn!("sim kubelet: start of {} failed: {e:#}", kpod.containers[i].spec.name);
                    }
                }
                let k = &kpod.containers[i];
                match (k.spec.kind, &k.current) {
                    (ContainerKind::Init, Some(inst)) if inst.exit.as_ref().is_none_or(|e| e.code != 0) => {
                        blocked = true
                    }
                    (ContainerKind::Init, Some(_)) => {}
                    // A native sidecar lets the next container start once a sync saw it running
                    // and its startupProbe (if any) passed.
                    (ContainerKind::NativeSidecar, Some(inst))
                        if inst.seen.load(Ordering::SeqCst) && inst.started_ok.load(Ordering::SeqCst) => {}
                    _ if is_init => blocked = true,
                    _ => {}
                }
            }
        }
        // An init step finished: the next starts on the following relist.
        if exited_now
            && kpod.containers.iter().any(|k| {
                k.spec.kind == ContainerKind::Init
                    && k.current.as_ref().and_then(|c| c.exit.as_ref()).is_some_and(|e| e.code == 0 && e.at == now)
            })
        {
            kpod.next_step_at = Some(self.next_tick_after(now) + uniform(self.opts.status_sync_delay));
        }
        self.stop_sidecars(kpod, now);
        // The runtime cleans up after exited containers.
        let cg_delay = self.opts.cgroup_removal_delay;
        let bundle_delay = self.opts.bundle_removal_delay;
        let sim = kpod.sim.clone();
        let bundles: Option<PathBuf> = if kpod.spec.bundles { self.opts.runtime_state_dir.clone() } else { None };
        for k in kpod.containers.iter_mut() {
            for inst in k.current.iter_mut().chain(k.old.iter_mut()) {
                let Some(exit) = &inst.exit else { continue };
                if !inst.cgroup_removed && now >= exit.at + cg_delay && sim.remove_container_cgroup(&inst.c) {
                    inst.cgroup_removed = true;
                    inst.bundle_remove_at = Some(now + uniform(bundle_delay));
                }
                if !inst.bundle_removed && inst.bundle_remove_at.is_some_and(|t| now >= t) {
                    if let Some(dir) = &bundles {
                        let _ = std::fs::remove_dir_all(dir.join(&inst.c.id));
                    }
                    inst.bundle_removed = true;
                }
            }
            k.old.retain(|i| !i.done());
        }
    }

    /// What a sync does with what the last relist saw, for native sidecars
    /// (`computePodActions`, `computeInitContainerActions`): while a regular container still
    /// runs (or is to be restarted), a native sidecar seen exited is restarted after the back-off;
    /// once every regular container is seen done, the pod is killed: no sidecar is restarted and
    /// the running ones are stopped (see [`Inner::stop_sidecars`]). The containers not started
    /// yet are started once what holds them (a sidecar's startup) is seen.
    fn sync(&self, kpod: &mut KPod, now: Instant) {
        let has_native = kpod.containers.iter().any(|k| k.spec.kind == ContainerKind::NativeSidecar);
        if kpod.killing.is_none() && has_native && regular_done(kpod) {
            kpod.killing = Some(now);
            let grace = kpod.spec.grace_period;
            let sim = kpod.sim.clone();
            for k in kpod.containers.iter_mut().filter(|k| k.spec.kind == ContainerKind::NativeSidecar) {
                k.restart_at = None;
                let Some(inst) = k.current.as_ref().filter(|i| i.exit.is_none()) else { continue };
                // The preStop hooks of every container start at once (each `killContainer` runs
                // in a goroutine of its own); each one's turn comes after.
                let pre_stop = k.spec.pre_stop.as_ref().and_then(|cmd| {
                    let args: Vec<&str> = cmd.iter().map(String::as_str).collect();
                    let ns = PathBuf::from(format!("/proc/{}/ns/pid", inst.proc_.host_pid()));
                    let spawn = SpawnOptions { join_pid_namespace: Some(ns), ..Default::default() };
                    sim.spawn(&k.spec.name, &args, &spawn)
                        .map_err(|e| tracing::warn!("sim kubelet: preStop of {} failed: {e:#}", k.spec.name))
                        .ok()
                });
                k.stopping = Some(Stopping { pre_stop, deadline: now + grace, sigterm_at: None, kill_at: None });
            }
            kpod.changed = true;
            return;
        }
        if kpod.killing.is_some() {
            return;
        }
        for (k, seen) in kpod.containers.iter_mut().zip(kpod.seen.iter()) {
            if k.spec.kind != ContainerKind::NativeSidecar || k.restart_at.is_some() || k.spec.command.is_none() {
                continue;
            }
            let seen_exited =
                seen.exit.is_some() && k.current.as_ref().is_some_and(|c| Some(&c.c.id) == seen.id.as_ref());
            if seen_exited {
                // `doBackOff`: a container with no back-off entry yet (its first exit) is restarted
                // by this very sync; later ones after the back-off, doubled per restart.
                let backoff = match k.restart_count {
                    0 => Duration::ZERO,
                    n => self
                        .opts
                        .restart_backoff
                        .saturating_mul(1 << (n - 1).min(16))
                        .min(self.opts.max_restart_backoff),
                };
                k.restart_at = Some(now + backoff);
            }
        }
        let waiting = kpod.containers.iter().any(|k| k.current.is_none() && k.spec.command.is_some());
        if waiting && kpod.next_step_at.is_none() {
            kpod.next_step_at = Some(now + uniform(self.opts.status_sync_delay));
        }
    }

    /// Stops a killed pod's native sidecars, last first (see [`Stopping`]).
    fn stop_sidecars(&self, kpod: &mut KPod, now: Instant) {
        if kpod.killing.is_none() {
            return;
        }
        let regular_ended = kpod
            .containers
            .iter()
            .filter(|k| k.spec.kind != ContainerKind::NativeSidecar)
            .all(|k| k.current.as_ref().is_none_or(|c| c.exit.as_ref().is_some_and(|e| e.recorded(now))));
        // Whether every sidecar after index i has exited.
        let n = kpod.containers.len();
        let mut later_ended = vec![true; n + 1];
        for i in (0..n).rev() {
            let k = &kpod.containers[i];
            let ended = k.spec.kind != ContainerKind::NativeSidecar
                || k.current.as_ref().is_none_or(|c| c.exit.as_ref().is_some_and(|e| e.recorded(now)));
            later_ended[i] = later_ended[i + 1] && ended;
        }
        for i in (0..n).rev() {
            let k = &mut kpod.containers[i];
            let Some(st) = k.stopping.as_mut() else { continue };
            let Some(inst) = k.current.as_ref().filter(|c| c.exit.is_none()) else {
                if let Some(p) = st.pre_stop.as_mut() {
                    let _ = p.kill();
                }
                k.stopping = None;
                continue;
            };
            if st.sigterm_at.is_none() {
                let hook_running = st.pre_stop.as_mut().is_some_and(|p| matches!(p.try_wait(), Ok(None)));
                let my_turn = regular_ended && later_ended[i + 1];
                if (hook_running || !my_turn) && now < st.deadline {
                    continue;
                }
                if let Some(p) = st.pre_stop.as_mut() {
                    let _ = p.kill();
                }
                // What is left of the grace period, at least the kubelet's minimum of 2 s.
                st.sigterm_at = Some(now);
                st.kill_at = Some(st.deadline.max(now + Duration::from_secs(2)));
                if let Err(e) = inst.proc_.signal(libc::SIGTERM) {
                    tracing::warn!("sim kubelet: SIGTERM to {} failed: {e:#}", k.spec.name);
                }
            } else if st.kill_at.is_some_and(|t| now >= t) {
                st.kill_at = None;
                let _ = inst.proc_.signal(libc::SIGKILL);
            }
        }
    }

    /// A PLEG relist: records what the runtime shows now.
    fn relist(&self, kpod: &mut KPod, now: Instant) {
        kpod.recorded_now = false;
        kpod.seen_sandbox = kpod.sandbox.is_some();
        for (k, seen) in kpod.containers.iter().zip(kpod.seen.iter_mut()) {
            *seen = match &k.current {
                None => Seen {
                    id: None,
                    started: None,
                    exit: None,
                    restart_pending: false,
                    restart_count: k.restart_count,
                    last_terminated: k.last_terminated.clone(),
                },
                Some(inst) => {
                    inst.seen.store(true, Ordering::SeqCst);
                    Seen {
                        id: Some(inst.c.id.clone()),
                        started: Some(inst.started.clone()),
                        // The runtime's record: an exit not recorded yet is still running.
                        exit: inst.exit.clone().filter(|e| e.recorded(now)),
                        restart_pending: k.restart_at.is_some(),
                        restart_count: k.restart_count,
                        last_terminated: k.last_terminated.clone(),
                    }
                }
            };
        }
    }

    /// The status the last relist (and the current probe results) make.
    fn status_json(&self, kpod: &KPod) -> Value {
        let scheme = kpod.sim.runtime().id_scheme();
        let mut statuses: Vec<(ContainerKind, Value, bool, bool, Option<i32>, bool)> = Vec::new();
        for (k, seen) in kpod.containers.iter().zip(kpod.seen.iter()) {
            let ready_flag = match (&k.current, &seen.id) {
                (Some(inst), Some(id)) if inst.c.id == *id && inst.exit.is_none() => {
                    k.spec.readiness.is_none() || inst.ready.load(Ordering::SeqCst)
                }
                _ => false,
            };
            let mut v = json!({
                "name": k.spec.name, "image": k.image,
                "imageID": format!("{}@sha256:{}", k.image, "0".repeat(64)),
                "restartCount": seen.restart_count,
                "lastState": seen.last_terminated.clone().map_or(json!({}), |t| json!({"terminated": t})),
            });
            let (running, ready, code, waiting) = match (&seen.id, &seen.exit) {
                (None, _) => {
                    v["state"] = json!({"waiting": {"reason": "ContainerCreating"}});
                    (false, false, None, seen.last_terminated.is_none())
                }
                (Some(id), None) => {
                    v["containerID"] = json!(format!("{scheme}://{id}"));
                    v["state"] = json!({"running": {"startedAt": seen.started}});
                    (true, ready_flag, None, false)
                }
                (Some(id), Some(exit)) => {
                    v["containerID"] = json!(format!("{scheme}://{id}"));
                    let term = json!({
                        "exitCode": exit.code,
                        "reason": reason(exit),
                        "startedAt": seen.started,
                        "finishedAt": exit.finished,
                        "containerID": format!("{scheme}://{id}"),
                    });
                    if seen.restart_pending {
                        v["state"] = json!({"waiting": {"reason": "CrashLoopBackOff",
                            "message": format!("back-off restarting failed container {} in pod {}", k.spec.name, kpod.sim.name())}});
                        v["lastState"] = json!({"terminated": term});
                    } else {
                        v["state"] = json!({"terminated": term});
                    }
                    (false, false, Some(exit.code), false)
                }
            };
            // `started`: running and past its startupProbe (the kubelet's startup manager).
            let started = running
                && k.current
                    .as_ref()
                    .is_some_and(|c| Some(&c.c.id) == seen.id.as_ref() && c.started_ok.load(Ordering::SeqCst));
            v["ready"] = json!(ready);
            v["started"] = json!(started);
            // For native sidecars, `waiting` is "pending" in the kubelet's `getPhase`: not seen yet
            // (and never terminated), or running but not started.
            let waiting = match k.spec.kind {
                ContainerKind::NativeSidecar => waiting || (running && !started),
                _ => waiting,
            };
            statuses.push((k.spec.kind, v, running, ready, code, waiting));
        }
        let any_regular_seen = kpod
            .seen
            .iter()
            .zip(kpod.containers.iter())
            .any(|(s, k)| k.spec.kind == ContainerKind::Main && s.id.is_some());
        // `GeneratePodInitializedCondition`: regular init containers succeeded, and the native
        // sidecars started (or a regular container has started already).
        let init_done = statuses.iter().all(|(kind, v, _, _, code, _)| match kind {
            ContainerKind::Init => *code == Some(0),
            ContainerKind::NativeSidecar => any_regular_seen || v["started"] == true,
            ContainerKind::Main => true,
        });
        let policy = kpod.spec.json.restart_policy.as_str();
        let main: Vec<_> = statuses.iter().filter(|s| s.0 == ContainerKind::Main).collect();
        // `getPhase`: a failed container the kubelet will restart keeps the pod Running.
        let restarting = kpod.containers.iter().zip(kpod.seen.iter()).any(|(k, seen)| {
            k.spec.kind == ContainerKind::Main
                && seen.exit.as_ref().is_some_and(|e| k.spec.should_restart(policy, e.code))
        });
        let waiting = main.iter().filter(|s| s.5).count();
        // `getPhase`: a running native sidecar keeps the pod Running; a pending one keeps it
        // Pending; a terminated one does not count (its exit code never fails the pod).
        let native_pending = statuses.iter().filter(|s| s.0 == ContainerKind::NativeSidecar && s.5).count();
        let running = statuses.iter().filter(|s| s.0 != ContainerKind::Init && s.2).count();
        let init_failed =
            statuses.iter().any(|s| s.0 == ContainerKind::Init && s.4.is_some_and(|c| c != 0) && policy == "Never");
        let phase = if init_failed {
            "Failed"
        } else if !init_done || waiting > 0 || native_pending > 0 {
            "Pending"
        } else if running > 0 {
            "Running"
        } else if main.iter().all(|s| s.4 == Some(0)) {
            "Succeeded"
        } else if !restarting {
            "Failed"
        } else {
            "Running"
        };
        let all_ready = !main.is_empty() && main.iter().all(|s| s.3);
        let terminal = matches!(phase, "Succeeded" | "Failed");
        let b = |x: bool| if x { "True" } else { "False" };
        let mut conditions = vec![
            ("PodReadyToStartContainers", b(kpod.seen_sandbox && !terminal), None),
            ("Initialized", b(init_done), None),
            ("Ready", b(all_ready), (terminal).then_some("PodCompleted")),
            ("ContainersReady", b(all_ready), (terminal).then_some("PodCompleted")),
            ("PodScheduled", "True", None),
        ];
        if !all_ready && !terminal {
            conditions[2].2 = Some("ContainersNotReady");
            conditions[3].2 = Some("ContainersNotReady");
        }
        let conditions: Vec<Value> = conditions
            .into_iter()
            .map(|(t, s, r)| {
                let mut c = json!({"type": t, "status": s});
                if let Some(r) = r {
                    c["reason"] = json!(r);
                }
                c
            })
            .collect();
        let mut status = json!({
            "phase": phase,
            "conditions": conditions,
            "containerStatuses": statuses.iter().filter(|s| s.0 == ContainerKind::Main).map(|s| s.1.clone()).collect::<Vec<_>>(),
        });
        let init: Vec<Value> = statuses.iter().filter(|s| s.0 != ContainerKind::Main).map(|s| s.1.clone()).collect();
        if !init.is_empty() {
            status["initContainerStatuses"] = json!(init);
        }
        if kpod.seen_sandbox
            && kpod.spec.report_pod_ip
            && let Some(ip) = kpod.sim.pod_ip()
        {
            status["podIP"] = json!(ip.to_string());
            status["podIPs"] = json!([{"ip": ip.to_string()}]);
        }
        status
    }

    /// Writes the status to the API if it changed (the kubelet's conditions merged by type,
    /// other writers' conditions kept).
    fn write(&self, kpod: &mut KPod) -> Result<()> {
        let status = self.status_json(kpod);
        if kpod.last_written.as_ref() == Some(&status) {
            return Ok(());
        }
        let (ns, name) = (kpod.sim.namespace().to_string(), kpod.sim.name().to_string());
        let now = util::now_rfc3339();
        let fresh = status.clone();
        self.api.modify_pod(&ns, &name, move |pod| {
            let old = pod["status"].clone();
            let st = &mut pod["status"];
            if !st.is_object() {
                *st = json!({});
            }
            for key in ["phase", "containerStatuses", "initContainerStatuses", "podIP", "podIPs"] {
                match fresh.get(key) {
                    Some(v) => st[key] = v.clone(),
                    None => {
                        if let Some(o) = st.as_object_mut() {
                            o.remove(key);
                        }
                    }
                }
            }
            let mut conds: Vec<Value> = old["conditions"].as_array().cloned().unwrap_or_default();
            for c in fresh["conditions"].as_array().into_iter().flatten() {
                let mut c = c.clone();
                match conds.iter_mut().find(|o| o["type"] == c["type"]) {
                    Some(o) => {
                        c["lastProbeTime"] = Value::Null;
                        c["lastTransitionTime"] =
                            if o["status"] == c["status"] { o["lastTransitionTime"].clone() } else { json!(now) };
                        *o = c;
                    }
                    None => {
                        c["lastProbeTime"] = Value::Null;
                        c["lastTransitionTime"] = json!(now);
                        conds.push(c);
                    }
                }
            }
            st["conditions"] = json!(conds);
        })?;
        kpod.last_written = Some(status);
        Ok(())
    }

    fn tick(&self, now: Instant, relist: bool) {
        let held = lock(&self.writes_held_until).is_some_and(|until| now < until);
        let mut pods = lock(&self.pods);
        for kpod in pods.values_mut() {
            self.step(kpod, now);
            let timing = kpod.spec.status;
            let probe_changed = kpod.dirty.swap(false, Ordering::SeqCst);
            match timing {
                StatusTiming::Relist => {
                    if relist || (self.opts.evented_pleg && kpod.recorded_now) {
                        self.relist(kpod, now);
                        self.sync(kpod, now);
                        kpod.pending_write = Some(now + uniform(self.opts.status_sync_delay));
                    } else if probe_changed && kpod.pending_write.is_none() {
                        kpod.pending_write = Some(now + uniform(self.opts.status_sync_delay));
                    }
                }
                StatusTiming::AtOnce => {
                    if relist || kpod.changed {
                        self.relist(kpod, now);
                        self.sync(kpod, now);
                        kpod.pending_write = Some(now);
                    } else if probe_changed {
                        kpod.pending_write = Some(now);
                    }
                }
                StatusTiming::Manual => {
                    if relist || (self.opts.evented_pleg && kpod.recorded_now) {
                        // The kubelet still sees its containers (probes start); it writes nothing.
                        self.relist(kpod, now);
                        self.sync(kpod, now);
                    }
                }
            }
            if probe_changed {
                // A startup probe's result syncs the pod at once (the prober's update channel).
                self.sync(kpod, now);
            }
            kpod.changed = false;
            if !held && kpod.pending_write.is_some_and(|t| now >= t) {
                kpod.pending_write = None;
                // A pod object not posted yet (or deleted) gets the next relist's status.
                let _ = self.write(kpod);
            }
        }
    }

    fn teardown(&self, mut kpod: KPod) {
        let mut all: Vec<Instance> = kpod.sandbox.take().into_iter().collect();
        for k in kpod.containers.iter_mut() {
            all.extend(k.current.take());
            all.append(&mut k.old);
        }
        for inst in &all {
            let _ = inst.proc_.kill();
            if let Some(dir) = self.bundle_dir(&kpod, &inst.c.id) {
                let _ = std::fs::remove_dir_all(dir);
            }
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

/// Whether the last relist saw every regular container done for good: exited, and not to be
/// restarted (restartPolicy Never, or OnFailure after exit 0; never with Always). The kubelet
/// then kills the pod (`computePodActions`: no container to keep or start).
fn regular_done(kpod: &KPod) -> bool {
    let policy = kpod.spec.json.restart_policy.as_str();
    let mut regular = kpod.containers.iter().zip(kpod.seen.iter()).filter(|(k, _)| k.spec.kind == ContainerKind::Main);
    kpod.containers.iter().any(|k| k.spec.kind == ContainerKind::Main)
        && regular.all(|(k, seen)| {
            seen.exit.as_ref().is_some_and(|e| !k.spec.should_restart(policy, e.code))
                && k.current.as_ref().is_some_and(|c| Some(&c.c.id) == seen.id.as_ref())
        })
}

fn reason(exit: &Exit) -> &'static str {
    match (exit.code, exit.signal) {
        (0, _) => "Completed",
        _ => "Error",
    }
}

fn terminated_json(inst: &Instance, exit: &Exit, scheme: &str) -> Value {
    json!({
        "exitCode": exit.code,
        "reason": reason(exit),
        "startedAt": inst.started,
        "finishedAt": exit.finished,
        "containerID": format!("{scheme}://{}", inst.c.id),
    })
}

/// The kubelet's prober: waits until the kubelet saw the container running, honours the initial
/// delay, then probes every period; ready after one success, not ready after
/// `failure_threshold` failures in a row. A startup probe (`once`) stops at its first success.
/// (A startup probe's `failure_threshold` failures, which make the kubelet restart the
/// container, are not modelled: it keeps probing.)
#[allow(clippy::too_many_arguments, reason = "the probe and the container's shared state, each its own")]
fn probe_loop(
    probe: HttpProbe,
    ip: Option<Ipv4Addr>,
    started: Instant,
    seen: Arc<AtomicBool>,
    ready: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    dirty: Arc<AtomicBool>,
    once: bool,
) {
    let sleep_until = |t: Instant| {
        while Instant::now() < t {
            if stop.load(Ordering::SeqCst) {
                return false;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        !stop.load(Ordering::SeqCst)
    };
    while !seen.load(Ordering::SeqCst) {
        if !sleep_until(Instant::now() + Duration::from_millis(5)) {
            return;
        }
    }
    if !sleep_until(started + probe.initial_delay) {
        return;
    }
    let mut failures = 0;
    loop {
        let t = Instant::now();
        let ok = ip.is_some_and(|ip| http_probe(SocketAddr::from((ip, probe.port)), &probe.path, probe.timeout));
        if stop.load(Ordering::SeqCst) {
            return;
        }
        if ok {
            failures = 0;
            if !ready.swap(true, Ordering::SeqCst) {
                dirty.store(true, Ordering::SeqCst);
            }
            if once {
                return;
            }
        } else if !once {
            failures += 1;
            if failures >= probe.failure_threshold && ready.swap(false, Ordering::SeqCst) {
                dirty.store(true, Ordering::SeqCst);
            }
        }
        if !sleep_until(t + probe.period) {
            return;
        }
    }
}

/// One HTTP GET as the kubelet's prober makes it: success on 200–399; only the status line is
/// read (an endless answer cannot hold the prober).
fn http_probe(addr: SocketAddr, path: &str, timeout: Duration) -> bool {
    use std::io::{Read as _, Write as _};
    let deadline = Instant::now() + timeout;
    let Ok(mut s) = std::net::TcpStream::connect_timeout(&addr, timeout) else { return false };
    let _ = s.set_read_timeout(Some(timeout));
    let _ = s.set_write_timeout(Some(timeout));
    let req =
        format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nUser-Agent: kube-probe/1.33\r\nConnection: close\r\n\r\n");
    if s.write_all(req.as_bytes()).is_err() {
        return false;
    }
    let mut buf = Vec::with_capacity(256);
    let mut chunk = [0u8; 256];
    while !buf.windows(2).any(|w| w == b"\r\n") && buf.len() < 4096 && Instant::now() < deadline {
        match s.read(&mut chunk) {
            Ok(0) | Err(_) => break,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
    let line = String::from_utf8_lossy(&buf);
    let code: u16 = line.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (200..400).contains(&code)
}

/// The pod object as the API shows it before the kubelet synced anything: Pending, containers
/// waiting, no ids, no pod IP; readinessProbes and init containers in the spec.
fn initial_pod(sim: &SimPod, spec: &KubeletPod) -> Value {
    let mut json_opts = spec.json.clone();
    json_opts.container_ids = false;
    for c in &spec.containers {
        match c.kind {
            ContainerKind::NativeSidecar if !json_opts.native_sidecars.contains(&c.name) => {
                json_opts.native_sidecars.push(c.name.clone())
            }
            ContainerKind::Init if !json_opts.init_containers.contains(&c.name) => {
                json_opts.init_containers.push(c.name.clone())
            }
            _ => {}
        }
    }
    let mut pod = sim.pod_json(&json_opts);
    // A container of the node's pod that the spec does not list (an ephemeral one, as `kubectl
    // debug` adds, started by the test) is not in the object.
    let listed = |c: &Value| spec.containers.iter().any(|s| c["name"].as_str() == Some(s.name.as_str()));
    for (part, list) in [("spec", "containers"), ("spec", "initContainers"), ("status", "containerStatuses")] {
        if let Some(items) = pod[part][list].as_array_mut() {
            items.retain(listed);
        }
    }
    for list in ["containers", "initContainers"] {
        for c in pod["spec"][list].as_array_mut().into_iter().flatten() {
            let name = c["name"].as_str().unwrap_or_default().to_string();
            let Some(cs) = spec.containers.iter().find(|s| s.name == name) else { continue };
            if let Some(probe) = &cs.readiness {
                c["readinessProbe"] = probe.json();
            }
            if let Some(probe) = &cs.startup {
                c["startupProbe"] = probe.json();
            }
            if let Some(cmd) = &cs.pre_stop {
                c["lifecycle"] = json!({"preStop": {"exec": {"command": cmd}}});
            }
            if let Some(policy) = &cs.restart_policy {
                c["restartPolicy"] = json!(policy);
            }
            if !cs.restart_rules.is_empty() {
                let rules: Vec<Value> = cs
                    .restart_rules
                    .iter()
                    .map(|(action, operator, values)| {
                        json!({"action": action, "exitCodes": {"operator": operator, "values": values}})
                    })
                    .collect();
                c["restartPolicyRules"] = json!(rules);
            }
        }
    }
    pod["spec"]["terminationGracePeriodSeconds"] = json!(spec.grace_period.as_secs());
    let waiting = |c: &Value| {
        json!({"name": c["name"], "image": c["image"], "imageID": "", "ready": false, "started": false,
               "restartCount": 0, "state": {"waiting": {"reason": "ContainerCreating"}}, "lastState": {}})
    };
    let st = &mut pod["status"];
    st["phase"] = json!("Pending");
    if let Some(o) = st.as_object_mut() {
        o.remove("podIP");
        o.remove("podIPs");
    }
    let now = util::now_rfc3339();
    let cond = |t: &str, s: &str| json!({"type": t, "status": s, "lastProbeTime": null, "lastTransitionTime": now});
    let has_init = spec.containers.iter().any(|c| c.kind != ContainerKind::Main);
    st["conditions"] = json!([
        cond("PodReadyToStartContainers", "False"),
        cond("Initialized", if has_init { "False" } else { "True" }),
        cond("Ready", "False"),
        cond("ContainersReady", "False"),
        cond("PodScheduled", "True"),
    ]);
    let main: Vec<Value> = pod["spec"]["containers"].as_array().into_iter().flatten().map(waiting).collect();
    let init: Vec<Value> = pod["spec"]["initContainers"].as_array().into_iter().flatten().map(waiting).collect();
    pod["status"]["containerStatuses"] = json!(main);
    if !init.is_empty() {
        pod["status"]["initContainerStatuses"] = json!(init);
    }
    pod
}

/// Writes a container's OCI bundle as the runtime does before it starts the process:
/// containerd `<dir>/config.json`, CRI-O `<dir>/userdata/config.json`, with the CRI annotations.
pub fn write_bundle(dir: &Path, sim: &SimPod, c: &SimContainer, sandbox: bool) -> Result<()> {
    let (path, annotations) = match sim.runtime() {
        Runtime::Crio => (
            dir.join("userdata"),
            json!({
                "io.kubernetes.cri-o.ContainerType": if sandbox { "sandbox" } else { "container" },
                "io.kubernetes.container.name": if sandbox { "POD" } else { c.name.as_str() },
                "io.kubernetes.pod.uid": sim.uid(),
                "io.kubernetes.pod.name": sim.name(),
                "io.kubernetes.pod.namespace": sim.namespace(),
            }),
        ),
        _ => (
            dir.to_path_buf(),
            json!({
                "io.kubernetes.cri.container-type": if sandbox { "sandbox" } else { "container" },
                "io.kubernetes.cri.container-name": if sandbox { "POD" } else { c.name.as_str() },
                "io.kubernetes.cri.sandbox-uid": sim.uid(),
                "io.kubernetes.cri.sandbox-name": sim.name(),
                "io.kubernetes.cri.sandbox-namespace": sim.namespace(),
            }),
        ),
    };
    std::fs::create_dir_all(&path).with_context(|| format!("mkdir {}", path.display()))?;
    let config = json!({"ociVersion": "1.1.0", "annotations": annotations});
    let file = path.join("config.json");
    std::fs::write(&file, serde_json::to_vec(&config)?).with_context(|| format!("write {}", file.display()))
}

/// A `pause` program for sandboxes: `sleep` under the pause image's name, made once per host.
/// Tests of one process make it at once on a fresh machine: each copy has a name of its own
/// and the renames replace one another whole.
fn pause_binary() -> Result<PathBuf> {
    pause_binary_in(&std::env::temp_dir().join("valet-sim-bin"))
}

fn pause_binary_in(dir: &Path) -> Result<PathBuf> {
    static COPIES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let path = dir.join("pause");
    if !path.exists() {
        std::fs::create_dir_all(dir).with_context(|| format!("mkdir {}", dir.display()))?;
        let n = COPIES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tmp = dir.join(format!("pause.{}.{n}", std::process::id()));
        std::fs::copy("/bin/sleep", &tmp).with_context(|| format!("copy /bin/sleep to {}", tmp.display()))?;
        std::fs::rename(&tmp, &path).with_context(|| format!("rename {} to {}", tmp.display(), path.display()))?;
    }
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    // On a fresh machine the first pods of several tests in one process make the pause program
    // at the same moment: every one of them gets it.
    #[test]
    fn the_pause_program_is_made_once_by_many_at_once() {
        let dir = std::env::temp_dir().join(format!("valet-sim-pause-{}", crate::util::random_hex(4)));
        let start = std::sync::Arc::new(std::sync::Barrier::new(8));
        let makers: Vec<_> = (0..8)
            .map(|_| {
                let (dir, start) = (dir.clone(), start.clone());
                std::thread::spawn(move || {
                    start.wait();
                    pause_binary_in(&dir).map_err(|e| format!("{e:#}"))
                })
            })
            .collect();
        let made: Vec<_> = makers.into_iter().map(|t| t.join().expect("thread")).collect();
        let _ = std::fs::remove_dir_all(&dir);
        for m in made {
            assert_eq!(m, Ok(dir.join("pause")));
        }
    }
}
