//! New container cgroups in tracked pods, as they are made (inotify on the pod's cgroup directory).
//!
//! A runtime makes a container's cgroup when it creates the container (`runc create`), with the
//! OCI bundle already written, and starts its process later (`runc start`, a separate CRI call).
//! Learning of the cgroup at once lets the agent read the bundle and tell the kernel whether the
//! container's first exec is held before that exec happens: a sidecar, an init container or the
//! sandbox is never stopped, not even for the millisecond a judgement at exec would take.
//!
//! Without inotify (or when a watch cannot be added) nothing is lost but that head start: the
//! kernel still holds an unclassified container's first exec and the agent judges it then.

use std::collections::HashMap;
use std::path::Path;

use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify, WatchDescriptor};
use tokio::io::unix::AsyncFd;
use tracing::{debug, warn};

use crate::host::sys::Inotify as Fd;

/// Watches pod cgroup directories for new children.
pub struct Creations {
    inotify: Option<AsyncFd<Fd>>,
    by_wd: HashMap<WatchDescriptor, u64>,
    by_pod: HashMap<u64, WatchDescriptor>,
}

impl Creations {
    /// Registers with the current tokio runtime's reactor. Never fails: without inotify (or
    /// outside a runtime), [`Creations::next`] never resolves and [`Creations::watch`] says so.
    pub fn new() -> Creations {
        let inotify = if tokio::runtime::Handle::try_current().is_err() {
            Err("no tokio runtime".to_owned())
        } else {
            Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC)
                .map_err(|e| e.to_string())
                .and_then(|i| crate::host::sys::readable(Fd(i)).map_err(|e| e.to_string()))
        };
        let inotify = match inotify {
            Ok(i) => Some(i),
            Err(e) => {
                warn!("inotify unavailable ({e}): containers of held pods are judged at their first exec");
                None
            }
        };
        Creations { inotify, by_wd: HashMap::new(), by_pod: HashMap::new() }
    }

    /// Starts watching the pod cgroup `dir` (id `pod_cgroup`) for new container cgroups.
    pub fn watch(&mut self, pod_cgroup: u64, dir: &Path) -> Result<(), String> {
        if self.by_pod.contains_key(&pod_cgroup) {
            return Ok(());
        }
        let Some(inotify) = &self.inotify else { return Err("inotify unavailable".into()) };
        let wd = inotify
            .get_ref()
            .0
            .add_watch(dir, AddWatchFlags::IN_CREATE | AddWatchFlags::IN_MOVED_TO | AddWatchFlags::IN_ONLYDIR)
            .map_err(|e| format!("inotify watch {}: {e}", dir.display()))?;
        self.by_wd.insert(wd, pod_cgroup);
        self.by_pod.insert(pod_cgroup, wd);
        Ok(())
    }

    pub fn unwatch(&mut self, pod_cgroup: u64) {
        if let Some(wd) = self.by_pod.remove(&pod_cgroup) {
            self.by_wd.remove(&wd);
            if let Some(inotify) = &self.inotify {
                // Fails when the directory is gone already (the kernel dropped the watch).
                let _ = inotify.get_ref().0.rm_watch(wd);
            }
        }
    }

    pub fn watching(&self) -> usize {
        self.by_pod.len()
    }

    /// Waits for new directories; returns the pod cgroup ids that got one (each once). On a
    /// queue overflow every watched pod is returned, since any of them may have one.
    pub async fn next(&mut self) -> Vec<u64> {
        let Some(inotify) = &self.inotify else { return std::future::pending().await };
        loop {
            let mut ready = match inotify.readable().await {
                Ok(r) => r,
                Err(e) => {
                    warn!("inotify: {e}");
                    return std::future::pending().await;
                }
            };
            let events = match ready.try_io(|fd| fd.get_ref().0.read_events().map_err(std::io::Error::from)) {
                Ok(Ok(events)) => events,
                Ok(Err(e)) => {
                    debug!("inotify read: {e}");
                    continue;
                }
                Err(_would_block) => continue,
            };
            let mut pods = Vec::new();
            for event in events {
                if event.mask.contains(AddWatchFlags::IN_Q_OVERFLOW) {
                    pods.extend(self.by_pod.keys().copied());
                    continue;
                }
                if event.mask.contains(AddWatchFlags::IN_IGNORED) {
                    // The directory is gone (the pod's cgroup was removed): the kernel dropped it.
                    if let Some(pod) = self.by_wd.remove(&event.wd) {
                        self.by_pod.remove(&pod);
                    }
                    continue;
                }
                // cgroupfs makes directories with mkdir; a directory moved in counts the same.
                let made = event.mask.intersects(AddWatchFlags::IN_CREATE | AddWatchFlags::IN_MOVED_TO);
                if made
                    && event.mask.contains(AddWatchFlags::IN_ISDIR)
                    && let Some(pod) = self.by_wd.get(&event.wd)
                {
                    pods.push(*pod);
                }
            }
            pods.sort_unstable();
            pods.dedup();
            if !pods.is_empty() {
                return pods;
            }
        }
    }
}

impl Default for Creations {
    fn default() -> Self {
        Creations::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// Only a guard against a hang: the tests wait for events, never for a time.
    const HANG_GUARD: Duration = Duration::from_secs(30);

    fn dir(name: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("valet-created-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("mkdir");
        d
    }

    #[tokio::test]
    async fn a_new_directory_names_its_pod_once_and_files_are_ignored() {
        let (a, b) = (dir("a"), dir("b"));
        let mut c = Creations::new();
        c.watch(1, &a).expect("watch a");
        c.watch(2, &b).expect("watch b");
        std::fs::write(a.join("cgroup.procs"), "").expect("file");
        std::fs::create_dir(b.join("cri-containerd-1.scope")).expect("mkdir");
        std::fs::create_dir(b.join("cri-containerd-2.scope")).expect("mkdir");
        let got = tokio::time::timeout(HANG_GUARD, c.next()).await.expect("an event");
        assert_eq!(got, vec![2]);
        // Unwatched: a new directory there is not reported.
        c.unwatch(2);
        std::fs::create_dir(b.join("cri-containerd-3.scope")).expect("mkdir");
        std::fs::create_dir(a.join("cri-containerd-4.scope")).expect("mkdir");
        let got = tokio::time::timeout(HANG_GUARD, c.next()).await.expect("an event");
        assert_eq!(got, vec![1]);
        assert_eq!(c.watching(), 1);
        let _ = std::fs::remove_dir_all(&a);
        let _ = std::fs::remove_dir_all(&b);
    }

    #[tokio::test]
    async fn a_removed_pod_directory_drops_its_watch() {
        let (a, later) = (dir("gone"), dir("later"));
        let mut c = Creations::new();
        c.watch(7, &a).expect("watch");
        std::fs::remove_dir_all(&a).expect("rm");
        // A directory made in another pod afterwards: its event comes after the removal's, so
        // whatever the removal caused is known once it arrives.
        c.watch(8, &later).expect("watch later");
        std::fs::create_dir(later.join("cri-containerd-1.scope")).expect("mkdir");
        let got = tokio::time::timeout(HANG_GUARD, c.next()).await.expect("an event");
        assert_eq!(got, vec![8], "the removed directory reported as new");
        assert_eq!(c.watching(), 1, "the kernel dropped the watch and so did we");
        assert!(c.watch(7, &a).is_err(), "a missing directory is an error, not a panic");
        let _ = std::fs::remove_dir_all(&later);
    }
}
