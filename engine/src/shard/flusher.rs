//! The flusher: one turn prepares journals, stages their appends, writes
//! the commit log and the spools, and acknowledges what committed; seals.

use super::primary::propose;
use super::*;

/// A journal whose batch is being written while the next one is staged.
/// While the write is in flight, `other` holds the batch being written and
/// the journal's `staged` the next one; [`Held::swap_back`] trades them
/// once the write is done, leaving the next batch in `other`.
pub(super) struct Held {
    j: JournalRef,
    other: Vec<Staged>,
    other_with_replicas: bool,
}

impl Held {
    fn swap_back(&mut self) {
        let mut jm = self.j.borrow_mut();
        std::mem::swap(&mut jm.queue.staged, &mut self.other);
        std::mem::swap(
            &mut jm.queue.staged_with_replicas,
            &mut self.other_with_replicas,
        );
    }
}

/// What was staged during a turn's writes is the next turn's batch: back
/// into each journal's `staged`, and the journal around again.
fn requeue_held(held: Vec<Held>, again: &mut Vec<JournalRef>) {
    for h in held {
        let mut jm = h.j.borrow_mut();
        jm.queue.staged.extend(h.other);
        jm.queue.staged_with_replicas = h.other_with_replicas;
        drop(jm);
        again.push(h.j);
    }
}

/// A journal's spool write of a turn: the write (if bytes were staged),
/// its file and path, and whether to fdatasync it after.
type SpoolWrite = (
    JournalRef,
    Option<rotary_storage::spool::PendingWrite>,
    (Rc<compio::fs::File>, Rc<std::path::Path>),
    bool,
);

/// The outcome of a [`SpoolWrite`]: the write's, the write back, the sync's.
type WriteResult = (
    JournalRef,
    std::io::Result<()>,
    Option<rotary_storage::spool::PendingWrite>,
    Option<std::io::Result<()>>,
);

impl Shard {
    /// The flusher loop. Never returns.
    pub async fn flusher(self: Rc<Self>) {
        loop {
            let l = self.wake.listen();
            let has_log_records = self.log.borrow().as_ref().is_some_and(|l| l.has_pending());
            if self.ready.borrow().is_empty() && !has_log_records {
                let restating = !self.unrestated.borrow().is_empty();
                if !restating {
                    self.idle.notify(usize::MAX);
                    l.await;
                    continue;
                }
                if self.restate_failed.get() {
                    // The log refused the restatements last time: try
                    // again after a while, or sooner with a batch.
                    self.idle.notify(usize::MAX);
                    let delay = std::pin::pin!(compio::time::sleep(RESTATE_RETRY_DELAY));
                    futures_util::future::select(l, delay).await;
                }
            } else {
                drop(l);
            }
            self.busy.set(true);
            self.turn().await;
            self.busy.set(false);
        }
    }

    pub(super) async fn turn(self: &Rc<Self>) {
        let started = crate::clock::now();
        let ready = self.take_ready();

        // 1. Prepare, every journal at once: seals, new spools and tail
        // loads are file operations that wait on the kernel, and journals
        // sealing at the same flush-interval boundary would otherwise wait
        // for each other's.
        join_all(ready.iter().map(|j| self.prepare(j))).await;
        // A journal deleted while it prepared commits nothing more.
        let ready = self.without_deleted(ready);
        let prepared = crate::clock::now();
        // 2. Stage.
        let mut again: Vec<JournalRef> = ready.iter().filter(|j| self.stage(j)).cloned().collect();
        let staged_at = crate::clock::now();
        // 3. Write every spool with staged bytes and this batch's commit-log
        // records, all at the same time; `fsync` spools and the log are
        // fdatasync'ed after their writes. A record can thus reach the disk
        // without its spool bytes; recovery checks each journal's last record
        // against the spool's SHA-1 and falls back to the record before it.
        let committing: Vec<JournalRef> = ready
            .iter()
            .filter(|j| !j.borrow().queue.staged.is_empty())
            .cloned()
            .collect();
        // Restatements still owed go first: a journal's next record must
        // not reach the log without the one that takes back its failed
        // batch, or recovery could fall back onto that batch's record.
        let restated = self.record_restatements();
        let early = self.record_commits(&committing);
        let writing = Self::take_writes(&ready);
        let wrote = writing.iter().any(|(_, w, _, _)| w.is_some());
        // The log's records go first, into the page cache. Batches whose
        // records carry their bytes (or whose bytes are already on disk)
        // are answered now; their replies and proposals are sent before
        // the spool writes are submitted.
        let log_written = self.write_log();
        // Without their records nothing is answered early; the batch fails.
        let early: Vec<JournalRef> = if log_written.is_ok() {
            // One whose lease lapsed is answered by `commit_batches`.
            early
                .into_iter()
                .filter(|j| !self.lease_lapsed(j))
                .collect()
        } else {
            Vec::new()
        };
        let early_waits: HashMap<_, _> = early
            .iter()
            .filter_map(|j| Some((Rc::as_ptr(j), self.answer_early(j)?)))
            .collect();
        // Replicas get this turn's content (and early proposals, in the
        // same send) while the spools are written.
        self.flush_pipelines();
        if !early.is_empty() {
            yield_now().await;
        }
        let mut held = Vec::new();
        let sync_log = !restated.is_empty();
        let (results, log_result) = self
            .write_spools(writing, log_written, sync_log, &mut held)
            .await;
        self.restatements_written(&restated, log_result.is_ok());
        let written = crate::clock::now();
        self.settle_writes(results, &log_result, &committing, &early, wrote, &mut held);
        let committing = self.restate_failed(committing);
        self.commit_batches(&committing, &early, early_waits);
        self.flush_pipelines();
        requeue_held(held, &mut again);
        let acked = crate::clock::now();
        self.compact_log().await;
        note_slow_turn(
            &self.metrics,
            ready.len(),
            [started, prepared, staged_at, written, acked],
        );
        // Replica journals with a SYNC waiting go around again once their
        // queued appends are through.
        for j in &ready {
            if !j.borrow().replica.sync_waiters.is_empty() {
                again.push(j.clone());
            }
        }
        // Journals with more to do go around again, after other tasks
        // (readers, the acker, connections) had a turn.
        if !again.is_empty() {
            yield_now().await;
        }
        for j in again {
            self.ready.borrow_mut().push(j);
        }
    }

    /// Restates the journals of `committing` whose batch failed (nothing
    /// of it is left staged): the log may hold a record naming bytes that
    /// are not on disk. Returns the others, whose batches commit.
    fn restate_failed(&self, committing: Vec<JournalRef>) -> Vec<JournalRef> {
        let (failed, ok): (Vec<_>, Vec<_>) = committing
            .into_iter()
            .partition(|j| j.borrow().queue.staged.is_empty());
        failed.iter().for_each(|j| self.restate(j));
        ok
    }

    /// The journals marked ready since the last turn, each once, in the
    /// order they came, without the deleted ones.
    fn take_ready(&self) -> Vec<JournalRef> {
        let mut ready = std::mem::take(&mut *self.ready.borrow_mut());
        // Dedup by identity, keeping first-come order.
        let mut seen = std::collections::HashSet::new();
        ready.retain(|j| seen.insert(Rc::as_ptr(j)));
        self.without_deleted(ready)
    }

    /// `journals` without the deleted ones. The appends a deleted journal
    /// has staged and not committed (a batch staged while the one before
    /// it was written) are refused here: no commit record of a journal
    /// may follow its deletion, and `Shard::drop_journal` answered only
    /// its queued appends and the open one.
    fn without_deleted(&self, mut journals: Vec<JournalRef>) -> Vec<JournalRef> {
        journals.retain(|j| {
            let (deleted, staged) = {
                let jm = j.borrow();
                (jm.deleted, !jm.queue.staged.is_empty())
            };
            if deleted && staged {
                self.fail_batch(j, Status::JOURNAL_NOT_FOUND, "journal was deleted");
            }
            !deleted
        });
        journals
    }

    /// Step 6 of a turn: acknowledges the batches written this turn, or proposes them to
    /// the replicas and lets the acker acknowledge once every replica has.
    /// `early`: the journals answered from the commit log, with what
    /// their early proposals wait for.
    fn commit_batches(
        self: &Rc<Self>,
        committing: &[JournalRef],
        early: &[JournalRef],
        mut early_waits: HashMap<*const RefCell<Journal>, Vec<Wait>>,
    ) {
        let is_early = |j: &JournalRef| early.iter().any(|x| Rc::ptr_eq(x, j));
        for j in committing {
            let (staged_with_replicas, repl_now) = {
                let jm = j.borrow();
                (jm.queue.staged_with_replicas, jm.primary.repl.is_some())
            };
            let start = j
                .borrow()
                .files
                .spool
                .as_ref()
                .expect("spool")
                .committed_point();
            if !staged_with_replicas {
                if is_early(j) {
                    // Answered and counted when its record was written.
                    let staged = self.commit_local(j);
                    self.publish_counted(j, staged);
                } else if self.lease_lapsed(j) {
                    let staged = self.commit_local(j);
                    let f = Failure::new(
                        Status::NOT_JOURNAL_PRIMARY_BROKER,
                        "the broker's etcd lease may have expired before the append committed; it was taken back",
                    );
                    self.refuse_unconfirmed(j, start, staged, &f);
                } else {
                    self.acknowledge(j);
                }
                continue;
            }
            if !repl_now {
                // The pipelines broke while this batch was written: it
                // is committed here, but no replica will confirm it, so
                // it is taken back.
                let staged = self.commit_local(j);
                let f = Failure::new(
                    Status::REPLICATION_FAILED,
                    "the replication pipeline broke before the append was proposed; it was taken back",
                );
                self.refuse_unconfirmed(j, start, staged, &f);
                continue;
            }
            // Proposed already if the batch was answered from the log.
            let early = early_waits.remove(&Rc::as_ptr(j));
            let staged = self.commit_local(j);
            let mut jm = j.borrow_mut();
            let waits = early.unwrap_or_else(|| propose(&jm, &staged));
            jm.primary.inflight += 1;
            jm.primary.proposed.push_back(InFlight {
                start,
                staged,
                waits,
            });
            let start_acker = !std::mem::replace(&mut jm.primary.acking, true);
            drop(jm);
            self.proposals.set(self.proposals.get() + 1);
            self.proposed.notify(usize::MAX);
            if start_acker {
                self.awaiting_acks.set(self.awaiting_acks.get() + 1);
                compio::runtime::spawn(self.clone().acker(j.clone())).detach();
            }
        }
    }

    /// Compaction between turns keeps the log short. Its snapshot is
    /// written and synced in the background while turns go on; only the
    /// switch to the new file happens here.
    async fn compact_log(&self) {
        if self.log_disk_failed.borrow().is_some() {
            return;
        }
        let (begin, finish) = self.log.borrow().as_ref().map_or((false, false), |l| {
            let idle = !l.has_pending();
            (idle && l.needs_compaction(), idle && l.compaction_ready())
        });
        if begin {
            let states = self.states.borrow();
            if let Some(log) = self.log.borrow_mut().as_mut() {
                log.begin_compaction(states.iter().map(|(k, v)| (k.as_str(), v)));
            }
        } else if finish {
            let mut log = self.log.borrow_mut().take().expect("commit log present");
            match log.finish_compaction().await {
                // The old log's blocks are freed at its last close: the
                // reaper's, not this thread's (with `discard`, 13-22 ms for
                // 64 MiB on the test machine).
                Ok(old) => crate::reaper::close_later(old.into_iter().collect()),
                Err(e) => {
                    if let Some(held) = self.log_compaction_failed.due() {
                        tracing::error!(error = %e, since_last_logged = held, "commit log compaction failed (logged once a minute while it lasts)");
                    }
                }
            }
            self.put_log_back(log);
        }
    }

    /// Puts the commit log back after an await it was taken out for, and
    /// wakes who waits for it.
    fn put_log_back(&self, log: CommitLog) {
        *self.log.borrow_mut() = Some(log);
        self.log_back.notify(usize::MAX);
    }

    /// Takes the results of a turn's writes: failed spool writes and a
    /// failed commit-log write or sync fail their batches.
    fn settle_writes(
        &self,
        results: Vec<WriteResult>,
        log_result: &Result<(), StorageError>,
        committing: &[JournalRef],
        early: &[JournalRef],
        wrote: bool,
        held: &mut Vec<Held>,
    ) {
        let is_early = |j: &JournalRef| early.iter().any(|x| Rc::ptr_eq(x, j));
        // A failed batch fails the one staged after it too.
        let fail_batch = |j: &JournalRef, status: Status, msg: &str, held: &mut Vec<Held>| {
            if let Some(i) = held.iter().position(|h| Rc::ptr_eq(&h.j, j)) {
                let h = held.swap_remove(i);
                j.borrow_mut().queue.staged.extend(h.other);
            }
            // Before the refusal: the batch's record may be in the log.
            self.cut_back(j);
            self.fail_batch(j, status, msg);
        };
        let mut failed: Vec<(JournalRef, Status, String, StorageError)> = Vec::new();
        for (j, res, w, synced) in results {
            let path = j
                .borrow()
                .files
                .spool
                .as_ref()
                .map(|s| s.path().to_path_buf())
                .unwrap_or_default();
            if let Some(w) = w {
                metrics::add(&self.metrics.batch_write_bytes, w.bytes() as u64);
                j.borrow_mut()
                    .files
                    .spool
                    .as_mut()
                    .expect("spool written")
                    .write_done(w, res.is_ok());
            }
            if synced.is_some() {
                metrics::add(&self.metrics.fsyncs, 1);
            }
            if let Err(e) = res.and(synced.unwrap_or(Ok(()))) {
                let e = StorageError::io(&path, e);
                if is_early(&j) {
                    // Answered already: the bytes are in the commit log
                    // only, and the spool cannot take them. Recovery writes
                    // them from the log into the spool.
                    tracing::error!(error = %e, "spool write of an answered batch failed; stopping so recovery restores it from the commit log");
                    std::process::abort();
                }
                failed.push((j, storage_status(&e), e.to_string(), e));
            }
        }
        if wrote {
            metrics::add(&self.metrics.batches, 1);
        }
        for (j, status, msg, e) in &failed {
            fail_batch(j, *status, msg, held);
            // A disk that failed for good is not written again; what
            // is queued behind is refused at the next turn.
            if self.park_if_final(&mut j.borrow_mut(), e) {
                self.mark_ready(j);
            }
        }
        if let Err(e) = &log_result {
            if !e.is_retryable() {
                self.park_shard_if_final(e);
            } else if let Some(held) = self.log_write_failed.due() {
                tracing::error!(error = %e, since_last_logged = held, "commit log write failed; failing the batch (logged once a minute while it lasts)");
            }
            let status = storage_status(e);
            for j in committing {
                // Batches answered early had their records written; only
                // the fdatasync for `fsync` journals failed.
                if !j.borrow().queue.staged.is_empty() && !is_early(j) {
                    fail_batch(j, status, &e.to_string(), held);
                }
            }
        }
    }

    /// Takes every spool write staged this turn, and which spools (of
    /// `fsync` journals with a batch) are to be synced after it.
    fn take_writes(ready: &[JournalRef]) -> Vec<SpoolWrite> {
        let mut writing = Vec::new();
        for j in ready {
            let mut jm = j.borrow_mut();
            let fsync = jm.spec.durability == Durability::Fsync && !jm.queue.staged.is_empty();
            let Some(spool) = jm.files.spool.as_mut() else {
                continue;
            };
            let file = (spool.file().clone(), spool.shared_path());
            let w = spool.take_write();
            if w.is_some() || fsync {
                writing.push((j.clone(), w, file, fsync));
            }
        }
        writing
    }

    /// Writes the turn's spools and syncs them (and the commit log, if an
    /// `fsync` journal wrote), staging meanwhile the next batch of the
    /// journals being written (see [`Shard::stage_while`]).
    async fn write_spools(
        &self,
        writing: Vec<SpoolWrite>,
        log_written: Result<(), StorageError>,
        sync_log: bool,
        held: &mut Vec<Held>,
    ) -> (Vec<WriteResult>, Result<(), StorageError>) {
        let any_fsync = sync_log || writing.iter().any(|(_, _, _, fsync)| *fsync);
        let in_flight: Vec<JournalRef> = writing
            .iter()
            .filter(|(_, w, _, _)| w.is_some())
            .map(|(j, _, _, _)| j.clone())
            .collect();
        let spool_writes = join_all(writing.into_iter().map(
            |(j, w, (file, path), fsync)| async move {
                let mut res = Ok(());
                let w = match w {
                    Some(w) => {
                        let (r, w) = w.run(&file).await;
                        res = r;
                        Some(w)
                    }
                    None => None,
                };
                let synced = if res.is_ok() && fsync {
                    Some(rotary_storage::spool::sync_data(&file, &path).await)
                } else {
                    None
                };
                (j, res, w, synced)
            },
        ));
        let log_sync = async {
            if !any_fsync || log_written.is_err() {
                return log_written;
            }
            // The log is taken out for the sync so no borrow spans the await.
            let mut log = self.log.borrow_mut().take().expect("commit log present");
            let res = log.flush(true).await;
            self.put_log_back(log);
            res
        };
        // The next batch of the journals being written is staged while
        // they are: hashing it and waiting on the disk overlap.
        let (results, log_result) = self
            .stage_while(&in_flight, held, async {
                futures_util::join!(spool_writes, log_sync)
            })
            .await;
        for h in held.iter_mut() {
            h.swap_back();
        }
        (results, log_result)
    }

    /// Runs `work` (a turn's writes), staging meanwhile what arrives for
    /// `journals` (those being written) into their spools' second buffers.
    /// A journal's batch being written is set aside in `held` the first
    /// time, so that `staged` collects the next batch.
    pub(super) async fn stage_while<T>(
        &self,
        journals: &[JournalRef],
        held: &mut Vec<Held>,
        work: impl std::future::Future<Output = T>,
    ) -> T {
        if journals.is_empty() {
            return work.await;
        }
        let mut work = std::pin::pin!(work);
        // Submit the writes first: poll them once and let the runtime hand
        // them to the kernel.
        if let std::task::Poll::Ready(out) = futures_util::poll!(work.as_mut()) {
            return out;
        }
        yield_now().await;
        loop {
            let wake = self.wake.listen();
            let mut staged = false;
            for j in journals {
                let has_bytes = {
                    let jm = j.borrow();
                    !jm.deleted
                        && jm.files.spool.as_ref().is_some_and(|s| s.room() > 0)
                        && jm
                            .queue
                            .active
                            .as_ref()
                            .map(|a| &a.op)
                            .or(jm.queue.waiting.front())
                            .is_some_and(|op| !op.chunks.borrow().is_empty())
                };
                if !has_bytes {
                    continue;
                }
                if !held.iter().any(|h| Rc::ptr_eq(&h.j, j)) {
                    let mut jm = j.borrow_mut();
                    held.push(Held {
                        j: j.clone(),
                        other: std::mem::take(&mut jm.queue.staged),
                        other_with_replicas: jm.queue.staged_with_replicas,
                    });
                }
                let before = j.borrow().files.spool.as_ref().map_or(0, |s| s.staged());
                self.stage_queue(j);
                let after = j.borrow().files.spool.as_ref().map_or(0, |s| s.staged());
                metrics::add(&self.metrics.prestaged_bytes, after.saturating_sub(before));
                staged = true;
            }
            if staged {
                self.flush_pipelines();
            }
            match futures_util::future::select(work.as_mut(), wake).await {
                futures_util::future::Either::Left((out, _)) => return out,
                futures_util::future::Either::Right(_) => {}
            }
        }
    }

    /// Adds a commit-log record for each journal's staged appends (none
    /// for a batch of pulses, which change nothing the log holds). Returns
    /// the journals whose batch can be answered once the log is written:
    /// `replicated` ones whose new bytes are few enough for the record to
    /// carry them (or are on disk already).
    pub(super) fn record_commits(&self, committing: &[JournalRef]) -> Vec<JournalRef> {
        let mut log = self.log.borrow_mut();
        let log = log.as_mut().expect("commit log present");
        let mut states = self.states.borrow_mut();
        let mut early = Vec::new();
        let new_bytes: u64 = committing
            .iter()
            .map(|j| {
                let jm = j.borrow();
                let end = jm.queue.staged.last().expect("non-empty").end;
                end.saturating_sub(jm.files.spool.as_ref().expect("spool").written())
            })
            .sum();
        let carry_max = if new_bytes <= INLINE_TURN_BYTES_MAX {
            INLINE_BYTES_MAX
        } else {
            0
        };
        for j in committing {
            let jm = j.borrow();
            // Its delete record may be in the log already: `turn` leaves
            // deleted journals out before they stage.
            assert!(
                !jm.deleted,
                "journal {}: a commit record after its deletion",
                jm.name
            );
            let last = jm.queue.staged.last().expect("non-empty");
            let spool = jm.files.spool.as_ref().expect("spool");
            if last.end == spool.committed() && last.registers == *jm.heads.local_registers() {
                continue;
            }
            let st = JournalState {
                spool_begin: spool.begin(),
                end: last.end,
                sha1: last.point.sha.clone().finalize(),
                registers: last.registers.clone(),
                mid: Some(spool.committed_midstate()),
            };
            let from = spool.written();
            let carried = (jm.spec.durability == Durability::Replicated)
                .then(|| match last.end.checked_sub(from) {
                    None | Some(0) => Some(None),
                    Some(n) if n <= carry_max => {
                        spool.staged_since(from).map(|b| Some(&b[..n as usize]))
                    }
                    Some(_) => None,
                })
                .flatten();
            match carried {
                Some(Some(bytes)) => log.record_commit_inline(&jm.name, &st, from, bytes),
                _ => log.record_commit(&jm.name, &st),
            }
            if carried.is_some() {
                early.push(j.clone());
            }
            states.insert(jm.name.clone(), st);
        }
        early
    }

    /// Writes the log's pending records into the page cache. A failed
    /// write leaves none pending: the batch fails.
    pub(super) fn write_log(&self) -> Result<(), StorageError> {
        let mut log = self.log.borrow_mut();
        let log = log.as_mut().expect("commit log present");
        if self.log_disk_failed.borrow().is_some() {
            // Its disk failed for good: nothing is staged, and the records
            // left (restating what failed) are not written to it again.
            log.discard_pending();
            return Ok(());
        }
        let res = log.write_pending();
        if res.is_err() {
            log.discard_pending();
        }
        res
    }

    /// Answers a batch whose commit record is written while its spool
    /// write has yet to complete (the record carries the bytes, or they
    /// are on disk). A replica's appends are acknowledged to the primary;
    /// a client's get their replies; a primary's are proposed to its
    /// replicas, and the waits for their acks are returned.
    pub(super) fn answer_early(&self, j: &JournalRef) -> Option<Vec<Wait>> {
        let mut jm = j.borrow_mut();
        let last = jm.queue.staged.last().expect("non-empty").end;
        if jm.queue.staged_with_replicas {
            return jm
                .primary
                .repl
                .is_some()
                .then(|| propose(&jm, &jm.queue.staged));
        }
        self.count_appends(&jm.queue.staged, false, jm.spec.durability);
        jm.queue.staged.iter().for_each(answer_ok);
        jm.answered_to(last);
        None
    }

    /// Cuts a journal's spool file back to its committed bytes after its
    /// batch failed (`Spool::cut_back`): the batch's commit record may be
    /// in the log already, and should its restatement ([`Shard::restate`])
    /// never be written (the log failed for good, or a crash came first),
    /// a restart must still not find the refused bytes in the spool.
    fn cut_back(&self, j: &JournalRef) {
        let mut jm = j.borrow_mut();
        let Some(spool) = jm.files.spool.as_mut() else {
            return;
        };
        if let Err(e) = spool.cut_back() {
            tracing::error!(journal = %jm.name, error = %e, "cutting a spool back to its committed bytes after a failed batch; a restart may serve the batch if the commit log cannot restate the journal either");
            self.park_if_final(&mut jm, &e);
        }
    }

    /// Owes the commit log a record of what a journal's spool holds
    /// committed, after a batch of it failed: the log may hold a record of
    /// that batch (written, even synced, with its spool bytes), which a
    /// restart would otherwise serve, bringing back an append its client
    /// was told committed nothing (PROTOCOL §6.4). The in-memory state
    /// goes back at once; the record is written by the next turn, ahead of
    /// any later record of the journal, and written again by each turn
    /// (and at a clean stop) until a write of it succeeds, so that neither
    /// a failed log write nor the journal's next record loses it.
    ///
    /// A journal deleted meanwhile (its batch failed while in flight) is
    /// not restated: what the log owes it is its delete record
    /// (`Shard::drop_journal`), and its state must not come back, where a
    /// journal created again under its name would take it for its own and
    /// a later restatement would put it in the log after the deletion.
    pub(super) fn restate(&self, j: &JournalRef) {
        let jm = j.borrow();
        if jm.deleted {
            return;
        }
        let Some(spool) = &jm.files.spool else { return };
        let st = JournalState {
            spool_begin: spool.begin(),
            end: spool.committed(),
            sha1: spool.committed_sha1(),
            registers: jm.heads.local_registers().clone(),
            mid: Some(spool.committed_midstate()),
        };
        self.states.borrow_mut().insert(jm.name.clone(), st);
        self.unrestated.borrow_mut().insert(jm.name.clone());
    }

    /// Records the restatements still owed (see [`Shard::restate`]), each
    /// the journal's state as the shard holds it: nothing committed to it
    /// since, as nothing commits without a log write that carries its
    /// restatement too. A journal deleted since (none in `states`) gets
    /// its delete record. Returns the journals restated.
    pub(super) fn record_restatements(&self) -> Vec<String> {
        let names: Vec<String> = self.unrestated.borrow().iter().cloned().collect();
        if names.is_empty() {
            return names;
        }
        let states = self.states.borrow();
        let mut log = self.log.borrow_mut();
        let log = log.as_mut().expect("commit log present");
        for name in &names {
            match states.get(name) {
                Some(st) => log.record_commit(name, st),
                // Deleted (and not committed to since, if created again).
                None => log.record_delete(name),
            }
        }
        names
    }

    /// Settles the restatements of `restated` after their log write (and
    /// fdatasync): once it succeeded they are owed no more; if it failed,
    /// the next is tried after [`RESTATE_RETRY_DELAY`]. A log whose disk
    /// failed for good takes no more records: nothing is owed to it.
    pub(super) fn restatements_written(&self, restated: &[String], ok: bool) {
        if self.log_disk_failed.borrow().is_some() {
            self.unrestated.borrow_mut().clear();
            self.restate_failed.set(false);
            return;
        }
        if restated.is_empty() {
            return;
        }
        if ok {
            let mut owed = self.unrestated.borrow_mut();
            for name in restated {
                owed.remove(name);
            }
        }
        self.restate_failed.set(!ok);
    }

    /// At a clean stop: writes the restatements still owed (into the page
    /// cache, as a turn does), so that a stop right after a failed batch
    /// does not leave its record standing.
    pub fn write_restatements(&self) {
        let restated = self.record_restatements();
        if restated.is_empty() {
            return;
        }
        let res = self.write_log();
        if let Err(e) = &res {
            tracing::error!(error = %e, journals = restated.len(), "writing what journals hold after failed batches to the commit log failed at stop: the restart may serve those batches");
        }
        self.restatements_written(&restated, res.is_ok());
    }

    /// A SYNC from the primary ends any append it left open. A broker
    /// no longer a replica of the journal (the route changed) drops all
    /// the appends of its old primary not yet committed here, whole or
    /// not: their bytes must not stay in a spool it is about to seal or
    /// append to as the primary. Either way the primary that sent them
    /// hears so at once, unless it rolled them back itself (or gave
    /// them up by synchronizing again on their connection).
    fn supersede_replica_appends(&self, j: &JournalRef) {
        {
            let mut jm = j.borrow_mut();
            let replica_ops = !jm.replica.awaiting.is_empty()
                || jm
                    .queue
                    .active
                    .as_ref()
                    .is_some_and(|a| a.op.replica.is_some());
            let left = replica_ops && !matches!(self.role(&jm.spec), Role::Replica(_));
            if left {
                // Whatever the old primary sends next is refused until a
                // primary synchronizes the journal again.
                if let Some(t) = jm.replica.track.as_mut() {
                    t.diverged();
                }
            }
            if !jm.replica.sync_waiters.is_empty() || left {
                let open = jm
                    .queue
                    .waiting
                    .iter()
                    .chain(jm.queue.active.as_ref().map(|a| &a.op))
                    .chain(jm.replica.awaiting.iter().map(|w| &w.op))
                    .filter(|op| op.replica.is_some() && (left || !op.complete.get()));
                for op in open {
                    if op.aborted.get().is_none() {
                        op.aborted.set(Some(AbortReason::Superseded));
                    }
                }
            }
        }
    }

    /// A replica append rolled back by its primary (or whose connection
    /// closed) drops it and everything staged after it.
    fn drop_rolled_back(j: &JournalRef) {
        {
            let mut jm = j.borrow_mut();
            let jm = &mut *jm;
            if let Some(i) = jm
                .replica
                .awaiting
                .iter()
                .position(|w| w.op.aborted.get().is_some())
            {
                let start = jm.replica.awaiting[i].start.clone();
                let r = AppendReply {
                    write_head: jm.heads.head(),
                    ..Default::default()
                };
                for w in jm.replica.awaiting.drain(i..) {
                    w.op.end_aborted(&r);
                }
                rewind_replica_to(jm, start, |op| op.end_aborted(&r));
            }
        }
    }

    /// An aborted active append rewinds the spool to where it began.
    fn rewind_aborted(&self, j: &JournalRef) {
        {
            let mut jm = j.borrow_mut();
            let aborted = jm
                .queue
                .active
                .as_ref()
                .is_some_and(|a| a.op.aborted.get().is_some());
            if aborted {
                let a = abandon_active(&mut jm).expect("checked");
                let reply = rolled_back_reply(&jm);
                a.op.end_aborted(&reply);
                drop_budget(&a.op);
                metrics::add(&self.metrics.append_failures, 1);
            }
        }
    }

    /// Settles the journal's replication for `role`: fails its queue when
    /// its route is short of brokers, starts a SYNC when its replicas must
    /// be asked (again), or forgets a stale one. False: nothing more to
    /// prepare this turn.
    async fn settle_replication(&self, j: &JournalRef, role: &Role) -> bool {
        let takeover = match role {
            Role::Primary(route) => self.takeover_due(j, route),
            _ => false,
        };
        match role {
            Role::Primary(route) if !route.is_complete() => {
                let msg = route.incomplete_message();
                self.fail_queue(j, Status::INSUFFICIENT_JOURNAL_BROKERS, &msg);
                return false;
            }
            Role::Primary(route) if route.members.len() > 1 || takeover => {
                // Synchronized in this very view: after any change of the
                // cluster file the journal may have had another primary
                // meanwhile (a route that went away and came back is the
                // same list of members), so the replicas are asked again.
                let version = self.topology.version();
                let ready = !takeover
                    && j.borrow().primary.repl.as_ref().is_some_and(|r| {
                        r.members == route.ids() && r.version == version && r.is_live()
                    });
                if !ready {
                    self.begin_sync(j, route.clone()).await;
                    return false;
                }
            }
            Role::Primary(_) => j.borrow_mut().primary.repl = None,
            Role::Replica(_) | Role::Outside(_) => {
                // No longer the primary: what it synchronized as one is
                // stale (its batches in flight keep their own pipelines).
                j.borrow_mut().primary.repl = None;
            }
        }
        true
    }

    /// Whether a fragment sealed now is held back from upload: sealed by
    /// a broker the journal's route left, from a spool its primary's
    /// appends wrote last (see
    /// [`rotary_storage::fragment::LocalFragment::held`]). Its tail may be
    /// bytes the primary took back; stored, they would contradict the
    /// journal's history.
    fn holds_back(&self, jm: &Journal) -> bool {
        jm.replica.wrote_spool && matches!(self.role(&jm.spec), Role::Outside(_))
    }

    /// Reloads the spool's tail block after a rollback past written bytes.
    /// False: that failed, and the queue with it.
    async fn reload_tail(&self, j: &JournalRef) -> bool {
        let needs_tail = j
            .borrow()
            .files
            .spool
            .as_ref()
            .is_some_and(|s| !s.can_stage() && !s.write_in_flight());
        if needs_tail {
            let mut spool = j.borrow_mut().files.spool.take().expect("checked");
            j.borrow_mut().files.spool_out = true;
            let res = spool.load_tail().await;
            {
                let mut jm = j.borrow_mut();
                jm.files.spool = Some(spool);
                jm.spool_back();
            }
            if let Err(e) = res {
                if !self.park_if_final(&mut j.borrow_mut(), &e) {
                    tracing::error!(journal = %j.borrow().name, error = %e, "reloading spool tail failed");
                }
                self.fail_queue(j, storage_status(&e), &e.to_string());
                return false;
            }
        }
        true
    }

    /// Opens a spool for a journal with appends queued and none open.
    async fn open_spool(&self, j: &JournalRef) {
        let needs_spool = {
            let jm = j.borrow();
            jm.files.spool.is_none() && !jm.queue.waiting.is_empty()
        };
        if needs_spool {
            let (dir, head, length) = {
                let jm = j.borrow();
                (
                    jm.files.dir.clone(),
                    jm.heads.local_head(),
                    jm.spec.fragment.length,
                )
            };
            let created = match std::fs::create_dir_all(&dir) {
                Ok(()) => self.create_spool(&dir, head, length).await,
                Err(e) => Err(StorageError::io(&dir, e)),
            };
            match created {
                Ok(spool) => j.borrow_mut().files.spool = Some(spool),
                Err(e) => {
                    if e.is_full() {
                        metrics::add(&self.metrics.storage_full, 1);
                    }
                    self.park_if_final(&mut j.borrow_mut(), &e);
                    self.fail_queue(j, storage_status(&e), &e.to_string());
                }
            }
        }
    }

    /// Async preparation of a journal before staging: handle an aborted
    /// active append, reload a tail block, seal, open a spool.
    pub(super) async fn prepare(&self, j: &JournalRef) {
        self.supersede_replica_appends(j);
        Self::drop_rolled_back(j);
        self.rewind_aborted(j);
        // Appends cut off before they started are gone before the seal and
        // the spool are decided on: a queue of nothing else would open a
        // spool (`open_spool`) that staging then finds nothing to put in,
        // and a SEAL asked for meanwhile, of a journal that had no spool,
        // would wait for a turn that nothing readies the journal for.
        super::stage::drop_dead_front(&mut j.borrow_mut());
        // Before anything seals, syncs or answers a SYNC.
        self.take_back_unconfirmed(j);
        if self.refuse_parked(j) {
            // Its disk failed for good: no seal, no new spool, and a SYNC
            // is refused (DISK_FAILED), never applied.
            return;
        }
        let role = self.role(&j.borrow().spec);
        if !self.settle_replication(j, &role).await {
            return;
        }
        self.apply_syncs(j).await;
        if !self.reload_tail(j).await {
            return;
        }
        let reset = {
            let jm = j.borrow();
            (!jm.index.reset_waiters.is_empty() || jm.index.reset_pending)
                && jm.queue.active.is_none()
                && jm.queue.staged.is_empty()
        };
        if reset {
            self.reset_head(j).await;
        }
        if self.refuse_seals_backing_off(j) {
            // Its last seal failed a moment ago: not tried again yet.
            self.open_spool(j).await;
            return;
        }
        let wants_seal = {
            let jm = j.borrow();
            let idle =
                jm.queue.active.is_none() && jm.queue.staged.is_empty() && jm.primary.inflight == 0;
            // Replicas seal when their primary says so (SYNC), and a
            // primary not while replicas have yet to ack. A broker the
            // journal was routed away from seals what it holds, so that it
            // can be uploaded: the new members may never have had it.
            idle && match role {
                Role::Primary(_) => jm.wants_seal(crate::clock::wall()),
                Role::Outside(_) => jm.files.spool.as_ref().is_some_and(|s| !s.is_empty()),
                Role::Replica(_) => false,
            }
        };
        if wants_seal {
            self.seal(j).await;
        }
        self.open_spool(j).await;
    }

    /// A new spool at `head`: in a spare file if one fits the journal's
    /// fragment length, else a new file.
    pub(super) async fn create_spool(
        &self,
        dir: &std::path::Path,
        head: u64,
        fragment_length: u64,
    ) -> Result<Spool, StorageError> {
        let max_len = fragment_length.saturating_add(self.sizing.grow_bytes);
        let spare = self.spares.borrow_mut().take(max_len);
        if let Some(spare) = spare {
            match Spool::create_recycled(&spare, dir, head, self.sizing).await {
                Ok(spool) => {
                    metrics::add(&self.metrics.spools_recycled, 1);
                    return Ok(spool);
                }
                Err(e) => {
                    tracing::warn!(spare = %spare.display(), error = %e, "cannot begin a spool in a spare file; creating one");
                }
            }
        }
        Spool::create_sized(dir, head, self.sizing).await
    }

    pub(super) async fn seal(&self, j: &JournalRef) {
        if self.refuse_parked(j) {
            // A seal would fail the same way; the spool stays readable.
            return;
        }
        let (spool, durable) = {
            let mut jm = j.borrow_mut();
            let durable = jm.spec.durability == Durability::Fsync;
            (jm.files.spool.take(), durable)
        };
        let spool = match spool {
            Some(s) if s.is_empty() => {
                // Nothing to seal: its file is kept as a spare, or its name
                // removed here (the next spool may take it) and its
                // preallocated blocks freed by the reaper.
                let (path, len) = s.into_empty_file();
                if self.spares.borrow_mut().give(&path, len) {
                    metrics::add(&self.metrics.spares_kept, 1);
                } else if let Err(e) = crate::reaper::unlink_now_free_later(&path) {
                    tracing::warn!(path = %path.display(), error = %e, "cannot remove an empty spool");
                }
                None
            }
            other => other,
        };
        let mut sealed = None;
        if let Some(spool) = spool {
            let path = spool.path().to_path_buf();
            let begin = spool.begin();
            let acked = (spool.committed(), spool.committed_sha1());
            j.borrow_mut().files.spool_out = true;
            match spool.seal(durable).await {
                Ok(frag) => sealed = frag,
                Err(e) => return self.seal_not_made(j, &e, (path, begin), acked).await,
            }
        }
        let mut jm = j.borrow_mut();
        jm.files.seal_requested = false;
        jm.files.seal_retry = None;
        jm.files.spool_since = None;
        // Replicas must start their next spool where this one ended.
        jm.primary.repl = None;
        let json = match &sealed {
            Some(f) => fragment_json(f, jm.has_stores()),
            None => serde_json::Value::Null,
        };
        if let Some(mut f) = sealed {
            metrics::add(&self.metrics.fragments_sealed, 1);
            if self.holds_back(&jm) {
                f.held = true;
                tracing::info!(journal = %jm.name, begin = f.begin, end = f.end, "sealed what this broker held as a replica of a route it left; it is kept here, not uploaded");
            }
            if jm.has_stores() {
                // Count it against the spool budget now: the next append
                // must see it, not wait for an upload attempt to finish.
                self.unuploaded_bytes
                    .set(self.unuploaded_bytes.get() + (f.end - f.begin));
            }
            // Only the newest sealed fragment keeps its spool's open file
            // (tailing readers finish it); older ones are opened per read.
            // Else every fragment of a journal with small fragments holds a
            // descriptor, and tens of thousands exhaust the process's.
            if let Some(prev) = jm.files.fragments.last_mut() {
                prev.file = None;
            }
            jm.files.fragments.push(f);
        }
        if jm.has_stores() {
            self.queue_uploads(&mut jm);
        }
        if jm.files.spool_out {
            jm.spool_back();
        }
        let body = serde_json::to_vec(&serde_json::json!({ "sealed": json })).expect("json");
        for (outbox, id) in jm.files.seal_waiters.drain(..) {
            outbox.frame(Op::ADMIN_REPLY, Status::OK, id, &[], &body);
        }
    }

    /// After a seal of the spool at `path`, beginning at `begin`, failed
    /// with `e`: the spool file stays where it was, and recovery or the
    /// next seal picks it up. It is opened again to keep appending, or, if
    /// the disk failed for good, to keep serving reads of its bytes while
    /// the journal is parked (no more seals are tried). `acked`: the end
    /// and SHA-1 its appends were acknowledged with.
    async fn seal_not_made(
        &self,
        j: &JournalRef,
        e: &StorageError,
        (path, begin): (PathBuf, u64),
        acked: (u64, [u8; 20]),
    ) {
        let mut parked = self.park_if_final(&mut j.borrow_mut(), e);
        let end = j.borrow().heads.head();
        let reopened = Spool::recover_sized(path.clone(), begin, end, self.sizing).await;
        match reopened {
            Ok((s, on_disk)) => {
                j.borrow_mut().files.spool = Some(s);
                parked |= self.park_if_changed(j, &path, acked, (end, on_disk));
            }
            Err(re) => {
                // Without it, `[begin, end)` is in no file the journal
                // knows until a restart recovers it: a spool opened at the
                // head would have reads skip that span. Nothing more is
                // appended here.
                let why =
                    format!("after a failed seal ({e}), its spool could not be opened again: {re}");
                self.park(&mut j.borrow_mut(), &why);
                parked = true;
            }
        }
        j.borrow_mut().spool_back();
        if parked {
            self.refuse_parked(j);
        } else {
            self.seal_failed(j, e);
        }
    }

    /// After a failed seal (an fdatasync that failed, say, whose pages the
    /// kernel may have dropped), the spool's bytes as read back from disk,
    /// `on_disk` (their end and SHA-1), against those its appends were
    /// acknowledged with, `acked`. Bytes that differ are not what was
    /// acknowledged: sealed, they would make a fragment named by a SHA-1
    /// they do not have, and a retry cannot mend them. The journal is
    /// parked as on a disk that failed for good (`DISK_FAILED`), and the
    /// spool's file is no longer read; returns whether they differed.
    fn park_if_changed(
        &self,
        j: &JournalRef,
        path: &std::path::Path,
        acked: (u64, [u8; 20]),
        on_disk: (u64, [u8; 20]),
    ) -> bool {
        // Reopened at another end (the journal's head), the SHA-1s are of
        // different bytes: nothing to compare.
        if acked.0 != on_disk.0 || acked.1 == on_disk.1 {
            return false;
        }
        let e = StorageError::Corrupt {
            path: path.to_path_buf(),
            why: format!(
                "after a failed seal, its bytes up to {} read back with SHA-1 {}, not the {} of its acknowledged bytes up to {}",
                on_disk.0,
                hex::encode(on_disk.1),
                hex::encode(acked.1),
                acked.0
            ),
        };
        let mut jm = j.borrow_mut();
        // Its file's bytes are never served: reads of its span go to a
        // store's copy or are refused (`Index::locate`).
        let begin = jm.files.spool.as_ref().map_or(0, |s| s.begin());
        jm.files.spool_changed = Some((begin, e.to_string()));
        self.park_if_final(&mut jm, &e)
    }

    /// A seal failed with an error that may pass: it is tried again after
    /// a delay that doubles with each failure in a row (`Files::seal_failed`),
    /// not at once, which would spin on it for as long as it fails. Those
    /// who asked for it are told now; appends that need it first are
    /// refused `IO_ERROR` meanwhile (`journal::admit`), and others go on
    /// into the spool.
    fn seal_failed(&self, j: &JournalRef, e: &StorageError) {
        let delay = {
            let mut jm = j.borrow_mut();
            let delay = jm.files.seal_failed(crate::clock::now(), e.to_string());
            let failures = jm.files.seal_retry.as_ref().map_or(0, |r| r.failures);
            if failures == 1 || failures.is_power_of_two() {
                tracing::error!(journal = %jm.name, error = %e, failures, retry_ms = delay.as_millis() as u64, "seal failed; trying again later");
            }
            delay
        };
        self.refuse_seals_backing_off(j);
        let me = self.me.borrow().clone();
        let j = j.clone();
        compio::runtime::spawn(async move {
            compio::time::sleep(delay).await;
            if let Some(shard) = me.upgrade() {
                shard.mark_ready(&j);
            }
        })
        .detach();
    }

    /// Answers the SEALs of a journal whose last seal failed and is not
    /// yet to be tried again, with that failure; returns whether it backs
    /// off.
    fn refuse_seals_backing_off(&self, j: &JournalRef) -> bool {
        let mut jm = j.borrow_mut();
        let jm = &mut *jm;
        let Some(retry) = jm.files.seal_backoff(crate::clock::now()) else {
            return false;
        };
        let why = format!(
            "sealing the journal's spool failed ({}); it is tried again shortly",
            retry.error
        );
        for (outbox, id) in jm.files.seal_waiters.drain(..) {
            outbox.error(Op::ADMIN_REPLY, Status::IO_ERROR, id, &[], &why);
        }
        true
    }

    /// Commits and acknowledges the staged appends of a journal.
    pub(super) fn acknowledge(&self, j: &JournalRef) {
        let staged = self.commit_local(j);
        self.publish(j, staged);
    }

    /// Moves the journal's local commit point past its staged appends
    /// (the commit log holds them) and returns them.
    pub(super) fn commit_local(&self, j: &JournalRef) -> Vec<Staged> {
        let mut jm = j.borrow_mut();
        let jm = &mut *jm;
        let staged = std::mem::take(&mut jm.queue.staged);
        let last = staged.last().expect("non-empty");
        jm.files
            .spool
            .as_mut()
            .expect("spool")
            .commit(last.point.clone());
        jm.replica.wrote_spool = last.op.replica.is_some();
        jm.commit_local_to(last.end);
        jm.heads.set_local_registers(last.registers.clone());
        if jm.files.spool_since.is_none() {
            jm.files.spool_since = Some(crate::clock::wall());
        }
        staged
    }

    /// Whether a journal without replicas, in a cluster on etcd, may no
    /// longer be this broker's: its lease may have expired (the fence
    /// passed, say while the process was stopped), so another broker may
    /// hold the journal now and nobody would refuse this one's appends.
    /// Its batch is then taken back rather than answered. Checked right
    /// before the answer: a batch answered was committed before then.
    fn lease_lapsed(&self, j: &JournalRef) -> bool {
        let jm = j.borrow();
        if jm.queue.staged_with_replicas || jm.spec.replication > 1 {
            return false;
        }
        self.topology
            .control()
            .is_some_and(|c| !c.fence.holds(crate::cluster::now_ms()))
    }

    /// Makes locally committed appends visible and answers them OK.
    pub(super) fn publish(&self, j: &JournalRef, staged: Vec<Staged>) {
        let durability = j.borrow().spec.durability;
        self.count_appends(&staged, false, durability);
        self.publish_counted(j, staged);
    }

    /// A replicated batch committed here that began at `start` and that a
    /// replica did not acknowledge: its appends are answered with
    /// `failure`, and it is taken back, with every batch after it, once
    /// none is in flight ([`Shard::take_back_unconfirmed`]). Never
    /// visible: its bytes may conflict with what a new primary appends at
    /// their offsets.
    pub(super) fn refuse_unconfirmed(
        &self,
        j: &JournalRef,
        start: CommitPoint,
        staged: Vec<Staged>,
        failure: &Failure,
    ) {
        let durability = j.borrow().spec.durability;
        self.count_appends(&staged, true, durability);
        if failure.status == Status::REPLICATION_FAILED {
            let answered = staged
                .iter()
                .filter(|s| !s.op.finished.get() && is_client_append(&s.op))
                .count();
            metrics::add(&self.metrics.replication_failed, answered as u64);
        }
        let mut jm = j.borrow_mut();
        assert!(
            staged.first().is_none_or(|s| s.begin == start.offset),
            "journal {}: a batch taken back from {} begins elsewhere",
            jm.name,
            start.offset
        );
        jm.primary.unconfirmed_from(start);
        let reply = jm.heads.refusal();
        for s in &staged {
            s.op.reply_error(failure.status, &reply, &failure.message);
        }
    }

    /// Takes back the batches committed here that a replica did not
    /// acknowledge (`PrimaryState::unconfirmed`), once none is in flight
    /// and nothing is staged: the spool and its file go back to the last
    /// acknowledged batch, the heads and registers to what readers see,
    /// and the commit log is told (a restatement, as after a failed
    /// batch). An append open on top of them is refused. Their bytes are
    /// then never sealed, uploaded, served, copied or named in a SYNC's
    /// answer, whatever this broker does next: go on as the primary, or
    /// follow a new one.
    pub(super) fn take_back_unconfirmed(&self, j: &JournalRef) {
        if self.take_back_spool(&mut j.borrow_mut()) {
            self.restate(j);
        }
    }

    /// [`Shard::take_back_unconfirmed`] of the spool and the heads; true
    /// if it took anything back (the commit log is then owed a
    /// restatement).
    fn take_back_spool(&self, jm: &mut Journal) -> bool {
        let Some(point) = jm.primary.unconfirmed.clone() else {
            return false;
        };
        let busy = jm.primary.inflight > 0
            || !jm.queue.staged.is_empty()
            || jm.files.spool_out
            || jm.files.spool.as_ref().is_some_and(|s| s.write_in_flight());
        if busy {
            // The acker (or the write) readies the journal again.
            return false;
        }
        self.fail_open_append(
            jm,
            "an earlier append of the journal was not acknowledged by every replica; this one was rolled back with it",
        );
        jm.primary.unconfirmed = None;
        let spool = jm
            .files
            .spool
            .as_mut()
            .expect("unconfirmed bytes are in the open spool");
        let taken_back = spool.committed() - point.offset;
        let res = spool.uncommit(point.clone());
        assert_eq!(
            jm.heads.head(),
            point.offset,
            "journal {}: taking back to where readers do not stand",
            jm.name
        );
        jm.take_back_to_head();
        jm.primary.took_back(point.offset);
        jm.readers.tail.truncate(point.offset);
        metrics::add(&self.metrics.taken_back_bytes, taken_back);
        tracing::warn!(journal = %jm.name, from = point.offset, bytes = taken_back, "took back appends that a replica did not acknowledge");
        if let Err(e) = res {
            tracing::error!(journal = %jm.name, error = %e, "cutting a spool back after taking back unacknowledged appends; the commit log's restatement still takes them back at a restart");
            self.park_if_final(jm, &e);
        }
        true
    }

    /// Counts a batch's appends (and their bytes) as succeeded or failed,
    /// and the latency of the succeeded ones that came from clients.
    pub(super) fn count_appends(&self, staged: &[Staged], failed: bool, durability: Durability) {
        // Pulses (internal, their outbox closed) are not client appends.
        let counted = staged
            .iter()
            .filter(|s| !s.op.outbox.is_closed() || s.op.replica.is_some())
            .count() as u64;
        if failed {
            metrics::add(&self.metrics.append_failures, counted);
        } else {
            let class = metrics::durability_class(durability);
            let now = crate::clock::now();
            // A replica's copy is acknowledged to its primary, whose own
            // append (the client's) is the one measured.
            for s in staged.iter().filter(|s| is_client_append(&s.op)) {
                let micros = now.saturating_duration_since(s.op.arrived).as_micros();
                self.metrics
                    .append_latency
                    .observe(class, u64::try_from(micros).unwrap_or(u64::MAX));
            }
            let bytes = staged.iter().map(|s| s.end - s.begin).sum();
            metrics::add(&self.metrics.appends, counted);
            metrics::add(&self.metrics.append_bytes, bytes);
            let (n, b) = match durability {
                Durability::Replicated => (
                    &self.metrics.appends_replicated,
                    &self.metrics.append_bytes_replicated,
                ),
                Durability::Fsync => (
                    &self.metrics.appends_fsync,
                    &self.metrics.append_bytes_fsync,
                ),
            };
            metrics::add(n, counted);
            metrics::add(b, bytes);
        }
    }

    /// [`Shard::publish`] of a batch already counted (when it was answered).
    pub(super) fn publish_counted(&self, j: &JournalRef, staged: Vec<Staged>) {
        let mut jm = j.borrow_mut();
        let jm = &mut *jm;
        let Some(last) = staged.last() else { return };
        jm.publish_to(last.end);
        jm.heads.publish_registers(last.registers.clone());
        staged.iter().for_each(answer_ok);
        jm.readers.committed.notify(usize::MAX);
    }
}

/// Whether an append is a client's: not a pulse (internal, its outbox
/// closed), nor a replica's copy of its primary's append (answered to the
/// primary, which answers the client).
pub(super) fn is_client_append(op: &AppendOp) -> bool {
    !op.outbox.is_closed() && op.replica.is_none()
}

/// Counts and warns of a turn that took [`SLOW_TURN`] or longer, with the
/// time each of its steps took: `at` are the ends of started, prepare,
/// stage, write and acknowledge. True if it was slow.
fn note_slow_turn(metrics: &Metrics, journals: usize, at: [Instant; 5]) -> bool {
    let [started, prepared, staged_at, written, acked] = at;
    let now = crate::clock::now();
    if now.saturating_duration_since(started) < SLOW_TURN {
        return false;
    }
    metrics::add(&metrics.slow_turns, 1);
    let ms = |from: Instant, to: Instant| {
        format!(
            "{:.1}",
            to.saturating_duration_since(from).as_secs_f64() * 1e3
        )
    };
    tracing::warn!(
        journals,
        prepare_ms = %ms(started, prepared),
        stage_ms = %ms(prepared, staged_at),
        write_ms = %ms(staged_at, written),
        ack_ms = %ms(written, acked),
        compact_ms = %ms(acked, now),
        "slow turn: the shard's appends waited this long"
    );
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A turn of [`SLOW_TURN`] or longer is counted, a shorter one not.
    #[test]
    fn turns_from_the_threshold_on_are_counted_slow() {
        let clock = crate::clock::Clock::manual();
        let _installed = crate::clock::install(clock.clone());
        let m = Metrics::default();
        let started = crate::clock::now();
        let at = [started; 5];
        clock.advance(SLOW_TURN - std::time::Duration::from_millis(1));
        assert!(!note_slow_turn(&m, 1, at));
        assert_eq!(m.slow_turns.load(std::sync::atomic::Ordering::Relaxed), 0);
        clock.advance(std::time::Duration::from_millis(1));
        assert!(note_slow_turn(&m, 1, at));
        assert_eq!(m.slow_turns.load(std::sync::atomic::Ordering::Relaxed), 1);
    }
}
