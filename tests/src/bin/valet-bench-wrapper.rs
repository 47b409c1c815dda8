//! The in-pod wrapper valet is compared with (how scuttle and envoy-preflight work): runs the
//! app as a child, waits for it, then POSTs the quit to the sidecar on 127.0.0.1, and exits
//! with the app's code. `valet-bench-wrapper <port> <path> -- <app> [args...]`
use std::io::{Read as _, Write as _};
use std::net::TcpStream;
use std::os::unix::process::ExitStatusExt as _;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let Some(sep) = args.iter().position(|a| a == "--") else {
        eprintln!("usage: valet-bench-wrapper <port> <path> -- <app> [args...]");
        std::process::exit(2);
    };
    let (Some(port), Some(path), Some(app)) = (args.get(1), args.get(2), args.get(sep + 1)) else {
        std::process::exit(2);
    };
    let status = match std::process::Command::new(app).args(&args[sep + 2..]).status() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("wrapper: {e}");
            std::process::exit(127);
        }
    };
    if let Ok(mut s) = TcpStream::connect(format!("127.0.0.1:{port}")) {
        let _ = s.set_nodelay(true);
        let req = format!("POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\nConnection: close\r\n\r\n");
        let _ = s.write_all(req.as_bytes());
        let mut buf = [0u8; 256];
        let _ = s.read(&mut buf);
    }
    std::process::exit(status.code().unwrap_or_else(|| 128 + status.signal().unwrap_or(0)));
}
