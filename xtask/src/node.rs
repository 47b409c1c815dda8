//! `cargo xtask node`: valet on a real node. A Debian VM (mmdebstrap from apt: systemd, containerd
//! with its CRI plugin and the systemd cgroup driver, runc and crun, the CNI plugins, AppArmor)
//! booted with a Debian kernel under qemu TCG, the host's `/` read-only at `/host`; a kubelet
//! stand-in (tests/node/kubelet.py) drives containerd through the CRI and mirrors the pods into
//! the fake API server; the host-built agent runs as root on the node. Images are built here
//! (tests/node/oci_image.py) and imported with `ctr`: no registry is involved. The scenarios are
//! tests/node/scenarios.py's; each prints `node scenario <name>: ok|FAILED (<figures>)`.
//!
//! The runtime matrix: a cell is a Debian suite (its containerd and OCI runtimes: one node image
//! each, cached), an OCI runtime (runc or crun) and a containerd layout (kubeadm's paths, or k3s's:
//! root `/var/lib/rancher/k3s/agent/containerd`, state and socket under `/run/k3s/containerd`).
//! Runtime and layout are named on the kernel command line and written into containerd's config
//! at boot, before containerd starts (tests/node/customize.sh's valet-node-config), rather than
//! baked into more images. Both of the kubelet's cgroup drivers run in every cell: the image's
//! containerd uses systemd's; the `*_cgroupfs` scenarios (run last) switch it to
//! `SystemdCgroup = false` with one restart, and the kubelet stand-in then makes and names
//! `/kubepods/<qos>/pod<uid>` as the kubelet's cgroupfs driver does. A cell's cgroup mode (v2, or
//! on bookworm v1 and hybrid: `/v1`, `/hybrid` after its name) is systemd's, chosen on the kernel
//! command line; the kubelet stand-in and the agent find it by looking. A `/no-btf` cell boots its
//! kernel with `initcall_blacklist=btf_vmlinux_init`: the kernel never makes `/sys/kernel/btf`, as
//! a kernel built without BTF (every Debian kernel in reach has BTF); the host agent there is
//! given the kernel's BTF as a file (`--kernel-btf`, the `.BTF` section of the booted vmlinux), and
//! the DaemonSet's pod, as shipped, finds none (tests/node/scenarios.py's `no_btf`).
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, anyhow, bail};

use crate::arch::Arch;
use crate::node_images::oci_images;
use crate::vm::apt::Apt;
use crate::vm::kernel::Kernel;
use crate::vm::qemu::{qemu, stopped_why};
use crate::vm::{CACHE, fnv};

/// Packages of the node image on top of `--variant=minbase`; each suite adds its OCI runtimes.
const PACKAGES: &str = "systemd,systemd-sysv,dbus,containerd,containernetworking-plugins,iproute2,apparmor,\
                        python3,python3-grpcio,python3-protobuf,protobuf-compiler,kmod,util-linux,procps,ca-certificates";
/// The node images: a Debian suite, the kernel suite it boots (sid's own kernel is not in the
/// private apt lists: trixie's), and the OCI runtimes the matrix runs on it. Bookworm's crun (1.8)
/// predates crun as a default anywhere: runc only.
const SUITES: [(&str, &str, &[&str]); 3] = [
    ("bookworm", "bookworm", &["runc"]),
    ("trixie", "trixie", &["runc", "crun"]),
    ("sid", "trixie", &["runc", "crun"]),
];
/// containerd's layouts: kubeadm's paths, and k3s's (also RKE2's).
const LAYOUTS: [&str; 2] = ["kubeadm", "k3s"];
/// The suites with a CRI-O layout cell (`<suite>/crun/crio`): no containerd for the pods, but
/// CRI-O's own layout from Debian's conmon and crun (tests/node/crio.py), with conmon in the pod
/// (`conmon_cgroup = "pod"`, OpenShift's). sid's conmon (2.1) and crun (1.2x) are the versions
/// CRI-O 1.3x ships with.
const CRIO_SUITES: [&str; 1] = ["sid"];
/// What plain `cargo xtask test` (CI) runs: the oldest node on cgroup v1 (Amazon Linux 2's and
/// RHEL 8's mode) under the cgroupfs driver, and the newest on cgroup v2 (crun one level below its
/// scope, k3s's paths) under systemd's, so CI sees both cgroup versions, both drivers and both
/// runtimes. The newest boots without `/sys/kernel/btf` (`/no-btf`): its host agent runs every
/// scenario from a BTF file (`--kernel-btf`), and the DaemonSet's pod as shipped runs degraded.
/// Both drivers in both cells would take CI from a fresh machine past 45 minutes
/// (docs/dev/testing.md); `cargo xtask node`, `--cell` and `--matrix` run both, and the hybrid and
/// CRI-O cells.
pub(crate) const CI_CELLS: [Cell; 2] = [
    Cell {
        suite: "bookworm",
        runtime: "runc",
        layout: "kubeadm",
        cgroups: Cgroups::V1,
        drivers: Drivers::Cgroupfs,
        arch: Arch::Amd64,
        kernel_btf: true,
    },
    Cell {
        suite: "sid",
        runtime: "crun",
        layout: "k3s",
        cgroups: Cgroups::V2,
        drivers: Drivers::Systemd,
        arch: Arch::Amd64,
        kernel_btf: false,
    },
];
/// The scenarios (tests/node/scenarios.py's, by their systemd names) CI runs in each of
/// [`CI_CELLS`]: every scenario runs in one cell at least, and the basic and hold scenarios (the
/// kernel path's quit and hold) in both. Each scenario takes about 20 s under TCG; running all
/// 13 in both cells took CI from a fresh machine past 45 minutes. The scenarios tied to cgroup v1
/// (its OOM report, a sub-cgroup's v1 paths, holds across an agent restart, the DaemonSet's own
/// resources) run in the v1 cell; `cargo xtask node --cell` and `--matrix` run every scenario.
pub(crate) const CI_SCENARIOS: [&[&str]; 2] = [
    &[
        "job",
        "hold_app",
        "nested_pidns",
        "oom_killed",
        "agent_restart_held",
        "daemonset_agent",
        "dind_subcgroup",
        // The DaemonSet's pod as shipped on a node without bpffs at /sys/fs/bpf, then under
        // lockdown=confidentiality (raised through securityfs, so last: it cannot be lowered).
        "no_bpffs",
        // The DaemonSet's pod where the runtime (containerd 1.6) has no recursive read-only
        // mounts: each container makes the v1 controllers' mounts read-only itself.
        "cgroup_read_only",
        "kernel_lockdown",
    ],
    &[
        "job",
        "hold_app",
        "short_app",
        // An app that starts and ends while the agent is stopped, named by the kubelet's log link
        // (the v1 cell runs it with the DaemonSet's agent, in daemonset_agent).
        "stall_short_app",
        "onfailure_restart",
        "restart_rules",
        "share_pidns",
        "hostpid_nested",
        "native_sidecar",
        "native_record",
        "envoy_job",
        // The DaemonSet's pod on cgroup v2 (a recursive read-only mount where containerd 2.x
        // makes one).
        "cgroup_read_only",
        // The DaemonSet's pod as shipped on this cell's kernel without /sys/kernel/btf, then with
        // the documented BTF file.
        "no_btf",
    ],
];
/// `cargo xtask node` without `--matrix` or `--cell`.
pub(crate) const DEFAULT_CELL: Cell = Cell { cgroups: Cgroups::V2, drivers: Drivers::Both, ..CI_CELLS[0] };
/// The cells whose kernel boots without `/sys/kernel/btf` (`<cell>/no-btf`).
const NO_BTF_CELLS: [&str; 1] = ["sid/crun/k3s"];
/// The suites whose systemd still boots cgroup v1 and hybrid (bookworm's 252; trixie's 257 needs
/// `SYSTEMD_CGROUP_ENABLE_LEGACY_FORCE=1`, and later ones have no v1 at all).
const V1_SUITES: [&str; 1] = ["bookworm"];
/// Size of the (sparse) root disk.
const DISK: &str = "3G";
/// Per cell: every scenario under both cgroup drivers took 20 minutes under TCG on a 2-core
/// machine at a load of 15 (RunPodSandbox alone 10 s); a guest still running after this is hung.
const DEADLINE: Duration = Duration::from_secs(40 * 60);
/// Where the guest mounts the host's out directory.
pub(crate) const OUT: &str = "/run/valet-out";

/// CI's cells with their scenarios ([`CI_SCENARIOS`]), named as each cell's drivers name them.
pub(crate) fn ci_plan() -> Vec<(Cell, Vec<String>)> {
    CI_CELLS.iter().zip(CI_SCENARIOS).map(|(cell, names)| (*cell, cell.scenario_names(names))).collect()
}

/// One cell of the runtime matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Cell {
    pub suite: &'static str,
    pub runtime: &'static str,
    pub layout: &'static str,
    /// How the node mounts its cgroups (systemd's choice at boot, from the kernel command line).
    pub cgroups: Cgroups,
    /// The kubelet's cgroup drivers the scenarios run under.
    pub drivers: Drivers,
    /// The node's architecture: arm64 boots under qemu-system-aarch64 with Debian's arm64 packages
    /// and the aarch64 builds.
    pub arch: Arch,
    /// Whether the kernel shows its BTF at `/sys/kernel/btf` (false: booted with
    /// `initcall_blacklist=btf_vmlinux_init`, so it never makes that directory).
    pub kernel_btf: bool,
}

/// A node's cgroup mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Cgroups {
    /// cgroup v2 alone at `/sys/fs/cgroup` (systemd's default).
    V2,
    /// `systemd.unified_cgroup_hierarchy=0`: the v1 controllers at `/sys/fs/cgroup/<controller>`,
    /// systemd's own cgroup2 (no controllers) at `/sys/fs/cgroup/unified`.
    Hybrid,
    /// `systemd.legacy_systemd_cgroup_controller=1` besides: v1 alone (systemd's tree in the
    /// named `name=systemd` hierarchy).
    V1,
}

impl Cgroups {
    /// The cell name's suffix (none for v2).
    fn suffix(self) -> &'static str {
        match self {
            Cgroups::V2 => "",
            Cgroups::Hybrid => "/hybrid",
            Cgroups::V1 => "/v1",
        }
    }

    /// What systemd reads from the kernel command line to mount them so.
    fn kernel_args(self) -> &'static str {
        match self {
            Cgroups::V2 => "",
            Cgroups::Hybrid => " systemd.unified_cgroup_hierarchy=0",
            Cgroups::V1 => " systemd.unified_cgroup_hierarchy=0 systemd.legacy_systemd_cgroup_controller=1",
        }
    }
}

/// The kubelet's cgroup drivers a cell runs its scenarios under (tests/node/scenarios.py reads
/// them from `VALET_NODE_DRIVERS`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Drivers {
    /// Every scenario, then every scenario again under cgroupfs (`<scenario>_cgroupfs`).
    Both,
    Systemd,
    /// Only the `<scenario>_cgroupfs` twins.
    Cgroupfs,
}

impl Drivers {
    fn name(self) -> &'static str {
        match self {
            Drivers::Both => "both",
            Drivers::Systemd => "systemd",
            Drivers::Cgroupfs => "cgroupfs",
        }
    }
}

impl Cell {
    pub(crate) fn name(&self) -> String {
        let arch = if self.arch == Arch::Amd64 { "" } else { "/arm64" };
        let btf = if self.kernel_btf { "" } else { "/no-btf" };
        format!("{}/{}/{}{}{arch}{btf}", self.suite, self.runtime, self.layout, self.cgroups.suffix())
    }

    /// The scenarios named `base` (their systemd names) as this cell's drivers run them:
    /// `<name>_cgroupfs` under cgroupfs, both names under both drivers.
    fn scenario_names(&self, base: &[&str]) -> Vec<String> {
        let twin = |n: &&str| format!("{n}_cgroupfs");
        match self.drivers {
            Drivers::Systemd => base.iter().map(|n| n.to_string()).collect(),
            Drivers::Cgroupfs => base.iter().map(twin).collect(),
            Drivers::Both => base.iter().map(|n| n.to_string()).chain(base.iter().map(twin)).collect(),
        }
    }

    pub(crate) fn kernel_suite(&self) -> &'static str {
        SUITES.iter().find(|(s, _, _)| *s == self.suite).map_or("bookworm", |(_, k, _)| *k)
    }

    /// containerd's socket and state directory in this cell's layout.
    fn containerd(&self) -> (&'static str, &'static str) {
        // The CRI-O layout's node still runs containerd (the image's), unused by its pods.
        match self.layout {
            "k3s" => ("/run/k3s/containerd/containerd.sock", "/run/k3s/containerd"),
            _ => ("/run/containerd/containerd.sock", "/run/containerd"),
        }
    }

    /// `suite/runtime/layout[/v1|/hybrid]`, each part one the matrix knows.
    pub(crate) fn parse(text: &str) -> Result<Cell> {
        matrix().into_iter().find(|c| c.name() == text).ok_or_else(|| {
            anyhow!("unknown cell {text:?}: one of {}", matrix().iter().map(Cell::name).collect::<Vec<_>>().join(", "))
        })
    }
}

/// Every cell: suite × its runtimes × layout on cgroup v2, and the kubeadm layout of the suites
/// that still boot cgroup v1, with v1 and hybrid cgroups.
pub(crate) fn matrix() -> Vec<Cell> {
    let mut cells = Vec::new();
    for (suite, _, runtimes) in SUITES {
        for runtime in runtimes {
            for layout in LAYOUTS {
                cells.push(Cell {
                    suite,
                    runtime,
                    layout,
                    cgroups: Cgroups::V2,
                    drivers: Drivers::Both,
                    arch: Arch::Amd64,
                    kernel_btf: true,
                });
            }
        }
    }
    for suite in CRIO_SUITES {
        cells.push(Cell {
            suite,
            runtime: "crun",
            layout: "crio",
            cgroups: Cgroups::V2,
            drivers: Drivers::Both,
            arch: Arch::Amd64,
            kernel_btf: true,
        });
    }
    for suite in V1_SUITES {
        for cgroups in [Cgroups::V1, Cgroups::Hybrid] {
            cells.push(Cell {
                suite,
                runtime: "runc",
                layout: "kubeadm",
                cgroups,
                drivers: Drivers::Both,
                arch: Arch::Amd64,
                kernel_btf: true,
            });
        }
    }
    let no_btf: Vec<Cell> = cells
        .iter()
        .filter(|c| NO_BTF_CELLS.contains(&c.name().as_str()))
        .map(|c| Cell { kernel_btf: false, ..*c })
        .collect();
    cells.extend(no_btf);
    // arm64: Debian's arm64 containerd and runc on its arm64 kernel, under qemu-system-aarch64.
    cells.push(Cell { arch: Arch::Arm64, ..DEFAULT_CELL });
    cells
}

/// Builds (or reuses) the node images and the OCI images, then boots one node per cell, one after
/// the other, and runs each cell's scenarios (all when its list is empty). Each cell prints
/// `node <suite>/<runtime>/<layout>: N passed, N failed` with the versions its VM ran. Returns the
/// summed (passed, failed) counts; a cell whose scenarios never reported counts one failure.
pub(crate) fn run(root: &Path, cells: &[(Cell, Vec<String>)]) -> Result<(u64, u64)> {
    let started = Instant::now();
    let apt = Apt::new()?;
    let mut kits = std::collections::BTreeMap::new();
    for arch in [Arch::Amd64, Arch::Arm64] {
        if cells.iter().any(|(c, _)| c.arch == arch) {
            kits.insert(arch.deb(), Kit::make(root, &apt, arch)?);
        }
    }
    let manifests = Manifests::render(root)?;
    let (mut passed, mut failed) = (0, 0);
    let mut summary = Vec::new();
    for (cell, only) in cells {
        let t = Instant::now();
        let kit = &kits[cell.arch.deb()];
        let outcome = run_cell(root, &apt, &kit.busybox, &kit.release, &kit.images, &manifests, *cell, only)?;
        let line = format!(
            "node {}{}: {} passed, {} failed{} ({}) [{:.0?}]",
            cell.name(),
            match cell.drivers {
                Drivers::Both => "",
                Drivers::Systemd => " (systemd driver only)",
                Drivers::Cgroupfs => " (cgroupfs driver only)",
            },
            outcome.passed,
            outcome.failed,
            if outcome.rebooted { ", booted twice: a guest kernel panic or hang not in valet's code" } else { "" },
            outcome.versions,
            t.elapsed()
        );
        println!("{line}");
        for result in &outcome.results {
            println!("{result}");
        }
        summary.push(line);
        passed += outcome.passed;
        failed += outcome.failed;
    }
    println!("\nnode matrix ({:.0?}):", started.elapsed());
    for line in summary {
        println!("{line}");
    }
    Ok((passed, failed))
}

/// What the node gets of the shipped manifests, rendered as an install renders them (`kubectl
/// kustomize`): the DaemonSet of `deploy/base` translated to CRI requests
/// (tests/node/daemonset_cri.py), and the PrometheusRule's groups of `deploy/monitoring` as JSON,
/// a rule file promtool reads (tests/node/alert_rules.py).
struct Manifests {
    agent_pod: Vec<u8>,
    rules: Vec<u8>,
}

impl Manifests {
    fn render(root: &Path) -> Result<Self> {
        Ok(Self {
            agent_pod: through(
                root,
                "deploy/base",
                "tests/node/daemonset_cri.py",
                &["-", "valet-node", crate::image::NAME],
            )?,
            rules: through(root, "deploy/monitoring", "tests/node/alert_rules.py", &[])?,
        })
    }

    /// Into a cell's out directory, which the guest mounts at [`OUT`].
    fn write_to(&self, out: &Path) -> Result<()> {
        std::fs::write(out.join("agent-pod.json"), &self.agent_pod)?;
        Ok(std::fs::write(out.join("valet-rules.json"), &self.rules)?)
    }
}

/// `kubectl kustomize <dir>` (`KUBECTL` or the one on `PATH`), piped into `script` (the manifest
/// tests' Python, which has PyYAML); the script's output.
fn through(root: &Path, dir: &str, script: &str, args: &[&str]) -> Result<Vec<u8>> {
    let kubectl = std::env::var_os("KUBECTL").unwrap_or_else(|| "kubectl".into());
    let rendered = Command::new(&kubectl)
        .arg("kustomize")
        .arg(root.join(dir))
        .output()
        .with_context(|| format!("run {} kustomize (the manifest tests need it too)", kubectl.to_string_lossy()))?;
    if !rendered.status.success() {
        bail!("kubectl kustomize {dir}: {}", String::from_utf8_lossy(&rendered.stderr));
    }
    let mut child = Command::new(root.join(".venv/bin/python"))
        .arg(root.join(script))
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .with_context(|| format!("run {script} (.venv: cargo xtask setup)"))?;
    let mut stdin = child.stdin.take().context("stdin")?;
    let input = rendered.stdout;
    let writer = std::thread::spawn(move || std::io::Write::write_all(&mut stdin, &input));
    let out = child.wait_with_output()?;
    writer.join().map_err(|_| anyhow!("writer thread"))??;
    if !out.status.success() {
        bail!("{script} on {dir}: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(out.stdout)
}

/// What the nodes of one architecture run: the static busybox (initramfs, images), the release
/// binaries (agent, fake API server, stand-in proxy), and the pods' images with the agent's own.
struct Kit {
    busybox: PathBuf,
    release: PathBuf,
    images: PathBuf,
}

impl Kit {
    fn make(root: &Path, apt: &Apt, arch: Arch) -> Result<Self> {
        let busybox = apt.busybox(arch)?;
        // VALET_NODE_BINARIES: run the scenarios with another build's valet-agent,
        // valet-fake-apiserver and valet-standin-proxy (a directory holding the three).
        let release = match std::env::var_os("VALET_NODE_BINARIES") {
            Some(dir) if arch == Arch::host() => {
                println!("node: binaries from VALET_NODE_BINARIES={}", dir.to_string_lossy());
                PathBuf::from(dir)
            }
            _ => crate::cmd::build_release_bins_for(root, arch)?,
        };
        let images = oci_images(root, apt, arch, &release, &busybox)?;
        // The agent's own image, imported with the others.
        let (_, agent_tar) = crate::image::from_binary(root, arch, &release.join("valet-agent"))?;
        std::fs::copy(&agent_tar, images.join("valet-agent.tar"))?;
        Ok(Self { busybox, release, images })
    }
}

/// tests/node/scenarios.py's `BASE`: every scenario, by its systemd name.
#[cfg(test)]
fn base_scenarios(root: &Path) -> Result<Vec<String>> {
    let path = root.join("tests/node/scenarios.py");
    let text = std::fs::read_to_string(&path).with_context(|| format!("read {}", path.display()))?;
    let start = text.find("\nBASE = [").context("no BASE list in scenarios.py")? + "\nBASE = [".len();
    let end = start + text[start..].find(']').context("BASE's end")?;
    Ok(text[start..end].split(',').map(|n| n.trim().to_string()).filter(|n| !n.is_empty()).collect())
}

/// What one cell's VM reported.
struct CellOutcome {
    passed: u64,
    failed: u64,
    /// containerd's and the OCI runtime's `--version`, from inside the VM.
    versions: String,
    results: Vec<String>,
    /// Booted again after a guest kernel panic with no BPF program on its stack.
    rebooted: bool,
}

#[allow(clippy::too_many_arguments, reason = "one cell's run and what every cell shares")]
fn run_cell(
    root: &Path,
    apt: &Apt,
    busybox: &Path,
    release: &Path,
    images: &Path,
    manifests: &Manifests,
    cell: Cell,
    only: &[String],
) -> Result<CellOutcome> {
    let (kernel, image, dir, out) = prepare_cell(root, apt, busybox, manifests, cell)?;
    let script = dir.join("run.sh");
    // VALET_NODE_CRASH_AFTER=<scenario>: the first boot's guest kernel crashes (sysrq) after that
    // scenario, to check the rerun below.
    let crash_after = std::env::var("VALET_NODE_CRASH_AFTER").ok();
    let write_script = |only: &[String], boot: u32| -> Result<()> {
        let text =
            cell_script(root, cell, &kernel, release, images, only, crash_after.as_deref().filter(|_| boot == 1));
        std::fs::write(&script, text)?;
        Ok(())
    };
    let append = kernel_append(cell, &script);
    let [drive, share] = disk_and_share(&image, &out);
    // A guest kernel panic with no BPF program on its stack (the emulator's or the kernel's fault,
    // not valet's) boots the node once more for the scenarios it did not report; said in the log.
    let asked_all = only.is_empty();
    let mut only = only.to_vec();
    let (mut passed, mut failed) = (0, 0);
    let mut results = Vec::new();
    let mut versions = String::new();
    let mut rebooted = false;
    for boot in 1..=2 {
        write_script(&only, boot)?;
        let t = Instant::now();
        let (lines, killed) =
            qemu(&kernel, &append, &["-drive", &drive, "-virtfs", &share], &dir.join("console.log"), DEADLINE)?;
        let ready = lines.iter().find_map(|l| l.split_once("VALET-NODE-READY ").map(|(_, t)| t.to_string()));
        versions = reported_versions(&lines);
        println!(
            "node {}: booted to containerd-ready at {}s guest uptime; VM ran {:.0?}",
            cell.name(),
            ready.as_deref().unwrap_or("?"),
            t.elapsed(),
        );
        let (reported, mut this_boot) = scenario_lines(&lines);
        let finished = !this_boot.is_empty() && lines.iter().any(|l| l.starts_with("VALET-NODE-EXIT"));
        let panic = if finished { None } else { crate::vm::qemu::foreign_fault(&lines, killed.as_ref()) };
        let left: Vec<String> = only.iter().filter(|n| !reported.contains(n)).cloned().collect();
        let rerun = boot == 1 && panic.is_some() && (asked_all || !left.is_empty());
        if let (true, Some(panic)) = (rerun, &panic) {
            let again = if asked_all { "every scenario".to_string() } else { left.join(" ") };
            results.push(panic_note(cell, &dir, panic, &again)?);
            // With every scenario asked for (an empty list), all of them run again.
            if asked_all {
                this_boot.clear();
            }
            only = left;
        }
        let (ok, not_ok) = tally(this_boot, &mut results);
        (passed, failed) = (passed + ok, failed + not_ok);
        if rerun {
            rebooted = true;
            continue;
        }
        if !finished {
            failed += 1;
            let why = stopped_why(&lines, killed.as_ref(), panic.as_deref());
            results.push(format!(
                "  node: the scenarios did not finish: {why}; console: {}",
                dir.join("console.log").display()
            ));
        }
        break;
    }
    results.push(format!("  (agent log and events: {})", out.display()));
    Ok(CellOutcome { passed, failed, versions, results, rebooted })
}

/// One cell's kernel (VALET_NODE_KERNEL: another kernel of the matrix, e.g. 6.12; the root file
/// system stays the cell's), node image, run directory and out directory (emptied, with the
/// agent's pod in it).
fn prepare_cell(
    root: &Path,
    apt: &Apt,
    busybox: &Path,
    manifests: &Manifests,
    cell: Cell,
) -> Result<(Kernel, PathBuf, PathBuf, PathBuf)> {
    let kernel_suite = match std::env::var("VALET_NODE_KERNEL") {
        Ok(k) => crate::kernels::suites(&[k])?.first().map(|(s, _)| *s).unwrap_or(cell.kernel_suite()),
        Err(_) => cell.kernel_suite(),
    };
    let kernel = Kernel::prepare(apt, kernel_suite, cell.arch, busybox)?;
    let t = Instant::now();
    let image = node_image(root, &apt.mirror, cell.suite, cell.arch)?;
    println!("node {}: image {} ready in {:.0?}", cell.name(), image.display(), t.elapsed());
    let dir = Path::new(CACHE).join(format!("run/node/{}", cell.name().replace('/', "-")));
    // Shared writable with the guest: the agent's log and the scenarios' events come back here.
    let out = dir.join("out");
    if out.exists() {
        std::fs::remove_dir_all(&out)?;
    }
    std::fs::create_dir_all(&out)?;
    manifests.write_to(&out)?;
    Ok((kernel, image, dir, out))
}

/// A cell's run script: the scenarios named in `only` (all when empty), the guest kernel crashed
/// after `crash_after` when given.
fn cell_script(
    root: &Path,
    cell: Cell,
    kernel: &Kernel,
    release: &Path,
    images: &Path,
    only: &[String],
    crash_after: Option<&str>,
) -> String {
    let crash = match crash_after {
        Some(name) => format!("export VALET_NODE_CRASH_AFTER={name}\n"),
        None => String::new(),
    };
    format!(
        "{head}{crash}python3 {scenarios} {release} {images} {OUT} {only}\n",
        head = script_head(cell, kernel),
        scenarios = in_guest(&root.join("tests/node/scenarios.py")).display(),
        release = in_guest(release).display(),
        images = in_guest(images).display(),
        only = only.join(" "),
    )
}

/// The versions the VM reported (`VALET-NODE-VERSIONS`), or says they were not.
pub(crate) fn reported_versions(lines: &[String]) -> String {
    lines
        .iter()
        .find_map(|l| l.split_once("VALET-NODE-VERSIONS ").map(|(_, v)| format!("containerd {}", v.trim())))
        .unwrap_or_else(|| "versions not reported".into())
}

/// A boot that ended in a guest kernel panic or hang not in valet's code: its console kept aside,
/// and the note (printed, and returned for the cell's results) that the node boots again for
/// `again`.
fn panic_note(cell: Cell, dir: &Path, panic: &str, again: &str) -> Result<String> {
    let kept = dir.join("console-panicked.log");
    std::fs::rename(dir.join("console.log"), &kept)?;
    let note = format!(
        "  node: the guest kernel panicked or hung with nothing of valet's on its stacks ({panic}); console: {}; \
         booted again for {again}",
        kept.display(),
    );
    println!("node {}: {}", cell.name(), note.trim_start().trim_start_matches("node: "));
    Ok(note)
}

/// The scenarios a boot reported: their names, and their `node scenario` lines.
fn scenario_lines(lines: &[String]) -> (Vec<String>, Vec<String>) {
    let mut reported = Vec::new();
    let mut this_boot = Vec::new();
    for line in lines {
        let Some(rest) = line.strip_prefix("node scenario ") else { continue };
        let (name, _) = rest.split_once(": ").unwrap_or((rest, ""));
        reported.push(name.to_string());
        this_boot.push(line.clone());
    }
    (reported, this_boot)
}

/// Counts a boot's `node scenario` lines as (passed, failed), each pushed indented to `results`.
fn tally(this_boot: Vec<String>, results: &mut Vec<String>) -> (u64, u64) {
    let (mut passed, mut failed) = (0, 0);
    for line in this_boot {
        if line
            .strip_prefix("node scenario ")
            .and_then(|r| r.split_once(": "))
            .is_some_and(|(_, r)| r.starts_with("ok"))
        {
            passed += 1;
        } else {
            failed += 1;
        }
        results.push(format!("  {line}"));
    }
    (passed, failed)
}

/// A host path as the guest sees it: the host's `/` is its read-only `/host`.
pub(crate) fn in_guest(p: &Path) -> PathBuf {
    Path::new("/host").join(p.strip_prefix("/").unwrap_or(p))
}

/// The start of a node's run script: the cell's environment for tests/node/*.py (with the booted
/// vmlinux, `VALET_NODE_VMLINUX`), the versions the VM runs on the console (`VALET-NODE-VERSIONS`),
/// the out directory mounted at [`OUT`].
pub(crate) fn script_head(cell: Cell, kernel: &Kernel) -> String {
    let (socket, state) = cell.containerd();
    format!(
        "export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\n\
         export CONTAINERD_ADDRESS={socket} VALET_NODE_STATE={state} VALET_NODE_RUNTIME={runtime} \
         VALET_NODE_DRIVERS={drivers} VALET_NODE_CRI={cri} VALET_NODE_ARCH={arch} VALET_NODE_VMLINUX={vmlinux}\n\
         echo \"VALET-NODE-VERSIONS $(containerd --version | cut -d' ' -f3){conmon} / {runtime} \
         $({runtime} --version | head -1 | sed 's/.*version //') / kernel $(uname -r) / \
         AppArmor $(cat /sys/module/apparmor/parameters/enabled 2>/dev/null || echo absent) / cgroup \
         $(if [ -f /sys/fs/cgroup/cgroup.controllers ]; then echo v2; \
         elif [ -f /sys/fs/cgroup/unified/cgroup.procs ]; then echo hybrid; else echo v1; fi)\"\n\
         findmnt -t cgroup,cgroup2 > /dev/console\n\
         mkdir -p {OUT} && mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 out {OUT} || exit 1\n",
        runtime = cell.runtime,
        arch = cell.arch.deb(),
        vmlinux = in_guest(&kernel.vmlinux).display(),
        drivers = cell.drivers.name(),
        cri = if cell.layout == "crio" { "crio" } else { "containerd" },
        conmon =
            if cell.layout == "crio" { " (unused) / conmon $(conmon --version | head -1 | cut -d' ' -f3)" } else { "" },
    )
}

/// qemu's `-drive` (the node's root disk, a throw-away snapshot) and `-virtfs` (the out directory,
/// writable, mounted at [`OUT`]) values.
pub(crate) fn disk_and_share(image: &Path, out: &Path) -> [String; 2] {
    [
        format!("file={},if=virtio,format=raw,snapshot=on", image.display()),
        format!("local,path={},mount_tag=out,security_model=none", out.display()),
    ]
}

/// The node's kernel command line: its root, the script it runs (valet-node-run), the cell's OCI
/// runtime, containerd layout (valet-node-config) and cgroup mode, AppArmor on; for a `/no-btf`
/// cell, no `/sys/kernel/btf`.
pub(crate) fn kernel_append(cell: Cell, script: &Path) -> String {
    format!(
        "valet.root=/dev/vda valet.run={} valet.runtime={} valet.layout={} apparmor=1 security=apparmor \
         systemd.show_status=0{}{}",
        script.display(),
        cell.runtime,
        // containerd's layout (valet-node-config): the image's own on a CRI-O layout node.
        if cell.layout == "crio" { "kubeadm" } else { cell.layout },
        cell.cgroups.kernel_args(),
        // kernel/bpf/sysfs_btf.c's initcall makes /sys/kernel/btf/vmlinux: skipped, the kernel
        // shows no BTF (its own, inside, stays: nothing the agent reaches without that file).
        if cell.kernel_btf { "" } else { " initcall_blacklist=btf_vmlinux_init" }
    )
}

/// The node's root disk: mmdebstrap (its .debs cached), tests/node/customize.sh, mke2fs.
/// A foreign architecture's image runs its maintainer scripts under qemu-user (binfmt_misc,
/// [`crate::setup::binfmt_aarch64`]).
pub(crate) fn node_image(root: &Path, mirror: &str, suite: &str, arch: Arch) -> Result<PathBuf> {
    let customize = std::fs::read(root.join("tests/node/customize.sh"))?;
    let runtimes = SUITES.iter().find(|(s, _, _)| *s == suite).map(|(_, _, r)| r.join(",")).unwrap_or_default();
    let crio = if CRIO_SUITES.contains(&suite) { ",conmon" } else { "" };
    let packages = format!("{PACKAGES},{runtimes}{crio}");
    let (tag, foreign) = match arch {
        Arch::Amd64 => (String::new(), false),
        other => (format!("-{}", other.deb()), other != Arch::host()),
    };
    let key = fnv(&[suite.as_bytes(), packages.as_bytes(), &customize]);
    let base = Path::new(CACHE).join("node");
    let image = base.join(format!("node-{suite}{tag}-{key:016x}.img"));
    if image.exists() {
        return Ok(image);
    }
    if foreign {
        crate::setup::binfmt_aarch64()?;
    }
    let debs = base.join(format!("debs-{suite}{tag}"));
    std::fs::create_dir_all(&debs)?;
    let rootfs = base.join(format!("rootfs-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&rootfs);
    println!("node: mmdebstrap {suite} {} (first time: downloads ~150 MB of .debs, cached)", arch.deb());
    crate::cmd::run(
        Command::new("mmdebstrap")
            .args(["--variant=minbase", "--quiet", &format!("--include={packages}"), "--skip=download/empty"])
            .arg(format!("--architectures={}", arch.deb()))
            // sid's index on the mirror may be past its Valid-Until date.
            .arg("--aptopt=Acquire::Check-Valid-Until \"false\"")
            .arg("--setup-hook=mkdir -p \"$1\"/var/cache/apt/archives/")
            .arg(format!("--setup-hook=sync-in {} /var/cache/apt/archives/", debs.display()))
            .arg(format!("--customize-hook=sync-out /var/cache/apt/archives {}", debs.display()))
            .arg(suite)
            .arg(&rootfs)
            .arg(mirror),
    )?;
    crate::cmd::run(Command::new("sh").arg(root.join("tests/node/customize.sh")).arg(&rootfs))?;
    let tmp = image.with_extension("tmp");
    crate::cmd::run(
        Command::new("mke2fs").args(["-q", "-t", "ext4", "-L", "valet-node", "-d"]).arg(&rootfs).arg(&tmp).arg(DISK),
    )?;
    std::fs::rename(&tmp, &image)?;
    std::fs::remove_dir_all(&rootfs)?;
    Ok(image)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matrix_cells_and_names() {
        let cells = matrix();
        assert_eq!(
            cells.len(),
            15,
            "bookworm runc × 2 layouts, trixie and sid 2 runtimes × 2 layouts, sid's CRI-O layout, 2 v1 cells, \
             sid/crun/k3s without BTF, arm64"
        );
        assert_eq!(Cell::parse("sid/crun/crio").map(|c| (c.layout, c.runtime)).ok(), Some(("crio", "crun")));
        assert!(Cell::parse("sid/runc/crio").is_err(), "the CRI-O layout runs crun");
        assert_eq!(Cell::parse("sid/crun/k3s/no-btf").ok(), Some(Cell { drivers: Drivers::Both, ..CI_CELLS[1] }));
        assert_eq!(Cell::parse("sid/crun/k3s").map(|c| c.kernel_btf).ok(), Some(true));
        assert!(Cell::parse("bookworm/runc/kubeadm/no-btf").is_err(), "one cell without BTF");
        let no_btf = kernel_append(CI_CELLS[1], Path::new("/run.sh"));
        assert!(no_btf.ends_with(" initcall_blacklist=btf_vmlinux_init"), "{no_btf}");
        assert!(!kernel_append(CI_CELLS[0], Path::new("/run.sh")).contains("initcall_blacklist"));
        assert_eq!(Cell::parse("bookworm/runc/kubeadm/v1").map(|c| c.cgroups).ok(), Some(Cgroups::V1));
        assert_eq!(Cell::parse("bookworm/runc/kubeadm").ok(), Some(DEFAULT_CELL));
        assert_eq!(Cell::parse("bookworm/runc/kubeadm/arm64").map(|c| c.arch).ok(), Some(Arch::Arm64));
        assert_eq!(Cell::parse("bookworm/runc/kubeadm/hybrid").map(|c| c.cgroups).ok(), Some(Cgroups::Hybrid));
        assert!(Cell::parse("sid/crun/k3s/v1").is_err(), "sid's systemd boots no cgroup v1");
        assert!(Cell::parse("bookworm/crun/kubeadm").is_err(), "bookworm has runc only");
        assert!(Cell::parse("sid/crun").is_err());
        assert_eq!(CI_CELLS[1].containerd(), ("/run/k3s/containerd/containerd.sock", "/run/k3s/containerd"));
        assert_eq!(CI_CELLS[1].kernel_suite(), "trixie");
    }

    /// Scenarios of the CRI-O layout only (`cargo xtask node --cell sid/crun/crio`), which CI
    /// does not boot: a third cell would take CI from a fresh machine past its 45 minutes.
    const CRIO_ONLY: [&str; 1] = ["drop_infra"];

    #[test]
    fn ci_runs_every_scenario_and_only_known_ones() {
        let base = base_scenarios(&crate::cmd::workspace_root()).expect("scenarios.py's BASE");
        assert!(base.len() >= 13, "{base:?}");
        let in_ci: Vec<&str> = CI_SCENARIOS.iter().flat_map(|s| s.iter().copied()).collect();
        for name in &base {
            let crio_only = CRIO_ONLY.contains(&name.as_str());
            assert!(in_ci.contains(&name.as_str()) != crio_only, "{name} runs in no CI cell, or is CRI-O's and in one");
        }
        for name in &in_ci {
            assert!(base.iter().any(|b| b == name), "CI names {name}, which scenarios.py does not have");
        }
        for basic in ["job", "hold_app"] {
            assert!(CI_SCENARIOS.iter().all(|s| s.contains(&basic)), "{basic} runs in every CI cell");
        }
        // The DaemonSet's pod as shipped runs degraded (no_btf) without the kernel's BTF: the
        // scenarios that want it otherwise run where the kernel shows BTF, and no_btf where not.
        for (cell, names) in CI_CELLS.iter().zip(CI_SCENARIOS) {
            for name in ["daemonset_agent", "no_bpffs", "kernel_lockdown"] {
                assert!(!names.contains(&name) || cell.kernel_btf, "{name} in {}", cell.name());
            }
            assert!(!names.contains(&"no_btf") || !cell.kernel_btf, "no_btf in {}", cell.name());
        }
        let plan = ci_plan();
        assert_eq!(plan[0].1[0], "job_cgroupfs", "the v1 cell runs the cgroupfs twins");
        assert_eq!(plan[1].1[0], "job", "the systemd cell runs the systemd names");
        let both = Cell { drivers: Drivers::Both, ..CI_CELLS[0] };
        assert_eq!(both.scenario_names(&["job"]), ["job", "job_cgroupfs"]);
    }
}
