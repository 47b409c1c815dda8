//! Watching the runtime's record of an app's end (effect `WatchRecord`): a native sidecar is quit
//! once the kubelet can no longer see the app running, which is once the runtime has recorded its
//! end ([`crate::runtime_record`]), or the API reports it, whichever comes first.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tokio::sync::mpsc;
use tracing::debug;

use super::PodFeedback;
use crate::effect::Feedback;
use crate::runtime_record::{Record, RecordDir, read_any};

/// The first pause between two reads of a record, grown by half each time up to the last.
const FIRST_PAUSE: Duration = Duration::from_millis(2);
const LAST_PAUSE: Duration = Duration::from_millis(20);
/// How long a record is watched: the API's report (about a second after the record) ends the
/// wait long before; a runtime that never records the end leaves the pod to it.
const WATCH_FOR: Duration = Duration::from_secs(120);

/// Watches container records, each on a task of its own, and reports an end as
/// [`Feedback::Recorded`].
pub(super) struct Records {
    host_proc: PathBuf,
    /// The record directories read first (the flag's, else the host root's well-known ones).
    fixed: Vec<RecordDir>,
    reports: mpsc::UnboundedSender<PodFeedback>,
}

impl Records {
    pub(super) fn new(
        host_proc: PathBuf,
        fixed: Vec<RecordDir>,
        reports: mpsc::UnboundedSender<PodFeedback>,
    ) -> Records {
        Records { host_proc, fixed, reports }
    }

    /// Watches container `id`'s record (pod `uid`'s) in the fixed directories, then in
    /// `reached` (through the runtime processes found).
    pub(super) fn watch(&self, uid: &str, id: String, reached: Vec<RecordDir>) {
        let mut dirs = self.fixed.clone();
        dirs.extend(reached);
        let (host_proc, reports, uid) = (self.host_proc.clone(), self.reports.clone(), uid.to_owned());
        tokio::spawn(async move {
            match watch(&host_proc, &dirs, &id, WATCH_FOR).await {
                Record::Ended => {
                    let _ = reports.send((uid, Feedback::Recorded { container_id: id }));
                }
                Record::Absent => {
                    debug!(%uid, container = %id, "no runtime record of the container: the API's report is awaited")
                }
                Record::NotEnded => {
                    debug!(%uid, container = %id, "the runtime did not record the container's end in time")
                }
            }
        });
    }
}

/// Reads container `id`'s record until it shows the end, `for_` at most. [`Record::Absent`]: no
/// directory has it (another runtime), or it went (the container was removed).
pub(super) async fn watch(host_proc: &Path, dirs: &[RecordDir], id: &str, for_: Duration) -> Record {
    let start = Instant::now();
    let mut pause = FIRST_PAUSE;
    loop {
        match read_any(host_proc, dirs, id) {
            Record::NotEnded => {}
            done => return done,
        }
        if start.elapsed() >= for_ {
            return Record::NotEnded;
        }
        tokio::time::sleep(pause).await;
        pause = (pause * 3 / 2).min(LAST_PAUSE);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "fedcba9876543210fedcba9876543210fedcba9876543210fedcba9876543210";

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("valet-record-watch-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join(ID)).expect("mkdir");
        dir
    }

    #[tokio::test]
    async fn the_end_is_reported_once_the_record_shows_it() {
        let dir = scratch("ends");
        let status = dir.join(ID).join("status");
        std::fs::write(&status, r#"{"Version":"v1","Pid":7,"FinishedAt":0}"#).expect("write");
        let (tx, mut rx) = mpsc::unbounded_channel();
        let records = Records::new("/proc".into(), vec![RecordDir { dir: dir.clone(), through: None }], tx);
        records.watch("pod-1", ID.to_owned(), Vec::new());
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(rx.try_recv().is_err(), "nothing recorded yet");
        // As containerd writes it: a new file renamed over the old.
        let tmp = dir.join(ID).join(".status-tmp");
        std::fs::write(&tmp, r#"{"Version":"v1","Pid":7,"FinishedAt":1764950003200000000,"ExitCode":0}"#)
            .expect("write");
        std::fs::rename(&tmp, &status).expect("rename");
        let (uid, fb) =
            tokio::time::timeout(Duration::from_secs(30), rx.recv()).await.expect("reported").expect("sent");
        assert_eq!(uid, "pod-1");
        assert!(matches!(fb, Feedback::Recorded { container_id } if container_id == ID));
    }

    #[tokio::test]
    async fn no_record_and_a_record_that_never_ends_report_nothing() {
        let dir = scratch("never");
        let dirs = [RecordDir { dir: dir.clone(), through: None }];
        let other = "1".repeat(64);
        assert_eq!(watch(Path::new("/proc"), &dirs, &other, Duration::from_secs(5)).await, Record::Absent);
        std::fs::write(dir.join(ID).join("status"), r#"{"FinishedAt":0}"#).expect("write");
        let waited = watch(Path::new("/proc"), &dirs, ID, Duration::from_millis(30)).await;
        assert_eq!(waited, Record::NotEnded);
    }
}
