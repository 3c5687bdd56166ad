//! `rotary serve`: its flags, the checks they get before anything starts,
//! and the engine's configuration made of them (sized by the data
//! directory's tune profile, when there is one).

use super::exit::{CliError, CmdResult};
use clap::{Args, ValueEnum};
use rotary_engine::ServeConfig;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::PathBuf;

#[derive(Args, Debug)]
pub(super) struct ServeArgs {
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
    /// Bytes per second a client must stream an append at while the append
    /// holds its journal (a journal's max_append_rate lowers it to half of
    /// that); a client a second behind is cut off with APPEND_TIMEOUT, so a
    /// stalled writer holds a journal for about a second. 0 turns it off.
    #[arg(long = "min-append-rate", value_name = "BYTES", value_parser = parse_bytes, default_value = "1M")]
    min_append_rate: u64,
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

pub(super) fn serve(args: ServeArgs) -> CmdResult {
    init_logs(args.log_format);
    let listen = socket_addr("--listen", &args.listen)?;
    if args.data.exists() && !args.data.is_dir() {
        return Err(CliError::Usage(
            "BAD_USAGE",
            format!("--data {}: not a directory", args.data.display()),
        ));
    }
    let config = serve_config(&args, listen)?;
    if let Some(selector) = &args.metrics_journals {
        rotary_net::spec::LabelSelector::parse_journals(selector).map_err(|e| {
            CliError::Usage("BAD_USAGE", format!("--metrics-journals {selector:?}: {e}"))
        })?;
    }
    // The HTTP threads start here: on the broker's cores, like the rest.
    rotary_engine::confine_to_cores(&config)
        .map_err(|e| CliError::Other("SERVE_FAILED", anyhow::Error::new(e)))?;
    let http = http_server(&args)?;
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

/// Log lines go to stderr, as text (in colour on a terminal) or as JSON.
fn init_logs(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        // The store client logs each of its retries at info; the uploader
        // reports what matters (a failed upload or listing) itself.
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,object_store=warn"));
    let logs = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Text => logs
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .try_init(),
        LogFormat::Json => logs.json().with_current_span(false).try_init(),
    };
}

/// The first address `addr` (given to `flag`) resolves to.
fn socket_addr(flag: &str, addr: &str) -> Result<SocketAddr, CliError> {
    addr.to_socket_addrs()
        .map_err(|e| CliError::Usage("BAD_USAGE", format!("{flag} {addr}: {e}")))?
        .next()
        .ok_or_else(|| CliError::Usage("BAD_USAGE", format!("{flag} {addr}: no address")))
}

/// The engine's configuration: the tune profile's sizes, then the flags.
fn serve_config(args: &ServeArgs, listen: SocketAddr) -> Result<ServeConfig, CliError> {
    let etcd = etcd_config(args, listen)?;
    let mut config = ServeConfig::new(args.data.clone(), listen);
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
    config.cluster = cluster_file(args, config.etcd.is_some())?;
    let cores = |list: &Option<CpuList>| list.as_ref().map(|c| c.0.clone()).unwrap_or_default();
    config.cpus = cores(&args.cpus);
    config.iowq_cpus = cores(&args.iowq_cpus);
    config.peer_silence = args.peer_silence;
    config.offset_jump_age = args.offset_jump_age;
    config.min_append_rate = args.min_append_rate;
    config.shard_slice = args.shard_slice;
    config.ack_poll = args.ack_poll;
    config.replica_ack_timeout = args.replica_ack_timeout;
    Ok(config)
}

/// The cluster file and this broker's id in it, if `--cluster` names one.
/// An `--id` needs a cluster to be a member of, in etcd or in a file.
fn cluster_file(args: &ServeArgs, on_etcd: bool) -> Result<Option<(PathBuf, String)>, CliError> {
    match (&args.cluster, &args.id) {
        (Some(file), Some(id)) => Ok(Some((file.clone(), id.clone()))),
        (Some(_), None) => Err(CliError::Usage("BAD_USAGE", "--cluster needs --id".into())),
        (None, Some(_)) if !on_etcd => Err(CliError::Usage(
            "BAD_USAGE",
            "--id goes with --etcd or --cluster".into(),
        )),
        (None, _) => Ok(None),
    }
}

/// The HTTP listener, unless `--http off`. The default address may be taken
/// by another broker on the host: then this one runs without.
fn http_server(args: &ServeArgs) -> Result<Option<rotary_http::HttpServer>, CliError> {
    let addr = match args.http.as_str() {
        "off" => return Ok(None),
        addr => addr,
    };
    let listen = socket_addr("--http", addr)?;
    let mut c = rotary_http::HttpConfig::new(listen);
    c.body_limit_bytes = args.http_body_limit;
    c.timeout = args.http_timeout;
    c.metrics_journals = args.metrics_journals.clone();
    match rotary_http::HttpServer::start(c) {
        Ok(server) => Ok(Some(server)),
        Err(e) if e.is_addr_in_use() && addr == HTTP_DEFAULT => {
            tracing::warn!(error = %e, "no HTTP listener: the default address is taken (give --http another address, or --http off)");
            Ok(None)
        }
        Err(e) => Err(CliError::Other("SERVE_FAILED", anyhow::Error::new(e))),
    }
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

/// Largest fallocate step taken from a tune profile.
const SPOOL_GROW_BYTES_MAX: u64 = 64 << 20;

/// Sizes the broker's I/O from `<data>/tune-profile.json` when there is
/// one; otherwise the engine's defaults stand. Says which in the log.
fn apply_tune_profile(config: &mut ServeConfig) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::{Cli, Cmd};
    use clap::Parser as _;

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
}
