//! Loads valet's kernel programs (embedded in the binary by `build.rs`), attaches them, and
//! gives user space typed handles on their maps.

use aya::{
    Ebpf, EbpfLoader,
    maps::{HashMap, MapData, PerCpuArray, RingBuf},
    programs::{TracePoint, trace_point::TracePointLinkId},
};
use tracing::{debug, info, warn};
use valet_common::{
    Counter, EXEC_CLASS_HOLD, EXEC_CLASS_PASS, GLOBAL_LAYOUT, KernelLayout, MAP_COUNTERS, MAP_EVENTS, MAP_EXEC_CLASS,
    MAP_EXEC_SEEN, MAP_WATCHED, PROG_EXEC, PROG_EXIT,
};

use super::btf::Btf;
use super::layout::{find_tracefs, read_layout};
use crate::error::{Error, Result};

/// The BPF object built from `agent-ebpf`, aligned for the loader.
static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/valet-agent-ebpf"));

/// Which programs to attach.
#[derive(Clone, Copy, Debug)]
pub struct Attach {
    pub exits: bool,
    pub execs: bool,
}

impl Default for Attach {
    fn default() -> Self {
        Attach { exits: true, execs: true }
    }
}

/// Loaded and attached programs plus their maps. Dropping it detaches everything.
pub struct Programs {
    ebpf: Ebpf,
    watched: HashMap<MapData, u64, u32>,
    exec_class: HashMap<MapData, u64, u32>,
    exec_seen: HashMap<MapData, u64, u8>,
    counters: PerCpuArray<MapData, u64>,
    events: Option<RingBuf<MapData>>,
    logger: Option<aya_log::EbpfLogger<&'static dyn log::Log>>,
    layout: KernelLayout,
    links: Vec<(&'static str, TracePointLinkId)>,
}

fn map_err(what: &str) -> impl FnOnce(aya::maps::MapError) -> Error + '_ {
    move |e| Error::ebpf_map(format!("map {what}"), e)
}

impl Programs {
    /// Reads the kernel layout, loads the object and attaches the requested tracepoints.
    /// `host_root` is where the host's `/sys` is visible (`/` outside a container).
    pub fn load(host_root: &std::path::Path, attach: Attach) -> Result<Programs> {
        raise_memlock_limit();
        let tracefs = match find_tracefs(host_root) {
            Ok(path) => path,
            Err(e) => mount_tracefs(host_root).ok_or(e)?,
        };
        let btf_path = host_root.join("sys/kernel/btf/vmlinux");
        let btf = Btf::from_file(&btf_path)?;
        let layout = read_layout(&btf, &tracefs)?;
        debug!(?layout, "kernel layout from BTF");

        let mut ebpf = EbpfLoader::new()
            .override_global(GLOBAL_LAYOUT, &layout, true)
            .load(OBJECT)
            .map_err(|e| Error::ebpf_object("load object", e))?;

        // Kernel-side diagnostics go to our log; the logger must outlive the programs.
        let logger = match aya_log::EbpfLogger::init(&mut ebpf) {
            Ok(logger) => Some(logger),
            Err(e) => {
                debug!("kernel log channel unavailable: {e}");
                None
            }
        };

        let mut links = Vec::new();
        for (enabled, prog, category, name) in [
            (attach.exits, PROG_EXIT, "sched", "sched_process_exit"),
            (attach.execs, PROG_EXEC, "sched", "sched_process_exec"),
        ] {
            if !enabled {
                continue;
            }
            let program: &mut TracePoint = ebpf
                .program_mut(prog)
                .ok_or_else(|| Error::Ebpf(format!("program {prog} missing from object")))?
                .try_into()
                .map_err(|e| Error::ebpf_program(format!("program {prog}"), e))?;
            program.load().map_err(|e| Error::ebpf_program(format!("load {prog}"), e))?;
            let link = program
                .attach(category, name)
                .map_err(|e| Error::ebpf_program(format!("attach {prog} to {category}/{name}"), e))?;
            links.push((prog, link));
        }

        let take = |ebpf: &mut Ebpf, name: &str| {
            ebpf.take_map(name).ok_or_else(|| Error::Ebpf(format!("map {name} missing from object")))
        };
        let watched = HashMap::try_from(take(&mut ebpf, MAP_WATCHED)?).map_err(map_err(MAP_WATCHED))?;
        let exec_class = HashMap::try_from(take(&mut ebpf, MAP_EXEC_CLASS)?).map_err(map_err(MAP_EXEC_CLASS))?;
        let exec_seen = HashMap::try_from(take(&mut ebpf, MAP_EXEC_SEEN)?).map_err(map_err(MAP_EXEC_SEEN))?;
        let counters = PerCpuArray::try_from(take(&mut ebpf, MAP_COUNTERS)?).map_err(map_err(MAP_COUNTERS))?;
        let events = RingBuf::try_from(take(&mut ebpf, MAP_EVENTS)?).map_err(map_err(MAP_EVENTS))?;
        info!(
            attached = ?links.iter().map(|(p, _)| *p).collect::<Vec<_>>(),
            group_dead_field = layout.tp_exit_group_dead != valet_common::OFFSET_UNKNOWN,
            "kernel programs attached"
        );
        Ok(Programs { ebpf, watched, exec_class, exec_seen, counters, events: Some(events), logger, layout, links })
    }

    /// The layout the programs were loaded with.
    pub fn layout(&self) -> &KernelLayout {
        &self.layout
    }

    /// Hands out the event ring buffer (once) for [`super::events::EventStream`].
    pub fn take_events(&mut self) -> Option<RingBuf<MapData>> {
        self.events.take()
    }

    /// Hands out the kernel log channel (once), to be drained by [`drain_kernel_log`].
    pub fn take_logger(&mut self) -> Option<aya_log::EbpfLogger<&'static dyn log::Log>> {
        self.logger.take()
    }

    /// Starts watching a cgroup (and everything below it) with the given
    /// [`valet_common::watch_flags`].
    pub fn watch(&mut self, cgroup_id: u64, flags: u32) -> Result<()> {
        self.watched.insert(cgroup_id, flags, 0).map_err(map_err(MAP_WATCHED))
    }

    /// Stops watching a cgroup. Unknown ids are fine.
    pub fn unwatch(&mut self, cgroup_id: u64) -> Result<()> {
        match self.watched.remove(&cgroup_id) {
            Ok(()) | Err(aya::maps::MapError::KeyNotFound) => Ok(()),
            Err(e) => Err(map_err(MAP_WATCHED)(e)),
        }
    }

    /// Tells the exec program, before a container starts, whether its first init exec is held.
    pub fn classify_exec(&mut self, container_cgroup_id: u64, hold: bool) -> Result<()> {
        let class = if hold { EXEC_CLASS_HOLD } else { EXEC_CLASS_PASS };
        self.exec_class.insert(container_cgroup_id, class, 0).map_err(map_err(MAP_EXEC_CLASS))
    }

    /// Forgets a container cgroup in the exec maps (it was removed).
    pub fn forget_exec(&mut self, container_cgroup_id: u64) {
        let _ = self.exec_class.remove(&container_cgroup_id);
        let _ = self.exec_seen.remove(&container_cgroup_id);
    }

    /// Whether the exec program already judged this container's first init exec.
    pub fn exec_seen(&self, container_cgroup_id: u64) -> bool {
        self.exec_seen.get(&container_cgroup_id, 0).is_ok()
    }

    /// Currently watched cgroup ids.
    pub fn watched(&self) -> Vec<(u64, u32)> {
        self.watched.iter().filter_map(|r| r.ok()).collect()
    }

    /// Sum over CPUs of a kernel counter.
    pub fn counter(&self, counter: Counter) -> u64 {
        match self.counters.get(&(counter as u32), 0) {
            Ok(values) => values.iter().sum(),
            Err(e) => {
                warn!("read kernel counter {counter:?}: {e}");
                0
            }
        }
    }

    /// Names of attached programs.
    pub fn attached(&self) -> Vec<&'static str> {
        self.links.iter().map(|(p, _)| *p).collect()
    }

    /// Detaches every program now (also done on drop).
    pub fn detach(&mut self) {
        for (prog, link) in self.links.drain(..) {
            if let Some(Ok(p)) = self.ebpf.program_mut(prog).map(<&mut TracePoint>::try_from)
                && let Err(e) = p.detach(link)
            {
                warn!("detach {prog}: {e}");
            }
        }
    }
}

/// Drains the kernel log channel into our log until the task is dropped.
pub async fn drain_kernel_log(logger: aya_log::EbpfLogger<&'static dyn log::Log>) {
    // SAFETY: the logger owns its ring buffer fd and keeps it open while registered.
    let registered = unsafe { tokio::io::unix::AsyncFd::register_with_interest(logger, tokio::io::Interest::READABLE) };
    let Ok(mut fd) = registered else {
        warn!("kernel log channel cannot be polled");
        return;
    };
    loop {
        match fd.readable_mut().await {
            Ok(mut guard) => {
                guard.get_inner_mut().flush();
                guard.clear_ready();
            }
            Err(e) => {
                warn!("kernel log channel: {e}");
                return;
            }
        }
    }
}

/// Tracepoints are attached by id, read from tracefs. A host that never mounted it (tracing
/// tools mount it on first use) gets it mounted at its standard place, as they would.
fn mount_tracefs(host_root: &std::path::Path) -> Option<std::path::PathBuf> {
    let target = host_root.join("sys/kernel/tracing");
    let mounted = nix::mount::mount(
        Some("tracefs"),
        &target,
        Some("tracefs"),
        nix::mount::MsFlags::MS_NOSUID | nix::mount::MsFlags::MS_NODEV | nix::mount::MsFlags::MS_NOEXEC,
        None::<&str>,
    );
    match mounted {
        Ok(()) if target.join("events").is_dir() => {
            info!(path = %target.display(), "mounted tracefs");
            Some(target)
        }
        Ok(()) => None,
        Err(e) => {
            warn!(path = %target.display(), "tracefs is not mounted and mounting it failed: {e}");
            None
        }
    }
}

/// BPF maps are charged to the memlock rlimit on kernels before 5.11; lift it.
fn raise_memlock_limit() {
    let limit = libc::rlimit { rlim_cur: libc::RLIM_INFINITY, rlim_max: libc::RLIM_INFINITY };
    // SAFETY: plain syscall with a valid pointer.
    if unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &limit) } != 0 {
        debug!("setrlimit(RLIMIT_MEMLOCK) failed: {}", std::io::Error::last_os_error());
    }
}

impl Drop for Programs {
    fn drop(&mut self) {
        self.detach();
    }
}
