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
//! bytes; an upload streams through bounded memory, whatever the fragment's
//! length, and is verified before it is reported done; a fragment whose
//! bytes do not match its name's SHA-1 is never written or served.
//!
//! Threads: one dispatcher thread (`rotary-upload-queue`) moves jobs from
//! the bounded queue onto the runtime, at most `threads` at a time; the
//! runtime's workers (`rotary-upload`) run requests to stores; reading,
//! hashing, compressing and decompressing run on the runtime's blocking
//! threads. Dropping the last [`Uploader`] handle stops the pool: queued
//! and running uploads are abandoned (uploads are idempotent, so a shard
//! queues its unconfirmed fragments again after a restart).

// Functions stay short enough to hold in mind (threshold in clippy.toml).
#![warn(clippy::too_many_lines)]

mod codec;
pub mod conflicts;
mod put;
pub use rotary_proto::fragment_name as name;
mod read;
pub mod stats;
pub mod store;

use object_store::ObjectStoreExt;
use rotary_proto::spec::Codec;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, SystemTime};
use store::{Backend, Store};

pub use name::FragmentName;
pub use store::{StoreError, StoreUrl};

// Shards on many threads share one pool.
const _: fn() = || {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Uploader>();
};

/// Attempts of one upload job before it is reported as a (retryable)
/// failure, and the pauses between them.
pub const UPLOAD_ATTEMPTS_MAX: usize = 3;
const UPLOAD_BACKOFF: [Duration; UPLOAD_ATTEMPTS_MAX - 1] =
    [Duration::from_millis(200), Duration::from_millis(1000)];
/// Bytes per chunk of [`Uploader::sha1_of_range`]'s reads.
const HASH_CHUNK_BYTES: usize = 1 << 20;
/// How often [`Uploader::wait_idle`] looks.
const IDLE_POLL: Duration = Duration::from_millis(5);

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
    /// The fragment's SHA-1: with `begin` and `end`, which fragment this
    /// is (a journal deleted and created again may hold another of the
    /// same span).
    pub sha1: [u8; 20],
    pub result: Result<StoredFragment, StoreError>,
    /// The upload read the local file whole and found the bytes the
    /// fragment's name says (it wrote the object); false when the object
    /// existed already (the local file was not read) or the upload failed.
    pub local_checked: bool,
}

/// Operator-visible counters of the pool.
#[derive(Default, Debug)]
pub struct UploadMetrics {
    /// Jobs accepted by [`Uploader::try_upload`] and not yet started.
    pub queued: std::sync::atomic::AtomicU64,
    /// Successful uploads (written and verified; skips not counted).
    pub uploads: std::sync::atomic::AtomicU64,
    /// Jobs reported failed (after their attempts).
    pub upload_failures: std::sync::atomic::AtomicU64,
    /// Uncompressed bytes of successful uploads.
    pub upload_bytes: std::sync::atomic::AtomicU64,
    /// Stored (compressed) bytes of successful uploads.
    pub upload_stored_bytes: std::sync::atomic::AtomicU64,
    /// Sum of upload latencies in microseconds (with `uploads`, the mean).
    pub upload_micros: std::sync::atomic::AtomicU64,
    /// Jobs whose object already existed in the store.
    pub skipped_existing: std::sync::atomic::AtomicU64,
    /// Jobs started and not yet reported.
    pub in_flight: std::sync::atomic::AtomicU64,
    /// Attempts that failed and were tried again within a job.
    pub upload_retries: std::sync::atomic::AtomicU64,
}

/// The uploader pool.
#[derive(Clone)]
pub struct Uploader {
    // Implementation detail: a bounded crossbeam channel of jobs, a
    // channel of requests, the runtime's handle, metrics.
    inner: std::sync::Arc<Inner>,
}

/// Owned by the [`Uploader`] handles only. Tasks on the runtime hold
/// [`Shared`], never this: the runtime must not own (and so drop) itself.
struct Inner {
    jobs: crossbeam_channel::Sender<UploadJob>,
    handle: tokio::runtime::Handle,
    runtime: Option<tokio::runtime::Runtime>,
    shared: Arc<Shared>,
}

/// State of the pool that its tasks share.
pub(crate) struct Shared {
    /// Built stores by URL as written.
    stores: Mutex<HashMap<String, Arc<Store>>>,
    metrics: UploadMetrics,
    stores_stats: stats::StoresStats,
    /// One permit per upload thread: bounds concurrent jobs.
    permits: Arc<tokio::sync::Semaphore>,
    conflicts: conflicts::Conflicts,
}

impl Shared {
    pub(crate) fn store(&self, url: &str) -> Result<Arc<Store>, StoreError> {
        let mut stores = self.stores.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(store) = stores.get(url) {
            return Ok(store.clone());
        }
        let store = Arc::new(Store::open(&StoreUrl::parse(url)?)?);
        stores.insert(url.to_string(), store.clone());
        Ok(store)
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // The dispatcher leaves on a closed semaphore or a closed queue (our
        // `jobs` sender is dropped right after this).
        self.shared.permits.close();
        if let Some(runtime) = self.runtime.take() {
            // Never blocks, so the last handle may go anywhere, even on
            // another runtime's thread.
            runtime.shutdown_background();
        }
    }
}

/// How much lower than the broker's own an uploader thread's priority is.
/// Nice 10 weighs about a tenth of nice 0: a shard that wakes on a core where
/// the uploader compresses or hashes preempts it sooner, and the uploader
/// still gets its tenth of a busy core, so uploads never starve.
const UPLOADER_NICENESS: i32 = 10;

/// The calling thread's nice (on Linux, nice is per thread).
#[allow(unsafe_code)] // getpriority: std has no per-thread nice
fn thread_nice() -> i32 {
    // SAFETY: plain syscall on the calling thread. Its -1 is also a valid
    // nice, so an error reads as -1; callers clamp what they derive from it.
    unsafe { libc::getpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t) }
}

/// Sets the calling thread's nice to `nice` (clamped to at most 19). Absolute,
/// not relative: a blocking-pool thread is created by an uploader thread and
/// inherits its nice.
#[allow(unsafe_code)] // setpriority: std has no per-thread nice
fn set_thread_nice(nice: i32) {
    // SAFETY: plain syscall on the calling thread.
    let rc = unsafe {
        libc::setpriority(
            libc::PRIO_PROCESS,
            libc::gettid() as libc::id_t,
            nice.min(19),
        )
    };
    if rc != 0 {
        tracing::debug!(error = %std::io::Error::last_os_error(), "uploader thread keeps the priority it was created with");
    }
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
        assert!(threads >= 1, "an uploader needs a thread");
        assert!(queue_max >= 1, "an uploader needs a queue");
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .thread_name("rotary-upload")
            .on_thread_start({
                // Below the broker's threads, whichever thread creates them.
                let nice = thread_nice() + UPLOADER_NICENESS;
                move || set_thread_nice(nice)
            })
            .enable_all()
            .build()
            .expect("cannot start the uploader's runtime");
        let handle = runtime.handle().clone();
        let shared = Arc::new(Shared {
            stores: Mutex::new(HashMap::new()),
            metrics: UploadMetrics::default(),
            stores_stats: stats::StoresStats::default(),
            permits: Arc::new(tokio::sync::Semaphore::new(threads)),
            conflicts: conflicts::Conflicts::default(),
        });
        let (jobs, queue) = crossbeam_channel::bounded(queue_max);
        std::thread::Builder::new()
            .name("rotary-upload-queue".into())
            .spawn({
                let (shared, handle) = (shared.clone(), handle.clone());
                move || dispatch(queue, shared, handle)
            })
            .expect("cannot start the uploader's dispatcher thread");
        Uploader {
            inner: Arc::new(Inner {
                jobs,
                handle,
                runtime: Some(runtime),
                shared,
            }),
        }
    }

    /// Queues an upload; gives the job back if the queue is full.
    pub fn try_upload(&self, job: UploadJob) -> Result<(), UploadJob> {
        assert!(
            job.begin <= job.end,
            "upload of a fragment that ends before it begins"
        );
        let metrics = &self.inner.shared.metrics;
        // Counted before it can be dequeued, so `queued` never underflows.
        metrics.queued.fetch_add(1, Ordering::Relaxed);
        match self.inner.jobs.try_send(job) {
            Ok(()) => Ok(()),
            Err(e) => {
                metrics.queued.fetch_sub(1, Ordering::Relaxed);
                Err(e.into_inner())
            }
        }
    }

    pub fn metrics(&self) -> &UploadMetrics {
        &self.inner.shared.metrics
    }

    /// Upload and listing figures of each store used so far.
    pub fn stores_stats(&self) -> &stats::StoresStats {
        &self.inner.shared.stores_stats
    }

    /// The fragments the broker's journal indexes judged conflicting.
    pub fn conflicts(&self) -> &conflicts::Conflicts {
        &self.inner.shared.conflicts
    }

    /// Blocks the calling thread until no upload is queued or running (each
    /// started job has sent its [`UploadDone`]), or `timeout` passes; true
    /// if idle. For shutdown and tests: never call it on a shard's executor.
    pub fn wait_idle(&self, timeout: Duration) -> bool {
        let metrics = &self.inner.shared.metrics;
        let deadline = rotary_proto::clock::now() + timeout;
        loop {
            let busy =
                metrics.queued.load(Ordering::Acquire) + metrics.in_flight.load(Ordering::Acquire);
            if busy == 0 {
                return true;
            }
            if rotary_proto::clock::now() >= deadline {
                return false;
            }
            std::thread::sleep(IDLE_POLL);
        }
    }

    /// Lists a journal's fragments in a store: objects directly under
    /// `<prefix><journal>/` whose names parse as fragment names (any
    /// postfix directory between journal and file name, as Gazette allows;
    /// never objects of journal `<journal>/child`).
    ///
    /// A postfix directory is recognized only if its name contains `=`
    /// (see [`name`] for the rule and its one ambiguity). Sorted by
    /// `(begin, end, key)`.
    pub async fn list(
        &self,
        store: &str,
        journal: &str,
    ) -> Result<Vec<StoredFragment>, StoreError> {
        let shared = self.inner.shared.clone();
        let (store, journal) = (store.to_string(), journal.to_string());
        self.request(async move {
            let started = rotary_proto::clock::now();
            let listed = list_journal(&shared, &store, &journal).await;
            let stats = shared.stores_stats.of(&store);
            stats
                .listings
                .observe(rotary_proto::clock::elapsed(started));
            if listed.is_err() {
                stats.listing_errors.fetch_add(1, Ordering::Relaxed);
            }
            listed
        })
        .await
    }

    /// Streams `[from, fragment.end)` of a fragment, decompressed and
    /// SHA-1-verified, in chunks of at most `chunk_max` bytes over a
    /// bounded channel. If the whole fragment's SHA-1 does not match its
    /// name, the stream ends with an error instead of its last chunk, so a
    /// caller must not treat bytes as served until the stream ends cleanly.
    ///
    /// The stream is whole when it closes after a chunk that ends at
    /// `fragment.end`: that chunk is sent only once the fragment verified.
    /// A stream that closes short of it was cut off (the pool stopped).
    /// Errors: the store's (`Unavailable` is retryable), [`StoreError::Corrupt`]
    /// for an object that does not match its name, and
    /// [`StoreError::BadOffset`] if `from` is outside `[begin, end]`;
    /// `from == end` is an empty stream.
    pub fn read(
        &self,
        fragment: &StoredFragment,
        from: u64,
        chunk_max: usize,
    ) -> async_channel::Receiver<Result<HistoryChunk, StoreError>> {
        assert!(chunk_max > 0, "history chunks hold at least a byte");
        let (tx, rx) = async_channel::bounded(read::CHUNKS_AHEAD);
        if from < fragment.begin || from > fragment.end {
            let bad = StoreError::BadOffset {
                from,
                begin: fragment.begin,
                end: fragment.end,
            };
            let _ = tx.try_send(Err(bad));
            return rx;
        }
        if from == fragment.end {
            return rx; // `tx` drops: an empty, clean stream
        }
        let shared = self.inner.shared.clone();
        self.inner.handle.spawn(read::read_task(
            shared,
            fragment.clone(),
            from,
            chunk_max,
            tx,
        ));
        rx
    }

    /// The SHA-1 of a fragment's bytes `[from, to)`, read from its store
    /// and decompressed on the pool's threads. The whole fragment is read
    /// and checked against its name: one that does not match is
    /// [`StoreError::Corrupt`]. Comparing two fragments over their overlap
    /// takes one of these of each.
    pub async fn sha1_of_range(
        &self,
        fragment: &StoredFragment,
        from: u64,
        to: u64,
    ) -> Result<[u8; 20], StoreError> {
        assert!(
            fragment.begin <= from && from <= to && to <= fragment.end,
            "a range outside its fragment"
        );
        let rx = self.read(fragment, from, HASH_CHUNK_BYTES);
        let end = fragment.end;
        self.request(async move {
            use sha1::Digest;
            let mut hasher = sha1::Sha1::new();
            let mut at = from;
            while let Ok(chunk) = rx.recv().await {
                let chunk = chunk?;
                let upto = to
                    .saturating_sub(chunk.offset)
                    .min(chunk.bytes.len() as u64);
                hasher.update(&chunk.bytes[..upto as usize]);
                at = chunk.offset + chunk.bytes.len() as u64;
            }
            // A stream is whole only once its last chunk, which comes after
            // the fragment verified, reached the end.
            if at != end {
                return Err(StoreError::Stopped);
            }
            Ok(hasher.finalize().into())
        })
        .await
    }

    /// Where a client can read a fragment directly: a presigned GET URL
    /// valid for `ttl` (S3) or an absolute `file://` path.
    pub async fn locate(
        &self,
        fragment: &StoredFragment,
        ttl: std::time::Duration,
    ) -> Result<String, StoreError> {
        let shared = self.inner.shared.clone();
        let fragment = fragment.clone();
        self.request(async move { locate(&shared, &fragment, ttl).await })
            .await
    }

    /// Deletes a fragment object. Deleting an object that is already gone
    /// succeeds.
    pub async fn delete(&self, fragment: &StoredFragment) -> Result<(), StoreError> {
        let shared = self.inner.shared.clone();
        let fragment = fragment.clone();
        self.request(async move {
            let store = shared.store(&fragment.store)?;
            let path = store.path(&fragment.key)?;
            match store.object().delete(&path).await {
                Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
                Err(e) => Err(store.err(&fragment.key, e)),
            }
        })
        .await
    }

    /// Runs `work` on the pool's runtime and awaits its answer on an
    /// executor-agnostic channel: the caller's thread needs no tokio context.
    async fn request<T: Send + 'static>(
        &self,
        work: impl std::future::Future<Output = Result<T, StoreError>> + Send + 'static,
    ) -> Result<T, StoreError> {
        let (tx, rx) = async_channel::bounded(1);
        self.inner.handle.spawn(async move {
            let _ = tx.send(work.await).await;
        });
        rx.recv().await.unwrap_or(Err(StoreError::Stopped))
    }
}

/// The dispatcher thread: takes a permit, then a job, and runs the job on
/// the runtime. Taking the permit first keeps waiting jobs in the bounded
/// queue, where `try_upload` sees them.
fn dispatch(
    queue: crossbeam_channel::Receiver<UploadJob>,
    shared: Arc<Shared>,
    handle: tokio::runtime::Handle,
) {
    loop {
        let Ok(permit) = handle.block_on(shared.permits.clone().acquire_owned()) else {
            return; // the pool stopped
        };
        let Ok(job) = queue.recv() else {
            return; // every handle is gone
        };
        shared.metrics.in_flight.fetch_add(1, Ordering::AcqRel);
        shared.metrics.queued.fetch_sub(1, Ordering::AcqRel);
        let shared = shared.clone();
        handle.spawn(async move {
            run_job(&shared, job).await;
            drop(permit);
        });
    }
}

/// What an upload did.
enum Uploaded {
    /// Wrote the object and verified it.
    Written(StoredFragment),
    /// The object already existed.
    Existing(StoredFragment),
}

async fn run_job(shared: &Shared, job: UploadJob) {
    let started = rotary_proto::clock::now();
    let done = job.done.clone();
    let (journal, begin, end, sha1) = (job.journal.clone(), job.begin, job.end, job.sha1);
    let store = job.store.clone();
    let result = upload(shared, job).await;
    let metrics = &shared.metrics;
    let local_checked = matches!(result, Ok(Uploaded::Written(_)));
    let result = match result {
        Ok(Uploaded::Written(fragment)) => {
            metrics.uploads.fetch_add(1, Ordering::Relaxed);
            metrics
                .upload_bytes
                .fetch_add(end - begin, Ordering::Relaxed);
            metrics
                .upload_stored_bytes
                .fetch_add(fragment.size, Ordering::Relaxed);
            let took = rotary_proto::clock::elapsed(started);
            let micros = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
            metrics.upload_micros.fetch_add(micros, Ordering::Relaxed);
            shared.stores_stats.of(&store).uploads.observe(took);
            Ok(fragment)
        }
        Ok(Uploaded::Existing(fragment)) => {
            metrics.skipped_existing.fetch_add(1, Ordering::Relaxed);
            Ok(fragment)
        }
        Err(e) => {
            metrics.upload_failures.fetch_add(1, Ordering::Relaxed);
            Err(e)
        }
    };
    // A shard that has gone away no longer needs the answer.
    let _ = done
        .send(UploadDone {
            journal,
            begin,
            end,
            sha1,
            result,
            local_checked,
        })
        .await;
    metrics.in_flight.fetch_sub(1, Ordering::AcqRel);
}

async fn upload(shared: &Shared, job: UploadJob) -> Result<Uploaded, StoreError> {
    rotary_proto::spec::validate_journal_name(&job.journal).map_err(|e| {
        StoreError::BadJournal {
            journal: job.journal.clone(),
            why: e.to_string(),
        }
    })?;
    let store = shared.store(&job.store)?;
    let name = FragmentName {
        begin: job.begin,
        end: job.end,
        sha1: job.sha1,
        codec: job.codec,
    };
    let key = name.key(&job.journal);
    // Set once an object we wrote failed to verify: it is then ours and
    // wrong, not another writer's, and must be replaced rather than skipped.
    let mut overwrite = false;
    let mut attempt = 0;
    loop {
        let result = upload_attempt(&store, &job, &key, &mut overwrite).await;
        if result.is_err() {
            shared
                .stores_stats
                .of(&job.store)
                .upload_errors
                .fetch_add(1, Ordering::Relaxed);
        }
        match result {
            Err(e) if e.is_retryable() && attempt + 1 < UPLOAD_ATTEMPTS_MAX => {
                tracing::debug!(store = %job.store, %key, attempt, error = %e, "upload attempt failed; retrying");
                shared
                    .metrics
                    .upload_retries
                    .fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(UPLOAD_BACKOFF[attempt]).await;
                attempt += 1;
            }
            result => return result,
        }
    }
}

async fn upload_attempt(
    store: &Store,
    job: &UploadJob,
    key: &str,
    overwrite: &mut bool,
) -> Result<Uploaded, StoreError> {
    let path = store.path(key)?;
    let object = store.object();
    let stored = |size: u64, mod_time: SystemTime| StoredFragment {
        journal: job.journal.clone(),
        begin: job.begin,
        end: job.end,
        sha1: job.sha1,
        codec: job.codec,
        store: job.store.clone(),
        key: key.to_string(),
        size,
        mod_time,
    };
    if !*overwrite {
        // Content-addressed: an object of this name should hold these
        // bytes. It is read back before the local copy is let go, since
        // one that does not (written by hand, or damaged) would leave the
        // fragment nowhere: then it is replaced.
        match object.head(&path).await {
            Ok(meta) => match put::reads_back_as_named(store, job, key).await? {
                Ok(()) => {
                    return Ok(Uploaded::Existing(stored(
                        meta.size,
                        meta.last_modified.into(),
                    )))
                }
                Err(why) => {
                    tracing::warn!(store = %job.store, %key, why, "an object of the fragment's name holds other bytes; replacing it");
                    *overwrite = true;
                }
            },
            Err(object_store::Error::NotFound { .. }) => {}
            Err(e) => return Err(store.err(key, e)),
        }
    }
    // Each attempt reads and compresses the local file again: holding a
    // compressed fragment between attempts would hold all of it.
    let written = put::put_fragment(store, job, key).await?;
    match verify(store, job, key, written).await {
        Ok(meta) => Ok(Uploaded::Written(stored(
            meta.size,
            meta.last_modified.into(),
        ))),
        Err(e) => {
            if matches!(e, StoreError::VerifyFailed { .. }) {
                *overwrite = true;
                let _ = object.delete(&path).await;
            }
            Err(e)
        }
    }
}

/// Checks what was written: its size everywhere, and for a file store
/// (where reading back is cheap) that it decompresses to the named bytes.
async fn verify(
    store: &Store,
    job: &UploadJob,
    key: &str,
    written: u64,
) -> Result<object_store::ObjectMeta, StoreError> {
    let path = store.path(key)?;
    let failed = |why: String| StoreError::VerifyFailed {
        store: job.store.clone(),
        key: key.to_string(),
        why,
    };
    let meta = match store.object().head(&path).await {
        Ok(meta) => meta,
        Err(object_store::Error::NotFound { .. }) => {
            return Err(failed("not found after writing".into()))
        }
        Err(e) => return Err(store.err(key, e)),
    };
    if meta.size != written {
        return Err(failed(format!(
            "holds {} bytes, {written} were written",
            meta.size,
        )));
    }
    if let Backend::File(_) = store.backend {
        put::reads_back_as_named(store, job, key)
            .await?
            .map_err(failed)?;
    }
    Ok(meta)
}

/// Runs blocking work on the runtime's blocking threads.
async fn blocking<T: Send + 'static>(work: impl FnOnce() -> T + Send + 'static) -> T {
    match tokio::task::spawn_blocking(work).await {
        Ok(t) => t,
        Err(e) => std::panic::resume_unwind(e.into_panic()),
    }
}

async fn list_journal(
    shared: &Shared,
    store_url: &str,
    journal: &str,
) -> Result<Vec<StoredFragment>, StoreError> {
    rotary_proto::spec::validate_journal_name(journal).map_err(|e| StoreError::BadJournal {
        journal: journal.to_string(),
        why: e.to_string(),
    })?;
    let store = shared.store(store_url)?;
    let base = store.path(journal)?;
    let object = store.object();
    let top = object
        .list_with_delimiter(Some(&base))
        .await
        .map_err(|e| store.err(journal, e))?;
    let mut fragments = Vec::new();
    collect(&store, journal, top.objects, &mut fragments);
    let mut dirs = vec![base.clone()];
    for dir in top.common_prefixes {
        // Postfix directories only (see `name`): other directories hold
        // child journals.
        if !dir.filename().is_some_and(|d| d.contains('=')) {
            continue;
        }
        let postfixed = object
            .list_with_delimiter(Some(&dir))
            .await
            .map_err(|e| store.err(dir.as_ref(), e))?;
        collect(&store, journal, postfixed.objects, &mut fragments);
        dirs.push(dir);
    }
    if let Some(root) = store.url.file_dir() {
        let dirs: Vec<_> = dirs.iter().map(|d| root.join(d.as_ref())).collect();
        blocking(move || {
            for dir in dirs {
                remove_stale_staging(&dir, STAGING_STALE_AFTER);
            }
        })
        .await;
    }
    fragments.sort_by(|a, b| (a.begin, a.end, &a.key).cmp(&(b.begin, b.end, &b.key)));
    Ok(fragments)
}

/// A `file://` store writes each object into `<name>#<n>` and renames it
/// into place; a broker killed in between leaves that file behind, which
/// listings skip. Those of a journal's directories untouched this long are
/// removed when the journal is listed. A writer still at work on one gets
/// an error at its rename and uploads again.
pub const STAGING_STALE_AFTER: Duration = Duration::from_secs(3600);

/// Removes the staging files in `dir` (not below it) last modified more
/// than `age` ago; returns how many.
pub fn remove_stale_staging(dir: &std::path::Path, age: Duration) -> usize {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    let mut removed = 0;
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some((_, suffix)) = name.to_str().and_then(|n| n.rsplit_once('#')) else {
            continue;
        };
        if suffix.is_empty() || !suffix.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let Ok(meta) = entry.metadata() else {
            continue;
        };
        let stale = meta
            .modified()
            .ok()
            .and_then(|t| rotary_proto::clock::wall_elapsed(t).ok())
            .is_some_and(|e| e >= age);
        if meta.is_file() && stale {
            let path = entry.path();
            match std::fs::remove_file(&path) {
                Ok(()) => {
                    removed += 1;
                    tracing::info!(path = %path.display(), "removed an upload's stale staging file");
                }
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "cannot remove a stale staging file")
                }
            }
        }
    }
    removed
}

fn collect(
    store: &Store,
    journal: &str,
    objects: Vec<object_store::ObjectMeta>,
    out: &mut Vec<StoredFragment>,
) {
    for meta in objects {
        let Some(key) = store.key_of(&meta.location) else {
            continue;
        };
        let Some(rel) = key.strip_prefix(journal).and_then(|r| r.strip_prefix('/')) else {
            continue;
        };
        let Some(name) = name::journal_fragment(rel) else {
            continue;
        };
        out.push(StoredFragment {
            journal: journal.to_string(),
            begin: name.begin,
            end: name.end,
            sha1: name.sha1,
            codec: name.codec,
            store: store.url.as_str().to_string(),
            key: key.to_string(),
            size: meta.size,
            mod_time: meta.last_modified.into(),
        });
    }
}

async fn locate(
    shared: &Shared,
    fragment: &StoredFragment,
    ttl: Duration,
) -> Result<String, StoreError> {
    use object_store::signer::{Method, Signer};
    let store = shared.store(&fragment.store)?;
    let path = store.path(&fragment.key)?;
    match &store.backend {
        Backend::File(fs) => {
            let file = fs
                .path_to_filesystem(&path)
                .map_err(|e| store.err(&fragment.key, e))?;
            let url = url::Url::from_file_path(&file).map_err(|()| StoreError::BadJournal {
                journal: fragment.journal.clone(),
                why: format!("{} is not an absolute path", file.display()),
            })?;
            Ok(url.to_string())
        }
        Backend::S3(s3) => {
            let url = s3
                .signed_url(Method::GET, &path, ttl)
                .await
                .map_err(|e| store.err(&fragment.key, e))?;
            Ok(url.to_string())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::thread_nice as nice;

    #[test]
    fn uploader_threads_yield_to_shards() {
        let own = nice();
        let lower = (own + super::UPLOADER_NICENESS).min(19);
        let up = super::Uploader::start(2, 4);
        let handle = up.inner.handle.clone();
        let (worker, pool) = std::thread::spawn(move || {
            handle.block_on(async {
                // The pool thread is created from an uploader thread.
                tokio::spawn(async { (nice(), tokio::task::spawn_blocking(nice).await.unwrap()) })
                    .await
                    .unwrap()
            })
        })
        .join()
        .unwrap();
        assert_eq!(worker, lower, "a worker thread");
        assert_eq!(pool, lower, "a blocking-pool thread");
        assert_eq!(nice(), own, "only the uploader's threads");
    }
}
