use std::path::Path;
use std::process::Command;

use anyhow::{Context as _, Result};
use valet_agent::kernel::{Attach, Programs};
use valet_common::watch_flags;
use valet_tests::cgroups::TestCgroups;

#[allow(clippy::wildcard_imports)]
use super::*;

/// Sum of `run_time_ns` and `run_cnt` over the loaded programs named `valet_exit*`.
pub(crate) fn exit_program_stats() -> (u64, u64) {
    let mut time = 0u64;
    let mut count = 0u64;
    for info in aya::programs::loaded_programs().flatten() {
        if info.name_as_str().is_some_and(|n| n.starts_with("valet_exit")) {
            time += info.run_time().as_nanos() as u64;
            count += info.run_count();
        }
    }
    (time, count)
}

/// Runs the forker for `ms` in `cgroup` (None: the bench's own cgroup); exits per second.
pub(crate) fn fork_rate(cgroups: &TestCgroups, cgroup: Option<&str>, ms: u64) -> Result<f64> {
    let forker = bin("valet-bench-forker")?;
    let out = std::env::temp_dir().join(format!("valet-forks-{}", std::process::id()));
    let mut cmd = Command::new(&forker);
    cmd.args([&ms.to_string(), "2", out.to_str().context("path")?]);
    let mut child = match cgroup {
        Some(rel) => cgroups.spawn_in(rel, &mut cmd)?,
        None => cmd.spawn()?,
    };
    child.wait()?;
    let n: f64 = std::fs::read_to_string(&out)?.trim().parse()?;
    let _ = std::fs::remove_file(&out);
    Ok(n / (ms as f64 / 1000.0))
}

/// 6. What the kernel programs cost each exit, from the kernel's own BPF statistics.
pub(crate) fn kernel_cost(table: &mut Table) -> Result<()> {
    println!("\n[6] cost of the exit program per process exit (kernel.bpf_stats_enabled: run_time_ns ÷ run_cnt)");
    // Keeps the kernel's statistics on while held (as sysctl kernel.bpf_stats_enabled=1).
    let _stats = aya::sys::enable_stats(aya::sys::Stats::RunTime).context("enable BPF run-time statistics")?;
    let mut cgroups = TestCgroups::new()?;
    let pod = format!("kubepods/besteffort/pod{}", valet_sim::util::uuid_v4());
    let container = format!("{pod}/{}", "cd".repeat(32));
    cgroups.create(&pod)?;
    cgroups.create(&container)?;
    let ms = 3000;
    let detached = fork_rate(&cgroups, None, ms)?;
    let mut programs = Programs::load(Path::new("/"), Attach::default())?;
    for id in 0..110u64 {
        programs.watch(u64::MAX - id, watch_flags::EXITS | watch_flags::HOLD)?;
    }
    programs.watch(cgroups.id(&pod)?, watch_flags::EXITS)?;
    let measure = |cgroup: Option<&str>| -> Result<(f64, f64)> {
        let (t0, c0) = exit_program_stats();
        let rate = fork_rate(&cgroups, cgroup, ms)?;
        let (t1, c1) = exit_program_stats();
        let per = (t1 - t0) as f64 / (c1 - c0).max(1) as f64;
        Ok((rate, per))
    };
    let (outside_rate, outside_ns) = measure(None)?;
    let (inside_rate, inside_ns) = measure(Some(&container))?;
    drop(programs);
    let detached_again = fork_rate(&cgroups, None, ms)?;
    let reference = (detached + detached_again) / 2.0;
    println!("  exits outside watched pods (110 pods watched): {outside_ns:>6.0} ns per exit");
    println!("  exits inside a watched pod (filtered there):   {inside_ns:>6.0} ns per exit");
    println!(
        "  fork+_exit loop, 2 processes: detached {reference:.0}/s, attached {outside_rate:.0}/s outside and \
         {inside_rate:.0}/s inside a watched pod (ratio {:.3} / {:.3})",
        outside_rate / reference,
        inside_rate / reference
    );
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
    Ok(())
}
