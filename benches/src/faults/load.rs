//! Writers of a fault run, and the records they append.
//!
//! Each record says what it is: a 16-byte header (`RTFL`, writer,
//! sequence, length, little-endian u32s) and filler generated from
//! (writer, sequence), so any span of a journal can be walked record by
//! record and each record checked against what it must be, with no other
//! knowledge: a torn or foreign byte is found where it is.
#![allow(clippy::disallowed_methods)] // Benchmarks measure real time.

use rotary_net::client::Client;
use rotary_net::wire::AppendRequest;
use sha1::{Digest, Sha1};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub const RECORD_MAGIC: &[u8; 4] = b"RTFL";
pub const RECORD_HEADER_LEN: usize = 16;
/// Record lengths run from the minimum to the minimum plus the spread.
const RECORD_LEN_MIN: usize = 64;
const RECORD_LEN_SPREAD: usize = 900;
/// Pause after a failed append, so a writer whose journal has no route
/// does not spin.
const FAILED_APPEND_PAUSE: Duration = Duration::from_millis(100);

/// The record `seq` of `writer`, `len` (at least [`RECORD_HEADER_LEN`])
/// bytes long.
pub fn record(writer: u32, seq: u32, len: usize) -> Vec<u8> {
    assert!(len >= RECORD_HEADER_LEN);
    let mut out = Vec::with_capacity(len);
    out.extend_from_slice(RECORD_MAGIC);
    out.extend_from_slice(&writer.to_le_bytes());
    out.extend_from_slice(&seq.to_le_bytes());
    out.extend_from_slice(&(len as u32).to_le_bytes());
    // splitmix64 seeded by (writer, seq).
    let mut x = (u64::from(writer) << 32) | u64::from(seq);
    while out.len() < len {
        x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = x;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        let take = (len - out.len()).min(8);
        out.extend_from_slice(&z.to_le_bytes()[..take]);
    }
    out
}

/// A record found in a journal at `[begin, end)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Found {
    pub begin: u64,
    pub end: u64,
    pub writer: u32,
    pub seq: u32,
}

/// Walks `bytes` (journal offsets from `base`) as back-to-back whole
/// records; an error names the first offset that does not begin a whole,
/// intact record.
pub fn parse_records(bytes: &[u8], base: u64) -> Result<Vec<Found>, String> {
    let mut at = 0usize;
    let mut out = Vec::new();
    while at < bytes.len() {
        let rest = &bytes[at..];
        let offset = base + at as u64;
        if rest.len() < RECORD_HEADER_LEN || &rest[..4] != RECORD_MAGIC {
            return Err(format!("offset {offset}: no record header"));
        }
        let u = |i: usize| u32::from_le_bytes([rest[i], rest[i + 1], rest[i + 2], rest[i + 3]]);
        let (writer, seq, len) = (u(4), u(8), u(12) as usize);
        if len < RECORD_HEADER_LEN || len > rest.len() {
            return Err(format!(
                "offset {offset}: record ({writer}, {seq}) of {len} bytes does not fit"
            ));
        }
        if rest[..len] != record(writer, seq, len)[..] {
            return Err(format!(
                "offset {offset}: record ({writer}, {seq}) of {len} bytes is corrupt"
            ));
        }
        out.push(Found {
            begin: offset,
            end: offset + len as u64,
            writer,
            seq,
        });
        at += len;
    }
    Ok(out)
}

pub fn sha1(bytes: &[u8]) -> [u8; 20] {
    Sha1::digest(bytes).into()
}

/// One acknowledged append.
#[derive(Clone, Debug)]
pub struct Ack {
    /// Index of the journal in the run's list.
    pub journal: usize,
    pub writer: u32,
    pub seq: u32,
    pub begin: u64,
    pub end: u64,
    /// The SHA-1 the acknowledgement gave.
    pub sha1: [u8; 20],
    pub sent: Instant,
    pub acked: Instant,
}

/// What the writers saw.
#[derive(Debug, Default)]
pub struct Log {
    pub acks: Vec<Ack>,
    /// Failed appends: when, and why.
    pub failures: Vec<(Instant, String)>,
    /// Acknowledgements that contradict the append itself (wrong length or
    /// SHA-1): violations found on the spot.
    pub bad_acks: Vec<String>,
}

/// Writers appending records one after another, each waiting for its ack,
/// writer `w` to journal `w % journals` only (a writer blocked on one
/// journal holds up no other).
pub struct Writers {
    pub log: Arc<Mutex<Log>>,
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Writers {
    /// One writer per client in `clients`.
    pub fn start(clients: Vec<Client>, journals: &[String]) -> Writers {
        let log: Arc<Mutex<Log>> = Arc::default();
        let stop: Arc<AtomicBool> = Arc::default();
        let journals: Arc<Vec<String>> = Arc::new(journals.to_vec());
        let tasks = clients
            .into_iter()
            .enumerate()
            .map(|(w, client)| {
                let (log, stop, journals) = (log.clone(), stop.clone(), journals.clone());
                tokio::spawn(write(client, w as u32, journals, log, stop))
            })
            .collect();
        Writers { log, stop, tasks }
    }

    /// The first acknowledgement of an append sent after `at` to each
    /// journal in `journals`, if every one has one.
    pub fn acked_after(&self, at: Instant, journals: usize) -> bool {
        let log = self.log.lock().expect("log");
        (0..journals).all(|j| log.acks.iter().any(|a| a.journal == j && a.sent > at))
    }

    /// Waits until every journal has an append sent after `at`
    /// acknowledged, at most `timeout`.
    pub async fn wait_acked_after(
        &self,
        at: Instant,
        journals: usize,
        timeout: Duration,
    ) -> anyhow::Result<()> {
        let deadline = Instant::now() + timeout;
        while !self.acked_after(at, journals) {
            if Instant::now() >= deadline {
                let log = self.log.lock().expect("log");
                let waiting: Vec<usize> = (0..journals)
                    .filter(|j| !log.acks.iter().any(|a| a.journal == *j && a.sent > at))
                    .collect();
                let failures: Vec<&String> = log
                    .failures
                    .iter()
                    .filter(|(t, _)| *t > at)
                    .map(|(_, f)| f)
                    .take(5)
                    .collect();
                anyhow::bail!(
                    "journals {waiting:?} had no append acknowledged within {timeout:?}; \
                     {} acks in all since, failures since: {failures:?}",
                    log.acks.iter().filter(|a| a.sent > at).count()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(())
    }

    /// Stops the writers (each finishes the append it is in) and returns
    /// what they saw.
    pub async fn finish(self) -> Log {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.tasks {
            let _ = t.await;
        }
        std::mem::take(&mut *self.log.lock().expect("log"))
    }
}

async fn write(
    client: Client,
    writer: u32,
    journals: Arc<Vec<String>>,
    log: Arc<Mutex<Log>>,
    stop: Arc<AtomicBool>,
) {
    let mut seq = 0u32;
    while !stop.load(Ordering::Relaxed) {
        let journal = writer as usize % journals.len();
        let req = AppendRequest {
            journal: journals[journal].clone(),
            ..AppendRequest::default()
        };
        let len = RECORD_LEN_MIN + (seq as usize * 37 + writer as usize * 101) % RECORD_LEN_SPREAD;
        let content = record(writer, seq, len);
        let digest = sha1(&content);
        let sent = Instant::now();
        let r = client.append(&req, content).await;
        let acked = Instant::now();
        let failed = {
            let mut log = log.lock().expect("log");
            match r {
                Ok(reply) => {
                    if reply.end - reply.begin != len as u64 || reply.sha1 != digest {
                        log.bad_acks.push(format!(
                            "{}: append ({writer}, {seq}) of {len} bytes acknowledged at [{}, {}) with SHA-1 {}",
                            journals[journal],
                            reply.begin,
                            reply.end,
                            hex(&reply.sha1)
                        ));
                    }
                    log.acks.push(Ack {
                        journal,
                        writer,
                        seq,
                        begin: reply.begin,
                        end: reply.end,
                        sha1: reply.sha1,
                        sent,
                        acked,
                    });
                    false
                }
                Err(e) => {
                    log.failures.push((
                        acked,
                        format!("{}: writer {writer} append {seq}: {e}", journals[journal]),
                    ));
                    true
                }
            }
        };
        if failed {
            tokio::time::sleep(FAILED_APPEND_PAUSE).await;
        }
        seq += 1;
    }
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
