//! The listen program: loaded and attached with the others, at start, for the agent's life.
//!
//! It was once attached only while some pod held an app (it runs on every TCP state change of
//! the node). Each attach and detach flips the tracepoint's static key, which patches kernel
//! text on every CPU (`text_poke_bp`, three rounds of IPIs); on a node VM under QEMU's
//! multi-threaded TCG, a flip at a hold's start raced the prober's own `connect` on the other
//! vCPU and the guest kernel died (`Oops: int3` in `inet_sk_state_store`). Attached once, the
//! key flips at start like the exit and exec programs' do (docs/dev/design-notes.md).

use aya::Ebpf;
use aya::programs::trace_point::TracePointLinkId;
use valet_common::{KernelLayout, PROG_LISTEN, PROG_LISTEN_WALK};

use super::{AncestorMode, Programs};

/// Loads and attaches the listen program of the ancestor `mode`; returns its name and link.
pub(super) fn attach_listen(
    ebpf: &mut Ebpf,
    layout: &KernelLayout,
    mode: AncestorMode,
) -> std::result::Result<(&'static str, TracePointLinkId), String> {
    if layout.tp_sock_newstate == valet_common::OFFSET_UNKNOWN || layout.tp_sock_sport == valet_common::OFFSET_UNKNOWN {
        return Err("no sock/inet_sock_set_state tracepoint format (kernel before 4.16?)".into());
    }
    let prog = if mode == AncestorMode::Walk { PROG_LISTEN_WALK } else { PROG_LISTEN };
    let program = super::tracepoint(ebpf, prog).map_err(|e| e.chain().to_string())?;
    program.load().map_err(|e| format!("load {prog}: {e}"))?;
    let link = program.attach("sock", "inet_sock_set_state").map_err(|e| format!("attach {prog}: {e}"))?;
    Ok((prog, link))
}

impl Programs {
    /// The listen program, if the kernel took it (then it is attached).
    pub fn listen_program(&self) -> Option<&'static str> {
        self.attached().into_iter().find(|p| [PROG_LISTEN, PROG_LISTEN_WALK].contains(p))
    }
}
