use std::path::Path;
use std::process::Command;
use std::time::Duration;

use anyhow::{Context as _, Result};
use valet_agent::host::clock::monotonic_ns;
use valet_agent::kernel::{Attach, Event, EventStream, Programs};
use valet_common::watch_flags;
use valet_tests::cgroups::TestCgroups;

#[allow(clippy::wildcard_imports, reason = "the bench's parts share one namespace")]
use super::*;

/// 1. Exit events: kernel timestamp to user-space receipt.
pub(crate) fn exit_latency(runs: usize, table: &mut Table) -> Result<()> {
    println!("\n[1] kernel → user latency of exit events ({runs} processes)");
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
    rt.block_on(async {
        let mut programs = Programs::load(Path::new("/"), Attach { exits: true, execs: false, ..Attach::default() })?;
        let mut stream = EventStream::new(programs.take_events().context("ring")?)?;
        let mut cgroups = TestCgroups::new()?;
        let pod = format!("kubepods/besteffort/pod{}", valet_sim::util::uuid_v4());
        let rel = format!("{pod}/{}", "ab".repeat(32));
        cgroups.create(&pod)?;
        cgroups.create(&rel)?;
        programs.watch(cgroups.id(&pod)?, watch_flags::EXITS)?;
        let mut samples = Vec::with_capacity(runs);
        for _ in 0..runs {
            // Pid 1 of a pid namespace of its own, as a container's main process: the kernel
            // reports only exits that can end a container.
            let mut cmd = Command::new("unshare");
            cmd.args(["--pid", "--fork", "/bin/true"]).stdout(std::process::Stdio::null());
            let mut child = cgroups.spawn_in(&rel, &mut cmd)?;
            let batch = tokio::time::timeout(Duration::from_secs(2), stream.next_batch()).await??;
            let now = monotonic_ns();
            let _ = child.wait();
            for event in batch {
                if let Event::Exit(e) = event {
                    samples.push(now.saturating_sub(e.ktime_ns) as f64 / 1000.0);
                }
            }
        }
        let st = report("exit event latency", samples);
        table.add("[1] exit event, kernel → agent (median / p99)", st.us(), "—", "—", "—".into());
        Ok::<_, anyhow::Error>(())
    })
}
