//! Debian kernels and userlands booted in qemu, shared by the kernel suite (`kernels.rs`) and
//! the node VM (`node.rs`): Debian's packages through a private apt state (`apt`), a kernel and
//! its initramfs (`kernel`, `initramfs`), and the qemu run with its console (`qemu`). Everything
//! is cached under [`CACHE`].
use std::path::{Path, PathBuf};

use anyhow::Result;

pub(crate) mod apt;
pub(crate) mod initramfs;
pub(crate) mod kernel;
pub(crate) mod qemu;

pub(crate) const CACHE: &str = "/var/cache/valet/vm";

/// A fresh scratch directory under the cache, for one extraction.
fn scratch(what: &str) -> Result<PathBuf> {
    let dir = Path::new(CACHE).join(format!("tmp/{what}-{}", std::process::id()));
    if dir.exists() {
        std::fs::remove_dir_all(&dir)?;
    }
    std::fs::create_dir_all(&dir)?;
    Ok(dir)
}

/// A small stable hash (FNV-1a) for cache keys.
pub(crate) fn fnv(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for b in *p {
            h = (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3);
        }
    }
    h
}
