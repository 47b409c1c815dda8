//! `cargo xtask bench`: valet's performance figures, each beside its reference measured in the same
//! run and its target, printed as one table at the end (figures are printed, never asserted).
//!
//! 1. kernel → user latency of an exit event;
//! 3. app exit → quit received by the stand-in proxy for a 0.3 s Job, valet vs an in-pod wrapper
//!    (waitpid, then POST), and the stand-in's own part of each;
//! 4. proxy ready → held app released, valet vs Istio's `pilot-agent wait` poller; 4s. the same
//!    on a saturated node (a busy loop on every CPU beside it);
//! 5. a watched pod forking short processes as fast as the machine allows: container ends lost,
//!    exit → quit and pod-watch latency during the storm and without it, and an app that ends
//!    while the agent is stalled (SIGSTOP) in the middle of the storm;
//! 6. the exit program's own cost per exit, from the kernel's BPF statistics, and a tight exit
//!    loop's rate with and without the programs;
//! 7. 20 pods held at once, in rounds: release latency and the agent's CPU while it probes them;
//! 8. a full node: 110 opted-in pods tracked, 50 Jobs started within one second: RSS, idle CPU,
//!    exit → quit of the 50 beside as many Jobs under the in-pod wrapper in the same kind of burst
//!    on the same node, pod-watch latency;
//! 9. soak: 10,000 short Jobs through one node in batches: RSS, open fds and kernel map entries at
//!    the start and the end;
//! 10. observe mode on a full node: 110 pods, a tenth opted in and the rest only observed, every
//!     app running: RSS and idle CPU against [8]'s targets;
//! 11. the API's bill, from the fake API server's counters: requests, bytes and watch events per
//!     Job (labelled and unlabelled) beside the kubelet's, per node-hour at rest with a full node,
//!     and for an agent's restart (its re-list read from the watch cache or from etcd);
//! 12. a node at 250 pods (the most some providers allow), all opted in: RSS and idle CPU;
//! 13. a rollout's gap: apps started while one agent gives way to the next, without and with
//!     surge, and which of them ran unheld.
//!
//! `--quick` runs every section small (a smoke test for CI, not figures for the README).
//! Pods run on the simulated node's kubelet as unhelpful as a real one (container ids and exits
//! reach the API about a second late; bundles and cgroups go at exit).
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail};

mod bill;
mod exit;
mod kernel;
mod node;
mod pods;
mod procfs;
mod quit;
mod release;
mod rollout;
mod round_cpu;
mod saturated;
mod soak;
mod stall;
mod storm;
mod table;
mod together;
mod wide;

#[allow(clippy::wildcard_imports, reason = "the bench's parts share one namespace")]
pub(crate) use bill::*;
#[allow(clippy::wildcard_imports, reason = "the bench's parts share one namespace")]
pub(crate) use exit::*;
#[allow(clippy::wildcard_imports, reason = "the bench's parts share one namespace")]
pub(crate) use kernel::*;
#[allow(clippy::wildcard_imports, reason = "the bench's parts share one namespace")]
pub(crate) use node::*;
#[allow(clippy::wildcard_imports, reason = "the bench's parts share one namespace")]
pub(crate) use pods::*;
#[allow(clippy::wildcard_imports, reason = "the bench's parts share one namespace")]
pub(crate) use procfs::*;
#[allow(clippy::wildcard_imports, reason = "the bench's parts share one namespace")]
pub(crate) use quit::*;
#[allow(clippy::wildcard_imports, reason = "the bench's parts share one namespace")]
pub(crate) use release::*;
#[allow(clippy::wildcard_imports, reason = "the bench's parts share one namespace")]
pub(crate) use rollout::*;
#[allow(clippy::wildcard_imports, reason = "the bench's parts share one namespace")]
pub(crate) use round_cpu::*;
pub(crate) use saturated::*;
#[allow(clippy::wildcard_imports, reason = "the bench's parts share one namespace")]
pub(crate) use soak::*;
#[allow(clippy::wildcard_imports, reason = "the bench's parts share one namespace")]
pub(crate) use stall::*;
#[allow(clippy::wildcard_imports, reason = "the bench's parts share one namespace")]
pub(crate) use storm::*;
#[allow(clippy::wildcard_imports, reason = "the bench's parts share one namespace")]
pub(crate) use table::*;
#[allow(clippy::wildcard_imports, reason = "the bench's parts share one namespace")]
pub(crate) use together::*;
#[allow(clippy::wildcard_imports, reason = "the bench's parts share one namespace")]
pub(crate) use wide::*;

pub(crate) const SECTIONS: &str =
    "exit|quit|release|saturated|storm|kernel|together|node|soak|observe|bill|wide|rollout";

pub(crate) struct Args {
    pub(crate) runs: Option<usize>,
    pub(crate) soak: Option<usize>,
    pub(crate) quick: bool,
    pub(crate) only: Option<String>,
    /// Where to write the figures table (Markdown), also spliced into the docs that include it.
    pub(crate) table: Option<PathBuf>,
}

pub(crate) fn parse_args() -> Result<Args> {
    let mut args = Args { runs: None, soak: None, quick: false, only: None, table: None };
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--runs" => args.runs = Some(it.next().context("--runs N")?.parse()?),
            "--soak" => args.soak = Some(it.next().context("--soak JOBS")?.parse()?),
            "--quick" => args.quick = true,
            "--table" => args.table = Some(it.next().context("--table FILE")?.into()),
            "--only" => {
                let only = it.next().context(SECTIONS)?;
                if let Some(bad) = only.split(',').find(|o| !SECTIONS.split('|').any(|s| s == *o)) {
                    bail!("--only {bad}: one of {SECTIONS} (several: comma-separated)");
                }
                args.only = Some(only);
            }
            "-h" | "--help" => {
                println!("valet-bench [--quick] [--runs N] [--soak JOBS] [--only {SECTIONS}] [--table FILE]");
                std::process::exit(0);
            }
            other => bail!("unknown argument {other}"),
        }
    }
    Ok(args)
}

/// How big each section is: the full run (about 15 minutes on 2 cores) or `--quick`.
pub(crate) struct Plan {
    pub(crate) quick: bool,
    /// Pods per side in [3].
    pub(crate) runs: usize,
    /// The fork storm's length and the agent stall in it.
    pub(crate) storm: Duration,
    pub(crate) stall: Duration,
    /// Container ends while the agent is stopped.
    pub(crate) stall_ends: usize,
    /// Other Jobs during the storm.
    pub(crate) storm_jobs: usize,
    /// [8]: long-running pods, and Jobs started within one second beside them.
    pub(crate) services: usize,
    pub(crate) jobs: usize,
    /// [8]: how long the agent's idle CPU is measured.
    pub(crate) idle: Duration,
    /// [4]: held pods per variant, and the reference's (`--runs` sets it too).
    pub(crate) release_runs: usize,
    /// [8]: repetitions of the two bursts (the wrapper's, then valet's).
    pub(crate) node_reps: usize,
    /// [9]: Jobs in all, and per batch.
    pub(crate) soak: usize,
    pub(crate) batch: usize,
}

impl Plan {
    pub(crate) fn new(args: &Args) -> Plan {
        let mut plan = if args.quick {
            Plan {
                quick: true,
                runs: 20,
                storm: Duration::from_secs(40),
                stall: Duration::from_secs(4),
                stall_ends: 20,
                storm_jobs: 5,
                services: 20,
                jobs: 10,
                idle: Duration::from_secs(8),
                node_reps: 2,
                release_runs: 10,
                soak: 200,
                batch: 50,
            }
        } else {
            Plan {
                quick: false,
                runs: 60,
                storm: Duration::from_secs(120),
                stall: Duration::from_secs(8),
                stall_ends: 200,
                storm_jobs: 20,
                services: 60,
                jobs: 50,
                idle: READY_PROBE_INTERVAL,
                node_reps: 10,
                release_runs: 50,
                soak: 10_000,
                batch: 50,
            }
        };
        if let Some(runs) = args.runs {
            plan.runs = runs;
            plan.release_runs = runs;
        }
        if let Some(soak) = args.soak {
            plan.soak = soak;
        }
        plan
    }
}

pub(crate) fn bin(name: &str) -> Result<std::path::PathBuf> {
    let exe = std::env::current_exe()?;
    let p = exe.parent().context("exe dir")?.join(name);
    if !p.is_file() {
        bail!("{} missing: build with `cargo build --release -p valet-tests`", p.display());
    }
    Ok(p)
}

/// Whether `pid` is stopped (state `T`): held by the kernel before its first instruction.
pub(crate) fn stopped(pid: u32) -> bool {
    valet_tests::harness::process_state(pid) == Some('T')
}

pub(crate) fn read_stamp(path: &Path) -> Option<u64> {
    stamp_field(path, 0)
}

/// The CPU time (ns) an app started with `cpu` wrote beside its stamp ([`read_stamp`]).
pub(crate) fn read_stamp_cpu(path: &Path) -> Option<u64> {
    stamp_field(path, 1)
}

fn stamp_field(path: &Path, field: usize) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.lines().next()?.split_whitespace().nth(field)?.parse().ok()
}

/// How long the Job's app runs in [3] and [5]: a short Job, over before the API names it.
pub(crate) const JOB_MS: &str = "300";

/// The in-pod wrapper's arguments before the app's command: the port and path it POSTs to once
/// the app exited (Istio's quit endpoint).
pub(crate) const WRAPPER_ARGS: [&str; 3] = ["15020", "/quitquitquit", "--"];

/// The agent's default `--ready-probe-interval`: every pod whose proxy was seen ready is probed
/// again once per interval, all in the same round. An idle figure is measured over one whole
/// interval, so that it holds one round, as the agent's average does; a shorter window counts
/// the round's cost not at all or several times over, depending on whether a round falls in it.
pub(crate) const READY_PROBE_INTERVAL: Duration = Duration::from_secs(30);

pub(crate) use valet_test_support::free_port;

pub(crate) fn main() -> Result<()> {
    let args = parse_args()?;
    valet_tests::cgroups::require_root();
    let plan = Plan::new(&args);
    let want = |s: &str| args.only.as_deref().is_none_or(|o| o.split(',').any(|o| o == s));
    let machine = machine();
    println!("valet benchmarks{}: {machine}", if plan.quick { " (--quick: a smoke run, not figures)" } else { "" });
    let (started, machine_at_start) = (Instant::now(), MachineCpu::now());
    let mut table = Table::default();
    type Section<'a> = &'a dyn Fn(&mut Table) -> Result<()>;
    let sections: [(&str, Section); 13] = [
        ("exit", &|t| exit_latency(if plan.quick { 50 } else { 500 }, t)),
        ("quit", &|t| quit_latency(plan.runs, t)),
        ("release", &|t| release_latency(&plan, t)),
        ("saturated", &|t| saturated_release(&plan, t)),
        ("storm", &|t| storm(&plan, t)),
        ("kernel", &|t| kernel_cost(t)),
        ("together", &|t| {
            // VALET_BENCH_TOGETHER: only these rows, by hand (`110:listens`, `20:silent,110:silent`).
            let rows = std::env::var("VALET_BENCH_TOGETHER").ok();
            let want_row = |pods: usize, flip: Flip| {
                rows.as_deref().is_none_or(|r| r.split(',').any(|r| r == format!("{pods}:{}", flip.name())))
            };
            for flip in [Flip::Silent, Flip::Listens] {
                for (pods, rounds) in [(20, 20), (110, 4)] {
                    if want_row(pods, flip) {
                        held_together(pods, if plan.quick { 1 } else { rounds }, flip, t)?;
                    }
                }
            }
            Ok(())
        }),
        ("node", &|t| full_node(&plan, t)),
        ("soak", &|t| soak(&plan, t)),
        ("observe", &|t| observed_node(&plan, t)),
        ("bill", &|t| api_bill(&plan, t)),
        ("wide", &|t| widest_node(&plan, t)),
        ("rollout", &|t| rollout_gap(&plan, t)),
    ];
    for (name, section) in sections {
        if want(name) {
            let (t, cpu) = (Instant::now(), MachineCpu::now());
            section(&mut table)?;
            println!("  ({name}: {:.0} s, {})", t.elapsed().as_secs_f64(), steal_words(cpu));
        }
    }
    let took = format!("{:.0} s, {}", started.elapsed().as_secs_f64(), steal_words(machine_at_start));
    let markdown = table.markdown(&machine, &took, plan.quick, args.only.as_deref());
    println!("\n{markdown}");
    if let Some(path) = &args.table {
        write_table(path, &markdown)?;
    }
    if !table.missed.is_empty() {
        println!("targets NOT met: {}", table.missed.join("; "));
        // A smoke run's samples are too small to judge a target: only a broken measurement (an
        // error above) fails it.
        if !plan.quick {
            std::process::exit(1);
        }
    }
    Ok(())
}
