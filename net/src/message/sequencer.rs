//! Read-committed sequencing: a plain state machine over envelopes read
//! uncommitted, in each journal's order.
//!
//! Per journal and producer it keeps the last acknowledged clock
//! (`min_clock`), the largest clock of the open transaction (`max_clock`)
//! and the offset where that transaction's first pending message begins.
//! Messages outside transactions commit at once; continuing messages wait
//! in a ring shared by all producers (so memory is bounded by the ring's
//! length) until an acknowledgement with a larger clock commits every
//! pending message with a clock up to its own. An acknowledgement at the
//! last acknowledged clock rolls the pending messages back. Messages at or
//! below the last acknowledgement, and continuing messages at or below the
//! transaction's largest clock, are duplicates (an append retried after an
//! unknown outcome) and are dropped.
//!
//! When a committed transaction's first messages have already left the
//! ring, the caller replays the journal range [`Sequencer::replay_range`]
//! names and feeds it to [`Sequencer::replay`]. No producer holds up
//! another: an acknowledgement delivers its transaction at once, whatever
//! other producers have pending.
//!
//! Journals and producers are interned to small indices (one hash lookup
//! per message at most, none while a producer's messages come in a run),
//! and a producer's pending messages are a chain through the ring's slots:
//! an envelope is moved into the ring once and out of it once, when it is
//! delivered.

use super::intern::{JournalIndex, ProducerIndex};
use super::uuid::{Clock, Flags, ProducerId};
use super::{Envelope, MessageError};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, VecDeque};
use std::sync::Arc;

/// Pending messages a reader keeps unless told otherwise.
pub const RING_LEN_DEFAULT: usize = 8192;

/// What [`Sequencer::queue`] decided about an envelope.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QueueOutcome {
    /// An OUTSIDE_TXN message at or below the last acknowledgement: a duplicate.
    OutsideAlreadyAcked,
    /// An OUTSIDE_TXN message, committed: dequeue it with `pop`.
    OutsideCommit,
    /// A CONTINUE_TXN message at or below the last acknowledgement: a duplicate.
    ContinueAlreadyAcked,
    /// A CONTINUE_TXN message at or below its transaction's largest clock: a duplicate.
    ContinueTxnClockLarger,
    /// A CONTINUE_TXN message beginning a transaction.
    ContinueBeginSpan,
    /// A CONTINUE_TXN message extending a transaction.
    ContinueExtendSpan,
    /// An ACK_TXN at (or below) the last acknowledgement: pending messages are discarded.
    AckRollback,
    /// An ACK_TXN with nothing pending: it alone is delivered.
    AckEmpty,
    /// An ACK_TXN committing a transaction held whole in the ring.
    AckCommitRing,
    /// An ACK_TXN committing a transaction whose first messages left the
    /// ring: replay [`Sequencer::replay_range`], then `pop`.
    AckCommitReplay,
}

impl QueueOutcome {
    /// The envelope repeats one already delivered or superseded.
    pub fn is_duplicate(self) -> bool {
        matches!(
            self,
            QueueOutcome::OutsideAlreadyAcked
                | QueueOutcome::ContinueAlreadyAcked
                | QueueOutcome::ContinueTxnClockLarger
        )
    }

    /// Messages are ready to dequeue.
    pub fn commits(self) -> bool {
        matches!(
            self,
            QueueOutcome::OutsideCommit
                | QueueOutcome::AckEmpty
                | QueueOutcome::AckCommitRing
                | QueueOutcome::AckCommitReplay
        )
    }
}

/// A chain of one producer's pending messages in the ring: the ring
/// sequence numbers of its first and last; each slot names the next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Chain {
    first: u64,
    last: u64,
}

#[derive(Debug)]
struct Partial {
    /// Last acknowledged (or delivered) clock: exclusive lower bound.
    min_clock: Clock,
    /// Largest clock of the open transaction: inclusive upper bound.
    max_clock: Clock,
    /// Offset of the open transaction's first pending message.
    begin: Option<u64>,
    /// Its pending messages still in the ring, in order.
    pending: Option<Chain>,
}

impl Partial {
    fn settled(clock: Clock) -> Partial {
        Partial {
            min_clock: clock,
            max_clock: clock,
            begin: None,
            pending: None,
        }
    }
}

#[derive(Debug)]
struct Slot {
    /// Index of the producer whose pending message this is.
    producer: u32,
    /// Ring sequence number of the producer's next pending message.
    next: Option<u64>,
    /// Taken out when its transaction commits or rolls back: a slot holds
    /// an envelope exactly while it is in its producer's pending chain.
    env: Option<Envelope>,
}

/// Pending messages of all producers, oldest first, addressed by ring
/// sequence numbers (which count every message ever pushed). The slots
/// run from the oldest message still pending (or a little older) to the
/// newest.
#[derive(Debug, Default)]
struct Ring {
    slots: VecDeque<Slot>,
    /// Sequence number of `slots[0]`.
    first_seq: u64,
}

impl Ring {
    fn next_seq(&self) -> u64 {
        self.first_seq + self.slots.len() as u64
    }

    fn slot_mut(&mut self, seq: u64) -> &mut Slot {
        &mut self.slots[(seq - self.first_seq) as usize]
    }

    /// The envelope of a pending message.
    fn env(&self, seq: u64) -> &Envelope {
        self.slots[(seq - self.first_seq) as usize]
            .env
            .as_ref()
            .expect("a pending message is in its slot")
    }

    /// Appends `env` to the producer's chain `pending`.
    fn push(&mut self, producer: u32, pending: &mut Option<Chain>, env: Envelope) {
        let seq = self.next_seq();
        let first = match *pending {
            Some(chain) => {
                self.slot_mut(chain.last).next = Some(seq);
                chain.first
            }
            None => seq,
        };
        *pending = Some(Chain { first, last: seq });
        // The envelope is written into its slot in place: a `Slot` built
        // whole first is copied through the stack in pieces that do not
        // line up with the stores that made it, and every such copy
        // stalls on store forwarding.
        self.slots.push_back(Slot {
            producer,
            next: None,
            env: None,
        });
        self.slots.back_mut().expect("just pushed").env = Some(env);
    }

    /// Takes the envelope at `seq` out of its slot, and the sequence number
    /// of the chain's next.
    fn take(&mut self, seq: u64) -> (Envelope, Option<u64>) {
        let slot = self.slot_mut(seq);
        let env = slot.env.take().expect("a pending message is in its slot");
        (env, slot.next)
    }

    /// Drops a chain's envelopes (a rollback).
    fn drop_chain(&mut self, chain: Option<Chain>) {
        let mut at = chain.map(|c| c.first);
        while let Some(seq) = at {
            at = self.take(seq).1;
        }
    }

    /// Drops the `n` oldest slots, which hold no pending message.
    fn drop_oldest(&mut self, n: u64) {
        debug_assert!(self.slots.iter().take(n as usize).all(|s| s.env.is_none()));
        self.slots.drain(..n as usize);
        self.first_seq += n;
    }
}

/// A commit being dequeued.
#[derive(Debug)]
struct Emit {
    /// Index of its producer; `None` for a message without a clock (not
    /// tracked per producer).
    producer: Option<u32>,
    max_clock: Clock,
    /// Where the last message delivered so far begins: the producer's
    /// `begin` in a checkpoint taken now (its `min_clock` is `last`), from
    /// which a restored reader replays the rest. `None` before the first,
    /// when a checkpoint holds the producer's state from before the commit;
    /// that state is written once, when the commit is through.
    delivered_begin: Option<u64>,
    /// Largest clock delivered so far (starts at the last acknowledgement).
    last: Clock,
    /// Range to replay before the chain: `[begin, end)`.
    replay: Option<(u64, u64)>,
    /// The next of the pending messages (taken from the ring as they are
    /// dequeued), then those of `run`, then `committing`.
    cursor: Option<u64>,
    /// A whole transaction's messages taken at once
    /// ([`Sequencer::queue_txn`]); empty otherwise.
    run: std::vec::IntoIter<Envelope>,
    committing: Option<Envelope>,
    journal: u32,
    /// Where the committing envelope ends: the journal's read-through
    /// offset once the commit is dequeued.
    end: u64,
}

impl Emit {
    /// A message without a clock, delivered alone.
    fn unclocked(journal: u32, env: Envelope) -> Emit {
        Emit {
            producer: None,
            max_clock: Clock(0),
            last: Clock(0),
            delivered_begin: None,
            replay: None,
            cursor: None,
            run: Vec::new().into_iter(),
            end: env.end,
            committing: Some(env),
            journal,
        }
    }

    /// Whether `env`, the next message of the commit, is delivered (not a
    /// duplicate, nor beyond the acknowledged clock); if so, it is counted
    /// as delivered.
    fn delivers(&mut self, env: &Envelope) -> bool {
        let clock = env.clock();
        if self.producer.is_some() && (clock <= self.last || clock > self.max_clock) {
            return false;
        }
        self.last = clock;
        self.delivered_begin = Some(env.begin);
        true
    }
}

/// A reader's position: where to read each journal from, and each
/// producer's sequencing state there.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Checkpoint {
    /// Journal → offset to read from.
    pub offsets: BTreeMap<String, u64>,
    pub producers: Vec<ProducerState>,
}

/// One producer's state in one journal.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProducerState {
    pub journal: String,
    /// 12 hex digits.
    pub producer: String,
    /// The clock of its last acknowledged (delivered) message.
    pub last_ack: u64,
    /// Where its pending transaction's first message begins, if one is open.
    pub begin: Option<u64>,
}

/// The read-committed state machine (see the module documentation).
#[derive(Debug)]
pub struct Sequencer {
    ring_len: usize,
    ring: Ring,
    journals: JournalIndex,
    /// By journal index: the offset read through (where a restarted
    /// reader reads from), once known.
    offsets: Vec<Option<u64>>,
    producers: ProducerIndex,
    /// By producer index.
    partials: Vec<Partial>,
    emit: Option<Emit>,
}

impl Sequencer {
    /// A sequencer holding up to `ring_len` pending messages (at least 1).
    pub fn new(ring_len: usize) -> Sequencer {
        Sequencer {
            ring_len: ring_len.max(1),
            ring: Ring::default(),
            journals: JournalIndex::default(),
            offsets: Vec::new(),
            producers: ProducerIndex::default(),
            partials: Vec::new(),
            emit: None,
        }
    }

    /// A sequencer continuing from `checkpoint`.
    pub fn from_checkpoint(
        checkpoint: &Checkpoint,
        ring_len: usize,
    ) -> Result<Sequencer, MessageError> {
        let mut s = Sequencer::new(ring_len);
        for (j, &o) in &checkpoint.offsets {
            s.set_offset(j, o);
        }
        for p in &checkpoint.producers {
            let producer = super::uuid::ProducerId::from_hex(&p.producer)
                .map_err(|e| MessageError::BadCheckpoint { why: e.to_string() })?;
            if let (Some(b), Some(&o)) = (p.begin, checkpoint.offsets.get(&p.journal)) {
                if b > o {
                    return Err(MessageError::BadCheckpoint {
                        why: format!(
                            "producer {} of {} begins at {b}, beyond the journal's offset {o}",
                            p.producer, p.journal
                        ),
                    });
                }
            }
            let journal = s.journal(&p.journal);
            let mut partial = Partial::settled(Clock(p.last_ack));
            partial.begin = p.begin;
            // A producer named twice takes its last state.
            let i = s.producer(journal, producer, Partial::settled(Clock(0)));
            s.partials[i as usize] = partial;
        }
        Ok(s)
    }

    /// The index of journal `name`, interned if new.
    fn journal(&mut self, name: &str) -> u32 {
        let i = self.journals.intern(name);
        self.offsets.resize(self.journals.len(), None);
        i
    }

    /// The index of `(journal, producer)`, in state `new` if it is new.
    fn producer(&mut self, journal: u32, producer: ProducerId, new: Partial) -> u32 {
        let (i, is_new) = self.producers.index(journal, producer);
        if is_new {
            self.partials.push(new);
        }
        debug_assert_eq!(self.partials.len(), self.producers.len());
        i
    }

    /// The position to restore with [`Sequencer::from_checkpoint`]. Taken
    /// between `pop` calls, it counts every popped message as processed.
    pub fn checkpoint(&self) -> Checkpoint {
        let mut producers: Vec<ProducerState> = (0u32..)
            .zip(&self.partials)
            .map(|(i, s)| {
                let (last_ack, begin) = match &self.emit {
                    Some(Emit {
                        producer: Some(p),
                        last,
                        delivered_begin: Some(b),
                        ..
                    }) if *p == i => (last.0, Some(*b)),
                    _ => (s.min_clock.0, s.begin),
                };
                let (journal, producer) = self.producers.key(i);
                ProducerState {
                    journal: self.journals.name(journal).to_string(),
                    producer: producer.to_hex(),
                    last_ack,
                    begin,
                }
            })
            .collect();
        producers.sort_by(|a, b| (&a.journal, &a.producer).cmp(&(&b.journal, &b.producer)));
        let offsets = (0u32..)
            .zip(&self.offsets)
            .filter_map(|(j, o)| Some((self.journals.name(j).to_string(), (*o)?)))
            .collect();
        Checkpoint { offsets, producers }
    }

    /// The offset `journal` has been read through, if known.
    pub fn offset(&self, journal: &str) -> Option<u64> {
        self.offsets[self.journals.get(journal)? as usize]
    }

    /// Sets where `journal` is read from (before reading it).
    pub fn set_offset(&mut self, journal: &str, offset: u64) {
        let j = self.journal(journal);
        self.offsets[j as usize] = Some(offset);
    }

    /// Records that `env`'s journal has been read through `env`, as a
    /// reader that does not sequence (read uncommitted) does per message.
    pub fn read_through(&mut self, env: &Envelope) {
        let j = self.journal_of(&env.journal);
        self.offsets[j as usize] = Some(env.end);
    }

    /// The index of an envelope's journal, interned if new.
    fn journal_of(&mut self, name: &Arc<str>) -> u32 {
        let j = self.journals.index(name);
        if j as usize == self.offsets.len() {
            self.offsets.push(None);
        }
        j
    }

    /// Whether a commit is being dequeued (`queue` must wait for it).
    pub fn is_dequeuing(&self) -> bool {
        self.emit.is_some()
    }

    /// Takes the next envelope read uncommitted.
    ///
    /// # Panics
    ///
    /// If a commit is still being dequeued ([`Sequencer::is_dequeuing`]).
    pub fn queue(&mut self, env: Envelope) -> QueueOutcome {
        assert!(self.emit.is_none(), "committed messages remain to dequeue");
        self.evict_oldest();
        let journal = self.journal_of(&env.journal);
        let clock = env.clock();
        if clock == Clock(0) {
            // No clock: committed at once, never deduplicated.
            self.emit = Some(Emit::unclocked(journal, env));
            return QueueOutcome::OutsideCommit;
        }
        let p = self.producer(
            journal,
            env.producer(),
            Partial::settled(Clock(clock.0 - 1)),
        );
        let partial = &mut self.partials[p as usize];
        let outcome = outcome_of(&env, partial, &self.ring);
        match outcome {
            QueueOutcome::OutsideAlreadyAcked
            | QueueOutcome::ContinueAlreadyAcked
            | QueueOutcome::ContinueTxnClockLarger => {
                self.offsets[journal as usize] = Some(env.end);
            }
            QueueOutcome::ContinueBeginSpan | QueueOutcome::ContinueExtendSpan => {
                if outcome == QueueOutcome::ContinueBeginSpan {
                    partial.begin = Some(env.begin);
                }
                partial.max_clock = clock;
                self.offsets[journal as usize] = Some(env.end);
                self.ring.push(p, &mut partial.pending, env);
            }
            QueueOutcome::AckRollback => {
                self.ring.drop_chain(partial.pending);
                *partial = Partial::settled(clock);
                self.offsets[journal as usize] = Some(env.end);
            }
            QueueOutcome::OutsideCommit
            | QueueOutcome::AckEmpty
            | QueueOutcome::AckCommitRing
            | QueueOutcome::AckCommitReplay => {
                self.emit = Some(begin_commit(
                    outcome,
                    p,
                    journal,
                    partial,
                    &mut self.ring,
                    env,
                ));
            }
        }
        outcome
    }

    /// How many envelopes at the front of `front` make one whole
    /// transaction that [`Sequencer::queue_txn`] can take at once: messages
    /// continuing a transaction, of one producer in one journal, with
    /// rising clocks, from a producer with nothing pending, then their
    /// acknowledgement at a larger clock; fewer messages than the ring
    /// holds. `None` if the front is anything else (queue it one envelope
    /// at a time).
    ///
    /// Queued one by one, such a transaction is pushed into the ring and
    /// committed from it; taken whole, the same messages are delivered in
    /// the same order with the same checkpoints between them, each moved
    /// once and looked up not at all.
    pub fn txn_at_front<'a>(
        &mut self,
        mut front: impl Iterator<Item = &'a Envelope>,
    ) -> Option<usize> {
        let first = front.next()?;
        let clock = first.clock();
        if self.emit.is_some() || first.flags() != Flags::CONTINUE_TXN || clock == Clock(0) {
            return None;
        }
        let journal = self.journal_of(&first.journal);
        let producer = first.producer();
        let p = self.producer(journal, producer, Partial::settled(Clock(clock.0 - 1)));
        let partial = &self.partials[p as usize];
        if partial.begin.is_some() || partial.pending.is_some() || clock <= partial.min_clock {
            return None;
        }
        // `n` messages so far, all of which the ring would hold.
        let (mut last, mut n) = (clock, 1);
        if n >= self.ring_len {
            return None;
        }
        for env in front {
            let clock = env.clock();
            let same = Arc::ptr_eq(&env.journal, &first.journal) && env.producer() == producer;
            if !same || clock <= last {
                return None;
            }
            match env.flags() {
                Flags::CONTINUE_TXN if n + 1 < self.ring_len => (last, n) = (clock, n + 1),
                Flags::ACK_TXN => return Some(n + 1),
                _ => return None,
            }
        }
        None
    }

    /// Takes a whole transaction [`Sequencer::txn_at_front`] found: its
    /// messages, then its acknowledgement. Dequeue it with `pop`.
    ///
    /// # Panics
    ///
    /// If a commit is still being dequeued, or `txn` is not such a
    /// transaction of a producer with nothing pending.
    pub fn queue_txn(&mut self, mut txn: Vec<Envelope>) -> QueueOutcome {
        assert!(self.emit.is_none(), "committed messages remain to dequeue");
        let ack = txn
            .pop()
            .expect("a transaction ends with its acknowledgement");
        assert!(
            ack.is_ack() && !txn.is_empty(),
            "messages then an acknowledgement"
        );
        let (first, last) = (&txn[0], &txn[txn.len() - 1]);
        let journal = self.journal_of(&ack.journal);
        let (p, is_new) = self.producers.index(journal, ack.producer());
        assert!(!is_new, "txn_at_front interned the producer");
        let partial = &mut self.partials[p as usize];
        assert!(
            partial.begin.is_none() && partial.pending.is_none(),
            "the producer has nothing pending"
        );
        assert!(partial.min_clock < first.clock() && last.clock() < ack.clock());
        // The state queueing the messages one by one would leave (see
        // `begin_commit`).
        partial.begin = Some(first.begin);
        partial.max_clock = last.clock();
        self.offsets[journal as usize] = Some(last.end);
        self.emit = Some(Emit {
            producer: Some(p),
            max_clock: ack.clock(),
            last: partial.min_clock,
            delivered_begin: None,
            replay: None,
            cursor: None,
            run: txn.into_iter(),
            journal,
            end: ack.end,
            committing: Some(ack),
        });
        QueueOutcome::AckCommitRing
    }

    /// Makes room for the message being queued: the ring holds the last
    /// `ring_len - 1` messages pushed before it, and older pending messages
    /// leave their producers' chains (their commit replays them). Slots no
    /// longer pending are dropped as soon as they are the oldest, so that
    /// the ring's memory spans what is pending, not `ring_len` slots.
    fn evict_oldest(&mut self) {
        let bound = (self.ring.next_seq() + 1).saturating_sub(self.ring_len as u64);
        let first_seq = self.ring.first_seq;
        match self.ring.slots.front() {
            Some(slot) if first_seq >= bound && slot.env.is_some() => return,
            None => return,
            Some(_) => {}
        }
        // Slots are looked at in place and dropped together: moving each
        // out of the ring costs more than the rest of a message's queueing.
        let mut gone = 0u64;
        for slot in self.ring.slots.iter_mut() {
            let seq = first_seq + gone;
            if seq >= bound && slot.env.is_some() {
                break;
            }
            gone += 1;
            if slot.env.take().is_none() {
                continue; // delivered or rolled back already
            }
            let partial = &mut self.partials[slot.producer as usize];
            let chain = partial.pending.expect("a pending message is in a chain");
            assert_eq!(
                chain.first, seq,
                "the oldest pending message heads its chain"
            );
            partial.pending = slot.next.map(|n| Chain {
                first: n,
                last: chain.last,
            });
        }
        self.ring.drop_oldest(gone);
    }

    /// The range to replay before the current commit can be dequeued:
    /// `(journal, begin, end)`.
    pub fn replay_range(&self) -> Option<(Arc<str>, u64, u64)> {
        let e = self.emit.as_ref()?;
        let (b, end) = e.replay?;
        Some((self.journals.name(e.journal).clone(), b, end))
    }

    /// Takes one envelope of the replayed range, in journal order. Returns
    /// it if it is a message of the commit (to deliver now), else `None`.
    pub fn replay(&mut self, env: Envelope) -> Result<Option<Envelope>, MessageError> {
        let emit = self.emit.as_mut().expect("replay without a commit");
        let (b, end) = emit.replay.expect("replay without a replay range");
        let journal = self.journals.name(emit.journal);
        if env.journal != *journal || env.begin < b || env.end > end {
            return Err(MessageError::Replay {
                journal: journal.to_string(),
                begin: b,
                end,
                why: format!(
                    "got a message of {} at [{}, {})",
                    env.journal, env.begin, env.end
                ),
            });
        }
        let p = emit.producer.expect("a replay has a producer");
        if env.producer() != self.producers.key(p).1 {
            return Ok(None);
        }
        let clock = env.clock();
        if clock <= emit.last || clock > emit.max_clock {
            return Ok(None);
        }
        emit.last = clock;
        emit.delivered_begin = Some(env.begin);
        Ok(Some(env))
    }

    /// Ends the replay; the rest of the commit comes from `pop`.
    pub fn finish_replay(&mut self) {
        if let Some(e) = self.emit.as_mut() {
            e.replay = None;
        }
    }

    /// The next committed message, or `None` when there is none (or a
    /// replay must come first: see [`Sequencer::replay_range`]).
    pub fn pop(&mut self) -> Option<Envelope> {
        let emit = self.emit.as_mut()?;
        if emit.replay.is_some() {
            return None;
        }
        // The pending messages, each looked at in its slot and moved out
        // of it straight to the caller (see `Ring::push`).
        while let Some(seq) = emit.cursor {
            let slot = self.ring.slot_mut(seq);
            emit.cursor = slot.next;
            let env = slot.env.as_ref().expect("a pending message is in its slot");
            if emit.delivers(env) {
                return slot.env.take();
            }
            slot.env = None;
        }
        while let Some(env) = emit.run.next() {
            if emit.delivers(&env) {
                return Some(env);
            }
        }
        // Then the committing envelope, last: the commit is through.
        let mut emit = self.emit.take().expect("emitting");
        let env = emit
            .committing
            .take()
            .expect("a commit ends with its envelope");
        let delivered = emit.delivers(&env);
        self.offsets[emit.journal as usize] = Some(emit.end);
        if let Some(p) = emit.producer {
            self.partials[p as usize] = Partial::settled(emit.last);
        }
        delivered.then_some(env)
    }
}

/// What `env` is to its producer's state (see [`QueueOutcome`]).
fn outcome_of(env: &Envelope, partial: &Partial, ring: &Ring) -> QueueOutcome {
    let clock = env.clock();
    match env.flags() {
        Flags::CONTINUE_TXN => {
            if clock <= partial.min_clock {
                QueueOutcome::ContinueAlreadyAcked
            } else if clock <= partial.max_clock {
                QueueOutcome::ContinueTxnClockLarger
            } else if partial.begin.is_none() {
                QueueOutcome::ContinueBeginSpan
            } else {
                QueueOutcome::ContinueExtendSpan
            }
        }
        // At or below the last acknowledgement: the producer went back to
        // an older checkpoint; follow it (at-least-once until it catches up).
        Flags::ACK_TXN if clock <= partial.min_clock => QueueOutcome::AckRollback,
        Flags::ACK_TXN => match partial.begin {
            None => QueueOutcome::AckEmpty,
            Some(b) => match partial.pending {
                Some(c) if ring.env(c.first).begin == b => QueueOutcome::AckCommitRing,
                _ => QueueOutcome::AckCommitReplay,
            },
        },
        // OUTSIDE_TXN, and flags this client does not know, which are
        // taken as outside any transaction.
        _ if clock <= partial.min_clock => QueueOutcome::OutsideAlreadyAcked,
        _ => QueueOutcome::OutsideCommit,
    }
}

/// The commit `env` makes: the producer's pending chain handed to it (or
/// dropped, when a message outside any transaction rolls an open one back:
/// the producer mixed the two), and the journal range to replay before the
/// chain when its first messages left the ring.
fn begin_commit(
    outcome: QueueOutcome,
    producer: u32,
    journal: u32,
    partial: &mut Partial,
    ring: &mut Ring,
    env: Envelope,
) -> Emit {
    let pending = partial.pending.take();
    let mut replay = None;
    let mut cursor = pending.map(|c| c.first);
    if outcome == QueueOutcome::OutsideCommit {
        ring.drop_chain(pending);
        cursor = None;
    } else if outcome == QueueOutcome::AckCommitReplay {
        let first_in_ring = pending.map(|c| ring.env(c.first).begin);
        let b = partial.begin.expect("a replay has a begin");
        replay = Some((b, first_in_ring.unwrap_or(env.begin)));
    }
    let clock = env.clock();
    // `partial` keeps the state from before `env` until the commit is
    // through: that is the position of a checkpoint taken before its first
    // message is dequeued (the journal's offset is still where `env`
    // begins, so a restored reader reads `env` again and replays the whole
    // transaction from `begin`).
    Emit {
        producer: Some(producer),
        max_clock: clock,
        last: partial.min_clock,
        delivered_begin: None,
        replay,
        cursor,
        run: Vec::new().into_iter(),
        journal,
        end: env.end,
        committing: Some(env),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::uuid::Uuid;
    use bytes::Bytes;

    const A: ProducerId = ProducerId([0x01, 0, 0, 0, 0, 0xa]);
    const B: ProducerId = ProducerId([0x01, 0, 0, 0, 0, 0xb]);

    /// A test journal: envelopes get consecutive 10-byte spans.
    struct J {
        name: Arc<str>,
        at: u64,
        all: Vec<Envelope>,
    }

    impl J {
        fn new(name: &str) -> J {
            J {
                name: name.into(),
                at: 0,
                all: Vec::new(),
            }
        }
        fn env(&mut self, p: ProducerId, clock: u64, flags: Flags) -> Envelope {
            let e = Envelope {
                journal: self.name.clone(),
                begin: self.at,
                end: self.at + 10,
                uuid: Uuid::build(p, Clock(clock), flags),
                message: Bytes::from(format!("{p}@{clock}")),
            };
            self.at += 10;
            self.all.push(e.clone());
            e
        }
        fn c(&mut self, p: ProducerId, clock: u64) -> Envelope {
            self.env(p, clock, Flags::CONTINUE_TXN)
        }
        fn ack(&mut self, p: ProducerId, clock: u64) -> Envelope {
            self.env(p, clock, Flags::ACK_TXN)
        }
        fn out(&mut self, p: ProducerId, clock: u64) -> Envelope {
            self.env(p, clock, Flags::OUTSIDE_TXN)
        }
        /// The envelopes of `[begin, end)`, as a replay reads them.
        fn range(&self, begin: u64, end: u64) -> Vec<Envelope> {
            self.all
                .iter()
                .filter(|e| e.begin >= begin && e.end <= end)
                .cloned()
                .collect()
        }
    }

    fn drain(s: &mut Sequencer, j: &J) -> Vec<u64> {
        let mut out = Vec::new();
        if let Some((_, b, e)) = s.replay_range() {
            for env in j.range(b, e) {
                if let Some(d) = s.replay(env).unwrap() {
                    out.push(d.clock().0);
                }
            }
            s.finish_replay();
        }
        while let Some(d) = s.pop() {
            out.push(d.clock().0);
        }
        assert!(!s.is_dequeuing());
        out
    }

    fn ring_env(ring: &Ring, seq: u64) -> u64 {
        ring.env(seq).clock().0
    }

    #[test]
    fn chains_link_each_producers_messages_through_the_ring() {
        let mut j = J::new("a/j");
        let mut ring = Ring::default();
        let (mut a, mut b) = (None, None);
        ring.push(0, &mut a, j.c(A, 1));
        ring.push(1, &mut b, j.c(B, 10));
        ring.push(0, &mut a, j.c(A, 2));
        ring.push(0, &mut a, j.c(A, 3));
        ring.push(1, &mut b, j.c(B, 11));
        assert_eq!(a, Some(Chain { first: 0, last: 3 }));
        assert_eq!(b, Some(Chain { first: 1, last: 4 }));
        assert_eq!((ring_env(&ring, 2), ring_env(&ring, 4)), (2, 11));
        // A's chain, followed from its first: 0 -> 2 -> 3.
        let (e, next) = ring.take(0);
        assert_eq!((e.clock().0, next), (1, Some(2)));
        let (e, next) = ring.take(2);
        assert_eq!((e.clock().0, next), (2, Some(3)));
        // Dropping B's chain empties its slots, not A's.
        ring.drop_chain(b);
        let held: Vec<bool> = ring.slots.iter().map(|s| s.env.is_some()).collect();
        assert_eq!(held, vec![false, false, false, true, false], "A's 3 alone");
        assert_eq!(ring.slots[1].next, Some(4), "links stay for eviction");
        ring.drop_oldest(3);
        assert_eq!(
            (ring.first_seq, ring.slots.len(), ring.next_seq()),
            (3, 2, 5)
        );
        assert_eq!(ring_env(&ring, 3), 3);
        let (e, next) = ring.take(3);
        assert_eq!((e.clock().0, next), (3, None));
        ring.drop_oldest(2);
        assert_eq!(ring.slots.len(), 0);
    }

    #[test]
    fn producers_of_two_journals_interleave_and_are_evicted_apart() {
        let (mut j, mut k) = (J::new("a/j"), J::new("a/k"));
        let mut s = Sequencer::new(5);
        // A in both journals, and B in j, interleaved; each journal's
        // envelopes come in fresh allocations of its name now and then.
        assert_eq!(s.queue(j.c(A, 1)), QueueOutcome::ContinueBeginSpan);
        assert_eq!(s.queue(k.c(A, 2)), QueueOutcome::ContinueBeginSpan);
        assert_eq!(s.queue(j.c(B, 5)), QueueOutcome::ContinueBeginSpan);
        let mut env = j.c(A, 3);
        env.journal = "a/j".into();
        assert_eq!(s.queue(env), QueueOutcome::ContinueExtendSpan);
        assert_eq!(s.queue(k.c(A, 4)), QueueOutcome::ContinueExtendSpan);
        // The ring of 5 gives up A1 of j: j's commit replays it, k's not.
        assert_eq!(s.queue(k.ack(A, 6)), QueueOutcome::AckCommitRing);
        assert_eq!(drain(&mut s, &k), vec![2, 4, 6]);
        assert_eq!(s.queue(j.ack(B, 7)), QueueOutcome::AckCommitRing);
        assert_eq!(drain(&mut s, &j), vec![5, 7]);
        assert_eq!(s.queue(j.ack(A, 8)), QueueOutcome::AckCommitReplay);
        assert_eq!(s.replay_range(), Some(("a/j".into(), 0, 20)));
        assert_eq!(drain(&mut s, &j), vec![1, 3, 8]);
        let cp = s.checkpoint();
        assert_eq!(
            cp.offsets,
            BTreeMap::from([("a/j".to_string(), 50), ("a/k".to_string(), 30)])
        );
        let states: Vec<_> = cp
            .producers
            .iter()
            .map(|p| (p.journal.as_str(), p.producer.clone(), p.last_ack, p.begin))
            .collect();
        assert_eq!(
            states,
            vec![
                ("a/j", A.to_hex(), 8, None),
                ("a/j", B.to_hex(), 7, None),
                ("a/k", A.to_hex(), 6, None),
            ]
        );
    }

    #[test]
    fn read_through_sets_offsets_by_any_allocation_of_the_name() {
        let mut j = J::new("a/j");
        let mut s = Sequencer::new(4);
        s.set_offset("a/k", 7);
        let env = j.c(A, 1);
        s.read_through(&env);
        assert_eq!(s.offset("a/j"), Some(10));
        let mut env = j.c(A, 2);
        env.journal = "a/j".into();
        s.read_through(&env);
        assert_eq!((s.offset("a/j"), s.offset("a/k")), (Some(20), Some(7)));
        let cp = s.checkpoint();
        let want = BTreeMap::from([("a/j".to_string(), 20), ("a/k".to_string(), 7)]);
        assert_eq!((cp.offsets, cp.producers), (want, vec![]));
    }

    #[test]
    fn a_rollback_empties_the_chain_and_later_spans_start_afresh() {
        let mut j = J::new("a/j");
        let mut s = Sequencer::new(3);
        s.queue(j.c(A, 5));
        s.queue(j.c(A, 6));
        assert_eq!(s.queue(j.ack(A, 4)), QueueOutcome::AckRollback);
        // The rolled-back slots are still counted by the ring; evicting
        // them touches no producer's chain.
        assert_eq!(s.queue(j.c(A, 5)), QueueOutcome::ContinueBeginSpan);
        assert_eq!(s.queue(j.c(A, 7)), QueueOutcome::ContinueExtendSpan);
        assert_eq!(s.queue(j.ack(A, 8)), QueueOutcome::AckCommitRing);
        assert_eq!(drain(&mut s, &j), vec![5, 7, 8]);
    }

    #[test]
    fn duplicates_in_a_span_then_commit_from_the_ring() {
        let mut j = J::new("a/j");
        let mut s = Sequencer::new(3);
        let steps = [
            (j.c(A, 1), QueueOutcome::ContinueBeginSpan),
            (j.c(A, 2), QueueOutcome::ContinueExtendSpan),
            (j.c(A, 1), QueueOutcome::ContinueTxnClockLarger),
            (j.c(A, 2), QueueOutcome::ContinueTxnClockLarger),
            (j.ack(A, 3), QueueOutcome::AckCommitRing),
        ];
        for (env, want) in steps {
            assert_eq!(s.queue(env), want);
        }
        assert!(QueueOutcome::ContinueTxnClockLarger.is_duplicate());
        assert_eq!(drain(&mut s, &j), vec![1, 2, 3]);
        assert_eq!(s.offset("a/j"), Some(50));
        // Everything again (a retried append of the whole transaction) is
        // dropped.
        for (clock, flags) in [(1, Flags::CONTINUE_TXN), (2, Flags::CONTINUE_TXN)] {
            let env = j.env(A, clock, flags);
            assert_eq!(s.queue(env), QueueOutcome::ContinueAlreadyAcked);
        }
        let env = j.ack(A, 3);
        assert_eq!(s.queue(env), QueueOutcome::AckRollback);
        assert_eq!(drain(&mut s, &j), Vec::<u64>::new());
    }

    #[test]
    fn an_ack_commits_up_to_its_clock() {
        let mut j = J::new("a/j");
        let mut s = Sequencer::new(3);
        assert_eq!(s.queue(j.c(A, 5)), QueueOutcome::ContinueBeginSpan);
        assert_eq!(s.queue(j.c(A, 7)), QueueOutcome::ContinueExtendSpan);
        assert_eq!(s.queue(j.ack(A, 6)), QueueOutcome::AckCommitRing);
        assert_eq!(drain(&mut s, &j), vec![5, 6]);
    }

    #[test]
    fn an_ack_at_the_last_ack_rolls_back() {
        let mut j = J::new("a/j");
        let mut s = Sequencer::new(8);
        s.queue(j.c(A, 1));
        s.queue(j.c(A, 2));
        assert_eq!(s.queue(j.ack(A, 3)), QueueOutcome::AckCommitRing);
        assert_eq!(drain(&mut s, &j), vec![1, 2, 3]);
        assert_eq!(s.queue(j.c(A, 4)), QueueOutcome::ContinueBeginSpan);
        assert_eq!(s.queue(j.c(A, 5)), QueueOutcome::ContinueExtendSpan);
        assert_eq!(s.queue(j.ack(A, 3)), QueueOutcome::AckRollback);
        assert_eq!(drain(&mut s, &j), Vec::<u64>::new());
        // The next transaction commits alone; the rolled-back messages stay gone.
        assert_eq!(s.queue(j.c(A, 6)), QueueOutcome::ContinueBeginSpan);
        assert_eq!(s.queue(j.ack(A, 7)), QueueOutcome::AckCommitRing);
        assert_eq!(drain(&mut s, &j), vec![6, 7]);
        assert_eq!(s.queue(j.ack(A, 8)), QueueOutcome::AckEmpty);
        assert_eq!(drain(&mut s, &j), vec![8]);
        assert_eq!(s.queue(j.out(A, 8)), QueueOutcome::OutsideAlreadyAcked);
        assert_eq!(s.queue(j.out(A, 9)), QueueOutcome::OutsideCommit);
        assert_eq!(drain(&mut s, &j), vec![9]);
    }

    #[test]
    fn a_span_evicted_from_the_ring_is_replayed() {
        let mut j = J::new("a/j");
        let mut s = Sequencer::new(3);
        s.queue(j.c(A, 1));
        s.queue(j.c(A, 2));
        // B's messages push A's first ones out of the ring of 3; B commits
        // at once, without waiting for A.
        assert_eq!(s.queue(j.c(B, 10)), QueueOutcome::ContinueBeginSpan);
        assert_eq!(s.queue(j.c(A, 3)), QueueOutcome::ContinueExtendSpan);
        assert_eq!(s.queue(j.out(B, 11)), QueueOutcome::OutsideCommit);
        assert_eq!(drain(&mut s, &j), vec![11]);
        assert_eq!(s.queue(j.c(A, 2)), QueueOutcome::ContinueTxnClockLarger);
        assert_eq!(s.queue(j.ack(A, 4)), QueueOutcome::AckCommitReplay);
        assert_eq!(s.replay_range(), Some(("a/j".into(), 0, 30)));
        assert_eq!(s.pop(), None, "pop waits for the replay");
        assert_eq!(drain(&mut s, &j), vec![1, 2, 3, 4]);
        // A replay of the wrong span is refused.
        let mut s2 = Sequencer::new(1);
        let mut j2 = J::new("a/k");
        s2.queue(j2.c(A, 1));
        s2.queue(j2.c(A, 2));
        assert_eq!(s2.queue(j2.ack(A, 3)), QueueOutcome::AckCommitReplay);
        // The ring of 1 gave up A2 to make room at the ack.
        assert_eq!(s2.replay_range(), Some(("a/k".into(), 0, 20)));
        assert!(s2.replay(j2.all[2].clone()).is_err());
    }

    #[test]
    fn checkpoints_resume_exactly_once() {
        let mut j = J::new("a/j");
        let mut s = Sequencer::new(16);
        s.queue(j.c(A, 1));
        s.queue(j.c(B, 20));
        s.queue(j.c(A, 2));
        assert_eq!(s.queue(j.ack(B, 21)), QueueOutcome::AckCommitRing);
        assert_eq!(s.pop().unwrap().clock(), Clock(20));
        // Stop after B's first message: B at 20, A pending from offset 0.
        let cp = s.checkpoint();
        assert_eq!(cp.offsets.get("a/j"), Some(&30), "before B's ack");
        let json = serde_json::to_string(&cp).unwrap();
        let cp: Checkpoint = serde_json::from_str(&json).unwrap();
        let mut r = Sequencer::from_checkpoint(&cp, 16).unwrap();
        j.c(A, 3);
        j.ack(A, 4);
        let mut delivered = Vec::new();
        for env in j.range(30, u64::MAX) {
            r.queue(env);
            delivered.extend(drain(&mut r, &j));
        }
        assert_eq!(delivered, vec![21, 1, 2, 3, 4]);
        let bad = Checkpoint {
            offsets: BTreeMap::from([("a/j".to_string(), 5)]),
            producers: vec![ProducerState {
                journal: "a/j".into(),
                producer: A.to_hex(),
                last_ack: 1,
                begin: Some(9),
            }],
        };
        assert!(Sequencer::from_checkpoint(&bad, 4).is_err());
    }

    /// A sequencer restored from `s`'s checkpoint (through its JSON), fed
    /// the rest of `j` from the checkpoint's offset.
    fn resume(s: &Sequencer, j: &J, ring_len: usize) -> Vec<u64> {
        let json = serde_json::to_string(&s.checkpoint()).unwrap();
        let cp: Checkpoint = serde_json::from_str(&json).unwrap();
        let mut r = Sequencer::from_checkpoint(&cp, ring_len).unwrap();
        let mut delivered = Vec::new();
        for env in j.range(cp.offsets[&*j.name], u64::MAX) {
            r.queue(env);
            delivered.extend(drain(&mut r, j));
        }
        delivered
    }

    /// Journals written by several producers in one global order: each
    /// envelope gets the next 10 bytes of its journal, and a unique
    /// message unless it repeats an earlier one (a retried append).
    #[derive(Default)]
    struct Log {
        all: Vec<Envelope>,
        heads: BTreeMap<Arc<str>, u64>,
    }

    /// What identifies a delivered message: its journal and content
    /// (a retried append repeats both, and must be delivered once).
    type Delivery = (Arc<str>, Bytes);

    impl Log {
        fn push(&mut self, journal: &Arc<str>, uuid: Uuid, message: Bytes) {
            let at = self.heads.entry(journal.clone()).or_insert(0);
            self.all.push(Envelope {
                journal: journal.clone(),
                begin: *at,
                end: *at + 10,
                uuid,
                message,
            });
            *at += 10;
        }

        /// A log from random steps: `(producer, journal, kind, n)`.
        fn random(steps: &[(u8, u8, u8, u8)]) -> Log {
            let journals: [Arc<str>; 2] = ["a/j".into(), "a/k".into()];
            let producers = [A, B, ProducerId([0x01, 0, 0, 0, 0, 0xc])];
            let mut clocks = [0u64; 3];
            let mut log = Log::default();
            for (i, &(p, j, kind, n)) in steps.iter().enumerate() {
                let (p, journal) = (usize::from(p % 3), &journals[usize::from(j % 2)]);
                let fresh = Bytes::from(format!("m{i}"));
                let mut next = |flags| {
                    clocks[p] += 1;
                    Uuid::build(producers[p], Clock(clocks[p]), flags)
                };
                match kind % 20 {
                    0..=8 => log.push(journal, next(Flags::CONTINUE_TXN), fresh),
                    9..=12 => log.push(journal, next(Flags::ACK_TXN), fresh),
                    13 | 14 => log.push(journal, next(Flags::OUTSIDE_TXN), fresh),
                    // An acknowledgement of an earlier clock: a rollback,
                    // or a commit of part of what is pending.
                    15 | 16 => {
                        let clock = clocks[p].saturating_sub(u64::from(n % 4));
                        let uuid = Uuid::build(producers[p], Clock(clock), Flags::ACK_TXN);
                        log.push(journal, uuid, fresh);
                    }
                    17 => log.push(
                        journal,
                        Uuid::build(producers[p], Clock(0), Flags::OUTSIDE_TXN),
                        fresh,
                    ),
                    // A retried append: one of the journal's last messages again.
                    _ => {
                        let theirs: Vec<&Envelope> =
                            log.all.iter().filter(|e| e.journal == *journal).collect();
                        if let Some(e) = theirs.iter().rev().nth(usize::from(n % 4)) {
                            let (uuid, message) = (e.uuid, e.message.clone());
                            log.push(journal, uuid, message);
                        }
                    }
                }
            }
            log
        }

        /// The envelopes of `journal`'s `[begin, end)`, as a replay reads them.
        fn range(&self, journal: &str, begin: u64, end: u64) -> Vec<Envelope> {
            self.all
                .iter()
                .filter(|e| &*e.journal == journal && e.begin >= begin && e.end <= end)
                .cloned()
                .collect()
        }
    }

    /// Reads `input` as a reader does, one sequencer call at a time, and
    /// returns what it delivered; with `checkpoints`, also the checkpoint
    /// after every call, with the number of messages delivered before it.
    fn read(
        s: &mut Sequencer,
        log: &Log,
        input: &[Envelope],
        mut checkpoints: Option<&mut Vec<(Checkpoint, usize)>>,
    ) -> Vec<Delivery> {
        let mut out: Vec<Delivery> = Vec::new();
        let mut taken = |s: &Sequencer, out: &Vec<Delivery>| {
            if let Some(cps) = checkpoints.as_mut() {
                cps.push((s.checkpoint(), out.len()));
            }
        };
        for env in input {
            s.queue(env.clone());
            taken(s, &out);
            if let Some((journal, b, e)) = s.replay_range() {
                for env in log.range(&journal, b, e) {
                    if let Some(d) = s.replay(env).unwrap() {
                        out.push((d.journal, d.message));
                    }
                    taken(s, &out);
                }
                s.finish_replay();
            }
            while let Some(d) = s.pop() {
                out.push((d.journal, d.message));
                taken(s, &out);
            }
        }
        out
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

        /// A checkpoint taken between any two sequencer calls resumes to
        /// exactly the messages the uninterrupted run delivered after it,
        /// with a ring of any length.
        #[test]
        fn every_checkpoint_resumes_to_exactly_the_rest(
            steps in proptest::collection::vec(proptest::prelude::any::<(u8, u8, u8, u8)>(), 0..48),
            ring_len in 1usize..6,
            resumed_ring_len in 1usize..6,
        ) {
            let log = Log::random(&steps);
            let mut s = Sequencer::new(ring_len);
            for journal in log.heads.keys() {
                s.set_offset(journal, 0);
            }
            let mut checkpoints = Vec::new();
            let all = read(&mut s, &log, &log.all, Some(&mut checkpoints));
            for (cp, delivered) in checkpoints {
                let json = serde_json::to_string(&cp).unwrap();
                let mut r = Sequencer::from_checkpoint(&serde_json::from_str(&json).unwrap(), resumed_ring_len).unwrap();
                let rest: Vec<Envelope> = log
                    .all
                    .iter()
                    .filter(|e| e.begin >= cp.offsets[&*e.journal])
                    .cloned()
                    .collect();
                let resumed = read(&mut r, &log, &rest, None);
                proptest::prop_assert_eq!(&resumed[..], &all[delivered..], "from {:?}", cp);
            }
        }
    }

    /// Reads `input` as a reader does, delivering each message with the
    /// checkpoint right after it; with `whole`, transactions at the front
    /// are taken whole when they can be. Also returns how many were.
    fn read_delivering(
        s: &mut Sequencer,
        log: &Log,
        input: &[Envelope],
        whole: bool,
    ) -> (Vec<(Delivery, Checkpoint)>, usize) {
        let (mut out, mut taken_whole, mut i) = (Vec::new(), 0, 0);
        while i < input.len() {
            match whole.then(|| s.txn_at_front(input[i..].iter())).flatten() {
                Some(n) => {
                    s.queue_txn(input[i..i + n].to_vec());
                    (taken_whole, i) = (taken_whole + 1, i + n);
                }
                None => {
                    s.queue(input[i].clone());
                    i += 1;
                }
            }
            if let Some((journal, b, e)) = s.replay_range() {
                for env in log.range(&journal, b, e) {
                    if let Some(d) = s.replay(env).unwrap() {
                        out.push(((d.journal, d.message), s.checkpoint()));
                    }
                }
                s.finish_replay();
            }
            while let Some(d) = s.pop() {
                out.push(((d.journal, d.message), s.checkpoint()));
            }
        }
        (out, taken_whole)
    }

    /// A log of random steps in which each message continuing a
    /// transaction comes in a run of 1 to 5 of its producer's in one
    /// journal.
    fn runs_log(steps: &[(u8, u8, u8, u8)]) -> Log {
        let runs: Vec<(u8, u8, u8, u8)> = steps
            .iter()
            .flat_map(|&(p, j, kind, n)| {
                let times = if kind % 20 <= 8 { n % 5 + 1 } else { 1 };
                std::iter::repeat_n((p, j, kind, n), usize::from(times))
            })
            .collect();
        Log::random(&runs)
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(512))]

        /// Transactions taken whole deliver exactly what queueing them one
        /// envelope at a time does, with the same checkpoint after every
        /// message, with a ring of any length.
        #[test]
        fn whole_transactions_deliver_as_queued_one_by_one(
            steps in proptest::collection::vec(proptest::prelude::any::<(u8, u8, u8, u8)>(), 0..48),
            ring_len in 1usize..12,
        ) {
            let log = runs_log(&steps);
            let mut one_by_one = Sequencer::new(ring_len);
            let mut whole = Sequencer::new(ring_len);
            for journal in log.heads.keys() {
                one_by_one.set_offset(journal, 0);
                whole.set_offset(journal, 0);
            }
            let (want, _) = read_delivering(&mut one_by_one, &log, &log.all, false);
            let (got, _) = read_delivering(&mut whole, &log, &log.all, true);
            proptest::prop_assert_eq!(got, want);
            proptest::prop_assert_eq!(whole.checkpoint(), one_by_one.checkpoint());
        }
    }

    /// The bench's shape: one producer's transactions over 4 journals,
    /// each journal's run then its acknowledgement, read journal by
    /// journal. Every transaction is taken whole (but in a ring too short
    /// for it), and delivers what queueing it one by one does.
    #[test]
    fn a_journal_read_of_whole_transactions_takes_each_whole() {
        let journals: Vec<Arc<str>> = (0..4).map(|i| format!("b/{i}").into()).collect();
        let mut log = Log::default();
        let mut clock = 0;
        for t in 0..30u64 {
            let ack = clock + 4 * 5 + 1;
            for j in &journals {
                for k in 0..5u64 {
                    clock += 1;
                    let message = Bytes::from(format!("{t}.{k}"));
                    log.push(
                        j,
                        Uuid::build(A, Clock(clock), Flags::CONTINUE_TXN),
                        message,
                    );
                }
                log.push(j, Uuid::build(A, Clock(ack), Flags::ACK_TXN), Bytes::new());
            }
            clock = ack;
        }
        // Each journal's envelopes in turn, as four reads would hand them.
        let input: Vec<Envelope> = journals
            .iter()
            .flat_map(|j| log.all.iter().filter(move |e| e.journal == *j).cloned())
            .collect();
        for (ring_len, whole_txns) in [(6, 120), (5, 0)] {
            let mut one_by_one = Sequencer::new(ring_len);
            let mut whole = Sequencer::new(ring_len);
            let (want, _) = read_delivering(&mut one_by_one, &log, &input, false);
            let (got, n) = read_delivering(&mut whole, &log, &input, true);
            assert_eq!(n, whole_txns, "ring of {ring_len}");
            assert_eq!(want.len(), 30 * 4 * 6);
            assert_eq!(got, want, "ring of {ring_len}");
        }
    }

    #[test]
    fn a_checkpoint_before_a_commits_first_message_resumes_the_whole_transaction() {
        // Held whole in the ring, and evicted from a ring of 1: the state
        // between the acknowledgement's `queue` and the first `pop` (or
        // during the replay a reader stopped) is the state before the
        // acknowledgement.
        for ring_len in [16, 1] {
            let mut j = J::new("a/j");
            let mut s = Sequencer::new(ring_len);
            s.set_offset("a/j", 0);
            s.queue(j.c(A, 1));
            s.queue(j.c(A, 2));
            assert!(s.queue(j.ack(A, 3)).commits());
            assert_eq!(resume(&s, &j, 16), vec![1, 2, 3], "ring of {ring_len}");
            let cp = s.checkpoint();
            assert_eq!(cp.offsets["a/j"], 20, "ring of {ring_len}");
            assert_eq!(
                (cp.producers[0].last_ack, cp.producers[0].begin),
                (0, Some(0)),
                "ring of {ring_len}"
            );
            assert_eq!(drain(&mut s, &j), vec![1, 2, 3], "ring of {ring_len}");
        }
        // An acknowledgement alone opens no transaction.
        let mut j = J::new("a/j");
        let mut s = Sequencer::new(4);
        s.set_offset("a/j", 0);
        assert_eq!(s.queue(j.ack(A, 3)), QueueOutcome::AckEmpty);
        assert_eq!(s.checkpoint().producers[0].begin, None);
        assert_eq!(resume(&s, &j, 4), vec![3]);
    }
}
