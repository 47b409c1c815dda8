//! A container's OCI `config.json` from a runtime's bundle: the role and pod uid read from its
//! annotations, and its network namespace entry, streamed with a bound (every other field skipped).
#![no_main]

use libfuzzer_sys::fuzz_target;
use valet_agent::runtime::parse_bundle;

fuzz_target!(|data: &[u8]| {
    let _ = parse_bundle(data, 1 << 20);
});
