//! The native wire format: length-prefixed frames with a fixed 24-byte
//! little-endian header, an op-specific metadata section and a raw payload.
//!
//! ```text
//! | FrameHeader (24) | meta (meta_len bytes) | payload (body_len - meta_len bytes) |
//! ```
//!
//! Content bytes travel raw in the payload: never re-encoded, never copied by
//! the codec (decoding borrows). `docs/PROTOCOL.md` specifies every byte.
//! Decoding never panics on any input; every malformed frame is a
//! [`WireError`], which a server answers with a status.

use crate::spec::{LabelSelector, LabelSet, SpecError};
use crate::status::Status;
use zerocopy::byteorder::little_endian::{I64, U16, U32, U64};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

/// `"RT"`: the first two bytes after `body_len` of every frame.
pub const MAGIC: u16 = u16::from_le_bytes(*b"RT");
/// Size of [`FrameHeader`] in bytes.
pub const HEADER_LEN: usize = 24;
/// Largest metadata section, in bytes.
pub const META_LEN_MAX: usize = u16::MAX as usize;
/// Largest encoded register set: an APPEND_REPLY's metadata (48 fixed
/// bytes, the registers, and 8 for a route revision) must fit in
/// [`META_LEN_MAX`].
pub const REGISTERS_ENCODED_LEN_MAX: usize = META_LEN_MAX - 48 - 8;
/// Largest payload a frame may carry by default (content chunks, read data).
pub const PAYLOAD_LEN_MAX: usize = 16 << 20;
/// Largest `body_len` accepted by default.
pub const BODY_LEN_MAX: u32 = (PAYLOAD_LEN_MAX + META_LEN_MAX) as u32;

/// Fixed header of every frame.
#[derive(Clone, Copy, Debug, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct FrameHeader {
    /// Bytes that follow this header: `meta_len` + payload length.
    pub body_len: U32,
    /// Always [`MAGIC`].
    pub magic: U16,
    /// What the frame is ([`Op`]).
    pub op: u8,
    /// Op-specific flag bits; bits an op does not define must be zero.
    pub flags: u8,
    /// [`Status`] code in replies; zero in requests.
    pub status: U16,
    /// Length of the metadata section.
    pub meta_len: U16,
    /// Chosen by the client; echoed in every frame answering the request.
    pub request_id: U64,
    /// Must be zero.
    pub reserved: U32,
}

const _: () = assert!(std::mem::size_of::<FrameHeader>() == HEADER_LEN);
const _: () = assert!(BODY_LEN_MAX as usize == PAYLOAD_LEN_MAX + META_LEN_MAX);

macro_rules! ops {
    ($($(#[doc = $doc:literal])* $name:ident = $code:literal, flags = $flags:expr;)*) => {
        /// Frame kinds. Requests are below 0x80, replies at or above.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        #[allow(non_camel_case_types)]
        #[repr(u8)]
        pub enum Op {
            $($(#[doc = $doc])* $name = $code,)*
        }

        impl Op {
            pub fn from_code(code: u8) -> Option<Op> {
                match code {
                    $($code => Some(Op::$name),)*
                    _ => None,
                }
            }

            /// Flag bits this op defines.
            pub fn known_flags(self) -> u8 {
                match self {
                    $(Op::$name => $flags,)*
                }
            }
        }
    };
}

ops! {
    /// Begins an append; payload is the first content chunk.
    APPEND = 0x01, flags = flag::MORE | flag::DO_NOT_PROXY;
    /// Further content of the open append with the same request id.
    APPEND_CHUNK = 0x02, flags = flag::MORE | flag::ABORT;
    /// Reads a journal from an offset.
    READ = 0x03, flags = flag::BLOCK | flag::METADATA_ONLY | flag::DO_NOT_PROXY | flag::PROXIED | flag::TAKEOVER;
    /// Cancels the request with the same request id (a blocking read).
    CANCEL = 0x04, flags = 0;
    /// Asks which shard owns a journal; meta is the name.
    ROUTE = 0x05, flags = 0;
    /// Creates or changes journals; payload is a JSON array of specs.
    APPLY = 0x10, flags = 0;
    /// Lists journals; payload is JSON `{"selector": "..."}`.
    LIST = 0x11, flags = 0;
    /// Deletes a journal and its local fragments; meta is the name.
    DELETE = 0x12, flags = 0;
    /// Lists a journal's fragments; meta is the name.
    FRAGMENTS = 0x13, flags = 0;
    /// Seals a journal's open spool now; meta is the name.
    SEAL = 0x14, flags = 0;
    /// Broker metrics as JSON.
    STATS = 0x15, flags = 0;
    /// Replies at once with the same payload.
    PING = 0x16, flags = 0;
    /// Moves a journal's write head to the end of its fragment index; meta is the name.
    RESET_HEAD = 0x17, flags = 0;
    /// Deletes store fragments older than their journal's retention; JSON payload.
    PRUNE = 0x18, flags = 0;
    /// Lists the cluster's brokers (members), with the journals each holds.
    MEMBERS = 0x19, flags = 0;
    /// Marks a broker exiting, so that its journals move to others; JSON
    /// payload `{"id": "…"}`. In a cluster on etcd only.
    DRAIN = 0x1A, flags = 0;
    /// Broker to broker: content, commit proposals and rollbacks of a
    /// primary's appends, for the replica shard this connection reaches.
    REPLICATE = 0x20, flags = 0;
    /// Broker to broker: agree on a journal's route, head and registers
    /// before its appends are replicated; JSON payload.
    SYNC = 0x21, flags = 0;
    /// Reply to APPEND (after its last chunk) or to APPEND_CHUNK with ABORT.
    APPEND_REPLY = 0x81, flags = 0;
    /// Content of a READ at an offset; more frames follow.
    READ_DATA = 0x83, flags = 0;
    /// Last frame answering a READ.
    READ_DONE = 0x84, flags = 0;
    /// Answers a READ with DO_NOT_PROXY whose offset lies in a fragment held
    /// only by a store: where to read it. The READ_DONE that follows names
    /// the offset to resume at with the broker.
    READ_FRAGMENT = 0x85, flags = 0;
    /// Reply to ROUTE, APPLY, LIST, DELETE, FRAGMENTS, SEAL, STATS, MEMBERS, DRAIN: JSON payload.
    ADMIN_REPLY = 0x90, flags = flag::NEXT_PAGE;
    /// Reply to PING.
    PONG = 0x96, flags = 0;
    /// Broker to broker: outcomes of replicated appends and SYNCs, many per frame.
    REPLICATE_ACK = 0xA0, flags = 0;
    /// A request that could not be decoded; payload is the reason.
    ERROR = 0xFF, flags = 0;
}

/// Flag bits.
pub mod flag {
    /// APPEND, APPEND_CHUNK: more content frames follow.
    pub const MORE: u8 = 1 << 0;
    /// APPEND_CHUNK: roll the append back instead of committing it.
    pub const ABORT: u8 = 1 << 2;
    /// READ: wait at the write head for more content.
    pub const BLOCK: u8 = 1 << 0;
    /// READ: reply with READ_DONE only (offsets, no content).
    pub const METADATA_ONLY: u8 = 1 << 1;
    /// READ: do not proxy to another broker or store. APPEND: do not proxy
    /// to the journal's primary.
    pub const DO_NOT_PROXY: u8 = 1 << 2;
    /// READ: sent by a broker proxying a client's read; the receiver serves
    /// it from its own copy or refuses it, and never proxies it on.
    pub const PROXIED: u8 = 1 << 3;
    /// READ: sent by a broker taking the journal over from this one. The
    /// receiver serves the bytes it holds itself even when it is outside
    /// the journal's route, and never proxies it.
    pub const TAKEOVER: u8 = 1 << 4;
    /// ADMIN_REPLY to FRAGMENTS or LIST: entries after the page's last
    /// one remain; ask again after it.
    pub const NEXT_PAGE: u8 = 1 << 1;
}

/// Most fragments one FRAGMENTS reply lists (its default page), beyond
/// those that begin where the page's last one does.
pub const FRAGMENTS_PAGE_MAX: u32 = 1000;

/// Most entries one LIST reply holds (its default page).
pub const LIST_PAGE_MAX: u32 = 1000;

/// The payload of a LIST for the page after the name `after` (`""`: the
/// first page).
pub fn list_payload(selector: &str, after: &str) -> Vec<u8> {
    let mut body = serde_json::json!({ "selector": selector });
    if !after.is_empty() {
        body["after"] = after.into();
    }
    serde_json::to_vec(&body).expect("JSON")
}

/// Why bytes are not a valid frame or message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    #[error("bad magic {0:#06x}: not a rotary frame")]
    BadMagic(u16),
    #[error("frame body of {len} bytes exceeds the limit of {max}")]
    FrameTooLarge { len: u32, max: u32 },
    #[error("meta_len {meta_len} exceeds body_len {body_len}")]
    MetaTooLong { meta_len: u16, body_len: u32 },
    #[error("unknown op {0:#04x}")]
    UnknownOp(u8),
    #[error("unknown flags {flags:#04x} for op {op:?}")]
    UnknownFlags { op: Op, flags: u8 },
    #[error("reserved header field is not zero")]
    Reserved,
    #[error("metadata truncated reading {0}")]
    Truncated(&'static str),
    #[error("{0} bytes of metadata left over")]
    Trailing(usize),
    #[error("string is not UTF-8: {0}")]
    Utf8(&'static str),
    #[error("unknown status code {0}")]
    UnknownStatus(u16),
    #[error("offset {0} is negative (only -1, the write head, is allowed)")]
    BadOffset(i64),
    #[error("offset {0} exceeds {OFFSET_MAX} (i64::MAX), the largest offset a request carries")]
    OffsetTooLarge(u64),
    #[error("end offset 0 cannot be sent: 0 means \"no end\" on the wire (the range [offset, 0) is empty)")]
    ZeroEndOffset,
    #[error(transparent)]
    Spec(#[from] SpecError),
}

impl WireError {
    /// The status a server answers this error with.
    pub fn status(&self) -> Status {
        match self {
            WireError::FrameTooLarge { .. } => Status::FRAME_TOO_LARGE,
            _ => Status::BAD_REQUEST,
        }
    }
}

/// A decoded frame borrowing its bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Frame<'a> {
    pub op: Op,
    pub flags: u8,
    pub status: u16,
    pub request_id: u64,
    pub meta: &'a [u8],
    pub payload: &'a [u8],
}

/// Reads the header at the front of `buf`, if complete, and checks it.
/// Returns the header and the total frame length (header + body).
pub fn decode_header(
    buf: &[u8],
    body_len_max: u32,
) -> Result<Option<(FrameHeader, usize)>, WireError> {
    let Some((header, _)) = FrameHeader::read_from_prefix(buf).ok() else {
        return Ok(None);
    };
    if header.magic.get() != MAGIC {
        return Err(WireError::BadMagic(header.magic.get()));
    }
    let body_len = header.body_len.get();
    if body_len > body_len_max {
        return Err(WireError::FrameTooLarge {
            len: body_len,
            max: body_len_max,
        });
    }
    if u32::from(header.meta_len.get()) > body_len {
        return Err(WireError::MetaTooLong {
            meta_len: header.meta_len.get(),
            body_len,
        });
    }
    let op = Op::from_code(header.op).ok_or(WireError::UnknownOp(header.op))?;
    if header.flags & !op.known_flags() != 0 {
        return Err(WireError::UnknownFlags {
            op,
            flags: header.flags,
        });
    }
    if header.reserved.get() != 0 {
        return Err(WireError::Reserved);
    }
    Ok(Some((header, HEADER_LEN + body_len as usize)))
}

/// Decodes one frame from the front of `buf`. `Ok(None)` means more bytes
/// are needed; the `usize` is how many bytes the frame took.
pub fn decode_frame(
    buf: &[u8],
    body_len_max: u32,
) -> Result<Option<(Frame<'_>, usize)>, WireError> {
    let Some((header, total)) = decode_header(buf, body_len_max)? else {
        return Ok(None);
    };
    if buf.len() < total {
        return Ok(None);
    }
    let body = &buf[HEADER_LEN..total];
    let (meta, payload) = body.split_at(header.meta_len.get() as usize);
    let op = Op::from_code(header.op).ok_or(WireError::UnknownOp(header.op))?;
    Ok(Some((
        Frame {
            op,
            flags: header.flags,
            status: header.status.get(),
            request_id: header.request_id.get(),
            meta,
            payload,
        },
        total,
    )))
}

/// Appends a frame to `out`. Panics if `meta` exceeds [`META_LEN_MAX`]:
/// callers build metadata from bounded fields.
pub fn encode_frame(
    out: &mut Vec<u8>,
    op: Op,
    flags: u8,
    status: Status,
    request_id: u64,
    meta: &[u8],
    payload: &[u8],
) {
    let header = frame_header(op, flags, status, request_id, meta.len(), payload.len());
    out.reserve(HEADER_LEN + meta.len() + payload.len());
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(meta);
    out.extend_from_slice(payload);
}

/// Builds a header for a frame whose payload the caller sends separately.
pub fn frame_header(
    op: Op,
    flags: u8,
    status: Status,
    request_id: u64,
    meta_len: usize,
    payload_len: usize,
) -> FrameHeader {
    assert!(meta_len <= META_LEN_MAX, "meta of {meta_len} bytes");
    assert!(
        flags & !op.known_flags() == 0,
        "flags {flags:#x} for {op:?}"
    );
    let body_len = u32::try_from(meta_len + payload_len).expect("frame body fits u32");
    FrameHeader {
        body_len: U32::new(body_len),
        magic: U16::new(MAGIC),
        op: op as u8,
        flags,
        status: U16::new(status as u16),
        meta_len: U16::new(meta_len as u16),
        request_id: U64::new(request_id),
        reserved: U32::new(0),
    }
}

/// Builds a metadata section.
#[derive(Default)]
pub struct MetaWriter {
    buf: Vec<u8>,
}

impl MetaWriter {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn fixed<T: IntoBytes + Immutable>(&mut self, v: &T) -> &mut Self {
        self.buf.extend_from_slice(v.as_bytes());
        self
    }

    /// A string as `u16 length | bytes`. Strings on the wire are bounded by
    /// the spec rules (names ≤ 512, label values ≤ 1024); longer is a bug.
    pub fn str16(&mut self, s: &str) -> &mut Self {
        let len = u16::try_from(s.len()).expect("wire string fits u16");
        self.buf.extend_from_slice(&len.to_le_bytes());
        self.buf.extend_from_slice(s.as_bytes());
        self
    }

    /// A label set as `u16 count | (str16 name, str16 value)*`.
    pub fn labels(&mut self, set: &LabelSet) -> &mut Self {
        let n = u16::try_from(set.len()).expect("label count fits u16");
        self.buf.extend_from_slice(&n.to_le_bytes());
        for l in set.iter() {
            self.str16(&l.name);
            self.str16(&l.value);
        }
        self
    }

    /// Raw bytes, as they are.
    pub fn raw(&mut self, bytes: &[u8]) -> &mut Self {
        self.buf.extend_from_slice(bytes);
        self
    }

    /// Ends a section with an etcd revision, left out when 0: sections
    /// without one read as revision 0 ([`MetaReader::revision`]), so
    /// brokers and clients outside etcd send what they always sent.
    pub fn revision(&mut self, revision: u64) -> &mut Self {
        if revision != 0 {
            self.buf.extend_from_slice(&revision.to_le_bytes());
        }
        self
    }

    /// Bytes written so far.
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    /// The bytes written, for a payload (which has no metadata limit).
    pub fn into_payload(self) -> Vec<u8> {
        self.buf
    }

    pub fn finish(self) -> Vec<u8> {
        assert!(
            self.buf.len() <= META_LEN_MAX,
            "meta of {} bytes",
            self.buf.len()
        );
        self.buf
    }
}

/// Reads a metadata section; every read is bounds-checked.
pub struct MetaReader<'a> {
    buf: &'a [u8],
}

impl<'a> MetaReader<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        MetaReader { buf }
    }

    pub fn fixed<T: FromBytes + KnownLayout + Immutable>(
        &mut self,
        what: &'static str,
    ) -> Result<T, WireError> {
        let (v, rest) = T::read_from_prefix(self.buf).map_err(|_| WireError::Truncated(what))?;
        self.buf = rest;
        Ok(v)
    }

    pub fn str16(&mut self, what: &'static str) -> Result<&'a str, WireError> {
        if self.buf.len() < 2 {
            return Err(WireError::Truncated(what));
        }
        let len = u16::from_le_bytes([self.buf[0], self.buf[1]]) as usize;
        let rest = &self.buf[2..];
        if rest.len() < len {
            return Err(WireError::Truncated(what));
        }
        let s = std::str::from_utf8(&rest[..len]).map_err(|_| WireError::Utf8(what))?;
        self.buf = &rest[len..];
        Ok(s)
    }

    /// The next `n` raw bytes.
    pub fn bytes(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], WireError> {
        if self.buf.len() < n {
            return Err(WireError::Truncated(what));
        }
        let (v, rest) = self.buf.split_at(n);
        self.buf = rest;
        Ok(v)
    }

    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }

    pub fn labels(&mut self, what: &'static str) -> Result<LabelSet, WireError> {
        if self.buf.len() < 2 {
            return Err(WireError::Truncated(what));
        }
        let n = u16::from_le_bytes([self.buf[0], self.buf[1]]);
        self.buf = &self.buf[2..];
        let mut set = LabelSet::new();
        for _ in 0..n {
            let name = self.str16(what)?;
            let value = self.str16(what)?;
            set.push_sorted(name.to_string(), value.to_string())?;
        }
        Ok(set)
    }

    /// The optional etcd revision that may end a section (see
    /// [`MetaWriter::revision`]): 0 when the section ends here.
    pub fn revision(&mut self, what: &'static str) -> Result<u64, WireError> {
        if self.buf.is_empty() {
            return Ok(0);
        }
        let v: U64 = self.fixed(what)?;
        Ok(v.get())
    }

    pub fn finish(self) -> Result<(), WireError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(WireError::Trailing(self.buf.len()))
        }
    }
}

/// Largest offset a request can name: requested offsets travel as `i64`,
/// whose negative values mean "none" (`-1`) or are refused.
pub const OFFSET_MAX: u64 = i64::MAX as u64;

/// Refuses a requested offset that does not fit the wire's `i64`. Encoding
/// one would wrap it to a negative number, and `-1` means "no expected
/// offset" on APPEND and "the write head" on READ.
pub fn check_offset(offset: Option<u64>) -> Result<(), WireError> {
    match offset {
        Some(o) if o > OFFSET_MAX => Err(WireError::OffsetTooLarge(o)),
        _ => Ok(()),
    }
}

/// Refuses `Some(0)` as a READ's end: on the wire 0 means "no end", so
/// sending it would read the whole journal instead of nothing.
pub fn check_end_offset(end_offset: Option<u64>) -> Result<(), WireError> {
    match end_offset {
        Some(0) => Err(WireError::ZeroEndOffset),
        _ => check_offset(end_offset),
    }
}

/// A requested offset as it travels: `None` is `-1`.
///
/// # Panics
///
/// If the offset exceeds [`OFFSET_MAX`]: callers check requests with
/// [`check_offset`] first (the client does), since the value would wrap.
fn offset_to_wire(offset: Option<u64>) -> i64 {
    match offset {
        None => -1,
        Some(o) => i64::try_from(o)
            .unwrap_or_else(|_| panic!("offset {o} exceeds OFFSET_MAX; call check_offset first")),
    }
}

/// Fixed part of APPEND's metadata.
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct AppendFixed {
    /// Required write head, or -1 for no requirement.
    pub expect_offset: I64,
}

/// APPEND metadata: preconditions and register changes.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AppendRequest {
    pub journal: String,
    /// The write head must equal this offset.
    pub expect_offset: Option<u64>,
    /// The journal's registers must match this selector.
    pub check_registers: LabelSelector,
    /// Added to the registers if the append commits at least one byte.
    pub union_registers: LabelSet,
    /// Removed from the registers if the append commits at least one byte.
    pub subtract_registers: LabelSet,
    /// The etcd revision the sender's route of the journal was read at
    /// (Gazette's `min_etcd_revision`): a broker that has seen less waits
    /// for its watch to catch up before it routes the append. 0: none.
    pub route_revision: u64,
}

impl AppendRequest {
    /// # Panics
    ///
    /// If `expect_offset` exceeds [`OFFSET_MAX`] (see [`check_offset`]).
    pub fn encode(&self) -> Vec<u8> {
        self.encode_at(self.route_revision)
    }

    /// The request as it goes on a route read at `route_revision`: the
    /// later of it and the request's own.
    ///
    /// # Panics
    ///
    /// As [`AppendRequest::encode`].
    pub fn encode_at(&self, route_revision: u64) -> Vec<u8> {
        let mut w = MetaWriter::new();
        w.fixed(&AppendFixed {
            expect_offset: I64::new(offset_to_wire(self.expect_offset)),
        })
        .str16(&self.journal)
        .labels(&self.check_registers.include)
        .labels(&self.check_registers.exclude)
        .labels(&self.union_registers)
        .labels(&self.subtract_registers)
        .revision(route_revision.max(self.route_revision));
        w.finish()
    }

    pub fn decode(meta: &[u8]) -> Result<Self, WireError> {
        let mut r = MetaReader::new(meta);
        let fixed: AppendFixed = r.fixed("append offset")?;
        let expect = fixed.expect_offset.get();
        let expect_offset = match expect {
            -1 => None,
            o if o >= 0 => Some(o as u64),
            o => return Err(WireError::BadOffset(o)),
        };
        let journal = r.str16("journal name")?.to_string();
        let include = r.labels("check_registers.include")?;
        let exclude = r.labels("check_registers.exclude")?;
        let union_registers = r.labels("union_registers")?;
        let subtract_registers = r.labels("subtract_registers")?;
        let route_revision = r.revision("route revision")?;
        r.finish()?;
        Ok(AppendRequest {
            journal,
            expect_offset,
            check_registers: LabelSelector { include, exclude },
            union_registers,
            subtract_registers,
            route_revision,
        })
    }
}

/// Fixed part of APPEND_REPLY's metadata.
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct AppendReplyFixed {
    pub begin: U64,
    pub end: U64,
    pub write_head: U64,
    pub sha1: [u8; 20],
    pub reserved: [u8; 4],
}

const _: () = assert!(std::mem::size_of::<AppendReplyFixed>() == 48);

/// APPEND_REPLY metadata. On success `[begin, end)` is where the append
/// committed and `sha1` is the SHA-1 of its bytes. On any status the write
/// head and the journal's registers (as of the reply) are filled in where
/// known; a failed append's `begin == end`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AppendReply {
    pub begin: u64,
    pub end: u64,
    pub write_head: u64,
    pub sha1: [u8; 20],
    pub registers: LabelSet,
    /// In a cluster on etcd, the revision of the route the answering
    /// broker acted on; a client told to go elsewhere looks the route up
    /// again at this revision or later. 0 outside etcd.
    pub route_revision: u64,
}

impl AppendReply {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = MetaWriter::new();
        w.fixed(&AppendReplyFixed {
            begin: U64::new(self.begin),
            end: U64::new(self.end),
            write_head: U64::new(self.write_head),
            sha1: self.sha1,
            reserved: [0; 4],
        })
        .labels(&self.registers)
        .revision(self.route_revision);
        w.finish()
    }

    pub fn decode(meta: &[u8]) -> Result<Self, WireError> {
        let mut r = MetaReader::new(meta);
        let f: AppendReplyFixed = r.fixed("append reply")?;
        let registers = r.labels("registers")?;
        let route_revision = r.revision("route revision")?;
        r.finish()?;
        Ok(AppendReply {
            begin: f.begin.get(),
            end: f.end.get(),
            write_head: f.write_head.get(),
            sha1: f.sha1,
            registers,
            route_revision,
        })
    }
}

/// Fixed part of READ's metadata.
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct ReadFixed {
    /// First offset to read, or -1 for the write head.
    pub offset: I64,
    /// Stop before this offset; 0 reads without end.
    pub end_offset: U64,
}

/// READ metadata.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReadRequest {
    pub journal: String,
    /// `None` is the write head (-1 on the wire).
    pub offset: Option<u64>,
    /// Stop before this offset; `None` reads without end.
    pub end_offset: Option<u64>,
    /// As [`AppendRequest::route_revision`]. 0: none.
    pub route_revision: u64,
}

impl ReadRequest {
    /// # Panics
    ///
    /// If `offset` exceeds [`OFFSET_MAX`] (see [`check_offset`]).
    pub fn encode(&self) -> Vec<u8> {
        let mut w = MetaWriter::new();
        w.fixed(&ReadFixed {
            offset: I64::new(offset_to_wire(self.offset)),
            end_offset: U64::new(self.end_offset.unwrap_or(0)),
        })
        .str16(&self.journal)
        .revision(self.route_revision);
        w.finish()
    }

    pub fn decode(meta: &[u8]) -> Result<Self, WireError> {
        let mut r = MetaReader::new(meta);
        let f: ReadFixed = r.fixed("read offsets")?;
        let offset = match f.offset.get() {
            -1 => None,
            o if o >= 0 => Some(o as u64),
            o => return Err(WireError::BadOffset(o)),
        };
        let end_offset = match f.end_offset.get() {
            0 => None,
            e => Some(e),
        };
        let journal = r.str16("journal name")?.to_string();
        let route_revision = r.revision("route revision")?;
        r.finish()?;
        Ok(ReadRequest {
            journal,
            offset,
            end_offset,
            route_revision,
        })
    }
}

/// READ_DATA metadata: the journal offset of the payload's first byte.
#[derive(Clone, Copy, Debug, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct ReadData {
    pub offset: U64,
}

/// READ_DONE metadata: where the read stopped and the write head then.
#[derive(Clone, Copy, Debug, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct ReadDone {
    /// Next offset the reader would read.
    pub offset: U64,
    pub write_head: U64,
}

/// READ_FRAGMENT metadata: a fragment in a store and where the reader's
/// bytes start in it. The payload is the location: a `file:///…` path or
/// an `http(s)://…` URL (presigned, time-limited) to GET.
#[derive(Clone, Copy, Debug, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct ReadFragment {
    pub begin: U64,
    pub end: U64,
    /// First offset the reader asked for (`begin <= offset < end`).
    pub offset: U64,
    /// SHA-1 of the fragment's uncompressed bytes.
    pub sha1: [u8; 20],
    /// 0 none, 1 gzip, 2 zstd, 3 snappy (framing format), 4 gzip-offload
    /// (gzip bytes, held by S3 with `Content-Encoding: gzip`).
    pub codec: u8,
    pub reserved: [u8; 3],
}

const _: () = assert!(std::mem::size_of::<ReadFragment>() == 48);

/// Wire code of a codec in [`ReadFragment::codec`] (the enum's
/// discriminant, fixed there).
pub fn codec_code(codec: crate::spec::Codec) -> u8 {
    codec as u8
}

pub fn codec_from_code(code: u8) -> Option<crate::spec::Codec> {
    crate::spec::Codec::ALL.get(usize::from(code)).copied()
}

/// Decodes a name-only metadata section (ROUTE, DELETE, FRAGMENTS, SEAL).
pub fn decode_name(meta: &[u8]) -> Result<&str, WireError> {
    let mut r = MetaReader::new(meta);
    let name = r.str16("journal name")?;
    r.finish()?;
    Ok(name)
}

pub fn encode_name(name: &str) -> Vec<u8> {
    let mut w = MetaWriter::new();
    w.str16(name);
    w.finish()
}

/// ROUTE's metadata: the journal's name and the least etcd revision the
/// answer must be read at (0: any).
pub fn encode_route(name: &str, min_revision: u64) -> Vec<u8> {
    let mut w = MetaWriter::new();
    w.str16(name).revision(min_revision);
    w.finish()
}

/// Decodes ROUTE's metadata (see [`encode_route`]).
pub fn decode_route(meta: &[u8]) -> Result<(&str, u64), WireError> {
    let mut r = MetaReader::new(meta);
    let name = r.str16("journal name")?;
    let revision = r.revision("route revision")?;
    r.finish()?;
    Ok((name, revision))
}

/// A refused READ's READ_DONE metadata: offsets 0 and, in a cluster on
/// etcd, the revision of the route the refusing broker acted on.
pub fn encode_read_refusal(route_revision: u64) -> Vec<u8> {
    let mut w = MetaWriter::new();
    w.raw(&[0; 16]).revision(route_revision);
    w.finish()
}

/// Decodes READ_DONE's metadata: where the read stopped, and the route
/// revision a refusal may carry (0 without one).
pub fn decode_read_done(meta: &[u8]) -> Result<(ReadDone, u64), WireError> {
    let mut r = MetaReader::new(meta);
    let done: ReadDone = r.fixed("read done")?;
    let revision = r.revision("route revision")?;
    r.finish()?;
    Ok((done, revision))
}

/// Decodes a fixed-size metadata section exactly.
pub fn decode_fixed<T: FromBytes + KnownLayout + Immutable>(
    meta: &[u8],
    what: &'static str,
) -> Result<T, WireError> {
    let mut r = MetaReader::new(meta);
    let v = r.fixed(what)?;
    r.finish()?;
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn label_set() -> impl Strategy<Value = LabelSet> {
        proptest::collection::vec(("[a-z][a-z0-9_.]{0,8}", "[a-z0-9=%:]{0,10}"), 0..5)
            .prop_map(|pairs| LabelSet::from_pairs(pairs).unwrap())
    }

    fn journal() -> impl Strategy<Value = String> {
        "[a-z0-9]{2,10}(/[a-z0-9_.=%+-]{1,10}){1,3}"
    }

    /// The codes of PROTOCOL.md §5.11, pinned: a client decodes by them.
    #[test]
    fn codec_codes_are_the_documented_ones() {
        use crate::spec::Codec;
        let codes = [
            (Codec::None, 0),
            (Codec::Gzip, 1),
            (Codec::Zstd, 2),
            (Codec::Snappy, 3),
            (Codec::GzipOffload, 4),
        ];
        for (codec, code) in codes {
            assert_eq!(codec_code(codec), code);
            assert_eq!(codec_from_code(code), Some(codec));
        }
        assert_eq!(codes.len(), Codec::ALL.len());
        assert_eq!(codec_from_code(5), None);
        assert_eq!(codec_from_code(255), None);
    }

    #[test]
    fn a_zero_end_offset_is_refused_before_it_means_no_end() {
        assert_eq!(check_end_offset(None), Ok(()));
        assert_eq!(check_end_offset(Some(1)), Ok(()));
        assert_eq!(check_end_offset(Some(0)), Err(WireError::ZeroEndOffset));
        assert_eq!(
            check_end_offset(Some(OFFSET_MAX + 1)),
            Err(WireError::OffsetTooLarge(OFFSET_MAX + 1))
        );
    }

    #[test]
    fn offsets_beyond_i64_are_refused_not_wrapped() {
        assert_eq!(check_offset(None), Ok(()));
        assert_eq!(check_offset(Some(OFFSET_MAX)), Ok(()));
        assert_eq!(
            check_offset(Some(OFFSET_MAX + 1)),
            Err(WireError::OffsetTooLarge(OFFSET_MAX + 1))
        );
        assert_eq!(
            check_offset(Some(u64::MAX)),
            Err(WireError::OffsetTooLarge(u64::MAX))
        );
        let req = AppendRequest {
            journal: "a/b/c".into(),
            expect_offset: Some(OFFSET_MAX),
            ..Default::default()
        };
        assert_eq!(&req.encode()[..8], &i64::MAX.to_le_bytes());
        assert_eq!(AppendRequest::decode(&req.encode()).unwrap(), req);
    }

    #[test]
    #[should_panic(expected = "exceeds OFFSET_MAX")]
    fn encoding_an_append_offset_beyond_i64_panics() {
        let req = AppendRequest {
            journal: "a/b/c".into(),
            expect_offset: Some(u64::MAX),
            ..Default::default()
        };
        let _ = req.encode();
    }

    #[test]
    #[should_panic(expected = "exceeds OFFSET_MAX")]
    fn encoding_a_read_offset_beyond_i64_panics() {
        let req = ReadRequest {
            journal: "a/b/c".into(),
            offset: Some(OFFSET_MAX + 1),
            end_offset: None,
            route_revision: 0,
        };
        let _ = req.encode();
    }

    proptest! {
        #[test]
        fn append_request_round_trips(
            journal in journal(),
            expect in proptest::option::of(0u64..=OFFSET_MAX),
            include in label_set(), exclude in label_set(),
            union in label_set(), subtract in label_set(),
            route_revision in prop_oneof![Just(0u64), any::<u64>()],
        ) {
            let req = AppendRequest {
                journal, expect_offset: expect,
                check_registers: LabelSelector { include, exclude },
                union_registers: union, subtract_registers: subtract, route_revision,
            };
            let meta = req.encode();
            prop_assert_eq!(AppendRequest::decode(&meta).unwrap(), req.clone());
            // Every strict prefix is rejected, never accepted or panicking,
            // but the one without the revision, which is the request at
            // revision 0 (what a sender outside etcd sends).
            let bare = if route_revision == 0 { meta.len() } else { meta.len() - 8 };
            for cut in 0..meta.len() {
                match AppendRequest::decode(&meta[..cut]) {
                    Ok(r) => {
                        prop_assert_eq!(cut, bare);
                        prop_assert_eq!(r, AppendRequest { route_revision: 0, ..req.clone() });
                    }
                    Err(_) => prop_assert_ne!(cut, bare),
                }
            }
        }

        #[test]
        fn append_reply_round_trips(begin in any::<u64>(), len in 0u64..1<<40, head in any::<u64>(),
                                    sha1 in any::<[u8; 20]>(), registers in label_set(),
                                    route_revision in any::<u64>()) {
            let reply = AppendReply { begin, end: begin.wrapping_add(len), write_head: head, sha1, registers, route_revision };
            prop_assert_eq!(AppendReply::decode(&reply.encode()).unwrap(), reply);
        }

        #[test]
        fn read_request_round_trips(journal in journal(),
                                    offset in proptest::option::of(0u64..=OFFSET_MAX),
                                    end in proptest::option::of(1u64..u64::MAX),
                                    route_revision in any::<u64>()) {
            let req = ReadRequest { journal: journal.clone(), offset, end_offset: end, route_revision };
            prop_assert_eq!(ReadRequest::decode(&req.encode()).unwrap(), req);
            let route = encode_route(&journal, route_revision);
            prop_assert_eq!(decode_route(&route).unwrap(), (journal.as_str(), route_revision));
            let (done, r) = decode_read_done(&encode_read_refusal(route_revision)).unwrap();
            prop_assert_eq!((done.offset.get(), done.write_head.get(), r), (0, 0, route_revision));
        }

        #[test]
        fn frames_round_trip(op in prop::sample::select(vec![Op::APPEND, Op::APPEND_CHUNK, Op::READ_DATA, Op::APPEND_REPLY]),
                             more in any::<bool>(), id in any::<u64>(),
                             meta in proptest::collection::vec(any::<u8>(), 0..300),
                             payload in proptest::collection::vec(any::<u8>(), 0..3000)) {
            let flags = if more && op.known_flags() & flag::MORE != 0 { flag::MORE } else { 0 };
            let mut buf = Vec::new();
            encode_frame(&mut buf, op, flags, Status::OK, id, &meta, &payload);
            encode_frame(&mut buf, Op::PING, 0, Status::OK, id ^ 1, &[], b"x");
            let (f, used) = decode_frame(&buf, BODY_LEN_MAX).unwrap().unwrap();
            prop_assert_eq!(f.op, op);
            prop_assert_eq!(f.flags, flags);
            prop_assert_eq!(f.request_id, id);
            prop_assert_eq!(f.meta, &meta[..]);
            prop_assert_eq!(f.payload, &payload[..]);
            let (g, used2) = decode_frame(&buf[used..], BODY_LEN_MAX).unwrap().unwrap();
            prop_assert_eq!(g.op, Op::PING);
            prop_assert_eq!(used + used2, buf.len());
            // Any prefix of a frame asks for more bytes, never errors.
            for cut in [0, 1, HEADER_LEN - 1, HEADER_LEN, used - 1] {
                prop_assert_eq!(decode_frame(&buf[..cut], BODY_LEN_MAX).unwrap(), None);
            }
        }

        #[test]
        fn garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            if let Ok(Some((f, _))) = decode_frame(&bytes, BODY_LEN_MAX) {
                let _ = AppendRequest::decode(f.meta);
                let _ = ReadRequest::decode(f.meta);
                let _ = AppendReply::decode(f.meta);
            }
        }
    }

    #[test]
    fn header_errors() {
        let mut buf = Vec::new();
        encode_frame(&mut buf, Op::PING, 0, Status::OK, 7, &[], &[]);
        let mut bad = buf.clone();
        bad[4] = 0;
        assert!(matches!(
            decode_frame(&bad, BODY_LEN_MAX),
            Err(WireError::BadMagic(_))
        ));
        let mut bad = buf.clone();
        bad[6] = 0x7e;
        assert_eq!(
            decode_frame(&bad, BODY_LEN_MAX),
            Err(WireError::UnknownOp(0x7e))
        );
        let mut bad = buf.clone();
        bad[7] = 0x80;
        assert!(matches!(
            decode_frame(&bad, BODY_LEN_MAX),
            Err(WireError::UnknownFlags { .. })
        ));
        let mut big = Vec::new();
        encode_frame(&mut big, Op::PING, 0, Status::OK, 7, &[], &[0; 100]);
        let err = decode_frame(&big, 50).unwrap_err();
        assert_eq!(err.status(), Status::FRAME_TOO_LARGE);
        let mut bad = buf.clone();
        bad[20] = 1;
        assert_eq!(decode_frame(&bad, BODY_LEN_MAX), Err(WireError::Reserved));
    }

    #[test]
    fn an_admin_reply_may_say_it_is_paged_and_nothing_else_may() {
        let mut buf = Vec::new();
        encode_frame(
            &mut buf,
            Op::ADMIN_REPLY,
            flag::NEXT_PAGE,
            Status::OK,
            7,
            &[],
            b"[]",
        );
        let (f, _) = decode_frame(&buf, BODY_LEN_MAX).unwrap().unwrap();
        assert_eq!((f.op, f.flags), (Op::ADMIN_REPLY, flag::NEXT_PAGE));
        for other in [1 << 0, 1 << 2] {
            buf[7] = other;
            assert!(matches!(
                decode_frame(&buf, BODY_LEN_MAX),
                Err(WireError::UnknownFlags { .. })
            ));
        }
        buf[7] = 1 << 2;
        assert!(matches!(
            decode_frame(&buf, BODY_LEN_MAX),
            Err(WireError::UnknownFlags { .. })
        ));
        let mut pong = Vec::new();
        encode_frame(&mut pong, Op::PONG, 0, Status::OK, 7, &[], &[]);
        pong[7] = flag::NEXT_PAGE;
        assert!(matches!(
            decode_frame(&pong, BODY_LEN_MAX),
            Err(WireError::UnknownFlags { .. })
        ));
    }

    #[test]
    fn negative_offsets_other_than_head_are_refused() {
        let mut w = MetaWriter::new();
        w.fixed(&ReadFixed {
            offset: I64::new(-5),
            end_offset: U64::new(0),
        })
        .str16("a/b/c");
        assert_eq!(
            ReadRequest::decode(&w.finish()),
            Err(WireError::BadOffset(-5))
        );
    }
}
