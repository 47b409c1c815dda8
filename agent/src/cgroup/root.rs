//! Finds the cgroup v2 mount: `/sys/fs/cgroup` on nodes, `/sys/fs/cgroup/unified` on hybrid hosts.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// Parses `/proc/self/mountinfo` text and returns the first cgroup2 mount point.
pub fn cgroup2_mount_from_mountinfo(mountinfo: &str) -> Option<PathBuf> {
    mountinfo.lines().find_map(|line| {
        // Fields: id parent major:minor root mountpoint options [optional...] - fstype source opts
        let (left, right) = line.split_once(" - ")?;
        let fstype = right.split_whitespace().next()?;
        if fstype != "cgroup2" {
            return None;
        }
        let mount_point = left.split_whitespace().nth(4)?;
        Some(PathBuf::from(unescape_octal(mount_point)))
    })
}

/// mountinfo escapes space, tab, newline and backslash as `\ooo`.
fn unescape_octal(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        // Only `\000`..`\377` are escapes (one byte); anything else is kept as it is.
        if bytes[i] == b'\\'
            && i + 3 < bytes.len()
            && (b'0'..=b'3').contains(&bytes[i + 1])
            && bytes[i + 2..i + 4].iter().all(|b| (b'0'..=b'7').contains(b))
        {
            let v = (bytes[i + 1] - b'0') * 64 + (bytes[i + 2] - b'0') * 8 + (bytes[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The cgroup2 root to use. An explicit `configured` path wins (a host mount inside the agent's
/// container); otherwise the mount table of this process, read under `host_proc`.
pub fn find_cgroup2_root(configured: Option<&Path>, host_proc: &Path) -> Result<PathBuf> {
    if let Some(path) = configured {
        if path.join("cgroup.procs").exists() {
            return Ok(path.to_path_buf());
        }
        return Err(Error::Cgroup(format!("{} is not a cgroup v2 root (no cgroup.procs)", path.display())));
    }
    let mountinfo_path = host_proc.join("self/mountinfo");
    let text = std::fs::read_to_string(&mountinfo_path)
        .map_err(|e| Error::io(format!("read {}", mountinfo_path.display()), e))?;
    cgroup2_mount_from_mountinfo(&text)
        .ok_or_else(|| Error::Cgroup("no cgroup2 mount found (valet needs cgroup v2 on the node)".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_unified_and_hybrid_mounts() {
        let node =
            "30 23 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate\n";
        assert_eq!(cgroup2_mount_from_mountinfo(node), Some(PathBuf::from("/sys/fs/cgroup")));
        let hybrid = "25 24 0:22 / /sys/fs/cgroup ro,nosuid shared:5 - tmpfs tmpfs ro,mode=755\n\
            26 25 0:23 / /sys/fs/cgroup/unified rw,nosuid,nodev,noexec,relatime shared:6 - cgroup2 cgroup2 rw\n\
            27 25 0:24 / /sys/fs/cgroup/cpu rw shared:7 - cgroup cgroup rw,cpu\n";
        assert_eq!(cgroup2_mount_from_mountinfo(hybrid), Some(PathBuf::from("/sys/fs/cgroup/unified")));
        let v1_only = "27 25 0:24 / /sys/fs/cgroup/cpu rw shared:7 - cgroup cgroup rw,cpu\n";
        assert_eq!(cgroup2_mount_from_mountinfo(v1_only), None);
        let escaped = "30 23 0:26 / /host/with\\040space rw - cgroup2 cgroup2 rw\n";
        assert_eq!(cgroup2_mount_from_mountinfo(escaped), Some(PathBuf::from("/host/with space")));
        assert_eq!(cgroup2_mount_from_mountinfo("garbage\n - \n"), None);
    }

    #[test]
    fn an_escape_above_a_byte_is_kept_not_an_overflow() {
        // Found by the fuzz target mountinfo (fuzz/artifacts/mountinfo/crash-895fc471...):
        // `\771` overflowed the byte it was decoded into (a panic in debug builds).
        let crash =
            b"25 s/cgr\xf0up\xcbcpu rw share\ndw,cpu\n30 23 0:26 / /hoct/,ith\\771space rw - cgroup2 cgroup2 rw\n";
        let text = String::from_utf8_lossy(crash);
        assert_eq!(cgroup2_mount_from_mountinfo(&text), Some(PathBuf::from("/hoct/,ith\\771space")));
        let top = "30 23 0:26 / /a\\377b rw - cgroup2 cgroup2 rw\n";
        assert_eq!(cgroup2_mount_from_mountinfo(top), Some(PathBuf::from("/a\u{fffd}b")));
    }

    #[test]
    fn finds_this_hosts_root() {
        let root = find_cgroup2_root(None, Path::new("/proc")).expect("cgroup2 mounted");
        assert!(root.join("cgroup.procs").exists());
    }
}
