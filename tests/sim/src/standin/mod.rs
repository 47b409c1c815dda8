//! Stand-in sidecar proxies: small HTTP servers with the readiness and quit endpoints of Istio's
//! pilot-agent/Envoy, plain Envoy, Linkerd's proxy, cloud-sql-proxy, Vault Agent,
//! consul-dataplane, the AlloyDB Auth Proxy and kuma-dp, including who may call quit (loopback
//! only), what answers look like and how each ends on a signal (each one's source: docs/sidecars.md). The binary `valet-standin-proxy` runs
//! [`run`]; [`crate::node::SimPod::spawn_standin`] starts it inside a sim pod's container.
//!
//! Connections are served as Go's net/http serves them: tasks on a small runtime (a worker thread
//! per CPU, woken by epoll), never a thread started for a connection (see [`run`]).

use std::fs::File;
use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, anyhow, bail};
use tokio::io::{AsyncBufRead, AsyncBufReadExt as _, AsyncReadExt as _, AsyncWriteExt as _};

use crate::node::{SimPod, SimProcess, SpawnOptions};
use crate::util::monotonic_ns;

mod options;

pub use options::{ProxyKind, StandinOptions, USAGE};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Role {
    IstioStatus,
    IstioHealth,
    IstioEnvoyAdmin,
    EnvoyAdmin,
    LinkerdAdmin,
    CloudSqlHealth,
    CloudSqlAdmin,
    VaultListener,
    ConsulLifecycle,
    KumaReadiness,
}

/// What to do with a request.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Action {
    Reply {
        code: u16,
        body: &'static str,
    },
    /// Reply, then exit with this code once the response is flushed.
    ReplyThenExit {
        code: u16,
        body: &'static str,
        exit: i32,
    },
    /// Reply, then exit with this code `after` this long (a shutdown with a grace period).
    ReplyThenExitAfter {
        code: u16,
        body: &'static str,
        exit: i32,
        after: Duration,
    },
}

struct State {
    opts: StandinOptions,
    started: Instant,
    events: Option<Mutex<File>>,
    /// `--listen-when-ready`: the port is bound (its listener is kept here).
    configured: Mutex<Option<TcpListener>>,
}

impl State {
    fn ready(&self) -> bool {
        self.opts.ready_after.is_none_or(|d| self.started.elapsed() >= d)
            && self.opts.ready_file.as_ref().is_none_or(|f| f.exists())
            && (self.opts.listen_when_ready.is_none()
                || self.configured.lock().unwrap_or_else(std::sync::PoisonError::into_inner).is_some())
    }

    /// `--listen-when-ready`: waits (inotify, no polling) for the ready file, then binds the port.
    fn listen_when_ready(&self, port: u16, file: &Path) -> Result<()> {
        use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};
        let dir = file.parent().context("the ready file has no directory")?;
        let inotify = Inotify::init(InitFlags::IN_CLOEXEC).context("inotify")?;
        inotify
            .add_watch(dir, AddWatchFlags::IN_CREATE | AddWatchFlags::IN_MOVED_TO)
            .with_context(|| format!("watch {}", dir.display()))?;
        while !file.exists() {
            inotify.read_events().context("inotify read")?;
        }
        let l = TcpListener::bind((Ipv4Addr::UNSPECIFIED, port)).with_context(|| format!("bind :{port}"))?;
        // The moment it is ready, read before it is (a lost CPU in between counts against
        // whoever waits for it, never for them), logged as `READY / 0.0.0.0:<port>`.
        let at = monotonic_ns();
        *self.configured.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(l);
        self.log_at(at, "READY", "/", SocketAddr::from((Ipv4Addr::UNSPECIFIED, port)), None);
        Ok(())
    }

    /// How long it takes to exit once asked to.
    fn drain(&self) -> Duration {
        self.opts.drain.unwrap_or_else(|| self.opts.default_drain())
    }

    fn quit(&self, code: u16, body: &'static str) -> Action {
        if self.opts.quit_ignored {
            Action::Reply { code, body }
        } else {
            Action::ReplyThenExit { code, body, exit: 0 }
        }
    }

    // table: one arm a (listener, path) of the real proxies, each answering as its proxy does
    fn decide(&self, role: Role, method: &str, path: &str, loopback: bool) -> Action {
        use Action::Reply;
        let ready = self.ready();
        match (role, path) {
            // pilot-agent: the source check comes before the method check.
            (Role::IstioStatus, "/quitquitquit") => {
                if !loopback {
                    Reply { code: 403, body: "Only requests from localhost are allowed\n" }
                } else if method != "POST" {
                    Reply { code: 405, body: "Method Not Allowed\n" }
                } else {
                    self.quit(200, "OK")
                }
            }
            (Role::IstioStatus | Role::IstioHealth, "/healthz/ready") => {
                if ready {
                    Reply { code: 200, body: "" }
                } else {
                    Reply { code: 503, body: "envoy not ready\n" }
                }
            }
            (Role::IstioEnvoyAdmin | Role::EnvoyAdmin, "/quitquitquit") => {
                if method != "POST" {
                    Reply { code: 405, body: "Method not allowed, POST required.\n" }
                } else if role == Role::IstioEnvoyAdmin {
                    // Envoy exits, pilot-agent restarts it: the pod's proxy keeps running.
                    Reply { code: 200, body: "OK\n" }
                } else {
                    self.quit(200, "OK\n")
                }
            }
            (Role::IstioEnvoyAdmin | Role::EnvoyAdmin, "/ready") => {
                if ready {
                    Reply { code: 200, body: "LIVE\n" }
                } else {
                    Reply { code: 503, body: "PRE_INITIALIZING\n" }
                }
            }
            (Role::IstioEnvoyAdmin | Role::EnvoyAdmin, _) => {
                Reply { code: 404, body: "invalid path. admin commands are:\n" }
            }
            (Role::LinkerdAdmin, "/ready") => {
                if ready {
                    Reply { code: 200, body: "ready\n" }
                } else {
                    Reply { code: 503, body: "not ready\n" }
                }
            }
            (Role::LinkerdAdmin, "/live") => Reply { code: 200, body: "live\n" },
            (Role::LinkerdAdmin, "/shutdown") if !self.opts.linkerd_shutdown_disabled => {
                // linkerd2-proxy: the method check comes before the source check.
                if method != "POST" {
                    Reply { code: 405, body: "" }
                } else if !loopback {
                    Reply { code: 403, body: "Requests are only permitted from localhost." }
                } else {
                    self.quit(200, "shutdown\n")
                }
            }
            (Role::LinkerdAdmin, _) => Reply { code: 404, body: "" },
            (Role::CloudSqlHealth, "/readiness" | "/startup") => {
                if ready {
                    Reply { code: 200, body: "ok" }
                } else {
                    Reply { code: 503, body: "error: proxy not ready" }
                }
            }
            (Role::CloudSqlHealth, "/liveness") => Reply { code: 200, body: "ok" },
            (Role::CloudSqlAdmin, "/quitquitquit") => {
                if method != "POST" && method != "GET" {
                    Reply { code: 400, body: "" }
                } else {
                    self.quit(200, "")
                }
            }
            // Vault's handleQuit: 404 when not enabled (a listener with a cache but no
            // agent_api), 405 for any method but POST, else 200 and the agent shuts down.
            (Role::VaultListener, "/agent/v1/quit") => {
                if self.opts.quit_disabled {
                    Reply { code: 404, body: "" }
                } else if method != "POST" {
                    Reply { code: 405, body: "" }
                } else {
                    self.quit(200, "")
                }
            }
            (Role::VaultListener, "/agent/v1/metrics") => Reply { code: 200, body: "" },
            // consul-dataplane's gracefulShutdownHandler takes any method, answers 200 at once
            // and quits Envoy once the grace period has passed.
            (Role::ConsulLifecycle, "/graceful_shutdown") => {
                if self.opts.quit_ignored {
                    Reply { code: 200, body: "" }
                } else {
                    Action::ReplyThenExitAfter { code: 200, body: "", exit: 0, after: self.drain() }
                }
            }
            (Role::ConsulLifecycle, "/graceful_startup") => Reply { code: 200, body: "" },
            (Role::KumaReadiness, "/ready") => {
                if ready {
                    Reply { code: 200, body: "READY" }
                } else {
                    Reply { code: 503, body: "NOT READY" }
                }
            }
            _ => Reply { code: 404, body: "404 page not found\n" },
        }
    }

    fn log(&self, method: &str, path: &str, peer: SocketAddr) {
        self.log_at(monotonic_ns(), method, path, peer, None);
    }

    /// `arrived_real_ns`: with `--stamp-arrivals`, the kernel's receive timestamp of the
    /// request's bytes (CLOCK_REALTIME), logged as CLOCK_MONOTONIC (`arrived=`).
    fn log_at(&self, mono_ns: u64, method: &str, path: &str, peer: SocketAddr, arrived_real_ns: Option<u64>) {
        self.log_answered(mono_ns, method, path, peer, arrived_real_ns, None);
    }

    /// [`State::log_at`], and with `replied_ns` the moment the answer had been written
    /// (CLOCK_MONOTONIC, `replied=`).
    fn log_answered(
        &self,
        mono_ns: u64,
        method: &str,
        path: &str,
        peer: SocketAddr,
        arrived_real_ns: Option<u64>,
        replied_ns: Option<u64>,
    ) {
        if let Some(f) = &self.events {
            let arrived = arrived_real_ns
                .map(|real| {
                    // The two clocks read back to back: the monotonic one on both sides.
                    let before = monotonic_ns();
                    let now_real = std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0, |d| d.as_nanos() as u64);
                    let now = before / 2 + monotonic_ns() / 2;
                    format!(" arrived={}", now.saturating_sub(now_real.saturating_sub(real)))
                })
                .unwrap_or_default();
            let replied = replied_ns.map(|ns| format!(" replied={ns}")).unwrap_or_default();
            let line = format!("{mono_ns} {method} {path} {peer}{arrived}{replied}\n");
            let mut f = f.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            // One write per line on an O_APPEND file: lines from threads never interleave.
            let _ = f.write_all(line.as_bytes());
        }
    }
}

fn reason(code: u16) -> &'static str {
    match code {
        200 => "OK",
        400 => "Bad Request",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        503 => "Service Unavailable",
        _ => "Unknown",
    }
}

/// Reads the request head: method, path without query, Content-Length, and whether the client
/// asked to close the connection after the answer. None if the peer sent nothing usable (or closed).
async fn read_head<R: AsyncBufRead + Unpin>(r: &mut R) -> Option<(String, String, usize, bool)> {
    let mut line = String::new();
    r.read_line(&mut line).await.ok()?;
    let mut parts = line.split_whitespace();
    let method = parts.next()?.to_string();
    let target = parts.next()?;
    let path = target.split('?').next().unwrap_or("/").to_string();
    let mut content_length = 0usize;
    let mut close = false;
    let mut total = line.len();
    loop {
        let mut h = String::new();
        if r.read_line(&mut h).await.ok()? == 0 {
            return None;
        }
        total += h.len();
        if total > 64 * 1024 {
            return None;
        }
        let t = h.trim_end();
        if t.is_empty() {
            break;
        }
        if let Some((k, v)) = t.split_once(':')
            && k.trim().eq_ignore_ascii_case("connection")
            && v.trim().eq_ignore_ascii_case("close")
        {
            close = true;
        }
        if let Some((k, v)) = t.split_once(':')
            && k.trim().eq_ignore_ascii_case("content-length")
        {
            content_length = v.trim().parse().unwrap_or(0);
        }
    }
    Some((method, path, content_length, close))
}

/// A connection's read half. With `--stamp-arrivals` it reads with `recvmsg` and keeps the
/// kernel's receive timestamp (SO_TIMESTAMPNS, CLOCK_REALTIME) of the bytes it read last.
struct StampedRead {
    half: tokio::net::tcp::OwnedReadHalf,
    stamped: bool,
    last_real_ns: Option<u64>,
}

impl tokio::io::AsyncRead for StampedRead {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        let this = self.get_mut();
        if !this.stamped {
            return std::pin::Pin::new(&mut this.half).poll_read(cx, buf);
        }
        loop {
            let stream: &tokio::net::TcpStream = this.half.as_ref();
            std::task::ready!(stream.poll_read_ready(cx))?;
            let unfilled = buf.initialize_unfilled();
            match stream.try_io(tokio::io::Interest::READABLE, || recv_stamped(stream, unfilled)) {
                Ok((n, at)) => {
                    if at.is_some() {
                        this.last_real_ns = at;
                    }
                    buf.advance(n);
                    return std::task::Poll::Ready(Ok(()));
                }
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                Err(e) => return std::task::Poll::Ready(Err(e)),
            }
        }
    }
}

/// `--stamp-arrivals`: the kernel stamps what reaches the connections `l` accepts (they inherit
/// SO_TIMESTAMPNS from it, so a request sent right after the connect is stamped too: the
/// kernel stamps nothing that arrived before any socket asked for it).
fn stamp_arrivals(l: &TcpListener) -> Result<()> {
    nix::sys::socket::setsockopt(l, nix::sys::socket::sockopt::ReceiveTimestampns, &true)
        .context("SO_TIMESTAMPNS on a listener")
}

/// One `recvmsg` into `buf`: the bytes read and their receive timestamp (CLOCK_REALTIME ns), if
/// the kernel gave one.
fn recv_stamped(stream: &tokio::net::TcpStream, buf: &mut [u8]) -> std::io::Result<(usize, Option<u64>)> {
    use nix::sys::socket::{ControlMessageOwned, MsgFlags, recvmsg};
    use std::os::fd::AsRawFd as _;
    let mut iov = [std::io::IoSliceMut::new(buf)];
    let mut space = nix::cmsg_space!(nix::sys::time::TimeSpec);
    let msg = recvmsg::<()>(stream.as_raw_fd(), &mut iov, Some(&mut space), MsgFlags::empty())
        .map_err(std::io::Error::from)?;
    let at = msg.cmsgs().ok().and_then(|mut c| {
        c.find_map(|m| match m {
            ControlMessageOwned::ScmTimestampns(t) => Some(t.tv_sec() as u64 * 1_000_000_000 + t.tv_nsec() as u64),
            _ => None,
        })
    });
    Ok((msg.bytes, at))
}

async fn handle(stream: tokio::net::TcpStream, role: Role, state: Arc<State>) {
    let peer = match stream.peer_addr() {
        Ok(p) => p,
        Err(_) => return,
    };
    // As Go's net/http, which pilot-agent's status server uses: TCP_NODELAY, HTTP/1.1
    // keep-alive, no read or idle timeout; the connection is closed when the client asks or
    // goes away.
    let _ = stream.set_nodelay(true);
    // A line per connection too (`ACCEPT /`), so tests can tell which requests shared one.
    state.log("ACCEPT", "/", peer);
    // Stamped from its listener ([`stamp_arrivals`]).
    let stamped = state.opts.stamp_arrivals;
    let (read_half, mut w) = stream.into_split();
    let mut reader = tokio::io::BufReader::new(StampedRead { half: read_half, stamped, last_real_ns: None });
    loop {
        let Some((method, path, content_length, close)) = read_head(&mut reader).await else {
            return;
        };
        let read_ns = monotonic_ns();
        let arrived = reader.get_ref().last_real_ns;
        // Stamped, a request's line is written once its answer is out, with the answer's moment:
        // the bench then tells the proxy's part of an answer (its read to its write) from the
        // asker's (the answer's way back). Otherwise, and where no answer comes, at the read.
        let log_answered = stamped && !state.opts.hang && !state.opts.flood;
        if !log_answered {
            state.log_at(read_ns, &method, &path, peer, arrived);
        }
        if state.opts.hang {
            // Hold the connection open and never answer (until the peer gives up).
            let mut sink = [0u8; 4096];
            while matches!(reader.read(&mut sink).await, Ok(n) if n > 0) {}
            return;
        }
        let _ = tokio::io::copy(&mut (&mut reader).take(content_length as u64), &mut tokio::io::sink()).await;
        if state.opts.flood {
            let _ = w.write_all(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\n").await;
            let chunk = vec![b'x'; 64 * 1024];
            while w.write_all(&chunk).await.is_ok() {}
            return;
        }
        let loopback = peer.ip().is_loopback()
            || matches!(peer.ip(), IpAddr::V6(v6) if v6.to_ipv4_mapped().is_some_and(|v4| v4.is_loopback()));
        let action = state.decide(role, &method, &path, loopback);
        let (code, body, exit, exit_later) = match action {
            Action::Reply { code, body } => (code, body, None, None),
            Action::ReplyThenExit { code, body, exit } => (code, body, Some(exit), None),
            Action::ReplyThenExitAfter { code, body, exit, after } => (code, body, None, Some((exit, after))),
        };
        let ct = if body.is_empty() { "" } else { "Content-Type: text/plain; charset=utf-8\r\n" };
        let conn = if close { "Connection: close\r\n" } else { "" };
        let resp =
            format!("HTTP/1.1 {code} {}\r\n{ct}Content-Length: {}\r\n{conn}\r\n{body}", reason(code), body.len());
        let _ = w.write_all(resp.as_bytes()).await;
        let _ = w.flush().await;
        if log_answered {
            state.log_answered(read_ns, &method, &path, peer, arrived, Some(monotonic_ns()));
        }
        if let Some((code, after)) = exit_later {
            // The answer is out; the process ends once its grace period has passed.
            std::thread::spawn(move || {
                std::thread::sleep(after);
                std::process::exit(code);
            });
        }
        if let Some(code) = exit {
            let _ = w.shutdown().await;
            std::process::exit(code);
        }
        if close {
            let _ = w.shutdown().await;
            return;
        }
    }
}

/// Serves until a quit request or a signal ends the process.
///
/// Connections are served as Go's net/http serves them (pilot-agent, cloud-sql-proxy): each one a
/// task on a runtime with a worker thread per CPU, woken by epoll; no thread is started for a
/// connection, so a fresh connection costs what it costs a Go proxy, not a thread's start.
pub fn run(opts: StandinOptions) -> Result<()> {
    use nix::sys::signal::{SigSet, Signal};
    // Block the stop signals before any thread exists so all inherit the mask and the main
    // thread can take them with sigwait (also works as pid 1 of a pid namespace, where
    // default-disposition signals would be ignored).
    let mut sigs = SigSet::empty();
    sigs.add(Signal::SIGTERM);
    sigs.add(Signal::SIGINT);
    sigs.thread_block().context("block SIGTERM/SIGINT")?;
    let events = match &opts.events {
        Some(p) => Some(Mutex::new(
            File::options().create(true).append(true).open(p).with_context(|| format!("open {}", p.display()))?,
        )),
        None => None,
    };
    let listeners = opts
        .listeners()
        .into_iter()
        .map(|(role, addr)| {
            let l = TcpListener::bind(addr).with_context(|| format!("bind {addr}"))?;
            l.set_nonblocking(true)?;
            if opts.stamp_arrivals {
                stamp_arrivals(&l)?;
            }
            Ok((role, l))
        })
        .collect::<Result<Vec<_>>>()?;
    let state = Arc::new(State { opts, started: Instant::now(), events, configured: Mutex::new(None) });
    if let (Some(port), Some(file)) = (state.opts.listen_when_ready, state.opts.ready_file.clone()) {
        let state = state.clone();
        std::thread::Builder::new().name("listen-when-ready".into()).spawn(move || {
            if let Err(e) = state.listen_when_ready(port, &file) {
                eprintln!("valet-standin-proxy: --listen-when-ready: {e:#}");
                std::process::exit(1);
            }
        })?;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_io().enable_time().build()?;
    for (role, l) in listeners {
        let state = state.clone();
        let l = {
            let _guard = runtime.enter();
            tokio::net::TcpListener::from_std(l)?
        };
        runtime.spawn(async move {
            loop {
                match l.accept().await {
                    Ok((conn, _)) => {
                        tokio::spawn(handle(conn, role, state.clone()));
                    }
                    Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
                }
            }
        });
    }
    let sig = sigs.wait().context("sigwait")?;
    let code = state.opts.sigterm_exit_code.unwrap_or_else(|| state.opts.default_exit_code(sig));
    if state.opts.kind == ProxyKind::Kuma {
        // kuma-dp: a second stop signal ends the drain at once.
        let drain = state.drain();
        std::thread::spawn(move || {
            std::thread::sleep(drain);
            std::process::exit(code);
        });
        let _ = sigs.wait();
        std::process::exit(code);
    }
    std::thread::sleep(state.drain());
    std::process::exit(code);
}

static BINARY: Mutex<Option<PathBuf>> = Mutex::new(None);

/// Tells this process where `valet-standin-proxy` is (integration tests of this crate pass
/// `env!("CARGO_BIN_EXE_valet-standin-proxy")`); thread-safe, unlike setting an env var.
pub fn set_binary_path(path: impl Into<PathBuf>) {
    *BINARY.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(path.into());
}

/// Path of the `valet-standin-proxy` binary: the one given to [`set_binary_path`], else
/// `$VALET_STANDIN_PROXY`, else next to the running test executable (`target/<profile>/`,
/// also when running from `target/<profile>/deps/`).
pub fn binary_path() -> Result<PathBuf> {
    if let Some(p) = BINARY.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone() {
        return Ok(p);
    }
    if let Some(p) = std::env::var_os("VALET_STANDIN_PROXY") {
        return Ok(PathBuf::from(p));
    }
    if let Some(p) = crate::util::next_to_exe("valet-standin-proxy") {
        return Ok(p);
    }
    bail!(
        "valet-standin-proxy not found: build it (`cargo build -p valet-sim --bin valet-standin-proxy`) or set VALET_STANDIN_PROXY"
    )
}

impl SimPod {
    /// Starts the stand-in proxy as `container`'s main process (pid 1 of its pid namespace
    /// unless `spawn.pid_namespace` is off), in the pod's cgroup and netns.
    pub fn spawn_standin(&self, container: &str, opts: &StandinOptions, spawn: &SpawnOptions) -> Result<SimProcess> {
        let bin = binary_path()?;
        let bin_s = bin.to_string_lossy().into_owned();
        let args = opts.to_args();
        let mut cmd: Vec<&str> = vec![bin_s.as_str()];
        cmd.extend(args.iter().map(String::as_str));
        self.spawn(container, &cmd, spawn)
    }

    /// Waits until the stand-in in this pod answers its readiness endpoint with 200 (probed
    /// on the pod IP from the host, like the kubelet; on 127.0.0.1 inside the netns for the
    /// loopback-only Envoy admin).
    pub fn wait_standin_ready(&self, opts: &StandinOptions, timeout: Duration) -> Result<()> {
        let (port, path) = opts.ready_endpoint();
        let loopback_only = (matches!(opts.kind, ProxyKind::Envoy) && opts.admin_addr.is_none_or(|a| a.is_loopback()))
            || matches!(opts.kind, ProxyKind::Vault | ProxyKind::Consul);
        if loopback_only || self.pod_ip().is_none() {
            let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
            return match self.netns_path() {
                Some(_) => self.in_netns(|| wait_http_ok(addr, path, timeout))?,
                None => wait_http_ok(addr, path, timeout),
            };
        }
        let ip = self.pod_ip().ok_or_else(|| anyhow!("no pod IP"))?;
        wait_http_ok(SocketAddr::from((ip, port)), path, timeout)
    }
}

/// Polls `GET path` until it answers 200.
pub fn wait_http_ok(addr: SocketAddr, path: &str, timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    let mut last = String::from("no attempt");
    while Instant::now() < deadline {
        match crate::client::get(addr, path, Duration::from_millis(500)) {
            Ok(r) if r.status == 200 => return Ok(()),
            Ok(r) => last = format!("HTTP {}", r.status),
            Err(e) => last = format!("{e:#}"),
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    bail!("{addr}{path} not ready after {timeout:?}: {last}")
}

/// One line of an `--events` file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestEvent {
    /// CLOCK_MONOTONIC ns when the request head had been read (compare with [`monotonic_ns`]).
    pub mono_ns: u64,
    pub method: String,
    pub path: String,
    pub peer: SocketAddr,
    /// With `--stamp-arrivals`: CLOCK_MONOTONIC ns when the request's bytes reached the socket
    /// (the kernel's receive timestamp).
    pub arrived_ns: Option<u64>,
    /// With `--stamp-arrivals`: CLOCK_MONOTONIC ns when its answer had been written (none for a
    /// request left unanswered).
    pub replied_ns: Option<u64>,
}

/// Reads an `--events` file (missing file = no events yet).
pub fn read_events(path: impl AsRef<Path>) -> Result<Vec<RequestEvent>> {
    let text = match std::fs::read_to_string(path.as_ref()) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).with_context(|| format!("read {}", path.as_ref().display())),
    };
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            if !(4..=6).contains(&f.len()) {
                bail!("bad event line {l:?}");
            }
            let (mut arrived_ns, mut replied_ns) = (None, None);
            for stamp in &f[4..] {
                let (slot, n) = match stamp.split_once('=') {
                    Some(("arrived", n)) if arrived_ns.is_none() => (&mut arrived_ns, n),
                    Some(("replied", n)) if replied_ns.is_none() => (&mut replied_ns, n),
                    _ => bail!("bad stamp {stamp:?} in {l:?}"),
                };
                *slot = Some(n.parse().with_context(|| format!("bad stamp {stamp:?} in {l:?}"))?);
            }
            Ok(RequestEvent {
                mono_ns: f[0].parse().with_context(|| format!("bad timestamp in {l:?}"))?,
                method: f[1].to_string(),
                path: f[2].to_string(),
                peer: f[3].parse().with_context(|| format!("bad peer in {l:?}"))?,
                arrived_ns,
                replied_ns,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(kind: ProxyKind) -> State {
        State { opts: StandinOptions::new(kind), started: Instant::now(), events: None, configured: Mutex::new(None) }
    }

    #[test]
    fn args_round_trip() {
        let mut o = StandinOptions::new(ProxyKind::CloudSql);
        o.ready_after = Some(Duration::from_millis(250));
        o.quit_ignored = true;
        o.admin_port = Some(19091);
        o.events = Some(PathBuf::from("/tmp/ev"));
        let p = StandinOptions::parse_args(o.to_args()).expect("parses");
        assert_eq!(p.kind, ProxyKind::CloudSql);
        assert_eq!(p.ready_after, Some(Duration::from_millis(250)));
        assert!(p.quit_ignored);
        assert_eq!(p.admin_port, Some(19091));
        assert_eq!(p.to_args(), o.to_args());
        assert!(StandinOptions::parse_args(["--bogus".to_string()]).is_err());
        let p = StandinOptions::parse_args(["--kind=linkerd".to_string()]).expect("parses");
        assert_eq!(p.kind, ProxyKind::Linkerd);
    }

    #[test]
    fn istio_quit_rules() {
        let s = state(ProxyKind::Istio);
        assert_eq!(
            s.decide(Role::IstioStatus, "POST", "/quitquitquit", false),
            Action::Reply { code: 403, body: "Only requests from localhost are allowed\n" }
        );
        assert_eq!(
            s.decide(Role::IstioStatus, "GET", "/quitquitquit", true),
            Action::Reply { code: 405, body: "Method Not Allowed\n" }
        );
        assert_eq!(
            s.decide(Role::IstioStatus, "POST", "/quitquitquit", true),
            Action::ReplyThenExit { code: 200, body: "OK", exit: 0 }
        );
        assert_eq!(
            s.decide(Role::IstioEnvoyAdmin, "POST", "/quitquitquit", true),
            Action::Reply { code: 200, body: "OK\n" }
        );
        assert_eq!(s.decide(Role::IstioHealth, "GET", "/healthz/ready", false), Action::Reply { code: 200, body: "" });
    }

    #[test]
    fn linkerd_and_cloudsql_rules() {
        let s = state(ProxyKind::Linkerd);
        assert_eq!(s.decide(Role::LinkerdAdmin, "GET", "/shutdown", true), Action::Reply { code: 405, body: "" });
        assert_eq!(
            s.decide(Role::LinkerdAdmin, "POST", "/shutdown", false).clone(),
            Action::Reply { code: 403, body: "Requests are only permitted from localhost." }
        );
        assert!(matches!(
            s.decide(Role::LinkerdAdmin, "POST", "/shutdown", true),
            Action::ReplyThenExit { code: 200, .. }
        ));
        let c = state(ProxyKind::CloudSql);
        assert!(matches!(c.decide(Role::CloudSqlAdmin, "POST", "/quitquitquit", true), Action::ReplyThenExit { .. }));
        assert_eq!(c.decide(Role::CloudSqlAdmin, "PUT", "/quitquitquit", true), Action::Reply { code: 400, body: "" });
    }

    /// Vault Agent's handleQuit, consul-dataplane's gracefulShutdownHandler, the AlloyDB Auth
    /// Proxy's quitquitquit, kuma-dp's readiness reporter: what each answers, and which ones
    /// have a listener at all when their opt-in is off.
    #[test]
    fn vault_consul_alloydb_and_kuma_rules() {
        let v = state(ProxyKind::Vault);
        assert_eq!(v.decide(Role::VaultListener, "GET", "/agent/v1/quit", true), Action::Reply { code: 405, body: "" });
        assert_eq!(
            v.decide(Role::VaultListener, "POST", "/agent/v1/quit", true),
            Action::ReplyThenExit { code: 200, body: "", exit: 0 }
        );
        let mut off = state(ProxyKind::Vault);
        off.opts.quit_disabled = true;
        assert_eq!(
            off.decide(Role::VaultListener, "POST", "/agent/v1/quit", true),
            Action::Reply { code: 404, body: "" }
        );
        assert!(off.opts.listeners().is_empty(), "no enable-quit, no cache: no listener");
        assert_eq!(v.opts.listeners()[0].1, SocketAddr::from((Ipv4Addr::LOCALHOST, 8200)));

        let mut c = state(ProxyKind::Consul);
        for method in ["POST", "GET", "PUT"] {
            assert_eq!(
                c.decide(Role::ConsulLifecycle, method, "/graceful_shutdown", true),
                Action::ReplyThenExitAfter { code: 200, body: "", exit: 0, after: Duration::ZERO },
                "{method}"
            );
        }
        c.opts.drain = Some(Duration::from_secs(30));
        assert!(matches!(
            c.decide(Role::ConsulLifecycle, "POST", "/graceful_shutdown", true),
            Action::ReplyThenExitAfter { after, .. } if after == Duration::from_secs(30)
        ));
        assert_eq!(c.decide(Role::EnvoyAdmin, "GET", "/ready", true), Action::Reply { code: 200, body: "LIVE\n" });
        let ports: Vec<u16> = c.opts.listeners().iter().map(|(_, a)| a.port()).collect();
        assert_eq!(ports, [20600, 19000]);

        let a = state(ProxyKind::AlloyDb);
        assert!(matches!(a.decide(Role::CloudSqlAdmin, "POST", "/quitquitquit", true), Action::ReplyThenExit { .. }));
        assert_eq!(a.opts.listeners().len(), 2);
        assert_eq!(a.opts.default_exit_code(nix::sys::signal::Signal::SIGTERM), 143);
        let mut no_flag = state(ProxyKind::AlloyDb);
        no_flag.opts.quit_disabled = true;
        let roles: Vec<Role> = no_flag.opts.listeners().iter().map(|(r, _)| *r).collect();
        assert_eq!(roles, [Role::CloudSqlHealth], "no --quitquitquit: no admin listener");

        let k = state(ProxyKind::Kuma);
        assert_eq!(k.decide(Role::KumaReadiness, "GET", "/ready", false), Action::Reply { code: 200, body: "READY" });
        assert_eq!(k.opts.default_exit_code(nix::sys::signal::Signal::SIGTERM), 0);
        assert_eq!(k.drain(), Duration::from_secs(30));
        for kind in ["vault", "consul", "alloydb", "kuma"] {
            assert_eq!(ProxyKind::parse(kind).expect(kind).as_str(), kind);
        }
    }

    #[test]
    fn readiness_gates() {
        let mut s = state(ProxyKind::Envoy);
        s.opts.ready_after = Some(Duration::from_secs(3600));
        assert_eq!(
            s.decide(Role::EnvoyAdmin, "GET", "/ready", true),
            Action::Reply { code: 503, body: "PRE_INITIALIZING\n" }
        );
        s.opts.ready_after = None;
        s.opts.ready_file = Some(PathBuf::from("/nonexistent/valet-ready"));
        assert!(!s.ready());
        s.opts.quit_ignored = true;
        assert_eq!(
            s.decide(Role::EnvoyAdmin, "POST", "/quitquitquit", true),
            Action::Reply { code: 200, body: "OK\n" }
        );
    }

    /// `--listen-when-ready`: not ready, and the port closed, until the ready file appears; then
    /// the port listens and the proxy is ready.
    #[test]
    fn listens_when_its_ready_file_appears_and_only_then_is_ready() {
        let dir = std::env::temp_dir().join(format!("valet-standin-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let file = dir.join("ready");
        let _ = std::fs::remove_file(&file);
        let port = TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("a free port").port();
        let mut s = state(ProxyKind::Istio);
        s.opts.ready_file = Some(file.clone());
        s.opts.listen_when_ready = Some(port);
        let events = dir.join("events");
        let _ = std::fs::remove_file(&events);
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&events).expect("events file");
        s.events = Some(Mutex::new(log));
        let s = Arc::new(s);
        let waiter = {
            let s = s.clone();
            let file = file.clone();
            std::thread::spawn(move || s.listen_when_ready(port, &file))
        };
        std::thread::sleep(Duration::from_millis(50));
        assert!(!s.ready(), "ready with no file");
        assert!(std::net::TcpStream::connect(("127.0.0.1", port)).is_err(), "listening with no file");
        // The file alone is not enough: ready once the port listens.
        let written = monotonic_ns();
        std::fs::write(&file, b"").expect("ready file");
        waiter.join().expect("the waiter").expect("bound");
        assert!(s.ready());
        // Its ready moment is logged: after the file, before the waiter was done.
        let ready = read_events(&events).expect("events");
        assert_eq!(ready.len(), 1, "{ready:?}");
        assert_eq!((ready[0].method.as_str(), ready[0].peer.port()), ("READY", port));
        assert!((written..=monotonic_ns()).contains(&ready[0].mono_ns), "{ready:?} not after the file at {written}");
        assert!(std::net::TcpStream::connect(("127.0.0.1", port)).is_ok(), "the port listens");
        let _ = std::fs::remove_dir_all(&dir);
        assert!(
            StandinOptions::parse_args(["--listen-when-ready".to_string(), "15006".into()]).is_err(),
            "--listen-when-ready needs --ready-file"
        );
    }

    /// `--stamp-arrivals`: a request read only a while after it was written is logged with its
    /// bytes' arrival, between the write and the read; without the flag, with none.
    #[test]
    fn a_requests_arrival_is_logged_apart_from_its_read() {
        use std::io::{Read as _, Write as _};
        let dir = std::env::temp_dir().join(format!("valet-standin-arrivals-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        for stamp in [true, false] {
            let events = dir.join(format!("events-{stamp}"));
            let _ = std::fs::remove_file(&events);
            let mut s = state(ProxyKind::Istio);
            s.opts.stamp_arrivals = stamp;
            s.events = Some(Mutex::new(
                std::fs::OpenOptions::new().create(true).append(true).open(&events).expect("events file"),
            ));
            let s = Arc::new(s);
            let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
            if stamp {
                stamp_arrivals(&listener).expect("SO_TIMESTAMPNS");
                until_stamped(&rt, &listener);
            }
            let mut client = std::net::TcpStream::connect(listener.local_addr().expect("addr")).expect("connect");
            let (conn, _) = listener.accept().expect("accept");
            // Written before the stand-in reads anything: its read comes later.
            let written = monotonic_ns();
            client.write_all(b"GET /healthz/ready HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").expect("write");
            let after_write = monotonic_ns();
            // Read well after the write: an arrival logged at the read would be this much late.
            std::thread::sleep(Duration::from_millis(100));
            rt.block_on(async {
                conn.set_nonblocking(true).expect("nonblocking");
                let conn = tokio::net::TcpStream::from_std(conn).expect("tokio stream");
                handle(conn, Role::IstioHealth, s.clone()).await;
            });
            let mut answer = String::new();
            client.read_to_string(&mut answer).expect("answer");
            assert!(answer.starts_with("HTTP/1.1 "), "{answer:?}");
            let got = read_events(&events).expect("events");
            let get = got.iter().find(|e| e.method == "GET").expect("the GET logged");
            match (stamp, get.arrived_ns) {
                (true, Some(arrived)) => {
                    // The two clocks are read back to back at the log: slack for a preemption
                    // between them, well short of the 100 ms before the read.
                    let slack = 20_000_000;
                    assert!(
                        arrived + slack >= written && arrived <= after_write + slack,
                        "arrived {arrived} not at the write ({written}..{after_write}), read at {}",
                        get.mono_ns
                    );
                }
                (false, None) => {}
                other => panic!("--stamp-arrivals {stamp}: arrival {:?}", other.1),
            }
            // The answer's moment: after the read, and logged only with the stamps.
            match (stamp, get.replied_ns) {
                (true, Some(replied)) => {
                    assert!(replied >= get.mono_ns, "replied {replied} before the read {}", get.mono_ns)
                }
                (false, None) => {}
                other => panic!("--stamp-arrivals {stamp}: answer {:?}", other.1),
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
        assert!(
            StandinOptions::parse_args(["--stamp-arrivals".to_string()]).is_err(),
            "--stamp-arrivals needs --events"
        );
    }

    /// Waits until what reaches `listener`'s connections is stamped: the kernel turns its receive
    /// timestamps on a moment after the first socket asks for them (a static key flipped from a
    /// work queue), and stamps nothing before; with no other stamping socket on the host, the
    /// test's request came first.
    fn until_stamped(rt: &tokio::runtime::Runtime, listener: &TcpListener) {
        use std::io::Write as _;
        let addr = listener.local_addr().expect("addr");
        for _ in 0..500 {
            let mut client = std::net::TcpStream::connect(addr).expect("connect");
            let (conn, _) = listener.accept().expect("accept");
            client.write_all(b"x").expect("write");
            let stamped = rt.block_on(async {
                conn.set_nonblocking(true).expect("nonblocking");
                let conn = tokio::net::TcpStream::from_std(conn).expect("tokio stream");
                conn.readable().await.expect("readable");
                recv_stamped(&conn, &mut [0u8; 8]).is_ok_and(|(_, at)| at.is_some())
            });
            if stamped {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        panic!("nothing reaching {addr} was stamped within 5 s of SO_TIMESTAMPNS");
    }

    /// A line with both stamps, in either order, is read; a stamp twice, unknown or not a
    /// number is not.
    #[test]
    fn an_event_lines_stamps_are_read_by_name() {
        let dir = std::env::temp_dir().join(format!("valet-standin-lines-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let lines = dir.join("lines");
        let line = |l: &str| {
            std::fs::write(&lines, format!("{l}\n")).expect("write");
            read_events(&lines)
        };
        let e = line("5 GET /x 127.0.0.1:9 replied=9 arrived=3").expect("read");
        assert_eq!((e[0].mono_ns, e[0].arrived_ns, e[0].replied_ns), (5, Some(3), Some(9)));
        let e = line("5 GET /x 127.0.0.1:9").expect("read");
        assert_eq!((e[0].arrived_ns, e[0].replied_ns), (None, None));
        for bad in [
            "5 GET /x 127.0.0.1:9 replied=9 replied=9",
            "5 GET /x 127.0.0.1:9 sent=9",
            "5 GET /x 127.0.0.1:9 arrived=x",
        ] {
            assert!(line(bad).is_err(), "{bad}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
