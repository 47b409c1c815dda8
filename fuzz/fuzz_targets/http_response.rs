//! What a sidecar's endpoint answers (bytes off the socket): the completeness check that
//! decides when to stop reading, and the parse of the status and body, capped like a real read.
#![no_main]

use libfuzzer_sys::fuzz_target;
use valet_agent::sidecar::http::{Limits, parse_response, response_complete};

fuzz_target!(|data: &[u8]| {
    let _ = response_complete(data);
    let limits = Limits::default();
    if let Ok(r) = parse_response(data, limits) {
        assert!((100..600).contains(&r.status), "status {}", r.status);
        assert!(r.body.len() <= limits.max_response_bytes * 3, "body larger than the cap");
    }
    let small = Limits { max_response_bytes: 64, ..limits };
    let _ = parse_response(data, small);
});
