//! One shard: the journals hashed to this core, their spools and commit
//! log, and the flusher that turns queued appends into durable commits.
//!
//! The flusher is the only writer. Each turn it (1) prepares journals that
//! have work (reload a tail after rollback, seal, open a spool), (2) stages
//! every ready append of every journal into its spool's buffer, (3) writes
//! one commit-log record per committing journal into the page cache and
//! answers the batches whose records carry their bytes, (4) submits all
//! spool writes at once, fdatasyncing `fsync` journals' spools and the log
//! after their writes, and (5) acknowledges, in order, every other append
//! that committed, and makes every committed byte readable. Appends that
//! arrive meanwhile wait for the next turn: that is the group commit which
//! batches ring submissions. While (4) is in flight, bytes arriving for the
//! journals being written are staged into their spools' second buffers, so
//! that hashing the next batch overlaps writing this one; they commit in
//! the next turn.

use crate::journal::{
    AbortReason, Active, AppendOp, AppendSha, Digest, FileRef, InFlight, Journal, PrimaryRepl,
    SharedWork, Staged, Wait, APPEND_IDLE_TIMEOUT,
};
use crate::metrics::{self, Metrics};
use crate::outbox::Outbox;
use crate::pipeline::{Failure, Pipeline};
use crate::specs::SpecStore;
use crate::topology::{ClusterView, Member, Route, Topology};
use event_listener::Event;
use futures_util::future::join_all;
use rotary_net::repl::Record;
use rotary_net::spec::{Durability, JournalFlags, JournalSpec, LabelSet};
use rotary_net::status::Status;
use rotary_net::wire::{AppendReply, Op};
use rotary_storage::fragment::{list_dir, LocalFragment};
use rotary_storage::sha::Sha1;
use rotary_storage::spool::{read_range, Check, CommitPoint, Spool, SpoolSizing};
use rotary_storage::wal::{CommitLog, JournalState, Midstate, Replayed};
use rotary_storage::StorageError;
use rotary_uploader::{StoredFragment, UploadDone, UploadJob, Uploader};
use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet, VecDeque};
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::Arc;
use std::time::{Instant, SystemTime};

pub type JournalRef = Rc<RefCell<Journal>>;

/// Which fragment an upload is of: journal, begin, end, SHA-1.
type UploadKey = (String, u64, u64, [u8; 20]);

/// Largest READ_DATA payload.
pub const READ_CHUNK_BYTES: usize = 1 << 20;

pub struct Shard {
    pub index: u32,
    pub shards: u32,
    pub dir: PathBuf,
    pub specs: Arc<SpecStore>,
    pub metrics: Arc<Metrics>,
    /// Listen address of every shard of this broker.
    pub endpoints: Vec<std::net::SocketAddr>,
    pub disk_reserve_bytes: u64,
    journals: RefCell<HashMap<String, JournalRef>>,
    specs_seen: Cell<u64>,
    log: RefCell<Option<CommitLog>>,
    /// Last committed state of every journal, as in the commit log.
    states: RefCell<HashMap<String, JournalState>>,
    ready: RefCell<Vec<JournalRef>>,
    wake: Event,
    /// Set once a clean stop began; see [`Shard::begin_shutdown`].
    shutting_down: Cell<bool>,
    /// Commit-log write and compaction failures, logged once a minute.
    log_write_failed: crate::journal::Repeated,
    log_compaction_failed: crate::journal::Repeated,
    /// Failed store listings and uploads, logged per store; failed SYNCs
    /// per replica set; failed batches per replica; refused records.
    pub(crate) shared_failures: crate::journal::SharedFailures,
    /// Upload jobs handed to the uploader and not yet answered.
    uploads_in_flight: RefCell<HashSet<UploadKey>>,
    /// Wakes waiting reads when a clean stop begins.
    stopping: Event,
    /// Every connection's outbox, so that a clean stop can wait for the
    /// answers it gave to reach their clients.
    outboxes: RefCell<Vec<std::rc::Weak<Outbox>>>,
    /// Set while the flusher works on a turn.
    busy: Cell<bool>,
    idle: Event,
    pub uploader: Uploader,
    upload_done: async_channel::Sender<UploadDone>,
    upload_done_rx: RefCell<Option<async_channel::Receiver<UploadDone>>>,
    /// Sealed bytes of journals with stores not yet in their store.
    unuploaded_bytes: Cell<u64>,
    /// Store listings running ([`Shard::refresh_listing`]).
    listings_in_flight: Cell<usize>,
    /// Journals whose listing waits for one of those to end.
    listings_waiting: RefCell<VecDeque<JournalRef>>,
    spool_budget_bytes: u64,
    local_cache_bytes: u64,
    /// Files of uploaded fragments kept for new spools.
    spares: RefCell<crate::spares::Spares>,
    /// Append content its connections hold queued, against its share.
    pub append_queue: Rc<crate::conn::QueueBudget>,
    /// The last upload error, named in refusals while the budget is spent.
    store_error: RefCell<Option<String>>,
    me: RefCell<std::rc::Weak<Shard>>,
    sizing: SpoolSizing,
    topology: Arc<Topology>,
    spec_sync_interval: std::time::Duration,
    /// See `ServeConfig::peer_silence`.
    pub peer_silence: std::time::Duration,
    /// See `ServeConfig::replica_ack_timeout`.
    replica_ack_timeout: std::time::Duration,
    /// The last snapshot taken.
    view: RefCell<crate::topology::Views>,
    /// The current view the tick last saw (see `Shard::tick`).
    tick_view: RefCell<Arc<ClusterView>>,
    /// Pipelines to peer shards, by (peer id, endpoint).
    pipelines: RefCell<HashMap<(String, std::net::SocketAddr), Rc<Pipeline>>>,
    /// Brokers of journals' earlier routes that did not answer a takeover
    /// SYNC in time, and when: the takeovers of other journals pass them
    /// over for a while (see `SILENT_SOURCE_PASSED_OVER`) rather than each
    /// wait for them in turn.
    silent_sources: RefCell<HashMap<String, Instant>>,
    /// Sequence numbers of replicated appends (and SYNCs).
    next_seq: Cell<u64>,
    hasher: Option<crate::hasher::Hasher>,
    /// Journals holding an append back until the hasher catches up.
    hash_parked: RefCell<Vec<JournalRef>>,
    /// Local fragment files being checked against their names (see
    /// [`crate::check`]), and the event that ends each check: a second
    /// reader of the same file waits for the first one's check.
    checking: RefCell<HashMap<PathBuf, Rc<Event>>>,
    /// Journals with replicated batches awaiting acks (running ackers).
    awaiting_acks: Cell<usize>,
    /// Batches proposed to replicas so far; the ack poller's clock.
    proposals: Cell<u64>,
    /// Notified when a batch is proposed.
    proposed: Event,
    ack_poll: std::time::Duration,
}

/// A read of a journal's local file in flight (counted in
/// `Journal::reads_in_flight` while it lives).
struct ReadPin(JournalRef);

impl ReadPin {
    fn new(j: &JournalRef) -> ReadPin {
        j.borrow_mut().reads_in_flight += 1;
        ReadPin(j.clone())
    }
}

impl Drop for ReadPin {
    fn drop(&mut self) {
        // Should the journal be borrowed here, the count stays up: that
        // only stops its files from being reused, never the other way.
        if let Ok(mut jm) = self.0.try_borrow_mut() {
            jm.reads_in_flight -= 1;
        }
    }
}

/// Proposes a journal's batch to each of its replicas: the commit record
/// of every staged append. Returns what to wait for.
fn propose(jm: &Journal, staged: &[Staged]) -> Vec<Wait> {
    let repl = jm.repl.as_ref().expect("proposed with replicas");
    let mut waits = Vec::new();
    for (p, epoch) in &repl.pipelines {
        for s in staged {
            p.push(&Record::Commit {
                seq: s.seq,
                journal: &jm.name,
                begin: s.begin,
                end: s.end,
                fragment_sha1: s.point.sha.clone().finalize(),
                registers: s.registers.clone(),
            });
        }
        waits.push((p.clone(), *epoch, staged.iter().map(|s| s.seq).collect()));
    }
    waits
}

/// New bytes of one journal's batch that its commit record may carry, so
/// that the batch is answered without waiting for its spool write.
const INLINE_BYTES_MAX: u64 = 32 << 10;
const _: () = assert!(INLINE_BYTES_MAX as usize <= rotary_storage::wal::RECORD_INLINE_BYTES_MAX);
/// New bytes of a whole turn beyond which no record carries any: a turn
/// that busy is bound by the CPU, which copying every byte into the log as
/// well would only slow, and its write is shared by many appends.
const INLINE_TURN_BYTES_MAX: u64 = 64 << 10;
/// How long a peer may take to answer a page of the LIST of its specs
/// (a broker of an earlier version answers every spec at once: about 400
/// bytes a journal, 24 MB for 60,000).
const PEER_LIST_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);
/// Most store listings a shard runs at once ([`Shard::refresh_listing`]).
const LISTINGS_IN_FLIGHT_MAX: usize = 32;

/// Batches of one journal proposed to replicas and not yet acknowledged.
const INFLIGHT_BATCHES_MAX: usize = 16;
/// How long a primary waits before retrying a failed SYNC.
const SYNC_RETRY: std::time::Duration = std::time::Duration::from_millis(250);
/// A turn that takes this long is logged with the time of each phase.
const SLOW_TURN: std::time::Duration = std::time::Duration::from_millis(50);
/// How long a broker of a journal's earlier route that did not answer a
/// takeover SYNC in time is passed over by the takeovers of other journals,
/// in replica ack timeouts.
const SILENT_SOURCE_PASSED_OVER: u32 = 3;
/// How many journals a shard's tick begins to take over, at most, after a
/// change of the cluster file (see `Shard::tick`): a change that moves
/// tens of thousands of journals does not send as many SYNCs at once.
const TICK_TAKEOVERS_MAX: usize = 256;

/// A primary pulses a replicated journal idle this long.
const PULSE_IDLE: std::time::Duration = std::time::Duration::from_secs(2);

/// A journal's place on this broker.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Role {
    /// The primary; the route's other members are replicas.
    Primary(Route),
    Replica(Route),
    /// Not in the route: requests are proxied.
    Outside(Route),
}

/// What a shard is started with.
pub struct ShardConfig {
    pub index: u32,
    pub shards: u32,
    pub data_dir: PathBuf,
    pub specs: Arc<SpecStore>,
    pub metrics: Arc<Metrics>,
    pub endpoints: Vec<std::net::SocketAddr>,
    pub disk_reserve_bytes: u64,
    pub uploader: Uploader,
    pub spool_budget_bytes: u64,
    pub append_queue_bytes: u64,
    pub local_cache_bytes: u64,
    pub sizing: SpoolSizing,
    pub topology: Arc<Topology>,
    pub commit_log_compact_bytes: u64,
    pub spec_sync_interval: std::time::Duration,
    pub peer_silence: std::time::Duration,
    /// See `ServeConfig::replica_ack_timeout`.
    pub replica_ack_timeout: std::time::Duration,
    /// See `ServeConfig::ack_poll`.
    pub ack_poll: std::time::Duration,
    /// Hashes large appends' own SHA-1 off the shard's thread; `None` on a
    /// broker with one core.
    pub hasher: Option<crate::hasher::Hasher>,
}

/// How long a presigned location handed to a direct reader stays valid.
const LOCATION_TTL: std::time::Duration = std::time::Duration::from_secs(600);

/// One entry of a peer's LIST answer with deletions: a spec or a
/// tombstone, and its revision.
#[derive(serde::Deserialize)]
struct Listed {
    spec: Option<JournalSpec>,
    deleted: Option<String>,
    #[serde(default)]
    revision: u64,
}

/// Directories of deleted journals, until the reaper removes them, are
/// `<shard dir>/<TRASH_PREFIX><unique>`.
const TRASH_PREFIX: &str = "deleted-";

fn trash_dir(shard_dir: &std::path::Path) -> PathBuf {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    shard_dir.join(format!("{TRASH_PREFIX}{nanos:x}-{n}"))
}

fn journal_dir(shard_dir: &std::path::Path, name: &str) -> PathBuf {
    // `@` never occurs in journal names, so `a/b`'s files never mix with
    // the directory of journal `a/b/c`.
    shard_dir.join("journals").join(name).join("@")
}

/// Some file of a journal (spool, fragment, copy) in the shard directory
/// `shard_dir`, if there is one.
fn first_journal_file(shard_dir: &std::path::Path) -> Result<Option<PathBuf>, crate::EngineError> {
    let mut dirs = vec![shard_dir.join("journals")];
    while let Some(dir) = dirs.pop() {
        let entries = match std::fs::read_dir(&dir) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(e) => return Err(crate::EngineError::Io(dir, e)),
        };
        for entry in entries {
            let entry = entry.map_err(|e| crate::EngineError::Io(dir.clone(), e))?;
            let kind = entry
                .file_type()
                .map_err(|e| crate::EngineError::Io(entry.path(), e))?;
            if kind.is_dir() {
                dirs.push(entry.path());
            } else {
                return Ok(Some(entry.path()));
            }
        }
    }
    Ok(None)
}

/// What a start's recovery of the shard's spools did.
#[derive(Default)]
struct Recovery {
    /// The shard directory was last recovered in this boot (see
    /// `rotary_storage::boot`): spools are hashed from their records'
    /// midstates, not whole.
    same_boot: bool,
    /// Spools checked against the commit log.
    spools: u64,
    /// Bytes hashed to check them.
    hashed: u64,
}

fn storage_status(e: &StorageError) -> Status {
    if e.is_full() {
        Status::STORAGE_FULL
    } else {
        Status::IO_ERROR
    }
}

impl Shard {
    /// Opens the shard's directory: replays its commit log and recovers
    /// every journal it owns.
    pub async fn open(cfg: ShardConfig) -> Result<Rc<Shard>, crate::EngineError> {
        let ShardConfig {
            index,
            shards,
            data_dir,
            specs,
            metrics,
            endpoints,
            disk_reserve_bytes,
            uploader,
            spool_budget_bytes,
            append_queue_bytes,
            local_cache_bytes,
            sizing,
            topology,
            commit_log_compact_bytes,
            spec_sync_interval,
            peer_silence,
            replica_ack_timeout,
            ack_poll,
            hasher,
        } = cfg;
        let dir = data_dir.join(format!("shard-{index}"));
        std::fs::create_dir_all(dir.join("journals"))
            .map_err(|e| crate::EngineError::Io(dir.clone(), e))?;
        // Files of journals deleted before a crash, not yet removed.
        for entry in std::fs::read_dir(&dir)
            .map_err(|e| crate::EngineError::Io(dir.clone(), e))?
            .flatten()
        {
            if entry
                .file_name()
                .to_string_lossy()
                .starts_with(TRASH_PREFIX)
            {
                crate::reaper::remove_dir_all(entry.path());
            }
        }
        // Every start writes the commit log (`settle`) before any journal
        // has a file, so journal files without a log mean the log was lost:
        // recovering from nothing would drop every spool and give out
        // acknowledged offsets again. (A start that died before writing
        // the log left no journal files.)
        let log_path = CommitLog::path_in(&dir);
        let has_log = log_path
            .try_exists()
            .map_err(|e| crate::EngineError::Io(log_path.clone(), e))?;
        if !has_log {
            if let Some(file) = first_journal_file(&dir)? {
                return Err(crate::EngineError::Corrupt(format!(
                    "{} is missing, but the shard holds journal files, such as {}",
                    log_path.display(),
                    file.display()
                )));
            }
        }
        let (mut log, replayed) = CommitLog::open(&dir).await.map_err(|e| match e {
            StorageError::Corrupt { path, why } => {
                crate::EngineError::Corrupt(format!("{}: {why}", path.display()))
            }
            e => e.into(),
        })?;
        // Likewise, specs are stored before a journal has data: without
        // them, every journal of this shard would be forgotten, and one
        // applied again would start over beside its old files.
        if specs.file_was_missing() {
            let named = replayed.keys().min();
            let found = match named {
                Some(name) => Some(format!("its commit log names journal {name}")),
                None => first_journal_file(&dir)?
                    .map(|file| format!("it holds journal files, such as {}", file.display())),
            };
            if let Some(found) = found {
                return Err(crate::EngineError::Corrupt(format!(
                    "{} is missing, but {} is no new shard: {found}",
                    specs.path().display(),
                    dir.display()
                )));
            }
        }
        log.set_compact_bytes(commit_log_compact_bytes);
        // Until recovery checks them against the spools, the last records.
        let states = replayed
            .iter()
            .map(|(name, r)| (name.clone(), r.last.clone()))
            .collect();
        let (done_tx, done_rx) = async_channel::unbounded();
        let spares = crate::spares::Spares::open(&dir)
            .map_err(|e| crate::EngineError::Io(dir.join("spares"), e))?;
        let append_queue = Rc::new(crate::conn::QueueBudget::new(
            usize::try_from(append_queue_bytes).unwrap_or(usize::MAX),
            Some(metrics.clone()),
        ));
        let shard = Rc::new(Shard {
            index,
            shards,
            dir,
            specs,
            metrics,
            endpoints,
            disk_reserve_bytes,
            journals: RefCell::new(HashMap::new()),
            specs_seen: Cell::new(0),
            log: RefCell::new(Some(log)),
            states: RefCell::new(states),
            ready: RefCell::new(Vec::new()),
            wake: Event::new(),
            shutting_down: Cell::new(false),
            stopping: Event::new(),
            uploads_in_flight: RefCell::new(HashSet::new()),
            log_write_failed: Default::default(),
            log_compaction_failed: Default::default(),
            shared_failures: Default::default(),
            outboxes: RefCell::new(Vec::new()),
            busy: Cell::new(false),
            idle: Event::new(),
            uploader,
            upload_done: done_tx,
            upload_done_rx: RefCell::new(Some(done_rx)),
            unuploaded_bytes: Cell::new(0),
            listings_in_flight: Cell::new(0),
            listings_waiting: RefCell::new(VecDeque::new()),
            spool_budget_bytes,
            local_cache_bytes,
            spares: RefCell::new(spares),
            append_queue,
            store_error: RefCell::new(None),
            me: RefCell::new(std::rc::Weak::new()),
            sizing,
            view: RefCell::new(topology.views()),
            tick_view: RefCell::new(topology.snapshot()),
            topology,
            spec_sync_interval,
            peer_silence,
            replica_ack_timeout,
            pipelines: RefCell::new(HashMap::new()),
            silent_sources: RefCell::new(HashMap::new()),
            next_seq: Cell::new(1),
            hasher,
            hash_parked: RefCell::new(Vec::new()),
            checking: RefCell::new(HashMap::new()),
            awaiting_acks: Cell::new(0),
            proposals: Cell::new(0),
            proposed: Event::new(),
            ack_poll,
        });
        *shard.me.borrow_mut() = Rc::downgrade(&shard);
        shard.specs_seen.set(shard.specs.version());
        // Journals whose last record did not stand, with what stands instead.
        let mut restated: Vec<(String, Option<JournalState>)> = Vec::new();
        let started = Instant::now();
        let mut recovery = Recovery {
            same_boot: rotary_storage::boot::recovered_in_this_boot(&shard.dir),
            ..Recovery::default()
        };
        for spec in shard.specs.all() {
            if rotary_net::shard_of(&spec.name, shards) == index {
                let (j, chosen) = shard
                    .recover(spec.clone(), replayed.get(&spec.name), &mut recovery)
                    .await?;
                let last = replayed.get(&j.name).map(|r| &r.last);
                if chosen.as_ref() != last {
                    let mut states = shard.states.borrow_mut();
                    match &chosen {
                        Some(st) => states.insert(j.name.clone(), st.clone()),
                        None => states.remove(&j.name),
                    };
                    restated.push((j.name.clone(), chosen));
                }
                shard
                    .journals
                    .borrow_mut()
                    .insert(j.name.clone(), Rc::new(RefCell::new(j)));
            }
        }
        {
            let mut log = shard.log.borrow_mut().take().expect("commit log present");
            let states = shard.states.borrow().clone();
            let res = log
                .settle(
                    restated.iter().map(|(n, st)| (n.as_str(), st.as_ref())),
                    states.iter().map(|(k, v)| (k.as_str(), v)),
                )
                .await;
            *shard.log.borrow_mut() = Some(log);
            res?;
        }
        // Only now: a start that dies before here checks everything again.
        if let Err(e) = rotary_storage::boot::record_recovery(&shard.dir) {
            tracing::warn!(dir = %shard.dir.display(), error = %e, "recording this boot's recovery; the next start reads every spool whole");
        }
        metrics::add(&shard.metrics.recovery_hashed_bytes, recovery.hashed);
        tracing::info!(
            shard = index,
            spools = recovery.spools,
            hashed_bytes = recovery.hashed,
            spools_read_whole = !recovery.same_boot,
            elapsed_ms = started.elapsed().as_millis() as u64,
            "recovered"
        );
        Ok(shard)
    }

    /// Rebuilds a journal from its directory and what the commit log holds
    /// for it. Returns the journal and the commit-log state that stands: the
    /// last record, or the one before it when the last record's spool
    /// bytes did not all reach the disk (see `rotary_storage::wal`).
    async fn recover(
        &self,
        spec: rotary_net::JournalSpec,
        replayed: Option<&Replayed>,
        recovery: &mut Recovery,
    ) -> Result<(Journal, Option<JournalState>), crate::EngineError> {
        let dir = journal_dir(&self.dir, &spec.name);
        let mut j = Journal::new(spec, dir.clone());
        j.init_index();
        let listing = list_dir(&dir).map_err(|e| crate::EngineError::Io(dir.clone(), e))?;
        j.fragments = listing.fragments;
        for path in &listing.partial {
            tracing::warn!(path = %path.display(), "removing an unfinished copy from a replica");
            let _ = std::fs::remove_file(path);
        }
        let mut head = j.fragments.iter().map(|f| f.end).max().unwrap_or(0);
        let candidates: Vec<&JournalState> = replayed
            .map(|r| r.candidates().collect())
            .unwrap_or_default();
        // Only one spool can hold commits: the one the commit log names
        // (its last record, or the one before when that one's bytes did not
        // reach the disk). Without such a spool, the newest: one begun
        // after the last commit, with nothing committed in it yet.
        let mut spools = listing.spools;
        let named = candidates
            .iter()
            .filter(|st| st.end > st.spool_begin && st.spool_begin >= head)
            .find_map(|st| {
                spools
                    .iter()
                    .position(|(begin, _)| *begin == st.spool_begin)
            });
        let newest = match named {
            Some(i) => Some(spools.remove(i)),
            None => spools.pop(),
        };
        for (begin, path) in spools {
            if j.fragments.iter().any(|f| f.begin == begin) {
                // A leftover of a seal interrupted after its rename target
                // was written: its bytes are in that fragment.
                tracing::warn!(path = %path.display(), "removing stale spool");
                let _ = std::fs::remove_file(&path);
            } else {
                // Not the spool the commit log's records commit into, and
                // no fragment holds its bytes: it is left as it is, for
                // whoever put it there. (A spool begun at a replica's new
                // head just before a crash is one too: the next spool
                // there takes its name.)
                tracing::warn!(
                    path = %path.display(),
                    "ignoring a spool the commit log does not name"
                );
            }
        }
        // A candidate commits bytes into the newest spool, or says the
        // spool holds nothing committed (its commits are all in fragments).
        let in_spool = |st: &JournalState| {
            newest.as_ref().is_some_and(|(begin, _)| {
                st.spool_begin == *begin && st.end > *begin && *begin >= head
            })
        };
        let mut chosen: Option<JournalState> = None;
        // Its index among the candidates.
        let mut chosen_at = candidates.len();
        let mut use_spool = false;
        if let Some((begin, path)) = &newest {
            // The last record may carry bytes that were answered before
            // their spool write completed: they go back into the spool
            // (identical bytes if the write did complete).
            if let Some(r) = replayed {
                if let Some(inline) = r.inline.as_ref().filter(|_| in_spool(&r.last)) {
                    Spool::repair(path, *begin, inline.at, &inline.bytes).await?;
                }
            }
            // In the boot of the last recovery, a candidate's bytes before
            // its midstate are on disk: only its own batch is hashed.
            let checks: Vec<Check> = candidates
                .iter()
                .filter(|st| in_spool(st))
                .map(|st| Check {
                    end: st.end,
                    sha1: st.sha1,
                    from: st
                        .mid
                        .filter(|_| recovery.same_boot)
                        .and_then(|m| Some((m.at, m.resume(st.spool_begin, st.end)?))),
                })
                .collect();
            let found = if checks.is_empty() {
                None
            } else {
                recovery.spools += 1;
                let (found, hashed) =
                    Spool::recover_checked(path.clone(), *begin, &checks, self.sizing).await?;
                recovery.hashed += hashed;
                found
            };
            // The first candidate that either is on disk or needs nothing
            // from the spool stands. Candidates before it all commit into
            // the spool, so its index among the checks is its index here.
            for (i, st) in candidates.iter().enumerate() {
                if !in_spool(st) {
                    chosen = Some((*st).clone());
                    chosen_at = i;
                    break;
                }
                if found.as_ref().is_some_and(|(_, at)| *at == i) {
                    chosen = Some((*st).clone());
                    chosen_at = i;
                    use_spool = true;
                    break;
                }
            }
            if chosen.is_none() && !candidates.is_empty() {
                // Neither the last record nor the one before it matches
                // the bytes on disk: only possible after power loss in
                // `replicated` mode (the log reached the disk, the data
                // did not), or damage to the file.
                return Err(crate::EngineError::Corrupt(format!(
                    "{}: SHA-1 of committed spool bytes matches neither of the commit log's last two records",
                    path.display()
                )));
            }
            match (use_spool, found) {
                (true, Some((s, _))) => {
                    head = s.committed();
                    j.spool_since = Some(SystemTime::now());
                    j.spool = Some(s);
                }
                _ if candidates[chosen_at..].iter().any(|st| in_spool(st)) => {
                    // The record that stands does not commit into this
                    // spool, but an older one does: the log names a spool
                    // that is not there. This one may hold acknowledged
                    // bytes no fragment has; it stays.
                    tracing::error!(
                        path = %path.display(),
                        "keeping a spool that an earlier commit record names"
                    );
                }
                _ => {
                    // Nothing committed into this spool. Its name goes
                    // here, not on the reaper: the next spool may take it.
                    let _ = crate::reaper::unlink_now_free_later(path);
                }
            }
        } else {
            chosen = candidates.first().map(|st| (*st).clone());
        }
        if let Some(st) = &chosen {
            j.registers = st.registers.clone();
            if !use_spool {
                // Its bytes are all in sealed fragments, which may since
                // have left the local cache for the store: the head is at
                // least where they end, so no offset is given out twice.
                if st.end > head && !j.has_stores() {
                    // A journal without stores keeps every fragment here.
                    tracing::error!(
                        journal = %j.name,
                        local_end = head,
                        committed_end = st.end,
                        "the commit log commits bytes that no file of the data directory holds, and the journal has no store: those offsets are lost (were its files removed?)"
                    );
                }
                head = head.max(st.end);
            }
        }
        j.head = head;
        j.local_head = head;
        j.staged_head = head;
        j.staged_registers = j.registers.clone();
        j.local_registers = j.registers.clone();
        j.first_sync_pending = j.fragments.is_empty() && j.spool.is_none() && chosen.is_none();
        Ok((j, chosen))
    }

    /// What a client asking for a journal this broker does not know is
    /// told: JOURNAL_NOT_FOUND, or while the broker is still learning the
    /// specs its peers hold (it just started, perhaps on an empty data
    /// directory), the retryable NO_JOURNAL_PRIMARY_BROKER.
    pub fn unknown_journal(&self, name: &str) -> (Status, String) {
        if self.specs.is_caught_up() {
            (
                Status::JOURNAL_NOT_FOUND,
                format!("journal {name:?} does not exist"),
            )
        } else {
            (
                Status::NO_JOURNAL_PRIMARY_BROKER,
                format!("journal {name:?} is not known here yet: this broker is still learning journal specs from its peers"),
            )
        }
    }

    /// Refreshes specs if the store changed; returns the journal if it exists.
    pub fn journal(&self, name: &str) -> Option<JournalRef> {
        self.take_spec_changes();
        self.journals.borrow().get(name).cloned()
    }

    /// Gives this shard's journals the specs changed in the store since it
    /// last looked, creating the journals new to it. On every request, and
    /// on every tick, so that a change reaches a journal that sees no
    /// requests too (a shorter flush interval, a store added).
    fn take_spec_changes(&self) {
        let v = self.specs.version();
        let seen = self.specs_seen.get();
        if v != seen {
            self.specs_seen.set(v);
            let mut map = self.journals.borrow_mut();
            match self.specs.changes_since(seen) {
                // Only the journals the changes name.
                Some(names) => {
                    for changed in names {
                        if rotary_net::shard_of(&changed, self.shards) != self.index {
                            continue;
                        }
                        if let Some(spec) = self.specs.get(&changed) {
                            self.take_spec(&mut map, spec);
                        }
                    }
                }
                None => {
                    for spec in self.specs.all() {
                        if rotary_net::shard_of(&spec.name, self.shards) == self.index {
                            self.take_spec(&mut map, spec);
                        }
                    }
                }
            }
        }
    }

    /// Gives this shard's journal its current spec, creating the journal
    /// if the spec is new here.
    fn take_spec(&self, map: &mut HashMap<String, JournalRef>, spec: rotary_net::JournalSpec) {
        if let Some(j) = map.get(&spec.name) {
            let mut j = j.borrow_mut();
            j.rate.set_rate(spec.max_append_rate);
            let gained_stores = !j.has_stores() && !spec.fragment.stores.is_empty();
            j.spec = spec;
            if gained_stores {
                j.init_index();
            }
            return;
        }
        // A journal created since: fresh, with no local files (deletion
        // removes them), possibly with registers left in the commit log by
        // an earlier incarnation (deletion logs their removal).
        let dir = journal_dir(&self.dir, &spec.name);
        let name = spec.name.clone();
        let mut j = Journal::new(spec, dir);
        j.init_index();
        j.first_sync_pending = true;
        let state = self.states.borrow().get(&name).cloned();
        if let Some(st) = &state {
            j.registers = st.registers.clone();
            j.staged_registers = st.registers.clone();
            j.local_registers = st.registers.clone();
        }
        self.adopt_files(&mut j, state.as_ref());
        map.insert(name, Rc::new(RefCell::new(j)));
    }

    /// Files in the directory of a journal created while the broker runs
    /// (a spec applied again after it was set aside at start, say, or
    /// files put there by hand). A restart would recover their fragments
    /// and prefer them to new bytes at the same offsets, so the journal
    /// takes them now and goes on after them and after its last commit
    /// record, giving out none of their offsets again. A spool stays where
    /// it is: a restart passes over one the commit log does not name.
    fn adopt_files(&self, j: &mut Journal, state: Option<&JournalState>) {
        let listing = match list_dir(&j.dir) {
            Ok(listing) => listing,
            Err(e) => {
                tracing::warn!(dir = %j.dir.display(), error = %e, "listing a new journal's directory");
                return;
            }
        };
        if listing.fragments.is_empty() && listing.spools.is_empty() {
            return;
        }
        let head = listing
            .fragments
            .iter()
            .map(|f| f.end)
            .chain(state.map(|st| st.end))
            .max()
            .unwrap_or(0);
        tracing::warn!(
            journal = %j.name,
            fragments = listing.fragments.len(),
            spools = listing.spools.len(),
            head,
            "a new journal's directory holds files; it continues after them"
        );
        j.fragments = listing.fragments;
        j.head = head;
        j.local_head = head;
        j.staged_head = head;
        j.first_sync_pending = j.fragments.is_empty() && state.is_none();
    }

    pub fn mark_ready(&self, j: &JournalRef) {
        self.ready.borrow_mut().push(j.clone());
        self.wake.notify(1);
    }

    /// The current cluster view.
    pub fn view(&self) -> Arc<ClusterView> {
        self.views().current
    }

    /// The current view and the ones before it.
    /// Where views come from (and, in a cluster on etcd, the control thread).
    pub fn topology(&self) -> &Arc<Topology> {
        &self.topology
    }

    pub fn views(&self) -> crate::topology::Views {
        let v = self.topology.version();
        let mut cur = self.view.borrow_mut();
        if cur.version != v {
            *cur = self.topology.views();
        }
        cur.clone()
    }

    /// The brokers to ask for bytes of a journal beyond this primary's
    /// head before it gives out offsets: those of the journal's routes in
    /// the views before the current one, since its takeover was last
    /// settled (`since`), that are not in its route now. A route that
    /// gained no broker leaves none; when every member of an old route
    /// stays in the new one, the replicas' SYNC answers carry their heads
    /// anyway. With the topology version of the views they were found in.
    fn takeover_sources(
        &self,
        spec: &rotary_net::JournalSpec,
        route: &Route,
        since: u64,
    ) -> (u64, Vec<Member>) {
        let views = self.views();
        let mut sources: Vec<Member> = Vec::new();
        // In a cluster on etcd a primary is only ever a member that was
        // consistent with the route before it (it holds every acknowledged
        // byte), and brokers that left hold nothing it lacks: nobody to ask.
        if views.current.assigned.is_some() {
            return (views.version, sources);
        }
        for view in views.since(since) {
            for m in view.route(&spec.name, spec.replication).members {
                if m.id != views.current.me
                    && !route.contains(&m.id)
                    && !sources.iter().any(|s| s.id == m.id)
                {
                    sources.push(m);
                }
            }
        }
        (views.version, sources)
    }

    /// Whether this primary of `j` has yet to ask the brokers of the
    /// journal's earlier routes for bytes beyond its head (see
    /// [`Shard::takeover_sources`]). With none to ask, it is settled here.
    fn takeover_due(&self, j: &JournalRef, route: &Route) -> bool {
        let since = j.borrow().takeover_version;
        if since == self.topology.version() {
            return false;
        }
        let (version, sources) = self.takeover_sources(&j.borrow().spec, route, since);
        if sources.is_empty() {
            j.borrow_mut().takeover_version = version;
        }
        !sources.is_empty()
    }

    /// The journal's place on this broker.
    pub fn role(&self, spec: &rotary_net::JournalSpec) -> Role {
        let view = self.view();
        let route = view.route(&spec.name, spec.replication);
        if route.is_primary(&view.me) {
            Role::Primary(route)
        } else if route.contains(&view.me) {
            Role::Replica(route)
        } else {
            Role::Outside(route)
        }
    }

    /// Whether this broker is the journal's primary.
    pub fn is_primary(&self, spec: &rotary_net::JournalSpec) -> bool {
        matches!(self.role(spec), Role::Primary(_))
    }

    /// The endpoint of `m`'s shard for `journal`.
    pub fn member_endpoint(&self, m: &Member, journal: &str) -> std::net::SocketAddr {
        if m.id == self.view().me {
            return self.endpoints[rotary_net::shard_of(journal, self.shards) as usize];
        }
        m.shard_endpoint(journal, self.shards)
    }

    /// Where a client appends to `journal` on `route`: its primary's shard
    /// endpoint, or this broker's own shard for the journal when the route
    /// has no members.
    pub fn primary_endpoint(
        &self,
        route: &crate::topology::Route,
        journal: &str,
    ) -> std::net::SocketAddr {
        match route.primary() {
            Some(p) => self.member_endpoint(p, journal),
            None => self.endpoints[rotary_net::shard_of(journal, self.shards) as usize],
        }
    }

    /// The pipeline to `peer`'s shard for `journal`.
    fn pipeline(&self, peer: &Member, journal: &str) -> Rc<Pipeline> {
        let addr = peer.shard_endpoint(journal, self.shards);
        self.pipelines
            .borrow_mut()
            .entry((peer.id.clone(), addr))
            .or_insert_with(|| {
                Pipeline::new(
                    peer.id.clone(),
                    addr,
                    self.metrics.clone(),
                    self.replica_ack_timeout,
                )
            })
            .clone()
    }

    fn flush_pipelines(&self) {
        for p in self.pipelines.borrow().values() {
            p.flush();
        }
    }

    fn seq(&self) -> u64 {
        let s = self.next_seq.get();
        self.next_seq.set(s + 1);
        s
    }

    /// Answers a journal's replicated batches in commit order as its
    /// replicas ack them. One runs per journal while it has batches in
    /// flight, so a replica slow to answer holds up only the journals
    /// routed through it, not every journal of the shard.
    async fn acker(self: Rc<Self>, j: JournalRef) {
        loop {
            let next = j.borrow_mut().proposed.pop_front();
            let Some(f) = next else {
                j.borrow_mut().acking = false;
                self.awaiting_acks.set(self.awaiting_acks.get() - 1);
                return;
            };
            let mut failure = None;
            let mut failed_at = "";
            'wait: for (i, (p, epoch, seqs)) in f.waits.iter().enumerate() {
                failed_at = &p.peer;
                for (k, &seq) in seqs.iter().enumerate() {
                    let failed = match p.wait(seq, *epoch).await {
                        Ok(ack) if ack.status == Status::OK => continue,
                        Ok(ack) => Failure::new(
                            Status::REPLICATION_FAILED,
                            format!(
                                "replica {} answered {}: {}",
                                p.peer,
                                ack.status,
                                String::from_utf8_lossy(&ack.body)
                            ),
                        ),
                        Err(e) => e,
                    };
                    failure = Some(failed);
                    // Nobody waits for the rest of the batch's acks.
                    for &rest in &seqs[k + 1..] {
                        p.forget(rest, *epoch);
                    }
                    for (p, epoch, seqs) in &f.waits[i + 1..] {
                        for &rest in seqs {
                            p.forget(rest, *epoch);
                        }
                    }
                    break 'wait;
                }
            }
            metrics::add(&self.metrics.replicated_batches, 1);
            if let Some(e) = &failure {
                let journal = j.borrow().name.clone();
                match self
                    .shared_failures
                    .failed(SharedWork::Replication, failed_at)
                {
                    Some(held) => {
                        tracing::warn!(replica = failed_at, %journal, error = %e.message, since_last_logged = held, "replication failed; the journal will synchronize again (logged once a minute per replica)");
                    }
                    None => {
                        tracing::debug!(replica = failed_at, %journal, error = %e.message, "replication failed");
                    }
                }
            }
            self.publish(&j, f.staged, failure.as_ref());
            {
                let mut jm = j.borrow_mut();
                jm.inflight -= 1;
                if failure.is_some() {
                    jm.repl = None;
                }
            }
            self.mark_ready(&j);
        }
    }

    /// Keeps the shard's runtime polling its ring, rather than sleeping,
    /// for up to `ack_poll` after each proposal while replicas' acks are
    /// awaited: they are a round trip away, and a thread that sleeps is
    /// woken (on a virtual machine, its vCPU too) only after they arrive.
    async fn poll_for_acks(self: Rc<Self>) {
        let mut seen = self.proposals.get();
        loop {
            let l = self.proposed.listen();
            if self.proposals.get() == seen {
                l.await;
                continue;
            }
            drop(l);
            seen = self.proposals.get();
            let began = Instant::now();
            let mut until = began + self.ack_poll;
            while self.awaiting_acks.get() > 0 && Instant::now() < until {
                if self.proposals.get() != seen {
                    seen = self.proposals.get();
                    until = Instant::now() + self.ack_poll;
                }
                yield_now().await;
            }
            metrics::add(&self.metrics.ack_polls, 1);
            metrics::add(
                &self.metrics.ack_poll_micros,
                began.elapsed().as_micros() as u64,
            );
        }
    }

    /// Learns the spec changes made while this broker was down. APPLY and
    /// DELETE reach the brokers that are up; one that starts later asks each
    /// peer for its specs and tombstones and takes whatever has a later
    /// revision than its own: journals created or changed meanwhile, and
    /// journals deleted meanwhile (deleted here through their shard, files
    /// and all). A peer that does not answer is asked again, soon at first
    /// (brokers of a cluster often start together), then every 5 s, for a
    /// minute at most. After that it asks every peer again each
    /// `spec_sync_interval`.
    async fn catch_up_specs(self: Rc<Self>) {
        const GIVE_UP: std::time::Duration = std::time::Duration::from_secs(60);
        const PAUSE_MAX: std::time::Duration = std::time::Duration::from_secs(5);
        let started = std::time::Instant::now();
        let mut pause = std::time::Duration::from_millis(100);
        let view = self.view();
        let mut waiting: Vec<_> = view.brokers.iter().filter(|m| m.id != view.me).collect();
        // The views first, from every peer at once and for one ack timeout
        // at most: takeovers wait for them (see `sync_replicas`), and a
        // peer that hangs must not hold them up for longer. One that
        // answers only later still tells its views below.
        let me = &*self;
        join_all(waiting.iter().map(|m| async move {
            if let Some(stats) = me.peer_stats(m, me.replica_ack_timeout).await {
                me.learn_views(m, &stats);
            }
        }))
        .await;
        self.topology.mark_peers_asked();
        loop {
            let mut still = Vec::new();
            for m in waiting {
                if !self.sync_specs_with(m).await {
                    still.push(m);
                }
            }
            waiting = still;
            if waiting.is_empty() || started.elapsed() >= GIVE_UP {
                break;
            }
            compio::time::sleep(pause).await;
            pause = (pause * 2).min(PAUSE_MAX);
        }
        if waiting.is_empty() {
            tracing::info!("learned the journal specs of every peer");
        } else {
            let silent: Vec<&str> = waiting.iter().map(|m| m.id.as_str()).collect();
            tracing::warn!(peers = ?silent, "some peers never listed their journal specs; journals unknown here now answer JOURNAL_NOT_FOUND");
        }
        self.specs.mark_caught_up();
        // Then now and again, for changes a peer's fan-out did not deliver
        // while this broker was up (a timeout, a stalled process).
        if self.spec_sync_interval.is_zero() {
            return;
        }
        loop {
            compio::time::sleep(self.spec_sync_interval).await;
            let view = self.view();
            for m in view.brokers.iter().filter(|m| m.id != view.me) {
                self.sync_specs_with(m).await;
            }
        }
    }

    /// Lists a peer's specs and tombstones and takes the newer ones, unless
    /// its STATS show the same specs as this broker's; false if the peer
    /// did not answer.
    async fn sync_specs_with(&self, peer: &Member) -> bool {
        let Some(stats) = self.peer_stats(peer, PEER_LIST_TIMEOUT).await else {
            return false;
        };
        // The views first: a journal this broker learns of below may have
        // left a broker in a change it never saw.
        if !self.specs.is_caught_up() {
            self.learn_views(peer, &stats);
        }
        if self.same_specs(&stats) {
            metrics::add(&self.metrics.spec_syncs_unchanged, 1);
            return true;
        }
        metrics::add(&self.metrics.spec_syncs_full, 1);
        // Every page first, then one change of the store for all of them.
        let mut entries = Vec::new();
        let mut after = String::new();
        loop {
            let body = rotary_net::wire::list_payload("", true, &after);
            let listed =
                crate::pipeline::unary(peer.endpoint, Op::LIST, 0, &[], &body, PEER_LIST_TIMEOUT)
                    .await;
            let Ok((Status::OK, flags, payload)) = listed else {
                return false;
            };
            let page = match serde_json::from_slice::<Vec<Listed>>(&payload) {
                Ok(page) => page,
                Err(e) => {
                    tracing::warn!(peer = %peer.id, error = %e, "a peer's journal list did not parse");
                    return true;
                }
            };
            let next = match page.last() {
                Some(last) if flags & rotary_net::wire::flag::NEXT_PAGE != 0 => last
                    .spec
                    .as_ref()
                    .map(|s| s.name.clone())
                    .or(last.deleted.clone()),
                _ => None,
            };
            entries.extend(page);
            match next {
                Some(next) => after = next,
                None => break,
            }
        }
        self.adopt_newer(&peer.id, entries).await;
        true
    }

    /// A peer's STATS, or `None` if it did not answer OK within `timeout`
    /// (a body that does not parse is `null`).
    async fn peer_stats(
        &self,
        peer: &Member,
        timeout: std::time::Duration,
    ) -> Option<serde_json::Value> {
        let stats = crate::pipeline::unary(peer.endpoint, Op::STATS, 0, &[], &[], timeout).await;
        let Ok((Status::OK, _, payload)) = stats else {
            return None;
        };
        Some(serde_json::from_slice(&payload).unwrap_or_default())
    }

    /// Whether a peer's STATS show the same count and digest of specs as
    /// this broker's store (false if they show none). A deletion shows
    /// too: the peer lacks the spec. Only tombstones are not compared, and
    /// they matter only to a spec older than the deletion, which one of
    /// the two would then hold.
    fn same_specs(&self, stats: &serde_json::Value) -> bool {
        let (count, digest) = self.specs.digest();
        stats["specs"].as_u64() == Some(count as u64)
            && stats["specs_digest"].as_str() == Some(format!("{digest:032x}").as_str())
    }

    /// Takes the cluster views a peer's STATS list as earlier views of
    /// this broker (see [`Topology::learn`]), while it starts: changes
    /// made while it was down, or before it first started, name brokers
    /// that journals left and that it never saw. Afterwards its own file
    /// watch sees every change.
    fn learn_views(&self, peer: &Member, stats: &serde_json::Value) {
        let views = match serde_json::from_value::<Vec<Vec<Member>>>(stats["cluster_views"].clone())
        {
            Ok(views) => views,
            Err(e) => {
                tracing::warn!(peer = %peer.id, error = %e, "a peer's cluster views did not parse; it may know brokers that journals left that this broker does not");
                return;
            }
        };
        let learned = self.topology.learn(views);
        if learned > 0 {
            metrics::add(&self.metrics.cluster_views_learned, learned as u64);
            tracing::info!(peer = %peer.id, learned, "learned cluster views from a peer");
        }
    }

    /// Takes a peer's specs and deletions that are newer than this
    /// broker's.
    async fn adopt_newer(&self, peer: &str, entries: Vec<Listed>) {
        // Specs and tombstones are each taken in one change of the spec
        // store: one write of its file, however many a peer lists.
        let mut specs = Vec::new();
        let mut tombstones = Vec::new();
        for e in entries {
            if let Err(why) = crate::specs::check_revision(e.revision) {
                tracing::warn!(%peer, error = %why, "a peer listed a change no clock could have made; it is ignored");
                continue;
            }
            match (e.spec, e.deleted) {
                (Some(spec), None) => specs.push(crate::specs::Revised {
                    revision: e.revision,
                    spec,
                }),
                (None, Some(name)) => {
                    let ours = self.specs.get_revised(&name).map(|r| r.revision);
                    if ours.is_none_or(|r| r >= e.revision) {
                        // Not here, or created again after that deletion.
                        tombstones.push(crate::specs::Tombstone {
                            name,
                            revision: e.revision,
                        });
                        continue;
                    }
                    // The journal's own shard deletes it, files and all.
                    let owner = rotary_net::shard_of(&name, self.shards) as usize;
                    let payload = crate::conn::delete_payload(e.revision);
                    let res = crate::pipeline::unary(
                        self.endpoints[owner],
                        Op::DELETE,
                        rotary_net::wire::flag::LOCAL,
                        &rotary_net::wire::encode_name(&name),
                        &payload,
                        std::time::Duration::from_secs(5),
                    )
                    .await;
                    match res {
                        Ok((Status::OK, _, _)) => {
                            tracing::info!(%peer, journal = %name, "deleted a journal whose deletion this broker had missed")
                        }
                        other => {
                            tracing::warn!(%peer, journal = %name, outcome = ?other.map(|(s, _, _)| s), "deleting a journal whose deletion this broker had missed failed")
                        }
                    }
                }
                _ => {}
            }
        }
        if let Err(err) = self.specs.delete_each(tombstones) {
            tracing::warn!(%peer, error = %err, "recording a peer's deletions failed");
        }
        match self.specs.apply_each(specs) {
            Ok(adopted) if !adopted.is_empty() => {
                let shown = &adopted[..adopted.len().min(10)];
                tracing::info!(%peer, journals = ?shown, "adopted {} journal specs created or changed without this broker", adopted.len());
            }
            Ok(_) => {}
            Err(err) => {
                tracing::warn!(%peer, error = %err, "adopting a peer's journal specs failed")
            }
        }
    }

    /// Spawns the shard's background tasks: the flusher, the once-a-second
    /// ticker, the upload-result consumer and the first store listings.
    pub fn start_background(self: &Rc<Self>) {
        compio::runtime::spawn(self.clone().flusher()).detach();
        if !self.ack_poll.is_zero() {
            compio::runtime::spawn(self.clone().poll_for_acks()).detach();
        }
        let ticker = self.clone();
        compio::runtime::spawn(async move {
            loop {
                compio::time::sleep(std::time::Duration::from_secs(1)).await;
                ticker.tick().await;
            }
        })
        .detach();
        if let Some(rx) = self.upload_done_rx.borrow_mut().take() {
            compio::runtime::spawn(self.clone().upload_results(rx)).detach();
        }
        if let Some(h) = &self.hasher {
            let caught_up = h.caught_up();
            let me = self.clone();
            compio::runtime::spawn(async move {
                while caught_up.recv().await.is_ok() {
                    let parked = std::mem::take(&mut *me.hash_parked.borrow_mut());
                    for j in &parked {
                        me.mark_ready(j);
                    }
                }
            })
            .detach();
        }
        if self.index == 0 && !self.view().is_single() && self.topology.control().is_none() {
            compio::runtime::spawn(self.clone().catch_up_specs()).detach();
        }
        let journals: Vec<JournalRef> = self.journals.borrow().values().cloned().collect();
        for j in journals {
            let mut jm = j.borrow_mut();
            if jm.has_stores() {
                self.queue_uploads(&mut jm);
                drop(jm);
                self.refresh_listing(&j);
            }
        }
        self.recount_unuploaded();
    }

    /// Hands the journal's sealed, not yet uploaded fragments to the
    /// uploader. A full queue leaves them for the next tick.
    fn queue_uploads(&self, jm: &mut Journal) {
        let Some(store) = jm.spec.fragment.stores.first().cloned() else {
            return;
        };
        if matches!(self.role(&jm.spec), Role::Replica(_)) {
            // The primary uploads. So does a broker outside the route, for
            // fragments it still holds: the route's members may never have
            // had those bytes. (A fragment uploaded twice has the same name
            // and bytes both times.)
            return;
        }
        let codec = jm.spec.fragment.compression_codec;
        let name = jm.name.clone();
        for f in jm
            .fragments
            .iter_mut()
            .filter(|f| !f.uploaded && !f.uploading)
        {
            let job = UploadJob {
                journal: name.clone(),
                begin: f.begin,
                end: f.end,
                sha1: f.sha1,
                path: f.path.clone(),
                codec,
                store: store.clone(),
                done: self.upload_done.clone(),
            };
            if self.uploader.try_upload(job).is_err() {
                break;
            }
            self.uploads_in_flight
                .borrow_mut()
                .insert((name.clone(), f.begin, f.end, f.sha1));
            f.uploading = true;
        }
    }

    /// Applies upload outcomes reported by the uploader pool.
    async fn upload_results(self: Rc<Self>, rx: async_channel::Receiver<UploadDone>) {
        while let Ok(done) = rx.recv().await {
            self.uploads_in_flight.borrow_mut().remove(&(
                done.journal.clone(),
                done.begin,
                done.end,
                done.sha1,
            ));
            let Some(j) = self.journals.borrow().get(&done.journal).cloned() else {
                continue;
            };
            let mut jm = j.borrow_mut();
            // The SHA-1 tells a fragment from one of the same span of a
            // deleted journal of the same name, whose upload may end late.
            let Some(f) = jm
                .fragments
                .iter_mut()
                .find(|f| f.begin == done.begin && f.end == done.end && f.sha1 == done.sha1)
            else {
                continue;
            };
            f.uploading = false;
            match done.result {
                Ok(stored) => {
                    f.uploaded = true;
                    // A file found at start is then known to hold its
                    // bytes: its first read need not hash it again.
                    f.verified |= done.local_checked;
                    jm.insert_remote(stored);
                    *self.store_error.borrow_mut() = None;
                    if let Some(store) = jm.spec.fragment.stores.first() {
                        if self.shared_failures.worked(SharedWork::Upload, store) {
                            tracing::info!(store = %store, journal = %done.journal, "uploads succeed again");
                        }
                    }
                }
                Err(e) => {
                    // Only a local fragment that does not match its name is
                    // beyond retrying: store-side refusals (a bucket being
                    // recreated, a credential being fixed) may pass.
                    if !matches!(e, rotary_uploader::StoreError::LocalCorrupt { .. }) {
                        let store = jm.spec.fragment.stores.first().map_or("", |s| s.as_str());
                        match self.shared_failures.failed(SharedWork::Upload, store) {
                            Some(held) => {
                                tracing::warn!(store, journal = %done.journal, begin = done.begin, end = done.end, error = %e, since_last_logged = held, "upload failed; retrying, logged once a minute per store while it lasts");
                            }
                            None => {
                                tracing::debug!(journal = %done.journal, begin = done.begin, end = done.end, error = %e, "upload failed; will retry");
                            }
                        }
                    } else {
                        // Park it for an operator. It stays counted against
                        // the spool budget, so appends are eventually
                        // refused naming this error.
                        f.uploading = true;
                        if let rotary_uploader::StoreError::LocalCorrupt { why, .. } = &e {
                            f.corrupt = Some(why.clone());
                        }
                        tracing::error!(journal = %done.journal, begin = done.begin, end = done.end, error = %e, "upload failed permanently; not retrying, and its span is no longer read from this file");
                    }
                    *self.store_error.borrow_mut() = Some(e.to_string());
                }
            }
            drop(jm);
            // Both walk every journal: once per burst of results.
            if rx.is_empty() {
                self.recount_unuploaded();
                self.evict_cache();
            }
        }
    }

    /// Recomputes the sealed bytes awaiting upload.
    ///
    /// Runs over every journal of the shard, so it runs once a tick and
    /// once per burst of upload results, not per listing or per upload: a
    /// shard may hold tens of thousands of journals. Between two counts the
    /// figure only runs high (seals add to it at once), so the budget it
    /// guards is never overrun.
    fn recount_unuploaded(&self) {
        let mut total = 0;
        for j in self.journals.borrow().values() {
            let jm = j.borrow();
            if !jm.has_stores() {
                continue;
            }
            let waiting: u64 = jm
                .fragments
                .iter()
                .filter(|f| !f.uploaded)
                .map(|f| f.end - f.begin)
                .sum();
            // The route is worked out only for the few journals with
            // fragments awaiting upload.
            if waiting > 0 && self.is_primary(&jm.spec) {
                total += waiting;
            }
        }
        self.unuploaded_bytes.set(total);
    }

    /// Drops the oldest uploaded local fragments once the local copies of
    /// uploaded fragments exceed the cache budget.
    fn evict_cache(&self) {
        let mut cached: Vec<(SystemTime, u64, JournalRef, u64)> = Vec::new();
        let mut total = 0;
        for j in self.journals.borrow().values() {
            for f in j.borrow().fragments.iter().filter(|f| f.uploaded) {
                total += f.end - f.begin;
                cached.push((f.sealed_at, f.end - f.begin, j.clone(), f.begin));
            }
        }
        if total <= self.local_cache_bytes {
            return;
        }
        cached.sort_by_key(|c| c.0);
        for (_, len, j, begin) in cached {
            if total <= self.local_cache_bytes {
                break;
            }
            let mut jm = j.borrow_mut();
            if let Some(at) = jm
                .fragments
                .iter()
                .position(|f| f.begin == begin && f.uploaded)
            {
                let f = jm.fragments.remove(at);
                self.retire_fragment(&jm, f);
                total -= len;
            }
        }
    }

    /// Lists the journal's stores in the background and merges the result.
    ///
    /// At most [`LISTINGS_IN_FLIGHT_MAX`] listings of a shard run at once;
    /// the others wait in a queue, a journal not yet listed ahead of those
    /// listed before. A shard of tens of thousands of journals would
    /// otherwise start all their listings in the same tick (at start, and
    /// again every `refresh_interval`), and their results would hold up
    /// its appends for hundreds of milliseconds.
    fn refresh_listing(&self, j: &JournalRef) {
        self.start_listing(j, false);
    }

    /// Starts the first listing of a journal's stores at once, whatever
    /// the queue, because a request waits for it: after a start, a shard
    /// of tens of thousands of journals with stores lists them all, and an
    /// append to a journal near the end of that queue would otherwise wait
    /// for every listing ahead of it (tens of seconds on S3). Once per
    /// journal; a listing under way is left to end.
    pub fn hurry_first_listing(&self, j: &JournalRef) {
        {
            let mut jm = j.borrow_mut();
            if jm.index_loaded || jm.listing || jm.listing_hurried || !jm.has_stores() {
                return;
            }
            jm.listing_hurried = true;
        }
        metrics::add(&self.metrics.listings_hurried, 1);
        self.start_listing(j, true);
    }

    /// [`Shard::hurry_first_listing`] from where the journal is borrowed:
    /// on a task of its own, right after.
    /// Readies a journal once `wait` has passed (its rate admits more
    /// bytes then). The caller sets the journal's `rate_timer`, which keeps
    /// it to one timer at a time.
    fn ready_after(&self, j: &JournalRef, wait: std::time::Duration) {
        let me = self.me.borrow().clone();
        let j = j.clone();
        compio::runtime::spawn(async move {
            compio::time::sleep(wait).await;
            j.borrow_mut().rate_timer = false;
            if let Some(shard) = me.upgrade() {
                shard.mark_ready(&j);
            }
        })
        .detach();
    }

    fn hurry_first_listing_soon(&self, j: &JournalRef) {
        let me = self.me.borrow().clone();
        let j = j.clone();
        compio::runtime::spawn(async move {
            if let Some(shard) = me.upgrade() {
                shard.hurry_first_listing(&j);
            }
        })
        .detach();
    }

    fn start_listing(&self, j: &JournalRef, hurried: bool) {
        if !hurried && self.listings_in_flight.get() >= LISTINGS_IN_FLIGHT_MAX {
            let mut jm = j.borrow_mut();
            if !jm.listing && !jm.listing_queued && jm.has_stores() {
                jm.listing_queued = true;
                let mut waiting = self.listings_waiting.borrow_mut();
                if jm.index_loaded {
                    waiting.push_back(j.clone());
                } else {
                    waiting.push_front(j.clone());
                }
            }
            return;
        }
        let (stores, name) = {
            let mut jm = j.borrow_mut();
            jm.listing_queued = false;
            if jm.listing || !jm.has_stores() || jm.deleted {
                return;
            }
            // A journal deleted and created again lists its stores only once
            // the uploads of the deleted one have ended: listed before, the
            // new journal would start at 0 and an old fragment land beside
            // its own. Listed after, it holds the old history (appends
            // answer INDEX_HAS_GREATER_OFFSET until a reset-head).
            if !jm.index_loaded
                && self
                    .uploads_in_flight
                    .borrow()
                    .iter()
                    .any(|(n, begin, end, sha1)| {
                        *n == jm.name
                            && !jm
                                .fragments
                                .iter()
                                .any(|f| f.begin == *begin && f.end == *end && f.sha1 == *sha1)
                    })
            {
                return;
            }
            jm.listing = true;
            (jm.spec.fragment.stores.clone(), jm.name.clone())
        };
        self.listings_in_flight
            .set(self.listings_in_flight.get() + 1);
        metrics::add(&self.metrics.listings, 1);
        let mark = j.borrow().listing_mark();
        let uploader = self.uploader.clone();
        let j = j.clone();
        let me = self.me.borrow().clone();
        compio::runtime::spawn(async move {
            let mut all = Vec::new();
            let mut err = None;
            for store in &stores {
                match uploader.list(store, &name).await {
                    Ok(v) => all.extend(v),
                    Err(e) => {
                        err = Some((store, e.to_string()));
                        break;
                    }
                }
            }
            let shard = me.upgrade();
            if let Some(shard) = &shard {
                match &err {
                    None => {
                        for store in &stores {
                            if shard.shared_failures.worked(SharedWork::Listing, store) {
                                tracing::info!(store = %store, journal = %name, "listing the fragment store works again");
                            }
                        }
                    }
                    Some((store, e)) => {
                        match shard.shared_failures.failed(SharedWork::Listing, store) {
                            Some(held) => {
                                tracing::warn!(store = %store, journal = %name, error = %e, since_last_logged = held, "listing the fragment store failed; retrying, logged once a minute per store while it lasts");
                            }
                            None => {
                                tracing::debug!(journal = %name, error = %e, "listing the fragment store failed");
                            }
                        }
                    }
                }
            }
            {
                let mut jm = j.borrow_mut();
                jm.listing = false;
                jm.index_forgotten = false;
                jm.last_listing = Some(Instant::now());
                match err {
                    None => {
                        jm.set_listing(all, mark);
                        jm.index_loaded = true;
                        jm.index_error = None;
                    }
                    Some((_, e)) => {
                        jm.index_error = Some(e);
                        // Reads waiting for a first listing get its error.
                        jm.committed.notify(usize::MAX);
                    }
                }
            }
            if let Some(shard) = shard {
                let mut jm = j.borrow_mut();
                if !shard.is_primary(&jm.spec) {
                    // A replica's copies are dropped once the store holds them.
                    let (gone, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut jm.fragments)
                        .into_iter()
                        .partition(|f| f.uploaded);
                    jm.fragments = kept;
                    for f in gone {
                        shard.retire_fragment(&jm, f);
                    }
                }
                drop(jm);
                // Fragments the listing found uploaded leave the spool
                // budget's count at the next tick.
                // Appends waiting for the index go ahead (or are refused).
                shard.mark_ready(&j);
                shard.listings_in_flight.set(shard.listings_in_flight.get() - 1);
                loop {
                    let next = shard.listings_waiting.borrow_mut().pop_front();
                    let Some(next) = next else { break };
                    // Not queued any more: its listing was started
                    // meanwhile (hurried, or by the tick).
                    if std::mem::take(&mut next.borrow_mut().listing_queued) {
                        shard.refresh_listing(&next);
                    }
                    if shard.listings_in_flight.get() >= LISTINGS_IN_FLIGHT_MAX {
                        break;
                    }
                }
            }
        })
        .detach();
    }

    /// Asks the flusher to move the write head to the end of the index.
    pub fn request_reset_head(&self, j: &JournalRef, outbox: Rc<Outbox>, request_id: u64) {
        j.borrow_mut().reset_waiters.push((outbox, request_id));
        self.mark_ready(j);
    }

    /// Seals every open spool of journals with stores and waits, at most
    /// `timeout`, until every sealed fragment is in its store.
    pub async fn flush_to_stores(&self, timeout: std::time::Duration) -> bool {
        let journals: Vec<JournalRef> = self.journals.borrow().values().cloned().collect();
        for j in &journals {
            let wants = {
                let jm = j.borrow();
                jm.has_stores()
                    && self.is_primary(&jm.spec)
                    && jm.spool.as_ref().is_some_and(|s| !s.is_empty())
            };
            if wants {
                j.borrow_mut().seal_requested = true;
                self.mark_ready(j);
            }
        }
        let deadline = Instant::now() + timeout;
        loop {
            let pending = journals.iter().any(|j| {
                let jm = j.borrow();
                jm.has_stores()
                    && self.is_primary(&jm.spec)
                    && (jm.seal_requested || jm.fragments.iter().any(|f| !f.uploaded))
            });
            if !pending {
                return true;
            }
            if Instant::now() >= deadline {
                return false;
            }
            for j in &journals {
                let mut jm = j.borrow_mut();
                if jm.has_stores() {
                    self.queue_uploads(&mut jm);
                }
            }
            compio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
    }

    /// Deletes store fragments older than their journal's retention.
    pub async fn prune(
        &self,
        selector: &rotary_net::LabelSelector,
        dry_run: bool,
    ) -> Result<Vec<serde_json::Value>, String> {
        let now = SystemTime::now();
        // Every store is listed before anything is deleted, so that a
        // store that cannot be listed fails the prune, not half of it.
        let mut due = Vec::new();
        for spec in self.specs.all() {
            let retention = spec.fragment.retention;
            if !selector.matches(&spec.labels) || retention.is_zero() {
                continue;
            }
            for store in &spec.fragment.stores {
                let listed = self
                    .uploader
                    .list(store, &spec.name)
                    .await
                    .map_err(|e| format!("nothing was pruned: {e}"))?;
                for f in listed {
                    let age = now.duration_since(f.mod_time).unwrap_or_default();
                    if age > retention {
                        due.push((f, age));
                    }
                }
            }
        }
        let mut out = Vec::new();
        for (f, age) in due {
            if !dry_run {
                if let Err(e) = self.uploader.delete(&f).await {
                    let keys: Vec<String> = out
                        .iter()
                        .map(|v: &serde_json::Value| {
                            let text = |k: &str| v[k].as_str().unwrap_or_default().to_string();
                            text("store") + &text("key")
                        })
                        .collect();
                    return Err(format!(
                        "{e}; {} fragment(s) were pruned before it: [{}]",
                        keys.len(),
                        keys.join(", ")
                    ));
                }
                // Reads of this shard's journals go around it at once; other
                // shards find it gone when they next list or read it.
                if let Some(j) = self.journals.borrow().get(&f.journal) {
                    j.borrow_mut().drop_remote(&f, false);
                }
            }
            out.push(serde_json::json!({
                "journal": f.journal,
                "begin": f.begin,
                "end": f.end,
                "sha1": hex::encode(f.sha1),
                "store": f.store,
                "key": f.key,
                "age_secs": age.as_secs(),
            }));
        }
        Ok(out)
    }

    /// Enqueues an append; the flusher picks it up.
    pub fn submit_append(&self, j: &JournalRef, op: Rc<crate::journal::AppendOp>) {
        j.borrow_mut().queue.push_back(op);
        self.mark_ready(j);
    }

    /// Deletes a journal owned by this shard: its spec, its queued appends,
    /// its local files. Returns false if it did not exist.
    pub fn delete_journal(&self, name: &str, revision: u64) -> Result<bool, crate::EngineError> {
        let existed = match self.specs.delete_at(name, revision)? {
            crate::specs::Deleted::Removed => true,
            crate::specs::Deleted::Absent => false,
            // Created again after this deletion: nothing to do.
            crate::specs::Deleted::KeptNewer => return Ok(false),
        };
        if let Some(j) = self.journals.borrow_mut().remove(name) {
            let mut j = j.borrow_mut();
            j.deleted = true;
            let reply = AppendReply::default();
            for op in j.queue.drain(..) {
                op.reply_error(Status::JOURNAL_NOT_FOUND, &reply, "journal was deleted");
            }
            if let Some(a) = j.active.take() {
                a.op.reply_error(Status::JOURNAL_NOT_FOUND, &reply, "journal was deleted");
            }
            j.committed.notify(usize::MAX);
            let root = self.dir.join("journals").join(name);
            // Renamed first, so that a journal of the same name can be
            // created again at once; the reaper deletes the rest.
            let trash = trash_dir(&self.dir);
            match std::fs::rename(root.join("@"), &trash) {
                Ok(()) => crate::reaper::remove_dir_all(trash),
                // Not renamed: removed here, before the name can be reused.
                Err(_) => {
                    let _ = std::fs::remove_dir_all(root.join("@"));
                }
            }
            // Parent directories of other journals stay.
            let _ = std::fs::remove_dir(&root);
        }
        self.states.borrow_mut().remove(name);
        if let Some(log) = self.log.borrow_mut().as_mut() {
            log.record_delete(name);
        }
        self.wake.notify(1);
        Ok(existed)
    }

    /// Asks the flusher to seal a journal's spool and reply on `outbox`.
    pub fn request_seal(&self, j: &JournalRef, outbox: Rc<Outbox>, request_id: u64) {
        {
            let mut jm = j.borrow_mut();
            jm.seal_requested = true;
            jm.seal_waiters.push((outbox, request_id));
        }
        self.mark_ready(j);
    }

    /// Seals due spools and times out idle streamed appends. Runs every second.
    pub async fn tick(self: &Rc<Self>) {
        let now = SystemTime::now();
        self.check_spares();
        self.take_spec_changes();
        // After a change of the cluster file, a journal that this broker
        // became the primary of is taken over now (its bytes copied from
        // the brokers it left, while they still run) rather than at its
        // first request, however long that is in coming. Not at a start:
        // journals are taken over then at their first request, as before.
        let current = self.view();
        let before = std::mem::replace(&mut *self.tick_view.borrow_mut(), current.clone());
        let changed = !Arc::ptr_eq(&before, &current);
        let journals: Vec<JournalRef> = self.journals.borrow().values().cloned().collect();
        let mut takeovers = 0;
        for j in journals {
            let mut due = false;
            if changed {
                let mut jm = j.borrow_mut();
                let was_primary = before
                    .route(&jm.spec.name, jm.spec.replication)
                    .is_primary(&current.me);
                jm.route_check |= !was_primary;
            }
            // Working out a route costs more than the rest of a quiet
            // journal's tick: it is needed only for a journal holding bytes,
            // with replicas to pulse, or whose route may have changed, of
            // tens of thousands on a shard.
            let holds_bytes = j.borrow().spool.as_ref().is_some_and(|s| !s.is_empty());
            // At most so many takeovers begin in a tick; the other
            // journals keep their check for the next.
            let check = j.borrow().route_check && takeovers < TICK_TAKEOVERS_MAX;
            let role = {
                let jm = j.borrow();
                (holds_bytes || jm.spec.replication > 1 || check).then(|| self.role(&jm.spec))
            };
            if check {
                match &role {
                    // Checked again each tick until it is settled.
                    Some(Role::Primary(route))
                        if route.is_complete() && self.takeover_due(&j, route) =>
                    {
                        takeovers += 1;
                        due = true
                    }
                    _ => j.borrow_mut().route_check = false,
                }
            }
            {
                let jm = j.borrow();
                match &role {
                    Some(Role::Primary(_)) if jm.wants_seal(now) && holds_bytes => due = true,
                    // A journal routed away from this broker: its open spool
                    // is sealed and uploaded (see `prepare`).
                    Some(Role::Outside(_)) if holds_bytes => due = true,
                    _ => {}
                }
                if let Some(a) = &jm.active {
                    // Bytes that arrived and wait (for the rate, or for
                    // room) are no client's idleness.
                    if a.op.last_activity.get().elapsed() > APPEND_IDLE_TIMEOUT
                        && !a.op.complete.get()
                        && a.op.chunks.borrow().is_empty()
                    {
                        a.op.aborted.set(Some(AbortReason::Timeout));
                        due = true;
                    } else if a.holds_up(
                        jm.queue
                            .iter()
                            .find(|w| !Rc::ptr_eq(w, &a.op))
                            .map(|w| &**w),
                        jm.rate.rate(),
                    ) {
                        a.op.aborted.set(Some(AbortReason::TooSlow));
                        due = true;
                    }
                }
            }
            if due {
                self.mark_ready(&j);
            }
            if let Some(Role::Primary(route)) = &role {
                self.pulse(&j, route, false);
            }
            let refresh = {
                let mut jm = j.borrow_mut();
                if jm.has_stores() {
                    self.queue_uploads(&mut jm);
                    let every = jm.spec.fragment.refresh_interval;
                    !jm.listing
                        && jm.last_listing.is_none_or(|t| {
                            t.elapsed() >= every
                                || (!jm.index_loaded
                                    && !jm.index_forgotten
                                    && t.elapsed() >= std::time::Duration::from_secs(1))
                        })
                } else {
                    false
                }
            };
            if refresh {
                let outside = match &role {
                    Some(role) => matches!(role, Role::Outside(_)),
                    None => matches!(self.role(&j.borrow().spec), Role::Outside(_)),
                };
                if outside && j.borrow_mut().forget_index() {
                    metrics::add(&self.metrics.listings_spared, 1);
                } else {
                    self.refresh_listing(&j);
                }
            }
        }
        self.recount_unuploaded();
    }

    /// Sends an empty append through an idle replicated journal, so that a
    /// broken replica is found (and the journal re-synchronized once it is
    /// back) without waiting for client traffic.
    /// `now` sends it without waiting for the journal to be idle a while
    /// (a read waits for the first SYNC).
    fn pulse(&self, j: &JournalRef, route: &Route, now: bool) {
        {
            let mut jm = j.borrow_mut();
            let idle = jm.queue.is_empty()
                && jm.active.is_none()
                && jm.inflight == 0
                && !jm.syncing
                && (now || jm.last_append.elapsed() >= PULSE_IDLE);
            if route.members.len() < 2 || !route.is_complete() || !idle || jm.deleted {
                return;
            }
            jm.last_append = Instant::now();
        }
        let outbox = Rc::new(Outbox::new());
        outbox.close();
        let op = Rc::new(crate::journal::AppendOp {
            request_id: 0,
            outbox,
            req: rotary_net::wire::AppendRequest {
                journal: j.borrow().name.clone(),
                ..Default::default()
            },
            chunks: RefCell::new(Default::default()),
            complete: Cell::new(true),
            aborted: Cell::new(None),
            finished: Cell::new(false),
            last_activity: Cell::new(Instant::now()),
            budget: Rc::new(crate::conn::Budget::default()),
            replica: None,
        });
        self.submit_append(j, op);
    }

    pub fn is_shutting_down(&self) -> bool {
        self.shutting_down.get()
    }

    /// Registers a connection's outbox (see [`Shard::answers_sent`]).
    pub fn add_outbox(&self, outbox: &Rc<Outbox>) {
        let mut all = self.outboxes.borrow_mut();
        if all.len() == all.capacity() {
            all.retain(|o| o.strong_count() > 0);
        }
        all.push(Rc::downgrade(outbox));
    }

    /// Begins a clean stop: appends arriving from now on are refused,
    /// appends still streaming their content are rolled back and answered
    /// `SHUTTING_DOWN`, and reads end with `SHUTTING_DOWN` at the offset
    /// they reached, so that clients know what happened rather than see
    /// their connection break. Appends whose content is whole commit as
    /// usual ([`Shard::drained`] waits for them).
    pub fn begin_shutdown(&self) {
        self.shutting_down.set(true);
        let journals: Vec<JournalRef> = self.journals.borrow().values().cloned().collect();
        for j in journals {
            let mut streaming = false;
            {
                let jm = j.borrow();
                for op in jm.queue.iter().chain(jm.active.as_ref().map(|a| &a.op)) {
                    if op.replica.is_none() && !op.complete.get() && op.aborted.get().is_none() {
                        op.aborted.set(Some(AbortReason::ShuttingDown));
                        streaming = true;
                    }
                }
            }
            if streaming {
                self.mark_ready(&j);
            }
        }
        self.stopping.notify(usize::MAX);
    }

    /// Waits, up to `limit`, until every connection has written out what
    /// it was given to send.
    pub async fn answers_sent(&self, limit: std::time::Duration) {
        let deadline = Instant::now() + limit;
        // Reads woken by the stop answer in their next step.
        yield_now().await;
        while Instant::now() < deadline {
            let pending = self
                .outboxes
                .borrow()
                .iter()
                .filter_map(|o| o.upgrade())
                .any(|o| !o.is_closed() && (o.backlog() > 0 || o.promised() > 0));
            if !pending {
                return;
            }
            compio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    }

    /// Waits until the flusher has nothing queued and is not mid-turn.
    pub async fn drained(&self) {
        loop {
            let l = self.idle.listen();
            if !self.busy.get() && self.ready.borrow().is_empty() {
                return;
            }
            l.await;
        }
    }

    /// The flusher loop. Never returns.
    pub async fn flusher(self: Rc<Self>) {
        loop {
            let l = self.wake.listen();
            let has_log_records = self.log.borrow().as_ref().is_some_and(|l| l.has_pending());
            if self.ready.borrow().is_empty() && !has_log_records {
                self.idle.notify(usize::MAX);
                l.await;
                continue;
            }
            drop(l);
            self.busy.set(true);
            self.turn().await;
            self.busy.set(false);
        }
    }

    async fn turn(self: &Rc<Self>) {
        let started = Instant::now();
        let mut ready = std::mem::take(&mut *self.ready.borrow_mut());
        // Dedup by identity, keeping first-come order.
        let mut seen = std::collections::HashSet::new();
        ready.retain(|j| seen.insert(Rc::as_ptr(j)));
        ready.retain(|j| !j.borrow().deleted);

        // 1. Prepare, every journal at once: seals, new spools and tail
        // loads are file operations that wait on the kernel, and journals
        // sealing at the same flush-interval boundary would otherwise wait
        // for each other's.
        join_all(ready.iter().map(|j| self.prepare(j))).await;
        let prepared = Instant::now();
        // 2. Stage.
        let mut again = Vec::new();
        for j in &ready {
            if self.stage(j) {
                again.push(j.clone());
            }
        }
        let staged_at = Instant::now();
        // 3. Write every spool with staged bytes and this batch's commit-log
        // records, all at the same time; `fsync` spools and the log are
        // fdatasync'ed after their writes. A record can thus reach the disk
        // without its spool bytes; recovery checks each journal's last record
        // against the spool's SHA-1 and falls back to the record before it.
        let committing: Vec<JournalRef> = ready
            .iter()
            .filter(|j| !j.borrow().staged.is_empty())
            .cloned()
            .collect();
        let early = self.record_commits(&committing);
        let mut writing = Vec::new();
        for j in &ready {
            let mut jm = j.borrow_mut();
            let fsync = jm.spec.durability == Durability::Fsync && !jm.staged.is_empty();
            let Some(spool) = jm.spool.as_mut() else {
                continue;
            };
            let file = spool.file().clone();
            let w = spool.take_write();
            if w.is_some() || fsync {
                writing.push((j.clone(), w, file, fsync));
            }
        }
        let any_fsync = writing.iter().any(|(_, _, _, fsync)| *fsync);
        let wrote = writing.iter().any(|(_, w, _, _)| w.is_some());
        let in_flight: Vec<JournalRef> = writing
            .iter()
            .filter(|(_, w, _, _)| w.is_some())
            .map(|(j, _, _, _)| j.clone())
            .collect();
        // The log's records go first, into the page cache. Batches whose
        // records carry their bytes (or whose bytes are already on disk)
        // are answered now; their replies and proposals are sent before
        // the spool writes are submitted.
        let log_written = self.write_log();
        // Without their records nothing is answered early; the batch fails.
        let early = if log_written.is_ok() {
            early
        } else {
            Vec::new()
        };
        let is_early = |j: &JournalRef| early.iter().any(|x| Rc::ptr_eq(x, j));
        let mut early_waits = HashMap::new();
        for j in &early {
            if let Some(waits) = self.answer_early(j) {
                early_waits.insert(Rc::as_ptr(j), waits);
            }
        }
        // Replicas get this turn's content (and early proposals, in the
        // same send) while the spools are written.
        self.flush_pipelines();
        if !early.is_empty() {
            yield_now().await;
        }
        let spool_writes = join_all(writing.into_iter().map(|(j, w, file, fsync)| async move {
            let mut res = Ok(());
            let w = match w {
                Some(w) => {
                    let (r, w) = w.run(&file).await;
                    res = r;
                    Some(w)
                }
                None => None,
            };
            let synced = if res.is_ok() && fsync {
                Some(file.sync_data().await)
            } else {
                None
            };
            (j, res, w, synced)
        }));
        let log_sync = async {
            if !any_fsync || log_written.is_err() {
                return log_written;
            }
            // The log is taken out for the sync so no borrow spans the await.
            let mut log = self.log.borrow_mut().take().expect("commit log present");
            let res = log.flush(true).await;
            *self.log.borrow_mut() = Some(log);
            res
        };
        // The next batch of the journals being written is staged while
        // they are: hashing it and waiting on the disk overlap.
        let mut held = Vec::new();
        let (results, log_result) = self
            .stage_while(&in_flight, &mut held, async {
                futures_util::join!(spool_writes, log_sync)
            })
            .await;
        for h in &mut held {
            h.swap_back();
        }
        let written = Instant::now();
        // A failed batch fails the one staged after it too.
        let fail_batch = |j: &JournalRef, status: Status, msg: &str, held: &mut Vec<Held>| {
            if let Some(i) = held.iter().position(|h| Rc::ptr_eq(&h.j, j)) {
                let h = held.swap_remove(i);
                j.borrow_mut().staged.extend(h.other);
            }
            self.fail_batch(j, status, msg);
        };
        let mut failed: Vec<(JournalRef, Status, String)> = Vec::new();
        for (j, res, w, synced) in results {
            let path = j
                .borrow()
                .spool
                .as_ref()
                .map(|s| s.path().to_path_buf())
                .unwrap_or_default();
            if let Some(w) = w {
                metrics::add(&self.metrics.batch_write_bytes, w.bytes() as u64);
                j.borrow_mut()
                    .spool
                    .as_mut()
                    .expect("spool written")
                    .write_done(w, res.is_ok());
            }
            if synced.is_some() {
                metrics::add(&self.metrics.fsyncs, 1);
            }
            if let Err(e) = res.and(synced.unwrap_or(Ok(()))) {
                let e = StorageError::io(&path, e);
                if is_early(&j) {
                    // Answered already: the bytes are in the commit log
                    // only, and the spool cannot take them. Recovery writes
                    // them from the log into the spool.
                    tracing::error!(error = %e, "spool write of an answered batch failed; stopping so recovery restores it from the commit log");
                    std::process::abort();
                }
                failed.push((j, storage_status(&e), e.to_string()));
            }
        }
        if wrote {
            metrics::add(&self.metrics.batches, 1);
        }
        for (j, status, msg) in &failed {
            fail_batch(j, *status, msg, &mut held);
        }
        if let Err(e) = &log_result {
            if let Some(held) = self.log_write_failed.due() {
                tracing::error!(error = %e, since_last_logged = held, "commit log write failed; failing the batch (logged once a minute while it lasts)");
            }
            let status = storage_status(e);
            for j in &committing {
                // Batches answered early had their records written; only
                // the fdatasync for `fsync` journals failed.
                if !j.borrow().staged.is_empty() && !is_early(j) {
                    fail_batch(j, status, &e.to_string(), &mut held);
                }
            }
        }
        // Journals that failed may have a record in the log naming bytes
        // that are not on disk: the log restates what they hold.
        for j in &committing {
            if j.borrow().staged.is_empty() {
                self.restate(j);
            }
        }
        let committing: Vec<JournalRef> = committing
            .into_iter()
            .filter(|j| !j.borrow().staged.is_empty())
            .collect();
        // 6. Acknowledge, or propose to the replicas and let the acker
        // acknowledge once every replica has.
        for j in &committing {
            let (staged_with_replicas, repl_now) = {
                let jm = j.borrow();
                (jm.staged_with_replicas, jm.repl.is_some())
            };
            if !staged_with_replicas {
                if is_early(j) {
                    // Answered and counted when its record was written.
                    let staged = self.commit_local(j);
                    self.publish_counted(j, staged, None);
                } else {
                    self.acknowledge(j);
                }
                continue;
            }
            if !repl_now {
                // The pipelines broke while this batch was written: it
                // is committed here, but no replica will confirm it.
                let staged = self.commit_local(j);
                let f = Failure::new(
                    Status::REPLICATION_FAILED,
                    "the replication pipeline broke before the append was proposed",
                );
                self.publish(j, staged, Some(&f));
                continue;
            }
            // Proposed already if the batch was answered from the log.
            let early = early_waits.remove(&Rc::as_ptr(j));
            let staged = self.commit_local(j);
            let mut jm = j.borrow_mut();
            let waits = early.unwrap_or_else(|| propose(&jm, &staged));
            jm.inflight += 1;
            jm.proposed.push_back(InFlight { staged, waits });
            let start_acker = !std::mem::replace(&mut jm.acking, true);
            drop(jm);
            self.proposals.set(self.proposals.get() + 1);
            self.proposed.notify(usize::MAX);
            if start_acker {
                self.awaiting_acks.set(self.awaiting_acks.get() + 1);
                compio::runtime::spawn(self.clone().acker(j.clone())).detach();
            }
        }
        self.flush_pipelines();
        // What was staged during the writes is the next turn's batch.
        for h in held {
            h.j.borrow_mut().staged.extend(h.other);
            h.j.borrow_mut().staged_with_replicas = h.other_with_replicas;
            again.push(h.j);
        }
        let acked = Instant::now();
        // Compaction between turns keeps the log short. Its snapshot is
        // written and synced in the background while turns go on; only
        // the switch to the new file happens here.
        let (begin, finish) = self.log.borrow().as_ref().map_or((false, false), |l| {
            let idle = !l.has_pending();
            (idle && l.needs_compaction(), idle && l.compaction_ready())
        });
        if begin {
            let states = self.states.borrow();
            if let Some(log) = self.log.borrow_mut().as_mut() {
                log.begin_compaction(states.iter().map(|(k, v)| (k.as_str(), v)));
            }
        } else if finish {
            let mut log = self.log.borrow_mut().take().expect("commit log present");
            match log.finish_compaction().await {
                // The old log's blocks are freed at its last close: the
                // reaper's, not this thread's (with `discard`, 13-22 ms for
                // 64 MiB on the test machine).
                Ok(old) => crate::reaper::close_later(old.into_iter().collect()),
                Err(e) => {
                    if let Some(held) = self.log_compaction_failed.due() {
                        tracing::error!(error = %e, since_last_logged = held, "commit log compaction failed (logged once a minute while it lasts)");
                    }
                }
            }
            *self.log.borrow_mut() = Some(log);
        }
        if started.elapsed() >= SLOW_TURN {
            let ms = |from: Instant, to: Instant| format!("{:.1}", (to - from).as_secs_f64() * 1e3);
            tracing::warn!(
                journals = ready.len(),
                prepare_ms = %ms(started, prepared),
                stage_ms = %ms(prepared, staged_at),
                write_ms = %ms(staged_at, written),
                ack_ms = %ms(written, acked),
                compact_ms = %ms(acked, Instant::now()),
                "slow turn: the shard's appends waited this long"
            );
        }
        // Replica journals with a SYNC waiting go around again once their
        // queued appends are through.
        for j in &ready {
            if !j.borrow().sync_waiters.is_empty() {
                again.push(j.clone());
            }
        }
        // Journals with more to do go around again, after other tasks
        // (readers, the acker, connections) had a turn.
        if !again.is_empty() {
            yield_now().await;
        }
        for j in again {
            self.ready.borrow_mut().push(j);
        }
    }

    /// Runs `work` (a turn's writes), staging meanwhile what arrives for
    /// `journals` (those being written) into their spools' second buffers.
    /// A journal's batch being written is set aside in `held` the first
    /// time, so that `staged` collects the next batch.
    async fn stage_while<T>(
        &self,
        journals: &[JournalRef],
        held: &mut Vec<Held>,
        work: impl std::future::Future<Output = T>,
    ) -> T {
        if journals.is_empty() {
            return work.await;
        }
        let mut work = std::pin::pin!(work);
        // Submit the writes first: poll them once and let the runtime hand
        // them to the kernel.
        if let std::task::Poll::Ready(out) = futures_util::poll!(work.as_mut()) {
            return out;
        }
        yield_now().await;
        loop {
            let wake = self.wake.listen();
            let mut staged = false;
            for j in journals {
                let has_bytes = {
                    let jm = j.borrow();
                    !jm.deleted
                        && jm.spool.as_ref().is_some_and(|s| s.room() > 0)
                        && jm
                            .active
                            .as_ref()
                            .map(|a| &a.op)
                            .or(jm.queue.front())
                            .is_some_and(|op| !op.chunks.borrow().is_empty())
                };
                if !has_bytes {
                    continue;
                }
                if !held.iter().any(|h| Rc::ptr_eq(&h.j, j)) {
                    let mut jm = j.borrow_mut();
                    held.push(Held {
                        j: j.clone(),
                        other: std::mem::take(&mut jm.staged),
                        other_with_replicas: jm.staged_with_replicas,
                    });
                }
                let before = j.borrow().spool.as_ref().map_or(0, |s| s.staged());
                self.stage_queue(j);
                let after = j.borrow().spool.as_ref().map_or(0, |s| s.staged());
                metrics::add(&self.metrics.prestaged_bytes, after.saturating_sub(before));
                staged = true;
            }
            if staged {
                self.flush_pipelines();
            }
            match futures_util::future::select(work.as_mut(), wake).await {
                futures_util::future::Either::Left((out, _)) => return out,
                futures_util::future::Either::Right(_) => {}
            }
        }
    }

    /// Adds a commit-log record for each journal's staged appends (none
    /// for a batch of pulses, which change nothing the log holds). Returns
    /// the journals whose batch can be answered once the log is written:
    /// `replicated` ones whose new bytes are few enough for the record to
    /// carry them (or are on disk already).
    fn record_commits(&self, committing: &[JournalRef]) -> Vec<JournalRef> {
        let mut log = self.log.borrow_mut();
        let log = log.as_mut().expect("commit log present");
        let mut states = self.states.borrow_mut();
        let mut early = Vec::new();
        let new_bytes: u64 = committing
            .iter()
            .map(|j| {
                let jm = j.borrow();
                let end = jm.staged.last().expect("non-empty").end;
                end.saturating_sub(jm.spool.as_ref().expect("spool").written())
            })
            .sum();
        let carry_max = if new_bytes <= INLINE_TURN_BYTES_MAX {
            INLINE_BYTES_MAX
        } else {
            0
        };
        for j in committing {
            let jm = j.borrow();
            let last = jm.staged.last().expect("non-empty");
            let spool = jm.spool.as_ref().expect("spool");
            if last.end == spool.committed() && last.registers == jm.local_registers {
                continue;
            }
            let st = JournalState {
                spool_begin: spool.begin(),
                end: last.end,
                sha1: last.point.sha.clone().finalize(),
                registers: last.registers.clone(),
                mid: Some(spool.committed_midstate()),
            };
            let from = spool.written();
            let carried = (jm.spec.durability == Durability::Replicated)
                .then(|| match last.end.checked_sub(from) {
                    None | Some(0) => Some(None),
                    Some(n) if n <= carry_max => {
                        spool.staged_since(from).map(|b| Some(&b[..n as usize]))
                    }
                    Some(_) => None,
                })
                .flatten();
            match carried {
                Some(Some(bytes)) => log.record_commit_inline(&jm.name, &st, from, bytes),
                _ => log.record_commit(&jm.name, &st),
            }
            if carried.is_some() {
                early.push(j.clone());
            }
            states.insert(jm.name.clone(), st);
        }
        early
    }

    /// Writes the log's pending records into the page cache. A failed
    /// write leaves none pending: the batch fails.
    fn write_log(&self) -> Result<(), StorageError> {
        let mut log = self.log.borrow_mut();
        let log = log.as_mut().expect("commit log present");
        let res = log.write_pending();
        if res.is_err() {
            log.discard_pending();
        }
        res
    }

    /// Answers a batch whose commit record is written while its spool
    /// write has yet to complete (the record carries the bytes, or they
    /// are on disk). A replica's appends are acknowledged to the primary;
    /// a client's get their replies; a primary's are proposed to its
    /// replicas, and the waits for their acks are returned.
    fn answer_early(&self, j: &JournalRef) -> Option<Vec<Wait>> {
        let mut jm = j.borrow_mut();
        let last = jm.staged.last().expect("non-empty").end;
        if jm.staged_with_replicas {
            return jm.repl.is_some().then(|| propose(&jm, &jm.staged));
        }
        self.count_appends(&jm.staged, false);
        jm.staged.iter().for_each(answer_ok);
        jm.answered = jm.answered.max(last);
        None
    }

    /// Adds a commit-log record of what a journal's spool holds committed,
    /// after a batch of it failed: the log may hold a record of that batch
    /// (written at the same time as its spool bytes), and the in-memory
    /// state must not run ahead of the spool.
    fn restate(&self, j: &JournalRef) {
        let jm = j.borrow();
        let Some(spool) = &jm.spool else { return };
        let st = JournalState {
            spool_begin: spool.begin(),
            end: spool.committed(),
            sha1: spool.committed_sha1(),
            registers: jm.local_registers.clone(),
            mid: Some(spool.committed_midstate()),
        };
        if let Some(log) = self.log.borrow_mut().as_mut() {
            log.record_commit(&jm.name, &st);
        }
        self.states.borrow_mut().insert(jm.name.clone(), st);
    }

    /// Async preparation of a journal before staging: handle an aborted
    /// active append, reload a tail block, seal, open a spool.
    async fn prepare(&self, j: &JournalRef) {
        // A SYNC from the primary ends any append it left open. A broker
        // no longer a replica of the journal (the route changed) drops all
        // the appends of its old primary not yet committed here, whole or
        // not: their bytes must not stay in a spool it is about to seal or
        // append to as the primary. Either way the primary that sent them
        // hears so at once, unless it rolled them back itself (or gave
        // them up by synchronizing again on their connection).
        {
            let mut jm = j.borrow_mut();
            let replica_ops = !jm.awaiting.is_empty()
                || jm.active.as_ref().is_some_and(|a| a.op.replica.is_some());
            let left = replica_ops && !matches!(self.role(&jm.spec), Role::Replica(_));
            if left {
                // Whatever the old primary sends next is refused until a
                // primary synchronizes the journal again.
                if let Some(t) = jm.replica.as_mut() {
                    t.diverged();
                }
            }
            if !jm.sync_waiters.is_empty() || left {
                let open = jm
                    .queue
                    .iter()
                    .chain(jm.active.as_ref().map(|a| &a.op))
                    .chain(jm.awaiting.iter().map(|w| &w.op))
                    .filter(|op| op.replica.is_some() && (left || !op.complete.get()));
                for op in open {
                    if op.aborted.get().is_none() {
                        op.aborted.set(Some(AbortReason::Superseded));
                    }
                }
            }
        }
        // A replica append rolled back by its primary (or whose connection
        // closed) drops it and everything staged after it.
        {
            let mut jm = j.borrow_mut();
            let jm = &mut *jm;
            if let Some(i) = jm
                .awaiting
                .iter()
                .position(|w| w.op.aborted.get().is_some())
            {
                let start = jm.awaiting[i].start.clone();
                let r = AppendReply {
                    write_head: jm.head,
                    ..Default::default()
                };
                for w in jm.awaiting.drain(i..) {
                    w.op.end_aborted(&r);
                }
                if let Some(a) = jm.active.take() {
                    a.op.end_aborted(&r);
                    drop_budget(&a.op);
                    jm.queue.pop_front();
                }
                jm.tail.truncate(start.offset);
                jm.staged_head = start.offset;
                if let Some(spool) = jm.spool.as_mut() {
                    spool.rewind(start);
                }
            }
        }
        // An aborted active append rewinds the spool to where it began.
        {
            let mut jm = j.borrow_mut();
            let aborted = jm
                .active
                .as_ref()
                .is_some_and(|a| a.op.aborted.get().is_some());
            if aborted {
                let a = abandon_active(&mut jm).expect("checked");
                let reply = AppendReply {
                    write_head: jm.head,
                    registers: jm.registers.clone(),
                    ..Default::default()
                };
                a.op.end_aborted(&reply);
                drop_budget(&a.op);
                metrics::add(&self.metrics.append_failures, 1);
            }
        }
        let role = self.role(&j.borrow().spec);
        let takeover = match &role {
            Role::Primary(route) => self.takeover_due(j, route),
            _ => false,
        };
        match &role {
            Role::Primary(route) if !route.is_complete() => {
                let msg = format!(
                    "the journal's replication is {} but the cluster has {} broker(s) for it",
                    route.replication,
                    route.members.len()
                );
                self.fail_queue(j, Status::INSUFFICIENT_JOURNAL_BROKERS, &msg);
                return;
            }
            Role::Primary(route) if route.members.len() > 1 || takeover => {
                // Synchronized in this very view: after any change of the
                // cluster file the journal may have had another primary
                // meanwhile (a route that went away and came back is the
                // same list of members), so the replicas are asked again.
                let version = self.topology.version();
                let ready = !takeover
                    && j.borrow().repl.as_ref().is_some_and(|r| {
                        r.members == route.ids() && r.version == version && r.is_live()
                    });
                if !ready {
                    self.begin_sync(j, route.clone()).await;
                    return;
                }
            }
            Role::Primary(_) => j.borrow_mut().repl = None,
            Role::Replica(_) | Role::Outside(_) => {
                // No longer the primary: what it synchronized as one is
                // stale (its batches in flight keep their own pipelines).
                j.borrow_mut().repl = None;
            }
        }
        self.apply_syncs(j).await;
        let needs_tail = j
            .borrow()
            .spool
            .as_ref()
            .is_some_and(|s| !s.can_stage() && !s.write_in_flight());
        if needs_tail {
            let mut spool = j.borrow_mut().spool.take().expect("checked");
            j.borrow_mut().spool_out = true;
            let res = spool.load_tail().await;
            {
                let mut jm = j.borrow_mut();
                jm.spool = Some(spool);
                jm.spool_back();
            }
            if let Err(e) = res {
                tracing::error!(journal = %j.borrow().name, error = %e, "reloading spool tail failed");
                self.fail_queue(j, storage_status(&e), &e.to_string());
                return;
            }
        }
        let reset = {
            let jm = j.borrow();
            !jm.reset_waiters.is_empty() && jm.active.is_none() && jm.staged.is_empty()
        };
        if reset {
            self.reset_head(j).await;
        }
        let wants_seal = {
            let jm = j.borrow();
            let idle = jm.active.is_none() && jm.staged.is_empty() && jm.inflight == 0;
            // Replicas seal when their primary says so (SYNC), and a
            // primary not while replicas have yet to ack. A broker the
            // journal was routed away from seals what it holds, so that it
            // can be uploaded: the new members may never have had it.
            idle && match role {
                Role::Primary(_) => jm.wants_seal(SystemTime::now()),
                Role::Outside(_) => jm.spool.as_ref().is_some_and(|s| !s.is_empty()),
                Role::Replica(_) => false,
            }
        };
        if wants_seal {
            self.seal(j).await;
        }
        let needs_spool = {
            let jm = j.borrow();
            jm.spool.is_none() && !jm.queue.is_empty()
        };
        if needs_spool {
            let (dir, head, length) = {
                let jm = j.borrow();
                (jm.dir.clone(), jm.local_head, jm.spec.fragment.length)
            };
            let created = match std::fs::create_dir_all(&dir) {
                Ok(()) => self.create_spool(&dir, head, length).await,
                Err(e) => Err(StorageError::io(&dir, e)),
            };
            match created {
                Ok(spool) => j.borrow_mut().spool = Some(spool),
                Err(e) => {
                    if e.is_full() {
                        metrics::add(&self.metrics.storage_full, 1);
                    }
                    self.fail_queue(j, storage_status(&e), &e.to_string());
                }
            }
        }
    }

    /// A new spool at `head`: in a spare file if one fits the journal's
    /// fragment length, else a new file.
    async fn create_spool(
        &self,
        dir: &std::path::Path,
        head: u64,
        fragment_length: u64,
    ) -> Result<Spool, StorageError> {
        let max_len = fragment_length.saturating_add(self.sizing.grow_bytes);
        let spare = self.spares.borrow_mut().take(max_len);
        if let Some(spare) = spare {
            match Spool::create_recycled(&spare, dir, head, self.sizing).await {
                Ok(spool) => {
                    metrics::add(&self.metrics.spools_recycled, 1);
                    return Ok(spool);
                }
                Err(e) => {
                    tracing::warn!(spare = %spare.display(), error = %e, "cannot begin a spool in a spare file; creating one");
                }
            }
        }
        Spool::create_sized(dir, head, self.sizing).await
    }

    /// Gives up the spare spools once the disk has less than
    /// `SPARE_BYTES_MAX` free above the reserve: space for appends comes
    /// first.
    fn check_spares(&self) {
        if self.spares.borrow().is_empty() {
            return;
        }
        let low = rotary_storage::spool::free_bytes_at(&self.dir).is_ok_and(|free| {
            free < self
                .disk_reserve_bytes
                .saturating_add(crate::spares::SPARE_BYTES_MAX)
        });
        if low {
            tracing::info!(
                bytes = self.spares.borrow().bytes(),
                "the disk is short of space: deleting the spare spools"
            );
            self.spares.borrow_mut().release();
        }
    }

    /// Lets go of a local fragment's file: kept as a spare when nothing
    /// can read or write it any more (in the store, not being uploaded, no
    /// read of its journal in flight, not known to be damaged), else
    /// deleted by the reaper: freed a step at a time unless something
    /// may still read it.
    fn retire_fragment(&self, jm: &Journal, f: LocalFragment) {
        let unread = !f.uploading && jm.reads_in_flight == 0;
        let idle = unread && f.uploaded && f.corrupt.is_none();
        let len = f.end - f.begin;
        drop(f.file);
        if idle && self.spares.borrow_mut().give(&f.path, len) {
            metrics::add(&self.metrics.spares_kept, 1);
        } else if unread {
            crate::reaper::free_file(f.path);
        } else {
            crate::reaper::remove_file(f.path);
        }
    }

    /// Moves the write head to the end of the fragment index (after a
    /// broker restarted on an empty disk), sealing the open spool first.
    async fn reset_head(&self, j: &JournalRef) {
        let (loaded, error) = {
            let jm = j.borrow();
            (jm.index_loaded, jm.index_error.clone())
        };
        if !loaded {
            let msg = format!(
                "fragment index not yet listed: {}",
                error.unwrap_or_else(|| "listing in progress".into())
            );
            for (outbox, id) in j.borrow_mut().reset_waiters.drain(..) {
                outbox.error(
                    Op::ADMIN_REPLY,
                    Status::FRAGMENT_STORE_UNHEALTHY,
                    id,
                    &[],
                    &msg,
                );
            }
            return;
        }
        if j.borrow().spool.is_some() {
            self.seal(j).await;
        }
        let mut jm = j.borrow_mut();
        let local_end = jm.fragments.iter().map(|f| f.end).max().unwrap_or(0);
        let head = jm.head.max(jm.remote_end()).max(local_end);
        if head > jm.head {
            // Recorded, so that a restart before the next append keeps the
            // new head: an empty spool beginning there (recovery starts a
            // journal at least at its last record's end).
            let st = JournalState {
                spool_begin: head,
                end: head,
                sha1: Sha1::new().finalize(),
                registers: jm.local_registers.clone(),
                mid: Some(Midstate::of(head, &Sha1::new())),
            };
            if let Some(log) = self.log.borrow_mut().as_mut() {
                log.record_commit(&jm.name, &st);
            }
            if let Err(e) = self.write_log() {
                let msg = format!("recording the new write head: {e}");
                for (outbox, id) in jm.reset_waiters.drain(..) {
                    outbox.error(Op::ADMIN_REPLY, storage_status(&e), id, &[], &msg);
                }
                return;
            }
            self.states.borrow_mut().insert(jm.name.clone(), st);
        }
        jm.head = head;
        jm.local_head = head;
        jm.staged_head = head;
        let body =
            serde_json::to_vec(&serde_json::json!({ "journal": jm.name, "write_head": head }))
                .expect("json");
        for (outbox, id) in jm.reset_waiters.drain(..) {
            outbox.frame(Op::ADMIN_REPLY, Status::OK, id, &[], &body);
        }
        jm.committed.notify(usize::MAX);
    }

    /// Starts agreeing with the journal's replicas (SYNC) in the
    /// background; the journal stages nothing until they agree.
    async fn begin_sync(&self, j: &JournalRef, route: Route) {
        {
            let mut jm = j.borrow_mut();
            let jm = &mut *jm;
            if jm.syncing {
                return;
            }
            // An open append's content went over pipelines being replaced.
            if let Some(a) = abandon_active(jm) {
                let reply = AppendReply {
                    write_head: jm.head,
                    registers: jm.registers.clone(),
                    ..Default::default()
                };
                a.op.reply_error(
                    Status::REPLICATION_FAILED,
                    &reply,
                    "the journal's replication pipeline broke during the append; it was rolled back",
                );
                drop_budget(&a.op);
                jm.queue.pop_front();
                metrics::add(&self.metrics.append_failures, 1);
            }
            if jm.inflight > 0 || !jm.staged.is_empty() {
                // The acker marks the journal ready when they are answered.
                return;
            }
            jm.repl = None;
        }
        let retry = j.borrow().sync_retry.clone();
        if let Some((at, f)) = retry {
            if Instant::now() < at {
                // The last SYNC failed moments ago: answer with its cause.
                self.fail_queue(j, f.status, &f.message);
                return;
            }
        }
        // A fresh spool at the head on every member. (A primary without
        // replicas, asking only its earlier routes' brokers, keeps its spool
        // unless they are ahead of it.)
        if route.members.len() > 1 && j.borrow().spool.as_ref().is_some_and(|s| !s.is_empty()) {
            self.seal(j).await;
        }
        j.borrow_mut().syncing = true;
        let Some(me) = self.me.borrow().upgrade() else {
            return;
        };
        let j = j.clone();
        compio::runtime::spawn(async move {
            let res = me.sync_replicas(&j, &route).await;
            let mut replicas: Vec<&str> = route.members.iter().skip(1).map(|m| m.id.as_str()).collect();
            replicas.sort_unstable();
            let replicas = replicas.join(",");
            {
                let mut jm = j.borrow_mut();
                jm.syncing = false;
                match res {
                    Ok(repl) => {
                        metrics::add(&me.metrics.syncs, 1);
                        // In a cluster on etcd the assignments record the
                        // route: its members are consistent from now on.
                        if let Some(control) = me.topology.control() {
                            control.synced(&jm.name, route.ids());
                        }
                        jm.repl = Some(repl);
                        jm.sync_retry = None;
                        jm.first_sync_pending = false;
                        if me.shared_failures.worked(SharedWork::Sync, &replicas) {
                            tracing::info!(replicas, journal = %jm.name, "replicas synchronized again");
                        }
                    }
                    Err(f) => {
                        if let Some(held) = me.shared_failures.failed(SharedWork::Sync, &replicas) {
                            tracing::warn!(replicas, journal = %jm.name, status = %f.status, error = %f.message, since_last_logged = held, "replicas did not synchronize; retrying every 250 ms, logged once a minute per replica set while it lasts");
                        } else {
                            tracing::debug!(journal = %jm.name, status = %f.status, error = %f.message, "replicas did not synchronize");
                        }
                        jm.sync_retry = Some((Instant::now() + SYNC_RETRY, f));
                    }
                }
                // Reads waiting for the first SYNC get its outcome.
                jm.committed.notify(usize::MAX);
            }
            me.mark_ready(&j);
        })
        .detach();
    }

    /// SYNC with every replica of `route`, and with the brokers of the
    /// journal's earlier routes that left it (see [`Shard::takeover_sources`]).
    /// A broker ahead of this primary (possible only after a route change)
    /// moves the journal forward to its head first, so offsets are never
    /// reused.
    async fn sync_replicas(&self, j: &JournalRef, route: &Route) -> Result<PrimaryRepl, Failure> {
        use rotary_net::repl::{SyncReply, SyncRequest};
        // A broker that just started learns from its peers the views it
        // lacks (`catch_up_specs`) before it looks for the brokers a
        // journal left; that takes one ack timeout at most.
        let started = Instant::now();
        while !self.topology.peers_asked() && started.elapsed() < self.replica_ack_timeout {
            compio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
        let since = j.borrow().takeover_version;
        let (version, sources) = self.takeover_sources(&j.borrow().spec, route, since);
        for _ in 0..3 {
            let (spec, head, registers, name) = {
                let jm = j.borrow();
                (
                    jm.spec.clone(),
                    jm.local_head,
                    jm.local_registers.clone(),
                    jm.name.clone(),
                )
            };
            let mut pipelines = Vec::new();
            // Replicas ahead of this primary: head, registers, member.
            let mut ahead: Vec<(u64, LabelSet, &Member)> = Vec::new();
            let revision = self
                .specs
                .get_revised(&name)
                .filter(|r| r.spec == spec)
                .map_or(0, |r| r.revision);
            let request = || SyncRequest {
                seq: self.seq(),
                journal: name.clone(),
                spec: spec.clone(),
                revision,
                route: route.ids(),
                head,
                registers: registers.clone(),
            };
            for m in &route.members[1..] {
                let p = self.pipeline(m, &name);
                let epoch = p.connect().await?;
                let ack = p.sync(&request()).await?;
                let reply: SyncReply = serde_json::from_slice(&ack.body).unwrap_or_default();
                match ack.status {
                    Status::OK => pipelines.push((p, epoch)),
                    Status::PROPOSAL_MISMATCH if reply.head > head => {
                        ahead.push((reply.head, reply.registers, m));
                    }
                    status => {
                        // Clients see a retryable status; the cause is named.
                        return Err(Failure::new(
                            Status::REPLICATION_FAILED,
                            format!(
                                "replica {} answered SYNC with {status}: {}",
                                m.id, reply.message
                            ),
                        ));
                    }
                }
            }
            // Brokers the journal left: they answer WRONG_ROUTE with their
            // head. Bytes only they hold are copied and the head moves past
            // them, so that this primary's appends never reuse their
            // offsets. One still routing the journal to itself has not seen
            // the change, and may yet take appends: wait for it.
            for m in &sources {
                let silent_since = self.silent_sources.borrow().get(&m.id).copied();
                if silent_since.is_some_and(|at| {
                    at.elapsed() < self.replica_ack_timeout * SILENT_SOURCE_PASSED_OVER
                }) {
                    metrics::add(&self.metrics.takeover_sources_passed_over, 1);
                    tracing::debug!(journal = %name, broker = %m.id, "a broker of one of the journal's earlier routes did not answer moments ago; taking the journal over without its bytes");
                    continue;
                }
                let p = self.pipeline(m, &name);
                let ack = match p.connect().await {
                    Ok(_) => p.sync(&request()).await,
                    Err(f) => Err(f),
                };
                let ack = match ack {
                    Ok(ack) => {
                        self.silent_sources.borrow_mut().remove(&m.id);
                        ack
                    }
                    Err(f) => {
                        // Gone with its disk, or stopped: what only it held
                        // cannot be had (a journal of one replica). One that
                        // is stopped, or cut off, is not waited for again by
                        // every journal in turn.
                        if f.timed_out {
                            metrics::add(&self.metrics.takeover_sources_silent, 1);
                            self.silent_sources
                                .borrow_mut()
                                .insert(m.id.clone(), Instant::now());
                        }
                        tracing::warn!(journal = %name, broker = %m.id, error = %f.message, "a broker of one of the journal's earlier routes does not answer; taking the journal over without its bytes");
                        continue;
                    }
                };
                let reply: SyncReply = serde_json::from_slice(&ack.body).unwrap_or_default();
                if reply.route.contains(&m.id) {
                    return Err(Failure::new(
                        Status::REPLICATION_FAILED,
                        format!(
                            "broker {} still routes the journal to {:?}: it has not seen the cluster change yet",
                            m.id, reply.route
                        ),
                    ));
                }
                if ack.status == Status::WRONG_ROUTE && reply.head > head {
                    ahead.push((reply.head, reply.registers, m));
                }
            }
            if ahead.is_empty() {
                j.borrow_mut().takeover_version = version;
                return Ok(PrimaryRepl {
                    members: route.ids(),
                    pipelines,
                    version,
                });
            }
            // Furthest first; among equals, route order.
            ahead.sort_by_key(|a| std::cmp::Reverse(a.0));
            let (to, their_registers) = (ahead[0].0, ahead[0].1.clone());
            // Only after a route change, or a restart without the data
            // (a replaced disk): replicas, or brokers the journal left,
            // hold bytes this primary does not. They are copied before the
            // head moves past them, so the primary serves and uploads them
            // like its own.
            tracing::warn!(journal = %name, from = head, to, broker = %ahead[0].2.id, "a broker is ahead; copying the journal's bytes from it and rolling forward");
            // Sealed first, if bytes are open in it (a primary without
            // replicas keeps its spool through a SYNC).
            if j.borrow().spool.as_ref().is_some_and(|s| !s.is_empty()) {
                self.seal(j).await;
                if j.borrow().spool.is_some() {
                    return Err(Failure::new(
                        Status::IO_ERROR,
                        "sealing the primary's spool before copying failed",
                    ));
                }
            }
            let spool = j.borrow_mut().spool.take();
            if let Some(spool) = spool {
                // Empty: the SYNC started by sealing.
                let _ = spool.seal(false).await;
            }
            let (dir, durable, from) = {
                let jm = j.borrow();
                // What a listed store holds need not be copied.
                let listed = if jm.index_loaded { jm.remote_end() } else { 0 };
                (
                    jm.dir.clone(),
                    jm.spec.durability == Durability::Fsync,
                    head.max(listed).min(to),
                )
            };
            let sources: Vec<(u64, std::net::SocketAddr)> = ahead
                .iter()
                .map(|(h, _, m)| (*h, self.member_endpoint(m, &name)))
                .collect();
            let copied = crate::fetch::copy_from_each(&sources, &name, from, to, &dir, durable)
                .await
                .map_err(|e| Failure::new(Status::REPLICATION_FAILED, e))?;
            let held: u64 = copied.iter().map(|f| f.end - f.begin).sum();
            metrics::add(&self.metrics.copied_bytes, held);
            if held < to - from {
                tracing::warn!(journal = %name, from, to, copied = held, "the replicas ahead hold only part of the span; the rest is read from the store, if one holds it");
            }
            let mut jm = j.borrow_mut();
            if jm.has_stores() {
                self.unuploaded_bytes
                    .set(self.unuploaded_bytes.get() + held);
            }
            jm.fragments.extend(copied);
            jm.fragments.sort_by_key(|f| (f.begin, f.end));
            if jm.has_stores() {
                self.queue_uploads(&mut jm);
            }
            jm.head = jm.head.max(to);
            jm.local_head = jm.local_head.max(to);
            jm.staged_head = jm.local_head;
            // The registers go with the furthest history (fencing must not
            // step back).
            jm.registers = their_registers.clone();
            jm.local_registers = their_registers.clone();
            jm.staged_registers = their_registers;
        }
        Err(Failure::new(
            Status::PROPOSAL_MISMATCH,
            "replicas keep disagreeing with the primary's head",
        ))
    }

    /// Applies SYNCs sent by the journal's primary, once the appends it
    /// sent before them are through.
    async fn apply_syncs(&self, j: &JournalRef) {
        use rotary_net::repl::SyncReply;
        loop {
            let w = {
                let mut jm = j.borrow_mut();
                if jm.sync_waiters.is_empty()
                    || jm.active.is_some()
                    || !jm.queue.is_empty()
                    || !jm.staged.is_empty()
                    || !jm.awaiting.is_empty()
                {
                    return;
                }
                jm.sync_waiters.remove(0)
            };
            let view = self.view();
            let route = view.route(&w.req.journal, w.req.spec.replication);
            let head = j.borrow().local_head;
            let answer = |status: Status, message: String, head: u64| {
                let body = SyncReply {
                    head,
                    route: route.ids(),
                    registers: j.borrow().local_registers.clone(),
                    message,
                };
                w.sink
                    .push(w.req.seq, status, serde_json::to_vec(&body).expect("json"));
            };
            if route.ids() != w.req.route || !route.contains(&view.me) || route.is_primary(&view.me)
            {
                let msg = route_disagreement(&view.me, &route, &w.req);
                answer(Status::WRONG_ROUTE, msg, head);
                continue;
            }
            if head > w.req.head {
                let msg = format!(
                    "the replica's head {head} is beyond the primary's {}",
                    w.req.head
                );
                answer(Status::PROPOSAL_MISMATCH, msg, head);
                continue;
            }
            if j.borrow().spool.is_some() {
                self.seal(j).await;
            }
            if j.borrow().spool.is_some() {
                answer(
                    Status::IO_ERROR,
                    "sealing the replica's spool failed".into(),
                    head,
                );
                continue;
            }
            {
                let mut jm = j.borrow_mut();
                let h = w.req.head;
                jm.head = h;
                jm.local_head = h;
                jm.staged_head = h;
                jm.registers = w.req.registers.clone();
                jm.local_registers = w.req.registers.clone();
                jm.staged_registers = w.req.registers.clone();
                jm.replica = Some(crate::replica::ReplicaTrack::synced_at(h, w.req.seq));
                jm.committed.notify(usize::MAX);
            }
            metrics::add(&self.metrics.syncs, 1);
            answer(Status::OK, String::new(), w.req.head);
        }
    }

    async fn seal(&self, j: &JournalRef) {
        let (spool, durable) = {
            let mut jm = j.borrow_mut();
            let durable = jm.spec.durability == Durability::Fsync;
            (jm.spool.take(), durable)
        };
        let spool = match spool {
            Some(s) if s.is_empty() => {
                // Nothing to seal: its file is kept as a spare, or its name
                // removed here (the next spool may take it) and its
                // preallocated blocks freed by the reaper.
                let (path, len) = s.into_empty_file();
                if self.spares.borrow_mut().give(&path, len) {
                    metrics::add(&self.metrics.spares_kept, 1);
                } else if let Err(e) = crate::reaper::unlink_now_free_later(&path) {
                    tracing::warn!(path = %path.display(), error = %e, "cannot remove an empty spool");
                }
                None
            }
            other => other,
        };
        let mut sealed = None;
        if let Some(spool) = spool {
            let path = spool.path().to_path_buf();
            let begin = spool.begin();
            j.borrow_mut().spool_out = true;
            match spool.seal(durable).await {
                Ok(frag) => sealed = frag,
                Err(e) => {
                    // The spool file stays where it was; recovery or the
                    // next seal picks it up. Reopen it to keep appending.
                    tracing::error!(path = %path.display(), error = %e, "seal failed");
                    let end = j.borrow().head;
                    if let Ok((s, _)) = Spool::recover_sized(path, begin, end, self.sizing).await {
                        j.borrow_mut().spool = Some(s);
                    }
                    j.borrow_mut().spool_back();
                    return;
                }
            }
        }
        let mut jm = j.borrow_mut();
        jm.seal_requested = false;
        jm.spool_since = None;
        // Replicas must start their next spool where this one ended.
        jm.repl = None;
        let json = match &sealed {
            Some(f) => fragment_json(f, jm.has_stores()),
            None => serde_json::Value::Null,
        };
        if let Some(f) = sealed {
            metrics::add(&self.metrics.fragments_sealed, 1);
            if jm.has_stores() {
                // Count it against the spool budget now: the next append
                // must see it, not wait for an upload attempt to finish.
                self.unuploaded_bytes
                    .set(self.unuploaded_bytes.get() + (f.end - f.begin));
            }
            // Only the newest sealed fragment keeps its spool's open file
            // (tailing readers finish it); older ones are opened per read.
            // Else every fragment of a journal with small fragments holds a
            // descriptor, and tens of thousands exhaust the process's.
            if let Some(prev) = jm.fragments.last_mut() {
                prev.file = None;
            }
            jm.fragments.push(f);
        }
        if jm.has_stores() {
            self.queue_uploads(&mut jm);
        }
        if jm.spool_out {
            jm.spool_back();
        }
        let body = serde_json::to_vec(&serde_json::json!({ "sealed": json })).expect("json");
        for (outbox, id) in jm.seal_waiters.drain(..) {
            outbox.frame(Op::ADMIN_REPLY, Status::OK, id, &[], &body);
        }
    }

    /// Stages queued appends of one journal. Returns true if it has more
    /// to stage as soon as the buffer is written.
    fn stage(&self, j: &JournalRef) -> bool {
        let again = self.stage_queue(j);
        let mut jm = j.borrow_mut();
        if !jm.awaiting.is_empty() {
            self.commit_awaiting(&mut jm);
        }
        again
    }

    /// Moves a replica's appends whose proposals arrived, oldest first,
    /// from awaiting to this turn's batch, each checked against the bytes
    /// staged for it. A mismatch drops it and everything staged after it.
    fn commit_awaiting(&self, jm: &mut Journal) {
        while let Some(front) = jm.awaiting.front() {
            let proposal = match &front.op.replica {
                Some(r) => r.proposal.borrow().clone(),
                None => None,
            };
            let Some(proposal) = proposal else { break };
            let w = jm.awaiting.pop_front().expect("front");
            let staged_sha = w.end.sha.clone().finalize();
            if let Err(msg) = crate::replica::check_proposal(
                w.end.offset,
                &staged_sha,
                proposal.end,
                &proposal.fragment_sha1,
            ) {
                let r = AppendReply {
                    write_head: jm.head,
                    ..Default::default()
                };
                w.op.reply_error(Status::PROPOSAL_MISMATCH, &r, &msg);
                self.drop_replica_tail(jm, w.start, &msg);
                return;
            }
            jm.staged_registers = proposal.registers.clone();
            jm.staged.push(Staged {
                op: w.op,
                begin: w.start.offset,
                end: w.end.offset,
                sha1: crate::journal::Digest::Ready(staged_sha),
                point: w.end,
                registers: proposal.registers,
                seq: w.seq,
            });
        }
    }

    /// Drops a replica's awaiting and active appends and rewinds its spool
    /// to `start`; the journal needs a SYNC before it takes more.
    fn drop_replica_tail(&self, jm: &mut Journal, start: CommitPoint, msg: &str) {
        let r = AppendReply {
            write_head: jm.head,
            ..Default::default()
        };
        for w in jm.awaiting.drain(..) {
            w.op.reply_error(Status::PROPOSAL_MISMATCH, &r, msg);
        }
        if let Some(a) = jm.active.take() {
            a.op.reply_error(Status::PROPOSAL_MISMATCH, &r, msg);
            drop_budget(&a.op);
            jm.queue.pop_front();
        }
        jm.tail.truncate(start.offset);
        jm.staged_head = start.offset;
        if let Some(spool) = jm.spool.as_mut() {
            spool.rewind(start);
        }
        if let Some(t) = jm.replica.as_mut() {
            t.diverged();
        }
    }

    fn stage_queue(&self, j: &JournalRef) -> bool {
        let mut jm = j.borrow_mut();
        let jm = &mut *jm;
        let role = self.role(&jm.spec);
        let replicated = matches!(&role, Role::Primary(r) if r.members.len() > 1);
        if replicated && jm.repl.is_none() {
            // A SYNC is due (say, the spool was just sealed): the next
            // turn's prepare starts it. One under way marks the journal
            // ready when it ends, and so does the acker for batches in
            // flight.
            return !jm.syncing && jm.inflight == 0 && !jm.queue.is_empty();
        }
        if replicated && jm.inflight >= INFLIGHT_BATCHES_MAX {
            // Replicas catch up first (the acker marks the journal ready).
            return false;
        }
        if jm.staged.is_empty() {
            jm.staged_with_replicas = jm.repl.is_some();
        }
        if jm.spool.as_ref().is_none_or(|s| !s.can_stage()) {
            // Seal waiters on a journal without a spool get their answer.
            if jm.spool.is_none() && !jm.seal_waiters.is_empty() {
                let body =
                    serde_json::to_vec(&serde_json::json!({ "sealed": null })).expect("json");
                for (outbox, id) in jm.seal_waiters.drain(..) {
                    outbox.frame(Op::ADMIN_REPLY, Status::OK, id, &[], &body);
                }
                jm.seal_requested = false;
            }
            return false;
        }
        loop {
            if jm.active.is_none() {
                let Some(op) = jm.queue.front().cloned() else {
                    return false;
                };
                if op.aborted.get().is_some() || op.finished.get() {
                    jm.queue.pop_front();
                    let reply = AppendReply {
                        write_head: jm.staged_head,
                        ..Default::default()
                    };
                    op.end_aborted(&reply);
                    drop_budget(&op);
                    continue;
                }
                let is_replica_op = op.replica.is_some();
                // A client's append is staged only by the primary, a
                // primary's only by a replica: the route may have changed
                // while it waited (a broker no longer the primary must not
                // add bytes the new primary never hears of).
                let allowed = if is_replica_op {
                    matches!(role, Role::Replica(_))
                } else {
                    matches!(role, Role::Primary(_))
                };
                if !allowed {
                    jm.queue.pop_front();
                    let r = AppendReply {
                        write_head: jm.staged_head,
                        registers: jm.staged_registers.clone(),
                        ..Default::default()
                    };
                    if is_replica_op {
                        op.reply_error(
                            Status::WRONG_ROUTE,
                            &r,
                            "this broker is not a replica of the journal",
                        );
                    } else {
                        op.reply_error(
                            Status::NOT_JOURNAL_PRIMARY_BROKER,
                            &r,
                            "the journal's route changed; this broker is no longer its primary",
                        );
                    }
                    drop_budget(&op);
                    continue;
                }
                let spool = jm.spool.as_ref().expect("checked");
                if !is_replica_op
                    && (spool.staged() - spool.begin() >= jm.spec.fragment.length
                        || jm.seal_requested)
                {
                    // Roll to a new fragment first, once this batch commits
                    // (and replicas have acknowledged what is in flight: the
                    // acker marks the journal ready then).
                    return jm.inflight == 0;
                }
                let reply = |status: Status, msg: &str, jm: &Journal| {
                    let r = AppendReply {
                        write_head: jm.staged_head,
                        registers: jm.staged_registers.clone(),
                        ..Default::default()
                    };
                    op.reply_error(status, &r, msg);
                };
                if jm.has_stores() && !is_replica_op {
                    if !jm.index_loaded {
                        match &jm.index_error {
                            // Wait for the first listing: the store may
                            // hold offsets beyond the local head.
                            None => {
                                if !jm.listing && !jm.listing_hurried {
                                    self.hurry_first_listing_soon(j);
                                }
                                return false;
                            }
                            Some(e) => {
                                let msg = format!("fragment index not yet listed: {e}");
                                reply(Status::FRAGMENT_STORE_UNHEALTHY, &msg, jm);
                                jm.queue.pop_front();
                                drop_budget(&op);
                                continue;
                            }
                        }
                    }
                    let remote_end = jm.remote_end();
                    if remote_end > jm.staged_head {
                        let msg = format!(
                            "the fragment index ends at {remote_end}, beyond the write head {}; run `rotary journals reset-head {}`",
                            jm.staged_head, jm.name
                        );
                        reply(Status::INDEX_HAS_GREATER_OFFSET, &msg, jm);
                        jm.queue.pop_front();
                        drop_budget(&op);
                        continue;
                    }
                    if self.unuploaded_bytes.get() > self.spool_budget_bytes {
                        let cause = self.store_error.borrow().clone().unwrap_or_else(|| {
                            "no upload has reported a failure yet: uploads are behind appends, or still retrying against a store that does not answer".into()
                        });
                        let msg = format!(
                            "{} bytes of sealed fragments await upload (budget {}): {cause}",
                            self.unuploaded_bytes.get(),
                            self.spool_budget_bytes
                        );
                        reply(Status::FRAGMENT_STORE_UNHEALTHY, &msg, jm);
                        jm.queue.pop_front();
                        drop_budget(&op);
                        continue;
                    }
                }
                let req = &op.req;
                if let Some(expect) = req.expect_offset {
                    if expect != jm.staged_head {
                        let msg = format!(
                            "expected offset {expect} but the write head is {}",
                            jm.staged_head
                        );
                        let status = if is_replica_op {
                            if let Some(t) = jm.replica.as_mut() {
                                t.diverged();
                            }
                            Status::PROPOSAL_MISMATCH
                        } else {
                            Status::WRONG_APPEND_OFFSET
                        };
                        reply(status, &msg, jm);
                        jm.queue.pop_front();
                        drop_budget(&op);
                        continue;
                    }
                }
                if !req.check_registers.is_empty()
                    && !req.check_registers.matches(&jm.staged_registers)
                {
                    let msg = format!(
                        "registers {{{}}} do not match selector {{{}}}",
                        jm.staged_registers,
                        req.check_registers.to_text()
                    );
                    reply(Status::REGISTER_MISMATCH, &msg, jm);
                    jm.queue.pop_front();
                    drop_budget(&op);
                    continue;
                }
                let start = jm.spool.as_ref().expect("checked").commit_point();
                let seq = if is_replica_op {
                    op.request_id
                } else {
                    jm.last_append = Instant::now();
                    self.seq()
                };
                jm.active = Some(Active {
                    _streaming: crate::conn::Streaming::new(op.budget.clone()),
                    op,
                    start,
                    sha: crate::journal::AppendSha::Inline(Sha1::new()),
                    chunk_pos: 0,
                    seq,
                    started: Instant::now(),
                });
            }
            let a = jm.active.as_mut().expect("set above");
            let spool = jm.spool.as_mut().expect("checked");
            // Stage what has arrived.
            loop {
                let mut chunks = a.op.chunks.borrow_mut();
                let Some(chunk) = chunks.front() else { break };
                let bytes = &chunk.bytes()[a.chunk_pos..];
                if bytes.is_empty() {
                    let c = chunks.pop_front().expect("front");
                    a.op.budget.release(c.range.len());
                    a.chunk_pos = 0;
                    continue;
                }
                if let Err(e) = spool.ensure_allocated(bytes.len() as u64, self.disk_reserve_bytes)
                {
                    drop(chunks);
                    if e.is_full() {
                        metrics::add(&self.metrics.storage_full, 1);
                        // Spare spools must never be why an append fails.
                        self.spares.borrow_mut().release();
                    }
                    let a = jm.active.take().expect("active");
                    jm.tail.truncate(a.start.offset);
                    spool.rewind(a.start);
                    send_rollback(jm.repl.as_ref(), &jm.name, a.seq);
                    let r = AppendReply {
                        write_head: jm.staged_head,
                        registers: jm.staged_registers.clone(),
                        ..Default::default()
                    };
                    a.op.reply_error(storage_status(&e), &r, &e.to_string());
                    drop_budget(&a.op);
                    metrics::add(&self.metrics.append_failures, 1);
                    jm.queue.pop_front();
                    // A rewind past written bytes needs a tail reload.
                    return !jm.queue.is_empty();
                }
                let at = spool.staged();
                // A replica's reply carries no SHA-1 of the append.
                let client = a.op.replica.is_none();
                if let Some(h) = self.hasher.as_ref().filter(|_| client) {
                    let size = at - a.start.offset + bytes.len() as u64;
                    if self.offload_hash(h, &mut a.sha, size) && h.behind() {
                        // Its bytes wait in the chunk until the hasher
                        // caught up and readies the journal again.
                        drop(chunks);
                        self.hash_parked.borrow_mut().push(j.clone());
                        metrics::add(&self.metrics.hash_waits, 1);
                        return false;
                    }
                }
                // A client's bytes go at the journal's `max_append_rate`;
                // the rest wait in their chunk (and the connection's budget
                // holds the client back) while its connection goes on
                // serving. A replica's were admitted by its primary.
                let admitted = if client {
                    match jm.rate.admit(bytes.len() as u64, Instant::now()) {
                        Ok(n) => &bytes[..n as usize],
                        Err(wait) => {
                            drop(chunks);
                            metrics::add(&self.metrics.rate_waits, 1);
                            if !jm.rate_timer {
                                jm.rate_timer = true;
                                self.ready_after(j, wait);
                            }
                            return false;
                        }
                    }
                } else {
                    bytes
                };
                let n = match &mut a.sha {
                    AppendSha::Inline(_) if !client => spool.stage(admitted),
                    AppendSha::Inline(sha) => spool.stage_hashed(admitted, sha),
                    AppendSha::Offloaded(o) => {
                        let n = spool.stage(admitted);
                        let from = chunk.range.start + a.chunk_pos;
                        o.hash(&chunk.data, from..from + n);
                        metrics::add(&self.metrics.hash_offloaded_bytes, n as u64);
                        n
                    }
                };
                if client && n < admitted.len() {
                    jm.rate.give_back((admitted.len() - n) as u64);
                }
                if let Some(r) = &jm.repl {
                    let rec = Record::Content {
                        seq: a.seq,
                        journal: &jm.name,
                        offset: at,
                        bytes: &bytes[..n],
                    };
                    for (p, _) in &r.pipelines {
                        p.push(&rec);
                    }
                }
                if jm.waiting_readers > 0 {
                    let window = crate::journal::tail_window(self.journals.borrow().len());
                    jm.tail.push(at, &bytes[..n], window, &self.metrics);
                }
                a.chunk_pos += n;
                if n < admitted.len() {
                    // Buffer full: write it, then continue.
                    return true;
                }
            }
            let content_done = a.op.replica.as_ref().is_some_and(|r| r.content_done.get());
            if (!a.op.complete.get() && !content_done) || !a.op.chunks.borrow().is_empty() {
                return false;
            }
            // The append is whole.
            let a = jm.active.take().expect("active");
            jm.queue.pop_front();
            let point = spool.commit_point();
            let begin = a.start.offset;
            let end = point.offset;
            if a.op.replica.is_some() {
                // Committed when its proposal comes (`commit_awaiting`);
                // the next append's content is staged meanwhile.
                jm.staged_head = end;
                jm.awaiting.push_back(crate::journal::Awaiting {
                    op: a.op,
                    start: a.start,
                    end: point,
                    seq: a.seq,
                });
                continue;
            }
            if begin == end
                && (!a.op.req.union_registers.is_empty() || !a.op.req.subtract_registers.is_empty())
            {
                let r = AppendReply {
                    write_head: jm.staged_head,
                    registers: jm.staged_registers.clone(),
                    ..Default::default()
                };
                a.op.reply_error(
                    Status::BAD_REQUEST,
                    &r,
                    "an empty append cannot change registers",
                );
                send_rollback(jm.repl.as_ref(), &jm.name, a.seq);
                continue;
            }
            let mut registers = jm.staged_registers.clone();
            if begin != end {
                registers.union(&a.op.req.union_registers);
                registers.subtract(&a.op.req.subtract_registers);
            }
            if registers.encoded_len() > rotary_net::wire::REGISTERS_ENCODED_LEN_MAX {
                // Replies carry the registers; they must stay encodable.
                jm.tail.truncate(a.start.offset);
                spool.rewind(a.start);
                send_rollback(jm.repl.as_ref(), &jm.name, a.seq);
                let r = AppendReply {
                    write_head: jm.staged_head,
                    registers: jm.staged_registers.clone(),
                    ..Default::default()
                };
                let msg = format!(
                    "registers would take {} bytes; at most {} are allowed",
                    registers.encoded_len(),
                    rotary_net::wire::REGISTERS_ENCODED_LEN_MAX
                );
                a.op.reply_error(Status::BAD_REQUEST, &r, &msg);
                continue;
            }
            jm.staged_head = end;
            jm.staged_registers = registers.clone();
            jm.staged.push(Staged {
                op: a.op,
                begin,
                end,
                sha1: a.sha.finish(),
                point,
                registers,
                seq: a.seq,
            });
        }
    }

    /// Moves a client append's own SHA-1 to the hasher once it is large
    /// enough (`size` bytes, with those about to be staged, against
    /// [`crate::hasher::OFFLOAD_AFTER`]) and the hasher has room. Returns
    /// whether the append's hashing is offloaded.
    fn offload_hash(&self, h: &crate::hasher::Hasher, sha: &mut AppendSha, size: u64) -> bool {
        match sha {
            AppendSha::Offloaded(_) => true,
            AppendSha::Inline(_) => {
                if size < crate::hasher::OFFLOAD_AFTER || !h.has_room() {
                    return false;
                }
                let AppendSha::Inline(inline) =
                    std::mem::replace(sha, AppendSha::Inline(Sha1::new()))
                else {
                    unreachable!("matched above")
                };
                *sha = AppendSha::Offloaded(h.offload(inline));
                true
            }
        }
    }

    /// Fails every append staged in this batch and the active one, and
    /// rewinds the spool to its last commit.
    fn fail_batch(&self, j: &JournalRef, status: Status, msg: &str) {
        let mut jm = j.borrow_mut();
        let jm = &mut *jm;
        let reply = AppendReply {
            write_head: jm.head,
            registers: jm.registers.clone(),
            ..Default::default()
        };
        for s in jm.staged.drain(..) {
            send_rollback(jm.repl.as_ref(), &jm.name, s.seq);
            s.op.reply_error(status, &reply, msg);
            metrics::add(&self.metrics.append_failures, 1);
        }
        if let Some(a) = jm.active.take() {
            send_rollback(jm.repl.as_ref(), &jm.name, a.seq);
            a.op.reply_error(status, &reply, msg);
            drop_budget(&a.op);
            jm.queue.pop_front();
            metrics::add(&self.metrics.append_failures, 1);
        }
        for w in jm.awaiting.drain(..) {
            w.op.reply_error(status, &reply, msg);
        }
        if let Some(t) = jm.replica.as_mut() {
            t.diverged();
        }
        if let Some(spool) = jm.spool.as_mut() {
            spool.rollback();
        }
        let head = jm.local_head;
        jm.tail.truncate(head);
        jm.staged_head = head;
        jm.staged_registers = jm.local_registers.clone();
    }

    /// Fails every queued append of a journal (its spool cannot be used).
    fn fail_queue(&self, j: &JournalRef, status: Status, msg: &str) {
        let mut jm = j.borrow_mut();
        let reply = AppendReply {
            write_head: jm.head,
            registers: jm.registers.clone(),
            ..Default::default()
        };
        for op in jm.queue.drain(..) {
            op.reply_error(status, &reply, msg);
            drop_budget(&op);
            metrics::add(&self.metrics.append_failures, 1);
        }
        jm.active = None;
    }

    /// Commits and acknowledges the staged appends of a journal.
    fn acknowledge(&self, j: &JournalRef) {
        let staged = self.commit_local(j);
        self.publish(j, staged, None);
    }

    /// Moves the journal's local commit point past its staged appends
    /// (the commit log holds them) and returns them.
    fn commit_local(&self, j: &JournalRef) -> Vec<Staged> {
        let mut jm = j.borrow_mut();
        let jm = &mut *jm;
        let staged = std::mem::take(&mut jm.staged);
        let last = staged.last().expect("non-empty");
        jm.spool.as_mut().expect("spool").commit(last.point.clone());
        jm.local_head = last.end;
        jm.local_registers = last.registers.clone();
        if jm.spool_since.is_none() {
            jm.spool_since = Some(SystemTime::now());
        }
        staged
    }

    /// Makes locally committed appends visible and answers them: OK, or
    /// `failure` when a replica did not acknowledge (they stay committed
    /// here, like appends whose reply was lost).
    fn publish(&self, j: &JournalRef, staged: Vec<Staged>, failure: Option<&Failure>) {
        self.count_appends(&staged, failure.is_some());
        self.publish_counted(j, staged, failure);
    }

    /// Counts a batch's appends (and their bytes) as succeeded or failed.
    fn count_appends(&self, staged: &[Staged], failed: bool) {
        // Pulses (internal, their outbox closed) are not client appends.
        let counted = staged
            .iter()
            .filter(|s| !s.op.outbox.is_closed() || s.op.replica.is_some())
            .count() as u64;
        if failed {
            metrics::add(&self.metrics.append_failures, counted);
        } else {
            let bytes = staged.iter().map(|s| s.end - s.begin).sum();
            metrics::add(&self.metrics.appends, counted);
            metrics::add(&self.metrics.append_bytes, bytes);
        }
    }

    /// [`Shard::publish`] of a batch already counted (when it was answered).
    fn publish_counted(&self, j: &JournalRef, staged: Vec<Staged>, failure: Option<&Failure>) {
        let mut jm = j.borrow_mut();
        let jm = &mut *jm;
        let Some(last) = staged.last() else { return };
        jm.head = jm.head.max(last.end);
        jm.registers = last.registers.clone();
        for s in &staged {
            if let Some(f) = failure {
                let reply = AppendReply {
                    write_head: jm.head,
                    registers: jm.registers.clone(),
                    ..Default::default()
                };
                s.op.reply_error(f.status, &reply, &f.message);
                continue;
            }
            answer_ok(s);
        }
        jm.committed.notify(usize::MAX);
    }

    /// Streams a read to `outbox`. Ends with READ_DONE unless the
    /// connection closed.
    pub async fn read(
        &self,
        j: JournalRef,
        outbox: Rc<Outbox>,
        request_id: u64,
        req: rotary_net::wire::ReadRequest,
        flags: u8,
        cancel: Rc<crate::conn::Cancel>,
    ) {
        let block = flags & rotary_net::wire::flag::BLOCK != 0;
        let metadata_only = flags & rotary_net::wire::flag::METADATA_ONLY != 0;
        use rotary_net::wire::{ReadData, ReadDone};
        use zerocopy::byteorder::little_endian::U64;
        use zerocopy::IntoBytes;
        metrics::add(&self.metrics.reads, 1);
        let done = |status: Status, offset: u64, head: u64, msg: &str| {
            let meta = ReadDone {
                offset: U64::new(offset),
                write_head: U64::new(head),
            };
            outbox.frame(
                Op::READ_DONE,
                status,
                request_id,
                meta.as_bytes(),
                msg.as_bytes(),
            );
        };
        if j.borrow().spec.flags == JournalFlags::WriteOnly {
            let head = j.borrow().head;
            return done(Status::NOT_ALLOWED, 0, head, "journal is write-only");
        }
        // Why a read ends early: a CANCEL, or a clean stop of the broker.
        let stopped = || {
            if cancel.is_set() {
                Some((Status::CANCELLED, "read cancelled"))
            } else if self.shutting_down.get() {
                Some((
                    Status::SHUTTING_DOWN,
                    "the broker is shutting down; read on from this offset elsewhere or later",
                ))
            } else {
                None
            }
        };
        // A read waiting before it starts ends if it is stopped (answered
        // here) or its connection closed.
        let ended = |head: u64| {
            if let Some((status, why)) = stopped() {
                done(status, req.offset.unwrap_or(head), head, why);
                return true;
            }
            outbox.is_closed()
        };
        // A journal with stores is whole only once its store was first
        // listed: the store may hold history the local disk does not (a
        // wiped data dir, `--local-cache 0`). Until then a read would see
        // an empty journal, so it waits for the listing, and a listing
        // that failed is the read's answer, as it is an append's.
        loop {
            let (listed, failed) = {
                let jm = j.borrow();
                (jm.index_loaded, jm.index_error.clone())
            };
            if listed {
                break;
            }
            let head = j.borrow().head;
            if let Some(e) = failed {
                return done(
                    Status::FRAGMENT_STORE_UNHEALTHY,
                    req.offset.unwrap_or(head),
                    head,
                    &format!("fragment index not yet listed: {e}"),
                );
            }
            let wakeup = read_wakeup(&j, &cancel, &outbox, &self.stopping);
            {
                let jm = j.borrow();
                if jm.index_loaded || jm.index_error.is_some() {
                    continue;
                }
            }
            self.hurry_first_listing(&j);
            if ended(head) {
                return;
            }
            wakeup.await;
        }
        // A primary that started with none of a replicated journal's data
        // (a new journal, or a data dir lost with its disk) learns its head
        // from its replicas' at the first SYNC, copying what they hold
        // beyond its own. Until then a read would see an empty journal, so
        // it waits for that SYNC, and a SYNC that failed is its answer.
        // So does a primary the journal was just routed to, until it asked
        // the brokers of the journal's earlier routes for their heads.
        loop {
            let role = self.role(&j.borrow().spec);
            // (A route short of brokers cannot synchronize at all.)
            let (route, takeover) = match role {
                Role::Primary(r) if r.is_complete() => {
                    let takeover = self.takeover_due(&j, &r);
                    let first = j.borrow().first_sync_pending && r.members.len() > 1;
                    if !takeover && !first {
                        break;
                    }
                    (r, takeover)
                }
                _ => break,
            };
            let failed = {
                let jm = j.borrow();
                // A failure stands until its retry is due.
                jm.sync_retry
                    .as_ref()
                    .filter(|(at, _)| Instant::now() < *at && !jm.syncing)
                    .map(|(_, f)| f.clone())
            };
            let head = j.borrow().head;
            if let Some(f) = failed {
                let msg = if takeover {
                    format!(
                        "the journal's route changed, and its new primary has not learned the head from the brokers it left yet: {}",
                        f.message
                    )
                } else {
                    format!(
                        "the primary started without the journal's data and has not synchronized with its replicas yet: {}",
                        f.message
                    )
                };
                return done(
                    Status::REPLICATION_FAILED,
                    req.offset.unwrap_or(head),
                    head,
                    &msg,
                );
            }
            let wakeup = read_wakeup(&j, &cancel, &outbox, &self.stopping);
            if takeover {
                // `prepare` starts the SYNC.
                self.mark_ready(&j);
            } else {
                self.pulse(&j, &route, true);
            }
            if ended(head) {
                return;
            }
            wakeup.await;
        }
        // Appends already answered are readable, and count in the write
        // head, if a moment later: their spool write completes in the turn.
        settle_answered(&j).await;
        // `-1` is the end of readable history, the head READ_DONE reports:
        // beyond the write head only before a head reset, when a tail "from
        // now on" must not replay the store's history.
        let head = j.borrow().read_head();
        let mut offset = req.offset.unwrap_or(head);
        if metadata_only {
            return done(Status::OK, offset, head, "");
        }
        if !block && offset >= head {
            return done(
                Status::OFFSET_NOT_YET_AVAILABLE,
                offset,
                head,
                &format!("offset {offset} is not before the write head {head}"),
            );
        }
        loop {
            if let Some(end) = req.end_offset {
                if offset >= end {
                    let head = j.borrow().head;
                    return done(Status::OK, offset, head, "");
                }
            }
            if let Some((status, why)) = stopped() {
                let head = j.borrow().head;
                return done(status, offset, head, why);
            }
            // Fetch a chunk only with room for it and a turn: a client
            // that stops reading, however many reads it has in flight,
            // holds a bounded share of the shard's memory.
            let Some(turn) = outbox.produce().await else {
                return;
            };
            let (located, head, deleted) = {
                let jm = j.borrow();
                (jm.locate(offset), jm.head, jm.deleted)
            };
            if deleted {
                return done(
                    Status::JOURNAL_NOT_FOUND,
                    offset,
                    head,
                    "journal was deleted",
                );
            }
            // Recent bytes come from memory when the tail cache has them.
            let served = {
                let jm = j.borrow();
                let limit = req
                    .end_offset
                    .map_or(jm.head, |e| e.min(jm.head))
                    .min(offset + READ_CHUNK_BYTES as u64);
                jm.tail.get(offset, limit).map(|bytes| {
                    let meta = ReadData {
                        offset: U64::new(offset),
                    };
                    outbox.frame(
                        Op::READ_DATA,
                        Status::OK,
                        request_id,
                        meta.as_bytes(),
                        bytes,
                    );
                    bytes.len() as u64
                })
            };
            if let Some(n) = served {
                metrics::add(&self.metrics.read_bytes, n);
                metrics::add(&self.metrics.tail_cache_reads, 1);
                offset += n;
                continue;
            }
            let Some(loc) = located else {
                drop(turn);
                if j.borrow().spool_out {
                    // Its spool is being sealed, or its tail reloaded: the
                    // bytes are back in a file when that is done.
                    let wakeup = read_wakeup(&j, &cancel, &outbox, &self.stopping);
                    if j.borrow().spool_out && stopped().is_none() && !outbox.is_closed() {
                        wakeup.await;
                    }
                    continue;
                }
                let answered_ahead = {
                    let jm = j.borrow();
                    offset < jm.answered && jm.head < jm.answered
                };
                if !block && answered_ahead {
                    settle_answered(&j).await;
                    continue;
                }
                if !block {
                    // Past the head, or in a gap of the history.
                    return done(Status::OK, offset, head, "");
                }
                // Wait for a commit (or cancel, or a closed connection).
                let wakeup = read_wakeup(&j, &cancel, &outbox, &self.stopping);
                // Only a readable span ends the wait. Bytes below the read
                // head that no file holds (history missing, or a fragment
                // between its local copy and the store's listing) wait for
                // a commit or a new listing like bytes beyond the head.
                if j.borrow().locate(offset).is_some() || stopped().is_some() || outbox.is_closed()
                {
                    continue;
                }
                // While readers wait, appends keep their bytes in memory.
                j.borrow_mut().waiting_readers += 1;
                wakeup.await;
                j.borrow_mut().waiting_readers -= 1;
                continue;
            };
            offset = loc.offset;
            if let Some(end) = req.end_offset {
                if offset >= end {
                    // The rest of the range lies in a gap of the history:
                    // the read ends at its end, and the client sees that
                    // no bytes came for it.
                    let head = j.borrow().head;
                    return done(Status::OK, end, head, "");
                }
            }
            let mut len = (loc.end - offset).min(READ_CHUNK_BYTES as u64);
            if let Some(end) = req.end_offset {
                len = len.min(end - offset);
            }
            // A local file's read holds the journal's files from reuse
            // until it is done: see `retire_fragment`.
            let reading = matches!(
                loc.file,
                FileRef::Open(_) | FileRef::Fragment(..) | FileRef::Unchecked(_)
            )
            .then(|| ReadPin::new(&j));
            let file = match loc.file {
                FileRef::Remote(frag) => {
                    // Each chunk from the store takes its own turn.
                    drop(turn);
                    let step = if flags & rotary_net::wire::flag::DO_NOT_PROXY != 0 {
                        self.direct(&frag, offset, request_id, &outbox)
                            .await
                            .map(|()| None)
                            .map_err(|msg| (None, msg))
                    } else {
                        self.proxy(&frag, offset, req.end_offset, request_id, &outbox, &cancel)
                            .await
                            .map(Some)
                            .map_err(|(e, reached)| {
                                let msg = e.to_string();
                                (Some((e, reached)), msg)
                            })
                    };
                    match step {
                        // The client reads this fragment from the store and
                        // comes back at its end.
                        Ok(None) => {
                            let head = j.borrow().read_head();
                            return done(Status::OK, frag.end, head, "");
                        }
                        Ok(Some(next)) if next > offset => {
                            offset = next;
                            continue;
                        }
                        // Stopped before its first chunk: answered above.
                        Ok(Some(_)) if stopped().is_some() || outbox.is_closed() => continue,
                        Ok(Some(_)) => {
                            let head = j.borrow().read_head();
                            return done(
                                Status::FRAGMENT_STORE_UNHEALTHY,
                                offset,
                                head,
                                "store returned no bytes for the fragment",
                            );
                        }
                        Err((failed, msg)) => {
                            use rotary_uploader::StoreError;
                            let mut jm = j.borrow_mut();
                            match failed {
                                // Never served again (bytes already sent from
                                // it are the client's to discard).
                                Some((StoreError::Corrupt { .. }, _)) => {
                                    tracing::warn!(journal = %jm.name, key = %frag.key, error = %msg, "a store fragment is corrupt; left out of the index");
                                    jm.drop_remote(&frag, true);
                                }
                                // Gone from the store (pruned) before a byte
                                // of it was sent: read on around it.
                                Some((StoreError::NotFound { .. }, reached)) => {
                                    jm.drop_remote(&frag, false);
                                    if reached == offset {
                                        continue;
                                    }
                                }
                                _ => {}
                            }
                            let head = jm.read_head();
                            return done(Status::FRAGMENT_STORE_UNHEALTHY, offset, head, &msg);
                        }
                    }
                }
                FileRef::Corrupt(why) => {
                    let head = j.borrow().head;
                    return done(Status::IO_ERROR, offset, head, &why);
                }
                FileRef::Unchecked(path) => {
                    drop(turn);
                    let checked = self.check_fragment(&j, path).await;
                    drop(reading);
                    if let Err(msg) = checked {
                        let head = j.borrow().head;
                        return done(Status::IO_ERROR, offset, head, &msg);
                    }
                    // Checked (and now read from), or found corrupt (and
                    // now read from a store's copy, or refused).
                    continue;
                }
                FileRef::Open(f) | FileRef::Fragment(_, Some(f)) => f,
                FileRef::Fragment(path, None) => match compio::fs::File::open(&path).await {
                    Ok(f) => Rc::new(f),
                    // Evicted meanwhile: its span is read from where it is
                    // now (the store).
                    Err(e)
                        if e.kind() == std::io::ErrorKind::NotFound
                            && !j.borrow().fragments.iter().any(|f| f.path == path) =>
                    {
                        continue
                    }
                    Err(e) => {
                        let head = j.borrow().head;
                        return done(
                            Status::IO_ERROR,
                            offset,
                            head,
                            &format!("{}: {e}", path.display()),
                        );
                    }
                },
            };
            let read = read_range(&file, loc.file_pos, len as usize).await;
            drop(reading);
            match read {
                Ok((buf, range)) if !range.is_empty() => {
                    let meta = ReadData {
                        offset: U64::new(offset),
                    };
                    outbox.frame(
                        Op::READ_DATA,
                        Status::OK,
                        request_id,
                        meta.as_bytes(),
                        &buf.as_slice()[range.clone()],
                    );
                    metrics::add(&self.metrics.read_bytes, range.len() as u64);
                    offset += range.len() as u64;
                    drop(turn);
                }
                Ok(_) => {
                    let head = j.borrow().head;
                    return done(
                        Status::IO_ERROR,
                        offset,
                        head,
                        "short read of local fragment",
                    );
                }
                Err(e) => {
                    let head = j.borrow().head;
                    return done(Status::IO_ERROR, offset, head, &e.to_string());
                }
            }
        }
    }

    /// Checks the local fragment file at `path` of journal `j` against its
    /// name, once: a second caller waits for the first one's check. The
    /// fragment is then marked verified, or corrupt (never read again).
    /// Err: the file could not be read this time; it stays unchecked.
    async fn check_fragment(&self, j: &JournalRef, path: PathBuf) -> Result<(), String> {
        let running = self.checking.borrow().get(&path).cloned();
        if let Some(event) = running {
            let l = event.listen();
            if self.checking.borrow().contains_key(&path) {
                l.await;
            }
            return Ok(());
        }
        let Some((begin, end, sha1)) = j
            .borrow()
            .fragments
            .iter()
            .find(|f| f.path == path && !f.verified)
            .map(|f| (f.begin, f.end, f.sha1))
        else {
            // Checked, evicted or dropped meanwhile: locate again.
            return Ok(());
        };
        let event = Rc::new(Event::new());
        self.checking
            .borrow_mut()
            .insert(path.clone(), event.clone());
        let res = crate::check::check(path.clone(), begin, end, sha1).await;
        self.checking.borrow_mut().remove(&path);
        event.notify(usize::MAX);
        let mut jm = j.borrow_mut();
        let name = jm.name.clone();
        let Some(f) = jm.fragments.iter_mut().find(|f| f.path == path) else {
            return Ok(());
        };
        match res {
            Ok(()) => {
                f.verified = true;
                metrics::add(&self.metrics.fragments_checked, 1);
                Ok(())
            }
            Err(crate::check::CheckFailed::Mismatch(why)) => {
                tracing::error!(journal = %name, path = %path.display(), %why, "a local fragment does not hold the bytes its name says; it is never served");
                metrics::add(&self.metrics.fragments_checked, 1);
                metrics::add(&self.metrics.fragments_check_failed, 1);
                f.corrupt = Some(why);
                Ok(())
            }
            Err(crate::check::CheckFailed::Io(e)) if e.kind() == std::io::ErrorKind::NotFound => {
                // Still in the index, but its file is gone (removed by
                // hand): nothing of it can be served.
                tracing::error!(journal = %name, path = %path.display(), "a local fragment's file is gone; it is never served");
                metrics::add(&self.metrics.fragments_check_failed, 1);
                f.corrupt = Some("its file is gone".into());
                Ok(())
            }
            Err(crate::check::CheckFailed::Io(e)) => Err(format!(
                "{}: checking the fragment against its name: {e}",
                path.display()
            )),
        }
    }

    /// Answers a direct read with the fragment's location.
    async fn direct(
        &self,
        frag: &StoredFragment,
        offset: u64,
        request_id: u64,
        outbox: &Outbox,
    ) -> Result<(), String> {
        use rotary_net::wire::ReadFragment;
        use zerocopy::byteorder::little_endian::U64;
        use zerocopy::IntoBytes;
        let location = self
            .uploader
            .locate(frag, LOCATION_TTL)
            .await
            .map_err(|e| e.to_string())?;
        let meta = ReadFragment {
            begin: U64::new(frag.begin),
            end: U64::new(frag.end),
            offset: U64::new(offset),
            sha1: frag.sha1,
            codec: rotary_net::wire::codec_code(frag.codec),
            reserved: [0; 3],
        };
        outbox.frame(
            Op::READ_FRAGMENT,
            Status::OK,
            request_id,
            meta.as_bytes(),
            location.as_bytes(),
        );
        Ok(())
    }

    /// Streams a store fragment's bytes from `offset` as READ_DATA, up to
    /// `end_offset`. Returns the next offset to read.
    async fn proxy(
        &self,
        frag: &StoredFragment,
        mut offset: u64,
        end_offset: Option<u64>,
        request_id: u64,
        outbox: &Outbox,
        cancel: &crate::conn::Cancel,
    ) -> Result<u64, (rotary_uploader::StoreError, u64)> {
        use rotary_net::wire::ReadData;
        use zerocopy::byteorder::little_endian::U64;
        use zerocopy::IntoBytes;
        let rx = self.uploader.read(frag, offset, READ_CHUNK_BYTES);
        // Set once `end_offset` is reached inside the fragment: the rest of
        // it is still read, not sent, so that its SHA-1 is checked before
        // the read is answered OK.
        let mut served = false;
        while let Ok(chunk) = rx.recv().await {
            let chunk = chunk.map_err(|e| (e, offset))?;
            if served {
                continue;
            }
            if chunk.offset != offset {
                let skipped = rotary_uploader::StoreError::Corrupt {
                    store: frag.store.clone(),
                    key: frag.key.clone(),
                    why: format!("store stream skipped from {offset} to {}", chunk.offset),
                };
                return Err((skipped, offset));
            }
            let Some(_turn) = outbox.produce().await else {
                break;
            };
            let mut bytes = &chunk.bytes[..];
            if let Some(end) = end_offset {
                bytes = &bytes[..bytes.len().min(end.saturating_sub(offset) as usize)];
            }
            let meta = ReadData {
                offset: U64::new(offset),
            };
            outbox.frame(
                Op::READ_DATA,
                Status::OK,
                request_id,
                meta.as_bytes(),
                bytes,
            );
            metrics::add(&self.metrics.read_bytes, bytes.len() as u64);
            offset += bytes.len() as u64;
            if end_offset.is_some_and(|e| offset >= e) {
                served = true;
            } else if cancel.is_set() || self.shutting_down.get() || outbox.is_closed() {
                break;
            }
        }
        Ok(offset)
    }

    /// A page of the journal's fragments (FRAGMENTS, PROTOCOL §9.5): those
    /// beginning at or after `from`, sorted by begin, local copies first.
    /// At most `limit` of them, except that fragments beginning where the
    /// page's last one does are never split across pages. Returns the page
    /// and whether fragments beginning after its last remain. The work is
    /// bounded by the page, not by the index: a journal's store may hold
    /// hundreds of thousands of fragments, and the shard serves appends
    /// meanwhile.
    pub fn fragments_page(
        &self,
        j: &JournalRef,
        from: u64,
        limit: usize,
    ) -> (serde_json::Value, bool) {
        let jm = j.borrow();
        let limit = limit.max(1);
        let mut out: Vec<(u64, bool, serde_json::Value)> = jm
            .fragments
            .iter()
            .filter(|f| f.begin >= from)
            .map(|f| (f.begin, false, fragment_json(f, jm.has_stores())))
            .collect();
        // The index is sorted by begin: take a page's worth from `from`,
        // and the rest of the last begin's fragments.
        let first = jm.remote.partition_point(|r| r.begin < from);
        let mut last = (first + limit).min(jm.remote.len());
        while last < jm.remote.len()
            && last > first
            && jm.remote[last].begin == jm.remote[last - 1].begin
        {
            last += 1;
        }
        let remote_left = last < jm.remote.len();
        for r in &jm.remote[first..last] {
            out.push((
                r.begin,
                true,
                serde_json::json!({
                    "begin": r.begin,
                    "end": r.end,
                    "sha1": hex::encode(r.sha1),
                    "codec": r.codec,
                    "size": r.size,
                    "store": r.store,
                    "key": r.key,
                    "path": r.key,
                    "mod_time": unix_secs(r.mod_time),
                    "open": false,
                }),
            ));
        }
        if let Some(spool) = jm
            .spool
            .as_ref()
            .filter(|s| !s.is_empty() && s.begin() >= from)
        {
            out.push((
                spool.begin(),
                false,
                serde_json::json!({
                    "begin": spool.begin(),
                    "end": spool.committed(),
                    "sha1": hex::encode(spool.committed_sha1()),
                    "codec": "none",
                    "size": spool.len(),
                    "store": "local",
                    "path": spool.path().display().to_string(),
                    "mod_time": unix_secs(SystemTime::now()),
                    "open": true,
                }),
            ));
        }
        out.sort_by_key(|(begin, remote, _)| (*begin, *remote));
        let mut cut = out.len().min(limit);
        while cut < out.len() && cut > 0 && out[cut].0 == out[cut - 1].0 {
            cut += 1;
        }
        let more = cut < out.len() || remote_left;
        out.truncate(cut);
        let page = out.into_iter().map(|(_, _, v)| v).collect();
        (serde_json::Value::Array(page), more)
    }

    pub fn registers_of(&self, j: &JournalRef) -> LabelSet {
        j.borrow().registers.clone()
    }
}

/// A journal whose batch is being written while the next one is staged.
/// While the write is in flight, `other` holds the batch being written and
/// the journal's `staged` the next one; [`Held::swap_back`] trades them
/// once the write is done, leaving the next batch in `other`.
struct Held {
    j: JournalRef,
    other: Vec<Staged>,
    other_with_replicas: bool,
}

impl Held {
    fn swap_back(&mut self) {
        let mut jm = self.j.borrow_mut();
        std::mem::swap(&mut jm.staged, &mut self.other);
        std::mem::swap(&mut jm.staged_with_replicas, &mut self.other_with_replicas);
    }
}

/// Why a broker refuses a SYNC whose route is not its own.
pub(crate) fn route_disagreement(
    me: &str,
    route: &crate::topology::Route,
    req: &rotary_net::repl::SyncRequest,
) -> String {
    format!(
        "broker {me} computes the route {:?} for {}, the primary sent {:?}",
        route.ids(),
        req.journal,
        req.route
    )
}

/// Lets every other ready task of the shard run once.
async fn yield_now() {
    let mut yielded = false;
    std::future::poll_fn(|cx| {
        if yielded {
            std::task::Poll::Ready(())
        } else {
            yielded = true;
            cx.waker().wake_by_ref();
            std::task::Poll::Pending
        }
    })
    .await
}

/// Answers a committed append OK, unless it was answered already: a
/// replica's append with an ack to its primary, a client's with its reply.
fn answer_ok(s: &Staged) {
    if s.op.finished.replace(true) {
        return;
    }
    if let Some(r) = &s.op.replica {
        r.sink.push(s.seq, Status::OK, Vec::new());
        return;
    }
    let mut reply = AppendReply {
        begin: s.begin,
        end: s.end,
        write_head: s.end,
        sha1: [0; 20],
        registers: s.registers.clone(),
    };
    let send = |op: &AppendOp, reply: &AppendReply| {
        op.outbox.frame(
            Op::APPEND_REPLY,
            Status::OK,
            op.request_id,
            &reply.encode(),
            &[],
        )
    };
    let pending = match &s.sha1 {
        Digest::Ready(sha1) => Ok(*sha1),
        Digest::Pending(rx) => rx.try_recv().map_err(|_| rx.clone()),
    };
    let pending = match pending {
        Ok(sha1) => {
            reply.sha1 = sha1;
            return send(&s.op, &reply);
        }
        Err(pending) => pending,
    };
    // The hasher is still at it (the append committed before its last
    // bytes were hashed): answer once it is done.
    let op = s.op.clone();
    let promise = op.outbox.promise();
    compio::runtime::spawn(async move {
        match pending.recv().await {
            Ok(sha1) => {
                reply.sha1 = sha1;
                send(&op, &reply);
                drop(promise);
            }
            // The hasher stops the process before it drops a digest.
            Err(_) => unreachable!("the hasher dropped a committed append's digest"),
        }
    })
    .detach();
}

/// Waits while appends answered to their appenders are still being
/// written to the spool, until they are readable.
async fn settle_answered(j: &JournalRef) {
    loop {
        let l = {
            let jm = j.borrow();
            if jm.deleted || jm.head >= jm.answered {
                return;
            }
            jm.committed.listen()
        };
        // The turn publishes the batch as soon as its write completes.
        l.await;
    }
}

/// What wakes a waiting read: a commit or a new store listing of its
/// journal, a CANCEL, its connection closing, or the broker stopping. Call
/// it before the last check of what the read waits for, so nothing in
/// between is missed, then await it.
fn read_wakeup(
    j: &JournalRef,
    cancel: &crate::conn::Cancel,
    outbox: &Outbox,
    stopping: &Event,
) -> impl std::future::Future<Output = ()> {
    let commit = j.borrow().committed.listen();
    let cancelled = cancel.event.listen();
    // Not `drained`, which fires after every write of the connection's
    // outbox: a tailing reader would wake once more for each chunk it sent.
    let closed = outbox.closing.listen();
    let stopped = stopping.listen();
    async move {
        let (a, b, c, d) = (
            std::pin::pin!(commit),
            std::pin::pin!(cancelled),
            std::pin::pin!(closed),
            std::pin::pin!(stopped),
        );
        futures_util::future::select(
            futures_util::future::select(a, b),
            futures_util::future::select(c, d),
        )
        .await;
    }
}

/// Takes the journal's open append back out of its spool (and out of its
/// replicas'): the next append begins where the last commit ended. Only
/// between batches (nothing staged in this turn but the open append).
fn abandon_active(jm: &mut Journal) -> Option<Active> {
    let a = jm.active.take()?;
    jm.tail.truncate(a.start.offset);
    if let Some(spool) = jm.spool.as_mut() {
        spool.rewind(a.start.clone());
    }
    send_rollback(jm.repl.as_ref(), &jm.name, a.seq);
    jm.staged_head = jm.local_head;
    jm.staged_registers = jm.local_registers.clone();
    Some(a)
}

/// Tells replicas to forget an append whose content they may hold.
fn send_rollback(repl: Option<&PrimaryRepl>, journal: &str, seq: u64) {
    if let Some(r) = repl {
        for (p, _) in &r.pipelines {
            p.push(&Record::Rollback { seq, journal });
        }
    }
}

fn drop_budget(op: &crate::journal::AppendOp) {
    let mut chunks = op.chunks.borrow_mut();
    for c in chunks.drain(..) {
        op.budget.release(c.range.len());
    }
}

fn unix_secs(t: SystemTime) -> u64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs()
}

/// A sealed local fragment as FRAGMENTS and SEAL answer it. `uploaded` is
/// there only for a journal with stores: a fragment of one without stays
/// local, and `false` would read as an upload still to come. `damaged`
/// says why a file is no longer read (see [`LocalFragment::corrupt`]).
fn fragment_json(f: &LocalFragment, has_stores: bool) -> serde_json::Value {
    let mod_time = unix_secs(f.sealed_at);
    let mut json = serde_json::json!({
        "begin": f.begin,
        "end": f.end,
        "sha1": hex::encode(f.sha1),
        "codec": "none",
        "size": f.end - f.begin,
        "store": "local",
        "path": f.path.display().to_string(),
        "mod_time": mod_time,
        "open": false,
    });
    if has_stores {
        json["uploaded"] = f.uploaded.into();
    }
    if let Some(why) = &f.corrupt {
        json["damaged"] = why.as_str().into();
    }
    json
}
