//! End-to-end: messages on journals against real brokers.
//!
//! - Four publishers write transactions spanning three journals of a
//!   three-broker cluster (replication 3) while one broker is SIGKILLed and
//!   started again; they retry the appends whose outcome the kill left
//!   unknown. A read-committed reader yields every committed message exactly
//!   once and none of a rolled-back transaction, also when it stops at a
//!   checkpoint and a new reader with a tiny ring (so committed spans leave
//!   it and are replayed from the journals) continues from there. A
//!   read-uncommitted reader sees every message written, duplicates
//!   included.
//! - Journals written byte by byte in Gazette's framings, built here from
//!   the formats' definitions (not with the library's encoder), read back
//!   message for message; a damaged frame in the middle is skipped and
//!   counted.
//! - `rotary publish` and `rotary consume` from the shell.
#![allow(clippy::disallowed_methods)] // Tests time real servers and processes.

mod common;

use common::cluster::Cluster;
use common::*;
use rotary_net::client::Client;
use rotary_net::message::MessageError;
use rotary_net::message::{
    Checkpoint, Envelope, Framing, Publisher, PublisherOptions, ReadMode, Reader, ReaderOptions,
};
use rotary_net::spec::{Codec, JournalFlags, JournalSpec, LabelSet};
use rotary_net::status::Status;
use rotary_net::wire::AppendRequest;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::Write as _;
use std::process::Stdio;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

const JOURNALS: [&str; 3] = ["msg/a", "msg/b", "msg/c"];
const PUBLISHERS: u64 = 4;
const MESSAGES_PER_PUBLISHER: u64 = 10_000;
/// Messages per transaction, spread over the three journals in turn.
const TXN_MESSAGES: u64 = 10;
/// Every tenth transaction (those with `t % 10 == ROLLBACK_EVERY_AT`) is
/// appended, then rolled back.
const ROLLBACK_AT: u64 = 7;
/// Long enough to cover a broker's restart.
const RETRY_FOR: Duration = Duration::from_secs(60);
const TEST_LIMIT: Duration = Duration::from_secs(600);

fn spec(name: &str, replication: u32, content_type: &str) -> JournalSpec {
    let mut s = JournalSpec::new(name);
    s.replication = replication;
    s.labels = LabelSet::from_pairs([("content-type", content_type)]).expect("labels");
    s.fragment.length = 1 << 20;
    s.fragment.compression_codec = Codec::None;
    s
}

/// `(publisher, transaction, index)` of a test message.
type Id = (u64, u64, u64);

fn id_of(env: &Envelope) -> Id {
    let doc: serde_json::Value = serde_json::from_slice(&env.message).expect("JSON message");
    let f = |k: &str| doc[k].as_u64().unwrap_or_else(|| panic!("{k} in {doc}"));
    (f("p"), f("t"), f("k"))
}

struct Published {
    committed: BTreeSet<Id>,
    rolled_back: BTreeSet<Id>,
    retries_unknown: u64,
}

async fn publish(client: Client, p: u64, progress: Arc<AtomicU64>) -> Published {
    let options = PublisherOptions {
        retry_for: RETRY_FOR,
        ..PublisherOptions::default()
    };
    let mut publisher = Publisher::new(client, options);
    let mut out = Published {
        committed: BTreeSet::new(),
        rolled_back: BTreeSet::new(),
        retries_unknown: 0,
    };
    for t in 0..MESSAGES_PER_PUBLISHER / TXN_MESSAGES {
        let mut ids = Vec::new();
        for k in 0..TXN_MESSAGES {
            let journal = JOURNALS[(k % 3) as usize];
            let payload = serde_json::json!({ "p": p, "t": t, "k": k, "pad": "x".repeat(64) });
            publisher
                .publish_uncommitted(journal, payload.to_string().as_bytes())
                .await
                .unwrap_or_else(|e| panic!("publisher {p} txn {t}: {e}"));
            ids.push((p, t, k));
        }
        if t % 10 == ROLLBACK_AT {
            // Let the messages reach the journals first, so that there is
            // something for readers to discard.
            publisher
                .flush()
                .await
                .unwrap_or_else(|e| panic!("publisher {p} txn {t} flush: {e}"));
            publisher
                .rollback()
                .await
                .unwrap_or_else(|e| panic!("publisher {p} txn {t} rollback: {e}"));
            out.rolled_back.extend(ids);
        } else {
            publisher
                .commit()
                .await
                .unwrap_or_else(|e| panic!("publisher {p} txn {t} commit: {e}"));
            out.committed.extend(ids);
        }
        progress.fetch_add(1, Ordering::Relaxed);
    }
    out.retries_unknown = publisher.stats().retries_unknown.load(Ordering::Relaxed);
    out
}

/// Reads every journal to its head; stops early after `stop_after`
/// non-acknowledgement messages, returning the reader's checkpoint.
async fn read_messages(
    client: Client,
    options: ReaderOptions,
    stop_after: Option<usize>,
) -> (Vec<Envelope>, Checkpoint) {
    let names: Vec<String> = JOURNALS.iter().map(|s| s.to_string()).collect();
    let mut reader = Reader::open(client, &names, options).await.expect("reader");
    let mut got = Vec::new();
    while let Some(env) = reader.next().await {
        let env = env.expect("read");
        if !env.is_ack() {
            got.push(env);
        }
        if Some(got.len()) == stop_after {
            break;
        }
    }
    for j in JOURNALS {
        assert_eq!(reader.skipped_bytes(j), 0, "{j}: damaged frames");
    }
    (got, reader.checkpoint())
}

/// Each committed message exactly once, none rolled back, and each
/// producer's messages in clock order per journal.
fn check_committed(what: &str, got: &[Envelope], published: &Published) {
    let mut counts: BTreeMap<Id, u32> = BTreeMap::new();
    let mut last_clock = HashMap::new();
    for env in got {
        let id = id_of(env);
        assert!(
            !published.rolled_back.contains(&id),
            "{what}: rolled-back message {id:?} delivered"
        );
        *counts.entry(id).or_default() += 1;
        let key = (env.journal.clone(), env.producer());
        if let Some(prev) = last_clock.insert(key, env.clock()) {
            assert!(prev < env.clock(), "{what}: {id:?} out of clock order");
        }
    }
    let twice: Vec<_> = counts.iter().filter(|(_, &n)| n > 1).take(5).collect();
    assert!(
        twice.is_empty(),
        "{what}: delivered more than once: {twice:?}"
    );
    let delivered: BTreeSet<Id> = counts.into_keys().collect();
    let missing: Vec<_> = published.committed.difference(&delivered).take(5).collect();
    assert!(
        missing.is_empty(),
        "{what}: committed but not delivered: {missing:?}"
    );
    assert_eq!(delivered, published.committed, "{what}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transactions_survive_a_broker_kill_exactly_once() {
    let mut cluster = Cluster::start(3, 1);
    let done = tokio::time::timeout(TEST_LIMIT, transactions_body(&mut cluster)).await;
    cluster.finished(done, TEST_LIMIT);
}

async fn transactions_body(cluster: &mut Cluster) {
    let specs: Vec<JournalSpec> = JOURNALS
        .iter()
        .map(|j| spec(j, 3, "application/x-ndjson"))
        .collect();
    cluster.apply(&specs).await;
    // Kill the primary of the first journal (a replica of the others);
    // clients bootstrap at another broker.
    let route = cluster.brokers[0]
        .client()
        .await
        .route(JOURNALS[0])
        .await
        .expect("route");
    let victim = cluster.index(&route.members[0].id);
    let boot = (victim + 1) % cluster.brokers.len();

    let started = std::time::Instant::now();
    let progress = Arc::new(AtomicU64::new(0));
    let mut tasks = Vec::new();
    for p in 0..PUBLISHERS {
        let client = cluster.brokers[boot].client().await;
        tasks.push(tokio::spawn(publish(client, p, progress.clone())));
    }
    let txns_total = PUBLISHERS * MESSAGES_PER_PUBLISHER / TXN_MESSAGES;
    while progress.load(Ordering::Relaxed) < txns_total / 4 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    eprintln!(
        "killing {} after {} transactions",
        cluster.brokers[victim].id,
        progress.load(Ordering::Relaxed)
    );
    tokio::task::block_in_place(|| cluster.brokers[victim].kill9());
    tokio::time::sleep(Duration::from_secs(2)).await;
    tokio::task::block_in_place(|| cluster.brokers[victim].start());
    eprintln!(
        "{} restarted after {} transactions",
        cluster.brokers[victim].id,
        progress.load(Ordering::Relaxed)
    );

    let mut published = Published {
        committed: BTreeSet::new(),
        rolled_back: BTreeSet::new(),
        retries_unknown: 0,
    };
    for t in tasks {
        let p = t.await.expect("publisher task");
        published.committed.extend(p.committed);
        published.rolled_back.extend(p.rolled_back);
        published.retries_unknown += p.retries_unknown;
    }
    eprintln!(
        "published in {:?}: {} committed, {} rolled back, {} appends retried with unknown outcome",
        started.elapsed(),
        published.committed.len(),
        published.rolled_back.len(),
        published.retries_unknown
    );
    assert_eq!(
        (published.committed.len() + published.rolled_back.len()) as u64,
        PUBLISHERS * MESSAGES_PER_PUBLISHER
    );

    let client = cluster.brokers[boot].client().await;
    let (all, _) = read_messages(client.clone(), ReaderOptions::default(), None).await;
    check_committed("read committed", &all, &published);

    // Stop halfway, then continue from the checkpoint with a ring of 4:
    // most committed spans have left it by their acknowledgement and are
    // replayed from the journal.
    let half = published.committed.len() / 2;
    let small_ring = ReaderOptions {
        ring_len: 4,
        ..ReaderOptions::default()
    };
    let (first, cp) = read_messages(client.clone(), small_ring.clone(), Some(half)).await;
    let cp: Checkpoint =
        serde_json::from_str(&serde_json::to_string(&cp).expect("checkpoint JSON")).expect("JSON");
    let resumed = ReaderOptions {
        checkpoint: Some(cp),
        ..small_ring
    };
    let (rest, _) = read_messages(client.clone(), resumed, None).await;
    assert_eq!(first.len(), half);
    let both: Vec<Envelope> = first.into_iter().chain(rest).collect();
    check_committed("checkpoint and resume", &both, &published);

    let uncommitted = ReaderOptions {
        mode: ReadMode::Uncommitted,
        ..ReaderOptions::default()
    };
    let (raw, _) = read_messages(client, uncommitted, None).await;
    let distinct: BTreeSet<_> = raw.iter().map(|e| e.uuid).collect();
    let ids: BTreeSet<Id> = raw.iter().map(id_of).collect();
    let written: BTreeSet<Id> = published
        .committed
        .union(&published.rolled_back)
        .copied()
        .collect();
    assert_eq!(
        ids, written,
        "read uncommitted: every message written, rolled back too"
    );
    let duplicates = raw.len() - distinct.len();
    eprintln!(
        "read uncommitted: {} messages, {} distinct, {duplicates} duplicate copies written by retries",
        raw.len(),
        distinct.len()
    );
    assert_eq!(distinct.len(), written.len(), "one UUID per message");
    // A copy can only come from an append sent again after its outcome was unknown.
    assert!(
        duplicates == 0 || published.retries_unknown > 0,
        "{duplicates} duplicates without a retried append"
    );
}

// ---------------------------------------------------------------------------
// Gazette's formats, from their definitions.

/// A message UUID per RFC 4122 v1 as Gazette lays it out: the 60-bit
/// timestamp (clock >> 4) split low/mid/high with version 1, then variant
/// 0b10, the 4-bit counter (clock & 0xf) and 10 flag bits, then the node.
fn gazette_uuid(node: [u8; 6], clock: u64, flags: u16) -> [u8; 16] {
    let ts = clock >> 4;
    let mut u = [0u8; 16];
    u[0..4].copy_from_slice(&(ts as u32).to_be_bytes());
    u[4..6].copy_from_slice(&((ts >> 32) as u16).to_be_bytes());
    u[6..8].copy_from_slice(&((((ts >> 48) as u16) & 0x0fff) | 0x1000).to_be_bytes());
    let seq = 0x8000 | (((clock & 0xf) as u16) << 10) | flags;
    u[8..10].copy_from_slice(&seq.to_be_bytes());
    u[10..16].copy_from_slice(&node);
    u
}

fn uuid_text(u: &[u8; 16]) -> String {
    let h = hex::encode(u);
    format!(
        "{}-{}-{}-{}-{}",
        &h[..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..]
    )
}

/// Gazette's fixed frame: word 66 33 93 36, little-endian u32 length, then
/// the message: here protobuf `{ bytes uuid = 1; bytes content = 2; }`.
fn fixed_frame(uuid: &[u8; 16], content: &[u8]) -> Vec<u8> {
    let mut body = vec![0x0a, 16];
    body.extend_from_slice(uuid);
    if !content.is_empty() {
        assert!(content.len() < 128, "one-byte varint length");
        body.extend_from_slice(&[0x12, content.len() as u8]);
        body.extend_from_slice(content);
    }
    let mut f = vec![0x66, 0x33, 0x93, 0x36];
    f.extend_from_slice(&(body.len() as u32).to_le_bytes());
    f.extend_from_slice(&body);
    f
}

fn json_line(uuid: &[u8; 16], n: Option<u64>) -> Vec<u8> {
    let mut line = format!("{{\"_meta\":{{\"uuid\":\"{}\"}}", uuid_text(uuid));
    if let Some(n) = n {
        line.push_str(&format!(",\"n\":{n}"));
    }
    line.push_str("}\n");
    line.into_bytes()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gazette_framed_journals_read_back_message_for_message() {
    let broker = Broker::start_with_cores(1);
    let client = broker.client().await;
    client
        .apply(&[
            spec("gz/json", 1, "application/x-ndjson"),
            spec("gz/fixed", 1, "application/x-protobuf-fixed"),
        ])
        .await
        .expect("apply");
    let x = [0x01, 0xaa, 0xbb, 0xcc, 0xdd, 0xee];
    let y = [0x03, 0x11, 0x22, 0x33, 0x44, 0x55];
    let base: u64 = 0x1ef_0000_0000_0000 << 4;
    // X: 1 outside, 2 and 3 continuing (3 twice: a retried append), then
    // its ack at 4; Y: 10 continuing, rolled back by an ack at 9; X: 5
    // outside, at a clock whose counter is at its top (0xf).
    let msgs: Vec<([u8; 6], u64, u16, u64)> = vec![
        (x, base + 1, 0, 1),
        (x, base + 2, 1, 2),
        (y, base + 10, 1, 10),
        (x, base + 3, 1, 3),
        (x, base + 3, 1, 3),
        (y, base + 9, 2, 0),
        (x, base + 4, 2, 0),
        (x, base + 0xf, 0, 5),
    ];
    let garbage: &[&[u8]] = &[b"{\"torn\":\n", b"\x66\x33\x93\x36\xff\xff\xff\x7f"];
    for (journal, fixed) in [("gz/json", false), ("gz/fixed", true)] {
        let mut bytes = Vec::new();
        // What the reader's envelopes carry, per frame: the JSON document
        // (its line without the newline) or the fixed frame's content.
        let mut carried: Vec<Vec<u8>> = Vec::new();
        for (i, (node, clock, flags, n)) in msgs.iter().enumerate() {
            let u = gazette_uuid(*node, *clock, *flags);
            let content = (*n > 0).then(|| format!("m{n}"));
            let frame = if fixed {
                fixed_frame(&u, content.as_deref().unwrap_or("").as_bytes())
            } else {
                json_line(&u, (*n > 0).then_some(*n))
            };
            // The library frames the same message to the same bytes.
            let framing = if fixed {
                Framing::Fixed
            } else {
                Framing::json()
            };
            let mut ours = Vec::new();
            let uuid = rotary_net::message::Uuid(u);
            match (*n > 0, fixed) {
                (true, true) => framing
                    .encode(uuid, content.as_deref().unwrap().as_bytes(), &mut ours)
                    .unwrap(),
                (true, false) => framing
                    .encode(uuid, format!("{{\"n\":{n}}}").as_bytes(), &mut ours)
                    .unwrap(),
                (false, _) => framing.encode_ack(uuid, &mut ours),
            }
            assert_eq!(ours, frame, "{journal} message {i}");
            carried.push(if fixed {
                content.unwrap_or_default().into_bytes()
            } else {
                frame[..frame.len() - 1].to_vec()
            });
            bytes.extend_from_slice(&frame);
            if i == 3 {
                // Damage in the middle of the journal.
                bytes.extend_from_slice(garbage[usize::from(fixed)]);
            }
        }
        let req = AppendRequest {
            journal: journal.to_string(),
            ..AppendRequest::default()
        };
        client.append(&req, bytes.clone()).await.expect("append");

        let names = vec![journal.to_string()];
        let mut reader = Reader::open(client.clone(), &names, ReaderOptions::default())
            .await
            .expect("reader");
        let mut got = Vec::new();
        while let Some(env) = reader.next().await {
            let env = env.expect("read");
            got.push((
                env.producer().0,
                env.clock().0 - base,
                env.flags().0,
                env.message.to_vec(),
            ));
        }
        let want = vec![
            (x, 1, 0, carried[0].clone()),
            (x, 2, 1, carried[1].clone()),
            (x, 3, 1, carried[3].clone()),
            (x, 4, 2, carried[6].clone()),
            (x, 0xf, 0, carried[7].clone()),
        ];
        assert_eq!(got, want, "{journal}");
        assert_eq!(
            reader.skipped_bytes(journal),
            garbage[usize::from(fixed)].len() as u64,
            "{journal}: damaged bytes skipped"
        );
        let cp = reader.checkpoint();
        assert_eq!(cp.offsets.get(journal), Some(&(bytes.len() as u64)));

        // Read uncommitted: every whole frame, the duplicate and Y's too.
        let options = ReaderOptions {
            mode: ReadMode::Uncommitted,
            ..ReaderOptions::default()
        };
        let mut reader = Reader::open(client.clone(), &names, options)
            .await
            .expect("reader");
        let mut clocks = Vec::new();
        while let Some(env) = reader.next().await {
            clocks.push(env.expect("read").clock().0 - base);
        }
        assert_eq!(clocks, vec![1, 2, 10, 3, 3, 9, 4, 0xf], "{journal}");
    }
}

// ---------------------------------------------------------------------------
// The CLI.

fn run_cli(broker: &Broker, args: &[&str], stdin: &str) -> (i32, String, String) {
    let mut child = broker
        .cli(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn rotary");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(stdin.as_bytes())
        .expect("write stdin");
    let out = child.wait_with_output().expect("rotary output");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A publisher that gives up on a failing append after 5 s.
fn quick_publisher(client: &Client) -> Publisher {
    let options = PublisherOptions {
        retry_for: Duration::from_secs(5),
        ..PublisherOptions::default()
    };
    Publisher::new(client.clone(), options)
}

/// The `n` of every message read committed from `journals`, per journal,
/// in the order read.
async fn read_ns(client: Client, journals: &[&str]) -> BTreeMap<String, Vec<u64>> {
    let names: Vec<String> = journals.iter().map(|j| j.to_string()).collect();
    let mut reader = Reader::open(client, &names, ReaderOptions::default())
        .await
        .expect("reader");
    let mut got: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    while let Some(env) = reader.next().await {
        let env = env.expect("read");
        if !env.is_ack() {
            let doc: serde_json::Value = serde_json::from_slice(&env.message).expect("JSON");
            let n = doc["n"].as_u64().expect("n");
            got.entry(env.journal.to_string()).or_default().push(n);
        }
    }
    got
}

/// An append refused for good (its journal made read-only) fails the
/// commit and holds that journal: a later commit is refused there and
/// appends nothing, until a rollback. The other journal's part of the
/// failed transaction committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_commit_holds_its_journal_until_a_rollback() {
    let broker = Broker::start_with_cores(1);
    let client = broker.client().await;
    let (a, b) = ("hold/a", "hold/b");
    let specs = |flags| {
        let mut held = spec(a, 1, "application/x-ndjson");
        held.flags = flags;
        vec![held, spec(b, 1, "application/x-ndjson")]
    };
    client
        .apply(&specs(JournalFlags::ReadWrite))
        .await
        .expect("apply");
    let mut p = quick_publisher(&client);
    let msg = |n: u64| serde_json::json!({ "n": n }).to_string();
    p.publish_uncommitted(a, msg(1).as_bytes()).await.unwrap();
    p.publish_uncommitted(b, msg(2).as_bytes()).await.unwrap();
    p.commit().await.expect("first commit");
    let a_head = write_head(&client, a).await;

    client
        .apply(&specs(JournalFlags::ReadOnly))
        .await
        .expect("apply");
    p.publish_uncommitted(a, msg(3).as_bytes()).await.unwrap();
    p.publish_uncommitted(b, msg(4).as_bytes()).await.unwrap();
    match p.commit().await {
        Err(MessageError::Append {
            journal,
            status,
            retryable,
            ..
        }) => assert_eq!(
            (journal.as_str(), status, retryable),
            (a, Some(Status::NOT_ALLOWED), false)
        ),
        other => panic!("commit to a read-only journal: {other:?}"),
    }

    client
        .apply(&specs(JournalFlags::ReadWrite))
        .await
        .expect("apply");
    p.publish_uncommitted(a, msg(5).as_bytes()).await.unwrap();
    let held = p.commit().await;
    assert!(
        matches!(&held, Err(MessageError::Append { journal, .. }) if journal == a),
        "held until a rollback: {held:?}"
    );
    assert_eq!(
        write_head(&client, a).await,
        a_head,
        "nothing appended while held"
    );
    p.rollback().await.expect("rollback");
    p.publish_uncommitted(a, msg(6).as_bytes()).await.unwrap();
    p.commit().await.expect("commit after the rollback");

    let got = read_ns(client, &[a, b]).await;
    assert_eq!(got[a], vec![1, 6], "{got:?}");
    assert_eq!(got[b], vec![2, 4], "{got:?}");
}

/// Outside a transaction, a flush names every journal whose append
/// failed; each stays held (its later messages are not appended) until the
/// application resets it, which drops what of it was not appended. A
/// journal of the open transaction is not reset, only rolled back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_journal_outside_a_transaction_is_named_and_reset() {
    let broker = Broker::start_with_cores(1);
    let client = broker.client().await;
    let (a, b, c) = ("reset/a", "reset/b", "reset/c");
    let specs = |flags| {
        let mut v = Vec::new();
        for name in [a, b] {
            let mut s = spec(name, 1, "application/x-ndjson");
            s.flags = flags;
            v.push(s);
        }
        v.push(spec(c, 1, "application/x-ndjson"));
        v
    };
    client
        .apply(&specs(JournalFlags::ReadOnly))
        .await
        .expect("apply");
    let mut p = quick_publisher(&client);
    let msg = |n: u64| serde_json::json!({ "n": n }).to_string();
    p.publish_committed(a, msg(1).as_bytes()).await.unwrap();
    p.publish_committed(b, msg(2).as_bytes()).await.unwrap();
    p.publish_committed(c, msg(3).as_bytes()).await.unwrap();
    let err = p.flush().await.expect_err("two read-only journals");
    assert!(matches!(err, MessageError::Journals(_)), "{err:?}");
    let mut named = err.failed_journals();
    named.sort_unstable();
    assert_eq!(named, [a, b], "{err}");
    assert!(!err.is_retryable());

    // Writable again, they stay held until reset.
    client
        .apply(&specs(JournalFlags::ReadWrite))
        .await
        .expect("apply");
    p.publish_committed(a, msg(4).as_bytes()).await.unwrap();
    let held = p.flush().await.expect_err("still held");
    let mut named = held.failed_journals();
    named.sort_unstable();
    assert_eq!(named, [a, b], "{held}");
    p.reset(a).await.expect("reset a");
    p.publish_committed(a, msg(5).as_bytes()).await.unwrap();
    let held = p.flush().await.expect_err("b still held");
    assert_eq!(held.failed_journals(), [b], "{held}");
    p.reset(b).await.expect("reset b");
    p.publish_committed(b, msg(6).as_bytes()).await.unwrap();
    p.flush().await.expect("both reset");

    // A journal of the open transaction is rolled back, not reset.
    p.publish_uncommitted(c, msg(7).as_bytes()).await.unwrap();
    let refused = p.reset(c).await.expect_err("in the transaction");
    assert_eq!(refused.failed_journals(), [c], "{refused}");
    p.rollback().await.expect("rollback");

    let got = read_ns(client, &[a, b, c]).await;
    assert_eq!(got.get(a), Some(&vec![5]), "{got:?}");
    assert_eq!(got.get(b), Some(&vec![6]), "{got:?}");
    assert_eq!(got.get(c), Some(&vec![3]), "{got:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publish_and_consume_from_the_shell() {
    let broker = Broker::start_with_cores(1);
    let client = broker.client().await;
    client
        .apply(&[
            spec("cli/a", 1, "application/x-ndjson"),
            spec("cli/b", 1, "application/x-protobuf-fixed"),
            JournalSpec::new("cli/plain"),
        ])
        .await
        .expect("apply");
    let (code, out, err) = run_cli(
        &broker,
        &["publish", "cli/a", "cli/b"],
        "{\"n\":1}\n{\"n\":2}\n\n{\"n\":3}\n",
    );
    assert_eq!(code, 0, "{err}");
    let summary: serde_json::Value = serde_json::from_str(out.trim()).expect("summary JSON");
    assert_eq!(summary["messages"], 3);
    let (code, _, err) = run_cli(
        &broker,
        &["publish", "--txn", "cli/a", "cli/b"],
        "{\"n\":4}\n{\"n\":5}\n",
    );
    assert_eq!(code, 0, "{err}");
    // A bad line rolls the whole transaction back.
    let (code, _, err) = run_cli(&broker, &["publish", "--txn", "cli/a"], "{\"n\":6}\n[7]\n");
    assert_eq!(code, 2, "{err}");
    assert!(err.starts_with("error: BAD_REQUEST: line 2:"), "{err}");
    let (code, _, err) = run_cli(&broker, &["publish", "cli/plain"], "{}\n");
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("content-type"), "{err}");
    let (code, _, err) = run_cli(&broker, &["publish", "cli/nope"], "");
    assert_eq!(code, 1, "{err}");
    assert!(err.starts_with("error: JOURNAL_NOT_FOUND: "), "{err}");

    let ns = |out: &str, key_only: bool| -> Vec<u64> {
        out.lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).expect("a JSON line");
                if key_only {
                    assert!(v["_meta"]["uuid"].is_string(), "{l}");
                }
                v["n"].as_u64().expect("n")
            })
            .collect()
    };
    let (code, out, err) = run_cli(&broker, &["consume", "cli/a"], "");
    assert_eq!(code, 0, "{err}");
    assert_eq!(ns(&out, true), vec![1, 3, 4]);
    let (code, out, err) = run_cli(&broker, &["consume", "cli/b"], "");
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        ns(&out, false),
        vec![2, 5],
        "fixed framing prints the content"
    );
    let (code, out, err) = run_cli(&broker, &["consume", "--uncommitted", "cli/a"], "");
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        ns(&out, true),
        vec![1, 3, 4, 6],
        "the rolled-back message is in the journal"
    );
    let (code, _, err) = run_cli(&broker, &["consume", "cli/a", "--offset", "-1"], "");
    assert_eq!(code, 2, "{err}");
}
