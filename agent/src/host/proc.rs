//! One process as procfs shows it: its state and start time (`/proc/<pid>/stat`), its pid in
//! each pid namespace (`NSpid` of `/proc/<pid>/status`), and a mount point's escapes in its
//! `mountinfo`, each parsed here once.

use std::path::Path;

/// Field `field` (numbered as in proc(5), from 1) of a `/proc/<pid>/stat` line. The command
/// (field 2) may hold spaces and parentheses: fields after it start past its last `)`.
pub fn stat_field(stat: &str, field: usize) -> Option<&str> {
    stat.rsplit_once(')')?.1.split_whitespace().nth(field.checked_sub(3)?)
}

/// `NSpid` of a `/proc/<pid>/status` text: the process's pid in each pid namespace that sees it,
/// the outermost (the procfs's own) first. `None` when the line is missing or not all numbers.
pub fn nspid(status: &str) -> Option<Vec<u32>> {
    status.lines().find_map(|l| l.strip_prefix("NSpid:"))?.split_whitespace().map(|p| p.parse().ok()).collect()
}

/// Whether a process is stopped (state `T` in /proc/<pid>/stat). `Err`: its state cannot be
/// read (`NotFound`: it is gone).
pub fn stopped(host_proc: &Path, pid: u32) -> std::io::Result<bool> {
    let stat = std::fs::read_to_string(host_proc.join(pid.to_string()).join("stat"))?;
    Ok(stat_field(&stat, 3) == Some("T"))
}

/// [`stopped`], a process whose state cannot be read taken for not stopped.
pub fn process_stopped(host_proc: &Path, pid: u32) -> bool {
    stopped(host_proc, pid).unwrap_or(false)
}

/// mountinfo escapes space, tab, newline and backslash as `\ooo`.
pub fn unescape_octal(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        // Only `\000`..`\377` are escapes (one byte); anything else is kept as it is.
        if bytes[i] == b'\\'
            && i + 3 < bytes.len()
            && (b'0'..=b'3').contains(&bytes[i + 1])
            && bytes[i + 2..i + 4].iter().all(|b| (b'0'..=b'7').contains(b))
        {
            let v = (bytes[i + 1] - b'0') * 64 + (bytes[i + 2] - b'0') * 8 + (bytes[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
pub(crate) mod tests {
    use std::time::{Duration, Instant};

    use super::*;

    /// A `sleep` child, stopped (SIGSTOP) as a held app is; the caller kills it.
    pub(crate) fn stopped_child() -> std::process::Child {
        let child = std::process::Command::new("sleep").arg("30").spawn().expect("spawn sleep");
        crate::host::sys::kill(child.id(), libc::SIGSTOP).expect("stop our own child");
        // Only a guard against a hang: the loop waits for the stop itself.
        let deadline = Instant::now() + Duration::from_secs(30);
        while !process_stopped(Path::new("/proc"), child.id()) {
            assert!(Instant::now() < deadline, "child {} never stopped", child.id());
            std::thread::sleep(Duration::from_millis(5));
        }
        child
    }

    #[test]
    fn stat_fields_after_a_command_with_parentheses() {
        let stat = "42 (a (b) c) T 1 42 42 0 -1 4194560 0 0 0 0 0 0 0 0 20 0 1 0 500 0";
        assert_eq!(stat_field(stat, 3), Some("T"));
        assert_eq!(stat_field(stat, 22), Some("500"));
        assert_eq!(stat_field(stat, 2), None, "the command is not a field after it");
        assert_eq!(stat_field("42 (x", 3), None);
    }

    #[test]
    fn nspid_entries_outermost_first() {
        assert_eq!(nspid("Name:\tx\nNSpid:\t501\t7\t1\n"), Some(vec![501, 7, 1]));
        assert_eq!(nspid("NSpid:\t501\n"), Some(vec![501]));
        assert_eq!(nspid("NSpid:\tnot-a-pid\n"), None);
        assert_eq!(nspid("Name:\tx\n"), None);
    }

    #[test]
    fn a_stopped_child_is_stopped_and_we_are_not() {
        let mut child = stopped_child();
        let (it, me) =
            (process_stopped(Path::new("/proc"), child.id()), process_stopped(Path::new("/proc"), std::process::id()));
        let _ = child.kill();
        let _ = child.wait();
        assert!(it && !me);
        assert!(stopped(Path::new("/proc"), u32::MAX).is_err(), "a missing process");
    }
}
