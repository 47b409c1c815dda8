//! Builds the kernel programs (`agent-ebpf`) for the BPF target and leaves the object in
//! `OUT_DIR`, where `src/kernel/programs.rs` embeds it: `target/release/valet-agent` is one
//! self-contained binary.
//!
//! Toolchain: `nightly` with `rust-src` by default (the aya route). `VALET_EBPF_TOOLCHAIN` names
//! another rustup toolchain, e.g. `stable` (with `RUSTC_BOOTSTRAP=1`, which `cargo xtask` sets)
//! or a linked system toolchain (`rustup toolchain link valet-system /usr`, the Debian fallback
//! that `cargo xtask setup` installs when rustup cannot add `rust-src`).
use anyhow::Context as _;

fn main() -> anyhow::Result<()> {
    println!("cargo:rerun-if-env-changed=VALET_EBPF_TOOLCHAIN");
    let root = std::env::var("CARGO_MANIFEST_DIR").context("CARGO_MANIFEST_DIR")?;
    let ebpf_dir = std::path::Path::new(&root).join("../agent-ebpf");
    let ebpf_dir = ebpf_dir.to_str().context("non-UTF-8 path")?.to_owned();
    let common_dir = std::path::Path::new(&root).join("../common");
    println!("cargo:rerun-if-changed={}", common_dir.display());
    let toolchain = std::env::var("VALET_EBPF_TOOLCHAIN").ok();
    let toolchain = match toolchain.as_deref() {
        None | Some("") | Some("nightly") => aya_build::Toolchain::Nightly,
        Some(name) => aya_build::Toolchain::Custom(name),
    };
    aya_build::build_ebpf(
        [aya_build::Package {
            name: "valet-agent-ebpf",
            root_dir: &ebpf_dir,
            ..Default::default()
        }],
        toolchain,
    )
}
