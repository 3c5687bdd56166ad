//! The append operation: what a connection queues on a journal, what the
//! flusher stages and commits, and what replicas are told. Shared by
//! connections (which build them) and the shard (which runs them).

use crate::outbox::Outbox;
use rotary_net::spec::LabelSet;
use rotary_net::status::Status;
use rotary_net::wire::AppendRequest;
use rotary_storage::sha::Sha1;
use rotary_storage::spool::CommitPoint;
use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::ops::Range;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant};

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
    /// When its first frame arrived (the append latency's start).
    pub arrived: Instant,
    /// Bytes queued in `chunks`, charged to the connection's budget.
    pub budget: Rc<crate::budget::Budget>,
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
    /// Unique among the process's sinks: names the connection (the
    /// primary's stream) a replica synchronized a journal with.
    pub id: u64,
    pub outbox: Rc<Outbox>,
    pending: RefCell<Vec<rotary_net::repl::Ack>>,
    scheduled: Cell<bool>,
}

impl AckSink {
    pub fn new(outbox: Rc<Outbox>) -> Rc<AckSink> {
        static NEXT_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        Rc::new(AckSink {
            id: NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
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
    /// An append whose first frame arrived now. `complete`: that frame was
    /// its last (no MORE flag).
    pub fn new(
        request_id: u64,
        outbox: Rc<Outbox>,
        req: AppendRequest,
        complete: bool,
        budget: Rc<crate::budget::Budget>,
    ) -> AppendOp {
        let now = crate::clock::now();
        AppendOp {
            request_id,
            outbox,
            req,
            chunks: RefCell::new(VecDeque::new()),
            complete: Cell::new(complete),
            aborted: Cell::new(None),
            finished: Cell::new(false),
            last_activity: Cell::new(now),
            arrived: now,
            budget,
            replica: None,
        }
    }

    /// Makes it a replica's copy of its primary's append, acknowledged
    /// through `sink`.
    pub fn for_replica(mut self, sink: Rc<AckSink>) -> AppendOp {
        self.replica = Some(ReplicaOp {
            sink,
            proposal: RefCell::new(None),
            content_done: Cell::new(false),
        });
        self
    }

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
    pub _streaming: crate::budget::Streaming,
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
        let held = crate::clock::elapsed(self.started);
        let min_rate = match max_rate {
            0 => APPEND_MIN_RATE,
            r => APPEND_MIN_RATE.min(r / 2),
        };
        !self.op.complete.get()
            && self.op.replica.is_none()
            && held > APPEND_BLOCKING_TIMEOUT
            && crate::clock::elapsed(waiting.last_activity.get()) > APPEND_BLOCKING_TIMEOUT
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
    /// The spool's committed point before the batch: where it is taken
    /// back to should a replica not acknowledge it.
    pub start: CommitPoint,
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
