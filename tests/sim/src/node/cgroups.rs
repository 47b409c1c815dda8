//! The kubelet's cgroup layout of a sim pod (its names for either driver and runtime), and
//! taking a cgroup tree down.
use std::io;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Result, bail};

use super::*;
use crate::util;

/// The pod's cgroup: the kubelet's shared parents (`kubepods`, its QoS class's) and its own
/// directory, named as the cgroup driver names them.
pub(super) fn cgroup_names(opts: &SimPodOptions, uid: &str) -> (Vec<String>, String) {
    let uid_ = uid.replace('-', "_");
    match (opts.driver, opts.qos.cgroup_name()) {
        (CgroupDriver::Systemd, Some(q)) => {
            (vec!["kubepods.slice".into(), format!("kubepods-{q}.slice")], format!("kubepods-{q}-pod{uid_}.slice"))
        }
        (CgroupDriver::Systemd, None) => (vec!["kubepods.slice".into()], format!("kubepods-pod{uid_}.slice")),
        (CgroupDriver::Cgroupfs, Some(q)) => (vec!["kubepods".into(), q.into()], format!("pod{uid}")),
        (CgroupDriver::Cgroupfs, None) => (vec!["kubepods".into()], format!("pod{uid}")),
    }
}

/// A container's cgroup leaf, as the runtime names it for the cgroup driver.
pub(super) fn leaf_name(opts: &SimPodOptions, id: &str) -> String {
    match (opts.driver, opts.runtime) {
        (CgroupDriver::Systemd, rt) => format!("{}{id}.scope", rt.scope_prefix()),
        // CRI-O names its cgroupfs leaves crio-<ID> too; containerd and Docker use the bare ID.
        (CgroupDriver::Cgroupfs, Runtime::Crio) => format!("crio-{id}"),
        (CgroupDriver::Cgroupfs, _) => id.to_string(),
    }
}

/// The pod's containers (the sandbox apart), each with its id (given, or random) and cgroup.
pub(super) fn sim_containers(opts: &SimPodOptions, pod_cgroup: &Path) -> Result<Vec<SimContainer>> {
    let mut containers = Vec::new();
    for c in &opts.containers {
        let id = match &c.id {
            Some(id) if id.len() == 64 && id.chars().all(|x| x.is_ascii_hexdigit()) => id.to_ascii_lowercase(),
            Some(id) => bail!("container {} id {id:?} is not 64 hex characters", c.name),
            None => util::random_container_id(),
        };
        if containers.iter().any(|x: &SimContainer| x.name == c.name) {
            bail!("duplicate container name {}", c.name);
        }
        containers.push(SimContainer {
            name: c.name.clone(),
            image: c.image.clone().unwrap_or_else(|| default_image(&c.name)),
            ports: c.ports.clone(),
            cgroup: pod_cgroup.join(leaf_name(opts, &id)),
            id,
        });
    }
    Ok(containers)
}

/// Kills what runs in a cgroup and waits until it is empty.
pub(super) fn kill_cgroup(dir: &Path) {
    let kill_file = dir.join("cgroup.kill");
    let have_kill = std::fs::write(&kill_file, "1").is_ok();
    let deadline = Instant::now() + Duration::from_secs(2);
    loop {
        let procs = std::fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default();
        let pids: Vec<i32> = procs.lines().filter_map(|l| l.trim().parse().ok()).collect();
        if pids.is_empty() || Instant::now() >= deadline {
            return;
        }
        if !have_kill {
            for p in pids {
                // SAFETY: plain syscall.
                unsafe { libc::kill(p, libc::SIGKILL) };
            }
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Kills what runs in a cgroup and below it, and removes the whole subtree, children first.
pub(super) fn remove_tree(dir: &Path) {
    if !dir.is_dir() {
        return;
    }
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            if e.file_type().is_ok_and(|t| t.is_dir()) {
                remove_tree(&e.path());
            }
        }
    }
    kill_cgroup(dir);
    rmdir_retry(dir);
}

pub(super) fn rmdir_retry(dir: &Path) {
    for _ in 0..100 {
        match std::fs::remove_dir(dir) {
            Ok(()) => return,
            Err(e) if e.kind() == io::ErrorKind::NotFound => return,
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => std::thread::sleep(Duration::from_millis(10)),
            Err(_) => return,
        }
    }
}
