//! End to end, issue 26 ("prove it with a crash test, not by reading"): the real agent binary is
//! killed with SIGKILL at random moments and restarted each time, as its DaemonSet would restart
//! it, across a rolling population of Job pods on a simulated node (real cgroups, network
//! namespaces, eBPF, processes; a fake API server and kubelet). Pods are held at their app's
//! first exec in their own pid namespace and in the pod's shared one (shareProcessNamespace);
//! the kills land right after an app's end (a quit in flight), right after a proxy turned ready
//! (a release and a condition write in flight), at any moment, and during the agent's startup;
//! while the agent is down, pods are deleted, relabelled, stripped of their hold annotation,
//! their proxies turn ready and their apps end.
//!
//! After every restart, measured from the moment the new agent answers `/readyz` 200, it counts:
//! apps left stopped or frozen 2 s later that should run; quits sent before an app's end;
//! finished Jobs not quit within 1 s; `valet.dev/ProxyReady` conditions that say something false
//! once the agent has settled. Each count is printed and must be 0. The waits are hang guards
//! that record a violation at their deadline, never sleeps followed by a look.
//!
//! Second version (issue 36): every pod has a short hold timeout (3–8 s), so deadlines fall
//! while the agent is down, and the test also counts apps left stopped more than 2 s past their
//! deadline (the kernel's stop time, read from its pinned record, plus the pod's hold timeout)
//! and early releases (an app that ran before the test made its proxy ready, before its pod
//! stopped holding it, and before its start plus its pod's hold timeout: judged against what the
//! test did, never against a deadline the agent or the kernel wrote). The agent runs
//! beside `valet-agent deadlines`, as in its DaemonSet pod. Besides the kills, in turn every
//! `VALET_CHAOS_SPECIAL_EVERY` turns (default 6; each at least once): a restart into a 30 s API outage (every request
//! answered 503); a crash loop (the agent killed before ready 5 times, its restarts delayed
//! 1, 2, 4, 4, 4 times `VALET_CHAOS_BACKOFF_MS`, 1000 here and 10000 in `cargo xtask chaos`, as
//! the kubelet's 10, 20, 40 s backoff); an uninstall (SIGTERM to both containers, no successor:
//! every app must run), followed by a fresh install; an upgrade across a change of record format
//! and pin directory (both containers SIGKILLed, their `held_v2` records rewritten as `held_v1`
//! in another directory, the new version started with `--old-pin-dir`); a full record map (filled
//! with records of pids no process can have while the agent runs, then apps start: each must run
//! unheld or be held with a record, never stopped without one).
//!
//! `VALET_CHAOS_KILLS` sets the number of kills (default 25 here; `cargo xtask chaos` runs 200),
//! `VALET_CHAOS_SEED` replays a run's random choices (its seed is printed first; timings still
//! differ from run to run).

use std::os::unix::ffi::OsStrExt as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use valet_common::{HELD_CAPACITY, HeldRecord, HeldRecordV1, PIN_HELD, PIN_HELD_V1};
use valet_sim::apiserver::Fault;
use valet_sim::node::SpawnOptions;
use valet_sim::util::monotonic_ns;
use valet_tests::harness::{Agent, DeadlineKeeper, JobPod, JobSpec, Node, eventually, process_state as state};
use valet_tests::pins;

const HOLD: &str = "valet.dev/hold-app";
const LABEL: &str = "valet.dev/enabled";
const CONDITION: &str = "valet.dev/ProxyReady";

/// Kinds of special disruption, one every `VALET_CHAOS_SPECIAL_EVERY` turns in turn: an
/// outage, a crash loop, an uninstall, an upgrade, a full record map.
const SPECIALS: usize = 5;
/// The pass criteria, counted per restart from the new agent's `/readyz` 200.
const RUN_WITHIN: Duration = Duration::from_secs(2);
const QUIT_WITHIN: Duration = Duration::from_secs(1);
/// How long the agent may take to settle a condition before it counts as left false: a hang
/// guard, far above the agent's 100 ms probe interval and its 10 s write bound.
const SETTLE: Duration = Duration::from_secs(15);
/// Hang guard for the things the test itself waits for (a late quit is still waited for, to
/// print how late it was).
const GUARD: Duration = Duration::from_secs(10);
/// Pods alive at a time: enough to have every kind of pod in flight at each kill, few enough
/// that the test does not starve the agent on a loaded 2-core machine.
const POPULATION: (usize, usize) = (4, 8);
/// A pod is retired after this many restarts whatever its state, so the population rolls.
const MAX_AGE: usize = 10;
/// Hold timeouts, in seconds: short, so deadlines fall during outages and crash loops.
const HOLD_TIMEOUTS: (u64, u64) = (3, 8);
/// How late past its deadline an app may run.
const DEADLINE_WITHIN: Duration = Duration::from_secs(2);
/// The API outage a restart meets.
const OUTAGE: Duration = Duration::from_secs(30);
/// A marker's time comes from the coarse clock file systems stamp with (up to a tick behind).
const STAMP_SLACK_NS: u64 = 10_000_000;

/// A small seeded generator (SplitMix64): one seed replays a run's choices.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next() % n }
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
    fn millis(&mut self, max: u64) -> Duration {
        Duration::from_millis(self.below(max + 1))
    }
}

fn env_u64(name: &str) -> Option<u64> {
    let v = std::env::var(name).ok()?;
    Some(v.trim().parse().unwrap_or_else(|_| panic!("{name}={v:?} is not a number")))
}

/// Whether the process' cgroup is frozen (cgroup v2 `cgroup.events`).
fn frozen(cgroup_root: &Path, pid: u32) -> bool {
    let Ok(text) = std::fs::read_to_string(format!("/proc/{pid}/cgroup")) else { return false };
    let Some(rel) = text.lines().find_map(|l| l.strip_prefix("0::")) else { return false };
    let events = cgroup_root.join(rel.trim_start_matches('/')).join("cgroup.events");
    std::fs::read_to_string(events).is_ok_and(|e| e.lines().any(|l| l == "frozen 1"))
}

/// Stopped or frozen: not running though alive. A process that is gone is not held.
fn stuck(cgroup_root: &Path, pid: u32) -> bool {
    match state(pid) {
        None | Some('Z') => false,
        Some('T' | 't') => true,
        Some(_) => frozen(cgroup_root, pid),
    }
}

/// The kernel's record of a held process, from the pinned map.
fn record(pin_dir: &Path, pid: u32) -> Option<HeldRecord> {
    use aya::maps::{HashMap, Map, MapData};
    let data = MapData::from_pin(pin_dir.join(PIN_HELD)).ok()?;
    let map: HashMap<MapData, u32, HeldRecord> = HashMap::try_from(Map::HashMap(data)).ok()?;
    map.get(&pid, 0).ok()
}

/// CLOCK_REALTIME minus CLOCK_MONOTONIC: turns a file's time stamp into the monotonic clock.
fn realtime_offset_ns() -> i128 {
    let real = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as i128);
    real - i128::from(monotonic_ns())
}

/// When a marker file was written, on the monotonic clock.
fn written_ns(path: &Path, offset: i128) -> Option<u64> {
    use std::os::unix::fs::MetadataExt as _;
    let m = std::fs::metadata(path).ok()?;
    let real = i128::from(m.mtime()) * 1_000_000_000 + i128::from(m.mtime_nsec());
    u64::try_from(real - offset).ok()
}

/// The agent's `valet.dev/ProxyReady` condition status on the pod.
fn condition(node: &Node, job: &JobPod) -> Option<String> {
    let pod = node.pod(job)?;
    pod["status"]["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == CONDITION)
        .map(|c| c["status"].as_str().unwrap_or_default().to_owned())
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Pidns {
    /// The app is pid 1 of its container's own pid namespace.
    Own,
    /// shareProcessNamespace: the app joins the sandbox's namespace (pid N, the pause is pid 1).
    Shared,
}

/// What happens to a pod while the agent is down; one kind per kill in turn, so a short run
/// covers every kind.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Disruption {
    Deleted,
    Unlabelled,
    Unannotated,
    ProxyReady,
    AppEnded,
}

const DISRUPTIONS: [Disruption; 5] = [
    Disruption::Deleted,
    Disruption::Unlabelled,
    Disruption::Unannotated,
    Disruption::ProxyReady,
    Disruption::AppEnded,
];

/// One Job pod of the population and what the test did to it.
struct Pod {
    job: JobPod,
    pidns: Pidns,
    ready_file: PathBuf,
    /// Written by the app the moment it runs.
    ran: PathBuf,
    /// A FIFO the app reads before it exits: the test decides when the app ends.
    end: PathBuf,
    /// The app's first process (the one the kernel holds at exec).
    app: Option<u32>,
    ready: bool,
    /// CLOCK_MONOTONIC just before the test let the app end: the end came after it.
    ended_ns: Option<u64>,
    labelled: bool,
    hold: bool,
    deleted: bool,
    /// Restarts survived.
    age: usize,
    /// A violation was counted for it: it is retired, and not counted twice.
    failed: bool,
    /// Its `valet.dev/hold-timeout`.
    timeout: Duration,
    /// CLOCK_MONOTONIC just before the app started (its hold began after it).
    started_ns: Option<u64>,
    /// Its hold's deadline: the kernel's stop time in its record, once read, plus its own hold
    /// timeout (not the deadline the record carries: a deadline written wrong is what is judged).
    deadline_ns: Option<u64>,
    /// The earliest moment a release was allowed before the deadline: its proxy turned ready,
    /// or its pod stopped holding it (deleted, relabelled, stripped of its hold).
    allowed_ns: Option<u64>,
    /// Its app's release was judged (early or not).
    release_judged: bool,
    /// Counted as left stopped past its deadline.
    late_counted: bool,
}

impl Pod {
    fn name(&self) -> &str {
        &self.job.name
    }
    /// The app runs, or may: its proxy is ready, or the pod is no longer held, labelled or there.
    fn must_run(&self) -> Option<&'static str> {
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
    fn can(&self, kind: Disruption) -> bool {
        !self.deleted
            && self.labelled
            && match kind {
                Disruption::ProxyReady => !self.ready,
                Disruption::AppEnded => self.ended_ns.is_none() && self.app_ran(),
                Disruption::Unannotated => self.hold,
                Disruption::Deleted | Disruption::Unlabelled => true,
            }
    }
    fn app_ran(&self) -> bool {
        self.ran.exists()
    }
    fn proxy_alive(&self) -> bool {
        self.job.proxy.try_wait().is_ok_and(|s| s.is_none())
    }
    /// Whether valet owes this pod a quit: its Job finished and the pod is still valet's.
    fn owed_quit(&self) -> bool {
        self.ended_ns.is_some() && self.labelled && !self.deleted
    }
    fn allow_release(&mut self) {
        let now = monotonic_ns();
        self.allowed_ns = Some(self.allowed_ns.map_or(now, |a| a.min(now)));
    }
    /// The earliest its hold's deadline can be: the app's start plus its pod's hold timeout (the
    /// kernel stopped it after the start). Nothing the agent or the kernel wrote moves it.
    fn deadline_at_least(&self) -> Option<u64> {
        self.started_ns.map(|s| s + self.timeout.as_nanos() as u64)
    }
    fn make_ready(&mut self) {
        self.allow_release();
        std::fs::write(&self.ready_file, "").expect("ready file");
        self.ready = true;
    }
    /// Lets a running app end (it reads one line from its FIFO, then exits 0); false when it
    /// never opened the FIFO within the guard.
    fn end_app(&mut self) -> bool {
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

/// Violations and what the run covered.
#[derive(Default)]
struct Tally {
    kills: usize,
    startup_kills: usize,
    restarts: usize,
    pods: usize,
    startups: Vec<Duration>,
    held_at_kill: [usize; 2],
    /// Disruptions made while the agent was down, by kind (see [`DISRUPTIONS`]).
    disrupted: [usize; 5],
    quits_in_flight: usize,
    conditions_in_flight: usize,
    disrupted_held: Vec<(Disruption, Pidns)>,
    should_run: usize,
    left_stopped: usize,
    quits: usize,
    early_quits: usize,
    owed_quits: usize,
    late_quits: usize,
    conditions_checked: usize,
    false_conditions: usize,
    /// Held apps whose deadline the test read from the kernel's record.
    deadlines_known: usize,
    /// Apps still stopped more than 2 s past their deadline.
    past_deadline: usize,
    /// Releases judged, and those that came before the app's proxy was ready, its pod stopped
    /// holding it and its deadline.
    releases_judged: usize,
    early_releases: usize,
    /// Releases that came at the deadline (neither ready nor let go before it).
    deadline_releases: usize,
    outages: usize,
    crash_loops: usize,
    uninstalls: usize,
    /// Apps held at an uninstall, and those still stopped 2 s after it.
    held_at_uninstall: usize,
    left_by_uninstall: usize,
    /// Upgrades across a change of record format and pin directory, and the records they
    /// carried over.
    upgrades: usize,
    upgraded_records: usize,
    /// Times the record map was filled, apps started into it, and those that ran unheld.
    map_fills: usize,
    started_into_full_map: usize,
    ran_unheld: usize,
    /// Apps stopped with no record to release them by (must be 0).
    held_without_record: usize,
    /// Full maps the agent did not clear of records of processes that do not exist (must be 0).
    full_map_kept: usize,
}

struct Chaos<'a> {
    node: &'a Node,
    rng: Rng,
    pods: Vec<Pod>,
    tally: Tally,
    cgroup_root: PathBuf,
    serial: usize,
    /// Kills the run makes in all.
    kills: usize,
    /// CLOCK_REALTIME − CLOCK_MONOTONIC.
    offset: i128,
    /// Flags every agent start gets (after an upgrade: the previous version's pin directory).
    agent_args: Vec<String>,
    /// The previous versions' pin directories the upgrades made (removed at the end).
    old_pin_dirs: Vec<PathBuf>,
}

impl Chaos<'_> {
    fn spawn(&self) -> Agent {
        let args: Vec<&str> = self.agent_args.iter().map(String::as_str).collect();
        self.node.spawn_agent(&args).expect("start the agent")
    }

    /// An upgrade across a change of record format and pin directory. The previous version's
    /// pod dies without releasing (both containers SIGKILLed: an OOM kill or a node crash
    /// during the update), its records left as that version wrote them: `held_v1` (no
    /// deadline) in its own pin directory. The new version's containers start with
    /// `--old-pin-dir` naming it; every held app must still run by its deadline (the one the
    /// kernel recorded before the upgrade), and none before it is allowed.
    fn upgrade(&mut self, agent: &mut Agent, keeper: &mut DeadlineKeeper) -> DeadlineKeeper {
        self.tally.upgrades += 1;
        // At least one app held across it: of a pod still holding it (its hold annotation on,
        // its proxy not ready: a disruption may have changed either before its app started).
        if let Some(&i) = self.placed_unstarted(|p| p.hold && !p.ready).first() {
            self.start_app(i);
            let pid = self.pods[i].app;
            let ran = self.pods[i].ran.clone();
            eventually(GUARD, || pid.is_some_and(|p| state(p) == Some('T')) || ran.exists());
        }
        // Every held app's deadline is read from the record before it loses it.
        self.observe(Some(agent));
        let killed_ns = monotonic_ns();
        agent.stop(libc::SIGKILL, GUARD).expect("kill the agent");
        keeper.kill();
        self.count_in_flight(killed_ns);
        let pin_dir = self.node.pin_dir().to_path_buf();
        // On bpffs, where a name may not hold a dot.
        let mut old_dir = pin_dir.clone().into_os_string();
        old_dir.push(format!("-previous{}", self.tally.upgrades));
        let old_dir = PathBuf::from(old_dir);
        self.old_pin_dirs.push(old_dir.clone());
        std::fs::create_dir_all(&old_dir).expect("the previous version's pin directory");
        let records = pins::held_records(&pin_dir);
        let mut v1 = pins::pin_held_v1(&old_dir.join(PIN_HELD_V1));
        for (pid, r) in &records {
            v1.insert(pid, HeldRecordV1 { cgroup_id: r.cgroup_id, ktime_ns: r.ktime_ns }, 0).expect("a v1 record");
        }
        drop(v1);
        if pin_dir.join(PIN_HELD).exists() {
            std::fs::remove_file(pin_dir.join(PIN_HELD)).expect("unpin the new format's map");
        }
        self.tally.upgraded_records += records.len();
        let old = old_dir.display().to_string();
        self.agent_args = vec!["--old-pin-dir".into(), old.clone()];
        self.node.start_deadline_keeper_with(&["--old-pin-dir", &old]).expect("the new version's deadline keeper")
    }

    /// The pods the agent has placed (probed, condition written) whose app has not started, of
    /// those `also` takes; one is made, and waited for, if there is none.
    fn placed_unstarted(&mut self, also: impl Fn(&Pod) -> bool) -> Vec<usize> {
        let placed = |c: &Self, i: usize| {
            let p = &c.pods[i];
            !p.deleted && p.labelled && !p.failed && p.app.is_none() && also(p) && condition(c.node, &p.job).is_some()
        };
        let mut found: Vec<usize> = (0..self.pods.len()).filter(|&i| placed(self, i)).collect();
        if found.is_empty() {
            self.new_pod();
            let i = self.pods.len() - 1;
            eventually(GUARD, || placed(self, i));
            if placed(self, i) {
                found.push(i);
            }
        }
        found
    }

    /// A full record map, as a leak would leave it: with the agent running, the pinned map is
    /// filled to capacity with records of pids no process can have (above the kernel's
    /// `PID_MAX_LIMIT`), and the apps of the pods the agent has placed start at once. A hold the
    /// kernel cannot record must not be made: each app runs at once, or (the agent's sweep
    /// freed room first) is held with a record. An app stopped with no record is counted.
    fn fill_record_map(&mut self) {
        const PID_MAX_LIMIT: u32 = 4 * 1024 * 1024;
        self.tally.map_fills += 1;
        let pin = self.node.pin_dir().join(PIN_HELD);
        let data = aya::maps::MapData::from_pin(&pin).expect("the pinned record");
        let mut map: aya::maps::HashMap<aya::maps::MapData, u32, HeldRecord> =
            aya::maps::HashMap::try_from(aya::maps::Map::HashMap(data)).expect("the record map");
        let now = monotonic_ns();
        let filler = HeldRecord { cgroup_id: 0, ktime_ns: now, deadline_ns: now + 3_600_000_000_000 };
        let mut key = PID_MAX_LIMIT + 1;
        while map.insert(key, filler, 0).is_ok() {
            key += 1;
            assert!(key < PID_MAX_LIMIT + 2 * HELD_CAPACITY, "the record map took more than its capacity");
        }
        let placed = self.placed_unstarted(|_| true);
        for i in placed {
            self.start_app(i);
            self.tally.started_into_full_map += 1;
            let (pid, ran) = (self.pods[i].app, self.pods[i].ran.clone());
            eventually(GUARD, || pid.is_some_and(|p| state(p) == Some('T')) || ran.exists());
            let stopped = pid.is_some_and(|p| state(p) == Some('T'));
            if !stopped && ran.exists() {
                // Ran unheld: allowed, the kernel could not record a hold.
                self.tally.ran_unheld += 1;
                let pod = &mut self.pods[i];
                pod.allowed_ns = pod.started_ns;
            } else if stopped && pid.is_some_and(|p| record(self.node.pin_dir(), p).is_none()) {
                self.tally.held_without_record += 1;
                self.pods[i].failed = true;
                println!("VIOLATION held without a record: {} (app {pid:?})", self.pods[i].name());
            }
        }
        // The agent's sweep drops the records of processes that do not exist; until it has,
        // apps run unheld, so the next turn starts none before (a map that stayed full would
        // end every hold on the node: counted).
        let pin_dir = self.node.pin_dir().to_path_buf();
        let cleared = Instant::now() + GUARD;
        while pins::held_records(&pin_dir).iter().any(|(pid, _)| *pid > PID_MAX_LIMIT) {
            if Instant::now() > cleared {
                self.tally.full_map_kept += 1;
                println!("VIOLATION full map kept: the agent had not dropped the records of no process {GUARD:?} on");
                break;
            }
            self.wait_observing(Duration::from_millis(50), None);
        }
    }

    fn new_pod(&mut self) {
        self.serial += 1;
        // Alternating, so every kill finds both kinds in the population.
        let pidns = if self.serial.is_multiple_of(2) { Pidns::Own } else { Pidns::Shared };
        let tag = format!("{}{}", if pidns == Pidns::Own { "own" } else { "shared" }, self.serial);
        let ready_file = self.node.scratch.path(&format!("{tag}.ready"));
        let ran = self.node.scratch.path(&format!("{tag}.ran"));
        let end = self.node.scratch.path(&format!("{tag}.end"));
        let fifo = std::ffi::CString::new(end.as_os_str().as_bytes()).expect("path");
        // SAFETY: a valid C string.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0, "mkfifo {}", end.display());
        let timeout = Duration::from_secs(HOLD_TIMEOUTS.0 + self.rng.below(HOLD_TIMEOUTS.1 - HOLD_TIMEOUTS.0 + 1));
        let mut spec = JobSpec::new(&format!("chaos-{tag}"))
            .annotation(HOLD, "true")
            .annotation("valet.dev/hold-timeout", &format!("{}s", timeout.as_secs()));
        spec.share_process_namespace = pidns == Pidns::Shared;
        spec.ready_file = Some(ready_file.clone());
        let job = self.node.job_pod(spec).expect("pod");
        self.tally.pods += 1;
        self.pods.push(Pod {
            job,
            pidns,
            ready_file,
            ran,
            end,
            app: None,
            ready: false,
            ended_ns: None,
            labelled: true,
            hold: true,
            deleted: false,
            age: 0,
            failed: false,
            timeout,
            started_ns: None,
            deadline_ns: None,
            allowed_ns: None,
            release_judged: false,
            late_counted: false,
        });
    }

    fn start_app(&mut self, i: usize) {
        let pod = &mut self.pods[i];
        pod.started_ns = Some(monotonic_ns());
        let script = format!("echo ran > {}; read line < {}; exit 0", pod.ran.display(), pod.end.display());
        let pid = match pod.pidns {
            Pidns::Own => {
                pod.job.run_app("app", &script).expect("start the app");
                pod.job.apps[0].host_pid()
            }
            Pidns::Shared => {
                // As runc starts a container of a shareProcessNamespace pod: in its own cgroup,
                // in the sandbox's pid namespace, where the pause is pid 1.
                let opts = SpawnOptions {
                    join_pid_namespace: Some(format!("/proc/{}/ns/pid", pod.job.pause.host_pid()).into()),
                    ..Default::default()
                };
                let app = pod.job.start_app("app", &["/bin/sh", "-c", &script], &opts).expect("start the app");
                app.host_pid()
            }
        };
        pod.app = Some(pid);
    }

    /// The agent's log lines about a pod, for a violation's report.
    fn log_about(agent: &Agent, pod: &Pod) -> String {
        let text = agent.log_text();
        let lines: Vec<&str> = text.lines().filter(|l| l.contains(pod.name())).collect();
        if lines.is_empty() {
            return "(it names the pod nowhere)".into();
        }
        lines[lines.len().saturating_sub(15)..].join("\n")
    }

    /// One turn while the agent runs: pods advance a step each, at random (the kill lands right
    /// after the turn, or later). Whether an app was let end.
    fn advance(&mut self) -> bool {
        let mut ends = Vec::new();
        for i in 0..self.pods.len() {
            let pod = &self.pods[i];
            if pod.deleted || !pod.labelled || pod.failed || !self.rng.chance(65) {
                continue;
            }
            if pod.app.is_none() {
                // The agent has placed the pod (probed its proxy and written the condition):
                // the kernel holds the app's first exec.
                if condition(self.node, &pod.job).is_some() {
                    self.start_app(i);
                    // Its exec is done (held, or run) before the turn goes on: a kill right
                    // after the turn finds it held, never on its way to the exec.
                    let (pid, ran) = (self.pods[i].app, self.pods[i].ran.clone());
                    eventually(GUARD, || pid.is_some_and(|p| state(p) == Some('T')) || ran.exists());
                }
            } else if !pod.ready && pod.hold {
                self.pods[i].make_ready();
            } else if pod.ended_ns.is_none() && pod.app_ran() {
                ends.push(i);
            }
        }
        // Ends last, so that a kill right after the turn finds their quits in flight.
        for &i in &ends {
            self.pods[i].end_app();
        }
        !ends.is_empty()
    }

    /// Counts what the agent had in hand when it was killed (at `killed_ns`): held apps by kind,
    /// quits owed and not received, ready proxies whose condition did not say so yet.
    fn count_in_flight(&mut self, killed_ns: u64) {
        for pod in &self.pods {
            if let Some(pid) = pod.app
                && state(pid) == Some('T')
            {
                self.tally.held_at_kill[pod.pidns as usize] += 1;
            }
            if pod.owed_quit() && !pod.job.loopback_quits().iter().any(|q| q.mono_ns < killed_ns) {
                self.tally.quits_in_flight += 1;
            }
            if pod.ready && pod.labelled && !pod.deleted && condition(self.node, &pod.job).as_deref() != Some("True") {
                self.tally.conditions_in_flight += 1;
            }
        }
    }

    /// While the agent is down: `kind` happens to one pod (one with a held app when there is
    /// one), and now and then something else to others.
    fn disrupt(&mut self, kind: Disruption) {
        let fits = |p: &Pod| !p.failed && p.can(kind);
        let held = |p: &Pod| p.app.is_some_and(|pid| state(pid) == Some('T'));
        let candidates: Vec<usize> = (0..self.pods.len()).filter(|&i| fits(&self.pods[i])).collect();
        let held_ones: Vec<usize> = candidates.iter().copied().filter(|&i| held(&self.pods[i])).collect();
        let pool = if held_ones.is_empty() { &candidates } else { &held_ones };
        if pool.is_empty() {
            return;
        }
        let i = pool[self.rng.below(pool.len() as u64) as usize];
        if held(&self.pods[i]) {
            self.tally.disrupted_held.push((kind, self.pods[i].pidns));
        }
        self.apply(i, kind);
        for j in 0..self.pods.len() {
            if j != i && !self.pods[j].failed && self.rng.chance(10) {
                let other = DISRUPTIONS[self.rng.below(DISRUPTIONS.len() as u64) as usize];
                self.apply(j, other);
            }
        }
    }

    fn apply(&mut self, i: usize, kind: Disruption) {
        let node = self.node;
        let pod = &mut self.pods[i];
        if !pod.can(kind) {
            return;
        }
        self.tally.disrupted[kind as usize] += 1;
        if matches!(kind, Disruption::Deleted | Disruption::Unlabelled | Disruption::Unannotated) {
            pod.allow_release();
        }
        match kind {
            // Gone from the API at once (a forced delete); its processes live on until the
            // pod is retired, as the kubelet takes its time to kill them.
            Disruption::Deleted => {
                node.api.delete_pod("jobs", pod.name()).expect("delete");
                pod.deleted = true;
            }
            Disruption::Unlabelled => {
                node.api
                    .modify_pod("jobs", pod.name(), |p| {
                        if let Some(l) = p["metadata"]["labels"].as_object_mut() {
                            l.remove(LABEL);
                        }
                    })
                    .expect("relabel");
                pod.labelled = false;
            }
            Disruption::Unannotated => {
                node.api
                    .modify_pod("jobs", pod.name(), |p| {
                        if let Some(a) = p["metadata"]["annotations"].as_object_mut() {
                            a.remove(HOLD);
                        }
                    })
                    .expect("annotate");
                pod.hold = false;
            }
            Disruption::ProxyReady => pod.make_ready(),
            Disruption::AppEnded => {
                pod.end_app();
            }
        }
    }

    /// A crash loop: the agent is started and killed before it is ready 5 times, each start
    /// delayed as the kubelet's backoff delays it (1, 2, 4, 4, 4 × `backoff`).
    fn crash_loop(&mut self, backoff: Duration) {
        self.tally.crash_loops += 1;
        for factor in [1, 2, 4, 4, 4] {
            self.wait_observing(backoff * factor, None);
            let mut agent = self.spawn();
            let typical = self.tally.startups.last().copied().unwrap_or(Duration::from_millis(300));
            let before = self.rng.millis(typical.as_millis() as u64 / 2);
            self.wait_observing(before, Some(&agent));
            agent.stop(libc::SIGKILL, GUARD).expect("kill the starting agent");
            self.tally.kills += 1;
            self.tally.startup_kills += 1;
        }
    }

    /// A restart into an API outage: every request is answered 503 for [`OUTAGE`]; the agent
    /// comes up meanwhile. Returns it ready, once the API is back.
    fn restart_into_outage(&mut self) -> (Agent, Instant, u64) {
        self.tally.outages += 1;
        self.node.api.set_fault(Fault::Status { code: 503, verbs: Vec::new(), until: Some(Instant::now() + OUTAGE) });
        let spawned = Instant::now();
        let agent = self.spawn();
        self.wait_observing(OUTAGE, Some(&agent));
        self.node.api.clear_faults();
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            self.observe(Some(&agent));
            let ok =
                valet_sim::client::get(agent.metrics, "/readyz", Duration::from_secs(2)).is_ok_and(|r| r.status == 200);
            if ok {
                break;
            }
            assert!(Instant::now() < deadline, "the agent was not ready 90 s after the outage:\n{}", agent.log_text());
            std::thread::sleep(Duration::from_millis(5));
        }
        let (ready_at, ready_ns) = (Instant::now(), monotonic_ns());
        println!("chaos: outage: the agent was ready {:?} after its start", ready_at - spawned);
        self.tally.restarts += 1;
        (agent, ready_at, ready_ns)
    }

    /// An uninstall: both containers get SIGTERM and no successor comes; every app must run.
    /// Then a fresh install (a new deadline keeper; the caller starts the agent).
    fn uninstall(&mut self, agent: &mut Agent, keeper: &mut DeadlineKeeper) -> DeadlineKeeper {
        self.tally.uninstalls += 1;
        let held: Vec<(usize, u32)> = (0..self.pods.len())
            .filter_map(|i| self.pods[i].app.filter(|&p| state(p) == Some('T')).map(|p| (i, p)))
            .collect();
        self.tally.held_at_uninstall += held.len();
        // Every hold may end now: the uninstall releases them.
        for pod in &mut self.pods {
            if pod.app.is_some() {
                pod.allow_release();
            }
        }
        let status = agent.stop(libc::SIGTERM, GUARD).expect("SIGTERM the agent");
        assert!(status.is_some_and(|s| s.success()), "the agent's exit at SIGTERM: {status:?}\n{}", agent.log_text());
        keeper.stop().expect("SIGTERM the deadline keeper");
        let root = self.cgroup_root.clone();
        let gone = Instant::now() + RUN_WITHIN;
        for (i, pid) in held {
            while stuck(&root, pid) && Instant::now() < gone {
                std::thread::sleep(Duration::from_millis(5));
            }
            if stuck(&root, pid) {
                self.tally.left_by_uninstall += 1;
                self.pods[i].failed = true;
                println!("VIOLATION uninstall: {} left stopped after both containers exited", self.pods[i].name());
            }
        }
        self.node.start_deadline_keeper().expect("a new deadline keeper")
    }

    /// Starts the agent as its DaemonSet would after a crash; sometimes kills it again before it
    /// is ready (a crash during recovery). Returns the ready agent and when it answered ready.
    fn restart(&mut self) -> (Agent, Instant, u64) {
        loop {
            let spawned = Instant::now();
            let mut agent = self.spawn();
            if self.tally.kills < self.kills && self.rng.chance(15) {
                let typical = self.tally.startups.last().copied().unwrap_or(Duration::from_millis(300));
                std::thread::sleep(self.rng.millis(typical.as_millis() as u64));
                agent.stop(libc::SIGKILL, GUARD).expect("kill the starting agent");
                self.tally.kills += 1;
                self.tally.startup_kills += 1;
                continue;
            }
            // Polled every 5 ms: the criteria count from this moment.
            let deadline = Instant::now() + Duration::from_secs(60);
            loop {
                let ok = valet_sim::client::get(agent.metrics, "/readyz", Duration::from_secs(2))
                    .is_ok_and(|r| r.status == 200);
                if ok {
                    break;
                }
                assert!(Instant::now() < deadline, "the agent was not ready in 60 s:\n{}", agent.log_text());
                std::thread::sleep(Duration::from_millis(5));
            }
            let (ready_at, ready_ns) = (Instant::now(), monotonic_ns());
            self.tally.startups.push(ready_at - spawned);
            self.tally.restarts += 1;
            return (agent, ready_at, ready_ns);
        }
    }

    /// The counts after a restart.
    fn check(&mut self, agent: &Agent, ready_at: Instant, ready_ns: u64) {
        let root = self.cgroup_root.clone();
        // Apps that should run and are still stopped or frozen 2 s after the agent is back.
        for pod in &mut self.pods {
            let (Some(why), Some(pid)) = (pod.must_run(), pod.app) else { continue };
            if pod.failed {
                continue;
            }
            self.tally.should_run += 1;
            let deadline = ready_at + RUN_WITHIN;
            let ran = loop {
                if !stuck(&root, pid) {
                    break true;
                }
                if Instant::now() > deadline {
                    break false;
                }
                std::thread::sleep(Duration::from_millis(5));
            };
            if !ran {
                self.tally.left_stopped += 1;
                pod.failed = true;
                println!(
                    "VIOLATION stopped: {} ({:?} pid namespace, {why}): app {pid} in state {:?} (frozen: {}) \
                     {RUN_WITHIN:?} after the agent was back; agent log:\n{}",
                    pod.name(),
                    pod.pidns,
                    state(pid),
                    frozen(&root, pid),
                    Chaos::log_about(agent, pod)
                );
            }
        }
        // Finished Jobs not quit by then: the quit must come within 1 s of the restart.
        for pod in &mut self.pods {
            if !pod.owed_quit() || pod.failed {
                continue;
            }
            let quit_before = pod.job.loopback_quits().iter().any(|q| q.mono_ns < ready_ns);
            if quit_before {
                continue;
            }
            self.tally.owed_quits += 1;
            let mut first = None;
            eventually((ready_at + GUARD).saturating_duration_since(Instant::now()), || {
                first = pod.job.loopback_quits().iter().map(|q| q.mono_ns).min();
                first.is_some()
            });
            let late = first.is_none_or(|t| t > ready_ns + QUIT_WITHIN.as_nanos() as u64);
            if late {
                self.tally.late_quits += 1;
                pod.failed = true;
                let after = first.map(|t| Duration::from_nanos(t.saturating_sub(ready_ns)));
                println!(
                    "VIOLATION quit: {} ({:?} pid namespace, ended {:?} before the restart): quit {} after the \
                     agent was back; agent log:\n{}",
                    pod.name(),
                    pod.pidns,
                    Duration::from_nanos(ready_ns.saturating_sub(pod.ended_ns.unwrap_or(ready_ns))),
                    after.map_or("never (10 s guard)".to_owned(), |d| format!("{d:?}")),
                    Chaos::log_about(agent, pod)
                );
            }
        }
        // Conditions of the pods still valet's, whose proxy runs: True exactly when it is ready.
        for pod in &mut self.pods {
            if pod.deleted || !pod.labelled || pod.failed || !pod.proxy_alive() || !pod.job.quits().is_empty() {
                continue;
            }
            self.tally.conditions_checked += 1;
            let want = if pod.ready { "True" } else { "False" };
            let mut have = None;
            let settled = eventually((ready_at + SETTLE).saturating_duration_since(Instant::now()), || {
                have = condition(self.node, &pod.job);
                // A True while the proxy is not ready is false at once, not a matter of settling.
                have.as_deref() == Some(want) || (!pod.ready && have.as_deref() == Some("True"))
            });
            // The proxy may have been quit meanwhile (its app ended just before the kill).
            let quit_meanwhile = !pod.proxy_alive() || !pod.job.quits().is_empty();
            if (!settled || have.as_deref() != Some(want)) && !quit_meanwhile {
                self.tally.false_conditions += 1;
                pod.failed = true;
                println!(
                    "VIOLATION condition: {} ({:?} pid namespace): {CONDITION} {have:?} while the proxy is {}; \
                     agent log:\n{}",
                    pod.name(),
                    pod.pidns,
                    if pod.ready { "ready" } else { "not ready" },
                    Chaos::log_about(agent, pod)
                );
            }
        }
    }

    /// Looks at every held app: reads its deadline from the kernel's record while it is held,
    /// counts it when it is still stopped more than 2 s past that deadline, and judges its
    /// release once it ran (early: before its proxy was ready, its pod let it go, and its
    /// deadline). Called between every step, and every 50 ms while the test waits.
    fn observe(&mut self, agent: Option<&Agent>) {
        let root = self.cgroup_root.clone();
        let pin_dir = self.node.pin_dir().to_path_buf();
        let now = monotonic_ns();
        for pod in &mut self.pods {
            let Some(pid) = pod.app else { continue };
            if pod.deadline_ns.is_none()
                && state(pid) == Some('T')
                && let Some(r) = record(&pin_dir, pid)
            {
                pod.deadline_ns = Some(r.ktime_ns + pod.timeout.as_nanos() as u64);
                self.tally.deadlines_known += 1;
            }
            if !pod.late_counted
                && let Some(deadline) = pod.deadline_ns
                && now > deadline + DEADLINE_WITHIN.as_nanos() as u64
                && stuck(&root, pid)
            {
                pod.late_counted = true;
                self.tally.past_deadline += 1;
                println!(
                    "VIOLATION past deadline: {} ({:?} pid namespace): app {pid} still stopped {:?} after its \
                     deadline{}",
                    pod.name(),
                    pod.pidns,
                    Duration::from_nanos(now - deadline),
                    agent.map(|a| format!("; agent log:\n{}", Chaos::log_about(a, pod))).unwrap_or_default()
                );
            }
            if !pod.release_judged
                && let Some(ran) = written_ns(&pod.ran, self.offset)
            {
                pod.release_judged = true;
                self.tally.releases_judged += 1;
                let deadline = pod.deadline_at_least().unwrap_or(u64::MAX);
                let allowed = pod.allowed_ns.unwrap_or(u64::MAX).min(deadline);
                if ran + STAMP_SLACK_NS < allowed {
                    self.tally.early_releases += 1;
                    println!(
                        "VIOLATION early release: {} ({:?} pid namespace): app {pid} ran {:?} before its proxy was \
                         ready, its pod let it go or its app's start plus its hold timeout",
                        pod.name(),
                        pod.pidns,
                        Duration::from_nanos(allowed - ran),
                    );
                } else if pod.allowed_ns.is_none_or(|a| a > deadline) {
                    self.tally.deadline_releases += 1;
                }
            }
        }
    }

    /// Waits `d`, looking at the held apps every 50 ms.
    fn wait_observing(&mut self, d: Duration, agent: Option<&Agent>) {
        let end = Instant::now() + d;
        while Instant::now() < end {
            self.observe(agent);
            std::thread::sleep(Duration::from_millis(50).min(end.saturating_duration_since(Instant::now())));
        }
    }

    /// Quits that reached a pod's proxy before its app ended (or with no end at all).
    fn count_early_quits(&mut self, i: usize) {
        let pod = &self.pods[i];
        let quits = pod.job.loopback_quits();
        self.tally.quits += quits.len();
        let early: Vec<u64> = quits.iter().map(|q| q.mono_ns).filter(|&t| pod.ended_ns.is_none_or(|e| t < e)).collect();
        if !early.is_empty() {
            self.tally.early_quits += early.len();
            println!(
                "VIOLATION early quit: {} ({:?} pid namespace): {} quit(s) before the app's end (app ended: {})",
                pod.name(),
                pod.pidns,
                early.len(),
                pod.ended_ns.is_some()
            );
        }
    }

    /// Retires pods that are done with, or old: their processes are killed and their objects
    /// deleted, as the kubelet and the Job controller would.
    fn retire(&mut self, all: bool) {
        let mut i = 0;
        while i < self.pods.len() {
            let pod = &self.pods[i];
            let done = all
                || pod.deleted
                || !pod.labelled
                || pod.failed
                || pod.age >= MAX_AGE
                || (pod.ended_ns.is_some() && !pod.proxy_alive());
            if !done {
                i += 1;
                continue;
            }
            self.count_early_quits(i);
            let pod = self.pods.swap_remove(i);
            let (name, deleted) = (pod.name().to_owned(), pod.deleted);
            drop(pod);
            if !deleted {
                let _ = self.node.api.delete_pod("jobs", &name);
            }
        }
    }
}

#[test]
fn agent_killed_at_random_moments_leaves_no_app_stopped_no_quit_early_or_late_and_no_false_condition() {
    let kills = env_u64("VALET_CHAOS_KILLS").unwrap_or(25) as usize;
    let seed = env_u64("VALET_CHAOS_SEED").unwrap_or_else(|| {
        let mut b = [0u8; 8];
        valet_sim::util::random_bytes(&mut b);
        u64::from_le_bytes(b)
    });
    println!("chaos: seed {seed} (VALET_CHAOS_SEED={seed} replays its choices), {kills} kills");
    let node = Node::new().expect("node");
    let cgroup_root = valet_agent::cgroup::root::find_cgroup2_root(None, Path::new("/proc")).expect("the cgroup2 root");
    let special_every = env_u64("VALET_CHAOS_SPECIAL_EVERY").unwrap_or(6).max(2) as usize;
    let backoff = Duration::from_millis(env_u64("VALET_CHAOS_BACKOFF_MS").unwrap_or(1000));
    let mut chaos = Chaos {
        node: &node,
        rng: Rng(seed),
        pods: Vec::new(),
        tally: Tally::default(),
        cgroup_root,
        serial: 0,
        kills,
        offset: realtime_offset_ns(),
        agent_args: Vec::new(),
        old_pin_dirs: Vec::new(),
    };
    let started = Instant::now();
    // The DaemonSet pod's second container, beside every agent.
    let mut keeper = node.start_deadline_keeper().expect("the deadline keeper");
    let mut agent = chaos.restart().0;
    let mut turn = 0usize;
    let mut progress = 0;
    // Every kind of special disruption comes at least once, however few the kills.
    while chaos.tally.kills < kills || turn < SPECIALS * special_every {
        chaos.retire(false);
        let want = POPULATION.0 + chaos.rng.below((POPULATION.1 - POPULATION.0 + 1) as u64) as usize;
        while chaos.pods.len() < want {
            chaos.new_pod();
        }
        let ended = chaos.advance();
        // Right after the turn (a quit, a release or a condition write in flight), or later.
        let delay = match chaos.rng.below(3) {
            0 if ended => Duration::ZERO,
            0 | 1 => chaos.rng.millis(20),
            _ => chaos.rng.millis(400),
        };
        std::thread::sleep(delay);
        chaos.observe(Some(&agent));
        turn += 1;
        // In turn: an outage, a crash loop, an uninstall, an upgrade, a full record map, every
        // `special_every` turns.
        let special = if turn.is_multiple_of(special_every) { (turn / special_every - 1) % SPECIALS } else { SPECIALS };
        if special == 2 {
            keeper = chaos.uninstall(&mut agent, &mut keeper);
            chaos.tally.kills += 1;
        } else if special == 3 {
            keeper = chaos.upgrade(&mut agent, &mut keeper);
            chaos.tally.kills += 1;
        } else {
            let killed_ns = monotonic_ns();
            agent.stop(libc::SIGKILL, GUARD).expect("kill the agent");
            chaos.count_in_flight(killed_ns);
            chaos.tally.kills += 1;
            let kind = DISRUPTIONS[chaos.tally.kills % DISRUPTIONS.len()];
            chaos.disrupt(kind);
        }
        let wait = chaos.rng.millis(200);
        chaos.wait_observing(wait, None);
        if special == 1 {
            chaos.crash_loop(backoff);
        }
        let (restarted, ready_at, ready_ns) = if special == 0 { chaos.restart_into_outage() } else { chaos.restart() };
        agent = restarted;
        chaos.observe(Some(&agent));
        for pod in &mut chaos.pods {
            pod.age += 1;
        }
        chaos.check(&agent, ready_at, ready_ns);
        if special == 4 {
            chaos.fill_record_map();
        }
        chaos.observe(Some(&agent));
        // A kill during startup makes two in one turn: a line per 25 crossed.
        if chaos.tally.kills / 25 > progress {
            progress = chaos.tally.kills / 25;
            println!("chaos: {} kills, {:?}", chaos.tally.kills, started.elapsed());
        }
    }
    // The holds still open run to their deadline (or their pod's end) before the final count.
    let last = chaos.pods.iter().filter_map(|p| p.deadline_at_least()).max().unwrap_or(0);
    let left = Duration::from_nanos(last.saturating_sub(monotonic_ns())) + DEADLINE_WITHIN;
    chaos.wait_observing(left.min(Duration::from_secs(12)), Some(&agent));
    chaos.retire(true);
    drop(agent);
    drop(keeper);
    for dir in &chaos.old_pin_dirs {
        let _ = std::fs::remove_file(dir.join(PIN_HELD_V1));
        let _ = std::fs::remove_dir(dir);
    }

    let t = &chaos.tally;
    let mut startups = t.startups.clone();
    startups.sort_unstable();
    let held_kinds = |k: Pidns| {
        DISRUPTIONS
            .iter()
            .map(|d| format!("{d:?} {}", t.disrupted_held.iter().filter(|(x, p)| x == d && *p == k).count()))
            .collect::<Vec<_>>()
            .join(", ")
    };
    println!(
        "chaos: seed {seed}: {} kills ({} during startup), {} restarts, {} pods, {:?}; agent ready {:?} after its \
         start (median), {:?} (slowest)",
        t.kills,
        t.startup_kills,
        t.restarts,
        t.pods,
        started.elapsed(),
        startups.get(startups.len() / 2).copied().unwrap_or_default(),
        startups.last().copied().unwrap_or_default(),
    );
    println!(
        "chaos: at the kills: apps held {} in their own pid namespace, {} in a shared one; {} quits and {} \
         ProxyReady True writes owed; while the agent was down: {}; of them to pods of held apps, in their own \
         pid namespace: {}; in a shared one: {}",
        t.held_at_kill[0],
        t.held_at_kill[1],
        t.quits_in_flight,
        t.conditions_in_flight,
        DISRUPTIONS.iter().map(|d| format!("{d:?} {}", t.disrupted[*d as usize])).collect::<Vec<_>>().join(", "),
        held_kinds(Pidns::Own),
        held_kinds(Pidns::Shared)
    );
    println!(
        "apps left stopped or frozen 2 s after the agent was back: {} (of {} that should run)",
        t.left_stopped, t.should_run
    );
    println!("quits sent before an app's end: {} (of {} quits)", t.early_quits, t.quits);
    println!("finished Jobs not quit within 1 s of the agent's restart: {} (of {} owed)", t.late_quits, t.owed_quits);
    println!("conditions left saying something false: {} (of {} checked)", t.false_conditions, t.conditions_checked);
    println!(
        "apps left stopped more than 2 s past their deadline: {} (of {} held apps whose deadline was read)",
        t.past_deadline, t.deadlines_known
    );
    println!(
        "early releases: {} (of {} releases judged; {} of them at the deadline)",
        t.early_releases, t.releases_judged, t.deadline_releases
    );
    println!(
        "apps left stopped by an uninstall: {} (of {} held at {} uninstalls); {} restarts into a {OUTAGE:?} API \
         outage, {} crash loops (backoff unit {backoff:?})",
        t.left_by_uninstall, t.held_at_uninstall, t.uninstalls, t.outages, t.crash_loops
    );
    println!(
        "upgrades across a record format and pin directory change: {} ({} records carried over); full record \
         maps: {} ({} apps started into one, {} ran unheld; not cleared: {}); apps stopped with no record: {}",
        t.upgrades,
        t.upgraded_records,
        t.map_fills,
        t.started_into_full_map,
        t.ran_unheld,
        t.full_map_kept,
        t.held_without_record
    );
    assert_eq!(
        (
            t.left_stopped,
            t.early_quits,
            t.late_quits,
            t.false_conditions,
            t.past_deadline,
            t.early_releases,
            t.left_by_uninstall,
            t.held_without_record,
            t.full_map_kept
        ),
        (0, 0, 0, 0, 0, 0, 0, 0, 0),
        "seed {seed}: every count must be 0 (stopped, early quits, late quits, false conditions, past deadline, early \
         releases, left by an uninstall, held without a record, full map kept)"
    );
    assert!(
        t.upgraded_records > 0 && t.started_into_full_map > 0,
        "an upgrade carried a record over and an app started into a full map"
    );
    // The run covered what it claims to: held apps of both kinds at the kills.
    assert!(t.held_at_kill[0] > 0 && t.held_at_kill[1] > 0, "seed {seed}: held apps of both kinds were killed over");
}
