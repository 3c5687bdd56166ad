//! Seeded simulation of a journal's replication pipeline. A primary model
//! proposes appends as [`Record`]s (content in 1..4 chunks, then a commit
//! or a rollback); a faulty network drops, duplicates, swaps, delays and
//! bit-flips them, through the wire codec; a replica model applies what
//! arrives through [`ReplicaTrack`] and [`check_proposal`] exactly as a
//! broker does, and answers with acks; the primary re-SYNCs on any refusal.
//!
//! After every step the replica's committed bytes must be the primary's
//! bytes at the same offsets: a replica may lag, and may lack ranges it
//! skipped over at a SYNC, but never holds a different byte, never commits
//! a range the primary did not propose for that seq, and only grows at its
//! end. Every OK ack the primary receives must name a range the replica
//! holds with the primary's bytes.
//!
//! The primary keeps what it proposed whatever the replica answers (a
//! replica that misses appends is brought back by SYNC at the primary's
//! head, leaving a gap), so "the primary's byte at offset o" is fixed once
//! proposed. A failing seed replays with `ROTARY_SIM_SEED=n`, which also
//! prints every event of the run; `ROTARY_SIM_SEEDS=n` runs n seeds.
//!
//! Registers are checked per commit (the replica takes those the primary
//! proposed for that seq), not against the primary's latest: a reordered or
//! repeated commit of an append without content passes the track and the
//! SHA-1 check and brings older registers back. The faulty runs count these
//! (`register_regressions`); an ignored test pins the case down.

use rand::{rngs::StdRng, Rng, SeedableRng};
use rotary_engine::replica::{check_proposal, ReplicaTrack, Verdict};
use rotary_net::repl::{decode_acks, decode_records, encode_acks, Ack, Record};
use rotary_net::spec::LabelSet;
use rotary_net::status::Status;
use rotary_net::wire::MetaWriter;
use sha1::{Digest, Sha1};
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};

const JOURNAL: &str = "sim/pipeline";
/// Appends per seed.
const APPENDS: usize = 200;
/// Steps an append may wait for its ack before the primary gives up on the
/// replica and re-SYNCs.
const ACK_TIMEOUT_STEPS: usize = 8;

/// Per-packet fault probabilities of one seed's network.
#[derive(Clone, Copy, Debug)]
struct Faults {
    drop: f64,
    dup: f64,
    /// Swap with the packet sent just before.
    swap: f64,
    /// Let 1..4 later packets overtake it (or hold it to the next step).
    delay: f64,
    /// Hold it for 1..20 steps: it arrives after later appends, often
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
        seal: 0.02,
    };

    /// Each seed draws its own mix; any kind may be off for a seed.
    fn random(rng: &mut StdRng) -> Faults {
        let mut p = |max: f64| {
            if rng.gen_bool(0.2) {
                0.0
            } else {
                rng.gen_range(0.0..max)
            }
        };
        Faults {
            drop: p(0.03),
            dup: p(0.03),
            swap: p(0.05),
            delay: p(0.05),
            late: p(0.01),
            corrupt: p(0.02),
            ack_drop: p(0.03),
            seal: p(0.02),
        }
    }
}

/// Everything a run counts; summed over seeds.
#[derive(Clone, Debug, Default)]
struct Stats {
    appends: u64,
    proposed: u64,
    rolled_back: u64,
    /// Proposals the primary got an OK ack for.
    acked: u64,
    replica_commits: u64,
    committed_bytes: u64,
    /// Refuse verdicts of the track.
    refusals: u64,
    /// Commits the track let through that failed `check_proposal`.
    mismatches: u64,
    /// ... of which had a corrupted chunk staged.
    corruption_caught: u64,
    rollbacks_applied: u64,
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
    stale_recommits: u64,
    register_regressions: u64,
}

impl Stats {
    fn add(&mut self, o: &Stats) {
        macro_rules! sum {
            ($($f:ident),*) => { $(self.$f += o.$f;)* };
        }
        sum!(
            appends,
            proposed,
            rolled_back,
            acked,
            replica_commits,
            committed_bytes,
            refusals,
            mismatches,
            corruption_caught,
            rollbacks_applied,
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
            acks_dropped,
            stale_recommits,
            register_regressions
        );
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

struct Proposal {
    begin: u64,
    end: u64,
    registers: LabelSet,
}

struct Primary {
    /// The journal from offset 0: every proposed (committed) byte.
    journal: Vec<u8>,
    /// SHA-1 of the open fragment, which begins at the last SYNC's head.
    frag_sha: Sha1,
    next_seq: u64,
    epoch: u64,
    /// The first seq sent after the last SYNC.
    epoch_seq: u64,
    proposals: HashMap<u64, Proposal>,
    /// Proposals of this epoch awaiting an ack: seq -> step sent.
    pending: BTreeMap<u64, usize>,
    acked: HashSet<u64>,
    needs_sync: bool,
}

fn append_len(rng: &mut StdRng) -> usize {
    match rng.gen_range(0..100) {
        0..=9 => 0,
        10..=74 => rng.gen_range(1..=256),
        75..=94 => rng.gen_range(257..=2048),
        _ => rng.gen_range(2049..=6144),
    }
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

impl Primary {
    fn new() -> Primary {
        Primary {
            journal: Vec::new(),
            frag_sha: Sha1::new(),
            next_seq: 1,
            epoch: 0,
            epoch_seq: 1,
            proposals: HashMap::new(),
            pending: BTreeMap::new(),
            acked: HashSet::new(),
            needs_sync: false,
        }
    }

    fn head(&self) -> u64 {
        self.journal.len() as u64
    }

    /// One random append: its content records, then its commit or rollback.
    fn append(
        &mut self,
        step: usize,
        rng: &mut StdRng,
        st: &mut Stats,
        trace: bool,
    ) -> Vec<Packet> {
        let len = append_len(rng);
        let mut bytes = vec![0u8; len];
        rng.fill(&mut bytes[..]);
        let mut cuts = Vec::new();
        if len > 0 {
            let pieces = rng.gen_range(1..=4usize).min(len);
            cuts = (1..pieces).map(|_| rng.gen_range(1..len)).collect();
            cuts.sort_unstable();
            cuts.dedup();
        }
        let registers = if rng.gen_bool(0.08) {
            None
        } else {
            Some(LabelSet::from_pairs([("writer", format!("w{}", rng.gen_range(0..3)))]).unwrap())
        };
        self.propose(step, &bytes, &cuts, registers, st, trace)
    }

    /// Append `bytes` as content records split at `cuts`, then commit it
    /// with `registers`, or roll it back if there are none.
    fn propose(
        &mut self,
        step: usize,
        bytes: &[u8],
        cuts: &[usize],
        registers: Option<LabelSet>,
        st: &mut Stats,
        trace: bool,
    ) -> Vec<Packet> {
        let seq = self.next_seq;
        self.next_seq += 1;
        st.appends += 1;
        let begin = self.head();
        let mut packets = Vec::new();
        if !bytes.is_empty() {
            let mut at = 0;
            for &cut in cuts.iter().chain([&bytes.len()]) {
                let rec = Record::Content {
                    seq,
                    journal: JOURNAL,
                    offset: begin + at as u64,
                    bytes: &bytes[at..cut],
                };
                packets.push(encode(&rec, self.epoch));
                at = cut;
            }
        }
        let Some(registers) = registers else {
            st.rolled_back += 1;
            packets.push(encode(
                &Record::Rollback {
                    seq,
                    journal: JOURNAL,
                },
                self.epoch,
            ));
            if trace {
                eprintln!(
                    "step {step}: append {seq} of {} bytes at {begin}, rolled back",
                    bytes.len()
                );
            }
            return packets;
        };
        self.journal.extend_from_slice(bytes);
        self.frag_sha.update(bytes);
        let end = self.head();
        packets.push(encode(
            &Record::Commit {
                seq,
                journal: JOURNAL,
                begin,
                end,
                fragment_sha1: self.frag_sha.clone().finalize().into(),
                registers: registers.clone(),
            },
            self.epoch,
        ));
        st.proposed += 1;
        if trace {
            eprintln!(
                "step {step}: append {seq} proposed at [{begin}, {end}) in {} records, registers {registers}",
                packets.len()
            );
        }
        self.proposals.insert(
            seq,
            Proposal {
                begin,
                end,
                registers,
            },
        );
        self.pending.insert(seq, step);
        packets
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
    /// Bytes of the open append, which began at `head`.
    staged: Vec<u8>,
    /// `frag_sha` then `staged`.
    staged_sha: Sha1,
    /// The simulation's knowledge: a bit-flipped chunk is staged.
    staged_corrupt: bool,
    registers: LabelSet,
    /// The latest seq committed.
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
            staged: Vec::new(),
            staged_sha: Sha1::new(),
            staged_corrupt: false,
            registers: LabelSet::new(),
            last_seq: 0,
            acks: Vec::new(),
            skip_check,
        }
    }

    /// SYNC: the journal continues at the primary's `head`; the replica
    /// seals what it has and starts a fragment there.
    fn sync(&mut self, head: u64) {
        self.track = ReplicaTrack::synced_at(head);
        self.head = head;
        self.frag_sha = Sha1::new();
        self.discard();
    }

    fn discard(&mut self) {
        self.staged.clear();
        self.staged_sha = self.frag_sha.clone();
        self.staged_corrupt = false;
    }

    fn stage(&mut self, bytes: &[u8], corrupt: bool) {
        self.staged.extend_from_slice(bytes);
        self.staged_sha.update(bytes);
        self.staged_corrupt |= corrupt;
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

    fn refused(&mut self, v: Verdict, st: &mut Stats, trace: bool) {
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
            Some(to) => assert_eq!(to, self.head, "an open append began at the replica's head"),
            None => assert!(
                self.staged.is_empty(),
                "refusal of {seq} without a rewind while {} bytes are staged",
                self.staged.len()
            ),
        }
        self.discard();
        st.refusals += 1;
        self.ack(seq, status, message);
    }

    fn apply(&mut self, rec: &Record, pk: &Packet, p: &Primary, st: &mut Stats, trace: bool) {
        assert_eq!(rec.journal(), JOURNAL);
        if trace {
            eprintln!(
                "  deliver {}{}{}",
                describe(rec),
                if pk.corrupt { " [bit flipped]" } else { "" },
                if pk.epoch < p.epoch { " [stale]" } else { "" }
            );
        }
        match *rec {
            Record::Content {
                seq, offset, bytes, ..
            } => match self.track.on_content(seq, offset, bytes.len() as u64) {
                Verdict::Start { seq: s, begin } => {
                    assert_eq!((s, begin), (seq, offset));
                    assert!(
                        self.staged.is_empty(),
                        "append {seq} starts over staged bytes"
                    );
                    assert_eq!(
                        begin, self.head,
                        "append {seq} starts away from the replica's head"
                    );
                    self.stage(bytes, pk.corrupt);
                }
                Verdict::Continue { seq: s } => {
                    assert_eq!(s, seq);
                    assert_eq!(
                        offset,
                        self.head + self.staged.len() as u64,
                        "content of {seq} continues away from the staged end"
                    );
                    self.stage(bytes, pk.corrupt);
                }
                v @ Verdict::Refuse { .. } => self.refused(v, st, trace),
                v => panic!("content record of {seq} gave {v:?}"),
            },
            Record::Commit {
                seq,
                begin,
                end,
                fragment_sha1,
                ref registers,
                ..
            } => match self.track.on_commit(seq, begin, end) {
                Verdict::Commit {
                    seq: s,
                    begin: b,
                    end: e,
                } => {
                    assert_eq!((s, b, e), (seq, begin, end));
                    let staged_end = self.head + self.staged.len() as u64;
                    let staged_sha: [u8; 20] = self.staged_sha.clone().finalize().into();
                    let checked = if self.skip_check {
                        Ok(())
                    } else {
                        check_proposal(staged_end, &staged_sha, end, &fragment_sha1)
                    };
                    match checked {
                        Ok(()) => self.commit(seq, begin, end, registers, p, st, trace),
                        Err(msg) => {
                            if trace {
                                eprintln!("  replica: proposal {seq} mismatch: {msg}");
                            }
                            self.track.diverged();
                            st.mismatches += 1;
                            if self.staged_corrupt {
                                st.corruption_caught += 1;
                            }
                            self.discard();
                            self.ack(seq, Status::PROPOSAL_MISMATCH, msg);
                        }
                    }
                }
                v @ Verdict::Refuse { .. } => self.refused(v, st, trace),
                v => panic!("commit record of {seq} gave {v:?}"),
            },
            Record::Rollback { seq, .. } => match self.track.on_rollback(seq) {
                Verdict::Rollback { seq: s, to } => {
                    assert_eq!(s, seq);
                    assert_eq!(to, self.head, "rollback of {seq} to where it began");
                    self.discard();
                    st.rollbacks_applied += 1;
                }
                Verdict::Ignore => {}
                v => panic!("rollback record of {seq} gave {v:?}"),
            },
        }
    }

    #[allow(clippy::too_many_arguments)]
    fn commit(
        &mut self,
        seq: u64,
        begin: u64,
        end: u64,
        registers: &LabelSet,
        p: &Primary,
        st: &mut Stats,
        trace: bool,
    ) {
        // What the state machine and the SHA-1 check let through must be
        // exactly what the primary proposed for this seq.
        let prop = p.proposals.get(&seq).unwrap_or_else(|| {
            panic!("divergent commit: append {seq} at [{begin}, {end}), which the primary never proposed")
        });
        assert_eq!(
            (prop.begin, prop.end),
            (begin, end),
            "divergent commit: append {seq} at another range than proposed"
        );
        assert_eq!(&prop.registers, registers, "registers of {seq}");
        assert_eq!(begin, self.head, "append {seq} commits away from the head");
        assert_eq!(
            end - begin,
            self.staged.len() as u64,
            "staged bytes of {seq}"
        );
        let last_end = self.ranges.last().map_or(0, |r| r.1);
        assert!(begin >= last_end, "committed ranges only grow at the end");
        if end > begin {
            self.content.resize(begin as usize, 0);
            self.content.extend_from_slice(&self.staged);
            match self.ranges.last_mut() {
                Some(r) if r.1 == begin => r.1 = end,
                _ => self.ranges.push((begin, end)),
            }
        }
        if trace {
            eprintln!("  replica: commit {seq} at [{begin}, {end}), registers {registers}");
        }
        if seq <= self.last_seq {
            st.stale_recommits += 1;
            if *registers != self.registers {
                st.register_regressions += 1;
                if trace {
                    eprintln!(
                        "  replica: registers go back from {} to {registers} of {seq}, older than {}",
                        self.registers, self.last_seq
                    );
                }
            }
        } else {
            self.last_seq = seq;
        }
        self.head = end;
        self.frag_sha = self.staged_sha.clone();
        self.registers = registers.clone();
        self.discard();
        st.replica_commits += 1;
        st.committed_bytes += end - begin;
        self.ack(seq, Status::OK, String::new());
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
            ..
        } => format!(
            "commit {seq} [{begin}, {end}) sha {}",
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
                    // Still in flight when the primary sends its next append.
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
        sim.sync("start");
        sim
    }

    fn sync(&mut self, why: &str) {
        let head = self.p.head();
        assert!(
            self.r.head <= head,
            "replica head {} is past the primary's {head}",
            self.r.head
        );
        if self.trace {
            eprintln!("  SYNC at {head} ({why}); replica was at {}", self.r.head);
        }
        self.st.gap_bytes += head - self.r.head;
        self.st.syncs += 1;
        self.p.frag_sha = Sha1::new();
        self.p.epoch += 1;
        self.p.epoch_seq = self.p.next_seq;
        self.p.pending.clear();
        self.p.needs_sync = false;
        self.r.sync(head);
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
    last_registers: Option<LabelSet>,
}

fn run(seed: u64, faults: Option<Faults>, skip_check: bool, trace: bool) -> Run {
    let mut sim = Sim::new(seed, faults, skip_check, trace);
    let f = sim.net.f;
    for step in 0..APPENDS {
        let packets = sim.p.append(step, &mut sim.rng, &mut sim.st, trace);
        for pk in packets {
            sim.net.send(pk, step, &mut sim.rng, &mut sim.st);
        }
        let arrived = sim.net.deliver(step, &mut sim.rng, &mut sim.st);
        sim.receive(arrived);
        sim.answer();
        sim.check(false);
        if sim.p.needs_sync {
            sim.sync("refused");
        } else if sim.p.timed_out(step) {
            sim.sync("ack timed out");
        } else if sim.rng.gen_bool(f.seal) {
            sim.sync("seal");
        }
    }
    // Whatever is still in flight arrives at last.
    let rest = sim.net.drain();
    sim.receive(rest);
    sim.answer();
    sim.check(true);
    let last_registers = sim
        .p
        .proposals
        .iter()
        .max_by_key(|(seq, _)| **seq)
        .map(|(_, p)| p.registers.clone());
    Run {
        st: sim.st,
        journal: sim.p.journal,
        replica: sim.r.content,
        ranges: sim.r.ranges,
        replica_registers: sim.r.registers,
        last_registers,
    }
}

/// Runs a seed; a failure names the seed and how to replay it.
fn run_seed(seed: u64, faults: Option<Faults>) -> Run {
    match catch_unwind(AssertUnwindSafe(|| run(seed, faults, false, false))) {
        Ok(r) => r,
        Err(e) => {
            eprintln!(
                "pipeline_sim: seed {seed} failed; replay it with ROTARY_SIM_SEED={seed} \
                 cargo test -p rotary-engine --test pipeline_sim -- --nocapture"
            );
            resume_unwind(e)
        }
    }
}

#[test]
fn perfect_network_commits_every_append() {
    for seed in 0..20 {
        let run = run_seed(seed, Some(Faults::NONE));
        let st = &run.st;
        assert_eq!(
            st.acked, st.proposed,
            "seed {seed}: every proposal is acked OK"
        );
        assert_eq!(st.replica_commits, st.proposed, "seed {seed}");
        assert_eq!(
            st.refusals + st.mismatches,
            0,
            "seed {seed}: nothing is refused"
        );
        assert_eq!(st.gap_bytes, 0, "seed {seed}: no gaps");
        assert_eq!(st.stale_recommits, 0, "seed {seed}");
        assert!(
            st.rolled_back > 0 && st.proposed > 150,
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
        assert_eq!(Some(run.replica_registers), run.last_registers);
    }
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
        total.add(&run_seed(seed, None).st);
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
    assert!(t.refusals > 1000 && t.mismatches > 100, "{t:?}");
    // Commits that follow the replica's view and differ only in the
    // fragment they hash (an empty append's commit arriving after a SYNC at
    // its offset): the SHA-1 check alone turns them away.
    assert!(t.mismatches > t.corruption_caught, "{t:?}");
    assert!(t.gap_bytes > 0 && t.rollbacks_applied > 0, "{t:?}");
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
                let msg = e
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| e.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
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

#[test]
#[ignore = "ReplicaTrack accepts an older seq's commit at the replica's head: a reordered or \
            repeated register-only append re-applies older registers (faulty seeds count these \
            as register_regressions)"]
fn reordered_register_only_appends_keep_the_latest_registers() {
    // Two appends without content, each setting the registers, arrive
    // newest first (seed 68 of the faulty runs does this at appends 47/48).
    // Both follow the replica's view and hash the same fragment, so both
    // commit, and the replica ends with the older append's registers.
    let mut sim = Sim::new(0, Some(Faults::NONE), false, false);
    let regs = |w: &str| LabelSet::from_pairs([("writer", w)]).unwrap();
    let first = sim
        .p
        .propose(0, &[], &[], Some(regs("w1")), &mut sim.st, false);
    let second = sim
        .p
        .propose(1, &[], &[], Some(regs("w2")), &mut sim.st, false);
    sim.receive(second.into_iter().chain(first).collect());
    sim.answer();
    sim.check(true);
    assert_eq!(
        sim.r.registers,
        regs("w2"),
        "the replica's registers went back"
    );
}
