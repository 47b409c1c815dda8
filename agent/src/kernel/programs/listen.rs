//! The listen program's life: loaded with the others, attached only while some pod holds an app
//! (and a while after), its links closed off the caller's thread.

use aya::Ebpf;
use aya::programs::TracePoint;
use aya::programs::trace_point::TracePointLink;
use tracing::{debug, warn};
use valet_common::{KernelLayout, PROG_LISTEN, PROG_LISTEN_WALK};

use super::{AncestorMode, Programs};

/// A thread that closes the links sent to it, one after the other, for as long as the sender
/// lives.
fn link_closer() -> Option<std::sync::mpsc::Sender<TracePointLink>> {
    let (tx, rx) = std::sync::mpsc::channel::<TracePointLink>();
    let spawned = std::thread::Builder::new().name("valet-unlink".into()).spawn(move || {
        for link in rx {
            drop(link);
        }
    });
    match spawned {
        Ok(_) => Some(tx),
        Err(e) => {
            warn!("no thread to close detached links (closed in place: the controller waits): {e}");
            None
        }
    }
}

/// Loads the listen program of the ancestor `mode`; returns its name.
pub(super) fn load_listen(
    ebpf: &mut Ebpf,
    layout: &KernelLayout,
    mode: AncestorMode,
) -> std::result::Result<&'static str, String> {
    if layout.tp_sock_newstate == valet_common::OFFSET_UNKNOWN || layout.tp_sock_sport == valet_common::OFFSET_UNKNOWN {
        return Err("no sock/inet_sock_set_state tracepoint format (kernel before 4.16?)".into());
    }
    let prog = if mode == AncestorMode::Walk { PROG_LISTEN_WALK } else { PROG_LISTEN };
    let program: &mut TracePoint = ebpf
        .program_mut(prog)
        .ok_or_else(|| format!("program {prog} missing from object"))?
        .try_into()
        .map_err(|e| format!("program {prog}: {e}"))?;
    program.load().map_err(|e| format!("load {prog}: {e}"))?;
    Ok(prog)
}

impl Programs {
    /// The listen program, if the kernel took it (attached or not).
    pub fn listen_program(&self) -> Option<&'static str> {
        self.listen
    }

    /// Attaches the listen program while some pod holds an app (`on`), and detaches it once none
    /// has for [`Programs::set_listen_linger`] (10 s): it runs on every TCP state change of the
    /// node (a loopback connect/accept/close loop ran about 5 % slower with it), a cost only worth
    /// paying while apps wait for their proxies. Detaching waits for an RCU grace period (50–80
    /// ms here): the link is closed on a thread of its own, never the caller's. Until that close
    /// is done the kernel refuses to attach the program again (the linger makes that rare); a
    /// refused attach is tried again at the next call, and meanwhile the probes' poll does.
    pub fn set_listen(&mut self, on: bool) {
        let Some(prog) = self.listen else { return };
        if on {
            self.listen_idle_since = None;
            if self.listen_link.is_some() {
                return;
            }
            let Some(Ok(program)) = self.ebpf.program_mut(prog).map(<&mut TracePoint>::try_from) else { return };
            match program.attach("sock", "inet_sock_set_state") {
                Ok(link) => self.listen_link = Some(link),
                Err(e) => debug!("attach {prog} (tried again at the next hold; the 10 ms probe meanwhile): {e}"),
            }
            return;
        }
        if self.listen_link.is_none() {
            return;
        }
        let since = *self.listen_idle_since.get_or_insert_with(std::time::Instant::now);
        if since.elapsed() >= self.listen_linger {
            self.unlink_listen();
        }
    }

    /// How long the listen program stays attached after the last hold (tests: zero).
    pub fn set_listen_linger(&mut self, linger: std::time::Duration) {
        self.listen_linger = linger;
    }

    /// Detaches the listen program now, closing its link on the closer thread.
    pub(super) fn unlink_listen(&mut self) {
        self.listen_idle_since = None;
        let (Some(prog), Some(link)) = (self.listen, self.listen_link.take()) else { return };
        let Some(Ok(program)) = self.ebpf.program_mut(prog).map(<&mut TracePoint>::try_from) else { return };
        match program.take_link(link) {
            Ok(owned) => {
                if self.closer.is_none() {
                    self.closer = link_closer();
                }
                // Without the closer thread, closed here (the wait included).
                if let Some(Err(std::sync::mpsc::SendError(owned))) = self.closer.as_ref().map(|c| c.send(owned)) {
                    drop(owned);
                }
            }
            Err(e) => warn!("detach {prog}: {e}"),
        }
    }
}
