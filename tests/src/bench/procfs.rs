use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};

/// The agent's memory and CPU, to size the DaemonSet's requests and limits from measurement.
pub(crate) fn print_resources(pid: u32, wall: Duration, pods: usize) {
    let field = |name: &str| status_field(pid, name).unwrap_or_default();
    let cpu = cpu_time(pid).as_secs_f64();
    println!(
        "  agent resources over {:.0} s and {pods} pods: RSS {} (peak {}), CPU {:.2} s = {:.1} millicores on average",
        wall.as_secs_f64(),
        field("VmRSS:"),
        field("VmHWM:"),
        cpu,
        cpu / wall.as_secs_f64() * 1000.0
    );
}

/// CPU time (user + system) of a process so far.
pub(crate) fn cpu_time(pid: u32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // utime and stime are fields 14 and 15 of stat.
    let field = |n| valet_agent::host::proc::stat_field(&stat, n).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
    let hz = valet_agent::host::sys::clock_ticks().unwrap_or(100) as f64;
    Duration::from_secs_f64((field(14) + field(15)) as f64 / hz)
}

/// The CPU share (of one core) process `pid` used over `window`, from each thread's
/// `schedstat` (ns on a CPU), read every 50 ms so threads that come and go in the window count
/// too: precise where `/proc/<pid>/stat`'s clock ticks are 10 ms.
pub(crate) fn cpu_share(pid: u32, window: Duration) -> f64 {
    let read = || -> Vec<(u32, u64)> {
        let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return Vec::new() };
        dir.flatten()
            .filter_map(|t| {
                let tid = t.file_name().to_str()?.parse().ok()?;
                Some((tid, task_cpu_ns(pid, tid)?))
            })
            .collect()
    };
    let mut threads: std::collections::HashMap<u32, (u64, u64)> =
        read().into_iter().map(|(t, v)| (t, (v, v))).collect();
    let started = Instant::now();
    while started.elapsed() < window {
        std::thread::sleep(Duration::from_millis(50));
        for (tid, v) in read() {
            // A thread born in the window counts from zero.
            threads.entry(tid).or_insert((0, v)).1 = v;
        }
    }
    let ns: u64 = threads.values().map(|(first, last)| last.saturating_sub(*first)).sum();
    // VALET_BENCH_THREADS=1: where the time went, by thread name.
    if std::env::var_os("VALET_BENCH_THREADS").is_some() {
        let mut by_name: std::collections::BTreeMap<String, u64> = std::collections::BTreeMap::new();
        for (tid, (first, last)) in &threads {
            let comm =
                std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/comm")).unwrap_or_else(|_| "(gone)".into());
            *by_name.entry(comm.trim().to_owned()).or_default() += last.saturating_sub(*first);
        }
        let secs = started.elapsed().as_secs_f64();
        let words: Vec<String> =
            by_name.iter().map(|(n, v)| format!("{n} {:.2} %", *v as f64 / 1e9 / secs * 100.0)).collect();
        println!("  threads: {}", words.join(", "));
    }
    ns as f64 / 1e9 / started.elapsed().as_secs_f64()
}

/// A task's CPU time so far (ns, the first field of its `schedstat`).
pub(crate) fn task_cpu_ns(pid: u32, tid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/schedstat")).ok()?;
    stat.split_whitespace().next()?.parse().ok()
}

/// The CPU time (ns) of the threads of `pid` named `name`, summed.
pub(crate) fn thread_cpu_ns(pid: u32, name: &str) -> u64 {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return 0 };
    dir.flatten()
        .filter_map(|t| t.file_name().to_str()?.parse::<u32>().ok())
        .filter(|tid| std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/comm")).is_ok_and(|c| c.trim() == name))
        .filter_map(|tid| task_cpu_ns(pid, tid))
        .sum()
}

/// One field of `/proc/<pid>/status` (`name` with its colon), trimmed.
pub(crate) fn status_field(pid: u32, name: &str) -> Option<String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status.lines().find_map(|l| l.strip_prefix(name)).map(|v| v.trim().to_owned())
}

/// Resident set size of a process, in KiB.
pub(crate) fn rss_kib(pid: u32) -> u64 {
    status_field(pid, "VmRSS:").and_then(|v| v.split_whitespace().next()?.parse().ok()).unwrap_or(0)
}

/// What a process's resident set is made of (KiB): anonymous memory (the heap, stacks), file
/// pages (the binary's text and data, libraries) and shared memory, from `/proc/<pid>/status`.
pub(crate) fn rss_parts(pid: u32) -> String {
    let kib = |f: &str| status_field(pid, f).and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok());
    match (kib("RssAnon:"), kib("RssFile:"), kib("RssShmem:")) {
        (Some(a), Some(f), Some(s)) => format!("anonymous {a} KiB, file {f} KiB, shared {s} KiB"),
        _ => "its parts unread".to_owned(),
    }
}

/// Peak resident set size of a process since its start (`VmHWM`), in KiB.
pub(crate) fn peak_rss_kib(pid: u32) -> u64 {
    status_field(pid, "VmHWM:").and_then(|v| v.split_whitespace().next()?.parse().ok()).unwrap_or(0)
}

/// `max_entries` of the BPF map named `name` that process `pid` holds open (a ring buffer's
/// size in bytes).
pub(crate) fn map_max_entries(pid: u32, name: &str) -> Option<u32> {
    let dir = std::fs::read_dir(format!("/proc/{pid}/fdinfo")).ok()?;
    dir.flatten()
        .filter_map(|e| std::fs::read_to_string(e.path()).ok())
        .filter_map(|info| info.lines().find_map(|l| l.strip_prefix("map_id:")?.trim().parse().ok()))
        .filter_map(|id| aya::maps::MapInfo::from_id(id).ok())
        .find(|info| info.name_as_str() == Some(name))
        .map(|info| info.max_entries())
}

/// Open file descriptors of a process.
pub(crate) fn open_fds(pid: u32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd")).map(|d| d.count()).unwrap_or(0)
}

/// Entries in the hash maps a process holds open (found through its fds' `map_id`), by map name.
pub(crate) fn map_entries(pid: u32) -> std::collections::BTreeMap<String, usize> {
    use std::os::fd::{AsFd as _, AsRawFd as _};
    let mut out = std::collections::BTreeMap::new();
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fdinfo")) else { return out };
    let mut ids: Vec<u32> = dir
        .flatten()
        .filter_map(|e| std::fs::read_to_string(e.path()).ok())
        .filter_map(|info| info.lines().find_map(|l| l.strip_prefix("map_id:")?.trim().parse().ok()))
        .collect();
    ids.sort_unstable();
    ids.dedup();
    for id in ids {
        let Ok(info) = aya::maps::MapInfo::from_id(id) else { continue };
        if !matches!(info.map_type(), Ok(aya::maps::MapType::Hash | aya::maps::MapType::LruHash)) {
            continue;
        }
        let (Ok(fd), Some(name)) = (info.fd(), info.name_as_str().map(str::to_owned)) else { continue };
        let mut key = vec![0u8; info.key_size() as usize];
        let mut next = vec![0u8; info.key_size() as usize];
        let mut n = 0usize;
        let mut first = true;
        loop {
            // BPF_MAP_GET_NEXT_KEY: union bpf_attr { u32 map_fd; u64 key; u64 next_key; ... }.
            let mut attr = [0u64; 4];
            attr[0] = fd.as_fd().as_raw_fd() as u64;
            attr[1] = if first { 0 } else { key.as_ptr() as u64 };
            attr[2] = next.as_mut_ptr() as u64;
            // SAFETY: attr is a valid bpf_attr prefix for this command; key and next are key_size long.
            let r = unsafe { libc::syscall(libc::SYS_bpf, 4, attr.as_ptr(), std::mem::size_of_val(&attr)) };
            if r != 0 || n > 1_000_000 {
                break;
            }
            n += 1;
            first = false;
            key.copy_from_slice(&next);
        }
        *out.entry(name).or_insert(0) += n;
    }
    out
}

pub(crate) fn entries_text(entries: &std::collections::BTreeMap<String, usize>) -> String {
    entries.iter().map(|(k, v)| format!("{k} {v}")).collect::<Vec<_>>().join(", ")
}

/// When each SIGCONT was sent, from the kernel's `signal:signal_generate` tracepoint in a tracefs
/// instance of the bench's own (CLOCK_MONOTONIC): the release itself, before the released app
/// gets a CPU.
pub(crate) struct SignalTrace {
    pub(crate) dir: std::path::PathBuf,
}

impl SignalTrace {
    pub(crate) fn start() -> Result<SignalTrace> {
        let root = ["/sys/kernel/tracing", "/sys/kernel/debug/tracing"]
            .into_iter()
            .map(Path::new)
            .find(|p| p.join("instances").is_dir())
            .context("no tracefs (cargo xtask setup mounts it)")?;
        let dir = root.join("instances").join(format!("valet-bench-{}", std::process::id()));
        std::fs::create_dir(&dir).with_context(|| format!("mkdir {}", dir.display()))?;
        let trace = SignalTrace { dir };
        let event = trace.dir.join("events/signal/signal_generate");
        std::fs::write(trace.dir.join("trace_clock"), "mono").context("trace_clock mono")?;
        std::fs::write(event.join("filter"), format!("sig == {}", libc::SIGCONT)).context("event filter")?;
        std::fs::write(event.join("enable"), "1").context("enable signal_generate")?;
        Ok(trace)
    }

    /// The first SIGCONT sent to each pid since the last call (the buffer is cleared).
    pub(crate) fn sent(&self) -> std::collections::HashMap<u32, u64> {
        let text = std::fs::read_to_string(self.dir.join("trace")).unwrap_or_default();
        let _ = std::fs::write(self.dir.join("trace"), "");
        let mut sent = std::collections::HashMap::new();
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            // "<comm>-<tid> [001] d..2. 42197.312565: signal_generate: sig=18 ... pid=16835 grp=1 res=1"
            let Some((head, rest)) = line.split_once(": signal_generate:") else { continue };
            let at = head.rsplit(' ').next().and_then(|t| {
                let (s, us) = t.split_once('.')?;
                Some(s.parse::<u64>().ok()? * 1_000_000_000 + us.parse::<u64>().ok()? * 1_000)
            });
            let pid = rest.split_whitespace().find_map(|f| f.strip_prefix("pid=")?.parse::<u32>().ok());
            if let (Some(at), Some(pid)) = (at, pid) {
                sent.entry(pid).or_insert(at);
            }
        }
        sent
    }
}

impl Drop for SignalTrace {
    fn drop(&mut self) {
        let _ = std::fs::write(self.dir.join("events/signal/signal_generate/enable"), "0");
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// A task's scheduling policy and niceness, from `/proc/<pid>/stat` (fields 41 and 19).
pub(crate) fn policy_nice(pid: u32) -> Option<(i64, i64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    // `rest[0]` is field 3 (the state).
    Some((rest.get(38)?.parse().ok()?, rest.get(16)?.parse().ok()?))
}

/// Per thread name of process `pid`: CPU time and time waiting on a run queue (ns), the times
/// it ran, and the policy of the last thread of that name seen (0 normal, 1 FIFO).
pub(crate) type Waits = std::collections::BTreeMap<String, (u64, u64, u64, i64)>;

pub(crate) fn thread_waits(pid: u32) -> Waits {
    let mut out = Waits::new();
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return out };
    for task in tasks.flatten() {
        let dir = task.path();
        let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default().trim().to_owned();
        let sched = std::fs::read_to_string(dir.join("schedstat")).unwrap_or_default();
        let mut f = sched.split_whitespace().map(|v| v.parse::<u64>().unwrap_or(0));
        let (cpu, wait, runs) = (f.next().unwrap_or(0), f.next().unwrap_or(0), f.next().unwrap_or(0));
        let tid = dir.file_name().and_then(|n| n.to_str()?.parse().ok()).unwrap_or(0);
        let policy = policy_nice(tid).map_or(-1, |(p, _)| p);
        let e = out.entry(comm).or_default();
        e.0 += cpu;
        e.1 += wait;
        e.2 += runs;
        e.3 = policy;
    }
    out
}

/// The machine's CPU time so far, from the first line of `/proc/stat` (in clock ticks): the
/// time every CPU spent, and of it the steal (time a hypervisor ran something else while this
/// machine's virtual CPU had work: the other guests of a shared host).
#[derive(Clone, Copy, Default)]
pub(crate) struct MachineCpu {
    total: u64,
    steal: u64,
}

impl MachineCpu {
    pub(crate) fn now() -> MachineCpu {
        std::fs::read_to_string("/proc/stat").ok().and_then(|s| MachineCpu::parse(&s)).unwrap_or_default()
    }

    /// `cpu  user nice system idle iowait irq softirq steal guest guest_nice`: guest time is
    /// already in user and nice.
    fn parse(stat: &str) -> Option<MachineCpu> {
        let line = stat.lines().next()?.strip_prefix("cpu ")?;
        let fields: Vec<u64> = line.split_whitespace().map(|f| f.parse().ok()).collect::<Option<_>>()?;
        let steal = *fields.get(7)?;
        Some(MachineCpu { total: fields.iter().take(8).sum(), steal })
    }

    /// The steal's share of the CPUs' time since `self` (0 to 1), or None when nothing was read.
    pub(crate) fn steal_since(self, later: MachineCpu) -> Option<f64> {
        let total = later.total.checked_sub(self.total).filter(|t| *t > 0)?;
        Some(later.steal.saturating_sub(self.steal) as f64 / total as f64)
    }
}

/// The steal since `since` as words for a section's or a run's line.
pub(crate) fn steal_words(since: MachineCpu) -> String {
    match since.steal_since(MachineCpu::now()) {
        Some(share) => format!("steal {:.1} % of the CPUs' time", share * 100.0),
        None => "steal not read".to_owned(),
    }
}

#[cfg(test)]
mod machine_cpu_tests {
    use super::MachineCpu;

    #[test]
    fn steal_is_its_share_of_every_cpus_time() {
        let before = MachineCpu::parse("cpu  100 0 50 800 10 0 5 35 0 0\ncpu0 1 2 3\n").expect("parsed");
        let after = MachineCpu::parse("cpu  200 0 100 1500 10 0 10 85 7 0\n").expect("parsed");
        // 1000 → 1905 ticks (the guest's 7 already in user), 50 of the 905 stolen.
        let share = before.steal_since(after).expect("a share");
        assert!((share - 50.0 / 905.0).abs() < 1e-9, "{share}");
        assert_eq!(before.steal_since(before), None, "no time passed");
        assert!(MachineCpu::parse("cpu0 1 2 3 4 5 6 7 8\n").is_none(), "only the machine's line");
        assert!(MachineCpu::parse("cpu  1 2 3\n").is_none(), "no steal field");
    }
}
