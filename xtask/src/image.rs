//! `cargo xtask image`: the agent's OCI image, built without Docker or a registry from the release
//! binaries: an image index of linux/amd64 and linux/arm64 (the aarch64 agent cross-built with
//! Debian's cross gcc, its glibc and libgcc from Debian's cross sysroot), as an OCI image layout
//! (directory) and the same layout in a tar for `ctr -n k8s.io images import`. Each platform's
//! image holds what the Dockerfile's distroless image holds for the agent:
//! `/usr/local/bin/valet-agent` (the eBPF object is embedded: one object for both), the glibc and
//! libgcc it links, the CA bundle; it runs as root (the DaemonSet's capabilities need uid 0).
//! Timestamps are zero: the same binaries give the same digests.
//!
//! Once built, each platform's image is unpacked and its agent run with `--version`: amd64's in a
//! chroot of its own files, arm64's under qemu-user (`qemu-aarch64-static -L <its files>`).
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context as _, Result, bail};

use crate::arch::Arch;

/// The image's name, as deploy/base/daemonset.yaml refers to it.
pub(crate) const NAME: &str = "ghcr.io/valet-dev/valet-agent:0.1.0";

/// The architectures the image index holds. The DaemonSet selects exactly these
/// (deploy/tests/test_manifest.py reads this list).
pub(crate) const ARCHITECTURES: [&str; 2] = ["amd64", "arm64"];

/// Debian's cross sysroot for arm64 (libc6-arm64-cross, libgcc-s1-arm64-cross).
pub(crate) const ARM64_SYSROOT: &str = "/usr/aarch64-linux-gnu";

/// Where the image is written: (layout directory, tar archive).
pub(crate) fn paths(root: &Path) -> Result<(PathBuf, PathBuf)> {
    let dir = crate::cmd::target_dir(root)?.join("oci");
    Ok((dir.join("valet-agent"), dir.join("valet-agent.tar")))
}

fn arch(name: &str) -> Arch {
    if name == "arm64" { Arch::Arm64 } else { Arch::Amd64 }
}

/// Builds the release agent for every architecture and the image index; checks each platform's
/// agent runs. Returns (layout directory, tar archive).
pub(crate) fn build(root: &Path) -> Result<(PathBuf, PathBuf)> {
    crate::setup::build_tools()?;
    crate::setup::arm64_tools()?;
    let target = crate::cmd::target_dir(root)?;
    let mut agents = Vec::new();
    for name in ARCHITECTURES {
        let arch = arch(name);
        let mut cargo = crate::cmd::cargo();
        cargo.current_dir(root).args(["build", "--release", "-p", "valet-agent", "--bin", "valet-agent"]);
        let dir = if arch == Arch::host() {
            target.join("release")
        } else {
            cargo.args(["--target", arch.triple()]);
            target.join(arch.triple()).join("release")
        };
        crate::cmd::run(&mut cargo)?;
        agents.push((name, dir.join("valet-agent")));
    }
    let (layout, tar) = index(root, &agents)?;
    for (name, _) in &agents {
        check(&layout, name)?;
    }
    Ok((layout, tar))
}

/// The single-platform image of an agent binary already built for `arch` (a node VM's).
pub(crate) fn from_binary(root: &Path, arch: Arch, agent: &Path) -> Result<(PathBuf, PathBuf)> {
    let (layout, tar) = paths(root)?;
    let name = arch.deb();
    let single =
        (layout.with_file_name(format!("valet-agent-{name}")), tar.with_file_name(format!("valet-agent-{name}.tar")));
    platform(root, agent, name, &single.0, &single.1)?;
    Ok(single)
}

/// One platform's image of `agent`, as a layout and a tar.
fn platform(root: &Path, agent: &Path, arch_name: &str, layout: &Path, tar: &Path) -> Result<()> {
    if let Some(parent) = tar.parent() {
        std::fs::create_dir_all(parent)?;
    }
    let mut cmd = Command::new("python3");
    cmd.arg(root.join("tests/node/oci_image.py"))
        .arg(tar)
        .arg(NAME)
        .arg(format!("--elf={}:/usr/local/bin/valet-agent", agent.display()))
        .arg("--add=/etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt")
        .arg(r#"--entrypoint=["/usr/local/bin/valet-agent"]"#)
        .args(["--user=0:0", "--port=9090/tcp", "--env=PATH=/usr/local/bin:/usr/bin:/bin"])
        .arg("--label=org.opencontainers.image.title=valet-agent")
        .arg("--label=org.opencontainers.image.source=https://github.com/valet-dev/valet")
        .arg("--label=org.opencontainers.image.licenses=Apache-2.0")
        .arg(format!("--arch={arch_name}"))
        .arg("--layout")
        .arg(layout);
    if arch(arch_name) != Arch::host() {
        cmd.arg(format!("--sysroot={ARM64_SYSROOT}"));
    }
    crate::cmd::run(&mut cmd).with_context(|| format!("build the agent's linux/{arch_name} image"))
}

/// The image index of one image per (architecture, agent binary).
fn index(root: &Path, agents: &[(&str, PathBuf)]) -> Result<(PathBuf, PathBuf)> {
    let (layout, tar) = paths(root)?;
    let mut merge = Command::new("python3");
    merge.arg(root.join("tests/node/oci_image.py")).arg(&tar).arg(NAME);
    for (name, agent) in agents {
        let single = layout.with_file_name(format!("valet-agent-{name}"));
        platform(root, agent, name, &single, &tar.with_file_name(format!("valet-agent-{name}.tar")))?;
        merge.arg("--index").arg(&single);
    }
    crate::cmd::run(merge.arg("--layout").arg(&layout)).context("build the agent's image index")?;
    println!(
        "image: {NAME} (linux/{}): layout {} and archive {}",
        ARCHITECTURES.join(", linux/"),
        layout.display(),
        tar.display()
    );
    Ok((layout, tar))
}

/// Unpacks the index's image for `arch_name` and runs its agent's `--version` there, under its
/// architecture: the image must hold everything the binary loads.
pub(crate) fn check(layout: &Path, arch_name: &str) -> Result<()> {
    let read = |digest: &str| -> Result<serde_json::Value> {
        let hex = digest.strip_prefix("sha256:").unwrap_or(digest);
        let path = layout.join("blobs/sha256").join(hex);
        Ok(serde_json::from_slice(&std::fs::read(&path).with_context(|| format!("read {}", path.display()))?)?)
    };
    let top: serde_json::Value = serde_json::from_slice(&std::fs::read(layout.join("index.json"))?)?;
    let index = read(top["manifests"][0]["digest"].as_str().unwrap_or_default())?;
    let Some(desc) = index["manifests"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|m| m["platform"]["architecture"] == arch_name && m["platform"]["os"] == "linux")
    else {
        bail!("the image index at {} holds no linux/{arch_name} image", layout.display());
    };
    let manifest = read(desc["digest"].as_str().unwrap_or_default())?;
    let config = read(manifest["config"]["digest"].as_str().unwrap_or_default())?;
    if config["architecture"] != arch_name {
        bail!("linux/{arch_name}'s config says architecture {}", config["architecture"]);
    }
    let rootfs = layout.with_file_name(format!("rootfs-{arch_name}"));
    let _ = std::fs::remove_dir_all(&rootfs);
    std::fs::create_dir_all(&rootfs)?;
    for layer in manifest["layers"].as_array().into_iter().flatten() {
        let hex = layer["digest"].as_str().unwrap_or_default().trim_start_matches("sha256:");
        crate::cmd::run(
            Command::new("tar").arg("-xf").arg(layout.join("blobs/sha256").join(hex)).arg("-C").arg(&rootfs),
        )?;
    }
    let entry = config["config"]["Entrypoint"][0].as_str().unwrap_or_default().to_string();
    let mut run = if arch(arch_name) == Arch::host() {
        let mut c = Command::new("chroot");
        c.arg(&rootfs).arg(&entry);
        c
    } else {
        let mut c = Command::new("qemu-aarch64-static");
        c.arg("-L").arg(&rootfs).arg(rootfs.join(entry.trim_start_matches('/')));
        c
    };
    let out = run.arg("--version").output().with_context(|| format!("run {run:?}"))?;
    let version = String::from_utf8_lossy(&out.stdout).trim().to_string();
    if !out.status.success() || !version.starts_with("valet-agent ") {
        bail!(
            "linux/{arch_name}: {run:?} --version: {} {version:?} {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    // The ELF header's e_machine: the binary is the platform's, not the host's run by luck.
    let elf = std::fs::read(rootfs.join(entry.trim_start_matches('/')))?;
    let machine = elf.get(18..20).map(|m| u16::from_le_bytes([m[0], m[1]]));
    let expected = match arch(arch_name) {
        Arch::Amd64 => 62,
        Arch::Arm64 => 183,
    };
    if machine != Some(expected) {
        bail!("linux/{arch_name}: the agent's ELF machine is {machine:?}, not {expected}");
    }
    println!(
        "image: linux/{arch_name}: {version} (ELF machine {expected}, run {})",
        if arch(arch_name) == Arch::host() {
            "in a chroot of the image's files"
        } else {
            "under qemu-aarch64-static with the image's files as its root"
        }
    );
    std::fs::remove_dir_all(&rootfs)?;
    Ok(())
}
