//! One qemu run: a kernel booted with its initramfs and the host's `/` shared read-only, its
//! serial console kept and echoed, killed at its deadline.
//!
//! `/dev/kvm` on the machines this runs on is a PVM hypervisor that cannot run stock kernels, so
//! qemu uses TCG (`microvm` has no timer under TCG and hangs: `q35`).
use std::io::{BufRead as _, Write as _};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, anyhow};

use super::kernel::Kernel;
use crate::arch::Arch;

/// Boots `kernel` with our initramfs and the host's `/` shared read-only, echoes the serial
/// console (prefixed with the kernel release) and keeps it in `console`. Returns the console's
/// lines and whether the guest had to be killed at `deadline`.
pub(crate) fn qemu(
    kernel: &Kernel,
    append: &str,
    extra: &[&str],
    console: &Path,
    deadline: Duration,
) -> Result<(Vec<String>, bool)> {
    let log = std::fs::File::create(console)?;
    // arm64: the `virt` machine, its PL011 console; `pauth-impdef` makes TCG's pointer
    // authentication cheap (QEMU's own algorithm instead of QARMA's).
    let (program, machine, cpu, tty) = match kernel.arch {
        Arch::Amd64 => ("qemu-system-x86_64", "q35", "max", "ttyS0"),
        Arch::Arm64 => ("qemu-system-aarch64", "virt", "max,pauth-impdef=on", "ttyAMA0"),
    };
    let append = format!("console={tty} panic=-1 loglevel=4 mitigations=off no_timer_check rdinit=/init {append}");
    let mut child = Command::new(program)
        .args(["-accel", "tcg,thread=multi,tb-size=256", "-cpu", cpu, "-machine", machine])
        .args(["-m", "2G", "-smp", "2", "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot"])
        .args(["-serial", "stdio", "-monitor", "none"])
        .args(["-virtfs", "local,path=/,mount_tag=host,security_model=none,readonly=on,multidevs=remap"])
        .arg("-kernel")
        .arg(&kernel.vmlinux)
        .arg("-initrd")
        .arg(&kernel.initramfs)
        .args(["-append", &append])
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .with_context(|| format!("start {program}"))?;
    // The console is read on a thread (kept in `console`, its test lines echoed with a prefix) so
    // that the deadline is kept even when the guest prints nothing.
    let stdout = child.stdout.take().ok_or_else(|| anyhow!("qemu stdout"))?;
    let release = kernel.release.clone();
    let reader = std::thread::spawn(move || {
        let mut log = log;
        let mut lines = Vec::new();
        for line in std::io::BufReader::new(stdout).split(b'\n').map_while(|l| l.ok()) {
            let line = String::from_utf8_lossy(&line).trim_end_matches('\r').to_string();
            let _ = writeln!(log, "{line}");
            if echoed(&line) {
                let short: String = line.chars().take(400).collect();
                println!("[{release}] {short}");
            } else if line.contains("Verifier output") {
                // A panic's message with the verifier's log in Debug form: its reason is at the end.
                let pieces: Vec<&str> = line.split("\\n").filter(|p| !p.trim().is_empty()).collect();
                let tail = pieces.len().saturating_sub(5);
                let head: String = line.chars().take(160).collect();
                println!("[{release}] {head} ... {}", pieces[tail..].join(" | "));
            }
            lines.push(line);
        }
        lines
    });
    let deadline = Instant::now() + deadline;
    let mut timed_out = false;
    loop {
        if child.try_wait()?.is_some() {
            break;
        }
        if Instant::now() >= deadline {
            timed_out = true;
            let _ = child.kill();
            let _ = child.wait();
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let lines = reader.join().map_err(|_| anyhow!("console reader panicked"))?;
    Ok((lines, timed_out))
}

/// Console lines worth echoing: test names and results, panics (cut to 400 characters: a
/// verifier log is long; the whole of it is in the console log), the guest's own markers.
/// A guest kernel panic with no BPF program on its stack: a fault of the kernel or of the
/// emulator (QEMU's TCG has double-faulted a Debian kernel in its slab allocator's
/// `cmpxchg16b`), not of valet's programs. Returns its summary for the log: the oops line, the
/// faulting function and the task. `None` when the guest did not panic, or when a BPF program
/// (`bpf_prog_*`, a BPF helper) is on the panicking stack: that is valet's, and never rerun.
pub(crate) fn foreign_panic(lines: &[String]) -> Option<String> {
    let end = lines.iter().position(|l| l.contains("Kernel panic - not syncing"))?;
    let start = lines[..end]
        .iter()
        .position(|l| {
            l.contains("Oops:")
                || l.contains("BUG:")
                || l.contains("traps: PANIC")
                || l.contains("------------[ cut here ]")
        })
        .unwrap_or(end);
    // A panic() of its own prints its stack after its line, up to "---[ end Kernel panic".
    let last = lines[end..].iter().position(|l| l.contains("end Kernel panic")).map_or(lines.len() - 1, |i| end + i);
    let report = &lines[start.saturating_sub(1)..=last];
    if report.iter().any(|l| l.contains("bpf")) {
        return None;
    }
    let strip = |l: &String| l.split_once("] ").map_or(l.as_str(), |(_, r)| r).trim().to_string();
    let pick = |key: &str| report.iter().find(|l| l.contains(key)).map(strip);
    let parts: Vec<String> =
        [pick("Oops:").or_else(|| pick("BUG:")), pick("RIP: 0010:"), pick("Comm:"), Some(strip(&lines[end]))]
            .into_iter()
            .flatten()
            .collect();
    Some(parts.join(" | "))
}

fn echoed(line: &str) -> bool {
    const PREFIXES: [&str; 11] = [
        "test ",
        "degraded (",
        "running ",
        "VALET-",
        "thread '",
        "node",
        "kubelet:",
        "---",
        "without ",
        "BPF memory",
        "agent resident memory",
    ];
    PREFIXES.iter().any(|p| line.starts_with(p)) || line.contains("FAIL") || line.contains("Kernel panic")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn foreign_panic_and_ours() {
        let log = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/testdata/tcg-double-fault.log"))
            .expect("read the fixture");
        let lines: Vec<String> = log.lines().map(String::from).collect();
        let summary = foreign_panic(&lines).expect("a panic with no BPF program on its stack");
        assert!(summary.starts_with("Oops: double fault"), "{summary}");
        assert!(summary.contains("RIP: 0010:kmem_cache_alloc_node_noprof"), "{summary}");
        assert!(summary.contains("Comm: systemd"), "{summary}");
        assert!(summary.ends_with("Kernel panic - not syncing: Fatal exception in interrupt"), "{summary}");
        // The same panic with a BPF program on its stack is valet's: never rerun.
        let mut ours = lines.clone();
        let at = ours.iter().position(|l| l.contains("__alloc_skb+0x14a")).expect("its stack");
        ours.insert(at, "[  221.662036]  bpf_prog_6deef7357e7b4530_on_exit+0x52/0x9a".into());
        assert_eq!(foreign_panic(&ours), None);
        // No panic: the scenarios' own lines only.
        assert_eq!(foreign_panic(&lines[..lines.iter().position(|l| l.contains("traps:")).expect("its trap")]), None);
    }
}
