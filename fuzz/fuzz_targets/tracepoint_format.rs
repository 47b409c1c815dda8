//! A tracefs `format` file (`events/sched/sched_process_exit/format`): the field offset lookup.
//! The input is the file's text; the field looked up is the one valet reads, and the first
//! line's name (so the fuzzer can reach any field).
#![no_main]

use libfuzzer_sys::fuzz_target;
use valet_agent::kernel::offsets::tracepoint_field_offset;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let _ = tracepoint_field_offset(&text, "group_dead");
    let first = text.lines().next().unwrap_or_default();
    let _ = tracepoint_field_offset(&text, first);
});
