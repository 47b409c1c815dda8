//! Throwaway kubelet-shaped cgroups for kernel tests, removed on drop.

use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};

use anyhow::{Context as _, Result};
use valet_agent::cgroup::root::{Controller, Hierarchy, find_cgroup2_root, v1_controller_mounts};

/// A tree of cgroup directories created for one test; removed (children first) on drop after
/// killing whatever still runs in them.
pub struct TestCgroups {
    pub root: PathBuf,
    created: Vec<PathBuf>,
}

impl TestCgroups {
    pub fn new() -> Result<TestCgroups> {
        let root = find_cgroup2_root(None, Path::new("/proc")).context("cgroup2 root")?;
        Ok(TestCgroups { root, created: Vec::new() })
    }

    /// Cgroups in a hierarchy: the v2 one, or a v1 controller's ([`v1_mount`]).
    pub fn in_hierarchy(hierarchy: Hierarchy) -> Result<TestCgroups> {
        match hierarchy {
            Hierarchy::V2 => TestCgroups::new(),
            Hierarchy::V1(controller) => Ok(TestCgroups { root: v1_mount(controller)?, created: Vec::new() }),
        }
    }

    /// Creates every missing directory of a relative cgroup path; returns its absolute path.
    /// Ancestors are shared by tests running at once: one that another test created may be
    /// removed by that test's drop between our check and our mkdir below it (ENOENT), and one
    /// may appear between our check and our mkdir (EEXIST); both are taken as they are and the
    /// walk starts again.
    pub fn create(&mut self, rel: &str) -> Result<PathBuf> {
        let mut attempts = 0;
        loop {
            match self.create_once(rel) {
                Err(e) if e.kind() == std::io::ErrorKind::NotFound && attempts < 100 => attempts += 1,
                other => return other.with_context(|| format!("mkdir {} under {}", rel, self.root.display())),
            }
        }
    }

    fn create_once(&mut self, rel: &str) -> std::io::Result<PathBuf> {
        let mut path = self.root.clone();
        for part in rel.trim_matches('/').split('/') {
            path.push(part);
            match std::fs::create_dir(&path) {
                Ok(()) => self.created.push(path.clone()),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(e),
            }
        }
        Ok(path)
    }

    /// The cgroup id (inode) of a relative path.
    pub fn id(&self, rel: &str) -> Result<u64> {
        use std::os::unix::fs::MetadataExt as _;
        Ok(std::fs::metadata(self.root.join(rel.trim_start_matches('/')))?.ino())
    }

    /// Spawns `cmd` with its first process placed into the cgroup before it execs.
    pub fn spawn_in(&self, rel: &str, cmd: &mut Command) -> Result<Child> {
        let procs = self.root.join(rel.trim_start_matches('/')).join("cgroup.procs");
        let procs_c = std::ffi::CString::new(procs.as_os_str().as_encoded_bytes())?;
        // SAFETY: only async-signal-safe calls (open/write/close) between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                let fd = libc::open(procs_c.as_ptr(), libc::O_WRONLY);
                if fd < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                let ok = libc::write(fd, b"0\n".as_ptr().cast(), 2);
                libc::close(fd);
                if ok < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        cmd.spawn().context("spawn in cgroup")
    }
}

impl Drop for TestCgroups {
    fn drop(&mut self) {
        for dir in self.created.iter().rev() {
            for _ in 0..50 {
                let procs = std::fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default();
                let pids: Vec<i32> = procs.lines().filter_map(|l| l.parse().ok()).collect();
                for pid in &pids {
                    // SAFETY: plain syscall.
                    unsafe { libc::kill(*pid, libc::SIGKILL) };
                }
                if std::fs::remove_dir(dir).is_ok() || !dir.exists() {
                    break;
                }
                std::thread::sleep(std::time::Duration::from_millis(20));
            }
        }
    }
}

/// Where the v1 hierarchy of `controller` is mounted: where the host mounted it (this
/// development machine is a hybrid node: `/sys/fs/cgroup/<controller>`), else a mount of it made
/// here, once, and shared by every test (a cgroup v2 guest of `cargo xtask kernels`, where no
/// cgroup enables the controller, so the kernel lets a v1 hierarchy take it). Fails when the v2
/// hierarchy uses it.
pub fn v1_mount(controller: Controller) -> Result<PathBuf> {
    let mounted = || -> Result<Option<PathBuf>> {
        let text = std::fs::read_to_string("/proc/self/mountinfo").context("read /proc/self/mountinfo")?;
        Ok(v1_controller_mounts(&text).into_iter().find(|(_, c)| *c == controller).map(|(p, _)| p))
    };
    if let Some(path) = mounted()? {
        return Ok(path);
    }
    static MOUNTING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one_at_a_time = MOUNTING.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some(path) = mounted()? {
        return Ok(path);
    }
    let dir = PathBuf::from(format!("/run/valet-test-cgroup-v1/{}", controller.name()));
    std::fs::create_dir_all(&dir)?;
    let status = Command::new("mount")
        .args(["-t", "cgroup", "-o", controller.name(), "cgroup"])
        .arg(&dir)
        .status()
        .context("run mount")?;
    anyhow::ensure!(status.success(), "mount -t cgroup -o {} failed ({status})", controller.name());
    Ok(dir)
}

/// Fails the test run when not root: privileged tests must never be skipped silently.
pub use valet_sim::util::require_root;
