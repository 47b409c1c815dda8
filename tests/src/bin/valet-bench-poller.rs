//! The reference valet's hold is compared with: what Istio's `holdApplicationUntilProxyStarts`
//! does (a postStart hook running `pilot-agent wait`, which polls the readiness endpoint on
//! 127.0.0.1 every 500 ms until it answers 200), then the app is started.
//! `valet-bench-poller <port> <path> <period-ms> -- <app> [args...]`
use std::io::{Read as _, Write as _};
use std::net::TcpStream;
use std::os::unix::process::CommandExt as _;
use std::time::Duration;

fn ready(port: &str, path: &str) -> bool {
    let Ok(mut s) = TcpStream::connect(format!("127.0.0.1:{port}")) else { return false };
    let _ = s.set_read_timeout(Some(Duration::from_secs(1)));
    let req = format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
    if s.write_all(req.as_bytes()).is_err() {
        return false;
    }
    let mut buf = [0u8; 64];
    let n = s.read(&mut buf).unwrap_or(0);
    buf[..n].starts_with(b"HTTP/1.1 200") || buf[..n].starts_with(b"HTTP/1.0 200")
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let Some(sep) = args.iter().position(|a| a == "--") else {
        eprintln!("usage: valet-bench-poller <port> <path> <period-ms> -- <app> [args...]");
        std::process::exit(2);
    };
    let (Some(port), Some(path), Some(period), Some(app)) =
        (args.get(1), args.get(2), args.get(3).and_then(|p| p.parse::<u64>().ok()), args.get(sep + 1))
    else {
        std::process::exit(2);
    };
    while !ready(port, path) {
        std::thread::sleep(Duration::from_millis(period));
    }
    let e = std::process::Command::new(app).args(&args[sep + 2..]).exec();
    eprintln!("poller: {e}");
    std::process::exit(127);
}
