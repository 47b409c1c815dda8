use std::process::Command;
use std::time::Duration;

/// The summary: one row per figure, with its reference (measured in the same run) and target.
#[derive(Default)]
pub(crate) struct Table {
    pub(crate) rows: Vec<[String; 5]>,
    /// The in-pod wrapper's exit → quit median (µs), the reference of later quit figures.
    pub(crate) wrapper_median: Option<f64>,
}

impl Table {
    pub(crate) fn add(&mut self, figure: &str, valet: String, reference: &str, target: &str, result: String) {
        self.rows.push([figure.to_owned(), valet, reference.to_owned(), target.to_owned(), result]);
    }

    /// Prints the table in Markdown, ready for the README.
    pub(crate) fn print(&self, machine: &str, took: Duration, quick: bool) {
        println!("\n## valet bench{}: {machine}, {:.0} s", if quick { " --quick" } else { "" }, took.as_secs_f64());
        println!();
        println!("| figure | valet | reference (same run) | target | result |");
        println!("|---|---|---|---|---|");
        for [figure, valet, reference, target, result] in &self.rows {
            println!("| {figure} | {valet} | {reference} | {target} | {result} |");
        }
    }
}

pub(crate) fn met(ok: bool) -> &'static str {
    if ok { "met" } else { "NOT met" }
}

/// The date, CPU, core count and kernel this run is on.
pub(crate) fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|c| {
            c.lines()
                .find_map(|l| l.strip_prefix("model name").map(|v| v.trim_start_matches([' ', '\t', ':']).to_owned()))
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let date = Command::new("date")
        .args(["-u", "+%Y-%m-%d"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
        .unwrap_or_default();
    format!(
        "{date}, {} cores ({cpu}), kernel {}",
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
        kernel.trim()
    )
}

pub(crate) fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let idx = ((sorted.len() as f64 - 1.0) * p).round() as usize;
    sorted[idx.min(sorted.len() - 1)]
}

/// Median, p99 and maximum of microsecond samples.
#[derive(Clone, Copy)]
pub(crate) struct Stats {
    pub(crate) median: f64,
    p99: f64,
    pub(crate) max: f64,
    pub(crate) n: usize,
}

impl Stats {
    /// `median / p99` in milliseconds.
    pub(crate) fn ms(&self) -> String {
        format!("{:.2} / {:.2} ms", self.median / 1e3, self.p99 / 1e3)
    }

    pub(crate) fn us(&self) -> String {
        format!("{:.0} / {:.0} µs", self.median, self.p99)
    }
}

/// Prints median, p99, min and max of microsecond samples.
pub(crate) fn report(label: &str, mut us: Vec<f64>) -> Stats {
    us.sort_by(|a, b| a.total_cmp(b));
    let (median, p99) = (percentile(&us, 0.5), percentile(&us, 0.99));
    let max = us.last().copied().unwrap_or(f64::NAN);
    println!(
        "  {label:<46} n={:<5} median {:>9.1} µs   p99 {:>9.1} µs   min {:>8.1} µs   max {:>9.1} µs",
        us.len(),
        median,
        p99,
        us.first().copied().unwrap_or(f64::NAN),
        max
    );
    Stats { median, p99, max, n: us.len() }
}
