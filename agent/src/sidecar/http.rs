//! A deliberately small, blocking HTTP/1.1 client for sidecar endpoints: hard connect and total
//! deadlines, and a cap on what it reads, so a hung or hostile endpoint can cost at most the
//! deadline and a few kilobytes. An answer is complete at the end of its `Content-Length` body or
//! of its last chunk (Envoy's admin answers chunked: read to the deadline, every `/ready` of a
//! real Envoy took 500 ms). A connection may be kept for the next request when the answer ended
//! exactly there and the server did not ask to close it.

use std::io::{Read as _, Write as _};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::host::clock::monotonic_ns;

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
    /// When the request's last byte was written (CLOCK_MONOTONIC, ns; the kernel's event clock);
    /// 0 for an answer parsed alone.
    pub sent_ns: u64,
}

/// What of a request went out before [`exchange_async`] took it over: its first `bytes`, the
/// last of them written at `at_ns` (CLOCK_MONOTONIC).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Written {
    pub bytes: usize,
    pub at_ns: u64,
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
    exchange(&mut stream, Ask { addr, method, path, limits, started, keep: false }).map(|(r, _)| r)
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
    let mut pfd = [libc::pollfd { fd: stream.as_raw_fd(), events: libc::POLLIN | libc::POLLRDHUP, revents: 0 }];
    crate::host::sys::poll(&mut pfd, 0).is_ok_and(|n| n == 0)
}

/// One request, as [`exchange`] and [`exchange_async`] send it.
#[derive(Clone, Copy, Debug)]
pub struct Ask<'a> {
    pub addr: SocketAddr,
    pub method: &'a str,
    pub path: &'a str,
    pub limits: Limits,
    /// When the whole request began (the total deadline counts from there).
    pub started: Instant,
    /// Ask the server to keep the connection open.
    pub keep: bool,
}

/// One request on an open connection; `keep`: ask the server to keep it open. Returns the
/// answer and whether the connection can be used again (the answer ended exactly at its
/// `Content-Length` and the server did not say `Connection: close`). `started`: when the whole
/// request began (the total deadline counts from there).
pub fn exchange(stream: &mut TcpStream, ask: Ask<'_>) -> Result<(Response, bool), Failure> {
    let Ask { addr, method, path, limits, started, keep } = ask;
    stream.set_write_timeout(Some(time_left(limits, started)?)).map_err(|e| Failure::Io(e.to_string()))?;
    let req = request_text(addr, method, path, keep);
    stream.write_all(req.as_bytes()).map_err(|e| io_failure(&e))?;
    let sent_ns = monotonic_ns();

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
    answer(&buf, limits, keep).map(|(r, again)| (Response { sent_ns, ..r }, again))
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
pub async fn exchange_async(
    stream: &mut tokio::net::TcpStream,
    ask: Ask<'_>,
    sent: Written,
) -> Result<(Response, bool), Failure> {
    let Ask { addr, method, path, limits, started, keep } = ask;
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let left = time_left(limits, started)?;
    let req = request_text(addr, method, path, keep);
    let mut buf = Vec::with_capacity(512);
    let mut sent_ns = sent.at_ns;
    let io = async {
        // `sent`: the first bytes of this same request already went out (a quit written at once).
        let rest = req.as_bytes().get(sent.bytes..).unwrap_or_default();
        if !rest.is_empty() {
            stream.write_all(rest).await.map_err(|e| io_failure(&e))?;
            sent_ns = monotonic_ns();
        }
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
            return Ok((Response { sent_ns, ..parse_response(&buf, limits)? }, false));
        }
        Ok(Err(e)) => return Err(e),
        Err(_) => return Err(Failure::Timeout),
    }
    answer(&buf, limits, keep).map(|(r, again)| (Response { sent_ns, ..r }, again))
}

/// Whether a complete answer ends exactly where its framing says and leaves the connection open.
fn reusable(buf: &[u8]) -> bool {
    let Some(end) = find(buf, b"\r\n\r\n") else { return false };
    let head = String::from_utf8_lossy(&buf[..end]);
    if header(&head, "connection").is_some_and(|v| v.eq_ignore_ascii_case("close")) || !head.starts_with("HTTP/1.1 ") {
        return false;
    }
    frame(buf) == Frame::Complete(buf.len())
}

/// The value of header `name` in `head` (the status line and headers).
fn header<'a>(head: &'a str, name: &str) -> Option<&'a str> {
    head.lines().skip(1).find_map(|l| {
        let (k, v) = l.split_once(':')?;
        k.trim().eq_ignore_ascii_case(name).then(|| v.trim())
    })
}

/// How far the answer in a buffer has come.
#[derive(Debug, PartialEq, Eq)]
enum Frame {
    /// Headers, and a body whose end is known, are not all in yet.
    Partial,
    /// Complete: the answer's length in bytes.
    Complete(usize),
    /// Only the server's close ends it: no length, or a chunked body that cannot be read.
    UntilClose,
}

/// Where the answer in `buf` ends: after its `Content-Length` body, or after the last chunk and
/// trailers of a chunked one (`Transfer-Encoding` wins over `Content-Length`, as RFC 9112 says).
fn frame(buf: &[u8]) -> Frame {
    let Some(end) = find(buf, b"\r\n\r\n") else { return Frame::Partial };
    let head = String::from_utf8_lossy(&buf[..end]);
    let body_at = end + 4;
    if let Some(coding) = header(&head, "transfer-encoding") {
        let last = coding.rsplit(',').next().unwrap_or_default().trim();
        if !last.eq_ignore_ascii_case("chunked") {
            return Frame::UntilClose;
        }
        return match chunks(&buf[body_at..]) {
            Chunks::Partial => Frame::Partial,
            Chunks::End(n) => Frame::Complete(body_at + n),
            Chunks::Broken => Frame::UntilClose,
        };
    }
    match header(&head, "content-length").and_then(|v| v.parse::<usize>().ok()) {
        // Saturating: a Content-Length near usize::MAX must not overflow (a panic in debug builds).
        Some(n) if buf.len().saturating_sub(body_at) >= n => Frame::Complete(body_at.saturating_add(n)),
        Some(_) => Frame::Partial,
        None => Frame::UntilClose,
    }
}

enum Chunks {
    Partial,
    /// The chunked body ends after this many bytes.
    End(usize),
    Broken,
}

/// Walks a chunked body: its chunks' data, given to `data`, and where it ends.
fn walk_chunks(body: &[u8], mut data: impl FnMut(&[u8])) -> Chunks {
    let mut at = 0usize;
    loop {
        let Some(line) = find(&body[at..], b"\r\n") else { return Chunks::Partial };
        let size_text = String::from_utf8_lossy(&body[at..at + line]);
        let size_text = size_text.split(';').next().unwrap_or_default().trim();
        let Some(size) =
            usize::from_str_radix(size_text, 16).ok().filter(|_| !size_text.is_empty() && size_text.len() <= 8)
        else {
            return Chunks::Broken;
        };
        at += line + 2;
        if size == 0 {
            // Trailer fields, if any, then an empty line.
            if body[at..].starts_with(b"\r\n") {
                return Chunks::End(at + 2);
            }
            return match find(&body[at..], b"\r\n\r\n") {
                Some(t) => Chunks::End(at + t + 4),
                None => Chunks::Partial,
            };
        }
        let have = body.len() - at;
        data(&body[at..at + size.min(have)]);
        if have < size + 2 {
            return Chunks::Partial;
        }
        if &body[at + size..at + size + 2] != b"\r\n" {
            return Chunks::Broken;
        }
        at += size + 2;
    }
}

fn chunks(body: &[u8]) -> Chunks {
    walk_chunks(body, |_| {})
}

fn io_failure(e: &std::io::Error) -> Failure {
    match e.kind() {
        std::io::ErrorKind::TimedOut | std::io::ErrorKind::WouldBlock => Failure::Timeout,
        _ => Failure::Io(e.to_string()),
    }
}

/// Whether the bytes read so far hold a whole answer (headers, and a `Content-Length` or chunked
/// body): reading can stop.
pub fn response_complete(buf: &[u8]) -> bool {
    matches!(frame(buf), Frame::Complete(_))
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
        Some(end) => {
            let head = String::from_utf8_lossy(&buf[..end]);
            let raw = &buf[end + 4..];
            let chunked = header(&head, "transfer-encoding")
                .is_some_and(|c| c.rsplit(',').next().unwrap_or_default().trim().eq_ignore_ascii_case("chunked"));
            let mut data = Vec::new();
            if chunked && !matches!(walk_chunks(raw, |d| data.extend_from_slice(d)), Chunks::Broken) {
                String::from_utf8_lossy(&data).into_owned()
            } else {
                String::from_utf8_lossy(raw).into_owned()
            }
        }
        None => String::new(),
    };
    Ok(Response { status, body, sent_ns: 0 })
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
        let before = monotonic_ns();
        let r = request(addr, "POST", "/quitquitquit", Limits::default()).expect("answer");
        assert_eq!((r.status, r.body.as_str()), (200, "OK"));
        // The request's moment, on the kernel's clock: after the call began, before it returned.
        assert!((before..=monotonic_ns()).contains(&r.sent_ns), "sent at {} from {before}", r.sent_ns);
    }

    // The deadline is what is tested: the server holds the connection open until the answer is
    // in, so the answer can only have come at the deadline, not at the close.
    #[test]
    fn a_status_line_then_silence_is_still_an_answer() {
        let r = request_held_open(b"HTTP/1.1 403 Forbidden\r\n\r\nOnly requests from localhost", 300);
        assert_eq!(r.expect("answer").status, 403);
    }

    #[test]
    fn a_hung_endpoint_times_out() {
        assert_eq!(request_held_open(b"", 200), Err(Failure::Timeout));
    }

    /// A quit of `timeout_ms` to a server that writes `answer` and holds the connection open until
    /// the request returned: the request returned at its deadline, not at the close.
    fn request_held_open(answer: &'static [u8], timeout_ms: u64) -> Result<Response, Failure> {
        let (addr, let_go, server) = serve_and_hold(answer);
        let limits = Limits { total_timeout: Duration::from_millis(timeout_ms), ..Limits::default() };
        let r = request(addr, "POST", "/quitquitquit", limits);
        let _ = let_go.send(());
        assert!(server.join().expect("server"), "returned only when the server closed the connection");
        r
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
            let (r, again) = exchange(
                &mut s,
                Ask { addr, method: "GET", path: "/ready", limits, started: Instant::now(), keep: true },
            )
            .expect("answer");
            assert_eq!((r.status, r.body.as_str()), (200, "OK"));
            assert!(again, "a complete keep-alive answer leaves the connection usable");
        }
        assert_eq!(accepted.load(std::sync::atomic::Ordering::SeqCst), 1, "one connection for three requests");
        // Asking to close: not kept.
        let (_, again) =
            exchange(&mut s, Ask { addr, method: "POST", path: "/quit", limits, started: Instant::now(), keep: false })
                .expect("answer");
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
            let (r, again) = exchange_async(
                &mut s,
                Ask { addr, method: "GET", path: "/ready", limits, started: Instant::now(), keep: true },
                Written::default(),
            )
            .await
            .expect("answer");
            assert_eq!((r.status, r.body.as_str()), (200, "OK"));
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
            exchange_async(
                &mut s,
                Ask { addr: hung, method: "GET", path: "/ready", limits: short, started: Instant::now(), keep: true },
                Written::default(),
            ),
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
        assert_eq!(ok.map(|r| (r.status, r.body)), Ok((200, "OK".to_string())));
        let capped = parse_response(b"HTTP/1.1 200 OK\r\n\r\nabcdef", Limits { max_response_bytes: 21, ..limits });
        assert_eq!(capped.map(|r| r.body), Ok("ab".into()));
        assert!(matches!(parse_response(b"HTTP/1.1 999 Nope\r\n", limits), Err(Failure::Malformed(_))));
        assert!(matches!(parse_response(b"HTTP/1.1 200 OK", limits), Err(Failure::Malformed(_))));
        assert!(response_complete(b"HTTP/1.1 204 No Content\r\nContent-Length: 0\r\n\r\n"));
        assert!(!response_complete(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nab"));
    }

    // Envoy's admin answers chunked (`/ready` is `5\r\nLIVE\n\r\n0\r\n\r\n`): complete at its last
    // chunk, not at the deadline, and its connection kept.
    #[test]
    fn chunked_answers_end_at_their_last_chunk() {
        let envoy = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain; charset=UTF-8\r\nserver: envoy\r\n\
                      transfer-encoding: chunked\r\n\r\n5\r\nLIVE\n\r\n0\r\n\r\n";
        assert!(response_complete(envoy));
        assert!(reusable(envoy));
        assert_eq!(parse_response(envoy, Limits::default()).map(|r| r.body), Ok("LIVE\n".into()));
        for cut in 0..envoy.len() {
            assert!(!response_complete(&envoy[..cut]), "complete after {cut} of {} bytes", envoy.len());
        }
        let trailers = b"HTTP/1.1 503 Service Unavailable\r\nTransfer-Encoding: chunked\r\n\r\n\
                         4;ext=1\r\nPRE_\r\nA\r\nINITIALIZE\r\n0\r\nX-T: 1\r\n\r\n";
        assert!(response_complete(trailers));
        assert_eq!(parse_response(trailers, Limits::default()).map(|r| r.body), Ok("PRE_INITIALIZE".into()));
        // More than the answer: complete, but the connection is not kept.
        let mut extra = envoy.to_vec();
        extra.extend_from_slice(b"HTTP/1.1 200");
        assert!(response_complete(&extra) && !reusable(&extra));
        // A chunk size that is not hex, or data not ended by CRLF: read until the close.
        assert!(!response_complete(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nab\r\n0\r\n\r\n"));
        assert!(!response_complete(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nabc\r\n0\r\n\r\n"));
        assert!(!response_complete(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: gzip\r\n\r\nab"));
        let huge = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffff\r\nab";
        assert!(!response_complete(huge));
        assert_eq!(parse_response(huge, Limits::default()).map(|r| r.status), Ok(200));
    }

    // Over a real connection, as the probes read: the answer is in as soon as its last chunk is,
    // with the server keeping the connection open.
    #[test]
    fn a_chunked_answer_on_an_open_connection_is_read_without_waiting_for_the_deadline() {
        let (addr, release, server) =
            serve_and_hold(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nLIVE\n\r\n0\r\n\r\n");
        // A deadline no test machine reaches: answered from the framing, not at the deadline.
        let limits = Limits { total_timeout: HANG_GUARD, ..Limits::default() };
        let mut stream = connect(addr, limits).expect("connect");
        let (response, again) = exchange(
            &mut stream,
            Ask { addr, method: "GET", path: "/ready", limits, started: Instant::now(), keep: true },
        )
        .expect("answer");
        assert_eq!((response.status, response.body.as_str(), again), (200, "LIVE\n", true));
        let _ = release.send(());
        assert!(server.join().expect("server"), "the answer came only when the server let go");
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
