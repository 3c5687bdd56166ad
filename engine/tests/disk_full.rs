//! A full data disk: appends fail with the retryable STORAGE_FULL and
//! commit nothing, reads and admin keep working, and appends succeed again
//! once space returns. Runs on a small tmpfs of its own, which needs root
//! (as in CI); elsewhere it says so and checks nothing.
#![warn(clippy::too_many_lines)] // Functions under 100 lines, as in the engine.

mod common;

use common::{req, start, Conn};
use rotary_net::spec::JournalSpec;
use rotary_net::status::Status;
use std::process::Command;

struct Mount(std::path::PathBuf);

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

#[test]
fn full_disk_is_a_retryable_status_and_recovers() {
    let dir = tempfile::tempdir().unwrap();
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let ok = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=48m", "tmpfs"])
        .arg(&mnt)
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        eprintln!("SKIPPED: mounting a tmpfs needs root");
        return;
    }
    let _mount = Mount(mnt.clone());
    // Leave about 24 MiB free.
    let filler = mnt.join("filler");
    std::fs::write(&filler, vec![1u8; 24 << 20]).unwrap();

    let data = mnt.join("data");
    let broker = start(&data, 1);
    let mut c = Conn::new(broker.endpoints[0]);
    let name = "full/disk";
    let mut spec = JournalSpec::new(name);
    spec.fragment.length = 4 << 20;
    c.apply(&[spec]);

    let chunk = vec![7u8; 512 << 10];
    let mut acked = 0u64;
    let mut full = None;
    for _ in 0..200 {
        let (status, reply) = c.append(&req(name), &chunk);
        match status {
            Status::OK => {
                assert_eq!(reply.begin, acked);
                acked = reply.end;
            }
            s => {
                full = Some((s, reply));
                break;
            }
        }
    }
    let (status, reply) = full.expect("the disk never filled");
    assert_eq!(status, Status::STORAGE_FULL);
    assert!(status.is_retryable());
    assert_eq!(reply.write_head, acked, "a refused append commits nothing");
    // Reads and admin keep working.
    let (bytes, read_status) = c.read_all(name, 0);
    assert_eq!(read_status, Status::OK);
    assert_eq!(bytes.len() as u64, acked);
    assert!(bytes.iter().all(|&b| b == 7));
    c.send(rotary_net::wire::Op::STATS, 0, 3, &[], &[]);
    let stats = c.recv();
    assert_eq!(stats.known_status(), Status::OK);
    let stats: serde_json::Value = serde_json::from_slice(&stats.payload).unwrap();
    assert!(stats["storage_full"].as_u64().unwrap() >= 1);
    // Still full: still refused, still nothing committed.
    let (status, _) = c.append(&req(name), &chunk);
    assert_eq!(status, Status::STORAGE_FULL);
    // A restart on the full disk comes up and serves what it has.
    broker.shutdown();
    let broker = start(&data, 1);
    let mut c = Conn::new(broker.endpoints[0]);
    let (bytes, _) = c.read_all(name, 0);
    assert_eq!(bytes.len() as u64, acked);
    // Space returns: appends continue at the same head.
    std::fs::remove_file(&filler).unwrap();
    let (status, reply) = c.append(&req(name), b"space is back");
    assert_eq!(status, Status::OK, "append after space returned");
    assert_eq!(reply.begin, acked);
    let (bytes, _) = c.read_all(name, acked);
    assert_eq!(bytes, b"space is back");
    broker.shutdown();
}
