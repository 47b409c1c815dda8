//! One readiness probe loop per pod: asks every probed sidecar of the pod whether it is ready,
//! reports the answer, and waits as the pod's pace says. Dropping the handle stops the loop.
//! [`Probes`] keeps every pod's loop, and the held pods' prober.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::{Notify, mpsc, watch};

use super::answer::{Answer, LIMITS, REPEAT, all_ready, detail};
use super::held_prober::HeldProber;
use super::{PodFeedback, Settings, next_multiple};
use crate::effect::{Feedback, Pace};
use crate::pod::spec::{Sidecar, SidecarKind};
use crate::sidecar::{PodRequest, PodTarget, SidecarLink};

/// The readiness probes of every pod (effects `StartProbe`, `SetPace`, `StopProbe`): one loop
/// each, and the held pods' prober, which probes the pods whose app is held in their stead.
pub struct Probes<L> {
    link: Arc<L>,
    loops: HashMap<String, Handle>,
    /// How many of `loops` probe a held pod (`Pace::Urgent`), kept as they change: counted over
    /// every loop at each change, a 110-pod round's releases looked at all 110 loops 110 times,
    /// in the loop's time before the batch's first SIGCONT (with the wake-ups of the loops whose
    /// pace changed, 0.1-1.1 ms a round: [`Probes::keep_paces`]).
    urgent: usize,
    /// The pace changes kept while a batch's releases are (see [`Probes::keep_paces`]).
    kept: Option<Vec<(String, Pace)>>,
    reports: Arc<ProbeNews>,
    held_prober: Option<Arc<HeldProber>>,
    /// Probe interval until the pod's proxies are ready, and once they are.
    intervals: (Duration, Duration),
    /// Most probes per second across the pods whose app is held, on their loops.
    held_budget: u32,
    /// How often, at most, a held pod is probed.
    held_floor: Duration,
}

impl<L: SidecarLink> Probes<L> {
    /// The loops' news goes to `reports`.
    pub fn new(link: Arc<L>, reports: mpsc::UnboundedSender<PodFeedback>, settings: &Settings) -> Probes<L> {
        let held_prober = settings
            .held_prober
            .then(|| {
                HeldProber::start(link.clone(), reports.clone(), settings.decide_priority, settings.urgent_priority)
            })
            .flatten();
        if let Some(p) = &held_prober {
            p.set_interval(settings.held_probe_interval);
            p.set_cpu_share(settings.held_probe_cpu);
        }
        Probes {
            link,
            loops: HashMap::new(),
            urgent: 0,
            kept: None,
            reports: ProbeNews::new(reports),
            held_prober,
            intervals: (settings.probe_interval, settings.ready_probe_interval),
            held_budget: settings.held_probe_budget,
            held_floor: settings.held_probe_interval,
        }
    }

    /// Starts probing `sidecars` of pod `uid` (effect `StartProbe`), at `pod_rel` or else its IP.
    pub fn start(
        &mut self,
        uid: &str,
        sidecars: Vec<Sidecar>,
        pod_rel: Option<String>,
        pod_ip: Option<&str>,
        pace: Pace,
    ) {
        let target =
            PodTarget { uid: uid.to_owned(), pod_rel, pod_ip: pod_ip.and_then(|ip| ip.parse::<IpAddr>().ok()) };
        let handle = start(
            self.link.clone(),
            target,
            sidecars,
            pace,
            self.intervals,
            self.reports.clone(),
            self.held_prober.clone(),
        );
        self.drop_kept(uid);
        let old = self.loops.insert(uid.to_owned(), handle);
        self.count(old.map(|h| h.pace()), Some(pace));
    }

    /// Sets pod `uid`'s probe pace (effect `SetPace`); while a batch's releases are kept, once
    /// they are out.
    pub fn set_pace(&mut self, uid: &str, pace: Pace) {
        if let Some(kept) = &mut self.kept {
            kept.retain(|(u, _)| u != uid);
            kept.push((uid.to_owned(), pace));
            return;
        }
        let Some(p) = self.loops.get(uid) else { return };
        let old = p.pace();
        p.set_pace(pace);
        self.count(Some(old), Some(pace));
    }

    /// Stops probing pod `uid` (effect `StopProbe`).
    pub fn stop(&mut self, uid: &str) {
        self.drop_kept(uid);
        let old = self.loops.remove(uid);
        self.count(old.map(|h| h.pace()), None);
    }

    /// Probes held pod `uid`'s proxies at once (a socket started listening there), if the held
    /// pods' prober has it; a pod on its own loop keeps its pace.
    pub fn probe_now(&self, uid: &str) {
        if let Some(p) = &self.held_prober {
            p.probe_now(uid);
        }
    }

    /// Keeps the pace changes from now on until [`Probes::flush_paces`]: a batch's releases go
    /// out first. Each change wakes the pod's loop (a task woken from the loop's thread, and
    /// often a runtime worker with it): a 110-pod round's 110 releases' changes cost the loop
    /// 0.1-1.1 ms before its first SIGCONT.
    pub fn keep_paces(&mut self) {
        self.kept.get_or_insert_with(Vec::new);
    }

    /// Makes the pace changes kept since [`Probes::keep_paces`], in order.
    pub fn flush_paces(&mut self) {
        for (uid, pace) in self.kept.take().unwrap_or_default() {
            self.set_pace(&uid, pace);
        }
    }

    /// A kept pace change of a loop started anew or stopped is void: the new loop's pace is the
    /// pod's now.
    fn drop_kept(&mut self, uid: &str) {
        if let Some(kept) = &mut self.kept {
            kept.retain(|(u, _)| u != uid);
        }
    }

    /// A loop's pace went from `old` to `new` (None: no loop): spreads the probes of the held
    /// pods on their own loops over the budget, their interval following how many are held.
    /// (The held pods' prober keeps to its CPU budget itself.)
    fn count(&mut self, old: Option<Pace>, new: Option<Pace>) {
        let urgent = |p: Option<Pace>| usize::from(p == Some(Pace::Urgent));
        self.urgent = (self.urgent + urgent(new)).saturating_sub(urgent(old));
        self.reports.set_held(self.urgent, self.held_budget, self.held_floor);
    }
}

/// Shortest probe interval while an app is held (`--held-probe-interval`'s default): the release
/// latency is about half of it.
const URGENT_MIN: Duration = Duration::from_millis(10);
/// Once the proxy was seen ready, an unchanged answer is reported at most this often (each
/// report is a decision step of the pod: on a full node, the cost of probing ready proxies);
/// before, at most every [`REPEAT`].
const REPEAT_READY: Duration = Duration::from_secs(60);
/// How often a proxy that is not ready yet gets a connection to its quit endpoint tried.
const STANDBY_EARLY: Duration = Duration::from_secs(1);

/// Longest the news of held pods' probes waits for the other probes running with them.
const GATHER_CAP: Duration = Duration::from_millis(3);

/// Where the probe loops send their news. The probes of held pods that run together (one slot of
/// the shared clock) report together: once the last of them has its answer, or `GATHER_CAP`
/// after the first news if one is slow. Their releases then go out in one turn of the
/// controller, before the apps released first take the CPUs from proxies still answering (each
/// app released early pushed the rest of the slot back by milliseconds on a busy node).
pub struct ProbeNews {
    tx: mpsc::UnboundedSender<PodFeedback>,
    gather: Mutex<Gather>,
    all_in: Notify,
    /// The held pods' probe interval, in ns (see [`held_interval`]).
    urgent_ns: AtomicU64,
}

/// The probe interval of held pods on their loops when `held` of them share `budget` probes per
/// second: `floor`, or longer so that they stay within the budget (the loops' timers round it up
/// to the millisecond).
pub fn held_interval(held: usize, budget: u32, floor: Duration) -> Duration {
    let us = (held as u64 * 1_000_000).div_ceil(u64::from(budget.max(1)));
    Duration::from_micros(us).max(floor)
}

#[derive(Default)]
struct Gather {
    /// Probes of held pods under way.
    in_flight: usize,
    /// News waiting for them.
    queued: Vec<PodFeedback>,
    /// A loop waits (at most `GATHER_CAP`) to send what is queued.
    waiting: bool,
}

impl ProbeNews {
    pub fn new(tx: mpsc::UnboundedSender<PodFeedback>) -> Arc<ProbeNews> {
        Arc::new(ProbeNews {
            tx,
            gather: Mutex::new(Gather::default()),
            all_in: Notify::new(),
            urgent_ns: AtomicU64::new(nanos(URGENT_MIN)),
        })
    }

    /// `held` pods have their app held: their probes share `budget` per second, each at most
    /// every `floor`. Returns their interval.
    pub fn set_held(&self, held: usize, budget: u32, floor: Duration) -> Duration {
        let interval = held_interval(held, budget, floor);
        if self.urgent_ns.swap(nanos(interval), Ordering::Relaxed) != nanos(interval) {
            tracing::debug!(held, ?interval, "held pods' probe interval");
        }
        interval
    }

    fn urgent(&self) -> Duration {
        Duration::from_nanos(self.urgent_ns.load(Ordering::Relaxed))
    }

    fn gather(&self) -> std::sync::MutexGuard<'_, Gather> {
        self.gather.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A probe of a held pod begins: its news waits for the others under way.
    fn enter(self: &Arc<Self>) -> InFlight {
        self.gather().in_flight += 1;
        InFlight { reports: self.clone(), left: false }
    }

    /// Sends what is queued; whether the controller still listens.
    fn flush(&self) -> bool {
        let queued = std::mem::take(&mut self.gather().queued);
        for report in queued {
            let _ = self.tx.send(report);
        }
        !self.tx.is_closed()
    }
}

/// A probe of a held pod under way. Dropped without [`InFlight::leave`] (its loop was stopped),
/// it no longer holds the others back.
struct InFlight {
    reports: Arc<ProbeNews>,
    left: bool,
}

impl InFlight {
    /// The probe has its answer; `news` is queued with the others' and sent with them. Returns
    /// whether the controller still listens.
    async fn leave(mut self, news: Option<PodFeedback>) -> bool {
        self.left = true;
        let (last, wait) = {
            let mut g = self.reports.gather();
            g.in_flight = g.in_flight.saturating_sub(1);
            g.queued.extend(news);
            if g.in_flight == 0 {
                let waiting = std::mem::take(&mut g.waiting);
                (Some(waiting), false)
            } else if !g.waiting && !g.queued.is_empty() {
                g.waiting = true;
                (None, true)
            } else {
                (None, false)
            }
        };
        match last {
            Some(someone_waits) => {
                let listening = self.reports.flush();
                if someone_waits {
                    self.reports.all_in.notify_one();
                }
                listening
            }
            None if wait => {
                // Sends what is queued however this ends (the loop may be stopped meanwhile).
                let flush = FlushOnDrop(self.reports.clone());
                let _ = tokio::time::timeout(GATHER_CAP, self.reports.all_in.notified()).await;
                drop(flush);
                !self.reports.tx.is_closed()
            }
            None => !self.reports.tx.is_closed(),
        }
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        if self.left {
            return;
        }
        let last = {
            let mut g = self.reports.gather();
            g.in_flight = g.in_flight.saturating_sub(1);
            g.in_flight == 0 && std::mem::take(&mut g.waiting)
        };
        if last {
            self.reports.flush();
            self.reports.all_in.notify_one();
        }
    }
}

/// The waiting loop's duty: what is queued is sent when it stops waiting.
struct FlushOnDrop(Arc<ProbeNews>);

impl Drop for FlushOnDrop {
    fn drop(&mut self) {
        self.0.gather().waiting = false;
        self.0.flush();
    }
}

/// A running probe loop; it stops when this is dropped.
pub struct Handle {
    pace: watch::Sender<Pace>,
    task: tokio::task::JoinHandle<()>,
}

impl Handle {
    pub fn set_pace(&self, pace: Pace) {
        let _ = self.pace.send(pace);
    }

    pub fn pace(&self) -> Pace {
        *self.pace.borrow()
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl Drop for Handle {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Starts probing `sidecars` of the pod at `target`, every `normal` until they are ready, then
/// every `relaxed`.
pub fn start<L: SidecarLink>(
    link: Arc<L>,
    target: PodTarget,
    sidecars: Vec<Sidecar>,
    pace: Pace,
    (normal, relaxed): (Duration, Duration),
    reports: Arc<ProbeNews>,
    prober: Option<Arc<HeldProber>>,
) -> Handle {
    let (tx, rx) = watch::channel(pace);
    let pod = PodProbe { link, target, sidecars, reports, prober, normal, relaxed, last: None, standby_at: None };
    let task = tokio::spawn(pod.run(rx, pace));
    Handle { pace: tx, task }
}

/// One pod's probe loop: what it probes, and what it remembers from turn to turn.
struct PodProbe<L> {
    link: Arc<L>,
    target: PodTarget,
    sidecars: Vec<Sidecar>,
    reports: Arc<ProbeNews>,
    prober: Option<Arc<HeldProber>>,
    normal: Duration,
    relaxed: Duration,
    /// The last answer reported, and when.
    last: Option<(Vec<Answer>, tokio::time::Instant)>,
    /// When the quit connections were last opened ahead.
    standby_at: Option<tokio::time::Instant>,
}

impl<L: SidecarLink> PodProbe<L> {
    async fn run(mut self, mut rx: watch::Receiver<Pace>, pace: Pace) {
        // The prober ended and gave the pod back: this loop probes it from now on.
        let mut own = false;
        // The pace of the last turn: a pod that turns held reports its next answer whatever the
        // last one was (the app just stopped waits for an answer that came after it).
        let mut was = pace;
        loop {
            let now_pace = *rx.borrow();
            if now_pace == Pace::Urgent && was != Pace::Urgent {
                self.last = None;
            }
            was = now_pace;
            // Held, with the prober: it probes the pod until the pace changes.
            if *rx.borrow() == Pace::Urgent
                && !own
                && let Some(prober) = self.prober.clone()
                && self.link.netns_open(&self.target.uid)
            {
                let Some(given_back) = self.lend_to(&prober, &mut rx).await else { return };
                own = given_back;
                // Given back by a pace change: the next probe at the pace's next slot.
                if !own {
                    if !until_next_turn(&mut rx, &self.reports, self.normal, self.relaxed).await {
                        return;
                    }
                    continue;
                }
            }
            if !self.probe(&rx).await {
                return;
            }
            if !until_next_turn(&mut rx, &self.reports, self.normal, self.relaxed).await {
                return;
            }
        }
    }

    /// Lets the held pods' prober probe the pod until the pace changes (`Some(false)`) or the
    /// prober gives the pod back (`Some(true)`: this loop probes it from now on). None: the
    /// handle is gone.
    async fn lend_to(&mut self, prober: &Arc<HeldProber>, rx: &mut watch::Receiver<Pace>) -> Option<bool> {
        let endpoints = self
            .sidecars
            .iter()
            .filter_map(|sc| sc.ready.as_ref().map(|e| (sc.name.clone(), e.port, e.path.clone())))
            .collect();
        let token = prober.hold(&self.target.uid, endpoints);
        let guard = Unhold(prober.clone(), self.target.uid.clone(), token);
        let given_back = loop {
            tokio::select! {
                changed = rx.changed() => {
                    if changed.is_err() { return None }
                    if *rx.borrow_and_update() != Pace::Urgent { break false }
                }
                () = tokio::time::sleep(STANDBY_EARLY) => {
                    if !prober.probes(&self.target.uid, token) {
                        break true;
                    }
                    self.standby();
                }
            }
        };
        drop(guard);
        self.standby();
        self.last = None;
        Some(given_back)
    }

    /// Probes the pod once and reports the news (an app held at the urgent pace waits for this
    /// answer). False once nobody listens.
    async fn probe(&mut self, rx: &watch::Receiver<Pace>) -> bool {
        let held = (*rx.borrow() == Pace::Urgent).then(|| self.reports.enter());
        let answers = probe_all(self.link.as_ref(), &self.target, &self.sidecars).await;
        let ready = all_ready(&answers);
        // Have a connection to each quit endpoint open before the work is done, so the quit
        // is one write: once the proxy serves, and already before (at most every second:
        // pilot-agent's status port listens well before Envoy is ready), so a burst of
        // proxies turning ready does not also open a burst of connections.
        if ready || self.standby_at.is_none_or(|at| at.elapsed() >= STANDBY_EARLY) {
            self.standby_at = Some(tokio::time::Instant::now());
            self.standby();
        }
        // Only news goes to the pod's state machine (the loop runs every 10 ms while an app is
        // held): a changed answer, or the same one after a while.
        let repeat = if *rx.borrow() == Pace::Relaxed { REPEAT_READY } else { REPEAT };
        let news = self.last.as_ref().is_none_or(|(a, at)| *a != answers || at.elapsed() >= repeat);
        let news = news.then(|| {
            let probed = self.sidecars.iter().filter(|sc| sc.ready.is_some()).map(|sc| sc.name.as_str());
            let detail = detail(probed, &answers);
            self.last = Some((answers, tokio::time::Instant::now()));
            (self.target.uid.clone(), Feedback::Probed { ready, detail })
        });
        match held {
            Some(held) => held.leave(news).await,
            None => news.is_none_or(|news| self.reports.tx.send(news).is_ok()),
        }
    }

    /// A connection to each quit endpoint, opened ahead (see `SidecarLink::standby`).
    fn standby(&self) {
        for endpoint in self.sidecars.iter().filter_map(|sc| sc.quit.as_ref()) {
            self.link.standby(&self.target, endpoint.port);
        }
    }
}

/// Waits until the next slot of the pace; false once the handle is gone. An app held meanwhile
/// is asked for at once; a slower pace only moves the next probe (the apps of a slot are
/// released together and their pods all slow down at once: probing them all again then took
/// the CPUs from the releases).
async fn until_next_turn(
    rx: &mut watch::Receiver<Pace>,
    reports: &ProbeNews,
    normal: Duration,
    relaxed: Duration,
) -> bool {
    loop {
        let wait = match *rx.borrow() {
            Pace::Urgent => reports.urgent(),
            Pace::Normal => normal,
            Pace::Relaxed => relaxed.max(normal),
        };
        tokio::select! {
            () = tokio::time::sleep_until(next_slot(wait)) => return true,
            changed = rx.changed() => match changed {
                Err(_) => return false,
                Ok(()) if *rx.borrow_and_update() == Pace::Urgent => return true,
                Ok(()) => {}
            },
        }
    }
}

struct Unhold(Arc<HeldProber>, String, u64);

impl Drop for Unhold {
    fn drop(&mut self) {
        self.0.unhold(&self.1, self.2);
    }
}

/// The next multiple of `period` on a clock shared by every probe loop: the loops of a pace
/// wake together, so a node's probes cost one wake-up of the agent per period, not one per pod.
fn next_slot(period: Duration) -> tokio::time::Instant {
    static ORIGIN: std::sync::OnceLock<tokio::time::Instant> = std::sync::OnceLock::new();
    let origin = *ORIGIN.get_or_init(tokio::time::Instant::now);
    origin + next_multiple(tokio::time::Instant::now().duration_since(origin), period)
}

/// One probe of every sidecar that has a readiness endpoint, in order.
async fn probe_all(link: &dyn SidecarLink, target: &PodTarget, sidecars: &[Sidecar]) -> Vec<Answer> {
    let mut answers = Vec::with_capacity(sidecars.len());
    for sc in sidecars {
        let Some(endpoint) = &sc.ready else { continue };
        // From inside the pod's network namespace first: health listeners bound to loopback
        // (Envoy's admin, cloud-sql-proxy's default) answer there. The pod IP, as the kubelet
        // probes, until the pod's processes are found — never for Envoy's loopback-only admin.
        let fallback = !matches!(sc.kind, SidecarKind::Envoy);
        let answer = link
            .request(PodRequest {
                target: target.clone(),
                port: endpoint.port,
                method: "GET",
                path: endpoint.path.clone(),
                limits: LIMITS,
                fresh: false,
                pod_ip_fallback: fallback,
            })
            .await;
        answers.push(match answer {
            Ok(r) => Answer::Status(r.status),
            Err((why, _)) => Answer::Failed(why),
        });
    }
    answers
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pod::spec::Endpoint;
    use crate::sidecar::testing::TestLink;

    fn news(uid: &str) -> Option<PodFeedback> {
        Some((uid.to_owned(), Feedback::Probed { ready: true, detail: String::new() }))
    }

    // On a paused clock: a pace change moves the next probe, and only a held app brings it on.
    #[tokio::test(start_paused = true)]
    async fn a_slower_pace_waits_for_its_slot_and_a_held_app_is_probed_at_once() {
        let link = Arc::new(TestLink::default());
        let (tx, mut rx) = mpsc::unbounded_channel();
        let reports = ProbeNews::new(tx);
        let sidecar = Sidecar {
            name: "istio-proxy".into(),
            kind: SidecarKind::Istio,
            quit: None,
            ready: Some(Endpoint { port: 15021, path: "/healthz/ready".into() }),
            quit_signal: libc::SIGTERM,
        };
        let target = PodTarget { uid: "u".into(), pod_rel: None, pod_ip: None };
        let normal = Duration::from_secs(1);
        let handle = start(link.clone(), target, vec![sidecar], Pace::Urgent, (normal, normal * 60), reports, None);
        let probes = || link.requests.load(Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert_eq!(probes(), 1, "a held pod is probed as its loop starts");
        assert!(rx.try_recv().is_ok(), "its answer is news");
        // Released: the pod slows down, and is not probed again before its slot.
        handle.set_pace(Pace::Relaxed);
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(probes(), 1, "probed again on slowing down");
        // Held again (a restarted app): probed at once.
        handle.set_pace(Pace::Urgent);
        tokio::time::sleep(Duration::from_millis(1)).await;
        assert_eq!(probes(), 2, "a held app waited for the slow pace's slot");
    }

    // On a paused clock: the loops' probes go to a test link, no time passes.
    #[tokio::test(start_paused = true)]
    async fn the_held_loops_are_counted_as_their_paces_change() {
        let (tx, _rx) = mpsc::unbounded_channel();
        let settings = Settings::quick(std::path::PathBuf::from("/proc"));
        let mut probes = Probes::new(Arc::new(TestLink::default()), tx, &settings);
        let sidecar = || Sidecar {
            name: "istio-proxy".into(),
            kind: SidecarKind::Istio,
            quit: None,
            ready: Some(Endpoint { port: 15021, path: "/healthz/ready".into() }),
            quit_signal: libc::SIGTERM,
        };
        let held = |probes: &Probes<TestLink>| {
            let counted = probes.loops.values().filter(|h| h.pace() == Pace::Urgent).count();
            assert_eq!(probes.urgent, counted, "the count kept is the loops'");
            (counted, probes.reports.urgent())
        };
        for i in 0..22 {
            probes.start(&format!("p{i}"), vec![sidecar()], None, None, Pace::Urgent);
        }
        assert_eq!(held(&probes), (22, held_interval(22, 2000, settings.held_probe_interval)));
        probes.set_pace("p0", Pace::Relaxed);
        probes.set_pace("p0", Pace::Relaxed);
        probes.set_pace("gone", Pace::Urgent);
        assert_eq!(held(&probes).0, 21, "a release counts once; an unknown pod not at all");
        probes.stop("p1");
        probes.stop("p0");
        probes.stop("p1");
        assert_eq!(held(&probes), (20, settings.held_probe_interval), "within the budget again");
        // A loop started anew for the same pod (its IP known) takes the old one's place.
        probes.start("p2", vec![sidecar()], None, Some("10.0.0.2"), Pace::Urgent);
        probes.start("p3", vec![sidecar()], None, None, Pace::Normal);
        assert_eq!(held(&probes).0, 19);
        probes.set_pace("p3", Pace::Urgent);
        assert_eq!(held(&probes).0, 20);
        // A batch's changes wait for its releases; one of a loop started anew or stopped is void.
        probes.keep_paces();
        probes.set_pace("p3", Pace::Relaxed);
        probes.set_pace("p4", Pace::Relaxed);
        probes.set_pace("p5", Pace::Relaxed);
        probes.set_pace("p5", Pace::Normal);
        probes.start("p4", vec![sidecar()], None, None, Pace::Urgent);
        probes.stop("p6");
        assert_eq!(held(&probes).0, 19, "only the stop counts while the batch is kept");
        assert_eq!(probes.loops["p3"].pace(), Pace::Urgent);
        probes.flush_paces();
        assert_eq!(held(&probes).0, 17, "p3 and p5 slowed down, p4 kept its new loop's pace");
        assert_eq!(probes.loops["p4"].pace(), Pace::Urgent);
        assert_eq!(probes.loops["p5"].pace(), Pace::Normal, "the batch's last change stands");
        probes.set_pace("p5", Pace::Urgent);
        assert_eq!(held(&probes).0, 18, "made at once after the batch");
    }

    #[test]
    fn held_probes_share_the_budget() {
        assert_eq!(held_interval(0, 2000, URGENT_MIN), URGENT_MIN);
        assert_eq!(held_interval(1, 2000, URGENT_MIN), URGENT_MIN);
        assert_eq!(held_interval(20, 2000, URGENT_MIN), URGENT_MIN);
        assert_eq!(held_interval(21, 2000, URGENT_MIN), Duration::from_micros(10_500));
        assert_eq!(held_interval(110, 2000, URGENT_MIN), Duration::from_millis(55));
        assert_eq!(held_interval(20, 1200, URGENT_MIN), Duration::from_micros(16_667));
        // The default.
        assert_eq!(held_interval(15, 1500, URGENT_MIN), URGENT_MIN);
        assert_eq!(held_interval(16, 1500, URGENT_MIN), Duration::from_micros(10_667));
        assert_eq!(held_interval(20, 1500, URGENT_MIN), Duration::from_micros(13_334));
        assert_eq!(held_interval(110, 1500, URGENT_MIN), Duration::from_micros(73_334));
        assert_eq!(
            held_interval(20, 0, URGENT_MIN),
            Duration::from_secs(20),
            "a zero budget counts as one probe a second"
        );
        assert_eq!(held_interval(1, 1500, Duration::from_secs(1)), Duration::from_secs(1), "the floor is kept");
    }

    // On a paused clock: the first news waits at most GATHER_CAP (3 ms), which a busy machine
    // can let pass before the others answer; here time moves only when nothing else can run.
    #[tokio::test(start_paused = true)]
    async fn news_of_probes_under_way_together_goes_out_with_the_last_answer() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let reports = ProbeNews::new(tx);
        let (a, b, c) = (reports.enter(), reports.enter(), reports.enter());
        // The first news waits for the others (at most the cap).
        let first = tokio::spawn(a.leave(news("a")));
        tokio::task::yield_now().await;
        assert!(b.leave(None).await, "no news: nothing to wait for");
        assert!(rx.try_recv().is_err(), "sent before the last probe of the slot answered");
        assert!(c.leave(news("c")).await);
        let got: Vec<String> = std::iter::from_fn(|| rx.try_recv().ok()).map(|(uid, _)| uid).collect();
        assert_eq!(got, ["a", "c"], "both at once, when the last answered");
        assert!(first.await.expect("join"));
    }

    // On a paused clock: the runtime's time moves only by the timers it waits for.
    #[tokio::test(start_paused = true)]
    async fn a_slow_probe_holds_the_others_news_back_at_most_the_cap() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let reports = ProbeNews::new(tx);
        let (a, slow) = (reports.enter(), reports.enter());
        let started = tokio::time::Instant::now();
        assert!(a.leave(news("a")).await);
        let waited = started.elapsed();
        assert!(waited >= GATHER_CAP && waited <= GATHER_CAP + Duration::from_millis(1), "sent after {waited:?}");
        assert_eq!(rx.try_recv().map(|(uid, _)| uid).ok().as_deref(), Some("a"));
        // A probe loop stopped mid-probe no longer holds anyone back.
        drop(slow);
        let d = reports.enter();
        let started = tokio::time::Instant::now();
        assert!(d.leave(news("d")).await);
        assert_eq!(started.elapsed(), Duration::ZERO, "the stopped probe still counted");
        assert_eq!(rx.try_recv().map(|(uid, _)| uid).ok().as_deref(), Some("d"));
    }

    #[tokio::test]
    async fn a_loop_stopped_while_it_waits_still_sends_the_news() {
        let (tx, mut rx) = mpsc::unbounded_channel();
        let reports = ProbeNews::new(tx);
        let (a, _slow) = (reports.enter(), reports.enter());
        let waiting = tokio::spawn(a.leave(news("a")));
        tokio::task::yield_now().await;
        waiting.abort();
        let _ = waiting.await;
        assert_eq!(rx.try_recv().map(|(uid, _)| uid).ok().as_deref(), Some("a"));
    }
}
