//! What valet's test suites share, once: a free port on the loopback, a wait for an event (polled,
//! with a hang guard, never a sleep-then-count), and the kernel's monotonic clock that the agent,
//! the stand-in proxies and the kernel programs stamp their events with.
#![deny(unsafe_code)]

use std::net::TcpListener;
use std::time::{Duration, Instant};

/// A free TCP port on 127.0.0.1 (bound, then let go: the caller binds it next).
pub fn free_port() -> std::io::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Polls `f` every 10 ms until it returns true (`true`) or `timeout` passes (`false`). The
/// timeout is a hang guard, not a pace: the wait ends at the event.
pub fn eventually(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + timeout;
    loop {
        if f() {
            return true;
        }
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Polls `f` every 2 ms until it returns true: the time that took, `None` once `timeout` passes.
pub fn wait_for(timeout: Duration, mut f: impl FnMut() -> bool) -> Option<Duration> {
    let start = Instant::now();
    while start.elapsed() < timeout {
        if f() {
            return Some(start.elapsed());
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    None
}

/// CLOCK_MONOTONIC in nanoseconds: the clock of `bpf_ktime_get_ns`, the agent's and the stand-in
/// proxies' stamps, so that times taken in other processes compare.
#[allow(unsafe_code, reason = "one clock_gettime, which std does not expose as a number")]
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: `ts` is a valid out-pointer; CLOCK_MONOTONIC always exists on Linux.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    u64::try_from(ts.tv_sec).unwrap_or(0) * 1_000_000_000 + u64::try_from(ts.tv_nsec).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn waits_end_at_the_event_or_the_guard() {
        let mut n = 0;
        assert!(eventually(Duration::from_secs(30), || {
            n += 1;
            n == 3
        }));
        assert!(!eventually(Duration::ZERO, || false));
        assert!(wait_for(Duration::from_secs(30), || true).is_some());
        assert_eq!(wait_for(Duration::ZERO, || true), None, "no time left: no poll");
    }

    #[test]
    fn ports_are_free_and_the_clock_moves_on() -> std::io::Result<()> {
        let port = free_port()?;
        assert_ne!(port, 0);
        TcpListener::bind(("127.0.0.1", port))?;
        let (a, b) = (monotonic_ns(), monotonic_ns());
        assert!(a > 0 && b >= a);
        Ok(())
    }
}
