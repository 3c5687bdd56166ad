//! A journal's files on this broker: its open spool and sealed local
//! fragments, and the seals asked of them.

use crate::outbox::Outbox;
use rotary_storage::fragment::LocalFragment;
use rotary_storage::spool::Spool;
use std::path::PathBuf;
use std::rc::Rc;
use std::time::{Duration, Instant, SystemTime};

/// The first wait before a seal that failed with an error that may pass
/// (an interrupted call, a lack of memory) is tried again; each failure in
/// a row doubles it, up to [`SEAL_RETRY_DELAY_MAX`].
pub const SEAL_RETRY_DELAY_MIN: Duration = Duration::from_millis(100);
/// The longest wait between two tries of a seal that keeps failing.
pub const SEAL_RETRY_DELAY_MAX: Duration = Duration::from_secs(10);

/// A seal that failed with an error that may pass: it is not tried again
/// before `at` (see `Shard::seal`).
#[derive(Clone, Debug)]
pub struct SealRetry {
    pub at: Instant,
    /// Failures in a row.
    pub failures: u32,
    /// The last failure, named in the refusals it causes.
    pub error: String,
}

/// The journal's local files.
///
/// Written by the flusher: staging writes appends into the spool and
/// answers seal requests when nothing is left to seal (`shard/stage.rs`);
/// its turn commits, rolls back, seals and reloads the spool, and adds
/// the sealed fragment (`shard/flusher.rs`, with the rollbacks of
/// `shard/replica.rs` and `shard/mod.rs`). Recovery (`shard/recover.rs`)
/// finds the files, and a takeover (`shard/primary.rs`) adds what it
/// copied from earlier brokers. Of the fragments, the history room
/// (`shard/history.rs`) marks them uploaded, prunes and lets them go, and
/// asks for seals (as do admin requests, `shard/lifecycle.rs`); a read
/// (`shard/read.rs`) marks one it finds damaged. `reads_in_flight` is
/// written by reads only.
pub struct Files {
    pub(crate) dir: PathBuf,
    /// Sealed local fragments, by begin.
    pub(crate) fragments: Vec<LocalFragment>,
    pub(crate) spool: Option<Spool>,
    /// The spool is out of `spool` while an operation on it awaits (a seal,
    /// or a reload of its tail): its bytes are in no file a read can
    /// locate until it is back, or sealed into `fragments`. Reads of them
    /// wait, and `committed` is notified when it ends.
    pub(crate) spool_out: bool,
    /// When the open spool took its first commit.
    pub(crate) spool_since: Option<SystemTime>,
    /// Reads of a local file (fragment or spool) in flight: while any is,
    /// no fragment file of the journal is reused as a spare spool.
    pub(crate) reads_in_flight: usize,
    pub(crate) seal_requested: bool,
    pub(crate) seal_waiters: Vec<(Rc<Outbox>, u64)>,
    /// Why the journal is parked: its disk failed for good (see the
    /// shard's `disk`). Appends are refused with it until a restart.
    pub(crate) disk_failed: Option<String>,
    /// The open spool, the one beginning at this offset, was read back
    /// after a failed seal and its bytes are not the ones acknowledged
    /// (why): reads of its span go to a store's copy or are refused,
    /// never served from its file.
    pub(crate) spool_changed: Option<(u64, String)>,
    /// The last seal failed with an error that may pass: the next waits.
    pub(crate) seal_retry: Option<SealRetry>,
}

impl Files {
    /// No files yet, in `dir`.
    pub fn new(dir: PathBuf) -> Files {
        Files {
            dir,
            fragments: Vec::new(),
            spool: None,
            spool_out: false,
            spool_since: None,
            reads_in_flight: 0,
            seal_requested: false,
            seal_waiters: Vec::new(),
            disk_failed: None,
            spool_changed: None,
            seal_retry: None,
        }
    }

    /// The failed seal whose retry is not yet due at `now`, if one is.
    pub fn seal_backoff(&self, now: Instant) -> Option<&SealRetry> {
        self.seal_retry.as_ref().filter(|r| now < r.at)
    }

    /// Notes a seal that failed with `error` (one that may pass) at `now`;
    /// returns how long until it is tried again.
    pub fn seal_failed(&mut self, now: Instant, error: String) -> Duration {
        let failures = self.seal_retry.as_ref().map_or(0, |r| r.failures) + 1;
        let delay = SEAL_RETRY_DELAY_MIN
            .saturating_mul(1 << (failures - 1).min(16))
            .min(SEAL_RETRY_DELAY_MAX);
        self.seal_retry = Some(SealRetry {
            at: now + delay,
            failures,
            error,
        });
        delay
    }
}
