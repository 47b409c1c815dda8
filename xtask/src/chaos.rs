//! `cargo xtask chaos`: the crash test at full length (issues 26, 36 and 51). The agent is
//! stopped at random moments, `--kills` times (200 by default): SIGKILLed, SIGTERMed as the
//! kubelet restarts a container or rolls out its DaemonSet (with and without surge), restarted
//! by a failed liveness probe; its reads of held apps' cgroups fail for a while and held apps'
//! pids are reused; with API outages, crash loops at the kubelet's backoff, uninstalls and
//! upgrades in between. The test prints its counts (apps run before their proxy was ready, past
//! their deadline, records lost, apps left stopped, early and late quits, false conditions...)
//! and fails unless each is 0.
//! `cargo xtask test` runs the same test shortened.
use std::path::Path;

use anyhow::{Result, bail};

use crate::cmd::{build_release_bins, cargo, is_root, run};
use crate::setup;

pub(crate) const DEFAULT_KILLS: u32 = 200;

pub(crate) fn chaos(root: &Path, kills: u32, seed: Option<u64>) -> Result<()> {
    if !is_root() {
        bail!("the crash test loads eBPF programs and makes cgroups and namespaces: run it as root");
    }
    // As the demo's and the bench's: the build tools; the test suite's extras (qemu, pytest) are
    // not needed here.
    setup::setup(root, false)?;
    let release = build_release_bins(root)?;
    let mut cmd = cargo();
    cmd.current_dir(root)
        .args(["test", "-p", "valet-tests", "--test", "chaos", "--", "--nocapture"])
        .env("VALET_CHAOS_KILLS", kills.to_string())
        // The kubelet's own crash-loop backoff (10, 20, 40 s), and an outage, a crash loop and
        // an uninstall in turn every 25 turns.
        .env("VALET_CHAOS_BACKOFF_MS", "10000")
        .env("VALET_CHAOS_SPECIAL_EVERY", "25")
        .env("VALET_AGENT_BIN", release.join("valet-agent"))
        .env("VALET_STANDIN_PROXY", release.join("valet-standin-proxy"))
        // The one just built: `-p valet-tests` alone does not rebuild the debug one.
        .env("VALET_SIM_EXEC", release.join("valet-sim-exec"));
    if let Some(seed) = seed {
        cmd.env("VALET_CHAOS_SEED", seed.to_string());
    }
    run(&mut cmd)
}
