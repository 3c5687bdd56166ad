//! What a journal keeps as its primary: the agreed replica pipelines,
//! its SYNCs and takeovers, and the batches awaiting replica acks.

use crate::append::{InFlight, PrimaryRepl};
use rotary_storage::spool::CommitPoint;
use std::collections::VecDeque;
use std::time::Instant;

/// A primary's replication state of the journal.
///
/// Written by the primary's room (`shard/primary.rs`: SYNC of replicas,
/// the acker, takeovers, the tick) and by the flusher's primary path
/// (`shard/flusher.rs`: a committed batch proposed to replicas, pipelines
/// dropped when the route changes); recovery (`shard/recover.rs`,
/// `shard/mod.rs`) sets `first_sync_pending`. Staging (`shard/stage.rs`)
/// and reads (`shard/read.rs`) only read it.
#[derive(Default)]
pub struct PrimaryState {
    /// The agreed replica pipelines (None: SYNC needed).
    pub(crate) repl: Option<PrimaryRepl>,
    /// A SYNC is under way.
    pub(crate) syncing: bool,
    /// The broker started with none of the journal's data (no fragment,
    /// spool or commit record): as its primary it knows its head only
    /// after its first SYNC, so reads wait for that (see `Shard::read`).
    pub(crate) first_sync_pending: bool,
    /// The topology version at which this broker, as the journal's
    /// primary, last asked the brokers of its earlier routes for bytes beyond
    /// its head (see `Shard::takeover_sources`); 0: not yet. Appends and
    /// reads wait for that.
    pub(crate) takeover_version: u64,
    /// The cluster view changed since the shard's tick last looked at the
    /// journal's route: if this broker became its primary, the tick takes
    /// it over then rather than at its first request (see `Shard::tick`).
    pub(crate) route_check: bool,
    /// After a failed SYNC, when to try again, and why it failed.
    pub(crate) sync_retry: Option<(Instant, crate::pipeline::Failure)>,
    /// SYNCs failed in a row since the last that succeeded: the pause
    /// before the next grows with them.
    pub(crate) sync_failures: u32,
    /// Committed batches awaiting replica acks (those in `proposed`, and
    /// the one the journal's acker waits on).
    pub(crate) inflight: usize,
    /// Batches proposed and not yet taken by the journal's acker, oldest
    /// first.
    pub(crate) proposed: VecDeque<InFlight>,
    /// The journal's acker task is running.
    pub(crate) acking: bool,
    /// Where the batches committed here stopped being confirmed: the
    /// spool's committed point before the oldest batch that a replica did
    /// not acknowledge (set through [`PrimaryState::unconfirmed_from`]).
    /// Those bytes were never acknowledged and may conflict with what a
    /// new primary appends at their offsets, so nothing stages, seals or
    /// answers a SYNC until the flusher took them back
    /// (`Shard::take_back_unconfirmed`), once no batch is in flight.
    pub(crate) unconfirmed: Option<CommitPoint>,
    /// Notified by the tick when the cluster view changed: the acker
    /// stops waiting for a replica that left the journal's route.
    pub(crate) route_moved: event_listener::Event,
    /// Offsets where this broker, as the journal's primary, took its
    /// history back and wrote it again with other bytes, oldest first, at
    /// most [`TAKEN_BACK_KEPT`]. Every SYNC it sends carries them, so a
    /// replica that was away when they were taken back, and still holds
    /// those bytes, drops them before it follows (`Shard::apply_syncs`).
    taken_back: Vec<u64>,
    /// Take-back offsets this broker followed as a replica (learned from
    /// its primaries' SYNCs): a later SYNC carrying one again drops
    /// nothing. Never passed on: a take-back that a primary later undid
    /// (rolling forward onto the bytes) only it knows of.
    followed: Vec<u64>,
}

/// Take-back offsets a journal keeps ([`PrimaryState::taken_back`]).
pub const TAKEN_BACK_KEPT: usize = 64;

impl PrimaryState {
    /// The take-back offsets SYNCs carry.
    pub fn taken_back(&self) -> &[u64] {
        &self.taken_back
    }

    /// Records that the history was taken back to `offset` (its bytes
    /// from there on may differ on a replica that was away).
    pub fn took_back(&mut self, offset: u64) {
        if self.taken_back.last() != Some(&offset) {
            self.taken_back.push(offset);
        }
        if self.taken_back.len() > TAKEN_BACK_KEPT {
            self.taken_back.remove(0);
        }
        assert!(self.taken_back.len() <= TAKEN_BACK_KEPT);
    }

    /// Forgets the take-backs at or beyond `head`: the history there was
    /// rolled forward onto the bytes a broker ahead held (the ones taken
    /// back, which then are the journal's).
    pub fn rolled_forward_from(&mut self, head: u64) {
        self.taken_back.retain(|&x| x < head);
    }

    /// Notes the take-back offsets a primary's SYNC carried, which this
    /// replica followed.
    pub fn followed(&mut self, offsets: &[u64]) {
        let mut all: Vec<u64> = self.followed.iter().chain(offsets).copied().collect();
        all.sort_unstable();
        all.dedup();
        let skip = all.len().saturating_sub(TAKEN_BACK_KEPT);
        self.followed = all.split_off(skip);
    }

    /// Every take-back offset this broker knows its copy follows: its own
    /// and those it followed as a replica.
    pub fn known_taken_back(&self) -> Vec<u64> {
        self.taken_back
            .iter()
            .chain(&self.followed)
            .copied()
            .collect()
    }

    /// A batch that began at `start` was not acknowledged by every replica:
    /// it and every batch after it are to be taken back. Keeps the oldest
    /// such point.
    pub(crate) fn unconfirmed_from(&mut self, start: CommitPoint) {
        match &self.unconfirmed {
            Some(u) if u.offset <= start.offset => {}
            _ => self.unconfirmed = Some(start),
        }
    }

    /// Whether a batch that began at `start` lies on top of a batch to be
    /// taken back, and so goes with it whatever its replicas answer.
    pub(crate) fn is_unconfirmed(&self, start: u64) -> bool {
        self.unconfirmed.as_ref().is_some_and(|u| start >= u.offset)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rotary_storage::sha::Sha1;

    fn at(offset: u64) -> CommitPoint {
        CommitPoint {
            offset,
            sha: Sha1::new(),
        }
    }

    #[test]
    fn the_oldest_unconfirmed_batch_is_kept() {
        let mut p = PrimaryState::default();
        assert!(!p.is_unconfirmed(0));
        p.unconfirmed_from(at(300));
        p.unconfirmed_from(at(500));
        assert_eq!(p.unconfirmed.as_ref().map(|u| u.offset), Some(300));
        p.unconfirmed_from(at(100));
        assert_eq!(p.unconfirmed.as_ref().map(|u| u.offset), Some(100));
        assert!(p.is_unconfirmed(100) && p.is_unconfirmed(700));
        assert!(!p.is_unconfirmed(99), "a batch before it stands on its own");
    }
}
