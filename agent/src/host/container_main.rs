//! The main process of a container that was already running when its pod was watched (the agent
//! restarted, or found the pod late), read from procfs, so the kernel can be told about it
//! ([`super::Programs::record_container_main`]).
//!
//! It is the process the kernel's exec program would have recorded: the first to exec in the
//! container's cgroup deeper than the host's pid namespace. Read after the fact, that is:
//! * among the cgroup's processes deeper than the host's pid namespace, those in the shallowest
//!   namespace (fewest `NSpid` entries): the container's own namespace or the pod's shared one.
//!   Deeper ones are sandboxes the app made (Chromium, bwrap, `unshare -p`);
//! * among those, pid 1 of that namespace when there is one (a container with a pid namespace of
//!   its own);
//! * otherwise (shareProcessNamespace: the pod's pid 1 is the sandbox's pause, in another
//!   cgroup) the oldest by start time (`/proc/<pid>/stat` field 22), lowest pid on a tie.
//!
//! Runtime helpers that run in the host's namespace (runc, conmon) are never candidates.

use std::path::Path;

use crate::error::{Error, Result};

/// A container's main process as seen from the host's pid namespace (the procfs given).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MainProcess {
    /// Pid in the host's pid namespace.
    pub tgid: u32,
    /// How many pid namespaces below the host's it lives (1 for a container's own namespace).
    pub ns_depth: u32,
    /// Pid 1 of its namespace.
    pub ns_init: bool,
    /// Inode number of its pid namespace (`/proc/<pid>/ns/pid`); 0 when unreadable.
    pub pidns_inum: u32,
    /// Start time in clock ticks after boot (`/proc/<pid>/stat` field 22).
    pub start_ticks: u64,
}

/// What procfs says about one process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ProcInfo {
    pub pid: u32,
    /// `NSpid` of `/proc/<pid>/status`: its pid in each namespace, the host's first.
    pub nspid: Vec<u32>,
    pub start_ticks: u64,
    pub pidns_inum: u32,
}

/// Chooses the main process among a container cgroup's processes (see the module docs).
pub fn choose_main(procs: &[ProcInfo]) -> Option<MainProcess> {
    let depth = procs.iter().filter(|p| p.nspid.len() >= 2).map(|p| p.nspid.len()).min()?;
    let shallowest = procs.iter().filter(|p| p.nspid.len() == depth);
    let init = shallowest.clone().find(|p| p.nspid.last() == Some(&1));
    let main = init.or_else(|| shallowest.min_by_key(|p| (p.start_ticks, p.pid)))?;
    Some(MainProcess {
        tgid: main.pid,
        ns_depth: depth as u32 - 1,
        ns_init: init.is_some(),
        pidns_inum: main.pidns_inum,
        start_ticks: main.start_ticks,
    })
}

/// A process's start time (`/proc/<pid>/stat` field 22, clock ticks since boot).
pub fn start_time(host_proc: &Path, pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(host_proc.join(pid.to_string()).join("stat")).ok()?;
    super::proc::stat_field(&stat, 22)?.parse().ok()
}

/// Reads one process from procfs; `None` when it is gone or unreadable (it raced its exit).
pub fn read_process(host_proc: &Path, pid: u32) -> Option<ProcInfo> {
    let dir = host_proc.join(pid.to_string());
    let status = std::fs::read_to_string(dir.join("status")).ok()?;
    let nspid = super::proc::nspid(&status)?;
    if nspid.first() != Some(&pid) {
        return None;
    }
    let start_ticks = start_time(host_proc, pid)?;
    let pidns_inum = std::fs::read_link(dir.join("ns/pid"))
        .ok()
        .and_then(|link| {
            let link = link.to_str()?.to_owned();
            link.strip_prefix("pid:[")?.strip_suffix(']')?.parse().ok()
        })
        .unwrap_or(0);
    Some(ProcInfo { pid, nspid, start_ticks, pidns_inum })
}

/// Finds the main process of the container whose cgroup directory is `cgroup_dir`, from its
/// `cgroup.procs` and `host_proc` (the host's procfs, as the agent sees it with hostPID).
/// `Ok(None)`: no process deeper than the host's pid namespace (empty, or runtime helpers only).
pub fn find_container_main(host_proc: &Path, cgroup_dir: &Path) -> Result<Option<MainProcess>> {
    let path = cgroup_dir.join("cgroup.procs");
    let text = std::fs::read_to_string(&path).map_err(|e| Error::io(format!("read {}", path.display()), e))?;
    let pids: Vec<u32> = text.lines().filter_map(|l| l.trim().parse().ok()).collect();
    Ok(main_among(host_proc, &pids))
}

/// The main process among a container's processes, wherever they sit in its cgroup subtree (crun
/// runs them one level below the container's cgroup; a main process may move deeper).
pub fn main_among(host_proc: &Path, pids: &[u32]) -> Option<MainProcess> {
    let procs: Vec<ProcInfo> = pids.iter().filter_map(|pid| read_process(host_proc, *pid)).collect();
    choose_main(&procs)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake procfs and cgroup in a temporary directory.
    struct Fake {
        root: std::path::PathBuf,
    }

    impl Fake {
        fn new(name: &str) -> Fake {
            let root = std::env::temp_dir().join(format!("valet-main-{name}-{}", std::process::id()));
            let _ = std::fs::remove_dir_all(&root);
            std::fs::create_dir_all(root.join("proc")).expect("mkdir");
            std::fs::create_dir_all(root.join("cg")).expect("mkdir");
            Fake { root }
        }

        fn proc(&self) -> std::path::PathBuf {
            self.root.join("proc")
        }

        fn cg(&self) -> std::path::PathBuf {
            self.root.join("cg")
        }

        /// A process with these `NSpid` entries (the host's first) and start time.
        fn add(&self, nspid: &[u32], start: u64, comm: &str) {
            let pid = nspid[0];
            let dir = self.proc().join(pid.to_string());
            std::fs::create_dir_all(dir.join("ns")).expect("mkdir");
            let ns: Vec<String> = nspid.iter().map(u32::to_string).collect();
            std::fs::write(dir.join("status"), format!("Name:\t{comm}\nNSpid:\t{}\nNSpgid:\t1\n", ns.join("\t")))
                .expect("status");
            // Fields 3..=21 filled with placeholders, field 22 = start time.
            let mut fields = vec!["S".to_owned()];
            fields.extend((4..22).map(|n| n.to_string()));
            fields.push(start.to_string());
            fields.extend(["999".to_owned(), "0".to_owned()]);
            std::fs::write(dir.join("stat"), format!("{pid} ({comm}) {}\n", fields.join(" "))).expect("stat");
            std::os::unix::fs::symlink(format!("pid:[{}]", 4026531000 + nspid.len() as u32), dir.join("ns/pid"))
                .expect("symlink");
        }

        fn procs(&self, pids: &[u32]) {
            let text: String = pids.iter().map(|p| format!("{p}\n")).collect();
            std::fs::write(self.cg().join("cgroup.procs"), text).expect("procs");
        }

        fn find(&self) -> Option<MainProcess> {
            find_container_main(&self.proc(), &self.cg()).expect("find")
        }
    }

    impl Drop for Fake {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.root);
        }
    }

    #[test]
    fn own_pid_namespace_main_is_its_init_not_a_nested_sandbox_init() {
        let f = Fake::new("own");
        // runc-1.2-style helper in the host namespace, the container's init, its child, and a
        // nested sandbox (pid 1 of a deeper namespace) started before everything else's child.
        f.add(&[900], 10, "runc:[2:INIT]");
        f.add(&[1000, 1], 50, "app");
        f.add(&[1001, 7], 60, "worker");
        f.add(&[1002, 8, 1], 55, "chrome-sandbox");
        f.procs(&[900, 1002, 1001, 1000]);
        let main = f.find().expect("main");
        assert_eq!(main.tgid, 1000);
        assert_eq!(main.ns_depth, 1);
        assert!(main.ns_init);
        assert_eq!(main.pidns_inum, 4026531002);
        assert_eq!(main.start_ticks, 50);
    }

    #[test]
    fn shared_pid_namespace_main_is_the_oldest_at_the_shallowest_depth() {
        let f = Fake::new("shared");
        // The pod's pid 1 (pause) lives in the sandbox cgroup, not here.
        f.add(&[2003, 14], 80, "child");
        f.add(&[2001, 12], 70, "app");
        f.add(&[2002, 13], 70, "app-twin");
        f.add(&[2004, 15, 1], 60, "nested");
        f.procs(&[2003, 2002, 2004, 2001]);
        let main = f.find().expect("main");
        assert_eq!(main.tgid, 2001, "oldest, lowest pid on a tie");
        assert!(!main.ns_init);
        assert_eq!(main.ns_depth, 1);
    }

    #[test]
    fn kind_node_levels_are_relative_to_the_procfs_given() {
        // On a kind node the agent's procfs is the node's: a container is one level below it,
        // whatever the kernel's absolute level.
        let f = Fake::new("kind");
        f.add(&[300, 1], 5, "app");
        f.procs(&[300]);
        assert_eq!(f.find().map(|m| (m.tgid, m.ns_depth)), Some((300, 1)));
    }

    #[test]
    fn nothing_deeper_than_the_host_is_no_main() {
        let f = Fake::new("none");
        f.add(&[400], 5, "runc");
        f.procs(&[400, 401]);
        assert_eq!(f.find(), None, "host-namespace helpers and vanished pids are no main");
        f.procs(&[]);
        assert_eq!(f.find(), None);
    }

    #[test]
    fn garbage_is_skipped_and_a_missing_cgroup_is_an_error() {
        let f = Fake::new("garbage");
        let dir = f.proc().join("500");
        std::fs::create_dir_all(&dir).expect("mkdir");
        std::fs::write(dir.join("status"), "NSpid:\tnot-a-pid\n").expect("write");
        std::fs::write(dir.join("stat"), "500 (x y) S").expect("write");
        let dir = f.proc().join("501");
        std::fs::create_dir_all(&dir).expect("mkdir");
        std::fs::write(dir.join("status"), "NSpid:\t501\t1\n").expect("write");
        std::fs::write(dir.join("stat"), "501 (x) y) S 1").expect("write");
        f.add(&[502, 2], 9, "ok (really)");
        f.procs(&[500, 501, 502]);
        assert_eq!(f.find().map(|m| m.tgid), Some(502));
        assert!(find_container_main(&f.proc(), &f.root.join("missing")).is_err());
    }

    #[test]
    fn reads_a_real_process() {
        let me = std::process::id();
        let info = read_process(Path::new("/proc"), me).expect("own process");
        assert_eq!(info.nspid.first(), Some(&me));
        assert!(info.start_ticks > 0);
        assert!(info.pidns_inum > 0);
    }
}
