//! rotary's uploader: fragment stores, compression, uploads, store
//! listings and history reads.
//!
//! Runs on its own threads with its own tokio runtime (`object_store` needs
//! one), never on a shard core's executor. Shards talk to it only through
//! channels: they hand over sealed fragments with [`Uploader::try_upload`]
//! (bounded; never blocks) and get [`UploadDone`] back on the channel they
//! named. Listing, reading, presigning and deleting are requests answered
//! on executor-agnostic channels, so a compio shard can await them.
//!
//! Invariants: an object's name carries the SHA-1 of its *uncompressed*
//! bytes; an upload is verified before it is reported done; a fragment whose
//! bytes do not match its name's SHA-1 is never served.

pub mod store;

use rotary_net::spec::Codec;
use std::path::PathBuf;
use std::time::SystemTime;

pub use store::{StoreError, StoreUrl};

/// A fragment as it exists in a store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StoredFragment {
    pub journal: String,
    pub begin: u64,
    pub end: u64,
    /// SHA-1 of the uncompressed bytes `[begin, end)`.
    pub sha1: [u8; 20],
    pub codec: Codec,
    /// The store URL as written in the journal spec (`file:///…/`, `s3://…/`).
    pub store: String,
    /// Object key within the store, e.g. `orders/part-000/0000…-0000…-<sha1>.zst`.
    pub key: String,
    /// Stored (compressed) size in bytes.
    pub size: u64,
    pub mod_time: SystemTime,
}

/// A sealed local fragment to upload.
#[derive(Clone, Debug)]
pub struct UploadJob {
    pub journal: String,
    pub begin: u64,
    pub end: u64,
    pub sha1: [u8; 20],
    /// The local `.raw` file holding exactly the bytes `[begin, end)`.
    pub path: PathBuf,
    pub codec: Codec,
    /// Store URL to upload to (the journal's first store).
    pub store: String,
    /// Where to report the outcome (the owning shard's inbox).
    pub done: async_channel::Sender<UploadDone>,
}

/// Outcome of an [`UploadJob`].
#[derive(Debug)]
pub struct UploadDone {
    pub journal: String,
    pub begin: u64,
    pub end: u64,
    pub result: Result<StoredFragment, StoreError>,
}

/// Operator-visible counters of the pool.
#[derive(Default, Debug)]
pub struct UploadMetrics {
    pub queued: std::sync::atomic::AtomicU64,
    pub uploads: std::sync::atomic::AtomicU64,
    pub upload_failures: std::sync::atomic::AtomicU64,
    pub upload_bytes: std::sync::atomic::AtomicU64,
    pub upload_stored_bytes: std::sync::atomic::AtomicU64,
    /// Sum of upload latencies in microseconds (with `uploads`, the mean).
    pub upload_micros: std::sync::atomic::AtomicU64,
    pub skipped_existing: std::sync::atomic::AtomicU64,
}

/// The uploader pool.
#[derive(Clone)]
pub struct Uploader {
    // Implementation detail: a bounded crossbeam channel of jobs, a
    // channel of requests, the runtime's handle, metrics.
    inner: std::sync::Arc<Inner>,
}

struct Inner {
    _private: (),
}

/// Bytes of history streamed from a store, decompressed, in order.
pub struct HistoryChunk {
    /// Journal offset of `bytes[0]`.
    pub offset: u64,
    pub bytes: bytes::Bytes,
}

impl Uploader {
    /// Starts `threads` uploader threads (a tokio runtime of that many
    /// workers) with a job queue of `queue_max` fragments.
    pub fn start(threads: usize, queue_max: usize) -> Uploader {
        let _ = (threads, queue_max);
        todo!()
    }

    /// Queues an upload; gives the job back if the queue is full.
    pub fn try_upload(&self, job: UploadJob) -> Result<(), UploadJob> {
        let _ = job;
        todo!()
    }

    pub fn metrics(&self) -> &UploadMetrics {
        todo!()
    }

    /// Lists a journal's fragments in a store: objects directly under
    /// `<prefix><journal>/` whose names parse as fragment names (any
    /// postfix directory between journal and file name, as Gazette allows;
    /// never objects of journal `<journal>/child`).
    pub async fn list(&self, store: &str, journal: &str) -> Result<Vec<StoredFragment>, StoreError> {
        let _ = (store, journal);
        todo!()
    }

    /// Streams `[from, fragment.end)` of a fragment, decompressed and
    /// SHA-1-verified, in chunks of at most `chunk_max` bytes over a
    /// bounded channel. If the whole fragment's SHA-1 does not match its
    /// name, the stream ends with an error instead of its last chunk, so a
    /// caller must not treat bytes as served until the stream ends cleanly.
    pub fn read(&self, fragment: &StoredFragment, from: u64, chunk_max: usize) -> async_channel::Receiver<Result<HistoryChunk, StoreError>> {
        let _ = (fragment, from, chunk_max);
        todo!()
    }

    /// Where a client can read a fragment directly: a presigned GET URL
    /// valid for `ttl` (S3) or an absolute `file://` path.
    pub async fn locate(&self, fragment: &StoredFragment, ttl: std::time::Duration) -> Result<String, StoreError> {
        let _ = (fragment, ttl);
        todo!()
    }

    /// Deletes a fragment object.
    pub async fn delete(&self, fragment: &StoredFragment) -> Result<(), StoreError> {
        let _ = fragment;
        todo!()
    }
}
