//! valet's developer tasks, one module per task.
//!
//! * `cargo xtask setup`  installs what building and testing need (idempotent, quiet when done).
//! * `cargo xtask lint`   checks formatting and runs clippy on every crate, the kernel one included.
//! * `cargo xtask test`   runs every test: unit, privileged integration (as root), manifests.
//! * `cargo xtask demo`   runs the agent against a simulated node on this host.
//! * `cargo xtask bench`  prints the performance figures.
//! * `cargo xtask chaos`  stops the agent every way, at random moments, 200 times, and counts what it left.
//! * `cargo xtask fuzz`   runs the fuzz targets for a bounded time (also part of `test`).
//! * `cargo xtask image`  builds the agent's OCI image (no Docker, no registry).
//! * `cargo xtask kernels`, `cargo xtask node`: the qemu suites (Debian kernels, a real node).
#![forbid(unsafe_code)]

mod arch;
mod beside;
mod chaos;
mod cmd;
mod compat;
mod fuzz;
mod image;
mod imports;
mod kernels;
mod lint;
mod node;
mod node_images;
mod node_lag;
mod setup;
mod sim;
mod size;
mod test;
mod vm;

use anyhow::Result;
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(about = "valet developer tasks")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Install missing build and test prerequisites (rust-src, bpf-linker, tracefs, test tools).
    Setup,
    /// Check formatting and run clippy (host crates, and the kernel crate for the BPF target).
    Lint,
    /// Run the whole test suite (needs root: privileged tests are never skipped).
    Test {
        /// Only run tests whose name contains this filter (Rust tests only).
        filter: Option<String>,
        /// Skip the qemu suites (Debian's 5.10, 6.1 and 6.12 kernels, arm64's 6.12, and CI's two
        /// node cells),
        /// which run by default; for quick local runs only, CI runs them.
        #[arg(long)]
        no_vm: bool,
        /// Boot only this kernel (a suite or a version: `6.1`; arm64's as `arm64/6.1`); repeatable.
        #[arg(long = "kernel", value_name = "K")]
        kernels: Vec<String>,
        /// Run N busy loops beside the tests, from the build's end to the run's end, to show no
        /// test depends on the machine's pace (`--cpu-hog 2` on a 2-core machine).
        #[arg(long, value_name = "N", default_value_t = 0)]
        cpu_hog: usize,
    },
    /// Run the kernel tests and one end-to-end scenario on Debian's 5.10, 6.1 and 6.12 kernels in
    /// qemu (amd64, and arm64's 6.12 under qemu-system-aarch64).
    Kernels {
        /// Only these kernels: suites (bullseye, bookworm, trixie) or versions (5.10, 6.1, 6.12),
        /// amd64's; arm64's as `arm64/<suite or version>`; `amd64` or `arm64` for all three.
        only: Vec<String>,
    },
    /// Build the agent's OCI image (an image layout under target/oci) from the release binary.
    Image,
    /// Run valet on a real node: a Debian VM with containerd driven through the CRI.
    Node {
        /// Every cell of the runtime matrix: Debian suite (containerd 1.6, 1.7, 2.1) × OCI
        /// runtime (runc, crun) × containerd layout (kubeadm, k3s), one VM after the other.
        #[arg(long)]
        matrix: bool,
        /// Only this cell, `suite/runtime/layout` (e.g. `sid/crun/k3s`); repeatable. Default:
        /// bookworm/runc/kubeadm.
        #[arg(long = "cell")]
        cells: Vec<String>,
        /// Only these scenarios (tests/node/scenarios.py), e.g. `job hold_app`.
        only: Vec<String>,
        /// Instead of the scenarios: measure when the runtime records a container's exit against
        /// the kernel's moment (tests/node/runtime_lag.py), this many runs per way of quitting a
        /// native sidecar, in each cell named.
        #[arg(long, value_name = "RUNS", conflicts_with = "only")]
        lag: Option<u32>,
    },
    /// Run the agent against a simulated node on this host and print a timeline.
    Demo {
        /// Extra arguments for the demo driver.
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Run the fuzz targets (fuzz/), each for a bounded time.
    Fuzz {
        /// Only this target (default: all).
        target: Option<String>,
        #[arg(long, default_value_t = fuzz::DEFAULT_SECONDS)]
        seconds: u64,
    },
    /// Print the performance figures, each beside its reference and target, as one table.
    Bench {
        /// Extra arguments for the bench driver (e.g. `--quick`, `--only soak`, `--runs 200`).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        args: Vec<String>,
    },
    /// Stop the agent every way it stops (SIGKILL, SIGTERM and liveness restarts, rollouts with
    /// and without surge, uninstalls), fail its cgroup reads and reuse held apps' pids, at random
    /// moments across held, quitting and changing pods; print what it left behind (every count
    /// must be 0).
    Chaos {
        /// How many disruptions (stops and faults) to make.
        #[arg(long, visible_alias = "disruptions", default_value_t = chaos::DEFAULT_KILLS)]
        kills: u32,
        /// Replay a run's random choices (its seed is printed first).
        #[arg(long, env = "VALET_CHAOS_SEED")]
        seed: Option<u64>,
    },
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let root = cmd::workspace_root();
    match cli.task {
        Task::Setup => setup::setup(&root, true),
        Task::Lint => lint::lint(&root),
        Task::Test { filter, no_vm, kernels, cpu_hog } => {
            test::test(&root, filter.as_deref(), !no_vm || !kernels.is_empty(), &kernels, cpu_hog)
        }
        Task::Image => image::build(&root).map(|_| ()),
        Task::Kernels { only } => test::kernels(&root, &only),
        Task::Node { matrix, cells, only, lag } => test::node(&root, matrix, &cells, &only, lag),
        Task::Fuzz { target, seconds } => fuzz::run(&root, target.as_deref(), seconds),
        Task::Demo { args } => sim::demo(&root, &args),
        Task::Bench { args } => sim::bench(&root, &args),
        Task::Chaos { kills, seed } => chaos::chaos(&root, kills, seed),
    }
}
