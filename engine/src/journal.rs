//! A journal's shard-local state: its spool, sealed local fragments, write
//! head, registers and the queue of appends waiting their turn.

use crate::metrics::{self, Metrics};
use crate::outbox::Outbox;
use event_listener::Event;
use rotary_net::spec::{JournalSpec, LabelSet};
use rotary_net::status::Status;
use rotary_net::wire::AppendRequest;
use rotary_storage::fragment::LocalFragment;
use rotary_storage::sha::Sha1;
use rotary_storage::spool::{CommitPoint, Spool};
use rotary_uploader::StoredFragment;
use std::cell::{Cell, RefCell};
use std::collections::{HashMap, VecDeque};
use std::ops::Range;
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

/// A failure that repeats (a replica down, a store unreachable) is logged
/// at most this often per journal.
pub const REPEAT_WARN_INTERVAL: Duration = Duration::from_secs(60);

/// Lets a message that may repeat every turn (a full disk fails each
/// batch) through once per [`REPEAT_WARN_INTERVAL`], counting the rest.
#[derive(Default)]
pub struct Repeated {
    last: Cell<Option<Instant>>,
    held: Cell<u64>,
}

impl Repeated {
    /// Some(number of occurrences held back since the last one let
    /// through) if this one is to be logged.
    pub fn due(&self) -> Option<u64> {
        if self
            .last
            .get()
            .is_some_and(|t| t.elapsed() < REPEAT_WARN_INTERVAL)
        {
            self.held.set(self.held.get() + 1);
            return None;
        }
        self.last.set(Some(Instant::now()));
        Some(self.held.replace(0))
    }
}

/// Work of a shard's journals that fails for many of them at once.
#[derive(Clone, Copy, Debug)]
pub enum SharedWork {
    /// Listing a fragment store; failures are keyed by the store's URL.
    Listing,
    /// Uploading to a fragment store; keyed likewise.
    Upload,
    /// Synchronizing with replicas; keyed by the replicas' ids.
    Sync,
    /// Replicating a batch; keyed by the id of the replica that failed it.
    Replication,
    /// Taking a primary's replicated records, as a replica; one key.
    Refusal,
}

/// Failures of work that journals share a cause of: a store that is down
/// fails every journal's listings and uploads, a broker that is down every
/// SYNC and batch replicated to it, a replica that restarted every
/// journal's next record. A line per journal would flood the log (tens of
/// thousands a minute on a broker of that many journals, just when its
/// disk fills with what it cannot upload). So the failures of one cause
/// are logged at most once per [`REPEAT_WARN_INTERVAL`] over a shard's
/// journals, with the count held back, and its recovery once after a
/// failure was logged.
#[derive(Default)]
pub struct SharedFailures {
    /// Per [`SharedWork`], by cause: its throttle, and whether a failure
    /// was logged since the last recovery was.
    by_cause: [RefCell<HashMap<String, (Repeated, bool)>>; 5],
}

impl SharedFailures {
    /// A failure of `work` from `cause`: Some(failures held back since the
    /// last one logged) if this one is to be logged.
    pub fn failed(&self, work: SharedWork, cause: &str) -> Option<u64> {
        let mut m = self.by_cause[work as usize].borrow_mut();
        let (repeated, logged) = m.entry(cause.to_string()).or_default();
        let due = repeated.due();
        *logged |= due.is_some();
        due
    }

    /// A success of `work` at `cause`: whether to log that it works again.
    pub fn worked(&self, work: SharedWork, cause: &str) -> bool {
        self.by_cause[work as usize]
            .borrow_mut()
            .get_mut(cause)
            .is_some_and(|(_, logged)| std::mem::take(logged))
    }
}

/// A streamed append idle this long is rolled back.
pub const APPEND_IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// A streamed append that another append has waited behind this long ...
pub const APPEND_BLOCKING_TIMEOUT: Duration = Duration::from_secs(30);
/// ... is rolled back if it has sent less than this many bytes per second
/// since it began: a trickle must not hold a journal from everyone else.
pub const APPEND_MIN_RATE: u64 = 1 << 20;

/// Content of one frame: a buffer and the range of it that is payload.
pub struct Chunk {
    /// Shared: the records of one received frame may each be a chunk, and
    /// the hasher may read it on its own thread.
    pub data: Arc<Vec<u8>>,
    pub range: Range<usize>,
}

impl Chunk {
    pub fn bytes(&self) -> &[u8] {
        &self.data[self.range.clone()]
    }
}

/// Where an append's own SHA-1 is being hashed.
pub enum AppendSha {
    /// On the shard, with the fragment's.
    Inline(Sha1),
    /// By the shard's hasher (large appends).
    Offloaded(crate::hasher::Offloaded),
}

impl AppendSha {
    /// Bytes of the append hashed so far (or sent to the hasher).
    pub fn hashed(&self) -> u64 {
        match self {
            AppendSha::Inline(sha) => sha.len(),
            AppendSha::Offloaded(o) => o.hashed(),
        }
    }

    /// The append is whole: its digest, now or once the hasher has it.
    pub fn finish(self) -> Digest {
        match self {
            AppendSha::Inline(sha) => Digest::Ready(sha.finalize()),
            AppendSha::Offloaded(o) => Digest::Pending(o.finish()),
        }
    }
}

/// An append's SHA-1 as its reply needs it.
pub enum Digest {
    Ready([u8; 20]),
    /// Still being hashed: it arrives on the channel.
    Pending(async_channel::Receiver<[u8; 20]>),
}

/// Why an append ended without committing, as decided outside the flusher.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AbortReason {
    /// The client asked (APPEND_CHUNK with ABORT): reply CANCELLED.
    Client,
    /// The connection closed: nobody to reply to.
    Closed,
    /// Idle too long: reply APPEND_TIMEOUT.
    Timeout,
    /// Too slow while others waited behind it: reply APPEND_TIMEOUT.
    TooSlow,
    /// The broker is stopping and the append was still streaming: reply
    /// SHUTTING_DOWN.
    ShuttingDown,
    /// A replica's append from a primary it no longer follows: the route
    /// changed, or another SYNC came first. Reply WRONG_ROUTE, so that the
    /// old primary fails its batch now instead of at its ack timeout.
    Superseded,
}

impl AbortReason {
    /// The reply to an append rolled back for this reason, if anybody is
    /// left to receive one.
    pub fn reply(self) -> Option<(Status, &'static str)> {
        match self {
            AbortReason::Client => Some((Status::CANCELLED, "append cancelled by the client")),
            AbortReason::Closed => None,
            AbortReason::Timeout => Some((Status::APPEND_TIMEOUT, "append idle too long; rolled back")),
            AbortReason::TooSlow => Some((
                Status::APPEND_TIMEOUT,
                "append streamed under 1 MiB/s while another append waited 30 s behind it; rolled back",
            )),
            AbortReason::ShuttingDown => Some((
                Status::SHUTTING_DOWN,
                "the broker is shutting down; the append was rolled back",
            )),
            AbortReason::Superseded => Some((
                Status::WRONG_ROUTE,
                "this broker no longer takes the journal's appends from this primary; rolled back",
            )),
        }
    }
}

/// One append, shared by the connection that feeds it and the flusher that
/// stages it.
pub struct AppendOp {
    pub request_id: u64,
    pub outbox: Rc<Outbox>,
    pub req: AppendRequest,
    pub chunks: RefCell<VecDeque<Chunk>>,
    /// The frame without MORE arrived.
    pub complete: Cell<bool>,
    pub aborted: Cell<Option<AbortReason>>,
    /// The reply was sent (the connection discards later chunks).
    pub finished: Cell<bool>,
    pub last_activity: Cell<Instant>,
    /// Bytes queued in `chunks`, charged to the connection's budget.
    pub budget: Rc<crate::conn::Budget>,
    /// Set when this append is a replica's copy of a primary's append.
    pub replica: Option<ReplicaOp>,
}

impl Drop for AppendOp {
    /// Whatever path let it go (a reply, a deleted journal, a closed
    /// connection), the bytes still queued on it leave its connection's
    /// and its shard's budgets.
    fn drop(&mut self) {
        let queued: usize = self.chunks.get_mut().drain(..).map(|c| c.range.len()).sum();
        if queued > 0 {
            self.budget.release(queued);
        }
    }
}

/// The replica side of a replicated append: where its ack goes and the
/// primary's proposal, once it arrives.
pub struct ReplicaOp {
    pub sink: Rc<AckSink>,
    pub proposal: RefCell<Option<Proposal>>,
    /// All of its content has arrived (the primary started a later append
    /// of the journal): it can be staged whole before its proposal comes.
    pub content_done: Cell<bool>,
}

/// A replica's append staged whole and waiting for its proposal.
pub struct Awaiting {
    pub op: Rc<AppendOp>,
    pub start: CommitPoint,
    pub end: CommitPoint,
    pub seq: u64,
}

/// A primary's commit proposal for one append.
#[derive(Clone, Debug)]
pub struct Proposal {
    pub end: u64,
    pub fragment_sha1: [u8; 20],
    pub registers: LabelSet,
}

/// Acks of one replication connection, sent many per REPLICATE_ACK frame:
/// everything pushed while a task runs goes out in one frame.
pub struct AckSink {
    pub outbox: Rc<Outbox>,
    pending: RefCell<Vec<rotary_net::repl::Ack>>,
    scheduled: Cell<bool>,
}

impl AckSink {
    pub fn new(outbox: Rc<Outbox>) -> Rc<AckSink> {
        Rc::new(AckSink {
            outbox,
            pending: RefCell::new(Vec::new()),
            scheduled: Cell::new(false),
        })
    }

    pub fn push(self: &Rc<Self>, seq: u64, status: Status, body: Vec<u8>) {
        self.pending
            .borrow_mut()
            .push(rotary_net::repl::Ack { seq, status, body });
        if !self.scheduled.replace(true) {
            // Runs once the current task yields: every ack pushed until
            // then shares the frame.
            let me = self.clone();
            compio::runtime::spawn(async move { me.flush() }).detach();
        }
    }

    pub fn flush(&self) {
        self.scheduled.set(false);
        let acks = std::mem::take(&mut *self.pending.borrow_mut());
        if acks.is_empty() {
            return;
        }
        self.outbox.frame(
            rotary_net::wire::Op::REPLICATE_ACK,
            Status::OK,
            0,
            &[],
            &rotary_net::repl::encode_acks(&acks),
        );
    }
}

impl AppendOp {
    /// Ends an append rolled back for its [`AbortReason`]: answered with
    /// the reason's status, or only marked finished when nobody is left to
    /// answer.
    pub fn end_aborted(&self, reply: &rotary_net::wire::AppendReply) {
        match self.aborted.get().and_then(AbortReason::reply) {
            Some((status, why)) => self.reply_error(status, reply, why),
            None => self.finished.set(true),
        }
    }

    pub fn reply_error(
        &self,
        status: Status,
        reply: &rotary_net::wire::AppendReply,
        message: &str,
    ) {
        assert!(status != Status::OK);
        if self.finished.replace(true) {
            return;
        }
        if let Some(r) = &self.replica {
            r.sink
                .push(self.request_id, status, message.as_bytes().to_vec());
            return;
        }
        self.outbox.error(
            rotary_net::wire::Op::APPEND_REPLY,
            status,
            self.request_id,
            &reply.encode(),
            message,
        );
    }
}

/// The append being staged into the spool.
pub struct Active {
    pub op: Rc<AppendOp>,
    /// Spool point where the append begins (to rewind to on failure).
    pub start: CommitPoint,
    /// The append's own SHA-1, for its reply.
    pub sha: AppendSha,
    /// Offset into the front chunk already staged.
    pub chunk_pos: usize,
    /// Sequence number on the journal's pipelines (primaries with replicas).
    pub seq: u64,
    /// When it began to be staged.
    pub started: Instant,
    /// Keeps its connection read while it holds the journal.
    pub _streaming: crate::conn::Streaming,
}

impl Active {
    /// Whether this append, still streaming, has held the journal from an
    /// append waiting behind it too long while sending too slowly.
    /// `max_rate` is the journal's `max_append_rate` (0: none): an append
    /// that sends at least half of it is never too slow.
    pub fn holds_up(&self, waiting: Option<&AppendOp>, max_rate: u64) -> bool {
        let Some(waiting) = waiting else {
            return false;
        };
        let held = self.started.elapsed();
        let min_rate = match max_rate {
            0 => APPEND_MIN_RATE,
            r => APPEND_MIN_RATE.min(r / 2),
        };
        !self.op.complete.get()
            && self.op.replica.is_none()
            && held > APPEND_BLOCKING_TIMEOUT
            && waiting.last_activity.get().elapsed() > APPEND_BLOCKING_TIMEOUT
            && (self.sha.hashed() as f64) < min_rate as f64 * held.as_secs_f64()
    }
}

/// An append fully staged in the current batch, waiting for durability.
pub struct Staged {
    pub op: Rc<AppendOp>,
    pub begin: u64,
    pub end: u64,
    /// The append's own SHA-1 (unused on replicas).
    pub sha1: Digest,
    pub point: CommitPoint,
    pub registers: LabelSet,
    pub seq: u64,
}

/// A journal's batch committed on its primary and proposed to its
/// replicas, awaiting their acks.
pub struct InFlight {
    pub staged: Vec<Staged>,
    /// For each replica's pipeline.
    pub waits: Vec<Wait>,
}

/// (pipeline, epoch, seqs proposed on it) of a proposed batch.
pub type Wait = (Rc<crate::pipeline::Pipeline>, u64, Vec<u64>);

/// A primary's view of its journal's replicas, agreed by SYNC.
pub struct PrimaryRepl {
    /// Route member ids at the SYNC, primary first.
    pub members: Vec<String>,
    /// The pipeline to each replica and the connection epoch synced over.
    pub pipelines: Vec<(Rc<crate::pipeline::Pipeline>, u64)>,
    /// The topology version (cluster views) the SYNC was made in.
    pub version: u64,
}

impl PrimaryRepl {
    /// Whether every pipeline is still the connection the SYNC went over.
    pub fn is_live(&self) -> bool {
        self.pipelines
            .iter()
            .all(|(p, e)| p.live_epoch() == Some(*e))
    }
}

/// A primary's SYNC waiting for the replica's flusher.
pub struct SyncWaiter {
    pub sink: Rc<AckSink>,
    pub req: rotary_net::repl::SyncRequest,
}

pub struct Journal {
    pub name: String,
    pub spec: JournalSpec,
    pub dir: PathBuf,
    /// Sealed local fragments, by begin.
    pub fragments: Vec<LocalFragment>,
    pub spool: Option<Spool>,
    /// The spool is out of `spool` while an operation on it awaits (a seal,
    /// or a reload of its tail): its bytes are in no file a read can
    /// locate until it is back, or sealed into `fragments`. Reads of them
    /// wait, and `committed` is notified when it ends.
    pub spool_out: bool,
    /// Write head visible to readers: committed here and on every replica.
    pub head: u64,
    pub registers: LabelSet,
    /// Answered to appenders. Beyond `head` only while a batch answered
    /// from the commit log (see `Shard::answer_early`) waits for its spool
    /// write; readers of those bytes wait for it too.
    pub answered: u64,
    /// Committed here (in the commit log); replicas may not have acked yet.
    pub local_head: u64,
    pub local_registers: LabelSet,
    /// Primary: the agreed replica pipelines (None: SYNC needed).
    pub repl: Option<PrimaryRepl>,
    /// Primary: a SYNC is under way.
    pub syncing: bool,
    /// The broker started with none of the journal's data (no fragment,
    /// spool or commit record): as its primary it knows its head only
    /// after its first SYNC, so reads wait for that (see `Shard::read`).
    pub first_sync_pending: bool,
    /// The topology version at which this broker, as the journal's
    /// primary, last asked the brokers of its earlier routes for bytes beyond
    /// its head (see `Shard::takeover_sources`); 0: not yet. Appends and
    /// reads wait for that.
    pub takeover_version: u64,
    /// The cluster view changed since the shard's tick last looked at the
    /// journal's route: if this broker became its primary, the tick takes
    /// it over then rather than at its first request (see `Shard::tick`).
    pub route_check: bool,
    /// Primary: after a failed SYNC, when to try again, and why it failed.
    pub sync_retry: Option<(Instant, crate::pipeline::Failure)>,
    /// Primary: committed batches awaiting replica acks (those in
    /// `proposed`, and the one the journal's acker waits on).
    pub inflight: usize,
    /// Primary: batches proposed and not yet taken by the journal's
    /// acker, oldest first.
    pub proposed: VecDeque<InFlight>,
    /// Primary: the journal's acker task is running.
    pub acking: bool,
    /// Primary: this turn's staged appends went to replicas.
    pub staged_with_replicas: bool,
    /// Replica: the position in the primary's stream.
    pub replica: Option<crate::replica::ReplicaTrack>,
    /// Replica: appends staged whole, oldest first, awaiting proposals.
    pub awaiting: VecDeque<Awaiting>,
    /// Replica: SYNCs waiting to be applied by the flusher.
    pub sync_waiters: Vec<SyncWaiter>,
    /// When the last append was queued (primaries pulse idle journals).
    pub last_append: Instant,
    pub queue: VecDeque<Rc<AppendOp>>,
    pub active: Option<Active>,
    /// Appends staged in the batch being built or written.
    pub staged: Vec<Staged>,
    /// Head and registers as of the last staged append.
    pub staged_head: u64,
    pub staged_registers: LabelSet,
    /// Wakes readers waiting at the head.
    pub committed: Event,
    pub seal_requested: bool,
    pub seal_waiters: Vec<(Rc<Outbox>, u64)>,
    /// When the open spool took its first commit.
    pub spool_since: Option<SystemTime>,
    pub rate: TokenBucket,
    /// A timer will ready the journal when its rate admits more bytes.
    pub rate_timer: bool,
    pub deleted: bool,
    /// Fragments listed from the journal's stores, by begin. Changed only
    /// through `set_listing`, `insert_remote`, `drop_remote` and
    /// `forget_index`.
    pub remote: Vec<StoredFragment>,
    /// For each fragment of `remote`, the furthest end of it and those
    /// before it: [`Self::locate`] stops looking back where no earlier
    /// fragment reaches the offset.
    remote_reach: Vec<u64>,
    /// Objects found not to hold the bytes their names say (store, key):
    /// left out of every listing.
    corrupt: std::collections::HashSet<(String, String)>,
    /// Fragments this broker's uploads confirmed, with the count of
    /// confirmations so far: a listing that started before a confirmation
    /// must not drop it (the local copy may already be gone).
    confirmed: Vec<(u64, StoredFragment)>,
    confirmations: u64,
    /// A listing of every store succeeded at least once (always true for
    /// journals without stores). Appends wait for it: the store may hold
    /// offsets beyond the local head.
    pub index_loaded: bool,
    /// The last listing error, for operators and refusals.
    pub index_error: Option<String>,
    pub last_listing: Option<Instant>,
    /// The index was let go (see [`Self::forget_index`]): the tick lists
    /// the journal again only once `refresh_interval` has passed, not
    /// every second as for a first listing.
    pub index_forgotten: bool,
    pub listing: bool,
    /// Waiting in the shard's queue of listings (see
    /// `Shard::refresh_listing`).
    pub listing_queued: bool,
    /// A request waits for the first listing, which was started ahead of
    /// the queue (see `Shard::hurry_first_listing`).
    pub listing_hurried: bool,
    pub reset_waiters: Vec<(Rc<Outbox>, u64)>,
    /// The newest staged bytes, kept while readers wait at the head so
    /// that tailing readers are served from memory, not the spool file.
    pub tail: TailCache,
    /// Blocking readers waiting for the next commit.
    pub waiting_readers: usize,
    /// Reads of a local file (fragment or spool) in flight: while any is,
    /// no fragment file of the journal is reused as a spare spool.
    pub reads_in_flight: usize,
}

/// Most bytes one journal's [`TailCache`] keeps (it holds up to twice its
/// window between trims).
pub const TAIL_CACHE_BYTES: usize = 4 << 20;
/// Fewest: a shard of very many tailed journals still serves readers at
/// the head from memory.
pub const TAIL_CACHE_MIN_BYTES: usize = 64 << 10;
/// What the tail caches of one shard's journals hold together, at most
/// (unless the shard has so many journals that each window is at its
/// minimum): every tailed journal of a busy shard keeps a cache, and
/// thousands of 4 MiB windows would not fit in memory.
pub const TAIL_CACHE_SHARD_BYTES: usize = 64 << 20;

/// The window of each tail cache on a shard of `journals` journals.
pub fn tail_window(journals: usize) -> usize {
    (TAIL_CACHE_SHARD_BYTES / 2 / journals.max(1)).clamp(TAIL_CACHE_MIN_BYTES, TAIL_CACHE_BYTES)
}

/// A contiguous window `[begin, begin + len)` of a journal's newest bytes.
/// Bytes beyond the write head are staged, not committed: readers take
/// only what is below the head, and rollbacks truncate.
#[derive(Default)]
pub struct TailCache {
    begin: u64,
    buf: Vec<u8>,
    /// Where the buffer's size is counted (`tail_cache_bytes`), from the
    /// first push on.
    counted: Option<Arc<Metrics>>,
}

impl Drop for TailCache {
    fn drop(&mut self) {
        if let Some(m) = &self.counted {
            metrics::sub(&m.tail_cache_bytes, self.buf.capacity() as u64);
        }
    }
}

impl TailCache {
    pub fn end(&self) -> u64 {
        self.begin + self.buf.len() as u64
    }

    /// Adds bytes staged at `offset`; a gap restarts the window there.
    /// Once more than twice `window` bytes would be held, the oldest go,
    /// down to `window`; the buffer never grows past twice `window`.
    pub fn push(&mut self, offset: u64, bytes: &[u8], window: usize, counted: &Arc<Metrics>) {
        let before = self.buf.capacity();
        self.put(offset, bytes, window);
        let m = self.counted.get_or_insert_with(|| counted.clone());
        let after = self.buf.capacity();
        if after > before {
            metrics::add(&m.tail_cache_bytes, (after - before) as u64);
        } else {
            metrics::sub(&m.tail_cache_bytes, (before - after) as u64);
        }
    }

    fn put(&mut self, offset: u64, bytes: &[u8], window: usize) {
        if offset != self.end() {
            self.buf.clear();
            self.begin = offset;
        }
        let total = self.buf.len() + bytes.len();
        let bytes = if total > 2 * window {
            let drop = total - window;
            if drop >= self.buf.len() {
                let skip = drop - self.buf.len();
                self.begin = offset + skip as u64;
                self.buf.clear();
                &bytes[skip..]
            } else {
                self.buf.drain(..drop);
                self.begin += drop as u64;
                bytes
            }
        } else {
            bytes
        };
        let need = self.buf.len() + bytes.len();
        if need > self.buf.capacity() {
            let want = (2 * self.buf.capacity()).clamp(need, 2 * window.max(need / 2));
            self.buf.reserve_exact(want - self.buf.len());
        }
        self.buf.extend_from_slice(bytes);
        if self.buf.capacity() > 2 * window {
            // A window that shrank (more journals on the shard).
            self.buf.shrink_to(2 * window);
        }
    }

    /// Bytes the cache's buffer holds allocated.
    pub fn capacity(&self) -> usize {
        self.buf.capacity()
    }

    /// Forgets bytes at and beyond `to` (a rollback).
    pub fn truncate(&mut self, to: u64) {
        if to <= self.begin {
            self.buf.clear();
            self.begin = to;
        } else if to < self.end() {
            self.buf.truncate((to - self.begin) as usize);
        }
    }

    /// The cached bytes of `[from, to)`, if the window starts at or before
    /// `from` and holds at least one of them.
    pub fn get(&self, from: u64, to: u64) -> Option<&[u8]> {
        let to = to.min(self.end());
        (from >= self.begin && from < to)
            .then(|| &self.buf[(from - self.begin) as usize..(to - self.begin) as usize])
    }
}

impl Journal {
    pub fn new(spec: JournalSpec, dir: PathBuf) -> Journal {
        Journal {
            name: spec.name.clone(),
            rate: TokenBucket::new(spec.max_append_rate),
            rate_timer: false,
            spec,
            dir,
            fragments: Vec::new(),
            spool: None,
            spool_out: false,
            head: 0,
            registers: LabelSet::new(),
            answered: 0,
            local_head: 0,
            local_registers: LabelSet::new(),
            repl: None,
            syncing: false,
            sync_retry: None,
            first_sync_pending: false,
            takeover_version: 0,
            route_check: false,
            inflight: 0,
            proposed: VecDeque::new(),
            acking: false,
            staged_with_replicas: false,
            replica: None,
            awaiting: VecDeque::new(),
            sync_waiters: Vec::new(),
            last_append: Instant::now(),
            queue: VecDeque::new(),
            active: None,
            staged: Vec::new(),
            staged_head: 0,
            staged_registers: LabelSet::new(),
            committed: Event::new(),
            seal_requested: false,
            seal_waiters: Vec::new(),
            spool_since: None,
            deleted: false,
            remote: Vec::new(),
            corrupt: std::collections::HashSet::new(),
            remote_reach: Vec::new(),
            index_loaded: false,
            index_error: None,
            last_listing: None,
            index_forgotten: false,
            listing_queued: false,
            listing_hurried: false,
            listing: false,
            confirmed: Vec::new(),
            confirmations: 0,
            reset_waiters: Vec::new(),
            tail: TailCache::default(),
            waiting_readers: 0,
            reads_in_flight: 0,
        }
    }

    /// A journal without stores has its whole index locally.
    pub fn init_index(&mut self) {
        self.index_loaded = !self.has_stores();
    }

    /// The spool is back (or sealed into `fragments`): reads that waited
    /// for it go on.
    pub fn spool_back(&mut self) {
        self.spool_out = false;
        self.committed.notify(usize::MAX);
    }

    /// Lets the stores' index go, as a broker outside the journal's route
    /// may: it proxies the journal's reads and appends, so listing its
    /// stores every `refresh_interval` would only multiply the store's
    /// LISTs by the cluster's size. The journal returns to the state it
    /// has at a start: a request that needs the index (an append once the
    /// route holds this broker again, FRAGMENTS) waits for a fresh listing,
    /// so nothing uploaded meanwhile by its members is missed. Refused
    /// (false) while the broker holds any of the journal's bytes: those
    /// are dropped or uploaded by the listings it still makes.
    pub fn forget_index(&mut self) -> bool {
        let holds_bytes =
            !self.fragments.is_empty() || self.spool.as_ref().is_some_and(|s| !s.is_empty());
        if holds_bytes || self.listing || !self.has_stores() {
            return false;
        }
        self.index_loaded = false;
        self.index_error = None;
        self.index_forgotten = true;
        self.listing_hurried = false;
        self.last_listing = Some(Instant::now());
        self.remote = Vec::new();
        self.confirmed.clear();
        self.remote_changed();
        true
    }

    pub fn has_stores(&self) -> bool {
        !self.spec.fragment.stores.is_empty()
    }

    /// The end of readable history: the write head, or further when the
    /// stores or local fragments hold more (before a head reset).
    pub fn read_head(&self) -> u64 {
        let local = self.fragments.iter().map(|f| f.end).max().unwrap_or(0);
        self.head.max(self.remote_end()).max(local)
    }

    /// End of the furthest fragment the stores hold.
    pub fn remote_end(&self) -> u64 {
        self.remote_reach.last().copied().unwrap_or(0)
    }

    /// Adds a fragment the store confirmed, unless the index has it.
    pub fn insert_remote(&mut self, f: StoredFragment) {
        self.confirmations += 1;
        self.confirmed.push((self.confirmations, f.clone()));
        self.add_remote(f);
    }

    /// Where a listing starting now stands: pass it to [`Self::set_listing`].
    pub fn listing_mark(&self) -> u64 {
        self.confirmations
    }

    /// Adds a fragment this broker uploaded. Another object of the same
    /// span but other bytes (a deleted journal's of the same name) gives
    /// way to it: these are the bytes this broker committed.
    fn add_remote(&mut self, f: StoredFragment) {
        let at = self.remote.partition_point(|r| r.begin < f.begin);
        if let Some(r) = self.remote[at..]
            .iter_mut()
            .take_while(|r| r.begin == f.begin)
            .find(|r| r.end == f.end)
        {
            if r.sha1 != f.sha1 {
                *r = f;
            }
            return;
        }
        self.remote.insert(at, f);
        self.remote_changed();
    }

    /// Removes a fragment from the index: its object is gone (pruned), or
    /// does not hold the bytes its name says (`corrupt`), when later
    /// listings leave it out too.
    pub fn drop_remote(&mut self, f: &StoredFragment, corrupt: bool) {
        let same = |r: &StoredFragment| r.store == f.store && r.key == f.key;
        self.remote.retain(|r| !same(r));
        self.confirmed.retain(|(_, r)| !same(r));
        if corrupt {
            self.corrupt.insert((f.store.clone(), f.key.clone()));
        }
        self.remote_changed();
    }

    /// The end offset every append checks is kept, not recomputed: the
    /// index may hold thousands of fragments.
    fn remote_changed(&mut self) {
        let mut reach = 0;
        self.remote_reach.clear();
        self.remote_reach.extend(self.remote.iter().map(|f| {
            reach = reach.max(f.end);
            reach
        }));
    }

    /// Merges a fresh listing into the index: the listing replaces what
    /// was known from the stores, so objects removed from a store leave the
    /// log (local copies still serve their spans). Uploads confirmed after
    /// the listing started (`mark`, from [`Self::listing_mark`]) stay.
    /// Readers waiting for bytes are woken: the index may now hold them.
    pub fn set_listing(&mut self, mut listed: Vec<StoredFragment>, mark: u64) {
        listed.retain(|f| !self.corrupt.contains(&(f.store.clone(), f.key.clone())));
        // Of two objects of one span, the one holding the bytes of a local
        // fragment comes first and stays.
        let local = |f: &StoredFragment| {
            self.fragments
                .iter()
                .any(|l| l.begin == f.begin && l.end == f.end && l.sha1 == f.sha1)
        };
        listed.sort_by_key(|f| (f.begin, std::cmp::Reverse(f.end), !local(f)));
        listed.dedup_by(|b, a| a.begin == b.begin && a.end == b.end);
        for f in &mut self.fragments {
            if !f.uploaded
                && listed
                    .iter()
                    .any(|r| r.begin == f.begin && r.end == f.end && r.sha1 == f.sha1)
            {
                f.uploaded = true;
            }
        }
        self.remote = listed;
        self.confirmed.retain(|(n, _)| *n > mark);
        for (_, f) in self.confirmed.clone() {
            self.add_remote(f);
        }
        self.remote_changed();
        self.committed.notify(usize::MAX);
    }

    /// Whether the open spool should seal before the next append starts.
    pub fn wants_seal(&self, now: SystemTime) -> bool {
        let Some(spool) = &self.spool else {
            return false;
        };
        if spool.is_empty() {
            return self.seal_requested;
        }
        if self.seal_requested || spool.len() >= self.spec.fragment.length {
            return true;
        }
        flush_boundary_crossed(self.spool_since, self.spec.fragment.flush_interval, now)
    }

    /// Where `offset` can be read: local files first (sealed fragments,
    /// then the spool), then the stores, preferring the larger fragment.
    /// An offset in a gap of history resolves to the next span's start.
    pub fn locate(&self, offset: u64) -> Option<Located> {
        // Of the stores' fragments holding `at`, the one reaching furthest
        // (the last in the index of those reaching equally far). The index
        // is sorted by begin, and a journal's history may be hundreds of
        // thousands of fragments long: a read looks back only as far as
        // fragments reaching `at` can begin.
        let remote = |at: u64| -> Option<Located> {
            let mut found: Option<&StoredFragment> = None;
            let upto = self.remote.partition_point(|f| f.begin <= at);
            for i in (0..upto).rev() {
                if self.remote_reach[i] <= at {
                    break;
                }
                let f = &self.remote[i];
                if f.end > at && found.is_none_or(|b| f.end > b.end) {
                    found = Some(f);
                }
            }
            let f = found?;
            Some(Located {
                file: FileRef::Remote(f.clone()),
                offset: at,
                file_pos: at - f.begin,
                end: f.end,
            })
        };
        let local = |at: u64| -> Option<Located> {
            for f in &self.fragments {
                if f.begin <= at && at < f.end {
                    if let Some(why) = &f.corrupt {
                        // A store's copy, if there is one; else the read
                        // fails here rather than serve wrong bytes.
                        return remote(at).or_else(|| {
                            Some(Located {
                                file: FileRef::Corrupt(format!("{}: {why}", f.path.display())),
                                offset: at,
                                file_pos: at - f.begin,
                                end: f.end,
                            })
                        });
                    }
                    let file = if f.verified {
                        FileRef::Fragment(f.path.clone(), f.file.clone())
                    } else {
                        FileRef::Unchecked(f.path.clone())
                    };
                    return Some(Located {
                        file,
                        offset: at,
                        file_pos: at - f.begin,
                        end: f.end,
                    });
                }
            }
            let spool = self.spool.as_ref()?;
            // Bytes committed here but not yet acknowledged by every
            // replica are not readable.
            let end = spool.committed().min(self.head);
            (spool.begin() <= at && at < end).then(|| Located {
                file: FileRef::Open(spool.file().clone()),
                offset: at,
                file_pos: at - spool.begin(),
                end,
            })
        };
        if let Some(l) = local(offset).or_else(|| remote(offset)) {
            return Some(l);
        }
        // A gap: jump to the next span that exists.
        let next_remote = self
            .remote
            .get(self.remote.partition_point(|f| f.begin <= offset));
        let next = self
            .fragments
            .iter()
            .map(|f| f.begin)
            .chain(next_remote.map(|f| f.begin))
            .chain(
                self.spool
                    .as_ref()
                    .filter(|s| !s.is_empty())
                    .map(|s| s.begin()),
            )
            .filter(|&b| b > offset)
            .min()?;
        local(next).or_else(|| remote(next))
    }
}

pub enum FileRef {
    Open(Rc<compio::fs::File>),
    Fragment(PathBuf, Option<Rc<compio::fs::File>>),
    /// A local fragment found on disk at start whose bytes have not been
    /// checked against its name yet (see [`LocalFragment::verified`]): a
    /// read checks it whole first.
    Unchecked(PathBuf),
    Remote(StoredFragment),
    /// A local fragment known not to hold its bytes, and why.
    Corrupt(String),
}

pub struct Located {
    pub file: FileRef,
    pub offset: u64,
    pub file_pos: u64,
    pub end: u64,
}

/// Whether a UTC multiple of `interval` lies between `since` and `now`.
pub fn flush_boundary_crossed(
    since: Option<SystemTime>,
    interval: Duration,
    now: SystemTime,
) -> bool {
    let Some(since) = since else { return false };
    if interval.is_zero() {
        return false;
    }
    let secs = |t: SystemTime| {
        t.duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs()
    };
    let iv = interval.as_secs().max(1);
    secs(now) / iv > secs(since) / iv
}

/// Admits bytes at `rate` per second with one second of burst; zero is
/// unlimited.
pub struct TokenBucket {
    rate: u64,
    tokens: f64,
    last: Instant,
}

impl TokenBucket {
    pub fn new(rate: u64) -> Self {
        TokenBucket {
            rate,
            tokens: rate as f64,
            last: Instant::now(),
        }
    }

    pub fn set_rate(&mut self, rate: u64) {
        if rate != self.rate {
            *self = TokenBucket::new(rate);
        }
    }

    /// Returns bytes admitted but not used.
    pub fn give_back(&mut self, n: u64) {
        if self.rate != 0 {
            self.tokens = (self.tokens + n as f64).min(self.rate as f64);
        }
    }

    /// Zero when unlimited.
    pub fn rate(&self) -> u64 {
        self.rate
    }

    /// Takes as many of `n` bytes as may go now (all of them when
    /// unlimited), at least one; or, if none may, says how long until one
    /// may.
    pub fn admit(&mut self, n: u64, now: Instant) -> Result<u64, Duration> {
        if self.rate == 0 {
            return Ok(n);
        }
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = now;
        self.tokens = (self.tokens + elapsed * self.rate as f64).min(self.rate as f64);
        if self.tokens < 1.0 {
            return Err(Duration::from_secs_f64(
                (1.0 - self.tokens) / self.rate as f64,
            ));
        }
        let take = n.min(self.tokens as u64);
        self.tokens -= take as f64;
        Ok(take)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flush_boundaries_are_utc_multiples() {
        let t = |s: u64| SystemTime::UNIX_EPOCH + Duration::from_secs(s);
        let h = Duration::from_secs(3600);
        assert!(!flush_boundary_crossed(Some(t(3600)), h, t(7199)));
        assert!(flush_boundary_crossed(Some(t(3600)), h, t(7200)));
        assert!(flush_boundary_crossed(Some(t(7199)), h, t(7200)));
        assert!(!flush_boundary_crossed(None, h, t(99999)));
        assert!(!flush_boundary_crossed(
            Some(t(0)),
            Duration::ZERO,
            t(99999)
        ));
    }

    fn object(begin: u64, end: u64, sha: u8) -> StoredFragment {
        StoredFragment {
            journal: "a/b/c".into(),
            begin,
            end,
            sha1: [sha; 20],
            codec: rotary_net::spec::Codec::None,
            store: "file:///s/".into(),
            key: format!("a/b/c/{begin}-{end}-{sha}"),
            size: end - begin,
            mod_time: SystemTime::UNIX_EPOCH,
        }
    }

    /// A sealed fragment not yet uploaded.
    fn local(begin: u64, end: u64, sha: u8) -> LocalFragment {
        LocalFragment {
            begin,
            end,
            sha1: [sha; 20],
            path: PathBuf::from("/nonexistent/f"),
            file: None,
            uploaded: false,
            uploading: false,
            corrupt: None,
            verified: true,
            sealed_at: SystemTime::UNIX_EPOCH,
        }
    }

    fn shas(j: &Journal) -> Vec<(u64, u64, u8)> {
        j.remote
            .iter()
            .map(|r| (r.begin, r.end, r.sha1[0]))
            .collect()
    }

    /// Two objects of one span (a journal deleted and created again): the
    /// index keeps the one holding this broker's bytes, whichever order
    /// the store lists them in; a corrupt object stays out of it.
    #[test]
    fn the_index_prefers_this_brokers_bytes_and_forgets_corrupt_objects() {
        let mut j = Journal::new(JournalSpec::new("a/b/c"), PathBuf::from("/nonexistent"));
        j.fragments.push(local(0, 8, 2));
        for listed in [
            vec![object(0, 8, 1), object(0, 8, 2)],
            vec![object(0, 8, 2), object(0, 8, 1)],
        ] {
            j.set_listing(listed, j.listing_mark());
            assert_eq!(shas(&j), [(0, 8, 2)]);
            assert!(j.fragments[0].uploaded);
        }
        // Without a local copy, an upload this broker confirmed wins over
        // an object listed before it.
        j.fragments.clear();
        j.set_listing(vec![object(8, 16, 1)], j.listing_mark());
        j.insert_remote(object(8, 16, 3));
        assert_eq!(shas(&j), [(8, 16, 3)]);
        // A corrupt object leaves the index for good; a pruned one comes
        // back if a store lists it again.
        let bad = object(8, 16, 3);
        j.drop_remote(&bad, true);
        let gone = object(16, 24, 4);
        j.set_listing(vec![bad.clone(), gone.clone()], j.listing_mark());
        assert_eq!(shas(&j), [(16, 24, 4)]);
        j.drop_remote(&gone, false);
        assert!(j.remote.is_empty());
        assert_eq!(j.remote_end(), 0);
        j.set_listing(vec![bad, gone], j.listing_mark());
        assert_eq!(shas(&j), [(16, 24, 4)]);
    }

    /// A broker outside the route lets the index go only while it holds
    /// none of the journal's bytes and no listing is under way; what it
    /// forgets is gone, and the journal waits for a listing again.
    #[test]
    fn an_index_is_let_go_only_by_a_broker_holding_no_bytes() {
        let mut spec = JournalSpec::new("a/b/c");
        let mut j = Journal::new(spec.clone(), PathBuf::from("/nonexistent"));
        j.init_index();
        assert!(!j.forget_index(), "nothing to forget without stores");
        spec.fragment.stores = vec!["file:///s/".into()];
        j.spec = spec;
        j.init_index();
        j.set_listing(vec![object(0, 8, 1), object(8, 16, 2)], j.listing_mark());
        j.index_loaded = true;
        j.listing = true;
        assert!(!j.forget_index(), "a listing is under way");
        j.listing = false;
        j.fragments.push(local(16, 24, 3));
        assert!(!j.forget_index(), "a local fragment is still to upload");
        assert!(j.index_loaded);
        assert_eq!(j.remote_end(), 16);
        j.fragments.clear();
        assert!(j.forget_index());
        assert!(!j.index_loaded && j.index_forgotten && j.last_listing.is_some());
        assert!(j.remote.is_empty());
        assert_eq!(j.remote_end(), 0);
        assert_eq!(j.read_head(), 0);
        // The next listing brings it back whole.
        j.set_listing(vec![object(0, 8, 1), object(8, 16, 2)], j.listing_mark());
        assert_eq!(shas(&j), [(0, 8, 1), (8, 16, 2)]);
        assert_eq!(j.remote_end(), 16);
    }

    /// Reads find, of the stores' fragments holding an offset, the one
    /// reaching furthest, and across a gap the next that begins, as a
    /// look at every fragment would; seeded, with fragments overlapping.
    #[test]
    fn located_store_fragments_match_a_look_at_every_one() {
        use rand::{Rng, SeedableRng};
        for seed in 0..20u64 {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let mut j = Journal::new(JournalSpec::new("a/b/c"), PathBuf::from("/nonexistent"));
            let random = |rng: &mut rand::rngs::StdRng| {
                let begin = rng.gen_range(0..5_000u64);
                object(begin, begin + rng.gen_range(1..400), rng.gen_range(0..4))
            };
            let listed: Vec<_> = (0..rng.gen_range(1..300))
                .map(|_| random(&mut rng))
                .collect();
            j.set_listing(listed, j.listing_mark());
            for _ in 0..20 {
                j.insert_remote(random(&mut rng));
            }
            for _ in 0..10 {
                let i = rng.gen_range(0..j.remote.len());
                let f = j.remote[i].clone();
                j.drop_remote(&f, false);
            }
            let want = |at: u64| -> Option<(String, u64)> {
                let holding = |at: u64| {
                    j.remote
                        .iter()
                        .filter(|f| f.begin <= at && at < f.end)
                        .max_by_key(|f| f.end)
                };
                match holding(at) {
                    Some(f) => Some((f.key.clone(), at)),
                    None => {
                        let next = j.remote.iter().map(|f| f.begin).filter(|&b| b > at).min()?;
                        holding(next).map(|f| (f.key.clone(), next))
                    }
                }
            };
            assert_eq!(
                j.remote_end(),
                j.remote.iter().map(|f| f.end).max().unwrap_or(0)
            );
            for at in 0..j.remote_end() + 2 {
                let got = j.locate(at).map(|l| match l.file {
                    FileRef::Remote(f) => {
                        assert_eq!(l.file_pos, l.offset - f.begin);
                        assert_eq!(l.end, f.end);
                        (f.key, l.offset)
                    }
                    _ => panic!("not a store's fragment"),
                });
                assert_eq!(got, want(at), "seed {seed}, offset {at}");
            }
        }
    }

    /// A local fragment found damaged is read from a store's copy of its
    /// span, or not at all; the fragments around it read as before.
    #[test]
    fn a_damaged_local_fragment_is_read_from_the_store_or_refused() {
        let mut j = Journal::new(JournalSpec::new("a/b/c"), PathBuf::from("/nonexistent"));
        for (begin, end) in [(0, 8), (8, 16)] {
            j.fragments.push(LocalFragment {
                begin,
                end,
                sha1: [2; 20],
                path: PathBuf::from(format!("/nonexistent/{begin}")),
                file: None,
                uploaded: false,
                uploading: false,
                corrupt: None,
                verified: true,
                sealed_at: SystemTime::UNIX_EPOCH,
            });
        }
        j.fragments[0].corrupt = Some("bytes hash to 00".into());
        let located = |j: &Journal, at: u64| {
            let l = j.locate(at).expect("located");
            let file = match l.file {
                FileRef::Corrupt(why) => format!("corrupt {why}"),
                FileRef::Fragment(path, _) => format!("local {}", path.display()),
                FileRef::Unchecked(path) => format!("unchecked {}", path.display()),
                FileRef::Remote(f) => format!("store {}-{}", f.begin, f.end),
                FileRef::Open(_) => "spool".into(),
            };
            (file, l.offset, l.file_pos, l.end)
        };
        assert_eq!(
            located(&j, 3),
            ("corrupt /nonexistent/0: bytes hash to 00".into(), 3, 3, 8)
        );
        assert_eq!(located(&j, 8), ("local /nonexistent/8".into(), 8, 0, 16));
        // Found on disk and not checked yet: the read checks it first.
        j.fragments[1].verified = false;
        assert_eq!(
            located(&j, 9),
            ("unchecked /nonexistent/8".into(), 9, 1, 16)
        );
        j.fragments[1].verified = true;
        j.set_listing(vec![object(0, 8, 2)], j.listing_mark());
        assert_eq!(located(&j, 3), ("store 0-8".into(), 3, 3, 8));
    }

    #[test]
    fn repeated_messages_pass_once_a_minute_with_a_count() {
        let r = Repeated::default();
        assert_eq!(r.due(), Some(0));
        assert_eq!(r.due(), None);
        assert_eq!(r.due(), None);
        r.last.set(Instant::now().checked_sub(REPEAT_WARN_INTERVAL));
        assert_eq!(r.due(), Some(2));
        assert_eq!(r.due(), None);
    }

    #[test]
    fn shared_failures_are_logged_per_cause_and_their_recovery_once() {
        let f = SharedFailures::default();
        let (a, b) = ("s3://a/", "s3://b/");
        assert!(!f.worked(SharedWork::Listing, a), "never failed");
        // The first failure of each store and kind is logged, the rest held.
        assert_eq!(f.failed(SharedWork::Listing, a), Some(0));
        assert_eq!(f.failed(SharedWork::Listing, a), None);
        assert_eq!(f.failed(SharedWork::Listing, b), Some(0));
        assert_eq!(f.failed(SharedWork::Upload, a), Some(0));
        // Its recovery is logged once; a failure right after is held, and
        // so is the recovery after that.
        assert!(f.worked(SharedWork::Listing, a));
        assert!(!f.worked(SharedWork::Listing, a));
        assert_eq!(f.failed(SharedWork::Listing, a), None);
        assert!(!f.worked(SharedWork::Listing, a));
        // A minute on, the next failure is logged with the count held back.
        f.by_cause[SharedWork::Listing as usize]
            .borrow()
            .get(a)
            .unwrap()
            .0
            .last
            .set(Instant::now().checked_sub(REPEAT_WARN_INTERVAL));
        assert_eq!(f.failed(SharedWork::Listing, a), Some(2));
        assert!(f.worked(SharedWork::Listing, a));
        assert!(f.worked(SharedWork::Upload, a));
        assert!(f.worked(SharedWork::Listing, b));
    }

    #[test]
    fn tail_cache_window() {
        let w = TAIL_CACHE_BYTES;
        let m = Arc::new(Metrics::default());
        let mut t = TailCache::default();
        t.push(100, b"abcdef", w, &m);
        assert_eq!(t.get(100, 103), Some(&b"abc"[..]));
        assert_eq!(t.get(102, 999), Some(&b"cdef"[..]));
        assert_eq!(t.get(99, 103), None, "before the window");
        assert_eq!(t.get(106, 999), None, "at its end");
        t.truncate(104);
        assert_eq!(t.get(100, 999), Some(&b"abcd"[..]));
        t.push(104, b"XY", w, &m);
        assert_eq!(t.get(103, 999), Some(&b"dXY"[..]));
        t.push(200, b"gap", w, &m);
        assert_eq!(t.get(104, 999), None);
        assert_eq!(t.get(200, 999), Some(&b"gap"[..]));
        let big = vec![7u8; TAIL_CACHE_BYTES + 10];
        t.push(203, &big, w, &m);
        t.push(t.end(), &big, w, &m);
        assert!(t.get(200, 999).is_none(), "trimmed from the front");
        assert_eq!(t.get(t.end() - 1, u64::MAX), Some(&[7u8][..]));
        assert!(t.capacity() <= 2 * w);
        t.truncate(0);
        assert_eq!(t.get(0, 10), None);
        // The gauge counts the buffer until the cache is dropped.
        assert_eq!(gauge(&m), t.capacity() as u64);
        drop(t);
        assert_eq!(gauge(&m), 0);
    }

    fn gauge(m: &Metrics) -> u64 {
        m.tail_cache_bytes
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Byte for byte against a model, with windows that change: the cache
    /// always holds the newest bytes of the run it was fed, at least the
    /// window's worth (or all of them), and never more than twice the
    /// window in its buffer.
    #[test]
    fn tail_cache_keeps_the_newest_bytes_within_its_window() {
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        let mut next = move |n: u64| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % n
        };
        let m = Arc::new(Metrics::default());
        let mut t = TailCache::default();
        let mut fed: Vec<u8> = Vec::new();
        let base = 1000u64;
        for step in 0..2000u64 {
            let window = [1usize << 10, 4 << 10, 16 << 10][(step / 500 % 3) as usize];
            let len = next(3 * window as u64) as usize + 1;
            let bytes: Vec<u8> = (0..len).map(|_| next(256) as u8).collect();
            t.push(base + fed.len() as u64, &bytes, window, &m);
            fed.extend_from_slice(&bytes);
            let end = base + fed.len() as u64;
            assert_eq!(t.end(), end);
            let held = (t.end() - t.begin) as usize;
            assert!(held >= window.min(fed.len()), "step {step}: {held} held");
            assert!(
                t.capacity() <= 2 * window,
                "step {step}: capacity {}",
                t.capacity()
            );
            let got = t.get(t.begin, end).expect("the window");
            assert!(got == &fed[fed.len() - held..], "step {step}: bytes differ");
        }
    }

    #[test]
    fn tail_windows_share_the_shards_budget() {
        assert_eq!(tail_window(0), TAIL_CACHE_BYTES);
        assert_eq!(tail_window(8), TAIL_CACHE_BYTES);
        assert_eq!(tail_window(100), TAIL_CACHE_SHARD_BYTES / 200);
        assert_eq!(tail_window(100_000), TAIL_CACHE_MIN_BYTES);
    }

    fn stored(begin: u64, end: u64) -> StoredFragment {
        StoredFragment {
            journal: "a/b".into(),
            begin,
            end,
            sha1: [begin as u8; 20],
            codec: rotary_net::spec::Codec::None,
            store: "file:///store/".into(),
            key: format!("a/b/{begin}-{end}"),
            size: end - begin,
            mod_time: SystemTime::UNIX_EPOCH,
        }
    }

    fn spans(j: &Journal) -> Vec<(u64, u64)> {
        j.remote.iter().map(|f| (f.begin, f.end)).collect()
    }

    #[test]
    fn a_listing_keeps_uploads_confirmed_after_it_started() {
        let mut j = Journal::new(JournalSpec::new("a/b"), PathBuf::from("/nonexistent"));
        j.insert_remote(stored(0, 10));
        let mark = j.listing_mark();
        // Confirmed while the listing runs; the listing does not show it.
        j.insert_remote(stored(10, 20));
        j.set_listing(vec![stored(0, 10)], mark);
        assert_eq!(spans(&j), [(0, 10), (10, 20)]);
        assert_eq!(j.read_head(), 20);
        assert!(j.locate(15).is_some());

        // A later listing is the truth: an object gone from the store
        // leaves the index, whatever was confirmed before it started.
        let mark = j.listing_mark();
        j.set_listing(vec![stored(10, 20)], mark);
        assert_eq!(spans(&j), [(10, 20)]);
        let mark = j.listing_mark();
        j.set_listing(Vec::new(), mark);
        assert!(spans(&j).is_empty());

        // A fragment dropped for bad bytes is not brought back either.
        let mark = j.listing_mark();
        j.insert_remote(stored(20, 30));
        j.drop_remote(&stored(20, 30), true);
        j.set_listing(Vec::new(), mark);
        assert!(spans(&j).is_empty());
    }

    #[test]
    fn token_bucket_admits_its_rate() {
        let now = Instant::now();
        let mut b = TokenBucket::new(1000);
        // One second of burst, then nothing until the bucket refills.
        assert_eq!(b.admit(600, now), Ok(600));
        assert_eq!(b.admit(600, now), Ok(400));
        let wait = b.admit(600, now).unwrap_err();
        assert!(
            wait >= Duration::from_micros(999) && wait <= Duration::from_micros(1001),
            "{wait:?}"
        );
        let later = now + Duration::from_millis(250);
        assert_eq!(b.admit(600, later), Ok(250));
        // Idle time refills no more than one second's worth.
        assert_eq!(b.admit(5000, later + Duration::from_secs(60)), Ok(1000));
        let mut free = TokenBucket::new(0);
        assert_eq!(free.admit(u64::MAX / 2, now), Ok(u64::MAX / 2));
    }
}
