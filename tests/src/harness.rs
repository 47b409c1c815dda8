//! A simulated node with the real agent binary running against it: the fake API server, the
//! agent process (as a DaemonSet would run it) and helpers to build Job-like pods whose sidecar
//! is a stand-in proxy. Used by the end-to-end tests, the demo and the benchmarks.

use std::io::Read as _;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use serde_json::Value;
use valet_sim::node::{
    CgroupDriver, PodJsonOptions, QosClass, Runtime, SimPod, SimPodOptions, SimProcess, SpawnOptions,
};
use valet_sim::standin::{ProxyKind, StandinOptions};
use valet_sim::{FakeApiServer, ServerOptions};

/// The workspace's target directory.
fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"))
}

/// The agent binary: `$VALET_AGENT_BIN`, else the release build.
pub fn agent_binary() -> Result<PathBuf> {
    let path = std::env::var_os("VALET_AGENT_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| target_dir().join("release/valet-agent"));
    if !path.is_file() {
        bail!("{} missing: run `cargo build --release -p valet-agent` (cargo xtask test does)", path.display());
    }
    Ok(path)
}

/// Points valet-sim at the stand-in proxy binary built next to the agent.
pub fn locate_standin() {
    if std::env::var_os("VALET_STANDIN_PROXY").is_some() {
        return;
    }
    for profile in ["release", "debug"] {
        let p = target_dir().join(profile).join("valet-standin-proxy");
        if p.is_file() {
            valet_sim::standin::set_binary_path(p);
            return;
        }
    }
}

fn free_port() -> Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// A scratch directory removed on drop.
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(tag: &str) -> Result<Scratch> {
        let dir =
            std::env::temp_dir().join(format!("valet-{tag}-{}-{}", std::process::id(), valet_sim::util::random_hex(4)));
        std::fs::create_dir_all(&dir)?;
        Ok(Scratch(dir))
    }
    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A simulated node: an API server and a node name.
pub struct Node {
    pub api: FakeApiServer,
    pub name: String,
    pub scratch: Scratch,
    kubeconfig: PathBuf,
}

impl Node {
    pub fn new() -> Result<Node> {
        crate::cgroups::require_root();
        locate_standin();
        let api = FakeApiServer::start_with(ServerOptions {
            bookmark_interval: Duration::from_millis(500),
            ..ServerOptions::default()
        })?;
        let scratch = Scratch::new("node")?;
        let kubeconfig = scratch.path("kubeconfig");
        api.write_kubeconfig(&kubeconfig)?;
        let name = format!("node-{}", valet_sim::util::random_hex(3));
        Ok(Node { api, name, scratch, kubeconfig })
    }

    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// Starts the agent binary for this node, with `extra` flags.
    pub fn start_agent(&self, extra: &[&str]) -> Result<Agent> {
        let mut agent = self.spawn_agent(extra)?;
        agent.wait_ready(Duration::from_secs(20))?;
        Ok(agent)
    }

    /// Starts the agent binary for this node, with `extra` flags, without waiting for `/readyz`.
    pub fn spawn_agent(&self, extra: &[&str]) -> Result<Agent> {
        self.spawn_agent_under(&[], extra)
    }

    /// Like [`Node::spawn_agent`], through a wrapper command (`wrapper` then the agent binary and
    /// its arguments), e.g. `setpriv` to run it with a given capability set.
    pub fn spawn_agent_under(&self, wrapper: &[String], extra: &[&str]) -> Result<Agent> {
        let port = free_port()?;
        let metrics: SocketAddr = format!("127.0.0.1:{port}").parse()?;
        let log = self.scratch.path(&format!("agent-{port}.log"));
        let log_file = std::fs::File::create(&log)?;
        let mut command = match wrapper.split_first() {
            Some((program, args)) => {
                let mut c = Command::new(program);
                c.args(args).arg(agent_binary()?);
                c
            }
            None => Command::new(agent_binary()?),
        };
        let child = command
            .args(["--metrics-addr", &metrics.to_string()])
            .args(extra)
            .env("NODE_NAME", &self.name)
            .env("KUBECONFIG", &self.kubeconfig)
            .env("RUST_LOG", std::env::var("VALET_TEST_LOG").unwrap_or_else(|_| "info,kube=warn".into()))
            .env_remove("KUBERNETES_SERVICE_HOST")
            .stdout(Stdio::from(log_file.try_clone()?))
            .stderr(Stdio::from(log_file))
            .spawn()
            .context("start valet-agent")?;
        Ok(Agent { child: Some(child), metrics, log })
    }

    /// Builds an Istio-injected Job pod on this node: real cgroups, a netns with a pod IP, a
    /// pause process and a running stand-in pilot-agent; the pod object is posted to the API.
    pub fn job_pod(&self, spec: JobSpec) -> Result<JobPod> {
        self.build_job_pod(spec, None)
    }

    /// Like [`Node::job_pod`], but the pod object is posted to the API first (`spec.post` is
    /// ignored) and the stand-in proxy is started only after `before_proxy` returned, so a test
    /// can wait until the agent knows the pod before the sidecar's first exec.
    pub fn job_pod_proxy_later(&self, spec: JobSpec, before_proxy: impl FnOnce() -> Result<()>) -> Result<JobPod> {
        let mut hook = Some(before_proxy);
        let mut call = || hook.take().map_or(Ok(()), |f| f());
        self.build_job_pod(spec, Some(&mut call))
    }

    fn build_job_pod(&self, spec: JobSpec, before_proxy: Option<&mut dyn FnMut() -> Result<()>>) -> Result<JobPod> {
        let name = format!("{}-{}", spec.name, valet_sim::util::random_hex(3));
        let mut opts =
            SimPodOptions::new(&name).namespace("jobs").driver(spec.driver).runtime(spec.runtime).qos(spec.qos);
        for app in &spec.apps {
            opts = opts.container(app);
        }
        opts = opts.container("istio-proxy");
        let sim = SimPod::create(opts)?;
        if let Some(dir) = &spec.bundles_dir {
            write_bundles(&sim, &name, dir)?;
        }
        let pause = sim.spawn_pause()?;
        let events = self.scratch.path(&format!("{name}.proxy-events"));
        let mut standin = StandinOptions::new(ProxyKind::Istio);
        standin.events = Some(events.clone());
        standin.ready_file = spec.ready_file.clone();
        standin.hang = spec.proxy_hangs;
        standin.quit_ignored = spec.proxy_ignores_quit;
        standin.flood = spec.proxy_floods;
        let start_proxy = || -> Result<SimProcess> {
            let proxy = sim.spawn_standin("istio-proxy", &standin, &SpawnOptions::default())?;
            if spec.ready_file.is_none() {
                sim.wait_standin_ready(&standin, Duration::from_secs(5))?;
            }
            Ok(proxy)
        };
        let early_proxy = if before_proxy.is_none() { Some(start_proxy()?) } else { None };
        let mut json_opts = PodJsonOptions::node(spec.node.as_deref().unwrap_or(&self.name))
            .restart_policy(&spec.restart_policy)
            .job(&spec.name);
        if spec.labelled {
            json_opts = json_opts.label("valet.dev/enabled", "true");
        }
        for (k, v) in &spec.annotations {
            json_opts = json_opts.annotation(k, v);
        }
        let mut pod = sim.pod_json(&json_opts);
        if spec.ready_file.is_some() {
            // The kubelet reports a proxy that is not ready yet as such.
            for status in pod["status"]["containerStatuses"].as_array_mut().into_iter().flatten() {
                if status["name"] == "istio-proxy" {
                    status["ready"] = Value::Bool(false);
                }
            }
        }
        for app in &spec.already_exited {
            valet_sim::node::mark_container_terminated(&mut pod, app, 0)?;
        }
        let mut posted = pod.clone();
        if !spec.container_ids {
            for status in posted["status"]["containerStatuses"].as_array_mut().into_iter().flatten() {
                if let Some(o) = status.as_object_mut() {
                    o.remove("containerID");
                }
            }
        }
        if spec.post || before_proxy.is_some() {
            self.api.create_pod(posted)?;
        }
        let proxy = match (early_proxy, before_proxy) {
            (Some(p), _) => p,
            (None, Some(hook)) => {
                hook()?;
                start_proxy()?
            }
            (None, None) => bail!("no proxy started"),
        };
        Ok(JobPod { sim, pause, proxy, apps: Vec::new(), events, json: pod, name })
    }

    pub fn pod(&self, job: &JobPod) -> Option<Value> {
        self.api.get_pod("jobs", &job.name)
    }

    /// Events the agent posted about a pod (both API groups), as the API stores them.
    pub fn events_about(&self, job: &JobPod) -> Vec<Value> {
        self.api
            .events()
            .into_iter()
            .filter(|e| {
                let regarding = e.get("regarding").or_else(|| e.get("involvedObject"));
                regarding.and_then(|r| r.get("name")).and_then(Value::as_str) == Some(job.name.as_str())
            })
            .collect()
    }

    /// Events the agent posted about a pod, as (reason, note) pairs.
    pub fn events_for(&self, job: &JobPod) -> Vec<(String, String)> {
        self.events_about(job)
            .into_iter()
            .map(|e| {
                let reason = e["reason"].as_str().unwrap_or_default().to_owned();
                let note = e.get("note").or_else(|| e.get("message")).and_then(Value::as_str).unwrap_or_default();
                (reason, note.to_owned())
            })
            .collect()
    }
}

/// What [`Node::job_pod`] builds.
#[derive(Clone, Debug)]
pub struct JobSpec {
    pub name: String,
    pub apps: Vec<String>,
    pub restart_policy: String,
    pub labelled: bool,
    pub node: Option<String>,
    pub annotations: Vec<(String, String)>,
    /// Apps the pod object already shows as terminated (exit 0).
    pub already_exited: Vec<String>,
    /// The stand-in is ready only while this file exists.
    pub ready_file: Option<PathBuf>,
    pub proxy_hangs: bool,
    pub proxy_ignores_quit: bool,
    /// The stand-in answers every request with an endless body (set `ready_file` too: the
    /// readiness wait cannot read such an answer).
    pub proxy_floods: bool,
    /// Post the pod object to the API now.
    pub post: bool,
    /// The kubelet's cgroup driver (default systemd).
    pub driver: CgroupDriver,
    /// The container runtime (default containerd).
    pub runtime: Runtime,
    /// The pod's QoS class (default Burstable).
    pub qos: QosClass,
    /// Whether the posted pod shows container ids (false: the kubelet has not synced yet).
    pub container_ids: bool,
    /// Write the runtime's OCI bundles for the pod's containers here when creating them.
    pub bundles_dir: Option<PathBuf>,
}

impl JobSpec {
    pub fn new(name: &str) -> JobSpec {
        JobSpec {
            name: name.into(),
            apps: vec!["app".into()],
            restart_policy: "Never".into(),
            labelled: true,
            node: None,
            annotations: Vec::new(),
            already_exited: Vec::new(),
            ready_file: None,
            proxy_hangs: false,
            proxy_ignores_quit: false,
            proxy_floods: false,
            post: true,
            driver: CgroupDriver::Systemd,
            runtime: Runtime::Containerd,
            qos: QosClass::Burstable,
            container_ids: true,
            bundles_dir: None,
        }
    }
    /// Cgroup driver, runtime and QoS class of the simulated pod.
    pub fn cgroup_layout(mut self, driver: CgroupDriver, runtime: Runtime, qos: QosClass) -> Self {
        self.driver = driver;
        self.runtime = runtime;
        self.qos = qos;
        self
    }
    pub fn apps(mut self, apps: &[&str]) -> Self {
        self.apps = apps.iter().map(|s| s.to_string()).collect();
        self
    }
    pub fn restart_policy(mut self, p: &str) -> Self {
        self.restart_policy = p.into();
        self
    }
    pub fn annotation(mut self, k: &str, v: &str) -> Self {
        self.annotations.push((k.into(), v.into()));
        self
    }
}

/// A Job pod on the simulated node.
pub struct JobPod {
    pub sim: SimPod,
    pub pause: SimProcess,
    pub proxy: SimProcess,
    pub apps: Vec<SimProcess>,
    /// The stand-in's request log.
    pub events: PathBuf,
    pub json: Value,
    pub name: String,
}

impl JobPod {
    /// Starts an app container's main process (pid 1 of its own pid namespace).
    pub fn run_app(&mut self, container: &str, script: &str) -> Result<()> {
        let p = self.sim.spawn(container, &["/bin/sh", "-c", script], &SpawnOptions::default())?;
        self.apps.push(p);
        Ok(())
    }

    /// Quit requests the stand-in received (POST /quitquitquit), with their peers.
    pub fn quits(&self) -> Vec<valet_sim::standin::RequestEvent> {
        valet_sim::standin::read_events(&self.events)
            .unwrap_or_default()
            .into_iter()
            .filter(|e| e.method == "POST" && e.path == "/quitquitquit")
            .collect()
    }

    /// Quit requests that came from the pod's own loopback (the ones the proxy accepts).
    pub fn loopback_quits(&self) -> Vec<valet_sim::standin::RequestEvent> {
        self.quits().into_iter().filter(|e| e.peer.ip().is_loopback()).collect()
    }

    /// Waits for the proxy to exit; its exit code (None: still running at the deadline).
    pub fn wait_proxy_exit(&mut self, timeout: Duration) -> Result<Option<i32>> {
        Ok(self.proxy.wait_timeout(timeout)?.map(|s| {
            use std::os::unix::process::ExitStatusExt as _;
            s.code().unwrap_or_else(|| 128 + s.signal().unwrap_or(0))
        }))
    }

    /// Writes the runtime's OCI bundles for this pod (see [`write_bundles`]).
    pub fn write_bundles(&self, dir: &Path) -> Result<()> {
        write_bundles(&self.sim, &self.name, dir)
    }

    /// Marks an app terminated in the API, as the kubelet would a second later.
    pub fn report_terminated(&self, node: &Node, app: &str, code: i32) -> Result<()> {
        node.api.modify_pod("jobs", &self.name, |pod| {
            let _ = valet_sim::node::mark_container_terminated(pod, app, code);
        })?;
        Ok(())
    }
}

/// A running agent process.
pub struct Agent {
    child: Option<Child>,
    pub metrics: SocketAddr,
    pub log: PathBuf,
}

impl Agent {
    fn get(&self, path: &str) -> Result<(u16, String)> {
        let r = valet_sim::client::get(self.metrics, path, Duration::from_secs(2))?;
        Ok((r.status, r.text()))
    }

    pub fn wait_ready(&mut self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(child) = self.child.as_mut()
                && let Some(status) = child.try_wait()?
            {
                bail!("valet-agent exited ({status}) before ready:\n{}", self.log_text());
            }
            if let Ok((200, _)) = self.get("/readyz") {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("valet-agent not ready after {timeout:?}:\n{}", self.log_text());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn metrics_text(&self) -> Result<String> {
        let (status, body) = self.get("/metrics")?;
        if status != 200 {
            bail!("/metrics answered {status}");
        }
        Ok(body)
    }

    /// The value of one sample line (`name{labels}` exactly as exposed), 0 when absent.
    pub fn metric(&self, sample: &str) -> f64 {
        self.metrics_text()
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix(sample).and_then(|rest| rest.trim().split(' ').next()?.parse().ok()))
            .unwrap_or(0.0)
    }

    /// Waits until `pods_tracked` reaches `n` (the agent has seen the pods and their cgroups).
    pub fn wait_tracked(&self, n: usize, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        while self.metric("valet_pods_tracked ") as usize != n {
            if Instant::now() > deadline {
                bail!("agent tracks {} pods, want {n}:\n{}", self.metric("valet_pods_tracked "), self.log_text());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    pub fn log_text(&self) -> String {
        let mut s = String::new();
        if let Ok(mut f) = std::fs::File::open(&self.log) {
            let _ = f.read_to_string(&mut s);
        }
        s
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// Sends a signal and waits for the process to end (up to `timeout`); its exit status.
    pub fn stop(&mut self, signal: i32, timeout: Duration) -> Result<Option<std::process::ExitStatus>> {
        let Some(mut child) = self.child.take() else { return Ok(None) };
        // SAFETY: plain syscall on our own child.
        unsafe { libc::kill(child.id() as i32, signal) };
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(status) = child.try_wait()? {
                return Ok(Some(status));
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                bail!("agent did not stop within {timeout:?}");
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Polls `f` every 10 ms until it returns true or `timeout` passes.
pub fn eventually(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if f() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Writes containerd-style OCI bundles (`<dir>/<id>/config.json` with the kubelet's annotations)
/// for the sandbox and every container of a pod, as the runtime does before it starts them.
pub fn write_bundles(sim: &SimPod, pod_name: &str, dir: &Path) -> Result<()> {
    let uid = sim.uid();
    let mut entries = vec![(sim.sandbox().id.clone(), "sandbox", "POD".to_owned())];
    entries.extend(sim.containers().iter().map(|c| (c.id.clone(), "container", c.name.clone())));
    for (id, kind, name) in entries {
        let bundle = dir.join(&id);
        std::fs::create_dir_all(&bundle)?;
        let config = serde_json::json!({
            "ociVersion": "1.1.0",
            "annotations": {
                "io.kubernetes.cri.container-type": kind,
                "io.kubernetes.cri.container-name": name,
                "io.kubernetes.cri.sandbox-uid": uid,
                "io.kubernetes.cri.sandbox-name": pod_name,
                "io.kubernetes.cri.sandbox-namespace": "jobs",
            }
        });
        std::fs::write(bundle.join("config.json"), serde_json::to_vec(&config)?)?;
    }
    Ok(())
}
