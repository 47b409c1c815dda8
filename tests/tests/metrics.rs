//! End to end, the metrics: the real agent binary's `/metrics`, `/healthz` and `/readyz`
//! after it drove a real sidecar quit, checked by the Prometheus tools themselves: `promtool
//! check metrics` (errors and lint), and a real Prometheus server scraping the agent and
//! answering queries about it.
//!
//! promtool and prometheus come from the Debian package `prometheus`, which `cargo xtask setup`
//! installs; these tests fail (never skip) without them.
//!
//! The families' names, types and help texts, and the names the dashboard and the alerts use,
//! are checked against the agent's registry without running an agent, so those two tests need
//! no root; the others run a real agent (root).

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use valet_tests::harness::{Agent, HANG_GUARD, JobPod, JobSpec, Node, Scratch, eventually};

/// The `Accept` header Prometheus 2.x scrapes with.
const PROMETHEUS_ACCEPT: &str = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
const TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";

// ---------------------------------------------------------------------------------------------
// Helpers

/// A tool from the Debian package `prometheus`; panics (the test fails) when it is missing.
fn require_tool(name: &str) -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/bin"), PathBuf::from("/usr/local/bin")])
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .unwrap_or_else(|| {
            panic!(
                "`{name}` not found on PATH: the metrics tests need promtool and prometheus \
                 (Debian package `prometheus`); run `cargo xtask setup` as root to install them"
            )
        })
}

fn free_port() -> u16 {
    valet_test_support::free_port().expect("free port")
}

/// One HTTP/1.1 exchange with full control of the method and headers.
struct Reply {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl Reply {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v.as_str())
    }
}

fn http(addr: SocketAddr, method: &str, path: &str, headers: &[(&str, &str)]) -> Reply {
    let mut s = TcpStream::connect_timeout(&addr, HANG_GUARD).expect("connect");
    s.set_read_timeout(Some(HANG_GUARD)).expect("timeout");
    let mut req = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    if method == "POST" {
        req.push_str("Content-Length: 0\r\n");
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).expect("send");
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).unwrap_or_else(|e| panic!("{method} {path}: {e} after {raw:?}"));
    let raw = String::from_utf8(raw).expect("utf-8 response");
    let (head, body) = raw.split_once("\r\n\r\n").expect("response head");
    let mut lines = head.lines();
    let status = lines.next().and_then(|l| l.split(' ').nth(1)).and_then(|s| s.parse().ok()).expect("status line");
    let headers = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect::<Vec<_>>();
    let chunked = headers.iter().any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"));
    assert!(!chunked, "the agent answers with a Content-Length");
    Reply { status, headers, body: body.to_owned() }
}

/// `/metrics` with `accept` (None: no Accept header at all); checks the status and content type.
fn scrape(agent: &Agent, accept: Option<&str>, want_content_type: &str) -> String {
    let headers: Vec<(&str, &str)> = accept.map(|a| ("Accept", a)).into_iter().collect();
    let r = http(agent.metrics, "GET", "/metrics", &headers);
    assert_eq!(r.status, 200, "/metrics with Accept {accept:?}: {}", r.body);
    assert_eq!(r.header("content-type"), Some(want_content_type), "content type for Accept {accept:?}");
    r.body
}

/// A parsed exposition (either format): metadata by family and every sample.
#[derive(Debug, Default)]
struct Exposition {
    /// family → type, as the `# TYPE` lines say.
    types: BTreeMap<String, String>,
    /// family → help.
    helps: BTreeMap<String, String>,
    /// (sample name, labels) → value.
    samples: BTreeMap<(String, BTreeMap<String, String>), f64>,
}

impl Exposition {
    fn parse(text: &str) -> Exposition {
        let mut e = Exposition::default();
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# TYPE ") {
                let (name, t) = rest.split_once(' ').expect("TYPE line");
                assert!(e.types.insert(name.into(), t.into()).is_none(), "two TYPE lines for {name}");
            } else if let Some(rest) = line.strip_prefix("# HELP ") {
                let (name, help) = rest.split_once(' ').expect("HELP line");
                e.helps.insert(name.into(), help.into());
            } else if line.starts_with('#') || line.is_empty() {
                continue;
            } else {
                let (name, labels, rest) = parse_series(line);
                let value = rest.split_whitespace().next().and_then(|v| v.parse().ok());
                let value = value.unwrap_or_else(|| panic!("no value in {line:?}"));
                assert!(e.samples.insert((name, labels), value).is_none(), "duplicate series {line:?}");
            }
        }
        e
    }

    fn value(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let labels = labels.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        self.samples.get(&(name.to_owned(), labels)).copied()
    }

    /// The family a sample belongs to (by the `# TYPE` lines).
    fn family_of(&self, sample: &str) -> Option<&str> {
        if self.types.contains_key(sample) {
            return self.types.get_key_value(sample).map(|(k, _)| k.as_str());
        }
        ["_total", "_bucket", "_sum", "_count", "_info", "_created"]
            .iter()
            .filter_map(|s| sample.strip_suffix(s))
            .find_map(|f| self.types.get_key_value(f).map(|(k, _)| k.as_str()))
    }

    /// The series keys (name and labels), without values.
    fn series(&self) -> BTreeSet<(String, BTreeMap<String, String>)> {
        self.samples.keys().cloned().collect()
    }
}

/// `name{a="x",b="y"} rest` → (name, labels, rest), honouring escapes in label values.
fn parse_series(line: &str) -> (String, BTreeMap<String, String>, &str) {
    let name_end = line.find(['{', ' ']).unwrap_or(line.len());
    let name = line[..name_end].to_owned();
    let mut labels = BTreeMap::new();
    if !line[name_end..].starts_with('{') {
        return (name, labels, &line[name_end..]);
    }
    let mut chars = line[name_end + 1..].char_indices().peekable();
    loop {
        let mut key = String::new();
        while let Some(&(_, c)) = chars.peek() {
            if c == '=' || c == '}' {
                break;
            }
            chars.next();
            if c != ',' {
                key.push(c);
            }
        }
        match chars.next() {
            Some((i, '}')) => return (name, labels, &line[name_end + 1 + i + 1..]),
            Some((_, '=')) => {}
            _ => panic!("bad label set in {line:?}"),
        }
        assert_eq!(chars.next().map(|(_, c)| c), Some('"'), "quoted label value in {line:?}");
        let mut value = String::new();
        loop {
            match chars.next().map(|(_, c)| c) {
                Some('\\') => match chars.next().map(|(_, c)| c) {
                    Some('n') => value.push('\n'),
                    Some(c) => value.push(c),
                    None => panic!("bad escape in {line:?}"),
                },
                Some('"') => break,
                Some(c) => value.push(c),
                None => panic!("unterminated label value in {line:?}"),
            }
        }
        assert!(labels.insert(key.clone(), value).is_none(), "label {key} twice in {line:?}");
    }
}

/// One Istio Job pod whose app exits 0 and whose proxy the agent quits; returns once the quit
/// is counted.
fn drive_quit(node: &Node, agent: &Agent, tracked_after: usize) -> JobPod {
    let mut job = node.job_pod(JobSpec::new("metrics")).expect("pod");
    agent.wait_tracked(tracked_after, HANG_GUARD).expect("tracked");
    job.run_app("app", "exit 0").expect("app");
    let code = job.wait_proxy_exit(HANG_GUARD).expect("wait");
    assert_eq!(code, Some(0), "the agent quit the proxy\n{}", agent.log_text());
    assert_eq!(job.quits().len(), 1, "one quit request");
    job
}

/// Observed pods the agent quit, counted in the sidecar tax.
fn taxed(agent: &Agent) -> f64 {
    agent.metric("valet_sidecar_tax_seconds_count{namespace=\"jobs\",owner_kind=\"Job\",acted=\"true\",sidecar_mode=\"classic\"} ")
}

fn quits_ok(agent: &Agent) -> f64 {
    agent.metric("valet_sidecar_quits_total{kind=\"istio\",result=\"ok\"} ")
}

/// A node, its agent and one quit already done.
fn agent_after_one_quit() -> (Node, Agent, JobPod) {
    let node = Node::new().expect("node");
    let agent = node.start_agent(&[]).expect("agent");
    let job = drive_quit(&node, &agent, 1);
    assert!(eventually(HANG_GUARD, || quits_ok(&agent) == 1.0), "quit counted");
    (node, agent, job)
}

// ---------------------------------------------------------------------------------------------
// 1. promtool

fn promtool_check(exposition: &str) -> (bool, String) {
    let mut child = Command::new(require_tool("promtool"))
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run promtool");
    child.stdin.take().expect("stdin").write_all(exposition.as_bytes()).expect("feed promtool");
    let out = child.wait_with_output().expect("promtool");
    let report = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    (out.status.success() && report.trim().is_empty(), format!("exit {}: {report}", out.status))
}

#[test]
fn promtool_accepts_the_exposition_without_lint_warnings() {
    let promtool = require_tool("promtool");
    let (_node, agent, _job) = agent_after_one_quit();

    // Prometheus' text format for promtool, curl and every client that does not ask for OpenMetrics.
    let text = scrape(&agent, Some("text/plain;version=0.0.4"), TEXT);
    assert_eq!(scrape(&agent, None, TEXT), text, "no Accept header: the text format");
    assert_eq!(scrape(&agent, Some("*/*"), TEXT), text);
    let (clean, report) = promtool_check(&text);
    assert!(clean, "{} check metrics found problems ({report}) in\n{text}", promtool.display());

    // The histograms and counters really have samples (the quit went through).
    let e = Exposition::parse(&text);
    assert_eq!(e.value("valet_quit_latency_seconds_count", &[]), Some(1.0), "{text}");
    assert!(e.value("valet_container_exits_total", &[("outcome", "Success")]).unwrap_or(0.0) >= 1.0, "{text}");

    // What Prometheus asks for: OpenMetrics, with the same samples.
    let om = scrape(&agent, Some(PROMETHEUS_ACCEPT), OPENMETRICS);
    assert!(om.ends_with("# EOF\n"), "OpenMetrics ends with # EOF:\n{om}");
    let o = Exposition::parse(&om);
    assert_eq!(o.series(), e.series(), "both formats carry the same series");
    // Counters: family `x` in OpenMetrics, `x_total` in the text format; everything else alike.
    for (family, t) in &o.types {
        let classic = if t == "counter" { format!("{family}_total") } else { family.clone() };
        assert_eq!(e.types.get(&classic), Some(t), "{family} ({t}) in the text format");
        assert_eq!(e.helps.get(&classic), o.helps.get(family), "help of {family}");
    }
    assert_eq!(e.types.len(), o.types.len());
}

// ---------------------------------------------------------------------------------------------
// 2. a real Prometheus server

/// A Prometheus server process, killed (and its TSDB removed) on drop, failure included.
struct Prometheus {
    child: Option<Child>,
    addr: SocketAddr,
    log: PathBuf,
    _dir: Scratch,
}

impl Prometheus {
    fn start(target: SocketAddr) -> Prometheus {
        let binary = require_tool("prometheus");
        let dir = Scratch::new("prometheus").expect("scratch");
        let config = dir.path("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
                 scrape_configs:\n  - job_name: valet\n    static_configs:\n      - targets: ['{target}']\n"
            ),
        )
        .expect("write config");
        let addr: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().expect("addr");
        let log = dir.path("prometheus.log");
        let log_file = std::fs::File::create(&log).expect("log");
        let child = Command::new(binary)
            .arg(format!("--config.file={}", config.display()))
            .arg(format!("--storage.tsdb.path={}", dir.path("data").display()))
            .arg(format!("--web.listen-address={addr}"))
            .stdout(Stdio::from(log_file.try_clone().expect("log")))
            .stderr(Stdio::from(log_file))
            .stdin(Stdio::null())
            .spawn()
            .expect("start prometheus");
        Prometheus { child: Some(child), addr, log, _dir: dir }
    }

    fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn get(&self, path: &str) -> Option<Value> {
        let r = valet_sim::client::get(self.addr, path, Duration::from_secs(2)).ok()?;
        if r.status != 200 {
            return None;
        }
        r.json().ok()
    }

    /// An instant query's result vector.
    fn query(&self, promql: &str) -> Vec<Value> {
        let v = self.get(&format!("/api/v1/query?query={}", percent_encode(promql)));
        let v = v.unwrap_or_else(|| panic!("query {promql} failed\n{}", self.log_text()));
        assert_eq!(v["status"], "success", "{promql}: {v}");
        v["data"]["result"].as_array().cloned().unwrap_or_default()
    }

    /// The scrape target's state (health, lastError), for failure messages.
    fn targets(&self) -> String {
        self.get("/api/v1/targets")
            .map(|v| {
                let t = &v["data"]["activeTargets"];
                serde_json::to_string_pretty(t).unwrap_or_default()
            })
            .unwrap_or_else(|| "(no answer from /api/v1/targets)".into())
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn percent_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

fn sample_value(series: &Value) -> f64 {
    series["value"][1].as_str().and_then(|v| v.parse().ok()).unwrap_or(f64::NAN)
}

#[test]
fn prometheus_scrapes_the_agent() {
    require_tool("prometheus");
    let (_node, agent, _job) = agent_after_one_quit();
    let mut prometheus = Prometheus::start(agent.metrics);

    // Scraped (successfully) at least once: `up` is 1 and the agent's own series are there.
    let deadline = Instant::now() + HANG_GUARD;
    loop {
        let up = prometheus.get(&format!("/api/v1/query?query={}", percent_encode("up{job=\"valet\"}")));
        let up = up.and_then(|v| v["data"]["result"].as_array().and_then(|r| r.first()).map(sample_value));
        if up == Some(1.0) && !prometheus.query("valet_build_info").is_empty() {
            break;
        }
        if let Some(status) = prometheus.child.as_mut().and_then(|c| c.try_wait().ok().flatten()) {
            panic!("prometheus exited ({status})\n{}", prometheus.log_text());
        }
        assert!(
            Instant::now() < deadline,
            "Prometheus did not scrape the agent (up = {up:?}); targets:\n{}\nlog:\n{}",
            prometheus.targets(),
            prometheus.log_text()
        );
        std::thread::sleep(Duration::from_millis(200));
    }

    let info = prometheus.query("valet_build_info");
    assert_eq!(info.len(), 1, "one build_info series: {info:?}");
    assert_eq!(sample_value(&info[0]), 1.0);
    assert_eq!(info[0]["metric"]["version"], env!("CARGO_PKG_VERSION"), "{info:?}");
    assert_eq!(info[0]["metric"]["job"], "valet");

    // Every sidecar kind's `ok` series exists from the start (at 0); the one quit is istio's.
    let quits = prometheus.query("valet_sidecar_quits_total > 0");
    assert_eq!(quits.len(), 1, "one non-zero quit series: {quits:?}");
    assert_eq!(quits[0]["metric"]["kind"], "istio", "{quits:?}");
    assert_eq!(quits[0]["metric"]["result"], "ok", "{quits:?}");
    assert_eq!(sample_value(&quits[0]), 1.0, "{quits:?}");
    let total = prometheus.query("sum(valet_sidecar_quits_total)");
    assert_eq!(total.iter().map(sample_value).collect::<Vec<_>>(), [1.0], "{total:?}");

    // The histogram arrives as a histogram: buckets Prometheus can compute quantiles from.
    let count = prometheus.query("valet_quit_latency_seconds_count");
    assert_eq!(count.iter().map(sample_value).collect::<Vec<_>>(), [1.0], "{count:?}");
    let p99 = prometheus.query("histogram_quantile(0.99, valet_quit_latency_seconds_bucket)");
    assert_eq!(p99.len(), 1, "{p99:?}");
    let p99 = sample_value(&p99[0]);
    assert!(p99 > 0.0 && p99 <= 30.0, "p99 quit latency {p99}");
    assert_eq!(prometheus.query("valet_pods_tracked").iter().map(sample_value).collect::<Vec<_>>(), [1.0]);

    drop(prometheus);
}

// ---------------------------------------------------------------------------------------------
// 3. every family, low-cardinality labels only

/// Every family the issue asks for (as the text format names them), its type and the only
/// label names its series may carry. A new metric must be added here, with its labels.
const FAMILIES: &[(&str, &str, &[&str])] = &[
    ("valet_pods_tracked", "gauge", &[]),
    ("valet_container_exits_total", "counter", &["outcome"]),
    ("valet_sidecar_quits_total", "counter", &["kind", "result"]),
    ("valet_sidecar_escalations_total", "counter", &["kind"]),
    ("valet_quit_latency_seconds", "histogram", &["le"]),
    ("valet_quits_sent_ahead_total", "counter", &["result"]),
    ("valet_app_holds_total", "counter", &[]),
    ("valet_app_releases_total", "counter", &["reason"]),
    ("valet_app_hold_fail_opens_total", "counter", &[]),
    ("valet_release_failures_total", "counter", &[]),
    ("valet_app_gone_before_release_total", "counter", &[]),
    ("valet_app_holds_refused_total", "counter", &[]),
    ("valet_app_hold_duration_seconds", "histogram", &["le"]),
    ("valet_condition_patches_total", "counter", &["result"]),
    ("valet_kernel_events_lost_total", "counter", &[]),
    ("valet_kernel_map_full_total", "counter", &[]),
    ("valet_proxy_listens_total", "counter", &[]),
    ("valet_watch_restarts_total", "counter", &[]),
    ("valet_pod_skips_total", "counter", &["reason"]),
    ("valet_build_info", "gauge", &["version"]),
    ("valet_node_info", "gauge", &["mode", "reason"]),
    ("valet_pods_api_path_total", "counter", &["reason"]),
    ("valet_pods_observed", "gauge", &[]),
    ("valet_pods_waiting_on_sidecars", "gauge", &["namespace", "owner_kind"]),
    ("valet_sidecar_tax_seconds", "histogram", &["namespace", "owner_kind", "acted", "sidecar_mode", "le"]),
    ("valet_app_started_before_proxy_ready_total", "counter", &["namespace", "owner_kind"]),
    ("valet_pods_waiting_longest_seconds", "gauge", &["namespace", "owner_kind"]),
    ("valet_sidecar_startup_tax_seconds", "histogram", &["namespace", "owner_kind", "le"]),
    ("valet_app_container_start_seconds", "histogram", &["namespace", "owner_kind", "le"]),
    ("valet_classic_sidecar_pods_on_native_node_total", "counter", &["namespace"]),
    ("valet_observe_uncounted_total", "counter", &["reason"]),
];

/// Observed pods' series carry their namespace on purpose (bounded by `--observe-max-namespaces`;
/// `--observe-namespace-label=false` empties it).
const NAMESPACE_LABELLED: &[&str] = &[
    "valet_pods_waiting_on_sidecars",
    "valet_sidecar_tax_seconds",
    "valet_app_started_before_proxy_ready_total",
    "valet_pods_waiting_longest_seconds",
    "valet_sidecar_startup_tax_seconds",
    "valet_app_container_start_seconds",
    "valet_classic_sidecar_pods_on_native_node_total",
];

fn is_hex_id(v: &str) -> bool {
    v.len() >= 8 && v.bytes().all(|b| b.is_ascii_hexdigit())
}

fn is_uuid(v: &str) -> bool {
    let b = v.as_bytes();
    b.len() == 36
        && b.iter()
            .enumerate()
            .all(|(i, c)| if [8, 13, 18, 23].contains(&i) { *c == b'-' } else { c.is_ascii_hexdigit() })
}

fn is_number(v: &str) -> bool {
    !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit())
}

/// Why a label value looks like a per-pod/per-process identifier, if it does.
fn identifier_like(value: &str, forbidden: &[&str]) -> Option<String> {
    if value.len() > 32 {
        return Some("longer than 32 characters".into());
    }
    if is_uuid(value) || is_hex_id(value) {
        return Some("a UID or container/cgroup id".into());
    }
    if is_number(value) {
        return Some("a number (a pid?)".into());
    }
    if value.contains(['/', ':']) {
        return Some("a path, URL or runtime://id".into());
    }
    forbidden.iter().find(|f| !f.is_empty() && value.contains(**f)).map(|f| format!("contains {f:?}"))
}

#[test]
fn every_family_is_exposed_with_low_cardinality_labels() {
    let (node, agent, job) = agent_after_one_quit();
    let uid = node.pod(&job).and_then(|p| p["metadata"]["uid"].as_str().map(str::to_owned)).expect("pod uid");
    let forbidden = [job.name.as_str(), uid.as_str(), node.name.as_str(), "jobs"];

    // The observer taxes the pod once the API shows its proxy ended (about a second later).
    assert!(eventually(Duration::from_secs(10), || taxed(&agent) == 1.0), "the quit pod taxed");
    let text = scrape(&agent, None, TEXT);
    let e = Exposition::parse(&text);
    let om = Exposition::parse(&scrape(&agent, Some(PROMETHEUS_ACCEPT), OPENMETRICS));

    for (family, t, _) in FAMILIES {
        assert_eq!(e.types.get(*family).map(String::as_str), Some(*t), "family {family} ({t}) in\n{text}");
        assert!(e.helps.get(*family).is_some_and(|h| h.len() > 10), "help for {family}");
    }
    let declared: BTreeSet<&str> = FAMILIES.iter().map(|(f, _, _)| *f).collect();
    let exposed: BTreeSet<&str> = e.types.keys().map(String::as_str).collect();
    assert_eq!(exposed, declared, "exposed families (add new ones to FAMILIES, with their labels)");
    assert_eq!(om.types.len(), e.types.len());

    for (name, labels) in e.samples.keys() {
        let family = e.family_of(name).unwrap_or_else(|| panic!("sample {name} outside any # TYPE family"));
        let allowed = FAMILIES.iter().find(|(f, _, _)| *f == family).map(|(_, _, l)| *l).unwrap_or(&[]);
        for (key, value) in labels {
            assert!(allowed.contains(&key.as_str()), "{name}: label {key}={value:?} not in {allowed:?}");
            if key == "le" {
                assert!(value == "+Inf" || value.parse::<f64>().is_ok(), "{name}: bucket bound {value:?}");
                continue;
            }
            if key == "namespace" && NAMESPACE_LABELLED.contains(&family) {
                assert_eq!(value, "jobs", "{name}: the observed pod's namespace");
                continue;
            }
            if let Some(why) = identifier_like(value, &forbidden) {
                panic!("{name}{{{key}={value:?}}}: looks like a per-pod or per-process value ({why})");
            }
        }
    }

    // What one quit leaves behind.
    assert_eq!(e.value("valet_build_info", &[("version", env!("CARGO_PKG_VERSION"))]), Some(1.0));
    assert_eq!(e.value("valet_sidecar_quits_total", &[("kind", "istio"), ("result", "ok")]), Some(1.0));
    assert_eq!(e.value("valet_quit_latency_seconds_count", &[]), Some(1.0));
    assert!(e.value("valet_container_exits_total", &[("outcome", "Success")]).unwrap_or(0.0) >= 1.0, "{text}");
    for zero in ["valet_app_holds_total", "valet_app_hold_fail_opens_total", "valet_kernel_events_lost_total"] {
        assert_eq!(e.value(zero, &[]), Some(0.0), "{zero}");
    }
    assert_eq!(e.value("valet_app_hold_duration_seconds_count", &[]), Some(0.0));

    // A second pod doing the same thing adds no series: nothing is keyed by pod.
    let _second = drive_quit(&node, &agent, 2);
    assert!(eventually(HANG_GUARD, || quits_ok(&agent) == 2.0), "second quit counted");
    assert!(eventually(HANG_GUARD, || taxed(&agent) == 2.0), "the second pod taxed");
    let after = Exposition::parse(&scrape(&agent, None, TEXT));
    assert_eq!(after.series(), e.series(), "the same series after a second pod's quit");
    assert_eq!(after.value("valet_quit_latency_seconds_count", &[]), Some(2.0));
}

// ---------------------------------------------------------------------------------------------
// 3b. the dashboard and the alerts use only names the agent exports

/// Every `valet_*` name in the dashboard's and the rules' PromQL (anywhere in the files: their
/// descriptions name series too).
fn names_used_in(path: &std::path::Path) -> BTreeSet<String> {
    names_in(&std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
}

fn names_in(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("valet_") {
        let before = rest[..at].chars().next_back();
        let tail = &rest[at..];
        let end = tail.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(tail.len());
        if !before.is_some_and(|c| c.is_ascii_alphanumeric() || c == '_') {
            names.insert(tail[..end].to_owned());
        }
        rest = &tail[end..];
    }
    names
}

/// The exposition of a fresh agent's registry, without running an agent (no root): every family
/// is exposed from the start (`# HELP`, `# TYPE`), series or not, so it names every family the
/// agent exports. `every_family_is_exposed_with_low_cardinality_labels` checks a real agent's.
fn registry_exposition() -> Exposition {
    let text = valet_agent::metrics::Metrics::new().render(valet_agent::metrics::Format::Text).expect("render");
    Exposition::parse(&text)
}

#[test]
fn every_family_is_declared_with_its_type_and_help() {
    let e = registry_exposition();
    for (family, t, _) in FAMILIES {
        assert_eq!(e.types.get(*family).map(String::as_str), Some(*t), "family {family} ({t})");
        assert!(e.helps.get(*family).is_some_and(|h| h.len() > 10), "help for {family}");
    }
    let declared: BTreeSet<&str> = FAMILIES.iter().map(|(f, _, _)| *f).collect();
    let exposed: BTreeSet<&str> = e.types.keys().map(String::as_str).collect();
    assert_eq!(exposed, declared, "exposed families (add new ones to FAMILIES, with their labels)");
}

#[test]
fn dashboard_and_rules_use_exported_metrics() {
    let e = registry_exposition();
    // A histogram's samples are named after its family; an empty one shows only its # TYPE.
    let exported: BTreeSet<String> = e
        .types
        .iter()
        .flat_map(|(family, t)| match t.as_str() {
            "histogram" => ["", "_bucket", "_sum", "_count"].map(|s| format!("{family}{s}")).to_vec(),
            _ => vec![family.clone()],
        })
        .collect();
    let monitoring = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/monitoring");
    for file in ["valet-dashboard.json", "prometheusrule.yaml", "tests/rules-test.yaml"] {
        let used = names_used_in(&monitoring.join(file));
        assert!(used.len() >= 3, "{file}: valet series found: {used:?}");
        let unknown: Vec<&String> = used.iter().filter(|n| !exported.contains(*n)).collect();
        assert!(unknown.is_empty(), "{file} uses {unknown:?}, which the agent does not export:\n{exported:?}");
    }
    // And the check can fail: a name the agent does not export is found.
    let used = names_in("expr: rate(valet_sidecar_quits_totl[5m]) > valet_pods_tracked");
    assert_eq!(used.iter().filter(|n| !exported.contains(*n)).collect::<Vec<_>>(), ["valet_sidecar_quits_totl"]);
}

// ---------------------------------------------------------------------------------------------
// 4. health, readiness, routes and methods

#[test]
fn health_readiness_routes_and_methods() {
    let node = Node::new().expect("node");
    // The API server refuses everything at first: the agent runs but cannot list pods.
    // (500, not 503: kube-client retries 503s itself, for minutes, before the watch sees them.)
    node.api.fail_next(u32::MAX, 500);
    let mut agent = node.spawn_agent(&[]).expect("agent");
    let addr = agent.metrics;
    assert!(
        eventually(HANG_GUARD, || {
            TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok()
                && http(addr, "GET", "/healthz", &[]).status == 200
        }),
        "/healthz answers 200 while the agent runs\n{}",
        agent.log_text()
    );
    let r = http(addr, "GET", "/readyz", &[]);
    assert_eq!(r.status, 503, "not ready before the first pod list: {}", r.body);
    // Kernel programs attached, the pod list keeps failing (and is counted): still not ready.
    assert!(
        eventually(HANG_GUARD, || agent.metric("valet_watch_restarts_total ") >= 1.0),
        "failed pod lists count as watch restarts\n{}",
        agent.log_text()
    );
    let r = http(addr, "GET", "/readyz", &[]);
    assert_eq!((r.status, r.body.as_str()), (503, "waiting for the first pod list\n"));
    assert_eq!(http(addr, "GET", "/healthz", &[]).status, 200, "alive even though not ready");

    // The API recovers: ready.
    node.api.fail_next(0, 500);
    agent.wait_ready(HANG_GUARD).expect("ready once the pods are listed");
    let r = http(addr, "GET", "/readyz", &[]);
    assert_eq!((r.status, r.body.as_str()), (200, "ready\n"));
    let r = http(addr, "GET", "/healthz", &[]);
    assert_eq!((r.status, r.body.as_str()), (200, "ok\n"));

    // Unknown paths.
    for path in ["/", "/nope", "/metrics/x", "/healthz/", "/debug/pprof"] {
        let r = http(addr, "GET", path, &[]);
        assert_eq!(r.status, 404, "GET {path}");
    }
    // Methods: GET and HEAD only.
    for (method, path) in [("POST", "/metrics"), ("PUT", "/metrics"), ("DELETE", "/healthz"), ("POST", "/readyz")] {
        let r = http(addr, method, path, &[]);
        assert_eq!(r.status, 405, "{method} {path}");
        assert_eq!(r.header("allow"), Some("GET, HEAD"), "{method} {path}: Allow header");
    }
    let head = http(addr, "HEAD", "/metrics", &[]);
    assert_eq!((head.status, head.body.as_str()), (200, ""), "HEAD /metrics: no body");
    assert_eq!(head.header("content-type"), Some(TEXT));
    assert_eq!(http(addr, "HEAD", "/healthz", &[]).status, 200);
    // Still serving after all that.
    assert!(!agent.metrics_text().expect("metrics").is_empty());
}
