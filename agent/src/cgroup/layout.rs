//! Where the kubelet puts pods and containers in the cgroup v2 tree, both directions: a cgroup
//! path to the pod and container it belongs to (`classify`), and a pod UID or container ID to the
//! places its cgroup can be (`pod_cgroup_candidates`, `container_cgroup_name`).
//!
//! Paths are relative to the cgroup2 mount and start with `/`. Layouts (cgroup v2):
//! - systemd driver: `/kubepods.slice/kubepods-<qos>.slice/kubepods-<qos>-pod<UID_>.slice/<runtime>-<ID>.scope`,
//!   Guaranteed pods directly under `kubepods.slice` as `kubepods-pod<UID_>.slice`;
//! - cgroupfs driver: `/kubepods/<qos>/pod<UID>/<ID>`, Guaranteed as `/kubepods/pod<UID>/<ID>`.
//!
//! A pod's cgroup is accepted only where the kubelet puts it: right under a kubelet root (or
//! its QoS parent), and never below another pod's cgroup. A container whose cgroup tree is
//! writable (privileged, or cgroup-delegated) can create `.../kubepods/pod<another pod's UID>`
//! inside its own cgroup; such a path is not a pod or a container here, whatever it is named.
//!
//! Everything here is pure string work; an unexpected path is classified, never a panic.

/// The pod's QoS class: it picks the parent cgroup of the pod.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Qos {
    Guaranteed,
    Burstable,
    BestEffort,
}

impl Qos {
    pub const ALL: [Qos; 3] = [Qos::Guaranteed, Qos::Burstable, Qos::BestEffort];

    /// The QoS component name; Guaranteed pods have none (they sit under the kubepods root).
    fn component(self) -> Option<&'static str> {
        match self {
            Qos::Guaranteed => None,
            Qos::Burstable => Some("burstable"),
            Qos::BestEffort => Some("besteffort"),
        }
    }

    fn from_component(name: &str) -> Option<Qos> {
        match name {
            "burstable" => Some(Qos::Burstable),
            "besteffort" => Some(Qos::BestEffort),
            _ => None,
        }
    }
}

/// The kubelet's cgroup driver.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Driver {
    Systemd,
    Cgroupfs,
}

/// The container runtime, as far as the cgroup name or the API's `containerID` tells.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Runtime {
    Containerd,
    CriO,
    Docker,
}

impl Runtime {
    pub const ALL: [Runtime; 3] = [Runtime::Containerd, Runtime::CriO, Runtime::Docker];

    /// The prefix of the container's systemd scope name.
    fn scope_prefix(self) -> &'static str {
        match self {
            Runtime::Containerd => "cri-containerd-",
            Runtime::CriO => "crio-",
            Runtime::Docker => "docker-",
        }
    }
}

/// A pod-level cgroup.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct PodCgroup {
    /// Canonical form: lower case, with dashes (as the API shows it).
    pub uid: String,
    pub qos: Qos,
    pub driver: Driver,
}

/// A container-level cgroup (an app, a sidecar or the pod sandbox: the caller knows which ID is which).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ContainerCgroup {
    pub pod: PodCgroup,
    /// `None` where the name does not tell: the bare ID that containerd and Docker use with the
    /// cgroupfs driver. CRI-O prefixes `crio-` with both drivers.
    pub runtime: Option<Runtime>,
    /// 64 lower-case hex digits.
    pub id: String,
}

/// What a cgroup path is, for valet.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum CgroupKind {
    Pod(PodCgroup),
    Container(ContainerCgroup),
    /// Anything else: system services, QoS parents, CRI-O's conmon, malformed or foreign paths.
    NotPodContainer,
}

/// Longer paths than the kernel's PATH_MAX are not cgroups the kubelet made.
const MAX_PATH_LEN: usize = 4096;
pub const CONTAINER_ID_LEN: usize = 64;
const SYSTEMD_ROOT: &str = "kubepods.slice";
const CGROUPFS_ROOT: &str = "kubepods";
/// crun's default `run.oci.systemd.subgroup`: the cgroup below a container's scope where its
/// processes run.
const CRUN_SUBGROUP: &str = "container";
/// CRI-O's monitor process gets a scope of its own next to the container's; it is not the container.
const CRIO_CONMON_PREFIX: &str = "crio-conmon-";

/// Classifies a cgroup path (relative to the cgroup2 mount, starting with `/`).
///
/// The kubepods root may sit below a prefix, so nested kubelet roots work
/// (`/kubelet.slice/kubelet-kubepods.slice/...` in kind, `/kubelet/kubepods/...`,
/// `/docker/<id>/kubepods/...`), but that prefix must not be inside a pod: the first kubelet
/// root that holds a pod cgroup on the path decides, and anything deeper than that pod's
/// container cgroups is [`CgroupKind::NotPodContainer`], even a planted `kubepods/pod<UID>`.
pub fn classify(path: &str) -> CgroupKind {
    let Some(components) = components(path) else {
        return CgroupKind::NotPodContainer;
    };
    // A prefix could itself contain a kubepods-looking component that is not a kubelet root
    // (`/docker/kubepods/kubepods/...`): try each, left to right, until one holds a pod.
    for (i, name) in components.iter().enumerate() {
        let rest = &components[i + 1..];
        let below_pod = match kubelet_root_name(name) {
            Some(RootName::Cgroupfs) => classify_cgroupfs(rest),
            Some(RootName::Systemd { prefix }) => classify_systemd(prefix, rest),
            None => continue,
        };
        // A pod cgroup is on the path: it, one of its containers, or nothing valet knows.
        if let Some(kind) = below_pod {
            return kind;
        }
    }
    CgroupKind::NotPodContainer
}

/// Splits a path into its components, or `None` when it cannot be a kubelet cgroup path.
fn components(path: &str) -> Option<Vec<&str>> {
    if path.is_empty() || path.len() > MAX_PATH_LEN || !path.is_ascii() {
        return None;
    }
    let inner = path.strip_prefix('/')?;
    // One trailing slash is fine (a directory); more means an empty component.
    let inner = inner.strip_suffix('/').unwrap_or(inner);
    let components: Vec<&str> = inner.split('/').collect();
    let valid =
        components.iter().all(|c| !c.is_empty() && *c != "." && *c != ".." && c.bytes().all(|b| b.is_ascii_graphic()));
    valid.then_some(components)
}

/// `rest` is what follows `kubepods`: `[<qos>,] pod<UID> [, <leaf>]`. `None` when no pod cgroup
/// follows; otherwise what the path is, given that a pod cgroup is on it.
fn classify_cgroupfs(rest: &[&str]) -> Option<CgroupKind> {
    let (qos, rest) = match rest.first().and_then(|c| Qos::from_component(c)) {
        Some(qos) => (qos, &rest[1..]),
        None => (Qos::Guaranteed, rest),
    };
    let uid = rest.first()?.strip_prefix("pod").and_then(canonical_uid)?;
    let pod = PodCgroup { uid, qos, driver: Driver::Cgroupfs };
    Some(match runtime_subgroup_folded(&rest[1..]) {
        [] => CgroupKind::Pod(pod),
        [leaf] => {
            if leaf.starts_with(CRIO_CONMON_PREFIX) {
                return Some(CgroupKind::NotPodContainer);
            }
            match leaf.strip_prefix(Runtime::CriO.scope_prefix()) {
                Some(id) => container(pod, Some(Runtime::CriO), id),
                None => container(pod, None, leaf),
            }
        }
        _ => CgroupKind::NotPodContainer,
    })
}

/// `prefix` is what precedes `kubepods.slice` in its name (`""`, or `kubelet-` in kind); systemd
/// repeats it in every slice below. `rest` is `[<qos slice>,] <pod slice> [, <scope>]`. `None`
/// when no pod slice follows; otherwise what the path is, given that a pod cgroup is on it.
fn classify_systemd(prefix: &str, rest: &[&str]) -> Option<CgroupKind> {
    let first = rest.first()?.strip_prefix(prefix).and_then(|n| n.strip_prefix("kubepods-"))?;
    // Either `kubepods-<qos>.slice` (then the pod slice follows) or `kubepods-pod<UID_>.slice`.
    let (qos, pod_slice, rest) = match first.strip_suffix(".slice").and_then(Qos::from_component) {
        Some(qos) => (qos, *rest.get(1)?, &rest[2..]),
        None => (Qos::Guaranteed, rest[0], &rest[1..]),
    };
    // The pod slice must repeat the parent's prefix and QoS: `kubepods-burstable-pod<UID_>.slice`.
    let expected_head = match qos.component() {
        Some(q) => format!("{prefix}kubepods-{q}-pod"),
        None => format!("{prefix}kubepods-pod"),
    };
    let uid =
        pod_slice.strip_prefix(expected_head.as_str()).and_then(|n| n.strip_suffix(".slice")).and_then(systemd_uid)?;
    let pod = PodCgroup { uid, qos, driver: Driver::Systemd };
    Some(match runtime_subgroup_folded(rest) {
        [] => CgroupKind::Pod(pod),
        [scope] => {
            let Some(name) = scope.strip_suffix(".scope") else {
                return Some(CgroupKind::NotPodContainer);
            };
            if name.starts_with(CRIO_CONMON_PREFIX) {
                return Some(CgroupKind::NotPodContainer);
            }
            Runtime::ALL
                .into_iter()
                .find_map(|r| name.strip_prefix(r.scope_prefix()).map(|id| (r, id)))
                .map_or(CgroupKind::NotPodContainer, |(r, id)| container(pod, Some(r), id))
        }
        _ => CgroupKind::NotPodContainer,
    })
}

/// What follows a pod cgroup, with crun's sub-cgroup folded into its container: crun (under
/// containerd or CRI-O, systemd driver) runs a container's processes in `<scope>/container`,
/// leaving the scope itself empty, and that is still the container.
fn runtime_subgroup_folded<'a>(rest: &'a [&'a str]) -> &'a [&'a str] {
    match rest {
        [_, sub] if *sub == CRUN_SUBGROUP => &rest[..1],
        _ => rest,
    }
}

fn container(pod: PodCgroup, runtime: Option<Runtime>, id: &str) -> CgroupKind {
    if is_container_id(id) {
        CgroupKind::Container(ContainerCgroup { pod, runtime, id: id.to_owned() })
    } else {
        CgroupKind::NotPodContainer
    }
}

/// Whether `id` is a container runtime's container id: 64 lower-case hex digits (the only text
/// ever joined to a runtime's directory).
pub fn is_container_id(id: &str) -> bool {
    id.len() == CONTAINER_ID_LEN && id.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
}

/// A systemd slice spells the UID with `_` (a `-` would mean another slice level).
fn systemd_uid(text: &str) -> Option<String> {
    if text.contains('-') {
        return None;
    }
    canonical_uid(&text.replace('_', "-"))
}

/// The UID if it is in the canonical 8-4-4-4-12 lower-case hex form the API uses.
fn canonical_uid(text: &str) -> Option<String> {
    let groups: Vec<&str> = text.split('-').collect();
    let lens_ok = groups.len() == 5 && groups.iter().map(|g| g.len()).eq([8, 4, 4, 4, 12]);
    let hex_ok = groups.iter().all(|g| g.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')));
    (lens_ok && hex_ok).then(|| text.to_owned())
}

/// Every path (without a nested kubelet root) where the cgroup of the pod with this UID can be:
/// both drivers, every QoS class. Empty when `uid` is not a UUID. Upper-case input is accepted.
pub fn pod_cgroup_candidates(uid: &str) -> Vec<String> {
    STANDARD_KUBELET_ROOTS.iter().flat_map(|root| pod_cgroup_candidates_under(root, uid)).collect()
}

/// The kubelet roots at the top of the tree: the systemd driver's and cgroupfs's.
const STANDARD_KUBELET_ROOTS: [&str; 2] = ["/kubepods.slice", "/kubepods"];

/// Every path below the kubelet root `root` (relative, starting with `/`: a `kubepods`
/// directory, or a `<prefix>kubepods.slice` with the systemd driver, whose prefix every slice
/// below repeats) where the cgroup of the pod with this UID can be: every QoS class. Empty when
/// `root` is no kubelet root by its name or `uid` is not a UUID.
pub fn pod_cgroup_candidates_under(root: &str, uid: &str) -> Vec<String> {
    let Some(uid) = canonical_uid(&uid.to_ascii_lowercase()) else {
        return Vec::new();
    };
    let root = root.trim_end_matches('/');
    let Some(driver) = kubelet_root_name(root.rsplit('/').next().unwrap_or_default()) else {
        return Vec::new();
    };
    let systemd_uid = uid.replace('-', "_");
    Qos::ALL
        .iter()
        .map(|qos| match (&driver, qos.component()) {
            (RootName::Cgroupfs, Some(q)) => format!("{root}/{q}/pod{uid}"),
            (RootName::Cgroupfs, None) => format!("{root}/pod{uid}"),
            (RootName::Systemd { prefix }, Some(q)) => {
                format!("{root}/{prefix}kubepods-{q}.slice/{prefix}kubepods-{q}-pod{systemd_uid}.slice")
            }
            (RootName::Systemd { prefix }, None) => format!("{root}/{prefix}kubepods-pod{systemd_uid}.slice"),
        })
        .collect()
}

/// What a cgroup directory's name says of it as a kubelet root.
enum RootName<'a> {
    /// `kubepods`.
    Cgroupfs,
    /// `<prefix>kubepods.slice`, the prefix empty or ending in a dash (`kubelet-` in kind).
    Systemd { prefix: &'a str },
}

/// Whether `name` is a kubelet root's name, and of which driver.
fn kubelet_root_name(name: &str) -> Option<RootName<'_>> {
    if name == CGROUPFS_ROOT {
        return Some(RootName::Cgroupfs);
    }
    let prefix = name.strip_suffix(SYSTEMD_ROOT).filter(|p| p.is_empty() || p.ends_with('-'))?;
    Some(RootName::Systemd { prefix })
}

/// The kubelet root that holds the pod cgroup at `pod_rel` (the pod's QoS parent's parent, or
/// its parent for a Guaranteed pod): what [`pod_cgroup_candidates_under`] takes.
pub fn kubelet_root_of<'a>(pod_rel: &'a str, pod: &PodCgroup) -> Option<&'a str> {
    let up = |p: &'a str| p.rsplit_once('/').map(|(head, _)| head).filter(|h| !h.is_empty());
    let parent = up(pod_rel.trim_end_matches('/'))?;
    match pod.qos.component() {
        None => Some(parent),
        Some(_) => up(parent),
    }
}

/// The name of a container's cgroup directory inside its pod's cgroup.
pub fn container_cgroup_name(driver: Driver, runtime: Runtime, id: &str) -> String {
    match (driver, runtime) {
        (Driver::Systemd, r) => format!("{}{id}.scope", r.scope_prefix()),
        (Driver::Cgroupfs, Runtime::CriO) => format!("{}{id}", Runtime::CriO.scope_prefix()),
        (Driver::Cgroupfs, Runtime::Containerd | Runtime::Docker) => id.to_owned(),
    }
}

/// Splits an API `status.containerStatuses[].containerID` (`containerd://<ID>`, `cri-o://<ID>`,
/// `docker://<ID>`) into the runtime and the 64-hex ID.
pub fn parse_container_id(status_id: &str) -> Option<(Runtime, String)> {
    split_container_id(status_id).map(|(runtime, id)| (runtime, id.to_owned()))
}

/// As [`parse_container_id`], the id borrowed: the pods' decisions read every status's id many
/// times a step, and its parse and copy led the loop's profile in a round of 110 releases.
pub fn split_container_id(status_id: &str) -> Option<(Runtime, &str)> {
    let schemes = [("containerd://", Runtime::Containerd), ("cri-o://", Runtime::CriO), ("docker://", Runtime::Docker)];
    let (runtime, id) = schemes.into_iter().find_map(|(scheme, r)| Some((r, status_id.strip_prefix(scheme)?)))?;
    is_container_id(id).then_some((runtime, id))
}

#[cfg(test)]
mod tests {
    use super::*;

    const UID: &str = "0f5c9b6e-3a7d-4e21-9b8a-1c2d3e4f5a6b";
    const UID_: &str = "0f5c9b6e_3a7d_4e21_9b8a_1c2d3e4f5a6b";
    const ID: &str = "4d2a7c1f9e8b3a6d5c4b3a29180f7e6d5c4b3a2918f0e7d6c5b4a39281706f5e";

    fn pod(qos: Qos, driver: Driver) -> PodCgroup {
        PodCgroup { uid: UID.to_owned(), qos, driver }
    }

    fn container_of(qos: Qos, driver: Driver, runtime: Option<Runtime>) -> CgroupKind {
        CgroupKind::Container(ContainerCgroup { pod: pod(qos, driver), runtime, id: ID.to_owned() })
    }

    #[test]
    fn systemd_layouts_every_qos_and_runtime() {
        let pods = [
            (Qos::Guaranteed, format!("/kubepods.slice/kubepods-pod{UID_}.slice")),
            (Qos::Burstable, format!("/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice")),
            (Qos::BestEffort, format!("/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice")),
        ];
        for (qos, pod_path) in pods {
            assert_eq!(classify(&pod_path), CgroupKind::Pod(pod(qos, Driver::Systemd)), "{pod_path}");
            for (runtime, prefix) in
                [(Runtime::Containerd, "cri-containerd-"), (Runtime::CriO, "crio-"), (Runtime::Docker, "docker-")]
            {
                let path = format!("{pod_path}/{prefix}{ID}.scope");
                assert_eq!(classify(&path), container_of(qos, Driver::Systemd, Some(runtime)), "{path}");
            }
            let conmon = format!("{pod_path}/crio-conmon-{ID}.scope");
            assert_eq!(classify(&conmon), CgroupKind::NotPodContainer, "{conmon}");
        }
    }

    #[test]
    fn cgroupfs_layouts_every_qos() {
        let pods = [
            (Qos::Guaranteed, format!("/kubepods/pod{UID}")),
            (Qos::Burstable, format!("/kubepods/burstable/pod{UID}")),
            (Qos::BestEffort, format!("/kubepods/besteffort/pod{UID}")),
        ];
        for (qos, pod_path) in pods {
            assert_eq!(classify(&pod_path), CgroupKind::Pod(pod(qos, Driver::Cgroupfs)), "{pod_path}");
            let bare = format!("{pod_path}/{ID}");
            assert_eq!(classify(&bare), container_of(qos, Driver::Cgroupfs, None), "{bare}");
            let crio = format!("{pod_path}/crio-{ID}");
            assert_eq!(classify(&crio), container_of(qos, Driver::Cgroupfs, Some(Runtime::CriO)), "{crio}");
            let conmon = format!("{pod_path}/crio-conmon-{ID}");
            assert_eq!(classify(&conmon), CgroupKind::NotPodContainer, "{conmon}");
        }
    }

    #[test]
    fn nested_kubelet_roots_and_trailing_slash() {
        let kind = format!(
            "/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/\
             kubelet-kubepods-besteffort-pod{UID_}.slice/cri-containerd-{ID}.scope"
        );
        assert_eq!(classify(&kind), container_of(Qos::BestEffort, Driver::Systemd, Some(Runtime::Containerd)));
        let kind_guaranteed = format!("/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-pod{UID_}.slice");
        assert_eq!(classify(&kind_guaranteed), CgroupKind::Pod(pod(Qos::Guaranteed, Driver::Systemd)));
        let cgroupfs = format!("/kubelet/kubepods/burstable/pod{UID}/{ID}");
        assert_eq!(classify(&cgroupfs), container_of(Qos::Burstable, Driver::Cgroupfs, None));
        // Docker-in-Docker style roots with a kubepods-looking component above the real one.
        let doubled = format!("/docker/kubepods/kubepods/pod{UID}/{ID}");
        assert_eq!(classify(&doubled), container_of(Qos::Guaranteed, Driver::Cgroupfs, None));
        let trailing = format!("/kubepods.slice/kubepods-pod{UID_}.slice/docker-{ID}.scope/");
        assert_eq!(classify(&trailing), container_of(Qos::Guaranteed, Driver::Systemd, Some(Runtime::Docker)));
        let pod_trailing = format!("/kubepods/besteffort/pod{UID}/");
        assert_eq!(classify(&pod_trailing), CgroupKind::Pod(pod(Qos::BestEffort, Driver::Cgroupfs)));
    }

    #[test]
    fn candidates_and_names_round_trip() {
        let candidates = pod_cgroup_candidates(UID);
        assert_eq!(candidates.len(), 6);
        let mut seen = Vec::new();
        for rel in &candidates {
            let CgroupKind::Pod(p) = classify(rel) else { panic!("{rel} is a pod cgroup") };
            assert_eq!(p.uid, UID);
            seen.push((p.qos, p.driver));
            for runtime in Runtime::ALL {
                let leaf = format!("{rel}/{}", container_cgroup_name(p.driver, runtime, ID));
                let CgroupKind::Container(c) = classify(&leaf) else { panic!("{leaf} is a container cgroup") };
                assert_eq!(c.pod, p);
                assert_eq!(c.id, ID);
                let expected = match (p.driver, runtime) {
                    (Driver::Cgroupfs, Runtime::Containerd | Runtime::Docker) => None,
                    _ => Some(runtime),
                };
                assert_eq!(c.runtime, expected, "{leaf}");
            }
        }
        for qos in Qos::ALL {
            for driver in [Driver::Systemd, Driver::Cgroupfs] {
                assert!(seen.contains(&(qos, driver)), "{qos:?} {driver:?} is a candidate");
            }
        }
        assert_eq!(pod_cgroup_candidates(&UID.to_uppercase()), candidates);
        for bad in ["", "nope", UID_, "0f5c9b6e-3a7d-4e21-9b8a-1c2d3e4f5a6", "../../etc"] {
            assert!(pod_cgroup_candidates(bad).is_empty(), "{bad:?}");
        }
    }

    #[test]
    fn candidates_under_a_nested_root_are_its_pods_and_lead_back_to_it() {
        for root in ["/kubepods", "/kind/kubelet/kubepods", "/kubepods.slice", "/kubelet.slice/kubelet-kubepods.slice"]
        {
            let candidates = pod_cgroup_candidates_under(root, UID);
            assert_eq!(candidates.len(), Qos::ALL.len(), "{root}");
            for rel in &candidates {
                let CgroupKind::Pod(pod) = classify(rel) else { panic!("{rel} is not a pod cgroup") };
                assert_eq!(pod.uid, UID, "{rel}");
                assert_eq!(kubelet_root_of(rel, &pod), Some(root), "{rel}");
            }
        }
        // Not a kubelet root by its name (a systemd prefix must end in a dash), or not a UID.
        for root in ["/", "/system.slice", "/kubeletkubepods.slice", "/kubepods/burstable"] {
            assert!(pod_cgroup_candidates_under(root, UID).is_empty(), "{root}");
        }
        assert!(pod_cgroup_candidates_under("/kubepods", "../../etc").is_empty());
    }

    #[test]
    fn container_names() {
        assert_eq!(
            container_cgroup_name(Driver::Systemd, Runtime::Containerd, ID),
            format!("cri-containerd-{ID}.scope")
        );
        assert_eq!(container_cgroup_name(Driver::Systemd, Runtime::CriO, ID), format!("crio-{ID}.scope"));
        assert_eq!(container_cgroup_name(Driver::Systemd, Runtime::Docker, ID), format!("docker-{ID}.scope"));
        assert_eq!(container_cgroup_name(Driver::Cgroupfs, Runtime::Containerd, ID), ID);
        assert_eq!(container_cgroup_name(Driver::Cgroupfs, Runtime::Docker, ID), ID);
        assert_eq!(container_cgroup_name(Driver::Cgroupfs, Runtime::CriO, ID), format!("crio-{ID}"));
    }

    #[test]
    fn api_container_ids() {
        assert_eq!(parse_container_id(&format!("containerd://{ID}")), Some((Runtime::Containerd, ID.to_owned())));
        assert_eq!(parse_container_id(&format!("cri-o://{ID}")), Some((Runtime::CriO, ID.to_owned())));
        assert_eq!(parse_container_id(&format!("docker://{ID}")), Some((Runtime::Docker, ID.to_owned())));
        for bad in [
            String::new(),
            ID.to_owned(),
            format!("rkt://{ID}"),
            format!("containerd:/{ID}"),
            format!("containerd://{}", &ID[1..]),
            format!("containerd://{}", ID.to_uppercase()),
            format!("containerd://{ID}0"),
            "containerd://".to_owned(),
        ] {
            assert_eq!(parse_container_id(&bad), None, "{bad:?}");
        }
    }

    #[test]
    fn malformed_paths() {
        let upper_uid = UID.to_uppercase();
        let cases: Vec<String> = vec![
            String::new(),
            "/".into(),
            "//".into(),
            "/kubepods".into(),
            "/kubepods.slice".into(),
            "/kubepods/burstable".into(),
            "/kubepods.slice/kubepods-burstable.slice".into(),
            "/system.slice/containerd.service".into(),
            "/user.slice/user-1000.slice/session-1.scope".into(),
            // Relative, doubled slashes, dot components.
            format!("kubepods/pod{UID}/{ID}"),
            format!("/kubepods//pod{UID}/{ID}"),
            format!("/kubepods/pod{UID}/{ID}//"),
            format!("/kubepods/pod{UID}/../pod{UID}/{ID}"),
            format!("/kubepods/./pod{UID}/{ID}"),
            format!("/kubepods/pod{UID}/.."),
            // Bad UIDs.
            format!("/kubepods/pod{upper_uid}"),
            format!("/kubepods/pod{UID_}"),
            format!("/kubepods/pod{}", &UID[1..]),
            format!("/kubepods/pod{}x", &UID[1..]),
            "/kubepods/pod".into(),
            format!("/kubepods/{UID}"),
            format!("/kubepods.slice/kubepods-pod{UID}.slice"),
            format!("/kubepods.slice/kubepods-pod{}.slice", upper_uid.replace('-', "_")),
            format!("/kubepods.slice/kubepods-pod{UID_}"),
            // QoS of the pod slice does not match its parent; unknown QoS.
            format!("/kubepods.slice/kubepods-burstable.slice/kubepods-besteffort-pod{UID_}.slice"),
            format!("/kubepods.slice/kubepods-burstable.slice/kubepods-pod{UID_}.slice"),
            format!("/kubepods.slice/kubepods-guaranteed.slice/kubepods-guaranteed-pod{UID_}.slice"),
            format!("/kubepods/guaranteed/pod{UID}"),
            format!("/kubepods.slice/kubepods-besteffort-pod{UID_}.slice"),
            // Nested prefix not repeated in the slice names.
            format!("/kubelet.slice/kubelet-kubepods.slice/kubepods-pod{UID_}.slice"),
            format!("/xkubepods.slice/xkubepods-pod{UID_}.slice"),
            // Wrong nesting: QoS level missing or doubled, pod at the wrong depth.
            format!("/kubepods/burstable/burstable/pod{UID}/{ID}"),
            format!(
                "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice"
            ),
            // Bad container IDs and leaves.
            format!("/kubepods/pod{UID}/{}", &ID[1..]),
            format!("/kubepods/pod{UID}/{ID}0"),
            format!("/kubepods/pod{UID}/{}", ID.to_uppercase()),
            format!("/kubepods/pod{UID}/docker-{ID}"),
            format!("/kubepods/pod{UID}/crio-conmon-{ID}"),
            format!("/kubepods.slice/kubepods-pod{UID_}.slice/cri-containerd-{ID}"),
            format!("/kubepods.slice/kubepods-pod{UID_}.slice/{ID}.scope"),
            format!("/kubepods.slice/kubepods-pod{UID_}.slice/containerd-{ID}.scope"),
            format!("/kubepods.slice/kubepods-pod{UID_}.slice/crio-conmon-{ID}.scope"),
            format!("/kubepods.slice/kubepods-pod{UID_}.slice/cri-containerd-{}.scope", &ID[2..]),
            // Extra components under a container (crun's one `container` level is the container).
            format!("/kubepods/pod{UID}/{ID}/child"),
            format!("/kubepods.slice/kubepods-pod{UID_}.slice/crio-{ID}.scope/{ID}"),
            format!("/kubepods.slice/kubepods-pod{UID_}.slice/crio-{ID}.scope/container/container"),
            format!("/kubepods.slice/kubepods-pod{UID_}.slice/crio-{ID}.scope/container/x"),
            format!("/kubepods.slice/kubepods-pod{UID_}.slice/crio-{ID}.scope/Container"),
            format!("/kubepods.slice/kubepods-pod{UID_}.slice/container"),
            format!("/kubepods/pod{UID}/container"),
            // Non-ASCII, control characters, very long.
            format!("/kubepods/pod{UID}/{}é", &ID[1..]),
            format!("/kübepods/pod{UID}"),
            format!("/kubepods/pod{UID}/{ID}\n"),
            format!("/kubepods/pod{UID}/ {ID}"),
            format!("/{}/kubepods/pod{UID}/{ID}", "a/".repeat(3000)),
        ];
        for path in &cases {
            assert_eq!(classify(path), CgroupKind::NotPodContainer, "{path:?}");
        }
    }

    /// Another pod's UID planted inside a pod's own (writable) cgroup tree, in every layout.
    #[test]
    fn a_path_planted_inside_a_pod_is_never_a_pod() {
        const OTHER: &str = "11111111-2222-4333-8444-555555555555";
        const OTHER_: &str = "11111111_2222_4333_8444_555555555555";
        let hosts = [
            format!("/kubepods/burstable/pod{UID}/{ID}"),
            format!("/kubepods/pod{UID}/crio-{ID}"),
            format!(
                "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/cri-containerd-{ID}.scope"
            ),
            format!("/kubepods.slice/kubepods-pod{UID_}.slice/crio-{ID}.scope"),
            format!("/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-pod{UID_}.slice/cri-containerd-{ID}.scope"),
            format!("/kubelet/kubepods/besteffort/pod{UID}/{ID}"),
            format!("/docker/{ID}/kubepods/pod{UID}/{ID}"),
            // Planted directly in the pod's cgroup (not a container's): no better.
            format!("/kubepods/burstable/pod{UID}"),
            format!("/kubepods.slice/kubepods-pod{UID_}.slice"),
        ];
        let planted = [
            format!("kubepods/besteffort/pod{OTHER}"),
            format!("kubepods/pod{OTHER}/{ID}"),
            format!("kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{OTHER_}.slice"),
            format!("kubepods.slice/kubepods-pod{OTHER_}.slice/cri-containerd-{ID}.scope"),
            format!("kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-pod{OTHER_}.slice"),
            format!("x/kubepods/pod{OTHER}"),
            format!("kubepods/pod{UID}"),
        ];
        for host in &hosts {
            assert_ne!(classify(host), CgroupKind::NotPodContainer, "{host} is a real pod or container");
            for plant in &planted {
                let path = format!("{host}/{plant}");
                assert_eq!(classify(&path), CgroupKind::NotPodContainer, "{path}");
            }
        }
        // The same planted names under a prefix that holds no pod are kubelet roots (kind nodes).
        let kind_node = format!("/docker/{ID}/kubepods/besteffort/pod{OTHER}");
        assert!(matches!(classify(&kind_node), CgroupKind::Pod(p) if p.uid == OTHER));
    }

    #[test]
    fn crun_runs_a_container_one_level_below_its_scope() {
        let scope = format!(
            "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice/cri-containerd-{ID}.scope"
        );
        let crio = format!("/kubepods.slice/kubepods-pod{UID_}.slice/crio-{ID}.scope");
        let cgroupfs = format!("/kubepods/burstable/pod{UID}/{ID}");
        for leaf in [&scope, &crio, &cgroupfs] {
            let CgroupKind::Container(c) = classify(leaf) else { panic!("{leaf} is a container") };
            assert_eq!(classify(&format!("{leaf}/container")), CgroupKind::Container(c.clone()), "{leaf}/container");
            assert_eq!(c.id, ID);
        }
        // A planted pod below crun's level is still nothing.
        let planted = format!("{scope}/container/kubepods/pod{UID}");
        assert_eq!(classify(&planted), CgroupKind::NotPodContainer);
    }

    #[test]
    fn bad_leaf_under_a_pod_is_not_the_pod() {
        // A pod-level path is a Pod; anything unknown below it is not (it is not the pod itself).
        let pod_path = format!("/kubepods/burstable/pod{UID}");
        assert!(matches!(classify(&pod_path), CgroupKind::Pod(_)));
        assert_eq!(classify(&format!("{pod_path}/garbage")), CgroupKind::NotPodContainer);
    }

    #[test]
    fn arbitrary_bytes_never_panic() {
        // A cheap deterministic fuzz: mutate valid paths byte by byte.
        let seeds = [
            format!(
                "/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-burstable.slice/kubelet-kubepods-burstable-pod{UID_}.slice/crio-{ID}.scope"
            ),
            format!("/kubepods/besteffort/pod{UID}/crio-{ID}"),
        ];
        let replacements = [b'/', b'-', b'_', b'.', b'x', b'0'];
        for seed in &seeds {
            for i in 0..seed.len() {
                for r in replacements {
                    let mut bytes = seed.as_bytes().to_vec();
                    bytes[i] = r;
                    if let Ok(s) = String::from_utf8(bytes) {
                        let _ = classify(&s);
                    }
                    let _ = classify(&seed[..i]);
                }
            }
        }
    }
}
