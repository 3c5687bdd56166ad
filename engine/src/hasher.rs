//! Hashes large appends' own SHA-1 off the shard's thread.
//!
//! A shard hashes every appended byte into the open fragment's running
//! SHA-1, and a client's append also into the append's own SHA-1, which
//! its reply carries. The two are independent streams. For a large append
//! the second one is hashed by a thread of the shard's own
//! (`rotary-hash-<n>`), which runs on the broker's other cores. A
//! journal's rate is then bound by one pass over its bytes on the shard's
//! core instead of two.
//!
//! An append is hashed on the shard until the next piece of it to stage
//! would take it to [`OFFLOAD_AFTER`] bytes; then its state moves to the
//! hasher, and that piece and every later one are sent there as shared
//! ranges of the received frames (no copy). An append that arrives in one
//! large frame is hashed there whole. When the append is whole the shard asks for the digest and the
//! reply waits for it, usually not at all: the hasher finishes long before
//! the spool write does.
//!
//! The bytes the hasher has not hashed yet are bounded: past its backlog
//! limit ([`BACKLOG_BYTES`] unless configured) the shard holds back
//! appends whose hashing is offloaded, and the hasher wakes it once it is
//! below a quarter of that. New appends are offloaded only below that
//! quarter too.

use rotary_storage::sha::Sha1;
use std::collections::HashMap;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;

/// An append smaller than this is hashed on the shard. Below it, handing the work over costs more than it saves (a
/// wake-up of another core is tens of microseconds here; hashing 256 KiB
/// takes about 150).
pub const OFFLOAD_AFTER: u64 = 256 << 10;
/// Bytes sent to the hasher and not yet hashed, above which the shard
/// holds back appends whose hashing is offloaded.
pub const BACKLOG_BYTES: usize = 32 << 20;

enum Job {
    Start {
        id: u64,
        sha: Sha1,
    },
    Bytes {
        id: u64,
        data: Arc<Vec<u8>>,
        range: Range<usize>,
    },
    Finish {
        id: u64,
        digest: async_channel::Sender<[u8; 20]>,
    },
    Forget {
        id: u64,
    },
}

/// A shard's hasher: its thread, and what the shard sees of it.
pub struct Hasher {
    jobs: crossbeam_channel::Sender<Job>,
    shared: Arc<Shared>,
    /// Tells the shard that held appends back that the hasher caught up.
    caught_up: async_channel::Receiver<()>,
    next_id: std::cell::Cell<u64>,
}

struct Shared {
    /// Bytes sent and not hashed yet.
    outstanding: AtomicUsize,
    /// Set while the shard holds appends back for the hasher.
    parked: AtomicBool,
    /// Past this many outstanding bytes offloaded appends wait ...
    max: usize,
    /// ... until they are below this.
    resume: usize,
}

impl Hasher {
    /// Starts shard `index`'s hasher thread, confined to `cores` (the
    /// broker's cores other than the shard's: on the shard's own core it
    /// would only take turns with it); any core if empty.
    pub fn start(index: u32, cores: Vec<usize>, backlog: usize) -> std::io::Result<Hasher> {
        let (jobs, rx) = crossbeam_channel::unbounded();
        let (wake, caught_up) = async_channel::bounded(1);
        let shared = Arc::new(Shared {
            outstanding: AtomicUsize::new(0),
            parked: AtomicBool::new(false),
            max: backlog.max(1),
            resume: (backlog / 4).max(1),
        });
        let theirs = shared.clone();
        std::thread::Builder::new()
            .name(format!("rotary-hash-{index}"))
            .spawn(move || {
                if !cores.is_empty() {
                    if let Err(e) = crate::sys::confine_current_thread(&cores) {
                        tracing::info!(error = %e, ?cores, "the append hasher runs unconfined");
                    }
                }
                run(rx, theirs, wake)
            })?;
        Ok(Hasher {
            jobs,
            shared,
            caught_up,
            next_id: std::cell::Cell::new(0),
        })
    }

    /// Moves an append's hashing to the hasher, from `sha` on.
    pub fn offload(&self, sha: Sha1) -> Offloaded {
        let id = self.next_id.get();
        self.next_id.set(id + 1);
        let hashed = sha.len();
        let _ = self.jobs.send(Job::Start { id, sha });
        Offloaded {
            id,
            hashed,
            jobs: self.jobs.clone(),
            shared: self.shared.clone(),
            finished: false,
        }
    }

    /// Whether the hasher is so far behind that offloaded appends must
    /// wait. When it is, the shard is woken through
    /// [`Hasher::caught_up`] once it has caught up.
    pub fn behind(&self) -> bool {
        if self.shared.outstanding.load(Ordering::SeqCst) < self.shared.max {
            return false;
        }
        self.shared.parked.store(true, Ordering::SeqCst);
        // The hasher may have caught up between the two loads; it then
        // did not see `parked`.
        if self.shared.outstanding.load(Ordering::SeqCst) < self.shared.resume {
            self.shared.parked.store(false, Ordering::SeqCst);
            return false;
        }
        true
    }

    /// Whether a new append may start offloading: not while the hasher is
    /// past a quarter of its backlog, so that it catches up.
    pub fn has_room(&self) -> bool {
        self.shared.outstanding.load(Ordering::Relaxed) < self.shared.resume
    }

    /// Fires after [`Hasher::behind`] said yes, once the hasher caught up.
    pub fn caught_up(&self) -> async_channel::Receiver<()> {
        self.caught_up.clone()
    }
}

/// An append whose SHA-1 the hasher holds. Dropped unfinished (the append
/// rolled back), it tells the hasher to forget it.
pub struct Offloaded {
    id: u64,
    /// Bytes of the append hashed or sent to be.
    hashed: u64,
    jobs: crossbeam_channel::Sender<Job>,
    shared: Arc<Shared>,
    finished: bool,
}

impl Offloaded {
    /// Hashes `data[range]` next.
    pub fn hash(&mut self, data: &Arc<Vec<u8>>, range: Range<usize>) {
        if range.is_empty() {
            return;
        }
        self.hashed += range.len() as u64;
        self.shared
            .outstanding
            .fetch_add(range.len(), Ordering::SeqCst);
        let _ = self.jobs.send(Job::Bytes {
            id: self.id,
            data: data.clone(),
            range,
        });
    }

    /// The append is whole: its digest arrives on the channel returned.
    pub fn finish(mut self) -> async_channel::Receiver<[u8; 20]> {
        self.finished = true;
        let (digest, rx) = async_channel::bounded(1);
        let _ = self.jobs.send(Job::Finish {
            id: self.id,
            digest,
        });
        rx
    }
}

impl Drop for Offloaded {
    fn drop(&mut self) {
        if !self.finished {
            let _ = self.jobs.send(Job::Forget { id: self.id });
        }
    }
}

/// The hasher thread: runs until its shard drops every sender.
fn run(rx: crossbeam_channel::Receiver<Job>, shared: Arc<Shared>, wake: async_channel::Sender<()>) {
    // A broker whose hasher is gone would leave appends unanswered; stop
    // it instead (what it acknowledged is on disk and recovered).
    struct AbortOnPanic;
    impl Drop for AbortOnPanic {
        fn drop(&mut self) {
            if std::thread::panicking() {
                tracing::error!("the append hasher failed; stopping the broker");
                std::process::abort();
            }
        }
    }
    let _guard = AbortOnPanic;
    let mut states: HashMap<u64, Sha1> = HashMap::new();
    for job in rx {
        match job {
            Job::Start { id, sha } => {
                states.insert(id, sha);
            }
            Job::Bytes { id, data, range } => {
                let len = range.len();
                if let Some(sha) = states.get_mut(&id) {
                    sha.update(&data[range]);
                }
                drop(data);
                let left = shared.outstanding.fetch_sub(len, Ordering::SeqCst) - len;
                if left < shared.resume && shared.parked.load(Ordering::SeqCst) {
                    shared.parked.store(false, Ordering::SeqCst);
                    let _ = wake.try_send(());
                }
            }
            Job::Finish { id, digest } => {
                if let Some(sha) = states.remove(&id) {
                    let _ = digest.try_send(sha.finalize());
                }
            }
            Job::Forget { id } => {
                states.remove(&id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reference(data: &[u8]) -> [u8; 20] {
        use sha1::Digest as _;
        sha1::Sha1::digest(data).into()
    }

    #[test]
    fn an_offloaded_append_hashes_to_the_digest_of_all_its_bytes() {
        let hasher = Hasher::start(0, Vec::new(), BACKLOG_BYTES).unwrap();
        let data: Vec<u8> = (0..3_000_000u32).map(|i| (i * 7 + i / 13) as u8).collect();
        let data = Arc::new(data);
        // Two appends interleaved, each begun on the shard.
        let mut a = Sha1::new();
        a.update(&data[..1000]);
        let mut b = Sha1::new();
        b.update(&data[..77]);
        let (mut a, mut b) = (hasher.offload(a), hasher.offload(b));
        // Another one rolled back midway.
        let mut c = hasher.offload(Sha1::new());
        c.hash(&data, 0..500_000);
        for (i, at) in (1000..3_000_000).step_by(100_000).enumerate() {
            a.hash(&data, at..(at + 100_000).min(3_000_000));
            if i < 10 {
                b.hash(&data, 77 + i * 1000..77 + (i + 1) * 1000);
            }
        }
        drop(c);
        let (a, b) = (a.finish(), b.finish());
        assert_eq!(a.recv_blocking().unwrap(), reference(&data[..]));
        assert_eq!(b.recv_blocking().unwrap(), reference(&data[..10_077]));
        assert_eq!(hasher.shared.outstanding.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn a_hasher_far_behind_holds_appends_back_and_says_when_it_caught_up() {
        let hasher = Hasher::start(0, Vec::new(), BACKLOG_BYTES).unwrap();
        assert!(!hasher.behind());
        assert!(hasher.has_room());
        // Pretend the hasher is far behind: nothing below it drains.
        hasher
            .shared
            .outstanding
            .fetch_add(BACKLOG_BYTES, Ordering::SeqCst);
        assert!(!hasher.has_room());
        assert!(hasher.behind());
        let caught_up = hasher.caught_up();
        assert!(caught_up.try_recv().is_err());
        // One real job brings it below the mark: the hasher says so.
        hasher
            .shared
            .outstanding
            .fetch_sub(BACKLOG_BYTES, Ordering::SeqCst);
        let data = Arc::new(vec![1u8; 4096]);
        let mut a = hasher.offload(Sha1::new());
        a.hash(&data, 0..4096);
        caught_up.recv_blocking().unwrap();
        assert_eq!(a.finish().recv_blocking().unwrap(), reference(&data[..]));
        assert!(!hasher.behind());
    }
}
