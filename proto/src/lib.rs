//! rotary's protocol: the shapes that brokers, clients, the commit log's
//! neighbours and the uploader agree on, as plain data and pure functions.
//!
//! `wire` encodes and decodes frames without allocation on the decode path;
//! `status` holds the status codes; `spec` the journal specifications,
//! labels and selectors (and the `Codec` a spec names); `repl` the frames
//! brokers exchange to replicate; `fragment_name` the object names of
//! fragments (Gazette's); `shard_of` the journal → shard hash; `clock` the
//! one clock library code reads (real, or set by a test); `disk` which
//! local disk errors are final. Nothing here
//! does I/O, owns a thread or depends on a runtime: every crate of the
//! workspace may use it, and it never points back up at them.

// Functions stay short enough to hold in mind (threshold in clippy.toml).
#![warn(clippy::too_many_lines)]

pub mod clock;
pub mod disk;
pub mod fragment_name;
pub mod repl;
pub mod spec;
pub mod status;
pub mod wire;

pub use fragment_name::FragmentName;
pub use spec::{Codec, JournalSpec, LabelSelector, LabelSet};
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
