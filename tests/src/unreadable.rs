//! A held app's cgroup made unreadable to valet (as a container's own root may make its delegated
//! cgroup): the crash test's read faults and the restart test that reproduces what they found.

use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};

/// A cgroup directory made unreadable, and what to put back.
pub struct Unreadable {
    dir: PathBuf,
    uid: u32,
    gid: u32,
    mode: u32,
}

impl Unreadable {
    /// The cgroup of `pid` owned by another uid, mode 0700, as a container's own root (its
    /// cgroup delegated to it, as a user-namespaced pod's is) may make it. valet runs as uid 0
    /// without `CAP_DAC_OVERRIDE` (the manifest's capabilities), so its reads there fail with
    /// EACCES; it can still stat the directory (its id).
    pub fn make(cgroup_root: &Path, pid: u32) -> Option<Unreadable> {
        let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
        let rel = text.lines().find_map(|l| l.strip_prefix("0::"))?;
        let dir = cgroup_root.join(rel.trim_start_matches('/'));
        let m = std::fs::metadata(&dir).ok()?;
        let saved = Unreadable { dir, uid: m.uid(), gid: m.gid(), mode: m.mode() & 0o7777 };
        std::os::unix::fs::chown(&saved.dir, Some(65534), Some(65534)).ok()?;
        std::fs::set_permissions(&saved.dir, std::fs::Permissions::from_mode(0o700)).ok()?;
        Some(saved)
    }

    /// Readable again, as it was.
    pub fn restore(self) {
        // The cgroup may be gone with its pod meanwhile.
        let _ = std::os::unix::fs::chown(&self.dir, Some(self.uid), Some(self.gid));
        let _ = std::fs::set_permissions(&self.dir, std::fs::Permissions::from_mode(self.mode));
    }
}
