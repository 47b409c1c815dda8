//! The stand-in proxy's behaviour switches, run directly on the host loopback (no root needed).

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use valet_sim::client;
use valet_sim::standin::read_events;

/// Only a guard against a hang: the waits are for events.
const T: Duration = Duration::from_secs(30);

fn free_port() -> u16 {
    valet_test_support::free_port().expect("a free port")
}

struct Proxy {
    child: Child,
}

impl Drop for Proxy {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(args: &[&str], port: u16) -> Proxy {
    let child = Command::new(env!("CARGO_BIN_EXE_valet-standin-proxy"))
        .args(args)
        .stdin(Stdio::null())
        .spawn()
        .expect("spawn stand-in");
    let deadline = Instant::now() + T;
    while TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "stand-in did not listen on {port}");
        std::thread::sleep(Duration::from_millis(5));
    }
    Proxy { child }
}

fn lo(port: u16) -> SocketAddr {
    SocketAddr::from((Ipv4Addr::LOCALHOST, port))
}

#[test]
fn hang_never_answers_but_logs() {
    let port = free_port();
    let dir = std::env::temp_dir().join(format!("valet-standin-{}", valet_sim::util::random_hex(4)));
    std::fs::create_dir_all(&dir).expect("dir");
    let events = dir.join("ev");
    let p = port.to_string();
    let ev = events.display().to_string();
    let _proxy = start(&["--kind", "envoy", "--admin-port", &p, "--hang", "--events", &ev], port);
    let before = valet_sim::util::monotonic_ns();
    let err = client::post(lo(port), "/quitquitquit", Duration::from_millis(300)).expect_err("no answer");
    let kind = err.downcast_ref::<std::io::Error>().map(std::io::Error::kind);
    assert!(matches!(kind, Some(std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut)), "{err:#}");
    let all = read_events(&events).expect("events");
    // Each connection is logged as it is accepted (`ACCEPT /`), the readiness check's too.
    let evs: Vec<_> = all.iter().filter(|e| e.method != "ACCEPT").cloned().collect();
    assert!(all.iter().any(|e| e.method == "ACCEPT" && Some(e.peer) == evs.first().map(|q| q.peer)), "{all:?}");
    assert_eq!(evs.len(), 1);
    assert_eq!((evs[0].method.as_str(), evs[0].path.as_str()), ("POST", "/quitquitquit"));
    assert!(evs[0].mono_ns >= before);
    assert!(evs[0].peer.ip().is_loopback());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn flood_sends_an_endless_body() {
    let port = free_port();
    let p = port.to_string();
    let _proxy = start(
        &[
            "--kind",
            "istio",
            "--status-port",
            &p,
            "--health-port",
            &free_port().to_string(),
            "--admin-port",
            &free_port().to_string(),
            "--flood",
        ],
        port,
    );
    let mut s = TcpStream::connect(lo(port)).expect("connect");
    s.set_read_timeout(Some(T)).expect("timeout");
    s.write_all(b"POST /quitquitquit HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n").expect("write");
    let mut total = 0usize;
    let mut buf = vec![0u8; 65536];
    while total < 4 << 20 {
        let n = s.read(&mut buf).expect("read");
        assert!(n > 0, "the flood must not end");
        total += n;
    }
}

#[test]
fn quit_ignored_answers_and_keeps_running() {
    let health = free_port();
    let admin = free_port();
    let mut proxy = start(
        &[
            "--kind",
            "cloudsql",
            "--health-port",
            &health.to_string(),
            "--admin-port",
            &admin.to_string(),
            "--quit-ignored",
        ],
        admin,
    );
    let r = client::post(lo(admin), "/quitquitquit", T).expect("quit");
    assert_eq!(r.status, 200);
    std::thread::sleep(Duration::from_millis(200));
    assert!(proxy.child.try_wait().expect("wait").is_none());
    assert_eq!(client::get(lo(health), "/liveness", T).expect("live").status, 200);
}

#[test]
fn ready_file_and_ready_after() {
    let admin = free_port();
    let dir = std::env::temp_dir().join(format!("valet-standin-{}", valet_sim::util::random_hex(4)));
    std::fs::create_dir_all(&dir).expect("dir");
    let flag = dir.join("ready");
    let _proxy = start(
        &["--kind", "linkerd", "--admin-port", &admin.to_string(), "--ready-file", &flag.display().to_string()],
        admin,
    );
    let ready = || client::get(lo(admin), "/ready", T).expect("ready").status;
    assert_eq!(ready(), 503);
    std::fs::write(&flag, b"").expect("touch");
    assert_eq!(ready(), 200);
    std::fs::remove_file(&flag).expect("rm");
    assert_eq!(ready(), 503);
    let _ = std::fs::remove_dir_all(&dir);

    let admin = free_port();
    let started = Instant::now();
    let _proxy = start(&["--kind", "envoy", "--admin-port", &admin.to_string(), "--ready-after-ms", "400"], admin);
    let first = client::get(lo(admin), "/ready", T).expect("ready");
    if started.elapsed() < Duration::from_millis(350) {
        assert_eq!((first.status, first.text().as_str()), (503, "PRE_INITIALIZING\n"));
    }
    valet_sim::standin::wait_http_ok(lo(admin), "/ready", T).expect("ready later");
    assert!(started.elapsed() >= Duration::from_millis(400));
    assert_eq!(client::get(lo(admin), "/ready", T).expect("ready").text(), "LIVE\n");
}

#[test]
fn istio_sigterm_drains_then_exits_zero() {
    let status = free_port();
    let mut proxy = start(
        &[
            "--kind",
            "istio",
            "--status-port",
            &status.to_string(),
            "--health-port",
            &free_port().to_string(),
            "--admin-port",
            &free_port().to_string(),
            "--drain-ms",
            "150",
        ],
        status,
    );
    let t0 = Instant::now();
    // SAFETY: plain syscall on our own child.
    unsafe { libc::kill(proxy.child.id() as i32, libc::SIGTERM) };
    let st = proxy.child.wait().expect("wait");
    assert_eq!(st.code(), Some(0));
    assert!(t0.elapsed() >= Duration::from_millis(150));
}

#[test]
fn istio_quit_during_the_drain_exits_zero_at_once() {
    // pilot-agent keeps its status server up while it drains: a quit then ends the drain. The
    // drain (60 s) is longer than the wait: only the quit can end the process in time.
    let status = free_port();
    let mut proxy = start(
        &[
            "--kind",
            "istio",
            "--status-port",
            &status.to_string(),
            "--health-port",
            &free_port().to_string(),
            "--admin-port",
            &free_port().to_string(),
            "--drain-ms",
            "60000",
        ],
        status,
    );
    // SAFETY: plain syscall on our own child.
    unsafe { libc::kill(proxy.child.id() as i32, libc::SIGTERM) };
    assert!(proxy.child.try_wait().expect("poll").is_none(), "draining");
    let r = client::post(lo(status), "/quitquitquit", T).expect("quit");
    assert_eq!(r.status, 200);
    let deadline = Instant::now() + Duration::from_secs(30);
    let code = loop {
        if let Some(st) = proxy.child.try_wait().expect("poll") {
            break st.code();
        }
        assert!(Instant::now() < deadline, "still draining 30 s after the quit");
        std::thread::sleep(Duration::from_millis(5));
    };
    assert_eq!(code, Some(0));
}

#[test]
fn usage_errors() {
    let out = Command::new(env!("CARGO_BIN_EXE_valet-standin-proxy")).args(["--kind", "nginx"]).output().expect("run");
    assert_eq!(out.status.code(), Some(2));
    let out = Command::new(env!("CARGO_BIN_EXE_valet-standin-proxy")).arg("--help").output().expect("run");
    assert!(String::from_utf8_lossy(&out.stdout).contains("--quit-ignored"));
}
