//! The kubelet's sync loop over one pod: reaping exits, restarts, starting the next
//! containers, stopping native sidecars, relists, cleaning up after the runtime, each tick.
use std::os::unix::process::ExitStatusExt as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result};

use super::*;
use crate::util;

impl Inner {
    pub(super) fn next_tick_after(&self, t: Instant) -> Instant {
        let p = self.opts.relist_period.as_nanos().max(1);
        let since = t.saturating_duration_since(self.epoch).as_nanos();
        let k = since / p + 1;
        self.epoch + Duration::from_nanos((k * p) as u64)
    }

    /// Where containerd's CRI records of the pod's containers are: none for another runtime's.
    pub(super) fn record_dir(&self, kpod: &KPod) -> Option<PathBuf> {
        if !kpod.spec.bundles || kpod.sim.runtime() != Runtime::Containerd {
            return None;
        }
        self.opts.runtime_record_dir.clone()
    }

    pub(super) fn bundle_dir(&self, kpod: &KPod, id: &str) -> Option<PathBuf> {
        if !kpod.spec.bundles {
            return None;
        }
        let dir = self.opts.runtime_state_dir.as_ref()?;
        Some(dir.join(id))
    }

    /// The kubelet's log link of container `c` (`legacyLogSymlink`: the name cut to 251 bytes,
    /// then `.log`).
    pub(super) fn log_link(&self, kpod: &KPod, c: &SimContainer) -> Option<PathBuf> {
        let dir = self.opts.container_log_links.as_ref()?;
        let mut stem = format!("{}_{}_{}-{}", kpod.sim.name(), kpod.sim.namespace(), c.name, c.id);
        stem.truncate(251);
        Some(dir.join(format!("{stem}.log")))
    }

    /// Writes the bundle, makes the cgroup, spawns the process (`spec` None: the sandbox).
    pub(super) fn start_instance(
        &self,
        kpod: &KPod,
        spec: Option<&ContainerSpec>,
        cmd: &[String],
        spawn: &SpawnOptions,
    ) -> Result<Instance> {
        let name = spec.map_or("POD", |s| s.name.as_str());
        let c = kpod.sim.container(name)?;
        if let Some(dir) = self.bundle_dir(kpod, &c.id) {
            let sandbox_pid = kpod.sandbox.as_ref().map(|s| s.proc_.host_pid());
            write_bundle(&dir, &kpod.sim, &c, spec.is_none(), sandbox_pid)?;
        }
        // containerd's CRI plugin stores the container's status record at its creation (no pid
        // yet), before the process can run, let alone end: an app that ends at once has one.
        if let (Some(dir), Some(_)) = (self.record_dir(kpod), spec) {
            write_record(&dir, &c.id, 0, None)?;
        }
        kpod.sim.make_container_cgroup(&c)?;
        let args: Vec<&str> = cmd.iter().map(String::as_str).collect();
        let mut spawn = spawn.clone();
        if spawn.exec_delay.is_none() && !self.opts.create_start_gap.is_zero() {
            spawn.exec_delay = Some(self.opts.create_start_gap);
        }
        let p = kpod.sim.spawn(name, &args, &spawn)?;
        // Once started, the kubelet links the container's log (never the sandbox's).
        if spec.is_some()
            && let Some(link) = self.log_link(kpod, &c)
        {
            let (ns, pod, uid) = (kpod.sim.namespace(), kpod.sim.name(), kpod.sim.uid());
            let log = format!("/var/log/pods/{ns}_{pod}_{uid}/{}/0.log", c.name);
            std::os::unix::fs::symlink(log, &link).with_context(|| format!("log link {}", link.display()))?;
        }
        let proc_ = ContainerProcess::new(p, c.clone());
        // Its pid once started, as containerd updates the record at the start.
        if let (Some(dir), Some(_)) = (self.record_dir(kpod), spec) {
            write_record(&dir, &c.id, proc_.host_pid(), None)?;
        }
        let inst = Instance {
            c,
            proc_,
            started: util::now_rfc3339(),
            exit: None,
            seen: Arc::new(AtomicBool::new(false)),
            ready: Arc::new(AtomicBool::new(false)),
            started_ok: Arc::new(AtomicBool::new(spec.is_none_or(|s| s.startup.is_none()))),
            stop: Arc::default(),
            cgroup_removed: false,
            bundle_remove_at: None,
            bundle_removed: false,
            record_noticed: false,
        };
        if let Some(probe) = spec.and_then(|s| s.readiness.clone()) {
            let ip = kpod.sim.pod_ip();
            let (seen, ready, stop, dirty) =
                (inst.seen.clone(), inst.ready.clone(), inst.stop.clone(), kpod.dirty.clone());
            let started = Instant::now();
            std::thread::Builder::new()
                .name("sim-prober".into())
                .spawn(move || probe_loop(probe, ip, started, seen, ready, stop, dirty, false))
                .context("probe thread")?;
        }
        if let Some(probe) = spec.and_then(|s| s.startup.clone()) {
            let ip = kpod.sim.pod_ip();
            let (seen, started_ok, stop, dirty) =
                (inst.seen.clone(), inst.started_ok.clone(), inst.stop.clone(), kpod.dirty.clone());
            let started = Instant::now();
            std::thread::Builder::new()
                .name("sim-startup".into())
                .spawn(move || probe_loop(probe, ip, started, seen, started_ok, stop, dirty, true))
                .context("startup probe thread")?;
        }
        Ok(inst)
    }

    pub(super) fn start_container_at(&self, kpod: &mut KPod, i: usize, cmd: &[String]) -> Result<ContainerProcess> {
        let k = &kpod.containers[i];
        let restarting = k.current.is_some();
        if restarting {
            kpod.sim.new_instance(&k.spec.name)?;
        }
        let spec = k.spec.clone();
        let inst = self.start_instance(kpod, Some(&spec), cmd, &spec.spawn)?;
        let proc_ = inst.proc_.clone();
        let k = &mut kpod.containers[i];
        if let Some(old) = k.current.take() {
            let scheme = kpod.sim.runtime().id_scheme();
            k.last_terminated = old.exit.as_ref().map(|e| terminated_json(&old, e, scheme));
            k.restart_count += 1;
            k.old.push(old);
        }
        k.restart_at = None;
        k.current = Some(inst);
        kpod.changed = true;
        Ok(proc_)
    }

    /// What the kubelet does on its own: reaps, restarts, starts the next containers, removes
    /// cgroups and bundles of exited containers.
    /// `exits`: whether a child may have exited since the last look (else nothing is reaped).
    pub(super) fn step(&self, kpod: &mut KPod, now: Instant, exits: bool) {
        let exited_now = self.reap(kpod, now, exits);
        self.restart(kpod, now);
        self.start_next(kpod, now, exited_now);
        self.stop_sidecars(kpod, now);
        self.clean_up(kpod, now);
    }

    /// Exits, as the kernel has them, and their records, as the runtime makes them later.
    /// Whether a container exited now.
    pub(super) fn reap(&self, kpod: &mut KPod, now: Instant, exits: bool) -> bool {
        let lag_range = self.opts.exit_record_lag;
        let (mut exited_now, mut recorded_now) = (false, false);
        let records = self.record_dir(kpod);
        let mut look = |inst: &mut Instance, lag: Option<Duration>| {
            if let Some(exit) = &inst.exit
                && !inst.record_noticed
                && exit.recorded(now)
            {
                inst.record_noticed = true;
                recorded_now = true;
                if let Some(dir) = &records {
                    let code = exit.code;
                    let at = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
                    let finished = (i64::try_from(at.as_nanos()).unwrap_or(i64::MAX), code);
                    if let Err(e) = write_record(dir, &inst.c.id, inst.proc_.host_pid(), Some(finished)) {
                        eprintln!("sim kubelet: {e:#}");
                    }
                }
            }
            // Reaped already by another hand (a test's wait or kill), or a zombie of ours now.
            if inst.exit.is_none()
                && (exits || inst.proc_.reaped())
                && let Ok(Some(status)) = inst.proc_.try_wait()
            {
                inst.exit = Some(Exit {
                    code: exit_code(status),
                    signal: status.signal(),
                    at: now,
                    finished: util::now_rfc3339(),
                    recorded_at: now + lag.unwrap_or_else(|| uniform(lag_range)),
                });
                inst.stop.set();
                inst.ready.store(false, Ordering::SeqCst);
                exited_now = true;
            }
        };
        if let Some(sandbox) = kpod.sandbox.as_mut() {
            look(sandbox, None);
        }
        for k in kpod.containers.iter_mut() {
            let lag = k.spec.record_lag;
            for inst in k.current.iter_mut().chain(k.old.iter_mut()) {
                look(inst, lag);
            }
        }
        if exited_now {
            kpod.changed = true;
        }
        if recorded_now {
            kpod.changed = true;
            kpod.recorded_now = true;
        }
        exited_now
    }

    /// Restarts (decided from the exit; the back-off counts from the relist that saw it).
    pub(super) fn restart(&self, kpod: &mut KPod, now: Instant) {
        let policy = kpod.spec.json.restart_policy.clone();
        for k in kpod.containers.iter_mut() {
            let Some(cur) = &k.current else { continue };
            let Some(exit) = cur.exit.as_ref().filter(|e| e.recorded(now)) else { continue };
            if k.restart_at.is_some() {
                continue;
            }
            let restart = match k.spec.kind {
                // Decided by the sync that sees the exit (see `sync`): not if the pod is done.
                ContainerKind::NativeSidecar => false,
                _ => k.spec.should_restart(&policy, exit.code),
            };
            if restart && k.spec.command.is_some() {
                let shift = k.restart_count.min(16);
                let backoff = self.opts.restart_backoff.saturating_mul(1 << shift).min(self.opts.max_restart_backoff);
                k.restart_at = Some(self.next_tick_after(exit.at) + backoff);
            }
        }
        let done = regular_done(kpod);
        for i in 0..kpod.containers.len() {
            if kpod.containers[i].spec.kind == ContainerKind::NativeSidecar
                && kpod.containers[i].restart_at.is_some()
                && (done || kpod.killing.is_some())
            {
                // The sync at the end of the back-off sees every regular container done: it kills
                // the pod instead (`computePodActions` drops `InitContainersToStart`).
                kpod.containers[i].restart_at = None;
            }
            if kpod.containers[i].restart_at.is_some_and(|t| now >= t) {
                let cmd = kpod.containers[i].spec.command.clone().unwrap_or_default();
                if let Err(e) = self.start_container_at(kpod, i, &cmd) {
                    tracing::warn!("sim kubelet: restart of {} failed: {e:#}", kpod.containers[i].spec.name);
                    kpod.containers[i].restart_at = Some(now + Duration::from_secs(1));
                }
            }
        }
    }

    /// Starts what comes next, in spec order: init steps one at a time, then every container.
    pub(super) fn start_next(&self, kpod: &mut KPod, now: Instant, exited_now: bool) {
        if kpod.next_step_at.is_some_and(|t| now >= t) && kpod.killing.is_some() {
            kpod.next_step_at = None;
        }
        if kpod.next_step_at.is_some_and(|t| now >= t) {
            kpod.next_step_at = None;
            let mut blocked = false;
            for i in 0..kpod.containers.len() {
                let k = &kpod.containers[i];
                let is_init = k.spec.kind != ContainerKind::Main;
                if blocked {
                    break;
                }
                if k.current.is_none() && k.spec.command.is_some() {
                    let cmd = k.spec.command.clone().unwrap_or_default();
                    if let Err(e) = self.start_container_at(kpod, i, &cmd) {
                        tracing::warn!("sim kubelet: start of {} failed: {e:#}", kpod.containers[i].spec.name);
                    }
                }
                let k = &kpod.containers[i];
                match (k.spec.kind, &k.current) {
                    (ContainerKind::Init, Some(inst)) if inst.exit.as_ref().is_none_or(|e| e.code != 0) => {
                        blocked = true
                    }
                    (ContainerKind::Init, Some(_)) => {}
                    // A native sidecar lets the next container start once a sync saw it running
                    // and its startupProbe (if any) passed.
                    (ContainerKind::NativeSidecar, Some(inst))
                        if inst.seen.load(Ordering::SeqCst) && inst.started_ok.load(Ordering::SeqCst) => {}
                    _ if is_init => blocked = true,
                    _ => {}
                }
            }
        }
        // An init step finished: the next starts on the following relist.
        if exited_now
            && kpod.containers.iter().any(|k| {
                k.spec.kind == ContainerKind::Init
                    && k.current.as_ref().and_then(|c| c.exit.as_ref()).is_some_and(|e| e.code == 0 && e.at == now)
            })
        {
            kpod.next_step_at = Some(self.next_tick_after(now) + uniform(self.opts.status_sync_delay));
        }
    }

    /// The runtime cleans up after exited containers: their cgroups, then their bundles.
    pub(super) fn clean_up(&self, kpod: &mut KPod, now: Instant) {
        let cg_delay = self.opts.cgroup_removal_delay;
        let bundle_delay = self.opts.bundle_removal_delay;
        let sim = kpod.sim.clone();
        let bundles: Option<PathBuf> = if kpod.spec.bundles { self.opts.runtime_state_dir.clone() } else { None };
        for k in kpod.containers.iter_mut() {
            for inst in k.current.iter_mut().chain(k.old.iter_mut()) {
                let Some(exit) = &inst.exit else { continue };
                if !inst.cgroup_removed && now >= exit.at + cg_delay && sim.remove_container_cgroup(&inst.c) {
                    inst.cgroup_removed = true;
                    inst.bundle_remove_at = Some(now + uniform(bundle_delay));
                }
                if !inst.bundle_removed && inst.bundle_remove_at.is_some_and(|t| now >= t) {
                    if let Some(dir) = &bundles {
                        let _ = std::fs::remove_dir_all(dir.join(&inst.c.id));
                    }
                    inst.bundle_removed = true;
                }
            }
            k.old.retain(|i| !i.done());
        }
    }

    /// What a sync does with what the last relist saw, for native sidecars
    /// (`computePodActions`, `computeInitContainerActions`): while a regular container still
    /// runs (or is to be restarted), a native sidecar seen exited is restarted after the back-off;
    /// once every regular container is seen done, the pod is killed: no sidecar is restarted and
    /// the running ones are stopped (see [`Inner::stop_sidecars`]). The containers not started
    /// yet are started once what holds them (a sidecar's startup) is seen.
    pub(super) fn sync(&self, kpod: &mut KPod, now: Instant) {
        let has_native = kpod.containers.iter().any(|k| k.spec.kind == ContainerKind::NativeSidecar);
        if kpod.killing.is_none() && has_native && regular_done(kpod) {
            kpod.killing = Some(now);
            let grace = kpod.spec.grace_period;
            let sim = kpod.sim.clone();
            for k in kpod.containers.iter_mut().filter(|k| k.spec.kind == ContainerKind::NativeSidecar) {
                k.restart_at = None;
                let Some(inst) = k.current.as_ref().filter(|i| i.exit.is_none()) else { continue };
                // The preStop hooks of every container start at once (each `killContainer` runs
                // in a goroutine of its own); each one's turn comes after.
                let pre_stop = k.spec.pre_stop.as_ref().and_then(|cmd| {
                    let args: Vec<&str> = cmd.iter().map(String::as_str).collect();
                    let ns = PathBuf::from(format!("/proc/{}/ns/pid", inst.proc_.host_pid()));
                    let spawn = SpawnOptions { join_pid_namespace: Some(ns), ..Default::default() };
                    sim.spawn(&k.spec.name, &args, &spawn)
                        .map_err(|e| tracing::warn!("sim kubelet: preStop of {} failed: {e:#}", k.spec.name))
                        .ok()
                });
                k.stopping = Some(Stopping { pre_stop, deadline: now + grace, sigterm_at: None, kill_at: None });
            }
            kpod.changed = true;
            return;
        }
        if kpod.killing.is_some() {
            return;
        }
        for (k, seen) in kpod.containers.iter_mut().zip(kpod.seen.iter()) {
            if k.spec.kind != ContainerKind::NativeSidecar || k.restart_at.is_some() || k.spec.command.is_none() {
                continue;
            }
            let seen_exited =
                seen.exit.is_some() && k.current.as_ref().is_some_and(|c| Some(&c.c.id) == seen.id.as_ref());
            if seen_exited {
                // `doBackOff`: a container with no back-off entry yet (its first exit) is restarted
                // by this very sync; later ones after the back-off, doubled per restart.
                let backoff = match k.restart_count {
                    0 => Duration::ZERO,
                    n => self
                        .opts
                        .restart_backoff
                        .saturating_mul(1 << (n - 1).min(16))
                        .min(self.opts.max_restart_backoff),
                };
                k.restart_at = Some(now + backoff);
            }
        }
        let waiting = kpod.containers.iter().any(|k| k.current.is_none() && k.spec.command.is_some());
        if waiting && kpod.next_step_at.is_none() {
            kpod.next_step_at = Some(now + uniform(self.opts.status_sync_delay));
        }
    }

    /// Stops a killed pod's native sidecars, last first (see [`Stopping`]).
    pub(super) fn stop_sidecars(&self, kpod: &mut KPod, now: Instant) {
        if kpod.killing.is_none() {
            return;
        }
        let regular_ended = kpod
            .containers
            .iter()
            .filter(|k| k.spec.kind != ContainerKind::NativeSidecar)
            .all(|k| k.current.as_ref().is_none_or(|c| c.exit.as_ref().is_some_and(|e| e.recorded(now))));
        // Whether every sidecar after index i has exited.
        let n = kpod.containers.len();
        let mut later_ended = vec![true; n + 1];
        for i in (0..n).rev() {
            let k = &kpod.containers[i];
            let ended = k.spec.kind != ContainerKind::NativeSidecar
                || k.current.as_ref().is_none_or(|c| c.exit.as_ref().is_some_and(|e| e.recorded(now)));
            later_ended[i] = later_ended[i + 1] && ended;
        }
        for i in (0..n).rev() {
            let k = &mut kpod.containers[i];
            let Some(st) = k.stopping.as_mut() else { continue };
            let Some(inst) = k.current.as_ref().filter(|c| c.exit.is_none()) else {
                if let Some(p) = st.pre_stop.as_mut() {
                    let _ = p.kill();
                }
                k.stopping = None;
                continue;
            };
            if st.sigterm_at.is_none() {
                let hook_running = st.pre_stop.as_mut().is_some_and(|p| matches!(p.try_wait(), Ok(None)));
                let my_turn = regular_ended && later_ended[i + 1];
                if (hook_running || !my_turn) && now < st.deadline {
                    continue;
                }
                if let Some(p) = st.pre_stop.as_mut() {
                    let _ = p.kill();
                }
                // What is left of the grace period, at least the kubelet's minimum of 2 s.
                st.sigterm_at = Some(now);
                st.kill_at = Some(st.deadline.max(now + Duration::from_secs(2)));
                if let Err(e) = inst.proc_.signal(libc::SIGTERM) {
                    tracing::warn!("sim kubelet: SIGTERM to {} failed: {e:#}", k.spec.name);
                }
            } else if st.kill_at.is_some_and(|t| now >= t) {
                st.kill_at = None;
                let _ = inst.proc_.signal(libc::SIGKILL);
            }
        }
    }

    /// A PLEG relist: records what the runtime shows now.
    pub(super) fn relist(&self, kpod: &mut KPod, now: Instant) {
        kpod.recorded_now = false;
        kpod.seen_sandbox = kpod.sandbox.is_some();
        for (k, seen) in kpod.containers.iter().zip(kpod.seen.iter_mut()) {
            *seen = match &k.current {
                None => Seen {
                    id: None,
                    started: None,
                    exit: None,
                    restart_pending: false,
                    restart_count: k.restart_count,
                    last_terminated: k.last_terminated.clone(),
                },
                Some(inst) => {
                    inst.seen.store(true, Ordering::SeqCst);
                    Seen {
                        id: Some(inst.c.id.clone()),
                        started: Some(inst.started.clone()),
                        // The runtime's record: an exit not recorded yet is still running.
                        exit: inst.exit.clone().filter(|e| e.recorded(now)),
                        restart_pending: k.restart_at.is_some(),
                        restart_count: k.restart_count,
                        last_terminated: k.last_terminated.clone(),
                    }
                }
            };
        }
    }

    pub(super) fn tick(&self, now: Instant, relist: bool) {
        let held = lock(&self.writes_held_until).is_some_and(|until| now < until);
        let mut pods = lock(&self.pods);
        // One look for an exit, not a `waitpid` per container each tick (a full node's 330 of
        // them every 3 ms were a fifth of a core): a real kubelet's relist is far cheaper.
        let exits = crate::util::child_exited();
        for kpod in pods.values_mut() {
            self.step(kpod, now, exits);
            let timing = kpod.spec.status;
            let probe_changed = kpod.dirty.swap(false, Ordering::SeqCst);
            match timing {
                StatusTiming::Relist => {
                    if relist || (self.opts.evented_pleg && kpod.recorded_now) {
                        self.relist(kpod, now);
                        self.sync(kpod, now);
                        kpod.pending_write = Some(now + uniform(self.opts.status_sync_delay));
                    } else if probe_changed && kpod.pending_write.is_none() {
                        kpod.pending_write = Some(now + uniform(self.opts.status_sync_delay));
                    }
                }
                StatusTiming::AtOnce => {
                    if relist || kpod.changed {
                        self.relist(kpod, now);
                        self.sync(kpod, now);
                        kpod.pending_write = Some(now);
                    } else if probe_changed {
                        kpod.pending_write = Some(now);
                    }
                }
                StatusTiming::Manual => {
                    if relist || (self.opts.evented_pleg && kpod.recorded_now) {
                        // The kubelet still sees its containers (probes start); it writes nothing.
                        self.relist(kpod, now);
                        self.sync(kpod, now);
                    }
                }
            }
            if probe_changed {
                // A startup probe's result syncs the pod at once (the prober's update channel).
                self.sync(kpod, now);
            }
            kpod.changed = false;
            if !held && kpod.pending_write.is_some_and(|t| now >= t) {
                kpod.pending_write = None;
                // A pod object not posted yet (or deleted) gets the next relist's status.
                let _ = self.write(kpod);
            }
        }
    }

    pub(super) fn teardown(&self, mut kpod: KPod) {
        let mut all: Vec<Instance> = kpod.sandbox.take().into_iter().collect();
        for k in kpod.containers.iter_mut() {
            all.extend(k.current.take());
            all.append(&mut k.old);
        }
        for inst in &all {
            let _ = inst.proc_.kill();
            if let Some(dir) = self.bundle_dir(&kpod, &inst.c.id) {
                let _ = std::fs::remove_dir_all(dir);
            }
            // And their log links (`removeContainerLog`).
            if let Some(link) = self.log_link(&kpod, &inst.c) {
                let _ = std::fs::remove_file(link);
            }
            // The pod removed: its containers' records go with it (RemoveContainer).
            if let Some(dir) = self.record_dir(&kpod) {
                let _ = std::fs::remove_dir_all(dir.join(&inst.c.id));
            }
        }
    }
}
