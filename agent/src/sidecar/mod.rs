//! Talking to a pod's sidecars: quit them, probe their readiness. Their admin endpoints accept
//! loopback callers only, so every request is made from inside the pod's own network namespace.
pub mod http;
pub mod netns;
mod pod_ns;
pub mod quit_request;

use std::future::Future;
use std::net::IpAddr;
use std::pin::Pin;

use self::http::{Limits, Response};

/// Where a pod's sidecars are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodTarget {
    pub uid: String,
    /// The pod's cgroup (relative path): its network namespace is found through its processes.
    pub pod_rel: Option<String>,
    /// Used only for readiness, and only until the pod's namespace can be entered (the kubelet
    /// probes the pod IP the same way).
    pub pod_ip: Option<IpAddr>,
}

/// A request's failure: what happened, and a low-cardinality label for metrics.
pub type Failed = (String, &'static str);

/// Why [`SidecarLink::pod_socket`] made no socket.
#[derive(Debug)]
pub enum SocketError {
    /// Not this time (the pod's namespace is not open, a call failed); the calling thread is in
    /// its own namespace.
    Failed(String),
    /// The calling thread joined the pod's namespace and could not go back: it must make no
    /// other socket (it would be the pod's).
    Stranded(String),
}

/// A new non-blocking, close-on-exec TCP socket of the calling thread's network namespace.
pub fn tcp_socket() -> nix::Result<std::os::fd::OwnedFd> {
    use nix::sys::socket::{AddressFamily, SockFlag, SockType, socket};
    socket(AddressFamily::Inet, SockType::Stream, SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC, None)
}

/// A boxed, sendable future.
pub type Pending<T> = Pin<Box<dyn Future<Output = T> + Send>>;

/// How the agent reaches a pod's sidecars (the network namespace and HTTP in production, a
/// stand-in in tests of the loop).
pub trait SidecarLink: Send + Sync + 'static {
    /// Opens the pod's network namespace ahead of time, so a quit needs no search.
    fn open(&self, uid: &str, pod_rel: &str) -> Result<(), String>;
    /// Drops what `open` kept, and every connection kept for the pod.
    fn close(&self, uid: &str);
    /// Opens a connection to `port` on the pod's loopback ahead of time, if none is open, so that
    /// the next request to it (a quit) needs no connect. Never waits; failures are silent (the
    /// request then connects as usual).
    fn standby(&self, target: &PodTarget, port: u16) {
        let _ = (target, port);
    }
    /// Sends `POST path` at once, in one non-blocking write, on the connection [`standby`] kept
    /// to `port` of pod `uid`, from any thread; whether it went out (no kept connection, or one
    /// the server closed: no). The next quit request to that port takes the connection over
    /// with what was written, and reads the answer.
    ///
    /// [`standby`]: SidecarLink::standby
    fn send_ahead(&self, uid: &str, port: u16, path: &str) -> bool {
        let _ = (uid, port, path);
        false
    }
    /// Drops the requests sent ahead to pod `uid` that no quit request took over; how many.
    fn drop_sent_ahead(&self, uid: &str) -> usize {
        let _ = uid;
        0
    }
    /// Whether the pod's network namespace is open (the held pods' prober connects only there;
    /// other pods keep being probed by their loops, through the pod IP if need be).
    fn netns_open(&self, uid: &str) -> bool {
        let _ = uid;
        false
    }
    /// A new non-blocking TCP socket of the pod's network namespace, for the held pods' prober
    /// thread, which connects it to the pod's loopback itself. Made on the calling thread: it
    /// joins the namespace for the `socket` call alone and goes back to its own.
    fn pod_socket(&self, uid: &str) -> Result<std::os::fd::OwnedFd, SocketError> {
        let _ = uid;
        Err(SocketError::Failed("this link makes no sockets".into()))
    }
    /// One request to a sidecar of the pod.
    fn request(&self, request: PodRequest) -> Pending<Result<Response, Failed>>;
}

/// One request to `127.0.0.1:port` in a pod's network namespace.
#[derive(Clone, Debug)]
pub struct PodRequest {
    pub target: PodTarget,
    pub port: u16,
    pub method: &'static str,
    pub path: String,
    pub limits: Limits,
    /// Enter the namespace anew, on a new connection (a retry).
    pub fresh: bool,
    /// Send it to the pod IP while the namespace cannot be entered.
    pub pod_ip_fallback: bool,
}

/// A link for tests of the loops: every request answers 200 and is counted; the prober's sockets
/// are the test's own (its servers listen on the test's loopback). Quits sent ahead are recorded,
/// and the next drop reports `unclaimed` of them.
#[cfg(test)]
pub mod testing {
    use super::*;
    use std::sync::Mutex;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[derive(Default)]
    pub struct TestLink {
        pub requests: AtomicUsize,
        pub sent_ahead: Mutex<Vec<(String, u16, String)>>,
        pub unclaimed: AtomicUsize,
        /// The next this many requests fail with this failure (refused, timeout) instead.
        pub failing: Mutex<Option<(usize, super::http::Failure)>>,
    }

    impl SidecarLink for TestLink {
        fn open(&self, _: &str, _: &str) -> Result<(), String> {
            Ok(())
        }
        fn close(&self, _: &str) {}
        fn send_ahead(&self, uid: &str, port: u16, path: &str) -> bool {
            let mut sent = self.sent_ahead.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            sent.push((uid.into(), port, path.into()));
            true
        }
        fn drop_sent_ahead(&self, _: &str) -> usize {
            self.unclaimed.swap(0, Ordering::SeqCst)
        }
        fn netns_open(&self, _: &str) -> bool {
            true
        }
        fn pod_socket(&self, _: &str) -> Result<std::os::fd::OwnedFd, SocketError> {
            tcp_socket().map_err(|e| SocketError::Failed(e.to_string()))
        }
        fn request(&self, _: PodRequest) -> Pending<Result<Response, Failed>> {
            self.requests.fetch_add(1, Ordering::SeqCst);
            let mut failing = self.failing.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            if let Some((left, failure)) = failing.as_mut()
                && *left > 0
            {
                *left -= 1;
                let failed = (failure.to_string(), failure.label());
                return Box::pin(async move { Err(failed) });
            }
            Box::pin(async { Ok(Response { status: 200, body: String::new(), sent_ns: 0 }) })
        }
    }
}
