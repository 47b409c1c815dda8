//! A sim pod's processes: started through `valet-sim-exec` into a container's cgroup, the
//! pod's netns and (optionally) a pid namespace of their own; waited for and signalled.
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Result, anyhow};

use super::*;
use crate::util;

/// Where container processes' output goes.
#[derive(Debug, Clone, Default)]
pub enum Output {
    Inherit,
    #[default]
    Null,
    /// Appended to this file.
    File(PathBuf),
}

impl Output {
    pub(super) fn stdio(&self) -> Result<Stdio> {
        Ok(match self {
            Output::Inherit => Stdio::inherit(),
            Output::Null => Stdio::null(),
            Output::File(p) => Stdio::from(
                File::options().create(true).append(true).open(p).with_context(|| format!("open {}", p.display()))?,
            ),
        })
    }
}

/// How [`SimPod::spawn`] starts a process.
#[derive(Debug, Clone)]
pub struct SpawnOptions {
    /// Start as pid 1 of a new pid namespace, like a container's main process (default true).
    pub pid_namespace: bool,
    /// Start in this existing pid namespace instead (`/proc/<pid>/ns/pid`; shareProcessNamespace:
    /// the sandbox's), as pid N there, with `valet-sim-exec` as its parent as the shim is a real
    /// container's. Takes precedence over `pid_namespace`.
    pub join_pid_namespace: Option<PathBuf>,
    pub env: Vec<(String, String)>,
    pub stdout: Output,
    pub stderr: Output,
    pub cwd: Option<PathBuf>,
    /// Run as this uid and gid (no supplementary groups) from the first exec, like a container
    /// with `runAsUser`; `None`: as the caller.
    pub uid: Option<u32>,
    /// Wait this long in the container's cgroup (and pid namespace) before the exec, as `runc
    /// init` waits from `runc create` to `runc start`.
    pub exec_delay: Option<Duration>,
    /// With a pid namespace (own or joined): give the command this host pid, freed just before
    /// (`ns_last_pid` set right before `valet-sim-exec`'s fork; the caller checks the pid it got).
    pub host_pid: Option<u32>,
}

impl Default for SpawnOptions {
    fn default() -> Self {
        SpawnOptions {
            pid_namespace: true,
            join_pid_namespace: None,
            env: Vec::new(),
            stdout: Output::Null,
            stderr: Output::Inherit,
            cwd: None,
            uid: None,
            exec_delay: None,
            host_pid: None,
        }
    }
}

/// Where [`SimProcess::signal`] sends its signals.
#[derive(Debug)]
pub(super) enum Target {
    /// `host_pid` is our child: it cannot be recycled before we reap it.
    Child,
    /// The process is `valet-sim-exec`'s child (pid 1 of its pid namespace, or pid N of one it
    /// joined): through its pidfd.
    Pidfd(OwnedFd),
    /// It was gone before a pidfd could be opened.
    Gone,
}

/// A running container process.
#[derive(Debug)]
pub struct SimProcess {
    /// The process itself, or the `valet-sim-exec` that waits for it and ends as it ended.
    child: Child,
    target: Target,
    host_pid: u32,
    pid_namespace: bool,
    container: String,
    status: Option<ExitStatus>,
}

impl SimProcess {
    /// Its pid in the host (initial) pid namespace.
    pub fn host_pid(&self) -> u32 {
        self.host_pid
    }
    /// Its pid inside its own pid namespace (1 when it has one; else its host pid, also when it
    /// joined another's namespace).
    pub fn ns_pid(&self) -> u32 {
        if self.pid_namespace { 1 } else { self.host_pid }
    }
    pub fn container(&self) -> &str {
        &self.container
    }
    /// The exit status if it has exited (reaps it).
    pub fn try_wait(&mut self) -> Result<Option<ExitStatus>> {
        if self.status.is_none() {
            self.status = self.child.try_wait().context("waitpid")?;
        }
        Ok(self.status)
    }
    /// Whether it has been reaped (its status is known), without a syscall.
    pub fn reaped(&self) -> bool {
        self.status.is_some()
    }
    /// Waits up to `timeout` for the exit; None if still running.
    pub fn wait_timeout(&mut self, timeout: Duration) -> Result<Option<ExitStatus>> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = self.try_wait()? {
                return Ok(Some(s));
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }
    /// [`Self::wait_timeout`] without blocking an async runtime's thread.
    pub async fn wait_timeout_async(&mut self, timeout: Duration) -> Result<Option<ExitStatus>> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = self.try_wait()? {
                return Ok(Some(s));
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
    /// Sends a signal (a no-op once it has been reaped, so a recycled pid is never hit).
    pub fn signal(&mut self, sig: i32) -> Result<()> {
        if self.try_wait()?.is_some() {
            return Ok(());
        }
        let sent = match &self.target {
            // SAFETY: plain syscall; the pid is our unreaped child, so it cannot have been recycled.
            Target::Child => unsafe { libc::kill(self.host_pid as i32, sig) },
            // SAFETY: plain syscall on a pidfd we own.
            Target::Pidfd(fd) => unsafe {
                libc::syscall(libc::SYS_pidfd_send_signal, fd.as_raw_fd(), sig, std::ptr::null::<u8>(), 0) as i32
            },
            Target::Gone => return Ok(()),
        };
        if sent != 0 {
            let e = io::Error::last_os_error();
            if e.raw_os_error() != Some(libc::ESRCH) {
                return Err(e).context("kill");
            }
        }
        Ok(())
    }
    /// SIGKILL and reap. Killing a pid namespace's init also kills the rest of the namespace.
    pub fn kill(&mut self) -> Result<ExitStatus> {
        self.signal(libc::SIGKILL)?;
        if let Some(s) = self.status {
            return Ok(s);
        }
        let s = self.child.wait().context("waitpid")?;
        self.status = Some(s);
        Ok(s)
    }
}

impl Drop for SimProcess {
    fn drop(&mut self) {
        let _ = self.kill();
    }
}

/// `valet-sim-exec`, which starts every container process (see [`SimPod::spawn`]):
/// `$VALET_SIM_EXEC`, else next to the running executable (`target/<profile>/`, also from
/// `target/<profile>/deps/`) or to the stand-in proxy.
pub fn exec_helper() -> Result<&'static Path> {
    static HELPER: std::sync::OnceLock<Option<PathBuf>> = std::sync::OnceLock::new();
    HELPER
        .get_or_init(|| {
            if let Some(p) = std::env::var_os("VALET_SIM_EXEC") {
                return Some(PathBuf::from(p));
            }
            util::next_to_exe("valet-sim-exec").or_else(|| {
                let standin = crate::standin::binary_path().ok()?;
                Some(standin.parent()?.join("valet-sim-exec")).filter(|p| p.is_file())
            })
        })
        .as_deref()
        .ok_or_else(|| {
            anyhow!("valet-sim-exec not found: build it (`cargo build -p valet-sim --bins`) or set VALET_SIM_EXEC")
        })
}

impl SimPod {
    /// Starts `cmd` as a process of `container` (`POD` = the sandbox): it joins the container's
    /// cgroup and the pod's netns before exec, and with `pid_namespace` it is pid 1 of a new
    /// pid namespace while the returned handle holds its host pid and can wait for its status.
    /// The steps before the exec run in `valet-sim-exec`, which std starts with `posix_spawn` (a
    /// vfork), not in a fork of this (large, many-threaded) process.
    pub fn spawn(&self, container: &str, cmd: &[&str], opts: &SpawnOptions) -> Result<SimProcess> {
        let helper = exec_helper()?;
        let c = self.container(container)?;
        let (prog, args) = cmd.split_first().ok_or_else(|| anyhow!("empty command"))?;
        let procs_path = self.procs_cgroup(&c).join("cgroup.procs");
        let (mut status, status_w) = io::pipe().context("pipe")?;
        let mut command = Command::new(helper);
        command.arg("--cgroup-procs").arg(&procs_path);
        if let Some(p) = self.netns_path() {
            command.arg("--netns").arg(p);
        }
        if let Some(id) = opts.uid {
            command.arg("--uid").arg(id.to_string());
        }
        if let Some(d) = opts.exec_delay {
            command.arg("--delay-ns").arg(d.as_nanos().to_string());
        }
        if let Some(d) = &opts.cwd {
            command.arg("--cwd").arg(d);
        }
        if let Some(ns) = &opts.join_pid_namespace {
            command.arg("--join-pidns").arg(ns);
        } else if opts.pid_namespace {
            command.arg("--pidns");
        }
        let child_of_helper = opts.pid_namespace || opts.join_pid_namespace.is_some();
        if let Some(pid) = opts.host_pid.filter(|_| child_of_helper) {
            command.arg("--host-pid").arg(pid.to_string());
        }
        command.arg("--").arg(prog).args(args);
        command.stdin(status_w).stdout(opts.stdout.stdio()?).stderr(opts.stderr.stdio()?);
        for (k, v) in &opts.env {
            command.env(k, v);
        }
        let mut child = command.spawn().with_context(|| format!("spawn {} for {prog}", helper.display()))?;
        // The command holds our copy of the pipe's write end: end of file needs it closed.
        drop(command);
        let mut said = String::new();
        io::Read::read_to_string(&mut status, &mut said).context("read valet-sim-exec's status")?;
        let mut pid = None;
        for line in said.lines() {
            if let Some(n) = line.strip_prefix("pid ") {
                pid = n.trim().parse::<u32>().ok();
            } else if let Some(rest) = line.strip_prefix("err ") {
                let (errno, what) = rest.split_once(' ').unwrap_or((rest, ""));
                let _ = child.wait();
                let err = io::Error::from_raw_os_error(errno.parse().unwrap_or(libc::EIO));
                return Err(
                    anyhow::Error::new(err).context(format!("{what}: spawn {prog} in {}/{container}", self.name))
                );
            }
        }
        let (host_pid, target) = if child_of_helper {
            let pid = pid.ok_or_else(|| anyhow!("valet-sim-exec said no pid for {prog}: {said:?}"))?;
            // The command is valet-sim-exec's child: signals go through a pidfd, which cannot hit
            // a recycled pid. Gone already (it ended at once and was reaped): nothing to signal.
            // SAFETY: plain syscall; a valid fd it returns is ours.
            let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
            let target = if fd >= 0 {
                // SAFETY: a new fd that nothing else owns.
                Target::Pidfd(unsafe { OwnedFd::from_raw_fd(fd as i32) })
            } else {
                Target::Gone
            };
            (pid, target)
        } else {
            (child.id(), Target::Child)
        };
        Ok(SimProcess {
            host_pid,
            child,
            target,
            pid_namespace: opts.pid_namespace && opts.join_pid_namespace.is_none(),
            container: container.to_string(),
            status: None,
        })
    }

    /// Starts a pause-like process (`sleep infinity`) in the sandbox, so the pod has a live
    /// process holding its namespaces as a real sandbox does.
    pub fn spawn_pause(&self) -> Result<SimProcess> {
        self.spawn("POD", &["sleep", "infinity"], &SpawnOptions::default())
    }
}
