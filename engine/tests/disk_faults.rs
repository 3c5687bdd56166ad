//! A disk that fails under a journal, through the injected fault hook
//! (`rotary_storage::faults`, set by `ServeConfig::faults`): an error that
//! may pass (a full disk) stays retryable, while one that will not (EIO)
//! parks the journal — its appends are refused `DISK_FAILED`, commit
//! nothing, and are not tried on the disk again — and reads of what it
//! committed still work.
#![warn(clippy::too_many_lines)] // Functions under 100 lines, as in the engine.

mod common;

use common::{req, start_faulty, stat, Conn};
use rotary_engine::Broker;
use rotary_net::spec::JournalSpec;
use rotary_net::status::Status;
use rotary_net::wire::Op;
use rotary_storage::faults::{DiskOp, Faults};
use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

/// Fails the armed operations on files whose path holds `only`, and
/// counts every operation it is asked about there.
#[derive(Default)]
struct Disk {
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    only: String,
    /// Operation → (errno, how many more times it fails).
    armed: HashMap<DiskOp, (i32, u32)>,
    asked: HashMap<DiskOp, u32>,
}

impl Disk {
    fn new(only: &str) -> Arc<Disk> {
        let d = Disk::default();
        d.state.lock().unwrap().only = only.into();
        Arc::new(d)
    }

    fn arm(&self, op: DiskOp, errno: i32, times: u32) {
        self.state.lock().unwrap().armed.insert(op, (errno, times));
    }

    fn disarm(&self) {
        self.state.lock().unwrap().armed.clear();
    }

    fn asked(&self, op: DiskOp) -> u32 {
        self.state
            .lock()
            .unwrap()
            .asked
            .get(&op)
            .copied()
            .unwrap_or(0)
    }
}

impl Faults for Disk {
    fn check(&self, op: DiskOp, path: &Path) -> Option<i32> {
        let mut s = self.state.lock().unwrap();
        if !path.to_string_lossy().contains(&s.only) {
            return None;
        }
        *s.asked.entry(op).or_default() += 1;
        let (errno, left) = s.armed.get_mut(&op)?;
        if *left == 0 {
            return None;
        }
        *left -= 1;
        Some(*errno)
    }
}

/// A broker of one shard on a fresh directory whose disk operations on
/// files under `only` a `Disk` decides, and a connection to it. Bind the
/// directory first: it must outlive the broker.
fn serve(only: &str) -> (tempfile::TempDir, Arc<Disk>, Broker, Conn) {
    let dir = tempfile::tempdir().unwrap();
    let disk = Disk::new(only);
    let broker = start_faulty(dir.path(), disk.clone());
    let c = Conn::new(broker.endpoints[0]);
    (dir, disk, broker, c)
}

/// `start`, a connection, and journal `spec` created with `first` appended
/// (acknowledged at `[0, first.len())`).
fn start_with(
    dir: &Path,
    faults: Arc<dyn Faults>,
    spec: JournalSpec,
    first: &[u8],
) -> (Broker, Conn) {
    let broker = start_faulty(dir, faults);
    let mut c = Conn::new(broker.endpoints[0]);
    let name = spec.name.clone();
    c.apply(&[spec]);
    let (status, reply) = c.append(&req(&name), first);
    assert_eq!(status, Status::OK);
    assert_eq!((reply.begin, reply.end), (0, first.len() as u64));
    (broker, c)
}

/// After a restart of `dir`'s broker on `faults`: the journal holds
/// `bytes`, and takes `more` right after them.
fn restarted_holds(dir: &Path, faults: Arc<dyn Faults>, journal: &str, bytes: &[u8], more: &[u8]) {
    let broker = start_faulty(dir, faults);
    let mut c = Conn::new(broker.endpoints[0]);
    assert_eq!(c.read_ok(journal, 0), bytes);
    let (status, reply) = c.append(&req(journal), more);
    assert_eq!(status, Status::OK);
    let end = (bytes.len() + more.len()) as u64;
    assert_eq!((reply.begin, reply.end), (bytes.len() as u64, end));
    broker.shutdown();
}

/// Larger than the commit log carries: the append is answered only once
/// its spool write is done, so a failed write fails it.
const APPEND_BYTES: usize = 100 << 10;

#[test]
fn eio_on_a_spool_write_parks_the_journal_and_reads_go_on() {
    let (_dir, disk, broker, mut c) = serve("/dying/");
    c.apply(&[
        JournalSpec::new("dying/one"),
        JournalSpec::new("healthy/one"),
    ]);
    let first = vec![1u8; APPEND_BYTES];
    let reply = c.append_ok("dying/one", &first);
    let head = reply.end;

    // The disk fails every write from now on.
    disk.arm(DiskOp::SpoolWrite, libc::EIO, u32::MAX);
    let writes = disk.asked(DiskOp::SpoolWrite);
    let (status, reply) = c.append(&req("dying/one"), &vec![2u8; APPEND_BYTES]);
    assert_eq!(status, Status::DISK_FAILED);
    assert!(!status.is_retryable());
    assert_eq!(reply.write_head, head, "a failed append commits nothing");
    assert_eq!(disk.asked(DiskOp::SpoolWrite), writes + 1);
    // Even once the hook would let writes through, later appends are
    // refused the same way, without touching the disk.
    disk.disarm();
    for n in 0..3u8 {
        let (status, reply) = c.append(&req("dying/one"), &[n; 10]);
        assert_eq!(status, Status::DISK_FAILED, "append {n}");
        assert_eq!(reply.write_head, head);
    }
    assert_eq!(disk.asked(DiskOp::SpoolWrite), writes + 1, "written again");
    // What committed is still read.
    let bytes = c.read_ok("dying/one", 0);
    assert_eq!(bytes, first);
    assert_eq!(stat(&mut c, "disk_failed_journals"), 1);
    // Another journal of the shard, on a disk that works, goes on.
    let (status, reply) = c.append(&req("healthy/one"), &vec![3u8; APPEND_BYTES]);
    assert_eq!(status, Status::OK);
    assert_eq!(reply.end, APPEND_BYTES as u64);
    broker.shutdown();
}

#[test]
fn enospc_on_a_spool_write_stays_retryable_storage_full() {
    let (_dir, disk, broker, mut c) = serve("/full/");
    c.apply(&[JournalSpec::new("full/one")]);
    let first = vec![1u8; APPEND_BYTES];
    let _ = c.append_ok("full/one", &first);
    disk.arm(DiskOp::SpoolWrite, libc::ENOSPC, 2);
    for _ in 0..2 {
        let (status, reply) = c.append(&req("full/one"), &vec![2u8; APPEND_BYTES]);
        assert_eq!(status, Status::STORAGE_FULL);
        assert!(status.is_retryable());
        assert_eq!(reply.write_head, APPEND_BYTES as u64);
    }
    // Space returns: the retry commits at the same head.
    let (status, reply) = c.append(&req("full/one"), &vec![3u8; APPEND_BYTES]);
    assert_eq!(status, Status::OK);
    assert_eq!(reply.begin, APPEND_BYTES as u64);
    let (bytes, _) = c.read_all("full/one", 0);
    assert_eq!(bytes.len(), 2 * APPEND_BYTES);
    assert!(bytes[APPEND_BYTES..].iter().all(|&b| b == 3));
    assert_eq!(stat(&mut c, "disk_failed_journals"), 0);
    broker.shutdown();
}

/// A seal that fails with EIO is tried once, not at every turn after: the
/// journal is parked with its spool still readable.
#[test]
fn eio_at_seal_is_not_retried() {
    let (_dir, disk, broker, mut c) = serve("/sealing/");
    let mut spec = JournalSpec::new("sealing/one");
    // The second append rolls the fragment first.
    spec.fragment.length = 4096;
    c.apply(&[spec]);
    // Fails many seals, then lets them through: a broker that retried
    // would get there and commit the appends below. Armed first: the
    // journal may seal as soon as its spool is past the length.
    disk.arm(DiskOp::Seal, libc::EIO, 50);
    let first = vec![1u8; 10_000];
    let reply = c.append_ok("sealing/one", &first);
    let head = reply.end;
    for n in 0..3u8 {
        let (status, reply) = c.append(&req("sealing/one"), &[n; 100]);
        assert_eq!(status, Status::DISK_FAILED, "append {n}");
        assert_eq!(reply.write_head, head);
    }
    assert_eq!(disk.asked(DiskOp::Seal), 1, "seal attempts");
    // An operator's SEAL is told why, not left waiting.
    let name = rotary_net::wire::encode_name("sealing/one");
    c.send(Op::SEAL, 0, 11, &name, &[]);
    let r = c.recv();
    assert_eq!(r.known_status(), Status::DISK_FAILED);
    assert_eq!(disk.asked(DiskOp::Seal), 1, "seal attempts");
    let bytes = c.read_ok("sealing/one", 0);
    assert_eq!(bytes, first);
    broker.shutdown();
}

/// The commit log is the shard's: an EIO writing it parks every journal of
/// the shard.
#[test]
fn eio_on_the_commit_log_parks_the_shard() {
    let (_dir, disk, broker, mut c) = serve("commit.log");
    c.apply(&[JournalSpec::new("log/one"), JournalSpec::new("log/two")]);
    let reply = c.append_ok("log/one", b"committed");
    assert_eq!(reply.end, 9);
    let before = disk.asked(DiskOp::LogWrite);
    disk.arm(DiskOp::LogWrite, libc::EIO, 1);
    let (status, reply) = c.append(&req("log/one"), b"lost");
    assert_eq!(status, Status::DISK_FAILED);
    assert_eq!(reply.write_head, 9);
    // The fault passed, but the log's disk is not trusted again: every
    // journal of the shard is refused.
    for name in ["log/one", "log/two"] {
        let (status, _) = c.append(&req(name), b"refused");
        assert_eq!(status, Status::DISK_FAILED, "{name}");
    }
    assert_eq!(
        disk.asked(DiskOp::LogWrite),
        before + 1,
        "log writes after the EIO"
    );
    let bytes = c.read_ok("log/one", 0);
    assert_eq!(bytes, b"committed");
    assert!(stat(&mut c, "disk_failed_journals") >= 1);
    // Nor can a deletion be recorded: the journal stays, bytes and all.
    assert_eq!(c.delete("log/one"), Status::DISK_FAILED);
    let bytes = c.read_ok("log/one", 0);
    assert_eq!(bytes, b"committed");
    broker.shutdown();
}

/// An fdatasync of an `fsync` journal's spool, or a spool's growth, that
/// fails with EIO parks the journal as a write does; other journals go on.
#[test]
fn eio_on_a_spool_sync_or_allocation_parks_the_journal() {
    let (_dir, disk, broker, mut c) = serve("/bad/");
    let mut synced = JournalSpec::new("bad/synced");
    synced.durability = rotary_net::spec::Durability::Fsync;
    c.apply(&[
        synced,
        JournalSpec::new("bad/new"),
        JournalSpec::new("ok/one"),
    ]);
    let reply = c.append_ok("bad/synced", b"synced");
    assert_eq!(reply.end, 6);

    disk.arm(DiskOp::SpoolSync, libc::EIO, u32::MAX);
    disk.arm(DiskOp::SpoolAllocate, libc::EIO, u32::MAX);
    let (status, reply) = c.append(&req("bad/synced"), b"lost");
    assert_eq!(status, Status::DISK_FAILED);
    assert_eq!(reply.write_head, 6);
    // The first append to a journal grows its new spool: refused.
    let (status, reply) = c.append(&req("bad/new"), b"never");
    assert_eq!(status, Status::DISK_FAILED);
    assert_eq!(reply.write_head, 0);
    let (syncs, allocations) = (
        disk.asked(DiskOp::SpoolSync),
        disk.asked(DiskOp::SpoolAllocate),
    );
    disk.disarm();
    for name in ["bad/synced", "bad/new"] {
        let (status, _) = c.append(&req(name), b"refused");
        assert_eq!(status, Status::DISK_FAILED, "{name}");
    }
    assert_eq!(disk.asked(DiskOp::SpoolSync), syncs, "synced again");
    assert_eq!(
        disk.asked(DiskOp::SpoolAllocate),
        allocations,
        "grown again"
    );
    let (bytes, _) = c.read_all("bad/synced", 0);
    assert_eq!(bytes, b"synced");
    let _ = c.append_ok("ok/one", b"fine");
    assert_eq!(stat(&mut c, "disk_failed_journals"), 2);
    broker.shutdown();
}

/// A single node's DELETE is written to the commit log before the journal
/// goes, and refused if it cannot be: a DELETE answered first and recorded
/// after left, when the log failed at that record, the journal's last
/// commit in the log, and a restart gave a journal created again under the
/// name the old one's head, though nothing was appended to it.
#[test]
fn a_delete_the_commit_log_cannot_record_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let disk = Disk::new("commit.log");
    let spec = JournalSpec::new("log/kept");
    let (broker, mut c) = start_with(dir.path(), disk.clone(), spec, b"committed");
    // A write that may pass: refused, to be asked again.
    disk.arm(DiskOp::LogWrite, libc::EINTR, 1);
    assert_eq!(c.delete("log/kept"), Status::IO_ERROR);
    // One that will not: refused for good.
    disk.arm(DiskOp::LogWrite, libc::EIO, 1);
    assert_eq!(c.delete("log/kept"), Status::DISK_FAILED);
    let (bytes, status) = c.read_all("log/kept", 0);
    assert_eq!(status, Status::OK);
    assert_eq!(bytes, b"committed");
    broker.shutdown();

    // A restart, on a disk that works, finds the journal as it was.
    disk.disarm();
    restarted_holds(dir.path(), disk, "log/kept", b"committed", b"more");
}

/// What `OnceAt` does to a file.
type FileDeed = Box<dyn FnOnce(&Path) + Send>;

/// Does something to the file of the next `op` once armed, and fails
/// that operation with EINTR (an error that may pass).
struct OnceAt {
    op: DiskOp,
    armed: Mutex<Option<FileDeed>>,
}

impl OnceAt {
    fn new(op: DiskOp) -> Arc<OnceAt> {
        let armed = Mutex::new(None);
        Arc::new(OnceAt { op, armed })
    }

    fn arm(&self, f: impl FnOnce(&Path) + Send + 'static) {
        *self.armed.lock().unwrap() = Some(Box::new(f));
    }

    fn is_armed(&self) -> bool {
        self.armed.lock().unwrap().is_some()
    }
}

impl Faults for OnceAt {
    fn check(&self, op: DiskOp, path: &Path) -> Option<i32> {
        if op != self.op {
            return None;
        }
        let f = self.armed.lock().unwrap().take()?;
        f(path);
        Some(libc::EINTR)
    }
}

/// Flips the first byte of a file: what a disk that dropped the pages of
/// a failed sync leaves.
fn flip_first_byte(path: &Path) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, 0).unwrap();
    f.write_all_at(&[!b[0]], 0).unwrap();
}

/// A seal whose fdatasync failed reads the spool back; bytes that are not
/// those acknowledged park the journal (`DISK_FAILED`) rather than seal
/// into a fragment named by a SHA-1 they do not have.
#[test]
fn a_spool_changed_under_a_failed_seal_parks_the_journal() {
    let dir = tempfile::tempdir().unwrap();
    let hook = OnceAt::new(DiskOp::SpoolSync);
    let mut spec = JournalSpec::new("rot/one");
    spec.durability = rotary_net::spec::Durability::Fsync;
    let (broker, mut c) = start_with(dir.path(), hook.clone(), spec, b"acknowledged");
    let head = 12;

    hook.arm(flip_first_byte);
    let name = rotary_net::wire::encode_name("rot/one");
    c.send(Op::SEAL, 0, 11, &name, &[]);
    let r = c.recv();
    assert_eq!(
        r.known_status(),
        Status::DISK_FAILED,
        "{:?}",
        String::from_utf8_lossy(&r.payload)
    );
    assert!(!hook.is_armed(), "the seal's fdatasync was not asked");
    let (status, reply) = c.append(&req("rot/one"), b"refused");
    assert_eq!(status, Status::DISK_FAILED);
    assert_eq!(reply.write_head, head);
    assert_eq!(stat(&mut c, "disk_failed_journals"), 1);
    // No fragment was sealed from the changed bytes, nor is one later.
    c.send(Op::SEAL, 0, 12, &name, &[]);
    assert_eq!(c.recv().known_status(), Status::DISK_FAILED);
    let journal_dir = dir.path().join("shard-0/journals/rot/one/@");
    let fragments: Vec<_> = std::fs::read_dir(&journal_dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".raw"))
        .collect();
    assert!(fragments.is_empty(), "sealed: {fragments:?}");
    // Nor are the changed bytes read: reads get the acknowledged bytes (a
    // tail in memory holds them) or are refused, never other bytes.
    let (bytes, status) = c.read_all("rot/one", 0);
    assert!(
        b"acknowledged".starts_with(&bytes),
        "{status:?}: read {:?}",
        String::from_utf8_lossy(&bytes)
    );
    assert!(
        status != Status::OK || bytes == b"acknowledged",
        "{status:?}"
    );
    broker.shutdown();
}

/// A seal that failed and whose spool could not be opened again parks the
/// journal: no spool is opened at the head past bytes that are then in no
/// file the journal knows, which reads would skip. A restart finds them.
#[test]
fn a_spool_that_cannot_be_reopened_after_a_failed_seal_parks_the_journal() {
    let dir = tempfile::tempdir().unwrap();
    let hook = OnceAt::new(DiskOp::Seal);
    let spec = JournalSpec::new("lost/spool");
    let (broker, mut c) = start_with(dir.path(), hook.clone(), spec, b"acknowledged");

    let journal_dir = dir.path().join("shard-0/journals/lost/spool/@");
    let spool = journal_dir.join(format!("{:016x}.spool", 0));
    assert!(spool.exists(), "{}", spool.display());
    let aside = dir.path().join("aside.spool");
    let moved = aside.clone();
    // The spool's file leaves as its seal is asked: the seal's reopening
    // of it finds none.
    hook.arm(move |path| std::fs::rename(path, moved).unwrap());
    let name = rotary_net::wire::encode_name("lost/spool");
    c.send(Op::SEAL, 0, 11, &name, &[]);
    let r = c.recv();
    assert_eq!(r.known_status(), Status::DISK_FAILED);
    let (status, reply) = c.append(&req("lost/spool"), b"refused");
    assert_eq!(status, Status::DISK_FAILED);
    assert_eq!(reply.write_head, 12);
    broker.shutdown();

    std::fs::rename(&aside, &spool).unwrap();
    restarted_holds(dir.path(), hook, "lost/spool", b"acknowledged", b"more");
}
