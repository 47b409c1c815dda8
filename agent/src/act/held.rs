//! Experimental (`--held-prober`, off by default): one thread probes every held pod's proxies. Each slot, every
//! request is written back to back on the pods' kept connections, the answers are read after
//! `poll` says they are there, and the slot's news goes out together. The probe loops of the
//! held pods hand their pod over while it is held. On the runtime, each probe cost wake-ups of
//! its threads for the answers (about twice the CPU per probe on a 2-core VM).
//!
//! Only pods whose network namespace is open are handed over (the others' loops go on, with their
//! pod-IP fallback). A proxy that does not answer within the probe timeout holds that one slot
//! back, and its pod goes back to its own loop. Not yet as the loops: a pod handed over waits for
//! the next slot, where its loop probed at once when its app was held.

use std::collections::HashMap;
use std::io::{Read as _, Write as _};
use std::net::TcpStream;
use std::os::fd::AsRawFd as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tracing::debug;

use super::Report;
use super::answer::{Answer, REPEAT, all_ready, detail};
use crate::effect::Feedback;
use crate::sidecar::SidecarLink;
use crate::sidecar::http;

/// How long a slot waits for its answers.
const ANSWER_TIMEOUT: Duration = Duration::from_millis(500);
const TIMED_OUT: &str = "no answer in time";

struct Endpoint {
    name: String,
    port: u16,
    request: Vec<u8>,
    conn: Option<TcpStream>,
}

struct Pod {
    /// Which hand-over this is: a loop that stops late does not take a newer one's pod away.
    token: u64,
    endpoints: Vec<Endpoint>,
    last: Option<(Vec<Answer>, Instant)>,
}

/// The prober thread and the pods handed to it.
pub struct HeldProber {
    pods: Mutex<HashMap<String, Pod>>,
    wake: Condvar,
    interval_ns: AtomicU64,
    tokens: AtomicU64,
}

/// One request of a slot: which pod and endpoint, and the answer.
struct Ask {
    uid: String,
    endpoint: usize,
    name: String,
    answer: Option<Result<u16, String>>,
}

impl HeldProber {
    /// Starts the thread; its news goes to `tx`. It ends once `tx` is closed.
    pub fn start<L: SidecarLink>(link: Arc<L>, tx: mpsc::UnboundedSender<Report>) -> Arc<HeldProber> {
        let prober = Arc::new(HeldProber {
            pods: Mutex::new(HashMap::new()),
            wake: Condvar::new(),
            interval_ns: AtomicU64::new(10_000_000),
            tokens: AtomicU64::new(0),
        });
        let p = prober.clone();
        if let Err(e) = std::thread::Builder::new().name("valet-held".into()).spawn(move || p.run(link.as_ref(), &tx)) {
            tracing::warn!("no held-pod prober thread: {e}");
        }
        prober
    }

    fn pods(&self) -> std::sync::MutexGuard<'_, HashMap<String, Pod>> {
        self.pods.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The held pods' probe interval.
    pub fn set_interval(&self, interval: Duration) {
        self.interval_ns.store(u64::try_from(interval.as_nanos()).unwrap_or(u64::MAX).max(1), Ordering::Relaxed);
    }

    /// Takes over probing pod `uid`'s `(name, port, path)` endpoints; returns the token for
    /// [`HeldProber::unhold`].
    pub fn hold(&self, uid: &str, endpoints: Vec<(String, u16, String)>) -> u64 {
        let token = self.tokens.fetch_add(1, Ordering::Relaxed);
        let endpoints = endpoints
            .into_iter()
            .map(|(name, port, path)| {
                let addr = std::net::SocketAddr::from((std::net::Ipv4Addr::LOCALHOST, port));
                Endpoint { name, port, request: http::request_text(addr, "GET", &path, true).into_bytes(), conn: None }
            })
            .collect();
        self.pods().insert(uid.to_owned(), Pod { token, endpoints, last: None });
        self.wake.notify_one();
        token
    }

    /// Whether the pod handed over with `token` is still probed here (one whose proxy did not
    /// answer in time is given back to its loop, so that it does not hold the others' slots).
    pub fn probes(&self, uid: &str, token: u64) -> bool {
        self.pods().get(uid).is_some_and(|p| p.token == token)
    }

    /// Gives pod `uid` back to its loop, if `token` is still its hand-over.
    pub fn unhold(&self, uid: &str, token: u64) {
        let mut pods = self.pods();
        if pods.get(uid).is_some_and(|p| p.token == token) {
            pods.remove(uid);
        }
    }

    fn run(&self, link: &dyn SidecarLink, tx: &mpsc::UnboundedSender<Report>) {
        let origin = Instant::now();
        loop {
            {
                let mut pods = self.pods();
                while pods.is_empty() {
                    if tx.is_closed() {
                        return;
                    }
                    pods =
                        self.wake.wait_timeout(pods, Duration::from_secs(1)).unwrap_or_else(PoisonError::into_inner).0;
                }
            }
            // The next slot of the shared clock.
            let period = self.interval_ns.load(Ordering::Relaxed).max(1);
            let since = u64::try_from(origin.elapsed().as_nanos()).unwrap_or(u64::MAX);
            let next = origin + Duration::from_nanos((since / period).saturating_add(1).saturating_mul(period));
            std::thread::sleep(next.saturating_duration_since(Instant::now()));
            if tx.is_closed() {
                return;
            }
            let started = Instant::now();
            self.slot(link, tx);
            if started.elapsed() > Duration::from_nanos(period) {
                debug!(took = ?started.elapsed(), "held pods' probe slot overran its period");
            }
        }
    }

    /// One probe of every held pod's endpoints.
    fn slot(&self, link: &dyn SidecarLink, tx: &mpsc::UnboundedSender<Report>) {
        // The connections are taken out: the probing happens without the lock.
        let mut asks = Vec::new();
        let mut work = Vec::new();
        for (uid, pod) in self.pods().iter_mut() {
            for (i, ep) in pod.endpoints.iter_mut().enumerate() {
                asks.push(Ask { uid: uid.clone(), endpoint: i, name: ep.name.clone(), answer: None });
                work.push((ep.port, ep.conn.take(), ep.request.clone()));
            }
        }
        // Every request written (a connection made where there is none).
        let mut live: Vec<(usize, TcpStream, Vec<u8>)> = Vec::new();
        for (k, (port, conn, request)) in work.into_iter().enumerate() {
            let stream = conn.or_else(|| {
                link.blocking_conn(&asks[k].uid, port).and_then(|s| s.set_nonblocking(true).ok().map(|()| s))
            });
            let Some(mut stream) = stream else {
                asks[k].answer = Some(Err("no connection in the pod's network namespace".into()));
                continue;
            };
            match stream.write(&request) {
                Ok(n) if n == request.len() => live.push((k, stream, Vec::with_capacity(256))),
                Ok(_) => asks[k].answer = Some(Err("request not written whole".into())),
                Err(e) => asks[k].answer = Some(Err(format!("write: {e}"))),
            }
        }
        let kept = read_answers(&mut asks, live);
        // Connections back, news out.
        let mut pods = self.pods();
        for (k, stream) in kept {
            if let Some(ep) = pods.get_mut(&asks[k].uid).and_then(|p| p.endpoints.get_mut(asks[k].endpoint)) {
                ep.conn = Some(stream);
            }
        }
        let mut by_pod: HashMap<String, Vec<Ask>> = HashMap::new();
        for ask in asks {
            by_pod.entry(ask.uid.clone()).or_default().push(ask);
        }
        for (uid, mut asked) in by_pod {
            if asked.iter().any(|a| a.answer.as_ref().is_some_and(|r| r.as_ref().is_err_and(|e| e == TIMED_OUT))) {
                debug!(%uid, "a held pod's proxy did not answer in time: back to its own probe loop");
                pods.remove(&uid);
                continue;
            }
            let Some(pod) = pods.get_mut(&uid) else { continue };
            asked.sort_by_key(|a| a.endpoint);
            let answers: Vec<Answer> = asked
                .iter_mut()
                .map(|a| match a.answer.take() {
                    Some(Ok(status)) => Answer::Status(status),
                    Some(Err(why)) => Answer::Failed(why),
                    None => Answer::Failed("no answer".into()),
                })
                .collect();
            if pod.last.as_ref().is_some_and(|(l, at)| *l == answers && at.elapsed() < REPEAT) {
                continue;
            }
            let (ready, detail) = (all_ready(&answers), detail(asked.iter().map(|a| a.name.as_str()), &answers));
            pod.last = Some((answers, Instant::now()));
            let _ = tx.send((uid, Feedback::Probed { ready, detail }));
        }
    }
}

/// Reads the answers on `live` connections (index into `asks`, stream, bytes so far) until all
/// have one or [`ANSWER_TIMEOUT`]; returns the connections that can carry the next request.
fn read_answers(asks: &mut [Ask], mut live: Vec<(usize, TcpStream, Vec<u8>)>) -> Vec<(usize, TcpStream)> {
    let limits = http::Limits::default();
    let deadline = Instant::now() + ANSWER_TIMEOUT;
    let mut kept = Vec::new();
    while !live.is_empty() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            for (k, ..) in live.drain(..) {
                asks[k].answer = Some(Err(TIMED_OUT.into()));
            }
            break;
        }
        let mut fds: Vec<libc::pollfd> =
            live.iter().map(|(_, s, _)| libc::pollfd { fd: s.as_raw_fd(), events: libc::POLLIN, revents: 0 }).collect();
        let wait = i32::try_from(left.as_millis()).unwrap_or(i32::MAX).saturating_add(1);
        // SAFETY: `fds` is a valid array of pollfds for the duration of the call.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, wait) };
        if n <= 0 {
            continue;
        }
        let mut still = Vec::new();
        for ((k, mut stream, mut buf), pfd) in live.drain(..).zip(fds) {
            if pfd.revents == 0 {
                still.push((k, stream, buf));
                continue;
            }
            let mut chunk = [0u8; 1024];
            match stream.read(&mut chunk) {
                Ok(0) => asks[k].answer = Some(Err("the connection was closed".into())),
                Ok(n) => {
                    let room = limits.max_response_bytes.saturating_sub(buf.len());
                    buf.extend_from_slice(&chunk[..n.min(room)]);
                    if buf.len() < limits.max_response_bytes && !http::response_complete(&buf) {
                        still.push((k, stream, buf));
                        continue;
                    }
                    match http::parse_response(&buf, limits) {
                        Ok(r) => {
                            asks[k].answer = Some(Ok(r.status));
                            if buf.len() < limits.max_response_bytes {
                                kept.push((k, stream));
                            }
                        }
                        Err(e) => asks[k].answer = Some(Err(e.to_string())),
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => still.push((k, stream, buf)),
                Err(e) => asks[k].answer = Some(Err(format!("read: {e}"))),
            }
        }
        live = still;
    }
    kept
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sidecar::testing::TestLink;
    use std::sync::atomic::AtomicBool;

    /// A keep-alive server answering 503 until `ready`, then 200; counts the requests.
    fn server(ready: Arc<AtomicBool>, asked: Arc<AtomicU64>) -> u16 {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("addr").port();
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                let (ready, asked) = (ready.clone(), asked.clone());
                std::thread::spawn(move || {
                    let mut conn = conn;
                    let mut buf = [0u8; 1024];
                    while let Ok(n) = conn.read(&mut buf) {
                        if n == 0 {
                            return;
                        }
                        asked.fetch_add(1, Ordering::SeqCst);
                        let answer: &[u8] = if ready.load(Ordering::SeqCst) {
                            b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
                        } else {
                            b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n"
                        };
                        if conn.write_all(answer).is_err() {
                            return;
                        }
                    }
                });
            }
        });
        port
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_proxy_that_does_not_answer_goes_back_to_its_loop_and_holds_the_others_once() {
        let (ready, asked) = (Arc::new(AtomicBool::new(true)), Arc::new(AtomicU64::new(0)));
        let port = server(ready, asked.clone());
        // A listener that accepts and never answers.
        let hung = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let hung_port = hung.local_addr().expect("addr").port();
        std::thread::spawn(move || {
            let _conns: Vec<_> = hung.incoming().flatten().collect();
        });
        let (tx, mut rx) = mpsc::unbounded_channel();
        let prober =
            HeldProber::start(Arc::new(TestLink { port, ports: vec![("hung", hung_port)], ..TestLink::default() }), tx);
        let hung_token = prober.hold("hung", vec![("istio-proxy".into(), hung_port, "/healthz/ready".into())]);
        let _ = prober.hold("fine", vec![("istio-proxy".into(), port, "/healthz/ready".into())]);
        let started = Instant::now();
        let got = tokio::time::timeout(Duration::from_secs(5), rx.recv()).await.ok().flatten();
        assert!(matches!(got, Some((ref uid, Feedback::Probed { ready: true, .. })) if uid == "fine"), "{got:?}");
        assert!(started.elapsed() < ANSWER_TIMEOUT * 2, "the other pod waited {:?}", started.elapsed());
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(!prober.probes("hung", hung_token), "the hung pod was not given back");
        let before = asked.load(Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert!(asked.load(Ordering::SeqCst) >= before + 5, "the other pod is no longer probed every 10 ms");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn held_pods_are_probed_on_kept_connections_until_given_back() {
        let (ready, asked) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicU64::new(0)));
        let port = server(ready.clone(), asked.clone());
        let (tx, mut rx) = mpsc::unbounded_channel();
        let prober = HeldProber::start(Arc::new(TestLink { port, ..TestLink::default() }), tx);
        let token = prober.hold("pod-a", vec![("istio-proxy".into(), port, "/healthz/ready".into())]);
        let Some((uid, Feedback::Probed { ready: false, detail })) =
            tokio::time::timeout(Duration::from_secs(5), rx.recv()).await.ok().flatten()
        else {
            panic!("no not-ready news")
        };
        assert_eq!((uid.as_str(), detail.as_str()), ("pod-a", "istio-proxy answered 503"));
        ready.store(true, Ordering::SeqCst);
        let flipped = Instant::now();
        let Some((_, Feedback::Probed { ready: true, .. })) =
            tokio::time::timeout(Duration::from_secs(5), rx.recv()).await.ok().flatten()
        else {
            panic!("no ready news")
        };
        assert!(flipped.elapsed() < Duration::from_secs(1), "ready seen after {:?}", flipped.elapsed());
        // Every 10 ms on one connection; nothing once the pod is given back.
        assert!(asked.load(Ordering::SeqCst) >= 2);
        prober.unhold("pod-a", token + 1);
        tokio::time::sleep(Duration::from_millis(50)).await;
        let before = asked.load(Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(asked.load(Ordering::SeqCst) > before, "a stale token gave the pod back");
        prober.unhold("pod-a", token);
        tokio::time::sleep(Duration::from_millis(50)).await;
        let after = asked.load(Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(asked.load(Ordering::SeqCst), after, "still probed after it was given back");
    }
}
