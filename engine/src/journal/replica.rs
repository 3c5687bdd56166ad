//! What a journal keeps as a replica: its place in the primary's stream,
//! the appends awaiting proposals, the SYNCs waiting to be applied.

use crate::append::{Awaiting, SyncWaiter};
use std::collections::VecDeque;

/// A replica's state of the journal.
///
/// Written by the replica's rooms: a primary's REPLICATE and SYNC stream
/// (`conn/replica.rs`: the track of a new stream, SYNCs queued) and what
/// the flusher does with it (`shard/replica.rs`: proposals and SYNCs
/// applied; `shard/stage.rs`: appends staged whole; `shard/flusher.rs`:
/// those failed with their batch, and who wrote the spool last). Nothing
/// else reads it.
#[derive(Default)]
pub struct ReplicaState {
    /// The position in the primary's stream.
    pub(crate) track: Option<crate::replica::ReplicaTrack>,
    /// Appends staged whole, oldest first, awaiting proposals.
    pub(crate) awaiting: VecDeque<Awaiting>,
    /// SYNCs waiting to be applied by the flusher.
    pub(crate) sync_waiters: Vec<SyncWaiter>,
    /// The last batch committed to the open spool was a primary's (this
    /// broker a replica), not a client's: set by the flusher at each
    /// commit. A broker the route left holds back such a spool once
    /// sealed (`Shard::hold_sealed`).
    pub(crate) wrote_spool: bool,
}
