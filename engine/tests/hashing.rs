//! Large appends whose own SHA-1 the shard's hasher thread computes: their
//! replies, their bytes, and appends rolled back while it held them.
#![warn(clippy::too_many_lines)] // Functions under 100 lines, as in the engine.

mod common;

use common::{req, Conn};
use rotary_engine::{Broker, ServeConfig};
use rotary_net::spec::JournalSpec;
use rotary_net::status::Status;
use rotary_net::wire::{flag, AppendReply, Op};
use sha1::{Digest, Sha1};
use std::collections::HashMap;

/// Content of a frame of an append: a pattern of its own.
fn content(len: usize, seed: u64) -> Vec<u8> {
    (0..len)
        .map(|i| ((i as u64).wrapping_mul(0x9e37_79b9) ^ seed) as u8)
        .collect()
}

/// Sends an append of `content` in frames of at most `frame` bytes.
fn send_append(c: &mut Conn, name: &str, id: u64, content: &[u8], frame: usize) {
    let mut parts = content.chunks(frame).peekable();
    let first = parts.next().unwrap_or(&[]);
    let more = if parts.peek().is_some() {
        flag::MORE
    } else {
        0
    };
    c.send(Op::APPEND, more, id, &req(name).encode(), first);
    while let Some(p) = parts.next() {
        let more = if parts.peek().is_some() {
            flag::MORE
        } else {
            0
        };
        c.send(Op::APPEND_CHUNK, more, id, &[], p);
    }
}

/// Starts two appends that roll back after the shard handed their hashing
/// over: one the client aborts (on the connection returned, which gets its
/// reply), one whose connection closes.
fn start_rollbacks(at: std::net::SocketAddr, name: &str) -> Conn {
    // Rolled back by the client, 1.5 MiB in.
    let mut aborting = Conn::new(at);
    send_open(&mut aborting, name, &[&[b'A'; 512 << 10], &[b'A'; 1 << 20]]);
    aborting.send(Op::APPEND_CHUNK, flag::ABORT, 1, &[], &[]);
    // Rolled back by a connection that closed, 2 MiB in.
    {
        let mut closing = Conn::new(at);
        send_open(&mut closing, name, &[&[b'C'; 1 << 20], &[b'C'; 1 << 20]]);
    }
    aborting
}

/// Sends the first `frames` of append 1 to `name`, each flagged MORE: the
/// append stays open.
fn send_open(c: &mut Conn, name: &str, frames: &[&[u8]]) {
    for (i, frame) in frames.iter().enumerate() {
        let (op, meta) = if i == 0 {
            (Op::APPEND, req(name).encode())
        } else {
            (Op::APPEND_CHUNK, Vec::new())
        };
        c.send(op, flag::MORE, 1, &meta, frame);
    }
}

/// Each connection's replies to its `appends` appends: each OK, of the
/// length and SHA-1 of what was `sent`. Answers them with their offsets.
fn replies(
    conns: &mut [Conn],
    sent: &mut HashMap<(usize, u64), Vec<u8>>,
    appends: u64,
) -> Vec<(u64, Vec<u8>)> {
    let mut committed = Vec::new();
    for (k, c) in conns.iter_mut().enumerate() {
        for _ in 0..appends {
            let r = c.recv();
            assert_eq!((r.op, r.known_status()), (Op::APPEND_REPLY, Status::OK));
            let reply = AppendReply::decode(&r.meta).unwrap();
            let bytes = sent.remove(&(k, r.id)).expect("one reply per append");
            assert_eq!(reply.end - reply.begin, bytes.len() as u64);
            assert_eq!(
                reply.sha1,
                <[u8; 20]>::from(Sha1::digest(&bytes)),
                "append {} of connection {k}",
                r.id
            );
            committed.push((reply.begin, bytes));
        }
    }
    committed
}

#[test]
fn large_appends_hashed_off_the_shard_answer_their_own_sha1() {
    // One shard, and a hasher that may fall only 256 KiB behind, so that
    // appends wait for it again and again; three connections stream
    // appends of 100 KiB to 3 MiB into one journal, in frames of up to
    // 1 MiB, while two more appends roll back after the shard has handed
    // their hashing over.
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = ServeConfig::new(dir.path().to_path_buf(), "127.0.0.1:0".parse().unwrap());
    cfg.cores = 1;
    cfg.disk_reserve_bytes = 0;
    cfg.hash_backlog_bytes = 256 << 10;
    let broker = Broker::start(cfg).unwrap();
    let name = "hashing/large";
    let mut admin = Conn::new(broker.endpoints[0]);
    let mut spec = JournalSpec::new(name);
    // Seals along the way.
    spec.fragment.length = 16 << 20;
    admin.apply(&[spec]);

    let mut next = common::xorshift(0x2545_f491_4f6c_dd1du64);
    const APPENDS: u64 = 12;
    let mut conns: Vec<Conn> = (0..3).map(|_| Conn::new(broker.endpoints[0])).collect();
    let mut sent = HashMap::new();
    for id in 0..APPENDS {
        for (k, c) in conns.iter_mut().enumerate() {
            let len = (100 << 10) + (next() % (3 << 20)) as usize;
            let frame = [64 << 10, 300 << 10, 1 << 20][(next() % 3) as usize];
            let bytes = content(len, next());
            send_append(c, name, id, &bytes, frame);
            sent.insert((k, id), bytes);
        }
    }
    let mut aborting = start_rollbacks(broker.endpoints[0], name);
    let mut committed = replies(&mut conns, &mut sent, APPENDS);
    assert!(sent.is_empty());
    let r = aborting.recv();
    assert_eq!(
        (r.op, r.known_status()),
        (Op::APPEND_REPLY, Status::CANCELLED)
    );

    // One total order, no gap, nothing of the rolled-back appends.
    committed.sort_by_key(|(begin, _)| *begin);
    let mut expected = Vec::new();
    for (begin, bytes) in &committed {
        assert_eq!(*begin, expected.len() as u64, "appends are contiguous");
        expected.extend_from_slice(bytes);
    }
    // An append after the rollbacks lands right after the others.
    let tail = content(700 << 10, 7);
    let reply = admin.append_ok(name, &tail);
    assert_eq!(reply.begin, expected.len() as u64);
    assert_eq!(reply.sha1, <[u8; 20]>::from(Sha1::digest(&tail)));
    expected.extend_from_slice(&tail);
    let got = admin.read_ok(name, 0);
    assert!(got == expected, "read back differs");

    admin.send(Op::STATS, 0, 5, &[], &[]);
    let stats: serde_json::Value = serde_json::from_slice(&admin.recv().payload).unwrap();
    // The hasher runs on the broker's other cores; a machine of one core
    // has none, and hashes every append on its shard.
    if std::thread::available_parallelism().map_or(1, |n| n.get()) > 1 {
        assert!(
            stats["hash_offloaded_bytes"].as_u64().unwrap() > 0,
            "{stats}"
        );
        assert!(stats["hash_waits"].as_u64().unwrap() > 0, "{stats}");
    } else {
        assert_eq!(stats["hash_offloaded_bytes"], 0, "{stats}");
    }
    broker.shutdown();
}
