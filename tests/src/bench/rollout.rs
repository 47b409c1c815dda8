//! [13] The gap of a rollout: apps that start while one agent gives way to the next. The kernel
//! programs that hold an app at its exec are the running agent's (detached when it exits; only
//! the record of held apps is pinned), so an app whose exec falls between the old agent's exit
//! and the new agent's first look at its pod runs unheld: before its proxy is ready, the race
//! valet closes. Measured with the real agent binary in the DaemonSet's pod on the simulated
//! node: held pods placed by the old agent, one app started every [`STEP`] from before the old
//! pod's deletion to after the new agent's start, the new pod's agent started [`REPLACED_AFTER`]
//! after the old one's exit (without surge) or ready before the old pod's deletion (with surge,
//! both agents running meanwhile). An app that has run by the end ran unheld.

use std::time::{Duration, Instant, SystemTime};

use anyhow::{Context as _, Result, bail};
use valet_tests::harness::{AGENT_NAMESPACE, Agent, HANG_GUARD, JobPod, Node, eventually, process_state};
use valet_tests::held::{held_spec, wait_probed_not_ready};

#[allow(clippy::wildcard_imports, reason = "the bench's parts share one namespace")]
use super::*;

/// Between two apps' starts.
const STEP: Duration = Duration::from_millis(100);
/// Apps started before the old pod's deletion (the first ones: held by the old agent).
const BEFORE: usize = 3;
/// The old pod's exit to the new pod's agent starting (the DaemonSet controller's new pod, the
/// kubelet's start; an image already on the node): what the simulated node assumes, as the
/// end-to-end rollout test does.
const REPLACED_AFTER: Duration = Duration::from_secs(2);

/// One app of [13]: its pod, the marker it writes when it runs, and when it was started (ms
/// from the old pod's deletion).
struct GapApp {
    job: JobPod,
    marker: std::path::PathBuf,
    ready: std::path::PathBuf,
    started: Option<Instant>,
}

/// What one rollout left: each app's start (ms from the old pod's deletion) and whether it ran
/// unheld; when the new agent started and could hold (ms, same origin).
struct Gap {
    apps: Vec<(f64, bool)>,
    new_started_ms: f64,
    new_placed_ms: f64,
}

pub(crate) fn rollout_gap(plan: &Plan, table: &mut Table) -> Result<()> {
    println!(
        "\n[13] a rollout's gap: an app started every {} ms from before the old pod's deletion; the new pod's agent {} s after the old one's exit, or (surge) ready before the deletion",
        STEP.as_millis(),
        REPLACED_AFTER.as_secs()
    );
    let apps = BEFORE
        + ((REPLACED_AFTER + Duration::from_secs(if plan.quick { 2 } else { 3 })).as_millis() / STEP.as_millis())
            as usize;
    for surge in [false, true] {
        let gap = one_rollout(apps, surge)?;
        gap_rows(surge, &gap, table);
    }
    Ok(())
}

fn one_rollout(n: usize, surge: bool) -> Result<Gap> {
    let node = Node::new()?;
    node.install_daemonset()?;
    let old = node.daemonset_pod()?;
    let mut agent = node.start_agent_in(&old, &[])?;
    let mut apps = Vec::new();
    for i in 0..n {
        let ready = node.scratch.path(&format!("gap-ready-{i}"));
        let marker = node.scratch.path(&format!("gap-ran-{i}"));
        let job = node.job_pod(held_spec(&format!("gap-{i}"), &ready))?;
        wait_probed_not_ready(&node, &job, &agent);
        apps.push(GapApp { job, marker, ready, started: None });
    }
    let mut next: Option<Agent> = None;
    if surge {
        let new = node.daemonset_pod()?;
        let new_agent = node.start_agent_in(&new, &[])?;
        for app in &apps {
            wait_probed_not_ready(&node, &app.job, &new_agent);
        }
        next = Some(new_agent);
    }
    let t0 = Instant::now();
    let (mut deleted, mut old_exited, mut new_started) = (None, None, None);
    for (i, app) in apps.iter_mut().enumerate() {
        std::thread::sleep((t0 + STEP * i as u32).saturating_duration_since(Instant::now()));
        app.started = Some(Instant::now());
        app.job.run_app("app", &format!("echo ran > {}; exec sleep 0.2", app.marker.display()))?;
        if i + 1 == BEFORE {
            // The DaemonSet controller deletes the old pod; the kubelet SIGTERMs its container.
            std::thread::sleep(STEP / 2);
            deleted = Some((Instant::now(), SystemTime::now()));
            node.api.begin_pod_deletion(AGENT_NAMESPACE, &old, None)?;
            agent.stop(libc::SIGTERM, HANG_GUARD)?;
            node.api.delete_pod(AGENT_NAMESPACE, &old)?;
            old_exited = Some(Instant::now());
        }
        if !surge && next.is_none() && old_exited.is_some_and(|at| at.elapsed() >= REPLACED_AFTER) {
            let new = node.daemonset_pod()?;
            new_started = Some(Instant::now());
            next = Some(node.spawn_agent_in_under(&new, &[], &[])?);
        }
    }
    let new_agent = next.context("no new agent: too few apps")?;
    let (deleted, deleted_wall) = deleted.context("the old pod was never deleted: too few apps")?;
    let ms = |t: Instant| {
        t.saturating_duration_since(deleted).as_secs_f64() * 1000.0
            - deleted.saturating_duration_since(t).as_secs_f64() * 1000.0
    };
    // When the new agent could hold: the first pod it placed (probed, not ready), by its log's
    // clock.
    let placed = if surge {
        None
    } else {
        let first = || first_placed(&new_agent.log_text());
        if !eventually(HANG_GUARD, || first().is_some()) {
            bail!("the new agent never placed a pod\n{}", new_agent.log_text());
        }
        first().map(|at| wall_ms(at, deleted_wall))
    };
    let apps = settle(&apps, &new_agent, ms)?;
    Ok(Gap { apps, new_started_ms: new_started.map_or(f64::NAN, ms), new_placed_ms: placed.unwrap_or(f64::NAN) })
}

/// Once settled (every held app stopped at its exec; an app that ran did so unheld), each app's
/// start (by `ms`) and whether it ran unheld; then the held ones are released by their proxies'
/// readiness through the new agent.
fn settle(apps: &[GapApp], new_agent: &Agent, ms: impl Fn(Instant) -> f64) -> Result<Vec<(f64, bool)>> {
    // Settled: every held app is stopped at its exec; an app that ran did so unheld.
    std::thread::sleep(Duration::from_millis(500));
    let mut out = Vec::new();
    for app in apps {
        let ran = app.marker.exists();
        if !ran && process_state(app.job.apps[0].host_pid()) != Some('T') {
            bail!("{}: neither ran nor held", app.job.name);
        }
        out.push((app.started.map_or(f64::NAN, &ms), ran));
    }
    // The held ones run once their proxies are ready (the new agent releases them).
    for app in apps {
        std::fs::write(&app.ready, b"")?;
    }
    for app in apps {
        if !eventually(HANG_GUARD, || app.marker.exists()) {
            bail!("{}: never released\n{}", app.job.name, new_agent.log_text());
        }
    }
    Ok(out)
}

/// The time of the first "proxy not ready" line of an agent's log (a pod placed and probed).
fn first_placed(log: &str) -> Option<SystemTime> {
    let line = log.lines().find(|l| l.contains("proxy not ready"))?;
    let stamp = line.split_whitespace().next()?;
    let at = chrono::DateTime::parse_from_rfc3339(stamp).ok()?;
    let nanos = u64::try_from(at.timestamp_nanos_opt()?).ok()?;
    Some(SystemTime::UNIX_EPOCH + Duration::from_nanos(nanos))
}

/// `at` in ms after `origin` (negative before).
fn wall_ms(at: SystemTime, origin: SystemTime) -> f64 {
    match at.duration_since(origin) {
        Ok(d) => d.as_secs_f64() * 1000.0,
        Err(e) => -e.duration().as_secs_f64() * 1000.0,
    }
}

fn gap_rows(surge: bool, gap: &Gap, table: &mut Table) {
    let unheld: Vec<f64> = gap.apps.iter().filter(|(_, ran)| *ran).map(|(at, _)| *at).collect();
    let window = match (unheld.first(), unheld.last()) {
        (Some(a), Some(b)) => format!("{a:.0} to {b:.0} ms"),
        _ => "none".into(),
    };
    let how = if surge { "with surge (both agents running meanwhile)" } else { "without surge" };
    println!(
        "  {how}: {} of {} apps ran unheld, started {window} after the old pod's deletion; the new agent started at {:.0} ms, placing pods by {:.0} ms",
        unheld.len(),
        gap.apps.len(),
        gap.new_started_ms,
        gap.new_placed_ms
    );
    let agent_part = gap.new_placed_ms - gap.new_started_ms;
    table.add(
        &format!("[13] rollout {how}: apps started in the gap that ran unheld (one every {} ms)", STEP.as_millis()),
        format!("{} of {} ({window})", unheld.len(), gap.apps.len()),
        &if surge {
            "—".to_owned()
        } else {
            format!(
                "the new agent's start → its pods placed: {agent_part:.0} ms (the rest is the kubelet's {} s)",
                REPLACED_AFTER.as_secs()
            )
        },
        "—",
        "a measurement (no target in the issue)".into(),
    );
}
