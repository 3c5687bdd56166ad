//! The journal spec store of a broker: specs live in `<data>/specs.json`,
//! shared by every shard behind a lock. Specs change rarely and never on
//! the data path; shards notice changes through `version` and refresh
//! their local copies.
//!
//! Every change has a revision: a hybrid clock, the wall clock in
//! nanoseconds unless the store has already seen a later revision, in
//! which case one more than that. The broker that takes a client's APPLY or
//! DELETE picks the revision and sends it with the change to its peers, so
//! every broker stores the same one. A deleted journal leaves a tombstone
//! with its revision. Brokers that missed changes while they were down
//! compare revisions with their peers' and take whatever is newer: a
//! changed spec, or a deletion (see `Shard::catch_up_specs`).

use crate::EngineError;
use rotary_net::spec::JournalSpec;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, VecDeque};
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

/// Tombstones are dropped once their revision is this old (by the wall
/// clock the revisions mostly carry): a broker down for longer must not
/// rejoin with its old data directory, or journals deleted meanwhile can
/// come back from it.
pub const TOMBSTONE_TTL: std::time::Duration = std::time::Duration::from_secs(30 * 24 * 3600);

fn now_nanos() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// A spec and the revision that set it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Revised {
    pub revision: u64,
    pub spec: JournalSpec,
}

/// A deleted journal's name and the revision of its deletion.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tombstone {
    pub name: String,
    pub revision: u64,
}

/// What [`SpecStore::delete_at`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Deleted {
    /// The spec was removed.
    Removed,
    /// There was no spec (a tombstone is kept all the same).
    Absent,
    /// The spec is newer than the deletion and stays.
    KeptNewer,
}

#[derive(Default)]
struct State {
    specs: BTreeMap<String, Revised>,
    tombstones: BTreeMap<String, u64>,
    /// The names each recent change touched, by the version it made,
    /// oldest first (see [`SpecStore::changes_since`]).
    changes: VecDeque<(u64, Vec<String>)>,
}

/// Most names the change history keeps, over all its changes: beyond it
/// the oldest changes are dropped, and a shard that has not caught up
/// with them looks at every spec instead.
const CHANGED_NAMES_KEPT: usize = 1 << 18;

/// The file's shape. Before revisions it was a bare array of specs, which
/// is still read (every spec at revision 0).
#[derive(Serialize, Deserialize)]
struct OnDisk {
    specs: Vec<Revised>,
    #[serde(default)]
    deleted: Vec<Tombstone>,
}

pub struct SpecStore {
    path: PathBuf,
    state: Mutex<State>,
    version: AtomicU64,
    /// The highest revision seen or issued.
    clock: AtomicU64,
    /// The file did not exist when the store was opened.
    file_was_missing: bool,
    /// Every peer was asked for the changes made while this broker was
    /// down (or the asking gave up): until then a journal this store lacks
    /// may exist all the same.
    caught_up: AtomicBool,
    /// [`CHANGED_NAMES_KEPT`], smaller in tests.
    changed_names_kept: usize,
}

impl SpecStore {
    pub fn open(path: PathBuf) -> Result<SpecStore, EngineError> {
        let bad = |e: serde_json::Error| EngineError::Config(format!("{}: {e}", path.display()));
        let mut file_was_missing = false;
        let state = match std::fs::read(&path) {
            Ok(bytes) => {
                let disk: OnDisk = match serde_json::from_slice::<Vec<JournalSpec>>(&bytes) {
                    Ok(list) => OnDisk {
                        specs: list
                            .into_iter()
                            .map(|spec| Revised { revision: 0, spec })
                            .collect(),
                        deleted: Vec::new(),
                    },
                    Err(_) => serde_json::from_slice(&bytes).map_err(bad)?,
                };
                State {
                    specs: disk
                        .specs
                        .into_iter()
                        .filter(|r| match r.spec.validate() {
                            Ok(()) => true,
                            Err(e) => {
                                // Stored before a rule tightened: serving it
                                // could fail every journal's start, so it is
                                // left out until applied again under a valid
                                // name or with valid fields.
                                tracing::error!(error = %e, "ignoring a stored spec that is no longer valid");
                                false
                            }
                        })
                        .map(|r| (r.spec.name.clone(), r))
                        .collect(),
                    tombstones: disk
                        .deleted
                        .into_iter()
                        .map(|t| (t.name, t.revision))
                        .collect(),
                    changes: VecDeque::new(),
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                file_was_missing = true;
                State::default()
            }
            Err(e) => return Err(EngineError::Io(path, e)),
        };
        let newest = state
            .specs
            .values()
            .map(|r| r.revision)
            .chain(state.tombstones.values().copied())
            .max()
            .unwrap_or(0);
        Ok(SpecStore {
            path,
            state: Mutex::new(state),
            version: AtomicU64::new(1),
            clock: AtomicU64::new(newest),
            file_was_missing,
            caught_up: AtomicBool::new(false),
            changed_names_kept: CHANGED_NAMES_KEPT,
        })
    }

    /// Whether the file did not exist when the store was opened: a new
    /// data directory, unless shards hold journal data (they check).
    pub fn file_was_missing(&self) -> bool {
        self.file_was_missing
    }

    /// Whether a journal missing here can be taken not to exist: the store
    /// has heard from every peer since the broker started (at once for a
    /// broker without peers).
    pub fn is_caught_up(&self) -> bool {
        self.caught_up.load(Ordering::Acquire)
    }

    pub fn mark_caught_up(&self) {
        self.caught_up.store(true, Ordering::Release);
    }

    /// The file the specs are stored in.
    pub fn path(&self) -> &std::path::Path {
        &self.path
    }

    pub fn version(&self) -> u64 {
        self.version.load(Ordering::Acquire)
    }

    /// A revision later than every one this store has seen.
    pub fn next_revision(&self) -> u64 {
        let wall = now_nanos();
        let mut seen = self.clock.load(Ordering::Acquire);
        loop {
            let next = wall.max(seen + 1);
            match self
                .clock
                .compare_exchange(seen, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => return next,
                Err(now) => seen = now,
            }
        }
    }

    fn observe(&self, revision: u64) {
        self.clock.fetch_max(revision, Ordering::AcqRel);
    }

    pub fn get(&self, name: &str) -> Option<JournalSpec> {
        self.lock().specs.get(name).map(|r| r.spec.clone())
    }

    pub fn get_revised(&self, name: &str) -> Option<Revised> {
        self.lock().specs.get(name).cloned()
    }

    /// The revision of the journal's deletion, if it was deleted.
    pub fn tombstone(&self, name: &str) -> Option<u64> {
        self.lock().tombstones.get(name).copied()
    }

    pub fn all(&self) -> Vec<JournalSpec> {
        self.lock().specs.values().map(|r| r.spec.clone()).collect()
    }

    pub fn all_revised(&self) -> Vec<Revised> {
        self.lock().specs.values().cloned().collect()
    }

    pub fn tombstones(&self) -> Vec<Tombstone> {
        tombstones_of(&self.lock())
    }

    /// Creates or replaces specs at `revision` (from
    /// [`SpecStore::next_revision`] for a client's change), all or none,
    /// except those this store knows a later (or the same) revision of, as a
    /// spec or as a deletion. Returns how many it took.
    pub fn apply_at(&self, specs: Vec<JournalSpec>, revision: u64) -> Result<usize, EngineError> {
        let specs = specs
            .into_iter()
            .map(|spec| Revised { revision, spec })
            .collect();
        Ok(self.apply_each(specs)?.len())
    }

    /// As [`SpecStore::apply_at`], each spec at its own revision, in one
    /// change of the store (one write of its file: a broker catching up
    /// with a peer may take tens of thousands at once). Returns the names
    /// of those it took.
    pub fn apply_each(&self, specs: Vec<Revised>) -> Result<Vec<String>, EngineError> {
        let (mut state, mut next) = self.begin_change(specs.iter().map(|r| r.revision).max());
        let mut changed = Vec::new();
        for Revised { revision, spec } in specs {
            let known = next.specs.get(&spec.name).map(|r| r.revision);
            let gone = next.tombstones.get(&spec.name).copied();
            let newer_known = known.is_some_and(|k| k > revision || (k == revision && k != 0))
                || gone.is_some_and(|g| g >= revision);
            if newer_known {
                continue;
            }
            next.tombstones.remove(&spec.name);
            changed.push(spec.name.clone());
            next.specs
                .insert(spec.name.clone(), Revised { revision, spec });
        }
        if !changed.is_empty() {
            self.install(&mut state, next, changed.clone())?;
        }
        Ok(changed)
    }

    /// Records deletions a peer knows of, each as of its revision, in one
    /// change of the store: a tombstone for a journal absent here, or the
    /// removal of a spec no newer than the deletion (as
    /// [`SpecStore::delete_at`] does one at a time).
    pub fn delete_each(&self, deletions: Vec<Tombstone>) -> Result<(), EngineError> {
        let (mut state, mut next) = self.begin_change(deletions.iter().map(|t| t.revision).max());
        let mut changed = Vec::new();
        for Tombstone { name, revision } in deletions {
            let known = next.specs.get(&name).map(|r| r.revision);
            if known.is_some_and(|k| k > revision) {
                continue;
            }
            if known.is_none() && next.tombstones.get(&name).is_some_and(|&t| t >= revision) {
                continue;
            }
            next.specs.remove(&name);
            next.tombstones.insert(name.clone(), revision);
            changed.push(name);
        }
        if !changed.is_empty() {
            self.install(&mut state, next, changed)?;
        }
        Ok(())
    }

    /// Deletes a spec as of `revision`, leaving a tombstone, unless the
    /// spec was set at a later revision.
    pub fn delete_at(&self, name: &str, revision: u64) -> Result<Deleted, EngineError> {
        self.observe(revision);
        let mut state = self.lock();
        let known = state.specs.get(name).map(|r| r.revision);
        if known.is_some_and(|k| k > revision) {
            return Ok(Deleted::KeptNewer);
        }
        if known.is_none() && state.tombstones.get(name).is_some_and(|&t| t >= revision) {
            return Ok(Deleted::Absent);
        }
        let mut next = State {
            specs: state.specs.clone(),
            tombstones: state.tombstones.clone(),
            changes: VecDeque::new(),
        };
        let removed = next.specs.remove(name).is_some();
        next.tombstones.insert(name.to_string(), revision);
        self.install(&mut state, next, vec![name.to_string()])?;
        Ok(if removed {
            Deleted::Removed
        } else {
            Deleted::Absent
        })
    }

    /// Notes the newest revision a change brings, and locks the store for
    /// it: the state, and a copy of it to change (installed whole or not
    /// at all).
    fn begin_change(&self, newest: Option<u64>) -> (std::sync::MutexGuard<'_, State>, State) {
        if let Some(newest) = newest {
            self.observe(newest);
        }
        let state = self.lock();
        let next = State {
            specs: state.specs.clone(),
            tombstones: state.tombstones.clone(),
            changes: VecDeque::new(),
        };
        (state, next)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().expect("spec lock")
    }

    /// Drops expired tombstones from `next`, persists it and makes it the
    /// store's state; `state` stays as it was if persisting fails.
    /// `changed` names the specs the change sets or deletes.
    fn install(
        &self,
        state: &mut State,
        mut next: State,
        changed: Vec<String>,
    ) -> Result<(), EngineError> {
        let expired = now_nanos().saturating_sub(TOMBSTONE_TTL.as_nanos() as u64);
        next.tombstones.retain(|_, revision| *revision >= expired);
        self.persist(&next)?;
        next.changes = std::mem::take(&mut state.changes);
        let version = self.version.fetch_add(1, Ordering::AcqRel) + 1;
        next.changes.push_back((version, changed));
        let mut kept: usize = next.changes.iter().map(|(_, n)| n.len()).sum();
        while kept > self.changed_names_kept && next.changes.len() > 1 {
            let (_, dropped) = next.changes.pop_front().expect("more than one change");
            kept -= dropped.len();
        }
        *state = next;
        Ok(())
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

    fn persist(&self, state: &State) -> Result<(), EngineError> {
        let disk = OnDisk {
            specs: state.specs.values().cloned().collect(),
            deleted: tombstones_of(state),
        };
        let bytes = serde_json::to_vec_pretty(&disk).expect("specs serialize");
        let tmp = self.path.with_extension("json.next");
        let write = || -> std::io::Result<()> {
            let mut f = std::fs::File::create(&tmp)?;
            f.write_all(&bytes)?;
            f.sync_data()?;
            std::fs::rename(&tmp, &self.path)?;
            std::fs::File::open(self.path.parent().expect("has parent"))?.sync_all()
        };
        write().map_err(|e| EngineError::Io(self.path.clone(), e))
    }
}

fn tombstones_of(state: &State) -> Vec<Tombstone> {
    state
        .tombstones
        .iter()
        .map(|(name, &revision)| Tombstone {
            name: name.clone(),
            revision,
        })
        .collect()
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
        s.delete_at("c/b", base() + 2).unwrap();
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

    /// Revisions near now: older tombstones expire.
    static NOW: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    fn base() -> u64 {
        *NOW.get_or_init(now_nanos)
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
    fn a_deletion_leaves_a_tombstone_that_stops_older_specs() {
        let (_d, s) = store();
        s.apply_at(vec![spec("a/one", "v1")], base() + 10).unwrap();
        assert_eq!(
            s.delete_at("a/one", base() + 5).unwrap(),
            Deleted::KeptNewer
        );
        assert_eq!(s.delete_at("a/one", base() + 20).unwrap(), Deleted::Removed);
        assert_eq!(s.get("a/one"), None);
        assert_eq!(s.tombstone("a/one"), Some(base() + 20));
        // The spec as it was before the deletion does not come back...
        assert_eq!(
            s.apply_at(vec![spec("a/one", "v1")], base() + 10).unwrap(),
            0
        );
        assert_eq!(s.get("a/one"), None);
        // ...but a later APPLY creates the journal again.
        assert_eq!(
            s.apply_at(vec![spec("a/one", "v4")], base() + 40).unwrap(),
            1
        );
        assert_eq!(s.tombstone("a/one"), None);
        assert_eq!(s.delete_at("a/two", base() + 50).unwrap(), Deleted::Absent);
        assert_eq!(s.tombstone("a/two"), Some(base() + 50));
    }

    #[test]
    fn revisions_and_tombstones_survive_a_restart() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("specs.json");
        {
            let s = SpecStore::open(path.clone()).unwrap();
            s.apply_at(vec![spec("a/one", "v1"), spec("a/two", "v1")], base() + 10)
                .unwrap();
            s.delete_at("a/two", base() + 11).unwrap();
        }
        let s = SpecStore::open(path).unwrap();
        assert_eq!(s.get_revised("a/one").unwrap().revision, base() + 10);
        assert_eq!(s.tombstone("a/two"), Some(base() + 11));
        assert!(s.next_revision() > base() + 11);
    }

    #[test]
    fn tombstones_expire() {
        let (_d, s) = store();
        let old = base() - TOMBSTONE_TTL.as_nanos() as u64 - 1;
        s.apply_at(vec![spec("a/one", "v1")], old - 10).unwrap();
        assert_eq!(s.delete_at("a/one", old).unwrap(), Deleted::Removed);
        assert_eq!(s.tombstone("a/one"), None);
        assert_eq!(s.delete_at("a/two", base()).unwrap(), Deleted::Absent);
        assert_eq!(s.tombstone("a/two"), Some(base()));
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
    }
}
