//! valet's developer tasks.
//!
//! * `cargo xtask setup`  installs what building and testing need (idempotent, quiet when done).
//! * `cargo xtask test`   runs every test: unit, privileged integration (as root), manifests.
//! * `cargo xtask demo`   runs the agent against a simulated node on this host.
//! * `cargo xtask bench`  prints the performance figures.
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context as _, Result, bail};
use clap::{Parser, Subcommand};

mod kernels;
mod node;

#[derive(Parser)]
#[command(about = "valet developer tasks")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Install missing build and test prerequisites (rust-src, bpf-linker, tracefs, test tools).
    Setup,
    /// Run the whole test suite (needs root: privileged tests are never skipped).
    Test {
        /// Only run tests whose name contains this filter (Rust tests only).
        filter: Option<String>,
        /// Also boot every kernel of the matrix (CI boots only bookworm's).
        #[arg(long)]
        kernels: bool,
    },
    /// Run the kernel tests and one end-to-end scenario on Debian's 5.10, 6.1 and 6.12 kernels in qemu.
    Kernels,
    /// Run valet on a real node: a Debian VM with containerd driven through the CRI.
    Node,
    /// Run the agent against a simulated node on this host and print a timeline.
    Demo {
        /// Extra arguments for the demo driver.
        #[arg(trailing_var_arg = true)]
        args: Vec<String>,
    },
    /// Print latency and overhead figures.
    Bench {
        /// Extra arguments for the bench driver (e.g. `--runs 200`).
        #[arg(trailing_var_arg = true)]
        args: Vec<String>,
    },
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().map(Path::to_path_buf).unwrap_or_default()
}

fn run(cmd: &mut Command) -> Result<()> {
    let status = cmd.status().with_context(|| format!("spawn {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed: {status}");
    }
    Ok(())
}

fn succeeds(cmd: &mut Command) -> bool {
    cmd.stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

fn is_root() -> bool {
    Command::new("id").arg("-u").output().map(|o| String::from_utf8_lossy(&o.stdout).trim() == "0").unwrap_or(false)
}

fn on_path(bin: &str) -> bool {
    succeeds(Command::new("sh").args(["-c", &format!("command -v {bin}")]))
}

/// Says what setup did, once per action.
fn did(what: &str) {
    println!("xtask setup: {what}");
}

fn apt_install(packages: &[&str]) -> Result<()> {
    let installed = |p: &str| {
        Command::new("dpkg-query")
            .args(["-W", "-f=${Status}", p])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).contains("install ok installed"))
            .unwrap_or(false)
    };
    let missing: Vec<&str> = packages.iter().copied().filter(|p| !installed(p)).collect();
    if missing.is_empty() {
        return Ok(());
    }
    if !is_root() {
        bail!("missing Debian packages {missing:?}: install them (as root: apt-get install {})", missing.join(" "));
    }
    did(&format!("apt-get install {}", missing.join(" ")));
    run(Command::new("apt-get").args(["update", "-qq"]))?;
    run(Command::new("apt-get")
        .args(["install", "-y", "-qq", "--no-install-recommends"])
        .args(&missing)
        .env("DEBIAN_FRONTEND", "noninteractive"))
}

fn has_rust_src(toolchain: &str) -> bool {
    let Ok(out) = Command::new("rustup").args(["run", toolchain, "rustc", "--print", "sysroot"]).output() else {
        return false;
    };
    out.status.success()
        && Path::new(String::from_utf8_lossy(&out.stdout).trim())
            .join("lib/rustlib/src/rust/library/core/Cargo.toml")
            .exists()
}

/// A toolchain that can build the BPF object (`-Z build-std=core` needs rust-src).
fn ensure_rust_src() -> Result<()> {
    if ["nightly", "stable", "valet-system"].iter().any(|t| has_rust_src(t)) {
        return Ok(());
    }
    for toolchain in ["nightly", "stable"] {
        if succeeds(Command::new("rustup").args(["run", toolchain, "rustc", "--version"]))
            && succeeds(Command::new("rustup").args(["component", "add", "rust-src", "--toolchain", toolchain]))
            && has_rust_src(toolchain)
        {
            did(&format!("rustup component add rust-src --toolchain {toolchain}"));
            return Ok(());
        }
    }
    // Fallback: Debian's compiler and library source, linked into rustup under a fixed name
    // that agent/build.rs looks for.
    apt_install(&["rustc-web", "cargo-web", "rust-web-src"])?;
    run(Command::new("rustup").args(["toolchain", "link", "valet-system", "/usr"]))?;
    did("linked Debian rustc-web + rust-web-src as rustup toolchain valet-system");
    if !has_rust_src("valet-system") {
        bail!("no toolchain with rust-src after setup");
    }
    Ok(())
}

fn ensure_bpf_linker() -> Result<()> {
    if on_path("bpf-linker") {
        return Ok(());
    }
    // bpf-linker's default wants LLVM 23; Debian 12 backports carry LLVM 22.
    apt_install(&["llvm-22-dev", "libpolly-22-dev", "libzstd-dev", "zlib1g-dev"])?;
    did("cargo install bpf-linker (against LLVM 22, about a minute)");
    let path = format!("/usr/lib/llvm-22/bin:{}", std::env::var("PATH").unwrap_or_default());
    run(Command::new("cargo")
        .args([
            "install",
            "--locked",
            "bpf-linker",
            "--version",
            "0.13.0",
            "--no-default-features",
            "--features",
            "llvm-22",
        ])
        .env("PATH", path)
        .env("LLVM_SYS_221_PREFIX", "/usr/lib/llvm-22")
        .env("LLVM_SYS_220_PREFIX", "/usr/lib/llvm-22"))
}

fn ensure_tracefs() -> Result<()> {
    if Path::new("/sys/kernel/tracing/events").is_dir() || Path::new("/sys/kernel/debug/tracing/events").is_dir() {
        return Ok(());
    }
    if !is_root() {
        bail!("tracefs is not mounted: as root, mount -t tracefs tracefs /sys/kernel/tracing");
    }
    run(Command::new("mount").args(["-t", "tracefs", "tracefs", "/sys/kernel/tracing"]))?;
    did("mounted tracefs at /sys/kernel/tracing");
    Ok(())
}

/// Tools only the test suite needs: iproute2 for network namespaces, promtool and Prometheus for
/// the metrics tests, Python for the manifest checks.
fn ensure_test_tools(root: &Path) -> Result<()> {
    apt_install(&[
        "iproute2",
        "prometheus",
        "python3-venv",
        "util-linux",
        "procps",
        "qemu-system-x86",
        "xz-utils",
        "zstd",
    ])?;
    let venv = root.join(".venv");
    let requirements = root.join("deploy/tests/requirements.txt");
    let stamp = venv.join(".valet-requirements");
    let wanted = std::fs::read_to_string(&requirements).unwrap_or_default();
    if std::fs::read_to_string(&stamp).ok().as_deref() == Some(wanted.as_str()) {
        return Ok(());
    }
    if !venv.join("bin/python").exists() {
        run(Command::new("/usr/bin/python3").args(["-m", "venv"]).arg(&venv))?;
    }
    did("pip install -r deploy/tests/requirements.txt into .venv");
    run(Command::new(venv.join("bin/pip"))
        .args(["install", "-q", "--disable-pip-version-check", "-r"])
        .arg(&requirements))?;
    std::fs::write(&stamp, wanted)?;
    Ok(())
}

fn setup(root: &Path, for_tests: bool) -> Result<()> {
    ensure_rust_src()?;
    ensure_bpf_linker()?;
    ensure_tracefs()?;
    if for_tests {
        ensure_test_tools(root)?;
    }
    Ok(())
}

fn cargo() -> Command {
    Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
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

/// Runs a test runner, echoing its output and counting its results.
fn run_counted(cmd: &mut Command, tally: &mut Tally) -> Result<bool> {
    use std::io::BufRead as _;
    let mut child = cmd.stdout(std::process::Stdio::piped()).spawn().with_context(|| format!("spawn {cmd:?}"))?;
    if let Some(out) = child.stdout.take() {
        for line in std::io::BufReader::new(out).lines() {
            let line = line?;
            println!("{line}");
            tally.read(&line);
        }
    }
    Ok(child.wait()?.success())
}

fn test(root: &Path, filter: Option<String>, all_kernels: bool) -> Result<()> {
    if !is_root() {
        bail!("the test suite has privileged tests (eBPF, cgroups, namespaces): run it as root");
    }
    setup(root, true)?;
    // The agent binary is what the end-to-end tests run, like a DaemonSet would; the stand-in
    // proxy is what they run as the sidecar.
    run(cargo().current_dir(root).args(["build", "--release", "-p", "valet-agent", "-p", "valet-sim", "--bins"]))?;
    let mut tally = Tally::default();
    let mut cmd = cargo();
    cmd.current_dir(root)
        .args(["test", "--workspace", "--exclude", "valet-agent-ebpf", "--no-fail-fast"])
        .env("VALET_AGENT_BIN", root.join("target/release/valet-agent"))
        .env("VALET_STANDIN_PROXY", root.join("target/release/valet-standin-proxy"));
    if let Some(f) = &filter {
        cmd.args(["--", f.as_str()]);
    }
    let mut ok = run_counted(&mut cmd, &mut tally)?;
    if filter.is_none() && root.join("deploy/tests").is_dir() {
        ok &= run_counted(
            Command::new(root.join(".venv/bin/python")).current_dir(root).args(["-m", "pytest", "-q", "deploy/tests"]),
            &mut tally,
        )?;
    }
    if filter.is_none() {
        let suites: &[&str] = if all_kernels { &["bullseye", "bookworm", "trixie"] } else { &["bookworm"] };
        println!("\nkernel matrix in qemu: {} (all three: cargo xtask test --kernels)", suites.join(", "));
        let (passed, failed) = kernels::run(root, suites)?;
        (tally.passed, tally.failed) = (tally.passed + passed, tally.failed + failed);
        println!("\nreal node in qemu: containerd through the CRI, the Job scenario");
        if node::run(root)? { tally.passed += 1 } else { tally.failed += 1 }
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

fn sim_binary(root: &Path, bin: &str, args: &[String]) -> Result<()> {
    setup(root, false)?;
    run(cargo().current_dir(root).args([
        "build",
        "--release",
        "-p",
        "valet-agent",
        "-p",
        "valet-tests",
        "-p",
        "valet-sim",
    ]))?;
    let release = root.join("target/release");
    run(Command::new(release.join(bin))
        .args(args)
        .env("VALET_AGENT_BIN", release.join("valet-agent"))
        .env("VALET_STANDIN_PROXY", release.join("valet-standin-proxy")))
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let root = workspace_root();
    match cli.task {
        Task::Setup => setup(&root, true),
        Task::Test { filter, kernels } => test(&root, filter, kernels),
        Task::Node => {
            if !is_root() {
                bail!("the node VM needs root (mmdebstrap, qemu): run it as root");
            }
            setup(&root, true)?;
            if !node::run(&root)? {
                bail!("the real-node scenario failed");
            }
            Ok(())
        }
        Task::Kernels => {
            if !is_root() {
                bail!("the kernel matrix boots qemu guests that load eBPF programs: run it as root");
            }
            setup(&root, true)?;
            let (_, failed) = kernels::run(&root, &["bullseye", "bookworm", "trixie"])?;
            if failed > 0 {
                bail!("{failed} failed on the kernel matrix");
            }
            Ok(())
        }
        Task::Demo { args } => {
            if !is_root() {
                bail!("the demo creates cgroups and network namespaces: run it as root");
            }
            sim_binary(&root, "valet-demo", &args)
        }
        Task::Bench { args } => {
            if !is_root() {
                bail!("the benchmarks load eBPF programs: run them as root");
            }
            sim_binary(&root, "valet-bench", &args)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::Tally;

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
