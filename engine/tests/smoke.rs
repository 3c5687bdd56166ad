//! In-process broker tests over real sockets: the engine's append, read and
//! recovery paths, driven with raw frames (no client library).
#![warn(clippy::too_many_lines)] // Functions under 100 lines, as in the engine.

mod common;

use common::{req, serve_journal, start, Conn};
use rotary_engine::ServeConfig;
use rotary_net::spec::{JournalSpec, LabelSet};
use rotary_net::status::Status;
use rotary_net::wire::{flag, AppendReply, Op};
use sha1::{Digest, Sha1};
use std::io::Write;

#[test]
fn append_read_seal_and_recover() {
    let dir = tempfile::tempdir().unwrap();
    let name = "smoke/journal-1";
    let mut expected = Vec::new();
    {
        let broker = start(dir.path(), 1);
        let mut c = Conn::new(broker.endpoints[0]);
        let mut spec = JournalSpec::new(name);
        spec.fragment.length = 64 << 10;
        c.apply(&[spec]);
        for i in 0..200u32 {
            let content: Vec<u8> = (0..(i * 37 % 5000 + 1))
                .map(|k| (k as u8) ^ (i as u8))
                .collect();
            let reply = c.append_ok(name, &content);
            assert_eq!(reply.begin, expected.len() as u64);
            assert_eq!(reply.end, (expected.len() + content.len()) as u64);
            let sum: [u8; 20] = Sha1::digest(&content).into();
            assert_eq!(reply.sha1, sum);
            expected.extend_from_slice(&content);
        }
        let got = c.read_ok(name, 0);
        assert_eq!(got, expected);
        // Reads from the middle, across sealed fragments.
        let (got, _) = c.read_all(name, 70_000);
        assert_eq!(got, expected[70_000..]);
        let (_, status) = c.read_all(name, expected.len() as u64);
        assert_eq!(status, Status::OFFSET_NOT_YET_AVAILABLE);
        // Simulate a crash: the broker's threads are left running, but its
        // files are reopened by a second broker on a copy of the directory.
        std::mem::forget(broker);
    }
    let copy = crash_image(dir.path());
    let broker = start(copy.path(), 1);
    let mut c = Conn::new(broker.endpoints[0]);
    let (got, _) = c.read_all(name, 0);
    assert_eq!(got.len(), expected.len());
    assert!(got == expected);
    let reply = c.append_ok(name, b"after restart");
    assert_eq!(reply.begin, expected.len() as u64);
}

/// Copies a directory tree. False if a file vanished while it was copied
/// (a running broker renamed or removed it): the copy is then no image of
/// one moment, and the caller copies again.
fn copy_dir(from: &std::path::Path, to: &std::path::Path) -> bool {
    let mut whole = true;
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let dest = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            std::fs::create_dir_all(&dest).unwrap();
            whole &= copy_dir(&e.path(), &dest);
        } else {
            match std::fs::copy(e.path(), &dest) {
                Ok(_) => {}
                Err(err) if err.kind() == std::io::ErrorKind::NotFound => whole = false,
                Err(err) => panic!("copying {}: {err}", e.path().display()),
            }
        }
    }
    whole
}

#[test]
fn streamed_append_rolls_back_when_the_connection_closes() {
    let dir = tempfile::tempdir().unwrap();
    let broker = start(dir.path(), 2);
    let name = "smoke/stream";
    let owner = rotary_net::shard_of(name, 2) as usize;
    let mut c = Conn::new(broker.endpoints[owner]);
    c.apply(&[JournalSpec::new(name)]);
    assert_eq!(c.append(&req(name), b"0123456789").0, Status::OK);
    {
        let mut d = Conn::new(broker.endpoints[owner]);
        d.send(Op::APPEND, flag::MORE, 1, &req(name).encode(), b"partial-1");
        d.send(Op::APPEND_CHUNK, flag::MORE, 1, &[], &vec![b'x'; 300_000]);
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    std::thread::sleep(std::time::Duration::from_millis(200));
    let reply = c.append_ok(name, b"next");
    assert_eq!(reply.begin, 10);
    let (got, _) = c.read_all(name, 0);
    assert_eq!(got, b"0123456789next");
    // The same through the other shard: forwarded, same answers.
    let other = 1 - owner;
    let mut f = Conn::new(broker.endpoints[other]);
    let (got, _) = f.read_all(name, 0);
    assert_eq!(got, b"0123456789next");
    // A streamed append in chunks commits whole.
    f.send(Op::APPEND, flag::MORE, 5, &req(name).encode(), b"a");
    f.send(Op::APPEND_CHUNK, flag::MORE, 5, &[], &vec![b'b'; 200_000]);
    f.send(Op::APPEND_CHUNK, 0, 5, &[], b"c");
    let r = f.recv();
    assert_eq!(
        (r.op, r.known_status(), r.id),
        (Op::APPEND_REPLY, Status::OK, 5)
    );
    let reply = AppendReply::decode(&r.meta).unwrap();
    assert_eq!((reply.begin, reply.end), (14, 14 + 200_002));
}

/// An append cancelled while it waits behind another is answered
/// `CANCELLED` with the journal's write head and registers as of the
/// reply, the append ahead of it included, as `WRONG_APPEND_OFFSET` and
/// `REGISTER_MISMATCH` would carry them.
#[test]
fn an_append_cancelled_in_the_queue_answers_the_head_and_registers() {
    let name = "smoke/cancelled";
    let (_dir, broker, mut c) = serve_journal(name);
    let mut r = req(name);
    r.union_registers = LabelSet::from_pairs([("epoch", "a")]).unwrap();
    assert_eq!(c.append(&r, b"0123456789").0, Status::OK);
    // An open append holds the journal; the one behind it is cancelled
    // before its turn.
    let mut open = Conn::new(broker.endpoints[0]);
    let mut r = req(name);
    r.union_registers = LabelSet::from_pairs([("writer", "b")]).unwrap();
    open.send(Op::APPEND, flag::MORE, 1, &r.encode(), b"open");
    open.send(Op::PING, 0, 2, &[], &[]);
    assert_eq!(open.recv().op, Op::PONG);
    let mut cut = Conn::new(broker.endpoints[0]);
    cut.send(Op::APPEND, flag::MORE, 3, &req(name).encode(), b"cut");
    cut.send(Op::APPEND_CHUNK, flag::ABORT, 3, &[], &[]);
    cut.send(Op::PING, 0, 4, &[], &[]);
    assert_eq!(cut.recv().op, Op::PONG);
    // The open append ends: it is staged, and the cancelled one answered
    // in the same turn.
    open.send(Op::APPEND_CHUNK, 0, 1, &[], b"-end");
    let r = open.recv();
    assert_eq!((r.op, r.known_status()), (Op::APPEND_REPLY, Status::OK));
    let reply = AppendReply::decode(&r.meta).unwrap();
    assert_eq!((reply.begin, reply.end), (10, 18));
    let r = cut.recv();
    assert_eq!(
        (r.op, r.known_status(), r.id),
        (Op::APPEND_REPLY, Status::CANCELLED, 3)
    );
    let reply = AppendReply::decode(&r.meta).unwrap();
    assert_eq!((reply.begin, reply.end, reply.write_head), (0, 0, 18));
    assert_eq!(reply.registers.to_text(), "epoch=a,writer=b");
    assert_eq!(c.read_all(name, 0).0, b"0123456789open-end");
}

#[test]
fn preconditions_and_registers() {
    let name = "smoke/regs";
    let (_dir, broker, mut c) = serve_journal(name);
    let mut r = req(name);
    r.expect_offset = Some(5);
    let (status, reply) = c.append(&r, b"x");
    assert_eq!(status, Status::WRONG_APPEND_OFFSET);
    assert_eq!(reply.write_head, 0);
    let mut r = req(name);
    r.union_registers = rotary_net::LabelSet::from_pairs([("owner", "a")]).unwrap();
    assert_eq!(c.append(&r, b"one").0, Status::OK);
    let mut r = req(name);
    r.check_registers = rotary_net::LabelSelector::parse("owner=b").unwrap();
    let (status, reply) = c.append(&r, b"two");
    assert_eq!(status, Status::REGISTER_MISMATCH);
    assert_eq!(reply.registers.to_text(), "owner=a");
    let mut r = req(name);
    r.union_registers = rotary_net::LabelSet::from_pairs([("owner", "b")]).unwrap();
    assert_eq!(c.append(&r, b"").0, Status::BAD_REQUEST);
    assert_eq!(
        c.append(&req("no/such/journal"), b"x").0,
        Status::JOURNAL_NOT_FOUND
    );
    assert_eq!(c.append(&req("bad name"), b"x").0, Status::BAD_REQUEST);
    // Garbage closes only its own connection.
    let mut g = Conn::new(broker.endpoints[0]);
    g.s.write_all(&[0xde; 64]).unwrap();
    let e = g.recv();
    assert_eq!((e.op, e.known_status()), (Op::ERROR, Status::BAD_REQUEST));
    let reply = c.append_ok(name, b"ok");
    assert_eq!(reply.begin, 3);
    // A well-framed frame with an undefined flag bit is refused and skipped;
    // the connection keeps serving.
    let mut frame = Vec::new();
    rotary_net::wire::encode_frame(&mut frame, Op::PING, 0, Status::OK, 41, &[], &[9; 100_000]);
    frame[7] = 0x80;
    c.s.write_all(&frame).unwrap();
    let e = c.recv();
    assert_eq!(
        (e.op, e.known_status(), e.id),
        (Op::ERROR, Status::BAD_REQUEST, 41)
    );
    c.send(Op::PING, 0, 42, &[], b"still here");
    let p = c.recv();
    assert_eq!(
        (p.op, p.id, &p.payload[..]),
        (Op::PONG, 42, &b"still here"[..])
    );
    // Registers that would outgrow a reply are refused whole.
    let big = |from: usize| {
        let mut r = req(name);
        let labels: Vec<(String, String)> = (from..from + 40)
            .map(|i| (format!("k{i:03}"), "v".repeat(1000)))
            .collect();
        r.union_registers = rotary_net::LabelSet::from_pairs(labels).unwrap();
        r
    };
    let (status, reply) = c.append(&big(0), b"40 KB of registers");
    assert_eq!((status, reply.begin), (Status::OK, 5));
    let (status, reply) = c.append(&big(40), b"80 KB of registers");
    assert_eq!(status, Status::BAD_REQUEST);
    assert_eq!(reply.write_head, 23);
    let (status, reply) = c.append(&req(name), b"!");
    assert_eq!((status, reply.begin), (Status::OK, 23));
    assert_eq!(reply.registers.len(), 41);
}

#[test]
fn tailing_readers_are_served_from_memory() {
    let name = "smoke/tail";
    let (_dir, broker, mut w) = serve_journal(name);
    // Three blocking readers wait at the head.
    let mut readers: Vec<Conn> = (0..3).map(|_| Conn::new(broker.endpoints[0])).collect();
    for r in &mut readers {
        let req = rotary_net::wire::ReadRequest {
            journal: name.into(),
            offset: Some(0),
            end_offset: Some(3000),
            route_revision: 0,
        };
        r.send(Op::READ, flag::BLOCK, 11, &req.encode(), &[]);
    }
    std::thread::sleep(std::time::Duration::from_millis(100));
    let mut expected = Vec::new();
    for i in 0..30u8 {
        let chunk = vec![i; 100];
        assert_eq!(w.append(&req(name), &chunk).0, Status::OK);
        expected.extend_from_slice(&chunk);
    }
    for r in &mut readers {
        let mut got = Vec::new();
        loop {
            let f = r.recv();
            match f.op {
                Op::READ_DATA => {
                    assert_eq!(
                        u64::from_le_bytes(f.meta[..8].try_into().unwrap()),
                        got.len() as u64
                    );
                    got.extend_from_slice(&f.payload);
                }
                Op::READ_DONE => {
                    assert_eq!(f.known_status(), Status::OK);
                    break;
                }
                op => panic!("{op:?}"),
            }
        }
        assert_eq!(got, expected);
    }
    w.send(Op::STATS, 0, 5, &[], &[]);
    let stats: serde_json::Value = serde_json::from_slice(&w.recv().payload).unwrap();
    assert!(stats["tail_cache_reads"].as_u64().unwrap() > 0, "{stats}");
}

/// The spool file of `name` in a single-shard data directory.
fn spool_path(data: &std::path::Path, name: &str) -> std::path::PathBuf {
    let dir = data.join("shard-0/journals").join(name).join("@");
    let spools: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "spool"))
        .collect();
    assert_eq!(spools.len(), 1, "{spools:?}");
    spools[0].clone()
}

/// A copy of a broker's directory as a crash would leave it, without the
/// lock. A broker left running may still compact its commit log: copied
/// again until nothing changed under the copy.
fn crash_image(dir: &std::path::Path) -> tempfile::TempDir {
    let mut attempts = 0;
    let copy = loop {
        let copy = tempfile::tempdir().unwrap();
        if copy_dir(dir, copy.path()) {
            break copy;
        }
        attempts += 1;
        assert!(attempts < 20, "files kept vanishing under the copy");
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    std::fs::remove_file(copy.path().join("LOCK")).unwrap();
    copy
}

/// Reopens a crashed broker's files: a second broker on a copy of `dir`.
fn restart_copy(
    dir: &std::path::Path,
    damage: impl FnOnce(&std::path::Path),
) -> (tempfile::TempDir, rotary_engine::Broker) {
    let copy = crash_image(dir);
    damage(copy.path());
    let broker = start(copy.path(), 1);
    (copy, broker)
}

fn registers_of(c: &mut Conn, name: &str) -> String {
    let mut r = req(name);
    r.check_registers = rotary_net::LabelSelector::parse("owner=nobody").unwrap();
    let (status, reply) = c.append(&r, b"probe");
    assert_eq!(status, Status::REGISTER_MISMATCH);
    reply.registers.to_text()
}

/// Appends `a` (registers owner=a) and then `b` (owner=b) to a new journal
/// on a broker over `dir` that is left running, as if killed; returns b's
/// reply.
fn append_owned_pair(dir: &std::path::Path, name: &str, a: &[u8], b: &[u8]) -> AppendReply {
    let broker = start(dir, 1);
    let mut c = Conn::new(broker.endpoints[0]);
    c.apply(&[JournalSpec::new(name)]);
    let mut r = req(name);
    r.union_registers = rotary_net::LabelSet::from_pairs([("owner", "a")]).unwrap();
    assert_eq!(c.append(&r, a).0, Status::OK);
    let mut r = req(name);
    r.union_registers = rotary_net::LabelSet::from_pairs([("owner", "b")]).unwrap();
    let (status, reply) = c.append(&r, b);
    assert_eq!((status, reply.begin), (Status::OK, a.len() as u64));
    std::mem::forget(broker);
    reply
}

#[test]
fn an_answered_batch_whose_spool_write_never_landed_comes_back_from_the_log() {
    // A small batch is answered once its commit-log record, which carries
    // its bytes, is written; its spool write completes later in the turn.
    // A crash in between leaves the record without the spool bytes, and
    // recovery writes them back from the record.
    let dir = tempfile::tempdir().unwrap();
    let name = "smoke/carried-batch";
    let a: Vec<u8> = (0..5000u32).map(|i| (i * 7) as u8).collect();
    let b: Vec<u8> = (0..3000u32).map(|i| (i * 13 + 1) as u8).collect();
    let sha_b = append_owned_pair(dir.path(), name, &a, &b).sha1;
    let mut hasher = sha1::Sha1::new();
    sha1::Digest::update(&mut hasher, &b);
    assert_eq!(sha_b, <[u8; 20]>::from(sha1::Digest::finalize(hasher)));
    // B's bytes, and the rest of their block, never reached the spool.
    let (copy, broker) = restart_copy(dir.path(), |data| {
        let path = spool_path(data, name);
        let mut bytes = std::fs::read(&path).unwrap();
        let end = (a.len() + b.len()).next_multiple_of(4096);
        bytes[a.len()..end].fill(0);
        std::fs::write(&path, &bytes).unwrap();
    });
    let mut c = Conn::new(broker.endpoints[0]);
    let got = c.read_ok(name, 0);
    assert!(
        got == [a.clone(), b.clone()].concat(),
        "read {} bytes, want both appends' {}",
        got.len(),
        a.len() + b.len()
    );
    assert_eq!(registers_of(&mut c, name), "owner=b");
    let (status, reply) = c.append(&req(name), b"after");
    assert_eq!(
        (status, reply.begin),
        (Status::OK, (a.len() + b.len()) as u64)
    );
    drop(c);
    std::mem::forget(broker);
    // The restored bytes are in the spool itself: the log was compacted at
    // start, and another crash and restart still has everything.
    let (_copy2, broker) = restart_copy(copy.path(), |_| {});
    let mut c = Conn::new(broker.endpoints[0]);
    let (got, _) = c.read_all(name, 0);
    assert!(got == [&a[..], &b[..], b"after"].concat());
}

#[test]
fn an_answered_append_is_readable_at_once() {
    // Small appends are answered when their commit record is written,
    // before their spool write completes; a non-blocking read sent right
    // after the answer, on another connection, still gets the bytes.
    let dir = tempfile::tempdir().unwrap();
    let broker = start(dir.path(), 1);
    let name = "smoke/read-after-answer";
    let mut writer = Conn::new(broker.endpoints[0]);
    let mut reader = Conn::new(broker.endpoints[0]);
    writer.apply(&[JournalSpec::new(name)]);
    for i in 0..500u32 {
        let bytes: Vec<u8> = (0..64 + i % 100).map(|k| (k * 31 + i) as u8).collect();
        let reply = writer.append_ok(name, &bytes);
        let (got, status) = reader.read_all(name, reply.begin);
        assert_eq!(status, Status::OK, "append {i}");
        assert!(got == bytes, "append {i}: read {} bytes", got.len());
        // At the new head there is nothing yet, and the write head in the
        // answer (READ_DONE meta: offset, write_head) counts the append;
        // so does the head a metadata-only read resolves.
        for (offset, flags, status) in [
            (Some(reply.end), 0, Status::OFFSET_NOT_YET_AVAILABLE),
            // At the head: not yet available, with the head.
            (None, flag::METADATA_ONLY, Status::OFFSET_NOT_YET_AVAILABLE),
        ] {
            let read = rotary_net::wire::ReadRequest {
                journal: name.into(),
                offset,
                end_offset: None,
                route_revision: 0,
            };
            reader.send(Op::READ, flags, 7, &read.encode(), &[]);
            let done = reader.recv();
            assert_eq!((done.op, done.known_status()), (Op::READ_DONE, status));
            let head = u64::from_le_bytes(done.meta[8..16].try_into().unwrap());
            assert_eq!(head, reply.end, "append {i}: write head of {offset:?}");
        }
    }
}

#[test]
fn a_commit_record_whose_spool_bytes_never_landed_is_passed_over() {
    // A batch's spool bytes and its commit-log record are written at the
    // same time, so a crash can leave the record on disk without the bytes.
    // Recovery must then fall back to the record before it: the batch was
    // never acknowledged. (B is too large for its record to carry it; see
    // the next test for a batch that is carried.)
    let dir = tempfile::tempdir().unwrap();
    let name = "smoke/torn-batch";
    let a: Vec<u8> = (0..5000u32).map(|i| (i * 7) as u8).collect();
    let b = vec![0xabu8; 40_000];
    append_owned_pair(dir.path(), name, &a, &b);
    // Intact files: both appends are there.
    let (_copy, broker) = restart_copy(dir.path(), |_| {});
    let mut c = Conn::new(broker.endpoints[0]);
    let (got, _) = c.read_all(name, 0);
    assert!(got == [a.clone(), b.clone()].concat());
    assert_eq!(registers_of(&mut c, name), "owner=b");
    drop(c);
    drop(broker);

    // B's bytes never reached the spool (what was there before: zeros).
    let (copy, broker) = restart_copy(dir.path(), |data| {
        let path = spool_path(data, name);
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[a.len()..a.len() + b.len()].fill(0);
        std::fs::write(&path, &bytes).unwrap();
    });
    let mut c = Conn::new(broker.endpoints[0]);
    let got = c.read_ok(name, 0);
    assert!(
        got == a,
        "read {} bytes, want the first append's {}",
        got.len(),
        a.len()
    );
    assert_eq!(registers_of(&mut c, name), "owner=a");
    let (status, reply) = c.append(&req(name), b"after");
    assert_eq!((status, reply.begin), (Status::OK, a.len() as u64));
    std::mem::forget(broker);
    // The choice was written down: a further crash and restart keeps it.
    let (_copy2, broker) = restart_copy(copy.path(), |_| {});
    let mut c = Conn::new(broker.endpoints[0]);
    let (got, _) = c.read_all(name, 0);
    assert!(got == [&a[..], b"after"].concat());
    assert_eq!(registers_of(&mut c, name), "owner=a");
    drop(c);
    drop(broker);

    // Neither of the last two records matches the spool: the broker
    // refuses to start rather than serve bytes the log does not vouch for.
    let copy = crash_image(dir.path());
    let path = spool_path(copy.path(), name);
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[0] ^= 1;
    std::fs::write(&path, &bytes).unwrap();
    let mut cfg =
        rotary_engine::ServeConfig::new(copy.path().to_path_buf(), "127.0.0.1:0".parse().unwrap());
    cfg.cores = 1;
    cfg.disk_reserve_bytes = 0;
    let err = rotary_engine::Broker::start(cfg)
        .err()
        .expect("a corrupt spool stops the start");
    assert!(err.to_string().contains("matches neither"), "{err}");
}

/// Deleting a journal moves its files aside and removes them off the
/// shard's thread; its name can be used again at once, with nothing of the
/// old journal in it.
#[test]
fn a_deleted_journal_leaves_the_disk_and_its_name_is_free_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let broker = start(dir.path(), 1);
    let mut c = Conn::new(broker.endpoints[0]);
    let name = "smoke/deleted";
    let mut spec = JournalSpec::new(name);
    spec.fragment.length = 4096;
    c.apply(std::slice::from_ref(&spec));
    for _ in 0..3 {
        assert_eq!(c.append(&req(name), &[b'a'; 3000]).0, Status::OK);
    }
    let shard = dir.path().join("shard-0");
    let jdir = shard.join("journals").join(name).join("@");
    let names = |d: &std::path::Path| -> Vec<String> {
        let mut v: Vec<String> = std::fs::read_dir(d)
            .map(|r| {
                r.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                    .collect()
            })
            .unwrap_or_default();
        v.sort();
        v
    };
    assert!(
        names(&jdir).iter().any(|n| n.ends_with(".raw")),
        "{:?}",
        names(&jdir)
    );

    assert_eq!(c.delete(name), Status::OK);
    c.apply(std::slice::from_ref(&spec));
    let reply = c.append_ok(name, b"again");
    assert_eq!(reply.begin, 0);
    let (got, _) = c.read_all(name, 0);
    assert_eq!(got, b"again");

    rotary_engine::reaper::flush();
    assert!(
        !names(&shard).iter().any(|n| n.starts_with("deleted-")),
        "{:?}",
        names(&shard)
    );
    // Only the new journal's spool is left.
    let left = names(&jdir);
    assert_eq!(left.len(), 1, "{left:?}");
    assert!(left[0].ends_with(".spool"), "{left:?}");
}

#[test]
fn the_commit_log_compacts_between_turns_and_recovers_after_a_crash() {
    let dir = tempfile::tempdir().unwrap();
    let names = ["smoke/compact-a", "smoke/compact-b", "smoke/compact-c"];
    let mut expected: Vec<Vec<u8>> = vec![Vec::new(); names.len()];
    let log = dir.path().join("shard-0/commit.log");
    let mut sizes = Vec::new();
    {
        let mut cfg = ServeConfig::new(dir.path().to_path_buf(), "127.0.0.1:0".parse().unwrap());
        cfg.cores = 1;
        cfg.disk_reserve_bytes = 0;
        // A few dozen records per log: it is rewritten many times below.
        cfg.commit_log_compact_bytes = 4 << 10;
        let broker = rotary_engine::Broker::start(cfg).unwrap();
        let mut c = Conn::new(broker.endpoints[0]);
        let specs: Vec<JournalSpec> = names.iter().map(|n| JournalSpec::new(*n)).collect();
        c.apply(&specs);
        for i in 0..600u32 {
            let j = i as usize % names.len();
            let mut r = req(names[j]);
            let seq = |i: u32| LabelSet::from_pairs([("seq", i.to_string())]).unwrap();
            r.union_registers = seq(i);
            if i >= names.len() as u32 {
                r.subtract_registers = seq(i - names.len() as u32);
            }
            let content = format!("append {i} to {}\n", names[j]).into_bytes();
            let (status, reply) = c.append(&r, &content);
            assert_eq!(status, Status::OK);
            assert_eq!(reply.begin, expected[j].len() as u64);
            expected[j].extend_from_slice(&content);
            sizes.push(std::fs::metadata(&log).unwrap().len());
        }
        std::mem::forget(broker);
    }
    // Over 600 records of ~70 bytes, and the log was compacted again and
    // again (each time after a snapshot synced in the background, so how
    // far past the threshold it grew meanwhile depends on the disk).
    assert!(
        sizes.windows(2).filter(|w| w[1] < w[0]).count() >= 5,
        "fewer than 5 compactions: {sizes:?}"
    );
    let (_copy, broker) = restart_copy(dir.path(), |_| {});
    let mut c = Conn::new(broker.endpoints[0]);
    for (j, name) in names.iter().enumerate() {
        let got = c.read_ok(name, 0);
        assert!(got == expected[j], "{name} differs after recovery");
    }
    // The registers of each journal's last append were recovered too.
    let last = |j: usize| {
        (0..600u32)
            .filter(|i| *i as usize % names.len() == j)
            .max()
            .unwrap()
    };
    for (j, name) in names.iter().enumerate() {
        assert_eq!(registers_of(&mut c, name), format!("seq={}", last(j)));
    }
}

#[test]
fn the_next_batch_is_staged_while_the_last_is_written() {
    // Two connections pipeline appends of up to 900 KiB to one journal:
    // bytes keep arriving while the shard writes a batch, and are staged
    // into the spool's second buffer meanwhile. Every append must commit
    // whole, once, in one total order, with its own SHA-1, and read back
    // (and survive a crash) byte for byte.
    let dir = tempfile::tempdir().unwrap();
    let name = "smoke/overlap";
    let mut next = common::xorshift(0x9e37_79b9_7f4a_7c15u64);
    let broker = start(dir.path(), 1);
    let mut admin = Conn::new(broker.endpoints[0]);
    let mut spec = JournalSpec::new(name);
    // Seals at least once along the way.
    spec.fragment.length = 24 << 20;
    admin.apply(&[spec]);
    let mut conns: Vec<Conn> = (0..2).map(|_| Conn::new(broker.endpoints[0])).collect();
    let mut sent = std::collections::HashMap::new();
    for id in 0..40u64 {
        for (k, c) in conns.iter_mut().enumerate() {
            let len = (next() % (900 << 10)) as usize + 1;
            let seed = next() as u8;
            let content: Vec<u8> = (0..len)
                .map(|i| (i as u8).wrapping_mul(31) ^ seed)
                .collect();
            c.send(Op::APPEND, 0, id, &req(name).encode(), &content);
            sent.insert((k, id), content);
        }
    }
    let mut committed = Vec::new();
    for (k, c) in conns.iter_mut().enumerate() {
        for _ in 0..40 {
            let r = c.recv();
            assert_eq!((r.op, r.known_status()), (Op::APPEND_REPLY, Status::OK));
            let reply = AppendReply::decode(&r.meta).unwrap();
            let content = sent.remove(&(k, r.id)).expect("one reply per append");
            assert_eq!(reply.end - reply.begin, content.len() as u64);
            assert_eq!(reply.sha1, <[u8; 20]>::from(Sha1::digest(&content)));
            committed.push((reply.begin, content));
        }
    }
    assert!(sent.is_empty());
    committed.sort_by_key(|(begin, _)| *begin);
    let mut expected = Vec::new();
    for (begin, content) in &committed {
        assert_eq!(*begin, expected.len() as u64, "appends are contiguous");
        expected.extend_from_slice(content);
    }
    let got = admin.read_ok(name, 0);
    assert!(got == expected, "read back differs");
    admin.send(Op::STATS, 0, 5, &[], &[]);
    let stats: serde_json::Value = serde_json::from_slice(&admin.recv().payload).unwrap();
    assert!(stats["prestaged_bytes"].as_u64().unwrap() > 0, "{stats}");
    // A crash now: every acknowledged byte is there after recovery.
    std::mem::forget(broker);
    let (_copy, broker) = restart_copy(dir.path(), |_| {});
    let mut c = Conn::new(broker.endpoints[0]);
    let got = c.read_ok(name, 0);
    assert!(got == expected, "recovered bytes differ");
}
