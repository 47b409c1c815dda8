//! A deliberately small, blocking HTTP/1.1 client for sidecar endpoints: hard connect and total
//! deadlines, and a cap on what it reads, so a hung or hostile endpoint can cost at most the
//! deadline and a few kilobytes. A connection may be kept for the next request when the answer
//! ended exactly where its `Content-Length` said and the server did not ask to close it.

use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// Limits for one request.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    pub connect_timeout: Duration,
    /// Whole exchange, connect included.
    pub total_timeout: Duration,
    /// Most bytes read from the response (status line, headers and body).
    pub max_response_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            connect_timeout: Duration::from_millis(500),
            total_timeout: Duration::from_secs(2),
            max_response_bytes: 16 * 1024,
        }
    }
}

/// What came back.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Response {
    pub status: u16,
    /// Body bytes read (up to the cap), lossily decoded.
    pub body: String,
}

/// Why a request failed, in words that fit a log line and an Event.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Failure {
    Refused,
    ConnectTimeout,
    Timeout,
    Malformed(String),
    Io(String),
}

impl std::fmt::Display for Failure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Failure::Refused => write!(f, "connection refused"),
            Failure::ConnectTimeout => write!(f, "connect timed out"),
            Failure::Timeout => write!(f, "no complete answer before the deadline"),
            Failure::Malformed(why) => write!(f, "malformed response: {why}"),
            Failure::Io(e) => write!(f, "{e}"),
        }
    }
}

impl Failure {
    /// Short label for metrics.
    pub fn label(&self) -> &'static str {
        match self {
            Failure::Refused => "refused",
            Failure::ConnectTimeout => "connect_timeout",
            Failure::Timeout => "timeout",
            Failure::Malformed(_) => "malformed",
            Failure::Io(_) => "io",
        }
    }
}

impl From<Failure> for Error {
    fn from(f: Failure) -> Self {
        Error::Endpoint(f.to_string())
    }
}

/// Sends `method path` to `addr` on a new connection and reads the status and (capped) body.
pub fn request(addr: SocketAddr, method: &str, path: &str, limits: Limits) -> Result<Response, Failure> {
    let started = Instant::now();
    let mut stream = connect(addr, limits)?;
    exchange(&mut stream, addr, method, path, limits, started, false).map(|(r, _)| r)
}

/// Opens a connection (blocking, at most `limits.connect_timeout`). The socket lives in the
/// network namespace of the thread that calls this; it can be used from any thread afterwards.
pub fn connect(addr: SocketAddr, limits: Limits) -> Result<TcpStream, Failure> {
    let stream = TcpStream::connect_timeout(&addr, limits.connect_timeout).map_err(|e| match e.kind() {
        std::io::ErrorKind::ConnectionRefused => Failure::Refused,
        std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock => Failure::ConnectTimeout,
        _ => Failure::Io(e.to_string()),
    })?;
    let _ = stream.set_nodelay(true);
    Ok(stream)
}

/// Whether a kept connection can carry another request: nothing has arrived on it (a server
/// that closed it, or sent something unasked, makes it readable).
pub fn idle_and_open(stream: &impl std::os::fd::AsRawFd) -> bool {
    let mut pfd = libc::pollfd { fd: stream.as_raw_fd(), events: libc::POLLIN | libc::POLLRDHUP, revents: 0 };
    // SAFETY: one valid pollfd, zero timeout.
    let n = unsafe { libc::poll(&mut pfd, 1, 0) };
    n == 0
}

/// One request on an open connection; `keep`: ask the server to keep it open. Returns the
/// answer and whether the connection can be used again (the answer ended exactly at its
/// `Content-Length` and the server did not say `Connection: close`). `started`: when the whole
/// request began (the total deadline counts from there).
pub fn exchange(
    stream: &mut TcpStream,
    addr: SocketAddr,
    method: &str,
    path: &str,
    limits: Limits,
    started: Instant,
    keep: bool,
) -> Result<(Response, bool), Failure> {
    stream.set_write_timeout(Some(time_left(limits, started)?)).map_err(|e| Failure::Io(e.to_string()))?;
    let req = request_text(addr, method, path, keep);
    stream.write_all(req.as_bytes()).map_err(|e| io_failure(&e))?;

    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 4096];
    loop {
        stream.set_read_timeout(Some(time_left(limits, started)?)).map_err(|e| Failure::Io(e.to_string()))?;
        match stream.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => {
                if absorb(&mut buf, &chunk[..n], limits) {
                    break;
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                // A status line that already arrived is an answer, even if the rest hangs.
                if parse_response(&buf, limits).is_ok() {
                    break;
                }
                return Err(io_failure(&e));
            }
        }
    }
    answer(&buf, limits, keep)
}

/// Time left of the request's total deadline; none left is a timeout.
fn time_left(limits: Limits, started: Instant) -> Result<Duration, Failure> {
    limits.total_timeout.checked_sub(started.elapsed()).filter(|d| !d.is_zero()).ok_or(Failure::Timeout)
}

/// Adds bytes read to the answer, up to the cap; whether reading can stop (the cap is reached or
/// the answer is complete).
pub fn absorb(buf: &mut Vec<u8>, bytes: &[u8], limits: Limits) -> bool {
    let room = limits.max_response_bytes.saturating_sub(buf.len());
    buf.extend_from_slice(&bytes[..bytes.len().min(room)]);
    buf.len() >= limits.max_response_bytes || response_complete(buf)
}

/// The answer read, and whether its connection can carry another request.
pub fn answer(buf: &[u8], limits: Limits, keep: bool) -> Result<(Response, bool), Failure> {
    let response = parse_response(buf, limits)?;
    Ok((response, keep && reusable(buf)))
}

pub fn request_text(addr: SocketAddr, method: &str, path: &str, keep: bool) -> String {
    let host = match addr {
        SocketAddr::V4(a) => format!("{}:{}", a.ip(), a.port()),
        SocketAddr::V6(a) => format!("[{}]:{}", a.ip(), a.port()),
    };
    let connection = if keep { "keep-alive" } else { "close" };
    format!(
        "{method} {path} HTTP/1.1\r\nHost: {host}\r\nUser-Agent: valet\r\nAccept: */*\r\nContent-Length: 0\r\nConnection: {connection}\r\n\r\n"
    )
}

/// [`exchange`] on the agent's runtime, for a kept connection (no thread hop): the same request,
/// deadline, cap and reuse rule.
#[allow(clippy::too_many_arguments)]
pub async fn exchange_async(
    stream: &mut tokio::net::TcpStream,
    addr: SocketAddr,
    method: &str,
    path: &str,
    limits: Limits,
    started: Instant,
    keep: bool,
    sent: usize,
) -> Result<(Response, bool), Failure> {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let left = time_left(limits, started)?;
    let req = request_text(addr, method, path, keep);
    let mut buf = Vec::with_capacity(512);
    let io = async {
        // `sent`: the first bytes of this same request already went out (a quit written at once).
        stream.write_all(req.as_bytes().get(sent..).unwrap_or_default()).await.map_err(|e| io_failure(&e))?;
        // Small: it lives in the future, which is moved into a box for every probe (a sidecar's
        // answer is a status line and a few headers; a longer one takes more reads).
        let mut chunk = [0u8; 512];
        loop {
            match stream.read(&mut chunk).await {
                Ok(0) => return Ok(()),
                Ok(n) => {
                    if absorb(&mut buf, &chunk[..n], limits) {
                        return Ok(());
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(io_failure(&e)),
            }
        }
    };
    match tokio::time::timeout(left, io).await {
        Ok(Ok(())) => {}
        // A status line that already arrived is an answer, even if the rest hangs.
        Ok(Err(_)) | Err(_) if parse_response(&buf, limits).is_ok() => {
            return Ok((parse_response(&buf, limits)?, false));
        }
        Ok(Err(e)) => return Err(e),
        Err(_) => return Err(Failure::Timeout),
    }
    answer(&buf, limits, keep)
}

/// Whether a complete answer ends exactly at its `Content-Length` and leaves the connection open.
fn reusable(buf: &[u8]) -> bool {
    let Some(end) = find(buf, b"\r\n\r\n") else { return false };
    let head = String::from_utf8_lossy(&buf[..end]);
    let header = |name: &str| {
        head.lines().skip(1).find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.trim().eq_ignore_ascii_case(name).then(|| v.trim().to_owned())
        })
    };
    if header("connection").is_some_and(|v| v.eq_ignore_ascii_case("close")) || !head.starts_with("HTTP/1.1 ") {
        return false;
    }
    match header("content-length").and_then(|v| v.parse::<usize>().ok()) {
        Some(n) => buf.len().saturating_sub(end + 4) == n,
        None => false,
    }
}

fn io_failure(e: &std::io::Error) -> Failure {
    match e.kind() {
        std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock => Failure::Timeout,
        _ => Failure::Io(e.to_string()),
    }
}

/// Whether the bytes read so far hold the headers and a Content-Length body: reading can stop.
pub fn response_complete(buf: &[u8]) -> bool {
    let Some(end) = find(buf, b"\r\n\r\n") else { return false };
    let head = String::from_utf8_lossy(&buf[..end]);
    let length = head.lines().find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.trim().eq_ignore_ascii_case("content-length").then(|| v.trim().parse::<usize>().ok()).flatten()
    });
    match length {
        // Saturating: a Content-Length near usize::MAX must not overflow (a panic in debug builds).
        Some(n) => buf.len().saturating_sub(end + 4) >= n,
        None => false,
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// The status and body of what a sidecar answered, from the bytes [`request`] read (only the
/// first `limits.max_response_bytes` count, as when reading). Pure: the fuzz target
/// `http_response` calls it with arbitrary bytes.
pub fn parse_response(bytes: &[u8], limits: Limits) -> Result<Response, Failure> {
    parse(&bytes[..bytes.len().min(limits.max_response_bytes)])
}

fn parse(buf: &[u8]) -> Result<Response, Failure> {
    let line_end = find(buf, b"\r\n").ok_or_else(|| {
        if buf.is_empty() {
            Failure::Malformed("empty response".into())
        } else {
            Failure::Malformed("no status line".into())
        }
    })?;
    let line = String::from_utf8_lossy(&buf[..line_end]);
    let mut parts = line.splitn(3, ' ');
    let version = parts.next().unwrap_or_default();
    if !version.starts_with("HTTP/1.") {
        return Err(Failure::Malformed(format!("not HTTP/1.x: {:.40}", line)));
    }
    let status = parts
        .next()
        .and_then(|s| s.parse::<u16>().ok())
        .filter(|s| (100..600).contains(s))
        .ok_or_else(|| Failure::Malformed(format!("bad status line: {:.40}", line)))?;
    let body = match find(buf, b"\r\n\r\n") {
        Some(end) => String::from_utf8_lossy(&buf[end + 4..]).into_owned(),
        None => String::new(),
    };
    Ok(Response { status, body })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    /// Only a guard against a hang: the tests wait for events, never for a time.
    const HANG_GUARD: Duration = Duration::from_secs(30);

    fn serve(reply: &'static [u8]) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        std::thread::spawn(move || {
            if let Ok((mut s, _)) = listener.accept() {
                let mut buf = [0u8; 1024];
                let _ = s.read(&mut buf);
                let _ = s.write_all(reply);
            }
        });
        addr
    }

    /// A server that accepts one connection, reads the request, sends `reply` (if any) and then
    /// keeps the connection open until the test lets it go (`Sender::send`). Joined, it says
    /// whether the test let it go before the hang guard did.
    fn serve_and_hold(
        reply: &'static [u8],
    ) -> (SocketAddr, std::sync::mpsc::Sender<()>, std::thread::JoinHandle<bool>) {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (let_go, held) = std::sync::mpsc::channel();
        let server = std::thread::spawn(move || {
            let Ok((mut s, _)) = listener.accept() else { return false };
            let mut buf = [0u8; 1024];
            let _ = s.read(&mut buf);
            let _ = s.write_all(reply);
            held.recv_timeout(HANG_GUARD).is_ok()
        });
        (addr, let_go, server)
    }

    #[test]
    fn reads_status_and_body() {
        let addr = serve(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nOK");
        let r = request(addr, "POST", "/quitquitquit", Limits::default()).expect("answer");
        assert_eq!(r, Response { status: 200, body: "OK".into() });
    }

    // The deadline is what is tested: the server holds the connection open until the answer is
    // in, so the answer can only have come at the deadline, not at the close.
    #[test]
    fn a_status_line_then_silence_is_still_an_answer() {
        let (addr, let_go, server) = serve_and_hold(b"HTTP/1.1 403 Forbidden\r\n\r\nOnly requests from localhost");
        let limits = Limits { total_timeout: Duration::from_millis(300), ..Limits::default() };
        let r = request(addr, "POST", "/quitquitquit", limits);
        let _ = let_go.send(());
        assert!(server.join().expect("server"), "answered only when the server closed the connection");
        assert_eq!(r.expect("answer").status, 403);
    }

    #[test]
    fn a_hung_endpoint_times_out() {
        let (addr, let_go, server) = serve_and_hold(b"");
        let limits = Limits { total_timeout: Duration::from_millis(200), ..Limits::default() };
        let r = request(addr, "POST", "/q", limits);
        let _ = let_go.send(());
        assert!(server.join().expect("server"), "returned only when the server closed the connection");
        assert_eq!(r, Err(Failure::Timeout));
    }

    #[test]
    fn an_endless_answer_is_capped() {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        std::thread::spawn(move || {
            if let Ok((mut s, _)) = listener.accept() {
                let _ = s.write_all(b"HTTP/1.1 200 OK\r\n\r\n");
                let junk = [b'x'; 8192];
                while s.write_all(&junk).is_ok() {}
            }
        });
        let r = request(addr, "GET", "/ready", Limits::default()).expect("answer");
        assert_eq!(r.status, 200);
        assert!(r.body.len() <= Limits::default().max_response_bytes);
    }

    /// Answers requests on one connection, as Go's `http.Serve` does; (address, accepted count).
    fn keep_alive_server(reply: &'static [u8]) -> (SocketAddr, std::sync::Arc<std::sync::atomic::AtomicUsize>) {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let accepted = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let count = accepted.clone();
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                let Ok(mut s) = conn else { return };
                count.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                std::thread::spawn(move || {
                    let mut buf = [0u8; 1024];
                    while let Ok(n) = s.read(&mut buf) {
                        if n == 0 || s.write_all(reply).is_err() {
                            return;
                        }
                    }
                });
            }
        });
        (addr, accepted)
    }

    #[test]
    fn a_kept_connection_carries_the_next_request() {
        let (addr, accepted) = keep_alive_server(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nOK");
        let limits = Limits::default();
        let mut s = connect(addr, limits).expect("connect");
        for _ in 0..3 {
            assert!(idle_and_open(&s));
            let (r, again) = exchange(&mut s, addr, "GET", "/ready", limits, Instant::now(), true).expect("answer");
            assert_eq!(r, Response { status: 200, body: "OK".into() });
            assert!(again, "a complete keep-alive answer leaves the connection usable");
        }
        assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 1, "one connection for three requests");
        // Asking to close: not kept.
        let (_, again) = exchange(&mut s, addr, "POST", "/quit", limits, Instant::now(), false).expect("answer");
        assert!(!again);
    }

    #[tokio::test]
    async fn a_kept_connection_works_the_same_on_the_runtime() {
        let (addr, accepted) = keep_alive_server(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nOK");
        let limits = Limits::default();
        let std_stream = connect(addr, limits).expect("connect");
        std_stream.set_nonblocking(true).expect("nonblocking");
        let mut s = tokio::net::TcpStream::from_std(std_stream).expect("tokio stream");
        for _ in 0..3 {
            assert!(idle_and_open(&s));
            let (r, again) =
                exchange_async(&mut s, addr, "GET", "/ready", limits, Instant::now(), true, 0).await.expect("answer");
            assert_eq!(r, Response { status: 200, body: "OK".into() });
            assert!(again);
        }
        assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 1);
        // A hung server: the deadline holds.
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let hung = listener.local_addr().expect("addr");
        let std_stream = connect(hung, limits).expect("connect");
        std_stream.set_nonblocking(true).expect("nonblocking");
        let mut s = tokio::net::TcpStream::from_std(std_stream).expect("tokio stream");
        // The listener never accepts nor closes while the request is under way.
        let short = Limits { total_timeout: Duration::from_millis(200), ..limits };
        let r = tokio::time::timeout(
            HANG_GUARD,
            exchange_async(&mut s, hung, "GET", "/ready", short, Instant::now(), true, 0),
        )
        .await;
        assert_eq!(r, Ok(Err(Failure::Timeout)), "the deadline did not hold");
        drop(listener);
    }

    #[test]
    fn answers_that_close_or_lack_a_length_are_not_kept() {
        assert!(reusable(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nOK"));
        assert!(!reusable(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nOK"));
        assert!(!reusable(b"HTTP/1.1 200 OK\r\n\r\nOK"), "no length: ends at close");
        assert!(!reusable(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nOKextra"), "more than announced");
        assert!(!reusable(b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nOK"));
        // A server that closed a kept connection makes it readable: not idle any more.
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let s = connect(addr, Limits::default()).expect("connect");
        let (server_side, _) = listener.accept().expect("accept");
        assert!(idle_and_open(&s));
        drop(server_side);
        // The close reaches this end in the network stack's time, not at once.
        let deadline = Instant::now() + HANG_GUARD;
        while idle_and_open(&s) {
            assert!(Instant::now() < deadline, "still idle and open after the server closed it");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn parses_without_io() {
        let limits = Limits::default();
        let ok = parse_response(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nOK", limits);
        assert_eq!(ok, Ok(Response { status: 200, body: "OK".into() }));
        let capped = parse_response(b"HTTP/1.1 200 OK\r\n\r\nabcdef", Limits { max_response_bytes: 21, ..limits });
        assert_eq!(capped.map(|r| r.body), Ok("ab".into()));
        assert!(matches!(parse_response(b"HTTP/1.1 999 Nope\r\n", limits), Err(Failure::Malformed(_))));
        assert!(matches!(parse_response(b"HTTP/1.1 200 OK", limits), Err(Failure::Malformed(_))));
        assert!(response_complete(b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n"));
        assert!(!response_complete(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nab"));
    }

    #[test]
    fn a_huge_content_length_is_not_an_overflow() {
        // Found while writing the http_response fuzz target (20 s of fuzzing did not reach it):
        // `end + 4 + n` overflowed for a Content-Length near usize::MAX.
        let head = format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\nx", usize::MAX);
        assert!(!response_complete(head.as_bytes()));
        assert_eq!(parse_response(head.as_bytes(), Limits::default()).map(|r| r.status), Ok(200));
    }

    #[test]
    fn refused_and_garbage_are_clear_errors() {
        let addr = {
            let l = TcpListener::bind("127.0.0.1:0").expect("bind");
            l.local_addr().expect("addr")
        };
        assert_eq!(request(addr, "GET", "/", Limits::default()), Err(Failure::Refused));
        let addr = serve(b"SSH-2.0-OpenSSH\r\n");
        assert!(matches!(request(addr, "GET", "/", Limits::default()), Err(Failure::Malformed(_))));
        let addr = serve(b"");
        assert!(matches!(request(addr, "GET", "/", Limits::default()), Err(Failure::Malformed(_))));
    }
}
