//! Tasks that run beside `cargo xtask test`'s own tests, one after another in a thread: the fuzz
//! targets and the agent's image. The tests mostly wait (on agents, API stand-ins, timers: about
//! a tenth of two cores over their 7 minutes), and these two mostly build (6 to 8 minutes of
//! both cores), so running them together saves most of the shorter. Each task's output goes to
//! a file under `<target>/xtask-logs/`, replayed and counted once the tests are done, so that the
//! log still reads one runner at a time.
use std::os::unix::process::CommandExt as _;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;

use anyhow::{Context as _, Result};

/// One task run beside the tests: its name, the log of its output, and whether it exited 0
/// (`Err` when it could not be started or waited for).
pub(crate) struct Done {
    pub(crate) name: &'static str,
    pub(crate) log: PathBuf,
    pub(crate) ok: Result<bool>,
}

/// The tasks' thread. Dropped before [`Beside::join`] (the test run failed on its way), it
/// kills the task running and starts no other.
pub(crate) struct Beside {
    running: Arc<Mutex<Option<Child>>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<Vec<Done>>>,
}

impl Beside {
    /// Starts `tasks` one after another, each with its output (stdout and stderr) in
    /// `<logs>/<name>.log`.
    pub(crate) fn start(logs: PathBuf, tasks: Vec<(&'static str, Command)>) -> Result<Beside> {
        std::fs::create_dir_all(&logs).with_context(|| format!("create {}", logs.display()))?;
        let running = Arc::new(Mutex::new(None::<Child>));
        let stop = Arc::new(AtomicBool::new(false));
        let (r, s) = (Arc::clone(&running), Arc::clone(&stop));
        let thread = std::thread::Builder::new()
            .name("xtask-beside".into())
            .spawn(move || tasks.into_iter().map(|(name, cmd)| run_one(&logs, name, cmd, &r, &s)).collect())
            .context("spawn the thread of the tasks beside the tests")?;
        Ok(Beside { running, stop, thread: Some(thread) })
    }

    /// Waits for every task to end: each one's outcome, in order.
    pub(crate) fn join(mut self) -> Result<Vec<Done>> {
        let thread = self.thread.take().context("joined twice")?;
        thread.join().map_err(|_| anyhow::anyhow!("the thread of the tasks beside the tests panicked"))
    }
}

impl Drop for Beside {
    fn drop(&mut self) {
        let Some(thread) = self.thread.take() else { return };
        self.stop.store(true, Ordering::SeqCst);
        if let Some(child) = self.running.lock().unwrap_or_else(PoisonError::into_inner).as_mut() {
            kill_group(child);
        }
        // Killed, the task ends at once, and the thread starts no other.
        let _ = thread.join();
    }
}

fn run_one(
    logs: &std::path::Path,
    name: &'static str,
    mut cmd: Command,
    running: &Mutex<Option<Child>>,
    stop: &AtomicBool,
) -> Done {
    let log = logs.join(format!("{name}.log"));
    let ok = (|| {
        if stop.load(Ordering::SeqCst) {
            anyhow::bail!("not started: the test run ended first");
        }
        let out = std::fs::File::create(&log).with_context(|| format!("create {}", log.display()))?;
        let err = out.try_clone()?;
        // A process group of its own, so that a kill reaches what it started (cargo, rustc,
        // libFuzzer) too.
        let child = cmd
            .process_group(0)
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .with_context(|| format!("spawn {cmd:?}"))?;
        let pid = child.id();
        *running.lock().unwrap_or_else(PoisonError::into_inner) = Some(child);
        // Polled, not waited on while holding the lock, so that a drop can kill it meanwhile.
        loop {
            let mut slot = running.lock().unwrap_or_else(PoisonError::into_inner);
            let Some(child) = slot.as_mut() else { anyhow::bail!("task {pid} lost") };
            if stop.load(Ordering::SeqCst) {
                kill_group(child);
            }
            if let Some(status) = child.try_wait()? {
                *slot = None;
                return Ok(status.success());
            }
            drop(slot);
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
    })();
    Done { name, log, ok }
}

/// SIGKILL to the task's process group (its pid: [`run_one`] made it the group's leader).
fn kill_group(child: &mut Child) {
    let _ = Command::new("kill").args(["-KILL", "--", &format!("-{}", child.id())]).stderr(Stdio::null()).status();
    let _ = child.kill();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(script: &str) -> Command {
        let mut cmd = Command::new("sh");
        cmd.args(["-c", script]);
        cmd
    }

    #[test]
    fn tasks_run_in_order_with_their_output_and_status_kept() {
        let logs = std::env::temp_dir().join(format!("xtask-beside-{}", std::process::id()));
        let beside = Beside::start(
            logs.clone(),
            vec![("first", sh("echo one; echo two >&2; exit 0")), ("second", sh("test -s \"$0\"; exit 3"))],
        )
        .expect("start");
        let done = beside.join().expect("join");
        assert_eq!(done.iter().map(|d| d.name).collect::<Vec<_>>(), ["first", "second"]);
        assert!(matches!(done[0].ok, Ok(true)));
        assert!(matches!(done[1].ok, Ok(false)), "exit 3 is a failure");
        assert_eq!(std::fs::read_to_string(&done[0].log).expect("log"), "one\ntwo\n");
        let _ = std::fs::remove_dir_all(logs);
    }

    #[test]
    fn dropped_early_it_kills_the_task_running_and_starts_no_other() {
        let logs = std::env::temp_dir().join(format!("xtask-beside-drop-{}", std::process::id()));
        let marker = logs.join("second-ran");
        let grandchild = logs.join("grandchild.pid");
        std::fs::create_dir_all(&logs).expect("logs");
        let second = format!("touch {}", marker.display());
        let beside = Beside::start(
            logs.clone(),
            vec![
                ("sleeper", sh(&format!("sleep 600 & echo $! > {}; wait", grandchild.display()))),
                ("second", sh(&second)),
            ],
        )
        .expect("start");
        let guard = std::time::Instant::now();
        let pid = loop {
            let started = std::fs::read_to_string(&grandchild).is_ok_and(|p| p.ends_with('\n'));
            if let Some(child) = beside.running.lock().expect("lock").as_ref().filter(|_| started) {
                break child.id();
            }
            assert!(guard.elapsed().as_secs() < 60, "the first task never started");
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        // As a failed test run drops it: not joined. The drop returns once the thread has ended.
        drop(beside);
        assert!(
            std::fs::metadata(format!("/proc/{pid}")).is_err(),
            "the sleeper outlived the drop (or was not reaped)"
        );
        assert!(!marker.exists(), "a task started after the drop");
        // What the task started is killed too (it is no one's child here: not reaped, a zombie
        // at most until init reaps it).
        let sleeper: u32 = std::fs::read_to_string(&grandchild).expect("its pid").trim().parse().expect("a pid");
        let gone = || std::fs::read_to_string(format!("/proc/{sleeper}/stat")).map_or(true, |s| s.contains(") Z "));
        let guard = std::time::Instant::now();
        while !gone() {
            assert!(guard.elapsed().as_secs() < 60, "the task's own child outlived the drop");
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let _ = std::fs::remove_dir_all(logs);
    }
}
