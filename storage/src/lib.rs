//! rotary's local storage: aligned buffers, O_DIRECT spools, local
//! fragments and the per-shard commit log.
//!
//! Everything here runs on the owning shard's thread (types are `!Send`
//! where they hold files). Invariants: a spool never exposes bytes beyond
//! its committed point; the commit log names each spool's committed end;
//! fragment files are immutable and named by their content's SHA-1.
#![deny(unsafe_code)]

pub mod aligned;
pub mod boot;
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
    #[error("{path}: disk full: {}{free} bytes free, {reserve} reserved", needs(*.need))]
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

    /// Whether the failed operation may succeed if tried again later.
    pub fn is_retryable(&self) -> bool {
        match self {
            StorageError::Full { .. } => true,
            StorageError::Io { .. } => true,
            StorageError::Corrupt { .. } => false,
        }
    }

    pub fn is_full(&self) -> bool {
        matches!(self, StorageError::Full { .. })
    }
}

/// fsync of a directory, so renames and creations in it are durable.
pub async fn sync_dir(dir: &Path) -> Result<(), StorageError> {
    let f = compio::fs::OpenOptions::new()
        .read(true)
        .open(dir)
        .await
        .map_err(|e| StorageError::io(dir, e))?;
    f.sync_all().await.map_err(|e| StorageError::io(dir, e))
}

fn needs(need: u64) -> String {
    if need == 0 {
        String::new()
    } else {
        format!("needs {need} bytes, ")
    }
}
