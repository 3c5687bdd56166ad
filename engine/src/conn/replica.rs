//! REPLICATE and SYNC: a primary's stream to this broker as its replica.

use super::*;

impl Conn {
    pub(super) fn sink(&mut self) -> Rc<AckSink> {
        self.sink
            .get_or_insert_with(|| AckSink::new(self.outbox.clone()))
            .clone()
    }

    /// REPLICATE: records of a primary's appends. False closes the connection.
    pub(super) fn replicate(&mut self, payload: &[u8], frame: Option<&Arc<Vec<u8>>>) -> bool {
        let records = match rotary_net::repl::decode_records(payload) {
            Ok(r) => r,
            Err(e) => {
                self.outbox
                    .error(Op::ERROR, Status::BAD_REQUEST, 0, &[], &e.to_string());
                return false;
            }
        };
        let sink = self.sink();
        for rec in records {
            let seq = rec.seq();
            let name = rec.journal();
            if rotary_net::shard_of(name, self.shard.shards) != self.shard.index {
                let msg = format!("journal {name:?} is not on shard {}", self.shard.index);
                sink.push(seq, Status::WRONG_ROUTE, msg.into_bytes());
                continue;
            }
            let Some(j) = self.shard.journal(name) else {
                let msg = format!("journal {name:?} does not exist here");
                sink.push(seq, Status::JOURNAL_NOT_FOUND, msg.into_bytes());
                continue;
            };
            let verdict = {
                let mut jm = j.borrow_mut();
                let t = jm.replica.track.get_or_insert_with(Default::default);
                if !t.takes_stream(sink.id) {
                    // Another primary's stream synchronized the journal:
                    // this one's records (a deposed primary's, still in
                    // flight) must not disturb its appends.
                    match &rec {
                        repl::Record::Rollback { .. } => Verdict::Ignore,
                        _ => Verdict::Refuse {
                            seq,
                            status: Status::PROPOSAL_MISMATCH,
                            message: "the journal is synchronized with another primary".into(),
                            rewind_to: None,
                        },
                    }
                } else {
                    match &rec {
                        repl::Record::Content { offset, bytes, .. } => {
                            t.on_content(seq, *offset, bytes.len() as u64)
                        }
                        repl::Record::Commit { begin, end, .. } => t.on_commit(seq, *begin, *end),
                        repl::Record::Rollback { .. } => t.on_rollback(seq),
                    }
                }
            };
            self.on_verdict(verdict, rec, &j, &sink, frame);
            if self.overrun.is_some() {
                break;
            }
        }
        true
    }

    /// Opens the replicated append `seq` that a record starts at `begin`,
    /// unless the connection holds [`CONN_REPLICATED_APPENDS_MAX`] open:
    /// then it is to be closed.
    fn start_replica_op(
        &mut self,
        seq: u64,
        begin: u64,
        rec: &repl::Record<'_>,
        j: &JournalRef,
        sink: &Rc<AckSink>,
        frame: Option<&Arc<Vec<u8>>>,
    ) {
        if self.repl_ops.len() >= CONN_REPLICATED_APPENDS_MAX {
            self.overrun = Some(format!(
                "the primary holds {CONN_REPLICATED_APPENDS_MAX} replicated appends open on this connection, the most it may; it is closed"
            ));
            return;
        }
        let op = self.replica_op(j, sink, seq, begin);
        // The journal's earlier appends have all their content: only the
        // newest of them could still have been taking it.
        let key = Rc::as_ptr(j) as usize;
        if let Some(earlier) = self.repl_newest.insert(key, op.clone()) {
            if let Some(r) = &earlier.replica {
                r.content_done.set(true);
            }
        }
        if let repl::Record::Content { bytes, .. } = rec {
            self.push_bytes(&op, bytes, frame);
        }
        self.repl_ops.insert(seq, (op.clone(), j.clone()));
        self.shard.submit_append(j, op);
    }

    /// Acts on the replica's verdict on one record of a REPLICATE.
    fn on_verdict(
        &mut self,
        verdict: Verdict,
        rec: repl::Record<'_>,
        j: &JournalRef,
        sink: &Rc<AckSink>,
        frame: Option<&Arc<Vec<u8>>>,
    ) {
        let name = rec.journal();
        match verdict {
            Verdict::Start { seq, begin } => {
                self.start_replica_op(seq, begin, &rec, j, sink, frame)
            }
            Verdict::Continue { seq } => {
                if let Some((op, _)) = self.repl_ops.get(&seq).cloned() {
                    if let repl::Record::Content { bytes, .. } = &rec {
                        self.push_bytes(&op, bytes, frame);
                    }
                    op.last_activity.set(crate::clock::now());
                    self.shard.mark_ready(j);
                }
            }
            Verdict::Commit { seq, .. } => {
                let repl::Record::Commit {
                    end,
                    fragment_sha1,
                    registers,
                    ..
                } = rec
                else {
                    unreachable!("commit verdicts come from commit records")
                };
                let proposal = Proposal {
                    end,
                    fragment_sha1,
                    registers,
                };
                let Some((op, _)) = self.repl_ops.remove(&seq) else {
                    return;
                };
                self.forget_newest(j, &op);
                if let Some(r) = &op.replica {
                    *r.proposal.borrow_mut() = Some(proposal);
                }
                op.complete.set(true);
                self.shard.mark_ready(j);
            }
            Verdict::CommitEmpty { seq, .. } => sink.push(seq, Status::OK, Vec::new()),
            Verdict::Rollback { seqs, .. } => {
                for seq in seqs {
                    if let Some((op, j)) = self.repl_ops.remove(&seq) {
                        self.forget_newest(&j, &op);
                        op.aborted.set(Some(AbortReason::Closed));
                        self.shard.mark_ready(&j);
                    }
                }
            }
            Verdict::Ignore => {}
            Verdict::Refuse {
                seq,
                status,
                message,
                rewind_to,
            } => {
                match self
                    .shard
                    .shared_failures
                    .failed(crate::journal::SharedWork::Refusal, "")
                {
                    Some(held) => {
                        tracing::warn!(journal = %name, seq, %status, %message, since_last_logged = held, "refused a replicated record; the primary must synchronize again (logged once a minute)");
                    }
                    None => {
                        tracing::debug!(journal = %name, seq, %status, %message, "refused a replicated record");
                    }
                }
                if rewind_to.is_some() {
                    self.abort_replica_ops(j);
                }
                sink.push(seq, status, message.into_bytes());
            }
        }
    }

    pub(super) fn replica_op(
        &self,
        j: &JournalRef,
        sink: &Rc<AckSink>,
        seq: u64,
        begin: u64,
    ) -> Rc<AppendOp> {
        let req = AppendRequest {
            journal: j.borrow().name.clone(),
            expect_offset: Some(begin),
            ..Default::default()
        };
        let (outbox, budget) = (self.outbox.clone(), self.budget.clone());
        let op = AppendOp::new(seq, outbox, req, false, budget);
        Rc::new(op.for_replica(sink.clone()))
    }

    /// Queues a record's bytes on a replicated append: a range of the
    /// received frame's own buffer when it has one (no copy), else a copy.
    pub(super) fn push_bytes(&self, op: &Rc<AppendOp>, bytes: &[u8], frame: Option<&Arc<Vec<u8>>>) {
        if bytes.is_empty() {
            return;
        }
        self.budget.charge(bytes.len());
        let shared = frame.and_then(|f| {
            let at = (bytes.as_ptr() as usize).checked_sub(f.as_ptr() as usize)?;
            (at + bytes.len() <= f.len()).then(|| Chunk {
                data: f.clone(),
                range: at..at + bytes.len(),
            })
        });
        op.chunks
            .borrow_mut()
            .push_back(shared.unwrap_or_else(|| Chunk {
                data: Arc::new(bytes.to_vec()),
                range: 0..bytes.len(),
            }));
    }

    /// Forgets `op` as its journal's newest open replicated append, if it
    /// is that.
    fn forget_newest(&mut self, j: &JournalRef, op: &Rc<AppendOp>) {
        let key = Rc::as_ptr(j) as usize;
        if self
            .repl_newest
            .get(&key)
            .is_some_and(|n| Rc::ptr_eq(n, op))
        {
            self.repl_newest.remove(&key);
        }
    }

    /// Drops this connection's open replicated appends of a journal.
    pub(super) fn abort_replica_ops(&mut self, j: &JournalRef) {
        self.repl_newest.remove(&(Rc::as_ptr(j) as usize));
        let seqs: Vec<u64> = self
            .repl_ops
            .iter()
            .filter(|(_, (_, oj))| Rc::ptr_eq(oj, j))
            .map(|(k, _)| *k)
            .collect();
        for k in seqs {
            if let Some((op, _)) = self.repl_ops.remove(&k) {
                op.aborted.set(Some(AbortReason::Closed));
            }
        }
        self.shard.mark_ready(j);
    }

    /// SYNC: the primary's view of a journal, to be applied by the flusher.
    /// A replica whose watch has not reached the revision the primary read
    /// its route at waits for it first (bounded), so that the two compare
    /// routes of one revision; the stream's later frames wait behind it.
    /// Why this broker's spec of a SYNC's journal is not the primary's,
    /// if it is not.
    fn spec_disagreement(&self, req: &rotary_net::repl::SyncRequest) -> Option<(Status, String)> {
        match self.shard.specs.get_revised(&req.journal) {
            Some(r) if r.spec == req.spec => None,
            Some(r) => Some((
                Status::WRONG_ROUTE,
                format!(
                    "journal {:?}: this broker's spec (revision {}) is not the primary's (revision {})",
                    req.journal, r.revision, req.revision
                ),
            )),
            None => Some((
                Status::JOURNAL_NOT_FOUND,
                format!(
                    "journal {:?} has no spec here (the primary's is at revision {}): not taken yet, or deleted",
                    req.journal, req.revision
                ),
            )),
        }
    }

    pub(super) async fn sync(&mut self, request_id: u64, payload: &[u8]) {
        let sink = self.sink();
        let req: rotary_net::repl::SyncRequest = match serde_json::from_slice(payload) {
            Ok(r) => r,
            Err(e) => {
                return self.outbox.error(
                    Op::ERROR,
                    Status::BAD_REQUEST,
                    request_id,
                    &[],
                    &format!("SYNC: {e}"),
                )
            }
        };
        self.shard.await_revision(req.route_revision).await;
        let view = self.shard.view();
        let route = view.route(&req.journal, req.spec.replication);
        let refuse = |status: Status, message: String| {
            let body = rotary_net::repl::SyncReply {
                message,
                route: route.ids(),
                route_revision: view.revision(),
                ..Default::default()
            };
            sink.push(req.seq, status, serde_json::to_vec(&body).expect("json"));
        };
        if req.spec.name != req.journal || req.spec.validate().is_err() {
            return refuse(Status::BAD_REQUEST, "SYNC carries an invalid spec".into());
        }
        if let Err(e) = crate::specs::check_revision(req.revision) {
            return refuse(Status::BAD_REQUEST, format!("SYNC: {e}"));
        }
        if rotary_net::shard_of(&req.journal, self.shard.shards) != self.shard.index {
            return refuse(
                Status::WRONG_ROUTE,
                format!(
                    "journal {:?} is not on shard {}",
                    req.journal, self.shard.index
                ),
            );
        }
        // A broker that is the journal's primary by its own view, or that
        // neither holds the journal nor is in its route, has nothing to
        // synchronize: it answers at once and changes nothing (a broker the
        // journal left, which holds it, answers with its head once its
        // appends are through, below).
        let known = self.shard.journal(&req.journal).is_some();
        if route.is_primary(&view.me) || (!known && !route.contains(&view.me)) {
            let msg = crate::shard::route_disagreement(&view.me, &route, &req);
            return refuse(Status::WRONG_ROUTE, msg);
        }
        // Specs come to every broker from one source (etcd, or the
        // cluster file): a replica whose spec differs from the primary's has
        // not taken a change yet, or the primary has not, and the primary
        // tries again.
        if let Some(why) = self.spec_disagreement(&req) {
            return refuse(why.0, why.1);
        }
        let Some(j) = self.shard.journal(&req.journal) else {
            return refuse(Status::JOURNAL_NOT_FOUND, "journal vanished".into());
        };
        self.abort_replica_ops(&j);
        j.borrow_mut()
            .replica
            .sync_waiters
            .push(SyncWaiter { sink, req });
        self.shard.mark_ready(&j);
    }
}
