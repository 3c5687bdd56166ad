//! READ: a client's reads, served by this shard or relayed.

use super::*;

impl Conn {
    pub(super) async fn read(&mut self, frame: Frame<'_>, raw: &[u8]) {
        let id = frame.request_id;
        let req = match ReadRequest::decode(frame.meta) {
            Ok(r) => r,
            Err(e) => return self.refuse_read(id, e.status(), &e.to_string()),
        };
        if let Err(e) = validate_journal_name(&req.journal) {
            return self.refuse_read(id, Status::BAD_REQUEST, &e.to_string());
        }
        let owner = rotary_net::shard_of(&req.journal, self.shard.shards);
        if owner != self.shard.index {
            let addr = self.shard.endpoints[owner as usize];
            self.forward_read(id, addr);
            metrics::add(&self.shard.metrics.cross_core_forwards, 1);
            return self.forward_to(addr, raw).await;
        }
        if !self.shard.await_revision(req.route_revision).await {
            let msg = self.shard.behind_message(req.route_revision);
            return self.refuse_read(id, Status::WRONG_ROUTE, &msg);
        }
        let Some(j) = self.shard.journal(&req.journal) else {
            let (status, msg) = self.shard.unknown_journal(&req.journal);
            return self.refuse_read(id, status, &msg);
        };
        let role = self.shard.role(&j.borrow().spec);
        // A broker taking the journal over copies what this one holds.
        let takeover = frame.flags & flag::TAKEOVER != 0;
        if let (Role::Outside(route), false) = (role, takeover) {
            let Some(primary) = route.primary() else {
                return self.refuse_read(
                    id,
                    Status::NO_JOURNAL_PRIMARY_BROKER,
                    "the journal's route is empty",
                );
            };
            let addr = self.shard.member_endpoint(primary, &req.journal);
            if frame.flags & (flag::DO_NOT_PROXY | flag::PROXIED) != 0 {
                let msg = format!(
                    "broker {} is not in the journal's route {:?}; read from {} at {addr}",
                    self.shard.view().me,
                    route.ids(),
                    primary.id
                );
                return self.refuse_read(id, Status::NOT_JOURNAL_BROKER, &msg);
            }
            self.forward_read(id, addr);
            metrics::add(&self.shard.metrics.proxied_requests, 1);
            // Marked so that the primary, should its view of the cluster
            // differ from this broker's, refuses it instead of proxying it
            // on (or back).
            return self
                .proxy_to(addr, &with_flags(raw, flag::PROXIED, 0))
                .await;
        }
        if self.reads.borrow().contains_key(&id) {
            // A second read under one id could not be told apart, nor
            // cancelled.
            return self.refuse_read(
                id,
                Status::BAD_REQUEST,
                "request id already in use by an open read",
            );
        }
        let open = self.reads.borrow().len();
        if open >= CONN_OPEN_READS_MAX {
            let msg = format!(
                "the connection holds {open} reads open on this shard, the most it may; cancel one first"
            );
            return self.refuse_read(id, Status::TOO_MANY_REQUESTS, &msg);
        }
        let cancel = Rc::new(Cancel::default());
        self.reads.borrow_mut().insert(id, cancel.clone());
        let reads = self.reads.clone();
        let shard = self.shard.clone();
        let outbox = self.outbox.clone();
        let flags = frame.flags;
        compio::runtime::spawn(async move {
            let ask = ReadAsk {
                outbox,
                request_id: id,
                req,
                flags,
                cancel,
            };
            shard.read(j, ask).await;
            reads.borrow_mut().remove(&id);
        })
        .detach();
    }

    /// Refuses read `id` with `status`.
    fn refuse_read(&self, id: u64, status: Status, message: &str) {
        self.outbox
            .error(Op::READ_DONE, status, id, &self.refusal_meta(), message);
    }

    /// READ_DONE's metadata of a refused read: no offsets, and the etcd
    /// revision of the route this broker acted on.
    fn refusal_meta(&self) -> Vec<u8> {
        rotary_net::wire::encode_read_refusal(self.shard.view().revision())
    }
}
