//! A disk that failed for good under a journal: an I/O error that the
//! device or file system will not recover from (`rotary_proto::disk`).
//!
//! Retrying would fail the same way for ever, so the journal is parked:
//! its appends (queued now and sent later) are refused `DISK_FAILED`, which
//! clients do not retry here; it is no longer sealed, nor given a new
//! spool; reads of what it committed go on from its files. A failure of
//! the shard's commit log, which every journal of the shard writes, parks
//! them all. Each is logged once and counted (`disk_failed_journals`).
//! Only a restart, on a replaced disk, clears it.

use super::*;

impl Shard {
    /// Why appends to the journal are refused for a failed disk, if they
    /// are: its own, or the shard's commit log's.
    pub(super) fn disk_failure(&self, jm: &Journal) -> Option<String> {
        jm.files
            .disk_failed
            .clone()
            .or_else(|| self.log_disk_failed.borrow().clone())
    }

    /// Why the shard's commit log takes no more records, if its disk
    /// failed for good. A single node's DELETE is refused then: its record
    /// could not be written, and the journal's spec and files would go
    /// while the log still holds its head and registers, to come back at
    /// the next start.
    pub fn log_disk_failure(&self) -> Option<String> {
        self.log_disk_failed.borrow().clone()
    }

    /// Parks the journal if `e` is final; returns whether it is parked.
    pub(super) fn park_if_final(&self, jm: &mut Journal, e: &StorageError) -> bool {
        if e.is_retryable() {
            return jm.files.disk_failed.is_some();
        }
        self.park(jm, &e.to_string());
        true
    }

    /// Parks the journal for `why`, an error of its disk that nothing
    /// tried here again can mend (if it is not parked already).
    pub(super) fn park(&self, jm: &mut Journal, why: &str) {
        if jm.files.disk_failed.is_some() {
            return;
        }
        tracing::error!(journal = %jm.name, error = %why, "the disk failed for good under the journal: appends to it are refused DISK_FAILED until the disk is replaced and the broker restarted; what it committed can still be read");
        metrics::add(&self.metrics.disk_failed_journals, 1);
        jm.files.disk_failed = Some(format!(
            "the broker's disk failed for good under journal {:?} ({why}); nothing more is appended here until an operator replaces the disk and restarts the broker",
            jm.name
        ));
    }

    /// Parks every journal of the shard if `e`, an error of its commit
    /// log, is final.
    pub(super) fn park_shard_if_final(&self, e: &StorageError) {
        if e.is_retryable() || self.log_disk_failed.borrow().is_some() {
            return;
        }
        tracing::error!(error = %e, "the disk failed for good under the shard's commit log: appends to every journal of the shard are refused DISK_FAILED until the disk is replaced and the broker restarted; what they committed can still be read");
        metrics::add(
            &self.metrics.disk_failed_journals,
            self.journals.borrow().len() as u64,
        );
        *self.log_disk_failed.borrow_mut() = Some(format!(
            "the broker's disk failed for good under the shard's commit log ({e}); nothing more is appended here until an operator replaces the disk and restarts the broker"
        ));
        // What is queued is refused at the next turn.
        let queued: Vec<JournalRef> = self
            .journals
            .borrow()
            .values()
            .filter(|j| !j.borrow().queue.waiting.is_empty())
            .cloned()
            .collect();
        for j in &queued {
            self.mark_ready(j);
        }
    }

    /// Refuses everything queued on a parked journal; returns whether it
    /// is parked.
    pub(super) fn refuse_parked(&self, j: &JournalRef) -> bool {
        let Some(why) = self.disk_failure(&j.borrow()) else {
            return false;
        };
        // An append staging when the shard's commit log failed (another
        // journal's batch was written) is taken back out of the spool.
        let staging = {
            let jm = j.borrow();
            jm.queue.active.is_some() || !jm.queue.staged.is_empty()
        };
        if staging {
            self.fail_batch(j, Status::DISK_FAILED, &why);
        }
        if !j.borrow().queue.waiting.is_empty() {
            self.fail_queue(j, Status::DISK_FAILED, &why);
        }
        // A primary's SYNC is answered too: left waiting, every append the
        // primary takes would wait out its replica ack timeout instead.
        self.refuse_syncs(j, Status::DISK_FAILED, &why);
        // Nor is it sealed: those who asked are told why.
        let mut jm = j.borrow_mut();
        jm.files.seal_requested = false;
        for (outbox, id) in jm.files.seal_waiters.drain(..) {
            outbox.error(Op::ADMIN_REPLY, Status::DISK_FAILED, id, &[], &why);
        }
        true
    }
}
