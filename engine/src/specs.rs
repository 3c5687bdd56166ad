//! The journal spec store of a broker, shared by every shard behind a lock.
//! Specs change rarely and never on the data path; shards notice changes
//! through `version` and refresh their local copies.
//!
//! On disk the store is a snapshot, `<data>/specs.json`, and a change log
//! beside it, `<data>/specs.<generation>.log`, which the snapshot names.
//! Each change is one line of JSON appended to the log and fdatasynced
//! before it takes effect, so a change costs its own bytes, not those of
//! every spec (a broker of 60,000 journals has a snapshot of tens of
//! megabytes). Once the log outgrows the snapshot, later changes go to a
//! new log while a thread of the store's own writes a new snapshot naming
//! that log (from a copy of the specs, taken in a few milliseconds, so the
//! shard that made the change does not wait for it); once the snapshot is
//! in place, older logs are removed. A start reads the snapshot and
//! replays the log it names and every later one, in order; a last line cut
//! short by a crash is a change that was never acknowledged and is left
//! out.
//!
//! Every change has a revision. A single node's store counts them: each
//! change made here takes one more than the highest revision the store
//! holds (a store written when revisions were wall-clock nanoseconds goes
//! on counting from there). A broker of a cluster on etcd mirrors etcd's
//! items here at their etcd revisions, and one of a cluster file mirrors
//! the file's journals; neither changes the store otherwise. A deletion
//! removes the spec; its record in the change log carries its revision,
//! and nothing of it stays in the store.

use crate::EngineError;
use rotary_net::spec::JournalSpec;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::fs::File;
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// The largest revision a change may carry (etcd's are `i64`), so that
/// one past every revision a store has seen is still a revision.
pub const REVISION_MAX: u64 = i64::MAX as u64;

/// Refuses a revision sent by a primary (or anyone speaking for one) that
/// no store could have issued.
pub fn check_revision(revision: u64) -> Result<u64, String> {
    if revision > REVISION_MAX {
        Err(format!(
            "revision {revision} is beyond the largest a change may carry, {REVISION_MAX}"
        ))
    } else {
        Ok(revision)
    }
}

/// A spec and the revision that set it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Revised {
    pub revision: u64,
    pub spec: JournalSpec,
}

/// A deletion: the journal's name and the revision it was deleted at.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Deletion {
    pub name: String,
    pub revision: u64,
}

#[derive(Default)]
struct State {
    /// Shared with the snapshot being written, if any.
    specs: BTreeMap<String, Arc<Revised>>,
    /// The names each recent change touched, by the version it made,
    /// oldest first (see [`SpecStore::changes_since`]).
    changes: VecDeque<(u64, Vec<String>)>,
    /// The change log that changes go to: the one the snapshot names or
    /// a later one (none before the first snapshot written with one).
    log: Option<ChangeLog>,
    /// Bytes of the snapshot last written or read.
    snapshot_len: u64,
    /// The highest revision of any change taken, deletions included, so
    /// that a revision is never issued twice, even after the spec that
    /// carried it was deleted.
    high: u64,
    /// The highest log generation on disk or written.
    generation: u64,
    /// Logs of earlier snapshots, removed with the first snapshot.
    stale_logs: Vec<PathBuf>,
    /// The snapshot thread is writing a snapshot.
    snapshotting: bool,
    /// The XOR of [`entry_digest`] over `specs`: equal in two stores that
    /// hold the same specs, whatever their revisions.
    digest: u128,
}

impl State {
    fn put_spec(&mut self, revised: Arc<Revised>) {
        self.digest ^= entry_digest(&revised);
        if let Some(old) = self.specs.insert(revised.spec.name.clone(), revised) {
            self.digest ^= entry_digest(&old);
        }
    }

    fn remove_spec(&mut self, name: &str) {
        if let Some(old) = self.specs.remove(name) {
            self.digest ^= entry_digest(&old);
        }
    }
}

/// 128 bits of the SHA-1 of a spec's name and its content (its JSON), not
/// its revision: brokers count revisions on their own when their specs come
/// from a cluster file, and must still show the same digest for the same
/// specs.
fn entry_digest(revised: &Revised) -> u128 {
    use sha1::Digest;
    let mut h = sha1::Sha1::new();
    h.update(revised.spec.name.as_bytes());
    h.update([0]);
    h.update(serde_json::to_vec(&revised.spec).expect("a spec serializes"));
    let sum = h.finalize();
    u128::from_le_bytes(sum[..16].try_into().expect("20 bytes"))
}

/// Most names the change history keeps, over all its changes: beyond it
/// the oldest changes are dropped, and a shard that has not caught up
/// with them looks at every spec instead.
const CHANGED_NAMES_KEPT: usize = 1 << 18;

/// The change log may grow to the snapshot's size, and to this much
/// however small the snapshot, before a change writes a new snapshot.
const LOG_BYTES_MIN: u64 = 1 << 20;

/// The snapshot's shape. Before revisions it was a bare array of specs,
/// which is still read (every spec at revision 0), and before change logs
/// it named none. The deletions older snapshots list are not read.
#[derive(Default, Deserialize)]
struct OnDisk {
    specs: Vec<Revised>,
    #[serde(default)]
    log: Option<u64>,
    /// See `State::high` (missing in older snapshots).
    #[serde(default)]
    revision: u64,
}

/// The snapshot as written, borrowing the store's specs.
#[derive(Serialize)]
struct Snapshot<'a> {
    specs: Vec<&'a Revised>,
    log: u64,
    revision: u64,
}

impl Snapshot<'_> {
    fn bytes(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("specs serialize")
    }
}

/// A snapshot for the snapshot thread to write: the store as of the end
/// of the log before `generation`.
struct Job {
    generation: u64,
    specs: Vec<Arc<Revised>>,
    revision: u64,
}

/// What became of a [`Job`]: the snapshot's length once it is in place.
struct Done {
    generation: u64,
    written: Result<u64, EngineError>,
}

/// One change: a line of the change log (see [`Change::record`]).
#[derive(Default, Serialize, Deserialize)]
struct Change {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    specs: Vec<Revised>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    deleted: Vec<Deletion>,
}

impl Change {
    /// The change as a line of the log: the CRC-32C of its JSON in eight
    /// hex digits, a space, the JSON, a newline.
    fn record(&self) -> Vec<u8> {
        let json = serde_json::to_vec(self).expect("a change serializes");
        let mut record = format!("{:08x} ", crc32c::crc32c(&json)).into_bytes();
        record.extend_from_slice(&json);
        record.push(b'\n');
        record
    }

    /// A line of the log, without its newline; `None` if it is damaged.
    fn from_record(line: &[u8]) -> Option<Change> {
        let (crc, json) = (line.get(..8)?, line.get(9..)?);
        let crc = u32::from_str_radix(std::str::from_utf8(crc).ok()?, 16).ok()?;
        if line[8] != b' ' || crc32c::crc32c(json) != crc {
            return None;
        }
        serde_json::from_slice(json).ok()
    }

    fn names(&self) -> Vec<String> {
        let specs = self.specs.iter().map(|r| r.spec.name.clone());
        specs
            .chain(self.deleted.iter().map(|t| t.name.clone()))
            .collect()
    }
}

/// What a name was before a change, to put it back if the change cannot
/// be written.
type Undo = Vec<(String, Option<Arc<Revised>>)>;

struct ChangeLog {
    path: PathBuf,
    file: File,
    /// Bytes of whole records.
    len: u64,
    /// The file may hold bytes past `len` (a record cut short, or a write
    /// that failed): cut off before the next record is written.
    tail_dirty: bool,
}

impl ChangeLog {
    fn append(&mut self, record: &[u8]) -> std::io::Result<()> {
        if self.tail_dirty {
            self.file.set_len(self.len)?;
            self.tail_dirty = false;
        }
        let written = self
            .file
            .write_all_at(record, self.len)
            .and_then(|()| self.file.sync_data());
        match written {
            Ok(()) => {
                self.len += record.len() as u64;
                Ok(())
            }
            Err(e) => {
                self.tail_dirty = true;
                Err(e)
            }
        }
    }
}

pub struct SpecStore {
    path: PathBuf,
    state: Mutex<State>,
    version: AtomicU64,
    /// The highest revision seen or issued.
    clock: AtomicU64,
    /// Neither the snapshot nor a change log existed when the store was
    /// opened.
    file_was_missing: bool,
    /// Journals whose stored specs were no longer valid when the store
    /// was opened, and were left out of it.
    left_out: BTreeSet<String>,
    /// [`CHANGED_NAMES_KEPT`], smaller in tests.
    changed_names_kept: usize,
    /// [`LOG_BYTES_MIN`], smaller in tests.
    log_bytes_min: u64,
    /// To the snapshot thread; taken when the store is dropped.
    jobs: Option<crossbeam_channel::Sender<Job>>,
    done: crossbeam_channel::Receiver<Done>,
    snapshot_thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for SpecStore {
    /// Waits for a snapshot being written, so that a store opened next on
    /// the same directory does not race it.
    fn drop(&mut self) {
        self.jobs.take();
        if let Some(thread) = self.snapshot_thread.take() {
            let _ = thread.join();
        }
    }
}

/// Replays into `state` the change logs beside the snapshot at `path`,
/// from generation `named` (the one the snapshot names) on, and opens the
/// last of them for appending. A missing log of the chain is corruption.
fn replay_logs(
    path: &Path,
    state: &mut State,
    named: u64,
    logs: &[(u64, PathBuf)],
) -> Result<(), EngineError> {
    let chain: Vec<&(u64, PathBuf)> = logs.iter().filter(|(g, _)| *g >= named).collect();
    if chain.first().map(|(g, _)| *g) != Some(named) {
        let why = format!(
            "{} names the change log {}, which is missing",
            path.display(),
            log_path(path, named).display()
        );
        return Err(EngineError::corrupt(path, why));
    }
    if let Some(gap) = chain.windows(2).find(|w| w[1].0 != w[0].0 + 1) {
        let why = format!(
            "the change log {} follows {}, but the one between them is missing",
            gap[1].1.display(),
            gap[0].1.display()
        );
        return Err(EngineError::corrupt(&gap[1].1, why));
    }
    for (i, (_, log_path)) in chain.iter().enumerate() {
        let (changes, len, file_len) = read_log(log_path).map_err(|e| match e {
            LogError::Missing => EngineError::corrupt(
                log_path,
                format!(
                    "the change log {} went missing while it was read",
                    log_path.display()
                ),
            ),
            LogError::Io(e) => EngineError::Io(log_path.clone(), e),
            LogError::Damaged(at) => EngineError::corrupt(
                log_path,
                format!(
                    "{}: the record at byte {at} is damaged, and records follow it",
                    log_path.display()
                ),
            ),
        })?;
        for change in &changes {
            apply(state, change, None);
        }
        if i + 1 == chain.len() {
            let file = std::fs::OpenOptions::new()
                .write(true)
                .open(log_path)
                .map_err(|e| EngineError::Io(log_path.clone(), e))?;
            state.log = Some(ChangeLog {
                path: log_path.clone(),
                file,
                len,
                tail_dirty: file_len > len,
            });
        }
    }
    Ok(())
}

impl SpecStore {
    /// Reads the snapshot at `path` and replays the change log it names.
    /// A data directory that contradicts itself (the named log missing, a
    /// log without a snapshot, a damaged record before the last) is
    /// [`EngineError::Corrupt`], and nothing is changed on disk.
    pub fn open(path: PathBuf) -> Result<SpecStore, EngineError> {
        // The snapshot is replaced whole by a rename: one that does not
        // parse was damaged.
        let bad =
            |e: serde_json::Error| EngineError::corrupt(&path, format!("{}: {e}", path.display()));
        let logs = logs_beside(&path)?;
        let (disk, snapshot_len) = match std::fs::read(&path) {
            Ok(bytes) => {
                let disk = match serde_json::from_slice::<Vec<JournalSpec>>(&bytes) {
                    Ok(list) => OnDisk {
                        specs: list
                            .into_iter()
                            .map(|spec| Revised { revision: 0, spec })
                            .collect(),
                        ..OnDisk::default()
                    },
                    Err(_) => serde_json::from_slice(&bytes).map_err(bad)?,
                };
                (Some(disk), bytes.len() as u64)
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => (None, 0),
            Err(e) => return Err(EngineError::Io(path, e)),
        };
        let file_was_missing = disk.is_none() && logs.is_empty();
        if disk.is_none() {
            if let Some((_, log)) = logs.first() {
                let why = format!(
                    "{} is missing, but its change log {} is there",
                    path.display(),
                    log.display()
                );
                return Err(EngineError::corrupt(path, why));
            }
        }
        let disk = disk.unwrap_or_default();
        let mut state = State {
            specs: disk
                .specs
                .into_iter()
                .map(|r| (r.spec.name.clone(), Arc::new(r)))
                .collect(),
            snapshot_len,
            high: disk.revision,
            generation: logs.iter().map(|(g, _)| *g).max().unwrap_or(0),
            ..State::default()
        };
        if let Some(named) = disk.log {
            replay_logs(&path, &mut state, named, &logs)?;
        }
        state.stale_logs = logs
            .into_iter()
            .filter(|(g, _)| disk.log.is_none_or(|named| *g < named))
            .map(|(_, p)| p)
            .collect();
        let mut left_out = BTreeSet::new();
        state.specs.retain(|name, r| match r.spec.validate() {
            Ok(()) => true,
            Err(e) => {
                // Stored before a rule tightened: serving it could fail
                // every journal's start, so it is left out until applied
                // again under a valid name or with valid fields.
                tracing::error!(error = %e, "ignoring a stored spec that is no longer valid");
                left_out.insert(name.clone());
                false
            }
        });
        state.digest = state.specs.values().fold(0, |d, r| d ^ entry_digest(r));
        let newest = state
            .specs
            .values()
            .map(|r| r.revision)
            .fold(state.high, u64::max);
        // Started here, before any shard pins its thread, so that it runs
        // on any of the broker's cores.
        let (jobs, job) = crossbeam_channel::unbounded();
        let (finished, done) = crossbeam_channel::unbounded();
        let snapshot_path = path.clone();
        let snapshot_thread = std::thread::Builder::new()
            .name("rotary-specs".into())
            .spawn(move || write_snapshots(&snapshot_path, job, finished))
            .map_err(|e| EngineError::Io(path.clone(), e))?;
        Ok(SpecStore {
            path,
            state: Mutex::new(state),
            version: AtomicU64::new(1),
            clock: AtomicU64::new(newest),
            file_was_missing,
            left_out,
            changed_names_kept: CHANGED_NAMES_KEPT,
            log_bytes_min: LOG_BYTES_MIN,
            jobs: Some(jobs),
            done,
            snapshot_thread: Some(snapshot_thread),
        })
    }

    /// Whether the store had no file when it was opened: a new data
    /// directory, unless shards hold journal data (they check).
    pub fn file_was_missing(&self) -> bool {
        self.file_was_missing
    }

    /// Whether the store held a spec of journal `name` that it left out
    /// when it was opened, as no longer valid: the journal was not
    /// deleted, and the start keeps its files.
    pub fn left_out(&self, name: &str) -> bool {
        self.left_out.contains(name)
    }

    /// The highest revision this store has seen or issued.
    pub fn revision_seen(&self) -> u64 {
        self.clock.load(Ordering::Acquire)
    }

    /// The snapshot's file.
    pub fn path(&self) -> &std::path::Path {
        &self.path
    }

    pub fn version(&self) -> u64 {
        self.version.load(Ordering::Acquire)
    }

    /// A revision later than every one this store has seen: one more
    /// (saturating: a store written before revisions were bounded may hold
    /// a larger one).
    pub fn next_revision(&self) -> u64 {
        let seen = self
            .clock
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |seen| {
                Some(seen.saturating_add(1))
            })
            .expect("always updates");
        seen.saturating_add(1)
    }

    fn observe(&self, revision: u64) {
        self.clock.fetch_max(revision, Ordering::AcqRel);
    }

    pub fn get(&self, name: &str) -> Option<JournalSpec> {
        self.lock().specs.get(name).map(|r| r.spec.clone())
    }

    pub fn get_revised(&self, name: &str) -> Option<Revised> {
        self.lock().specs.get(name).map(|r| Revised::clone(r))
    }

    pub fn all(&self) -> Vec<JournalSpec> {
        self.lock().specs.values().map(|r| r.spec.clone()).collect()
    }

    pub fn all_revised(&self) -> Vec<Revised> {
        self.lock()
            .specs
            .values()
            .map(|r| Revised::clone(r))
            .collect()
    }

    /// How many specs the store holds, and a digest of their names and
    /// contents: two stores with the same count and digest hold the same
    /// specs, whatever revisions each counted.
    pub fn digest(&self) -> (usize, u128) {
        let state = self.lock();
        (state.specs.len(), state.digest)
    }

    /// A page of the store in name order, after the name `after` (`""`:
    /// from the first): at most `limit` of the specs `matches` takes. True
    /// if more follow.
    pub fn page(
        &self,
        after: &str,
        limit: usize,
        matches: impl Fn(&JournalSpec) -> bool,
    ) -> (Vec<Revised>, bool) {
        use std::ops::Bound;
        let state = self.lock();
        let range = (Bound::Excluded(after), Bound::Unbounded);
        let mut specs = state
            .specs
            .range::<str, _>(range)
            .filter(|(_, r)| matches(&r.spec));
        let page: Vec<Revised> = specs
            .by_ref()
            .take(limit)
            .map(|(_, r)| Revised::clone(r))
            .collect();
        let more = page.len() == limit && specs.next().is_some();
        (page, more)
    }

    /// Creates or replaces specs at `revision` (from
    /// [`SpecStore::next_revision`] for a client's change), all or none,
    /// except those this store holds at a later (or the same) revision.
    /// Returns how many it took.
    pub fn apply_at(&self, specs: Vec<JournalSpec>, revision: u64) -> Result<usize, EngineError> {
        let specs = specs
            .into_iter()
            .map(|spec| Revised { revision, spec })
            .collect();
        Ok(self.apply_each(specs)?.len())
    }

    /// As [`SpecStore::apply_at`], each spec at its own revision, in one
    /// change of the store (a mirror of etcd may take tens of thousands at
    /// once). Returns the names of those it took.
    pub fn apply_each(&self, specs: Vec<Revised>) -> Result<Vec<String>, EngineError> {
        if let Some(newest) = specs.iter().map(|r| r.revision).max() {
            self.observe(newest);
        }
        let mut state = self.lock();
        // Decided against the store and the specs taken before in the same
        // change (a name listed twice at one revision is taken once).
        let mut taken: HashMap<String, u64> = HashMap::new();
        let specs: Vec<Revised> = specs
            .into_iter()
            .filter(|Revised { revision, spec }| {
                let known = match taken.get(&spec.name) {
                    Some(&t) => Some(t),
                    None => state.specs.get(&spec.name).map(|r| r.revision),
                };
                let newer_known =
                    known.is_some_and(|k| k > *revision || (k == *revision && k != 0));
                if !newer_known {
                    taken.insert(spec.name.clone(), *revision);
                }
                !newer_known
            })
            .collect();
        let change = Change {
            specs,
            ..Change::default()
        };
        let names = change.names();
        if !names.is_empty() {
            self.commit(&mut state, change)?;
        }
        Ok(names)
    }

    /// Removes the specs of `deletions` in one change of the store, each
    /// unless the store holds it at a later revision than its deletion's.
    /// Returns the names of those it removed.
    pub fn delete_each(&self, deletions: Vec<Deletion>) -> Result<Vec<String>, EngineError> {
        if let Some(newest) = deletions.iter().map(|d| d.revision).max() {
            self.observe(newest);
        }
        let mut state = self.lock();
        let mut deleted: Vec<Deletion> = deletions
            .into_iter()
            .filter(|d| {
                state
                    .specs
                    .get(&d.name)
                    .is_some_and(|r| r.revision <= d.revision)
            })
            .collect();
        deleted.sort_by(|a, b| a.name.cmp(&b.name));
        deleted.dedup_by(|a, b| a.name == b.name);
        let names: Vec<String> = deleted.iter().map(|d| d.name.clone()).collect();
        if !deleted.is_empty() {
            let change = Change {
                deleted,
                ..Change::default()
            };
            self.commit(&mut state, change)?;
        }
        Ok(names)
    }

    /// Deletes a spec at the next revision; false if there was none.
    pub fn delete(&self, name: &str) -> Result<bool, EngineError> {
        let revision = self.next_revision();
        let gone = self.delete_each(vec![Deletion {
            name: name.to_string(),
            revision,
        }])?;
        Ok(!gone.is_empty())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().expect("spec lock")
    }

    /// Makes `change` the store's: applies it and writes it as a record of the change log (or, for the store's
    /// first change, as its first snapshot). If the write fails the change
    /// is undone and the store is as it was. A log that has outgrown the
    /// snapshot then starts the writing of a new one.
    fn commit(&self, state: &mut State, change: Change) -> Result<(), EngineError> {
        self.settle(state);
        let record = change.record();
        let mut undo = Undo::new();
        apply(state, &change, Some(&mut undo));
        // A snapshot renamed into place whose directory could not be
        // synced holds the change all the same: it stays, and the caller
        // hears of the failure.
        let mut unsynced = None;
        let written = match &mut state.log {
            Some(log) => log
                .append(&record)
                .map_err(|e| EngineError::Io(log.path.clone(), e)),
            None => self
                .write_first_snapshot(state)
                .map(|synced| unsynced = synced.err()),
        };
        if let Err(e) = written {
            for (name, spec) in undo.into_iter().rev() {
                match spec {
                    Some(spec) => state.put_spec(spec),
                    None => state.remove_spec(&name),
                };
            }
            return Err(e);
        }
        let version = self.version.fetch_add(1, Ordering::AcqRel) + 1;
        state.changes.push_back((version, change.names()));
        let mut kept: usize = state.changes.iter().map(|(_, n)| n.len()).sum();
        while kept > self.changed_names_kept && state.changes.len() > 1 {
            let (_, dropped) = state.changes.pop_front().expect("more than one change");
            kept -= dropped.len();
        }
        let log_max = state.snapshot_len.max(self.log_bytes_min);
        if !state.snapshotting && state.log.as_ref().is_some_and(|log| log.len > log_max) {
            self.start_snapshot(state);
        }
        match unsynced {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Takes note of the snapshots the snapshot thread has finished.
    fn settle(&self, state: &mut State) {
        while let Ok(done) = self.done.try_recv() {
            state.snapshotting = false;
            match done.written {
                Ok(len) => state.snapshot_len = len,
                // The logs since the snapshot in place are all kept, and
                // the next one is tried once the current log outgrows it.
                Err(e) => tracing::warn!(
                    error = %e,
                    generation = done.generation,
                    "cannot write a snapshot of the journal specs; their change logs are kept"
                ),
            }
        }
    }

    /// Sends later changes to a new, empty log, and hands a copy of the
    /// store as of the end of the current one to the snapshot thread. If
    /// the new log cannot be made, changes stay on the current one.
    fn start_snapshot(&self, state: &mut State) {
        let Some(jobs) = &self.jobs else { return };
        let generation = state.generation + 1;
        let path = log_path(&self.path, generation);
        // The new log's name is synced before any change it holds is
        // answered: a start that did not find it would lose them.
        let dir = self.path.parent().expect("has parent");
        let made = File::create(&path).and_then(|file| sync_dir(dir).map(|()| file));
        let file = match made {
            Ok(file) => file,
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                tracing::warn!(log = %path.display(), error = %e, "cannot start a new spec change log; changes stay on the current one");
                return;
            }
        };
        state.generation = generation;
        state.log = Some(ChangeLog {
            path,
            file,
            len: 0,
            tail_dirty: false,
        });
        state.snapshotting = true;
        let job = Job {
            generation,
            specs: state.specs.values().cloned().collect(),
            revision: state.high,
        };
        if jobs.send(job).is_err() {
            state.snapshotting = false;
        }
    }

    /// Writes `state` as the store's first snapshot with a change log, a
    /// new and empty one, then removes logs left from before. `Err`: the
    /// snapshot is not in place, and nothing changed. `Ok(Err)`: it is in
    /// place, but its directory could not be synced.
    fn write_first_snapshot(
        &self,
        state: &mut State,
    ) -> Result<Result<(), EngineError>, EngineError> {
        let generation = state.generation + 1;
        let log_path = log_path(&self.path, generation);
        let bytes = Snapshot {
            specs: state.specs.values().map(|r| &**r).collect(),
            log: generation,
            revision: state.high,
        }
        .bytes();
        let file = File::create(&log_path).map_err(|e| EngineError::Io(log_path.clone(), e))?;
        let synced = match put_snapshot(&self.path, &bytes) {
            Ok(synced) => synced,
            Err(e) => {
                let _ = std::fs::remove_file(&log_path);
                return Err(e);
            }
        };
        state.stale_logs.retain(|stale| match std::fs::remove_file(stale) {
            Ok(()) => false,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
            Err(e) => {
                tracing::warn!(log = %stale.display(), error = %e, "cannot remove an old spec change log");
                true
            }
        });
        state.generation = generation;
        state.snapshot_len = bytes.len() as u64;
        state.log = Some(ChangeLog {
            path: log_path,
            file,
            len: 0,
            tail_dirty: false,
        });
        Ok(synced)
    }

    /// Waits for the snapshot being written, in tests.
    #[cfg(test)]
    fn wait_for_snapshot(&self) {
        let mut state = self.lock();
        if state.snapshotting {
            let done = self.done.recv().expect("the snapshot thread answers");
            state.snapshotting = false;
            if let Ok(len) = done.written {
                state.snapshot_len = len;
            }
        }
    }

    /// The names of the specs set or deleted since `version` (a value of
    /// [`SpecStore::version`]), each once, or `None` when changes that old
    /// are no longer kept: a shard then looks at every spec. A journal
    /// store of tens of thousands of specs changes a few at a time, and
    /// each shard would otherwise compare them all at every change.
    pub fn changes_since(&self, version: u64) -> Option<Vec<String>> {
        let state = self.lock();
        let now = self.version();
        if version >= now {
            return Some(Vec::new());
        }
        let oldest = state.changes.front().map(|(v, _)| *v)?;
        if oldest > version + 1 {
            return None;
        }
        let mut names: Vec<String> = state
            .changes
            .iter()
            .filter(|(v, _)| *v > version)
            .flat_map(|(_, names)| names.iter().cloned())
            .collect();
        names.sort_unstable();
        names.dedup();
        Some(names)
    }

    /// The change log's generation, in tests.
    #[cfg(test)]
    fn log_generation(&self) -> Option<u64> {
        let state = self.lock();
        state.log.as_ref().map(|_| state.generation)
    }
}

/// The snapshot thread: writes each snapshot it is handed, then removes
/// the change logs before the one it names. It yields its core to every
/// other thread (a snapshot of 60,000 specs is tens of megabytes); the
/// logs grow meanwhile.
fn write_snapshots(
    path: &Path,
    jobs: crossbeam_channel::Receiver<Job>,
    done: crossbeam_channel::Sender<Done>,
) {
    crate::reaper::yield_to_everything();
    for job in jobs {
        let bytes = Snapshot {
            specs: job.specs.iter().map(|r| &**r).collect(),
            log: job.generation,
            revision: job.revision,
        }
        .bytes();
        drop(job.specs);
        let written = put_snapshot(path, &bytes).map(|synced| {
            match synced {
                Ok(()) => remove_logs_before(path, job.generation),
                // Until the directory is synced, a crash can bring back
                // the snapshot before, which needs the older logs.
                Err(e) => tracing::warn!(error = %e, "a new spec snapshot is in place, but not yet synced; older change logs are kept"),
            }
            bytes.len() as u64
        });
        let finished = Done {
            generation: job.generation,
            written,
        };
        if done.send(finished).is_err() {
            return;
        }
    }
}

/// Writes `bytes` to a file beside `path`, syncs it, and renames it over
/// `path`. `Err`: `path` is as it was. `Ok(Err)`: the new file is in
/// place, but the directory could not be synced.
fn put_snapshot(path: &Path, bytes: &[u8]) -> Result<Result<(), EngineError>, EngineError> {
    let tmp = path.with_extension("json.next");
    let write = || -> Result<(), (PathBuf, std::io::Error)> {
        let at = |p: &Path| {
            let p = p.to_path_buf();
            move |e| (p, e)
        };
        let mut f = File::create(&tmp).map_err(at(&tmp))?;
        f.write_all(bytes).map_err(at(&tmp))?;
        f.sync_data().map_err(at(&tmp))?;
        std::fs::rename(&tmp, path).map_err(at(path))
    };
    if let Err((at, e)) = write() {
        let _ = std::fs::remove_file(&tmp);
        return Err(EngineError::Io(at, e));
    }
    let dir = path.parent().expect("has parent");
    Ok(sync_dir(dir).map_err(|e| EngineError::Io(dir.to_path_buf(), e)))
}

fn sync_dir(dir: &Path) -> std::io::Result<()> {
    File::open(dir).and_then(|d| d.sync_all())
}

/// Removes the change logs beside `path` older than `generation`.
fn remove_logs_before(path: &Path, generation: u64) {
    let logs = match logs_beside(path) {
        Ok(logs) => logs,
        Err(e) => {
            tracing::warn!(error = %e, "cannot list old spec change logs");
            return;
        }
    };
    for (_, stale) in logs.into_iter().filter(|(g, _)| *g < generation) {
        if let Err(e) = std::fs::remove_file(&stale) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(log = %stale.display(), error = %e, "cannot remove an old spec change log");
            }
        }
    }
}

/// Applies a change to `state`, noting in `undo` what each name was.
fn apply(state: &mut State, change: &Change, mut undo: Option<&mut Undo>) {
    let mut note = |state: &State, name: &str| {
        if let Some(undo) = undo.as_deref_mut() {
            let spec = state.specs.get(name).cloned();
            undo.push((name.to_string(), spec));
        }
    };
    for r in &change.specs {
        state.high = state.high.max(r.revision);
        note(state, &r.spec.name);
        state.put_spec(Arc::new(r.clone()));
    }
    for t in &change.deleted {
        state.high = state.high.max(t.revision);
        note(state, &t.name);
        state.remove_spec(&t.name);
    }
}

/// The change log of generation `generation` beside the snapshot at `path`.
fn log_path(path: &Path, generation: u64) -> PathBuf {
    path.with_extension(format!("{generation}.log"))
}

/// The change logs beside the snapshot at `path`, by generation.
fn logs_beside(path: &Path) -> Result<Vec<(u64, PathBuf)>, EngineError> {
    let dir = path.parent().expect("has parent");
    let stem = path
        .file_stem()
        .and_then(|s| s.to_str())
        .expect("a snapshot name of UTF-8");
    let entries = match std::fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(EngineError::Io(dir.to_path_buf(), e)),
    };
    let mut logs = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| EngineError::Io(dir.to_path_buf(), e))?;
        let name = entry.file_name();
        let generation = name
            .to_str()
            .and_then(|n| n.strip_prefix(stem))
            .and_then(|n| n.strip_prefix('.'))
            .and_then(|n| n.strip_suffix(".log"))
            .and_then(|g| g.parse::<u64>().ok());
        if let Some(generation) = generation {
            logs.push((generation, entry.path()));
        }
    }
    logs.sort();
    Ok(logs)
}

enum LogError {
    Missing,
    Io(std::io::Error),
    /// Byte offset of a damaged record with whole records after it.
    Damaged(u64),
}

/// The changes of a log, the bytes of its whole records, and the file's
/// length. A last record cut short or damaged is a write that never
/// completed, so never acknowledged: it is left out.
fn read_log(path: &Path) -> Result<(Vec<Change>, u64, u64), LogError> {
    let bytes = std::fs::read(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => LogError::Missing,
        _ => LogError::Io(e),
    })?;
    let mut changes = Vec::new();
    let mut at = 0;
    while let Some(end) = bytes[at..].iter().position(|&b| b == b'\n') {
        let line = &bytes[at..at + end];
        let next = at + end + 1;
        match Change::from_record(line) {
            Some(change) => changes.push(change),
            // A record cut short may have reached the disk with its
            // newline but not all its bytes.
            None if !bytes[next..].contains(&b'\n') => break,
            None => return Err(LogError::Damaged(at as u64)),
        }
        at = next;
    }
    if at < bytes.len() {
        tracing::warn!(log = %path.display(), dropped = bytes.len() - at, "leaving out a spec change cut short");
    }
    Ok((changes, at as u64, bytes.len() as u64))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn changes_since_a_version_name_what_changed_until_they_are_dropped() {
        let (_d, mut s) = store();
        s.changed_names_kept = 4;
        let v0 = s.version();
        assert_eq!(s.changes_since(v0), Some(vec![]));
        s.apply_at(vec![spec("c/b", "x"), spec("c/a", "x")], base() + 1)
            .unwrap();
        let v1 = s.version();
        assert_eq!(v1, v0 + 1);
        assert_eq!(
            s.changes_since(v0),
            Some(vec!["c/a".to_string(), "c/b".to_string()])
        );
        // A change that takes nothing is no change.
        s.apply_at(vec![spec("c/a", "old")], base()).unwrap();
        assert_eq!(s.version(), v1);
        del(&s, "c/b", base() + 2).unwrap();
        s.apply_at(vec![spec("c/a", "y")], base() + 3).unwrap();
        assert_eq!(
            s.changes_since(v1),
            Some(vec!["c/a".to_string(), "c/b".to_string()])
        );
        assert_eq!(s.changes_since(s.version()), Some(vec![]));
        // Four names kept: the first change (two names) is dropped once
        // a fifth name comes, and a shard that saw nothing since must look
        // at every spec.
        s.apply_at(vec![spec("c/d", "x"), spec("c/e", "x")], base() + 4)
            .unwrap();
        assert_eq!(s.changes_since(v0), None);
        assert_eq!(
            s.changes_since(v1),
            Some(["c/a", "c/b", "c/d", "c/e"].map(String::from).to_vec())
        );
    }

    /// Revisions of the changes the tests make.
    fn base() -> u64 {
        1_000
    }

    /// Deletes `name` at `revision`.
    fn del(s: &SpecStore, name: &str, revision: u64) -> Result<Vec<String>, EngineError> {
        s.delete_each(vec![Deletion {
            name: name.to_string(),
            revision,
        }])
    }

    fn spec(name: &str, app: &str) -> JournalSpec {
        let mut s = JournalSpec::new(name);
        s.labels = rotary_net::spec::LabelSet::from_pairs([("app", app)]).expect("labels");
        s
    }

    fn store() -> (tempfile::TempDir, SpecStore) {
        let dir = tempfile::tempdir().expect("tempdir");
        let s = SpecStore::open(dir.path().join("specs.json")).expect("open");
        (dir, s)
    }

    #[test]
    fn a_later_revision_wins_whichever_arrives_first() {
        let (_d, s) = store();
        assert_eq!(
            s.apply_at(vec![spec("a/one", "v2")], base() + 20).unwrap(),
            1
        );
        // An older change arriving late is ignored.
        assert_eq!(
            s.apply_at(vec![spec("a/one", "v1")], base() + 10).unwrap(),
            0
        );
        assert_eq!(s.get("a/one").unwrap().labels, spec("a/one", "v2").labels);
        assert_eq!(
            s.apply_at(vec![spec("a/one", "v3")], base() + 30).unwrap(),
            1
        );
        assert_eq!(s.get_revised("a/one").unwrap().revision, base() + 30);
        // Revisions issued here come after every one seen.
        assert!(s.next_revision() > base() + 30);
    }

    #[test]
    fn a_deletion_removes_the_spec_unless_it_is_newer() {
        let (_d, s) = store();
        s.apply_at(vec![spec("a/one", "v1")], base() + 10).unwrap();
        let at = |name: &str, revision: u64| Deletion {
            name: name.to_string(),
            revision,
        };
        // A deletion older than the spec leaves it.
        assert!(s
            .delete_each(vec![at("a/one", base() + 5)])
            .unwrap()
            .is_empty());
        assert!(s.get("a/one").is_some());
        assert_eq!(
            s.delete_each(vec![at("a/one", base() + 20), at("a/two", base() + 20)])
                .unwrap(),
            vec!["a/one".to_string()]
        );
        assert_eq!(s.get("a/one"), None);
        // Nothing of it stays: any APPLY creates the journal again.
        assert_eq!(
            s.apply_at(vec![spec("a/one", "v4")], base() + 15).unwrap(),
            1
        );
        assert!(s.delete("a/one").unwrap());
        assert!(!s.delete("a/one").unwrap());
        assert!(s.next_revision() > base() + 20);
    }

    #[test]
    fn revisions_count_on_from_the_highest_seen() {
        let (_d, s) = store();
        assert_eq!(s.next_revision(), 1);
        assert_eq!(s.next_revision(), 2);
        // A store written when revisions were wall-clock nanoseconds.
        let old = 1_765_000_000_000_000_000;
        s.apply_at(vec![spec("a/one", "v1")], old).unwrap();
        assert_eq!(s.next_revision(), old + 1);
    }

    #[test]
    fn revisions_and_deletions_survive_a_restart() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("specs.json");
        {
            let s = SpecStore::open(path.clone()).unwrap();
            s.apply_at(vec![spec("a/one", "v1"), spec("a/two", "v1")], base() + 10)
                .unwrap();
            assert!(s.delete("a/two").unwrap());
        }
        let s = SpecStore::open(path.clone()).unwrap();
        assert_eq!(s.get_revised("a/one").unwrap().revision, base() + 10);
        assert_eq!(s.get("a/two"), None);
        // The deletion's revision is not issued again, from the log...
        assert!(s.delete("a/one").unwrap());
        drop(s);
        let s = SpecStore::open(path.clone()).unwrap();
        assert_eq!(s.next_revision(), base() + 13);
        // ...or from a snapshot written after it, which holds no spec.
        s.apply_at(vec![spec("a/three", "v1")], base() + 20)
            .unwrap();
        assert!(s.delete("a/three").unwrap());
        s.start_snapshot(&mut s.lock());
        s.wait_for_snapshot();
        drop(s);
        let s = SpecStore::open(path).unwrap();
        assert!(s.all().is_empty());
        assert_eq!(s.next_revision(), base() + 22);
    }

    #[test]
    fn a_file_from_before_revisions_reads_at_revision_zero() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("specs.json");
        let old = vec![spec("a/one", "v1")];
        std::fs::write(&path, serde_json::to_vec(&old).unwrap()).unwrap();
        let s = SpecStore::open(path).unwrap();
        assert_eq!(s.get_revised("a/one").unwrap().revision, 0);
        // Any revisioned change is newer.
        assert_eq!(
            s.apply_at(vec![spec("a/one", "v2")], base() + 1).unwrap(),
            1
        );
    }

    #[test]
    fn a_stored_spec_no_longer_valid_is_left_out() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("specs.json");
        // A name part of 256 bytes cannot be a directory name.
        let long = format!("a/{}", "b".repeat(256));
        let stored = vec![spec("a/one", "v1"), spec(&long, "v1")];
        std::fs::write(&path, serde_json::to_vec(&stored).unwrap()).unwrap();
        let s = SpecStore::open(path).unwrap();
        let names: Vec<String> = s.all().into_iter().map(|s| s.name).collect();
        assert_eq!(names, vec!["a/one".to_string()]);
        // Left out, not deleted: a start keeps its files.
        assert!(s.left_out(&long));
        assert!(!s.left_out("a/one") && !s.left_out("a/two"));
    }

    #[test]
    fn pages_go_in_name_order() {
        let (_d, s) = store();
        let specs = ["pg/a", "pg/b", "pg/c", "pg/d", "pg/e"].map(|n| spec(n, "x"));
        s.apply_at(specs.to_vec(), base() + 1).unwrap();
        s.apply_at(vec![spec("pg/c", "other")], base() + 2).unwrap();
        assert!(s.delete("pg/b").unwrap());
        let walk = |limit: usize| {
            let mut pages = Vec::new();
            let mut after = String::new();
            loop {
                let (page, more) = s.page(&after, limit, |s| s.labels.to_text() == "app=x");
                let names: Vec<String> = page.iter().map(|r| r.spec.name.clone()).collect();
                if let Some(last) = names.last() {
                    after = last.clone();
                }
                pages.push(names);
                if !more {
                    return pages;
                }
            }
        };
        assert_eq!(walk(2), vec![vec!["pg/a", "pg/d"], vec!["pg/e"]]);
        // A page that ends with the last spec says no more follow.
        assert_eq!(walk(3), vec![vec!["pg/a", "pg/d", "pg/e"]]);
        assert_eq!(walk(1).len(), 3);
        let (rest, more) = s.page("pg/e", 10, |_| true);
        assert_eq!((rest.len(), more), (0, false));
    }

    /// The change logs in `dir`, by name.
    fn logs_in(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| n.ends_with(".log"))
            .collect();
        names.sort();
        names
    }

    /// A store in a new directory holding `journals`, each applied at a
    /// revision of its own, then closed: the directory, the store's path
    /// and its log's.
    fn store_of(journals: &[&str]) -> (tempfile::TempDir, PathBuf, PathBuf) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("specs.json");
        let log = dir.path().join("specs.1.log");
        let s = SpecStore::open(path.clone()).unwrap();
        for (n, name) in (1..).zip(journals) {
            s.apply_at(vec![spec(name, "v1")], base() + n).unwrap();
        }
        (dir, path, log)
    }

    fn names(s: &SpecStore) -> Vec<String> {
        s.all().into_iter().map(|s| s.name).collect()
    }

    #[test]
    fn changes_are_appended_to_the_log_and_replayed_at_open() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("specs.json");
        let s = SpecStore::open(path.clone()).unwrap();
        assert!(s.file_was_missing());
        // The first change writes the snapshot, naming an empty log.
        s.apply_at(vec![spec("lg/a", "v1")], base() + 1).unwrap();
        let snapshot = std::fs::read(&path).unwrap();
        assert_eq!(logs_in(dir.path()), vec!["specs.1.log".to_string()]);
        assert_eq!(
            std::fs::metadata(dir.path().join("specs.1.log"))
                .unwrap()
                .len(),
            0
        );
        s.apply_at(vec![spec("lg/b", "v1"), spec("lg/c", "v1")], base() + 2)
            .unwrap();
        assert!(s.delete("lg/a").unwrap());
        s.apply_at(vec![spec("lg/b", "v2")], base() + 4).unwrap();
        // Later changes leave the snapshot as it was and go to the log,
        // one line each.
        assert_eq!(std::fs::read(&path).unwrap(), snapshot);
        let log = std::fs::read(dir.path().join("specs.1.log")).unwrap();
        assert_eq!(log.iter().filter(|&&b| b == b'\n').count(), 3);
        let revised = s.all_revised();
        drop(s);

        let s = SpecStore::open(path).unwrap();
        assert!(!s.file_was_missing());
        assert_eq!(s.all_revised(), revised);
        assert_eq!(names(&s), vec!["lg/b".to_string(), "lg/c".to_string()]);
        assert_eq!(s.get("lg/b").unwrap().labels, spec("lg/b", "v2").labels);
        assert_eq!(s.get("lg/a"), None);
        assert!(s.next_revision() > base() + 4);
        // And the reopened store goes on appending to the same log.
        s.apply_at(vec![spec("lg/d", "v1")], base() + 5).unwrap();
        assert_eq!(logs_in(dir.path()), vec!["specs.1.log".to_string()]);
        let longer = std::fs::read(dir.path().join("specs.1.log")).unwrap();
        assert_eq!(&longer[..log.len()], &log[..]);
        assert_eq!(longer.iter().filter(|&&b| b == b'\n').count(), 4);
    }

    /// The generation of the log that `path`'s snapshot names, and how
    /// many specs it holds.
    fn snapshot_at(path: &Path) -> (Option<u64>, usize) {
        let disk: OnDisk = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
        (disk.log, disk.specs.len())
    }

    /// Changes one of the 20 specs `f/000`..`f/019` at a time until the
    /// store moves to a new log; returns how many changes that took.
    fn change_until_a_new_log(s: &SpecStore, revision: &mut u64, round: usize) -> usize {
        let current = s.log_generation();
        let mut changes = 0;
        while s.log_generation() == current {
            let name = format!("f/{:03}", *revision % 20);
            s.apply_at(vec![spec(&name, &format!("r{round}"))], *revision)
                .unwrap();
            *revision += 1;
            changes += 1;
        }
        changes
    }

    /// Drops `s` and opens its directory again, which must hold the same
    /// specs.
    fn reopened(s: SpecStore, path: &Path) -> SpecStore {
        let revised = s.all_revised();
        drop(s);
        let s = SpecStore::open(path.to_path_buf()).unwrap();
        assert_eq!(s.all_revised(), revised);
        s
    }

    /// A store in a new directory whose log may grow only to the
    /// snapshot's size, holding `f/000`..`f/019`.
    fn store_of_twenty() -> (tempfile::TempDir, PathBuf, SpecStore) {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("specs.json");
        let mut s = SpecStore::open(path.clone()).unwrap();
        s.log_bytes_min = 0;
        let many: Vec<_> = (0..20).map(|i| spec(&format!("f/{i:03}"), "v1")).collect();
        s.apply_at(many, base() + 1).unwrap();
        (dir, path, s)
    }

    #[test]
    fn a_log_that_outgrows_the_snapshot_is_folded_into_a_new_one() {
        let (dir, path, s) = store_of_twenty();
        assert_eq!(s.log_generation(), Some(1));
        assert_eq!(snapshot_at(&path), (Some(1), 20));
        // Each change of one spec is a small record: the log takes about
        // as many as the snapshot holds specs; the change that takes it
        // past the snapshot's size sends later changes to a new log, and
        // a snapshot naming that log is written, then the old log goes.
        let mut revision = base() + 2;
        for round in 0..3 {
            let changes = change_until_a_new_log(&s, &mut revision, round);
            assert!(changes > 10, "{changes} changes before a new log");
            let generation = round as u64 + 2;
            assert_eq!(s.log_generation(), Some(generation));
            s.wait_for_snapshot();
            assert_eq!(snapshot_at(&path), (Some(generation), 20));
            assert_eq!(logs_in(dir.path()), vec![format!("specs.{generation}.log")]);
        }
        del(&s, "f/007", revision).unwrap();
        let s = reopened(s, &path);
        assert_eq!(s.all().len(), 19);
    }

    #[test]
    fn a_snapshot_that_cannot_be_written_keeps_every_log_and_loses_nothing() {
        let (dir, path, s) = store_of_twenty();
        // Nothing can be written where the snapshot is staged.
        let blocker = dir.path().join("specs.json.next");
        std::fs::create_dir(&blocker).unwrap();
        let mut revision = base() + 2;
        for round in 0..2 {
            change_until_a_new_log(&s, &mut revision, round);
            s.wait_for_snapshot();
        }
        // The snapshot still names the first log, and the changes since
        // are in it and in the two after it.
        assert_eq!(snapshot_at(&path).0, Some(1));
        let logs = ["specs.1.log", "specs.2.log", "specs.3.log"].map(String::from);
        assert_eq!(logs_in(dir.path()), logs.to_vec());
        del(&s, "f/007", revision).unwrap();
        // A start replays every log from the one the snapshot names.
        drop(reopened(s, &path));

        // A log missing from among them is no crash's doing.
        let middle = dir.path().join("specs.2.log");
        let kept = std::fs::read(&middle).unwrap();
        std::fs::remove_file(&middle).unwrap();
        match SpecStore::open(path.clone()) {
            Err(EngineError::Corrupt { why, .. }) => {
                assert!(why.contains("the one between them is missing"), "{why}")
            }
            Err(e) => panic!("not corrupt: {e}"),
            Ok(_) => panic!("opened without specs.2.log"),
        }
        std::fs::write(&middle, kept).unwrap();

        // Once a snapshot can be written, the logs before it go.
        std::fs::remove_dir(&blocker).unwrap();
        let mut s = SpecStore::open(path.clone()).unwrap();
        s.log_bytes_min = 0;
        change_until_a_new_log(&s, &mut revision, 2);
        s.wait_for_snapshot();
        assert_eq!(snapshot_at(&path), (Some(4), s.all().len()));
        assert_eq!(logs_in(dir.path()), vec!["specs.4.log".to_string()]);
        reopened(s, &path);
    }

    #[test]
    fn a_last_record_cut_short_is_left_out_and_cut_off() {
        let (_dir, path, log) = store_of(&["tt/a", "tt/b"]);
        let whole = std::fs::read(&log).unwrap();
        // Half of a record, as a crash in its write leaves it.
        let mut cut = whole.clone();
        cut.extend_from_slice(&whole[..whole.len() / 2]);
        std::fs::write(&log, &cut).unwrap();
        {
            let s = SpecStore::open(path.clone()).unwrap();
            assert_eq!(names(&s), vec!["tt/a".to_string(), "tt/b".to_string()]);
            // Opening changed nothing on disk; the next change cuts the
            // half record off before writing its own.
            assert_eq!(std::fs::read(&log).unwrap(), cut);
            s.apply_at(vec![spec("tt/c", "v1")], base() + 3).unwrap();
        }
        let s = SpecStore::open(path.clone()).unwrap();
        assert_eq!(
            names(&s),
            ["tt/a", "tt/b", "tt/c"].map(String::from).to_vec()
        );
        drop(s);
        // A whole line that is not a record, last in the log, was cut
        // short too (its newline reached the disk before its bytes).
        let mut damaged = std::fs::read(&log).unwrap();
        damaged.extend_from_slice(b"{\"specs\":[{\"revis\0\0\0\n");
        std::fs::write(&log, &damaged).unwrap();
        let s = SpecStore::open(path).unwrap();
        assert_eq!(
            names(&s),
            ["tt/a", "tt/b", "tt/c"].map(String::from).to_vec()
        );
    }

    #[test]
    fn a_store_that_contradicts_itself_stops_the_open_and_is_kept() {
        let (_dir, path, log) = store_of(&["xx/a", "xx/b", "xx/c"]);
        let kept = std::fs::read(&log).unwrap();
        let corrupt = |s: Result<SpecStore, EngineError>| match s {
            Err(EngineError::Corrupt { why, .. }) => why,
            Err(e) => panic!("not corrupt: {e}"),
            Ok(_) => panic!("opened"),
        };
        // A damaged record with another after it is no torn last write,
        // even when the damage leaves it valid JSON: its CRC tells.
        let mut damaged = kept.clone();
        let label = kept.windows(4).position(|w| w == b"\"v1\"").unwrap();
        assert!(label < kept.iter().position(|&b| b == b'\n').unwrap());
        damaged[label + 1] = b'w';
        std::fs::write(&log, &damaged).unwrap();
        let why = corrupt(SpecStore::open(path.clone()));
        assert!(why.contains("the record at byte 0 is damaged"), "{why}");
        assert_eq!(std::fs::read(&log).unwrap(), damaged);
        // The log the snapshot names is gone.
        std::fs::remove_file(&log).unwrap();
        let why = corrupt(SpecStore::open(path.clone()));
        assert!(why.contains("which is missing"), "{why}");
        // The snapshot is gone, its log is not.
        std::fs::write(&log, &kept).unwrap();
        let snapshot = std::fs::read(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        let why = corrupt(SpecStore::open(path.clone()));
        assert!(why.contains("specs.json is missing"), "{why}");
        // The snapshot is cut short.
        std::fs::write(&path, &snapshot[..snapshot.len() - 3]).unwrap();
        let why = corrupt(SpecStore::open(path.clone()));
        assert!(why.contains("specs.json: EOF while parsing"), "{why}");
        std::fs::write(&path, snapshot).unwrap();
        let s = SpecStore::open(path).unwrap();
        assert_eq!(
            names(&s),
            ["xx/a", "xx/b", "xx/c"].map(String::from).to_vec()
        );
    }

    /// Points the store's change log at `/dev/full`, as a full disk;
    /// returns the real file.
    fn log_to_dev_full(s: &SpecStore) -> File {
        let full = std::fs::OpenOptions::new()
            .write(true)
            .open("/dev/full")
            .unwrap();
        std::mem::replace(&mut s.lock().log.as_mut().unwrap().file, full)
    }

    #[test]
    fn stores_holding_the_same_specs_have_the_same_digest() {
        let (_da, a) = store();
        let (db, b) = store();
        assert_eq!(a.digest(), b.digest());
        a.apply_at(vec![spec("dg/x", "v1"), spec("dg/y", "v1")], base() + 1)
            .unwrap();
        a.apply_at(vec![spec("dg/x", "v2")], base() + 2).unwrap();
        del(&a, "dg/y", base() + 3).unwrap();
        a.apply_at(vec![spec("dg/z", "v1")], base() + 4).unwrap();
        // The same specs reached in another order, by other steps.
        b.apply_at(vec![spec("dg/z", "v1")], base() + 4).unwrap();
        del(&b, "dg/y", base() + 3).unwrap();
        b.apply_at(vec![spec("dg/x", "v2")], base() + 2).unwrap();
        b.apply_at(vec![spec("dg/x", "v1")], base() + 1).unwrap();
        assert_eq!(a.digest(), b.digest());
        assert_eq!(a.digest().0, 2);
        // The same spec at another revision leaves it (brokers reading one
        // cluster file count revisions each on its own) ...
        b.apply_at(vec![spec("dg/z", "v1")], base() + 5).unwrap();
        assert_eq!(a.digest(), b.digest());
        // ... a spec whose content differs, or one more, changes it.
        b.apply_at(vec![spec("dg/z", "v2")], base() + 6).unwrap();
        assert_eq!(a.digest().0, b.digest().0);
        assert_ne!(a.digest(), b.digest());
        a.apply_at(vec![spec("dg/z", "v2")], base() + 5).unwrap();
        assert_eq!(a.digest(), b.digest());
        a.apply_at(vec![spec("dg/w", "v1")], base() + 6).unwrap();
        assert_ne!(a.digest(), b.digest());
        del(&a, "dg/w", base() + 7).unwrap();
        assert_eq!(a.digest(), b.digest());
        // A change that cannot be written leaves the digest as it was.
        let before = b.digest();
        let real = log_to_dev_full(&b);
        assert!(b.apply_at(vec![spec("dg/x", "v3")], base() + 8).is_err());
        assert!(del(&b, "dg/z", base() + 8).is_err());
        assert_eq!(b.digest(), before);
        b.lock().log.as_mut().unwrap().file = real;
        // And a start computes the digest the changes kept.
        drop(b);
        let b = SpecStore::open(db.path().join("specs.json")).unwrap();
        assert_eq!(b.digest(), before);
    }

    #[test]
    fn a_change_that_cannot_be_written_is_undone() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("specs.json");
        let s = SpecStore::open(path.clone()).unwrap();
        // The first snapshot cannot be written: nothing changes, and the
        // log it would have named is not left behind.
        std::fs::create_dir(dir.path().join("specs.json.next")).unwrap();
        assert!(s.apply_at(vec![spec("uu/a", "v1")], base() + 1).is_err());
        assert_eq!(s.get("uu/a"), None);
        assert_eq!(logs_in(dir.path()), Vec::<String>::new());
        assert!(!path.exists());
        std::fs::remove_dir(dir.path().join("specs.json.next")).unwrap();
        s.apply_at(vec![spec("uu/a", "v1")], base() + 1).unwrap();
        let version = s.version();

        // A log write that fails (a full disk) undoes the change: the
        // spec replaced, the one deleted and the one created are as before.
        let real = log_to_dev_full(&s);
        let change = vec![spec("uu/a", "v2"), spec("uu/b", "v2")];
        assert!(s.apply_at(change.clone(), base() + 2).is_err());
        assert!(del(&s, "uu/a", base() + 3).is_err());
        assert_eq!(s.version(), version);
        assert_eq!(s.get("uu/a").unwrap().labels, spec("uu/a", "v1").labels);
        assert_eq!(s.get("uu/b"), None);
        assert_eq!(s.changes_since(version), Some(vec![]));
        s.lock().log.as_mut().unwrap().file = real;
        // Space again: the same change is taken.
        assert_eq!(s.apply_at(change, base() + 2).unwrap(), 2);
        drop(s);
        let s = SpecStore::open(path).unwrap();
        assert_eq!(s.get("uu/a").unwrap().labels, spec("uu/a", "v2").labels);
        assert_eq!(names(&s), vec!["uu/a".to_string(), "uu/b".to_string()]);
    }
}
