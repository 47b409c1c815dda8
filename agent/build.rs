//! Builds the kernel programs (`agent-ebpf`) for the BPF target and leaves the object in
//! `OUT_DIR`, where `src/kernel/programs/mod.rs` embeds it: `target/release/valet-agent` is one
//! self-contained binary.
//!
//! It runs the BPF cargo build the way aya-build 0.2.0 does (same arguments, flags and
//! target directory) but keeps that build's output to itself unless it fails: aya-build
//! forwards every `Compiling ...` line as a cargo warning. Compiler warnings still show.
//!
//! Toolchain for the BPF build, first match wins (`cargo xtask lint` chooses the same way):
//! 1. `VALET_EBPF_TOOLCHAIN=<rustup toolchain>` if set;
//! 2. `nightly` with `rust-src` (the aya route on a laptop);
//! 3. `stable` with `rust-src` and `RUSTC_BOOTSTRAP=1` (what `cargo xtask setup` installs here);
//! 4. `valet-system`, Debian's rustc-web + rust-web-src linked into rustup by `cargo xtask setup`
//!    when rustup cannot add `rust-src`, also with `RUSTC_BOOTSTRAP=1`.
//!
//! `VALET_EBPF_OBJECT=<file>` embeds an object already built instead. One object serves every
//! architecture: the programs are tracepoints that read their records and the kernel's structs at
//! offsets found at load time (format files, BTF), never `pt_regs` or syscall numbers, so the
//! `bpf_target_arch` cfg changes nothing in them (`cargo xtask lint` checks the crate never uses
//! them). Every architecture's build in one target directory shares one build of the object.
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context as _, bail};

const PACKAGE: &str = "valet-agent-ebpf";

/// Whether a rustup toolchain exists and has the standard library source (`-Z build-std`).
fn has_rust_src(toolchain: &str) -> bool {
    let Ok(out) = Command::new("rustup").args(["run", toolchain, "rustc", "--print", "sysroot"]).output() else {
        return false;
    };
    if !out.status.success() {
        return false;
    }
    let sysroot = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    Path::new(&sysroot).join("lib/rustlib/src/rust/library/core/Cargo.toml").exists()
}

fn toolchain() -> anyhow::Result<String> {
    if let Ok(name) = std::env::var("VALET_EBPF_TOOLCHAIN")
        && !name.is_empty()
    {
        return Ok(name);
    }
    match ["nightly", "stable", "valet-system"].into_iter().find(|t| has_rust_src(t)) {
        Some(found) => Ok(found.to_owned()),
        None => bail!(
            "no Rust toolchain with rust-src for the BPF build: run `cargo xtask setup`, or \
             `rustup toolchain install nightly --component rust-src`"
        ),
    }
}

fn env(name: &str) -> anyhow::Result<String> {
    std::env::var(name).with_context(|| format!("{name} not set"))
}

/// Cargo's own progress lines (`   Compiling x v1`), as opposed to compiler diagnostics.
fn is_progress(line: &str) -> bool {
    const VERBS: [&str; 10] = [
        "Compiling",
        "Finished",
        "Fresh",
        "Blocking",
        "Locking",
        "Updating",
        "Downloading",
        "Downloaded",
        "Adding",
        "Checking",
    ];
    let trimmed = line.trim_start();
    line.len() > trimmed.len() && VERBS.iter().any(|v| trimmed.strip_prefix(v).is_some_and(|r| r.starts_with(' ')))
}

fn main() {
    // Not `main() -> Result`: that prints a backtrace under RUST_BACKTRACE, burying the error.
    if let Err(e) = build() {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn build() -> anyhow::Result<()> {
    println!("cargo:rerun-if-env-changed=VALET_EBPF_TOOLCHAIN");
    println!("cargo:rerun-if-env-changed=VALET_EBPF_OBJECT");
    let out_dir = PathBuf::from(env("OUT_DIR")?);
    let embedded = out_dir.join(PACKAGE);
    if let Ok(object) = std::env::var("VALET_EBPF_OBJECT")
        && !object.is_empty()
    {
        println!("cargo:rerun-if-changed={object}");
        std::fs::copy(&object, &embedded).with_context(|| format!("copy VALET_EBPF_OBJECT {object}"))?;
        return Ok(());
    }
    let manifest_dir = PathBuf::from(env("CARGO_MANIFEST_DIR")?);
    let workspace = manifest_dir.parent().context("agent/ has no parent directory")?;
    // The kernel crate is also a build-dependency, which covers its library and dependencies;
    // its binary, the shared types and the release profile it is built with are covered here.
    for path in ["agent-ebpf", "common", "Cargo.toml"] {
        println!("cargo:rerun-if-changed={}", workspace.join(path).display());
    }

    let toolchain = toolchain()?;
    let target = match env("CARGO_CFG_TARGET_ENDIAN")?.as_str() {
        "little" => "bpfel-unknown-none",
        "big" => "bpfeb-unknown-none",
        other => bail!("unsupported endianness {other}"),
    };
    // One build of the kernel programs per target directory, shared by every profile that runs
    // this script (check, dev, release; clippy's and the fuzz targets' too) and by every target
    // architecture (an aarch64 cross-build embeds the object the host build made). The object
    // does not depend on the architecture: tracepoint fields are read at the offsets the
    // kernel's format files give, task fields at BTF's, and no program touches `pt_regs`
    // (`cargo xtask lint` checks that), so aya-ebpf's `bpf_target_arch` is left to its default.
    // Cargo's lock on the directory serialises concurrent builds, and its fingerprints rebuild
    // what changed. OUT_DIR is `<target dir>/[<triple>/]<profile>/build/<package>-<hash>/out`;
    // the target directory is the one that holds cargo's CACHEDIR.TAG, else the build stays in
    // OUT_DIR.
    let shared = out_dir
        .ancestors()
        .take(6)
        .find(|dir| dir.join("CACHEDIR.TAG").is_file())
        .filter(|_| out_dir.ancestors().nth(2).and_then(|b| b.file_name()).is_some_and(|n| n == "build"))
        .map(|dir| dir.join("bpf"));
    let target_dir = shared.unwrap_or_else(|| out_dir.join("bpf")).join(PACKAGE);

    let mut cargo = Command::new("rustup");
    cargo
        .args(["run", &toolchain, "cargo", "build", "--package", PACKAGE, "--bins", "--release"])
        .args(["--target", target, "-Z", "build-std=core", "--color", "never", "--target-dir"])
        .arg(&target_dir)
        .current_dir(&manifest_dir)
        .env("CARGO_ENCODED_RUSTFLAGS", "-Cdebuginfo=2\x1f-Clink-arg=--btf")
        // The host build's compiler settings are not the BPF toolchain's.
        .env_remove("RUSTC")
        .env_remove("RUSTC_WORKSPACE_WRAPPER");
    if !toolchain.starts_with("nightly") {
        // Lets a stable compiler take `-Z build-std=core`.
        cargo.env("RUSTC_BOOTSTRAP", "1");
    }
    let output = cargo.output().with_context(|| format!("spawn {cargo:?}"))?;
    let stderr = String::from_utf8_lossy(&output.stderr);
    if !output.status.success() {
        // Cargo shows a failed build script's stderr in full.
        for text in [String::from_utf8_lossy(&output.stdout), stderr] {
            if !text.trim().is_empty() {
                eprintln!("{}", text.trim_end());
            }
        }
        bail!("building the kernel programs failed ({}): {cargo:?}", output.status);
    }
    for line in String::from_utf8_lossy(&output.stderr).lines().filter(|l| !l.trim().is_empty() && !is_progress(l)) {
        println!("cargo:warning={line}");
    }

    let object = target_dir.join(target).join("release").join(PACKAGE);
    std::fs::copy(&object, &embedded)
        .with_context(|| format!("copy {} to {}", object.display(), embedded.display()))?;
    Ok(())
}
