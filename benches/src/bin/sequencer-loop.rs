//! `sequencer-loop`: the read-committed sequencer's own CPU per message,
//! in memory, on input shaped like `rotary bench --scenario messages`
//! reads: one producer's transactions of 100 messages of 1 KiB, 25 in each
//! of 4 journals, each journal's run followed by its acknowledgement.
//!
//! `sequencer-loop [ROUNDS] [one-by-one]` prints each round's CPU time per
//! delivered message (this thread's, from `/proc/thread-self/schedstat`),
//! input copies made outside the timing. Whole transactions are taken at
//! once, as a reader takes them, unless `one-by-one` is given. The same loop as the bench's
//! "sequencer alone", without a broker, so that it runs in seconds under
//! `perf`.

// Functions stay short enough to hold in mind (threshold in clippy.toml).
#![warn(clippy::too_many_lines)]
#![allow(clippy::disallowed_methods)] // Benchmarks measure real time.

use bytes::Bytes;
use rotary_net::message::{Clock, Envelope, Flags, ProducerId, Sequencer, Uuid};
use std::collections::VecDeque;
use std::sync::Arc;

const TRANSACTIONS: usize = 20_000;
const JOURNALS: usize = 4;
const PER_JOURNAL: usize = 25;

fn thread_cpu_ns() -> u64 {
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").expect("schedstat");
    let v = s.split_whitespace().next().expect("a first field");
    v.parse().expect("a number")
}

fn input() -> Vec<Envelope> {
    let journals: Vec<Arc<str>> = (0..JOURNALS)
        .map(|i| Arc::from(format!("bench/messages-{i}")))
        .collect();
    let producer = ProducerId([0x01, 2, 3, 4, 5, 6]);
    let content = Bytes::from(vec![7u8; 1024]);
    let mut heads = [0u64; JOURNALS];
    let mut clock = 0u64;
    let mut all = Vec::new();
    let mut push = |j: usize, len: u64, clock: u64, flags, message: &Bytes| {
        let begin = heads[j];
        heads[j] += len;
        all.push(Envelope {
            journal: journals[j].clone(),
            begin,
            end: begin + len,
            uuid: Uuid::build(producer, Clock(clock), flags),
            message: message.clone(),
        });
    };
    for _ in 0..TRANSACTIONS {
        let ack = clock + (JOURNALS * PER_JOURNAL) as u64 + 1;
        for j in 0..JOURNALS {
            for _ in 0..PER_JOURNAL {
                clock += 1;
                push(j, 1050, clock, Flags::CONTINUE_TXN, &content);
            }
            push(j, 30, ack, Flags::ACK_TXN, &Bytes::new());
        }
        clock = ack;
    }
    all
}

fn main() {
    let rounds: usize = std::env::args()
        .nth(1)
        .map_or(5, |r| r.parse().expect("ROUNDS is a number"));
    let whole = std::env::args().nth(2).as_deref() != Some("one-by-one");
    let all = input();
    for _ in 0..rounds {
        let mut seq = Sequencer::new(rotary_net::message::sequencer::RING_LEN_DEFAULT);
        let mut input: VecDeque<Envelope> = all.clone().into();
        let t0 = thread_cpu_ns();
        let mut delivered = 0u64;
        while !input.is_empty() {
            // As a reader does: a whole transaction at the front at once
            // (unless told not to), else one envelope.
            match whole.then(|| seq.txn_at_front(input.iter())).flatten() {
                Some(n) => seq.queue_txn(input.drain(..n).collect()),
                None => seq.queue(input.pop_front().expect("not empty")),
            };
            while let Some(env) = seq.pop() {
                delivered += 1;
                std::hint::black_box(&env);
            }
        }
        let ns = thread_cpu_ns() - t0;
        println!(
            "{delivered} messages delivered, {:.1} ns each",
            ns as f64 / delivered as f64
        );
    }
}
