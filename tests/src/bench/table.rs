use std::path::Path;
use std::process::Command;

use anyhow::{Context as _, Result, bail};

/// The summary: one row per figure, with its reference (measured in the same run) and target.
#[derive(Default)]
pub(crate) struct Table {
    pub(crate) rows: Vec<[String; 5]>,
    /// The in-pod wrapper's exit → quit median (µs), the reference of later quit figures.
    pub(crate) wrapper_median: Option<f64>,
    /// Rows whose target was missed (their result says `NOT met`).
    pub(crate) missed: Vec<String>,
}

impl Table {
    /// A row; a result with `NOT met` in it counts as a missed target (see [`met`]).
    pub(crate) fn add(&mut self, figure: &str, valet: String, reference: &str, target: &str, result: String) {
        if result.contains("NOT met") {
            self.missed.push(figure.to_owned());
        }
        self.rows.push([figure.to_owned(), valet, reference.to_owned(), target.to_owned(), result]);
    }

    /// The table in Markdown, under a line naming the run: what `--table` writes and the docs
    /// include as it is.
    /// `took`: the run's wall time and the machine's steal over it, as words.
    pub(crate) fn markdown(&self, machine: &str, took: &str, quick: bool, only: Option<&str>) -> String {
        let mut out = format!(
            "`cargo xtask bench{}{}` on {machine}: {took}, {}.\n\n",
            if quick { " --quick" } else { "" },
            only.map(|o| format!(" --only {o}")).unwrap_or_default(),
            match self.missed.len() {
                0 => "every target met".to_owned(),
                n => format!("{n} target{} NOT met", if n == 1 { "" } else { "s" }),
            }
        );
        out.push_str("| figure | valet | reference (same run) | target | result |\n|---|---|---|---|---|\n");
        for [figure, valet, reference, target, result] in &self.rows {
            out.push_str(&format!("| {figure} | {valet} | {reference} | {target} | {result} |\n"));
        }
        out
    }
}

/// Writes the table to `path`, and into every Markdown file beside it that includes it: between
/// the lines `<!-- begin <file name> -->` and `<!-- end <file name> -->`, replaced as they are.
pub(crate) fn write_table(path: &Path, markdown: &str) -> Result<()> {
    std::fs::write(path, markdown).with_context(|| format!("write {}", path.display()))?;
    let name = path.file_name().context("--table names a file")?.to_string_lossy().into_owned();
    let (begin, end) = (format!("<!-- begin {name} -->"), format!("<!-- end {name} -->"));
    let dir = path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    for doc in std::fs::read_dir(dir)?.flatten().map(|e| e.path()) {
        if doc == path || doc.extension().is_none_or(|e| e != "md") {
            continue;
        }
        let text = std::fs::read_to_string(&doc)?;
        let (Some(b), Some(e)) = (text.find(&begin), text.find(&end)) else { continue };
        if e < b {
            bail!("{}: {end} before {begin}", doc.display());
        }
        let spliced = format!("{}{begin}\n{markdown}{}", &text[..b], &text[e..]);
        std::fs::write(&doc, spliced).with_context(|| format!("write {}", doc.display()))?;
        println!("  the table is in {} and {}", path.display(), doc.display());
    }
    Ok(())
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
    pub(crate) p99: f64,
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
