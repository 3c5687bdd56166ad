//! End-to-end: many concurrent writers pipelining appends to one journal.
#![allow(clippy::disallowed_methods)] // Tests time real servers and processes.

mod common;

use common::*;
use rand::SeedableRng;
use rotary_net::wire::{AppendReply, AppendRequest};
use std::time::Instant;

const WRITERS: u32 = 8;
const APPENDS_PER_WRITER: u32 = 1_000;
const SIZE_MIN: usize = 1;
const SIZE_MAX: usize = 64 << 10;
const SEED: u64 = 0x5eed_0001;

/// Every writer's sizes, seeded; the first and last appends of each writer
/// hit the extremes so both are always exercised.
fn sizes(writer: u32) -> Vec<usize> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(SEED ^ u64::from(writer));
    (0..APPENDS_PER_WRITER)
        .map(|seq| match seq {
            0 => SIZE_MIN,
            s if s == APPENDS_PER_WRITER - 1 => SIZE_MAX,
            _ => log_uniform_size(&mut rng, SIZE_MIN, SIZE_MAX),
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_writers_commit_whole_contiguous_appends() {
    let broker = Broker::start();
    let client = broker.client().await;
    let j = "e2e/concurrency/one-journal";
    create_journal(&client, j, |_| {}).await;
    let total_expected: u64 = (0..WRITERS).flat_map(sizes).map(|n| n as u64).sum();

    // A tailing reader follows the writers from offset 0 to the known end.
    let tail = {
        let client = client.clone();
        tokio::spawn(async move {
            let req = rotary_net::wire::ReadRequest {
                journal: j.to_string(),
                offset: Some(0),
                end_offset: Some(total_expected),
                route_revision: 0,
            };
            let mut stream = client.read(&req, true, false).await.unwrap();
            let mut got = Vec::new();
            loop {
                match stream.next().await.expect("READ_DONE").unwrap() {
                    rotary_net::client::ReadEvent::Data { offset, content } => {
                        assert_eq!(offset, got.len() as u64, "tail offsets are contiguous");
                        got.extend_from_slice(&content);
                    }
                    rotary_net::client::ReadEvent::Done(d) => {
                        assert_eq!(
                            (d.status, d.offset),
                            (rotary_net::Status::OK, total_expected)
                        );
                        return got;
                    }
                    other => panic!("{other:?}"),
                }
            }
        })
    };
    let started = Instant::now();

    // All writers share one client, hence one connection: their appends
    // are pipelined on it.
    let mut tasks = Vec::new();
    for writer in 0..WRITERS {
        let client = client.clone();
        tasks.push(tokio::spawn(async move {
            let req = AppendRequest {
                journal: j.to_string(),
                ..Default::default()
            };
            let mut acks: Vec<(u32, usize, AppendReply)> = Vec::new();
            for (seq, len) in sizes(writer).into_iter().enumerate() {
                let content = record(writer, seq as u32, len);
                let reply = client
                    .append(&req, content)
                    .await
                    .unwrap_or_else(|e| panic!("writer {writer} append {seq}: {e}"));
                acks.push((seq as u32, len, reply));
            }
            (writer, acks)
        }));
    }
    let mut acked = Vec::new();
    for t in tasks {
        let (writer, acks) = t.await.unwrap();
        for (seq, len, reply) in acks {
            acked.push((writer, seq, len, reply));
        }
    }
    let appended_in = started.elapsed();
    assert_eq!(acked.len(), (WRITERS * APPENDS_PER_WRITER) as usize);

    // One total order: sorted by begin, back to back from 0, no overlaps.
    acked.sort_by_key(|a| a.3.begin);
    let mut at = 0u64;
    for (writer, seq, len, reply) in &acked {
        assert_eq!(
            reply.begin, at,
            "append ({writer}, {seq}) is not contiguous with the previous one"
        );
        assert_eq!(
            reply.end - reply.begin,
            *len as u64,
            "append ({writer}, {seq})"
        );
        assert!(reply.write_head >= reply.end);
        at = reply.end;
    }
    let total: u64 = acked.iter().map(|a| a.2 as u64).sum();
    assert_eq!(at, total);

    // Each writer's appends commit in the order it sent them.
    for writer in 0..WRITERS {
        let begins: Vec<u64> = acked
            .iter()
            .filter(|a| a.0 == writer)
            .map(|a| a.3.begin)
            .collect();
        let mut seqs: Vec<u32> = acked
            .iter()
            .filter(|a| a.0 == writer)
            .map(|a| a.1)
            .collect();
        assert!(begins.windows(2).all(|w| w[0] < w[1]));
        let sorted = {
            let mut s = seqs.clone();
            s.sort();
            s
        };
        assert_eq!(
            seqs, sorted,
            "writer {writer}'s appends committed out of order"
        );
        seqs.dedup();
        assert_eq!(seqs.len(), APPENDS_PER_WRITER as usize);
    }

    // The journal is exactly the acknowledged appends, each at its range,
    // each matching the SHA-1 its reply carried.
    let bytes = read_all(&client, j).await;
    assert_eq!(bytes.len() as u64, total);
    for (writer, seq, len, reply) in &acked {
        let span = &bytes[reply.begin as usize..reply.end as usize];
        assert_eq!(
            span,
            &record(*writer, *seq, *len)[..],
            "bytes of ({writer}, {seq}) at {}",
            reply.begin
        );
        assert_eq!(sha1(span), reply.sha1, "SHA-1 of ({writer}, {seq})");
    }
    assert_eq!(write_head(&client, j).await, total);
    assert_eq!(total, total_expected);
    let tailed = tail.await.unwrap();
    assert!(
        tailed == bytes,
        "the tailing reader saw other bytes than the final read"
    );
    eprintln!(
        "{} appends, {} bytes in {:?}",
        acked.len(),
        total,
        appended_in
    );
}

/// Rounds of append-then-seal in `reads_during_seals_wait_for_them_and_go_on`.
const SEAL_ROUNDS: usize = 60;
/// Bound on one read there: a shard that stops answering fails the test.
const READ_LIMIT: std::time::Duration = std::time::Duration::from_secs(15);

/// Readers read the journal from offset 0, without blocking, over and over,
/// while its spool is sealed again and again. A read that reaches the
/// spool's bytes while they are being sealed finds them in no file for a
/// moment: it waits for the seal and goes on from the fragment it made,
/// and the shard keeps answering everyone (a read that spun on those bytes
/// instead would hold the shard's thread, and its own seal, forever).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_during_seals_wait_for_them_and_go_on() {
    let broker = Broker::start_with_cores(1);
    let client = broker.client().await;
    let j = "e2e/concurrency/read-while-sealing";
    create_journal(&client, j, |_| {}).await;
    let written = std::sync::Arc::new(std::sync::Mutex::new(Vec::<u8>::new()));
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut readers = Vec::new();
    for r in 0..4 {
        let (client, written, stop) = (client.clone(), written.clone(), stop.clone());
        readers.push(tokio::spawn(async move {
            let mut reads = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let want = written.lock().unwrap().clone();
                if want.is_empty() {
                    tokio::task::yield_now().await;
                    continue;
                }
                let to = want.len() as u64;
                let read = tokio::time::timeout(READ_LIMIT, read_range(&client, j, 0, Some(to)))
                    .await
                    .unwrap_or_else(|_| panic!("reader {r}: no answer to a read of [0, {to}) in {READ_LIMIT:?}"))
                    .unwrap_or_else(|e| panic!("reader {r}: read of [0, {to}): {e}"));
                let (got, done) = read;
                assert_eq!(done.offset, to, "reader {r}: {done:?}");
                assert!(
                    got == want,
                    "reader {r}: [0, {to}) read back {} bytes (SHA-1 {}), {} were written (SHA-1 {})",
                    got.len(),
                    hex_sha1(&got),
                    want.len(),
                    hex_sha1(&want)
                );
                reads += 1;
            }
            reads
        }));
    }
    let mut sealed = 0;
    for round in 0..SEAL_ROUNDS {
        let content = record(0, round as u32, 96 << 10);
        let reply =
            tokio::time::timeout(READ_LIMIT, client.append(&append_req(j), content.clone()))
                .await
                .unwrap_or_else(|_| panic!("round {round}: no answer to an append"))
                .unwrap_or_else(|e| panic!("round {round}: append: {e}"));
        written.lock().unwrap().extend_from_slice(&content);
        assert_eq!(reply.end, written.lock().unwrap().len() as u64);
        // Let the readers get going on the open spool, then seal it.
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
        let frag = tokio::time::timeout(READ_LIMIT, client.seal(j))
            .await
            .unwrap_or_else(|_| panic!("round {round}: no answer to a seal"))
            .unwrap_or_else(|e| panic!("round {round}: seal: {e}"));
        if let Some(f) = frag {
            assert_eq!(f.end, reply.end, "round {round}");
            sealed += 1;
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut reads = 0;
    for r in readers {
        reads += r.await.unwrap();
    }
    assert_eq!(sealed, SEAL_ROUNDS, "every round sealed a fragment");
    let all = written.lock().unwrap().clone();
    assert!(read_all(&client, j).await == all);
    eprintln!("{reads} reads across {sealed} seals");
}

fn append_req(journal: &str) -> AppendRequest {
    AppendRequest {
        journal: journal.to_string(),
        ..Default::default()
    }
}
