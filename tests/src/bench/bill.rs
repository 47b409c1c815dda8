use std::time::{Duration, Instant};

use anyhow::{Result, bail};
use valet_agent::api::runtime_classes::RELIST;
use valet_sim::apiserver::{Cost, Flow, ListRead, Traffic};
use valet_sim::node::SpawnOptions;
use valet_tests::harness::{Agent, Node, eventually};

#[allow(clippy::wildcard_imports, reason = "the bench's parts share one namespace")]
use super::*;

/// The agent's user agent (its `User-Agent` product), and the simulated kubelet's.
const AGENT: &str = "valet-agent";
const KUBELET: &str = "kubelet";

/// How often a real API server sends a watch a BOOKMARK (about once a minute; the simulated
/// node's server sends one every 500 ms, so the bench counts bookmarks apart and scales them).
const REAL_BOOKMARK_INTERVAL: Duration = Duration::from_secs(60);

/// The agent's default `--watch-timeout`: each watch request is renewed this often.
const WATCH_TIMEOUT: Duration = Duration::from_secs(290);

/// The resource of the agent's RuntimeClass lists, and how often it makes one.
const RUNTIME_CLASSES: &str = "node.k8s.io/runtimeclasses";

/// The pod watches the agent has opened on `node` so far (one shared by the pod router and the
/// observer with the defaults; their own one each before): each is renewed, and gets bookmarks,
/// at a real server's pace at rest.
fn pod_watches(node: &Node) -> f64 {
    node.api.traffic().total(|f| f.user_agent == AGENT && f.verb == "watch" && f.resource == "pods").requests as f64
}

/// The agent's defaults, named where the test harness sets other values (it turns the quits'
/// Events on).
const DEFAULTS: &[&str] = &["--quit-events=false"];

/// The cluster the figures are projected to: nodes, pods a node, Jobs a minute.
const NODES: f64 = 5_000.0;
const JOBS_PER_MINUTE: f64 = 1_000.0;

fn is_write(f: &Flow) -> bool {
    matches!(f.verb.as_str(), "create" | "update" | "patch" | "delete")
}

/// A cost divided by `n` (per Job): requests, writes, bytes each way, watch events.
struct PerJob {
    requests: f64,
    writes: f64,
    request_bytes: f64,
    response_bytes: f64,
    watch_events: f64,
}

impl PerJob {
    fn of(t: &Traffic, ua: &str, n: usize) -> PerJob {
        let c = t.total(|f| f.user_agent == ua);
        let w = t.total(|f| f.user_agent == ua && is_write(f));
        let n = n.max(1) as f64;
        PerJob {
            requests: c.requests as f64 / n,
            writes: w.requests as f64 / n,
            request_bytes: c.request_bytes as f64 / n,
            response_bytes: c.response_bytes as f64 / n,
            watch_events: c.watch_events as f64 / n,
        }
    }

    /// [`PerJob::words`] without the watch events (a writer's, with no watch of its own here).
    fn request_words(&self) -> String {
        format!(
            "{:.2} requests ({:.2} writes), {:.0} B sent, {:.0} B received",
            self.requests, self.writes, self.request_bytes, self.response_bytes
        )
    }

    fn words(&self) -> String {
        format!(
            "{:.2} requests ({:.2} writes), {:.0} B sent, {:.0} B received, {:.2} watch events",
            self.requests, self.writes, self.request_bytes, self.response_bytes, self.watch_events
        )
    }
}

/// Prints every flow of `t` (bookmarks apart).
fn print_flows(label: &str, t: &Traffic) {
    println!("  {label}:");
    for (f, c) in &t.0 {
        let read = match f.read {
            ListRead::NotAList => "",
            ListRead::WatchCache => " (watch cache)",
            ListRead::Quorum => " (etcd: quorum read)",
        };
        println!(
            "    {:<12} {:<7} {:<22} {:>5} requests {:>9} B sent {:>10} B received {:>6} watch events {:>5} bookmarks{read}",
            if f.user_agent.is_empty() { "-" } else { &f.user_agent },
            f.verb,
            if f.resource.is_empty() { "(discovery)" } else { &f.resource },
            c.requests,
            c.request_bytes,
            c.response_bytes,
            c.watch_events,
            c.bookmarks
        );
    }
}

/// The pods' phases are terminal in the API (the kubelet reported their ends).
fn wait_finished(node: &Node, jobs: &[valet_tests::harness::JobPod]) -> Result<()> {
    let done = |j: &valet_tests::harness::JobPod| {
        node.pod(j).is_some_and(|p| matches!(p["status"]["phase"].as_str(), Some("Succeeded" | "Failed")))
    };
    if !eventually(Duration::from_secs(60), || jobs.iter().all(done)) {
        bail!("the kubelet never reported every Job's pod finished");
    }
    Ok(())
}

/// Waits until the pods are at rest: the kubelet has reported every app running and every
/// proxy ready, and the agent has written each pod's condition True.
pub(crate) fn wait_at_rest(node: &Node, pods: &[valet_tests::harness::JobPod]) -> Result<()> {
    let running = |j: &valet_tests::harness::JobPod, c: &str| {
        j.api_status(c).is_some_and(|s| s["state"]["running"].is_object() && (c == "app" || s["ready"] == true))
    };
    let rest = |j: &valet_tests::harness::JobPod| {
        running(j, "app") && running(j, "istio-proxy") && node.proxy_ready_condition(j)
    };
    if !eventually(Duration::from_secs(120), || pods.iter().all(rest)) {
        bail!("{} of {} pods never came to rest", pods.iter().filter(|j| !rest(j)).count(), pods.len());
    }
    Ok(())
}

/// Waits until the agent's pod router tracks `tracked` opted-in pods and its observer sees `observed`.
fn wait_seen(agent: &Agent, tracked: usize, observed: usize) -> Result<()> {
    agent.wait_tracked(tracked, Duration::from_secs(120))?;
    if !eventually(Duration::from_secs(120), || agent.metric("valet_pods_observed ") as usize == observed) {
        bail!("the agent observes {} pods, want {observed}", agent.metric("valet_pods_observed "));
    }
    Ok(())
}

/// `n` Jobs through the simulated kubelet, from their pods' creation to their deletion once
/// finished: labelled ones quit by the agent, unlabelled ones by the in-pod wrapper. What the API
/// server counted meanwhile.
fn jobs_bill(node: &Node, agent: &Agent, tag: &str, n: usize, labelled: bool, base: usize) -> Result<Traffic> {
    let before = node.api.traffic();
    let mut burst = Burst::start(node, tag, n, Duration::from_secs(2), !labelled)?;
    let (_, lost) = burst.quits()?;
    if lost > 0 {
        bail!("{lost} of {n} {tag} Jobs' proxies were not quit");
    }
    wait_finished(node, &burst.jobs)?;
    remove_jobs(node, std::mem::take(&mut burst.jobs));
    wait_seen(agent, base, base)?;
    Ok(node.api.traffic().since(&before))
}

/// [11]'s figures: the Jobs' traffic, the node at rest per hour, and an agent's restart.
struct Bill {
    pods: usize,
    n: usize,
    labelled: Traffic,
    unlabelled: Traffic,
    rest: AtRest,
    restart: Cost,
    /// The restart's lists read from the watch cache, and from etcd.
    cached: u64,
    quorum: u64,
    /// The agent's pod watches.
    watches: f64,
}

/// The agent's cost at rest, per node-hour: with a real server's bookmarks and watch renewals.
struct AtRest {
    window: Duration,
    requests: f64,
    bytes: f64,
    watch_events: f64,
    kubelet_requests: f64,
    renewals: f64,
    bookmarks: f64,
    class_lists: f64,
}

/// Section 11, the API's bill: requests, bytes and watch events the agent costs the API server,
/// from the fake server's own counters, beside the kubelet's for the same pods: per Job
/// (labelled and unlabelled), per node-hour at rest with a full node, and for an agent's restart
/// (is its re-list read from the watch cache?). Projected to a 5,000-node cluster.
pub(crate) fn api_bill(plan: &Plan, table: &mut Table) -> Result<()> {
    let pods = plan.services + plan.jobs;
    let n = if plan.quick { 5 } else { 20 };
    println!("\n[11] the API's bill: {n} labelled and {n} unlabelled Jobs, {pods} pods at rest, an agent restart");
    let node = Node::new()?;
    let mut agent = node.start_agent(DEFAULTS)?;

    let labelled = jobs_bill(&node, &agent, "billed", n, true, 0)?;
    print_flows(&format!("{n} labelled Jobs"), &labelled);
    // Opened at the start, well within one --watch-timeout: no renewal among them yet.
    let watches = pod_watches(&node);
    println!("  the agent's pod watches: {watches:.0}");
    let unlabelled = jobs_bill(&node, &agent, "unbilled", n, false, 0)?;
    print_flows(&format!("{n} unlabelled Jobs (the in-pod wrapper quits their proxies)"), &unlabelled);

    // At rest: a full node of long-running pods, every app running, the kubelet done reporting.
    let mut services = make_jobs(&node, "resting", pods)?;
    for pod in &mut services {
        pod.start_app("app", &["/bin/sleep", "3600"], &SpawnOptions::default())?;
    }
    wait_seen(&agent, pods, pods)?;
    wait_at_rest(&node, &services)?;
    let rest = at_rest(&node, plan.idle, pods, watches)?;

    // A restart: the agent stops and a new one lists every pod of the node again.
    agent.stop(libc::SIGTERM, Duration::from_secs(30))?;
    let before = node.api.traffic();
    let agent2 = node.start_agent(DEFAULTS)?;
    wait_seen(&agent2, pods, pods)?;
    let restart = node.api.traffic().since(&before);
    print_flows(&format!("an agent's restart with {pods} pods, until its router and observer have them all"), &restart);
    let lists = |read: ListRead| {
        restart
            .total(|f| f.user_agent == AGENT && f.read == read && matches!(f.verb.as_str(), "list" | "watch"))
            .requests
    };
    let (cached, quorum) = (lists(ListRead::WatchCache), lists(ListRead::Quorum));
    let restart = restart.total(|f| f.user_agent == AGENT);
    remove_jobs(&node, services);
    drop(agent2);
    bill_rows(&Bill { pods, n, labelled, unlabelled, rest, restart, cached, quorum, watches }, table);
    Ok(())
}

/// The agent's traffic over `window` with `pods` pods at rest, per node-hour (printed).
fn at_rest(node: &Node, window: Duration, pods: usize, watches: f64) -> Result<AtRest> {
    let before = node.api.traffic();
    let t = Instant::now();
    std::thread::sleep(window);
    let rest = node.api.traffic().since(&before);
    let hours = t.elapsed().as_secs_f64() / 3600.0;
    print_flows(&format!("{pods} pods at rest, {:.0} s", t.elapsed().as_secs_f64()), &rest);
    // The RuntimeClass list the agent makes every RELIST: a window of seconds holds one or none of
    // them, so it is left out of the measured part and added at its period, each list the size of
    // the ones the agent has made since its start.
    let classes = |f: &Flow| f.resource == RUNTIME_CLASSES;
    let rest_agent = rest.total(|f| f.user_agent == AGENT && !classes(f));
    let made = node.api.traffic().total(|f| f.user_agent == AGENT && classes(f));
    let class_list_bytes = made.response_bytes as f64 / made.requests.max(1) as f64;
    let per_hour_class_lists = 3600.0 / RELIST.as_secs_f64();
    let rest_kubelet = rest.total(|f| f.user_agent == KUBELET);
    // Bookmarks at a real server's pace, and each watch renewed once per --watch-timeout. With
    // no event at rest, the watches' bytes are their bookmarks'.
    let rest_watch = rest.total(|f| f.user_agent == AGENT && f.verb == "watch");
    let bookmark_bytes = if rest_agent.bookmarks > 0 && rest_watch.watch_events == 0 {
        rest_watch.response_bytes as f64 / rest_agent.bookmarks as f64
    } else {
        0.0
    };
    let per_hour_bookmarks = watches * 3600.0 / REAL_BOOKMARK_INTERVAL.as_secs_f64();
    let per_hour_renewals = watches * 3600.0 / WATCH_TIMEOUT.as_secs_f64();
    let rest_requests = (rest_agent.requests as f64 / hours) + per_hour_renewals + per_hour_class_lists;
    let measured_bytes = if rest_watch.watch_events == 0 {
        rest_agent.response_bytes.saturating_sub(rest_watch.response_bytes)
    } else {
        rest_agent.response_bytes
    };
    let rest_bytes =
        measured_bytes as f64 / hours + per_hour_bookmarks * bookmark_bytes + per_hour_class_lists * class_list_bytes;
    println!(
        "  at rest, per node-hour: {rest_requests:.1} requests ({:.0} measured, {per_hour_renewals:.1} watch renewals \
         every {} s, {per_hour_class_lists:.0} RuntimeClass lists of {class_list_bytes:.0} B every {} s), {:.0} watch \
         events, {per_hour_bookmarks:.0} bookmarks of {bookmark_bytes:.0} B; the kubelet's pod traffic {:.0} requests",
        rest_agent.requests as f64 / hours,
        WATCH_TIMEOUT.as_secs(),
        RELIST.as_secs(),
        rest_agent.watch_events as f64 / hours,
        rest_kubelet.requests as f64 / hours
    );
    Ok(AtRest {
        window,
        requests: rest_requests,
        bytes: rest_bytes,
        watch_events: rest_agent.watch_events as f64 / hours,
        kubelet_requests: rest_kubelet.requests as f64 / hours,
        renewals: per_hour_renewals,
        bookmarks: per_hour_bookmarks,
        class_lists: per_hour_class_lists,
    })
}

/// [11]'s rows: per Job, at rest, a restart, and the cluster they project to.
fn bill_rows(bill: &Bill, table: &mut Table) {
    let Bill { pods, n, ref rest, ref restart, cached, quorum, watches, .. } = *bill;
    let lab = PerJob::of(&bill.labelled, AGENT, n);
    let lab_kubelet = PerJob::of(&bill.labelled, KUBELET, n);
    let unlab = PerJob::of(&bill.unlabelled, AGENT, n);
    // The kubelet's own watch of its node's pods gets every change of every pod, as each of the
    // agent's does.
    let kubelet_watch = lab.watch_events / watches.max(1.0);
    table.add(
        "[11] API cost per labelled Job, the agent (requests, writes, bytes sent / received, watch events)",
        lab.words(),
        &format!(
            "the kubelet's status syncs for the same Jobs: {}; its pod watch ≈ {:.2} events",
            lab_kubelet.request_words(),
            kubelet_watch
        ),
        "≤ 1 write per labelled Job",
        met(lab.writes <= 1.0).into(),
    );
    table.add(
        "[11] API cost per unlabelled Job, the agent",
        unlab.words(),
        &format!("the kubelet's status syncs: {}", PerJob::of(&bill.unlabelled, KUBELET, n).request_words()),
        "no write",
        met(unlab.writes == 0.0).into(),
    );
    rest_row(pods, rest, table);
    table.add(
        &format!("[11] API cost of an agent restart, {pods} pods (the re-list)"),
        format!(
            "{} requests, {:.1} KiB received, {} watch events",
            restart.requests,
            restart.response_bytes as f64 / 1024.0,
            restart.watch_events
        ),
        &format!("lists and streaming lists from the watch cache: {cached}, from etcd: {quorum}"),
        "no quorum read",
        met(quorum == 0 && cached > 0).into(),
    );
    // The cluster: every Job labelled, each node at rest besides.
    let jobs_per_s = JOBS_PER_MINUTE / 60.0;
    table.add(
        &format!(
            "[11] projected: {NODES:.0} nodes × {pods} pods, {JOBS_PER_MINUTE:.0} labelled Jobs a minute (writes/s, requests/s, watch events/s)"
        ),
        format!(
            "{:.1} writes/s, {:.1} requests/s, {:.0} watch events/s",
            lab.writes * jobs_per_s,
            lab.requests * jobs_per_s + rest.requests * NODES / 3600.0,
            lab.watch_events * jobs_per_s + rest.watch_events * NODES / 3600.0
        ),
        &format!(
            "the kubelets: {:.1} writes/s, {:.1} requests/s for the same Jobs",
            lab_kubelet.writes * jobs_per_s,
            lab_kubelet.requests * jobs_per_s
        ),
        "—",
        format!(
            "a DaemonSet rollout (every agent re-lists): {:.0} requests, {:.1} GiB from the watch cache",
            restart.requests as f64 * NODES,
            restart.response_bytes as f64 * NODES / (1u64 << 30) as f64
        ),
    );
}

/// [11]'s row of the node at rest, per node-hour.
fn rest_row(pods: usize, rest: &AtRest, table: &mut Table) {
    table.add(
        &format!("[11] API cost per node-hour at rest, {pods} pods, the agent"),
        format!(
            "{:.1} requests, {:.1} KiB received, {:.0} watch events",
            rest.requests,
            rest.bytes / 1024.0,
            rest.watch_events
        ),
        &format!("the kubelet's pod status syncs: {:.0} requests", rest.kubelet_requests),
        "—",
        format!(
            "measured over {:.0} s; {:.1} watch renewals and {:.0} bookmarks an hour added at a real server's pace, \
             {:.0} RuntimeClass lists at the agent's",
            rest.window.as_secs_f64(),
            rest.renewals,
            rest.bookmarks,
            rest.class_lists
        ),
    );
}
