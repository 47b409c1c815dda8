//! What the held pods' prober waits on: its wake-up, and the connections to the held pods'
//! proxies in an epoll set, each registered once when it is made (edge-triggered), so that a
//! wait costs the kernel the connections that moved, not every one in flight. With `ppoll` over
//! every request in flight, a 110-pod round (dozens of proxies still to answer at each wake-up)
//! spent half of the prober's CPU in the kernel's poll of each socket.
//!
//! Edge-triggered: an event says once that a connection moved. The prober reads a connection
//! until it would block whenever it is told (or, for a lagged group, once its lag is over), so
//! no answer waits for an event that already came.

use std::cell::Cell;
use std::io;
use std::net::TcpStream;
use std::os::fd::{AsFd as _, AsRawFd as _, BorrowedFd};
use std::time::Duration;

use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};

/// Most events taken at a time (the rest stay ready for the next wait).
const EVENTS: usize = 256;

/// A connection's place in the set: its fd and a generation, so that an event read for a
/// connection closed meanwhile is not taken for a new one that got its fd number.
pub(super) type Key = u64;

pub(super) struct Poller {
    epoll: Epoll,
    events: Vec<EpollEvent>,
    generation: Cell<u32>,
}

/// What a wait saw.
pub(super) struct Waited<'a> {
    /// The wake-up's fd was readable (read it).
    pub(super) woken: bool,
    /// The connections that moved.
    pub(super) moved: &'a [Key],
}

impl Poller {
    pub(super) fn new() -> io::Result<Poller> {
        let epoll = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC)?;
        Ok(Poller { epoll, events: vec![EpollEvent::empty(); EVENTS], generation: Cell::new(0) })
    }

    /// Registers a connection just made, for its connect and every answer it carries; its key.
    /// It leaves the set when its socket is closed.
    pub(super) fn register(&self, stream: &TcpStream) -> io::Result<Key> {
        let generation = self.generation.get().wrapping_add(1);
        self.generation.set(generation);
        let key = (u64::from(stream.as_raw_fd() as u32) << 32) | u64::from(generation);
        let flags = EpollFlags::EPOLLIN | EpollFlags::EPOLLOUT | EpollFlags::EPOLLRDHUP | EpollFlags::EPOLLET;
        self.epoll.add(stream.as_fd(), EpollEvent::new(flags, key))?;
        Ok(key)
    }

    /// As [`Poller::wait`], but the connections are looked at only `from` now on: until then it
    /// sleeps on the wake-up alone, however many answers come. Each answer would wake it, and a
    /// real-time thread woken takes the CPU from the proxy running there: a 110-pod sweep's
    /// answers, read as they came, were all in about a millisecond later than read in batches.
    pub(super) fn wait_from<'a>(
        &mut self,
        wake: BorrowedFd<'_>,
        from: Duration,
        left: Duration,
        moved: &'a mut Vec<Key>,
    ) -> Waited<'a> {
        if from.is_zero() {
            return self.wait(wake, left, moved);
        }
        moved.clear();
        let mut fds = [libc::pollfd { fd: wake.as_raw_fd(), events: libc::POLLIN, revents: 0 }];
        if crate::host::sys::ppoll(&mut fds, from.min(left)).is_ok_and(|n| n > 0) {
            return Waited { woken: true, moved };
        }
        if from >= left {
            return Waited { woken: false, moved };
        }
        self.wait(wake, left - from, moved)
    }

    /// Waits up to `left` (to the nanosecond: `ppoll` on the wake-up and the set; `epoll_wait`
    /// alone counts in milliseconds) for the wake-up or a connection to move. `moved` is reused
    /// for the keys of those that did.
    pub(super) fn wait<'a>(&mut self, wake: BorrowedFd<'_>, left: Duration, moved: &'a mut Vec<Key>) -> Waited<'a> {
        moved.clear();
        let mut fds = [
            libc::pollfd { fd: wake.as_raw_fd(), events: libc::POLLIN, revents: 0 },
            libc::pollfd { fd: self.epoll.0.as_raw_fd(), events: libc::POLLIN, revents: 0 },
        ];
        if !crate::host::sys::ppoll(&mut fds, left).is_ok_and(|n| n > 0) {
            return Waited { woken: false, moved };
        }
        if fds[1].revents != 0
            && let Ok(n) = self.epoll.wait(&mut self.events, EpollTimeout::ZERO)
        {
            moved.extend(self.events[..n].iter().map(EpollEvent::data));
        }
        Waited { woken: fds[0].revents != 0, moved }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read as _, Write as _};
    use std::net::TcpListener;

    fn wake() -> std::fs::File {
        std::fs::File::from(crate::host::sys::eventfd().expect("eventfd"))
    }

    /// A connection moves once per change (its connect, an answer), and not again until the
    /// next; a closed connection's fd taken by a new one gets a new key.
    #[test]
    fn a_connection_is_reported_once_per_change_under_its_own_key() {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let wake = wake();
        let mut poller = Poller::new().expect("epoll");
        let mut moved = Vec::new();
        let client = TcpStream::connect(listener.local_addr().expect("addr")).expect("connect");
        let key = poller.register(&client).expect("register");
        let (mut server, _) = listener.accept().expect("accept");
        let guard = Duration::from_secs(5);
        // Connected (writable): one event, then none until something changes.
        assert_eq!(poller.wait(wake.as_fd(), guard, &mut moved).moved, &[key]);
        assert!(poller.wait(wake.as_fd(), Duration::from_millis(20), &mut moved).moved.is_empty(), "reported again");
        (&client).write_all(b"ask").expect("write");
        let mut got = [0u8; 3];
        server.read_exact(&mut got).expect("read");
        server.write_all(b"answer").expect("answer");
        assert_eq!(poller.wait(wake.as_fd(), guard, &mut moved).moved, &[key], "the answer");
        // The wake-up is told apart from the connections.
        (&wake).write_all(&1u64.to_ne_bytes()).expect("wake");
        let waited = poller.wait(wake.as_fd(), guard, &mut moved);
        assert!(waited.woken && waited.moved.is_empty());
        // Waiting from a moment on, an answer already there is not looked at before it; the
        // wake-up is.
        let mut buf = [0u8; 8];
        let _ = (&wake).read(&mut buf);
        (&client).write_all(b"ask").expect("write");
        server.read_exact(&mut got).expect("read");
        server.write_all(b"answer").expect("answer");
        let waited = poller.wait_from(wake.as_fd(), Duration::from_secs(3600), Duration::from_millis(50), &mut moved);
        assert!(!waited.woken && waited.moved.is_empty(), "looked at before its moment");
        (&wake).write_all(&1u64.to_ne_bytes()).expect("wake");
        let waited = poller.wait_from(wake.as_fd(), Duration::from_secs(3600), guard, &mut moved);
        assert!(waited.woken && waited.moved.is_empty());
        let _ = (&wake).read(&mut buf);
        assert_eq!(poller.wait_from(wake.as_fd(), Duration::from_millis(20), guard, &mut moved).moved, &[key]);
        let mut answer = [0u8; 6];
        (&client).read_exact(&mut answer).expect("the answer");
        // The same fd number for a new connection: another key.
        let fd = client.as_raw_fd();
        drop(client);
        let again = TcpStream::connect(listener.local_addr().expect("addr")).expect("connect");
        assert_eq!(again.as_raw_fd(), fd, "the lowest free fd is reused");
        let key2 = poller.register(&again).expect("register");
        assert_ne!(key2, key);
        assert_eq!(poller.wait(wake.as_fd(), guard, &mut moved).moved, &[key2]);
    }
}
