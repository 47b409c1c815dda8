//! What BPF objects cost in locked memory, and the RLIMIT_MEMLOCK kernels before 5.11 charge
//! them to.

/// BPF maps and programs are charged to the memlock rlimit on kernels before 5.11: lifted.
pub(super) use crate::host::sys::raise_memlock_limit;

/// Said with a failed load when RLIMIT_MEMLOCK is finite on a kernel before 5.11: there a map
/// the limit cannot hold fails with EPERM, which reads like a missing capability.
pub(super) fn memlock_hint(limit: Option<u64>) -> String {
    match limit {
        Some(bytes) if kernel_charges_memlock() => format!(
            " (RLIMIT_MEMLOCK is {} KiB and could not be raised: kernels before 5.11 charge BPF maps to it; \
             CAP_SYS_RESOURCE lets the agent lift it)",
            bytes / 1024
        ),
        _ => String::new(),
    }
}

/// Whether the running kernel charges BPF objects to RLIMIT_MEMLOCK (before 5.11).
fn kernel_charges_memlock() -> bool {
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let mut parts = release.trim().split(['.', '-']).map(|p| p.parse::<u32>().ok());
    match (parts.next().flatten(), parts.next().flatten()) {
        (Some(major), Some(minor)) => (major, minor) < (5, 11),
        // Unknown: say it, the hint costs nothing.
        _ => true,
    }
}

/// The memory the kernel reports charged for this process's BPF objects: the `memlock:` line
/// of every map and program fd in `/proc/self/fdinfo`. Kernels before 5.11 charge exactly this
/// to RLIMIT_MEMLOCK (per user: every process of the agent's uid adds to the same sum); later
/// kernels charge the memory cgroup instead and show their own estimate here.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BpfMemlock {
    pub maps: u32,
    pub map_bytes: u64,
    pub programs: u32,
    pub program_bytes: u64,
}

impl BpfMemlock {
    pub fn of_this_process() -> BpfMemlock {
        let mut sum = BpfMemlock::default();
        let Ok(dir) = std::fs::read_dir("/proc/self/fdinfo") else { return sum };
        for entry in dir.flatten() {
            let Ok(text) = std::fs::read_to_string(entry.path()) else { continue };
            let field = |name: &str| text.lines().find_map(|l| l.strip_prefix(name)).map(str::trim);
            let Some(bytes) = field("memlock:").and_then(|v| v.parse::<u64>().ok()) else { continue };
            if field("map_type:").is_some() {
                sum.maps += 1;
                sum.map_bytes += bytes;
            } else if field("prog_type:").is_some() {
                sum.programs += 1;
                sum.program_bytes += bytes;
            }
        }
        sum
    }
}
