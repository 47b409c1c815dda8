//! Signals to processes identified through cgroups, safe against pid reuse: the pid is pinned
//! with a pidfd first, then its cgroup is checked, then the signal goes through the pidfd.

use super::tree::CgroupFs;
use crate::error::{Error, Result};
use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};

fn pidfd_open(pid: u32) -> std::io::Result<OwnedFd> {
    // SAFETY: plain syscall; a non-negative return is a new fd we own.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: fd is valid and owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

fn pidfd_send_signal(fd: &OwnedFd, signal: i32) -> std::io::Result<()> {
    // SAFETY: plain syscall on a valid pidfd.
    let r = unsafe {
        libc::syscall(libc::SYS_pidfd_send_signal, fd.as_raw_fd(), signal, std::ptr::null::<libc::siginfo_t>(), 0)
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

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
        let mut poll = libc::pollfd { fd: self.fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd, no wait.
        unsafe { libc::poll(&mut poll, 1, 0) == 1 }
    }

    pub fn signal(&self, signal: i32) -> Result<()> {
        pidfd_send_signal(&self.fd, signal).map_err(|e| Error::io(format!("signal {signal} to pid {}", self.pid), e))
    }
}

/// Pins `pid` if it lives in cgroup `rel` or below (the check of [`signal_in_cgroup`], apart
/// from the signal: a batch of releases checks them all, then signals them back to back).
pub fn pin_in_cgroup(cgroups: &CgroupFs, pid: u32, rel: &str) -> Result<Pinned> {
    let fd = pidfd_open(pid).map_err(|e| Error::io(format!("pidfd_open({pid})"), e))?;
    // The cgroup itself first (a container's main process lives there): the walk below it reads
    // a directory per level, which a release of a held app should not wait for.
    if !cgroups.procs(rel).contains(&pid) && !cgroups.procs_recursive(rel).contains(&pid) {
        return Err(Error::Cgroup(format!("pid {pid} is not in {rel}: not signalled")));
    }
    Ok(Pinned { pid, fd })
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
