//! `--scenario failover`: a cluster on etcd loses its primary, again and
//! again, under load.
//!
//! A real `etcd` (Debian's `etcd-server`, or `$ROTARY_ETCD`) and four
//! `rotary serve --etcd` brokers of one shard each, lease TTL
//! `--failover-ttl`. Two writers append 1 KiB records to a journal of
//! replication 3, each waiting for its ack, retrying while the route moves.
//! Ten times: SIGKILL the journal's primary, time until the first append
//! is acknowledged after the kill, start the killed broker again (it joins
//! as a new member) and wait for the journal to have three live members
//! again. Then every acknowledged record is looked for at its offsets
//! (appends lost must be 0), and, with the writers stopped, etcd's
//! revision is watched for a minute over 100 idle journals: the writes an
//! idle cluster makes per journal and hour (the target is 0; lease
//! keep-alives are not writes).
#![allow(clippy::disallowed_methods)] // Benchmarks measure real time.

use crate::child::ChildGuard;
use anyhow::Context;
use rotary_net::client::{Client, ClientOptions};
use rotary_net::wire::AppendRequest;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Brokers of the scenario; a journal of replication 3 survives one loss.
const BROKERS: usize = 4;
/// Primaries killed, one after another.
pub const KILLS: usize = 10;
/// Idle journals whose etcd writes are counted.
const IDLE_JOURNALS: usize = 100;
/// How long etcd's revision is watched in the idle cluster.
const IDLE_WATCH: Duration = Duration::from_secs(60);
/// Record size and writers.
const RECORD_BYTES: usize = 1024;
const WRITERS: u32 = 2;
/// How long a route may take to be whole again after a restart.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(60);

/// What the scenario measured.
#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct Failover {
    pub lease_ttl_ms: u64,
    /// Per kill: milliseconds from SIGKILL to the first acknowledged append.
    pub first_ack_ms: Vec<u64>,
    pub acked: usize,
    pub lost: usize,
    /// etcd revisions in `IDLE_WATCH` over `IDLE_JOURNALS` idle journals,
    /// as writes per journal and hour.
    pub idle_writes_per_journal_hour: f64,
}

impl Failover {
    /// The p50 and max of the times to the first ack.
    pub fn summary(&self) -> String {
        let mut t = self.first_ack_ms.clone();
        t.sort_unstable();
        let p50 = t.get(t.len() / 2).copied().unwrap_or(0);
        let max = t.last().copied().unwrap_or(0);
        format!(
            "failover: {} kills, lease TTL {} ms: first ack after SIGKILL p50 {p50} ms, max {max} ms \
             (target TTL + 1 s = {} ms); {} appends acknowledged, {} lost; idle cluster: {:.2} etcd \
             writes per journal per hour",
            t.len(),
            self.lease_ttl_ms,
            self.lease_ttl_ms + 1000,
            self.acked,
            self.lost,
            self.idle_writes_per_journal_hour
        )
    }
}

struct Broker {
    id: String,
    endpoint: String,
    data: PathBuf,
    log: PathBuf,
    child: Option<ChildGuard>,
}

struct Cluster {
    exe: PathBuf,
    etcd: rotary_etcd::testing::Etcd,
    ttl: Duration,
    brokers: Vec<Broker>,
    /// The journal's fragment store (a directory).
    store: PathBuf,
}

impl Cluster {
    fn start_broker(&mut self, i: usize) -> anyhow::Result<()> {
        let b = &mut self.brokers[i];
        let out = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&b.log)
            .with_context(|| format!("opening {}", b.log.display()))?;
        let err = out.try_clone().context("log file")?;
        let child = Command::new(&self.exe)
            .args(["serve", "--etcd", &self.etcd.endpoint(), "--id", &b.id])
            .args(["--zone", &format!("zone-{i}"), "--listen", &b.endpoint])
            .arg("--lease-ttl")
            .arg(format!("{}ms", self.ttl.as_millis()))
            .arg("--data")
            .arg(&b.data)
            .args(["--cores", "1", "--disk-reserve", "0"])
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .with_context(|| format!("starting broker {}", b.id))?;
        b.child = Some(ChildGuard(child));
        Ok(())
    }

    fn endpoints(&self) -> String {
        let all: Vec<&str> = self.brokers.iter().map(|b| b.endpoint.as_str()).collect();
        all.join(",")
    }

    /// Waits until `journal`'s route has three members, all running.
    async fn settled(&self, client: &Client, journal: &str) -> anyhow::Result<Vec<String>> {
        let deadline = Instant::now() + SETTLE_TIMEOUT;
        loop {
            if let Ok(list) = client.list("").await {
                if let Some(j) = list.iter().find(|j| j.spec.name == journal) {
                    let live = j
                        .route
                        .members
                        .iter()
                        .all(|m| self.brokers.iter().any(|b| b.id == *m && b.child.is_some()));
                    if j.route.members.len() == 3 && live {
                        return Ok(j.route.members.clone());
                    }
                }
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "{journal} has no route of 3 live brokers after {SETTLE_TIMEOUT:?}"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

/// When each acknowledged append was sent, and when its ack came.
type Times = Arc<Mutex<Vec<(Instant, Instant)>>>;

/// Acknowledged records: (writer, sequence) → the offsets of their append.
type Acked = Arc<Mutex<BTreeMap<(u32, u64), (u64, u64)>>>;

/// Runs the scenario in `dir`.
pub fn run(exe: &Path, dir: &Path, ttl: Duration) -> anyhow::Result<Failover> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let etcd = rotary_etcd::testing::Etcd::start().map_err(|e| anyhow::anyhow!("{e}"))?;
    let mut cluster = Cluster {
        exe: exe.to_path_buf(),
        etcd,
        ttl,
        brokers: Vec::new(),
        store: dir.join("store"),
    };
    for i in 0..BROKERS {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        cluster.brokers.push(Broker {
            id: format!("b{}", i + 1),
            endpoint: format!("127.0.0.1:{port}"),
            data: dir.join(format!("b{}", i + 1)),
            log: dir.join(format!("b{}.log", i + 1)),
            child: None,
        });
        cluster.start_broker(i)?;
    }
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("the client's runtime")?;
    rt.block_on(measure(&mut cluster))
}

async fn measure(cluster: &mut Cluster) -> anyhow::Result<Failover> {
    let client = connect(&cluster.endpoints()).await?;
    let journal = "bench/failover";
    apply(&client, journal, 3, &cluster.store).await?;
    cluster.settled(&client, journal).await?;
    let acked: Acked = Arc::default();
    let times: Times = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let writers: Vec<_> = (0..WRITERS)
        .map(|w| {
            tokio::spawn(write(
                client.clone(),
                journal,
                w,
                acked.clone(),
                times.clone(),
                stop.clone(),
            ))
        })
        .collect();
    let mut first_ack_ms = Vec::new();
    for kill in 0..KILLS {
        let route = cluster.settled(&client, journal).await?;
        tokio::time::sleep(Duration::from_millis(500)).await;
        let i = cluster
            .brokers
            .iter()
            .position(|b| b.id == route[0])
            .context("primary")?;
        let killed_at = Instant::now();
        cluster.brokers[i].child.take();
        let first = loop {
            // The first ack of an append sent after the kill: an append in
            // flight at the kill may be acknowledged by the dying primary.
            let after = times
                .lock()
                .expect("times")
                .iter()
                .filter(|(sent, _)| *sent > killed_at)
                .map(|(_, acked)| *acked)
                .min();
            if let Some(t) = after {
                break t;
            }
            anyhow::ensure!(
                killed_at.elapsed() < SETTLE_TIMEOUT,
                "no append acknowledged after kill {kill}"
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        };
        first_ack_ms.push((first - killed_at).as_millis() as u64);
        eprintln!(
            "failover: kill {} of {}: first ack after {} ms",
            kill + 1,
            KILLS,
            first_ack_ms[kill]
        );
        cluster.start_broker(i)?;
    }
    stop.store(true, Ordering::Relaxed);
    for w in writers {
        w.await.context("writer")??;
    }
    let acked = acked.lock().expect("acked").clone();
    // A broker lists the store every refresh_interval (1 s here): history
    // another broker uploaded after the primary's last listing is read
    // once the next listing found it.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let lost = count_lost(&client, journal, &acked).await?;
    report_store(&cluster.store.join(journal));
    let idle = idle_writes(cluster, &client).await?;
    Ok(Failover {
        lease_ttl_ms: cluster.ttl.as_millis() as u64,
        first_ack_ms,
        acked: acked.len(),
        lost,
        idle_writes_per_journal_hour: idle,
    })
}

async fn connect(endpoints: &str) -> anyhow::Result<Client> {
    let options = ClientOptions {
        retry_for: SETTLE_TIMEOUT,
        ..ClientOptions::default()
    };
    let deadline = Instant::now() + SETTLE_TIMEOUT;
    loop {
        match Client::connect_with(endpoints, options.clone()).await {
            Ok(c) => return Ok(c),
            Err(e) if Instant::now() > deadline => {
                return Err(e).context("connecting to the brokers")
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// Applies the journal, with a `file://` store listed every second:
/// replicas added after a kill hold only the bytes from their join on, and
/// the history before it is read from the store.
async fn apply(
    client: &Client,
    journal: &str,
    replication: u32,
    store: &Path,
) -> anyhow::Result<()> {
    let spec = format!(
        "- {{name: {journal}, replication: {replication}, fragment: {{stores: [\"file://{}/\"], refresh_interval: 1s}}}}\n",
        store.display()
    );
    let specs = rotary_net::spec::parse_specs(&spec).context("spec")?;
    client.apply(&specs).await.context("applying the journal")?;
    Ok(())
}

/// A record: writer and sequence number, then filler to `RECORD_BYTES`.
fn record(writer: u32, seq: u64) -> Vec<u8> {
    let mut r = vec![(writer as u8).wrapping_add(seq as u8); RECORD_BYTES];
    r[..4].copy_from_slice(&writer.to_le_bytes());
    r[4..12].copy_from_slice(&seq.to_le_bytes());
    r
}

async fn write(
    client: Client,
    journal: &str,
    writer: u32,
    acked: Acked,
    times: Times,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<()> {
    let req = AppendRequest {
        journal: journal.to_string(),
        ..AppendRequest::default()
    };
    let mut seq = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let sent = Instant::now();
        match client.append(&req, record(writer, seq)).await {
            Ok(r) => {
                acked
                    .lock()
                    .expect("acked")
                    .insert((writer, seq), (r.begin, r.end));
                times.lock().expect("times").push((sent, Instant::now()));
            }
            Err(e) => eprintln!("failover: writer {writer}, append {seq} failed: {e}"),
        }
        seq += 1;
    }
    Ok(())
}

/// Acknowledged records not found at their offsets.
async fn count_lost(
    client: &Client,
    journal: &str,
    acked: &BTreeMap<(u32, u64), (u64, u64)>,
) -> anyhow::Result<usize> {
    let end = acked.values().map(|(_, e)| *e).max().unwrap_or(0);
    let mut bytes = Vec::with_capacity(end as usize);
    let req = rotary_net::wire::ReadRequest {
        journal: journal.to_string(),
        offset: Some(0),
        end_offset: Some(end),
        route_revision: 0,
    };
    let mut stream = client
        .read(&req, false, false)
        .await
        .context("reading the journal")?;
    while let Some(event) = stream.next().await {
        if let rotary_net::client::ReadEvent::Data { offset, content } = event.context("read")? {
            // A gap (bytes no broker or store holds) stays zeroes: lost.
            bytes.resize(offset as usize, 0);
            bytes.extend_from_slice(&content);
        }
    }
    let lost: Vec<(u64, u64)> = acked
        .iter()
        .filter(|((w, s), (b, e))| bytes.get(*b as usize..*e as usize) != Some(&record(*w, *s)[..]))
        .map(|(_, span)| *span)
        .collect();
    if let (Some(first), Some(last)) = (lost.first(), lost.last()) {
        let zeroes = lost
            .iter()
            .filter(|(b, e)| {
                bytes
                    .get(*b as usize..*e as usize)
                    .is_none_or(|s| s.iter().all(|x| *x == 0))
            })
            .count();
        eprintln!(
            "failover: {} acknowledged records not read back, from offset {} to {}; {zeroes} of them in spans the read skipped",
            lost.len(),
            first.0,
            last.1
        );
    }
    Ok(lost.len())
}

/// etcd writes per journal and hour while nothing happens: 100 journals
/// more, assigned and settled, then etcd's revision over a minute.
async fn idle_writes(cluster: &Cluster, client: &Client) -> anyhow::Result<f64> {
    let specs: String = (0..IDLE_JOURNALS)
        .map(|i| format!("- {{name: bench/idle-{i:03}, replication: 3}}\n"))
        .collect();
    let specs = rotary_net::spec::parse_specs(&specs).context("specs")?;
    client
        .apply(&specs)
        .await
        .context("applying idle journals")?;
    for s in &specs {
        cluster.settled(client, &s.name).await?;
    }
    // The primaries record their synchronized routes a moment later.
    tokio::time::sleep(cluster.ttl * 2).await;
    let etcd = rotary_etcd::Client::connect(&[cluster.etcd.endpoint()], Default::default())
        .await
        .context("connecting to etcd")?;
    let before = etcd
        .get(b"/".to_vec())
        .await
        .context("etcd revision")?
        .revision;
    tokio::time::sleep(IDLE_WATCH).await;
    let after = etcd
        .get(b"/".to_vec())
        .await
        .context("etcd revision")?
        .revision;
    let per_hour = (after - before) as f64 * 3600.0 / IDLE_WATCH.as_secs_f64();
    Ok(per_hour / IDLE_JOURNALS as f64)
}

/// Prints the spans the store's fragments of the journal cover, and the
/// gaps between them.
fn report_store(dir: &Path) {
    let mut spans: Vec<(u64, u64)> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            let mut parts = name.split('-');
            let b = u64::from_str_radix(parts.next()?, 16).ok()?;
            let e = u64::from_str_radix(parts.next()?, 16).ok()?;
            Some((b, e))
        })
        .collect();
    spans.sort_unstable();
    let mut covered = 0u64;
    let mut gaps = Vec::new();
    for (b, e) in &spans {
        if *b > covered {
            gaps.push((covered, *b));
        }
        covered = covered.max(*e);
    }
    eprintln!(
        "failover: the store holds {} fragments up to offset {covered}; gaps: {gaps:?}",
        spans.len()
    );
}
