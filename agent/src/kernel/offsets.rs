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
        kernfs_node_name: opt(btf.member_offset("kernfs_node", "name")),
        host_pidns_inum: 0,
        host_pidns_level: 0,
        tp_sock_newstate: OFFSET_UNKNOWN,
        tp_sock_sport: OFFSET_UNKNOWN,
        tp_sock_protocol: OFFSET_UNKNOWN,
        css_set_subsys: opt(btf.member_offset("css_set", "subsys")),
        css_cgroup: opt(btf.member_offset("cgroup_subsys_state", "cgroup")),
        cgroup_v1_subsys: valet_common::CGROUP_V2,
    };
    // The listen tracepoint (4.16+): without its format, no listen events (the probes still poll).
    let mut layout = layout;
    if let Ok(format) = std::fs::read_to_string(tracefs.join("events/sock/inet_sock_set_state/format")) {
        let at = |field| tracepoint_field_offset(&format, field).unwrap_or(OFFSET_UNKNOWN);
        (layout.tp_sock_newstate, layout.tp_sock_sport, layout.tp_sock_protocol) =
            (at("newstate"), at("sport"), at("protocol"));
    }
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

/// Whether the layout has what reading a task's cgroup in a v1 hierarchy needs
/// (`task->cgroups->subsys[id]->cgroup->kn`, then the ancestor walk).
pub fn supports_v1_hierarchy(layout: &KernelLayout) -> bool {
    supports_ancestor_walk(layout) && layout.css_set_subsys != OFFSET_UNKNOWN && layout.css_cgroup != OFFSET_UNKNOWN
}

/// Inode number of a pid namespace from its `/proc/<pid>/ns/pid` link (`pid:[4026531836]`).
pub fn pidns_inum(link: &Path) -> Result<u32> {
    let target = std::fs::read_link(link).map_err(|e| Error::io(format!("readlink {}", link.display()), e))?;
    parse_pidns_link(&target.to_string_lossy())
        .ok_or_else(|| Error::Ebpf(format!("{}: unexpected link {}", link.display(), target.display())))
}

fn parse_pidns_link(target: &str) -> Option<u32> {
    target.strip_prefix("pid:[")?.strip_suffix(']')?.parse().ok()
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
    fn reads_pid_namespace_links() {
        assert_eq!(parse_pidns_link("pid:[4026531836]"), Some(4026531836));
        assert_eq!(parse_pidns_link("net:[4026531836]"), None);
        assert_eq!(parse_pidns_link("pid:[x]"), None);
        let own = pidns_inum(Path::new("/proc/self/ns/pid")).expect("own pid namespace");
        assert!(own > 0);
        assert!(pidns_inum(Path::new("/proc/self/ns/nope")).is_err());
    }

    #[test]
    fn the_running_kernel_has_what_the_ancestor_walk_pid_reads_and_cgroup_names_need() {
        let btf = Btf::from_sys_fs().expect("/sys/kernel/btf/vmlinux readable");
        for (name, member) in [
            ("task_struct", "cgroups"),
            ("css_set", "dfl_cgrp"),
            ("cgroup", "kn"),
            ("kernfs_node", "id"),
            ("css_set", "subsys"),
            ("cgroup_subsys_state", "cgroup"),
            ("kernfs_node", "name"),
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
