//! Running code inside a pod's network namespace. Sidecar admin endpoints accept loopback
//! callers only, so the agent enters the pod's namespace on a thread of its own, opens its socket
//! to 127.0.0.1 there, and lets the thread die afterwards (no pool thread is ever left in a pod's
//! namespace).

use std::collections::HashMap;
use std::fs::File;
use std::net::{Ipv4Addr, SocketAddr};
use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};

use super::http::{self, Limits, Response};
use super::{Failed, Pending, PodTarget, SidecarLink};
use crate::cgroup::CgroupFs;
use crate::error::{Error, Result};
use crate::kernel::container_main::start_time;

/// An open handle on a pod's network namespace.
#[derive(Debug)]
pub struct PodNetns {
    file: File,
    /// Inode of the namespace (its identity).
    pub inode: u64,
    /// The process it was opened through.
    pub via_pid: u32,
}

/// Opens the network namespace of the pod whose cgroup is `pod_rel`: the pod's own, the one its
/// sandbox holds, never a private one an app process made for itself (`unshare -rn`, Chromium's
/// network sandbox). The sandbox starts first, so the pod's oldest process is in it.
///
/// Refuses the node's own namespace (a hostNetwork pod, or a process that moved): a quit sent to
/// the node's loopback could reach another pod's sidecar.
pub fn open_pod_netns(host_proc: &Path, cgroups: &CgroupFs, pod_rel: &str) -> Result<PodNetns> {
    // The node's namespace, when visible (hostNetwork pods are also skipped by the controller).
    let host_ns = std::fs::metadata(host_proc.join("1/ns/net")).map(|m| m.ino()).ok();
    let mut members: Vec<(u64, u32)> = cgroups
        .procs_recursive(pod_rel)
        .into_iter()
        .filter_map(|pid| Some((start_time(host_proc, pid)?, pid)))
        .collect();
    members.sort_unstable();
    for pid in members.iter().map(|(_, pid)| *pid) {
        let Ok(file) = File::open(host_proc.join(pid.to_string()).join("ns/net")) else { continue };
        let Ok(meta) = file.metadata() else { continue };
        // Checked after opening: if the pid was reused in between, it is no longer a member.
        // (Read from the cgroup files: /proc/<pid>/cgroup is relative to our cgroup namespace.)
        if !cgroups.procs_recursive(pod_rel).contains(&pid) {
            continue;
        }
        if Some(meta.ino()) == host_ns {
            return Err(Error::Endpoint(
                "the pod shares the node's network namespace (hostNetwork): refusing to call its loopback".into(),
            ));
        }
        return Ok(PodNetns { file, inode: meta.ino(), via_pid: pid });
    }
    Err(Error::Endpoint("no live process of the pod to enter its network namespace through".into()))
}

impl PodNetns {
    /// Runs `f` on a fresh thread that has joined this namespace, blocking until it is done.
    pub fn run_blocking<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce() -> T + Send + 'static,
    {
        let fd = self.file.try_clone().map_err(|e| Error::io("dup namespace fd", e))?;
        std::thread::Builder::new()
            .name("valet-netns".into())
            .spawn(move || {
                nix::sched::setns(&fd, nix::sched::CloneFlags::CLONE_NEWNET)
                    .map_err(|e| Error::Endpoint(format!("setns into the pod's network namespace: {e}")))?;
                Ok(f())
            })
            .map_err(|e| Error::io("spawn namespace thread", e))?
            .join()
            .map_err(|_| Error::Endpoint("namespace thread panicked".into()))?
    }

    /// Runs `f` on a fresh thread that has joined this namespace, and waits for it.
    pub async fn run<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce() -> T + Send + 'static,
    {
        let fd = self.file.try_clone().map_err(|e| Error::io("dup namespace fd", e))?;
        let (tx, rx) = tokio::sync::oneshot::channel();
        std::thread::Builder::new()
            .name("valet-netns".into())
            .spawn(move || {
                let entered = nix::sched::setns(&fd, nix::sched::CloneFlags::CLONE_NEWNET)
                    .map_err(|e| Error::Endpoint(format!("setns into the pod's network namespace: {e}")));
                let _ = tx.send(entered.map(|()| f()));
            })
            .map_err(|e| Error::io("spawn namespace thread", e))?;
        rx.await.map_err(|_| Error::Endpoint("namespace thread died".into()))?
    }
}

/// The production [`SidecarLink`]: each pod's network namespace, opened once and kept until the
/// pod's work is done, and a blocking HTTP/1.1 request on a thread inside it.
pub struct PodNetwork {
    host_proc: PathBuf,
    cgroups: CgroupFs,
    open: Mutex<HashMap<String, Arc<PodNetns>>>,
}

impl PodNetwork {
    pub fn new(host_proc: PathBuf, cgroups: CgroupFs) -> PodNetwork {
        PodNetwork { host_proc, cgroups, open: Mutex::new(HashMap::new()) }
    }

    /// How many pod network namespaces are held open.
    pub fn open_count(&self) -> usize {
        self.open.lock().unwrap_or_else(PoisonError::into_inner).len()
    }

    fn handle(&self, uid: &str, pod_rel: Option<&str>, fresh: bool) -> Result<Arc<PodNetns>> {
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        if !fresh && let Some(netns) = open.get(uid) {
            return Ok(netns.clone());
        }
        let rel = pod_rel.ok_or_else(|| Error::Endpoint("the pod's cgroup is not known yet".into()))?;
        let netns = Arc::new(open_pod_netns(&self.host_proc, &self.cgroups, rel)?);
        open.insert(uid.to_owned(), netns.clone());
        Ok(netns)
    }
}

impl SidecarLink for PodNetwork {
    fn open(&self, uid: &str, pod_rel: &str) -> Result<(), String> {
        self.handle(uid, Some(pod_rel), false).map(|_| ()).map_err(|e| e.to_string())
    }

    fn close(&self, uid: &str) {
        self.open.lock().unwrap_or_else(PoisonError::into_inner).remove(uid);
    }

    fn request(
        &self,
        target: PodTarget,
        port: u16,
        method: &'static str,
        path: String,
        limits: Limits,
        fresh: bool,
        pod_ip_fallback: bool,
    ) -> Pending<Result<Response, Failed>> {
        let netns = self.handle(&target.uid, target.pod_rel.as_deref(), fresh);
        Box::pin(async move {
            match (netns, target.pod_ip) {
                (Ok(netns), _) => {
                    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
                    match netns.run(move || http::request(addr, method, &path, limits)).await {
                        Ok(Ok(response)) => Ok(response),
                        Ok(Err(failure)) => Err((failure.to_string(), failure.label())),
                        Err(e) => Err((e.to_string(), "netns")),
                    }
                }
                (Err(_), Some(ip)) if pod_ip_fallback => {
                    let addr = SocketAddr::new(ip, port);
                    let answer = tokio::task::spawn_blocking(move || http::request(addr, method, &path, limits)).await;
                    match answer {
                        Ok(Ok(response)) => Ok(response),
                        Ok(Err(failure)) => Err((failure.to_string(), failure.label())),
                        Err(e) => Err((e.to_string(), "io")),
                    }
                }
                (Err(e), _) => Err((e.to_string(), "no_netns")),
            }
        })
    }
}
