//! `/proc/self/mountinfo`: the cgroup2 mount point, with the kernel's octal escapes undone.
#![no_main]

use libfuzzer_sys::fuzz_target;
use valet_agent::cgroup::root::cgroup2_mount_from_mountinfo;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let _ = cgroup2_mount_from_mountinfo(&text);
});
