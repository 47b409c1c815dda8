//! A pod's cgroups on the node: found, its containers named (from the runtime's bundles), and
//! watched by the kernel, which is told what each container's main process is.

use std::collections::HashSet;
use std::path::PathBuf;
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use tracing::{debug, warn};
use valet_common::watch_flags;

use super::release::{Releases, held_at_exec};
use crate::cgroup::CgroupFs;
use crate::cgroup::created::Creations;
use crate::effect::{ContainerSeen, Feedback, RuntimeName};
use crate::host::container_main::main_among;
use crate::kernel::{KernelControl, RecordOutcome};
use crate::runtime::{BundleRole, RuntimeBundles, name_of_process};

/// The pods' cgroups and the kernel's watch of them (effects `FindPodCgroup`, `ScanContainers`,
/// `Watch`, `Unwatch`, `ClassifyExec`, `ForgetContainer`).
pub struct PodCgroups<K> {
    cgroups: CgroupFs,
    bundles: RuntimeBundles,
    kernel: K,
    /// New container cgroups in watched pods.
    creations: Creations,
    host_proc: PathBuf,
    /// The kubelet's container log links (see [`crate::log_links`]), and their last read.
    log_links: PathBuf,
    links_read: crate::log_links::Links,
    /// Whether an unreadable links directory was warned of (once; debug after).
    links_warned: bool,
}

impl<K: KernelControl> PodCgroups<K> {
    pub fn new(cgroups: CgroupFs, bundles: RuntimeBundles, kernel: K, host_proc: PathBuf) -> PodCgroups<K> {
        let log_links = crate::log_links::default_dir(&host_proc);
        let links_read = crate::log_links::Links::default();
        PodCgroups {
            cgroups,
            bundles,
            kernel,
            creations: Creations::new(),
            host_proc,
            log_links,
            links_read,
            links_warned: false,
        }
    }

    /// Reads the kubelet's container log links in `dir` instead of the default directory.
    pub fn with_log_links(mut self, dir: PathBuf) -> PodCgroups<K> {
        self.log_links = dir;
        self
    }

    /// The name the kubelet's log link gives container `id` (cgroup `container_cgroup`) of `pod`,
    /// one the agent never saw (effect `NameEnded`): the runtime removed its cgroup and bundle
    /// before the agent looked.
    pub fn name_ended(&mut self, uid: &str, pod: Option<&Pod>, container_cgroup: u64, id: &str) -> Feedback {
        let name = pod.and_then(|pod| self.link_name(uid, pod, id));
        Feedback::EndedNamed { container_cgroup, name }
    }

    fn link_name(&mut self, uid: &str, pod: &Pod, id: &str) -> Option<String> {
        let (Some(namespace), Some(name)) = (pod.metadata.namespace.as_deref(), pod.metadata.name.as_deref()) else {
            return None;
        };
        if self.links_read.has(id) {
            return self.links_read.name_of(namespace, name, id);
        }
        match crate::log_links::Links::read(&self.log_links) {
            Ok(links) => {
                self.links_read = links;
                self.links_read.name_of(namespace, name, id)
            }
            Err(e) if !self.links_warned => {
                self.links_warned = true;
                warn!(
                    %uid,
                    dir = %self.log_links.display(),
                    "cannot read the kubelet's container log links: a container the agent did not see start waits for the API's report: {e}"
                );
                None
            }
            Err(e) => {
                debug!(%uid, dir = %self.log_links.display(), "cannot read the kubelet's container log links: {e}");
                None
            }
        }
    }

    /// New container cgroups in held pods.
    pub fn creations(&mut self) -> &mut Creations {
        &mut self.creations
    }

    pub fn kernel(&mut self) -> &mut K {
        &mut self.kernel
    }

    /// The runtime's container records reached through the runtime processes found so far that
    /// still live. With none, the runtime that started pod `pod_rel` is looked for first, up from
    /// its processes (the sandbox's pause runs as long as the pod): the pod may have been named
    /// through another pod's shim, gone since.
    pub fn record_dirs(&mut self, pod_rel: Option<&str>) -> Vec<crate::runtime_record::RecordDir> {
        let dirs = self.bundles.record_dirs();
        let Some(pod_rel) = pod_rel.filter(|_| dirs.is_empty()) else { return dirs };
        let procs: Vec<u32> = self
            .cgroups
            .containers(pod_rel)
            .into_iter()
            .filter_map(|c| self.cgroups.container_procs_proven(&c.rel).ok())
            .flatten()
            .collect();
        let pod_procs: HashSet<u32> = procs.iter().copied().collect();
        self.bundles.find_runtime(&procs, &pod_procs);
        self.bundles.record_dirs()
    }

    /// Pod `uid`'s cgroup (effect `FindPodCgroup`), if there is one.
    pub fn find_pod(&self, uid: &str) -> Option<Feedback> {
        self.cgroups.find_pod(uid).map(|dir| Feedback::PodCgroup { rel: dir.rel, id: dir.id })
    }

    /// Has the kernel watch pod cgroup `pod_cgroup` (effect `Watch`, once its hold is allowed):
    /// for its containers' exits, and to hold their apps until `hold` (the hold's timeout) is
    /// past.
    pub fn watch(&mut self, uid: &str, pod_cgroup: u64, pod_rel: &str, exits: bool, hold: Option<Duration>) {
        let flags = if exits { watch_flags::EXITS } else { 0 } | if hold.is_some() { watch_flags::HOLD } else { 0 };
        let flags = match hold {
            Some(timeout) => valet_common::watched_value(flags, u32::try_from(timeout.as_millis()).unwrap_or(u32::MAX)),
            None => flags,
        };
        if let Err(e) = self.kernel.watch(pod_cgroup, flags) {
            warn!(%uid, "register pod cgroup with the kernel: {}", e.chain());
        }
        // Every tracked pod: a container is named when its cgroup appears, not when it
        // ends (the runtime removes cgroup and bundle tens of milliseconds after the end,
        // which a busy agent can miss); in a held pod, before its first exec.
        if let Err(e) = self.creations.watch(pod_cgroup, &self.cgroups.abs(pod_rel)) {
            debug!(%uid, hold = ?hold.is_some(), "new containers are named when the kernel reports them: {e}");
        }
    }

    /// Ends the kernel's watch of pod cgroup `pod_cgroup` (effect `Unwatch`).
    pub fn unwatch(&mut self, uid: &str, pod_cgroup: u64) {
        self.creations.unwatch(pod_cgroup);
        if let Err(e) = self.kernel.unwatch(pod_cgroup) {
            debug!(%uid, "unwatch pod cgroup: {}", e.chain());
        }
    }

    /// Tells the kernel whether the app of a container is held at its exec (effect
    /// `ClassifyExec`).
    pub fn classify_exec(&mut self, uid: &str, container_cgroup: u64, hold: bool) {
        if let Err(e) = self.kernel.classify_exec(container_cgroup, hold) {
            debug!(%uid, "classify container cgroup: {}", e.chain());
        }
    }

    /// The kernel forgets a container (effect `ForgetContainer`).
    pub fn forget_container(&mut self, container_cgroup: u64) {
        self.kernel.forget_container(container_cgroup);
    }

    /// The pod's container cgroups, named from the runtime's bundles where they exist (effect
    /// `ScanContainers`). `releases`: where the kernel's record of held processes is read.
    pub fn scan(&mut self, uid: &str, pod_rel: &str, adopt: bool, releases: &Releases) -> Vec<ContainerSeen> {
        let containers: Vec<_> = self
            .cgroups
            .containers(pod_rel)
            .into_iter()
            .map(|c| match self.cgroups.container_procs_proven(&c.rel) {
                Ok(procs) => (c, procs, false),
                Err(e) => {
                    // Unreadable is not empty: the container is taken as running until a read
                    // proves otherwise (a cgroup made unreadable must not end its pod early).
                    warn!(%uid, cgroup = %c.rel, "cannot read the container's processes, taken as running: {e}");
                    (c, Vec::new(), true)
                }
            })
            .collect();
        let mut searched = false;
        let mut seen = Vec::with_capacity(containers.len());
        for (i, (c, procs, unreadable)) in containers.iter().enumerate() {
            // A container already running when its pod was first looked at: tell the kernel
            // which process is its main one (the exec that would have recorded it is past).
            if adopt && !procs.is_empty() && !self.kernel.exec_seen(c.id) {
                self.record_main(uid, &c.rel, c.id);
            }
            let mut role = self.bundles.role(&c.container.id, uid);
            if role.is_none() && !searched {
                // Not where the bundles were looked for: ask the runtime that started the pod,
                // up from this container's processes, then the others' (the sandbox's pause
                // runs as long as the pod).
                searched = true;
                let pod_procs: HashSet<u32> = containers.iter().flat_map(|(_, p, _)| p.iter().copied()).collect();
                let starts: Vec<u32> = procs
                    .iter()
                    .copied()
                    .chain(
                        containers
                            .iter()
                            .enumerate()
                            .filter(|(j, _)| *j != i)
                            .filter_map(|(_, (_, p, _))| p.first().copied()),
                    )
                    .collect();
                if self.bundles.find_runtime(&starts, &pod_procs) {
                    role = self.bundles.role(&c.container.id, uid);
                }
            }
            // The runtime's bundle first; else the kubelet's per-container mount, as a process
            // of the container sees it.
            let runtime_name = role
                .map(|role| match role {
                    BundleRole::Sandbox => RuntimeName::Sandbox,
                    BundleRole::Container(name) => RuntimeName::Container(name),
                })
                .or_else(|| {
                    procs.iter().find_map(|pid| name_of_process(&self.host_proc, *pid, uid)).map(RuntimeName::Container)
                });
            let exec_done = self.kernel.exec_seen(c.id)
                || procs.iter().any(|pid| held_at_exec(&self.host_proc, *pid))
                || releases.holds_recorded(&c.rel);
            seen.push(ContainerSeen {
                cgroup_id: c.id,
                rel: c.rel.clone(),
                id: c.container.id.clone(),
                runtime_name,
                exec_done,
                live: !procs.is_empty() || *unreadable,
            });
        }
        seen
    }

    fn record_main(&mut self, uid: &str, rel: &str, cgroup_id: u64) {
        // The whole subtree: a main process may have moved below the container's cgroup (a
        // nested runtime's), and its processes' pid namespaces tell the main one apart.
        let pids = self.cgroups.procs_recursive(rel);
        let Some(main) = main_among(&self.host_proc, &pids) else { return };
        match self.kernel.record_container_main(cgroup_id, &main) {
            Ok(RecordOutcome::MapFull) => {
                warn!(%uid, cgroup = %rel, "the kernel's container map is full: this container's end is seen by the API only");
            }
            Ok(_) => debug!(%uid, cgroup = %rel, pid = main.tgid, "recorded a running container's main process"),
            Err(e) => debug!(%uid, "record container main: {}", e.chain()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::fake_proc::FakeProc;
    use crate::kernel::mode::NoKernel;
    use crate::runtime_record::{Record, read_any};

    /// With no runtime process known that still lives, the pod's own runtime is looked for up
    /// from the processes of its containers' cgroups, and its records read through it; a pod
    /// whose processes no runtime process started reaches none.
    #[test]
    fn with_no_live_runtime_known_the_pods_own_is_found_from_its_processes() {
        let fake = FakeProc::new("pod-records");
        let app = "a".repeat(64);
        fake.k3s_shim_with_ended_record(50, 1000, &app);
        // The app's process (pid 1 of its namespace) under the shim; another pod's process
        // under the node's init.
        fake.process(100, 50, "100\t1", 1002);
        fake.process(200, 1, "200\t1", 1003);
        // The pods' cgroups: a tree of plain directories, membership read from cgroup.procs.
        let tree = fake.root.join("cgroup");
        let pod = "/kubepods/besteffort/pod0c1d2e3f-1111-4222-8333-444455556666";
        let stray = "/kubepods/besteffort/pod99999999-1111-4222-8333-444455556666";
        for (pod_rel, pid) in [(pod, 100), (stray, 200)] {
            let dir = tree.join(pod_rel.trim_start_matches('/')).join(&app);
            std::fs::create_dir_all(&dir).expect("mkdir");
            std::fs::write(dir.join("cgroup.procs"), format!("{pid}\n")).expect("procs");
        }
        let bundles = RuntimeBundles::new(Vec::new(), Some(fake.proc()));
        let mut pods = PodCgroups::new(CgroupFs::new(&tree), bundles, NoKernel, fake.proc());
        assert!(pods.record_dirs(None).is_empty(), "no runtime process known, no pod to look up from");
        assert!(pods.record_dirs(Some(stray)).is_empty(), "its process's parent is the node's init");
        let dirs = pods.record_dirs(Some(pod));
        assert_eq!(read_any(&fake.proc(), &dirs, &app), Record::Ended, "{dirs:?}");
        // Known and alive now: the same without a pod to look up from.
        assert_eq!(read_any(&fake.proc(), &pods.record_dirs(None), &app), Record::Ended);
        // The shim's pid goes to another program: nothing is read through the shim found, and
        // the pod's process no longer leads to a runtime.
        for link in ["exe", "cwd"] {
            std::fs::remove_file(fake.proc().join("50").join(link)).expect("rm link");
        }
        std::os::unix::fs::symlink("/usr/bin/sleep", fake.proc().join("50/exe")).expect("exe");
        fake.process(50, 1, "50", 2000);
        assert_eq!(read_any(&fake.proc(), &pods.record_dirs(Some(pod)), &app), Record::Absent);
    }

    /// An unseen container is named by its pod's link of its id, by default in the kubelet's
    /// directory through the host's pid 1; a link made after a read is found by the next; an
    /// unreadable directory names nothing (warned once).
    #[test]
    fn an_unseen_container_is_named_by_its_pods_log_link() {
        let fake = FakeProc::new("log-links");
        let host = fake.root.join("host");
        let links = host.join(crate::log_links::KUBELET_LINKS);
        std::fs::create_dir_all(&links).expect("links dir");
        std::fs::create_dir_all(fake.proc().join("1")).expect("proc/1");
        std::os::unix::fs::symlink(&host, fake.proc().join("1/root")).expect("root link");
        let (app, later) = ("a".repeat(64), "b".repeat(64));
        std::fs::write(links.join(format!("job_batch_app-{app}.log")), b"").expect("link");
        let pod: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "job", "namespace": "batch", "uid": "u1"}
        }))
        .expect("pod");
        let tree = fake.root.join("cgroup");
        let bundles = RuntimeBundles::new(Vec::new(), None);
        let mut pods = PodCgroups::new(CgroupFs::new(&tree), bundles, NoKernel, fake.proc());
        let named = |fb: Feedback| match fb {
            Feedback::EndedNamed { container_cgroup: 7, name } => name,
            other => panic!("{other:?}"),
        };
        assert_eq!(named(pods.name_ended("u1", Some(&pod), 7, &app)).as_deref(), Some("app"));
        assert_eq!(named(pods.name_ended("u1", None, 7, &app)), None, "no pod object, no name");
        let other: Pod = serde_json::from_value(serde_json::json!({
            "metadata": {"name": "job2", "namespace": "batch", "uid": "u2"}
        }))
        .expect("pod");
        assert_eq!(named(pods.name_ended("u2", Some(&other), 7, &app)), None, "another pod's link");
        std::fs::write(links.join(format!("job_batch_istio-proxy-{later}.log")), b"").expect("link");
        assert_eq!(named(pods.name_ended("u1", Some(&pod), 7, &later)).as_deref(), Some("istio-proxy"));
        std::fs::remove_dir_all(&links).expect("rm links");
        let gone = "c".repeat(64);
        for _ in 0..2 {
            assert_eq!(named(pods.name_ended("u1", Some(&pod), 7, &gone)), None);
        }
        assert!(pods.links_warned);
        // What was read stays true of its containers (an id is never reused).
        assert_eq!(named(pods.name_ended("u1", Some(&pod), 7, &app)).as_deref(), Some("app"));
    }
}
