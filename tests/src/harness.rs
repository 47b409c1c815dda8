//! A simulated node with the real agent binary running against it: the fake API server, the
//! agent process (as a DaemonSet would run it) and helpers to build Job-like pods whose sidecar
//! is a stand-in proxy. Used by the end-to-end tests, the demo and the benchmarks.

use std::io::Read as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use serde_json::Value;
use valet_sim::apiserver::Kind;
use valet_sim::kubelet::{ContainerKind, ContainerSpec, HttpProbe, KubeletOptions, KubeletPod, StatusTiming};
use valet_sim::node::{CgroupDriver, PodJsonOptions, QosClass, Runtime, SimPod, SimPodOptions, SpawnOptions};
use valet_sim::standin::{ProxyKind, StandinOptions};
use valet_sim::{ApiHandle, ContainerProcess, FakeApiServer, Kubelet, ServerOptions};

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

/// A scratch directory removed on drop, on a tmpfs like a node's `/run` where the host has one
/// ([`valet_sim::util::state_base`]): the runtime's bundles and the stand-ins' event files live here.
pub struct Scratch(pub PathBuf);

impl Scratch {
    pub fn new(tag: &str) -> Result<Scratch> {
        let name = format!("valet-{tag}-{}-{}", std::process::id(), valet_sim::util::random_hex(4));
        let dir = valet_sim::util::state_base().join(name);
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

/// A simulated node: an API server, a simulated kubelet and container runtime (unhelpful as a
/// real one by default, see [`valet_sim::kubelet`]) and a node name.
pub struct Node {
    pub api: FakeApiServer,
    pub kubelet: Kubelet,
    pub name: String,
    pub scratch: Scratch,
    kubeconfig: PathBuf,
    runtime_dir: PathBuf,
    /// The agents' pin directory on bpffs: this node's own, shared by its successive agents as
    /// a node's is, and by no other test's agent (whose orphan sweep would release this node's
    /// holds).
    pin_dir: PathBuf,
}

impl Drop for Node {
    fn drop(&mut self) {
        if let Ok(entries) = std::fs::read_dir(&self.pin_dir) {
            for e in entries.flatten() {
                let _ = std::fs::remove_file(e.path());
            }
        }
        let _ = std::fs::remove_dir(&self.pin_dir);
    }
}

impl Node {
    /// A node whose kubelet behaves like a real one (see [`KubeletOptions::default`]).
    pub fn new() -> Result<Node> {
        Node::with_kubelet(KubeletOptions::default())
    }

    /// A node with these kubelet settings; the runtime state dir is always the node's own
    /// (`runtime_state_dir` is overwritten).
    pub fn with_kubelet(mut opts: KubeletOptions) -> Result<Node> {
        crate::cgroups::require_root();
        locate_standin();
        let api = FakeApiServer::start_with(ServerOptions {
            bookmark_interval: Duration::from_millis(500),
            // The watch cache of a node's worth of pods: a real server keeps a window of recent
            // changes too (its default cache size is 100). The server runs in this process, and
            // 10,000 full pods made a benchmark's every fork slow (~300 MB to copy).
            history_limit: 1_000,
            ..ServerOptions::default()
        })?;
        let scratch = Scratch::new("node")?;
        let kubeconfig = scratch.path("kubeconfig");
        api.write_kubeconfig(&kubeconfig)?;
        // Laid out like containerd's `<state>/io.containerd.runtime.v2.task/k8s.io`.
        let runtime_dir = scratch.path("run/containerd/io.containerd.runtime.v2.task/k8s.io");
        std::fs::create_dir_all(&runtime_dir)?;
        opts.runtime_state_dir = Some(runtime_dir.clone());
        let kubelet = Kubelet::start(api.kubelet_handle(), opts)?;
        let name = format!("node-{}", valet_sim::util::random_hex(3));
        let pin_dir = PathBuf::from(format!("/sys/fs/bpf/valet-test-{}-{name}", std::process::id()));
        Ok(Node { api, kubelet, name, scratch, kubeconfig, runtime_dir, pin_dir })
    }

    pub fn kubeconfig(&self) -> &Path {
        &self.kubeconfig
    }

    /// Where the simulated runtime writes its OCI bundles (`<dir>/<id>/config.json`).
    pub fn runtime_state_dir(&self) -> &Path {
        &self.runtime_dir
    }

    /// Where this node's agents pin the record of the processes they held.
    pub fn pin_dir(&self) -> &Path {
        &self.pin_dir
    }

    /// Starts the agent binary for this node, with `extra` flags (and `--runtime-state-dirs`
    /// naming the node's runtime state dir unless `extra` has that flag).
    pub fn start_agent(&self, extra: &[&str]) -> Result<Agent> {
        let mut agent = self.spawn_agent(extra)?;
        // A hang guard: loading the programs (BTF, the verifier) takes tens of seconds in an
        // emulated guest (`cargo xtask kernels`) on a busy machine.
        agent.wait_ready(Duration::from_secs(180))?;
        Ok(agent)
    }

    /// Like [`Node::start_agent`] without waiting for `/readyz`.
    pub fn spawn_agent(&self, extra: &[&str]) -> Result<Agent> {
        self.spawn_agent_under(&[], extra)
    }

    /// Like [`Node::spawn_agent`], through a wrapper command (`wrapper` then the agent binary and
    /// its arguments), e.g. `setpriv` to run it with a given capability set.
    pub fn spawn_agent_under(&self, wrapper: &[String], extra: &[&str]) -> Result<Agent> {
        self.spawn_agent_env(wrapper, extra, &[])
    }

    /// Like [`Node::start_agent`], as the container of the DaemonSet's pod `pod` (made by
    /// [`Node::daemonset_pod`]): `POD_NAME` and `POD_NAMESPACE` from the downward API.
    pub fn start_agent_in(&self, pod: &str, extra: &[&str]) -> Result<Agent> {
        let mut agent = self.spawn_agent_env(&[], extra, &pod_env(pod))?;
        agent.wait_ready(Duration::from_secs(180))?;
        Ok(agent)
    }

    /// Like [`Node::start_agent_in`] without waiting for `/readyz`, through `wrapper` (e.g.
    /// `setpriv` with the manifest's capabilities).
    pub fn spawn_agent_in_under(&self, pod: &str, wrapper: &[String], extra: &[&str]) -> Result<Agent> {
        self.spawn_agent_env(wrapper, extra, &pod_env(pod))
    }

    fn spawn_agent_env(&self, wrapper: &[String], extra: &[&str], env: &[(&str, &str)]) -> Result<Agent> {
        // The metrics port is found free, then bound by the agent: a process of a test running
        // beside this one may take it in between. The agent then exits at once, saying so, and
        // is started again on another port.
        for _ in 0..5 {
            let mut agent = self.spawn_agent_once(wrapper, extra, env)?;
            if !agent.lost_its_port() {
                return Ok(agent);
            }
        }
        bail!("five agents in a row found their metrics port taken")
    }

    fn spawn_agent_once(&self, wrapper: &[String], extra: &[&str], env: &[(&str, &str)]) -> Result<Agent> {
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
        command.args(["--metrics-addr", &metrics.to_string()]).args(extra);
        if !extra.iter().any(|a| a.starts_with("--runtime-state-dirs")) {
            command.arg("--runtime-state-dirs").arg(&self.runtime_dir);
        }
        // The end-to-end tests read each quit's Event (off by default: one more write per Job).
        if !extra.iter().any(|a| a.starts_with("--quit-events")) {
            command.arg("--quit-events=true");
        }
        if !extra.iter().any(|a| a.starts_with("--pin-dir")) {
            command.arg("--pin-dir").arg(&self.pin_dir);
        }
        // The hierarchy the simulated kubelet makes its pods in (this host is hybrid: the agent
        // alone would take a v1 controller's, where a real kubelet would make them).
        if !extra.iter().any(|a| a.starts_with("--cgroup-root")) {
            command.arg("--cgroup-root").arg(valet_sim::node::CgroupRoot::detect()?);
        }
        let child = command
            .env("NODE_NAME", &self.name)
            .env("KUBECONFIG", &self.kubeconfig)
            .env("RUST_LOG", std::env::var("VALET_TEST_LOG").unwrap_or_else(|_| "info,kube=warn".into()))
            .env_remove("KUBERNETES_SERVICE_HOST")
            .env_remove("POD_NAME")
            .env_remove("POD_NAMESPACE")
            .envs(env.iter().copied())
            .stdout(Stdio::from(log_file.try_clone()?))
            .stderr(Stdio::from(log_file))
            .spawn()
            .context("start valet-agent")?;
        Ok(Agent { child: Some(child), metrics, log })
    }

    /// Starts `valet-agent deadlines` for this node's pin directory, as the DaemonSet's second
    /// container runs it beside the agent.
    pub fn start_deadline_keeper(&self) -> Result<DeadlineKeeper> {
        self.start_deadline_keeper_with(&[])
    }

    /// Like [`Node::start_deadline_keeper`], with `extra` flags.
    pub fn start_deadline_keeper_with(&self, extra: &[&str]) -> Result<DeadlineKeeper> {
        self.start_deadline_keeper_env(extra, &[])
    }

    /// Like [`Node::start_deadline_keeper`], as the second container of the DaemonSet's pod `pod`.
    pub fn start_deadline_keeper_in(&self, pod: &str) -> Result<DeadlineKeeper> {
        self.start_deadline_keeper_env(&[], &pod_env(pod))
    }

    /// Like [`Node::start_deadline_keeper`], run through `wrapper` (e.g. `setpriv` with other
    /// capabilities), which execs the agent binary given as its last argument.
    pub fn start_deadline_keeper_under(&self, wrapper: &[String]) -> Result<DeadlineKeeper> {
        self.start_deadline_keeper_full(wrapper, &[], &[])
    }

    /// Like [`Node::start_deadline_keeper_in`], through `wrapper`, with `extra` flags.
    pub fn start_deadline_keeper_in_under(
        &self,
        pod: &str,
        wrapper: &[String],
        extra: &[&str],
    ) -> Result<DeadlineKeeper> {
        self.start_deadline_keeper_full(wrapper, extra, &pod_env(pod))
    }

    fn start_deadline_keeper_env(&self, extra: &[&str], env: &[(&str, &str)]) -> Result<DeadlineKeeper> {
        self.start_deadline_keeper_full(&[], extra, env)
    }

    fn start_deadline_keeper_full(
        &self,
        wrapper: &[String],
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Result<DeadlineKeeper> {
        let log = self.scratch.path(&format!("deadlines-{}.log", free_port()?));
        let file = std::fs::File::create(&log)?;
        let mut command = match wrapper.split_first() {
            Some((program, args)) => {
                let mut c = Command::new(program);
                c.args(args).arg(agent_binary()?);
                c
            }
            None => Command::new(agent_binary()?),
        };
        let child = command
            .arg("deadlines")
            .arg("--pin-dir")
            .arg(&self.pin_dir)
            // The hierarchy the simulated kubelet makes its pods in, as for the agent.
            .arg("--cgroup-root")
            .arg(valet_sim::node::CgroupRoot::detect()?)
            .args(extra)
            .env("RUST_LOG", "info")
            .env("NODE_NAME", &self.name)
            .env("KUBECONFIG", &self.kubeconfig)
            .env_remove("KUBERNETES_SERVICE_HOST")
            .env_remove("POD_NAME")
            .env_remove("POD_NAMESPACE")
            .envs(env.iter().copied())
            .stdout(Stdio::from(file.try_clone()?))
            .stderr(Stdio::from(file))
            .spawn()
            .context("start valet-agent deadlines")?;
        Ok(DeadlineKeeper { child: Some(child), log })
    }

    /// Installs valet as `deploy/base` does, as far as the agent reads it: the DaemonSet
    /// `valet-system/valet-agent` (the manifest's scheduling: Linux, amd64 or arm64, every taint
    /// tolerated) and this node, labelled to fit it.
    pub fn install_daemonset(&self) -> Result<()> {
        let arch = if cfg!(target_arch = "aarch64") { "arm64" } else { "amd64" };
        self.api.put_object(
            Kind::Node,
            serde_json::json!({"metadata": {"name": self.name, "labels": {
                "kubernetes.io/os": "linux", "kubernetes.io/arch": arch, "kubernetes.io/hostname": self.name}}}),
        )?;
        self.api.put_object(
            Kind::DaemonSet,
            serde_json::json!({
                "metadata": {"name": AGENT_DAEMONSET, "namespace": AGENT_NAMESPACE},
                "spec": {
                    "selector": {"matchLabels": {"app.kubernetes.io/name": "valet"}},
                    "template": {"metadata": {"labels": {"app.kubernetes.io/name": "valet"}}, "spec": {
                        "containers": [{"name": "valet-agent"}, {"name": "valet-deadlines"}],
                        "nodeSelector": {"kubernetes.io/os": "linux"},
                        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                            "nodeSelectorTerms": [{"matchExpressions": [
                                {"key": "kubernetes.io/arch", "operator": "In", "values": ["amd64", "arm64"]}]}]}}},
                        "tolerations": [{"operator": "Exists"}]
                    }}
                }
            }),
        )?;
        Ok(())
    }

    /// A pod of the agent's DaemonSet on this node, as its controller makes one (its controller
    /// reference names the DaemonSet); its name. No process runs for it: the agent and the
    /// keeper started "in" it get its name.
    pub fn daemonset_pod(&self) -> Result<String> {
        let set = self
            .api
            .get_object(Kind::DaemonSet, Some(AGENT_NAMESPACE), AGENT_DAEMONSET)
            .context("install_daemonset first")?;
        let name = format!("{AGENT_DAEMONSET}-{}", valet_sim::util::random_hex(3));
        self.api.create_pod(serde_json::json!({
            "metadata": {"name": name, "namespace": AGENT_NAMESPACE,
                "labels": {"app.kubernetes.io/name": "valet"},
                "ownerReferences": [{"apiVersion": "apps/v1", "kind": "DaemonSet", "name": AGENT_DAEMONSET,
                    "uid": set["metadata"]["uid"], "controller": true, "blockOwnerDeletion": true}]},
            "spec": {"nodeName": self.name, "containers": [{"name": "valet-agent"}, {"name": "valet-deadlines"}]},
            "status": {"phase": "Running"}
        }))?;
        Ok(name)
    }

    /// Builds an Istio-injected Job pod on this node and hands it to the kubelet: real cgroups, a
    /// netns with a pod IP, the sandbox's pause process, the app containers that have a command
    /// in the spec and the stand-in pilot-agent (`istio-proxy`, last as Istio's injector puts it),
    /// started in spec order. Returns once the stand-in serves (unless `ready_file` is set).
    pub fn job_pod(&self, spec: JobSpec) -> Result<JobPod> {
        self.build_job_pod(spec, None)
    }

    /// Like [`Node::job_pod`], but the stand-in proxy is started only after `before_proxy`
    /// returned, so a test can wait until the agent knows the pod before the sidecar's first exec.
    pub fn job_pod_proxy_later(&self, spec: JobSpec, before_proxy: impl FnOnce() -> Result<()>) -> Result<JobPod> {
        let mut hook = Some(before_proxy);
        let mut call = || hook.take().map_or(Ok(()), |f| f());
        self.build_job_pod(spec, Some(&mut call))
    }

    fn build_job_pod(&self, spec: JobSpec, before_proxy: Option<&mut dyn FnMut() -> Result<()>>) -> Result<JobPod> {
        let name = format!("{}-{}", spec.name, valet_sim::util::random_hex(3));
        let mut opts = SimPodOptions::new(&name)
            .namespace("jobs")
            .driver(spec.driver)
            .runtime(spec.runtime)
            .qos(spec.qos)
            .crun(spec.crun)
            .lazy_cgroups(true);
        if let Some(root) = &spec.cgroup_root {
            opts = opts.cgroup_root(root);
        }
        for app in &spec.apps {
            opts = opts.container(app);
        }
        let proxy_name = spec.sidecar.as_ref().map_or("istio-proxy", |(name, _)| name.as_str());
        opts = opts.container(proxy_name);
        for (name, _) in &spec.natives_after {
            opts = opts.container(name);
        }
        for extra in &spec.extra_containers {
            opts = opts.container(extra);
        }
        let sim = Arc::new(SimPod::create(opts)?);
        let events = self.scratch.path(&format!("{name}.proxy-events"));
        let mut standin = StandinOptions::new(ProxyKind::Istio);
        standin.events = Some(events.clone());
        standin.ready_file = spec.ready_file.clone();
        standin.listen_when_ready = spec.listen_when_ready;
        standin.hang = spec.proxy_hangs;
        standin.quit_ignored = spec.proxy_ignores_quit;
        standin.flood = spec.proxy_floods;
        let proxy_cmd: Vec<String> = match &spec.sidecar {
            Some((_, cmd)) => cmd.clone(),
            None => std::iter::once(valet_sim::standin::binary_path()?.to_string_lossy().into_owned())
                .chain(standin.to_args())
                .collect(),
        };

        let mut json_opts = PodJsonOptions::node(spec.node.as_deref().unwrap_or(&self.name))
            .restart_policy(&spec.restart_policy)
            .share_process_namespace(spec.share_process_namespace)
            .job(&spec.name);
        if spec.labelled {
            json_opts = json_opts.label("valet.dev/enabled", "true");
        }
        for (k, v) in &spec.annotations {
            json_opts = json_opts.annotation(k, v);
        }
        json_opts.runtime_class = spec.runtime_class.clone();
        let mut containers = Vec::new();
        for app in &spec.apps {
            let mut c = ContainerSpec::new(app);
            if let Some((_, script)) = spec.app_commands.iter().find(|(a, _)| a == app) {
                c = c.command(&["/bin/sh", "-c", script]);
            } else if spec.already_exited.contains(app) {
                c = c.command(&["/bin/sh", "-c", "exit 0"]);
            }
            for (_, policy) in spec.app_restart_policies.iter().filter(|(a, _)| a == app) {
                c = c.restart_policy(policy);
            }
            for (_, (action, operator, values)) in spec.app_restart_rules.iter().filter(|(a, _)| a == app) {
                c = c.restart_rule(action, operator, values);
            }
            if let Some((lag, _)) = spec.record_lags {
                c = c.record_lag(lag);
            }
            containers.push(c);
        }
        let mut proxy = ContainerSpec::new(proxy_name);
        if before_proxy.is_none() {
            proxy.command = Some(proxy_cmd.clone());
        }
        proxy.readiness = spec.proxy_probe.clone();
        if let Some((_, lag)) = spec.record_lags {
            proxy = proxy.record_lag(lag);
        }
        if spec.native {
            // An init container with `restartPolicy: Always`, before the apps; the stand-in
            // pilot-agent gets Istio's startupProbe, which holds the apps until it passes.
            proxy = proxy.kind(ContainerKind::NativeSidecar);
            if spec.sidecar.is_none() {
                proxy = proxy.startup(HttpProbe::istio_startup());
            }
            containers.insert(0, proxy);
            for (i, (name, script)) in spec.natives_after.iter().enumerate() {
                let c = ContainerSpec::new(name).command(&["/bin/sh", "-c", script]).kind(ContainerKind::NativeSidecar);
                containers.insert(1 + i, c);
            }
        } else {
            containers.push(proxy);
        }
        let mut kpod = KubeletPod::new(json_opts, containers);
        kpod.status = spec.status;
        kpod.bundles = spec.bundles;
        kpod.report_pod_ip = spec.report_pod_ip;
        kpod.post = spec.post || before_proxy.is_some();
        let json = self.kubelet.add_pod(sim.clone(), kpod)?;
        let removal = PodRemoval { kubelet: self.kubelet.clone(), name: name.clone() };
        let pause = self.kubelet.process("jobs", &name, "POD").context("the sandbox did not start")?;
        if let Some(hook) = before_proxy {
            hook()?;
            let cmd: Vec<&str> = proxy_cmd.iter().map(String::as_str).collect();
            self.kubelet.start_container("jobs", &name, proxy_name, &cmd, &SpawnOptions::default())?;
        }
        let proxy = self.kubelet.process("jobs", &name, proxy_name).context("the proxy did not start")?;
        let mut job = JobPod {
            pause,
            proxy,
            sim,
            apps: Vec::new(),
            events,
            json,
            name,
            kubelet: self.kubelet.clone(),
            api: self.api.handle(),
            _removal: removal,
        };
        for app in &spec.apps {
            if let Some(p) = self.kubelet.process("jobs", &job.name, app) {
                job.apps.push(p);
            }
        }
        if spec.ready_file.is_none() && spec.sidecar.is_none() {
            job.sim.wait_standin_ready(&standin, HANG_GUARD)?;
        }
        for app in &spec.already_exited {
            if job.wait_api_terminated(app, HANG_GUARD).is_none() {
                bail!("the API never showed {app} of {} terminated", job.name);
            }
        }
        Ok(job)
    }

    pub fn pod(&self, job: &JobPod) -> Option<Value> {
        self.api.get_pod("jobs", &job.name)
    }

    /// Whether the pod shows the agent's `valet.dev/ProxyReady` condition True: the agent saw its
    /// proxy ready (and keeps a connection to its quit endpoint).
    pub fn proxy_ready_condition(&self, job: &JobPod) -> bool {
        let pod = self.pod(job).unwrap_or_default();
        pod["status"]["conditions"]
            .as_array()
            .is_some_and(|cs| cs.iter().any(|c| c["type"] == "valet.dev/ProxyReady" && c["status"] == "True"))
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
    /// Commands (`/bin/sh -c` scripts) of apps the kubelet starts itself, in spec order, before
    /// the proxy. Apps without one wait until the test starts them ([`JobPod::run_app`]).
    pub app_commands: Vec<(String, String)>,
    pub restart_policy: String,
    /// `spec.shareProcessNamespace` in the pod's JSON (the test starts its apps in the
    /// sandbox's pid namespace).
    pub share_process_namespace: bool,
    /// Containers of the pod on the node that its spec does not list (as `kubectl debug` adds an
    /// ephemeral one): their cgroups are the pod's, the kubelet starts nothing in them.
    pub extra_containers: Vec<String>,
    pub labelled: bool,
    pub node: Option<String>,
    pub annotations: Vec<(String, String)>,
    /// Apps that ran `exit 0` before [`Node::job_pod`] returns, which waits until the API shows
    /// them terminated.
    pub already_exited: Vec<String>,
    /// The stand-in is ready only while this file exists.
    pub ready_file: Option<PathBuf>,
    /// With `ready_file`: the stand-in binds this port when the file appears, and turns ready
    /// only then (as Envoy binds the listeners its configuration brings).
    pub listen_when_ready: Option<u16>,
    pub proxy_hangs: bool,
    pub proxy_ignores_quit: bool,
    /// The stand-in answers every request with an endless body (set `ready_file` too: the
    /// readiness wait cannot read such an answer).
    pub proxy_floods: bool,
    /// Another sidecar in place of the stand-in istio-proxy: its container name and command (a
    /// real Envoy); the test waits for its readiness itself.
    pub sidecar: Option<(String, Vec<String>)>,
    /// istio-proxy's readinessProbe: Istio's (`:15021/healthz/ready`, every 15 s) by default;
    /// None: no probe, so the kubelet reports it ready as soon as it runs.
    pub proxy_probe: Option<HttpProbe>,
    /// The kubelet posts the pod object at once (false: [`JobPod::post`] does, later).
    pub post: bool,
    /// The kubelet's cgroup driver (default systemd).
    pub driver: CgroupDriver,
    /// The container runtime (default containerd).
    pub runtime: Runtime,
    /// The pod's QoS class (default Burstable).
    pub qos: QosClass,
    /// Container processes run one cgroup below their container's, as crun runs them.
    pub crun: bool,
    /// When the kubelet writes statuses: as a real one (default), at once, or never.
    pub status: StatusTiming,
    /// The runtime writes OCI bundles for the pod's containers (default true).
    pub bundles: bool,
    /// The API shows the pod IP once the kubelet synced (default true; false: never).
    pub report_pod_ip: bool,
    /// The hierarchy the pod's cgroups are made in: None, the cgroup v2 mount; a v1
    /// controller's mount for a cgroup v1 node (start the agent with `--cgroup-root` there).
    pub cgroup_root: Option<PathBuf>,
    /// The proxy is a native sidecar (an init container with `restartPolicy: Always`, KEP-753)
    /// that the kubelet starts before the apps and stops once they have ended.
    pub native: bool,
    /// Apps' own `restartPolicy` (KEP-5307): (app, policy).
    pub app_restart_policies: Vec<(String, String)>,
    /// Apps' `restartPolicyRules`, in order: (app, (action, operator, values)).
    pub app_restart_rules: Vec<(String, valet_sim::kubelet::RestartRule)>,
    /// The runtime records the apps' and the proxy's exits these long after them (None: the
    /// kubelet's [`KubeletOptions::exit_record_lag`]).
    pub record_lags: Option<(Duration, Duration)>,
    /// More native sidecars, declared after the proxy (a native one): (name, `/bin/sh -c` script).
    pub natives_after: Vec<(String, String)>,
    /// `spec.runtimeClassName`.
    pub runtime_class: Option<String>,
}

impl JobSpec {
    pub fn new(name: &str) -> JobSpec {
        JobSpec {
            name: name.into(),
            apps: vec!["app".into()],
            app_commands: Vec::new(),
            restart_policy: "Never".into(),
            labelled: true,
            node: None,
            annotations: Vec::new(),
            already_exited: Vec::new(),
            ready_file: None,
            listen_when_ready: None,
            share_process_namespace: false,
            extra_containers: Vec::new(),
            proxy_hangs: false,
            proxy_ignores_quit: false,
            proxy_floods: false,
            sidecar: None,
            proxy_probe: Some(HttpProbe::istio()),
            post: true,
            driver: CgroupDriver::Systemd,
            runtime: Runtime::Containerd,
            qos: QosClass::Burstable,
            crun: false,
            status: StatusTiming::Relist,
            bundles: true,
            report_pod_ip: true,
            cgroup_root: None,
            native: false,
            app_restart_policies: Vec::new(),
            app_restart_rules: Vec::new(),
            record_lags: None,
            natives_after: Vec::new(),
            runtime_class: None,
        }
    }
    /// The runtime records the apps' exits `app` after them, the proxy's `proxy` after.
    pub fn record_lags(mut self, app: Duration, proxy: Duration) -> Self {
        self.record_lags = Some((app, proxy));
        self
    }
    /// `app`'s own `restartPolicy`, overriding the pod's (KEP-5307).
    pub fn app_restart_policy(mut self, app: &str, policy: &str) -> Self {
        self.app_restart_policies.push((app.into(), policy.into()));
        self
    }
    /// One more of `app`'s `restartPolicyRules` (set its own policy too, as the API requires).
    pub fn app_restart_rule(mut self, app: &str, action: &str, operator: &str, values: &[i32]) -> Self {
        self.app_restart_rules.push((app.into(), (action.into(), operator.into(), values.to_vec())));
        self
    }
    /// The pod's cgroups in this hierarchy's root (a cgroup v1 controller's mount).
    pub fn cgroup_root(mut self, root: impl Into<PathBuf>) -> Self {
        self.cgroup_root = Some(root.into());
        self
    }
    /// One more native sidecar, declared after the proxy (and any added before it), running this
    /// `/bin/sh -c` script; the proxy is made native too.
    pub fn native_after(mut self, name: &str, script: &str) -> Self {
        self.native = true;
        self.natives_after.push((name.into(), script.into()));
        self
    }
    /// The proxy as a native sidecar (see [`JobSpec::native`]).
    pub fn native_sidecar(mut self) -> Self {
        self.native = true;
        self
    }
    /// Cgroup driver, runtime and QoS class of the simulated pod.
    pub fn cgroup_layout(mut self, driver: CgroupDriver, runtime: Runtime, qos: QosClass) -> Self {
        self.driver = driver;
        self.runtime = runtime;
        self.qos = qos;
        self
    }
    /// crun's layout: every container's processes in `<scope>/container`.
    pub fn crun(mut self) -> Self {
        self.crun = true;
        self
    }
    pub fn apps(mut self, apps: &[&str]) -> Self {
        self.apps = apps.iter().map(|s| s.to_string()).collect();
        self
    }
    /// The kubelet starts `app` with this `/bin/sh -c` script, in spec order before the proxy.
    pub fn app_command(mut self, app: &str, script: &str) -> Self {
        self.app_commands.push((app.into(), script.into()));
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
    /// The pod's `spec.runtimeClassName`.
    pub fn runtime_class(mut self, class: &str) -> Self {
        self.runtime_class = Some(class.into());
        self
    }
    /// A kinder kubelet than any real one: statuses (ids, running, terminated) are written the
    /// moment containers start and exit, not on the next 1 s relist.
    pub fn kind_kubelet(mut self) -> Self {
        self.status = StatusTiming::AtOnce;
        self
    }
    /// The kubelet posts the pod once (Pending, no ids) and never writes its status: the test
    /// does ([`JobPod::publish_status`], [`JobPod::report_terminated`], the API directly).
    pub fn manual_status(mut self) -> Self {
        self.status = StatusTiming::Manual;
        self
    }
    /// No OCI bundles for this pod's containers.
    pub fn no_bundles(mut self) -> Self {
        self.bundles = false;
        self
    }
    /// istio-proxy's readinessProbe period (Istio: 15 s).
    pub fn readiness_period(mut self, period: Duration) -> Self {
        self.proxy_probe = Some(self.proxy_probe.unwrap_or_else(HttpProbe::istio).period(period));
        self
    }
    /// istio-proxy without a readinessProbe: the kubelet says ready as soon as it runs.
    pub fn without_readiness_probe(mut self) -> Self {
        self.proxy_probe = None;
        self
    }
}

/// A Job pod on the simulated node, run by the node's kubelet; dropping it removes it from the
/// kubelet (its processes are killed, its cgroups removed).
pub struct JobPod {
    pub sim: Arc<SimPod>,
    pub pause: ContainerProcess,
    /// The proxy's first instance.
    pub proxy: ContainerProcess,
    /// App main processes, in the order they started.
    pub apps: Vec<ContainerProcess>,
    /// The stand-in's request log.
    pub events: PathBuf,
    /// The pod object the kubelet posted (or would have, without `post`).
    pub json: Value,
    pub name: String,
    kubelet: Kubelet,
    api: ApiHandle,
    _removal: PodRemoval,
}

/// Removes a pod from the kubelet when dropped (also when building the [`JobPod`] failed).
struct PodRemoval {
    kubelet: Kubelet,
    name: String,
}

impl Drop for PodRemoval {
    fn drop(&mut self) {
        self.kubelet.remove_pod("jobs", &self.name);
    }
}

impl JobPod {
    /// Has the kubelet start an app container's main process now (pid 1 of its own pid
    /// namespace): bundle, cgroup, process, as for any container.
    pub fn run_app(&mut self, container: &str, script: &str) -> Result<()> {
        self.start_app(container, &["/bin/sh", "-c", script], &SpawnOptions::default())?;
        Ok(())
    }

    /// Like [`JobPod::run_app`] with any command and spawn options.
    pub fn start_app(&mut self, container: &str, cmd: &[&str], opts: &SpawnOptions) -> Result<ContainerProcess> {
        let p = self.kubelet.start_container("jobs", &self.name, container, cmd, opts)?;
        self.apps.push(p.clone());
        Ok(p)
    }

    /// The current process of a container (a restarted container has a new one).
    pub fn process(&self, container: &str) -> Option<ContainerProcess> {
        self.kubelet.process("jobs", &self.name, container)
    }

    /// Posts the pod object (for specs with `post: false`).
    pub fn post(&self) -> Result<()> {
        // The kubelet's status writes went nowhere until now.
        self.api.create_pod(self.json.clone())?;
        Ok(())
    }

    /// Writes what the runtime shows now to the API (ids, states), whatever the kubelet's timing.
    pub fn publish_status(&self) -> Result<()> {
        self.kubelet.publish_status("jobs", &self.name)
    }

    /// The status the runtime's truth makes now, not written (see [`Kubelet::runtime_status`]).
    pub fn runtime_status(&self) -> Result<Value> {
        self.kubelet.runtime_status("jobs", &self.name)
    }

    /// A container's status as the API shows it now.
    pub fn api_status(&self, container: &str) -> Option<Value> {
        let pod = self.api.get_pod("jobs", &self.name)?;
        ["containerStatuses", "initContainerStatuses"]
            .iter()
            .flat_map(|l| pod["status"][l].as_array().cloned().unwrap_or_default())
            .find(|c| c["name"] == container)
    }

    /// Waits until the API shows `container` terminated; its exit code.
    pub fn wait_api_terminated(&self, container: &str, timeout: Duration) -> Option<i64> {
        let mut code = None;
        eventually(timeout, || {
            code = self.api_status(container).and_then(|s| s["state"]["terminated"]["exitCode"].as_i64());
            code.is_some()
        });
        code
    }

    /// When a `listen_when_ready` stand-in turned ready (its listener bound), on the monotonic
    /// clock.
    pub fn proxy_ready_at(&self) -> Option<u64> {
        self.requests().into_iter().find(|e| e.method == "READY").map(|e| e.mono_ns)
    }

    /// Every line the stand-in logged: requests, `ACCEPT /` per connection, and `READY /` when
    /// a `listen_when_ready` stand-in turned ready.
    pub fn requests(&self) -> Vec<valet_sim::standin::RequestEvent> {
        valet_sim::standin::read_events(&self.events).unwrap_or_default()
    }

    /// Quit requests the stand-in received (POST /quitquitquit), with their peers.
    pub fn quits(&self) -> Vec<valet_sim::standin::RequestEvent> {
        self.requests().into_iter().filter(|e| e.method == "POST" && e.path == "/quitquitquit").collect()
    }

    /// When the connection that carried `request` was accepted.
    pub fn accepted(&self, request: &valet_sim::standin::RequestEvent) -> Option<u64> {
        self.requests()
            .into_iter()
            .filter(|e| e.method == "ACCEPT" && e.peer == request.peer && e.mono_ns <= request.mono_ns)
            .map(|e| e.mono_ns)
            .max()
    }

    /// Quit requests that came from the pod's own loopback (the ones the proxy accepts).
    pub fn loopback_quits(&self) -> Vec<valet_sim::standin::RequestEvent> {
        self.quits().into_iter().filter(|e| e.peer.ip().is_loopback()).collect()
    }

    /// Waits for the proxy (its first instance) to exit; its exit code (None: still running at
    /// the deadline).
    pub fn wait_proxy_exit(&mut self, timeout: Duration) -> Result<Option<i32>> {
        Ok(self.proxy.wait_timeout(timeout)?.map(valet_sim::kubelet::exit_code))
    }

    /// Marks an app terminated in the API now (the kubelet does it itself about a second after the
    /// exit; for `manual_status` pods, or to be early).
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
    /// Whether the agent exited because another process had its metrics port; waits until it
    /// serves, answers there or exits (a hang guard at most).
    fn lost_its_port(&mut self) -> bool {
        let deadline = Instant::now() + HANG_GUARD;
        while Instant::now() < deadline {
            let exited = self.child.as_mut().is_none_or(|c| c.try_wait().is_ok_and(|s| s.is_some()));
            let log = self.log_text();
            if exited {
                return log.contains("bind metrics address");
            }
            // The line is logged at info; with a quieter VALET_TEST_LOG, an answer on the port.
            if log.contains("serving /metrics")
                || std::net::TcpStream::connect_timeout(&self.metrics, Duration::from_millis(50)).is_ok()
            {
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        false
    }

    /// One GET of the agent's server (`/readyz`, `/healthz`, `/metrics`): status and body.
    pub fn get(&self, path: &str) -> Result<(u16, String)> {
        // A metric read as 0 because a busy agent answered late would fail a test for nothing.
        let r = valet_sim::client::get(self.metrics, path, HANG_GUARD)?;
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

    /// Waits until the agent serves the node: ready, or running degraded for a reason
    /// `--degraded-ok` does not expect (then `/readyz` answers 503 and says so, for good).
    pub fn wait_served(&mut self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(child) = self.child.as_mut()
                && let Some(status) = child.try_wait()?
            {
                bail!("valet-agent exited ({status}):\n{}", self.log_text());
            }
            match self.get("/readyz") {
                Ok((200, _)) => return Ok(()),
                Ok((503, body)) if body.contains("degraded for a reason not expected") => return Ok(()),
                _ => {}
            }
            if Instant::now() > deadline {
                bail!("valet-agent neither ready nor degraded after {timeout:?}:\n{}", self.log_text());
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

    /// Waits until a sample reads `value` (counts are made a moment after what they count: a
    /// released app may run, or a quit proxy exit, before the agent counts it); whether it did.
    pub fn wait_metric(&self, sample: &str, value: f64) -> bool {
        eventually(HANG_GUARD, || self.metric(sample) == value)
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
        stop_child(&mut self.child, signal, timeout, "agent")
    }
}

/// Sends `signal` to the child, if it still runs, and waits for it to end (up to `timeout`,
/// then SIGKILL and an error); its exit status.
fn stop_child(
    child: &mut Option<std::process::Child>,
    signal: i32,
    timeout: Duration,
    what: &str,
) -> Result<Option<std::process::ExitStatus>> {
    let Some(mut child) = child.take() else { return Ok(None) };
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
            bail!("{what} did not stop within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Where [`Node::install_daemonset`] puts the agent's DaemonSet, and its name.
pub const AGENT_NAMESPACE: &str = "valet-system";
pub const AGENT_DAEMONSET: &str = "valet-agent";

/// The downward API's environment of a container of the agent's pod `pod`.
fn pod_env(pod: &str) -> [(&'static str, &str); 2] {
    [("POD_NAME", pod), ("POD_NAMESPACE", AGENT_NAMESPACE)]
}

/// `valet-agent deadlines` for a node ([`Node::start_deadline_keeper`]); killed when dropped.
pub struct DeadlineKeeper {
    child: Option<std::process::Child>,
    pub log: PathBuf,
}

impl DeadlineKeeper {
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// SIGKILL (a crash, or the node's OOM killer): it releases nothing.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM (its pod deleted), then its exit status.
    pub fn stop(&mut self) -> Result<Option<std::process::ExitStatus>> {
        stop_child(&mut self.child, libc::SIGTERM, HANG_GUARD, "valet-agent deadlines")
    }

    /// Its exit status once it has exited on its own, waiting at most `timeout` (None: still running).
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let child = self.child.as_mut()?;
        let deadline = Instant::now() + timeout;
        loop {
            match child.try_wait() {
                Ok(Some(status)) => return Some(status),
                Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
                _ => return None,
            }
        }
    }
}

impl Drop for DeadlineKeeper {
    fn drop(&mut self) {
        self.kill();
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

/// How long a test waits for an event before it calls it missing: only a guard against a hang
/// (a test waits for the event itself, never for a time), long enough for a loaded machine.
pub const HANG_GUARD: Duration = Duration::from_secs(30);

/// The state letter of a process (`R`, `S`, `T`, `Z`, ...), None once it is gone.
pub fn process_state(pid: u32) -> Option<char> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    valet_agent::host::proc::stat_field(&stat, 3)?.chars().next()
}

/// Polls every 200 µs (fine enough to print a release latency) until `path` exists; how long
/// that took.
pub fn wait_file(path: &Path, timeout: Duration) -> Option<Duration> {
    let start = Instant::now();
    while start.elapsed() < timeout {
        if path.exists() {
            return Some(start.elapsed());
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    None
}

pub use valet_test_support::eventually;
use valet_test_support::free_port;
