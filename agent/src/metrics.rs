//! Node-level metrics for Prometheus. Labels are low-cardinality by construction: enums and
//! fixed strings only, never pod names, pids or ids.

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
pub enum ExitOutcome {
    Success,
    Failure,
    Signal,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ExitLabels {
    pub outcome: ExitOutcome,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct QuitLabels {
    /// Sidecar kind: istio, envoy, linkerd, cloudsql.
    pub kind: &'static str,
    /// ok, or a failure label (refused, timeout, rejected, no_netns, ...).
    pub result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct KindLabels {
    pub kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabels {
    pub reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabels {
    pub result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BuildLabels {
    pub version: &'static str,
}

/// Every metric the agent exports, registered once.
pub struct Metrics {
    pub registry: Registry,
    pub pods_tracked: Gauge,
    pub exits: Family<ExitLabels, Counter>,
    pub quits: Family<QuitLabels, Counter>,
    pub escalations: Family<KindLabels, Counter>,
    pub quit_latency: Histogram,
    pub holds: Counter,
    pub releases: Family<ReasonLabels, Counter>,
    pub fail_opens: Counter,
    pub hold_duration: Histogram,
    pub condition_patches: Family<ResultLabels, Counter>,
    pub events_lost: Counter,
    pub watch_restarts: Counter,
    pub skips: Family<ReasonLabels, Counter>,
    pub build_info: Family<BuildLabels, Gauge>,
}

/// Latency buckets from 50 µs to 30 s: the fast path is sub-millisecond, fallbacks take seconds.
fn latency_buckets() -> impl Iterator<Item = f64> {
    [
        0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
        30.0,
    ]
    .into_iter()
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Metrics {
        let mut registry = Registry::with_prefix("valet");
        let m = Metrics {
            registry: Registry::default(),
            pods_tracked: Gauge::default(),
            exits: Family::default(),
            quits: Family::default(),
            escalations: Family::default(),
            quit_latency: Histogram::new(latency_buckets()),
            holds: Counter::default(),
            releases: Family::default(),
            fail_opens: Counter::default(),
            hold_duration: Histogram::new(latency_buckets()),
            condition_patches: Family::default(),
            events_lost: Counter::default(),
            watch_restarts: Counter::default(),
            skips: Family::default(),
            build_info: Family::default(),
        };
        registry.register("pods_tracked", "Opted-in pods on this node that valet tracks", m.pods_tracked.clone());
        registry.register("container_exits", "App container exits seen, by outcome", m.exits.clone());
        registry.register("sidecar_quits", "Quit requests to sidecars, by sidecar kind and result", m.quits.clone());
        registry.register(
            "sidecar_escalations",
            "Sidecars sent SIGTERM because a quit did not end them",
            m.escalations.clone(),
        );
        registry.register(
            "quit_latency_seconds",
            "From the last app container's exit to the sidecar acknowledging the quit",
            m.quit_latency.clone(),
        );
        registry.register("app_holds", "App processes held at exec until the proxy is ready", m.holds.clone());
        registry.register("app_releases", "Held app processes released, by reason", m.releases.clone());
        registry.register(
            "app_hold_fail_opens",
            "Held apps released because the proxy was not ready in time",
            m.fail_opens.clone(),
        );
        registry.register("app_hold_duration_seconds", "How long app processes were held", m.hold_duration.clone());
        registry.register(
            "condition_patches",
            "Writes of the valet.dev/ProxyReady pod condition, by result",
            m.condition_patches.clone(),
        );
        registry.register(
            "kernel_events_lost",
            "Kernel events dropped because the ring buffer was full",
            m.events_lost.clone(),
        );
        registry.register("watch_restarts", "Restarts of the pod watch (errors, re-lists)", m.watch_restarts.clone());
        registry.register("pod_skips", "Pods or actions skipped, by reason", m.skips.clone());
        registry.register("build_info", "Build information", m.build_info.clone());
        m.build_info.get_or_create(&BuildLabels { version: env!("CARGO_PKG_VERSION") }).set(1);
        Metrics { registry, ..m }
    }

    /// The OpenMetrics text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }

    pub fn skip(&self, reason: &'static str) {
        self.skips.get_or_create(&ReasonLabels { reason }).inc();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposes_every_family_with_the_prefix() {
        let m = Metrics::new();
        m.exits.get_or_create(&ExitLabels { outcome: ExitOutcome::Success }).inc();
        m.quits.get_or_create(&QuitLabels { kind: "istio", result: "ok" }).inc();
        m.quit_latency.observe(0.0004);
        m.skip("restart_always");
        let text = m.encode();
        for name in [
            "valet_pods_tracked",
            "valet_container_exits_total{outcome=\"Success\"} 1",
            "valet_sidecar_quits_total{kind=\"istio\",result=\"ok\"} 1",
            "valet_quit_latency_seconds_bucket",
            "valet_pod_skips_total{reason=\"restart_always\"} 1",
            "valet_build_info{version=",
            "valet_kernel_events_lost_total",
            "valet_watch_restarts_total",
        ] {
            assert!(text.contains(name), "missing {name} in\n{text}");
        }
        assert!(text.ends_with("# EOF\n"));
    }
}
