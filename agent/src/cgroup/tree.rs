//! The node's cgroup file system (v2, or one v1 controller's hierarchy): finding a pod's cgroups,
//! their ids (directory inode numbers: the kernfs node ids the kernel programs read, which on v2
//! is what `bpf_get_current_cgroup_id()` returns) and their processes.

use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::layout::{
    CgroupKind, ContainerCgroup, PodCgroup, classify, kubelet_root_of, pod_cgroup_candidates,
    pod_cgroup_candidates_under,
};
use crate::error::{Error, Result};

/// How deep to look for a pod cgroup below the root when it is not at a standard place
/// (nested kubelet roots such as kind's `/kubelet.slice/kubelet-kubepods.slice/...`).
const POD_SEARCH_DEPTH: usize = 5;

/// Once a kubelet root is known, how often at most the walk looks for a pod that is at none of
/// the known roots' places (one the kubelet has not made yet, usually: it reads every pod cgroup
/// of a full node, and ran on every step of each new pod until its cgroup was there).
const WALK_EVERY: Duration = Duration::from_secs(1);

/// Kubelet roots are few: one per node, a nested one in kind or a test's.
const MAX_KNOWN_ROOTS: usize = 8;

/// A container cgroup of a pod, found on disk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ContainerDir {
    /// Path relative to the cgroup2 root, starting with `/`.
    pub rel: String,
    pub id: u64,
    pub container: ContainerCgroup,
}

/// What [`CgroupFs::search_by_id`] found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Search {
    Found(String),
    /// Every directory was looked at: no cgroup has this id.
    Gone,
    /// The search could not finish (budget, read errors): the cgroup may still be there.
    Unsure,
}

/// A pod cgroup found on disk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodDir {
    pub rel: String,
    pub id: u64,
    pub pod: PodCgroup,
}

/// The cgroup hierarchy under `root` (v2, or a v1 controller's: the kubelet's paths are the same).
///
/// Clones share what [`CgroupFs::find_pod`] learned of the kubelet roots.
#[derive(Clone, Debug)]
pub struct CgroupFs {
    root: PathBuf,
    known: Arc<Mutex<KnownRoots>>,
}

/// The kubelet roots where pods were found, and when the walk last ran.
#[derive(Debug, Default)]
struct KnownRoots {
    roots: Vec<String>,
    walked: Option<Instant>,
}

impl CgroupFs {
    pub fn new(root: impl Into<PathBuf>) -> CgroupFs {
        CgroupFs { root: root.into(), known: Arc::default() }
    }

    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Absolute path of a relative cgroup path.
    pub fn abs(&self, rel: &str) -> PathBuf {
        self.root.join(rel.trim_start_matches('/'))
    }

    /// The cgroup id (inode number) of a relative cgroup path.
    pub fn id_of(&self, rel: &str) -> Result<u64> {
        let path = self.abs(rel);
        std::fs::metadata(&path).map(|m| m.ino()).map_err(|e| Error::io(format!("stat {}", path.display()), e))
    }

    /// Finds the cgroup of the pod with this UID, if the kubelet created it yet: at its places
    /// below the kubelet roots where pods were found before (three `stat`s), or the standard
    /// roots' while none was, else by a bounded walk of the tree, at most once a [`WALK_EVERY`]
    /// once a root is known.
    pub fn find_pod(&self, uid: &str) -> Option<PodDir> {
        let roots = self.known().roots.clone();
        let candidates = if roots.is_empty() {
            pod_cgroup_candidates(uid)
        } else {
            roots.iter().flat_map(|root| pod_cgroup_candidates_under(root, uid)).collect()
        };
        let found = candidates.into_iter().find_map(|rel| self.pod_dir(&rel, uid));
        let found = match found {
            Some(found) => found,
            None if self.may_walk() => self.walk_for_pod(uid)?,
            None => return None,
        };
        if let Some(root) = kubelet_root_of(&found.rel, &found.pod) {
            let mut known = self.known();
            if !known.roots.iter().any(|r| r == root) && known.roots.len() < MAX_KNOWN_ROOTS {
                known.roots.push(root.to_owned());
            }
        }
        Some(found)
    }

    fn known(&self) -> std::sync::MutexGuard<'_, KnownRoots> {
        self.known.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Whether the walk may run now (and if so, it is counted as run).
    fn may_walk(&self) -> bool {
        let mut known = self.known();
        let due = known.roots.is_empty() || known.walked.is_none_or(|at| at.elapsed() >= WALK_EVERY);
        if due {
            known.walked = Some(Instant::now());
        }
        due
    }

    /// A bounded walk for a pod cgroup below a nested kubelet root.
    fn walk_for_pod(&self, uid: &str) -> Option<PodDir> {
        let mut frontier = vec![String::new()];
        for _ in 0..POD_SEARCH_DEPTH {
            let mut next = Vec::new();
            for rel in frontier {
                for child in self.child_dirs(&rel) {
                    // The walk looks for a kubelet root below a prefix; a pod's or container's
                    // cgroup holds none (classify refuses anything planted there, and the walk
                    // does not even look).
                    let kind = classify(&child);
                    if let CgroupKind::Pod(pod) = &kind
                        && pod.uid == uid
                        && let Ok(id) = self.id_of(&child)
                    {
                        return Some(PodDir { rel: child, id, pod: pod.clone() });
                    }
                    // Only descend through kubelet-looking directories to keep the walk cheap.
                    if kind == CgroupKind::NotPodContainer && child.contains("kube") {
                        next.push(child);
                    }
                }
            }
            frontier = next;
        }
        None
    }

    fn pod_dir(&self, rel: &str, uid: &str) -> Option<PodDir> {
        match classify(rel) {
            CgroupKind::Pod(pod) if pod.uid == uid => {
                let id = self.id_of(rel).ok()?;
                Some(PodDir { rel: rel.to_owned(), id, pod })
            }
            _ => None,
        }
    }

    /// Relative paths of the direct child cgroups of `rel`.
    pub fn child_dirs(&self, rel: &str) -> Vec<String> {
        let Ok(entries) = std::fs::read_dir(self.abs(rel)) else { return Vec::new() };
        entries
            .filter_map(|e| e.ok())
            .filter(|e| e.file_type().map(|t| t.is_dir()).unwrap_or(false))
            .filter_map(|e| e.file_name().into_string().ok())
            .map(|name| format!("{}/{}", rel.trim_end_matches('/'), name))
            .collect()
    }

    /// The container cgroups of a pod (including the sandbox's).
    pub fn containers(&self, pod_rel: &str) -> Vec<ContainerDir> {
        self.child_dirs(pod_rel)
            .into_iter()
            .filter_map(|rel| match classify(&rel) {
                CgroupKind::Container(container) => {
                    let id = self.id_of(&rel).ok()?;
                    Some(ContainerDir { rel, id, container })
                }
                _ => None,
            })
            .collect()
    }

    /// The path of the cgroup with this id (inode) at or below `within`, searching at most
    /// `budget` directories: the way back from an id the kernel reported to a path.
    pub fn find_by_id(&self, id: u64, within: &str, budget: usize) -> Option<String> {
        let mut stack = vec![within.trim_end_matches('/').to_owned()];
        let mut left = budget;
        while let Some(rel) = stack.pop() {
            let rel = if rel.is_empty() { "/".to_owned() } else { rel };
            if self.id_of(&rel).ok() == Some(id) {
                return Some(rel);
            }
            left = left.checked_sub(1)?;
            stack.extend(self.child_dirs(rel.trim_end_matches('/')));
        }
        None
    }

    /// [`CgroupFs::find_by_id`] that tells a search that looked everywhere (`Gone`) from one that
    /// could not (`Unsure`: out of budget, or a directory it could not read). A held process's
    /// record is dropped only on `Gone`.
    pub fn search_by_id(&self, id: u64, within: &str, budget: usize) -> Search {
        let mut stack = vec![within.trim_end_matches('/').to_owned()];
        let mut left = budget;
        let mut unsure = false;
        while let Some(rel) = stack.pop() {
            let rel = if rel.is_empty() { "/".to_owned() } else { rel };
            match std::fs::metadata(self.abs(&rel)) {
                Ok(m) if m.ino() == id => return Search::Found(rel),
                Ok(_) => {}
                // Removed meanwhile: that directory is no longer anyone's cgroup.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(_) => unsure = true,
            }
            let Some(l) = left.checked_sub(1) else { return Search::Unsure };
            left = l;
            match std::fs::read_dir(self.abs(&rel)) {
                Ok(entries) => {
                    for e in entries {
                        match e {
                            Ok(e) if e.file_type().map(|t| t.is_dir()).unwrap_or(false) => {
                                if let Ok(name) = e.file_name().into_string() {
                                    stack.push(format!("{}/{}", rel.trim_end_matches('/'), name));
                                }
                            }
                            Ok(_) => {}
                            Err(_) => unsure = true,
                        }
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(_) => unsure = true,
            }
        }
        if unsure { Search::Unsure } else { Search::Gone }
    }

    /// Processes directly in a cgroup (`cgroup.procs`); none when it cannot be read. A decision
    /// that drops something on "not there" reads [`CgroupFs::holds`] instead.
    pub fn procs(&self, rel: &str) -> Vec<u32> {
        self.read_procs(rel).unwrap_or_default()
    }

    fn read_procs(&self, rel: &str) -> std::io::Result<Vec<u32>> {
        std::fs::read_to_string(self.abs(rel).join("cgroup.procs"))
            .map(|text| text.lines().filter_map(|l| l.trim().parse().ok()).collect())
    }

    /// Whether `pid` lives in cgroup `rel` or below it, read so that "no" is proven: every
    /// `cgroup.procs` at and below `rel` read (a cgroup removed meanwhile holds no one), at most
    /// `budget` cgroups. `Err` says why it cannot tell (a read error, out of budget): the caller
    /// keeps what it would have dropped on "no".
    pub fn holds(&self, rel: &str, pid: u32, budget: usize) -> std::result::Result<bool, String> {
        let mut stack = vec![rel.to_owned()];
        let mut left = budget;
        while let Some(rel) = stack.pop() {
            let Some(l) = left.checked_sub(1) else {
                return Err(format!("more than {budget} cgroups below the one pid {pid} was held in"));
            };
            left = l;
            match self.read_procs(&rel) {
                Ok(pids) if pids.contains(&pid) => return Ok(true),
                Ok(_) => {}
                // Removed meanwhile (its directory is then gone too): it holds no one.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(format!("read {rel}/cgroup.procs: {e}")),
            }
            match std::fs::read_dir(self.abs(&rel)) {
                Ok(entries) => {
                    for e in entries {
                        let e = e.map_err(|e| format!("read the cgroups below {rel}: {e}"))?;
                        if e.file_type().map_err(|e| format!("read the cgroups below {rel}: {e}"))?.is_dir()
                            && let Ok(name) = e.file_name().into_string()
                        {
                            stack.push(format!("{}/{}", rel.trim_end_matches('/'), name));
                        }
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(format!("read the cgroups below {rel}: {e}")),
            }
        }
        Ok(false)
    }

    /// A container's processes: those of its cgroup, else those below it. runc puts them in the
    /// container's cgroup itself; crun one level below (`<scope>/container`), leaving the scope
    /// empty; only then is the directory read.
    pub fn container_procs(&self, rel: &str) -> Vec<u32> {
        let own = self.procs(rel);
        if own.is_empty() { self.procs_recursive(rel) } else { own }
    }

    /// [`CgroupFs::container_procs`], read so that "none" is proven: a cgroup removed meanwhile
    /// holds no one, but any other read error (EACCES, EIO, out of budget) is `Err`, and the
    /// caller must not take the container for ended on it.
    pub fn container_procs_proven(&self, rel: &str) -> std::io::Result<Vec<u32>> {
        let own = match self.read_procs(rel) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            other => other?,
        };
        if own.is_empty() { self.procs_recursive_proven(rel) } else { Ok(own) }
    }

    /// Processes in a cgroup and every cgroup below it, read so that "not there" is proven: a
    /// cgroup removed meanwhile holds no one, but any other error reading a `cgroup.procs` or a
    /// directory (EACCES, EIO, more than 1024 cgroups) is `Err`. A decision that drops or skips
    /// something on "not in this cgroup" reads this, not [`CgroupFs::procs_recursive`].
    pub fn procs_recursive_proven(&self, rel: &str) -> std::io::Result<Vec<u32>> {
        let gone = |e: &std::io::Error| e.kind() == std::io::ErrorKind::NotFound;
        let mut out = Vec::new();
        let mut stack = vec![rel.to_owned()];
        let mut budget = 1024_u32;
        while let Some(rel) = stack.pop() {
            budget = budget.checked_sub(1).ok_or_else(|| std::io::Error::other("over 1024 cgroups below"))?;
            match self.read_procs(&rel) {
                Ok(pids) => out.extend(pids),
                Err(e) if gone(&e) => continue,
                Err(e) => return Err(std::io::Error::new(e.kind(), format!("read {rel}/cgroup.procs: {e}"))),
            }
            let entries = match std::fs::read_dir(self.abs(&rel)) {
                Ok(entries) => entries,
                Err(e) if gone(&e) => continue,
                Err(e) => return Err(std::io::Error::new(e.kind(), format!("read the cgroups below {rel}: {e}"))),
            };
            for e in entries {
                let e = e?;
                if e.file_type()?.is_dir()
                    && let Ok(name) = e.file_name().into_string()
                {
                    stack.push(format!("{}/{}", rel.trim_end_matches('/'), name));
                }
            }
        }
        Ok(out)
    }

    /// Processes in a cgroup and every cgroup below it.
    pub fn procs_recursive(&self, rel: &str) -> Vec<u32> {
        let mut out = self.procs(rel);
        let mut stack = self.child_dirs(rel);
        let mut budget = 1024;
        while let Some(child) = stack.pop() {
            budget -= 1;
            if budget == 0 {
                break;
            }
            out.extend(self.procs(&child));
            stack.extend(self.child_dirs(&child));
        }
        out
    }
}

/// The cgroup v2 path of a process (`0::/path` in `/proc/<pid>/cgroup`).
pub fn cgroup_of_pid(host_proc: &Path, pid: u32) -> Option<String> {
    let text = std::fs::read_to_string(host_proc.join(pid.to_string()).join("cgroup")).ok()?;
    text.lines().find_map(|l| l.strip_prefix("0::").map(str::to_owned))
}

/// A throwaway directory tree standing in for a cgroup2 root (`CgroupFs` only reads
/// directories, their inode numbers and `cgroup.procs` files).
#[cfg(test)]
pub(crate) struct TempTree(pub(crate) PathBuf);

#[cfg(test)]
impl TempTree {
    pub(crate) fn new(name: &str) -> TempTree {
        let dir = std::env::temp_dir().join(format!("valet-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("mkdir temp root");
        TempTree(dir)
    }

    pub(crate) fn mkdir(&self, rel: &str) {
        std::fs::create_dir_all(self.0.join(rel.trim_start_matches('/'))).expect("mkdir");
    }

    /// Writes `pids` as the `cgroup.procs` of `rel`.
    pub(crate) fn procs(&self, rel: &str, pids: &[u32]) {
        let text: String = pids.iter().map(|p| format!("{p}\n")).collect();
        std::fs::write(self.0.join(rel.trim_start_matches('/')).join("cgroup.procs"), text).expect("cgroup.procs");
    }
}

#[cfg(test)]
impl Drop for TempTree {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const REAL: &str = "0f5c9b6e-3a7d-4e21-9b8a-1c2d3e4f5a6b";
    const REAL_: &str = "0f5c9b6e_3a7d_4e21_9b8a_1c2d3e4f5a6b";
    const ATTACKER_: &str = "11111111_2222_4333_8444_555555555555";
    const CTR: &str = "4d2a7c1f9e8b3a6d5c4b3a29180f7e6d5c4b3a2918f0e7d6c5b4a39281706f5e";

    #[test]
    fn a_container_whose_processes_cannot_be_read_is_not_proven_empty() {
        let tree = TempTree::new("unreadable");
        let fs = CgroupFs::new(&tree.0);
        // runc: the processes in the container's cgroup; crun: one level below, the scope empty.
        tree.mkdir("/pod/runc");
        tree.procs("/pod/runc", &[41, 42]);
        tree.mkdir("/pod/crun/container");
        tree.procs("/pod/crun", &[]);
        tree.procs("/pod/crun/container", &[51]);
        assert_eq!(fs.container_procs_proven("/pod/runc").ok(), Some(vec![41, 42]));
        assert_eq!(fs.container_procs_proven("/pod/crun").ok(), Some(vec![51]));
        // Removed: it holds no one.
        assert_eq!(fs.container_procs_proven("/pod/gone").ok(), Some(vec![]));
        // A read error that is not "gone" (a directory where the file is: EISDIR, even for root)
        // is no proof, at the container's cgroup and below it; the lenient read says "none".
        tree.mkdir("/pod/bad/cgroup.procs");
        assert!(fs.container_procs_proven("/pod/bad").is_err());
        assert!(fs.container_procs("/pod/bad").is_empty());
        tree.mkdir("/pod/crun2/container/cgroup.procs");
        tree.procs("/pod/crun2", &[]);
        assert!(fs.container_procs_proven("/pod/crun2").is_err());
    }

    #[test]
    fn a_pod_planted_in_another_pods_cgroup_is_never_found() {
        let tree = TempTree::new("planted");
        let fs = CgroupFs::new(&tree.0);
        // The attacker's pod, at its standard place, with a writable container cgroup in which
        // it made a kubelet-shaped path for the victim's UID, before the victim's pod exists.
        let attacker = format!("/kubepods.slice/kubepods-pod{ATTACKER_}.slice");
        let planted = [
            format!("{attacker}/cri-containerd-{CTR}.scope/kubepods.slice/kubepods-pod{REAL_}.slice"),
            format!("{attacker}/cri-containerd-{CTR}.scope/kubepods/besteffort/pod{REAL}"),
            format!("{attacker}/kubepods.slice/kubepods-pod{REAL_}.slice"),
            format!("{attacker}/kubelet-kubepods.slice/kubelet-kubepods-pod{REAL_}.slice"),
        ];
        for p in &planted {
            tree.mkdir(p);
            assert_eq!(classify(p), CgroupKind::NotPodContainer, "{p}");
        }
        assert_eq!(fs.find_pod(REAL), None, "only planted paths exist");
        // The victim's real cgroup, under a nested kubelet root that only the walk finds, and
        // deeper than the planted ones: the walk meets the planted ones first.
        let real = format!(
            "/kube-node/kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-besteffort.slice/\
             kubelet-kubepods-besteffort-pod{REAL_}.slice"
        );
        tree.mkdir(&real);
        let found = fs.find_pod(REAL).expect("the real pod cgroup");
        assert_eq!(found.rel, real);
        assert_eq!(found.id, fs.id_of(&real).expect("id"));
        // And at the standard place, the candidates find it directly (while no other kubelet
        // root is known).
        let standard = format!("/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{REAL_}.slice");
        tree.mkdir(&standard);
        assert_eq!(CgroupFs::new(&tree.0).find_pod(REAL).map(|d| d.rel), Some(standard));
    }

    #[test]
    fn once_a_root_is_known_its_pods_are_found_at_once_and_the_walk_waits() {
        let tree = TempTree::new("known");
        let fs = CgroupFs::new(&tree.0);
        let uid = |n: u8| format!("{n:08x}-3a7d-4e21-9b8a-1c2d3e4f5a6b");
        let under = |root: &str, n: u8| format!("{root}/kubepods/burstable/pod{}", uid(n));
        let (known, other) = ("/kube-a/kubelet", "/kube-b/kubelet");
        tree.mkdir(&under(known, 1));
        // The first pod: only the walk finds it, and it teaches the root.
        assert_eq!(fs.find_pod(&uid(1)).map(|d| d.rel), Some(under(known, 1)));
        // A pod in another root right after a walk: the walk waits, so it is not found yet...
        tree.mkdir(&under(other, 2));
        assert_eq!(fs.find_pod(&uid(2)), None, "the walk ran less than a second ago");
        // ...while a new pod in the known root is found at its place, with no walk, and a pod
        // not made yet is no walk either (a clone shares what was learned).
        tree.mkdir(&format!("{known}/kubepods/pod{}", uid(3)));
        assert_eq!(fs.clone().find_pod(&uid(3)).map(|d| d.rel), Some(format!("{known}/kubepods/pod{}", uid(3))));
        assert_eq!(fs.find_pod(&uid(4)), None);
        // Once the walk is due again, it finds the other root's pod.
        fs.known().walked = Instant::now().checked_sub(WALK_EVERY);
        assert_eq!(fs.find_pod(&uid(2)).map(|d| d.rel), Some(under(other, 2)));
    }

    #[test]
    fn containers_of_a_pod_ignore_planted_children() {
        let tree = TempTree::new("containers");
        let fs = CgroupFs::new(&tree.0);
        let pod = format!("/kubepods/besteffort/pod{REAL}");
        tree.mkdir(&format!("{pod}/{CTR}/kubepods/pod{}", "11111111-2222-4333-8444-555555555555"));
        tree.mkdir(&format!("{pod}/not-a-container"));
        let found = fs.containers(&pod);
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].container.id, CTR);
        assert_eq!(found[0].rel, format!("{pod}/{CTR}"));
    }

    #[test]
    fn reads_own_cgroup_and_its_procs() {
        let root = super::super::root::find_cgroup2_root(None, Path::new("/proc")).expect("cgroup2");
        let fs = CgroupFs::new(&root);
        let me = std::process::id();
        let rel = cgroup_of_pid(Path::new("/proc"), me).expect("own cgroup");
        assert!(fs.id_of(&rel).expect("id") > 0);
        assert!(fs.procs(&rel).contains(&me), "{rel} lists this process");
        assert!(fs.find_pod("00000000-0000-0000-0000-000000000000").is_none());
        // Path → id → path, on a throwaway child cgroup.
        let child = format!("{}/valet-unit-{me}", rel.trim_end_matches('/'));
        std::fs::create_dir(fs.abs(&child)).expect("mkdir child cgroup");
        let id = fs.id_of(&child).expect("id");
        let found = (fs.find_by_id(id, &rel, 100_000), fs.find_by_id(id, &child, 1), fs.find_by_id(id, &rel, 0));
        let missing = fs.find_by_id(u64::MAX, &child, 100);
        std::fs::remove_dir(fs.abs(&child)).expect("rmdir child cgroup");
        assert_eq!(found.0.as_deref(), Some(child.as_str()));
        assert_eq!(found.1.as_deref(), Some(child.as_str()));
        assert_eq!(found.2, None, "the budget bounds the walk");
        assert_eq!(missing, None);
    }

    #[test]
    fn a_search_tells_a_cgroup_gone_from_one_it_could_not_finish() {
        let tree = TempTree::new("search");
        let fs = CgroupFs::new(&tree.0);
        tree.mkdir("/kubepods/pod1/c1");
        tree.mkdir("/kubepods/pod2/c2");
        let id = fs.id_of("/kubepods/pod2/c2").expect("id");
        assert_eq!(fs.search_by_id(id, "/", 100), Search::Found("/kubepods/pod2/c2".into()));
        assert_eq!(fs.search_by_id(u64::MAX, "/", 100), Search::Gone, "every directory looked at");
        assert_eq!(fs.search_by_id(u64::MAX, "/", 2), Search::Unsure, "out of budget is not gone");
        // A directory that is not there (removed meanwhile) is no one's cgroup.
        assert_eq!(fs.search_by_id(u64::MAX, "/kubepods/pod9", 100), Search::Gone);
    }
}
