//! `cargo xtask demo` and `cargo xtask bench`: drivers in `tests/` that run the agent against a
//! simulated node on this host.
use std::path::Path;
use std::process::Command;

use anyhow::{Result, bail};

use crate::cmd::{cargo, is_root, run};
use crate::setup;

pub(crate) fn demo(root: &Path, args: &[String]) -> Result<()> {
    if !is_root() {
        bail!("the demo creates cgroups and network namespaces: run it as root");
    }
    run_driver(root, "valet-demo", args)
}

pub(crate) fn bench(root: &Path, args: &[String]) -> Result<()> {
    if !is_root() {
        bail!("the benchmarks load eBPF programs: run them as root");
    }
    // [4] runs a real Envoy; without it a full run fails (a smoke run leaves its row out).
    if let Err(e) = setup::envoy(root) {
        eprintln!("no Envoy for the bench's [4] ({e:#}): `cargo xtask setup` installs it");
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
    // From the workspace root: `--table docs/dev/bench-table.md` names the file there.
    run(Command::new(release.join(bin))
        .current_dir(root)
        .args(args)
        .env("VALET_AGENT_BIN", release.join("valet-agent"))
        .env("VALET_STANDIN_PROXY", release.join("valet-standin-proxy")))
}
