//! A process with several threads for the kernel tests.
//! `workers-first`: worker threads exit, then the process exits 5.
//! `leader-first`: the main thread exits alone (the exit(2) syscall) while a worker runs on, then the
//! worker ends the process with exit(6).
use std::time::Duration;

fn main() {
    match std::env::args().nth(1).as_deref() {
        Some("workers-first") => {
            let workers: Vec<_> =
                (0..4).map(|_| std::thread::spawn(|| std::thread::sleep(Duration::from_millis(20)))).collect();
            for w in workers {
                let _ = w.join();
            }
            std::thread::sleep(Duration::from_millis(100));
            std::process::exit(5);
        }
        Some("leader-first") => {
            std::thread::spawn(|| {
                std::thread::sleep(Duration::from_millis(150));
                // SAFETY: exit_group(6) straight away, no runtime teardown from a side thread.
                unsafe { libc::_exit(6) };
            });
            std::thread::sleep(Duration::from_millis(20));
            // SAFETY: the raw exit(2) syscall ends only the calling (main) thread, without the
            // forced unwinding of pthread_exit; the worker keeps the process alive.
            unsafe { libc::syscall(libc::SYS_exit, 0) };
        }
        _ => std::process::exit(2),
    }
}
