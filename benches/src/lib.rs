//! Benchmarks of one rotary broker, and of the machine's own floors that
//! those figures are judged against.
//!
//! [`run`] is `rotary bench`: it runs the chosen scenarios one after another
//! and prints one table (optionally also JSON). Broker scenarios run against
//! `--broker HOST:PORT` or, by default, against a broker embedded in this
//! process ([`rotary_engine::Broker`], one pinned shard per core) with a
//! fresh data directory that is removed afterwards. The load generator is the
//! ordinary tokio client ([`rotary_net::client::Client`]) on its own runtime.
//!
//! Scenarios:
//! * `append-1m`: 1 MiB appends to one journal, several in flight → MB/s.
//! * `latency-1k`: 1 KiB appends at a fixed rate; latency is measured from
//!   each append's *intended* send time, so a stall is charged to every
//!   append it delayed (no coordinated omission).
//! * `fanout-64x4k`: 4 KiB appends to 64 journals spread evenly over the
//!   shards, several in flight per journal → aggregate MB/s.
//! * `pingpong`: plain TCP round trips to a child process on loopback: the
//!   machine's latency floor.
//! * `baseline`: `fio` O_DIRECT sequential overwrite at 1 MiB blocks and
//!   `iperf3` loopback throughput: the disk and network ceilings; fio 4 KiB
//!   writes one at a time: the device's latency floor; and the SHA-1 rate of
//!   one core, which bounds one shard's appends.
//! * `backfill` (only when asked for by name): history in a `file://` store
//!   read with `read_direct` against a raw store GET, and 1 KiB append
//!   latency on another journal with and without a backfill running.
//! * `replication` (only when asked for by name): three `rotary serve
//!   --cluster` child processes; 1 MiB throughput and 1 KiB fixed-rate
//!   latency to a journal with `replication: 1` and to one with
//!   `replication: 3`, both with the same primary, and the primary's acks
//!   per ack frame; first, the hop floor: the same crossings between
//!   processes through echo servers, with no broker work.
//!
//! * `faults` (only when asked for by name): a cluster on etcd broken by
//!   each fault of `--faults` (SIGKILL, SIGSTOP, etcd outages, rolling
//!   restarts, partitions) `--fault-rounds` times, then checked from
//!   outside the brokers ([`faults`]); `tests/e2e_faults.rs` runs each once.
//!
//! `--workload FILE` runs an OpenMessaging Benchmark workload instead of the
//! scenarios ([`omb`]): against rotary or, with `--driver`, a peer; it
//! writes OMB's result JSON (`--output`) and SVG charts (`--charts`).
//! `--chart-results A.json B.json --charts DIR` draws several results into
//! one set of charts.
//!
//! Everything listens on 127.0.0.1 only; every child process is stopped by
//! its PID; every loop is bounded in time. Nothing here asserts timings:
//! figures are reported, and the table says whether each target was met.

// Functions stay short enough to hold in mind (threshold in clippy.toml).
#![warn(clippy::too_many_lines)]
#![deny(unsafe_code)]

mod allocator;
mod backfill;
mod baseline;
mod broker;
mod child;
mod cpu;
mod failover;
pub mod faults;
mod http;
mod load;
mod messages;
pub mod omb;
mod pingpong;
mod replication;
mod report;
mod sys;
mod tail;

use anyhow::Context as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

pub use report::Figures;

/// The scenarios `--scenario` selects.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Scenario {
    /// Every scenario below, in this order: pingpong, baseline, append-1m,
    /// latency-1k, fanout-64x4k, tail-readers.
    All,
    /// 1 MiB appends to one journal, pipelined: MB/s and appends/s.
    #[value(name = "append-1m")]
    Append1m,
    /// 1 KiB appends at a fixed rate: latency percentiles from intended send time.
    #[value(name = "latency-1k")]
    Latency1k,
    /// 4 KiB appends to 64 journals on every shard, pipelined: aggregate MB/s.
    #[value(name = "fanout-64x4k")]
    Fanout64x4k,
    /// Plain TCP ping-pong with a child process on loopback: the latency floor.
    Pingpong,
    /// fio O_DIRECT 1 MiB sequential overwrite, fio 4 KiB write latency,
    /// iperf3 loopback throughput, SHA-1 rate of one core.
    Baseline,
    /// 1 KiB appends at a fixed rate to a journal nobody reads, then to one
    /// that `--tail-readers` blocking readers tail: latency of both, and
    /// every reader checked byte for byte.
    #[value(name = "tail-readers")]
    TailReaders,
    /// History read from a `file://` store with `read_direct` vs. a raw
    /// store GET, and live append latency with and without that backfill.
    /// Not part of `all`: it writes `--backfill-gib` GiB twice over.
    Backfill,
    /// Three `rotary serve --cluster` child processes: 1 MiB MB/s and 1 KiB
    /// latency with replication 1 and 3 on the same primary, and acks per
    /// ack frame; and the same crossings through echo servers, with no
    /// broker work. Not part of `all`: it runs brokers of its own.
    Replication,
    /// The allocator's CPU time to assign 100,000 journals of replication 3
    /// over 4 brokers, and to react to a broker dying and one joining.
    /// Not part of `all`: it is no broker scenario.
    Allocator,
    /// A cluster on etcd (a real `etcd` and four `rotary serve --etcd`)
    /// whose journal's primary is SIGKILLed ten times under load: time to
    /// the first acknowledged append after each kill, appends lost, and
    /// etcd writes of an idle cluster. Not part of `all`.
    Failover,
    /// A cluster on etcd (four brokers, four journals with a `file://`
    /// store, two writers per journal) broken by each fault of `--faults`
    /// `--fault-rounds` times: SIGKILL and SIGSTOP of primaries and
    /// replicas, one and two at once, etcd paused and killed, a rolling
    /// restart, partitions in network namespaces. Per fault: appends
    /// acknowledged and failed, the longest gap between acks, and whether
    /// every acknowledged append is on every member and in the store with
    /// no conflicting or torn bytes. Not part of `all`.
    Faults,
    /// latency-1k and append-1m with `/metrics` scraped every second and
    /// without, alternating; 1 KiB appends through the HTTP gateway (PUT)
    /// beside the native client. Not part of `all`: it runs a broker and an
    /// HTTP server of its own.
    Http,
    /// 1 KiB messages in transactions of 100 over 4 journals, read
    /// committed, beside plain appends of the same bytes: messages/s,
    /// latency, and the reader's CPU per message. Not part of `all`.
    Messages,
}

/// A core list given on the command line, e.g. `0,2-3`.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(transparent)]
pub struct Cpus(pub Vec<usize>);

fn parse_durability(s: &str) -> Result<rotary_net::spec::Durability, String> {
    match s {
        "replicated" => Ok(rotary_net::spec::Durability::Replicated),
        "fsync" => Ok(rotary_net::spec::Durability::Fsync),
        other => Err(format!(
            "{other:?} is not a durability (replicated or fsync)"
        )),
    }
}

fn parse_ttl(s: &str) -> Result<Duration, String> {
    rotary_net::spec::parse_duration(s).map_err(|e| e.to_string())
}

fn parse_cpus(s: &str) -> Result<Cpus, String> {
    rotary_engine::parse_cpu_list(s).map(Cpus)
}

/// `rotary bench`: load-tests one broker and compares it with the machine.
#[derive(Clone, Debug, clap::Args)]
pub struct BenchArgs {
    /// Scenarios to run (repeat or separate with commas).
    #[arg(
        long = "scenario",
        value_enum,
        value_delimiter = ',',
        default_value = "all"
    )]
    pub scenarios: Vec<Scenario>,
    /// Broker to load, any shard's HOST:PORT. Without it, a broker is started
    /// in this process on 127.0.0.1 with a temporary data directory.
    #[arg(long = "broker", value_name = "HOST:PORT")]
    pub broker: Option<String>,
    /// Directory under which the temporary data directory (embedded broker's
    /// data and fio's test file) is made; removed afterwards.
    #[arg(long = "data", value_name = "DIR", default_value = ".")]
    pub data: PathBuf,
    /// Shards of the embedded broker; 0 = every core.
    #[arg(long = "cores", default_value_t = 0)]
    pub cores: usize,
    /// Measured seconds per scenario (after the warm-up).
    #[arg(long = "duration", value_name = "SECS", default_value_t = 5.0)]
    pub duration_secs: f64,
    /// Seconds of load before each scenario's measurement starts.
    #[arg(long = "warmup", value_name = "SECS", default_value_t = 1.0)]
    pub warmup_secs: f64,
    /// Appends in flight in append-1m.
    #[arg(long = "append-depth", default_value_t = 8)]
    pub append_depth: usize,
    /// Appends per second in latency-1k.
    #[arg(long = "rate", default_value_t = 10_000)]
    pub rate: u64,
    /// GiB of history the backfill scenario appends and reads back.
    #[arg(long = "backfill-gib", default_value_t = 2)]
    pub backfill_gib: u64,
    /// Appends per second of the live journal in the backfill scenario.
    #[arg(long = "backfill-rate", default_value_t = 2_000)]
    pub backfill_rate: u64,
    /// The brokers' lease TTL in the failover scenario.
    #[arg(long = "failover-ttl", value_name = "DURATION", value_parser = parse_ttl, default_value = "3s")]
    pub failover_ttl: Duration,
    /// The faults of the faults scenario (repeat or separate with
    /// commas); all by default.
    #[arg(long = "faults", value_enum, value_delimiter = ',')]
    pub faults: Vec<faults::Fault>,
    /// How often the faults scenario strikes with each fault.
    #[arg(long = "fault-rounds", default_value_t = 3)]
    pub fault_rounds: usize,
    /// Appends per second of the 1 KiB phases of the replication scenario.
    #[arg(long = "replication-rate", default_value_t = 2_000)]
    pub replication_rate: u64,
    /// Appends in flight in the 1 MiB phases of the replication scenario.
    /// Deeper than append-1m's: with replicas, each append waits a round
    /// trip more, and only more appends in flight fill the pipeline.
    #[arg(long = "replication-depth", default_value_t = 32)]
    pub replication_depth: usize,
    /// Appends in flight per journal in fanout-64x4k.
    #[arg(long = "fanout-depth", default_value_t = 4)]
    pub fanout_depth: usize,
    /// Blocking readers tailing the journal of tail-readers' second phase.
    #[arg(long = "tail-readers", value_name = "N", default_value_t = 16)]
    pub tail_readers: usize,
    /// http: rounds of scraped and unscraped runs, alternating.
    #[arg(long = "http-rounds", default_value_t = 3)]
    pub http_rounds: usize,
    /// http: clients appending at once, each one append at a time (a
    /// keep-alive connection each through the gateway).
    #[arg(long = "http-clients", default_value_t = 16)]
    pub http_clients: usize,
    /// Message bytes of each ping-pong round trip.
    #[arg(long = "pingpong-size", value_name = "BYTES", default_value_t = 1024)]
    pub pingpong_size: usize,
    /// Worker threads of the client's tokio runtime.
    #[arg(long = "client-threads", default_value_t = 1)]
    pub client_threads: usize,
    /// Cores the embedded broker's shards are pinned to (as `serve --cpus`).
    #[arg(long = "broker-cpus", value_name = "LIST", value_parser = parse_cpus)]
    pub broker_cpus: Option<Cpus>,
    /// Cores the load generator's threads are pinned to.
    #[arg(long = "client-cpus", value_name = "LIST", value_parser = parse_cpus)]
    pub client_cpus: Option<Cpus>,
    /// Cores the backfill scenario's concurrent backfill reader (a client
    /// of its own, like another machine's) is pinned to.
    #[arg(long = "backfill-cpus", value_name = "LIST", value_parser = parse_cpus)]
    pub backfill_cpus: Option<Cpus>,
    /// Journals the embedded broker holds before the broker scenarios run,
    /// quiet, each with a `file://` store in the scratch directory (listed
    /// every minute, as `refresh_interval` defaults): the scenarios then
    /// measure a broker that carries many partitions.
    #[arg(long = "idle-journals", value_name = "N", default_value_t = 0)]
    pub idle_journals: usize,
    /// Size of fio's preallocated test file, in MiB.
    #[arg(long = "fio-size-mib", default_value_t = 2048)]
    pub fio_size_mib: u64,
    /// Also measure the machine's limits in full (adds the pingpong and
    /// baseline scenarios): fio O_DIRECT writes of 16 KiB and 1 MiB, one and
    /// 32 deep, overwriting and extending; 4 KiB writes with fdatasync;
    /// iperf3; TCP ping-pong. Rotary's figures are reported as ratios to them.
    #[arg(long = "baseline")]
    pub baseline: bool,
    /// fio's I/Os in flight.
    #[arg(long = "fio-iodepth", default_value_t = 4)]
    pub fio_iodepth: u32,
    /// Also write every figure to this file as JSON (with --workload: the
    /// OpenMessaging result JSON).
    #[arg(long = "output", value_name = "FILE.json")]
    pub output: Option<PathBuf>,
    /// Run this OpenMessaging Benchmark workload (YAML) instead of the
    /// scenarios.
    #[arg(long = "workload", value_name = "FILE.yaml")]
    pub workload: Option<PathBuf>,
    /// The system --workload drives: rotary, or a peer at --broker.
    #[arg(long = "driver", value_name = "NAME", default_value = "rotary")]
    pub driver: String,
    /// Seconds between --workload's progress lines and series values
    /// (OpenMessaging's is 10).
    #[arg(long = "period", value_name = "SECS", default_value_t = 10.0)]
    pub period_secs: f64,
    /// Write SVG charts (throughput over time, latency percentiles) of the
    /// --workload run, or of --chart-results, into this directory.
    #[arg(long = "charts", value_name = "DIR")]
    pub charts: Option<PathBuf>,
    /// Draw these result JSONs (of any driver, or of OpenMessaging itself)
    /// into one set of charts in --charts, then exit.
    #[arg(long = "chart-results", value_name = "RESULT.json", num_args = 1..)]
    pub chart_results: Vec<PathBuf>,
    /// Fragment store of the journals --workload creates on rotary
    /// (file:///abs/dir/ or s3://…). Default: none; with the embedded broker
    /// and a backlog workload, a file:// store in the temporary directory.
    #[arg(long = "journal-store", value_name = "URL")]
    pub journal_store: Option<String>,
    /// Durability of the journals --workload creates on rotary: `replicated`
    /// (O_DIRECT write and commit-log record before the ack) or `fsync`
    /// (also fdatasync before the ack; survives a power loss).
    #[arg(long = "journal-durability", value_name = "MODE", default_value = "replicated", value_parser = parse_durability)]
    pub journal_durability: rotary_net::spec::Durability,
    /// Internal: serve ping-pong echoes (the child process of `pingpong`).
    #[arg(long = "echo-server", hide = true)]
    pub echo_server: bool,
    /// Internal: the CPU the echo server pins itself to.
    #[arg(long = "echo-cpu", hide = true)]
    pub echo_cpu: Option<usize>,
    /// Internal: echo servers on these ports of 127.0.0.1 that the echo
    /// server relays each message to, answering once all of them have
    /// (the replication scenario's hop floor).
    #[arg(long = "echo-relay-to", hide = true, value_delimiter = ',')]
    pub echo_relay_to: Vec<u16>,
    /// Internal: the length of the messages the echo server relays.
    #[arg(long = "echo-relay-bytes", hide = true, default_value_t = 1024)]
    pub echo_relay_bytes: usize,
}

impl BenchArgs {
    fn duration(&self) -> Duration {
        Duration::from_secs_f64(self.duration_secs)
    }

    fn warmup(&self) -> Duration {
        Duration::from_secs_f64(self.warmup_secs)
    }

    fn wants(&self, s: Scenario) -> bool {
        (self.baseline && matches!(s, Scenario::Pingpong | Scenario::Baseline))
            || (self.scenarios.contains(&Scenario::All)
                && s != Scenario::Backfill
                && s != Scenario::Replication
                && s != Scenario::Allocator
                && s != Scenario::Failover
                && s != Scenario::Faults
                && s != Scenario::Http
                && s != Scenario::Messages)
            || self.scenarios.contains(&s)
    }

    fn check(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.duration_secs > 0.0 && self.duration_secs <= DURATION_SECS_MAX,
            "--duration must be more than 0 and at most {DURATION_SECS_MAX} seconds"
        );
        anyhow::ensure!(
            self.warmup_secs >= 0.0 && self.warmup_secs <= DURATION_SECS_MAX,
            "--warmup must be 0 to {DURATION_SECS_MAX} seconds"
        );
        anyhow::ensure!(
            (1..=load::DEPTH_MAX).contains(&self.append_depth),
            "--append-depth must be 1 to {}",
            load::DEPTH_MAX
        );
        anyhow::ensure!(
            (1..=load::DEPTH_MAX).contains(&self.replication_depth),
            "--replication-depth must be 1 to {}",
            load::DEPTH_MAX
        );
        anyhow::ensure!(
            (1..=load::DEPTH_MAX).contains(&self.fanout_depth),
            "--fanout-depth must be 1 to {}",
            load::DEPTH_MAX
        );
        anyhow::ensure!(
            (1..=tail::READERS_MAX).contains(&self.tail_readers),
            "--tail-readers must be 1 to {}",
            tail::READERS_MAX
        );
        anyhow::ensure!(
            self.idle_journals <= load::IDLE_JOURNALS_MAX,
            "--idle-journals must be at most {}",
            load::IDLE_JOURNALS_MAX
        );
        anyhow::ensure!(
            self.idle_journals == 0 || self.broker.is_none(),
            "--idle-journals needs the embedded broker (no --broker): it does not delete them"
        );
        anyhow::ensure!(
            (1..=load::RATE_MAX).contains(&self.rate),
            "--rate must be 1 to {}",
            load::RATE_MAX
        );
        anyhow::ensure!(
            (1..=backfill::GIB_MAX).contains(&self.backfill_gib),
            "--backfill-gib must be 1 to {}",
            backfill::GIB_MAX
        );
        anyhow::ensure!(
            (1..=load::RATE_MAX).contains(&self.backfill_rate),
            "--backfill-rate must be 1 to {}",
            load::RATE_MAX
        );
        anyhow::ensure!(
            (1..=replication::RATE_MAX).contains(&self.replication_rate),
            "--replication-rate must be 1 to {}",
            replication::RATE_MAX
        );
        anyhow::ensure!(
            (1..=pingpong::MESSAGE_LEN_MAX).contains(&self.pingpong_size),
            "--pingpong-size must be 1 to {}",
            pingpong::MESSAGE_LEN_MAX
        );
        anyhow::ensure!(
            (1..=FAULT_ROUNDS_MAX).contains(&self.fault_rounds),
            "--fault-rounds must be 1 to {FAULT_ROUNDS_MAX}"
        );
        anyhow::ensure!(
            (1..=64).contains(&self.client_threads),
            "--client-threads must be 1 to 64"
        );
        anyhow::ensure!(
            self.fio_size_mib >= 16,
            "--fio-size-mib must be at least 16"
        );
        anyhow::ensure!(
            (1..=256).contains(&self.fio_iodepth),
            "--fio-iodepth must be 1 to 256"
        );
        Ok(())
    }
}

/// File of the 4 KiB fio latency job: small, it only has to be laid out.
const FIO_4K_FILE_MIB: u64 = 256;

/// Most `--fault-rounds` accepted.
pub const FAULT_ROUNDS_MAX: usize = 100;

/// Longest `--duration` or `--warmup` accepted.
pub const DURATION_SECS_MAX: f64 = 3600.0;

/// The load generator's runtime: `--client-threads` workers.
fn client_runtime(args: &BenchArgs) -> anyhow::Result<tokio::runtime::Runtime> {
    let cpus = args.client_cpus.clone();
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(args.client_threads)
        .thread_name("rotary-bench-client")
        .on_thread_start(move || {
            if let Some(cpus) = &cpus {
                if let Err(e) = sys::pin_current_thread_to(&cpus.0) {
                    eprintln!("bench: cannot pin a client thread to CPUs {cpus:?}: {e}");
                }
            }
        })
        .enable_all()
        .build()
        .context("starting the client runtime")
}

/// A temporary directory under `--data`, removed when dropped.
fn scratch_dir(args: &BenchArgs) -> anyhow::Result<tempfile::TempDir> {
    let parent = std::fs::canonicalize(&args.data)
        .with_context(|| format!("--data {}", args.data.display()))?;
    tempfile::Builder::new()
        .prefix("rotary-bench-")
        .tempdir_in(&parent)
        .with_context(|| format!("making a temporary directory in {}", parent.display()))
}

/// Runs the scenarios `args` selects and prints their figures.
pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    if args.echo_server {
        return pingpong::serve_echo(&args);
    }
    if !args.chart_results.is_empty() {
        return omb::chart_results(&args);
    }
    if let Some(path) = &args.workload {
        return omb::run_workload(&args, path);
    }
    args.check()?;
    let mut figures = Figures::new(&args);
    let scratch = scratch_dir(&args)?;
    eprintln!("scratch directory: {}", scratch.path().display());

    if args.wants(Scenario::Pingpong) {
        run_pingpong(&args, &mut figures)?;
    }
    if args.wants(Scenario::Baseline) {
        run_baseline(&args, scratch.path(), &mut figures)?;
    }
    let broker_scenarios = [
        Scenario::Append1m,
        Scenario::Latency1k,
        Scenario::Fanout64x4k,
        Scenario::TailReaders,
        Scenario::Backfill,
    ];
    if broker_scenarios.iter().any(|s| args.wants(*s)) {
        run_on_broker(&args, scratch.path(), &mut figures)?;
    }
    if args.wants(Scenario::Allocator) {
        allocator::run()?;
    }
    if args.wants(Scenario::Replication) {
        run_replication(&args, scratch.path(), &mut figures)?;
    }
    if args.wants(Scenario::Failover) {
        let exe = replication::broker_executable()?;
        let f = failover::run(&exe, &scratch.path().join("failover"), args.failover_ttl)?;
        println!("{}", f.summary());
        figures.failover = Some(f);
    }
    let faults_failed = args.wants(Scenario::Faults) && !run_faults(&args)?;
    if args.wants(Scenario::Http) {
        http::run(&args, &scratch.path().join("http"))?;
    }
    let messages = if args.wants(Scenario::Messages) {
        Some(messages::run(&args, &scratch.path().join("messages"))?)
    } else {
        None
    };
    drop(scratch);
    print_figures(&args, &figures, messages.as_ref())?;
    anyhow::ensure!(
        !faults_failed,
        "the faults scenario found violations (listed above)"
    );
    Ok(())
}

/// TCP round trips on loopback, unpinned and then pinned to one core and
/// to two.
fn run_pingpong(args: &BenchArgs, figures: &mut Figures) -> anyhow::Result<()> {
    eprintln!("pingpong: {} B round trips on loopback", args.pingpong_size);
    let cpu = cpu::Sample::now();
    figures.pingpong = Some(pingpong::run(args, pingpong::Placement::Unpinned)?);
    figures.note_foreign_cpu("pingpong", &cpu);
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    for placement in [
        pingpong::Placement::SameCore,
        pingpong::Placement::CrossCore,
    ] {
        if placement == pingpong::Placement::CrossCore && cpus < 2 {
            continue;
        }
        eprintln!("pingpong: {}", placement.name());
        let cpu = cpu::Sample::now();
        figures
            .pingpong_pinned
            .push(pingpong::run(args, placement)?);
        figures.note_foreign_cpu(
            match placement {
                pingpong::Placement::SameCore => "pingpong-same-core",
                _ => "pingpong-cross-core",
            },
            &cpu,
        );
    }
    Ok(())
}

/// The disk's, the network's and one core's hashing floors.
fn run_baseline(args: &BenchArgs, scratch: &Path, figures: &mut Figures) -> anyhow::Result<()> {
    let cpu = cpu::Sample::now();
    eprintln!("baseline: fio, 1 MiB blocks");
    let job = baseline::FioJob {
        key: "fio",
        block_kib: 1024,
        iodepth: args.fio_iodepth,
        file_mib: args.fio_size_mib,
        mode: baseline::FioMode::Overwrite,
        fdatasync: false,
    };
    figures.fio = baseline::fio(args, scratch, &job, &mut figures.skipped)?;
    eprintln!("baseline: fio, 1 MiB blocks into fresh preallocated space");
    let job = baseline::FioJob {
        key: "fio-fresh",
        mode: baseline::FioMode::Fresh,
        ..job
    };
    figures.fio_fresh = baseline::fio(args, scratch, &job, &mut figures.skipped)?;
    eprintln!("baseline: fio, 4 KiB blocks one at a time");
    let job = baseline::FioJob {
        key: "fio-4k",
        block_kib: 4,
        iodepth: 1,
        file_mib: FIO_4K_FILE_MIB,
        mode: baseline::FioMode::Overwrite,
        fdatasync: false,
    };
    figures.fio_4k = baseline::fio(args, scratch, &job, &mut figures.skipped)?;
    if args.baseline {
        for job in baseline::matrix(args.fio_size_mib) {
            eprintln!("baseline: {}", job.key);
            if let Some(f) = baseline::fio(args, scratch, &job, &mut figures.skipped)? {
                figures.fio_matrix.push(f);
            }
        }
        eprintln!("baseline: fio, 4 KiB writes each followed by fdatasync");
        let job = baseline::FioJob {
            key: "fio-4k-fdatasync",
            block_kib: 4,
            iodepth: 1,
            file_mib: FIO_4K_FILE_MIB,
            mode: baseline::FioMode::Overwrite,
            fdatasync: true,
        };
        figures.fdatasync = baseline::fio(args, scratch, &job, &mut figures.skipped)?;
    }
    eprintln!("baseline: iperf3");
    figures.iperf3 = baseline::iperf3(args, &mut figures.skipped)?;
    eprintln!("baseline: SHA-1");
    figures.sha1 = Some(baseline::sha1(args));
    figures.note_foreign_cpu("baseline", &cpu);
    Ok(())
}

/// The scenarios that load one broker, embedded or `--broker`.
fn run_on_broker(args: &BenchArgs, scratch: &Path, figures: &mut Figures) -> anyhow::Result<()> {
    let rt = client_runtime(args)?;
    let target = broker::Target::open(args, &scratch.join("broker"))?;
    figures.broker = Some(target.describe());
    let store_dir = scratch.join("store");
    let result = rt.block_on(load::run_all(args, &target, &store_dir, figures));
    // Stop the client (its connection tasks) before the broker.
    rt.shutdown_timeout(Duration::from_secs(5));
    target.close();
    result?;
    Ok(())
}

/// Three brokers as child processes, replication 1 against replication 3.
fn run_replication(args: &BenchArgs, scratch: &Path, figures: &mut Figures) -> anyhow::Result<()> {
    let f = replication::run(args, &scratch.join("replication"))?;
    if let Some(p) = f.foreign_cpu_percent {
        figures.foreign_cpu_percent.push(("replication", p));
    }
    if let Some(p) = f.steal_cpu_percent {
        figures.steal_cpu_percent.push(("replication", p));
    }
    figures.replication = Some(f);
    Ok(())
}

/// The faults scenario; prints its table and returns whether every check
/// passed.
fn run_faults(args: &BenchArgs) -> anyhow::Result<bool> {
    let exe = replication::broker_executable()?;
    // Not in the scratch directory: the directory of a run whose
    // checks failed is kept, with the processes' logs.
    let dir = std::fs::canonicalize(&args.data)
        .with_context(|| format!("--data {}", args.data.display()))?;
    let outcomes = faults::bench(&exe, &dir, &args.faults, args.fault_rounds)?;
    print!("{}", faults::table(&outcomes));
    Ok(outcomes.iter().all(|o| o.passed()))
}

/// The table (and the messages scenario's lines) on stdout, and the JSON
/// to `--output`.
fn print_figures(
    args: &BenchArgs,
    figures: &Figures,
    messages: Option<&messages::MessagesFigures>,
) -> anyhow::Result<()> {
    print!("{}", figures.table());
    if let Some(m) = messages {
        print!("{m}");
    }
    if let Some(path) = &args.output {
        let json = serde_json::to_vec_pretty(&figures.to_json()).expect("figures serialize");
        std::fs::write(path, json).with_context(|| format!("writing {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}
