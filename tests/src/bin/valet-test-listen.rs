//! A process that listens on a TCP port, for the kernel tests of the listen program: binds port 0
//! (on loopback, or on every address where loopback is down, as in a kernel guest), listens,
//! prints the port and waits for its stdin to close.
use std::io::{Read as _, Write as _};
use std::net::TcpListener;

fn main() {
    let listener = TcpListener::bind("127.0.0.1:0").or_else(|_| TcpListener::bind("0.0.0.0:0")).expect("bind");
    let port = listener.local_addr().expect("local address").port();
    let mut out = std::io::stdout();
    writeln!(out, "{port}").expect("print the port");
    out.flush().expect("flush");
    let _ = std::io::stdin().read_to_end(&mut Vec::new());
}
