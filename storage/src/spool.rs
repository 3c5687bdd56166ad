//! The spool: a journal's open fragment on local disk.
//!
//! A spool file holds the journal's bytes `[begin, …)` at file offset
//! `offset - begin`. It is opened with O_DIRECT and grown by `fallocate`
//! ahead of the write head, so writes never extend the file. The tail block
//! is kept in an aligned buffer and rewritten with the next write: bytes of
//! a block that are already on disk are rewritten identically, so a torn
//! write can only damage bytes beyond the last commit.
//!
//! Offsets move in one direction: `committed <= written <= staged`.
//! * `staged`: bytes handed to the spool (in the buffer or on disk).
//! * `written`: bytes on disk.
//! * `committed`: bytes that belong to committed appends. Everything beyond
//!   is invisible and is discarded by [`Spool::rollback`].
//!
//! Staging goes on while a write is in flight: [`Spool::take_write`] hands
//! the buffer to the write and stages on into a second one, which starts
//! with a copy of the tail block. One write is in flight at a time, since
//! the next rewrites that tail block.
//!
//! The spool runs on its shard's thread only. Its logic (offsets, SHA-1,
//! buffer management) is plain code; the I/O methods are thin.

use crate::aligned::{align_down, align_up, AlignedBuf, BLOCK};
use crate::faults::DiskOp;
use crate::sha::Sha1;
use crate::StorageError;
use compio::fs::{File, OpenOptions};
use compio::io::{AsyncReadAt, AsyncWriteAt};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::rc::Rc;

/// Largest batch of staged bytes written in one submission.
pub const SPOOL_BUFFER_BYTES: usize = 4 << 20;
/// Spools grow by at least this much per `fallocate`, once they hold as
/// much (see [`FIRST_GROW_BYTES`]).
pub const SPOOL_GROW_BYTES: u64 = 16 << 20;
/// A new spool's first `fallocate`. Each later one doubles the file, up to
/// the usual step: a busy journal reaches full steps within a few grows,
/// while each of thousands of quiet journals holds a quarter of a MiB of
/// disk, not a whole step.
pub const FIRST_GROW_BYTES: u64 = 256 << 10;
/// A spool's first buffer, when no idle one is in the pool: enough for
/// small appends; larger batches grow it (see [`crate::pool`]). Every open
/// spool holds one, so it is also what a quiet journal costs in memory.
const FIRST_BUFFER_BYTES: usize = 16 << 10;

/// How a spool sizes its I/O: the write buffer (the largest batch of
/// staged bytes written in one submission) and the fallocate step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SpoolSizing {
    pub buffer_bytes: usize,
    pub grow_bytes: u64,
}

impl Default for SpoolSizing {
    fn default() -> Self {
        SpoolSizing {
            buffer_bytes: SPOOL_BUFFER_BYTES,
            grow_bytes: SPOOL_GROW_BYTES,
        }
    }
}

/// A position in the spool that can become the committed point: the offset
/// and the fragment SHA-1 state at that offset.
#[derive(Clone)]
pub struct CommitPoint {
    pub offset: u64,
    pub sha: Sha1,
}

pub struct Spool {
    file: Rc<File>,
    /// Shared with each write, which names it to the fault hook.
    path: Rc<Path>,
    begin: u64,
    committed: u64,
    committed_sha: Sha1,
    written: u64,
    staged: u64,
    sha: Sha1,
    /// The staging buffer. Grows up to `max_buf` bytes.
    buf: AlignedBuf,
    max_buf: usize,
    /// While a write is in flight: the end of its bytes that are still
    /// wanted once it completes (a rewind below its end lowers it).
    writing: Option<u64>,
    /// Journal offset of `buf[0]`; always `begin` plus a block multiple.
    buf_start: u64,
    /// False after a rollback until the tail block is read back.
    tail_loaded: bool,
    /// File bytes allocated so far.
    allocated: u64,
    direct: bool,
    grow_bytes: u64,
}

/// Name of the spool file that begins at `begin`.
pub fn spool_file_name(begin: u64) -> String {
    format!("{begin:016x}.spool")
}

/// Opens `path` read-write with O_DIRECT, falling back to buffered I/O on a
/// filesystem that refuses O_DIRECT (e.g. an old tmpfs).
async fn open_direct(path: &Path, create: bool) -> Result<(File, bool), StorageError> {
    let mut opts = OpenOptions::new();
    opts.read(true).write(true).create(create);
    let mut direct_opts = opts.clone();
    direct_opts.custom_flags(libc::O_DIRECT);
    match direct_opts.open(path).await {
        Ok(f) => Ok((f, true)),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            tracing::warn!(path = %path.display(), "O_DIRECT refused; using buffered I/O");
            Ok((
                opts.open(path)
                    .await
                    .map_err(|e| StorageError::io(path, e))?,
                false,
            ))
        }
        Err(e) => Err(StorageError::io(path, e)),
    }
}

impl Spool {
    /// Creates an empty spool file for a journal whose head is `begin`.
    pub async fn create(dir: &Path, begin: u64) -> Result<Spool, StorageError> {
        Self::create_sized(dir, begin, SpoolSizing::default()).await
    }

    /// [`Spool::create`] with explicit I/O sizes (from `rotary tune`).
    pub async fn create_sized(
        dir: &Path,
        begin: u64,
        sizing: SpoolSizing,
    ) -> Result<Spool, StorageError> {
        let path = dir.join(spool_file_name(begin));
        let (file, direct) = open_direct(&path, true).await?;
        file.set_len(0)
            .await
            .map_err(|e| StorageError::io(&path, e))?;
        Ok(Spool::from_parts(
            file,
            path,
            begin,
            direct,
            Sha1::new(),
            sizing,
        ))
    }

    /// [`Spool::create_sized`] into a recycled file: `spare`, whose blocks
    /// are all written (an uploaded fragment's), is renamed to the spool's
    /// name and overwritten in place. On ext4 that runs at the speed of
    /// overwrites, not of first writes into fallocated blocks. Its old bytes
    /// beyond the write head are never read: readers, seals and recovery
    /// stop at the committed end, and a seal cuts the file there.
    pub async fn create_recycled(
        spare: &Path,
        dir: &Path,
        begin: u64,
        sizing: SpoolSizing,
    ) -> Result<Spool, StorageError> {
        let path = dir.join(spool_file_name(begin));
        std::fs::rename(spare, &path).map_err(|e| StorageError::io(spare, e))?;
        let opened = async {
            let (file, direct) = open_direct(&path, false).await?;
            let len = file_len(&file, &path).await?;
            Ok::<_, StorageError>((file, direct, len))
        }
        .await;
        let (file, direct, len) = match opened {
            Ok(o) => o,
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                return Err(e);
            }
        };
        let mut spool = Spool::from_parts(file, path, begin, direct, Sha1::new(), sizing);
        // The last, partial block is grown like a new one, so that no
        // write reaches past the file's end.
        spool.allocated = align_down(len);
        Ok(spool)
    }

    /// The file of an empty spool, to be kept as a spare or deleted by the
    /// caller (instead of [`Spool::seal`], which deletes it here).
    pub fn into_empty_file(self) -> (PathBuf, u64) {
        assert!(self.is_empty(), "only an empty spool gives up its file");
        assert_eq!(self.staged, self.committed, "uncommitted bytes staged");
        assert!(self.writing.is_none(), "a write is in flight");
        (self.path.to_path_buf(), self.allocated)
    }

    fn from_parts(
        file: File,
        path: PathBuf,
        begin: u64,
        direct: bool,
        sha: Sha1,
        sizing: SpoolSizing,
    ) -> Spool {
        let max_buf = align_up((sizing.buffer_bytes + BLOCK) as u64) as usize;
        Spool {
            file: Rc::new(file),
            path: Rc::from(path),
            begin,
            committed: begin,
            committed_sha: sha.clone(),
            written: begin,
            staged: begin,
            sha,
            buf: crate::pool::take(FIRST_BUFFER_BYTES.min(max_buf), max_buf),
            max_buf,
            writing: None,
            buf_start: begin,
            tail_loaded: true,
            allocated: 0,
            direct,
            grow_bytes: sizing.grow_bytes,
        }
    }

    /// Reopens a spool after a restart. `committed_end` comes from the
    /// commit log; bytes beyond it are ignored. Recomputes the SHA-1 from
    /// disk and returns it with the spool so the caller can check it
    /// against the commit log.
    pub async fn recover(
        path: PathBuf,
        begin: u64,
        committed_end: u64,
    ) -> Result<(Spool, [u8; 20]), StorageError> {
        Self::recover_sized(path, begin, committed_end, SpoolSizing::default()).await
    }

    /// [`Spool::recover`] with explicit I/O sizes.
    pub async fn recover_sized(
        path: PathBuf,
        begin: u64,
        committed_end: u64,
        sizing: SpoolSizing,
    ) -> Result<(Spool, [u8; 20]), StorageError> {
        assert!(committed_end >= begin);
        let (file, direct) = open_direct(&path, false).await?;
        let len = file_len(&file, &path).await?;
        let want = committed_end - begin;
        if len < want {
            return Err(StorageError::Corrupt {
                path,
                why: format!("spool holds {len} bytes but the commit log says {want}"),
            });
        }
        let mut shas = hash_prefixes(&file, &path, 0, Sha1::new(), &[want]).await?;
        let sha = shas.pop().flatten().expect("the file holds `want` bytes");
        let digest = sha.clone().finalize();
        let spool =
            Spool::reopened(file, path, begin, direct, sha, committed_end, len, sizing).await?;
        Ok((spool, digest))
    }

    /// Reopens a spool after a restart at the first of `candidates` (most
    /// preferred first) whose bytes are on disk and hash to its SHA-1.
    /// Returns the spool, the index of the candidate, and how many bytes
    /// were hashed to find it; the spool is `None` if no candidate matches.
    pub async fn recover_checked(
        path: PathBuf,
        begin: u64,
        candidates: &[Check],
        sizing: SpoolSizing,
    ) -> Result<(Option<(Spool, usize)>, u64), StorageError> {
        let (file, direct) = open_direct(&path, false).await?;
        let len = file_len(&file, &path).await?;
        let pos = |at: u64| at.saturating_sub(begin);
        let mut hashed = 0u64;
        // Those checked from the spool's start share one pass.
        let whole: Vec<usize> = (0..candidates.len())
            .filter(|&i| candidates[i].from.is_none())
            .collect();
        let mut shas: Vec<Option<Sha1>> = vec![None; candidates.len()];
        if !whole.is_empty() {
            let ends: Vec<u64> = whole.iter().map(|&i| pos(candidates[i].end)).collect();
            let found = hash_prefixes(&file, &path, 0, Sha1::new(), &ends).await?;
            hashed += ends
                .iter()
                .filter(|&&e| e <= len)
                .max()
                .copied()
                .unwrap_or(0);
            for (i, sha) in whole.into_iter().zip(found) {
                shas[i] = sha;
            }
        }
        // The others one by one, until one matches.
        let mut found = None;
        for (i, c) in candidates.iter().enumerate() {
            let sha = match &c.from {
                None => shas[i].take(),
                Some((at, sha)) => {
                    let (start, end) = (pos(*at), pos(c.end));
                    let mut sha = hash_prefixes(&file, &path, start, sha.clone(), &[end]).await?;
                    hashed += end.min(len).saturating_sub(start);
                    sha.pop().flatten()
                }
            };
            if let Some(sha) = sha.filter(|sha| c.end >= begin && sha.clone().finalize() == c.sha1)
            {
                found = Some((i, c.end, sha));
                break;
            }
        }
        let Some((i, end, sha)) = found else {
            return Ok((None, hashed));
        };
        let spool = Spool::reopened(file, path, begin, direct, sha, end, len, sizing).await?;
        Ok((Some((spool, i)), hashed))
    }

    /// A spool whose bytes `[begin, committed_end)` are on disk with the
    /// fragment SHA-1 state `sha`, and whose file holds `len` bytes.
    #[allow(clippy::too_many_arguments)]
    async fn reopened(
        file: File,
        path: PathBuf,
        begin: u64,
        direct: bool,
        sha: Sha1,
        committed_end: u64,
        len: u64,
        sizing: SpoolSizing,
    ) -> Result<Spool, StorageError> {
        let mut spool = Spool::from_parts(file, path, begin, direct, sha, sizing);
        spool.committed = committed_end;
        spool.committed_sha = spool.sha.clone();
        spool.written = committed_end;
        spool.staged = committed_end;
        spool.allocated = len;
        spool.buf_start = begin + align_down(committed_end - begin);
        spool.tail_loaded = false;
        spool.load_tail().await?;
        Ok(spool)
    }

    pub fn begin(&self) -> u64 {
        self.begin
    }

    pub fn committed(&self) -> u64 {
        self.committed
    }

    pub fn staged(&self) -> u64 {
        self.staged
    }

    /// End of the bytes on disk.
    pub fn written(&self) -> u64 {
        self.written
    }

    /// Committed bytes in the spool.
    pub fn len(&self) -> u64 {
        self.committed - self.begin
    }

    pub fn is_empty(&self) -> bool {
        self.committed == self.begin
    }

    pub fn file(&self) -> &Rc<File> {
        &self.file
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The spool's path, to name it when syncing its file from a task
    /// that does not hold the spool ([`sync_data`]).
    pub fn shared_path(&self) -> Rc<Path> {
        self.path.clone()
    }

    /// SHA-1 of the committed bytes.
    pub fn committed_sha1(&self) -> [u8; 20] {
        self.committed_sha.clone().finalize()
    }

    /// The SHA-1 state of the committed bytes at their last block
    /// boundary, for a commit record of bytes staged after them.
    pub fn committed_midstate(&self) -> crate::wal::Midstate {
        crate::wal::Midstate::of(self.begin, &self.committed_sha)
    }

    /// Whether a write is in flight.
    pub fn write_in_flight(&self) -> bool {
        self.writing.is_some()
    }

    /// Whether the spool can take bytes now: its tail block is loaded (a
    /// write may be in flight).
    pub fn can_stage(&self) -> bool {
        self.tail_loaded
    }

    /// Bytes that can be staged before the buffer must be written.
    pub fn room(&self) -> usize {
        if self.tail_loaded {
            self.max_buf - (self.staged - self.buf_start) as usize
        } else {
            0
        }
    }

    /// Makes sure the file has room for `extra` more bytes beyond `staged`,
    /// growing it with fallocate. Refuses when the filesystem would be left
    /// with less than `reserve` free bytes.
    pub fn ensure_allocated(&mut self, extra: u64, reserve: u64) -> Result<(), StorageError> {
        let need = self.staged - self.begin + extra;
        if need <= self.allocated {
            return Ok(());
        }
        let fd = self.file.as_raw_fd();
        let free = free_bytes(fd).map_err(|e| StorageError::io(&self.path, e))?;
        let full = |free| StorageError::Full {
            path: self.path.to_path_buf(),
            need: need - self.allocated,
            free,
            reserve,
        };
        let short = align_up(need) - self.allocated;
        let step = self
            .allocated
            .clamp(FIRST_GROW_BYTES, self.grow_bytes.max(FIRST_GROW_BYTES));
        let Some(grow) = grow_by(short, free.saturating_sub(reserve), step) else {
            return Err(full(free));
        };
        let target = align_up(self.allocated + grow);
        let rc = crate::faults::inject(DiskOp::SpoolAllocate, &self.path)
            .and_then(|()| sys::fallocate(fd, self.allocated, target - self.allocated));
        match rc {
            Ok(()) => {
                self.allocated = target;
                Ok(())
            }
            Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => Err(full(free)),
            Err(e) => Err(StorageError::io(&self.path, e)),
        }
    }

    /// Copies as much of `bytes` as fits into the buffer and hashes it.
    /// Returns how many bytes were taken. Callers check `ensure_allocated`
    /// first.
    pub fn stage(&mut self, bytes: &[u8]) -> usize {
        self.stage_into(bytes, None)
    }

    /// [`Spool::stage`] that also hashes the staged bytes into `also` (an
    /// append's own SHA-1), sharing the hashing work with the spool's.
    pub fn stage_hashed(&mut self, bytes: &[u8], also: &mut Sha1) -> usize {
        self.stage_into(bytes, Some(also))
    }

    fn stage_into(&mut self, bytes: &[u8], also: Option<&mut Sha1>) -> usize {
        assert!(self.tail_loaded, "stage before the tail block was reloaded");
        let at = (self.staged - self.buf_start) as usize;
        self.grow_buffer(at + bytes.len());
        let buf = &mut self.buf;
        let n = bytes.len().min(buf.capacity() - at);
        buf.full_mut()[at..at + n].copy_from_slice(&bytes[..n]);
        match also {
            Some(also) => crate::sha::update_both(&mut self.sha, also, &bytes[..n]),
            None => self.sha.update(&bytes[..n]),
        }
        self.staged += n as u64;
        n
    }

    /// Makes the buffer hold `need` bytes, up to its maximum, moving the
    /// staged bytes into a larger buffer (an idle one from the pool if it
    /// has one) when it is too small.
    fn grow_buffer(&mut self, need: usize) {
        let buf = &mut self.buf;
        if need <= buf.capacity() || buf.capacity() >= self.max_buf {
            return;
        }
        let want = need.max(buf.capacity() * 2).min(self.max_buf);
        let mut bigger = crate::pool::take(want, self.max_buf);
        let live = (self.staged - self.buf_start) as usize;
        bigger.full_mut()[..live].copy_from_slice(&buf.full_mut()[..live]);
        crate::pool::give(std::mem::replace(buf, bigger));
    }

    /// The staged bytes from journal offset `from` on, while they are in
    /// the staging buffer: `None` if `from` is before its start.
    pub fn staged_since(&self, from: u64) -> Option<&[u8]> {
        if !self.tail_loaded || from < self.buf_start || from > self.staged {
            return None;
        }
        let start = (from - self.buf_start) as usize;
        let end = (self.staged - self.buf_start) as usize;
        Some(&self.buf.full()[start..end])
    }

    /// Writes `bytes` at journal offset `at` into the spool file at `path`
    /// (whose first byte is journal offset `begin`), keeping the rest of
    /// the blocks it touches, and waits for the write. Recovery uses it to
    /// put back bytes whose commit record carried them but whose own write
    /// never reached the disk.
    pub async fn repair(
        path: &Path,
        begin: u64,
        at: u64,
        bytes: &[u8],
    ) -> Result<(), StorageError> {
        assert!(at >= begin);
        if bytes.is_empty() {
            return Ok(());
        }
        let (file, _) = open_direct(path, false).await?;
        let pos = at - begin;
        let start = align_down(pos);
        let end = align_up(pos + bytes.len() as u64);
        let mut buf = AlignedBuf::new((end - start) as usize);
        let (res, b) = file.read_at(buf, start).await.into();
        buf = b;
        // Bytes past the file's end read as nothing; the buffer is zeroed.
        let n = res.map_err(|e| StorageError::io(path, e))?;
        let from = (pos - start) as usize;
        if n >= from + bytes.len() && buf.full()[from..from + bytes.len()] == *bytes {
            // The spool write completed: nothing to put back, and no
            // fdatasync to wait for at start.
            return Ok(());
        }
        buf.full_mut()[from..from + bytes.len()].copy_from_slice(bytes);
        buf.set_len_checked((end - start) as usize);
        let w = PendingWrite {
            buf,
            file_pos: start,
            staged_to: 0,
            path: Rc::from(path),
        };
        let (res, _) = w.run(&file).await;
        res.map_err(|e| StorageError::io(path, e))?;
        sync_data(&file, path)
            .await
            .map_err(|e| StorageError::io(path, e))
    }

    /// The current staged point, to commit once it is written.
    pub fn commit_point(&self) -> CommitPoint {
        CommitPoint {
            offset: self.staged,
            sha: self.sha.clone(),
        }
    }

    /// Takes the staging buffer for writing the staged bytes, and goes on
    /// staging into another that starts with a copy of the partial tail
    /// block. `None` if nothing is staged beyond what is written, if a
    /// write is in flight already, or if the tail block awaits a reload.
    pub fn take_write(&mut self) -> Option<PendingWrite> {
        if self.staged == self.written || self.writing.is_some() || !self.tail_loaded {
            return None;
        }
        let used = (self.staged - self.buf_start) as usize;
        let tail_start = self.begin + align_down(self.staged - self.begin);
        let tail = (tail_start - self.buf_start) as usize;
        // Sized to this batch: twice it, no larger than the buffer being
        // written and no smaller than a new spool's. A journal of small
        // batches does not take a large idle buffer from the pool, and one
        // whose batches shrank (a burst over) gives its large buffer back.
        let cap = self.buf.capacity();
        let want = (2 * used).clamp(FIRST_BUFFER_BYTES.min(cap), cap);
        let mut next = crate::pool::take(FIRST_BUFFER_BYTES.min(want), want);
        next.full_mut()[..used - tail].copy_from_slice(&self.buf.full()[tail..used]);
        let mut buf = std::mem::replace(&mut self.buf, next);
        let len = if self.direct {
            align_up(used as u64) as usize
        } else {
            used
        };
        // Bytes between `used` and the block end are stale: zero them so the
        // file never holds leftovers of another offset.
        buf.full_mut()[used..len].fill(0);
        buf.set_len_checked(len);
        let w = PendingWrite {
            buf,
            file_pos: self.buf_start - self.begin,
            staged_to: self.staged,
            path: self.path.clone(),
        };
        self.buf_start = tail_start;
        self.writing = Some(self.staged);
        Some(w)
    }

    /// Takes back the write's buffer once it completed. On success its
    /// bytes are on disk (up to the lowest rewind made meanwhile); on
    /// failure everything beyond the committed point is discarded, as by
    /// [`Spool::rollback`].
    pub fn write_done(&mut self, w: PendingWrite, ok: bool) {
        let keep = self.writing.take().expect("a write in flight");
        assert!(keep <= w.staged_to && keep <= self.staged);
        crate::pool::give(w.buf);
        if ok {
            self.written = keep;
        } else {
            self.rollback();
        }
    }

    /// Writes the staged bytes and waits for the write: [`Spool::take_write`],
    /// [`PendingWrite::run`] and [`Spool::write_done`] in one call, for
    /// callers with nothing else to do meanwhile.
    pub async fn write_staged(&mut self) -> Result<(), StorageError> {
        let Some(w) = self.take_write() else {
            return Ok(());
        };
        let file = self.file.clone();
        let (res, w) = w.run(&file).await;
        self.write_done(w, res.is_ok());
        res.map_err(|e| StorageError::io(&self.path, e))
    }

    /// Marks everything up to `point` committed. The point must be written.
    pub fn commit(&mut self, point: CommitPoint) {
        assert!(point.offset >= self.committed && point.offset <= self.written);
        self.committed = point.offset;
        self.committed_sha = point.sha;
    }

    /// Discards staged bytes beyond `point`, which must not be below the
    /// committed point. A point in the staging buffer, at or after the
    /// written offset, stays there. An earlier one was written, or is in
    /// the buffer of the write in flight: the tail block must then be read
    /// back ([`Spool::load_tail`], once no write is in flight) before
    /// staging again, unless the point is at a block boundary.
    pub fn rewind(&mut self, point: CommitPoint) {
        assert!(point.offset <= self.staged);
        assert!(
            point.offset >= self.committed,
            "rewind below the committed point"
        );
        if let Some(keep) = self.writing.as_mut() {
            *keep = (*keep).min(point.offset);
        }
        let in_buffer =
            self.tail_loaded && point.offset >= self.buf_start && point.offset >= self.written;
        self.staged = point.offset;
        self.sha = point.sha;
        if !in_buffer {
            self.written = self.written.min(point.offset);
            self.buf_start = self.begin + align_down(point.offset - self.begin);
            self.tail_loaded = self.buf_start == point.offset;
        }
    }

    /// Discards everything beyond the committed point. The tail block may
    /// have to be read back ([`Spool::load_tail`]) before staging again.
    pub fn rollback(&mut self) {
        let point = CommitPoint {
            offset: self.committed,
            sha: self.committed_sha.clone(),
        };
        self.rewind(point);
    }

    /// The committed point: where a batch staged now begins.
    pub fn committed_point(&self) -> CommitPoint {
        CommitPoint {
            offset: self.committed,
            sha: self.committed_sha.clone(),
        }
    }

    /// Takes back commits beyond `point`, an earlier committed point of
    /// this spool: a primary's batches that its replicas did not
    /// acknowledge, which must never be sealed, served or uploaded. Drops
    /// everything staged, then cuts the file back ([`Spool::cut_back`]).
    /// No write may be in flight; the tail block is read back before the
    /// next staging unless `point` is at a block boundary.
    pub fn uncommit(&mut self, point: CommitPoint) -> Result<(), StorageError> {
        assert!(
            self.writing.is_none(),
            "uncommit while a write is in flight"
        );
        assert!(
            point.offset >= self.begin && point.offset <= self.committed,
            "uncommit to {} outside the committed [{}, {}]",
            point.offset,
            self.begin,
            self.committed
        );
        self.committed = point.offset;
        self.committed_sha = point.sha;
        self.rollback();
        assert_eq!(self.staged, self.committed, "uncommit left bytes staged");
        self.cut_back()
    }

    /// Cuts the file back to the committed bytes, then allocates what it
    /// held beyond them again (zeroed). Bytes that a refused batch wrote
    /// past the committed point (all of them, when only its fdatasync
    /// failed) then cannot pass for a commit at a restart, whatever record
    /// of the batch the commit log holds: recovery finds the spool too
    /// short for that record and stands on the one before. Shrinking needs
    /// no space, so this works on a full disk; should the allocation fail,
    /// staging allocates as it goes ([`Spool::ensure_allocated`]). No write
    /// may be in flight.
    pub fn cut_back(&mut self) -> Result<(), StorageError> {
        assert!(
            self.writing.is_none(),
            "cut_back while a write is in flight"
        );
        assert!(self.written <= self.staged && self.committed <= self.staged);
        let keep = self.committed - self.begin;
        let fd = self.file.as_raw_fd();
        sys::ftruncate(fd, keep).map_err(|e| StorageError::io(&self.path, e))?;
        let allocated = std::mem::replace(&mut self.allocated, keep);
        self.written = self.written.min(self.committed);
        if allocated > keep && sys::fallocate(fd, keep, allocated - keep).is_ok() {
            self.allocated = allocated;
        }
        Ok(())
    }

    /// Reads the committed part of the tail block back into the buffer.
    pub async fn load_tail(&mut self) -> Result<(), StorageError> {
        if self.tail_loaded {
            return Ok(());
        }
        assert!(
            self.writing.is_none(),
            "load_tail while a write is in flight"
        );
        let want = (self.written - self.buf_start) as usize;
        let (block, range) = read_range(&self.file, self.buf_start - self.begin, want)
            .await
            .map_err(|e| StorageError::io(&self.path, e))?;
        if range.len() < want {
            return Err(StorageError::Corrupt {
                path: self.path.to_path_buf(),
                why: format!("tail block read {} of {want} bytes", range.len()),
            });
        }
        self.buf.full_mut()[..want].copy_from_slice(&block.as_slice()[range]);
        self.tail_loaded = true;
        Ok(())
    }

    /// fdatasync of the spool file.
    pub async fn sync(&self) -> Result<(), StorageError> {
        sync_data(&self.file, &self.path)
            .await
            .map_err(|e| StorageError::io(&self.path, e))
    }

    /// Seals the committed bytes into a local fragment file named
    /// `<begin>-<end>-<sha1>.raw` beside the spool. An empty spool is
    /// removed and yields `None`.
    pub async fn seal(
        self,
        durable: bool,
    ) -> Result<Option<crate::fragment::LocalFragment>, StorageError> {
        assert_eq!(self.staged, self.committed, "seal with uncommitted bytes");
        assert!(self.writing.is_none(), "seal while a write is in flight");
        if self.is_empty() {
            compio::fs::remove_file(&self.path)
                .await
                .map_err(|e| StorageError::io(&self.path, e))?;
            return Ok(None);
        }
        // One question for the whole seal, so that a hook counts seals.
        crate::faults::inject(DiskOp::Seal, &self.path)
            .map_err(|e| StorageError::io(&self.path, e))?;
        let sha1 = self.committed_sha1();
        self.file
            .set_len(self.committed - self.begin)
            .await
            .map_err(|e| StorageError::io(&self.path, e))?;
        if durable {
            self.sync().await?;
        }
        let name = crate::fragment::fragment_file_name(self.begin, self.committed, &sha1);
        let dir = self.path.parent().expect("spool has a directory");
        let dest = dir.join(&name);
        compio::fs::rename(&self.path, &dest)
            .await
            .map_err(|e| StorageError::io(&dest, e))?;
        if durable {
            crate::sync_dir(dir).await?;
        }
        Ok(Some(crate::fragment::LocalFragment {
            begin: self.begin,
            end: self.committed,
            sha1,
            path: dest,
            file: Some(self.file.clone()),
            uploaded: false,
            uploading: false,
            corrupt: None,
            // Every byte was hashed into `sha1` as it was staged.
            verified: true,
            sealed_at: rotary_proto::clock::wall(),
            held: false,
        }))
    }
}

impl Drop for Spool {
    fn drop(&mut self) {
        crate::pool::give(std::mem::replace(&mut self.buf, AlignedBuf::empty()));
    }
}

/// A write of staged bytes, owning the spool's buffer until it completes.
/// A commit recovery checks a spool against: its end and the SHA-1 the
/// commit log recorded for the spool's bytes up to there.
#[derive(Clone, Debug)]
pub struct Check {
    pub end: u64,
    pub sha1: [u8; 20],
    /// The SHA-1 state at a journal offset whose bytes before it are known
    /// to be on disk: hashing goes on from there. `None` hashes the spool
    /// from its start.
    pub from: Option<(u64, Sha1)>,
}

pub struct PendingWrite {
    buf: AlignedBuf,
    file_pos: u64,
    staged_to: u64,
    /// The file's path, for the fault hook.
    path: Rc<Path>,
}

impl PendingWrite {
    /// Submits the write. The buffer comes back with the result.
    pub async fn run(mut self, file: &File) -> (std::io::Result<()>, PendingWrite) {
        if let Err(e) = crate::faults::inject_held(DiskOp::SpoolWrite, &self.path).await {
            return (Err(e), self);
        }
        let mut f = file;
        let len = self.buf.len();
        let (res, buf) = f.write_at(self.buf, self.file_pos).await.into();
        self.buf = buf;
        let res = match res {
            Ok(n) if n == len => Ok(()),
            Ok(n) => Err(std::io::Error::other(format!(
                "short write: {n} of {len} bytes"
            ))),
            Err(e) => Err(e),
        };
        (res, self)
    }

    pub fn bytes(&self) -> usize {
        self.buf.len()
    }
}

/// fdatasync of the spool file `file` at `path`, for callers that hold
/// the file but not the spool (a turn's writes).
pub async fn sync_data(file: &File, path: &Path) -> std::io::Result<()> {
    crate::faults::inject_held(DiskOp::SpoolSync, path).await?;
    file.sync_data().await
}

async fn file_len(file: &File, path: &Path) -> Result<u64, StorageError> {
    Ok(file
        .metadata()
        .await
        .map_err(|e| StorageError::io(path, e))?
        .len())
}

/// The SHA-1 states after hashing the file's bytes from `start` (where
/// the state is `sha`) up to each of `ends`; `None` for an end before
/// `start` or past the end of the file.
async fn hash_prefixes(
    file: &File,
    path: &Path,
    start: u64,
    mut sha: Sha1,
    ends: &[u64],
) -> Result<Vec<Option<Sha1>>, StorageError> {
    let len = file_len(file, path).await?;
    let mut out: Vec<Option<Sha1>> = vec![None; ends.len()];
    let mut order: Vec<usize> = (0..ends.len())
        .filter(|&i| (start..=len).contains(&ends[i]))
        .collect();
    order.sort_by_key(|&i| ends[i]);
    let mut order = order.into_iter().peekable();
    // Where the SHA-1 state stands.
    let mut at = start;
    // Reads stay aligned (O_DIRECT): the first begins at the block of
    // `start`, each later one where the one before ended.
    let mut read_pos = align_down(start);
    let mut buf = AlignedBuf::new(1 << 20);
    while let Some(&i) = order.peek() {
        if ends[i] == at {
            out[i] = Some(sha.clone());
            order.next();
            continue;
        }
        let (res, b) = file.read_at(buf, read_pos).await.into();
        buf = b;
        let n = res.map_err(|e| StorageError::io(path, e))? as u64;
        let read_end = read_pos + n;
        if read_end <= at {
            // Nothing past the state in this read (the file ends short).
            break;
        }
        // Hash up to each end that falls inside this read.
        while let Some(&i) = order.peek() {
            let stop = ends[i].min(read_end);
            sha.update(&buf.as_slice()[(at - read_pos) as usize..(stop - read_pos) as usize]);
            at = stop;
            if ends[i] > read_end {
                break;
            }
            out[i] = Some(sha.clone());
            order.next();
        }
        if n == 0 || at != read_end {
            // End of file, or every end is behind us.
            break;
        }
        read_pos = read_end;
    }
    Ok(out)
}

/// Reads up to `len` bytes at file offset `pos` with aligned I/O. Returns
/// the buffer and the range of it that holds the requested bytes.
pub async fn read_range(
    file: &File,
    pos: u64,
    len: usize,
) -> std::io::Result<(AlignedBuf, std::ops::Range<usize>)> {
    let start = align_down(pos);
    let end = align_up(pos + len as u64);
    let buf = AlignedBuf::new((end - start) as usize);
    let (res, buf) = file.read_at(buf, start).await.into();
    let n = res?;
    let skip = (pos - start) as usize;
    let avail = n.saturating_sub(skip).min(len);
    Ok((buf, skip..skip + avail))
}

/// How far to grow a spool that is `short` bytes short, with `usable`
/// bytes free above the reserve: by the usual `step`, or by what is left
/// above the reserve when that is less (so the last megabytes before the
/// reserve stay usable), but never by less than `short`. None: no room.
fn grow_by(short: u64, usable: u64, step: u64) -> Option<u64> {
    if usable < short {
        return None;
    }
    Some(short.max(step.min(align_down(usable))))
}

fn free_bytes(fd: i32) -> std::io::Result<u64> {
    sys::fstatvfs_free(fd)
}

/// Bytes free to unprivileged writers on the file system holding `path`.
pub fn free_bytes_at(path: &Path) -> std::io::Result<u64> {
    let f = std::fs::File::open(path)?;
    sys::fstatvfs_free(f.as_raw_fd())
}

/// The libc calls this module needs, kept in one place.
mod sys {
    #![allow(unsafe_code)]

    pub fn fallocate(fd: i32, offset: u64, len: u64) -> std::io::Result<()> {
        // SAFETY: plain syscall on a descriptor the caller keeps open.
        let rc = unsafe { libc::fallocate(fd, 0, offset as libc::off_t, len as libc::off_t) };
        if rc == 0 {
            return Ok(());
        }
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::EOPNOTSUPP) {
            // Filesystems without fallocate: grow the size instead.
            // SAFETY: as above.
            let rc = unsafe { libc::ftruncate(fd, (offset + len) as libc::off_t) };
            if rc == 0 {
                return Ok(());
            }
            return Err(std::io::Error::last_os_error());
        }
        Err(err)
    }

    pub fn ftruncate(fd: i32, len: u64) -> std::io::Result<()> {
        // SAFETY: plain syscall on a descriptor the caller keeps open.
        let rc = unsafe { libc::ftruncate(fd, len as libc::off_t) };
        if rc == 0 {
            return Ok(());
        }
        Err(std::io::Error::last_os_error())
    }

    pub fn fstatvfs_free(fd: i32) -> std::io::Result<u64> {
        let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
        // SAFETY: st is a valid out-pointer; fd is open.
        let rc = unsafe { libc::fstatvfs(fd, st.as_mut_ptr()) };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: fstatvfs succeeded and filled st.
        let st = unsafe { st.assume_init() };
        Ok(st.f_bavail * st.f_frsize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_hash_from_any_start_to_any_end() {
        use rand::{Rng, SeedableRng};
        use sha1::Digest;
        const MIB: usize = 1 << 20;
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let bytes: Vec<u8> = (0..9 * MIB + 123).map(|_| rng.r#gen()).collect();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("spool");
        std::fs::write(&path, &bytes).unwrap();
        let len = bytes.len() as u64;
        let rt = compio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let (file, _) = open_direct(&path, false).await.unwrap();
            for start in [0, 64, 4096 * 3 + 640, 5 * MIB as u64 + 64] {
                let mut sha = Sha1::new();
                sha.update(&bytes[..start as usize]);
                // Past the file, before the start, at it, short and long.
                let ends = [
                    len + 1,
                    start.saturating_sub(1),
                    start,
                    start + 100,
                    start + 4 * MIB as u64 + 1,
                    len,
                    len - 1,
                ];
                let got = hash_prefixes(&file, &path, start, sha, &ends)
                    .await
                    .unwrap();
                for (end, got) in ends.iter().zip(got) {
                    let want: Option<[u8; 20]> = (*end <= len && *end >= start)
                        .then(|| sha1::Sha1::digest(&bytes[..*end as usize]).into());
                    assert_eq!(got.map(|s| s.finalize()), want, "start {start} end {end}");
                }
            }
        });
    }

    #[test]
    fn repair_puts_back_missing_bytes_and_leaves_present_ones_alone() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(spool_file_name(1000));
        let mut file: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        std::fs::write(&path, &file).unwrap();
        let mtime = || std::fs::metadata(&path).unwrap().modified().unwrap();
        let before = mtime();
        std::thread::sleep(std::time::Duration::from_millis(20));
        let rt = compio::runtime::Runtime::new().unwrap();
        // Bytes the spool holds already: not written again.
        let held = file[5000..5300].to_vec();
        rt.block_on(Spool::repair(&path, 1000, 6000, &held))
            .unwrap();
        assert_eq!(mtime(), before, "identical bytes were written again");
        // Other bytes, and bytes past the end (zeros too): written.
        rt.block_on(Spool::repair(&path, 1000, 6000, &[9u8; 300]))
            .unwrap();
        file[5000..5300].fill(9);
        assert_eq!(std::fs::read(&path).unwrap(), file);
        rt.block_on(Spool::repair(&path, 1000, 11_000, &[0u8; 100]))
            .unwrap();
        let got = std::fs::read(&path).unwrap();
        assert!(got.len() >= 10_100, "{} bytes", got.len());
        assert_eq!(&got[..10_000], &file[..]);
        assert_eq!(&got[10_000..10_100], &[0u8; 100][..]);
    }

    #[test]
    fn spools_grow_into_the_last_space_above_the_reserve() {
        const MIB: u64 = 1 << 20;
        // Plenty of room: the usual step, or what the write needs if more.
        assert_eq!(grow_by(4096, 100 * MIB, 16 * MIB), Some(16 * MIB));
        assert_eq!(grow_by(20 * MIB, 100 * MIB, 16 * MIB), Some(20 * MIB));
        // Less than a step left above the reserve: all of it, in blocks.
        assert_eq!(grow_by(4096, 8 * MIB + 100, 16 * MIB), Some(8 * MIB));
        assert_eq!(grow_by(4096, 4096, 16 * MIB), Some(4096));
        // Not even what the write needs.
        assert_eq!(grow_by(8192, 4096, 16 * MIB), None);
        assert_eq!(grow_by(4096, 0, 16 * MIB), None);
    }

    #[test]
    fn a_new_spool_grows_from_a_quarter_mib_doubling_to_full_steps() {
        const MIB: u64 = 1 << 20;
        let rt = compio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let mut spool = Spool::create(dir.path(), 0).await.unwrap();
            let file_len = |s: &Spool| std::fs::metadata(s.path()).unwrap().len();
            // A few bytes take the first step only.
            spool.ensure_allocated(10, 0).unwrap();
            assert_eq!(file_len(&spool), FIRST_GROW_BYTES);
            // Each grow doubles the file while it is below a full step,
            // and never grows by less than what is short.
            let mut sizes = Vec::new();
            let mut need = FIRST_GROW_BYTES;
            while file_len(&spool) < 64 * MIB {
                spool.ensure_allocated(need + 1, 0).unwrap();
                sizes.push(file_len(&spool) / 1024);
                need = file_len(&spool);
            }
            assert_eq!(
                sizes,
                [512, 1024, 2048, 4096, 8192, 16384, 32768, 49152, 65536],
                "KiB after each grow"
            );
            // A single large need is met at once.
            let mut big = Spool::create(dir.path(), 1 << 40).await.unwrap();
            big.ensure_allocated(40 * MIB, 0).unwrap();
            assert_eq!(file_len(&big), 40 * MIB);
        });
    }

    /// A batch committed and then taken back (its replicas did not
    /// acknowledge it): the spool holds the bytes before it, a record of
    /// the batch no longer matches the file, and the next batch is staged
    /// and hashed from where the taken-back one began.
    #[test]
    fn an_uncommitted_batch_is_gone_from_the_spool() {
        let rt = compio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let mut spool = Spool::create(dir.path(), 0).await.unwrap();
            let path = spool.path().to_path_buf();
            let sha_of = |b: &[u8]| -> [u8; 20] {
                let mut s = Sha1::new();
                s.update(b);
                s.finalize()
            };
            spool.stage(&[1u8; 3000]);
            spool.write_staged().await.unwrap();
            spool.commit(spool.commit_point());
            let confirmed = spool.committed_point();
            spool.stage(&[2u8; 7000]);
            spool.write_staged().await.unwrap();
            spool.commit(spool.commit_point());
            assert_eq!(spool.committed(), 10_000);
            spool.uncommit(confirmed).unwrap();
            assert_eq!((spool.committed(), spool.staged()), (3000, 3000));
            assert!(spool.written() <= 3000);
            assert_eq!(spool.committed_sha1(), sha_of(&[1u8; 3000]));
            let mut both = vec![1u8; 3000];
            both.extend_from_slice(&[2u8; 7000]);
            let taken_back = [Check {
                end: 10_000,
                sha1: sha_of(&both),
                from: None,
            }];
            let (found, _) =
                Spool::recover_checked(path.clone(), 0, &taken_back, SpoolSizing::default())
                    .await
                    .unwrap();
            assert!(found.is_none(), "the taken-back batch still matches");
            spool.load_tail().await.unwrap();
            spool.stage(&[3u8; 10]);
            spool.write_staged().await.unwrap();
            spool.commit(spool.commit_point());
            let mut want = vec![1u8; 3000];
            want.extend_from_slice(&[3u8; 10]);
            assert_eq!(spool.committed_sha1(), sha_of(&want));
            let check = [Check {
                end: 3010,
                sha1: sha_of(&want),
                from: None,
            }];
            let (found, _) = Spool::recover_checked(path, 0, &check, SpoolSizing::default())
                .await
                .unwrap();
            assert!(found.is_some(), "the bytes after the take-back are on disk");
        });
    }

    /// Bytes of a refused batch written past the committed point: after
    /// `cut_back`, a record naming them no longer matches the file, the
    /// committed ones still do, and the spool goes on at the committed
    /// point with its allocation kept.
    #[test]
    fn a_cut_back_spool_no_longer_holds_a_refused_batch() {
        let rt = compio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let mut spool = Spool::create(dir.path(), 100).await.unwrap();
            let path = spool.path().to_path_buf();
            spool.ensure_allocated(20_000, 0).unwrap();
            let allocated = std::fs::metadata(&path).unwrap().len();
            let sha_of = |b: &[u8]| -> [u8; 20] {
                let mut s = Sha1::new();
                s.update(b);
                s.finalize()
            };
            spool.stage(&[1u8; 5000]);
            spool.write_staged().await.unwrap();
            spool.commit(spool.commit_point());
            // The refused batch reached the file whole (its fdatasync
            // failed, say).
            spool.stage(&[2u8; 9000]);
            spool.write_staged().await.unwrap();
            spool.rollback();
            spool.cut_back().unwrap();
            assert_eq!(std::fs::metadata(&path).unwrap().len(), allocated);
            let mut refused = vec![1u8; 5000];
            refused.extend_from_slice(&[2u8; 9000]);
            let checks = [
                Check {
                    end: 100 + 14_000,
                    sha1: sha_of(&refused),
                    from: None,
                },
                Check {
                    end: 100 + 5000,
                    sha1: sha_of(&[1u8; 5000]),
                    from: None,
                },
            ];
            let (found, _) =
                Spool::recover_checked(path.clone(), 100, &checks, SpoolSizing::default())
                    .await
                    .unwrap();
            let (_, at) = found.expect("the committed bytes match");
            assert_eq!(at, 1, "the refused batch's record does not stand");
            // Staging goes on at the committed point.
            spool.load_tail().await.unwrap();
            spool.stage(&[3u8; 10]);
            spool.write_staged().await.unwrap();
            spool.commit(spool.commit_point());
            let mut want = vec![1u8; 5000];
            want.extend_from_slice(&[3u8; 10]);
            let check = [Check {
                end: 100 + 5010,
                sha1: sha_of(&want),
                from: None,
            }];
            let (found, _) = Spool::recover_checked(path, 100, &check, SpoolSizing::default())
                .await
                .unwrap();
            assert!(found.is_some());
        });
    }

    #[test]
    fn a_full_disk_says_what_the_write_needed() {
        let e = StorageError::Full {
            path: "/d/spool".into(),
            need: 409600,
            free: 16764928,
            reserve: 16777216,
        };
        assert_eq!(
            e.to_string(),
            "/d/spool: disk full: needs 409600 bytes, 16764928 bytes free, 16777216 reserved"
        );
    }

    #[test]
    fn a_write_leaves_staging_to_a_buffer_no_larger_than_its_own() {
        let rt = compio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let mut spool = Spool::create(dir.path(), 0).await.unwrap();
            let own = spool.buf.capacity();
            assert_eq!(own, FIRST_BUFFER_BYTES);
            // A large idle buffer in the pool stays there.
            crate::pool::give(AlignedBuf::new(1 << 20));
            spool.ensure_allocated(5000, 0).unwrap();
            assert_eq!(spool.stage(&[3u8; 5000]), 5000);
            let w = spool.take_write().expect("bytes staged");
            assert!(spool.buf.capacity() <= own);
            assert!(crate::pool::idle_bytes() >= 1 << 20);
            // Staging goes on behind the write, from the tail block.
            assert_eq!(spool.stage(&[4u8; 100]), 100);
            let file = spool.file().clone();
            let (res, w) = w.run(&file).await;
            res.unwrap();
            spool.write_done(w, true);
            spool.write_staged().await.unwrap();
            spool.commit(spool.commit_point());
            let (block, range) = read_range(spool.file(), 0, 5100).await.unwrap();
            let got = &block.as_slice()[range];
            assert!(got[..5000].iter().all(|&b| b == 3) && got[5000..].iter().all(|&b| b == 4));
        });
    }

    #[test]
    fn a_recycled_file_is_overwritten_in_place_and_its_old_bytes_never_surface() {
        use rand::{Rng, SeedableRng};
        use sha1::Digest;
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let old: Vec<u8> = (0..(3 << 20) + 777).map(|_| rng.r#gen()).collect();
        let dir = tempfile::tempdir().unwrap();
        let spare = dir.path().join("spare-0");
        std::fs::write(&spare, &old).unwrap();
        let begin = 5000;
        let rt = compio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let mut spool =
                Spool::create_recycled(&spare, dir.path(), begin, SpoolSizing::default())
                    .await
                    .unwrap();
            assert!(!spare.exists());
            assert_eq!(spool.path(), dir.path().join(spool_file_name(begin)));
            // Within the old file no fallocate is needed and the file keeps
            // its length: every write overwrites written blocks.
            let new: Vec<u8> = (0..(2 << 20) + 12345).map(|_| rng.r#gen()).collect();
            for piece in new.chunks(300_001) {
                spool.ensure_allocated(piece.len() as u64, 0).unwrap();
                assert_eq!(spool.stage(piece), piece.len());
                spool.write_staged().await.unwrap();
                spool.commit(spool.commit_point());
            }
            let path = spool.path().to_path_buf();
            assert_eq!(std::fs::metadata(&path).unwrap().len(), old.len() as u64);
            let want: [u8; 20] = sha1::Sha1::digest(&new).into();
            assert_eq!(spool.committed_sha1(), want);
            // After a crash, recovery hashes the committed bytes only.
            let end = spool.committed();
            drop(spool);
            let (mut spool, digest) = Spool::recover(path.clone(), begin, end).await.unwrap();
            assert_eq!(digest, want);
            // Growing past the old file works as for a new spool.
            let more = vec![9u8; 2 << 20];
            spool.ensure_allocated(more.len() as u64, 0).unwrap();
            assert_eq!(spool.stage(&more), more.len());
            spool.write_staged().await.unwrap();
            spool.commit(spool.commit_point());
            // The seal cuts the old bytes off.
            let frag = spool.seal(false).await.unwrap().unwrap();
            let mut all = new.clone();
            all.extend_from_slice(&more);
            assert_eq!(std::fs::read(&frag.path).unwrap(), all);
            assert_eq!(frag.sha1, <[u8; 20]>::from(sha1::Sha1::digest(&all)));

            // An empty spool gives its file back whole.
            let spare = dir.path().join("spare-1");
            std::fs::write(&spare, &old).unwrap();
            let empty = Spool::create_recycled(&spare, dir.path(), 1 << 40, SpoolSizing::default())
                .await
                .unwrap();
            let (path, len) = empty.into_empty_file();
            assert_eq!(len, align_down(old.len() as u64));
            assert_eq!(std::fs::read(&path).unwrap(), old);
        });
    }

    /// After a burst, a journal whose batches are small again stages into
    /// a small buffer, even while the pool holds large idle ones, and its
    /// large buffer goes back to the pool.
    #[test]
    fn a_spool_whose_batches_shrink_gives_its_large_buffer_back() {
        let rt = compio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let mut spool = Spool::create(dir.path(), 0).await.unwrap();
            let mut expected = Vec::new();
            let mut batch = |spool: &mut Spool, len: usize, fill: u8| {
                spool.ensure_allocated(len as u64, 0).unwrap();
                assert_eq!(spool.stage(&vec![fill; len]), len);
                expected.extend(std::iter::repeat_n(fill, len));
            };
            // A burst: a batch of 1 MiB, written while the pool holds
            // another large buffer, which the next batch stages into.
            batch(&mut spool, 1 << 20, 1);
            crate::pool::give(AlignedBuf::new(1 << 20));
            spool.write_staged().await.unwrap();
            assert!(
                spool.buf.capacity() >= 1 << 20,
                "a burst keeps a large buffer"
            );
            spool.commit(spool.commit_point());
            // Small again: the next buffer is a small one, though the
            // pool holds the burst's first buffer idle.
            batch(&mut spool, 1000, 2);
            spool.write_staged().await.unwrap();
            assert!(
                spool.buf.capacity() <= FIRST_BUFFER_BYTES,
                "{} bytes for a batch of 1000",
                spool.buf.capacity()
            );
            assert!(
                crate::pool::idle_bytes() >= 2 << 20,
                "both large buffers idle"
            );
            spool.commit(spool.commit_point());
            let (block, range) = read_range(spool.file(), 0, expected.len()).await.unwrap();
            assert!(block.as_slice()[range] == expected[..], "bytes differ");
        });
    }

    #[test]
    fn buffers_start_small_grow_on_demand_and_are_reused_without_their_stale_bytes() {
        let rt = compio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let max = SPOOL_BUFFER_BYTES + BLOCK;
            let mut spool = Spool::create(dir.path(), 0).await.unwrap();
            assert_eq!(spool.room(), max, "room counts what the buffer can grow to");
            // One batch larger than the first buffer is taken whole.
            let big: Vec<u8> = (0..1_000_000u32).map(|i| (i % 251) as u8).collect();
            spool.ensure_allocated(big.len() as u64, 0).unwrap();
            assert_eq!(spool.stage(&big), big.len());
            spool.write_staged().await.unwrap();
            spool.commit(spool.commit_point());
            let frag = spool.seal(false).await.unwrap().unwrap();
            assert_eq!(std::fs::read(&frag.path).unwrap(), big);

            // The sealed spool's buffer, full of its bytes, goes to the next
            // spool; bytes past a partial block are zeros on disk, not the
            // previous fragment's.
            let mut next = Spool::create(dir.path(), big.len() as u64).await.unwrap();
            assert!(next.buf.capacity() > FIRST_BUFFER_BYTES);
            next.ensure_allocated(100, 0).unwrap();
            assert_eq!(next.stage(&[7u8; 100]), 100);
            next.write_staged().await.unwrap();
            let mut on_disk = vec![0u8; BLOCK];
            let (block, range) = read_range(next.file(), 0, BLOCK).await.unwrap();
            on_disk[..range.len()].copy_from_slice(&block.as_slice()[range]);
            assert_eq!(&on_disk[..100], &[7u8; 100][..]);
            assert!(
                on_disk[100..].iter().all(|&b| b == 0),
                "stale bytes written"
            );
        });
    }
}
