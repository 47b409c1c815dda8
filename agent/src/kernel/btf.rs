//! A small reader for the kernel's BTF (`/sys/kernel/btf/vmlinux`): just enough to find struct
//! member offsets and struct sizes, so the kernel programs never hard-code a kernel layout.
//!
//! Format: `include/uapi/linux/btf.h` (header, type section, string section).

use std::collections::HashMap;

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

#[derive(Debug, Clone)]
struct Member {
    name_off: u32,
    type_id: u32,
    /// Bit offset within the parent.
    bit_offset: u32,
}

#[derive(Debug, Clone)]
enum Type {
    /// A struct or union: size in bytes and members.
    Composite { name_off: u32, size: u32, members: Vec<Member> },
    /// Anything else; kept so type ids stay aligned with positions.
    Other,
}

/// Parsed BTF type information.
pub struct Btf {
    strings: Vec<u8>,
    /// Index = type id (id 0 is `void`).
    types: Vec<Type>,
    /// Struct name → first type id with that name.
    structs: HashMap<String, u32>,
}

fn u32_at(data: &[u8], off: usize) -> Result<u32> {
    data.get(off..off + 4)
        .and_then(|b| b.try_into().ok())
        .map(u32::from_le_bytes)
        .ok_or_else(|| Error::Btf(format!("truncated at byte {off}")))
}

impl Btf {
    /// Reads the running kernel's BTF.
    pub fn from_sys_fs() -> Result<Btf> {
        Self::from_file(std::path::Path::new("/sys/kernel/btf/vmlinux"))
    }

    pub fn from_file(path: &std::path::Path) -> Result<Btf> {
        let data = std::fs::read(path).map_err(|e| Error::io(format!("read {}", path.display()), e))?;
        Self::parse(&data)
    }

    /// Parses raw BTF (little-endian, as on every host valet supports).
    pub fn parse(data: &[u8]) -> Result<Btf> {
        if data.len() < 24 {
            return Err(Error::Btf("shorter than the BTF header".into()));
        }
        let magic = u16::from_le_bytes([data[0], data[1]]);
        if magic != BTF_MAGIC {
            return Err(Error::Btf(format!("bad magic {magic:#x} (big-endian BTF is not supported)")));
        }
        let hdr_len = u32_at(data, 4)? as usize;
        let type_off = u32_at(data, 8)? as usize;
        let type_len = u32_at(data, 12)? as usize;
        let str_off = u32_at(data, 16)? as usize;
        let str_len = u32_at(data, 20)? as usize;
        let section = |off: usize, len: usize| {
            let start = hdr_len.checked_add(off);
            let end = start.and_then(|s| s.checked_add(len));
            match (start, end) {
                (Some(s), Some(e)) if e <= data.len() => Ok(&data[s..e]),
                _ => Err(Error::Btf("section outside the data".into())),
            }
        };
        let tsec = section(type_off, type_len)?;
        let strings = section(str_off, str_len)?.to_vec();

        let mut types = vec![Type::Other];
        let mut pos = 0usize;
        while pos < tsec.len() {
            let name_off = u32_at(tsec, pos)?;
            let info = u32_at(tsec, pos + 4)?;
            let size_or_type = u32_at(tsec, pos + 8)?;
            pos += 12;
            let vlen = (info & 0xffff) as usize;
            let kind = (info >> 24) & 0x1f;
            let kind_flag = info >> 31 == 1;
            let ty = match kind {
                KIND_STRUCT | KIND_UNION => {
                    let mut members = Vec::with_capacity(vlen);
                    for i in 0..vlen {
                        let m = pos + i * 12;
                        let raw_offset = u32_at(tsec, m + 8)?;
                        members.push(Member {
                            name_off: u32_at(tsec, m)?,
                            type_id: u32_at(tsec, m + 4)?,
                            // With kind_flag the top 8 bits hold a bitfield size.
                            bit_offset: if kind_flag { raw_offset & 0x00ff_ffff } else { raw_offset },
                        });
                    }
                    pos += vlen * 12;
                    Type::Composite { name_off, size: size_or_type, members }
                }
                _ => {
                    pos += match kind {
                        KIND_INT | KIND_VAR | KIND_DECL_TAG => 4,
                        KIND_ARRAY => 12,
                        KIND_ENUM | KIND_FUNC_PROTO => vlen * 8,
                        KIND_DATASEC | KIND_ENUM64 => vlen * 12,
                        0 | 2 | 7..=12 | 16 | 18 => 0,
                        other => return Err(Error::Btf(format!("unknown BTF kind {other}"))),
                    };
                    Type::Other
                }
            };
            types.push(ty);
        }

        let mut btf = Btf { strings, types, structs: HashMap::new() };
        let mut structs = HashMap::new();
        for (id, ty) in btf.types.iter().enumerate() {
            if let Type::Composite { name_off, .. } = ty
                && *name_off != 0
            {
                let name = btf.string(*name_off).to_owned();
                structs.entry(name).or_insert(id as u32);
            }
        }
        btf.structs = structs;
        Ok(btf)
    }

    fn string(&self, off: u32) -> &str {
        let start = off as usize;
        let Some(rest) = self.strings.get(start..) else { return "" };
        let end = rest.iter().position(|&b| b == 0).unwrap_or(rest.len());
        std::str::from_utf8(&rest[..end]).unwrap_or("")
    }

    /// Size in bytes of `struct name`.
    pub fn struct_size(&self, name: &str) -> Result<u32> {
        match self.structs.get(name).and_then(|id| self.types.get(*id as usize)) {
            Some(Type::Composite { size, .. }) => Ok(*size),
            _ => Err(Error::Btf(format!("struct {name} not found"))),
        }
    }

    /// Byte offset of `member` in `struct name`, looking through anonymous structs and unions
    /// (the kernel wraps many fields in them, e.g. under randomized layouts).
    pub fn member_offset(&self, name: &str, member: &str) -> Result<u32> {
        let id = self.structs.get(name).ok_or_else(|| Error::Btf(format!("struct {name} not found")))?;
        self.find_member(*id, member, 0)
            .map(|bits| bits / 8)
            .ok_or_else(|| Error::Btf(format!("{name}.{member} not found")))
    }

    fn find_member(&self, id: u32, member: &str, depth: u32) -> Option<u32> {
        if depth > 8 {
            return None;
        }
        let Some(Type::Composite { members, .. }) = self.types.get(id as usize) else {
            return None;
        };
        for m in members {
            if m.name_off != 0 && self.string(m.name_off) == member {
                return Some(m.bit_offset);
            }
        }
        for m in members.iter().filter(|m| m.name_off == 0) {
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
    fn reads_the_running_kernel() {
        // Every supported node has BTF; so does CI. Fail loudly rather than skip.
        let btf = Btf::from_sys_fs().expect("/sys/kernel/btf/vmlinux readable");
        let exit_code = btf.member_offset("task_struct", "exit_code").expect("task_struct.exit_code");
        let thread_pid = btf.member_offset("task_struct", "thread_pid").expect("thread_pid");
        assert!(exit_code > 0 && thread_pid > 0 && exit_code != thread_pid);
        assert_eq!(btf.member_offset("upid", "nr").expect("upid.nr"), 0);
        assert!(btf.struct_size("upid").expect("upid size") >= 8);
    }
}
