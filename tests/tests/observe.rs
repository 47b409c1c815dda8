//! End to end, issue 30 "observe mode": the real agent binary, on the simulated node, counts what
//! unlabelled pods' sidecars cost and never touches them: an unlabelled Istio Job whose app ended
//! is counted waiting, is never quit, and is counted in the sidecar tax once its proxy stops; an
//! app started before its proxy is ready is counted, one that quits its own proxy is not; with
//! `--act=false` a labelled pod is only observed. Issue 35: a native-sidecar pod's shutdown tax
//! is at least the proxy's 5 s drain when unlabelled and about 0 when valet quits it, and a native
//! proxy's startup tax is measured.
//!
//! "Never quit" is checked against something that would have happened: a labelled pod of the same
//! agent is quit within milliseconds of its app's end, and the unlabelled pod's wait is counted
//! only after the kubelet reported its app ended (about a second later, as a real kubelet does).

use std::time::Duration;

use valet_tests::harness::{Agent, JobPod, JobSpec, Node, eventually};

const CONDITION: &str = "valet.dev/ProxyReady";

/// The value of the sample `name` whose labels include every one of `labels`, 0 when absent.
fn sample(agent: &Agent, name: &str, labels: &[(&str, &str)]) -> f64 {
    let text = agent.metrics_text().unwrap_or_default();
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with(['{', ' ']))
        .find(|l| labels.iter().all(|(k, v)| l.contains(&format!("{k}=\"{v}\""))))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0.0)
}

const JOB: &[(&str, &str)] = &[("namespace", "jobs"), ("owner_kind", "Job")];

fn waiting(agent: &Agent) -> f64 {
    sample(agent, "valet_pods_waiting_on_sidecars", JOB)
}

fn taxed(agent: &Agent, acted: &str) -> f64 {
    let labels = [JOB[0], JOB[1], ("acted", acted), ("sidecar_mode", "classic")];
    sample(agent, "valet_sidecar_tax_seconds_count", &labels)
}

fn races(agent: &Agent) -> f64 {
    sample(agent, "valet_app_started_before_proxy_ready_total", JOB)
}

/// The agent asked the proxy whether it is ready: a GET from the pod's own loopback (the
/// kubelet's probes come from outside, to the pod IP).
fn asked(job: &JobPod) -> bool {
    job.requests().iter().any(|r| r.method == "GET" && r.peer.ip().is_loopback())
}

fn unlabelled(name: &str) -> JobSpec {
    JobSpec { labelled: false, ..JobSpec::new(name) }
}

/// Nothing of valet's on the pod: no quit reached its proxy, no Event, no condition.
fn untouched(node: &Node, job: &JobPod, agent: &Agent) {
    assert_eq!(job.quits().len(), 0, "no quit request reached the proxy: {:?}\n{}", job.requests(), agent.log_text());
    assert_eq!(node.events_for(job), Vec::<(String, String)>::new(), "no Event about the pod");
    let pod = node.pod(job).expect("pod");
    let conditions = pod["status"]["conditions"].as_array().cloned().unwrap_or_default();
    assert!(!conditions.iter().any(|c| c["type"] == CONDITION), "no valet condition: {conditions:?}");
}

/// Stops the proxy the way a deletion or a person would (SIGTERM); waits for its end in the API.
fn stop_proxy(job: &mut JobPod) {
    job.proxy.signal(libc::SIGTERM).expect("signal the proxy");
    assert!(job.wait_proxy_exit(Duration::from_secs(10)).expect("wait").is_some(), "the proxy ended");
    assert!(job.wait_api_terminated("istio-proxy", Duration::from_secs(10)).is_some(), "the API shows it ended");
}

#[test]
fn an_unlabelled_job_is_counted_waiting_never_quit_and_taxed_once_its_proxy_stops() {
    let node = Node::new().expect("node");
    let agent = node.start_agent(&[]).expect("agent");
    let mut watched = node.job_pod(unlabelled("watched")).expect("unlabelled pod");
    let mut control = node.job_pod(JobSpec::new("control")).expect("labelled pod");
    agent.wait_tracked(1, Duration::from_secs(10)).expect("the labelled pod is tracked");
    assert!(
        eventually(Duration::from_secs(10), || agent.metric("valet_pods_observed ") == 2.0),
        "both pods observed\n{}",
        agent.log_text()
    );

    // The labelled pod: quit as soon as its app ends, counted in the tax as acted.
    control.run_app("app", "exit 0").expect("control app");
    assert_eq!(control.wait_proxy_exit(Duration::from_secs(10)).expect("wait"), Some(0), "valet quit it");
    // The unlabelled one: its app ends and its proxy keeps running.
    watched.run_app("app", "exit 0").expect("app");
    assert!(watched.wait_api_terminated("app", Duration::from_secs(10)).is_some(), "the API shows the app ended");
    assert!(
        eventually(Duration::from_secs(10), || waiting(&agent) == 1.0),
        "counted waiting on its sidecar\n{}",
        agent.metrics_text().unwrap_or_default()
    );
    assert!(eventually(Duration::from_secs(10), || taxed(&agent, "true") == 1.0), "the quit pod's tax, acted");
    assert_eq!(watched.proxy.try_wait().expect("proxy"), None, "the unlabelled pod's proxy still runs");
    untouched(&node, &watched, &agent);
    assert_eq!(taxed(&agent, "false"), 0.0, "no tax while the proxy runs");

    stop_proxy(&mut watched);
    assert!(
        eventually(Duration::from_secs(10), || taxed(&agent, "false") == 1.0),
        "counted in the tax once its proxy stopped\n{}",
        agent.metrics_text().unwrap_or_default()
    );
    assert_eq!(waiting(&agent), 0.0, "no longer waiting");
    assert_eq!(taxed(&agent, "true"), 1.0, "the labelled pod's tax once");
    untouched(&node, &watched, &agent);
    // Both apps started after their proxy was ready: no startup race.
    assert_eq!(races(&agent), 0.0);
}

#[test]
fn an_app_started_before_its_unlabelled_pods_proxy_is_ready_is_counted() {
    let node = Node::new().expect("node");
    let agent = node.start_agent(&[]).expect("agent");
    let ready = node.scratch.path("race.ready");
    let mut spec = unlabelled("race");
    spec.ready_file = Some(ready.clone());
    let mut job = node.job_pod(spec).expect("pod");
    // The observer knows the pod before its app starts (an app seen started at first sight is
    // not judged: its order with the proxy is unknown).
    assert!(eventually(Duration::from_secs(10), || agent.metric("valet_pods_observed ") == 1.0), "observed");
    job.run_app("app", "sleep 60").expect("app");
    // Asked once (not ready: no ready file), never told to quit.
    assert!(
        eventually(Duration::from_secs(15), || asked(&job)),
        "the proxy was asked: {:?}\n{}",
        job.requests(),
        agent.log_text()
    );
    assert_eq!(races(&agent), 0.0, "not counted before the proxy is seen ready (it may be stopping)");
    // The proxy gets ready; the kubelet's next probe (every 15 s) reports it: it was starting.
    std::fs::write(&ready, "").expect("ready");
    assert!(
        eventually(Duration::from_secs(30), || races(&agent) == 1.0),
        "the app started while the proxy was not ready\n{}\n{}",
        agent.metrics_text().unwrap_or_default(),
        agent.log_text()
    );
    untouched(&node, &job, &agent);
}

#[test]
fn an_unlabelled_app_that_quits_its_own_proxy_is_not_counted_as_a_race() {
    let node = Node::new().expect("node");
    let agent = node.start_agent(&[]).expect("agent");
    let go = node.scratch.path("self-quit.go");
    let mut spec = unlabelled("self-quit");
    // Never ready: the kubelet never reports it ready, the observer's question finds it not ready.
    spec.ready_file = Some(node.scratch.path("self-quit.never"));
    let mut job = node.job_pod(spec).expect("pod");
    assert!(eventually(Duration::from_secs(10), || agent.metric("valet_pods_observed ") == 1.0), "observed");
    // The workaround users run without valet: the app tells pilot-agent to quit, then ends.
    let script = format!(
        "while [ ! -e {go} ]; do sleep 0.05; done; \
         bash -c 'exec 3<>/dev/tcp/127.0.0.1/15020 && printf \"POST /quitquitquit HTTP/1.0\\r\\n\\r\\n\" >&3 && cat <&3 >/dev/null'; \
         exit 0",
        go = go.display()
    );
    job.run_app("app", &script).expect("app");
    assert!(
        eventually(Duration::from_secs(15), || asked(&job)),
        "the observer asked the proxy while the app ran: {:?}\n{}",
        job.requests(),
        agent.log_text()
    );
    std::fs::write(&go, "").expect("go");
    assert_eq!(job.wait_proxy_exit(Duration::from_secs(15)).expect("wait"), Some(0), "the app's quit ended it");
    assert!(job.wait_api_terminated("istio-proxy", Duration::from_secs(15)).is_some(), "the API shows it ended");
    assert!(
        eventually(Duration::from_secs(10), || {
            agent.metric("valet_observe_uncounted_total{reason=\"race_unconfirmed\"} ") == 1.0
        }),
        "the app's start is left uncounted, with its reason\n{}",
        agent.metrics_text().unwrap_or_default()
    );
    assert_eq!(races(&agent), 0.0, "not a race\n{}", agent.metrics_text().unwrap_or_default());
    // The only quit the proxy got came from the app (over loopback), none from valet.
    assert_eq!(job.quits().len(), 1, "{:?}", job.requests());
    assert_eq!(node.events_for(&job), Vec::<(String, String)>::new(), "no Event about the pod");
}

#[test]
fn a_look_only_agent_quits_no_labelled_pod_and_counts_its_tax_as_not_acted() {
    let node = Node::new().expect("node");
    let agent = node.start_agent(&["--act=false"]).expect("agent");
    let mut job = node.job_pod(JobSpec::new("look-only")).expect("labelled pod");
    assert!(eventually(Duration::from_secs(10), || agent.metric("valet_pods_observed ") == 1.0), "observed");
    assert_eq!(agent.metric("valet_pods_tracked "), 0.0, "the controller tracks nothing");
    job.run_app("app", "exit 0").expect("app");
    assert!(job.wait_api_terminated("app", Duration::from_secs(10)).is_some(), "the API shows the app ended");
    assert!(eventually(Duration::from_secs(10), || waiting(&agent) == 1.0), "counted waiting");
    assert_eq!(job.proxy.try_wait().expect("proxy"), None, "the proxy still runs");
    untouched(&node, &job, &agent);
    stop_proxy(&mut job);
    assert!(eventually(Duration::from_secs(10), || taxed(&agent, "false") == 1.0), "taxed, not acted");
    assert_eq!(taxed(&agent, "true"), 0.0);
}

/// The native-sidecar tax's samples (`sum`, `count`), for pods valet did (`acted`) or did not act on.
fn native_tax(agent: &Agent, acted: &str) -> (f64, f64) {
    let labels = [JOB[0], JOB[1], ("acted", acted), ("sidecar_mode", "native")];
    (sample(agent, "valet_sidecar_tax_seconds_sum", &labels), sample(agent, "valet_sidecar_tax_seconds_count", &labels))
}

#[test]
fn an_unlabelled_native_sidecar_pod_shows_its_shutdown_tax() {
    let node = Node::new().expect("node");
    let agent = node.start_agent(&[]).expect("agent");
    let mut job = node.job_pod(unlabelled("native-tax").native_sidecar()).expect("native pod");
    assert!(eventually(Duration::from_secs(10), || agent.metric("valet_pods_observed ") == 1.0), "observed");
    job.run_app("app", "exit 0").expect("app");
    // The kubelet sees the app's end, sends the native proxy SIGTERM, and the stand-in's
    // pilot-agent drains 5 s before it exits: the pod waits on it meanwhile.
    assert!(
        eventually(Duration::from_secs(30), || native_tax(&agent, "false").1 == 1.0),
        "taxed once its native proxy ended\n{}\n{}",
        agent.metrics_text().unwrap_or_default(),
        agent.log_text()
    );
    let (seconds, _) = native_tax(&agent, "false");
    assert!(seconds >= 5.0, "at least the proxy's 5 s drain: {seconds} s");
    assert_eq!(taxed(&agent, "false"), 0.0, "not counted as classic");
    untouched(&node, &job, &agent);
}

#[test]
fn the_startup_tax_of_a_native_proxy_is_shown() {
    let node = Node::new().expect("node");
    let agent = node.start_agent(&[]).expect("agent");
    let ready = node.scratch.path("startup.ready");
    let mut spec = unlabelled("native-startup").native_sidecar();
    spec.ready_file = Some(ready.clone());
    // The kubelet starts the app itself, once the proxy's startupProbe (every second) passes.
    spec.app_commands = vec![("app".into(), "sleep 60".into())];
    let job = node.job_pod(spec).expect("native pod");
    // Seen before its proxy is ready: the observer asks the proxy until it is.
    assert!(eventually(Duration::from_secs(10), || agent.metric("valet_pods_observed ") == 1.0), "observed");
    assert!(
        eventually(Duration::from_secs(10), || asked(&job)),
        "the observer asks the native proxy: {:?}\n{}",
        job.requests(),
        agent.log_text()
    );
    std::fs::write(&ready, "").expect("ready");
    let count = |agent: &Agent| sample(agent, "valet_sidecar_startup_tax_seconds_count", JOB);
    assert!(
        eventually(Duration::from_secs(30), || count(&agent) == 1.0),
        "the kubelet's move to the app after the proxy's readiness is measured\n{}\n{}",
        agent.metrics_text().unwrap_or_default(),
        agent.log_text()
    );
    let seconds = sample(&agent, "valet_sidecar_startup_tax_seconds_sum", JOB);
    assert!(seconds >= 0.0, "{seconds}");
    // The app's own start after the kubelet moved on to it (the Initialized condition), apart.
    assert!(
        eventually(Duration::from_secs(30), || sample(&agent, "valet_app_container_start_seconds_count", JOB) == 1.0),
        "the app's own start is measured apart\n{}",
        agent.metrics_text().unwrap_or_default()
    );
    assert!(job.api_status("app").is_some_and(|s| s["state"]["running"].is_object()), "the kubelet started the app");
    untouched(&node, &job, &agent);
}

#[test]
fn a_labelled_native_sidecar_pod_shows_about_no_tax() {
    let node = Node::new().expect("node");
    let agent = node.start_agent(&[]).expect("agent");
    let mut job = node.job_pod(JobSpec::new("native-quit").native_sidecar()).expect("native pod");
    agent.wait_tracked(1, Duration::from_secs(10)).expect("the labelled pod is tracked");
    assert!(eventually(Duration::from_secs(10), || agent.metric("valet_pods_observed ") == 1.0), "observed");
    job.run_app("app", "exit 0").expect("app");
    // valet quits the native proxy at the app's end: it exits 0 without the kubelet's SIGTERM
    // and its 5 s drain.
    assert_eq!(job.wait_proxy_exit(Duration::from_secs(10)).expect("wait"), Some(0), "valet quit it");
    assert!(
        eventually(Duration::from_secs(15), || native_tax(&agent, "true").1 == 1.0),
        "taxed as acted\n{}\n{}",
        agent.metrics_text().unwrap_or_default(),
        agent.log_text()
    );
    // The API's times are whole seconds: the app's end and the proxy's fall in the same second
    // or the next (a second more for a loaded machine), never the drain's 5 s.
    let (seconds, _) = native_tax(&agent, "true");
    assert!(seconds <= 2.0, "about 0: {seconds} s");
    assert_eq!(native_tax(&agent, "false").1, 0.0);
    assert_eq!(job.quits().len(), 1, "one quit, valet's: {:?}", job.requests());
}
