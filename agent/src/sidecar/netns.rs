//! Running code inside a pod's network namespace. Sidecar admin endpoints accept loopback
//! callers only, so the agent enters the pod's namespace on a thread of its own, opens its socket
//! to 127.0.0.1 there, and lets the thread die afterwards (no pool thread is ever left in a pod's
//! namespace).

use std::fs::File;
use std::os::unix::fs::MetadataExt as _;
use std::path::Path;

use crate::cgroup::CgroupFs;
use crate::error::{Error, Result};

/// An open handle on a pod's network namespace.
#[derive(Debug)]
pub struct PodNetns {
    file: File,
    /// Inode of the namespace (its identity).
    pub inode: u64,
    /// The process it was opened through.
    pub via_pid: u32,
}

/// Opens the network namespace of a live process of the pod whose cgroup is `pod_rel`.
///
/// Refuses the node's own namespace (a hostNetwork pod, or a process that moved): a quit sent to
/// the node's loopback could reach another pod's sidecar.
pub fn open_pod_netns(host_proc: &Path, cgroups: &CgroupFs, pod_rel: &str) -> Result<PodNetns> {
    // The node's namespace, when visible (hostNetwork pods are also skipped by the controller).
    let host_ns = std::fs::metadata(host_proc.join("1/ns/net")).map(|m| m.ino()).ok();
    let members = cgroups.procs_recursive(pod_rel);
    let mut saw_host_ns = false;
    for pid in members.iter().copied() {
        let Ok(file) = File::open(host_proc.join(pid.to_string()).join("ns/net")) else { continue };
        let Ok(meta) = file.metadata() else { continue };
        // Checked after opening: if the pid was reused in between, it is no longer a member.
        // (Read from the cgroup files: /proc/<pid>/cgroup is relative to our cgroup namespace.)
        if !cgroups.procs_recursive(pod_rel).contains(&pid) {
            continue;
        }
        if Some(meta.ino()) == host_ns {
            saw_host_ns = true;
            continue;
        }
        return Ok(PodNetns { file, inode: meta.ino(), via_pid: pid });
    }
    Err(Error::Endpoint(if saw_host_ns {
        "the pod shares the node's network namespace (hostNetwork): refusing to call its loopback".into()
    } else {
        "no live process of the pod to enter its network namespace through".into()
    }))
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
