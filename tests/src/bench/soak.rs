use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};
use valet_sim::node::SpawnOptions;
use valet_tests::harness::{Agent, Node};

#[allow(clippy::wildcard_imports, reason = "the bench's parts share one namespace")]
use super::*;

/// What the agent holds: RSS (KiB), open fds, kernel map entries by map.
type Holds = (u64, usize, BTreeMap<String, usize>);

/// Section 9, the soak: many short Jobs through one node, a batch at a time; what the agent
/// holds at the start and at the end.
pub(crate) fn soak(plan: &Plan, table: &mut Table) -> Result<()> {
    println!("\n[9] soak: {} short Jobs through one node, {} at a time", plan.soak, plan.batch);
    let node = Node::new()?;
    let agent = node.start_agent(&[])?;
    let pid = agent.pid().context("agent pid")?;
    let snapshot = || (rss_kib(pid), open_fds(pid), map_entries(pid));
    let started = Instant::now();
    let (mut first, mut lost, mut done) = (None, 0usize, 0usize);
    let batches = plan.soak.div_ceil(plan.batch);
    let mut phases = [Duration::ZERO; 5];
    // RSS after every batch once the first 1,000 Jobs are through (a fifth of a shorter soak):
    // the allocator's and the runtime's pools have grown to their working size by then.
    let warm_up = (plan.soak / 5).min(1_000);
    let mut rss_samples: Vec<(f64, f64)> = Vec::new();
    for b in 0..batches {
        let n = plan.batch.min(plan.soak - done);
        lost += soak_batch(&node, &agent, n, b == 0, &mut phases)?;
        done += n;
        if done >= warm_up {
            rss_samples.push((done as f64, rss_kib(pid) as f64 / 1024.0));
        }
        if b == 0 {
            // After one batch: the runtime's pools and the kernel's maps are warm.
            first = Some(snapshot());
        }
        if (b + 1) % 20 == 0 || b + 1 == batches {
            let (rss, fds, maps) = snapshot();
            println!(
                "  {done:>6} Jobs, {:>5.0} s: RSS {:.1} MiB, {fds} fds, map entries: {}",
                started.elapsed().as_secs_f64(),
                rss as f64 / 1024.0,
                entries_text(&maps)
            );
        }
    }
    println!(
        "  time per Job: making {:.1} ms, until tracked {:.1} ms, app run and quit {:.1} ms, teardown {:.1} ms, \
         until untracked {:.1} ms",
        phases[0].as_secs_f64() * 1e3 / done as f64,
        phases[1].as_secs_f64() * 1e3 / done as f64,
        phases[2].as_secs_f64() * 1e3 / done as f64,
        phases[3].as_secs_f64() * 1e3 / done as f64,
        phases[4].as_secs_f64() * 1e3 / done as f64,
    );
    let first = first.context("no batch ran")?;
    let slope = least_squares_slope(&rss_samples) * 1_000.0;
    println!(
        "  RSS slope after the first {warm_up} Jobs: {slope:+.3} MiB per 1,000 Jobs (least squares over {} samples)",
        rss_samples.len()
    );
    let samples = rss_samples.len();
    soak_rows((done, lost, warm_up, samples, slope), &first, &snapshot(), table);
    Ok(())
}

/// One batch of `n` Jobs: made, tracked, their apps run and quit, removed, untracked; each step's
/// time added to `phases`. Returns the Jobs whose proxy was not quit.
fn soak_batch(node: &Node, agent: &Agent, n: usize, first: bool, phases: &mut [Duration; 5]) -> Result<usize> {
    let pid = agent.pid().context("agent pid")?;
    let mut lost = 0;
    let mut t = Instant::now();
    let mut lap = |i: usize| {
        phases[i] += t.elapsed();
        t = Instant::now();
    };
    let mut jobs = make_jobs(node, "soak", n)?;
    lap(0);
    agent.wait_tracked(n, Duration::from_secs(30))?;
    lap(1);
    if first {
        println!("  map entries with {n} Jobs tracked: {}", entries_text(&map_entries(pid)));
    }
    for job in &mut jobs {
        job.start_app("app", &["/bin/true"], &SpawnOptions::default())?;
    }
    for job in &mut jobs {
        if job.wait_proxy_exit(Duration::from_secs(10))?.is_none() {
            lost += 1;
        }
    }
    lap(2);
    remove_jobs(node, jobs);
    // The fake API server runs in this process and records every request for tests to
    // inspect: kept, the record would grow by ~150 kB a Job and slow every fork.
    node.api.clear_requests();
    lap(3);
    agent.wait_tracked(0, Duration::from_secs(30))?;
    lap(4);
    Ok(lost)
}

/// [9]'s rows: the Jobs done and not quit, the warm-up, the RSS samples and their slope; what the
/// agent held after the first batch and at the end.
fn soak_rows(
    (done, lost, warm_up, samples, slope): (usize, usize, usize, usize, f64),
    (rss0, fds0, maps0): &Holds,
    (rss1, fds1, maps1): &Holds,
    table: &mut Table,
) {
    let entries = |m: &BTreeMap<String, usize>| m.values().sum::<usize>();
    table.add(
        &format!("[9] soak, {done} Jobs ({lost} not quit): agent RSS after the first batch → at the end"),
        format!("{:.1} → {:.1} MiB", *rss0 as f64 / 1024.0, *rss1 as f64 / 1024.0),
        "—",
        "—",
        "—".into(),
    );
    table.add(
        &format!("[9] soak: agent RSS slope after the first {warm_up} Jobs (least squares, {samples} samples)"),
        format!("{slope:+.3} MiB per 1,000 Jobs"),
        "—",
        "flat (≤ 0.1 MiB per 1,000 Jobs), every Job quit",
        met(lost == 0 && samples >= 2 && slope <= 0.1).into(),
    );
    table.add(
        "[9] soak: open fds → at the end",
        format!("{fds0} → {fds1}"),
        "—",
        "flat (≤ +4: a request's socket may be open at the moment)",
        met(*fds1 <= *fds0 + 4).into(),
    );
    table.add(
        "[9] soak: kernel map entries → at the end",
        format!("{} → {} ({})", entries(maps0), entries(maps1), entries_text(maps1)),
        "—",
        "flat",
        met(entries(maps1) <= entries(maps0)).into(),
    );
}

/// The least-squares slope of y over x (NaN with fewer than two distinct x).
pub(crate) fn least_squares_slope(points: &[(f64, f64)]) -> f64 {
    let n = points.len() as f64;
    let (mx, my) = (points.iter().map(|p| p.0).sum::<f64>() / n, points.iter().map(|p| p.1).sum::<f64>() / n);
    let sxy: f64 = points.iter().map(|(x, y)| (x - mx) * (y - my)).sum();
    let sxx: f64 = points.iter().map(|(x, _)| (x - mx) * (x - mx)).sum();
    if sxx > 0.0 { sxy / sxx } else { f64::NAN }
}
