use std::path::Path;
use std::process::Command;

use anyhow::{Context as _, Result, bail};
use valet_agent::kernel::{Attach, Programs};
use valet_common::watch_flags;
use valet_tests::cgroups::TestCgroups;

#[allow(clippy::wildcard_imports, reason = "the bench's parts share one namespace")]
use super::*;

/// Ids of the loaded BPF programs whose name starts with `valet_`.
fn valet_program_ids() -> std::collections::HashSet<u32> {
    aya::programs::loaded_programs()
        .flatten()
        .filter(|info| info.name_as_str().is_some_and(|n| n.starts_with("valet_")))
        .map(|info| info.id())
        .collect()
}

/// Sum of `run_time_ns` and `run_cnt` over the programs among `ours` whose name starts with
/// `prefix`. Only the bench's own: the tracepoints are the whole host's, and another agent's
/// programs on this host (a test run beside the bench) run on the same exits and may come and go
/// between two reads.
pub(crate) fn program_stats(ours: &std::collections::HashSet<u32>, prefix: &str) -> (u64, u64) {
    let mut time = 0u64;
    let mut count = 0u64;
    for info in aya::programs::loaded_programs().flatten() {
        if ours.contains(&info.id()) && info.name_as_str().is_some_and(|n| n.starts_with(prefix)) {
            time += info.run_time().as_nanos() as u64;
            count += info.run_count();
        }
    }
    (time, count)
}

/// Runs `storm` (its rate) and what the programs among `ours` named `prefixes` ran meanwhile: for
/// each, its run time (ns) and run count ([`program_stats`] before and after).
fn programs_during<const N: usize>(
    ours: &std::collections::HashSet<u32>,
    prefixes: [&str; N],
    storm: impl FnOnce() -> Result<f64>,
) -> Result<(f64, [(u64, u64); N])> {
    let before = prefixes.map(|p| program_stats(ours, p));
    let rate = storm()?;
    let mut ran = prefixes.map(|p| program_stats(ours, p));
    for ((time, count), (t0, c0)) in ran.iter_mut().zip(before) {
        *time -= t0;
        *count -= c0;
    }
    Ok((rate, ran))
}

/// A program's ns per run, from its run time and run count.
fn per_run((time, count): (u64, u64)) -> f64 {
    time as f64 / count.max(1) as f64
}

/// Runs the forker for `ms` in `cgroup` (None: the bench's own cgroup); exits per second.
pub(crate) fn fork_rate(cgroups: &TestCgroups, cgroup: Option<&str>, ms: u64) -> Result<f64> {
    spawn_rate(cgroups, cgroup, ms, None)
}

/// The program each child of the exec storm runs: a build's shell step at its smallest.
const EXEC_PROGRAM: &str = "/bin/true";

/// Runs the forker for `ms` in `cgroup`, each child exec'ing `exec` if given; processes per second.
pub(crate) fn spawn_rate(cgroups: &TestCgroups, cgroup: Option<&str>, ms: u64, exec: Option<&str>) -> Result<f64> {
    counted_rate(cgroups, cgroup, ms, "valet-bench-forker", exec)
}

/// Runs the connection storm (`valet-bench-connector`, 2 client threads) for `ms` in `cgroup`
/// (None: the bench's own cgroup); connections per second.
pub(crate) fn connect_rate(cgroups: &TestCgroups, cgroup: Option<&str>, ms: u64) -> Result<f64> {
    counted_rate(cgroups, cgroup, ms, "valet-bench-connector", None)
}

/// Runs `program <ms> 2 <count-file> [extra]` (2 workers) in `cgroup` (None: the bench's own
/// cgroup) and reads the count it wrote: its rate per second. A program that failed is an error.
fn counted_rate(
    cgroups: &TestCgroups,
    cgroup: Option<&str>,
    ms: u64,
    program: &str,
    extra: Option<&str>,
) -> Result<f64> {
    let path = bin(program)?;
    let out = std::env::temp_dir().join(format!("{program}-{}.count", std::process::id()));
    let mut cmd = Command::new(&path);
    cmd.args([&ms.to_string(), "2", out.to_str().context("path")?]);
    cmd.args(extra);
    let mut child = match cgroup {
        Some(rel) => cgroups.spawn_in(rel, &mut cmd)?,
        None => cmd.spawn()?,
    };
    let status = child.wait()?;
    if !status.success() {
        bail!("{program} failed: {status}");
    }
    let n: f64 = std::fs::read_to_string(&out)?.trim().parse()?;
    let _ = std::fs::remove_file(&out);
    Ok(n / (ms as f64 / 1000.0))
}

/// 6. What the kernel programs cost each exit, from the kernel's own BPF statistics.
pub(crate) fn kernel_cost(table: &mut Table) -> Result<()> {
    println!(
        "\n[6] cost of the exit, exec and listen programs per exit, exec and TCP state change (kernel.bpf_stats_enabled: run_time_ns ÷ run_cnt)"
    );
    // Keeps the kernel's statistics on while held (as sysctl kernel.bpf_stats_enabled=1).
    let _stats = aya::sys::enable_stats(aya::sys::Stats::RunTime).context("enable BPF run-time statistics")?;
    let costs = measure_costs()?;
    print_costs(&costs);
    cost_rows(&costs, table);
    Ok(())
}

/// [6]'s figures: each program's ns per run outside and inside a watched (held) pod, and the
/// storms' rates with the programs attached and detached (the reference: before and after).
#[derive(Clone, Copy)]
struct Costs {
    outside_ns: f64,
    inside_ns: f64,
    outside_rate: f64,
    inside_rate: f64,
    reference: f64,
    exec_outside_ns: f64,
    exec_inside_ns: f64,
    exec_exit_ns: f64,
    exec_outside_rate: f64,
    exec_inside_rate: f64,
    exec_reference: f64,
    connect_outside_ns: f64,
    connect_inside_ns: f64,
    per_connection: f64,
    connect_outside_rate: f64,
    connect_inside_rate: f64,
    connect_reference: f64,
}

/// Loads the programs beside 110 watched pods and runs the fork, exec and connection storms
/// outside and inside a watched pod, and detached before and after.
fn measure_costs() -> Result<Costs> {
    let mut cgroups = TestCgroups::new()?;
    let pod = format!("kubepods/besteffort/pod{}", valet_sim::util::uuid_v4());
    let container = format!("{pod}/{}", "cd".repeat(32));
    cgroups.create(&pod)?;
    cgroups.create(&container)?;
    // A pod that holds its app: the listen program looks for listens there.
    let held = format!("kubepods/besteffort/pod{}", valet_sim::util::uuid_v4());
    let held_container = format!("{held}/{}", "ef".repeat(32));
    cgroups.create(&held)?;
    cgroups.create(&held_container)?;
    let ms = 3000;
    let detached = fork_rate(&cgroups, None, ms)?;
    let detached_exec = spawn_rate(&cgroups, None, ms, Some(EXEC_PROGRAM))?;
    let detached_connect = connect_rate(&cgroups, None, ms)?;
    let others = valet_program_ids();
    let mut programs = Programs::load(Path::new("/"), Attach::default())?;
    let ours: std::collections::HashSet<u32> = valet_program_ids().difference(&others).copied().collect();
    println!("  {} programs of the bench's own; {} other valet programs loaded on this host", ours.len(), others.len());
    for id in 0..110u64 {
        programs.watch(u64::MAX - id, watch_flags::EXITS | watch_flags::HOLD)?;
    }
    programs.watch(cgroups.id(&pod)?, watch_flags::EXITS)?;
    programs.watch(cgroups.id(&held)?, watch_flags::EXITS | watch_flags::HOLD)?;
    let measure = |cgroup: Option<&str>| -> Result<(f64, f64)> {
        let (rate, [exit]) = programs_during(&ours, ["valet_exit"], || fork_rate(&cgroups, cgroup, ms))?;
        Ok((rate, per_run(exit)))
    };
    let (outside_rate, outside_ns) = measure(None)?;
    let (inside_rate, inside_ns) = measure(Some(&container))?;
    // The exec storm: every child execs, as a build Job's shell steps and compilers do; the exec
    // program's cost per exec (it looks for a container's first exec) and the exit program's.
    let measure_exec = |cgroup: Option<&str>| -> Result<(f64, f64, f64)> {
        let (rate, [exec, exit]) = programs_during(&ours, ["valet_exec", "valet_exit"], || {
            spawn_rate(&cgroups, cgroup, ms, Some(EXEC_PROGRAM))
        })?;
        Ok((rate, per_run(exec), per_run(exit)))
    };
    let (exec_outside_rate, exec_outside_ns, _) = measure_exec(None)?;
    let (exec_inside_rate, exec_inside_ns, exec_exit_ns) = measure_exec(Some(&container))?;
    // The connection storm: every TCP state change (a connect, its accept, the resets) runs the
    // listen program, which reads the new state and leaves unless it is LISTEN.
    let measure_connect = |cgroup: Option<&str>| -> Result<(f64, f64, f64)> {
        let (rate, [listen]) = programs_during(&ours, ["valet_listen"], || connect_rate(&cgroups, cgroup, ms))?;
        Ok((rate, per_run(listen), listen.1 as f64 / (rate * ms as f64 / 1000.0).max(1.0)))
    };
    let (connect_outside_rate, connect_outside_ns, per_connection) = measure_connect(None)?;
    let (connect_inside_rate, connect_inside_ns, _) = measure_connect(Some(&held_container))?;
    drop(programs);
    let detached_again = fork_rate(&cgroups, None, ms)?;
    let reference = (detached + detached_again) / 2.0;
    let exec_reference = (detached_exec + spawn_rate(&cgroups, None, ms, Some(EXEC_PROGRAM))?) / 2.0;
    let connect_reference = (detached_connect + connect_rate(&cgroups, None, ms)?) / 2.0;
    Ok(Costs {
        outside_ns,
        inside_ns,
        outside_rate,
        inside_rate,
        reference,
        exec_outside_ns,
        exec_inside_ns,
        exec_exit_ns,
        exec_outside_rate,
        exec_inside_rate,
        exec_reference,
        connect_outside_ns,
        connect_inside_ns,
        per_connection,
        connect_outside_rate,
        connect_inside_rate,
        connect_reference,
    })
}

/// Prints [6]'s figures.
fn print_costs(costs: &Costs) {
    let Costs {
        outside_ns,
        inside_ns,
        outside_rate,
        inside_rate,
        reference,
        exec_outside_ns,
        exec_inside_ns,
        exec_exit_ns,
        exec_outside_rate,
        exec_inside_rate,
        exec_reference,
        connect_outside_ns,
        connect_inside_ns,
        per_connection,
        connect_outside_rate,
        connect_inside_rate,
        connect_reference,
    } = *costs;
    println!(
        "  TCP state changes, connection storm outside / inside a held pod: {connect_outside_ns:.0} / \
         {connect_inside_ns:.0} ns per change (listen program), {per_connection:.1} changes per connection"
    );
    println!(
        "  connect+accept+reset loop, 2 threads: detached {connect_reference:.0}/s, attached {connect_outside_rate:.0}/s \
         outside and {connect_inside_rate:.0}/s inside a held pod (ratio {:.3} / {:.3})",
        connect_outside_rate / connect_reference,
        connect_inside_rate / connect_reference
    );
    println!("  execs outside watched pods: {exec_outside_ns:>6.0} ns per exec (exec program)");
    println!(
        "  execs inside a watched pod:  {exec_inside_ns:>6.0} ns per exec (exec program), {exec_exit_ns:.0} ns per exit"
    );
    println!(
        "  fork+exec {EXEC_PROGRAM} loop, 2 processes: detached {exec_reference:.0}/s, attached {exec_outside_rate:.0}/s \
         outside and {exec_inside_rate:.0}/s inside a watched pod (ratio {:.3} / {:.3})",
        exec_outside_rate / exec_reference,
        exec_inside_rate / exec_reference
    );
    println!("  exits outside watched pods (110 pods watched): {outside_ns:>6.0} ns per exit");
    println!("  exits inside a watched pod (filtered there):   {inside_ns:>6.0} ns per exit");
    println!(
        "  fork+_exit loop, 2 processes: detached {reference:.0}/s, attached {outside_rate:.0}/s outside and \
         {inside_rate:.0}/s inside a watched pod (ratio {:.3} / {:.3})",
        outside_rate / reference,
        inside_rate / reference
    );
}

/// [6]'s rows.
fn cost_rows(costs: &Costs, table: &mut Table) {
    let Costs {
        outside_ns,
        inside_ns,
        outside_rate,
        inside_rate,
        reference,
        exec_outside_ns,
        exec_inside_ns,
        exec_exit_ns,
        exec_outside_rate,
        exec_inside_rate,
        exec_reference,
        connect_outside_ns,
        connect_inside_ns,
        per_connection,
        connect_outside_rate,
        connect_inside_rate,
        connect_reference,
    } = *costs;
    table.add(
        "[6] exit program per exit, outside / inside a watched pod (BPF stats)",
        format!("{outside_ns:.0} / {inside_ns:.0} ns"),
        "—",
        "—",
        "—".into(),
    );
    table.add(
        "[6] tight fork+_exit loop (2 processes), programs attached: outside / inside a watched pod",
        format!("{outside_rate:.0} / {inside_rate:.0} exits/s"),
        &format!("detached {reference:.0} exits/s"),
        "—",
        format!("{:.3} / {:.3} of detached", outside_rate / reference, inside_rate / reference),
    );
    table.add(
        "[6] exec program per exec, outside / inside a watched pod (BPF stats, fork+exec storm)",
        format!("{exec_outside_ns:.0} / {exec_inside_ns:.0} ns"),
        "—",
        "—",
        format!("the exit program in the same storm: {exec_exit_ns:.0} ns per exit"),
    );
    table.add(
        &format!("[6] fork+exec {EXEC_PROGRAM} storm (2 processes), programs attached: outside / inside a watched pod"),
        format!("{exec_outside_rate:.0} / {exec_inside_rate:.0} execs/s"),
        &format!("detached {exec_reference:.0} execs/s"),
        "—",
        format!("{:.3} / {:.3} of detached", exec_outside_rate / exec_reference, exec_inside_rate / exec_reference),
    );
    table.add(
        "[6] listen program per TCP state change, connection storm outside / inside a held pod (BPF stats)",
        format!("{connect_outside_ns:.0} / {connect_inside_ns:.0} ns"),
        "—",
        "—",
        format!("{per_connection:.1} state changes per connection"),
    );
    table.add(
        "[6] connect+accept+reset storm on 127.0.0.1 (2 threads), programs attached: outside / inside a held pod",
        format!("{connect_outside_rate:.0} / {connect_inside_rate:.0} connections/s"),
        &format!("detached {connect_reference:.0} connections/s"),
        "—",
        format!(
            "{:.3} / {:.3} of detached",
            connect_outside_rate / connect_reference,
            connect_inside_rate / connect_reference
        ),
    );
}
