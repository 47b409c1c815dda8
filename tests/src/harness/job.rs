//! A Job's pod on the simulated node: its spec (apps, proxy, cgroup layout, the kubelet's
//! timing) and the pod the kubelet runs from it.
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use serde_json::Value;
use valet_sim::kubelet::{ContainerKind, ContainerSpec, HttpProbe, KubeletPod, StatusTiming};
use valet_sim::node::{CgroupDriver, PodJsonOptions, QosClass, Runtime, SimPod, SimPodOptions, SpawnOptions};
use valet_sim::standin::{ProxyKind, StandinOptions};
use valet_sim::{ApiHandle, ContainerProcess, Kubelet};

use super::*;

impl Node {
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
        let proxy_name = spec.proxy_name();
        let sim = Arc::new(SimPod::create(spec.sim_pod_options(&name))?);
        let events = self.scratch.path(&format!("{name}.proxy-events"));
        let (standin, proxy_cmd) = spec.proxy(&events)?;
        let json_opts = spec.pod_json_options(&self.name);
        let containers = spec.containers(proxy_name, &proxy_cmd, before_proxy.is_none());
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

    /// The pod's phase as the API shows it.
    pub fn phase(&self, job: &JobPod) -> Option<String> {
        self.pod(job)?["status"]["phase"].as_str().map(str::to_owned)
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
    /// The stand-in logs when each request's bytes reached its socket (`--stamp-arrivals`).
    pub stamp_arrivals: bool,
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
            stamp_arrivals: false,
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
    pub(super) kubelet: Kubelet,
    pub(super) name: String,
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

impl JobSpec {
    /// The proxy's container: `istio-proxy`, or the sidecar's own name.
    fn proxy_name(&self) -> &str {
        self.sidecar.as_ref().map_or("istio-proxy", |(name, _)| name.as_str())
    }

    /// The sim pod's cgroups and containers (each app, the proxy, the sidecars after it, the
    /// extra containers), lazily made as the kubelet starts each.
    fn sim_pod_options(&self, name: &str) -> SimPodOptions {
        let mut opts = SimPodOptions::new(name)
            .namespace("jobs")
            .driver(self.driver)
            .runtime(self.runtime)
            .qos(self.qos)
            .crun(self.crun)
            .lazy_cgroups(true);
        if let Some(root) = &self.cgroup_root {
            opts = opts.cgroup_root(root);
        }
        for app in &self.apps {
            opts = opts.container(app);
        }
        let proxy_name = self.proxy_name();
        opts = opts.container(proxy_name);
        for (name, _) in &self.natives_after {
            opts = opts.container(name);
        }
        for extra in &self.extra_containers {
            opts = opts.container(extra);
        }
        opts
    }

    /// The stand-in's options (its events to `events`) and the proxy's command: the stand-in's,
    /// or the spec's own sidecar's.
    fn proxy(&self, events: &Path) -> Result<(StandinOptions, Vec<String>)> {
        let mut standin = StandinOptions::new(ProxyKind::Istio);
        standin.events = Some(events.to_path_buf());
        standin.ready_file = self.ready_file.clone();
        standin.listen_when_ready = self.listen_when_ready;
        standin.stamp_arrivals = self.stamp_arrivals;
        standin.hang = self.proxy_hangs;
        standin.quit_ignored = self.proxy_ignores_quit;
        standin.flood = self.proxy_floods;
        let proxy_cmd: Vec<String> = match &self.sidecar {
            Some((_, cmd)) => cmd.clone(),
            None => std::iter::once(valet_sim::standin::binary_path()?.to_string_lossy().into_owned())
                .chain(standin.to_args())
                .collect(),
        };

        Ok((standin, proxy_cmd))
    }

    /// The pod object's options: on `node_name` (unless the spec names a node), the Job's
    /// labels, annotations and runtime class.
    fn pod_json_options(&self, node_name: &str) -> PodJsonOptions {
        let mut json_opts = PodJsonOptions::node(self.node.as_deref().unwrap_or(node_name))
            .restart_policy(&self.restart_policy)
            .share_process_namespace(self.share_process_namespace)
            .job(&self.name);
        if self.labelled {
            json_opts = json_opts.label("valet.dev/enabled", "true");
        }
        for (k, v) in &self.annotations {
            json_opts = json_opts.annotation(k, v);
        }
        json_opts.runtime_class = self.runtime_class.clone();
        json_opts
    }

    /// The kubelet's containers in spec order: the apps, and the proxy (first, as a native
    /// sidecar, or last); with `command_now` the proxy's command is the kubelet's to start.
    fn containers(&self, proxy_name: &str, proxy_cmd: &[String], command_now: bool) -> Vec<ContainerSpec> {
        let mut containers = Vec::new();
        for app in &self.apps {
            let mut c = ContainerSpec::new(app);
            if let Some((_, script)) = self.app_commands.iter().find(|(a, _)| a == app) {
                c = c.command(&["/bin/sh", "-c", script]);
            } else if self.already_exited.contains(app) {
                c = c.command(&["/bin/sh", "-c", "exit 0"]);
            }
            for (_, policy) in self.app_restart_policies.iter().filter(|(a, _)| a == app) {
                c = c.restart_policy(policy);
            }
            for (_, (action, operator, values)) in self.app_restart_rules.iter().filter(|(a, _)| a == app) {
                c = c.restart_rule(action, operator, values);
            }
            if let Some((lag, _)) = self.record_lags {
                c = c.record_lag(lag);
            }
            containers.push(c);
        }
        let mut proxy = ContainerSpec::new(proxy_name);
        if command_now {
            proxy.command = Some(proxy_cmd.to_vec());
        }
        proxy.readiness = self.proxy_probe.clone();
        if let Some((_, lag)) = self.record_lags {
            proxy = proxy.record_lag(lag);
        }
        if self.native {
            // An init container with `restartPolicy: Always`, before the apps; the stand-in
            // pilot-agent gets Istio's startupProbe, which holds the apps until it passes.
            proxy = proxy.kind(ContainerKind::NativeSidecar);
            if self.sidecar.is_none() {
                proxy = proxy.startup(HttpProbe::istio_startup());
            }
            containers.insert(0, proxy);
            for (i, (name, script)) in self.natives_after.iter().enumerate() {
                let c = ContainerSpec::new(name).command(&["/bin/sh", "-c", script]).kind(ContainerKind::NativeSidecar);
                containers.insert(1 + i, c);
            }
        } else {
            containers.push(proxy);
        }
        containers
    }
}
