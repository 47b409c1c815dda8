//! One qemu run: a kernel booted with its initramfs and the host's `/` shared read-only, its
//! serial console kept and echoed, killed at its deadline.
//!
//! `/dev/kvm` on the machines this runs on is a PVM hypervisor that cannot run stock kernels, so
//! qemu uses TCG (`microvm` has no timer under TCG and hangs: `q35`).
use std::io::{BufRead as _, Write as _};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, anyhow};

use super::kernel::Kernel;
use crate::arch::Arch;

/// A guest that prints no console line for this long is hung, whatever its deadline: the
/// slowest step seen under TCG on a loaded 2-core machine (a node's image import, a kernel test)
/// took under 3 minutes.
const SILENCE: Duration = Duration::from_secs(10 * 60);

/// Why a guest was killed: its deadline passed, or [`SILENCE`] went by without a console line
/// (then the console's lines from `dump_from` on are what [`dump_hung_guest`] made it print).
pub(crate) struct Killed {
    why: String,
    silent: bool,
    dump_from: usize,
}

impl std::fmt::Display for Killed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.why)
    }
}

impl Killed {
    /// A guest gone silent whose dump names nothing of valet's ([`names_valet_in`]: no task of the
    /// agent's on a CPU, no BPF frame): a hang of the emulator's or the kernel's, as a lost
    /// interrupt leaves a guest (a CPU that takes no IPI, a 9p request never answered). Its
    /// summary: the tasks on the CPUs and where they were, or that SysRq printed nothing.
    pub(crate) fn foreign_hang(&self, lines: &[String]) -> Option<String> {
        if !self.silent {
            return None;
        }
        // What was on its CPUs (SysRq `l`); the task lists' stacks hold stale frames (`? ...`).
        let dump = lines.get(self.dump_from..).unwrap_or(&[]);
        let start = dump.iter().position(|l| l.contains("sysrq: Show backtrace of all active CPUs"));
        let dump = start.map_or(&[][..], |i| &dump[i..]);
        let dump = &dump[..dump.iter().position(|l| l.contains("sysrq: Show State")).unwrap_or(dump.len())];
        if names_valet_in(dump) {
            return None;
        }
        let on_cpus: Vec<String> = dump
            .iter()
            .filter(|l| l.contains("Comm:") || l.contains("RIP: 0010:"))
            .take(8)
            .map(|l| unstamped(l).trim_end().to_string())
            .collect();
        Some(if on_cpus.is_empty() {
            format!("{}; SysRq printed nothing", self.why)
        } else {
            format!("{}; on its CPUs: {}", self.why, on_cpus.join(" | "))
        })
    }
}

/// Boots `kernel` with our initramfs and the host's `/` shared read-only, echoes the serial
/// console (prefixed with the kernel release) and keeps it in `console`. Returns the console's
/// lines and, when the guest had to be killed, why ([`Killed`]).
pub(crate) fn qemu(
    kernel: &Kernel,
    append: &str,
    extra: &[&str],
    console: &Path,
    deadline: Duration,
) -> Result<(Vec<String>, Option<Killed>)> {
    let log = std::fs::File::create(console)?;
    // arm64: the `virt` machine, its PL011 console; `pauth-impdef` makes TCG's pointer
    // authentication cheap (QEMU's own algorithm instead of QARMA's).
    let (program, machine, cpu, tty) = match kernel.arch {
        Arch::Amd64 => ("qemu-system-x86_64", "q35", "max", "ttyS0"),
        Arch::Arm64 => ("qemu-system-aarch64", "virt", "max,pauth-impdef=on", "ttyAMA0"),
    };
    // A CPU stuck in the kernel (soft lockup) or an RCU stall panics the guest at once (the
    // panic replays the kernel's whole log, its all-CPU backtraces included, which loglevel=4
    // keeps off the console), rather than hanging until the deadline. SysRq is on for
    // [`dump_hung_guest`].
    let append = format!(
        "console={tty} panic=-1 loglevel=4 mitigations=off no_timer_check rdinit=/init softlockup_panic=1 \
         softlockup_all_cpu_backtrace=1 sysctl.kernel.panic_on_rcu_stall=1 panic_print=0x20 sysctl.kernel.sysrq=1 \
         {append}"
    );
    let monitor = console.with_extension("monitor.sock");
    let _ = std::fs::remove_file(&monitor);
    let mut child = Command::new(program)
        .args(["-accel", "tcg,thread=multi,tb-size=256", "-cpu", cpu, "-machine", machine])
        .args(["-m", "2G", "-smp", "2", "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot"])
        .args(["-serial", "stdio", "-monitor"])
        .arg(format!("unix:{},server=on,wait=off", monitor.display()))
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
    let heard = Heard { started: Instant::now(), last_ms: Arc::default(), count: Arc::default() };
    let reader = read_console(stdout, log, kernel.release.clone(), heard.clone());
    let mut killed = None;
    while child.try_wait()?.is_none() {
        let (quiet, count) = heard.quiet();
        if heard.started.elapsed() >= deadline {
            let why = format!("the VM was killed at its deadline, {deadline:?}");
            killed = Some(Killed { why, silent: false, dump_from: count });
        } else if quiet >= SILENCE {
            let why = format!("the VM was killed after {SILENCE:?} without a console line");
            killed = Some(Killed { why, silent: true, dump_from: count });
        }
        if killed.is_some() {
            dump_hung_guest(&monitor, &console.with_extension("monitor.log"));
            let _ = child.kill();
            let _ = child.wait();
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let lines = reader.join().map_err(|_| anyhow!("console reader panicked"))?;
    let _ = std::fs::remove_file(&monitor);
    Ok((lines, killed))
}

/// What the console reader heard: when the last line came (milliseconds from `started`), and how
/// many lines so far.
#[derive(Clone)]
struct Heard {
    started: Instant,
    last_ms: Arc<AtomicU64>,
    count: Arc<AtomicUsize>,
}

impl Heard {
    fn line(&self) {
        self.last_ms.store(self.started.elapsed().as_millis() as u64, Ordering::Relaxed);
        self.count.fetch_add(1, Ordering::Relaxed);
    }

    /// How long since the last line, and how many lines so far.
    fn quiet(&self) -> (Duration, usize) {
        let last = Duration::from_millis(self.last_ms.load(Ordering::Relaxed));
        (self.started.elapsed().saturating_sub(last), self.count.load(Ordering::Relaxed))
    }
}

/// The console's reader thread: every line kept in `log` and returned, test lines echoed with the
/// kernel release before them.
fn read_console(
    stdout: std::process::ChildStdout,
    mut log: std::fs::File,
    release: String,
    heard: Heard,
) -> std::thread::JoinHandle<Vec<String>> {
    std::thread::spawn(move || {
        let mut lines = Vec::new();
        for line in std::io::BufReader::new(stdout).split(b'\n').map_while(|l| l.ok()) {
            heard.line();
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
    })
}

/// Before a hung guest is killed: where its CPUs are (the monitor's `info registers -a`, kept in
/// `log`), then SysRq through its keyboard: the console's log level up, `w` (the blocked tasks,
/// a task waiting on the host's 9p share included, which the hung-task detector skips as
/// killable), `l` (every CPU's backtrace) and `t` (every task), onto the console. A guest whose
/// CPUs take no interrupt prints nothing of these; its registers still say where they are. Best
/// effort.
fn dump_hung_guest(monitor: &Path, log: &Path) {
    use std::io::Read as _;
    let Ok(mut socket) = std::os::unix::net::UnixStream::connect(monitor) else { return };
    let _ = socket.set_read_timeout(Some(Duration::from_millis(500)));
    let mut said = Vec::new();
    let mut ask = |command: &str, wait: Duration| {
        let _ = socket.write_all(format!("{command}\n").as_bytes());
        let until = Instant::now() + wait;
        let mut buf = [0u8; 65536];
        while Instant::now() < until {
            match socket.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => said.extend_from_slice(&buf[..n]),
                Err(_) => {}
            }
        }
    };
    ask("info registers -a", Duration::from_secs(2));
    // `8` first: the console's log level to 8, else only each dump's heading passes loglevel=4.
    for (key, wait) in [("8", 1), ("w", 8), ("l", 8), ("t", 15)] {
        ask(&format!("sendkey alt-sysrq-{key}"), Duration::from_secs(wait));
    }
    let _ = std::fs::write(log, &said);
}

/// A guest kernel panic with no BPF program on its stack and no task of the agent's on a CPU: a
/// fault of the kernel or of the emulator, not of valet's. QEMU's TCG has double-faulted a
/// Debian kernel in its slab allocator's `cmpxchg16b`, and has left a CPU of a node stuck in the
/// kernel (`runc`, a soft lockup, with an RCU stall on the other CPU) for 40 minutes; with
/// `softlockup_panic` and `panic_on_rcu_stall` such a hang is a panic too, and its report (the
/// kernel's whole log replayed, `panic_print`) has every CPU's backtrace. Returns its summary for
/// the log: the oops line, the faulting function and the task. `None` when the guest did not
/// panic, or when the report names valet ([`names_valet_in`]): that is valet's, and never rerun.
pub(crate) fn foreign_panic(lines: &[String]) -> Option<String> {
    let end = lines.iter().position(|l| l.contains("Kernel panic - not syncing"))?;
    let start = lines[..end]
        .iter()
        .position(|l| {
            l.contains("Oops:")
                || l.contains("BUG:")
                || l.contains("traps: PANIC")
                || l.contains("------------[ cut here ]")
                || l.contains("detected stall")
        })
        .unwrap_or(end);
    // A panic() of its own prints its stack after its line, up to "---[ end Kernel panic".
    let last = lines[end..].iter().position(|l| l.contains("end Kernel panic")).map_or(lines.len() - 1, |i| end + i);
    let report = &lines[start.saturating_sub(1)..=last];
    if names_valet_in(report) {
        return None;
    }
    let strip = |l: &String| unstamped(l).trim_end().to_string();
    let pick = |key: &str| report.iter().find(|l| l.contains(key)).map(strip);
    let parts: Vec<String> = [
        pick("Oops:").or_else(|| pick("BUG:")).or_else(|| pick("detected stall")),
        report
            .iter()
            .find(|l| on_text_patch(l))
            .or_else(|| report.iter().find(|l| l.contains("RIP: 0010:")))
            .map(strip),
        pick("Comm:"),
        Some(strip(&lines[end])),
    ]
    .into_iter()
    .flatten()
    .collect();
    Some(parts.join(" | "))
}

/// A panic ([`foreign_panic`]) or a hang ([`Killed::foreign_hang`]) not of valet's: its summary.
pub(crate) fn foreign_fault(lines: &[String], killed: Option<&Killed>) -> Option<String> {
    match killed {
        Some(killed) => killed.foreign_hang(lines),
        None => foreign_panic(lines),
    }
}

/// Why a guest's scenarios or tests did not finish: it was killed (why), its kernel panicked
/// (valet's when `foreign` is `None`: no rerun), or it stopped.
pub(crate) fn stopped_why(lines: &[String], killed: Option<&Killed>, foreign: Option<&str>) -> String {
    let panic = lines.iter().find(|l| l.contains("Kernel panic - not syncing")).map(|l| unstamped(l).trim_end());
    match (killed, panic, foreign) {
        (Some(k), _, _) => k.to_string(),
        (None, Some(p), None) => format!("its kernel panicked with valet on its stacks, so not rerun ({p})"),
        (None, Some(p), Some(_)) => format!("its kernel panicked, not rerun: its second boot, or none left ({p})"),
        (None, None, _) => "it stopped".into(),
    }
}

/// A kernel console line without its timestamp (`[  164.589105] `) and leading blanks.
fn unstamped(line: &str) -> &str {
    line.split_once("] ").map_or(line, |(_, rest)| rest).trim_start()
}

/// Whether a panic's report or a hung guest's dump names valet: a BPF frame ([`names_bpf`]), or
/// a task of the agent's on a CPU ([`names_agent_task`]). The task does not when another CPU is
/// trapped on a kernel text patch's `int3` ([`on_text_patch`]): a tracepoint switched on or off
/// (the agent attaching or detaching its programs, at its start or its exit) rewrites a jump
/// label with `int3` and IPIs, and under TCG a CPU has been seen looping on that `int3` while the
/// other waited for it: an RCU stall with the agent's threads on both CPUs, in `do_exit` at the
/// tracepoint's site (2026-12-06, the bookworm v1 node cell, at an agent's exit). That is the
/// emulator's cross-modified code, not valet's; a BPF frame still names valet. The replayed log's
/// other lines (a unit's `valet-node-run[223]`, "eBPF" in a boot message) name nothing.
fn names_valet_in(report: &[String]) -> bool {
    let any = |f: fn(&str) -> bool| report.iter().any(|l| f(l));
    any(names_bpf) || (any(names_agent_task) && !any(on_text_patch))
}

/// A CPU stopped at a kernel text patch's breakpoint: `RIP: 0010:asm_exc_int3+0x0/0x40`, or in
/// the handler that steps a patched site (`poke_int3_handler`; `smp_text_poke_int3_handler` since
/// 6.16).
fn on_text_patch(line: &str) -> bool {
    line.split_once("RIP: 0010:").is_some_and(|(_, at)| {
        ["asm_exc_int3+", "exc_int3+", "poke_int3_handler+", "smp_text_poke_int3_handler+"]
            .iter()
            .any(|f| at.starts_with(f))
    })
}

/// A BPF program or helper in a stack or at the faulting instruction
/// (`bpf_prog_6deef7357e7b4530_on_exit+0x52/0x9a`, `RIP: 0010:bpf_prog_...`,
/// `bpf_ringbuf_reserve+0x1c/0x60`).
fn names_bpf(line: &str) -> bool {
    // A frame, reliable (a `?` one is a stale word on the stack: `? __bpf_trace_tick_stop+0x10`
    // is in most tasks' stacks), or the faulting instruction.
    let frame = unstamped(line);
    let bpf_frame = frame.split_whitespace().next().is_some_and(|w| w.starts_with("bpf_") && w.contains("+0x"));
    bpf_frame || line.contains(":bpf_")
}

/// A task of the agent's on a CPU: its threads are all named `valet-*` (`Comm: valet-events`, a
/// soft lockup's `[valet-agent:812]`).
fn names_agent_task(line: &str) -> bool {
    line.contains("Comm: valet") || line.contains("[valet")
}

/// Console lines worth echoing: test names and results, panics (cut to 400 characters: a
/// verifier log is long; the whole of it is in the console log), the guest's own markers.
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

    /// A console kept in `xtask/testdata/`, by line.
    fn fixture(name: &str) -> Vec<String> {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata").join(name);
        std::fs::read_to_string(&path).expect("read the fixture").lines().map(String::from).collect()
    }

    #[test]
    fn foreign_panic_and_ours() {
        let lines = fixture("tcg-double-fault.log");
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
        // A soft lockup made a panic: every CPU's backtrace in the replayed log, none of them
        // valet's (the log's `valet-node-run[223]` is the guest's unit, not the agent).
        let lockup: Vec<String> = [
            "node [  116.848] kubelet: container istio-proxy 59e1339d588e (attempt 0) created and started in 0.856s",
            "[  139.333500] rcu: INFO: rcu_preempt detected stalls on CPUs/tasks:",
            "[  139.333500] rcu: \t1-...!: (1 GPs behind) idle=f074/1/0x4000000000000000 softirq=16880/16881 fqs=0",
            "[  164.589105] watchdog: BUG: soft lockup - CPU#0 stuck for 45s! [runc:2182]",
            "[  164.589105] Kernel panic - not syncing: softlockup: hung tasks",
            "[   10.334808] valet-node-run[223]: VALET-NODE-READY 10.32",
            "[  164.589105] CPU: 0 PID: 2182 Comm: runc Tainted: G             L     6.1.0-50-amd64 #1  Debian 6.1.176-1",
            "[  164.589105] RIP: 0010:smp_call_function_many_cond+0x13e/0x3a0",
            "[  164.589105]  flush_tlb_mm_range+0x11b/0x170",
            "[  164.589105] NMI backtrace for cpu 1",
            "[  164.589105] CPU: 1 PID: 0 Comm: swapper/1 Tainted: G             L     6.1.0-50-amd64 #1  Debian 6.1.176-1",
            "[  164.589105] ---[ end Kernel panic - not syncing: softlockup: hung tasks ]---",
        ]
        .map(String::from)
        .to_vec();
        let summary = foreign_panic(&lockup).expect("a lockup of no task of valet's");
        assert!(summary.starts_with("watchdog: BUG: soft lockup - CPU#0 stuck for 45s! [runc:2182]"), "{summary}");
        assert!(summary.contains("RIP: 0010:smp_call_function_many_cond"), "{summary}");
        assert!(summary.ends_with("Kernel panic - not syncing: softlockup: hung tasks"), "{summary}");
        // An RCU stall made a panic (`panic_on_rcu_stall`) before any lockup: the stall's report.
        let mut stall = lockup.clone();
        stall.remove(3);
        stall[3] = "[  139.333500] Kernel panic - not syncing: RCU Stall".into();
        let summary = foreign_panic(&stall).expect("a stall of no task of valet's");
        assert!(summary.starts_with("rcu: INFO: rcu_preempt detected stalls"), "{summary}");
        assert!(summary.ends_with("Kernel panic - not syncing: RCU Stall"), "{summary}");
        // The agent's thread on the other CPU, or stuck itself, or a BPF helper on a stack: valet's.
        for (at, line) in [
            (10, "[  164.589105] CPU: 1 PID: 812 Comm: valet-events Tainted: G             L     6.1.0-50-amd64 #1"),
            (3, "[  164.589105] watchdog: BUG: soft lockup - CPU#0 stuck for 45s! [valet-agent:812]"),
            (8, "[  164.589105]  bpf_ringbuf_reserve+0x1c/0x60"),
        ] {
            let mut ours = lockup.clone();
            ours[at] = line.into();
            assert_eq!(foreign_panic(&ours), None, "{line}");
        }
        // No panic: the scenarios' own lines only.
        assert_eq!(foreign_panic(&lines[..lines.iter().position(|l| l.contains("traps:")).expect("its trap")]), None);
    }

    #[test]
    fn a_stall_on_a_patched_tracepoint_is_the_emulators_even_with_the_agent_on_its_cpus() {
        // 2026-12-06, the bookworm v1 node cell (6.1): the agent exiting, its threads in `do_exit`
        // on both CPUs at the exit tracepoint's jump label, CPU 1 on the patch's `int3`; the RCU
        // stall a panic (`panic_on_rcu_stall`), the NMI backtraces only in the replayed log.
        let lines = fixture("tcg-int3-rcu-stall.log");
        let summary = foreign_panic(&lines).expect("a stall on a text patch's int3");
        assert!(summary.starts_with("rcu: INFO: rcu_preempt self-detected stall on CPU"), "{summary}");
        assert!(summary.contains("RIP: 0010:asm_exc_int3+0x0/0x40"), "{summary}");
        assert!(summary.contains("Comm: valet-worker"), "{summary}");
        // Without the CPU on the int3, the agent's threads on the CPUs are valet's.
        let no_patch: Vec<String> = lines.iter().filter(|l| !l.contains("asm_exc_int3")).cloned().collect();
        assert_eq!(foreign_panic(&no_patch), None);
        // With a BPF program on a stack, valet's whatever the int3.
        let mut in_bpf = lines.clone();
        let at = in_bpf.iter().position(|l| l.contains("do_group_exit+0x2d")).expect("a stack");
        in_bpf.insert(at, "[  192.525789]  bpf_prog_6deef7357e7b4530_on_exit+0x52/0x9a".into());
        assert_eq!(foreign_panic(&in_bpf), None);
        // A hung guest's SysRq dump, the same way.
        let mut dump = vec!["[  900.000000] sysrq: Show backtrace of all active CPUs".to_string()];
        dump.extend(lines.iter().filter(|l| l.contains("Comm:") || l.contains("RIP: 0010:")).cloned());
        let silent = Killed { why: "silent".into(), silent: true, dump_from: 0 };
        assert!(silent.foreign_hang(&dump).is_some_and(|s| s.contains("asm_exc_int3")));
        dump.retain(|l| !l.contains("asm_exc_int3"));
        assert_eq!(silent.foreign_hang(&dump), None);
        // What the cell's summary says when it is not rerun.
        assert_eq!(
            stopped_why(&in_bpf, None, foreign_panic(&in_bpf).as_deref()),
            "its kernel panicked with valet on its stacks, so not rerun (Kernel panic - not syncing: RCU Stall)"
        );
        assert!(stopped_why(&lines, None, Some("x")).starts_with("its kernel panicked, not rerun"));
        assert_eq!(stopped_why(&lines[..2], None, None), "it stopped");
        assert!(on_text_patch("[  1.0] RIP: 0010:smp_text_poke_int3_handler+0x5/0x90"));
        assert!(!on_text_patch("[  1.0] RIP: 0033:asm_exc_int3+0x0/0x40"), "user space");
        assert!(!on_text_patch("[  1.0]  asm_exc_int3+0x39/0x40"), "a frame, not where a CPU is");
    }

    #[test]
    fn a_silent_guests_dump_names_valet_or_not() {
        // A guest gone silent: its SysRq dump names valet or not; killed at the deadline, no rerun.
        let silent = |dump_from| Killed { why: "silent".into(), silent: true, dump_from };
        let mut hung: Vec<String> = [
            "node [   42.002] containerd restarted with the cgroupfs cgroup driver in 1.5s",
            "[  644.100000] sysrq: Show backtrace of all active CPUs",
            "[  644.100000] NMI backtrace for cpu 0",
            "[  644.100000] CPU: 0 PID: 0 Comm: swapper/0 Not tainted 6.1.0-50-amd64 #1  Debian 6.1.176-1",
            "[  644.100000] RIP: 0010:default_idle+0xb/0x20",
            "[  644.100000]  ? __bpf_trace_tick_stop+0x10/0x10",
            "[  644.200000] sysrq: Show State",
            "[  644.200000] task:valet-events    state:S stack:0     pid:812   ppid:390    flags:0x00000002",
            "[  644.200000]  ? bpf_prog_790dc5bf24aa4daa_valet_listen+0xae/0x8ab",
            "[  644.200000]  bpf_ringbuf_reserve+0x1c/0x60",
        ]
        .map(String::from)
        .to_vec();
        let summary = silent(1).foreign_hang(&hung).expect("a hang of nothing of valet's");
        assert_eq!(
            summary,
            "silent; on its CPUs: CPU: 0 PID: 0 Comm: swapper/0 Not tainted 6.1.0-50-amd64 #1  \
                             Debian 6.1.176-1 | RIP: 0010:default_idle+0xb/0x20"
        );
        assert_eq!(silent(hung.len()).foreign_hang(&hung).as_deref(), Some("silent; SysRq printed nothing"));
        assert!(Killed { why: "late".into(), silent: false, dump_from: 1 }.foreign_hang(&hung).is_none());
        // A BPF program on a CPU (a reliable frame, not the stale `? __bpf_trace_...`), or the
        // agent's thread: valet's.
        let mut in_bpf = hung.clone();
        in_bpf[5] = "[  644.100000]  bpf_prog_790dc5bf24aa4daa_valet_listen+0xae/0x8ab".into();
        assert_eq!(silent(1).foreign_hang(&in_bpf), None);
        hung[3] = "[  644.100000] CPU: 0 PID: 812 Comm: valet-events Not tainted 6.1.0-50-amd64 #1".into();
        assert_eq!(silent(1).foreign_hang(&hung), None);
        // Before the dump, a line naming valet (the scenarios' own) does not count.
        assert!(silent(4).foreign_hang(&hung).is_some());
    }
}
