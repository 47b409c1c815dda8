//! The host's cgroup fs made read-only in the process's own mount namespace (`--cgroup-read-only`).
//!
//! A hostPath with `readOnly: true` is bound recursively by the runtime, and only its top mount
//! is remounted read-only. On a v2 node that is the whole cgroup fs; on v1 and hybrid nodes the
//! controllers' mounts below it (and hybrid's `unified/`) stay writable: a container could rewrite
//! any pod's limits, move processes, or write a v1 `release_agent`. `recursiveReadOnly` closes
//! that only where the runtime can (containerd 2.0+, CRI-O 1.30+, Kubernetes 1.31+). So both of
//! the DaemonSet's containers make every mount at and below their view of `/sys/fs/cgroup`
//! read-only themselves, first thing at start. What changes is a per-mount flag in the
//! container's own mount namespace: a bind remount changes one mount, not its file system, and a
//! remount does not propagate, so the host and other containers keep theirs as they are.
//!
//! The host's own `/sys/fs/cgroup` is refused: a process run on the host itself (tests, a demo)
//! shares the host's mount namespace, where the flag would reach systemd and the runtime.

use std::io;
use std::path::{Path, PathBuf};

use nix::mount::MsFlags;

use crate::host::proc::unescape_octal;
use crate::host::sys;

/// The kernel's number for CAP_SYS_ADMIN.
pub const CAP_SYS_ADMIN: u32 = 21;

/// One mount at or below the top, from mountinfo.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MountEntry {
    /// Where it is mounted.
    pub point: PathBuf,
    /// Its own (per-mount) flags say `ro`.
    pub read_only: bool,
    /// Its own flags besides `ro`/`rw`, kept by a bind remount.
    pub kept: MsFlags,
}

/// What [`make_read_only`] found and did.
#[derive(Debug)]
pub struct Outcome {
    /// Mounts at and below the top.
    pub mounts: usize,
    /// Of those, made read-only now.
    pub changed: usize,
    /// How: `mount_setattr` (one recursive call), `remount` (one bind remount per mount), or
    /// `none` (nothing was writable).
    pub how: &'static str,
    /// Mounts still writable after (why, in `error`).
    pub writable: Vec<PathBuf>,
    /// The error of the last way tried, when mounts stay writable.
    pub error: Option<String>,
}

/// The flags a bind remount must keep, from a mount's own options (`rw,nosuid,nodev,relatime`).
fn kept_flags(options: &str) -> MsFlags {
    options.split(',').fold(MsFlags::empty(), |flags, o| {
        flags
            | match o {
                "nosuid" => MsFlags::MS_NOSUID,
                "nodev" => MsFlags::MS_NODEV,
                "noexec" => MsFlags::MS_NOEXEC,
                "noatime" => MsFlags::MS_NOATIME,
                "nodiratime" => MsFlags::MS_NODIRATIME,
                "relatime" => MsFlags::MS_RELATIME,
                "strictatime" => MsFlags::MS_STRICTATIME,
                _ => MsFlags::empty(),
            }
    })
}

/// The mounts at `top` and below it in mountinfo text, one per mount point: where several are
/// stacked on one point, the last listed (the one on top, the only one a path reaches).
pub fn mounts_under(mountinfo: &str, top: &Path) -> Vec<MountEntry> {
    let mut found: Vec<MountEntry> = Vec::new();
    for line in mountinfo.lines() {
        let fields: Vec<&str> = line.split(' ').collect();
        let (Some(point), Some(options)) = (fields.get(4), fields.get(5)) else { continue };
        let point = PathBuf::from(unescape_octal(point));
        if !point.starts_with(top) {
            continue;
        }
        let entry = MountEntry { read_only: options.split(',').any(|o| o == "ro"), kept: kept_flags(options), point };
        match found.iter_mut().find(|e| e.point == entry.point) {
            Some(stacked) => *stacked = entry,
            None => found.push(entry),
        }
    }
    found
}

/// Makes every mount at and below `top` read-only in this process's mount namespace: one
/// recursive `mount_setattr`, or where that is refused (kernels before 5.12, a seccomp profile
/// without it) a bind remount of each writable mount. Needs CAP_SYS_ADMIN; without it the mounts
/// stay writable and the outcome says so. An error only when nothing can be tried: `top` is the
/// host's own cgroup mount, or no mount is there.
pub fn make_read_only(top: &Path) -> Result<Outcome, String> {
    let canonical = std::fs::canonicalize(top).map_err(|e| format!("{}: {e}", top.display()))?;
    if canonical == Path::new("/sys/fs/cgroup") {
        return Err(format!(
            "{} is the host's own cgroup mount when run on the host: left as it is (the flag is for \
             the DaemonSet's containers, which see the host's cgroup fs at /host/sys/fs/cgroup)",
            top.display()
        ));
    }
    let read = || std::fs::read_to_string("/proc/self/mountinfo").map(|text| mounts_under(&text, &canonical));
    let before = read().map_err(|e| format!("/proc/self/mountinfo: {e}"))?;
    if before.is_empty() {
        return Err(format!("no mount at or below {}", canonical.display()));
    }
    let writable: Vec<&MountEntry> = before.iter().filter(|m| !m.read_only).collect();
    if writable.is_empty() {
        return Ok(Outcome { mounts: before.len(), changed: 0, how: "none", writable: vec![], error: None });
    }
    let (how, error) = match sys::mount_setattr_read_only(&canonical) {
        Ok(()) => ("mount_setattr", None),
        Err(first) => {
            let remount = MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY;
            // Every writable mount is tried, whatever the others gave.
            let failed: Vec<String> = writable
                .iter()
                .filter_map(|m| {
                    nix::mount::mount(None::<&str>, &m.point, None::<&str>, remount | m.kept, None::<&str>)
                        .err()
                        .map(|e| format!("{}: {e}", m.point.display()))
                })
                .collect();
            ("remount", failed.last().map(|e| format!("mount_setattr: {first}; bind remount of {e}")))
        }
    };
    let after = read().map_err(|e| format!("/proc/self/mountinfo: {e}"))?;
    let still: Vec<PathBuf> = after.iter().filter(|m| !m.read_only).map(|m| m.point.clone()).collect();
    Ok(Outcome {
        mounts: after.len(),
        changed: writable.len() - still.len().min(writable.len()),
        how,
        error,
        writable: still,
    })
}

/// Whether the calling thread's effective or permitted set holds capability `cap`, from
/// `/proc/thread-self/status`.
pub fn holds_capability(cap: u32) -> io::Result<bool> {
    let status = std::fs::read_to_string("/proc/thread-self/status")?;
    let set = |name: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(name))
            .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
            .ok_or_else(|| io::Error::other(format!("no {name} in /proc/thread-self/status")))
    };
    let bit = 1u64 << cap;
    Ok(set("CapEff:")? & bit != 0 || set("CapPrm:")? & bit != 0)
}

/// Gives CAP_SYS_ADMIN up for the calling thread and the threads it makes after, and checks
/// that it is gone. For the deadline keeper, which needs it only for [`make_read_only`].
pub fn give_up_sys_admin() -> io::Result<()> {
    sys::drop_capability(CAP_SYS_ADMIN)?;
    if holds_capability(CAP_SYS_ADMIN)? {
        return Err(io::Error::other("CAP_SYS_ADMIN is still held after capset"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const HYBRID: &str = "\
25 1 0:23 / / rw,relatime - overlay overlay rw
30 25 0:26 / /host/sys/fs/cgroup ro,nosuid,nodev,noexec - tmpfs tmpfs ro,mode=755
31 30 0:27 / /host/sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime - cgroup2 cgroup2 rw
32 30 0:28 / /host/sys/fs/cgroup/memory rw,nosuid,nodev,noexec,relatime - cgroup cgroup rw,memory
33 30 0:29 / /host/sys/fs/cgroup/cpu,cpuacct rw,nosuid,nodev,noexec,relatime - cgroup cgroup rw,cpu,cpuacct
34 25 0:30 / /host/sys/fs/cgroupx rw - tmpfs tmpfs rw
35 30 0:31 / /host/sys/fs/cgroup/with\\040space ro,relatime - cgroup cgroup rw,pids
";

    #[test]
    fn lists_every_mount_at_and_below_the_top_with_its_own_flags() {
        let found = mounts_under(HYBRID, Path::new("/host/sys/fs/cgroup"));
        let points: Vec<&str> = found.iter().map(|m| m.point.to_str().expect("utf-8")).collect();
        assert_eq!(
            points,
            [
                "/host/sys/fs/cgroup",
                "/host/sys/fs/cgroup/unified",
                "/host/sys/fs/cgroup/memory",
                "/host/sys/fs/cgroup/cpu,cpuacct",
                "/host/sys/fs/cgroup/with space"
            ],
            "a sibling with the same prefix (cgroupx) is not below the top"
        );
        let writable: Vec<bool> = found.iter().map(|m| !m.read_only).collect();
        assert_eq!(writable, [false, true, true, true, false], "the mount's own flags, not the file system's");
        assert_eq!(found[1].kept, MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC | MsFlags::MS_RELATIME);
    }

    #[test]
    fn of_mounts_stacked_on_one_point_the_top_one_counts() {
        let stacked = "\
30 25 0:26 / /host/sys/fs/cgroup ro - tmpfs tmpfs ro
31 30 0:27 / /host/sys/fs/cgroup/memory ro - cgroup cgroup rw,memory
40 31 0:27 / /host/sys/fs/cgroup/memory rw - cgroup cgroup rw,memory
";
        let found = mounts_under(stacked, Path::new("/host/sys/fs/cgroup"));
        assert_eq!(found.len(), 2);
        assert!(!found[1].read_only, "the mount on top is writable, whatever lies under it");
    }

    #[test]
    fn the_hosts_own_cgroup_mount_is_refused() {
        let read = || {
            mounts_under(
                &std::fs::read_to_string("/proc/self/mountinfo").expect("mountinfo"),
                Path::new("/sys/fs/cgroup"),
            )
        };
        let before = read();
        let refused = make_read_only(Path::new("/sys/fs/cgroup")).expect_err("never on the host's own mount");
        assert!(refused.contains("host's own cgroup mount"), "{refused}");
        assert_eq!(read(), before, "the host's cgroup mounts are as they were");
    }

    #[test]
    fn a_capability_not_held_reads_so() {
        // Bit 63 is no capability: never held by anyone.
        assert!(!holds_capability(63).expect("status"));
    }
}
