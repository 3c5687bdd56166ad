//! The replication scenario: what synchronous replication to three brokers
//! costs an append, against no replication, on the same primary in one run.
//!
//! 0. Hop floor ([`HopFloor`]): before any broker starts, 1 KiB round
//!    trips through echo servers placed as the brokers will be, one path
//!    as a rep-1 append crosses processes and one as a rep-3 append does.
//! 1. Cluster: three child processes of this executable (`rotary serve
//!    --cluster FILE --id bN --cores 1 --cpus C --disk-reserve 0`: the
//!    primary `b1` alone on core 0, the replicas on the other cores, shared
//!    if there are fewer than two), brokers `b1`,
//!    `b2`, `b3` in zones `a`, `b`, `c` on free ports of 127.0.0.1, each with
//!    its data directory and its log (stdout and stderr) in the scratch
//!    directory. Each must answer PING before the run goes on. Each is
//!    stopped by its PID at the end, also on error; a broker that exits on
//!    its own fails the run, and on any failure (or failed append) the tail
//!    of every broker's log is printed.
//! 2. Journals: one with `replication: 1` and one with `replication: 3`,
//!    default specs otherwise, their names tried (by ROUTE) until `b1` is the
//!    primary of both, so both phases load the same broker. Applied through
//!    `b1` and awaited on every broker, with whole routes.
//! 3. 1 KiB appends at `--replication-rate` per second (latency-1k's pacer,
//!    latency from each append's intended send time), to the rep-1 journal,
//!    then to the rep-3 journal. First, while the journals are fresh.
//! 4. 1 MiB appends, `--replication-depth` in flight (append-1m's closed loop),
//!    to each journal.
//! 5. Around each phase: the primary's STATS counters (acks per ack frame =
//!    `repl_acks` ÷ `repl_ack_frames` over the two rep-3 phases) and the CPU
//!    time of each broker process.
//!
//! The journals are not deleted: the brokers and their data directories go
//! at the end of the scenario.
#![allow(clippy::disallowed_methods)] // Benchmarks measure real time.

use crate::child::ChildGuard;
use crate::load;
use crate::report::{LatencyFigures, Percentiles, ThroughputFigures};
use crate::BenchArgs;
use anyhow::Context as _;
use rotary_net::client::Client;
use rotary_net::spec::JournalSpec;
use serde::Serialize;
use std::collections::BTreeMap;
use std::fs::File;
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The brokers: id and zone. One zone each, so a rep-3 route takes all three.
const BROKERS: [(&str, &str); 3] = [("b1", "a"), ("b2", "b"), ("b3", "c")];
/// The broker that must be primary of both journals.
const PRIMARY: &str = "b1";
/// Appends of the throughput phases.
const APPEND_1M_BYTES: usize = 1 << 20;
/// How long a broker may take to answer PING after it was started.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
const READY_POLL: Duration = Duration::from_millis(25);
/// How long every broker may take to list the journals with whole routes.
const SETTLE_TIMEOUT: Duration = Duration::from_secs(20);
const SETTLE_POLL: Duration = Duration::from_millis(50);
/// Names tried per journal until `PRIMARY` is its primary (about 1 in 3 is).
const NAME_TRIES_MAX: usize = 256;
/// Lines of each broker's log printed on failure.
const LOG_TAIL_LINES: usize = 40;
/// WARN/ERROR lines of each broker's log kept in the figures.
const LOG_NOTES_MAX: usize = 20;
/// Clock ticks per second of `/proc` times (USER_HZ).
const TICKS_PER_SEC: f64 = 100.0;
/// Deadline on a STATS request.
const STATS_TIMEOUT: Duration = Duration::from_secs(10);

/// Largest `--replication-rate`.
pub const RATE_MAX: u64 = load::RATE_MAX;

/// One broker process of the cluster.
#[derive(Clone, Debug, Default, Serialize)]
pub struct BrokerInfo {
    pub id: String,
    pub zone: String,
    pub endpoint: String,
    pub pid: u32,
    /// `thread: allowed CPUs` of each shard thread, read once it was ready.
    pub shard_threads: Vec<String>,
    /// Lines logged at WARN or ERROR (or of a panic) during the scenario.
    pub log_warnings: usize,
    /// The first of those lines.
    pub log_notes: Vec<String>,
}

/// Deltas of the primary's STATS counters over one phase, warm-up included
/// (`None`: the broker does not report the counter).
#[derive(Clone, Debug, Default, Serialize)]
pub struct CounterDeltas {
    pub appends: Option<u64>,
    pub append_failures: Option<u64>,
    pub replicated_batches: Option<u64>,
    pub syncs: Option<u64>,
    pub repl_ack_frames: Option<u64>,
    pub repl_acks: Option<u64>,
    pub ack_polls: Option<u64>,
    pub ack_poll_micros: Option<u64>,
}

/// What one phase cost the cluster.
#[derive(Clone, Debug, Default, Serialize)]
pub struct PhaseStats {
    pub phase: String,
    pub seconds: f64,
    pub primary: CounterDeltas,
    /// CPU time of each broker process over the phase, percent of one core.
    pub broker_cpu_percent: BTreeMap<String, f64>,
}

/// Round trips through echo servers placed as the brokers are: what the
/// crossings of a 1 KiB append between processes and vCPUs cost alone,
/// with no broker work. The rep-1 path is client → echo server on the
/// primary's CPU → client; the rep-3 path is client → relay on the
/// primary's CPU → an echo server on each replica's CPU → relay → client.
/// One message in flight, at `--replication-rate`, from a client thread
/// pinned to the CPUs other than the primary's.
#[derive(Clone, Debug, Default, Serialize)]
pub struct HopFloor {
    pub message_bytes: usize,
    pub rate: u64,
    pub client_cpus: Vec<usize>,
    pub rep1: Percentiles,
    pub rep3: Percentiles,
}

/// Everything the replication scenario measured.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ReplicationFigures {
    pub executable: String,
    pub brokers: Vec<BrokerInfo>,
    pub primary: String,
    pub journal_rep1: String,
    pub journal_rep3: String,
    /// The rep-3 journal's route, primary first.
    pub members_rep3: Vec<String>,
    pub rate: u64,
    pub append_1m_rep1: ThroughputFigures,
    pub append_1m_rep3: ThroughputFigures,
    pub latency_1k_rep1: LatencyFigures,
    pub latency_1k_rep3: LatencyFigures,
    /// The same crossings between processes with no broker work.
    pub hop_floor: Option<HopFloor>,
    pub phases: Vec<PhaseStats>,
    /// `repl_acks` ÷ `repl_ack_frames` of the primary over both rep-3 phases.
    pub acks_per_ack_frame: Option<f64>,
    pub repl_acks: Option<u64>,
    pub repl_ack_frames: Option<u64>,
    /// Percent of all CPUs busy outside this process and the brokers.
    pub foreign_cpu_percent: Option<f64>,
    /// Percent of all CPUs' time the host took from this virtual machine.
    pub steal_cpu_percent: Option<f64>,
}

impl ReplicationFigures {
    /// Appends that failed in any phase.
    pub fn errors(&self) -> u64 {
        self.append_1m_rep1.errors
            + self.append_1m_rep3.errors
            + self.latency_1k_rep1.errors
            + self.latency_1k_rep3.errors
    }
}

/// Runs the scenario with the brokers' data and logs under `dir`.
pub fn run(args: &BenchArgs, dir: &Path) -> anyhow::Result<ReplicationFigures> {
    let exe = broker_executable()?;
    std::fs::create_dir_all(dir).with_context(|| format!("making {}", dir.display()))?;
    let rt = crate::client_runtime(args)?;
    // Before the brokers start, so that nothing else runs meanwhile.
    let hop_floor = hop_floor(args).context("replication: the hop floor")?;
    let mut cluster = Cluster::spawn(&exe, dir)?;
    eprintln!(
        "replication: brokers {} (pids {}), logs in {}",
        cluster
            .brokers
            .iter()
            .map(|b| format!("{} at {}", b.id, b.endpoint))
            .collect::<Vec<_>>()
            .join(", "),
        cluster
            .brokers
            .iter()
            .map(|b| b.pid.to_string())
            .collect::<Vec<_>>()
            .join(", "),
        dir.display()
    );
    let result = rt.block_on(async {
        cluster.wait_ready().await?;
        measure(args, &mut cluster).await
    });
    // Stop the client (its connection tasks) before the brokers.
    rt.shutdown_timeout(Duration::from_secs(5));
    let early_exits = cluster.stop();
    let mut f = match result {
        Ok(f) => f,
        Err(e) => {
            cluster.print_log_tails();
            return Err(e);
        }
    };
    if !early_exits.is_empty() {
        cluster.print_log_tails();
        anyhow::bail!("brokers exited on their own: {}", early_exits.join("; "));
    }
    f.executable = exe.display().to_string();
    f.hop_floor = Some(hop_floor);
    f.brokers = cluster.describe();
    if f.errors() > 0 {
        eprintln!("replication: {} appends failed; broker logs:", f.errors());
        cluster.print_log_tails();
    }
    Ok(f)
}

/// The CPU of the `i`th broker: the primary gets a core of its own where
/// there are two or more; the replicas share the others.
fn broker_cpu(i: usize, ncpu: usize) -> usize {
    if ncpu < 2 || i == 0 {
        0
    } else {
        1 + (i - 1) % (ncpu - 1)
    }
}

/// Measures [`HopFloor`]: the rep-1 path, then the rep-3 path.
fn hop_floor(args: &BenchArgs) -> anyhow::Result<HopFloor> {
    let ncpu = std::thread::available_parallelism().map_or(1, |n| n.get());
    let client_cpus: Vec<usize> = (1..ncpu).collect();
    let bytes = load::LATENCY_1K_BYTES;
    let rate = args.replication_rate;
    let (_b2, p2) = crate::pingpong::spawn_echo(Some(broker_cpu(1, ncpu)), &[])?;
    let (_b3, p3) = crate::pingpong::spawn_echo(Some(broker_cpu(2, ncpu)), &[])?;
    let (_relay, relay) = crate::pingpong::spawn_echo(
        Some(broker_cpu(0, ncpu)),
        &[
            format!("--echo-relay-to={p2},{p3}"),
            format!("--echo-relay-bytes={bytes}"),
        ],
    )?;
    let (_alone, alone) = crate::pingpong::spawn_echo(Some(broker_cpu(0, ncpu)), &[])?;
    let rep1 = crate::pingpong::paced_round_trips(args, alone, rate, bytes, &client_cpus)?;
    let rep3 = crate::pingpong::paced_round_trips(args, relay, rate, bytes, &client_cpus)?;
    Ok(HopFloor {
        message_bytes: bytes,
        rate,
        client_cpus,
        rep1: Percentiles::of(&rep1),
        rep3: Percentiles::of(&rep3),
    })
}

/// `rotary`, which has `serve`: this executable, or when this is the
/// stand-alone `rotary-bench`, the `rotary` next to it.
pub(crate) fn broker_executable() -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe().context("finding this executable")?;
    let is_bench = exe
        .file_name()
        .is_some_and(|n| n.to_string_lossy().starts_with("rotary-bench"));
    if !is_bench {
        return Ok(exe);
    }
    let sibling = exe.with_file_name("rotary");
    anyhow::ensure!(
        sibling.is_file(),
        "the replication scenario starts brokers with `rotary serve`, which {} does not have \
         and {} does not exist; run `rotary bench --scenario replication`",
        exe.display(),
        sibling.display()
    );
    Ok(sibling)
}

/// One broker child process.
struct BrokerProc {
    id: &'static str,
    zone: &'static str,
    endpoint: String,
    pid: u32,
    log: PathBuf,
    child: Option<ChildGuard>,
    shard_threads: Vec<String>,
}

/// The three brokers. Dropping it kills every one still running, by PID.
struct Cluster {
    brokers: Vec<BrokerProc>,
    /// The cluster file, and its list of brokers as first written.
    file: PathBuf,
    brokers_text: String,
}

impl Cluster {
    /// Rewrites the cluster file with `specs` as its journals (written
    /// beside it, then renamed over it, so no broker reads half a file).
    fn add_journals(&self, specs: &[JournalSpec]) -> anyhow::Result<()> {
        let yaml = serde_yaml::to_string(specs).context("specs to YAML")?;
        let mut text = format!("{}journals:\n", self.brokers_text);
        for line in yaml.lines() {
            text.push_str(&format!("  {line}\n"));
        }
        let next = self.file.with_extension("yaml.next");
        std::fs::write(&next, text).with_context(|| format!("writing {}", next.display()))?;
        std::fs::rename(&next, &self.file)
            .with_context(|| format!("renaming to {}", self.file.display()))
    }

    /// Writes the cluster file and starts every broker (not yet ready).
    fn spawn(exe: &Path, dir: &Path) -> anyhow::Result<Cluster> {
        // Hold every port until the file is written, so no two are the same.
        let listeners = BROKERS
            .iter()
            .map(|_| TcpListener::bind("127.0.0.1:0"))
            .collect::<Result<Vec<_>, _>>()
            .context("choosing free ports on 127.0.0.1")?;
        let mut endpoints = Vec::new();
        for l in &listeners {
            endpoints.push(l.local_addr().context("port")?.to_string());
        }
        let file = dir.join("cluster.yaml");
        let mut text = String::from("brokers:\n");
        for ((id, zone), endpoint) in BROKERS.iter().zip(&endpoints) {
            text.push_str(&format!(
                "  - {{id: {id}, zone: {zone}, endpoint: {endpoint}}}\n"
            ));
        }
        std::fs::write(&file, &text).with_context(|| format!("writing {}", file.display()))?;
        drop(listeners);

        let mut cluster = Cluster {
            brokers: Vec::new(),
            file: file.clone(),
            brokers_text: text,
        };
        let ncpu = std::thread::available_parallelism().map_or(1, |n| n.get());
        for (i, ((id, zone), endpoint)) in BROKERS.iter().zip(endpoints).enumerate() {
            let cpu = broker_cpu(i, ncpu);
            let data = dir.join(id).join("data");
            let log = dir.join(format!("{id}.log"));
            let out = File::create(&log).with_context(|| format!("creating {}", log.display()))?;
            let err = out.try_clone().context("log file")?;
            let child = Command::new(exe)
                .arg("serve")
                .arg("--cluster")
                .arg(&file)
                .arg("--id")
                .arg(id)
                .arg("--data")
                .arg(&data)
                .args(["--cores", "1", "--disk-reserve", "0"])
                .arg("--cpus")
                .arg(cpu.to_string())
                .args(iowq_args(cpu, ncpu))
                .env("RUST_BACKTRACE", "1")
                .stdin(Stdio::null())
                .stdout(out)
                .stderr(err)
                .spawn()
                .with_context(|| format!("starting {} serve --id {id}", exe.display()))?;
            cluster.brokers.push(BrokerProc {
                id,
                zone,
                endpoint,
                pid: child.id(),
                log,
                child: Some(ChildGuard(child)),
                shard_threads: Vec::new(),
            });
        }
        Ok(cluster)
    }

    /// Waits until every broker answers PING (and notes where its shard
    /// threads may run).
    async fn wait_ready(&mut self) -> anyhow::Result<()> {
        let deadline = Instant::now() + READY_TIMEOUT;
        for i in 0..self.brokers.len() {
            loop {
                let endpoint = self.brokers[i].endpoint.clone();
                let answered = match Client::connect(&endpoint).await {
                    Ok(c) => tokio::time::timeout(READY_POLL * 40, c.ping())
                        .await
                        .is_ok_and(|r| r.is_ok()),
                    Err(_) => false,
                };
                if answered {
                    break;
                }
                self.check_running()?;
                anyhow::ensure!(
                    Instant::now() < deadline,
                    "broker {} does not answer PING at {endpoint} after {READY_TIMEOUT:?}",
                    self.brokers[i].id
                );
                tokio::time::sleep(READY_POLL).await;
            }
            let b = &mut self.brokers[i];
            b.shard_threads = shard_threads(b.pid);
        }
        Ok(())
    }

    /// Fails if a broker has exited, with its exit status.
    fn check_running(&mut self) -> anyhow::Result<()> {
        for b in &mut self.brokers {
            if let Some(c) = b.child.as_mut() {
                if let Some(status) = c.0.try_wait().context("waiting for a broker")? {
                    anyhow::bail!("broker {} (pid {}) exited with {status}", b.id, b.pid);
                }
            }
        }
        Ok(())
    }

    /// Kills every broker by its PID; says which had exited on their own.
    fn stop(&mut self) -> Vec<String> {
        let mut exited = Vec::new();
        for b in &mut self.brokers {
            if let Some(mut c) = b.child.take() {
                match c.0.try_wait() {
                    Ok(Some(status)) => exited.push(format!("{} with {status}", b.id)),
                    Ok(None) => {
                        if let Err(e) = c.0.kill() {
                            eprintln!("warning: killing broker {} (pid {}): {e}", b.id, b.pid);
                        }
                    }
                    Err(e) => eprintln!("warning: waiting for broker {}: {e}", b.id),
                }
                // Dropping the guard reaps it.
                drop(c);
            }
        }
        exited
    }

    /// CPU ticks (user + system) of each broker process so far.
    fn ticks(&self) -> Vec<Option<u64>> {
        self.brokers.iter().map(|b| process_ticks(b.pid)).collect()
    }

    fn print_log_tails(&self) {
        for b in &self.brokers {
            let text = std::fs::read_to_string(&b.log).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            let skip = lines.len().saturating_sub(LOG_TAIL_LINES);
            eprintln!(
                "--- broker {} (pid {}, {}): last {} of {} log lines ---",
                b.id,
                b.pid,
                b.log.display(),
                lines.len() - skip,
                lines.len()
            );
            for l in &lines[skip..] {
                eprintln!("{l}");
            }
        }
    }

    fn describe(&self) -> Vec<BrokerInfo> {
        self.brokers
            .iter()
            .map(|b| {
                let text = std::fs::read_to_string(&b.log).unwrap_or_default();
                let notes: Vec<&str> = text.lines().filter(|l| is_warning(l)).collect();
                BrokerInfo {
                    id: b.id.into(),
                    zone: b.zone.into(),
                    endpoint: b.endpoint.clone(),
                    pid: b.pid,
                    shard_threads: b.shard_threads.clone(),
                    log_warnings: notes.len(),
                    log_notes: notes
                        .iter()
                        .take(LOG_NOTES_MAX)
                        .map(|l| l.to_string())
                        .collect(),
                }
            })
            .collect()
    }
}

/// A log line at WARN or ERROR level (tracing's plain format: time, level,
/// …), or one of a panic.
fn is_warning(line: &str) -> bool {
    matches!(line.split_whitespace().nth(1), Some("WARN" | "ERROR")) || line.contains("panicked")
}

/// utime + stime of a process, in clock ticks.
fn process_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name, which is in parentheses.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15, i.e. 11 and 12 after ')'.
    Some(f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?)
}

/// `name: allowed CPUs` of each `rotary-shard-*` thread of a process.
fn shard_threads(pid: u32) -> Vec<String> {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return Vec::new();
    };
    let mut out: Vec<String> = tasks
        .filter_map(|t| t.ok())
        .filter_map(|t| {
            let comm = std::fs::read_to_string(t.path().join("comm")).ok()?;
            let comm = comm.trim();
            if !comm.starts_with("rotary-shard") {
                return None;
            }
            let status = std::fs::read_to_string(t.path().join("status")).ok()?;
            let cpus = status
                .lines()
                .find_map(|l| l.strip_prefix("Cpus_allowed_list:"))?
                .trim()
                .to_string();
            Some(format!("{comm}: CPUs {cpus}"))
        })
        .collect();
    out.sort();
    out
}

/// The STATS counters the scenario reads.
#[derive(Default)]
struct Counters {
    appends: Option<u64>,
    append_failures: Option<u64>,
    replicated_batches: Option<u64>,
    syncs: Option<u64>,
    repl_ack_frames: Option<u64>,
    repl_acks: Option<u64>,
    ack_polls: Option<u64>,
    ack_poll_micros: Option<u64>,
}

async fn counters(client: &Client) -> Counters {
    match tokio::time::timeout(STATS_TIMEOUT, client.stats()).await {
        Ok(Ok(v)) => Counters {
            appends: v["appends"].as_u64(),
            append_failures: v["append_failures"].as_u64(),
            replicated_batches: v["replicated_batches"].as_u64(),
            syncs: v["syncs"].as_u64(),
            repl_ack_frames: v["repl_ack_frames"].as_u64(),
            repl_acks: v["repl_acks"].as_u64(),
            ack_polls: v["ack_polls"].as_u64(),
            ack_poll_micros: v["ack_poll_micros"].as_u64(),
        },
        Ok(Err(e)) => {
            eprintln!("warning: STATS of {PRIMARY}: {e}");
            Counters::default()
        }
        Err(_) => {
            eprintln!("warning: STATS of {PRIMARY} took longer than {STATS_TIMEOUT:?}");
            Counters::default()
        }
    }
}

fn delta(before: Option<u64>, after: Option<u64>) -> Option<u64> {
    Some(after?.saturating_sub(before?))
}

/// Runs `body` as the phase `name`, with the primary's counters and the
/// brokers' CPU time around it; fails if a broker died meanwhile.
async fn phase<T>(
    cluster: &mut Cluster,
    client: &Client,
    name: &str,
    body: impl std::future::Future<Output = anyhow::Result<T>>,
) -> anyhow::Result<(T, PhaseStats)> {
    let before = counters(client).await;
    let ticks_before = cluster.ticks();
    let start = Instant::now();
    let out = body.await;
    let seconds = start.elapsed().as_secs_f64();
    let ticks_after = cluster.ticks();
    cluster
        .check_running()
        .with_context(|| format!("during {name}"))?;
    let out = out.with_context(|| format!("replication {name}"))?;
    let after = counters(client).await;
    let broker_cpu_percent = cluster
        .brokers
        .iter()
        .zip(ticks_before.iter().zip(&ticks_after))
        .filter_map(|(b, (t0, t1))| {
            let ticks = t1.as_ref()?.checked_sub(*t0.as_ref()?)?;
            Some((
                b.id.to_string(),
                ticks as f64 / TICKS_PER_SEC / seconds * 100.0,
            ))
        })
        .collect();
    let stats = PhaseStats {
        phase: name.to_string(),
        seconds,
        primary: CounterDeltas {
            appends: delta(before.appends, after.appends),
            append_failures: delta(before.append_failures, after.append_failures),
            replicated_batches: delta(before.replicated_batches, after.replicated_batches),
            syncs: delta(before.syncs, after.syncs),
            repl_ack_frames: delta(before.repl_ack_frames, after.repl_ack_frames),
            repl_acks: delta(before.repl_acks, after.repl_acks),
            ack_polls: delta(before.ack_polls, after.ack_polls),
            ack_poll_micros: delta(before.ack_poll_micros, after.ack_poll_micros),
        },
        broker_cpu_percent,
    };
    Ok((out, stats))
}

/// A journal name under `prefix` whose primary is [`PRIMARY`].
async fn name_on_primary(client: &Client, prefix: &str) -> anyhow::Result<String> {
    for i in 0..NAME_TRIES_MAX {
        let name = format!("{prefix}-{i:03}");
        let route = client
            .route(&name)
            .await
            .with_context(|| format!("ROUTE {name}"))?;
        if route.members.first().is_some_and(|m| m.id == PRIMARY) {
            return Ok(name);
        }
    }
    anyhow::bail!("no name of the form {prefix}-NNN has {PRIMARY} as its primary")
}

/// Waits until every broker lists each spec with a route of `replication`
/// members, [`PRIMARY`] first.
async fn settle(cluster: &Cluster, specs: &[JournalSpec]) -> anyhow::Result<()> {
    let deadline = Instant::now() + SETTLE_TIMEOUT;
    for b in &cluster.brokers {
        let client = Client::connect(&b.endpoint)
            .await
            .with_context(|| format!("connecting to {}", b.id))?;
        loop {
            let list = client
                .list("")
                .await
                .with_context(|| format!("LIST on {}", b.id))?;
            let missing: Vec<&str> = specs
                .iter()
                .filter(|s| {
                    !list.iter().any(|j| {
                        j.spec.name == s.name
                            && j.route.members.len() == s.replication as usize
                            && j.route.primary == PRIMARY
                    })
                })
                .map(|s| s.name.as_str())
                .collect();
            if missing.is_empty() {
                break;
            }
            anyhow::ensure!(
                Instant::now() < deadline,
                "{} does not list {missing:?} with {PRIMARY} as primary and whole routes \
                 after {SETTLE_TIMEOUT:?}",
                b.id
            );
            tokio::time::sleep(SETTLE_POLL).await;
        }
    }
    Ok(())
}

async fn measure(args: &BenchArgs, cluster: &mut Cluster) -> anyhow::Result<ReplicationFigures> {
    let endpoint = cluster.brokers[0].endpoint.clone();
    let client = Client::connect(&endpoint)
        .await
        .with_context(|| format!("connecting to {PRIMARY} at {endpoint}"))?;
    let (rep1, rep3, members_rep3) = make_journals(cluster, &client).await?;
    let cpu = crate::cpu::Sample::now();
    let ticks_start = cluster.ticks();
    let start = Instant::now();
    let mut phases = Vec::new();
    // Latency first: its tails are the figures most easily disturbed, and
    // the throughput phases leave gigabytes of history behind them.
    let lat = latency_phases(args, cluster, &client, [&rep1, &rep3], &mut phases).await?;
    let tput = throughput_phases(args, cluster, &client, [&rep1, &rep3], &mut phases).await?;
    let foreign_cpu_percent = foreign_percent(&cpu, &ticks_start, &cluster.ticks(), start);
    let steal_cpu_percent = cpu.steal_percent();

    let sum = |get: fn(&CounterDeltas) -> Option<u64>| -> Option<u64> {
        phases
            .iter()
            .filter(|p| p.phase.ends_with("rep 3"))
            .map(|p| get(&p.primary))
            .sum()
    };
    let repl_acks = sum(|c| c.repl_acks);
    let repl_ack_frames = sum(|c| c.repl_ack_frames);
    let acks_per_ack_frame = match (repl_acks, repl_ack_frames) {
        (Some(a), Some(f)) if f > 0 => Some(a as f64 / f as f64),
        _ => None,
    };
    let mut lat = lat.into_iter();
    let mut tput = tput.into_iter();
    Ok(ReplicationFigures {
        primary: PRIMARY.into(),
        journal_rep1: rep1,
        journal_rep3: rep3,
        members_rep3,
        rate: args.replication_rate,
        append_1m_rep1: tput.next().expect("two throughput phases"),
        append_1m_rep3: tput.next().expect("two throughput phases"),
        latency_1k_rep1: lat.next().expect("two latency phases"),
        latency_1k_rep3: lat.next().expect("two latency phases"),
        phases,
        acks_per_ack_frame,
        repl_acks,
        repl_ack_frames,
        foreign_cpu_percent,
        steal_cpu_percent,
        ..ReplicationFigures::default()
    })
}

/// Makes a journal of replication 1 and one of replication 3, both with
/// [`PRIMARY`] as primary, and waits until every broker routes them so.
/// Returns their names and the members of the second.
async fn make_journals(
    cluster: &mut Cluster,
    client: &Client,
) -> anyhow::Result<(String, String, Vec<String>)> {
    let unix_secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let prefix = format!("bench/{}-{}", unix_secs, std::process::id());
    let rep1 = name_on_primary(client, &format!("{prefix}/rep1")).await?;
    let rep3 = name_on_primary(client, &format!("{prefix}/rep3")).await?;
    let specs: Vec<JournalSpec> = [(&rep1, 1), (&rep3, 3)]
        .into_iter()
        .map(|(name, replication)| {
            let mut s = JournalSpec::new(name);
            s.replication = replication;
            s
        })
        .collect();
    cluster.add_journals(&specs)?;
    settle(cluster, &specs).await?;
    let route1 = client.route(&rep1).await.context("ROUTE")?;
    let route3 = client.route(&rep3).await.context("ROUTE")?;
    let ids = |r: &rotary_net::client::RouteInfo| -> Vec<String> {
        r.members.iter().map(|m| m.id.clone()).collect()
    };
    anyhow::ensure!(
        ids(&route1) == [PRIMARY] && ids(&route3).len() == 3 && ids(&route3)[0] == PRIMARY,
        "routes: {rep1} {:?}, {rep3} {:?}; want {PRIMARY} alone and {PRIMARY} first of three",
        ids(&route1),
        ids(&route3)
    );
    eprintln!(
        "replication: {rep1} on {:?}, {rep3} on {:?}",
        ids(&route1),
        ids(&route3)
    );
    Ok((rep1, rep3, ids(&route3)))
}

/// latency-1k on the replication-1 journal, then on the replication-3 one.
async fn latency_phases(
    args: &BenchArgs,
    cluster: &mut Cluster,
    client: &Client,
    [rep1, rep3]: [&String; 2],
    phases: &mut Vec<PhaseStats>,
) -> anyhow::Result<Vec<LatencyFigures>> {
    let mut lat = Vec::new();
    for j in [rep1, rep3] {
        eprintln!(
            "replication: 1024 B appends to {j} at {}/s",
            args.replication_rate
        );
        let name = if j == rep1 {
            "latency-1k rep 1"
        } else {
            "latency-1k rep 3"
        };
        let (f, s) = phase(
            cluster,
            client,
            name,
            load::latency(client, args, j.clone(), args.replication_rate),
        )
        .await?;
        lat.push(f);
        phases.push(s);
    }
    Ok(lat)
}

/// append-1m on the replication-1 journal, then on the replication-3 one.
async fn throughput_phases(
    args: &BenchArgs,
    cluster: &mut Cluster,
    client: &Client,
    [rep1, rep3]: [&String; 2],
    phases: &mut Vec<PhaseStats>,
) -> anyhow::Result<Vec<ThroughputFigures>> {
    let mut tput = Vec::new();
    for j in [rep1, rep3] {
        eprintln!(
            "replication: {APPEND_1M_BYTES} B appends to {j}, {} in flight",
            args.replication_depth
        );
        let name = if j == rep1 {
            "append-1m rep 1"
        } else {
            "append-1m rep 3"
        };
        let (f, s) = phase(
            cluster,
            client,
            name,
            load::throughput(
                client,
                args,
                vec![j.clone()],
                APPEND_1M_BYTES,
                args.replication_depth,
            ),
        )
        .await?;
        tput.push(f);
        phases.push(s);
    }
    Ok(tput)
}

/// Percent of all CPUs busy outside this process and the brokers since
/// `cpu` (the brokers are child processes, which [`crate::cpu`] would count
/// as foreign until they are reaped).
fn foreign_percent(
    cpu: &crate::cpu::Sample,
    ticks_start: &[Option<u64>],
    ticks_end: &[Option<u64>],
    start: Instant,
) -> Option<f64> {
    let outside_self = cpu.foreign_percent()?;
    let cpus = std::thread::available_parallelism().ok()?.get() as f64;
    let secs = start.elapsed().as_secs_f64();
    let mut brokers = 0u64;
    for (t0, t1) in ticks_start.iter().zip(ticks_end) {
        brokers += t1.as_ref()?.checked_sub(*t0.as_ref()?)?;
    }
    let brokers_percent = brokers as f64 / TICKS_PER_SEC / (secs * cpus) * 100.0;
    Some((outside_self - brokers_percent).clamp(0.0, 100.0))
}

/// Each broker's io-wq workers run on the cores its shard does not: the
/// punted writes of a replica then do not queue behind the other replica
/// and the load generator on their shared core.
fn iowq_args(cpu: usize, ncpu: usize) -> Vec<String> {
    let others: Vec<String> = (0..ncpu)
        .filter(|&c| c != cpu)
        .map(|c| c.to_string())
        .collect();
    if others.is_empty() {
        return Vec::new();
    }
    vec!["--iowq-cpus".into(), others.join(",")]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_primary_has_a_core_of_its_own_where_there_are_two() {
        for (ncpu, cpus) in [
            (1, [0, 0, 0]),
            (2, [0, 1, 1]),
            (3, [0, 1, 2]),
            (8, [0, 1, 2]),
        ] {
            let got: Vec<usize> = (0..3).map(|i| broker_cpu(i, ncpu)).collect();
            assert_eq!(got, cpus, "{ncpu} CPUs");
        }
    }
}
