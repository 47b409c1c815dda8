//! A cgroup path (from `/proc/<pid>/cgroup` or a directory walk; pods with a writable cgroup
//! tree choose their own names): the classifier, and its planting defence as a property:
//! nothing below a pod's or a container's cgroup is ever a pod or a container.
#![no_main]

use libfuzzer_sys::fuzz_target;
use valet_agent::cgroup::layout::{CgroupKind, classify, parse_container_id, pod_cgroup_candidates};

const VICTIM: &str = "11111111-2222-4333-8444-555555555555";
const VICTIM_: &str = "11111111_2222_4333_8444_555555555555";
const ID: &str = "4d2a7c1f9e8b3a6d5c4b3a29180f7e6d5c4b3a2918f0e7d6c5b4a39281706f5e";

fuzz_target!(|data: &[u8]| {
    let Ok(path) = std::str::from_utf8(data) else { return };
    let kind = classify(path);
    let _ = pod_cgroup_candidates(path);
    let _ = parse_container_id(path);
    if let CgroupKind::Pod(pod) = &kind {
        // A pod found is one the kubelet could have made: its UID maps back to candidates.
        assert!(!pod_cgroup_candidates(&pod.uid).is_empty(), "{path}");
    }
    if kind != CgroupKind::NotPodContainer {
        let base = path.trim_end_matches('/');
        for planted in [
            format!("{base}/kubepods/pod{VICTIM}"),
            format!("{base}/kubepods/besteffort/pod{VICTIM}/{ID}"),
            format!("{base}/kubepods.slice/kubepods-pod{VICTIM_}.slice"),
            format!(
                "{base}/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{VICTIM_}.slice/crio-{ID}.scope"
            ),
        ] {
            assert_eq!(classify(&planted), CgroupKind::NotPodContainer, "{planted}");
        }
    }
});
