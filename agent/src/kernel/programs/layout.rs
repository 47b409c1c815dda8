//! The kernel's layout the programs read it through: struct offsets from the kernel's BTF, a v1
//! controller's id, and the host's pid namespace with its level.

use tracing::{debug, warn};
use valet_common::{
    GLOBAL_LAYOUT, KernelLayout, MAP_CALIBRATION, MAP_CONTAINERS, MAP_EVENTS, MAP_EXEC_CLASS, MAP_EXEC_SEEN, MAP_HELD,
    MAP_WATCHED, MAX_HOST_PIDNS_LEVEL, PROG_CALIBRATE,
};

use super::{Attach, OBJECT, map_err, memlock_hint, mount_tracefs, new_loader, tracepoint};
use crate::cgroup::root::{Controller, Hierarchy};
use crate::error::{Error, Result};
use crate::host::resident;
use crate::kernel::btf::Btf;
use crate::kernel::offsets::{find_tracefs, pidns_inum, read_layout};
use aya::maps::{Array, MapData};
use aya::programs::TracePoint;

/// The layout for this kernel (`btf_path`: its BTF) and the host's pid namespace (`attach`'s).
pub(super) fn kernel_layout(
    host_root: &std::path::Path,
    attach: &Attach,
    btf_path: &std::path::Path,
    memlock_limit: Option<u64>,
) -> Result<KernelLayout> {
    let tracefs = match find_tracefs(host_root) {
        Ok(path) => path,
        Err(e) => mount_tracefs(host_root).ok_or(e)?,
    };
    resident::note("before reading the kernel's BTF");
    let btf = Btf::from_file(btf_path)?;
    resident::note("kernel BTF read");
    let mut layout = read_layout(&btf, &tracefs)?;
    if let Hierarchy::V1(controller) = attach.hierarchy {
        layout.cgroup_v1_subsys = v1_subsys_id(&btf, &layout, controller)?;
    }
    // Megabytes, needed no more: given back before the maps and programs are made.
    drop(btf);
    resident::trim_heap();
    resident::note("kernel BTF dropped");
    host_pidns(&mut layout, attach, memlock_limit)?;
    debug!(?layout, "kernel layout from BTF");
    Ok(layout)
}

/// Sets the host's pid namespace in `layout`: its inode number and its absolute level.
fn host_pidns(layout: &mut KernelLayout, attach: &Attach, memlock_limit: Option<u64>) -> Result<()> {
    let host_ns = match attach.host_pidns_of {
        Some(pid) => format!("/proc/{pid}/ns/pid"),
        None => "/proc/self/ns/pid".to_owned(),
    };
    layout.host_pidns_inum = pidns_inum(std::path::Path::new(&host_ns))?;
    // The host's absolute level: the agent's own, from the kernel, plus how much deeper the
    // namespace standing in for the host is (tests), from its NSpid in our procfs.
    let own = pidns_inum(std::path::Path::new("/proc/self/ns/pid"))?;
    let deeper = match attach.host_pidns_of {
        Some(pid) => nspid_depth(pid)?,
        None => 0,
    };
    layout.host_pidns_level = match calibrate(layout, own, memlock_limit) {
        Ok(level) => level + deeper,
        Err(e) => {
            warn!("cannot tell the host's pid namespace level ({}): taking the kernel's initial one", e.chain());
            deeper
        }
    };
    if layout.host_pidns_level > MAX_HOST_PIDNS_LEVEL {
        return Err(Error::Ebpf(format!(
            "the host's pid namespace is {} levels deep (at most {MAX_HOST_PIDNS_LEVEL} supported)",
            layout.host_pidns_level
        )));
    }
    Ok(())
}

/// The absolute level of the pid namespace whose inode number is `inum`, which this process
/// lives in: the calibration program records it from one of our own threads' exit.
fn calibrate(layout: &KernelLayout, inum: u32, memlock_limit: Option<u64>) -> Result<u32> {
    let mut l = *layout;
    l.host_pidns_inum = inum;
    let mut loader = new_loader();
    resident::note("calibration loader made");
    loader.btf(None).override_global(GLOBAL_LAYOUT, &l, true);
    // Loading the object creates every map in it, and this program uses none of the big ones:
    // the smallest of each, so that the calibration does not double what kernels before 5.11
    // charge to RLIMIT_MEMLOCK (its maps are freed only after it, by a kernel worker).
    let page = crate::host::sys::page_size();
    for map in [MAP_WATCHED, MAP_EXEC_CLASS, MAP_EXEC_SEEN, MAP_CONTAINERS, MAP_HELD] {
        loader.map_max_entries(map, 1);
    }
    // Ring buffers: at least a page (a power of two).
    for map in [MAP_EVENTS, "AYA_LOGS"] {
        loader.map_max_entries(map, page);
    }
    let mut ebpf = loader
        .load(OBJECT)
        .map_err(|e| Error::ebpf_object(format!("load object (calibration){}", memlock_hint(memlock_limit)), e))?;
    resident::note("calibration object loaded");
    let program = tracepoint(&mut ebpf, PROG_CALIBRATE)?;
    program.load().map_err(|e| Error::ebpf_program(format!("load {PROG_CALIBRATE}"), e))?;
    let link = program
        .attach("sched", "sched_process_exit")
        .map_err(|e| Error::ebpf_program(format!("attach {PROG_CALIBRATE}"), e))?;
    let mut seen = 0;
    {
        let map = ebpf.map(MAP_CALIBRATION).ok_or_else(|| Error::Ebpf(format!("map {MAP_CALIBRATION} missing")))?;
        let array: Array<&MapData, u32> = Array::try_from(map).map_err(map_err(MAP_CALIBRATION))?;
        for _ in 0..20 {
            // A thread's exit fires the tracepoint in this process's namespace.
            let _ = std::thread::spawn(|| {}).join();
            seen = array.get(&0, 0).map_err(map_err(MAP_CALIBRATION))?;
            if seen > 0 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }
    if let Some(p) = ebpf.program_mut(PROG_CALIBRATE)
        && let Ok(p) = <&mut TracePoint>::try_from(p)
    {
        let _ = p.detach(link);
    }
    seen.checked_sub(1).ok_or_else(|| Error::Ebpf("the calibration program saw no exit of ours".into()))
}

/// How many pid namespaces below our procfs's the process `pid` lives (NSpid entries − 1).
fn nspid_depth(pid: u32) -> Result<u32> {
    crate::host::container_main::read_process(std::path::Path::new("/proc"), pid)
        .map(|p| p.nspid.len().saturating_sub(1) as u32)
        .ok_or_else(|| Error::Ebpf(format!("/proc/{pid}: no such process or no NSpid line")))
}

/// The id of a v1 controller (`enum cgroup_subsys_id` in the kernel's BTF: it depends on the
/// kernel's configuration), checked usable by the programs.
fn v1_subsys_id(btf: &Btf, layout: &KernelLayout, controller: Controller) -> Result<u32> {
    if !crate::kernel::offsets::supports_v1_hierarchy(layout) {
        return Err(Error::Ebpf(
            "cgroup v1: the kernel's BTF lacks the css_set/cgroup_subsys_state/kernfs_node offsets the programs \
             read a v1 hierarchy with"
                .into(),
        ));
    }
    let id = btf.enum_value(&controller.subsys_enumerator())?;
    if id > valet_common::MAX_CGROUP_SUBSYS {
        return Err(Error::Ebpf(format!("cgroup v1: controller {} has id {id}", controller.name())));
    }
    Ok(id)
}
