//! Running commands: the few process helpers every task shares.
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context as _, Result, bail};

/// The workspace root (xtask lives one level below it).
pub(crate) fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().map(Path::to_path_buf).unwrap_or_default()
}

/// Cargo's target directory for the workspace (`CARGO_TARGET_DIR` or `build.target-dir` when set,
/// else `<root>/target`), as `cargo metadata` reports it.
pub(crate) fn target_dir(root: &Path) -> Result<PathBuf> {
    let out = cargo()
        .current_dir(root)
        .args(["metadata", "--no-deps", "--format-version", "1"])
        .stderr(Stdio::inherit())
        .output()
        .context("cargo metadata")?;
    if !out.status.success() {
        bail!("cargo metadata failed: {}", out.status);
    }
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).context("cargo metadata output")?;
    meta["target_directory"]
        .as_str()
        .map(PathBuf::from)
        .ok_or_else(|| anyhow::anyhow!("cargo metadata named no target_directory"))
}

/// Builds the release binaries every privileged suite runs (the agent, the stand-in proxy, the
/// fake API server) and returns the directory they are in.
pub(crate) fn build_release_bins(root: &Path) -> Result<PathBuf> {
    build_release_bins_for(root, crate::arch::Arch::host())
}

/// [`build_release_bins`] for `arch`: cross-built (`--target`) when it is not the host's, into
/// `<target>/<triple>/release`.
pub(crate) fn build_release_bins_for(root: &Path, arch: crate::arch::Arch) -> Result<PathBuf> {
    let mut cmd = cargo();
    cmd.current_dir(root).args(["build", "--release", "-p", "valet-agent", "-p", "valet-sim", "--bins"]);
    if arch == crate::arch::Arch::host() {
        run(&mut cmd)?;
        return Ok(target_dir(root)?.join("release"));
    }
    run(cmd.args(["--target", arch.triple()]))?;
    Ok(target_dir(root)?.join(arch.triple()).join("release"))
}

/// The cargo that runs xtask, so every step uses the same toolchain.
pub(crate) fn cargo() -> Command {
    Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
}

/// Runs a command with inherited output; fails unless it exits 0.
pub(crate) fn run(cmd: &mut Command) -> Result<()> {
    let status = cmd.status().with_context(|| format!("spawn {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed: {status}");
    }
    Ok(())
}

/// Whether a command runs and exits 0, its output discarded.
pub(crate) fn succeeds(cmd: &mut Command) -> bool {
    cmd.stdout(Stdio::null()).stderr(Stdio::null()).status().is_ok_and(|s| s.success())
}

pub(crate) fn is_root() -> bool {
    Command::new("id").arg("-u").output().is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

pub(crate) fn on_path(bin: &str) -> bool {
    succeeds(Command::new("sh").args(["-c", &format!("command -v {bin}")]))
}
