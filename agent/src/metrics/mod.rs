//! Node-level metrics for Prometheus. Labels are low-cardinality by construction: enums and
//! fixed strings only, never pod names, pids or ids.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::{EncodeLabelSet, EncodeLabelValue, EncodeMetric, MetricEncoder};
use prometheus_client::metrics::MetricType;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::vocab::{DegradedReason, NodeMode, SidecarKind, SkipReason};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelValue)]
pub enum ExitOutcome {
    Success,
    Failure,
    Signal,
}

/// Label sets, each a struct whose fields are a series' labels (names and values), with the
/// derives every one needs.
macro_rules! label_sets {
    ($($(#[$meta:meta])* $name:ident { $($(#[$field_meta:meta])* $field:ident: $ty:ty,)+ })+) => {
        $(
            $(#[$meta])*
            #[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
            pub struct $name {
                $($(#[$field_meta])* pub $field: $ty,)+
            }
        )+
    };
}

label_sets! {
    ExitLabels {
        outcome: ExitOutcome,
    }
    QuitLabels {
        /// Sidecar kind (`SidecarKind::as_str`).
        kind: &'static str,
        /// ok, or a failure label (refused, timeout, rejected, no_netns, ...).
        result: &'static str,
    }
    KindLabels {
        kind: &'static str,
    }
    ReasonLabels {
        reason: &'static str,
    }
    ResultLabels {
        result: &'static str,
    }
    /// An observed pod's series: its namespace (empty when the agent drops it) and owner kind (Job,
    /// CronJob, other).
    ObservedLabels {
        namespace: String,
        owner_kind: &'static str,
    }
    TaxLabels {
        namespace: String,
        owner_kind: &'static str,
        /// "true": valet quit one of the pod's sidecars.
        acted: &'static str,
        /// "native" (init containers with `restartPolicy: Always`) or "classic".
        sidecar_mode: &'static str,
    }
    /// The observed pods of one namespace (its bounded label value).
    NamespaceLabels {
        namespace: String,
    }
    /// How the node is served: `mode` kernel or degraded, and why (`none` in kernel mode; else a
    /// [`DegradedReason`] label).
    NodeLabels {
        mode: &'static str,
        reason: &'static str,
    }
    BuildLabels {
        version: &'static str,
    }
}

/// A labelled family that is exposed (`# HELP`, `# TYPE`) even before its first series:
/// prometheus-client leaves empty families out, and a family missing from `/metrics` is
/// indistinguishable from one the agent does not have.
#[derive(Debug)]
struct Declared<M>(M);

impl<M: EncodeMetric> EncodeMetric for Declared<M> {
    fn encode(&self, encoder: MetricEncoder) -> Result<(), std::fmt::Error> {
        self.0.encode(encoder)
    }

    fn metric_type(&self) -> MetricType {
        self.0.metric_type()
    }

    fn is_empty(&self) -> bool {
        false
    }
}

/// Every metric the agent exports, registered once.
pub struct Metrics {
    pub registry: Registry,
    pub pods_tracked: Gauge,
    pub exits: Family<ExitLabels, Counter>,
    pub quits: Family<QuitLabels, Counter>,
    pub escalations: Family<KindLabels, Counter>,
    pub quit_latency: Histogram,
    pub quits_ahead: Family<ResultLabels, Counter>,
    pub holds: Counter,
    pub releases: Family<ReasonLabels, Counter>,
    pub fail_opens: Counter,
    /// Releases of held apps that failed: a SIGCONT refused, or a process that could not be
    /// placed (retried; the record is kept). Not apps gone before their release.
    pub release_failures: Counter,
    /// Held apps gone (exited, killed, or their pid another process's) when their release came.
    pub gone_before_release: Counter,
    /// Pods whose apps were not held because the record of holds is not pinned.
    pub holds_refused: Counter,
    pub hold_duration: Histogram,
    pub condition_patches: Family<ResultLabels, Counter>,
    pub events_lost: Counter,
    pub map_full: Counter,
    pub proxy_listens: Counter,
    pub watch_restarts: Counter,
    pub skips: Family<ReasonLabels, Counter>,
    pub build_info: Family<BuildLabels, Gauge>,
    pub node_info: Family<NodeLabels, Gauge>,
    pub api_path: Family<ReasonLabels, Counter>,
    pub pods_observed: Gauge,
    pub pods_waiting: Family<ObservedLabels, Gauge>,
    pub sidecar_tax: Family<TaxLabels, Histogram, fn() -> Histogram>,
    pub started_before_ready: Family<ObservedLabels, Counter>,
    pub waiting_longest: Family<ObservedLabels, Gauge<f64, AtomicU64>>,
    pub startup_tax: Family<ObservedLabels, Histogram, fn() -> Histogram>,
    pub app_start: Family<ObservedLabels, Histogram, fn() -> Histogram>,
    pub classic_on_native: Family<NamespaceLabels, Counter>,
    pub uncounted: Family<ReasonLabels, Counter>,
}

/// Sidecar tax buckets from 1 s to a day: the API's times are whole seconds, and a stuck Job's
/// proxy runs until someone deletes the pod.
fn tax_histogram() -> Histogram {
    Histogram::new([1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 10800.0, 43200.0, 86400.0])
}

/// Startup tax buckets from half a second to 5 minutes: the kubelet's `startupProbe` period is
/// 1 s in Istio's template and 10 s by default, and API times are whole seconds.
fn startup_tax_histogram() -> Histogram {
    Histogram::new([0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0])
}

/// The apps' own start, from half a second (a cached image) to half an hour (a large image over
/// a slow registry).
fn app_start_histogram() -> Histogram {
    Histogram::new([0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0])
}

/// Hold buckets from 50 µs to an hour: a released hold takes milliseconds, a hold that fails
/// open takes its whole timeout (120 s by default, up to an hour with `valet.dev/hold-timeout`).
fn hold_buckets() -> impl Iterator<Item = f64> {
    latency_buckets().chain([60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0])
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
            quits_ahead: Family::default(),
            holds: Counter::default(),
            releases: Family::default(),
            fail_opens: Counter::default(),
            release_failures: Counter::default(),
            gone_before_release: Counter::default(),
            holds_refused: Counter::default(),
            hold_duration: Histogram::new(hold_buckets()),
            condition_patches: Family::default(),
            events_lost: Counter::default(),
            map_full: Counter::default(),
            proxy_listens: Counter::default(),
            watch_restarts: Counter::default(),
            skips: Family::default(),
            build_info: Family::default(),
            node_info: Family::default(),
            api_path: Family::default(),
            pods_observed: Gauge::default(),
            pods_waiting: Family::default(),
            sidecar_tax: Family::new_with_constructor(tax_histogram),
            started_before_ready: Family::default(),
            waiting_longest: Family::default(),
            startup_tax: Family::new_with_constructor(startup_tax_histogram),
            app_start: Family::new_with_constructor(app_start_histogram),
            classic_on_native: Family::default(),
            uncounted: Family::default(),
        };
        m.register_pod_work(&mut registry);
        m.register_holds(&mut registry);
        m.register_node(&mut registry);
        m.register_observer(&mut registry);
        m.start_known_series();
        Metrics { registry, ..m }
    }

    /// The pods valet acts on: how many, their containers' ends, the quits of their sidecars.
    fn register_pod_work(&self, registry: &mut Registry) {
        registry.register("pods_tracked", "Opted-in pods on this node that valet tracks", self.pods_tracked.clone());
        registry.register(
            "container_exits",
            "Container ends (app and sidecar) seen in the kernel, by outcome",
            Declared(self.exits.clone()),
        );
        registry.register(
            "sidecar_quits",
            "Quit requests to sidecars, by sidecar kind and result",
            Declared(self.quits.clone()),
        );
        registry.register(
            "sidecar_escalations",
            "Sidecars sent SIGTERM because a quit did not end them",
            Declared(self.escalations.clone()),
        );
        registry.register(
            "quit_latency_seconds",
            "From the last app container's exit to the sidecar acknowledging the quit",
            self.quit_latency.clone(),
        );
        registry.register(
            "quits_sent_ahead",
            "Quit requests sent by the kernel event reader as soon as it read the last app's end, \
             before the loop's transition (sent; unclaimed: the pod's state had changed and did not quit)",
            Declared(self.quits_ahead.clone()),
        );
    }

    /// The holds of apps at exec until their proxy is ready, and their releases.
    fn register_holds(&self, registry: &mut Registry) {
        registry.register("app_holds", "App processes held at exec until the proxy is ready", self.holds.clone());
        registry.register("app_releases", "Held app processes released, by reason", Declared(self.releases.clone()));
        registry.register(
            "app_hold_fail_opens",
            "Held apps released because the proxy was not ready in time",
            self.fail_opens.clone(),
        );
        registry.register(
            "release_failures",
            "Releases of held apps that failed (a SIGCONT refused, a process that could not be placed); \
             each is retried with backoff and its record kept",
            self.release_failures.clone(),
        );
        registry.register(
            "app_gone_before_release",
            "Held apps gone (exited, killed, or their pid another process's) when their release came",
            self.gone_before_release.clone(),
        );
        registry.register(
            "app_holds_refused",
            "Pods whose apps ran without a hold: the record of holds could not be pinned (no bpffs)",
            self.holds_refused.clone(),
        );
        registry.register("app_hold_duration_seconds", "How long app processes were held", self.hold_duration.clone());
    }

    /// What the node and the API did: condition writes, the kernel's losses, watches, skips, how the node is served.
    fn register_node(&self, registry: &mut Registry) {
        registry.register(
            "condition_patches",
            "Writes of the valet.dev/ProxyReady pod condition, by result",
            Declared(self.condition_patches.clone()),
        );
        registry.register(
            "kernel_events_lost",
            "Kernel events dropped because the ring buffer was full",
            self.events_lost.clone(),
        );
        registry.register(
            "kernel_map_full",
            "Container records the kernel could not make because its map was full",
            self.map_full.clone(),
        );
        registry.register(
            "proxy_listens",
            "Sockets that started listening in pods holding an app, each a probe of the pod at once",
            self.proxy_listens.clone(),
        );
        registry.register(
            "watch_restarts",
            "Restarts of the pod watch (errors, re-lists)",
            self.watch_restarts.clone(),
        );
        registry.register("pod_skips", "Pods or actions skipped, by reason", Declared(self.skips.clone()));
        registry.register("build_info", "Build information", Declared(self.build_info.clone()));
        registry.register(
            "node_info",
            "How valet serves this node: mode kernel (ends as they happen, holds) or degraded (the kernel \
             programs could not run: ends from the API, no holds), and why (reason)",
            Declared(self.node_info.clone()),
        );
        registry.register(
            "pods_api_path",
            "Opted-in pods the node's kernel cannot see, served from the API's container status without \
             holds, by reason (host_pid, sandboxed, unknown_runtime_class, node_degraded)",
            Declared(self.api_path.clone()),
        );
    }

    /// What the observer saw of every pod with a known sidecar, acted on or not.
    fn register_observer(&self, registry: &mut Registry) {
        registry.register(
            "pods_observed",
            "Pods on this node with a sidecar valet knows, labelled or not, that the observer keeps",
            self.pods_observed.clone(),
        );
        registry.register(
            "pods_waiting_on_sidecars",
            "Pods on this node whose app containers have all ended while a sidecar still runs (labelled or not)",
            Declared(self.pods_waiting.clone()),
        );
        registry.register(
            "sidecar_tax_seconds",
            "From a pod's apps' end to its last sidecar's end, observed when the sidecars end \
             (acted: valet quit or signalled one of them; sidecar_mode: native or classic sidecars)",
            Declared(self.sidecar_tax.clone()),
        );
        registry.register(
            "app_started_before_proxy_ready",
            "App containers that started while their pod's proxy was not ready (its proxy, asked \
             when the API first showed the app started, was not ready yet)",
            Declared(self.started_before_ready.clone()),
        );
        registry.register(
            "pods_waiting_longest_seconds",
            "How long the pod waiting longest on its sidecars has waited so far, from its apps' end",
            Declared(self.waiting_longest.clone()),
        );
        registry.register(
            "sidecar_startup_tax_seconds",
            "What a native proxy cost its pod's start: from its readiness (found by asking it) to the \
             kubelet's move to the apps (the pod's Initialized condition)",
            Declared(self.startup_tax.clone()),
        );
        registry.register(
            "app_container_start_seconds",
            "Pods with a native proxy: from the kubelet's move to the apps (the pod's Initialized \
             condition) to the first app's start (its image pull, container creation and start)",
            Declared(self.app_start.clone()),
        );
        registry.register(
            "classic_sidecar_pods_on_native_node",
            "New pods whose mesh proxy runs as a regular container on a node where native sidecars run",
            Declared(self.classic_on_native.clone()),
        );
        registry.register(
            "observe_uncounted",
            "What the observer saw but could not count, by reason",
            Declared(self.uncounted.clone()),
        );
    }

    /// `valet_build_info` at 1; series whose label values are known in advance at 0, so rates
    /// and alerts on them see 0 rather than nothing until the first event.
    fn start_known_series(&self) {
        self.build_info.get_or_create(&BuildLabels { version: env!("CARGO_PKG_VERSION") }).set(1);
        for outcome in [ExitOutcome::Success, ExitOutcome::Failure, ExitOutcome::Signal] {
            let _ = self.exits.get_or_create(&ExitLabels { outcome });
        }
        for reason in ["host_pid", "sandboxed", "unknown_runtime_class", "node_degraded"] {
            let _ = self.api_path.get_or_create(&ReasonLabels { reason });
        }
        for result in ["sent", "unclaimed"] {
            let _ = self.quits_ahead.get_or_create(&ResultLabels { result });
        }
        // The condition is written only once the proxy is first ready: until then, 0.
        for result in ["ok", "error"] {
            let _ = self.condition_patches.get_or_create(&ResultLabels { result });
        }
        for kind in SidecarKind::ALL.map(|k| k.as_str()) {
            let _ = self.quits.get_or_create(&QuitLabels { kind, result: "ok" });
            let _ = self.escalations.get_or_create(&KindLabels { kind });
        }
    }

    /// The OpenMetrics text exposition (empty if encoding fails).
    pub fn encode(&self) -> String {
        self.render(Format::OpenMetrics).unwrap_or_default()
    }

    /// The exposition in `format`.
    pub fn render(&self, format: Format) -> Result<String, std::fmt::Error> {
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &self.registry)?;
        Ok(match format {
            Format::OpenMetrics => out,
            Format::Text => openmetrics_to_text(&out),
        })
    }

    /// Says how this node is served: one `valet_node_info` series at 1, the others at 0 (every
    /// mode and reason is exposed, so an alert sees 0 rather than nothing).
    pub fn set_node_mode(&self, mode: NodeMode) {
        let all = std::iter::once(NodeMode::Kernel).chain(DegradedReason::ALL.map(NodeMode::Degraded));
        for m in all {
            let labels = NodeLabels { mode: m.label(), reason: m.reason_label() };
            self.node_info.get_or_create(&labels).set(i64::from(m == mode));
        }
    }

    pub fn skip(&self, reason: SkipReason) {
        self.skips.get_or_create(&ReasonLabels { reason: reason.as_str() }).inc();
    }
}

/// The exposition formats `/metrics` serves. prometheus-client writes only OpenMetrics; the
/// classic Prometheus text format is derived from it ([`openmetrics_to_text`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// OpenMetrics 1.0.0 text: what Prometheus asks for first.
    OpenMetrics,
    /// The Prometheus text format 0.0.4: for every other client (promtool, older scrapers, curl).
    Text,
}

impl Format {
    pub fn content_type(self) -> &'static str {
        match self {
            Format::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
            Format::Text => "text/plain; version=0.0.4; charset=utf-8",
        }
    }

    /// The format for a request's `Accept` header (all its values joined with `,`), chosen like
    /// Prometheus' own client libraries do: media ranges in order of preference (`q`, then
    /// header order), ranges with `q=0` refused; the first `application/openmetrics-text`
    /// (version 1.0.0, 0.0.1 or none) or `text/plain` (version 0.0.4 or none) decides;
    /// wildcards and other types do not. No header, or no match: the text format.
    pub fn negotiate(accept: Option<&str>) -> Format {
        let Some(accept) = accept else { return Format::Text };
        let mut ranges: Vec<(f64, Option<Format>)> = Vec::new();
        for range in accept.split(',') {
            let mut parts = range.split(';');
            let media = parts.next().unwrap_or_default().trim().to_ascii_lowercase();
            let (mut q, mut version) = (1.0, None);
            for param in parts {
                let Some((k, v)) = param.split_once('=') else { continue };
                let v = v.trim().trim_matches('"');
                match k.trim().to_ascii_lowercase().as_str() {
                    "q" => q = v.parse::<f64>().ok().filter(|q| (0.0..=1.0).contains(q)).unwrap_or(0.0),
                    "version" => version = Some(v.to_owned()),
                    _ => {}
                }
            }
            if q <= 0.0 {
                continue;
            }
            let format = match (media.as_str(), version.as_deref()) {
                ("application/openmetrics-text", None | Some("1.0.0" | "0.0.1")) => Some(Format::OpenMetrics),
                ("text/plain", None | Some("0.0.4")) => Some(Format::Text),
                _ => None,
            };
            ranges.push((q, format));
        }
        // Stable: equal preferences keep the header's order.
        ranges.sort_by(|a, b| b.0.total_cmp(&a.0));
        ranges.into_iter().find_map(|(_, f)| f).unwrap_or(Format::Text)
    }
}

/// The end of a sample's name and label set: the index just past `}` (or the name), honouring
/// quoted label values with escapes.
fn sample_series_end(line: &str) -> usize {
    let bytes = line.as_bytes();
    let name_end = bytes.iter().position(|b| *b == b'{' || *b == b' ').unwrap_or(bytes.len());
    if bytes.get(name_end) != Some(&b'{') {
        return name_end;
    }
    let (mut quoted, mut escaped) = (false, false);
    for (i, b) in bytes.iter().enumerate().skip(name_end + 1) {
        match (quoted, escaped, *b) {
            (true, true, _) => escaped = false,
            (true, false, b'\\') => escaped = true,
            (_, false, b'"') => quoted = !quoted,
            (false, _, b'}') => return i + 1,
            _ => {}
        }
    }
    bytes.len()
}

/// Converts OpenMetrics text (as prometheus-client writes it) into the Prometheus text format
/// 0.0.4, sample for sample:
/// - counters: the family is named like its samples, with `_total`;
/// - info metrics become gauges named `<name>_info`; `unknown` becomes `untyped`; state sets
///   gauges; gauge histograms (no classic equivalent) `untyped`;
/// - `# UNIT`, `_created` samples, exemplars and `# EOF` have no equivalent and are dropped;
///   sample timestamps go from seconds to milliseconds;
/// - `\"` in help texts, an OpenMetrics-only escape, is unescaped.
pub fn openmetrics_to_text(openmetrics: &str) -> String {
    let types: HashMap<&str, &str> = openmetrics
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_once(' '))
        .map(|(name, t)| (name, t.trim()))
        .collect();
    let classic_name = |name: &str| -> String {
        match types.get(name) {
            Some(&"counter") => format!("{name}_total"),
            Some(&"info") => format!("{name}_info"),
            _ => name.to_owned(),
        }
    };
    let mut out = String::with_capacity(openmetrics.len());
    for line in openmetrics.lines() {
        if line == "# EOF" {
            break;
        }
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').unwrap_or((rest, ""));
            let _ = writeln!(out, "# HELP {} {}", classic_name(name), help.replace("\\\"", "\""));
        } else if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, t) = rest.split_once(' ').unwrap_or((rest, "unknown"));
            let t = match t.trim() {
                t @ ("counter" | "gauge" | "histogram" | "summary") => t,
                "info" | "stateset" => "gauge",
                _ => "untyped",
            };
            let _ = writeln!(out, "# TYPE {} {t}", classic_name(name));
        } else if line.starts_with('#') || line.trim().is_empty() {
            // `# UNIT`, and nothing else OpenMetrics allows.
        } else {
            let series_end = sample_series_end(line);
            let name = &line[..line.find(['{', ' ']).unwrap_or(line.len())];
            let created_of = name.strip_suffix("_created").and_then(|f| types.get(f));
            if matches!(created_of, Some(&("counter" | "histogram" | "summary" | "gaugehistogram"))) {
                continue;
            }
            let mut rest = line[series_end..].split_whitespace().take_while(|t| *t != "#");
            let Some(value) = rest.next() else { continue };
            let _ = write!(out, "{} {value}", &line[..series_end]);
            if let Some(seconds) = rest.next().and_then(|t| t.parse::<f64>().ok()) {
                let _ = write!(out, " {}", (seconds * 1000.0).round() as i64);
            }
            out.push('\n');
        }
    }
    out
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
        m.skip(SkipReason::RestartAlways);
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

    #[test]
    fn text_format_names_counter_families_like_their_samples() {
        let m = Metrics::new();
        m.quits.get_or_create(&QuitLabels { kind: "istio", result: "ok" }).inc();
        m.quit_latency.observe(0.0004);
        let text = m.render(Format::Text).expect("render");
        assert!(
            text.contains("# HELP valet_sidecar_quits_total Quit requests to sidecars, by sidecar kind and result.\n")
        );
        assert!(text.contains("# TYPE valet_sidecar_quits_total counter\nvalet_sidecar_quits_total{"));
        assert!(text.contains("\nvalet_sidecar_quits_total{kind=\"istio\",result=\"ok\"} 1\n"));
        assert!(text.contains("# TYPE valet_quit_latency_seconds histogram\n"));
        assert!(text.contains("valet_quit_latency_seconds_bucket{le=\"+Inf\"} 1\n"));
        assert!(text.contains("# TYPE valet_build_info gauge\nvalet_build_info{version=\""));
        assert!(text.contains("# TYPE valet_pods_tracked gauge\nvalet_pods_tracked 0\n"));
        assert!(!text.contains("# EOF") && !text.contains("# UNIT"), "{text}");
        // Every sample is kept as is.
        let samples = |t: &str| t.lines().filter(|l| !l.starts_with('#')).map(str::to_owned).collect::<Vec<_>>();
        assert_eq!(samples(&text), samples(&m.encode()));
        // Every TYPE line names the samples that follow it.
        let mut family = String::new();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                family = rest.split(' ').next().unwrap_or_default().to_owned();
            } else if !line.starts_with('#') {
                let name = &line[..line.find(['{', ' ']).unwrap_or(line.len())];
                let base = ["_bucket", "_sum", "_count"].iter().find_map(|s| name.strip_suffix(s)).unwrap_or(name);
                assert!(name == family || base == family, "{name} under # TYPE {family}");
            }
        }
    }

    #[test]
    fn every_family_is_exposed_from_the_start() {
        let text = Metrics::new().render(Format::Text).expect("render");
        let families: Vec<&str> =
            text.lines().filter_map(|l| l.strip_prefix("# TYPE ")).filter_map(|l| l.split(' ').next()).collect();
        assert_eq!(
            families,
            [
                "valet_pods_tracked",
                "valet_container_exits_total",
                "valet_sidecar_quits_total",
                "valet_sidecar_escalations_total",
                "valet_quit_latency_seconds",
                "valet_quits_sent_ahead_total",
                "valet_app_holds_total",
                "valet_app_releases_total",
                "valet_app_hold_fail_opens_total",
                "valet_release_failures_total",
                "valet_app_gone_before_release_total",
                "valet_app_holds_refused_total",
                "valet_app_hold_duration_seconds",
                "valet_condition_patches_total",
                "valet_kernel_events_lost_total",
                "valet_kernel_map_full_total",
                "valet_proxy_listens_total",
                "valet_watch_restarts_total",
                "valet_pod_skips_total",
                "valet_build_info",
                "valet_node_info",
                "valet_pods_api_path_total",
                "valet_pods_observed",
                "valet_pods_waiting_on_sidecars",
                "valet_sidecar_tax_seconds",
                "valet_app_started_before_proxy_ready_total",
                "valet_pods_waiting_longest_seconds",
                "valet_sidecar_startup_tax_seconds",
                "valet_app_container_start_seconds",
                "valet_classic_sidecar_pods_on_native_node_total",
                "valet_observe_uncounted_total",
            ]
        );
        for zero in [
            "valet_container_exits_total{outcome=\"Signal\"} 0\n",
            "valet_sidecar_quits_total{kind=\"cloudsql\",result=\"ok\"} 0\n",
            "valet_sidecar_escalations_total{kind=\"linkerd\"} 0\n",
        ] {
            assert!(text.contains(zero), "{zero} in\n{text}");
        }
        assert!(text.contains("# TYPE valet_app_releases_total counter\n# HELP valet_app_hold_fail_opens_total"));
    }

    #[test]
    fn hold_durations_reach_an_hour() {
        let m = Metrics::new();
        // A hold that fails open after the default 120 s timeout lands in a bucket of its own.
        m.hold_duration.observe(120.5);
        let text = m.render(Format::Text).expect("render");
        assert!(text.contains("valet_app_hold_duration_seconds_bucket{le=\"120.0\"} 0\n"), "{text}");
        assert!(text.contains("valet_app_hold_duration_seconds_bucket{le=\"300.0\"} 1\n"), "{text}");
        assert!(text.contains("valet_app_hold_duration_seconds_bucket{le=\"3600.0\"} 1\n"), "{text}");
        assert!(text.contains("valet_app_hold_duration_seconds_bucket{le=\"0.00005\"} 0\n"), "{text}");
    }

    #[test]
    fn every_skip_reason_is_one_documented_label() {
        let doc = include_str!("../../../docs/monitoring.md");
        let m = Metrics::new();
        let mut labels = std::collections::BTreeSet::new();
        for reason in SkipReason::ALL {
            let label = reason.as_str();
            assert!(labels.insert(label), "{label} spelt twice");
            assert!(label.chars().all(|c| c.is_ascii_lowercase() || c == '_'), "{label} is not snake_case");
            assert!(doc.contains(&format!("| `{label}` | the ")), "{label} is not in docs/monitoring.md's skip table");
            m.skip(reason);
        }
        let text = m.render(Format::Text).expect("render");
        for label in labels {
            assert!(text.contains(&format!("valet_pod_skips_total{{reason=\"{label}\"}} 1\n")), "{label}: {text}");
        }
    }

    #[test]
    fn help_texts_need_no_escaping_in_either_format() {
        // prometheus-client writes help texts raw: they must not contain what either format escapes.
        let text = Metrics::new().encode();
        for help in text.lines().filter_map(|l| l.strip_prefix("# HELP ")) {
            assert!(!help.contains(['\\', '"']), "{help}");
        }
    }

    #[test]
    fn converts_every_openmetrics_construct() {
        let om = concat!(
            "# HELP a_seconds A \\\"quoted\\\" help.\n",
            "# TYPE a_seconds counter\n",
            "# UNIT a_seconds seconds\n",
            "a_seconds_total{l=\"x} # {\\\"y\\\\\"} 2 # {trace_id=\"1\"} 1.0 1700000000.5\n",
            "a_seconds_created{l=\"x} # {\\\"y\\\\\"} 1700000000.25\n",
            "# HELP b B.\n",
            "# TYPE b info\n",
            "b_info{v=\"1\"} 1\n",
            "# HELP c C.\n",
            "# TYPE c unknown\n",
            "c 3.5 1700000000.001\n",
            "# HELP h H.\n",
            "# TYPE h histogram\n",
            "h_bucket{le=\"1.0\"} 1 # {a=\"b\"} 0.5\n",
            "h_bucket{le=\"+Inf\"} 1\n",
            "h_sum 0.5\n",
            "h_count 1\n",
            "h_created 1700000000.0\n",
            "# EOF\n",
        );
        let want = concat!(
            "# HELP a_seconds_total A \"quoted\" help.\n",
            "# TYPE a_seconds_total counter\n",
            "a_seconds_total{l=\"x} # {\\\"y\\\\\"} 2\n",
            "# HELP b_info B.\n",
            "# TYPE b_info gauge\n",
            "b_info{v=\"1\"} 1\n",
            "# HELP c C.\n",
            "# TYPE c untyped\n",
            "c 3.5 1700000000001\n",
            "# HELP h H.\n",
            "# TYPE h histogram\n",
            "h_bucket{le=\"1.0\"} 1\n",
            "h_bucket{le=\"+Inf\"} 1\n",
            "h_sum 0.5\n",
            "h_count 1\n",
        );
        assert_eq!(openmetrics_to_text(om), want);
    }

    #[test]
    fn negotiates_like_prometheus_client_libraries() {
        use Format::{OpenMetrics, Text};
        let prometheus = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,\
                          text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
        for (accept, want) in [
            (None, Text),
            (Some(""), Text),
            (Some(prometheus), OpenMetrics),
            (Some("application/openmetrics-text"), OpenMetrics),
            (Some("Application/OpenMetrics-Text; Version=\"1.0.0\""), OpenMetrics),
            (Some("application/openmetrics-text; version=0.0.1"), OpenMetrics),
            (Some("application/openmetrics-text; version=2.0.0"), Text),
            (Some("text/plain;version=0.0.4"), Text),
            (Some("text/plain"), Text),
            (Some("*/*"), Text),
            (Some("application/json, */*"), Text),
            (Some("text/plain;version=0.0.4;q=0.5,application/openmetrics-text;version=1.0.0;q=0.2"), Text),
            (Some("text/plain;q=0.2,application/openmetrics-text;q=0.5"), OpenMetrics),
            (Some("application/openmetrics-text;q=0,text/plain"), Text),
            (Some("application/openmetrics-text;q=bogus"), Text),
            (Some("*/*,application/openmetrics-text;q=0.5"), OpenMetrics),
            (Some("application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited"), Text),
        ] {
            assert_eq!(Format::negotiate(accept), want, "Accept: {accept:?}");
        }
        assert_eq!(OpenMetrics.content_type(), "application/openmetrics-text; version=1.0.0; charset=utf-8");
        assert_eq!(Text.content_type(), "text/plain; version=0.0.4; charset=utf-8");
    }
}
