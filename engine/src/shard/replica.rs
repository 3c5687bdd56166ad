//! What a replica does: applying its primary's records and SYNCs.

use super::*;

impl Shard {
    /// Applies SYNCs sent by the journal's primary, once the appends it
    /// sent before them are through.
    pub(super) async fn apply_syncs(&self, j: &JournalRef) {
        use rotary_net::repl::SyncReply;
        loop {
            let w = {
                let mut jm = j.borrow_mut();
                if jm.replica.sync_waiters.is_empty()
                    || jm.queue.active.is_some()
                    || !jm.queue.waiting.is_empty()
                    || !jm.queue.staged.is_empty()
                    || !jm.replica.awaiting.is_empty()
                    || jm.primary.inflight > 0
                    || jm.primary.unconfirmed.is_some()
                {
                    // Its own batches as a primary go first: those a
                    // replica did not acknowledge are taken back before
                    // its head is named to a new primary.
                    return;
                }
                jm.replica.sync_waiters.remove(0)
            };
            let view = self.view();
            let route = view.route(&w.req.journal, w.req.spec.replication);
            let head = j.borrow().heads.local_head();
            let answer = |status: Status, message: String, head: u64| {
                let body = SyncReply {
                    head,
                    route: route.ids(),
                    route_revision: view.revision(),
                    registers: j.borrow().heads.local_registers().clone(),
                    message,
                };
                w.sink
                    .push(w.req.seq, status, serde_json::to_vec(&body).expect("json"));
            };
            if route.ids() != w.req.route || !route.contains(&view.me) || route.is_primary(&view.me)
            {
                let msg = route_disagreement(&view.me, &route, &w.req);
                answer(Status::WRONG_ROUTE, msg, head);
                continue;
            }
            if head > w.req.head {
                let msg = format!(
                    "the replica's head {head} is beyond the primary's {}",
                    w.req.head
                );
                answer(Status::PROPOSAL_MISMATCH, msg, head);
                continue;
            }
            if !self.seal_for_sync(j).await {
                answer(
                    Status::IO_ERROR,
                    "sealing the replica's spool failed".into(),
                    head,
                );
                continue;
            }
            let known = j.borrow().primary.known_taken_back();
            let head = match diverged_at(&w.req.taken_back, &known, head) {
                Some(at) => self.drop_diverged(j, at),
                None => head,
            };
            if let Err(e) = self.fill_from_primary(j, &route, head, w.req.head).await {
                let to = w.req.head;
                let msg = format!("copying [{head}, {to}), which this replica missed, from its primary failed: {e}");
                answer(Status::IO_ERROR, msg, head);
                continue;
            }
            {
                let mut jm = j.borrow_mut();
                let h = w.req.head;
                jm.set_heads(h);
                jm.primary.followed(&w.req.taken_back);
                for f in jm.files.fragments.iter_mut() {
                    // Followed its primary: what it holds is the journal's.
                    f.held = false;
                }
                jm.heads.set_registers(w.req.registers.clone());
                jm.replica.track = Some(
                    crate::replica::ReplicaTrack::synced_at(h, w.req.seq).with_stream(w.sink.id),
                );
                jm.readers.committed.notify(usize::MAX);
            }
            metrics::add(&self.metrics.syncs, 1);
            answer(Status::OK, String::new(), w.req.head);
        }
    }

    /// Drops this replica's local bytes from `at` on, the lowest offset its
    /// primary took back below this replica's head: the replica was away
    /// then, so what it holds there may be bytes the route never
    /// confirmed, which the primary has since replaced. The spool was
    /// sealed (`seal_for_sync`): whole fragments reaching past `at` go,
    /// and the SYNC copies what it can from the primary again. Returns
    /// the replica's head after (the end of what it kept).
    fn drop_diverged(&self, j: &JournalRef, at: u64) -> u64 {
        let mut jm = j.borrow_mut();
        assert!(
            jm.files.spool.is_none(),
            "the replica's spool is sealed first"
        );
        let (gone, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut jm.files.fragments)
            .into_iter()
            .partition(|f| f.end > at);
        jm.files.fragments = kept;
        let head = jm.files.fragments.iter().map(|f| f.end).max().unwrap_or(0);
        assert!(head <= at, "kept bytes beyond the take-back");
        let dropped: u64 = gone.iter().map(|f| f.end - f.begin).sum();
        for f in gone {
            self.retire_fragment(&jm, f);
        }
        jm.readers.tail.truncate(head);
        metrics::add(&self.metrics.taken_back_bytes, dropped);
        tracing::warn!(journal = %jm.name, at, head, dropped, "dropped bytes the primary took back while this replica was away");
        head
    }

    /// Answers every SYNC waiting on the journal with `status` and `why`,
    /// changing nothing: this replica cannot follow its primary (its disk
    /// failed for good). The primary fails its appends with the cause and
    /// tries a SYNC again only after its retry delay.
    pub(super) fn refuse_syncs(&self, j: &JournalRef, status: Status, why: &str) {
        use rotary_net::repl::SyncReply;
        assert!(status != Status::OK, "a SYNC refused with OK");
        let waiters = std::mem::take(&mut j.borrow_mut().replica.sync_waiters);
        if waiters.is_empty() {
            return;
        }
        let view = self.view();
        let jm = j.borrow();
        for w in waiters {
            let route = view.route(&w.req.journal, w.req.spec.replication);
            let body = SyncReply {
                head: jm.heads.local_head(),
                route: route.ids(),
                route_revision: view.revision(),
                registers: jm.heads.local_registers().clone(),
                message: why.to_owned(),
            };
            w.sink
                .push(w.req.seq, status, serde_json::to_vec(&body).expect("json"));
        }
    }

    /// Seals the replica's spool for its primary's SYNC; returns whether
    /// it is sealed. A seal that failed with an error that may pass (an
    /// interrupted call, ENOSPC from fdatasync) left the spool reopened
    /// (`Shard::seal`) and is tried again at once, up to
    /// [`SYNC_SEAL_TRIES_MAX`] tries. Why not answer the SYNC at once: the
    /// primary answers every append with a refused SYNC's failure until it
    /// tries again (`SYNC_RETRY`), which on a busy journal is dozens of
    /// appends for one transient error. The tries are few and the primary
    /// paces its SYNCs, so a disk that keeps failing is not spun on. The
    /// seal back-off (`Files::seal_backoff`) is not waited for: the SYNC
    /// needs the seal now.
    async fn seal_for_sync(&self, j: &JournalRef) -> bool {
        for _ in 0..SYNC_SEAL_TRIES_MAX {
            {
                let jm = j.borrow();
                if jm.files.spool.is_none() {
                    return true;
                }
                if jm.files.disk_failed.is_some() {
                    // Parked: no seal is tried.
                    return false;
                }
            }
            self.seal(j).await;
        }
        j.borrow().files.spool.is_none()
    }

    /// Copies `[head, to)` from the journal's primary before a SYNC moves
    /// this replica's head to `to`: appends it missed that the primary
    /// committed (answered `REPLICATION_FAILED` while this replica did not
    /// acknowledge them, their outcome unknown to their clients). Without
    /// it this copy would lack their span, and reads here would skip it
    /// while the primary serves it. A replica that holds nothing of the
    /// journal copies too: it cannot tell whether it missed the journal's
    /// first appends (or restarted on an empty disk after them) or was
    /// just added to the route, and for a member just added the copy is
    /// at most [`SYNC_FILL_BYTES_MAX`], of what the primary holds locally
    /// (`DO_NOT_PROXY`: what only the store holds stays there), once.
    /// One more than that behind starts at `to`: what lies before is read
    /// from the store. A copy that fails is an error: the SYNC is refused
    /// rather than move this replica's head past bytes it does not hold,
    /// and a later SYNC tries the copy again.
    async fn fill_from_primary(
        &self,
        j: &JournalRef,
        route: &Route,
        head: u64,
        to: u64,
    ) -> Result<(), String> {
        if to <= head || to - head > SYNC_FILL_BYTES_MAX {
            return Ok(());
        }
        let Some(primary) = route.primary() else {
            return Ok(());
        };
        let (name, dir, durable) = {
            let jm = j.borrow();
            let durable = jm.spec.durability == Durability::Fsync;
            (jm.name.clone(), jm.files.dir.clone(), durable)
        };
        let addr = self.member_endpoint(primary, &name);
        let sources = [(to, addr)];
        let copied = crate::fetch::copy_from_each(&sources, &name, head, to, &dir, durable);
        match copied.await {
            Ok(copied) => {
                let got = self.take_copied(&mut j.borrow_mut(), copied);
                tracing::info!(journal = %name, from = head, to, copied = got, "copied the appends this replica missed from its primary");
                Ok(())
            }
            Err(e) => {
                tracing::warn!(journal = %name, from = head, to, error = %e, "could not copy the appends this replica missed from its primary; its SYNC is refused");
                Err(e)
            }
        }
    }

    /// Moves a replica's appends whose proposals arrived, oldest first,
    /// from awaiting to this turn's batch, each checked against the bytes
    /// staged for it. A mismatch drops it and everything staged after it.
    pub(super) fn commit_awaiting(&self, jm: &mut Journal) {
        while let Some(front) = jm.replica.awaiting.front() {
            let proposal = match &front.op.replica {
                Some(r) => r.proposal.borrow().clone(),
                None => None,
            };
            let Some(proposal) = proposal else { break };
            let w = jm.replica.awaiting.pop_front().expect("front");
            let staged_sha = w.end.sha.clone().finalize();
            if let Err(msg) = crate::replica::check_proposal(
                w.end.offset,
                &staged_sha,
                proposal.end,
                &proposal.fragment_sha1,
            ) {
                let r = AppendReply {
                    write_head: jm.heads.head(),
                    ..Default::default()
                };
                w.op.reply_error(Status::PROPOSAL_MISMATCH, &r, &msg);
                self.drop_replica_tail(jm, w.start, &msg);
                return;
            }
            jm.heads.set_staged_registers(proposal.registers.clone());
            jm.queue.staged.push(Staged {
                op: w.op,
                begin: w.start.offset,
                end: w.end.offset,
                sha1: crate::append::Digest::Ready(staged_sha),
                point: w.end,
                registers: proposal.registers,
                seq: w.seq,
            });
        }
    }

    /// Drops a replica's awaiting and active appends and rewinds its spool
    /// to `start`; the journal needs a SYNC before it takes more.
    pub(super) fn drop_replica_tail(&self, jm: &mut Journal, start: CommitPoint, msg: &str) {
        let r = AppendReply {
            write_head: jm.heads.head(),
            ..Default::default()
        };
        for w in jm.replica.awaiting.drain(..) {
            w.op.reply_error(Status::PROPOSAL_MISMATCH, &r, msg);
        }
        rewind_replica_to(jm, start, |op| {
            op.reply_error(Status::PROPOSAL_MISMATCH, &r, msg)
        });
        if let Some(t) = jm.replica.track.as_mut() {
            t.diverged();
        }
    }
}

/// The lowest of a SYNC's `taken_back` below the replica's `head` that the
/// replica does not already `know` (one it learned at an earlier SYNC, or
/// made itself as primary, it has followed since): where its copy may
/// hold bytes its primary took back and replaced.
fn diverged_at(taken_back: &[u64], known: &[u64], head: u64) -> Option<u64> {
    taken_back
        .iter()
        .copied()
        .filter(|&x| x < head && !known.contains(&x))
        .min()
}

#[cfg(test)]
mod tests {
    use super::diverged_at;

    #[test]
    fn a_replica_drops_from_the_lowest_take_back_below_its_head() {
        assert_eq!(diverged_at(&[], &[], 100), None);
        let at_head = diverged_at(&[100, 200], &[], 100);
        assert_eq!(at_head, None, "at its head: nothing beyond");
        assert_eq!(diverged_at(&[40, 90, 200], &[], 100), Some(40));
        assert_eq!(diverged_at(&[90, 40], &[], 100), Some(40));
        // Take-backs it followed already drop nothing again.
        assert_eq!(diverged_at(&[40, 90], &[40], 100), Some(90));
        assert_eq!(diverged_at(&[40, 90], &[40, 90], 100), None);
    }
}
