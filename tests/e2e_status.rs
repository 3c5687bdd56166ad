//! End-to-end: append preconditions, register sequences and every status a
//! client can provoke, plus malformed frames on raw sockets.
#![allow(clippy::disallowed_methods)] // Tests time real servers and processes.

mod common;

use common::*;
use rotary_net::spec::{JournalFlags, LabelSelector, LabelSet};
use rotary_net::wire::{self, flag, AppendRequest, Op, ReadRequest};
use rotary_net::Status;
use std::io::Write;

fn req(journal: &str) -> AppendRequest {
    AppendRequest {
        journal: journal.to_string(),
        ..Default::default()
    }
}

fn labels(text: &str) -> LabelSet {
    let mut set = LabelSet::new();
    for part in text.split(',').filter(|p| !p.is_empty()) {
        let (n, v) = part.split_once('=').unwrap_or((part, ""));
        set.add(n.into(), v.into()).unwrap();
    }
    set
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn preconditions_and_register_sequences() {
    let broker = Broker::start();
    let client = broker.client().await;
    let j = "e2e/status/registers";
    create_journal(&client, j, |_| {}).await;

    // Empty append without register changes: the head and registers.
    let r = client.append(&req(j), Vec::new()).await.unwrap();
    assert_eq!((r.begin, r.end, r.write_head), (0, 0, 0));
    assert!(r.registers.is_empty());

    // union on a committing append.
    let mut a = req(j);
    a.union_registers = labels("owner=w1");
    let r = client.append(&a, b"one".to_vec()).await.unwrap();
    assert_eq!((r.begin, r.end), (0, 3));
    assert_eq!(r.registers, labels("owner=w1"));

    // check + union.
    let mut a = req(j);
    a.check_registers = LabelSelector::parse("owner=w1").unwrap();
    a.union_registers = labels("epoch=1");
    let r = client.append(&a, b"two".to_vec()).await.unwrap();
    assert_eq!((r.begin, r.end), (3, 6));
    assert_eq!(r.registers, labels("epoch=1,owner=w1"));

    // A failing check: REGISTER_MISMATCH with the current registers.
    let mut a = req(j);
    a.check_registers = LabelSelector::parse("owner=w2").unwrap();
    a.union_registers = labels("stolen=yes");
    let err = client.append(&a, b"nope".to_vec()).await.unwrap_err();
    assert_eq!(err.status(), Some(Status::REGISTER_MISMATCH), "{err}");
    let reply = err
        .append_reply()
        .expect("REGISTER_MISMATCH carries the reply");
    assert_eq!(reply.registers, labels("epoch=1,owner=w1"));
    assert_eq!(reply.begin, reply.end);
    assert!(!err.is_retryable());

    // subtract removes a name whose values are exactly those given.
    let mut a = req(j);
    a.subtract_registers = labels("owner=w1");
    let r = client.append(&a, b"three".to_vec()).await.unwrap();
    assert_eq!((r.begin, r.end), (6, 11));
    assert_eq!(r.registers, labels("epoch=1"));

    // A check that a name is absent, then a new owner.
    let mut a = req(j);
    a.check_registers = LabelSelector::parse("!owner").unwrap();
    a.union_registers = labels("owner=w2");
    let r = client.append(&a, b"four".to_vec()).await.unwrap();
    assert_eq!(r.registers, labels("epoch=1,owner=w2"));

    // subtract one exact value.
    let mut a = req(j);
    a.check_registers = LabelSelector::parse("epoch=1,owner=w2").unwrap();
    a.subtract_registers = labels("epoch=1");
    let r = client.append(&a, b"five".to_vec()).await.unwrap();
    assert_eq!((r.begin, r.end), (15, 19));
    assert_eq!(r.registers, labels("owner=w2"));

    // An empty append with register changes is BAD_REQUEST; nothing changes.
    for (u, s) in [("x=1", ""), ("", "owner")] {
        let mut a = req(j);
        a.union_registers = labels(u);
        a.subtract_registers = labels(s);
        assert_eq!(
            status_of(client.append(&a, Vec::new()).await),
            Status::BAD_REQUEST
        );
    }
    let r = client.append(&req(j), Vec::new()).await.unwrap();
    assert_eq!((r.begin, r.end, r.write_head), (19, 19, 19));
    assert_eq!(r.registers, labels("owner=w2"));

    // WRONG_APPEND_OFFSET carries the current write head.
    let mut a = req(j);
    a.expect_offset = Some(25);
    let err = client.append(&a, b"late".to_vec()).await.unwrap_err();
    assert_eq!(err.status(), Some(Status::WRONG_APPEND_OFFSET), "{err}");
    assert_eq!(err.append_reply().expect("reply").write_head, 19);
    a.expect_offset = Some(3);
    let err = client.append(&a, b"early".to_vec()).await.unwrap_err();
    assert_eq!(err.status(), Some(Status::WRONG_APPEND_OFFSET));
    assert_eq!(err.append_reply().unwrap().write_head, 19);
    // The right offset commits; a large chunked append refused early too.
    a.expect_offset = Some(19);
    let r = client.append(&a, b"six".to_vec()).await.unwrap();
    assert_eq!((r.begin, r.end), (19, 22));
    let big = vec![0x5a; 3 * rotary_net::client::APPEND_CHUNK_LEN];
    let err = client.append(&a, big).await.unwrap_err();
    assert_eq!(err.status(), Some(Status::WRONG_APPEND_OFFSET));
    assert_eq!(err.append_reply().unwrap().write_head, 22);
    let mut a = req(j);
    a.check_registers = LabelSelector::parse("owner=w9").unwrap();
    let err = client
        .append_stream(&a, &vec![1u8; 3 << 20][..])
        .await
        .unwrap_err();
    assert_eq!(err.status(), Some(Status::REGISTER_MISMATCH));

    // Nothing refused is visible, and the connection still works.
    assert_eq!(
        read_all(&client, j).await,
        b"onetwothreefourfivesix".to_vec()
    );
    let r = client.append(&req(j), b"!".to_vec()).await.unwrap();
    assert_eq!((r.begin, r.end), (22, 23));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn request_statuses() {
    let broker = Broker::start();
    let client = broker.client().await;
    let ro = "e2e/status/read-only";
    let wo = "e2e/status/write-only";
    let rw = "e2e/status/read-write";
    create_journal(&client, ro, |s| s.flags = JournalFlags::ReadOnly).await;
    create_journal(&client, wo, |s| s.flags = JournalFlags::WriteOnly).await;
    create_journal(&client, rw, |_| {}).await;

    // Bad names.
    for bad in ["a//b/c", "has space/x", "/abs/path", "abc"] {
        assert_eq!(
            status_of(client.route(bad).await),
            Status::BAD_REQUEST,
            "{bad}"
        );
        assert_eq!(
            status_of(client.append(&req(bad), b"x".to_vec()).await),
            Status::BAD_REQUEST,
            "{bad}"
        );
        let r = ReadRequest {
            journal: bad.into(),
            offset: Some(0),
            end_offset: None,
            route_revision: 0,
        };
        assert_eq!(
            read_status(&client, &r, false).await.0,
            Status::BAD_REQUEST,
            "{bad}"
        );
    }

    // Unknown journal.
    let missing = "e2e/status/missing";
    assert_eq!(
        status_of(client.append(&req(missing), b"x".to_vec()).await),
        Status::JOURNAL_NOT_FOUND
    );
    let r = ReadRequest {
        journal: missing.into(),
        offset: Some(0),
        end_offset: None,
        route_revision: 0,
    };
    assert_eq!(
        read_status(&client, &r, false).await.0,
        Status::JOURNAL_NOT_FOUND
    );
    assert_eq!(
        read_status(&client, &r, true).await.0,
        Status::JOURNAL_NOT_FOUND
    );
    assert_eq!(
        status_of(client.fragments(missing).await),
        Status::JOURNAL_NOT_FOUND
    );
    assert_eq!(
        status_of(client.delete(missing).await),
        Status::JOURNAL_NOT_FOUND
    );
    assert_eq!(
        status_of(client.seal(missing).await),
        Status::JOURNAL_NOT_FOUND
    );

    // Read-only refuses appends (a zero-byte one too, as documented);
    // write-only refuses reads.
    assert_eq!(
        status_of(client.append(&req(ro), b"x".to_vec()).await),
        Status::NOT_ALLOWED
    );
    assert_eq!(
        status_of(client.append(&req(ro), Vec::new()).await),
        Status::NOT_ALLOWED
    );
    let r = client
        .append(&req(wo), b"write-only bytes".to_vec())
        .await
        .unwrap();
    assert_eq!((r.begin, r.end), (0, 16));
    let rd = |j: &str, offset: Option<u64>| ReadRequest {
        journal: j.into(),
        offset,
        end_offset: None,
        route_revision: 0,
    };
    assert_eq!(
        read_status(&client, &rd(wo, Some(0)), false).await.0,
        Status::NOT_ALLOWED
    );
    assert_eq!(
        read_status(&client, &rd(wo, Some(0)), true).await.0,
        Status::NOT_ALLOWED
    );

    // Non-blocking reads at and past the head.
    client
        .append(&req(rw), b"0123456789".to_vec())
        .await
        .unwrap();
    for offset in [Some(10), Some(11), None] {
        let (status, done) = read_status(&client, &rd(rw, offset), false).await;
        assert_eq!(status, Status::OFFSET_NOT_YET_AVAILABLE, "{offset:?}");
        assert_eq!(done.expect("READ_DONE").write_head, 10);
    }
    // An empty read-only journal has nothing to read either.
    assert_eq!(
        read_status(&client, &rd(ro, Some(0)), false).await.0,
        Status::OFFSET_NOT_YET_AVAILABLE
    );
    // offset >= end_offset: READ_DONE OK at once.
    let (bytes, done) = read_range(&client, rw, 5, Some(5)).await.unwrap();
    assert!(bytes.is_empty());
    assert_eq!(done.status, Status::OK);
    // An end offset of 0 would mean "no end" on the wire: the client
    // refuses it rather than read the whole journal.
    let err = read_range(&client, rw, 0, Some(0)).await.unwrap_err();
    assert!(
        matches!(err, rotary_net::client::ClientError::Offset(_)),
        "{err}"
    );

    // Bad specs.
    let mut spec = rotary_net::spec::JournalSpec::new("e2e/status/bad-spec");
    spec.fragment.length = 1;
    assert_eq!(status_of(client.apply(&[spec]).await), Status::BAD_REQUEST);
    // A name part too long to be a directory name.
    let long = rotary_net::spec::JournalSpec::new(format!("e2e/{}", "b".repeat(256)));
    assert_eq!(status_of(client.apply(&[long]).await), Status::BAD_REQUEST);
    // Store URLs the uploader could not use, refused in full at apply.
    for store in [
        "s3://",
        "s3:///prefix/",
        "s3://Bad_Bucket!/p/",
        "s3://bucket/p/?endpoint=notaurl",
        "s3://bucket/p/?bogus=1",
        "file://relative/dir/",
    ] {
        let mut spec = rotary_net::spec::JournalSpec::new("e2e/status/bad-store");
        spec.fragment.stores = vec![store.to_string()];
        let res = client.apply(&[spec]).await;
        assert_eq!(status_of(res), Status::BAD_REQUEST, "{store}");
    }
    // A file store whose path runs through a regular file.
    let file = tempfile::NamedTempFile::new().unwrap();
    for store in [
        format!("file://{}/", file.path().display()),
        format!("file://{}/below/", file.path().display()),
    ] {
        let mut spec = rotary_net::spec::JournalSpec::new("e2e/status/bad-store");
        spec.fragment.stores = vec![store.clone()];
        let res = client.apply(&[spec]).await;
        assert_eq!(status_of(res), Status::BAD_REQUEST, "{store}");
    }
    // One journal named twice in one apply: neither entry is guessed at.
    let mut ro = rotary_net::spec::JournalSpec::new("e2e/status/twice");
    ro.flags = rotary_net::spec::JournalFlags::ReadOnly;
    let rw = rotary_net::spec::JournalSpec::new("e2e/status/twice");
    assert_eq!(
        status_of(client.apply(&[ro, rw]).await),
        Status::BAD_REQUEST
    );
    assert_eq!(client.list("").await.unwrap().len(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_frames() {
    let broker = Broker::start();
    let client = broker.client().await;
    let j = "e2e/status/frames";
    create_journal(&client, j, |_| {}).await;
    client.append(&req(j), b"before".to_vec()).await.unwrap();
    let endpoint = broker.endpoint();

    // Oversized: FRAME_TOO_LARGE (request id echoed), then the close.
    let mut s = raw_connect(&endpoint);
    let mut header = frame(Op::APPEND, 0, 77, &[], &[]);
    header[..4].copy_from_slice(&(wire::BODY_LEN_MAX + 1).to_le_bytes());
    s.write_all(&header).unwrap();
    let f = read_raw_frame(&mut s).unwrap().expect("an ERROR frame");
    assert_eq!(
        (f.op, f.status, f.request_id),
        (Op::ERROR, Status::FRAME_TOO_LARGE as u16, 77)
    );
    assert!(!f.payload.is_empty(), "ERROR carries a message");
    assert!(
        read_raw_frame(&mut s).unwrap().is_none(),
        "connection closed after FRAME_TOO_LARGE"
    );

    // Garbage: an ERROR frame (BAD_REQUEST) or nothing, then the close.
    let mut s = raw_connect(&endpoint);
    let garbage: Vec<u8> = (0..64u32).map(|i| (i * 37 + 11) as u8).collect();
    s.write_all(&garbage).unwrap();
    while let Some(f) = read_raw_frame(&mut s).unwrap() {
        assert_eq!(
            (f.op, f.status),
            (Op::ERROR, Status::BAD_REQUEST as u16),
            "{f:?}"
        );
    }

    // Unknown op with good magic: ERROR BAD_REQUEST, then the close.
    let mut s = raw_connect(&endpoint);
    let mut bad = frame(Op::PING, 0, 5, &[], &[]);
    bad[6] = 0x7e;
    s.write_all(&bad).unwrap();
    let f = read_raw_frame(&mut s).unwrap().expect("an ERROR frame");
    assert_eq!(
        (f.op, f.status, f.request_id),
        (Op::ERROR, Status::BAD_REQUEST as u16, 5)
    );
    assert!(read_raw_frame(&mut s).unwrap().is_none());

    // Undecodable metadata in a well-framed request: BAD_REQUEST for that
    // request, and the connection goes on serving.
    let mut s = raw_connect(&broker.shard_endpoint(0));
    s.write_all(&frame(Op::APPEND, 0, 9, &[1, 2, 3], b"payload"))
        .unwrap();
    s.write_all(&frame(Op::READ, flag::BLOCK, 10, &[0xff; 5], &[]))
        .unwrap();
    s.write_all(&frame(Op::PING, 0, 11, &[], b"still here"))
        .unwrap();
    let mut seen = Vec::new();
    for _ in 0..3 {
        let f = read_raw_frame(&mut s).unwrap().expect("a reply");
        seen.push(f.request_id);
        match f.request_id {
            9 | 10 => assert_eq!(f.status, Status::BAD_REQUEST as u16, "{f:?}"),
            11 => assert_eq!((f.op, &f.payload[..]), (Op::PONG, &b"still here"[..])),
            other => panic!("reply for unknown request {other}"),
        }
    }
    seen.sort();
    assert_eq!(seen, vec![9, 10, 11]);

    // Headers whose length is trustworthy but whose flags, reserved field
    // or meta_len are bad: an ERROR for that request id, frame skipped,
    // connection kept. A stray APPEND_CHUNK: BAD_REQUEST in APPEND_REPLY.
    let mut bad_flags = frame(Op::PING, 0, 12, &[], b"p");
    bad_flags[7] = 0x80;
    let mut bad_reserved = frame(Op::PING, 0, 13, &[], b"p");
    bad_reserved[20] = 1;
    let mut bad_meta_len = frame(Op::PING, 0, 14, &[], b"p");
    bad_meta_len[10..12].copy_from_slice(&100u16.to_le_bytes());
    for f in [bad_flags, bad_reserved, bad_meta_len] {
        s.write_all(&f).unwrap();
    }
    s.write_all(&frame(Op::APPEND_CHUNK, 0, 15, &[], b"stray"))
        .unwrap();
    s.write_all(&frame(Op::PING, 0, 16, &[], b"kept")).unwrap();
    for id in 12..=14 {
        let f = read_raw_frame(&mut s).unwrap().expect("an ERROR frame");
        assert_eq!(
            (f.op, f.status, f.request_id),
            (Op::ERROR, Status::BAD_REQUEST as u16, id),
            "{f:?}"
        );
    }
    let f = read_raw_frame(&mut s).unwrap().expect("a reply");
    assert_eq!(
        (f.op, f.status, f.request_id),
        (Op::APPEND_REPLY, Status::BAD_REQUEST as u16, 15),
        "{f:?}"
    );
    let f = read_raw_frame(&mut s).unwrap().expect("PONG");
    assert_eq!(
        (f.op, f.request_id, &f.payload[..]),
        (Op::PONG, 16, &b"kept"[..])
    );

    // The broker keeps serving everyone else; nothing was appended.
    let fresh = broker.client().await;
    fresh.ping().await.unwrap();
    assert_eq!(read_all(&fresh, j).await, b"before".to_vec());
    let r = client.append(&req(j), b"after".to_vec()).await.unwrap();
    assert_eq!((r.begin, r.end), (6, 11));
}

/// One admin request on a raw connection; the reply's status and JSON body.
fn admin(endpoint: &str, op: Op, flags: u8, meta: &[u8], payload: &[u8]) -> (u16, String) {
    let mut s = raw_connect(endpoint);
    s.write_all(&frame(op, flags, 9, meta, payload)).unwrap();
    let f = read_raw_frame(&mut s).unwrap().expect("a reply");
    (f.status, String::from_utf8_lossy(&f.payload).into_owned())
}

/// LIST answers in pages, by name after a cursor, without the journals
/// deleted; a bad page request is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn journal_lists_come_in_pages() {
    let broker = Broker::start();
    let client = broker.client().await;
    let endpoint = broker.endpoint();
    for i in 0..7 {
        let name = format!("e2e/pages/j-{i}");
        create_journal(&client, &name, |s| s.labels = labels("app=pages")).await;
    }
    create_journal(&client, "e2e/pages/j-8", |s| s.labels = labels("app=other")).await;
    client.delete("e2e/pages/j-3").await.unwrap();

    // Names of a page, and its flags.
    let page = |body: serde_json::Value| -> (Vec<String>, u8) {
        let mut s = raw_connect(&endpoint);
        s.write_all(&frame(Op::LIST, 0, 9, &[], body.to_string().as_bytes()))
            .unwrap();
        let f = read_raw_frame(&mut s).unwrap().expect("a reply");
        let text = String::from_utf8_lossy(&f.payload).into_owned();
        assert_eq!(f.status, Status::OK as u16, "{body}: {text}");
        let entries: Vec<serde_json::Value> = serde_json::from_str(&text).unwrap();
        let names = entries
            .iter()
            .map(|e| e["spec"]["name"].as_str().unwrap().to_string())
            .collect();
        (names, f.flags)
    };
    let names = |ns: &[&str]| ns.iter().map(|n| n.to_string()).collect::<Vec<_>>();
    let sel = "app=pages";
    assert_eq!(
        page(serde_json::json!({"selector": sel, "limit": 3})),
        (
            names(&["e2e/pages/j-0", "e2e/pages/j-1", "e2e/pages/j-2"]),
            flag::NEXT_PAGE
        )
    );
    // The last page is full, and says nothing follows.
    assert_eq!(
        page(serde_json::json!({"selector": sel, "limit": 3, "after": "e2e/pages/j-2"})),
        (
            names(&["e2e/pages/j-4", "e2e/pages/j-5", "e2e/pages/j-6"]),
            0
        )
    );
    // The cursor need not be a journal's name.
    assert_eq!(
        page(serde_json::json!({"after": "e2e/pages/j-55"})),
        (names(&["e2e/pages/j-6", "e2e/pages/j-8"]), 0)
    );
    assert_eq!(page(serde_json::json!({"after": "zzzz"})), (vec![], 0));
    // Without a limit, a page holds up to LIST_PAGE_MAX.
    assert_eq!(page(serde_json::json!({})).0.len(), 7);
    assert_eq!(client.list(sel).await.unwrap().len(), 6);

    let max = wire::LIST_PAGE_MAX;
    for (op, body) in [
        (Op::LIST, serde_json::json!({"limit": 0})),
        (Op::LIST, serde_json::json!({"limit": max + 1})),
        (Op::LIST, serde_json::json!({"limit": "ten"})),
        (Op::LIST, serde_json::json!({"after": 7})),
        (Op::LIST, serde_json::json!({"deleted": true})),
        (Op::PRUNE, serde_json::json!({"after": "e2e/pages/j-2"})),
        (Op::PRUNE, serde_json::json!({"limit": 3})),
    ] {
        let (status, text) = admin(&endpoint, op, 0, &[], body.to_string().as_bytes());
        assert_eq!(status, Status::BAD_REQUEST as u16, "{op:?} {body}: {text}");
    }
    // The broker goes on serving.
    assert_eq!(page(serde_json::json!({"limit": max})).0.len(), 7);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spec_revisions_order_changes_and_deletions() {
    let mut broker = Broker::start();
    broker.client().await;
    let endpoint = broker.endpoint();
    let ok = Status::OK as u16;
    let name = "e2e/status/revised";
    let spec = |app: &str| serde_json::json!({"name": name, "labels": {"app": app}, "fragment": {"compression_codec": "none"}});
    let listed = |endpoint: &str| -> serde_json::Value {
        let (status, body) = admin(endpoint, Op::LIST, 0, &[], b"{}");
        assert_eq!(status, Status::OK as u16, "{body}");
        serde_json::from_str(&body).unwrap()
    };

    // A client's APPLY gets a revision.
    let (status, body) = admin(
        &endpoint,
        Op::APPLY,
        0,
        &[],
        spec("v1").to_string().as_bytes(),
    );
    assert_eq!(
        status,
        Status::BAD_REQUEST as u16,
        "a bare object is not a list: {body}"
    );
    assert!(
        body.contains("must be a JSON array of journal specs"),
        "{body}"
    );
    let (status, body) = admin(&endpoint, Op::APPLY, 0, &[], b"{not json");
    assert_eq!(status, Status::BAD_REQUEST as u16, "{body}");
    assert!(
        body.contains("must be a JSON array of journal specs"),
        "{body}"
    );
    let payload = serde_json::json!([spec("v1")]).to_string();
    let (status, body) = admin(&endpoint, Op::APPLY, 0, &[], payload.as_bytes());
    assert_eq!(status, ok, "{body}");
    let r1 = serde_json::from_str::<serde_json::Value>(&body).unwrap()["revision"]
        .as_u64()
        .expect("a revision");
    assert_eq!(listed(&endpoint)[0]["revision"], r1);

    // Each change takes the next revision.
    let payload2 = serde_json::json!([spec("v2")]).to_string();
    let (status, body) = admin(&endpoint, Op::APPLY, 0, &[], payload2.as_bytes());
    assert_eq!(status, ok, "{body}");
    let r2 = listed(&endpoint)[0]["revision"].as_u64().unwrap();
    assert_eq!(r2, r1 + 1);
    // Brokers no longer forward changes to each other: the flag that
    // marked a forwarded change, and LIST's deletions, are unknown.
    let mut with_flag = frame(Op::APPLY, 0, 9, &[], payload.as_bytes());
    with_flag[7] = 1;
    let mut conn = raw_connect(&endpoint);
    conn.write_all(&with_flag).unwrap();
    let f = read_raw_frame(&mut conn).unwrap().expect("a reply");
    assert_eq!(f.status, Status::BAD_REQUEST as u16, "{f:?}");
    let body = serde_json::json!({ "selector": "", "deleted": true }).to_string();
    let (status, text) = admin(&endpoint, Op::LIST, 0, &[], body.as_bytes());
    assert_eq!(status, Status::BAD_REQUEST as u16, "{text}");
    assert_eq!(listed(&endpoint)[0]["revision"], r2);

    // DELETE takes no payload; then it removes the journal, and nothing
    // of it is listed.
    let meta = wire::encode_name(name);
    let with_payload = serde_json::json!({ "revision": r2 + 5 }).to_string();
    let (status, body) = admin(&endpoint, Op::DELETE, 0, &meta, with_payload.as_bytes());
    assert_eq!(status, Status::BAD_REQUEST as u16, "{body}");
    assert_eq!(listed(&endpoint).as_array().unwrap().len(), 1);
    let (status, body) = admin(&endpoint, Op::DELETE, 0, &meta, &[]);
    assert_eq!(status, ok, "{body}");
    assert_eq!(listed(&endpoint), serde_json::json!([]));
    let (status, body) = admin(&endpoint, Op::DELETE, 0, &meta, &[]);
    assert_eq!(status, Status::JOURNAL_NOT_FOUND as u16, "{body}");

    // After a restart the journal is still gone, and creating it again
    // takes a revision after the deletion's (r2 + 1): never one issued
    // before.
    broker.restart();
    broker.client().await;
    let endpoint = broker.endpoint();
    assert_eq!(listed(&endpoint), serde_json::json!([]));
    let (status, body) = admin(&endpoint, Op::APPLY, 0, &[], payload.as_bytes());
    assert_eq!(status, ok, "{body}");
    let l = listed(&endpoint);
    assert_eq!(l.as_array().unwrap().len(), 1, "{l}");
    assert_eq!(l[0]["revision"].as_u64().unwrap(), r2 + 2);
}

/// A LIST page ends before its reply outgrows a frame's payload, however
/// many labels its specs carry, and the pages together list every journal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_pages_fit_in_a_frame() {
    let broker = Broker::start();
    let client = broker.client().await;
    // About 1 MiB of labels each: 20 journals list as some 20 MiB.
    let value = "v".repeat(rotary_net::spec::LABEL_VALUE_LEN_MAX);
    for i in 0..20 {
        let pairs: Vec<(String, String)> = (0..1000)
            .map(|k| (format!("label-{k:04}"), value.clone()))
            .collect();
        let labels =
            LabelSet::from_pairs(pairs.iter().map(|(n, v)| (n.as_str(), v.as_str()))).unwrap();
        create_journal(&client, &format!("e2e/status/labelled-{i:02}"), |s| {
            s.labels = labels
        })
        .await;
    }
    let endpoint = broker.endpoint();
    let mut after = String::new();
    let mut listed = Vec::new();
    let mut pages = 0;
    loop {
        let body = serde_json::json!({ "after": after }).to_string();
        let mut s = raw_connect(&endpoint);
        s.write_all(&frame(Op::LIST, 0, 9, &[], body.as_bytes()))
            .unwrap();
        let f = tokio::task::block_in_place(|| read_raw_frame(&mut s))
            .unwrap()
            .expect("a reply");
        assert_eq!(f.status, Status::OK as u16);
        assert!(
            f.payload.len() <= wire::PAYLOAD_LEN_MAX,
            "a page of {} bytes",
            f.payload.len()
        );
        let entries: Vec<serde_json::Value> = serde_json::from_slice(&f.payload).unwrap();
        assert!(!entries.is_empty());
        for e in &entries {
            assert_eq!(e["spec"]["labels"].as_object().map(|l| l.len()), Some(1000));
            listed.push(e["spec"]["name"].as_str().unwrap().to_string());
        }
        pages += 1;
        if f.flags & flag::NEXT_PAGE == 0 {
            break;
        }
        after = listed.last().unwrap().clone();
    }
    let want: Vec<String> = (0..20)
        .map(|i| format!("e2e/status/labelled-{i:02}"))
        .collect();
    assert_eq!(listed, want);
    assert!(pages >= 2, "20 MiB of specs in {pages} page(s)");
    assert_eq!(client.list("").await.unwrap().len(), 20);
}

/// A revision beyond any store's (here u64::MAX) is refused where a
/// primary sends one, in a SYNC, and changes nothing: later changes of
/// specs still get revisions of their own, also after a restart. A SYNC to the journal's own primary, or for a journal
/// a broker neither holds nor is routed, is refused and changes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn revisions_no_store_could_make_and_stray_syncs_are_refused() {
    let mut broker = Broker::start();
    let client = broker.client().await;
    let endpoint = broker.endpoint();
    let name = "e2e/status/clock";
    create_journal(&client, name, |_| {}).await;
    let listed = |endpoint: &str| -> serde_json::Value {
        let (status, body) = admin(endpoint, Op::LIST, 0, &[], b"{}");
        assert_eq!(status, Status::OK as u16, "{body}");
        serde_json::from_str(&body).unwrap()
    };
    let before = listed(&endpoint);
    let huge = u64::MAX;
    let spec = serde_json::json!({"name": name, "flags": "read-only"});

    // SYNC goes to the journal's shard; its answer is an ack in a
    // REPLICATE_ACK frame.
    let sync = |journal: &str, spec: serde_json::Value, revision: u64| {
        let payload = serde_json::json!({
            "seq": 7, "journal": journal, "spec": spec, "revision": revision,
            "route": ["elsewhere", "local"], "head": 0, "registers": {},
        })
        .to_string();
        let shard = rotary_net::shard_of(journal, broker.cores as u32) as usize;
        let mut s = raw_connect(&broker.shard_endpoint(shard));
        s.write_all(&frame(Op::SYNC, 0, 1, &[], payload.as_bytes()))
            .unwrap();
        let f = read_raw_frame(&mut s).unwrap().expect("an answer");
        let acks = rotary_net::repl::decode_acks(&f.payload).expect("acks");
        assert_eq!(acks.len(), 1, "{f:?}");
        assert_eq!(acks[0].seq, 7);
        (
            acks[0].status,
            String::from_utf8_lossy(&acks[0].body).into_owned(),
        )
    };
    let (status, body) = sync(name, spec.clone(), huge);
    assert_eq!(status, Status::BAD_REQUEST, "{body}");
    // This lone broker is every journal's primary.
    let (status, body) = sync(name, spec.clone(), 5);
    assert_eq!(status, Status::WRONG_ROUTE, "{body}");
    let stray = "e2e/status/stray";
    let (status, body) = sync(stray, serde_json::json!({ "name": stray }), 5);
    assert_eq!(status, Status::WRONG_ROUTE, "{body}");
    assert_eq!(
        listed(&endpoint),
        before,
        "refused changes left the specs as they were"
    );

    // Changes go on, with revisions past the old ones.
    let revision_of = |l: &serde_json::Value| l[0]["revision"].as_u64().unwrap();
    let (status, body) = admin(
        &endpoint,
        Op::APPLY,
        0,
        &[],
        serde_json::json!([{"name": name, "labels": {"app": "after"}}])
            .to_string()
            .as_bytes(),
    );
    assert_eq!(status, Status::OK as u16, "{body}");
    let after = listed(&endpoint);
    assert!(revision_of(&after) > revision_of(&before), "{after}");
    broker.restart();
    let client = broker.client().await;
    client.delete(name).await.unwrap();
    assert_eq!(listed(&broker.endpoint()), serde_json::json!([]));
}

/// Open descriptors of a process.
fn open_fds(pid: u32) -> u64 {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count() as u64)
        .unwrap_or(0)
}

/// A broker out of file descriptors closes the connections it cannot
/// serve, so their clients see the close instead of waiting forever, and
/// serves again once descriptors are free.
#[test]
#[allow(unsafe_code)]
fn out_of_file_descriptors_closes_unserved_connections() {
    let broker = Broker::start_with_cores(1);
    let pid = broker.pid().expect("running");
    // One reading for both limits: the broker may open a descriptor
    // between two, and a soft limit above the hard one is EINVAL.
    let limit = open_fds(pid) + 16;
    let lim = libc::rlimit {
        rlim_cur: limit,
        rlim_max: limit,
    };
    // SAFETY: prlimit on our own child with a valid rlimit and no old value.
    let rc = unsafe {
        libc::prlimit(
            pid as libc::pid_t,
            libc::RLIMIT_NOFILE,
            &lim,
            std::ptr::null_mut(),
        )
    };
    assert_eq!(rc, 0, "prlimit: {}", std::io::Error::last_os_error());

    // More connections than descriptors: the last ones cannot be served.
    let held: Vec<std::net::TcpStream> = (0..40).map(|_| raw_connect(&broker.endpoint())).collect();
    let mut probe = raw_connect(&broker.endpoint());
    probe
        .write_all(&frame(Op::PING, 0, 7, &[], b"served?"))
        .unwrap();
    match read_raw_frame(&mut probe) {
        // Closed unserved: the client knows at once.
        Ok(None) => {}
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
        other => panic!("a connection past the descriptor limit got {other:?}"),
    }
    let warnings = broker.log().matches("out of file descriptors").count();
    assert!(
        (1..=2).contains(&warnings),
        "{warnings} warnings:\n{}",
        broker.log()
    );

    // Descriptors free again: served again.
    drop(held);
    drop(probe);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while !raw_ping(&broker.endpoint()) {
        assert!(
            std::time::Instant::now() < deadline,
            "not served after the connections closed"
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}

/// Anonymous resident memory of a process, in bytes.
fn rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = status.lines().find(|l| l.starts_with("RssAnon:")).unwrap();
    line.split_whitespace()
        .nth(1)
        .unwrap()
        .parse::<u64>()
        .unwrap()
        * 1024
}

/// A client that sends many small requests with large replies (LIST) and
/// never reads them stalls itself: the broker stops reading its requests
/// once some MiB of replies are queued, instead of queueing every reply.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_reads_replies_holds_bounded_memory() {
    let broker = Broker::start_with_cores(1);
    let pid = broker.pid().expect("running");
    let client = broker.client().await;
    for i in 0..24 {
        create_journal(&client, &format!("e2e/status/listed-{i:02}"), |s| {
            s.labels = LabelSet::from_pairs([("team", "x".repeat(200).as_str())]).unwrap();
        })
        .await;
    }
    let reply_len = serde_json::to_vec(&client.list("").await.unwrap())
        .unwrap()
        .len();
    assert!(reply_len > 8 << 10, "a LIST reply of {reply_len} bytes");
    let before = rss(pid);

    // 20,000 LISTs (about 480 KB of requests) from a client that never
    // reads: queued whole, their replies would take over 160 MB.
    let s = raw_connect(&broker.endpoint());
    s.set_write_timeout(Some(std::time::Duration::from_secs(3)))
        .unwrap();
    let mut reqs = Vec::new();
    for id in 1..=20_000u64 {
        reqs.extend_from_slice(&frame(Op::LIST, 0, id, &[], &[]));
    }
    let mut w = s.try_clone().unwrap();
    // May block once the broker stops reading; the timeout ends it.
    let writer = std::thread::spawn(move || w.write_all(&reqs).is_ok());
    tokio::time::sleep(std::time::Duration::from_secs(4)).await;
    writer.join().unwrap();
    let grown = rss(pid).saturating_sub(before);
    assert!(grown < 64 << 20, "broker memory grew by {grown} bytes");
    // Others are served.
    assert_eq!(client.list("").await.unwrap().len(), 24);
    drop(s);
}

/// A client that sends many reads and then stops reading its socket holds a
/// bounded share of the broker's memory, and appends to other journals go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_stops_reading_holds_bounded_memory() {
    let broker = Broker::start_with_cores(1);
    let pid = broker.pid().expect("running");
    let client = broker.client().await;
    let big = "e2e/status/stalled-reads";
    let other = "e2e/status/beside-stalled";
    create_journal(&client, big, |_| {}).await;
    create_journal(&client, other, |_| {}).await;
    // 64 MiB to read, in 1 MiB appends.
    let chunk = vec![7u8; 1 << 20];
    for _ in 0..64 {
        client.append(&req(big), chunk.clone()).await.unwrap();
    }
    let before = rss(pid);

    // 500 reads of the whole journal on one connection that never reads.
    let mut s = raw_connect(&broker.endpoint());
    let mut reqs = Vec::new();
    for id in 1..=500u64 {
        let meta = ReadRequest {
            journal: big.to_string(),
            offset: Some(0),
            end_offset: None,
            route_revision: 0,
        }
        .encode();
        reqs.extend_from_slice(&frame(Op::READ, 0, id, &meta, &[]));
    }
    s.write_all(&reqs).unwrap();
    tokio::time::sleep(std::time::Duration::from_secs(3)).await;
    let grown = rss(pid).saturating_sub(before);

    // Appends beside it still answer.
    let r = tokio::time::timeout(
        std::time::Duration::from_secs(5),
        client.append(&req(other), b"still here".to_vec()),
    )
    .await
    .expect("an append beside a stalled reader answers")
    .unwrap();
    assert_eq!((r.begin, r.end), (0, 10));
    // Unbounded, each read would hold at least a 1 MiB chunk: 500 MiB.
    assert!(grown < 64 << 20, "broker memory grew by {grown} bytes");
    drop(s);
}

/// A streamed append whose client trickles (or stalls) below the minimum
/// append rate (1 MiB/s) holds its journal for about a second: it is rolled
/// back with APPEND_TIMEOUT, saying why, and the append waiting behind it
/// commits. One streamed faster than the rate commits whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trickling_append_does_not_hold_a_journal() {
    let broker = Broker::start_with_cores(1);
    let client = broker.client().await;
    let j = "e2e/status/trickle";
    create_journal(&client, j, |_| {}).await;

    let endpoint = broker.endpoint();
    let meta = req(j).encode();
    let trickler = std::thread::spawn(move || {
        let mut s = raw_connect(&endpoint);
        s.set_read_timeout(Some(std::time::Duration::from_millis(200)))
            .unwrap();
        s.write_all(&frame(Op::APPEND, flag::MORE, 1, &meta, b"t"))
            .unwrap();
        // A byte every 200 ms: never idle, far under 1 MiB/s.
        for _ in 0..300 {
            match read_raw_frame(&mut s) {
                Ok(Some(f)) => return f,
                Ok(None) => panic!("closed without a reply"),
                Err(_) => {}
            }
            s.write_all(&frame(Op::APPEND_CHUNK, flag::MORE, 1, &[], b"t"))
                .unwrap();
        }
        panic!("the trickle was never cut off");
    });
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    let r = tokio::time::timeout(
        std::time::Duration::from_secs(60),
        client.append(&req(j), b"behind".to_vec()),
    )
    .await
    .expect("the append behind the trickle answers")
    .unwrap();
    // The trickle was rolled back: the waiting append is the journal's first.
    assert_eq!((r.begin, r.end), (0, 6));
    let reply = trickler.join().unwrap();
    assert_eq!(
        (reply.op, reply.status),
        (Op::APPEND_REPLY, Status::APPEND_TIMEOUT as u16),
        "{reply:?}"
    );
    let why = String::from_utf8_lossy(&reply.payload).to_string();
    assert!(why.contains("minimum append rate"), "{why}");

    // 4 MiB streamed in 64 KiB frames at about 4 MiB/s commits whole.
    let endpoint = broker.endpoint();
    let meta = req(j).encode();
    let fast = std::thread::spawn(move || {
        let mut s = raw_connect(&endpoint);
        let piece = vec![b'f'; 64 << 10];
        s.write_all(&frame(Op::APPEND, flag::MORE, 2, &meta, &piece))
            .unwrap();
        for i in 1..64 {
            std::thread::sleep(std::time::Duration::from_millis(15));
            let flags = if i == 63 { 0 } else { flag::MORE };
            s.write_all(&frame(Op::APPEND_CHUNK, flags, 2, &[], &piece))
                .unwrap();
        }
        read_raw_frame(&mut s).unwrap().expect("a reply")
    });
    let reply = fast.join().unwrap();
    assert_eq!(
        (reply.op, reply.status),
        (Op::APPEND_REPLY, Status::OK as u16),
        "{reply:?}"
    );
    let (bytes, _) = read_range(&client, j, 0, None).await.unwrap();
    assert_eq!(bytes.len(), 6 + (4 << 20));
    assert!(bytes[..6] == *b"behind" && bytes[6..].iter().all(|&b| b == b'f'));
}

/// Requests larger than the read buffer (128 KiB and up) are read into a
/// buffer of their own; every op finds its payload there, not only appends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn large_admin_requests_keep_their_payload() {
    const JOURNALS: usize = 1500;
    let broker = Broker::start_with_cores(2);
    let client = broker.client().await;
    let specs: Vec<rotary_net::spec::JournalSpec> = (0..JOURNALS)
        .map(|i| {
            let mut s =
                rotary_net::spec::JournalSpec::new(format!("e2e/status/large-apply/{i:04}"));
            s.labels = labels("batch=large");
            s
        })
        .collect();
    let payload = serde_json::to_vec(&specs).unwrap();
    assert!(payload.len() > 256 << 10, "{} bytes", payload.len());
    assert_eq!(client.apply(&specs).await.unwrap(), JOURNALS as u64);
    let listed = client.list("batch=large").await.unwrap();
    assert_eq!(listed.len(), JOURNALS);

    // A PING of 200 KiB comes back whole.
    let endpoint = broker.endpoint();
    let mut s = raw_connect(&endpoint);
    let body: Vec<u8> = (0..200u32 << 10).map(|i| (i % 251) as u8).collect();
    s.write_all(&frame(Op::PING, 0, 9, &[], &body)).unwrap();
    let f = read_raw_frame(&mut s).unwrap().expect("a PONG");
    assert_eq!((f.op, f.request_id), (Op::PONG, 9));
    assert!(f.payload == body, "PONG of {} bytes", f.payload.len());
}

/// Disk blocks (bytes) held by every spool file under `dir`.
fn spool_blocks(dir: &std::path::Path) -> (usize, u64) {
    use std::os::unix::fs::MetadataExt;
    let mut files = 0;
    let mut bytes = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let path = e.path();
            let meta = e.metadata().unwrap();
            if meta.is_dir() {
                stack.push(path);
            } else if path.extension().is_some_and(|x| x == "spool") {
                files += 1;
                bytes += meta.blocks() * 512;
            }
        }
    }
    (files, bytes)
}

/// A new spool takes a quarter of a MiB of disk, not a whole fallocate
/// step: a broker of thousands of quiet journals keeps its disk.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quiet_journals_hold_little_disk_each() {
    const JOURNALS: usize = 64;
    let broker = Broker::start_with_cores(2);
    let client = broker.client().await;
    for i in 0..JOURNALS {
        let j = format!("e2e/status/quiet-{i:02}");
        create_journal(&client, &j, |_| {}).await;
        let r = client.append(&req(&j), &b"a few bytes"[..]).await.unwrap();
        assert_eq!((r.begin, r.end), (0, 11));
    }
    // Each journal has an open spool; none holds a full fallocate step
    // (16 MiB) for its eleven bytes.
    let (files, bytes) = spool_blocks(&broker.data);
    assert_eq!(files, JOURNALS, "one open spool per journal");
    assert!(
        bytes <= (JOURNALS as u64) * (256 << 10),
        "{files} spools of 11 bytes hold {bytes} bytes of disk"
    );
}

/// Sealed fragments are opened per read: a journal of thousands of small
/// fragments does not hold a descriptor for each (which once exhausted the
/// broker's, failing every request of every journal).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_fragments_do_not_each_hold_a_descriptor() {
    const FRAGMENTS: usize = 1500;
    let broker = Broker::start_with_cores(1);
    let pid = broker.pid().expect("running");
    let client = broker.client().await;
    let j = "e2e/status/many-fragments";
    create_journal(&client, j, |s| s.fragment.length = 4096).await;
    let before = open_fds(pid);
    let mut written = Vec::new();
    for i in 0..FRAGMENTS {
        let content = record(0, i as u32, 4096);
        let r = client.append(&req(j), content.clone()).await.unwrap();
        assert_eq!(r.begin, written.len() as u64);
        written.extend_from_slice(&content);
    }
    let sealed = client.fragments(j).await.unwrap().len();
    assert!(sealed >= FRAGMENTS - 1, "{sealed} fragments");
    let after = open_fds(pid);
    assert!(
        after < before + 100,
        "{sealed} fragments: {before} descriptors before, {after} after"
    );
    let (bytes, done) = read_range(&client, j, 0, None).await.unwrap();
    assert_eq!(done.status, Status::OK);
    assert!(
        bytes == written,
        "read {} bytes (SHA-1 {}), wrote {} (SHA-1 {})",
        bytes.len(),
        hex_sha1(&bytes),
        written.len(),
        hex_sha1(&written)
    );
}

/// A READ under the id of an open read is refused; the open read goes on
/// and can still be cancelled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_id_in_use_is_refused() {
    let broker = Broker::start_with_cores(1);
    let client = broker.client().await;
    let j = "e2e/status/read-ids";
    create_journal(&client, j, |_| {}).await;
    client.append(&req(j), b"abc".to_vec()).await.unwrap();
    let endpoint = broker.endpoint();
    tokio::task::block_in_place(|| {
        let mut s = raw_connect(&endpoint);
        let read = ReadRequest {
            journal: j.into(),
            offset: Some(0),
            end_offset: None,
            route_revision: 0,
        }
        .encode();
        s.write_all(&frame(Op::READ, flag::BLOCK, 5, &read, &[]))
            .unwrap();
        let f = read_raw_frame(&mut s).unwrap().expect("READ_DATA");
        assert_eq!(
            (f.op, f.request_id, &f.payload[..]),
            (Op::READ_DATA, 5, &b"abc"[..])
        );
        s.write_all(&frame(Op::READ, flag::BLOCK, 5, &read, &[]))
            .unwrap();
        let f = read_raw_frame(&mut s).unwrap().expect("READ_DONE");
        assert_eq!(
            (f.op, f.status, f.request_id),
            (Op::READ_DONE, Status::BAD_REQUEST as u16, 5),
            "{f:?}"
        );
        s.write_all(&frame(Op::CANCEL, 0, 5, &[], &[])).unwrap();
        let f = read_raw_frame(&mut s).unwrap().expect("READ_DONE");
        assert_eq!(
            (f.op, f.status, f.request_id),
            (Op::READ_DONE, Status::CANCELLED as u16, 5),
            "{f:?}"
        );
    });
}

/// An APPEND under the id of an open streamed append is refused, and the
/// open one is rolled back: the chunks that follow could be either's, so
/// neither commits with the other's bytes. So too when the shard the
/// client reached forwards the journal's appends to another.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_append_id_in_use_rolls_back_both() {
    // On the journal's own shard, and on a shard that forwards it.
    for cores in [1, 2] {
        an_append_id_in_use_rolls_back_both_on(cores).await;
    }
}

async fn an_append_id_in_use_rolls_back_both_on(cores: usize) {
    let broker = Broker::start_with_cores(cores);
    let client = broker.client().await;
    let j = "e2e/status/append-ids";
    create_journal(&client, j, |_| {}).await;
    let owner = rotary_net::shard_of(j, cores as u32) as usize;
    let endpoint = broker.shard_endpoint((owner + 1) % cores);
    tokio::task::block_in_place(|| {
        let mut s = raw_connect(&endpoint);
        let meta = req(j).encode();
        s.write_all(&frame(Op::APPEND, flag::MORE, 9, &meta, b"A1"))
            .unwrap();
        s.write_all(&frame(Op::APPEND, flag::MORE, 9, &meta, b"B1"))
            .unwrap();
        s.write_all(&frame(Op::APPEND_CHUNK, 0, 9, &[], b"C"))
            .unwrap();
        let mut statuses = Vec::new();
        for _ in 0..2 {
            let f = read_raw_frame(&mut s).unwrap().expect("a reply");
            assert_eq!((f.op, f.request_id), (Op::APPEND_REPLY, 9), "{f:?}");
            statuses.push(f.status);
        }
        statuses.sort();
        let mut want = vec![Status::BAD_REQUEST as u16, Status::CANCELLED as u16];
        want.sort();
        assert_eq!(statuses, want);
    });
    let r = client.append(&req(j), b"next".to_vec()).await.unwrap();
    assert_eq!(r.begin, 0, "nothing of either append committed");
    let (bytes, _) = read_range(&client, j, 0, None).await.unwrap();
    assert_eq!(bytes, b"next");
}

/// A request carries only the sections its op has (PROTOCOL.md §4): meta
/// or payload where the op has none is BAD_REQUEST, a payload above 16 MiB
/// is FRAME_TOO_LARGE, each in the request's own reply op, and the
/// connection goes on. A bad chunk of an open append rolls it back, on the
/// journal's shard and through one that forwards it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_carry_only_the_sections_their_op_has() {
    for cores in [1, 2] {
        requests_carry_only_the_sections_their_op_has_on(cores).await;
    }
}

async fn requests_carry_only_the_sections_their_op_has_on(cores: usize) {
    let broker = Broker::start_with_cores(cores);
    let client = broker.client().await;
    let j = "e2e/status/shapes";
    create_journal(&client, j, |_| {}).await;
    client.append(&req(j), b"before".to_vec()).await.unwrap();
    let owner = rotary_net::shard_of(j, cores as u32) as usize;
    let endpoint = broker.shard_endpoint((owner + 1) % cores);
    let spec = r#"[{"name":"e2e/status/shapes-new"}]"#;
    let read_meta = ReadRequest {
        journal: j.into(),
        offset: Some(0),
        end_offset: None,
        route_revision: 0,
    }
    .encode();
    tokio::task::block_in_place(|| {
        let mut s = raw_connect(&endpoint);
        let cases: Vec<(Vec<u8>, Op, Status)> = vec![
            (
                frame(Op::STATS, 0, 1, b"m", &[]),
                Op::ADMIN_REPLY,
                Status::BAD_REQUEST,
            ),
            (
                frame(Op::STATS, 0, 2, &[], b"p"),
                Op::ADMIN_REPLY,
                Status::BAD_REQUEST,
            ),
            (
                frame(Op::PING, 0, 3, b"m", b"p"),
                Op::ERROR,
                Status::BAD_REQUEST,
            ),
            (
                frame(Op::APPLY, 0, 4, b"m", spec.as_bytes()),
                Op::ADMIN_REPLY,
                Status::BAD_REQUEST,
            ),
            (
                frame(Op::SEAL, 0, 5, j.as_bytes(), b"p"),
                Op::ADMIN_REPLY,
                Status::BAD_REQUEST,
            ),
            (
                frame(Op::READ, 0, 6, &read_meta, b"p"),
                Op::READ_DONE,
                Status::BAD_REQUEST,
            ),
            (
                frame(
                    Op::APPEND,
                    0,
                    7,
                    &req(j).encode(),
                    &vec![b'x'; wire::PAYLOAD_LEN_MAX + 1],
                ),
                Op::APPEND_REPLY,
                Status::FRAME_TOO_LARGE,
            ),
            (
                frame(Op::PING, 0, 8, &[], &vec![0; wire::PAYLOAD_LEN_MAX + 1]),
                Op::ERROR,
                Status::FRAME_TOO_LARGE,
            ),
        ];
        for (bytes, _, _) in &cases {
            s.write_all(bytes).unwrap();
        }
        for (i, (_, op, status)) in cases.iter().enumerate() {
            let f = read_raw_frame(&mut s).unwrap().expect("a reply");
            assert_eq!(
                (f.op, f.request_id, f.status),
                (*op, i as u64 + 1, *status as u16),
                "{}",
                String::from_utf8_lossy(&f.payload)
            );
            assert!(!f.payload.is_empty(), "a message comes with it");
        }

        // An open append whose second chunk carries meta: refused and
        // rolled back; its last chunk is dropped without a reply.
        let meta = req(j).encode();
        s.write_all(&frame(Op::APPEND, flag::MORE, 20, &meta, b"A1"))
            .unwrap();
        s.write_all(&frame(Op::APPEND_CHUNK, flag::MORE, 20, b"m", b"A2"))
            .unwrap();
        s.write_all(&frame(Op::APPEND_CHUNK, 0, 20, &[], b"A3"))
            .unwrap();
        // And one whose chunk is too large.
        s.write_all(&frame(Op::APPEND, flag::MORE, 21, &meta, b"B1"))
            .unwrap();
        s.write_all(&frame(
            Op::APPEND_CHUNK,
            0,
            21,
            &[],
            &vec![b'y'; wire::PAYLOAD_LEN_MAX + 1],
        ))
        .unwrap();
        s.write_all(&frame(Op::PING, 0, 22, &[], b"kept")).unwrap();
        let mut got = Vec::new();
        for _ in 0..3 {
            let f = read_raw_frame(&mut s).unwrap().expect("a reply");
            got.push((f.op, f.request_id, f.status));
        }
        got.sort_by_key(|&(_, id, _)| id);
        assert_eq!(
            got,
            vec![
                (Op::APPEND_REPLY, 20, Status::BAD_REQUEST as u16),
                (Op::APPEND_REPLY, 21, Status::FRAME_TOO_LARGE as u16),
                (Op::PONG, 22, Status::OK as u16),
            ]
        );
    });
    // Nothing of any refused request took effect.
    let r = client.append(&req(j), b"after".to_vec()).await.unwrap();
    assert_eq!(r.begin, 6, "no refused append committed");
    let (bytes, _) = read_range(&client, j, 0, None).await.unwrap();
    assert_eq!(bytes, b"beforeafter");
    let listed = client.list("").await.unwrap();
    assert!(
        listed
            .iter()
            .all(|i| i.spec.name != "e2e/status/shapes-new"),
        "the refused APPLY created nothing"
    );
}

/// Reads the next frame on a raw connection: an OK APPEND_REPLY to `id`.
fn expect_append_ok(s: &mut std::net::TcpStream, id: u64) {
    let f = tokio::task::block_in_place(|| read_raw_frame(s))
        .unwrap()
        .expect("the append's reply");
    assert_eq!(
        (f.op, f.request_id, f.status),
        (Op::APPEND_REPLY, id, Status::OK as u16),
        "{f:?}"
    );
}

/// `max_append_rate` holds a journal's appends back at the shard, not on
/// the connection: a PING sent behind a throttled append is answered at
/// once. The rate bounds an append streamed in chunks too, and a spec
/// lifting it lets the held append through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_throttled_append_holds_back_neither_its_connection_nor_its_bytes_rate() {
    let broker = Broker::start_with_cores(1);
    let client = broker.client().await;
    let endpoint = broker.endpoint();
    let slow = "e2e/status/rate-slow";
    let streamed = "e2e/status/rate-streamed";
    create_journal(&client, slow, |s| s.max_append_rate = 100).await;
    create_journal(&client, streamed, |s| s.max_append_rate = 4000).await;
    let body: Vec<u8> = (0..5000u32).map(|i| (i % 251) as u8).collect();

    // 5000 bytes at 100 B/s would take 49 s; the PING is answered first,
    // with nothing committed yet.
    let mut s = raw_connect(&endpoint);
    let meta = req(slow).encode();
    s.write_all(&frame(Op::APPEND, 0, 1, &meta, &body)).unwrap();
    s.write_all(&frame(Op::PING, 0, 2, &[], b"here")).unwrap();
    let f = tokio::task::block_in_place(|| read_raw_frame(&mut s))
        .unwrap()
        .expect("a reply");
    assert_eq!((f.op, f.request_id), (Op::PONG, 2), "{f:?}");
    assert_eq!(write_head(&client, slow).await, 0);
    // Lifting the rate lets it through, whole.
    create_journal(&client, slow, |s| s.max_append_rate = 0).await;
    expect_append_ok(&mut s, 1);
    assert_eq!(read_all(&client, slow).await, body);

    // 16,000 bytes streamed in four chunks at 4000 B/s (one second of
    // burst): no sooner than 3 s.
    let started = std::time::Instant::now();
    let mut s = raw_connect(&endpoint);
    let meta = req(streamed).encode();
    let chunks: Vec<Vec<u8>> = (0..4u8).map(|k| vec![b'a' + k; 4000]).collect();
    s.write_all(&frame(Op::APPEND, flag::MORE, 3, &meta, &chunks[0]))
        .unwrap();
    for (k, c) in chunks.iter().enumerate().skip(1) {
        let flags = if k == 3 { 0 } else { flag::MORE };
        s.write_all(&frame(Op::APPEND_CHUNK, flags, 3, &[], c))
            .unwrap();
    }
    expect_append_ok(&mut s, 3);
    let took = started.elapsed();
    assert!(
        took >= std::time::Duration::from_millis(2900),
        "16,000 bytes at 4000 B/s went in {took:?}"
    );
    assert_eq!(read_all(&client, streamed).await, chunks.concat());
    let stats = client.stats().await.unwrap();
    assert!(stats["rate_waits"].as_u64().unwrap() > 0, "{stats}");
}

/// A clean stop (SIGTERM) answers what it ends: an append still streaming
/// is rolled back and answered `SHUTTING_DOWN`, and so is a read waiting
/// for data, at the offset it reached; an append whose content is whole
/// commits and is answered. Nothing of the rolled-back append is visible
/// after a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clean_stop_answers_what_it_ends() {
    let mut broker = Broker::start_with_cores(1);
    let j = "e2e/status/clean-stop";
    {
        let client = broker.client().await;
        create_journal(&client, j, |_| {}).await;
        client.append(&req(j), b"kept".to_vec()).await.unwrap();
    }
    let endpoint = broker.endpoint();
    let (mut appender, mut reader) = tokio::task::block_in_place(|| {
        let mut appender = raw_connect(&endpoint);
        let meta = req(j).encode();
        appender
            .write_all(&frame(Op::APPEND, flag::MORE, 9, &meta, b"lost"))
            .unwrap();
        ping_on(&mut appender, 10);
        let mut reader = raw_connect(&endpoint);
        let read = ReadRequest {
            journal: j.into(),
            offset: Some(4),
            end_offset: None,
            route_revision: 0,
        }
        .encode();
        reader
            .write_all(&frame(Op::READ, flag::BLOCK, 5, &read, &[]))
            .unwrap();
        ping_on(&mut reader, 6);
        (appender, reader)
    });
    tokio::task::block_in_place(|| broker.stop_graceful());
    tokio::task::block_in_place(|| {
        let f = read_raw_frame(&mut appender)
            .unwrap()
            .expect("APPEND_REPLY");
        assert_eq!(
            (f.op, f.status, f.request_id),
            (Op::APPEND_REPLY, Status::SHUTTING_DOWN as u16, 9),
            "{f:?}"
        );
        assert!(
            String::from_utf8_lossy(&f.payload).contains("rolled back"),
            "{f:?}"
        );
        let f = read_raw_frame(&mut reader).unwrap().expect("READ_DONE");
        assert_eq!(
            (f.op, f.status, f.request_id),
            (Op::READ_DONE, Status::SHUTTING_DOWN as u16, 5),
            "{f:?}"
        );
        let u64_at = |at: usize| u64::from_le_bytes(f.meta[at..at + 8].try_into().unwrap());
        assert_eq!(
            (u64_at(0), u64_at(8)),
            (4, 4),
            "offset and write head: {f:?}"
        );
    });
    broker.start_again();
    let client = broker.client().await;
    assert_eq!(read_all(&client, j).await, b"kept");
    let r = client.append(&req(j), b"next".to_vec()).await.unwrap();
    assert_eq!(r.begin, 4);
}

/// A one-shard broker whose append queue budget is `budget` (e.g. `4M`).
fn broker_with_queue_budget(budget: &str) -> Broker {
    Broker::start_with(
        1,
        BrokerOpts {
            args: vec!["--append-queue-budget".into(), budget.into()],
            env: Vec::new(),
            ..Default::default()
        },
    )
}

/// PINGs on a raw connection and checks the PONG: every frame sent before
/// it was read.
fn ping_on(s: &mut std::net::TcpStream, id: u64) {
    s.write_all(&frame(Op::PING, 0, id, &[], b"")).unwrap();
    let f = read_raw_frame(s).unwrap().expect("PONG");
    assert_eq!((f.op, f.request_id), (Op::PONG, id), "{f:?}");
}

/// A raw connection whose append (request id 1, content `first`) holds
/// `journal` and streams no more until the test sends its last chunk.
fn hold_journal(endpoint: &str, journal: &str, first: &[u8]) -> std::net::TcpStream {
    tokio::task::block_in_place(|| {
        let mut s = raw_connect(endpoint);
        let meta = req(journal).encode();
        s.write_all(&frame(Op::APPEND, flag::MORE, 1, &meta, first))
            .unwrap();
        ping_on(&mut s, 2);
        s
    })
}

/// Many clients appending behind a journal held by a stalled append: the
/// shard stops reading those that hold 1 MiB or more of queued content
/// once its `--append-queue-budget` share is spent, so the content in
/// memory stays near the budget rather than every connection's 64 MiB.
/// When the stalled append ends, every queued append commits, whole and
/// in one piece.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_queued_appends_hold_the_shards_budget() {
    const CLIENTS: usize = 8;
    const EACH: usize = 4 << 20;
    const BUDGET: u64 = 4 << 20;
    let broker = broker_with_queue_budget("4M");
    let client = broker.client().await;
    let j = "e2e/status/queue-budget";
    create_journal(&client, j, |_| {}).await;
    let endpoint = broker.endpoint();
    // The journal's append slot, held by an append that streams no more.
    let mut holder = hold_journal(&endpoint, j, b"first");
    let mut tasks = Vec::new();
    for i in 0..CLIENTS {
        let c = broker.client().await;
        let content = vec![b'a' + i as u8; EACH];
        tasks.push(tokio::spawn(async move {
            let r = c.append(&req(j), content).await;
            (i, r)
        }));
    }
    // Wait until the queue stops growing.
    let stat = |s: &serde_json::Value, k: &str| s[k].as_u64().unwrap_or_else(|| panic!("{k}: {s}"));
    let mut last = u64::MAX;
    let mut queued = 0;
    for _ in 0..100 {
        tokio::time::sleep(std::time::Duration::from_millis(300)).await;
        queued = stat(&client.stats().await.unwrap(), "append_queued_bytes");
        if queued == last && queued > BUDGET {
            break;
        }
        last = queued;
    }
    let stats = client.stats().await.unwrap();
    let bound = BUDGET + CLIENTS as u64 * ((1 << 20) + (256 << 10));
    assert!(
        queued > BUDGET && queued <= bound,
        "{queued} bytes queued; {} were sent, the bound is {bound}",
        CLIENTS * EACH
    );
    assert!(stat(&stats, "append_queue_waits") >= 1, "{stats}");
    // The held append ends; everything queued commits after it.
    tokio::task::block_in_place(|| {
        holder
            .write_all(&frame(Op::APPEND_CHUNK, 0, 1, &[], b"-done"))
            .unwrap();
        let f = read_raw_frame(&mut holder).unwrap().expect("reply");
        assert_eq!(
            (f.op, f.request_id, f.status),
            (Op::APPEND_REPLY, 1, 0),
            "{f:?}"
        );
    });
    let mut spans = Vec::new();
    for t in tasks {
        let (i, r) = t.await.unwrap();
        let r = r.unwrap_or_else(|e| panic!("client {i}: {e}"));
        assert_eq!(r.end - r.begin, EACH as u64);
        spans.push((r.begin, i));
    }
    spans.sort();
    let all = read_all(&client, j).await;
    assert_eq!(all.len(), 10 + CLIENTS * EACH);
    assert_eq!(&all[..10], b"first-done");
    for (n, (begin, i)) in spans.into_iter().enumerate() {
        assert_eq!(begin as usize, 10 + n * EACH);
        let span = &all[begin as usize..begin as usize + EACH];
        assert!(
            span.iter().all(|&b| b == b'a' + i as u8),
            "client {i}'s bytes interleaved"
        );
    }
    assert_eq!(
        stat(&client.stats().await.unwrap(), "append_queued_bytes"),
        0
    );
}

/// A connection held back by a spent append queue budget is still read
/// for an append of it that holds its journal: that append's content
/// arrives only by reading it. Here the connection has content queued
/// behind a stalled append on another journal, which alone would keep it
/// held back, and its append on the first journal commits all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_append_holding_its_journal_is_read_past_a_spent_budget() {
    const MIB: usize = 1 << 20;
    let broker = broker_with_queue_budget("4M");
    let client = broker.client().await;
    let (j, k) = ("e2e/status/held-j", "e2e/status/held-k");
    create_journal(&client, j, |_| {}).await;
    create_journal(&client, k, |_| {}).await;
    let endpoint = broker.endpoint();
    let reply = |s: &mut std::net::TcpStream, id: u64| {
        let f = read_raw_frame(s).unwrap().expect("reply");
        assert_eq!(
            (f.op, f.request_id, f.status),
            (Op::APPEND_REPLY, id, 0),
            "{f:?}"
        );
    };
    let (mut hold_j, mut hold_k) = (
        hold_journal(&endpoint, j, b"h0"),
        hold_journal(&endpoint, k, b"h0"),
    );
    let mut c = tokio::task::block_in_place(|| {
        // C: the first MiB of an append to j, and 2 MiB to k, both queued.
        let mut c = raw_connect(&endpoint);
        let (meta_j, meta_k) = (req(j).encode(), req(k).encode());
        c.write_all(&frame(Op::APPEND, flag::MORE, 1, &meta_j, &vec![b'c'; MIB]))
            .unwrap();
        c.write_all(&frame(Op::APPEND, flag::MORE, 2, &meta_k, &vec![b'C'; MIB]))
            .unwrap();
        c.write_all(&frame(Op::APPEND_CHUNK, 0, 2, &[], &vec![b'C'; MIB]))
            .unwrap();
        ping_on(&mut c, 3);
        c
    });
    // Others queue on k until the shard's budget is spent.
    let mut others = Vec::new();
    for i in 0..3u8 {
        let c = broker.client().await;
        others.push(tokio::spawn(async move {
            c.append(&req(k), vec![b'd' + i; 2 * MIB]).await
        }));
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while client.stats().await.unwrap()["append_queue_waits"].as_u64() < Some(1) {
        assert!(
            std::time::Instant::now() < deadline,
            "the budget was never spent"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    // The rest of C's append to j, sent while C is held back.
    let mut sender = c.try_clone().unwrap();
    let rest = std::thread::spawn(move || {
        for n in 0..4 {
            let flags = if n < 3 { flag::MORE } else { 0 };
            sender
                .write_all(&frame(Op::APPEND_CHUNK, flags, 1, &[], &vec![b'c'; MIB]))
                .unwrap();
        }
    });
    tokio::task::block_in_place(|| {
        // j is free: C's append holds it now, and is read to its end.
        hold_j
            .write_all(&frame(Op::APPEND_CHUNK, 0, 1, &[], b"h1"))
            .unwrap();
        reply(&mut hold_j, 1);
        reply(&mut c, 1);
        rest.join().unwrap();
        hold_k
            .write_all(&frame(Op::APPEND_CHUNK, 0, 1, &[], b"h1"))
            .unwrap();
        reply(&mut hold_k, 1);
        reply(&mut c, 2);
    });
    for t in others {
        let r = t.await.unwrap().unwrap();
        assert_eq!(r.end - r.begin, 2 * MIB as u64);
    }
    let all_j = read_all(&client, j).await;
    assert_eq!(all_j.len(), 4 + 5 * MIB);
    assert!(all_j.starts_with(b"h0h1") && all_j[4..].iter().all(|&b| b == b'c'));
    assert_eq!(read_all(&client, k).await.len(), 4 + 2 * MIB + 3 * 2 * MIB);
}

/// Append content queued behind a journal that is then deleted leaves the
/// shard's queue: the budget is not spent by appends that are gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_appends_of_a_deleted_journal_leave_the_queue() {
    let broker = Broker::start_with_cores(1);
    let client = broker.client().await;
    let j = "e2e/status/queue-deleted";
    create_journal(&client, j, |_| {}).await;
    let endpoint = broker.endpoint();
    let _holder = hold_journal(&endpoint, j, b"h0");
    let queued = || async {
        let stats = client.stats().await.unwrap();
        stats["append_queued_bytes"]
            .as_u64()
            .expect("append_queued_bytes")
    };
    let c = broker.client().await;
    let appending = tokio::spawn(async move { c.append(&req(j), vec![7u8; 3 << 20]).await });
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while queued().await < 3 << 20 {
        assert!(
            std::time::Instant::now() < deadline,
            "the append never queued"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    client.delete(j).await.unwrap();
    let err = appending
        .await
        .unwrap()
        .expect_err("its journal was deleted");
    assert_eq!(err.status(), Some(Status::JOURNAL_NOT_FOUND), "{err}");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        let left = queued().await;
        if left == 0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{left} bytes stay queued for a deleted journal"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// A full data disk refuses changes of specs with the retryable
/// STORAGE_FULL and changes nothing; reads and lists go on, and the same
/// changes are taken once space returns, and kept across a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_refuses_spec_changes_until_it_has_space() {
    let mut broker = Broker::start_with_cores(1);
    broker.kill9();
    let Some(_mount) = mount_tmpfs(&broker.data, "8m") else {
        eprintln!("SKIPPED: mounting a tmpfs needs root");
        return;
    };
    broker.start_again();
    let client = broker.client().await;
    let kept = "e2e/full/kept";
    create_journal(&client, kept, |_| {}).await;
    client
        .append(&req(kept), b"kept bytes".to_vec())
        .await
        .unwrap();

    // Every page of the file system taken.
    let filler = broker.data.join("filler");
    {
        let mut f = std::fs::File::create(&filler).unwrap();
        let chunk = vec![7u8; 64 << 10];
        loop {
            match f.write_all(&chunk) {
                Ok(()) => {}
                Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => break,
                Err(e) => panic!("filling the disk: {e}"),
            }
        }
        // Partial writes may leave a page or two: take them too.
        while f.write_all(&[7u8; 512]).is_ok() {}
    }
    let mut new = rotary_net::spec::JournalSpec::new("e2e/full/new");
    new.fragment.compression_codec = rotary_net::spec::Codec::None;
    for _ in 0..2 {
        let e = client.apply(std::slice::from_ref(&new)).await.unwrap_err();
        assert_eq!(e.status(), Some(Status::STORAGE_FULL), "{e}");
        assert!(e.is_retryable(), "{e}");
        assert!(e.to_string().contains("No space left"), "{e}");
        let e = client.delete(kept).await.unwrap_err();
        assert_eq!(e.status(), Some(Status::STORAGE_FULL), "{e}");
    }
    // Nothing changed, and the broker serves what it has.
    let names = |l: Vec<rotary_net::client::JournalInfo>| {
        l.into_iter().map(|j| j.spec.name).collect::<Vec<_>>()
    };
    assert_eq!(
        names(client.list("").await.unwrap()),
        vec![kept.to_string()]
    );
    assert_eq!(read_all(&client, kept).await, b"kept bytes".to_vec());

    // Space returns: the same changes are taken.
    std::fs::remove_file(&filler).unwrap();
    assert_eq!(client.apply(std::slice::from_ref(&new)).await.unwrap(), 1);
    client.delete(kept).await.unwrap();
    drop(client);
    broker.restart();
    let client = broker.client().await;
    assert_eq!(
        names(client.list("").await.unwrap()),
        vec!["e2e/full/new".to_string()]
    );
    assert_eq!(
        status_of(client.append(&req(kept), b"x".to_vec()).await),
        Status::JOURNAL_NOT_FOUND
    );
}

/// A raw frame, expected to be the reply `op` to request `id` with
/// `status`.
fn expect_reply(s: &mut std::net::TcpStream, op: Op, id: u64, status: Status) -> RawFrame {
    let f = read_raw_frame(s).unwrap().expect("a reply");
    assert_eq!(
        (f.op, f.request_id, f.status),
        (op, id, status as u16),
        "{f:?}: {}",
        String::from_utf8_lossy(&f.payload)
    );
    f
}

/// A connection holds at most 1,024 streamed appends open (PROTOCOL.md
/// §11): the next is refused TOO_MANY_REQUESTS and its chunks dropped,
/// while those open go on; once they end, streams are taken again. So too
/// through a shard that forwards the journal's appends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_holds_a_bounded_count_of_streamed_appends() {
    for cores in [1, 2] {
        let broker = Broker::start_with_cores(cores);
        let client = broker.client().await;
        let j = "e2e/status/open-appends";
        create_journal(&client, j, |_| {}).await;
        let owner = rotary_net::shard_of(j, cores as u32) as usize;
        let endpoint = broker.shard_endpoint((owner + 1) % cores);
        tokio::task::block_in_place(|| streamed_appends_past_the_limit(&endpoint, j));
        let (bytes, _) = read_range(&client, j, 0, None).await.unwrap();
        assert_eq!(bytes, b"abcd", "on {cores} cores");
    }
}

fn streamed_appends_past_the_limit(endpoint: &str, j: &str) {
    const OPEN: u64 = 1024;
    let mut s = raw_connect(endpoint);
    let meta = req(j).encode();
    // Append 1 holds the journal; 2..=1024 queue behind it.
    for id in 1..=OPEN {
        s.write_all(&frame(Op::APPEND, flag::MORE, id, &meta, b"a"))
            .unwrap();
    }
    ping_on(&mut s, 9000);
    s.write_all(&frame(Op::APPEND, flag::MORE, 5000, &meta, b"x"))
        .unwrap();
    let f = expect_reply(&mut s, Op::APPEND_REPLY, 5000, Status::TOO_MANY_REQUESTS);
    assert!(
        String::from_utf8_lossy(&f.payload).contains("1024 streamed appends open"),
        "{f:?}"
    );
    // The refused append's last chunk is dropped without a reply.
    s.write_all(&frame(Op::APPEND_CHUNK, 0, 5000, &[], b"zzz"))
        .unwrap();
    s.write_all(&frame(Op::APPEND_CHUNK, 0, 1, &[], b"b"))
        .unwrap();
    expect_reply(&mut s, Op::APPEND_REPLY, 1, Status::OK);
    for id in 2..=OPEN {
        s.write_all(&frame(Op::APPEND_CHUNK, flag::ABORT, id, &[], b""))
            .unwrap();
    }
    let mut cancelled = std::collections::BTreeSet::new();
    for _ in 2..=OPEN {
        let f = read_raw_frame(&mut s).unwrap().expect("a reply");
        assert_eq!(
            (f.op, f.status),
            (Op::APPEND_REPLY, Status::CANCELLED as u16),
            "{f:?}"
        );
        cancelled.insert(f.request_id);
    }
    assert_eq!(cancelled, (2..=OPEN).collect());
    // Room again.
    s.write_all(&frame(Op::APPEND, flag::MORE, 6000, &meta, b"c"))
        .unwrap();
    s.write_all(&frame(Op::APPEND_CHUNK, 0, 6000, &[], b"d"))
        .unwrap();
    expect_reply(&mut s, Op::APPEND_REPLY, 6000, Status::OK);
}

/// A client that leaves more than 1,024 refused streamed appends
/// unfinished (PROTOCOL.md §6.3, §11) is sent an ERROR of
/// TOO_MANY_REQUESTS and its connection is closed; below that, finishing
/// one makes room.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_streams_left_unfinished_close_the_connection_past_the_limit() {
    let broker = Broker::start_with_cores(1);
    let endpoint = broker.endpoint();
    tokio::task::block_in_place(|| {
        let mut s = raw_connect(&endpoint);
        let meta = req("e2e/status/never-created").encode();
        let refused = |s: &mut std::net::TcpStream, id: u64| {
            s.write_all(&frame(Op::APPEND, flag::MORE, id, &meta, b"a"))
                .unwrap();
            expect_reply(s, Op::APPEND_REPLY, id, Status::JOURNAL_NOT_FOUND);
        };
        for id in 1..=1024 {
            refused(&mut s, id);
        }
        // Append 1 ends: its id leaves the discarded ones.
        s.write_all(&frame(Op::APPEND_CHUNK, 0, 1, &[], b""))
            .unwrap();
        refused(&mut s, 1025);
        ping_on(&mut s, 9000);
        refused(&mut s, 1026);
        let f = expect_reply(&mut s, Op::ERROR, 0, Status::TOO_MANY_REQUESTS);
        assert!(
            String::from_utf8_lossy(&f.payload).contains("1024 refused streamed appends"),
            "{f:?}"
        );
        assert!(
            read_raw_frame(&mut s).unwrap().is_none(),
            "the connection is closed"
        );
    });
    assert!(raw_ping(&endpoint), "the broker serves other connections");
}

/// A connection holds at most 4,096 reads open on a shard (PROTOCOL.md
/// §7, §11): the next READ is refused TOO_MANY_REQUESTS; a cancelled one
/// makes room, and those open go on serving.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_holds_a_bounded_count_of_reads() {
    const OPEN: u64 = 4096;
    let broker = Broker::start_with_cores(1);
    let client = broker.client().await;
    let j = "e2e/status/open-reads";
    create_journal(&client, j, |_| {}).await;
    client.append(&req(j), b"abc".to_vec()).await.unwrap();
    let endpoint = broker.endpoint();
    let read_at = |offset: u64| {
        ReadRequest {
            journal: j.into(),
            offset: Some(offset),
            end_offset: None,
            route_revision: 0,
        }
        .encode()
    };
    let mut s = tokio::task::block_in_place(|| {
        let mut s = raw_connect(&endpoint);
        for id in 1..=OPEN {
            s.write_all(&frame(Op::READ, flag::BLOCK, id, &read_at(3), &[]))
                .unwrap();
        }
        ping_on(&mut s, 9000);
        s.write_all(&frame(Op::READ, flag::BLOCK, 5000, &read_at(0), &[]))
            .unwrap();
        let f = expect_reply(&mut s, Op::READ_DONE, 5000, Status::TOO_MANY_REQUESTS);
        assert!(
            String::from_utf8_lossy(&f.payload).contains("4096 reads open"),
            "{f:?}"
        );
        s.write_all(&frame(Op::CANCEL, 0, 1, &[], &[])).unwrap();
        expect_reply(&mut s, Op::READ_DONE, 1, Status::CANCELLED);
        s.write_all(&frame(Op::READ, flag::BLOCK, 5001, &read_at(0), &[]))
            .unwrap();
        let f = expect_reply(&mut s, Op::READ_DATA, 5001, Status::OK);
        assert_eq!(f.payload, b"abc");
        s
    });
    client.append(&req(j), b"d".to_vec()).await.unwrap();
    tokio::task::block_in_place(|| {
        let mut served = std::collections::BTreeSet::new();
        for _ in 2..=OPEN + 1 {
            let f = read_raw_frame(&mut s).unwrap().expect("READ_DATA");
            assert_eq!((f.op, &f.payload[..]), (Op::READ_DATA, &b"d"[..]), "{f:?}");
            served.insert(f.request_id);
        }
        let want: std::collections::BTreeSet<u64> = (2..=OPEN).chain([5001]).collect();
        assert_eq!(served, want, "every open read is served the new byte");
    });
}
