//! `messages`: 1 KiB messages in transactions of 100 over 4 journals, read
//! committed, against plain appends of the same bytes in the same run.
//!
//! Phase 1: one [`Publisher`] publishes transactions of 100 messages, in
//! turn over 4 journals (Gazette's fixed framing), and commits each, for
//! `--duration` seconds; a read-committed [`Reader`] tails the 4 journals.
//! Phase 2: the same bytes (the same frames, acknowledgements included) are
//! appended with plain appends, the 4 journals of each transaction at
//! once, and tailed with plain reads that decode the frames. Each message
//! carries its publish time: latency is from publish to delivery, and
//! messages per second is what the reader delivered.
//!
//! Reader CPU: the phase-1 journals are then read again to their heads on
//! one thread, three ways (plain reads of the bytes; read uncommitted,
//! which decodes frames; read committed, which also sequences), and each
//! way's CPU time per message is taken from the thread's schedstat. The
//! sequencer alone is also timed over the same envelopes in memory.
#![allow(clippy::disallowed_methods)] // Benchmarks measure real time.

use crate::BenchArgs;
use anyhow::Context as _;
use hdrhistogram::Histogram;
use rotary_net::client::{Client, ReadEvent};
use rotary_net::message::{
    Clock, Decoder, Envelope, Flags, Framing, ProducerId, Publisher, PublisherOptions, ReadMode,
    Reader, ReaderOptions, Sequencer, Uuid,
};
use rotary_net::spec::{Codec, JournalSpec, LabelSet};
use rotary_net::wire::{AppendRequest, ReadRequest};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Bytes of each message's content.
pub const MESSAGE_LEN: usize = 1024;
/// Messages per transaction.
pub const TXN_MESSAGES: usize = 100;
/// Journals each transaction spans.
pub const JOURNALS: usize = 4;
/// How long the readers may take to deliver the last message after the
/// writer stopped.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(60);
/// Reads of the reader-CPU comparison; the least CPU of them counts.
const CPU_ROUNDS: usize = 5;

/// What the scenario measured.
#[derive(Debug, Clone, serde::Serialize)]
pub struct MessagesFigures {
    pub messages: Phase,
    pub plain: Phase,
    /// Reader CPU per message, in ns: plain reads of the bytes, read
    /// uncommitted (decoding), read committed (decoding and sequencing).
    pub cpu_ns_plain: f64,
    pub cpu_ns_uncommitted: f64,
    pub cpu_ns_committed: f64,
    /// The sequencer alone, per message (in memory).
    pub sequencer_ns: f64,
    pub messages_read_for_cpu: u64,
}

/// One phase's figures.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Phase {
    pub delivered: u64,
    pub secs: f64,
    pub per_sec: f64,
    pub p50_us: u64,
    pub p99_us: u64,
    pub max_us: u64,
}

impl std::fmt::Display for MessagesFigures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ratio = self.messages.per_sec / self.plain.per_sec.max(1.0);
        let seq_share = (self.cpu_ns_committed - self.cpu_ns_uncommitted) / self.cpu_ns_uncommitted;
        writeln!(
            f,
            "\nmessages: 1 KiB messages, transactions of {TXN_MESSAGES} over {JOURNALS} journals, read committed"
        )?;
        writeln!(
            f,
            "  {:<34} {:>12} {:>10} {:>10} {:>10}",
            "", "msgs/s", "p50 us", "p99 us", "max us"
        )?;
        for (name, p) in [
            ("publisher + read committed", &self.messages),
            ("plain appends of the same bytes", &self.plain),
        ] {
            writeln!(
                f,
                "  {:<34} {:>12.0} {:>10} {:>10} {:>10}",
                name, p.per_sec, p.p50_us, p.p99_us, p.max_us
            )?;
        }
        writeln!(
            f,
            "  throughput vs plain appends: {:.0}% (target >= 80%: {})",
            ratio * 100.0,
            if ratio >= 0.8 { "met" } else { "NOT met" }
        )?;
        writeln!(
            f,
            "  reader CPU per message ({} messages, least of {CPU_ROUNDS} reads): plain bytes {:.0} ns, \
             read uncommitted {:.0} ns, read committed {:.0} ns; sequencer alone {:.0} ns",
            self.messages_read_for_cpu,
            self.cpu_ns_plain,
            self.cpu_ns_uncommitted,
            self.cpu_ns_committed,
            self.sequencer_ns
        )?;
        writeln!(
            f,
            "  sequencing adds {:.1}% CPU per message over read uncommitted (target <= 10%: {})",
            seq_share * 100.0,
            if seq_share <= 0.10 { "met" } else { "NOT met" }
        )
    }
}

/// Runs the scenario against `--broker` or a broker embedded with its data
/// in `dir`.
pub fn run(args: &BenchArgs, dir: &std::path::Path) -> anyhow::Result<MessagesFigures> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let rt = crate::client_runtime(args)?;
    let target = crate::broker::Target::open(args, dir)?;
    let endpoint = target.endpoint.clone();
    let duration = Duration::from_secs_f64(args.duration_secs);
    let result = rt.block_on(phases(endpoint.clone(), duration));
    let result = result.and_then(|(messages, plain, names)| {
        let (cpu, n) = reader_cpu(&endpoint, &names)?;
        Ok(MessagesFigures {
            messages,
            plain,
            cpu_ns_plain: cpu[0],
            cpu_ns_uncommitted: cpu[1],
            cpu_ns_committed: cpu[2],
            sequencer_ns: cpu[3],
            messages_read_for_cpu: n,
        })
    });
    rt.shutdown_timeout(Duration::from_secs(5));
    target.close();
    result
}

fn spec(name: &str) -> JournalSpec {
    let mut s = JournalSpec::new(name);
    s.labels =
        LabelSet::from_pairs([("content-type", "application/x-protobuf-fixed")]).expect("labels");
    s.fragment.compression_codec = Codec::None;
    s
}

fn now_ns(start: Instant) -> u64 {
    start.elapsed().as_nanos() as u64
}

/// A message's content: its publish time (ns since `start`), then padding.
fn content(start: Instant) -> Vec<u8> {
    let mut c = vec![b'x'; MESSAGE_LEN];
    c[..8].copy_from_slice(&now_ns(start).to_le_bytes());
    c
}

fn sent_ns(message: &[u8]) -> Option<u64> {
    Some(u64::from_le_bytes(message.get(..8)?.try_into().ok()?))
}

/// Delivered messages and their latencies, shared by a phase's readers.
struct Tally {
    delivered: AtomicU64,
    last_ns: AtomicU64,
    hist: std::sync::Mutex<Histogram<u64>>,
}

impl Tally {
    fn new() -> Arc<Tally> {
        Arc::new(Tally {
            delivered: AtomicU64::new(0),
            last_ns: AtomicU64::new(0),
            hist: std::sync::Mutex::new(
                Histogram::new_with_bounds(1, 600_000_000, 3).expect("histogram"),
            ),
        })
    }

    fn record(&self, start: Instant, message: &[u8]) {
        let Some(sent) = sent_ns(message) else { return };
        let now = now_ns(start);
        let us = (now.saturating_sub(sent) / 1000).max(1);
        self.hist.lock().expect("lock").saturating_record(us);
        self.delivered.fetch_add(1, Ordering::Relaxed);
        self.last_ns.fetch_max(now, Ordering::Relaxed);
    }

    async fn wait_for(&self, n: u64) -> anyhow::Result<()> {
        let deadline = Instant::now() + DRAIN_TIMEOUT;
        while self.delivered.load(Ordering::Relaxed) < n {
            anyhow::ensure!(
                Instant::now() < deadline,
                "readers delivered {} of {n} messages within {DRAIN_TIMEOUT:?} of the writer's end",
                self.delivered.load(Ordering::Relaxed)
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        Ok(())
    }

    fn phase(&self, first_ns: u64) -> Phase {
        let h = self.hist.lock().expect("lock");
        let delivered = self.delivered.load(Ordering::Relaxed);
        let secs = (self
            .last_ns
            .load(Ordering::Relaxed)
            .saturating_sub(first_ns)) as f64
            / 1e9;
        Phase {
            delivered,
            secs,
            per_sec: delivered as f64 / secs.max(1e-9),
            p50_us: h.value_at_quantile(0.50),
            p99_us: h.value_at_quantile(0.99),
            max_us: h.max(),
        }
    }
}

/// `n` transactions as the publisher frames them, per journal: what the
/// plain phase appends (their send times are written afresh as it goes).
fn echo_batches(n: usize, start: Instant) -> anyhow::Result<Vec<Vec<Vec<u8>>>> {
    let echo = ProducerId::random();
    let mut clock = Clock(0);
    let mut batches = Vec::with_capacity(n);
    for _ in 0..n {
        let mut frames: Vec<Vec<u8>> = (0..JOURNALS)
            .map(|_| Vec::with_capacity(TXN_MESSAGES / JOURNALS * (MESSAGE_LEN + 32)))
            .collect();
        for i in 0..TXN_MESSAGES {
            clock.update(Clock::wall());
            let u = Uuid::build(echo, clock.tick(), Flags::CONTINUE_TXN);
            Framing::Fixed.encode(u, &content(start), &mut frames[i % JOURNALS])?;
        }
        for f in frames.iter_mut() {
            Framing::Fixed.encode_ack(Uuid::build(echo, clock.tick(), Flags::ACK_TXN), f);
        }
        batches.push(frames);
    }
    Ok(batches)
}

async fn phases(
    endpoint: String,
    duration: Duration,
) -> anyhow::Result<(Phase, Phase, Vec<String>)> {
    let client = Client::connect(&endpoint).await.context("connecting")?;
    let msg_names: Vec<String> = (0..JOURNALS)
        .map(|i| format!("bench/messages-{i}"))
        .collect();
    let plain_names: Vec<String> = (0..JOURNALS).map(|i| format!("bench/plain-{i}")).collect();
    let specs: Vec<JournalSpec> = msg_names
        .iter()
        .chain(&plain_names)
        .map(|n| spec(n))
        .collect();
    client.apply(&specs).await.context("creating journals")?;
    let (messages, published, start) = message_phase(&client, &msg_names, duration).await?;
    // The same bytes for phase 2, made outside either measurement: each
    // transaction's frames per journal, acknowledgements included.
    let batches = echo_batches(published as usize / TXN_MESSAGES, start)?;
    let plain = plain_phase(&client, &plain_names, batches).await?;
    Ok((messages, plain, msg_names))
}

/// Phase 1: publisher and read-committed reader. Returns the phase, the
/// messages published and when the phase started.
async fn message_phase(
    client: &Client,
    msg_names: &[String],
    duration: Duration,
) -> anyhow::Result<(Phase, u64, Instant)> {
    eprintln!("messages: publisher and read-committed reader, {duration:?}");
    let start = Instant::now();
    let tally = Tally::new();
    let reader = {
        let options = ReaderOptions {
            mode: ReadMode::Committed,
            block: true,
            ..ReaderOptions::default()
        };
        let mut reader = Reader::open(client.clone(), msg_names, options).await?;
        let tally = tally.clone();
        tokio::spawn(async move {
            while let Some(env) = reader.next().await {
                match env {
                    Ok(env) if !env.is_ack() => tally.record(start, &env.message),
                    Ok(_) => {}
                    Err(e) => return Err(anyhow::Error::new(e).context("read committed")),
                }
            }
            Ok(())
        })
    };
    let mut publisher = Publisher::new(client.clone(), PublisherOptions::default());
    let mut published = 0u64;
    // One content buffer, stamped afresh for each message: the plain phase
    // makes its frames before it is timed, so this one allocates nothing
    // per message either.
    let mut c = content(start);
    let first_ns = now_ns(start);
    while start.elapsed() < duration {
        for i in 0..TXN_MESSAGES {
            c[..8].copy_from_slice(&now_ns(start).to_le_bytes());
            publisher
                .publish_uncommitted(&msg_names[i % JOURNALS], &c)
                .await?;
        }
        publisher.commit().await?;
        published += TXN_MESSAGES as u64;
    }
    tally.wait_for(published).await?;
    reader.abort();
    Ok((tally.phase(first_ns), published, start))
}

/// Phase 2: plain appends of the same bytes, plain readers.
async fn plain_phase(
    client: &Client,
    plain_names: &[String],
    batches: Vec<Vec<Vec<u8>>>,
) -> anyhow::Result<Phase> {
    eprintln!("messages: plain appends of the same bytes");
    let start = Instant::now();
    let tally = Tally::new();
    let readers: Vec<_> = plain_names
        .iter()
        .map(|name| {
            tokio::spawn(plain_reader(
                client.clone(),
                name.clone(),
                tally.clone(),
                start,
            ))
        })
        .collect();
    let first_ns = now_ns(start);
    let mut appended = 0u64;
    let reqs: Vec<AppendRequest> = plain_names
        .iter()
        .map(|n| AppendRequest {
            journal: n.clone(),
            ..AppendRequest::default()
        })
        .collect();
    for frames in batches {
        // Fresh send times, written into the frames' contents.
        let frames: Vec<Vec<u8>> = frames
            .into_iter()
            .map(|mut f| {
                restamp(&mut f, start);
                f
            })
            .collect();
        let appends = frames
            .into_iter()
            .zip(&reqs)
            .map(|(f, req)| client.append(req, f));
        for r in futures_util::future::join_all(appends).await {
            r?;
        }
        appended += TXN_MESSAGES as u64;
    }
    tally.wait_for(appended).await?;
    for r in readers {
        r.abort();
    }
    Ok(tally.phase(first_ns))
}

/// Reads a plain journal from the start, decoding its frames, into `tally`.
async fn plain_reader(
    client: Client,
    name: String,
    tally: Arc<Tally>,
    start: Instant,
) -> anyhow::Result<()> {
    let req = ReadRequest {
        journal: name.clone(),
        offset: Some(0),
        end_offset: None,
        route_revision: 0,
    };
    let mut stream = client.read(&req, true, false).await?;
    let mut decoder = Decoder::new(name.as_str().into(), Framing::Fixed, 0);
    while let Some(ev) = stream.next().await {
        if let ReadEvent::Data { offset, content } = ev? {
            decoder.push_bytes(offset, content);
            while let Some(env) = decoder.next_envelope() {
                if !env.is_ack() {
                    tally.record(start, &env.message);
                }
            }
        }
    }
    anyhow::Ok(())
}

/// Writes the current time into every non-empty message of fixed frames.
fn restamp(frames: &mut [u8], start: Instant) {
    let mut decoder = Decoder::new("restamp".into(), Framing::Fixed, 0);
    decoder.push(0, frames);
    let now = now_ns(start).to_le_bytes();
    while let Some(env) = decoder.next_envelope() {
        if env.message.len() >= 8 {
            // The content is the frame's last MESSAGE_LEN bytes.
            let at = env.end as usize - env.message.len();
            frames[at..at + 8].copy_from_slice(&now);
        }
    }
}

/// This thread's CPU time in ns (`/proc/thread-self/schedstat`).
fn thread_cpu_ns() -> anyhow::Result<u64> {
    let s = std::fs::read_to_string("/proc/thread-self/schedstat").context("reading schedstat")?;
    s.split_whitespace()
        .next()
        .and_then(|v| v.parse().ok())
        .context("parsing schedstat")
}

/// Reader CPU per message on one thread: `[plain, uncommitted, committed,
/// sequencer alone]`, and the messages read.
fn reader_cpu(endpoint: &str, names: &[String]) -> anyhow::Result<([f64; 4], u64)> {
    eprintln!("messages: reader CPU");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("reader runtime")?;
    rt.block_on(async {
        let client = Client::connect(endpoint).await?;
        let mut best = [f64::MAX; 3];
        let mut count = 0u64;
        let mut envelopes: Vec<Envelope> = Vec::new();
        for round in 0..CPU_ROUNDS {
            // Plain: the bytes only.
            let t0 = thread_cpu_ns()?;
            for name in names {
                let req = ReadRequest {
                    journal: name.clone(),
                    offset: Some(0),
                    end_offset: None,
                    route_revision: 0,
                };
                let mut stream = client.read(&req, false, false).await?;
                while let Some(ev) = stream.next().await {
                    if let ReadEvent::Done(d) = ev? {
                        anyhow::ensure!(
                            matches!(
                                d.status,
                                rotary_net::Status::OK
                                    | rotary_net::Status::OFFSET_NOT_YET_AVAILABLE
                            ),
                            "plain read of {name}: {}",
                            d.status
                        );
                    }
                }
            }
            let plain = thread_cpu_ns()? - t0;
            eprintln!("messages: round {round}: plain read done");
            let mut per_mode = [0u64; 2];
            for (k, mode) in [ReadMode::Uncommitted, ReadMode::Committed]
                .into_iter()
                .enumerate()
            {
                let options = ReaderOptions {
                    mode,
                    ..ReaderOptions::default()
                };
                let t0 = thread_cpu_ns()?;
                let mut reader = Reader::open(client.clone(), names, options).await?;
                let mut n = 0u64;
                while let Some(env) = reader.next().await {
                    let env = env?;
                    if round == 0 && mode == ReadMode::Uncommitted {
                        envelopes.push(env);
                    }
                    n += 1;
                }
                per_mode[k] = thread_cpu_ns()? - t0;
                eprintln!("messages: round {round}: {mode:?} read done, {n} messages");
                if mode == ReadMode::Committed {
                    count = n;
                }
            }
            let n = count.max(1) as f64;
            best[0] = best[0].min(plain as f64 / n);
            best[1] = best[1].min(per_mode[0] as f64 / n);
            best[2] = best[2].min(per_mode[1] as f64 / n);
        }
        // The sequencer alone, over the same envelopes in read order
        // (interleaved across journals as a reader might see them).
        let mut seq_best = f64::MAX;
        for _ in 0..CPU_ROUNDS {
            // A ring that holds them all: no replays, which need journal reads.
            let mut seq = Sequencer::new(envelopes.len());
            // The sequencer takes envelopes by value: copies made outside
            // the timing, so that it measures the sequencer, not the
            // reference counts of the bench's clones.
            let mut input: std::collections::VecDeque<Envelope> = envelopes.clone().into();
            let t0 = thread_cpu_ns()?;
            let mut delivered = 0u64;
            while !input.is_empty() {
                // As the reader does: a whole transaction at the front at
                // once, else one envelope.
                match seq.txn_at_front(input.iter()) {
                    Some(n) => seq.queue_txn(input.drain(..n).collect()),
                    None => seq.queue(input.pop_front().expect("not empty")),
                };
                while seq.pop().is_some() {
                    delivered += 1;
                }
            }
            let ns = thread_cpu_ns()? - t0;
            seq_best = seq_best.min(ns as f64 / delivered.max(1) as f64);
        }
        Ok(([best[0], best[1], best[2], seq_best], count))
    })
}
