//! tail-readers: what readers tailing a journal cost its appends.
//!
//! 1 KiB appends at `--rate`, exactly as latency-1k, first to a journal
//! nobody reads, then to another that `--tail-readers` blocking readers
//! tail from offset 0. Each reader has a connection of its own, and all of
//! them run on a runtime of their own on another thread, as readers in
//! other processes would. Every append is the same 1 KiB, so the byte at
//! offset `o` of either journal is `content[o % 1024]`: each reader checks
//! every byte it receives and that its offsets are contiguous, and must
//! reach the journal's final head once the appends have stopped.
#![allow(clippy::disallowed_methods)] // Benchmarks measure real time.

use crate::load::{self, APPEND_TIMEOUT};
use crate::report::LatencyFigures;
use crate::BenchArgs;
use anyhow::Context as _;
use bytes::Bytes;
use rotary_net::client::{Client, ReadEvent, ReadOptions};
use rotary_net::wire::ReadRequest;
use serde::Serialize;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, watch};

/// Largest `--tail-readers`.
pub const READERS_MAX: usize = 1024;
/// How long a reader may take to reach the head once the appends stopped.
const CATCH_UP_MAX: Duration = Duration::from_secs(30);

/// The tail-readers scenario's figures.
#[derive(Clone, Debug, Serialize)]
pub struct TailFigures {
    pub readers: usize,
    /// Appends to a journal nobody reads.
    pub alone: LatencyFigures,
    /// The same appends to a journal `readers` readers tail.
    pub with_readers: LatencyFigures,
    /// The tailed journal's head once its appends stopped.
    pub head: u64,
    /// Readers that received exactly `[0, head)`, every byte right.
    pub readers_whole: usize,
    /// Bytes all readers received together.
    pub reader_bytes: u64,
    pub first_reader_error: Option<String>,
    /// The longest any reader took, after the last append was answered,
    /// to receive the head (0 when every reader was there already).
    pub catch_up_max_ms: f64,
    /// The broker's READ_DATA bytes over the tailed phase.
    pub broker_read_bytes: Option<u64>,
    /// Percent of a core each of this process's threads used (by name),
    /// in each phase: the embedded broker's shards, the load generator,
    /// and in the second phase the readers' thread.
    pub cpu_alone: BTreeMap<String, f64>,
    pub cpu_with_readers: BTreeMap<String, f64>,
}

/// What one reader saw.
struct Tailed {
    bytes: u64,
    /// When it received its last byte.
    last_at: Option<Instant>,
    error: Option<String>,
}

/// Runs both phases on `client`'s runtime, the readers on a thread of
/// their own. `alone` and `tailed` exist and are empty.
pub async fn run(
    client: &Client,
    args: &BenchArgs,
    endpoint: &str,
    alone: &str,
    tailed: &str,
) -> anyhow::Result<TailFigures> {
    let threads = crate::cpu::Threads::now();
    let alone_figures = load::latency(client, args, alone.to_string(), args.rate).await?;
    let cpu_alone = threads.percent_since();

    let (content, _) = load::content(load::LATENCY_1K_BYTES);
    let (stop_tx, stop_rx) = watch::channel(None::<u64>);
    let (ready_tx, mut ready_rx) = mpsc::channel::<()>(args.tail_readers);
    let readers = start_readers(
        endpoint,
        tailed,
        args.tail_readers,
        content,
        ready_tx,
        stop_rx,
    )?;
    // Every reader's READ is open (or failed) before the appends start.
    wait_opened(&mut ready_rx, args.tail_readers).await?;

    let read_before = read_bytes(client).await;
    let threads = crate::cpu::Threads::now();
    let with_readers = load::latency(client, args, tailed.to_string(), args.rate).await?;
    let cpu_with_readers = threads.percent_since();
    let head = write_head(client, tailed).await?;
    let stopped_at = Instant::now();
    let _ = stop_tx.send(Some(head));
    let tailed_out = tokio::task::spawn_blocking(move || readers.join())
        .await
        .context("joining the readers' thread")?
        .map_err(|_| anyhow::anyhow!("the readers' thread panicked"))??;
    let read_after = read_bytes(client).await;

    let mut figures = TailFigures {
        readers: tailed_out.len(),
        alone: alone_figures,
        with_readers,
        head,
        readers_whole: 0,
        reader_bytes: 0,
        first_reader_error: None,
        catch_up_max_ms: 0.0,
        broker_read_bytes: read_after
            .zip(read_before)
            .map(|(a, b)| a.saturating_sub(b)),
        cpu_alone,
        cpu_with_readers,
    };
    tally_readers(&mut figures, tailed_out, head, stopped_at);
    if let Some(e) = &figures.first_reader_error {
        eprintln!(
            "warning: {} of {} readers did not receive the journal whole; first: {e}",
            figures.readers - figures.readers_whole,
            figures.readers
        );
    }
    Ok(figures)
}

/// The readers' thread: `count` readers of `tailed` on a runtime of its
/// own. Each says on `ready` once its READ is open, and stops at the head
/// `stop` announces.
fn start_readers(
    endpoint: &str,
    tailed: &str,
    count: usize,
    content: Bytes,
    ready_tx: mpsc::Sender<()>,
    stop_rx: watch::Receiver<Option<u64>>,
) -> anyhow::Result<std::thread::JoinHandle<anyhow::Result<Vec<Tailed>>>> {
    let endpoint = endpoint.to_string();
    let journal = tailed.to_string();
    std::thread::Builder::new()
        .name("rotary-bench-tail".into())
        .spawn(move || -> anyhow::Result<Vec<Tailed>> {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .context("starting the readers' runtime")?;
            rt.block_on(async move {
                let tasks: Vec<_> = (0..count)
                    .map(|_| {
                        tokio::spawn(tail(
                            endpoint.clone(),
                            journal.clone(),
                            content.clone(),
                            ready_tx.clone(),
                            stop_rx.clone(),
                        ))
                    })
                    .collect();
                drop(ready_tx);
                let mut out = Vec::with_capacity(count);
                for t in tasks {
                    out.push(t.await.context("reader task panicked")?);
                }
                Ok(out)
            })
        })
        .context("starting the readers' thread")
}

/// Waits until each of `count` readers opened its READ (or failed to).
async fn wait_opened(ready_rx: &mut mpsc::Receiver<()>, count: usize) -> anyhow::Result<()> {
    let opened = tokio::time::timeout(APPEND_TIMEOUT, async {
        let mut n = 0;
        while ready_rx.recv().await.is_some() {
            n += 1;
        }
        n
    })
    .await
    .context("readers did not open their reads in time")?;
    anyhow::ensure!(
        opened == count,
        "only {opened} of {count} readers opened their reads"
    );
    Ok(())
}

/// Adds what each reader received to `figures`: whole or not, and how
/// long it took to reach `head` after `stopped_at`.
fn tally_readers(
    figures: &mut TailFigures,
    tailed_out: Vec<Tailed>,
    head: u64,
    stopped_at: Instant,
) {
    for t in tailed_out {
        figures.reader_bytes += t.bytes;
        match t.error {
            None if t.bytes == head => {
                figures.readers_whole += 1;
                if let Some(at) = t.last_at {
                    let ms = at.saturating_duration_since(stopped_at).as_secs_f64() * 1e3;
                    figures.catch_up_max_ms = figures.catch_up_max_ms.max(ms);
                }
            }
            None => {
                let why = format!("received {} of {head} bytes", t.bytes);
                figures.first_reader_error.get_or_insert(why);
            }
            Some(e) => {
                figures.first_reader_error.get_or_insert(e);
            }
        }
    }
}

/// One reader: tails `journal` from 0, checking each byte, until it holds
/// the head that `stop` announces.
async fn tail(
    endpoint: String,
    journal: String,
    content: Bytes,
    ready: mpsc::Sender<()>,
    mut stop: watch::Receiver<Option<u64>>,
) -> Tailed {
    let mut out = Tailed {
        bytes: 0,
        last_at: None,
        error: None,
    };
    let opened = async {
        let client = Client::connect(&endpoint).await?;
        let req = ReadRequest {
            journal,
            offset: Some(0),
            end_offset: None,
            route_revision: 0,
        };
        let options = ReadOptions {
            block: true,
            ..Default::default()
        };
        client.read_with(&req, options).await
    }
    .await;
    if opened.is_ok() {
        let _ = ready.send(()).await;
    }
    drop(ready);
    let mut stream = match opened {
        Ok(s) => s,
        Err(e) => {
            out.error = Some(format!("opening the read: {e}"));
            return out;
        }
    };
    let mut deadline: Option<tokio::time::Instant> = None;
    loop {
        let head = *stop.borrow();
        if let Some(head) = head {
            if out.bytes >= head {
                break;
            }
            deadline.get_or_insert_with(|| tokio::time::Instant::now() + CATCH_UP_MAX);
        }
        let far = tokio::time::Instant::now() + Duration::from_secs(3600);
        tokio::select! {
            event = stream.next() => {
                let (offset, data) = match event {
                    Some(Ok(ReadEvent::Data { offset, content })) => (offset, content),
                    Some(Ok(ReadEvent::Done(d))) => {
                        out.error = Some(format!("the read ended at {}: {:?} {}", d.offset, d.status, d.message));
                        break;
                    }
                    Some(Ok(ReadEvent::Fragment { .. })) => {
                        out.error = Some("a proxied read answered with a fragment location".into());
                        break;
                    }
                    Some(Err(e)) => {
                        out.error = Some(e.to_string());
                        break;
                    }
                    None => {
                        out.error = Some("the read stream ended".into());
                        break;
                    }
                };
                if offset != out.bytes {
                    out.error = Some(format!("expected offset {}, got {offset}", out.bytes));
                    break;
                }
                if let Some(bad) = first_wrong_byte(&content, offset, &data) {
                    out.error = Some(format!("wrong byte at offset {bad}"));
                    break;
                }
                out.bytes += data.len() as u64;
                out.last_at = Some(Instant::now());
            }
            changed = stop.changed(), if head.is_none() => {
                if changed.is_err() {
                    out.error = Some("the scenario ended before its appends did".into());
                    break;
                }
            }
            _ = tokio::time::sleep_until(deadline.unwrap_or(far)) => {
                out.error = Some(format!(
                    "at {} of {} bytes {CATCH_UP_MAX:?} after the appends stopped",
                    out.bytes,
                    head.unwrap_or_default()
                ));
                break;
            }
        }
    }
    out
}

/// The offset of the first byte of `data` (read at `offset`) that is not
/// the journal's: `content` repeated from offset 0.
fn first_wrong_byte(content: &[u8], offset: u64, data: &[u8]) -> Option<u64> {
    let period = content.len() as u64;
    let mut at = 0usize;
    while at < data.len() {
        let phase = ((offset + at as u64) % period) as usize;
        let n = (content.len() - phase).min(data.len() - at);
        if data[at..at + n] != content[phase..phase + n] {
            let i = (0..n)
                .find(|&i| data[at + i] != content[phase + i])
                .unwrap_or(0);
            return Some(offset + (at + i) as u64);
        }
        at += n;
    }
    None
}

async fn write_head(client: &Client, journal: &str) -> anyhow::Result<u64> {
    let req = ReadRequest {
        journal: journal.to_string(),
        offset: None,
        end_offset: None,
        route_revision: 0,
    };
    let options = ReadOptions {
        metadata_only: true,
        ..Default::default()
    };
    let mut stream = client.read_with(&req, options).await?;
    while let Some(event) = stream.next().await {
        if let ReadEvent::Done(d) = event? {
            return Ok(d.write_head);
        }
    }
    anyhow::bail!("the metadata read of {journal} ended without READ_DONE")
}

async fn read_bytes(client: &Client) -> Option<u64> {
    client.stats().await.ok()?["read_bytes"].as_u64()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrong_bytes_are_found_wherever_a_chunk_starts() {
        let content: Vec<u8> = (0..10u8).collect();
        let journal: Vec<u8> = content.iter().copied().cycle().take(95).collect();
        for start in [0usize, 3, 10, 17] {
            for end in [start, start + 1, start + 9, start + 30, 95] {
                if end < start {
                    continue;
                }
                assert_eq!(
                    first_wrong_byte(&content, start as u64, &journal[start..end]),
                    None
                );
                if end > start {
                    let mut bad = journal[start..end].to_vec();
                    let i = (end - start) / 2;
                    bad[i] ^= 0xff;
                    assert_eq!(
                        first_wrong_byte(&content, start as u64, &bad),
                        Some((start + i) as u64)
                    );
                }
            }
        }
    }
}
