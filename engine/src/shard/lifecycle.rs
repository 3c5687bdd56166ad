//! Starting a shard's background tasks and stopping it cleanly.

use super::*;

impl Shard {
    /// Spawns the shard's background tasks: the flusher, the once-a-second
    /// ticker, the upload-result consumer and the first store listings.
    pub fn start_background(self: &Rc<Self>) {
        compio::runtime::spawn(self.clone().flusher()).detach();
        if !self.ack_poll.is_zero() {
            compio::runtime::spawn(self.clone().poll_for_acks()).detach();
        }
        let ticker = self.clone();
        compio::runtime::spawn(async move {
            loop {
                compio::time::sleep(std::time::Duration::from_secs(1)).await;
                ticker.tick().await;
            }
        })
        .detach();
        if let Some(rx) = self.upload_done_rx.borrow_mut().take() {
            compio::runtime::spawn(self.clone().upload_results(rx)).detach();
        }
        if let Some(h) = &self.hasher {
            let caught_up = h.caught_up();
            let me = self.clone();
            compio::runtime::spawn(async move {
                while caught_up.recv().await.is_ok() {
                    let parked = std::mem::take(&mut *me.hash_parked.borrow_mut());
                    for j in &parked {
                        me.mark_ready(j);
                    }
                }
            })
            .detach();
        }
        let journals: Vec<JournalRef> = self.journals.borrow().values().cloned().collect();
        for j in journals {
            let mut jm = j.borrow_mut();
            if jm.has_stores() {
                self.queue_uploads(&mut jm);
                drop(jm);
                self.refresh_listing(&j);
            }
        }
        self.recount_unuploaded();
        self.measure_journals();
    }

    /// Asks the flusher to seal a journal's spool and reply on `outbox`.
    pub fn request_seal(&self, j: &JournalRef, outbox: Rc<Outbox>, request_id: u64) {
        {
            let mut jm = j.borrow_mut();
            jm.files.seal_requested = true;
            jm.files.seal_waiters.push((outbox, request_id));
        }
        self.mark_ready(j);
    }

    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down.get()
    }

    /// Registers a connection's outbox (see [`Shard::answers_sent`]).
    pub fn add_outbox(&self, outbox: &Rc<Outbox>) {
        let mut all = self.outboxes.borrow_mut();
        if all.len() == all.capacity() {
            all.retain(|o| o.strong_count() > 0);
        }
        all.push(Rc::downgrade(outbox));
    }

    /// Begins a clean stop: appends arriving from now on are refused,
    /// appends still streaming their content are rolled back and answered
    /// `SHUTTING_DOWN`, and reads end with `SHUTTING_DOWN` at the offset
    /// they reached, so that clients know what happened rather than see
    /// their connection break. Appends whose content is whole commit as
    /// usual ([`Shard::drained`] waits for them).
    pub fn begin_shutdown(&self) {
        self.shutting_down.set(true);
        let journals: Vec<JournalRef> = self.journals.borrow().values().cloned().collect();
        for j in journals {
            let mut streaming = false;
            {
                let jm = j.borrow();
                for op in jm
                    .queue
                    .waiting
                    .iter()
                    .chain(jm.queue.active.as_ref().map(|a| &a.op))
                {
                    if op.replica.is_none() && !op.complete.get() && op.aborted.get().is_none() {
                        op.aborted.set(Some(AbortReason::ShuttingDown));
                        streaming = true;
                    }
                }
            }
            if streaming {
                self.mark_ready(&j);
            }
        }
        self.stopping.notify(usize::MAX);
    }

    /// Waits, up to `limit`, until every connection has written out what
    /// it was given to send.
    pub async fn answers_sent(&self, limit: std::time::Duration) {
        let deadline = crate::clock::now() + limit;
        // Reads woken by the stop answer in their next step.
        yield_now().await;
        while crate::clock::now() < deadline {
            let pending = self
                .outboxes
                .borrow()
                .iter()
                .filter_map(|o| o.upgrade())
                .any(|o| !o.is_closed() && (o.backlog() > 0 || o.promised() > 0));
            if !pending {
                return;
            }
            compio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    }

    /// Waits until the flusher has nothing queued and is not mid-turn.
    pub async fn drained(&self) {
        loop {
            let l = self.idle.listen();
            if !self.busy.get() && self.ready.borrow().is_empty() {
                return;
            }
            l.await;
        }
    }
}
