//! A journal's fragment index: its local fragments and the ones listed
//! from its stores, and which one holds an offset.

use super::*;

/// The fragments the journal's stores hold, as listed and as this
/// broker's uploads confirmed them, and the state of its listings.
///
/// Written by the shard's history tasks (`shard/history.rs`: store
/// listings, upload results, prune and reset-head): the fragments through
/// `set_listing`, `insert_remote` and `drop_remote`, the listing state
/// directly. Elsewhere only recovery sets it up (`init`), a read
/// (`shard/read.rs`) drops an object it finds gone or corrupt
/// (`drop_remote`), and the tick (`shard/primary.rs`) lets the index go
/// (`forget`). Admission (`journal/admit.rs`), reads, the tick and admin
/// requests read it.
#[derive(Default)]
pub struct Index {
    /// Fragments listed from the journal's stores, by begin.
    remote: Vec<StoredFragment>,
    /// For each fragment of `remote`, the furthest end of it and those
    /// before it: [`Self::locate`] stops looking back where no earlier
    /// fragment reaches the offset.
    remote_reach: Vec<u64>,
    /// Objects found not to hold the bytes their names say (store, key):
    /// left out of every listing.
    corrupt: std::collections::HashSet<(String, String)>,
    /// Fragments this broker's uploads confirmed, with the count of
    /// confirmations so far: a listing that started before a confirmation
    /// must not drop it (the local copy may already be gone).
    confirmed: Vec<(u64, StoredFragment)>,
    confirmations: u64,
    /// A listing of every store succeeded at least once (always true for
    /// journals without stores). Appends wait for it: the store may hold
    /// offsets beyond the local head.
    pub(crate) loaded: bool,
    /// The last listing error, for operators and refusals.
    pub(crate) error: Option<String>,
    /// The index was let go (see [`Self::forget`]): the tick lists
    /// the journal again only once `refresh_interval` has passed, not
    /// every second as for a first listing.
    pub(crate) forgotten: bool,
    pub(crate) listings: Listings,
    /// Requests to move the write head to the end of the index, answered
    /// by `Shard::reset_head` (the flusher calls it).
    pub(crate) reset_waiters: Vec<(Rc<Outbox>, u64)>,
}

/// Where the listings of a journal's stores stand (written by the shard's
/// history tasks, and by [`Index::forget`]).
#[derive(Default)]
pub struct Listings {
    /// One is running.
    pub(crate) running: bool,
    /// Waiting in the shard's queue of listings (see
    /// `Shard::refresh_listing`).
    pub(crate) queued: bool,
    /// A request waits for the first listing, which was started ahead of
    /// the queue (see `Shard::hurry_first_listing`).
    pub(crate) hurried: bool,
    /// When the last one ended, or the index was let go (the next is due
    /// a refresh interval later).
    pub(crate) last: Option<Instant>,
}

impl Index {
    /// A journal without stores has its whole index locally.
    pub fn init(&mut self, has_stores: bool) {
        self.loaded = !has_stores;
    }

    /// The fragments listed from the stores, by begin.
    pub fn remote(&self) -> &[StoredFragment] {
        &self.remote
    }

    /// Lets the stores' index go, as a broker outside the journal's route
    /// may: it proxies the journal's reads and appends, so listing its
    /// stores every `refresh_interval` would only multiply the store's
    /// LISTs by the cluster's size. The journal returns to the state it
    /// has at a start: a request that needs the index (an append once the
    /// route holds this broker again, FRAGMENTS) waits for a fresh listing,
    /// so nothing uploaded meanwhile by its members is missed. Refused
    /// (false) while the broker holds any of the journal's bytes
    /// (`holds_bytes`): those are dropped or uploaded by the listings it
    /// still makes.
    pub fn forget(&mut self, holds_bytes: bool, has_stores: bool) -> bool {
        if holds_bytes || self.listings.running || !has_stores {
            return false;
        }
        self.loaded = false;
        self.error = None;
        self.forgotten = true;
        self.listings.hurried = false;
        self.listings.last = Some(crate::clock::now());
        self.remote = Vec::new();
        self.confirmed.clear();
        self.remote_changed();
        true
    }
    /// End of the furthest fragment the stores hold.
    pub fn remote_end(&self) -> u64 {
        self.remote_reach.last().copied().unwrap_or(0)
    }

    /// Adds a fragment the store confirmed, unless the index has it.
    pub fn insert_remote(&mut self, f: StoredFragment) {
        self.confirmations += 1;
        self.confirmed.push((self.confirmations, f.clone()));
        self.add_remote(f);
    }

    /// Where a listing starting now stands: pass it to [`Self::set_listing`].
    pub fn listing_mark(&self) -> u64 {
        self.confirmations
    }

    /// Adds a fragment this broker uploaded. Another object of the same
    /// span but other bytes (a deleted journal's of the same name) gives
    /// way to it: these are the bytes this broker committed.
    fn add_remote(&mut self, f: StoredFragment) {
        let at = self.remote.partition_point(|r| r.begin < f.begin);
        if let Some(r) = self.remote[at..]
            .iter_mut()
            .take_while(|r| r.begin == f.begin)
            .find(|r| r.end == f.end)
        {
            if r.sha1 != f.sha1 {
                *r = f;
            }
            return;
        }
        self.remote.insert(at, f);
        self.remote_changed();
    }

    /// Removes a fragment from the index: its object is gone (pruned), or
    /// does not hold the bytes its name says (`corrupt`), when later
    /// listings leave it out too.
    pub fn drop_remote(&mut self, f: &StoredFragment, corrupt: bool) {
        let same = |r: &StoredFragment| r.store == f.store && r.key == f.key;
        self.remote.retain(|r| !same(r));
        self.confirmed.retain(|(_, r)| !same(r));
        if corrupt {
            self.corrupt.insert((f.store.clone(), f.key.clone()));
        }
        self.remote_changed();
    }

    /// The end offset every append checks is kept, not recomputed: the
    /// index may hold thousands of fragments.
    fn remote_changed(&mut self) {
        let mut reach = 0;
        self.remote_reach.clear();
        self.remote_reach.extend(self.remote.iter().map(|f| {
            reach = reach.max(f.end);
            reach
        }));
    }

    /// Merges a fresh listing into the index: the listing replaces what
    /// was known from the stores, so objects removed from a store leave the
    /// log (local copies still serve their spans). Uploads confirmed after
    /// the listing started (`mark`, from [`Self::listing_mark`]) stay.
    /// Local `fragments` the listing shows uploaded are marked so.
    pub fn set_listing(
        &mut self,
        mut listed: Vec<StoredFragment>,
        mark: u64,
        fragments: &mut [LocalFragment],
    ) {
        listed.retain(|f| !self.corrupt.contains(&(f.store.clone(), f.key.clone())));
        // Of two objects of one span, the one holding the bytes of a local
        // fragment comes first and stays.
        let local = |f: &StoredFragment| {
            fragments
                .iter()
                .any(|l| l.begin == f.begin && l.end == f.end && l.sha1 == f.sha1)
        };
        listed.sort_by_key(|f| (f.begin, std::cmp::Reverse(f.end), !local(f)));
        listed.dedup_by(|b, a| a.begin == b.begin && a.end == b.end);
        for f in fragments.iter_mut() {
            if !f.uploaded
                && listed
                    .iter()
                    .any(|r| r.begin == f.begin && r.end == f.end && r.sha1 == f.sha1)
            {
                f.uploaded = true;
            }
        }
        self.remote = listed;
        self.confirmed.retain(|(n, _)| *n > mark);
        for (_, f) in self.confirmed.clone() {
            self.add_remote(f);
        }
        self.remote_changed();
    }

    /// Where `offset` can be read: local files first (sealed fragments,
    /// then the spool), then the stores, preferring the larger fragment.
    /// An offset in a gap of history resolves to the next span's start.
    /// `fragments`, `spool` and `head` are the journal's local files and
    /// the head readers may see.
    pub fn locate(
        &self,
        offset: u64,
        fragments: &[LocalFragment],
        spool: Option<(&Spool, Option<&str>)>,
        head: u64,
    ) -> Option<Located> {
        // Of the stores' fragments holding `at`, the one reaching furthest
        // (the last in the index of those reaching equally far). The index
        // is sorted by begin, and a journal's history may be hundreds of
        // thousands of fragments long: a read looks back only as far as
        // fragments reaching `at` can begin.
        let remote = |at: u64| -> Option<Located> {
            let mut found: Option<&StoredFragment> = None;
            let upto = self.remote.partition_point(|f| f.begin <= at);
            for i in (0..upto).rev() {
                if self.remote_reach[i] <= at {
                    break;
                }
                let f = &self.remote[i];
                if f.end > at && found.is_none_or(|b| f.end > b.end) {
                    found = Some(f);
                }
            }
            let f = found?;
            Some(Located {
                file: FileRef::Remote(f.clone()),
                offset: at,
                file_pos: at - f.begin,
                end: f.end,
            })
        };
        let local = |at: u64| -> Option<Located> {
            for f in fragments {
                if f.begin <= at && at < f.end {
                    if let Some(why) = &f.corrupt {
                        // A store's copy, if there is one; else the read
                        // fails here rather than serve wrong bytes.
                        return remote(at).or_else(|| {
                            Some(Located {
                                file: FileRef::Corrupt(format!("{}: {why}", f.path.display())),
                                offset: at,
                                file_pos: at - f.begin,
                                end: f.end,
                            })
                        });
                    }
                    let file = if f.verified {
                        FileRef::Fragment(f.path.clone(), f.file.clone())
                    } else {
                        FileRef::Unchecked(f.path.clone())
                    };
                    return Some(Located {
                        file,
                        offset: at,
                        file_pos: at - f.begin,
                        end: f.end,
                    });
                }
            }
            let (spool, changed) = spool?;
            // Bytes committed here but not yet acknowledged by every
            // replica are not readable.
            let end = spool.committed().min(head);
            if !(spool.begin() <= at && at < end) {
                return None;
            }
            let file = match changed {
                None => FileRef::Open(spool.file().clone()),
                // As for a corrupt fragment: a store's copy, or a refusal.
                Some(why) => match remote(at) {
                    Some(l) => return Some(l),
                    None => FileRef::Corrupt(why.to_string()),
                },
            };
            Some(Located {
                file,
                offset: at,
                file_pos: at - spool.begin(),
                end,
            })
        };
        if let Some(l) = local(offset).or_else(|| remote(offset)) {
            return Some(l);
        }
        // A gap: jump to the next span that exists.
        let next_remote = self
            .remote
            .get(self.remote.partition_point(|f| f.begin <= offset));
        let next = fragments
            .iter()
            .map(|f| f.begin)
            .chain(next_remote.map(|f| f.begin))
            .chain(spool.filter(|(s, _)| !s.is_empty()).map(|(s, _)| s.begin()))
            .filter(|&b| b > offset)
            .min()?;
        local(next).or_else(|| remote(next))
    }
}

impl Journal {
    /// A journal without stores has its whole index locally.
    pub fn init_index(&mut self) {
        let has_stores = self.has_stores();
        self.index.init(has_stores);
    }

    /// Lets the stores' index go (see [`Index::forget`]), unless the
    /// broker holds any of the journal's bytes.
    pub fn forget_index(&mut self) -> bool {
        let holds_bytes = !self.files.fragments.is_empty()
            || self.files.spool.as_ref().is_some_and(|s| !s.is_empty());
        let has_stores = self.has_stores();
        self.index.forget(holds_bytes, has_stores)
    }

    /// Merges a fresh listing into the index (see [`Index::set_listing`]).
    /// Readers waiting for bytes are woken: the index may now hold them.
    pub fn set_listing(&mut self, listed: Vec<StoredFragment>, mark: u64) {
        self.index
            .set_listing(listed, mark, &mut self.files.fragments);
        self.readers.committed.notify(usize::MAX);
    }

    /// Where `offset` can be read (see [`Index::locate`]).
    pub fn locate(&self, offset: u64) -> Option<Located> {
        let spool = self.files.spool.as_ref().map(|s| {
            let changed = self.files.spool_changed.as_ref();
            let why = changed.filter(|(begin, _)| *begin == s.begin());
            (s, why.map(|(_, why)| why.as_str()))
        });
        self.index
            .locate(offset, &self.files.fragments, spool, self.heads.head())
    }
}

pub enum FileRef {
    Open(Rc<compio::fs::File>),
    Fragment(PathBuf, Option<Rc<compio::fs::File>>),
    /// A local fragment found on disk at start whose bytes have not been
    /// checked against its name yet (see [`LocalFragment::verified`]): a
    /// read checks it whole first.
    Unchecked(PathBuf),
    Remote(StoredFragment),
    /// A local fragment known not to hold its bytes, and why.
    Corrupt(String),
}

pub struct Located {
    pub file: FileRef,
    pub offset: u64,
    pub file_pos: u64,
    pub end: u64,
}
