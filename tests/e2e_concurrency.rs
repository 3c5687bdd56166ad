//! End-to-end: many concurrent writers pipelining appends to one journal.

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
