//! `cargo xtask test`: every test, privileged ones included, with one summary count at the end.
use std::io::BufRead as _;
use std::path::Path;
use std::process::{Child, Command, Stdio};

use anyhow::{Context as _, Result, bail};

use crate::cmd::{build_release_bins, cargo, is_root};
use crate::setup;

/// `cpu_hog`: that many busy loops run beside the tests, from the build's end to the run's end
/// (failed or not), to show that no test depends on the machine's pace (`--cpu-hog 2` keeps a
/// 2-core machine's cores busy, as a CI neighbour would).
pub(crate) fn test(root: &Path, filter: Option<&str>, vm: bool, kernels: &[String], cpu_hog: usize) -> Result<()> {
    if !is_root() {
        bail!("the test suite has privileged tests (eBPF, cgroups, namespaces): run it as root");
    }
    setup::setup(root, true)?;
    // The agent binary is what the end-to-end tests run, like a DaemonSet would; the stand-in
    // proxy is what they run as the sidecar.
    let release = build_release_bins(root)?;
    let envoy = setup::envoy(root)?;
    let tests = || {
        let mut cmd = cargo();
        cmd.current_dir(root)
            .args(["test", "--workspace", "--exclude", "valet-agent-ebpf", "--no-fail-fast"])
            .env("VALET_AGENT_BIN", release.join("valet-agent"))
            .env("VALET_STANDIN_PROXY", release.join("valet-standin-proxy"))
            .env("VALET_ENVOY", &envoy);
        cmd
    };
    // Built first, so that what runs beside them overlaps their run, not their build.
    crate::cmd::run(tests().arg("--no-run"))?;
    let _hog = CpuHog::start(cpu_hog)?;
    // The fuzz targets and the image build while the tests wait on their agents (crate::beside).
    let beside = if filter.is_none() { Some(beside(root)?) } else { None };
    let mut tally = Tally::default();
    let mut cmd = tests();
    if let Some(f) = filter {
        cmd.args(["--", f]);
    }
    let mut ok = run_counted(&mut cmd, &mut tally)?;
    if filter.is_none() && root.join("deploy/tests").is_dir() {
        ok &= run_counted(
            Command::new(root.join(".venv/bin/python")).current_dir(root).args(["-m", "pytest", "-q", "deploy/tests"]),
            &mut tally,
        )?;
    }
    if let Some(beside) = beside {
        ok &= match beside.join() {
            Ok(done) => replay(done, &mut tally)?,
            Err(e) => {
                println!("the fuzz targets and the image: FAILED: {e:#}");
                tally.failed += 1;
                false
            }
        };
    }
    // The qemu suites: Debian's 5.10, 6.1 and 6.12 kernels, arm64's 6.12, and the node cells
    // bookworm/runc/kubeadm and sid/crun/k3s (containerd, the agent also from its image under the
    // DaemonSet's privileges); `cargo xtask node --matrix` runs the other cells.
    if filter.is_none() && vm {
        let suites = crate::kernels::suites(kernels)?;
        let names: Vec<String> = suites.iter().map(|(s, a)| format!("{s} ({})", a.deb())).collect();
        println!("\nkernel matrix in qemu: {}", names.join(", "));
        let (passed, failed) = crate::kernels::run(root, &suites)?;
        (tally.passed, tally.failed) = (tally.passed + passed, tally.failed + failed);
        println!(
            "\nreal node in qemu: containerd through the CRI, the node scenarios (every cell: cargo xtask node --matrix)"
        );
        let (passed, failed) = crate::node::run(root, &crate::node::ci_plan())?;
        (tally.passed, tally.failed) = (tally.passed + passed, tally.failed + failed);
    }
    println!("\ntotal: {} passed, {} failed", tally.passed, tally.failed);
    if !ok || tally.failed > 0 {
        bail!("some tests failed");
    }
    if tally.passed == 0 {
        bail!("no test ran");
    }
    Ok(())
}

/// `cargo xtask kernels`: the kernel tests and one end-to-end scenario on every kernel of the matrix.
pub(crate) fn kernels(root: &Path, only: &[String]) -> Result<()> {
    if !is_root() {
        bail!("the kernel matrix boots qemu guests that load eBPF programs: run it as root");
    }
    let suites = crate::kernels::suites(only)?;
    setup::setup(root, true)?;
    let (_, failed) = crate::kernels::run(root, &suites)?;
    if failed > 0 {
        bail!("{failed} failed on the kernel matrix");
    }
    Ok(())
}

/// `cargo xtask node`: valet on a real node (a Debian VM with containerd driven through the CRI),
/// in the default cell, the named cells, or every cell of the matrix.
pub(crate) fn node(root: &Path, matrix: bool, cells: &[String], only: &[String], lag: Option<u32>) -> Result<()> {
    if !is_root() {
        bail!("the node VM needs root (mmdebstrap, qemu): run it as root");
    }
    let cells = if matrix {
        crate::node::matrix()
    } else if cells.is_empty() {
        vec![crate::node::DEFAULT_CELL]
    } else {
        cells.iter().map(|c| crate::node::Cell::parse(c)).collect::<Result<Vec<_>>>()?
    };
    if let Some(runs) = lag {
        // No agent, no Envoy: containerd, busybox and pause only.
        return crate::node_lag::lag(root, &cells, runs);
    }
    setup::setup(root, true)?;
    let plan: Vec<_> = cells.into_iter().map(|c| (c, only.to_vec())).collect();
    let (_, failed) = crate::node::run(root, &plan)?;
    if failed > 0 {
        bail!("{failed} failed on the real node");
    }
    Ok(())
}

/// Starts the fuzz targets and then the image (each platform's agent run with `--version` under
/// its architecture) beside the tests.
fn beside(root: &Path) -> Result<crate::beside::Beside> {
    let xtask = std::env::current_exe().context("own executable")?;
    let mut image = Command::new(&xtask);
    image.current_dir(root).arg("image");
    let logs = crate::cmd::target_dir(root)?.join("xtask-logs");
    crate::beside::Beside::start(logs, vec![("fuzz", crate::fuzz::command()?), ("image", image)])
}

/// Prints the output of the tasks run beside the tests and counts it: the fuzz targets' summary
/// line, and the image as one test per architecture. Whether every task exited 0.
fn replay(done: Vec<crate::beside::Done>, tally: &mut Tally) -> Result<bool> {
    let mut ok = true;
    for task in done {
        let log = std::fs::read_to_string(&task.log).unwrap_or_default();
        // The image prints no summary of its own: it counts by its exit.
        let image = task.name == "image";
        if image {
            println!("\nthe agent's image: linux/{}", crate::image::ARCHITECTURES.join(", linux/"));
        }
        for line in log.lines() {
            println!("{line}");
            if !image {
                tally.read(line);
            }
        }
        let passed = matches!(task.ok, Ok(true));
        match &task.ok {
            Ok(true) if image => tally.passed += crate::image::ARCHITECTURES.len() as u64,
            Ok(true) => {}
            Ok(false) => println!("{}: FAILED (its output above, also in {})", task.name, task.log.display()),
            Err(e) => println!("{}: FAILED: {e:#}", task.name),
        }
        if !passed {
            // A task that never printed its summary counts as one failure.
            tally.failed += u64::from(image || !log.lines().any(|l| l.starts_with("fuzz: ")));
        }
        ok &= passed;
    }
    Ok(ok)
}

/// Busy loops beside the test run; ended when dropped (on every way out of [`test`]).
struct CpuHog(Vec<Child>);

impl CpuHog {
    fn start(n: usize) -> Result<CpuHog> {
        let mut hog = CpuHog(Vec::with_capacity(n));
        if n > 0 {
            println!("{n} busy loop(s) run beside the tests (--cpu-hog)");
        }
        for _ in 0..n {
            // The loop also ends by itself once this process is gone (killed, say), since its
            // test of the parent fails then: no loop outlives the run.
            let child = Command::new("sh")
                .args(["-c", "while kill -0 $PPID 2>/dev/null; do :; done"])
                .stdin(Stdio::null())
                .spawn()
                .context("spawn a busy loop for --cpu-hog")?;
            hog.0.push(child);
        }
        Ok(hog)
    }
}

impl Drop for CpuHog {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Runs a test runner, echoing its output and counting its results. Whether it exited 0.
fn run_counted(cmd: &mut Command, tally: &mut Tally) -> Result<bool> {
    let mut child = cmd.stdout(Stdio::piped()).spawn().with_context(|| format!("spawn {cmd:?}"))?;
    if let Some(out) = child.stdout.take() {
        for line in std::io::BufReader::new(out).lines() {
            let line = line?;
            println!("{line}");
            tally.read(&line);
        }
    }
    Ok(child.wait()?.success())
}

/// Passed and failed test counts, summed over runners.
#[derive(Default)]
struct Tally {
    passed: u64,
    failed: u64,
}

impl Tally {
    /// Reads a runner's summary line: cargo's `test result: ok. 3 passed; 1 failed; ...` or
    /// pytest's `51 passed in 8.70s` / `2 failed, 49 passed in ...`.
    fn read(&mut self, line: &str) {
        let line = line.trim();
        let cargo = line.strip_prefix("test result: ");
        let pytest = !line.starts_with("test ")
            && (line.contains(" passed") || line.contains(" failed"))
            && line.contains(" in ");
        if cargo.is_none() && !pytest {
            return;
        }
        let words: Vec<&str> = cargo.unwrap_or(line).split([' ', ';', ',']).collect();
        for pair in words.windows(2) {
            let Ok(n) = pair[0].parse::<u64>() else { continue };
            match pair[1] {
                "passed" => self.passed += n,
                "failed" => self.failed += n,
                _ => {}
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{CpuHog, Tally};

    #[test]
    fn the_busy_loops_run_until_dropped() {
        let hog = CpuHog::start(2).expect("busy loops");
        let pids: Vec<u32> = hog.0.iter().map(std::process::Child::id).collect();
        let running = |pid: u32| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|s| s.rsplit(')').next().and_then(|r| r.split_whitespace().next()).map(str::to_owned))
                .is_some_and(|state| state != "Z")
        };
        assert!(pids.iter().all(|&p| running(p)), "a busy loop ended by itself");
        drop(hog);
        // Reaped on drop: gone, not even a zombie.
        assert!(pids.iter().all(|&p| !running(p)), "a busy loop outlived the run");
    }

    #[test]
    fn counts_cargo_and_pytest_summaries() {
        let mut t = Tally::default();
        t.read("test result: ok. 18 passed; 0 failed; 0 ignored; 0 measured; 0 filtered out; finished in 20.72s");
        t.read("test result: FAILED. 3 passed; 2 failed; 0 ignored; 0 measured; 0 filtered out; finished in 1s");
        t.read("51 passed in 8.70s");
        t.read("2 failed, 49 passed in 9.10s");
        t.read("test never_policy_failed_app ... ok");
        t.read("running 18 tests");
        assert_eq!((t.passed, t.failed), (18 + 3 + 51 + 49, 2 + 2));
    }
}
