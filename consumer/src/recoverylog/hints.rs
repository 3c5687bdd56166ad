//! Hints: where in a log the records of the live files are, so that a
//! player reads those and skips the records of deleted files.
//!
//! Hints describe the files as of one barrier. They name each live file
//! (fnode) with the segments of the log holding its records, and the
//! chain's [`Cursor`] just after that barrier. A player reads the segments
//! in seqno order, jumping over the gaps between them (records of files
//! deleted by the barrier), then jumps to the cursor and reads on from
//! there like any player. Within a segment, records of files the hints do
//! not name are played for the chain's sake but change no file.
//!
//! A segment is a run of one author's records, as in Gazette's recovery
//! log: once an fnode has a segment, its later records by the same author
//! extend it until a hand-off starts a new run. Segments hold offsets: a
//! recorder knows only a lower bound of where its records land (the end of
//! its last append), a player knows them exactly. A player reading from a
//! lower bound skips the records before the one it wants.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

use super::ops::{Author, Fnode, Seqno};

/// A run of the log, all written by one author.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Segment {
    pub author: Author,
    pub first_seqno: Seqno,
    /// At or before the offset of the first record's frame.
    pub first_offset: u64,
    /// The chain's value before the first record (that record's checksum).
    pub first_checksum: u32,
    pub last_seqno: Seqno,
    /// Just past the last record's frame, when known (players know it).
    pub last_offset: Option<u64>,
}

/// A live file and the segments holding all of its records.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FnodeHints {
    pub fnode: Fnode,
    pub segments: Vec<Segment>,
}

/// A position in a log's chain: what the next record must carry, and
/// where in the log it may be found.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cursor {
    /// Seqno of the next record.
    pub seqno: Seqno,
    /// The chain's value before the next record.
    pub checksum: u32,
    /// The log's author; `None` before the first hand-off.
    pub author: Option<Author>,
    /// Seqno of the hand-off that made `author` the author (0 for none):
    /// segments of `author` before it belong to an earlier run.
    pub handoff_seqno: Seqno,
    /// At or before the offset of the next record's frame.
    pub offset: u64,
}

impl Cursor {
    /// The start of a log: nothing recorded yet.
    pub const ORIGIN: Cursor = Cursor {
        seqno: Seqno::FIRST,
        checksum: 0,
        author: None,
        handoff_seqno: Seqno(0),
        offset: 0,
    };
}

/// What a player needs to rebuild a log's files as of one barrier without
/// reading the records of files deleted before it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hints {
    /// The journal holding the log; every offset here is one of its.
    pub log: String,
    /// The chain just after the barrier these hints describe.
    pub cursor: Cursor,
    /// The live files by ascending fnode.
    pub live: Vec<FnodeHints>,
}

/// Why hints cannot be followed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum HintsError {
    #[error("hints are for log {hinted:?}, not {log:?}")]
    WrongLog { hinted: String, log: String },
    #[error("fnode {0} has no segments")]
    NoSegments(Fnode),
    #[error("fnode {0}'s first segment does not start at its seqno")]
    FirstSegment(Fnode),
    #[error("fnodes are not in ascending order at {0}")]
    FnodeOrder(Fnode),
    #[error("a segment of fnode {0} ends before it starts, or before the one before it")]
    SegmentOrder(Fnode),
    #[error("a segment of fnode {0} ends at or after the cursor")]
    PastCursor(Fnode),
    #[error("segments of authors {0} and {1} overlap")]
    AuthorsOverlap(Author, Author),
    #[error("the cursor names no author, yet fnodes are live")]
    NoAuthor,
    #[error(
        "a seqno or offset is out of range (seqnos from 1, both at most {})",
        BOUND_MAX
    )]
    OutOfRange,
}

/// Largest seqno or offset hints may hold (journal offsets are signed
/// 64-bit in Gazette's protocol), so that reading on from any of them
/// cannot overflow.
pub const BOUND_MAX: u64 = i64::MAX as u64;

impl Hints {
    /// Hints for playing `log` from its start.
    pub fn origin(log: &str) -> Hints {
        Hints {
            log: log.to_owned(),
            cursor: Cursor::ORIGIN,
            live: Vec::new(),
        }
    }

    /// Checks the hints and orders their segments for reading.
    pub(crate) fn plan(&self) -> Result<Plan, HintsError> {
        if !self.live.is_empty() && self.cursor.author.is_none() {
            return Err(HintsError::NoAuthor);
        }
        if !in_range(self.cursor.seqno, self.cursor.offset) {
            return Err(HintsError::OutOfRange);
        }
        let mut segments = Vec::new();
        let mut fnode_last: Option<Fnode> = None;
        for node in &self.live {
            if fnode_last.is_some_and(|last| last >= node.fnode) {
                return Err(HintsError::FnodeOrder(node.fnode));
            }
            fnode_last = Some(node.fnode);
            self.check_segments(node)?;
            segments.extend(node.segments.iter().cloned());
        }
        Ok(Plan {
            segments: merge(segments)?,
            fnodes: self.live.iter().map(|node| node.fnode).collect(),
            resume: self.cursor,
        })
    }

    fn check_segments(&self, node: &FnodeHints) -> Result<(), HintsError> {
        let first = node
            .segments
            .first()
            .ok_or(HintsError::NoSegments(node.fnode))?;
        if Fnode::from(first.first_seqno) != node.fnode {
            return Err(HintsError::FirstSegment(node.fnode));
        }
        let mut last_seqno = Seqno(0);
        for segment in &node.segments {
            let last_offset = segment.last_offset.unwrap_or(0);
            if !in_range(segment.first_seqno, segment.first_offset) || last_offset > BOUND_MAX {
                return Err(HintsError::OutOfRange);
            }
            if segment.last_seqno < segment.first_seqno || segment.first_seqno <= last_seqno {
                return Err(HintsError::SegmentOrder(node.fnode));
            }
            if segment.last_seqno >= self.cursor.seqno {
                return Err(HintsError::PastCursor(node.fnode));
            }
            last_seqno = segment.last_seqno;
        }
        Ok(())
    }
}

fn in_range(seqno: Seqno, offset: u64) -> bool {
    (1..=BOUND_MAX).contains(&seqno.0) && offset <= BOUND_MAX
}

/// Hints turned into the order a player reads them in.
#[derive(Clone, Debug)]
pub(crate) struct Plan {
    /// Segments to read, by ascending seqno, none overlapping.
    pub segments: VecDeque<Segment>,
    /// Live fnodes by ascending fnode, each popped as its create is read.
    pub fnodes: VecDeque<Fnode>,
    /// Where the chain goes on after the segments.
    pub resume: Cursor,
}

/// Orders segments by seqno and joins those that overlap or touch: a
/// player reads them as one run. Overlapping segments of two authors
/// cannot both be in one chain.
fn merge(mut segments: Vec<Segment>) -> Result<VecDeque<Segment>, HintsError> {
    segments.sort_by_key(|segment| segment.first_seqno);
    let mut merged: VecDeque<Segment> = VecDeque::new();
    for segment in segments {
        let Some(last) = merged.back_mut() else {
            merged.push_back(segment);
            continue;
        };
        let overlaps = segment.first_seqno <= last.last_seqno;
        if overlaps && segment.author != last.author {
            return Err(HintsError::AuthorsOverlap(last.author, segment.author));
        }
        if segment.author == last.author && segment.first_seqno <= last.last_seqno.next() {
            last.first_offset = last.first_offset.min(segment.first_offset);
            if segment.last_seqno > last.last_seqno {
                last.last_seqno = segment.last_seqno;
                last.last_offset = segment.last_offset;
            }
        } else {
            merged.push_back(segment);
        }
    }
    Ok(merged)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn segment(author: u32, first: u64, last: u64, offset: u64) -> Segment {
        Segment {
            author: Author::new(author).unwrap(),
            first_seqno: Seqno(first),
            first_offset: offset,
            first_checksum: first as u32,
            last_seqno: Seqno(last),
            last_offset: Some(offset + 100),
        }
    }

    fn hints(live: Vec<(u64, Vec<Segment>)>) -> Hints {
        let cursor = Cursor {
            seqno: Seqno(100),
            author: Author::new(1),
            ..Cursor::ORIGIN
        };
        let live = live.into_iter().map(|(fnode, segments)| FnodeHints {
            fnode: Fnode(fnode),
            segments,
        });
        Hints {
            log: "log".into(),
            cursor,
            live: live.collect(),
        }
    }

    #[test]
    fn segments_merge_by_seqno_across_fnodes() {
        let h = hints(vec![
            (2, vec![segment(1, 2, 10, 50)]),
            (5, vec![segment(1, 5, 12, 80), segment(2, 20, 21, 300)]),
            (13, vec![segment(1, 13, 14, 120)]),
        ]);
        let plan = h.plan().unwrap();
        let merged: Vec<_> = plan
            .segments
            .iter()
            .map(|s| (s.author.get(), s.first_seqno.0, s.last_seqno.0))
            .collect();
        assert_eq!(merged, [(1, 2, 14), (2, 20, 21)]);
        assert_eq!(plan.segments[0].first_offset, 50);
        assert_eq!(plan.segments[0].last_offset, Some(220));
        assert_eq!(plan.fnodes, [Fnode(2), Fnode(5), Fnode(13)]);
    }

    #[test]
    fn inconsistent_hints_are_refused() {
        let cases = [
            (hints(vec![(2, vec![])]), HintsError::NoSegments(Fnode(2))),
            (
                hints(vec![(2, vec![segment(1, 3, 4, 0)])]),
                HintsError::FirstSegment(Fnode(2)),
            ),
            (
                hints(vec![
                    (4, vec![segment(1, 4, 4, 0)]),
                    (2, vec![segment(1, 2, 2, 0)]),
                ]),
                HintsError::FnodeOrder(Fnode(2)),
            ),
            (
                hints(vec![(2, vec![segment(1, 2, 1, 0)])]),
                HintsError::SegmentOrder(Fnode(2)),
            ),
            (
                hints(vec![(2, vec![segment(1, 2, 100, 0)])]),
                HintsError::PastCursor(Fnode(2)),
            ),
            (
                hints(vec![
                    (2, vec![segment(1, 2, 9, 0)]),
                    (5, vec![segment(2, 5, 6, 0)]),
                ]),
                HintsError::AuthorsOverlap(Author::new(1).unwrap(), Author::new(2).unwrap()),
            ),
        ];
        for (hints, error) in cases {
            assert_eq!(hints.plan().unwrap_err(), error);
        }
        let mut far = hints(vec![(2, vec![segment(1, 2, 2, BOUND_MAX + 1)])]);
        assert_eq!(far.plan().unwrap_err(), HintsError::OutOfRange);
        far.live.clear();
        far.cursor.seqno = Seqno(0);
        assert_eq!(far.plan().unwrap_err(), HintsError::OutOfRange);
        let mut orphan = hints(vec![(2, vec![segment(1, 2, 2, 0)])]);
        orphan.cursor.author = None;
        assert_eq!(orphan.plan().unwrap_err(), HintsError::NoAuthor);
    }

    #[test]
    fn hints_round_trip_through_json() {
        let h = hints(vec![(2, vec![segment(7, 2, 10, 50)])]);
        let json = serde_json::to_string(&h).unwrap();
        assert!(json.contains(r#""author":7"#), "{json}");
        assert_eq!(serde_json::from_str::<Hints>(&json).unwrap(), h);
        let zero_author = json.replace(r#""author":7"#, r#""author":0"#);
        assert!(serde_json::from_str::<Hints>(&zero_author).is_err());
    }
}
