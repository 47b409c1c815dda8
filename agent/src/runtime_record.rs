//! The container runtime's own record of a container's end, read where the runtime keeps it,
//! without its socket.
//!
//! The kubelet decides from the runtime's record of a container, never from the kernel's: a
//! native sidecar quit while the runtime still shows the app running can be recorded exited
//! first, and restarted (see `docs/dev/native-sidecars.md`). containerd's CRI plugin records an
//! exit in `Status.UpdateSync`, which under the status's write lock first writes the container's
//! status checkpoint (`<root>/io.containerd.grpc.v1.cri/containers/<id>/status`, a temporary file
//! renamed over it) and then sets the in-memory status every `ContainerStatus` and
//! `ListContainers` read, under the same lock. So once the file shows a `FinishedAt`, every CRI
//! look asked after that read sees the container EXITED: a native sidecar quit then is recorded
//! after the app, as the kubelet needs.
//!
//! The file is JSON whose status fields sit at the top level (`{"Version":"v1","Pid":…,
//! "StartedAt":…,"FinishedAt":<ns>,"ExitCode":…,…}`); the record of the end is the first version
//! with a non-zero `FinishedAt`. Only `FinishedAt` is read. CRI-O keeps no such file (conmon's
//! exit file comes before CRI-O's own record): its pods wait for the API's report.

use std::io::Read as _;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::cgroup::layout::is_container_id;
use crate::host::container_main::start_time;

/// Where the CRI plugin keeps its container records, below containerd's root.
pub const CRI_CONTAINERS: &str = "io.containerd.grpc.v1.cri/containers";
/// containerd's roots, relative to the host's root: kubeadm's (the default), k3s's and RKE2's,
/// microk8s's.
pub const WELL_KNOWN_ROOTS: [&str; 3] =
    ["var/lib/containerd", "var/lib/rancher/k3s/agent/containerd", "var/snap/microk8s/common/var/lib/containerd"];
/// The most of a status file read (they are a few hundred bytes).
const MAX_STATUS_BYTES: u64 = 64 * 1024;

/// A directory of container records (`<dir>/<id>/status`), and the process it is reached
/// through, if any (pid and start time: checked after each read, so that a reused pid never
/// leads elsewhere).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RecordDir {
    pub dir: PathBuf,
    pub through: Option<(u32, u64)>,
}

/// The record directories below `root` (a host root: the host's `/`, or a runtime process's
/// `root` link), one per well-known containerd root.
pub fn dirs_under(root: &Path, through: Option<(u32, u64)>) -> Vec<RecordDir> {
    WELL_KNOWN_ROOTS.iter().map(|r| RecordDir { dir: root.join(r).join(CRI_CONTAINERS), through }).collect()
}

/// What a runtime's record says of a container.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Record {
    /// No record of it in the directory (another runtime's, or another root).
    Absent,
    /// Recorded, its end not (or not readably) among it.
    NotEnded,
    /// The runtime has recorded its end.
    Ended,
}

#[derive(Deserialize)]
struct Status {
    #[serde(rename = "FinishedAt", default)]
    finished_at: i64,
}

/// Whether a status checkpoint's text records an end. `None`: not one (unreadable JSON).
pub fn parse_status(text: &[u8]) -> Option<bool> {
    serde_json::from_slice::<Status>(text).ok().map(|s| s.finished_at != 0)
}

/// Reads container `id`'s record in `at` (`host_proc`: where the process it is reached through
/// is checked).
pub fn read(host_proc: &Path, at: &RecordDir, id: &str) -> Record {
    // Only a container id is ever joined to a directory.
    if !is_container_id(id) {
        return Record::Absent;
    }
    let Ok(file) = std::fs::File::open(at.dir.join(id).join("status")) else { return Record::Absent };
    if let Some((pid, start)) = at.through
        && start_time(host_proc, pid) != Some(start)
    {
        return Record::Absent;
    }
    let mut text = Vec::new();
    if file.take(MAX_STATUS_BYTES).read_to_end(&mut text).is_err() {
        return Record::NotEnded;
    }
    match parse_status(&text) {
        Some(true) => Record::Ended,
        _ => Record::NotEnded,
    }
}

/// Container `id`'s record in the first of `dirs` that has one.
pub fn read_any(host_proc: &Path, dirs: &[RecordDir], id: &str) -> Record {
    dirs.iter().map(|d| read(host_proc, d, id)).find(|r| *r != Record::Absent).unwrap_or(Record::Absent)
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";

    /// containerd 1.6's checkpoint of a running container, then of the same one ended.
    const RUNNING: &str = r#"{"Version":"v1","Pid":4242,"CreatedAt":1764950000000000000,
        "StartedAt":1764950000100000000,"FinishedAt":0,"ExitCode":0,"Reason":"","Message":"",
        "Resources":null,"Unknown":false}"#;
    const ENDED: &str = r#"{"Version":"v1","Pid":4242,"CreatedAt":1764950000000000000,
        "StartedAt":1764950000100000000,"FinishedAt":1764950003200000000,"ExitCode":42,
        "Reason":"Error","Message":"","Resources":null,"Unknown":false}"#;

    /// A directory of this test's own, made anew.
    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("valet-records-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("mkdir");
        dir
    }

    fn record(dir: &Path, id: &str, text: &str) {
        std::fs::create_dir_all(dir.join(id)).expect("mkdir");
        std::fs::write(dir.join(id).join("status"), text).expect("write");
    }

    #[test]
    fn the_end_is_a_non_zero_finished_at() {
        assert_eq!(parse_status(RUNNING.as_bytes()), Some(false));
        assert_eq!(parse_status(ENDED.as_bytes()), Some(true));
        assert_eq!(parse_status(br#"{"Version":"v1"}"#), Some(false), "no FinishedAt: not ended");
        assert_eq!(parse_status(b"{\"FinishedAt\":"), None, "cut short");
        assert_eq!(parse_status(br#"{"FinishedAt":"soon"}"#), None);
    }

    #[test]
    fn a_record_is_read_in_the_first_directory_that_has_it() {
        let tmp = scratch("first");
        let host_proc = Path::new("/proc");
        let dirs = dirs_under(&tmp, None);
        assert_eq!(read_any(host_proc, &dirs, ID), Record::Absent);
        // k3s's root, the second one.
        record(&dirs[1].dir, ID, RUNNING);
        assert_eq!(read_any(host_proc, &dirs, ID), Record::NotEnded);
        record(&dirs[1].dir, ID, ENDED);
        assert_eq!(read_any(host_proc, &dirs, ID), Record::Ended);
        record(&dirs[1].dir, ID, "not json");
        assert_eq!(read_any(host_proc, &dirs, ID), Record::NotEnded, "unreadable: never taken for an end");
    }

    #[test]
    fn only_a_container_id_is_joined_to_a_directory() {
        let tmp = scratch("ids");
        let at = RecordDir { dir: tmp.join("containers"), through: None };
        record(&tmp, "containers", ENDED);
        assert_eq!(read(Path::new("/proc"), &at, ".."), Record::Absent);
        assert_eq!(read(Path::new("/proc"), &at, &ID.to_uppercase()), Record::Absent);
    }

    #[test]
    fn a_record_reached_through_a_process_that_is_gone_is_not_read() {
        let tmp = scratch("through");
        let me = std::process::id();
        let start = start_time(Path::new("/proc"), me).expect("own start time");
        let alive = RecordDir { dir: tmp.clone(), through: Some((me, start)) };
        let reused = RecordDir { through: Some((me, start + 1)), ..alive.clone() };
        record(&tmp, ID, ENDED);
        assert_eq!(read(Path::new("/proc"), &alive, ID), Record::Ended);
        assert_eq!(read(Path::new("/proc"), &reused, ID), Record::Absent, "the pid is another process now");
    }
}
