//! Shard stores whose files are recorded into a recovery log. The one
//! store so far is SQLite's ([`SqliteStore`]).
//!
//! **Files.** A SQLite store keeps its database in a local directory, as
//! real files, through a VFS of its own ([`vfs`], the C side, over
//! [`files`], the safe side). Each call that changes a file (creating the
//! database or its rollback journal, writing at an offset, truncating,
//! deleting) is done locally, then recorded through the store's
//! [`Recorder`](crate::recoverylog::Recorder), so the log holds every
//! byte the files hold.
//!
//! **Barriers.** The store runs SQLite with `journal_mode=DELETE` and
//! normal locking. A write transaction holds the database's write lock
//! from its first change to its end, and ends, committed or rolled back,
//! thus: the rollback journal is deleted (SQLite's commit point: after
//! it the database file alone holds the outcome), the database file is
//! truncated to its size if it shrank, and the lock is lowered to shared.
//! That unlock (`xUnlock` on the database) is where the VFS records a
//! barrier, if any file changed since the last one: inside SQLite's
//! `COMMIT`, which fails if the barrier cannot be appended and returns
//! only once it is. Deleting the journal would be too early: a commit
//! that shrinks the database truncates the file after it. The pragmas
//! that would change files outside that cycle (other journal modes,
//! exclusive locking) are refused, and the VFS offers no atomic writes,
//! shared memory or memory mapping, so SQLite journals every change and
//! writes every page through the VFS. SQLite lowers the lock with a
//! journal still in place only after an I/O error, and an I/O error on a
//! recorded file fails the store first, so that unlock records nothing. A
//! player stopped at any barrier thus holds a database file without a
//! journal, equal byte for byte to the store's when the transaction
//! ended.
//!
//! **Checkpoint.** A shard's checkpoint (the journal offsets it has read,
//! say) lives in the database, in the table `rotary_checkpoint`, written
//! in the same SQLite transaction as the application's changes
//! ([`StoreTxn::write_checkpoint`]): both commit at one barrier or neither
//! does.
//!
//! **Failure.** A change that cannot be done locally or recorded fails
//! its SQLite call with an I/O error, so SQLite never believes a change
//! landed that the log lacks. The store's directory is then failed: the
//! local files may be ahead of the log (the change, or a commit whose
//! barrier did not reach it), so every later call on its files fails too,
//! nothing more is recorded, and the store is unusable: drop it and
//! rebuild its files by playing the log. A sink's retryable errors fail
//! the store as well; retrying belongs in the sink.
//!
//! Everything runs on the thread that uses the store's connection (SQLite
//! calls the VFS from it), and blocks there in the recorder's sink.

mod files;
mod sqlite;
mod vfs;

use std::path::PathBuf;
use std::sync::Arc;

pub use sqlite::{read_checkpoint, write_checkpoint, SqliteStore, StoreTxn, DB_FILE};

use crate::recoverylog;

/// A file operation that failed, after which the store is unusable.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    #[error("{op} of {path}: the local file")]
    Local {
        op: &'static str,
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{op} of {path}: recording into the recovery log")]
    Record {
        op: &'static str,
        path: String,
        #[source]
        source: recoverylog::Error,
    },
    #[error("{path} is a local file the recovery log does not hold")]
    Unrecorded { path: String },
}

impl FileError {
    fn local(op: &'static str, path: &str, source: std::io::Error) -> FileError {
        FileError::Local {
            op,
            path: path.to_owned(),
            source,
        }
    }

    fn record(op: &'static str, path: &str, source: recoverylog::Error) -> FileError {
        FileError::Record {
            op,
            path: path.to_owned(),
            source,
        }
    }
}

/// Everything a store can fail with.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("sqlite")]
    Sqlite(#[from] rusqlite::Error),
    /// A file operation failed, now or before: the store is unusable.
    #[error("the store failed and must be rebuilt from its recovery log")]
    Failed(#[source] Arc<FileError>),
    #[error("store directory {path}")]
    Root {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("a store is already open in {0}")]
    RootInUse(PathBuf),
    /// The directory's files are not the recorder's: it was not played
    /// from the recorder's log, or something else changed it.
    #[error("the directory holds {local:?}, the recorder {recorded:?}")]
    FilesDiffer {
        local: Vec<String>,
        recorded: Vec<String>,
    },
    #[error("the recorder has a transaction open")]
    TransactionOpen,
    #[error("registering the recording VFS failed with SQLite code {0}")]
    Register(i32),
    #[error("hints")]
    Hints(#[source] recoverylog::Error),
}

impl StoreError {
    /// Whether doing the same thing again may succeed: only when SQLite
    /// was busy. A failed store stays failed.
    pub fn is_retryable(&self) -> bool {
        match self {
            StoreError::Sqlite(rusqlite::Error::SqliteFailure(e, _)) => matches!(
                e.code,
                rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked
            ),
            StoreError::Hints(e) => e.is_retryable(),
            _ => false,
        }
    }
}
