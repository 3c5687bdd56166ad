//! Feeds arbitrary bytes to the native wire decoder the way a shard's
//! connection reader does: decode a frame from the front of the buffer,
//! consume it, repeat; on an error, skip the frame only when its boundary can
//! be trusted, otherwise stop (the server closes the connection). Every
//! decoded frame's metadata goes through every message decoder.
//!
//! Beyond "never panics", it asserts what the decoder promises:
//! - a frame re-encoded from its decoded fields is the exact bytes consumed;
//! - every strict prefix of a frame asks for more bytes, never errors;
//! - a smaller body limit changes nothing but which frames are too large;
//! - a decoded message re-encodes to a message that decodes equal, and the
//!   fixed-layout ones (READ, READ_DATA, READ_DONE, names) to the same bytes.
//!
//! With the `canonical` feature it also requires byte-exact re-encoding of
//! APPEND and APPEND_REPLY metadata (sorted, duplicate-free label sets and
//! zero reserved bytes).

#![no_main]

use libfuzzer_sys::fuzz_target;
use rotary_proto::spec::{validate_journal_name, JournalSpec, LabelSelector};
use rotary_proto::status::Status;
use rotary_proto::wire::{
    self, AppendReply, AppendRequest, Frame, FrameHeader, Op, ReadData, ReadDone, ReadRequest,
    WireError, BODY_LEN_MAX, HEADER_LEN,
};
use zerocopy::{FromBytes, IntoBytes};

/// A body limit small enough that short inputs reach FRAME_TOO_LARGE.
const BODY_LEN_MAX_SMALL: u32 = 256;

fuzz_target!(|data: &[u8]| {
    consume(data);
});

/// Decodes frames from the front of `buf` until it needs more bytes or the
/// connection would be closed.
fn consume(mut buf: &[u8]) {
    loop {
        let result = wire::decode_frame(buf, BODY_LEN_MAX);
        check_limits_agree(buf, &result);
        match result {
            Ok(None) => {
                if let Ok((header, _)) = FrameHeader::read_from_prefix(buf) {
                    // A complete header that asks for more: the frame is longer
                    // than what is here.
                    let total = HEADER_LEN + header.body_len.get() as usize;
                    assert!(buf.len() < total, "Ok(None) for a complete frame");
                }
                return;
            }
            Ok(Some((frame, used))) => {
                check_frame(&buf[..used], &frame);
                check_messages(&frame);
                buf = &buf[used..];
            }
            Err(err) => {
                // The decoder never errors on a header it has not fully seen.
                assert!(buf.len() >= HEADER_LEN, "{err:?} on {} bytes", buf.len());
                let status = err.status();
                assert!(
                    status == Status::BAD_REQUEST || status == Status::FRAME_TOO_LARGE,
                    "{err:?} maps to {status:?}"
                );
                match err {
                    // The header's length is within limits: a server answers
                    // ERROR and skips the frame.
                    WireError::MetaTooLong { .. }
                    | WireError::UnknownFlags { .. }
                    | WireError::Reserved => {
                        let (header, _) = FrameHeader::read_from_prefix(buf)
                            .expect("an error implies a complete header");
                        let total = HEADER_LEN + header.body_len.get() as usize;
                        if buf.len() < total {
                            return;
                        }
                        buf = &buf[total..];
                    }
                    // The frame boundary cannot be trusted: the server closes.
                    WireError::BadMagic(_)
                    | WireError::FrameTooLarge { .. }
                    | WireError::UnknownOp(_) => return,
                    other => panic!("header decoding returned a metadata error: {other:?}"),
                }
            }
        }
    }
}

/// Decoding with a smaller body limit gives the same answer except where the
/// frame exceeds that limit.
fn check_limits_agree(buf: &[u8], big: &Result<Option<(Frame<'_>, usize)>, WireError>) {
    let small = wire::decode_frame(buf, BODY_LEN_MAX_SMALL);
    match &small {
        Err(WireError::FrameTooLarge { len, max }) => {
            assert_eq!(*max, BODY_LEN_MAX_SMALL);
            assert!(*len > BODY_LEN_MAX_SMALL);
            if *len <= BODY_LEN_MAX {
                assert!(
                    !matches!(big, Err(WireError::FrameTooLarge { .. })),
                    "{len} bytes too large for {BODY_LEN_MAX}: {big:?}"
                );
            }
        }
        other => assert_eq!(
            other, big,
            "limits {BODY_LEN_MAX_SMALL} and {BODY_LEN_MAX} disagree"
        ),
    }
}

/// Checks one decoded frame against the bytes it was decoded from.
fn check_frame(bytes: &[u8], frame: &Frame<'_>) {
    assert_eq!(
        bytes.len(),
        HEADER_LEN + frame.meta.len() + frame.payload.len()
    );
    assert_eq!(
        frame.flags & !frame.op.known_flags(),
        0,
        "unknown flags accepted"
    );
    assert_eq!(Op::from_code(frame.op as u8), Some(frame.op));
    assert_eq!(
        frame.meta,
        &bytes[HEADER_LEN..HEADER_LEN + frame.meta.len()]
    );
    assert_eq!(frame.payload, &bytes[HEADER_LEN + frame.meta.len()..]);

    // Every strict prefix asks for more bytes.
    for cut in [0, HEADER_LEN - 1, HEADER_LEN, bytes.len() - 1] {
        if cut < bytes.len() {
            assert_eq!(
                wire::decode_frame(&bytes[..cut], BODY_LEN_MAX),
                Ok(None),
                "prefix {cut}"
            );
        }
    }

    // Re-encoding the decoded fields gives the same bytes. A status code the
    // decoder passed through but `Status` does not know cannot be re-encoded.
    if let Some(status) = Status::from_code(frame.status) {
        let mut out = Vec::new();
        wire::encode_frame(
            &mut out,
            frame.op,
            frame.flags,
            status,
            frame.request_id,
            frame.meta,
            frame.payload,
        );
        assert_eq!(out, bytes, "re-encoded frame differs");
        let header = wire::frame_header(
            frame.op,
            frame.flags,
            status,
            frame.request_id,
            frame.meta.len(),
            frame.payload.len(),
        );
        assert_eq!(header.as_bytes(), &bytes[..HEADER_LEN]);
    }
}

/// Runs every message decoder over the frame's metadata (whatever its op: a
/// hostile peer chooses the op too), and the admin JSON parsers over its
/// payload.
fn check_messages(frame: &Frame<'_>) {
    let meta = frame.meta;

    if let Ok(req) = AppendRequest::decode(meta) {
        let again = req.encode();
        assert!(again.len() <= meta.len(), "APPEND meta grew on re-encoding");
        assert_eq!(AppendRequest::decode(&again).as_ref(), Ok(&req));
        if cfg!(feature = "canonical") {
            assert_eq!(again, meta, "APPEND meta is not canonical");
        }
        // What the engine does next with these fields.
        let _ = validate_journal_name(&req.journal);
        let _ = req.check_registers.matches(&req.union_registers);
        let _ = req.check_registers.to_text();
    }

    if let Ok(reply) = AppendReply::decode(meta) {
        let again = reply.encode();
        assert!(
            again.len() <= meta.len(),
            "APPEND_REPLY meta grew on re-encoding"
        );
        assert_eq!(AppendReply::decode(&again).as_ref(), Ok(&reply));
        if cfg!(feature = "canonical") {
            assert_eq!(again, meta, "APPEND_REPLY meta is not canonical");
        }
    }

    if let Ok(req) = ReadRequest::decode(meta) {
        assert!(req.offset.is_none_or(|o| o <= i64::MAX as u64));
        assert_ne!(req.end_offset, Some(0));
        assert_eq!(req.encode(), meta, "READ meta re-encodes differently");
    }

    if let Ok(name) = wire::decode_name(meta) {
        assert_eq!(
            wire::encode_name(name),
            meta,
            "name meta re-encodes differently"
        );
        let _ = validate_journal_name(name);
    }

    if let Ok(data) = wire::decode_fixed::<ReadData>(meta, "read data") {
        assert_eq!(meta.len(), 8);
        assert_eq!(data.as_bytes(), meta);
    }

    if let Ok(done) = wire::decode_fixed::<ReadDone>(meta, "read done") {
        assert_eq!(meta.len(), 16);
        assert_eq!(done.as_bytes(), meta);
    }

    match frame.op {
        Op::APPLY => {
            if let Ok(specs) = serde_json::from_slice::<Vec<JournalSpec>>(frame.payload) {
                for spec in &specs {
                    let _ = spec.validate();
                }
            }
        }
        Op::LIST => {
            if let Ok(serde_json::Value::Object(map)) =
                serde_json::from_slice::<serde_json::Value>(frame.payload)
            {
                if let Some(serde_json::Value::String(text)) = map.get("selector") {
                    if let Ok(selector) = LabelSelector::parse(text) {
                        // Text form round-trips through the parser.
                        let again = LabelSelector::parse(&selector.to_text());
                        assert_eq!(again.as_ref(), Ok(&selector), "selector {text:?}");
                    }
                }
            }
        }
        _ => {}
    }
}
