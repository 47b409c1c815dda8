//! The pinned record of held processes, as the tests read it and as earlier versions wrote it.

use std::path::Path;

use aya::maps::{HashMap as BpfHashMap, Map, MapData};
use valet_common::{HeldRecord, HeldRecordV1, PIN_HELD};

/// Every record of the pinned map in `pin_dir` (none if there is no pin).
pub fn held_records(pin_dir: &Path) -> Vec<(u32, HeldRecord)> {
    let Ok(data) = MapData::from_pin(pin_dir.join(PIN_HELD)) else { return Vec::new() };
    let Ok(map) = BpfHashMap::<MapData, u32, HeldRecord>::try_from(Map::HashMap(data)) else { return Vec::new() };
    map.iter().filter_map(Result::ok).collect()
}

/// Creates a pinned map of the previous version's layout at `path` (as valet before 36 made it).
pub fn pin_held_v1(path: &Path) -> BpfHashMap<MapData, u32, HeldRecordV1> {
    #[repr(C)]
    struct MapCreate {
        map_type: u32,
        key_size: u32,
        value_size: u32,
        max_entries: u32,
        rest: [u8; 112],
    }
    #[repr(C)]
    struct ObjPin {
        pathname: u64,
        bpf_fd: u32,
        file_flags: u32,
        rest: [u8; 112],
    }
    const BPF_MAP_CREATE: libc::c_long = 0;
    const BPF_OBJ_PIN: libc::c_long = 6;
    const BPF_MAP_TYPE_HASH: u32 = 1;
    let attr = MapCreate {
        map_type: BPF_MAP_TYPE_HASH,
        key_size: 4,
        value_size: std::mem::size_of::<HeldRecordV1>() as u32,
        max_entries: 4096,
        rest: [0; 112],
    };
    // SAFETY: a valid bpf_attr for BPF_MAP_CREATE, zero-filled past its fields.
    let fd = unsafe { libc::syscall(libc::SYS_bpf, BPF_MAP_CREATE, &attr, std::mem::size_of::<MapCreate>()) };
    assert!(fd >= 0, "BPF_MAP_CREATE: {}", std::io::Error::last_os_error());
    let cpath = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).expect("path");
    let pin = ObjPin { pathname: cpath.as_ptr() as u64, bpf_fd: fd as u32, file_flags: 0, rest: [0; 112] };
    // SAFETY: a valid bpf_attr for BPF_OBJ_PIN; the path outlives the call.
    let pinned = unsafe { libc::syscall(libc::SYS_bpf, BPF_OBJ_PIN, &pin, std::mem::size_of::<ObjPin>()) };
    assert!(pinned == 0, "BPF_OBJ_PIN {}: {}", path.display(), std::io::Error::last_os_error());
    // SAFETY: fd is ours; the pin keeps the map.
    unsafe { libc::close(fd as i32) };
    let data = MapData::from_pin(path).expect("open the v1 pin");
    BpfHashMap::try_from(Map::HashMap(data)).expect("a v1 map")
}
