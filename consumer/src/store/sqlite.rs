//! [`SqliteStore`]: a SQLite database in a directory, its files recorded
//! into a recovery log, with the shard's checkpoint in the database.

use std::collections::BTreeSet;
use std::fs;
use std::ops::Deref;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use rusqlite::{Connection, OpenFlags, OptionalExtension, Transaction, TransactionBehavior};

use super::files::{self, Dir, SharedLog};
use super::vfs::{self, VFS_NAME};
use super::{FileError, StoreError};
use crate::recoverylog::{Hints, LogSink, Recorder};

/// The database's file in the store's directory.
pub const DB_FILE: &str = "store.db";

/// What the store runs on a connection before the application does.
/// Temporary tables and indices stay in memory (they are not the shard's
/// state, and need no files); the journal mode is the one the store's
/// barriers rely on (and the default, stated so that it shows).
const SETUP_SQL: &str = "\
    PRAGMA temp_store = MEMORY;
    PRAGMA journal_mode = DELETE;
    CREATE TABLE IF NOT EXISTS rotary_checkpoint (
        id INTEGER PRIMARY KEY CHECK (id = 0),
        checkpoint BLOB
    );";

/// A SQLite database whose files are recorded into a recovery log.
///
/// It opens the database in a directory that holds exactly the files its
/// recorder's log describes (a player's, handed off to the recorder, or
/// an empty one for a new log). Every transaction that changes the
/// database ends with a barrier in the log before its commit returns; see
/// the [module docs](super) for how and why.
///
/// One connection, used from one thread at a time, reaches the files;
/// the VFS takes no locks, so nothing else may open them.
pub struct SqliteStore<K: LogSink + Send + 'static> {
    // Fields drop in order: the connection closes its files before the
    // store's directory is released.
    conn: Connection,
    dir: Arc<Dir>,
    recorder: Arc<Mutex<Recorder<K>>>,
    root: PathBuf,
}

impl<K: LogSink + Send + 'static> SqliteStore<K> {
    /// Opens (or creates) the database [`DB_FILE`] in `root`, recording
    /// its files through `recorder`, and creates the checkpoint table if
    /// it is missing (a transaction of its own).
    pub fn open(root: &Path, recorder: Recorder<K>) -> Result<SqliteStore<K>, StoreError> {
        if recorder.fsm().transaction_open() {
            return Err(StoreError::TransactionOpen);
        }
        let root_error = |source| StoreError::Root {
            path: root.to_owned(),
            source,
        };
        fs::create_dir_all(root).map_err(root_error)?;
        let root = fs::canonicalize(root).map_err(root_error)?;
        check_files(&root, &recorder)?;
        vfs::register().map_err(StoreError::Register)?;
        let recorder = Arc::new(Mutex::new(recorder));
        let dir = Dir::register(root.clone(), Arc::clone(&recorder) as SharedLog)?;
        let flags = OpenFlags::SQLITE_OPEN_READ_WRITE
            | OpenFlags::SQLITE_OPEN_CREATE
            | OpenFlags::SQLITE_OPEN_NO_MUTEX;
        let opened = Connection::open_with_flags_and_vfs(root.join(DB_FILE), flags, VFS_NAME);
        let conn = match opened {
            Ok(conn) => conn,
            Err(e) => return Err(failed_or(&dir, e)),
        };
        let store = SqliteStore {
            conn,
            dir,
            recorder,
            root,
        };
        store
            .conn
            .execute_batch(SETUP_SQL)
            .map_err(|e| store.error(e))?;
        store.assert_barriered();
        Ok(store)
    }

    /// The store's connection, for reads and for statements outside
    /// [`Self::begin`]'s transactions (each is a transaction of its own,
    /// recorded like any other). Do not change `journal_mode` or
    /// `locking_mode`: the store refuses it.
    pub fn connection(&self) -> &Connection {
        &self.conn
    }

    /// The store's directory (canonical).
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Begins a write transaction (`BEGIN IMMEDIATE`).
    pub fn begin(&self) -> Result<StoreTxn<'_, K>, StoreError> {
        self.check()?;
        let tx = Transaction::new_unchecked(&self.conn, TransactionBehavior::Immediate)
            .map_err(|e| self.error(e))?;
        Ok(StoreTxn { store: self, tx })
    }

    /// The checkpoint as the store's connection sees it: the last one
    /// committed, or one written by the open transaction; `None` if none.
    pub fn read_checkpoint(&self) -> Result<Option<Vec<u8>>, StoreError> {
        self.check()?;
        read_checkpoint(&self.conn).map_err(|e| self.error(e))
    }

    /// Hints to rebuild the store's files as of its last transaction.
    pub fn hints(&self) -> Result<Hints, StoreError> {
        self.check()?;
        self.recorder().hints().map_err(StoreError::Hints)
    }

    /// The failure that made the store unusable, if one has.
    pub fn failure(&self) -> Option<Arc<FileError>> {
        self.dir.failure()
    }

    /// The recorder, locked. The store's connection must not be used
    /// while the guard is held: its file calls would wait for the lock.
    pub fn recorder(&self) -> MutexGuard<'_, Recorder<K>> {
        files::lock(&self.recorder)
    }

    fn check(&self) -> Result<(), StoreError> {
        match self.dir.failure() {
            Some(failure) => Err(StoreError::Failed(failure)),
            None => Ok(()),
        }
    }

    /// A SQLite error, or the file failure behind it.
    fn error(&self, e: rusqlite::Error) -> StoreError {
        failed_or(&self.dir, e)
    }

    /// Every change SQLite made ended with a barrier: no file operation
    /// is recorded past the log's last one. (A transaction ends by
    /// releasing its lock, which records the barrier; nothing changes a
    /// file outside one.)
    fn assert_barriered(&self) {
        if self.dir.failure().is_none() {
            assert!(
                !self.recorder().fsm().transaction_open(),
                "a SQLite transaction ended without deleting its journal"
            );
        }
    }
}

// A store moves to the thread that runs its shard.
const _: fn() = || {
    fn send<T: Send>() {}
    send::<SqliteStore<crate::recoverylog::MemLog>>();
};

fn failed_or(dir: &Dir, e: rusqlite::Error) -> StoreError {
    match dir.failure() {
        Some(failure) => StoreError::Failed(failure),
        None => StoreError::Sqlite(e),
    }
}

/// The directory holds exactly the files the recorder's log does.
fn check_files<K: LogSink>(root: &Path, recorder: &Recorder<K>) -> Result<(), StoreError> {
    let local = local_files(root, root).map_err(|source| StoreError::Root {
        path: root.to_owned(),
        source,
    })?;
    let recorded: BTreeSet<String> = recorder
        .fsm()
        .paths()
        .map(|(path, _)| path.as_str().to_owned())
        .collect();
    if local != recorded {
        return Err(StoreError::FilesDiffer {
            local: local.into_iter().collect(),
            recorded: recorded.into_iter().collect(),
        });
    }
    Ok(())
}

/// Every file under `dir`, by its `/`-separated path under `root`.
fn local_files(root: &Path, dir: &Path) -> std::io::Result<BTreeSet<String>> {
    let mut out = BTreeSet::new();
    for entry in fs::read_dir(dir)? {
        let path = entry?.path();
        if path.is_dir() {
            out.extend(local_files(root, &path)?);
            continue;
        }
        let relative = path.strip_prefix(root).unwrap_or(&path);
        let name: Vec<&str> = relative.iter().filter_map(|c| c.to_str()).collect();
        out.insert(name.join("/"));
    }
    Ok(out)
}

/// A write transaction of a [`SqliteStore`]. It derefs to the store's
/// connection, for the application's statements. Dropped without
/// [`Self::commit`], it rolls back.
pub struct StoreTxn<'s, K: LogSink + Send + 'static> {
    store: &'s SqliteStore<K>,
    tx: Transaction<'s>,
}

impl<K: LogSink + Send + 'static> StoreTxn<'_, K> {
    /// Sets the shard's checkpoint, committed with the transaction.
    pub fn write_checkpoint(&self, checkpoint: &[u8]) -> Result<(), StoreError> {
        write_checkpoint(&self.tx, checkpoint).map_err(|e| self.store.error(e))
    }

    /// Commits: once this returns, the transaction's changes and the
    /// barrier after them are appended to the log. On an error the store
    /// has failed, unless SQLite itself refused the commit.
    pub fn commit(self) -> Result<(), StoreError> {
        let StoreTxn { store, tx } = self;
        tx.commit().map_err(|e| store.error(e))?;
        // SQLite reports a failed barrier as the commit's error; should it
        // ever not, the failure still tells.
        store.check()?;
        store.assert_barriered();
        Ok(())
    }

    /// Rolls back. SQLite restores the database file from the journal and
    /// deletes it, and a barrier is recorded too: the log's files are as
    /// before the transaction, byte for byte.
    pub fn rollback(self) -> Result<(), StoreError> {
        let StoreTxn { store, tx } = self;
        tx.rollback().map_err(|e| store.error(e))?;
        store.check()?;
        store.assert_barriered();
        Ok(())
    }
}

impl<K: LogSink + Send + 'static> Deref for StoreTxn<'_, K> {
    type Target = Connection;

    fn deref(&self) -> &Connection {
        &self.tx
    }
}

/// Sets the checkpoint in `tx`, to commit with the rest of it.
pub fn write_checkpoint(tx: &Transaction<'_>, checkpoint: &[u8]) -> rusqlite::Result<()> {
    tx.execute(
        "INSERT INTO rotary_checkpoint (id, checkpoint) VALUES (0, ?1)
         ON CONFLICT (id) DO UPDATE SET checkpoint = excluded.checkpoint",
        [checkpoint],
    )?;
    Ok(())
}

/// The checkpoint in the database `conn` reads (a store's, or a played
/// copy's opened with SQLite's own VFS), if one was committed.
pub fn read_checkpoint(conn: &Connection) -> rusqlite::Result<Option<Vec<u8>>> {
    conn.query_row(
        "SELECT checkpoint FROM rotary_checkpoint WHERE id = 0",
        [],
        |row| row.get::<_, Option<Vec<u8>>>(0),
    )
    .optional()
    .map(Option::flatten)
}
