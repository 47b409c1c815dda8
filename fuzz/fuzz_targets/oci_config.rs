//! A container's OCI `config.json` from the runtime's state directory: the role and pod uid
//! read from its annotations.
#![no_main]

use libfuzzer_sys::fuzz_target;
use valet_agent::runtime::parse_config;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let _ = parse_config(&text);
});
