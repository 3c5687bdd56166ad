//! The backfill scenario: reading a journal's history straight from its
//! fragment store, and what that does to live appends on the same broker.
//!
//! 1. History: `--backfill-gib` GiB of 1 MiB appends (`--append-depth` in
//!    flight) to one journal whose spec names a `file://` store in the
//!    scratch directory (`compression_codec: none`, 64 MiB fragments,
//!    `refresh_interval: 1s`); then SEAL, and FRAGMENTS is polled (bounded)
//!    until every local fragment shows uploaded.
//! 2. Raw store GET: every fragment object of the journal, listed and read
//!    one after another through [`rotary_uploader::Uploader`] (object_store's
//!    GET, streamed, SHA-1 checked): the store's own rate.
//! 3. Backfill: [`Client::read_direct`] from offset 0 to the write head,
//!    non-blocking, timed; then once more with the whole stream hashed: the
//!    byte count and the SHA-1 must match what was appended.
//! 4. Live latency: 1 KiB appends at `--backfill-rate` per second to another
//!    journal (latency-1k's pacer), first alone, then while a second client
//!    (own thread, own runtime, own connection: another process, in effect)
//!    backfills the history from offset 0 over and over.
#![allow(clippy::disallowed_methods)] // Benchmarks measure real time.

use crate::broker::Target;
use crate::load::{self, APPEND_TIMEOUT};
use crate::report::LatencyFigures;
use crate::BenchArgs;
use anyhow::Context as _;
use bytes::{Bytes, BytesMut};
use rotary_net::client::{Client, FragmentInfo, ReadEvent};
use rotary_net::spec::{Codec, JournalSpec};
use rotary_net::wire::{AppendRequest, ReadRequest};
use serde::Serialize;
use sha1::{Digest as _, Sha1};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Largest `--backfill-gib`.
pub const GIB_MAX: u64 = 64;

const APPEND_BYTES: usize = 1 << 20;
const FRAGMENT_LENGTH: u64 = 64 << 20;
const REFRESH_INTERVAL: Duration = Duration::from_secs(1);
/// How long every fragment may take to show uploaded after SEAL.
const UPLOAD_WAIT_MAX: Duration = Duration::from_secs(600);
const UPLOAD_POLL: Duration = Duration::from_millis(100);
/// Chunks the raw GET asks the store reader for.
const RAW_CHUNK_BYTES: usize = 1 << 20;

/// A read of the whole history.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ReadFigures {
    pub bytes: u64,
    pub seconds: f64,
    pub mb_per_s: f64,
}

/// Everything the backfill scenario measured.
#[derive(Clone, Debug, Default, Serialize)]
pub struct BackfillFigures {
    pub journal: String,
    pub store: String,
    pub history_bytes: u64,
    /// Appending the history (1 MiB appends, pipelined).
    pub build: ReadFigures,
    /// From SEAL until every local fragment showed uploaded.
    pub upload_wait_seconds: f64,
    /// Fragment objects in the store.
    pub fragments: usize,
    /// Every object read through the uploader's store reader.
    pub raw_get: ReadFigures,
    /// `read_direct` from 0 to the head (the stream not hashed by the bench).
    pub direct: ReadFigures,
    pub direct_fragments_fetched: u64,
    pub direct_fragments_proxied: u64,
    pub direct_reads: u64,
    /// A second direct read's bytes had the SHA-1 of the appended stream.
    pub direct_sha1_matches: bool,
    pub live_alone: LatencyFigures,
    pub live_with_backfill: LatencyFigures,
    /// What the concurrent backfill read while `live_with_backfill` ran.
    pub concurrent_backfill: ReadFigures,
    pub concurrent_backfill_passes: u64,
    pub concurrent_backfill_error: Option<String>,
}

/// Runs the scenario; `store_dir` becomes the journal's `file://` store.
pub async fn run(
    client: &Client,
    args: &BenchArgs,
    target: &Target,
    prefix: &str,
    store_dir: &Path,
) -> anyhow::Result<BackfillFigures> {
    std::fs::create_dir_all(store_dir)
        .with_context(|| format!("making {}", store_dir.display()))?;
    let store = format!("file://{}/", store_dir.display());
    let history = format!("{prefix}/backfill");
    let live = format!("{prefix}/backfill-live");
    let mut spec = JournalSpec::new(&history);
    spec.fragment.stores = vec![store.clone()];
    spec.fragment.compression_codec = Codec::None;
    spec.fragment.length = FRAGMENT_LENGTH;
    spec.fragment.refresh_interval = REFRESH_INTERVAL;
    client
        .apply(&[spec, JournalSpec::new(&live)])
        .await
        .context("creating the backfill journals")?;
    let result = measure(client, args, target, &history, &live, &store).await;
    for j in [&history, &live] {
        if let Err(e) = client.delete(j).await {
            eprintln!("warning: deleting {j}: {e}");
        }
    }
    result
}

async fn measure(
    client: &Client,
    args: &BenchArgs,
    target: &Target,
    history: &str,
    live: &str,
    store: &str,
) -> anyhow::Result<BackfillFigures> {
    let mut f = BackfillFigures {
        journal: history.to_string(),
        store: store.to_string(),
        ..BackfillFigures::default()
    };
    let appends = args.backfill_gib * 1024;
    eprintln!(
        "backfill: {} × {APPEND_BYTES} B appends to {history}, {} in flight",
        appends, args.append_depth
    );
    let start = Instant::now();
    let (head, sha) = build_history(client, history, appends, args.append_depth).await?;
    f.history_bytes = head;
    f.build = rate(head, start.elapsed());

    eprintln!("backfill: sealing, waiting for uploads");
    let start = Instant::now();
    client.seal(history).await.context("SEAL")?;
    wait_uploaded(client, history, head).await?;
    f.upload_wait_seconds = start.elapsed().as_secs_f64();

    eprintln!("backfill: raw store GET");
    let (fragments, raw) = raw_get(store, history, head).await?;
    f.fragments = fragments;
    f.raw_get = raw;

    eprintln!("backfill: read_direct from 0");
    // Timed without hashing the stream here (the raw GET does not either;
    // both check each fragment's SHA-1); a second pass checks the whole.
    let start = Instant::now();
    let pass = direct_pass(client, history, head, false).await?;
    f.direct = rate(pass.bytes, start.elapsed());
    f.direct_fragments_fetched = pass.fetched;
    f.direct_fragments_proxied = pass.proxied;
    f.direct_reads = pass.reads;
    anyhow::ensure!(
        pass.bytes == head,
        "read_direct returned {} bytes of {head}",
        pass.bytes
    );
    eprintln!("backfill: read_direct from 0 again, hashing the stream");
    let check = direct_pass(client, history, head, true).await?;
    f.direct_sha1_matches = check.bytes == head && check.sha1 == Some(sha);
    anyhow::ensure!(
        f.direct_sha1_matches,
        "read_direct's bytes differ from what was appended (SHA-1)"
    );

    eprintln!(
        "backfill: live 1 KiB appends to {live} at {}/s, alone",
        args.backfill_rate
    );
    f.live_alone = load::latency(client, args, live.to_string(), args.backfill_rate).await?;

    eprintln!("backfill: live appends again, with a backfill looping from 0");
    let stop = Arc::new(AtomicBool::new(false));
    let bytes = Arc::new(AtomicU64::new(0));
    let passes = Arc::new(AtomicU64::new(0));
    let error = Arc::new(Mutex::new(None::<String>));
    let reader = {
        let (endpoint, history) = (target.endpoint.clone(), history.to_string());
        let (stop, bytes, passes, error) =
            (stop.clone(), bytes.clone(), passes.clone(), error.clone());
        let backfill_cpus = args.backfill_cpus.clone();
        std::thread::Builder::new()
            .name("rotary-bench-backfill".into())
            .spawn(move || {
                if let Some(cpus) = &backfill_cpus {
                    if let Err(e) = crate::sys::pin_current_thread_to(&cpus.0) {
                        eprintln!("backfill: cannot pin the backfill reader to CPUs {cpus:?}: {e}");
                    }
                }
                let rt = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                    .expect("backfill runtime");
                let r = rt.block_on(backfill_loop(endpoint, history, head, stop, bytes, passes));
                if let Err(e) = r {
                    *error.lock().unwrap_or_else(|p| p.into_inner()) = Some(format!("{e:#}"));
                }
            })
            .context("starting the backfill thread")?
    };
    // Let the backfill get going before the pacer starts.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let start = Instant::now();
    let bytes_at_start = bytes.load(Ordering::Relaxed);
    let with = load::latency(client, args, live.to_string(), args.backfill_rate).await;
    let elapsed = start.elapsed();
    let read = bytes.load(Ordering::Relaxed) - bytes_at_start;
    stop.store(true, Ordering::Relaxed);
    let _ = tokio::task::spawn_blocking(move || reader.join()).await;
    f.live_with_backfill = with?;
    f.concurrent_backfill = rate(read, elapsed);
    f.concurrent_backfill_passes = passes.load(Ordering::Relaxed);
    f.concurrent_backfill_error = error.lock().unwrap_or_else(|p| p.into_inner()).take();
    if let Some(e) = &f.concurrent_backfill_error {
        eprintln!("warning: concurrent backfill: {e}");
    }
    Ok(f)
}

fn rate(bytes: u64, elapsed: Duration) -> ReadFigures {
    let seconds = elapsed.as_secs_f64();
    ReadFigures {
        bytes,
        seconds,
        mb_per_s: if seconds > 0.0 {
            bytes as f64 / seconds / 1e6
        } else {
            0.0
        },
    }
}

/// Appends `count` distinct 1 MiB blocks, `depth` in flight; returns the
/// write head and the SHA-1 of the journal's bytes `[0, head)`.
async fn build_history(
    client: &Client,
    journal: &str,
    count: u64,
    depth: usize,
) -> anyhow::Result<(u64, [u8; 20])> {
    let (base, _) = load::content(APPEND_BYTES);
    let next = Arc::new(AtomicU64::new(0));
    let mut workers = Vec::new();
    for _ in 0..depth {
        let (client, next, base) = (client.clone(), next.clone(), base.clone());
        let req = AppendRequest {
            journal: journal.to_string(),
            ..Default::default()
        };
        workers.push(tokio::spawn(async move {
            // (offset, block number) of each committed append.
            let mut placed = Vec::new();
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= count {
                    return Ok::<_, anyhow::Error>(placed);
                }
                let block = block(&base, i);
                let reply = tokio::time::timeout(APPEND_TIMEOUT, client.append(&req, block))
                    .await
                    .map_err(|_| anyhow::anyhow!("append took longer than {APPEND_TIMEOUT:?}"))?
                    .context("append")?;
                anyhow::ensure!(
                    reply.end.checked_sub(reply.begin) == Some(APPEND_BYTES as u64),
                    "reply [{}, {}) does not span {APPEND_BYTES} bytes",
                    reply.begin,
                    reply.end
                );
                placed.push((reply.begin, i));
            }
        }));
    }
    let mut placed = Vec::new();
    for w in workers {
        placed.extend(w.await.context("append worker panicked")??);
    }
    placed.sort_unstable();
    // The journal's bytes, in offset order: the blocks as they landed.
    let mut sha = Sha1::new();
    let mut at = 0;
    for (begin, i) in placed {
        anyhow::ensure!(begin == at, "appends left a gap at {at} (next at {begin})");
        sha.update(block(&base, i));
        at += APPEND_BYTES as u64;
    }
    Ok((at, sha.finalize().into()))
}

/// Block `i`: the base content with its number in the first 8 bytes.
fn block(base: &Bytes, i: u64) -> Bytes {
    let mut b = BytesMut::from(&base[..]);
    b[..8].copy_from_slice(&i.to_le_bytes());
    b.freeze()
}

/// Polls FRAGMENTS until every sealed local fragment shows uploaded and
/// the fragments cover `[0, head)`.
async fn wait_uploaded(client: &Client, journal: &str, head: u64) -> anyhow::Result<()> {
    let deadline = Instant::now() + UPLOAD_WAIT_MAX;
    loop {
        let fragments = client.fragments(journal).await.context("FRAGMENTS")?;
        if all_uploaded(&fragments, head) {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "fragments not all uploaded {UPLOAD_WAIT_MAX:?} after SEAL"
        );
        tokio::time::sleep(UPLOAD_POLL).await;
    }
}

fn all_uploaded(fragments: &[FragmentInfo], head: u64) -> bool {
    let local_done = fragments
        .iter()
        .filter(|f| f.store == "local" && !f.open && f.end > f.begin)
        .all(|f| f.uploaded == Some(true));
    let mut stored: Vec<(u64, u64)> = fragments
        .iter()
        .filter(|f| f.store != "local")
        .map(|f| (f.begin, f.end))
        .collect();
    stored.sort_unstable();
    let mut covered = 0;
    for (b, e) in stored {
        if b <= covered {
            covered = covered.max(e);
        }
    }
    local_done && covered >= head
}

/// Lists the journal's objects in `store` and reads each through the
/// uploader's store reader, one after another.
async fn raw_get(store: &str, journal: &str, head: u64) -> anyhow::Result<(usize, ReadFigures)> {
    let uploader = rotary_uploader::Uploader::start(2, 16);
    let fragments = uploader
        .list(store, journal)
        .await
        .with_context(|| format!("listing {journal} in {store}"))?;
    let start = Instant::now();
    let mut bytes = 0u64;
    for frag in &fragments {
        let chunks = uploader.read(frag, frag.begin, RAW_CHUNK_BYTES);
        let mut at = frag.begin;
        while let Ok(chunk) = chunks.recv().await {
            let chunk = chunk.with_context(|| format!("reading {}", frag.key))?;
            anyhow::ensure!(chunk.offset == at, "{}: chunk out of order", frag.key);
            at += chunk.bytes.len() as u64;
        }
        anyhow::ensure!(at == frag.end, "{}: stream cut off at {at}", frag.key);
        bytes += frag.end - frag.begin;
    }
    let elapsed = start.elapsed();
    anyhow::ensure!(
        bytes >= head,
        "the store holds {bytes} bytes of the {head} appended"
    );
    Ok((fragments.len(), rate(bytes, elapsed)))
}

struct Pass {
    bytes: u64,
    sha1: Option<[u8; 20]>,
    fetched: u64,
    proxied: u64,
    reads: u64,
}

/// One non-blocking `read_direct` from 0 to the head.
async fn direct_pass(
    client: &Client,
    journal: &str,
    head: u64,
    hash: bool,
) -> anyhow::Result<Pass> {
    let req = ReadRequest {
        journal: journal.to_string(),
        offset: Some(0),
        end_offset: Some(head),
        route_revision: 0,
    };
    let mut read = client.read_direct(&req, false);
    let mut sha = hash.then(Sha1::new);
    let mut at = 0u64;
    while let Some(event) = read.next().await {
        match event.context("read_direct")? {
            ReadEvent::Data { offset, content } => {
                anyhow::ensure!(offset == at, "read_direct jumped from {at} to {offset}");
                at += content.len() as u64;
                if let Some(s) = &mut sha {
                    s.update(&content);
                }
            }
            ReadEvent::Done(done) => {
                end_ok(&done)?;
                break;
            }
            ReadEvent::Fragment { .. } => {}
        }
    }
    let stats = read.stats();
    Ok(Pass {
        bytes: at,
        sha1: sha.map(|s| s.finalize().into()),
        fetched: stats.fragments_fetched.load(Ordering::Relaxed),
        proxied: stats.fragments_proxied.load(Ordering::Relaxed),
        reads: stats.reads.load(Ordering::Relaxed),
    })
}

/// The concurrent backfill: direct reads from 0, over and over, until `stop`.
async fn backfill_loop(
    endpoint: String,
    journal: String,
    head: u64,
    stop: Arc<AtomicBool>,
    bytes: Arc<AtomicU64>,
    passes: Arc<AtomicU64>,
) -> anyhow::Result<()> {
    let client = Client::connect(&endpoint)
        .await
        .with_context(|| format!("connecting to {endpoint}"))?;
    let req = ReadRequest {
        journal,
        offset: Some(0),
        end_offset: Some(head),
        route_revision: 0,
    };
    while !stop.load(Ordering::Relaxed) {
        let mut read = client.read_direct(&req, false);
        while let Some(event) = read.next().await {
            if stop.load(Ordering::Relaxed) {
                return Ok(());
            }
            match event.context("read_direct")? {
                ReadEvent::Data { content, .. } => {
                    bytes.fetch_add(content.len() as u64, Ordering::Relaxed);
                }
                ReadEvent::Done(done) => {
                    end_ok(&done)?;
                    break;
                }
                ReadEvent::Fragment { .. } => {}
            }
        }
        passes.fetch_add(1, Ordering::Relaxed);
    }
    Ok(())
}

/// A non-blocking read ends OK, or OFFSET_NOT_YET_AVAILABLE at the head.
fn end_ok(done: &rotary_net::client::ReadDone) -> anyhow::Result<()> {
    if done.status == rotary_net::status::Status::OFFSET_NOT_YET_AVAILABLE {
        return Ok(());
    }
    done.check().context("read_direct ended")?;
    Ok(())
}
