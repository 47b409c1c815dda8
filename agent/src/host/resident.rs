//! The agent's own resident memory, read at the steps of loading: the DaemonSet's memory limit
//! has to fit the peak (`VmHWM`), and loading is where it is reached.

/// Resident memory now and at its highest so far, in KiB (`VmRSS`, `VmHWM` of
/// `/proc/self/status`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Resident {
    pub rss_kib: u64,
    pub peak_kib: u64,
}

impl Resident {
    /// This process's figures; zeros where procfs does not say (never fails).
    pub fn now() -> Resident {
        std::fs::read_to_string("/proc/self/status").map(|s| Resident::parse(&s)).unwrap_or_default()
    }

    fn parse(status: &str) -> Resident {
        let kib = |name: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.trim().strip_suffix("kB"))
                .and_then(|v| v.trim().parse().ok())
                .unwrap_or(0)
        };
        Resident { rss_kib: kib("VmRSS:"), peak_kib: kib("VmHWM:") }
    }
}

/// Logs (at debug) the resident memory after a step of loading.
pub fn note(step: &str) {
    let r = Resident::now();
    tracing::debug!(step, rss_kib = r.rss_kib, peak_kib = r.peak_kib, "resident memory");
}

/// Gives freed heap back to the node (glibc keeps it otherwise).
pub fn trim_heap() {
    super::sys::malloc_trim();
}

/// Unmaps the executable's pages that start-up left resident (the code and read-only data it ran
/// through once: loading the kernel programs, reading the kubeconfig, parsing the flags); what
/// the agent runs after maps again on its next use. Returns the KiB unmapped (0, logged, when the
/// kernel refuses).
pub fn unmap_start_up_pages() -> u64 {
    match super::sys::unmap_clean_exe_pages() {
        Ok(kib) => kib,
        Err(e) => {
            tracing::warn!("cannot unmap the executable's start-up pages: {e}");
            0
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_status_fields() {
        let s = "Name:\tvalet-agent\nVmPeak:\t  100 kB\nVmHWM:\t   34288 kB\nVmRSS:\t   13888 kB\n";
        assert_eq!(Resident::parse(s), Resident { rss_kib: 13888, peak_kib: 34288 });
    }

    #[test]
    fn missing_or_odd_fields_are_zero() {
        assert_eq!(Resident::parse("VmRSS: lots\n"), Resident::default());
        assert_eq!(Resident::parse(""), Resident::default());
    }

    #[test]
    fn reads_this_process() {
        let r = Resident::now();
        assert!(r.rss_kib > 0 && r.peak_kib >= r.rss_kib, "{r:?}");
    }

    #[test]
    fn unmapping_this_process_keeps_it_running() {
        // The test binary's own clean pages go; the code after the call runs from the file again.
        let kib = unmap_start_up_pages();
        assert!(kib > 0, "nothing unmapped");
        let smaps = std::fs::read_to_string("/proc/self/smaps").expect("this process's smaps");
        let exe = std::fs::read_link("/proc/self/exe").expect("this process's executable");
        let resident: u64 =
            crate::host::smaps::clean_exe_mappings(&smaps, &exe.to_string_lossy()).iter().map(|m| m.rss_kib).sum();
        assert!(resident < kib, "still {resident} KiB resident of the {kib} unmapped");
    }
}
