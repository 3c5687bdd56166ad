//! Whether a shard directory was last recovered in this boot of the
//! machine, and is still the same directory.
//!
//! Within one boot, a write the kernel completed is there for every later
//! read, whatever becomes of the process that made it: after a crash of
//! the broker alone, recovery need not read back what earlier batches
//! wrote, only what the last one may have left unwritten. After a reboot
//! (power loss, a kernel crash) the disk may have lost writes it had taken
//! into its cache, and a directory copied or restored from elsewhere may
//! hold anything: recovery reads everything it checks. A stamp in the
//! directory names the boot it was recovered in and the directory itself
//! (device and inode), and is written only once a recovery completed.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

const FILE: &str = "recovered-in";

/// The stamp `dir` would get now; `None` where the boot cannot be told.
fn stamp(dir: &Path) -> Option<String> {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    let boot = boot.trim();
    if boot.is_empty() {
        return None;
    }
    let meta = std::fs::metadata(dir).ok()?;
    Some(format!("{boot} {} {}\n", meta.dev(), meta.ino()))
}

/// Whether `dir` was last recovered in this boot, as this directory.
pub fn recovered_in_this_boot(dir: &Path) -> bool {
    match (stamp(dir), std::fs::read_to_string(dir.join(FILE))) {
        (Some(now), Ok(then)) => now == then,
        _ => false,
    }
}

/// Records that `dir` has been recovered in this boot. A stamp cut short
/// (the disk full, say) only makes the next recovery read everything.
/// Where the boot cannot be told, an old stamp is removed.
pub fn record_recovery(dir: &Path) -> std::io::Result<()> {
    let path = dir.join(FILE);
    match stamp(dir) {
        Some(now) => std::fs::write(path, now),
        None => match std::fs::remove_file(path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
            _ => Ok(()),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stamp_holds_for_its_directory_only() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        assert!(!recovered_in_this_boot(a.path()));
        record_recovery(a.path()).unwrap();
        assert!(recovered_in_this_boot(a.path()));
        // The same stamp in another directory (a copy) does not hold.
        std::fs::copy(a.path().join(FILE), b.path().join(FILE)).unwrap();
        assert!(!recovered_in_this_boot(b.path()));
        // Another boot's stamp does not hold.
        let other = std::fs::read_to_string(a.path().join(FILE))
            .unwrap()
            .replacen(|c: char| c.is_ascii_hexdigit(), "x", 1);
        std::fs::write(a.path().join(FILE), other).unwrap();
        assert!(!recovered_in_this_boot(a.path()));
        // Without a stamp, nothing holds.
        record_recovery(a.path()).unwrap();
        std::fs::remove_file(a.path().join(FILE)).unwrap();
        assert!(!recovered_in_this_boot(a.path()));
    }
}
