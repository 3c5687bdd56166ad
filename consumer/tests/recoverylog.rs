//! Recovery logs end to end: a store's file operations done on real files
//! and recorded into an in-memory log, played back into fresh directories,
//! compared byte for byte.
//!
//! `random_workloads_play_back_byte_for_byte` runs seeded random
//! workloads; a failure names its seed, and `RECOVERYLOG_SEED=<seed>`
//! runs that one alone.

#![warn(clippy::too_many_lines)] // Functions under 100 lines, as in the crate.

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::fs::{self, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::rc::Rc;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rotary_consumer::recoverylog::ops::{self, FRAME_HEADER_BYTES};
use rotary_consumer::recoverylog::{
    Author, Error, Fnode, Hints, LogPath, LogSink, MemLog, Op, Player, PlayerConfig, Record,
    Recorder, Seqno, SinkError,
};

const LOG: &str = "shard-7/recovery";

type Files = BTreeMap<String, Vec<u8>>;

fn author(id: u32) -> Author {
    Author::new(id).unwrap()
}

/// Every regular file under `root`, by its `/`-separated relative path.
fn files(root: &Path) -> Files {
    fn walk(root: &Path, dir: &Path, out: &mut Files) {
        for entry in fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(root, &path, out);
            } else {
                let name = path
                    .strip_prefix(root)
                    .unwrap()
                    .to_str()
                    .unwrap()
                    .to_owned();
                out.insert(name, fs::read(&path).unwrap());
            }
        }
    }
    let mut out = Files::new();
    walk(root, root, &mut out);
    out
}

fn player(root: &Path, hints: &Hints, source: MemLog) -> Player<MemLog> {
    Player::new(PlayerConfig::new(LOG, root), hints, source).unwrap()
}

/// A store's file layer in miniature: each operation on the real files
/// under `root`, then recorded.
struct Store<K: LogSink> {
    root: PathBuf,
    rec: Recorder<K>,
}

impl<K: LogSink> Store<K> {
    /// Plays `log` into `root` and takes it over for `id`.
    fn start(log: &MemLog, root: &Path, id: u32, sink: K) -> Store<K> {
        let rec = player(root, &Hints::origin(LOG), log.clone())
            .handoff(author(id), sink)
            .unwrap();
        Store {
            root: root.to_owned(),
            rec,
        }
    }

    fn at(&self, path: &str) -> PathBuf {
        self.root.join(path)
    }

    fn exists(&self, path: &str) -> bool {
        self.rec.fnode(path).is_some()
    }

    fn fnode(&self, path: &str) -> Fnode {
        self.rec.fnode(path).unwrap()
    }

    fn create(&mut self, path: &str) {
        fs::create_dir_all(self.at(path).parent().unwrap()).unwrap();
        OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(self.at(path))
            .unwrap();
        self.rec.create(path).unwrap();
    }

    fn write(&mut self, path: &str, offset: u64, data: &[u8]) {
        OpenOptions::new()
            .write(true)
            .open(self.at(path))
            .unwrap()
            .write_all_at(data, offset)
            .unwrap();
        self.rec.write(self.fnode(path), offset, data).unwrap();
    }

    fn truncate(&mut self, path: &str, length: u64) {
        OpenOptions::new()
            .write(true)
            .open(self.at(path))
            .unwrap()
            .set_len(length)
            .unwrap();
        self.rec.truncate(self.fnode(path), length).unwrap();
    }

    fn rename(&mut self, from: &str, to: &str) {
        fs::create_dir_all(self.at(to).parent().unwrap()).unwrap();
        fs::rename(self.at(from), self.at(to)).unwrap();
        self.rec.rename(from, to).unwrap();
    }

    fn link(&mut self, from: &str, to: &str) {
        fs::create_dir_all(self.at(to).parent().unwrap()).unwrap();
        fs::hard_link(self.at(from), self.at(to)).unwrap();
        self.rec.link(from, to).unwrap();
    }

    fn unlink(&mut self, path: &str) {
        fs::remove_file(self.at(path)).unwrap();
        self.rec.unlink(path).unwrap();
    }

    fn len(&self, path: &str) -> u64 {
        fs::metadata(self.at(path)).unwrap().len()
    }

    /// Ends the transaction; returns the files, the hints, and where the
    /// barrier's frame ends.
    fn barrier(&mut self, log: &MemLog) -> Snapshot {
        self.rec.barrier().unwrap();
        Snapshot {
            end: log.len(),
            files: files(&self.root),
            hints: self.rec.hints().unwrap(),
        }
    }
}

/// The store as of a barrier.
#[derive(Clone, Debug)]
struct Snapshot {
    end: u64,
    files: Files,
    hints: Hints,
}

const PATHS: [&str; 5] = ["a", "b", "c", "d/e", "d/f"];

/// One random file operation, or a barrier (then its snapshot).
fn random_op(rng: &mut StdRng, store: &mut Store<MemLog>, log: &MemLog) -> Option<Snapshot> {
    let path = PATHS[rng.gen_range(0..PATHS.len())];
    let other = PATHS[rng.gen_range(0..PATHS.len())];
    match (rng.gen_range(0..100), store.exists(path)) {
        (0..=14, false) => store.create(path),
        (15..=49, true) => {
            let offset = rng.gen_range(0..=store.len(path) + 64);
            let len = if rng.gen_bool(0.1) {
                rng.gen_range(1..5000)
            } else {
                rng.gen_range(1..200)
            };
            let data: Vec<u8> = (0..len).map(|_| rng.gen()).collect();
            store.write(path, offset, &data);
        }
        (50..=59, true) => store.truncate(path, rng.gen_range(0..=store.len(path) + 100)),
        (60..=69, true) if other != path => store.rename(path, other),
        (70..=74, true) if !store.exists(other) => store.link(path, other),
        (75..=84, true) => store.unlink(path),
        (85..=99, _) => return Some(store.barrier(log)),
        _ => {}
    }
    None
}

/// A seeded workload: the log and the store's snapshots, the first taken
/// just after the hand-off and the last at the workload's end.
fn workload(seed: u64, root: &Path) -> (MemLog, Vec<Snapshot>) {
    let mut rng = StdRng::seed_from_u64(seed);
    let log = MemLog::new();
    let mut store = Store::start(&log, root, 1 + seed as u32, log.clone());
    let mut snapshots = vec![store.barrier(&log)];
    for _ in 0..rng.gen_range(20..80) {
        snapshots.extend(random_op(&mut rng, &mut store, &log));
    }
    snapshots.push(store.barrier(&log));
    (log, snapshots)
}

/// One player tails the log from its origin, stopping at a random offset
/// inside each transaction and at each barrier.
fn check_tailing(seed: u64, dir: &Path, log: &MemLog, snapshots: &[Snapshot]) {
    let mut rng = StdRng::seed_from_u64(seed ^ 0x7a11);
    let mut tail = player(&dir.join("tail"), &Hints::origin(LOG), log.clone());
    let mut committed = &Files::new();
    for snapshot in snapshots {
        let inside = rng.gen_range(tail.fsm().next().offset..snapshot.end);
        tail.play_until(inside).unwrap();
        assert_eq!(
            &files(tail.root()),
            committed,
            "seed {seed}: tail at {inside}, before {}",
            snapshot.end
        );
        let progress = tail.play_until(snapshot.end).unwrap();
        assert_eq!(progress.offset, snapshot.end, "seed {seed}");
        assert_eq!(progress.pending, 0, "seed {seed}");
        assert_eq!(
            files(tail.root()),
            snapshot.files,
            "seed {seed}: tail at barrier ending {}",
            snapshot.end
        );
        check_player_hints(seed, &tail.hints().unwrap(), &snapshot.hints);
        committed = &snapshot.files;
    }
}

/// A player's hints are the recorder's, with exact offsets in place of
/// lower bounds.
fn check_player_hints(seed: u64, played: &Hints, recorded: &Hints) {
    assert_eq!(played.cursor, recorded.cursor, "seed {seed}");
    let fnodes = |h: &Hints| {
        h.live
            .iter()
            .map(|n| (n.fnode, n.segments.len()))
            .collect::<Vec<_>>()
    };
    assert_eq!(fnodes(played), fnodes(recorded), "seed {seed}");
    let segments = played
        .live
        .iter()
        .zip(&recorded.live)
        .flat_map(|(p, r)| p.segments.iter().zip(&r.segments));
    for (p, r) in segments {
        let key = |s: &rotary_consumer::recoverylog::Segment| {
            (s.author, s.first_seqno, s.first_checksum, s.last_seqno)
        };
        assert_eq!(key(p), key(r), "seed {seed}");
        assert!(
            p.first_offset >= r.first_offset,
            "seed {seed}: {p:?} vs {r:?}"
        );
        assert!(
            p.last_offset.is_some() && r.last_offset.is_none(),
            "seed {seed}"
        );
    }
}

/// A fresh player from the hints of a barrier rebuilds that barrier's
/// files, then plays on to the end. Every barrier's hints round-trip
/// through JSON; a random one and the last are played (the tailing player
/// checks every barrier, and files cost time).
fn check_from_hints(seed: u64, dir: &Path, log: &MemLog, snapshots: &[Snapshot]) {
    for snapshot in snapshots {
        let json = serde_json::to_string(&snapshot.hints).unwrap();
        assert_eq!(
            serde_json::from_str::<Hints>(&json).unwrap(),
            snapshot.hints,
            "seed {seed}"
        );
    }
    let last = snapshots.last().unwrap();
    let some = StdRng::seed_from_u64(seed ^ 0x4e7).gen_range(0..snapshots.len());
    let mut played = vec![some, snapshots.len() - 1];
    played.dedup();
    for i in played {
        let snapshot = &snapshots[i];
        let mut hinted = player(
            &dir.join(format!("hinted-{i}")),
            &snapshot.hints,
            log.clone(),
        );
        let progress = hinted.play_until(snapshot.end).unwrap();
        assert!(!progress.following_hints, "seed {seed}: barrier {i}");
        assert_eq!(
            files(hinted.root()),
            snapshot.files,
            "seed {seed}: from hints of barrier {i}"
        );
        hinted.play().unwrap();
        assert_eq!(
            files(hinted.root()),
            last.files,
            "seed {seed}: from hints of barrier {i}, to the end"
        );
    }
}

#[test]
fn random_workloads_play_back_byte_for_byte() {
    let seeds = match std::env::var("RECOVERYLOG_SEED") {
        Ok(seed) => vec![seed.parse().expect("RECOVERYLOG_SEED is a number")],
        Err(_) => (0..200).collect::<Vec<u64>>(),
    };
    for seed in seeds {
        let dir = tempfile::tempdir().unwrap();
        let (log, snapshots) = workload(seed, &dir.path().join("store"));
        check_tailing(seed, dir.path(), &log, &snapshots);
        check_from_hints(seed, dir.path(), &log, &snapshots);
    }
}

/// Flipping any one byte of a log cuts its history at the frame holding
/// the byte: that frame is garbage, the records after it do not extend the
/// chain, and playback gives the files of the last barrier before it.
#[test]
fn a_corrupt_byte_plays_back_to_the_last_barrier_before_it() {
    for seed in 0..4 {
        let dir = tempfile::tempdir().unwrap();
        let (log, snapshots) = workload(seed, &dir.path().join("store"));
        let bytes = log.to_vec();
        let mut rng = StdRng::seed_from_u64(seed ^ 0xf11);
        for i in 0..12 {
            let at = rng.gen_range(0..bytes.len());
            let mut corrupt = bytes.clone();
            corrupt[at] ^= 1 << rng.gen_range(0..8);
            let root = dir.path().join(format!("corrupt-{i}"));
            let mut fresh = player(&root, &Hints::origin(LOG), MemLog::from(corrupt));
            fresh.play().unwrap();
            let before = snapshots.iter().rev().find(|s| s.end <= at as u64);
            let expect = before.map_or_else(Files::new, |s| s.files.clone());
            assert_eq!(
                files(&root),
                expect,
                "seed {seed}: byte {at} of {} flipped",
                bytes.len()
            );
        }
    }
}

/// A recorder whose author was handed off goes on appending (no fencing
/// here): players ignore and count its records, and rebuild the new
/// author's files.
#[test]
fn zombie_records_after_a_handoff_are_ignored() {
    let dir = tempfile::tempdir().unwrap();
    let log = MemLog::new();
    let mut zombie = Store::start(&log, &dir.path().join("a"), 1, log.clone());
    zombie.create("db");
    zombie.write("db", 0, b"committed by a");
    zombie.barrier(&log);
    zombie.create("journal");
    zombie.write("db", 0, b"uncommitted");
    zombie.rec.flush().unwrap();

    let mut store = Store::start(&log, &dir.path().join("b"), 2, log.clone());
    assert_eq!(
        files(&store.root),
        Files::from([("db".into(), b"committed by a".to_vec())])
    );
    let zombie_from = zombie.rec.fsm().next().seqno;
    zombie.write("db", 0, b"zombie write");
    store.write("db", 14, b" then b");
    zombie.barrier(&log);
    store.create("journal");
    store.barrier(&log);
    zombie.unlink("db");
    zombie.barrier(&log);
    store.write("journal", 0, b"b's journal");
    let last = store.barrier(&log);
    let zombie_records = zombie.rec.fsm().next().seqno.0 - zombie_from.0;

    let expect = Files::from([
        ("db".into(), b"committed by a then b".to_vec()),
        ("journal".into(), b"b's journal".to_vec()),
    ]);
    assert_eq!(last.files, expect);
    assert_ne!(files(&zombie.root), expect);
    let mut fresh = player(&dir.path().join("fresh"), &Hints::origin(LOG), log.clone());
    fresh.play().unwrap();
    assert_eq!(files(fresh.root()), expect);
    assert_eq!(
        fresh.counts().records.ignored,
        BTreeMap::from([(author(1), zombie_records)])
    );
    let mut hinted = player(&dir.path().join("hinted"), &last.hints, log.clone());
    hinted.play().unwrap();
    assert_eq!(files(hinted.root()), expect);
    let standby_hints = fresh.hints().unwrap();
    let mut from_standby = player(&dir.path().join("standby"), &standby_hints, log.clone());
    from_standby.play().unwrap();
    assert_eq!(files(from_standby.root()), expect);
}

/// A sink that holds its appends back while `held` is `Some`, so that a
/// test decides when they land.
struct Gate {
    log: MemLog,
    held: Rc<RefCell<Option<Vec<u8>>>>,
}

impl LogSink for Gate {
    fn append(&mut self, bytes: &[u8]) -> Result<u64, SinkError> {
        match self.held.borrow_mut().as_mut() {
            Some(held) => {
                held.extend_from_slice(bytes);
                Ok(self.log.len())
            }
            None => self.log.append(bytes),
        }
    }
}

/// A sink that lets other bytes land just before its first append.
struct Racing {
    log: MemLog,
    first: Option<Vec<u8>>,
}

impl LogSink for Racing {
    fn append(&mut self, bytes: &[u8]) -> Result<u64, SinkError> {
        if let Some(first) = self.first.take() {
            self.log.push(&first);
        }
        self.log.append(bytes)
    }
}

/// The old author's transaction lands between the new author's read of
/// the log and its hand-off: the hand-off does not extend the chain, so
/// the new author reads on and hands off again.
#[test]
fn handoff_that_loses_a_race_tries_again() {
    let dir = tempfile::tempdir().unwrap();
    let log = MemLog::new();
    let held = Rc::new(RefCell::new(None));
    let gate = Gate {
        log: log.clone(),
        held: held.clone(),
    };
    let mut old = Store::start(&log, &dir.path().join("old"), 1, gate);
    old.create("db");
    old.barrier(&log);
    *held.borrow_mut() = Some(Vec::new());
    old.write("db", 0, b"raced in");
    old.rec.barrier().unwrap();
    let raced = held.borrow_mut().take().unwrap();

    let racing = Racing {
        log: log.clone(),
        first: Some(raced),
    };
    let mut new = Store::start(&log, &dir.path().join("new"), 2, racing);
    assert_eq!(
        files(&new.root),
        Files::from([("db".into(), b"raced in".to_vec())])
    );
    new.write("db", 8, b", then new");
    let last = new.barrier(&log);
    let mut fresh = player(&dir.path().join("fresh"), &Hints::origin(LOG), log.clone());
    fresh.play().unwrap();
    assert_eq!(files(fresh.root()), last.files);
    assert_eq!(
        fresh.counts().records.ignored,
        BTreeMap::from([(author(2), 1)]),
        "the lost hand-off"
    );
}

/// A sink that puts other writers' bytes into the log before each append:
/// random bytes, torn and corrupt frames, and whole frames of another log.
struct Noisy {
    log: MemLog,
    rng: StdRng,
    garbage_bytes: u64,
    foreign_records: u64,
}

impl Noisy {
    fn frame(&mut self) -> Vec<u8> {
        let len = self.rng.gen_range(0..3000);
        let data = (0..len).map(|_| self.rng.gen()).collect();
        let op = Op::Write {
            fnode: Fnode(2),
            offset: 0,
            data,
        };
        let record = Record {
            seqno: Seqno(self.rng.gen_range(1..50)),
            checksum: self.rng.gen(),
            author: author(999),
            op,
        };
        let mut frame = Vec::new();
        ops::encode(&record, &mut frame);
        frame
    }

    fn noise(&mut self) -> Vec<u8> {
        match self.rng.gen_range(0..5) {
            0 => (0..self.rng.gen_range(1..100))
                .map(|_| self.rng.gen())
                .collect(),
            1 => ops::FRAME_MAGIC.to_vec(),
            2 => {
                let frame = self.frame();
                frame[..self.rng.gen_range(1..frame.len())].to_vec()
            }
            3 => {
                let mut frame = self.frame();
                let at = self.rng.gen_range(0..frame.len());
                frame[at] ^= 1 << self.rng.gen_range(0..8);
                frame
            }
            _ => {
                self.foreign_records += 1;
                self.frame()
            }
        }
    }
}

impl LogSink for Noisy {
    fn append(&mut self, bytes: &[u8]) -> Result<u64, SinkError> {
        let before = self.foreign_records;
        let noise = self.noise();
        if self.foreign_records == before {
            self.garbage_bytes += noise.len() as u64;
        }
        self.log.push(&noise);
        self.log.append(bytes)
    }
}

#[test]
fn garbage_between_records_is_skipped() {
    for seed in 0..20 {
        let dir = tempfile::tempdir().unwrap();
        let log = MemLog::new();
        let noisy = Noisy {
            log: log.clone(),
            rng: StdRng::seed_from_u64(seed),
            garbage_bytes: 0,
            foreign_records: 0,
        };
        let mut store = Store::start(&log, &dir.path().join("store"), 1, noisy);
        let mut rng = StdRng::seed_from_u64(seed);
        for i in 0..30u64 {
            let path = PATHS[rng.gen_range(0..PATHS.len())];
            if !store.exists(path) {
                store.create(path);
            }
            store.write(
                path,
                rng.gen_range(0..500),
                &i.to_le_bytes().repeat(rng.gen_range(1..100)),
            );
            store.barrier(&log);
        }
        let last = store.barrier(&log);
        let mut fresh = player(&dir.path().join("fresh"), &Hints::origin(LOG), log.clone());
        fresh.play().unwrap();
        assert_eq!(files(fresh.root()), last.files, "seed {seed}");
        let counts = fresh.counts();
        assert_eq!(
            counts.garbage_bytes,
            store.rec_sink().garbage_bytes,
            "seed {seed}"
        );
        let foreign = store.rec_sink().foreign_records;
        assert_eq!(
            counts.records.ignored,
            BTreeMap::from([(author(999), foreign)]),
            "seed {seed}"
        );
        let mut hinted = player(&dir.path().join("hinted"), &last.hints, log.clone());
        hinted.play().unwrap();
        assert_eq!(files(hinted.root()), last.files, "seed {seed}");
    }
}

impl Store<Noisy> {
    fn rec_sink(&self) -> &Noisy {
        self.rec.sink()
    }
}

/// A log that ends inside a transaction plays back to its last barrier,
/// wherever it is cut, and a tailing player applies the transaction once
/// its barrier lands.
#[test]
fn log_cut_inside_a_transaction_plays_to_the_last_barrier() {
    let dir = tempfile::tempdir().unwrap();
    let log = MemLog::new();
    let mut store = Store::start(&log, &dir.path().join("store"), 1, log.clone());
    store.create("db");
    store.write("db", 0, b"first transaction");
    let first = store.barrier(&log);
    store.write("db", 6, b"TRANSACTION");
    store.create("wal");
    store.write("wal", 0, &[7; 300]);
    store.rename("wal", "d/wal");
    store.rec.flush().unwrap();
    let bytes = log.to_vec();

    let mut tail = player(&dir.path().join("tail"), &Hints::origin(LOG), log.clone());
    for cut in 0..=bytes.len() as u64 {
        let progress = tail.play_until(cut).unwrap();
        let expect = if cut < first.end {
            Files::new()
        } else {
            first.files.clone()
        };
        assert_eq!(files(tail.root()), expect, "cut at {cut}");
        assert!(progress.offset <= cut);
    }
    for cut in [
        first.end + 1,
        first.end + 40,
        bytes.len() as u64 - 1,
        bytes.len() as u64,
    ] {
        let cut_log = MemLog::from(bytes[..cut as usize].to_vec());
        let mut fresh = player(
            &dir.path().join(format!("cut-{cut}")),
            &first.hints,
            cut_log,
        );
        fresh.play().unwrap();
        assert_eq!(files(fresh.root()), first.files, "cut at {cut}");
    }
    assert!(tail.play().unwrap().pending > 0);
    let second = store.barrier(&log);
    assert_eq!(tail.play().unwrap().pending, 0);
    assert_eq!(files(tail.root()), second.files);
    assert_eq!(second.files["db"], b"first TRANSACTION".to_vec());
}

/// Hints let a player skip the records of a large deleted file.
#[test]
fn hints_skip_the_records_of_deleted_files() {
    let dir = tempfile::tempdir().unwrap();
    let log = MemLog::new();
    let mut store = Store::start(&log, &dir.path().join("store"), 1, log.clone());
    store.create("big");
    store.write("big", 0, &vec![1; 300_000]);
    store.barrier(&log);
    store.create("small");
    store.write("small", 0, b"kept");
    store.unlink("big");
    let last = store.barrier(&log);

    let mut fresh = player(&dir.path().join("fresh"), &Hints::origin(LOG), log.clone());
    fresh.play().unwrap();
    let mut hinted = player(&dir.path().join("hinted"), &last.hints, log.clone());
    hinted.play().unwrap();
    assert_eq!(
        files(hinted.root()),
        Files::from([("small".into(), b"kept".to_vec())])
    );
    assert_eq!(files(fresh.root()), files(hinted.root()));
    assert!(fresh.counts().read_bytes >= log.len());
    assert!(
        hinted.counts().read_bytes < 1000,
        "read {}",
        hinted.counts().read_bytes
    );
}

/// A record whose path would leave the root (its frame's CRCs redone to
/// hold) stops playback, and no file appears outside the root.
#[test]
fn paths_escaping_the_root_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let log = MemLog::new();
    let mut store = Store::start(&log, &dir.path().join("store"), 1, log.clone());
    store.rec.flush().unwrap();
    let next = *store.rec.fsm().next();
    let record = Record {
        seqno: next.seqno,
        checksum: next.checksum,
        author: author(1),
        op: create("xx/escape"),
    };
    let mut frame = Vec::new();
    ops::encode(&record, &mut frame);
    let at = frame.len() - "xx/escape".len();
    frame[at..at + 2].copy_from_slice(b"..");
    let payload_crc = crc32c::crc32c(&frame[FRAME_HEADER_BYTES..]);
    frame[8..12].copy_from_slice(&payload_crc.to_le_bytes());
    let header_crc = crc32c::crc32c(&frame[..12]);
    frame[12..16].copy_from_slice(&header_crc.to_le_bytes());
    let offset = log.push(&frame);
    let root = dir.path().join("play/root");
    let mut fresh = player(&root, &Hints::origin(LOG), log.clone());
    let error = fresh.play().unwrap_err();
    assert!(
        matches!(error, Error::Malformed { offset: o, .. } if o == offset),
        "{error:?}"
    );
    assert!(!dir.path().join("play/escape").exists());
    assert_eq!(
        files(dir.path())
            .keys()
            .filter(|k| k.ends_with("escape"))
            .count(),
        0
    );
}

fn create(path: &str) -> Op {
    Op::Create {
        path: LogPath::new(path).unwrap(),
    }
}

#[test]
fn players_refuse_a_root_with_files_and_an_oversized_transaction() {
    let dir = tempfile::tempdir().unwrap();
    fs::write(dir.path().join("stray"), b"x").unwrap();
    let refused = Player::new(
        PlayerConfig::new(LOG, dir.path()),
        &Hints::origin(LOG),
        MemLog::new(),
    );
    assert!(matches!(refused, Err(Error::RootNotEmpty(_))));

    let log = MemLog::new();
    let mut store = Store::start(&log, &dir.path().join("store"), 1, log.clone());
    store.create("db");
    store.write("db", 0, &[0; 10_000]);
    store.barrier(&log);
    let config = PlayerConfig {
        pending_bytes_max: 4096,
        ..PlayerConfig::new(LOG, &dir.path().join("small"))
    };
    let mut small = Player::new(config, &Hints::origin(LOG), log.clone()).unwrap();
    assert!(matches!(
        small.play(),
        Err(Error::TransactionTooLarge {
            bytes_max: 4096,
            ..
        })
    ));
}
