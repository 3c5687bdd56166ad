//! The SQLite store end to end: transactions run through a store whose
//! files are recorded into an in-memory log; the log is played back into
//! other directories, and the played database, opened with SQLite's own
//! VFS, is compared with a model of what was committed and, byte for
//! byte, with the store's database file.
//!
//! `seeded_transactions_play_back_as_committed` runs seeded workloads; a
//! failure names its seed, and `SQLITE_STORE_SEED=<seed>` runs that one
//! alone.

#![warn(clippy::too_many_lines)] // Functions under 100 lines, as in the crate.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rotary_consumer::recoverylog::{
    self, Author, Hints, LogSink, MemLog, Player, PlayerConfig, SinkError,
};
use rotary_consumer::store::{self, FileError, SqliteStore, StoreError, DB_FILE};
use rusqlite::{params, Connection, OpenFlags};

const LOG: &str = "shard-3/recovery";

/// Rows of both tables: (table, key) to (n, value); table `a` has no n.
type Model = BTreeMap<(&'static str, i64), (i64, Vec<u8>)>;

/// What a store's transactions committed, as of one barrier.
#[derive(Clone, Debug)]
struct Committed {
    model: Model,
    checkpoint: Option<Vec<u8>>,
    /// The store's database file.
    db: Vec<u8>,
    /// The log's end, just past the barrier.
    end: u64,
    hints: Hints,
}

const SCHEMA: &str = "
    CREATE TABLE a (k INTEGER PRIMARY KEY, v BLOB NOT NULL);
    CREATE TABLE b (k INTEGER PRIMARY KEY, n INTEGER NOT NULL, v BLOB NOT NULL);";

fn author(id: u32) -> Author {
    Author::new(id).unwrap()
}

fn player(root: &Path, hints: &Hints, log: &MemLog) -> Player<MemLog> {
    Player::new(PlayerConfig::new(LOG, root), hints, log.clone()).unwrap()
}

/// Plays `log` into `root` (new or empty) and opens a store there,
/// recording through `sink` as `id`.
fn open_store<K: LogSink + Send + 'static>(
    root: &Path,
    log: &MemLog,
    id: u32,
    sink: K,
) -> SqliteStore<K> {
    let recorder = player(root, &Hints::origin(LOG), log)
        .handoff(author(id), sink)
        .unwrap();
    SqliteStore::open(root, recorder).unwrap()
}

/// Both tables' rows, read through `conn`.
fn contents(conn: &Connection) -> Model {
    let mut model = Model::new();
    let mut a = conn.prepare("SELECT k, v FROM a").unwrap();
    let rows = a.query_map([], |r| Ok((r.get(0)?, r.get(1)?))).unwrap();
    for row in rows {
        let (k, v) = row.unwrap();
        model.insert(("a", k), (0, v));
    }
    let mut b = conn.prepare("SELECT k, n, v FROM b").unwrap();
    let rows = b
        .query_map([], |r| Ok((r.get(0)?, r.get(1)?, r.get(2)?)))
        .unwrap();
    for row in rows {
        let (k, n, v) = row.unwrap();
        model.insert(("b", k), (n, v));
    }
    model
}

/// Every file under `root`, by name (the store's files are not nested).
fn files(root: &Path) -> BTreeMap<String, Vec<u8>> {
    fs::read_dir(root)
        .unwrap()
        .map(|entry| {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_str().unwrap().to_owned();
            (name, fs::read(&path).unwrap())
        })
        .collect()
}

/// The database played into `root`: it is the one file there, and SQLite's
/// own VFS opens it read-only (so nothing of it changes) and finds the
/// model and the checkpoint of `committed`.
fn check_played(what: &str, root: &Path, committed: &Committed) {
    let played = files(root);
    assert_eq!(
        played.keys().collect::<Vec<_>>(),
        [DB_FILE],
        "{what}: the database alone, no journal"
    );
    assert!(
        played[DB_FILE] == committed.db,
        "{what}: played database differs from the store's ({} and {} bytes)",
        played[DB_FILE].len(),
        committed.db.len()
    );
    let conn =
        Connection::open_with_flags(root.join(DB_FILE), OpenFlags::SQLITE_OPEN_READ_ONLY).unwrap();
    let ok: String = conn
        .query_row("PRAGMA integrity_check", [], |r| r.get(0))
        .unwrap();
    assert_eq!(ok, "ok", "{what}");
    assert_eq!(contents(&conn), committed.model, "{what}");
    assert_eq!(
        store::read_checkpoint(&conn).unwrap(),
        committed.checkpoint,
        "{what}"
    );
}

fn blob(rng: &mut StdRng) -> Vec<u8> {
    let len = match rng.gen_range(0..100) {
        // Overflow pages, and pages freed and reused as blobs shrink.
        0..=14 => rng.gen_range(2_000..60_000),
        _ => rng.gen_range(1..300),
    };
    (0..len).map(|_| rng.gen()).collect()
}

/// One random insert, update or delete in `tx`, applied to `model` too.
fn random_change(rng: &mut StdRng, tx: &Connection, model: &mut Model) {
    let table = if rng.gen_bool(0.5) { "a" } else { "b" };
    let k = rng.gen_range(0..40);
    let n = if table == "a" {
        0
    } else {
        rng.gen_range(0..1000)
    };
    if rng.gen_bool(0.25) {
        tx.execute(&format!("DELETE FROM {table} WHERE k = ?1"), [k])
            .unwrap();
        model.remove(&(table, k));
        return;
    }
    let v = blob(rng);
    match table {
        "a" => tx.execute(
            "INSERT OR REPLACE INTO a (k, v) VALUES (?1, ?2)",
            params![k, v],
        ),
        _ => tx.execute(
            "INSERT OR REPLACE INTO b (k, n, v) VALUES (?1, ?2, ?3)",
            params![k, n, v],
        ),
    }
    .unwrap();
    model.insert((table, k), (n, v));
}

/// The store's state, now that a transaction has ended.
fn committed<K: LogSink + Send + 'static>(
    store: &SqliteStore<K>,
    log: &MemLog,
    model: &Model,
    checkpoint: &Option<Vec<u8>>,
) -> Committed {
    Committed {
        model: model.clone(),
        checkpoint: checkpoint.clone(),
        db: fs::read(store.root().join(DB_FILE)).unwrap(),
        end: log.len(),
        hints: store.hints().unwrap(),
    }
}

/// How a workload's transactions ended, and how many shrank the
/// database file: each kind is expected across the seeds.
#[derive(Clone, Copy, Debug, Default)]
struct Tally {
    commits: u32,
    rollbacks: u32,
    autocommits: u32,
    vacuums: u32,
    shrinks: u32,
}

impl std::ops::AddAssign for Tally {
    fn add_assign(&mut self, other: Tally) {
        self.commits += other.commits;
        self.rollbacks += other.rollbacks;
        self.autocommits += other.autocommits;
        self.vacuums += other.vacuums;
        self.shrinks += other.shrinks;
    }
}

/// One random transaction: committed, rolled back, or (now and then) a
/// statement outside any transaction of the store's, or a VACUUM.
fn random_transaction(
    rng: &mut StdRng,
    store: &SqliteStore<MemLog>,
    model: &mut Model,
    checkpoint: &mut Option<Vec<u8>>,
    tally: &mut Tally,
) {
    match rng.gen_range(0..100) {
        0..=7 => {
            // Its own transaction, ended by SQLite's autocommit.
            let k = rng.gen_range(0..40);
            store
                .connection()
                .execute("DELETE FROM a WHERE k = ?1", [k])
                .unwrap();
            model.remove(&("a", k));
            tally.autocommits += 1;
            return;
        }
        8..=11 => {
            store.connection().execute_batch("VACUUM").unwrap();
            tally.vacuums += 1;
            return;
        }
        _ => {}
    }
    let tx = store.begin().unwrap();
    let mut changed = model.clone();
    for _ in 0..rng.gen_range(1..10) {
        random_change(rng, &tx, &mut changed);
    }
    let written = rng.gen_bool(0.8).then(|| {
        let bytes: Vec<u8> = (0..rng.gen_range(1..40)).map(|_| rng.gen()).collect();
        tx.write_checkpoint(&bytes).unwrap();
        bytes
    });
    assert_eq!(contents(&tx), changed, "the transaction reads its changes");
    if rng.gen_bool(0.2) {
        tx.rollback().unwrap();
        tally.rollbacks += 1;
        return;
    }
    tx.commit().unwrap();
    tally.commits += 1;
    *model = changed;
    if written.is_some() {
        *checkpoint = written;
    }
}

/// A seeded workload, checked after every transaction by a player that
/// tails the log; returns the log, the state after each transaction and
/// the tally of transactions.
fn workload(seed: u64, dir: &Path) -> (MemLog, Vec<Committed>, Tally) {
    let mut rng = StdRng::seed_from_u64(seed);
    let log = MemLog::new();
    let store = open_store(&dir.join("store"), &log, 1, log.clone());
    if seed % 2 == 1 {
        // A cache of a few pages spills a transaction's pages into the
        // database file before it commits (or rolls back).
        store
            .connection()
            .execute_batch("PRAGMA cache_size = 4")
            .unwrap();
    }
    let tx = store.begin().unwrap();
    tx.execute_batch(SCHEMA).unwrap();
    tx.commit().unwrap();
    let (mut model, mut checkpoint) = (Model::new(), None);
    let mut tail = player(&dir.join("tail"), &Hints::origin(LOG), &log);
    let mut states: Vec<Committed> = Vec::new();
    let mut tally = Tally::default();
    for i in 0..rng.gen_range(15..30) {
        random_transaction(&mut rng, &store, &mut model, &mut checkpoint, &mut tally);
        let state = committed(&store, &log, &model, &checkpoint);
        if states
            .last()
            .is_some_and(|last| last.db.len() > state.db.len())
        {
            tally.shrinks += 1;
        }
        let progress = tail.play().unwrap();
        assert_eq!(progress.offset, state.end, "seed {seed}");
        assert_eq!(
            progress.pending, 0,
            "seed {seed}: the log ends at a barrier"
        );
        check_played(
            &format!("seed {seed}: after transaction {i}"),
            tail.root(),
            &state,
        );
        states.push(state);
    }
    (log, states, tally)
}

/// Fresh players from the hints of some transaction's barrier rebuild its
/// state, then play on to the last; a fresh player from the log's origin
/// rebuilds the last.
fn check_from_hints(seed: u64, dir: &Path, log: &MemLog, states: &[Committed]) {
    let last = states.last().unwrap();
    let some = StdRng::seed_from_u64(seed ^ 0x417).gen_range(0..states.len());
    let mut played = vec![some, states.len() - 1];
    played.dedup();
    for i in played {
        let state = &states[i];
        let what = format!("seed {seed}: from hints after transaction {i}");
        let root = dir.join(format!("hinted-{i}"));
        let mut hinted = player(&root, &state.hints, log);
        let progress = hinted.play_until(state.end).unwrap();
        assert!(!progress.following_hints, "{what}");
        check_played(&what, &root, state);
        hinted.play().unwrap();
        check_played(&format!("{what}, to the end"), &root, last);
    }
    let root = dir.join("fresh");
    player(&root, &Hints::origin(LOG), log).play().unwrap();
    check_played(&format!("seed {seed}: from the origin"), &root, last);
}

#[test]
fn seeded_transactions_play_back_as_committed() {
    let seeds = match std::env::var("SQLITE_STORE_SEED") {
        Ok(seed) => vec![seed.parse().expect("SQLITE_STORE_SEED is a number")],
        Err(_) => (0..20).collect::<Vec<u64>>(),
    };
    let mut tally = Tally::default();
    for &seed in &seeds {
        let dir = tempfile::tempdir().unwrap();
        let (log, states, seed_tally) = workload(seed, dir.path());
        check_from_hints(seed, dir.path(), &log, &states);
        tally += seed_tally;
    }
    if seeds.len() > 1 {
        let Tally {
            commits,
            rollbacks,
            autocommits,
            vacuums,
            shrinks,
        } = tally;
        let each = [commits, rollbacks, autocommits, vacuums, shrinks];
        assert!(each.iter().all(|&n| n > 0), "{tally:?}");
    }
}

/// A transaction whose pages spilled into the database file before it
/// rolled back: a player reading the log while it is open, and after it
/// rolled back, holds the database as it was before, byte for byte, as
/// the store's own file is again.
#[test]
fn rollback_leaves_no_trace() {
    let dir = tempfile::tempdir().unwrap();
    let log = MemLog::new();
    let store = open_store(&dir.path().join("store"), &log, 1, log.clone());
    let conn = store.connection();
    conn.execute_batch("PRAGMA cache_size = 4").unwrap();
    conn.execute_batch(SCHEMA).unwrap();
    let tx = store.begin().unwrap();
    tx.execute("INSERT INTO a (k, v) VALUES (1, x'01')", [])
        .unwrap();
    tx.write_checkpoint(b"before").unwrap();
    tx.commit().unwrap();
    let model = Model::from([(("a", 1), (0, vec![1]))]);
    let before = committed(&store, &log, &model, &Some(b"before".to_vec()));

    let tx = store.begin().unwrap();
    for k in 0..400 {
        tx.execute(
            "INSERT OR REPLACE INTO b (k, n, v) VALUES (?1, 7, zeroblob(3000))",
            [k],
        )
        .unwrap();
    }
    tx.execute("DELETE FROM a", []).unwrap();
    tx.write_checkpoint(b"rolled back").unwrap();
    let db = store.root().join(DB_FILE);
    assert!(
        fs::metadata(&db).unwrap().len() > before.db.len() as u64,
        "pages spilled into the database file"
    );
    assert!(
        log.len() > before.end,
        "the open transaction's records were appended"
    );
    let mut tail = player(&dir.path().join("tail"), &Hints::origin(LOG), &log);
    let progress = tail.play().unwrap();
    assert!(progress.pending > 0);
    check_played("transaction open", tail.root(), &before);

    tx.rollback().unwrap();
    assert!(
        fs::read(&db).unwrap() == before.db,
        "the store's file is as before"
    );
    assert_eq!(tail.play().unwrap().pending, 0);
    check_played("rolled back", tail.root(), &before);
    let fresh = dir.path().join("fresh");
    player(&fresh, &Hints::origin(LOG), &log).play().unwrap();
    check_played("rolled back, from the origin", &fresh, &before);
    assert_eq!(store.read_checkpoint().unwrap(), Some(b"before".to_vec()));
}

/// A sink that appends to a log until its appends run out, then fails
/// for good.
struct FailAfter {
    log: MemLog,
    appends_left: u32,
}

impl LogSink for FailAfter {
    fn append(&mut self, bytes: &[u8]) -> Result<u64, SinkError> {
        if self.appends_left == 0 {
            return Err(SinkError::Failed("injected failure".into()));
        }
        self.appends_left -= 1;
        self.log.append(bytes)
    }
}

/// Commits small transactions until the sink fails: the commit it fails
/// returns the sink's error, the store is unusable from then on, and the
/// log plays back to the last commit that succeeded.
#[test]
fn a_failed_append_fails_the_commit_and_the_store() {
    // The hand-off, the store's setup and the schema take three appends.
    for appends in 4..8 {
        let dir = tempfile::tempdir().unwrap();
        let log = MemLog::new();
        let sink = FailAfter {
            log: log.clone(),
            appends_left: appends,
        };
        let store = open_store(&dir.path().join("store"), &log, 1, sink);
        let tx = store.begin().unwrap();
        tx.execute_batch(SCHEMA).unwrap();
        tx.commit().unwrap();
        let mut last = committed(&store, &log, &Model::new(), &None);
        let mut model = Model::new();
        let error = (0..10)
            .find_map(|k| {
                let tx = store.begin().unwrap();
                tx.execute("INSERT INTO a (k, v) VALUES (?1, x'abcd')", [k])
                    .unwrap();
                tx.write_checkpoint(&[k as u8]).unwrap();
                let result = tx.commit();
                if result.is_ok() {
                    model.insert(("a", k), (0, vec![0xab, 0xcd]));
                    last = committed(&store, &log, &model, &Some(vec![k as u8]));
                }
                result.err()
            })
            .unwrap_or_else(|| panic!("{appends} appends: no commit failed"));
        check_failure(appends, &error);
        assert!(
            matches!(store.begin(), Err(StoreError::Failed(_))),
            "{appends} appends"
        );
        assert!(matches!(
            store.read_checkpoint(),
            Err(StoreError::Failed(_))
        ));
        assert!(store.connection().execute("DELETE FROM a", []).is_err());
        assert_eq!(
            log.len(),
            last.end,
            "{appends} appends: nothing after the failure"
        );
        let fresh = dir.path().join("fresh");
        player(&fresh, &Hints::origin(LOG), &log).play().unwrap();
        check_played(&format!("{appends} appends"), &fresh, &last);
    }
}

/// The error is the sink's, appending the barrier at the end of the
/// transaction, and the store keeps it.
fn check_failure(appends: u32, error: &StoreError) {
    let StoreError::Failed(failure) = error else {
        panic!("{appends} appends: {error:?}");
    };
    match &**failure {
        FileError::Record { op, path, source } => {
            assert_eq!(*op, "barrier", "{appends} appends");
            assert_eq!(path, DB_FILE, "{appends} appends");
            assert!(
                matches!(source, recoverylog::Error::Sink(SinkError::Failed(_))),
                "{appends} appends: {source:?}"
            );
        }
        other => panic!("{appends} appends: {other:?}"),
    }
}

/// A store rebuilt from the log by a new primary holds what the old one
/// committed, and goes on recording into the same log.
#[test]
fn a_store_recovered_from_its_log_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let log = MemLog::new();
    let first = open_store(&dir.path().join("a"), &log, 1, log.clone());
    first.connection().execute_batch(SCHEMA).unwrap();
    let tx = first.begin().unwrap();
    tx.execute("INSERT INTO b (k, n, v) VALUES (1, 2, x'03')", [])
        .unwrap();
    tx.write_checkpoint(b"one").unwrap();
    tx.commit().unwrap();
    drop(first);

    let second = open_store(&dir.path().join("b"), &log, 2, log.clone());
    assert_eq!(second.read_checkpoint().unwrap(), Some(b"one".to_vec()));
    let tx = second.begin().unwrap();
    tx.execute("INSERT INTO a (k, v) VALUES (4, x'05')", [])
        .unwrap();
    tx.write_checkpoint(b"two").unwrap();
    tx.commit().unwrap();
    let model = Model::from([(("a", 4), (0, vec![5])), (("b", 1), (2, vec![3]))]);
    assert_eq!(contents(second.connection()), model);
    let last = committed(&second, &log, &model, &Some(b"two".to_vec()));
    let fresh = dir.path().join("fresh");
    player(&fresh, &Hints::origin(LOG), &log).play().unwrap();
    check_played("from the origin", &fresh, &last);
}

/// The pragmas that would change files outside a journal's deletion are
/// refused, and leave the store working; asking for the mode is fine.
#[test]
fn journal_and_locking_modes_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let log = MemLog::new();
    let store = open_store(&dir.path().join("store"), &log, 1, log.clone());
    let conn = store.connection();
    for pragma in [
        "PRAGMA journal_mode = WAL",
        "PRAGMA journal_mode = 'memory'",
        "PRAGMA main.journal_mode = TRUNCATE",
        "PRAGMA journal_mode = off",
        "PRAGMA locking_mode = EXCLUSIVE",
    ] {
        let error = conn.execute_batch(pragma).unwrap_err();
        assert!(error.to_string().contains("refused"), "{pragma}: {error}");
    }
    let mode: String = conn
        .query_row("PRAGMA journal_mode", [], |r| r.get(0))
        .unwrap();
    assert_eq!(mode, "delete");
    conn.execute_batch("PRAGMA journal_mode = DELETE").unwrap();
    conn.execute_batch(SCHEMA).unwrap();
    assert!(store.failure().is_none());
}

/// A store opens only in a directory holding exactly its recorder's
/// files, and only one store at a time.
#[test]
fn open_checks_the_directory() {
    let dir = tempfile::tempdir().unwrap();
    let log = MemLog::new();
    let root: PathBuf = dir.path().join("store");
    let store = open_store(&root, &log, 1, log.clone());
    let recorder = player(&dir.path().join("other"), &Hints::origin(LOG), &log)
        .handoff(author(2), log.clone())
        .unwrap();
    assert!(matches!(
        SqliteStore::open(&root, recorder),
        Err(StoreError::RootInUse(_))
    ));
    drop(store);

    let stray = dir.path().join("stray");
    fs::create_dir(&stray).unwrap();
    fs::write(stray.join("extra"), b"not in the log").unwrap();
    let recorder = player(&dir.path().join("third"), &Hints::origin(LOG), &log)
        .handoff(author(3), log.clone())
        .unwrap();
    match SqliteStore::open(&stray, recorder) {
        Err(StoreError::FilesDiffer { local, recorded }) => {
            assert_eq!(local, ["extra"]);
            assert_eq!(recorded, [DB_FILE]);
        }
        Err(other) => panic!("{other:?}"),
        Ok(_) => panic!("opened a directory the log does not describe"),
    }
}
