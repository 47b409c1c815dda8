//! One thread probes every held pod's proxies (`--held-prober`). Each period, every pod is asked
//! once on its kept connection, the pods in groups spread over the period (a flip waits for the
//! next group, not the next period); the answers are read as the epoll set says they are there
//! ([`super::held_poll`]), and a
//! group's news goes out together. A pod that turns ready brings the others' asks forward, once
//! a period: the held pods of a node often wait for the same thing. On the runtime, each probe cost
//! wake-ups of its threads for the answers (about twice the CPU per probe on a 2-core VM).
//!
//! The probe loops of the held pods hand their pod over while it is held, and only when the
//! pod's network namespace is open (the others' loops go on, with their pod-IP fallback). A pod
//! handed over is probed at once, as its loop did. Connections are made by this thread itself:
//! it joins the pod's namespace for the `socket` call alone ([`SidecarLink::pod_socket`]) and
//! connects without blocking, so a proxy that does not listen yet costs a refused connect, not a
//! thread. A proxy that does not answer holds back no one: its request stays open across slots
//! until the probe's deadline, and is then reported as a failure, as its loop would.

use std::collections::HashMap;
use std::fs::File;
use std::io::{Read as _, Write as _};
use std::os::fd::AsFd as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tracing::{debug, warn};

use super::PodFeedback;
use super::answer::{Answer, LIMITS, REPEAT, all_ready, detail};
use super::held_conn::{Conn, Endpoint, answer_so_far, connect, progress, send};
use super::held_pace::{Boost, Raise, Retired, SlotClock};
use super::held_poll::{Key, Poller};
use crate::effect::Feedback;
use crate::sidecar::SidecarLink;
use crate::sidecar::http::{self, Failure};

/// How long the news of a round waits for the round's slower answers: the answers of a slot
/// come within a millisecond or so, and their news then wakes the agent once. A sweep's round
/// waits as long as its answers keep coming, each within this of the one before.
const ROUND_WAIT: Duration = Duration::from_millis(2);
/// How long a sweep's news waits at most for the rest of its answers. Released, the first pods'
/// apps take the CPUs the other proxies need to answer: a 110-pod sweep's last tenth waited in
/// their sockets 18 ms at the median (58 ms at the p99) behind them, on a 2-core node.
const SWEEP_WAIT: Duration = Duration::from_millis(30);
/// While a sweep's answers are coming, they are read this often, together ([`Poller::wait_from`]):
/// its news waits for all of them anyway, and each answer read as it came took a CPU from the
/// proxies still to answer.
const SWEEP_READ_GAP: Duration = Duration::from_micros(250);
/// After a socket started listening in a pod, its proxy is asked this many more times, this far
/// apart, while it is not ready: a proxy binds its listeners just before it turns ready (Envoy
/// listens, then goes LIVE), so the first answer may still say no.
const LISTEN_BURST: u8 = 5;
const BURST_GAP: Duration = Duration::from_millis(2);
/// With nothing to do, how often the thread looks whether the agent is still there.
const IDLE_WAIT: Duration = Duration::from_secs(1);
/// A period's asks are spread over it in groups at least this far apart, and of at least this
/// many pods: a flip is seen by the next group's ask, and each group costs the thread its
/// wake-ups (for the group's slot, and for its answers).
const SPREAD_GAP: Duration = Duration::from_millis(2);
const GROUP_LEAST: usize = 4;
/// A spread group's answers are read this long after its asks, together, and do not wake the
/// thread before ([`read_from`]): read as each came, a probe cost the thread a wake-up more (about
/// twice the CPU on a 2-core VM); woken by each and reading none, a 110-pod poll's probe cost
/// 59-61 µs of its CPU, against 44-53 µs unwoken. A flip seen in them
/// brings the rest of the period forward ([`sweep`]); a sweep's answers are read as they come.
const ANSWER_LAG: Duration = Duration::from_millis(1);

/// A pod as handed over.
struct Wanted {
    /// Which hand-over this is: a loop that stops late does not take a newer one's pod away.
    token: u64,
    endpoints: Vec<(String, u16, String)>,
}

#[derive(Default)]
struct Registry {
    pods: HashMap<String, Wanted>,
    /// Pods to probe at once, at the thread's next turn.
    now: Vec<String>,
    /// Handed over, and given back, since the thread last looked: it takes the changes alone
    /// (a look over every pod, at each listen of a 110-pod round, cost it 2-3 ms a round).
    handed: Vec<String>,
    given_back: Vec<(String, u64)>,
    /// Bumped on every change (the thread looks at the pods only then).
    version: u64,
    /// The thread ended: nothing is probed here any more.
    ended: bool,
}

/// The prober thread and the pods handed to it.
pub struct HeldProber {
    registry: Mutex<Registry>,
    /// An eventfd: a hand-over wakes the thread.
    wake: File,
    interval_ns: AtomicU64,
    /// The thread's CPU budget: a share of one core (`f64` bits; 1.0 and above: none).
    cpu_share: AtomicU64,
    /// A request's deadline: [`LIMITS`]' total timeout (a test makes it longer, to look at the
    /// other pods while one request is still open).
    deadline_ns: AtomicU64,
    tokens: AtomicU64,
    /// Its real-time class for the asks a release waits on, which a hand-over or a listen puts it
    /// in before waking it.
    raise: Arc<Raise>,
}

struct Pod {
    uid: String,
    token: u64,
    endpoints: Vec<Endpoint>,
    /// Handed over since the last slot: probed at once.
    fresh: bool,
    /// Quick asks left after a listening socket ([`LISTEN_BURST`]), and when the next is due.
    burst: u8,
    burst_next: Option<Instant>,
    /// Its last ask was a listen's or its burst's: a flip on it is its own pod's news.
    listen_ask: bool,
    /// Asked, and not every answer is in yet.
    asked: bool,
    last: Option<(Vec<Answer>, Instant)>,
    /// When this period asks it, and which ask that is (its group's place in the period, or at
    /// once in a sweep).
    due: Option<(Instant, Due)>,
    /// When the answers of its lagged group's ask in flight are read.
    read_at: Option<Instant>,
}

/// Which ask a pod's due one is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Due {
    /// The period's only group: its answers read as they come.
    Group,
    /// One group of several: its answers read together, [`ANSWER_LAG`] after its asks.
    LaggedGroup,
    /// A sweep's: in the loop's class, its answers read as they come.
    Sweep,
}

impl Pod {
    /// A pod as `wanted` hands it over: probed at once (on connections made anew, or taken from
    /// its last hand-over: [`Pod::take_idle`]).
    fn handed(uid: String, wanted: &Wanted) -> Pod {
        let endpoints = wanted
            .endpoints
            .iter()
            .map(|(name, port, path)| {
                let addr = std::net::SocketAddr::from((std::net::Ipv4Addr::LOCALHOST, *port));
                let request = http::request_text(addr, "GET", path, true).into_bytes();
                Endpoint {
                    name: name.clone(),
                    port: *port,
                    request,
                    conn: Conn::None,
                    key: 0,
                    moved: false,
                    answer: None,
                }
            })
            .collect();
        Pod {
            uid,
            token: wanted.token,
            endpoints,
            fresh: true,
            burst: 0,
            burst_next: None,
            listen_ask: false,
            asked: false,
            last: None,
            due: None,
            read_at: None,
        }
    }

    /// Takes the idle connections of `old`, a hand-over of the same pod given back or replaced,
    /// for the same endpoints: a pod is handed over again when its loop starts anew (its IP
    /// known, a second after its start), and each connection made anew cost the thread a
    /// `setns` and a connect, and the old one's close (a 20-pod round's, 4.5 ms of its CPU at
    /// once, which the CPU budget then paid for with a period of 65-110 ms).
    fn take_idle(&mut self, old: &mut Pod) {
        for ep in self.endpoints.iter_mut().filter(|ep| matches!(ep.conn, Conn::None)) {
            let idle = old.endpoints.iter_mut().find(|o| {
                o.name == ep.name && o.port == ep.port && o.request == ep.request && matches!(o.conn, Conn::Idle(_))
            });
            if let Some(o) = idle {
                ep.conn = std::mem::replace(&mut o.conn, Conn::None);
                ep.key = o.key;
            }
        }
    }

    /// Whether its last answers were all ready (None: no answer yet).
    fn last_ready(&self) -> Option<bool> {
        self.last.as_ref().map(|(answers, _)| all_ready(answers))
    }
}

impl HeldProber {
    /// Starts the thread; its news goes to `tx`. It ends once `tx` is closed. None: no thread
    /// (the held pods are probed by their loops).
    /// `priority`: the thread's SCHED_FIFO priority (0: the normal class); `urgent`: its priority
    /// while the asks a release waits on are out, if it is in the normal class (0: none).
    pub fn start<L: SidecarLink>(
        link: Arc<L>,
        tx: mpsc::UnboundedSender<PodFeedback>,
        priority: u8,
        urgent: u8,
    ) -> Option<Arc<HeldProber>> {
        let wake = match crate::host::sys::eventfd() {
            Ok(fd) => File::from(fd),
            Err(e) => {
                warn!("no held-pod prober: eventfd: {e}");
                return None;
            }
        };
        let prober = Arc::new(HeldProber {
            registry: Mutex::new(Registry::default()),
            wake,
            interval_ns: AtomicU64::new(10_000_000),
            cpu_share: AtomicU64::new(1.0f64.to_bits()),
            deadline_ns: AtomicU64::new(nanos(LIMITS.total_timeout)),
            tokens: AtomicU64::new(0),
            raise: Raise::new(if priority == 0 { urgent } else { 0 }),
        });
        let p = prober.clone();
        let spawned = std::thread::Builder::new().name("valet-held".into()).spawn(move || {
            crate::host::sys::enter_real_time("the held pods' prober", priority);
            let boost = Boost::new(p.raise.clone());
            if let Err(why) = p.run(link.as_ref(), &tx, boost) {
                warn!("held-pod prober stops, its pods go back to their loops: {why}");
            }
            let mut registry = p.registry();
            registry.ended = true;
            registry.pods.clear();
        });
        match spawned {
            Ok(_) => Some(prober),
            Err(e) => {
                warn!("no held-pod prober thread: {e}");
                None
            }
        }
    }

    fn registry(&self) -> std::sync::MutexGuard<'_, Registry> {
        self.registry.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The held pods' probe interval (the shortest: the CPU budget may make it longer).
    pub fn set_interval(&self, interval: Duration) {
        self.interval_ns.store(nanos(interval).max(1), Ordering::Relaxed);
    }

    /// The thread's CPU budget, a share of one core (1.0: none).
    pub fn set_cpu_share(&self, share: f64) {
        self.cpu_share.store(share.to_bits(), Ordering::Relaxed);
    }

    #[cfg(test)]
    fn set_deadline(&self, deadline: Duration) {
        self.deadline_ns.store(nanos(deadline), Ordering::Relaxed);
        if let Err(e) = (&self.wake).write(&1u64.to_ne_bytes()) {
            debug!("waking the held-pod prober: {e}");
        }
    }

    fn deadline(&self) -> Duration {
        Duration::from_nanos(self.deadline_ns.load(Ordering::Relaxed))
    }

    /// Takes over probing pod `uid`'s `(name, port, path)` endpoints, at once and then every
    /// slot; returns the token for [`HeldProber::unhold`].
    pub fn hold(&self, uid: &str, endpoints: Vec<(String, u16, String)>) -> u64 {
        let token = self.tokens.fetch_add(1, Ordering::Relaxed);
        {
            let mut registry = self.registry();
            if registry.ended {
                return token;
            }
            registry.pods.insert(uid.to_owned(), Wanted { token, endpoints });
            registry.handed.push(uid.to_owned());
            registry.version += 1;
        }
        self.raise.raise();
        if let Err(e) = (&self.wake).write(&1u64.to_ne_bytes()) {
            debug!("waking the held-pod prober: {e}");
        }
        token
    }

    /// Probes pod `uid` at once, if it is probed here: a socket started listening in it.
    pub fn probe_now(&self, uid: &str) {
        {
            let mut registry = self.registry();
            if !registry.pods.contains_key(uid) {
                return;
            }
            registry.now.push(uid.to_owned());
            registry.version += 1;
        }
        self.raise.raise();
        if let Err(e) = (&self.wake).write(&1u64.to_ne_bytes()) {
            debug!("waking the held-pod prober: {e}");
        }
    }

    /// Whether the pod handed over with `token` is probed here (not once the thread ended).
    pub fn probes(&self, uid: &str, token: u64) -> bool {
        self.registry().pods.get(uid).is_some_and(|p| p.token == token)
    }

    /// Gives pod `uid` back to its loop, if `token` is still its hand-over.
    pub fn unhold(&self, uid: &str, token: u64) {
        let mut registry = self.registry();
        if registry.pods.get(uid).is_some_and(|p| p.token == token) {
            registry.pods.remove(uid);
            registry.given_back.push((uid.to_owned(), token));
            registry.version += 1;
        }
    }

    /// The pods of the registry, if it changed since `seen`: new ones fresh, their connections
    /// made anew; those given back into `retired` (their connections closed later, off the
    /// release's path).
    fn sync(&self, pods: &mut Vec<Pod>, retired: &mut Retired<Pod>, seen: &mut u64) {
        let mut registry = self.registry();
        if registry.version == *seen {
            return;
        }
        *seen = registry.version;
        for (uid, token) in std::mem::take(&mut registry.given_back) {
            if let Some(i) = pods.iter().position(|p| p.token == token && p.uid == uid) {
                retired.push(pods.swap_remove(i));
            }
        }
        for uid in std::mem::take(&mut registry.handed) {
            let Some(wanted) = registry.pods.get(&uid) else { continue };
            // Handed over again while held: the newer hand-over replaces the pod.
            if let Some(i) = pods.iter().position(|p| p.uid == uid && p.token != wanted.token) {
                retired.push(pods.swap_remove(i));
            }
            if pods.iter().any(|p| p.token == wanted.token) {
                continue;
            }
            let mut pod = Pod::handed(uid, wanted);
            for (_, old) in retired.0.iter_mut().rev() {
                if old.uid == pod.uid {
                    pod.take_idle(old);
                }
            }
            pods.push(pod);
        }
        for uid in std::mem::take(&mut registry.now) {
            if let Some(pod) = pods.iter_mut().find(|p| p.uid == uid) {
                pod.fresh = true;
                pod.burst = LISTEN_BURST;
                pod.burst_next = None;
            }
        }
    }

    /// Probes until the agent is gone (Ok) or this thread may make no other socket (Err).
    fn run(
        &self,
        link: &dyn SidecarLink,
        tx: &mpsc::UnboundedSender<PodFeedback>,
        mut boost: Boost,
    ) -> Result<(), String> {
        let mut clock = SlotClock::new(Instant::now());
        let mut pods: Vec<Pod> = Vec::new();
        let mut seen = 0;
        let mut retired = Retired::default();
        // The open round: its news waits a moment for the rest of its answers.
        let mut round: Option<Round> = None;
        let mut news: Vec<PodFeedback> = Vec::new();
        let mut poller = Poller::new().map_err(|e| format!("epoll: {e}"))?;
        let mut moved = Vec::new();
        // This period's asks were brought forward by a pod that turned ready.
        let mut swept = false;
        // While a sweep's round is open: when its answers are next read.
        let mut next_read = Instant::now();
        loop {
            if tx.is_closed() {
                return Ok(());
            }
            self.sync(&mut pods, &mut retired, &mut seen);
            let now = Instant::now();
            boost.adopt(now);
            let floor = Duration::from_nanos(self.interval_ns.load(Ordering::Relaxed));
            let share = f64::from_bits(self.cpu_share.load(Ordering::Relaxed));
            if !pods.is_empty() && clock.slot(now, floor, share, pods.len()) {
                swept = false;
                spread(&mut pods, now, clock.next.saturating_duration_since(now));
            }
            if ask_due(link, &poller, &mut pods, now, &mut boost)? {
                round.get_or_insert(Round::new(now));
            }
            let deadline = self.deadline();
            expire(&mut pods, Instant::now(), deadline);
            // A pod that turned ready brings the others' asks forward, once a period: the held
            // pods of a node often wait for the same thing (the control plane's first push).
            if collect(&mut pods, &mut news) && !swept {
                swept = true;
                let now = Instant::now();
                sweep(&mut pods, now);
                // Its news and the flip's go out together, once the sweep's answers are in.
                round.get_or_insert(Round::new(now)).swept(now);
            }
            go_on_bursting(&mut pods, Instant::now());
            // The round's news, once its answers are in or it waited long enough.
            if let Some(r) = &mut round {
                let now = Instant::now();
                r.note(round_left(&pods, r.at), now);
                if r.over(now) {
                    round = None;
                }
            }
            if round.is_none() {
                for report in news.drain(..) {
                    if tx.send(report).is_err() {
                        return Ok(());
                    }
                }
            }
            // Out of the loop's class only once the news is sent: the apps its first releases
            // wake would otherwise take the CPU from the rest of it (a 110-pod sweep's last
            // releases went out 47-87 ms after its answers, at the p99).
            boost.end_when_answered(
                |at| in_flight(&pods).any(|since| since >= at) || pods.iter().any(|p| p.burst > 0),
                || self.registry().version != seen,
            );
            let now = Instant::now();
            let until =
                wake_at(&pods, now, clock.next, round.as_ref().map(Round::ends_at), retired.close_due(now), deadline);
            let paced = round.as_ref().and_then(|r| r.sweep).map(|_| next_read);
            self.wait(link, &mut poller, &mut moved, &mut pods, paced, until.saturating_duration_since(now))?;
            let now = Instant::now();
            if paced.is_some_and(|at| now >= at) {
                next_read = now + SWEEP_READ_GAP;
            }
        }
    }

    /// Waits up to `left` for the wake-up or for a connection to move (looked at only from
    /// [`read_from`] on; `paced`: a sweep's next read), and moves those that did.
    /// A connection that moved while its pod's lagged group waited is marked (an edge-triggered
    /// event comes once) and moved once the pod is not lagged: its lag over, or the pod asked
    /// again meanwhile, out of its group (handed over, or a listen's); it returns at once then.
    /// Err: this thread may make no other socket.
    fn wait(
        &self,
        link: &dyn SidecarLink,
        poller: &mut Poller,
        moved: &mut Vec<Key>,
        pods: &mut [Pod],
        paced: Option<Instant>,
        left: Duration,
    ) -> Result<(), String> {
        let now = Instant::now();
        let mut lag_over = false;
        for pod in pods.iter_mut().filter(|p| p.read_at.is_some_and(|at| at <= now)) {
            pod.read_at = None;
            lag_over = true;
        }
        if lag_over | move_marked(link, poller, pods, now)? {
            return Ok(());
        }
        let from = read_from(pods, paced).map_or(Duration::ZERO, |at| at.saturating_duration_since(now));
        let waited = poller.wait_from(self.wake.as_fd(), from, left, moved);
        if waited.woken {
            let _ = (&self.wake).read(&mut [0u8; 8]);
        }
        if waited.moved.is_empty() {
            return Ok(());
        }
        // A lagged group's answers wait for its lag (their events came once: marked, read then).
        for ep in pods.iter_mut().flat_map(|p| &mut p.endpoints) {
            ep.moved |= ep.in_flight() && waited.moved.contains(&ep.key);
        }
        move_marked(link, poller, pods, Instant::now())?;
        Ok(())
    }
}

/// Moves the connections marked moved of the pods not lagged. True if any was. Err: this thread
/// may make no other socket.
fn move_marked(link: &dyn SidecarLink, poller: &Poller, pods: &mut [Pod], now: Instant) -> Result<bool, String> {
    let mut any = false;
    for pod in pods.iter_mut().filter(|p| p.read_at.is_none()) {
        for ep in pod.endpoints.iter_mut().filter(|ep| ep.moved) {
            any = true;
            progress(link, poller, &pod.uid, ep, now)?;
        }
    }
    Ok(any)
}

/// Asks every pod whose ask is due at `now`: its group's, a sweep's, a burst's, or handed over.
/// Those a release waits on go out in the loop's class (`boost`). True if any was asked. Err: this
/// thread may make no other socket.
fn ask_due(
    link: &dyn SidecarLink,
    poller: &Poller,
    pods: &mut [Pod],
    now: Instant,
    boost: &mut Boost,
) -> Result<bool, String> {
    let burst_due = |p: &Pod| p.burst_next.is_some_and(|at| now >= at);
    // A pod waiting for an answer keeps its due ask until the answer is in.
    let due = |p: &Pod| !p.asked && p.due.is_some_and(|(at, _)| now >= at);
    let sweep_due = |p: &Pod| due(p) && p.due.is_some_and(|(_, kind)| kind == Due::Sweep);
    if pods.iter().any(|p| p.fresh || burst_due(p) || sweep_due(p)) {
        boost.start(now);
    }
    let mut asked = false;
    for pod in pods.iter_mut().filter(|p| due(p) || p.fresh || burst_due(p)) {
        asked = true;
        let lagged = pod.due.is_some_and(|(_, kind)| kind == Due::LaggedGroup) && !pod.fresh && !burst_due(pod);
        pod.read_at = lagged.then_some(now + ANSWER_LAG);
        pod.listen_ask = pod.burst > 0;
        pod.fresh = false;
        if due(pod) {
            pod.due = None;
        }
        if burst_due(pod) {
            pod.burst_next = None;
            pod.burst -= 1;
        }
        ask(link, poller, pod, now)?;
    }
    Ok(asked)
}

/// Until when the thread waits at `now`, if no answer or hand-over comes first: the next `slot`,
/// a pod's ask or its lagged group's read, the `round`'s end, a retired pod's close, a request's
/// `deadline`.
fn wake_at(
    pods: &[Pod],
    now: Instant,
    slot: Instant,
    round: Option<Instant>,
    retired: Option<Instant>,
    deadline: Duration,
) -> Instant {
    let slot = (!pods.is_empty()).then_some(slot);
    let expiry = in_flight(pods).min().map(|first| first + deadline);
    [slot, next_ask(pods, now), round, retired, expiry].into_iter().flatten().fold(now + IDLE_WAIT, Instant::min)
}

/// From when the thread looks at its connections: at once, but while a sweep's answers come
/// (`paced`: its next read), or while every request in flight is a lagged group's (the first
/// group's lag over). Woken by each answer, a thread that reads none of them yet pays a wake-up
/// for nothing; in the real-time class, it also takes the CPU from the proxies still to answer.
fn read_from(pods: &[Pod], paced: Option<Instant>) -> Option<Instant> {
    if paced.is_some() {
        return paced;
    }
    let mut first: Option<Instant> = None;
    for pod in pods.iter().filter(|p| p.endpoints.iter().any(Endpoint::in_flight)) {
        let at = pod.read_at?;
        first = Some(first.map_or(at, |f| f.min(at)));
    }
    first
}

/// The next moment a pod is to be asked, or its lagged group's answers read.
fn next_ask(pods: &[Pod], now: Instant) -> Option<Instant> {
    let next = |p: &Pod| {
        let read = p.read_at.filter(|at| p.asked && *at > now);
        let due = p.due.map(|(at, _)| at).filter(|_| !p.asked);
        p.burst_next.into_iter().chain(due).chain(read).min()
    };
    pods.iter().filter_map(next).min()
}

/// The asks whose news goes out together, and how their answers are coming.
struct Round {
    /// When its first requests went out (those sent since are its own too).
    at: Instant,
    /// When a sweep joined it: its news waits while its answers keep coming, up to
    /// [`SWEEP_WAIT`] from then.
    sweep: Option<Instant>,
    /// Its requests in flight when last counted, and when the count last fell.
    left: usize,
    answered: Instant,
}

impl Round {
    fn new(at: Instant) -> Round {
        Round { at, sweep: None, left: usize::MAX, answered: at }
    }

    /// A sweep joined it at `now`.
    fn swept(&mut self, now: Instant) {
        self.sweep = Some(now);
        self.answered = now;
    }

    /// Its requests still in flight at `now`.
    fn note(&mut self, left: usize, now: Instant) {
        if left < self.left {
            self.answered = now;
        }
        self.left = left;
    }

    /// When its news goes out while some answers are missing: [`ROUND_WAIT`] after its asks; a
    /// sweep's, [`ROUND_WAIT`] after its last answer, at most [`SWEEP_WAIT`] after the sweep.
    fn ends_at(&self) -> Instant {
        match self.sweep {
            Some(swept) => (self.answered + ROUND_WAIT).min(swept + SWEEP_WAIT),
            None => self.at + ROUND_WAIT,
        }
    }

    /// Its news goes out: every answer is in, or it waited long enough.
    fn over(&self, now: Instant) -> bool {
        self.left == 0 || now >= self.ends_at()
    }
}

/// The requests of a round that began at `at` still unanswered: those in flight sent since, and
/// a sweep's asks not made yet (a pod waiting for an earlier answer is asked once it has it; the
/// sweep's cue is collected before its asks go out).
fn round_left(pods: &[Pod], at: Instant) -> usize {
    let swept_later = pods.iter().filter(|p| p.due.is_some_and(|(_, kind)| kind == Due::Sweep)).count();
    in_flight(pods).filter(|since| *since >= at).count() + swept_later
}

/// A period's asks, spread over `period` from `now` in groups at least [`SPREAD_GAP`] apart and
/// of at least [`GROUP_LEAST`] pods, so that a flip waits for the next group rather than for the
/// next period.
fn spread(pods: &mut [Pod], now: Instant, period: Duration) {
    let n = pods.len().max(1);
    let by_gap = usize::try_from(period.as_nanos() / SPREAD_GAP.as_nanos()).unwrap_or(usize::MAX);
    let groups = by_gap.min(n / GROUP_LEAST).max(1);
    let gap = period.div_f64(groups as f64);
    let kind = if groups > 1 { Due::LaggedGroup } else { Due::Group };
    for (i, pod) in pods.iter_mut().enumerate() {
        pod.due = Some((now + gap.mul_f64((i * groups / n) as f64), kind));
    }
}

/// Every pod not ready by its last answer is asked at `now` (one waiting for an answer, asked
/// before the flip, once it has it): in place of its ask later in the period.
fn sweep(pods: &mut [Pod], now: Instant) {
    for pod in pods.iter_mut().filter(|p| p.last_ready() != Some(true)) {
        pod.due = Some((now, Due::Sweep));
    }
}

/// A burst goes on while the pod's answers are in and not ready yet.
fn go_on_bursting(pods: &mut [Pod], now: Instant) {
    for pod in pods.iter_mut().filter(|p| p.burst > 0 && !p.asked && p.burst_next.is_none()) {
        if pod.last_ready() == Some(true) {
            pod.burst = 0;
        } else {
            pod.burst_next = Some(now + BURST_GAP);
        }
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

/// The times the requests in flight went out.
fn in_flight(pods: &[Pod]) -> impl Iterator<Item = Instant> + '_ {
    pods.iter().flat_map(|p| &p.endpoints).filter_map(|ep| match ep.conn {
        Conn::Connecting { since, .. } | Conn::Waiting { since, .. } => Some(since),
        Conn::None | Conn::Idle(_) => None,
    })
}

/// Asks every endpoint of `pod` whose last request was answered. Err: this thread may make no
/// other socket.
fn ask(link: &dyn SidecarLink, poller: &Poller, pod: &mut Pod, now: Instant) -> Result<(), String> {
    pod.asked = true;
    for ep in &mut pod.endpoints {
        if matches!(ep.conn, Conn::Connecting { .. } | Conn::Waiting { .. }) {
            continue;
        }
        ep.answer = None;
        match std::mem::replace(&mut ep.conn, Conn::None) {
            Conn::Idle(stream) => send(link, poller, &pod.uid, ep, stream, now, true)?,
            _ => connect(link, poller, &pod.uid, ep, now)?,
        }
    }
    Ok(())
}

/// Requests past the probe's deadline are answered with a failure, as a loop's probe would be;
/// their connections are dropped (the next slot makes a new one).
fn expire(pods: &mut [Pod], now: Instant, deadline: Duration) {
    for ep in pods.iter_mut().flat_map(|p| &mut p.endpoints) {
        let answer = match &ep.conn {
            Conn::Connecting { since, .. } if now.duration_since(*since) >= LIMITS.connect_timeout => {
                Answer::Failed(Failure::ConnectTimeout.to_string())
            }
            // A status line that already arrived is an answer, even if the rest hangs.
            Conn::Waiting { since, buf, .. } if now.duration_since(*since) >= deadline => {
                answer_so_far(buf, Failure::Timeout.to_string())
            }
            _ => continue,
        };
        ep.conn = Conn::None;
        ep.moved = false;
        ep.answer = Some(answer);
    }
}

/// The news of every pod whose answers are all in: a changed answer, or the same after a while.
/// True if a pod whose last answers were not all ready now is, on an ask no listen brought (a
/// sweep's cue): a binding proxy's listen is its own pod's news, and each of the others that binds
/// brings its own ask. Swept at a 110-pod round's first listen, the 109 others, still binding,
/// answered 503 on the CPUs they needed to bind.
fn collect(pods: &mut [Pod], news: &mut Vec<PodFeedback>) -> bool {
    let mut flipped = false;
    for pod in pods.iter_mut().filter(|p| p.asked && p.endpoints.iter().all(|ep| ep.answer.is_some())) {
        pod.asked = false;
        // Compared in place: an unchanged answer, the common case, costs no allocation.
        let unchanged = pod.last.as_ref().is_some_and(|(last, at)| {
            at.elapsed() < REPEAT
                && last.len() == pod.endpoints.len()
                && last.iter().zip(&pod.endpoints).all(|(l, ep)| ep.answer.as_ref() == Some(l))
        });
        if unchanged {
            pod.endpoints.iter_mut().for_each(|ep| ep.answer = None);
            continue;
        }
        let answers: Vec<Answer> = pod.endpoints.iter_mut().filter_map(|ep| ep.answer.take()).collect();
        let ready = all_ready(&answers);
        flipped |= ready && pod.last_ready() == Some(false) && !pod.listen_ask;
        let detail = detail(pod.endpoints.iter().map(|ep| ep.name.as_str()), &answers);
        pod.last = Some((answers, Instant::now()));
        news.push((pod.uid.clone(), Feedback::Probed { ready, detail }));
    }
    flipped
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sidecar::testing::TestLink;
    use std::sync::atomic::AtomicBool;

    /// Only a guard against a hang: the tests wait for events, never for a time.
    const HANG_GUARD: Duration = Duration::from_secs(30);

    /// What a test server saw: requests, connections, and connections the prober closed (each
    /// counted once its requests were).
    #[derive(Default)]
    struct Seen {
        requests: AtomicU64,
        conns: AtomicU64,
        closed: AtomicU64,
    }

    /// A keep-alive server on `listener` answering 503 until `ready`, then 200; `close`: it
    /// closes each connection after one answer, without saying so.
    fn serve(listener: std::net::TcpListener, ready: Arc<AtomicBool>, seen: Arc<Seen>, close: bool) {
        std::thread::spawn(move || {
            for conn in listener.incoming().flatten() {
                seen.conns.fetch_add(1, Ordering::SeqCst);
                let (ready, seen) = (ready.clone(), seen.clone());
                std::thread::spawn(move || {
                    let mut conn = conn;
                    let mut buf = [0u8; 1024];
                    while let Ok(n) = conn.read(&mut buf) {
                        if n == 0 {
                            break;
                        }
                        seen.requests.fetch_add(1, Ordering::SeqCst);
                        let answer: &[u8] = if ready.load(Ordering::SeqCst) {
                            b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
                        } else {
                            b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\n\r\n"
                        };
                        if conn.write_all(answer).is_err() || close {
                            break;
                        }
                    }
                    seen.closed.fetch_add(1, Ordering::SeqCst);
                });
            }
        });
    }

    fn server(ready: bool, close: bool) -> (u16, Arc<AtomicBool>, Arc<Seen>) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let (ready, seen) = (Arc::new(AtomicBool::new(ready)), Arc::new(Seen::default()));
        serve(listener, ready.clone(), seen.clone(), close);
        (port, ready, seen)
    }

    fn endpoint(port: u16) -> Vec<(String, u16, String)> {
        vec![("istio-proxy".into(), port, "/healthz/ready".into())]
    }

    fn prober() -> (Arc<HeldProber>, mpsc::UnboundedReceiver<PodFeedback>) {
        let (tx, rx) = mpsc::unbounded_channel();
        (HeldProber::start(Arc::new(TestLink::default()), tx, 0, 0).expect("a prober thread"), rx)
    }

    async fn next(rx: &mut mpsc::UnboundedReceiver<PodFeedback>) -> (String, bool, String) {
        match tokio::time::timeout(HANG_GUARD, rx.recv()).await.ok().flatten() {
            Some((uid, Feedback::Probed { ready, detail })) => (uid, ready, detail),
            other => panic!("no probe news: {other:?}"),
        }
    }

    /// The next news of `uid` that is not `unchanged` (an unchanged answer is news again after
    /// [`REPEAT`], which a busy machine can reach; other pods' news is passed over).
    async fn next_of(
        rx: &mut mpsc::UnboundedReceiver<PodFeedback>,
        uid: &str,
        unchanged: Option<(bool, &str)>,
    ) -> (bool, String) {
        loop {
            let (of, ready, detail) = next(rx).await;
            if of == uid && unchanged != Some((ready, detail.as_str())) {
                return (ready, detail);
            }
        }
    }

    /// Waits until `f` holds (panics with `what` at the hang guard).
    async fn until(what: &str, f: impl Fn() -> bool) {
        let deadline = Instant::now() + HANG_GUARD;
        while !f() {
            assert!(Instant::now() < deadline, "never: {what}");
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    fn count(n: &AtomicU64) -> u64 {
        n.load(Ordering::SeqCst)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn held_pods_are_probed_on_one_kept_connection_until_given_back() {
        let (port, ready, seen) = server(false, false);
        let (prober, mut rx) = prober();
        let token = prober.hold("pod-a", endpoint(port));
        assert_eq!(next(&mut rx).await, ("pod-a".into(), false, "istio-proxy answered 503".into()));
        ready.store(true, Ordering::SeqCst);
        let unchanged = Some((false, "istio-proxy answered 503"));
        assert_eq!(next_of(&mut rx, "pod-a", unchanged).await, (true, "istio-proxy answered 200".into()));
        // Probed again and again, on the one connection.
        until("five probes", || count(&seen.requests) >= 5).await;
        assert_eq!(count(&seen.conns), 1, "a connection per probe");
        // A stale token gives nothing back: the probes go on.
        prober.unhold("pod-a", token + 1);
        assert!(prober.probes("pod-a", token), "a stale token gave the pod back");
        let before = count(&seen.requests);
        until("probes after a stale give-back", || count(&seen.requests) >= before + 3).await;
        // Given back: the prober drops its connection, and makes no other. The proof that no
        // probe follows is another pod's, handed over later and probed slot after slot by the
        // same thread (which looks at its pods, and drops pod-a, before it probes pod-b).
        prober.unhold("pod-a", token);
        assert!(!prober.probes("pod-a", token));
        let (other_port, _, other) = server(true, false);
        let _ = prober.hold("pod-b", endpoint(other_port));
        assert_eq!(next_of(&mut rx, "pod-b", None).await, (true, "istio-proxy answered 200".into()));
        until("pod-a's connection closed", || count(&seen.closed) == count(&seen.conns)).await;
        let after = count(&seen.requests);
        until("pod-b probed in later slots", || count(&other.requests) >= 5).await;
        assert_eq!(count(&seen.requests), after, "still probed after it was given back");
        assert_eq!(count(&seen.conns), 1, "a new connection after it was given back");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_pod_handed_over_is_probed_at_once_not_at_the_next_slot() {
        let (port, _, _) = server(true, false);
        let (prober, mut rx) = prober();
        // The next slot is an hour away, far past the hang guard: only a probe at once is seen.
        prober.set_interval(Duration::from_secs(3600));
        let _ = prober.hold("first", endpoint(port));
        assert_eq!(next(&mut rx).await.0, "first");
        let _ = prober.hold("second", endpoint(port));
        assert_eq!(next(&mut rx).await.0, "second");
    }

    /// A held pod as the thread keeps it, with no connection and `last`'s answer.
    fn held(uid: &str, last: Option<u16>) -> Pod {
        let mut pod = Pod::handed(uid.into(), &Wanted { token: 0, endpoints: Vec::new() });
        pod.fresh = false;
        pod.last = last.map(|status| (vec![Answer::Status(status)], Instant::now()));
        pod
    }

    #[test]
    fn a_period_asks_its_pods_in_groups_spread_over_it() {
        let now = Instant::now();
        let ms = Duration::from_millis;
        let at = |pods: &[Pod]| -> Vec<Duration> {
            pods.iter().map(|p| p.due.expect("due").0.duration_since(now)).collect()
        };
        // 40 pods over 10 ms: five groups of eight, 2 ms apart, their answers read late.
        let mut pods: Vec<Pod> = (0..40).map(|i| held(&format!("p{i}"), None)).collect();
        spread(&mut pods, now, ms(10));
        let want: Vec<Duration> = (0..40).map(|i| ms(2 * (i / 8))).collect();
        assert_eq!(at(&pods), want);
        assert!(pods.iter().all(|p| p.due.is_some_and(|(_, kind)| kind == Due::LaggedGroup)));
        // Over 100 ms: ten groups (four pods at least), 10 ms apart.
        spread(&mut pods, now, ms(100));
        let want: Vec<Duration> = (0..40).map(|i| ms(10 * (i / 4))).collect();
        assert_eq!(at(&pods), want);
        // Too few pods for two groups, or a period shorter than a gap: all at once, their
        // answers read as they come.
        let mut few: Vec<Pod> = (0..7).map(|i| held(&format!("p{i}"), None)).collect();
        spread(&mut few, now, ms(30));
        assert_eq!(at(&few), vec![ms(0); 7]);
        assert!(few.iter().all(|p| p.due.is_some_and(|(_, kind)| kind == Due::Group)));
        spread(&mut pods, now, ms(1));
        assert_eq!(at(&pods), vec![ms(0); 40]);
        spread(&mut [], now, ms(10));
    }

    #[test]
    fn a_sweep_asks_the_pods_not_ready_by_their_last_answer() {
        let now = Instant::now();
        let mut pods =
            vec![held("ready", Some(200)), held("not-yet", Some(503)), held("new", None), held("asked", Some(503))];
        pods[3].asked = true;
        let later = now + Duration::from_millis(30);
        pods.iter_mut().for_each(|p| p.due = Some((later, Due::LaggedGroup)));
        sweep(&mut pods, now);
        let due: Vec<bool> = pods.iter().map(|p| p.due.is_some_and(|(at, _)| at == now)).collect();
        assert_eq!(due, vec![false, true, true, true]);
        // A sweep's asks go out in the loop's class, their answers read as they come; the ready
        // pod keeps its group's.
        let kinds: Vec<Due> = pods.iter().filter_map(|p| p.due.map(|(_, kind)| kind)).collect();
        assert_eq!(kinds, vec![Due::LaggedGroup, Due::Sweep, Due::Sweep, Due::Sweep]);
    }

    /// A request of `pod` in flight, on a connection to `listener`.
    fn in_flight_on(pod: &mut Pod, listener: &std::net::TcpListener) {
        let stream = std::net::TcpStream::connect(listener.local_addr().expect("addr")).expect("connect");
        let since = Instant::now();
        pod.endpoints.push(Endpoint {
            name: "istio-proxy".into(),
            port: 0,
            request: Vec::new(),
            conn: Conn::Waiting { stream, since, buf: Vec::new(), reused: false },
            key: 0,
            moved: false,
            answer: None,
        });
    }

    // The thread looks at its connections at once, but while every request in flight is a lagged
    // group's (until the first lag is over) or a sweep's answers are coming (at its next read):
    // it reads none of them before, and each would wake it.
    #[test]
    fn answers_not_to_be_read_yet_do_not_wake_the_thread() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let now = Instant::now();
        let ms = Duration::from_millis;
        let mut pods = vec![held("a", None), held("b", None), held("idle", None)];
        assert_eq!(read_from(&pods, None), None, "nothing in flight");
        in_flight_on(&mut pods[0], &listener);
        in_flight_on(&mut pods[1], &listener);
        pods[0].read_at = Some(now + ms(2));
        pods[1].read_at = Some(now + ms(1));
        // A pod with nothing in flight has no say, whatever its lag.
        pods[2].read_at = Some(now + ms(5));
        assert_eq!(read_from(&pods, None), Some(now + ms(1)), "the first lag's end");
        pods[1].read_at = None;
        assert_eq!(read_from(&pods, None), None, "an answer read as it comes");
        assert_eq!(read_from(&pods, Some(now + ms(3))), Some(now + ms(3)), "a sweep's next read");
    }

    // A sweep's news goes out once its answers are in: its asks not made yet are its own, and it
    // waits while its answers keep coming (released, the first pods' apps would take the CPUs
    // the other proxies need to answer), up to a bound; a round with no sweep waits a moment.
    #[test]
    fn a_sweeps_news_waits_while_its_answers_keep_coming() {
        let at = Instant::now();
        let mut pods = vec![held("flipped", Some(200)), held("a", Some(503)), held("b", Some(503))];
        sweep(&mut pods, at);
        assert_eq!(round_left(&pods, at), 2, "the sweep's asks, not made yet, are the round's");
        let mut round = Round::new(at);
        round.note(0, at);
        assert!(round.over(at), "no sweep and nothing in flight: its news goes out");
        round.swept(at);
        round.note(round_left(&pods, at), at);
        assert!(!round.over(at + ROUND_WAIT / 2), "the sweep's answers are missing");
        assert_eq!(round.ends_at(), at + ROUND_WAIT, "no answer yet: a moment");
        // An answer keeps it open past a plain round's wait; a look with none does not ...
        let step = Duration::from_millis(1);
        round.note(1, at + step);
        round.note(1, at + 2 * step);
        assert_eq!(round.ends_at(), at + step + ROUND_WAIT, "from its last answer");
        assert!(!round.over(at + step + ROUND_WAIT / 2));
        assert!(round.over(at + step + ROUND_WAIT), "the rest may never come");
        round.note(0, at + 2 * step);
        assert!(round.over(at + 2 * step), "every answer is in");
        // ... up to its bound, from the sweep (a round its thread came back to late may be older).
        let mut long = Round::new(at);
        let swept = at + 50 * step;
        long.swept(swept);
        for k in 1..=100u32 {
            long.note(1000 - k as usize, swept + step * k);
        }
        assert_eq!(long.ends_at(), swept + SWEEP_WAIT);
        let plain = Round::new(at);
        assert_eq!(plain.ends_at(), at + ROUND_WAIT);
    }

    // The held pods of a node often wait for the same thing: one the poll finds ready brings every
    // other pod's ask forward, once a period. The slot after the servers turn ready spreads the
    // eight pods in two groups over a period that the CPU budget, cut to nothing just before it,
    // makes hours long: the second group is asked within the hang guard only by the sweep.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_pod_the_poll_finds_ready_brings_the_others_asks_forward() {
        let (prober, mut rx) = prober();
        prober.set_interval(Duration::from_secs(2));
        let servers: Vec<_> = (0..8).map(|_| server(false, false)).collect();
        // (In the normal class here: the prober of these tests has no real-time priority.)
        for (i, (port, _, _)) in servers.iter().enumerate() {
            let _ = prober.hold(&format!("pod-{i}"), endpoint(*port));
            assert!(!next_of(&mut rx, &format!("pod-{i}"), None).await.0);
        }
        servers.iter().for_each(|(_, ready, _)| ready.store(true, Ordering::SeqCst));
        prober.set_cpu_share(1e-9);
        let mut ready = std::collections::BTreeSet::new();
        while ready.len() < 8 {
            let (uid, is_ready, detail) = next(&mut rx).await;
            if is_ready {
                assert_eq!(detail, "istio-proxy answered 200");
                ready.insert(uid);
            }
        }
    }

    /// A prober with no thread: the test does the thread's work in its place.
    fn threadless() -> HeldProber {
        HeldProber {
            registry: Mutex::new(Registry::default()),
            wake: File::from(crate::host::sys::eventfd().expect("eventfd")),
            interval_ns: AtomicU64::new(0),
            cpu_share: AtomicU64::new(0),
            deadline_ns: AtomicU64::new(0),
            tokens: AtomicU64::new(0),
            raise: Raise::new(0),
        }
    }

    // An answer that came while its pod's lagged group waited is read as soon as the pod is asked
    // out of its group (a listen's ask, a hand-over), not at the request's deadline: its
    // edge-triggered event came once, before. Seen as a 20-pod round's p99 at 500 ms.
    #[test]
    fn an_answer_that_came_in_a_lag_is_read_once_the_pod_is_asked_out_of_its_group() {
        let (port, _, seen) = server(true, false);
        let prober = threadless();
        let link = TestLink::default();
        let mut poller = Poller::new().expect("epoll");
        let mut boost = Boost::new(Raise::new(0));
        let mut moved = Vec::new();
        let mut pods = vec![Pod::handed("pod".into(), &Wanted { token: 0, endpoints: endpoint(port) })];
        let guard = Instant::now() + HANG_GUARD;
        let wait_until = |poller: &mut Poller, pods: &mut Vec<Pod>, what: &str, done: &dyn Fn(&Endpoint) -> bool| {
            let mut moved = Vec::new();
            while !done(&pods[0].endpoints[0]) {
                assert!(Instant::now() < guard, "never: {what}");
                prober.wait(&link, poller, &mut moved, pods, None, Duration::from_millis(100)).expect("wait");
            }
        };
        // Handed over: asked at once, on a connection kept afterwards.
        assert!(ask_due(&link, &poller, &mut pods, Instant::now(), &mut boost).expect("ask"));
        wait_until(&mut poller, &mut pods, "the first answer", &|ep| ep.answer.is_some());
        assert!(matches!(pods[0].endpoints[0].conn, Conn::Idle(_)), "the connection not kept");
        assert!(!collect(&mut pods, &mut Vec::new()), "no sweep's cue");
        // Its group's ask, lagged; its lag outlasts the test, as the busy thread's may.
        let now = Instant::now();
        pods[0].due = Some((now, Due::LaggedGroup));
        assert!(ask_due(&link, &poller, &mut pods, now, &mut boost).expect("ask"));
        pods[0].read_at = Some(now + 2 * HANG_GUARD);
        // Alone in flight, its answer does not wake the thread before its lag is over.
        prober.wait(&link, &mut poller, &mut moved, &mut pods, None, Duration::from_millis(100)).expect("wait");
        assert!(!pods[0].endpoints[0].moved, "looked at in its group's lag");
        // Another pod's answer, read as it comes: the lagged one's event, taken with it, is marked.
        let (other, _, _) = server(true, false);
        pods.push(Pod::handed("other".into(), &Wanted { token: 1, endpoints: endpoint(other) }));
        assert!(ask_due(&link, &poller, &mut pods, Instant::now(), &mut boost).expect("ask"));
        wait_until(&mut poller, &mut pods, "the answer's event", &|ep| ep.moved);
        assert_eq!(pods[0].endpoints[0].answer, None, "read in its group's lag");
        // A listen: the pod is asked at once, out of its group; its request is already out.
        pods[0].fresh = true;
        assert!(ask_due(&link, &poller, &mut pods, Instant::now(), &mut boost).expect("ask"));
        assert_eq!(pods[0].read_at, None);
        // No event comes any more: a wait that does not return at once lasts the hang guard.
        prober.wait(&link, &mut poller, &mut moved, &mut pods, None, HANG_GUARD).expect("wait");
        assert_eq!(pods[0].endpoints[0].answer, Some(Answer::Status(200)), "the answer left unread");
        assert_eq!(count(&seen.requests), 2, "the request sent again");
    }

    // The thread takes the registry's changes alone: a pod handed over again replaces the one it
    // had, a stale give-back is nothing, and a pod given back is retired (its connections closed
    // later).
    #[test]
    fn the_thread_takes_hand_overs_and_give_backs_as_they_came() {
        // No thread: the test takes the changes in its place.
        let prober = threadless();
        let (mut pods, mut retired, mut seen) = (Vec::new(), Retired::default(), 0);
        let mut sync = |prober: &HeldProber| {
            prober.sync(&mut pods, &mut retired, &mut seen);
            let mut view: Vec<(String, u64)> = pods.iter().map(|p| (p.uid.clone(), p.token)).collect();
            view.sort();
            (view, retired.0.len())
        };
        let a = prober.hold("a", endpoint(1));
        let b = prober.hold("b", endpoint(1));
        assert_eq!(sync(&prober), (vec![("a".into(), a), ("b".into(), b)], 0));
        let a2 = prober.hold("a", endpoint(1));
        prober.unhold("b", b + 100);
        assert_eq!(sync(&prober), (vec![("a".into(), a2), ("b".into(), b)], 1));
        prober.unhold("b", b);
        let c = prober.hold("c", endpoint(1));
        prober.unhold("c", c);
        assert_eq!(sync(&prober), (vec![("a".into(), a2)], 2));
    }

    // A pod handed over again (its loop started anew once its IP was known) is asked on the
    // connections of its last hand-over, given back or replaced, for the same endpoints; another
    // endpoint gets a connection of its own.
    #[test]
    fn a_pod_handed_over_again_keeps_its_connections() {
        let (port, _, seen) = server(true, false);
        let prober = threadless();
        let link = TestLink::default();
        let mut poller = Poller::new().expect("epoll");
        let mut boost = Boost::new(Raise::new(0));
        let (mut pods, mut retired, mut synced) = (Vec::new(), Retired::default(), 0);
        let guard = Instant::now() + HANG_GUARD;
        let mut answered = |prober: &HeldProber, pods: &mut Vec<Pod>, retired: &mut Retired<Pod>| {
            prober.sync(pods, retired, &mut synced);
            assert!(ask_due(&link, &poller, pods, Instant::now(), &mut boost).expect("ask"));
            let mut moved = Vec::new();
            while !pods.iter().all(|p| p.endpoints.iter().all(|ep| ep.answer.is_some())) {
                assert!(Instant::now() < guard, "never answered");
                prober.wait(&link, &mut poller, &mut moved, pods, None, Duration::from_millis(100)).expect("wait");
            }
            collect(pods, &mut Vec::new());
        };
        let first = prober.hold("pod", endpoint(port));
        answered(&prober, &mut pods, &mut retired);
        // Replaced by a newer hand-over, then given back and handed over again.
        let _ = prober.hold("pod", endpoint(port));
        answered(&prober, &mut pods, &mut retired);
        prober.unhold("pod", first);
        let second = pods[0].token;
        prober.unhold("pod", second);
        let _ = prober.hold("pod", endpoint(port));
        answered(&prober, &mut pods, &mut retired);
        assert_eq!((count(&seen.requests), count(&seen.conns)), (3, 1), "a connection made anew");
        // Another endpoint: a connection of its own.
        let (other, _, other_seen) = server(true, false);
        let _ = prober.hold("pod", endpoint(other));
        answered(&prober, &mut pods, &mut retired);
        assert_eq!(count(&other_seen.conns), 1);
        assert_eq!(count(&seen.conns), 1);
    }

    // A flip a listen brought is its own pod's news: each binding proxy's listen brings its own
    // ask. The poll's flip is the sweep's cue.
    #[test]
    fn only_a_flip_the_poll_found_is_a_sweeps_cue() {
        let flip = |listen_ask: bool| {
            let mut pod = held("pod", Some(503));
            pod.endpoints.push(Endpoint {
                name: "istio-proxy".into(),
                port: 15021,
                request: Vec::new(),
                conn: Conn::None,
                key: 0,
                moved: false,
                answer: Some(Answer::Status(200)),
            });
            pod.asked = true;
            pod.listen_ask = listen_ask;
            let mut news = Vec::new();
            let cue = collect(&mut [pod], &mut news);
            assert!(matches!(news.as_slice(), [(_, Feedback::Probed { ready: true, .. })]), "{news:?}");
            cue
        };
        assert!(flip(false), "the poll's flip brings no sweep");
        assert!(!flip(true), "a listen's flip brings a sweep");
    }

    // A listen's ask, and its burst's, are the listen's: set at the ask.
    #[test]
    fn an_ask_in_a_listens_burst_is_the_listens() {
        let link = TestLink::default();
        let now = Instant::now();
        let mut boost = Boost::new(Raise::new(0));
        let mut pods = vec![held("polled", Some(503)), held("listened", Some(503)), held("bursting", Some(503))];
        pods[0].due = Some((now, Due::LaggedGroup));
        pods[1].fresh = true;
        pods[1].burst = LISTEN_BURST;
        pods[2].burst = 1;
        pods[2].burst_next = Some(now);
        let poller = Poller::new().expect("epoll");
        assert!(ask_due(&link, &poller, &mut pods, now, &mut boost).expect("ask"));
        let listens: Vec<bool> = pods.iter().map(|p| p.listen_ask).collect();
        assert_eq!(listens, vec![false, true, true]);
        assert_eq!(pods[2].burst, 0, "the burst's last ask");
    }

    // A socket listening in a held pod brings a probe at once and, while the proxy still says no
    // (it binds its listeners just before it turns ready), a short burst more. No slot comes
    // within the hang guard: every request after the first is the listens'.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_listening_socket_brings_a_probe_at_once_and_a_short_burst() {
        let (port, ready, seen) = server(false, false);
        let (prober, mut rx) = prober();
        prober.set_interval(Duration::from_secs(3600));
        let _ = prober.hold("pod", endpoint(port));
        assert_eq!(next(&mut rx).await, ("pod".into(), false, "istio-proxy answered 503".into()));
        prober.probe_now("pod");
        let burst = 2 + u64::from(LISTEN_BURST);
        until("the listen's probe and its burst", || count(&seen.requests) >= burst).await;
        ready.store(true, Ordering::SeqCst);
        prober.probe_now("pod");
        let unchanged = Some((false, "istio-proxy answered 503"));
        assert_eq!(next_of(&mut rx, "pod", unchanged).await, (true, "istio-proxy answered 200".into()));
        // A listen in a pod the prober does not have is nothing.
        prober.probe_now("another");
        assert_eq!(count(&seen.conns), 1, "one kept connection throughout");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_proxy_that_does_not_answer_holds_back_no_other_and_fails_at_the_deadline() {
        let (port, _, seen) = server(true, false);
        // A listener that accepts, reads, and never answers; it counts the connections, and
        // those the prober closed.
        let hung = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let hung_port = hung.local_addr().expect("addr").port();
        let hung_seen = Arc::new(Seen::default());
        let counted = hung_seen.clone();
        std::thread::spawn(move || {
            for conn in hung.incoming().flatten() {
                counted.conns.fetch_add(1, Ordering::SeqCst);
                let counted = counted.clone();
                std::thread::spawn(move || {
                    let mut conn = conn;
                    let mut buf = [0u8; 1024];
                    while conn.read(&mut buf).is_ok_and(|n| n > 0) {
                        counted.requests.fetch_add(1, Ordering::SeqCst);
                    }
                    counted.closed.fetch_add(1, Ordering::SeqCst);
                });
            }
        });
        let (prober, mut rx) = prober();
        // The hung request stays open while the other pod is looked at (its deadline, far past
        // the hang guard, is brought back below).
        prober.set_deadline(Duration::from_secs(3600));
        let started = Instant::now();
        let hung_token = prober.hold("hung", endpoint(hung_port));
        let _ = prober.hold("fine", endpoint(port));
        assert_eq!(next(&mut rx).await.0, "fine");
        until("the hung request read", || count(&hung_seen.requests) == 1).await;
        let before = count(&seen.requests);
        until("the other pod probed slot after slot", || count(&seen.requests) >= before + 8).await;
        assert_eq!(
            (count(&hung_seen.conns), count(&hung_seen.requests), count(&hung_seen.closed)),
            (1, 1, 0),
            "the hung request was not left open while the other pod was probed"
        );
        while let Ok((uid, news)) = rx.try_recv() {
            assert_eq!(uid, "fine", "news before the hung request's deadline: {news:?}");
        }
        // The deadline: a failure, and the request's connection is dropped.
        prober.set_deadline(LIMITS.total_timeout);
        let (ready, detail) = next_of(&mut rx, "hung", None).await;
        assert!(!ready);
        assert_eq!(detail, "istio-proxy: no complete answer before the deadline");
        let failed_after = started.elapsed();
        assert!(failed_after >= LIMITS.total_timeout, "failed before the deadline: {failed_after:?}");
        // Still probed here, on a new connection.
        assert!(prober.probes("hung", hung_token));
        until("the timed-out connection closed", || count(&hung_seen.closed) >= 1).await;
        until("a new connection after the deadline", || count(&hung_seen.conns) >= 2).await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_proxy_that_listens_late_is_refused_then_ready() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("addr").port();
        drop(listener);
        let (prober, mut rx) = prober();
        let _ = prober.hold("late", endpoint(port));
        assert_eq!(next(&mut rx).await, ("late".into(), false, "istio-proxy: connection refused".into()));
        let listener = std::net::TcpListener::bind(("127.0.0.1", port)).expect("bind the same port");
        serve(listener, Arc::new(AtomicBool::new(true)), Arc::default(), false);
        assert_eq!(next(&mut rx).await, ("late".into(), true, "istio-proxy answered 200".into()));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_kept_connection_the_proxy_closed_is_made_anew_without_a_failure() {
        let (port, _, seen) = server(true, true);
        let (prober, mut rx) = prober();
        // What is tested is the kept connection made anew, not the probe's deadline: on a loaded
        // machine the test's server thread may answer past it, a failure of its own.
        prober.set_deadline(Duration::from_secs(3600));
        let _ = prober.hold("closing", endpoint(port));
        let answered = ("closing".to_owned(), true, "istio-proxy answered 200".to_owned());
        assert_eq!(next(&mut rx).await, answered);
        until("ten connections", || count(&seen.conns) >= 10).await;
        // The unchanged answer is no news; a failure would be, and so would the 200 after it.
        // The next news is the unchanged answer's repeat (due after REPEAT): whatever a probe
        // on the first ten connections reported came before it.
        assert_eq!(next(&mut rx).await, answered, "a failure while the proxy answered 200 each time");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_thread_ends_with_the_agent_and_gives_every_pod_back() {
        let (port, _, _) = server(true, false);
        let (prober, rx) = prober();
        let token = prober.hold("pod-a", endpoint(port));
        drop(rx);
        until("the pod given back", || !prober.probes("pod-a", token)).await;
        let again = prober.hold("pod-b", endpoint(port));
        assert!(!prober.probes("pod-b", again), "a pod handed to an ended prober");
    }
}
