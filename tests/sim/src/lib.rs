//! A simulated Kubernetes node for valet's tests, demo and benchmarks:
//!
//! - [`apiserver`]: a fake API server for Pods and Events speaking the real REST/watch protocol
//!   (kube-rs and client-go work against it), with a synchronous test-control API;
//! - [`kubelet`]: a simulated kubelet and container runtime that run those pods with a real
//!   kubelet's timing (ids and exits reported about a second late, readiness from probes);
//! - [`node`]: kubelet-shaped pods made of real cgroups, network and pid namespaces (root);
//! - [`standin`]: stand-in sidecar proxies (Istio, Envoy, Linkerd, cloud-sql-proxy endpoints),
//!   also the `valet-standin-proxy` binary;
//! - [`client`]: a tiny blocking HTTP client for tests.
//!
//! ```no_run
//! use std::time::Duration;
//! use valet_sim::{FakeApiServer, PodJsonOptions, ProxyKind, SimPod, SimPodOptions, SpawnOptions, StandinOptions};
//!
//! # fn main() -> anyhow::Result<()> {
//! let api = FakeApiServer::start()?;
//! api.write_kubeconfig("/tmp/kubeconfig")?;
//! let pod = SimPod::create(SimPodOptions::new("job-1").container("app").container("istio-proxy"))?;
//! let proxy = StandinOptions::new(ProxyKind::Istio);
//! let _sidecar = pod.spawn_standin("istio-proxy", &proxy, &SpawnOptions::default())?;
//! pod.wait_standin_ready(&proxy, Duration::from_secs(5))?;
//! let mut app = pod.spawn("app", &["sh", "-c", "sleep 0.1"], &SpawnOptions::default())?;
//! api.create_pod(pod.pod_json(&PodJsonOptions::node("node-a").job("job")))?;
//! let status = app.wait_timeout(Duration::from_secs(5))?;
//! # let _ = status;
//! # Ok(())
//! # }
//! ```

pub mod apiserver;
pub mod client;
pub mod kubelet;
pub mod node;
pub mod standin;
pub mod util;

pub use apiserver::{ApiHandle, FakeApiServer, RecordedRequest, ServerOptions};
pub use kubelet::{ContainerProcess, HttpProbe, Kubelet, KubeletOptions, KubeletPod, StatusTiming};
pub use node::{
    CgroupDriver, CgroupRoot, PodJsonOptions, QosClass, Runtime, SimPod, SimPodOptions, SimProcess, SpawnOptions,
};
pub use standin::{ProxyKind, StandinOptions};
