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
//! Third version (issue 51): the agent and its keeper run as the containers of a pod of the
//! agent's DaemonSet (`POD_NAME`, the DaemonSet and the pod served by the fake API), each with
//! the capabilities the manifest gives it (`setpriv`), and each turn's stop is drawn from the
//! seeded generator among: SIGKILL; a SIGTERM restart of the agent container alone (grace
//! period, then SIGKILL); a liveness restart (the agent hung half the time, SIGTERM with the
//! probe's short grace period, SIGKILL at its end); a rollout as the kubelet makes one (the old
//! pod marked for deletion, both containers SIGTERMed, SIGKILL at the grace period's end, the
//! new pod's keeper and agent 0–2 s later), and one with surge (the new pod's containers first);
//! a read fault (a held app's cgroup made unreadable to valet for up to a second, as its owner
//! may, while its proxy turns ready); pid reuse (a held app killed with its pod and its host pid
//! given to the next held app at once). Besides the counts above it counts apps run before their
//! proxy was ready (as the stand-in proxy logged its readiness, not as any record says) and
//! records lost while their app stayed stopped. The uninstall deletes the DaemonSet first.
//!
//! `VALET_CHAOS_KILLS` sets the number of disruptions (stops and faults; default 25 here;
//! `cargo xtask chaos` runs 200),
//! `VALET_CHAOS_READ_FAULTS=0` leaves the read faults out,
//! `VALET_CHAOS_SEED` replays a run's random choices (its seed is printed first; timings still
//! differ from run to run).

use std::os::unix::ffi::OsStrExt as _;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use valet_common::{HELD_CAPACITY, HeldRecord, HeldRecordV1, PIN_HELD, PIN_HELD_V1};
use valet_sim::apiserver::{Fault, Kind, Propagation};
use valet_sim::node::SpawnOptions;
use valet_sim::util::monotonic_ns;
use valet_tests::capabilities::{manifest_capabilities, with_capabilities};
use valet_tests::harness::{
    AGENT_DAEMONSET, AGENT_NAMESPACE, Agent, DeadlineKeeper, JobPod, JobSpec, Node, eventually, process_state as state,
    says_about,
};
use valet_tests::pins;

mod faults;
mod judge;
mod model;
mod run;
mod specials;
mod stops;
mod tally;

use model::*;
use run::Chaos;
use stops::{STOPS, Stop, signal};
use tally::Tally;

fn env_u64(name: &str) -> Option<u64> {
    let v = std::env::var(name).ok()?;
    Some(v.trim().parse().unwrap_or_else(|_| panic!("{name}={v:?} is not a number")))
}

/// Whether read faults are made (on unless `VALET_CHAOS_READ_FAULTS=0`).
fn read_faults() -> bool {
    env_u64("VALET_CHAOS_READ_FAULTS").unwrap_or(1) > 0
}

/// One turn: pods advance, then this turn's stop or special disruption, the agent back, the
/// counts. Returns the agent running after it.
fn turn(chaos: &mut Chaos<'_>, mut agent: Agent, special: usize, backoff: Duration) -> Agent {
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
    chaos.tally.kills += 1;
    let (ready_at, ready_ns) = match special {
        0 => {
            agent.stop(libc::SIGKILL, GUARD).expect("kill the agent");
            chaos.while_down();
            let (restarted, at, ns) = chaos.restart_into_outage();
            agent = restarted;
            (at, ns)
        }
        1..=3 => {
            match special {
                1 => {
                    agent.stop(libc::SIGKILL, GUARD).expect("kill the agent");
                    chaos.while_down();
                    chaos.crash_loop(backoff);
                }
                2 => chaos.uninstall(&mut agent),
                _ => chaos.upgrade(&mut agent),
            }
            let (restarted, at, ns) = chaos.restart();
            agent = restarted;
            (at, ns)
        }
        _ => {
            let stop = Stop::draw(&mut chaos.rng, chaos.tally.stops.iter().sum(), read_faults());
            chaos.tally.stops[stop as usize] += 1;
            stop_once(chaos, &mut agent, stop)
        }
    };
    chaos.observe(Some(&agent));
    for pod in &mut chaos.pods {
        pod.age += 1;
    }
    chaos.check(&agent, ready_at, ready_ns);
    if special == 4 {
        chaos.fill_record_map();
    }
    chaos.observe(Some(&agent));
    agent
}

/// This turn's stop or fault; the moment the agent was back (or the fault over).
fn stop_once(chaos: &mut Chaos<'_>, agent: &mut Agent, stop: Stop) -> (Instant, u64) {
    let (restarted, at, ns) = match stop {
        Stop::Kill => {
            let killed_ns = monotonic_ns();
            agent.stop(libc::SIGKILL, GUARD).expect("kill the agent");
            chaos.count_in_flight(killed_ns);
            chaos.while_down();
            chaos.restart()
        }
        Stop::Sigterm | Stop::Liveness => chaos.container_restart(agent, stop == Stop::Liveness),
        Stop::Rollout | Stop::RolloutSurge => chaos.rollout(agent, stop == Stop::RolloutSurge),
        Stop::ReadFault => return chaos.read_fault(agent),
        Stop::PidReuse => {
            chaos.pid_reuse();
            return (Instant::now(), monotonic_ns());
        }
    };
    *agent = restarted;
    (at, ns)
}

#[test]
fn agent_stopped_every_way_leaves_no_app_run_early_stopped_late_or_without_its_record() {
    let kills = env_u64("VALET_CHAOS_KILLS").unwrap_or(25) as usize;
    let seed = env_u64("VALET_CHAOS_SEED").unwrap_or_else(|| {
        let mut b = [0u8; 8];
        valet_sim::util::random_bytes(&mut b);
        u64::from_le_bytes(b)
    });
    println!("chaos: seed {seed} (VALET_CHAOS_SEED={seed} replays its choices), {kills} disruptions");
    let node = Node::new().expect("node");
    node.install_daemonset().expect("the agent's DaemonSet");
    let cgroup_root = valet_agent::cgroup::root::find_cgroup2_root(None, Path::new("/proc")).expect("the cgroup2 root");
    let special_every = env_u64("VALET_CHAOS_SPECIAL_EVERY").unwrap_or(6).max(2) as usize;
    let backoff = Duration::from_millis(env_u64("VALET_CHAOS_BACKOFF_MS").unwrap_or(1000));
    let caps = manifest_capabilities();
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
        pod: node.daemonset_pod().expect("the agent's pod"),
        keeper: None,
        agent_caps: with_capabilities(&caps[0]),
        keeper_caps: with_capabilities(&caps[1]),
    };
    let started = Instant::now();
    chaos.start_keeper();
    let mut agent = chaos.restart().0;
    let mut turns = 0usize;
    let mut progress = 0;
    // Every kind of special disruption comes at least once, however few the others.
    while chaos.tally.kills < kills || turns < SPECIALS * special_every {
        turns += 1;
        // In turn: an outage, a crash loop, an uninstall, an upgrade, a full record map, every
        // `special_every` turns.
        let special =
            if turns.is_multiple_of(special_every) { (turns / special_every - 1) % SPECIALS } else { SPECIALS };
        agent = turn(&mut chaos, agent, special, backoff);
        if chaos.tally.kills / 25 > progress {
            progress = chaos.tally.kills / 25;
            println!("chaos: {} disruptions, {:?}", chaos.tally.kills, started.elapsed());
        }
    }
    // The holds still open run to their deadline (or their pod's end) before the final count.
    let last = chaos.pods.iter().filter_map(|p| p.deadline_at_least()).max().unwrap_or(0);
    let left = Duration::from_nanos(last.saturating_sub(monotonic_ns())) + DEADLINE_WITHIN;
    chaos.wait_observing(left.min(Duration::from_secs(12)), Some(&agent));
    chaos.retire(true);
    drop(agent);
    drop(chaos.keeper.take());
    for dir in &chaos.old_pin_dirs {
        let _ = std::fs::remove_file(dir.join(PIN_HELD_V1));
        let _ = std::fs::remove_dir(dir);
    }
    let t = &chaos.tally;
    t.print(seed, started.elapsed(), backoff);
    let bad: Vec<String> = t.violations().iter().filter(|(_, n)| *n > 0).map(|(w, n)| format!("{w} {n}")).collect();
    assert!(bad.is_empty(), "seed {seed}: every count must be 0: {}", bad.join(", "));
    assert!(
        t.upgraded_records > 0 && t.started_into_full_map > 0,
        "an upgrade carried a record over and an app started into a full map"
    );
    // The run covered what it claims to: held apps of both kinds at the stops, every kind.
    assert!(t.held_at_kill[0] > 0 && t.held_at_kill[1] > 0, "seed {seed}: held apps of both kinds were stopped over");
    let came = STOPS.iter().zip(t.stops).all(|(s, n)| n > 0 || (*s == Stop::ReadFault && !read_faults()));
    assert!(came, "seed {seed}: every kind of stop came");
}
