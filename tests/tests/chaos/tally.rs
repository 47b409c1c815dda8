use super::*;

/// Violations and what the run covered.
#[derive(Default)]
pub(crate) struct Tally {
    pub(crate) kills: usize,
    pub(crate) startup_kills: usize,
    pub(crate) restarts: usize,
    pub(crate) pods: usize,
    pub(crate) startups: Vec<Duration>,
    pub(crate) held_at_kill: [usize; 2],
    /// Disruptions made while the agent was down, by kind (see [`DISRUPTIONS`]).
    pub(crate) disrupted: [usize; 5],
    pub(crate) quits_in_flight: usize,
    pub(crate) conditions_in_flight: usize,
    pub(crate) disrupted_held: Vec<(Disruption, Pidns)>,
    pub(crate) should_run: usize,
    pub(crate) left_stopped: usize,
    pub(crate) quits: usize,
    pub(crate) early_quits: usize,
    pub(crate) owed_quits: usize,
    pub(crate) late_quits: usize,
    pub(crate) conditions_checked: usize,
    pub(crate) false_conditions: usize,
    /// Held apps whose deadline the test read from the kernel's record.
    pub(crate) deadlines_known: usize,
    /// Apps still stopped more than 2 s past their deadline.
    pub(crate) past_deadline: usize,
    /// Releases judged, and those that came before the app's proxy was ready, its pod stopped
    /// holding it and its deadline.
    pub(crate) releases_judged: usize,
    pub(crate) early_releases: usize,
    /// Releases that came at the deadline (neither ready nor let go before it).
    pub(crate) deadline_releases: usize,
    pub(crate) outages: usize,
    pub(crate) crash_loops: usize,
    pub(crate) uninstalls: usize,
    /// Apps held at an uninstall, and those still stopped 2 s after it.
    pub(crate) held_at_uninstall: usize,
    pub(crate) left_by_uninstall: usize,
    /// Upgrades across a change of record format and pin directory, and the records they
    /// carried over.
    pub(crate) upgrades: usize,
    pub(crate) upgraded_records: usize,
    /// Times the record map was filled, apps started into it, and those that ran unheld.
    pub(crate) map_fills: usize,
    pub(crate) started_into_full_map: usize,
    pub(crate) ran_unheld: usize,
    /// Apps stopped with no record to release them by (must be 0).
    pub(crate) held_without_record: usize,
    /// Full maps the agent did not clear of records of processes that do not exist (must be 0).
    pub(crate) full_map_kept: usize,
    /// Stops and faults made, by kind (see [`STOPS`]).
    pub(crate) stops: [usize; 7],
    /// SIGTERMs the agent exited 0 at, exited otherwise at (counted: it must exit 0), and
    /// containers SIGKILLed at the end of their grace period.
    pub(crate) graceful_exits: usize,
    pub(crate) bad_exits: usize,
    pub(crate) killed_at_grace: usize,
    /// Liveness restarts of a hung (SIGSTOPped) agent.
    pub(crate) hung: usize,
    pub(crate) rollouts: usize,
    pub(crate) surges: usize,
    /// Read faults, the held apps whose cgroup they made unreadable, the releases that fell
    /// due during one, and those that spanned an agent restart.
    pub(crate) read_faults: usize,
    pub(crate) read_faulted_apps: usize,
    pub(crate) read_fault_releases_due: usize,
    pub(crate) read_fault_restarts: usize,
    /// Pid reuses tried, made (the new held app got the old one's host pid), and made while
    /// the old app's record was still in the map.
    pub(crate) pid_reuses_tried: usize,
    pub(crate) pids_reused: usize,
    pub(crate) reused_over_old_record: usize,
    /// Apps seen stopped with their record gone (must be 0).
    pub(crate) records_lost: usize,
}

impl Tally {
    /// Prints what the run covered and every count.
    pub(crate) fn print(&self, seed: u64, elapsed: Duration, backoff: Duration) {
        let t = self;
        let mut startups = t.startups.clone();
        startups.sort_unstable();
        let held_kinds = |k: Pidns| {
            DISRUPTIONS
                .iter()
                .map(|d| format!("{d:?} {}", t.disrupted_held.iter().filter(|(x, p)| x == d && *p == k).count()))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let stops: Vec<String> = STOPS.iter().zip(t.stops).map(|(s, n)| format!("{s:?} {n}")).collect();
        println!(
            "chaos: seed {seed}: {} disruptions ({}; {} kills during startup), {} restarts, {} pods, {elapsed:?}; \
             agent ready {:?} after its start (median), {:?} (slowest)",
            t.kills,
            stops.join(", "),
            t.startup_kills,
            t.restarts,
            t.pods,
            startups.get(startups.len() / 2).copied().unwrap_or_default(),
            startups.last().copied().unwrap_or_default(),
        );
        println!(
            "chaos: at the stops: apps held {} in their own pid namespace, {} in a shared one; {} quits and {} \
             ProxyReady True writes owed; while the agent was down: {}; of them to pods of held apps, in their own \
             pid namespace: {}; in a shared one: {}",
            t.held_at_kill[0],
            t.held_at_kill[1],
            t.quits_in_flight,
            t.conditions_in_flight,
            DISRUPTIONS.iter().map(|d| format!("{d:?} {}", t.disrupted[*d as usize])).collect::<Vec<_>>().join(", "),
            held_kinds(Pidns::Own),
            held_kinds(Pidns::Shared)
        );
        println!(
            "chaos: SIGTERMs: {} exits 0, {} other exits, {} containers SIGKILLed at their grace period's end ({} \
             hung agents); {} rollouts without surge, {} with; read faults: {} ({} apps, {} releases due during one, \
             {} across a restart); pid reuse: {} tried, {} made ({} over the old app's record)",
            t.graceful_exits,
            t.bad_exits,
            t.killed_at_grace,
            t.hung,
            t.rollouts,
            t.surges,
            t.read_faults,
            t.read_faulted_apps,
            t.read_fault_releases_due,
            t.read_fault_restarts,
            t.pid_reuses_tried,
            t.pids_reused,
            t.reused_over_old_record
        );
        self.print_counts(backoff);
    }

    fn print_counts(&self, backoff: Duration) {
        let t = self;
        println!(
            "apps run before their proxy was ready: {} (of {} releases judged against the stand-in's readiness; {} \
             at the deadline)",
            t.early_releases, t.releases_judged, t.deadline_releases
        );
        println!(
            "apps left stopped more than 2 s past their deadline: {} (of {} held apps whose deadline was read)",
            t.past_deadline, t.deadlines_known
        );
        println!(
            "records lost while their app stayed stopped: {} (of {} held apps)",
            t.records_lost, t.deadlines_known
        );
        println!(
            "apps left stopped or frozen 2 s after the agent was back: {} (of {} that should run)",
            t.left_stopped, t.should_run
        );
        println!("quits sent before an app's end: {} (of {} quits)", t.early_quits, t.quits);
        println!(
            "finished Jobs not quit within 1 s of the agent's restart: {} (of {} owed)",
            t.late_quits, t.owed_quits
        );
        println!(
            "conditions left saying something false: {} (of {} checked)",
            t.false_conditions, t.conditions_checked
        );
        println!("agents not exiting 0 at a SIGTERM: {}", t.bad_exits);
        println!(
            "apps left stopped by an uninstall: {} (of {} held at {} uninstalls); {} restarts into a {OUTAGE:?} API \
             outage, {} crash loops (backoff unit {backoff:?})",
            t.left_by_uninstall, t.held_at_uninstall, t.uninstalls, t.outages, t.crash_loops
        );
        println!(
            "upgrades across a record format and pin directory change: {} ({} records carried over); full record \
             maps: {} ({} apps started into one, {} ran unheld; not cleared: {}); apps stopped with no record: {}",
            t.upgrades,
            t.upgraded_records,
            t.map_fills,
            t.started_into_full_map,
            t.ran_unheld,
            t.full_map_kept,
            t.held_without_record
        );
    }

    /// Every count that must be 0, named.
    pub(crate) fn violations(&self) -> Vec<(&'static str, usize)> {
        let t = self;
        vec![
            ("run before their proxy was ready", t.early_releases),
            ("past deadline", t.past_deadline),
            ("records lost", t.records_lost),
            ("left stopped", t.left_stopped),
            ("early quits", t.early_quits),
            ("late quits", t.late_quits),
            ("false conditions", t.false_conditions),
            ("bad SIGTERM exits", t.bad_exits),
            ("left by an uninstall", t.left_by_uninstall),
            ("held without a record", t.held_without_record),
            ("full map kept", t.full_map_kept),
        ]
    }
}
