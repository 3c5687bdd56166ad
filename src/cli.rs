//! Command-line shapes and what each command does.

use crate::output;
use anyhow::Context as _;
use clap::{Args, Parser, Subcommand, ValueEnum};
use rotary_net::client::{Client, ClientError, ReadEvent};
use rotary_net::spec::{parse_specs, LabelSelector, LabelSet, SpecError};
use rotary_net::wire::{AppendRequest, ReadRequest, OFFSET_MAX};
use rotary_net::Status;
use std::io::Write as _;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;

/// Default broker endpoint of client commands.
pub const BROKER_DEFAULT: &str = "127.0.0.1:7401";
/// Environment variable naming the broker endpoint.
pub const BROKER_ENV: &str = "ROTARY_BROKER";

pub const EXIT_OK: i32 = 0;
pub const EXIT_FAILED: i32 = 1;
pub const EXIT_USAGE: i32 = 2;
pub const EXIT_RETRYABLE: i32 = 3;
/// The command's change was made but its result could not be written out:
/// a script must not retry it.
pub const EXIT_CHANGED_UNREPORTED: i32 = 4;

#[derive(Parser, Debug)]
#[command(
    name = "rotary",
    version,
    about = "A streaming journal broker: append-only byte journals."
)]
pub struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Runs a broker until SIGINT or SIGTERM.
    Serve(Box<ServeArgs>),
    /// Creates, lists, deletes and seals journals.
    Journals {
        #[command(subcommand)]
        cmd: JournalsCmd,
    },
    /// Lists the cluster's brokers, or drains one.
    Brokers {
        #[command(subcommand)]
        cmd: BrokersCmd,
    },
    /// Appends standard input (or a file) to a journal as one atomic span and
    /// prints the result as one JSON line.
    Append(AppendArgs),
    /// Reads a journal's bytes to standard output.
    Read(ReadArgs),
    /// Publishes JSON lines from standard input as messages
    /// (docs/MESSAGES.md), to the journals in turn.
    Publish(crate::messages::PublishArgs),
    /// Prints the messages of journals, one per line: read committed
    /// (each committed message once), or everything with --uncommitted.
    Consume(crate::messages::ConsumeArgs),
    /// Lists a journal's fragments, with their states: open, uploading,
    /// uploaded, local, stored, damaged, and for store fragments that
    /// disagree with another over the same offsets, conflicting (not the
    /// journal's history: never served, removed by `journals prune`) or
    /// disputed (not known to be: reads of its span are refused).
    Fragments {
        name: String,
        #[arg(short = 'o', long = "output", value_enum, default_value_t = TableOrJson::Table)]
        output: TableOrJson,
        #[command(flatten)]
        broker: BrokerArgs,
    },
    /// Prints the broker's counters as JSON.
    Stats {
        #[command(flatten)]
        broker: BrokerArgs,
    },
    /// Checks this host for what a broker needs.
    Doctor {
        /// Data directory to check.
        #[arg(long = "data", default_value = "./rotary-data")]
        data: PathBuf,
    },
    /// Load-tests a broker and measures this machine's floors in the same
    /// run (docs/BENCHMARKS.md).
    Bench(Box<rotary_benches::BenchArgs>),
    /// Calibrates the data directory's device and writes
    /// <data>/tune-profile.json, which `serve` reads at start.
    Tune {
        /// Data directory whose device is calibrated.
        #[arg(long = "data", default_value = "./rotary-data")]
        data: PathBuf,
        /// About 5 s instead of 20-25 s; coarser.
        #[arg(long)]
        quick: bool,
    },
}

#[derive(Args, Debug)]
pub(crate) struct BrokerArgs {
    /// How long an append, or a read (not --proxy or --metadata), keeps
    /// being tried while its journal's route moves (a broker died or hands
    /// its journals off): a broken connection, or NO_JOURNAL_PRIMARY_BROKER,
    /// INSUFFICIENT_JOURNAL_BROKERS, REPLICATION_FAILED and the like. Each
    /// try asks the route again; a read goes on from the next offset it
    /// has not printed. A retried append may have committed the first
    /// time; give --offset or registers to keep it exactly once. Content
    /// longer than 16 MiB is streamed and not retried. 0: no retries.
    /// [env: ROTARY_RETRY_FOR] [default: 30s]
    #[arg(long = "retry-for", value_name = "DURATION", value_parser = parse_retry_for)]
    retry_for: Option<std::time::Duration>,
    /// Broker endpoint, any shard's HOST:PORT, or several comma-separated
    /// (the first that answers serves) [env: ROTARY_BROKER] [default: 127.0.0.1:7401]
    #[arg(long = "broker", value_name = "HOST:PORT[,HOST:PORT…]")]
    broker: Option<String>,
}

/// The variable `--retry-for` falls back on.
pub const RETRY_FOR_ENV: &str = "ROTARY_RETRY_FOR";
/// `--retry-for` without the flag or the variable.
const RETRY_FOR_DEFAULT: std::time::Duration = std::time::Duration::from_secs(30);

impl BrokerArgs {
    /// `--retry-for`, else `ROTARY_RETRY_FOR`, else 30 s.
    fn retry_for(&self) -> Result<std::time::Duration, CliError> {
        if let Some(d) = self.retry_for {
            return Ok(d);
        }
        match std::env::var(RETRY_FOR_ENV) {
            Ok(v) if !v.is_empty() => parse_retry_for(&v).map_err(|why| {
                CliError::Usage("BAD_USAGE", format!("{RETRY_FOR_ENV} {v:?}: {why}"))
            }),
            _ => Ok(RETRY_FOR_DEFAULT),
        }
    }

    /// The endpoint to connect to: `--broker`, else `ROTARY_BROKER`, else
    /// the default. One that is not `HOST:PORT` is bad usage, not an
    /// unreachable broker: trying again cannot help.
    fn endpoint(&self) -> Result<String, CliError> {
        let (endpoint, source) = match (&self.broker, std::env::var(BROKER_ENV)) {
            (Some(b), _) => (b.clone(), "--broker"),
            (None, Ok(e)) if !e.is_empty() => (e, BROKER_ENV),
            (None, _) => (BROKER_DEFAULT.to_string(), "the default broker"),
        };
        // Several brokers, comma-separated: the first that answers serves.
        for one in endpoint.split(',') {
            check_endpoint(one.trim()).map_err(|why| {
                CliError::Usage("BAD_USAGE", format!("{source} {endpoint:?}: {why}"))
            })?;
        }
        Ok(endpoint)
    }
}

/// Checks the shape of `HOST:PORT`: a host (a name, an IPv4 address or a
/// bracketed IPv6 address) and a port from 1 to 65535. Whether the host
/// resolves, and whether a broker listens there, is for connecting to find
/// out.
fn check_endpoint(endpoint: &str) -> Result<(), String> {
    let Some((host, port)) = endpoint.rsplit_once(':') else {
        return Err("want HOST:PORT, e.g. 127.0.0.1:7401".into());
    };
    if host.is_empty() || host.chars().any(char::is_whitespace) {
        return Err("want HOST:PORT with a host before the colon".into());
    }
    match port.parse::<u16>() {
        Ok(p) if p > 0 => Ok(()),
        _ => Err(format!("port {port:?} is not a number from 1 to 65535")),
    }
}

#[derive(Args, Debug)]
struct ServeArgs {
    /// Data directory: specs, commit logs, spools and local fragments.
    #[arg(long = "data", default_value = "./rotary-data")]
    data: PathBuf,
    /// Endpoint of shard 0; shard n listens on port + n.
    #[arg(
        long = "listen",
        default_value = "127.0.0.1:7401",
        value_name = "HOST:PORT"
    )]
    listen: String,
    /// Number of shards (one per core); 0 = every core.
    #[arg(long = "cores", default_value_t = 0)]
    cores: usize,
    /// Free disk space never spent on spools: bytes, or with K, M, G, T (binary) suffix.
    #[arg(long = "disk-reserve", value_name = "BYTES", value_parser = parse_bytes)]
    disk_reserve: Option<u64>,
    /// Sealed bytes of journals with stores that may wait on local disk for
    /// their upload; beyond it, appends to such journals are refused with
    /// FRAGMENT_STORE_UNHEALTHY until uploads catch up. Each shard has an
    /// equal share, for its own journals. K, M, G, T suffixes.
    #[arg(long = "spool-budget", value_name = "BYTES", value_parser = parse_bytes, default_value = "8G")]
    spool_budget: u64,
    /// Append content the broker holds in memory, read from clients and
    /// queued behind busy journals; beyond it, a connection holding more
    /// than 1 MiB of it is not read until the queue drains, unless an
    /// append of it holds its journal (each client connection holds at
    /// most 64 MiB either way). Each shard has an equal share. K, M, G, T
    /// suffixes.
    #[arg(long = "append-queue-budget", value_name = "BYTES", value_parser = parse_bytes, default_value = "1G")]
    append_queue_budget: u64,
    /// Bytes of uploaded fragments kept on local disk to serve reads; the
    /// oldest go first. 0 = drop each fragment once uploaded (history is
    /// then read from the stores). Each shard has an equal share. K, M, G,
    /// T suffixes.
    #[arg(long = "local-cache", value_name = "BYTES", value_parser = parse_bytes, default_value = "4G")]
    local_cache: u64,
    /// Threads that compress and upload sealed fragments to their stores.
    #[arg(long = "upload-threads", value_name = "N", value_parser = parse_upload_threads, default_value = "2")]
    upload_threads: usize,
    /// Cores to pin shards to, e.g. `1` or `0,2-3`: shard n runs on the
    /// n-th (cycling). Without it shard n runs on core n. Brokers sharing a
    /// host give each other disjoint lists.
    #[arg(long = "cpus", value_name = "LIST", value_parser = parse_cpus)]
    cpus: Option<CpuList>,
    /// Cores the io-wq workers of the shards' rings run on (writes the
    /// kernel cannot issue inline, fsyncs). Default: the cores without
    /// shards, or each shard's own core when every core has a shard. Give
    /// the shards' cores when the spare cores are busy with other work.
    #[arg(long = "iowq-cpus", value_name = "LIST", value_parser = parse_cpus)]
    iowq_cpus: Option<CpuList>,
    /// A cluster without etcd, to try one out: a YAML file of `brokers:
    /// [{id, zone, endpoint}]` and `journals:` (specs, as `journals apply`
    /// takes them). The broker listens on its own endpoint from it and
    /// re-reads it when it changes or on SIGHUP; APPLY and DELETE are
    /// refused. Nothing notices a dead broker: use --etcd for failover.
    /// Needs --id; excludes --listen.
    #[arg(
        long = "cluster",
        value_name = "FILE",
        requires = "id",
        conflicts_with = "listen"
    )]
    cluster: Option<PathBuf>,
    /// This broker's id: in the cluster file, or as a member in etcd.
    #[arg(long = "id", value_name = "ID")]
    id: Option<String>,
    /// etcd endpoints, comma-separated (`http://127.0.0.1:2379`): the
    /// broker joins the cluster kept there under --etcd-prefix, as member
    /// --id, and listens on --listen. Needs --id; excludes --cluster.
    #[arg(long = "etcd", value_name = "URLS", conflicts_with = "cluster")]
    etcd: Option<String>,
    /// With --etcd: the broker's zone; replicas of a journal go to
    /// distinct zones where there are enough.
    #[arg(
        long = "zone",
        value_name = "ZONE",
        default_value = "",
        requires = "etcd"
    )]
    zone: String,
    /// With --etcd: the address other brokers and clients reach shard 0
    /// at (default: --listen).
    #[arg(long = "advertise", value_name = "HOST:PORT", requires = "etcd")]
    advertise: Option<String>,
    /// With --etcd: the key prefix of the cluster in etcd.
    #[arg(
        long = "etcd-prefix",
        value_name = "PREFIX",
        default_value = "/rotary",
        requires = "etcd"
    )]
    etcd_prefix: String,
    /// With --etcd: the TTL of the broker's lease. A broker that dies is
    /// noticed, and its journals move, once its lease expires. A duration
    /// such as 10s; from 2s to 1h.
    #[arg(long = "lease-ttl", value_name = "DURATION", value_parser = parse_lease_ttl, default_value = "10s", requires = "etcd")]
    lease_ttl: std::time::Duration,
    /// With --etcd: how many journals (as primary or replica) the broker
    /// may hold.
    #[arg(long = "journal-limit", value_name = "N", default_value_t = rotary_engine::cluster::JOURNAL_LIMIT_DEFAULT, requires = "etcd")]
    journal_limit: u32,
    /// How long a broker or shard that a request was forwarded or proxied
    /// to may send nothing while the request waits, before it is PINGed;
    /// after as long again with nothing, the request is answered IO_ERROR.
    /// A duration such as 15s.
    #[arg(long = "peer-silence", value_name = "DURATION", value_parser = parse_peer_wait, default_value = "15s")]
    peer_silence: std::time::Duration,
    /// How old the fragment after a gap in a journal's history must be
    /// before a read jumps the gap; a younger gap may still be filled, so
    /// reads wait there. A duration such as 6h; 0s jumps at once.
    #[arg(long = "offset-jump-age", value_name = "DURATION", value_parser = parse_duration_arg, default_value = "6h")]
    offset_jump_age: std::time::Duration,
    /// In a cluster: how long a primary waits for a replica to acknowledge
    /// an append before it treats the replica as gone, answers the appends
    /// waiting on it REPLICATION_FAILED and reconnects. A duration such as
    /// 10s.
    #[arg(long = "replica-ack-timeout", value_name = "DURATION", value_parser = parse_peer_wait, default_value = "10s")]
    replica_ack_timeout: std::time::Duration,
    /// The time slice each shard's thread asks the kernel's scheduler for
    /// (Linux 6.12 or later): a shard with a shorter slice than the thread
    /// running on its core preempts that thread as soon as it wakes. From
    /// 100us to 100ms; 0 keeps the kernel's default.
    #[arg(long = "shard-slice", value_name = "DURATION", value_parser = parse_shard_slice, default_value = "100us")]
    shard_slice: std::time::Duration,
    /// In a cluster: how long a primary's shard keeps polling for work,
    /// rather than sleeping, after it proposed appends to replicas and
    /// while their acks are awaited. The acks come back sooner than a
    /// sleeping thread (and a halted virtual CPU) wakes; the poll costs the
    /// shard's core that time. Up to 10ms; 0 sleeps at once.
    #[arg(long = "ack-poll", value_name = "DURATION", value_parser = parse_ack_poll, default_value = "1ms")]
    ack_poll: std::time::Duration,
    /// The HTTP listener (metrics, health probes, journal gateway), or
    /// `off`. When the default address is taken (another broker on the
    /// host), the broker runs without one and says so; an address given
    /// here must be free.
    #[arg(long = "http", value_name = "HOST:PORT|off", default_value = HTTP_DEFAULT)]
    http: String,
    /// Largest body the HTTP gateway appends (PUT); larger ones are
    /// answered 413. K, M, G suffixes.
    #[arg(long = "http-body-limit", value_name = "BYTES", value_parser = parse_bytes, default_value = "64M")]
    http_body_limit: u64,
    /// How long an HTTP request's headers may take to arrive, and a PUT's
    /// body may send nothing, before the request is answered or closed.
    #[arg(long = "http-timeout", value_name = "DURATION", value_parser = parse_peer_wait, default_value = "10s")]
    http_timeout: std::time::Duration,
    /// Journals (a label selector, e.g. `app=orders`) that get series of
    /// their own on /metrics. Without it, metrics are per broker and shard
    /// only.
    #[arg(long = "metrics-journals", value_name = "SELECTOR")]
    metrics_journals: Option<String>,
    /// Log lines as human text (default) or as JSON objects, one a line.
    #[arg(long = "log-format", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

/// `serve --http` by default.
const HTTP_DEFAULT: &str = "127.0.0.1:7480";

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

fn parse_lease_ttl(s: &str) -> Result<std::time::Duration, String> {
    let d = rotary_net::spec::parse_duration(s)
        .map_err(|_| format!("{s:?} is not a duration such as 10s or 1m"))?;
    if d < std::time::Duration::from_secs(2) || d > std::time::Duration::from_secs(3600) {
        return Err("must be from 2s to 1h".to_string());
    }
    Ok(d)
}

/// A duration in whole microseconds (`250us`, `250µs`) or as in journal
/// specs (`2ms`, `0`), whose durations are whole milliseconds.
fn parse_fine_duration(s: &str) -> Result<std::time::Duration, String> {
    let parsed = match s.strip_suffix("us").or_else(|| s.strip_suffix("µs")) {
        Some(n) => n.parse::<u64>().ok().map(std::time::Duration::from_micros),
        None => rotary_net::spec::parse_duration(s).ok(),
    };
    parsed.ok_or_else(|| format!("{s:?} is not a duration such as 250us or 2ms"))
}

fn parse_ack_poll(s: &str) -> Result<std::time::Duration, String> {
    let d = parse_fine_duration(s)?;
    if d <= std::time::Duration::from_millis(10) {
        Ok(d)
    } else {
        Err("must be from 0 to 10ms".to_string())
    }
}

fn parse_shard_slice(s: &str) -> Result<std::time::Duration, String> {
    let d = parse_fine_duration(s)?;
    let range = std::time::Duration::from_micros(100)..=std::time::Duration::from_millis(100);
    if d.is_zero() || range.contains(&d) {
        Ok(d)
    } else {
        Err("must be 0, or from 100us to 100ms".to_string())
    }
}

fn parse_duration_arg(s: &str) -> Result<std::time::Duration, String> {
    rotary_net::spec::parse_duration(s).map_err(|e| e.to_string())
}

fn parse_peer_wait(s: &str) -> Result<std::time::Duration, String> {
    match rotary_net::spec::parse_duration(s).map_err(|e| e.to_string())? {
        d if d < std::time::Duration::from_millis(100) => Err("must be at least 100ms".to_string()),
        d => Ok(d),
    }
}

/// Cores given to `--cpus`.
#[derive(Clone, Debug, PartialEq, Eq)]
struct CpuList(Vec<usize>);

/// A core list: `1`, `0,2`, `2-5`, or a mix.
fn parse_cpus(s: &str) -> Result<CpuList, String> {
    rotary_engine::parse_cpu_list(s).map(CpuList)
}

/// Most upload threads `serve` accepts.
const UPLOAD_THREADS_MAX: usize = 256;

fn parse_upload_threads(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(n) if (1..=UPLOAD_THREADS_MAX).contains(&n) => Ok(n),
        _ => Err(format!(
            "{s:?}: want a thread count from 1 to {UPLOAD_THREADS_MAX}"
        )),
    }
}

#[derive(Subcommand, Debug)]
enum BrokersCmd {
    /// Lists the brokers: id, zone, endpoint, journal limit, journals and
    /// primaries held, and whether each is exiting.
    List {
        #[arg(short = 'o', long = "output", value_enum, default_value_t = TableOrJson::Table)]
        output: TableOrJson,
        #[command(flatten)]
        broker: BrokerArgs,
    },
    /// Marks a broker exiting: the allocator moves its journals to other
    /// brokers (each replacement added before the broker's copy goes), and
    /// the broker stops once it holds none. A cluster on etcd only.
    Drain {
        /// The broker's member id.
        id: String,
        #[command(flatten)]
        broker: BrokerArgs,
    },
}

#[derive(Subcommand, Debug)]
enum JournalsCmd {
    /// Creates or replaces journals from YAML or JSON specs (one spec or a list).
    Apply {
        /// Spec file; `-` reads standard input.
        #[arg(short = 'f', long = "file", value_name = "FILE")]
        file: String,
        #[command(flatten)]
        broker: BrokerArgs,
    },
    /// Lists journals. `-o yaml` prints a list of specs, each with the
    /// revision it was read at, that `apply` takes back (refusing a spec
    /// changed meanwhile); `-o json` prints the broker's entries (spec,
    /// revision and route).
    List {
        /// Label selector, e.g. `app=orders,region notin (eu, us),!retired`.
        #[arg(short = 'l', long = "selector", default_value = "")]
        selector: String,
        #[arg(short = 'o', long = "output", value_enum, default_value_t = ListFormat::Table)]
        output: ListFormat,
        /// Keep listing: print a line for each journal whose spec or route
        /// changes (and each that appears or goes), until interrupted.
        #[arg(long = "watch", conflicts_with = "output")]
        watch: bool,
        #[command(flatten)]
        broker: BrokerArgs,
    },
    /// Opens the specs of the selected journals in `$EDITOR` (as `list -o
    /// yaml` prints them) and applies what is saved: a spec changed by
    /// someone else meanwhile is refused with ETCD_TRANSACTION_FAILED.
    Edit {
        #[arg(short = 'l', long = "selector", default_value = "")]
        selector: String,
        #[command(flatten)]
        broker: BrokerArgs,
    },
    /// Deletes a journal and its local fragments.
    Delete {
        name: String,
        #[command(flatten)]
        broker: BrokerArgs,
    },
    /// Seals a journal's open spool into a fragment now.
    Seal {
        name: String,
        #[command(flatten)]
        broker: BrokerArgs,
    },
    /// Moves a journal's write head to the end of its history in the
    /// fragment stores. Needed once after a broker lost its data directory
    /// (appends answer INDEX_HAS_GREATER_OFFSET until then). Prints
    /// `{"journal":…,"write_head":…}`.
    ResetHead {
        name: String,
        #[command(flatten)]
        broker: BrokerArgs,
    },
    /// Deletes store fragments older than their journal's
    /// `fragment.retention` (journals whose retention is 0s keep everything),
    /// and, whatever their age, those the journal's brokers found
    /// conflicting with its committed history (`rotary fragments` shows
    /// them). Prints one line per fragment removed.
    Prune {
        /// Only journals matching this label selector.
        #[arg(short = 'l', long = "selector", default_value = "")]
        selector: String,
        /// Print what would be removed, remove nothing.
        #[arg(long = "dry-run")]
        dry_run: bool,
        #[arg(short = 'o', long = "output", value_enum, default_value_t = TableOrJson::Table)]
        output: TableOrJson,
        #[command(flatten)]
        broker: BrokerArgs,
    },
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum ListFormat {
    Table,
    Json,
    Yaml,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum TableOrJson {
    Table,
    Json,
}

#[derive(Args, Debug)]
struct AppendArgs {
    name: String,
    /// Read content from this file instead of standard input (`-` is
    /// standard input).
    #[arg(short = 'i', long = "input", value_name = "FILE")]
    input: Option<PathBuf>,
    /// Commit only if the journal's write head is exactly this offset, 0
    /// to 9223372036854775807 (0: only into an empty journal). Without it
    /// the append commits at the write head, wherever that is.
    #[arg(long = "offset", value_name = "N", value_parser = parse_append_offset, allow_hyphen_values = true)]
    offset: Option<u64>,
    /// Commit only if the journal's registers match this selector.
    #[arg(long = "check-registers", value_name = "SELECTOR")]
    check_registers: Option<String>,
    /// Registers to set when the append commits, `k=v,k2=v2`: each name
    /// given gets exactly these values, replacing those it had. Applied
    /// after --subtract-registers.
    #[arg(long = "union-registers", value_name = "K=V,...")]
    union_registers: Option<String>,
    /// Registers to remove when the append commits, `k=v,...`: a name is
    /// removed when its values are exactly those given (`k` alone is the
    /// empty value, which removes only an empty `k`).
    #[arg(long = "subtract-registers", value_name = "K=V,...")]
    subtract_registers: Option<String>,
    #[command(flatten)]
    broker: BrokerArgs,
}

#[derive(Args, Debug)]
struct ReadArgs {
    name: String,
    /// First offset to read, 0 to 9223372036854775807; `head` (or -1) is
    /// the write head.
    #[arg(long = "offset", default_value = "0", value_parser = parse_offset, allow_hyphen_values = true)]
    offset: ReadOffset,
    /// Stop before this offset, 1 to 9223372036854775807, and greater than
    /// --offset. Without it the read ends at the write head (or, with
    /// --block, never).
    #[arg(long = "end-offset", value_name = "N", value_parser = parse_end_offset)]
    end_offset: Option<u64>,
    /// Wait at the write head for more content (until --end-offset, if given).
    #[arg(long = "block")]
    block: bool,
    /// Print `{"offset":…,"write_head":…}` instead of content.
    #[arg(long = "metadata")]
    metadata: bool,
    /// Let the broker stream history held in fragment stores, instead of
    /// fetching those fragments from the store directly (the default).
    #[arg(long = "proxy")]
    proxy: bool,
    /// Read the --broker's own copy: it answers from what it holds (and
    /// the store) or refuses with NOT_JOURNAL_BROKER; nothing is proxied
    /// to another broker. To compare the members of a route.
    #[arg(long = "pin", conflicts_with = "proxy")]
    pin: bool,
    #[command(flatten)]
    broker: BrokerArgs,
}

#[derive(Clone, Copy, Debug)]
enum ReadOffset {
    Head,
    At(u64),
}

fn parse_offset(s: &str) -> Result<ReadOffset, String> {
    match s {
        "head" | "-1" => Ok(ReadOffset::Head),
        _ => parse_offset_number(s).map(ReadOffset::At).map_err(|e| {
            e.unwrap_or_else(|| format!("{s:?} is not an offset (a byte count, or `head`)"))
        }),
    }
}

/// An append's expected write head. The wire's `-1` (no expectation) is
/// what leaving `--offset` out sends, so negative values are refused
/// rather than taken to mean "the head" as they do for `read`.
fn parse_append_offset(s: &str) -> Result<u64, String> {
    if s.starts_with('-') {
        return Err(format!(
            "append takes the write head it expects, 0 to {OFFSET_MAX}; \
             to append wherever the head is, leave --offset out"
        ));
    }
    parse_offset_number(s).map_err(|e| {
        e.unwrap_or_else(|| format!("{s:?} is not an offset (a byte count, 0 to {OFFSET_MAX})"))
    })
}

/// A read's end. 0 would name an empty range, but on the wire it means
/// "no end": it is refused rather than read as the whole journal.
fn parse_end_offset(s: &str) -> Result<u64, String> {
    match parse_offset_number(s) {
        Ok(0) => Err(
            "the end offset must be at least 1; leave --end-offset out to read to the head".into(),
        ),
        Ok(o) => Ok(o),
        Err(e) => Err(e.unwrap_or_else(|| {
            format!("{s:?} is not an offset (a byte count, 1 to {OFFSET_MAX})")
        })),
    }
}

/// A decimal offset the wire can carry. `Err(Some(_))` names the limit;
/// `Err(None)` is not a number at all.
fn parse_offset_number(s: &str) -> Result<u64, Option<String>> {
    let too_large = || {
        Some(format!(
            "{s} exceeds {OFFSET_MAX} (i64::MAX), the largest offset"
        ))
    };
    match s.parse::<u64>() {
        Ok(o) if o <= OFFSET_MAX => Ok(o),
        Ok(_) => Err(too_large()),
        Err(e) if *e.kind() == std::num::IntErrorKind::PosOverflow => Err(too_large()),
        Err(_) => Err(None),
    }
}

/// Parses `1073741824`, `512M`, `1G`, `1GiB`, `64k` (binary multiples).
fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (digits, unit) = t.split_at(split);
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("{s:?} is not a byte count"))?;
    let shift = match unit
        .trim()
        .to_ascii_lowercase()
        .trim_end_matches("ib")
        .trim_end_matches('b')
    {
        "" => 0,
        "k" => 10,
        "m" => 20,
        "g" => 30,
        "t" => 40,
        _ => return Err(format!("{s:?}: unknown unit (use K, M, G or T)")),
    };
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| format!("{s:?} is too large"))
}

/// Parses `k=v,k2=v2` (or `k` for an empty value) into a label set.
fn parse_label_set(text: &str) -> Result<LabelSet, SpecError> {
    let mut set = LabelSet::new();
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (n, v) = part.split_once('=').unwrap_or((part, ""));
        set.add(n.trim().to_string(), v.trim().to_string())?;
    }
    Ok(set)
}

/// A failed command: what to print and how to exit.
#[derive(Debug)]
pub enum CliError {
    /// The broker or the client library reported an error.
    Client(ClientError),
    /// Bad input from the user (exit 2): `(STATUS_NAME, explanation)`.
    Usage(&'static str, String),
    /// Anything else (exit 1).
    Other(&'static str, anyhow::Error),
    /// The command changed something (`what`) and then could not write its
    /// result (exit 4).
    ChangedUnreported { what: String, error: anyhow::Error },
}

impl From<ClientError> for CliError {
    fn from(e: ClientError) -> Self {
        CliError::Client(e)
    }
}

/// An error and its causes, `a: b: c`, leaving out a cause whose text the
/// message before it already carries (many errors print their source).
fn chain_text(e: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in e.chain() {
        let c = cause.to_string();
        if text.is_empty() {
            text = c;
        } else if !text.contains(&c) {
            text.push_str(": ");
            text.push_str(&c);
        }
    }
    text
}

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

impl CliError {
    fn report(&self) -> i32 {
        let (name, text, code): (&str, String, i32) = match self {
            CliError::Client(e) => match e {
                ClientError::Status {
                    status, message, ..
                } => {
                    let code = status_exit_code(*status);
                    let text = if message.is_empty() {
                        status_explanation(*status).to_string()
                    } else {
                        message.clone()
                    };
                    (status.name(), text, code)
                }
                ClientError::Io { .. } => ("UNAVAILABLE", e.to_string(), EXIT_RETRYABLE),
                ClientError::Protocol { .. } => ("PROTOCOL_ERROR", e.to_string(), EXIT_FAILED),
                ClientError::Invalid(inner) => ("BAD_REQUEST", inner.to_string(), EXIT_USAGE),
                ClientError::Offset(inner) => ("BAD_REQUEST", inner.to_string(), EXIT_USAGE),
                ClientError::Content(inner) => (
                    "INPUT_ERROR",
                    format!("reading content: {inner}"),
                    EXIT_FAILED,
                ),
                ClientError::Fragment(inner) => {
                    ("FRAGMENT_CORRUPT", inner.to_string(), EXIT_FAILED)
                }
            },
            CliError::Usage(name, text) => (name, text.clone(), EXIT_USAGE),
            CliError::Other(name, e) => (name, chain_text(e), EXIT_FAILED),
            CliError::ChangedUnreported { what, error } => (
                "OUTPUT_ERROR_AFTER_CHANGE",
                format!("{what}, but {}: do not retry", chain_text(error)),
                EXIT_CHANGED_UNREPORTED,
            ),
        };
        eprintln!("error: {name}: {}", one_line(&text));
        code
    }
}

/// A broker status's exit code: `BAD_REQUEST` is what the command line
/// asked for (an empty append with register changes, a spec the broker
/// refuses), so it exits like every other invalid input; retryable
/// statuses exit 3 so that scripts know to try again.
fn status_exit_code(status: Status) -> i32 {
    if status == Status::BAD_REQUEST {
        EXIT_USAGE
    } else if status.is_retryable() {
        EXIT_RETRYABLE
    } else {
        EXIT_FAILED
    }
}

fn status_explanation(status: Status) -> &'static str {
    match status {
        Status::JOURNAL_NOT_FOUND => "no journal of that name exists",
        Status::NOT_ALLOWED => "the journal's flags forbid this",
        Status::WRONG_APPEND_OFFSET => "the write head is not at the expected offset",
        Status::REGISTER_MISMATCH => "the journal's registers do not match",
        Status::OFFSET_NOT_YET_AVAILABLE => "the offset is at or beyond the write head",
        Status::INDEX_HAS_GREATER_OFFSET => {
            "the fragment stores hold history beyond the write head; run `rotary journals reset-head`"
        }
        Status::FRAGMENT_STORE_UNHEALTHY => {
            "a fragment store of the journal cannot be reached or uploads are behind"
        }
        Status::DISK_FAILED => {
            "the broker's disk failed under the journal; append elsewhere, or after the disk is replaced"
        }
        _ => "the broker refused the request",
    }
}

pub(crate) type CmdResult = Result<(), CliError>;

/// Runs a parsed command line; returns the process exit code.
pub fn run(cli: Cli) -> i32 {
    let result = match cli.cmd {
        Cmd::Serve(args) => serve(*args),
        Cmd::Doctor { data } => return rotary_tuning::doctor::run(&data),
        Cmd::Tune { data, quick } => return tune(&data, quick),
        Cmd::Bench(args) => {
            return match rotary_benches::run(*args) {
                Ok(()) => EXIT_OK,
                Err(e) => {
                    eprintln!("error: BENCH_FAILED: {}", one_line(&format!("{e:#}")));
                    EXIT_FAILED
                }
            }
        }
        other => {
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    return CliError::Other(
                        "RUNTIME_FAILED",
                        anyhow::Error::new(e).context("starting the runtime"),
                    )
                    .report()
                }
            };
            rt.block_on(client_command(other))
        }
    };
    match result {
        Ok(()) => EXIT_OK,
        Err(e) => e.report(),
    }
}

fn serve(args: ServeArgs) -> CmdResult {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        // The store client logs each of its retries at info; the uploader
        // reports what matters (a failed upload or listing) itself.
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,object_store=warn"));
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match args.log_format {
        LogFormat::Text => logs
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .try_init(),
        LogFormat::Json => logs.json().with_current_span(false).try_init(),
    };
    let listen: SocketAddr = args
        .listen
        .to_socket_addrs()
        .map_err(|e| CliError::Usage("BAD_USAGE", format!("--listen {}: {e}", args.listen)))?
        .next()
        .ok_or_else(|| {
            CliError::Usage("BAD_USAGE", format!("--listen {}: no address", args.listen))
        })?;
    if args.data.exists() && !args.data.is_dir() {
        return Err(CliError::Usage(
            "BAD_USAGE",
            format!("--data {}: not a directory", args.data.display()),
        ));
    }
    let etcd = etcd_config(&args, listen)?;
    let mut config = rotary_engine::ServeConfig::new(args.data, listen);
    apply_tune_profile(&mut config);
    config.cores = args.cores;
    if let Some(reserve) = args.disk_reserve {
        config.disk_reserve_bytes = reserve;
    }
    config.spool_budget_bytes = args.spool_budget;
    config.append_queue_bytes = args.append_queue_budget;
    config.upload_threads = args.upload_threads;
    config.local_cache_bytes = args.local_cache;
    config.etcd = etcd;
    config.cluster = match (args.cluster, &args.id) {
        (Some(file), Some(id)) => Some((file, id.clone())),
        (Some(_), None) => return Err(CliError::Usage("BAD_USAGE", "--cluster needs --id".into())),
        (None, Some(_)) if config.etcd.is_none() => {
            return Err(CliError::Usage(
                "BAD_USAGE",
                "--id goes with --etcd or --cluster".into(),
            ))
        }
        (None, _) => None,
    };
    config.cpus = args.cpus.map(|c| c.0).unwrap_or_default();
    config.iowq_cpus = args.iowq_cpus.map(|c| c.0).unwrap_or_default();
    config.peer_silence = args.peer_silence;
    config.offset_jump_age = args.offset_jump_age;
    config.shard_slice = args.shard_slice;
    config.ack_poll = args.ack_poll;
    config.replica_ack_timeout = args.replica_ack_timeout;
    if let Some(selector) = &args.metrics_journals {
        rotary_net::spec::LabelSelector::parse_journals(selector).map_err(|e| {
            CliError::Usage("BAD_USAGE", format!("--metrics-journals {selector:?}: {e}"))
        })?;
    }
    // The HTTP threads start here: on the broker's cores, like the rest.
    rotary_engine::confine_to_cores(&config)
        .map_err(|e| CliError::Other("SERVE_FAILED", anyhow::Error::new(e)))?;
    let http = match args.http.as_str() {
        "off" => None,
        addr => {
            let listen: SocketAddr = addr
                .to_socket_addrs()
                .map_err(|e| CliError::Usage("BAD_USAGE", format!("--http {addr}: {e}")))?
                .next()
                .ok_or_else(|| {
                    CliError::Usage("BAD_USAGE", format!("--http {addr}: no address"))
                })?;
            let mut c = rotary_http::HttpConfig::new(listen);
            c.body_limit_bytes = args.http_body_limit;
            c.timeout = args.http_timeout;
            c.metrics_journals = args.metrics_journals.clone();
            match rotary_http::HttpServer::start(c) {
                Ok(server) => Some(server),
                Err(e) if e.is_addr_in_use() && addr == HTTP_DEFAULT => {
                    tracing::warn!(error = %e, "no HTTP listener: the default address is taken (give --http another address, or --http off)");
                    None
                }
                Err(e) => return Err(CliError::Other("SERVE_FAILED", anyhow::Error::new(e))),
            }
        }
    };
    rotary_engine::serve_with(
        config,
        |broker| {
            if let Some(h) = &http {
                h.started(broker);
            }
        },
        || {
            if let Some(h) = &http {
                h.stopping();
            }
        },
    )
    .map_err(|e| CliError::Other("SERVE_FAILED", anyhow::Error::new(e)))
}

/// The cluster on etcd that `serve` joins, if `--etcd` names one.
fn etcd_config(
    args: &ServeArgs,
    listen: SocketAddr,
) -> Result<Option<rotary_engine::cluster::EtcdConfig>, CliError> {
    let Some(endpoints) = &args.etcd else {
        return Ok(None);
    };
    let usage = |m: String| CliError::Usage("BAD_USAGE", m);
    let id = args
        .id
        .clone()
        .ok_or_else(|| usage("--etcd needs --id".into()))?;
    let advertise = match &args.advertise {
        None => listen,
        Some(a) => a
            .to_socket_addrs()
            .ok()
            .and_then(|mut it| it.next())
            .ok_or_else(|| usage(format!("--advertise {a}: not a HOST:PORT")))?,
    };
    let config = rotary_engine::cluster::EtcdConfig {
        endpoints: endpoints.split(',').map(|e| e.trim().to_string()).collect(),
        prefix: args.etcd_prefix.clone(),
        id,
        zone: args.zone.clone(),
        advertise,
        lease_ttl: args.lease_ttl,
        journal_limit: args.journal_limit,
    };
    config.check().map_err(usage)?;
    Ok(Some(config))
}

fn tune(data: &std::path::Path, quick: bool) -> i32 {
    use rotary_tuning::tune::{self, TuneOptions};
    let base = if quick {
        TuneOptions::quick()
    } else {
        TuneOptions::standard()
    };
    let opts = TuneOptions {
        progress: true,
        ..base
    };
    match tune::run(data, &opts).and_then(|p| p.save(data)) {
        Ok(path) => {
            println!("wrote {}", path.display());
            EXIT_OK
        }
        Err(e) => {
            eprintln!("error: TUNE_FAILED: {}", one_line(&e.to_string()));
            EXIT_FAILED
        }
    }
}

/// Largest fallocate step taken from a tune profile.
const SPOOL_GROW_BYTES_MAX: u64 = 64 << 20;

/// Sizes the broker's I/O from `<data>/tune-profile.json` when there is
/// one; otherwise the engine's defaults stand. Says which in the log.
fn apply_tune_profile(config: &mut rotary_engine::ServeConfig) {
    let data = config.data_dir.clone();
    match rotary_tuning::tune::load(&data) {
        Ok(Some(p)) => {
            if !p.matches_device(&data) {
                tracing::warn!(measured_on = %p.host.device, "tune profile was measured on another device; using it anyway");
            }
            let r = &p.recommended;
            config.spool_sizing.buffer_bytes = r.write_batch_bytes as usize;
            // Every open spool holds this much ahead of its head; with many
            // journals a larger step only ties up disk.
            config.spool_sizing.grow_bytes = r.spool_grow_bytes.min(SPOOL_GROW_BYTES_MAX);
            // The ring also carries socket I/O: the disk's depth is a floor.
            config.ring_entries = config.ring_entries.max(r.ring_entries);
            tracing::info!(
                write_batch_bytes = r.write_batch_bytes,
                spool_grow_bytes = config.spool_sizing.grow_bytes,
                ring_entries = config.ring_entries,
                "sizing I/O from tune-profile.json"
            );
        }
        Ok(None) => {
            tracing::info!("no tune-profile.json; I/O sized by defaults (run `rotary tune`)")
        }
        Err(e) => tracing::warn!(error = %e, "tune profile not used; I/O sized by defaults"),
    }
}

/// How long a broker has to answer the PING each client command starts with.
const PING_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

pub(crate) async fn connect(broker: &BrokerArgs) -> Result<Client, CliError> {
    let options = rotary_net::client::ClientOptions {
        retry_for: broker.retry_for()?,
        ..Default::default()
    };
    answering(Client::connect_with(&broker.endpoint()?, options).await?).await
}

fn parse_retry_for(s: &str) -> Result<std::time::Duration, String> {
    let d = rotary_net::spec::parse_duration(s)
        .map_err(|_| format!("{s:?} is not a duration such as 30s or 2m"))?;
    if d > std::time::Duration::from_secs(3600) {
        return Err("must be at most 1h".to_string());
    }
    Ok(d)
}

/// Append content a CLI append reads into memory, so that it can be tried
/// again; longer content is streamed as it is read, and not retried.
const APPEND_RETRY_BUFFER_MAX: usize = 16 << 20;

/// Appends what `input` yields: whole, with retries, if it ends within
/// [`APPEND_RETRY_BUFFER_MAX`]; else streamed.
async fn append_input<R>(
    client: &Client,
    req: &AppendRequest,
    mut input: R,
) -> Result<rotary_net::wire::AppendReply, CliError>
where
    R: tokio::io::AsyncRead + Unpin,
{
    use tokio::io::AsyncReadExt;
    let mut head = Vec::new();
    (&mut input)
        .take(APPEND_RETRY_BUFFER_MAX as u64 + 1)
        .read_to_end(&mut head)
        .await
        .map_err(|e| CliError::Client(ClientError::Content(e)))?;
    if head.len() <= APPEND_RETRY_BUFFER_MAX {
        return Ok(client.append(req, head).await?);
    }
    let rest = std::io::Cursor::new(head).chain(input);
    Ok(client.append_stream(req, rest).await?)
}

/// The client, once its broker answered a PING. A listener that accepts but
/// never answers (a wedged broker, another service on the port) would
/// otherwise hang the command; this way it fails as UNAVAILABLE (exit 3).
async fn answering(client: Client) -> Result<Client, CliError> {
    match tokio::time::timeout(PING_TIMEOUT, client.ping()).await {
        Ok(answer) => answer?,
        Err(_) => {
            return Err(CliError::Client(ClientError::Io {
                endpoint: client.endpoint().to_string(),
                source: std::sync::Arc::new(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!(
                        "no answer to PING in {} s: is a rotary broker listening there?",
                        PING_TIMEOUT.as_secs()
                    ),
                )),
            }))
        }
    }
    Ok(client)
}

async fn client_command(cmd: Cmd) -> CmdResult {
    match cmd {
        Cmd::Serve(_) | Cmd::Doctor { .. } | Cmd::Tune { .. } | Cmd::Bench(_) => {
            unreachable!("handled without a runtime")
        }
        Cmd::Journals { cmd } => journals(cmd).await,
        Cmd::Brokers { cmd } => brokers(cmd).await,
        Cmd::Append(args) => append(args).await,
        Cmd::Read(args) => read(args).await,
        Cmd::Publish(args) => crate::messages::publish(args).await,
        Cmd::Consume(args) => crate::messages::consume(args).await,
        Cmd::Fragments {
            name,
            output,
            broker,
        } => {
            let client = connect(&broker).await?;
            let fragments = client.fragments(&name).await?;
            match output {
                TableOrJson::Json => print_json(&fragments),
                TableOrJson::Table => {
                    print_text(&output::fragments_table(&fragments, unix_now_secs()))
                }
            }
        }
        Cmd::Stats { broker } => {
            let client = connect(&broker).await?;
            let stats = client.stats().await?;
            print_json(&stats)
        }
    }
}

/// The wall clock, read once per command: ages in tables are relative to it.
fn unix_now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn print_text(text: &str) -> CmdResult {
    let mut out = std::io::stdout().lock();
    out.write_all(text.as_bytes())
        .and_then(|_| out.flush())
        .or_else(ignore_broken_pipe)
}

fn print_json<T: serde::Serialize>(v: &T) -> CmdResult {
    let mut text = serde_json::to_string_pretty(v).expect("JSON");
    text.push('\n');
    print_text(&text)
}

pub(crate) fn ignore_broken_pipe(e: std::io::Error) -> CmdResult {
    if e.kind() == std::io::ErrorKind::BrokenPipe {
        Ok(())
    } else {
        Err(CliError::Other(
            "OUTPUT_ERROR",
            anyhow::Error::new(e).context("writing standard output"),
        ))
    }
}

/// The result of printing what a command changed: an output error then says
/// that the change was made, so that nobody retries it.
fn after_change(printed: CmdResult, what: impl FnOnce() -> String) -> CmdResult {
    match printed {
        Err(CliError::Other("OUTPUT_ERROR", error)) => Err(CliError::ChangedUnreported {
            what: what(),
            error,
        }),
        other => other,
    }
}

/// The names of `specs`, the first [`NAMES_SHOWN_MAX`] of them and how
/// many more: a file of thousands of journals makes one readable line.
fn name_list(specs: &[rotary_net::spec::JournalSpec]) -> String {
    let shown: Vec<&str> = specs
        .iter()
        .take(NAMES_SHOWN_MAX)
        .map(|s| s.name.as_str())
        .collect();
    let mut text = shown.join(", ");
    if specs.len() > shown.len() {
        text += &format!(" and {} more", specs.len() - shown.len());
    }
    text
}

/// Specs as YAML, each with the revision it was read at: `apply` of the
/// edited list changes only what did not change meanwhile.
fn revised_yaml(list: Vec<rotary_net::client::JournalInfo>) -> Result<String, CliError> {
    let specs: Vec<serde_yaml::Value> = list
        .into_iter()
        .map(|j| {
            let mut v = serde_yaml::to_value(&j.spec).unwrap_or_default();
            if let Some(m) = v.as_mapping_mut() {
                m.insert("revision".into(), j.revision.into());
            }
            v
        })
        .collect();
    serde_yaml::to_string(&specs)
        .context("encoding YAML")
        .map_err(|e| CliError::Other("OUTPUT_ERROR", e))
}

/// How often `journals list --watch` lists again.
const WATCH_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);

/// `journals list --watch`: a line per journal whose spec or route changed
/// (all of them at first), as long as the command runs.
async fn watch_journals(client: &Client, selector: &str) -> CmdResult {
    let mut seen: std::collections::BTreeMap<String, String> = Default::default();
    loop {
        let list = client.list(selector).await?;
        let mut now = std::collections::BTreeMap::new();
        for j in &list {
            let line = output::watch_line(j);
            if seen.get(&j.spec.name) != Some(&line) {
                print_text(&format!("{line}\n"))?;
            }
            now.insert(j.spec.name.clone(), line);
        }
        for gone in seen.keys().filter(|n| !now.contains_key(*n)) {
            print_text(&format!("{gone}\tdeleted\n"))?;
        }
        seen = now;
        tokio::time::sleep(WATCH_INTERVAL).await;
    }
}

/// `journals edit`: the selected specs in `$EDITOR` (`vi` without one),
/// applied when the editor exits 0 with the file changed.
async fn edit_journals(client: &Client, selector: &str) -> CmdResult {
    let list = client.list(selector).await?;
    let before = revised_yaml(list)?;
    let path = std::env::temp_dir().join(format!("rotary-edit-{}.yaml", std::process::id()));
    let _remove = RemoveOnDrop(path.clone());
    std::fs::write(&path, &before)
        .map_err(|e| CliError::Other("EDIT_FAILED", anyhow::Error::new(e)))?;
    let editor = std::env::var("EDITOR").unwrap_or_else(|_| "vi".into());
    let status = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!("{editor} \"$1\""))
        .arg("sh")
        .arg(&path)
        .status()
        .map_err(|e| CliError::Other("EDIT_FAILED", anyhow::anyhow!("running {editor}: {e}")))?;
    if !status.success() {
        return Err(CliError::Other(
            "EDIT_FAILED",
            anyhow::anyhow!("{editor} exited with {status}; nothing applied"),
        ));
    }
    let after = std::fs::read_to_string(&path)
        .map_err(|e| CliError::Other("EDIT_FAILED", anyhow::Error::new(e)))?;
    if after == before {
        return print_text("no change\n");
    }
    let (text, revisions) = take_revisions(&after)?;
    let specs = parse_specs(&text).map_err(|e| CliError::Usage("BAD_REQUEST", e.to_string()))?;
    let revised: Vec<_> = specs.iter().cloned().zip(revisions).collect();
    let applied = client.apply_revised(&revised).await?;
    let text = format!("applied {applied} journal(s): {}", name_list(&specs));
    after_change(print_text(&format!("{text}\n")), || text)
}

/// Removes a file when dropped.
struct RemoveOnDrop(std::path::PathBuf);

impl Drop for RemoveOnDrop {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// Takes the `revision` of each spec out of a specs document (a list or
/// one spec): the text without them, for [`parse_specs`], and each spec's
/// revision in order.
fn take_revisions(text: &str) -> Result<(String, Vec<Option<u64>>), CliError> {
    let bad = |why: String| CliError::Usage("BAD_REQUEST", why);
    let Ok(mut doc) = serde_yaml::from_str::<serde_yaml::Value>(text) else {
        // parse_specs says what is wrong with it.
        return Ok((text.to_string(), Vec::new()));
    };
    let mut take = |v: &mut serde_yaml::Value| -> Result<Option<u64>, CliError> {
        let Some(m) = v.as_mapping_mut() else {
            return Ok(None);
        };
        match m.remove("revision") {
            None => Ok(None),
            Some(r) => r
                .as_u64()
                .filter(|r| *r <= i64::MAX as u64)
                .map(Some)
                .ok_or_else(|| bad(format!("revision {r:?} is not a whole number of 0 or more"))),
        }
    };
    let revisions = match &mut doc {
        serde_yaml::Value::Sequence(items) => {
            items.iter_mut().map(&mut take).collect::<Result<_, _>>()?
        }
        v => vec![take(v)?],
    };
    if revisions.iter().all(Option::is_none) {
        return Ok((text.to_string(), revisions));
    }
    let text = serde_yaml::to_string(&doc).map_err(|e| bad(e.to_string()))?;
    Ok((text, revisions))
}

async fn brokers(cmd: BrokersCmd) -> CmdResult {
    match cmd {
        BrokersCmd::List { output, broker } => {
            let client = connect(&broker).await?;
            let members = client.members().await?;
            match output {
                TableOrJson::Json => print_json(&members),
                TableOrJson::Table => print_text(&output::brokers_table(&members)),
            }
        }
        BrokersCmd::Drain { id, broker } => {
            let client = connect(&broker).await?;
            client.drain(&id).await?;
            after_change(print_text(&format!("draining {id}\n")), || {
                format!("draining {id}")
            })
        }
    }
}

/// Names `journals apply` prints before it counts the rest.
const NAMES_SHOWN_MAX: usize = 10;

async fn journals(cmd: JournalsCmd) -> CmdResult {
    match cmd {
        JournalsCmd::Apply { file, broker } => {
            let text = if file == "-" {
                std::io::read_to_string(std::io::stdin()).map_err(|e| {
                    CliError::Usage("BAD_USAGE", format!("reading standard input: {e}"))
                })?
            } else {
                std::fs::read_to_string(&file)
                    .map_err(|e| CliError::Usage("BAD_USAGE", format!("reading {file}: {e}")))?
            };
            let (text, revisions) = take_revisions(&text)?;
            let specs =
                parse_specs(&text).map_err(|e| CliError::Usage("BAD_REQUEST", e.to_string()))?;
            let client = connect(&broker).await?;
            let applied = if revisions.iter().all(Option::is_none) {
                client.apply(&specs).await?
            } else {
                let revised: Vec<_> = specs.iter().cloned().zip(revisions).collect();
                client.apply_revised(&revised).await?
            };
            let text = format!("applied {applied} journal(s): {}", name_list(&specs));
            after_change(print_text(&format!("{text}\n")), || text)
        }
        JournalsCmd::List {
            selector,
            watch,
            broker,
            ..
        } if watch => {
            LabelSelector::parse_journals(&selector)
                .map_err(|e| CliError::Usage("BAD_REQUEST", e.to_string()))?;
            let client = connect(&broker).await?;
            watch_journals(&client, &selector).await
        }
        JournalsCmd::Edit { selector, broker } => {
            LabelSelector::parse_journals(&selector)
                .map_err(|e| CliError::Usage("BAD_REQUEST", e.to_string()))?;
            let client = connect(&broker).await?;
            edit_journals(&client, &selector).await
        }
        JournalsCmd::List {
            selector,
            output,
            broker,
            ..
        } => {
            LabelSelector::parse_journals(&selector)
                .map_err(|e| CliError::Usage("BAD_REQUEST", e.to_string()))?;
            let client = connect(&broker).await?;
            let list = client.list(&selector).await?;
            match output {
                ListFormat::Json => print_json(&list),
                ListFormat::Yaml => print_text(&revised_yaml(list)?),
                ListFormat::Table => print_text(&output::journals_table(&list)),
            }
        }
        JournalsCmd::Delete { name, broker } => {
            let client = connect(&broker).await?;
            client.delete(&name).await?;
            after_change(print_text(&format!("deleted {name}\n")), || {
                format!("deleted {name}")
            })
        }
        JournalsCmd::Seal { name, broker } => {
            let client = connect(&broker).await?;
            let sealed = client.seal(&name).await?;
            let line = serde_json::json!({ "sealed": sealed });
            after_change(print_json(&line), || format!("sealed: {line}"))
        }
        JournalsCmd::ResetHead { name, broker } => {
            let client = connect(&broker).await?;
            let write_head = client.reset_head(&name).await?;
            let line = serde_json::json!({ "journal": name, "write_head": write_head });
            after_change(print_text(&format!("{line}\n")), || {
                format!("reset the head: {line}")
            })
        }
        JournalsCmd::Prune {
            selector,
            dry_run,
            output,
            broker,
        } => {
            LabelSelector::parse_journals(&selector)
                .map_err(|e| CliError::Usage("BAD_REQUEST", e.to_string()))?;
            let client = connect(&broker).await?;
            let pruned = client.prune(&selector, dry_run).await?;
            let verb = if dry_run { "would prune" } else { "pruned" };
            let printed = match output {
                TableOrJson::Json => print_json(&pruned),
                TableOrJson::Table => print_text(&output::pruned_lines(&pruned, dry_run)),
            };
            let printed = match dry_run {
                true => printed,
                false => after_change(printed, || format!("pruned {} fragment(s)", pruned.len())),
            };
            if printed.is_ok() && matches!(output, TableOrJson::Table) {
                eprintln!("{verb} {} fragment(s)", pruned.len());
            }
            printed
        }
    }
}

async fn append(args: AppendArgs) -> CmdResult {
    let bad = |e: SpecError| CliError::Usage("BAD_REQUEST", e.to_string());
    let req = AppendRequest {
        journal: args.name.clone(),
        expect_offset: args.offset,
        check_registers: match &args.check_registers {
            Some(t) => LabelSelector::parse(t).map_err(bad)?,
            None => LabelSelector::default(),
        },
        union_registers: match &args.union_registers {
            Some(t) => parse_label_set(t).map_err(bad)?,
            None => LabelSet::new(),
        },
        subtract_registers: match &args.subtract_registers {
            Some(t) => parse_label_set(t).map_err(bad)?,
            None => LabelSet::new(),
        },
        route_revision: 0,
    };
    let input = match &args.input {
        // `-i -` is standard input, as `apply -f -` is.
        Some(path) if path.as_os_str() == "-" => None,
        Some(path) => Some(tokio::fs::File::open(path).await.map_err(|e| {
            CliError::Usage("BAD_USAGE", format!("opening {}: {e}", path.display()))
        })?),
        None => None,
    };
    let client = connect(&args.broker).await?;
    let reply = match input {
        Some(file) => append_input(&client, &req, file).await?,
        None => append_input(&client, &req, tokio::io::stdin()).await?,
    };
    let line = serde_json::json!({
        "journal": args.name,
        "begin": reply.begin,
        "end": reply.end,
        "sha1": hex::encode(reply.sha1),
        "registers": reply.registers,
    });
    after_change(print_text(&format!("{line}\n")), || {
        format!("the append committed: {line}")
    })
}

async fn read(args: ReadArgs) -> CmdResult {
    if let (ReadOffset::At(offset), Some(end)) = (&args.offset, args.end_offset) {
        if end <= *offset {
            return Err(CliError::Usage(
                "BAD_USAGE",
                format!("--end-offset {end} must be greater than --offset {offset}"),
            ));
        }
    }
    let req = ReadRequest {
        journal: args.name.clone(),
        offset: match args.offset {
            ReadOffset::Head => None,
            ReadOffset::At(o) => Some(o),
        },
        end_offset: args.end_offset,
        route_revision: 0,
    };
    let client = if args.pin {
        answering(Client::connect_pinned(&args.broker.endpoint()?).await?).await?
    } else {
        connect(&args.broker).await?
    };
    let mut stream = if args.proxy || args.metadata {
        let options = rotary_net::client::ReadOptions {
            block: args.block && !args.metadata,
            metadata_only: args.metadata,
            do_not_proxy: args.pin,
        };
        Reader::Broker(client.read_with(&req, options).await?)
    } else {
        Reader::Direct(client.read_direct(&req, args.block))
    };
    let mut out = std::io::stdout().lock();
    // Where the next byte should begin: bytes skipped over (history that
    // no fragment holds) are reported, at the start and end of the range
    // as in its middle.
    let mut next_offset: Option<u64> = req.offset;
    while let Some(event) = stream.next().await {
        match event? {
            ReadEvent::Fragment { .. } => {
                unreachable!("neither a proxied nor a direct read yields locations")
            }
            ReadEvent::Data { offset, content } => {
                if args.metadata {
                    continue;
                }
                if let Some(expected) = next_offset {
                    if offset != expected {
                        eprintln!("warning: offsets {expected}..{offset} are missing from the journal's history ({} bytes skipped)", offset - expected);
                    }
                }
                next_offset = Some(offset + content.len() as u64);
                if let Err(e) = out.write_all(&content).and_then(|_| out.flush()) {
                    // Dropping the stream cancels the read.
                    return ignore_broken_pipe(e);
                }
            }
            ReadEvent::Done(done) => {
                let normal_end = done.status == Status::OK
                    || (done.status == Status::OFFSET_NOT_YET_AVAILABLE && !args.block);
                if !normal_end {
                    done.check()?;
                }
                if done.status == Status::OFFSET_NOT_YET_AVAILABLE && done.offset > done.write_head
                {
                    eprintln!(
                        "warning: offset {} is beyond the write head {}: nothing to read yet (--block waits for it)",
                        done.offset, done.write_head
                    );
                }
                if let Some(expected) = next_offset.filter(|&e| e < done.offset) {
                    if done.status == Status::OK && !args.metadata {
                        let found = done.offset;
                        eprintln!("warning: offsets {expected}..{found} are missing from the journal's history ({} bytes skipped)", found - expected);
                    }
                }
                if args.metadata {
                    let line =
                        serde_json::json!({ "offset": done.offset, "write_head": done.write_head });
                    out.write_all(format!("{line}\n").as_bytes())
                        .and_then(|_| out.flush())
                        .or_else(ignore_broken_pipe)?;
                }
                stream.report_fallbacks();
                return Ok(());
            }
        }
    }
    Ok(())
}

/// A proxied read (the broker streams everything) or a direct one
/// (store-held fragments fetched from the store).
enum Reader {
    Broker(rotary_net::client::ReadStream),
    Direct(rotary_net::client::DirectRead),
}

impl Reader {
    async fn next(&mut self) -> Option<Result<ReadEvent, ClientError>> {
        match self {
            Reader::Broker(s) => s.next().await,
            Reader::Direct(s) => s.next().await,
        }
    }

    /// Says on stderr when fragments had to be read through the broker.
    fn report_fallbacks(&self) {
        if let Reader::Direct(s) = self {
            let n = s
                .stats()
                .fragments_proxied
                .load(std::sync::atomic::Ordering::Relaxed);
            if n > 0 {
                eprintln!(
                    "note: {n} fragment(s) were read through the broker: their store could not be reached from here"
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn applied_names_are_counted_past_ten() {
        let specs = |n: usize| -> Vec<rotary_net::spec::JournalSpec> {
            (0..n)
                .map(|i| rotary_net::spec::JournalSpec::new(format!("a/j-{i:02}")))
                .collect()
        };
        assert_eq!(name_list(&specs(2)), "a/j-00, a/j-01");
        let ten = name_list(&specs(10));
        assert!(ten.ends_with("a/j-08, a/j-09"), "{ten}");
        let many = name_list(&specs(3000));
        assert!(
            many.ends_with("a/j-08, a/j-09 and 2990 more") && !many.contains("a/j-10"),
            "{many}"
        );
    }

    #[test]
    fn byte_counts() {
        assert_eq!(parse_bytes("1024").unwrap(), 1024);
        assert_eq!(parse_bytes("256M").unwrap(), 256 << 20);
        assert_eq!(parse_bytes("1GiB").unwrap(), 1 << 30);
        assert_eq!(parse_bytes("2g").unwrap(), 2 << 30);
        assert!(parse_bytes("12x").is_err());
        assert!(parse_bytes("M").is_err());
    }

    #[test]
    fn label_sets_from_text() {
        let set = parse_label_set("owner=a, epoch=2,flag").unwrap();
        assert_eq!(set.to_text(), "epoch=2,flag,owner=a");
        assert!(parse_label_set("bad name=x").is_err());
    }

    #[test]
    fn offsets() {
        assert!(matches!(parse_offset("head"), Ok(ReadOffset::Head)));
        assert!(matches!(parse_offset("-1"), Ok(ReadOffset::Head)));
        assert!(matches!(parse_offset("42"), Ok(ReadOffset::At(42))));
        assert!(parse_offset("-2").is_err());
        // The wire carries offsets as i64: larger ones would wrap to -1.
        let max = i64::MAX.to_string();
        assert!(matches!(parse_offset(&max), Ok(ReadOffset::At(o)) if o == OFFSET_MAX));
        for big in [
            "9223372036854775808",
            "18446744073709551615",
            "18446744073709551616",
        ] {
            let err = parse_offset(big).unwrap_err();
            assert_eq!(
                err,
                format!("{big} exceeds 9223372036854775807 (i64::MAX), the largest offset")
            );
            assert_eq!(parse_append_offset(big).unwrap_err(), err);
        }
        assert_eq!(parse_append_offset("0"), Ok(0));
        assert_eq!(parse_append_offset(&max), Ok(OFFSET_MAX));
        for negative in ["-1", "-2"] {
            let err = parse_append_offset(negative).unwrap_err();
            assert!(err.contains("leave --offset out"), "{err}");
        }
        assert!(parse_append_offset("head")
            .unwrap_err()
            .contains("is not an offset"));
    }

    #[test]
    fn error_chains_name_each_cause_once() {
        let io = std::io::Error::from(std::io::ErrorKind::AddrInUse);
        let e = anyhow::Error::new(std::io::Error::other(format!("cannot listen: {io}")));
        assert_eq!(chain_text(&e), format!("cannot listen: {io}"));
        let e = anyhow::Error::new(io).context("starting");
        assert_eq!(chain_text(&e), "starting: address in use");
    }

    #[test]
    fn end_offsets() {
        assert_eq!(parse_end_offset("1"), Ok(1));
        assert_eq!(parse_end_offset(&i64::MAX.to_string()), Ok(OFFSET_MAX));
        assert!(parse_end_offset("0").unwrap_err().contains("at least 1"));
        assert!(parse_end_offset("9223372036854775808")
            .unwrap_err()
            .contains("the largest offset"));
        assert!(parse_end_offset("-1")
            .unwrap_err()
            .contains("is not an offset"));
    }

    #[test]
    fn broker_endpoints() {
        for good in [
            "127.0.0.1:7401",
            "broker-1:1",
            "[::1]:65535",
            "localhost:7401",
        ] {
            assert_eq!(check_endpoint(good), Ok(()), "{good}");
        }
        for bad in [
            "nonsense",
            "127.0.0.1:99999",
            "127.0.0.1:0",
            ":7401",
            "h:",
            "h:x",
        ] {
            assert!(check_endpoint(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn status_exit_codes() {
        assert_eq!(status_exit_code(Status::BAD_REQUEST), EXIT_USAGE);
        assert_eq!(status_exit_code(Status::JOURNAL_NOT_FOUND), EXIT_FAILED);
        assert_eq!(status_exit_code(Status::WRONG_APPEND_OFFSET), EXIT_FAILED);
        assert_eq!(status_exit_code(Status::STORAGE_FULL), EXIT_RETRYABLE);
        assert_eq!(status_exit_code(Status::IO_ERROR), EXIT_RETRYABLE);
        assert_eq!(status_exit_code(Status::DISK_FAILED), EXIT_FAILED);
    }

    #[test]
    fn serve_defaults_and_limits() {
        let Cmd::Serve(args) = Cli::try_parse_from(["rotary", "serve"]).unwrap().cmd else {
            panic!("serve");
        };
        assert_eq!((args.spool_budget, args.upload_threads), (8 << 30, 2));
        assert_eq!(args.append_queue_budget, 1 << 30);
        assert!(Cli::try_parse_from(["rotary", "serve", "--upload-threads", "0"]).is_err());
        assert!(Cli::try_parse_from(["rotary", "serve", "--spool-budget", "lots"]).is_err());
        assert_eq!(args.peer_silence, std::time::Duration::from_secs(15));
        assert!(Cli::try_parse_from(["rotary", "serve", "--peer-silence", "50ms"]).is_err());
        let Cmd::Serve(args) = Cli::try_parse_from(["rotary", "serve", "--peer-silence", "2s"])
            .unwrap()
            .cmd
        else {
            panic!("serve");
        };
        assert_eq!(args.peer_silence, std::time::Duration::from_secs(2));
        assert_eq!(args.replica_ack_timeout, std::time::Duration::from_secs(10));
        assert!(Cli::try_parse_from(["rotary", "serve", "--replica-ack-timeout", "0"]).is_err());
        let Cmd::Serve(args) =
            Cli::try_parse_from(["rotary", "serve", "--replica-ack-timeout", "2s"])
                .unwrap()
                .cmd
        else {
            panic!("serve");
        };
        assert_eq!(args.replica_ack_timeout, std::time::Duration::from_secs(2));
    }

    #[test]
    fn http_and_log_flags() {
        let Cmd::Serve(args) = Cli::try_parse_from(["rotary", "serve"]).unwrap().cmd else {
            panic!("serve");
        };
        assert_eq!(args.http, HTTP_DEFAULT);
        assert_eq!(args.http_body_limit, 64 << 20);
        assert_eq!(args.http_timeout, std::time::Duration::from_secs(10));
        assert_eq!(args.metrics_journals, None);
        assert_eq!(args.log_format, LogFormat::Text);
        let Cmd::Serve(args) = Cli::try_parse_from([
            "rotary",
            "serve",
            "--http",
            "off",
            "--http-body-limit",
            "1K",
            "--http-timeout",
            "2s",
            "--metrics-journals",
            "app=orders",
            "--log-format",
            "json",
        ])
        .unwrap()
        .cmd
        else {
            panic!("serve");
        };
        assert_eq!(args.http, "off");
        assert_eq!(args.http_body_limit, 1024);
        assert_eq!(args.http_timeout, std::time::Duration::from_secs(2));
        assert_eq!(args.metrics_journals.as_deref(), Some("app=orders"));
        assert_eq!(args.log_format, LogFormat::Json);
        for bad in [
            &["--log-format", "xml"][..],
            &["--http-timeout", "10ms"],
            &["--http-body-limit", "lots"],
        ] {
            let mut argv = vec!["rotary", "serve"];
            argv.extend_from_slice(bad);
            assert!(Cli::try_parse_from(argv).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn shard_slices() {
        use std::time::Duration;
        assert_eq!(parse_shard_slice("100us"), Ok(Duration::from_micros(100)));
        assert_eq!(parse_shard_slice("250µs"), Ok(Duration::from_micros(250)));
        assert_eq!(parse_shard_slice("2ms"), Ok(Duration::from_millis(2)));
        assert_eq!(parse_shard_slice("100ms"), Ok(Duration::from_millis(100)));
        assert_eq!(parse_shard_slice("0"), Ok(Duration::ZERO));
        for bad in ["99us", "101ms", "1s", "us", "-5us", "fast"] {
            assert!(parse_shard_slice(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn ack_polls() {
        use std::time::Duration;
        assert_eq!(parse_ack_poll("0"), Ok(Duration::ZERO));
        assert_eq!(parse_ack_poll("1ms"), Ok(Duration::from_millis(1)));
        assert_eq!(parse_ack_poll("250us"), Ok(Duration::from_micros(250)));
        assert_eq!(parse_ack_poll("10ms"), Ok(Duration::from_millis(10)));
        for bad in ["11ms", "1s", "us", "-1us", "soon"] {
            assert!(parse_ack_poll(bad).is_err(), "{bad}");
        }
        assert_eq!(
            parse_ack_poll("soon"),
            Err("\"soon\" is not a duration such as 250us or 2ms".to_string())
        );
        let Cmd::Serve(args) = Cli::try_parse_from(["rotary", "serve"]).unwrap().cmd else {
            panic!("serve");
        };
        assert_eq!(args.ack_poll, rotary_engine::ACK_POLL_DEFAULT);
    }

    #[test]
    fn core_lists() {
        assert_eq!(parse_cpus("1").unwrap(), CpuList(vec![1]));
        assert_eq!(parse_cpus("0,2-4").unwrap(), CpuList(vec![0, 2, 3, 4]));
        assert!(parse_cpus("3-1").is_err());
        assert!(parse_cpus("a").is_err());
        assert!(parse_cpus("").is_err());
    }

    #[test]
    fn cli_shapes_parse() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
        for line in [
            "rotary serve --data /tmp/d --listen 127.0.0.1:7401 --cores 2 --disk-reserve 1G",
            "rotary serve --spool-budget 64M --upload-threads 4",
            "rotary serve --cluster c.yaml --id b1 --cpus 0,2-3",
            "rotary journals reset-head a/b/c",
            "rotary journals prune -l app=orders --dry-run -o json",
            "rotary journals prune",
            "rotary read a/b/c --proxy --block",
            "rotary read a/b/c --pin --metadata --broker 127.0.0.1:7411",
            "rotary journals apply -f -",
            "rotary journals list -l app=orders -o yaml --broker 127.0.0.1:1",
            "rotary journals delete a/b/c",
            "rotary journals seal a/b/c",
            "rotary append a/b/c -i /tmp/x --offset 5 --check-registers owner=a --union-registers k=v,k2=v2 --subtract-registers k",
            "rotary read a/b/c --offset 10 --end-offset 20 --block",
            "rotary read a/b/c --offset head --metadata",
            "rotary fragments a/b/c -o json",
            "rotary stats",
            "rotary doctor --data /tmp/d",
        ] {
            let words: Vec<&str> = line.split_whitespace().collect();
            Cli::try_parse_from(words).unwrap_or_else(|e| panic!("{line}: {e}"));
        }
    }
}
