//! Running code inside a pod's network namespace. Sidecar admin endpoints accept loopback
//! callers only, so the agent enters the pod's namespace on a thread of its own, opens its socket
//! to 127.0.0.1 there, and lets the thread die afterwards (no pool thread is ever left in a pod's
//! namespace); the held pods' prober thread joins it for one `socket` call and goes back
//! ([`PodNetns::socket_here`]). A socket stays in the namespace it was made in, so a connection
//! opened there is kept (HTTP/1.1 keep-alive) and used again from the agent's own threads:
//! readiness probes reuse one connection, and a connection to each quit endpoint is opened ahead
//! of time, so a quit is one write on an open connection rather than a thread, a `setns` and a
//! handshake.

use std::collections::HashMap;
use std::fs::File;
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use tracing::info;

pub use super::pod_ns::Via;

use super::http::{self, Response};
use super::{Failed, Pending, PodRequest, PodTarget, SidecarLink, SocketError};
use crate::cgroup::CgroupFs;
use crate::error::{Error, Result};
use crate::host::clock::monotonic_ns;
use crate::runtime::RuntimeBundles;

/// An open handle on a pod's network namespace.
#[derive(Debug)]
pub struct PodNetns {
    file: File,
    /// Inode of the namespace (its identity).
    pub inode: u64,
    /// How it was found.
    pub via: Via,
}

/// Opens the network namespace of pod `uid`, whose cgroup is `pod_rel`: the one its runtime's
/// record names ([`super::pod_ns`]). Refused, not kept: the next attempt looks again.
pub fn open_pod_netns(
    host_proc: &Path,
    cgroups: &CgroupFs,
    bundles: &mut RuntimeBundles,
    uid: &str,
    pod_rel: &str,
) -> Result<PodNetns> {
    let found = super::pod_ns::find_pod_netns(host_proc, cgroups, bundles, uid, pod_rel)?;
    Ok(PodNetns { file: found.file, inode: found.inode, via: found.via })
}

impl PodNetns {
    /// A new non-blocking TCP socket of this namespace, made on the calling thread: it joins the
    /// namespace for the `socket` call alone and goes back to its own (no thread to start, for a
    /// thread that makes its own connections: the held pods' prober).
    pub fn socket_here(&self) -> Result<OwnedFd, SocketError> {
        use nix::sched::{CloneFlags, setns};
        let home = File::open("/proc/thread-self/ns/net")
            .map_err(|e| SocketError::Failed(format!("open this thread's network namespace: {e}")))?;
        setns(&self.file, CloneFlags::CLONE_NEWNET)
            .map_err(|e| SocketError::Failed(format!("setns into the pod's network namespace: {e}")))?;
        let made = super::tcp_socket();
        setns(&home, CloneFlags::CLONE_NEWNET)
            .map_err(|e| SocketError::Stranded(format!("setns back from the pod's network namespace: {e}")))?;
        made.map_err(|e| SocketError::Failed(format!("socket: {e}")))
    }

    /// Runs `f` on a fresh thread that has joined this namespace, and waits for it.
    pub async fn run<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce() -> T + Send + 'static,
    {
        let fd = self.file.try_clone().map_err(|e| Error::io("dup namespace fd", e))?;
        let (tx, rx) = tokio::sync::oneshot::channel();
        std::thread::Builder::new()
            .name("valet-netns".into())
            .spawn(move || {
                let entered = nix::sched::setns(&fd, nix::sched::CloneFlags::CLONE_NEWNET)
                    .map_err(|e| Error::Endpoint(format!("setns into the pod's network namespace: {e}")));
                let _ = tx.send(entered.map(|()| f()));
            })
            .map_err(|e| Error::io("spawn namespace thread", e))?;
        rx.await.map_err(|_| Error::Endpoint("namespace thread died".into()))?
    }
}

/// Connections kept open, by pod uid and port on the pod's loopback.
type Kept = Arc<Mutex<HashMap<(String, u16), tokio::net::TcpStream>>>;
/// Quit requests sent ahead on a kept connection, with how much of them went out, and when.
type Ahead = Mutex<HashMap<(String, u16), (tokio::net::TcpStream, http::Written)>>;

/// Open pod network namespaces, by pod uid.
type Open = Arc<Mutex<HashMap<String, Arc<PodNetns>>>>;

/// Keeps `stream` (in `kept`, or a request sent ahead on it) for the pod of `key` only while the
/// pod's network is open: a request, a standby or a quit sent ahead that finishes after
/// [`SidecarLink::close`] must not leave a connection behind.
fn keep<V>(open: &Open, kept: &Mutex<HashMap<(String, u16), V>>, key: (String, u16), stream: V) {
    let open = open.lock().unwrap_or_else(PoisonError::into_inner);
    if open.contains_key(&key.0) {
        kept.lock().unwrap_or_else(PoisonError::into_inner).entry(key).or_insert(stream);
    }
}

/// A connection made on a namespace thread, handed to the agent's runtime.
fn on_runtime(stream: TcpStream) -> Option<tokio::net::TcpStream> {
    stream.set_nonblocking(true).ok()?;
    tokio::net::TcpStream::from_std(stream).ok()
}

/// The production [`SidecarLink`]: each pod's network namespace, opened once and kept until the
/// pod's work is done; connections made inside it, kept while the server keeps them.
pub struct PodNetwork {
    host_proc: PathBuf,
    cgroups: CgroupFs,
    /// The runtime's records, where each pod's network namespace is named.
    bundles: Mutex<RuntimeBundles>,
    open: Open,
    kept: Kept,
    ahead: Ahead,
}

impl PodNetwork {
    pub fn new(host_proc: PathBuf, cgroups: CgroupFs, bundles: RuntimeBundles) -> PodNetwork {
        PodNetwork {
            host_proc,
            cgroups,
            bundles: Mutex::new(bundles),
            open: Arc::new(Mutex::new(HashMap::new())),
            kept: Arc::new(Mutex::new(HashMap::new())),
            ahead: Mutex::new(HashMap::new()),
        }
    }

    /// How many connections are kept open (all pods).
    pub fn kept_count(&self) -> usize {
        self.kept.lock().unwrap_or_else(PoisonError::into_inner).len()
    }

    /// How many pod network namespaces are held open.
    pub fn open_count(&self) -> usize {
        self.open.lock().unwrap_or_else(PoisonError::into_inner).len()
    }

    fn handle(&self, uid: &str, pod_rel: Option<&str>, fresh: bool) -> Result<Arc<PodNetns>> {
        let mut open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        if !fresh && let Some(netns) = open.get(uid) {
            return Ok(netns.clone());
        }
        let rel = pod_rel.ok_or_else(|| Error::Endpoint("the pod's cgroup is not known yet".into()))?;
        let mut bundles = self.bundles.lock().unwrap_or_else(PoisonError::into_inner);
        let netns = Arc::new(open_pod_netns(&self.host_proc, &self.cgroups, &mut bundles, uid, rel)?);
        open.insert(uid.to_owned(), netns.clone());
        Ok(netns)
    }
}

impl SidecarLink for PodNetwork {
    fn netns_open(&self, uid: &str) -> bool {
        self.open.lock().unwrap_or_else(PoisonError::into_inner).contains_key(uid)
    }

    fn pod_socket(&self, uid: &str) -> Result<OwnedFd, SocketError> {
        let netns = self.open.lock().unwrap_or_else(PoisonError::into_inner).get(uid).cloned();
        netns.ok_or_else(|| SocketError::Failed("the pod's network namespace is not open".into()))?.socket_here()
    }

    fn open(&self, uid: &str, pod_rel: &str) -> Result<(), String> {
        self.handle(uid, Some(pod_rel), false).map(|_| ()).map_err(|e| e.chain().to_string())
    }

    fn close(&self, uid: &str) {
        // In this order (see `keep`): nothing is kept for the pod once this returns.
        self.open.lock().unwrap_or_else(PoisonError::into_inner).remove(uid);
        self.kept.lock().unwrap_or_else(PoisonError::into_inner).retain(|(u, _), _| u != uid);
        self.drop_sent_ahead(uid);
    }

    fn send_ahead(&self, uid: &str, port: u16, path: &str) -> bool {
        // The kept connection goes to the requests sent ahead under its lock, and `open`'s (in
        // `keep`'s order): a quit taking its connection at the same moment finds it in one place
        // or the other, never in neither (it would open another, and both be sent); the pod's
        // network closed at the same moment finds it sent ahead (and logs its send time) or
        // never sends it. Before, a request written in either gap went out unrecorded.
        let open = self.open.lock().unwrap_or_else(PoisonError::into_inner);
        if !open.contains_key(uid) {
            return false;
        }
        let key = (uid.to_owned(), port);
        let mut kept = self.kept.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(stream) = kept.remove(&key) else { return false };
        if !http::idle_and_open(&stream) {
            return false;
        }
        let req = http::request_text(SocketAddr::from((Ipv4Addr::LOCALHOST, port)), "POST", path, false);
        match stream.try_write(req.as_bytes()) {
            Ok(n) if n > 0 => {
                let written = http::Written { bytes: n, at_ns: monotonic_ns() };
                self.ahead.lock().unwrap_or_else(PoisonError::into_inner).entry(key).or_insert((stream, written));
                true
            }
            // Nothing written: the connection stays kept, and the quit goes the usual way.
            _ => {
                kept.insert(key, stream);
                false
            }
        }
    }

    fn drop_sent_ahead(&self, uid: &str) -> usize {
        let mut ahead = self.ahead.lock().unwrap_or_else(PoisonError::into_inner);
        let before = ahead.len();
        ahead.retain(|(u, port), (_, written)| {
            if u != uid {
                return true;
            }
            // The request went out (its moment is the agent's send time, as `sent_ns` on an
            // accepted quit's line); its answer is not read: the pod ended, or no longer quits.
            info!(%uid, port, sent_ns = written.at_ns, "quit sent ahead, its answer not read");
            false
        });
        before - ahead.len()
    }

    fn standby(&self, target: &PodTarget, port: u16) {
        let key = (target.uid.clone(), port);
        {
            let mut kept = self.kept.lock().unwrap_or_else(PoisonError::into_inner);
            match kept.get(&key) {
                Some(s) if http::idle_and_open(s) => return,
                Some(_) => {
                    kept.remove(&key);
                }
                None => {}
            }
        }
        // Only for a pod whose network is open: a standby never reopens a closed one.
        let Some(netns) = self.open.lock().unwrap_or_else(PoisonError::into_inner).get(&target.uid).cloned() else {
            return;
        };
        let (open, kept) = (self.open.clone(), self.kept.clone());
        tokio::spawn(async move {
            let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
            let limits = http::Limits::default();
            if let Ok(Ok(stream)) = netns.run(move || http::connect(addr, limits)).await
                && let Some(stream) = on_runtime(stream)
            {
                keep(&open, &kept, key, stream);
            }
        });
    }

    fn request(&self, request: PodRequest) -> Pending<Result<Response, Failed>> {
        // Probes keep their connection; a quit is the connection's last request.
        let reuse = request.method == "GET";
        let (kept_conn, ahead_sent) = self.connection_for(&request, reuse);
        let target = &request.target;
        // The namespace only when there is no connection to use (looked up now: the future
        // cannot borrow this link).
        let netns = if kept_conn.is_none() || !reuse {
            Some(self.handle(&target.uid, target.pod_rel.as_deref(), request.fresh))
        } else {
            None
        };
        let (open, kept) = (self.open.clone(), self.kept.clone());
        // A quit on a kept connection goes out now, in one non-blocking write, not when the
        // returned future first runs (its caller may have more to do before it yields).
        let sent = match (&kept_conn, reuse, ahead_sent) {
            (_, _, Some(sent)) => sent,
            (Some(stream), false, None) => {
                let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, request.port));
                let req = http::request_text(addr, request.method, &request.path, false);
                http::Written { bytes: stream.try_write(req.as_bytes()).unwrap_or(0), at_ns: monotonic_ns() }
            }
            _ => http::Written::default(),
        };
        Box::pin(async move {
            let started = Instant::now();
            if let Some(stream) = kept_conn
                && let Some(answer) = on_kept(stream, &request, reuse, sent, started, &open, &kept).await
            {
                return answer;
            }
            // A probe whose kept connection was closed: the namespace it was made in, while open.
            let netns = netns.unwrap_or_else(|| {
                let open = open.lock().unwrap_or_else(PoisonError::into_inner);
                let open = open.get(&request.target.uid).cloned();
                open.ok_or_else(|| Error::Endpoint("the pod's network was closed".into()))
            });
            on_new_connection(netns, request, reuse, started, &open, &kept).await
        })
    }
}

impl PodNetwork {
    /// The connection a request goes on, if any: a quit the event reader sent ahead on the kept
    /// connection (taken over, answer and all: what it wrote comes along), or the connection
    /// kept to the port (none for a fresh request).
    fn connection_for(
        &self,
        request: &PodRequest,
        reuse: bool,
    ) -> (Option<tokio::net::TcpStream>, Option<http::Written>) {
        let PodRequest { target, port, fresh, .. } = request;
        if *fresh {
            return (None, None);
        }
        let key = (target.uid.clone(), *port);
        // Under the kept connections' lock, as `send_ahead` moves one to the requests sent ahead.
        let mut kept = self.kept.lock().unwrap_or_else(PoisonError::into_inner);
        if !reuse && let Some((stream, sent)) = self.ahead.lock().unwrap_or_else(PoisonError::into_inner).remove(&key) {
            return (Some(stream), Some(sent));
        }
        let stream = kept.remove(&key);
        // A quit only on a connection still open and idle (a look costs a syscall: a probe skips
        // it, since a connection the server closed answers its request with nothing and the
        // probe goes again on a new one).
        (stream.filter(|s| reuse || http::idle_and_open(s)), None)
    }
}

/// The request on a kept connection, on the runtime itself: no thread, no namespace switch.
/// None: the server closed it since the last look and nothing was answered, so the request goes
/// again on a new connection.
async fn on_kept(
    mut stream: tokio::net::TcpStream,
    request: &PodRequest,
    reuse: bool,
    sent: http::Written,
    started: Instant,
    open: &Open,
    kept: &Kept,
) -> Option<Result<Response, Failed>> {
    let PodRequest { target, port, method, path, limits, .. } = request;
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, *port));
    match http::exchange_async(
        &mut stream,
        http::Ask { addr, method, path, limits: *limits, started, keep: reuse },
        sent,
    )
    .await
    {
        Ok((response, again)) => {
            if again {
                keep(open, kept, (target.uid.clone(), *port), stream);
            }
            Some(Ok(response))
        }
        Err(http::Failure::Io(_) | http::Failure::Malformed(_)) => None,
        Err(failure) => Some(Err((failure.to_string(), failure.label()))),
    }
}

/// The request on a new connection: made in the pod's network namespace, or else to the pod IP
/// when the request allows it.
async fn on_new_connection(
    netns: Result<Arc<PodNetns>>,
    request: PodRequest,
    reuse: bool,
    started: Instant,
    open: &Open,
    kept: &Kept,
) -> Result<Response, Failed> {
    let PodRequest { target, port, method, path, limits, pod_ip_fallback, .. } = request;
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    match (netns, target.pod_ip) {
        (Ok(netns), _) => {
            let answer = netns
                .run(move || {
                    let mut stream = http::connect(addr, limits)?;
                    let (response, again) = http::exchange(
                        &mut stream,
                        http::Ask { addr, method, path: &path, limits, started, keep: reuse },
                    )?;
                    Ok::<_, http::Failure>((response, again.then_some(stream)))
                })
                .await;
            match answer {
                Ok(Ok((response, stream))) => {
                    if let Some(stream) = stream.and_then(on_runtime) {
                        keep(open, kept, (target.uid.clone(), port), stream);
                    }
                    Ok(response)
                }
                Ok(Err(failure)) => Err((failure.to_string(), failure.label())),
                Err(e) => Err((e.chain().to_string(), "netns")),
            }
        }
        (Err(_), Some(ip)) if pod_ip_fallback => {
            let addr = SocketAddr::new(ip, port);
            let answer = tokio::task::spawn_blocking(move || http::request(addr, method, &path, limits)).await;
            match answer {
                Ok(Ok(response)) => Ok(response),
                Ok(Err(failure)) => Err((failure.to_string(), failure.label())),
                Err(e) => Err((e.to_string(), "io")),
            }
        }
        (Err(e), _) => Err((e.chain().to_string(), "no_netns")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sidecar::http::Limits;
    use std::io::{Read as _, Write as _};
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A plain request to `port` of the pod, its namespace entered as kept.
    fn request(target: &PodTarget, port: u16, method: &'static str, path: &str) -> PodRequest {
        PodRequest {
            target: target.clone(),
            port,
            method,
            path: path.into(),
            limits: Limits::default(),
            fresh: false,
            pod_ip_fallback: false,
        }
    }

    /// A pod whose only process is this test, in a cgroup tree and a procfs of its own (no
    /// `1/ns/net` there, so this test's namespace is not taken for the node's).
    fn fake_pod(tag: &str) -> (PathBuf, PodNetwork, String) {
        let dir = std::env::temp_dir().join(format!("valet-netns-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let rel = "/kubepods/pod1234".to_owned();
        let cg = dir.join("cgroup").join("kubepods/pod1234");
        std::fs::create_dir_all(&cg).expect("cgroup");
        let me = std::process::id();
        std::fs::write(cg.join("cgroup.procs"), format!("{me}\n")).expect("procs");
        std::fs::create_dir_all(dir.join("proc")).expect("proc");
        std::os::unix::fs::symlink(format!("/proc/{me}"), dir.join("proc").join(me.to_string())).expect("link");
        let net = PodNetwork::new(dir.join("proc"), CgroupFs::new(dir.join("cgroup")), RuntimeBundles::default());
        (dir, net, rel)
    }

    /// A loopback server that counts the connections it accepts and hands each to `serve`.
    fn counting_server(serve: impl Fn(std::net::TcpStream) + Send + 'static) -> (u16, Arc<AtomicUsize>) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = accepted.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(s) = conn else { return };
                count.fetch_add(1, Ordering::SeqCst);
                serve(s);
            }
        });
        (port, accepted)
    }

    fn keep_alive_server() -> (u16, Arc<AtomicUsize>) {
        counting_server(|mut s| {
            std::thread::spawn(move || {
                let mut buf = [0u8; 1024];
                while let Ok(n) = s.read(&mut buf) {
                    if n == 0 || s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nOK").is_err() {
                        return;
                    }
                }
            });
        })
    }

    /// Answers one request per connection (keep-alive, by its headers), then closes the
    /// connection once it has been idle a moment, as a proxy with a short idle timeout does;
    /// (port, accepted, closed).
    fn idle_closing_server() -> (u16, Arc<AtomicUsize>, Arc<AtomicUsize>) {
        let closed = Arc::new(AtomicUsize::new(0));
        let count = closed.clone();
        let (port, accepted) = counting_server(move |mut s| {
            let mut buf = [0u8; 1024];
            if s.read(&mut buf).is_ok_and(|n| n > 0) {
                let _ = s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nOK");
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
            drop(s);
            count.fetch_add(1, Ordering::SeqCst);
        });
        (port, accepted, closed)
    }

    /// Only a guard against a hang: the tests wait for events, never for a time.
    const HANG_GUARD: std::time::Duration = std::time::Duration::from_secs(30);

    /// Waits until `f` holds (panics with `what` at the hang guard).
    async fn until(what: &str, f: impl Fn() -> bool) {
        let deadline = Instant::now() + HANG_GUARD;
        while !f() {
            assert!(Instant::now() < deadline, "never: {what}");
            tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        }
    }

    #[tokio::test]
    async fn a_probe_on_a_connection_the_server_closed_goes_again_on_a_new_one() {
        let (dir, net, rel) = fake_pod("closed");
        let (port, accepted, closed) = idle_closing_server();
        net.open("uid-1", &rel).expect("open");
        let target = PodTarget { uid: "uid-1".into(), pod_rel: Some(rel.clone()), pod_ip: None };
        for round in 1..=3 {
            let r = net.request(request(&target, port, "GET", "/ready")).await;
            assert_eq!(r.map(|r| r.status), Ok(200), "probe {round}");
            assert_eq!(net.kept_count(), 1, "kept: the answer said nothing of closing");
            // The server closes it meanwhile: the next probe finds it closed.
            until("the server closed the connection", || closed.load(Ordering::SeqCst) >= round).await;
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 3, "each probe after a close went on a new connection");
        net.close("uid-1");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_process_in_the_agents_own_namespace_is_not_taken_for_the_pods() {
        // pid 1's namespace is not readable here (as on hosts whose init is not dumpable); the
        // pod's only process is in the agent's namespace, the node's: refused, and not kept.
        let (dir, net, rel) = fake_pod("own");
        std::os::unix::fs::symlink(format!("/proc/{}", std::process::id()), dir.join("proc").join("self"))
            .expect("self link");
        let err = net.open("uid-1", &rel).expect_err("the node's namespace must be refused");
        assert!(err.contains("node's network namespace"), "{err}");
        assert_eq!(net.open_count(), 0);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn probes_share_a_connection_and_nothing_is_kept_after_close() {
        let (dir, net, rel) = fake_pod("kept");
        let (port, accepted) = keep_alive_server();
        net.open("uid-1", &rel).expect("open");
        let target = PodTarget { uid: "uid-1".into(), pod_rel: Some(rel.clone()), pod_ip: None };
        for _ in 0..3 {
            let r = net.request(request(&target, port, "GET", "/ready")).await;
            assert_eq!(r.map(|r| r.status), Ok(200));
        }
        assert_eq!(accepted.load(Ordering::SeqCst), 1, "three probes, one connection");
        assert_eq!(net.kept_count(), 1);
        net.close("uid-1");
        assert_eq!(net.kept_count(), 0);
        assert_eq!(net.open_count(), 0);
        // A standby after the close does not reopen anything: it starts no connection (one
        // would be a task on this runtime).
        let tasks = || tokio::runtime::Handle::current().metrics().num_alive_tasks();
        let before = tasks();
        net.standby(&target, port);
        assert_eq!(tasks(), before, "a standby after the close started a connection");
        assert_eq!((net.kept_count(), net.open_count()), (0, 0));
        // While open, a standby opens one connection ahead of time, and a quit uses it.
        net.open("uid-1", &rel).expect("open");
        net.standby(&target, port);
        assert_eq!(tasks(), before + 1, "a standby while open starts a connection");
        until("connected ahead of time", || net.kept_count() == 1).await;
        let before = accepted.load(Ordering::SeqCst);
        let r = net.request(request(&target, port, "POST", "/quit")).await;
        assert_eq!(r.map(|r| r.status), Ok(200));
        assert_eq!(accepted.load(Ordering::SeqCst), before, "the quit went on the kept connection");
        assert_eq!(net.kept_count(), 0, "a quit's connection is not kept");
        net.close("uid-1");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Waits until a standby has connected to `port` ahead of time.
    async fn wait_kept(net: &PodNetwork, target: &PodTarget, port: u16) {
        net.standby(target, port);
        until("connected ahead of time", || net.kept_count() == 1).await;
    }

    #[tokio::test]
    async fn a_quit_sent_ahead_from_another_thread_is_taken_over_by_the_quit_request() {
        let (dir, net, rel) = fake_pod("ahead");
        let net = Arc::new(net);
        // Records every request it reads, answers each, and closes as asked.
        let seen = Arc::new(Mutex::new(Vec::<String>::new()));
        let log = seen.clone();
        let (port, accepted) = counting_server(move |mut s| {
            let log = log.clone();
            std::thread::spawn(move || {
                let mut buf = [0u8; 1024];
                while let Ok(n) = s.read(&mut buf) {
                    if n == 0 {
                        return;
                    }
                    log.lock().unwrap_or_else(PoisonError::into_inner).push(String::from_utf8_lossy(&buf[..n]).into());
                    if s.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nOK").is_err() {
                        return;
                    }
                }
            });
        });
        let target = PodTarget { uid: "uid-1".into(), pod_rel: Some(rel.clone()), pod_ip: None };
        // Nothing kept: nothing sent ahead.
        net.open("uid-1", &rel).expect("open");
        assert!(!net.send_ahead("uid-1", port, "/quitquitquit"));
        wait_kept(&net, &target, port).await;
        // From a thread of its own, as the event reader does: it reaches the server at once.
        let n2 = net.clone();
        let (before, sent) =
            std::thread::spawn(move || (monotonic_ns(), n2.send_ahead("uid-1", port, "/quitquitquit")))
                .join()
                .expect("thread");
        let after = monotonic_ns();
        assert!(sent);
        until("the quit sent ahead read", || !seen.lock().unwrap_or_else(PoisonError::into_inner).is_empty()).await;
        let first = seen.lock().unwrap_or_else(PoisonError::into_inner).clone();
        assert_eq!(first.len(), 1, "{first:?}");
        assert!(first[0].starts_with("POST /quitquitquit HTTP/1.1\r\n"), "{first:?}");
        // The quit request takes it over: the answer is read, nothing is sent twice.
        let r = net.request(request(&target, port, "POST", "/quitquitquit")).await;
        // Its send time is the write ahead's, not the takeover's.
        assert_eq!(r.as_ref().map(|r| r.status), Ok(200));
        let sent_ns = r.map(|r| r.sent_ns).unwrap_or_default();
        assert!((before..=after).contains(&sent_ns), "sent at {sent_ns}, ahead between {before} and {after}");
        assert_eq!(seen.lock().unwrap_or_else(PoisonError::into_inner).len(), 1, "one request");
        assert_eq!(accepted.load(Ordering::SeqCst), 1, "on the kept connection");
        assert_eq!(net.drop_sent_ahead("uid-1"), 0, "taken over");
        // One that no quit takes over is dropped, and so is it at close.
        wait_kept(&net, &target, port).await;
        assert!(net.send_ahead("uid-1", port, "/quitquitquit"));
        assert_eq!(net.drop_sent_ahead("uid-1"), 1);
        wait_kept(&net, &target, port).await;
        assert!(net.send_ahead("uid-1", port, "/quitquitquit"));
        net.close("uid-1");
        assert_eq!(net.drop_sent_ahead("uid-1"), 0, "dropped at close");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
