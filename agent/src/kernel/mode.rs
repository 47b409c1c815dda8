//! When the kernel programs cannot run: why (a bounded [`DegradedReason`], told from the load's
//! error and what the node shows), and the stand-ins the loop then runs with. A node valet
//! cannot watch in the kernel is still served: every pod's ends come from the API's container
//! status, and no app is held.

use std::path::Path;

use valet_common::Counter;

use super::{EventSource, KernelControl, MainProcess, RecordOutcome};
use crate::error::Result;
use crate::vocab::{DegradedReason, NodeMode};

/// What the node shows, read after a failed load, to tell its reason.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct NodeFacts {
    /// The BTF file the programs' offsets are read from exists.
    pub btf_present: bool,
    /// The kernel's lockdown level (the bracketed word of `/sys/kernel/security/lockdown`).
    pub lockdown: Option<String>,
    /// A tracefs with `events` is mounted.
    pub tracefs: bool,
}

impl NodeFacts {
    /// Reads them below `host_root` (where the host's `/sys` is visible).
    pub fn read(host_root: &Path, btf: &Path) -> NodeFacts {
        // securityfs says the level in force; without it mounted, the boot's command line.
        let lockdown = std::fs::read_to_string(host_root.join("sys/kernel/security/lockdown"))
            .ok()
            .and_then(|text| lockdown_level(&text))
            .or_else(|| std::fs::read_to_string("/proc/cmdline").ok().and_then(|c| cmdline_lockdown(&c)));
        NodeFacts { btf_present: btf.is_file(), lockdown, tracefs: super::offsets::find_tracefs(host_root).is_ok() }
    }
}

/// The active level of `/sys/kernel/security/lockdown` (`none [integrity] confidentiality`).
pub fn lockdown_level(text: &str) -> Option<String> {
    let start = text.find('[')? + 1;
    let end = start + text[start..].find(']')?;
    Some(text[start..end].to_owned())
}

/// The `lockdown=` level of a kernel command line.
pub fn cmdline_lockdown(cmdline: &str) -> Option<String> {
    cmdline.split_whitespace().find_map(|w| w.strip_prefix("lockdown=")).map(str::to_owned)
}

/// Why the programs did not load, from the load's error (its whole chain) and the node's facts.
/// The node's facts come first: they name the cause where the error only shows its effect (a
/// locked-down kernel fails in the verifier, on tracefs or on a helper, depending on the kernel).
pub fn classify(error: &str, facts: &NodeFacts) -> DegradedReason {
    let error = error.to_ascii_lowercase();
    if !facts.btf_present {
        return DegradedReason::NoBtf;
    }
    if facts.lockdown.as_deref() == Some("confidentiality") {
        return DegradedReason::Lockdown;
    }
    if !facts.tracefs || error.contains("tracefs is not mounted") {
        return DegradedReason::NoTracefs;
    }
    if error.contains("rlimit_memlock") {
        return DegradedReason::Memlock;
    }
    if error.contains("operation not permitted") || error.contains("permission denied") {
        return DegradedReason::BpfDenied;
    }
    if error.contains("btf") && (error.contains("no such file") || error.contains("not found")) {
        return DegradedReason::NoBtf;
    }
    if ["verifier", "unknown func", "invalid argument", "no program variant loads", "not supported"]
        .iter()
        .any(|w| error.contains(w))
    {
        return DegradedReason::KernelUnsupported;
    }
    DegradedReason::LoadFailed
}

/// The degraded reasons an operator expects (`--degraded-ok`): a node degraded for one of them
/// is ready; one degraded for any other is not, so that a DaemonSet rollout that degrades its
/// nodes stops at the first ones. The node is served degraded either way.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpectedDegraded(Vec<DegradedReason>);

/// `--degraded-ok`'s default: the reasons that are properties of a node's kernel, which the
/// operator chose with the node pool and no release of valet can cause (a kernel built without
/// BTF, a kernel locked down by its boot). The others may come from a release itself (programs a
/// kernel's verifier rejects, a manifest whose privileges or mounts no longer let BPF load, a
/// map too large for a memlock limit), which is what a rollout must not carry to every node.
pub const DEFAULT_DEGRADED_OK: &str = "no_btf,lockdown";

impl ExpectedDegraded {
    /// From `--degraded-ok`'s comma-separated words: `valet_node_info` reason labels, `all`
    /// (every reason), or nothing / `none` (no reason: any degraded node is not ready).
    pub fn parse(words: &[String]) -> std::result::Result<ExpectedDegraded, String> {
        let mut reasons = Vec::new();
        for word in words.iter().map(|w| w.trim()).filter(|w| !w.is_empty() && *w != "none") {
            if word == "all" {
                reasons.extend(DegradedReason::ALL);
                continue;
            }
            match DegradedReason::ALL.into_iter().find(|r| r.as_str() == word) {
                Some(r) => reasons.push(r),
                None => {
                    let known: Vec<&str> = DegradedReason::ALL.iter().map(DegradedReason::as_str).collect();
                    return Err(format!("unknown reason {word:?} (known: {}, all, none)", known.join(", ")));
                }
            }
        }
        reasons.sort_by_key(|r| r.as_str());
        reasons.dedup();
        Ok(ExpectedDegraded(reasons))
    }

    /// Why a node served in `mode` must not be ready, if it must not: it degraded for a reason
    /// not expected. The words go to `/readyz` and the log.
    pub fn unready(&self, mode: NodeMode) -> Option<String> {
        let NodeMode::Degraded(reason) = mode else { return None };
        if self.0.contains(&reason) {
            return None;
        }
        let expected: Vec<&str> = self.0.iter().map(DegradedReason::as_str).collect();
        let expected = if expected.is_empty() { "none".to_owned() } else { expected.join(",") };
        Some(format!("degraded for a reason not expected: {reason} ({}); --degraded-ok={expected}", reason.explain()))
    }
}

/// The kernel side of a degraded node: nothing is watched, recorded or held. Every call
/// succeeds, so the loop and the actuators run unchanged; the pods themselves know their ends
/// come from the API.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoKernel;

impl KernelControl for NoKernel {
    fn watch(&mut self, _cgroup_id: u64, _flags: u32) -> Result<()> {
        Ok(())
    }

    fn unwatch(&mut self, _cgroup_id: u64) -> Result<()> {
        Ok(())
    }

    fn classify_exec(&mut self, _container_cgroup_id: u64, _hold: bool) -> Result<()> {
        Ok(())
    }

    fn exec_seen(&self, _container_cgroup_id: u64) -> bool {
        false
    }

    fn forget_container(&mut self, _container_cgroup_id: u64) {}

    fn record_container_main(&mut self, _container_cgroup_id: u64, _main: &MainProcess) -> Result<RecordOutcome> {
        Ok(RecordOutcome::Recorded)
    }

    fn counter(&self, _counter: Counter) -> u64 {
        0
    }

    fn detach(&mut self) {}
}

/// The kernel programs of a node in either mode, as the loop sees them.
pub enum NodeKernel {
    /// Boxed: the programs and their maps are large beside the empty stand-in.
    Loaded(Box<super::Programs>),
    Degraded(NoKernel),
}

impl KernelControl for NodeKernel {
    fn watch(&mut self, cgroup_id: u64, flags: u32) -> Result<()> {
        match self {
            NodeKernel::Loaded(p) => KernelControl::watch(p.as_mut(), cgroup_id, flags),
            NodeKernel::Degraded(n) => n.watch(cgroup_id, flags),
        }
    }

    fn unwatch(&mut self, cgroup_id: u64) -> Result<()> {
        match self {
            NodeKernel::Loaded(p) => KernelControl::unwatch(p.as_mut(), cgroup_id),
            NodeKernel::Degraded(n) => n.unwatch(cgroup_id),
        }
    }

    fn classify_exec(&mut self, container_cgroup_id: u64, hold: bool) -> Result<()> {
        match self {
            NodeKernel::Loaded(p) => KernelControl::classify_exec(p.as_mut(), container_cgroup_id, hold),
            NodeKernel::Degraded(n) => n.classify_exec(container_cgroup_id, hold),
        }
    }

    fn exec_seen(&self, container_cgroup_id: u64) -> bool {
        match self {
            NodeKernel::Loaded(p) => KernelControl::exec_seen(p.as_ref(), container_cgroup_id),
            NodeKernel::Degraded(n) => n.exec_seen(container_cgroup_id),
        }
    }

    fn forget_container(&mut self, container_cgroup_id: u64) {
        match self {
            NodeKernel::Loaded(p) => KernelControl::forget_container(p.as_mut(), container_cgroup_id),
            NodeKernel::Degraded(n) => n.forget_container(container_cgroup_id),
        }
    }

    fn record_container_main(&mut self, container_cgroup_id: u64, main: &MainProcess) -> Result<RecordOutcome> {
        match self {
            NodeKernel::Loaded(p) => KernelControl::record_container_main(p.as_mut(), container_cgroup_id, main),
            NodeKernel::Degraded(n) => n.record_container_main(container_cgroup_id, main),
        }
    }

    fn counter(&self, counter: Counter) -> u64 {
        match self {
            NodeKernel::Loaded(p) => KernelControl::counter(p.as_ref(), counter),
            NodeKernel::Degraded(n) => n.counter(counter),
        }
    }

    fn detach(&mut self) {
        match self {
            NodeKernel::Loaded(p) => KernelControl::detach(p.as_mut()),
            NodeKernel::Degraded(n) => n.detach(),
        }
    }

    fn held_ledger(&self) -> Option<std::sync::Arc<super::held_ledger::HeldLedger>> {
        match self {
            NodeKernel::Loaded(p) => KernelControl::held_ledger(p.as_ref()),
            NodeKernel::Degraded(n) => n.held_ledger(),
        }
    }

    fn held_record_pinned(&self) -> bool {
        match self {
            NodeKernel::Loaded(p) => KernelControl::held_record_pinned(p.as_ref()),
            // Nothing is held on a degraded node; nothing to pin.
            NodeKernel::Degraded(_) => false,
        }
    }
}

/// The kernel events of a node in either mode: a degraded node's never come.
pub enum NodeEvents {
    Reader(super::EventReader),
    None,
}

impl EventSource for NodeEvents {
    async fn next_batch(&mut self) -> Result<Vec<super::Event>> {
        match self {
            NodeEvents::Reader(r) => r.next_batch().await,
            NodeEvents::None => std::future::pending().await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(text: &str) -> Vec<String> {
        text.split(',').map(str::to_owned).collect()
    }

    #[test]
    fn a_node_degraded_for_a_reason_not_expected_is_not_ready() {
        let default = ExpectedDegraded::parse(&words(DEFAULT_DEGRADED_OK)).expect("the default parses");
        assert_eq!(default.unready(NodeMode::Kernel), None, "the kernel path is always ready");
        for expected in [DegradedReason::NoBtf, DegradedReason::Lockdown] {
            assert_eq!(default.unready(NodeMode::Degraded(expected)), None, "{expected} is a node's kernel");
        }
        for r in
            DegradedReason::ALL.into_iter().filter(|r| !matches!(r, DegradedReason::NoBtf | DegradedReason::Lockdown))
        {
            let why = default.unready(NodeMode::Degraded(r)).unwrap_or_else(|| panic!("{r} is ready by default"));
            assert!(why.contains(r.as_str()) && why.contains(r.explain()), "{why}");
            assert!(why.contains("--degraded-ok=lockdown,no_btf"), "{why}");
        }

        // Every reason, or none at all.
        let all = ExpectedDegraded::parse(&words("all")).expect("all");
        assert!(DegradedReason::ALL.into_iter().all(|r| all.unready(NodeMode::Degraded(r)).is_none()));
        for none in ["", "none", " , none"] {
            let none = ExpectedDegraded::parse(&words(none)).expect("none");
            let why = none.unready(NodeMode::Degraded(DegradedReason::NoBtf)).expect("not ready");
            assert!(why.ends_with("--degraded-ok=none"), "{why}");
            assert_eq!(none.unready(NodeMode::Kernel), None);
        }
        // An operator who knows a pool of old kernels and its seccomp profile.
        let pool = ExpectedDegraded::parse(&words(" kernel_unsupported,bpf_denied,kernel_unsupported")).expect("ok");
        assert_eq!(pool.unready(NodeMode::Degraded(DegradedReason::BpfDenied)), None);
        assert!(pool.unready(NodeMode::Degraded(DegradedReason::NoBtf)).is_some());
        // A word that is no reason is a clear error, never a guess.
        let err = ExpectedDegraded::parse(&words("no_btf,nobtf")).expect_err("unknown");
        assert!(err.contains("\"nobtf\"") && err.contains("no_btf, lockdown"), "{err}");
    }

    fn facts() -> NodeFacts {
        NodeFacts { btf_present: true, lockdown: Some("none".into()), tracefs: true }
    }

    #[test]
    fn reads_the_active_lockdown_level() {
        assert_eq!(lockdown_level("none integrity [confidentiality]\n").as_deref(), Some("confidentiality"));
        assert_eq!(lockdown_level("[none] integrity confidentiality\n").as_deref(), Some("none"));
        assert_eq!(lockdown_level("garbage"), None);
        assert_eq!(lockdown_level("[unclosed"), None);
        assert_eq!(
            cmdline_lockdown("console=ttyS0 lockdown=confidentiality quiet").as_deref(),
            Some("confidentiality")
        );
        assert_eq!(cmdline_lockdown("console=ttyS0 quiet"), None);
    }

    // The errors as the agent logged them on such nodes (issue 34) or as aya words them.
    #[test]
    fn tells_each_reason_from_the_error_and_the_node() {
        let no_btf = NodeFacts { btf_present: false, ..facts() };
        let cases: [(&str, NodeFacts, DegradedReason); 9] = [
            ("read /sys/kernel/btf/vmlinux: No such file or directory (os error 2)", no_btf, DegradedReason::NoBtf),
            (
                "no program variant loads on this kernel: load valet_exit: the BPF_PROG_LOAD syscall failed",
                NodeFacts { lockdown: Some("confidentiality".into()), ..facts() },
                DegradedReason::Lockdown,
            ),
            (
                "kernel programs: tracefs is not mounted (mount -t tracefs tracefs /sys/kernel/tracing)",
                NodeFacts { tracefs: false, ..facts() },
                DegradedReason::NoTracefs,
            ),
            (
                "kernel programs, load object (RLIMIT_MEMLOCK is 64 KiB and could not be raised: kernels before \
                 5.11 charge BPF maps to it; CAP_SYS_RESOURCE lets the agent lift it): map EVENTS: Operation not \
                 permitted (os error 1)",
                facts(),
                DegradedReason::Memlock,
            ),
            (
                "kernel programs, load object: map EVENTS: Operation not permitted (os error 1)",
                facts(),
                DegradedReason::BpfDenied,
            ),
            ("kernel programs, load object: Permission denied (os error 13)", facts(), DegradedReason::BpfDenied),
            (
                "kernel programs: no program variant loads on this kernel: load valet_exit: the verifier said: \
                 unknown func bpf_get_current_ancestor_cgroup_id#123",
                facts(),
                DegradedReason::KernelUnsupported,
            ),
            ("BTF: not a BTF file (bad magic)", facts(), DegradedReason::LoadFailed),
            ("something else entirely", facts(), DegradedReason::LoadFailed),
        ];
        for (error, node, want) in cases {
            assert_eq!(classify(error, &node), want, "{error}");
        }
    }

    #[test]
    fn reason_labels_are_bounded_snake_case_and_distinct() {
        let labels: std::collections::BTreeSet<&str> = DegradedReason::ALL.iter().map(|r| r.as_str()).collect();
        assert_eq!(labels.len(), DegradedReason::ALL.len());
        for l in labels {
            assert!(l.chars().all(|c| c.is_ascii_lowercase() || c == '_'), "{l}");
        }
    }

    #[test]
    fn a_degraded_kernel_accepts_every_call_and_counts_nothing() {
        let mut k = NodeKernel::Degraded(NoKernel);
        assert!(k.watch(1, 3).is_ok() && k.unwatch(1).is_ok() && k.classify_exec(2, true).is_ok());
        assert!(!k.exec_seen(2));
        assert_eq!(k.counter(Counter::ExitsReported), 0);
        assert!(k.held_ledger().is_none());
    }
}
