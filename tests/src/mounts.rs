//! A v1 or hybrid node's cgroup fs as a runtime without recursive read-only mounts binds a
//! `readOnly` hostPath of it (containerd before 2.0, CRI-O before 1.30): recursively (`rbind`),
//! its top mount alone remounted read-only; made in a process's own mount namespace. And what a
//! process sees of it: its mounts there, with their own flags, and which writes succeed.

use std::path::{Path, PathBuf};

/// A wrapper (for `Node::start_deadline_keeper_under` and the like) that runs the process in a
/// private mount namespace with `VALET_CGROUP_MOUNT=view` and `VALET_CGROUP_READ_ONLY=true`, and
/// then through `inner` (e.g. `setpriv` with capabilities). At `view`, the layout a v1 or hybrid
/// node's `/sys/fs/cgroup` has, as containerd 1.6 binds a `readOnly` hostPath of it: a tmpfs whose
/// own mount is read-only, with the host's cgroup fs bound (recursively, writable) at `unified/`
/// below it. The same layout on any host (a guest without systemd has no cgroup directory to
/// mount on), and nothing of it outside that namespace.
pub fn bound_top_read_only(view: &Path, inner: &[String]) -> Vec<String> {
    let script = "v=\"$VALET_CGROUP_MOUNT\"; mount -t tmpfs -o mode=755 cgroup-view \"$v\" \
                  && mkdir \"$v/unified\" && mount --rbind /sys/fs/cgroup \"$v/unified\" \
                  && mount -o remount,bind,ro \"$v\" && exec \"$@\"";
    let mut wrapper: Vec<String> = vec![
        "env".into(),
        format!("VALET_CGROUP_MOUNT={}", view.display()),
        "VALET_CGROUP_READ_ONLY=true".into(),
        "unshare".into(),
        "--mount".into(),
        "--propagation".into(),
        "private".into(),
        "sh".into(),
        "-c".into(),
        script.into(),
        "sh".into(),
    ];
    wrapper.extend(inner.iter().cloned());
    wrapper
}

/// The mounts at and below `view` in the mount namespace of process `pid`: each mount point and
/// whether its own flags say read-only.
pub fn mounts_below(pid: u32, view: &Path) -> Vec<(PathBuf, bool)> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/mountinfo")).unwrap_or_default();
    text.lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split(' ').collect();
            let (point, options) = (PathBuf::from(fields.get(4)?), fields.get(5)?);
            point.starts_with(view).then(|| (point, options.split(',').any(|o| o == "ro")))
        })
        .collect()
}

/// Write attempts into every mount at and below `view` as process `pid` sees them (through
/// `/proc/<pid>/root`, which resolves in its mounts): a directory made at each mount's root (a
/// cgroup, on a cgroup fs), and its `cgroup.procs` and `release_agent` opened for writing. Returns
/// what succeeded (undone at once: a directory made is removed, nothing is written).
pub fn writes_that_succeed(pid: u32, view: &Path) -> Vec<String> {
    let mut wrote = Vec::new();
    for (point, _) in mounts_below(pid, view) {
        let inside = Path::new(&format!("/proc/{pid}/root")).join(point.strip_prefix("/").unwrap_or(&point));
        let probe = inside.join("valet-rw-probe");
        if std::fs::create_dir(&probe).is_ok() {
            wrote.push(format!("mkdir {}", probe.display()));
            let _ = std::fs::remove_dir(&probe);
        }
        for name in ["cgroup.procs", "release_agent"] {
            let file = inside.join(name);
            if file.exists() && std::fs::OpenOptions::new().write(true).open(&file).is_ok() {
                wrote.push(format!("open {} for writing", file.display()));
            }
        }
    }
    wrote
}

/// Whether any thread of process `pid` holds capability number `cap` in its effective or
/// permitted set.
pub fn any_thread_holds(pid: u32, cap: u32) -> bool {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).into_iter().flatten().flatten();
    tasks.filter_map(|t| std::fs::read_to_string(t.path().join("status")).ok()).any(|status| {
        status.lines().filter(|l| l.starts_with("CapEff:") || l.starts_with("CapPrm:")).any(|l| {
            u64::from_str_radix(l.split(':').nth(1).unwrap_or("").trim(), 16).is_ok_and(|set| set & (1 << cap) != 0)
        })
    })
}
