//! Keeps `docs/PROTOCOL.md` honest: its worked examples are encoded here with
//! `rotary_proto::wire` and compared byte for byte with the hex dumps printed
//! in the document, and its routing example with `shard_of`.

use rotary_proto::spec::{LabelSelector, LabelSet};
use rotary_proto::status::Status;
use rotary_proto::wire::{
    self, AppendReply, AppendRequest, Op, ReadDone, ReadRequest, BODY_LEN_MAX, HEADER_LEN, MAGIC,
};
use sha1::{Digest, Sha1};
use zerocopy::byteorder::little_endian::U64;
use zerocopy::IntoBytes;

const DOC: &str = include_str!("../../docs/PROTOCOL.md");

/// The bytes of the hex dump that follows `<!-- hex: NAME -->` in the doc.
/// Each dump line is `hex bytes separated by single spaces`, then two or
/// more spaces and a note.
fn doc_hex(name: &str) -> Vec<u8> {
    let marker = format!("<!-- hex: {name} -->");
    let at = DOC
        .find(&marker)
        .unwrap_or_else(|| panic!("{marker} missing from PROTOCOL.md"));
    let rest = &DOC[at + marker.len()..];
    let open = rest.find("```").expect("fenced block after marker");
    let body = &rest[open + 3..];
    let body = &body[body.find('\n').expect("fence line") + 1..];
    let close = body.find("```").expect("closing fence");
    let mut bytes = Vec::new();
    for line in body[..close].lines() {
        let hex_part = line.split("  ").next().unwrap_or("").trim();
        for token in hex_part.split(' ').filter(|t| !t.is_empty()) {
            assert_eq!(
                token.len(),
                2,
                "bad hex token {token:?} in {name}: {line:?}"
            );
            bytes.push(
                u8::from_str_radix(token, 16)
                    .unwrap_or_else(|_| panic!("bad hex {token:?} in {name}")),
            );
        }
    }
    bytes
}

const CONTENT: &[u8] = b"hello\n";

fn append_request() -> AppendRequest {
    AppendRequest {
        journal: "orders/part-000".into(),
        expect_offset: None,
        check_registers: LabelSelector::default(),
        union_registers: LabelSet::from_pairs([("owner", "w7")]).unwrap(),
        subtract_registers: LabelSet::new(),
        route_revision: 0,
    }
}

#[test]
fn append_frame_matches_the_doc() {
    let meta = append_request().encode();
    let mut frame = Vec::new();
    wire::encode_frame(&mut frame, Op::APPEND, 0, Status::OK, 1, &meta, CONTENT);
    assert_eq!(
        frame,
        doc_hex("append-request"),
        "APPEND example in PROTOCOL.md is stale"
    );

    let (decoded, used) = wire::decode_frame(&frame, BODY_LEN_MAX).unwrap().unwrap();
    assert_eq!(used, frame.len());
    assert_eq!(decoded.op, Op::APPEND);
    assert_eq!(decoded.payload, CONTENT);
    assert_eq!(
        AppendRequest::decode(decoded.meta).unwrap(),
        append_request()
    );
}

#[test]
fn append_reply_matches_the_doc() {
    let sha1: [u8; 20] = Sha1::digest(CONTENT).into();
    assert_eq!(
        hex::encode(sha1),
        "f572d396fae9206628714fb2ce00f72e94f2258f"
    );
    let reply = AppendReply {
        begin: 0x1000,
        end: 0x1006,
        write_head: 0x1006,
        sha1,
        registers: LabelSet::from_pairs([("owner", "w7")]).unwrap(),
        route_revision: 0,
    };
    let mut frame = Vec::new();
    wire::encode_frame(
        &mut frame,
        Op::APPEND_REPLY,
        0,
        Status::OK,
        1,
        &reply.encode(),
        &[],
    );
    assert_eq!(
        frame,
        doc_hex("append-reply"),
        "APPEND_REPLY example in PROTOCOL.md is stale"
    );

    let (decoded, _) = wire::decode_frame(&frame, BODY_LEN_MAX).unwrap().unwrap();
    assert_eq!(AppendReply::decode(decoded.meta).unwrap(), reply);
}

#[test]
fn read_frames_match_the_doc() {
    let req = ReadRequest {
        journal: "orders/part-000".into(),
        offset: Some(0x1000),
        end_offset: None,
        route_revision: 0,
    };
    let mut frame = Vec::new();
    wire::encode_frame(
        &mut frame,
        Op::READ,
        wire::flag::BLOCK,
        Status::OK,
        2,
        &req.encode(),
        &[],
    );
    assert_eq!(
        frame,
        doc_hex("read-request"),
        "READ example in PROTOCOL.md is stale"
    );

    let data = wire::ReadData {
        offset: U64::new(0x1000),
    };
    let mut frame = Vec::new();
    wire::encode_frame(
        &mut frame,
        Op::READ_DATA,
        0,
        Status::OK,
        2,
        data.as_bytes(),
        CONTENT,
    );
    assert_eq!(
        frame,
        doc_hex("read-data"),
        "READ_DATA example in PROTOCOL.md is stale"
    );

    let mut frame = Vec::new();
    wire::encode_frame(&mut frame, Op::CANCEL, 0, Status::OK, 2, &[], &[]);
    assert_eq!(
        frame,
        doc_hex("cancel"),
        "CANCEL example in PROTOCOL.md is stale"
    );

    let done = ReadDone {
        offset: U64::new(0x1006),
        write_head: U64::new(0x1006),
    };
    let mut frame = Vec::new();
    wire::encode_frame(
        &mut frame,
        Op::READ_DONE,
        0,
        Status::CANCELLED,
        2,
        done.as_bytes(),
        b"cancelled",
    );
    assert_eq!(
        frame,
        doc_hex("read-done"),
        "READ_DONE example in PROTOCOL.md is stale"
    );
}

#[test]
fn constants_match_the_doc() {
    assert_eq!(MAGIC.to_le_bytes(), *b"RT");
    assert_eq!(MAGIC, 0x5452);
    assert_eq!(HEADER_LEN, 24);
    assert_eq!(BODY_LEN_MAX, 16_842_751);
    assert_eq!(wire::PAYLOAD_LEN_MAX, 16_777_216);
    assert_eq!(wire::META_LEN_MAX, 65_535);
    for text in ["`0x5452`", "16 842 751", "16 777 216", "65 535"] {
        assert!(DOC.contains(text), "PROTOCOL.md lacks {text}");
    }
    // Every op and status is documented with its number.
    for &s in Status::ALL {
        let row = format!("| {} | `{}` |", s as u16, s.name());
        assert!(DOC.contains(&row), "PROTOCOL.md lacks status row {row:?}");
        let retry = if s.is_retryable() { "yes" } else { "no" };
        let line = DOC.lines().find(|l| l.starts_with(&row)).unwrap();
        assert!(
            line.trim_end().ends_with(&format!("| {retry} |")),
            "retryability of {} in {line:?}",
            s.name()
        );
    }
    for code in 0u8..=255 {
        if let Some(op) = Op::from_code(code) {
            let row = format!("| `0x{code:02X}` | `{op:?}` |");
            assert!(DOC.contains(&row), "PROTOCOL.md lacks op row {row:?}");
        }
    }
}

/// §9.5a's table of object names, §5.11's codec codes and §9.2's spec
/// names are `spec::CODEC_NAMES`, row for row.
#[test]
fn codecs_match_the_doc() {
    use rotary_proto::spec::CODEC_NAMES;
    let spec_row = DOC
        .lines()
        .find(|l| l.starts_with("| `fragment.compression_codec` |"))
        .expect("§9.2 row of compression_codec");
    let codes_row = DOC
        .lines()
        .find(|l| l.starts_with("| 44 | 1 | u8 | `codec` |"))
        .expect("§5.11 row of codec");
    for n in &CODEC_NAMES {
        let written = if n.extension.is_empty() {
            "no extension".to_string()
        } else {
            format!("`{}`", n.extension)
        };
        let aliases: Vec<String> = n.aliases.iter().map(|a| format!("`{a}`")).collect();
        let row = format!(
            "| `{}` (`{}`) | {written} | {} |",
            n.name,
            n.gazette,
            aliases.join(", ")
        );
        let row = row.replace("|  |", "| |");
        assert!(DOC.contains(&row), "PROTOCOL.md lacks codec row {row:?}");
        for name in [n.name, n.gazette] {
            assert!(
                spec_row.contains(&format!("`\"{name}\"`")),
                "§9.2 lacks {name}"
            );
        }
        let code = format!("{} {}", wire::codec_code(n.codec), n.name);
        assert!(
            codes_row.contains(&code),
            "§5.11 lacks {code:?}: {codes_row}"
        );
    }
}

#[test]
fn shard_routing_matches_the_doc() {
    assert_eq!(rotary_proto::shard_of("orders/part-000", 4), 1);
    assert_eq!(rotary_proto::shard_of("orders/part-000", 8), 5);
    assert_eq!(rotary_proto::shard_of("orders/part-001", 4), 2);
    assert_eq!(rotary_proto::shard_of("a/b/c", 4), 3);
    assert!(DOC.contains("0xff0a6c6c707f2b5d"));
}

#[test]
fn replication_frames_match_the_doc() {
    use rotary_proto::repl::{self, Ack, Record};
    let journal = "orders/part-000";
    let frame_of = |op: Op, payload: &[u8]| {
        let mut frame = Vec::new();
        wire::encode_frame(&mut frame, op, 0, Status::OK, 0, &[], payload);
        frame
    };
    let mut w = wire::MetaWriter::new();
    Record::Content {
        seq: 3,
        journal,
        offset: 0x1000,
        bytes: CONTENT,
    }
    .encode(&mut w);
    let content = frame_of(Op::REPLICATE, &w.into_payload());
    assert_eq!(
        content,
        doc_hex("replicate-content"),
        "REPLICATE content example in PROTOCOL.md is stale"
    );

    let sha1: [u8; 20] = Sha1::digest(CONTENT).into();
    let mut w = wire::MetaWriter::new();
    let commit = Record::Commit {
        seq: 3,
        journal,
        begin: 0x1000,
        end: 0x1006,
        fragment_sha1: sha1,
        registers: LabelSet::from_pairs([("owner", "w7")]).unwrap(),
    };
    commit.encode(&mut w);
    let frame = frame_of(Op::REPLICATE, &w.into_payload());
    assert_eq!(
        frame,
        doc_hex("replicate-commit"),
        "REPLICATE commit example in PROTOCOL.md is stale"
    );
    let (decoded, _) = wire::decode_frame(&frame, BODY_LEN_MAX).unwrap().unwrap();
    assert_eq!(repl::decode_records(decoded.payload).unwrap(), vec![commit]);

    let ack = Ack {
        seq: 3,
        status: Status::OK,
        body: Vec::new(),
    };
    let frame = frame_of(
        Op::REPLICATE_ACK,
        &repl::encode_acks(std::slice::from_ref(&ack)),
    );
    assert_eq!(
        frame,
        doc_hex("replicate-ack"),
        "REPLICATE_ACK example in PROTOCOL.md is stale"
    );
    let (decoded, _) = wire::decode_frame(&frame, BODY_LEN_MAX).unwrap().unwrap();
    assert_eq!(repl::decode_acks(decoded.payload).unwrap(), vec![ack]);

    // The SYNC reply of the example, as a replica serializes it.
    let reply = repl::SyncReply {
        head: 4096,
        route: vec!["b3".into(), "b2".into(), "b1".into()],
        registers: LabelSet::new(),
        message: String::new(),
        route_revision: 0,
    };
    let text = serde_json::to_string(&reply).unwrap();
    assert!(
        DOC.contains(&format!("body `{text}`")),
        "SyncReply example: {text}"
    );
}
