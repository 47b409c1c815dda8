//! valet-agent: wires configuration, telemetry, the kernel programs, the API client, the metrics
//! server and the controller loop together.
#![forbid(unsafe_code)]

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser as _;
use futures::StreamExt as _;
use kube::runtime::watcher;
use nix::sys::signal::{SigSet, Signal};
use std::path::PathBuf;
use tracing::{error, info, warn};
use tracing_subscriber::EnvFilter;
use valet_agent::act::{Actuators, Parts, Settings};
use valet_agent::api::events::EventSink;
use valet_agent::api::runtime_classes::RuntimeHandlers;
use valet_agent::api::successor::{self, Stop};
use valet_agent::cgroup::CgroupFs;
use valet_agent::cgroup::root::{NodeCgroups, find_node_cgroups};
use valet_agent::config::{Config, LogFormat};
use valet_agent::config::{OLD_RECORD_TIMEOUT, parse_duration};
use valet_agent::controller::Controller;
use valet_agent::error::Chain;
use valet_agent::host::clock::monotonic_ns;
use valet_agent::host::resident;
use valet_agent::kernel::deadlines::{DEFER, Keeper, KeeperSettings};
use valet_agent::kernel::held_ledger::pin_paths;
use valet_agent::kernel::mode::{self, NoKernel, NodeEvents, NodeFacts, NodeKernel};
use valet_agent::kernel::{Attach, EventReader, Programs};
use valet_agent::metrics::Metrics;
use valet_agent::observe::{NetnsProbe, Observer};
use valet_agent::pod::spec::SidecarDefaults;
use valet_agent::pod::state::Rules;
use valet_agent::runtime::RuntimeBundles;
use valet_agent::server::{self, Health};
use valet_agent::sidecar::netns::PodNetwork;
use valet_agent::vocab::NodeMode;

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
async fn shutdown_signal(node: String) -> Stop {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => info!("SIGTERM received"),
        _ = int.recv() => info!("SIGINT received"),
    }
    let stop = successor::at_sigterm_from_env(&node).await;
    stop.log("valet-agent");
    stop
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
            let root = found.root.clone();
            let settings = KeeperSettings {
                pins: pin_paths(&cfg.pin_dir, &cfg.old_pin_dirs),
                host_proc: cfg.host_proc.clone(),
                default_timeout: cfg.old_record_timeout,
            };
            // Until the pods are listed no pod loop can release; from then on they release first.
            let health = health.clone();
            let defer = move || {
                if health.pods_listed.load(std::sync::atomic::Ordering::Relaxed) { DEFER } else { Duration::ZERO }
            };
            Keeper::new(settings, CgroupFs::new(root), Some(metrics.clone()), defer).start();
        }
        Err(e) => error!("no cgroup hierarchy, so no release of held apps at their deadline: {}", e.chain()),
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
        node = %cfg.node_name,
        cgroup_root = %node_cgroups.root.display(),
        hierarchy = ?node_cgroups.hierarchy,
        "starting valet-agent {}",
        env!("CARGO_PKG_VERSION")
    );

    // Bind first: a bad or busy address is a configuration error, reported before anything else.
    let listener = server::bind(cfg.metrics_addr).await?;
    tokio::spawn(server::serve(listener, metrics.clone(), health.clone()));

    let mut config = kube::Config::infer().await.context("Kubernetes client config (in-cluster or KUBECONFIG)")?;
    // kube's client names itself to nobody: the API server's audit log and the cluster owner's
    // per-client figures see valet by this.
    config.headers.push((
        http::header::USER_AGENT,
        http::HeaderValue::from_static(concat!("valet-agent/", env!("CARGO_PKG_VERSION"))),
    ));
    let client = valet_agent::api::watch_client(
        kube::client::ClientBuilder::try_from(config.clone())
            .context("Kubernetes client (in-cluster or KUBECONFIG)")?,
    );
    let writes = valet_agent::api::writes_client(
        kube::client::ClientBuilder::try_from(config).context("Kubernetes client (in-cluster or KUBECONFIG)")?,
    );

    let attach = Attach { ancestors: cfg.cgroup_ancestors, hierarchy: node_cgroups.hierarchy, ..Attach::default() };
    resident::note("before loading the kernel programs");
    let btf = cfg.btf_path();
    let (mut kernel, mode) = match Programs::load_with_btf(&cfg.host_root, attach, Some(&cfg.pin_dir), &btf) {
        Ok(programs) => (NodeKernel::Loaded(Box::new(programs)), NodeMode::Kernel),
        Err(e) => {
            // A node valet cannot watch in the kernel is still served, from the API: a crash
            // loop would help no pod on it.
            let why = e.chain().to_string();
            let reason = mode::classify(&why, &NodeFacts::read(&cfg.host_root, &btf));
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
    };
    metrics.set_node_mode(mode);
    // A rollout that degrades its nodes for a reason the operator does not expect stops there.
    if let Some(why) = cfg.expected_degraded()?.unready(mode) {
        warn!(
            mode = "degraded",
            reason = mode.reason_label(),
            "not ready: {why}. The node is still served degraded; /readyz fails so that a DaemonSet rollout \
             stops at this node (expect this reason with --degraded-ok to make the node ready)"
        );
        health.degraded_unexpectedly(why);
    }
    let mut ring = None;
    if let NodeKernel::Loaded(programs) = &mut kernel {
        if let Some(logger) = programs.take_logger() {
            tokio::spawn(valet_agent::kernel::programs::drain_kernel_log(logger));
        }
        // Version N reads version N−1's records: they move into this version's pin.
        let own_pin = cfg.pin_dir.join(valet_common::PIN_HELD);
        let old_pins: Vec<_> =
            pin_paths(&cfg.pin_dir, &cfg.old_pin_dirs).into_iter().filter(|p| *p != own_pin).collect();
        let moved = programs.held_ledger().migrate(&old_pins, cfg.old_record_timeout);
        if moved > 0 {
            info!(moved, "records of holds taken over from an earlier version");
        }
        ring = Some(programs.take_events().context("kernel event ring buffer")?);
    }
    // Loading parsed the kernel's BTF (megabytes, freed since): give that memory back to the
    // node rather than keep it in the allocator's free lists for the agent's lifetime.
    resident::trim_heap();
    let resident = resident::Resident::now();
    info!(rss_kib = resident.rss_kib, peak_kib = resident.peak_kib, "resident memory after loading");

    let cgroups = CgroupFs::new(node_cgroups.root);
    let quit_pods = Arc::new(valet_agent::acted::QuitPods::default());
    if cfg.observe {
        let settings = valet_agent::observe::Settings {
            node: cfg.node_name.clone(),
            defaults: SidecarDefaults { names: cfg.sidecar_names.clone(), hold_timeout: cfg.hold_timeout },
            namespace_label: cfg.observe_namespace_label,
            max_namespaces: cfg.observe_max_namespaces,
            act: cfg.act,
        };
        let probe = NetnsProbe { host_proc: cfg.host_proc.clone(), cgroups: cgroups.clone() };
        let observer = Observer::new(settings, metrics.clone(), Arc::new(probe), quit_pods.clone());
        tokio::spawn(observer.run(valet_agent::api::watch::all_pods_on_node(
            client.clone(),
            &cfg.node_name,
            cfg.watch_timeout,
        )));
    }
    let (reports_tx, reports_rx) = tokio::sync::mpsc::unbounded_channel();
    let act = Actuators::new(Parts {
        settings: Settings {
            host_proc: cfg.host_proc.clone(),
            quit_timeout: cfg.quit_timeout,
            quit_retry_for: cfg.quit_retry_for,
            probe_interval: cfg.probe_interval,
            ready_probe_interval: cfg.ready_probe_interval,
            held_probe_interval: cfg.held_probe_interval,
            held_probe_cpu: cfg.held_probe_cpu / 100.0,
            held_probe_budget: cfg.held_probe_budget,
            held_prober: cfg.held_prober,
            release_priority: cfg.release_priority,
        },
        cgroups: cgroups.clone(),
        bundles: RuntimeBundles::new(cfg.runtime_dirs(), Some(cfg.host_proc.clone())),
        kernel,
        link: Arc::new(PodNetwork::new(cfg.host_proc.clone(), cgroups)),
        client: writes.clone(),
        events: EventSink::new(writes, &cfg.node_name),
        metrics,
        reports: reports_tx,
        quit_pods,
    });
    // The ring buffer's reader thread sends the quits armed ahead the moment it reads an end.
    let events = match ring {
        Some(ring) => NodeEvents::Reader(EventReader::spawn(ring, act.quits_ahead())?),
        None => NodeEvents::None,
    };
    // The RuntimeClasses (sandboxes known by their handler), listed before the first pod.
    let runtime_handlers = RuntimeHandlers::default();
    runtime_handlers.start(client.clone()).await;
    let rules = Rules {
        defaults: SidecarDefaults { names: cfg.sidecar_names.clone(), hold_timeout: cfg.hold_timeout },
        escalate_after: (!cfg.no_escalation).then_some(cfg.escalate_after),
        mode,
        sandboxed_classes: cfg.sandboxed_runtime_classes.iter().map(|c| c.trim().to_owned()).collect(),
        quit_events: cfg.quit_events,
        runtime_handlers: runtime_handlers.clone(),
        default_handler: cfg.default_runtime_handler.clone().filter(|h| !h.trim().is_empty()),
    };
    let controller = Controller::new(&cfg.node_name, rules, act, reports_rx, health);
    // Leave time within the usual 30 s grace period (after the lookup at SIGTERM, at most
    // `successor::LOOKUP_BUDGET`) for in-flight quits to finish.
    let drain = Duration::from_secs(10);
    let shutdown = shutdown_signal(cfg.node_name.clone());
    let stop = if cfg.act {
        let watch = valet_agent::api::watch::pods_on_node(client, &cfg.node_name, cfg.watch_timeout);
        controller.run(events, watch, shutdown, drain).await
    } else {
        // Look-only: the controller is given no pod (an empty list, then nothing), so it acts on none.
        info!("--act=false: no pod is acted on; labelled pods are only observed");
        let none = futures::stream::iter([Ok(watcher::Event::Init), Ok(watcher::Event::InitDone)])
            .chain(futures::stream::pending());
        controller.run(events, none, shutdown, drain).await
    };
    info!("stopped");
    Ok(stop)
}

/// `valet-agent deadlines`: the DaemonSet pod's second container. It releases every held app
/// whose deadline has passed, reading nothing but the pinned record of holds, `/proc` and the
/// cgroup tree: no API, no kernel programs. It outlives the agent's crashes (the kubelet restarts
/// a crashed container with a backoff of up to 5 minutes and leaves the pod's other containers
/// running), so a held app runs again at its deadline even while no agent does. At SIGTERM (its
/// pod deleted) it releases every app still held only when no successor will come (an
/// uninstall: the same decision as the agent's, [`successor::at_sigterm_from_env`]).
/// Releases held apps at their deadline (see the agent's flags of the same names).
#[derive(clap::Parser, Debug)]
#[command(name = "valet-agent deadlines", version)]
struct DeadlineArgs {
    #[arg(long, env = "VALET_PIN_DIR", default_value = "/sys/fs/bpf/valet")]
    pin_dir: PathBuf,
    #[arg(long = "old-pin-dirs", visible_alias = "old-pin-dir", env = "VALET_OLD_PIN_DIRS", value_delimiter = ',')]
    old_pin_dirs: Vec<PathBuf>,
    #[arg(long, env = "VALET_HOST_PROC", default_value = "/proc")]
    host_proc: PathBuf,
    #[arg(long, env = "VALET_CGROUP_ROOT")]
    cgroup_root: Option<PathBuf>,
    #[arg(long, env = "VALET_CGROUP_MOUNT", default_value = "/sys/fs/cgroup")]
    cgroup_mount: PathBuf,
    /// Hold timeout of records that carry no deadline (an older version's): the agent's setting
    /// of the same name, which must be the same.
    #[arg(long, env = "VALET_OLD_RECORD_TIMEOUT", default_value = OLD_RECORD_TIMEOUT, value_parser = parse_duration)]
    old_record_timeout: Duration,
    /// This node's name: whether it still fits the DaemonSet, at SIGTERM.
    #[arg(long, env = "NODE_NAME", default_value = "")]
    node_name: String,
}

fn deadlines_main() -> std::process::ExitCode {
    let args = DeadlineArgs::parse_from(std::env::args().skip(1));
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    tracing_subscriber::fmt().with_env_filter(filter).with_ansi(false).init();
    // Blocked before any thread starts (threads inherit the mask): this thread waits for them.
    let mut stop = SigSet::empty();
    stop.add(Signal::SIGTERM);
    stop.add(Signal::SIGINT);
    if let Err(e) = stop.thread_block() {
        error!("cannot block SIGTERM: {e}");
        return std::process::ExitCode::FAILURE;
    }
    let root = match find_node_cgroups(args.cgroup_root.as_deref(), &args.cgroup_mount, &args.host_proc) {
        Ok(found) => found.root,
        Err(e) => {
            error!("{}", e.chain());
            return std::process::ExitCode::FAILURE;
        }
    };
    let settings = KeeperSettings {
        pins: pin_paths(&args.pin_dir, &args.old_pin_dirs),
        host_proc: args.host_proc,
        default_timeout: args.old_record_timeout,
    };
    info!(pins = ?settings.pins, "releasing held apps at their deadline");
    let cgroups = CgroupFs::new(root);
    // Beside a running agent: its pod loops release first (the agent's own thread does the
    // same once the pods are listed).
    Keeper::new(settings.clone(), cgroups.clone(), None, || DEFER).exit_when_refused().start();
    match stop.wait() {
        Ok(signal) => info!("{signal:?} received"),
        Err(e) => error!("waiting for SIGTERM: {e}"),
    }
    // Only an uninstall leaves nothing stopped behind the pod; a successor takes the rest over.
    let decided = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map(|rt| rt.block_on(successor::at_sigterm_from_env(&args.node_name)))
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
    init_logging(cfg.log_format);
    let metrics = Arc::new(Metrics::new());
    let health = Arc::new(Health::default());
    // Found once: the deadlines' thread, the agent and its last release at shutdown share it.
    let node_cgroups = find_node_cgroups(cfg.cgroup_root.as_deref(), &cfg.cgroup_mount, &cfg.host_proc);
    keep_deadlines(&cfg, &node_cgroups, &metrics, &health);
    let shutdown_root = node_cgroups.as_ref().ok().map(|found| found.root.clone());
    let runtime = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("valet-agent: cannot start the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    let settings = KeeperSettings {
        pins: pin_paths(&cfg.pin_dir, &cfg.old_pin_dirs),
        host_proc: cfg.host_proc.clone(),
        default_timeout: cfg.old_record_timeout,
    };
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
