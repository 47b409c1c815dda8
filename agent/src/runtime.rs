//! Container names from the container runtime's OCI bundles. The runtime writes a container's
//! `config.json` (with the kubelet's annotations) before it starts the container's process, about
//! a second before the API reports the container's id: with the state directory mounted, valet
//! knows a container as soon as its process exits or execs.
//!
//! Read-only files, looked up by container id; a bundle whose pod uid differs from the pod's is
//! ignored. Layouts: containerd `<dir>/<id>/config.json` (dir
//! `/run/containerd/io.containerd.runtime.v2.task/k8s.io`), CRI-O `<dir>/<id>/userdata/config.json`
//! (dir `/run/containers/storage/overlay-containers`).

use std::io::Read as _;
use std::path::PathBuf;

/// The most of a `config.json` read (they are tens of kilobytes; environments can be large).
const MAX_CONFIG_BYTES: u64 = 4 * 1024 * 1024;

/// The name the kubelet gives the pod sandbox (infra container). Container names are DNS-1123
/// labels, lower case: no app or sidecar can be called this.
pub const SANDBOX_NAME: &str = "POD";

/// What a bundle says about a container.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BundleRole {
    /// The pod sandbox (pause).
    Sandbox,
    /// A container of the pod spec, by name.
    Container(String),
}

/// The runtime state directories to look in (none: the feature is off).
#[derive(Clone, Debug, Default)]
pub struct RuntimeBundles {
    dirs: Vec<PathBuf>,
}

fn annotation<'a>(annotations: &'a serde_json::Value, keys: &[&str]) -> Option<&'a str> {
    keys.iter().find_map(|k| annotations.get(*k).and_then(|v| v.as_str()))
}

/// Reads the role and pod uid from a `config.json`'s annotations (containerd or CRI-O keys).
pub fn parse_config(text: &str) -> Option<(BundleRole, Option<String>)> {
    let config: serde_json::Value = serde_json::from_str(text).ok()?;
    let annotations = config.get("annotations")?;
    let kind = annotation(annotations, &["io.kubernetes.cri.container-type", "io.kubernetes.cri-o.ContainerType"])?;
    let uid = annotation(annotations, &["io.kubernetes.cri.sandbox-uid", "io.kubernetes.pod.uid"]).map(str::to_owned);
    let role = match kind {
        "sandbox" => BundleRole::Sandbox,
        "container" => BundleRole::Container(
            annotation(annotations, &["io.kubernetes.cri.container-name", "io.kubernetes.container.name"])?.to_owned(),
        ),
        _ => return None,
    };
    Some((role, uid))
}

impl BundleRole {
    /// The container's name, the sandbox as [`SANDBOX_NAME`].
    pub fn name(&self) -> &str {
        match self {
            BundleRole::Sandbox => SANDBOX_NAME,
            BundleRole::Container(name) => name,
        }
    }
}

impl RuntimeBundles {
    pub fn new(dirs: Vec<PathBuf>) -> RuntimeBundles {
        RuntimeBundles { dirs }
    }

    pub fn enabled(&self) -> bool {
        !self.dirs.is_empty()
    }

    /// The role of container `id` in the pod with uid `pod_uid`, if a bundle says so.
    pub fn role(&self, id: &str, pod_uid: &str) -> Option<BundleRole> {
        // Only a container id is ever joined to the directory.
        if id.len() != 64 || !id.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        for dir in &self.dirs {
            for path in [dir.join(id).join("config.json"), dir.join(id).join("userdata/config.json")] {
                let Ok(file) = std::fs::File::open(&path) else { continue };
                let mut text = String::new();
                if file.take(MAX_CONFIG_BYTES).read_to_string(&mut text).is_err() {
                    continue;
                }
                match parse_config(&text) {
                    Some((role, Some(uid))) if uid == pod_uid => return Some(role),
                    _ => continue,
                }
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CONTAINERD: &str = r#"{"ociVersion":"1.1.0","annotations":{
        "io.kubernetes.cri.container-type":"container",
        "io.kubernetes.cri.container-name":"istio-proxy",
        "io.kubernetes.cri.sandbox-uid":"0b5e1f6e-2a4b-4c3d-8e9f-0a1b2c3d4e5f"}}"#;
    const CRIO_SANDBOX: &str = r#"{"annotations":{
        "io.kubernetes.cri-o.ContainerType":"sandbox",
        "io.kubernetes.pod.uid":"0b5e1f6e-2a4b-4c3d-8e9f-0a1b2c3d4e5f"}}"#;
    const UID: &str = "0b5e1f6e-2a4b-4c3d-8e9f-0a1b2c3d4e5f";

    #[test]
    fn parses_both_runtimes_and_rejects_the_rest() {
        assert_eq!(parse_config(CONTAINERD), Some((BundleRole::Container("istio-proxy".into()), Some(UID.into()))));
        assert_eq!(parse_config(CRIO_SANDBOX), Some((BundleRole::Sandbox, Some(UID.into()))));
        assert_eq!(parse_config("not json"), None);
        assert_eq!(parse_config(r#"{"annotations":{}}"#), None);
        assert_eq!(parse_config(r#"{"annotations":{"io.kubernetes.cri.container-type":"container"}}"#), None);
        assert_eq!(parse_config(r#"{"annotations":{"io.kubernetes.cri.container-type":"weird"}}"#), None);
    }

    #[test]
    fn looks_up_bundles_on_disk_and_checks_the_pod() {
        let dir = std::env::temp_dir().join(format!("valet-bundles-{}", std::process::id()));
        let a = "a".repeat(64);
        let b = "b".repeat(64);
        std::fs::create_dir_all(dir.join(&a)).expect("mkdir");
        std::fs::create_dir_all(dir.join(&b).join("userdata")).expect("mkdir");
        std::fs::write(dir.join(&a).join("config.json"), CONTAINERD).expect("write");
        std::fs::write(dir.join(&b).join("userdata/config.json"), CRIO_SANDBOX).expect("write");
        let bundles = RuntimeBundles::new(vec![dir.clone()]);
        let found = (
            bundles.role(&a, UID),
            bundles.role(&b, UID),
            bundles.role(&a, "11111111-2222-4333-8444-555555555555"),
            bundles.role("../../etc/passwd", UID),
            bundles.role(&"c".repeat(64), UID),
        );
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(found.0, Some(BundleRole::Container("istio-proxy".into())));
        assert_eq!(found.1, Some(BundleRole::Sandbox));
        assert_eq!(found.2, None, "a bundle of another pod is ignored");
        assert_eq!(found.3, None, "only container ids are looked up");
        assert_eq!(found.4, None);
        assert!(!RuntimeBundles::default().enabled());
    }
}
