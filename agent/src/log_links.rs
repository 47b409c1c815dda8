//! The kubelet's container log links: a container's name from its id once the runtime has
//! removed everything else of it.
//!
//! Every kubelet makes, for each container it starts and right after the runtime's
//! `StartContainer` returns, a link `/var/log/containers/<pod>_<namespace>_<container>-<id>.log`
//! to the container's log (`legacyLogSymlink` in `kuberuntime_container.go`: log collectors read
//! that directory), for containerd and CRI-O alike; it removes the link only with the container
//! (`removeContainerLog`, at the container's garbage collection or the pod's deletion). So a
//! container that started and ended while the agent could not look (a stall) is still named
//! there after its cgroup and its bundle are gone, by the kubelet itself.
//!
//! The name is `<pod>_<namespace>_<container>-<id>` cut to 251 bytes, then `.log`: a link whose
//! cut took part of the id names no container here (the API's report does, later). Pod names,
//! namespaces and container names hold no `_`, so the three split apart.

use std::path::{Path, PathBuf};

use crate::cgroup::layout::is_container_id;

/// Where the kubelet makes the links, relative to the host's root.
pub const KUBELET_LINKS: &str = "var/log/containers";
/// The most directory entries read in one look (a node keeps a link per container not yet
/// collected: a few per pod).
const MAX_ENTRIES: usize = 100_000;

/// The default directory: the kubelet's, through the host's pid 1 (the agent sees the host's
/// processes, not its file system).
pub fn default_dir(host_proc: &Path) -> PathBuf {
    host_proc.join("1/root").join(KUBELET_LINKS)
}

/// The container name that link file `file_name` gives container `id` of pod
/// `namespace`/`pod`, if it is that container's link.
pub fn parse_link(file_name: &str, namespace: &str, pod: &str, id: &str) -> Option<String> {
    if !is_container_id(id) {
        return None;
    }
    let stem = file_name.strip_suffix(".log")?;
    let rest = stem.strip_suffix(id)?.strip_suffix('-')?;
    let mut parts = rest.split('_');
    let (Some(p), Some(ns), Some(container), None) = (parts.next(), parts.next(), parts.next(), parts.next()) else {
        return None;
    };
    let label = !container.is_empty()
        && container.len() <= 63
        && container.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
    (p == pod && ns == namespace && label).then(|| container.to_owned())
}

/// One read of the links' directory: each link's file name by the container id it ends with.
/// An id is never reused, so what a read found stays true of that container after its link is
/// gone: a container that ended unseen is looked up here first, and the directory is read again
/// only for an id it does not have (after a stall, a whole batch of such ends is named from one
/// read).
#[derive(Debug, Default)]
pub struct Links {
    by_id: std::collections::HashMap<String, String>,
}

impl Links {
    pub fn read(dir: &Path) -> std::io::Result<Links> {
        let mut by_id = std::collections::HashMap::new();
        for entry in std::fs::read_dir(dir)?.take(MAX_ENTRIES) {
            let Ok(file) = entry?.file_name().into_string() else { continue };
            let Some(stem) = file.strip_suffix(".log") else { continue };
            // `get`: a name with a multi-byte character there is no link (never a panic).
            let at = stem.len().saturating_sub(crate::cgroup::layout::CONTAINER_ID_LEN);
            let Some(id) = stem.get(at..) else { continue };
            if is_container_id(id) {
                by_id.insert(id.to_owned(), file);
            }
        }
        Ok(Links { by_id })
    }

    /// Whether this read has a link ending with container id `id`.
    pub fn has(&self, id: &str) -> bool {
        self.by_id.contains_key(id)
    }

    /// The container name the link of `id` gives, if it is one of pod `namespace`/`pod`.
    pub fn name_of(&self, namespace: &str, pod: &str, id: &str) -> Option<String> {
        parse_link(self.by_id.get(id)?, namespace, pod, id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "4f1c2d3e4f5a6b7c8d9e0f1a2b3c4d5e6f7a8b9c0d1e2f3a4b5c6d7e8f9a0b1c";

    #[test]
    fn names_the_container_of_its_own_id_and_pod() {
        let link = format!("job-7x2lq_batch_app-{ID}.log");
        assert_eq!(parse_link(&link, "batch", "job-7x2lq", ID).as_deref(), Some("app"));
        let dotted = format!("web.v2-0_default_istio-proxy-{ID}.log");
        assert_eq!(parse_link(&dotted, "default", "web.v2-0", ID).as_deref(), Some("istio-proxy"));
    }

    #[test]
    fn another_container_pod_or_namespace_is_not_it() {
        let other = "0".repeat(64);
        let link = format!("job_batch_app-{other}.log");
        assert_eq!(parse_link(&link, "batch", "job", ID), None, "another id");
        let link = format!("job_batch_app-{ID}.log");
        assert_eq!(parse_link(&link, "batch", "job2", ID), None, "another pod");
        assert_eq!(parse_link(&link, "default", "job", ID), None, "another namespace");
        assert_eq!(parse_link(&link, "batch", "job", "app"), None, "not an id");
    }

    #[test]
    fn a_cut_or_odd_name_names_nothing() {
        // The kubelet cuts the name to 251 bytes: the id is the part that goes.
        let long_pod = "p".repeat(200);
        let whole = format!("{long_pod}_batch_app-{ID}");
        let cut = format!("{}.log", &whole[..251]);
        assert_eq!(parse_link(&cut, "batch", &long_pod, ID), None);
        for odd in [
            format!("job_batch_app-{ID}"),
            format!("job_batch_app-{ID}.log.1"),
            format!("job_batch_-{ID}.log"),
            format!("job_batch_APP-{ID}.log"),
            format!("job_batch_a_b-{ID}.log"),
            format!("job_batch_app{ID}.log"),
            format!("batch_app-{ID}.log"),
        ] {
            assert_eq!(parse_link(&odd, "batch", "job", ID), None, "{odd}");
        }
    }

    #[test]
    fn finds_the_link_among_others_in_a_directory() {
        let dir = std::env::temp_dir().join(format!("valet-log-links-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        let other = "a".repeat(64);
        for name in [format!("job_batch_istio-proxy-{other}.log"), format!("job_batch_app-{ID}.log")] {
            // Dangling, as a link whose log was rotated away: only its name is read.
            std::os::unix::fs::symlink("/var/log/pods/none/0.log", dir.join(name)).expect("link");
        }
        let links = Links::read(&dir).expect("read");
        assert_eq!(links.name_of("batch", "job", ID).as_deref(), Some("app"));
        assert_eq!(links.name_of("batch", "job", &"b".repeat(64)), None);
        assert!(Links::read(&dir.join("missing")).is_err());
        std::fs::remove_dir_all(&dir).expect("clean up");
    }

    #[test]
    fn one_read_serves_every_id_it_holds_and_skips_what_is_no_link() {
        let dir = std::env::temp_dir().join(format!("valet-log-links-read-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        let ids: Vec<String> = (0..3).map(|i| format!("{i:064x}")).collect();
        for (i, id) in ids.iter().enumerate() {
            std::fs::write(dir.join(format!("job-{i}_batch_app-{id}.log")), b"").expect("link");
        }
        let multibyte = format!("{}é{}.log", "a".repeat(10), "0".repeat(63));
        for odd in ["README", "x.log", "é.log", multibyte.as_str()] {
            std::fs::write(dir.join(odd), b"").expect("file");
        }
        let links = Links::read(&dir).expect("read");
        for (i, id) in ids.iter().enumerate() {
            assert!(links.has(id));
            assert_eq!(links.name_of("batch", &format!("job-{i}"), id).as_deref(), Some("app"));
        }
        assert_eq!(links.name_of("batch", "job-1", &ids[0]), None, "another pod's link");
        assert!(!links.has(&"f".repeat(64)));
        assert_eq!(links.by_id.len(), 3, "only links: {:?}", links.by_id);
        std::fs::remove_dir_all(&dir).expect("clean up");
    }

    #[test]
    fn the_default_is_the_kubelets_directory_through_the_hosts_init() {
        assert_eq!(default_dir(Path::new("/proc")), Path::new("/proc/1/root/var/log/containers"));
    }
}
