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

/// A streamed append idle this long is rolled back (with the minimum
/// append rate off; with it, a stalled append ends within about a second).
pub const APPEND_IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// Default of `ServeConfig::min_append_rate`: bytes per second a client
/// must stream an append at while it holds its journal.
pub const MIN_APPEND_RATE_DEFAULT: u64 = 1 << 20;
/// The credit a streaming append starts with, and the most it may bank, in
/// seconds of the minimum rate: a client falling this far behind the rate
/// is cut off (Gazette's one second of burst).
pub const MIN_RATE_CREDIT: Duration = Duration::from_secs(1);

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
    /// Streamed below the minimum append rate: reply APPEND_TIMEOUT.
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
                "the append's content arrived below the broker's minimum append rate (--min-append-rate) for a second; rolled back",
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
    /// Content bytes that arrived (queued in `chunks` or staged since).
    pub received: Cell<u64>,
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
            received: Cell::new(0),
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
    /// Its credit against the minimum append rate.
    pub flow: Flow,
    /// Keeps its connection read while it holds the journal.
    pub _streaming: crate::budget::Streaming,
}

impl Active {
    /// Whether this client's append, still streaming, fell more than
    /// [`MIN_RATE_CREDIT`] behind `min_rate` (bytes per second; 0: never)
    /// by `now`. Time counts against it only while none of its bytes wait
    /// on the broker's side (queued chunks: the journal's rate, or staging,
    /// hold it back, not the client).
    pub fn too_slow(&mut self, min_rate: u64, now: Instant) -> bool {
        let op = &self.op;
        if min_rate == 0 || op.complete.get() || op.replica.is_some() {
            return false;
        }
        let waiting = !op.chunks.borrow().is_empty();
        self.flow.check(op.received.get(), waiting, min_rate, now)
    }
}

/// The credit of a streaming append against the minimum append rate: it
/// earns each byte that arrives and spends `min_rate` per second, between
/// zero and [`MIN_RATE_CREDIT`] of the rate, which it starts with.
#[derive(Clone, Copy, Debug)]
pub struct Flow {
    /// When it was last checked, and the append's bytes then.
    at: Instant,
    received: u64,
    /// Bytes of credit (negative: cut off).
    credit: f64,
    /// The rate it was started at: the first check fills the credit.
    started: bool,
}

impl Flow {
    pub fn new(now: Instant) -> Flow {
        Flow {
            at: now,
            received: 0,
            credit: 0.0,
            started: false,
        }
    }

    /// Settles the credit at `now` for `received` bytes in all; true once
    /// it is spent. `waiting`: bytes wait on the broker, so the time since
    /// the last check is not charged.
    pub fn check(&mut self, received: u64, waiting: bool, min_rate: u64, now: Instant) -> bool {
        let full = min_rate as f64 * MIN_RATE_CREDIT.as_secs_f64();
        if !self.started {
            self.started = true;
            self.credit = full;
        }
        let arrived = received.saturating_sub(self.received) as f64;
        let spent = if waiting {
            0.0
        } else {
            min_rate as f64 * now.saturating_duration_since(self.at).as_secs_f64()
        };
        self.credit = (self.credit + arrived - spent).min(full);
        self.at = now;
        self.received = received;
        self.credit < 0.0
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

#[cfg(test)]
mod tests {
    use super::*;

    const RATE: u64 = 1000;

    fn ms(t0: Instant, ms: u64) -> Instant {
        t0 + Duration::from_millis(ms)
    }

    #[test]
    fn a_stalled_append_is_cut_off_after_its_second_of_credit() {
        let t0 = crate::clock::now();
        let mut f = Flow::new(t0);
        assert!(!f.check(0, false, RATE, ms(t0, 500)));
        assert!(!f.check(0, false, RATE, ms(t0, 990)));
        assert!(f.check(0, false, RATE, ms(t0, 1010)));
    }

    #[test]
    fn an_append_at_the_rate_goes_on_and_one_under_it_is_cut_off() {
        let t0 = crate::clock::now();
        let mut at_rate = Flow::new(t0);
        let mut half = Flow::new(t0);
        for step in 1..=100u64 {
            let now = ms(t0, step * 100);
            assert!(!at_rate.check(step * 100, false, RATE, now), "at {step}");
            if half.check(step * 50, false, RATE, now) {
                // 500 B/s under 1000: the second of credit lasts 2 s.
                assert_eq!(step, 21, "cut off at {} ms", step * 100);
                return;
            }
        }
        panic!("the append at half the rate was never cut off");
    }

    #[test]
    fn credit_is_banked_for_one_second_only_and_waiting_is_not_charged() {
        let t0 = crate::clock::now();
        let mut f = Flow::new(t0);
        // Ten seconds' worth at once, then nothing: cut off after one.
        assert!(!f.check(10 * RATE, false, RATE, ms(t0, 10)));
        assert!(!f.check(10 * RATE, false, RATE, ms(t0, 1000)));
        assert!(f.check(10 * RATE, false, RATE, ms(t0, 1020)));
        // Bytes that wait on the broker stop the charge, however long.
        let mut f = Flow::new(t0);
        assert!(!f.check(5, true, RATE, ms(t0, 60_000)));
        assert!(!f.check(5, false, RATE, ms(t0, 60_900)));
        assert!(f.check(5, false, RATE, ms(t0, 61_100)));
    }
}
