//! Signals to processes identified through cgroups, safe against pid reuse: the pid is pinned
//! with a pidfd first, then its cgroup is checked, then the signal goes through the pidfd.

use super::tree::{CgroupFs, Search, cgroup_of_pid};
use crate::error::{Error, Result};
use std::os::fd::{AsFd as _, OwnedFd};
use std::path::Path;

use crate::host::sys::{pidfd_open, pidfd_send_signal};

/// Sends `signal` to `pid` only if it (still) lives in cgroup `rel` or below.
///
/// Membership is read from the cgroup's own `cgroup.procs` files (host pids, with hostPID), not
/// from `/proc/<pid>/cgroup`, whose paths are relative to the agent's cgroup namespace.
pub fn signal_in_cgroup(cgroups: &CgroupFs, pid: u32, rel: &str, signal: i32) -> Result<()> {
    pin_in_cgroup(cgroups, pid, rel)?.signal(signal)
}

/// A process pinned by a pidfd after its cgroup was checked: a signal through it reaches that
/// process or none, whenever it is sent.
pub struct Pinned {
    pid: u32,
    fd: OwnedFd,
}

impl Pinned {
    /// Whether the process has exited (its pidfd turns readable).
    pub fn exited(&self) -> bool {
        crate::host::sys::ready_now(self.fd.as_fd(), libc::POLLIN)
    }

    pub fn signal(&self, signal: i32) -> Result<()> {
        pidfd_send_signal(self.fd.as_fd(), signal)
            .map_err(|e| Error::io(format!("signal {signal} to pid {}", self.pid), e))
    }
}

/// Pins `pid`, wherever it lives (the caller checks what it must of the process pinned).
pub fn pin_pid(pid: u32) -> Result<Pinned> {
    let fd = pidfd_open(pid).map_err(|e| Error::io(format!("pidfd_open({pid})"), e))?;
    Ok(Pinned { pid, fd })
}

/// Most cgroups read to tell whether a process lives in one or below it (a container's are a
/// handful; a node's whole tree a few thousand).
const MEMBERSHIP_BUDGET: usize = 4096;

/// Pins `pid` if it lives in cgroup `rel` or below (the check of [`signal_in_cgroup`], apart
/// from the signal: a batch of releases checks them all, then signals them back to back).
pub fn pin_in_cgroup(cgroups: &CgroupFs, pid: u32, rel: &str) -> Result<Pinned> {
    match place_in_cgroup(cgroups, pid, rel) {
        Placed::In(pinned) => Ok(pinned),
        Placed::Elsewhere(why) | Placed::Unsure(why) => Err(Error::Cgroup(format!("{why}: not signalled"))),
    }
}

/// [`pin_in_cgroup`] that tells a process proven gone or elsewhere from one that could not be
/// placed (a read error).
pub fn place_in_cgroup(cgroups: &CgroupFs, pid: u32, rel: &str) -> Placed {
    let pinned = match pin_pid_placed(pid) {
        Ok(pinned) => pinned,
        Err(placed) => return placed,
    };
    place_pinned(cgroups, pinned, rel)
}

/// Whether process `pinned` (pinned earlier, and not exited: its pid is still its own) lives in
/// cgroup `rel` or below: [`place_in_cgroup`] for a process pinned before its cgroup could be
/// read.
pub fn place_pinned(cgroups: &CgroupFs, pinned: Pinned, rel: &str) -> Placed {
    let pid = pinned.pid;
    // The cgroup itself first (a container's main process lives there): the walk below it reads
    // a directory per level, which a release of a held app should not wait for.
    if cgroups.procs(rel).contains(&pid) {
        return Placed::In(pinned);
    }
    match cgroups.holds(rel, pid, MEMBERSHIP_BUDGET) {
        Ok(true) => Placed::In(pinned),
        Ok(false) => Placed::Elsewhere(format!("pid {pid} is not in {rel}")),
        Err(why) => Placed::Unsure(why),
    }
}

/// Where [`pin_in_cgroup_id`] (or [`place_in_cgroup`]) found a process.
pub enum Placed {
    /// Pinned, and it lives in the cgroup with the recorded id (or below it).
    In(Pinned),
    /// Proven gone, or another process has its pid (it lives outside that cgroup, or the cgroup
    /// is gone): its record names no one any more. Says which.
    Elsewhere(String),
    /// Cannot tell now (a read error, or a search out of budget): ask again later, and keep its
    /// record.
    Unsure(String),
}

/// Pins `pid`, wherever it lives; a pid no process has is [`Placed::Elsewhere`], any other
/// failure [`Placed::Unsure`].
pub fn pin_pid_placed(pid: u32) -> std::result::Result<Pinned, Placed> {
    match pidfd_open(pid) {
        Ok(fd) => Ok(Pinned { pid, fd }),
        Err(e) if e.raw_os_error() == Some(libc::ESRCH) => Err(Placed::Elsewhere(format!("pid {pid} is gone"))),
        Err(e) => Err(Placed::Unsure(format!("pidfd_open({pid}): {e}"))),
    }
}

/// Pins `pid` first, then checks that it lives in the cgroup whose id is `cgroup_id` (the one a
/// [`valet_common::HeldRecord`] names) or below it: a signal through the result reaches the
/// process that was held, or none. The process's own `/proc/<pid>/cgroup` path is tried first
/// (a lookup, no search); where that path is not under this agent's cgroup root (another cgroup
/// namespace) the tree is searched, within `budget` directories. Only what is proven makes
/// [`Placed::Elsewhere`]: a read error anywhere is [`Placed::Unsure`].
pub fn pin_in_cgroup_id(cgroups: &CgroupFs, host_proc: &Path, pid: u32, cgroup_id: u64, budget: usize) -> Placed {
    let pinned = match pin_pid_placed(pid) {
        Ok(pinned) => pinned,
        Err(placed) => return placed,
    };
    if let Some(path) = cgroup_of_pid(host_proc, pid).filter(|p| p.starts_with('/') && !p.starts_with("/..")) {
        // The process's cgroup and its ancestors, deepest first. No match proves nothing (the
        // path may be relative to another root than ours): the search below decides then.
        let mut rel = path.as_str();
        loop {
            match cgroups.id_of(rel) {
                Ok(id) if id == cgroup_id => return Placed::In(pinned),
                Ok(_) => {}
                Err(_) => break,
            }
            match rel.rfind('/') {
                Some(0) if rel.len() > 1 => rel = "/",
                Some(i) if i > 0 => rel = &rel[..i],
                _ => break,
            }
        }
    }
    match cgroups.search_by_id(cgroup_id, "/", budget) {
        Search::Found(rel) => match cgroups.holds(&rel, pid, budget) {
            Ok(true) => Placed::In(pinned),
            Ok(false) => Placed::Elsewhere(format!("pid {pid} is not in cgroup {cgroup_id} ({rel})")),
            Err(why) => Placed::Unsure(why),
        },
        Search::Gone => Placed::Elsewhere(format!("cgroup {cgroup_id} is gone")),
        Search::Unsure => Placed::Unsure(format!("the search for cgroup {cgroup_id} could not finish")),
    }
}

/// Sends `signal` to every process in cgroup `rel` and below; returns how many were signalled.
pub fn signal_cgroup(cgroups: &CgroupFs, rel: &str, signal: i32) -> usize {
    cgroups.procs_recursive(rel).into_iter().filter(|pid| signal_in_cgroup(cgroups, *pid, rel, signal).is_ok()).count()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cgroup::cgroup_of_pid;
    use crate::cgroup::root::find_cgroup2_root;

    #[test]
    fn a_pinned_process_that_exits_says_so() {
        let root = find_cgroup2_root(None, std::path::Path::new("/proc")).expect("cgroup2");
        let cgroups = CgroupFs::new(root);
        let mut child = std::process::Command::new("sleep").arg("30").spawn().expect("spawn");
        let own = cgroup_of_pid(std::path::Path::new("/proc"), child.id()).expect("its cgroup");
        let pinned = pin_in_cgroup(&cgroups, child.id(), &own).expect("pin");
        assert!(!pinned.exited(), "running");
        let _ = child.kill();
        let _ = child.wait();
        assert!(pinned.exited(), "exited and reaped");
        assert!(pinned.signal(libc::SIGCONT).is_err(), "a signal to it reaches nobody");
    }

    #[test]
    fn refuses_a_process_outside_the_cgroup() {
        let root = find_cgroup2_root(None, std::path::Path::new("/proc")).expect("cgroup2");
        let cgroups = CgroupFs::new(root);
        let me = std::process::id();
        let err = signal_in_cgroup(&cgroups, me, "/kubepods.slice/not-me", 0);
        assert!(err.is_err(), "must not signal a process of another cgroup");
        let own = cgroup_of_pid(std::path::Path::new("/proc"), me).expect("own cgroup");
        signal_in_cgroup(&cgroups, me, &own, 0).expect("signal 0 to self in own cgroup");
    }
}
