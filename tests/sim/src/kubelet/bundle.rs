//! The runtime's OCI bundles (what the agent reads of a container) and the sandbox's pause
//! program.
use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result};
use serde_json::json;

use super::*;

/// Writes a container's OCI bundle as the runtime does before it starts the process:
/// containerd `<dir>/config.json`, CRI-O `<dir>/userdata/config.json`, with the CRI annotations
/// and the pod's network namespace as each runtime names it: CRI-O its pinned path in every
/// container's; containerd the pinned path in the sandbox's only, and in its containers'
/// `/proc/<sandbox pid>/ns/net` (the CRI plugin's `GetNetworkNamespace(sandboxPid)`), which an
/// agent opens through the host's procfs (ptrace-read on the pause process).
/// `sandbox_pid`: the pod's sandbox process, once it runs.
pub fn write_bundle(dir: &Path, sim: &SimPod, c: &SimContainer, sandbox: bool, sandbox_pid: Option<u32>) -> Result<()> {
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
    // The pod's network namespace, named as CRI-O names its pinned one (a pod without one of its
    // own writes no namespaces: no record, as a runtime valet cannot read).
    let netns = match (sim.runtime(), sandbox_pid) {
        (Runtime::Containerd, Some(pid)) if !sandbox => {
            sim.netns_path().map(|_| std::path::PathBuf::from(format!("/proc/{pid}/ns/net")))
        }
        _ => sim.netns_path().map(Path::to_path_buf),
    };
    let config = match netns {
        Some(netns) => json!({"ociVersion": "1.1.0", "annotations": annotations, "linux": {"namespaces": [
            {"type": "pid"}, {"type": "network", "path": netns}]}}),
        None => json!({"ociVersion": "1.1.0", "annotations": annotations}),
    };
    let file = path.join("config.json");
    std::fs::write(&file, serde_json::to_vec(&config)?).with_context(|| format!("write {}", file.display()))
}

/// Writes container `id`'s CRI record in `dir` as containerd 1.6 to 2.1 write theirs
/// (`<dir>/<id>/status`; the status fields at the top level): `finished` (the time in ns since the
/// epoch, the exit code) once its exit is recorded. A new file renamed over the old, as
/// `continuity.AtomicWriteFile` does.
pub fn write_record(dir: &Path, id: &str, pid: u32, finished: Option<(i64, i32)>) -> Result<()> {
    let own = dir.join(id);
    std::fs::create_dir_all(&own).with_context(|| format!("mkdir {}", own.display()))?;
    let (finished_at, exit_code) = finished.unwrap_or((0, 0));
    let status = json!({"Version": "v1", "Pid": pid, "CreatedAt": 0, "StartedAt": 0, "FinishedAt": finished_at,
                        "ExitCode": exit_code, "Reason": "", "Message": "", "Resources": null, "Unknown": false});
    let tmp = own.join(".status.tmp");
    std::fs::write(&tmp, serde_json::to_vec(&status)?).with_context(|| format!("write {}", tmp.display()))?;
    std::fs::rename(&tmp, own.join("status")).with_context(|| format!("rename into {}", own.display()))
}

/// A `pause` program for sandboxes: `sleep` under the pause image's name, made once per host.
/// Tests of one process make it at once on a fresh machine: each copy has a name of its own
/// and the renames replace one another whole.
pub(super) fn pause_binary() -> Result<PathBuf> {
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
