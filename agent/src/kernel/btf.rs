//! A small reader for the kernel's BTF (`/sys/kernel/btf/vmlinux`): just enough to find struct
//! member offsets and struct sizes, so the kernel programs never hard-code a kernel layout.
//!
//! Format: `include/uapi/linux/btf.h` (header, type section, string section).

use crate::error::{Error, Result};

const BTF_MAGIC: u16 = 0xeb9f;

const KIND_INT: u32 = 1;
const KIND_ARRAY: u32 = 3;
const KIND_STRUCT: u32 = 4;
const KIND_UNION: u32 = 5;
const KIND_ENUM: u32 = 6;
const KIND_FUNC_PROTO: u32 = 13;
const KIND_VAR: u32 = 14;
const KIND_DATASEC: u32 = 15;
const KIND_DECL_TAG: u32 = 17;
const KIND_ENUM64: u32 = 19;

/// Parsed BTF type information: the blob as read, and where each type's record starts in it.
/// Nothing is copied out of the blob: the kernel's is 5–6 MB, and this reader runs while the
/// agent's memory is at its peak (its limit must fit it).
pub struct Btf {
    data: Vec<u8>,
    /// The type section's and the string section's place in `data`.
    types: std::ops::Range<usize>,
    strings: std::ops::Range<usize>,
    /// Index = type id: where the type's record starts in the type section (id 0 is `void`,
    /// which has none).
    records: Vec<u32>,
}

fn u32_at(data: &[u8], off: usize) -> Result<u32> {
    off.checked_add(4)
        .and_then(|end| data.get(off..end))
        .and_then(|b| b.try_into().ok())
        .map(u32::from_le_bytes)
        .ok_or_else(|| Error::Btf(format!("truncated at byte {off}")))
}

/// A struct or union: its name, size in bytes and members (`vlen` records after its own).
#[derive(Clone, Copy)]
struct Composite {
    name_off: u32,
    size: u32,
    kind_flag: bool,
    /// Where its member records start in the type section, and how many there are.
    members_at: usize,
    vlen: usize,
}

struct Member {
    name_off: u32,
    type_id: u32,
    /// Bit offset within the parent.
    bit_offset: u32,
}

impl Btf {
    /// Reads the running kernel's BTF.
    pub fn from_sys_fs() -> Result<Btf> {
        Self::from_file(std::path::Path::new("/sys/kernel/btf/vmlinux"))
    }

    pub fn from_file(path: &std::path::Path) -> Result<Btf> {
        let data = std::fs::read(path).map_err(|e| Error::io(format!("read {}", path.display()), e))?;
        Self::from_bytes(data)
    }

    /// Parses raw BTF (little-endian, as on every host valet supports).
    pub fn parse(data: &[u8]) -> Result<Btf> {
        Self::from_bytes(data.to_vec())
    }

    /// [`Btf::parse`], keeping `data`.
    pub fn from_bytes(data: Vec<u8>) -> Result<Btf> {
        if data.len() < 24 {
            return Err(Error::Btf("shorter than the BTF header".into()));
        }
        let magic = u16::from_le_bytes([data[0], data[1]]);
        if magic != BTF_MAGIC {
            return Err(Error::Btf(format!("bad magic {magic:#x} (big-endian BTF is not supported)")));
        }
        let hdr_len = u32_at(&data, 4)? as usize;
        let section = |at: usize| -> Result<std::ops::Range<usize>> {
            let (off, len) = (u32_at(&data, at)? as usize, u32_at(&data, at + 4)? as usize);
            let start = hdr_len.checked_add(off);
            match (start, start.and_then(|s| s.checked_add(len))) {
                (Some(s), Some(e)) if e <= data.len() => Ok(s..e),
                _ => Err(Error::Btf("section outside the data".into())),
            }
        };
        let types = section(8)?;
        let strings = section(16)?;

        let tsec = &data[types.clone()];
        let mut records = vec![0];
        let mut pos = 0usize;
        while pos < tsec.len() {
            let record = u32::try_from(pos).map_err(|_| Error::Btf("type section over 4 GiB".into()))?;
            let info = u32_at(tsec, pos + 4)?;
            u32_at(tsec, pos + 8)?;
            let vlen = (info & 0xffff) as usize;
            let extra = match (info >> 24) & 0x1f {
                KIND_INT | KIND_VAR | KIND_DECL_TAG => 4,
                KIND_ARRAY => 12,
                KIND_ENUM | KIND_FUNC_PROTO => vlen * 8,
                KIND_STRUCT | KIND_UNION | KIND_DATASEC | KIND_ENUM64 => vlen * 12,
                0 | 2 | 7..=12 | 16 | 18 => 0,
                other => return Err(Error::Btf(format!("unknown BTF kind {other}"))),
            };
            pos += 12 + extra;
            if pos > tsec.len() {
                return Err(Error::Btf(format!("type {} runs past the type section", records.len())));
            }
            records.push(record);
        }
        Ok(Btf { data, types, strings, records })
    }

    fn string(&self, off: u32) -> &str {
        let strings = &self.data[self.strings.clone()];
        let Some(rest) = strings.get(off as usize..) else { return "" };
        let end = rest.iter().position(|&b| b == 0).unwrap_or(rest.len());
        std::str::from_utf8(&rest[..end]).unwrap_or("")
    }

    /// Type `id` if it is a struct or union (every record lies within the type section: checked
    /// by the parse).
    fn composite(&self, id: u32) -> Option<Composite> {
        if id == 0 {
            return None;
        }
        let tsec = &self.data[self.types.clone()];
        let at = *self.records.get(id as usize)? as usize;
        let info = u32_at(tsec, at + 4).ok()?;
        if !matches!((info >> 24) & 0x1f, KIND_STRUCT | KIND_UNION) {
            return None;
        }
        Some(Composite {
            name_off: u32_at(tsec, at).ok()?,
            size: u32_at(tsec, at + 8).ok()?,
            kind_flag: info >> 31 == 1,
            members_at: at + 12,
            vlen: (info & 0xffff) as usize,
        })
    }

    fn members(&self, c: Composite) -> impl Iterator<Item = Member> + '_ {
        let tsec = &self.data[self.types.clone()];
        let kind_flag = c.kind_flag;
        (0..c.vlen).filter_map(move |i| {
            let m = c.members_at + i * 12;
            let raw_offset = u32_at(tsec, m + 8).ok()?;
            Some(Member {
                name_off: u32_at(tsec, m).ok()?,
                type_id: u32_at(tsec, m + 4).ok()?,
                // With kind_flag the top 8 bits hold a bitfield size.
                bit_offset: if kind_flag { raw_offset & 0x00ff_ffff } else { raw_offset },
            })
        })
    }

    /// The first struct or union named `name` (a scan: the layout step asks a score of names).
    fn named(&self, name: &str) -> Option<(u32, Composite)> {
        (1..self.records.len() as u32).find_map(|id| {
            let c = self.composite(id)?;
            (c.name_off != 0 && self.string(c.name_off) == name).then_some((id, c))
        })
    }

    /// The value of the enumerator `name` of any (32-bit) enum, e.g. `memory_cgrp_id` of
    /// `enum cgroup_subsys_id`, whose values depend on the kernel's configuration.
    pub fn enum_value(&self, name: &str) -> Result<u32> {
        let tsec = &self.data[self.types.clone()];
        for &at in self.records.iter().skip(1) {
            let at = at as usize;
            let Ok(info) = u32_at(tsec, at + 4) else { continue };
            if (info >> 24) & 0x1f != KIND_ENUM {
                continue;
            }
            // Every record lies within the type section (checked by the parse).
            for i in 0..(info & 0xffff) as usize {
                let entry = at + 12 + i * 8;
                if let (Ok(name_off), Ok(value)) = (u32_at(tsec, entry), u32_at(tsec, entry + 4))
                    && name_off != 0
                    && self.string(name_off) == name
                {
                    return Ok(value);
                }
            }
        }
        Err(Error::Btf(format!("enumerator {name} not found")))
    }

    /// Size in bytes of `struct name`.
    pub fn struct_size(&self, name: &str) -> Result<u32> {
        self.named(name).map(|(_, c)| c.size).ok_or_else(|| Error::Btf(format!("struct {name} not found")))
    }

    /// Byte offset of `member` in `struct name`, looking through anonymous structs and unions
    /// (the kernel wraps many fields in them, e.g. under randomized layouts).
    pub fn member_offset(&self, name: &str, member: &str) -> Result<u32> {
        let (id, _) = self.named(name).ok_or_else(|| Error::Btf(format!("struct {name} not found")))?;
        self.find_member(id, member, 0)
            .map(|bits| bits / 8)
            .ok_or_else(|| Error::Btf(format!("{name}.{member} not found")))
    }

    fn find_member(&self, id: u32, member: &str, depth: u32) -> Option<u32> {
        if depth > 8 {
            return None;
        }
        let c = self.composite(id)?;
        if let Some(m) = self.members(c).find(|m| m.name_off != 0 && self.string(m.name_off) == member) {
            return Some(m.bit_offset);
        }
        for m in self.members(c).filter(|m| m.name_off == 0) {
            if let Some(inner) = self.find_member(m.type_id, member, depth + 1) {
                // Checked: offsets come from the blob (an overflow is a panic in debug builds).
                return m.bit_offset.checked_add(inner);
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Builds a tiny BTF blob: `struct outer { int a; union { int b; long c; }; }`.
    fn tiny() -> Vec<u8> {
        let strings = b"\0int\0outer\0a\0b\0c\0".to_vec();
        let s = |name: &str| -> u32 {
            let pos = strings
                .windows(name.len() + 1)
                .position(|w| &w[..name.len()] == name.as_bytes() && w[name.len()] == 0)
                .expect("string in table");
            pos as u32
        };
        let mut types = Vec::new();
        let push = |v: &mut Vec<u8>, x: u32| v.extend_from_slice(&x.to_le_bytes());
        // 1: int
        push(&mut types, s("int"));
        push(&mut types, KIND_INT << 24);
        push(&mut types, 4);
        push(&mut types, 32);
        // 2: anonymous union { b @0, c @0 }, size 8
        push(&mut types, 0);
        push(&mut types, (KIND_UNION << 24) | 2);
        push(&mut types, 8);
        for name in ["b", "c"] {
            push(&mut types, s(name));
            push(&mut types, 1);
            push(&mut types, 0);
        }
        // 3: struct outer { a @0, <anon> @64 bits }, size 16
        push(&mut types, s("outer"));
        push(&mut types, (KIND_STRUCT << 24) | 2);
        push(&mut types, 16);
        push(&mut types, s("a"));
        push(&mut types, 1);
        push(&mut types, 0);
        push(&mut types, 0);
        push(&mut types, 2);
        push(&mut types, 64);

        let mut out = Vec::new();
        out.extend_from_slice(&BTF_MAGIC.to_le_bytes());
        out.push(1);
        out.push(0);
        push(&mut out, 24);
        push(&mut out, 0);
        push(&mut out, types.len() as u32);
        push(&mut out, types.len() as u32);
        push(&mut out, strings.len() as u32);
        out.extend_from_slice(&types);
        out.extend_from_slice(&strings);
        out
    }

    #[test]
    fn finds_members_through_anonymous_unions() {
        let btf = Btf::parse(&tiny()).expect("parse");
        assert_eq!(btf.member_offset("outer", "a").expect("a"), 0);
        assert_eq!(btf.member_offset("outer", "b").expect("b"), 8);
        assert_eq!(btf.member_offset("outer", "c").expect("c"), 8);
        assert_eq!(btf.struct_size("outer").expect("size"), 16);
        assert!(btf.member_offset("outer", "zz").is_err());
        assert!(btf.member_offset("nope", "a").is_err());
    }

    #[test]
    fn rejects_garbage_without_panicking() {
        assert!(Btf::parse(&[]).is_err());
        assert!(Btf::parse(&[0u8; 64]).is_err());
        let mut blob = tiny();
        blob.truncate(40);
        assert!(Btf::parse(&blob).is_err());
        // Every truncation of a valid blob is an error or a valid parse, never a panic.
        let full = tiny();
        for n in 0..full.len() {
            let _ = Btf::parse(&full[..n]);
        }
    }

    #[test]
    fn member_offsets_that_overflow_are_not_found() {
        // Found by review next to the btf fuzz target: an anonymous member at bit offset
        // u32::MAX holding a member at 64 overflowed `bit_offset + inner`.
        let mut blob = tiny();
        // The anonymous union's offset in `outer` is the last u32 of the type section.
        let last = 24 + (blob.len() - 24 - b"\0int\0outer\0a\0b\0c\0".len()) - 4;
        blob[last..last + 4].copy_from_slice(&u32::MAX.to_le_bytes());
        // ...and `b`, inside the union, at 64 bits (the union's first member's offset).
        let b_off = 24 + 16 + 12 + 8;
        blob[b_off..b_off + 4].copy_from_slice(&64u32.to_le_bytes());
        let btf = Btf::parse(&blob).expect("parse");
        assert!(btf.member_offset("outer", "b").is_err());
        assert_eq!(btf.member_offset("outer", "a").expect("a"), 0);
    }

    #[test]
    fn finds_enumerators() {
        // `tiny()` plus `enum e { A = 0, B = 7 }` (names reuse "a" and "b").
        let mut blob = tiny();
        let strings = b"\0int\0outer\0a\0b\0c\0";
        let (a, b) = (11u32, 13u32);
        let mut record = Vec::new();
        for x in [0, (KIND_ENUM << 24) | 2, 4, a, 0, b, 7] {
            record.extend_from_slice(&u32::to_le_bytes(x));
        }
        let types_len = blob.len() - 24 - strings.len();
        blob.splice(24 + types_len..24 + types_len, record.iter().copied());
        let grown = (types_len + record.len()) as u32;
        blob[12..16].copy_from_slice(&grown.to_le_bytes());
        blob[16..20].copy_from_slice(&grown.to_le_bytes());
        let btf = Btf::parse(&blob).expect("parse");
        assert_eq!(btf.enum_value("b").expect("b"), 7);
        assert_eq!(btf.enum_value("a").expect("a"), 0);
        assert!(btf.enum_value("c").is_err(), "a member, not an enumerator");
        assert_eq!(btf.member_offset("outer", "b").expect("b"), 8);
    }

    #[test]
    fn reads_the_running_kernel() {
        // Every supported node has BTF; so does CI. Fail loudly rather than skip.
        let btf = Btf::from_sys_fs().expect("/sys/kernel/btf/vmlinux readable");
        let exit_code = btf.member_offset("task_struct", "exit_code").expect("task_struct.exit_code");
        let thread_pid = btf.member_offset("task_struct", "thread_pid").expect("thread_pid");
        assert!(exit_code > 0 && thread_pid > 0 && exit_code != thread_pid);
        assert_eq!(btf.member_offset("upid", "nr").expect("upid.nr"), 0);
        assert!(btf.struct_size("upid").expect("upid size") >= 8);
        // The v1 controllers' ids (cgroup v1 and hybrid nodes): distinct, and in /proc/cgroups's
        // order, which lists the controllers by id.
        let ids: Vec<u32> = ["memory", "pids"]
            .iter()
            .map(|c| btf.enum_value(&format!("{c}_cgrp_id")).expect("controller id"))
            .collect();
        assert_ne!(ids[0], ids[1]);
        let listed = std::fs::read_to_string("/proc/cgroups").expect("/proc/cgroups");
        let order: Vec<&str> =
            listed.lines().filter(|l| !l.starts_with('#')).filter_map(|l| l.split('\t').next()).collect();
        for (c, id) in ["memory", "pids"].iter().zip(&ids) {
            assert_eq!(order.get(*id as usize), Some(c), "{c} is controller {id}");
        }
    }
}
