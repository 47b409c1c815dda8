//! valet-agent: wires configuration, telemetry, the kernel programs, the API client, the metrics
//! server and the controller loop together.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use clap::Parser as _;
use futures::StreamExt as _;
use kube::runtime::watcher;
use tracing::{error, info};
use tracing_subscriber::EnvFilter;
use valet_agent::act::{Actuators, Settings};
use valet_agent::api::events::EventSink;
use valet_agent::cgroup::CgroupFs;
use valet_agent::cgroup::root::find_node_cgroups;
use valet_agent::config::{Config, LogFormat};
use valet_agent::controller::Controller;
use valet_agent::error::Chain;
use valet_agent::kernel::programs::AncestorMode;
use valet_agent::kernel::{Attach, EventReader, Programs, memory};
use valet_agent::metrics::Metrics;
use valet_agent::observe::{NetnsProbe, Observer};
use valet_agent::pod::spec::SidecarDefaults;
use valet_agent::pod::state::Rules;
use valet_agent::runtime::RuntimeBundles;
use valet_agent::server::{self, Health};
use valet_agent::sidecar::netns::PodNetwork;

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

/// Resolves on SIGTERM (the kubelet stopping the pod) or SIGINT.
async fn shutdown_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) else {
        std::future::pending::<()>().await;
        return;
    };
    tokio::select! {
        _ = term.recv() => info!("SIGTERM received"),
        _ = int.recv() => info!("SIGINT received"),
    }
}

async fn run(cfg: Config) -> anyhow::Result<()> {
    cfg.validate()?;
    let cfg = Arc::new(cfg);
    let node_cgroups = find_node_cgroups(cfg.cgroup_root.as_deref(), &cfg.cgroup_mount, &cfg.host_proc)?;
    info!(
        node = %cfg.node_name,
        cgroup_root = %node_cgroups.root.display(),
        hierarchy = ?node_cgroups.hierarchy,
        "starting valet-agent {}",
        env!("CARGO_PKG_VERSION")
    );

    let metrics = Arc::new(Metrics::new());
    let health = Arc::new(Health::default());
    // Bind first: a bad or busy address is a configuration error, reported before anything else.
    let listener = server::bind(cfg.metrics_addr).await?;
    tokio::spawn(server::serve(listener, metrics.clone(), health.clone()));

    let config = kube::Config::infer().await.context("Kubernetes client config (in-cluster or KUBECONFIG)")?;
    let client = valet_agent::api::watch_client(
        kube::client::ClientBuilder::try_from(config.clone())
            .context("Kubernetes client (in-cluster or KUBECONFIG)")?,
    );
    let writes = valet_agent::api::writes_client(
        kube::client::ClientBuilder::try_from(config).context("Kubernetes client (in-cluster or KUBECONFIG)")?,
    );

    // VALET_CGROUP_ANCESTORS=auto|helper|walk: how the kernel programs find a process's pod
    // cgroup (auto: the helper where the kernel allows it, else a walk up the cgroup tree).
    let attach =
        Attach { ancestors: AncestorMode::from_env()?, hierarchy: node_cgroups.hierarchy, ..Attach::default() };
    memory::note("before loading the kernel programs");
    let mut programs =
        Programs::load_pinned(&cfg.host_root, attach, Some(&cfg.pin_dir)).context("load kernel programs")?;
    if let Some(logger) = programs.take_logger() {
        tokio::spawn(valet_agent::kernel::programs::drain_kernel_log(logger));
    }
    let ring = programs.take_events().context("kernel event ring buffer")?;
    // Loading parsed the kernel's BTF (megabytes, freed since): give that memory back to the
    // node rather than keep it in the allocator's free lists for the agent's lifetime.
    // SAFETY: glibc's malloc_trim only releases free memory.
    unsafe { libc::malloc_trim(0) };
    let resident = memory::Resident::now();
    info!(rss_kib = resident.rss_kib, peak_kib = resident.peak_kib, "resident memory after loading");

    let cgroups = CgroupFs::new(node_cgroups.root);
    if cfg.observe {
        let settings = valet_agent::observe::Settings {
            node: cfg.node_name.clone(),
            defaults: SidecarDefaults { names: cfg.sidecar_names.clone(), hold_timeout: cfg.hold_timeout },
            namespace_label: cfg.observe_namespace_label,
            max_namespaces: cfg.observe_max_namespaces,
            act: cfg.act,
        };
        let probe = NetnsProbe { host_proc: cfg.host_proc.clone(), cgroups: cgroups.clone() };
        let observer = Observer::new(settings, metrics.clone(), Arc::new(probe));
        tokio::spawn(observer.run(valet_agent::api::watch::all_pods_on_node(
            client.clone(),
            &cfg.node_name,
            cfg.watch_timeout,
        )));
    }
    let (reports_tx, reports_rx) = tokio::sync::mpsc::unbounded_channel();
    let act = Actuators::new(
        Settings {
            host_proc: cfg.host_proc.clone(),
            quit_timeout: cfg.quit_timeout,
            quit_retry_for: cfg.quit_retry_for,
            probe_interval: cfg.probe_interval,
            ready_probe_interval: cfg.ready_probe_interval,
            held_probe_budget: cfg.held_probe_budget,
            held_prober: cfg.held_prober,
        },
        cgroups.clone(),
        RuntimeBundles::new(cfg.runtime_dirs(), Some(cfg.host_proc.clone())),
        programs,
        Arc::new(PodNetwork::new(cfg.host_proc.clone(), cgroups)),
        writes.clone(),
        EventSink::new(writes, &cfg.node_name),
        metrics,
        reports_tx,
    );
    // The ring buffer's reader thread sends the quits armed ahead the moment it reads an end.
    let events = EventReader::spawn(ring, act.quits_ahead())?;
    let rules = Rules {
        defaults: SidecarDefaults { names: cfg.sidecar_names.clone(), hold_timeout: cfg.hold_timeout },
        escalate_after: (!cfg.no_escalation).then_some(cfg.escalate_after),
    };
    let controller = Controller::new(&cfg.node_name, rules, act, reports_rx, health);
    // Leave time within the usual 30 s grace period for in-flight quits to finish.
    let drain = Duration::from_secs(10);
    if cfg.act {
        let watch = valet_agent::api::watch::pods_on_node(client, &cfg.node_name, cfg.watch_timeout);
        controller.run(events, watch, shutdown_signal(), drain).await;
    } else {
        // Look-only: the controller is given no pod (an empty list, then nothing), so it acts on none.
        info!("--act=false: no pod is acted on; labelled pods are only observed");
        let none = futures::stream::iter([Ok(watcher::Event::Init), Ok(watcher::Event::InitDone)])
            .chain(futures::stream::pending());
        controller.run(events, none, shutdown_signal(), drain).await;
    }
    info!("stopped");
    Ok(())
}

fn main() -> std::process::ExitCode {
    let cfg = Config::parse();
    init_logging(cfg.log_format);
    let runtime = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("valet-agent: cannot start the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cfg)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            error!("{}", Chain(e.as_ref()));
            std::process::ExitCode::FAILURE
        }
    }
}
