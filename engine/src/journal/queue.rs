//! A journal's append queue: appends waiting their turn, the one being
//! staged, and the batch staged.

use super::TokenBucket;
use crate::append::{Active, AppendOp, Staged};
use std::collections::VecDeque;
use std::rc::Rc;
use std::time::Instant;

/// The appends of a journal on their way into its spool.
///
/// Connections only push: `Shard::submit_append` (`shard/stage.rs`, for
/// `conn/append.rs` and `conn/replica.rs`, and for the tick's pulses of
/// idle journals in `shard/primary.rs`, which also set `last_append`)
/// queues onto `waiting`. Every other change is the flusher's: staging
/// takes appends from `waiting` into `active` and `staged`
/// (`shard/stage.rs`); the flusher's turn moves `staged` to the commit log
/// and answers it, and fails or rolls back what it must
/// (`shard/flusher.rs`, `shard/stage.rs`,
/// `shard/replica.rs`, `shard/primary.rs`, a deleted journal's in
/// `shard/history.rs`). `rate` is re-rated when the spec changes
/// (`shard/mod.rs`); `rate_timer` is cleared by the timer it names
/// (`shard/history.rs`). The tick and stats read it.
pub struct AppendQueue {
    /// Appends queued by connections, oldest first.
    pub(crate) waiting: VecDeque<Rc<AppendOp>>,
    /// The append being staged (the front of `waiting`).
    pub(crate) active: Option<Active>,
    /// Appends staged in the batch being built or written.
    pub(crate) staged: Vec<Staged>,
    /// Primary: this turn's staged appends went to replicas.
    pub(crate) staged_with_replicas: bool,
    /// When the last append was queued (primaries pulse idle journals).
    pub(crate) last_append: Instant,
    pub(crate) rate: TokenBucket,
    /// A timer will ready the journal when its rate admits more bytes.
    pub(crate) rate_timer: bool,
}

impl AppendQueue {
    /// An empty queue admitting `max_append_rate` bytes a second (0: any).
    pub fn new(max_append_rate: u64) -> AppendQueue {
        AppendQueue {
            waiting: VecDeque::new(),
            active: None,
            staged: Vec::new(),
            staged_with_replicas: false,
            last_append: crate::clock::now(),
            rate: TokenBucket::new(max_append_rate),
            rate_timer: false,
        }
    }
}
