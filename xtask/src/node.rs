//! `cargo xtask node`: valet on a real node. A Debian bookworm VM (mmdebstrap from apt: systemd,
//! containerd with its CRI plugin and the systemd cgroup driver, runc, the CNI plugins) booted
//! with Debian's bookworm kernel under qemu TCG, the host's `/` read-only at `/host`; a kubelet
//! stand-in (tests/node/kubelet.py) drives containerd through the CRI and mirrors the pods into
//! the fake API server; the host-built agent runs as root on the node. Images are built here
//! (tests/node/oci_image.py) and imported with `ctr`: no registry is involved. The scenarios are
//! tests/node/scenarios.py's; each prints `node scenario <name>: ok|FAILED (<figures>)`. Both of
//! the kubelet's cgroup drivers: the image's containerd uses systemd's; the `*_cgroupfs` scenarios
//! (run last) switch it to `SystemdCgroup = false` with one restart, and the kubelet stand-in then
//! makes and names `/kubepods/<qos>/pod<uid>` as the kubelet's cgroupfs driver does.
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};

use crate::kernels::{Apt, CACHE, qemu};

/// Packages of the node image on top of `--variant=minbase`.
const PACKAGES: &str = "systemd,systemd-sysv,dbus,containerd,runc,containernetworking-plugins,iproute2,\
                        python3,python3-grpcio,python3-protobuf,protobuf-compiler,kmod,util-linux,procps,ca-certificates";
/// Size of the (sparse) root disk.
const DISK: &str = "3G";
const DEADLINE: Duration = Duration::from_secs(15 * 60);
/// Where the guest mounts the host's out directory.
const OUT: &str = "/run/valet-out";

/// Builds (or reuses) the node image and the OCI images, boots the node and runs the scenarios
/// (all when `only` is empty). Returns the (passed, failed) counts; a scenario that never reported
/// counts as failed.
pub fn run(root: &Path, only: &[String]) -> Result<(u64, u64)> {
    let started = Instant::now();
    let apt = Apt::new()?;
    let busybox = apt.busybox()?;
    // VALET_NODE_KERNEL: boot the node with another kernel of the matrix (e.g. 6.12); the root
    // file system stays bookworm's.
    let suite = match std::env::var("VALET_NODE_KERNEL") {
        Ok(k) => crate::kernels::suites(&[k])?.first().copied().unwrap_or("bookworm"),
        Err(_) => "bookworm",
    };
    let kernel = apt.kernel(suite, &busybox)?;
    let t = Instant::now();
    let image = node_image(root, &apt.mirror)?;
    println!("node: image {} ready in {:.0?}", image.display(), t.elapsed());
    // VALET_NODE_BINARIES: run the scenarios with another build's valet-agent,
    // valet-fake-apiserver and valet-standin-proxy (a directory holding the three).
    let release = match std::env::var_os("VALET_NODE_BINARIES") {
        Some(dir) => {
            println!("node: binaries from VALET_NODE_BINARIES={}", dir.to_string_lossy());
            PathBuf::from(dir)
        }
        None => crate::cmd::build_release_bins(root)?,
    };
    let images = oci_images(root, &release, &busybox)?;
    // The agent's own image (imported with the others), and its DaemonSet translated to the CRI.
    let (_, agent_tar) = crate::image::from_binary(root, &release.join("valet-agent"))?;
    std::fs::copy(&agent_tar, images.join("valet-agent.tar"))?;
    let dir = Path::new(CACHE).join("run/node");
    // Shared writable with the guest: the agent's log and the scenarios' events come back here.
    let out = dir.join("out");
    if out.exists() {
        std::fs::remove_dir_all(&out)?;
    }
    std::fs::create_dir_all(&out)?;
    let script = dir.join("run.sh");
    let host = |p: &Path| Path::new("/host").join(p.strip_prefix("/").unwrap_or(p));
    std::fs::write(
        &script,
        format!(
            "export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\n\
             mkdir -p {OUT} && mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 out {OUT} || exit 1\n\
             python3 {scenarios} {release} {images} {OUT} {only}\n",
            scenarios = host(&root.join("tests/node/scenarios.py")).display(),
            release = host(&release).display(),
            images = host(&images).display(),
            only = only.join(" "),
        ),
    )?;
    let append = format!("valet.root=/dev/vda valet.run={} systemd.show_status=0", script.display());
    let drive = format!("file={},if=virtio,format=raw,snapshot=on", image.display());
    let t = Instant::now();
    let pod = Command::new(root.join(".venv/bin/python"))
        .arg(root.join("tests/node/daemonset_cri.py"))
        .arg(root.join("deploy/base/daemonset.yaml"))
        .args(["valet-node", crate::image::NAME])
        .output()
        .context("translate the DaemonSet to CRI requests")?;
    if !pod.status.success() {
        bail!("daemonset_cri.py: {}", String::from_utf8_lossy(&pod.stderr));
    }
    std::fs::write(out.join("agent-pod.json"), &pod.stdout)?;
    let share = format!("local,path={},mount_tag=out,security_model=none", out.display());
    let (lines, timed_out) =
        qemu(&kernel, &append, &["-drive", &drive, "-virtfs", &share], &dir.join("console.log"), DEADLINE)?;
    let ready = lines.iter().find_map(|l| l.split_once("VALET-NODE-READY ").map(|(_, t)| t.to_string()));
    println!(
        "node: booted to containerd-ready at {}s guest uptime; VM ran {:.0?} ({:.0?} in all)",
        ready.as_deref().unwrap_or("?"),
        t.elapsed(),
        started.elapsed()
    );
    let (mut passed, mut failed) = (0, 0);
    let mut results = Vec::new();
    for line in &lines {
        let Some(rest) = line.strip_prefix("node scenario ") else { continue };
        if rest.split_once(": ").is_some_and(|(_, r)| r.starts_with("ok")) {
            passed += 1;
        } else {
            failed += 1;
        }
        results.push(line.clone());
    }
    if results.is_empty() || !lines.iter().any(|l| l.starts_with("VALET-NODE-EXIT")) {
        failed += 1;
        let why = if timed_out { format!("the VM was killed after {DEADLINE:?}") } else { "it stopped".into() };
        results
            .push(format!("node: the scenarios did not finish: {why}; console: {}", dir.join("console.log").display()));
    }
    println!(
        "\nreal node ({:.0?}): {passed} passed, {failed} failed (agent log and events: {})",
        started.elapsed(),
        out.display()
    );
    for line in results {
        println!("{line}");
    }
    Ok((passed, failed))
}

/// A small stable hash (FNV-1a) for cache keys.
fn fnv(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for b in *p {
            h = (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3);
        }
    }
    h
}

/// The node's root disk: mmdebstrap (its .debs cached), tests/node/customize.sh, mke2fs.
fn node_image(root: &Path, mirror: &str) -> Result<PathBuf> {
    let customize = std::fs::read(root.join("tests/node/customize.sh"))?;
    let key = fnv(&[PACKAGES.as_bytes(), &customize]);
    let base = Path::new(CACHE).join("node");
    let image = base.join(format!("node-{key:016x}.img"));
    if image.exists() {
        return Ok(image);
    }
    let debs = base.join("debs");
    std::fs::create_dir_all(&debs)?;
    let rootfs = base.join(format!("rootfs-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&rootfs);
    println!("node: mmdebstrap bookworm (first time: downloads ~150 MB of .debs, cached)");
    crate::cmd::run(
        Command::new("mmdebstrap")
            .args(["--variant=minbase", "--quiet", &format!("--include={PACKAGES}"), "--skip=download/empty"])
            .arg("--setup-hook=mkdir -p \"$1\"/var/cache/apt/archives/")
            .arg(format!("--setup-hook=sync-in {} /var/cache/apt/archives/", debs.display()))
            .arg(format!("--customize-hook=sync-out /var/cache/apt/archives {}", debs.display()))
            .arg("bookworm")
            .arg(&rootfs)
            .arg(mirror),
    )?;
    crate::cmd::run(Command::new("sh").arg(root.join("tests/node/customize.sh")).arg(&rootfs))?;
    let tmp = image.with_extension("tmp");
    crate::cmd::run(
        Command::new("mke2fs").args(["-q", "-t", "ext4", "-L", "valet-node", "-d"]).arg(&rootfs).arg(&tmp).arg(DISK),
    )?;
    std::fs::rename(&tmp, &image)?;
    std::fs::remove_dir_all(&rootfs)?;
    Ok(image)
}

/// The pods' images: busybox (the app, with util-linux's `unshare` for nested pid namespaces), a
/// pause of our own, the stand-in proxy.
fn oci_images(root: &Path, release: &Path, busybox: &Path) -> Result<PathBuf> {
    let dir = Path::new(CACHE).join("node/images");
    std::fs::create_dir_all(&dir)?;
    let build = |out: &str, name: &str, args: &[String]| -> Result<()> {
        crate::cmd::run(
            Command::new("python3").arg(root.join("tests/node/oci_image.py")).arg(dir.join(out)).arg(name).args(args),
        )
        .with_context(|| format!("build image {name}"))
    };
    let bb = format!("{}:/bin/busybox", busybox.display());
    let links = ["sh", "sleep", "cat", "ls", "touch", "yes", "head"].map(|l| format!("--link=/bin/{l}:busybox"));
    let mut args = vec![
        format!("--add={bb}"),
        "--elf=/usr/bin/unshare:/bin/unshare".to_string(),
        r#"--entrypoint=["/bin/sh"]"#.to_string(),
    ];
    args.extend(links.iter().cloned());
    build("busybox.tar", "docker.io/valet/busybox:1", &args)?;
    build(
        "pause.tar",
        "docker.io/valet/pause:1",
        &[format!("--add={bb}"), r#"--entrypoint=["/bin/busybox","sleep","2147483647"]"#.to_string()],
    )?;
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
    )?;
    Ok(dir)
}
