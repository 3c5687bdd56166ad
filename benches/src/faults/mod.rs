//! `--scenario faults`, and the harness of `tests/e2e_faults.rs`: a
//! cluster on etcd under load, broken one way at a time, then checked
//! from outside the brokers.
//!
//! The cluster ([`cluster`]): a real etcd and four `rotary serve --etcd`
//! brokers in four zones, lease TTL 3 s. Journals: three of replication 3
//! and one of replication 2, each with a `file://` store (listed every
//! second; spools seal every 2 s, so the store soon holds every
//! acknowledged byte). Eight writers ([`load`]), two per journal, each
//! with a client that knows every broker and so sends straight to its
//! journal's primary, append self-describing records one at a time.
//!
//! A [`Fault`] strikes the route of the first journal (its primary, a
//! replica, or both), etcd, or every broker in turn, `rounds` times; after
//! each, the cluster is healed and the run waits until every journal has
//! an append acknowledged again. Then the writers stop, each journal takes
//! one last append once its route settled (which synchronizes a member
//! that joined after the writers' last append), and [`check`] looks at
//! every member's own copy and at the store's files.
//!
//! The outcome ([`Outcome`]) counts acknowledged and failed appends, the
//! longest gap between two acknowledgements of a journal, and the
//! violations the checks found. Nothing here judges timings.
#![allow(clippy::disallowed_methods)] // Benchmarks measure real time.

pub mod check;
pub mod cluster;
pub mod load;

use anyhow::Context as _;
use cluster::{Cluster, Net};
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// The lease TTL of the brokers.
pub const TTL: Duration = Duration::from_secs(3);
/// Writers, each with a client of its own, two per journal: a journal's
/// outage stalls its own writers only, so each journal's longest gap
/// between acknowledgements is its own.
const WRITERS: usize = 2 * JOURNALS.len();
/// How long a writer's client keeps trying an append while its journal's
/// route moves (past the longest fault).
const WRITER_RETRY: Duration = Duration::from_secs(30);
/// How long a writer waits on a silent connection before it probes it (it
/// gives up at twice this): a paused broker answers nothing.
const WRITER_SILENCE: Duration = Duration::from_secs(1);
/// How long the cluster may take to route every journal to healthy
/// brokers, or to have an append acknowledged on each, after a fault.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a paused or cut-off broker stays so after its journal moved
/// away from it: well past its lease.
const PAST_LEASE: Duration = Duration::from_secs(2);
/// Fault runs at once in one process (each is five processes); more
/// wait. `ROTARY_FAULT_CLUSTERS` overrides.
const CLUSTERS_AT_ONCE_DEFAULT: usize = 2;

/// The journals of a run: name and replication. Faults strike the first.
pub const JOURNALS: [(&str, usize); 4] = [
    ("faults/r3-a", 3),
    ("faults/r3-b", 3),
    ("faults/r3-c", 3),
    ("faults/r2-d", 2),
];

/// One way to break the cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Fault {
    /// SIGKILL the primary; start it again once its journal moved.
    KillPrimary,
    /// SIGKILL a replica; start it again once its journal moved.
    KillReplica,
    /// SIGSTOP the primary, with appends queued on it, until its journal
    /// moved and its lease is long gone; then SIGCONT.
    StopPrimary,
    /// SIGSTOP a replica past its lease; then SIGCONT.
    StopReplica,
    /// SIGKILL the primary and a replica together; start both after the
    /// lease TTL and 2 s (the journal has too few brokers meanwhile).
    KillTwo,
    /// SIGSTOP the primary and a replica together for twice the TTL.
    StopTwo,
    /// SIGSTOP etcd for twice the TTL and 1 s; then SIGCONT.
    StopEtcd,
    /// SIGKILL etcd; start it again (same data) after twice the TTL.
    KillEtcd,
    /// SIGTERM every broker in turn and start it again.
    RollingRestart,
    /// Cut the primary off the network until its journal moved and its
    /// lease is long gone; then join it again.
    PartitionPrimary,
    /// The same of a replica.
    PartitionReplica,
}

impl Fault {
    pub const ALL: [Fault; 11] = [
        Fault::KillPrimary,
        Fault::KillReplica,
        Fault::StopPrimary,
        Fault::StopReplica,
        Fault::KillTwo,
        Fault::StopTwo,
        Fault::StopEtcd,
        Fault::KillEtcd,
        Fault::RollingRestart,
        Fault::PartitionPrimary,
        Fault::PartitionReplica,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Fault::KillPrimary => "kill-primary",
            Fault::KillReplica => "kill-replica",
            Fault::StopPrimary => "stop-primary",
            Fault::StopReplica => "stop-replica",
            Fault::KillTwo => "kill-two",
            Fault::StopTwo => "stop-two",
            Fault::StopEtcd => "stop-etcd",
            Fault::KillEtcd => "kill-etcd",
            Fault::RollingRestart => "rolling-restart",
            Fault::PartitionPrimary => "partition-primary",
            Fault::PartitionReplica => "partition-replica",
        }
    }

    fn needs_namespaces(self) -> bool {
        matches!(self, Fault::PartitionPrimary | Fault::PartitionReplica)
    }
}

/// What one run did and found.
#[derive(Debug, serde::Serialize)]
pub struct Outcome {
    pub fault: Fault,
    pub rounds: usize,
    pub acked: usize,
    pub failed: usize,
    /// The longest time between two acknowledged appends of one journal,
    /// and that journal.
    pub longest_gap_ms: u64,
    pub longest_gap_journal: String,
    /// Violations found by the checks, per kind, and the first few.
    pub violation_counts: std::collections::BTreeMap<String, usize>,
    pub violations: Vec<String>,
    /// The first few failed appends.
    pub failures: Vec<String>,
    /// Where the processes' logs are (kept when a check failed).
    pub logs: String,
}

impl Outcome {
    pub fn passed(&self) -> bool {
        self.violation_counts.is_empty()
    }

    /// One line of figures.
    pub fn summary(&self) -> String {
        format!(
            "{}: {} rounds, {} appends acknowledged, {} failed, longest gap between acks {} ms ({}); checks {}",
            self.fault.name(),
            self.rounds,
            self.acked,
            self.failed,
            self.longest_gap_ms,
            self.longest_gap_journal,
            if self.passed() {
                "passed".to_string()
            } else {
                format!("FAILED: {:?}", self.violation_counts)
            }
        )
    }

    /// The summary, every violation listed, and the first failures.
    pub fn details(&self) -> String {
        let mut out = self.summary();
        for v in &self.violations {
            out.push_str(&format!("\n  violation: {v}"));
        }
        for f in &self.failures {
            out.push_str(&format!("\n  failed append: {f}"));
        }
        out.push_str(&format!("\n  logs: {}", self.logs));
        out
    }
}

/// Admits at most `ROTARY_FAULT_CLUSTERS` runs at once; the slot is
/// given back when dropped.
struct Slot;

static RUNNING: AtomicUsize = AtomicUsize::new(0);

impl Slot {
    async fn take() -> Slot {
        let max = std::env::var("ROTARY_FAULT_CLUSTERS")
            .ok()
            .and_then(|s| s.parse().ok())
            .filter(|n| *n > 0)
            .unwrap_or(CLUSTERS_AT_ONCE_DEFAULT);
        loop {
            let got = RUNNING.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < max).then_some(n + 1)
            });
            if got.is_ok() {
                return Slot;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        RUNNING.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Set (to anything) to keep every run's directory, logs and data.
pub const KEEP_ENV: &str = "ROTARY_FAULT_KEEP";

/// Runs `fault` `rounds` times on a fresh cluster of `exe` (`rotary`)
/// in a temporary directory under `dir`, which is removed afterwards
/// unless a check failed, an append failed, or [`KEEP_ENV`] is set. An error is a run that could not be carried
/// out (a process did not start, the cluster did not recover in time).
pub async fn run(exe: &Path, dir: &Path, fault: Fault, rounds: usize) -> anyhow::Result<Outcome> {
    let _slot = Slot::take().await;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let scratch = tempfile::Builder::new()
        .prefix(&format!("rotary-{}-", fault.name()))
        .tempdir_in(dir)
        .context("a directory for the run")?;
    let net = if fault.needs_namespaces() {
        Net::namespaces().context("network namespaces for a partition (root and iproute2)")?
    } else {
        Net::Loopback
    };
    let mut cluster = match Cluster::start(exe, scratch.path(), TTL, net).await {
        Ok(c) => c,
        Err(e) => {
            let kept = scratch.keep();
            anyhow::bail!("{}: {e:#} (logs kept in {})", fault.name(), kept.display());
        }
    };
    let result = run_on(&mut cluster, scratch.path(), fault, rounds).await;
    let outcome = match result {
        Ok(o) => o,
        Err(e) => {
            let logs = cluster.log_tails(60);
            drop(cluster);
            let kept = scratch.keep();
            anyhow::bail!(
                "{}: {e:#} (logs kept in {})\n{logs}",
                fault.name(),
                kept.display()
            );
        }
    };
    drop(cluster);
    if outcome.passed() && outcome.failed == 0 && std::env::var_os(KEEP_ENV).is_none() {
        drop(scratch);
    } else {
        let _ = scratch.keep();
    }
    Ok(outcome)
}

async fn run_on(
    cluster: &mut Cluster,
    dir: &Path,
    fault: Fault,
    rounds: usize,
) -> anyhow::Result<Outcome> {
    let store = dir.join("store");
    std::fs::create_dir_all(&store).context("the store directory")?;
    let all: Vec<usize> = (0..cluster.brokers.len()).collect();
    let admin = cluster
        .client_of(&all, WRITER_RETRY, WRITER_SILENCE)
        .await?;
    let specs: String = JOURNALS
        .iter()
        .map(|(name, r)| {
            format!(
                "- {{name: {name}, replication: {r}, fragment: {{stores: [\"file://{}/\"], \
                 refresh_interval: 1s, flush_interval: 2s, compression_codec: none, length: 4194304}}}}\n",
                store.display()
            )
        })
        .collect();
    let specs = rotary_net::spec::parse_specs(&specs).context("the journals' specs")?;
    admin.apply(&specs).await.context("applying the journals")?;
    for (name, r) in JOURNALS {
        cluster.settled(name, r, SETTLE_TIMEOUT).await?;
    }
    let names: Vec<String> = JOURNALS.iter().map(|(n, _)| n.to_string()).collect();
    let mut clients = Vec::new();
    for _ in 0..WRITERS {
        clients.push(
            cluster
                .client_of(&all, WRITER_RETRY, WRITER_SILENCE)
                .await?,
        );
    }
    let writers = load::Writers::start(clients, &names);
    writers
        .wait_acked_after(Instant::now(), names.len(), SETTLE_TIMEOUT)
        .await
        .context("the first appends")?;
    tokio::time::sleep(Duration::from_secs(1)).await;

    for round in 0..rounds {
        for (name, r) in JOURNALS {
            cluster.settled(name, r, SETTLE_TIMEOUT).await?;
        }
        let began = Instant::now();
        inject(cluster, fault, &writers)
            .await
            .with_context(|| format!("{} round {}", fault.name(), round + 1))?;
        let healed = Instant::now();
        for (name, r) in JOURNALS {
            cluster.settled(name, r, SETTLE_TIMEOUT).await?;
        }
        writers
            .wait_acked_after(healed, names.len(), SETTLE_TIMEOUT)
            .await
            .with_context(|| format!("after {} round {}", fault.name(), round + 1))?;
        eprintln!(
            "faults: {} round {} of {}: healed after {:?}, every journal acknowledging again after {:?}",
            fault.name(),
            round + 1,
            rounds,
            healed - began,
            began.elapsed()
        );
        // The faulted brokers have a moment to do whatever they would do.
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let mut log = writers.finish().await;
    let (longest_gap_ms, longest_gap_journal) = longest_gap(&log);
    last_appends(cluster, &admin, &mut log).await?;

    let journals: Vec<check::Journal> = JOURNALS
        .iter()
        .enumerate()
        .map(|(i, (name, r))| check::Journal {
            name,
            replication: *r,
            acks: log.acks.iter().filter(|a| a.journal == i).collect(),
        })
        .collect();
    let mut v = check::check(cluster, &journals, &store, SETTLE_TIMEOUT).await;
    for bad in &log.bad_acks {
        v.add("bad ack", bad.clone());
    }
    Ok(Outcome {
        fault,
        rounds,
        acked: log.acks.len(),
        failed: log.failures.len(),
        longest_gap_ms,
        longest_gap_journal,
        violation_counts: v.counts,
        violations: v.listed,
        failures: log
            .failures
            .iter()
            .take(5)
            .map(|(_, f)| f.clone())
            .collect(),
        logs: dir.display().to_string(),
    })
}

/// The writer id of [`last_appends`]' records.
const LAST_WRITER: u32 = u32::MAX;

/// One more append to each journal once its route settled, logged with the
/// writers' acks. A broker that joined a journal's route after its last
/// append holds what it missed only once the primary synchronizes it, at
/// the next append; after this one every member of the route must hold
/// every acknowledged append, and the checks hold each to it.
async fn last_appends(
    cluster: &Cluster,
    client: &rotary_net::client::Client,
    log: &mut load::Log,
) -> anyhow::Result<()> {
    for (i, (name, r)) in JOURNALS.iter().enumerate() {
        cluster.settled(name, *r, SETTLE_TIMEOUT).await?;
        let content = load::record(LAST_WRITER, 0, load::RECORD_HEADER_LEN + 64);
        let req = rotary_net::wire::AppendRequest {
            journal: name.to_string(),
            ..Default::default()
        };
        let sent = Instant::now();
        let reply = client
            .append(&req, content.clone())
            .await
            .with_context(|| format!("the last append to {name}"))?;
        if reply.sha1 != load::sha1(&content) || reply.end - reply.begin != content.len() as u64 {
            log.bad_acks.push(format!(
                "{name}: the last append acknowledged at [{}, {}) with SHA-1 {}",
                reply.begin,
                reply.end,
                load::hex(&reply.sha1)
            ));
        }
        log.acks.push(load::Ack {
            journal: i,
            writer: LAST_WRITER,
            seq: 0,
            begin: reply.begin,
            end: reply.end,
            sha1: reply.sha1,
            sent,
            acked: Instant::now(),
        });
    }
    Ok(())
}

/// The longest time between consecutive acknowledgements of one journal.
fn longest_gap(log: &load::Log) -> (u64, String) {
    let mut best = (0, String::new());
    for (i, (name, _)) in JOURNALS.iter().enumerate() {
        let mut at: Vec<Instant> = log
            .acks
            .iter()
            .filter(|a| a.journal == i)
            .map(|a| a.acked)
            .collect();
        at.sort_unstable();
        for w in at.windows(2) {
            let ms = (w[1] - w[0]).as_millis() as u64;
            if ms > best.0 {
                best = (ms, name.to_string());
            }
        }
    }
    best
}

/// Breaks the cluster as `fault` says and heals it again; returns once it
/// is healed (not necessarily recovered).
async fn inject(
    cluster: &mut Cluster,
    fault: Fault,
    writers: &load::Writers,
) -> anyhow::Result<()> {
    let (target, r) = JOURNALS[0];
    let route = cluster.route(target).await?.route;
    let primary = cluster.index(&route.primary)?;
    // The replica struck: one whose loss with the primary's leaves the
    // journal of replication 2 a member (losing every member of a journal
    // is beyond what replication promises).
    let (small, _) = JOURNALS[JOURNALS.len() - 1];
    let small = cluster.route(small).await?.route.members;
    let replicas: Vec<&String> = route
        .members
        .iter()
        .filter(|m| **m != route.primary)
        .collect();
    let replica = replicas
        .iter()
        .find(|m| small.iter().any(|s| s != **m && *s != route.primary))
        .or(replicas.first())
        .context("a replica")
        .and_then(|m| cluster.index(m))?;
    let ttl = cluster.ttl;
    match fault {
        Fault::KillPrimary | Fault::KillReplica => {
            let i = if fault == Fault::KillPrimary {
                primary
            } else {
                replica
            };
            cluster.kill_broker(i);
            cluster.settled(target, r, SETTLE_TIMEOUT).await?;
            cluster.start_broker(i).await?;
        }
        Fault::StopPrimary | Fault::StopReplica => {
            let i = if fault == Fault::StopPrimary {
                primary
            } else {
                replica
            };
            cluster.pause_broker(i).await?;
            let moved = cluster.settled(target, r, SETTLE_TIMEOUT).await;
            tokio::time::sleep(PAST_LEASE).await;
            cluster.resume_broker(i)?;
            moved?;
        }
        Fault::PartitionPrimary | Fault::PartitionReplica => {
            let i = if fault == Fault::PartitionPrimary {
                primary
            } else {
                replica
            };
            cluster.partition_broker(i)?;
            let moved = cluster.settled(target, r, SETTLE_TIMEOUT).await;
            tokio::time::sleep(PAST_LEASE).await;
            cluster.heal_broker(i)?;
            moved?;
        }
        Fault::KillTwo => {
            cluster.kill_broker(primary);
            cluster.kill_broker(replica);
            tokio::time::sleep(ttl + PAST_LEASE).await;
            cluster.start_broker(primary).await?;
            cluster.start_broker(replica).await?;
        }
        Fault::StopTwo => {
            cluster.pause_broker(primary).await?;
            cluster.pause_broker(replica).await?;
            tokio::time::sleep(ttl * 2).await;
            cluster.resume_broker(primary)?;
            cluster.resume_broker(replica)?;
        }
        Fault::StopEtcd => {
            let pid = cluster.etcd.pid().context("etcd not running")?;
            cluster::stop_process(pid).await?;
            tokio::time::sleep(ttl * 2 + Duration::from_secs(1)).await;
            cluster::signal(pid, libc::SIGCONT)?;
        }
        Fault::KillEtcd => {
            cluster.etcd.kill();
            tokio::time::sleep(ttl * 2).await;
            cluster.etcd.start().await?;
        }
        Fault::RollingRestart => {
            for i in 0..cluster.brokers.len() {
                let began = Instant::now();
                cluster.stop_broker_graceful(i).await?;
                cluster.start_broker(i).await?;
                for (name, r) in JOURNALS {
                    cluster.settled(name, r, SETTLE_TIMEOUT).await?;
                }
                writers
                    .wait_acked_after(began, JOURNALS.len(), SETTLE_TIMEOUT)
                    .await
                    .with_context(|| format!("after restarting {}", cluster.brokers[i].id))?;
            }
        }
    }
    Ok(())
}

/// `rotary bench --scenario faults`: each of `faults` (all if empty)
/// `rounds` times, one fresh cluster per fault, under `dir`.
pub fn bench(
    exe: &Path,
    dir: &Path,
    faults: &[Fault],
    rounds: usize,
) -> anyhow::Result<Vec<Outcome>> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("the clients' runtime")?;
    let faults = if faults.is_empty() {
        &Fault::ALL[..]
    } else {
        faults
    };
    let mut out = Vec::new();
    for &fault in faults {
        eprintln!("faults: {} × {rounds}", fault.name());
        match rt.block_on(run(exe, dir, fault, rounds)) {
            Ok(o) => {
                eprintln!("{}", o.details());
                out.push(o);
            }
            Err(e) => {
                eprintln!("faults: {} could not be carried out: {e:#}", fault.name());
                out.push(Outcome {
                    fault,
                    rounds,
                    acked: 0,
                    failed: 0,
                    longest_gap_ms: 0,
                    longest_gap_journal: String::new(),
                    violation_counts: [("run".to_string(), 1)].into_iter().collect(),
                    violations: vec![format!("{e:#}")
                        .lines()
                        .next()
                        .unwrap_or_default()
                        .to_string()],
                    failures: Vec::new(),
                    logs: String::new(),
                });
            }
        }
    }
    Ok(out)
}

/// The table of `rotary bench --scenario faults`.
pub fn table(outcomes: &[Outcome]) -> String {
    let mut out = String::from("fault               rounds   acked  failed  longest gap  checks\n");
    for o in outcomes {
        out.push_str(&format!(
            "{:<18} {:>7} {:>7} {:>7} {:>9} ms  {}\n",
            o.fault.name(),
            o.rounds,
            o.acked,
            o.failed,
            o.longest_gap_ms,
            if o.passed() {
                "passed".to_string()
            } else {
                format!("FAILED {:?}", o.violation_counts)
            }
        ));
    }
    out
}
