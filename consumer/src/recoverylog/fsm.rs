//! The state machine recorders and players both run over records.
//!
//! It owns the chain's position (the next seqno, checksum and author), the
//! live files (fnodes, their paths and the segments holding their records)
//! as of the last barrier, and, apart from them, the files as the open
//! transaction has changed them. A barrier commits the open transaction; a
//! hand-off abandons it. So a log that ends mid-transaction, or whose
//! author died mid-transaction, leaves the committed files as they were.
//!
//! A record extends the chain if its seqno is the next one, its checksum
//! the chain's value so far, and its author the log's current author (a
//! hand-off may come from any author, and makes it the current one).
//! Records that do not are ignored and counted by author: a zombie
//! recorder's writes after a hand-off, duplicated appends, and records read
//! again from a lower-bound offset. A record that extends the chain but
//! cannot be applied is an error: the recorder that wrote it had a bug.
//!
//! The open transaction's files start as a copy of the committed ones,
//! made at its first file record: O(live files and their segments) per
//! transaction, small for the handful of files an embedded store keeps.
//!
//! An FSM started from hints follows their plan: it reads the hinted
//! segments, jumping the chain over the gaps between them, skips (and
//! counts) records of files the hints do not name, and at the end of the
//! segments jumps to the hints' cursor, which commits what it read.

use std::collections::{BTreeMap, BTreeSet};

use super::error::{Error, Inconsistency};
use super::hints::{Cursor, FnodeHints, Hints, HintsError, Plan, Segment};
use super::ops::{Author, Fnode, LogPath, Op, Record, Seqno};

/// Where a record lies in the log.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    /// The frame's first byte, or a lower bound of it (a recorder's).
    pub first_offset: u64,
    /// Just past the frame, if known.
    pub last_offset: Option<u64>,
}

/// A change to the files under a player's root, in paths.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Effect {
    Create {
        path: LogPath,
    },
    /// A hard link `to` the file at `from`.
    Link {
        from: LogPath,
        to: LogPath,
    },
    Unlink {
        path: LogPath,
    },
    Write {
        path: LogPath,
        offset: u64,
        data: Vec<u8>,
    },
    Truncate {
        path: LogPath,
        length: u64,
    },
}

/// What an applied record does to the open transaction.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Txn {
    /// Its effect, if any, joins the open transaction.
    Continue,
    /// The open transaction (with this record's effect) is committed.
    Commit,
    /// The open transaction is abandoned.
    Abort,
}

/// What applying a record that extended the chain calls for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Step {
    /// `None` for barriers, hand-offs, and records of files hinted deleted.
    pub effect: Option<Effect>,
    pub txn: Txn,
    /// Following hints: read on at this offset (a lower bound of the next
    /// record's), skipping the bytes before it.
    pub seek: Option<u64>,
}

/// Why a record did not extend the chain.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ignored {
    /// Its seqno is below the next one: read again, or appended twice, or
    /// a zombie's that lost the race.
    Behind,
    /// Its seqno is past the next one, or its checksum is not the chain's.
    Unchained,
    /// Written by an author other than the log's current one.
    OtherAuthor,
}

/// What became of one record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    Applied(Step),
    Ignored(Ignored),
}

/// Records seen by an FSM, by what became of them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    /// Records that extended the chain.
    pub applied: u64,
    /// Of those, records of files the hints named deleted.
    pub skipped: u64,
    /// Records that did not extend the chain, by author.
    pub ignored: BTreeMap<Author, u64>,
}

/// A live file.
#[derive(Clone, Debug, Default)]
struct Node {
    /// Never empty: a file without paths is gone.
    links: BTreeSet<LogPath>,
    segments: Vec<Segment>,
}

/// Live files and their paths.
#[derive(Clone, Debug, Default)]
struct Files {
    nodes: BTreeMap<Fnode, Node>,
    links: BTreeMap<LogPath, Fnode>,
}

/// A record's facts that its file operation needs.
struct Meta {
    seqno: Seqno,
    checksum: u32,
    author: Author,
    span: Span,
    /// Segments ending at or before this seqno belong to an earlier run.
    run_start: Seqno,
    /// Following hints: records of unnamed fnodes are skipped.
    hinted: bool,
    /// Following hints: a create of this fnode is tracked.
    track_create: bool,
}

/// The chain and the files it describes.
#[derive(Clone, Debug)]
pub struct Fsm {
    /// What the next record must carry; `offset` is a lower bound of it.
    next: Cursor,
    /// Files as of the last barrier.
    committed: Files,
    /// Files as the open transaction left them, once it has a record.
    open: Option<Files>,
    /// The chain just after the last barrier (or hand-off).
    barrier: Cursor,
    /// The hints being followed, until the chain reaches their cursor.
    plan: Option<Plan>,
    counts: Counts,
}

impl Fsm {
    /// An FSM that will rebuild the files `hints` describe
    /// ([`Hints::origin`] to play a log from its start).
    pub fn new(hints: &Hints) -> Result<Fsm, HintsError> {
        let mut fsm = Fsm {
            next: Cursor {
                offset: 0,
                ..hints.cursor
            },
            committed: Files::default(),
            open: None,
            barrier: hints.cursor,
            plan: Some(hints.plan()?),
            counts: Counts::default(),
        };
        let (_, resumed) = fsm
            .enter_plan()
            .expect("checked hints have segments for their fnodes");
        debug_assert_eq!(resumed, hints.live.is_empty());
        Ok(fsm)
    }

    /// What the next record must carry, and a lower bound of its offset.
    pub fn next(&self) -> &Cursor {
        &self.next
    }

    /// The chain just after the last barrier or hand-off.
    pub fn barrier(&self) -> &Cursor {
        &self.barrier
    }

    pub fn counts(&self) -> &Counts {
        &self.counts
    }

    /// Whether the FSM is still reading hinted segments.
    pub fn following_hints(&self) -> bool {
        self.plan.is_some()
    }

    /// Following hints: the cursor they end at.
    pub fn hinted_cursor(&self) -> Option<&Cursor> {
        self.plan.as_ref().map(|plan| &plan.resume)
    }

    /// The file at `path`, as the open transaction left it.
    pub fn fnode(&self, path: &LogPath) -> Option<Fnode> {
        self.open
            .as_ref()
            .unwrap_or(&self.committed)
            .links
            .get(path)
            .copied()
    }

    /// Whether the open transaction has changed any file.
    pub fn transaction_open(&self) -> bool {
        self.open.is_some()
    }

    /// The committed paths and their files.
    pub fn paths(&self) -> impl Iterator<Item = (&LogPath, Fnode)> {
        self.committed
            .links
            .iter()
            .map(|(path, fnode)| (path, *fnode))
    }

    /// Hints to rebuild the files as of the last barrier. Their cursor's
    /// offset is exact once the barrier's append is known: recorders and
    /// players hand hints out through their own `hints`.
    pub(crate) fn hints(&self, log: &str) -> Result<Hints, Error> {
        if self.plan.is_some() {
            return Err(Error::HintsPending);
        }
        let live = self.committed.nodes.iter().map(|(fnode, node)| FnodeHints {
            fnode: *fnode,
            segments: node.segments.clone(),
        });
        Ok(Hints {
            log: log.to_owned(),
            cursor: self.barrier,
            live: live.collect(),
        })
    }

    /// Whether `record` would extend the chain, and if not, why not.
    pub fn check(&self, record: &Record) -> Option<Ignored> {
        if record.seqno < self.next.seqno {
            return Some(Ignored::Behind);
        }
        if record.seqno > self.next.seqno || record.checksum != self.next.checksum {
            return Some(Ignored::Unchained);
        }
        let any_author = record.op == Op::Handoff && self.plan.is_none();
        if !any_author && self.next.author != Some(record.author) {
            return Some(Ignored::OtherAuthor);
        }
        None
    }

    /// Applies `record`, found at `span`, whose payload takes the chain to
    /// `chained` (see [`super::ops::scan`]). A record whose operation does
    /// not fit the files changes nothing (recorders rely on it); an error
    /// from following hints means they do not match the log, and leaves
    /// the FSM unusable.
    pub fn apply(&mut self, record: Record, chained: u32, span: Span) -> Result<Outcome, Error> {
        if let Some(ignored) = self.check(&record) {
            *self.counts.ignored.entry(record.author).or_default() += 1;
            return Ok(Outcome::Ignored(ignored));
        }
        let Record {
            seqno,
            checksum,
            author,
            op,
        } = record;
        let inconsistent = |kind| Error::Inconsistent { seqno, kind };
        let (effect, txn) = match op {
            Op::Barrier => (None, Txn::Commit),
            Op::Handoff if self.plan.is_some() => {
                return Err(inconsistent(Inconsistency::HandoffInHintedSegment))
            }
            Op::Handoff => (None, Txn::Abort),
            op => {
                let meta = self.meta(seqno, checksum, author, span);
                (
                    self.file_op(&meta, op).map_err(inconsistent)?,
                    Txn::Continue,
                )
            }
        };
        let skipped = effect.is_none() && txn == Txn::Continue;
        self.advance(seqno, chained, span);
        match txn {
            Txn::Commit => self.commit(),
            Txn::Abort => self.handoff(author, seqno),
            Txn::Continue => {}
        }
        let (seek, resumed) = self.follow_plan().map_err(inconsistent)?;
        // Reaching the hints' cursor commits: it is just after a barrier.
        let txn = if resumed { Txn::Commit } else { txn };
        self.counts.applied += 1;
        self.counts.skipped += u64::from(skipped);
        Ok(Outcome::Applied(Step { effect, txn, seek }))
    }

    fn meta(&self, seqno: Seqno, checksum: u32, author: Author, span: Span) -> Meta {
        let hinted_fnode = self.plan.as_ref().and_then(|plan| plan.fnodes.front());
        Meta {
            seqno,
            checksum,
            author,
            span,
            run_start: self.next.handoff_seqno,
            hinted: self.plan.is_some(),
            track_create: self.plan.is_none() || hinted_fnode == Some(&Fnode::from(seqno)),
        }
    }

    /// Applies a file operation to the open transaction's files.
    fn file_op(&mut self, meta: &Meta, op: Op) -> Result<Option<Effect>, Inconsistency> {
        let hinted_fnode = self
            .plan
            .as_ref()
            .and_then(|plan| plan.fnodes.front().copied());
        if let Some(fnode) = hinted_fnode {
            if fnode < Fnode::from(meta.seqno) {
                return Err(Inconsistency::HintedFnodeMissing(fnode));
            }
            if fnode == Fnode::from(meta.seqno) && !matches!(op, Op::Create { .. }) {
                return Err(Inconsistency::HintedFnodeNotCreated(fnode));
            }
        }
        let files = self.open.get_or_insert_with(|| self.committed.clone());
        let effect = files.apply(meta, op)?;
        debug_assert!(
            files.consistent(),
            "paths and fnodes agree after record {}",
            meta.seqno
        );
        if meta.hinted && meta.track_create && matches!(effect, Some(Effect::Create { .. })) {
            self.plan.as_mut().map(|plan| plan.fnodes.pop_front());
        }
        Ok(effect)
    }

    /// Moves the chain past the record with `seqno`.
    fn advance(&mut self, seqno: Seqno, chained: u32, span: Span) {
        assert_eq!(
            seqno, self.next.seqno,
            "only the next record extends the chain"
        );
        self.next.seqno = seqno.next();
        self.next.checksum = chained;
        self.next.offset = span
            .last_offset
            .unwrap_or(span.first_offset)
            .max(self.next.offset);
    }

    fn commit(&mut self) {
        if let Some(open) = self.open.take() {
            self.committed = open;
        }
        self.barrier = self.next;
    }

    /// `author` took over the log with the record at `seqno`: the open
    /// transaction's author stopped before its barrier.
    fn handoff(&mut self, author: Author, seqno: Seqno) {
        self.open = None;
        self.next.author = Some(author);
        self.next.handoff_seqno = seqno;
        self.barrier = self.next;
    }

    /// Following hints, after a record: past the end of the segment being
    /// read, moves on to the next (see [`Self::enter_plan`]).
    fn follow_plan(&mut self) -> Result<(Option<u64>, bool), Inconsistency> {
        let Some(plan) = self.plan.as_mut() else {
            return Ok((None, false));
        };
        match plan.segments.front() {
            Some(segment) if segment.last_seqno >= self.next.seqno => return Ok((None, false)),
            Some(_) => {
                plan.segments.pop_front();
            }
            None => {}
        }
        self.enter_plan()
    }

    /// Following hints: moves the chain to the next hinted segment, or past
    /// the last one to the hints' cursor. Returns where to read on, and
    /// whether it reached the cursor (which commits what was read).
    fn enter_plan(&mut self) -> Result<(Option<u64>, bool), Inconsistency> {
        let plan = self.plan.as_mut().expect("called while following hints");
        if let Some(segment) = plan.segments.front() {
            self.next = Cursor {
                seqno: segment.first_seqno,
                checksum: segment.first_checksum,
                author: Some(segment.author),
                // Segments of this author before the jump are of another run
                // as far as this FSM knows: it starts new ones.
                handoff_seqno: Seqno(segment.first_seqno.0 - 1),
                offset: segment.first_offset.max(self.next.offset),
            };
            return Ok((Some(self.next.offset), false));
        }
        if let Some(fnode) = plan.fnodes.front() {
            return Err(Inconsistency::HintedFnodeMissing(*fnode));
        }
        let resume = plan.resume;
        self.plan = None;
        self.next = Cursor {
            offset: resume.offset.max(self.next.offset),
            ..resume
        };
        self.commit();
        Ok((Some(self.next.offset), true))
    }

    /// A recorder learned where its barrier's frame ended: the barrier
    /// cursor moves up to `offset` from its lower bound.
    pub(crate) fn settle_barrier_offset(&mut self, offset: u64) {
        self.barrier.offset = self.barrier.offset.max(offset);
    }
}

impl Files {
    /// Every path names a live file that has it, and every live file has
    /// paths, each naming it. O(files).
    fn consistent(&self) -> bool {
        let links = self
            .nodes
            .values()
            .map(|node| node.links.len())
            .sum::<usize>();
        links == self.links.len()
            && self.nodes.values().all(|node| !node.links.is_empty())
            && self.links.iter().all(|(path, fnode)| {
                self.nodes
                    .get(fnode)
                    .is_some_and(|node| node.links.contains(path))
            })
    }

    /// Applies a file operation; on an error nothing changed.
    fn apply(&mut self, meta: &Meta, op: Op) -> Result<Option<Effect>, Inconsistency> {
        match op {
            Op::Create { path } => self.create(meta, path),
            Op::Link { fnode, path } => {
                if !self.nodes.contains_key(&fnode) {
                    return untracked(meta, fnode);
                }
                if self.links.contains_key(&path) {
                    return Err(Inconsistency::PathExists(path));
                }
                let node = self.nodes.get_mut(&fnode).expect("checked above");
                let from = node.path().clone();
                node.links.insert(path.clone());
                node.extend(meta);
                self.links.insert(path.clone(), fnode);
                Ok(Some(Effect::Link { from, to: path }))
            }
            Op::Unlink { fnode, path } => self.unlink(meta, fnode, path),
            Op::Write {
                fnode,
                offset,
                data,
            } => self.touch(meta, fnode, |path| Effect::Write { path, offset, data }),
            Op::Truncate { fnode, length } => {
                self.touch(meta, fnode, |path| Effect::Truncate { path, length })
            }
            Op::Handoff | Op::Barrier => unreachable!("the FSM applies markers itself"),
        }
    }

    fn create(&mut self, meta: &Meta, path: LogPath) -> Result<Option<Effect>, Inconsistency> {
        if !meta.track_create {
            return Ok(None);
        }
        if self.links.contains_key(&path) {
            return Err(Inconsistency::PathExists(path));
        }
        let fnode = Fnode::from(meta.seqno);
        let mut node = Node {
            links: BTreeSet::from([path.clone()]),
            segments: Vec::new(),
        };
        node.extend(meta);
        let replaced = self.nodes.insert(fnode, node);
        assert!(replaced.is_none(), "fnode {fnode} created twice");
        self.links.insert(path.clone(), fnode);
        Ok(Some(Effect::Create { path }))
    }

    fn unlink(
        &mut self,
        meta: &Meta,
        fnode: Fnode,
        path: LogPath,
    ) -> Result<Option<Effect>, Inconsistency> {
        let Some(node) = self.nodes.get_mut(&fnode) else {
            return untracked(meta, fnode);
        };
        if !node.links.remove(&path) {
            return Err(Inconsistency::NoSuchLink { fnode, path });
        }
        node.extend(meta);
        if node.links.is_empty() {
            self.nodes.remove(&fnode);
        }
        let removed = self.links.remove(&path);
        assert_eq!(removed, Some(fnode), "links and nodes agree");
        Ok(Some(Effect::Unlink { path }))
    }

    /// A write or truncate of `fnode`, through one of its paths.
    fn touch(
        &mut self,
        meta: &Meta,
        fnode: Fnode,
        effect: impl FnOnce(LogPath) -> Effect,
    ) -> Result<Option<Effect>, Inconsistency> {
        let Some(node) = self.nodes.get_mut(&fnode) else {
            return untracked(meta, fnode);
        };
        node.extend(meta);
        Ok(Some(effect(node.path().clone())))
    }
}

/// A record of an fnode the FSM does not track: skipped if the hints name
/// it deleted, else the record is wrong.
fn untracked(meta: &Meta, fnode: Fnode) -> Result<Option<Effect>, Inconsistency> {
    if meta.hinted {
        Ok(None)
    } else {
        Err(Inconsistency::UnknownFnode(fnode))
    }
}

impl Node {
    fn path(&self) -> &LogPath {
        self.links.first().expect("a live file has a path")
    }

    /// Adds the record to the file's segments: its last one if the same
    /// author wrote it in the same run, else a new one.
    fn extend(&mut self, meta: &Meta) {
        if let Some(last) = self.segments.last_mut() {
            if last.author == meta.author && last.last_seqno > meta.run_start {
                assert!(last.last_seqno < meta.seqno, "segments grow with the chain");
                last.last_seqno = meta.seqno;
                last.last_offset = meta.span.last_offset;
                return;
            }
        }
        self.segments.push(Segment {
            author: meta.author,
            first_seqno: meta.seqno,
            first_offset: meta.span.first_offset,
            first_checksum: meta.checksum,
            last_seqno: meta.seqno,
            last_offset: meta.span.last_offset,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::recoverylog::ops;

    fn author(id: u32) -> Author {
        Author::new(id).unwrap()
    }

    fn path(p: &str) -> LogPath {
        LogPath::new(p).unwrap()
    }

    /// Writes records the way a single recorder chains them, at exact
    /// offsets of an imagined log.
    #[derive(Clone)]
    struct Writer {
        seqno: Seqno,
        checksum: u32,
        offset: u64,
    }

    impl Writer {
        fn new() -> Writer {
            Writer {
                seqno: Seqno::FIRST,
                checksum: 0,
                offset: 0,
            }
        }

        fn next(&mut self, id: u32, op: Op) -> (Record, u32, Span) {
            let record = Record {
                seqno: self.seqno,
                checksum: self.checksum,
                author: author(id),
                op,
            };
            let mut frame = Vec::new();
            let payload = ops::encode(&record, &mut frame);
            let chained = ops::chain(record.checksum, &frame[payload]);
            let span = Span {
                first_offset: self.offset,
                last_offset: Some(self.offset + frame.len() as u64),
            };
            (self.seqno, self.checksum, self.offset) =
                (self.seqno.next(), chained, self.offset + frame.len() as u64);
            (record, chained, span)
        }
    }

    fn apply(fsm: &mut Fsm, (record, chained, span): (Record, u32, Span)) -> Outcome {
        fsm.apply(record, chained, span).unwrap()
    }

    fn step(effect: Option<Effect>, txn: Txn) -> Outcome {
        Outcome::Applied(Step {
            effect,
            txn,
            seek: None,
        })
    }

    fn write(fnode: u64, data: &[u8]) -> Op {
        Op::Write {
            fnode: Fnode(fnode),
            offset: 0,
            data: data.to_vec(),
        }
    }

    #[test]
    fn only_the_next_record_of_the_author_extends_the_chain() {
        let mut fsm = Fsm::new(&Hints::origin("log")).unwrap();
        let mut w = Writer::new();
        let create = w.clone().next(1, Op::Create { path: path("a") });
        assert_eq!(
            apply(&mut fsm, create),
            Outcome::Ignored(Ignored::OtherAuthor),
            "no author before a hand-off"
        );
        assert_eq!(
            apply(&mut fsm, w.next(1, Op::Handoff)),
            step(None, Txn::Abort)
        );
        let behind = Writer::new().next(1, Op::Handoff);
        let mut skip = w.clone();
        skip.next(1, Op::Barrier);
        let (mut wrong_sum, chained, span) = w.clone().next(1, Op::Barrier);
        wrong_sum.checksum ^= 1;
        let zombie = w.clone().next(2, Op::Create { path: path("z") });
        assert_eq!(apply(&mut fsm, behind), Outcome::Ignored(Ignored::Behind));
        assert_eq!(
            apply(&mut fsm, skip.next(1, Op::Barrier)),
            Outcome::Ignored(Ignored::Unchained)
        );
        assert_eq!(
            fsm.apply(wrong_sum, chained, span).unwrap(),
            Outcome::Ignored(Ignored::Unchained)
        );
        assert_eq!(
            apply(&mut fsm, zombie),
            Outcome::Ignored(Ignored::OtherAuthor)
        );
        assert_eq!(
            fsm.next().seqno,
            Seqno(2),
            "ignored records do not move the chain"
        );
        let effect = Some(Effect::Create { path: path("a") });
        assert_eq!(
            apply(&mut fsm, w.next(1, Op::Create { path: path("a") })),
            step(effect, Txn::Continue)
        );
        assert_eq!(fsm.next().seqno, Seqno(3));
        assert_eq!(fsm.counts().applied, 2);
        assert_eq!(
            fsm.counts().ignored,
            BTreeMap::from([(author(1), 4), (author(2), 1)])
        );
    }

    #[test]
    fn handoff_abandons_the_open_transaction() {
        let mut fsm = Fsm::new(&Hints::origin("log")).unwrap();
        let mut w = Writer::new();
        apply(&mut fsm, w.next(1, Op::Handoff));
        apply(&mut fsm, w.next(1, Op::Create { path: path("x") }));
        assert_eq!(
            apply(&mut fsm, w.next(1, Op::Barrier)),
            step(None, Txn::Commit)
        );
        apply(&mut fsm, w.next(1, write(2, b"lost")));
        apply(&mut fsm, w.next(1, Op::Create { path: path("y") }));
        assert_eq!(fsm.fnode(&path("y")), Some(Fnode(5)));
        assert_eq!(
            apply(&mut fsm, w.next(2, Op::Handoff)),
            step(None, Txn::Abort)
        );
        assert_eq!(fsm.fnode(&path("y")), None);
        assert_eq!(fsm.paths().collect::<Vec<_>>(), [(&path("x"), Fnode(2))]);
        let hints = fsm.hints("log").unwrap();
        assert_eq!(
            hints.cursor,
            Cursor {
                seqno: Seqno(7),
                author: Some(author(2)),
                handoff_seqno: Seqno(6),
                ..*fsm.next()
            }
        );
        assert_eq!(hints.live[0].segments.len(), 1);
        assert_eq!(
            hints.live[0].segments[0].last_seqno,
            Seqno(2),
            "the abandoned write is in no segment"
        );
    }

    #[test]
    fn segments_extend_within_a_run_and_break_at_handoffs() {
        let mut fsm = Fsm::new(&Hints::origin("log")).unwrap();
        let mut w = Writer::new();
        for (id, op) in [
            (1, Op::Handoff),
            (1, Op::Create { path: path("f") }),
            (1, Op::Barrier),
            (2, Op::Handoff),
            (2, write(2, b"b")),
            (2, Op::Barrier),
            (1, Op::Handoff),
            (1, write(2, b"a")),
            (1, Op::Barrier),
            (1, write(2, b"a")),
            (1, Op::Barrier),
        ] {
            assert!(matches!(
                apply(&mut fsm, w.next(id, op)),
                Outcome::Applied(_)
            ));
        }
        let runs: Vec<_> = fsm.hints("log").unwrap().live[0]
            .segments
            .iter()
            .map(|s| (s.author.get(), s.first_seqno.0, s.last_seqno.0))
            .collect();
        assert_eq!(runs, [(1, 2, 2), (2, 5, 5), (1, 8, 10)]);
    }

    /// Hints name file a only: the records of d inside a's segment play for
    /// the chain but change nothing, and the end of the segment jumps to
    /// the cursor and commits.
    #[test]
    fn hinted_fsm_skips_files_deleted_before_the_hints() {
        let mut w = Writer::new();
        let records: Vec<_> = [
            Op::Handoff,
            Op::Create { path: path("a") },
            Op::Create { path: path("d") },
            write(3, b"dead"),
            write(2, b"live"),
            Op::Unlink {
                fnode: Fnode(3),
                path: path("d"),
            },
            Op::Barrier,
        ]
        .into_iter()
        .map(|op| w.next(1, op))
        .collect();
        let mut recorder = Fsm::new(&Hints::origin("log")).unwrap();
        for record in records.clone() {
            apply(&mut recorder, record);
        }
        let hints = recorder.hints("log").unwrap();
        assert_eq!(hints.live.len(), 1);
        let mut fsm = Fsm::new(&hints).unwrap();
        assert_eq!(
            fsm.next().offset,
            records[1].2.first_offset,
            "reading starts at a's segment"
        );
        let outcomes: Vec<_> = records[..5]
            .iter()
            .cloned()
            .map(|r| apply(&mut fsm, r))
            .collect();
        let seek = Some(hints.cursor.offset);
        let expect = [
            Outcome::Ignored(Ignored::Behind),
            step(Some(Effect::Create { path: path("a") }), Txn::Continue),
            step(None, Txn::Continue),
            step(None, Txn::Continue),
            Outcome::Applied(Step {
                effect: Some(Effect::Write {
                    path: path("a"),
                    offset: 0,
                    data: b"live".to_vec(),
                }),
                txn: Txn::Commit,
                seek,
            }),
        ];
        assert_eq!(outcomes, expect);
        assert!(!fsm.following_hints());
        assert_eq!(fsm.next(), &hints.cursor);
        assert_eq!(fsm.counts().skipped, 2);
        assert_eq!(fsm.hints("log").unwrap().live, hints.live);
    }

    #[test]
    fn records_that_do_not_fit_the_files_are_errors() {
        let mut fsm = Fsm::new(&Hints::origin("log")).unwrap();
        let mut w = Writer::new();
        apply(&mut fsm, w.next(1, Op::Handoff));
        apply(&mut fsm, w.next(1, Op::Create { path: path("a") }));
        for (op, kind) in [
            (
                Op::Create { path: path("a") },
                Inconsistency::PathExists(path("a")),
            ),
            (write(9, b"x"), Inconsistency::UnknownFnode(Fnode(9))),
            (
                Op::Unlink {
                    fnode: Fnode(2),
                    path: path("b"),
                },
                Inconsistency::NoSuchLink {
                    fnode: Fnode(2),
                    path: path("b"),
                },
            ),
        ] {
            let (record, chained, span) = w.clone().next(1, op);
            let error = fsm.apply(record, chained, span).unwrap_err();
            assert!(
                matches!(&error, Error::Inconsistent { seqno: Seqno(3), kind: k } if *k == kind),
                "{error:?}"
            );
            assert_eq!(fsm.next().seqno, Seqno(3));
        }
    }

    fn small_op() -> impl proptest::strategy::Strategy<Value = Op> {
        use proptest::prelude::*;
        let path = prop_oneof![Just("a"), Just("b"), Just("d/c")].prop_map(path);
        let fnode = (1..24u64).prop_map(Fnode);
        prop_oneof![
            1 => Just(Op::Handoff),
            3 => Just(Op::Barrier),
            4 => path.clone().prop_map(|path| Op::Create { path }),
            2 => (fnode.clone(), path.clone()).prop_map(|(fnode, path)| Op::Link { fnode, path }),
            3 => (fnode.clone(), path).prop_map(|(fnode, path)| Op::Unlink { fnode, path }),
            4 => (fnode.clone(), 0..64u64).prop_map(|(fnode, offset)| Op::Write { fnode, offset, data: vec![1; 3] }),
            1 => (fnode, 0..64u64).prop_map(|(fnode, length)| Op::Truncate { fnode, length }),
        ]
    }

    proptest::proptest! {
        /// Records mostly chained, some not, with operations that often do
        /// not fit the files: the FSM never panics, moves the chain by one
        /// exactly when it applies a record, and its hints are valid.
        #[test]
        fn arbitrary_records_keep_the_fsm_sound(
            steps in proptest::collection::vec((0..10u8, 1..3u32, small_op()), 0..120)
        ) {
            let mut fsm = Fsm::new(&Hints::origin("log")).unwrap();
            let mut offset = 0;
            for (how, id, op) in steps {
                let next = *fsm.next();
                let (seqno, checksum) = match how {
                    0 => (Seqno(next.seqno.0.saturating_sub(1).max(1)), next.checksum),
                    1 => (next.seqno.next(), next.checksum),
                    2 => (next.seqno, next.checksum ^ 1),
                    _ => (next.seqno, next.checksum),
                };
                let record = Record { seqno, checksum, author: author(id), op };
                let mut frame = Vec::new();
                let payload = ops::encode(&record, &mut frame);
                let chained = ops::chain(checksum, &frame[payload]);
                let span = Span { first_offset: offset, last_offset: Some(offset + frame.len() as u64) };
                offset += frame.len() as u64;
                let applied = matches!(fsm.apply(record, chained, span), Ok(Outcome::Applied(_)));
                let moved = if applied { next.seqno.next() } else { next.seqno };
                proptest::prop_assert_eq!(fsm.next().seqno, moved);
            }
            let hints = fsm.hints("log").unwrap();
            proptest::prop_assert!(hints.plan().is_ok(), "{:?}", hints.plan());
        }
    }
}
