//! The kubelet's prober: HTTP readiness and startup probes against the pod's IP.
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use super::*;

/// The kubelet's prober: waits until the kubelet saw the container running, honours the initial
/// delay, then probes every period; ready after one success, not ready after
/// `failure_threshold` failures in a row. A startup probe (`once`) stops at its first success.
/// (A startup probe's `failure_threshold` failures, which make the kubelet restart the
/// container, are not modelled: it keeps probing.)
#[allow(clippy::too_many_arguments, reason = "the probe and the container's shared state, each its own")]
pub(super) fn probe_loop(
    probe: HttpProbe,
    ip: Option<Ipv4Addr>,
    started: Instant,
    seen: Arc<AtomicBool>,
    ready: Arc<AtomicBool>,
    stop: Arc<Stop>,
    dirty: Arc<AtomicBool>,
    once: bool,
) {
    let sleep_until = |t: Instant| stop.wait_until(t);
    while !seen.load(Ordering::SeqCst) {
        if !sleep_until(Instant::now() + Duration::from_millis(5)) {
            return;
        }
    }
    if !sleep_until(started + probe.initial_delay) {
        return;
    }
    let mut failures = 0;
    loop {
        let t = Instant::now();
        let ok = ip.is_some_and(|ip| http_probe(SocketAddr::from((ip, probe.port)), &probe.path, probe.timeout));
        if stop.is_set() {
            return;
        }
        if ok {
            failures = 0;
            if !ready.swap(true, Ordering::SeqCst) {
                dirty.store(true, Ordering::SeqCst);
            }
            if once {
                return;
            }
        } else if !once {
            failures += 1;
            if failures >= probe.failure_threshold && ready.swap(false, Ordering::SeqCst) {
                dirty.store(true, Ordering::SeqCst);
            }
        }
        if !sleep_until(t + probe.period) {
            return;
        }
    }
}

/// Stops a probe thread: set once, it wakes the thread from its wait between probes (the kubelet's
/// probe worker waits on its ticker and its stop channel; a wait in short sleeps, to look at a
/// flag, cost a full node's 110 probe threads a sixth of a core).
#[derive(Debug, Default)]
pub(super) struct Stop {
    stopped: std::sync::Mutex<bool>,
    woken: std::sync::Condvar,
}

impl Stop {
    pub(super) fn set(&self) {
        *lock(&self.stopped) = true;
        self.woken.notify_all();
    }

    fn is_set(&self) -> bool {
        *lock(&self.stopped)
    }

    /// Waits until `t`; false if stopped first (or already).
    fn wait_until(&self, t: Instant) -> bool {
        let mut stopped = lock(&self.stopped);
        loop {
            if *stopped {
                return false;
            }
            let now = Instant::now();
            if now >= t {
                return true;
            }
            stopped = self.woken.wait_timeout(stopped, t - now).unwrap_or_else(std::sync::PoisonError::into_inner).0;
        }
    }
}

/// One HTTP GET as the kubelet's prober makes it: success on 200–399; only the status line is
/// read (an endless answer cannot hold the prober).
pub(super) fn http_probe(addr: SocketAddr, path: &str, timeout: Duration) -> bool {
    use std::io::{Read as _, Write as _};
    let deadline = Instant::now() + timeout;
    let Ok(mut s) = std::net::TcpStream::connect_timeout(&addr, timeout) else { return false };
    let _ = s.set_read_timeout(Some(timeout));
    let _ = s.set_write_timeout(Some(timeout));
    let req =
        format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nUser-Agent: kube-probe/1.33\r\nConnection: close\r\n\r\n");
    if s.write_all(req.as_bytes()).is_err() {
        return false;
    }
    let mut buf = Vec::with_capacity(256);
    let mut chunk = [0u8; 256];
    while !buf.windows(2).any(|w| w == b"\r\n") && buf.len() < 4096 && Instant::now() < deadline {
        match s.read(&mut chunk) {
            Ok(0) | Err(_) => break,
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
        }
    }
    let line = String::from_utf8_lossy(&buf);
    let code: u16 = line.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (200..400).contains(&code)
}
