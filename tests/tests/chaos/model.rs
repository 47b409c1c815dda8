use super::*;

pub(crate) const HOLD: &str = "valet.dev/hold-app";
pub(crate) const LABEL: &str = "valet.dev/enabled";
pub(crate) const CONDITION: &str = "valet.dev/ProxyReady";

/// Kinds of special disruption, one every `VALET_CHAOS_SPECIAL_EVERY` turns in turn: an
/// outage, a crash loop, an uninstall, an upgrade, a full record map.
pub(crate) const SPECIALS: usize = 5;
/// The pass criteria, counted per restart from the new agent's `/readyz` 200.
pub(crate) const RUN_WITHIN: Duration = Duration::from_secs(2);
pub(crate) const QUIT_WITHIN: Duration = Duration::from_secs(1);
/// How long the agent may take to settle a condition before it counts as left false: a hang
/// guard, far above the agent's 100 ms probe interval and its 10 s write bound.
pub(crate) const SETTLE: Duration = Duration::from_secs(15);
/// Hang guard for the things the test itself waits for (a late quit is still waited for, to
/// print how late it was).
pub(crate) const GUARD: Duration = Duration::from_secs(10);
/// Pods alive at a time: enough to have every kind of pod in flight at each kill, few enough
/// that the test does not starve the agent on a loaded 2-core machine.
pub(crate) const POPULATION: (usize, usize) = (4, 8);
/// A pod is retired after this many restarts whatever its state, so the population rolls.
pub(crate) const MAX_AGE: usize = 10;
/// Hold timeouts, in seconds: short, so deadlines fall during outages and crash loops.
pub(crate) const HOLD_TIMEOUTS: (u64, u64) = (3, 8);
/// How late past its deadline an app may run.
pub(crate) const DEADLINE_WITHIN: Duration = Duration::from_secs(2);
/// The API outage a restart meets.
pub(crate) const OUTAGE: Duration = Duration::from_secs(30);
/// A marker's time comes from the coarse clock file systems stamp with (up to a tick behind).
pub(crate) const STAMP_SLACK_NS: u64 = 10_000_000;

/// A small seeded generator (SplitMix64): one seed replays a run's choices.
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next() % n }
    }
    pub(crate) fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
    pub(crate) fn millis(&mut self, max: u64) -> Duration {
        Duration::from_millis(self.below(max + 1))
    }
}

/// Whether the process' cgroup is frozen (cgroup v2 `cgroup.events`).
pub(crate) fn frozen(cgroup_root: &Path, pid: u32) -> bool {
    let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/cgroup")) else { return false };
    let Some(rel) = text.lines().find_map(|l| l.strip_prefix("0::")) else { return false };
    let events = cgroup_root.join(rel.trim_start_matches('/')).join("cgroup.events");
    std::fs::read_to_string(events).is_ok_and(|e| e.lines().any(|l| l == "frozen 1"))
}

/// Stopped or frozen: not running though alive. A process that is gone is not held.
pub(crate) fn stuck(cgroup_root: &Path, pid: u32) -> bool {
    match state(pid) {
        None | Some('Z') => false,
        Some('T' | 't') => true,
        Some(_) => frozen(cgroup_root, pid),
    }
}

/// The kernel's record of a held process, from the pinned map.
pub(crate) fn record(pin_dir: &Path, pid: u32) -> Option<HeldRecord> {
    use aya::maps::{HashMap, Map, MapData};
    let data = MapData::from_pin(pin_dir.join(PIN_HELD)).ok()?;
    let map: HashMap<MapData, u32, HeldRecord> = HashMap::try_from(Map::HashMap(data)).ok()?;
    map.get(&pid, 0).ok()
}

/// The stop time of the record of `pid` in any pin an agent reads: this version's, or the
/// previous version's (`held_v1`) in the pin directories the upgrades left.
pub(crate) fn recorded_stop(pin_dir: &Path, old_dirs: &[PathBuf], pid: u32) -> Option<u64> {
    use aya::maps::{HashMap, Map, MapData};
    if let Some(r) = record(pin_dir, pid) {
        return Some(r.ktime_ns);
    }
    old_dirs.iter().find_map(|dir| {
        let data = MapData::from_pin(dir.join(PIN_HELD_V1)).ok()?;
        let map: HashMap<MapData, u32, HeldRecordV1> = HashMap::try_from(Map::HashMap(data)).ok()?;
        map.get(&pid, 0).ok().map(|r| r.ktime_ns)
    })
}

/// CLOCK_REALTIME minus CLOCK_MONOTONIC: turns a file's time stamp into the monotonic clock.
pub(crate) fn realtime_offset_ns() -> i128 {
    let real = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as i128);
    real - i128::from(monotonic_ns())
}

/// When a marker file was written, on the monotonic clock.
pub(crate) fn written_ns(path: &Path, offset: i128) -> Option<u64> {
    use std::os::unix::fs::MetadataExt as _;
    let m = std::fs::metadata(path).ok()?;
    let real = i128::from(m.mtime()) * 1_000_000_000 + i128::from(m.mtime_nsec());
    u64::try_from(real - offset).ok()
}

/// Whether an agent has placed the pod: written its condition, or probed its proxy and found it
/// not ready (no condition says that before the first True; its log does). Every agent's log is
/// read (`agent-*.log` in the node's scratch): a predecessor's placing holds, as its condition did.
pub(crate) fn placed(node: &Node, job: &JobPod) -> bool {
    let pod = format!("jobs/{}", job.name);
    let logs = std::fs::read_dir(&node.scratch.0).into_iter().flatten().flatten().filter(|e| {
        let name = e.file_name().to_string_lossy().into_owned();
        name.starts_with("agent-") && name.ends_with(".log")
    });
    condition(node, job).is_some()
        || logs
            .into_iter()
            .any(|e| says_about(&std::fs::read_to_string(e.path()).unwrap_or_default(), "proxy not ready", &pod))
}

/// The agent's `valet.dev/ProxyReady` condition status on the pod.
pub(crate) fn condition(node: &Node, job: &JobPod) -> Option<String> {
    let pod = node.pod(job)?;
    pod["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == CONDITION)
        .map(|c| c["status"].as_str().unwrap_or_default().to_owned())
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Pidns {
    /// The app is pid 1 of its container's own pid namespace.
    Own,
    /// shareProcessNamespace: the app joins the sandbox's namespace (pid N, the pause is pid 1).
    Shared,
}

/// What happens to a pod while the agent is down; one kind per kill in turn, so a short run
/// covers every kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Disruption {
    Deleted,
    Unlabelled,
    Unannotated,
    ProxyReady,
    AppEnded,
}

pub(crate) const DISRUPTIONS: [Disruption; 5] = [
    Disruption::Deleted,
    Disruption::Unlabelled,
    Disruption::Unannotated,
    Disruption::ProxyReady,
    Disruption::AppEnded,
];

/// One Job pod of the population and what the test did to it.
pub(crate) struct Pod {
    pub(crate) job: JobPod,
    pub(crate) pidns: Pidns,
    pub(crate) ready_file: PathBuf,
    /// Written by the app the moment it runs.
    pub(crate) ran: PathBuf,
    /// A FIFO the app reads before it exits: the test decides when the app ends.
    pub(crate) end: PathBuf,
    /// The app's first process (the one the kernel holds at exec).
    pub(crate) app: Option<u32>,
    pub(crate) ready: bool,
    /// CLOCK_MONOTONIC just before the test let the app end: the end came after it.
    pub(crate) ended_ns: Option<u64>,
    pub(crate) labelled: bool,
    pub(crate) hold: bool,
    pub(crate) deleted: bool,
    /// Restarts survived.
    pub(crate) age: usize,
    /// A violation was counted for it: it is retired, and not counted twice.
    pub(crate) failed: bool,
    /// Its `valet.dev/hold-timeout`.
    pub(crate) timeout: Duration,
    /// CLOCK_MONOTONIC just before the app started (its hold began after it).
    pub(crate) started_ns: Option<u64>,
    /// Its hold's deadline: the kernel's stop time in its record, once read, plus its own hold
    /// timeout (not the deadline the record carries: a deadline written wrong is what is judged).
    pub(crate) deadline_ns: Option<u64>,
    /// The earliest moment a release was allowed before the deadline: its proxy turned ready,
    /// or its pod stopped holding it (deleted, relabelled, stripped of its hold).
    pub(crate) allowed_ns: Option<u64>,
    /// Its app's release was judged (early or not).
    pub(crate) release_judged: bool,
    /// Counted as left stopped past its deadline.
    pub(crate) late_counted: bool,
    /// Counted as stopped with its record gone.
    pub(crate) lost_counted: bool,
    /// Its app's cgroup was made unreadable by a read fault.
    pub(crate) read_faulted: bool,
}

impl Pod {
    pub(crate) fn name(&self) -> &str {
        &self.job.name
    }
    /// The app runs, or may: its proxy is ready, or the pod is no longer held, labelled or there.
    pub(crate) fn must_run(&self) -> Option<&'static str> {
        self.app?;
        if self.deleted {
            Some("pod deleted")
        } else if !self.labelled {
            Some("label removed")
        } else if !self.hold {
            Some("hold annotation removed")
        } else if self.ready {
            Some("proxy ready")
        } else {
            None
        }
    }
    /// Whether `kind` can still happen to it (a pod the agent no longer sees is left alone).
    pub(crate) fn can(&self, kind: Disruption) -> bool {
        !self.deleted
            && self.labelled
            && match kind {
                Disruption::ProxyReady => !self.ready,
                Disruption::AppEnded => self.ended_ns.is_none() && self.app_ran(),
                Disruption::Unannotated => self.hold,
                Disruption::Deleted | Disruption::Unlabelled => true,
            }
    }
    pub(crate) fn app_ran(&self) -> bool {
        self.ran.exists()
    }
    pub(crate) fn proxy_alive(&self) -> bool {
        self.job.proxy.try_wait().is_ok_and(|s| s.is_none())
    }
    /// Whether valet owes this pod a quit: its Job finished and the pod is still valet's.
    pub(crate) fn owed_quit(&self) -> bool {
        self.ended_ns.is_some() && self.labelled && !self.deleted
    }
    pub(crate) fn allow_release(&mut self) {
        let now = monotonic_ns();
        self.allowed_ns = Some(self.allowed_ns.map_or(now, |a| a.min(now)));
    }
    /// The earliest its hold's deadline can be: the app's start plus its pod's hold timeout (the
    /// kernel stopped it after the start). Nothing the agent or the kernel wrote moves it.
    pub(crate) fn deadline_at_least(&self) -> Option<u64> {
        self.started_ns.map(|s| s + self.timeout.as_nanos() as u64)
    }
    /// Lets its proxy turn ready (the stand-in binds its listener and answers ready from then
    /// on, logging that moment: the one releases are judged against).
    pub(crate) fn make_ready(&mut self) {
        std::fs::write(&self.ready_file, "").expect("ready file");
        self.ready = true;
    }
    /// Lets a running app end (it reads one line from its FIFO, then exits 0); false when it
    /// never opened the FIFO within the guard.
    pub(crate) fn end_app(&mut self) -> bool {
        let path = std::ffi::CString::new(self.end.as_os_str().as_bytes()).expect("path");
        let deadline = Instant::now() + GUARD;
        loop {
            let before = monotonic_ns();
            // SAFETY: a valid C string; the fd is closed below. Non-blocking: ENXIO while the
            // app has not opened its end of the FIFO yet.
            let fd = unsafe { libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_NONBLOCK | libc::O_CLOEXEC) };
            if fd >= 0 {
                // SAFETY: a valid fd and buffer.
                unsafe {
                    libc::write(fd, b"end\n".as_ptr().cast(), 4);
                    libc::close(fd);
                }
                self.ended_ns = Some(before);
                return true;
            }
            if Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
    }
}
