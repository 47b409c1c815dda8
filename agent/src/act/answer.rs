//! A probed sidecar's answer, shared by the probe loops and the held pods' prober: what counts
//! as news, ready, and the words for it.

use std::time::Duration;

use crate::sidecar::http::Limits;

/// One probe's limits: a proxy that does not answer within half a second has not answered.
pub(super) const LIMITS: Limits = Limits {
    connect_timeout: Duration::from_millis(200),
    total_timeout: Duration::from_millis(500),
    max_response_bytes: 4096,
};

/// An unchanged answer is reported at most this often (a failed condition write is retried on
/// the next report).
pub(super) const REPEAT: Duration = Duration::from_secs(1);

/// A probed sidecar's answer: its status, or why there is none. Compared with the last one as
/// is; put in words only for news (the loop of a held pod runs every 10 ms).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) enum Answer {
    Status(u16),
    Failed(String),
}

/// Ready when every probed sidecar answers 2xx.
pub(super) fn all_ready(answers: &[Answer]) -> bool {
    answers.iter().all(|a| matches!(a, Answer::Status(s) if (200..300).contains(s)))
}

/// The answers of the sidecars `names` (in order) in words, for the state machine's log and
/// Events.
pub(super) fn detail<'a>(names: impl IntoIterator<Item = &'a str>, answers: &[Answer]) -> String {
    let words: Vec<String> = names
        .into_iter()
        .zip(answers)
        .map(|(name, a)| match a {
            Answer::Status(status) => format!("{name} answered {status}"),
            Answer::Failed(why) => format!("{name}: {why}"),
        })
        .collect();
    words.join("; ")
}
