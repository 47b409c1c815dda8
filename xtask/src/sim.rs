//! `cargo xtask demo` and `cargo xtask bench`: drivers in `tests/` that run the agent against a
//! simulated node on this host.
use std::path::Path;
use std::process::Command;

use anyhow::{Result, bail};

use crate::cmd::{cargo, is_root, run};
use crate::setup;

pub fn demo(root: &Path, args: &[String]) -> Result<()> {
    if !is_root() {
        bail!("the demo creates cgroups and network namespaces: run it as root");
    }
    run_driver(root, "valet-demo", args)
}

pub fn bench(root: &Path, args: &[String]) -> Result<()> {
    if !is_root() {
        bail!("the benchmarks load eBPF programs: run them as root");
    }
    run_driver(root, "valet-bench", args)
}

fn run_driver(root: &Path, bin: &str, args: &[String]) -> Result<()> {
    setup::setup(root, false)?;
    run(cargo().current_dir(root).args([
        "build",
        "--release",
        "-p",
        "valet-agent",
        "-p",
        "valet-tests",
        "-p",
        "valet-sim",
    ]))?;
    let release = root.join("target/release");
    run(Command::new(release.join(bin))
        .args(args)
        .env("VALET_AGENT_BIN", release.join("valet-agent"))
        .env("VALET_STANDIN_PROXY", release.join("valet-standin-proxy")))
}
