//! `cargo xtask fuzz [target] [--seconds N]`: the cargo-fuzz targets in `fuzz/` (libFuzzer),
//! one per parser of outside input, each for a bounded time from its seed corpus in
//! `fuzz/corpus/<target>/`. `cargo xtask test` runs all of them through [`command`].
//!
//! Build: stable rustc with `RUSTC_BOOTSTRAP=1` (cargo-fuzz passes `-Z` flags), no sanitizer
//! (the parsers are safe Rust: what can go wrong is a panic, an overflow or a hang, and
//! debug assertions with overflow checks catch the first two, libFuzzer's `-timeout` the
//! third), unoptimised (`--dev`: the build is most of the time this task takes on CI). New inputs the fuzzer finds go to a
//! temporary directory, not into the repository's corpus; a crash is written to
//! `fuzz/artifacts/<target>/` and fails the run. Add the crashing input as a unit test next
//! to the parser with the fix (see `git log fuzz/`).
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Instant;

use anyhow::{Context as _, Result, bail};

/// Every fuzz target (`fuzz/fuzz_targets/<name>.rs`).
pub(crate) const TARGETS: [&str; 7] =
    ["btf", "tracepoint_format", "http_response", "cgroup_path", "pod_annotations", "oci_config", "mountinfo"];
/// Seconds per target when none is given: 7 targets take about a minute and a half, after a build of
/// about four minutes on a 2-core machine.
pub(crate) const DEFAULT_SECONDS: u64 = 10;
const CARGO_FUZZ_VERSION: &str = "0.13.2";
/// The build flags, identical for `build` and `run` so that `run` does not rebuild.
const BUILD_FLAGS: [&str; 4] = ["--dev", "--sanitizer", "none", "--debug-assertions"];

/// `cargo xtask fuzz` as a command (what `cargo xtask test` runs and counts).
pub(crate) fn command() -> Result<Command> {
    let mut cmd = Command::new(std::env::current_exe().context("own executable")?);
    cmd.arg("fuzz");
    Ok(cmd)
}

fn cargo() -> Command {
    let mut cmd = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    // cargo-fuzz's `-Z` flags on the stable compiler.
    cmd.env("RUSTC_BOOTSTRAP", "1");
    cmd
}

fn ensure_cargo_fuzz() -> Result<()> {
    let installed = cargo()
        .args(["fuzz", "--version"])
        .output()
        .map(|o| o.status.success() && String::from_utf8_lossy(&o.stdout).contains(CARGO_FUZZ_VERSION))
        .unwrap_or(false);
    if installed {
        return Ok(());
    }
    println!("xtask fuzz: cargo install cargo-fuzz {CARGO_FUZZ_VERSION}");
    let status = cargo()
        .args(["install", "--locked", "cargo-fuzz", "--version", CARGO_FUZZ_VERSION])
        .status()
        .context("cargo install cargo-fuzz")?;
    if !status.success() {
        bail!("cargo install cargo-fuzz failed: {status}");
    }
    Ok(())
}

/// What libFuzzer reported for one target.
struct Outcome {
    passed: bool,
    execs: Option<u64>,
    detail: String,
}

/// `stat::number_of_executed_units: N` from `-print_final_stats=1`.
fn executed_units(log: &str) -> Option<u64> {
    log.lines().find_map(|l| l.strip_prefix("stat::number_of_executed_units:")).and_then(|n| n.trim().parse().ok())
}

fn run_target(fuzz_dir: &Path, target: &str, seconds: u64) -> Result<Outcome> {
    let seeds = fuzz_dir.join("corpus").join(target);
    if !seeds.is_dir() {
        bail!("no seed corpus at {}", seeds.display());
    }
    // libFuzzer adds what it finds to the first corpus directory: a scratch one.
    let scratch = std::env::temp_dir().join(format!("valet-fuzz-{target}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&scratch);
    std::fs::create_dir_all(&scratch)?;
    let out = cargo()
        .current_dir(fuzz_dir)
        .args(["fuzz", "run"])
        .args(BUILD_FLAGS)
        .arg(target)
        .arg(&scratch)
        .arg(&seeds)
        .arg("--")
        .arg(format!("-max_total_time={seconds}"))
        .args(["-print_final_stats=1", "-timeout=10", "-rss_limit_mb=2048", "-max_len=65536"])
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("cargo fuzz run {target}"))?;
    let _ = std::fs::remove_dir_all(&scratch);
    let log = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let logs = fuzz_dir.join("target/xtask-logs");
    std::fs::create_dir_all(&logs)?;
    std::fs::write(logs.join(format!("{target}.log")), &log)?;
    let detail = if out.status.success() {
        String::new()
    } else {
        // The crash report: the panic, libFuzzer's summary and where the input was written.
        let tail: Vec<&str> = log.lines().rev().take(40).collect();
        tail.into_iter().rev().collect::<Vec<_>>().join("\n")
    };
    Ok(Outcome { passed: out.status.success(), execs: executed_units(&log), detail })
}

/// Builds the targets and runs `target` (all when `None`) for `seconds` each. Prints a line
/// per target and a summary that `cargo xtask test`'s tally counts; fails if any target
/// crashed or could not run.
pub(crate) fn run(root: &Path, target: Option<&str>, seconds: u64) -> Result<()> {
    let targets: Vec<&str> = match target {
        Some(t) if TARGETS.contains(&t) => vec![t],
        Some(t) => bail!("unknown fuzz target {t:?}; targets: {}", TARGETS.join(", ")),
        None => TARGETS.to_vec(),
    };
    ensure_cargo_fuzz()?;
    let fuzz_dir = root.join("fuzz");
    let started = Instant::now();
    let mut build = cargo();
    build.current_dir(&fuzz_dir).args(["fuzz", "build"]).args(BUILD_FLAGS);
    if let [one] = targets.as_slice() {
        build.arg(one);
    }
    let status = build.status().context("cargo fuzz build")?;
    if !status.success() {
        bail!("cargo fuzz build failed: {status}");
    }
    println!("xtask fuzz: built in {:.0}s", started.elapsed().as_secs_f64());
    let (mut passed, mut failed) = (0u64, 0u64);
    for t in &targets {
        let outcome = run_target(&fuzz_dir, t, seconds)?;
        let execs = outcome.execs.map_or_else(|| "? executions".to_owned(), |n| format!("{n} executions"));
        if outcome.passed {
            passed += 1;
            println!("fuzz {t} ... ok ({execs} in {seconds}s)");
        } else {
            failed += 1;
            println!("fuzz {t} ... FAILED ({execs})\n{}", outcome.detail);
        }
    }
    println!("fuzz: {passed} passed, {failed} failed in {:.0}s", started.elapsed().as_secs_f64());
    if failed > 0 {
        bail!("{failed} fuzz target(s) crashed: inputs in fuzz/artifacts/, logs in fuzz/target/xtask-logs/");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_libfuzzers_final_stats() {
        let log = "#1024\tpulse  cov: 10\nDone 5313 runs in 2 second(s)\nstat::number_of_executed_units: 5313\n\
                   stat::average_exec_per_sec:     2656\n";
        assert_eq!(executed_units(log), Some(5313));
        assert_eq!(executed_units("==1== ERROR: libFuzzer: deadly signal"), None);
    }

    #[test]
    fn every_target_has_a_source_and_a_seed_corpus() {
        let fuzz = Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz");
        let manifest = std::fs::read_to_string(fuzz.join("Cargo.toml")).expect("fuzz/Cargo.toml");
        for t in TARGETS {
            assert!(fuzz.join(format!("fuzz_targets/{t}.rs")).is_file(), "{t}");
            assert!(manifest.contains(&format!("name = \"{t}\"")), "{t} in fuzz/Cargo.toml");
            let seeds = std::fs::read_dir(fuzz.join("corpus").join(t)).map(|d| d.count()).unwrap_or(0);
            assert!(seeds > 0, "{t} has no seed corpus");
        }
    }
}
