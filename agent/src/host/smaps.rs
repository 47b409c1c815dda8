//! `/proc/<pid>/smaps` read for what the agent may unmap of itself: the mappings of its own
//! executable whose pages are all the file's.

/// A mapping of the executable that can be unmapped and read back from the file as it was.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CleanMapping {
    pub start: usize,
    pub len: usize,
    /// KiB resident in it.
    pub rss_kib: u64,
}

/// The mappings of `exe` in a `/proc/<pid>/smaps` text whose pages are all the file's: private,
/// not writable, and with no page of their own, resident or swapped out (`Anonymous: 0 kB` and
/// `Swap: 0 kB`, both listed). The RELRO segment, read-only but written by the dynamic loader's
/// relocations first, has pages of its own (in memory or in swap) and is left out, as are the
/// writable data and every other file's mappings.
pub fn clean_exe_mappings(smaps: &str, exe: &str) -> Vec<CleanMapping> {
    let mut found = Vec::new();
    let mut current: Option<(CleanMapping, Own)> = None;
    for line in smaps.lines() {
        if let Some(head) = mapping_head(line, exe) {
            found.extend(current.take().and_then(clean));
            current = head.map(|m| (m, Own::default()));
            continue;
        }
        let Some((m, own)) = current.as_mut() else { continue };
        if let Some(v) = line.strip_prefix("Rss:") {
            m.rss_kib = kib(v).unwrap_or(0);
        } else if let Some(v) = line.strip_prefix("Anonymous:") {
            own.anonymous = kib(v);
        } else if let Some(v) = line.strip_prefix("Swap:") {
            own.swap = kib(v);
        }
    }
    found.extend(current.and_then(clean));
    found
}

/// A mapping's head line: `None` if `line` is not one; `Some(None)` for a mapping not wanted (not
/// `exe`'s, or writable, or shared); `Some(Some(_))` for a candidate.
fn mapping_head(line: &str, exe: &str) -> Option<Option<CleanMapping>> {
    let mut fields = line.splitn(6, ' ');
    let range = fields.next()?;
    let (start, end) = range.split_once('-')?;
    let start = usize::from_str_radix(start, 16).ok()?;
    let end = usize::from_str_radix(end, 16).ok()?;
    let perms = fields.next()?;
    let path = fields.nth(3).map(str::trim_start).unwrap_or("");
    let wanted = path == exe && perms.len() == 4 && perms.starts_with("r-") && perms.ends_with('p') && end > start;
    Some(wanted.then_some(CleanMapping { start, len: end - start, rss_kib: 0 }))
}

/// A mapping's pages of its own, in KiB, as listed (`None`: not listed).
#[derive(Default)]
struct Own {
    anonymous: Option<u64>,
    swap: Option<u64>,
}

fn clean((m, own): (CleanMapping, Own)) -> Option<CleanMapping> {
    (own.anonymous == Some(0) && own.swap == Some(0)).then_some(m)
}

fn kib(v: &str) -> Option<u64> {
    v.trim().strip_suffix("kB")?.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXE: &str = "/usr/local/bin/valet-agent";

    fn mapping(head: &str, rss: u64, anonymous: u64) -> String {
        swapped(head, rss, anonymous, 0)
    }

    fn swapped(head: &str, rss: u64, anonymous: u64, swap: u64) -> String {
        format!(
            "{head}\nSize:  100 kB\nRss:  {rss} kB\nPss:  {rss} kB\nAnonymous:  {anonymous} kB\nSwap:  {swap} kB\n\
             VmFlags: rd mr\n"
        )
    }

    #[test]
    fn picks_the_executables_clean_read_only_mappings() {
        let smaps = [
            mapping("55d000000000-55d000100000 r--p 00000000 fe:00 42    /usr/local/bin/valet-agent", 900, 0),
            mapping("55d000100000-55d000a00000 r-xp 00100000 fe:00 42    /usr/local/bin/valet-agent", 8000, 0),
            // RELRO: read-only now, relocated by the loader first.
            mapping("55d000a00000-55d000a90000 r--p 00a00000 fe:00 42    /usr/local/bin/valet-agent", 576, 576),
            // The same, its copies swapped out: nothing anonymous resident, but pages of its own.
            swapped("55d000a90000-55d000a98000 r--p 00a90000 fe:00 42    /usr/local/bin/valet-agent", 0, 0, 32),
            mapping("55d000a98000-55d000aa0000 rw-p 00a98000 fe:00 42    /usr/local/bin/valet-agent", 64, 64),
            mapping("7f0000000000-7f0000100000 r-xp 00026000 fe:00 7    /usr/lib/x86_64-linux-gnu/libc.so.6", 1000, 0),
            mapping("7f0000200000-7f0000300000 r--s 00001000 00:10 1038    anon_inode:bpf-map", 500, 0),
            mapping("7f0000300000-7f0000400000 rw-p 00000000 00:00 0 ", 300, 300),
            mapping("7f0000400000-7f0000500000 r-xs 00000000 fe:00 42    /usr/local/bin/valet-agent", 100, 0),
        ]
        .concat();
        assert_eq!(
            clean_exe_mappings(&smaps, EXE),
            [
                CleanMapping { start: 0x55d0_0000_0000, len: 0x10_0000, rss_kib: 900 },
                CleanMapping { start: 0x55d0_0010_0000, len: 0x90_0000, rss_kib: 8000 },
            ]
        );
    }

    #[test]
    fn a_mapping_whose_own_pages_are_not_listed_is_kept() {
        let head = "55d000100000-55d000a00000 r-xp 00100000 fe:00 42    /usr/local/bin/valet-agent";
        assert_eq!(clean_exe_mappings(&format!("{head}\nRss:  8000 kB\n"), EXE), []);
        assert_eq!(clean_exe_mappings(&format!("{head}\nRss:  8000 kB\nAnonymous:  0 kB\n"), EXE), []);
        assert_eq!(clean_exe_mappings(&format!("{head}\nRss:  8000 kB\nSwap:  0 kB\n"), EXE), []);
        assert_eq!(clean_exe_mappings("", EXE), []);
        assert_eq!(clean_exe_mappings("garbage line\nRss: x\n", EXE), []);
    }
}
