//! A journal's fragment index: its local fragments and the ones listed
//! from its stores, and which one holds an offset.

use super::*;
use std::collections::HashSet;

/// An object of a store: (store URL, key).
pub type FragmentId = (String, String);

fn id_of(f: &StoredFragment) -> FragmentId {
    (f.store.clone(), f.key.clone())
}

/// A store fragment judged not to hold the journal's committed history,
/// and why (naming the fragment or local copy it disagrees with).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Conflict {
    pub fragment: StoredFragment,
    pub why: String,
}

/// What the broker holds of a journal locally: what [`judge`] trusts as
/// committed history when two store fragments disagree.
#[derive(Clone, Debug, Default)]
pub struct Evidence {
    /// Names `(begin, end, SHA-1)` of the sealed local fragments and of the
    /// uploads this broker confirmed since its last listing.
    pub held: Vec<(u64, u64, [u8; 20])>,
    /// Offsets from which the broker holds the history itself: each local
    /// fragment's begin, the spool's begin and the write head. A chain of
    /// store fragments that reaches one of them joins the history the
    /// broker serves from its own files.
    pub anchors: Vec<u64>,
    /// The broker is a member of the journal's current route: what it
    /// holds was committed under that route. Else nothing it holds counts
    /// (it may be a deposed primary), and every disagreement is disputed.
    pub trusted: bool,
}

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
    /// Fragments listed from the journal's stores that hold its history
    /// (or may: see `disputed`), by begin: the listing and the confirmed
    /// uploads as judged by [`judge`].
    remote: Vec<StoredFragment>,
    /// The last listing as the store gave it (corrupt objects left out):
    /// with `confirmed`, what [`judge`] looks at.
    listed: Vec<StoredFragment>,
    /// Listed fragments that overlap another one with other bytes and are
    /// not the journal's committed history (PROTOCOL §7, "Fragments that
    /// disagree"): never served, shown as conflicting, pruned.
    conflicting: Vec<Conflict>,
    /// Fragments of `remote` that disagree with another one where the
    /// broker cannot tell which holds the committed bytes, with a message
    /// naming both: reads of their spans are refused, nothing is pruned.
    disputed: HashMap<FragmentId, String>,
    /// Whether two objects' bytes agree over their overlap (the pair in
    /// order), as read from the store. Objects are named by their content,
    /// so an answer holds for as long as both exist.
    verdicts: HashMap<(FragmentId, FragmentId), bool>,
    /// Pairs whose comparison found one of them not to hold the bytes its
    /// name says: not compared again (a read of that object finds it out
    /// and drops it, PROTOCOL §7).
    uncompared: HashSet<(FragmentId, FragmentId)>,
    /// What the broker holds locally, as of the last listing (see
    /// [`Evidence`]).
    evidence: Evidence,
    /// Set by the shard before a listing is merged: the broker is outside
    /// the journal's route, and its local copies are not evidence of what
    /// was committed (it may be a deposed primary's).
    pub(crate) outside_route: bool,
    /// Conflicting fragments already logged and counted.
    noticed: HashSet<FragmentId>,
    /// Conflicting fragments found since [`Self::take_new_conflicts`] was
    /// last called.
    news: Vec<Conflict>,
    /// For each fragment of `remote`, the furthest end of it and those
    /// before it: [`Self::locate`] stops looking back where no earlier
    /// fragment reaches the offset.
    remote_reach: Vec<u64>,
    /// Objects found not to hold the bytes their names say (store, key):
    /// left out of every listing.
    corrupt: HashSet<FragmentId>,
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
    /// An append with an explicit offset asked for the head to move to
    /// this end of the index (Gazette's roll of the pipeline to an
    /// explicit offset): `Shard::reset_head` moves it once the queue is
    /// idle, and an append that finds the head still short of the same
    /// end is refused rather than asking again.
    pub(crate) reset_asked: Option<u64>,
    /// `reset_asked` is yet to be carried out.
    pub(crate) reset_pending: bool,
    /// The furthest end of a fragment this broker pruned: history below it
    /// that no fragment holds is gone on purpose, and reads jump it at
    /// once (see [`Jump::pruned`]).
    pruned_to: u64,
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
        self.listed = Vec::new();
        self.confirmed.clear();
        self.evidence = Evidence::default();
        self.remote_changed();
        true
    }
    /// End of the furthest fragment the stores hold.
    pub fn remote_end(&self) -> u64 {
        self.remote_reach.last().copied().unwrap_or(0)
    }

    /// Adds a fragment the store confirmed, unless the index has it.
    /// Another object of the same span but other bytes (a deleted
    /// journal's of the same name, or a deposed primary's) gives way to
    /// it: these are the bytes this broker committed.
    pub fn insert_remote(&mut self, f: StoredFragment) {
        self.confirmations += 1;
        self.confirmed.push((self.confirmations, f.clone()));
        self.evidence.held.push((f.begin, f.end, f.sha1));
        self.remote_changed();
    }

    /// Where a listing starting now stands: pass it to [`Self::set_listing`].
    pub fn listing_mark(&self) -> u64 {
        self.confirmations
    }

    /// Removes a fragment from the index: its object is gone (pruned), or
    /// does not hold the bytes its name says (`corrupt`), when later
    /// listings leave it out too.
    pub fn drop_remote(&mut self, f: &StoredFragment, corrupt: bool) {
        let same = |r: &StoredFragment| r.store == f.store && r.key == f.key;
        self.listed.retain(|r| !same(r));
        self.confirmed.retain(|(_, r)| !same(r));
        if corrupt {
            self.corrupt.insert(id_of(f));
        } else {
            self.pruned_to = self.pruned_to.max(f.end);
        }
        self.remote_changed();
    }

    /// Judges the listed and confirmed fragments again (see [`judge`]),
    /// then keeps the end offset every append checks rather than
    /// recompute it: the index may hold thousands of fragments.
    fn remote_changed(&mut self) {
        let candidates: Vec<StoredFragment> = self
            .listed
            .iter()
            .chain(self.confirmed.iter().map(|(_, f)| f))
            .filter(|f| !self.corrupt.contains(&id_of(f)))
            .cloned()
            .collect();
        let judged = judge(candidates, &self.evidence, &self.verdicts);
        for c in &judged.conflicting {
            if self.noticed.insert(id_of(&c.fragment)) {
                self.news.push(c.clone());
            }
        }
        self.remote = judged.remote;
        self.conflicting = judged.conflicting;
        self.disputed = judged.disputed;
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
    /// `evidence` is what the broker holds now, less the uploads it
    /// confirmed (added here).
    pub fn set_listing(
        &mut self,
        mut listed: Vec<StoredFragment>,
        mark: u64,
        fragments: &mut [LocalFragment],
        mut evidence: Evidence,
    ) {
        listed.retain(|f| !self.corrupt.contains(&id_of(f)));
        for f in fragments.iter_mut() {
            if !f.uploaded
                && listed
                    .iter()
                    .any(|r| r.begin == f.begin && r.end == f.end && r.sha1 == f.sha1)
            {
                f.uploaded = true;
            }
        }
        self.listed = listed;
        self.confirmed.retain(|(n, _)| *n > mark);
        evidence
            .held
            .extend(self.confirmed.iter().map(|(_, f)| (f.begin, f.end, f.sha1)));
        self.evidence = evidence;
        self.remote_changed();
    }

    /// Pairs of `listed` fragments whose bytes must be compared before
    /// they can be judged: they overlap, but not over the same span (where
    /// the names tell), and no answer is known. At most `max` of them.
    pub fn unchecked_pairs(
        &self,
        listed: &[StoredFragment],
        max: usize,
    ) -> Vec<(StoredFragment, StoredFragment)> {
        let mut sorted: Vec<&StoredFragment> = listed
            .iter()
            .filter(|f| !self.corrupt.contains(&id_of(f)))
            .collect();
        sorted.sort_by(|a, b| (a.begin, b.end, &a.key).cmp(&(b.begin, a.end, &b.key)));
        let mut out = Vec::new();
        for (a, b) in overlapping_pairs(&sorted) {
            let (a, b) = (sorted[a], sorted[b]);
            let same_span = a.begin == b.begin && a.end == b.end;
            let key = pair_key(a, b);
            if !same_span && !self.verdicts.contains_key(&key) && !self.uncompared.contains(&key) {
                out.push((a.clone(), b.clone()));
                if out.len() >= max {
                    break;
                }
            }
        }
        out
    }

    /// Records whether `a` and `b` hold the same bytes over their overlap.
    pub fn record_verdict(&mut self, a: &StoredFragment, b: &StoredFragment, agree: bool) {
        self.verdicts.insert(pair_key(a, b), agree);
    }

    /// Gives up comparing `a` and `b`: one of them is corrupt.
    pub fn give_up_pair(&mut self, a: &StoredFragment, b: &StoredFragment) {
        self.uncompared.insert(pair_key(a, b));
    }

    /// The listed fragments judged not to be the journal's history.
    pub fn conflicting(&self) -> &[Conflict] {
        &self.conflicting
    }

    /// Why reads of `f`'s span are refused, if they are.
    pub fn disputed(&self, f: &StoredFragment) -> Option<&str> {
        if self.disputed.is_empty() {
            return None;
        }
        self.disputed.get(&id_of(f)).map(String::as_str)
    }

    /// Conflicting fragments found since the last call, each once: for
    /// the shard to log and count.
    pub fn take_new_conflicts(&mut self) -> Vec<Conflict> {
        std::mem::take(&mut self.news)
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
        let remote = |at: u64| self.remote_at(at);
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
                                jumped: None,
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
                        jumped: None,
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
                jumped: None,
            })
        };
        if let Some(l) = local(offset).or_else(|| remote(offset)) {
            return Some(l);
        }
        // A gap: the next span that exists, and when it was written (the
        // reader decides whether the gap is old enough to jump).
        let (next, written) = self.next_span(offset, fragments, spool)?;
        let mut l = local(next).or_else(|| remote(next))?;
        assert!(l.offset > offset, "a jump goes forward");
        l.jumped = Some(Jump {
            from: offset,
            written,
            pruned: next <= self.pruned_to,
        });
        Some(l)
    }
}

impl Index {
    /// The first span beginning after `offset` (a local fragment, a store
    /// fragment, or the open spool), and when it was written (`None`: the
    /// open spool, being written now).
    fn next_span(
        &self,
        offset: u64,
        fragments: &[LocalFragment],
        spool: Option<(&Spool, Option<&str>)>,
    ) -> Option<(u64, Option<std::time::SystemTime>)> {
        let next_remote = self
            .remote
            .get(self.remote.partition_point(|f| f.begin <= offset));
        let locals = fragments.iter().map(|f| (f.begin, Some(f.sealed_at)));
        let open = spool
            .filter(|(s, _)| !s.is_empty())
            .map(|(s, _)| (s.begin(), None));
        locals
            .chain(next_remote.map(|f| (f.begin, Some(f.mod_time))))
            .chain(open)
            .filter(|&(b, _)| b > offset)
            .min_by_key(|&(b, _)| b)
    }
}

impl Index {
    /// Of the stores' fragments holding `at`, the one reaching furthest
    /// (the last in the index of those reaching equally far). The index
    /// is sorted by begin, and a journal's history may be hundreds of
    /// thousands of fragments long: a read looks back only as far as
    /// fragments reaching `at` can begin.
    fn remote_at(&self, at: u64) -> Option<Located> {
        let mut found: Option<&StoredFragment> = None;
        let mut disputed = None;
        let upto = self.remote.partition_point(|f| f.begin <= at);
        for i in (0..upto).rev() {
            if self.remote_reach[i] <= at {
                break;
            }
            let f = &self.remote[i];
            if f.end > at {
                disputed = disputed.or_else(|| self.disputed(f));
                if found.is_none_or(|b| f.end > b.end) {
                    found = Some(f);
                }
            }
        }
        let f = found?;
        if let Some(why) = disputed {
            // Two fragments here disagree and nothing tells which is
            // committed: refused, never a guess.
            return Some(Located {
                file: FileRef::Corrupt(why.to_string()),
                offset: at,
                file_pos: at - f.begin,
                end: f.end,
                jumped: None,
            });
        }
        Some(Located {
            file: FileRef::Remote(f.clone()),
            offset: at,
            file_pos: at - f.begin,
            end: f.end,
            jumped: None,
        })
    }
}

/// What [`judge`] made of a journal's store fragments.
#[derive(Debug, Default)]
pub struct Judgement {
    /// The fragments that hold (or, if disputed, may hold) the journal's
    /// history, by begin.
    pub remote: Vec<StoredFragment>,
    /// The fragments that do not.
    pub conflicting: Vec<Conflict>,
    /// Fragments of `remote` that disagree with another one of it, with a
    /// message naming both.
    pub disputed: HashMap<FragmentId, String>,
}

/// The key of a verdict on two objects, whichever order they come in.
fn pair_key(a: &StoredFragment, b: &StoredFragment) -> (FragmentId, FragmentId) {
    let (x, y) = (id_of(a), id_of(b));
    if x <= y {
        (x, y)
    } else {
        (y, x)
    }
}

/// The pairs `(i, j)`, `i < j`, of fragments sorted by begin whose spans
/// overlap. A history without overlaps costs one look per fragment.
fn overlapping_pairs(sorted: &[&StoredFragment]) -> Vec<(usize, usize)> {
    debug_assert!(sorted.windows(2).all(|w| w[0].begin <= w[1].begin));
    let mut out = Vec::new();
    for (i, a) in sorted.iter().enumerate() {
        for (j, b) in sorted.iter().enumerate().skip(i + 1) {
            if b.begin >= a.end {
                break;
            }
            out.push((i, j));
        }
    }
    out
}

/// Rule 1 of [`judge`] by names alone: each fragment over the span of a
/// copy the broker holds, with another SHA-1, and why.
fn losing_to_held(candidates: &[StoredFragment], evidence: &Evidence) -> Vec<Option<String>> {
    candidates
        .iter()
        .map(|f| {
            if !evidence.trusted {
                return None;
            }
            let mut same_span = evidence
                .held
                .iter()
                .filter(|&&(b, e, _)| b == f.begin && e == f.end);
            if same_span.clone().any(|&(_, _, s)| s == f.sha1) {
                return None;
            }
            same_span.next().map(|(b, e, s)| {
                format!(
                    "holds other bytes than this broker's copy of [{b}, {e}) (SHA-1 {})",
                    hex::encode(s)
                )
            })
        })
        .collect()
}

/// Which fragments (sorted by begin) a chain links to the history the
/// broker holds (rule 2 of [`judge`]), passing over those already losing:
/// looked at from the last begin back, so a fragment's successors are
/// known before it is.
fn anchored(
    candidates: &[StoredFragment],
    losing: &[Option<String>],
    evidence: &Evidence,
) -> Vec<bool> {
    let mut points: HashSet<u64> = HashSet::new();
    if evidence.trusted {
        points.extend(evidence.anchors.iter().copied());
    }
    let mut anchored = vec![false; candidates.len()];
    for (i, f) in candidates.iter().enumerate().rev() {
        if losing[i].is_none() && points.contains(&f.end) {
            anchored[i] = true;
            points.insert(f.begin);
        }
    }
    anchored
}

/// Judges a journal's store fragments (the listing and the uploads this
/// broker confirmed): which hold its committed history. The rule is
/// PROTOCOL §7's "Fragments that disagree":
///
/// Two fragments that overlap disagree when their bytes differ over the
/// overlap: over the same span, when their SHA-1s differ; otherwise when
/// the bytes read from the store differ (`verdicts`; a pair not compared
/// yet is taken to agree until it is). Committed history is one sequence
/// of bytes, so at most one of the two holds it. Of the two:
///
/// 1. one whose span and SHA-1 are those of a copy the broker holds
///    (`evidence.held`) holds it, and a fragment over a held copy's span
///    with another SHA-1 never does;
/// 2. else one from whose end a chain of fragments, each beginning where
///    the last ends, reaches an offset from which the broker holds the
///    history itself (`evidence.anchors`: its local fragments, its spool,
///    its write head) holds it, when the other's does not;
/// 3. else neither is known to: both are disputed.
///
/// Evidence counts only from a member of the journal's route.
/// The same bytes under two names (two stores, two codecs) are one.
pub fn judge(
    mut candidates: Vec<StoredFragment>,
    evidence: &Evidence,
    verdicts: &HashMap<(FragmentId, FragmentId), bool>,
) -> Judgement {
    candidates.sort_by(|a, b| {
        (a.begin, b.end, a.sha1, &a.store, &a.key).cmp(&(b.begin, a.end, b.sha1, &b.store, &b.key))
    });
    candidates.dedup_by(|b, a| a.begin == b.begin && a.end == b.end && a.sha1 == b.sha1);
    let trusted = evidence.trusted;
    let held = |f: &StoredFragment| {
        trusted
            && evidence
                .held
                .iter()
                .any(|&(b, e, s)| b == f.begin && e == f.end && s == f.sha1)
    };
    let mut losing = losing_to_held(&candidates, evidence);
    let anchored = anchored(&candidates, &losing, evidence);
    let refs: Vec<&StoredFragment> = candidates.iter().collect();
    let differing: Vec<(usize, usize)> = overlapping_pairs(&refs)
        .into_iter()
        .filter(|&(i, j)| {
            let (a, b) = (refs[i], refs[j]);
            if a.begin == b.begin && a.end == b.end {
                a.sha1 != b.sha1
            } else {
                verdicts.get(&pair_key(a, b)) == Some(&false)
            }
        })
        .collect();
    // A fragment that lost to one pair's rule is out of every other pair:
    // decided until nothing changes (each round decides one more, or ends).
    loop {
        let mut changed = false;
        for &(i, j) in &differing {
            if losing[i].is_some() || losing[j].is_some() {
                continue;
            }
            let (a, b) = (refs[i], refs[j]);
            let (winner, loser, reason) = if held(a) != held(b) {
                let (w, l) = if held(a) { (i, j) } else { (j, i) };
                (w, l, "holds the bytes of this broker's own copy")
            } else if anchored[i] != anchored[j] {
                let (w, l) = if anchored[i] { (i, j) } else { (j, i) };
                (w, l, "chains to the history this broker holds")
            } else {
                continue;
            };
            let (lo, hi) = (a.begin.max(b.begin), a.end.min(b.end));
            losing[loser] = Some(format!(
                "holds other bytes than {}{} over [{lo}, {hi}), which {reason}",
                refs[winner].store, refs[winner].key
            ));
            changed = true;
        }
        if !changed {
            break;
        }
    }
    let mut disputed = HashMap::new();
    for &(i, j) in &differing {
        if losing[i].is_some() || losing[j].is_some() {
            continue;
        }
        let (a, b) = (refs[i], refs[j]);
        let (lo, hi) = (a.begin.max(b.begin), a.end.min(b.end));
        let why = format!(
            "store fragments {}{} and {}{} hold different bytes over [{lo}, {hi}), and this broker \
             cannot tell which holds the journal's committed history; neither is served",
            a.store, a.key, b.store, b.key
        );
        disputed.entry(id_of(a)).or_insert_with(|| why.clone());
        disputed.entry(id_of(b)).or_insert(why);
    }
    let mut out = Judgement {
        disputed,
        ..Judgement::default()
    };
    for (f, lost) in candidates.into_iter().zip(losing) {
        match lost {
            Some(why) => out.conflicting.push(Conflict { fragment: f, why }),
            None => out.remote.push(f),
        }
    }
    out
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
        let evidence = self.evidence();
        self.index
            .set_listing(listed, mark, &mut self.files.fragments, evidence);
        self.readers.committed.notify(usize::MAX);
    }

    /// What the broker holds of the journal, as [`judge`] weighs it.
    fn evidence(&self) -> Evidence {
        let fragments = &self.files.fragments;
        let spool = self.files.spool.as_ref().map(|s| s.begin());
        Evidence {
            held: fragments.iter().map(|f| (f.begin, f.end, f.sha1)).collect(),
            anchors: fragments
                .iter()
                .map(|f| f.begin)
                .chain(spool)
                .chain([self.heads.head()])
                .collect(),
            trusted: !self.index.outside_route,
        }
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

/// A read's jump over a gap in the history: from the offset asked for to
/// [`Located::offset`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Jump {
    pub from: u64,
    /// When the span after the gap was written (sealed, or stored); `None`
    /// for the open spool, which is being written now.
    pub written: Option<std::time::SystemTime>,
    /// The gap lies below what this broker pruned: gone on purpose.
    pub pruned: bool,
}

impl Jump {
    /// Whether the gap is old enough at `now` to be taken as permanent:
    /// the span after it was written `age` or longer ago.
    pub fn is_permanent(&self, now: std::time::SystemTime, age: std::time::Duration) -> bool {
        if age.is_zero() || self.pruned {
            return true;
        }
        self.written
            .is_some_and(|w| now.duration_since(w).is_ok_and(|d| d >= age))
    }

    /// How long until the gap is permanent (zero if it is already);
    /// `None` while the span after it is still being written.
    pub fn permanent_in(
        &self,
        now: std::time::SystemTime,
        age: std::time::Duration,
    ) -> Option<std::time::Duration> {
        let written = self.written?;
        let old = now.duration_since(written).unwrap_or_default();
        Some(age.saturating_sub(old))
    }
}

pub struct Located {
    pub file: FileRef,
    pub offset: u64,
    pub file_pos: u64,
    pub end: u64,
    /// Set when no span holds the offset asked for and this is the next
    /// one after the gap.
    pub jumped: Option<Jump>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gap_is_permanent_once_old_enough_or_pruned() {
        use std::time::{Duration, SystemTime};
        let t0 = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        let hour = Duration::from_secs(3600);
        let jump = |written, pruned| Jump {
            from: 0,
            written,
            pruned,
        };
        let young = jump(Some(t0), false);
        assert!(!young.is_permanent(t0 + hour, 6 * hour));
        assert_eq!(young.permanent_in(t0 + hour, 6 * hour), Some(5 * hour));
        assert!(young.is_permanent(t0 + 6 * hour, 6 * hour));
        assert!(young.is_permanent(t0, Duration::ZERO), "zero jumps at once");
        let open = jump(None, false);
        assert!(
            !open.is_permanent(t0 + 100 * hour, hour),
            "the spool is being written"
        );
        assert_eq!(open.permanent_in(t0, hour), None);
        assert!(
            jump(Some(t0), true).is_permanent(t0, 6 * hour),
            "pruned on purpose"
        );
    }

    /// A store object of `[begin, end)` whose bytes are named by `tag`.
    fn obj(begin: u64, end: u64, tag: u8) -> StoredFragment {
        StoredFragment {
            journal: "j".into(),
            begin,
            end,
            sha1: [tag; 20],
            codec: rotary_net::spec::Codec::None,
            store: "file:///s/".into(),
            key: format!("j/{begin}-{end}-{}", tag as char),
            size: end - begin,
            mod_time: std::time::SystemTime::UNIX_EPOCH,
        }
    }

    fn evidence(held: &[&StoredFragment], anchors: &[u64]) -> Evidence {
        Evidence {
            held: held.iter().map(|f| (f.begin, f.end, f.sha1)).collect(),
            anchors: anchors.to_vec(),
            trusted: true,
        }
    }

    fn listed(index: &mut Index, fragments: &[&StoredFragment], ev: Evidence) {
        let all = fragments.iter().map(|f| (*f).clone()).collect();
        index.set_listing(all, index.listing_mark(), &mut [], ev);
    }

    /// What a read at `at` is given: a store object's key, or a refusal.
    fn read_at(index: &Index, at: u64) -> Option<String> {
        index.locate(at, &[], None, 0).map(|l| match l.file {
            FileRef::Remote(f) => f.key,
            FileRef::Corrupt(why) => format!("refused: {why}"),
            _ => panic!("not a store's fragment"),
        })
    }

    fn keys(conflicts: &[Conflict]) -> Vec<&str> {
        conflicts.iter().map(|c| c.fragment.key.as_str()).collect()
    }

    /// Over the span of a copy the broker holds, the object with that
    /// copy's SHA-1 is the history; one with another SHA-1 is conflicting,
    /// whichever order the store lists them in, and is never read.
    #[test]
    fn a_copy_the_broker_holds_decides_between_objects_of_one_span() {
        let (a, b, y) = (obj(0, 4, b'A'), obj(4, 8, b'B'), obj(4, 8, b'Y'));
        for order in [[&a, &b, &y], [&y, &b, &a]] {
            let mut index = Index::default();
            listed(&mut index, &order, evidence(&[&b], &[8]));
            assert_eq!(keys(index.conflicting()), ["j/4-8-Y"]);
            assert!(index.conflicting()[0]
                .why
                .contains("this broker's copy of [4, 8)"));
            assert_eq!(read_at(&index, 5).as_deref(), Some("j/4-8-B"));
            assert_eq!(index.remote_end(), 8);
            let news = index.take_new_conflicts();
            assert_eq!(keys(&news), ["j/4-8-Y"]);
            // Found once: a later listing does not report it again.
            listed(&mut index, &order, evidence(&[&b], &[8]));
            assert!(index.take_new_conflicts().is_empty());
            assert_eq!(keys(index.conflicting()), ["j/4-8-Y"]);
        }
    }

    /// A larger fragment that disagrees with the chain of fragments that
    /// reaches the write head is conflicting: reads, which prefer larger
    /// fragments, read the chain. Until its bytes were compared it is
    /// taken to agree, and the pairs to compare are named.
    #[test]
    fn the_chain_that_reaches_the_head_decides() {
        let (a, b, c, x) = (
            obj(0, 4, b'A'),
            obj(4, 8, b'B'),
            obj(8, 12, b'C'),
            obj(4, 10, b'X'),
        );
        let all = [&a, &b, &c, &x];
        let mut index = Index::default();
        listed(&mut index, &all, evidence(&[], &[12]));
        assert!(index.conflicting().is_empty());
        assert_eq!(read_at(&index, 5).as_deref(), Some("j/4-10-X"));
        let owned: Vec<StoredFragment> = all.iter().map(|f| (*f).clone()).collect();
        let pairs: Vec<(String, String)> = index
            .unchecked_pairs(&owned, 10)
            .into_iter()
            .map(|(p, q)| (p.key, q.key))
            .collect();
        assert_eq!(
            pairs,
            [
                ("j/4-10-X".to_string(), "j/4-8-B".to_string()),
                ("j/4-10-X".to_string(), "j/8-12-C".to_string())
            ]
        );
        assert_eq!(index.unchecked_pairs(&owned, 1).len(), 1);
        index.record_verdict(&x, &b, false);
        index.record_verdict(&c, &x, false);
        assert!(index.unchecked_pairs(&owned, 10).is_empty());
        listed(&mut index, &all, evidence(&[], &[12]));
        assert_eq!(keys(index.conflicting()), ["j/4-10-X"]);
        let why = &index.conflicting()[0].why;
        assert!(
            why.contains("file:///s/j/4-8-B") && why.contains("[4, 8)"),
            "{why}"
        );
        for (at, key) in [(0, "j/0-4-A"), (5, "j/4-8-B"), (9, "j/8-12-C")] {
            assert_eq!(read_at(&index, at).as_deref(), Some(key), "at {at}");
        }
        // Not history: it does not count in the index's end either.
        let beyond = obj(8, 40, b'Z');
        index.record_verdict(&beyond, &c, false);
        listed(&mut index, &[&a, &b, &c, &x, &beyond], evidence(&[], &[12]));
        assert_eq!(keys(index.conflicting()), ["j/4-10-X", "j/8-40-Z"]);
        assert_eq!(index.remote_end(), 12);
    }

    /// Fragments that overlap with equal bytes (a larger one and those it
    /// holds) are history alike; the larger one serves.
    #[test]
    fn overlapping_fragments_that_agree_are_history() {
        let (a, b, ab) = (obj(0, 4, b'A'), obj(4, 8, b'B'), obj(0, 8, b'W'));
        let mut index = Index::default();
        index.record_verdict(&a, &ab, true);
        index.record_verdict(&b, &ab, true);
        listed(&mut index, &[&a, &b, &ab], evidence(&[], &[8]));
        assert!(index.conflicting().is_empty());
        assert_eq!(index.remote().len(), 3);
        assert_eq!(read_at(&index, 1).as_deref(), Some("j/0-8-W"));
        // The same bytes under two names (another store) are one.
        let copy = StoredFragment {
            store: "file:///t/".into(),
            ..b.clone()
        };
        listed(&mut index, &[&a, &b, &copy], evidence(&[], &[8]));
        assert!(index.conflicting().is_empty());
        assert_eq!(index.remote().len(), 2);
    }

    /// Where nothing tells which of two fragments is committed (both
    /// chain to the head, no copy is held), neither is served: a read of
    /// their span is refused naming both, and neither is conflicting, so
    /// nothing is pruned. Reads elsewhere go on.
    #[test]
    fn undecided_fragments_are_refused_not_guessed() {
        let (a, b, y, c) = (
            obj(0, 4, b'A'),
            obj(4, 8, b'B'),
            obj(4, 8, b'Y'),
            obj(8, 12, b'C'),
        );
        let mut index = Index::default();
        listed(&mut index, &[&a, &b, &y, &c], evidence(&[], &[12]));
        assert!(index.conflicting().is_empty());
        let refused = read_at(&index, 6).expect("located");
        assert!(
            refused.starts_with("refused: ")
                && refused.contains("file:///s/j/4-8-B")
                && refused.contains("file:///s/j/4-8-Y"),
            "{refused}"
        );
        assert!(index.disputed(&b).is_some() && index.disputed(&y).is_some());
        assert_eq!(read_at(&index, 9).as_deref(), Some("j/8-12-C"));
        assert_eq!(read_at(&index, 1).as_deref(), Some("j/0-4-A"));
    }

    /// A broker outside the journal's route (perhaps the deposed primary
    /// whose bytes are the wrong ones) takes nothing it holds as evidence:
    /// what it would have judged conflicting is only disputed there.
    #[test]
    fn a_broker_outside_the_route_judges_nothing() {
        let (b, y) = (obj(4, 8, b'B'), obj(4, 8, b'Y'));
        let mut index = Index::default();
        let mut ev = evidence(&[&y], &[8]);
        ev.trusted = false;
        listed(&mut index, &[&b, &y], ev);
        assert!(index.conflicting().is_empty());
        assert!(index.disputed(&b).is_some() && index.disputed(&y).is_some());
    }

    /// An upload this broker confirmed is a copy it held: an object of the
    /// same span with other bytes gives way to it at once.
    #[test]
    fn a_confirmed_upload_outweighs_another_object_of_its_span() {
        let (b, y) = (obj(4, 8, b'B'), obj(4, 8, b'Y'));
        let mut index = Index::default();
        listed(&mut index, &[&y], evidence(&[], &[8]));
        assert_eq!(read_at(&index, 4).as_deref(), Some("j/4-8-Y"));
        index.insert_remote(b.clone());
        assert_eq!(keys(index.conflicting()), ["j/4-8-Y"]);
        assert_eq!(read_at(&index, 4).as_deref(), Some("j/4-8-B"));
        // Pruned: the conflict is gone with it.
        index.drop_remote(&y, false);
        assert!(index.conflicting().is_empty());
    }
}
