//! The record format: ids, paths, file operations, and their framing.
//!
//! A log is a sequence of frames. Each frame holds one record: a header
//! (seqno, chain checksum, author) and one operation. Everything is
//! little-endian.
//!
//! ```text
//! frame   := magic "\xd1RLG" | payload_len u32 | payload_crc u32 | header_crc u32 | payload
//! payload := seqno u64 | checksum u32 | author u32 | kind u8 | body
//! body    := handoff (1), barrier (2):   nothing
//!          | create (3):                 path
//!          | link (4), unlink (5):       fnode u64 | path
//!          | write (6):                  fnode u64 | offset u64 | data
//!          | truncate (7):               fnode u64 | length u64
//! ```
//!
//! `payload_crc` is the CRC-32C of the payload, `header_crc` that of the
//! twelve bytes before it; a path or write data runs to the payload's end.
//! A journal may hold other writers' bytes and torn frames: [`scan`] tells a
//! frame from garbage by the magic and both CRCs, and after garbage resumes
//! at the next byte that could start a magic.
//!
//! Records chain: a record's `checksum` is the chain's value before it,
//! which starts at 0 and takes in each record's payload ([`chain`]). A
//! record written by a recorder that did not see the records before it
//! (a zombie racing a new author) carries a stale value and is ignored.

use std::fmt;
use std::num::NonZeroU32;
use std::ops::Range;

use serde::{Deserialize, Serialize};

/// A record's place in its log's chain. The first record is 1; a record
/// extends the chain only with the previous one's seqno plus one.
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
#[serde(transparent)]
pub struct Seqno(pub u64);

impl Seqno {
    pub const FIRST: Seqno = Seqno(1);

    /// The seqno after this one.
    pub fn next(self) -> Seqno {
        Seqno(self.0 + 1)
    }
}

impl fmt::Display for Seqno {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// A file across its renames and links, like an inode: the seqno of the
/// record that created it, as in Gazette's recovery log.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Fnode(pub u64);

impl From<Seqno> for Fnode {
    fn from(seqno: Seqno) -> Fnode {
        Fnode(seqno.0)
    }
}

impl fmt::Display for Fnode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// The recorder that wrote a record. Each recorder takes a fresh id (the
/// caller draws it at random); 0 is reserved for "no author yet".
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "u32", into = "u32")]
pub struct Author(NonZeroU32);

impl Author {
    /// The author with id `id`, unless it is the reserved 0.
    pub fn new(id: u32) -> Option<Author> {
        NonZeroU32::new(id).map(Author)
    }

    pub fn get(self) -> u32 {
        self.0.get()
    }
}

/// Author id 0 is reserved.
#[derive(Debug, thiserror::Error)]
#[error("author id 0 is reserved")]
pub struct ZeroAuthor;

impl TryFrom<u32> for Author {
    type Error = ZeroAuthor;

    fn try_from(id: u32) -> Result<Author, ZeroAuthor> {
        Author::new(id).ok_or(ZeroAuthor)
    }
}

impl From<Author> for u32 {
    fn from(author: Author) -> u32 {
        author.get()
    }
}

impl fmt::Display for Author {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// Longest path a record carries.
pub const PATH_BYTES_MAX: usize = 1024;

/// A file's path relative to the store's root: `/`-separated components,
/// none empty, `.` or `..`, no NUL, at most [`PATH_BYTES_MAX`] bytes. So it
/// can name nothing outside the root, whichever directory that is.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct LogPath(String);

/// Why a string is not a [`LogPath`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    #[error("empty")]
    Empty,
    #[error("{bytes} bytes, more than {PATH_BYTES_MAX}")]
    TooLong { bytes: usize },
    #[error("a component is empty (leading, trailing or doubled '/')")]
    EmptyComponent,
    #[error("a component is '.' or '..'")]
    DotComponent,
    #[error("contains NUL")]
    Nul,
}

impl LogPath {
    pub fn new(path: &str) -> Result<LogPath, PathError> {
        if path.is_empty() {
            return Err(PathError::Empty);
        }
        if path.len() > PATH_BYTES_MAX {
            return Err(PathError::TooLong { bytes: path.len() });
        }
        if path.contains('\0') {
            return Err(PathError::Nul);
        }
        for component in path.split('/') {
            match component {
                "" => return Err(PathError::EmptyComponent),
                "." | ".." => return Err(PathError::DotComponent),
                _ => {}
            }
        }
        Ok(LogPath(path.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for LogPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// One operation of a store's file layer, or a marker of the log's own.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// The record's author becomes the log's author. The open transaction,
    /// if any, is abandoned: its author stopped before its barrier.
    Handoff,
    /// Ends a store transaction: players apply its operations, all at once.
    Barrier,
    /// A new, empty file at `path`; its fnode is the record's seqno.
    Create { path: LogPath },
    /// One more path for `fnode` (a rename is a link and an unlink).
    Link { fnode: Fnode, path: LogPath },
    /// One path fewer for `fnode`; with its last path, the file is gone.
    Unlink { fnode: Fnode, path: LogPath },
    /// `data` written at `offset`, extending the file (with zeros) as needed.
    Write {
        fnode: Fnode,
        offset: u64,
        data: Vec<u8>,
    },
    /// The file's length set to `length`, cutting or extending with zeros.
    Truncate { fnode: Fnode, length: u64 },
}

/// A framed operation with its place in the chain.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    pub seqno: Seqno,
    /// The chain's value before this record.
    pub checksum: u32,
    pub author: Author,
    pub op: Op,
}

/// First bytes of every frame.
pub const FRAME_MAGIC: [u8; 4] = [0xd1, b'R', b'L', b'G'];
/// magic, payload_len, payload_crc, header_crc.
pub const FRAME_HEADER_BYTES: usize = 16;
/// seqno, checksum, author, kind.
const RECORD_HEADER_BYTES: usize = 17;
/// Largest write one record carries; recorders split larger ones.
pub const WRITE_BYTES_MAX: usize = 1 << 20;
/// Largest payload a frame may declare; longer is garbage.
pub const PAYLOAD_BYTES_MAX: usize = RECORD_HEADER_BYTES + 16 + WRITE_BYTES_MAX;

const _: () = assert!(FRAME_HEADER_BYTES == FRAME_MAGIC.len() + 4 + 4 + 4);
const _: () = assert!(RECORD_HEADER_BYTES == 8 + 4 + 4 + 1);
const _: () = assert!(PAYLOAD_BYTES_MAX >= RECORD_HEADER_BYTES + 8 + PATH_BYTES_MAX);
const _: () = assert!(PAYLOAD_BYTES_MAX <= u32::MAX as usize);

const KIND_HANDOFF: u8 = 1;
const KIND_BARRIER: u8 = 2;
const KIND_CREATE: u8 = 3;
const KIND_LINK: u8 = 4;
const KIND_UNLINK: u8 = 5;
const KIND_WRITE: u8 = 6;
const KIND_TRUNCATE: u8 = 7;

/// The chain's value after a record with this payload, given its value
/// before.
pub fn chain(checksum: u32, payload: &[u8]) -> u32 {
    crc32c::crc32c_append(checksum, payload)
}

/// Appends `record`'s frame to `out`; returns where its payload lies in
/// `out` (what [`chain`] takes in).
pub fn encode(record: &Record, out: &mut Vec<u8>) -> Range<usize> {
    let start = out.len();
    out.extend_from_slice(&FRAME_MAGIC);
    out.extend_from_slice(&[0; FRAME_HEADER_BYTES - FRAME_MAGIC.len()]);
    let payload_start = out.len();
    out.extend_from_slice(&record.seqno.0.to_le_bytes());
    out.extend_from_slice(&record.checksum.to_le_bytes());
    out.extend_from_slice(&record.author.get().to_le_bytes());
    encode_op(&record.op, out);
    let payload_len = out.len() - payload_start;
    assert!(
        payload_len <= PAYLOAD_BYTES_MAX,
        "record of {payload_len} bytes: recorders split writes at {WRITE_BYTES_MAX}"
    );
    let payload_crc = crc32c::crc32c(&out[payload_start..]);
    out[start + 4..start + 8].copy_from_slice(&(payload_len as u32).to_le_bytes());
    out[start + 8..start + 12].copy_from_slice(&payload_crc.to_le_bytes());
    let header_crc = crc32c::crc32c(&out[start..start + 12]);
    out[start + 12..start + 16].copy_from_slice(&header_crc.to_le_bytes());
    payload_start..out.len()
}

fn encode_op(op: &Op, out: &mut Vec<u8>) {
    match op {
        Op::Handoff => out.push(KIND_HANDOFF),
        Op::Barrier => out.push(KIND_BARRIER),
        Op::Create { path } => {
            out.push(KIND_CREATE);
            out.extend_from_slice(path.as_str().as_bytes());
        }
        Op::Link { fnode, path } | Op::Unlink { fnode, path } => {
            out.push(if matches!(op, Op::Link { .. }) {
                KIND_LINK
            } else {
                KIND_UNLINK
            });
            out.extend_from_slice(&fnode.0.to_le_bytes());
            out.extend_from_slice(path.as_str().as_bytes());
        }
        Op::Write {
            fnode,
            offset,
            data,
        } => {
            out.push(KIND_WRITE);
            out.extend_from_slice(&fnode.0.to_le_bytes());
            out.extend_from_slice(&offset.to_le_bytes());
            out.extend_from_slice(data);
        }
        Op::Truncate { fnode, length } => {
            out.push(KIND_TRUNCATE);
            out.extend_from_slice(&fnode.0.to_le_bytes());
            out.extend_from_slice(&length.to_le_bytes());
        }
    }
}

/// Why a frame whose CRCs hold does not hold a record.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    #[error("payload ends inside a field")]
    Truncated,
    #[error("bytes after the record's last field")]
    TrailingBytes,
    #[error("unknown operation kind {0}")]
    UnknownKind(u8),
    #[error("seqno 0")]
    ZeroSeqno,
    #[error("author 0")]
    ZeroAuthor,
    #[error("fnode 0")]
    ZeroFnode,
    #[error("path is not UTF-8")]
    PathNotUtf8,
    #[error("invalid path")]
    Path(#[from] PathError),
    #[error("write ends past the largest file offset")]
    WriteOverflow,
}

/// What the bytes at the start of a buffer are.
#[derive(Debug, PartialEq, Eq)]
pub enum Scanned {
    /// A whole frame of `frame_bytes` bytes; `chained` is the chain's value
    /// after it, if its `checksum` is the value before it.
    Frame {
        record: Record,
        frame_bytes: usize,
        chained: u32,
    },
    /// The first `bytes` bytes start no frame: skip them and scan again.
    Garbage { bytes: usize },
    /// The buffer may start a frame, but ends before one can be told.
    Incomplete,
}

/// Looks at the start of `buf`. Never panics, whatever `buf` holds.
pub fn scan(buf: &[u8]) -> Result<Scanned, DecodeError> {
    let magic_bytes = buf.len().min(FRAME_MAGIC.len());
    if buf[..magic_bytes] != FRAME_MAGIC[..magic_bytes] {
        return Ok(Scanned::Garbage { bytes: resync(buf) });
    }
    if buf.len() < FRAME_HEADER_BYTES {
        return Ok(Scanned::Incomplete);
    }
    let field = |at: usize| u32::from_le_bytes([buf[at], buf[at + 1], buf[at + 2], buf[at + 3]]);
    let payload_len = field(4) as usize;
    let header_valid = crc32c::crc32c(&buf[..12]) == field(12)
        && (RECORD_HEADER_BYTES..=PAYLOAD_BYTES_MAX).contains(&payload_len);
    if !header_valid {
        return Ok(Scanned::Garbage { bytes: resync(buf) });
    }
    let frame_bytes = FRAME_HEADER_BYTES + payload_len;
    let Some(payload) = buf.get(FRAME_HEADER_BYTES..frame_bytes) else {
        return Ok(Scanned::Incomplete);
    };
    if crc32c::crc32c(payload) != field(8) {
        return Ok(Scanned::Garbage { bytes: resync(buf) });
    }
    let record = decode(payload)?;
    let chained = chain(record.checksum, payload);
    Ok(Scanned::Frame {
        record,
        frame_bytes,
        chained,
    })
}

/// The first position after the start of `buf` where a frame could begin:
/// a whole magic, or a prefix of one that `buf` ends with.
fn resync(buf: &[u8]) -> usize {
    (1..buf.len())
        .find(|&at| {
            let n = (buf.len() - at).min(FRAME_MAGIC.len());
            buf[at..at + n] == FRAME_MAGIC[..n]
        })
        .unwrap_or(buf.len())
        .max(1)
}

/// Decodes a payload whose CRC held.
fn decode(payload: &[u8]) -> Result<Record, DecodeError> {
    let mut fields = Fields(payload);
    let seqno = Seqno(fields.u64()?);
    let checksum = fields.u32()?;
    let author = Author::new(fields.u32()?).ok_or(DecodeError::ZeroAuthor)?;
    if seqno.0 == 0 {
        return Err(DecodeError::ZeroSeqno);
    }
    let op = match fields.u8()? {
        KIND_HANDOFF => Op::Handoff,
        KIND_BARRIER => Op::Barrier,
        KIND_CREATE => Op::Create {
            path: fields.path()?,
        },
        KIND_LINK => Op::Link {
            fnode: fields.fnode()?,
            path: fields.path()?,
        },
        KIND_UNLINK => Op::Unlink {
            fnode: fields.fnode()?,
            path: fields.path()?,
        },
        KIND_WRITE => decode_write(&mut fields)?,
        KIND_TRUNCATE => Op::Truncate {
            fnode: fields.fnode()?,
            length: fields.u64()?,
        },
        kind => return Err(DecodeError::UnknownKind(kind)),
    };
    if !fields.0.is_empty() {
        return Err(DecodeError::TrailingBytes);
    }
    Ok(Record {
        seqno,
        checksum,
        author,
        op,
    })
}

fn decode_write(fields: &mut Fields<'_>) -> Result<Op, DecodeError> {
    let fnode = fields.fnode()?;
    let offset = fields.u64()?;
    let data = fields.rest().to_vec();
    offset
        .checked_add(data.len() as u64)
        .ok_or(DecodeError::WriteOverflow)?;
    Ok(Op::Write {
        fnode,
        offset,
        data,
    })
}

/// The fields of a payload not yet decoded.
struct Fields<'a>(&'a [u8]);

impl<'a> Fields<'a> {
    fn take<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let (head, rest) = self
            .0
            .split_first_chunk::<N>()
            .ok_or(DecodeError::Truncated)?;
        self.0 = rest;
        Ok(*head)
    }

    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take::<1>()?[0])
    }

    fn u32(&mut self) -> Result<u32, DecodeError> {
        Ok(u32::from_le_bytes(self.take()?))
    }

    fn u64(&mut self) -> Result<u64, DecodeError> {
        Ok(u64::from_le_bytes(self.take()?))
    }

    fn fnode(&mut self) -> Result<Fnode, DecodeError> {
        match self.u64()? {
            0 => Err(DecodeError::ZeroFnode),
            id => Ok(Fnode(id)),
        }
    }

    fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.0)
    }

    fn path(&mut self) -> Result<LogPath, DecodeError> {
        let path = std::str::from_utf8(self.rest()).map_err(|_| DecodeError::PathNotUtf8)?;
        Ok(LogPath::new(path)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::collection::vec;
    use proptest::prelude::*;

    fn author(id: u32) -> Author {
        Author::new(id).unwrap()
    }

    fn path(p: &str) -> LogPath {
        LogPath::new(p).unwrap()
    }

    fn frame(record: &Record) -> Vec<u8> {
        let mut out = Vec::new();
        encode(record, &mut out);
        out
    }

    /// The layout in the module doc, byte for byte.
    #[test]
    fn write_frame_layout() {
        let record = Record {
            seqno: Seqno(7),
            checksum: 0x0403_0201,
            author: author(0x0c0b_0a09),
            op: Op::Write {
                fnode: Fnode(3),
                offset: 0x10,
                data: b"hi".to_vec(),
            },
        };
        let bytes = frame(&record);
        let payload =
            "0700000000000000 01020304 090a0b0c 06 0300000000000000 1000000000000000 6869";
        let payload = hex::decode(payload.replace(' ', "")).unwrap();
        assert_eq!(bytes[..4], FRAME_MAGIC);
        assert_eq!(bytes[4..8], (payload.len() as u32).to_le_bytes());
        assert_eq!(bytes[8..12], crc32c::crc32c(&payload).to_le_bytes());
        assert_eq!(bytes[12..16], crc32c::crc32c(&bytes[..12]).to_le_bytes());
        assert_eq!(bytes[16..], payload[..]);
        let scanned = scan(&bytes).unwrap();
        let chained = chain(0x0403_0201, &payload);
        assert_eq!(
            scanned,
            Scanned::Frame {
                record,
                frame_bytes: bytes.len(),
                chained
            }
        );
    }

    #[test]
    fn paths_that_could_leave_the_root_are_refused() {
        for (bad, why) in [
            ("", PathError::Empty),
            ("/etc/passwd", PathError::EmptyComponent),
            ("a//b", PathError::EmptyComponent),
            ("a/", PathError::EmptyComponent),
            ("..", PathError::DotComponent),
            ("a/../../b", PathError::DotComponent),
            ("./a", PathError::DotComponent),
            ("a\0b", PathError::Nul),
        ] {
            assert_eq!(LogPath::new(bad), Err(why), "{bad:?}");
        }
        let long = "x".repeat(PATH_BYTES_MAX + 1);
        assert_eq!(
            LogPath::new(&long),
            Err(PathError::TooLong {
                bytes: PATH_BYTES_MAX + 1
            })
        );
        assert_eq!(LogPath::new("db/main-wal").unwrap().as_str(), "db/main-wal");
    }

    /// A frame whose CRCs hold but whose path would escape the root is an
    /// error, not a record.
    #[test]
    fn crc_valid_frame_with_escaping_path_is_malformed() {
        let mut bytes = frame(&Record {
            seqno: Seqno(1),
            checksum: 0,
            author: author(1),
            op: Op::Create {
                path: path("ab/cd"),
            },
        });
        let at = bytes.len() - 5;
        bytes[at..].copy_from_slice(b"../cd");
        reseal(&mut bytes);
        assert_eq!(
            scan(&bytes),
            Err(DecodeError::Path(PathError::DotComponent))
        );
    }

    /// Recomputes a frame's CRCs after its payload was changed.
    fn reseal(bytes: &mut [u8]) {
        let payload_crc = crc32c::crc32c(&bytes[FRAME_HEADER_BYTES..]);
        bytes[8..12].copy_from_slice(&payload_crc.to_le_bytes());
        let header_crc = crc32c::crc32c(&bytes[..12]);
        bytes[12..16].copy_from_slice(&header_crc.to_le_bytes());
    }

    #[test]
    fn torn_and_corrupt_frames_are_garbage_or_incomplete() {
        let record = Record {
            seqno: Seqno(2),
            checksum: 9,
            author: author(4),
            op: Op::Barrier,
        };
        let bytes = frame(&record);
        for cut in 0..bytes.len() {
            assert_eq!(scan(&bytes[..cut]), Ok(Scanned::Incomplete), "cut at {cut}");
        }
        for flip in 0..bytes.len() {
            let mut corrupt = bytes.clone();
            corrupt[flip] ^= 0x20;
            let scanned = scan(&corrupt).unwrap();
            assert!(
                matches!(scanned, Scanned::Garbage { bytes } if bytes >= 1),
                "flip {flip}: {scanned:?}"
            );
        }
    }

    #[test]
    fn resync_stops_at_the_next_magic_or_its_prefix() {
        let mut buf = b"xx".to_vec();
        buf.extend_from_slice(&FRAME_MAGIC);
        assert_eq!(scan(&buf), Ok(Scanned::Garbage { bytes: 2 }));
        assert_eq!(scan(&buf[..4]), Ok(Scanned::Garbage { bytes: 2 }));
        assert_eq!(scan(b"abc"), Ok(Scanned::Garbage { bytes: 3 }));
        assert_eq!(scan(&buf[2..5]), Ok(Scanned::Incomplete));
    }

    fn any_path() -> impl Strategy<Value = LogPath> {
        "[a-z0-9_.-]{1,12}(/[a-z0-9_-]{1,12}){0,3}"
            .prop_filter_map("valid path", |p| LogPath::new(&p).ok())
    }

    fn any_op() -> impl Strategy<Value = Op> {
        let fnode = (1..u64::MAX).prop_map(Fnode);
        prop_oneof![
            Just(Op::Handoff),
            Just(Op::Barrier),
            any_path().prop_map(|path| Op::Create { path }),
            (fnode.clone(), any_path()).prop_map(|(fnode, path)| Op::Link { fnode, path }),
            (fnode.clone(), any_path()).prop_map(|(fnode, path)| Op::Unlink { fnode, path }),
            (fnode.clone(), 0..u64::MAX / 2, vec(any::<u8>(), 0..300)).prop_map(
                |(fnode, offset, data)| Op::Write {
                    fnode,
                    offset,
                    data
                }
            ),
            (fnode, any::<u64>()).prop_map(|(fnode, length)| Op::Truncate { fnode, length }),
        ]
    }

    fn any_record() -> impl Strategy<Value = Record> {
        (1..u64::MAX, any::<u32>(), 1..=u32::MAX, any_op()).prop_map(|(seqno, checksum, id, op)| {
            Record {
                seqno: Seqno(seqno),
                checksum,
                author: author(id),
                op,
            }
        })
    }

    /// Scans `buf` to its end the way a player does; returns the records
    /// and the garbage bytes skipped.
    fn scan_all(mut buf: &[u8]) -> (Vec<Record>, usize) {
        let (mut records, mut garbage) = (Vec::new(), 0);
        loop {
            match scan(buf) {
                Ok(Scanned::Frame {
                    record,
                    frame_bytes,
                    ..
                }) => {
                    assert!(frame_bytes >= FRAME_HEADER_BYTES + RECORD_HEADER_BYTES);
                    records.push(record);
                    buf = &buf[frame_bytes..];
                }
                Ok(Scanned::Garbage { bytes }) => {
                    assert!(
                        (1..=buf.len()).contains(&bytes),
                        "garbage of {bytes} in {}",
                        buf.len()
                    );
                    garbage += bytes;
                    buf = &buf[bytes..];
                }
                Ok(Scanned::Incomplete) | Err(_) => return (records, garbage),
            }
        }
    }

    proptest! {
        #[test]
        fn records_round_trip(record in any_record(), checksum in any::<u32>()) {
            let mut bytes = Vec::new();
            let payload = encode(&record, &mut bytes);
            let chained = chain(checksum, &bytes[payload]);
            let scanned = scan(&bytes).unwrap();
            let Scanned::Frame { record: decoded, frame_bytes, chained: scanned_chain } = scanned
            else {
                panic!("not a frame: {scanned:?}");
            };
            prop_assert_eq!(decoded, record.clone());
            prop_assert_eq!(frame_bytes, bytes.len());
            prop_assert_eq!(scanned_chain == chained, checksum == record.checksum);
        }

        /// Arbitrary bytes never panic the scanner, and every step of a
        /// scan makes progress within the buffer.
        #[test]
        fn random_bytes_scan_without_panic(bytes in vec(any::<u8>(), 0..2048)) {
            let _ = scan(&bytes);
            scan_all(&bytes);
        }

        /// Random bytes with magics sprinkled in, so headers get parsed.
        #[test]
        fn random_bytes_with_magics_scan_without_panic(
            chunks in vec((vec(any::<u8>(), 0..40), any::<bool>()), 0..40)
        ) {
            let mut bytes = Vec::new();
            for (chunk, magic) in chunks {
                if magic {
                    bytes.extend_from_slice(&FRAME_MAGIC);
                }
                bytes.extend_from_slice(&chunk);
            }
            scan_all(&bytes);
        }

        /// Records between runs of garbage (with no magic in them) are all
        /// found, and exactly the garbage is skipped.
        #[test]
        fn records_are_found_between_garbage(
            items in vec((any_record(), vec(any::<u8>(), 0..64)), 1..12)
        ) {
            let (mut bytes, mut garbage_len, mut records) = (Vec::new(), 0, Vec::new());
            for (record, mut garbage) in items {
                garbage.retain(|b| *b != FRAME_MAGIC[0]);
                garbage_len += garbage.len();
                bytes.extend_from_slice(&garbage);
                encode(&record, &mut bytes);
                records.push(record);
            }
            prop_assert_eq!(scan_all(&bytes), (records, garbage_len));
        }
    }
}
