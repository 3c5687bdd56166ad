//! APPEND and its chunks: a client's appends, queued on their journal's shard.

use super::*;

impl Conn {
    /// Refuses an append; the reply names the etcd revision of the route
    /// this broker acted on, so that a client sent elsewhere looks the
    /// route up again at least there.
    pub(super) fn append_error(&self, id: u64, status: Status, msg: &str) {
        let reply = AppendReply {
            route_revision: self.shard.view().revision(),
            ..AppendReply::default()
        };
        self.outbox
            .error(Op::APPEND_REPLY, status, id, &reply.encode(), msg);
    }

    /// Refuses an append at its first frame; its later chunks are dropped.
    pub(super) fn refuse_append(&mut self, frame: &Frame<'_>, status: Status, msg: &str) {
        self.append_error(frame.request_id, status, msg);
        if frame.flags & flag::MORE != 0 {
            self.discard_rest(frame.request_id);
        }
    }

    /// An APPEND whose request id an open append already uses: the
    /// chunks that follow could belong to either, so both are refused.
    fn refuse_reused_id(&mut self, frame: &Frame<'_>) {
        let id = frame.request_id;
        // The chunks that follow could belong to either: the open
        // append is rolled back too, rather than finished with the
        // other's bytes.
        if let Some((op, j)) = self.appends.remove(&id) {
            op.aborted.set(Some(AbortReason::Client));
            self.shard.mark_ready(&j);
        }
        // One forwarded is aborted where it went, which answers it.
        if let Some(addr) = self.forwarded.remove(&id) {
            if let Some(relay) = self.relays.get(&addr) {
                let mut abort = Vec::new();
                wire::encode_frame(
                    &mut abort,
                    Op::APPEND_CHUNK,
                    flag::ABORT,
                    Status::OK,
                    id,
                    &[],
                    &[],
                );
                relay.out.raw(&abort);
            }
        }
        self.refuse_append(
            frame,
            Status::BAD_REQUEST,
            "request id already in use by an open append; both are refused",
        );
    }

    /// Refuses an APPEND whose request id an open append uses, or that
    /// would open a stream past [`CONN_OPEN_APPENDS_MAX`]; true if it did.
    fn refused_by_connection(&mut self, frame: &Frame<'_>) -> bool {
        let id = frame.request_id;
        if self.appends.contains_key(&id) || self.forwarded.contains_key(&id) {
            self.refuse_reused_id(frame);
            return true;
        }
        let streams = self.appends.len() + self.forwarded.len();
        if frame.flags & flag::MORE != 0 && streams >= CONN_OPEN_APPENDS_MAX {
            let msg = format!(
                "the connection holds {streams} streamed appends open, the most it may; finish one first"
            );
            self.refuse_append(frame, Status::TOO_MANY_REQUESTS, &msg);
            return true;
        }
        false
    }

    pub(super) async fn append(&mut self, frame: Frame<'_>, body: Body<'_>) {
        let id = frame.request_id;
        let raw = body.raw();
        let req = match AppendRequest::decode(frame.meta) {
            Ok(r) => r,
            Err(e) => return self.refuse_append(&frame, e.status(), &e.to_string()),
        };
        if let Err(e) = validate_journal_name(&req.journal) {
            return self.refuse_append(&frame, Status::BAD_REQUEST, &e.to_string());
        }
        if self.refused_by_connection(&frame) {
            return;
        }
        let owner = rotary_net::shard_of(&req.journal, self.shard.shards);
        if owner != self.shard.index {
            let addr = self.shard.endpoints[owner as usize];
            if frame.flags & flag::MORE != 0 {
                self.forwarded.insert(id, addr);
            }
            metrics::add(&self.shard.metrics.cross_core_forwards, 1);
            return self.forward_to(addr, raw).await;
        }
        if self.shard.is_shutting_down() {
            return self.refuse_append(&frame, Status::SHUTTING_DOWN, "broker is shutting down");
        }
        if !self.shard.await_revision(req.route_revision).await {
            let msg = self.shard.behind_message(req.route_revision);
            return self.refuse_append(&frame, Status::WRONG_ROUTE, &msg);
        }
        let Some(j) = self.shard.journal(&req.journal) else {
            let (status, msg) = self.shard.unknown_journal(&req.journal);
            return self.refuse_append(&frame, status, &msg);
        };
        let role = self.shard.role(&j.borrow().spec);
        match role {
            Role::Primary(route) if !route.is_complete() => {
                let msg = route.incomplete_message();
                return self.refuse_append(&frame, Status::INSUFFICIENT_JOURNAL_BROKERS, &msg);
            }
            Role::Primary(_) => {}
            Role::Replica(route) | Role::Outside(route) => {
                let Some(primary) = route.primary() else {
                    return self.refuse_append(
                        &frame,
                        Status::NO_JOURNAL_PRIMARY_BROKER,
                        "the journal's route is empty",
                    );
                };
                if frame.flags & flag::DO_NOT_PROXY != 0 {
                    let msg = format!(
                        "broker {} is not the journal's primary; its primary is {} at {}",
                        self.shard.view().me,
                        primary.id,
                        self.shard.member_endpoint(primary, &req.journal)
                    );
                    return self.refuse_append(&frame, Status::NOT_JOURNAL_PRIMARY_BROKER, &msg);
                }
                let addr = self.shard.member_endpoint(primary, &req.journal);
                if frame.flags & flag::MORE != 0 {
                    self.forwarded.insert(id, addr);
                }
                metrics::add(&self.shard.metrics.proxied_requests, 1);
                // The primary must not proxy it on again (views may differ
                // for a moment while a cluster file changes).
                return self
                    .proxy_to(addr, &with_flags(raw, flag::DO_NOT_PROXY, 0))
                    .await;
            }
        }
        if j.borrow().spec.flags == JournalFlags::ReadOnly {
            return self.refuse_append(&frame, Status::NOT_ALLOWED, "journal is read-only");
        }
        let more = frame.flags & flag::MORE != 0;
        let (outbox, budget) = (self.outbox.clone(), self.budget.clone());
        let op = Rc::new(AppendOp::new(id, outbox, req, !more, budget));
        self.push_chunk(&op, &frame, body);
        if more {
            self.appends.insert(id, (op.clone(), j.clone()));
        }
        self.shard.submit_append(&j, op);
    }

    /// Queues a frame's payload on an append. A frame in its own buffer
    /// moves in whole (no copy); others are copied out of the read buffer.
    pub(super) fn push_chunk(&self, op: &Rc<AppendOp>, frame: &Frame<'_>, body: Body<'_>) {
        let chunk = match body {
            Body::Owned(chunk) => chunk,
            Body::Borrowed(_) => Chunk {
                data: Arc::new(frame.payload.to_vec()),
                range: 0..frame.payload.len(),
            },
        };
        if chunk.range.is_empty() {
            return;
        }
        self.budget.charge(chunk.range.len());
        op.received
            .set(op.received.get() + chunk.range.len() as u64);
        op.chunks.borrow_mut().push_back(chunk);
    }

    /// Takes a chunk of an open append. `misshapen` (from [`shape_error`])
    /// refuses it: the append is rolled back and answered with it, and its
    /// further chunks are dropped.
    pub(super) fn append_chunk(
        &mut self,
        frame: Frame<'_>,
        body: Body<'_>,
        misshapen: Option<(Status, String)>,
    ) {
        let id = frame.request_id;
        let more = frame.flags & flag::MORE != 0;
        if self.discard.contains(&id) {
            if !more {
                self.discard.remove(&id);
            }
            return;
        }
        // A refused chunk ends its append here; the rest of it is dropped.
        let ends = !more || misshapen.is_some();
        if more && misshapen.is_some() {
            self.discard_rest(id);
        }
        if let Some(&addr) = self.forwarded.get(&id) {
            if ends {
                self.forwarded.remove(&id);
            }
            // Forwarding is async only while connecting; chunks follow an
            // APPEND that already connected the relay. A refused chunk goes
            // on as the append's last: where it went, the same check
            // answers it and rolls the append back.
            if let Some(relay) = self.relays.get(&addr) {
                match misshapen {
                    Some(_) => relay.out.raw(&with_flags(body.raw(), 0, flag::MORE)),
                    None => relay.out.raw(body.raw()),
                }
            }
            return;
        }
        let Some((op, j)) = self.appends.get(&id).cloned() else {
            let (status, msg) = misshapen.unwrap_or_else(|| {
                (
                    Status::BAD_REQUEST,
                    "APPEND_CHUNK without an open append of this request id".into(),
                )
            });
            self.append_error(id, status, &msg);
            if more {
                self.discard_rest(id);
            }
            return;
        };
        if ends {
            self.appends.remove(&id);
        }
        if op.finished.get() {
            return;
        }
        if let Some((status, msg)) = misshapen {
            // Answered here; the rollback then has nothing to say.
            op.reply_error(status, &AppendReply::default(), &msg);
            op.aborted.set(Some(AbortReason::Client));
            self.shard.mark_ready(&j);
            return;
        }
        op.last_activity.set(crate::clock::now());
        if frame.flags & flag::ABORT != 0 {
            op.aborted.set(Some(AbortReason::Client));
            self.appends.remove(&id);
            self.shard.mark_ready(&j);
            return;
        }
        self.push_chunk(&op, &frame, body);
        if !more {
            op.complete.set(true);
        }
        self.shard.mark_ready(&j);
    }
}
