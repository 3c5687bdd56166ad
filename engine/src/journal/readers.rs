//! What a journal keeps for the readers waiting at its head.

use super::TailCache;
use event_listener::Event;

/// The readers waiting at the journal's head, and what is kept for them.
///
/// `tail` is written by the flusher only: staging pushes the bytes it
/// stages (`shard/stage.rs`), and undoing a staging truncates them
/// (`shard/stage.rs`, `shard/flusher.rs`, `shard/replica.rs`,
/// `shard/mod.rs`); reads (`shard/read.rs`) serve from it. `waiting` is
/// written by blocking reads only (`shard/read.rs`); staging reads it.
/// `committed` is an event, not a value: every path that makes bytes
/// readable or ends what reads wait for notifies it (the flusher's commit,
/// a replica's SYNC, a primary's SYNC or failure, listings, reset-head,
/// deletion, the spool's return); reads and admin requests listen.
#[derive(Default)]
pub struct Readers {
    /// Wakes readers waiting at the head.
    pub(crate) committed: Event,
    /// The newest staged bytes, kept while readers wait at the head so
    /// that tailing readers are served from memory, not the spool file.
    pub(crate) tail: TailCache,
    /// Blocking readers waiting for the next commit.
    pub(crate) waiting: usize,
}
