//! The consumer framework: an application's work split into shards that
//! the cluster places on consumer processes, each shard's state in an
//! embedded store whose file operations are recorded into a recovery log
//! journal, and transactions that commit state, read offsets and
//! published messages together.
//!
//! The recovery log's core ([`recoverylog`]) is plain logic with no
//! network and no async, driven by the caller's thread.

// Functions stay short enough to hold in mind (threshold in clippy.toml).
#![warn(clippy::too_many_lines)]

pub mod cluster;
pub mod journal;
pub mod recoverylog;
pub mod spec;
pub mod store;
