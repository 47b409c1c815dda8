//! A stand-in app for the demo and benchmarks: appends CLOCK_MONOTONIC (ns) to a file, then
//! exits with the given code. `valet-bench-app <stamp-file> <exit-code> [sleep-ms]`
//! (with a sleep, the stamp is taken after it, right before the exit).
//! `valet-bench-app <stamp-file> <exit-code> <sleep-ms> <linger-ms>`: stamps after the sleep, then
//! runs on for `linger-ms` before the exit (a released app that keeps working).
//! `... <linger-ms> cpu`: the stamp's line also carries the thread's CPU time (ns) read right
//! after the stamp: `<monotonic-ns> <cpu-ns>`.
fn clock_ns(clock: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: valid out-pointer.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (Some(file), Some(code)) = (args.get(1), args.get(2).and_then(|c| c.parse::<i32>().ok())) else {
        eprintln!("usage: valet-bench-app <stamp-file> <exit-code> [sleep-ms]");
        std::process::exit(2);
    };
    if let Some(ms) = args.get(3).and_then(|m| m.parse::<u64>().ok()) {
        std::thread::sleep(std::time::Duration::from_millis(ms));
    }
    let stamp = clock_ns(libc::CLOCK_MONOTONIC);
    let line = if args.get(5).is_some_and(|a| a == "cpu") {
        format!("{stamp} {}\n", clock_ns(libc::CLOCK_THREAD_CPUTIME_ID))
    } else {
        format!("{stamp}\n")
    };
    use std::io::Write as _;
    if let Ok(mut f) = std::fs::OpenOptions::new().create(true).append(true).open(file) {
        let _ = f.write_all(line.as_bytes());
    }
    if let Some(ms) = args.get(4).and_then(|m| m.parse::<u64>().ok()) {
        std::thread::sleep(std::time::Duration::from_millis(ms));
    }
    std::process::exit(code);
}
