use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use valet_agent::host::clock::monotonic_ns;
use valet_sim::node::SpawnOptions;
use valet_tests::harness::{Agent, JobPod, JobSpec, Node, eventually};

#[allow(clippy::wildcard_imports, reason = "the bench's parts share one namespace")]
use super::*;

/// How the proxies of [7] turn ready.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) enum Flip {
    /// They answer 200 from the moment their ready file exists: no kernel event marks it, the
    /// held pods' poll finds it.
    Silent,
    /// As Envoy when its configuration arrives: each binds a listener (15006) and then answers
    /// 200. The kernel sees the listen in the holding pod.
    Listens,
}

impl Flip {
    /// Its name in `VALET_BENCH_TOGETHER`.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Flip::Silent => "silent",
            Flip::Listens => "listens",
        }
    }
}

/// What [7]'s rounds measured, summed over the rounds.
#[derive(Default)]
struct Rounds {
    /// From each proxy's ready moment to its app's stamp, and to the SIGCONT the agent sent it
    /// (when traced) (µs).
    samples: Vec<f64>,
    released: Vec<f64>,
    /// Of the release: from the ready moment to the proxy's reading of the first ask after it
    /// (the ask that found it ready: the agent's asking and the proxy's wait for a CPU), and from
    /// that read to the SIGCONT (the answer's way back and the agent's decision) (µs).
    asked: Vec<f64>,
    decided: Vec<f64>,
    /// That read to the SIGCONT split at the answer's write (the stand-in's `replied=`): the
    /// proxy's answering (its read to its write) and the agent's part after it (the prober's
    /// reading of the answer, the loop's decision, the signal) (µs).
    answered: Vec<f64>,
    after_answer: Vec<f64>,
    /// That first ask split at its bytes' arrival in the proxy's socket (the kernel's receive
    /// timestamp, the stand-in's `--stamp-arrivals`; on loopback, the agent's write): (from the
    /// ready moment to the arrival, 0 when it came before it; from the arrival to the read, the
    /// proxy's own wait), each beside its read's delay after the ready moment (`asked`) (µs).
    ask_parts: Vec<AskParts>,
    /// The agent's CPU share in each of the first rounds.
    cpu: Vec<f64>,
    /// Proxies that bind as they turn ready are ready only once they got the CPU to bind (with
    /// 110 of them woken at once on two CPUs, up to milliseconds after the file): the app's wait
    /// counts from each one's own ready moment, and also, for comparison, from the file.
    from_file: Vec<f64>,
    binding: Vec<f64>,
    /// What the apps' own start costs: each app's CPU from its release to its stamp (it reads its
    /// own thread's CPU time there; the bench reads it while the app is held). And the floor that
    /// sets: on `cpus` CPUs the k-th app of a round to run cannot have run sooner after the ready
    /// moment than the CPU its k cheapest apps needed, shared out over every CPU.
    starts: Vec<f64>,
    floors: Vec<f64>,
    /// From the round's ready moment (the file's) to each app's stamp (µs), both flips; and the
    /// complete floor: the apps' own start and every other CPU of the round that is not the
    /// agent's, each round's account in `spent`.
    from_round: Vec<f64>,
    complete: Vec<f64>,
    spent: Vec<RoundSpent>,
    /// The poll's cost: the prober thread's CPU and the GETs the proxies logged meanwhile.
    prober_ns: u64,
    probes: usize,
}

/// A held pod of a round: the pod, the stamp its app writes once it runs, the app's host pid.
type HeldJob = (JobPod, PathBuf, u32);

/// What every round of [7] shares.
struct Setup<'a> {
    node: &'a Node,
    agent: &'a Agent,
    app: String,
    pid: u32,
    trace: Option<SignalTrace>,
    pods: usize,
    flip: Flip,
    cpus: usize,
}

/// [7]'s figures over every round (each printed as it is reported).
struct Figures {
    released: Option<Stats>,
    runs: Stats,
    delivery: Option<Stats>,
    start: Stats,
    floor: Stats,
    from_round: Stats,
    complete: Stats,
    /// Each round's account, the median of each part over the rounds.
    spent: RoundSpent,
    cpu: f64,
}

/// Section 7, many held pods at once: their proxies turn ready together. Over `rounds` rounds of
/// `pods` new pods each: the moment the proxies turn ready falls at a new place in the agent's
/// probe period each round (one round is one draw of it).
pub(crate) fn held_together(pods: usize, rounds: usize, flip: Flip, table: &mut Table) -> Result<()> {
    let how = match flip {
        Flip::Silent => "readiness flips, no listen",
        Flip::Listens => "each binds a listener as it turns ready",
    };
    println!("\n[7] {pods} pods held at once, their proxies ready at the same moment, {how} ({rounds} rounds)");
    let app = bin("valet-bench-app")?;
    let app = app.to_str().context("path")?.to_owned();
    let node = Node::new()?;
    let agent = node.start_agent(&[])?;
    let pid = agent.pid().context("agent pid")?;
    let listens = agent.metric("valet_proxy_listens_total ");
    let trace = SignalTrace::start().map_err(|e| println!("  (SIGCONT times not traced: {e:#})")).ok();
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let setup = Setup { node: &node, agent: &agent, app, pid, trace, pods, flip, cpus };
    let mut acc = Rounds::default();
    for round in 0..rounds {
        together_round(&setup, round, &mut acc)?;
    }
    let (prober_ns, probes) = (acc.prober_ns, acc.probes);
    let figures = together_figures(acc, cpus);
    println!("  agent CPU while probing {pods} held pods: {:.1} % of one core", figures.cpu * 100.0);
    let listens = agent.metric("valet_proxy_listens_total ") - listens;
    println!("  listens seen in holding pods: {listens} ({} pods)", pods * rounds);
    together_rows(&setup, how, &figures, table);
    complete_rows(&setup, &figures, table);
    if flip == Flip::Silent && probes > 0 {
        poll_rows(pods, prober_ns, probes, table);
    }
    table.add(
        &format!("[7] agent CPU while probing {pods} held pods ({how})"),
        format!("{:.1} % of one core", figures.cpu * 100.0),
        "—",
        "≤ 5 %",
        met(figures.cpu <= 0.05).into(),
    );
    Ok(())
}

/// One round of [7]: `pods` held pods made, the agent's CPU while it probes them (in the first
/// rounds), their proxies turned ready at once, each app's release measured; then the pods go.
fn together_round(setup: &Setup<'_>, round: usize, acc: &mut Rounds) -> Result<()> {
    const CPU_ROUNDS: usize = 3;
    let Setup { node, agent, pid, pods, flip, .. } = *setup;
    let (ready, jobs) = together_jobs(setup, round)?;
    agent.wait_tracked(pods, Duration::from_secs(10))?;
    let all_held = eventually(Duration::from_secs(10), || jobs.iter().all(|(_, _, p)| stopped(*p)));
    if !all_held {
        bail!("not every app was held\n{}", agent.log_text());
    }
    // Once the kubelet has reported the containers (about a second after they started, and
    // the agent's work of naming them and opening their networks is done), the agent only
    // probes every held pod's proxy until it is ready: its CPU over 5 s of that, in the
    // first rounds. The later ones are more draws of the moment in the probe period.
    std::thread::sleep(Duration::from_millis(1500));
    if round < CPU_ROUNDS {
        // VALET_BENCH_CPU_SECS: a longer window, to look at the agent meanwhile.
        let secs = std::env::var("VALET_BENCH_CPU_SECS").ok().and_then(|s| s.parse().ok()).unwrap_or(5);
        let gets = || -> usize {
            jobs.iter().map(|(job, ..)| job.requests().iter().filter(|e| e.method == "GET").count()).sum()
        };
        let (prober_before, gets_before) = (thread_cpu_ns(pid, "valet-held"), gets());
        acc.cpu.push(cpu_share(pid, Duration::from_secs(secs)));
        acc.prober_ns += thread_cpu_ns(pid, "valet-held").saturating_sub(prober_before);
        acc.probes += gets().saturating_sub(gets_before);
    }
    // Each held app's CPU so far (its exec's included), read before any is released.
    let held_cpu: Vec<Option<u64>> = jobs.iter().map(|(.., app_pid)| task_cpu_ns(*app_pid, *app_pid)).collect();
    if let Some(trace) = &setup.trace {
        trace.sent();
    }
    let account = RoundCpu::open(pid, jobs.iter().map(|(.., app_pid)| *app_pid));
    let t_ready = monotonic_ns();
    std::fs::write(&ready, b"")?;
    let mut ready_at = Vec::new();
    for (i, (job, stamp, _)) in jobs.iter().enumerate() {
        if !eventually(Duration::from_secs(5), || read_stamp(stamp).is_some()) {
            bail!("round {round}, pod {i}: app not released\n{}", agent.log_text());
        }
        let ran = read_stamp(stamp).context("stamp")?;
        // A silent proxy answers 200 from the moment the file exists (it looks at each request).
        let ready = match flip {
            Flip::Silent => t_ready,
            Flip::Listens => {
                let at = job.proxy_ready_at().with_context(|| format!("round {round}, pod {i}: no ready moment"))?;
                acc.binding.push(at.saturating_sub(t_ready) as f64 / 1000.0);
                acc.from_file.push(ran.saturating_sub(t_ready) as f64 / 1000.0);
                at.max(t_ready)
            }
        };
        acc.samples.push(ran.saturating_sub(ready) as f64 / 1000.0);
        acc.from_round.push(ran.saturating_sub(t_ready) as f64 / 1000.0);
        ready_at.push(ready);
    }
    let spent = account.close();
    own_starts(&jobs, &held_cpu, setup.cpus, round, spent, acc);
    if let Some(trace) = &setup.trace {
        let sent = trace.sent();
        let (mut signals, mut answers) = (Vec::new(), Vec::new());
        for (i, ((job, _, app_pid), ready)) in jobs.iter().zip(&ready_at).enumerate() {
            let Some(&at) = sent.get(app_pid) else {
                println!("  round {round}, pod {i}: its SIGCONT was not traced (left out)");
                continue;
            };
            signals.push(at.saturating_sub(t_ready) as f64 / 1000.0);
            acc.released.push(at.saturating_sub(*ready) as f64 / 1000.0);
            answers.extend(first_ask(job, *ready, at, acc).map(|r| r.saturating_sub(t_ready) as f64 / 1000.0));
        }
        round_line(round, &mut answers, &mut signals);
    }
    remove_jobs(node, jobs.into_iter().map(|j| j.0).collect());
    agent.wait_tracked(0, Duration::from_secs(30))
}

/// A round's timeline from its ready moment (the file's): when the proxies wrote their answers to
/// the first asks after it, and when the SIGCONTs went out, first, median and last (ms). The gap
/// between the last answer and the first SIGCONT is the round's wait and its decisions; the
/// SIGCONTs' own spread, the releases'.
fn round_line(round: usize, answers: &mut [f64], signals: &mut [f64]) {
    let spread = |v: &mut [f64]| {
        v.sort_by(f64::total_cmp);
        match (v.first(), v.get(v.len() / 2), v.last()) {
            (Some(a), Some(m), Some(z)) => format!("{:.2} / {:.2} / {:.2} ms", a / 1000.0, m / 1000.0, z / 1000.0),
            _ => "none".to_string(),
        }
    };
    println!(
        "  round {round}, from the file (first / median / last): the answers written {}, the SIGCONTs sent {}",
        spread(answers),
        spread(signals)
    );
}

/// A released pod's release split at the first ask its proxy read after its `ready` moment (and
/// before the SIGCONT `at`): the read's delay, from it to the SIGCONT, and the ask's arrival in the
/// socket, into `acc`. Returns when its answer was written, if the stand-in said.
fn first_ask(job: &JobPod, ready: u64, at: u64, acc: &mut Rounds) -> Option<u64> {
    let us = |from: u64, to: u64| to.saturating_sub(from) as f64 / 1000.0;
    let asks = job.requests().into_iter().filter(|e| e.method == "GET" && (ready..=at).contains(&e.mono_ns));
    let first = asks.min_by_key(|e| e.mono_ns)?;
    let read = first.mono_ns;
    acc.asked.push(us(ready, read));
    acc.decided.push(us(read, at));
    if let Some(replied) = first.replied_ns.filter(|r| *r <= at) {
        acc.answered.push(us(read, replied));
        acc.after_answer.push(us(replied, at));
    }
    if let Some(arrived) = first.arrived_ns {
        acc.ask_parts.push(AskParts {
            read_after: us(ready, read),
            in_socket: us(ready, arrived),
            waited: us(arrived, read),
        });
    }
    first.replied_ns
}

/// A round's held pods, each with its app started (held) and the stamp it writes once it runs;
/// and the file whose making turns every one of their proxies ready.
fn together_jobs(setup: &Setup<'_>, round: usize) -> Result<(PathBuf, Vec<HeldJob>)> {
    let node = setup.node;
    let mut jobs = Vec::new();
    // One file for every stand-in of the round: made once, it turns them all ready at the same
    // instant (a file each, written one after another, spread the moment over milliseconds
    // whenever the writer lost its CPU to the probes it set off).
    // In a directory of its own: the stand-ins that bind when it appears watch it (inotify).
    let dir = node.scratch.path(&format!("together-{round}"));
    std::fs::create_dir_all(&dir)?;
    let ready = dir.join("ready");
    for i in 0..setup.pods {
        let mut spec = JobSpec::new("together").annotation("valet.dev/hold-app", "true");
        spec.ready_file = Some(ready.clone());
        spec.listen_when_ready = (setup.flip == Flip::Listens).then_some(15006);
        spec.stamp_arrivals = true;
        let mut job = node.job_pod(spec)?;
        let stamp = node.scratch.path(&format!("together-ran-{round}-{i}"));
        let stamp_s = stamp.to_str().context("path")?.to_owned();
        let app = setup.app.as_str();
        let app_pid =
            job.start_app("app", &[app, &stamp_s, "0", "0", "2000", "cpu"], &SpawnOptions::default())?.host_pid();
        jobs.push((job, stamp, app_pid));
    }
    Ok((ready, jobs))
}

/// Each released app's own start (its CPU from its release to its stamp) and the floor that
/// sets on `cpus` CPUs, into `acc`.
/// With the round's account `spent`: the complete floor, the apps' own start and every other CPU
/// of the round that is not the agent's (what the apps did after their stamps included).
fn own_starts(
    jobs: &[HeldJob],
    held_cpu: &[Option<u64>],
    cpus: usize,
    round: usize,
    spent: RoundSpent,
    acc: &mut Rounds,
) {
    let mut own: Vec<u64> = jobs
        .iter()
        .zip(held_cpu)
        .filter_map(|((_, stamp, _), held)| Some(read_stamp_cpu(stamp)?.saturating_sub((*held)?)))
        .collect();
    if own.len() < jobs.len() {
        println!("  round {round}: {} apps' own CPU not read (left out of the floor)", jobs.len() - own.len());
    }
    own.sort_unstable();
    let starts: u64 = own.iter().sum();
    let rest = spent.bench_ns + spent.others_ns + spent.apps_ns.saturating_sub(starts);
    acc.complete.extend(complete_floor(&own, rest, cpus));
    acc.spent.push(spent);
    let mut sum = 0;
    for c in own {
        acc.starts.push(c as f64 / 1000.0);
        sum += c;
        acc.floors.push(sum as f64 / cpus as f64 / 1000.0);
    }
}

/// The first ask that found a proxy ready, split at its arrival in the proxy's socket (µs).
#[derive(Clone, Copy)]
struct AskParts {
    /// Its read after the ready moment.
    read_after: f64,
    /// The ready moment → the arrival (0 when it came before the moment).
    in_socket: f64,
    /// The arrival → the read: the proxy's own wait (longer than `read_after` when the ask came
    /// before the moment).
    waited: f64,
}

/// The first ask that found each proxy ready, split at its arrival in the proxy's socket: the
/// agent's part (ready moment → arrival) and the proxy's wait (arrival → read), over every pod
/// and over the tenth read latest after its ready moment, where the round's tail is.
fn ask_split(parts: &[AskParts]) {
    if parts.is_empty() {
        return;
    }
    let each = |parts: &[AskParts], f: fn(&AskParts) -> f64| parts.iter().map(f).collect::<Vec<f64>>();
    report("    the ask reached the proxy's socket after the ready moment", each(parts, |p| p.in_socket));
    report("    the ask waited in the socket until the proxy read it", each(parts, |p| p.waited));
    let mut late = parts.to_vec();
    late.sort_by(|a, b| b.read_after.total_cmp(&a.read_after));
    late.truncate(parts.len().div_ceil(10));
    report("    the latest tenth: the ask reached the socket after the ready moment", each(&late, |p| p.in_socket));
    report("    the latest tenth: the ask waited in the socket", each(&late, |p| p.waited));
}

/// [7]'s figures, each reported (printed) in turn.
fn together_figures(acc: Rounds, cpus: usize) -> Figures {
    let released =
        (!acc.released.is_empty()).then(|| report("released (SIGCONT sent) after its proxy is ready", acc.released));
    if !acc.asked.is_empty() {
        report("  of it: the proxy read the first ask after its ready moment", acc.asked);
        report("  of it: from that read to the SIGCONT", acc.decided);
        if !acc.answered.is_empty() {
            report("    the proxy's answer written after its read", acc.answered);
            report("    the agent's part after it: the answer read, the decision, the SIGCONT", acc.after_answer);
        }
    }
    ask_split(&acc.ask_parts);
    let runs = report("held app runs after its proxy is ready", acc.samples);
    let (binding, from_file) = (acc.binding, acc.from_file);
    let delivery = (!from_file.is_empty()).then(|| {
        report("proxy bound its listener after the file", binding);
        report("held app runs after the file (delivery)", from_file)
    });
    let start = report("the apps' own start: each one's CPU from its release to its stamp", acc.starts);
    let floor = report(&format!("floor: the k-th app of a round on {cpus} CPUs, from the ready moment"), acc.floors);
    let from_round = report("held app runs after the round's ready moment (the file)", acc.from_round);
    let complete = report(
        &format!("complete floor: the k-th app on {cpus} CPUs, every CPU of the round not the agent's"),
        acc.complete,
    );
    let spent = median_spent(&acc.spent);
    let [main, prober, workers, events, rest] = spent.agent_parts.map(|ns| ns as f64 / 1e6);
    println!(
        "  a round's CPU (median of {} rounds): the agent {:.2} ms (its loop {main:.2}, the prober {prober:.2}, \
         the runtime's workers {workers:.2}, the event reader {events:.2}, the rest {rest:.2}); not the agent's: the bench's own {:.2} ms, \
         the proxies and sandboxes {:.2} ms, the apps {:.2} ms",
        acc.spent.len(),
        spent.agent_ns as f64 / 1e6,
        spent.bench_ns as f64 / 1e6,
        spent.others_ns as f64 / 1e6,
        spent.apps_ns as f64 / 1e6
    );
    let cpu = acc.cpu.iter().sum::<f64>() / acc.cpu.len().max(1) as f64;
    Figures { released, runs, delivery, start, floor, from_round, complete, spent, cpu }
}

/// Each part's median over the rounds.
fn median_spent(rounds: &[RoundSpent]) -> RoundSpent {
    let median = |part: &dyn Fn(&RoundSpent) -> u64| {
        let mut v: Vec<u64> = rounds.iter().map(part).collect();
        v.sort_unstable();
        v.get(v.len() / 2).copied().unwrap_or(0)
    };
    RoundSpent {
        agent_ns: median(&|s| s.agent_ns),
        agent_parts: std::array::from_fn(|i| median(&|s| s.agent_parts[i])),
        bench_ns: median(&|s| s.bench_ns),
        others_ns: median(&|s| s.others_ns),
        apps_ns: median(&|s| s.apps_ns),
    }
}

/// [7]'s rows: the release, the app running, the floor its own start sets, the delivery.
fn together_rows(setup: &Setup<'_>, how: &str, f: &Figures, table: &mut Table) {
    let Setup { pods, flip, cpus, .. } = *setup;
    // The agent's part, judged at a full node (issue 53's target); the app runs later.
    let (target, result) = match &f.released {
        None => ("—", "not traced".to_owned()),
        Some(r) if pods == FULL_NODE => {
            ("median ≤ 5 ms, p99 ≤ 15 ms", met(r.median <= 5_000.0 && r.p99 <= 15_000.0).to_owned())
        }
        Some(_) => ("—", "the signal only: the app runs later".to_owned()),
    };
    table.add(
        &format!("[7] {pods} pods held at once, {how}: released, SIGCONT sent (median / p99)"),
        f.released.as_ref().map_or_else(|| "—".into(), Stats::ms),
        "—",
        target,
        result,
    );
    // Judged where the promise is kept: the released app running (its own start included: the
    // apps of a round start at once on two CPUs).
    let m = &f.runs;
    table.add(
        &format!("[7] … the released app runs (median / p99, n={})", m.n),
        m.ms(),
        "—",
        "median ≤ 12.5 ms, p99 ≤ 25 ms",
        met(m.median <= 12_500.0 && m.p99 <= 25_000.0).into(),
    );
    // The floor's ready moment is the round's (the file's): it bounds the row judged for
    // proxies that flip with no listen, and for binding proxies the delivery row beside it.
    let bounds = match flip {
        Flip::Silent => "the row above",
        Flip::Listens => "the delivery row below",
    };
    let over = f.floor.median > 12_500.0 || f.floor.p99 > 25_000.0;
    table.add(
        &format!(
            "[7] … the floor the apps' own start sets (each {:.0} µs of CPU at the median, from its release): the \
             k-th app to run, its k cheapest apps' CPU over {cpus} CPUs (median / p99)",
            f.start.median
        ),
        f.floor.ms(),
        "—",
        "—",
        if over {
            format!("above the target: {bounds} cannot meet it on {cpus} CPUs with these apps")
        } else {
            format!("below the target ({bounds})")
        },
    );
    if let Some(d) = &f.delivery {
        table.add(
            &format!("[7] … the app runs after its configuration is delivered, its proxy's own wait for a CPU included (n={})", d.n),
            d.ms(),
            "—",
            "—",
            "the proxies', not the agent's: not judged".into(),
        );
    }
}

/// A full node: the kubelet's default maximum of pods, where the agent's part and the complete
/// floor's ratios are judged.
const FULL_NODE: usize = 110;

/// The complete floor (every CPU of the round that is not the agent's), the app running from the
/// round's ready moment against it (judged at a full node), and the agent's own CPU in the round.
fn complete_rows(setup: &Setup<'_>, f: &Figures, table: &mut Table) {
    let Setup { pods, cpus, .. } = *setup;
    let ms = |ns: u64| ns as f64 / 1e6;
    table.add(
        &format!(
            "[7] … the complete floor: the k-th app to run, its k cheapest apps' start and k/n of the round's other \
             CPU not the agent's (a round, median: the apps {:.1} ms, the proxies and sandboxes {:.1} ms, the bench's \
             own {:.1} ms), over {cpus} CPUs (median / p99)",
            ms(f.spent.apps_ns),
            ms(f.spent.others_ns),
            ms(f.spent.bench_ns)
        ),
        f.complete.ms(),
        "—",
        "—",
        "the floor of the row below".into(),
    );
    let (m, p) = (f.from_round.median / f.complete.median, f.from_round.p99 / f.complete.p99);
    let (target, result) = if pods == FULL_NODE {
        ("median ≤ 1.25×, p99 ≤ 1.5× the complete floor", met(m <= 1.25 && p <= 1.5).to_owned())
    } else {
        ("—", "not judged (a full node's target)".to_owned())
    };
    table.add(
        &format!(
            "[7] … the app runs after the round's ready moment (the file), {} / {}: over the complete floor \
             (median / p99)",
            f.from_round.ms().trim_end_matches(" ms"),
            f.complete.ms()
        ),
        format!("{m:.2}× / {p:.2}×"),
        "the complete floor",
        target,
        result,
    );
    let [main, prober, workers, events, _] = f.spent.agent_parts.map(ms);
    table.add(
        &format!(
            "[7] … the agent's own CPU in a round, from the ready moment to its last app running (median; its loop \
             {main:.1} ms, the prober {prober:.1} ms, the runtime's workers, which write the conditions, {workers:.1} ms, \
             the kernel event reader {events:.1} ms)"
        ),
        format!("{:.2} ms", ms(f.spent.agent_ns)),
        "—",
        "—",
        "beside the complete floor".into(),
    );
}

/// With no listen, the release waits for the poll. A probe costs the prober `per` of its CPU;
/// within the CPU target (5 % of a core, all of it the prober's) every held pod is probed no more
/// often than every `period`, and a lone flip at a random moment of it waits half of it at the
/// median. A round's flips come together: the first one seen brings the others' asks forward.
fn poll_rows(pods: usize, prober_ns: u64, probes: usize, table: &mut Table) {
    let per = prober_ns as f64 / probes as f64;
    let period = pods as f64 * per / 0.05;
    println!(
        "  the poll: {probes} GETs logged by the proxies, the prober's CPU {:.1} ms: {:.1} µs a probe; within 5 % \
         of a core, {pods} pods every {:.1} ms at best",
        prober_ns as f64 / 1e6,
        per / 1000.0,
        period / 1e6
    );
    table.add(
        &format!(
            "[7] … the floor the poll's cost sets: a probe {:.1} µs of the prober's CPU, {pods} pods within 5 % of a \
             core: a lone flip waits (median)",
            per / 1000.0
        ),
        format!("{:.2} ms", period / 2.0 / 1e6),
        "—",
        "—",
        if period / 2.0 > 12.5e6 {
            "above the target for a lone flip: no poll at this cost meets it within the CPU target (a round's \
             first flip brings the others' asks forward)"
                .into()
        } else {
            "below the target".into()
        },
    );
}
