//! The agent and the deadline keeper as the tests run them: child processes with their logs,
//! their HTTP endpoints and metrics, stopped by signal.
use std::io::Read as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Child;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};

use super::*;

/// A running agent process.
pub struct Agent {
    pub(super) child: Option<Child>,
    pub metrics: SocketAddr,
    pub log: PathBuf,
}

impl Agent {
    /// Whether the agent exited because another process had its metrics port; waits until it
    /// serves, answers there or exits (a hang guard at most).
    pub(super) fn lost_its_port(&mut self) -> bool {
        let deadline = Instant::now() + HANG_GUARD;
        while Instant::now() < deadline {
            let exited = self.child.as_mut().is_none_or(|c| c.try_wait().is_ok_and(|s| s.is_some()));
            let log = self.log_text();
            if exited {
                return log.contains("bind metrics address");
            }
            // The line is logged at info; with a quieter VALET_TEST_LOG, an answer on the port.
            if log.contains("serving /metrics")
                || std::net::TcpStream::connect_timeout(&self.metrics, Duration::from_millis(50)).is_ok()
            {
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        false
    }

    /// One GET of the agent's server (`/readyz`, `/healthz`, `/metrics`): status and body.
    pub fn get(&self, path: &str) -> Result<(u16, String)> {
        // A metric read as 0 because a busy agent answered late would fail a test for nothing.
        let r = valet_sim::client::get(self.metrics, path, HANG_GUARD)?;
        Ok((r.status, r.text()))
    }

    pub fn wait_ready(&mut self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(child) = self.child.as_mut()
                && let Some(status) = child.try_wait()?
            {
                bail!("valet-agent exited ({status}) before ready:\n{}", self.log_text());
            }
            if let Ok((200, _)) = self.get("/readyz") {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!("valet-agent not ready after {timeout:?}:\n{}", self.log_text());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Waits until the agent serves the node: ready, or running degraded for a reason
    /// `--degraded-ok` does not expect (then `/readyz` answers 503 and says so, for good).
    pub fn wait_served(&mut self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(child) = self.child.as_mut()
                && let Some(status) = child.try_wait()?
            {
                bail!("valet-agent exited ({status}):\n{}", self.log_text());
            }
            match self.get("/readyz") {
                Ok((200, _)) => return Ok(()),
                Ok((503, body)) if body.contains("degraded for a reason not expected") => return Ok(()),
                _ => {}
            }
            if Instant::now() > deadline {
                bail!("valet-agent neither ready nor degraded after {timeout:?}:\n{}", self.log_text());
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn metrics_text(&self) -> Result<String> {
        let (status, body) = self.get("/metrics")?;
        if status != 200 {
            bail!("/metrics answered {status}");
        }
        Ok(body)
    }

    /// The value of one sample line (`name{labels}` exactly as exposed), 0 when absent.
    pub fn metric(&self, sample: &str) -> f64 {
        self.metrics_text()
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix(sample).and_then(|rest| rest.trim().split(' ').next()?.parse().ok()))
            .unwrap_or(0.0)
    }

    /// Waits until a sample reads `value` (counts are made a moment after what they count: a
    /// released app may run, or a quit proxy exit, before the agent counts it); whether it did.
    pub fn wait_metric(&self, sample: &str, value: f64) -> bool {
        eventually(HANG_GUARD, || self.metric(sample) == value)
    }

    /// Waits until `pods_tracked` reaches `n` (the agent has seen the pods and their cgroups).
    pub fn wait_tracked(&self, n: usize, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        while self.metric("valet_pods_tracked ") as usize != n {
            if Instant::now() > deadline {
                bail!("agent tracks {} pods, want {n}:\n{}", self.metric("valet_pods_tracked "), self.log_text());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// Waits until a line of the log says `message` about the pod `namespace/name` (its `pod=`
    /// field, matched whole); whether it came within the hang guard. The agent logs such lines at
    /// info, the tests' default level.
    pub fn wait_pod_line(&self, message: &str, pod: &str) -> bool {
        eventually(HANG_GUARD, || says_about(&self.log_text(), message, pod))
    }

    pub fn log_text(&self) -> String {
        let mut s = String::new();
        if let Ok(mut f) = std::fs::File::open(&self.log) {
            let _ = f.read_to_string(&mut s);
        }
        s
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// Sends a signal and waits for the process to end (up to `timeout`); its exit status.
    pub fn stop(&mut self, signal: i32, timeout: Duration) -> Result<Option<std::process::ExitStatus>> {
        stop_child(&mut self.child, signal, timeout, "agent")
    }
}

/// Whether a line of an agent's log says `message` about the pod `namespace/name` (its `pod=`
/// field, matched whole: `jobs/a` is not `jobs/a-b`).
pub fn says_about(log: &str, message: &str, pod: &str) -> bool {
    let field = format!("pod={pod}");
    log.lines().any(|l| l.contains(message) && l.split_whitespace().any(|w| w == field))
}

/// Sends `signal` to the child, if it still runs, and waits for it to end (up to `timeout`,
/// then SIGKILL and an error); its exit status.
fn stop_child(
    child: &mut Option<std::process::Child>,
    signal: i32,
    timeout: Duration,
    what: &str,
) -> Result<Option<std::process::ExitStatus>> {
    let Some(mut child) = child.take() else { return Ok(None) };
    // SAFETY: plain syscall on our own child.
    unsafe { libc::kill(child.id() as i32, signal) };
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(status) = child.try_wait()? {
            return Ok(Some(status));
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!("{what} did not stop within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// `valet-agent deadlines` for a node ([`Node::start_deadline_keeper`]); killed when dropped.
pub struct DeadlineKeeper {
    pub(super) child: Option<std::process::Child>,
    pub log: PathBuf,
}

impl DeadlineKeeper {
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(|c| c.id())
    }

    /// SIGKILL (a crash, or the node's OOM killer): it releases nothing.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM (its pod deleted), then its exit status.
    pub fn stop(&mut self) -> Result<Option<std::process::ExitStatus>> {
        stop_child(&mut self.child, libc::SIGTERM, HANG_GUARD, "valet-agent deadlines")
    }

    /// Its exit status once it has exited on its own, waiting at most `timeout` (None: still running).
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let child = self.child.as_mut()?;
        let deadline = Instant::now() + timeout;
        loop {
            match child.try_wait() {
                Ok(Some(status)) => return Some(status),
                Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(20)),
                _ => return None,
            }
        }
    }
}

impl Drop for DeadlineKeeper {
    fn drop(&mut self) {
        self.kill();
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}
