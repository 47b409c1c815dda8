//! A procfs stand-in for unit tests: processes with a parent, a pid namespace depth, a start
//! time and, for runtime processes, an executable and the links the agent reads through.

use std::path::{Path, PathBuf};

/// A procfs stand-in: processes with a parent, a pid namespace depth, a start time and, for
/// runtime processes, an executable and the links the agent reads through.
pub(crate) struct FakeProc {
    pub(crate) root: PathBuf,
}

impl FakeProc {
    pub(crate) fn new(name: &str) -> FakeProc {
        let root = std::env::temp_dir().join(format!("valet-fakeproc-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(root.join("proc")).expect("mkdir");
        FakeProc { root }
    }

    pub(crate) fn proc(&self) -> PathBuf {
        self.root.join("proc")
    }

    pub(crate) fn process(&self, pid: u32, ppid: u32, nspid: &str, start: u64) -> PathBuf {
        let dir = self.proc().join(pid.to_string());
        std::fs::create_dir_all(&dir).expect("mkdir");
        std::fs::write(dir.join("status"), format!("Name:\tx\nPPid:\t{ppid}\nNSpid:\t{nspid}\n")).expect("status");
        let fields: Vec<String> = (3..=22).map(|i| if i == 22 { start.to_string() } else { "0".into() }).collect();
        std::fs::write(dir.join("stat"), format!("{pid} (x) {}", fields.join(" "))).expect("stat");
        dir
    }

    /// A containerd shim whose working directory is `bundle` (a real directory here; its
    /// `root` is the real root, so its paths read as they are).
    pub(crate) fn shim(&self, pid: u32, start: u64, bundle: &Path) {
        let dir = self.process(pid, 1, &pid.to_string(), start);
        std::os::unix::fs::symlink("/usr/bin/containerd-shim-runc-v2", dir.join("exe")).expect("exe");
        std::os::unix::fs::symlink(bundle, dir.join("cwd")).expect("cwd");
        std::os::unix::fs::symlink("/", dir.join("root")).expect("root");
    }

    pub(crate) fn bundle(&self, state: &Path, id: &str, config: &str) {
        std::fs::create_dir_all(state.join(id)).expect("mkdir");
        std::fs::write(state.join(id).join("config.json"), config).expect("config");
    }
}

impl Drop for FakeProc {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}
