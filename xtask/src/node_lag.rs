//! `cargo xtask node --lag N`: when the runtime records a container's exit, against the kernel's
//! moment, in each cell's node VM ([`crate::node`]'s images, kernel and run script).
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};

use crate::node::{Cell, OUT, disk_and_share, in_guest, kernel_append, node_image, reported_versions, script_head};
use crate::node_images::base_images;
use crate::vm::CACHE;
use crate::vm::apt::Apt;
use crate::vm::kernel::Kernel;
use crate::vm::qemu::qemu;

/// `cargo xtask node --lag N`: when the runtime records a container's exit, against the kernel's
/// moment, in each cell's VM (tests/node/runtime_lag.py: N runs per way of quitting a native
/// sidecar, one run after the other, a VM at a time, the systemd cgroup driver). No agent, no API
/// server: only containerd through the CRI, busybox and pause images. Prints the VM's `node lag`
/// tables per cell and how long the cell took; fails when a cell's runs did not all finish.
pub(crate) fn lag(root: &Path, cells: &[Cell], runs: u32) -> Result<()> {
    if let Some(cell) = cells.iter().find(|c| c.layout == "crio") {
        bail!("--lag measures containerd's CRI: {} runs CRI-O's layout", cell.name());
    }
    let apt = Apt::new()?;
    let mut summary = Vec::new();
    let mut failed = 0;
    for cell in cells {
        let (line, finished) = lag_cell(root, &apt, *cell, runs)?;
        summary.push(line);
        failed += u32::from(!finished);
    }
    println!();
    for line in &summary {
        println!("{line}");
    }
    if failed > 0 {
        bail!("{failed} cell(s) did not finish their runs");
    }
    Ok(())
}

/// One cell's lag runs in its VM: their `node lag` lines printed; returns the cell's summary line
/// and whether every run finished.
fn lag_cell(root: &Path, apt: &Apt, cell: Cell, runs: u32) -> Result<(String, bool)> {
    let t = Instant::now();
    let busybox = apt.busybox(cell.arch)?;
    let dir = Path::new(CACHE).join(format!("run/node-lag/{}", cell.name().replace('/', "-")));
    // The cell's own (6 MB): another run may be writing the scenarios' images.
    let images = dir.join("images");
    base_images(root, apt, cell.arch, &busybox, &images)?;
    let kernel = Kernel::prepare(apt, cell.kernel_suite(), cell.arch, &busybox)?;
    let image = node_image(root, &apt.mirror, cell.suite, cell.arch)?;
    println!("node lag {}: kernel and image ready in {:.0?}", cell.name(), t.elapsed());
    let out = dir.join("out");
    if out.exists() {
        std::fs::remove_dir_all(&out)?;
    }
    std::fs::create_dir_all(&out)?;
    let script = dir.join("run.sh");
    // VALET_LAG_WAYS: only these ways of quitting (e.g. `kernel,cri`), else all three.
    let ways = std::env::var("VALET_LAG_WAYS").unwrap_or_else(|_| "kernel,status_file,cri".into());
    if !ways.split(',').all(|w| ["kernel", "status_file", "cri"].contains(&w)) {
        bail!("VALET_LAG_WAYS={ways}: a comma-separated list of kernel, status_file, cri");
    }
    let n_ways = ways.split(',').count() as u64;
    std::fs::write(
        &script,
        format!(
            "{}python3 {} {} {OUT} {runs} {ways}\n",
            script_head(cell, &kernel),
            in_guest(&root.join("tests/node/runtime_lag.py")).display(),
            in_guest(&images).display()
        ),
    )?;
    let [drive, share] = disk_and_share(&image, &out);
    // Under TCG on a loaded 2-core machine a run (two containers made, started and ended) has
    // taken up to ~10 s; a VM still running at twice that is hung.
    let deadline = Duration::from_secs(15 * 60 + u64::from(runs) * n_ways * 20);
    let vm = Instant::now();
    let (lines, killed) = qemu(
        &kernel,
        &kernel_append(cell, &script),
        &["-drive", &drive, "-virtfs", &share],
        &dir.join("console.log"),
        deadline,
    )?;
    let versions = reported_versions(&lines);
    for line in lines.iter().filter(|l| l.starts_with("node lag")) {
        println!("{line}");
    }
    let done = lines.iter().find(|l| l.starts_with("node lag done")).cloned();
    let outcome = match (&done, killed) {
        (Some(done), _) => done.trim_start_matches("node lag done: ").to_string(),
        (None, Some(killed)) => killed.to_string(),
        (None, None) => "the runs did not finish".to_string(),
    };
    let finished = done.as_deref().is_some_and(|d| d.ends_with(", 0 failed"));
    let line = format!(
        "node lag {}: {outcome} ({versions}) [VM {:.0?}, cell {:.0?}; console {}, runs {}]",
        cell.name(),
        vm.elapsed(),
        t.elapsed(),
        dir.join("console.log").display(),
        out.join("lag.jsonl").display()
    );
    Ok((line, finished))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::DEFAULT_CELL;

    #[test]
    fn lag_refuses_the_crio_layout_before_any_download() {
        let root = crate::cmd::workspace_root();
        let crio = Cell::parse("sid/crun/crio").expect("the CRI-O cell");
        let err = lag(&root, &[DEFAULT_CELL, crio], 1).expect_err("runtime_lag.py drives containerd only");
        assert!(err.to_string().contains("sid/crun/crio"), "{err}");
    }
}
