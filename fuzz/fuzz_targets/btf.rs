//! The kernel's BTF (`/sys/kernel/btf/vmlinux`) as valet reads it: parse, then every lookup the
//! kernel-layout step makes. Any input must give a value or an error, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use valet_agent::kernel::btf::Btf;

/// What `kernel::offsets::read_layout` asks, plus the names the seed corpus defines.
const MEMBERS: [(&str, &str); 10] = [
    ("task_struct", "exit_code"),
    ("task_struct", "thread_pid"),
    ("task_struct", "signal"),
    ("task_struct", "group_leader"),
    ("signal_struct", "live"),
    ("pid", "level"),
    ("pid", "numbers"),
    ("upid", "nr"),
    ("outer", "b"),
    ("outer", "c"),
];

fuzz_target!(|data: &[u8]| {
    let Ok(btf) = Btf::parse(data) else { return };
    for (name, member) in MEMBERS {
        let _ = btf.member_offset(name, member);
        let _ = btf.struct_size(name);
    }
});
