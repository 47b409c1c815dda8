//! Kernel layout facts for the kernel programs, read from the running kernel at load time:
//! struct offsets from BTF, tracepoint record offsets from tracefs format files.

use std::path::{Path, PathBuf};

use valet_common::{KernelLayout, OFFSET_UNKNOWN};

use super::btf::Btf;
use crate::error::{Error, Result};

/// Where tracefs may be mounted, in order of preference.
pub const TRACEFS_CANDIDATES: [&str; 2] = ["/sys/kernel/tracing", "/sys/kernel/debug/tracing"];

/// Finds a mounted tracefs (a directory with an `events` subdirectory).
pub fn find_tracefs(host_root: &Path) -> Result<PathBuf> {
    for candidate in TRACEFS_CANDIDATES {
        let path = host_root.join(candidate.trim_start_matches('/'));
        if path.join("events").is_dir() {
            return Ok(path);
        }
    }
    Err(Error::Ebpf("tracefs is not mounted (mount -t tracefs tracefs /sys/kernel/tracing)".into()))
}

/// Offset of `field` in a tracepoint format file's text (`field:bool group_dead; offset:32; ...`).
pub fn tracepoint_field_offset(format: &str, field: &str) -> Option<u32> {
    format.lines().find_map(|line| {
        let line = line.trim();
        let decl = line.strip_prefix("field:")?.split(';').next()?;
        let name = decl.rsplit([' ', '*']).next()?;
        let name = name.split('[').next()?;
        if name != field {
            return None;
        }
        line.split(';').find_map(|part| part.trim().strip_prefix("offset:")).and_then(|v| v.trim().parse().ok())
    })
}

/// Reads every layout fact the programs use. Missing facts become [`OFFSET_UNKNOWN`], which the
/// programs treat as "feature unavailable" (flagged in events), never as an address.
pub fn read_layout(btf: &Btf, tracefs: &Path) -> Result<KernelLayout> {
    let opt = |r: Result<u32>| r.unwrap_or(OFFSET_UNKNOWN);
    let format_path = tracefs.join("events/sched/sched_process_exit/format");
    let format =
        std::fs::read_to_string(&format_path).map_err(|e| Error::io(format!("read {}", format_path.display()), e))?;
    let layout = KernelLayout {
        task_exit_code: opt(btf.member_offset("task_struct", "exit_code")),
        task_thread_pid: opt(btf.member_offset("task_struct", "thread_pid")),
        task_signal: opt(btf.member_offset("task_struct", "signal")),
        signal_live: opt(btf.member_offset("signal_struct", "live")),
        pid_level: opt(btf.member_offset("pid", "level")),
        pid_numbers: opt(btf.member_offset("pid", "numbers")),
        upid_size: opt(btf.struct_size("upid")),
        upid_nr: opt(btf.member_offset("upid", "nr")),
        tp_exit_group_dead: tracepoint_field_offset(&format, "group_dead").unwrap_or(OFFSET_UNKNOWN),
        task_group_leader: opt(btf.member_offset("task_struct", "group_leader")),
        upid_ns: opt(btf.member_offset("upid", "ns")),
        pidns_inum: opt(btf
            .member_offset("pid_namespace", "ns")
            .and_then(|ns| Ok(ns + btf.member_offset("ns_common", "inum")?))),
        task_cgroups: opt(btf.member_offset("task_struct", "cgroups")),
        css_set_dfl_cgrp: opt(btf.member_offset("css_set", "dfl_cgrp")),
        cgroup_kn: opt(btf.member_offset("cgroup", "kn")),
        // Renamed `__parent` in 6.15 (it became RCU-protected).
        kernfs_node_parent: opt(btf
            .member_offset("kernfs_node", "parent")
            .or_else(|_| btf.member_offset("kernfs_node", "__parent"))),
        kernfs_node_id: opt(btf.member_offset("kernfs_node", "id")),
        host_pidns_level: 0,
    };
    if layout.task_exit_code == OFFSET_UNKNOWN {
        return Err(Error::Btf("task_struct.exit_code not found: cannot report exit codes".into()));
    }
    Ok(layout)
}

/// Whether the layout has every offset the cgroup ancestor walk (the `*_walk` programs) needs.
pub fn supports_ancestor_walk(layout: &KernelLayout) -> bool {
    [layout.task_cgroups, layout.css_set_dfl_cgrp, layout.cgroup_kn, layout.kernfs_node_parent, layout.kernfs_node_id]
        .iter()
        .all(|off| *off != OFFSET_UNKNOWN)
}

/// Level of the pid namespace of the process whose `/proc/<pid>/status` this is: the number of
/// `NSpid` entries minus one, counted from the pid namespace of that procfs mount. For
/// `/proc/self/status` of a process that sees its own pid namespace's procfs (the agent with
/// hostPID), that is the absolute level of the host's pid namespace (0 on a plain host, 1 on a
/// kind node).
pub fn pidns_level_from_status(status: &str) -> Option<u32> {
    let line = status.lines().find_map(|l| l.strip_prefix("NSpid:"))?;
    let entries = line.split_whitespace().filter(|p| p.parse::<u32>().is_ok()).count() as u32;
    entries.checked_sub(1)
}

/// The agent's own pid namespace level (see [`pidns_level_from_status`]).
pub fn own_pidns_level() -> Result<u32> {
    let path = "/proc/self/status";
    let status = std::fs::read_to_string(path).map_err(|e| Error::io(format!("read {path}"), e))?;
    pidns_level_from_status(&status)
        .ok_or_else(|| Error::Ebpf(format!("{path} has no NSpid line: cannot tell the host's pid namespace level")))
}

#[cfg(test)]
mod tests {
    use super::*;

    const EXIT_FORMAT: &str = "name: sched_process_exit\nID: 369\nformat:\n\
        \tfield:unsigned short common_type;\toffset:0;\tsize:2;\tsigned:0;\n\
        \tfield:int common_pid;\toffset:4;\tsize:4;\tsigned:1;\n\n\
        \tfield:char comm[16];\toffset:8;\tsize:16;\tsigned:0;\n\
        \tfield:pid_t pid;\toffset:24;\tsize:4;\tsigned:1;\n\
        \tfield:int prio;\toffset:28;\tsize:4;\tsigned:1;\n\
        \tfield:bool group_dead;\toffset:32;\tsize:1;\tsigned:0;\n";

    #[test]
    fn parses_tracepoint_offsets() {
        assert_eq!(tracepoint_field_offset(EXIT_FORMAT, "group_dead"), Some(32));
        assert_eq!(tracepoint_field_offset(EXIT_FORMAT, "pid"), Some(24));
        assert_eq!(tracepoint_field_offset(EXIT_FORMAT, "comm"), Some(8));
        assert_eq!(tracepoint_field_offset(EXIT_FORMAT, "missing"), None);
        // Older kernels: no group_dead field.
        let old = EXIT_FORMAT.replace("group_dead", "other");
        assert_eq!(tracepoint_field_offset(&old, "group_dead"), None);
        assert_eq!(tracepoint_field_offset("garbage\nfield:;;;", "x"), None);
    }

    #[test]
    fn reads_pid_namespace_levels() {
        assert_eq!(pidns_level_from_status("Name:\tsh\nNSpid:\t4242\n"), Some(0));
        assert_eq!(pidns_level_from_status("NSpid:\t4242\t17\t1\nNSpgid:\t1\n"), Some(2));
        assert_eq!(pidns_level_from_status("Name:\tsh\n"), None);
        assert_eq!(pidns_level_from_status("NSpid:\t\n"), None);
        // This test process runs somewhere; its level is whatever the kernel says, consistent
        // with /proc/self/status's NSpid.
        let level = own_pidns_level().expect("own level");
        let status = std::fs::read_to_string("/proc/self/status").expect("status");
        let nspid = status.lines().find(|l| l.starts_with("NSpid:")).expect("NSpid");
        assert_eq!(level as usize + 1, nspid.split_whitespace().count() - 1);
    }

    #[test]
    fn the_running_kernel_has_what_the_ancestor_walk_and_pid_reads_need() {
        let btf = Btf::from_sys_fs().expect("/sys/kernel/btf/vmlinux readable");
        for (name, member) in [
            ("task_struct", "cgroups"),
            ("css_set", "dfl_cgrp"),
            ("cgroup", "kn"),
            ("kernfs_node", "id"),
            ("upid", "ns"),
            ("pid_namespace", "ns"),
            ("ns_common", "inum"),
        ] {
            assert!(btf.member_offset(name, member).is_ok(), "{name}.{member}");
        }
        assert!(
            btf.member_offset("kernfs_node", "parent").is_ok() || btf.member_offset("kernfs_node", "__parent").is_ok()
        );
    }
}
