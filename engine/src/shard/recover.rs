//! Opening a shard: its commit log, spools and local fragments, replayed into journals.

use super::*;

impl Shard {
    /// Makes the shard's directory ready (dropping files of journals
    /// deleted before a crash) and opens its commit log, refusing to go on
    /// when the log or the specs are missing but the shard holds data.
    async fn open_log(
        dir: &std::path::Path,
        specs: &SpecStore,
    ) -> Result<(CommitLog, HashMap<String, Replayed>), crate::EngineError> {
        let dir = dir.to_path_buf();
        std::fs::create_dir_all(dir.join("journals"))
            .map_err(|e| crate::EngineError::Io(dir.clone(), e))?;
        // Files of journals deleted before a crash, not yet removed.
        for entry in std::fs::read_dir(&dir)
            .map_err(|e| crate::EngineError::Io(dir.clone(), e))?
            .flatten()
        {
            if entry
                .file_name()
                .to_string_lossy()
                .starts_with(TRASH_PREFIX)
            {
                crate::reaper::remove_dir_all(entry.path());
            }
        }
        // Every start writes the commit log (`settle`) before any journal
        // has a file, so journal files without a log mean the log was lost:
        // recovering from nothing would drop every spool and give out
        // acknowledged offsets again. (A start that died before writing
        // the log left no journal files.)
        let log_path = CommitLog::path_in(&dir);
        let has_log = log_path
            .try_exists()
            .map_err(|e| crate::EngineError::Io(log_path.clone(), e))?;
        if !has_log {
            if let Some(file) = first_journal_file(&dir)? {
                let why = format!(
                    "{} is missing, but the shard holds journal files, such as {}",
                    log_path.display(),
                    file.display()
                );
                return Err(crate::EngineError::corrupt(log_path, why));
            }
        }
        let (log, replayed) = CommitLog::open(&dir).await.map_err(|e| match e {
            StorageError::Corrupt { path, why } => {
                let why = format!("{}: {why}", path.display());
                crate::EngineError::corrupt(path, why)
            }
            e => e.into(),
        })?;
        // Likewise, specs are stored before a journal has data: without
        // them, every journal of this shard would be forgotten, and one
        // applied again would start over beside its old files.
        if specs.file_was_missing() {
            let named = replayed.keys().min();
            let found = match named {
                Some(name) => Some(format!("its commit log names journal {name}")),
                None => first_journal_file(&dir)?
                    .map(|file| format!("it holds journal files, such as {}", file.display())),
            };
            if let Some(found) = found {
                let why = format!(
                    "{} is missing, but {} is no new shard: {found}",
                    specs.path().display(),
                    dir.display()
                );
                return Err(crate::EngineError::corrupt(specs.path(), why));
            }
        }
        Ok((log, replayed))
    }

    /// Recovers every journal of this shard from its files and the commit
    /// log's `replayed` records, then settles the log on what stands.
    async fn recover_journals(
        &self,
        replayed: &HashMap<String, Replayed>,
    ) -> Result<(), crate::EngineError> {
        let shard = self;
        let (index, shards) = (self.index, self.shards);
        // Journals whose last record did not stand, with what stands instead.
        let mut restated: Vec<(String, Option<JournalState>)> = Vec::new();
        let started = crate::clock::now();
        let mut recovery = Recovery {
            same_boot: rotary_storage::boot::recovered_in_this_boot(&shard.dir),
            ..Recovery::default()
        };
        for name in shard.reap_unspecified(replayed)? {
            shard.states.borrow_mut().remove(&name);
            restated.push((name, None));
        }
        for spec in shard.specs.all() {
            if rotary_net::shard_of(&spec.name, shards) == index {
                let (j, chosen) = shard
                    .recover(spec.clone(), replayed.get(&spec.name), &mut recovery)
                    .await?;
                let last = replayed.get(&j.name).map(|r| &r.last);
                if chosen.as_ref() != last {
                    let mut states = shard.states.borrow_mut();
                    match &chosen {
                        Some(st) => states.insert(j.name.clone(), st.clone()),
                        None => states.remove(&j.name),
                    };
                    restated.push((j.name.clone(), chosen));
                }
                shard
                    .journals
                    .borrow_mut()
                    .insert(j.name.clone(), Rc::new(RefCell::new(j)));
            }
        }
        {
            let mut log = shard.log.borrow_mut().take().expect("commit log present");
            let states = shard.states.borrow().clone();
            let res = log
                .settle(
                    restated.iter().map(|(n, st)| (n.as_str(), st.as_ref())),
                    states.iter().map(|(k, v)| (k.as_str(), v)),
                )
                .await;
            *shard.log.borrow_mut() = Some(log);
            res?;
        }
        // Only now: a start that dies before here checks everything again.
        if let Err(e) = rotary_storage::boot::record_recovery(&shard.dir) {
            tracing::warn!(dir = %shard.dir.display(), error = %e, "recording this boot's recovery; the next start reads every spool whole");
        }
        metrics::add(&shard.metrics.recovery_hashed_bytes, recovery.hashed);
        tracing::info!(
            shard = index,
            spools = recovery.spools,
            hashed_bytes = recovery.hashed,
            spools_read_whole = !recovery.same_boot,
            elapsed_ms = crate::clock::elapsed(started).as_millis() as u64,
            "recovered"
        );
        Ok(())
    }

    /// Reaps the journals of this shard that have a directory or records
    /// in the commit log (`replayed`) but no spec: deleted while the broker
    /// was down. Their directories go to the reaper, as a live deletion's
    /// do (`Shard::drop_journal`), so that a journal created again under
    /// the name starts empty at offset 0. Returns those the commit log
    /// holds records of: recovery records their deletion.
    ///
    /// The journals' spec source has been read by now: `Broker::start`
    /// opens the spec store (a single node's own), mirrors the cluster
    /// file into it, or reads etcd's keyspace into it (`Cluster::connect`
    /// returns once it has; a broker on etcd has also moved its shard
    /// directories aside by then) before any shard opens. A spec the store
    /// left out as no longer valid keeps its journal's files.
    fn reap_unspecified(
        &self,
        replayed: &HashMap<String, Replayed>,
    ) -> Result<Vec<String>, crate::EngineError> {
        let on_disk = journals_on_disk(&self.dir)?;
        let names: std::collections::BTreeSet<&str> = on_disk
            .iter()
            .chain(replayed.keys())
            .map(String::as_str)
            .filter(|name| self.specs.get(name).is_none())
            .collect();
        let mut deleted = Vec::new();
        for name in names {
            if self.specs.left_out(name) {
                tracing::warn!(journal = %name, "keeping the files of a journal whose stored spec is no longer valid: apply its spec again");
                continue;
            }
            let files = self.trash_journal_dir(name);
            let root = self.dir.join("journals");
            remove_empty_dirs(&root.join(name), &root);
            let logged = replayed.contains_key(name);
            tracing::info!(journal = %name, files, commit_log = logged, "the journal has no spec (deleted while the broker was down): reaping its files");
            metrics::add(&self.metrics.recovery_reaped_journals, 1);
            if logged {
                deleted.push(name.to_string());
            }
        }
        Ok(deleted)
    }

    /// Opens the shard's directory: replays its commit log and recovers
    /// every journal it owns.
    pub async fn open(cfg: ShardConfig) -> Result<Rc<Shard>, crate::EngineError> {
        let ShardConfig {
            index,
            shards,
            data_dir,
            specs,
            metrics,
            endpoints,
            disk_reserve_bytes,
            uploader,
            spool_budget_bytes,
            append_queue_bytes,
            local_cache_bytes,
            sizing,
            topology,
            commit_log_compact_bytes,
            peer_silence,
            offset_jump_age,
            min_append_rate,
            replica_ack_timeout,
            ack_poll,
            hasher,
            clock: _,
            faults: _,
        } = cfg;
        let dir = data_dir.join(format!("shard-{index}"));
        let (mut log, replayed) = Self::open_log(&dir, &specs).await?;
        log.set_compact_bytes(commit_log_compact_bytes);
        // Until recovery checks them against the spools, the last records.
        let states = last_records(&replayed);
        let (done_tx, done_rx) = async_channel::unbounded();
        let spares = crate::spares::Spares::open(&dir)
            .map_err(|e| crate::EngineError::Io(dir.join("spares"), e))?;
        let append_queue = Rc::new(crate::budget::QueueBudget::new(
            usize::try_from(append_queue_bytes).unwrap_or(usize::MAX),
            Some(metrics.clone()),
        ));
        let shard = Rc::new(Shard {
            index,
            shards,
            dir,
            specs,
            metrics,
            endpoints,
            disk_reserve_bytes,
            journals: RefCell::new(HashMap::new()),
            specs_seen: Cell::new(0),
            drops_seen: Cell::new(0),
            log: RefCell::new(Some(log)),
            log_back: Event::new(),
            states: RefCell::new(states),
            unrestated: RefCell::new(std::collections::BTreeSet::new()),
            restate_failed: Cell::new(false),
            ready: RefCell::new(Vec::new()),
            wake: Event::new(),
            shutting_down: Cell::new(false),
            stopping: Event::new(),
            uploads_in_flight: RefCell::new(HashSet::new()),
            log_write_failed: Default::default(),
            log_compaction_failed: Default::default(),
            shared_failures: Default::default(),
            outboxes: RefCell::new(Vec::new()),
            busy: Cell::new(false),
            idle: Event::new(),
            uploader,
            upload_done: done_tx,
            upload_done_rx: RefCell::new(Some(done_rx)),
            unuploaded_bytes: Cell::new(0),
            log_disk_failed: RefCell::new(None),
            listings_in_flight: Cell::new(0),
            listings_waiting: RefCell::new(VecDeque::new()),
            spool_budget_bytes,
            local_cache_bytes,
            spares: RefCell::new(spares),
            append_queue,
            store_error: RefCell::new(None),
            me: RefCell::new(std::rc::Weak::new()),
            sizing,
            view: RefCell::new(topology.views()),
            tick_view: RefCell::new(topology.snapshot()),
            topology,
            peer_silence,
            offset_jump_age,
            min_append_rate,
            replica_ack_timeout,
            pipelines: RefCell::new(HashMap::new()),
            silent_sources: RefCell::new(HashMap::new()),
            next_seq: Cell::new(1),
            hasher,
            hash_parked: RefCell::new(Vec::new()),
            checking: RefCell::new(HashMap::new()),
            awaiting_acks: Cell::new(0),
            proposals: Cell::new(0),
            proposed: Event::new(),
            ack_poll,
        });
        *shard.me.borrow_mut() = Rc::downgrade(&shard);
        shard.specs_seen.set(shard.specs.version());
        shard.recover_journals(&replayed).await?;
        Ok(shard)
    }

    /// Recovers the journal's newest spool, `begin` and `path`: the first
    /// of the commit log's `candidates` that is on disk (or needs nothing
    /// from the spool) stands. Returns it, and whether the spool holds its
    /// commits (then the spool is the journal's, and `head` its end).
    async fn recover_spool(
        &self,
        j: &mut Journal,
        (begin, path): (&u64, &PathBuf),
        candidates: &[&JournalState],
        replayed: Option<&Replayed>,
        recovery: &mut Recovery,
        head: &mut u64,
    ) -> Result<(Option<JournalState>, bool), crate::EngineError> {
        let base = *head;
        // A candidate commits bytes into the newest spool, or says the
        // spool holds nothing committed (its commits are all in fragments).
        let in_spool =
            |st: &JournalState| st.spool_begin == *begin && st.end > *begin && *begin >= base;
        let mut chosen: Option<JournalState> = None;
        // Its index among the candidates.
        let mut chosen_at = candidates.len();
        let mut use_spool = false;
        // The last record may carry bytes that were answered before
        // their spool write completed: they go back into the spool
        // (identical bytes if the write did complete).
        if let Some(r) = replayed {
            if let Some(inline) = r.inline.as_ref().filter(|_| in_spool(&r.last)) {
                Spool::repair(path, *begin, inline.at, &inline.bytes).await?;
            }
        }
        // In the boot of the last recovery, a candidate's bytes before
        // its midstate are on disk: only its own batch is hashed.
        let checks: Vec<Check> = candidates
            .iter()
            .filter(|st| in_spool(st))
            .map(|st| Check {
                end: st.end,
                sha1: st.sha1,
                from: st
                    .mid
                    .filter(|_| recovery.same_boot)
                    .and_then(|m| Some((m.at, m.resume(st.spool_begin, st.end)?))),
            })
            .collect();
        let found = if checks.is_empty() {
            None
        } else {
            recovery.spools += 1;
            let (found, hashed) =
                Spool::recover_checked(path.clone(), *begin, &checks, self.sizing).await?;
            recovery.hashed += hashed;
            found
        };
        // The first candidate that either is on disk or needs nothing
        // from the spool stands. Candidates before it all commit into
        // the spool, so its index among the checks is its index here.
        for (i, st) in candidates.iter().enumerate() {
            if !in_spool(st) {
                chosen = Some((*st).clone());
                chosen_at = i;
                break;
            }
            if found.as_ref().is_some_and(|(_, at)| *at == i) {
                chosen = Some((*st).clone());
                chosen_at = i;
                use_spool = true;
                break;
            }
        }
        if chosen.is_none() && !candidates.is_empty() {
            // Neither the last record nor the one before it matches
            // the bytes on disk: only possible after power loss in
            // `replicated` mode (the log reached the disk, the data
            // did not), or damage to the file.
            let why = format!(
                "{}: SHA-1 of committed spool bytes matches neither of the commit log's last two records",
                path.display()
            );
            return Err(crate::EngineError::corrupt(path, why));
        }
        match (use_spool, found) {
            (true, Some((s, _))) => {
                *head = s.committed();
                j.files.spool_since = Some(crate::clock::wall());
                j.files.spool = Some(s);
            }
            _ if candidates[chosen_at..].iter().any(|st| in_spool(st)) => {
                // The record that stands does not commit into this
                // spool, but an older one does: the log names a spool
                // that is not there. This one may hold acknowledged
                // bytes no fragment has; it stays.
                tracing::error!(
                    path = %path.display(),
                    "keeping a spool that an earlier commit record names"
                );
            }
            _ => {
                // Nothing committed into this spool. Its name goes
                // here, not on the reaper: the next spool may take it.
                let _ = crate::reaper::unlink_now_free_later(path);
            }
        }
        Ok((chosen, use_spool))
    }

    /// Rebuilds a journal from its directory and what the commit log holds
    /// for it. Returns the journal and the commit-log state that stands: the
    /// last record, or the one before it when the last record's spool
    /// bytes did not all reach the disk (see `rotary_storage::wal`).
    pub(super) async fn recover(
        &self,
        spec: rotary_net::JournalSpec,
        replayed: Option<&Replayed>,
        recovery: &mut Recovery,
    ) -> Result<(Journal, Option<JournalState>), crate::EngineError> {
        let dir = journal_dir(&self.dir, &spec.name);
        let mut j = Journal::new(spec, dir.clone());
        j.init_index();
        let listing = list_dir(&dir).map_err(|e| crate::EngineError::Io(dir.clone(), e))?;
        j.files.fragments = listing.fragments;
        for path in &listing.partial {
            tracing::warn!(path = %path.display(), "removing an unfinished copy from a replica");
            let _ = std::fs::remove_file(path);
        }
        let mut head = j.files.fragments.iter().map(|f| f.end).max().unwrap_or(0);
        let candidates: Vec<&JournalState> = replayed
            .map(|r| r.candidates().collect())
            .unwrap_or_default();
        // Only one spool can hold commits: the one the commit log names
        // (its last record, or the one before when that one's bytes did not
        // reach the disk). Without such a spool, the newest: one begun
        // after the last commit, with nothing committed in it yet.
        let mut spools = listing.spools;
        let named = candidates
            .iter()
            .filter(|st| st.end > st.spool_begin && st.spool_begin >= head)
            .find_map(|st| {
                spools
                    .iter()
                    .position(|(begin, _)| *begin == st.spool_begin)
            });
        let newest = match named {
            Some(i) => Some(spools.remove(i)),
            None => spools.pop(),
        };
        for (begin, path) in spools {
            if j.files.fragments.iter().any(|f| f.begin == begin) {
                // A leftover of a seal interrupted after its rename target
                // was written: its bytes are in that fragment.
                tracing::warn!(path = %path.display(), "removing stale spool");
                let _ = std::fs::remove_file(&path);
            } else {
                // Not the spool the commit log's records commit into, and
                // no fragment holds its bytes: it is left as it is, for
                // whoever put it there. (A spool begun at a replica's new
                // head just before a crash is one too: the next spool
                // there takes its name.)
                tracing::warn!(
                    path = %path.display(),
                    "ignoring a spool the commit log does not name"
                );
            }
        }
        let (chosen, use_spool) = match &newest {
            Some((begin, path)) => {
                self.recover_spool(
                    &mut j,
                    (begin, path),
                    &candidates,
                    replayed,
                    recovery,
                    &mut head,
                )
                .await?
            }
            None => (candidates.first().map(|st| (*st).clone()), false),
        };
        if let Some(st) = &chosen {
            j.heads.set_registers(st.registers.clone());
            if !use_spool {
                // Its bytes are all in sealed fragments, which may since
                // have left the local cache for the store: the head is at
                // least where they end, so no offset is given out twice.
                if st.end > head && !j.has_stores() {
                    // A journal without stores keeps every fragment here.
                    tracing::error!(
                        journal = %j.name,
                        local_end = head,
                        committed_end = st.end,
                        "the commit log commits bytes that no file of the data directory holds, and the journal has no store: those offsets are lost (were its files removed?)"
                    );
                }
                head = head.max(st.end);
            }
        }
        j.set_heads(head);
        j.primary.first_sync_pending =
            j.files.fragments.is_empty() && j.files.spool.is_none() && chosen.is_none();
        Ok((j, chosen))
    }

    /// Files in the directory of a journal created while the broker runs
    /// (one whose stored spec the start left out as no longer valid,
    /// applied again, say, or files put there by hand; a start reaps the
    /// files of journals deleted while the broker was down). A restart
    /// would recover their fragments and prefer them to new bytes at the
    /// same offsets, so the journal takes them now and goes on after them
    /// and after its last commit record, giving out none of their offsets
    /// again. A spool stays where it is: a restart passes over one the
    /// commit log does not name.
    pub(super) fn adopt_files(&self, j: &mut Journal, state: Option<&JournalState>) {
        let listing = match list_dir(&j.files.dir) {
            Ok(listing) => listing,
            Err(e) => {
                tracing::warn!(dir = %j.files.dir.display(), error = %e, "listing a new journal's directory");
                return;
            }
        };
        if listing.fragments.is_empty() && listing.spools.is_empty() {
            return;
        }
        let head = listing
            .fragments
            .iter()
            .map(|f| f.end)
            .chain(state.map(|st| st.end))
            .max()
            .unwrap_or(0);
        tracing::warn!(
            journal = %j.name,
            fragments = listing.fragments.len(),
            spools = listing.spools.len(),
            head,
            "a new journal's directory holds files; it continues after them"
        );
        j.files.fragments = listing.fragments;
        j.set_heads(head);
        j.primary.first_sync_pending = j.files.fragments.is_empty() && state.is_none();
    }
}

/// Each journal's last replayed commit record.
fn last_records(replayed: &HashMap<String, Replayed>) -> HashMap<String, JournalState> {
    replayed
        .iter()
        .map(|(name, r)| (name.clone(), r.last.clone()))
        .collect()
}
