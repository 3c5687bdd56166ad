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

mod disk;
mod flusher;
mod history;
mod lifecycle;
mod primary;
mod read;
mod recover;
mod replica;
mod stage;

pub(crate) use history::refuse_unlisted;
pub use read::{Cancel, ReadAsk};

use crate::append::{
    AbortReason, Active, AppendOp, AppendSha, Digest, InFlight, PrimaryRepl, Staged, Wait,
    APPEND_IDLE_TIMEOUT,
};
use crate::journal::{FileRef, Journal, SharedWork};
use crate::metrics::{self, Metrics};
use crate::outbox::Outbox;
use crate::pipeline::{Failure, Pipeline};
use crate::specs::SpecStore;
use crate::topology::{ClusterView, Member, Route, Topology};
use event_listener::Event;
use futures_util::future::join_all;
use rotary_net::repl::Record;
use rotary_net::spec::{Durability, JournalFlags, LabelSet};
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
    pub(crate) index: u32,
    pub(crate) shards: u32,
    pub(crate) dir: PathBuf,
    pub(crate) specs: Arc<SpecStore>,
    pub(crate) metrics: Arc<Metrics>,
    /// Listen address of every shard of this broker.
    pub(crate) endpoints: Vec<std::net::SocketAddr>,
    pub(crate) disk_reserve_bytes: u64,
    journals: RefCell<HashMap<String, JournalRef>>,
    specs_seen: Cell<u64>,
    /// The spec store's version when the tick last looked for journals
    /// whose specs were deleted (see `Shard::drop_deleted_journals`).
    drops_seen: Cell<u64>,
    log: RefCell<Option<CommitLog>>,
    /// Notified when the flusher puts the commit log back after taking it
    /// out for an await (an fdatasync, a compaction's switch): see
    /// [`Shard::record_deletion`].
    log_back: Event,
    /// Last committed state of every journal, as in the commit log.
    states: RefCell<HashMap<String, JournalState>>,
    /// Journals whose batch failed after its commit record may have been
    /// written, or that were deleted, and whose restatement (their state in
    /// `states`, or their deletion if they have none) the log has yet to
    /// hold: see [`Shard::restate`].
    unrestated: RefCell<std::collections::BTreeSet<String>>,
    /// The last write of restatements failed: the next waits
    /// [`RESTATE_RETRY_DELAY`], not for the next turn.
    restate_failed: Cell<bool>,
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
    pub(crate) uploader: Uploader,
    upload_done: async_channel::Sender<UploadDone>,
    upload_done_rx: RefCell<Option<async_channel::Receiver<UploadDone>>>,
    /// Sealed bytes of journals with stores not yet in their store.
    unuploaded_bytes: Cell<u64>,
    /// Why every journal of the shard is parked: its commit log's disk
    /// failed for good (see `disk`).
    log_disk_failed: RefCell<Option<String>>,
    /// Store listings running ([`Shard::refresh_listing`]).
    listings_in_flight: Cell<usize>,
    /// Journals whose listing waits for one of those to end.
    listings_waiting: RefCell<VecDeque<JournalRef>>,
    spool_budget_bytes: u64,
    local_cache_bytes: u64,
    /// Files of uploaded fragments kept for new spools.
    spares: RefCell<crate::spares::Spares>,
    /// Append content its connections hold queued, against its share.
    pub(crate) append_queue: Rc<crate::budget::QueueBudget>,
    /// The last upload error, named in refusals while the budget is spent.
    store_error: RefCell<Option<String>>,
    me: RefCell<std::rc::Weak<Shard>>,
    sizing: SpoolSizing,
    topology: Arc<Topology>,
    /// See `ServeConfig::peer_silence`.
    pub(crate) peer_silence: std::time::Duration,
    /// See `ServeConfig::offset_jump_age`.
    pub(crate) offset_jump_age: std::time::Duration,
    /// See `ServeConfig::min_append_rate`.
    min_append_rate: u64,
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

/// New bytes of one journal's batch that its commit record may carry, so
/// that the batch is answered without waiting for its spool write.
const INLINE_BYTES_MAX: u64 = 32 << 10;
const _: () = assert!(INLINE_BYTES_MAX as usize <= rotary_storage::wal::RECORD_INLINE_BYTES_MAX);
/// New bytes of a whole turn beyond which no record carries any: a turn
/// that busy is bound by the CPU, which copying every byte into the log as
/// well would only slow, and its write is shared by many appends.
const INLINE_TURN_BYTES_MAX: u64 = 64 << 10;
/// Most store listings a shard runs at once ([`Shard::refresh_listing`]).
const LISTINGS_IN_FLIGHT_MAX: usize = 32;

/// The most a replica copies from its primary at a SYNC to fill the
/// appends it missed (see `Shard::fill_from_primary`); one further behind
/// starts at the primary's head and reads what lies before from the store.
const SYNC_FILL_BYTES_MAX: u64 = 64 << 20;
/// Tries a replica makes at sealing its spool for one SYNC, the later ones
/// at once after a failure that may pass (see `Shard::seal_for_sync`).
const SYNC_SEAL_TRIES_MAX: u32 = 3;

/// How long a broker waits for its etcd watch to reach the revision a
/// request or a SYNC was routed at before it refuses with WRONG_ROUTE.
pub const ROUTE_REVISION_WAIT: std::time::Duration = std::time::Duration::from_secs(2);
/// How often that wait looks at the view again.
const ROUTE_REVISION_POLL: std::time::Duration = std::time::Duration::from_millis(2);
/// How long a primary waits before retrying a SYNC that timed out, or
/// failed twice in a row (the first other failure is tried again at the
/// next append); appends meanwhile are answered with its failure.
const SYNC_RETRY: std::time::Duration = std::time::Duration::from_millis(250);
/// The first pause after a SYNC failed twice in a row (a replica that
/// refuses, say while it restarts): it doubles with each failure after,
/// up to [`SYNC_RETRY`], so that a replica back within moments costs a
/// few refused appends rather than a quarter of a second of them.
const SYNC_RETRY_FIRST: std::time::Duration = std::time::Duration::from_millis(10);

/// How long a journal's appends are answered with its last SYNC failure
/// before the next SYNC: none after the first failure in a row (unless
/// the replica did not answer at all), then [`SYNC_RETRY_FIRST`] doubling
/// up to [`SYNC_RETRY`]. `failures`: the failures in a row, this one
/// counted.
fn sync_retry_after(failures: u32, timed_out: bool) -> std::time::Duration {
    assert!(failures > 0, "a pause after no failure");
    if timed_out {
        return SYNC_RETRY;
    }
    match failures {
        1 => std::time::Duration::ZERO,
        n => SYNC_RETRY_FIRST
            .saturating_mul(1 << (n - 2).min(16))
            .min(SYNC_RETRY),
    }
}
/// How long the flusher waits, with nothing else to do, before it writes
/// again restatements whose last write failed (a full disk, say): one
/// try per delay, not a loop on the failing log.
const RESTATE_RETRY_DELAY: std::time::Duration = std::time::Duration::from_millis(100);
/// A turn that takes this long is logged with the time of each phase and
/// counted in `slow_turns`.
const SLOW_TURN: std::time::Duration = std::time::Duration::from_millis(50);
// `slow_turns`' help text and docs/OPERATIONS.md name the threshold.
const _: () = assert!(SLOW_TURN.as_millis() == 50);
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
    pub peer_silence: std::time::Duration,
    pub offset_jump_age: std::time::Duration,
    /// See `ServeConfig::min_append_rate`.
    pub min_append_rate: u64,
    /// See `ServeConfig::replica_ack_timeout`.
    pub replica_ack_timeout: std::time::Duration,
    /// See `ServeConfig::ack_poll`.
    pub ack_poll: std::time::Duration,
    /// Hashes large appends' own SHA-1 off the shard's thread; `None` on a
    /// broker with one core.
    pub hasher: Option<crate::hasher::Hasher>,
    /// The clock the shard's thread reads; installed by the thread that
    /// runs the shard, before it opens it.
    pub clock: crate::clock::Clock,
    /// See `ServeConfig::faults`; installed beside the clock.
    pub faults: Option<Arc<dyn rotary_storage::faults::Faults>>,
}

/// How long a presigned location handed to a direct reader stays valid.
const LOCATION_TTL: std::time::Duration = std::time::Duration::from_secs(600);

/// Directories of deleted journals, until the reaper removes them, are
/// `<shard dir>/<TRASH_PREFIX><unique>`.
const TRASH_PREFIX: &str = "deleted-";

fn trash_dir(shard_dir: &std::path::Path) -> PathBuf {
    static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let nanos = crate::clock::wall()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    shard_dir.join(format!("{TRASH_PREFIX}{nanos:x}-{n}"))
}

fn journal_dir(shard_dir: &std::path::Path, name: &str) -> PathBuf {
    // `@` never occurs in journal names, so `a/b`'s files never mix with
    // the directory of journal `a/b/c`.
    shard_dir.join("journals").join(name).join("@")
}

/// Walks the directories below `shard_dir/journals`, handing each entry
/// to `visit` with its directory and whether it is one; `visit` says
/// whether to go into a directory, or stops the walk with `Err(())`.
fn walk_journals(
    shard_dir: &std::path::Path,
    mut visit: impl FnMut(&std::path::Path, &std::fs::DirEntry, bool) -> Result<bool, ()>,
) -> Result<(), crate::EngineError> {
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
            match visit(&dir, &entry, kind.is_dir()) {
                Ok(true) => dirs.push(entry.path()),
                Ok(false) => {}
                Err(()) => return Ok(()),
            }
        }
    }
    Ok(())
}

/// Some file of a journal (spool, fragment, copy) in the shard directory
/// `shard_dir`, if there is one.
fn first_journal_file(shard_dir: &std::path::Path) -> Result<Option<PathBuf>, crate::EngineError> {
    let mut found = None;
    walk_journals(shard_dir, |_, entry, is_dir| match is_dir {
        true => Ok(true),
        false => {
            found = Some(entry.path());
            Err(())
        }
    })?;
    Ok(found)
}

/// The journals with a directory in the shard directory `shard_dir`: each
/// `@` directory below `journals/` names one by its path there
/// (`journals/a/b/@` is journal `a/b`).
fn journals_on_disk(shard_dir: &std::path::Path) -> Result<Vec<String>, crate::EngineError> {
    let root = shard_dir.join("journals");
    let mut found = Vec::new();
    walk_journals(shard_dir, |dir, entry, is_dir| {
        if !is_dir {
            return Ok(false);
        }
        if entry.file_name() != "@" {
            return Ok(true);
        }
        if let Some(name) = dir.strip_prefix(&root).ok().and_then(|p| p.to_str()) {
            if !name.is_empty() {
                found.push(name.to_string());
            }
        }
        Ok(false)
    })?;
    Ok(found)
}

/// Removes `dir` and its parents up to `root` (not `root` itself) while
/// they are empty.
fn remove_empty_dirs(mut dir: &std::path::Path, root: &std::path::Path) {
    while dir != root && dir.starts_with(root) && std::fs::remove_dir(dir).is_ok() {
        let Some(parent) = dir.parent() else { return };
        dir = parent;
    }
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
    } else if !e.is_retryable() {
        Status::DISK_FAILED
    } else {
        Status::IO_ERROR
    }
}

impl Shard {
    /// What a client asking for a journal this broker does not know is
    /// told.
    pub fn unknown_journal(&self, name: &str) -> (Status, String) {
        (
            Status::JOURNAL_NOT_FOUND,
            format!("journal {name:?} does not exist"),
        )
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
            j.queue.rate.set_rate(spec.max_append_rate);
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
        j.primary.first_sync_pending = true;
        let state = self.states.borrow().get(&name).cloned();
        if let Some(st) = &state {
            j.heads.set_registers(st.registers.clone());
        }
        self.adopt_files(&mut j, state.as_ref());
        map.insert(name, Rc::new(RefCell::new(j)));
    }

    pub fn mark_ready(&self, j: &JournalRef) {
        self.ready.borrow_mut().push(j.clone());
        self.wake.notify(1);
    }

    /// The current cluster view.
    pub fn view(&self) -> Arc<ClusterView> {
        // Only the current view: not a copy of the earlier ones, on every
        // request.
        self.fresh_views().current.clone()
    }

    /// Where views come from (and, in a cluster on etcd, the control thread).
    pub fn topology(&self) -> &Arc<Topology> {
        &self.topology
    }

    /// Waits until this broker's view of the cluster has reached etcd
    /// revision `revision` (one a client or a peer read a route at), for
    /// at most [`ROUTE_REVISION_WAIT`]; whether it has. Routes come from
    /// the control thread's watch, so a broker behind by a moment catches
    /// up within milliseconds; one cut off from etcd does not.
    pub async fn await_revision(&self, revision: u64) -> bool {
        // Most requests name none (a single node, a cluster file).
        if revision == 0 || self.view().revision() >= revision {
            return true;
        }
        let started = crate::clock::now();
        loop {
            compio::time::sleep(ROUTE_REVISION_POLL).await;
            if self.view().revision() >= revision {
                metrics::add(&self.metrics.route_revision_waits, 1);
                return true;
            }
            if crate::clock::now().duration_since(started) >= ROUTE_REVISION_WAIT {
                metrics::add(&self.metrics.route_revision_timeouts, 1);
                return false;
            }
        }
    }

    /// Why a request at `revision` is refused by a broker whose watch has
    /// not reached it (see [`Shard::await_revision`]).
    pub fn behind_message(&self, revision: u64) -> String {
        format!(
            "broker {} has read the cluster at etcd revision {}, behind the request's {revision}, and its watch did not catch up within {:?}",
            self.view().me,
            self.view().revision(),
            ROUTE_REVISION_WAIT
        )
    }

    /// The current view and the ones before it.
    pub fn views(&self) -> crate::topology::Views {
        self.fresh_views().clone()
    }

    /// The shard's copy of the views, brought up to the topology's version.
    fn fresh_views(&self) -> std::cell::RefMut<'_, crate::topology::Views> {
        let v = self.topology.version();
        let mut cur = self.view.borrow_mut();
        if cur.version != v {
            *cur = self.topology.views();
        }
        cur
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
        route_revision: 0,
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

/// Takes the journal's open append back out of its spool (and out of its
/// replicas'): the next append begins where it began. The queue's front
/// stays for the caller to pop or keep.
fn abandon_active(jm: &mut Journal) -> Option<Active> {
    let a = jm.queue.active.take()?;
    roll_back_open(jm, &a);
    Some(a)
}

/// Takes an open append, out of the queue already, back out of its spool,
/// the tail readers see and its replicas' spools. The staged head and
/// registers stay: an open append moves neither until it is whole
/// (`Shard::finish_whole`), and the appends staged or awaiting ahead of it
/// in this turn, which end where it begins, stay staged. Going back to
/// the local commit instead would leave them beyond the staged head.
fn roll_back_open(jm: &mut Journal, a: &Active) {
    assert!(
        jm.heads.staged_head() == a.start.offset,
        "journal {}: open append began at {} but staged_head is {}",
        jm.name,
        a.start.offset,
        jm.heads.staged_head()
    );
    jm.readers.tail.truncate(a.start.offset);
    if let Some(spool) = jm.files.spool.as_mut() {
        spool.rewind(a.start.clone());
    }
    send_rollback(jm.primary.repl.as_ref(), &jm.name, a.seq);
}

/// Rewinds a replica's copy to `start` once the appends staged from there
/// are answered: its open append, if any, is answered by `answer` and
/// leaves the queue; the tail cache, the staged head and the spool go
/// back to `start`.
fn rewind_replica_to(jm: &mut Journal, start: CommitPoint, answer: impl FnOnce(&AppendOp)) {
    if let Some(a) = jm.queue.active.take() {
        answer(&a.op);
        drop_budget(&a.op);
        jm.queue.waiting.pop_front();
    }
    jm.readers.tail.truncate(start.offset);
    jm.set_staged_head(start.offset);
    if let Some(spool) = jm.files.spool.as_mut() {
        spool.rewind(start);
    }
}

/// The reply of an append rolled back before it was staged whole
/// (`CANCELLED`, `APPEND_TIMEOUT`, ...): the write head and registers the
/// next append would be checked against, as `WRONG_APPEND_OFFSET` and
/// `REGISTER_MISMATCH` replies carry them. Those readers see, or those
/// committed here, lag what was answered while a batch answered from the
/// commit log waits for its spool write.
fn rolled_back_reply(jm: &Journal) -> AppendReply {
    AppendReply {
        write_head: jm.heads.staged_head(),
        registers: jm.heads.staged_registers().clone(),
        ..Default::default()
    }
}

/// Tells replicas to forget an append whose content they may hold.
fn send_rollback(repl: Option<&PrimaryRepl>, journal: &str, seq: u64) {
    if let Some(r) = repl {
        for (p, _) in &r.pipelines {
            p.push(&Record::Rollback { seq, journal });
        }
    }
}

fn drop_budget(op: &crate::append::AppendOp) {
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

#[cfg(test)]
mod tests {
    #[test]
    fn sync_retries_start_short_and_grow() {
        use super::{sync_retry_after, SYNC_RETRY};
        use std::time::Duration;
        let ms = |n| sync_retry_after(n, false).as_millis();
        assert_eq!(
            [ms(1), ms(2), ms(3), ms(4), ms(5), ms(6), ms(7)],
            [0, 10, 20, 40, 80, 160, 250]
        );
        assert_eq!(sync_retry_after(40, false), SYNC_RETRY);
        assert_eq!(
            sync_retry_after(1, true),
            SYNC_RETRY,
            "a replica that did not answer"
        );
        assert!(sync_retry_after(u32::MAX, false) <= Duration::from_millis(250));
    }
}
