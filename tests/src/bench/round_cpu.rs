//! [7]'s account of a round's CPU: every process of the bench's tree (the bench's own, with the
//! API server and kubelet stand-ins in it; the proxies, the sandboxes and the apps of the node)
//! and the agent's, each thread's `schedstat`, read just before the round's ready moment and
//! again once every app of the round ran.

use std::collections::{HashMap, HashSet};

#[allow(clippy::wildcard_imports, reason = "the bench's parts share one namespace")]
use super::*;

/// Every thread's CPU (ns) of process `pid`, summed (None: gone).
pub(crate) fn process_cpu_ns(pid: u32) -> Option<u64> {
    let dir = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    Some(
        dir.flatten()
            .filter_map(|t| t.file_name().to_str()?.parse::<u32>().ok())
            .filter_map(|tid| task_cpu_ns(pid, tid))
            .sum(),
    )
}

/// The parts of the agent's CPU [`agent_parts_ns`] tells apart.
pub(crate) const AGENT_PARTS: usize = 5;

/// The CPU (ns) of the threads of `pid` by part: the main thread (the agent's loop), the held
/// pods' prober, the runtime's workers (the API writes), the kernel event reader, the rest.
fn agent_parts_ns(pid: u32) -> [u64; AGENT_PARTS] {
    let mut parts = [0; AGENT_PARTS];
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/task")) else { return parts };
    for tid in dir.flatten().filter_map(|t| t.file_name().to_str()?.parse::<u32>().ok()) {
        let Some(ns) = task_cpu_ns(pid, tid) else { continue };
        let comm = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/comm")).unwrap_or_default();
        let part = match comm.trim_end() {
            _ if tid == pid => 0,
            "valet-held" => 1,
            "valet-worker" => 2,
            "valet-events" => 3,
            _ => 4,
        };
        parts[part] += ns;
    }
    parts
}

/// The processes under `root` (its children, theirs, and so on), `root` left out.
pub(crate) fn descendants(root: u32) -> Vec<u32> {
    let mut children: HashMap<u32, Vec<u32>> = HashMap::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else { continue };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { continue };
        // The parent is the second field after the command's closing parenthesis.
        let ppid = stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok());
        if let Some(ppid) = ppid {
            children.entry(ppid).or_default().push(pid);
        }
    }
    let (mut out, mut stack) = (Vec::new(), vec![root]);
    while let Some(p) = stack.pop() {
        for &c in children.get(&p).map_or(&[][..], Vec::as_slice) {
            out.push(c);
            stack.push(c);
        }
    }
    out
}

/// A round's CPU account, opened just before its ready moment.
pub(crate) struct RoundCpu {
    agent: u32,
    apps: HashSet<u32>,
    /// Each process of the tree (the agent and the bench left out): its CPU at the start.
    start: HashMap<u32, u64>,
    agent_start: [u64; AGENT_PARTS],
    own_start: u64,
}

/// What a round's processes spent of the CPU from its ready moment to its last app running.
#[derive(Clone, Copy, Default)]
pub(crate) struct RoundSpent {
    /// The agent's (every thread), and by part: its loop (the main thread), the held pods'
    /// prober, the runtime's workers (the API writes), the kernel event reader, the rest.
    pub(crate) agent_ns: u64,
    pub(crate) agent_parts: [u64; AGENT_PARTS],
    /// The bench's own process: the API server and kubelet stand-ins, the readers of the stamps.
    pub(crate) bench_ns: u64,
    /// The node's other processes: the proxies (their readiness, their answers to the probes),
    /// the sandboxes.
    pub(crate) others_ns: u64,
    /// The apps', from the start to the end of the account (their own start and what they did
    /// after their stamp).
    pub(crate) apps_ns: u64,
}

impl RoundCpu {
    /// Reads the tree's processes, the agent's, and last the bench's own (so that reading the
    /// others is not counted in the round).
    pub(crate) fn open(agent: u32, apps: impl IntoIterator<Item = u32>) -> RoundCpu {
        let me = std::process::id();
        let start =
            descendants(me).into_iter().filter(|p| *p != agent).filter_map(|p| Some((p, process_cpu_ns(p)?))).collect();
        let agent_start = agent_parts_ns(agent);
        let own_start = process_cpu_ns(me).unwrap_or(0);
        RoundCpu { agent, apps: apps.into_iter().collect(), start, agent_start, own_start }
    }

    /// Closes the account: the bench's own CPU is read first, then the agent's and the tree's. A
    /// process started meanwhile counts from zero; one that ended meanwhile is not counted.
    pub(crate) fn close(self) -> RoundSpent {
        let me = std::process::id();
        let bench_ns = process_cpu_ns(me).unwrap_or(0).saturating_sub(self.own_start);
        let now = agent_parts_ns(self.agent);
        let agent_parts: [u64; AGENT_PARTS] = std::array::from_fn(|i| now[i].saturating_sub(self.agent_start[i]));
        let agent_ns = agent_parts.iter().sum();
        let mut spent = RoundSpent { agent_ns, agent_parts, bench_ns, ..RoundSpent::default() };
        for p in descendants(me).into_iter().filter(|p| *p != self.agent) {
            let Some(now) = process_cpu_ns(p) else { continue };
            let ns = now.saturating_sub(self.start.get(&p).copied().unwrap_or(0));
            if self.apps.contains(&p) {
                spent.apps_ns += ns;
            } else {
                spent.others_ns += ns;
            }
        }
        spent
    }
}

/// The complete floor of a round whose apps' own starts are `own` (ns, sorted, cheapest first),
/// with `rest` ns of the round's other CPU that is not the agent's, on `cpus` CPUs: the k-th app
/// to run cannot have run sooner after the ready moment than its k cheapest apps' start and its
/// share (k of the round's n) of the rest, shared out over every CPU (µs, one per app).
pub(crate) fn complete_floor(own: &[u64], rest: u64, cpus: usize) -> Vec<f64> {
    let n = own.len().max(1) as f64;
    let mut sum = 0;
    own.iter()
        .enumerate()
        .map(|(i, c)| {
            sum += c;
            (sum as f64 + rest as f64 * (i + 1) as f64 / n) / cpus.max(1) as f64 / 1000.0
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_complete_floor_adds_each_apps_share_of_the_rest() {
        // Two apps of 1 and 3 ms, 2 ms of the proxies' and the bench's, 2 CPUs: the first
        // cannot run before (1 + 1) / 2 ms, the second before (4 + 2) / 2.
        assert_eq!(complete_floor(&[1_000_000, 3_000_000], 2_000_000, 2), vec![1000.0, 3000.0]);
        assert!(complete_floor(&[], 5, 2).is_empty());
    }

    #[test]
    fn the_tree_holds_a_child_and_its_child() {
        let mut child = std::process::Command::new("sh").args(["-c", "sleep 5 & wait"]).spawn().expect("sh");
        let pid = child.id();
        let found = eventually_found(pid);
        let _ = child.kill();
        let _ = child.wait();
        assert!(found, "the shell and its sleep under this process");
    }

    fn eventually_found(pid: u32) -> bool {
        for _ in 0..100 {
            let tree = descendants(std::process::id());
            let grandchild = tree.iter().any(|p| {
                std::fs::read_to_string(format!("/proc/{p}/stat")).is_ok_and(|s| {
                    s.rsplit_once(')').and_then(|(_, r)| r.split_whitespace().nth(1).map(str::to_owned))
                        == Some(pid.to_string())
                })
            });
            if tree.contains(&pid) && grandchild {
                return true;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        false
    }
}
