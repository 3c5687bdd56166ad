//! rotary's async client library and the CLI's transport.
//!
//! `client` is the async client for ordinary tokio applications: it speaks
//! the native protocol to brokers and, for reads of history, fetches and
//! decodes fragments straight from their stores. The protocol itself (frames,
//! statuses, specs, replication frames, `shard_of`) lives in `rotary-proto`;
//! it is re-exported here under its old paths (`rotary_net::wire`, …).
//! Nothing here owns a thread or a shard: the broker's per-core servers live
//! in `rotary-engine`.

// Functions stay short enough to hold in mind (threshold in clippy.toml).
#![warn(clippy::too_many_lines)]

pub mod client;
pub mod message;

pub use rotary_proto::{fragment_name, repl, shard_of, spec, status, wire};
pub use rotary_proto::{JournalSpec, LabelSelector, LabelSet, Status};
