//! rotary's engine: shards, journals, the append and read paths, and the
//! per-core servers.
//!
//! A broker runs one shard per core. Each shard is a compio executor on a
//! thread pinned to its core; it owns the journals hashed to it
//! ([`rotary_net::shard_of`]), their spools, its commit log, its sockets and
//! its ring. A journal's state is touched by its shard's thread only, so
//! nothing on the data path takes a lock. Journal specs are shared behind a
//! lock because they change rarely and never on the data path.

// Functions stay short enough to hold in mind (threshold in clippy.toml).
#![warn(clippy::too_many_lines)]

pub(crate) mod append;
pub(crate) mod budget;
pub(crate) mod check;
pub mod clock;
pub mod cluster;
pub(crate) mod conn;
mod error;
pub(crate) mod fetch;
pub(crate) mod hasher;
pub(crate) mod journal;
pub mod metrics;
pub(crate) mod outbox;
pub(crate) mod pipeline;
pub mod reaper;
pub mod replica;
pub(crate) mod shard;
pub mod spares;
pub mod specs;
pub mod topology;

pub use error::{ConfigError, EngineError};

use std::collections::HashSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

/// How `rotary serve` runs.
#[derive(Clone, Debug)]
pub struct ServeConfig {
    /// Data directory: specs, commit logs, spools and local fragments.
    pub data_dir: PathBuf,
    /// Address of shard 0; shard n listens on the same host, port + n.
    pub listen: SocketAddr,
    /// Number of shards (one per core). 0 = every core of the machine.
    pub cores: usize,
    /// Bytes of free disk the broker never spends on spools.
    pub disk_reserve_bytes: u64,
    /// Sealed bytes (of journals with stores) allowed to await upload
    /// before appends to such journals are refused, for the whole broker
    /// (each shard holds an equal share).
    pub spool_budget_bytes: u64,
    /// Append content read from clients and queued behind busy journals,
    /// for the whole broker (each shard holds an equal share): beyond it,
    /// a connection holding more than 1 MiB of it is not read until its
    /// shard's queue drains, unless an append of it holds its journal.
    pub append_queue_bytes: u64,
    /// Local copies of uploaded fragments kept as a read cache.
    pub local_cache_bytes: u64,
    /// Threads of the uploader pool.
    pub upload_threads: usize,
    /// How long a clean shutdown waits for open spools to reach their stores.
    pub shutdown_upload_timeout: Duration,
    /// Spool write batch and fallocate step (from `rotary tune`, else defaults).
    pub spool_sizing: rotary_storage::spool::SpoolSizing,
    /// Submission queue entries of each shard's ring.
    pub ring_entries: u32,
    /// A shard's commit log is rewritten from a snapshot once it grows past
    /// this many bytes.
    pub commit_log_compact_bytes: u64,
    /// Cores the shards are pinned to, shard n on `cpus[n % len]`; empty =
    /// shard n on core n (modulo the machine's cores). Lets brokers that
    /// share a host keep to cores of their own.
    pub cpus: Vec<usize>,
    /// Cores the rings' io-wq workers (which run writes the kernel cannot
    /// issue inline, e.g. into newly allocated extents, and fsyncs) may run
    /// on; empty = the cores without shards, or the shard's own core when
    /// every core has one. A core that is busy with other work delays every
    /// punted write by its scheduling latency.
    pub iowq_cpus: Vec<usize>,
    /// How long a peer (another broker, or another shard of this one) that
    /// a request was forwarded or proxied to may send nothing while the
    /// request waits, before it is sent a PING; after as long again with
    /// still nothing, its requests are answered `IO_ERROR`.
    pub peer_silence: Duration,
    /// How old the first fragment after a gap in a journal's history must
    /// be before a read jumps over the gap: a younger gap may still be
    /// filled (another broker is uploading it), so the read waits, or a
    /// non-blocking one answers `OFFSET_NOT_YET_AVAILABLE`. Zero jumps at
    /// once.
    pub offset_jump_age: Duration,
    /// Bytes per second a client must stream an append's content at while
    /// the append holds its journal; one that falls a second behind is
    /// rolled back with `APPEND_TIMEOUT`, so that a stalled client holds a
    /// journal for about a second (Gazette's minimum append rate). Zero:
    /// off (only `APPEND_IDLE_TIMEOUT` applies).
    pub min_append_rate: u64,
    /// How long a primary waits for a replica's acknowledgement before it
    /// treats the replica as gone: the appends waiting on it are answered
    /// `REPLICATION_FAILED` and the pipeline is closed (and reconnected,
    /// with a SYNC, by the next append).
    pub replica_ack_timeout: Duration,
    /// A static cluster file and this broker's id in it. The broker then
    /// listens on its endpoint from the file (`listen` is ignored).
    pub cluster: Option<(PathBuf, String)>,
    /// A cluster on etcd to join (excludes `cluster`).
    pub etcd: Option<cluster::EtcdConfig>,
    /// Bytes of large appends a shard's hasher may have yet to hash before
    /// the shard holds such appends back (see `hasher`).
    pub hash_backlog_bytes: usize,
    /// The time slice each shard's thread asks the kernel's scheduler for
    /// (EEVDF, Linux 6.12; ignored before). A thread with a shorter slice
    /// than the one running on its core preempts it when it wakes, rather
    /// than waiting out the other's slice (up to a few milliseconds):
    /// shards wake for every request and run briefly. Zero keeps the
    /// kernel's default.
    pub shard_slice: Duration,
    /// How long a primary's shard polls its ring instead of sleeping after
    /// it proposed a batch to replicas, while their acks are awaited (see
    /// `Shard::poll_for_acks`). Zero: it sleeps at once.
    pub ack_poll: Duration,
    /// The clock each shard's thread reads (see `clock`): the real one but
    /// in tests that set and move time.
    pub clock: clock::Clock,
    /// Injected disk faults (see `rotary_storage::faults`), installed on
    /// each shard's thread before the shard opens: the disk operations of
    /// its spools, seals and commit log fail as the hook says. For tests
    /// and simulations only: no flag of `rotary serve` sets it, and a
    /// broker runs without one (`None`, the default).
    pub faults: Option<Arc<dyn rotary_storage::faults::Faults>>,
}

/// [`ServeConfig::shard_slice`] by default: the shortest the kernel allows.
pub const SHARD_SLICE_DEFAULT: Duration = Duration::from_micros(100);

/// [`ServeConfig::ack_poll`] by default: a replica's ack comes back within
/// about 50 µs on loopback, and within 1 ms but for a stall.
pub const ACK_POLL_DEFAULT: Duration = Duration::from_millis(1);

/// Default of `ServeConfig::offset_jump_age`, Gazette's: a gap that
/// six hours did not fill is taken as permanent.
pub const OFFSET_JUMP_AGE_DEFAULT: Duration = Duration::from_secs(6 * 3600);

impl ServeConfig {
    pub fn new(data_dir: PathBuf, listen: SocketAddr) -> Self {
        ServeConfig {
            data_dir,
            listen,
            cores: 0,
            disk_reserve_bytes: 256 << 20,
            spool_budget_bytes: 8 << 30,
            append_queue_bytes: 1 << 30,
            local_cache_bytes: 4 << 30,
            upload_threads: 2,
            shutdown_upload_timeout: Duration::from_secs(30),
            spool_sizing: rotary_storage::spool::SpoolSizing::default(),
            ring_entries: 1024,
            commit_log_compact_bytes: rotary_storage::wal::COMMIT_LOG_COMPACT_BYTES,
            cpus: Vec::new(),
            iowq_cpus: Vec::new(),
            peer_silence: crate::conn::PEER_SILENCE_DEFAULT,
            offset_jump_age: OFFSET_JUMP_AGE_DEFAULT,
            min_append_rate: append::MIN_APPEND_RATE_DEFAULT,
            replica_ack_timeout: crate::pipeline::ACK_TIMEOUT_DEFAULT,
            cluster: None,
            etcd: None,
            hash_backlog_bytes: hasher::BACKLOG_BYTES,
            shard_slice: SHARD_SLICE_DEFAULT,
            ack_poll: ACK_POLL_DEFAULT,
            clock: clock::Clock::real(),
            faults: None,
        }
    }
}

/// How long a clean shutdown waits for appends to commit and uploads to finish.
const SHUTDOWN_DRAIN: Duration = Duration::from_secs(45);
/// How long a clean stop waits for its last answers to be written out to
/// clients that are slow to read them.
const SHUTDOWN_ANSWERS_WAIT: Duration = Duration::from_secs(2);
/// Sealed fragments queued for upload across the broker.
const UPLOAD_QUEUE_MAX: usize = 1024;

/// Parses a core list, `1`, `0,2`, `2-5` or a mix, as `--cpus` takes it.
pub fn parse_cpu_list(s: &str) -> Result<Vec<usize>, String> {
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim) {
        let (a, b) = part.split_once('-').unwrap_or((part, part));
        let a: usize = a
            .parse()
            .map_err(|_| format!("{part:?} is not a core or range"))?;
        let b: usize = b
            .parse()
            .map_err(|_| format!("{part:?} is not a core or range"))?;
        if a > b || b >= 1024 {
            return Err(format!("{part:?} is not a core range"));
        }
        out.extend(a..=b);
    }
    Ok(out)
}

/// Runs a broker until SIGINT or SIGTERM, then shuts it down cleanly. A
/// broker given cores (`cpus`) keeps to them: its other threads (uploads,
/// store listings) and its rings' io-wq workers run there too.
pub fn serve(config: ServeConfig) -> Result<(), EngineError> {
    serve_with(config, |_| {}, || {})
}

/// [`serve`], calling `started` once every shard has recovered its journals
/// and listens (with the running broker, e.g. to hand its counters to an
/// HTTP server and report it ready), and `stopping` when a signal asked it
/// to stop, before it drains.
pub fn serve_with(
    config: ServeConfig,
    started: impl FnOnce(&Broker),
    stopping: impl FnOnce(),
) -> Result<(), EngineError> {
    confine_to_cores(&config)?;
    let broker = Broker::start(config)?;
    started(&broker);
    wait_for_signal();
    tracing::info!("shutting down");
    stopping();
    broker.shutdown();
    Ok(())
}

/// Keeps the calling thread, and every thread it starts from now on, on
/// the broker's cores (`cpus` and `iowq_cpus`), if it was given any. Call
/// it before starting threads that belong to the broker (an HTTP server's).
pub fn confine_to_cores(config: &ServeConfig) -> Result<(), EngineError> {
    // A core that does not exist is refused with its message by `start`.
    let online = sys::online_cpus();
    let mut cores: Vec<usize> = config
        .cpus
        .iter()
        .chain(&config.iowq_cpus)
        .copied()
        .collect();
    cores.sort_unstable();
    cores.dedup();
    if !config.cpus.is_empty() && cores.iter().all(|&c| c < online) {
        sys::confine_current_thread(&cores)
            .map_err(|source| ConfigError::Confine { cores, source })?;
    }
    Ok(())
}

fn wait_for_signal() {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let mut signals =
        signal_hook::iterator::Signals::new([SIGINT, SIGTERM]).expect("signal handlers");
    let _ = signals.forever().next();
}

/// A running broker: its shard threads.
pub struct Broker {
    stops: Vec<async_channel::Sender<()>>,
    done: crossbeam_channel::Receiver<u32>,
    _lock: std::fs::File,
    pub endpoints: Vec<SocketAddr>,
    /// The broker's session with the cluster on etcd, if it is in one.
    etcd: Option<cluster::Cluster>,
    observed: Observed,
}

/// What a broker shows to observers on other threads (an HTTP server's
/// `/metrics`): shared counters, read with relaxed loads, never a lock a
/// shard takes on its data path.
#[derive(Clone)]
pub struct Observed {
    pub metrics: Arc<metrics::Metrics>,
    pub uploader: rotary_uploader::Uploader,
    pub specs: Arc<specs::SpecStore>,
    pub data_dir: PathBuf,
    pub shards: usize,
}

impl Broker {
    /// The broker's counters and what else STATS reports.
    pub fn observed(&self) -> Observed {
        self.observed.clone()
    }
}

/// How long a clean stop of a broker in a cluster on etcd waits for its
/// journals to move to other brokers before it stops anyway.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(60);

/// The spec store's file of a broker in a cluster on etcd.
const ETCD_SPECS_FILE: &str = "etcd-specs.json";

fn lock_data_dir(dir: &std::path::Path) -> Result<std::fs::File, EngineError> {
    use std::os::fd::AsRawFd;
    let path = dir.join("LOCK");
    let f = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&path)
        .map_err(|e| EngineError::Io(path.clone(), e))?;
    #[allow(unsafe_code)]
    // SAFETY: flock on a descriptor we own.
    let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) };
    if rc != 0 {
        return Err(ConfigError::DataDirInUse(dir.to_path_buf()).into());
    }
    Ok(f)
}

/// The shard count is part of the on-disk layout (journals live under the
/// shard that owns them), so a data directory keeps the count it was made with.
/// Answers whether the directory has recorded a count yet; one that has not
/// gets it from [`record_shard_count`] once the start can no longer fail for
/// reasons outside the directory (a busy port, say), so that a failed first
/// start does not fix `--cores` for good.
fn check_shard_count(dir: &std::path::Path, shards: usize) -> Result<bool, EngineError> {
    let path = dir.join(BROKER_FILE);
    match std::fs::read(&path) {
        Ok(bytes) => {
            let v: serde_json::Value = serde_json::from_slice(&bytes)
                .map_err(|e| EngineError::corrupt(&path, format!("{}: {e}", path.display())))?;
            let had = v["shards"].as_u64().unwrap_or(0) as usize;
            if had != shards {
                return Err(ConfigError::ShardCount {
                    dir: dir.to_path_buf(),
                    had,
                    asked: shards,
                }
                .into());
            }
            Ok(true)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(e) => Err(EngineError::Io(path, e)),
    }
}

fn record_shard_count(dir: &std::path::Path, shards: usize) -> Result<(), EngineError> {
    let path = dir.join(BROKER_FILE);
    let body = serde_json::to_vec(&serde_json::json!({ "shards": shards })).expect("json");
    std::fs::write(&path, body).map_err(|e| EngineError::Io(path.clone(), e))
}

const BROKER_FILE: &str = "broker.json";

/// Keeps the C allocator from mapping and unmapping the data path's large
/// buffers. glibc serves allocations above its mmap threshold (128 KiB at
/// start) with a fresh mapping each, so every 1 MiB append frame and read
/// buffer would cost 256 page faults and as many zeroed pages, on the
/// shard's thread. glibc raises that threshold by itself only after the
/// process frees one such mapping, which made throughput depend on when a
/// large buffer was first freed: `append-1m` ran 5-15% slower in a broker
/// that had not yet freed a spool buffer (docs/BENCHMARKS.md). Fixed
/// thresholds instead: allocations up to 32 MiB come from the heap, and up
/// to 64 MiB of free heap is kept rather than returned to the kernel. Called
/// by [`Broker::start`]; binaries call it first thing as well.
pub fn tune_allocator() {
    sys::tune_allocator();
}

impl Broker {
    /// Starts every shard and returns once all of them listen.
    pub fn start(config: ServeConfig) -> Result<Broker, EngineError> {
        tune_allocator();
        // Every connection, spool and fragment is a descriptor: use all the
        // hard limit allows, not the soft default of 1024.
        sys::raise_open_files_limit();
        let dir = &config.data_dir;
        let lock = open_data_dir(dir)?;
        let cores = CoreLayout::plan(&config)?;
        let shards = cores.shard.len();
        let recorded = check_shard_count(dir, shards)?;
        warn_if_no_space_above_reserve(dir, config.disk_reserve_bytes);
        // Before any shard opens: recovery reaps the files of journals the
        // spec source, read here, has no spec for (`Shard::reap_unspecified`).
        let (specs, mut etcd, cluster_view) = open_membership(&config, shards)?;
        let listen = match &cluster_view {
            Some(v) => v.me().expect("checked by load").endpoint,
            None => config.listen,
        };
        let uploader =
            rotary_uploader::Uploader::start(config.upload_threads.max(1), UPLOAD_QUEUE_MAX);
        // On the broker's cores, like the uploader, before a shard pins its
        // thread to one of them.
        reaper::start();
        check::start();
        let metrics = Arc::new(metrics::Metrics::default());
        // Bind every listener first so that a busy port fails the start.
        let (listeners, endpoints) = bind_listeners(listen, shards)?;
        if !recorded {
            record_shard_count(dir, shards)?;
        }
        let topology = start_topology(&config, &specs, etcd.as_ref(), cluster_view, endpoints[0]);
        let parts = SharedParts {
            specs,
            metrics,
            uploader,
            topology,
            endpoints,
        };
        let (stops, done) = start_shards(&config, &cores, &parts, listeners)?;
        if let Some(c) = etcd.as_mut() {
            c.announce(parts.topology.clone())?;
            tracing::info!(id = %config.etcd.as_ref().map_or("", |e| e.id.as_str()), "joined the cluster in etcd");
        }
        tracing::info!(shards, endpoint = %parts.endpoints[0], data = %dir.display(), "rotary is serving");
        Ok(Broker {
            stops,
            done,
            _lock: lock,
            endpoints: parts.endpoints,
            etcd,
            observed: Observed {
                metrics: parts.metrics,
                uploader: parts.uploader,
                specs: parts.specs,
                data_dir: dir.clone(),
                shards,
            },
        })
    }

    /// Stops accepting, lets in-flight appends commit, and returns.
    pub fn shutdown(mut self) {
        if let Some(c) = &self.etcd {
            tracing::info!("handing this broker's journals to other brokers");
            match c.drain(DRAIN_TIMEOUT) {
                0 => tracing::info!("every journal handed off"),
                n => tracing::warn!(left = n, "not every journal was handed off in time"),
            }
        }
        for s in &self.stops {
            let _ = s.try_send(());
        }
        let deadline = crate::clock::now() + SHUTDOWN_DRAIN;
        for _ in 0..self.stops.len() {
            let left = deadline.saturating_duration_since(crate::clock::now());
            if self.done.recv_timeout(left).is_err() {
                tracing::warn!("a shard did not drain in time");
                break;
            }
        }
        // Files the shards handed over for deletion are gone before exit.
        reaper::flush();
        if let Some(c) = self.etcd.take() {
            c.stop();
        }
    }
}

/// Creates the data directory if it is missing and locks it for this
/// process.
fn open_data_dir(dir: &std::path::Path) -> Result<std::fs::File, EngineError> {
    if dir.exists() && !dir.is_dir() {
        return Err(ConfigError::NotADirectory(dir.to_path_buf()).into());
    }
    std::fs::create_dir_all(dir).map_err(|e| EngineError::Io(dir.to_path_buf(), e))?;
    lock_data_dir(dir)
}

/// The cores a broker's threads run on.
struct CoreLayout {
    /// Shard n's core, for each of the broker's shards.
    shard: Vec<usize>,
    /// Shard n's hasher's cores: the broker's other cores.
    hash: Vec<Vec<usize>>,
    /// Where the rings' io-wq workers run: `iowq_cpus`, else the broker's
    /// cores that host no shard.
    spare: Vec<usize>,
}

impl CoreLayout {
    /// Counts the shards and places them, their hashers and their io-wq
    /// workers on the broker's cores (`cores`, `cpus`, `iowq_cpus`).
    fn plan(config: &ServeConfig) -> Result<CoreLayout, EngineError> {
        let ncpu = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1);
        let shards = match (config.cores, config.cpus.len()) {
            (0, 0) => ncpu,
            (0, n) => n,
            (n, _) => n,
        };
        // A process confined to some cores (`serve --cpus` confines itself
        // before it gets here) still names cores by the machine's numbers.
        let online = sys::online_cpus().max(ncpu);
        if let Some(c) = config.cpus.iter().find(|&&c| c >= online) {
            return Err(ConfigError::NoSuchCore { core: *c, online }.into());
        }
        let core_of = |n: usize| {
            if config.cpus.is_empty() {
                n % ncpu
            } else {
                config.cpus[n % config.cpus.len()]
            }
        };
        let shard: Vec<usize> = (0..shards).map(core_of).collect();
        let used: HashSet<usize> = shard.iter().copied().collect();
        // A broker given cores keeps its io-wq workers among them too.
        let own: Vec<usize> = if config.cpus.is_empty() {
            (0..ncpu).collect()
        } else {
            config.cpus.clone()
        };
        // Each shard's hasher runs on the broker's other cores.
        let hash = shard
            .iter()
            .map(|&mine| own.iter().copied().filter(|&c| c != mine).collect())
            .collect();
        let spare: Vec<usize> = if config.iowq_cpus.is_empty() {
            own.into_iter().filter(|c| !used.contains(c)).collect()
        } else {
            config.iowq_cpus.clone()
        };
        if shards > metrics::SHARDS_MAX {
            return Err(ConfigError::TooManyShards {
                asked: shards,
                max: metrics::SHARDS_MAX,
            }
            .into());
        }
        Ok(CoreLayout { shard, hash, spare })
    }
}

fn warn_if_no_space_above_reserve(dir: &std::path::Path, reserve_bytes: u64) {
    match rotary_storage::spool::free_bytes_at(dir) {
        Ok(free) if free <= reserve_bytes => tracing::warn!(
            free,
            reserve = reserve_bytes,
            "the data dir's file system has no space above --disk-reserve: appends answer STORAGE_FULL until space returns"
        ),
        _ => {}
    }
}

/// Opens the broker's specs and, in a cluster, its session with etcd or
/// its view from the cluster file.
#[allow(clippy::type_complexity)]
fn open_membership(
    config: &ServeConfig,
    shards: usize,
) -> Result<
    (
        Arc<specs::SpecStore>,
        Option<cluster::Cluster>,
        Option<topology::ClusterView>,
    ),
    EngineError,
> {
    let dir = &config.data_dir;
    // A broker of a cluster on etcd mirrors etcd's specs in a file of
    // its own: revisions there are etcd's, not comparable with a single
    // node's or a cluster file's.
    let specs_file = if config.etcd.is_some() {
        ETCD_SPECS_FILE
    } else {
        "specs.json"
    };
    let specs = Arc::new(specs::SpecStore::open(dir.join(specs_file))?);
    let etcd = match config.etcd.clone() {
        Some(c) => {
            cluster::retire_local_journals(dir)?;
            Some(cluster::Cluster::connect(c, shards as u32, specs.clone())?)
        }
        None => None,
    };
    let cluster_view = match &config.cluster {
        Some((path, me)) => {
            let file =
                topology::load_cluster_file(path, me).map_err(|why| ConfigError::ClusterFile {
                    path: path.clone(),
                    why,
                })?;
            // The file's journals, before any shard looks at the store.
            topology::mirror_specs(&specs, file.specs);
            Some(file.view)
        }
        None => None,
    };
    Ok((specs, etcd, cluster_view))
}

/// Binds shard n's listener on `listen`'s port + n (any free port for
/// each when `listen`'s is 0), answering the listeners and their addresses.
fn bind_listeners(
    listen: SocketAddr,
    shards: usize,
) -> Result<(Vec<std::net::TcpListener>, Vec<SocketAddr>), EngineError> {
    let mut listeners = Vec::new();
    let mut endpoints = Vec::new();
    for n in 0..shards {
        let mut addr = listen;
        let port = listen
            .port()
            .checked_add(n as u16)
            .ok_or(ConfigError::PortRange {
                port: listen.port(),
                shards,
            })?;
        addr.set_port(if listen.port() == 0 { 0 } else { port });
        let l = bind_listener(addr).map_err(|e| EngineError::Listen(addr, e))?;
        endpoints.push(l.local_addr().map_err(|e| EngineError::Listen(addr, e))?);
        listeners.push(l);
    }
    Ok((listeners, endpoints))
}

/// The broker's view of its cluster: etcd's, the cluster file's (watched
/// for changes), or a cluster of this broker alone.
fn start_topology(
    config: &ServeConfig,
    specs: &Arc<specs::SpecStore>,
    etcd: Option<&cluster::Cluster>,
    cluster_view: Option<topology::ClusterView>,
    endpoint: SocketAddr,
) -> Arc<topology::Topology> {
    if let Some(c) = etcd {
        let t = topology::Topology::new(c.view.clone());
        t.set_control(c.handle.clone());
        return t;
    }
    match cluster_view {
        Some(v) => {
            let t = topology::Topology::new(v);
            let (path, me) = config.cluster.clone().expect("cluster view from a file");
            topology::watch_cluster_file(t.clone(), specs.clone(), path, me);
            t
        }
        None => topology::Topology::new(topology::ClusterView::single(endpoint)),
    }
}

/// What every shard of a broker shares.
struct SharedParts {
    specs: Arc<specs::SpecStore>,
    metrics: Arc<metrics::Metrics>,
    uploader: rotary_uploader::Uploader,
    topology: Arc<topology::Topology>,
    endpoints: Vec<SocketAddr>,
}

/// Shard n's configuration.
fn shard_config(
    config: &ServeConfig,
    cores: &CoreLayout,
    parts: &SharedParts,
    n: usize,
) -> Result<shard::ShardConfig, EngineError> {
    let shards = cores.shard.len();
    let hash_cores = &cores.hash[n];
    // With one core there is nowhere else to hash.
    let hasher = if hash_cores.is_empty() {
        None
    } else {
        Some(
            hasher::Hasher::start(n as u32, hash_cores.clone(), config.hash_backlog_bytes)
                .map_err(|e| EngineError::Thread("hasher", e))?,
        )
    };
    Ok(shard::ShardConfig {
        index: n as u32,
        shards: shards as u32,
        data_dir: config.data_dir.clone(),
        specs: parts.specs.clone(),
        metrics: parts.metrics.clone(),
        endpoints: parts.endpoints.clone(),
        disk_reserve_bytes: config.disk_reserve_bytes,
        uploader: parts.uploader.clone(),
        // The budget and the cache are the broker's; each shard
        // holds an equal share.
        spool_budget_bytes: config.spool_budget_bytes / shards as u64,
        append_queue_bytes: config.append_queue_bytes / shards as u64,
        local_cache_bytes: config.local_cache_bytes / shards as u64,
        sizing: config.spool_sizing,
        topology: parts.topology.clone(),
        commit_log_compact_bytes: config.commit_log_compact_bytes,
        peer_silence: config.peer_silence,
        offset_jump_age: config.offset_jump_age,
        min_append_rate: config.min_append_rate,
        replica_ack_timeout: config.replica_ack_timeout,
        ack_poll: config.ack_poll,
        clock: config.clock.clone(),
        faults: config.faults.clone(),
        hasher,
    })
}

/// Starts a thread per shard and waits until every shard has recovered its
/// journals and listens. Answers the shards' stop signals and the channel
/// on which each reports having stopped.
#[allow(clippy::type_complexity)]
fn start_shards(
    config: &ServeConfig,
    cores: &CoreLayout,
    parts: &SharedParts,
    listeners: Vec<std::net::TcpListener>,
) -> Result<
    (
        Vec<async_channel::Sender<()>>,
        crossbeam_channel::Receiver<u32>,
    ),
    EngineError,
> {
    let shards = cores.shard.len();
    let (ready_tx, ready_rx) = crossbeam_channel::bounded::<Result<(), EngineError>>(shards);
    let (done_tx, done_rx) = crossbeam_channel::bounded::<u32>(shards);
    let mut stops = Vec::new();
    for (n, listener) in listeners.into_iter().enumerate() {
        let (stop_tx, stop_rx) = async_channel::bounded::<()>(1);
        stops.push(stop_tx);
        let ctx = ShardContext {
            core: cores.shard[n],
            spare: cores.spare.clone(),
            shard: shard_config(config, cores, parts, n)?,
            ring_entries: config.ring_entries,
            slice: config.shard_slice,
            shutdown_upload_timeout: config.shutdown_upload_timeout,
            listener,
            stop: stop_rx,
            ready: ready_tx.clone(),
            done: done_tx.clone(),
        };
        std::thread::Builder::new()
            .name(format!("rotary-shard-{n}"))
            .spawn(move || run_shard(ctx))
            .map_err(|e| EngineError::Thread("shard", e))?;
    }
    for _ in 0..shards {
        ready_rx.recv().map_err(|_| EngineError::ShardDied)??;
    }
    Ok((stops, done_rx))
}

/// How long a start waits for its ports to come free: a broker that just
/// exited may hold its listening sockets for a moment after its process is
/// gone (their rings are torn down after it), and a supervisor restarting
/// it at once would otherwise fail on "address in use".
const BIND_RETRY_FOR: Duration = Duration::from_secs(2);

fn bind_listener(addr: SocketAddr) -> std::io::Result<std::net::TcpListener> {
    let deadline = crate::clock::now() + BIND_RETRY_FOR;
    loop {
        match std::net::TcpListener::bind(addr) {
            Err(e)
                if e.kind() == std::io::ErrorKind::AddrInUse && crate::clock::now() < deadline =>
            {
                std::thread::sleep(Duration::from_millis(50));
            }
            other => return other,
        }
    }
}

struct ShardContext {
    core: usize,
    /// Cores that host no shard of this broker.
    spare: Vec<usize>,
    ring_entries: u32,
    slice: Duration,
    shard: shard::ShardConfig,
    shutdown_upload_timeout: Duration,
    listener: std::net::TcpListener,
    stop: async_channel::Receiver<()>,
    ready: crossbeam_channel::Sender<Result<(), EngineError>>,
    done: crossbeam_channel::Sender<u32>,
}

/// Builds a shard's runtime, its ring pinned with it to `core`.
///
/// Only the shard's thread ever submits to its ring, so the ring is set up as
/// single-issuer with deferred task work (Linux 6.1): completions are reaped
/// when the shard next enters the kernel to wait, instead of interrupting it
/// wherever it runs, and no inter-processor interrupt is sent to make it do
/// so. On a kernel that refuses those flags the ring is built without them;
/// the flag returned says which ring was built.
fn shard_runtime(
    core: usize,
    ring_entries: u32,
) -> std::io::Result<(compio::runtime::Runtime, bool)> {
    let build = |deferred: bool| {
        let mut proactor = compio::driver::ProactorBuilder::new();
        proactor.capacity(ring_entries);
        if deferred {
            proactor
                .single_issuer(true)
                .defer_taskrun(true)
                .coop_taskrun(true)
                .taskrun_flag(true);
        }
        compio::runtime::RuntimeBuilder::new()
            .with_proactor(proactor)
            .thread_affinity(HashSet::from([core]))
            .build()
    };
    match build(true) {
        Ok(rt) => Ok((rt, true)),
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
            tracing::info!(
                core,
                "io_uring refused deferred task work; the shard's ring runs without it"
            );
            Ok((build(false)?, false))
        }
        Err(e) => Err(e),
    }
}

fn run_shard(ctx: ShardContext) {
    metrics::set_thread_shard(ctx.shard.index);
    // Every time-based decision of this shard reads this clock.
    let _clock = clock::install(ctx.shard.clock.clone());
    // And every disk operation of it asks this hook, if a test set one.
    let _faults = rotary_storage::faults::install(ctx.shard.faults.clone());
    let rt = match shard_runtime(ctx.core, ctx.ring_entries) {
        Ok((rt, _)) => rt,
        Err(e) => {
            let _ = ctx
                .ready
                .send(Err(EngineError::Io(ctx.shard.data_dir.clone(), e)));
            return;
        }
    };
    place_iowq_workers(&rt, ctx.core, &ctx.spare);
    if !ctx.slice.is_zero() {
        match sys::set_time_slice(ctx.slice) {
            Ok(()) => tracing::debug!(core = ctx.core, slice = ?ctx.slice, "shard time slice set"),
            Err(e) => {
                tracing::info!(error = %e, "the shard keeps the scheduler's default time slice")
            }
        }
    }
    rt.block_on(serve_shard(ctx));
}

/// Keeps the io-wq workers of a shard's ring on `spare`: cores that host
/// no shard (counted by the broker before any thread was pinned: a pinned
/// thread sees only its own core), or the cores the operator chose
/// (`iowq_cpus`). Moving io-wq work onto another shard's core would trade a
/// stall for a cross-core wake-up on every punted write, so with no spare
/// core the workers stay with their shard.
fn place_iowq_workers(rt: &compio::runtime::Runtime, core: usize, spare: &[usize]) {
    use std::os::fd::AsRawFd;
    if spare.is_empty() {
        tracing::debug!(
            core,
            "no core without a shard; io-wq workers stay on the shard's core"
        );
        return;
    }
    match sys::set_iowq_affinity(rt.as_raw_fd(), spare) {
        Ok(()) => tracing::debug!(core, ?spare, "io-wq workers kept on the chosen cores"),
        Err(e) => {
            tracing::info!(error = %e, "io-wq affinity not set; punted work may run on the shard's core")
        }
    }
}

/// Opens the shard, reports it ready, serves its connections until told to
/// stop, then drains it.
async fn serve_shard(ctx: ShardContext) {
    let index = ctx.shard.index;
    let endpoint = ctx.shard.endpoints[index as usize];
    let shard = match shard::Shard::open(ctx.shard).await {
        Ok(s) => s,
        Err(e) => {
            let _ = ctx.ready.send(Err(e));
            return;
        }
    };
    let listener = match ctx
        .listener
        .set_nonblocking(true)
        .and_then(|_| compio::net::TcpListener::from_std(ctx.listener))
    {
        Ok(l) => l,
        Err(e) => {
            let _ = ctx.ready.send(Err(EngineError::Listen(endpoint, e)));
            return;
        }
    };
    shard.start_background();
    let _ = ctx.ready.send(Ok(()));
    accept_until_stopped(&shard, &listener, &ctx.stop).await;
    shard.begin_shutdown();
    shard.drained().await;
    shard.write_restatements();
    // The answers of the stop (appends rolled back, reads ended) and
    // of the last turns reach their clients before the process exits.
    shard.answers_sent(SHUTDOWN_ANSWERS_WAIT).await;
    // Hand every open spool to its store before exiting, so a clean
    // stop-and-wipe loses nothing.
    if !shard.flush_to_stores(ctx.shutdown_upload_timeout).await {
        tracing::warn!(
            shard = index,
            "some fragments were not uploaded before shutdown; they stay on local disk"
        );
    }
    let _ = ctx.done.send(index);
}

/// Accepts connections and serves each on its own task until `stop`.
async fn accept_until_stopped(
    shard: &std::rc::Rc<shard::Shard>,
    listener: &compio::net::TcpListener,
    stop: &async_channel::Receiver<()>,
) {
    // Out of file descriptors, a connection would wait in the listen
    // backlog and its client would hang. One descriptor is kept spare
    // to accept such a connection and close it at once: its client sees
    // the close and can retry.
    let mut spare = std::fs::File::open("/dev/null").ok();
    let mut shed = false;
    let mut warned: Option<std::time::Instant> = None;
    let mut failures = 0u64;
    loop {
        let accept = std::pin::pin!(listener.accept());
        let stopped = std::pin::pin!(stop.recv());
        match futures_util::future::select(accept, stopped).await {
            futures_util::future::Either::Left((Ok((stream, _)), _)) => {
                if shed {
                    drop(stream);
                    shed = false;
                    spare = std::fs::File::open("/dev/null").ok();
                    continue;
                }
                compio::runtime::spawn(conn::serve(shard.clone(), stream)).detach();
            }
            futures_util::future::Either::Left((Err(e), _)) => {
                failures += 1;
                let out_of_fds = matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE));
                // One line per 10 s, not one per attempt.
                if warned.is_none_or(|t| crate::clock::elapsed(t) >= Duration::from_secs(10)) {
                    if out_of_fds {
                        tracing::warn!(
                            error = %e,
                            failures,
                            "out of file descriptors: connections are closed unserved until some are free (raise `ulimit -n`)"
                        );
                    } else {
                        tracing::warn!(error = %e, failures, "accept failed");
                    }
                    warned = Some(crate::clock::now());
                    failures = 0;
                }
                if out_of_fds && spare.is_some() {
                    spare = None;
                    shed = true;
                } else {
                    compio::time::sleep(Duration::from_millis(10)).await;
                }
            }
            futures_util::future::Either::Right(_) => break,
        }
    }
}

/// Ring control the runtime lacks.
mod sys {
    #![allow(unsafe_code)]

    const IORING_REGISTER_IOWQ_AFF: libc::c_uint = 17;

    /// See [`super::tune_allocator`]. Other C libraries keep their defaults.
    pub fn tune_allocator() {
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        {
            const MMAP_THRESHOLD: libc::c_int = 32 << 20;
            const TRIM_THRESHOLD: libc::c_int = 64 << 20;
            // SAFETY: mallopt only changes allocator settings; it is
            // thread-safe and may be called at any time.
            unsafe {
                libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD);
                libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD);
            }
        }
    }

    /// Turns on TCP keepalive for a client's connection, probing after
    /// `idle` without traffic, every `interval`, `count` times: a client
    /// whose machine died or left the network without a reset is then
    /// found, and its connection (a blocking read waiting at the write
    /// head, say) closed, instead of being kept for ever.
    pub fn keep_alive(
        fd: std::os::fd::RawFd,
        idle: std::time::Duration,
        interval: std::time::Duration,
        count: u32,
    ) -> std::io::Result<()> {
        let set = |level, name, value: libc::c_int| {
            // SAFETY: value is a valid c_int for the length given.
            let rc = unsafe {
                libc::setsockopt(
                    fd,
                    level,
                    name,
                    (&value as *const libc::c_int).cast(),
                    std::mem::size_of::<libc::c_int>() as libc::socklen_t,
                )
            };
            if rc == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        };
        let secs = |d: std::time::Duration| d.as_secs().clamp(1, i32::MAX as u64) as libc::c_int;
        set(libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, secs(idle))?;
        set(libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, secs(interval))?;
        set(
            libc::IPPROTO_TCP,
            libc::TCP_KEEPCNT,
            count.max(1) as libc::c_int,
        )?;
        set(libc::SOL_SOCKET, libc::SO_KEEPALIVE, 1)
    }

    /// Raises this process's soft RLIMIT_NOFILE to its hard limit.
    pub fn raise_open_files_limit() {
        let mut lim = std::mem::MaybeUninit::<libc::rlimit>::uninit();
        // SAFETY: lim is a valid out-pointer for getrlimit.
        if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, lim.as_mut_ptr()) } != 0 {
            return;
        }
        // SAFETY: getrlimit succeeded and filled lim.
        let mut lim = unsafe { lim.assume_init() };
        if lim.rlim_cur < lim.rlim_max {
            lim.rlim_cur = lim.rlim_max;
            // SAFETY: lim is a valid rlimit; raising the soft limit up to
            // the hard one needs no privilege. Failure leaves it as it was.
            unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &lim) };
        }
    }

    /// Cores the machine has online (whatever this process may use).
    pub fn online_cpus() -> usize {
        // SAFETY: sysconf reads a system setting; no memory is passed.
        let n = unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) };
        usize::try_from(n).unwrap_or(1).max(1)
    }

    /// The kernel's `struct sched_attr`.
    #[repr(C)]
    #[derive(Default)]
    struct SchedAttr {
        size: u32,
        policy: u32,
        flags: u64,
        nice: i32,
        priority: u32,
        runtime: u64,
        deadline: u64,
        period: u64,
        util_min: u32,
        util_max: u32,
    }

    /// Asks the scheduler for time slices of `slice` for the calling
    /// thread, keeping its policy and nice value. Under EEVDF (Linux 6.12)
    /// a normal thread's `sched_runtime` is its slice; the kernel clamps
    /// it to 100 µs–100 ms. Earlier kernels take and ignore it.
    pub fn set_time_slice(slice: std::time::Duration) -> std::io::Result<()> {
        let size = std::mem::size_of::<SchedAttr>() as u32;
        let mut attr = SchedAttr::default();
        // SAFETY: pid 0 is the calling thread; the kernel writes at most
        // `size` bytes into attr.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_sched_getattr,
                0,
                &mut attr as *mut SchedAttr,
                size,
                0,
            )
        };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
        if attr.policy != libc::SCHED_OTHER as u32 {
            return Err(std::io::Error::other(format!(
                "the thread's scheduling policy is {}, not SCHED_OTHER",
                attr.policy
            )));
        }
        attr.size = size;
        attr.flags = 0;
        attr.runtime = u64::try_from(slice.as_nanos()).unwrap_or(u64::MAX);
        // SAFETY: the kernel reads `attr.size` bytes from attr during the
        // call only.
        let rc = unsafe { libc::syscall(libc::SYS_sched_setattr, 0, &attr as *const SchedAttr, 0) };
        if rc != 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }

    /// Confines the calling thread, and every thread it starts afterwards,
    /// to `cpus`.
    pub fn confine_current_thread(cpus: &[usize]) -> std::io::Result<()> {
        rotary_tuning::sys::set_thread_affinity(cpus)
    }

    /// Pins the ring's io-wq workers (which run fsync and other punted
    /// work) to `cpus`, so that blocking work does not land on the core of
    /// the shard that submitted it.
    pub fn set_iowq_affinity(ring_fd: i32, cpus: &[usize]) -> std::io::Result<()> {
        if cpus.is_empty() {
            return Err(std::io::Error::other("no core besides the shard's"));
        }
        // SAFETY: cpu_set_t is plain data; zeroed is the empty set.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        for &c in cpus {
            // SAFETY: CPU_SET writes within the set for c < CPU_SETSIZE.
            unsafe { libc::CPU_SET(c, &mut set) };
        }
        // SAFETY: the kernel reads size_of::<cpu_set_t>() bytes from &set.
        let rc = unsafe {
            libc::syscall(
                libc::SYS_io_uring_register,
                ring_fd,
                IORING_REGISTER_IOWQ_AFF,
                &set as *const libc::cpu_set_t,
                std::mem::size_of::<libc::cpu_set_t>(),
            )
        };
        if rc < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    /// The keepalive settings land on the socket.
    #[test]
    #[allow(unsafe_code)]
    fn client_connections_get_keepalive() {
        use std::os::fd::AsRawFd;
        use std::time::Duration;
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let _c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        let fd = s.as_raw_fd();
        let get = |level, name| {
            let mut v: libc::c_int = -1;
            let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
            // SAFETY: v and len are valid out-pointers of the right size.
            let rc = unsafe {
                libc::getsockopt(
                    fd,
                    level,
                    name,
                    (&mut v as *mut libc::c_int).cast(),
                    &mut len,
                )
            };
            assert_eq!(rc, 0);
            v
        };
        assert_eq!(get(libc::SOL_SOCKET, libc::SO_KEEPALIVE), 0);
        super::sys::keep_alive(fd, Duration::from_secs(61), Duration::from_secs(7), 4).unwrap();
        assert_eq!(get(libc::SOL_SOCKET, libc::SO_KEEPALIVE), 1);
        assert_eq!(get(libc::IPPROTO_TCP, libc::TCP_KEEPIDLE), 61);
        assert_eq!(get(libc::IPPROTO_TCP, libc::TCP_KEEPINTVL), 7);
        assert_eq!(get(libc::IPPROTO_TCP, libc::TCP_KEEPCNT), 4);
    }

    /// A port held a moment longer (by a broker still exiting) is waited
    /// for; one held for good fails the start once the wait is over.
    #[test]
    fn a_start_waits_a_moment_for_its_port() {
        let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = held.local_addr().unwrap();
        let freed = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(300));
            drop(held);
        });
        let l = super::bind_listener(addr).expect("bound once the port came free");
        assert_eq!(l.local_addr().unwrap(), addr);
        freed.join().unwrap();
        let started = crate::clock::now();
        let e = super::bind_listener(addr).unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::AddrInUse);
        assert!(crate::clock::elapsed(started) >= super::BIND_RETRY_FOR);
    }

    /// A shard's ring defers its task work to the shard's next wait. Wake-ups
    /// from other threads and completions of sockets and files must still
    /// arrive while it waits.
    #[test]
    fn a_shard_runtime_is_woken_by_other_threads_and_by_its_ring() {
        let (rt, deferred) = super::shard_runtime(0, 64).unwrap();
        // The shard's ring defers its task work wherever the kernel can.
        assert_eq!(deferred, rotary_tuning::doctor::defer_taskrun_accepted());
        let (tx, rx) = async_channel::bounded::<u64>(1);
        let sender = std::thread::spawn(move || {
            for i in 0..3u64 {
                std::thread::sleep(std::time::Duration::from_millis(20));
                tx.send_blocking(i * 7).unwrap();
            }
        });
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let (got, echoed, read_back) = rt.block_on(async move {
            let mut got = Vec::new();
            for _ in 0..3 {
                got.push(rx.recv().await.unwrap());
            }
            let listener = compio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let server = compio::runtime::spawn(async move {
                use compio::io::{AsyncReadExt, AsyncWriteExt};
                let (mut s, _) = listener.accept().await.unwrap();
                let compio::buf::BufResult(read, buf) = s.read_exact(vec![0u8; 5]).await;
                read.unwrap();
                s.write_all(buf).await.0.unwrap();
            });
            let mut c = compio::net::TcpStream::connect(addr).await.unwrap();
            use compio::io::{AsyncReadExt, AsyncWriteExt};
            c.write_all(b"hello".to_vec()).await.0.unwrap();
            let compio::buf::BufResult(read, echoed) = c.read_exact(vec![0u8; 5]).await;
            read.unwrap();
            server.await.unwrap();
            let mut f = compio::fs::File::create(&path).await.unwrap();
            use compio::io::AsyncWriteAtExt;
            f.write_all_at(b"rotary".to_vec(), 3).await.0.unwrap();
            let back = compio::fs::read(&path).await.unwrap();
            (got, echoed, back)
        });
        sender.join().unwrap();
        assert_eq!(got, vec![0, 7, 14]);
        assert_eq!(echoed, b"hello");
        assert_eq!(read_back, b"\0\0\0rotary");
    }

    #[test]
    fn iowq_affinity_registers_on_a_compio_ring() {
        use std::os::fd::AsRawFd;
        let rt = compio::runtime::Runtime::new().unwrap();
        super::sys::set_iowq_affinity(rt.as_raw_fd(), &[0]).unwrap();
        assert!(super::sys::set_iowq_affinity(rt.as_raw_fd(), &[]).is_err());
    }
}
