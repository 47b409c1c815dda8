use super::*;

pub(crate) struct Chaos<'a> {
    pub(crate) node: &'a Node,
    pub(crate) rng: Rng,
    pub(crate) pods: Vec<Pod>,
    pub(crate) tally: Tally,
    pub(crate) cgroup_root: PathBuf,
    pub(crate) serial: usize,
    /// Kills the run makes in all.
    pub(crate) kills: usize,
    /// CLOCK_REALTIME − CLOCK_MONOTONIC.
    pub(crate) offset: i128,
    /// Flags every agent start gets (after an upgrade: the previous version's pin directory).
    pub(crate) agent_args: Vec<String>,
    /// The previous versions' pin directories the upgrades made (removed at the end).
    pub(crate) old_pin_dirs: Vec<PathBuf>,
    /// The agent's DaemonSet pod the containers run in now (`POD_NAME`).
    pub(crate) pod: String,
    /// Its second container, `valet-agent deadlines`.
    pub(crate) keeper: Option<DeadlineKeeper>,
    /// `setpriv` runs each container with the capabilities the manifest gives it, no more (no
    /// `CAP_DAC_OVERRIDE`: a cgroup its owner made unreadable is unreadable to valet too).
    pub(crate) agent_caps: Vec<String>,
    pub(crate) keeper_caps: Vec<String>,
}

impl Chaos<'_> {
    pub(crate) fn spawn(&self) -> Agent {
        let args: Vec<&str> = self.agent_args.iter().map(String::as_str).collect();
        self.node.spawn_agent_in_under(&self.pod, &self.agent_caps, &args).expect("start the agent")
    }

    /// Starts the pod's deadline keeper (after an upgrade: with the old pin directory too).
    pub(crate) fn start_keeper(&mut self) {
        let args: Vec<&str> = self.agent_args.iter().map(String::as_str).collect();
        let keeper = self.node.start_deadline_keeper_in_under(&self.pod, &self.keeper_caps, &args);
        self.keeper = Some(keeper.expect("start the deadline keeper"));
    }

    pub(crate) fn new_pod(&mut self) {
        self.serial += 1;
        // Alternating, so every kill finds both kinds in the population.
        let pidns = if self.serial.is_multiple_of(2) { Pidns::Own } else { Pidns::Shared };
        let tag = format!("{}{}", if pidns == Pidns::Own { "own" } else { "shared" }, self.serial);
        let ready_file = self.node.scratch.path(&format!("{tag}.ready"));
        let ran = self.node.scratch.path(&format!("{tag}.ran"));
        let end = self.node.scratch.path(&format!("{tag}.end"));
        let fifo = std::ffi::CString::new(end.as_os_str().as_bytes()).expect("path");
        // SAFETY: a valid C string.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0, "mkfifo {}", end.display());
        let timeout = Duration::from_secs(HOLD_TIMEOUTS.0 + self.rng.below(HOLD_TIMEOUTS.1 - HOLD_TIMEOUTS.0 + 1));
        let mut spec = JobSpec::new(&format!("chaos-{tag}"))
            .annotation(HOLD, "true")
            .annotation("valet.dev/hold-timeout", &format!("{}s", timeout.as_secs()));
        spec.share_process_namespace = pidns == Pidns::Shared;
        spec.ready_file = Some(ready_file.clone());
        // The stand-in binds a listener once its ready file appears and answers ready only
        // then; it logs that moment (`READY`), taken before its first ready answer.
        spec.listen_when_ready = Some(15006);
        let job = self.node.job_pod(spec).expect("pod");
        self.tally.pods += 1;
        self.pods.push(Pod {
            job,
            pidns,
            ready_file,
            ran,
            end,
            app: None,
            ready: false,
            ended_ns: None,
            labelled: true,
            hold: true,
            deleted: false,
            age: 0,
            failed: false,
            timeout,
            started_ns: None,
            deadline_ns: None,
            allowed_ns: None,
            release_judged: false,
            late_counted: false,
            lost_counted: false,
            read_faulted: false,
        });
    }

    pub(crate) fn start_app(&mut self, i: usize) {
        self.start_app_as(i, None);
    }

    /// Starts pod `i`'s app; with `host_pid`, asks for that (free) host pid.
    pub(crate) fn start_app_as(&mut self, i: usize, host_pid: Option<u32>) {
        let pod = &mut self.pods[i];
        pod.started_ns = Some(monotonic_ns());
        let script = format!("echo ran > {}; read line < {}; exit 0", pod.ran.display(), pod.end.display());
        // Own: pid 1 of its own pid namespace. Shared: as runc starts a container of a
        // shareProcessNamespace pod, in its own cgroup, in the sandbox's pid namespace, where
        // the pause is pid 1.
        let join = (pod.pidns == Pidns::Shared).then(|| format!("/proc/{}/ns/pid", pod.job.pause.host_pid()).into());
        let opts = SpawnOptions { join_pid_namespace: join, host_pid, ..Default::default() };
        let app = pod.job.start_app("app", &["/bin/sh", "-c", &script], &opts).expect("start the app");
        pod.app = Some(app.host_pid());
    }

    /// The agent's log lines about a pod, for a violation's report.
    pub(crate) fn log_about(agent: &Agent, pod: &Pod) -> String {
        let text = agent.log_text();
        // Lines naming the pod, or its app's pid (a release names only the pid).
        let pid = pod.app.map(|p| format!("pid={p} "));
        let lines: Vec<&str> =
            text.lines().filter(|l| l.contains(pod.name()) || pid.as_ref().is_some_and(|p| l.contains(p))).collect();
        if lines.is_empty() {
            return "(it names neither the pod nor its app's pid)".into();
        }
        lines[lines.len().saturating_sub(15)..].join("\n")
    }

    /// One turn while the agent runs: pods advance a step each, at random (the kill lands right
    /// after the turn, or later). Whether an app was let end.
    pub(crate) fn advance(&mut self) -> bool {
        let mut ends = Vec::new();
        for i in 0..self.pods.len() {
            let pod = &self.pods[i];
            if pod.deleted || !pod.labelled || pod.failed || !self.rng.chance(65) {
                continue;
            }
            if pod.app.is_none() {
                // The agent has placed the pod (probed its proxy): the kernel holds the app's
                // first exec.
                if placed(self.node, &pod.job) {
                    self.start_app(i);
                    // Its exec is done (held, or run) before the turn goes on: a kill right
                    // after the turn finds it held, never on its way to the exec.
                    let (pid, ran) = (self.pods[i].app, self.pods[i].ran.clone());
                    eventually(GUARD, || pid.is_some_and(|p| state(p) == Some('T')) || ran.exists());
                }
            } else if !pod.ready && pod.hold {
                self.pods[i].make_ready();
            } else if pod.ended_ns.is_none() && pod.app_ran() {
                ends.push(i);
            }
        }
        // Ends last, so that a kill right after the turn finds their quits in flight.
        for &i in &ends {
            self.pods[i].end_app();
        }
        !ends.is_empty()
    }

    /// Counts what the agent had in hand when it was killed (at `killed_ns`): held apps by kind,
    /// quits owed and not received, ready proxies whose condition did not say so yet.
    pub(crate) fn count_in_flight(&mut self, killed_ns: u64) {
        for pod in &self.pods {
            if let Some(pid) = pod.app
                && state(pid) == Some('T')
            {
                self.tally.held_at_kill[pod.pidns as usize] += 1;
            }
            if pod.owed_quit() && !pod.job.loopback_quits().iter().any(|q| q.mono_ns < killed_ns) {
                self.tally.quits_in_flight += 1;
            }
            if pod.ready && pod.labelled && !pod.deleted && condition(self.node, &pod.job).as_deref() != Some("True") {
                self.tally.conditions_in_flight += 1;
            }
        }
    }

    /// While the agent is down: `kind` happens to one pod (one with a held app when there is
    /// one), and now and then something else to others.
    pub(crate) fn disrupt(&mut self, kind: Disruption) {
        let fits = |p: &Pod| !p.failed && p.can(kind);
        let held = |p: &Pod| p.app.is_some_and(|pid| state(pid) == Some('T'));
        let candidates: Vec<usize> = (0..self.pods.len()).filter(|&i| fits(&self.pods[i])).collect();
        let held_ones: Vec<usize> = candidates.iter().copied().filter(|&i| held(&self.pods[i])).collect();
        let pool = if held_ones.is_empty() { &candidates } else { &held_ones };
        if pool.is_empty() {
            return;
        }
        let i = pool[self.rng.below(pool.len() as u64) as usize];
        if held(&self.pods[i]) {
            self.tally.disrupted_held.push((kind, self.pods[i].pidns));
        }
        self.apply(i, kind);
        for j in 0..self.pods.len() {
            if j != i && !self.pods[j].failed && self.rng.chance(10) {
                let other = DISRUPTIONS[self.rng.below(DISRUPTIONS.len() as u64) as usize];
                self.apply(j, other);
            }
        }
    }

    pub(crate) fn apply(&mut self, i: usize, kind: Disruption) {
        let node = self.node;
        let pod = &mut self.pods[i];
        if !pod.can(kind) {
            return;
        }
        self.tally.disrupted[kind as usize] += 1;
        if matches!(kind, Disruption::Deleted | Disruption::Unlabelled | Disruption::Unannotated) {
            pod.allow_release();
        }
        match kind {
            // Gone from the API at once (a forced delete); its processes live on until the
            // pod is retired, as the kubelet takes its time to kill them.
            Disruption::Deleted => {
                node.api.delete_pod("jobs", pod.name()).expect("delete");
                pod.deleted = true;
            }
            Disruption::Unlabelled => {
                node.api
                    .modify_pod("jobs", pod.name(), |p| {
                        if let Some(l) = p["metadata"]["labels"].as_object_mut() {
                            l.remove(LABEL);
                        }
                    })
                    .expect("relabel");
                pod.labelled = false;
            }
            Disruption::Unannotated => {
                node.api
                    .modify_pod("jobs", pod.name(), |p| {
                        if let Some(a) = p["metadata"]["annotations"].as_object_mut() {
                            a.remove(HOLD);
                        }
                    })
                    .expect("annotate");
                pod.hold = false;
            }
            Disruption::ProxyReady => pod.make_ready(),
            Disruption::AppEnded => {
                pod.end_app();
            }
        }
    }

    /// Starts the agent as its DaemonSet would after a crash; sometimes kills it again before it
    /// is ready (a crash during recovery). Returns the ready agent and when it answered ready.
    pub(crate) fn restart(&mut self) -> (Agent, Instant, u64) {
        loop {
            let spawned = Instant::now();
            let mut agent = self.spawn();
            if self.tally.kills < self.kills && self.rng.chance(15) {
                let typical = self.tally.startups.last().copied().unwrap_or(Duration::from_millis(300));
                std::thread::sleep(self.rng.millis(typical.as_millis() as u64));
                agent.stop(libc::SIGKILL, GUARD).expect("kill the starting agent");
                self.tally.kills += 1;
                self.tally.startup_kills += 1;
                continue;
            }
            // Polled every 5 ms: the criteria count from this moment.
            let deadline = Instant::now() + Duration::from_secs(60);
            loop {
                let ok = valet_sim::client::get(agent.metrics, "/readyz", Duration::from_secs(2))
                    .is_ok_and(|r| r.status == 200);
                if ok {
                    break;
                }
                assert!(Instant::now() < deadline, "the agent was not ready in 60 s:\n{}", agent.log_text());
                std::thread::sleep(Duration::from_millis(5));
            }
            let (ready_at, ready_ns) = (Instant::now(), monotonic_ns());
            self.tally.startups.push(ready_at - spawned);
            self.tally.restarts += 1;
            return (agent, ready_at, ready_ns);
        }
    }
}
