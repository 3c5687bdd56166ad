//! The player: reads a log, runs the FSM over its records and rebuilds
//! the files under a directory, one committed transaction at a time.
//!
//! A player starts from hints (or the log's origin) and reads up to the
//! end of the log as it stands, or up to a given offset; called again it
//! reads on from where it stopped, which is how a hot standby tails. The
//! effects of the open transaction wait in memory, up to
//! `pending_bytes_max`, and reach the files when its barrier is read; a
//! hand-off drops them. So after any call the directory holds the files as
//! of the last barrier read, byte for byte.
//!
//! Bytes that are not frames (other writers', torn frames) are skipped and
//! counted. A torn frame at the end of what has been read could hide
//! records after it until enough bytes arrive to tell; so when the player
//! can read no further, a frame that starts inside it and extends the
//! chain shows it to be garbage.

use std::path::{Path, PathBuf};

use super::error::{Error, SourceError};
use super::fsm::{Counts, Effect, Fsm, Outcome, Span, Step, Txn};
use super::hints::{Hints, HintsError};
use super::ops::{self, Author, Op, Record, Scanned, FRAME_HEADER_BYTES, FRAME_MAGIC};
use super::recorder::{LogSink, Recorder};
use super::tree::Tree;

/// Where a player reads. Implemented over a journal reader by the caller.
pub trait LogSource {
    /// Reads log bytes at `offset` into `buf`; returns how many. 0 means
    /// the log has no bytes at `offset` yet: its end, for now.
    fn read(&mut self, offset: u64, buf: &mut [u8]) -> Result<usize, SourceError>;
}

impl<T: LogSource + ?Sized> LogSource for &mut T {
    fn read(&mut self, offset: u64, buf: &mut [u8]) -> Result<usize, SourceError> {
        (**self).read(offset, buf)
    }
}

/// Bytes asked of the source at once.
pub const READ_BYTES: usize = 64 << 10;
/// Default limit of the open transaction's effects held in memory.
pub const PENDING_BYTES_MAX: u64 = 256 << 20;
/// Hand-offs appended before a player gives up racing other writers.
pub const HANDOFF_ATTEMPTS_MAX: u32 = 8;

#[derive(Clone, Debug)]
pub struct PlayerConfig {
    /// The journal holding the log (hints name it).
    pub log: String,
    /// The directory to rebuild files in: missing or empty.
    pub root: PathBuf,
    /// Limit of the open transaction's effects held in memory.
    pub pending_bytes_max: u64,
}

impl PlayerConfig {
    pub fn new(log: &str, root: &Path) -> PlayerConfig {
        PlayerConfig {
            log: log.to_owned(),
            root: root.to_owned(),
            pending_bytes_max: PENDING_BYTES_MAX,
        }
    }
}

/// Where a call to play stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Progress {
    /// The next log offset to read.
    pub offset: u64,
    /// Effects of the open transaction, waiting for its barrier.
    pub pending: usize,
    /// Hinted records are still to be read.
    pub following_hints: bool,
}

/// What a player read.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PlayCounts {
    pub records: Counts,
    /// Bytes skipped as not frames.
    pub garbage_bytes: u64,
    /// Bytes read from the source.
    pub read_bytes: u64,
}

pub struct Player<S: LogSource> {
    log: String,
    source: S,
    fsm: Fsm,
    tree: Tree,
    /// Offset of `buf[start]`.
    offset: u64,
    /// Bytes read and not yet consumed are `buf[start..]`.
    buf: Vec<u8>,
    start: usize,
    /// The open transaction's effects, in order.
    pending: Vec<Effect>,
    pending_bytes: u64,
    pending_bytes_max: u64,
    garbage_bytes: u64,
    read_bytes: u64,
}

impl<S: LogSource> Player<S> {
    /// A player that rebuilds the files `hints` describe, and what follows
    /// them, under `config.root`.
    pub fn new(config: PlayerConfig, hints: &Hints, source: S) -> Result<Player<S>, Error> {
        if hints.log != config.log {
            return Err(HintsError::WrongLog {
                hinted: hints.log.clone(),
                log: config.log,
            }
            .into());
        }
        let fsm = Fsm::new(hints)?;
        let tree = Tree::create(&config.root)?;
        Ok(Player {
            log: config.log,
            source,
            offset: fsm.next().offset,
            fsm,
            tree,
            buf: Vec::new(),
            start: 0,
            pending: Vec::new(),
            pending_bytes: 0,
            pending_bytes_max: config.pending_bytes_max,
            garbage_bytes: 0,
            read_bytes: 0,
        })
    }

    pub fn root(&self) -> &Path {
        self.tree.root()
    }

    pub fn fsm(&self) -> &Fsm {
        &self.fsm
    }

    pub fn counts(&self) -> PlayCounts {
        PlayCounts {
            records: self.fsm.counts().clone(),
            garbage_bytes: self.garbage_bytes,
            read_bytes: self.read_bytes,
        }
    }

    /// Hints to rebuild the files as of the last barrier read.
    pub fn hints(&self) -> Result<Hints, Error> {
        self.fsm.hints(&self.log)
    }

    /// Plays to the end of the log as it stands.
    pub fn play(&mut self) -> Result<Progress, Error> {
        self.play_until(u64::MAX)
    }

    /// Plays the records whose frames end at or before `end_offset`, as far
    /// as the log holds them.
    pub fn play_until(&mut self, end_offset: u64) -> Result<Progress, Error> {
        loop {
            match ops::scan(&self.buf[self.start..]) {
                Ok(Scanned::Frame {
                    record,
                    frame_bytes,
                    chained,
                }) => self.play_frame(record, frame_bytes, chained)?,
                Ok(Scanned::Garbage { bytes }) => self.skip_garbage(bytes),
                Ok(Scanned::Incomplete) => {
                    if !self.fill(end_offset)? && !self.unstick() {
                        break;
                    }
                }
                Err(source) => {
                    return Err(Error::Malformed {
                        offset: self.offset,
                        source,
                    })
                }
            }
        }
        if let Some(cursor) = self.fsm.hinted_cursor() {
            if self.offset >= cursor.offset && self.start == self.buf.len() {
                return Err(Error::HintedRecordsMissing {
                    offset: self.offset,
                });
            }
        }
        Ok(Progress {
            offset: self.offset,
            pending: self.pending.len(),
            following_hints: self.fsm.following_hints(),
        })
    }

    /// Plays the log to its end and takes it over for a recorder of
    /// `author`: appends a hand-off through `sink`, reads on until it sees
    /// whether the hand-off extended the chain, and tries again if another
    /// writer's record took its place.
    pub fn handoff<K: LogSink>(
        mut self,
        author: Author,
        mut sink: K,
    ) -> Result<Recorder<K>, Error> {
        for _ in 0..HANDOFF_ATTEMPTS_MAX {
            self.play()?;
            if self.fsm.following_hints() {
                return Err(Error::HintsPending);
            }
            let next = *self.fsm.next();
            if next.author == Some(author) {
                return Err(Error::SameAuthor(author));
            }
            let record = Record {
                seqno: next.seqno,
                checksum: next.checksum,
                author,
                op: Op::Handoff,
            };
            let mut frame = Vec::new();
            ops::encode(&record, &mut frame);
            match sink.append_handoff(&frame) {
                Ok(_) => {}
                // It may have landed: reading on tells.
                Err(error) if error.is_retryable() => {}
                Err(error) => return Err(error.into()),
            }
            self.play()?;
            if self.fsm.next().author == Some(author) {
                let head_offset = self.fsm.barrier().offset;
                return Ok(Recorder::resume(
                    &self.log,
                    self.fsm,
                    author,
                    sink,
                    head_offset,
                ));
            }
        }
        Err(Error::HandoffLost {
            author,
            attempts: HANDOFF_ATTEMPTS_MAX,
        })
    }

    fn play_frame(
        &mut self,
        record: Record,
        frame_bytes: usize,
        chained: u32,
    ) -> Result<(), Error> {
        let span = Span {
            first_offset: self.offset,
            last_offset: Some(self.offset + frame_bytes as u64),
        };
        self.consume(frame_bytes);
        match self.fsm.apply(record, chained, span)? {
            Outcome::Applied(step) => self.act(step),
            Outcome::Ignored(_) => Ok(()),
        }
    }

    /// Holds a step's effect for its transaction, applies or drops the
    /// transaction, and follows the hints' jumps.
    fn act(&mut self, step: Step) -> Result<(), Error> {
        if let Some(effect) = step.effect {
            self.pending_bytes += effect_bytes(&effect);
            if self.pending_bytes > self.pending_bytes_max {
                return Err(Error::TransactionTooLarge {
                    bytes: self.pending_bytes,
                    bytes_max: self.pending_bytes_max,
                });
            }
            self.pending.push(effect);
        }
        match step.txn {
            Txn::Continue => {}
            Txn::Commit => {
                for effect in self.pending.drain(..) {
                    self.tree.apply(&effect)?;
                }
                self.pending_bytes = 0;
            }
            Txn::Abort => {
                self.pending.clear();
                self.pending_bytes = 0;
            }
        }
        if let Some(offset) = step.seek {
            self.seek(offset);
        }
        Ok(())
    }

    fn consume(&mut self, bytes: usize) {
        assert!(
            bytes <= self.buf.len() - self.start,
            "consumes only bytes read"
        );
        self.start += bytes;
        self.offset += bytes as u64;
    }

    fn skip_garbage(&mut self, bytes: usize) {
        self.consume(bytes);
        self.garbage_bytes += bytes as u64;
    }

    /// Moves on to `offset`, if it is ahead, skipping the bytes between.
    fn seek(&mut self, offset: u64) {
        let Some(skip) = offset.checked_sub(self.offset) else {
            return;
        };
        match usize::try_from(skip) {
            Ok(skip) if skip <= self.buf.len() - self.start => self.consume(skip),
            _ => {
                self.buf.clear();
                self.start = 0;
                self.offset = offset;
            }
        }
    }

    /// Reads more bytes, not past `end_offset`; false if there were none.
    fn fill(&mut self, end_offset: u64) -> Result<bool, Error> {
        let held = self.buf.len() - self.start;
        let read_offset = self.offset + held as u64;
        let want = end_offset
            .saturating_sub(read_offset)
            .min(READ_BYTES as u64) as usize;
        if want == 0 {
            return Ok(false);
        }
        self.buf.drain(..self.start);
        self.start = 0;
        let result = {
            self.buf.resize(held + want, 0);
            self.source.read(read_offset, &mut self.buf[held..])
        };
        let n = result.as_ref().map_or(0, |n| (*n).min(want));
        self.buf.truncate(held + n);
        result?;
        self.read_bytes += n as u64;
        Ok(n > 0)
    }

    /// At the end of what can be read, with a frame's start held: if a
    /// frame that extends the chain starts inside it, the bytes before that
    /// frame are garbage (a torn frame). Returns whether it skipped any.
    fn unstick(&mut self) -> bool {
        let held = &self.buf[self.start..];
        if held.len() <= FRAME_HEADER_BYTES {
            return false;
        }
        let extends_chain = |bytes: &[u8]| match ops::scan(bytes) {
            Ok(Scanned::Frame { record, .. }) => self.fsm.check(&record).is_none(),
            _ => false,
        };
        let found = (1..held.len())
            .find(|&at| held[at..].starts_with(&FRAME_MAGIC) && extends_chain(&held[at..]));
        match found {
            Some(at) => {
                self.skip_garbage(at);
                true
            }
            None => false,
        }
    }
}

/// Memory an effect holds, roughly.
fn effect_bytes(effect: &Effect) -> u64 {
    let bytes = match effect {
        Effect::Create { path } | Effect::Unlink { path } | Effect::Truncate { path, .. } => {
            path.as_str().len()
        }
        Effect::Link { from, to } => from.as_str().len() + to.as_str().len(),
        Effect::Write { path, data, .. } => path.as_str().len() + data.len(),
    };
    (bytes + std::mem::size_of::<Effect>()) as u64
}
