//! A journal's shard-local state: its spool, sealed local fragments, write
//! head, registers and the queue of appends waiting their turn, in structs
//! by the room of the shard that writes them.

mod admit;
mod files;
mod heads;
mod index;
mod primary;
mod queue;
mod rate;
mod readers;
mod replica;
mod tail;

pub use admit::{admit, Admission, AdmitRole, AdmitShard, Next};
pub use files::Files;
pub use heads::Heads;
pub use index::{FileRef, Index, Jump};
pub use primary::PrimaryState;
pub use queue::AppendQueue;
pub use rate::TokenBucket;
pub use readers::Readers;
pub use replica::ReplicaState;
pub use tail::{tail_window, TailCache};

use crate::metrics::{self, Metrics};
use crate::outbox::Outbox;
use rotary_net::spec::JournalSpec;
use rotary_storage::fragment::LocalFragment;
use rotary_storage::spool::Spool;
use rotary_uploader::StoredFragment;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

/// A failure that repeats (a replica down, a store unreachable) is logged
/// at most this often per journal.
pub const REPEAT_WARN_INTERVAL: Duration = Duration::from_secs(60);

/// Lets a message that may repeat every turn (a full disk fails each
/// batch) through once per [`REPEAT_WARN_INTERVAL`], counting the rest.
#[derive(Default)]
pub struct Repeated {
    last: Cell<Option<Instant>>,
    held: Cell<u64>,
}

impl Repeated {
    /// Some(number of occurrences held back since the last one let
    /// through) if this one is to be logged.
    pub fn due(&self) -> Option<u64> {
        if self
            .last
            .get()
            .is_some_and(|t| crate::clock::elapsed(t) < REPEAT_WARN_INTERVAL)
        {
            self.held.set(self.held.get() + 1);
            return None;
        }
        self.last.set(Some(crate::clock::now()));
        Some(self.held.replace(0))
    }
}

/// Work of a shard's journals that fails for many of them at once.
#[derive(Clone, Copy, Debug)]
pub enum SharedWork {
    /// Listing a fragment store; failures are keyed by the store's URL.
    Listing,
    /// Uploading to a fragment store; keyed likewise.
    Upload,
    /// Synchronizing with replicas; keyed by the replicas' ids.
    Sync,
    /// Replicating a batch; keyed by the id of the replica that failed it.
    Replication,
    /// Taking a primary's replicated records, as a replica; one key.
    Refusal,
}

/// Failures of work that journals share a cause of: a store that is down
/// fails every journal's listings and uploads, a broker that is down every
/// SYNC and batch replicated to it, a replica that restarted every
/// journal's next record. A line per journal would flood the log (tens of
/// thousands a minute on a broker of that many journals, just when its
/// disk fills with what it cannot upload). So the failures of one cause
/// are logged at most once per [`REPEAT_WARN_INTERVAL`] over a shard's
/// journals, with the count held back, and its recovery once after a
/// failure was logged.
#[derive(Default)]
pub struct SharedFailures {
    /// Per [`SharedWork`], by cause: its throttle, and whether a failure
    /// was logged since the last recovery was.
    by_cause: [RefCell<HashMap<String, (Repeated, bool)>>; 5],
}

impl SharedFailures {
    /// A failure of `work` from `cause`: Some(failures held back since the
    /// last one logged) if this one is to be logged.
    pub fn failed(&self, work: SharedWork, cause: &str) -> Option<u64> {
        let mut m = self.by_cause[work as usize].borrow_mut();
        let (repeated, logged) = m.entry(cause.to_string()).or_default();
        let due = repeated.due();
        *logged |= due.is_some();
        due
    }

    /// A success of `work` at `cause`: whether to log that it works again.
    pub fn worked(&self, work: SharedWork, cause: &str) -> bool {
        self.by_cause[work as usize]
            .borrow_mut()
            .get_mut(cause)
            .is_some_and(|(_, logged)| std::mem::take(logged))
    }
}

/// One journal's shard-local state, touched by its shard's thread only.
///
/// It is a few structs, each written by one room of the shard (its doc
/// comment says which, and which rooms only read it), so that a change to
/// one can be traced to the code that makes it. Cross-group operations
/// (locating an offset, merging a listing, the head setters that name the
/// journal in their assertions) are methods of `Journal` itself.
pub struct Journal {
    pub name: String,
    pub spec: JournalSpec,
    /// The journal was deleted: set once, by `Shard::delete_journal`
    /// (`shard/history.rs`), as it leaves the shard's journals.
    pub deleted: bool,
    /// The journal's files on this broker: its spool and sealed fragments.
    pub files: Files,
    /// The heads and registers: staged, committed here, visible.
    pub heads: Heads,
    /// The appends waiting their turn, and the one being staged.
    pub queue: AppendQueue,
    /// What the journal's primary keeps: its replicas and batches in flight.
    pub primary: PrimaryState,
    /// What the journal keeps as a replica of its primary's stream.
    pub replica: ReplicaState,
    /// Readers waiting at the head, and what is kept for them.
    pub readers: Readers,
    /// The stores' fragment index and its listings.
    pub index: Index,
}

impl Journal {
    pub fn new(spec: JournalSpec, dir: PathBuf) -> Journal {
        Journal {
            name: spec.name.clone(),
            queue: AppendQueue::new(spec.max_append_rate),
            spec,
            deleted: false,
            files: Files::new(dir),
            heads: Heads::default(),
            primary: PrimaryState::default(),
            replica: ReplicaState::default(),
            readers: Readers::default(),
            index: Index::default(),
        }
    }

    /// Sets every head to `offset`: a journal recovered from its files, its
    /// head reset, or a replica synced to its primary's head.
    pub fn set_heads(&mut self, offset: u64) {
        self.heads.set_heads(offset, &self.name);
    }

    /// The staged appends now end at `end`: an append was staged, or the
    /// staging of uncommitted appends was undone back to where one began
    /// (never below what is committed here).
    pub fn set_staged_head(&mut self, end: u64) {
        self.heads.set_staged_head(end, &self.name);
    }

    /// Undoes the staging of uncommitted appends: the staged head and
    /// registers go back to those committed here.
    pub fn unstage(&mut self) {
        self.heads.unstage(&self.name);
    }

    /// The commit log holds the staged appends up to `end`: committed here,
    /// if not yet on every replica. Commits only move forward.
    pub fn commit_local_to(&mut self, end: u64) {
        self.heads.commit_local_to(end, &self.name);
    }

    /// Batches committed here that the replicas did not acknowledge are
    /// taken back: what is committed and staged here goes back to what
    /// readers see, registers too.
    pub fn take_back_to_head(&mut self) {
        self.heads.take_back_to_head(&self.name);
    }

    /// Readers may see up to `end` (if not further already): committed
    /// here and on every replica.
    pub fn publish_to(&mut self, end: u64) {
        self.heads.publish_to(end, &self.name);
    }

    /// The journal's history up to `to` was taken over from earlier
    /// brokers: visible and committed up to there at least, with nothing
    /// staged beyond what is committed.
    pub fn take_over_to(&mut self, to: u64) {
        self.heads.take_over_to(to, &self.name);
    }

    /// Appenders were answered up to `end`, which was staged.
    pub fn answered_to(&mut self, end: u64) {
        self.heads.answered_to(end, &self.name);
    }

    /// The spool is back (or sealed into `fragments`): reads that waited
    /// for it go on.
    pub fn spool_back(&mut self) {
        self.files.spool_out = false;
        self.readers.committed.notify(usize::MAX);
    }

    pub fn has_stores(&self) -> bool {
        !self.spec.fragment.stores.is_empty()
    }

    /// The end of readable history: the write head, or further when the
    /// stores or local fragments hold more (before a head reset).
    pub fn read_head(&self) -> u64 {
        let local = self
            .files
            .fragments
            .iter()
            .map(|f| f.end)
            .max()
            .unwrap_or(0);
        self.heads.head().max(self.index.remote_end()).max(local)
    }

    /// Whether the open spool should seal before the next append starts.
    pub fn wants_seal(&self, now: SystemTime) -> bool {
        let Some(spool) = &self.files.spool else {
            return false;
        };
        if spool.is_empty() {
            return self.files.seal_requested;
        }
        if self.files.seal_requested || spool.len() >= self.spec.fragment.length {
            return true;
        }
        flush_boundary_crossed(
            self.files.spool_since,
            self.spec.fragment.flush_interval,
            now,
        )
    }
}

/// Whether a UTC multiple of `interval` lies between `since` and `now`.
pub fn flush_boundary_crossed(
    since: Option<SystemTime>,
    interval: Duration,
    now: SystemTime,
) -> bool {
    let Some(since) = since else { return false };
    if interval.is_zero() {
        return false;
    }
    let secs = |t: SystemTime| {
        t.duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs()
    };
    let iv = interval.as_secs().max(1);
    secs(now) / iv > secs(since) / iv
}

#[cfg(test)]
mod tests {
    use super::tail::{TAIL_CACHE_BYTES, TAIL_CACHE_MIN_BYTES, TAIL_CACHE_SHARD_BYTES};
    use super::*;

    fn journal() -> Journal {
        Journal::new(JournalSpec::new("a/b"), PathBuf::from("/nonexistent"))
    }

    /// The heads move as appends stage, commit and publish, and keep their
    /// order through each step.
    #[test]
    fn heads_move_in_order() {
        let mut j = journal();
        j.set_heads(100);
        j.set_staged_head(150);
        j.set_staged_head(180);
        j.answered_to(150);
        j.commit_local_to(150);
        j.publish_to(150);
        // Undone back to the commit point, no further.
        j.set_staged_head(150);
        assert_eq!(
            (j.heads.head(), j.heads.local_head(), j.heads.staged_head()),
            (150, 150, 150)
        );
        // A takeover of history up to 400 commits it here and stages nothing beyond.
        j.set_staged_head(200);
        j.take_over_to(400);
        assert_eq!(
            (j.heads.head(), j.heads.local_head(), j.heads.staged_head()),
            (400, 400, 400)
        );
        assert_eq!(j.heads.answered(), 150);
    }

    #[test]
    #[should_panic(expected = "heads out of order")]
    fn unstaging_below_the_commit_point_is_refused() {
        let mut j = journal();
        j.set_heads(100);
        j.set_staged_head(150);
        j.commit_local_to(150);
        j.set_staged_head(120);
    }

    #[test]
    #[should_panic(expected = "heads out of order")]
    fn publishing_what_is_not_committed_is_refused() {
        let mut j = journal();
        j.set_staged_head(50);
        j.publish_to(10);
    }

    #[test]
    #[should_panic(expected = "behind local_head")]
    fn a_commit_never_moves_back() {
        let mut j = journal();
        j.set_staged_head(50);
        j.commit_local_to(50);
        j.commit_local_to(40);
    }

    #[test]
    #[should_panic(expected = "beyond staged_head")]
    fn answers_never_run_ahead_of_staging() {
        let mut j = journal();
        j.set_staged_head(50);
        j.answered_to(60);
    }

    #[test]
    fn flush_boundaries_are_utc_multiples() {
        let t = |s: u64| SystemTime::UNIX_EPOCH + Duration::from_secs(s);
        let h = Duration::from_secs(3600);
        assert!(!flush_boundary_crossed(Some(t(3600)), h, t(7199)));
        assert!(flush_boundary_crossed(Some(t(3600)), h, t(7200)));
        assert!(flush_boundary_crossed(Some(t(7199)), h, t(7200)));
        assert!(!flush_boundary_crossed(None, h, t(99999)));
        assert!(!flush_boundary_crossed(
            Some(t(0)),
            Duration::ZERO,
            t(99999)
        ));
    }

    fn object(begin: u64, end: u64, sha: u8) -> StoredFragment {
        StoredFragment {
            journal: "a/b/c".into(),
            begin,
            end,
            sha1: [sha; 20],
            codec: rotary_net::spec::Codec::None,
            store: "file:///s/".into(),
            key: format!("a/b/c/{begin}-{end}-{sha}"),
            size: end - begin,
            mod_time: SystemTime::UNIX_EPOCH,
        }
    }

    /// A sealed fragment not yet uploaded.
    fn local(begin: u64, end: u64, sha: u8) -> LocalFragment {
        let path = PathBuf::from("/nonexistent/f");
        LocalFragment::file_at((begin, end), [sha; 20], path, true, SystemTime::UNIX_EPOCH)
    }

    fn shas(j: &Journal) -> Vec<(u64, u64, u8)> {
        j.index
            .remote()
            .iter()
            .map(|r| (r.begin, r.end, r.sha1[0]))
            .collect()
    }

    /// Two objects of one span (a journal deleted and created again): the
    /// index keeps the one holding this broker's bytes, whichever order
    /// the store lists them in; a corrupt object stays out of it.
    #[test]
    fn the_index_prefers_this_brokers_bytes_and_forgets_corrupt_objects() {
        let mut j = Journal::new(JournalSpec::new("a/b/c"), PathBuf::from("/nonexistent"));
        j.files.fragments.push(local(0, 8, 2));
        for listed in [
            vec![object(0, 8, 1), object(0, 8, 2)],
            vec![object(0, 8, 2), object(0, 8, 1)],
        ] {
            j.set_listing(listed, j.index.listing_mark());
            assert_eq!(shas(&j), [(0, 8, 2)]);
            assert!(j.files.fragments[0].uploaded);
        }
        // Without a local copy, an upload this broker confirmed wins over
        // an object listed before it.
        j.files.fragments.clear();
        j.set_listing(vec![object(8, 16, 1)], j.index.listing_mark());
        j.index.insert_remote(object(8, 16, 3));
        assert_eq!(shas(&j), [(8, 16, 3)]);
        // A corrupt object leaves the index for good; a pruned one comes
        // back if a store lists it again.
        let bad = object(8, 16, 3);
        j.index.drop_remote(&bad, true);
        let gone = object(16, 24, 4);
        j.set_listing(vec![bad.clone(), gone.clone()], j.index.listing_mark());
        assert_eq!(shas(&j), [(16, 24, 4)]);
        j.index.drop_remote(&gone, false);
        assert!(j.index.remote().is_empty());
        assert_eq!(j.index.remote_end(), 0);
        j.set_listing(vec![bad, gone], j.index.listing_mark());
        assert_eq!(shas(&j), [(16, 24, 4)]);
    }

    /// A broker outside the route lets the index go only while it holds
    /// none of the journal's bytes and no listing is under way; what it
    /// forgets is gone, and the journal waits for a listing again.
    #[test]
    fn an_index_is_let_go_only_by_a_broker_holding_no_bytes() {
        let mut spec = JournalSpec::new("a/b/c");
        let mut j = Journal::new(spec.clone(), PathBuf::from("/nonexistent"));
        j.init_index();
        assert!(!j.forget_index(), "nothing to forget without stores");
        spec.fragment.stores = vec!["file:///s/".into()];
        j.spec = spec;
        j.init_index();
        j.set_listing(
            vec![object(0, 8, 1), object(8, 16, 2)],
            j.index.listing_mark(),
        );
        j.index.loaded = true;
        j.index.listings.running = true;
        assert!(!j.forget_index(), "a listing is under way");
        j.index.listings.running = false;
        j.files.fragments.push(local(16, 24, 3));
        assert!(!j.forget_index(), "a local fragment is still to upload");
        assert!(j.index.loaded);
        assert_eq!(j.index.remote_end(), 16);
        j.files.fragments.clear();
        assert!(j.forget_index());
        assert!(!j.index.loaded && j.index.forgotten && j.index.listings.last.is_some());
        assert!(j.index.remote().is_empty());
        assert_eq!(j.index.remote_end(), 0);
        assert_eq!(j.read_head(), 0);
        // The next listing brings it back whole.
        j.set_listing(
            vec![object(0, 8, 1), object(8, 16, 2)],
            j.index.listing_mark(),
        );
        assert_eq!(shas(&j), [(0, 8, 1), (8, 16, 2)]);
        assert_eq!(j.index.remote_end(), 16);
    }

    /// Reads find, of the stores' fragments holding an offset, the one
    /// reaching furthest, and across a gap the next that begins, as a
    /// look at every fragment would; seeded, with fragments overlapping.
    #[test]
    fn located_store_fragments_match_a_look_at_every_one() {
        use rand::{Rng, SeedableRng};
        for seed in 0..20u64 {
            let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
            let mut j = Journal::new(JournalSpec::new("a/b/c"), PathBuf::from("/nonexistent"));
            let random = |rng: &mut rand::rngs::StdRng| {
                let begin = rng.gen_range(0..5_000u64);
                object(begin, begin + rng.gen_range(1..400), rng.gen_range(0..4))
            };
            let listed: Vec<_> = (0..rng.gen_range(1..300))
                .map(|_| random(&mut rng))
                .collect();
            j.set_listing(listed, j.index.listing_mark());
            for _ in 0..20 {
                j.index.insert_remote(random(&mut rng));
            }
            for _ in 0..10 {
                let i = rng.gen_range(0..j.index.remote().len());
                let f = j.index.remote()[i].clone();
                j.index.drop_remote(&f, false);
            }
            let want = |at: u64| -> Option<(String, u64)> {
                let holding = |at: u64| {
                    j.index
                        .remote()
                        .iter()
                        .filter(|f| f.begin <= at && at < f.end)
                        .max_by_key(|f| f.end)
                };
                match holding(at) {
                    Some(f) => Some((f.key.clone(), at)),
                    None => {
                        let next = j
                            .index
                            .remote()
                            .iter()
                            .map(|f| f.begin)
                            .filter(|&b| b > at)
                            .min()?;
                        holding(next).map(|f| (f.key.clone(), next))
                    }
                }
            };
            assert_eq!(
                j.index.remote_end(),
                j.index.remote().iter().map(|f| f.end).max().unwrap_or(0)
            );
            for at in 0..j.index.remote_end() + 2 {
                let got = j.locate(at).map(|l| match l.file {
                    FileRef::Remote(f) => {
                        assert_eq!(l.file_pos, l.offset - f.begin);
                        assert_eq!(l.end, f.end);
                        (f.key, l.offset)
                    }
                    _ => panic!("not a store's fragment"),
                });
                assert_eq!(got, want(at), "seed {seed}, offset {at}");
            }
        }
    }

    /// A local fragment found damaged is read from a store's copy of its
    /// span, or not at all; the fragments around it read as before.
    #[test]
    fn a_damaged_local_fragment_is_read_from_the_store_or_refused() {
        let mut j = Journal::new(JournalSpec::new("a/b/c"), PathBuf::from("/nonexistent"));
        for (begin, end) in [(0, 8), (8, 16)] {
            let path = PathBuf::from(format!("/nonexistent/{begin}"));
            j.files.fragments.push(local(begin, end, 2));
            j.files.fragments.last_mut().expect("pushed").path = path;
        }
        j.files.fragments[0].corrupt = Some("bytes hash to 00".into());
        let located = |j: &Journal, at: u64| {
            let l = j.locate(at).expect("located");
            let file = match l.file {
                FileRef::Corrupt(why) => format!("corrupt {why}"),
                FileRef::Fragment(path, _) => format!("local {}", path.display()),
                FileRef::Unchecked(path) => format!("unchecked {}", path.display()),
                FileRef::Remote(f) => format!("store {}-{}", f.begin, f.end),
                FileRef::Open(_) => "spool".into(),
            };
            (file, l.offset, l.file_pos, l.end)
        };
        assert_eq!(
            located(&j, 3),
            ("corrupt /nonexistent/0: bytes hash to 00".into(), 3, 3, 8)
        );
        assert_eq!(located(&j, 8), ("local /nonexistent/8".into(), 8, 0, 16));
        // Found on disk and not checked yet: the read checks it first.
        j.files.fragments[1].verified = false;
        assert_eq!(
            located(&j, 9),
            ("unchecked /nonexistent/8".into(), 9, 1, 16)
        );
        j.files.fragments[1].verified = true;
        j.set_listing(vec![object(0, 8, 2)], j.index.listing_mark());
        assert_eq!(located(&j, 3), ("store 0-8".into(), 3, 3, 8));
    }

    #[test]
    fn repeated_messages_pass_once_a_minute_with_a_count() {
        let r = Repeated::default();
        assert_eq!(r.due(), Some(0));
        assert_eq!(r.due(), None);
        assert_eq!(r.due(), None);
        r.last
            .set(crate::clock::now().checked_sub(REPEAT_WARN_INTERVAL));
        assert_eq!(r.due(), Some(2));
        assert_eq!(r.due(), None);
    }

    #[test]
    fn shared_failures_are_logged_per_cause_and_their_recovery_once() {
        let f = SharedFailures::default();
        let (a, b) = ("s3://a/", "s3://b/");
        assert!(!f.worked(SharedWork::Listing, a), "never failed");
        // The first failure of each store and kind is logged, the rest held.
        assert_eq!(f.failed(SharedWork::Listing, a), Some(0));
        assert_eq!(f.failed(SharedWork::Listing, a), None);
        assert_eq!(f.failed(SharedWork::Listing, b), Some(0));
        assert_eq!(f.failed(SharedWork::Upload, a), Some(0));
        // Its recovery is logged once; a failure right after is held, and
        // so is the recovery after that.
        assert!(f.worked(SharedWork::Listing, a));
        assert!(!f.worked(SharedWork::Listing, a));
        assert_eq!(f.failed(SharedWork::Listing, a), None);
        assert!(!f.worked(SharedWork::Listing, a));
        // A minute on, the next failure is logged with the count held back.
        f.by_cause[SharedWork::Listing as usize]
            .borrow()
            .get(a)
            .unwrap()
            .0
            .last
            .set(crate::clock::now().checked_sub(REPEAT_WARN_INTERVAL));
        assert_eq!(f.failed(SharedWork::Listing, a), Some(2));
        assert!(f.worked(SharedWork::Listing, a));
        assert!(f.worked(SharedWork::Upload, a));
        assert!(f.worked(SharedWork::Listing, b));
    }

    #[test]
    fn tail_cache_window() {
        let w = TAIL_CACHE_BYTES;
        let m = Arc::new(Metrics::default());
        let mut t = TailCache::default();
        t.push(100, b"abcdef", w, &m);
        assert_eq!(t.get(100, 103), Some(&b"abc"[..]));
        assert_eq!(t.get(102, 999), Some(&b"cdef"[..]));
        assert_eq!(t.get(99, 103), None, "before the window");
        assert_eq!(t.get(106, 999), None, "at its end");
        t.truncate(104);
        assert_eq!(t.get(100, 999), Some(&b"abcd"[..]));
        t.push(104, b"XY", w, &m);
        assert_eq!(t.get(103, 999), Some(&b"dXY"[..]));
        t.push(200, b"gap", w, &m);
        assert_eq!(t.get(104, 999), None);
        assert_eq!(t.get(200, 999), Some(&b"gap"[..]));
        let big = vec![7u8; TAIL_CACHE_BYTES + 10];
        t.push(203, &big, w, &m);
        t.push(t.end(), &big, w, &m);
        assert!(t.get(200, 999).is_none(), "trimmed from the front");
        assert_eq!(t.get(t.end() - 1, u64::MAX), Some(&[7u8][..]));
        assert!(t.capacity() <= 2 * w);
        t.truncate(0);
        assert_eq!(t.get(0, 10), None);
        // The gauge counts the buffer until the cache is dropped.
        assert_eq!(gauge(&m), t.capacity() as u64);
        drop(t);
        assert_eq!(gauge(&m), 0);
    }

    fn gauge(m: &Metrics) -> u64 {
        m.tail_cache_bytes
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Byte for byte against a model, with windows that change: the cache
    /// always holds the newest bytes of the run it was fed, at least the
    /// window's worth (or all of them), and never more than twice the
    /// window in its buffer.
    #[test]
    fn tail_cache_keeps_the_newest_bytes_within_its_window() {
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        let mut next = move |n: u64| {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng % n
        };
        let m = Arc::new(Metrics::default());
        let mut t = TailCache::default();
        let mut fed: Vec<u8> = Vec::new();
        let base = 1000u64;
        for step in 0..2000u64 {
            let window = [1usize << 10, 4 << 10, 16 << 10][(step / 500 % 3) as usize];
            let len = next(3 * window as u64) as usize + 1;
            let bytes: Vec<u8> = (0..len).map(|_| next(256) as u8).collect();
            t.push(base + fed.len() as u64, &bytes, window, &m);
            fed.extend_from_slice(&bytes);
            let end = base + fed.len() as u64;
            assert_eq!(t.end(), end);
            let held = (t.end() - t.begin) as usize;
            assert!(held >= window.min(fed.len()), "step {step}: {held} held");
            assert!(
                t.capacity() <= 2 * window,
                "step {step}: capacity {}",
                t.capacity()
            );
            let got = t.get(t.begin, end).expect("the window");
            assert!(got == &fed[fed.len() - held..], "step {step}: bytes differ");
        }
    }

    #[test]
    fn tail_windows_share_the_shards_budget() {
        assert_eq!(tail_window(0), TAIL_CACHE_BYTES);
        assert_eq!(tail_window(8), TAIL_CACHE_BYTES);
        assert_eq!(tail_window(100), TAIL_CACHE_SHARD_BYTES / 200);
        assert_eq!(tail_window(100_000), TAIL_CACHE_MIN_BYTES);
    }

    fn stored(begin: u64, end: u64) -> StoredFragment {
        StoredFragment {
            journal: "a/b".into(),
            begin,
            end,
            sha1: [begin as u8; 20],
            codec: rotary_net::spec::Codec::None,
            store: "file:///store/".into(),
            key: format!("a/b/{begin}-{end}"),
            size: end - begin,
            mod_time: SystemTime::UNIX_EPOCH,
        }
    }

    fn spans(j: &Journal) -> Vec<(u64, u64)> {
        j.index.remote().iter().map(|f| (f.begin, f.end)).collect()
    }

    #[test]
    fn a_listing_keeps_uploads_confirmed_after_it_started() {
        let mut j = Journal::new(JournalSpec::new("a/b"), PathBuf::from("/nonexistent"));
        j.index.insert_remote(stored(0, 10));
        let mark = j.index.listing_mark();
        // Confirmed while the listing runs; the listing does not show it.
        j.index.insert_remote(stored(10, 20));
        j.set_listing(vec![stored(0, 10)], mark);
        assert_eq!(spans(&j), [(0, 10), (10, 20)]);
        assert_eq!(j.read_head(), 20);
        assert!(j.locate(15).is_some());

        // A later listing is the truth: an object gone from the store
        // leaves the index, whatever was confirmed before it started.
        let mark = j.index.listing_mark();
        j.set_listing(vec![stored(10, 20)], mark);
        assert_eq!(spans(&j), [(10, 20)]);
        let mark = j.index.listing_mark();
        j.set_listing(Vec::new(), mark);
        assert!(spans(&j).is_empty());

        // A fragment dropped for bad bytes is not brought back either.
        let mark = j.index.listing_mark();
        j.index.insert_remote(stored(20, 30));
        j.index.drop_remote(&stored(20, 30), true);
        j.set_listing(Vec::new(), mark);
        assert!(spans(&j).is_empty());
    }

    #[test]
    fn token_bucket_admits_its_rate() {
        let now = crate::clock::now();
        let mut b = TokenBucket::new(1000);
        // One second of burst, then nothing until the bucket refills.
        assert_eq!(b.available(now), Ok(1000));
        b.take(600, now);
        assert_eq!(b.available(now), Ok(400));
        b.take(400, now);
        let wait = b.available(now).unwrap_err();
        assert!(
            wait >= Duration::from_micros(999) && wait <= Duration::from_micros(1001),
            "{wait:?}"
        );
        let later = now + Duration::from_millis(250);
        assert_eq!(b.available(later), Ok(250));
        // Charging nothing moves no token.
        b.take(0, later);
        assert_eq!(b.available(later), Ok(250));
        // Idle time refills no more than one second's worth.
        assert_eq!(b.available(later + Duration::from_secs(60)), Ok(1000));
        let mut free = TokenBucket::new(0);
        assert_eq!(free.available(now), Ok(u64::MAX));
        free.take(u64::MAX / 2, now);
        assert_eq!(free.available(now), Ok(u64::MAX));
    }

    #[test]
    #[should_panic(expected = "charged 2 bytes")]
    fn token_bucket_charges_no_more_than_it_holds() {
        let now = crate::clock::now();
        let mut b = TokenBucket::new(1);
        b.take(2, now);
    }
}
