//! The node's clocks as the agent reads them.

/// CLOCK_MONOTONIC now, in the same clock as `bpf_ktime_get_ns`, to measure kernel→user latency.
pub fn monotonic_ns() -> u64 {
    u64::try_from(super::sys::monotonic().as_nanos()).unwrap_or(u64::MAX)
}
