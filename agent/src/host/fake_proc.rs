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

    /// A k3s containerd shim (pid `pid`) in a mount namespace of its own, whose root (the fake's
    /// `host` directory) holds containerd's CRI record of container `app`, which says it ended.
    pub(crate) fn k3s_shim_with_ended_record(&self, pid: u32, start: u64, app: &str) {
        let host = self.root.join("host");
        let state = host.join("run/k3s/containerd/io.containerd.runtime.v2.task/k8s.io");
        let sandbox = "5".repeat(64);
        self.bundle(&state, &sandbox, r#"{"annotations":{"io.kubernetes.cri.container-type":"sandbox"}}"#);
        self.shim(pid, start, &state.join(&sandbox));
        let root_link = self.proc().join(pid.to_string()).join("root");
        std::fs::remove_file(&root_link).expect("rm root");
        std::os::unix::fs::symlink(&host, &root_link).expect("root");
        let records = host.join("var/lib/rancher/k3s/agent/containerd/io.containerd.grpc.v1.cri/containers");
        std::fs::create_dir_all(records.join(app)).expect("mkdir");
        std::fs::write(records.join(app).join("status"), r#"{"Version":"v1","FinishedAt":1764950003200000000}"#)
            .expect("status");
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
