//! A `Pod` turned into the plain data valet decides on (`PodPlan`): which containers are the app,
//! which are proxy sidecars and how to reach them, and whether to hold the app at start.
//!
//! Bad input is an error with the annotation, the value and why, never a guess: a pod valet
//! misreads could lose its proxy while the app still needs it, or keep a Job running forever.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

pub use super::restart::RestartPolicy;
use super::restart::{self, AfterExit, ContainerRestart, ExitOutcome};
pub use crate::vocab::{Endpoint, KIND_NAMES, Sidecar, SidecarKind, UnknownKind};
use k8s_openapi::api::core::v1::{Container, Pod, PodSpec};

/// Every valet annotation lives under this prefix; unknown keys under it are errors.
pub const ANNOTATION_PREFIX: &str = "valet.dev/";
/// Comma-separated container names: the pod's sidecars, replacing the agent's default names.
pub const SIDECARS: &str = "valet.dev/sidecars";
/// One of [`KIND_NAMES`] for one container (suffix: the container name).
pub const SIDECAR_KIND_PREFIX: &str = "valet.dev/sidecar-kind.";
/// Port of one sidecar's quit endpoint (suffix: the container name).
pub const QUIT_PORT_PREFIX: &str = "valet.dev/quit-port.";
/// Path of one sidecar's quit endpoint (suffix: the container name).
pub const QUIT_PATH_PREFIX: &str = "valet.dev/quit-path.";
/// Port of one sidecar's readiness endpoint (suffix: the container name).
pub const READY_PORT_PREFIX: &str = "valet.dev/ready-port.";
/// Path of one sidecar's readiness endpoint (suffix: the container name).
pub const READY_PATH_PREFIX: &str = "valet.dev/ready-path.";
/// The signal that ends a `signal` sidecar (suffix: the container name), `SIGTERM` by default.
pub const QUIT_SIGNAL_PREFIX: &str = "valet.dev/quit-signal.";
/// `true|false`: hold the app's first process until the proxy is ready.
pub const HOLD_APP: &str = "valet.dev/hold-app";
/// Go-style duration: how long an app is held at most (then released anyway).
pub const HOLD_TIMEOUT: &str = "valet.dev/hold-timeout";
/// Istio's pilot-agent status port, which also serves `/quitquitquit`.
pub const ISTIO_STATUS_PORT: &str = "status.sidecar.istio.io/port";
/// Istio's per-pod ProxyConfig (YAML).
pub const ISTIO_PROXY_CONFIG: &str = "proxy.istio.io/config";
/// vault-k8s: the injected agent serves `/agent/v1/quit` only when this is true.
pub const VAULT_ENABLE_QUIT: &str = "vault.hashicorp.com/agent-enable-quit";
/// vault-k8s: the port of the agent's listener (127.0.0.1), which serves the quit.
pub const VAULT_LISTENER_PORT: &str = "vault.hashicorp.com/agent-cache-listener-port";

pub const DEFAULT_HOLD_TIMEOUT: Duration = Duration::from_secs(120);
const MIN_HOLD_TIMEOUT: Duration = Duration::from_secs(1);
const MAX_HOLD_TIMEOUT: Duration = Duration::from_secs(3600);
/// Annotation values are quoted in errors (and so in Events): keep them short.
const MAX_SHOWN_VALUE: usize = 80;

/// What valet needs to know about a pod, as plain data.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodPlan {
    pub uid: String,
    pub namespace: String,
    pub name: String,
    /// The pod's `spec.restartPolicy`.
    pub restart_policy: RestartPolicy,
    /// The regular containers (apps and sidecars) that have a `restartPolicy` of their own
    /// (KEP-5307), with their `restartPolicyRules`: those override the pod's.
    pub own_restarts: BTreeMap<String, ContainerRestart>,
    /// `spec.containers` in order, minus the sidecars.
    pub apps: Vec<String>,
    /// The sidecars valet quits: native ones (`spec.initContainers` with `restartPolicy:
    /// Always`) in their order, then regular ones in `spec.containers` order. Both are found by
    /// the same rules (`valet.dev/sidecars`, else the default names).
    pub sidecars: Vec<Sidecar>,
    /// Every `spec.initContainers` name, native sidecars included: none is ever an app (a
    /// regular one runs to completion before the apps start).
    pub init_containers: Vec<String>,
    /// Init containers with `restartPolicy: Always` (KEP-753), valet's sidecars or not: the
    /// kubelet restarts them while an app runs and stops them once every app has ended.
    pub native_sidecars: Vec<String>,
    /// The native sidecars with a `startupProbe`: the kubelet starts the containers after one only
    /// once its probe passed (without one, as soon as it started).
    pub native_startup_probed: BTreeSet<String>,
    /// `valet.dev/hold-app: "true"`.
    pub hold_app: bool,
    pub hold_timeout: Duration,
    /// Istio already holds the app (holdApplicationUntilProxyStarts): valet should not hold too.
    pub istio_holds_app: bool,
    pub pod_ip: Option<String>,
    /// `metadata.deletionTimestamp` is set.
    pub deleting: bool,
    /// `spec.hostPID`: its containers run in the node's pid namespace, where nothing tells a
    /// container's main process from the runtime's helpers or from an app's nested sandbox
    /// (whose pid 1 then sits right below the node's namespace, where a container's init would).
    /// The kernel reports nothing for such a pod and holds nothing: its ends come from the API.
    pub host_pid: bool,
    /// `spec.shareProcessNamespace`: its containers' processes live in the sandbox's pid
    /// namespace. Otherwise each container's main process is pid 1 of a namespace of its own.
    pub shares_pid_namespace: bool,
    /// `spec.runtimeClassName` (a sandboxed one hides the app from the node's kernel).
    pub runtime_class: Option<String>,
}

/// The injected sidecars' container names valet knows by default (`--sidecar-names`).
pub const DEFAULT_SIDECAR_NAMES: [&str; 6] =
    ["istio-proxy", "linkerd-proxy", "cloud-sql-proxy", "vault-agent", "consul-dataplane", "kuma-sidecar"];

/// The agent-wide defaults a pod's annotations can override.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SidecarDefaults {
    /// Container names that are sidecars when the pod has no `valet.dev/sidecars` annotation.
    pub names: Vec<String>,
    /// Hold timeout when the pod has no `valet.dev/hold-timeout` annotation (`--hold-timeout`).
    pub hold_timeout: Duration,
}

impl Default for SidecarDefaults {
    fn default() -> SidecarDefaults {
        SidecarDefaults { names: DEFAULT_SIDECAR_NAMES.map(String::from).to_vec(), hold_timeout: DEFAULT_HOLD_TIMEOUT }
    }
}

/// Why a pod cannot be planned. Every variant says what to fix.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    #[error("pod {field}: {why}")]
    InvalidPod { field: &'static str, why: String },
    #[error("annotation {key}={value:?}: {why}")]
    MalformedAnnotation { key: String, value: String, why: String },
    #[error("annotation {key}={value:?}: unknown sidecar kind (valet knows {KIND_NAMES})")]
    UnknownSidecarKind { key: String, value: String },
    #[error(
        "cannot tell which proxy sidecar {container:?} runs (image {image:?}); \
         set the annotation {key} to one of {KIND_NAMES}"
    )]
    UndeterminedSidecarKind { container: String, image: String, key: String },
    #[error("annotation {key}={value:?}: container {container:?} {why}")]
    UnknownSidecar { key: String, value: String, container: String, why: &'static str },
    #[error(
        "unknown annotation {key}={value:?} (valet knows {SIDECARS}, {HOLD_APP}, {HOLD_TIMEOUT}, \
         {SIDECAR_KIND_PREFIX}<container>, {QUIT_PORT_PREFIX}<container>, {QUIT_PATH_PREFIX}<container>, \
         {READY_PORT_PREFIX}<container>, {READY_PATH_PREFIX}<container>, {QUIT_SIGNAL_PREFIX}<container>)"
    )]
    UnknownAnnotation { key: String, value: String },
}

impl SpecError {
    /// A short CamelCase reason for a Kubernetes Event (and a low-cardinality metric label).
    pub fn reason(&self) -> &'static str {
        match self {
            SpecError::InvalidPod { .. } => "InvalidPod",
            SpecError::MalformedAnnotation { .. } => "MalformedAnnotation",
            SpecError::UnknownSidecarKind { .. } => "UnknownSidecarKind",
            SpecError::UndeterminedSidecarKind { .. } => "UndeterminedSidecarKind",
            SpecError::UnknownSidecar { .. } => "UnknownSidecar",
            SpecError::UnknownAnnotation { .. } => "UnknownAnnotation",
        }
    }

    fn malformed(key: &str, value: &str, why: impl Into<String>) -> SpecError {
        SpecError::MalformedAnnotation { key: key.to_owned(), value: shown(value), why: why.into() }
    }
}

/// An annotation value as quoted in an error.
fn shown(value: &str) -> String {
    match value.char_indices().nth(MAX_SHOWN_VALUE) {
        Some((cut, _)) => format!("{}…", &value[..cut]),
        None => value.to_owned(),
    }
}

/// The valet annotations of one pod, parsed by key but not yet checked against the containers.
#[derive(Default)]
struct ValetAnnotations<'a> {
    sidecars: Option<&'a str>,
    hold_app: Option<&'a str>,
    hold_timeout: Option<&'a str>,
    /// Container name → (annotation key, value).
    kinds: BTreeMap<&'a str, (&'a str, &'a str)>,
    quit_ports: BTreeMap<&'a str, (&'a str, &'a str)>,
    quit_paths: BTreeMap<&'a str, (&'a str, &'a str)>,
    ready_ports: BTreeMap<&'a str, (&'a str, &'a str)>,
    ready_paths: BTreeMap<&'a str, (&'a str, &'a str)>,
    quit_signals: BTreeMap<&'a str, (&'a str, &'a str)>,
}

impl<'a> ValetAnnotations<'a> {
    fn parse(annotations: &'a BTreeMap<String, String>) -> Result<ValetAnnotations<'a>, SpecError> {
        let mut out = ValetAnnotations::default();
        for (key, value) in annotations {
            let (key, value) = (key.as_str(), value.as_str());
            if !key.starts_with(ANNOTATION_PREFIX) {
                continue;
            }
            let per_container = [
                (SIDECAR_KIND_PREFIX, &mut out.kinds),
                (QUIT_PORT_PREFIX, &mut out.quit_ports),
                (QUIT_PATH_PREFIX, &mut out.quit_paths),
                (READY_PORT_PREFIX, &mut out.ready_ports),
                (READY_PATH_PREFIX, &mut out.ready_paths),
                (QUIT_SIGNAL_PREFIX, &mut out.quit_signals),
            ];
            let mut known = true;
            match key {
                SIDECARS => out.sidecars = Some(value),
                HOLD_APP => out.hold_app = Some(value),
                HOLD_TIMEOUT => out.hold_timeout = Some(value),
                _ => {
                    known = false;
                    for (prefix, map) in per_container {
                        if let Some(container) = key.strip_prefix(prefix)
                            && !container.is_empty()
                        {
                            map.insert(container, (key, value));
                            known = true;
                        }
                    }
                }
            }
            if !known {
                return Err(SpecError::UnknownAnnotation { key: key.to_owned(), value: shown(value) });
            }
        }
        Ok(out)
    }

    /// Every per-container annotation, for checking that it names a sidecar.
    fn per_container(&self) -> impl Iterator<Item = (&'a str, &'a str, &'a str)> + '_ {
        [&self.kinds, &self.quit_ports, &self.quit_paths, &self.ready_ports, &self.ready_paths, &self.quit_signals]
            .into_iter()
            .flat_map(|m| m.iter().map(|(c, (k, v))| (*c, *k, *v)))
    }
}

/// Turns a pod into its plan, or says what is wrong with it.
pub fn plan(pod: &Pod, defaults: &SidecarDefaults) -> Result<PodPlan, SpecError> {
    let meta = &pod.metadata;
    let required = |field: &'static str, value: &Option<String>| match value {
        Some(v) if !v.is_empty() => Ok(v.clone()),
        _ => Err(SpecError::InvalidPod { field, why: "missing".into() }),
    };
    let uid = required("metadata.uid", &meta.uid)?;
    let name = required("metadata.name", &meta.name)?;
    let namespace = required("metadata.namespace", &meta.namespace)?;
    let Some(spec) = pod.spec.as_ref() else {
        return Err(SpecError::InvalidPod { field: "spec", why: "missing".into() });
    };
    let (restart_policy, own_restarts) = restarts(spec)?;
    let init = spec.init_containers.as_deref().unwrap_or_default();
    let empty = BTreeMap::new();
    let annotations = meta.annotations.as_ref().unwrap_or(&empty);
    let valet = ValetAnnotations::parse(annotations)?;
    let (apps, sidecars) = apps_and_sidecars(&valet, annotations, &spec.containers, init, defaults)?;
    let hold_app = match valet.hold_app {
        None => false,
        Some("true") => true,
        Some("false") => false,
        Some(other) => {
            return Err(SpecError::malformed(HOLD_APP, other, "expected \"true\" or \"false\""));
        }
    };
    let hold_timeout = match valet.hold_timeout {
        None => defaults.hold_timeout,
        Some(text) => hold_timeout(text)?,
    };
    let istio_holds_app = annotations.get(ISTIO_PROXY_CONFIG).is_some_and(|c| proxy_config_holds_app(c))
        || spec.containers.iter().chain(init).any(runs_pilot_agent_wait);

    Ok(PodPlan {
        uid,
        namespace,
        name,
        restart_policy,
        own_restarts,
        apps,
        sidecars,
        init_containers: init.iter().map(|c| c.name.clone()).collect(),
        native_sidecars: init.iter().filter(|c| is_native(c)).map(|c| c.name.clone()).collect(),
        native_startup_probed: init
            .iter()
            .filter(|c| is_native(c) && c.startup_probe.is_some())
            .map(|c| c.name.clone())
            .collect(),
        hold_app,
        hold_timeout,
        istio_holds_app,
        pod_ip: pod.status.as_ref().and_then(|s| s.pod_ip.clone()).filter(|ip| !ip.is_empty()),
        deleting: meta.deletion_timestamp.is_some(),
        host_pid: spec.host_pid.unwrap_or(false),
        shares_pid_namespace: spec.share_process_namespace.unwrap_or(false),
        runtime_class: spec.runtime_class_name.clone().filter(|c| !c.is_empty()),
    })
}

/// The pod's restart policy, and the regular containers' own restart settings.
fn restarts(spec: &PodSpec) -> Result<(RestartPolicy, BTreeMap<String, ContainerRestart>), SpecError> {
    let restart_policy = match spec.restart_policy.as_deref() {
        None => RestartPolicy::Always,
        Some(text) => RestartPolicy::parse(text).ok_or_else(|| SpecError::InvalidPod {
            field: "spec.restartPolicy",
            why: format!("unknown value {:?}", shown(text)),
        })?,
    };
    let mut own_restarts = BTreeMap::new();
    for c in &spec.containers {
        let own = restart::container_restart(c)
            .map_err(|why| SpecError::InvalidPod { field: "spec.containers[].restartPolicy", why })?;
        if let Some(own) = own {
            own_restarts.insert(c.name.clone(), own);
        }
    }
    Ok((restart_policy, own_restarts))
}

/// The app containers' names and the sidecars (native ones first), after checking that every
/// per-container annotation names a sidecar.
fn apps_and_sidecars(
    valet: &ValetAnnotations<'_>,
    annotations: &BTreeMap<String, String>,
    containers: &[Container],
    init: &[Container],
    defaults: &SidecarDefaults,
) -> Result<(Vec<String>, Vec<Sidecar>), SpecError> {
    let sidecar_names = sidecar_names(valet, containers, init, defaults)?;
    for (container, key, value) in valet.per_container() {
        if !sidecar_names.contains(container) {
            let why = if containers.iter().chain(init.iter().filter(|c| is_native(c))).any(|c| c.name == container) {
                "is not a sidecar of this pod (list it in valet.dev/sidecars)"
            } else {
                "is neither in spec.containers nor a native sidecar"
            };
            return Err(SpecError::UnknownSidecar {
                key: key.to_owned(),
                value: shown(value),
                container: container.to_owned(),
                why,
            });
        }
    }
    let mut apps = Vec::new();
    let mut sidecars = Vec::new();
    // A native sidecar valet quits follows the same rules as a regular one; the kubelet ends the
    // others once the apps have.
    for container in init.iter().filter(|c| is_native(c)) {
        if sidecar_names.contains(container.name.as_str()) {
            sidecars.push(sidecar(container, valet, annotations)?);
        }
    }
    for container in containers {
        if sidecar_names.contains(container.name.as_str()) {
            sidecars.push(sidecar(container, valet, annotations)?);
        } else {
            apps.push(container.name.clone());
        }
    }
    Ok((apps, sidecars))
}

impl PodPlan {
    /// What the kubelet does once the regular container `name` ended as `outcome`: its own
    /// restart settings, else the pod's ([`restart::after_exit`]).
    pub fn after_exit(&self, name: &str, outcome: ExitOutcome) -> AfterExit {
        restart::after_exit(self.restart_policy, self.own_restarts.get(name), outcome.code())
    }

    /// Whether the apps never end for good: each is restarted whatever its exit (with no app,
    /// the pod's `Always`).
    pub fn apps_never_end(&self) -> bool {
        if self.apps.is_empty() {
            return self.restart_policy == RestartPolicy::Always;
        }
        self.apps.iter().all(|a| restart::always_restarts(self.restart_policy, self.own_restarts.get(a)))
    }

    /// Whether the app's ends are all alike past a clean exit: every other code and signal has
    /// the same outcome (no `restartPolicyRules` that single some out).
    pub fn failures_alike(&self, app: &str) -> bool {
        self.own_restarts.get(app).is_none_or(|o| o.rules.is_empty())
    }

    /// The parts of the apps' restart rules valet does not know (a newer API's), each named with
    /// its container: the kubelet decides the exits they match, not valet.
    pub fn unknown_restart_rules(&self) -> Vec<String> {
        self.apps
            .iter()
            .filter_map(|a| Some((a, self.own_restarts.get(a)?)))
            .flat_map(|(a, own)| restart::unknown_parts(own).into_iter().map(move |p| format!("container {a:?} {p}")))
            .collect()
    }
}

/// A native sidecar (KEP-753): an init container with `restartPolicy: Always`.
fn is_native(c: &Container) -> bool {
    c.restart_policy.as_deref() == Some("Always")
}

/// The sidecar container names, among `spec.containers` and the native sidecars: the pod's own
/// list, or else the agent's default names that the pod has, and a container named `envoy` that
/// runs Envoy's own image beside other containers (name and image agree: Envoy beside an app is
/// its proxy; alone, or under another name, it may be the work itself, and `valet.dev/sidecars`
/// says otherwise).
fn sidecar_names<'a>(
    valet: &ValetAnnotations<'a>,
    containers: &'a [Container],
    init: &'a [Container],
    defaults: &SidecarDefaults,
) -> Result<BTreeSet<&'a str>, SpecError> {
    let candidates = || containers.iter().chain(init.iter().filter(|c| is_native(c)));
    let Some(list) = valet.sidecars else {
        let envoy_beside_others = |c: &Container| {
            c.name == "envoy"
                && candidates().count() > 1
                && c.image.as_deref().and_then(kind_from_image) == Some(SidecarKind::Envoy)
        };
        return Ok(candidates()
            .filter(|c| defaults.names.contains(&c.name) || envoy_beside_others(c))
            .map(|c| c.name.as_str())
            .collect());
    };
    let mut names = BTreeSet::new();
    for entry in list.split(',').map(str::trim) {
        if entry.is_empty() {
            return Err(SpecError::malformed(SIDECARS, list, "empty entry (expected \"name1,name2\")"));
        }
        let Some(container) = candidates().find(|c| c.name == entry) else {
            let why = if init.iter().any(|c| c.name == entry) {
                "is an init container that runs to completion before the apps, not a sidecar"
            } else {
                "is neither in spec.containers nor a native sidecar"
            };
            return Err(SpecError::UnknownSidecar {
                key: SIDECARS.to_owned(),
                value: shown(list),
                container: entry.to_owned(),
                why,
            });
        };
        if !names.insert(container.name.as_str()) {
            return Err(SpecError::malformed(SIDECARS, list, format!("lists {entry:?} twice")));
        }
    }
    Ok(names)
}

fn sidecar(
    container: &Container,
    valet: &ValetAnnotations<'_>,
    annotations: &BTreeMap<String, String>,
) -> Result<Sidecar, SpecError> {
    let name = container.name.as_str();
    let kind = sidecar_kind(container, valet)?;
    let quit = quit_endpoint(name, kind, valet, annotations)?;
    let ready = ready_endpoint(name, kind, valet)?;
    let quit_signal = match valet.quit_signals.get(name).copied() {
        None => libc::SIGTERM,
        Some((key, value)) if kind == SidecarKind::Signal => signal(key, value)?,
        Some((key, value)) => {
            return Err(SpecError::malformed(key, value, "only a sidecar of kind signal is ended with a signal"));
        }
    };
    Ok(Sidecar { name: name.to_owned(), kind, quit, ready, quit_signal })
}

/// The kind the pod's annotation gives the sidecar, else the one its name or image tells.
fn sidecar_kind(container: &Container, valet: &ValetAnnotations<'_>) -> Result<SidecarKind, SpecError> {
    let name = container.name.as_str();
    match valet.kinds.get(name) {
        Some((key, value)) => value
            .parse::<SidecarKind>()
            .map_err(|_| SpecError::UnknownSidecarKind { key: (*key).to_owned(), value: shown(value) }),
        None => {
            kind_from_name(name).or_else(|| container.image.as_deref().and_then(kind_from_image)).ok_or_else(|| {
                SpecError::UndeterminedSidecarKind {
                    container: name.to_owned(),
                    image: container.image.clone().unwrap_or_default(),
                    key: format!("{SIDECAR_KIND_PREFIX}{name}"),
                }
            })
        }
    }
}

/// Where the sidecar is asked to quit: its kind's endpoint, moved by valet's annotations or by
/// its own project's (Istio's status port, Vault Agent's listener); none for a signal sidecar.
fn quit_endpoint(
    name: &str,
    kind: SidecarKind,
    valet: &ValetAnnotations<'_>,
    annotations: &BTreeMap<String, String>,
) -> Result<Option<Endpoint>, SpecError> {
    let mut quit = kind.quit_endpoint();
    match valet.quit_ports.get(name).copied() {
        Some((key, value)) => {
            let port = port(key, value)?;
            match (&mut quit, kind) {
                (Some(q), _) => q.port = port,
                // Kuma: Envoy's admin, where it listens on TCP (`envoyAdminUnixSocket: false`).
                (None, SidecarKind::Http | SidecarKind::Kuma) => quit = Some(Endpoint::new(port, "/quitquitquit")),
                (None, _) => return Err(SpecError::malformed(key, value, "a signal sidecar has no quit port")),
            }
        }
        // pilot-agent serves /quitquitquit on its status port, which this annotation moves.
        None if kind == SidecarKind::Istio => {
            if let Some(q) = quit.as_mut()
                && let Some(port) = moved_quit_port(
                    annotations,
                    ISTIO_STATUS_PORT,
                    name,
                    "pilot-agent's status port serves /quitquitquit",
                )?
            {
                q.port = port;
            }
        }
        // vault-k8s: the quit is served on the agent's listener only with its opt-in; without
        // it the agent's own way out is SIGTERM, on which it exits 0.
        None if kind == SidecarKind::Vault => match annotations.get(VAULT_ENABLE_QUIT).map(String::as_str) {
            // What vault-k8s's parseutil.ParseBool (Go's strconv.ParseBool) takes for true.
            Some("1" | "t" | "T" | "true" | "TRUE" | "True") => {
                if let Some(q) = quit.as_mut()
                    && let Some(port) = moved_quit_port(
                        annotations,
                        VAULT_LISTENER_PORT,
                        name,
                        "Vault Agent's listener serves /agent/v1/quit",
                    )?
                {
                    q.port = port;
                }
            }
            _ => quit = None,
        },
        None if kind == SidecarKind::Http => {
            return Err(SpecError::malformed(
                &format!("{SIDECAR_KIND_PREFIX}{name}"),
                "http",
                format!("an http sidecar needs its quit port: set {QUIT_PORT_PREFIX}{name}"),
            ));
        }
        None => {}
    }
    if let Some((key, value)) = valet.quit_paths.get(name).copied() {
        let Some(q) = quit.as_mut() else {
            return Err(SpecError::malformed(key, value, "a signal sidecar has no quit path"));
        };
        q.path = http_path(key, value)?;
    }
    Ok(quit)
}

/// The quit port a sidecar's own project's annotation `key` sets, if the pod has it (`serves`:
/// what listens there).
fn moved_quit_port(
    annotations: &BTreeMap<String, String>,
    key: &str,
    name: &str,
    serves: &str,
) -> Result<Option<u16>, SpecError> {
    let Some(value) = annotations.get(key) else { return Ok(None) };
    port(key, value).map(Some).map_err(|_| {
        SpecError::malformed(key, value, format!("{serves} and must be 1..=65535 (or set {QUIT_PORT_PREFIX}{name})"))
    })
}

/// Where the sidecar is asked whether it is ready: its kind's endpoint, moved or made by the
/// pod's annotations.
fn ready_endpoint(name: &str, kind: SidecarKind, valet: &ValetAnnotations<'_>) -> Result<Option<Endpoint>, SpecError> {
    let mut ready = kind.ready_endpoint();
    if let Some((key, value)) = valet.ready_ports.get(name).copied() {
        let port = port(key, value)?;
        match ready.as_mut() {
            Some(r) => r.port = port,
            None => ready = Some(Endpoint::new(port, "/")),
        }
    }
    if let Some((key, value)) = valet.ready_paths.get(name).copied() {
        let Some(r) = ready.as_mut() else {
            return Err(SpecError::malformed(key, value, format!("set {READY_PORT_PREFIX}{name} too")));
        };
        r.path = http_path(key, value)?;
    }
    Ok(ready)
}

/// A request path: absolute, printable ASCII, no spaces (it goes into the request line as is).
fn http_path(key: &str, value: &str) -> Result<String, SpecError> {
    let ok = value.starts_with('/') && value.len() <= 256 && value.bytes().all(|b| b.is_ascii_graphic());
    if ok {
        Ok(value.to_owned())
    } else {
        Err(SpecError::malformed(key, value, "expected an absolute path like /quit"))
    }
}

/// The signals a helper may be ended with.
fn signal(key: &str, value: &str) -> Result<i32, SpecError> {
    let name = value.trim().to_ascii_uppercase();
    let name = name.strip_prefix("SIG").unwrap_or(&name);
    match name {
        "TERM" => Ok(libc::SIGTERM),
        "INT" => Ok(libc::SIGINT),
        "QUIT" => Ok(libc::SIGQUIT),
        "HUP" => Ok(libc::SIGHUP),
        "USR1" => Ok(libc::SIGUSR1),
        "USR2" => Ok(libc::SIGUSR2),
        "KILL" => Ok(libc::SIGKILL),
        _ => Err(SpecError::malformed(
            key,
            value,
            "expected SIGTERM, SIGINT, SIGQUIT, SIGHUP, SIGUSR1, SIGUSR2 or SIGKILL",
        )),
    }
}

fn port(key: &str, value: &str) -> Result<u16, SpecError> {
    // Digits only: `u16::from_str` would also take "+80".
    let parsed = if value.bytes().all(|b| b.is_ascii_digit()) { value.parse::<u16>().ok() } else { None };
    match parsed {
        Some(p) if p > 0 => Ok(p),
        _ => Err(SpecError::malformed(key, value, "expected a port number 1..=65535")),
    }
}

fn hold_timeout(text: &str) -> Result<Duration, SpecError> {
    let d = crate::vocab::parse_duration(text).map_err(|why| SpecError::malformed(HOLD_TIMEOUT, text, why))?;
    if !(MIN_HOLD_TIMEOUT..=MAX_HOLD_TIMEOUT).contains(&d) {
        return Err(SpecError::malformed(HOLD_TIMEOUT, text, "must be between 1s and 1h"));
    }
    Ok(d)
}

/// The kind the well-known injected container names stand for.
pub(crate) fn kind_from_name(name: &str) -> Option<SidecarKind> {
    match name {
        "istio-proxy" => Some(SidecarKind::Istio),
        "linkerd-proxy" => Some(SidecarKind::Linkerd),
        "cloud-sql-proxy" => Some(SidecarKind::CloudSql),
        "envoy" => Some(SidecarKind::Envoy),
        "vault-agent" => Some(SidecarKind::Vault),
        "consul-dataplane" => Some(SidecarKind::Consul),
        "kuma-sidecar" => Some(SidecarKind::Kuma),
        "alloydb-auth-proxy" => Some(SidecarKind::AlloyDb),
        _ => None,
    }
}

/// The kind an image reference stands for, from its repository path (registry, tag and digest
/// do not matter: mirrors keep the path).
fn kind_from_image(image: &str) -> Option<SidecarKind> {
    let without_digest = image.split('@').next().unwrap_or(image);
    let mut path: Vec<&str> = without_digest.split('/').collect();
    let last = path.pop().unwrap_or_default();
    let last = last.split(':').next().unwrap_or(last);
    path.push(last);
    let any = |pred: fn(&str) -> bool| path.iter().any(|c| pred(c));
    if last == "proxyv2" {
        Some(SidecarKind::Istio)
    } else if any(|c| c == "envoyproxy") && last.starts_with("envoy") {
        Some(SidecarKind::Envoy)
    } else if any(|c| c.contains("linkerd")) && last.ends_with("proxy") {
        // `linkerd/proxy`, older `linkerd-io/proxy`; `proxy-init` is the init container.
        Some(SidecarKind::Linkerd)
    } else if any(|c| matches!(c, "cloud-sql-proxy" | "cloudsql-proxy" | "cloud-sql-connectors")) {
        Some(SidecarKind::CloudSql)
    } else if any(|c| matches!(c, "alloydb-auth-proxy" | "alloydb-connectors")) {
        Some(SidecarKind::AlloyDb)
    } else if last == "consul-dataplane" {
        Some(SidecarKind::Consul)
    } else if last == "kuma-dp" {
        Some(SidecarKind::Kuma)
    } else if last == "vault" && any(|c| c == "hashicorp") {
        // `hashicorp/vault`: the image vault-k8s runs its agent from.
        Some(SidecarKind::Vault)
    } else {
        None
    }
}

/// Whether Istio's per-pod ProxyConfig turns on holdApplicationUntilProxyStarts. The value is
/// YAML (or JSON, which is YAML); a key/value scan is enough for this one top-level flag.
fn proxy_config_holds_app(config: &str) -> bool {
    let unquote = |s: &str| s.trim().trim_matches(|c| c == '"' || c == '\'').to_owned();
    config.split(['\n', ',', '{', '}']).any(|segment| {
        let segment = segment.split('#').next().unwrap_or_default();
        segment.split_once(':').is_some_and(|(key, value)| {
            unquote(key) == "holdApplicationUntilProxyStarts" && unquote(value).eq_ignore_ascii_case("true")
        })
    })
}

/// Istio injects `postStart: exec: pilot-agent wait` when it holds the app itself (whatever
/// turned it on: pod annotation or mesh-wide config).
fn runs_pilot_agent_wait(container: &Container) -> bool {
    let Some(command) = container
        .lifecycle
        .as_ref()
        .and_then(|l| l.post_start.as_ref())
        .and_then(|h| h.exec.as_ref())
        .and_then(|e| e.command.as_ref())
    else {
        return false;
    };
    let words: Vec<&str> = command.iter().flat_map(|arg| arg.split_whitespace()).collect();
    words.windows(2).any(|w| (w[0] == "pilot-agent" || w[0].ends_with("/pilot-agent")) && w[1] == "wait")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pod::fixtures;
    use serde_json::json;

    fn defaults() -> SidecarDefaults {
        SidecarDefaults::default()
    }

    fn plan_of(pod: &Pod) -> PodPlan {
        match plan(pod, &defaults()) {
            Ok(p) => p,
            Err(e) => panic!("plan failed: {e}"),
        }
    }

    fn err_of(pod: &Pod) -> SpecError {
        match plan(pod, &defaults()) {
            Ok(p) => panic!("expected an error, got {p:?}"),
            Err(e) => e,
        }
    }

    /// The `istio-proxy` sidecar with Istio's defaults: quit through pilot-agent, ready on 15021.
    fn istio_proxy() -> Sidecar {
        Sidecar {
            name: "istio-proxy".into(),
            kind: SidecarKind::Istio,
            quit: endpoint(15020, "/quitquitquit"),
            ready: endpoint(15021, "/healthz/ready"),
            quit_signal: libc::SIGTERM,
        }
    }

    fn endpoint(port: u16, path: &str) -> Option<Endpoint> {
        Some(Endpoint::new(port, path))
    }

    #[test]
    fn istio_job_pod() {
        let p = plan_of(&fixtures::istio_job());
        assert_eq!(p.uid, fixtures::UID);
        assert_eq!((p.namespace.as_str(), p.name.as_str()), ("batch", "report-28712345-x7k2p"));
        assert_eq!(p.restart_policy, RestartPolicy::Never);
        assert_eq!(p.apps, ["report"]);
        assert_eq!(p.sidecars, [istio_proxy()]);
        assert_eq!(p.init_containers, ["istio-init"]);
        assert!(p.native_sidecars.is_empty());
        assert!(!p.hold_app);
        assert_eq!(p.hold_timeout, DEFAULT_HOLD_TIMEOUT);
        assert!(!p.istio_holds_app);
        assert_eq!(p.pod_ip.as_deref(), Some("10.244.1.17"));
        assert!(!p.deleting);
    }

    #[test]
    fn istio_status_port_moves_quit_only() {
        let pod = fixtures::with_annotations(fixtures::istio_job(), &[(ISTIO_STATUS_PORT, "15120")]);
        let p = plan_of(&pod);
        assert_eq!(p.sidecars[0].quit, endpoint(15120, "/quitquitquit"));
        assert_eq!(p.sidecars[0].ready, endpoint(15021, "/healthz/ready"));
        // valet's own annotation wins over Istio's.
        let pod = fixtures::with_annotations(
            pod,
            &[("valet.dev/quit-port.istio-proxy", "15999"), ("valet.dev/ready-port.istio-proxy", "15998")],
        );
        let p = plan_of(&pod);
        assert_eq!(p.sidecars[0].quit, endpoint(15999, "/quitquitquit"));
        assert_eq!(p.sidecars[0].ready, endpoint(15998, "/healthz/ready"));
        for bad in ["0", "abc", "70000", ""] {
            let pod = fixtures::with_annotations(fixtures::istio_job(), &[(ISTIO_STATUS_PORT, bad)]);
            let e = err_of(&pod);
            assert_eq!(e.reason(), "MalformedAnnotation", "{bad:?}: {e}");
            assert!(e.to_string().contains(ISTIO_STATUS_PORT), "{e}");
        }
        // Istio's annotation is not valet's business on a pod without an Istio sidecar.
        let pod = fixtures::with_annotations(fixtures::linkerd_job(), &[(ISTIO_STATUS_PORT, "0")]);
        assert!(plan(&pod, &defaults()).is_ok());
    }

    #[test]
    fn linkerd_pod() {
        let p = plan_of(&fixtures::linkerd_job());
        assert_eq!(p.restart_policy, RestartPolicy::OnFailure);
        assert_eq!(p.apps, ["migrate"]);
        assert_eq!(p.sidecars.len(), 1);
        let s = &p.sidecars[0];
        assert_eq!((s.name.as_str(), s.kind), ("linkerd-proxy", SidecarKind::Linkerd));
        assert_eq!(s.quit, endpoint(4191, "/shutdown"));
        assert_eq!(s.ready, endpoint(4191, "/ready"));
        assert_eq!(p.init_containers, ["linkerd-init"]);
        assert!(p.native_sidecars.is_empty());
    }

    #[test]
    fn cloud_sql_proxy_pod() {
        let p = plan_of(&fixtures::cloud_sql_job());
        assert_eq!(p.apps, ["etl", "notify"]);
        let s = &p.sidecars[0];
        assert_eq!((s.name.as_str(), s.kind), ("cloud-sql-proxy", SidecarKind::CloudSql));
        assert_eq!(s.quit, endpoint(9091, "/quitquitquit"));
        assert_eq!(s.ready, endpoint(9090, "/readiness"));
        assert!(p.hold_app);
        assert_eq!(p.hold_timeout, Duration::from_secs(90));
        assert_eq!(p.restart_policy, RestartPolicy::Never);
    }

    /// A Job pod with an app and one injected sidecar, as its injector names it.
    fn job_with(sidecar: &str, image: &str, annotations: &[(&str, &str)]) -> Pod {
        let pod = fixtures::from_json(json!({
            "metadata": {"name": "job-x", "namespace": "batch", "uid": fixtures::UID},
            "spec": {"restartPolicy": "Never", "containers": [
                {"name": "app", "image": "example/app:1"},
                {"name": sidecar, "image": image}
            ]}
        }));
        fixtures::with_annotations(pod, annotations)
    }

    /// The sidecars users run in Jobs beside the meshes, by their injected names, each with the
    /// endpoints its own source documents (docs/sidecars.md names them).
    #[test]
    fn vault_consul_alloydb_and_kuma_by_their_injected_names() {
        let vault_quit = [(VAULT_ENABLE_QUIT, "true")];
        let cases = [
            (
                "vault-agent",
                "hashicorp/vault:1.18.1",
                &vault_quit[..],
                SidecarKind::Vault,
                endpoint(8200, "/agent/v1/quit"),
                None,
            ),
            (
                "consul-dataplane",
                "hashicorp/consul-dataplane:1.6.1",
                &[],
                SidecarKind::Consul,
                endpoint(20600, "/graceful_shutdown"),
                endpoint(19000, "/ready"),
            ),
            ("kuma-sidecar", "docker.io/kumahq/kuma-dp:2.9.3", &[], SidecarKind::Kuma, None, endpoint(9902, "/ready")),
        ];
        for (name, image, annotations, kind, quit, ready) in cases {
            let p = plan_of(&job_with(name, image, annotations));
            assert_eq!(p.apps, ["app"], "{name}");
            let s = &p.sidecars[0];
            assert_eq!((s.name.as_str(), s.kind, &s.quit, &s.ready), (name, kind, &quit, &ready), "{name}");
            assert_eq!(s.quit_signal, libc::SIGTERM, "{name}");
        }
        // The AlloyDB Auth Proxy has no injector, so no default name: listed, it is known by its
        // binary's name or by its image.
        for (name, image) in
            [("alloydb-auth-proxy", "example/any:1"), ("db", "gcr.io/alloydb-connectors/alloydb-auth-proxy:1.13.3")]
        {
            let s = plan_of(&job_with(name, image, &[("valet.dev/sidecars", name)])).sidecars.remove(0);
            assert_eq!(
                (s.kind, s.quit, s.ready),
                (SidecarKind::AlloyDb, endpoint(9091, "/quitquitquit"), endpoint(9090, "/readiness"))
            );
        }
    }

    /// vault-k8s serves `/agent/v1/quit` only with `agent-enable-quit`, on the listener port its
    /// annotation sets; without the opt-in the agent is ended with SIGTERM (it exits 0), never
    /// with a quit that cannot land. valet's own quit-port annotation still wins.
    #[test]
    fn vault_agent_follows_vault_k8s_annotations() {
        let image = "hashicorp/vault:1.18.1";
        let quit_of = |annotations: &[(&str, &str)]| {
            plan_of(&job_with("vault-agent", image, annotations)).sidecars[0].quit.clone()
        };
        assert_eq!(quit_of(&[]), None, "no opt-in: SIGTERM");
        assert_eq!(quit_of(&[(VAULT_ENABLE_QUIT, "false")]), None);
        assert_eq!(quit_of(&[(VAULT_ENABLE_QUIT, "yes")]), None, "not a Go bool: vault-k8s refuses it too");
        for yes in ["true", "1", "T", "TRUE"] {
            assert_eq!(quit_of(&[(VAULT_ENABLE_QUIT, yes)]), endpoint(8200, "/agent/v1/quit"), "{yes}");
        }
        assert_eq!(
            quit_of(&[(VAULT_ENABLE_QUIT, "true"), (VAULT_LISTENER_PORT, "8100")]),
            endpoint(8100, "/agent/v1/quit")
        );
        assert_eq!(
            quit_of(&[(VAULT_LISTENER_PORT, "8100"), ("valet.dev/quit-port.vault-agent", "8300")]),
            endpoint(8300, "/agent/v1/quit"),
            "valet's annotation says the quit is served"
        );
        let e = err_of(&job_with("vault-agent", image, &[(VAULT_ENABLE_QUIT, "true"), (VAULT_LISTENER_PORT, "0")]));
        assert!(matches!(&e, SpecError::MalformedAnnotation { key, .. } if key == VAULT_LISTENER_PORT), "{e}");
        // Kuma: kuma-dp ends on SIGTERM; where Envoy's admin listens on TCP, it can be named.
        let kuma = job_with("kuma-sidecar", "kumahq/kuma-dp:2.9.3", &[("valet.dev/quit-port.kuma-sidecar", "9901")]);
        assert_eq!(plan_of(&kuma).sidecars[0].quit, endpoint(9901, "/quitquitquit"));
    }

    #[test]
    fn sidecars_override_and_kinds_from_annotation_and_image() {
        let p = plan_of(&fixtures::override_job());
        // Spec order, not annotation order; `db-proxy` is not a default name but is listed.
        assert_eq!(p.apps, ["worker", "istio-proxy"]);
        let names: Vec<_> = p.sidecars.iter().map(|s| (s.name.as_str(), s.kind)).collect();
        assert_eq!(
            names,
            [("mesh", SidecarKind::Envoy), ("db-proxy", SidecarKind::CloudSql), ("l5d", SidecarKind::Linkerd)]
        );
        assert_eq!(p.sidecars[0].quit, endpoint(9901, "/quitquitquit"));
        assert_eq!(p.sidecars[0].ready, endpoint(9901, "/ready"));
        assert_eq!(p.sidecars[1].ready, endpoint(8090, "/readiness"));
        assert_eq!(p.restart_policy, RestartPolicy::Always);
    }

    #[test]
    fn defaults_are_configurable() {
        let custom = SidecarDefaults { names: vec!["envoy".into()], ..SidecarDefaults::default() };
        let pod = fixtures::pod(json!({
            "containers": [{"name": "app", "image": "busybox"}, {"name": "envoy", "image": "envoyproxy/envoy:v1.30.1"},
                           {"name": "istio-proxy", "image": "docker.io/istio/proxyv2:1.22.0"}],
            "restartPolicy": "Never"
        }));
        let Ok(p) = plan(&pod, &custom) else { panic!("plan") };
        assert_eq!(p.apps, ["app", "istio-proxy"]);
        assert_eq!(p.sidecars.len(), 1);
        assert_eq!((p.sidecars[0].name.as_str(), p.sidecars[0].kind), ("envoy", SidecarKind::Envoy));
        let Ok(p) = plan(&pod, &defaults()) else { panic!("plan") };
        assert_eq!(p.apps, ["app"]);
        let names: Vec<&str> = p.sidecars.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["envoy", "istio-proxy"]);
    }

    // A container named `envoy` running Envoy's image beside an app is its proxy by default; the
    // name or the image alone is not enough, and Envoy alone in its pod is the work.
    #[test]
    fn envoy_by_name_and_image_is_a_sidecar_by_default() {
        let planned = |containers: serde_json::Value| {
            let pod = fixtures::pod(json!({"containers": containers, "restartPolicy": "Never"}));
            let Ok(p) = plan(&pod, &defaults()) else { panic!("plan") };
            (p.apps, p.sidecars.iter().map(|s| (s.name.clone(), s.kind)).collect::<Vec<_>>())
        };
        let app = json!({"name": "app", "image": "busybox"});
        let (apps, sidecars) = planned(json!([app, {"name": "envoy", "image": "docker.io/envoyproxy/envoy:v1.40.0"}]));
        assert_eq!((apps, sidecars), (vec!["app".to_owned()], vec![("envoy".to_owned(), SidecarKind::Envoy)]));
        let (apps, sidecars) = planned(json!([app, {"name": "envoy", "image": "nginx"}]));
        assert_eq!((apps.len(), sidecars.len()), (2, 0), "the name alone");
        let (apps, sidecars) = planned(json!([app, {"name": "gateway", "image": "envoyproxy/envoy:v1.40.0"}]));
        assert_eq!((apps.len(), sidecars.len()), (2, 0), "the image alone");
        let (apps, sidecars) = planned(json!([{"name": "envoy", "image": "envoyproxy/envoy:v1.40.0"}]));
        assert_eq!((apps.len(), sidecars.len()), (1, 0), "Envoy alone is the work");
    }

    #[test]
    fn no_sidecars_and_no_annotations() {
        let pod = fixtures::pod(json!({"containers": [{"name": "app", "image": "busybox"}]}));
        let p = plan_of(&pod);
        assert_eq!(p.restart_policy, RestartPolicy::Always);
        assert_eq!(p.apps, ["app"]);
        assert!(p.sidecars.is_empty() && p.init_containers.is_empty() && p.pod_ip.is_none());
    }

    #[test]
    fn native_sidecar_pod() {
        let p = plan_of(&fixtures::native_sidecar_job());
        assert_eq!(p.init_containers, ["istio-validation", "istio-proxy"]);
        assert_eq!(p.native_sidecars, ["istio-proxy"]);
        // Neither the regular init container nor the native sidecar is an app.
        assert_eq!(p.apps, ["train"]);
        // The native istio-proxy is quit like a regular one, through pilot-agent.
        assert_eq!(p.sidecars, [istio_proxy()]);
        // Istio 1.27 as a native sidecar still gets its postStart hook when it holds the app.
        assert!(p.istio_holds_app);
    }

    // Native sidecars follow the same rules as regular ones: the default names, or the pod's
    // list; a native helper that is not a proxy is ended by the signal the pod names; one that
    // is not listed is left to the kubelet (and is not an app either); a regular init container
    // is never a sidecar.
    #[test]
    fn native_sidecars_follow_the_regular_rules() {
        let native_pod = |annotations: serde_json::Value| {
            let mut pod = fixtures::pod(json!({
                "restartPolicy": "OnFailure",
                "initContainers": [
                    {"name": "setup", "image": "busybox"},
                    {"name": "cloud-sql-proxy", "image": "gcr.io/cloud-sql-connectors/cloud-sql-proxy:2.11",
                     "restartPolicy": "Always"},
                    {"name": "logs", "image": "fluent/fluent-bit:3.0", "restartPolicy": "Always"},
                    {"name": "envoy", "image": "envoyproxy/envoy:v1.40.0", "restartPolicy": "Always"}
                ],
                "containers": [{"name": "etl", "image": "etl"}, {"name": "notify", "image": "notify"}]
            }));
            pod.metadata.annotations = serde_json::from_value(annotations).ok();
            pod
        };
        let names = |p: &PodPlan| p.sidecars.iter().map(|s| (s.name.clone(), s.kind)).collect::<Vec<_>>();
        // Defaults: the known name and Envoy by name and image beside the apps; not the logs.
        let p = plan_of(&native_pod(json!({})));
        assert_eq!(p.apps, ["etl", "notify"]);
        assert_eq!(
            names(&p),
            [("cloud-sql-proxy".to_owned(), SidecarKind::CloudSql), ("envoy".to_owned(), SidecarKind::Envoy)]
        );
        assert_eq!(p.native_sidecars, ["cloud-sql-proxy", "logs", "envoy"]);
        assert_eq!(p.init_containers, ["setup", "cloud-sql-proxy", "logs", "envoy"]);
        // Listed, with a signal: the log shipper is ended like a regular helper.
        let p = plan_of(&native_pod(json!({
            "valet.dev/sidecars": "logs,cloud-sql-proxy",
            "valet.dev/sidecar-kind.logs": "signal",
            "valet.dev/quit-signal.logs": "SIGINT"
        })));
        assert_eq!(p.apps, ["etl", "notify"]);
        assert_eq!(
            names(&p),
            [("cloud-sql-proxy".to_owned(), SidecarKind::CloudSql), ("logs".to_owned(), SidecarKind::Signal)]
        );
        assert_eq!(p.sidecars[1].quit_signal, libc::SIGINT);
        assert_eq!(p.sidecars[1].quit, None);
        // A regular init container is refused, saying why.
        let e = err_of(&native_pod(json!({"valet.dev/sidecars": "setup"})));
        assert_eq!(e.reason(), "UnknownSidecar");
        assert!(e.to_string().contains("runs to completion"), "{e}");
        // A per-container annotation for a native sidecar that is not listed.
        let e = err_of(&native_pod(json!({"valet.dev/sidecars": "envoy", "valet.dev/sidecar-kind.logs": "signal"})));
        assert!(e.to_string().contains("list it in valet.dev/sidecars"), "{e}");
        // A logs-only native pod: nothing valet quits.
        let pod = fixtures::pod(json!({
            "restartPolicy": "Never",
            "initContainers": [{"name": "logs", "image": "fluent/fluent-bit:3.0", "restartPolicy": "Always"}],
            "containers": [{"name": "app", "image": "busybox"}]
        }));
        let p = plan_of(&pod);
        assert_eq!((p.apps.as_slice(), p.sidecars.len()), (["app".to_owned()].as_slice(), 0));
        assert_eq!(p.native_sidecars, ["logs"]);
    }

    #[test]
    fn istio_hold_detected_from_annotation_or_hook() {
        let p = plan_of(&fixtures::istio_hold_job());
        assert!(p.istio_holds_app);
        // The injector moves istio-proxy first; the app list stays the rest in order.
        assert_eq!(p.apps, ["report"]);
        assert_eq!(p.sidecars[0].name, "istio-proxy");

        // The annotation alone (hook stripped) is enough.
        let mut pod = fixtures::istio_hold_job();
        if let Some(spec) = pod.spec.as_mut() {
            spec.containers[0].lifecycle = None;
        }
        assert!(plan_of(&pod).istio_holds_app);

        // The hook alone (annotation removed) is enough: mesh-wide config has no pod annotation.
        let mut pod = fixtures::istio_hold_job();
        if let Some(a) = pod.metadata.annotations.as_mut() {
            a.remove(ISTIO_PROXY_CONFIG);
        }
        assert!(plan_of(&pod).istio_holds_app);
    }

    #[test]
    fn proxy_config_variants() {
        for yes in [
            "holdApplicationUntilProxyStarts: true",
            "holdApplicationUntilProxyStarts: true\n",
            "  holdApplicationUntilProxyStarts:   true  # hold it\n",
            "\"holdApplicationUntilProxyStarts\": \"true\"",
            "'holdApplicationUntilProxyStarts': True",
            "concurrency: 2\nholdApplicationUntilProxyStarts: true\nterminationDrainDuration: 10s\n",
            "{\"holdApplicationUntilProxyStarts\": true, \"concurrency\": 2}",
            "{ concurrency: 2, holdApplicationUntilProxyStarts: true }",
        ] {
            assert!(proxy_config_holds_app(yes), "{yes:?}");
        }
        for no in [
            "",
            "holdApplicationUntilProxyStarts: false",
            "holdApplicationUntilProxyStarts:",
            "# holdApplicationUntilProxyStarts: true",
            "holdApplicationUntilProxyStartsX: true",
            "concurrency: 2",
            "holdApplicationUntilProxyStarts true",
        ] {
            assert!(!proxy_config_holds_app(no), "{no:?}");
        }
    }

    #[test]
    fn image_kinds() {
        for (image, kind) in [
            ("docker.io/istio/proxyv2:1.22.0", Some(SidecarKind::Istio)),
            ("gcr.io/istio-release/proxyv2:1.22.0-distroless", Some(SidecarKind::Istio)),
            ("proxyv2", Some(SidecarKind::Istio)),
            ("registry.local:5000/mirror/istio/proxyv2@sha256:abcd", Some(SidecarKind::Istio)),
            ("envoyproxy/envoy:v1.30.1", Some(SidecarKind::Envoy)),
            ("docker.io/envoyproxy/envoy-distroless:v1.30.1", Some(SidecarKind::Envoy)),
            ("cr.l5d.io/linkerd/proxy:edge-24.5.1", Some(SidecarKind::Linkerd)),
            ("gcr.io/linkerd-io/proxy:stable-2.10.2", Some(SidecarKind::Linkerd)),
            ("cr.l5d.io/linkerd/proxy-init:v2.4.0", None),
            ("gcr.io/cloud-sql-connectors/cloud-sql-proxy:2.11.0", Some(SidecarKind::CloudSql)),
            ("example.com/tools/cloudsql-proxy:1", Some(SidecarKind::CloudSql)),
            ("gcr.io/alloydb-connectors/alloydb-auth-proxy:1.13.3", Some(SidecarKind::AlloyDb)),
            ("hashicorp/consul-dataplane:1.6.1", Some(SidecarKind::Consul)),
            ("docker.io/kumahq/kuma-dp:2.9.3", Some(SidecarKind::Kuma)),
            ("docker.io/hashicorp/vault:1.18.1", Some(SidecarKind::Vault)),
            ("example.com/vault:1", None),
            ("hashicorp/consul:1.20", None),
            ("busybox:1.36", None),
            ("nginx", None),
            ("", None),
            ("istio/pilot:1.22.0", None),
        ] {
            assert_eq!(kind_from_image(image), kind, "{image:?}");
        }
    }

    #[test]
    fn kind_names_and_endpoints() {
        for kind in SidecarKind::ALL {
            assert_eq!(kind.as_str().parse(), Ok(kind));
            assert_eq!(kind.as_str().to_uppercase().parse(), Ok(kind));
            assert_eq!(format!(" {kind} ").parse(), Ok(kind));
            let paths = [kind.quit_endpoint(), kind.ready_endpoint()].into_iter().flatten();
            assert!(paths.map(|e| e.path).all(|p| p.starts_with('/')));
            assert_eq!(
                kind.quit_endpoint().is_none(),
                matches!(kind, SidecarKind::Http | SidecarKind::Signal | SidecarKind::Kuma)
            );
            assert!(KIND_NAMES.split(", ").any(|n| n == kind.as_str()), "{kind} in {KIND_NAMES}");
        }
        assert_eq!(KIND_NAMES.split(", ").count(), SidecarKind::ALL.len());
        for bad in ["", "istio-proxy", "cloud-sql", "consul-dataplane", "vault-agent"] {
            assert_eq!(bad.parse::<SidecarKind>(), Err(UnknownKind(bad.into())), "{bad:?}");
        }
        assert_eq!(SidecarKind::Envoy.quit_endpoint(), endpoint(15000, "/quitquitquit"));
        assert_eq!(SidecarKind::Envoy.ready_endpoint(), endpoint(15000, "/ready"));
    }

    #[test]
    fn hold_annotations() {
        let cases = [("90s", 90_000), ("2m", 120_000), ("1m30s", 90_000), ("1s", 1_000), ("1h", 3_600_000)];
        for (text, ms) in cases {
            let pod = fixtures::with_annotations(fixtures::istio_job(), &[(HOLD_TIMEOUT, text), (HOLD_APP, "true")]);
            let p = plan_of(&pod);
            assert_eq!(p.hold_timeout, Duration::from_millis(ms), "{text}");
            assert!(p.hold_app);
        }
        let pod = fixtures::with_annotations(fixtures::istio_job(), &[(HOLD_APP, "false")]);
        assert!(!plan_of(&pod).hold_app);
    }

    /// Every malformed annotation names its key and gets the right reason.
    #[test]
    fn malformed_annotations() {
        let cases: &[(&str, &str, &str)] = &[
            (HOLD_APP, "yes", "MalformedAnnotation"),
            (HOLD_APP, "True", "MalformedAnnotation"),
            (HOLD_APP, "", "MalformedAnnotation"),
            (HOLD_TIMEOUT, "500ms", "MalformedAnnotation"),
            (HOLD_TIMEOUT, "2h", "MalformedAnnotation"),
            (HOLD_TIMEOUT, "90", "MalformedAnnotation"),
            (HOLD_TIMEOUT, "soon", "MalformedAnnotation"),
            (HOLD_TIMEOUT, "-5s", "MalformedAnnotation"),
            (HOLD_TIMEOUT, "", "MalformedAnnotation"),
            ("valet.dev/quit-port.istio-proxy", "0", "MalformedAnnotation"),
            ("valet.dev/quit-port.istio-proxy", "65536", "MalformedAnnotation"),
            ("valet.dev/quit-port.istio-proxy", "+80", "MalformedAnnotation"),
            ("valet.dev/quit-port.istio-proxy", "http", "MalformedAnnotation"),
            ("valet.dev/ready-port.istio-proxy", "-1", "MalformedAnnotation"),
            ("valet.dev/ready-port.istio-proxy", " 15021", "MalformedAnnotation"),
            (SIDECARS, "istio-proxy,", "MalformedAnnotation"),
            (SIDECARS, "", "MalformedAnnotation"),
            (SIDECARS, "istio-proxy, istio-proxy", "MalformedAnnotation"),
            ("valet.dev/sidecar-kind.istio-proxy", "kong", "UnknownSidecarKind"),
            ("valet.dev/sidecar-kind.istio-proxy", "", "UnknownSidecarKind"),
            (SIDECARS, "istio-proxy,missing", "UnknownSidecar"),
            (SIDECARS, "istio-init", "UnknownSidecar"),
            ("valet.dev/quit-port.report", "8080", "UnknownSidecar"),
            ("valet.dev/sidecar-kind.nope", "envoy", "UnknownSidecar"),
            ("valet.dev/hold-apps", "true", "UnknownAnnotation"),
            ("valet.dev/sidecar", "istio-proxy", "UnknownAnnotation"),
            ("valet.dev/quit-port.", "15020", "UnknownAnnotation"),
            ("valet.dev/quitport.istio-proxy", "15020", "UnknownAnnotation"),
            ("valet.dev/enabled", "true", "UnknownAnnotation"),
        ];
        for &(key, value, reason) in cases {
            let pod = fixtures::with_annotations(fixtures::istio_job(), &[(key, value)]);
            let e = err_of(&pod);
            assert_eq!(e.reason(), reason, "{key}={value:?}: {e}");
            assert!(e.to_string().contains(key), "{key}={value:?}: message names the key: {e}");
        }
    }

    /// The generic kinds take their endpoints and signal from the pod's annotations, within the
    /// bounds SECURITY.md states: a port, an absolute printable path, one of seven signals.
    #[test]
    fn http_and_signal_kinds_from_annotations() {
        let kind = "valet.dev/sidecar-kind.istio-proxy";
        let with = |annotations: &[(&str, &str)]| fixtures::with_annotations(fixtures::istio_job(), annotations);
        let http = plan_of(&with(&[
            (kind, "http"),
            ("valet.dev/quit-port.istio-proxy", "8080"),
            ("valet.dev/quit-path.istio-proxy", "/admin/stop"),
            ("valet.dev/ready-port.istio-proxy", "8081"),
            ("valet.dev/ready-path.istio-proxy", "/healthz"),
        ]));
        assert_eq!(http.sidecars[0].quit, endpoint(8080, "/admin/stop"));
        assert_eq!(http.sidecars[0].ready, endpoint(8081, "/healthz"));
        let bare = plan_of(&with(&[(kind, "http"), ("valet.dev/quit-port.istio-proxy", "8080")]));
        assert_eq!(
            (bare.sidecars[0].quit.clone(), bare.sidecars[0].ready.clone()),
            (endpoint(8080, "/quitquitquit"), None)
        );
        let signal = plan_of(&with(&[(kind, "signal"), ("valet.dev/quit-signal.istio-proxy", "sigkill")]));
        assert_eq!((signal.sidecars[0].quit.clone(), signal.sidecars[0].quit_signal), (None, libc::SIGKILL));
        assert_eq!(plan_of(&with(&[(kind, "signal")])).sidecars[0].quit_signal, libc::SIGTERM);

        let refused: &[&[(&str, &str)]] = &[
            &[(kind, "http")],
            &[(kind, "http"), ("valet.dev/quit-port.istio-proxy", "8080"), ("valet.dev/quit-path.istio-proxy", "stop")],
            &[(kind, "http"), ("valet.dev/quit-port.istio-proxy", "8080"), ("valet.dev/quit-path.istio-proxy", "/a b")],
            &[
                (kind, "http"),
                ("valet.dev/quit-port.istio-proxy", "8080"),
                ("valet.dev/quit-path.istio-proxy", "/a\r\nHost: x"),
            ],
            &[(kind, "http"), ("valet.dev/quit-port.istio-proxy", "1"), ("valet.dev/ready-path.istio-proxy", "/r")],
            &[(kind, "signal"), ("valet.dev/quit-port.istio-proxy", "8080")],
            &[(kind, "signal"), ("valet.dev/quit-path.istio-proxy", "/stop")],
            &[(kind, "signal"), ("valet.dev/quit-signal.istio-proxy", "SIGSTOP")],
            &[(kind, "signal"), ("valet.dev/quit-signal.istio-proxy", "9")],
            &[(kind, "istio"), ("valet.dev/quit-signal.istio-proxy", "SIGKILL")],
        ];
        for annotations in refused {
            let e = err_of(&with(annotations));
            assert_eq!(e.reason(), "MalformedAnnotation", "{annotations:?}: {e}");
        }
    }

    #[test]
    fn error_details() {
        let pod = fixtures::with_annotations(fixtures::istio_job(), &[(SIDECARS, "istio-init")]);
        let e = err_of(&pod);
        assert!(e.to_string().contains("init container"), "{e}");
        let pod = fixtures::with_annotations(fixtures::istio_job(), &[("valet.dev/quit-port.report", "1")]);
        assert_eq!(
            err_of(&pod),
            SpecError::UnknownSidecar {
                key: "valet.dev/quit-port.report".into(),
                value: "1".into(),
                container: "report".into(),
                why: "is not a sidecar of this pod (list it in valet.dev/sidecars)",
            }
        );
        let long = "x".repeat(500);
        let pod = fixtures::with_annotations(fixtures::istio_job(), &[(HOLD_APP, long.as_str())]);
        assert!(err_of(&pod).to_string().len() < 300, "long values are cut in messages");
        // Foreign annotations are not valet's concern, however odd.
        let pod = fixtures::with_annotations(
            fixtures::istio_job(),
            &[("example.com/valet.dev/x", "?"), ("valet.dev.example.com/x", "?")],
        );
        assert!(plan(&pod, &defaults()).is_ok());
    }

    #[test]
    fn undeterminable_sidecar_kind() {
        let pod = fixtures::with_annotations(fixtures::istio_job(), &[(SIDECARS, "report")]);
        let e = err_of(&pod);
        assert_eq!(
            e,
            SpecError::UndeterminedSidecarKind {
                container: "report".into(),
                image: "registry.example.com/batch/report:2024.06".into(),
                key: "valet.dev/sidecar-kind.report".into(),
            }
        );
        assert_eq!(e.reason(), "UndeterminedSidecarKind");
        // The same pod with the kind given is fine.
        let pod = fixtures::with_annotations(pod, &[("valet.dev/sidecar-kind.report", "Envoy")]);
        let p = plan_of(&pod);
        assert_eq!(p.apps, ["istio-proxy"]);
        assert_eq!(p.sidecars[0].kind, SidecarKind::Envoy);
    }

    #[test]
    fn invalid_pods() {
        let mut pod = fixtures::istio_job();
        pod.metadata.uid = None;
        assert_eq!(err_of(&pod), SpecError::InvalidPod { field: "metadata.uid", why: "missing".into() });
        let mut pod = fixtures::istio_job();
        pod.spec = None;
        assert_eq!(err_of(&pod).reason(), "InvalidPod");
        let mut pod = fixtures::istio_job();
        if let Some(spec) = pod.spec.as_mut() {
            spec.restart_policy = Some("Sometimes".into());
        }
        assert!(err_of(&pod).to_string().contains("spec.restartPolicy"));
    }

    #[test]
    fn deleting_pod() {
        let mut pod = fixtures::istio_job();
        pod.metadata.deletion_timestamp = serde_json::from_value(json!("2024-06-01T12:00:00Z")).ok();
        assert!(pod.metadata.deletion_timestamp.is_some());
        assert!(plan_of(&pod).deleting);
    }
}
