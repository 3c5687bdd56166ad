//! Staging queued appends into spools' write buffers.

use super::*;
use crate::journal::{admit, Admission, AdmitRole, AdmitShard, Next};

impl Shard {
    /// Enqueues an append; the flusher picks it up.
    pub fn submit_append(&self, j: &JournalRef, op: Rc<crate::append::AppendOp>) {
        j.borrow_mut().queue.waiting.push_back(op);
        self.mark_ready(j);
    }

    /// Stages queued appends of one journal. Returns true if it has more
    /// to stage as soon as the buffer is written.
    pub(super) fn stage(&self, j: &JournalRef) -> bool {
        let again = self.stage_queue(j);
        let mut jm = j.borrow_mut();
        if !jm.replica.awaiting.is_empty() {
            self.commit_awaiting(&mut jm);
        }
        again
    }

    pub(super) fn stage_queue(&self, j: &JournalRef) -> bool {
        let mut jm = j.borrow_mut();
        let jm = &mut *jm;
        let store_error = self.store_error.borrow();
        // Nothing staging changes moves these facts or the journal's gates
        // within the call: asked once here, they hold for every append and
        // chunk below.
        let facts = self.admit_facts(jm, store_error.as_deref());
        let now = crate::clock::now();
        let gates = admit(jm, Next::Journal, &facts, now);
        if let Some(again) = self.hold(j, jm, &gates, now) {
            return again;
        }
        assert!(gates == Admission::Stage, "{gates:?}");
        if jm.queue.staged.is_empty() {
            jm.queue.staged_with_replicas = jm.primary.repl.is_some();
        }
        if jm.files.spool.as_ref().is_none_or(|s| !s.can_stage()) {
            // Seal waiters on a journal without a spool get their answer.
            if jm.files.spool.is_none() && !jm.files.seal_waiters.is_empty() {
                let body =
                    serde_json::to_vec(&serde_json::json!({ "sealed": null })).expect("json");
                for (outbox, id) in jm.files.seal_waiters.drain(..) {
                    outbox.frame(Op::ADMIN_REPLY, Status::OK, id, &[], &body);
                }
                jm.files.seal_requested = false;
            }
            return false;
        }
        loop {
            if jm.queue.active.is_none() {
                let Some(op) = jm.queue.waiting.front().cloned() else {
                    return false;
                };
                let is_replica_op = op.replica.is_some();
                match self.admission(j, jm, &op, &facts, now) {
                    Front::Stage => {}
                    Front::Passed => continue,
                    Front::Wait { again } => return again,
                }
                let start = jm.files.spool.as_ref().expect("checked").commit_point();
                let seq = if is_replica_op {
                    op.request_id
                } else {
                    jm.queue.last_append = crate::clock::now();
                    self.seq()
                };
                jm.queue.active = Some(Active {
                    _streaming: crate::budget::Streaming::new(op.budget.clone()),
                    op,
                    start,
                    sha: crate::append::AppendSha::Inline(Sha1::new()),
                    chunk_pos: 0,
                    seq,
                    flow: crate::append::Flow::new(crate::clock::now()),
                });
            }
            if let Some(again) = self.stage_arrived(j, jm, &facts, now) {
                return again;
            }
            let a = jm.queue.active.as_ref().expect("active");
            let content_done = a.op.replica.as_ref().is_some_and(|r| r.content_done.get());
            if (!a.op.complete.get() && !content_done) || !a.op.chunks.borrow().is_empty() {
                return false;
            }
            // The append is whole.
            self.finish_whole(jm);
        }
    }

    /// Fails the open append when its spool could not grow for it: it is
    /// taken back out of the spool (and its replicas') and answered.
    /// Returns whether to stage again in this turn.
    fn fail_allocation(&self, jm: &mut Journal, e: &StorageError) -> bool {
        if e.is_full() {
            metrics::add(&self.metrics.storage_full, 1);
            // Spare spools must never be why an append fails.
            self.spares.borrow_mut().release();
        }
        let a = abandon_active(jm).expect("active");
        let r = AppendReply {
            write_head: jm.heads.staged_head(),
            registers: jm.heads.staged_registers().clone(),
            ..Default::default()
        };
        a.op.reply_error(storage_status(e), &r, &e.to_string());
        drop_budget(&a.op);
        metrics::add(&self.metrics.append_failures, 1);
        jm.queue.waiting.pop_front();
        // A disk that failed for good parks the journal: the rest of its
        // queue is refused at the next turn's prepare.
        self.park_if_final(jm, e);
        // A rewind past written bytes needs a tail reload.
        !jm.queue.waiting.is_empty()
    }

    /// Stages what has arrived of the journal's open append, at most its
    /// spool's buffer, its admission (the rate) and its hasher allow.
    /// Some(again) when the journal stops here for this turn (a full
    /// buffer: again); None when every chunk that arrived is staged.
    fn stage_arrived(
        &self,
        j: &JournalRef,
        jm: &mut Journal,
        facts: &AdmitShard<'_>,
        now: Instant,
    ) -> Option<bool> {
        // Its own handle, so that admission can look at the whole journal
        // while the append's chunks are borrowed.
        let op = jm.queue.active.as_ref().expect("set above").op.clone();
        // A replica's reply carries no SHA-1 of the append, and its bytes
        // are not charged to the rate.
        let client = op.replica.is_none();
        loop {
            let mut chunks = op.chunks.borrow_mut();
            let Some(chunk) = chunks.front() else { break };
            let a = jm.queue.active.as_mut().expect("set above");
            let bytes = &chunk.bytes()[a.chunk_pos..];
            if bytes.is_empty() {
                let c = chunks.pop_front().expect("front");
                op.budget.release(c.range.len());
                a.chunk_pos = 0;
                continue;
            }
            let spool = jm.files.spool.as_mut().expect("checked");
            if let Err(e) = spool.ensure_allocated(bytes.len() as u64, self.disk_reserve_bytes) {
                drop(chunks);
                return Some(self.fail_allocation(jm, &e));
            }
            let at = spool.staged();
            if let Some(h) = self.hasher.as_ref().filter(|_| client) {
                let size = at - a.start.offset + bytes.len() as u64;
                if self.offload_hash(h, &mut a.sha, size) && h.behind() {
                    // Its bytes wait in the chunk until the hasher
                    // caught up and readies the journal again.
                    drop(chunks);
                    self.hash_parked.borrow_mut().push(j.clone());
                    metrics::add(&self.metrics.hash_waits, 1);
                    return Some(false);
                }
            }
            // A client's chunk is charged to the rate at the time it is
            // staged; a replica's is never, and the call's time will do.
            let now = if client { crate::clock::now() } else { now };
            let next = Next::Chunk {
                op: &op,
                len: bytes.len() as u64,
            };
            let admitted = match admit(jm, next, facts, now) {
                Admission::StageUpTo(n) => &bytes[..n as usize],
                wait => {
                    drop(chunks);
                    return Some(self.hold(j, jm, &wait, now).expect("a chunk waits"));
                }
            };
            let a = jm.queue.active.as_mut().expect("set above");
            let spool = jm.files.spool.as_mut().expect("checked");
            let n = match &mut a.sha {
                AppendSha::Inline(_) if !client => spool.stage(admitted),
                AppendSha::Inline(sha) => spool.stage_hashed(admitted, sha),
                AppendSha::Offloaded(o) => {
                    let n = spool.stage(admitted);
                    let from = chunk.range.start + a.chunk_pos;
                    o.hash(&chunk.data, from..from + n);
                    metrics::add(&self.metrics.hash_offloaded_bytes, n as u64);
                    n
                }
            };
            if client {
                jm.queue.rate.take(n as u64, now);
            }
            if let Some(r) = &jm.primary.repl {
                let rec = Record::Content {
                    seq: a.seq,
                    journal: &jm.name,
                    offset: at,
                    bytes: &bytes[..n],
                };
                for (p, _) in &r.pipelines {
                    p.push(&rec);
                }
            }
            if jm.readers.waiting > 0 {
                let window = crate::journal::tail_window(self.journals.borrow().len());
                jm.readers.tail.push(at, &bytes[..n], window, &self.metrics);
            }
            a.chunk_pos += n;
            if n < admitted.len() {
                // Buffer full: write it, then continue.
                return Some(true);
            }
        }
        None
    }

    /// Takes the journal's open append, whole now, out of the queue: a
    /// replica's awaits its proposal, a client's joins the batch (or is
    /// refused if its registers would not do).
    fn finish_whole(&self, jm: &mut Journal) {
        let a = jm.queue.active.take().expect("active");
        jm.queue.waiting.pop_front();
        let spool = jm.files.spool.as_mut().expect("checked");
        let point = spool.commit_point();
        let begin = a.start.offset;
        let end = point.offset;
        if a.op.replica.is_some() {
            // Committed when its proposal comes (`commit_awaiting`);
            // the next append's content is staged meanwhile.
            jm.set_staged_head(end);
            jm.replica.awaiting.push_back(crate::append::Awaiting {
                op: a.op,
                start: a.start,
                end: point,
                seq: a.seq,
            });
            return;
        }
        if begin == end
            && (!a.op.req.union_registers.is_empty() || !a.op.req.subtract_registers.is_empty())
        {
            let r = AppendReply {
                write_head: jm.heads.staged_head(),
                registers: jm.heads.staged_registers().clone(),
                ..Default::default()
            };
            a.op.reply_error(
                Status::BAD_REQUEST,
                &r,
                "an empty append cannot change registers",
            );
            send_rollback(jm.primary.repl.as_ref(), &jm.name, a.seq);
            return;
        }
        let mut registers = jm.heads.staged_registers().clone();
        if begin != end {
            // Subtract, then union, as Gazette: docs/PROTOCOL.md §6.2.
            registers.apply_append_changes(&a.op.req.union_registers, &a.op.req.subtract_registers);
        }
        if registers.encoded_len() > rotary_net::wire::REGISTERS_ENCODED_LEN_MAX {
            // Replies carry the registers; they must stay encodable.
            roll_back_open(jm, &a);
            let r = AppendReply {
                write_head: jm.heads.staged_head(),
                registers: jm.heads.staged_registers().clone(),
                ..Default::default()
            };
            let msg = format!(
                "registers would take {} bytes; at most {} are allowed",
                registers.encoded_len(),
                rotary_net::wire::REGISTERS_ENCODED_LEN_MAX
            );
            a.op.reply_error(Status::BAD_REQUEST, &r, &msg);
            return;
        }
        jm.set_staged_head(end);
        jm.heads.set_staged_registers(registers.clone());
        jm.queue.staged.push(Staged {
            op: a.op,
            begin,
            end,
            sha1: a.sha.finish(),
            point,
            registers,
            seq: a.seq,
        });
    }

    /// What the shard knows of `jm` for [`admit`]: its role by the
    /// current route, its batches in flight and the shard's uploads.
    fn admit_facts<'a>(&self, jm: &Journal, store_error: Option<&'a str>) -> AdmitShard<'a> {
        let role = self.role(&jm.spec);
        AdmitShard {
            role: match role {
                Role::Primary(_) => AdmitRole::Primary,
                Role::Replica(_) => AdmitRole::Replica,
                _ => AdmitRole::Other,
            },
            replicated: matches!(&role, Role::Primary(r) if r.members.len() > 1),
            inflight: jm.primary.inflight,
            unuploaded_bytes: self.unuploaded_bytes.get(),
            spool_budget_bytes: self.spool_budget_bytes,
            store_error,
        }
    }

    /// Acts on an answer of [`admit`] that holds the journal back: Some
    /// (whether to stage it again in this turn), or None if the answer is
    /// not a wait.
    fn hold(
        &self,
        j: &JournalRef,
        jm: &mut Journal,
        answer: &Admission,
        now: Instant,
    ) -> Option<bool> {
        match *answer {
            // A seal waits for this batch to commit and replicas to
            // acknowledge what is in flight; peers ready the journal
            // themselves (the acker, a SYNC's end).
            Admission::Seal { again } | Admission::AwaitPeers { again } => Some(again),
            Admission::AwaitListing { hurry } => {
                if hurry {
                    self.hurry_first_listing_soon(j);
                }
                Some(false)
            }
            Admission::ResetHead { to } => {
                jm.index.reset_asked = Some(to);
                jm.index.reset_pending = true;
                Some(true)
            }
            Admission::AwaitRate { until } => {
                metrics::add(&self.metrics.rate_waits, 1);
                if !jm.queue.rate_timer {
                    jm.queue.rate_timer = true;
                    self.ready_after(j, until.saturating_duration_since(now));
                }
                Some(false)
            }
            _ => None,
        }
    }

    /// Acts on [`admit`]'s decision on `op`, the first queued append of
    /// `j`: drops or refuses it, or says whether it stages now.
    fn admission(
        &self,
        j: &JournalRef,
        jm: &mut Journal,
        op: &Rc<AppendOp>,
        facts: &AdmitShard<'_>,
        now: Instant,
    ) -> Front {
        let decision = admit(jm, Next::Append(op), facts, now);
        if let Some(again) = self.hold(j, jm, &decision, now) {
            return Front::Wait { again };
        }
        match decision {
            Admission::Stage => Front::Stage,
            Admission::Drop => {
                drop_dead_front(jm);
                Front::Passed
            }
            Admission::Refuse {
                status,
                message,
                diverged,
            } => {
                if diverged {
                    if let Some(t) = jm.replica.track.as_mut() {
                        t.diverged();
                    }
                }
                jm.queue.waiting.pop_front();
                let r = AppendReply {
                    write_head: jm.heads.staged_head(),
                    registers: jm.heads.staged_registers().clone(),
                    ..Default::default()
                };
                op.reply_error(status, &r, &message);
                drop_budget(op);
                Front::Passed
            }
            other => unreachable!("a new append is not staged in part: {other:?}"),
        }
    }

    /// Moves a client append's own SHA-1 to the hasher once it is large
    /// enough (`size` bytes, with those about to be staged, against
    /// [`crate::hasher::OFFLOAD_AFTER`]) and the hasher has room. Returns
    /// whether the append's hashing is offloaded.
    pub(super) fn offload_hash(
        &self,
        h: &crate::hasher::Hasher,
        sha: &mut AppendSha,
        size: u64,
    ) -> bool {
        match sha {
            AppendSha::Offloaded(_) => true,
            AppendSha::Inline(_) => {
                if size < crate::hasher::OFFLOAD_AFTER || !h.has_room() {
                    return false;
                }
                let AppendSha::Inline(inline) =
                    std::mem::replace(sha, AppendSha::Inline(Sha1::new()))
                else {
                    unreachable!("matched above")
                };
                *sha = AppendSha::Offloaded(h.offload(inline));
                true
            }
        }
    }

    /// Counts the clients' appends among `failed` when they fail for want
    /// of their replicas.
    fn count_replication_failed<'a>(
        &self,
        status: Status,
        failed: impl Iterator<Item = &'a Rc<AppendOp>>,
    ) {
        if status == Status::REPLICATION_FAILED {
            let clients = failed.filter(|op| super::flusher::is_client_append(op));
            metrics::add(&self.metrics.replication_failed, clients.count() as u64);
        }
    }

    /// Fails every append staged in this batch and the active one, and
    /// rewinds the spool to its last commit.
    pub(super) fn fail_batch(&self, j: &JournalRef, status: Status, msg: &str) {
        let mut jm = j.borrow_mut();
        let jm = &mut *jm;
        let reply = jm.heads.refusal();
        let staged = jm.queue.staged.iter().map(|s| &s.op);
        let failed = staged.chain(jm.queue.active.as_ref().map(|a| &a.op));
        self.count_replication_failed(status, failed);
        for s in jm.queue.staged.drain(..) {
            send_rollback(jm.primary.repl.as_ref(), &jm.name, s.seq);
            s.op.reply_error(status, &reply, msg);
            metrics::add(&self.metrics.append_failures, 1);
        }
        if let Some(a) = jm.queue.active.take() {
            send_rollback(jm.primary.repl.as_ref(), &jm.name, a.seq);
            a.op.reply_error(status, &reply, msg);
            drop_budget(&a.op);
            jm.queue.waiting.pop_front();
            metrics::add(&self.metrics.append_failures, 1);
        }
        for w in jm.replica.awaiting.drain(..) {
            w.op.reply_error(status, &reply, msg);
        }
        if let Some(t) = jm.replica.track.as_mut() {
            t.diverged();
        }
        if let Some(spool) = jm.files.spool.as_mut() {
            spool.rollback();
        }
        let head = jm.heads.local_head();
        jm.readers.tail.truncate(head);
        jm.unstage();
    }

    /// Fails every queued append of a journal (its spool cannot be used).
    pub(super) fn fail_queue(&self, j: &JournalRef, status: Status, msg: &str) {
        let mut jm = j.borrow_mut();
        let reply = jm.heads.refusal();
        self.count_replication_failed(status, jm.queue.waiting.iter());
        for op in jm.queue.waiting.drain(..) {
            op.reply_error(status, &reply, msg);
            drop_budget(&op);
            metrics::add(&self.metrics.append_failures, 1);
        }
        jm.queue.active = None;
    }
}

/// Drops the appends at the front of a journal's queue that were aborted
/// (their connection closed, say) or answered before they started
/// staging: they commit nothing and are answered so, if at all. None is
/// dropped while an append is open, which is the front.
pub(super) fn drop_dead_front(jm: &mut Journal) {
    if jm.queue.active.is_some() {
        return;
    }
    while let Some(op) = jm.queue.waiting.front().cloned() {
        if op.aborted.get().is_none() && !op.finished.get() {
            return;
        }
        jm.queue.waiting.pop_front();
        let reply = rolled_back_reply(jm);
        op.end_aborted(&reply);
        drop_budget(&op);
    }
}

/// What became of the append at the front of a journal's queue.
enum Front {
    /// It starts staging.
    Stage,
    /// Dropped or refused: the queue moved on.
    Passed,
    /// The journal waits; `again`: stage it again in this turn.
    Wait { again: bool },
}
