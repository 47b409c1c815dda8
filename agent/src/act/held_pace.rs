//! When the held pods' prober asks: its slots, paced by its own CPU within a share of a core, and
//! the real-time class it asks in when a release waits on the answers; and when it closes the
//! connections of the pods given back.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::time::{Duration, Instant};

use tracing::{debug, warn};

use super::next_multiple;

/// The prober's CPU budget kept across its slots: each slot it reads its own CPU time, and the
/// next slot comes no sooner than what a period costs allows within the share.
///
/// What a period costs is a running mean of the periods' CPU, each weighing [`COST_WEIGHT`]: a
/// costly period (a burst of pods handed over, a sweep, or the host taking the CPU while the
/// thread ran) is paid for over the next periods, not by the next one alone. Paid at once, one
/// period of 8.3 ms at 20 pods made the next one 207 ms instead of 20-25, and a ready moment in it
/// was seen 52 ms late. The mean keeps the thread within its share over time all the same. It
/// follows a lasting rise (more pods held) over about eight periods, and meanwhile the thread can
/// spend over its share: about eight of the new periods' cost at most, over that time.
struct CpuPace {
    /// The thread's CPU time at the last slot.
    last: Duration,
    /// What a period costs: the running mean.
    cost: Duration,
}

/// The weight of the latest period in the running mean of a period's cost.
const COST_WEIGHT: f64 = 0.125;

impl CpuPace {
    fn new(cpu: Duration) -> CpuPace {
        CpuPace { last: cpu, cost: Duration::ZERO }
    }

    /// At a slot, with the thread's CPU time `cpu`: the period until the next one, at least
    /// `floor`, long enough that a period's CPU (its slot's probes, and the bursts and the pods
    /// probed at once since), in the running mean, is at most `share` of it.
    fn period(&mut self, cpu: Duration, floor: Duration, share: f64) -> Duration {
        let spent = cpu.saturating_sub(self.last);
        self.last = cpu;
        self.cost = self.cost.mul_f64(1.0 - COST_WEIGHT) + spent.mul_f64(COST_WEIGHT);
        if share >= 1.0 || share.is_nan() || share <= 0.0 {
            return floor;
        }
        floor.max(self.cost.div_f64(share))
    }
}

/// The calling thread's CPU time (zero if the clock cannot be read: no budget then).
fn thread_cpu() -> Duration {
    crate::host::sys::thread_cpu()
}

/// The prober's slots: at its interval on its own clock, further apart when the CPU budget asks.
pub(super) struct SlotClock {
    origin: Instant,
    /// When the next slot is due.
    pub(super) next: Instant,
    pace: CpuPace,
    period: Duration,
}

impl SlotClock {
    pub(super) fn new(origin: Instant) -> SlotClock {
        SlotClock { origin, next: origin, pace: CpuPace::new(thread_cpu()), period: Duration::ZERO }
    }

    /// Whether a slot is due at `now` (the interval `floor`, the CPU `share`; `held`: the pods,
    /// for the log); when it is, the next one is set, as often as the interval and the CPU budget
    /// allow.
    pub(super) fn slot(&mut self, now: Instant, floor: Duration, share: f64, held: usize) -> bool {
        if now < self.next {
            return false;
        }
        let next = self.pace.period(thread_cpu(), floor, share);
        if next > floor && (next > self.period * 2 || self.period > next * 2) {
            debug!(?next, ?floor, held, "the held pods' probe period, within the CPU budget");
        }
        self.period = next;
        // On the prober's clock at its interval; a period the budget lengthened counts from this
        // slot (a multiple of a period that changes from slot to slot can fall right after it, and
        // the slots come faster than the budget allows).
        self.next = if self.period > floor {
            now + self.period
        } else {
            self.origin + next_multiple(now.duration_since(self.origin), self.period)
        };
        true
    }
}

/// The asks that a release waits on (a pod handed over, a listen's, a sweep's) go out, and their
/// answers are read, in the loop's real-time class: the proxies they wake, and the apps released
/// in the same moment, do not take the prober's CPU. The spread poll stays in the normal class.
/// The loop raises the thread before it wakes it ([`Raise::raise`]): woken in the normal class, it
/// waited for a CPU behind every task the same moment woke (7 ms at 110 pods) before it could
/// raise itself.
pub(super) struct Boost {
    raise: Arc<Raise>,
    /// In the class since.
    since: Option<Instant>,
}

/// The prober's class, shared by the thread and the loop that wakes it.
pub(super) struct Raise {
    /// SCHED_FIFO priority (0: none).
    priority: u8,
    /// The thread's id (0 until it runs).
    tid: AtomicI32,
    /// In the real-time class, or being put there.
    raised: AtomicBool,
    /// The class was refused once (no CAP_SYS_NICE): not asked again.
    failed: AtomicBool,
}

impl Raise {
    pub(super) fn new(priority: u8) -> Arc<Raise> {
        Arc::new(Raise {
            priority,
            tid: AtomicI32::new(0),
            raised: AtomicBool::new(false),
            failed: AtomicBool::new(false),
        })
    }

    /// On the loop, before it wakes the thread for an ask a release waits on: the thread in the
    /// real-time class, unless it is there already.
    pub(super) fn raise(&self) {
        if self.priority == 0 || self.failed.load(Ordering::Relaxed) || self.raised.swap(true, Ordering::SeqCst) {
            return;
        }
        // Before the thread runs there is nothing to raise: it asks in its own class when it does.
        let tid = self.tid.load(Ordering::Acquire);
        if tid == 0 {
            self.raised.store(false, Ordering::SeqCst);
        } else if let Err(e) = crate::host::sys::real_time_thread(tid, self.priority) {
            self.refused(&e);
        }
    }

    /// The class was refused: the thread stays out of it, and it is not asked for again.
    fn refused(&self, e: &std::io::Error) {
        self.raised.store(false, Ordering::SeqCst);
        if !self.failed.swap(true, Ordering::Relaxed) {
            debug!("the held pods' prober asks in its own class: SCHED_FIFO: {e}");
        }
    }

    fn usable(&self) -> bool {
        self.priority > 0 && !self.failed.load(Ordering::Relaxed)
    }
}

/// The longest the prober stays in the real-time class at a time.
const BOOST_MOST: Duration = Duration::from_millis(10);

impl Boost {
    /// On the prober's thread: its id recorded for the loop's raises.
    pub(super) fn new(raise: Arc<Raise>) -> Boost {
        raise.tid.store(crate::host::sys::gettid(), Ordering::Release);
        Boost { raise, since: None }
    }

    /// Into the class (if not there already) for asks about to go out.
    pub(super) fn start(&mut self, now: Instant) {
        if self.since.is_some() || !self.raise.usable() {
            return;
        }
        if self.raise.raised.swap(true, Ordering::SeqCst) {
            // The loop put it there.
            self.since = Some(now);
            return;
        }
        self.enter(now);
    }

    fn enter(&mut self, now: Instant) {
        match crate::host::sys::real_time(self.raise.priority) {
            Ok(()) => self.since = Some(now),
            Err(e) => self.raise.refused(&e),
        }
    }

    /// At the thread's turn: a raise by the loop counts from `now`.
    pub(super) fn adopt(&mut self, now: Instant) {
        if self.since.is_none() && self.raise.raised.load(Ordering::SeqCst) {
            self.since = Some(now);
        }
    }

    /// Back to the normal class once the requests made since it entered are answered and no
    /// burst goes on (or after [`BOOST_MOST`]); straight back in if the loop handed over an ask
    /// meanwhile (`pending`), since its raise may have come before this.
    /// `waiting(at)`: whether a request made since `at` is still in flight, or a burst goes on.
    pub(super) fn end_when_answered(&mut self, waiting: impl FnOnce(Instant) -> bool, pending: impl FnOnce() -> bool) {
        let Some(at) = self.since else { return };
        if at.elapsed() < BOOST_MOST && waiting(at) {
            return;
        }
        self.since = None;
        self.raise.raised.store(false, Ordering::SeqCst);
        if let Err(e) = crate::host::sys::normal_class() {
            warn!("the held pods' prober stays SCHED_FIFO: {e}");
        }
        if pending() {
            self.raise.raised.store(true, Ordering::SeqCst);
            self.enter(Instant::now());
        }
    }
}

/// How long the connections of a pod given back stay open: closing one costs the prober a close
/// on the loopback and wakes the proxy, and a pod is given back once released, while the rest of
/// its round waits on the same CPUs for its proxies' answers. A round's are closed together after
/// it (each close 28 µs of the prober's CPU, 3 ms a 110-pod round).
pub(super) const RETIRE_AFTER: Duration = Duration::from_secs(1);

/// Pods given back, their connections open until [`RETIRE_AFTER`] (closed as each is dropped),
/// oldest first.
pub(super) struct Retired<T>(pub(super) VecDeque<(Instant, T)>);

impl<T> Default for Retired<T> {
    fn default() -> Self {
        Retired(VecDeque::new())
    }
}

impl<T> Retired<T> {
    pub(super) fn push(&mut self, pod: T) {
        self.0.push_back((Instant::now(), pod));
    }

    /// Closes the connections of those given back [`RETIRE_AFTER`] before `now`; when the next
    /// are due.
    pub(super) fn close_due(&mut self, now: Instant) -> Option<Instant> {
        while let Some((at, _)) = self.0.front() {
            let due = *at + RETIRE_AFTER;
            if due > now {
                return Some(due);
            }
            self.0.pop_front();
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_pace_keeps_the_threads_cpu_within_its_share() {
        let (ms, us) = (Duration::from_millis, Duration::from_micros);
        let mut cpu = ms(100);
        let mut pace = CpuPace::new(cpu);
        let mut slot = |spent: Duration, floor: Duration, share: f64| {
            cpu += spent;
            pace.period(cpu, floor, share)
        };
        let near = |d: Duration, want: Duration| (d.as_secs_f64() - want.as_secs_f64()).abs() < 1e-6;
        // A cheap period (2.5 ms at 2 %): the interval.
        assert_eq!(slot(us(50), ms(10), 0.02), ms(10));
        // 0.88 ms of CPU a period (20 held pods at 44 µs each), which 2 % of a core allows every
        // 44 ms: the mean gets there.
        let mut period = Duration::ZERO;
        for _ in 0..200 {
            period = slot(us(880), ms(10), 0.02);
        }
        assert!(near(period, ms(44)), "{period:?}");
        // One period ten times as dear is paid for over the next ones, an eighth of what it cost
        // over the rest at the next slot, and less at each after it.
        let dear = slot(us(8_800), ms(10), 0.02);
        assert!(near(dear, us(93_500)), "{dear:?}");
        let after = slot(us(880), ms(10), 0.02);
        assert!(near(after, us(87_312) + Duration::from_nanos(500)), "{after:?}");
        // Over time the thread keeps to its share, a dear period every 20 among them.
        let (mut spent, mut time) = (Duration::ZERO, Duration::ZERO);
        for i in 0..2_000 {
            let cost = if i % 20 == 0 { us(8_800) } else { us(880) };
            spent += cost;
            time += slot(cost, ms(10), 0.02);
        }
        let used = spent.as_secs_f64() / time.as_secs_f64();
        assert!((0.0195..=0.0201).contains(&used), "{:.4} of a core", used);
        // A longer interval is kept; no budget (a whole core or more) is the interval.
        assert_eq!(slot(us(100), Duration::from_secs(1), 0.02), Duration::from_secs(1));
        assert_eq!(slot(ms(5), ms(10), 1.0), ms(10));
        // The thread's own clock moves with its work.
        let before = thread_cpu();
        let mut x = 0u64;
        for i in 0..5_000_000u64 {
            x = std::hint::black_box(x.wrapping_add(i));
        }
        assert!(thread_cpu() > before, "the thread's CPU clock did not move ({x})");
    }

    #[test]
    fn a_pod_given_back_is_dropped_once_its_time_is_up() {
        let mut retired = Retired::default();
        assert_eq!(retired.close_due(Instant::now()), None);
        let dropped = Arc::new(());
        retired.push(dropped.clone());
        let now = Instant::now();
        assert_eq!(retired.close_due(now), Some(retired.0[0].0 + RETIRE_AFTER));
        assert_eq!(Arc::strong_count(&dropped), 2, "kept until its time");
        assert_eq!(retired.close_due(now + RETIRE_AFTER), None);
        assert_eq!(Arc::strong_count(&dropped), 1, "dropped once its time is up");
    }

    #[test]
    fn the_real_time_class_lasts_until_the_requests_made_in_it_are_answered() {
        let policy = || crate::host::sys::sched_policy().expect("sched_getscheduler");
        assert_eq!(policy(), libc::SCHED_OTHER);
        let mut boost = Boost::new(Raise::new(1));
        let now = Instant::now();
        boost.start(now);
        assert!(boost.raise.usable(), "SCHED_FIFO refused: the tests run as root (CAP_SYS_NICE)");
        assert_eq!(policy(), libc::SCHED_FIFO);
        // A request made since in flight keeps it there; once answered, back.
        boost.end_when_answered(|at| at == now, || false);
        assert_eq!(policy(), libc::SCHED_FIFO);
        boost.end_when_answered(|_| false, || false);
        assert_eq!(policy(), libc::SCHED_OTHER);
        // An ask handed over meanwhile: straight back in.
        boost.start(Instant::now());
        boost.end_when_answered(|_| false, || true);
        assert_eq!((policy(), boost.since.is_some()), (libc::SCHED_FIFO, true));
        boost.end_when_answered(|_| false, || false);
        assert_eq!(policy(), libc::SCHED_OTHER);
        // None asked for: the class is never entered.
        let mut none = Boost::new(Raise::new(0));
        none.start(Instant::now());
        assert_eq!((policy(), none.since), (libc::SCHED_OTHER, None));
    }

    /// The loop raises the thread it is about to wake: the thread is in the class before it runs,
    /// and counts its time there from its next turn.
    #[test]
    fn the_loop_raises_the_prober_before_it_wakes_it() {
        let raise = Raise::new(1);
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let (back, policies) = std::sync::mpsc::channel();
        let thread_raise = raise.clone();
        let thread = std::thread::spawn(move || {
            let policy = || crate::host::sys::sched_policy().expect("sched_getscheduler");
            let mut boost = Boost::new(thread_raise);
            back.send((policy(), boost.since.is_some())).expect("send");
            rx.recv().expect("woken");
            // The loop's raise came before the wake-up.
            let woken = policy();
            boost.adopt(Instant::now());
            let adopted = boost.since.is_some();
            boost.end_when_answered(|_| false, || false);
            back.send((woken, adopted)).expect("send");
            back.send((policy(), boost.since.is_some())).expect("send");
        });
        assert_eq!(policies.recv().expect("first"), (libc::SCHED_OTHER, false));
        raise.raise();
        tx.send(()).expect("wake");
        assert_eq!(policies.recv().expect("woken"), (libc::SCHED_FIFO, true), "raised before its wake-up");
        assert_eq!(policies.recv().expect("after"), (libc::SCHED_OTHER, false), "back once answered");
        thread.join().expect("join");
    }
}
