//! The shard's commit log: which bytes of each spool are committed, and the
//! journal's registers at that commit.
//!
//! Spool files hold bytes of appends that may later roll back, so the file
//! alone cannot say where the committed bytes end. For each batch the shard
//! appends one record per journal it commits, writing the records and the
//! batch's spool bytes at the same time, and acknowledges the batch only
//! once both writes completed (and, for `fsync` journals, were fdatasync'ed).
//! A record can therefore reach the disk while its spool bytes do not (a
//! crash between the two writes): on restart, the last record of a journal
//! names its spool's committed end only if the spool's bytes hash to the
//! record's SHA-1; otherwise the record before it stands, which described a
//! batch whose writes had all completed. Everything beyond is discarded.
//!
//! A batch of few bytes does not wait for its spool write at all: its
//! record carries the bytes themselves (kind 3), the log's write into the
//! page cache is all that must complete before the batch is answered, and
//! the spool write finishes during the same turn. The turn still waits for
//! it before the next batch, so again only a journal's last record can name
//! bytes missing from its spool; if that record carries them, recovery
//! writes them into the spool ([`Replayed::inline`]).
//!
//! Checking a spool's bytes against its record means hashing them. After
//! a restart in the same boot only the last batch can be missing (every
//! write that completed is there to read), so a record also carries the
//! fragment SHA-1's state where its batch began ([`Midstate`]), and
//! recovery hashes from there. After a reboot the disk may have lost
//! writes the kernel had completed, so recovery hashes each spool whole.
//!
//! Record: `u32 payload_len | u32 crc32c(payload) | payload`, little-endian.
//! Payload: `u8 kind | str16 journal | (kinds 1, 3, 4, 5) u64 spool_begin |
//! u64 end | [u8; 20] sha1 | (kinds 4, 5) u64 mid_at | [u8; 20] mid_state |
//! label set registers | (kinds 3, 5) u64 at | bytes`, where `bytes` runs to
//! the end of the payload and are the journal's bytes `[at, end)`. Kind 2
//! deletes the journal. Kinds 1 and 3 are records of earlier versions,
//! without a midstate; kinds 4 and 5 are written now.
//! Reading stops at the first record that is truncated or fails its CRC.
//! That may be the torn tail of a write that never completed, which is cut
//! off, or damage, which stops the start (see [`torn_tail_error`]).

use crate::faults::DiskOp;
use crate::StorageError;
use compio::fs::{File, OpenOptions};
use compio::io::AsyncWriteAtExt;
use rotary_proto::spec::LabelSet;
use std::cell::RefCell;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::rc::Rc;

const KIND_COMMIT: u8 = 1;
const KIND_DELETE: u8 = 2;
const KIND_COMMIT_INLINE: u8 = 3;
const KIND_COMMIT_MID: u8 = 4;
const KIND_COMMIT_INLINE_MID: u8 = 5;
/// The log is rewritten from a snapshot once it grows past this size.
pub const COMMIT_LOG_COMPACT_BYTES: u64 = 64 << 20;
const FILE_NAME: &str = "commit.log";
/// A record's header: `u32 payload_len | u32 crc32c(payload)`.
const RECORD_HEADER_LEN: usize = 8;
/// Most bytes one record may carry (kind 3). The shard carries fewer (its
/// own limit, checked against this one at compile time).
pub const RECORD_INLINE_BYTES_MAX: usize = 64 << 10;
/// Most bytes a record's encoded registers take. Registers reach the log
/// from an append's metadata, which the wire bounds more tightly (checked
/// below), so a record written from any append fits.
const REGISTERS_LEN_MAX: usize = u16::MAX as usize;
const _: () = assert!(rotary_proto::wire::REGISTERS_ENCODED_LEN_MAX <= REGISTERS_LEN_MAX);
/// Largest payload of a record: kind, journal name (`str16`), spool_begin,
/// end, SHA-1, registers, `at` and the carried bytes.
pub const RECORD_PAYLOAD_LEN_MAX: usize = 1
    + 2
    + u16::MAX as usize
    + 8
    + 8
    + 20
    + MID_LEN
    + REGISTERS_LEN_MAX
    + 8
    + RECORD_INLINE_BYTES_MAX;
/// `u64 mid_at | [u8; 20] mid_state`.
const MID_LEN: usize = 8 + 20;
const _: () = assert!(RECORD_PAYLOAD_LEN_MAX <= u32::MAX as usize);

/// A journal's last committed state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct JournalState {
    pub spool_begin: u64,
    pub end: u64,
    /// SHA-1 of the spool's bytes `[spool_begin, end)`.
    pub sha1: [u8; 20],
    pub registers: LabelSet,
    /// Where the bytes this state commits began to be written; `None` in
    /// records of earlier versions.
    pub mid: Option<Midstate>,
}

/// The fragment SHA-1's state after the spool's bytes `[spool_begin, at)`,
/// all of which had been written when the record was: those of earlier
/// commits, up to the last 64-byte block boundary before the bytes the
/// record commits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Midstate {
    /// A journal offset, `spool_begin` plus a multiple of 64.
    pub at: u64,
    pub h: [u32; 5],
}

impl Midstate {
    /// The block state of `sha`, a spool's SHA-1 from `spool_begin` on.
    pub fn of(spool_begin: u64, sha: &crate::sha::Sha1) -> Midstate {
        let (hashed, h) = sha.block_state();
        Midstate {
            at: spool_begin + hashed,
            h,
        }
    }

    /// The SHA-1 state to go on from, if the midstate fits the spool
    /// beginning at `spool_begin` and a commit ending at `end`.
    pub fn resume(&self, spool_begin: u64, end: u64) -> Option<crate::sha::Sha1> {
        if self.at < spool_begin || self.at > end {
            return None;
        }
        crate::sha::Sha1::resume(self.at - spool_begin, self.h)
    }

    fn encode(&self) -> [u8; MID_LEN] {
        let mut out = [0u8; MID_LEN];
        out[..8].copy_from_slice(&self.at.to_le_bytes());
        for (i, w) in self.h.iter().enumerate() {
            out[8 + 4 * i..12 + 4 * i].copy_from_slice(&w.to_le_bytes());
        }
        out
    }

    fn decode(b: [u8; MID_LEN]) -> Midstate {
        let word = |i: usize| u32::from_le_bytes(b[8 + 4 * i..12 + 4 * i].try_into().expect("4"));
        Midstate {
            at: u64::from_le_bytes(b[..8].try_into().expect("8 bytes")),
            h: [word(0), word(1), word(2), word(3), word(4)],
        }
    }
}

pub struct CommitLog {
    file: File,
    /// The same file, for writing records with a plain `pwrite` on the
    /// shard's thread: io_uring cannot write to ext4's page cache without
    /// blocking, so it hands such a write to a worker thread, which costs
    /// two context switches per batch on the shard's core for a write of a
    /// few hundred bytes into memory.
    writer: std::fs::File,
    path: PathBuf,
    pos: u64,
    pending: Vec<u8>,
    compact_bytes: u64,
    /// A compaction under way in the background ([`CommitLog::begin_compaction`]).
    next: Option<Next>,
    /// Most bytes a compaction's tail may hold ([`COMPACTION_TAIL_BYTES_MAX`]).
    tail_max: usize,
    /// A compaction renamed a new file over the log and the directory has
    /// not been synced since: the next synced flush syncs it, so that the
    /// rename is as durable as the records it acknowledges.
    dir_unsynced: bool,
}

/// A snapshot being written and synced beside the log, while records go
/// on being written to the log itself.
struct Next {
    /// The synced snapshot file, once its task is done.
    done: Rc<RefCell<Option<Result<File, StorageError>>>>,
    /// Bytes of the snapshot: where the copied records go.
    snapshot_len: u64,
    /// Records written to the log since the snapshot's states were taken;
    /// they follow the snapshot in the new file.
    tail: Vec<u8>,
    /// Some of `tail` was fdatasync'ed for an ack: the new file must hold
    /// it synced before it replaces the log.
    tail_synced: bool,
    /// The tail outgrew [`CommitLog::tail_max`]: the snapshot is
    /// dropped once its task is done.
    abandoned: bool,
}

/// Most bytes of records a background compaction holds in memory for its
/// new file while its snapshot syncs (a disk that stalls for seconds).
const COMPACTION_TAIL_BYTES_MAX: usize = 64 << 20;

/// The journal's bytes `[at, end)` of a commit, carried in its record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Inline {
    pub at: u64,
    pub bytes: Vec<u8>,
}

/// Builds a record's payload. The log's own encoding: it must never follow
/// a change of the wire's (the golden test below pins its bytes).
#[derive(Default)]
struct RecordWriter {
    buf: Vec<u8>,
}

impl RecordWriter {
    fn u8(&mut self, v: u8) -> &mut Self {
        self.buf.push(v);
        self
    }

    fn u64(&mut self, v: u64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }

    fn raw(&mut self, bytes: &[u8]) -> &mut Self {
        self.buf.extend_from_slice(bytes);
        self
    }

    /// `u16 length | bytes`. Journal names, label names and label values
    /// are all far shorter (the spec rules); longer is a bug.
    fn str16(&mut self, s: &str) -> &mut Self {
        let len = u16::try_from(s.len()).expect("commit log string fits u16");
        self.buf.extend_from_slice(&len.to_le_bytes());
        self.raw(s.as_bytes())
    }

    /// `u16 count | (str16 name, str16 value)*`, in the set's order.
    fn labels(&mut self, set: &LabelSet) -> &mut Self {
        let n = u16::try_from(set.len()).expect("register count fits u16");
        self.buf.extend_from_slice(&n.to_le_bytes());
        for l in set.iter() {
            self.str16(&l.name).str16(&l.value);
        }
        self
    }
}

/// Reads a record's payload; every read is bounds-checked and `None` on
/// bytes that do not hold what is asked (a damaged record).
struct RecordReader<'a> {
    buf: &'a [u8],
}

impl<'a> RecordReader<'a> {
    fn bytes(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.buf.len() < n {
            return None;
        }
        let (v, rest) = self.buf.split_at(n);
        self.buf = rest;
        Some(v)
    }

    fn array<const N: usize>(&mut self) -> Option<[u8; N]> {
        self.bytes(N)?.try_into().ok()
    }

    fn u8(&mut self) -> Option<u8> {
        Some(self.array::<1>()?[0])
    }

    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.array()?))
    }

    fn str16(&mut self) -> Option<&'a str> {
        let len = u16::from_le_bytes(self.array()?) as usize;
        std::str::from_utf8(self.bytes(len)?).ok()
    }

    /// A label set; its labels must be valid and sorted, as written.
    fn labels(&mut self) -> Option<LabelSet> {
        let n = u16::from_le_bytes(self.array()?);
        let mut set = LabelSet::new();
        for _ in 0..n {
            let name = self.str16()?.to_string();
            let value = self.str16()?.to_string();
            set.push_sorted(name, value).ok()?;
        }
        Some(set)
    }

    fn finish(self) -> Option<()> {
        self.buf.is_empty().then_some(())
    }
}

fn encode_record(
    out: &mut Vec<u8>,
    journal: &str,
    state: Option<&JournalState>,
    inline: Option<(u64, &[u8])>,
) {
    let mut w = RecordWriter::default();
    match state {
        Some(st) => {
            let kind = match (inline.is_some(), st.mid.is_some()) {
                (false, false) => KIND_COMMIT,
                (true, false) => KIND_COMMIT_INLINE,
                (false, true) => KIND_COMMIT_MID,
                (true, true) => KIND_COMMIT_INLINE_MID,
            };
            w.u8(kind).str16(journal);
            w.u64(st.spool_begin).u64(st.end).raw(&st.sha1);
            if let Some(mid) = &st.mid {
                w.raw(&mid.encode());
            }
            w.labels(&st.registers);
            if let Some((at, bytes)) = inline {
                assert!(bytes.len() <= RECORD_INLINE_BYTES_MAX);
                debug_assert_eq!(at + bytes.len() as u64, st.end);
                w.u64(at).raw(bytes);
            }
        }
        None => {
            w.u8(KIND_DELETE).str16(journal);
        }
    }
    frame(out, &w.buf);
}

/// A log holding exactly `states`: one commit record each.
fn snapshot<'a>(states: impl Iterator<Item = (&'a str, &'a JournalState)>) -> Vec<u8> {
    let mut bytes = Vec::new();
    for (journal, st) in states {
        encode_record(&mut bytes, journal, Some(st), None);
    }
    bytes
}

/// Appends one record: `u32 payload_len | u32 crc32c(payload) | payload`.
fn frame(out: &mut Vec<u8>, payload: &[u8]) {
    // Recovery takes a longer record for damage (see `torn_tail_error`).
    debug_assert!(payload.len() <= RECORD_PAYLOAD_LEN_MAX);
    out.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    out.extend_from_slice(&crc32c::crc32c(payload).to_le_bytes());
    out.extend_from_slice(payload);
}

/// A second descriptor of `file` for plain writes.
fn writer_of(file: &File, path: &Path) -> Result<std::fs::File, StorageError> {
    use std::os::fd::AsFd;
    let fd = file
        .as_fd()
        .try_clone_to_owned()
        .map_err(|e| StorageError::io(path, e))?;
    Ok(std::fs::File::from(fd))
}

/// What the log holds for one journal: its last record and the one before
/// it. Only the last can describe spool bytes that never reached the disk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Replayed {
    pub last: JournalState,
    pub prev: Option<JournalState>,
    /// The bytes the last record carries, if it carries them.
    pub inline: Option<Inline>,
}

impl Replayed {
    /// The candidate states, most recent first.
    pub fn candidates(&self) -> impl Iterator<Item = &JournalState> {
        std::iter::once(&self.last).chain(self.prev.as_ref())
    }
}

/// Parses records from `bytes`, applying them to `states`. Returns the
/// length of the valid prefix.
pub fn replay(bytes: &[u8], states: &mut HashMap<String, Replayed>) -> usize {
    walk(bytes, |record| record.apply_to(states))
}

/// One record of the log, as [`records`] reads it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Record {
    /// The journal's committed state, and the bytes the record carries.
    Commit {
        journal: String,
        state: JournalState,
        inline: Option<Inline>,
    },
    /// The journal was deleted.
    Delete { journal: String },
}

impl Record {
    pub fn journal(&self) -> &str {
        match self {
            Record::Commit { journal, .. } | Record::Delete { journal } => journal,
        }
    }

    fn apply_to(self, states: &mut HashMap<String, Replayed>) {
        match self {
            Record::Commit {
                journal,
                state,
                inline,
            } => {
                let prev = states.remove(&journal).map(|r| r.last);
                let last = state;
                states.insert(journal, Replayed { last, prev, inline });
            }
            Record::Delete { journal } => {
                states.remove(&journal);
            }
        }
    }
}

/// The records of a log's bytes, in order: those [`replay`] applies, up
/// to the first that is cut short, fails its CRC or does not parse.
pub fn records(bytes: &[u8]) -> Vec<Record> {
    let mut out = Vec::new();
    walk(bytes, |record| out.push(record));
    out
}

/// Hands each valid record of `bytes` to `each`, in order. Returns the
/// length of the valid prefix.
fn walk(bytes: &[u8], mut each: impl FnMut(Record)) -> usize {
    let mut pos = 0;
    while bytes.len() - pos >= 8 {
        let len = u32::from_le_bytes(bytes[pos..pos + 4].try_into().expect("4 bytes")) as usize;
        let crc = u32::from_le_bytes(bytes[pos + 4..pos + 8].try_into().expect("4 bytes"));
        if len == 0 || bytes.len() - pos - 8 < len {
            break;
        }
        let payload = &bytes[pos + 8..pos + 8 + len];
        if crc32c::crc32c(payload) != crc {
            break;
        }
        let Some(record) = decode(payload) else {
            break;
        };
        each(record);
        pos += 8 + len;
    }
    pos
}

/// Why `tail`, the bytes after the log's last valid record, cannot be the
/// torn tail of an interrupted write; `None` if it can.
///
/// The log only grows by [`CommitLog::write_pending`]: one write at its
/// end of whole records, in order (a failed write is cut back off). It is
/// replaced whole only by a file renamed over it (compaction): a synced
/// snapshot, then records written as here (synced first if any was). A
/// write cut short (`kill -9`, a crash before the page cache reached a
/// file system that keeps appends in order) leaves a prefix of its bytes:
/// whole records, which replay reads, then a proper prefix of one record.
/// A file system that extends a file before its data reaches the disk
/// leaves zeros instead (power loss). So the tail is torn only if it is
/// shorter than a header, only zeros, or its header
/// names a length a record can have that reaches past the end of the file
/// and that the record's fields, as far as they are there, agree with.
/// Anything else (a whole record failing its CRC or not parsing, a length
/// the fields contradict) is damage, and the records behind it may be
/// acknowledged commits: cutting them off would lose them silently.
///
/// The tail is not searched for records further on: a torn record may
/// carry a client's bytes, which can hold well-formed records of their
/// own. The checks above already catch every single damaged byte in front
/// of valid records, since a changed length disagrees with the fields.
pub fn torn_tail_error(tail: &[u8]) -> Option<String> {
    if tail.len() < RECORD_HEADER_LEN || tail.iter().all(|&b| b == 0) {
        return None;
    }
    let len = u32::from_le_bytes(tail[..4].try_into().expect("4 bytes")) as usize;
    if len == 0 {
        return Some("a record header with length 0".into());
    }
    if len > RECORD_PAYLOAD_LEN_MAX {
        return Some(format!(
            "a record header with length {len}, more than a record can hold ({RECORD_PAYLOAD_LEN_MAX})"
        ));
    }
    let present = &tail[RECORD_HEADER_LEN..];
    if present.len() >= len {
        let payload = &present[..len];
        let crc = u32::from_le_bytes(tail[4..8].try_into().expect("4 bytes"));
        return Some(if crc32c::crc32c(payload) != crc {
            format!("a whole record of {len} bytes fails its CRC")
        } else {
            format!("a whole record of {len} bytes with a valid CRC does not parse")
        });
    }
    match implied_payload_len(present) {
        Err(why) => Some(why),
        Ok(Some(implied)) if implied != len as u64 => Some(format!(
            "a record header with length {len}, whose fields make it {implied} bytes long"
        )),
        Ok(_) => None,
    }
}

/// The payload length the fields at the start of `p` imply, if enough of
/// them are there to tell.
fn implied_payload_len(p: &[u8]) -> Result<Option<u64>, String> {
    let u16_at = |at: u64| -> Option<u64> {
        let at = usize::try_from(at).ok()?;
        let b = p.get(at..at.checked_add(2)?)?;
        Some(u64::from(u16::from_le_bytes([b[0], b[1]])))
    };
    let u64_at = |at: u64| -> Option<u64> {
        let at = usize::try_from(at).ok()?;
        let b = p.get(at..at.checked_add(8)?)?;
        Some(u64::from_le_bytes(b.try_into().expect("8 bytes")))
    };
    let Some(&kind) = p.first() else {
        return Ok(None);
    };
    if !matches!(
        kind,
        KIND_COMMIT | KIND_DELETE | KIND_COMMIT_INLINE | KIND_COMMIT_MID | KIND_COMMIT_INLINE_MID
    ) {
        return Err(format!("a record of unknown kind {kind}"));
    }
    // kind | str16 journal
    let Some(name_len) = u16_at(1) else {
        return Ok(None);
    };
    let mut at = 3 + name_len;
    if kind == KIND_DELETE {
        return Ok(Some(at));
    }
    // spool_begin | end | sha1 | (mid) | u16 count | (str16 name | str16 value)*
    let end_at = at + 8;
    at += 8 + 8 + 20;
    if matches!(kind, KIND_COMMIT_MID | KIND_COMMIT_INLINE_MID) {
        at += MID_LEN as u64;
    }
    let Some(count) = u16_at(at) else {
        return Ok(None);
    };
    at += 2;
    for _ in 0..2 * count {
        let Some(n) = u16_at(at) else {
            return Ok(None);
        };
        at += 2 + n;
    }
    if matches!(kind, KIND_COMMIT | KIND_COMMIT_MID) {
        return Ok(Some(at));
    }
    // at | bytes [at, end)
    let (Some(end), Some(from)) = (u64_at(end_at), u64_at(at)) else {
        return Ok(None);
    };
    match end.checked_sub(from) {
        Some(carried) => Ok(Some((at + 8).saturating_add(carried))),
        None => Err(format!(
            "a record carrying bytes from {from} to {end}, which ends before it begins"
        )),
    }
}

fn decode(payload: &[u8]) -> Option<Record> {
    let mut r = RecordReader { buf: payload };
    let kind = r.u8()?;
    let journal = r.str16()?.to_string();
    match kind {
        KIND_COMMIT | KIND_COMMIT_INLINE | KIND_COMMIT_MID | KIND_COMMIT_INLINE_MID => {
            let spool_begin = r.u64()?;
            let end = r.u64()?;
            let sha1: [u8; 20] = r.array()?;
            let mid = if matches!(kind, KIND_COMMIT_MID | KIND_COMMIT_INLINE_MID) {
                Some(Midstate::decode(r.array()?))
            } else {
                None
            };
            let registers = r.labels()?;
            let inline = if matches!(kind, KIND_COMMIT_INLINE | KIND_COMMIT_INLINE_MID) {
                let at = r.u64()?;
                let len = end.checked_sub(at)?;
                if at < spool_begin || len > payload.len() as u64 {
                    return None;
                }
                let bytes = r.bytes(len as usize)?.to_vec();
                Some(Inline { at, bytes })
            } else {
                None
            };
            r.finish()?;
            if end < spool_begin {
                return None;
            }
            let state = JournalState {
                spool_begin,
                end,
                sha1,
                registers,
                mid,
            };
            Some(Record::Commit {
                journal,
                state,
                inline,
            })
        }
        KIND_DELETE => {
            r.finish()?;
            Some(Record::Delete { journal })
        }
        _ => None,
    }
}

impl CommitLog {
    /// The log's file in `dir`. Every shard directory has one from its
    /// first start on: [`CommitLog::settle`] writes it.
    pub fn path_in(dir: &Path) -> PathBuf {
        dir.join(FILE_NAME)
    }

    /// Reads the log in `dir` (if any), cuts off a torn last record, and
    /// opens it for appending. Returns the log and what it holds for each
    /// journal. The caller decides which state stands for each journal
    /// (see [`Replayed`]) and then calls [`CommitLog::settle`]. Fails
    /// with [`StorageError::Corrupt`], changing nothing, if the bytes after
    /// the last valid record are not a torn tail ([`torn_tail_error`]).
    pub async fn open(dir: &Path) -> Result<(CommitLog, HashMap<String, Replayed>), StorageError> {
        let path = Self::path_in(dir);
        let mut states = HashMap::new();
        let bytes = match std::fs::read(&path) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(e) => return Err(StorageError::io(&path, e)),
        };
        let valid = replay(&bytes, &mut states);
        if let Some(why) = torn_tail_error(&bytes[valid..]) {
            return Err(StorageError::Corrupt {
                path,
                why: format!(
                    "the {} bytes after the valid records (offset {valid}) are no torn last write: {why}",
                    bytes.len() - valid
                ),
            });
        }
        if valid < bytes.len() {
            tracing::warn!(
                path = %path.display(),
                torn_bytes = bytes.len() - valid,
                "commit log ends in a torn record; ignoring it"
            );
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .open(&path)
            .await
            .map_err(|e| StorageError::io(&path, e))?;
        if valid < bytes.len() {
            file.set_len(valid as u64)
                .await
                .map_err(|e| StorageError::io(&path, e))?;
        }
        let writer = writer_of(&file, &path)?;
        Ok((
            CommitLog {
                file,
                writer,
                path,
                pos: valid as u64,
                pending: Vec::with_capacity(64 << 10),
                compact_bytes: COMMIT_LOG_COMPACT_BYTES,
                next: None,
                tail_max: COMPACTION_TAIL_BYTES_MAX,
                dir_unsynced: false,
            },
            states,
        ))
    }

    /// Records the states chosen at recovery and compacts the log to them.
    /// `restated` are the journals whose chosen state is not their last
    /// record (`None`: nothing committed); they are written as records
    /// first, so the log stays right even if compaction fails (a full disk
    /// leaves the uncompacted log in place).
    pub async fn settle<'a>(
        &mut self,
        restated: impl Iterator<Item = (&'a str, Option<&'a JournalState>)>,
        states: impl Iterator<Item = (&'a str, &'a JournalState)>,
    ) -> Result<(), StorageError> {
        for (journal, st) in restated {
            encode_record(&mut self.pending, journal, st, None);
        }
        self.flush(true).await?;
        match self.compact(states).await {
            Err(e) if e.is_full() => {
                tracing::warn!(error = %e, "disk full; continuing with the uncompacted commit log");
                Ok(())
            }
            res => res,
        }
    }

    /// Writes a log holding exactly `states` and moves it into place
    /// atomically (write, fdatasync, rename, fsync dir).
    async fn write_snapshot<'a>(
        path: &Path,
        states: impl Iterator<Item = (&'a str, &'a JournalState)>,
    ) -> Result<File, StorageError> {
        let tmp = path.with_extension("log.next");
        let written = Self::write_synced(&tmp, snapshot(states)).await;
        if written.is_err() {
            // A full disk, say: the log stays as it was, and no partial
            // snapshot is left taking space beside it.
            let _ = std::fs::remove_file(&tmp);
        }
        let file = written?;
        compio::fs::rename(&tmp, path)
            .await
            .map_err(|e| StorageError::io(path, e))?;
        crate::sync_dir(path.parent().expect("log has a directory")).await?;
        Ok(file)
    }

    /// Writes `bytes` to a new file at `tmp` and syncs its data.
    async fn write_synced(tmp: &Path, bytes: Vec<u8>) -> Result<File, StorageError> {
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(tmp)
            .await
            .map_err(|e| StorageError::io(tmp, e))?;
        // A write cut short (the disk filling up) goes on with the rest,
        // which then fails with the cause (ENOSPC: a full disk).
        crate::faults::inject(DiskOp::LogWrite, tmp).map_err(|e| StorageError::io(tmp, e))?;
        let (res, _) = file.write_all_at(bytes, 0).await.into();
        res.map_err(|e| StorageError::io(tmp, e))?;
        crate::faults::inject(DiskOp::LogSync, tmp).map_err(|e| StorageError::io(tmp, e))?;
        file.sync_data()
            .await
            .map_err(|e| StorageError::io(tmp, e))?;
        Ok(file)
    }

    pub fn record_commit(&mut self, journal: &str, state: &JournalState) {
        encode_record(&mut self.pending, journal, Some(state), None);
    }

    /// A commit whose record carries the journal's bytes `[at, state.end)`.
    pub fn record_commit_inline(
        &mut self,
        journal: &str,
        state: &JournalState,
        at: u64,
        bytes: &[u8],
    ) {
        encode_record(&mut self.pending, journal, Some(state), Some((at, bytes)));
    }

    pub fn record_delete(&mut self, journal: &str) {
        encode_record(&mut self.pending, journal, None, None);
    }

    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Drops records not yet written (their batch failed).
    pub fn discard_pending(&mut self) {
        self.pending.clear();
    }

    /// Writes pending records with a plain `pwrite` on the calling thread,
    /// into the page cache: they survive the process, not the machine.
    pub fn write_pending(&mut self) -> Result<(), StorageError> {
        if !self.pending.is_empty() {
            use std::os::unix::fs::FileExt;
            let written = crate::faults::inject(DiskOp::LogWrite, &self.path)
                .and_then(|()| self.writer.write_all_at(&self.pending, self.pos));
            if let Err(e) = written {
                // Part of it may be in the file. Cut back, so that the log
                // never holds more than a torn last write behind its
                // records (see `torn_tail_error`); the next write would
                // otherwise overwrite its start and leave the rest behind.
                // Shrinking needs no space, so this works on a full disk.
                if let Err(cut) = self.writer.set_len(self.pos) {
                    tracing::error!(path = %self.path.display(), error = %cut, "cutting back a failed commit log write");
                }
                return Err(StorageError::io(&self.path, e));
            }
            self.pos += self.pending.len() as u64;
            if let Some(next) = self.next.as_mut().filter(|n| !n.abandoned) {
                if next.tail.len() + self.pending.len() > self.tail_max {
                    next.abandoned = true;
                    next.tail = Vec::new();
                } else {
                    next.tail.extend_from_slice(&self.pending);
                }
            }
            self.pending.clear();
        }
        Ok(())
    }

    /// Writes pending records (synchronously, into the page cache); with
    /// `sync`, fdatasyncs them too.
    pub async fn flush(&mut self, sync: bool) -> Result<(), StorageError> {
        self.write_pending()?;
        if sync {
            crate::faults::inject(DiskOp::LogSync, &self.path)
                .map_err(|e| StorageError::io(&self.path, e))?;
            self.file
                .sync_data()
                .await
                .map_err(|e| StorageError::io(&self.path, e))?;
            if self.dir_unsynced {
                crate::sync_dir(self.path.parent().expect("log has a directory")).await?;
                self.dir_unsynced = false;
            }
            if let Some(next) = self.next.as_mut() {
                next.tail_synced = true;
            }
        }
        Ok(())
    }

    /// The log has grown past its compaction size, and no compaction is
    /// under way.
    pub fn needs_compaction(&self) -> bool {
        self.pos > self.compact_bytes && self.next.is_none()
    }

    /// Sets the size past which [`CommitLog::needs_compaction`] says yes
    /// (default [`COMMIT_LOG_COMPACT_BYTES`]).
    pub fn set_compact_bytes(&mut self, bytes: u64) {
        self.compact_bytes = bytes;
    }

    /// Starts a compaction that does not hold up the log: a snapshot of
    /// `states` (the journals' states after every record written so far)
    /// is written and fdatasync'ed beside the log by a task of its own,
    /// while records go on being written to the log, and copied. Once
    /// [`CommitLog::compaction_ready`], [`CommitLog::finish_compaction`]
    /// appends the copies to the snapshot and renames it over the log.
    /// Pending records must have been written.
    pub fn begin_compaction<'a>(
        &mut self,
        states: impl Iterator<Item = (&'a str, &'a JournalState)>,
    ) {
        assert!(self.pending.is_empty());
        assert!(self.next.is_none(), "a compaction is under way");
        let bytes = snapshot(states);
        let snapshot_len = bytes.len() as u64;
        let done = Rc::new(RefCell::new(None));
        let tmp = self.next_path();
        let set = done.clone();
        compio::runtime::spawn(async move {
            let written = Self::write_synced(&tmp, bytes).await;
            *set.borrow_mut() = Some(written);
        })
        .detach();
        self.next = Some(Next {
            done,
            snapshot_len,
            tail: Vec::new(),
            tail_synced: false,
            abandoned: false,
        });
    }

    /// A compaction's snapshot is written (or failed): time for
    /// [`CommitLog::finish_compaction`].
    pub fn compaction_ready(&self) -> bool {
        self.next
            .as_ref()
            .is_some_and(|n| n.done.borrow().is_some())
    }

    /// Moves a ready compaction's file into place: the records copied
    /// since its snapshot follow the snapshot (fdatasync'ed if any of
    /// them were for an ack), then a rename replaces the log. Returns the
    /// old log's last open descriptor, whose close frees its blocks (slow
    /// with `discard`: a thread other than the shard's should close it);
    /// `None` if the compaction was dropped (its records outgrew the
    /// copy). On failure (a full disk) the log stays as it was and takes
    /// records as before. Pending records must have been written.
    pub async fn finish_compaction(&mut self) -> Result<Option<std::fs::File>, StorageError> {
        assert!(self.pending.is_empty());
        let next = self.next.take().expect("a compaction under way");
        let written = next.done.borrow_mut().take().expect("compaction ready");
        let tmp = self.next_path();
        let switched = match written {
            Ok(file) if !next.abandoned => self.switch_to(file, &tmp, next).await,
            Ok(_) => Ok(None),
            Err(e) => Err(e),
        };
        if !matches!(switched, Ok(Some(_))) {
            let _ = std::fs::remove_file(&tmp);
        }
        switched
    }

    async fn switch_to(
        &mut self,
        file: File,
        tmp: &Path,
        next: Next,
    ) -> Result<Option<std::fs::File>, StorageError> {
        let writer = writer_of(&file, tmp)?;
        let len = next.snapshot_len;
        {
            use std::os::unix::fs::FileExt;
            crate::faults::inject(DiskOp::LogWrite, tmp)
                .and_then(|()| writer.write_all_at(&next.tail, len))
                .map_err(|e| StorageError::io(tmp, e))?;
        }
        if next.tail_synced {
            crate::faults::inject(DiskOp::LogSync, tmp).map_err(|e| StorageError::io(tmp, e))?;
            file.sync_data()
                .await
                .map_err(|e| StorageError::io(tmp, e))?;
        }
        compio::fs::rename(tmp, &self.path)
            .await
            .map_err(|e| StorageError::io(&self.path, e))?;
        // The old file's other descriptor closes here; the caller closes
        // this one, the last.
        self.file = file;
        let old = std::mem::replace(&mut self.writer, writer);
        self.pos = len + next.tail.len() as u64;
        self.dir_unsynced = true;
        Ok(Some(old))
    }

    fn next_path(&self) -> PathBuf {
        self.path.with_extension("log.next")
    }

    /// Sets the most bytes of records a compaction copies for its new file
    /// (default [`COMPACTION_TAIL_BYTES_MAX`]).
    pub fn set_compaction_tail_max(&mut self, bytes: usize) {
        self.tail_max = bytes;
    }

    /// The log's file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Replaces the log with a snapshot of `states`. Pending records must
    /// have been flushed.
    pub async fn compact<'a>(
        &mut self,
        states: impl Iterator<Item = (&'a str, &'a JournalState)>,
    ) -> Result<(), StorageError> {
        assert!(self.pending.is_empty());
        assert!(self.next.is_none(), "a compaction is under way");
        self.file = Self::write_snapshot(&self.path, states).await?;
        self.writer = writer_of(&self.file, &self.path)?;
        self.pos = self
            .file
            .metadata()
            .await
            .map_err(|e| StorageError::io(&self.path, e))?
            .len();
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn st(end: u64, reg: &str) -> JournalState {
        JournalState {
            spool_begin: 7,
            end,
            sha1: [end as u8; 20],
            registers: LabelSet::from_pairs([("r", reg)]).unwrap(),
            mid: None,
        }
    }

    /// A state as this version records it, with a midstate.
    fn st_mid(end: u64, reg: &str) -> JournalState {
        JournalState {
            mid: Some(Midstate {
                at: 7 + 64,
                h: [1, 2, 0x0300_0000, u32::MAX, end as u32],
            }),
            ..st(end, reg)
        }
    }

    /// The bytes of each kind of record, fixed: data directories written by
    /// earlier versions must open, so a change here (e.g. one that followed
    /// a change of the wire's encoding) is a change of the disk format and
    /// needs a new record kind instead.
    #[test]
    fn records_on_disk_keep_their_bytes() {
        let golden = [
            "34000000889b88bb010500612f622f630700000000000000640000000000000064646464646464646464646464646464646464640100010072010031",
            "50000000275bd5ee040500612f622f6307000000000000006e000000000000006e6e6e6e6e6e6e6e6e6e6e6e6e6e6e6e6e6e6e6e4700000000000000010000000200000000000003ffffffff6e0000000100010072010032",
            "3d000000cea78953030300642f6507000000000000000d000000000000000d0d0d0d0d0d0d0d0d0d0d0d0d0d0d0d0d0d0d0d01000100720100330a0000000000000078797a",
            "5800000005926f38050300642f6507000000000000000d000000000000000d0d0d0d0d0d0d0d0d0d0d0d0d0d0d0d0d0d0d0d4700000000000000010000000200000000000003ffffffff0d00000001000100720100340b00000000000000797a",
            "08000000867e107c020500612f622f63",
        ];
        let mut records = Vec::new();
        let mut out = Vec::new();
        encode_record(&mut out, "a/b/c", Some(&st(100, "1")), None);
        records.push(std::mem::take(&mut out));
        encode_record(&mut out, "a/b/c", Some(&st_mid(110, "2")), None);
        records.push(std::mem::take(&mut out));
        encode_record(&mut out, "d/e", Some(&st(13, "3")), Some((10, b"xyz")));
        records.push(std::mem::take(&mut out));
        encode_record(&mut out, "d/e", Some(&st_mid(13, "4")), Some((11, b"yz")));
        records.push(std::mem::take(&mut out));
        encode_record(&mut out, "a/b/c", None, None);
        records.push(std::mem::take(&mut out));
        for (got, want) in records.iter().zip(golden) {
            assert_eq!(hex::encode(got), want);
        }

        // And the fixed bytes read back as those states.
        let log: Vec<u8> = golden
            .iter()
            .flat_map(|h| hex::decode(h).unwrap())
            .collect();
        let mut states = HashMap::new();
        assert_eq!(replay(&log[..log.len() - 16], &mut states), log.len() - 16);
        assert_eq!(states["a/b/c"].last, st_mid(110, "2"));
        assert_eq!(states["a/b/c"].prev, Some(st(100, "1")));
        assert_eq!(states["d/e"].last, st_mid(13, "4"));
        assert_eq!(
            states["d/e"].inline,
            Some(Inline {
                at: 11,
                bytes: b"yz".to_vec()
            })
        );
        assert_eq!(replay(&log, &mut states), log.len());
        assert!(!states.contains_key("a/b/c"));
    }

    #[test]
    fn records_with_and_without_a_midstate_read_back() {
        let mut bytes = Vec::new();
        encode_record(&mut bytes, "a/b/c", Some(&st(100, "1")), None);
        encode_record(&mut bytes, "a/b/c", Some(&st_mid(110, "2")), None);
        encode_record(
            &mut bytes,
            "d/e/f",
            Some(&st(120, "3")),
            Some((117, b"abc")),
        );
        encode_record(
            &mut bytes,
            "d/e/f",
            Some(&st_mid(124, "4")),
            Some((120, b"defg")),
        );
        let mut states = HashMap::new();
        assert_eq!(replay(&bytes, &mut states), bytes.len());
        let got: Vec<_> = states["a/b/c"].candidates().cloned().collect();
        assert_eq!(got, vec![st_mid(110, "2"), st(100, "1")]);
        let got: Vec<_> = states["d/e/f"].candidates().cloned().collect();
        assert_eq!(got, vec![st_mid(124, "4"), st(120, "3")]);
        assert_eq!(
            states["d/e/f"].inline,
            Some(Inline {
                at: 120,
                bytes: b"defg".to_vec()
            })
        );
        // Every cut of a record is a torn tail whose fields agree.
        let mut one = Vec::new();
        encode_record(
            &mut one,
            "d/e/f",
            Some(&st_mid(124, "4")),
            Some((120, b"defg")),
        );
        for cut in 0..one.len() {
            assert_eq!(torn_tail_error(&one[..cut]), None, "cut at {cut}");
        }
    }

    #[test]
    fn replay_keeps_last_two_states_and_stops_at_torn_tail() {
        let mut bytes = Vec::new();
        encode_record(&mut bytes, "a/b/c", Some(&st(10, "1")), None);
        encode_record(&mut bytes, "x/y/z", Some(&st(20, "2")), None);
        encode_record(&mut bytes, "a/b/c", Some(&st(30, "3")), None);
        encode_record(&mut bytes, "x/y/z", None, None);
        let full = bytes.len();
        encode_record(&mut bytes, "a/b/c", Some(&st(40, "4")), None);
        // Every cut inside the last record leaves exactly the first four.
        for cut in full..bytes.len() {
            let mut states = HashMap::new();
            assert_eq!(replay(&bytes[..cut], &mut states), full);
            assert_eq!(states.len(), 1);
            assert_eq!(states["a/b/c"].last, st(30, "3"));
            assert_eq!(states["a/b/c"].prev, Some(st(10, "1")));
        }
        let mut states = HashMap::new();
        assert_eq!(replay(&bytes, &mut states), bytes.len());
        let got: Vec<_> = states["a/b/c"].candidates().cloned().collect();
        assert_eq!(got, vec![st(40, "4"), st(30, "3")]);
        // A flipped bit in a record stops replay there.
        let mut bad = bytes.clone();
        bad[full + 12] ^= 1;
        let mut states = HashMap::new();
        assert_eq!(replay(&bad, &mut states), full);
        // A journal deleted and written again has no earlier state.
        encode_record(&mut bytes, "x/y/z", Some(&st(50, "5")), None);
        let mut states = HashMap::new();
        replay(&bytes, &mut states);
        assert_eq!(states["x/y/z"].prev, None);
    }

    /// `records` reads the log in order, each record as written, and stops
    /// where replay does.
    #[test]
    fn records_come_back_in_order_up_to_the_valid_prefix() {
        let mut bytes = Vec::new();
        encode_record(&mut bytes, "a", Some(&st(10, "1")), None);
        encode_record(&mut bytes, "a", None, None);
        encode_record(&mut bytes, "b", Some(&st(20, "2")), Some((15, &[7u8; 5])));
        let valid = bytes.len();
        encode_record(&mut bytes, "a", Some(&st(30, "3")), None);
        bytes.truncate(bytes.len() - 1);
        let commit = |journal: &str, state: JournalState, inline: Option<Inline>| Record::Commit {
            journal: journal.into(),
            state,
            inline,
        };
        let want = vec![
            commit("a", st(10, "1"), None),
            Record::Delete {
                journal: "a".into(),
            },
            commit(
                "b",
                st(20, "2"),
                Some(Inline {
                    at: 15,
                    bytes: vec![7; 5],
                }),
            ),
        ];
        assert_eq!(records(&bytes), want);
        assert_eq!(records(&bytes[..valid]), want);
        assert_eq!(replay(&bytes, &mut HashMap::new()), valid);
        assert_eq!(want[1].journal(), "a");
    }

    #[test]
    fn only_the_last_record_keeps_its_inline_bytes() {
        let mut bytes = Vec::new();
        let mut log = |st: JournalState, inline: Option<(u64, &[u8])>| {
            encode_record(&mut bytes, "a/b/c", Some(&st), inline);
        };
        log(st(10, "1"), Some((7, b"abc")));
        log(st(12, "2"), Some((10, b"de")));
        let mut states = HashMap::new();
        replay(&bytes, &mut states);
        let r = &states["a/b/c"];
        assert_eq!((&r.last, &r.prev), (&st(12, "2"), &Some(st(10, "1"))));
        assert_eq!(
            r.inline,
            Some(Inline {
                at: 10,
                bytes: b"de".to_vec()
            })
        );
        // A record without bytes after it leaves none.
        encode_record(&mut bytes, "a/b/c", Some(&st(12, "3")), None);
        let mut states = HashMap::new();
        assert_eq!(replay(&bytes, &mut states), bytes.len());
        assert_eq!(states["a/b/c"].inline, None);
        // Bytes that do not end at the record's end are a damaged record.
        let mut bad = Vec::new();
        encode_record(&mut bad, "a/b/c", Some(&st(9, "1")), None);
        let good = bad.len();
        let mut w = RecordWriter::default();
        w.u8(KIND_COMMIT_INLINE).str16("a/b/c");
        w.u64(7)
            .u64(10)
            .raw(&[0u8; 20])
            .labels(&LabelSet::default())
            .u64(8)
            .raw(b"x");
        frame(&mut bad, &w.buf);
        let mut states = HashMap::new();
        assert_eq!(replay(&bad, &mut states), good);
    }

    /// A log of three writes, the last holding two records, one carrying
    /// bytes. Returns the file's bytes and where the last write begins.
    fn three_writes(dir: &Path) -> (Vec<u8>, usize) {
        let last = compio::runtime::Runtime::new().unwrap().block_on(async {
            let (mut log, _) = CommitLog::open(dir).await.unwrap();
            log.record_commit("a/b/c", &st(10, "1"));
            log.flush(false).await.unwrap();
            log.record_delete("d/e/f");
            log.record_commit("d/e/f", &st(11, "2"));
            log.flush(false).await.unwrap();
            let last = log.pos as usize;
            log.record_commit_inline("a/b/c", &st_mid(13, "3"), 10, b"xyz");
            log.record_commit("g/h/i", &st_mid(12, "4"));
            log.flush(false).await.unwrap();
            last
        });
        (std::fs::read(dir.join(FILE_NAME)).unwrap(), last)
    }

    #[test]
    fn open_refuses_a_damaged_log_and_leaves_it_whole() {
        let dir = tempfile::tempdir().unwrap();
        let (bytes, last) = three_writes(dir.path());
        let path = dir.path().join(FILE_NAME);
        let rt = compio::runtime::Runtime::new().unwrap();
        // Any one byte changed, anywhere: a whole record fails its CRC, or
        // its length disagrees with its fields. The file stays as it was.
        for at in 0..bytes.len() {
            for flip in [0x01, 0x80, 0xff] {
                let mut bad = bytes.clone();
                bad[at] ^= flip;
                std::fs::write(&path, &bad).unwrap();
                let res = rt.block_on(CommitLog::open(dir.path()));
                match res {
                    Err(StorageError::Corrupt { why, .. }) => {
                        assert!(why.contains("no torn last write"), "{why}")
                    }
                    Err(e) => panic!("byte {at} ^ {flip:#x}: {e}"),
                    Ok(_) => panic!("byte {at} ^ {flip:#x}: opened a damaged log"),
                }
                assert_eq!(std::fs::read(&path).unwrap(), bad, "byte {at} changed");
            }
        }
        // A record cut anywhere in the last write is its torn tail: the
        // records before the cut stand, the rest is cut off.
        for cut in last..bytes.len() {
            std::fs::write(&path, &bytes[..cut]).unwrap();
            let (log, states) = rt.block_on(CommitLog::open(dir.path())).unwrap();
            let mut want = HashMap::new();
            let valid = replay(&bytes[..cut], &mut want);
            assert!(valid >= last);
            assert_eq!((log.pos, states), (valid as u64, want));
            assert_eq!(std::fs::metadata(&path).unwrap().len(), valid as u64);
        }
        // The last write's bytes lost to zeros, the file's length kept:
        // its records are cut off, the earlier ones stand.
        for (len, zeros) in [(bytes.len(), bytes.len() - last), (last + 5, 5)] {
            let mut torn = bytes[..len].to_vec();
            torn[last..].fill(0);
            assert_eq!(torn[last..].len(), zeros);
            std::fs::write(&path, &torn).unwrap();
            let (log, states) = rt.block_on(CommitLog::open(dir.path())).unwrap();
            let mut want = HashMap::new();
            assert_eq!(replay(&bytes[..last], &mut want), last);
            assert_eq!((log.pos, states), (last as u64, want));
        }
        // A record cut short whose length was changed, so that it seems
        // to reach past the end: its fields tell the length it had.
        let len = u32::from_le_bytes(bytes[last..last + 4].try_into().unwrap()) as usize;
        let mut bad = bytes[..last + 8 + len - 1].to_vec();
        bad[last + 1] ^= 0x01;
        std::fs::write(&path, &bad).unwrap();
        let Err(StorageError::Corrupt { why, .. }) = rt.block_on(CommitLog::open(dir.path()))
        else {
            panic!("opened a log whose last record's length was changed");
        };
        assert!(why.contains("whose fields make it"), "{why}");
    }

    /// A compaction that finds the disk full leaves the log as it was and
    /// no partial snapshot beside it. Runs on a small tmpfs of its own,
    /// which needs root (as in CI); elsewhere it says so and checks nothing.
    #[test]
    fn a_compaction_on_a_full_disk_leaves_nothing_behind() {
        use std::process::Command;
        let dir = tempfile::tempdir().unwrap();
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=1m", "tmpfs"])
            .arg(dir.path())
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            eprintln!("SKIPPED: mounting a tmpfs needs root");
            return;
        }
        struct Mount<'a>(&'a Path);
        impl Drop for Mount<'_> {
            fn drop(&mut self) {
                let _ = Command::new("umount").arg("-l").arg(self.0).status();
            }
        }
        let _mount = Mount(dir.path());
        let names: Vec<String> = (0..4000).map(|i| format!("full/journal-{i:05}")).collect();
        let state = st(10, "1");
        compio::runtime::Runtime::new().unwrap().block_on(async {
            let (mut log, _) = CommitLog::open(dir.path()).await.unwrap();
            log.record_commit(&names[0], &state);
            log.flush(true).await.unwrap();
            let before = std::fs::read(dir.path().join(FILE_NAME)).unwrap();
            // Fill the file system to its last few pages.
            let filler = vec![1u8; 4096];
            let mut f = std::fs::File::create(dir.path().join("filler")).unwrap();
            while std::io::Write::write_all(&mut f, &filler).is_ok() {}
            let _ = f.set_len(f.metadata().unwrap().len().saturating_sub(8192));
            let err = log
                .compact(names.iter().map(|n| (n.as_str(), &state)))
                .await
                .expect_err("a snapshot of 4000 journals fits in 8 KiB");
            assert!(err.is_full(), "{err}");
            assert!(!dir.path().join("commit.log.next").exists());
            assert_eq!(std::fs::read(dir.path().join(FILE_NAME)).unwrap(), before);
            // The same in the background.
            log.begin_compaction(names.iter().map(|n| (n.as_str(), &state)));
            ready(&log).await;
            let err = log.finish_compaction().await.expect_err("no room");
            assert!(err.is_full(), "{err}");
            assert!(!dir.path().join("commit.log.next").exists());
            assert_eq!(std::fs::read(dir.path().join(FILE_NAME)).unwrap(), before);
        });
    }

    /// Waits (on the log's own runtime) until a background compaction's
    /// snapshot is written.
    async fn ready(log: &CommitLog) {
        while !log.compaction_ready() {
            compio::time::sleep(std::time::Duration::from_millis(1)).await;
        }
    }

    /// Records go on being written while a snapshot syncs in the
    /// background; they follow it in the new log, which replays to the
    /// same states as the old one did. A crash before the switch leaves
    /// the old log whole, and the half-made file is overwritten later.
    #[test]
    fn records_written_during_a_background_compaction_follow_its_snapshot() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join(FILE_NAME);
        let next = dir.path().join("commit.log.next");
        compio::runtime::Runtime::new().unwrap().block_on(async {
            let (mut log, _) = CommitLog::open(dir.path()).await.unwrap();
            log.set_compact_bytes(0);
            for i in 0..50 {
                log.record_commit("a/b/c", &st_mid(100 + i, "1"));
                log.record_commit("d/e/f", &st(100 + i, "2"));
                log.flush(false).await.unwrap();
            }
            assert!(log.needs_compaction());
            let states: HashMap<String, JournalState> = [
                ("a/b/c".to_string(), st_mid(149, "1")),
                ("d/e/f".to_string(), st(149, "2")),
            ]
            .into();
            log.begin_compaction(states.iter().map(|(k, v)| (k.as_str(), v)));
            assert!(!log.needs_compaction(), "one compaction at a time");
            // While the snapshot syncs: a synced commit, an inline one and
            // a delete, all written to the old log and copied.
            log.record_commit("a/b/c", &st_mid(160, "3"));
            log.flush(true).await.unwrap();
            log.record_commit_inline("g/h/i", &st(9, "4"), 7, b"hi");
            log.record_delete("d/e/f");
            log.flush(false).await.unwrap();
            let before = std::fs::read(&path).unwrap();
            let (_, expected) = CommitLog::open(dir.path()).await.unwrap();
            ready(&log).await;
            let old = log.finish_compaction().await.unwrap();
            assert!(old.is_some());
            assert!(!next.exists());
            let after = std::fs::read(&path).unwrap();
            assert!(
                after.len() < before.len() / 10,
                "{} of {}",
                after.len(),
                before.len()
            );
            // Replaying the new log gives each journal's last state (and
            // the carried bytes) as the old one did.
            let (_, got) = CommitLog::open(dir.path()).await.unwrap();
            assert_eq!(got.len(), 2);
            for j in ["a/b/c", "g/h/i"] {
                assert_eq!(got[j].last, expected[j].last, "{j}");
                assert_eq!(got[j].inline, expected[j].inline, "{j}");
            }
            assert_eq!(got["g/h/i"].inline.as_ref().unwrap().bytes, b"hi");
            // The log goes on in the new file.
            log.record_commit("a/b/c", &st_mid(161, "5"));
            log.flush(true).await.unwrap();
            let (_, got) = CommitLog::open(dir.path()).await.unwrap();
            assert_eq!(got["a/b/c"].last, st_mid(161, "5"));

            // A crash while the next snapshot is on its way: the log is
            // whole without it, and the file it left is replaced.
            log.begin_compaction(std::iter::empty());
            log.record_commit("x/y/z", &st(105, "6"));
            log.flush(false).await.unwrap();
            ready(&log).await;
            drop(log);
            assert!(next.exists());
            let (mut log, got) = CommitLog::open(dir.path()).await.unwrap();
            assert_eq!(got["x/y/z"].last, st(105, "6"));
            assert_eq!(got["a/b/c"].last, st_mid(161, "5"));
            let only = [("x/y/z".to_string(), st(105, "6"))];
            log.settle(
                std::iter::empty(),
                only.iter().map(|(k, v)| (k.as_str(), v)),
            )
            .await
            .unwrap();
            assert!(!next.exists());
            let (_, got) = CommitLog::open(dir.path()).await.unwrap();
            assert_eq!(got.len(), 1);
        });
    }

    /// A compaction whose copied records outgrow their bound is dropped
    /// (its file removed, the log left as it was), and the next one runs.
    #[test]
    fn a_compaction_that_falls_too_far_behind_is_dropped() {
        let dir = tempfile::tempdir().unwrap();
        compio::runtime::Runtime::new().unwrap().block_on(async {
            let (mut log, _) = CommitLog::open(dir.path()).await.unwrap();
            log.set_compact_bytes(0);
            log.set_compaction_tail_max(1 << 10);
            log.record_commit("a/b/c", &st(101, "1"));
            log.flush(false).await.unwrap();
            let snapshot = [("a/b/c".to_string(), st(101, "1"))];
            log.begin_compaction(snapshot.iter().map(|(k, v)| (k.as_str(), v)));
            for i in 2..100 {
                log.record_commit("a/b/c", &st(100 + i, "1"));
                log.flush(false).await.unwrap();
            }
            let before = std::fs::read(log.path()).unwrap();
            ready(&log).await;
            assert!(log.finish_compaction().await.unwrap().is_none());
            assert!(!dir.path().join("commit.log.next").exists());
            assert_eq!(std::fs::read(log.path()).unwrap(), before);
            // Not under way any more: the next compaction starts and
            // switches.
            assert!(log.needs_compaction());
            let snapshot = [("a/b/c".to_string(), st(199, "1"))];
            log.begin_compaction(snapshot.iter().map(|(k, v)| (k.as_str(), v)));
            ready(&log).await;
            assert!(log.finish_compaction().await.unwrap().is_some());
            let (_, got) = CommitLog::open(dir.path()).await.unwrap();
            assert_eq!(got["a/b/c"].last, st(199, "1"));
            assert_eq!(got["a/b/c"].prev, None);
        });
    }

    #[test]
    fn open_cuts_a_torn_tail_and_settle_compacts() {
        let dir = tempfile::tempdir().unwrap();
        compio::runtime::Runtime::new().unwrap().block_on(async {
            let (mut log, states) = CommitLog::open(dir.path()).await.unwrap();
            assert!(states.is_empty());
            log.record_commit("a/b/c", &st(10, "1"));
            log.record_commit("a/b/c", &st(11, "2"));
            log.record_commit("d/e/f", &st(12, "3"));
            log.flush(true).await.unwrap();
            log.record_delete("d/e/f");
            log.record_commit("g/h/i", &st(13, "4"));
            log.flush(false).await.unwrap();
            drop(log);
            // A torn record at the end is cut off, and records written
            // after reopening are read back.
            let path = dir.path().join(FILE_NAME);
            let mut bytes = std::fs::read(&path).unwrap();
            bytes.extend_from_slice(&[9, 0, 0, 0, 1, 2]);
            std::fs::write(&path, &bytes).unwrap();
            let (mut log, states) = CommitLog::open(dir.path()).await.unwrap();
            assert_eq!(states.len(), 2);
            assert_eq!(states["a/b/c"].last, st(11, "2"));
            log.record_commit("a/b/c", &st(14, "5"));
            log.flush(false).await.unwrap();
            drop(log);
            let (mut log, states) = CommitLog::open(dir.path()).await.unwrap();
            assert_eq!(states["a/b/c"].last, st(14, "5"));
            assert_eq!(states["a/b/c"].prev, Some(st(11, "2")));
            // Settling: a/b/c falls back to its previous state, g/h/i to
            // nothing. The compacted log holds just the chosen states.
            let chosen = st(11, "2");
            log.settle(
                [("a/b/c", Some(&chosen)), ("g/h/i", None)].into_iter(),
                [("a/b/c", &chosen)].into_iter(),
            )
            .await
            .unwrap();
            drop(log);
            let (_, states) = CommitLog::open(dir.path()).await.unwrap();
            assert_eq!(states.len(), 1);
            assert_eq!(states["a/b/c"].last, chosen);
            assert_eq!(states["a/b/c"].prev, None);
        });
    }
}
