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
//! `/dev/kvm` on the machines this runs on is a PVM hypervisor that cannot run stock kernels, so
//! qemu uses TCG (`microvm` has no timer under TCG and hangs: `q35`).
use std::collections::{BTreeMap, HashSet};
use std::io::{BufRead as _, Read as _, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context as _, Result, anyhow, bail};

pub(crate) const CACHE: &str = "/var/cache/valet/vm";
/// Modules the guest loads (with their dependencies) when the kernel does not build them in.
const GUEST_MODULES: &[&str] = &["virtio_pci", "9pnet_virtio", "9p"];
/// What the node VM (see `node.rs`) needs on top: its root disk, ext4 with checksums, overlayfs
/// for containerd's snapshotter, a bridge and veth pairs for the CNI bridge plugin. Loaded when
/// the kernel ships them.
const NODE_MODULES: &[&str] = &["virtio_blk", "crc32c_generic", "ext4", "overlay", "bridge", "veth"];
/// Bumped when the initramfs's contents change, so cached ones are rebuilt.
const INITRAMFS_VERSION: u32 = 4;
/// The arm64 guests' userland: what the tests and the guest script call, from Debian bookworm
/// (the glibc the cross-built binaries link against, 2.36).
const ARM64_USERLAND: &str =
    "libc6,libgcc-s1,dash,bash,coreutils,util-linux,mount,iproute2,procps,busybox-static,base-passwd,base-files";
const ARM64_USERLAND_SUITE: &str = "bookworm";
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
/// `lockdown=confidentiality` to run it alone ([`boot_locked_down`]).
const LOCKDOWN: &str = "lockdown=confidentiality";
/// A guest that has not powered off by then is killed and its kernel counted as failed: a hang
/// guard, not a pace. One kernel's suites take about 5 minutes under TCG on an idle 2-core
/// machine; 5.10's took 13 minutes at a load of 3 (two other qemu guests and a build beside it),
/// and 15 minutes killed it before it had finished.
const DEADLINE: Duration = Duration::from_secs(40 * 60);
/// Lists older than this are refreshed before a kernel version is chosen.
const LISTS_MAX_AGE: Duration = Duration::from_secs(7 * 24 * 3600);

/// The matrix: Debian suite and the kernel series it ships.
pub const MATRIX: [(&str, &str); 3] = [("bullseye", "5.10"), ("bookworm", "6.1"), ("trixie", "6.12")];
/// The arm64 kernel of a default run (CI's): the other two run with `cargo xtask kernels arm64`.
pub const DEFAULT_ARM64: &str = "trixie";

/// A kernel's architecture: the host's (amd64), or arm64 under qemu-system-aarch64.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arch {
    Amd64,
    Arm64,
}

impl Arch {
    /// Debian's name.
    pub const fn deb(self) -> &'static str {
        match self {
            Self::Amd64 => "amd64",
            Self::Arm64 => "arm64",
        }
    }

    /// Rust's target.
    pub const fn triple(self) -> &'static str {
        match self {
            Self::Amd64 => "x86_64-unknown-linux-gnu",
            Self::Arm64 => "aarch64-unknown-linux-gnu",
        }
    }

    /// The architecture this xtask runs on.
    pub const fn host() -> Self {
        if cfg!(target_arch = "aarch64") { Self::Arm64 } else { Self::Amd64 }
    }
}

/// The kernels named by `only`: suite names or kernel series (amd64), the same after `arm64/`
/// (`arm64/trixie`, `arm64/6.12`), or `amd64`/`arm64` for the whole series of one architecture.
/// When empty: every amd64 kernel and arm64's [`DEFAULT_ARM64`].
pub fn suites(only: &[String]) -> Result<Vec<(&'static str, Arch)>> {
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
pub fn run(root: &Path, suites: &[(&str, Arch)]) -> Result<(u64, u64)> {
    let started = Instant::now();
    let apt = Apt::new()?;
    let mut kernels = Vec::new();
    for &(suite, arch) in suites {
        let t = Instant::now();
        let busybox = apt.busybox(arch)?;
        let kernel =
            apt.kernel(suite, arch, &busybox).with_context(|| format!("prepare the {suite} {arch:?} kernel"))?;
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
        tally(kernel.release.clone(), t, boot(root, kernel, bins, userland)?);
    }
    // The newest kernel of the first architecture run boots once more, locked down.
    if let Some(kernel) = kernels.iter().rfind(|k| k.arch == kernels[0].arch) {
        let t = Instant::now();
        let (bins, userland) = &guests[kernel.arch.deb()];
        tally(format!("{} {LOCKDOWN}", kernel.release), t, boot_locked_down(root, kernel, bins, userland)?);
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

/// apt-get with its own sources, lists, status and archives under the cache.
pub(crate) struct Apt {
    dir: PathBuf,
    pub(crate) mirror: String,
}

/// A kernel ready to boot.
pub(crate) struct Kernel {
    arch: Arch,
    package: String,
    version: String,
    /// `uname -r`.
    release: String,
    /// What qemu boots: the uncompressed `vmlinux` on amd64 (PVH), the compressed `Image` on arm64.
    vmlinux: PathBuf,
    initramfs: PathBuf,
}

impl Apt {
    pub(crate) fn new() -> Result<Self> {
        let mirror = host_debian_mirror()?;
        let dir = Path::new(CACHE).join("apt");
        for d in ["lists/partial", "archives/partial", "etc/sources.list.d", "etc/preferences.d", "debs"] {
            std::fs::create_dir_all(dir.join(d))?;
        }
        let status = dir.join("status");
        if !status.exists() {
            std::fs::write(&status, "")?;
        }
        let sources: String = ["bullseye", "bookworm", "trixie"]
            .iter()
            .map(|s| format!("deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] {mirror} {s} main\n"))
            .collect();
        let list = dir.join("etc/sources.list");
        let changed = std::fs::read_to_string(&list).ok().as_deref() != Some(sources.as_str());
        if changed {
            std::fs::write(&list, &sources)?;
        }
        let apt = Self { dir, mirror };
        if changed || apt.lists_age().is_none_or(|age| age > LISTS_MAX_AGE) {
            apt.update()?;
        }
        Ok(apt)
    }

    fn options(&self, cmd: &mut Command) {
        let d = self.dir.display();
        for opt in [
            format!("Dir::Etc::SourceList={d}/etc/sources.list"),
            format!("Dir::Etc::SourceParts={d}/etc/sources.list.d"),
            format!("Dir::Etc::PreferencesParts={d}/etc/preferences.d"),
            format!("Dir::Etc::Preferences={d}/etc/preferences"),
            format!("Dir::State::Lists={d}/lists"),
            format!("Dir::State::status={d}/status"),
            format!("Dir::Cache={d}/cache"),
            format!("Dir::Cache::archives={d}/archives"),
            "APT::Architecture=amd64".into(),
            "APT::Architectures=amd64,arm64".into(),
            "Acquire::Languages=none".into(),
            "Acquire::IndexTargets::deb::DEP-11::DefaultEnabled=false".into(),
            "Acquire::IndexTargets::deb::DEP-11-icons::DefaultEnabled=false".into(),
            "Acquire::IndexTargets::deb::DEP-11-icons-small::DefaultEnabled=false".into(),
            "APT::Sandbox::User=root".into(),
        ] {
            cmd.args(["-o", &opt]);
        }
    }

    /// Time since the last successful update (apt dates the list files by the archive's
    /// Last-Modified, so a stamp of our own says when we fetched them).
    fn lists_age(&self) -> Option<Duration> {
        let stamp = std::fs::metadata(self.dir.join("updated")).ok()?.modified().ok()?;
        SystemTime::now().duration_since(stamp).ok()
    }

    fn update(&self) -> Result<()> {
        println!("kernels: apt-get update (private lists for bullseye, bookworm, trixie from {})", self.mirror);
        let mut cmd = Command::new("apt-get");
        self.options(&mut cmd);
        crate::cmd::run(cmd.args(["-qq", "update"]))?;
        std::fs::write(self.dir.join("updated"), "")?;
        Ok(())
    }

    /// `apt-cache show <pkg>:<arch>/<suite>` field values, first record.
    fn field(&self, pkg_suite: &str, arch: Arch, field: &str) -> Result<String> {
        let (pkg, suite) = pkg_suite.split_once('/').unwrap_or((pkg_suite, ""));
        let pkg_suite = format!("{pkg}:{}/{suite}", arch.deb());
        let pkg_suite = pkg_suite.trim_end_matches('/');
        let mut cmd = Command::new("apt-cache");
        self.options(&mut cmd);
        let out = cmd.args(["show", pkg_suite]).output()?;
        let text = String::from_utf8_lossy(&out.stdout);
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{field}: ")))
            .map(str::to_string)
            .ok_or_else(|| anyhow!("apt-cache show {pkg_suite}: no {field}"))
    }

    /// Downloads `pkg` of `arch` at `version` (cached) and returns the .deb's path.
    fn download(&self, pkg: &str, arch: Arch, version: &str) -> Result<PathBuf> {
        let debs = self.dir.join("debs");
        let file = debs.join(format!("{pkg}_{}_{}.deb", version.replace(':', "%3a"), arch.deb()));
        if file.exists() {
            return Ok(file);
        }
        println!("kernels: apt-get download {pkg}:{}={version}", arch.deb());
        let get = || {
            let mut cmd = Command::new("apt-get");
            self.options(&mut cmd);
            crate::cmd::run(cmd.current_dir(&debs).args([
                "-qq",
                "download",
                &format!("{pkg}:{}={version}", arch.deb()),
            ]))
        };
        if get().is_err() {
            // The mirror may have dropped a version our lists still name.
            self.update()?;
            get()?;
        }
        if !file.exists() {
            bail!("apt-get download {pkg}={version} left no {}", file.display());
        }
        Ok(file)
    }

    /// Debian's static busybox of `arch`, extracted once per version.
    pub(crate) fn busybox(&self, arch: Arch) -> Result<PathBuf> {
        let version = self.field("busybox-static/bookworm", arch, "Version")?;
        let dir = match arch {
            Arch::Amd64 => version.replace(':', "_"),
            Arch::Arm64 => format!("{}_{}", version.replace(':', "_"), arch.deb()),
        };
        let out = Path::new(CACHE).join(format!("busybox/{dir}/busybox"));
        if out.exists() {
            return Ok(out);
        }
        let deb = self.download("busybox-static", arch, &version)?;
        let tmp = scratch("busybox")?;
        crate::cmd::run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&tmp))?;
        std::fs::create_dir_all(out.parent().unwrap_or(Path::new(CACHE)))?;
        std::fs::copy(tmp.join("bin/busybox"), &out)?;
        std::fs::remove_dir_all(&tmp)?;
        Ok(out)
    }

    /// The suite's kernel of `arch`: its image and an initramfs (with `busybox`, of the same
    /// architecture) with its modules, cached per package version.
    pub(crate) fn kernel(&self, suite: &str, arch: Arch, busybox: &Path) -> Result<Kernel> {
        // linux-image-amd64 is the suite's metapackage: "Depends: linux-image-6.1.0-50-amd64 (= 6.1.176-1)".
        let meta = format!("linux-image-{}", arch.deb());
        let depends = self.field(&format!("{meta}/{suite}"), arch, "Depends")?;
        let (package, version) = parse_exact_dependency(&depends)
            .ok_or_else(|| anyhow!("{meta}/{suite}: unexpected Depends {depends:?}"))?;
        let dir = Path::new(CACHE).join("kernels").join(format!("{package}_{version}_i{INITRAMFS_VERSION}"));
        let kernel = |release: String| Kernel {
            arch,
            package: package.clone(),
            version: version.clone(),
            release,
            vmlinux: dir.join("vmlinux"),
            initramfs: dir.join("initramfs.cpio"),
        };
        if let Ok(release) = std::fs::read_to_string(dir.join("release")) {
            return Ok(kernel(release.trim().to_string()));
        }
        let deb = self.download(&package, arch, &version)?;
        let tmp = scratch("kernel")?;
        crate::cmd::run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&tmp))?;
        let modules_root = ["lib/modules", "usr/lib/modules"]
            .iter()
            .map(|d| tmp.join(d))
            .find(|d| d.is_dir())
            .ok_or_else(|| anyhow!("{package}: no lib/modules directory"))?;
        let release = std::fs::read_dir(&modules_root)?
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .next()
            .ok_or_else(|| anyhow!("{package}: empty modules directory"))?;
        let vmlinuz = tmp.join(format!("boot/vmlinuz-{release}"));
        std::fs::create_dir_all(&dir)?;
        let vmlinuz = std::fs::read(&vmlinuz).with_context(|| format!("read {vmlinuz:?}"))?;
        // qemu-system-aarch64 boots arm64's gzip-compressed `Image` as it is.
        let image = if arch == Arch::Amd64 { extract_vmlinux(&vmlinuz)? } else { vmlinuz };
        std::fs::write(dir.join("vmlinux"), image)?;
        let modules = guest_modules(&modules_root.join(&release))?;
        let names: Vec<&str> = modules.iter().map(|(n, _)| n.as_str()).collect();
        println!(
            "kernels: {release}: modules to load, in order: {}",
            if names.is_empty() { "none".into() } else { names.join(" ") }
        );
        write_initramfs(&dir.join("initramfs.cpio"), busybox, &modules)?;
        std::fs::remove_dir_all(&tmp)?;
        std::fs::write(dir.join("release"), &release)?;
        Ok(kernel(release))
    }
}

/// The URI of the host's Debian archive, from `apt-cache policy` (works for one-line and deb822
/// sources alike): the repository whose release has `o=Debian` and `l=Debian`.
pub(crate) fn host_debian_mirror() -> Result<String> {
    let out = Command::new("apt-cache").arg("policy").output().context("apt-cache policy")?;
    let text = String::from_utf8_lossy(&out.stdout);
    let mut uri = None;
    for line in text.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        if words.len() >= 3 && words[0].parse::<i32>().is_ok() && words[1].contains("://") {
            uri = Some(words[1].trim_end_matches('/').to_string());
        } else if let Some(release) = line.trim().strip_prefix("release ") {
            let fields: Vec<&str> = release.split(',').collect();
            if fields.contains(&"o=Debian")
                && fields.contains(&"l=Debian")
                && let Some(u) = uri.take()
            {
                return Ok(u);
            }
        }
    }
    bail!("the host's apt sources have no Debian archive (o=Debian, l=Debian in apt-cache policy)")
}

/// `"linux-image-6.1.0-50-amd64 (= 6.1.176-1)"` → (package, version).
fn parse_exact_dependency(depends: &str) -> Option<(String, String)> {
    let first = depends.split(',').next()?.trim();
    let (name, rest) = first.split_once(" (= ")?;
    Some((name.trim().to_string(), rest.strip_suffix(')')?.trim().to_string()))
}

fn scratch(what: &str) -> Result<PathBuf> {
    let dir = Path::new(CACHE).join(format!("tmp/{what}-{}", std::process::id()));
    if dir.exists() {
        std::fs::remove_dir_all(&dir)?;
    }
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// Decompresses with an external tool, tolerating trailing data (the rest of the bzImage).
fn decompress(tool: &str, data: &[u8]) -> Option<Vec<u8>> {
    let mut child = Command::new(tool)
        .args(["-dc"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    let mut stdin = child.stdin.take()?;
    let input = data.to_vec();
    let writer = std::thread::spawn(move || {
        let _ = stdin.write_all(&input);
    });
    let mut out = Vec::new();
    let _ = child.stdout.take()?.read_to_end(&mut out);
    let _ = child.wait();
    let _ = writer.join();
    Some(out)
}

/// The kernel's `extract-vmlinux`: find a compressed payload in the bzImage that decompresses to
/// an ELF file.
fn extract_vmlinux(vmlinuz: &[u8]) -> Result<Vec<u8>> {
    let formats: [(&[u8], &str); 4] = [
        (b"\xfd7zXZ\x00", "xz"),
        (b"\x28\xb5\x2f\xfd", "zstd"),
        (b"\x1f\x8b\x08", "gzip"),
        (b"\x02\x21\x4c\x18", "lz4"),
    ];
    for (magic, tool) in formats {
        let mut from = 0;
        while let Some(pos) = find(&vmlinuz[from..], magic).map(|p| p + from) {
            if let Some(out) = decompress(tool, &vmlinuz[pos..])
                && out.starts_with(b"\x7fELF")
            {
                return Ok(out);
            }
            from = pos + 1;
        }
    }
    bail!("no compressed ELF payload found in vmlinuz (tried xz, zstd, gzip, lz4)")
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// A module file's contents, decompressed.
fn read_module(path: &Path) -> Result<Vec<u8>> {
    let raw = std::fs::read(path)?;
    let name = path.to_string_lossy();
    let tool = if name.ends_with(".xz") {
        "xz"
    } else if name.ends_with(".zst") {
        "zstd"
    } else if name.ends_with(".gz") {
        "gzip"
    } else {
        return Ok(raw);
    };
    decompress(tool, &raw).filter(|m| m.starts_with(b"\x7fELF")).ok_or_else(|| anyhow!("decompress {name}"))
}

fn module_name(file: &str) -> String {
    file.split(".ko").next().unwrap_or(file).replace('-', "_")
}

/// The modules among [`GUEST_MODULES`] the kernel does not build in, with everything they depend
/// on, in load order (dependencies first), decompressed.
fn guest_modules(modules_dir: &Path) -> Result<Vec<(String, Vec<u8>)>> {
    let builtin: HashSet<String> = std::fs::read_to_string(modules_dir.join("modules.builtin"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.rsplit('/').next())
        .map(module_name)
        .collect();
    let mut files = BTreeMap::new();
    let mut stack = vec![modules_dir.join("kernel")];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir)?.flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
            } else if let Some(file) = path.file_name().map(|f| f.to_string_lossy().into_owned())
                && file.contains(".ko")
            {
                files.insert(module_name(&file), path);
            }
        }
    }
    let mut order = Vec::new();
    let mut seen = HashSet::new();
    fn visit(
        name: &str,
        files: &BTreeMap<String, PathBuf>,
        builtin: &HashSet<String>,
        seen: &mut HashSet<String>,
        order: &mut Vec<(String, Vec<u8>)>,
    ) -> Result<()> {
        if !seen.insert(name.to_string()) || builtin.contains(name) {
            return Ok(());
        }
        let path = files.get(name).ok_or_else(|| anyhow!("module {name} is neither built in nor shipped"))?;
        let bytes = read_module(path)?;
        for dep in modinfo_depends(&bytes) {
            visit(&dep, files, builtin, seen, order)?;
        }
        order.push((name.to_string(), bytes));
        Ok(())
    }
    for m in GUEST_MODULES {
        visit(m, &files, &builtin, &mut seen, &mut order)?;
    }
    for m in NODE_MODULES {
        if files.contains_key(*m) || builtin.contains(*m) {
            visit(m, &files, &builtin, &mut seen, &mut order)?;
        } else {
            println!("kernels: {} has no module {m} (the node VM cannot boot it)", modules_dir.display());
        }
    }
    Ok(order)
}

/// The `depends=` entry of a module's `.modinfo` section (NUL-separated `key=value` strings).
fn modinfo_depends(module: &[u8]) -> Vec<String> {
    let Some(pos) = find(module, b"\0depends=") else { return Vec::new() };
    let rest = &module[pos + 9..];
    let end = rest.iter().position(|&b| b == 0).unwrap_or(rest.len());
    String::from_utf8_lossy(&rest[..end]).split(',').filter(|s| !s.is_empty()).map(module_name).collect()
}

/// The guest's pid 1 before the switch to the host's root. Its command comes from the kernel
/// command line (`valet.run=`), run by the host's busybox under the new root.
const INIT: &str = r#"#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
fail() { echo "VALET-VM-FAILED: $*"; poweroff -f; sleep 10; }
mount -t proc proc /proc
mount -t devtmpfs devtmpfs /dev
for m in $(cat /modules); do insmod /lib/modules/$m.ko || fail "insmod $m"; done
run=$(sed -n 's/.*valet\.run=\([^ ]*\).*/\1/p' /proc/cmdline)
shell=$(sed -n 's/.*valet\.shell=\([^ ]*\).*/\1/p' /proc/cmdline)
P9="trans=virtio,version=9p2000.L,msize=262144,cache=loose"
root=$(sed -n 's/.*valet\.root=\([^ ]*\).*/\1/p' /proc/cmdline)
if [ -n "$root" ]; then
  # The node VM: its own root disk with systemd, the host's root read-only at /host.
  for i in $(seq 100); do [ -b "$root" ] && break; sleep 0.1; done
  mount -t ext4 "$root" /newroot || fail "mount $root"
  mount -t 9p -o ro,$P9 host /newroot/host || fail "mount the host root at /host"
  umount /proc
  exec switch_root /newroot /sbin/init
fi
R=/newroot
keep=$(sed -n 's/.*valet\.keep=\([^ ]*\).*/\1/p' /proc/cmdline | tr , ' ')
disk=$(sed -n 's/.*valet\.disk=\([^ ]*\).*/\1/p' /proc/cmdline)
if [ -n "$disk" ]; then
  # Another architecture's userland on a disk of its own (written to a snapshot), the host's
  # root read-only at /host: the paths the tests need are bound from there to the host's paths.
  for i in $(seq 100); do [ -b "$disk" ] && break; sleep 0.1; done
  mount -t ext4 "$disk" $R || fail "mount $disk"
  mount -t 9p -o ro,$P9 host $R/host || fail "mount the host root at /host"
  from=$R/host
else
  mount -t 9p -o ro,$P9 host $R || fail "mount the host root"
  # Host paths the tmpfs mounts below would hide (a checkout under /tmp): a second view of the
  # host's root, taken before they are mounted, lends them back.
  from=/hostroot
  if [ -n "$keep" ]; then mkdir -p /hostroot && mount --bind $R /hostroot || fail "bind the host root"; fi
fi
mount -t proc proc $R/proc || fail proc
mount -t sysfs sysfs $R/sys || fail sysfs
mount -t devtmpfs devtmpfs $R/dev || fail devtmpfs
mkdir -p $R/dev/pts $R/dev/shm
mount -t devpts devpts $R/dev/pts
mount -t tmpfs tmpfs $R/dev/shm
mount -t tmpfs -o mode=755 tmpfs $R/run || fail /run
mount -t tmpfs -o mode=1777 tmpfs $R/tmp || fail /tmp
mount -t cgroup2 cgroup2 $R/sys/fs/cgroup || fail cgroup2
mount -t tracefs tracefs $R/sys/kernel/tracing || fail tracefs
mount -t debugfs debugfs $R/sys/kernel/debug
mount -t bpf bpf $R/sys/fs/bpf || fail bpffs
for p in $keep; do
  mkdir -p "$R$p" && mount --bind "$from$p" "$R$p" || fail "bind $p from the host"
done
if [ -z "$disk" ] && [ -n "$keep" ]; then umount /hostroot || fail "unmount the second view of the host root"; fi
umount /proc
exec switch_root $R "$shell" sh "$run"
"#;

fn write_initramfs(out: &Path, busybox: &Path, modules: &[(String, Vec<u8>)]) -> Result<()> {
    let mut cpio = Cpio::default();
    for d in ["bin", "dev", "proc", "newroot", "lib", "lib/modules"] {
        cpio.dir(d);
    }
    cpio.console();
    cpio.file("bin/busybox", 0o755, &std::fs::read(busybox)?);
    cpio.file("init", 0o755, INIT.as_bytes());
    let list: String = modules.iter().map(|(n, _)| format!("{n}\n")).collect();
    cpio.file("modules", 0o644, list.as_bytes());
    for (name, bytes) in modules {
        cpio.file(&format!("lib/modules/{name}.ko"), 0o644, bytes);
    }
    std::fs::write(out, cpio.finish())?;
    Ok(())
}

/// A `newc` cpio archive, as the kernel unpacks an initramfs.
#[derive(Default)]
struct Cpio {
    buf: Vec<u8>,
    ino: u32,
}

impl Cpio {
    fn entry(&mut self, name: &str, mode: u32, rdev: (u32, u32), data: &[u8]) {
        self.ino += 1;
        let header = format!(
            "070701{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}",
            self.ino,
            mode,
            0,
            0,
            1,
            0,
            data.len(),
            0,
            0,
            rdev.0,
            rdev.1,
            name.len() + 1,
            0
        );
        self.buf.extend_from_slice(header.as_bytes());
        self.buf.extend_from_slice(name.as_bytes());
        self.buf.push(0);
        self.pad();
        self.buf.extend_from_slice(data);
        self.pad();
    }

    fn pad(&mut self) {
        while !self.buf.len().is_multiple_of(4) {
            self.buf.push(0);
        }
    }

    fn dir(&mut self, name: &str) {
        self.entry(name, 0o040755, (0, 0), &[]);
    }

    fn file(&mut self, name: &str, perm: u32, data: &[u8]) {
        self.entry(name, 0o100000 | perm, (0, 0), data);
    }

    /// `/dev/console`, so that init has a stdin, stdout and stderr before devtmpfs is mounted.
    fn console(&mut self) {
        self.entry("dev/console", 0o020600, (5, 1), &[]);
    }

    fn finish(mut self) -> Vec<u8> {
        self.entry("TRAILER!!!", 0, (0, 0), &[]);
        self.buf
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
/// narrows the kernel tests.
fn guest_script(root: &Path, bins: &Binaries, busybox: &Path) -> String {
    let filter = std::env::var("VALET_KERNEL_TESTS").unwrap_or_default();
    format!(
        r#"export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root RUST_BACKTRACE=1
export VALET_AGENT_BIN={agent} VALET_STANDIN_PROXY={standin}
ip link set lo up
echo "VALET-VM-UNAME $(uname -r)"
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
sync
echo "VALET-VM-DONE"
{busybox} poweroff -f
"#,
        agent = bins.agent.display(),
        standin = bins.standin.display(),
        tests = root.join("tests").display(),
        kernel = bins.kernel_test.display(),
        shutdown = bins.shutdown_test.display(),
        privileges = bins.privileges_test.display(),
        degraded = bins.degraded_test.display(),
        scenario = SCENARIO,
        threads = GUEST_TEST_THREADS,
        filter = filter.split_whitespace().collect::<Vec<_>>().join(" "),
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

/// The arm64 userland's files, cached per package list (also where the arm64 node's pod images
/// take util-linux's `unshare` from).
pub(crate) fn arm64_rootfs(apt: &Apt) -> Result<PathBuf> {
    // The key's last part changes with what is added to the packages' files below.
    let key = crate::node::fnv(&[ARM64_USERLAND_SUITE.as_bytes(), ARM64_USERLAND.as_bytes(), b"ca,passwd"]);
    let base = Path::new(CACHE).join("guest");
    let done = base.join(format!("arm64-{ARM64_USERLAND_SUITE}-{key:016x}"));
    if done.is_dir() {
        return Ok(done);
    }
    let debs = base.join("debs-arm64");
    std::fs::create_dir_all(&debs)?;
    let rootfs = scratch("arm64-userland")?;
    std::fs::remove_dir(&rootfs)?;
    println!("kernels: mmdebstrap the arm64 userland ({ARM64_USERLAND_SUITE}: {ARM64_USERLAND})");
    crate::cmd::run(
        Command::new("mmdebstrap")
            .args(["--variant=extract", "--architectures=arm64", "--quiet", &format!("--include={ARM64_USERLAND}")])
            .arg("--setup-hook=mkdir -p \"$1\"/var/cache/apt/archives/")
            .arg(format!("--setup-hook=sync-in {} /var/cache/apt/archives/", debs.display()))
            .arg(format!("--customize-hook=sync-out /var/cache/apt/archives {}", debs.display()))
            .arg(ARM64_USERLAND_SUITE)
            .arg(&rootfs)
            .arg(&apt.mirror),
    )?;
    for d in ["proc", "sys", "dev", "run", "tmp", "host", "root"] {
        std::fs::create_dir_all(rootfs.join(d))?;
    }
    // What maintainer scripts would have made: the CA bundle (ca-certificates'; the agent's
    // Kubernetes client loads it even for the fake API server's plain HTTP), the host's copy, and
    // base-passwd's users and groups.
    let bundle = "etc/ssl/certs/ca-certificates.crt";
    std::fs::create_dir_all(rootfs.join("etc/ssl/certs"))?;
    std::fs::copy(Path::new("/").join(bundle), rootfs.join(bundle)).with_context(|| format!("copy /{bundle}"))?;
    for (master, file) in [("passwd.master", "etc/passwd"), ("group.master", "etc/group")] {
        std::fs::copy(rootfs.join("usr/share/base-passwd").join(master), rootfs.join(file))
            .with_context(|| format!("{master} of base-passwd"))?;
    }
    std::fs::rename(&rootfs, &done)?;
    Ok(done)
}

fn boot(root: &Path, kernel: &Kernel, bins: &Binaries, userland: &Userland) -> Result<Outcome> {
    let dir = Path::new(CACHE).join("run").join(&kernel.release);
    std::fs::create_dir_all(&dir)?;
    let script = dir.join("run.sh");
    std::fs::write(&script, guest_script(root, bins, &userland.busybox()))?;
    let (append, extra) = userland.boot_args(root, bins, &dir, &script)?;
    let (lines, timed_out) = qemu_guest(kernel, &append, &extra, &dir)?;
    let mut outcome = judge(&lines);
    if timed_out {
        outcome.failed += 1;
        outcome.note = Some(format!("killed after {DEADLINE:?}; console: {}", dir.join("console.log").display()));
    }
    Ok(outcome)
}

/// Boots `kernel` locked down (`lockdown=confidentiality`: no `bpf_probe_read_kernel`, no
/// tracefs reads) and runs the degraded test alone: valet's programs cannot run there.
fn boot_locked_down(root: &Path, kernel: &Kernel, bins: &Binaries, userland: &Userland) -> Result<Outcome> {
    let busybox = userland.busybox();
    let dir = Path::new(CACHE).join("run").join(format!("{}-lockdown", kernel.release));
    std::fs::create_dir_all(&dir)?;
    let script = dir.join("run.sh");
    std::fs::write(
        &script,
        format!(
            r#"export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root RUST_BACKTRACE=1
export VALET_AGENT_BIN={agent} VALET_STANDIN_PROXY={standin}
ip link set lo up
mount -t securityfs securityfs /sys/kernel/security
echo "VALET-VM-UNAME $(uname -r) $(cat /sys/kernel/security/lockdown)"
cd {tests}
echo "VALET-VM-BEGIN degraded"
VALET_DEGRADED_NODE=lockdown {degraded} --test-threads=1 --nocapture --color=never 2>&1
echo "VALET-VM-END degraded $?"
sync
echo "VALET-VM-DONE"
{busybox} poweroff -f
"#,
            agent = bins.agent.display(),
            standin = bins.standin.display(),
            tests = root.join("tests").display(),
            degraded = bins.degraded_test.display(),
            busybox = busybox.display(),
        ),
    )?;
    let (append, extra) = userland.boot_args(root, bins, &dir, &script)?;
    let (lines, timed_out) = qemu_guest(kernel, &format!("{LOCKDOWN} {append}"), &extra, &dir)?;
    let mut outcome = judge(&lines);
    if timed_out {
        outcome.failed += 1;
        outcome.note = Some(format!("killed after {DEADLINE:?}; console: {}", dir.join("console.log").display()));
    }
    Ok(outcome)
}

/// [`qemu`] for a kernel guest (console in `dir`), booted once more, from the start, when its
/// kernel panicked with no BPF program on its stack ([`foreign_panic`]): said in the log, the
/// first console kept as `console-panicked.log`.
fn qemu_guest(kernel: &Kernel, append: &str, extra: &[String], dir: &Path) -> Result<(Vec<String>, bool)> {
    let console = dir.join("console.log");
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    let (lines, timed_out) = qemu(kernel, append, &extra, &console, DEADLINE)?;
    let Some(panic) = (!timed_out).then(|| foreign_panic(&lines)).flatten() else { return Ok((lines, timed_out)) };
    let kept = dir.join("console-panicked.log");
    std::fs::rename(&console, &kept)?;
    println!(
        "[{}] the guest kernel panicked with no BPF program on its stack ({panic}); console: {}; booted again",
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

/// Boots `kernel` with our initramfs and the host's `/` shared read-only, echoes the serial
/// console (prefixed with the kernel release) and keeps it in `console`. Returns the console's
/// lines and whether the guest had to be killed at `deadline`.
pub(crate) fn qemu(
    kernel: &Kernel,
    append: &str,
    extra: &[&str],
    console: &Path,
    deadline: Duration,
) -> Result<(Vec<String>, bool)> {
    let log = std::fs::File::create(console)?;
    // arm64: the `virt` machine, its PL011 console; `pauth-impdef` makes TCG's pointer
    // authentication cheap (QEMU's own algorithm instead of QARMA's).
    let (program, machine, cpu, tty) = match kernel.arch {
        Arch::Amd64 => ("qemu-system-x86_64", "q35", "max", "ttyS0"),
        Arch::Arm64 => ("qemu-system-aarch64", "virt", "max,pauth-impdef=on", "ttyAMA0"),
    };
    let append = format!("console={tty} panic=-1 loglevel=4 mitigations=off no_timer_check rdinit=/init {append}");
    let mut child = Command::new(program)
        .args(["-accel", "tcg,thread=multi,tb-size=256", "-cpu", cpu, "-machine", machine])
        .args(["-m", "2G", "-smp", "2", "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot"])
        .args(["-serial", "stdio", "-monitor", "none"])
        .args(["-virtfs", "local,path=/,mount_tag=host,security_model=none,readonly=on,multidevs=remap"])
        .arg("-kernel")
        .arg(&kernel.vmlinux)
        .arg("-initrd")
        .arg(&kernel.initramfs)
        .args(["-append", &append])
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("start {program}"))?;
    // The console is read on a thread (kept in `console`, its test lines echoed with a prefix) so
    // that the deadline is kept even when the guest prints nothing.
    let stdout = child.stdout.take().ok_or_else(|| anyhow!("qemu stdout"))?;
    let release = kernel.release.clone();
    let reader = std::thread::spawn(move || {
        let mut log = log;
        let mut lines = Vec::new();
        for line in std::io::BufReader::new(stdout).split(b'\n').map_while(|l| l.ok()) {
            let line = String::from_utf8_lossy(&line).trim_end_matches('\r').to_string();
            let _ = writeln!(log, "{line}");
            if echoed(&line) {
                let short: String = line.chars().take(400).collect();
                println!("[{release}] {short}");
            } else if line.contains("Verifier output") {
                // A panic's message with the verifier's log in Debug form: its reason is at the end.
                let pieces: Vec<&str> = line.split("\\n").filter(|p| !p.trim().is_empty()).collect();
                let tail = pieces.len().saturating_sub(5);
                let head: String = line.chars().take(160).collect();
                println!("[{release}] {head} ... {}", pieces[tail..].join(" | "));
            }
            lines.push(line);
        }
        lines
    });
    let deadline = Instant::now() + deadline;
    let mut timed_out = false;
    loop {
        if child.try_wait()?.is_some() {
            break;
        }
        if Instant::now() >= deadline {
            timed_out = true;
            let _ = child.kill();
            let _ = child.wait();
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let lines = reader.join().map_err(|_| anyhow!("console reader panicked"))?;
    Ok((lines, timed_out))
}

/// Console lines worth echoing: test names and results, panics (cut to 400 characters: a
/// verifier log is long; the whole of it is in the console log), the guest's own markers.
/// A guest kernel panic with no BPF program on its stack: a fault of the kernel or of the
/// emulator (QEMU's TCG has double-faulted a Debian kernel in its slab allocator's
/// `cmpxchg16b`), not of valet's programs. Returns its summary for the log: the oops line, the
/// faulting function and the task. `None` when the guest did not panic, or when a BPF program
/// (`bpf_prog_*`, a BPF helper) is on the panicking stack: that is valet's, and never rerun.
pub(crate) fn foreign_panic(lines: &[String]) -> Option<String> {
    let end = lines.iter().position(|l| l.contains("Kernel panic - not syncing"))?;
    let start = lines[..end]
        .iter()
        .position(|l| {
            l.contains("Oops:")
                || l.contains("BUG:")
                || l.contains("traps: PANIC")
                || l.contains("------------[ cut here ]")
        })
        .unwrap_or(end);
    // A panic() of its own prints its stack after its line, up to "---[ end Kernel panic".
    let last = lines[end..].iter().position(|l| l.contains("end Kernel panic")).map_or(lines.len() - 1, |i| end + i);
    let report = &lines[start.saturating_sub(1)..=last];
    if report.iter().any(|l| l.contains("bpf")) {
        return None;
    }
    let strip = |l: &String| l.split_once("] ").map_or(l.as_str(), |(_, r)| r).trim().to_string();
    let pick = |key: &str| report.iter().find(|l| l.contains(key)).map(strip);
    let parts: Vec<String> =
        [pick("Oops:").or_else(|| pick("BUG:")), pick("RIP: 0010:"), pick("Comm:"), Some(strip(&lines[end]))]
            .into_iter()
            .flatten()
            .collect();
    Some(parts.join(" | "))
}

fn echoed(line: &str) -> bool {
    const PREFIXES: [&str; 11] = [
        "test ",
        "degraded (",
        "running ",
        "VALET-",
        "thread '",
        "node",
        "kubelet:",
        "---",
        "without ",
        "BPF memory",
        "agent resident memory",
    ];
    PREFIXES.iter().any(|p| line.starts_with(p)) || line.contains("FAIL") || line.contains("Kernel panic")
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
    fn foreign_panic_and_ours() {
        let log = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/testdata/tcg-double-fault.log"))
            .expect("read the fixture");
        let lines: Vec<String> = log.lines().map(String::from).collect();
        let summary = foreign_panic(&lines).expect("a panic with no BPF program on its stack");
        assert!(summary.starts_with("Oops: double fault"), "{summary}");
        assert!(summary.contains("RIP: 0010:kmem_cache_alloc_node_noprof"), "{summary}");
        assert!(summary.contains("Comm: systemd"), "{summary}");
        assert!(summary.ends_with("Kernel panic - not syncing: Fatal exception in interrupt"), "{summary}");
        // The same panic with a BPF program on its stack is valet's: never rerun.
        let mut ours = lines.clone();
        let at = ours.iter().position(|l| l.contains("__alloc_skb+0x14a")).expect("its stack");
        ours.insert(at, "[  221.662036]  bpf_prog_6deef7357e7b4530_on_exit+0x52/0x9a".into());
        assert_eq!(foreign_panic(&ours), None);
        // No panic: the scenarios' own lines only.
        assert_eq!(foreign_panic(&lines[..lines.iter().position(|l| l.contains("traps:")).expect("its trap")]), None);
    }

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
    fn exact_dependency() {
        assert_eq!(
            parse_exact_dependency("linux-image-6.12.117+deb13-amd64 (= 6.12.117-1)"),
            Some(("linux-image-6.12.117+deb13-amd64".into(), "6.12.117-1".into()))
        );
        assert_eq!(parse_exact_dependency("linux-image-6.1.0-50-amd64"), None);
    }

    #[test]
    fn depends_from_modinfo() {
        let ko = b"\x7fELF....\0license=GPL\0depends=9pnet,netfs\0intree=Y\0";
        assert_eq!(modinfo_depends(ko), vec!["9pnet".to_string(), "netfs".to_string()]);
        assert!(modinfo_depends(b"\x7fELF\0depends=\0name=x\0").is_empty());
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
