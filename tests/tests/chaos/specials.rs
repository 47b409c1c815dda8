use super::*;

impl Chaos<'_> {
    /// An upgrade across a change of record format and pin directory. The previous version's
    /// pod dies without releasing (both containers SIGKILLed: an OOM kill or a node crash
    /// during the update), its records left as that version wrote them: `held_v1` (no
    /// deadline) in its own pin directory. The new version's containers start with
    /// `--old-pin-dir` naming it; every held app must still run by its deadline (the one the
    /// kernel recorded before the upgrade), and none before it is allowed.
    pub(crate) fn upgrade(&mut self, agent: &mut Agent) {
        self.tally.upgrades += 1;
        // At least one app held across it: of a pod still holding it (its hold annotation on,
        // its proxy not ready: a disruption may have changed either before its app started).
        if let Some(&i) = self.placed_unstarted(|p| p.hold && !p.ready).first() {
            self.start_app(i);
            let pid = self.pods[i].app;
            let ran = self.pods[i].ran.clone();
            eventually(GUARD, || pid.is_some_and(|p| state(p) == Some('T')) || ran.exists());
        }
        // Every held app's deadline is read from the record before it loses it.
        self.observe(Some(agent));
        let killed_ns = monotonic_ns();
        agent.stop(libc::SIGKILL, GUARD).expect("kill the agent");
        if let Some(mut keeper) = self.keeper.take() {
            keeper.kill();
        }
        self.count_in_flight(killed_ns);
        let pin_dir = self.node.pin_dir().to_path_buf();
        // On bpffs, where a name may not hold a dot.
        let mut old_dir = pin_dir.clone().into_os_string();
        old_dir.push(format!("-previous{}", self.tally.upgrades));
        let old_dir = PathBuf::from(old_dir);
        self.old_pin_dirs.push(old_dir.clone());
        std::fs::create_dir_all(&old_dir).expect("the previous version's pin directory");
        let records = pins::held_records(&pin_dir);
        let mut v1 = pins::pin_held_v1(&old_dir.join(PIN_HELD_V1));
        for (pid, r) in &records {
            v1.insert(pid, HeldRecordV1 { cgroup_id: r.cgroup_id, ktime_ns: r.ktime_ns }, 0).expect("a v1 record");
        }
        drop(v1);
        if pin_dir.join(PIN_HELD).exists() {
            std::fs::remove_file(pin_dir.join(PIN_HELD)).expect("unpin the new format's map");
        }
        self.tally.upgraded_records += records.len();
        self.agent_args = vec!["--old-pin-dir".into(), old_dir.display().to_string()];
        // The new version's deadline keeper, with the old pin directory too.
        self.start_keeper();
    }

    /// The pods the agent has placed (probed its proxy) whose app has not started, of
    /// those `also` takes; one is made, and waited for, if there is none.
    pub(crate) fn placed_unstarted(&mut self, also: impl Fn(&Pod) -> bool) -> Vec<usize> {
        let candidate = |c: &Self, i: usize| {
            let p = &c.pods[i];
            !p.deleted && p.labelled && !p.failed && p.app.is_none() && also(p) && placed(c.node, &p.job)
        };
        let mut found: Vec<usize> = (0..self.pods.len()).filter(|&i| candidate(self, i)).collect();
        if found.is_empty() {
            self.new_pod();
            let i = self.pods.len() - 1;
            eventually(GUARD, || candidate(self, i));
            if candidate(self, i) {
                found.push(i);
            }
        }
        found
    }

    /// A full record map, as a leak would leave it: with the agent running, the pinned map is
    /// filled to capacity with records of pids no process can have (above the kernel's
    /// `PID_MAX_LIMIT`), and the apps of the pods the agent has placed start at once. A hold the
    /// kernel cannot record must not be made: each app runs at once, or (the agent's sweep
    /// freed room first) is held with a record. An app stopped with no record is counted.
    pub(crate) fn fill_record_map(&mut self) {
        const PID_MAX_LIMIT: u32 = 4 * 1024 * 1024;
        self.tally.map_fills += 1;
        let pin = self.node.pin_dir().join(PIN_HELD);
        let data = aya::maps::MapData::from_pin(&pin).expect("the pinned record");
        let mut map: aya::maps::HashMap<aya::maps::MapData, u32, HeldRecord> =
            aya::maps::HashMap::try_from(aya::maps::Map::HashMap(data)).expect("the record map");
        let now = monotonic_ns();
        let filler = HeldRecord { cgroup_id: 0, ktime_ns: now, deadline_ns: now + 3_600_000_000_000 };
        let mut key = PID_MAX_LIMIT + 1;
        while map.insert(key, filler, 0).is_ok() {
            key += 1;
            assert!(key < PID_MAX_LIMIT + 2 * HELD_CAPACITY, "the record map took more than its capacity");
        }
        let placed = self.placed_unstarted(|_| true);
        for i in placed {
            self.start_app(i);
            self.tally.started_into_full_map += 1;
            let (pid, ran) = (self.pods[i].app, self.pods[i].ran.clone());
            eventually(GUARD, || pid.is_some_and(|p| state(p) == Some('T')) || ran.exists());
            let stopped = pid.is_some_and(|p| state(p) == Some('T'));
            if !stopped && ran.exists() {
                // Ran unheld: allowed, the kernel could not record a hold.
                self.tally.ran_unheld += 1;
                let pod = &mut self.pods[i];
                pod.allowed_ns = pod.started_ns;
            } else if stopped && pid.is_some_and(|p| record(self.node.pin_dir(), p).is_none()) {
                self.tally.held_without_record += 1;
                self.pods[i].failed = true;
                println!("VIOLATION held without a record: {} (app {pid:?})", self.pods[i].name());
            }
        }
        // The agent's sweep drops the records of processes that do not exist; until it has,
        // apps run unheld, so the next turn starts none before (a map that stayed full would
        // end every hold on the node: counted).
        let pin_dir = self.node.pin_dir().to_path_buf();
        let cleared = Instant::now() + GUARD;
        while pins::held_records(&pin_dir).iter().any(|(pid, _)| *pid > PID_MAX_LIMIT) {
            if Instant::now() > cleared {
                self.tally.full_map_kept += 1;
                println!("VIOLATION full map kept: the agent had not dropped the records of no process {GUARD:?} on");
                break;
            }
            self.wait_observing(Duration::from_millis(50), None);
        }
    }

    /// A crash loop: the agent is started and killed before it is ready 5 times, each start
    /// delayed as the kubelet's backoff delays it (1, 2, 4, 4, 4 × `backoff`).
    pub(crate) fn crash_loop(&mut self, backoff: Duration) {
        self.tally.crash_loops += 1;
        for factor in [1, 2, 4, 4, 4] {
            self.wait_observing(backoff * factor, None);
            let mut agent = self.spawn();
            let typical = self.tally.startups.last().copied().unwrap_or(Duration::from_millis(300));
            let before = self.rng.millis(typical.as_millis() as u64 / 2);
            self.wait_observing(before, Some(&agent));
            agent.stop(libc::SIGKILL, GUARD).expect("kill the starting agent");
            self.tally.kills += 1;
            self.tally.startup_kills += 1;
        }
    }

    /// A restart into an API outage: every request is answered 503 for [`OUTAGE`]; the agent
    /// comes up meanwhile. Returns it ready, once the API is back.
    pub(crate) fn restart_into_outage(&mut self) -> (Agent, Instant, u64) {
        self.tally.outages += 1;
        self.node.api.set_fault(Fault::Status { code: 503, verbs: Vec::new(), until: Some(Instant::now() + OUTAGE) });
        let spawned = Instant::now();
        let agent = self.spawn();
        self.wait_observing(OUTAGE, Some(&agent));
        self.node.api.clear_faults();
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            self.observe(Some(&agent));
            let ok =
                valet_sim::client::get(agent.metrics, "/readyz", Duration::from_secs(2)).is_ok_and(|r| r.status == 200);
            if ok {
                break;
            }
            assert!(Instant::now() < deadline, "the agent was not ready 90 s after the outage:\n{}", agent.log_text());
            std::thread::sleep(Duration::from_millis(5));
        }
        let (ready_at, ready_ns) = (Instant::now(), monotonic_ns());
        println!("chaos: outage: the agent was ready {:?} after its start", ready_at - spawned);
        self.tally.restarts += 1;
        (agent, ready_at, ready_ns)
    }

    /// An uninstall: the DaemonSet deleted (background: gone at once), its pod deleted by the
    /// garbage collector, both containers SIGTERMed; no successor comes, so every app must run
    /// within 2 s. Then a fresh install: the DaemonSet, its new pod and its deadline keeper (the
    /// caller starts the agent).
    pub(crate) fn uninstall(&mut self, agent: &mut Agent) {
        self.tally.uninstalls += 1;
        let held: Vec<(usize, u32)> = (0..self.pods.len())
            .filter_map(|i| self.pods[i].app.filter(|&p| state(p) == Some('T')).map(|p| (i, p)))
            .collect();
        self.tally.held_at_uninstall += held.len();
        // Every hold may end now: the uninstall releases them.
        for pod in &mut self.pods {
            if pod.app.is_some() {
                pod.allow_release();
            }
        }
        let api = &self.node.api;
        api.delete_object(Kind::DaemonSet, Some(AGENT_NAMESPACE), AGENT_DAEMONSET, Propagation::Background)
            .expect("delete the DaemonSet");
        api.begin_pod_deletion(AGENT_NAMESPACE, &self.pod, None).expect("delete the agent's pod");
        let mut keeper = self.keeper.take().expect("a keeper runs");
        signal(keeper.pid(), libc::SIGTERM);
        let status = agent.stop(libc::SIGTERM, GUARD).expect("SIGTERM the agent");
        assert!(status.is_some_and(|s| s.success()), "the agent's exit at SIGTERM: {status:?}\n{}", agent.log_text());
        keeper.stop().expect("the deadline keeper's exit");
        let root = self.cgroup_root.clone();
        let gone = Instant::now() + RUN_WITHIN;
        for (i, pid) in held {
            while stuck(&root, pid) && Instant::now() < gone {
                std::thread::sleep(Duration::from_millis(5));
            }
            if stuck(&root, pid) {
                self.tally.left_by_uninstall += 1;
                self.pods[i].failed = true;
                println!("VIOLATION uninstall: {} left stopped after both containers exited", self.pods[i].name());
            }
        }
        let _ = api.delete_pod(AGENT_NAMESPACE, &self.pod);
        self.node.install_daemonset().expect("install again");
        self.pod = self.node.daemonset_pod().expect("the new install's pod");
        self.start_keeper();
    }
}
