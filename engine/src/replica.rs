//! The replica side of a journal's pipeline, as a plain state machine.
//!
//! A replica takes records from one primary, in the order the primary sent
//! them. [`ReplicaTrack`] decides, record by record, whether the record
//! continues exactly where the replica's view of the journal stands; any
//! gap, repeat or reordering is refused and leaves the journal
//! unsynchronized until the primary sends SYNC again. The flusher then
//! checks each proposal's fragment SHA-1 against the bytes the replica
//! actually staged ([`check_proposal`]) before it commits anything.

use rotary_net::status::Status;
use std::collections::VecDeque;

/// What to do with one record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// First bytes of append `seq`, which begins at `begin`.
    Start { seq: u64, begin: u64 },
    /// More bytes of the open append.
    Continue { seq: u64 },
    /// The oldest pending append is proposed at `[begin, end)`.
    Commit { seq: u64, begin: u64, end: u64 },
    /// An append without bytes is proposed at `at`. It changes nothing a
    /// replica holds (empty appends never change registers), so it is
    /// answered at once.
    CommitEmpty { seq: u64, at: u64 },
    /// Pending appends `seqs` (the named one and every later one) are
    /// abandoned; the replica rewinds to `to`.
    Rollback { seqs: Vec<u64>, to: u64 },
    /// Nothing to do (a rollback of an append this replica never started).
    Ignore,
    /// The record does not follow; answer `seq` with the status. The
    /// journal needs a SYNC before it takes more. Pending appends are
    /// dropped: `rewind_to` is where the first of them began.
    Refuse {
        seq: u64,
        status: Status,
        message: String,
        rewind_to: Option<u64>,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Pending {
    seq: u64,
    begin: u64,
}

/// A replica's position in one journal's stream from its primary.
///
/// The primary stages appends one after another, and may send the content
/// of several before the first is proposed (proposals follow its own
/// commit). So the replica keeps the appends it holds content of, in
/// order; only the newest may still be receiving content, and proposals
/// must come oldest first with strictly increasing sequence numbers.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReplicaTrack {
    /// Set by SYNC; cleared by any refusal.
    synced: bool,
    /// End of the content received: where the next content must land.
    expect: u64,
    /// Appends with content received and no proposal yet, oldest first.
    pending: VecDeque<Pending>,
    /// The newest sequence number committed (or of the SYNC).
    last_seq: u64,
    /// The primary's stream (connection) that synchronized the journal:
    /// records of any other stream (a primary the route has left, still
    /// sending) are refused without touching this state.
    stream: u64,
}

impl ReplicaTrack {
    /// A SYNC (sequence number `seq`) agreed that the journal continues at
    /// `head`.
    pub fn synced_at(head: u64, seq: u64) -> ReplicaTrack {
        ReplicaTrack {
            synced: true,
            expect: head,
            pending: VecDeque::new(),
            last_seq: seq,
            stream: 0,
        }
    }

    /// Binds the track to the stream that synchronized it.
    pub fn with_stream(mut self, stream: u64) -> ReplicaTrack {
        self.stream = stream;
        self
    }

    /// Whether records of `stream` may move this track: it is the stream
    /// that synchronized the journal, or the journal is not synchronized
    /// (its records are then refused as usual).
    pub fn takes_stream(&self, stream: u64) -> bool {
        !self.synced || self.stream == stream
    }

    pub fn is_synced(&self) -> bool {
        self.synced
    }

    /// Sequence numbers of the pending appends, oldest first.
    pub fn pending(&self) -> Vec<u64> {
        self.pending.iter().map(|p| p.seq).collect()
    }

    fn newest_seq(&self) -> u64 {
        self.pending.back().map_or(self.last_seq, |p| p.seq)
    }

    fn refuse(&mut self, seq: u64, message: String) -> Verdict {
        self.synced = false;
        let rewind_to = self.pending.front().map(|p| p.begin);
        self.pending.clear();
        Verdict::Refuse {
            seq,
            status: Status::PROPOSAL_MISMATCH,
            message,
            rewind_to,
        }
    }

    pub fn on_content(&mut self, seq: u64, offset: u64, len: u64) -> Verdict {
        if !self.synced {
            return self.refuse(seq, "journal is not synchronized with its primary".into());
        }
        if offset != self.expect {
            let msg = format!(
                "content of append {seq} at offset {offset}, but the replica is at {}",
                self.expect
            );
            return self.refuse(seq, msg);
        }
        if self.pending.back().is_some_and(|p| p.seq == seq) {
            self.expect += len;
            return Verdict::Continue { seq };
        }
        if seq <= self.newest_seq() {
            let msg = format!("content of append {seq} after append {}", self.newest_seq());
            return self.refuse(seq, msg);
        }
        self.pending.push_back(Pending { seq, begin: offset });
        self.expect += len;
        Verdict::Start { seq, begin: offset }
    }

    pub fn on_commit(&mut self, seq: u64, begin: u64, end: u64) -> Verdict {
        if !self.synced {
            return self.refuse(seq, "journal is not synchronized with its primary".into());
        }
        if seq <= self.last_seq {
            let msg = format!(
                "proposal of append {seq} after append {} committed",
                self.last_seq
            );
            return self.refuse(seq, msg);
        }
        if begin == end {
            // Between the pending appends it was staged among.
            let at = self.pending.front().map_or(self.expect, |p| p.begin);
            if begin != at || self.pending.front().is_some_and(|p| seq > p.seq) {
                let msg = format!(
                    "empty proposal of append {seq} at {begin}, but the replica is at {at}"
                );
                return self.refuse(seq, msg);
            }
            self.last_seq = seq;
            return Verdict::CommitEmpty { seq, at };
        }
        let ok = match self.pending.front() {
            Some(p) => {
                let p_end = self.pending.get(1).map_or(self.expect, |n| n.begin);
                p.seq == seq && p.begin == begin && end == p_end
            }
            None => false,
        };
        if !ok {
            let msg = format!(
                "proposal [{begin}, {end}) of append {seq} does not follow the replica's view (content through {}, pending {:?})",
                self.expect,
                self.pending()
            );
            return self.refuse(seq, msg);
        }
        self.pending.pop_front();
        self.last_seq = seq;
        Verdict::Commit { seq, begin, end }
    }

    pub fn on_rollback(&mut self, seq: u64) -> Verdict {
        let Some(at) = self.pending.iter().position(|p| p.seq == seq) else {
            return Verdict::Ignore;
        };
        let to = self.pending[at].begin;
        let seqs = self.pending.drain(at..).map(|p| p.seq).collect();
        self.expect = to;
        Verdict::Rollback { seqs, to }
    }

    /// The flusher found the proposal does not match the staged bytes.
    pub fn diverged(&mut self) {
        self.synced = false;
        self.pending.clear();
    }
}

/// Checks a proposal against what the replica staged: the same end and the
/// same SHA-1 of the open fragment through that end.
pub fn check_proposal(
    staged_end: u64,
    staged_sha1: &[u8; 20],
    end: u64,
    fragment_sha1: &[u8; 20],
) -> Result<(), String> {
    if staged_end != end {
        return Err(format!(
            "proposal ends at {end} but the replica staged through {staged_end}"
        ));
    }
    if staged_sha1 != fragment_sha1 {
        return Err(format!(
            "fragment SHA-1 through {end} is {} on the replica, {} in the proposal",
            hex::encode(staged_sha1),
            hex::encode(fragment_sha1)
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn start(seq: u64, begin: u64) -> Verdict {
        Verdict::Start { seq, begin }
    }

    fn commit(seq: u64, begin: u64, end: u64) -> Verdict {
        Verdict::Commit { seq, begin, end }
    }

    fn rollback(seqs: &[u64], to: u64) -> Verdict {
        let seqs = seqs.to_vec();
        Verdict::Rollback { seqs, to }
    }

    fn empty(seq: u64, at: u64) -> Verdict {
        Verdict::CommitEmpty { seq, at }
    }

    #[test]
    fn only_the_stream_that_synchronized_moves_the_track() {
        let t = ReplicaTrack::synced_at(100, 1).with_stream(7);
        assert!(t.takes_stream(7));
        assert!(!t.takes_stream(8), "a deposed primary's stream");
        let mut t = t;
        t.diverged();
        assert!(t.takes_stream(8), "unsynchronized: refused as usual");
    }

    #[test]
    fn in_order_records_commit() {
        let mut t = ReplicaTrack::synced_at(100, 1);
        assert_eq!(t.on_content(2, 100, 10), start(2, 100));
        assert_eq!(t.on_content(2, 110, 5), Verdict::Continue { seq: 2 });
        assert_eq!(t.on_commit(2, 100, 115), commit(2, 100, 115));
        assert_eq!(t.on_commit(3, 115, 115), empty(3, 115));
        assert_eq!(t.on_content(4, 115, 7), start(4, 115));
        assert_eq!(t.on_rollback(4), rollback(&[4], 115));
        assert_eq!(t.on_rollback(4), Verdict::Ignore);
        assert_eq!(t.on_content(5, 115, 1), start(5, 115));
    }

    #[test]
    fn a_batch_sends_content_of_several_appends_before_their_proposals() {
        let mut t = ReplicaTrack::synced_at(0, 1);
        assert_eq!(t.on_content(2, 0, 10), start(2, 0));
        assert_eq!(t.on_content(4, 10, 5), start(4, 10));
        assert_eq!(t.on_commit(2, 0, 10), commit(2, 0, 10));
        // Append 3 was empty, staged between 2 and 4.
        assert_eq!(t.on_commit(3, 10, 10), empty(3, 10));
        assert_eq!(t.on_commit(4, 10, 15), commit(4, 10, 15));
        // A failed batch rolls back every pending append from the first.
        t.on_content(5, 15, 1);
        t.on_content(6, 16, 1);
        assert_eq!(t.on_rollback(5), rollback(&[5, 6], 15));
        assert_eq!(t.on_rollback(6), Verdict::Ignore);
        assert_eq!(t.on_content(7, 15, 2), start(7, 15));
    }

    #[test]
    fn gaps_repeats_and_old_proposals_are_refused_until_sync() {
        let mut t = ReplicaTrack::synced_at(0, 1);
        t.on_content(2, 0, 10);
        // A repeated chunk.
        let v = t.on_content(2, 0, 10);
        assert!(matches!(
            v,
            Verdict::Refuse {
                rewind_to: Some(0),
                ..
            }
        ));
        assert!(!t.is_synced());
        assert!(matches!(t.on_commit(2, 0, 10), Verdict::Refuse { .. }));
        t = ReplicaTrack::synced_at(10, 5);
        // A commit whose content never arrived.
        assert!(matches!(t.on_commit(6, 10, 20), Verdict::Refuse { .. }));
        // A proposal older than the SYNC, even an empty one.
        t = ReplicaTrack::synced_at(10, 5);
        assert!(matches!(t.on_commit(4, 10, 10), Verdict::Refuse { .. }));
        t = ReplicaTrack::synced_at(10, 5);
        assert_eq!(t.on_commit(7, 10, 10), empty(7, 10));
        assert!(matches!(t.on_commit(6, 10, 10), Verdict::Refuse { .. }));
    }

    #[test]
    fn proposals_are_checked_against_staged_bytes() {
        assert!(check_proposal(10, &[1; 20], 10, &[1; 20]).is_ok());
        assert!(check_proposal(10, &[1; 20], 11, &[1; 20]).is_err());
        assert!(check_proposal(10, &[1; 20], 10, &[2; 20]).is_err());
    }
}
