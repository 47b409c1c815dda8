//! A BPF hash map read whole in a few `bpf(2)` calls (`BPF_MAP_LOOKUP_BATCH`, Linux 5.6+), not
//! two calls per entry as a walk by keys makes: the deadline keeper reads its record of holds
//! four times a second, and with 110 held apps the walk's 220 calls a pass were most of its CPU.

use std::io;

use aya::maps::{HashMap, MapData};

use crate::host::sys::{bpf_map_lookup_batch, read_pod};

/// Entries asked for at a time; doubled when a hash bucket holds more (`ENOSPC`).
const CHUNK: usize = 256;
/// A bucket of more entries than this is no map of ours: the caller walks it by keys instead.
const CHUNK_MAX: usize = 1 << 16;

/// Every entry of `map`. Err: the kernel has no batch lookup for it (older than 5.6:
/// `EINVAL`), or another error; the caller walks the map by keys then.
pub fn lookup_all<V: aya::Pod>(map: &HashMap<MapData, u32, V>) -> io::Result<Vec<(u32, V)>> {
    let size = size_of::<V>();
    let mut out = Vec::new();
    let mut chunk = CHUNK;
    let mut from = None;
    loop {
        let mut keys = vec![0u32; chunk];
        let mut values = vec![0u8; chunk * size];
        let read = match bpf_map_lookup_batch(map, from, &mut keys, &mut values) {
            Ok(read) => read,
            // A bucket holds more entries than asked for: ask again for more from the same place.
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) && chunk < CHUNK_MAX => {
                chunk *= 2;
                continue;
            }
            Err(e) => return Err(e),
        };
        for (key, value) in keys.iter().zip(values.chunks_exact(size)).take(read.count) {
            out.push((*key, read_pod(value).ok_or_else(|| io::Error::other("short value"))?));
        }
        if read.end {
            return Ok(out);
        }
        from = Some(read.next);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use aya::maps::Map;
    use valet_common::HeldRecord;

    /// A hash map of `u32` → `HeldRecord` made by `BPF_MAP_CREATE`, as the kernel programs'.
    fn map(max: u32) -> HashMap<MapData, u32, HeldRecord> {
        let fd = crate::host::sys::bpf_hash_map_create(4, size_of::<HeldRecord>() as u32, max).expect("BPF_MAP_CREATE");
        let data = MapData::from_fd(fd).expect("map data");
        HashMap::try_from(Map::HashMap(data)).expect("a hash map")
    }

    fn record(i: u32) -> HeldRecord {
        HeldRecord { cgroup_id: u64::from(i) * 7, ktime_ns: u64::from(i) << 20, deadline_ns: u64::from(i) + 1 }
    }

    /// What a walk by keys reads, sorted, against the batch's, sorted: the same entries, each
    /// once, for an empty map, one entry, and more entries than a chunk holds.
    #[test]
    fn a_batch_reads_what_a_walk_by_keys_reads() {
        for n in [0u32, 1, 3, CHUNK as u32 * 5 + 17] {
            let mut m = map(4096);
            for i in 0..n {
                m.insert(1000 + i, record(i), 0).expect("insert");
            }
            let mut walked: Vec<(u32, HeldRecord)> = m.iter().filter_map(Result::ok).collect();
            let mut batch = lookup_all(&m).expect("batch lookup");
            walked.sort_by_key(|(k, _)| *k);
            batch.sort_by_key(|(k, _)| *k);
            assert_eq!(batch.len(), n as usize, "every entry, each once");
            assert_eq!(batch, walked);
            assert!(batch.iter().all(|(k, r)| *r == record(k - 1000)), "each value with its own key");
        }
    }
}
