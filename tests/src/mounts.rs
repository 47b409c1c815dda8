//! The host's cgroup fs bound into a process's own mount namespace as a runtime without recursive
//! read-only mounts binds a `readOnly` hostPath (containerd before 2.0, CRI-O before 1.30):
//! recursively (`rbind`), then its top mount alone remounted read-only. And what a process sees
//! of it: its mounts there, with their own flags, and which writes into them succeed.

use std::path::{Path, PathBuf};

/// A wrapper (for `Node::start_deadline_keeper_under` and the like) that runs the process in a
/// private mount namespace where the host's `/sys/fs/cgroup` is bound at `view` as containerd 1.6
/// binds the DaemonSet's `host-cgroup` volume, with `VALET_CGROUP_MOUNT=view` and
/// `VALET_CGROUP_READ_ONLY=true`, and then through `inner` (e.g. `setpriv` with capabilities).
/// So that a writable mount lies below the top on a v2 host too (whose cgroup fs is one mount,
/// where v1 and hybrid ones have a mount per controller), the cgroup fs is also bound, writable,
/// on the first directory below the top that is no mount point yet (in that namespace only).
pub fn bound_top_read_only(view: &Path, inner: &[String]) -> Vec<String> {
    let script = "v=\"$VALET_CGROUP_MOUNT\"; mount --rbind /sys/fs/cgroup \"$v\" \
                  && mount -o remount,bind,ro \"$v\" || exit 1; \
                  for d in \"$v\"/*/; do \
                    if [ -d \"$d\" ] && ! mountpoint -q \"$d\"; then mount --bind /sys/fs/cgroup \"$d\" || exit 1; break; fi; \
                  done; exec \"$@\"";
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
