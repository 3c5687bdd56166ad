//! rotary's wire format, journal specs and client library.
//!
//! `wire` encodes and decodes frames without allocation on the decode path
//! and without any runtime; `spec` holds the journal specification types
//! shared by broker and client; `client` is the async client for ordinary
//! tokio applications. Nothing here owns a thread or a shard: the broker's
//! per-core servers live in `rotary-engine` and use `wire` directly.

pub mod client;
pub mod message;
pub mod repl;
pub mod spec;
pub mod status;
pub mod wire;

pub use spec::{JournalSpec, LabelSelector, LabelSet};
pub use status::Status;

/// Which shard of a broker owns a journal: a stable hash of the name
/// (FNV-1a 64) modulo the shard count. Client and broker compute the same.
pub fn shard_of(journal: &str, shards: u32) -> u32 {
    assert!(shards > 0);
    let mut h: u64 = 0xcbf29ce484222325;
    for b in journal.as_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x100000001b3);
    }
    (h % u64::from(shards)) as u32
}
