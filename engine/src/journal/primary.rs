//! What a journal keeps as its primary: the agreed replica pipelines,
//! its SYNCs and takeovers, and the batches awaiting replica acks.

use crate::append::{InFlight, PrimaryRepl};
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
    /// Committed batches awaiting replica acks (those in `proposed`, and
    /// the one the journal's acker waits on).
    pub(crate) inflight: usize,
    /// Batches proposed and not yet taken by the journal's acker, oldest
    /// first.
    pub(crate) proposed: VecDeque<InFlight>,
    /// The journal's acker task is running.
    pub(crate) acking: bool,
}
