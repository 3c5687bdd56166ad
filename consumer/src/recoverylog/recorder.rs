//! The recorder: a store's file operations turned into records and
//! appended to the log.
//!
//! A store's file layer performs each operation on its local files and
//! then tells the recorder, which checks it against its FSM, frames it and
//! buffers the frame. Frames go to the [`LogSink`] as one append when the
//! store ends a transaction ([`Recorder::barrier`]), when the buffer holds
//! [`FLUSH_BYTES_MAX`] or more before an operation, and on
//! [`Recorder::flush`]. Appends are whole or nothing, so the log holds a
//! prefix of the recorded frames, and players apply nothing past its last
//! barrier.
//!
//! A recorder begins with a hand-off record that makes its author the
//! log's author. Records of the author before it that land after the
//! hand-off do not extend the chain, and players ignore them. Journals
//! also fence: the real sink appends only while the journal's author
//! register names this recorder, so a zombie is refused by the broker too
//! ([`SinkError::Fenced`]).

use super::error::{Error, SinkError};
use super::fsm::{Fsm, Outcome, Span, Txn};
use super::hints::Hints;
use super::ops::{self, Author, Fnode, LogPath, Op, Record, WRITE_BYTES_MAX};

/// Where a recorder appends. Implemented over a journal client by the
/// caller; an async client blocks on its append here.
pub trait LogSink {
    /// Appends `bytes` as one atomic append; returns the log offset of its
    /// first byte. Fails [`SinkError::Fenced`] once another recorder took
    /// the log over.
    fn append(&mut self, bytes: &[u8]) -> Result<u64, SinkError>;

    /// Appends a hand-off frame, which makes this sink's recorder the
    /// log's author: a journal sink also sets the log's author register
    /// here, so that the old recorder's next append is refused.
    fn append_handoff(&mut self, bytes: &[u8]) -> Result<u64, SinkError> {
        self.append(bytes)
    }
}

impl<T: LogSink + ?Sized> LogSink for &mut T {
    fn append(&mut self, bytes: &[u8]) -> Result<u64, SinkError> {
        (**self).append(bytes)
    }

    fn append_handoff(&mut self, bytes: &[u8]) -> Result<u64, SinkError> {
        (**self).append_handoff(bytes)
    }
}

/// Buffered frames at which the next operation appends them first.
pub const FLUSH_BYTES_MAX: usize = 1 << 20;

/// Records one store's file operations into its log.
///
/// A file operation that returns an error was not recorded, though the
/// store's local file already changed: the log no longer matches the
/// local files, and the store should fail and recover from the log.
pub struct Recorder<K: LogSink> {
    log: String,
    author: Author,
    fsm: Fsm,
    sink: K,
    /// Frames recorded and not yet appended.
    buf: Vec<u8>,
    /// End in `buf` of the last barrier or hand-off, until it is appended.
    commit_end: Option<usize>,
    /// Just past our last append: a lower bound of where the next lands.
    head_offset: u64,
    /// An append failed for good: nothing more is recorded.
    stopped: bool,
}

impl<K: LogSink> Recorder<K> {
    /// Takes over the log whose chain `fsm` has played up to its end, by
    /// appending a hand-off that makes `author` the author. Whether the
    /// hand-off won the race with other writers shows only by reading the
    /// log back, which [`super::Player::handoff`] does: prefer it.
    pub fn start(log: &str, fsm: Fsm, author: Author, sink: K) -> Result<Recorder<K>, Error> {
        if fsm.following_hints() {
            return Err(Error::HintsPending);
        }
        if fsm.next().author == Some(author) {
            return Err(Error::SameAuthor(author));
        }
        let head_offset = fsm.next().offset;
        let mut recorder = Recorder::build(log, fsm, author, sink, head_offset);
        recorder.record(Op::Handoff)?;
        recorder.append_buffered(true)?;
        Ok(recorder)
    }

    /// A recorder for `author`, whose hand-off `fsm` has applied, its frame
    /// ending at `head_offset`.
    pub(crate) fn resume(
        log: &str,
        fsm: Fsm,
        author: Author,
        sink: K,
        head_offset: u64,
    ) -> Recorder<K> {
        assert_eq!(
            fsm.next().author,
            Some(author),
            "the recorder's author holds the log"
        );
        Recorder::build(log, fsm, author, sink, head_offset)
    }

    fn build(log: &str, fsm: Fsm, author: Author, sink: K, head_offset: u64) -> Recorder<K> {
        Recorder {
            log: log.to_owned(),
            author,
            fsm,
            sink,
            buf: Vec::new(),
            commit_end: None,
            head_offset,
            stopped: false,
        }
    }

    pub fn author(&self) -> Author {
        self.author
    }

    pub fn fsm(&self) -> &Fsm {
        &self.fsm
    }

    pub fn sink(&self) -> &K {
        &self.sink
    }

    /// The file at `path`, if `path` is valid and linked.
    pub fn fnode(&self, path: &str) -> Option<Fnode> {
        self.fsm.fnode(&LogPath::new(path).ok()?)
    }

    /// Records a new, empty file at `path`, which must not exist.
    pub fn create(&mut self, path: &str) -> Result<Fnode, Error> {
        let path = log_path(path)?;
        self.ready()?;
        let fnode = Fnode::from(self.fsm.next().seqno);
        self.record(Op::Create { path })?;
        Ok(fnode)
    }

    /// Records `data` written to `fnode` at `offset`, in records of at most
    /// [`WRITE_BYTES_MAX`] bytes.
    pub fn write(&mut self, fnode: Fnode, offset: u64, data: &[u8]) -> Result<(), Error> {
        let bytes = data.len() as u64;
        if offset.checked_add(bytes).is_none() {
            return Err(Error::WriteTooFar { offset, bytes });
        }
        self.ready()?;
        let mut at = offset;
        for chunk in data.chunks(WRITE_BYTES_MAX) {
            self.record(Op::Write {
                fnode,
                offset: at,
                data: chunk.to_vec(),
            })?;
            at += chunk.len() as u64;
        }
        Ok(())
    }

    /// Records `fnode`'s length set to `length`.
    pub fn truncate(&mut self, fnode: Fnode, length: u64) -> Result<(), Error> {
        self.ready()?;
        self.record(Op::Truncate { fnode, length })
    }

    /// Records a hard link `to` the file at `from`; `to` must not exist.
    pub fn link(&mut self, from: &str, to: &str) -> Result<(), Error> {
        let (from, to) = (log_path(from)?, log_path(to)?);
        self.ready()?;
        let fnode = self.linked(&from)?;
        self.record(Op::Link { fnode, path: to })
    }

    /// Records `from` renamed to `to`, replacing what `to` held, as
    /// rename(2) does (and doing nothing if both name one file).
    pub fn rename(&mut self, from: &str, to: &str) -> Result<(), Error> {
        let (from, to) = (log_path(from)?, log_path(to)?);
        self.ready()?;
        let fnode = self.linked(&from)?;
        match self.fsm.fnode(&to) {
            Some(replaced) if replaced == fnode => return Ok(()),
            Some(replaced) => self.record(Op::Unlink {
                fnode: replaced,
                path: to.clone(),
            })?,
            None => {}
        }
        self.record(Op::Link { fnode, path: to })?;
        self.record(Op::Unlink { fnode, path: from })
    }

    /// Records the removal of the path `path`.
    pub fn unlink(&mut self, path: &str) -> Result<(), Error> {
        let path = log_path(path)?;
        self.ready()?;
        let fnode = self.linked(&path)?;
        self.record(Op::Unlink { fnode, path })
    }

    /// Ends the store's transaction: records a barrier and appends every
    /// buffered frame. After an error that [`Error::is_retryable`], the
    /// barrier is recorded but perhaps not appended: call [`Self::flush`]
    /// until it succeeds before the transaction counts as durable.
    pub fn barrier(&mut self) -> Result<(), Error> {
        self.ready()?;
        self.record(Op::Barrier)?;
        self.flush()
    }

    /// Appends the buffered frames. After a retryable error they stay
    /// buffered (appending them twice is harmless: players skip records
    /// they already applied); after any other error the recorder stops.
    pub fn flush(&mut self) -> Result<(), Error> {
        self.append_buffered(false)
    }

    /// [`Recorder::flush`]; `handoff` when the buffer is the hand-off that
    /// makes this recorder the log's author.
    fn append_buffered(&mut self, handoff: bool) -> Result<(), Error> {
        if self.stopped {
            return Err(Error::RecorderStopped);
        }
        if self.buf.is_empty() {
            return Ok(());
        }
        let appended = match handoff {
            true => self.sink.append_handoff(&self.buf),
            false => self.sink.append(&self.buf),
        };
        let offset = match appended {
            Ok(offset) => offset,
            Err(error) => {
                self.stopped = !error.is_retryable();
                return Err(error.into());
            }
        };
        // Saturating: the offset is the log's word, not an invariant here.
        if let Some(end) = self.commit_end.take() {
            self.fsm
                .settle_barrier_offset(offset.saturating_add(end as u64));
        }
        let end_offset = offset.saturating_add(self.buf.len() as u64);
        self.head_offset = self.head_offset.max(end_offset);
        self.buf.clear();
        Ok(())
    }

    /// Hints to rebuild the files as of the last barrier, whose records are
    /// all appended first.
    pub fn hints(&mut self) -> Result<Hints, Error> {
        if self.commit_end.is_some() {
            self.flush()?;
        }
        self.fsm.hints(&self.log)
    }

    /// Before an operation: the recorder runs, and the buffer has room.
    fn ready(&mut self) -> Result<(), Error> {
        if self.stopped {
            return Err(Error::RecorderStopped);
        }
        if self.buf.len() >= FLUSH_BYTES_MAX {
            self.flush()?;
        }
        Ok(())
    }

    fn linked(&self, path: &LogPath) -> Result<Fnode, Error> {
        self.fsm.fnode(path).ok_or_else(|| Error::Inconsistent {
            seqno: self.fsm.next().seqno,
            kind: super::Inconsistency::NoSuchPath(path.clone()),
        })
    }

    /// Frames `op` as the chain's next record and applies it to the FSM;
    /// if the FSM refuses it, nothing is recorded.
    fn record(&mut self, op: Op) -> Result<(), Error> {
        let next = self.fsm.next();
        let record = Record {
            seqno: next.seqno,
            checksum: next.checksum,
            author: self.author,
            op,
        };
        let start = self.buf.len();
        let payload = ops::encode(&record, &mut self.buf);
        let chained = ops::chain(record.checksum, &self.buf[payload]);
        let span = Span {
            first_offset: self.head_offset,
            last_offset: None,
        };
        match self.fsm.apply(record, chained, span) {
            Ok(Outcome::Applied(step)) => {
                if step.txn != Txn::Continue {
                    self.commit_end = Some(self.buf.len());
                }
                Ok(())
            }
            Ok(Outcome::Ignored(why)) => {
                panic!("the recorder's own record did not extend its chain: {why:?}")
            }
            Err(error) => {
                self.buf.truncate(start);
                Err(error)
            }
        }
    }
}

fn log_path(path: &str) -> Result<LogPath, Error> {
    LogPath::new(path).map_err(|reason| Error::Path {
        path: path.to_owned(),
        reason,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::recoverylog::hints::Hints;
    use crate::recoverylog::memlog::MemLog;
    use crate::recoverylog::ops::{scan, Scanned, Seqno};

    fn author(id: u32) -> Author {
        Author::new(id).unwrap()
    }

    fn recorder(log: &MemLog) -> Recorder<MemLog> {
        let fsm = Fsm::new(&Hints::origin("log")).unwrap();
        Recorder::start("log", fsm, author(1), log.clone()).unwrap()
    }

    /// Every record in `bytes`, which holds no garbage.
    fn records(mut bytes: &[u8]) -> Vec<Record> {
        let mut out = Vec::new();
        while let Ok(Scanned::Frame {
            record,
            frame_bytes,
            ..
        }) = scan(bytes)
        {
            out.push(record);
            bytes = &bytes[frame_bytes..];
        }
        assert!(bytes.is_empty(), "{} bytes left", bytes.len());
        out
    }

    #[test]
    fn rename_over_a_file_is_unlink_link_unlink() {
        let log = MemLog::new();
        let mut rec = recorder(&log);
        let a = rec.create("a").unwrap();
        let b = rec.create("b").unwrap();
        rec.rename("a", "b").unwrap();
        rec.barrier().unwrap();
        let ops: Vec<Op> = records(&log.to_vec()).into_iter().map(|r| r.op).collect();
        let path = |p: &str| LogPath::new(p).unwrap();
        assert_eq!(
            ops,
            [
                Op::Handoff,
                Op::Create { path: path("a") },
                Op::Create { path: path("b") },
                Op::Unlink {
                    fnode: b,
                    path: path("b")
                },
                Op::Link {
                    fnode: a,
                    path: path("b")
                },
                Op::Unlink {
                    fnode: a,
                    path: path("a")
                },
                Op::Barrier,
            ]
        );
        assert_eq!(rec.fnode("b"), Some(a));
        assert_eq!(rec.fnode("a"), None);
    }

    #[test]
    fn large_writes_split_and_seqnos_rise_by_one() {
        let log = MemLog::new();
        let mut rec = recorder(&log);
        let f = rec.create("big").unwrap();
        let data: Vec<u8> = (0..WRITE_BYTES_MAX * 2 + 10)
            .map(|i| (i % 251) as u8)
            .collect();
        rec.write(f, 5, &data).unwrap();
        rec.barrier().unwrap();
        let records = records(&log.to_vec());
        let writes: Vec<(u64, usize)> = records
            .iter()
            .filter_map(|r| match &r.op {
                Op::Write { offset, data, .. } => Some((*offset, data.len())),
                _ => None,
            })
            .collect();
        let max = WRITE_BYTES_MAX as u64;
        assert_eq!(
            writes,
            [
                (5, WRITE_BYTES_MAX),
                (5 + max, WRITE_BYTES_MAX),
                (5 + 2 * max, 10)
            ]
        );
        let seqnos: Vec<u64> = records.iter().map(|r| r.seqno.0).collect();
        assert_eq!(seqnos, (1..=records.len() as u64).collect::<Vec<_>>());
    }

    #[test]
    fn invalid_operations_record_nothing() {
        let log = MemLog::new();
        let mut rec = recorder(&log);
        rec.create("a").unwrap();
        let next = rec.fsm().next().seqno;
        assert!(matches!(rec.create("a"), Err(Error::Inconsistent { .. })));
        assert!(matches!(
            rec.unlink("nope"),
            Err(Error::Inconsistent { .. })
        ));
        assert!(matches!(rec.create("../x"), Err(Error::Path { .. })));
        assert!(matches!(
            rec.write(Fnode(99), 0, b"x"),
            Err(Error::Inconsistent { .. })
        ));
        assert!(matches!(
            rec.write(Fnode(2), u64::MAX, b"x"),
            Err(Error::WriteTooFar { .. })
        ));
        assert_eq!(rec.fsm().next().seqno, next);
        rec.barrier().unwrap();
        assert_eq!(records(&log.to_vec()).len(), 3, "hand-off, create, barrier");
    }

    /// The hints' cursor is exactly where the barrier's frame ends, though
    /// the recorder knew only a lower bound when it recorded it.
    #[test]
    fn hints_cursor_is_the_barrier_frame_end() {
        let log = MemLog::new();
        log.push(b"another writer's bytes");
        let mut rec = recorder(&log);
        let f = rec.create("a").unwrap();
        rec.write(f, 0, b"hello").unwrap();
        rec.barrier().unwrap();
        let end = log.len();
        rec.write(f, 5, b" world").unwrap();
        rec.flush().unwrap();
        let hints = rec.hints().unwrap();
        assert_eq!(hints.cursor.offset, end);
        assert_eq!(hints.cursor.seqno, Seqno(5));
        assert_eq!(hints.live.len(), 1);
        assert_eq!(
            hints.live[0].segments[0].last_seqno,
            Seqno(3),
            "the open write is not hinted"
        );
    }

    struct Failing {
        log: MemLog,
        fail: Option<SinkError>,
    }

    impl LogSink for Failing {
        fn append(&mut self, bytes: &[u8]) -> Result<u64, SinkError> {
            match self.fail.take() {
                Some(error) => Err(error),
                None => self.log.append(bytes),
            }
        }
    }

    #[test]
    fn retryable_append_keeps_frames_and_fenced_stops() {
        let log = MemLog::new();
        let fsm = Fsm::new(&Hints::origin("log")).unwrap();
        let mut rec = Recorder::start(
            "log",
            fsm,
            author(1),
            Failing {
                log: log.clone(),
                fail: None,
            },
        )
        .unwrap();
        rec.create("a").unwrap();
        rec.sink.fail = Some(SinkError::Unavailable("timeout".into()));
        let error = rec.barrier().unwrap_err();
        assert!(error.is_retryable(), "{error:?}");
        let before = log.len();
        rec.flush().unwrap();
        assert!(log.len() > before);
        assert_eq!(records(&log.to_vec()).last().unwrap().op, Op::Barrier);
        rec.sink.fail = Some(SinkError::Fenced);
        rec.create("b").unwrap();
        assert!(!rec.flush().unwrap_err().is_retryable());
        assert!(matches!(rec.create("c"), Err(Error::RecorderStopped)));
    }
}
