//! The guest's initramfs: a busybox init that mounts the host's `/` (or an architecture's own
//! disk) with proc, sysfs, devtmpfs, cgroup2, tracefs, bpffs and tmpfs `/run` and `/tmp` on top,
//! and switches root into it.
use std::path::Path;

use anyhow::Result;

/// The guest's pid 1 before the switch to the host's root. Its command comes from the kernel
/// command line (`valet.run=`), run by the host's busybox under the new root.
const INIT: &str = r#"#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
fail() { echo "VALET-VM-FAILED: $*"; poweroff -f; sleep 10; }
mount -t proc proc /proc
mount -t devtmpfs devtmpfs /dev
for m in $(cat /modules); do insmod /lib/modules/$m.ko || fail "insmod $m"; done
run=$(sed -n 's/.*valet\.run=\([^ ]*\).*/\1/p' /proc/cmdline)
shell=$(sed -n 's/.*valet\.shell=\([^ ]*\).*/\1/p' /proc/cmdline)
P9="trans=virtio,version=9p2000.L,msize=262144,cache=loose"
root=$(sed -n 's/.*valet\.root=\([^ ]*\).*/\1/p' /proc/cmdline)
if [ -n "$root" ]; then
  # The node VM: its own root disk with systemd, the host's root read-only at /host.
  for i in $(seq 100); do [ -b "$root" ] && break; sleep 0.1; done
  mount -t ext4 "$root" /newroot || fail "mount $root"
  mount -t 9p -o ro,$P9 host /newroot/host || fail "mount the host root at /host"
  umount /proc
  exec switch_root /newroot /sbin/init
fi
R=/newroot
keep=$(sed -n 's/.*valet\.keep=\([^ ]*\).*/\1/p' /proc/cmdline | tr , ' ')
disk=$(sed -n 's/.*valet\.disk=\([^ ]*\).*/\1/p' /proc/cmdline)
if [ -n "$disk" ]; then
  # Another architecture's userland on a disk of its own (written to a snapshot), the host's
  # root read-only at /host: the paths the tests need are bound from there to the host's paths.
  for i in $(seq 100); do [ -b "$disk" ] && break; sleep 0.1; done
  mount -t ext4 "$disk" $R || fail "mount $disk"
  mount -t 9p -o ro,$P9 host $R/host || fail "mount the host root at /host"
  from=$R/host
else
  mount -t 9p -o ro,$P9 host $R || fail "mount the host root"
  # Host paths the tmpfs mounts below would hide (a checkout under /tmp): a second view of the
  # host's root, taken before they are mounted, lends them back.
  from=/hostroot
  if [ -n "$keep" ]; then mkdir -p /hostroot && mount --bind $R /hostroot || fail "bind the host root"; fi
fi
mount -t proc proc $R/proc || fail proc
mount -t sysfs sysfs $R/sys || fail sysfs
mount -t devtmpfs devtmpfs $R/dev || fail devtmpfs
mkdir -p $R/dev/pts $R/dev/shm
mount -t devpts devpts $R/dev/pts
mount -t tmpfs tmpfs $R/dev/shm
mount -t tmpfs -o mode=755 tmpfs $R/run || fail /run
mount -t tmpfs -o mode=1777 tmpfs $R/tmp || fail /tmp
mount -t cgroup2 cgroup2 $R/sys/fs/cgroup || fail cgroup2
mount -t tracefs tracefs $R/sys/kernel/tracing || fail tracefs
mount -t debugfs debugfs $R/sys/kernel/debug
mount -t bpf bpf $R/sys/fs/bpf || fail bpffs
for p in $keep; do
  mkdir -p "$R$p" && mount --bind "$from$p" "$R$p" || fail "bind $p from the host"
done
if [ -z "$disk" ] && [ -n "$keep" ]; then umount /hostroot || fail "unmount the second view of the host root"; fi
umount /proc
exec switch_root $R "$shell" sh "$run"
"#;

pub(super) fn write_initramfs(out: &Path, busybox: &Path, modules: &[(String, Vec<u8>)]) -> Result<()> {
    let mut cpio = Cpio::default();
    for d in ["bin", "dev", "proc", "newroot", "lib", "lib/modules"] {
        cpio.dir(d);
    }
    cpio.console();
    cpio.file("bin/busybox", 0o755, &std::fs::read(busybox)?);
    cpio.file("init", 0o755, INIT.as_bytes());
    let list: String = modules.iter().map(|(n, _)| format!("{n}\n")).collect();
    cpio.file("modules", 0o644, list.as_bytes());
    for (name, bytes) in modules {
        cpio.file(&format!("lib/modules/{name}.ko"), 0o644, bytes);
    }
    std::fs::write(out, cpio.finish())?;
    Ok(())
}

/// A `newc` cpio archive, as the kernel unpacks an initramfs.
#[derive(Default)]
struct Cpio {
    buf: Vec<u8>,
    ino: u32,
}

impl Cpio {
    fn entry(&mut self, name: &str, mode: u32, rdev: (u32, u32), data: &[u8]) {
        self.ino += 1;
        let header = format!(
            "070701{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}{:08x}",
            self.ino,
            mode,
            0,
            0,
            1,
            0,
            data.len(),
            0,
            0,
            rdev.0,
            rdev.1,
            name.len() + 1,
            0
        );
        self.buf.extend_from_slice(header.as_bytes());
        self.buf.extend_from_slice(name.as_bytes());
        self.buf.push(0);
        self.pad();
        self.buf.extend_from_slice(data);
        self.pad();
    }

    fn pad(&mut self) {
        while !self.buf.len().is_multiple_of(4) {
            self.buf.push(0);
        }
    }

    fn dir(&mut self, name: &str) {
        self.entry(name, 0o040755, (0, 0), &[]);
    }

    fn file(&mut self, name: &str, perm: u32, data: &[u8]) {
        self.entry(name, 0o100000 | perm, (0, 0), data);
    }

    /// `/dev/console`, so that init has a stdin, stdout and stderr before devtmpfs is mounted.
    fn console(&mut self) {
        self.entry("dev/console", 0o020600, (5, 1), &[]);
    }

    fn finish(mut self) -> Vec<u8> {
        self.entry("TRAILER!!!", 0, (0, 0), &[]);
        self.buf
    }
}
