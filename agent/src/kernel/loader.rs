//! An aya loader made without parsing the kernel's BTF.
//!
//! aya 0.14's `EbpfLoader::new()` always reads and parses `/sys/kernel/btf/vmlinux` (5–6 MB on
//! disk, about 22 MiB of heap while parsed), even when `.btf(None)` follows at once. valet's
//! programs carry no CO-RE relocation (they read the kernel through `LAYOUT`'s offsets, from our
//! own BTF reader), so that parse is only waste, and it was the agent's peak memory. aya 0.15
//! parses only when an object needs it (aya-rs/aya#1639, #1644), but it requires Rust 1.98.
//!
//! Until then the loader is made on a short-lived thread whose `open` calls fail (a seccomp
//! filter of that thread only): aya's read of the file fails, and `new()` keeps no BTF, as
//! `.btf(None)` would. `new()` opens nothing else. Remove this when aya is ≥ 0.15.

use aya::EbpfLoader;

/// `AUDIT_ARCH_*` of this build's syscall ABI (`include/uapi/linux/audit.h`); on others the
/// loader is made as aya makes it.
#[cfg(target_arch = "x86_64")]
const AUDIT_ARCH: Option<u32> = Some(0xc000_003e);
#[cfg(target_arch = "aarch64")]
const AUDIT_ARCH: Option<u32> = Some(0xc000_00b7);
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
const AUDIT_ARCH: Option<u32> = None;

/// Offsets in `struct seccomp_data`.
const SECCOMP_DATA_NR: u32 = 0;
const SECCOMP_DATA_ARCH: u32 = 4;

/// The syscalls that open a file by path, on this architecture.
fn open_syscalls() -> Vec<u32> {
    let nrs = vec![libc::SYS_openat as u32, libc::SYS_openat2 as u32];
    // aarch64 (and every newer ABI) has no `open`.
    #[cfg(target_arch = "x86_64")]
    let nrs = [nrs, vec![libc::SYS_open as u32]].concat();
    nrs
}

/// A classic BPF seccomp program: `open`-family syscalls of this ABI fail with `ENOENT`,
/// everything else is allowed.
fn deny_open_filter(arch: u32) -> Vec<libc::sock_filter> {
    let stmt = |code: u32, k: u32| libc::sock_filter { code: code as u16, jt: 0, jf: 0, k };
    let jeq = |k: u32, jt: u8, jf: u8| libc::sock_filter {
        code: (libc::BPF_JMP | libc::BPF_JEQ | libc::BPF_K) as u16,
        jt,
        jf,
        k,
    };
    let nrs = open_syscalls();
    let n = nrs.len() as u8;
    let mut prog = vec![
        stmt(libc::BPF_LD | libc::BPF_W | libc::BPF_ABS, SECCOMP_DATA_ARCH),
        // Another ABI (none is used here): allowed, past the syscall checks.
        jeq(arch, 0, n + 1),
        stmt(libc::BPF_LD | libc::BPF_W | libc::BPF_ABS, SECCOMP_DATA_NR),
    ];
    for (i, nr) in nrs.iter().enumerate() {
        // A match jumps over the remaining checks and the allow to the errno return.
        prog.push(jeq(*nr, n - i as u8, 0));
    }
    prog.push(stmt(libc::BPF_RET | libc::BPF_K, libc::SECCOMP_RET_ALLOW));
    prog.push(stmt(libc::BPF_RET | libc::BPF_K, libc::SECCOMP_RET_ERRNO | libc::ENOENT as u32));
    prog
}

/// Makes this thread's `open` calls fail from now on, for the rest of its life. Only for a
/// thread that is about to end: the filter cannot be lifted.
fn deny_open_on_this_thread() -> std::io::Result<()> {
    let arch = AUDIT_ARCH.ok_or_else(|| std::io::Error::other("no seccomp architecture known for this build"))?;
    let filter = deny_open_filter(arch);
    crate::host::sys::seccomp_this_thread(&filter)?;
    // The filter is in force if the file aya would parse no longer opens.
    match std::fs::File::open("/sys/kernel/btf/vmlinux") {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
        Ok(_) => Err(std::io::Error::other("the seccomp filter did not take effect")),
    }
}

/// `EbpfLoader::new()` without the kernel BTF parse (see the module's comment), with the
/// reason when that could not be done: then the parse happened, and memory peaked with it.
pub fn loader_without_kernel_btf() -> (EbpfLoader<'static>, Option<String>) {
    let made = std::thread::Builder::new()
        .name("valet-loader".into())
        .spawn(|| deny_open_on_this_thread().map(|()| EbpfLoader::new()).map_err(|e| format!("seccomp filter: {e}")));
    let result = match made {
        Ok(thread) => thread.join().unwrap_or_else(|_| Err("the loader thread panicked".into())),
        Err(e) => Err(format!("loader thread: {e}")),
    };
    match result {
        Ok(loader) => (loader, None),
        Err(why) => {
            let mut loader = EbpfLoader::new();
            loader.btf(None);
            (loader, Some(why))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn opens_fail_on_the_filtered_thread_only() {
        let inside = std::thread::spawn(|| {
            deny_open_on_this_thread().expect("filter installed");
            std::fs::File::open("/proc/self/status").map(|_| ()).map_err(|e| e.kind())
        })
        .join()
        .expect("thread");
        assert_eq!(inside, Err(std::io::ErrorKind::NotFound));
        // This thread and the process's others are not filtered.
        assert!(std::fs::File::open("/proc/self/status").is_ok());
        assert!(std::thread::spawn(|| std::fs::File::open("/proc/self/status").is_ok()).join().expect("thread"));
    }

    #[test]
    fn the_filter_jumps_land_on_the_returns() {
        let prog = deny_open_filter(AUDIT_ARCH.expect("a known architecture"));
        let n = open_syscalls().len();
        assert_eq!(prog.len(), 3 + n + 2);
        let ret = |i: usize| prog[i].code as u32 == libc::BPF_RET | libc::BPF_K;
        // Another ABI → allow; each syscall match → errno.
        let other_abi = 1 + 1 + prog[1].jf as usize;
        assert!(ret(other_abi));
        assert_eq!(prog[other_abi].k, libc::SECCOMP_RET_ALLOW);
        for i in 0..n {
            let at = 3 + i;
            let target = at + 1 + prog[at].jt as usize;
            assert!(ret(target));
            assert_eq!(prog[target].k, libc::SECCOMP_RET_ERRNO | libc::ENOENT as u32, "check {i}");
        }
    }

    #[test]
    fn makes_a_loader_without_parsing() {
        let (loader, fell_back) = loader_without_kernel_btf();
        assert_eq!(fell_back, None);
        // The loader holds no target BTF (a parsed one would print megabytes here).
        let shown = format!("{loader:?}");
        assert!(shown.contains("btf: None"), "{}", &shown[..shown.len().min(300)]);
    }
}
