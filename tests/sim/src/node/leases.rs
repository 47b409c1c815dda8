//! What sim pods leave on the host for their cleanup: the state directories, and each pod's lease
//! (its dirs, netns and veth), reaped once its owner process is gone.
use std::path::PathBuf;
use std::process::{Command, Stdio};

use serde_json::Value;

use super::*;
use crate::util;

/// Where the simulated node keeps host-wide state shared by test processes (leases, subnet
/// claims, the ipam lock): on a tmpfs like a node's `/run` ([`util::state_base`]).
pub fn sim_state_dir() -> PathBuf {
    util::state_base().join("valet-sim")
}

/// Subnet claims, one file per claimed `10.244.N.0/24`.
pub fn subnet_dir() -> PathBuf {
    sim_state_dir().join("subnets")
}

/// Leases: what each pod created, for [`reap_stale_leases`].
pub fn lease_dir() -> PathBuf {
    sim_state_dir().join("leases")
}

/// Field 22 of /proc/PID/stat (start time in clock ticks): tells a live owner from a recycled pid.
pub(super) fn process_start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name may contain spaces and parentheses: count fields after the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// Removes what sim pods of dead processes left behind (a test killed by a timeout, say).
pub fn reap_stale_leases() {
    let Ok(entries) = std::fs::read_dir(lease_dir()) else {
        return;
    };
    for e in entries.flatten() {
        let path = e.path();
        let Ok(text) = std::fs::read_to_string(&path) else {
            continue;
        };
        let Ok(lease) = serde_json::from_str::<Value>(&text) else {
            let _ = std::fs::remove_file(&path);
            continue;
        };
        let pid = lease["pid"].as_u64().unwrap_or(0) as u32;
        let alive = pid != 0 && process_start_time(pid).is_some() && process_start_time(pid) == lease["start"].as_u64();
        if alive {
            continue;
        }
        let paths = |k: &str| -> Vec<PathBuf> {
            lease[k]
                .as_array()
                .map(|a| a.iter().filter_map(Value::as_str).map(PathBuf::from).collect())
                .unwrap_or_default()
        };
        for d in paths("dirs").iter().rev() {
            remove_tree(d);
        }
        for d in paths("shared").iter().rev() {
            // Only goes if empty: other pods may still live there.
            let _ = std::fs::remove_dir(d);
        }
        if let Some(ns) = lease["netns"].as_str() {
            let _ = Command::new("ip").args(["netns", "del", ns]).stderr(Stdio::null()).status();
        }
        if let Some(h) = lease["host_if"].as_str() {
            let _ = Command::new("ip").args(["link", "del", h]).stderr(Stdio::null()).status();
        }
        let _ = std::fs::remove_file(&path);
    }
}
