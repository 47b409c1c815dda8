//! A build Job's worst case for the benchmarks: forks short-lived processes as fast as it can.
//! `valet-bench-forker <duration-ms> <workers> <count-file>`: `workers` processes each fork a
//! child that `_exit(0)`s at once and reap it, in a loop, for `duration-ms`; the total number of
//! processes is written to `count-file` at the end. With a fourth argument, each child execs
//! that program (no arguments; `/bin/true`, as a build's shell steps do) instead of `_exit`.
use std::time::{Duration, Instant};

fn worker(until: Instant, exec: Option<&std::ffi::CStr>) -> u64 {
    let mut n = 0u64;
    let argv = exec.map(|p| [p.as_ptr(), std::ptr::null()]);
    let envp: [*const libc::c_char; 1] = [std::ptr::null()];
    while Instant::now() < until {
        // SAFETY: the child only execs (async-signal-safe, built before the fork) or _exits; the
        // parent reaps it.
        let pid = unsafe { libc::fork() };
        match pid {
            // SAFETY: in the child: execve with argv and envp built before the fork, null-terminated,
            // and alive until the exec; _exit otherwise.
            0 => unsafe {
                if let Some(argv) = &argv {
                    libc::execve(argv[0], argv.as_ptr(), envp.as_ptr());
                }
                libc::_exit(0)
            },
            p if p > 0 => {
                let mut status = 0;
                // SAFETY: our own child.
                unsafe { libc::waitpid(p, &mut status, 0) };
                n += 1;
            }
            _ => std::thread::sleep(Duration::from_millis(1)),
        }
    }
    n
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (Some(ms), Some(workers), Some(out)) =
        (args.get(1).and_then(|a| a.parse::<u64>().ok()), args.get(2).and_then(|a| a.parse::<u32>().ok()), args.get(3))
    else {
        eprintln!("usage: valet-bench-forker <duration-ms> <workers> <count-file> [exec-program]");
        std::process::exit(2);
    };
    let exec = match args.get(4).map(|p| std::ffi::CString::new(p.as_str())) {
        Some(Ok(p)) => Some(p),
        Some(Err(_)) => {
            eprintln!("exec program with a NUL byte");
            std::process::exit(2);
        }
        None => None,
    };
    let exec = exec.as_deref();
    let until = Instant::now() + Duration::from_millis(ms);
    let mut pipes = Vec::new();
    for _ in 1..workers.max(1) {
        let mut fds = [0; 2];
        // SAFETY: valid out-array.
        if unsafe { libc::pipe(fds.as_mut_ptr()) } != 0 {
            eprintln!("pipe failed");
            std::process::exit(1);
        }
        // SAFETY: the child runs the loop, writes its count and exits.
        match unsafe { libc::fork() } {
            0 => {
                let n = worker(until, exec).to_le_bytes();
                // SAFETY: a valid buffer on an fd we own.
                unsafe {
                    libc::write(fds[1], n.as_ptr().cast(), n.len());
                    libc::_exit(0);
                }
            }
            p if p > 0 => {
                // SAFETY: closing our copy of the write end.
                unsafe { libc::close(fds[1]) };
                pipes.push((p, fds[0]));
            }
            _ => {
                eprintln!("fork failed");
                std::process::exit(1);
            }
        }
    }
    let mut total = worker(until, exec);
    for (pid, fd) in pipes {
        let mut buf = [0u8; 8];
        // SAFETY: a valid buffer on an fd we own; then our own child is reaped.
        unsafe {
            if libc::read(fd, buf.as_mut_ptr().cast(), 8) == 8 {
                total += u64::from_le_bytes(buf);
            }
            let mut status = 0;
            libc::waitpid(pid, &mut status, 0);
        }
    }
    if let Err(e) = std::fs::write(out, format!("{total}\n")) {
        eprintln!("write {out}: {e}");
        std::process::exit(1);
    }
}
