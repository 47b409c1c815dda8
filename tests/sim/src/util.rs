//! Small helpers shared by the modules: randomness, timestamps, clocks.

use std::fmt::Write as _;

/// Fills `buf` from the kernel's CSPRNG (no extra crate needed for test ids).
pub fn random_bytes(buf: &mut [u8]) {
    let mut filled = 0;
    while filled < buf.len() {
        // SAFETY: the pointer and length describe the unfilled tail of `buf`.
        let n = unsafe { libc::getrandom(buf[filled..].as_mut_ptr().cast(), buf.len() - filled, 0) };
        if n > 0 {
            filled += n as usize;
        } else {
            // EINTR or an ancient kernel: fall back to a time-and-counter mix so ids stay unique.
            fallback_fill(&mut buf[filled..]);
            return;
        }
    }
}

fn fallback_fill(buf: &mut [u8]) {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0x9e37_79b9_7f4a_7c15);
    for chunk in buf.chunks_mut(8) {
        let mut x = monotonic_ns() ^ COUNTER.fetch_add(0x9e37_79b9_7f4a_7c15, Ordering::Relaxed);
        // splitmix64 finaliser
        x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        x ^= x >> 31;
        chunk.copy_from_slice(&x.to_le_bytes()[..chunk.len()]);
    }
}

/// Lower-case hex of `n` random bytes.
pub fn random_hex(n: usize) -> String {
    let mut buf = vec![0u8; n];
    random_bytes(&mut buf);
    let mut s = String::with_capacity(n * 2);
    for b in buf {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// A random container id: 64 hex characters, like containerd/CRI-O/Docker ids.
pub fn random_container_id() -> String {
    random_hex(32)
}

/// A random RFC 4122 version 4 UUID in its text form.
pub fn uuid_v4() -> String {
    let mut b = [0u8; 16];
    random_bytes(&mut b);
    b[6] = (b[6] & 0x0f) | 0x40;
    b[8] = (b[8] & 0x3f) | 0x80;
    let h: String = b.iter().fold(String::with_capacity(32), |mut s, x| {
        let _ = write!(s, "{x:02x}");
        s
    });
    format!("{}-{}-{}-{}-{}", &h[0..8], &h[8..12], &h[12..16], &h[16..20], &h[20..32])
}

/// The 5-character random suffix the API server appends for `generateName`
/// (consonants and digits only, like apimachinery's `utilrand.String`).
pub fn name_suffix() -> String {
    const ALPHABET: &[u8] = b"bcdfghjklmnpqrstvwxz2456789";
    let mut b = [0u8; 5];
    random_bytes(&mut b);
    b.iter().map(|x| ALPHABET[*x as usize % ALPHABET.len()] as char).collect()
}

/// Whether a child of this process has exited and is not reaped yet: one look (`waitid` with
/// `WNOWAIT`, nothing reaped) in place of a `waitpid` per child. True if it cannot tell.
pub fn child_exited() -> bool {
    // SAFETY: a zeroed siginfo_t is a valid value; waitid only writes into it.
    let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
    let flags = libc::WEXITED | libc::WNOHANG | libc::WNOWAIT | libc::__WALL;
    // SAFETY: plain syscall writing into `info`.
    if unsafe { libc::waitid(libc::P_ALL, 0, &mut info, flags) } != 0 {
        return std::io::Error::last_os_error().raw_os_error() != Some(libc::ECHILD);
    }
    // SAFETY: waitid filled it (si_pid 0: no child has changed state).
    unsafe { info.si_pid() != 0 }
}

/// RFC 3339 UTC time with second precision, as `metav1.Time` serialises.
pub fn now_rfc3339() -> String {
    chrono::Utc::now().format("%Y-%m-%dT%H:%M:%SZ").to_string()
}

/// RFC 3339 UTC time with microseconds, as `metav1.MicroTime` serialises.
pub fn now_rfc3339_micro() -> String {
    chrono::Utc::now().format("%Y-%m-%dT%H:%M:%S%.6fZ").to_string()
}

/// CLOCK_MONOTONIC in nanoseconds: the clock the stand-in proxies stamp requests with.
pub use valet_test_support::monotonic_ns;

/// A binary built beside the running executable: in its directory (`target/<profile>/`) or the
/// one above (from `target/<profile>/deps/`, where tests run).
pub fn next_to_exe(name: &str) -> Option<std::path::PathBuf> {
    let exe = std::env::current_exe().ok()?;
    exe.ancestors().skip(1).take(2).map(|d| d.join(name)).find(|p| p.is_file())
}

/// A directory on a tmpfs for the simulated node's runtime state, as a real node keeps its
/// runtime's state in `/run` (a tmpfs there): `/run` when it is a tmpfs, else `/dev/shm`, else the
/// temp dir. Some hosts have `/run` and `/tmp` on their root disk, where making and removing
/// thousands of small files (bundles, leases, event files) costs ext4 inode searches that
/// dominated the benchmarks' pod setup.
pub fn state_base() -> std::path::PathBuf {
    static BASE: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    BASE.get_or_init(|| {
        ["/run", "/dev/shm"]
            .into_iter()
            .map(std::path::PathBuf::from)
            .find(|p| is_tmpfs(p))
            .unwrap_or_else(std::env::temp_dir)
    })
    .clone()
}

/// Whether `path` is on a tmpfs.
pub fn is_tmpfs(path: &std::path::Path) -> bool {
    use std::os::unix::ffi::OsStrExt as _;
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: `statfs` is plain old data, for which all zeroes is a valid value.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: a valid C string and out-pointer.
    unsafe { libc::statfs(c.as_ptr(), &mut st) == 0 && st.f_type == libc::TMPFS_MAGIC }
}

/// Fails the test when not run as root: privileged tests must never pass by skipping silently
/// (`cargo xtask test` runs them as root).
pub fn require_root() {
    // SAFETY: plain syscall.
    let euid = unsafe { libc::geteuid() };
    assert_eq!(euid, 0, "privileged tests need root (run them with `cargo xtask test`)");
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuid_shape() {
        let u = uuid_v4();
        assert_eq!(u.len(), 36);
        assert_eq!(&u[14..15], "4");
        assert!(matches!(&u[19..20], "8" | "9" | "a" | "b"));
        assert_ne!(u, uuid_v4());
    }

    #[test]
    fn state_base_is_a_tmpfs_when_the_host_has_one() {
        assert!(is_tmpfs(std::path::Path::new("/dev/shm")) || !std::path::Path::new("/dev/shm").is_dir());
        let base = state_base();
        assert!(is_tmpfs(&base) || base == std::env::temp_dir(), "{}", base.display());
        assert!(!is_tmpfs(std::path::Path::new("/proc")));
    }

    #[test]
    fn container_id_shape() {
        let id = random_container_id();
        assert_eq!(id.len(), 64);
        assert!(id.chars().all(|c| c.is_ascii_hexdigit()));
    }
}
