//! The held pods' prober's connections: one kept per proxy endpoint, made without blocking from
//! inside the pod's network namespace, each request's answer read as its connection moves
//! ([`super::held_poll`]).

use std::io::{ErrorKind, Read as _, Write as _};
use std::net::TcpStream;
use std::time::Instant;

use super::answer::{Answer, LIMITS};
use super::held_poll::{Key, Poller};
use crate::sidecar::http::{self, Failure};
use crate::sidecar::{SidecarLink, SocketError};

/// A connection to one endpoint, and where its request is.
pub(super) enum Conn {
    None,
    /// Answered; can carry the next request.
    Idle(TcpStream),
    Connecting {
        stream: TcpStream,
        since: Instant,
    },
    Waiting {
        stream: TcpStream,
        since: Instant,
        buf: Vec<u8>,
        /// On a connection that had carried a request: closed by the server before any answer,
        /// the request goes again on a new one.
        reused: bool,
    },
}

pub(super) struct Endpoint {
    pub(super) name: String,
    pub(super) port: u16,
    pub(super) request: Vec<u8>,
    pub(super) conn: Conn,
    /// Its connection's place in the prober's epoll set.
    pub(super) key: Key,
    /// Its connection moved (an edge-triggered event, which comes once) and was not looked at
    /// yet: its pod's lagged group's answers were not to be read then.
    pub(super) moved: bool,
    pub(super) answer: Option<Answer>,
}

impl Endpoint {
    /// Its request is out and its answer not read yet (or it is still connecting).
    pub(super) fn in_flight(&self) -> bool {
        matches!(self.conn, Conn::Connecting { .. } | Conn::Waiting { .. })
    }
}

/// A new connection to `ep` (answered at once if it cannot be made).
pub(super) fn connect(
    link: &dyn SidecarLink,
    poller: &Poller,
    uid: &str,
    ep: &mut Endpoint,
    now: Instant,
) -> Result<(), String> {
    use nix::errno::Errno;
    use nix::sys::socket::SockaddrIn;
    let fd = match link.pod_socket(uid) {
        Ok(fd) => fd,
        Err(SocketError::Failed(why)) => {
            ep.answer = Some(Answer::Failed(why));
            return Ok(());
        }
        Err(SocketError::Stranded(why)) => return Err(why),
    };
    let stream = TcpStream::from(fd);
    let _ = stream.set_nodelay(true);
    ep.moved = false;
    ep.key = match poller.register(&stream) {
        Ok(key) => key,
        Err(e) => {
            ep.answer = Some(Answer::Failed(format!("epoll: {e}")));
            return Ok(());
        }
    };
    match nix::sys::socket::connect(std::os::fd::AsRawFd::as_raw_fd(&stream), &SockaddrIn::new(127, 0, 0, 1, ep.port)) {
        Ok(()) => send(link, poller, uid, ep, stream, now, false)?,
        Err(Errno::EINPROGRESS) => ep.conn = Conn::Connecting { stream, since: now },
        Err(Errno::ECONNREFUSED) => ep.answer = Some(Answer::Failed(Failure::Refused.to_string())),
        Err(e) => ep.answer = Some(Answer::Failed(format!("connect: {e}"))),
    }
    Ok(())
}

/// Writes `ep`'s request on `stream`. A kept connection the server closed meanwhile is replaced
/// by a new one.
pub(super) fn send(
    link: &dyn SidecarLink,
    poller: &Poller,
    uid: &str,
    ep: &mut Endpoint,
    stream: TcpStream,
    now: Instant,
    reused: bool,
) -> Result<(), String> {
    match (&stream).write(&ep.request) {
        Ok(n) if n == ep.request.len() => {
            ep.conn = Conn::Waiting { stream, since: now, buf: Vec::new(), reused };
            Ok(())
        }
        Err(_) if reused => {
            drop(stream);
            connect(link, poller, uid, ep, now)
        }
        Ok(_) => {
            ep.answer = Some(Answer::Failed("request not written whole".into()));
            Ok(())
        }
        Err(e) => {
            ep.answer = Some(Answer::Failed(format!("write: {e}")));
            Ok(())
        }
    }
}

/// What moved on `ep`'s connection: connected (the request goes out), or answer bytes (read until
/// it would block: an edge-triggered event comes once).
pub(super) fn progress(
    link: &dyn SidecarLink,
    poller: &Poller,
    uid: &str,
    ep: &mut Endpoint,
    now: Instant,
) -> Result<(), String> {
    ep.moved = false;
    match std::mem::replace(&mut ep.conn, Conn::None) {
        Conn::Connecting { stream, since } => match stream.take_error() {
            Ok(None) => send(link, poller, uid, ep, stream, since, false),
            Ok(Some(e)) | Err(e) => {
                let failure = match e.kind() {
                    ErrorKind::ConnectionRefused => Failure::Refused.to_string(),
                    _ => format!("connect: {e}"),
                };
                ep.answer = Some(Answer::Failed(failure));
                Ok(())
            }
        },
        Conn::Waiting { mut stream, since, mut buf, reused } => {
            let mut chunk = [0u8; 512];
            loop {
                match stream.read(&mut chunk) {
                    // Closed before any answer on a kept connection: the request goes again.
                    Ok(0) if buf.is_empty() && reused => return connect(link, poller, uid, ep, now),
                    Ok(0) => {
                        ep.answer = Some(answer_so_far(&buf, "the connection was closed".into()));
                        return Ok(());
                    }
                    Ok(n) => {
                        if http::absorb(&mut buf, &chunk[..n], LIMITS) {
                            match http::answer(&buf, LIMITS, true) {
                                Ok((r, again)) => {
                                    ep.answer = Some(Answer::Status(r.status));
                                    if again {
                                        ep.conn = Conn::Idle(stream);
                                    }
                                }
                                Err(f) => ep.answer = Some(Answer::Failed(f.to_string())),
                            }
                            return Ok(());
                        }
                    }
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(e) if e.kind() == ErrorKind::WouldBlock => {
                        ep.conn = Conn::Waiting { stream, since, buf, reused };
                        return Ok(());
                    }
                    Err(_) if buf.is_empty() && reused => return connect(link, poller, uid, ep, now),
                    Err(e) => {
                        ep.answer = Some(Answer::Failed(e.to_string()));
                        return Ok(());
                    }
                }
            }
        }
        other => {
            ep.conn = other;
            Ok(())
        }
    }
}

/// What an unfinished read says: a status line that already arrived is an answer, even if the
/// rest never comes; else `failure`.
pub(super) fn answer_so_far(buf: &[u8], failure: String) -> Answer {
    match http::parse_response(buf, LIMITS) {
        Ok(r) => Answer::Status(r.status),
        Err(_) => Answer::Failed(failure),
    }
}
