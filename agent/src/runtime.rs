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
/// The most of a `mountinfo` read.
const MAX_MOUNTINFO_BYTES: u64 = 1024 * 1024;

/// Where the runtimes keep the bundles of Kubernetes containers, relative to the host root:
/// containerd's CRI namespace and CRI-O's storage.
pub const WELL_KNOWN_STATE_DIRS: [&str; 2] =
    ["run/containerd/io.containerd.runtime.v2.task/k8s.io", "run/containers/storage/overlay-containers"];

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

/// The container a process belongs to, from the kubelet's per-container mounts in its
/// `mountinfo`: the kubelet bind-mounts `/var/lib/kubelet/pods/<uid>/containers/<name>/<n>` as
/// the container's termination log. Only mounts of pod `pod_uid` count.
pub fn name_from_mountinfo(mountinfo: &str, pod_uid: &str) -> Option<String> {
    let marker = format!("/pods/{pod_uid}/containers/");
    mountinfo.lines().find_map(|line| {
        // Field 4 is the mount's root within its file system.
        let root = line.split(' ').nth(3)?;
        let rest = &root[root.find(&marker)? + marker.len()..];
        let name = rest.split('/').next()?;
        let valid = !name.is_empty()
            && name.len() <= 63
            && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
        valid.then(|| name.to_owned())
    })
}

/// [`name_from_mountinfo`] for a live process, read from `<host_proc>/<pid>/mountinfo`.
pub fn name_of_process(host_proc: &std::path::Path, pid: u32, pod_uid: &str) -> Option<String> {
    let file = std::fs::File::open(host_proc.join(pid.to_string()).join("mountinfo")).ok()?;
    let mut text = String::new();
    file.take(MAX_MOUNTINFO_BYTES).read_to_string(&mut text).ok()?;
    name_from_mountinfo(&text, pod_uid)
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
    fn names_a_container_from_the_kubelets_mounts() {
        let info = format!(
            "1301 1290 0:112 / / rw,relatime - overlay overlay rw\n\
             1320 1301 8:1 /var/lib/kubelet/pods/{UID}/etc-hosts /etc/hosts rw - ext4 /dev/sda1 rw\n\
             1321 1301 8:1 /var/lib/kubelet/pods/{UID}/containers/istio-proxy/5a1c2e3f /dev/termination-log rw - ext4 /dev/sda1 rw\n"
        );
        assert_eq!(name_from_mountinfo(&info, UID).as_deref(), Some("istio-proxy"));
        assert_eq!(name_from_mountinfo(&info, "11111111-2222-4333-8444-555555555555"), None, "another pod's");
        let odd = format!("1 1 8:1 /var/lib/kubelet/pods/{UID}/containers/Bad_Name/1 /x rw - ext4 /dev/sda1 rw\n");
        assert_eq!(name_from_mountinfo(&odd, UID), None);
        assert_eq!(name_from_mountinfo("garbage", UID), None);
        assert_eq!(name_of_process(std::path::Path::new("/proc"), std::process::id(), UID), None);
    }

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
