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

use super::uuid::{Clock, Flags, ProducerId};
use super::{Envelope, MessageError};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::Arc;

/// Producers' states are looked up once per message: a fast hasher,
/// seeded per process.
type Partials = HashMap<Key, Partial, foldhash::fast::RandomState>;

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

type Key = (Arc<str>, ProducerId);

#[derive(Debug)]
struct Partial {
    /// Last acknowledged (or delivered) clock: exclusive lower bound.
    min_clock: Clock,
    /// Largest clock of the open transaction: inclusive upper bound.
    max_clock: Clock,
    /// Offset of the open transaction's first pending message.
    begin: Option<u64>,
    /// Ring sequence numbers of its pending messages still in the ring, in order.
    ring: VecDeque<u64>,
}

impl Partial {
    fn settled(clock: Clock) -> Partial {
        Partial {
            min_clock: clock,
            max_clock: clock,
            begin: None,
            ring: VecDeque::new(),
        }
    }
}

#[derive(Debug)]
struct Slot {
    seq: u64,
    key: Key,
    /// Taken out (not copied) when its transaction commits or rolls back.
    env: Option<Envelope>,
}

/// A commit being dequeued.
#[derive(Debug)]
struct Emit {
    /// `None` for a message without a clock (not tracked per producer).
    key: Option<Key>,
    max_clock: Clock,
    /// Where the last message delivered so far begins: the producer's
    /// `begin` in a checkpoint taken now (its `min_clock` is `last`).
    /// `None` before the first; the producer's state is written once, when
    /// the commit is through.
    delivered_begin: Option<u64>,
    /// Largest clock delivered so far (starts at the last acknowledgement).
    last: Clock,
    /// Range to replay before `queued`: `[begin, end)`.
    replay: Option<(u64, u64)>,
    /// The messages from the ring, then the committing envelope.
    queued: VecDeque<Envelope>,
    journal: Arc<str>,
    /// Where the committing envelope ends: the journal's read-through
    /// offset once the commit is dequeued.
    end: u64,
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
    ring: VecDeque<Slot>,
    next_seq: u64,
    partials: Partials,
    /// Journal → offset read through (where a restarted reader reads from).
    offsets: BTreeMap<Arc<str>, u64>,
    emit: Option<Emit>,
}

impl Sequencer {
    /// A sequencer holding up to `ring_len` pending messages (at least 1).
    pub fn new(ring_len: usize) -> Sequencer {
        Sequencer {
            ring_len: ring_len.max(1),
            ring: VecDeque::new(),
            next_seq: 0,
            partials: Partials::default(),
            offsets: BTreeMap::new(),
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
            s.offsets.insert(j.as_str().into(), o);
        }
        for p in &checkpoint.producers {
            let producer = super::uuid::ProducerId::from_hex(&p.producer)
                .map_err(|e| MessageError::BadCheckpoint { why: e.to_string() })?;
            let journal: Arc<str> = p.journal.as_str().into();
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
            let mut partial = Partial::settled(Clock(p.last_ack));
            partial.begin = p.begin;
            s.partials.insert((journal, producer), partial);
        }
        Ok(s)
    }

    /// The position to restore with [`Sequencer::from_checkpoint`]. Taken
    /// between `pop` calls, it counts every popped message as processed.
    pub fn checkpoint(&self) -> Checkpoint {
        let mut producers: Vec<ProducerState> = self
            .partials
            .iter()
            .map(|(key, s)| {
                let (last_ack, begin) = match &self.emit {
                    Some(Emit {
                        key: Some(k),
                        last,
                        delivered_begin: Some(b),
                        ..
                    }) if k == key => (last.0, Some(*b)),
                    _ => (s.min_clock.0, s.begin),
                };
                ProducerState {
                    journal: key.0.to_string(),
                    producer: key.1.to_hex(),
                    last_ack,
                    begin,
                }
            })
            .collect();
        producers.sort_by(|a, b| (&a.journal, &a.producer).cmp(&(&b.journal, &b.producer)));
        Checkpoint {
            offsets: self
                .offsets
                .iter()
                .map(|(j, &o)| (j.to_string(), o))
                .collect(),
            producers,
        }
    }

    /// The offset `journal` has been read through, if known.
    pub fn offset(&self, journal: &str) -> Option<u64> {
        self.offsets.get(journal).copied()
    }

    /// Sets where `journal` is read from (before reading it).
    pub fn set_offset(&mut self, journal: &str, offset: u64) {
        set_offset(&mut self.offsets, journal, offset);
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
        let clock = env.clock();
        if clock == Clock(0) {
            // No clock: committed at once, never deduplicated.
            self.emit = Some(Emit {
                key: None,
                max_clock: Clock(0),
                last: Clock(0),
                delivered_begin: None,
                replay: None,
                journal: env.journal.clone(),
                end: env.end,
                queued: VecDeque::from([env]),
            });
            return QueueOutcome::OutsideCommit;
        }
        let key: Key = (env.journal.clone(), env.producer());
        if !self.partials.contains_key(&key) {
            self.partials
                .insert(key.clone(), Partial::settled(Clock(clock.0 - 1)));
        }
        let partial = self.partials.get_mut(&key).expect("inserted above");
        let outcome = outcome_of(&env, partial, &self.ring);
        match outcome {
            QueueOutcome::OutsideAlreadyAcked
            | QueueOutcome::ContinueAlreadyAcked
            | QueueOutcome::ContinueTxnClockLarger => {
                set_offset(&mut self.offsets, &env.journal, env.end);
            }
            QueueOutcome::ContinueBeginSpan | QueueOutcome::ContinueExtendSpan => {
                if outcome == QueueOutcome::ContinueBeginSpan {
                    partial.begin = Some(env.begin);
                }
                partial.max_clock = clock;
                partial.ring.push_back(self.next_seq);
                set_offset(&mut self.offsets, &env.journal, env.end);
                self.ring.push_back(Slot {
                    seq: self.next_seq,
                    key,
                    env: Some(env),
                });
                self.next_seq += 1;
            }
            QueueOutcome::AckRollback => {
                *partial = Partial::settled(clock);
                set_offset(&mut self.offsets, &env.journal, env.end);
            }
            QueueOutcome::OutsideCommit
            | QueueOutcome::AckEmpty
            | QueueOutcome::AckCommitRing
            | QueueOutcome::AckCommitReplay => {
                let (queued, replay) = take_pending(outcome, &env, partial, &mut self.ring);
                partial.begin = Some(env.begin);
                partial.max_clock = clock;
                let last = partial.min_clock;
                self.emit = Some(Emit {
                    key: Some(key),
                    max_clock: clock,
                    last,
                    delivered_begin: None,
                    replay,
                    journal: env.journal.clone(),
                    end: env.end,
                    queued,
                });
                self.emit.as_mut().expect("set above").queued.push_back(env);
            }
        }
        outcome
    }

    fn evict_oldest(&mut self) {
        while self.ring.len() >= self.ring_len {
            let slot = self.ring.pop_front().expect("ring is not empty");
            if slot.env.is_none() {
                continue; // delivered or rolled back already
            }
            if let Some(p) = self.partials.get_mut(&slot.key) {
                if p.ring.front() == Some(&slot.seq) {
                    p.ring.pop_front();
                }
            }
        }
    }

    /// The range to replay before the current commit can be dequeued:
    /// `(journal, begin, end)`.
    pub fn replay_range(&self) -> Option<(Arc<str>, u64, u64)> {
        let e = self.emit.as_ref()?;
        let (b, end) = e.replay?;
        Some((e.journal.clone(), b, end))
    }

    /// Takes one envelope of the replayed range, in journal order. Returns
    /// it if it is a message of the commit (to deliver now), else `None`.
    pub fn replay(&mut self, env: Envelope) -> Result<Option<Envelope>, MessageError> {
        let emit = self.emit.as_mut().expect("replay without a commit");
        let (b, end) = emit.replay.expect("replay without a replay range");
        if env.journal != emit.journal || env.begin < b || env.end > end {
            return Err(MessageError::Replay {
                journal: emit.journal.to_string(),
                begin: b,
                end,
                why: format!(
                    "got a message of {} at [{}, {})",
                    env.journal, env.begin, env.end
                ),
            });
        }
        let key = emit.key.as_ref().expect("a replay has a producer");
        if env.producer() != key.1 {
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
        let mut out = None;
        while let Some(env) = emit.queued.pop_front() {
            let clock = env.clock();
            if emit.key.is_some() && (clock <= emit.last || clock > emit.max_clock) {
                continue; // a duplicate, or beyond the acknowledged clock
            }
            emit.last = clock;
            emit.delivered_begin = Some(env.begin);
            out = Some(env);
            break;
        }
        if emit.queued.is_empty() {
            let emit = self.emit.take().expect("emitting");
            set_offset(&mut self.offsets, &emit.journal, emit.end);
            if let Some(key) = emit.key {
                *self.partials.get_mut(&key).expect("emitting producer") =
                    Partial::settled(emit.last);
            }
        }
        out
    }
}

/// The envelope of a ring sequence number still in the ring.
fn ring_env(ring: &VecDeque<Slot>, seq: u64) -> &Envelope {
    let first = ring.front().expect("a pending seq is in the ring").seq;
    ring[(seq - first) as usize]
        .env
        .as_ref()
        .expect("a pending message is in its slot")
}

/// Where `journal` is read through: updated in place, without a new key
/// for a journal already known.
fn set_offset(offsets: &mut BTreeMap<Arc<str>, u64>, journal: &str, offset: u64) {
    match offsets.get_mut(journal) {
        Some(o) => *o = offset,
        None => {
            offsets.insert(journal.into(), offset);
        }
    }
}

/// What `env` is to its producer's state (see [`QueueOutcome`]).
fn outcome_of(env: &Envelope, partial: &Partial, ring: &VecDeque<Slot>) -> QueueOutcome {
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
            Some(b) => match partial.ring.front() {
                Some(&seq) if ring_env(ring, seq).begin == b => QueueOutcome::AckCommitRing,
                _ => QueueOutcome::AckCommitReplay,
            },
        },
        // OUTSIDE_TXN, and flags this client does not know, which are
        // taken as outside any transaction.
        _ if clock <= partial.min_clock => QueueOutcome::OutsideAlreadyAcked,
        _ => QueueOutcome::OutsideCommit,
    }
}

/// The pending messages a commit delivers, moved out of the ring, and the
/// journal range to replay before them when the first ones left the ring.
/// A message outside any transaction rolls an open one back instead (the
/// producer mixed the two).
fn take_pending(
    outcome: QueueOutcome,
    env: &Envelope,
    partial: &mut Partial,
    ring: &mut VecDeque<Slot>,
) -> (VecDeque<Envelope>, Option<(u64, u64)>) {
    if outcome == QueueOutcome::OutsideCommit {
        partial.ring.clear();
        return (VecDeque::new(), None);
    }
    let mut replay = None;
    if outcome == QueueOutcome::AckCommitReplay {
        let first_in_ring = partial.ring.front().map(|&s| ring_env(ring, s).begin);
        let b = partial.begin.expect("a replay has a begin");
        replay = Some((b, first_in_ring.unwrap_or(env.begin)));
    }
    let ring_first = ring.front().map_or(0, |s| s.seq);
    let mut queued = VecDeque::with_capacity(partial.ring.len() + 1);
    for seq in partial.ring.drain(..) {
        let slot = &mut ring[(seq - ring_first) as usize];
        queued.push_back(slot.env.take().expect("a pending message is in its slot"));
    }
    (queued, replay)
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
}
