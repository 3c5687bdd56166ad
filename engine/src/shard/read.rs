//! Reads: from local fragments, the spool, the stores, or by location.

use super::*;
use crate::journal::Jump;

/// Longest wait of a blocking read in a young gap before it looks again:
/// the gap ages while nothing wakes the read (no commit, no listing).
const GAP_LOOK_AGAIN: std::time::Duration = std::time::Duration::from_secs(1);

/// Counts a read waiting on the journal (`delta` 1 or -1): while readers
/// wait, appends keep their bytes in memory.
fn j_waiting(j: &JournalRef, delta: isize) {
    let mut jm = j.borrow_mut();
    jm.readers.waiting = jm
        .readers
        .waiting
        .checked_add_signed(delta)
        .expect("readers waiting never below zero");
}

/// Cancellation of a streaming read.
#[derive(Default)]
pub struct Cancel {
    set: Cell<bool>,
    pub event: Event,
}

impl Cancel {
    pub fn is_set(&self) -> bool {
        self.set.get()
    }

    pub fn cancel(&self) {
        self.set.set(true);
        self.event.notify(usize::MAX);
    }
}

/// A read of a journal's local file in flight (counted in
/// `Journal::reads_in_flight` while it lives).
pub(super) struct ReadPin(JournalRef);

impl ReadPin {
    fn new(j: &JournalRef) -> ReadPin {
        j.borrow_mut().files.reads_in_flight += 1;
        ReadPin(j.clone())
    }
}

impl Drop for ReadPin {
    fn drop(&mut self) {
        // Should the journal be borrowed here, the count stays up: that
        // only stops its files from being reused, never the other way.
        if let Ok(mut jm) = self.0.try_borrow_mut() {
            jm.files.reads_in_flight -= 1;
        }
    }
}

/// Waits while appends answered to their appenders are still being
/// written to the spool, until they are readable.
pub(super) async fn settle_answered(j: &JournalRef) {
    loop {
        let l = {
            let jm = j.borrow();
            if jm.deleted || jm.heads.head() >= jm.heads.answered() {
                return;
            }
            jm.readers.committed.listen()
        };
        // The turn publishes the batch as soon as its write completes.
        l.await;
    }
}

/// What wakes a waiting read: a commit or a new store listing of its
/// journal, a CANCEL, its connection closing, or the broker stopping. Call
/// it before the last check of what the read waits for, so nothing in
/// between is missed, then await it.
pub(super) fn read_wakeup(
    j: &JournalRef,
    cancel: &crate::shard::Cancel,
    outbox: &Outbox,
    stopping: &Event,
) -> impl std::future::Future<Output = ()> {
    let commit = j.borrow().readers.committed.listen();
    let cancelled = cancel.event.listen();
    // Not `drained`, which fires after every write of the connection's
    // outbox: a tailing reader would wake once more for each chunk it sent.
    let closed = outbox.closing.listen();
    let stopped = stopping.listen();
    async move {
        let (a, b, c, d) = (
            std::pin::pin!(commit),
            std::pin::pin!(cancelled),
            std::pin::pin!(closed),
            std::pin::pin!(stopped),
        );
        futures_util::future::select(
            futures_util::future::select(a, b),
            futures_util::future::select(c, d),
        )
        .await;
    }
}

impl Shard {
    /// Streams a read to `outbox`. Ends with READ_DONE unless the
    /// connection closed.
    pub async fn read(&self, j: JournalRef, ask: ReadAsk) {
        metrics::add(&self.metrics.reads, 1);
        let call = ReadCall {
            shard: self,
            j,
            ask,
        };
        if call.j.borrow().spec.flags == JournalFlags::WriteOnly {
            let head = call.j.borrow().heads.head();
            return call.done(Status::NOT_ALLOWED, 0, head, "journal is write-only");
        }
        // A TAKEOVER read copies this broker's own bytes for another (a
        // new primary, or a replica filling what it missed): it does not
        // wait for this broker's own SYNC, which may be waiting for the
        // very broker that asks.
        let takeover = call.ask.flags & rotary_net::wire::flag::TAKEOVER != 0;
        if !call.wait_listed().await || (!takeover && !call.wait_synced().await) {
            return;
        }
        // Appends already answered are readable, and count in the write
        // head, if a moment later: their spool write completes in the turn.
        settle_answered(&call.j).await;
        // `-1` is the end of readable history, the head READ_DONE reports:
        // beyond the write head only before a head reset, when a tail "from
        // now on" must not replay the store's history.
        let head = call.j.borrow().read_head();
        let mut offset = call.ask.req.offset.unwrap_or(head);
        if call.ask.flags & rotary_net::wire::flag::METADATA_ONLY != 0 {
            return call.metadata(offset, head).await;
        }
        if !call.block() && offset >= head {
            return call.done(
                Status::OFFSET_NOT_YET_AVAILABLE,
                offset,
                head,
                &format!("offset {offset} is not before the write head {head}"),
            );
        }
        while let ReadStep::At(next) = call.step(offset).await {
            offset = next;
        }
    }

    /// Checks the local fragment file at `path` of journal `j` against its
    /// name, once: a second caller waits for the first one's check. The
    /// fragment is then marked verified, or corrupt (never read again).
    /// Err: the file could not be read this time; it stays unchecked.
    pub(super) async fn check_fragment(&self, j: &JournalRef, path: PathBuf) -> Result<(), String> {
        let running = self.checking.borrow().get(&path).cloned();
        if let Some(event) = running {
            let l = event.listen();
            if self.checking.borrow().contains_key(&path) {
                l.await;
            }
            return Ok(());
        }
        let Some((begin, end, sha1)) = j
            .borrow()
            .files
            .fragments
            .iter()
            .find(|f| f.path == path && !f.verified)
            .map(|f| (f.begin, f.end, f.sha1))
        else {
            // Checked, evicted or dropped meanwhile: locate again.
            return Ok(());
        };
        let event = Rc::new(Event::new());
        self.checking
            .borrow_mut()
            .insert(path.clone(), event.clone());
        let res = crate::check::check(path.clone(), begin, end, sha1).await;
        self.checking.borrow_mut().remove(&path);
        event.notify(usize::MAX);
        let mut jm = j.borrow_mut();
        let name = jm.name.clone();
        let Some(f) = jm.files.fragments.iter_mut().find(|f| f.path == path) else {
            return Ok(());
        };
        match res {
            Ok(()) => {
                f.verified = true;
                metrics::add(&self.metrics.fragments_checked, 1);
                Ok(())
            }
            Err(crate::check::CheckFailed::Mismatch(why)) => {
                tracing::error!(journal = %name, path = %path.display(), %why, "a local fragment does not hold the bytes its name says; it is never served");
                metrics::add(&self.metrics.fragments_checked, 1);
                metrics::add(&self.metrics.fragments_check_failed, 1);
                f.corrupt = Some(why);
                Ok(())
            }
            Err(crate::check::CheckFailed::Io(e)) if e.kind() == std::io::ErrorKind::NotFound => {
                // Still in the index, but its file is gone (removed by
                // hand): nothing of it can be served.
                tracing::error!(journal = %name, path = %path.display(), "a local fragment's file is gone; it is never served");
                metrics::add(&self.metrics.fragments_check_failed, 1);
                f.corrupt = Some("its file is gone".into());
                Ok(())
            }
            Err(crate::check::CheckFailed::Io(e)) => Err(format!(
                "{}: checking the fragment against its name: {e}",
                path.display()
            )),
        }
    }

    /// Answers a direct read with the fragment's location.
    pub(super) async fn direct(
        &self,
        frag: &StoredFragment,
        offset: u64,
        request_id: u64,
        outbox: &Outbox,
    ) -> Result<(), String> {
        use rotary_net::wire::ReadFragment;
        use zerocopy::byteorder::little_endian::U64;
        use zerocopy::IntoBytes;
        let location = self
            .uploader
            .locate(frag, LOCATION_TTL)
            .await
            .map_err(|e| e.to_string())?;
        let meta = ReadFragment {
            begin: U64::new(frag.begin),
            end: U64::new(frag.end),
            offset: U64::new(offset),
            sha1: frag.sha1,
            codec: rotary_net::wire::codec_code(frag.codec),
            reserved: [0; 3],
        };
        outbox.frame(
            Op::READ_FRAGMENT,
            Status::OK,
            request_id,
            meta.as_bytes(),
            location.as_bytes(),
        );
        Ok(())
    }

    /// Streams a store fragment's bytes from `offset` as READ_DATA, up to
    /// `end_offset`. Returns the next offset to read.
    pub(super) async fn proxy(
        &self,
        frag: &StoredFragment,
        mut offset: u64,
        end_offset: Option<u64>,
        request_id: u64,
        outbox: &Outbox,
        cancel: &crate::shard::Cancel,
    ) -> Result<u64, (rotary_uploader::StoreError, u64)> {
        use rotary_net::wire::ReadData;
        use zerocopy::byteorder::little_endian::U64;
        use zerocopy::IntoBytes;
        let rx = self.uploader.read(frag, offset, READ_CHUNK_BYTES);
        // Set once `end_offset` is reached inside the fragment: the rest of
        // it is still read, not sent, so that its SHA-1 is checked before
        // the read is answered OK.
        let mut served = false;
        while let Ok(chunk) = rx.recv().await {
            let chunk = chunk.map_err(|e| (e, offset))?;
            if served {
                continue;
            }
            if chunk.offset != offset {
                let skipped = rotary_uploader::StoreError::Corrupt {
                    store: frag.store.clone(),
                    key: frag.key.clone(),
                    why: format!("store stream skipped from {offset} to {}", chunk.offset),
                };
                return Err((skipped, offset));
            }
            let Some(_turn) = outbox.produce().await else {
                break;
            };
            let mut bytes = &chunk.bytes[..];
            if let Some(end) = end_offset {
                bytes = &bytes[..bytes.len().min(end.saturating_sub(offset) as usize)];
            }
            let meta = ReadData {
                offset: U64::new(offset),
            };
            outbox.frame(
                Op::READ_DATA,
                Status::OK,
                request_id,
                meta.as_bytes(),
                bytes,
            );
            metrics::add(&self.metrics.read_bytes, bytes.len() as u64);
            offset += bytes.len() as u64;
            if end_offset.is_some_and(|e| offset >= e) {
                served = true;
            } else if cancel.is_set() || self.shutting_down.get() || outbox.is_closed() {
                break;
            }
        }
        Ok(offset)
    }

    /// A page of the journal's fragments (FRAGMENTS, PROTOCOL §9.5): those
    /// beginning at or after `from`, sorted by begin, local copies first.
    /// At most `limit` of them, except that fragments beginning where the
    /// page's last one does are never split across pages. Returns the page
    /// and whether fragments beginning after its last remain. The work is
    /// bounded by the page, not by the index: a journal's store may hold
    /// hundreds of thousands of fragments, and the shard serves appends
    /// meanwhile.
    pub fn fragments_page(
        &self,
        j: &JournalRef,
        from: u64,
        limit: usize,
    ) -> (serde_json::Value, bool) {
        let jm = j.borrow();
        let limit = limit.max(1);
        let mut out: Vec<(u64, bool, serde_json::Value)> = jm
            .files
            .fragments
            .iter()
            .filter(|f| f.begin >= from)
            .map(|f| (f.begin, false, fragment_json(f, jm.has_stores())))
            .collect();
        // The index is sorted by begin: take a page's worth from `from`,
        // and the rest of the last begin's fragments.
        let first = jm.index.remote().partition_point(|r| r.begin < from);
        let mut last = (first + limit).min(jm.index.remote().len());
        while last < jm.index.remote().len()
            && last > first
            && jm.index.remote()[last].begin == jm.index.remote()[last - 1].begin
        {
            last += 1;
        }
        let remote_left = last < jm.index.remote().len();
        for r in &jm.index.remote()[first..last] {
            let mut v = stored_json(r);
            if let Some(why) = jm.index.disputed(r) {
                v["disputed"] = why.into();
            }
            out.push((r.begin, true, v));
        }
        // Conflicting fragments are few: those of the page's span join it.
        let page_end = match remote_left {
            true => jm.index.remote()[last - 1].begin,
            false => u64::MAX,
        };
        for c in jm.index.conflicting() {
            let r = &c.fragment;
            if r.begin >= from && r.begin <= page_end {
                let mut v = stored_json(r);
                v["conflicting"] = c.why.clone().into();
                out.push((r.begin, true, v));
            }
        }
        if let Some(spool) = jm
            .files
            .spool
            .as_ref()
            .filter(|s| !s.is_empty() && s.begin() >= from)
        {
            out.push((
                spool.begin(),
                false,
                serde_json::json!({
                    "begin": spool.begin(),
                    "end": spool.committed(),
                    "sha1": hex::encode(spool.committed_sha1()),
                    "codec": "none",
                    "size": spool.len(),
                    "store": "local",
                    "path": spool.path().display().to_string(),
                    "mod_time": unix_secs(crate::clock::wall()),
                    "open": true,
                }),
            ));
        }
        out.sort_by_key(|(begin, remote, _)| (*begin, *remote));
        let mut cut = out.len().min(limit);
        while cut < out.len() && cut > 0 && out[cut].0 == out[cut - 1].0 {
            cut += 1;
        }
        let more = cut < out.len() || remote_left;
        out.truncate(cut);
        let page = out.into_iter().map(|(_, _, v)| v).collect();
        (serde_json::Value::Array(page), more)
    }
}

/// A store fragment as FRAGMENTS shows it (PROTOCOL §9.5).
fn stored_json(r: &StoredFragment) -> serde_json::Value {
    serde_json::json!({
        "begin": r.begin,
        "end": r.end,
        "sha1": hex::encode(r.sha1),
        "codec": r.codec,
        "size": r.size,
        "store": r.store,
        "key": r.key,
        "path": r.key,
        "mod_time": unix_secs(r.mod_time),
        "open": false,
    })
}

/// Where a read goes after one step: on from an offset, or it ended
/// (answered, or its connection closed).
enum ReadStep {
    At(u64),
    Ended,
}

/// A read as its connection asked it, and where it answers.
pub struct ReadAsk {
    pub outbox: Rc<Outbox>,
    pub request_id: u64,
    pub req: rotary_net::wire::ReadRequest,
    pub flags: u8,
    /// Set by the connection when the client cancels or goes away.
    pub cancel: Rc<crate::shard::Cancel>,
}

/// One read in progress on its shard.
struct ReadCall<'s> {
    shard: &'s Shard,
    j: JournalRef,
    ask: ReadAsk,
}

impl ReadCall<'_> {
    fn block(&self) -> bool {
        self.ask.flags & rotary_net::wire::flag::BLOCK != 0
    }

    /// Ends the read with READ_DONE.
    fn done(&self, status: Status, offset: u64, head: u64, msg: &str) {
        use rotary_net::wire::ReadDone;
        use zerocopy::byteorder::little_endian::U64;
        use zerocopy::IntoBytes;
        let meta = ReadDone {
            offset: U64::new(offset),
            write_head: U64::new(head),
        };
        self.ask.outbox.frame(
            Op::READ_DONE,
            status,
            self.ask.request_id,
            meta.as_bytes(),
            msg.as_bytes(),
        );
    }

    /// [`ReadCall::done`] at the journal's write head, then [`ReadStep::Ended`].
    fn done_at_head(&self, status: Status, offset: u64, msg: &str) -> ReadStep {
        // The end of readable history, the store's included: a broker
        // whose head is behind its store reports where history ends.
        let head = self.j.borrow().read_head();
        self.done(status, offset, head, msg);
        ReadStep::Ended
    }

    /// Why a read ends early: a CANCEL, or a clean stop of the broker.
    fn stopped(&self) -> Option<(Status, &'static str)> {
        if self.ask.cancel.is_set() {
            Some((Status::CANCELLED, "read cancelled"))
        } else if self.shard.shutting_down.get() {
            Some((
                Status::SHUTTING_DOWN,
                "the broker is shutting down; read on from this offset elsewhere or later",
            ))
        } else {
            None
        }
    }

    /// A metadata-only read at `offset` (`head` the read head when it
    /// came): answered at once below the head; at or past it, a read that
    /// does not block ends `OFFSET_NOT_YET_AVAILABLE`, and a blocking one
    /// waits until a commit moves the head past `offset`, then answers
    /// once (Gazette's metadata-only read of an offset not yet written).
    async fn metadata(&self, offset: u64, head: u64) {
        if offset < head {
            return self.done(Status::OK, offset, head, "");
        }
        if !self.block() {
            let msg = format!("offset {offset} is not before the write head {head}");
            return self.done(Status::OFFSET_NOT_YET_AVAILABLE, offset, head, &msg);
        }
        loop {
            let wakeup = self.wakeup();
            let (head, deleted) = {
                let jm = self.j.borrow();
                (jm.read_head(), jm.deleted)
            };
            if deleted {
                return self.done(
                    Status::JOURNAL_NOT_FOUND,
                    offset,
                    head,
                    "journal was deleted",
                );
            }
            if head > offset {
                return self.done(Status::OK, offset, head, "");
            }
            if self.ended(head) {
                return;
            }
            wakeup.await;
        }
    }

    /// A read waiting before it starts ends if it is stopped (answered
    /// here) or its connection closed.
    fn ended(&self, head: u64) -> bool {
        if let Some((status, why)) = self.stopped() {
            self.done(status, self.ask.req.offset.unwrap_or(head), head, why);
            return true;
        }
        self.ask.outbox.is_closed()
    }

    fn wakeup(&self) -> impl std::future::Future<Output = ()> {
        read_wakeup(
            &self.j,
            &self.ask.cancel,
            &self.ask.outbox,
            &self.shard.stopping,
        )
    }

    /// A journal with stores is whole only once its store was first
    /// listed: the store may hold history the local disk does not (a
    /// wiped data dir, `--local-cache 0`). Until then a read would see
    /// an empty journal, so it waits for the listing, and a listing
    /// that failed is the read's answer, as it is an append's.
    /// False: the read ended.
    async fn wait_listed(&self) -> bool {
        loop {
            let (listed, failed) = {
                let jm = self.j.borrow();
                (jm.index.loaded, jm.index.error.clone())
            };
            if listed {
                return true;
            }
            let head = self.j.borrow().heads.head();
            if let Some(e) = failed {
                self.done(
                    Status::FRAGMENT_STORE_UNHEALTHY,
                    self.ask.req.offset.unwrap_or(head),
                    head,
                    &format!("fragment index not yet listed: {e}"),
                );
                return false;
            }
            let wakeup = self.wakeup();
            {
                let jm = self.j.borrow();
                if jm.index.loaded || jm.index.error.is_some() {
                    continue;
                }
            }
            self.shard.hurry_first_listing(&self.j);
            if self.ended(head) {
                return false;
            }
            wakeup.await;
        }
    }

    /// A primary that started with none of a replicated journal's data
    /// (a new journal, or a data dir lost with its disk) learns its head
    /// from its replicas' at the first SYNC, copying what they hold
    /// beyond its own. Until then a read would see an empty journal, so
    /// it waits for that SYNC, and a SYNC that failed is its answer.
    /// So does a primary the journal was just routed to, until it asked
    /// the brokers of the journal's earlier routes for their heads.
    /// False: the read ended.
    async fn wait_synced(&self) -> bool {
        let j = &self.j;
        loop {
            let role = self.shard.role(&j.borrow().spec);
            // (A route short of brokers cannot synchronize at all.)
            let (route, takeover) = match role {
                Role::Primary(r) if r.is_complete() => {
                    let takeover = self.shard.takeover_due(j, &r);
                    let first = j.borrow().primary.first_sync_pending && r.members.len() > 1;
                    if !takeover && !first {
                        return true;
                    }
                    (r, takeover)
                }
                _ => return true,
            };
            let failed = {
                let jm = j.borrow();
                // A failure stands until its retry is due.
                jm.primary
                    .sync_retry
                    .as_ref()
                    .filter(|(at, _)| crate::clock::now() < *at && !jm.primary.syncing)
                    .map(|(_, f)| f.clone())
            };
            let head = j.borrow().heads.head();
            if let Some(f) = failed {
                let msg = if takeover {
                    format!(
                        "the journal's route changed, and its new primary has not learned the head from the brokers it left yet: {}",
                        f.message
                    )
                } else {
                    format!(
                        "the primary started without the journal's data and has not synchronized with its replicas yet: {}",
                        f.message
                    )
                };
                self.done(
                    Status::REPLICATION_FAILED,
                    self.ask.req.offset.unwrap_or(head),
                    head,
                    &msg,
                );
                return false;
            }
            let wakeup = self.wakeup();
            if takeover {
                // `prepare` starts the SYNC.
                self.shard.mark_ready(j);
            } else {
                self.shard.pulse(j, &route, true);
            }
            if self.ended(head) {
                return false;
            }
            wakeup.await;
        }
    }

    /// Serves one chunk of the read from `offset`, or waits for one.
    async fn step(&self, offset: u64) -> ReadStep {
        let j = &self.j;
        if let Some(end) = self.ask.req.end_offset {
            if offset >= end {
                return self.done_at_head(Status::OK, offset, "");
            }
        }
        if let Some((status, why)) = self.stopped() {
            return self.done_at_head(status, offset, why);
        }
        // Fetch a chunk only with room for it and a turn: a client
        // that stops reading, however many reads it has in flight,
        // holds a bounded share of the shard's memory.
        let Some(turn) = self.ask.outbox.produce().await else {
            return ReadStep::Ended;
        };
        let (located, head, deleted) = {
            let jm = j.borrow();
            (jm.locate(offset), jm.read_head(), jm.deleted)
        };
        if deleted {
            self.done(
                Status::JOURNAL_NOT_FOUND,
                offset,
                head,
                "journal was deleted",
            );
            return ReadStep::Ended;
        }
        if let Some(n) = self.serve_tail(offset) {
            return ReadStep::At(offset + n);
        }
        let Some(loc) = located else {
            drop(turn);
            return self.wait_for_bytes(offset, head).await;
        };
        if let Some(jump) = loc.jumped {
            // Without a store nothing can fill the gap here: it is jumped.
            let young = !jump.is_permanent(crate::clock::wall(), self.shard.offset_jump_age);
            if young && j.borrow().has_stores() {
                drop(turn);
                return self.wait_in_gap(jump, loc.offset, head).await;
            }
            self.shard.note_jump(&self.j, jump, loc.offset);
        }
        let offset = loc.offset;
        if let Some(end) = self.ask.req.end_offset {
            if offset >= end {
                // The rest of the range lies in a gap of the history:
                // the read ends at its end, and the client sees that
                // no bytes came for it.
                return self.done_at_head(Status::OK, end, "");
            }
        }
        let mut len = (loc.end - offset).min(READ_CHUNK_BYTES as u64);
        if let Some(end) = self.ask.req.end_offset {
            len = len.min(end - offset);
        }
        // A local file's read holds the journal's files from reuse
        // until it is done: see `retire_fragment`.
        let reading = matches!(
            loc.file,
            FileRef::Open(_) | FileRef::Fragment(..) | FileRef::Unchecked(_)
        )
        .then(|| ReadPin::new(j));
        let file = match loc.file {
            FileRef::Remote(frag) => {
                // Each chunk from the store takes its own turn.
                drop(turn);
                return self.read_store(frag, offset).await;
            }
            FileRef::Corrupt(why) => return self.done_at_head(Status::IO_ERROR, offset, &why),
            FileRef::Unchecked(path) => {
                drop(turn);
                let checked = self.shard.check_fragment(j, path).await;
                drop(reading);
                if let Err(msg) = checked {
                    return self.done_at_head(Status::IO_ERROR, offset, &msg);
                }
                // Checked (and now read from), or found corrupt (and
                // now read from a store's copy, or refused).
                return ReadStep::At(offset);
            }
            FileRef::Open(f) | FileRef::Fragment(_, Some(f)) => f,
            FileRef::Fragment(path, None) => match compio::fs::File::open(&path).await {
                Ok(f) => Rc::new(f),
                // Evicted meanwhile: its span is read from where it is
                // now (the store).
                Err(e)
                    if e.kind() == std::io::ErrorKind::NotFound
                        && !j.borrow().files.fragments.iter().any(|f| f.path == path) =>
                {
                    return ReadStep::At(offset)
                }
                Err(e) => {
                    let msg = format!("{}: {e}", path.display());
                    return self.done_at_head(Status::IO_ERROR, offset, &msg);
                }
            },
        };
        let step = self.read_file(&file, loc.file_pos, len, offset).await;
        drop(reading);
        drop(turn);
        step
    }

    /// Reads up to `len` bytes at `offset` from `file` at `file_pos`, and
    /// sends them.
    async fn read_file(
        &self,
        file: &compio::fs::File,
        file_pos: u64,
        len: u64,
        offset: u64,
    ) -> ReadStep {
        match read_range(file, file_pos, len as usize).await {
            Ok((buf, range)) if !range.is_empty() => {
                self.send(offset, &buf.as_slice()[range.clone()]);
                ReadStep::At(offset + range.len() as u64)
            }
            Ok(_) => self.done_at_head(Status::IO_ERROR, offset, "short read of local fragment"),
            Err(e) => self.done_at_head(Status::IO_ERROR, offset, &e.to_string()),
        }
    }

    /// Sends bytes read at `offset` as READ_DATA.
    fn send(&self, offset: u64, bytes: &[u8]) {
        use rotary_net::wire::ReadData;
        use zerocopy::byteorder::little_endian::U64;
        use zerocopy::IntoBytes;
        let meta = ReadData {
            offset: U64::new(offset),
        };
        self.ask.outbox.frame(
            Op::READ_DATA,
            Status::OK,
            self.ask.request_id,
            meta.as_bytes(),
            bytes,
        );
        metrics::add(&self.shard.metrics.read_bytes, bytes.len() as u64);
    }

    /// Recent bytes come from memory when the tail cache has them: how
    /// many were sent.
    fn serve_tail(&self, offset: u64) -> Option<u64> {
        let served = {
            let jm = self.j.borrow();
            let limit = self
                .ask
                .req
                .end_offset
                .map_or(jm.heads.head(), |e| e.min(jm.heads.head()))
                .min(offset + READ_CHUNK_BYTES as u64);
            jm.readers.tail.get(offset, limit).map(|bytes| {
                self.send(offset, bytes);
                bytes.len() as u64
            })
        }?;
        metrics::add(&self.shard.metrics.tail_cache_reads, 1);
        Some(served)
    }

    /// No file holds `offset` (yet): waits for its bytes, or ends a read
    /// that does not block.
    async fn wait_for_bytes(&self, offset: u64, head: u64) -> ReadStep {
        let j = &self.j;
        if j.borrow().files.spool_out {
            // Its spool is being sealed, or its tail reloaded: the
            // bytes are back in a file when that is done.
            let wakeup = self.wakeup();
            if j.borrow().files.spool_out
                && self.stopped().is_none()
                && !self.ask.outbox.is_closed()
            {
                wakeup.await;
            }
            return ReadStep::At(offset);
        }
        let answered_ahead = {
            let jm = j.borrow();
            offset < jm.heads.answered() && jm.heads.head() < jm.heads.answered()
        };
        if !self.block() && answered_ahead {
            settle_answered(j).await;
            return ReadStep::At(offset);
        }
        if !self.block() {
            // Past the head, or in a gap of the history.
            self.done(Status::OK, offset, head, "");
            return ReadStep::Ended;
        }
        // Wait for a commit (or cancel, or a closed connection).
        let wakeup = self.wakeup();
        // Only a readable span ends the wait. Bytes below the read
        // head that no file holds (history missing, or a fragment
        // between its local copy and the store's listing) wait for
        // a commit or a new listing like bytes beyond the head.
        if j.borrow().locate(offset).is_some()
            || self.stopped().is_some()
            || self.ask.outbox.is_closed()
        {
            return ReadStep::At(offset);
        }
        // While readers wait, appends keep their bytes in memory.
        j.borrow_mut().readers.waiting += 1;
        let tailing = metrics::GaugeHeld::raise(&self.shard.metrics.tailing_readers);
        wakeup.await;
        drop(tailing);
        j.borrow_mut().readers.waiting -= 1;
        ReadStep::At(offset)
    }

    /// No span holds `jump.from`, and the next one (at `next`) is too
    /// young for the gap to be taken as permanent: its bytes may still
    /// come (another broker uploading them, a listing not yet made). A
    /// non-blocking read ends `OFFSET_NOT_YET_AVAILABLE` at the gap; a
    /// blocking one waits for a commit or a listing, or until the gap is
    /// old enough, and looks again.
    async fn wait_in_gap(&self, jump: Jump, next: u64, head: u64) -> ReadStep {
        let from = jump.from;
        if !self.block() {
            let msg = format!(
                "no fragment holds offset {from} yet; the next begins at {next}, and a read jumps a gap only once it is {:?} old (`--offset-jump-age`)",
                self.shard.offset_jump_age
            );
            self.done(Status::OFFSET_NOT_YET_AVAILABLE, from, head, &msg);
            return ReadStep::Ended;
        }
        let wakeup = self.wakeup();
        if self.stopped().is_some() || self.ask.outbox.is_closed() {
            return ReadStep::At(from);
        }
        let age = self.shard.offset_jump_age;
        let until = jump
            .permanent_in(crate::clock::wall(), age)
            .map_or(GAP_LOOK_AGAIN, |d| d.min(GAP_LOOK_AGAIN));
        j_waiting(&self.j, 1);
        let _ = compio::time::timeout(until, wakeup).await;
        j_waiting(&self.j, -1);
        ReadStep::At(from)
    }

    /// Reads from a fragment in a store: proxied, or answered with its
    /// location when the client asked not to be proxied.
    async fn read_store(&self, frag: StoredFragment, offset: u64) -> ReadStep {
        let shard = self.shard;
        let step = if self.ask.flags & rotary_net::wire::flag::DO_NOT_PROXY != 0 {
            shard
                .direct(&frag, offset, self.ask.request_id, &self.ask.outbox)
                .await
                .map(|()| None)
                .map_err(|msg| (None, msg))
        } else {
            shard
                .proxy(
                    &frag,
                    offset,
                    self.ask.req.end_offset,
                    self.ask.request_id,
                    &self.ask.outbox,
                    &self.ask.cancel,
                )
                .await
                .map(Some)
                .map_err(|(e, reached)| {
                    let msg = e.to_string();
                    (Some((e, reached)), msg)
                })
        };
        match step {
            // The client reads this fragment from the store and
            // comes back at its end.
            Ok(None) => {
                let head = self.j.borrow().read_head();
                self.done(Status::OK, frag.end, head, "");
                ReadStep::Ended
            }
            Ok(Some(next)) if next > offset => ReadStep::At(next),
            // Stopped before its first chunk: answered above.
            Ok(Some(_)) if self.stopped().is_some() || self.ask.outbox.is_closed() => {
                ReadStep::At(offset)
            }
            Ok(Some(_)) => {
                let head = self.j.borrow().read_head();
                self.done(
                    Status::FRAGMENT_STORE_UNHEALTHY,
                    offset,
                    head,
                    "store returned no bytes for the fragment",
                );
                ReadStep::Ended
            }
            Err((failed, msg)) => {
                use rotary_uploader::StoreError;
                let mut jm = self.j.borrow_mut();
                match failed {
                    // Never served again (bytes already sent from
                    // it are the client's to discard).
                    Some((StoreError::Corrupt { .. }, _)) => {
                        tracing::warn!(journal = %jm.name, key = %frag.key, error = %msg, "a store fragment is corrupt; left out of the index");
                        jm.index.drop_remote(&frag, true);
                    }
                    // Gone from the store (pruned) before a byte
                    // of it was sent: read on around it.
                    Some((StoreError::NotFound { .. }, reached)) => {
                        jm.index.drop_remote(&frag, false);
                        if reached == offset {
                            return ReadStep::At(offset);
                        }
                    }
                    _ => {}
                }
                let head = jm.read_head();
                drop(jm);
                self.done(Status::FRAGMENT_STORE_UNHEALTHY, offset, head, &msg);
                ReadStep::Ended
            }
        }
    }
}

impl Shard {
    /// Counts and logs a read's jump over a permanent gap: from
    /// `jump.from` to `to`. The reader sees it as the next frame's offset.
    fn note_jump(&self, j: &JournalRef, jump: Jump, to: u64) {
        let skipped = to - jump.from;
        metrics::add(&self.metrics.offset_jumps, 1);
        metrics::add(&self.metrics.offset_jump_bytes, skipped);
        let name = j.borrow().name.clone();
        tracing::info!(journal = %name, from = jump.from, to, skipped, "a read jumped over a gap in the journal's history");
    }
}
