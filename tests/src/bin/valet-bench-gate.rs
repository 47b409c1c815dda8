//! A proxy that starts late, for the benchmarks: waits until a file exists, then execs the
//! proxy's command, so the proxy's ports stay closed until that moment and it listens and turns
//! ready at once (as a sidecar does that is slow to start). `valet-bench-gate <file> -- <cmd> [args...]`
//! The wait is a stat every millisecond in this one process (no child processes in the pod).
use std::os::unix::process::CommandExt as _;
use std::time::Duration;

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let (Some(file), Some(sep)) = (args.get(1), args.iter().position(|a| a == "--")) else {
        eprintln!("usage: valet-bench-gate <file> -- <cmd> [args...]");
        std::process::exit(2);
    };
    let Some(cmd) = args.get(sep + 1) else {
        eprintln!("valet-bench-gate: no command after --");
        std::process::exit(2);
    };
    while !std::path::Path::new(file).exists() {
        std::thread::sleep(Duration::from_millis(1));
    }
    let e = std::process::Command::new(cmd).args(&args[sep + 2..]).exec();
    eprintln!("valet-bench-gate: exec {cmd}: {e}");
    std::process::exit(127);
}
