//! The capabilities the DaemonSet's manifest gives its containers, read from it, and how a test
//! runs a process with exactly a set of them (`setpriv`), as the container runtime would.

use std::path::Path;

/// The capabilities the manifest adds to each container (after `drop: [ALL]`), in order: the
/// agent's, then the keeper's.
pub fn manifest_capabilities() -> Vec<Vec<String>> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/base/daemonset.yaml");
    let text = std::fs::read_to_string(&path).expect("read the DaemonSet");
    let mut sets: Vec<Vec<String>> = Vec::new();
    let mut in_add = false;
    for line in text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')) {
        if line == "add:" {
            in_add = true;
            sets.push(Vec::new());
        } else if let Some(cap) = line.strip_prefix("- ").filter(|_| in_add) {
            sets.last_mut().expect("a set").push(cap.to_owned());
        } else {
            in_add = false;
        }
    }
    assert!(sets.len() >= 2 && sets.iter().all(|s| !s.is_empty()), "two capability sets in {}", path.display());
    sets
}

/// `setpriv` arguments that run a container's process as uid 0 with exactly `caps`.
pub fn with_capabilities(caps: &[impl AsRef<str>]) -> Vec<String> {
    let list: String = caps.iter().map(|c| format!(",+{}", c.as_ref().to_lowercase())).collect();
    ["setpriv", &format!("--bounding-set=-all{list}"), "--inh-caps=-all", "--ambient-caps=-all", "--no-new-privs", "--"]
        .map(str::to_owned)
        .to_vec()
}
