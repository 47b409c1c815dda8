//! Debian's packages through apt-get with a private state under the cache (the host's apt
//! configuration is only read, to learn its Debian mirror), and the arm64 userland extracted from
//! them.
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, SystemTime};

use anyhow::{Context as _, Result, anyhow, bail};

use super::{CACHE, fnv, scratch};
use crate::arch::Arch;

/// The arm64 guests' userland: what the tests and the guest script call, from Debian bookworm
/// (the glibc the cross-built binaries link against, 2.36).
const ARM64_USERLAND: &str =
    "libc6,libgcc-s1,dash,bash,coreutils,util-linux,mount,iproute2,procps,busybox-static,base-passwd,base-files";
const ARM64_USERLAND_SUITE: &str = "bookworm";
/// Lists older than this are refreshed before a kernel version is chosen.
const LISTS_MAX_AGE: Duration = Duration::from_secs(7 * 24 * 3600);

/// apt-get with its own sources, lists, status and archives under the cache.
pub(crate) struct Apt {
    dir: PathBuf,
    pub(crate) mirror: String,
}

impl Apt {
    pub(crate) fn new() -> Result<Self> {
        let mirror = host_debian_mirror()?;
        let dir = Path::new(CACHE).join("apt");
        for d in ["lists/partial", "archives/partial", "etc/sources.list.d", "etc/preferences.d", "debs"] {
            std::fs::create_dir_all(dir.join(d))?;
        }
        let status = dir.join("status");
        if !status.exists() {
            std::fs::write(&status, "")?;
        }
        let sources: String = ["bullseye", "bookworm", "trixie"]
            .iter()
            .map(|s| format!("deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] {mirror} {s} main\n"))
            .collect();
        let list = dir.join("etc/sources.list");
        let changed = std::fs::read_to_string(&list).ok().as_deref() != Some(sources.as_str());
        if changed {
            std::fs::write(&list, &sources)?;
        }
        let apt = Self { dir, mirror };
        if changed || apt.lists_age().is_none_or(|age| age > LISTS_MAX_AGE) {
            apt.update()?;
        }
        Ok(apt)
    }

    fn options(&self, cmd: &mut Command) {
        let d = self.dir.display();
        for opt in [
            format!("Dir::Etc::SourceList={d}/etc/sources.list"),
            format!("Dir::Etc::SourceParts={d}/etc/sources.list.d"),
            format!("Dir::Etc::PreferencesParts={d}/etc/preferences.d"),
            format!("Dir::Etc::Preferences={d}/etc/preferences"),
            format!("Dir::State::Lists={d}/lists"),
            format!("Dir::State::status={d}/status"),
            format!("Dir::Cache={d}/cache"),
            format!("Dir::Cache::archives={d}/archives"),
            "APT::Architecture=amd64".into(),
            "APT::Architectures=amd64,arm64".into(),
            "Acquire::Languages=none".into(),
            "Acquire::IndexTargets::deb::DEP-11::DefaultEnabled=false".into(),
            "Acquire::IndexTargets::deb::DEP-11-icons::DefaultEnabled=false".into(),
            "Acquire::IndexTargets::deb::DEP-11-icons-small::DefaultEnabled=false".into(),
            "APT::Sandbox::User=root".into(),
        ] {
            cmd.args(["-o", &opt]);
        }
    }

    /// Time since the last successful update (apt dates the list files by the archive's
    /// Last-Modified, so a stamp of our own says when we fetched them).
    fn lists_age(&self) -> Option<Duration> {
        let stamp = std::fs::metadata(self.dir.join("updated")).ok()?.modified().ok()?;
        SystemTime::now().duration_since(stamp).ok()
    }

    fn update(&self) -> Result<()> {
        println!("kernels: apt-get update (private lists for bullseye, bookworm, trixie from {})", self.mirror);
        let mut cmd = Command::new("apt-get");
        self.options(&mut cmd);
        crate::cmd::run(cmd.args(["-qq", "update"]))?;
        std::fs::write(self.dir.join("updated"), "")?;
        Ok(())
    }

    /// `apt-cache show <pkg>:<arch>/<suite>` field values, first record.
    pub(super) fn field(&self, pkg_suite: &str, arch: Arch, field: &str) -> Result<String> {
        let (pkg, suite) = pkg_suite.split_once('/').unwrap_or((pkg_suite, ""));
        let pkg_suite = format!("{pkg}:{}/{suite}", arch.deb());
        let pkg_suite = pkg_suite.trim_end_matches('/');
        let mut cmd = Command::new("apt-cache");
        self.options(&mut cmd);
        let out = cmd.args(["show", pkg_suite]).output()?;
        let text = String::from_utf8_lossy(&out.stdout);
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("{field}: ")))
            .map(str::to_string)
            .ok_or_else(|| anyhow!("apt-cache show {pkg_suite}: no {field}"))
    }

    /// Downloads `pkg` of `arch` at `version` (cached) and returns the .deb's path.
    pub(super) fn download(&self, pkg: &str, arch: Arch, version: &str) -> Result<PathBuf> {
        let debs = self.dir.join("debs");
        let file = debs.join(format!("{pkg}_{}_{}.deb", version.replace(':', "%3a"), arch.deb()));
        if file.exists() {
            return Ok(file);
        }
        println!("kernels: apt-get download {pkg}:{}={version}", arch.deb());
        let get = || {
            let mut cmd = Command::new("apt-get");
            self.options(&mut cmd);
            crate::cmd::run(cmd.current_dir(&debs).args([
                "-qq",
                "download",
                &format!("{pkg}:{}={version}", arch.deb()),
            ]))
        };
        if get().is_err() {
            // The mirror may have dropped a version our lists still name.
            self.update()?;
            get()?;
        }
        if !file.exists() {
            bail!("apt-get download {pkg}={version} left no {}", file.display());
        }
        Ok(file)
    }

    /// Debian's static busybox of `arch`, extracted once per version.
    pub(crate) fn busybox(&self, arch: Arch) -> Result<PathBuf> {
        let version = self.field("busybox-static/bookworm", arch, "Version")?;
        let dir = match arch {
            Arch::Amd64 => version.replace(':', "_"),
            Arch::Arm64 => format!("{}_{}", version.replace(':', "_"), arch.deb()),
        };
        let out = Path::new(CACHE).join(format!("busybox/{dir}/busybox"));
        if out.exists() {
            return Ok(out);
        }
        let deb = self.download("busybox-static", arch, &version)?;
        let tmp = scratch("busybox")?;
        crate::cmd::run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&tmp))?;
        std::fs::create_dir_all(out.parent().unwrap_or(Path::new(CACHE)))?;
        std::fs::copy(tmp.join("bin/busybox"), &out)?;
        std::fs::remove_dir_all(&tmp)?;
        Ok(out)
    }
}

/// The URI of the host's Debian archive, from `apt-cache policy` (works for one-line and deb822
/// sources alike): the repository whose release has `o=Debian` and `l=Debian`.
pub(crate) fn host_debian_mirror() -> Result<String> {
    let out = Command::new("apt-cache").arg("policy").output().context("apt-cache policy")?;
    let text = String::from_utf8_lossy(&out.stdout);
    let mut uri = None;
    for line in text.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        if words.len() >= 3 && words[0].parse::<i32>().is_ok() && words[1].contains("://") {
            uri = Some(words[1].trim_end_matches('/').to_string());
        } else if let Some(release) = line.trim().strip_prefix("release ") {
            let fields: Vec<&str> = release.split(',').collect();
            if fields.contains(&"o=Debian")
                && fields.contains(&"l=Debian")
                && let Some(u) = uri.take()
            {
                return Ok(u);
            }
        }
    }
    bail!("the host's apt sources have no Debian archive (o=Debian, l=Debian in apt-cache policy)")
}

/// `"linux-image-6.1.0-50-amd64 (= 6.1.176-1)"` → (package, version).
pub(super) fn parse_exact_dependency(depends: &str) -> Option<(String, String)> {
    let first = depends.split(',').next()?.trim();
    let (name, rest) = first.split_once(" (= ")?;
    Some((name.trim().to_string(), rest.strip_suffix(')')?.trim().to_string()))
}

/// The arm64 userland's files, cached per package list (also where the arm64 node's pod images
/// take util-linux's `unshare` from).
pub(crate) fn arm64_rootfs(apt: &Apt) -> Result<PathBuf> {
    // The key's last part changes with what is added to the packages' files below.
    let key = fnv(&[ARM64_USERLAND_SUITE.as_bytes(), ARM64_USERLAND.as_bytes(), b"ca,passwd"]);
    let base = Path::new(CACHE).join("guest");
    let done = base.join(format!("arm64-{ARM64_USERLAND_SUITE}-{key:016x}"));
    if done.is_dir() {
        return Ok(done);
    }
    let debs = base.join("debs-arm64");
    std::fs::create_dir_all(&debs)?;
    let rootfs = scratch("arm64-userland")?;
    std::fs::remove_dir(&rootfs)?;
    println!("kernels: mmdebstrap the arm64 userland ({ARM64_USERLAND_SUITE}: {ARM64_USERLAND})");
    crate::cmd::run(
        Command::new("mmdebstrap")
            .args(["--variant=extract", "--architectures=arm64", "--quiet", &format!("--include={ARM64_USERLAND}")])
            .arg("--setup-hook=mkdir -p \"$1\"/var/cache/apt/archives/")
            .arg(format!("--setup-hook=sync-in {} /var/cache/apt/archives/", debs.display()))
            .arg(format!("--customize-hook=sync-out /var/cache/apt/archives {}", debs.display()))
            .arg(ARM64_USERLAND_SUITE)
            .arg(&rootfs)
            .arg(&apt.mirror),
    )?;
    for d in ["proc", "sys", "dev", "run", "tmp", "host", "root"] {
        std::fs::create_dir_all(rootfs.join(d))?;
    }
    // What maintainer scripts would have made: the CA bundle (ca-certificates'; the agent's
    // Kubernetes client loads it even for the fake API server's plain HTTP), the host's copy, and
    // base-passwd's users and groups.
    let bundle = "etc/ssl/certs/ca-certificates.crt";
    std::fs::create_dir_all(rootfs.join("etc/ssl/certs"))?;
    std::fs::copy(Path::new("/").join(bundle), rootfs.join(bundle)).with_context(|| format!("copy /{bundle}"))?;
    for (master, file) in [("passwd.master", "etc/passwd"), ("group.master", "etc/group")] {
        std::fs::copy(rootfs.join("usr/share/base-passwd").join(master), rootfs.join(file))
            .with_context(|| format!("{master} of base-passwd"))?;
    }
    std::fs::rename(&rootfs, &done)?;
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_dependency() {
        assert_eq!(
            parse_exact_dependency("linux-image-6.12.117+deb13-amd64 (= 6.12.117-1)"),
            Some(("linux-image-6.12.117+deb13-amd64".into(), "6.12.117-1".into()))
        );
        assert_eq!(parse_exact_dependency("linux-image-6.1.0-50-amd64"), None);
    }
}
