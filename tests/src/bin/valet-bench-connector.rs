//! A connection storm for the benchmarks, as a busy node's services make one: every TCP state
//! change runs the listen program. `valet-bench-connector <duration-ms> <workers> <count-file>`:
//! `workers` threads, each with a listener of its own on 127.0.0.1, connect to it, accept the
//! connection and close both ends, in a loop, for `duration-ms`; the number of connections is
//! written to `count-file` at the end. Accepting in the connecting thread keeps the accept queue
//! from filling (a full queue drops SYNs, and the kernel resends them a second later), and both
//! ends close with a reset (`SO_LINGER` 0), so no `TIME_WAIT` socket holds a port: the storm runs
//! at the machine's pace to its end.
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

fn reset_on_close(socket: &impl std::os::fd::AsRawFd) {
    let linger = libc::linger { l_onoff: 1, l_linger: 0 };
    // SAFETY: a valid socket and a linger struct of the size given.
    unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_LINGER,
            (&raw const linger).cast(),
            std::mem::size_of::<libc::linger>() as libc::socklen_t,
        );
    }
}

fn worker(until: Instant) -> u64 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("address");
    let mut n = 0u64;
    while Instant::now() < until {
        let Ok(client) = TcpStream::connect(addr) else {
            std::thread::sleep(Duration::from_millis(1));
            continue;
        };
        if let Ok((server, _)) = listener.accept() {
            reset_on_close(&server);
        }
        reset_on_close(&client);
        n += 1;
    }
    n
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (Some(ms), Some(workers), Some(out)) =
        (args.get(1).and_then(|a| a.parse::<u64>().ok()), args.get(2).and_then(|a| a.parse::<u32>().ok()), args.get(3))
    else {
        eprintln!("usage: valet-bench-connector <duration-ms> <workers> <count-file>");
        std::process::exit(2);
    };
    let until = Instant::now() + Duration::from_millis(ms);
    let workers: Vec<_> = (0..workers).map(|_| std::thread::spawn(move || worker(until))).collect();
    let total: u64 = workers.into_iter().map(|w| w.join().unwrap_or(0)).sum();
    std::fs::write(out, total.to_string()).expect("write the count");
}
