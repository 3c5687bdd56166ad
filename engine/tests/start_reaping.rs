//! What a start does with the files of journals it has no spec for: those
//! of journals deleted while the broker was down go to the reaper (the
//! end-to-end tests `tests/e2e_deleted_while_down.rs` show it), but a
//! journal whose stored spec the start left out as no longer valid was
//! not deleted, and keeps them.
#![warn(clippy::too_many_lines)] // Functions under 100 lines, as in the engine.

mod common;

use common::{start, stat, Conn};
use rotary_net::spec::JournalSpec;
use rotary_net::status::Status;

#[test]
fn a_journal_whose_stored_spec_is_no_longer_valid_keeps_its_files() {
    let dir = tempfile::tempdir().unwrap();
    let files = dir.path().join("shard-0/journals/kept/invalid/@");
    let broker = start(dir.path(), 1);
    let mut c = Conn::new(broker.endpoints[0]);
    c.apply(&[JournalSpec::new("kept/invalid")]);
    let first = vec![5u8; 1000];
    assert_eq!(c.append_ok("kept/invalid", &first).end, 1000);
    broker.shutdown();
    // The store as an earlier version may have left it, under a rule this
    // one no longer takes (the snapshot's older form: a bare array).
    let mut stored = JournalSpec::new("kept/invalid");
    stored.replication = 0;
    let snapshot = serde_json::to_vec(&vec![stored]).unwrap();
    std::fs::write(dir.path().join("specs.json"), snapshot).unwrap();

    let broker = start(dir.path(), 1);
    let mut c = Conn::new(broker.endpoints[0]);
    assert!(files.is_dir(), "the journal's files were reaped");
    assert_eq!(stat(&mut c, "recovery_reaped_journals"), 0);
    let (_, status) = c.read_all("kept/invalid", 0);
    assert_eq!(status, Status::JOURNAL_NOT_FOUND, "a spec left out");
    // Applied again, valid: the journal goes on after what it held.
    c.apply(&[JournalSpec::new("kept/invalid")]);
    let reply = c.append_ok("kept/invalid", b"more");
    assert_eq!((reply.begin, reply.end), (1000, 1004));
    broker.shutdown();
}
