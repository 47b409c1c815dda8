//! `cargo xtask lint`: formatting, clippy on the host crates and the fuzz targets, clippy on the
//! kernel programs for the BPF target, no import circle among the modules of the agent or of
//! xtask ([`imports`]), and no file or function too long to read ([`size`]). Every step runs;
//! each ends with a one-line verdict.
use std::path::Path;
use std::process::Command;

use anyhow::{Result, bail};

use crate::cmd::cargo;
use crate::{imports, setup, size};

pub(crate) fn lint(root: &Path) -> Result<()> {
    // Clippy on the agent runs its build script, which builds the BPF object: same tools as a build.
    setup::build_tools()?;
    let bpf = setup::bpf_toolchain()?;
    setup::lint_tools(&bpf)?;

    let mut fmt = cargo();
    fmt.args(["fmt", "--all", "--check"]);

    let mut host = cargo();
    host.args(["clippy", "--workspace", "--exclude", "valet-agent-ebpf", "--all-targets", "--", "-D", "warnings"]);

    // fuzz/ is a workspace of its own (cargo-fuzz builds it instrumented): `--all` above does not
    // reach it. Its clippy build shares the host crates' target directory: the same dependencies
    // at the same versions are checked once (on a cold machine that saves about 2.5 minutes of
    // checking the agent's dependency tree again into fuzz/target).
    let fuzz_manifest = root.join("fuzz/Cargo.toml");
    let mut fuzz_fmt = cargo();
    fuzz_fmt.args(["fmt", "--all", "--check", "--manifest-path"]).arg(&fuzz_manifest);
    let mut fuzz_clippy = cargo();
    fuzz_clippy
        .args(["clippy", "--all-targets", "--manifest-path"])
        .arg(&fuzz_manifest)
        .arg("--target-dir")
        .arg(crate::cmd::target_dir(root)?)
        .args(["--", "-D", "warnings"]);

    // The kernel crate only builds for the BPF target, with the toolchain agent/build.rs picks.
    // Clippy only checks, so bpf-linker is not involved; its own target dir keeps it from
    // invalidating the host build.
    let mut kernel = Command::new("rustup");
    kernel
        .args(["run", &bpf.name, "cargo", "clippy", "-p", "valet-agent-ebpf", "--target", "bpfel-unknown-none"])
        .args(["-Z", "build-std=core", "--release", "--target-dir"])
        .arg(root.join("target/bpf-lint"))
        .args(["--", "-D", "warnings"])
        .env_remove("RUSTC")
        .env_remove("RUSTC_WORKSPACE_WRAPPER");
    if bpf.bootstrap {
        kernel.env("RUSTC_BOOTSTRAP", "1");
    }
    let kernel_name = format!("clippy, kernel crate for bpfel-unknown-none (toolchain {})", bpf.name);

    let mut verdicts = source_checks(root)?;
    for (name, cmd) in [
        ("rustfmt", &mut fmt),
        ("rustfmt, fuzz targets", &mut fuzz_fmt),
        ("clippy, host crates", &mut host),
        ("clippy, fuzz targets", &mut fuzz_clippy),
        (kernel_name.as_str(), &mut kernel),
    ] {
        println!("xtask lint: {name}: {cmd:?}");
        let ok = cmd.current_dir(root).status().is_ok_and(|s| s.success());
        let verdict = format!("xtask lint: {:<6} {name}", if ok { "ok" } else { "FAILED" });
        println!("{verdict}");
        verdicts.push((ok, verdict));
    }
    println!();
    for (_, verdict) in &verdicts {
        println!("{verdict}");
    }
    let failed = verdicts.iter().filter(|(ok, _)| !ok).count();
    if failed > 0 {
        bail!("{failed} lint step(s) failed");
    }
    Ok(())
}

/// The checks that read the sources (no build): the kernel crate's architecture-neutral API, no
/// import circle, and sizes a reader can hold ([`size`]). Each prints its offenders and verdict.
fn source_checks(root: &Path) -> Result<Vec<(bool, String)>> {
    let mut verdicts = Vec::new();
    let name = "kernel crate: no architecture-specific API (one BPF object for amd64 and arm64)";
    let found = arch_specific(&root.join("agent-ebpf/src"))?;
    for hit in &found {
        println!("xtask lint: {hit}: pt_regs differ per architecture; agent/build.rs builds one object for all");
    }
    let verdict = format!("xtask lint: {:<6} {name}", if found.is_empty() { "ok" } else { "FAILED" });
    println!("{verdict}");
    verdicts.push((found.is_empty(), verdict));
    let name = "no import circle between the modules of the agent, nor of xtask";
    let mut circles = 0;
    for src in ["agent/src", "xtask/src"] {
        for circle in imports::circles(&root.join(src))? {
            circles += 1;
            println!("xtask lint: {src}: modules that import each other round:");
            for import in circle {
                println!("    {import}");
            }
        }
    }
    let verdict = format!("xtask lint: {:<6} {name}", if circles == 0 { "ok" } else { "FAILED" });
    println!("{verdict}");
    verdicts.push((circles == 0, verdict));
    let name = format!(
        "no file over {} code lines, no fn over {} lines but marked tables (`// table: why`)",
        size::MAX_FILE,
        size::MAX_FN
    );
    let (found, fixed) = size::check(root)?;
    for o in &found {
        println!("xtask lint: {o}");
    }
    for f in &fixed {
        println!("xtask lint: {f}: fits now; take it out of size::PENDING");
    }
    let ok = found.is_empty() && fixed.is_empty();
    let verdict = format!("xtask lint: {:<6} {name}", if ok { "ok" } else { "FAILED" });
    println!("{verdict}");
    verdicts.push((ok, verdict));
    Ok(verdicts)
}

/// Lines of the kernel crate that use aya-ebpf's architecture-dependent API (`pt_regs` and the
/// probe contexts that read it): the BPF object is built once for every target architecture.
fn arch_specific(dir: &Path) -> Result<Vec<String>> {
    const NAMES: [&str; 6] =
        ["pt_regs", "PtRegs", "ProbeContext", "RetProbeContext", "FEntryContext", "bpf_target_arch"];
    let mut hits = Vec::new();
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            hits.extend(arch_specific(&path)?);
        } else if path.extension().is_some_and(|e| e == "rs") {
            for (n, line) in std::fs::read_to_string(&path)?.lines().enumerate() {
                if NAMES.iter().any(|name| line.contains(name)) {
                    hits.push(format!("{}:{}", path.display(), n + 1));
                }
            }
        }
    }
    Ok(hits)
}
