//! A Debian kernel ready to boot: from its package, the uncompressed `vmlinux` (PVH direct boot:
//! no bootloader, no decompression under TCG; arm64's compressed `Image` as it is) and the few
//! modules a guest needs, packed into an initramfs.
use std::collections::{BTreeMap, HashSet};
use std::io::{Read as _, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{Context as _, Result, anyhow, bail};

use super::apt::{Apt, parse_exact_dependency};
use super::initramfs::write_initramfs;
use super::{CACHE, scratch};
use crate::arch::Arch;

/// Modules the guest loads (with their dependencies) when the kernel does not build them in.
const GUEST_MODULES: &[&str] = &["virtio_pci", "9pnet_virtio", "9p"];
/// What the node VM (see `node.rs`) needs on top: its root disk, ext4 with checksums, overlayfs
/// for containerd's snapshotter, a bridge and veth pairs for the CNI bridge plugin. Loaded when
/// the kernel ships them.
const NODE_MODULES: &[&str] = &["virtio_blk", "crc32c_generic", "ext4", "overlay", "bridge", "veth"];
/// Bumped when the initramfs's contents change, so cached ones are rebuilt.
const INITRAMFS_VERSION: u32 = 4;

/// A kernel ready to boot.
pub(crate) struct Kernel {
    pub(crate) arch: Arch,
    pub(crate) package: String,
    pub(crate) version: String,
    /// `uname -r`.
    pub(crate) release: String,
    /// What qemu boots: the uncompressed `vmlinux` on amd64 (PVH), the compressed `Image` on arm64.
    pub(crate) vmlinux: PathBuf,
    pub(crate) initramfs: PathBuf,
}

impl Kernel {
    /// The suite's kernel of `arch`: its image and an initramfs (with `busybox`, of the same
    /// architecture) with its modules, cached per package version.
    pub(crate) fn prepare(apt: &Apt, suite: &str, arch: Arch, busybox: &Path) -> Result<Self> {
        // linux-image-amd64 is the suite's metapackage: "Depends: linux-image-6.1.0-50-amd64 (= 6.1.176-1)".
        let meta = format!("linux-image-{}", arch.deb());
        let depends = apt.field(&format!("{meta}/{suite}"), arch, "Depends")?;
        let (package, version) = parse_exact_dependency(&depends)
            .ok_or_else(|| anyhow!("{meta}/{suite}: unexpected Depends {depends:?}"))?;
        let dir = Path::new(CACHE).join("kernels").join(format!("{package}_{version}_i{INITRAMFS_VERSION}"));
        let kernel = |release: String| Self {
            arch,
            package: package.clone(),
            version: version.clone(),
            release,
            vmlinux: dir.join("vmlinux"),
            initramfs: dir.join("initramfs.cpio"),
        };
        if let Ok(release) = std::fs::read_to_string(dir.join("release")) {
            return Ok(kernel(release.trim().to_string()));
        }
        let deb = apt.download(&package, arch, &version)?;
        let tmp = scratch("kernel")?;
        crate::cmd::run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&tmp))?;
        let modules_root = ["lib/modules", "usr/lib/modules"]
            .iter()
            .map(|d| tmp.join(d))
            .find(|d| d.is_dir())
            .ok_or_else(|| anyhow!("{package}: no lib/modules directory"))?;
        let release = std::fs::read_dir(&modules_root)?
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .next()
            .ok_or_else(|| anyhow!("{package}: empty modules directory"))?;
        let vmlinuz = tmp.join(format!("boot/vmlinuz-{release}"));
        std::fs::create_dir_all(&dir)?;
        let vmlinuz = std::fs::read(&vmlinuz).with_context(|| format!("read {vmlinuz:?}"))?;
        // qemu-system-aarch64 boots arm64's gzip-compressed `Image` as it is.
        let image = if arch == Arch::Amd64 { extract_vmlinux(&vmlinuz)? } else { vmlinuz };
        std::fs::write(dir.join("vmlinux"), image)?;
        let modules = guest_modules(&modules_root.join(&release))?;
        let names: Vec<&str> = modules.iter().map(|(n, _)| n.as_str()).collect();
        println!(
            "kernels: {release}: modules to load, in order: {}",
            if names.is_empty() { "none".into() } else { names.join(" ") }
        );
        write_initramfs(&dir.join("initramfs.cpio"), busybox, &modules)?;
        std::fs::remove_dir_all(&tmp)?;
        std::fs::write(dir.join("release"), &release)?;
        Ok(kernel(release))
    }
}

/// Decompresses with an external tool, tolerating trailing data (the rest of the bzImage).
fn decompress(tool: &str, data: &[u8]) -> Option<Vec<u8>> {
    let mut child = Command::new(tool)
        .args(["-dc"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .ok()?;
    let mut stdin = child.stdin.take()?;
    let input = data.to_vec();
    let writer = std::thread::spawn(move || {
        let _ = stdin.write_all(&input);
    });
    let mut out = Vec::new();
    let _ = child.stdout.take()?.read_to_end(&mut out);
    let _ = child.wait();
    let _ = writer.join();
    Some(out)
}

/// The kernel's `extract-vmlinux`: find a compressed payload in the bzImage that decompresses to
/// an ELF file.
fn extract_vmlinux(vmlinuz: &[u8]) -> Result<Vec<u8>> {
    let formats: [(&[u8], &str); 4] = [
        (b"\xfd7zXZ\x00", "xz"),
        (b"\x28\xb5\x2f\xfd", "zstd"),
        (b"\x1f\x8b\x08", "gzip"),
        (b"\x02\x21\x4c\x18", "lz4"),
    ];
    for (magic, tool) in formats {
        let mut from = 0;
        while let Some(pos) = find(&vmlinuz[from..], magic).map(|p| p + from) {
            if let Some(out) = decompress(tool, &vmlinuz[pos..])
                && out.starts_with(b"\x7fELF")
            {
                return Ok(out);
            }
            from = pos + 1;
        }
    }
    bail!("no compressed ELF payload found in vmlinuz (tried xz, zstd, gzip, lz4)")
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// A module file's contents, decompressed.
fn read_module(path: &Path) -> Result<Vec<u8>> {
    let raw = std::fs::read(path)?;
    let name = path.to_string_lossy();
    let tool = if name.ends_with(".xz") {
        "xz"
    } else if name.ends_with(".zst") {
        "zstd"
    } else if name.ends_with(".gz") {
        "gzip"
    } else {
        return Ok(raw);
    };
    decompress(tool, &raw).filter(|m| m.starts_with(b"\x7fELF")).ok_or_else(|| anyhow!("decompress {name}"))
}

fn module_name(file: &str) -> String {
    file.split(".ko").next().unwrap_or(file).replace('-', "_")
}

/// The modules among [`GUEST_MODULES`] the kernel does not build in, with everything they depend
/// on, in load order (dependencies first), decompressed.
fn guest_modules(modules_dir: &Path) -> Result<Vec<(String, Vec<u8>)>> {
    let builtin: HashSet<String> = std::fs::read_to_string(modules_dir.join("modules.builtin"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.rsplit('/').next())
        .map(module_name)
        .collect();
    let mut files = BTreeMap::new();
    let mut stack = vec![modules_dir.join("kernel")];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir)?.flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
            } else if let Some(file) = path.file_name().map(|f| f.to_string_lossy().into_owned())
                && file.contains(".ko")
            {
                files.insert(module_name(&file), path);
            }
        }
    }
    let mut order = Vec::new();
    let mut seen = HashSet::new();
    fn visit(
        name: &str,
        files: &BTreeMap<String, PathBuf>,
        builtin: &HashSet<String>,
        seen: &mut HashSet<String>,
        order: &mut Vec<(String, Vec<u8>)>,
    ) -> Result<()> {
        if !seen.insert(name.to_string()) || builtin.contains(name) {
            return Ok(());
        }
        let path = files.get(name).ok_or_else(|| anyhow!("module {name} is neither built in nor shipped"))?;
        let bytes = read_module(path)?;
        for dep in modinfo_depends(&bytes) {
            visit(&dep, files, builtin, seen, order)?;
        }
        order.push((name.to_string(), bytes));
        Ok(())
    }
    for m in GUEST_MODULES {
        visit(m, &files, &builtin, &mut seen, &mut order)?;
    }
    for m in NODE_MODULES {
        if files.contains_key(*m) || builtin.contains(*m) {
            visit(m, &files, &builtin, &mut seen, &mut order)?;
        } else {
            println!("kernels: {} has no module {m} (the node VM cannot boot it)", modules_dir.display());
        }
    }
    Ok(order)
}

/// The `depends=` entry of a module's `.modinfo` section (NUL-separated `key=value` strings).
fn modinfo_depends(module: &[u8]) -> Vec<String> {
    let Some(pos) = find(module, b"\0depends=") else { return Vec::new() };
    let rest = &module[pos + 9..];
    let end = rest.iter().position(|&b| b == 0).unwrap_or(rest.len());
    String::from_utf8_lossy(&rest[..end]).split(',').filter(|s| !s.is_empty()).map(module_name).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn depends_from_modinfo() {
        let ko = b"\x7fELF....\0license=GPL\0depends=9pnet,netfs\0intree=Y\0";
        assert_eq!(modinfo_depends(ko), vec!["9pnet".to_string(), "netfs".to_string()]);
        assert!(modinfo_depends(b"\x7fELF\0depends=\0name=x\0").is_empty());
    }
}
