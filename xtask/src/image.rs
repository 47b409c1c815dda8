//! `cargo xtask image`: the agent's OCI image, built without Docker or a registry from the release
//! binary: an OCI image layout (directory) and the same layout in a tar for
//! `ctr -n k8s.io images import`. It holds what the Dockerfile's distroless image holds for the
//! agent: `/usr/local/bin/valet-agent` (the eBPF object is embedded), the glibc and libgcc it
//! links, the CA bundle; it runs as root (the DaemonSet's capabilities need uid 0). Timestamps are
//! zero: the same binary gives the same digest.
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context as _, Result};

/// The image's name, as deploy/base/daemonset.yaml refers to it.
pub const NAME: &str = "ghcr.io/valet-dev/valet-agent:0.1.0";

/// The architectures the image is built for (the host's: linux/amd64). The DaemonSet selects
/// exactly these (deploy/tests/test_manifest.py reads this list); arm64 is not built yet.
pub const ARCHITECTURES: [&str; 1] = ["amd64"];

/// Where the image is written: (layout directory, tar archive).
pub fn paths(root: &Path) -> Result<(PathBuf, PathBuf)> {
    let dir = crate::cmd::target_dir(root)?.join("oci");
    Ok((dir.join("valet-agent"), dir.join("valet-agent.tar")))
}

/// Builds the release agent and its image; returns (layout directory, tar archive).
pub fn build(root: &Path) -> Result<(PathBuf, PathBuf)> {
    crate::cmd::run(crate::cmd::cargo().current_dir(root).args([
        "build",
        "--release",
        "-p",
        "valet-agent",
        "--bin",
        "valet-agent",
    ]))?;
    let agent = crate::cmd::target_dir(root)?.join("release/valet-agent");
    from_binary(root, &agent)
}

/// The image of an agent binary already built.
pub fn from_binary(root: &Path, agent: &Path) -> Result<(PathBuf, PathBuf)> {
    let (layout, tar) = paths(root)?;
    if let Some(parent) = tar.parent() {
        std::fs::create_dir_all(parent)?;
    }
    crate::cmd::run(
        Command::new("python3")
            .arg(root.join("tests/node/oci_image.py"))
            .arg(&tar)
            .arg(NAME)
            .arg(format!("--elf={}:/usr/local/bin/valet-agent", agent.display()))
            .arg("--add=/etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt")
            .arg(r#"--entrypoint=["/usr/local/bin/valet-agent"]"#)
            .args(["--user=0:0", "--port=9090/tcp", "--env=PATH=/usr/local/bin:/usr/bin:/bin"])
            .arg("--label=org.opencontainers.image.title=valet-agent")
            .arg("--label=org.opencontainers.image.source=https://github.com/valet-dev/valet")
            .arg("--label=org.opencontainers.image.licenses=Apache-2.0")
            .arg("--layout")
            .arg(&layout),
    )
    .context("build the agent's OCI image")?;
    println!(
        "image: {NAME} (linux/{}): layout {} and archive {}",
        ARCHITECTURES.join(", linux/"),
        layout.display(),
        tar.display()
    );
    Ok((layout, tar))
}
