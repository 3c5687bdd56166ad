//! The broker scenarios: append-1m, latency-1k and fanout-64x4k, driven
//! through the ordinary tokio client.
//!
//! Each scenario creates its own journals (`bench/<run>/…`, default specs)
//! and deletes them afterwards. Every reply is checked: `[begin, end)` must
//! span the content and its SHA-1 must be the content's, else the append
//! counts as an error.
#![allow(clippy::disallowed_methods)] // Benchmarks measure real time.

use crate::broker::Target;
use crate::report::{self, LatencyFigures, Percentiles, ThroughputFigures};
use crate::{BenchArgs, Figures, Scenario};
use anyhow::Context as _;
use bytes::Bytes;
use hdrhistogram::Histogram;
use rotary_net::client::Client;
use rotary_net::spec::JournalSpec;
use rotary_net::wire::AppendRequest;
use sha1::{Digest as _, Sha1};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;

/// Largest `--append-depth`, `--replication-depth` and `--fanout-depth`.
pub const DEPTH_MAX: usize = 1024;
/// Largest `--rate`.
pub const RATE_MAX: u64 = 1_000_000;

const APPEND_1M_BYTES: usize = 1 << 20;
pub(crate) const LATENCY_1K_BYTES: usize = 1 << 10;
const FANOUT_BYTES: usize = 4 << 10;
const FANOUT_JOURNALS: usize = 64;

/// An append that takes longer than this counts as an error.
pub(crate) const APPEND_TIMEOUT: Duration = Duration::from_secs(30);
/// A scenario stops early after this many failed appends.
const ERRORS_MAX: u64 = 1000;
/// Pause after a failed append, so a refusing broker is not spun on.
const ERROR_BACKOFF: Duration = Duration::from_millis(10);
/// latency-1k: appends in flight at most; past it the pacer waits (and the
/// wait is charged to the appends, which keep their intended times).
const LATENCY_IN_FLIGHT_MAX: usize = 100_000;
/// How long in-flight appends may take to finish once a scenario ends.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(30);
/// latency-1k: the pacer starts this long after setup, so its first
/// intended times are not already in the past.
const PACER_LEAD: Duration = Duration::from_millis(10);
/// latency-1k: how often the pacer looks again when every slot is taken.
const PACER_FULL_POLL: Duration = Duration::from_micros(100);

/// Runs the selected broker scenarios against `target`.
pub async fn run_all(
    args: &BenchArgs,
    target: &Target,
    store_dir: &std::path::Path,
    figures: &mut Figures,
) -> anyhow::Result<()> {
    let client = Client::connect(&target.endpoint)
        .await
        .with_context(|| format!("connecting to {}", target.endpoint))?;
    client.ping().await.context("PING")?;
    let unix_secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let prefix = format!("bench/{}-{}", unix_secs, std::process::id());
    if args.idle_journals > 0 {
        create_idle_journals(&client, &prefix, args.idle_journals, store_dir).await?;
    }

    if args.wants(Scenario::Append1m) {
        let journals = vec![format!("{prefix}/append-1m")];
        eprintln!(
            "append-1m: {} B appends to {}, {} in flight",
            APPEND_1M_BYTES, journals[0], args.append_depth
        );
        let cpu = crate::cpu::Sample::now();
        let f = with_journals(&client, &journals, |client| {
            throughput(
                client,
                args,
                journals.clone(),
                APPEND_1M_BYTES,
                args.append_depth,
            )
        })
        .await?;
        figures.append_1m = Some(f);
        figures.note_foreign_cpu("append-1m", &cpu);
    }
    if args.wants(Scenario::Latency1k) {
        let journals = vec![format!("{prefix}/latency-1k")];
        eprintln!(
            "latency-1k: {} B appends to {} at {}/s",
            LATENCY_1K_BYTES, journals[0], args.rate
        );
        let cpu = crate::cpu::Sample::now();
        let f = with_journals(&client, &journals, |client| {
            latency(client, args, journals[0].clone(), args.rate)
        })
        .await?;
        figures.latency_1k = Some(f);
        figures.note_foreign_cpu("latency-1k", &cpu);
    }
    if args.wants(Scenario::Fanout64x4k) {
        let journals =
            balanced_names(&client, &format!("{prefix}/fanout"), FANOUT_JOURNALS).await?;
        eprintln!(
            "fanout-64x4k: {} B appends to {} journals, {} in flight each",
            FANOUT_BYTES,
            journals.len(),
            args.fanout_depth
        );
        let cpu = crate::cpu::Sample::now();
        let f = with_journals(&client, &journals, |client| {
            throughput(
                client,
                args,
                journals.clone(),
                FANOUT_BYTES,
                args.fanout_depth,
            )
        })
        .await?;
        figures.fanout_64x4k = Some(f);
        figures.note_foreign_cpu("fanout-64x4k", &cpu);
    }
    if args.wants(Scenario::TailReaders) {
        // Both phases on one shard: the shards' cores differ (one takes
        // the disk's interrupts), and the comparison is of readers only.
        let journals = same_shard_pair(&client, &format!("{prefix}/tail")).await?;
        eprintln!(
            "tail-readers: {} B appends at {}/s to {}, then to {} with {} readers tailing it",
            LATENCY_1K_BYTES, args.rate, journals[0], journals[1], args.tail_readers
        );
        let cpu = crate::cpu::Sample::now();
        let f = with_journals(&client, &journals, |client| {
            crate::tail::run(client, args, &target.endpoint, &journals[0], &journals[1])
        })
        .await?;
        figures.tail_readers = Some(f);
        figures.note_foreign_cpu("tail-readers", &cpu);
    }
    if args.wants(Scenario::Backfill) {
        let cpu = crate::cpu::Sample::now();
        let f = crate::backfill::run(&client, args, target, &prefix, store_dir).await?;
        figures.backfill = Some(f);
        figures.note_foreign_cpu("backfill", &cpu);
    }
    Ok(())
}

/// Creates `journals`, runs `body`, and deletes them again (also when
/// `body` failed), so a long run does not fill the disk.
async fn with_journals<'a, F, Fut, T>(
    client: &'a Client,
    journals: &[String],
    body: F,
) -> anyhow::Result<T>
where
    F: FnOnce(&'a Client) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<T>>,
{
    let specs: Vec<JournalSpec> = journals.iter().map(JournalSpec::new).collect();
    client.apply(&specs).await.context("creating journals")?;
    let result = body(client).await;
    for j in journals {
        if let Err(e) = client.delete(j).await {
            eprintln!("warning: deleting {j}: {e}");
        }
    }
    result
}

/// Most journals `--idle-journals` creates.
pub const IDLE_JOURNALS_MAX: usize = 1_000_000;

/// Creates `count` quiet journals under `prefix/idle/`, each with a
/// `file://` store under `store_dir`, in applies of 10,000.
async fn create_idle_journals(
    client: &Client,
    prefix: &str,
    count: usize,
    store_dir: &std::path::Path,
) -> anyhow::Result<()> {
    let dir = store_dir.join("idle");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let store = format!("file://{}/", dir.display());
    eprintln!("idle journals: creating {count} under {prefix}/idle/, stored in {store}");
    let started = Instant::now();
    let names: Vec<usize> = (0..count).collect();
    for batch in names.chunks(10_000) {
        let specs: Vec<JournalSpec> = batch
            .iter()
            .map(|i| {
                let mut spec = JournalSpec::new(format!("{prefix}/idle/{i:07}"));
                spec.fragment.stores = vec![store.clone()];
                spec
            })
            .collect();
        client
            .apply(&specs)
            .await
            .context("creating idle journals")?;
    }
    eprintln!(
        "idle journals: created in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

/// The broker's shard count, as ROUTE of a name under `prefix` tells it.
async fn shard_count(client: &Client, prefix: &str) -> anyhow::Result<u32> {
    let route = client
        .route(&format!("{prefix}/probe"))
        .await
        .context("ROUTE")?;
    Ok(route.shards.max(1))
}

/// `count` journal names under `prefix`, spread evenly over the shards
/// (names are tried in order and kept while their shard has room).
async fn balanced_names(
    client: &Client,
    prefix: &str,
    count: usize,
) -> anyhow::Result<Vec<String>> {
    let shards = shard_count(client, prefix).await?;
    let per_shard = count.div_ceil(shards as usize);
    let mut taken = vec![0usize; shards as usize];
    let mut names = Vec::with_capacity(count);
    // Every shard gets its share long before this many tries.
    for i in 0..count * 1000 {
        if names.len() == count {
            break;
        }
        let name = format!("{prefix}/j{i:04}");
        let shard = rotary_net::shard_of(&name, shards) as usize;
        if taken[shard] < per_shard {
            taken[shard] += 1;
            names.push(name);
        }
    }
    anyhow::ensure!(
        names.len() == count,
        "could not spread {count} journals over {shards} shards"
    );
    Ok(names)
}

/// Two journal names under `prefix` that live on the same shard.
async fn same_shard_pair(client: &Client, prefix: &str) -> anyhow::Result<Vec<String>> {
    let shards = shard_count(client, prefix).await?;
    let first = format!("{prefix}-alone");
    let shard = rotary_net::shard_of(&first, shards);
    let second = (0..1000)
        .map(|i| format!("{prefix}-read-{i}"))
        .find(|n| rotary_net::shard_of(n, shards) == shard)
        .context("no name on the first journal's shard")?;
    Ok(vec![first, second])
}

/// Deterministic, incompressible-looking content (xorshift).
pub(crate) fn content(len: usize) -> (Bytes, [u8; 20]) {
    let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
    let bytes: Vec<u8> = (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    let sha: [u8; 20] = Sha1::digest(&bytes).into();
    (Bytes::from(bytes), sha)
}

/// Broker counters, to tell what the scenario cost the broker.
#[derive(Default, Clone, Copy)]
struct Counters {
    appends: Option<u64>,
    append_bytes: Option<u64>,
    cross_core_forwards: Option<u64>,
}

async fn counters(client: &Client) -> Counters {
    match client.stats().await {
        Ok(v) => Counters {
            appends: v["appends"].as_u64(),
            append_bytes: v["append_bytes"].as_u64(),
            cross_core_forwards: v["cross_core_forwards"].as_u64(),
        },
        Err(e) => {
            eprintln!("warning: STATS: {e}");
            Counters::default()
        }
    }
}

fn delta(before: Option<u64>, after: Option<u64>) -> Option<u64> {
    Some(after?.saturating_sub(before?))
}

/// The shard of each journal, counted per shard.
async fn journals_per_shard(client: &Client, journals: &[String]) -> Vec<usize> {
    let mut per = Vec::new();
    for j in journals {
        if let Ok(r) = client.route(j).await {
            if per.len() < r.shards as usize {
                per.resize(r.shards as usize, 0);
            }
            if let Some(n) = per.get_mut(r.shard as usize) {
                *n += 1;
            }
        }
    }
    per
}

/// Why an append failed, or `None` if its reply is right.
fn check_reply(
    r: Result<
        Result<rotary_net::wire::AppendReply, rotary_net::client::ClientError>,
        tokio::time::error::Elapsed,
    >,
    len: usize,
    sha: &[u8; 20],
) -> Option<String> {
    match r {
        Err(_) => Some(format!("append took longer than {APPEND_TIMEOUT:?}")),
        Ok(Err(e)) => Some(e.to_string()),
        Ok(Ok(reply)) => {
            if reply.end.checked_sub(reply.begin) != Some(len as u64) {
                Some(format!(
                    "reply [{}, {}) does not span {len} bytes",
                    reply.begin, reply.end
                ))
            } else if &reply.sha1 != sha {
                Some("reply SHA-1 differs from the content's".into())
            } else {
                None
            }
        }
    }
}

/// What one closed-loop worker saw.
struct WorkerResult {
    appends: u64,
    latency: Histogram<u64>,
    errors: u64,
    first_error: Option<String>,
}

/// Appends `content` to `journal` one after another until `end`; counts
/// those that complete inside `[measure_from, end]`.
async fn closed_loop(
    client: Client,
    journal: String,
    content: Bytes,
    sha: [u8; 20],
    measure_from: Instant,
    end: Instant,
    errors_total: Arc<AtomicU64>,
) -> WorkerResult {
    let req = AppendRequest {
        journal,
        ..Default::default()
    };
    let mut out = WorkerResult {
        appends: 0,
        latency: report::histogram(),
        errors: 0,
        first_error: None,
    };
    loop {
        let sent = Instant::now();
        if sent >= end {
            break;
        }
        let r = tokio::time::timeout(APPEND_TIMEOUT, client.append(&req, content.clone())).await;
        let done = Instant::now();
        match check_reply(r, content.len(), &sha) {
            None => {
                if done >= measure_from && done <= end {
                    out.appends += 1;
                    report::record(&mut out.latency, done - sent);
                }
            }
            Some(why) => {
                out.errors += 1;
                out.first_error.get_or_insert(why);
                if errors_total.fetch_add(1, Ordering::Relaxed) + 1 >= ERRORS_MAX {
                    break;
                }
                tokio::time::sleep(ERROR_BACKOFF).await;
            }
        }
    }
    out
}

/// append-1m and fanout-64x4k (and replication): `depth` closed-loop
/// workers per journal.
pub(crate) async fn throughput(
    client: &Client,
    args: &BenchArgs,
    journals: Vec<String>,
    append_bytes: usize,
    depth: usize,
) -> anyhow::Result<ThroughputFigures> {
    let per_shard = journals_per_shard(client, &journals).await;
    let (data, sha) = content(append_bytes);
    let before = counters(client).await;
    let start = Instant::now();
    let measure_from = start + args.warmup();
    let end = measure_from + args.duration();
    let errors_total = Arc::new(AtomicU64::new(0));
    let mut workers = Vec::new();
    for j in &journals {
        for _ in 0..depth {
            workers.push(tokio::spawn(closed_loop(
                client.clone(),
                j.clone(),
                data.clone(),
                sha,
                measure_from,
                end,
                errors_total.clone(),
            )));
        }
    }
    let mut latency = report::histogram();
    let mut appends = 0;
    let mut errors = 0;
    let mut first_error = None;
    for w in workers {
        let r = w.await.context("append worker panicked")?;
        appends += r.appends;
        errors += r.errors;
        if first_error.is_none() {
            first_error = r.first_error;
        }
        latency.add(&r.latency).expect("same histogram bounds");
    }
    let after = counters(client).await;
    let secs = args.duration_secs;
    let bytes = appends * append_bytes as u64;
    if let Some(e) = &first_error {
        eprintln!("warning: {errors} appends failed; first: {e}");
    }
    Ok(ThroughputFigures {
        journals: journals.len(),
        journals_per_shard: per_shard,
        append_bytes,
        depth,
        seconds: secs,
        appends,
        bytes,
        mb_per_s: bytes as f64 / secs / 1e6,
        appends_per_s: appends as f64 / secs,
        latency: Percentiles::of(&latency),
        errors,
        first_error,
        broker_appends: delta(before.appends, after.appends),
        broker_append_bytes: delta(before.append_bytes, after.append_bytes),
        cross_core_forwards: delta(before.cross_core_forwards, after.cross_core_forwards),
    })
}

/// latency-1k's shared tally, written by each append's task.
struct Tally {
    latency: Histogram<u64>,
    service: Histogram<u64>,
    completed: u64,
    errors: u64,
    first_error: Option<String>,
}

fn lock(m: &Mutex<Tally>) -> std::sync::MutexGuard<'_, Tally> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// latency-1k: appends issued on a fixed schedule by a pacer thread, each
/// timed from its intended send time.
pub(crate) async fn latency(
    client: &Client,
    args: &BenchArgs,
    journal: String,
    rate: u64,
) -> anyhow::Result<LatencyFigures> {
    let (data, sha) = content(LATENCY_1K_BYTES);
    let req = Arc::new(AppendRequest {
        journal,
        ..Default::default()
    });
    let tally = Arc::new(Mutex::new(Tally {
        latency: report::histogram(),
        service: report::histogram(),
        completed: 0,
        errors: 0,
        first_error: None,
    }));
    let slots = Arc::new(Semaphore::new(LATENCY_IN_FLIGHT_MAX));
    let before = counters(client).await;
    let start = Instant::now() + PACER_LEAD;
    let measure_from = start + args.warmup();
    let end = measure_from + args.duration();
    let rate_target = rate;
    let pacer = LatencyPacer {
        client: client.clone(),
        req,
        data,
        sha,
        tally: tally.clone(),
        slots: slots.clone(),
        handle: tokio::runtime::Handle::current(),
        start,
        measure_from,
        end,
        rate: u128::from(rate),
    };
    // A thread of its own: tokio's timers tick in milliseconds, far
    // coarser than the 100 µs between appends at 10,000/s.
    let pacer = tokio::task::spawn_blocking(move || pacer.run());
    let (sent, lag, in_flight_max) = pacer.await.context("pacer thread panicked")?;
    // Every slot free again = every append answered.
    let drained = tokio::time::timeout(
        DRAIN_TIMEOUT,
        slots.acquire_many(LATENCY_IN_FLIGHT_MAX as u32),
    )
    .await;
    anyhow::ensure!(
        drained.is_ok(),
        "latency-1k: appends still in flight {DRAIN_TIMEOUT:?} after the end"
    );
    let after = counters(client).await;
    let t = lock(&tally);
    if let Some(e) = &t.first_error {
        eprintln!("warning: {} appends failed; first: {e}", t.errors);
    }
    Ok(LatencyFigures {
        append_bytes: LATENCY_1K_BYTES,
        rate_target,
        seconds: args.duration_secs,
        sent,
        completed: t.completed,
        rate_achieved: t.completed as f64 / args.duration_secs,
        latency: Percentiles::of(&t.latency),
        service: Percentiles::of(&t.service),
        pacer_lag: Percentiles::of(&lag),
        in_flight_max,
        errors: t.errors,
        first_error: t.first_error.clone(),
        cross_core_forwards: delta(before.cross_core_forwards, after.cross_core_forwards),
    })
}

/// latency-1k's pacer: what its thread needs to issue the appends.
struct LatencyPacer {
    client: Client,
    req: Arc<AppendRequest>,
    data: Bytes,
    sha: [u8; 20],
    tally: Arc<Mutex<Tally>>,
    slots: Arc<Semaphore>,
    handle: tokio::runtime::Handle,
    start: Instant,
    measure_from: Instant,
    end: Instant,
    /// Appends per second.
    rate: u128,
}

impl LatencyPacer {
    /// Issues the appends on schedule until the end, an appends' slot not
    /// freed in time, or too many errors. Returns the appends sent in the
    /// measured part, the pacer's lag, and the most appends in flight.
    fn run(self) -> (u64, Histogram<u64>, u64) {
        // Sleeps end within 1 µs instead of 50 µs late: lateness would
        // be charged to every append the pacer issues.
        if let Err(e) = crate::sys::precise_sleeps() {
            eprintln!("warning: PR_SET_TIMERSLACK: {e}");
        }
        let (start, end) = (self.start, self.end);
        let mut lag = report::histogram();
        let mut sent = 0u64;
        let mut in_flight_max = 0u64;
        for i in 0u128.. {
            let offset_ns = i * 1_000_000_000 / self.rate;
            let intended = start + Duration::from_nanos(offset_ns as u64);
            if intended >= end {
                break;
            }
            let now = Instant::now();
            if intended > now {
                std::thread::sleep(intended - now);
            }
            let permit = loop {
                match self.slots.clone().try_acquire_owned() {
                    Ok(p) => break Some(p),
                    Err(_) if Instant::now() >= end + DRAIN_TIMEOUT => break None,
                    Err(_) => std::thread::sleep(PACER_FULL_POLL),
                }
            };
            let Some(permit) = permit else { break };
            if lock(&self.tally).errors >= ERRORS_MAX {
                break;
            }
            let in_flight = (LATENCY_IN_FLIGHT_MAX - self.slots.available_permits()) as u64;
            in_flight_max = in_flight_max.max(in_flight);
            let issued = Instant::now();
            let measured = intended >= self.measure_from;
            if measured {
                sent += 1;
                report::record(&mut lag, issued - intended);
            }
            self.spawn_append(intended, issued, measured, permit);
        }
        (sent, lag, in_flight_max)
    }

    /// One append, timed from `intended` and from `issued` into the tally
    /// if `measured`; its slot is freed when it is answered.
    fn spawn_append(
        &self,
        intended: Instant,
        issued: Instant,
        measured: bool,
        permit: tokio::sync::OwnedSemaphorePermit,
    ) {
        let client = self.client.clone();
        let req = self.req.clone();
        let data = self.data.clone();
        let tally = self.tally.clone();
        let sha = self.sha;
        self.handle.spawn(async move {
            let len = data.len();
            let r = tokio::time::timeout(APPEND_TIMEOUT, client.append(&req, data)).await;
            let done = Instant::now();
            let why = check_reply(r, len, &sha);
            let mut t = lock(&tally);
            match why {
                None if measured => {
                    t.completed += 1;
                    report::record(&mut t.latency, done - intended);
                    report::record(&mut t.service, done - issued);
                }
                None => {}
                Some(why) => {
                    t.errors += 1;
                    t.first_error.get_or_insert(why);
                }
            }
            drop(t);
            drop(permit);
        });
    }
}
