//! valet-agent: wires configuration, telemetry, the kernel programs, the API client, the metrics
//! server and the pod router's loop together.
#![forbid(unsafe_code)]

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use aya::maps::{MapData, RingBuf};
use clap::Parser as _;
use futures::StreamExt as _;
use futures::stream::BoxStream;
use k8s_openapi::api::core::v1::Pod;
use kube::runtime::watcher;
use nix::sys::signal::{SigSet, Signal};
use tracing::{error, info, warn};
use tracing_subscriber::EnvFilter;
use valet_agent::act::{Actuators, Parts, Settings};
use valet_agent::api::events::EventSink;
use valet_agent::api::runtime_classes::RuntimeHandlers;
use valet_agent::api::successor::{self, Stop};
use valet_agent::cgroup::CgroupFs;
use valet_agent::cgroup::root::{Hierarchy, NodeCgroups, find_node_cgroups};
use valet_agent::config::{Config, HostPaths, KeeperConfig, LogFormat, NodeFlags, PinFlags};
use valet_agent::deadline_keeper::{DEFER, Keeper, KeeperSettings};
use valet_agent::ended_by_valet::EndedByValet;
use valet_agent::error::Chain;
use valet_agent::host::clock::monotonic_ns;
use valet_agent::host::{read_only, resident};
use valet_agent::kernel::held_ledger::pin_paths;
use valet_agent::kernel::mode::{self, NoKernel, NodeEvents, NodeFacts, NodeKernel};
use valet_agent::kernel::{Attach, EventReader, Programs};
use valet_agent::metrics::Metrics;
use valet_agent::observe::{NetnsProbe, Observer};
use valet_agent::pod::spec::SidecarDefaults;
use valet_agent::pod::state::Rules;
use valet_agent::pod_router::PodRouter;
use valet_agent::runtime::RuntimeBundles;
use valet_agent::server::{self, Health};
use valet_agent::sidecar::netns::PodNetwork;
use valet_agent::vocab::NodeMode;

/// How often the allocator's free memory is given back to the node (`malloc_trim`): a walk of
/// its arenas (the idle CPU rows of the bench [8], [12] include it).
const HEAP_TRIM: Duration = Duration::from_secs(30);

/// Pods come and go for the agent's lifetime, each object parsed whole and dropped: what the
/// allocator keeps of that in its free lists goes back to the node every [`HEAP_TRIM`].
fn spawn_heap_trim() {
    tokio::spawn(async {
        let mut every = tokio::time::interval_at(tokio::time::Instant::now() + HEAP_TRIM, HEAP_TRIM);
        loop {
            every.tick().await;
            resident::trim_heap();
        }
    });
}

/// Gives back what loading used once: the heap's free memory (loading parsed the kernel's BTF,
/// megabytes freed since, which the allocator would otherwise keep for the agent's lifetime), and
/// the executable's pages loading ran through (with the kernel's fault-around, nearly its whole
/// text stays mapped otherwise; unmapped, the agent maps again only what it runs from here on).
/// Then trims the heap every [`HEAP_TRIM`].
fn settle_after_loading() {
    resident::trim_heap();
    let unmapped_kib = resident::unmap_start_up_pages();
    let resident = resident::Resident::now();
    info!(rss_kib = resident.rss_kib, peak_kib = resident.peak_kib, unmapped_kib, "resident memory after loading");
    spawn_heap_trim();
}

fn init_logging(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    use std::io::IsTerminal as _;
    // Colours only for a person at a terminal, never in files or container logs.
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_ansi(std::io::stdout().is_terminal());
    match format {
        LogFormat::Json => builder.json().init(),
        LogFormat::Text => builder.init(),
    }
}

/// Resolves on SIGTERM (the kubelet stopping the container) or SIGINT, once it is known whether
/// a successor takes the holds over ([`successor::at_sigterm_from_env`]).
async fn shutdown_signal(node: NodeFlags) -> Stop {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => info!("SIGTERM received"),
        _ = int.recv() => info!("SIGINT received"),
    }
    let stop = successor::at_sigterm_from_env(&node.own_pod()).await;
    stop.log("valet-agent");
    stop
}

/// Where the deadline keeper reads the holds, and an old record's deadline: the same flags in the
/// agent and in `valet-agent deadlines`.
fn keeper_settings(host: &HostPaths, pins: &PinFlags) -> KeeperSettings {
    KeeperSettings {
        pins: pin_paths(&pins.pin_dir, &pins.old_pin_dirs),
        host_proc: host.host_proc.clone(),
        default_timeout: pins.old_record_timeout,
    }
}

/// Releases the held apps past their deadline in the pinned record of holds, first thing (before
/// anything that can fail or wait for the API), then keeps doing so on a thread of its own for
/// the agent's life: a crash loop or an API outage leaves no app stopped past its deadline.
fn keep_deadlines(
    cfg: &Config,
    found: &Result<NodeCgroups, valet_agent::Error>,
    metrics: &Arc<Metrics>,
    health: &Arc<Health>,
) {
    match found {
        Ok(found) => {
            let settings = keeper_settings(&cfg.host, &cfg.pins);
            // Until the pods are listed no pod loop can release; from then on they release first.
            let health = health.clone();
            let defer = move || {
                if health.pods_listed.load(std::sync::atomic::Ordering::Relaxed) { DEFER } else { Duration::ZERO }
            };
            Keeper::new(settings, CgroupFs::new(found.root.clone()), Some(metrics.clone()), defer).start();
        }
        Err(e) => error!("no cgroup hierarchy, so no release of held apps at their deadline: {}", e.chain()),
    }
}

/// The API clients: one for the watches, one for the writes, both named `valet-agent/<version>`.
async fn clients() -> anyhow::Result<(kube::Client, kube::Client)> {
    let mut config = kube::Config::infer().await.context("Kubernetes client config (in-cluster or KUBECONFIG)")?;
    // kube's client names itself to nobody: the API server's audit log and the cluster owner's
    // per-client figures see valet by this.
    config.headers.push((
        http::header::USER_AGENT,
        http::HeaderValue::from_static(concat!("valet-agent/", env!("CARGO_PKG_VERSION"))),
    ));
    let builder =
        |config| kube::client::ClientBuilder::try_from(config).context("Kubernetes client (in-cluster or KUBECONFIG)");
    let watches = valet_agent::api::watch_client(builder(config.clone())?);
    let writes = valet_agent::api::writes_client(builder(config)?);
    Ok((watches, writes))
}

/// The kernel programs, loaded, or the reason the node runs without them (degraded).
fn load_kernel(cfg: &Config, hierarchy: Hierarchy) -> (NodeKernel, NodeMode) {
    let attach = Attach { ancestors: cfg.kernel.cgroup_ancestors, hierarchy, ..Attach::default() };
    resident::note("before loading the kernel programs");
    let btf = cfg.kernel.btf_path();
    match Programs::load_with_btf(&cfg.kernel.host_root, attach, Some(&cfg.pins.pin_dir), &btf) {
        Ok(programs) => (NodeKernel::Loaded(Box::new(programs)), NodeMode::Kernel),
        Err(e) => {
            // A node valet cannot watch in the kernel is still served, from the API: a crash
            // loop would help no pod on it.
            let why = e.chain().to_string();
            let reason = mode::classify(&why, &NodeFacts::read(&cfg.kernel.host_root, &btf));
            warn!(
                mode = "degraded",
                reason = reason.as_str(),
                "kernel programs not loaded: {}. Running degraded: containers' ends are taken from the API \
                 (about a second after the kubelet sees them, not as they happen) and no app is held \
                 (pods asking for a hold run unheld, with an Event). Cause: {why}",
                reason.explain()
            );
            (NodeKernel::Degraded(NoKernel), NodeMode::Degraded(reason))
        }
    }
}

/// Readiness by the node's mode: a rollout that degrades its nodes for a reason the operator does
/// not expect stops there.
fn judge_mode(cfg: &Config, mode: NodeMode, metrics: &Metrics, health: &Health) -> anyhow::Result<()> {
    metrics.set_node_mode(mode);
    if let Some(why) = cfg.kernel.expected_degraded()?.unready(mode) {
        warn!(
            mode = "degraded",
            reason = mode.reason_label(),
            "not ready: {why}. The node is still served degraded; /readyz fails so that a DaemonSet rollout \
             stops at this node (expect this reason with --degraded-ok to make the node ready)"
        );
        health.degraded_unexpectedly(why);
    }
    Ok(())
}

/// With the programs loaded: their log drained, an earlier version's records of holds moved into
/// this version's pin, and the kernel's event ring handed out.
fn take_kernel_outputs(cfg: &Config, kernel: &mut NodeKernel) -> anyhow::Result<Option<RingBuf<MapData>>> {
    let NodeKernel::Loaded(programs) = kernel else { return Ok(None) };
    if let Some(logger) = programs.take_logger() {
        tokio::spawn(valet_agent::kernel::programs::drain_kernel_log(logger));
    }
    // Version N reads version N−1's records: they move into this version's pin.
    let own_pin = cfg.pins.pin_dir.join(valet_common::PIN_HELD);
    let old_pins: Vec<_> =
        pin_paths(&cfg.pins.pin_dir, &cfg.pins.old_pin_dirs).into_iter().filter(|p| *p != own_pin).collect();
    let moved = programs.held_ledger().migrate(&old_pins, cfg.pins.old_record_timeout);
    if moved > 0 {
        info!(moved, "records of holds taken over from an earlier version");
    }
    Ok(Some(programs.take_events().context("kernel event ring buffer")?))
}

/// The sidecar names and hold timeout a pod without annotations gets.
fn sidecar_defaults(cfg: &Config) -> SidecarDefaults {
    SidecarDefaults { names: cfg.pods.sidecar_names.clone(), hold_timeout: cfg.holds.hold_timeout }
}

/// The runtime's records (bundles): the fixed directories, then through the runtime's processes.
fn runtime_bundles(cfg: &Config) -> RuntimeBundles {
    RuntimeBundles::new(cfg.runtime_dirs(), Some(cfg.host.host_proc.clone())).with_root(cfg.kernel.host_root.clone())
}

/// Observes every pod on the node with a known sidecar (`--observe`), on a task of its own.
fn start_observer(
    cfg: &Config,
    watch: ObserverWatch,
    metrics: Arc<Metrics>,
    cgroups: CgroupFs,
    ended_by_valet: Arc<EndedByValet>,
) {
    let settings = valet_agent::observe::Settings {
        node: cfg.node.node_name.clone(),
        defaults: sidecar_defaults(cfg),
        namespace_label: cfg.observe.observe_namespace_label,
        max_namespaces: cfg.observe.observe_max_namespaces,
        act: cfg.observe.act,
    };
    let bundles = Arc::new(std::sync::Mutex::new(runtime_bundles(cfg)));
    let probe = NetnsProbe { host_proc: cfg.host.host_proc.clone(), cgroups, bundles };
    let observer = Observer::new(settings, metrics, Arc::new(probe), ended_by_valet);
    tokio::spawn(observer.run(watch));
}

type RouterWatch = BoxStream<'static, Result<watcher::Event<Pod>, watcher::Error>>;
type ObserverWatch = BoxStream<'static, Result<watcher::Event<Pod>, String>>;

/// The pod router's watch (none with `--act=false`) and the observer's (none with
/// `--observe=false`): one watch of every pod on the node shared by both when both run, so that
/// the API server sends a labelled pod's events once.
fn pod_watches(cfg: &Config, client: &kube::Client) -> (Option<RouterWatch>, Option<ObserverWatch>) {
    use valet_agent::api::watch;
    let (node, timeout) = (cfg.node.node_name.as_str(), cfg.pods.watch_timeout);
    match (cfg.observe.act, cfg.observe.observe) {
        (true, true) => {
            let (router, observer) = watch::shared_pods_on_node(client.clone(), node, timeout);
            (Some(router.boxed()), Some(observer.boxed()))
        }
        (true, false) => (Some(watch::pods_on_node(client.clone(), node, timeout).boxed()), None),
        (false, true) => {
            let all = watch::all_pods_on_node(client.clone(), node, timeout);
            (None, Some(all.map(|item| item.map_err(|e| e.to_string())).boxed()))
        }
        (false, false) => (None, None),
    }
}

/// What the actuators need from the flags.
fn act_settings(cfg: &Config) -> Settings {
    let probes = &cfg.probes;
    Settings {
        host_proc: cfg.host.host_proc.clone(),
        quit_timeout: cfg.quits.quit_timeout,
        quit_retry_for: cfg.quits.quit_retry_for,
        probe_interval: probes.probe_interval,
        ready_probe_interval: probes.ready_probe_interval,
        held_probe_interval: probes.held_probe_interval,
        held_probe_cpu: probes.held_probe_cpu / 100.0,
        held_probe_budget: probes.held_probe_budget,
        held_prober: probes.held_prober,
        release_priority: cfg.holds.release_priority,
        decide_priority: cfg.holds.decide_priority,
        urgent_priority: cfg.holds.decide_priority.max(cfg.holds.loop_priority),
        record_dirs: cfg.record_dirs(),
        log_links: cfg.log_links_dir(),
    }
}

/// The pod loops' rules: the flags', the node's mode, and the RuntimeClasses the API lists.
fn rules(cfg: &Config, mode: NodeMode, runtime_handlers: RuntimeHandlers) -> Rules {
    Rules {
        defaults: sidecar_defaults(cfg),
        escalate_after: (!cfg.quits.no_escalation).then_some(cfg.quits.escalate_after),
        mode,
        sandboxed_classes: cfg.pods.sandboxed_runtime_classes.iter().map(|c| c.trim().to_owned()).collect(),
        quit_events: cfg.quits.quit_events,
        runtime_handlers,
        default_handler: cfg.pods.default_runtime_handler.clone().filter(|h| !h.trim().is_empty()),
    }
}

/// `node_cgroups`: the node's hierarchy, found once at start ([`find_node_cgroups`]).
async fn run(
    cfg: Config,
    node_cgroups: Result<NodeCgroups, valet_agent::Error>,
    metrics: Arc<Metrics>,
    health: Arc<Health>,
) -> anyhow::Result<Stop> {
    cfg.validate()?;
    let cfg = Arc::new(cfg);
    let node_cgroups = node_cgroups?;
    info!(
        node = %cfg.node.node_name,
        cgroup_root = %node_cgroups.root.display(),
        hierarchy = ?node_cgroups.hierarchy,
        "starting valet-agent {}",
        env!("CARGO_PKG_VERSION")
    );

    // Bind first: a bad or busy address is a configuration error, reported before anything else.
    let listener = server::bind(cfg.server.metrics_addr).await?;
    tokio::spawn(server::serve(listener, metrics.clone(), health.clone()));
    let (client, writes) = clients().await?;

    let (mut kernel, mode) = load_kernel(&cfg, node_cgroups.hierarchy);
    judge_mode(&cfg, mode, &metrics, &health)?;
    let ring = take_kernel_outputs(&cfg, &mut kernel)?;
    settle_after_loading();

    let cgroups = CgroupFs::new(node_cgroups.root);
    let ended_by_valet = Arc::new(EndedByValet::default());
    let (router_watch, observer_watch) = pod_watches(&cfg, &client);
    if let Some(watch) = observer_watch {
        start_observer(&cfg, watch, metrics.clone(), cgroups.clone(), ended_by_valet.clone());
    }
    let (feedback_tx, feedback_rx) = tokio::sync::mpsc::unbounded_channel();
    let act = Actuators::new(Parts {
        settings: act_settings(&cfg),
        cgroups: cgroups.clone(),
        bundles: runtime_bundles(&cfg),
        kernel,
        link: Arc::new(PodNetwork::new(cfg.host.host_proc.clone(), cgroups, runtime_bundles(&cfg))),
        client: writes.clone(),
        events: EventSink::new(writes, &cfg.node.node_name),
        metrics,
        feedback: feedback_tx,
        ended_by_valet,
    });
    // The ring buffer's reader thread sends the quits armed ahead the moment it reads an end; it
    // runs in the loop's class.
    let loop_priority = cfg.holds.decide_priority.max(cfg.holds.loop_priority);
    let events = match ring {
        Some(ring) => NodeEvents::Reader(EventReader::spawn(ring, act.quits_ahead(), loop_priority)?),
        None => NodeEvents::None,
    };
    // The RuntimeClasses (sandboxes known by their handler), listed before the first pod.
    let runtime_handlers = RuntimeHandlers::default();
    runtime_handlers.start(client.clone()).await;
    let router = PodRouter::new(&cfg.node.node_name, rules(&cfg, mode, runtime_handlers), act, feedback_rx, health);
    // Leave time within the usual 30 s grace period (after the lookup at SIGTERM, at most
    // `successor::LOOKUP_BUDGET`) for in-flight quits to finish.
    let drain = Duration::from_secs(10);
    let shutdown = shutdown_signal(cfg.node.clone());
    // The loop runs on this thread (the runtime's `block_on`): from here on in its own class
    // (`--loop-priority`, or the decision path's), once the start's work (loading the programs)
    // is done.
    valet_agent::host::sys::enter_real_time("the loop", loop_priority);
    let stop = if let Some(watch) = router_watch {
        router.run(events, watch, shutdown, drain).await
    } else {
        // Look-only: the router is given no pod (an empty list, then nothing), so it acts on none.
        info!("--act=false: no pod is acted on; labelled pods are only observed");
        let none = futures::stream::iter([Ok(watcher::Event::Init), Ok(watcher::Event::InitDone)])
            .chain(futures::stream::pending());
        router.run(events, none, shutdown, drain).await
    };
    info!("stopped");
    Ok(stop)
}

/// `--cgroup-read-only`: every mount of the host's cgroup fs in this container's view made
/// read-only ([`read_only::make_read_only`]), and what came of it logged.
fn read_only_cgroups(host: &HostPaths) {
    if !host.cgroup_read_only {
        return;
    }
    match read_only::make_read_only(&host.cgroup_mount) {
        Ok(done) if done.writable.is_empty() => {
            info!(
                mounts = done.mounts,
                made_read_only = done.changed,
                how = done.how,
                "the host's cgroup fs is read-only here"
            )
        }
        Ok(done) => warn!(
            mounts = done.mounts,
            writable = ?done.writable,
            error = done.error.as_deref().unwrap_or("none"),
            "mounts of the host's cgroup fs stay writable here (CAP_SYS_ADMIN missing, or refused)"
        ),
        Err(why) => warn!("--cgroup-read-only: {why}"),
    }
}

/// `valet-agent deadlines`: the DaemonSet pod's second container. It releases every held app
/// whose deadline has passed, reading nothing but the pinned record of holds, `/proc` and the
/// cgroup tree: no API, no kernel programs. It outlives the agent's crashes (the kubelet restarts
/// a crashed container with a backoff of up to 5 minutes and leaves the pod's other containers
/// running), so a held app runs again at its deadline even while no agent does. At SIGTERM (its
/// pod deleted) it releases every app still held only when no successor will come (an
/// uninstall: the same decision as the agent's, [`successor::at_sigterm_from_env`]).
fn deadlines_main() -> std::process::ExitCode {
    let args = KeeperConfig::parse_from_args(std::env::args().skip(1));
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    tracing_subscriber::fmt().with_env_filter(filter).with_ansi(false).init();
    read_only_cgroups(&args.host);
    // The keeper's CAP_SYS_ADMIN is for the line above only: given up before any thread starts
    // (capabilities are per thread; the threads made later inherit the sets without it).
    if let Err(e) = read_only::give_up_sys_admin() {
        error!("cannot give up CAP_SYS_ADMIN: {e}");
        return std::process::ExitCode::FAILURE;
    }
    info!("CAP_SYS_ADMIN given up");
    // Blocked before any thread starts (threads inherit the mask): this thread waits for them.
    let mut stop = SigSet::empty();
    stop.add(Signal::SIGTERM);
    stop.add(Signal::SIGINT);
    if let Err(e) = stop.thread_block() {
        error!("cannot block SIGTERM: {e}");
        return std::process::ExitCode::FAILURE;
    }
    let root = match find_node_cgroups(args.host.cgroup_root.as_deref(), &args.host.cgroup_mount, &args.host.host_proc)
    {
        Ok(found) => found.root,
        Err(e) => {
            error!("{}", e.chain());
            return std::process::ExitCode::FAILURE;
        }
    };
    let settings = keeper_settings(&args.host, &args.pins);
    info!(pins = ?settings.pins, "releasing held apps at their deadline");
    let cgroups = CgroupFs::new(root);
    // Beside a running agent: its pod loops release first (the agent's own thread does the
    // same once the pods are listed).
    Keeper::new(settings.clone(), cgroups.clone(), None, || DEFER).exit_when_refused().start();
    // Its start ran through code it never runs again (the agent's too: one binary).
    let unmapped_kib = resident::unmap_start_up_pages();
    info!(rss_kib = resident::Resident::now().rss_kib, unmapped_kib, "resident memory after starting");
    match stop.wait() {
        Ok(signal) => info!("{signal:?} received"),
        Err(e) => error!("waiting for SIGTERM: {e}"),
    }
    // Only an uninstall leaves nothing stopped behind the pod; a successor takes the rest over.
    let decided = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map(|rt| rt.block_on(successor::at_sigterm_from_env(&args.node.own_pod())))
        .unwrap_or_else(|e| Stop::Keep(format!("no async runtime: {e}")));
    decided.log("valet-deadlines");
    if decided.releases() {
        let last = Keeper::new(settings, cgroups, None, || Duration::ZERO).release_all();
        info!(released = last.released, records = last.records, now_ns = monotonic_ns(), "stopped");
    } else {
        info!(verdict = decided.verdict(), now_ns = monotonic_ns(), "stopped, holds left pinned");
    }
    std::process::ExitCode::SUCCESS
}

fn main() -> std::process::ExitCode {
    if std::env::args().nth(1).as_deref() == Some("deadlines") {
        return deadlines_main();
    }
    let cfg = Config::parse();
    init_logging(cfg.server.log_format);
    read_only_cgroups(&cfg.host);
    let metrics = Arc::new(Metrics::new());
    let health = Arc::new(Health::default());
    // Found once: the deadlines' thread, the agent and its last release at shutdown share it.
    let node_cgroups = find_node_cgroups(cfg.host.cgroup_root.as_deref(), &cfg.host.cgroup_mount, &cfg.host.host_proc);
    keep_deadlines(&cfg, &node_cgroups, &metrics, &health);
    let shutdown_root = node_cgroups.as_ref().ok().map(|found| found.root.clone());
    // Every thread of the agent's is named valet-*: in `ps`, `top` and a guest kernel's panic
    // report (`Comm: valet-worker`), its threads are known as the agent's.
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("valet-worker")
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("valet-agent: cannot start the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let settings = keeper_settings(&cfg.host, &cfg.pins);
    match runtime.block_on(run(cfg, node_cgroups, metrics, health)) {
        Ok(stop) => {
            // Stopped with no successor to come (an uninstall, or run outside a pod): no app
            // stays stopped behind this agent, not even one whose pod it never got to list.
            if stop.releases()
                && let Some(root) = shutdown_root
            {
                let left = Keeper::new(settings, CgroupFs::new(root), None, || Duration::ZERO).release_all();
                if left.released > 0 {
                    info!(released = left.released, "released the held apps no pod had released at shutdown");
                }
            }
            std::process::ExitCode::SUCCESS
        }
        Err(e) => {
            error!("{}", Chain(e.as_ref()));
            std::process::ExitCode::FAILURE
        }
    }
}
