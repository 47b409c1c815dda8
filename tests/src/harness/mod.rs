//! A simulated node with the real agent binary running against it: the fake API server, the
//! agent process (as a DaemonSet would run it) and helpers to build Job-like pods whose sidecar
//! is a stand-in proxy. Used by the end-to-end tests, the demo and the benchmarks.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};
use valet_sim::apiserver::Kind;
use valet_sim::kubelet::KubeletOptions;
use valet_sim::{FakeApiServer, Kubelet, ServerOptions};

mod agent;
mod job;

pub use agent::{Agent, DeadlineKeeper, says_about};
pub use job::{JobPod, JobSpec};

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
    /// Where the simulated containerd keeps its CRI container records.
    record_dir: PathBuf,
    /// Where the simulated kubelet makes its container log links.
    log_links: PathBuf,
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
        // And containerd's CRI records, `<root>/io.containerd.grpc.v1.cri/containers`.
        let record_dir = scratch.path("var/lib/containerd/io.containerd.grpc.v1.cri/containers");
        std::fs::create_dir_all(&record_dir)?;
        opts.runtime_record_dir = Some(record_dir.clone());
        // And the kubelet's container log links, `/var/log/containers`.
        let log_links = scratch.path("var/log/containers");
        std::fs::create_dir_all(&log_links)?;
        opts.container_log_links = Some(log_links.clone());
        let kubelet = Kubelet::start(api.kubelet_handle(), opts)?;
        let name = format!("node-{}", valet_sim::util::random_hex(3));
        let pin_dir = PathBuf::from(format!("/sys/fs/bpf/valet-test-{}-{name}", std::process::id()));
        Ok(Node { api, kubelet, name, scratch, kubeconfig, runtime_dir, record_dir, log_links, pin_dir })
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

    /// Starts the agent binary for this node, with `extra` flags (and `--runtime-state-dirs`,
    /// `--runtime-record-dirs` and `--container-log-links` naming the node's own unless `extra`
    /// has that flag).
    pub fn start_agent(&self, extra: &[&str]) -> Result<Agent> {
        self.start_agent_env(extra, &[])
    }

    /// Like [`Node::start_agent`], with more environment (after the harness's own: e.g. its
    /// `RUST_LOG`).
    pub fn start_agent_env(&self, extra: &[&str], env: &[(&str, &str)]) -> Result<Agent> {
        let mut agent = self.spawn_agent_env(&[], extra, env)?;
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
        self.start_agent_env(extra, &pod_env(pod))
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
        if !extra.iter().any(|a| a.starts_with("--runtime-record-dirs")) {
            command.arg("--runtime-record-dirs").arg(&self.record_dir);
        }
        if !extra.iter().any(|a| a.starts_with("--container-log-links")) {
            command.arg("--container-log-links").arg(&self.log_links);
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
}

/// Where [`Node::install_daemonset`] puts the agent's DaemonSet, and its name.
pub const AGENT_NAMESPACE: &str = "valet-system";
pub const AGENT_DAEMONSET: &str = "valet-agent";

/// The downward API's environment of a container of the agent's pod `pod`.
fn pod_env(pod: &str) -> [(&'static str, &str); 2] {
    [("POD_NAME", pod), ("POD_NAMESPACE", AGENT_NAMESPACE)]
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
