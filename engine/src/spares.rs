//! Spare spool files: the files of uploaded fragments, kept for new spools.
//!
//! On ext4 a spool grown by `fallocate` holds *unwritten* extents, and each
//! O_DIRECT write into them also converts the extent: on this project's
//! test machine such first writes ran at two thirds of the speed of
//! overwrites (see docs/BENCHMARKS.md). A fragment that is in its store and
//! leaves the local cache therefore does not lose its file: the file is
//! renamed into `<shard>/spares/`, and the next spool of a journal takes it
//! and overwrites its blocks in place. Its old bytes beyond the new spool's
//! head are never read (readers, seals and recovery stop at the committed
//! end), and a seal cuts them off.
//!
//! It also spares the shard the cost of freeing the file's blocks, which
//! on a filesystem mounted with `discard` is slow (see `reaper`).
//!
//! The spares are bounded in number and bytes, and given up (to the reaper)
//! when the disk runs short of free space: they must never be the reason
//! an append is refused with STORAGE_FULL.

use std::path::{Path, PathBuf};

/// Most spare files a shard keeps.
pub const SPARES_MAX: usize = 8;
/// Most bytes of spare files a shard keeps.
pub const SPARE_BYTES_MAX: u64 = 2 << 30;
/// Smaller files are not worth keeping.
pub const SPARE_LEN_MIN: u64 = 1 << 20;
const DIR: &str = "spares";
const PREFIX: &str = "spare-";

pub struct Spares {
    dir: PathBuf,
    /// Path and length of each spare.
    files: Vec<(PathBuf, u64)>,
    next: u64,
}

impl Spares {
    /// Opens `<shard_dir>/spares`, keeping the spares a previous run left
    /// (any bytes they hold are never read) within the bounds.
    pub fn open(shard_dir: &Path) -> std::io::Result<Spares> {
        let dir = shard_dir.join(DIR);
        std::fs::create_dir_all(&dir)?;
        let mut spares = Spares {
            dir,
            files: Vec::new(),
            next: 0,
        };
        for entry in std::fs::read_dir(&spares.dir)?.flatten() {
            let path = entry.path();
            let n = entry
                .file_name()
                .to_str()
                .and_then(|n| n.strip_prefix(PREFIX))
                .and_then(|n| n.parse::<u64>().ok());
            let len = entry
                .metadata()
                .ok()
                .filter(|m| m.is_file())
                .map(|m| m.len());
            match (n, len) {
                (Some(n), Some(len)) if spares.has_room(len) => {
                    spares.next = spares.next.max(n + 1);
                    spares.files.push((path, len));
                }
                _ => crate::reaper::free_file(path),
            }
        }
        Ok(spares)
    }

    /// Bytes the spares hold.
    pub fn bytes(&self) -> u64 {
        self.files.iter().map(|f| f.1).sum()
    }

    pub fn len(&self) -> usize {
        self.files.len()
    }

    pub fn is_empty(&self) -> bool {
        self.files.is_empty()
    }

    fn has_room(&self, len: u64) -> bool {
        len >= SPARE_LEN_MIN
            && self.files.len() < SPARES_MAX
            && self.bytes() + len <= SPARE_BYTES_MAX
    }

    /// The largest spare no longer than `max_len`, removed from the pool
    /// (a larger one would leave many blocks to free at the seal).
    pub fn take(&mut self, max_len: u64) -> Option<PathBuf> {
        let at = (0..self.files.len())
            .filter(|&i| self.files[i].1 <= max_len)
            .max_by_key(|&i| self.files[i].1)?;
        Some(self.files.swap_remove(at).0)
    }

    /// Keeps the file at `path` (`len` bytes, not read or written by
    /// anyone any more) as a spare. False if there is no room or the
    /// rename failed: the caller deletes it.
    pub fn give(&mut self, path: &Path, len: u64) -> bool {
        if !self.has_room(len) {
            return false;
        }
        let dest = self.dir.join(format!("{PREFIX}{}", self.next));
        match std::fs::rename(path, &dest) {
            Ok(()) => {
                self.next += 1;
                self.files.push((dest, len));
                true
            }
            Err(e) => {
                tracing::warn!(path = %path.display(), error = %e, "cannot keep a fragment's file as a spare spool");
                false
            }
        }
    }

    /// Hands every spare to the reaper.
    pub fn release(&mut self) {
        for (path, _) in self.files.drain(..) {
            crate::reaper::free_file(path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(dir: &Path, name: &str, len: u64) -> PathBuf {
        let p = dir.join(name);
        std::fs::File::create(&p).unwrap().set_len(len).unwrap();
        p
    }

    #[test]
    fn spares_are_bounded_taken_by_size_and_kept_across_opens() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = Spares::open(dir.path()).unwrap();
        let mib = 1 << 20;
        assert!(!s.give(&file(dir.path(), "tiny", mib - 1), mib - 1));
        for (i, len) in [4 * mib, 64 * mib, 16 * mib].into_iter().enumerate() {
            let p = file(dir.path(), &format!("f{i}"), len);
            assert!(s.give(&p, len));
            assert!(!p.exists());
        }
        assert_eq!(s.len(), 3);
        assert_eq!(s.bytes(), 84 * mib);
        // The largest that fits.
        let t = s.take(20 * mib).unwrap();
        assert_eq!(std::fs::metadata(&t).unwrap().len(), 16 * mib);
        // (A spool takes it away under its own name.)
        std::fs::rename(&t, dir.path().join("spool")).unwrap();
        assert!(s.take(mib).is_none());
        assert_eq!(s.len(), 2);
        // Another open finds the two left, and names new ones after them.
        let mut again = Spares::open(dir.path()).unwrap();
        assert_eq!(again.bytes(), 68 * mib);
        let p = file(dir.path(), "f9", 2 * mib);
        assert!(again.give(&p, 2 * mib));
        let names: std::collections::HashSet<_> = std::fs::read_dir(dir.path().join(DIR))
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(names.len(), 3, "{names:?}");
        // At most SPARES_MAX files and SPARE_BYTES_MAX bytes.
        let big = file(dir.path(), "big", SPARE_BYTES_MAX);
        assert!(!again.give(&big, SPARE_BYTES_MAX));
        for i in 0..SPARES_MAX {
            let p = file(dir.path(), &format!("g{i}"), mib);
            assert_eq!(again.give(&p, mib), i + 3 < SPARES_MAX, "{i}");
        }
        again.release();
        assert_eq!(again.len(), 0);
        crate::reaper::flush();
        assert_eq!(std::fs::read_dir(dir.path().join(DIR)).unwrap().count(), 0);
    }
}
