//! Seeded simulation of a journal's replication pipeline. A primary model
//! stages appends in batches as a broker's flusher does: the content of
//! every append of a batch (each in 1..4 records, one append after
//! another), then the batch's proposals oldest first; an append may be
//! abandoned on its own (a rollback right after its content), a batch may
//! fail on the primary (a rollback of every append of it, first to last),
//! and the first content of the next append may go out before the batch's
//! proposals (the flusher's open append). A faulty network drops,
//! duplicates, swaps, delays and bit-flips records, through the wire codec;
//! a replica model applies what arrives through [`ReplicaTrack`] and
//! [`check_proposal`] exactly as a broker does, and answers with acks; the
//! primary re-SYNCs (with a sequence number of its own) on any refusal.
//!
//! After every step the replica's committed bytes must be the primary's
//! bytes at the same offsets: a replica may lag, and may lack ranges it
//! skipped over at a SYNC, but never holds a different byte, never commits
//! a range the primary did not propose for that seq, never commits a seq
//! older than one it committed (or SYNCed at), and only grows at its end.
//! After every commit, with content or without, the replica's registers
//! are those the primary proposed for that seq. Every OK ack the primary
//! receives must name a range the replica holds with the primary's bytes.
//! The replica's own bookkeeping of staged appends must agree with the
//! track's pending appends after every record.
//!
//! The primary keeps what it proposed whatever the replica answers (a
//! replica that misses appends is brought back by SYNC at the primary's
//! head, leaving a gap), so "the primary's byte at offset o" is fixed once
//! proposed. A failing seed replays with `ROTARY_SIM_SEED=n`, which also
//! prints every event of the run; `ROTARY_SIM_SEEDS=n` runs n seeds.
#![warn(clippy::too_many_lines)] // Functions under 100 lines, as in the engine.

mod common;

use common::sim::{panic_message, sum_fields};
use rand::{rngs::StdRng, Rng, SeedableRng};
use rotary_engine::replica::{check_proposal, ReplicaTrack, Verdict};
use rotary_net::repl::{decode_acks, decode_records, encode_acks, Ack, Record};
use rotary_net::spec::LabelSet;
use rotary_net::status::Status;
use rotary_net::wire::MetaWriter;
use sha1::{Digest, Sha1};
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::panic::{catch_unwind, AssertUnwindSafe};

const JOURNAL: &str = "sim/pipeline";
/// Batches per seed (1..8 appends each).
const BATCHES: usize = 45;
/// Batches an append may wait for its ack before the primary gives up on
/// the replica and re-SYNCs.
const ACK_TIMEOUT_STEPS: usize = 8;
/// A batch fails on the primary (its commit log write, say).
const BATCH_FAILURE: f64 = 0.08;
/// An append is abandoned after its content went out (cancelled, timed
/// out, its registers too large, the disk full).
const APPEND_ABORT: f64 = 0.03;
/// The next append's first content goes out before a batch's proposals.
const OPEN_NEXT: f64 = 0.3;
/// Clients retry appends the primary rolled back: the same bytes, often
/// at the same offset, under a new seq.
const RETRY: f64 = 0.7;

/// Per-packet fault probabilities of one seed's network.
#[derive(Clone, Copy, Debug)]
struct Faults {
    drop: f64,
    dup: f64,
    /// Swap with the packet sent just before.
    swap: f64,
    /// Let 1..4 later packets overtake it (or hold it to the next step).
    delay: f64,
    /// Hold it for 1..20 steps: it arrives after later batches, often
    /// after a SYNC.
    late: f64,
    /// Flip one bit of a content byte.
    corrupt: f64,
    /// Lose an ack on its way back.
    ack_drop: f64,
    /// The primary seals (SYNCs) without a refusal.
    seal: f64,
}

impl Faults {
    const NONE: Faults = Faults {
        drop: 0.0,
        dup: 0.0,
        swap: 0.0,
        delay: 0.0,
        late: 0.0,
        corrupt: 0.0,
        ack_drop: 0.0,
        seal: 0.05,
    };

    /// Each seed draws its own mix; any kind may be off for a seed. A
    /// batch is some 15 records, so these are half what single appends
    /// could take: higher rates leave most batches broken and the run
    /// mostly SYNCing.
    fn random(rng: &mut StdRng) -> Faults {
        let mut p = |max: f64| {
            if rng.gen_bool(0.2) {
                0.0
            } else {
                rng.gen_range(0.0..max)
            }
        };
        Faults {
            drop: p(0.015),
            dup: p(0.015),
            swap: p(0.025),
            delay: p(0.025),
            late: p(0.005),
            corrupt: p(0.01),
            ack_drop: p(0.03),
            seal: p(0.05),
        }
    }
}

/// Everything a run counts; summed over seeds (`max_pending`: the largest).
#[derive(Clone, Debug, Default)]
struct Stats {
    appends: u64,
    batches: u64,
    failed_batches: u64,
    /// Appends whose first content went out before the proposals of the
    /// batch ahead of them.
    opened_early: u64,
    /// Appends that retry one the primary rolled back.
    retried: u64,
    proposed: u64,
    /// ... of which without content.
    proposed_empty: u64,
    /// Appends the primary abandoned (alone, with a failed batch, at a SYNC).
    rolled_back: u64,
    /// Appends without content that asked for other registers, which the
    /// primary refuses (with a rollback) instead of staging them.
    refused_empty: u64,
    /// Proposals the primary got an OK ack for.
    acked: u64,
    replica_commits: u64,
    /// ... of which `CommitEmpty`.
    empty_commits: u64,
    /// ... of which while appends staged after it were pending.
    empty_commits_before_pending: u64,
    /// Commits made while later appends were pending on the replica.
    commits_ahead_of_pending: u64,
    committed_bytes: u64,
    /// Refuse verdicts of the track.
    refusals: u64,
    /// ... of commit records from before the last SYNC.
    stale_commits_refused: u64,
    /// ... that dropped more than one pending append.
    refusals_dropping_several: u64,
    /// Commits the track let through that failed `check_proposal`.
    mismatches: u64,
    /// ... of which had a corrupted chunk staged.
    corruption_caught: u64,
    rollbacks_applied: u64,
    /// ... that dropped more than one pending append.
    rollbacks_dropping_several: u64,
    /// ... that kept older pending appends.
    rollbacks_keeping_older: u64,
    /// The most appends pending on the replica at once.
    max_pending: u64,
    syncs: u64,
    /// Bytes a replica skipped over at a SYNC.
    gap_bytes: u64,
    sent: u64,
    dropped: u64,
    duplicated: u64,
    swapped: u64,
    delayed: u64,
    late: u64,
    corrupted: u64,
    delivered: u64,
    corrupt_delivered: u64,
    /// Packets that arrived after a SYNC that followed their sending.
    stale_delivered: u64,
    frames: u64,
    acks_dropped: u64,
}

impl Stats {
    fn add(&mut self, o: &Stats) {
        sum_fields!(
            self, o;
            appends,
            batches,
            failed_batches,
            opened_early,
            retried,
            proposed,
            proposed_empty,
            rolled_back,
            refused_empty,
            acked,
            replica_commits,
            empty_commits,
            empty_commits_before_pending,
            commits_ahead_of_pending,
            committed_bytes,
            refusals,
            stale_commits_refused,
            refusals_dropping_several,
            mismatches,
            corruption_caught,
            rollbacks_applied,
            rollbacks_dropping_several,
            rollbacks_keeping_older,
            syncs,
            gap_bytes,
            sent,
            dropped,
            duplicated,
            swapped,
            delayed,
            late,
            corrupted,
            delivered,
            corrupt_delivered,
            stale_delivered,
            frames,
            acks_dropped
        );
        self.max_pending = self.max_pending.max(o.max_pending);
    }
}

/// One encoded record in flight, with what the simulation knows of it.
#[derive(Clone)]
struct Packet {
    bytes: Vec<u8>,
    /// Content bytes at the end of `bytes` (content records only).
    content_len: usize,
    /// The primary's SYNC epoch when it was sent.
    epoch: u64,
    corrupt: bool,
}

fn encode(rec: &Record, epoch: u64) -> Packet {
    let mut w = MetaWriter::new();
    rec.encode(&mut w);
    let content_len = match rec {
        Record::Content { bytes, .. } => bytes.len(),
        _ => 0,
    };
    Packet {
        bytes: w.into_payload(),
        content_len,
        epoch,
        corrupt: false,
    }
}

fn append_len(rng: &mut StdRng) -> usize {
    match rng.gen_range(0..100) {
        0..=11 => 0,
        12..=74 => rng.gen_range(1..=256),
        75..=94 => rng.gen_range(257..=2048),
        _ => rng.gen_range(2049..=6144),
    }
}

fn writer(w: &str) -> LabelSet {
    LabelSet::from_pairs([("writer", w)]).unwrap()
}

/// One append as a client sends it to the primary.
#[derive(Clone, Debug)]
struct Draft {
    bytes: Vec<u8>,
    /// Ends of its content records, ascending, the last `bytes.len()`;
    /// empty for an append without content.
    cuts: Vec<usize>,
    /// Registers the append sets (None keeps them). An append without
    /// content that asks for registers is refused by the primary.
    registers: Option<LabelSet>,
    /// Abandoned after all its content went out.
    abort: bool,
}

impl Draft {
    fn random(rng: &mut StdRng) -> Draft {
        let len = append_len(rng);
        let mut bytes = vec![0u8; len];
        rng.fill(&mut bytes[..]);
        let mut cuts = Vec::new();
        if len > 0 {
            let pieces = rng.gen_range(1..=4usize).min(len);
            cuts = (1..pieces).map(|_| rng.gen_range(1..len)).collect();
            cuts.push(len);
            cuts.sort_unstable();
            cuts.dedup();
        }
        // Appends without content seldom ask for registers: those that do
        // are refused.
        let wants = if len > 0 { 0.5 } else { 0.15 };
        let registers = rng
            .gen_bool(wants)
            .then(|| writer(&format!("w{}", rng.gen_range(0..3))));
        Draft {
            bytes,
            cuts,
            registers,
            abort: rng.gen_bool(APPEND_ABORT),
        }
    }

    /// An append of `bytes` in one record.
    fn new(bytes: &[u8], registers: Option<LabelSet>) -> Draft {
        Draft {
            bytes: bytes.to_vec(),
            cuts: if bytes.is_empty() {
                vec![]
            } else {
                vec![bytes.len()]
            },
            registers,
            abort: false,
        }
    }

    /// Bounds of content record `i`.
    fn chunk(&self, i: usize) -> (usize, usize) {
        (if i == 0 { 0 } else { self.cuts[i - 1] }, self.cuts[i])
    }
}

/// The append whose content started going out before the proposals of the
/// batch ahead of it (the flusher's active append); it finishes in the
/// next batch, or is rolled back with a failed batch or at a SYNC.
struct Open {
    seq: u64,
    begin: u64,
    draft: Draft,
    /// Content records sent.
    sent: usize,
}

struct Proposal {
    begin: u64,
    end: u64,
    registers: LabelSet,
}

/// An append of the batch being staged.
/// What a batch staged: where it ends, the fragment's SHA-1 and registers
/// after it, its bytes and appends.
struct Batch {
    head: u64,
    sha: Sha1,
    registers: LabelSet,
    bytes: Vec<u8>,
    staged: Vec<Staged>,
}

struct Staged {
    seq: u64,
    begin: u64,
    end: u64,
    sha1: [u8; 20],
    registers: LabelSet,
    draft: Draft,
}

struct Primary {
    /// The journal from offset 0: every proposed (committed) byte.
    journal: Vec<u8>,
    /// SHA-1 of the open fragment, which begins at the last SYNC's head.
    frag_sha: Sha1,
    /// The registers after the newest proposal (or of the first SYNC).
    registers: LabelSet,
    /// Sequence numbers of appends and SYNCs.
    next_seq: u64,
    epoch: u64,
    /// The first seq after the last SYNC's.
    epoch_seq: u64,
    proposals: HashMap<u64, Proposal>,
    /// Proposals of this epoch awaiting an ack: seq -> step sent.
    pending: BTreeMap<u64, usize>,
    acked: HashSet<u64>,
    needs_sync: bool,
    open: Option<Open>,
    /// Appends rolled back, which their clients may send again.
    rolled_back: Vec<Draft>,
}

impl Primary {
    fn new() -> Primary {
        Primary {
            journal: Vec::new(),
            frag_sha: Sha1::new(),
            registers: LabelSet::new(),
            next_seq: 1,
            epoch: 0,
            epoch_seq: 1,
            proposals: HashMap::new(),
            pending: BTreeMap::new(),
            acked: HashSet::new(),
            needs_sync: false,
            open: None,
            rolled_back: Vec::new(),
        }
    }

    fn head(&self) -> u64 {
        self.journal.len() as u64
    }

    fn take_seq(&mut self) -> u64 {
        let s = self.next_seq;
        self.next_seq += 1;
        s
    }

    fn content(&self, seq: u64, begin: u64, d: &Draft, i: usize) -> Packet {
        let (a, b) = d.chunk(i);
        encode(
            &Record::Content {
                seq,
                journal: JOURNAL,
                offset: begin + a as u64,
                bytes: &d.bytes[a..b],
            },
            self.epoch,
        )
    }

    fn rollback(&self, seq: u64) -> Packet {
        encode(
            &Record::Rollback {
                seq,
                journal: JOURNAL,
            },
            self.epoch,
        )
    }

    /// One random batch; the last batch of a run leaves no append open.
    fn random_batch(
        &mut self,
        step: usize,
        last: bool,
        rng: &mut StdRng,
        st: &mut Stats,
        trace: bool,
    ) -> Vec<Packet> {
        let n = rng.gen_range(1..=8);
        let mut drafts = std::mem::take(&mut self.rolled_back);
        if rng.gen_bool(RETRY) {
            drafts.truncate(n);
            st.retried += drafts.len() as u64;
        } else {
            drafts.clear();
        }
        while drafts.len() < n {
            drafts.push(Draft::random(rng));
        }
        let mut next = None;
        if !last && rng.gen_bool(OPEN_NEXT) {
            let d = Draft::random(rng);
            if !d.cuts.is_empty() {
                let sent = rng.gen_range(1..=d.cuts.len());
                next = Some((d, sent));
            }
        }
        let fail = rng.gen_bool(BATCH_FAILURE);
        self.batch(step, drafts, next, fail, st, trace)
    }

    /// Stages `drafts` one after another (after the open append, if any):
    /// the content of each, a rollback right after it for one abandoned or
    /// refused; then the first `sent` content records of `next`, which
    /// stays open; then the proposals of the staged appends, oldest first,
    /// or, if the batch `fail`s, a rollback of each of them and of the open
    /// append, first to last.
    fn batch(
        &mut self,
        step: usize,
        drafts: Vec<Draft>,
        next: Option<(Draft, usize)>,
        fail: bool,
        st: &mut Stats,
        trace: bool,
    ) -> Vec<Packet> {
        st.batches += 1;
        let mut appends: Vec<(u64, Draft, usize)> = Vec::new();
        if let Some(o) = self.open.take() {
            assert_eq!(o.begin, self.head(), "the open append began at the head");
            appends.push((o.seq, o.draft, o.sent));
        }
        for d in drafts {
            let seq = self.take_seq();
            st.appends += 1;
            appends.push((seq, d, 0));
        }
        let mut packets = Vec::new();
        let b = self.stage(step, appends, &mut packets, st, trace);
        if let Some((d, sent)) = next {
            self.open_next(step, d, sent, b.head, &mut packets, st, trace);
        }
        self.conclude(step, b.staged, fail, &mut packets, st, trace);
        if fail {
            return packets;
        }
        self.journal.extend_from_slice(&b.bytes);
        self.frag_sha = b.sha;
        self.registers = b.registers;
        packets
    }

    /// The content of each of `appends` (from its record `sent` on), and a
    /// rollback right after one abandoned or refused: the batch staged.
    fn stage(
        &mut self,
        step: usize,
        appends: Vec<(u64, Draft, usize)>,
        packets: &mut Vec<Packet>,
        st: &mut Stats,
        trace: bool,
    ) -> Batch {
        let mut head = self.head();
        let mut sha = self.frag_sha.clone();
        let mut registers = self.registers.clone();
        let mut bytes = Vec::new();
        let mut staged: Vec<Staged> = Vec::new();
        for (seq, d, sent) in appends {
            for i in sent..d.cuts.len() {
                packets.push(self.content(seq, head, &d, i));
            }
            if d.abort || (d.bytes.is_empty() && d.registers.is_some()) {
                if d.abort {
                    st.rolled_back += 1;
                } else {
                    st.refused_empty += 1;
                }
                if trace {
                    eprintln!(
                        "step {step}: append {seq} of {} bytes at {head} {}",
                        d.bytes.len(),
                        if d.abort { "abandoned" } else { "refused" }
                    );
                }
                packets.push(self.rollback(seq));
                if d.abort {
                    self.rolled_back.push(Draft { abort: false, ..d });
                }
                continue;
            }
            let begin = head;
            head += d.bytes.len() as u64;
            sha.update(&d.bytes);
            bytes.extend_from_slice(&d.bytes);
            if !d.bytes.is_empty() {
                if let Some(r) = &d.registers {
                    registers = r.clone();
                }
            }
            staged.push(Staged {
                seq,
                begin,
                end: head,
                sha1: sha.clone().finalize().into(),
                registers: registers.clone(),
                draft: d,
            });
        }
        Batch {
            head,
            sha,
            registers,
            bytes,
            staged,
        }
    }

    /// Opens `d` at `head` with its first `sent` content records: it stays
    /// open past the batch.
    #[allow(clippy::too_many_arguments)]
    fn open_next(
        &mut self,
        step: usize,
        d: Draft,
        sent: usize,
        head: u64,
        packets: &mut Vec<Packet>,
        st: &mut Stats,
        trace: bool,
    ) {
        let seq = self.take_seq();
        st.appends += 1;
        st.opened_early += 1;
        for i in 0..sent {
            packets.push(self.content(seq, head, &d, i));
        }
        if trace {
            eprintln!(
                "step {step}: append {seq} opened at {head}, {sent} of {} records sent",
                d.cuts.len()
            );
        }
        self.open = Some(Open {
            seq,
            begin: head,
            draft: d,
            sent,
        });
    }

    /// The end of a batch: the proposals of the staged appends, oldest
    /// first; or, if it `fail`ed, a rollback of each staged append and of
    /// the open one, first to last.
    fn conclude(
        &mut self,
        step: usize,
        staged: Vec<Staged>,
        fail: bool,
        packets: &mut Vec<Packet>,
        st: &mut Stats,
        trace: bool,
    ) {
        if !fail {
            self.propose(step, staged, packets, st, trace);
            return;
        }
        st.failed_batches += 1;
        let open = self.open.take().map(|o| (o.seq, o.draft));
        let failed: Vec<(u64, Draft)> = staged
            .into_iter()
            .map(|s| (s.seq, s.draft))
            .chain(open)
            .collect();
        if trace {
            let seqs: Vec<u64> = failed.iter().map(|f| f.0).collect();
            eprintln!("step {step}: batch fails; rolling back {seqs:?}");
        }
        st.rolled_back += failed.len() as u64;
        for (seq, d) in failed {
            packets.push(self.rollback(seq));
            self.rolled_back.push(Draft { abort: false, ..d });
        }
    }

    /// The proposals of the staged appends, oldest first.
    fn propose(
        &mut self,
        step: usize,
        staged: Vec<Staged>,
        packets: &mut Vec<Packet>,
        st: &mut Stats,
        trace: bool,
    ) {
        for s in staged {
            packets.push(encode(
                &Record::Commit {
                    seq: s.seq,
                    journal: JOURNAL,
                    begin: s.begin,
                    end: s.end,
                    fragment_sha1: s.sha1,
                    registers: s.registers.clone(),
                },
                self.epoch,
            ));
            st.proposed += 1;
            st.proposed_empty += (s.begin == s.end) as u64;
            if trace {
                eprintln!(
                    "step {step}: append {} proposed at [{}, {}), registers {}",
                    s.seq, s.begin, s.end, s.registers
                );
            }
            self.proposals.insert(
                s.seq,
                Proposal {
                    begin: s.begin,
                    end: s.end,
                    registers: s.registers,
                },
            );
            self.pending.insert(s.seq, step);
        }
    }

    /// Before a SYNC: the open append is rolled back.
    fn abandon_open(&mut self, st: &mut Stats, trace: bool) -> Option<Packet> {
        let o = self.open.take()?;
        st.rolled_back += 1;
        if trace {
            eprintln!("  primary: append {} rolled back for a SYNC", o.seq);
        }
        self.rolled_back.push(Draft {
            abort: false,
            ..o.draft
        });
        Some(self.rollback(o.seq))
    }

    fn on_ack(&mut self, a: &Ack, r: &Replica, st: &mut Stats, trace: bool) {
        if trace {
            eprintln!(
                "  primary: ack {} {:?} {}",
                a.seq,
                a.status,
                String::from_utf8_lossy(&a.body)
            );
        }
        if a.status == Status::OK {
            let p = self.proposals.get(&a.seq).unwrap_or_else(|| {
                panic!(
                    "divergent commit: OK ack for append {}, which the primary never proposed",
                    a.seq
                )
            });
            if let Err(e) = r.holds(p.begin, p.end, &self.journal) {
                panic!(
                    "divergent commit: OK ack for append {} at [{}, {}), but {e}",
                    a.seq, p.begin, p.end
                );
            }
            self.pending.remove(&a.seq);
            if self.acked.insert(a.seq) {
                st.acked += 1;
            }
        } else if a.seq >= self.epoch_seq {
            // A refusal from before the last SYNC is old news.
            self.needs_sync = true;
        }
    }

    fn timed_out(&self, step: usize) -> bool {
        self.pending
            .values()
            .next()
            .is_some_and(|&sent| sent + ACK_TIMEOUT_STEPS < step)
    }
}

/// An append the replica staged and has no proposal for yet.
struct Pending {
    seq: u64,
    begin: u64,
    bytes: Vec<u8>,
    /// The simulation's knowledge: a bit-flipped chunk is staged.
    corrupt: bool,
}

struct Replica {
    track: ReplicaTrack,
    /// Committed bytes by offset; gaps are zero and not in `ranges`.
    content: Vec<u8>,
    /// Committed ranges, ascending, adjacent ones merged.
    ranges: Vec<(u64, u64)>,
    /// Where the committed content continues (past a gap after a SYNC).
    head: u64,
    /// SHA-1 of the committed bytes of the open fragment.
    frag_sha: Sha1,
    /// Staged appends after `head`, oldest first, one after another.
    pending: Vec<Pending>,
    registers: LabelSet,
    /// The newest seq committed, or of the last SYNC.
    last_seq: u64,
    acks: Vec<Ack>,
    /// Skip `check_proposal` (to show the simulation catches divergence).
    skip_check: bool,
}

impl Replica {
    fn new(skip_check: bool) -> Replica {
        Replica {
            track: ReplicaTrack::default(),
            content: Vec::new(),
            ranges: Vec::new(),
            head: 0,
            frag_sha: Sha1::new(),
            pending: Vec::new(),
            registers: LabelSet::new(),
            last_seq: 0,
            acks: Vec::new(),
            skip_check,
        }
    }

    /// SYNC `seq`: the journal continues at the primary's `head` with its
    /// `registers`; the replica seals what it has, drops what it staged and
    /// starts a fragment there.
    fn sync(&mut self, head: u64, seq: u64, registers: LabelSet) {
        assert!(seq > self.last_seq, "SYNC {seq} after {}", self.last_seq);
        self.track = ReplicaTrack::synced_at(head, seq);
        self.head = head;
        self.frag_sha = Sha1::new();
        self.pending.clear();
        self.registers = registers;
        self.last_seq = seq;
    }

    /// Where the next content lands.
    fn staged_end(&self) -> u64 {
        self.pending
            .last()
            .map_or(self.head, |p| p.begin + p.bytes.len() as u64)
    }

    fn ack(&mut self, seq: u64, status: Status, body: String) {
        self.acks.push(Ack {
            seq,
            status,
            body: body.into_bytes(),
        });
    }

    /// Whether [begin, end) is committed here with the primary's bytes.
    fn holds(&self, begin: u64, end: u64, journal: &[u8]) -> Result<(), String> {
        if begin == end {
            return Ok(());
        }
        if !self.ranges.iter().any(|&(b, e)| b <= begin && end <= e) {
            return Err(format!("the replica holds only {:?}", self.ranges));
        }
        let (b, e) = (begin as usize, end as usize);
        match first_difference(&self.content[b..e], &journal[b..e]) {
            None => Ok(()),
            Some(i) => Err(format!("the replica's byte at {} differs", b + i)),
        }
    }

    fn refused(&mut self, v: Verdict, stale: bool, st: &mut Stats, trace: bool) {
        let Verdict::Refuse {
            seq,
            status,
            message,
            rewind_to,
        } = v
        else {
            unreachable!()
        };
        if trace {
            eprintln!("  replica: refuse {seq} ({message}), rewind to {rewind_to:?}");
        }
        match rewind_to {
            Some(to) => assert_eq!(
                Some(to),
                self.pending.first().map(|p| p.begin),
                "a refusal rewinds to where the first pending append began"
            ),
            None => assert!(
                self.pending.is_empty(),
                "refusal of {seq} without a rewind while {} appends are pending",
                self.pending.len()
            ),
        }
        assert_eq!(rewind_to.unwrap_or(self.head), self.head);
        st.refusals_dropping_several += (self.pending.len() > 1) as u64;
        self.pending.clear();
        st.refusals += 1;
        st.stale_commits_refused += stale as u64;
        self.ack(seq, status, message);
    }

    fn apply(&mut self, rec: &Record, pk: &Packet, p: &Primary, st: &mut Stats, trace: bool) {
        assert_eq!(rec.journal(), JOURNAL);
        let stale = pk.epoch < p.epoch;
        if trace {
            eprintln!(
                "  deliver {}{}{}",
                describe(rec),
                if pk.corrupt { " [bit flipped]" } else { "" },
                if stale { " [stale]" } else { "" }
            );
        }
        match *rec {
            Record::Content { .. } => self.apply_content(rec, pk, st, trace),
            Record::Commit { .. } => self.apply_commit(rec, stale, p, st, trace),
            Record::Rollback { seq, .. } => self.apply_rollback(seq, st, trace),
        }
        assert_eq!(
            self.track.pending(),
            self.pending.iter().map(|p| p.seq).collect::<Vec<_>>(),
            "the track's pending appends are those the replica staged"
        );
    }

    /// A content record: it starts an append or continues the newest one.
    fn apply_content(&mut self, rec: &Record, pk: &Packet, st: &mut Stats, trace: bool) {
        let Record::Content {
            seq, offset, bytes, ..
        } = *rec
        else {
            unreachable!("a content record")
        };
        match self.track.on_content(seq, offset, bytes.len() as u64) {
            Verdict::Start { seq: s, begin } => {
                assert_eq!((s, begin), (seq, offset));
                assert_eq!(
                    begin,
                    self.staged_end(),
                    "append {seq} starts away from the end of the staged appends"
                );
                let newest = self.pending.last().map_or(self.last_seq, |p| p.seq);
                assert!(
                    seq > newest,
                    "append {seq} starts after append {newest} (committed, SYNCed or pending)"
                );
                self.pending.push(Pending {
                    seq,
                    begin,
                    bytes: bytes.to_vec(),
                    corrupt: pk.corrupt,
                });
                st.max_pending = st.max_pending.max(self.pending.len() as u64);
            }
            Verdict::Continue { seq: s } => {
                assert_eq!(s, seq);
                assert_eq!(
                    offset,
                    self.staged_end(),
                    "content of {seq} continues away from the staged end"
                );
                let last = self.pending.last_mut().expect("an append is open");
                assert_eq!(last.seq, seq, "content of {seq} goes to the newest append");
                last.bytes.extend_from_slice(bytes);
                last.corrupt |= pk.corrupt;
            }
            v @ Verdict::Refuse { .. } => self.refused(v, false, st, trace),
            v => panic!("content record of {seq} gave {v:?}"),
        }
    }

    /// A commit record: the oldest pending append commits if its bytes
    /// match the proposal, or the replica diverges.
    fn apply_commit(
        &mut self,
        rec: &Record,
        stale: bool,
        p: &Primary,
        st: &mut Stats,
        trace: bool,
    ) {
        let Record::Commit {
            seq,
            begin,
            end,
            fragment_sha1,
            ref registers,
            ..
        } = *rec
        else {
            unreachable!("a commit record")
        };
        match self.track.on_commit(seq, begin, end) {
            Verdict::Commit {
                seq: s,
                begin: b,
                end: e,
            } => {
                assert_eq!((s, b, e), (seq, begin, end));
                let front = self.pending.first().expect("a commit of a pending append");
                assert_eq!(
                    (front.seq, front.begin),
                    (seq, self.head),
                    "append {seq} commits the oldest pending append, at the head"
                );
                let staged_end = front.begin + front.bytes.len() as u64;
                let corrupt = front.corrupt;
                let mut sha = self.frag_sha.clone();
                sha.update(&front.bytes);
                let staged_sha: [u8; 20] = sha.clone().finalize().into();
                let checked = if self.skip_check {
                    Ok(())
                } else {
                    check_proposal(staged_end, &staged_sha, end, &fragment_sha1)
                };
                match checked {
                    Ok(()) => {
                        let front = self.pending.remove(0);
                        self.commit(seq, front, sha, registers, p, st, trace)
                    }
                    Err(msg) => {
                        if trace {
                            eprintln!("  replica: proposal {seq} mismatch: {msg}");
                        }
                        self.track.diverged();
                        st.mismatches += 1;
                        if corrupt {
                            st.corruption_caught += 1;
                        }
                        self.pending.clear();
                        self.ack(seq, Status::PROPOSAL_MISMATCH, msg);
                    }
                }
            }
            Verdict::CommitEmpty { seq: s, at } => {
                assert_eq!((s, at, at), (seq, begin, end));
                assert_eq!(
                    at, self.head,
                    "append {seq} without content is not at the head"
                );
                self.commit_empty(seq, at, p, st, trace);
            }
            v @ Verdict::Refuse { .. } => self.refused(v, stale, st, trace),
            v => panic!("commit record of {seq} gave {v:?}"),
        }
    }

    /// A rollback record: the append and every later one are dropped.
    fn apply_rollback(&mut self, seq: u64, st: &mut Stats, trace: bool) {
        match self.track.on_rollback(seq) {
            Verdict::Rollback { seqs, to } => {
                let at = self
                    .pending
                    .iter()
                    .position(|p| p.seq == seq)
                    .expect("a rollback of a pending append");
                let dropped: Vec<u64> = self.pending[at..].iter().map(|p| p.seq).collect();
                assert_eq!(
                    seqs, dropped,
                    "rollback of {seq} drops it and every later append"
                );
                assert_eq!(
                    to, self.pending[at].begin,
                    "rollback of {seq} to where it began"
                );
                if trace {
                    eprintln!("  replica: rollback {seqs:?} to {to}");
                }
                self.pending.truncate(at);
                st.rollbacks_applied += 1;
                st.rollbacks_dropping_several += (seqs.len() > 1) as u64;
                st.rollbacks_keeping_older += (at > 0) as u64;
            }
            Verdict::Ignore => assert!(
                self.pending.iter().all(|p| p.seq != seq),
                "rollback of pending append {seq} ignored"
            ),
            v => panic!("rollback record of {seq} gave {v:?}"),
        }
    }

    /// What the state machine let through must be exactly what the primary
    /// proposed for this seq, newer than anything committed before.
    fn proposal<'p>(&self, seq: u64, begin: u64, end: u64, p: &'p Primary) -> &'p Proposal {
        let prop = p.proposals.get(&seq).unwrap_or_else(|| {
            panic!("divergent commit: append {seq} at [{begin}, {end}), which the primary never proposed")
        });
        assert_eq!(
            (prop.begin, prop.end),
            (begin, end),
            "divergent commit: append {seq} at another range than proposed"
        );
        assert!(
            seq > self.last_seq,
            "divergent commit: append {seq} after append {} committed (or SYNCed)",
            self.last_seq
        );
        prop
    }

    #[allow(clippy::too_many_arguments)]
    fn commit(
        &mut self,
        seq: u64,
        staged: Pending,
        sha: Sha1,
        registers: &LabelSet,
        p: &Primary,
        st: &mut Stats,
        trace: bool,
    ) {
        let (begin, end) = (staged.begin, staged.begin + staged.bytes.len() as u64);
        let prop = self.proposal(seq, begin, end, p);
        assert_eq!(&prop.registers, registers, "registers of {seq}");
        assert_eq!(begin, self.head, "append {seq} commits away from the head");
        let last_end = self.ranges.last().map_or(0, |r| r.1);
        assert!(begin >= last_end, "committed ranges only grow at the end");
        self.content.resize(begin as usize, 0);
        self.content.extend_from_slice(&staged.bytes);
        match self.ranges.last_mut() {
            Some(r) if r.1 == begin => r.1 = end,
            _ => self.ranges.push((begin, end)),
        }
        if trace {
            eprintln!("  replica: commit {seq} at [{begin}, {end}), registers {registers}");
        }
        self.head = end;
        self.frag_sha = sha;
        self.registers = registers.clone();
        self.last_seq = seq;
        st.replica_commits += 1;
        st.committed_bytes += end - begin;
        st.commits_ahead_of_pending += !self.pending.is_empty() as u64;
        self.check_registers(seq, p);
        self.ack(seq, Status::OK, String::new());
    }

    /// An append without content: acked at once, nothing staged or changed.
    fn commit_empty(&mut self, seq: u64, at: u64, p: &Primary, st: &mut Stats, trace: bool) {
        self.proposal(seq, at, at, p);
        // Staged before every pending append: proposals come oldest first.
        if let Some(q) = self.pending.first() {
            assert!(
                seq < q.seq,
                "append {seq} without content commits after pending append {} began",
                q.seq
            );
        }
        if trace {
            eprintln!("  replica: commit {seq} without content at {at}");
        }
        self.last_seq = seq;
        st.replica_commits += 1;
        st.empty_commits += 1;
        st.empty_commits_before_pending += !self.pending.is_empty() as u64;
        st.commits_ahead_of_pending += !self.pending.is_empty() as u64;
        self.check_registers(seq, p);
        self.ack(seq, Status::OK, String::new());
    }

    /// After a commit the replica's registers are those the primary
    /// proposed for that seq, never an older append's.
    fn check_registers(&self, seq: u64, p: &Primary) {
        let want = &p.proposals[&seq].registers;
        assert!(
            self.registers == *want,
            "divergent registers: after the commit of {seq} the replica has {}, the primary proposed {want}",
            self.registers
        );
    }
}

fn describe(rec: &Record) -> String {
    match rec {
        Record::Content {
            seq, offset, bytes, ..
        } => format!("content {seq} [{offset}, {})", offset + bytes.len() as u64),
        Record::Commit {
            seq,
            begin,
            end,
            fragment_sha1,
            registers,
            ..
        } => format!(
            "commit {seq} [{begin}, {end}) sha {} registers {registers}",
            hex_prefix(fragment_sha1)
        ),
        Record::Rollback { seq, .. } => format!("rollback {seq}"),
    }
}

fn hex_prefix(sha: &[u8; 20]) -> String {
    sha[..4].iter().map(|b| format!("{b:02x}")).collect()
}

fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    a.iter().zip(b).position(|(x, y)| x != y)
}

struct Net {
    f: Faults,
    queue: VecDeque<Packet>,
    /// Held packets and the step they are released at.
    late: Vec<(usize, Packet)>,
}

impl Net {
    fn send(&mut self, pk: Packet, step: usize, rng: &mut StdRng, st: &mut Stats) {
        st.sent += 1;
        if rng.gen_bool(self.f.drop) {
            st.dropped += 1;
            return;
        }
        let mut copies = vec![pk];
        if rng.gen_bool(self.f.dup) {
            st.duplicated += 1;
            copies.push(copies[0].clone());
        }
        for mut pk in copies {
            if pk.content_len > 0 && rng.gen_bool(self.f.corrupt) {
                let at = pk.bytes.len() - 1 - rng.gen_range(0..pk.content_len);
                pk.bytes[at] ^= 1 << rng.gen_range(0..8);
                pk.corrupt = true;
                st.corrupted += 1;
            }
            if rng.gen_bool(self.f.late) {
                st.late += 1;
                self.late.push((step + rng.gen_range(1..=20), pk));
                continue;
            }
            self.queue.push_back(pk);
            let n = self.queue.len();
            if n >= 2 && rng.gen_bool(self.f.swap) {
                st.swapped += 1;
                self.queue.swap(n - 1, n - 2);
            }
        }
    }

    /// What arrives this step, in arrival order.
    fn deliver(&mut self, step: usize, rng: &mut StdRng, st: &mut Stats) -> Vec<Packet> {
        let mut i = 0;
        while i < self.late.len() {
            if self.late[i].0 <= step {
                let (_, pk) = self.late.remove(i);
                self.queue.push_back(pk);
            } else {
                i += 1;
            }
        }
        let mut out = Vec::new();
        while let Some(pk) = self.queue.pop_front() {
            if rng.gen_bool(self.f.delay) {
                st.delayed += 1;
                if self.queue.is_empty() {
                    // Still in flight when the primary sends its next batch.
                    self.queue.push_back(pk);
                    break;
                }
                let k = rng.gen_range(1..=4).min(self.queue.len());
                self.queue.insert(k, pk);
                continue;
            }
            out.push(pk);
        }
        out
    }

    /// Everything still in flight, the held packets last.
    fn drain(&mut self) -> Vec<Packet> {
        let mut out: Vec<Packet> = self.queue.drain(..).collect();
        self.late.sort_by_key(|(at, _)| *at);
        out.extend(self.late.drain(..).map(|(_, pk)| pk));
        out
    }
}

struct Sim {
    rng: StdRng,
    p: Primary,
    r: Replica,
    net: Net,
    st: Stats,
    /// Replica offsets below this were compared with the primary's bytes.
    verified: u64,
    trace: bool,
}

impl Sim {
    /// A primary and a replica just SYNCed at offset 0.
    fn new(seed: u64, faults: Option<Faults>, skip_check: bool, trace: bool) -> Sim {
        let mut rng = StdRng::seed_from_u64(seed);
        let f = faults.unwrap_or_else(|| Faults::random(&mut rng));
        if trace {
            eprintln!("seed {seed}: {f:?}");
        }
        let mut sim = Sim {
            rng,
            p: Primary::new(),
            r: Replica::new(skip_check),
            net: Net {
                f,
                queue: VecDeque::new(),
                late: Vec::new(),
            },
            st: Stats::default(),
            verified: 0,
            trace,
        };
        sim.sync(0, "start");
        sim
    }

    /// The primary rolls back its open append and SYNCs (with a seq of its
    /// own) at its head with its registers; the SYNC itself is not lost.
    fn sync(&mut self, step: usize, why: &str) {
        if let Some(pk) = self.p.abandon_open(&mut self.st, self.trace) {
            self.net.send(pk, step, &mut self.rng, &mut self.st);
        }
        let head = self.p.head();
        assert!(
            self.r.head <= head,
            "replica head {} is past the primary's {head}",
            self.r.head
        );
        let seq = self.p.take_seq();
        if self.trace {
            eprintln!(
                "  SYNC {seq} at {head}, registers {} ({why}); replica was at {}",
                self.p.registers, self.r.head
            );
        }
        self.st.gap_bytes += head - self.r.head;
        self.st.syncs += 1;
        self.p.frag_sha = Sha1::new();
        self.p.epoch += 1;
        self.p.epoch_seq = self.p.next_seq;
        self.p.pending.clear();
        self.p.needs_sync = false;
        self.r.sync(head, seq, self.p.registers.clone());
    }

    fn send(&mut self, packets: Vec<Packet>, step: usize) {
        for pk in packets {
            self.net.send(pk, step, &mut self.rng, &mut self.st);
        }
    }

    /// Hands packets to the replica in frames of 1..3 records.
    fn receive(&mut self, packets: Vec<Packet>) {
        let mut i = 0;
        while i < packets.len() {
            let n = self.rng.gen_range(1..=3).min(packets.len() - i);
            let group = &packets[i..i + n];
            let payload: Vec<u8> = group
                .iter()
                .flat_map(|pk| pk.bytes.iter().copied())
                .collect();
            let recs = decode_records(&payload).expect("REPLICATE payload decodes");
            assert_eq!(recs.len(), n, "one record per packet");
            self.st.frames += 1;
            for (rec, pk) in recs.iter().zip(group) {
                self.st.delivered += 1;
                self.st.corrupt_delivered += pk.corrupt as u64;
                self.st.stale_delivered += (pk.epoch < self.p.epoch) as u64;
                self.r.apply(rec, pk, &self.p, &mut self.st, self.trace);
            }
            i += n;
        }
    }

    fn answer(&mut self) {
        let acks: Vec<Ack> = std::mem::take(&mut self.r.acks)
            .into_iter()
            .filter(|a| {
                let lost = self.rng.gen_bool(self.net.f.ack_drop);
                if lost && self.trace {
                    eprintln!("  ack {} {:?} lost", a.seq, a.status);
                }
                self.st.acks_dropped += lost as u64;
                !lost
            })
            .collect();
        if acks.is_empty() {
            return;
        }
        let acks = decode_acks(&encode_acks(&acks)).expect("REPLICATE_ACK payload decodes");
        for a in &acks {
            self.p.on_ack(a, &self.r, &mut self.st, self.trace);
        }
    }

    /// The replica's committed bytes are the primary's, its ranges ordered
    /// and within the heads.
    fn check(&mut self, full: bool) {
        let (p, r) = (&self.p, &self.r);
        assert!(r.head <= p.head());
        let mut last = 0;
        for &(b, e) in &r.ranges {
            assert!(b < e && b >= last, "replica ranges {:?}", r.ranges);
            last = e;
        }
        assert!(last <= r.head);
        assert_eq!(r.content.len() as u64, last);
        let from = if full { 0 } else { self.verified };
        for &(b, e) in r.ranges.iter().rev() {
            if e <= from {
                break;
            }
            let b = b.max(from) as usize;
            let e = e as usize;
            if let Some(i) = first_difference(&r.content[b..e], &p.journal[b..e]) {
                panic!(
                    "divergent commit: the replica holds {:#04x} at offset {}, the primary {:#04x}",
                    r.content[b + i],
                    b + i,
                    p.journal[b + i]
                );
            }
        }
        self.verified = last;
    }
}

struct Run {
    st: Stats,
    journal: Vec<u8>,
    replica: Vec<u8>,
    ranges: Vec<(u64, u64)>,
    replica_registers: LabelSet,
    primary_registers: LabelSet,
}

fn run(seed: u64, faults: Option<Faults>, skip_check: bool, trace: bool) -> Run {
    let mut sim = Sim::new(seed, faults, skip_check, trace);
    let f = sim.net.f;
    for step in 0..BATCHES {
        let last = step + 1 == BATCHES;
        let packets = sim
            .p
            .random_batch(step, last, &mut sim.rng, &mut sim.st, trace);
        sim.send(packets, step);
        let arrived = sim.net.deliver(step, &mut sim.rng, &mut sim.st);
        sim.receive(arrived);
        sim.answer();
        sim.check(false);
        if sim.p.needs_sync {
            sim.sync(step, "refused");
        } else if sim.p.timed_out(step) {
            sim.sync(step, "ack timed out");
        } else if sim.rng.gen_bool(f.seal) {
            sim.sync(step, "seal");
        }
    }
    assert!(sim.p.open.is_none(), "the last batch leaves no append open");
    // Whatever is still in flight arrives at last.
    let rest = sim.net.drain();
    sim.receive(rest);
    sim.answer();
    sim.check(true);
    Run {
        st: sim.st,
        journal: sim.p.journal,
        replica: sim.r.content,
        ranges: sim.r.ranges,
        replica_registers: sim.r.registers,
        primary_registers: sim.p.registers,
    }
}

/// Runs a seed; a failure names the seed and how to replay it.
fn run_seed(seed: u64, faults: Option<Faults>) -> Run {
    common::sim::run_seed("pipeline_sim", seed, || run(seed, faults, false, false))
}

#[test]
fn perfect_network_commits_every_append() {
    let mut total = Stats::default();
    for seed in 0..20 {
        let run = run_seed(seed, Some(Faults::NONE));
        let st = &run.st;
        assert_eq!(
            st.acked, st.proposed,
            "seed {seed}: every proposal is acked OK"
        );
        assert_eq!(st.replica_commits, st.proposed, "seed {seed}");
        assert_eq!(st.empty_commits, st.proposed_empty, "seed {seed}");
        assert_eq!(
            st.refusals + st.mismatches,
            0,
            "seed {seed}: nothing is refused"
        );
        assert_eq!(st.gap_bytes, 0, "seed {seed}: no gaps");
        assert!(
            st.rolled_back > 0 && st.proposed > 100,
            "seed {seed}: {st:?}"
        );
        assert_eq!(run.replica, run.journal, "seed {seed}: same bytes");
        let len = run.journal.len() as u64;
        assert!(len > 0);
        assert_eq!(
            run.ranges,
            vec![(0, len)],
            "seed {seed}: one range, no gaps"
        );
        assert_eq!(run.replica_registers, run.primary_registers, "seed {seed}");
        total.add(st);
    }
    // Every shape of batch went through.
    let t = &total;
    assert!(t.failed_batches > 0 && t.opened_early > 0, "{t:?}");
    assert!(t.retried > 0, "{t:?}");
    assert!(t.refused_empty > 0 && t.empty_commits > 0, "{t:?}");
    assert!(
        t.commits_ahead_of_pending > 0 && t.max_pending >= 8,
        "{t:?}"
    );
    assert!(t.rollbacks_dropping_several > 0, "{t:?}");
    assert!(t.rollbacks_keeping_older > 0, "{t:?}");
    assert!(t.empty_commits_before_pending > 0, "{t:?}");
}

#[test]
fn faulty_network_never_commits_divergent_bytes() {
    if let Some(seed) = std::env::var("ROTARY_SIM_SEED")
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
    {
        let run = run(seed, None, false, true);
        eprintln!("seed {seed}: {:#?}", run.st);
        return;
    }
    let seeds: u64 = std::env::var("ROTARY_SIM_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2000);
    let mut total = Stats::default();
    for seed in 0..seeds {
        let st = run_seed(seed, None).st;
        // Content records carry their seq and offset and old proposals are
        // refused, so the SHA-1 check only ever catches flipped bits.
        assert_eq!(
            st.mismatches, st.corruption_caught,
            "seed {seed}: a proposal the track let through differs without a flipped bit"
        );
        total.add(&st);
    }
    eprintln!("pipeline_sim over {seeds} seeds: {total:#?}");
    if seeds < 2000 {
        return;
    }
    let t = &total;
    // The faults happened, and the checks had something to catch.
    assert!(t.dropped > 0 && t.duplicated > 0 && t.swapped > 0, "{t:?}");
    assert!(t.delayed > 0 && t.late > 0 && t.acks_dropped > 0, "{t:?}");
    assert!(t.corrupt_delivered > 100, "{t:?}");
    assert!(t.corruption_caught > 100, "{t:?}");
    assert!(t.stale_delivered > 100, "{t:?}");
    assert!(t.stale_commits_refused > 100, "{t:?}");
    assert!(t.refusals > 1000 && t.mismatches > 100, "{t:?}");
    assert!(t.refusals_dropping_several > 100, "{t:?}");
    assert!(t.gap_bytes > 0 && t.rollbacks_applied > 0, "{t:?}");
    assert!(t.rollbacks_dropping_several > 100, "{t:?}");
    assert!(t.rollbacks_keeping_older > 100, "{t:?}");
    assert!(t.empty_commits_before_pending > 100, "{t:?}");
    assert!(
        t.empty_commits > 1000 && t.commits_ahead_of_pending > 1000,
        "{t:?}"
    );
    assert!(t.max_pending >= 8 && t.retried > 1000, "{t:?}");
    // And the pipeline still made progress.
    assert!(
        t.acked * 10 >= t.proposed * 5,
        "only {} of {} proposals committed on the replica",
        t.acked,
        t.proposed
    );
}

#[test]
fn skipping_the_sha1_check_is_caught() {
    // The replica that trusts offsets alone commits a flipped bit sooner
    // or later; the simulation must see it.
    let caught = (0..200).any(|seed| {
        let res = catch_unwind(AssertUnwindSafe(|| run(seed, None, true, false)));
        match res {
            Ok(_) => false,
            Err(e) => {
                let msg = panic_message(&*e);
                assert!(msg.contains("divergent commit"), "seed {seed}: {msg}");
                true
            }
        }
    });
    assert!(
        caught,
        "no seed committed a corrupted byte without the check"
    );
}

/// Hands `packets` over in this order on a perfect network.
fn deliver(sim: &mut Sim, packets: Vec<Packet>) {
    sim.receive(packets);
    sim.answer();
    sim.check(true);
}

#[test]
fn reordered_register_only_appends_keep_the_latest_registers() {
    // The faulty runs once committed two appends without content, each
    // setting the registers, newest first, and the replica ended with the
    // older append's registers. Such appends are refused by the primary
    // now, and the track refuses any proposal not newer than the last one
    // committed (or SYNCed): reordered, repeated or from before a SYNC,
    // even when it lands at the replica's head.
    let mut sim = Sim::new(0, Some(Faults::NONE), false, false);
    let batch = |sim: &mut Sim, step: usize, drafts: Vec<Draft>| {
        sim.p.batch(step, drafts, None, false, &mut sim.st, false)
    };

    // The old case: the primary refuses both and rolls them back.
    let pk = batch(
        &mut sim,
        0,
        vec![
            Draft::new(b"", Some(writer("w1"))),
            Draft::new(b"", Some(writer("w2"))),
        ],
    );
    assert_eq!(pk.len(), 2, "two rollbacks");
    deliver(&mut sim, pk.into_iter().rev().collect());
    assert_eq!((sim.st.refused_empty, sim.st.proposed), (2, 0));
    assert_eq!(sim.r.registers, LabelSet::new());

    // Appends 4 (w1), 5 and 6 (without content, after 4); the proposal of
    // 5 arrives after that of 6 and is refused.
    let pk = batch(
        &mut sim,
        1,
        vec![
            Draft::new(b"abc", Some(writer("w1"))),
            Draft::new(b"", None),
            Draft::new(b"", None),
        ],
    );
    let [content4, commit4, commit5, commit6] = <[Packet; 4]>::try_from(pk).ok().unwrap();
    deliver(&mut sim, vec![content4, commit4, commit6, commit5]);
    assert_eq!(sim.st.acked, 2);
    assert!(sim.p.acked.contains(&4) && sim.p.acked.contains(&6));
    assert_eq!(sim.st.refusals, 1);
    assert_eq!(sim.r.registers, writer("w1"));
    assert!(sim.p.needs_sync);
    sim.sync(1, "refused");

    // Append 8 sets w2 and 9 follows it without content; a repeat of 9's
    // proposal is refused.
    let pk = batch(
        &mut sim,
        2,
        vec![Draft::new(b"de", Some(writer("w2"))), Draft::new(b"", None)],
    );
    let commit9 = pk[2].clone();
    deliver(&mut sim, pk);
    assert_eq!(sim.st.acked, 4);
    assert_eq!(sim.r.registers, writer("w2"));
    deliver(&mut sim, vec![commit9.clone()]);
    assert_eq!(sim.st.refusals, 2);
    assert!(sim.p.needs_sync);
    sim.sync(2, "refused");

    // SYNC 10 is at 5, where 9's proposal is: arriving late, it is
    // refused all the same. The primary takes that refusal for old news;
    // its next SYNC (after an ack timeout, say) brings the replica back.
    deliver(&mut sim, vec![commit9]);
    assert_eq!((sim.st.refusals, sim.st.stale_commits_refused), (3, 1));
    assert!(!sim.p.needs_sync);
    sim.sync(3, "ack timed out");

    // Appends 12 (without content) and 13 (keeping w2) commit.
    let pk = batch(
        &mut sim,
        4,
        vec![Draft::new(b"", None), Draft::new(b"fg", None)],
    );
    deliver(&mut sim, pk);
    assert!(sim.p.acked.contains(&12) && sim.p.acked.contains(&13));
    assert_eq!((sim.st.acked, sim.st.refusals), (6, 3));
    assert_eq!(sim.st.replica_commits, 6);
    assert_eq!(sim.r.registers, writer("w2"));
    assert_eq!(sim.r.registers, sim.p.registers);
    assert_eq!(sim.r.content, b"abcdefg");
}
