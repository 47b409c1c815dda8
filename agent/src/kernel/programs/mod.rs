//! Loads valet's kernel programs (embedded in the binary by `build.rs`), attaches them, and
//! gives user space typed handles on their maps.

use aya::{
    Ebpf, EbpfLoader,
    maps::{HashMap, MapData, PerCpuArray, RingBuf},
    programs::{TracePoint, trace_point::TracePointLinkId},
};
use tracing::{debug, info, warn};
use valet_common::{
    ContainerMain, Counter, EXEC_CLASS_HOLD, EXEC_CLASS_PASS, GLOBAL_LAYOUT, KernelLayout, MAP_CONTAINERS,
    MAP_COUNTERS, MAP_EVENTS, MAP_EXEC_CLASS, MAP_EXEC_SEEN, MAP_HELD, MAP_WATCHED, PIN_HELD, PROG_EXEC,
    PROG_EXEC_WALK, PROG_EXIT, PROG_EXIT_WALK, container_flags,
};

use super::held_ledger::{HeldLedger, prepare_pin_dir};
use super::loader::loader_without_kernel_btf;
use super::offsets::supports_ancestor_walk;
use crate::cgroup::root::Hierarchy;
use crate::error::{Error, Result};
use crate::host::container_main::MainProcess;
use crate::host::resident;

mod layout;
mod listen;
mod memlock;
use listen::attach_listen;
pub use memlock::BpfMemlock;
use memlock::{memlock_hint, raise_memlock_limit};

/// The BPF object built from `agent-ebpf`, aligned for the loader.
static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/valet-agent-ebpf"));

/// A loader for [`OBJECT`], made without aya parsing the kernel's BTF where this process can
/// (see [`loader_without_kernel_btf`]).
fn new_loader() -> EbpfLoader<'static> {
    let (loader, fell_back) = loader_without_kernel_btf();
    if let Some(why) = fell_back {
        warn!("the BPF loader parsed the kernel's BTF ({why}): the agent's memory peaks ~20 MiB higher while loading");
    }
    loader
}

/// The tracepoint program `prog` of the object (an error when the object has none by that name).
fn tracepoint<'a>(ebpf: &'a mut Ebpf, prog: &str) -> Result<&'a mut TracePoint> {
    ebpf.program_mut(prog)
        .ok_or_else(|| Error::Ebpf(format!("program {prog} missing from object")))?
        .try_into()
        .map_err(|e| Error::ebpf_program(format!("program {prog}"), e))
}

/// How the kernel programs find the pod cgroup above a process's own cgroup (`--cgroup-ancestors`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum AncestorMode {
    /// The helper variant when the kernel allows it (5.11+ for tracepoints), else the walk.
    Auto,
    /// `bpf_get_current_ancestor_cgroup_id`.
    Helper,
    /// A walk up `cgroup->kn->parent` with probe reads and offsets from BTF (5.10).
    Walk,
}

/// Where the kernel's own BTF is, below the host root.
pub const KERNEL_BTF: &str = "sys/kernel/btf/vmlinux";

/// Which programs to attach, and how they find pod cgroups.
#[derive(Clone, Copy, Debug)]
pub struct Attach {
    pub exits: bool,
    pub execs: bool,
    /// `Auto` in production; tests force each variant.
    pub ancestors: AncestorMode,
    /// A process whose pid namespace counts as the host's. `None` in production: the agent's
    /// own (it runs with hostPID). Tests use it to simulate a kind node's namespace.
    pub host_pidns_of: Option<u32>,
    /// The hierarchy whose cgroup ids the programs report and look up: the one the agent found
    /// the kubelet's cgroups in. A v1 controller's is read by the walk alone.
    pub hierarchy: Hierarchy,
}

impl Default for Attach {
    fn default() -> Self {
        Attach {
            exits: true,
            execs: true,
            ancestors: AncestorMode::Auto,
            host_pidns_of: None,
            hierarchy: Hierarchy::V2,
        }
    }
}

/// What [`Programs::record_container_main`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecordOutcome {
    /// The record is in the kernel now.
    Recorded,
    /// The kernel had a record already (its exec program saw the main process's exec); kept.
    AlreadyRecorded,
    /// The map is full: that container's main exit will not be reported as such. Raise it.
    MapFull,
}

/// Loaded and attached programs plus their maps. Dropping it detaches everything.
pub struct Programs {
    ebpf: Ebpf,
    watched: HashMap<MapData, u64, u32>,
    exec_class: HashMap<MapData, u64, u32>,
    exec_seen: HashMap<MapData, u64, u8>,
    containers: HashMap<MapData, u64, ContainerMain>,
    counters: PerCpuArray<MapData, u64>,
    held: std::sync::Arc<HeldLedger>,
    events: Option<RingBuf<MapData>>,
    logger: Option<aya_log::EbpfLogger<&'static dyn log::Log>>,
    layout: KernelLayout,
    ancestors: AncestorMode,
    links: Vec<(&'static str, TracePointLinkId)>,
}

fn map_err(what: &str) -> impl FnOnce(aya::maps::MapError) -> Error + '_ {
    move |e| Error::ebpf_map(format!("map {what}"), e)
}

/// What loading made beside the maps: the kernel log channel, the layout the programs read, the
/// way they find pod cgroups and their links.
struct Loaded {
    logger: Option<aya_log::EbpfLogger<&'static dyn log::Log>>,
    layout: KernelLayout,
    ancestors: AncestorMode,
    links: Vec<(&'static str, TracePointLinkId)>,
}

/// The object loaded with `layout`, its record of held apps pinned at `pin` where it can be (the
/// pin it got: `None` when it could not be pinned, which is logged).
fn load_object(
    layout: &KernelLayout,
    pin: Option<std::path::PathBuf>,
    memlock_limit: Option<u64>,
) -> Result<(Ebpf, Option<std::path::PathBuf>)> {
    let load = |pin: Option<&std::path::Path>| {
        let mut loader = new_loader();
        resident::note("loader made");
        // The programs read the kernel through offsets in LAYOUT (from our own BTF reader):
        // no CO-RE relocation needs the kernel's BTF.
        loader.btf(None).override_global(GLOBAL_LAYOUT, layout, true);
        if let Some(pin) = pin {
            loader.map_pin_path(MAP_HELD, pin);
        }
        loader.load(OBJECT)
    };
    let failed = |e| Error::ebpf_object(format!("load object{}", memlock_hint(memlock_limit)), e);
    match load(pin.as_deref()) {
        Ok(ebpf) => Ok((ebpf, pin)),
        Err(e) if pin.is_some() => {
            // Holds that do not survive the agent beat no holds at all.
            warn!("cannot pin the record of held apps ({e}): apps held when this agent dies stay stopped");
            Ok((load(None).map_err(failed)?, None))
        }
        Err(e) => Err(failed(e)),
    }
}

/// The exit and exec programs of one way to find pod cgroups, with their tracepoints, as far as
/// `attach` asks for them.
fn wanted(attach: &Attach, mode: AncestorMode) -> Vec<(&'static str, &'static str)> {
    let (exit, exec) =
        if mode == AncestorMode::Walk { (PROG_EXIT_WALK, PROG_EXEC_WALK) } else { (PROG_EXIT, PROG_EXEC) };
    [(attach.exits, exit, "sched_process_exit"), (attach.execs, exec, "sched_process_exec")]
        .into_iter()
        .filter(|(enabled, ..)| *enabled)
        .map(|(_, prog, tp)| (prog, tp))
        .collect()
}

/// Loads the programs of the first way to find pod cgroups that `attach` allows and the kernel
/// accepts; that way.
fn load_programs(ebpf: &mut Ebpf, attach: &Attach, layout: &KernelLayout) -> Result<AncestorMode> {
    let walk_possible = supports_ancestor_walk(layout);
    let candidates: &[AncestorMode] = match (attach.ancestors, attach.hierarchy) {
        (AncestorMode::Helper, Hierarchy::V1(_)) => {
            return Err(Error::Config(
                "--cgroup-ancestors helper: the helper reads only the cgroup v2 hierarchy, and this node's \
                 pods are in a v1 one (the programs walk it)"
                    .into(),
            ));
        }
        (_, Hierarchy::V1(_)) | (AncestorMode::Walk, _) => &[AncestorMode::Walk],
        (AncestorMode::Auto, Hierarchy::V2) => &[AncestorMode::Helper, AncestorMode::Walk],
        (AncestorMode::Helper, Hierarchy::V2) => &[AncestorMode::Helper],
    };
    let mut refusals = Vec::new();
    for &mode in candidates {
        if mode == AncestorMode::Walk && !walk_possible {
            refusals.push("cgroup walk: the kernel's BTF lacks css_set/cgroup/kernfs_node offsets".to_owned());
            continue;
        }
        let mut loaded = Ok(());
        for (prog, _) in wanted(attach, mode) {
            let program = tracepoint(ebpf, prog)?;
            if let Err(e) = program.load() {
                loaded = Err(format!("load {prog}: {e}"));
                break;
            }
        }
        match loaded {
            Ok(()) => return Ok(mode),
            Err(e) => {
                if candidates.len() > 1 {
                    info!("{e}; trying the next way to find pod cgroups");
                }
                refusals.push(e);
            }
        }
    }
    Err(Error::Ebpf(format!("no program variant loads on this kernel: {}", refusals.join("; "))))
}

/// Attaches the loaded programs of `ancestors` to their tracepoints, and the listen program.
fn attach_programs(
    ebpf: &mut Ebpf,
    attach: &Attach,
    layout: &KernelLayout,
    ancestors: AncestorMode,
) -> Result<Vec<(&'static str, TracePointLinkId)>> {
    let mut links = Vec::new();
    for (prog, name) in wanted(attach, ancestors) {
        let program = tracepoint(ebpf, prog)?;
        let link = program
            .attach("sched", name)
            .map_err(|e| Error::ebpf_program(format!("attach {prog} to sched/{name}"), e))?;
        links.push((prog, link));
    }
    // Listening sockets of held pods: attached for the agent's life (listen.rs says why not
    // only while a pod holds). An addition to the probes' poll, so a kernel that refuses it
    // costs only that (logged).
    if attach.execs {
        match attach_listen(ebpf, layout, ancestors) {
            Ok(link) => links.push(link),
            Err(e) => warn!("no listen events (held apps are released by the 10 ms probe alone): {e}"),
        }
    }
    Ok(links)
}

impl Programs {
    /// Reads the kernel layout and the host's pid namespace (the agent's own: it runs with
    /// hostPID), loads the object and attaches the requested tracepoints.
    /// `host_root` is where the host's `/sys` is visible (`/` outside a container).
    pub fn load(host_root: &std::path::Path, attach: Attach) -> Result<Programs> {
        Programs::load_pinned(host_root, attach, None)
    }

    /// [`Programs::load`], with the held-process map pinned in `pin_dir` (on bpffs, made or
    /// mounted if need be; an existing pin is taken over with the records an earlier agent
    /// left). Without a usable directory the map is not pinned, and that is logged.
    pub fn load_pinned(
        host_root: &std::path::Path,
        attach: Attach,
        pin_dir: Option<&std::path::Path>,
    ) -> Result<Programs> {
        Programs::load_with_btf(host_root, attach, pin_dir, &host_root.join(KERNEL_BTF))
    }

    /// [`Programs::load_pinned`] with the kernel's struct offsets read from `btf_path` (a BTF
    /// file for this kernel where the kernel has none of its own, e.g. from BTFHub).
    pub fn load_with_btf(
        host_root: &std::path::Path,
        attach: Attach,
        pin_dir: Option<&std::path::Path>,
        btf_path: &std::path::Path,
    ) -> Result<Programs> {
        let memlock_limit = raise_memlock_limit();
        let layout = layout::kernel_layout(host_root, &attach, btf_path, memlock_limit)?;
        let pin = pin_dir.and_then(prepare_pin_dir).map(|dir| dir.join(PIN_HELD));
        let (mut ebpf, pinned) = load_object(&layout, pin, memlock_limit)?;
        resident::note("object loaded");
        // Kernel-side diagnostics go to our log; the logger must outlive the programs.
        let logger = match aya_log::EbpfLogger::init(&mut ebpf) {
            Ok(logger) => Some(logger),
            Err(e) => {
                debug!("kernel log channel unavailable: {e}");
                None
            }
        };
        let ancestors = load_programs(&mut ebpf, &attach, &layout)?;
        let links = attach_programs(&mut ebpf, &attach, &layout, ancestors)?;
        resident::note("programs attached");
        let programs = Programs::with_maps(ebpf, pinned, Loaded { logger, layout, ancestors, links })?;
        programs.log_attached(&attach, memlock_limit);
        Ok(programs)
    }

    /// The loaded object's maps taken out, typed.
    fn with_maps(mut ebpf: Ebpf, pinned: Option<std::path::PathBuf>, loaded: Loaded) -> Result<Programs> {
        let take = |ebpf: &mut Ebpf, name: &str| {
            ebpf.take_map(name).ok_or_else(|| Error::Ebpf(format!("map {name} missing from object")))
        };
        let watched = HashMap::try_from(take(&mut ebpf, MAP_WATCHED)?).map_err(map_err(MAP_WATCHED))?;
        let exec_class = HashMap::try_from(take(&mut ebpf, MAP_EXEC_CLASS)?).map_err(map_err(MAP_EXEC_CLASS))?;
        let exec_seen = HashMap::try_from(take(&mut ebpf, MAP_EXEC_SEEN)?).map_err(map_err(MAP_EXEC_SEEN))?;
        let containers = HashMap::try_from(take(&mut ebpf, MAP_CONTAINERS)?).map_err(map_err(MAP_CONTAINERS))?;
        let counters = PerCpuArray::try_from(take(&mut ebpf, MAP_COUNTERS)?).map_err(map_err(MAP_COUNTERS))?;
        let events = RingBuf::try_from(take(&mut ebpf, MAP_EVENTS)?).map_err(map_err(MAP_EVENTS))?;
        let held = HashMap::try_from(take(&mut ebpf, MAP_HELD)?).map_err(map_err(MAP_HELD))?;
        let held = std::sync::Arc::new(HeldLedger::new(held, pinned));
        Ok(Programs {
            ebpf,
            watched,
            exec_class,
            exec_seen,
            containers,
            counters,
            held,
            events: Some(events),
            logger: loaded.logger,
            layout: loaded.layout,
            ancestors: loaded.ancestors,
            links: loaded.links,
        })
    }

    /// What was loaded and attached, and the BPF memory it takes.
    fn log_attached(&self, attach: &Attach, memlock_limit: Option<u64>) {
        let memlock = BpfMemlock::of_this_process();
        info!(
            maps = memlock.maps,
            map_kib = memlock.map_bytes / 1024,
            programs = memlock.programs,
            program_kib = memlock.program_bytes / 1024,
            rlimit_memlock_kib = ?memlock_limit.map(|b| b / 1024),
            "BPF memory (fdinfo memlock; kernels before 5.11 charge it to RLIMIT_MEMLOCK)"
        );
        let layout = &self.layout;
        info!(
            attached = ?self.attached(),
            group_dead_field = layout.tp_exit_group_dead != valet_common::OFFSET_UNKNOWN,
            host_pidns_inum = layout.host_pidns_inum,
            host_pidns_level = layout.host_pidns_level,
            ancestors = ?self.ancestors,
            hierarchy = ?attach.hierarchy,
            held_pinned = ?self.held.pinned(),
            held_left = self.held.records().len(),
            "kernel programs attached"
        );
    }

    /// How the loaded programs find pod cgroups: [`AncestorMode::Helper`] or
    /// [`AncestorMode::Walk`] (never `Auto`).
    pub fn ancestor_mode(&self) -> AncestorMode {
        self.ancestors
    }

    /// Inode number of the pid namespace the programs take for the host's.
    pub fn host_pidns_inum(&self) -> u32 {
        self.layout.host_pidns_inum
    }

    /// The layout the programs were loaded with.
    pub fn layout(&self) -> &KernelLayout {
        &self.layout
    }

    /// The record of processes stopped at exec (shared with the release thread).
    pub fn held_ledger(&self) -> std::sync::Arc<HeldLedger> {
        self.held.clone()
    }

    /// Hands out the event ring buffer (once) for [`super::ring::EventStream`].
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

    /// Forgets everything the kernel keeps about a container cgroup (its main process record,
    /// its exec judgement and class). Call it when the pod's work is done or the cgroup is gone;
    /// never for a running container of a watched pod: its next deeper-than-host exec would be
    /// taken for a new main process.
    pub fn forget_container(&mut self, container_cgroup_id: u64) {
        let _ = self.containers.remove(&container_cgroup_id);
        let _ = self.exec_class.remove(&container_cgroup_id);
        let _ = self.exec_seen.remove(&container_cgroup_id);
    }

    /// Whether this container's main process already exec'd (recorded by the exec program or
    /// adopted), so its exec can no longer be held.
    pub fn exec_seen(&self, container_cgroup_id: u64) -> bool {
        self.containers.get(&container_cgroup_id, 0).is_ok() || self.exec_seen.get(&container_cgroup_id, 0).is_ok()
    }

    /// The kernel's record of a container's main process, if any.
    pub fn container_main(&self, container_cgroup_id: u64) -> Option<ContainerMain> {
        self.containers.get(&container_cgroup_id, 0).ok()
    }

    /// Records the main process of a container found already running (its exec happened before
    /// its pod was watched, e.g. before an agent restart), so its exit is reported as the
    /// container's end and nothing else in it is. `main` comes from
    /// [`crate::host::container_main::find_container_main`] (pids and levels relative to the host's
    /// pid namespace). Adopt a pod's running containers *before* [`Programs::watch`] of the pod:
    /// once watched, the next deeper-than-host exec in an unrecorded container (an exec probe, a
    /// `kubectl exec`) would be recorded as its main process. A record the kernel already has wins.
    pub fn record_container_main(&mut self, container_cgroup_id: u64, main: &MainProcess) -> Result<RecordOutcome> {
        let record = ContainerMain {
            tgid: main.tgid,
            pidns_depth: main.ns_depth,
            pidns_inum: main.pidns_inum,
            flags: container_flags::ADOPTED | if main.ns_init { container_flags::NS_INIT } else { 0 },
            ktime_ns: 0,
        };
        const BPF_NOEXIST: u64 = 1;
        match self.containers.insert(container_cgroup_id, record, BPF_NOEXIST) {
            Ok(()) => Ok(RecordOutcome::Recorded),
            Err(aya::maps::MapError::SyscallError(e)) => match e.io_error.raw_os_error() {
                Some(libc::EEXIST) => Ok(RecordOutcome::AlreadyRecorded),
                Some(libc::E2BIG) | Some(libc::ENOMEM) => Ok(RecordOutcome::MapFull),
                _ => Err(Error::ebpf_map(format!("map {MAP_CONTAINERS}"), aya::maps::MapError::SyscallError(e))),
            },
            Err(e) => Err(map_err(MAP_CONTAINERS)(e)),
        }
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
    let registered = crate::host::sys::readable(logger);
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

impl Drop for Programs {
    fn drop(&mut self) {
        self.detach();
    }
}
