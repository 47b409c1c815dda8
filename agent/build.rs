//! Builds the kernel programs (`agent-ebpf`) for the BPF target and leaves the object in
//! `OUT_DIR`, where `src/kernel/programs.rs` embeds it: `target/release/valet-agent` is one
//! self-contained binary.
//!
//! Toolchain for the BPF build, first match wins:
//! 1. `VALET_EBPF_TOOLCHAIN=<rustup toolchain>` if set;
//! 2. `nightly` with `rust-src` (the aya route on a laptop);
//! 3. `stable` with `rust-src` and `RUSTC_BOOTSTRAP=1` (what `cargo xtask setup` installs here);
//! 4. `valet-system`, Debian's rustc-web + rust-web-src linked into rustup by `cargo xtask setup`
//!    when rustup cannot add `rust-src`, also with `RUSTC_BOOTSTRAP=1`.
use std::process::Command;

use anyhow::{Context as _, bail};

/// Whether a rustup toolchain exists and has the standard library source (`-Z build-std`).
fn has_rust_src(toolchain: &str) -> bool {
    let Ok(out) = Command::new("rustup").args(["run", toolchain, "rustc", "--print", "sysroot"]).output() else {
        return false;
    };
    if !out.status.success() {
        return false;
    }
    let sysroot = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    std::path::Path::new(&sysroot).join("lib/rustlib/src/rust/library/core/Cargo.toml").exists()
}

fn main() -> anyhow::Result<()> {
    println!("cargo:rerun-if-env-changed=VALET_EBPF_TOOLCHAIN");
    let root = std::env::var("CARGO_MANIFEST_DIR").context("CARGO_MANIFEST_DIR")?;
    let root = std::path::Path::new(&root);
    let ebpf_dir = root.join("../agent-ebpf");
    let ebpf_dir = ebpf_dir.to_str().context("non-UTF-8 path")?.to_owned();
    println!("cargo:rerun-if-changed={}", root.join("../common").display());

    let chosen = match std::env::var("VALET_EBPF_TOOLCHAIN") {
        Ok(name) if !name.is_empty() => name,
        _ => {
            let Some(found) = ["nightly", "stable", "valet-system"].into_iter().find(|t| has_rust_src(t)) else {
                bail!(
                    "no Rust toolchain with rust-src for the BPF build: run `cargo xtask setup`, or \
                     `rustup toolchain install nightly --component rust-src`"
                );
            };
            found.to_owned()
        }
    };
    if chosen != "nightly" {
        // Lets a stable compiler take `-Z build-std=core`; aya-build reads it and the BPF cargo
        // inherits it.
        // SAFETY: build scripts are single-threaded here.
        unsafe { std::env::set_var("RUSTC_BOOTSTRAP", "1") };
    }
    let toolchain =
        if chosen == "nightly" { aya_build::Toolchain::Nightly } else { aya_build::Toolchain::Custom(&chosen) };
    aya_build::build_ebpf(
        [aya_build::Package { name: "valet-agent-ebpf", root_dir: &ebpf_dir, ..Default::default() }],
        toolchain,
    )
}
