//! The reaper frees files that nothing reads a step at a time, and leaves
//! the blocks of files that may still be read to their last reader.
//!
//! Each file gets a second name (a hard link) outside what the reaper
//! removes, so that what it does to the file's blocks stays observable.
//! One test in this binary: [`reaper::flush`] elsewhere would make the
//! reaper free everything at once.
#![allow(clippy::disallowed_methods)] // Tests time real servers and processes.
#![warn(clippy::too_many_lines)] // Functions under 100 lines, as in the engine.

use rotary_engine::reaper::{self, FREE_STEP};
use std::path::Path;
use std::time::{Duration, Instant};

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ (i >> 12) as u8 ^ seed)
        .collect()
}

/// Waits until `path` is at most `len` bytes long; its length then.
fn shrunk_to(path: &Path, len: u64) -> u64 {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let now = std::fs::metadata(path).unwrap().len();
        if now <= len {
            return now;
        }
        assert!(
            Instant::now() < deadline,
            "{} is still {now} bytes",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn files_nothing_reads_are_freed_from_their_end_and_read_ones_are_left_whole() {
    let dir = tempfile::tempdir().unwrap();
    let len = 3 * FREE_STEP as usize + 12_345;
    let (a, b) = (pattern(len, 1), pattern(len, 2));
    let files = dir.path().join("files");
    std::fs::create_dir(&files).unwrap();
    let links = dir.path().join("links");
    std::fs::create_dir(&links).unwrap();
    for (name, bytes) in [("free", &a), ("read", &b)] {
        std::fs::write(files.join(name), bytes).unwrap();
        std::fs::hard_link(files.join(name), links.join(name)).unwrap();
    }
    // A journal's directory: its files are freed after the grace.
    let journal = dir.path().join("journal");
    std::fs::create_dir_all(journal.join("sub")).unwrap();
    std::fs::write(journal.join("sub/spool"), &a).unwrap();
    std::fs::hard_link(journal.join("sub/spool"), links.join("spool")).unwrap();

    // An empty spool: its name goes at once, and a new file may take it
    // at once without the reaper removing that one later.
    std::fs::write(files.join("spool"), &a).unwrap();
    std::fs::hard_link(files.join("spool"), links.join("empty-spool")).unwrap();

    reaper::free_file(files.join("free"));
    reaper::remove_file(files.join("read"));
    reaper::remove_dir_all(journal.clone());
    reaper::unlink_now_free_later(&files.join("spool")).unwrap();
    assert!(!files.join("spool").exists());
    std::fs::write(files.join("spool"), &b).unwrap();

    // Cut from the end down to the last step, the rest left to the close:
    // what remains is the file's first bytes, unchanged.
    for name in ["free", "spool", "empty-spool"] {
        let left = shrunk_to(&links.join(name), FREE_STEP) as usize;
        assert!(left > 0, "{name}: the last step is the close's");
        assert!(
            std::fs::read(links.join(name)).unwrap() == a[..left],
            "{name}"
        );
    }
    assert!(!files.join("free").exists());
    assert!(!journal.exists());
    // A file that may still be read keeps every byte.
    reaper::flush();
    assert!(!files.join("read").exists());
    assert!(std::fs::read(links.join("read")).unwrap() == b);
    assert!(std::fs::read(files.join("spool")).unwrap() == b);
}
