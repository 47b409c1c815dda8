//! `cargo xtask kernels`: the kernel tests and one end-to-end scenario on the Debian kernels users
//! run (bullseye 5.10, bookworm 6.1, trixie 6.12), each booted in qemu.
//!
//! Everything comes from Debian through a private apt state under /var/cache/valet/vm (the host's
//! apt configuration is only read, to learn its Debian mirror): the `linux-image` package of each
//! suite and `busybox-static`. From the package we take the uncompressed `vmlinux` (PVH direct
//! boot: no bootloader, no decompression under TCG) and the few modules a guest needs to mount the
//! host's `/` read-only over virtio-9p. A busybox initramfs mounts it, with proc, sysfs, devtmpfs,
//! cgroup2, tracefs, bpffs and tmpfs `/run` and `/tmp` on top, and switches root into it; host-built
//! test binaries then run in the guest as they run on the host. Results come back on the serial
//! console. Every qemu has a hard deadline and is killed when it passes.
//!
//! arm64 kernels (Debian's `linux-image-arm64` of the same suites) boot under qemu-system-aarch64
//! (`virt` machine) with the test binaries cross-built for aarch64. Their userland is arm64 too:
//! Debian's packages the tests call (glibc, util-linux, iproute2, coreutils, busybox), extracted
//! from the same mirror into an ext4 disk ([`arm64_userland`]) that the guest boots from, written
//! to a snapshot. The host's `/` is read-only at `/host` there, and the checkout, the target
//! directory and the run's script are bound from it to their host paths.
//!
//! The packages, the kernel with its initramfs and the qemu run are `vm`'s, shared with the node
//! VM (`node.rs`); this module is the suite: which kernels, which binaries, the guest's script
//! and the verdict on its console.
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, anyhow, bail};

use crate::arch::Arch;
use crate::vm::CACHE;
use crate::vm::apt::{Apt, arm64_rootfs};
use crate::vm::kernel::Kernel;
use crate::vm::qemu::{Killed, foreign_fault, qemu};

/// Where the guest mounts tmpfs over the host's read-only root: host paths below them (a checkout
/// or a target directory under /tmp) are bound back into the guest (`valet.keep=`).
const GUEST_TMPFS: &[&str] = &["/tmp", "/run"];
/// The end-to-end scenario run on every kernel.
const SCENARIO: &str = "labelled_job_pod_proxy_quits_when_the_app_exits";
/// The test binaries the guests run: the kernel tests, the scenario, and the agent under the
/// DaemonSet's capabilities (what each is needed for, SYS_RESOURCE's memlock limit above all,
/// depends on the kernel).
const TEST_BINARIES: [&str; 4] = ["kernel", "shutdown", "privileges", "degraded"];
/// Test threads of the kernel and privileges suites in a guest (it has 2 CPUs): both suites run
/// their tests concurrently on the host too. One thread leaves a guest CPU idle: 6.12's kernel
/// tests took 206 s with one thread and 148 s with two; 5.10's 255 s with either, the second at a
/// load of 3 from a build beside it (2026-11-28).
const GUEST_TEST_THREADS: u32 = 2;
/// Issue 34's degraded nodes: every guest also runs the degraded test with an empty tmpfs over
/// `/sys/kernel/btf` (a kernel without BTF), and the newest kernel boots once more with
/// `lockdown=confidentiality` to run it alone ([`boot`]).
const LOCKDOWN: &str = "lockdown=confidentiality";
/// A guest that has not powered off by then is killed and its kernel counted as failed: a hang
/// guard, not a pace. One kernel's suites take about 5 minutes under TCG on an idle 2-core
/// machine; 5.10's took 13 minutes at a load of 3 (two other qemu guests and a build beside it),
/// and 15 minutes killed it before it had finished.
const DEADLINE: Duration = Duration::from_secs(40 * 60);

/// The matrix: Debian suite and the kernel series it ships.
pub(crate) const MATRIX: [(&str, &str); 3] = [("bullseye", "5.10"), ("bookworm", "6.1"), ("trixie", "6.12")];
/// The arm64 kernel of a default run (CI's): the other two run with `cargo xtask kernels arm64`.
pub(crate) const DEFAULT_ARM64: &str = "trixie";

/// The kernels named by `only`: suite names or kernel series (amd64), the same after `arm64/`
/// (`arm64/trixie`, `arm64/6.12`), or `amd64`/`arm64` for the whole series of one architecture.
/// When empty: every amd64 kernel and arm64's [`DEFAULT_ARM64`].
pub(crate) fn suites(only: &[String]) -> Result<Vec<(&'static str, Arch)>> {
    if only.is_empty() {
        let mut all: Vec<_> = MATRIX.iter().map(|(s, _)| (*s, Arch::Amd64)).collect();
        all.push((DEFAULT_ARM64, Arch::Arm64));
        return Ok(all);
    }
    let mut picked = Vec::new();
    for o in only {
        let (arch, name) = match o.split_once('/') {
            Some(("arm64", rest)) => (Arch::Arm64, rest),
            Some(("amd64", rest)) => (Arch::Amd64, rest),
            _ if o == "arm64" || o == "amd64" => {
                let arch = if o == "arm64" { Arch::Arm64 } else { Arch::Amd64 };
                picked.extend(MATRIX.iter().map(|(s, _)| (*s, arch)));
                continue;
            }
            _ => (Arch::Amd64, o.as_str()),
        };
        let suite = MATRIX.iter().find(|(s, v)| name == *s || name == *v).map(|(s, _)| *s).ok_or_else(|| {
            anyhow!(
                "unknown kernel {o:?}: one of {}, each also as arm64/<name>; or amd64, arm64",
                MATRIX.map(|(s, v)| format!("{s} ({v})")).join(", ")
            )
        })?;
        picked.push((suite, arch));
    }
    picked.dedup();
    Ok(picked)
}

/// Boots each suite's kernel, runs the tests in it and prints `kernel <uname -r>: N passed, N failed`
/// per kernel. Returns the summed (passed, failed) counts; an error only when the matrix could not
/// be run at all (no mirror, no download, no qemu).
pub(crate) fn run(root: &Path, suites: &[(&str, Arch)]) -> Result<(u64, u64)> {
    let started = Instant::now();
    let apt = Apt::new()?;
    let mut kernels = Vec::new();
    for &(suite, arch) in suites {
        let t = Instant::now();
        let busybox = apt.busybox(arch)?;
        let kernel = Kernel::prepare(&apt, suite, arch, &busybox)
            .with_context(|| format!("prepare the {suite} {arch:?} kernel"))?;
        println!("kernels: {suite}: {} {} ready in {:.0?}", kernel.package, kernel.version, t.elapsed());
        kernels.push(kernel);
    }
    let host = Arch::host();
    let mut guests = BTreeMap::new();
    for arch in [Arch::Amd64, Arch::Arm64] {
        if kernels.iter().any(|k| k.arch == arch) {
            let bins = Binaries::build(root, arch)?;
            let userland = match arch {
                _ if arch == host => Userland::Host(apt.busybox(arch)?),
                Arch::Arm64 => arm64_userland(&apt)?,
                Arch::Amd64 => bail!("amd64 kernels boot on an amd64 host only (their userland is the host's)"),
            };
            guests.insert(arch.deb(), (bins, userland));
        }
    }
    let mut lines = Vec::new();
    let (mut passed, mut failed) = (0, 0);
    // One boot's line, printed now and again in the summary, and its counts.
    let mut tally = |name: String, t: Instant, outcome: Outcome| {
        let line = format!(
            "kernel {name}: {} passed, {} failed{}",
            outcome.passed,
            outcome.failed,
            outcome.note.as_deref().map(|n| format!(" ({n})")).unwrap_or_default()
        );
        println!("{line}  [{:.0?} boot + tests under TCG]", t.elapsed());
        lines.push(line);
        passed += outcome.passed;
        failed += outcome.failed;
    };
    for kernel in &kernels {
        let t = Instant::now();
        let (bins, userland) = &guests[kernel.arch.deb()];
        tally(kernel.release.clone(), t, boot(root, kernel, bins, userland, false)?);
    }
    // The newest kernel of the first architecture run boots once more, locked down.
    if let Some(kernel) = kernels.iter().rfind(|k| k.arch == kernels[0].arch) {
        let t = Instant::now();
        let (bins, userland) = &guests[kernel.arch.deb()];
        tally(format!("{} {LOCKDOWN}", kernel.release), t, boot(root, kernel, bins, userland, true)?);
    }
    println!("\nkernel matrix ({:.0?}):", started.elapsed());
    for line in lines {
        println!("{line}");
    }
    Ok((passed, failed))
}

/// The host-built binaries the guests run.
struct Binaries {
    kernel_test: PathBuf,
    shutdown_test: PathBuf,
    privileges_test: PathBuf,
    degraded_test: PathBuf,
    agent: PathBuf,
    standin: PathBuf,
    /// Cargo's target directory.
    target: PathBuf,
}

impl Binaries {
    /// The host's build, or a cross-build for `arch` (`--target`, in `<target>/<triple>/release`).
    fn build(root: &Path, arch: Arch) -> Result<Self> {
        let release = crate::cmd::build_release_bins_for(root, arch)?;
        let cross: &[&str] = if arch == Arch::host() { &[] } else { &["--target", arch.triple()] };
        let out = crate::cmd::cargo()
            .current_dir(root)
            .args(["test", "--release", "-p", "valet-tests", "--no-run"])
            .args(cross)
            .args(TEST_BINARIES.iter().flat_map(|t| ["--test", t]))
            .args(["--message-format=json"])
            .stderr(Stdio::inherit())
            .output()
            .context("cargo test --no-run")?;
        if !out.status.success() {
            bail!("building the test binaries {TEST_BINARIES:?} failed");
        }
        let mut found = BTreeMap::new();
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else { continue };
            let name = msg["target"]["name"].as_str().unwrap_or_default();
            if let Some(exe) = msg["executable"].as_str()
                && TEST_BINARIES.contains(&name)
            {
                found.insert(name.to_string(), PathBuf::from(exe));
            }
        }
        let take = |n: &str| found.get(n).cloned().ok_or_else(|| anyhow!("cargo named no executable for test {n}"));
        Ok(Self {
            target: crate::cmd::target_dir(root)?,
            kernel_test: take("kernel")?,
            shutdown_test: take("shutdown")?,
            privileges_test: take("privileges")?,
            degraded_test: take("degraded")?,
            agent: release.join("valet-agent"),
            standin: release.join("valet-standin-proxy"),
        })
    }
}

/// What one guest reported.
struct Outcome {
    passed: u64,
    failed: u64,
    note: Option<String>,
}

/// The guest's script: the test binaries, their summaries on the console, then power off. The
/// tests' output is not captured: a panic (a verifier log) reaches the console when it happens,
/// not at the end of a run the deadline may cut short. `VALET_KERNEL_TESTS` (a test name filter)
/// narrows the kernel tests. Locked down (`lockdown`): the degraded test alone, under the
/// kernel's lockdown, which the script reads back.
fn guest_script(root: &Path, bins: &Binaries, busybox: &Path, lockdown: bool) -> String {
    let tests = if lockdown {
        format!(
            r#"mount -t securityfs securityfs /sys/kernel/security
echo "VALET-VM-UNAME $(uname -r) $(cat /sys/kernel/security/lockdown)"
cd {tests}
echo "VALET-VM-BEGIN degraded"
VALET_DEGRADED_NODE=lockdown {degraded} --test-threads=1 --nocapture --color=never 2>&1
echo "VALET-VM-END degraded $?"
"#,
            tests = root.join("tests").display(),
            degraded = bins.degraded_test.display(),
        )
    } else {
        let filter = std::env::var("VALET_KERNEL_TESTS").unwrap_or_default();
        format!(
            r#"echo "VALET-VM-UNAME $(uname -r)"
cd {tests}
echo "VALET-VM-BEGIN kernel"
{kernel} --test-threads={threads} --nocapture --color=never {filter} 2>&1
echo "VALET-VM-END kernel $?"
echo "VALET-VM-BEGIN shutdown"
{shutdown} --exact {scenario} --test-threads=1 --nocapture --color=never 2>&1
echo "VALET-VM-END shutdown $?"
echo "VALET-VM-BEGIN privileges"
{privileges} --test-threads={threads} --nocapture --color=never 2>&1
echo "VALET-VM-END privileges $?"
echo "VALET-VM-BEGIN degraded"
mount -t tmpfs -o size=64k,mode=755 nobtf /sys/kernel/btf && VALET_DEGRADED_NODE=no_btf {degraded} --test-threads=1 --nocapture --color=never 2>&1
code=$?
umount /sys/kernel/btf
echo "VALET-VM-END degraded $code"
"#,
            tests = root.join("tests").display(),
            kernel = bins.kernel_test.display(),
            shutdown = bins.shutdown_test.display(),
            privileges = bins.privileges_test.display(),
            degraded = bins.degraded_test.display(),
            scenario = SCENARIO,
            threads = GUEST_TEST_THREADS,
            filter = filter.split_whitespace().collect::<Vec<_>>().join(" "),
        )
    };
    format!(
        r#"export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root RUST_BACKTRACE=1
export VALET_AGENT_BIN={agent} VALET_STANDIN_PROXY={standin}
ip link set lo up
{tests}sync
echo "VALET-VM-DONE"
{busybox} poweroff -f
"#,
        agent = bins.agent.display(),
        standin = bins.standin.display(),
        busybox = busybox.display(),
    )
}

/// The userland a guest's tests run in.
enum Userland {
    /// The host's `/` (the same architecture), with the host's static busybox.
    Host(PathBuf),
    /// Another architecture's userland on a disk image ([`arm64_userland`]).
    Disk(PathBuf),
}

impl Userland {
    /// The static busybox the guest script calls, by its path in the guest.
    fn busybox(&self) -> PathBuf {
        match self {
            Self::Host(busybox) => busybox.clone(),
            Self::Disk(_) => PathBuf::from("/bin/busybox"),
        }
    }

    /// The kernel command line's `valet.*` entries and qemu's extra arguments that boot a guest
    /// running `script` (in `run_dir`) with the checkout and the test binaries at their host paths.
    fn boot_args(&self, root: &Path, bins: &Binaries, run_dir: &Path, script: &Path) -> Result<(String, Vec<String>)> {
        let mut append = format!("valet.run={} valet.shell={}", script.display(), self.busybox().display());
        let (keep, extra) = match self {
            Self::Host(_) => (kept_paths(&[root, &bins.target], false)?, Vec::new()),
            Self::Disk(disk) => {
                append.push_str(" valet.disk=/dev/vda");
                let drive = format!("file={},format=raw,if=virtio,snapshot=on", disk.display());
                (kept_paths(&[root, &bins.target, run_dir], true)?, vec!["-drive".to_string(), drive])
            }
        };
        if !keep.is_empty() {
            append.push_str(&format!(" valet.keep={}", keep.join(",")));
        }
        Ok((append, extra))
    }
}

/// The arm64 guests' userland ([`ARM64_USERLAND`], extracted with mmdebstrap: no maintainer
/// script runs, so no emulator is needed), as an ext4 image cached per package list.
fn arm64_userland(apt: &Apt) -> Result<Userland> {
    let rootfs = arm64_rootfs(apt)?;
    let image = rootfs.with_extension("img");
    if !image.exists() {
        let tmp = image.with_extension("tmp");
        crate::cmd::run(
            Command::new("mke2fs")
                .args(["-q", "-t", "ext4", "-L", "valet-arm64", "-d"])
                .arg(&rootfs)
                .arg(&tmp)
                .arg("768M"),
        )?;
        std::fs::rename(&tmp, &image)?;
    }
    Ok(Userland::Disk(image))
}

/// Boots `kernel` with `userland`, runs the guest's script ([`guest_script`]) and judges its
/// console. Locked down (`lockdown`): with `lockdown=confidentiality` (no `bpf_probe_read_kernel`,
/// no tracefs reads), the degraded test alone: valet's programs cannot run there.
fn boot(root: &Path, kernel: &Kernel, bins: &Binaries, userland: &Userland, lockdown: bool) -> Result<Outcome> {
    let name = if lockdown { format!("{}-lockdown", kernel.release) } else { kernel.release.clone() };
    let dir = Path::new(CACHE).join("run").join(name);
    std::fs::create_dir_all(&dir)?;
    let script = dir.join("run.sh");
    std::fs::write(&script, guest_script(root, bins, &userland.busybox(), lockdown))?;
    let (append, extra) = userland.boot_args(root, bins, &dir, &script)?;
    let append = if lockdown { format!("{LOCKDOWN} {append}") } else { append };
    let (lines, killed) = qemu_guest(kernel, &append, &extra, &dir)?;
    let mut outcome = judge(&lines);
    if let Some(killed) = killed {
        outcome.failed += 1;
        outcome.note = Some(format!("{killed}; console: {}", dir.join("console.log").display()));
    }
    Ok(outcome)
}

/// [`qemu`] for a kernel guest (console in `dir`), booted once more, from the start, when its
/// kernel panicked with no BPF program on its stack ([`foreign_panic`]) or hung with nothing of
/// valet's on its CPUs ([`Killed::foreign_hang`]): said in the log, the
/// first console kept as `console-panicked.log`.
fn qemu_guest(kernel: &Kernel, append: &str, extra: &[String], dir: &Path) -> Result<(Vec<String>, Option<Killed>)> {
    let console = dir.join("console.log");
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    let (lines, killed) = qemu(kernel, append, &extra, &console, DEADLINE)?;
    let Some(panic) = foreign_fault(&lines, killed.as_ref()) else { return Ok((lines, killed)) };
    let kept = dir.join("console-panicked.log");
    std::fs::rename(&console, &kept)?;
    println!(
        "[{}] the guest kernel panicked or hung with nothing of valet's on its stacks ({panic}); console: {}; \
         booted again",
        kernel.release,
        kept.display()
    );
    qemu(kernel, append, &extra, &console, DEADLINE)
}

/// The paths among `paths` (resolved) that lie below one of the guest's tmpfs mounts
/// ([`GUEST_TMPFS`]) and must be bound back over it, or all of them when `all` (a guest with a
/// userland of its own), outermost only.
fn kept_paths(paths: &[&Path], all: bool) -> Result<Vec<String>> {
    let mut keep: Vec<PathBuf> = Vec::new();
    for path in paths {
        let real = std::fs::canonicalize(path).with_context(|| format!("resolve {}", path.display()))?;
        let tmpfs = GUEST_TMPFS.iter().map(Path::new).find(|t| real.starts_with(t));
        if tmpfs.is_none() && !all {
            continue;
        }
        if tmpfs.is_some_and(|t| real == t) || real == Path::new("/") {
            bail!("{} is the guest's tmpfs mount point itself: move it into a directory below it", real.display());
        }
        let text = real.to_string_lossy();
        if text.contains([' ', ',', '\t', '\n']) {
            bail!("{text}: the guest's kernel command line cannot carry a path with blanks or commas");
        }
        keep.push(real);
    }
    keep.sort();
    let mut outer: Vec<PathBuf> = Vec::new();
    for p in keep {
        if !outer.iter().any(|o| p.starts_with(o)) {
            outer.push(p);
        }
    }
    Ok(outer.iter().map(|p| p.to_string_lossy().into_owned()).collect())
}

/// Counts the cargo test summaries of the test binaries. A binary that ended (or was cut off by the
/// deadline) without a summary counts the test results it printed, plus one failure, with the
/// reason; so does a guest that never finished.
fn judge(lines: &[String]) -> Outcome {
    let mut outcome = Outcome { passed: 0, failed: 0, note: None };
    let mut notes = Vec::new();
    // The binary running now, and the results its tests printed so far (without --nocapture a
    // result ends its `test name ... ` line; with it, it may stand on a line of its own).
    let mut open: Option<(String, u64, u64)> = None;
    for line in lines {
        let trimmed = line.trim();
        if let Some(rest) = trimmed.strip_prefix("test result: ") {
            open = None;
            let words: Vec<&str> = rest.split([' ', ';']).filter(|w| !w.is_empty()).collect();
            for pair in words.windows(2) {
                let Ok(n) = pair[0].parse::<u64>() else { continue };
                match pair[1] {
                    "passed" => outcome.passed += n,
                    "failed" => outcome.failed += n,
                    _ => {}
                }
            }
        } else if let Some(what) = line.strip_prefix("VALET-VM-BEGIN ") {
            open = Some((what.trim().to_string(), 0, 0));
        } else if let Some(rest) = line.strip_prefix("VALET-VM-END ") {
            let code = rest.split_whitespace().nth(1).unwrap_or("?");
            if let Some((what, passed, failed)) = open.take() {
                outcome.passed += passed;
                outcome.failed += failed + 1;
                notes.push(format!("{what} tests ended without a summary (exit {code})"));
            }
        } else if let Some(rest) = line.strip_prefix("VALET-VM-FAILED: ") {
            outcome.failed += 1;
            notes.push(format!("guest setup failed: {rest}"));
        } else if let Some((_, passed, failed)) = open.as_mut() {
            if trimmed == "ok" || trimmed.ends_with(" ... ok") {
                *passed += 1;
            } else if trimmed == "FAILED" || trimmed.ends_with(" ... FAILED") {
                *failed += 1;
            }
        }
    }
    if let Some((what, passed, failed)) = open {
        outcome.passed += passed;
        outcome.failed += failed;
        notes.push(format!("{what} tests cut off after {} results", passed + failed));
    }
    if !lines.iter().any(|l| l == "VALET-VM-DONE") {
        outcome.failed += 1;
        notes.push("the guest stopped before the tests finished".into());
    }
    if !notes.is_empty() {
        outcome.note = Some(notes.join("; "));
    }
    outcome
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_names_pick_suites_and_architectures() -> Result<()> {
        let names = |v: &[&str]| suites(&v.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        let all = names(&[])?;
        assert_eq!(all.len(), 4, "every amd64 kernel and one arm64: {all:?}");
        assert_eq!(all.iter().filter(|(_, a)| *a == Arch::Arm64).collect::<Vec<_>>(), [&(DEFAULT_ARM64, Arch::Arm64)]);
        assert_eq!(names(&["6.1"])?, [("bookworm", Arch::Amd64)]);
        assert_eq!(names(&["arm64/5.10", "arm64/trixie"])?, [("bullseye", Arch::Arm64), ("trixie", Arch::Arm64)]);
        assert_eq!(names(&["arm64"])?.len(), 3);
        assert!(names(&["arm64/4.19"]).is_err());
        assert!(names(&["riscv64/6.1"]).is_err());
        Ok(())
    }

    #[test]
    fn keeps_outermost_paths_below_the_guest_tmpfs() -> Result<()> {
        let base = std::env::temp_dir().join(format!("valet-keep-{}", std::process::id()));
        let (repo, target) = (base.join("repo"), base.join("repo/target"));
        std::fs::create_dir_all(&target)?;
        let elsewhere = std::env::current_dir()?;
        let keep = kept_paths(&[&target, &repo, &elsewhere], false);
        std::fs::remove_dir_all(&base)?;
        let real = std::fs::canonicalize(std::env::temp_dir())?;
        if GUEST_TMPFS.iter().any(|t| real.starts_with(t)) && !elsewhere.starts_with("/tmp") {
            assert_eq!(keep?, vec![real.join(format!("valet-keep-{}/repo", std::process::id())).display().to_string()]);
        }
        assert!(kept_paths(&[Path::new("/tmp")], false).is_err());
        // A guest with its own userland gets every path, outermost only.
        assert_eq!(kept_paths(&[&elsewhere, &elsewhere.join("src")], true)?, vec![elsewhere.display().to_string()]);
        Ok(())
    }

    #[test]
    fn judges_summaries_and_missing_ones() {
        let lines = |s: &str| s.lines().map(str::to_string).collect::<Vec<_>>();
        let ok = judge(&lines(
            "VALET-VM-BEGIN kernel\ntest result: ok. 9 passed; 0 failed; 0 ignored\nVALET-VM-END kernel 0\n\
             VALET-VM-BEGIN shutdown\ntest result: FAILED. 0 passed; 1 failed; 0 ignored\nVALET-VM-END shutdown 101\n\
             VALET-VM-DONE",
        ));
        assert_eq!((ok.passed, ok.failed, ok.note), (9, 1, None));
        let crashed = judge(&lines("VALET-VM-BEGIN kernel\nVALET-VM-END kernel 139\nVALET-VM-DONE"));
        assert_eq!((crashed.passed, crashed.failed), (0, 1));
        assert!(crashed.note.unwrap_or_default().contains("exit 139"));
        let hung = judge(&lines("VALET-VM-BEGIN kernel"));
        assert_eq!(hung.failed, 1);
        let cut = judge(&lines(
            "VALET-VM-BEGIN kernel\ntest a ... ok\ntest b ... thread 'b' panicked at x.rs:1:1:\nload\nFAILED\ntest c ... ",
        ));
        assert_eq!((cut.passed, cut.failed), (1, 2));
        assert!(cut.note.unwrap_or_default().contains("cut off after 2 results"));
    }
}
