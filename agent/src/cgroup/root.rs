//! Finds the cgroup hierarchy the kubelet puts pods in, by looking at the node:
//! - cgroup v2: `/sys/fs/cgroup` is the cgroup2 mount;
//! - cgroup v1 and hybrid (`/sys/fs/cgroup` a tmpfs of v1 controller mounts, on hybrid nodes with
//!   a controller-less cgroup2 at `/sys/fs/cgroup/unified`): the kubelet, like runc, decides v1
//!   when `/sys/fs/cgroup` is not cgroup2, and makes every pod's and container's cgroup in each
//!   v1 controller's hierarchy under the same path. One controller's hierarchy is used (memory
//!   first), and the kernel programs are told which ([`Hierarchy::V1`]).

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::host::proc::unescape_octal;

/// `statfs(2)` magic numbers of the two cgroup file systems.
const CGROUP2_SUPER_MAGIC: i64 = 0x6367_7270;
const CGROUP_SUPER_MAGIC: i64 = 0x0027_e0eb;

/// A cgroup v1 controller whose hierarchy can hold the kubelet's cgroups.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Controller {
    Memory,
    Pids,
    Cpu,
    Cpuacct,
    Blkio,
    Devices,
    Freezer,
    Cpuset,
}

impl Controller {
    /// In the order they are preferred: the kubelet and runc enable accounting for memory, pids
    /// and cpu on every pod and container, under both drivers.
    pub const ALL: [Controller; 8] = [
        Controller::Memory,
        Controller::Pids,
        Controller::Cpu,
        Controller::Cpuacct,
        Controller::Blkio,
        Controller::Devices,
        Controller::Freezer,
        Controller::Cpuset,
    ];

    /// The name in mount options and under `/sys/fs/cgroup`.
    pub fn name(self) -> &'static str {
        match self {
            Controller::Memory => "memory",
            Controller::Pids => "pids",
            Controller::Cpu => "cpu",
            Controller::Cpuacct => "cpuacct",
            Controller::Blkio => "blkio",
            Controller::Devices => "devices",
            Controller::Freezer => "freezer",
            Controller::Cpuset => "cpuset",
        }
    }

    /// The kernel's `enum cgroup_subsys_id` enumerator (blkio is the io controller's v1 name).
    pub fn subsys_enumerator(self) -> String {
        match self {
            Controller::Blkio => "io_cgrp_id".to_owned(),
            other => format!("{}_cgrp_id", other.name()),
        }
    }

    pub fn from_name(name: &str) -> Option<Controller> {
        Controller::ALL.into_iter().find(|c| c.name() == name)
    }
}

/// Which hierarchy the kubelet's cgroups are read from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Hierarchy {
    /// The cgroup v2 hierarchy.
    V2,
    /// A cgroup v1 controller's hierarchy (a v1 or hybrid node).
    V1(Controller),
}

/// The hierarchy the agent reads and the kernel programs watch, and where it is mounted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeCgroups {
    pub root: PathBuf,
    pub hierarchy: Hierarchy,
}

/// The file system type of `path` (`statfs(2)`'s `f_type`).
fn fs_magic(path: &Path) -> Option<i64> {
    crate::host::sys::fs_magic(path)
}

/// Whether a kubelet root (either driver's) is a child of `dir`.
fn has_kubelet_root(dir: &Path) -> bool {
    dir.join("kubepods.slice").is_dir() || dir.join("kubepods").is_dir()
}

/// The first controller valet knows in a v1 mount's super options (`rw,cpu,cpuacct`).
fn controller_in_options(options: &str) -> Option<Controller> {
    options.split(',').find_map(Controller::from_name)
}

/// The v1 hierarchies of the controllers valet knows in mountinfo text: each mount point with
/// its (first) controller.
pub fn v1_controller_mounts(mountinfo: &str) -> Vec<(PathBuf, Controller)> {
    mountinfo
        .lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let mut fields = right.split_whitespace();
            if fields.next()? != "cgroup" {
                return None;
            }
            let controller = controller_in_options(fields.nth(1)?)?;
            Some((PathBuf::from(unescape_octal(left.split_whitespace().nth(4)?)), controller))
        })
        .collect()
}

/// The controller of the v1 hierarchy mounted at `path`, from mountinfo text.
pub fn v1_controller_from_mountinfo(mountinfo: &str, path: &Path) -> Option<Controller> {
    v1_controller_mounts(mountinfo).into_iter().find(|(p, _)| p == path).map(|(_, c)| c)
}

/// Finds the hierarchy to use. `configured`: a hierarchy's root given by the operator (the v2
/// mount, or a v1 controller's), taken as it is. Otherwise `mount` (the node's `/sys/fs/cgroup`
/// as the agent sees it) is looked at: cgroup2 there is a v2 node. On a v1 or hybrid node, the
/// v1 controller hierarchies that hold a kubelet root come first, then the v2 one if it alone
/// holds one (a kubelet that ran with its cgroups there), then the first v1 controller mounted
/// (the kubelet's choice on such a node, before it made any pod).
pub fn find_node_cgroups(configured: Option<&Path>, mount: &Path, host_proc: &Path) -> Result<NodeCgroups> {
    if let Some(path) = configured {
        return match fs_magic(path) {
            Some(CGROUP2_SUPER_MAGIC) => Ok(NodeCgroups { root: path.to_path_buf(), hierarchy: Hierarchy::V2 }),
            Some(CGROUP_SUPER_MAGIC) => {
                let mountinfo_path = host_proc.join("self/mountinfo");
                let text = std::fs::read_to_string(&mountinfo_path)
                    .map_err(|e| Error::io(format!("read {}", mountinfo_path.display()), e))?;
                let canonical = std::fs::canonicalize(path).unwrap_or_else(|_| path.to_path_buf());
                let controller = v1_controller_from_mountinfo(&text, &canonical).ok_or_else(|| {
                    Error::Cgroup(format!(
                        "{} is a cgroup v1 mount of none of the controllers {}",
                        path.display(),
                        Controller::ALL.map(Controller::name).join(", ")
                    ))
                })?;
                Ok(NodeCgroups { root: path.to_path_buf(), hierarchy: Hierarchy::V1(controller) })
            }
            _ => Err(Error::Cgroup(format!(
                "{} is not a cgroup mount (neither cgroup2 nor a v1 controller)",
                path.display()
            ))),
        };
    }
    if fs_magic(mount) == Some(CGROUP2_SUPER_MAGIC) {
        return Ok(NodeCgroups { root: mount.to_path_buf(), hierarchy: Hierarchy::V2 });
    }
    let v1: Vec<NodeCgroups> = Controller::ALL
        .into_iter()
        .map(|c| NodeCgroups { root: mount.join(c.name()), hierarchy: Hierarchy::V1(c) })
        .filter(|n| fs_magic(&n.root) == Some(CGROUP_SUPER_MAGIC))
        .collect();
    let unified = mount.join("unified");
    let unified = (fs_magic(&unified) == Some(CGROUP2_SUPER_MAGIC))
        .then_some(NodeCgroups { root: unified, hierarchy: Hierarchy::V2 });
    let with_pods = v1.iter().chain(unified.iter()).find(|n| has_kubelet_root(&n.root));
    with_pods.or(v1.first()).or(unified.as_ref()).cloned().ok_or_else(|| {
        Error::Cgroup(format!("no cgroup hierarchy at {} (neither cgroup2 nor v1 controllers)", mount.display()))
    })
}

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
    fn names_the_v1_controller_of_a_mount() {
        let hybrid = "25 24 0:22 / /sys/fs/cgroup ro,nosuid shared:5 - tmpfs tmpfs ro,mode=755\n\
            26 25 0:23 / /sys/fs/cgroup/unified rw shared:6 - cgroup2 cgroup2 rw\n\
            27 25 0:24 / /sys/fs/cgroup/cpu,cpuacct rw shared:7 - cgroup cgroup rw,cpu,cpuacct\n\
            28 25 0:25 / /sys/fs/cgroup/systemd rw shared:8 - cgroup cgroup rw,xattr,name=systemd\n\
            29 25 0:26 / /host/sys/fs/cgroup/memory rw shared:9 - cgroup cgroup rw,memory\n";
        let at = |p: &str| v1_controller_from_mountinfo(hybrid, Path::new(p));
        assert_eq!(at("/sys/fs/cgroup/cpu,cpuacct"), Some(Controller::Cpu));
        assert_eq!(at("/host/sys/fs/cgroup/memory"), Some(Controller::Memory));
        assert_eq!(at("/sys/fs/cgroup/systemd"), None, "a named hierarchy has no controller");
        assert_eq!(at("/sys/fs/cgroup/unified"), None);
        assert_eq!(at("/sys/fs/cgroup"), None);
        assert_eq!(Controller::Blkio.subsys_enumerator(), "io_cgrp_id");
        assert_eq!(Controller::Pids.subsys_enumerator(), "pids_cgrp_id");
    }

    #[test]
    fn finds_the_hierarchy_by_looking() {
        // This host: whatever it is, what is found is a mount of that kind, and an explicit
        // root of the other kinds is read as what it is.
        let found = find_node_cgroups(None, Path::new("/sys/fs/cgroup"), Path::new("/proc")).expect("found");
        let magic = fs_magic(&found.root);
        match found.hierarchy {
            Hierarchy::V2 => assert_eq!(magic, Some(CGROUP2_SUPER_MAGIC)),
            Hierarchy::V1(c) => {
                assert_eq!(magic, Some(CGROUP_SUPER_MAGIC));
                assert_eq!(found.root, Path::new("/sys/fs/cgroup").join(c.name()));
            }
        }
        for c in Controller::ALL {
            let root = Path::new("/sys/fs/cgroup").join(c.name());
            if fs_magic(&root) == Some(CGROUP_SUPER_MAGIC) {
                let given = find_node_cgroups(Some(&root), Path::new("/nowhere"), Path::new("/proc")).expect("v1");
                assert_eq!(given.hierarchy, Hierarchy::V1(c), "{}", root.display());
            }
        }
        let v2 = find_cgroup2_root(None, Path::new("/proc")).expect("cgroup2");
        let given = find_node_cgroups(Some(&v2), Path::new("/nowhere"), Path::new("/proc")).expect("v2");
        assert_eq!(given.hierarchy, Hierarchy::V2);
        assert!(find_node_cgroups(Some(Path::new("/tmp")), Path::new("/nowhere"), Path::new("/proc")).is_err());
        assert!(find_node_cgroups(None, Path::new("/tmp"), Path::new("/proc")).is_err());
    }

    #[test]
    fn finds_this_hosts_root() {
        let root = find_cgroup2_root(None, Path::new("/proc")).expect("cgroup2 mounted");
        assert!(root.join("cgroup.procs").exists());
    }
}
