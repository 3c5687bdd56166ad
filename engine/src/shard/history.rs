//! Fragment history: uploads, store listings, prune, reset-head, spare files.

use super::*;

impl Shard {
    /// Hands the journal's sealed, not yet uploaded fragments to the
    /// uploader. A full queue leaves them for the next tick.
    pub(super) fn queue_uploads(&self, jm: &mut Journal) {
        let Some(store) = jm.spec.fragment.stores.first().cloned() else {
            return;
        };
        let outside = match self.role(&jm.spec) {
            // The primary uploads. So does a broker outside the route, for
            // fragments it still holds: the route's members may never have
            // had those bytes. (A fragment uploaded twice has the same name
            // and bytes both times.)
            Role::Replica(_) => return,
            Role::Outside(_) => true,
            Role::Primary(_) => false,
        };
        let codec = jm.spec.fragment.compression_codec;
        let name = jm.name.clone();
        for f in jm.files.fragments.iter_mut() {
            if f.held && !outside {
                // Its primary now: what it holds is the journal's history.
                f.held = false;
            }
            if f.uploaded || f.uploading || f.held {
                continue;
            }
            let job = UploadJob {
                journal: name.clone(),
                begin: f.begin,
                end: f.end,
                sha1: f.sha1,
                path: f.path.clone(),
                codec,
                store: store.clone(),
                done: self.upload_done.clone(),
            };
            if self.uploader.try_upload(job).is_err() {
                break;
            }
            self.uploads_in_flight
                .borrow_mut()
                .insert((name.clone(), f.begin, f.end, f.sha1));
            f.uploading = true;
        }
    }

    /// Applies upload outcomes reported by the uploader pool.
    pub(super) async fn upload_results(self: Rc<Self>, rx: async_channel::Receiver<UploadDone>) {
        while let Ok(done) = rx.recv().await {
            self.uploads_in_flight.borrow_mut().remove(&(
                done.journal.clone(),
                done.begin,
                done.end,
                done.sha1,
            ));
            let Some(j) = self.journals.borrow().get(&done.journal).cloned() else {
                continue;
            };
            let mut jm = j.borrow_mut();
            // The SHA-1 tells a fragment from one of the same span of a
            // deleted journal of the same name, whose upload may end late.
            let Some(f) = jm
                .files
                .fragments
                .iter_mut()
                .find(|f| f.begin == done.begin && f.end == done.end && f.sha1 == done.sha1)
            else {
                continue;
            };
            f.uploading = false;
            match done.result {
                Ok(stored) => {
                    f.uploaded = true;
                    // A file found at start is then known to hold its
                    // bytes: its first read need not hash it again.
                    f.verified |= done.local_checked;
                    jm.index.insert_remote(stored);
                    self.publish_conflicts(&mut jm);
                    *self.store_error.borrow_mut() = None;
                    if let Some(store) = jm.spec.fragment.stores.first() {
                        if self.shared_failures.worked(SharedWork::Upload, store) {
                            tracing::info!(store = %store, journal = %done.journal, "uploads succeed again");
                        }
                    }
                }
                Err(e) => {
                    // Only a local fragment that does not match its name,
                    // or whose disk failed for good, is beyond retrying:
                    // store-side refusals (a bucket being recreated, a
                    // credential being fixed) may pass.
                    let beyond_retrying = match &e {
                        rotary_uploader::StoreError::LocalCorrupt { .. } => true,
                        rotary_uploader::StoreError::LocalIo {
                            errno: Some(errno), ..
                        } => rotary_proto::disk::errno_is_final(*errno),
                        _ => false,
                    };
                    if !beyond_retrying {
                        let store = jm.spec.fragment.stores.first().map_or("", |s| s.as_str());
                        match self.shared_failures.failed(SharedWork::Upload, store) {
                            Some(held) => {
                                tracing::warn!(store, journal = %done.journal, begin = done.begin, end = done.end, error = %e, since_last_logged = held, "upload failed; retrying, logged once a minute per store while it lasts");
                            }
                            None => {
                                tracing::debug!(journal = %done.journal, begin = done.begin, end = done.end, error = %e, "upload failed; will retry");
                            }
                        }
                    } else {
                        // Park it for an operator. It stays counted against
                        // the spool budget, so appends are eventually
                        // refused naming this error.
                        f.uploading = true;
                        if let rotary_uploader::StoreError::LocalCorrupt { why, .. } = &e {
                            f.corrupt = Some(why.clone());
                        }
                        tracing::error!(journal = %done.journal, begin = done.begin, end = done.end, error = %e, "upload failed permanently; not retrying, and a corrupt file's span is no longer read from it");
                    }
                    *self.store_error.borrow_mut() = Some(e.to_string());
                }
            }
            drop(jm);
            // Both walk every journal: once per burst of results.
            if rx.is_empty() {
                self.recount_unuploaded();
                self.evict_cache();
            }
        }
    }

    /// Recomputes the sealed bytes awaiting upload.
    ///
    /// Runs over every journal of the shard, so it runs once a tick and
    /// once per burst of upload results, not per listing or per upload: a
    /// shard may hold tens of thousands of journals. Between two counts the
    /// figure only runs high (seals add to it at once), so the budget it
    /// guards is never overrun.
    pub(super) fn recount_unuploaded(&self) {
        let mut total = 0;
        for j in self.journals.borrow().values() {
            let jm = j.borrow();
            if !jm.has_stores() {
                continue;
            }
            let waiting: u64 = jm
                .files
                .fragments
                .iter()
                .filter(|f| !f.uploaded)
                .map(|f| f.end - f.begin)
                .sum();
            // The route is worked out only for the few journals with
            // fragments awaiting upload.
            if waiting > 0 && self.is_primary(&jm.spec) {
                total += waiting;
            }
        }
        self.unuploaded_bytes.set(total);
    }

    /// Sets the shard's gauges that measure its journals as a whole: bytes
    /// on local disk, the largest replica lag, and journals whose stores
    /// are yet to be listed once. Walks every journal, so it runs once a
    /// tick (and as the shard starts), like [`Shard::recount_unuploaded`].
    pub(super) fn measure_journals(&self) {
        let (mut on_disk, mut lag_max, mut unlisted) = (0u64, 0u64, 0u64);
        for j in self.journals.borrow().values() {
            let jm = j.borrow();
            on_disk += jm
                .files
                .fragments
                .iter()
                .map(|f| f.end - f.begin)
                .sum::<u64>();
            on_disk += jm
                .files
                .spool
                .as_ref()
                .map_or(0, |s| s.committed().saturating_sub(s.begin()));
            // Committed here, not yet published: the acks of its replicas
            // are awaited.
            lag_max = lag_max.max(jm.heads.local_head().saturating_sub(jm.heads.head()));
            if jm.has_stores() && !jm.index.loaded && !jm.index.forgotten && !jm.deleted {
                unlisted += 1;
            }
        }
        self.metrics.spool_bytes.set_own(on_disk);
        self.metrics.replica_lag_bytes.set_own(lag_max);
        self.metrics.journals_unlisted.set_own(unlisted);
    }

    /// Drops the oldest uploaded local fragments once the local copies of
    /// uploaded fragments exceed the cache budget.
    pub(super) fn evict_cache(&self) {
        let mut cached: Vec<(SystemTime, u64, JournalRef, u64)> = Vec::new();
        let mut total = 0;
        for j in self.journals.borrow().values() {
            for f in j.borrow().files.fragments.iter().filter(|f| f.uploaded) {
                total += f.end - f.begin;
                cached.push((f.sealed_at, f.end - f.begin, j.clone(), f.begin));
            }
        }
        if total <= self.local_cache_bytes {
            return;
        }
        cached.sort_by_key(|c| c.0);
        for (_, len, j, begin) in cached {
            if total <= self.local_cache_bytes {
                break;
            }
            let mut jm = j.borrow_mut();
            if let Some(at) = jm
                .files
                .fragments
                .iter()
                .position(|f| f.begin == begin && f.uploaded)
            {
                let f = jm.files.fragments.remove(at);
                self.retire_fragment(&jm, f);
                total -= len;
            }
        }
    }

    /// Lists the journal's stores in the background and merges the result.
    ///
    /// At most [`LISTINGS_IN_FLIGHT_MAX`] listings of a shard run at once;
    /// the others wait in a queue, a journal not yet listed ahead of those
    /// listed before. A shard of tens of thousands of journals would
    /// otherwise start all their listings in the same tick (at start, and
    /// again every `refresh_interval`), and their results would hold up
    /// its appends for hundreds of milliseconds.
    pub(super) fn refresh_listing(&self, j: &JournalRef) {
        self.start_listing(j, false);
    }

    /// Starts the first listing of a journal's stores at once, whatever
    /// the queue, because a request waits for it: after a start, a shard
    /// of tens of thousands of journals with stores lists them all, and an
    /// append to a journal near the end of that queue would otherwise wait
    /// for every listing ahead of it (tens of seconds on S3). Once per
    /// journal; a listing under way is left to end.
    pub fn hurry_first_listing(&self, j: &JournalRef) {
        {
            let mut jm = j.borrow_mut();
            if jm.index.loaded
                || jm.index.listings.running
                || jm.index.listings.hurried
                || !jm.has_stores()
            {
                return;
            }
            jm.index.listings.hurried = true;
        }
        metrics::add(&self.metrics.listings_hurried, 1);
        self.start_listing(j, true);
    }

    /// [`Shard::hurry_first_listing`] from where the journal is borrowed:
    /// on a task of its own, right after.
    /// Readies a journal once `wait` has passed (its rate admits more
    /// bytes then). The caller sets the journal's `rate_timer`, which keeps
    /// it to one timer at a time.
    pub(super) fn ready_after(&self, j: &JournalRef, wait: std::time::Duration) {
        let me = self.me.borrow().clone();
        let j = j.clone();
        compio::runtime::spawn(async move {
            compio::time::sleep(wait).await;
            j.borrow_mut().queue.rate_timer = false;
            if let Some(shard) = me.upgrade() {
                shard.mark_ready(&j);
            }
        })
        .detach();
    }

    pub(super) fn hurry_first_listing_soon(&self, j: &JournalRef) {
        let me = self.me.borrow().clone();
        let j = j.clone();
        compio::runtime::spawn(async move {
            if let Some(shard) = me.upgrade() {
                shard.hurry_first_listing(&j);
            }
        })
        .detach();
    }

    /// Logs a store listing's failure once a minute per store, and its
    /// recovery once.
    fn log_listing(&self, stores: &[String], name: &str, err: Option<&(&String, String)>) {
        match err {
            None => {
                for store in stores {
                    if self.shared_failures.worked(SharedWork::Listing, store) {
                        tracing::info!(store = %store, journal = %name, "listing the fragment store works again");
                    }
                }
            }
            Some((store, e)) => match self.shared_failures.failed(SharedWork::Listing, store) {
                Some(held) => {
                    tracing::warn!(store = %store, journal = %name, error = %e, since_last_logged = held, "listing the fragment store failed; retrying, logged once a minute per store while it lasts");
                }
                None => {
                    tracing::debug!(journal = %name, error = %e, "listing the fragment store failed");
                }
            },
        }
    }

    /// After a journal's listing: a replica drops its copies the store
    /// holds, the journal's waiting appends go ahead, and the listings
    /// waiting for a free slot start.
    fn listing_done(&self, j: &JournalRef) {
        let mut jm = j.borrow_mut();
        if !self.is_primary(&jm.spec) {
            // A replica's copies are dropped once the store holds them.
            let (gone, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut jm.files.fragments)
                .into_iter()
                .partition(|f| f.uploaded);
            jm.files.fragments = kept;
            for f in gone {
                self.retire_fragment(&jm, f);
            }
        }
        drop(jm);
        // Fragments the listing found uploaded leave the spool
        // budget's count at the next tick.
        // Appends waiting for the index go ahead (or are refused).
        self.mark_ready(j);
        self.listings_in_flight
            .set(self.listings_in_flight.get() - 1);
        loop {
            let next = self.listings_waiting.borrow_mut().pop_front();
            let Some(next) = next else { break };
            // Not queued any more: its listing was started
            // meanwhile (hurried, or by the tick).
            if std::mem::take(&mut next.borrow_mut().index.listings.queued) {
                self.refresh_listing(&next);
            }
            if self.listings_in_flight.get() >= LISTINGS_IN_FLIGHT_MAX {
                break;
            }
        }
    }

    pub(super) fn start_listing(&self, j: &JournalRef, hurried: bool) {
        if !hurried && self.listings_in_flight.get() >= LISTINGS_IN_FLIGHT_MAX {
            let mut jm = j.borrow_mut();
            if !jm.index.listings.running && !jm.index.listings.queued && jm.has_stores() {
                jm.index.listings.queued = true;
                let mut waiting = self.listings_waiting.borrow_mut();
                if jm.index.loaded {
                    waiting.push_back(j.clone());
                } else {
                    waiting.push_front(j.clone());
                }
            }
            return;
        }
        let (stores, name) = {
            let mut jm = j.borrow_mut();
            jm.index.listings.queued = false;
            if jm.index.listings.running || !jm.has_stores() || jm.deleted {
                return;
            }
            // A journal deleted and created again lists its stores only once
            // the uploads of the deleted one have ended: listed before, the
            // new journal would start at 0 and an old fragment land beside
            // its own. Listed after, it holds the old history (appends
            // answer INDEX_HAS_GREATER_OFFSET until a reset-head).
            if !jm.index.loaded
                && self
                    .uploads_in_flight
                    .borrow()
                    .iter()
                    .any(|(n, begin, end, sha1)| {
                        *n == jm.name
                            && !jm
                                .files
                                .fragments
                                .iter()
                                .any(|f| f.begin == *begin && f.end == *end && f.sha1 == *sha1)
                    })
            {
                return;
            }
            jm.index.listings.running = true;
            (jm.spec.fragment.stores.clone(), jm.name.clone())
        };
        self.listings_in_flight
            .set(self.listings_in_flight.get() + 1);
        metrics::add(&self.metrics.listings, 1);
        let mark = j.borrow().index.listing_mark();
        let uploader = self.uploader.clone();
        let j = j.clone();
        let me = self.me.borrow().clone();
        compio::runtime::spawn(async move {
            let mut all = Vec::new();
            let mut err = None;
            for store in &stores {
                match uploader.list(store, &name).await {
                    Ok(v) => all.extend(v),
                    Err(e) => {
                        err = Some((store, e.to_string()));
                        break;
                    }
                }
            }
            if err.is_none() {
                compare_overlaps(&uploader, &j, &all).await;
            }
            let shard = me.upgrade();
            if let Some(shard) = &shard {
                shard.log_listing(&stores, &name, err.as_ref());
            }
            {
                let mut jm = j.borrow_mut();
                jm.index.listings.running = false;
                jm.index.forgotten = false;
                jm.index.listings.last = Some(crate::clock::now());
                match err {
                    None => {
                        if let Some(shard) = &shard {
                            jm.index.outside_route =
                                matches!(shard.role(&jm.spec), Role::Outside(_));
                        }
                        jm.set_listing(all, mark);
                        if let Some(shard) = &shard {
                            shard.publish_conflicts(&mut jm);
                        }
                        jm.index.loaded = true;
                        jm.index.error = None;
                    }
                    Some((_, e)) => {
                        jm.index.error = Some(e);
                        // Reads waiting for a first listing get its error.
                        jm.readers.committed.notify(usize::MAX);
                    }
                }
            }
            if let Some(shard) = shard {
                shard.listing_done(&j);
            }
        })
        .detach();
    }

    /// Logs and counts the fragments the journal's index found conflicting
    /// since it was last asked, each once, and tells the broker's other
    /// shards (PRUNE may run on any of them) what is conflicting now.
    pub(super) fn publish_conflicts(&self, jm: &mut Journal) {
        for c in jm.index.take_new_conflicts() {
            let f = &c.fragment;
            tracing::warn!(journal = %jm.name, store = %f.store, key = %f.key, begin = f.begin, end = f.end, why = %c.why, "a store fragment disagrees with the journal's committed history; it is never served, and `rotary journals prune` removes it");
            metrics::add(&self.metrics.fragments_conflicting, 1);
        }
        let now: Vec<_> = jm
            .index
            .conflicting()
            .iter()
            .map(|c| (c.fragment.clone(), c.why.clone()))
            .collect();
        self.uploader.conflicts().set(&jm.name, now);
    }

    /// Asks the flusher to move the write head to the end of the index.
    pub fn request_reset_head(&self, j: &JournalRef, outbox: Rc<Outbox>, request_id: u64) {
        j.borrow_mut()
            .index
            .reset_waiters
            .push((outbox, request_id));
        self.mark_ready(j);
    }

    /// Whether this shard uploads the journal's fragments: as its primary,
    /// or as a broker outside its route that still holds bytes of it (a
    /// drained broker, whose copy may be the last of what it holds beyond
    /// the store: the members that replaced it joined at the head).
    fn uploads(&self, spec: &rotary_net::JournalSpec) -> bool {
        !matches!(self.role(spec), Role::Replica(_))
    }

    /// Seals every open spool of journals with stores this shard uploads
    /// and waits, at most `timeout`, until every sealed fragment is in its
    /// store.
    pub async fn flush_to_stores(&self, timeout: std::time::Duration) -> bool {
        let journals: Vec<JournalRef> = self.journals.borrow().values().cloned().collect();
        for j in &journals {
            let wants = {
                let jm = j.borrow();
                jm.has_stores()
                    && self.uploads(&jm.spec)
                    && jm.files.spool.as_ref().is_some_and(|s| !s.is_empty())
            };
            if wants {
                j.borrow_mut().files.seal_requested = true;
                self.mark_ready(j);
            }
        }
        let deadline = crate::clock::now() + timeout;
        loop {
            let pending = journals.iter().any(|j| {
                let jm = j.borrow();
                jm.has_stores()
                    && self.uploads(&jm.spec)
                    && (jm.files.seal_requested
                        || jm.files.fragments.iter().any(|f| !f.uploaded && !f.held))
            });
            if !pending {
                return true;
            }
            if crate::clock::now() >= deadline {
                return false;
            }
            for j in &journals {
                let mut jm = j.borrow_mut();
                if jm.has_stores() {
                    self.queue_uploads(&mut jm);
                }
            }
            compio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }

    /// Deletes store fragments older than their journal's retention, and
    /// those the journal's index judged conflicting (PROTOCOL §7), whatever
    /// their age.
    pub async fn prune(
        &self,
        selector: &rotary_net::LabelSelector,
        dry_run: bool,
    ) -> Result<Vec<serde_json::Value>, String> {
        let now = crate::clock::wall();
        // Every store is listed before anything is deleted, so that a
        // store that cannot be listed fails the prune, not half of it.
        let mut due = Vec::new();
        for spec in self.specs.all() {
            let retention = spec.fragment.retention;
            if !selector.matches_journal(&spec.name, &spec.labels) {
                continue;
            }
            let conflicting = self.uploader.conflicts().of(&spec.name);
            if retention.is_zero() && conflicting.is_empty() {
                continue;
            }
            for store in &spec.fragment.stores {
                let listed = self
                    .uploader
                    .list(store, &spec.name)
                    .await
                    .map_err(|e| format!("nothing was pruned: {e}"))?;
                for f in listed {
                    let age = now.duration_since(f.mod_time).unwrap_or_default();
                    let why = conflicting
                        .iter()
                        .find(|(c, _)| c.store == f.store && c.key == f.key)
                        .map(|(_, why)| why.clone());
                    if why.is_some() || (!retention.is_zero() && age > retention) {
                        due.push((f, age, why));
                    }
                }
            }
        }
        let mut out = Vec::new();
        for (f, age, why) in due {
            if !dry_run {
                if let Err(e) = self.uploader.delete(&f).await {
                    let keys: Vec<String> = out
                        .iter()
                        .map(|v: &serde_json::Value| {
                            let text = |k: &str| v[k].as_str().unwrap_or_default().to_string();
                            text("store") + &text("key")
                        })
                        .collect();
                    return Err(format!(
                        "{e}; {} fragment(s) were pruned before it: [{}]",
                        keys.len(),
                        keys.join(", ")
                    ));
                }
                self.uploader.conflicts().remove(&f);
                // Reads of this shard's journals go around it at once; other
                // shards find it gone when they next list or read it.
                if let Some(j) = self.journals.borrow().get(&f.journal) {
                    j.borrow_mut().index.drop_remote(&f, false);
                }
            }
            let mut pruned = serde_json::json!({
                "journal": f.journal,
                "begin": f.begin,
                "end": f.end,
                "sha1": hex::encode(f.sha1),
                "store": f.store,
                "key": f.key,
                "age_secs": age.as_secs(),
            });
            if let Some(why) = why {
                pruned["conflicting"] = why.into();
            }
            out.push(pruned);
        }
        Ok(out)
    }

    /// Writes the deletion of journal `name` to the commit log (into the
    /// page cache, as a turn writes its records), before a single node's
    /// DELETE takes its spec and files away. The other order let a log
    /// that failed right then keep the journal's last commit record with
    /// no deletion after it: a restart gave a journal created again under
    /// the name the old one's head, though nothing was appended to it, as
    /// recovery must for a journal whose files were lost (it cannot tell
    /// the two apart). Fails, the journal untouched, if the log cannot
    /// take the record.
    pub async fn record_deletion(&self, name: &str) -> Result<(), Failure> {
        loop {
            // The flusher takes the log out while it syncs it or switches
            // to a compacted file.
            let back = self.log_back.listen();
            if self.log.borrow().is_some() {
                break;
            }
            back.await;
        }
        if let Some(why) = self.log_disk_failure() {
            return Err(Failure::new(Status::DISK_FAILED, why));
        }
        if let Some(log) = self.log.borrow_mut().as_mut() {
            log.record_delete(name);
        }
        self.write_log().map_err(|e| {
            self.park_shard_if_final(&e);
            let msg = format!("recording the deletion in the commit log: {e}");
            Failure::new(storage_status(&e), msg)
        })
    }

    /// Deletes a journal owned by this shard (a single node's DELETE): its
    /// spec, then the journal. Returns false if it did not exist.
    pub fn delete_journal(&self, name: &str) -> Result<bool, crate::EngineError> {
        let existed = self.specs.delete(name)?;
        self.drop_journal(name);
        Ok(existed)
    }

    /// Drops the journals of this shard whose specs were deleted since it
    /// last looked, by a mirror of etcd or of a cluster file. From the
    /// tick, where no journal is borrowed.
    pub(super) fn drop_deleted_journals(&self) {
        let version = self.specs.version();
        let seen = self.drops_seen.replace(version);
        if version == seen {
            return;
        }
        let names: Vec<String> = match self.specs.changes_since(seen) {
            Some(names) => names,
            None => self.journals.borrow().keys().cloned().collect(),
        };
        for name in names {
            let held = self.journals.borrow().contains_key(&name);
            if held && self.specs.get(&name).is_none() {
                tracing::info!(journal = %name, "the journal's spec was deleted: deleting the journal");
                self.drop_journal(&name);
            }
        }
    }

    /// Lets go of a journal whose spec is gone: refuses its queued
    /// appends and removes its local files and its registers.
    fn drop_journal(&self, name: &str) {
        if let Some(j) = self.journals.borrow_mut().remove(name) {
            let mut j = j.borrow_mut();
            j.deleted = true;
            let reply = AppendReply::default();
            for op in j.queue.waiting.drain(..) {
                op.reply_error(Status::JOURNAL_NOT_FOUND, &reply, "journal was deleted");
            }
            if let Some(a) = j.queue.active.take() {
                a.op.reply_error(Status::JOURNAL_NOT_FOUND, &reply, "journal was deleted");
            }
            j.readers.committed.notify(usize::MAX);
            self.trash_journal_dir(name);
            // Parent directories of other journals stay.
            let _ = std::fs::remove_dir(self.dir.join("journals").join(name));
        }
        // Its conflicting fragments are for a re-created journal's index
        // to judge again.
        self.uploader.conflicts().set(name, Vec::new());
        // The log owes the deletion until a write of it succeeds: one
        // dropped with a failed write would let a restart give the journal
        // re-created under this name the old one's head.
        self.states.borrow_mut().remove(name);
        self.unrestated.borrow_mut().insert(name.to_string());
        self.wake.notify(1);
    }

    /// Hands journal `name`'s directory to the reaper: renamed first, so
    /// that a journal of the same name can be created again at once; the
    /// reaper deletes the rest off the shard's thread. Returns whether
    /// there was one.
    pub(super) fn trash_journal_dir(&self, name: &str) -> bool {
        let dir = journal_dir(&self.dir, name);
        let trash = trash_dir(&self.dir);
        match std::fs::rename(&dir, &trash) {
            Ok(()) => crate::reaper::remove_dir_all(trash),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return false,
            // Not renamed: removed here, before the name can be reused.
            Err(_) => {
                let _ = std::fs::remove_dir_all(&dir);
            }
        }
        true
    }

    /// Gives up the spare spools once the disk has less than
    /// `SPARE_BYTES_MAX` free above the reserve: space for appends comes
    /// first.
    pub(super) fn check_spares(&self) {
        if self.spares.borrow().is_empty() {
            return;
        }
        let low = rotary_storage::spool::free_bytes_at(&self.dir).is_ok_and(|free| {
            free < self
                .disk_reserve_bytes
                .saturating_add(crate::spares::SPARE_BYTES_MAX)
        });
        if low {
            tracing::info!(
                bytes = self.spares.borrow().bytes(),
                "the disk is short of space: deleting the spare spools"
            );
            self.spares.borrow_mut().release();
        }
    }

    /// Lets go of a local fragment's file: kept as a spare when nothing
    /// can read or write it any more (in the store, not being uploaded, no
    /// read of its journal in flight, not known to be damaged), else
    /// deleted by the reaper: freed a step at a time unless something
    /// may still read it.
    pub(super) fn retire_fragment(&self, jm: &Journal, f: LocalFragment) {
        let unread = !f.uploading && jm.files.reads_in_flight == 0;
        let idle = unread && f.uploaded && f.corrupt.is_none();
        let len = f.end - f.begin;
        drop(f.file);
        if idle && self.spares.borrow_mut().give(&f.path, len) {
            metrics::add(&self.metrics.spares_kept, 1);
        } else if unread {
            crate::reaper::free_file(f.path);
        } else {
            crate::reaper::remove_file(f.path);
        }
    }

    /// Moves the write head to the end of the fragment index (after a
    /// broker restarted on an empty disk), sealing the open spool first.
    pub(super) async fn reset_head(&self, j: &JournalRef) {
        let (loaded, error) = {
            let mut jm = j.borrow_mut();
            jm.index.reset_pending = false;
            (jm.index.loaded, jm.index.error.clone())
        };
        if !loaded {
            let why = error.unwrap_or_else(|| "listing in progress".into());
            for (outbox, id) in j.borrow_mut().index.reset_waiters.drain(..) {
                refuse_unlisted(&outbox, id, &why);
            }
            return;
        }
        if j.borrow().files.spool.is_some() {
            self.seal(j).await;
        }
        let mut jm = j.borrow_mut();
        if jm.deleted {
            // Deleted while it sealed: no record of it may follow its
            // deletion's.
            let (status, msg) = self.unknown_journal(&jm.name);
            for (outbox, id) in jm.index.reset_waiters.drain(..) {
                outbox.error(Op::ADMIN_REPLY, status, id, &[], &msg);
            }
            return;
        }
        let local_end = jm.files.fragments.iter().map(|f| f.end).max().unwrap_or(0);
        let head = jm.heads.head().max(jm.index.remote_end()).max(local_end);
        if head > jm.heads.head() {
            // Recorded, so that a restart before the next append keeps the
            // new head: an empty spool beginning there (recovery starts a
            // journal at least at its last record's end).
            let st = JournalState {
                spool_begin: head,
                end: head,
                sha1: Sha1::new().finalize(),
                registers: jm.heads.local_registers().clone(),
                mid: Some(Midstate::of(head, &Sha1::new())),
            };
            if let Some(log) = self.log.borrow_mut().as_mut() {
                log.record_commit(&jm.name, &st);
            }
            if let Err(e) = self.write_log() {
                let msg = format!("recording the new write head: {e}");
                for (outbox, id) in jm.index.reset_waiters.drain(..) {
                    outbox.error(Op::ADMIN_REPLY, storage_status(&e), id, &[], &msg);
                }
                return;
            }
            self.states.borrow_mut().insert(jm.name.clone(), st);
        }
        jm.set_heads(head);
        let body =
            serde_json::to_vec(&serde_json::json!({ "journal": jm.name, "write_head": head }))
                .expect("json");
        for (outbox, id) in jm.index.reset_waiters.drain(..) {
            outbox.frame(Op::ADMIN_REPLY, Status::OK, id, &[], &body);
        }
        jm.readers.committed.notify(usize::MAX);
    }
}

/// Store fragments of a journal that overlap over different spans are
/// compared byte for byte before a listing is merged (the SHA-1s in their
/// names tell nothing of a part of either): at most this many pairs per
/// listing, the rest at later ones. A store without overlaps has none.
pub const OVERLAPS_COMPARED_PER_LISTING_MAX: usize = 16;

/// Compares the bytes of `listed` fragments that overlap and are not yet
/// judged (see [`Index::unchecked_pairs`](crate::journal::Index::unchecked_pairs)),
/// reading both from their stores on the uploader's threads, and records
/// the verdicts in the journal's index. A pair with an object found corrupt
/// is not compared again; one the store could not answer for is, at the
/// next listing.
async fn compare_overlaps(
    uploader: &rotary_uploader::Uploader,
    j: &JournalRef,
    listed: &[StoredFragment],
) {
    let pairs = j
        .borrow()
        .index
        .unchecked_pairs(listed, OVERLAPS_COMPARED_PER_LISTING_MAX);
    for (a, b) in pairs {
        let (lo, hi) = (a.begin.max(b.begin), a.end.min(b.end));
        let (ha, hb) = futures_util::future::join(
            uploader.sha1_of_range(&a, lo, hi),
            uploader.sha1_of_range(&b, lo, hi),
        )
        .await;
        let mut jm = j.borrow_mut();
        match (ha, hb) {
            (Ok(ha), Ok(hb)) => jm.index.record_verdict(&a, &b, ha == hb),
            (ha, hb) => {
                for (f, r) in [(&a, ha), (&b, hb)] {
                    match r {
                        // Left to the read that reaches it, which answers
                        // FRAGMENT_STORE_UNHEALTHY and drops it for good.
                        Err(e @ rotary_uploader::StoreError::Corrupt { .. }) => {
                            tracing::warn!(journal = %jm.name, key = %f.key, error = %e, "a store fragment is corrupt; not compared with the fragments it overlaps");
                            jm.index.give_up_pair(&a, &b);
                        }
                        Err(e) => {
                            tracing::debug!(journal = %jm.name, key = %f.key, error = %e, "comparing overlapping store fragments failed; compared again at the next listing");
                        }
                        Ok(_) => {}
                    }
                }
            }
        }
    }
}

/// Refuses admin request `id`, which needs the journal's fragment index,
/// because its store has not been listed yet (`why`: the listing's error,
/// or that it is in progress).
pub(crate) fn refuse_unlisted(outbox: &Outbox, id: u64, why: &str) {
    let msg = format!("fragment index not yet listed: {why}");
    let status = Status::FRAGMENT_STORE_UNHEALTHY;
    outbox.error(Op::ADMIN_REPLY, status, id, &[], &msg);
}
