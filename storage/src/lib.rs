//! rotary's local storage: aligned buffers, O_DIRECT spools, local
//! fragments and the per-shard commit log (`README.md` beside this crate).
//!
//! Everything here runs on the owning shard's thread (types are `!Send`
//! where they hold files). Invariants: a spool never exposes bytes beyond
//! its committed point; the commit log names each spool's committed end,
//! in an encoding of its own (never the wire's: `rotary-proto` supplies
//! only names and label sets); fragment files are immutable and named by
//! their content's SHA-1.

// Functions stay short enough to hold in mind (threshold in clippy.toml).
#![warn(clippy::too_many_lines)]
#![deny(unsafe_code)]

pub mod aligned;
pub mod boot;
pub mod faults;
pub mod fragment;
pub mod pool;
pub mod sha;
pub mod spool;
pub mod wal;

use std::path::{Path, PathBuf};

/// Errors of local storage. `Full` is retryable once space returns.
#[derive(Debug, thiserror::Error)]
pub enum StorageError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: disk full: {}", figures(*.need, *.free, *.reserve))]
    Full {
        path: PathBuf,
        /// Bytes the write needed beyond what was allocated (0: unknown).
        need: u64,
        free: u64,
        reserve: u64,
    },
    #[error("{path}: corrupt: {why}")]
    Corrupt { path: PathBuf, why: String },
}

impl StorageError {
    pub fn io(path: &Path, source: std::io::Error) -> Self {
        if source.raw_os_error() == Some(libc::ENOSPC)
            || source.raw_os_error() == Some(libc::EDQUOT)
        {
            return StorageError::Full {
                path: path.to_path_buf(),
                need: 0,
                free: 0,
                reserve: 0,
            };
        }
        StorageError::Io {
            path: path.to_path_buf(),
            source,
        }
    }

    /// Whether the failed operation may succeed if tried again later: a
    /// full disk may get space back, but a device that failed the I/O
    /// ([`io_is_retryable`]) or bytes that are corrupt stay so.
    pub fn is_retryable(&self) -> bool {
        match self {
            StorageError::Full { .. } => true,
            StorageError::Io { source, .. } => io_is_retryable(source),
            StorageError::Corrupt { .. } => false,
        }
    }

    pub fn is_full(&self) -> bool {
        matches!(self, StorageError::Full { .. })
    }
}

/// Whether an I/O error of the local disk may go away if the call is made
/// again: not when the device or the file system failed or refuses writes
/// for good (`EIO`, `ENXIO`, `ENODEV`, `EROFS`, `EUCLEAN`). The one
/// classification, shared with the uploader, is
/// [`rotary_proto::disk::io_is_retryable`].
pub use rotary_proto::disk::io_is_retryable;

/// fsync of a directory, so renames and creations in it are durable.
pub async fn sync_dir(dir: &Path) -> Result<(), StorageError> {
    let f = compio::fs::OpenOptions::new()
        .read(true)
        .open(dir)
        .await
        .map_err(|e| StorageError::io(dir, e))?;
    f.sync_all().await.map_err(|e| StorageError::io(dir, e))
}

/// A full disk's figures, where they were measured; a write the device
/// refused (all zero) says only that.
fn figures(need: u64, free: u64, reserve: u64) -> String {
    match (need, free, reserve) {
        (0, 0, 0) => "the device has no space left for the write".into(),
        (0, free, reserve) => format!("{free} bytes free, {reserve} reserved"),
        (need, free, reserve) => {
            format!("needs {need} bytes, {free} bytes free, {reserve} reserved")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A full disk may free up; a device that failed the I/O does not
    /// heal, and corrupt bytes stay corrupt.
    #[test]
    fn eio_and_corruption_are_not_retryable_a_full_disk_is() {
        let at = Path::new("/d/spool");
        let io = |errno| StorageError::io(at, std::io::Error::from_raw_os_error(errno));
        for errno in [
            libc::EIO,
            libc::ENXIO,
            libc::ENODEV,
            libc::EROFS,
            libc::EUCLEAN,
        ] {
            let e = io(errno);
            assert!(!e.is_full(), "{e}");
            assert!(!e.is_retryable(), "{e}");
        }
        for errno in [libc::ENOSPC, libc::EDQUOT] {
            let e = io(errno);
            assert!(e.is_full() && e.is_retryable(), "{e}");
        }
        for errno in [libc::EINTR, libc::EAGAIN, libc::ENOMEM, libc::EMFILE] {
            let e = io(errno);
            assert!(!e.is_full() && e.is_retryable(), "{e}");
        }
        let corrupt = StorageError::Corrupt {
            path: at.into(),
            why: "bad".into(),
        };
        assert!(!corrupt.is_retryable());
    }

    /// A write the device refused says so, without figures nobody measured.
    #[test]
    fn a_full_disk_names_only_the_figures_it_measured() {
        let refused = StorageError::io(
            Path::new("/d/commit.log"),
            std::io::Error::from_raw_os_error(libc::ENOSPC),
        );
        assert!(refused.is_full());
        assert_eq!(
            refused.to_string(),
            "/d/commit.log: disk full: the device has no space left for the write"
        );
        let measured = StorageError::Full {
            path: "/d/spool".into(),
            need: 0,
            free: 4096,
            reserve: 16,
        };
        assert_eq!(
            measured.to_string(),
            "/d/spool: disk full: 4096 bytes free, 16 reserved"
        );
    }
}
