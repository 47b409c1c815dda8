//! The kernel's record of the processes its exec program stopped ([`valet_common::MAP_HELD`]),
//! pinned on bpffs so that it outlives the agent. A held app is the one thing valet can make
//! worse than no agent at all: an agent killed while holding (OOM, SIGKILL, node pressure) must
//! leave its successor a list of every process it stopped, whatever happened to their pods
//! meanwhile (deleted, relabelled, stripped of their hold annotation). The program writes the
//! record before the stop; the agent drops it after the SIGCONT.

use std::path::{Path, PathBuf};
use std::sync::Mutex;
use std::time::Duration;

use aya::maps::{HashMap, Map, MapData};
use nix::sys::statfs::FsType;
use tracing::{info, warn};
use valet_common::{HeldRecord, HeldRecordV1, PIN_HELD, PIN_HELD_V1};

/// `statfs(2)`'s `f_type` of bpffs.
const BPF_FS_MAGIC: FsType = FsType(0xcafe_4a11);

/// What a keeper of held records needs of a map of them: a BPF hash map's lookup, delete and
/// walk, nothing more (tests stand in a map of their own).
pub trait HeldMap<V>: Send {
    /// Every record, by thread-group id (those that can be read).
    fn snapshot(&self) -> Vec<(u32, V)>;
    /// The record of `tgid` now; `Ok(None)`: there is none.
    fn lookup(&self, tgid: u32) -> std::result::Result<Option<V>, String>;
    /// Deletes the record of `tgid`, whatever it is.
    fn delete(&mut self, tgid: u32) -> std::result::Result<(), String>;
}

impl<V: aya::Pod + Send> HeldMap<V> for HashMap<MapData, u32, V> {
    fn snapshot(&self) -> Vec<(u32, V)> {
        // In a few calls where the kernel has batch lookups (5.6+), else walked by keys.
        match super::map_batch::lookup_all(self) {
            Ok(all) => all,
            Err(_) => self.iter().filter_map(Result::ok).collect(),
        }
    }

    fn lookup(&self, tgid: u32) -> std::result::Result<Option<V>, String> {
        match self.get(&tgid, 0) {
            Ok(v) => Ok(Some(v)),
            Err(aya::maps::MapError::KeyNotFound) => Ok(None),
            Err(e) => Err(e.to_string()),
        }
    }

    fn delete(&mut self, tgid: u32) -> std::result::Result<(), String> {
        match self.remove(&tgid) {
            Ok(()) => Ok(()),
            Err(aya::maps::MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::ENOENT) => Ok(()),
            Err(e) => Err(e.to_string()),
        }
    }
}

/// What [`forget_if`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Forgot {
    /// The record read was there and is deleted.
    Dropped,
    /// Another record has the pid now (the pid held again since it was read): kept.
    Newer,
    /// No record has the pid any more (someone else dropped it).
    Absent,
    /// The map could not be read or written: kept.
    Failed,
}

/// Deletes `tgid`'s record only if it is still `read`, the one a decision was taken on: the
/// kernel overwrites a record when the pid is held again, and that newer record must stay. BPF
/// hash maps have no compare-and-delete from user space: the record is read again right before
/// the delete. What is left is the time between the two calls (docs/dev/deadlines.md, "Records").
pub fn forget_if<V: PartialEq>(map: &mut dyn HeldMap<V>, tgid: u32, read: &V) -> Forgot {
    match map.lookup(tgid) {
        Ok(Some(now)) if now == *read => match map.delete(tgid) {
            Ok(()) => Forgot::Dropped,
            Err(e) => {
                warn!(pid = tgid, "cannot drop a held record (kept): {e}");
                Forgot::Failed
            }
        },
        Ok(Some(_)) => Forgot::Newer,
        Ok(None) => Forgot::Absent,
        Err(e) => {
            warn!(pid = tgid, "cannot read a held record again before dropping it (kept): {e}");
            Forgot::Failed
        }
    }
}

/// The held-process map, shared by the loop (which reads it) and the release thread (which
/// drops an entry once its SIGCONT is sent).
pub struct HeldLedger {
    map: Mutex<HashMap<MapData, u32, HeldRecord>>,
    pinned: Option<PathBuf>,
}

impl HeldLedger {
    pub fn new(map: HashMap<MapData, u32, HeldRecord>, pinned: Option<PathBuf>) -> HeldLedger {
        HeldLedger { map: Mutex::new(map), pinned }
    }

    /// Where the map is pinned; `None`: it dies with this agent (no bpffs could be had).
    pub fn pinned(&self) -> Option<&Path> {
        self.pinned.as_deref()
    }

    /// Every record, by thread-group id.
    pub fn records(&self) -> Vec<(u32, HeldRecord)> {
        let Ok(map) = self.map.lock() else { return Vec::new() };
        map.iter().filter_map(Result::ok).collect()
    }

    /// Whether there is no record (one key read, not the whole map).
    pub fn is_empty(&self) -> bool {
        let Ok(map) = self.map.lock() else { return true };
        map.keys().next().is_none()
    }

    pub fn get(&self, tgid: u32) -> Option<HeldRecord> {
        self.map.lock().ok()?.get(&tgid, 0).ok()
    }

    /// Moves the records of older pins into this one: version N reads version N−1's records
    /// (the [`PIN_HELD_V1`] layout, whose records get the record's time plus
    /// `default_timeout` for a deadline) and those left in an old pin directory. Each old pin is
    /// removed once its records are here. Returns how many records moved.
    pub fn migrate(&self, old_pins: &[PathBuf], default_timeout: Duration) -> usize {
        let Some(own) = self.pinned.as_deref() else { return 0 };
        let default_ns = u64::try_from(default_timeout.as_nanos()).unwrap_or(u64::MAX);
        let Ok(mut map) = self.map.lock() else { return 0 };
        let mut moved = 0;
        for path in old_pins {
            if path == own || !path.exists() {
                continue;
            }
            let v1 = path.file_name().is_some_and(|n| n == PIN_HELD_V1);
            let records: Vec<(u32, HeldRecord)> = match MapData::from_pin(path) {
                Ok(data) if v1 => match HashMap::<MapData, u32, HeldRecordV1>::try_from(Map::HashMap(data)) {
                    Ok(old) => old
                        .iter()
                        .filter_map(Result::ok)
                        .map(|(t, r)| {
                            let deadline_ns = r.ktime_ns.saturating_add(default_ns);
                            (t, HeldRecord { cgroup_id: r.cgroup_id, ktime_ns: r.ktime_ns, deadline_ns })
                        })
                        .collect(),
                    Err(e) => {
                        warn!(path = %path.display(), "an old record of held apps of another layout: {e}");
                        continue;
                    }
                },
                Ok(data) => match HashMap::<MapData, u32, HeldRecord>::try_from(Map::HashMap(data)) {
                    Ok(old) => old.iter().filter_map(Result::ok).collect(),
                    Err(e) => {
                        warn!(path = %path.display(), "an old record of held apps of another layout: {e}");
                        continue;
                    }
                },
                Err(e) => {
                    warn!(path = %path.display(), "cannot open an old record of held apps (kept): {e}");
                    continue;
                }
            };
            let mut complete = true;
            for (tgid, record) in records {
                // A record of this pin is newer (the pid held again since): it stays.
                const BPF_NOEXIST: u64 = 1;
                match map.insert(tgid, record, BPF_NOEXIST) {
                    Ok(()) => moved += 1,
                    Err(aya::maps::MapError::SyscallError(e)) if e.io_error.raw_os_error() == Some(libc::EEXIST) => {}
                    Err(e) => {
                        warn!(pid = tgid, path = %path.display(), "cannot move a held record (the old pin is kept): {e}");
                        complete = false;
                    }
                }
            }
            if complete {
                match std::fs::remove_file(path) {
                    Ok(()) => info!(path = %path.display(), "moved an older record of held apps into this one"),
                    Err(e) => warn!(path = %path.display(), "cannot remove the old record of held apps: {e}"),
                }
            }
        }
        moved
    }

    /// Drops `tgid`'s record if it is still `read` (released, gone, or another process by now):
    /// see [`forget_if`].
    pub fn forget(&self, tgid: u32, read: &HeldRecord) -> Forgot {
        match self.map.lock() {
            Ok(mut map) => forget_if(&mut *map, tgid, read),
            Err(_) => Forgot::Failed,
        }
    }

    /// Drops the record of `tgid`, a process the caller pinned (a pidfd) and just released: read
    /// now, its record is that process's own (or an older one's, stale): no other process can
    /// have the pid while it lives, and a pid freed is given again only once the kernel's pid
    /// numbers have gone round (they are handed out cyclically).
    pub fn forget_released(&self, tgid: u32) -> Forgot {
        match self.get(tgid) {
            Some(read) => self.forget(tgid, &read),
            None => Forgot::Absent,
        }
    }
}

/// Every pin a record of holds may be in, this version's first: [`PIN_HELD`] and
/// [`PIN_HELD_V1`] in `pin_dir` and in each of `old_dirs`.
pub fn pin_paths(pin_dir: &Path, old_dirs: &[PathBuf]) -> Vec<PathBuf> {
    std::iter::once(pin_dir)
        .chain(old_dirs.iter().map(PathBuf::as_path))
        .flat_map(|d| [d.join(PIN_HELD), d.join(PIN_HELD_V1)])
        .collect()
}

fn fs_type(path: &Path) -> Option<FsType> {
    nix::sys::statfs::statfs(path).ok().map(|s| s.filesystem_type())
}

/// Makes `dir` a directory on bpffs, mounting bpffs on its parent when that is the host's own
/// empty `/sys/fs/bpf` (an agent run as a host process, on a host whose init did not mount it).
/// In a DaemonSet the parent is the host's `/sys/fs/bpf` mounted into the container
/// (`/host/sys/fs/bpf`): a bpffs mounted over it would be the container's alone (a new instance,
/// in its mount namespace), its pins lost with the container and never seen by the deadline
/// keeper, so none is mounted there. `None`, with the reason logged, when it cannot be had: holds
/// then do not survive the agent.
pub fn prepare_pin_dir(dir: &Path) -> Option<PathBuf> {
    // A directory on bpffs already (made by an earlier agent, or mounted here).
    if fs_type(dir) == Some(BPF_FS_MAGIC) {
        return Some(dir.to_path_buf());
    }
    let parent = dir.parent()?;
    if fs_type(parent) != Some(BPF_FS_MAGIC) && parent == Path::new("/sys/fs/bpf") {
        match nix::mount::mount(
            Some("bpf"),
            parent,
            Some("bpf"),
            nix::mount::MsFlags::MS_NOSUID | nix::mount::MsFlags::MS_NODEV | nix::mount::MsFlags::MS_NOEXEC,
            Some("mode=0700"),
        ) {
            Ok(()) => info!(path = %parent.display(), "mounted bpffs"),
            Err(e) => warn!(path = %parent.display(), "bpffs is not mounted and mounting it failed: {e}"),
        }
    }
    if let Err(e) = std::fs::create_dir_all(dir) {
        warn!(path = %dir.display(), "cannot make the pin directory: {e}: apps held by this agent stay stopped if it dies");
        return None;
    }
    if fs_type(dir) != Some(BPF_FS_MAGIC) {
        warn!(path = %dir.display(), "the pin directory is not on bpffs: apps held by this agent stay stopped if it dies");
        return None;
    }
    Some(dir.to_path_buf())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_directory_off_bpffs_is_refused() {
        let dir = std::env::temp_dir().join(format!("valet-pin-test-{}", std::process::id()));
        assert_eq!(prepare_pin_dir(&dir.join("valet")), None, "a tmp directory is no bpffs");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_hosts_sys_fs_bpf_mounted_elsewhere_gets_no_bpffs_of_its_own() {
        // A DaemonSet's view of a node without bpffs: the host's /sys/fs/bpf (here a plain
        // directory) at /host/sys/fs/bpf. A bpffs mounted there would be the container's alone.
        let dir = std::env::temp_dir().join(format!("valet-pin-host-{}", std::process::id()));
        let parent = dir.join("host/sys/fs/bpf");
        std::fs::create_dir_all(&parent).expect("mkdir");
        let got = prepare_pin_dir(&parent.join("valet"));
        let mounted = fs_type(&parent) == Some(BPF_FS_MAGIC);
        if mounted {
            let _ = nix::mount::umount(&parent);
        }
        let _ = std::fs::remove_dir_all(&dir);
        assert!(!mounted, "bpffs was mounted over the host's directory");
        assert_eq!(got, None, "a pin directory off bpffs");
    }
}
