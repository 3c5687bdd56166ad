//! How messages are laid out in a journal's bytes, chosen by the journal's
//! `content-type` label with Gazette's names.
//!
//! - `application/x-ndjson` (JSON lines): one JSON object per line, the
//!   message UUID as a string at a JSON pointer the application names
//!   (`/_meta/uuid` by default). [`Envelope::message`] is the line without
//!   its newline.
//! - `application/x-protobuf-fixed` (Gazette's fixed framing): the 4-byte
//!   word `66 33 93 36`, a little-endian u32 length, then that many bytes
//!   of message. rotary's message is the protobuf encoding of
//!   `message { bytes uuid = 1; bytes content = 2; }`: the UUID's 16 bytes
//!   and the application's bytes. [`Envelope::message`] is `content`.
//!
//! A [`Decoder`] takes a journal's bytes as they are read and yields
//! envelopes; bytes that do not form a valid frame (a line that is not a
//! JSON object with a UUID, a fixed frame without the magic word or with a
//! body that does not decode) are skipped up to the next valid frame and
//! counted, never fatal.

use super::uuid::Uuid;
use super::{Envelope, MessageError};
use bytes::{Buf, Bytes, BytesMut};
use std::sync::Arc;

/// The journal label naming its framing.
pub const CONTENT_TYPE_LABEL: &str = "content-type";
/// Gazette's name of JSON lines.
pub const CONTENT_TYPE_JSON_LINES: &str = "application/x-ndjson";
/// Gazette's name of the fixed framing.
pub const CONTENT_TYPE_FIXED: &str = "application/x-protobuf-fixed";
/// Where a JSON message holds its UUID unless the application says otherwise.
pub const UUID_POINTER_DEFAULT: &str = "/_meta/uuid";
/// The word every fixed frame starts with.
pub const FIXED_MAGIC: [u8; 4] = [0x66, 0x33, 0x93, 0x36];
/// Magic word plus length.
pub const FIXED_HEADER_LEN: usize = 8;
/// Longest message (JSON line or fixed frame body) a decoder accepts; a
/// frame announcing more is taken for damage.
pub const MESSAGE_LEN_MAX: usize = 64 << 20;

/// A journal's framing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Framing {
    /// JSON lines, the UUID at this JSON pointer (RFC 6901, e.g. `/_meta/uuid`).
    JsonLines { uuid_pointer: String },
    /// Gazette's fixed framing.
    Fixed,
}

impl Framing {
    /// JSON lines with the UUID at `/_meta/uuid`.
    pub fn json() -> Framing {
        Framing::JsonLines {
            uuid_pointer: UUID_POINTER_DEFAULT.to_string(),
        }
    }

    /// The framing a `content-type` label names.
    pub fn from_content_type(
        journal: &str,
        content_type: Option<&str>,
        uuid_pointer: &str,
    ) -> Result<Framing, MessageError> {
        match content_type {
            Some(CONTENT_TYPE_JSON_LINES) => {
                check_pointer(uuid_pointer)?;
                Ok(Framing::JsonLines {
                    uuid_pointer: uuid_pointer.to_string(),
                })
            }
            Some(CONTENT_TYPE_FIXED) => Ok(Framing::Fixed),
            other => Err(MessageError::NoFraming {
                journal: journal.to_string(),
                content_type: other.map(str::to_string),
            }),
        }
    }

    pub fn content_type(&self) -> &'static str {
        match self {
            Framing::JsonLines { .. } => CONTENT_TYPE_JSON_LINES,
            Framing::Fixed => CONTENT_TYPE_FIXED,
        }
    }

    /// Appends the framed message to `out`. For JSON lines `payload` must be
    /// a JSON object (its UUID field is set, replacing any there); for the
    /// fixed framing it is the content, any bytes.
    pub fn encode(
        &self,
        uuid: Uuid,
        payload: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<(), MessageError> {
        match self {
            Framing::JsonLines { uuid_pointer } => {
                let mut doc: serde_json::Value =
                    serde_json::from_slice(payload).map_err(|e| MessageError::BadPayload {
                        why: format!("not JSON: {e}"),
                    })?;
                if !doc.is_object() {
                    return Err(MessageError::BadPayload {
                        why: "a JSON-lines message must be a JSON object".into(),
                    });
                }
                set_pointer(&mut doc, uuid_pointer, uuid.to_string())?;
                serde_json::to_writer(&mut *out, &doc).expect("JSON to a Vec");
                out.push(b'\n');
            }
            Framing::Fixed => {
                let body_len = 2
                    + 16
                    + if payload.is_empty() {
                        0
                    } else {
                        1 + varint_len(payload.len() as u64) + payload.len()
                    };
                if body_len > MESSAGE_LEN_MAX {
                    return Err(MessageError::BadPayload {
                        why: format!("message of {body_len} bytes exceeds {MESSAGE_LEN_MAX}"),
                    });
                }
                out.extend_from_slice(&FIXED_MAGIC);
                out.extend_from_slice(&(body_len as u32).to_le_bytes());
                out.push(0x0a); // field 1, length-delimited
                out.push(16);
                out.extend_from_slice(&uuid.0);
                if !payload.is_empty() {
                    out.push(0x12); // field 2, length-delimited
                    put_varint(out, payload.len() as u64);
                    out.extend_from_slice(payload);
                }
            }
        }
        Ok(())
    }

    /// Appends an acknowledgement (a message carrying only its UUID).
    pub fn encode_ack(&self, uuid: Uuid, out: &mut Vec<u8>) {
        match self {
            Framing::JsonLines { .. } => self.encode(uuid, b"{}", out),
            Framing::Fixed => self.encode(uuid, b"", out),
        }
        .expect("an empty message encodes");
    }
}

fn check_pointer(pointer: &str) -> Result<(), MessageError> {
    if !pointer.starts_with('/') || pointer.len() < 2 {
        return Err(MessageError::BadPointer {
            pointer: pointer.to_string(),
        });
    }
    Ok(())
}

fn pointer_tokens(pointer: &str) -> impl Iterator<Item = String> + '_ {
    pointer[1..]
        .split('/')
        .map(|t| t.replace("~1", "/").replace("~0", "~"))
}

/// Sets the string at `pointer`, creating objects on the way.
fn set_pointer(
    doc: &mut serde_json::Value,
    pointer: &str,
    value: String,
) -> Result<(), MessageError> {
    check_pointer(pointer)?;
    let mut at = doc;
    let tokens: Vec<String> = pointer_tokens(pointer).collect();
    let (last, path) = tokens.split_last().expect("a pointer has a token");
    for t in path {
        let obj = at.as_object_mut().ok_or_else(|| MessageError::BadPayload {
            why: format!("{pointer}: a value on the way is not an object"),
        })?;
        at = obj
            .entry(t.clone())
            .or_insert_with(|| serde_json::Value::Object(Default::default()));
    }
    let obj = at.as_object_mut().ok_or_else(|| MessageError::BadPayload {
        why: format!("{pointer}: its parent is not an object"),
    })?;
    obj.insert(last.clone(), serde_json::Value::String(value));
    Ok(())
}

fn varint_len(mut v: u64) -> usize {
    let mut n = 1;
    while v >= 0x80 {
        v >>= 7;
        n += 1;
    }
    n
}

fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn get_varint(b: &[u8], at: &mut usize) -> Option<u64> {
    let mut v = 0u64;
    for shift in (0..64).step_by(7) {
        let byte = *b.get(*at)?;
        *at += 1;
        v |= u64::from(byte & 0x7f) << shift;
        if byte < 0x80 {
            return Some(v);
        }
    }
    None
}

/// Decodes a fixed frame's body: `(uuid, content range)`. Unknown fields
/// are skipped, as protobuf decoders do.
fn decode_fixed_body(body: &[u8]) -> Option<(Uuid, std::ops::Range<usize>)> {
    let mut at = 0;
    let mut uuid = None;
    let mut content = 0..0;
    while at < body.len() {
        let key = get_varint(body, &mut at)?;
        let (field, wire_type) = (key >> 3, key & 7);
        match wire_type {
            0 => {
                get_varint(body, &mut at)?;
            }
            1 => at = at.checked_add(8)?,
            2 => {
                let len = usize::try_from(get_varint(body, &mut at)?).ok()?;
                let end = at.checked_add(len)?;
                if end > body.len() {
                    return None;
                }
                match field {
                    1 if len == 16 => {
                        let mut u = [0u8; 16];
                        u.copy_from_slice(&body[at..end]);
                        uuid = Some(Uuid(u));
                    }
                    1 => return None,
                    2 => content = at..end,
                    _ => {}
                }
                at = end;
            }
            5 => at = at.checked_add(4)?,
            _ => return None,
        }
        if at > body.len() {
            return None;
        }
    }
    Some((uuid?, content))
}

/// Reads the UUID of a JSON line.
fn decode_json_line(line: &[u8], uuid_pointer: &str) -> Option<Uuid> {
    let doc: serde_json::Value = serde_json::from_slice(line).ok()?;
    if !doc.is_object() {
        return None;
    }
    let text = doc.pointer(uuid_pointer)?.as_str()?;
    Uuid::parse(text).ok()
}

/// Turns a journal's bytes, as read, into envelopes.
///
/// Messages are slices of the bytes pushed ([`Decoder::push_bytes`]): only
/// a frame cut by the end of one push is copied, to join it with its rest.
#[derive(Debug)]
pub struct Decoder {
    journal: Arc<str>,
    framing: Framing,
    /// The bytes being decoded: a slice of what was pushed, or a frame cut
    /// by a push's end being joined with its rest.
    buf: Bytes,
    /// Bytes pushed after `buf`, not yet joined to it.
    pending: Bytes,
    /// Journal offset of `buf[0]`.
    offset: u64,
    skipped_bytes: u64,
    /// Bytes already searched for a newline (JSON lines), so a long line
    /// arriving in pieces is not rescanned from its start.
    scanned: usize,
}

impl Decoder {
    /// A decoder of `journal`'s bytes from `offset` on, which must be a
    /// message boundary.
    pub fn new(journal: Arc<str>, framing: Framing, offset: u64) -> Decoder {
        Decoder {
            journal,
            framing,
            buf: Bytes::new(),
            pending: Bytes::new(),
            offset,
            skipped_bytes: 0,
            scanned: 0,
        }
    }

    pub fn journal(&self) -> Arc<str> {
        self.journal.clone()
    }

    /// The offset of the next message not yet yielded (where a read
    /// restarts after a failure).
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Bytes skipped as damaged so far.
    pub fn skipped_bytes(&self) -> u64 {
        self.skipped_bytes
    }

    /// Bytes received but not yet yielded as a whole message.
    pub fn buffered(&self) -> usize {
        self.buf.len() + self.pending.len()
    }

    /// Takes bytes read at `offset` (a copy of them: see
    /// [`Decoder::push_bytes`]).
    pub fn push(&mut self, offset: u64, content: &[u8]) {
        self.push_bytes(offset, Bytes::copy_from_slice(content));
    }

    /// Takes bytes read at `offset`; the messages decoded are slices of
    /// them. Bytes must arrive in order; a read that restarted elsewhere
    /// restarts the decoder there.
    pub fn push_bytes(&mut self, offset: u64, content: Bytes) {
        let expected = self.offset + self.buffered() as u64;
        if offset != expected {
            self.buf.clear();
            self.pending.clear();
            self.scanned = 0;
            self.offset = offset;
        }
        if self.pending.is_empty() {
            self.pending = content;
        } else {
            self.pending = join(std::mem::take(&mut self.pending), &content);
        }
    }

    /// Moves pushed bytes into `buf` once it can decode nothing more: all
    /// of them if it is empty (no copy), else as many as complete the
    /// frame it begins with, joined to it. False if there are none.
    fn refill(&mut self) -> bool {
        if self.pending.is_empty() {
            return false;
        }
        if self.buf.is_empty() {
            self.buf = std::mem::take(&mut self.pending);
            return true;
        }
        let n = self.to_complete().min(self.pending.len());
        self.buf = join(std::mem::take(&mut self.buf), &self.pending[..n]);
        self.pending.advance(n);
        true
    }

    /// Bytes to add to `buf` that may complete the frame it begins with
    /// (a whole frame's, or its header's, or up to the next newline).
    fn to_complete(&self) -> usize {
        match &self.framing {
            Framing::JsonLines { .. } => memchr(b'\n', &self.pending).map_or(usize::MAX, |i| i + 1),
            // Damage before a header: join it all, and skip to the next
            // magic word in one scan.
            Framing::Fixed if !FIXED_MAGIC.starts_with(&self.buf[..self.buf.len().min(4)]) => {
                usize::MAX
            }
            Framing::Fixed if self.buf.len() < FIXED_HEADER_LEN => {
                FIXED_HEADER_LEN - self.buf.len()
            }
            Framing::Fixed => {
                let len = u32::from_le_bytes(self.buf[4..8].try_into().expect("4 bytes")) as usize;
                (FIXED_HEADER_LEN + len.min(MESSAGE_LEN_MAX))
                    .saturating_sub(self.buf.len())
                    .max(1)
            }
        }
    }

    fn skip(&mut self, n: usize) {
        self.buf.advance(n);
        self.offset += n as u64;
        self.skipped_bytes += n as u64;
        self.scanned = 0;
    }

    fn take(&mut self, n: usize) -> (u64, Bytes) {
        let begin = self.offset;
        let frame = self.buf.split_to(n);
        self.offset += n as u64;
        self.scanned = 0;
        (begin, frame)
    }

    /// The next whole message, or `None` until more bytes arrive.
    pub fn next_envelope(&mut self) -> Option<Envelope> {
        loop {
            if let Some(env) = self.decode() {
                return Some(env);
            }
            if !self.refill() {
                return None;
            }
        }
    }

    /// The next whole message in `buf`.
    fn decode(&mut self) -> Option<Envelope> {
        match &self.framing {
            Framing::JsonLines { uuid_pointer } => {
                let pointer = uuid_pointer.clone();
                loop {
                    let Some(nl) = memchr(b'\n', &self.buf[self.scanned..]) else {
                        self.scanned = self.buf.len();
                        if self.buf.len() > MESSAGE_LEN_MAX {
                            let n = self.buf.len();
                            self.skip(n);
                        }
                        return None;
                    };
                    let n = self.scanned + nl + 1;
                    let (begin, line) = self.take(n);
                    let text = line.slice(..n - 1);
                    match decode_json_line(&text, &pointer) {
                        Some(uuid) => {
                            return Some(Envelope {
                                journal: self.journal.clone(),
                                begin,
                                end: begin + n as u64,
                                uuid,
                                message: text,
                            })
                        }
                        None => self.skipped_bytes += n as u64,
                    }
                }
            }
            Framing::Fixed => loop {
                if self.buf.len() < FIXED_HEADER_LEN {
                    return None;
                }
                if self.buf[..4] != FIXED_MAGIC {
                    self.skip_to_magic();
                    continue;
                }
                let len = u32::from_le_bytes(self.buf[4..8].try_into().expect("4 bytes")) as usize;
                if len > MESSAGE_LEN_MAX {
                    self.skip_to_magic();
                    continue;
                }
                let n = FIXED_HEADER_LEN + len;
                if self.buf.len() < n {
                    return None;
                }
                match decode_fixed_body(&self.buf[FIXED_HEADER_LEN..n]) {
                    Some((uuid, content)) => {
                        let (begin, frame) = self.take(n);
                        let message = frame.slice(
                            FIXED_HEADER_LEN + content.start..FIXED_HEADER_LEN + content.end,
                        );
                        return Some(Envelope {
                            journal: self.journal.clone(),
                            begin,
                            end: begin + n as u64,
                            uuid,
                            message,
                        });
                    }
                    // The length may be damaged too: resynchronize on the
                    // next magic word rather than trust it.
                    None => self.skip_to_magic(),
                }
            },
        }
    }

    /// Skips to the next magic word after the buffer's first byte, or, if
    /// there is none yet, all but the last 3 bytes (a magic word may be
    /// arriving in pieces).
    fn skip_to_magic(&mut self) {
        let found = self.buf[1..]
            .windows(4)
            .position(|w| w == FIXED_MAGIC)
            .map(|i| i + 1);
        let n = found.unwrap_or(self.buf.len().saturating_sub(3).max(1));
        self.skip(n);
    }
}

/// `a` then `b`: `a`'s buffer extended in place when nothing else holds
/// it (a long line arriving in many pieces is not copied again at each),
/// else a new one.
fn join(a: Bytes, b: &[u8]) -> Bytes {
    let mut joined = a.try_into_mut().unwrap_or_else(|a| {
        let mut m = BytesMut::with_capacity(a.len() + b.len());
        m.extend_from_slice(&a);
        m
    });
    joined.extend_from_slice(b);
    joined.freeze()
}

fn memchr(needle: u8, hay: &[u8]) -> Option<usize> {
    hay.iter().position(|&b| b == needle)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::uuid::{Clock, Flags, ProducerId};
    use proptest::prelude::*;

    fn uuid(clock: u64, flags: Flags) -> Uuid {
        Uuid::build(ProducerId([0x11, 2, 3, 4, 5, 6]), Clock(clock << 4), flags)
    }

    fn decode_all(framing: &Framing, bytes: &[u8], piece: usize) -> (Vec<Envelope>, u64) {
        let mut d = Decoder::new("a/journal".into(), framing.clone(), 100);
        let mut out = Vec::new();
        let mut at = 0;
        while at < bytes.len() {
            let end = (at + piece).min(bytes.len());
            d.push(100 + at as u64, &bytes[at..end]);
            at = end;
            while let Some(e) = d.next_envelope() {
                out.push(e);
            }
        }
        (out, d.skipped_bytes())
    }

    #[test]
    fn json_lines_set_and_read_the_uuid() {
        let f = Framing::json();
        let mut out = Vec::new();
        let u = uuid(7, Flags::CONTINUE_TXN);
        f.encode(u, br#"{"n":1,"_meta":{"other":true}}"#, &mut out)
            .unwrap();
        let line = std::str::from_utf8(&out).unwrap();
        assert!(line.ends_with('\n'));
        let doc: serde_json::Value = serde_json::from_str(line.trim_end()).unwrap();
        assert_eq!(doc["_meta"]["uuid"], u.to_string());
        assert_eq!(doc["_meta"]["other"], true);
        assert_eq!(doc["n"], 1);
        let (envs, skipped) = decode_all(&f, &out, 3);
        assert_eq!(skipped, 0);
        assert_eq!(envs.len(), 1);
        assert_eq!((envs[0].begin, envs[0].end), (100, 100 + out.len() as u64));
        assert_eq!(envs[0].uuid, u);
        assert_eq!(&envs[0].message[..], &out[..out.len() - 1]);

        for bad in [&b"[1]"[..], b"nope", b"1"] {
            assert!(f.encode(u, bad, &mut Vec::new()).is_err());
        }
        let custom = Framing::from_content_type("j", Some(CONTENT_TYPE_JSON_LINES), "/id").unwrap();
        let mut out = Vec::new();
        custom.encode(u, b"{}", &mut out).unwrap();
        assert_eq!(out, format!("{{\"id\":\"{u}\"}}\n").as_bytes());
        assert!(Framing::from_content_type("j", Some("text/plain"), "/id").is_err());
        assert!(Framing::from_content_type("j", None, "/id").is_err());
        assert!(Framing::from_content_type("j", Some(CONTENT_TYPE_JSON_LINES), "id").is_err());
    }

    #[test]
    fn fixed_frame_layout() {
        let u = uuid(9, Flags::OUTSIDE_TXN);
        let mut out = Vec::new();
        Framing::Fixed.encode(u, b"hello", &mut out).unwrap();
        let mut want = vec![0x66, 0x33, 0x93, 0x36, 25, 0, 0, 0, 0x0a, 16];
        want.extend_from_slice(&u.0);
        want.extend_from_slice(&[0x12, 5]);
        want.extend_from_slice(b"hello");
        assert_eq!(out, want);
        let mut ack = Vec::new();
        Framing::Fixed.encode_ack(u, &mut ack);
        assert_eq!(ack.len(), FIXED_HEADER_LEN + 18);
        let (envs, _) = decode_all(&Framing::Fixed, &ack, 1);
        assert_eq!((envs[0].uuid, envs[0].message.len()), (u, 0));
    }

    #[test]
    fn damaged_frames_are_skipped_and_counted() {
        for framing in [Framing::json(), Framing::Fixed] {
            let mut bytes = Vec::new();
            framing
                .encode(uuid(1, Flags::OUTSIDE_TXN), br#"{"a":1}"#, &mut bytes)
                .unwrap();
            let garbage: &[u8] = match framing {
                Framing::JsonLines { .. } => b"{\"broken\": \n",
                // A frame whose magic word is hit, then noise.
                Framing::Fixed => b"\x66\x33\x00\x36\x05\x00\x00\x00noise",
            };
            bytes.extend_from_slice(garbage);
            framing
                .encode(uuid(2, Flags::OUTSIDE_TXN), br#"{"b":2}"#, &mut bytes)
                .unwrap();
            for piece in [1, 5, bytes.len()] {
                let (envs, skipped) = decode_all(&framing, &bytes, piece);
                assert_eq!(envs.len(), 2, "{framing:?} piece {piece}");
                assert_eq!(skipped, garbage.len() as u64, "{framing:?} piece {piece}");
                assert_eq!(envs[0].uuid.clock(), Clock(1 << 4));
                assert_eq!(envs[1].uuid.clock(), Clock(2 << 4));
                assert_eq!(envs[1].end, 100 + bytes.len() as u64);
                assert_eq!(envs[1].begin, envs[0].end + garbage.len() as u64);
            }
        }
        // A JSON line without a UUID is damage too, as is a fixed body
        // whose UUID is not 16 bytes.
        let (envs, skipped) = decode_all(&Framing::json(), b"{\"x\":1}\n", 4);
        assert_eq!((envs.len(), skipped), (0, 8));
        let mut bad = FIXED_MAGIC.to_vec();
        bad.extend_from_slice(&[3, 0, 0, 0, 0x0a, 1, 0]);
        let mut good = Vec::new();
        Framing::Fixed
            .encode(uuid(3, Flags::ACK_TXN), b"z", &mut good)
            .unwrap();
        bad.extend_from_slice(&good);
        let (envs, skipped) = decode_all(&Framing::Fixed, &bad, 2);
        assert_eq!((envs.len(), skipped), (1, 11));
        assert_eq!(envs[0].uuid.flags(), Flags::ACK_TXN);
    }

    /// Decodes `bytes` pushed in pieces cut at `cuts` (sizes, taken in
    /// turn; with `true`, the messages are drained before the next push):
    /// the messages, the bytes skipped and the bytes still buffered.
    fn decode_pieces(
        framing: &Framing,
        bytes: &[u8],
        cuts: &[(usize, bool)],
    ) -> (Vec<Envelope>, u64, usize) {
        let mut d = Decoder::new("a/journal".into(), framing.clone(), 100);
        let mut out = Vec::new();
        let (mut at, mut cut) = (0, cuts.iter().cycle());
        while at < bytes.len() {
            let (len, drain) = *cut.next().expect("cuts cycle");
            let end = (at + len).min(bytes.len());
            d.push_bytes(100 + at as u64, Bytes::copy_from_slice(&bytes[at..end]));
            at = end;
            while drain || at == bytes.len() {
                match d.next_envelope() {
                    Some(e) => out.push(e),
                    None => break,
                }
            }
        }
        (out, d.skipped_bytes(), d.buffered())
    }

    proptest! {
        /// Bytes with damage anywhere, pushed in pieces of any sizes (with
        /// or without taking the messages between pushes), decode to what
        /// they decode to pushed at once: the same messages at the same
        /// offsets, and every other byte skipped or still held in both.
        /// (Which of the last bytes after damage are skipped and which are
        /// held, in case a frame is arriving in pieces, depends on where
        /// the pieces were cut.)
        #[test]
        fn pieces_decode_as_the_whole(
            msgs in proptest::collection::vec((any::<u64>(), proptest::collection::vec(any::<u8>(), 0..300)), 1..12),
            damage in proptest::collection::vec((any::<usize>(), proptest::collection::vec(any::<u8>(), 0..12)), 0..4),
            cuts in proptest::collection::vec((1usize..200, any::<bool>()), 1..40),
        ) {
            for framing in [Framing::json(), Framing::Fixed] {
                let mut bytes = Vec::new();
                for (clock, content) in &msgs {
                    let payload = match framing {
                        Framing::JsonLines { .. } => serde_json::to_vec(&serde_json::json!({ "c": hex::encode(content) })).unwrap(),
                        Framing::Fixed => content.clone(),
                    };
                    framing.encode(uuid(clock >> 5, Flags::OUTSIDE_TXN), &payload, &mut bytes).unwrap();
                }
                for (at, garbage) in &damage {
                    let at = at % (bytes.len() + 1);
                    bytes.splice(at..at, garbage.iter().copied());
                }
                let whole = decode_pieces(&framing, &bytes, &[(bytes.len(), true)]);
                let pieces = decode_pieces(&framing, &bytes, &cuts);
                prop_assert_eq!(&pieces.0, &whole.0);
                prop_assert_eq!(pieces.1 + pieces.2 as u64, whole.1 + whole.2 as u64);
            }
        }

        #[test]
        fn round_trip(
            msgs in proptest::collection::vec((any::<u64>(), 0u16..3, proptest::collection::vec(any::<u8>(), 0..300)), 1..20),
            piece in 1usize..64,
        ) {
            for framing in [Framing::json(), Framing::Fixed] {
                let mut bytes = Vec::new();
                let mut want = Vec::new();
                for (clock, flags, content) in &msgs {
                    let u = uuid(clock >> 5, Flags(*flags));
                    let payload = match framing {
                        Framing::JsonLines { .. } => serde_json::to_vec(&serde_json::json!({ "c": hex::encode(content) })).unwrap(),
                        Framing::Fixed => content.clone(),
                    };
                    framing.encode(u, &payload, &mut bytes).unwrap();
                    want.push((u, payload));
                }
                let (envs, skipped) = decode_all(&framing, &bytes, piece);
                prop_assert_eq!(skipped, 0);
                prop_assert_eq!(envs.len(), want.len());
                let mut at = 100;
                for (e, (u, payload)) in envs.iter().zip(&want) {
                    prop_assert_eq!(e.uuid, *u);
                    prop_assert_eq!(e.begin, at);
                    at = e.end;
                    if let Framing::Fixed = framing {
                        prop_assert_eq!(&e.message[..], &payload[..]);
                    } else {
                        let doc: serde_json::Value = serde_json::from_slice(&e.message).unwrap();
                        let orig: serde_json::Value = serde_json::from_slice(payload).unwrap();
                        prop_assert_eq!(&doc["c"], &orig["c"]);
                    }
                }
                prop_assert_eq!(at, 100 + bytes.len() as u64);
            }
        }
    }
}
