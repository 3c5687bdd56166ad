//! A journal deleted while a batch of it that is to fail is in flight.
//!
//! The fault hook (`rotary_storage::faults`, set by `ServeConfig::faults`)
//! holds the batch's spool write, as a stalling disk would, after its
//! commit record was written; a DELETE lands meanwhile; then the write
//! fails with EIO. A failed batch owes the commit log a record of what
//! the journal still holds committed (`Shard::restate`), and a deletion
//! owes it the journal's delete record: the deletion must win. The log
//! holds no commit record of the journal after its delete record, and a
//! restart recovers without the journal, which starts empty when it is
//! created again.
#![warn(clippy::too_many_lines)] // Functions under 100 lines, as in the engine.
#![allow(clippy::disallowed_methods)] // Tests time real servers and processes.

mod common;

use common::{req, start_faulty, stat, Conn};
use rotary_engine::Broker;
use rotary_net::spec::{JournalSpec, LabelSet};
use rotary_net::status::Status;
use rotary_net::wire::AppendReply;
use rotary_storage::faults::{DiskOp, Faults};
use rotary_storage::wal::{records, CommitLog, Record};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Larger than a commit record carries: the append is answered only once
/// its spool write is done, so a failed write fails it.
const APPEND_BYTES: usize = 100 << 10;
/// How long the test waits for the held write to show up.
const HELD_WAIT: Duration = Duration::from_secs(10);
/// How long an appender waits for its answer.
const ANSWER_WAIT: Duration = Duration::from_secs(10);

/// Holds the spool writes of files whose path holds `only` while armed,
/// and fails the first one let go with `errno`.
#[derive(Default)]
struct Stall {
    state: Mutex<StallState>,
}

#[derive(Default)]
struct StallState {
    only: String,
    holding: bool,
    /// A write was held since the hook was armed.
    held: bool,
    fail: Option<i32>,
}

impl Stall {
    fn new(only: &str) -> Arc<Stall> {
        let s = Stall::default();
        s.state.lock().unwrap().only = only.into();
        Arc::new(s)
    }

    /// Holds the next spool writes, and fails the first let go with
    /// `errno`, if any.
    fn arm(&self, errno: Option<i32>) {
        let mut s = self.state.lock().unwrap();
        s.holding = true;
        s.held = false;
        s.fail = errno;
    }

    fn release(&self) {
        self.state.lock().unwrap().holding = false;
    }

    fn held(&self) -> bool {
        self.state.lock().unwrap().held
    }

    fn applies(s: &StallState, op: DiskOp, path: &Path) -> bool {
        op == DiskOp::SpoolWrite && path.to_string_lossy().contains(&s.only)
    }
}

impl Faults for Stall {
    fn check(&self, op: DiskOp, path: &Path) -> Option<i32> {
        let mut s = self.state.lock().unwrap();
        if !Self::applies(&s, op, path) {
            return None;
        }
        s.fail.take()
    }

    fn holds(&self, op: DiskOp, path: &Path) -> bool {
        let mut s = self.state.lock().unwrap();
        if !Self::applies(&s, op, path) || !s.holding {
            return false;
        }
        s.held = true;
        true
    }
}

/// The records of shard 0's commit log, in order.
fn log_records(dir: &Path) -> Vec<Record> {
    let path = CommitLog::path_in(&dir.join("shard-0"));
    records(&std::fs::read(&path).unwrap())
}

/// The kinds of `journal`'s records, in order: `commit` or `delete`.
fn kinds_of(records: &[Record], journal: &str) -> Vec<&'static str> {
    records
        .iter()
        .filter(|r| r.journal() == journal)
        .map(|r| match r {
            Record::Commit { .. } => "commit",
            Record::Delete { .. } => "delete",
        })
        .collect()
}

/// Until `done` holds, for at most `wait`; whether it did.
fn wait_for(wait: Duration, mut done: impl FnMut() -> bool) -> bool {
    let give_up = Instant::now() + wait;
    while !done() {
        if Instant::now() > give_up {
            return false;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    true
}

/// A broker of one shard on a fresh directory, whose spool writes of
/// journal `doomed/one` `stall` decides, serving that journal (with a
/// first batch committed at `[0, 1000)` that set a register) and
/// `other/one`; and a connection to it.
fn serve() -> (tempfile::TempDir, Arc<Stall>, Broker, Conn) {
    let dir = tempfile::tempdir().unwrap();
    let stall = Stall::new("/doomed/");
    let broker = start_faulty(dir.path(), stall.clone());
    let mut c = Conn::new(broker.endpoints[0]);
    c.apply(&[
        JournalSpec::new("doomed/one"),
        JournalSpec::new("other/one"),
    ]);
    let mut first = req("doomed/one");
    first.union_registers = LabelSet::from_pairs([("owner", "deleted")]).unwrap();
    let (status, reply) = c.append(&first, &[1u8; 1000]);
    assert_eq!(status, Status::OK);
    assert_eq!((reply.begin, reply.end), (0, 1000));
    (dir, stall, broker, c)
}

/// Appends `content` to `doomed/one` on a connection of its own, from a
/// thread that returns the answer.
fn append_in_thread(
    broker: &Broker,
    content: Vec<u8>,
) -> std::thread::JoinHandle<(Status, AppendReply)> {
    let endpoint = broker.endpoints[0];
    std::thread::spawn(move || {
        let mut c = Conn::with_wait(endpoint, ANSWER_WAIT);
        c.append(&req("doomed/one"), &content)
    })
}

/// The journal's records in the commit log: a commit first, and no
/// commit after its delete record.
fn assert_deleted_last(dir: &Path, journal: &str) {
    let kinds = kinds_of(&log_records(dir), journal);
    assert_eq!(kinds.first(), Some(&"commit"), "{kinds:?}");
    let deleted_at = kinds.iter().position(|k| *k == "delete");
    let Some(deleted_at) = deleted_at else {
        panic!("no delete record of {journal}: {kinds:?}");
    };
    assert!(
        !kinds[deleted_at..].contains(&"commit"),
        "a commit record of {journal} after its delete record: {kinds:?}"
    );
}

#[test]
fn a_journal_deleted_while_its_failing_batch_is_in_flight_stays_deleted() {
    let (dir, stall, broker, mut c) = serve();
    stall.arm(Some(libc::EIO));
    let appender = append_in_thread(&broker, vec![2u8; APPEND_BYTES]);
    assert!(wait_for(HELD_WAIT, || stall.held()), "no spool write held");
    // The batch's commit record is in the log and its spool write in
    // flight: the journal is deleted now, and the write fails after.
    assert_eq!(c.delete("doomed/one"), Status::OK);
    stall.release();
    let (status, reply) = appender.join().unwrap();
    assert_eq!(status, Status::DISK_FAILED, "the held append");
    assert_eq!(reply.begin, reply.end, "a failed append commits nothing");
    // A later batch of another journal: its turn writes what the log is
    // owed before its own record.
    assert_eq!(c.append_ok("other/one", b"after").end, 5);
    assert_deleted_last(dir.path(), "doomed/one");
    broker.shutdown();

    // A restart recovers without the journal, and its log forgets it.
    let broker = start_faulty(dir.path(), Stall::new("/doomed/"));
    let mut c = Conn::new(broker.endpoints[0]);
    let (bytes, status) = c.read_all("doomed/one", 0);
    assert_eq!(status, Status::JOURNAL_NOT_FOUND);
    assert!(bytes.is_empty());
    assert_eq!(c.read_ok("other/one", 0), b"after");
    let kinds = kinds_of(&log_records(dir.path()), "doomed/one");
    assert!(kinds.is_empty(), "{kinds:?}");
    // Created again, it starts empty: offset 0, none of the deleted
    // journal's registers.
    c.apply(&[JournalSpec::new("doomed/one")]);
    let (status, reply) = c.append(&req("doomed/one"), b"anew");
    assert_eq!(status, Status::OK);
    assert_eq!((reply.begin, reply.end), (0, 4));
    assert!(reply.registers.is_empty(), "{:?}", reply.registers);
    assert_eq!(c.read_ok("doomed/one", 0), b"anew");
    broker.shutdown();
}

/// A batch staged while the one before it is written, of a journal then
/// deleted: the batch written commits (its record came before the
/// deletion's), the one behind it is refused, and nothing of it reaches
/// the log.
#[test]
fn a_batch_staged_behind_one_in_flight_is_refused_when_its_journal_is_deleted() {
    let (dir, stall, broker, mut c) = serve();
    stall.arm(None);
    let written = append_in_thread(&broker, vec![2u8; APPEND_BYTES]);
    assert!(wait_for(HELD_WAIT, || stall.held()), "no spool write held");
    let prestaged = stat(&mut c, "prestaged_bytes");
    let behind = append_in_thread(&broker, vec![3u8; 100]);
    assert!(
        wait_for(HELD_WAIT, || stat(&mut c, "prestaged_bytes")
            >= prestaged + 100),
        "the second append was not staged behind the first"
    );
    assert_eq!(c.delete("doomed/one"), Status::OK);
    stall.release();
    let (status, reply) = written.join().unwrap();
    assert_eq!(status, Status::OK, "the append written before the deletion");
    assert_eq!((reply.begin, reply.end), (1000, 1000 + APPEND_BYTES as u64));
    let (status, reply) = behind.join().expect("the staged append is answered");
    assert_eq!(
        status,
        Status::JOURNAL_NOT_FOUND,
        "the append staged behind"
    );
    assert_eq!(reply.begin, reply.end, "a refused append commits nothing");
    assert_eq!(c.append_ok("other/one", b"after").end, 5);
    assert_deleted_last(dir.path(), "doomed/one");
    broker.shutdown();
}
