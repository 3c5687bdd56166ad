//! What a journal's primary does beyond staging: proposing batches to replicas,
//! gathering their acks, synchronizing replicas, taking over journals, pulses.

use super::*;

/// Proposes a journal's batch to each of its replicas: the commit record
/// of every staged append. Returns what to wait for.
pub(super) fn propose(jm: &Journal, staged: &[Staged]) -> Vec<Wait> {
    let repl = jm.primary.repl.as_ref().expect("proposed with replicas");
    let mut waits = Vec::new();
    for (p, epoch) in &repl.pipelines {
        for s in staged {
            p.push(&Record::Commit {
                seq: s.seq,
                journal: &jm.name,
                begin: s.begin,
                end: s.end,
                fragment_sha1: s.point.sha.clone().finalize(),
                registers: s.registers.clone(),
            });
        }
        waits.push((p.clone(), *epoch, staged.iter().map(|s| s.seq).collect()));
    }
    waits
}

/// Forgets the acks of every wait: nobody will take them.
fn forget_waits(waits: &[Wait]) {
    for (p, epoch, seqs) in waits {
        for &seq in seqs {
            p.forget(seq, *epoch);
        }
    }
}

impl Shard {
    /// The brokers to ask for bytes of a journal beyond this primary's
    /// head before it gives out offsets: those of the journal's routes in
    /// the views before the current one, since its takeover was last
    /// settled (`since`), that are not in its route now. A route that
    /// gained no broker leaves none; when every member of an old route
    /// stays in the new one, the replicas' SYNC answers carry their heads
    /// anyway. With the topology version of the views they were found in.
    pub(super) fn takeover_sources(
        &self,
        spec: &rotary_net::JournalSpec,
        route: &Route,
        since: u64,
    ) -> (u64, Vec<Member>) {
        let views = self.views();
        let mut sources: Vec<Member> = Vec::new();
        // In a cluster on etcd a primary is only ever a member that was
        // consistent with the route before it (it holds every acknowledged
        // byte), and brokers that left hold nothing it lacks: nobody to ask.
        if views.current.assigned.is_some() {
            return (views.version, sources);
        }
        for view in views.since(since) {
            for m in view.route(&spec.name, spec.replication).members {
                if m.id != views.current.me
                    && !route.contains(&m.id)
                    && !sources.iter().any(|s| s.id == m.id)
                {
                    sources.push(m);
                }
            }
        }
        (views.version, sources)
    }

    /// Whether this primary of `j` has yet to ask the brokers of the
    /// journal's earlier routes for bytes beyond its head (see
    /// [`Shard::takeover_sources`]). With none to ask, it is settled here.
    pub(super) fn takeover_due(&self, j: &JournalRef, route: &Route) -> bool {
        let since = j.borrow().primary.takeover_version;
        if since == self.topology.version() {
            return false;
        }
        let (version, sources) = self.takeover_sources(&j.borrow().spec, route, since);
        if sources.is_empty() {
            j.borrow_mut().primary.takeover_version = version;
        }
        !sources.is_empty()
    }

    /// Answers a journal's replicated batches in commit order as its
    /// replicas ack them. One runs per journal while it has batches in
    /// flight, so a replica slow to answer holds up only the journals
    /// routed through it, not every journal of the shard. A batch a
    /// replica did not acknowledge is refused and taken back, and so is
    /// every batch after it, whatever their acks (they lie on its bytes).
    pub(super) async fn acker(self: Rc<Self>, j: JournalRef) {
        loop {
            let next = j.borrow_mut().primary.proposed.pop_front();
            let Some(f) = next else {
                j.borrow_mut().primary.acking = false;
                self.awaiting_acks.set(self.awaiting_acks.get() - 1);
                return;
            };
            let failure = if j.borrow().primary.is_unconfirmed(f.start.offset) {
                forget_waits(&f.waits);
                Some(Failure::new(
                    Status::REPLICATION_FAILED,
                    "an earlier append of the journal was not acknowledged by every replica; this one was taken back with it",
                ))
            } else {
                self.await_acks(&j, &f.waits).await
            };
            metrics::add(&self.metrics.replicated_batches, 1);
            match &failure {
                Some(e) => self.refuse_unconfirmed(&j, f.start, f.staged, e),
                None => self.publish(&j, f.staged),
            }
            {
                let mut jm = j.borrow_mut();
                jm.primary.inflight -= 1;
                if failure.is_some() {
                    jm.primary.repl = None;
                }
            }
            self.mark_ready(&j);
        }
    }

    /// Waits for every replica's acks of one batch: None if each was OK,
    /// else why not (logged once a minute per replica). A replica that
    /// leaves the journal's route is not waited for any longer: the tick
    /// wakes the wait when the cluster view changes ([`Shard::tick`]).
    async fn await_acks(&self, j: &JournalRef, waits: &[Wait]) -> Option<Failure> {
        for (i, (p, epoch, seqs)) in waits.iter().enumerate() {
            for (k, &seq) in seqs.iter().enumerate() {
                let failed = match self.ack_in_route(j, p, seq, *epoch).await {
                    Ok(ack) if ack.status == Status::OK => continue,
                    Ok(ack) => Failure::new(
                        Status::REPLICATION_FAILED,
                        format!(
                            "replica {} answered {}: {}",
                            p.peer,
                            ack.status,
                            String::from_utf8_lossy(&ack.body)
                        ),
                    ),
                    Err(e) => e,
                };
                // Nobody waits for the rest of the batch's acks.
                for &rest in &seqs[k + 1..] {
                    p.forget(rest, *epoch);
                }
                forget_waits(&waits[i + 1..]);
                self.log_replication_failure(j, &p.peer, &failed);
                return Some(failed);
            }
        }
        None
    }

    /// The ack of `seq` from `p`, unless `p` leaves the journal's route
    /// first (or this broker stops being its primary).
    async fn ack_in_route(
        &self,
        j: &JournalRef,
        p: &Rc<Pipeline>,
        seq: u64,
        epoch: u64,
    ) -> Result<rotary_net::repl::Ack, Failure> {
        use futures_util::future::{select, Either};
        if let Some(ack) = p.try_take(seq) {
            return Ok(ack);
        }
        loop {
            let moved = j.borrow().primary.route_moved.listen();
            let wait = std::pin::pin!(p.wait(seq, epoch));
            match select(wait, moved).await {
                Either::Left((ack, _)) => return ack,
                Either::Right(_) => {
                    let role = self.role(&j.borrow().spec);
                    let still = matches!(&role, Role::Primary(r) if r.contains(&p.peer));
                    if !still {
                        p.forget(seq, epoch);
                        return Err(Failure::new(
                            Status::REPLICATION_FAILED,
                            format!(
                                "replica {} left the journal's route before it acknowledged the append",
                                p.peer
                            ),
                        ));
                    }
                }
            }
        }
    }

    /// Logs a replica's failure to acknowledge a batch, once a minute per
    /// replica (the rest at debug).
    fn log_replication_failure(&self, j: &JournalRef, replica: &str, e: &Failure) {
        let journal = j.borrow().name.clone();
        match self
            .shared_failures
            .failed(SharedWork::Replication, replica)
        {
            Some(held) => {
                tracing::warn!(replica, %journal, error = %e.message, since_last_logged = held, "replication failed; the journal will synchronize again (logged once a minute per replica)");
            }
            None => {
                tracing::debug!(replica, %journal, error = %e.message, "replication failed");
            }
        }
    }

    /// Keeps the shard's runtime polling its ring, rather than sleeping,
    /// for up to `ack_poll` after each proposal while replicas' acks are
    /// awaited: they are a round trip away, and a thread that sleeps is
    /// woken (on a virtual machine, its vCPU too) only after they arrive.
    pub(super) async fn poll_for_acks(self: Rc<Self>) {
        let mut seen = self.proposals.get();
        loop {
            let l = self.proposed.listen();
            if self.proposals.get() == seen {
                l.await;
                continue;
            }
            drop(l);
            seen = self.proposals.get();
            let began = crate::clock::now();
            let mut until = began + self.ack_poll;
            while self.awaiting_acks.get() > 0 && crate::clock::now() < until {
                if self.proposals.get() != seen {
                    seen = self.proposals.get();
                    until = crate::clock::now() + self.ack_poll;
                }
                yield_now().await;
            }
            metrics::add(&self.metrics.ack_polls, 1);
            metrics::add(
                &self.metrics.ack_poll_micros,
                crate::clock::elapsed(began).as_micros() as u64,
            );
        }
    }

    /// Ends a streamed append that went idle, or whose client streams it
    /// below the minimum append rate (`min_rate`, bytes per second; 0:
    /// off). True: one was aborted.
    fn time_out_active(jm: &mut Journal, min_rate: u64) -> bool {
        // A journal capped lower lets its appends go at half its cap.
        let min_rate = match jm.queue.rate.rate() {
            0 => min_rate,
            cap => min_rate.min(cap / 2),
        };
        if let Some(a) = &mut jm.queue.active {
            // Bytes that arrived and wait (for the rate, or for
            // room) are no client's idleness.
            if crate::clock::elapsed(a.op.last_activity.get()) > APPEND_IDLE_TIMEOUT
                && !a.op.complete.get()
                && a.op.chunks.borrow().is_empty()
            {
                a.op.aborted.set(Some(AbortReason::Timeout));
                return true;
            } else if a.too_slow(min_rate, crate::clock::now()) {
                a.op.aborted.set(Some(AbortReason::TooSlow));
                return true;
            }
        }
        false
    }

    /// Queues a journal's sealed fragments for upload and lists its stores
    /// when due; a broker the journal was routed away from lets its index
    /// go instead of listing.
    fn refresh_history(&self, j: &JournalRef, role: Option<&Role>) {
        let refresh = {
            let mut jm = j.borrow_mut();
            if jm.has_stores() {
                self.queue_uploads(&mut jm);
                let every = jm.spec.fragment.refresh_interval;
                !jm.index.listings.running
                    && jm.index.listings.last.is_none_or(|t| {
                        crate::clock::elapsed(t) >= every
                            || (!jm.index.loaded
                                && !jm.index.forgotten
                                && crate::clock::elapsed(t) >= std::time::Duration::from_secs(1))
                    })
            } else {
                false
            }
        };
        if refresh {
            let outside = match role {
                Some(role) => matches!(role, Role::Outside(_)),
                None => matches!(self.role(&j.borrow().spec), Role::Outside(_)),
            };
            if outside && j.borrow_mut().forget_index() {
                metrics::add(&self.metrics.listings_spared, 1);
            } else {
                self.refresh_listing(j);
            }
        }
    }

    /// Seals due spools and times out idle streamed appends. Runs every second.
    pub async fn tick(self: &Rc<Self>) {
        let now = crate::clock::wall();
        self.check_spares();
        self.take_spec_changes();
        self.drop_deleted_journals();
        // After a change of the cluster file, a journal that this broker
        // became the primary of is taken over now (its bytes copied from
        // the brokers it left, while they still run) rather than at its
        // first request, however long that is in coming. Not at a start:
        // journals are taken over then at their first request, as before.
        let current = self.view();
        let before = std::mem::replace(&mut *self.tick_view.borrow_mut(), current.clone());
        let changed = !Arc::ptr_eq(&before, &current);
        let journals: Vec<JournalRef> = self.journals.borrow().values().cloned().collect();
        let mut takeovers = 0;
        for j in journals {
            let mut due = false;
            if changed {
                let mut jm = j.borrow_mut();
                if jm.primary.inflight > 0 {
                    // Its acker stops waiting for a replica that left.
                    jm.primary.route_moved.notify(usize::MAX);
                }
                let was_primary = before
                    .route(&jm.spec.name, jm.spec.replication)
                    .is_primary(&current.me);
                jm.primary.route_check |= !was_primary;
            }
            // Working out a route costs more than the rest of a quiet
            // journal's tick: it is needed only for a journal holding bytes,
            // with replicas to pulse, or whose route may have changed, of
            // tens of thousands on a shard.
            let holds_bytes = j
                .borrow()
                .files
                .spool
                .as_ref()
                .is_some_and(|s| !s.is_empty());
            // At most so many takeovers begin in a tick; the other
            // journals keep their check for the next.
            let check = j.borrow().primary.route_check && takeovers < TICK_TAKEOVERS_MAX;
            let role = {
                let jm = j.borrow();
                (holds_bytes || jm.spec.replication > 1 || check).then(|| self.role(&jm.spec))
            };
            if check {
                match &role {
                    // Checked again each tick until it is settled.
                    Some(Role::Primary(route))
                        if route.is_complete() && self.takeover_due(&j, route) =>
                    {
                        takeovers += 1;
                        due = true
                    }
                    _ => j.borrow_mut().primary.route_check = false,
                }
            }
            {
                let mut jm = j.borrow_mut();
                match &role {
                    Some(Role::Primary(_)) if jm.wants_seal(now) && holds_bytes => due = true,
                    // A journal routed away from this broker: its open spool
                    // is sealed and uploaded (see `prepare`).
                    Some(Role::Outside(_)) if holds_bytes => due = true,
                    _ => {}
                }
                if Self::time_out_active(&mut jm, self.min_append_rate) {
                    due = true;
                }
            }
            if due {
                self.mark_ready(&j);
            }
            if let Some(Role::Primary(route)) = &role {
                self.pulse(&j, route, false);
            }
            self.refresh_history(&j, role.as_ref());
        }
        self.recount_unuploaded();
        self.measure_journals();
    }

    /// Sends an empty append through an idle replicated journal, so that a
    /// broken replica is found (and the journal re-synchronized once it is
    /// back) without waiting for client traffic.
    /// `now` sends it without waiting for the journal to be idle a while
    /// (a read waits for the first SYNC).
    pub(super) fn pulse(&self, j: &JournalRef, route: &Route, now: bool) {
        {
            let mut jm = j.borrow_mut();
            let idle = jm.queue.waiting.is_empty()
                && jm.queue.active.is_none()
                && jm.primary.inflight == 0
                && !jm.primary.syncing
                && (now || crate::clock::elapsed(jm.queue.last_append) >= PULSE_IDLE);
            if route.members.len() < 2 || !route.is_complete() || !idle || jm.deleted {
                return;
            }
            jm.queue.last_append = crate::clock::now();
        }
        let outbox = Rc::new(Outbox::new());
        outbox.close();
        let req = rotary_net::wire::AppendRequest {
            journal: j.borrow().name.clone(),
            ..Default::default()
        };
        let budget = Rc::new(crate::budget::Budget::default());
        let op = Rc::new(AppendOp::new(0, outbox, req, true, budget));
        self.submit_append(j, op);
    }

    /// Rolls back the append open on the journal, if any, and answers it
    /// `REPLICATION_FAILED` with `why`: its content went over pipelines
    /// that are being replaced, or it lies on appends being taken back.
    pub(super) fn fail_open_append(&self, jm: &mut Journal, why: &str) {
        if let Some(a) = abandon_active(jm) {
            let reply = jm.heads.refusal();
            a.op.reply_error(Status::REPLICATION_FAILED, &reply, why);
            drop_budget(&a.op);
            jm.queue.waiting.pop_front();
            metrics::add(&self.metrics.append_failures, 1);
        }
    }

    /// Starts agreeing with the journal's replicas (SYNC) in the
    /// background; the journal stages nothing until they agree.
    pub(super) async fn begin_sync(&self, j: &JournalRef, route: Route) {
        {
            let mut jm = j.borrow_mut();
            let jm = &mut *jm;
            if jm.primary.syncing {
                return;
            }
            // An open append's content went over pipelines being replaced.
            self.fail_open_append(
                jm,
                "the journal's replication pipeline broke during the append; it was rolled back",
            );
            if jm.primary.inflight > 0 || !jm.queue.staged.is_empty() {
                // The acker marks the journal ready when they are answered.
                return;
            }
            jm.primary.repl = None;
        }
        let retry = j.borrow().primary.sync_retry.clone();
        if let Some((at, f)) = retry {
            if crate::clock::now() < at {
                // The last SYNC failed moments ago: answer with its cause.
                self.fail_queue(j, f.status, &f.message);
                return;
            }
        }
        // A fresh spool at the head on every member. (A primary without
        // replicas, asking only its earlier routes' brokers, keeps its spool
        // unless they are ahead of it.)
        if route.members.len() > 1
            && j.borrow()
                .files
                .spool
                .as_ref()
                .is_some_and(|s| !s.is_empty())
        {
            self.seal(j).await;
        }
        j.borrow_mut().primary.syncing = true;
        let Some(me) = self.me.borrow().upgrade() else {
            return;
        };
        let j = j.clone();
        compio::runtime::spawn(async move {
            let res = me.sync_replicas(&j, &route).await;
            let mut replicas: Vec<&str> = route.members.iter().skip(1).map(|m| m.id.as_str()).collect();
            replicas.sort_unstable();
            let replicas = replicas.join(",");
            {
                let mut jm = j.borrow_mut();
                jm.primary.syncing = false;
                match res {
                    Ok(repl) => {
                        metrics::add(&me.metrics.syncs, 1);
                        // In a cluster on etcd the assignments record the
                        // route: its members are consistent from now on.
                        if let Some(control) = me.topology.control() {
                            control.synced(&jm.name, route.ids());
                        }
                        jm.primary.repl = Some(repl);
                        jm.primary.sync_retry = None;
                        jm.primary.sync_failures = 0;
                        jm.primary.first_sync_pending = false;
                        if me.shared_failures.worked(SharedWork::Sync, &replicas) {
                            tracing::info!(replicas, journal = %jm.name, "replicas synchronized again");
                        }
                    }
                    Err(f) => {
                        if let Some(held) = me.shared_failures.failed(SharedWork::Sync, &replicas) {
                            tracing::warn!(replicas, journal = %jm.name, status = %f.status, error = %f.message, since_last_logged = held, "replicas did not synchronize; retrying after a pause that grows to 250 ms, logged once a minute per replica set while it lasts");
                        } else {
                            tracing::debug!(journal = %jm.name, status = %f.status, error = %f.message, "replicas did not synchronize");
                        }
                        // The first failure in a row is tried again at
                        // the next append (or at once, for appends that
                        // waited for this SYNC); later ones after a pause
                        // that grows (`sync_retry_after`), and a replica
                        // that does not answer after SYNC_RETRY, its
                        // failure answering appends meanwhile: no loop on
                        // a replica that is down.
                        jm.primary.sync_failures = jm.primary.sync_failures.saturating_add(1);
                        let wait = sync_retry_after(jm.primary.sync_failures, f.timed_out);
                        jm.primary.sync_retry = Some((crate::clock::now() + wait, f));
                    }
                }
                // Reads waiting for the first SYNC get its outcome.
                jm.readers.committed.notify(usize::MAX);
            }
            me.mark_ready(&j);
        })
        .detach();
    }

    /// SYNC of the route's replicas: the pipeline to each one that agrees,
    /// and into `ahead` those that hold more than `head`.
    async fn sync_members<'r>(
        &self,
        route: &'r Route,
        name: &str,
        head: u64,
        request: &dyn Fn() -> rotary_net::repl::SyncRequest,
        ahead: &mut Vec<(u64, LabelSet, &'r Member)>,
    ) -> Result<Vec<(Rc<Pipeline>, u64)>, Failure> {
        use rotary_net::repl::SyncReply;
        let mut pipelines = Vec::new();
        for m in &route.members[1..] {
            let (p, epoch, ack) = self.sync_member(m, name, request).await?;
            let reply: SyncReply = serde_json::from_slice(&ack.body).unwrap_or_default();
            match ack.status {
                Status::OK => pipelines.push((p, epoch)),
                Status::PROPOSAL_MISMATCH if reply.head > head => {
                    ahead.push((reply.head, reply.registers, m));
                }
                status => {
                    // A replica that read a later route: this broker
                    // catches up with it before it routes the journal again.
                    if status == Status::WRONG_ROUTE {
                        self.await_revision(reply.route_revision).await;
                    }
                    // Clients see a retryable status; the cause is named.
                    return Err(Failure::new(
                        Status::REPLICATION_FAILED,
                        format!(
                            "replica {} answered SYNC with {status}: {}",
                            m.id, reply.message
                        ),
                    ));
                }
            }
        }
        Ok(pipelines)
    }

    /// SYNC of one replica over its pipeline: the pipeline, the epoch of
    /// the connection it went over, and the answer. A connection made
    /// before this SYNC that breaks under it is most likely one to a
    /// replica that restarted since (the primary learns of it only when it
    /// uses the connection): it is made again and the SYNC sent once more,
    /// rather than failing the journal's appends for `SYNC_RETRY`. Once
    /// only: a replica that breaks a fresh connection too fails the SYNC.
    async fn sync_member(
        &self,
        m: &Member,
        name: &str,
        request: &dyn Fn() -> rotary_net::repl::SyncRequest,
    ) -> Result<(Rc<Pipeline>, u64, rotary_net::repl::Ack), Failure> {
        let p = self.pipeline(m, name);
        let stale = p.live_epoch();
        let epoch = p.connect().await?;
        match p.sync(&request()).await {
            Ok(ack) => Ok((p, epoch, ack)),
            Err(f) if stale == Some(epoch) && !f.timed_out && p.live_epoch() != Some(epoch) => {
                tracing::debug!(journal = %name, replica = %m.id, error = %f.message, "the pipeline to a replica broke at a SYNC; connecting again");
                let epoch = p.connect().await?;
                assert!(
                    stale != Some(epoch),
                    "a SYNC sent again on the same connection"
                );
                let ack = p.sync(&request()).await?;
                Ok((p, epoch, ack))
            }
            Err(f) => Err(f),
        }
    }

    /// Brokers the journal left: they answer WRONG_ROUTE with their head.
    /// Bytes only they hold are copied and the head moves past them, so
    /// that this primary's appends never reuse their offsets. One still
    /// routing the journal to itself has not seen the change, and may yet
    /// take appends: wait for it.
    async fn ask_sources<'r>(
        &self,
        sources: &'r [Member],
        name: &str,
        head: u64,
        request: &dyn Fn() -> rotary_net::repl::SyncRequest,
        ahead: &mut Vec<(u64, LabelSet, &'r Member)>,
    ) -> Result<(), Failure> {
        use rotary_net::repl::SyncReply;
        for m in sources {
            let silent_since = self.silent_sources.borrow().get(&m.id).copied();
            if silent_since.is_some_and(|at| {
                crate::clock::elapsed(at) < self.replica_ack_timeout * SILENT_SOURCE_PASSED_OVER
            }) {
                metrics::add(&self.metrics.takeover_sources_passed_over, 1);
                tracing::debug!(journal = %name, broker = %m.id, "a broker of one of the journal's earlier routes did not answer moments ago; taking the journal over without its bytes");
                continue;
            }
            let p = self.pipeline(m, name);
            let ack = match p.connect().await {
                Ok(_) => p.sync(&request()).await,
                Err(f) => Err(f),
            };
            let ack = match ack {
                Ok(ack) => {
                    self.silent_sources.borrow_mut().remove(&m.id);
                    ack
                }
                Err(f) => {
                    // Gone with its disk, or stopped: what only it held
                    // cannot be had (a journal of one replica). One that
                    // is stopped, or cut off, is not waited for again by
                    // every journal in turn.
                    if f.timed_out {
                        metrics::add(&self.metrics.takeover_sources_silent, 1);
                        self.silent_sources
                            .borrow_mut()
                            .insert(m.id.clone(), crate::clock::now());
                    }
                    tracing::warn!(journal = %name, broker = %m.id, error = %f.message, "a broker of one of the journal's earlier routes does not answer; taking the journal over without its bytes");
                    continue;
                }
            };
            let reply: SyncReply = serde_json::from_slice(&ack.body).unwrap_or_default();
            if reply.route.contains(&m.id) {
                return Err(Failure::new(
                    Status::REPLICATION_FAILED,
                    format!(
                        "broker {} still routes the journal to {:?}: it has not seen the cluster change yet",
                        m.id, reply.route
                    ),
                ));
            }
            if ack.status == Status::WRONG_ROUTE && reply.head > head {
                ahead.push((reply.head, reply.registers, m));
            }
        }
        Ok(())
    }

    /// Takes fragments copied from another broker as the journal's own:
    /// counted as copied and, for a journal with stores, against the spool
    /// budget until uploaded. Returns their bytes.
    pub(super) fn take_copied(&self, jm: &mut Journal, copied: Vec<LocalFragment>) -> u64 {
        let got: u64 = copied.iter().map(|f| f.end - f.begin).sum();
        metrics::add(&self.metrics.copied_bytes, got);
        if jm.has_stores() {
            self.unuploaded_bytes.set(self.unuploaded_bytes.get() + got);
        }
        jm.files.fragments.extend(copied);
        jm.files.fragments.sort_by_key(|f| (f.begin, f.end));
        got
    }

    /// Copies the bytes the brokers `ahead` of this primary hold beyond
    /// `head`, and moves the journal's heads and registers past them.
    async fn roll_forward(
        &self,
        j: &JournalRef,
        name: &str,
        head: u64,
        mut ahead: Vec<(u64, LabelSet, &Member)>,
    ) -> Result<(), Failure> {
        // Furthest first; among equals, route order.
        ahead.sort_by_key(|a| std::cmp::Reverse(a.0));
        let (to, their_registers) = (ahead[0].0, ahead[0].1.clone());
        // Only after a route change, or a restart without the data
        // (a replaced disk): replicas, or brokers the journal left,
        // hold bytes this primary does not. They are copied before the
        // head moves past them, so the primary serves and uploads them
        // like its own.
        tracing::warn!(journal = %name, from = head, to, broker = %ahead[0].2.id, "a broker is ahead; copying the journal's bytes from it and rolling forward");
        // Sealed first, if bytes are open in it (a primary without
        // replicas keeps its spool through a SYNC).
        if j.borrow()
            .files
            .spool
            .as_ref()
            .is_some_and(|s| !s.is_empty())
        {
            self.seal(j).await;
            if j.borrow().files.spool.is_some() {
                return Err(Failure::new(
                    Status::IO_ERROR,
                    "sealing the primary's spool before copying failed",
                ));
            }
        }
        let spool = j.borrow_mut().files.spool.take();
        if let Some(spool) = spool {
            // Empty: the SYNC started by sealing.
            let _ = spool.seal(false).await;
        }
        let (dir, durable, from) = {
            let jm = j.borrow();
            // What a listed store holds need not be copied.
            let listed = if jm.index.loaded {
                jm.index.remote_end()
            } else {
                0
            };
            (
                jm.files.dir.clone(),
                jm.spec.durability == Durability::Fsync,
                head.max(listed).min(to),
            )
        };
        let sources: Vec<(u64, std::net::SocketAddr)> = ahead
            .iter()
            .map(|(h, _, m)| (*h, self.member_endpoint(m, name)))
            .collect();
        let copied = crate::fetch::copy_from_each(&sources, name, from, to, &dir, durable)
            .await
            .map_err(|e| Failure::new(Status::REPLICATION_FAILED, e))?;
        let mut jm = j.borrow_mut();
        let held = self.take_copied(&mut jm, copied);
        if held < to - from {
            tracing::warn!(journal = %name, from, to, copied = held, "the replicas ahead hold only part of the span; the rest is read from the store, if one holds it");
        }
        if jm.has_stores() {
            self.queue_uploads(&mut jm);
        }
        jm.primary.rolled_forward_from(from);
        jm.take_over_to(to);
        // The registers go with the furthest history (fencing must not
        // step back).
        jm.heads.set_registers(their_registers);
        Ok(())
    }

    /// SYNC with every replica of `route`, and with the brokers of the
    /// journal's earlier routes that left it (see [`Shard::takeover_sources`]).
    /// A broker ahead of this primary (possible only after a route change)
    /// moves the journal forward to its head first, so offsets are never
    /// reused.
    pub(super) async fn sync_replicas(
        &self,
        j: &JournalRef,
        route: &Route,
    ) -> Result<PrimaryRepl, Failure> {
        use rotary_net::repl::SyncRequest;
        let since = j.borrow().primary.takeover_version;
        let (version, sources) = self.takeover_sources(&j.borrow().spec, route, since);
        for _ in 0..3 {
            let (spec, head, registers, name, taken_back) = {
                let jm = j.borrow();
                (
                    jm.spec.clone(),
                    jm.heads.local_head(),
                    jm.heads.local_registers().clone(),
                    jm.name.clone(),
                    jm.primary.taken_back().to_vec(),
                )
            };
            // Replicas ahead of this primary: head, registers, member.
            let mut ahead: Vec<(u64, LabelSet, &Member)> = Vec::new();
            let revision = self
                .specs
                .get_revised(&name)
                .filter(|r| r.spec == spec)
                .map_or(0, |r| r.revision);
            let request = || SyncRequest {
                seq: self.seq(),
                journal: name.clone(),
                spec: spec.clone(),
                revision,
                route: route.ids(),
                route_revision: self.view().revision(),
                head,
                registers: registers.clone(),
                taken_back: taken_back.clone(),
            };
            let pipelines = self
                .sync_members(route, &name, head, &request, &mut ahead)
                .await?;
            self.ask_sources(&sources, &name, head, &request, &mut ahead)
                .await?;
            if ahead.is_empty() {
                j.borrow_mut().primary.takeover_version = version;
                return Ok(PrimaryRepl {
                    members: route.ids(),
                    pipelines,
                    version,
                });
            }
            self.roll_forward(j, &name, head, ahead).await?;
        }
        Err(Failure::new(
            Status::PROPOSAL_MISMATCH,
            "replicas keep disagreeing with the primary's head",
        ))
    }
}
