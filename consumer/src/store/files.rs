//! The recording VFS's files, in safe Rust: what each SQLite file call
//! does to the local files and records into the store's [`Recorder`].
//! [`super::vfs`] turns SQLite's C calls into these.
//!
//! Every store registers its directory here ([`Dir::register`]); the VFS
//! finds a file's store by the directory the file is in, so one VFS,
//! registered once for the process, serves every store. Files that last
//! (main databases and their rollback and super-journals) are recorded;
//! SQLite's temporary files are anonymous local files, unrecorded.
//!
//! A call that changes a recorded file does it locally first, then records
//! it. When SQLite releases a database's write lock, its transaction has
//! ended, and a barrier is recorded if any file changed since the last. If either fails, the store's directory is *failed*: the local files
//! may be ahead of the log, so from then on every call on the directory's
//! files fails (SQLite sees an I/O error), nothing more is recorded, and
//! the store must be rebuilt from the log.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::c_int;
use std::fs::{self, File, OpenOptions};
use std::io::ErrorKind;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError, Weak};

use libsqlite3_sys as ffi;

use super::{FileError, StoreError};
use crate::recoverylog::{Error, Fnode, LogPath, LogSink, Recorder};

/// Kinds of SQLite files that outlive their transaction, and are recorded.
const RECORDED_KINDS: c_int =
    ffi::SQLITE_OPEN_MAIN_DB | ffi::SQLITE_OPEN_MAIN_JOURNAL | ffi::SQLITE_OPEN_SUPER_JOURNAL;

/// What the VFS needs of a recorder, its sink's type erased so that the
/// VFS's C callbacks are not generic.
pub(crate) trait FileLog {
    fn fnode(&self, path: &str) -> Option<Fnode>;
    fn create(&mut self, path: &str) -> Result<Fnode, Error>;
    fn write(&mut self, fnode: Fnode, offset: u64, data: &[u8]) -> Result<(), Error>;
    fn truncate(&mut self, fnode: Fnode, length: u64) -> Result<(), Error>;
    fn unlink(&mut self, path: &str) -> Result<(), Error>;
    fn barrier(&mut self) -> Result<(), Error>;
    /// Whether a file changed since the last barrier.
    fn transaction_open(&self) -> bool;
}

impl<K: LogSink> FileLog for Recorder<K> {
    fn fnode(&self, path: &str) -> Option<Fnode> {
        Recorder::fnode(self, path)
    }

    fn create(&mut self, path: &str) -> Result<Fnode, Error> {
        Recorder::create(self, path)
    }

    fn write(&mut self, fnode: Fnode, offset: u64, data: &[u8]) -> Result<(), Error> {
        Recorder::write(self, fnode, offset, data)
    }

    fn truncate(&mut self, fnode: Fnode, length: u64) -> Result<(), Error> {
        Recorder::truncate(self, fnode, length)
    }

    fn unlink(&mut self, path: &str) -> Result<(), Error> {
        Recorder::unlink(self, path)
    }

    fn barrier(&mut self) -> Result<(), Error> {
        Recorder::barrier(self)
    }

    fn transaction_open(&self) -> bool {
        self.fsm().transaction_open()
    }
}

pub(crate) type SharedLog = Arc<Mutex<dyn FileLog + Send>>;

/// Locks `mutex`. A panic while holding it happened inside the recorder or
/// this module's bookkeeping, whose every step leaves whole state behind
/// (a panic inside a SQLite callback aborts the process anyway).
pub(crate) fn lock<T: ?Sized>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// Every open store's directory, by its canonical path.
static DIRS: Mutex<BTreeMap<PathBuf, Weak<Dir>>> = Mutex::new(BTreeMap::new());

/// A store's directory: its files are recorded into its log.
pub(crate) struct Dir {
    root: PathBuf,
    log: SharedLog,
    state: Mutex<DirState>,
}

#[derive(Default)]
struct DirState {
    /// The first failure; once set, every call on the directory fails.
    failure: Option<Arc<FileError>>,
    /// Recorded files with a handle open: one each at most.
    open: BTreeSet<String>,
}

impl Dir {
    /// Registers `root` (canonical) as a store's directory, recorded into
    /// `log`, until the returned `Dir` is dropped.
    pub(crate) fn register(root: PathBuf, log: SharedLog) -> Result<Arc<Dir>, StoreError> {
        let mut dirs = lock(&DIRS);
        if dirs.get(&root).is_some_and(|dir| dir.strong_count() > 0) {
            return Err(StoreError::RootInUse(root));
        }
        let dir = Arc::new(Dir {
            root: root.clone(),
            log,
            state: Mutex::default(),
        });
        dirs.insert(root, Arc::downgrade(&dir));
        Ok(dir)
    }

    /// The store's directory holding `path`, and `path`'s name in the log.
    fn find(path: &Path) -> Option<(Arc<Dir>, String)> {
        let name = path.file_name()?.to_str()?;
        LogPath::new(name).ok()?;
        let dir = lock(&DIRS).get(path.parent()?)?.upgrade()?;
        Some((dir, name.to_owned()))
    }

    pub(crate) fn failure(&self) -> Option<Arc<FileError>> {
        lock(&self.state).failure.clone()
    }

    /// `code` unless the directory has failed.
    fn check(&self, code: c_int) -> Result<(), c_int> {
        match lock(&self.state).failure {
            Some(_) => Err(code),
            None => Ok(()),
        }
    }

    /// Fails the directory (keeping its first failure); returns `code`.
    fn fail(&self, error: FileError, code: c_int) -> c_int {
        lock(&self.state)
            .failure
            .get_or_insert_with(|| Arc::new(error));
        code
    }

    fn open(self: &Arc<Self>, path: String, flags: c_int) -> Result<Handle, c_int> {
        self.check(ffi::SQLITE_IOERR)?;
        if lock(&self.state).open.contains(&path) {
            return Err(ffi::SQLITE_CANTOPEN);
        }
        let local = self.root.join(&path);
        let mut options = OpenOptions::new();
        options
            .read(true)
            .write(flags & ffi::SQLITE_OPEN_READONLY == 0);
        // Without CREATE, the file must exist already: open it as such.
        let created = match flags & ffi::SQLITE_OPEN_CREATE != 0 {
            true => options.clone().create_new(true).open(&local),
            false => Err(ErrorKind::AlreadyExists.into()),
        };
        let (file, fnode) = match created {
            Ok(file) => {
                let fnode = lock(&self.log).create(&path).map_err(|source| {
                    self.fail(
                        FileError::record("create", &path, source),
                        ffi::SQLITE_IOERR,
                    )
                })?;
                (file, fnode)
            }
            Err(e) if e.kind() == ErrorKind::AlreadyExists => {
                if flags & ffi::SQLITE_OPEN_EXCLUSIVE != 0 {
                    return Err(ffi::SQLITE_CANTOPEN);
                }
                let file = options.open(&local).map_err(|_| ffi::SQLITE_CANTOPEN)?;
                let fnode = lock(&self.log).fnode(&path).ok_or_else(|| {
                    let error = FileError::Unrecorded { path: path.clone() };
                    self.fail(error, ffi::SQLITE_CANTOPEN)
                })?;
                (file, fnode)
            }
            Err(_) => return Err(ffi::SQLITE_CANTOPEN),
        };
        lock(&self.state).open.insert(path.clone());
        Ok(Handle::Recorded(Recorded {
            dir: Arc::clone(self),
            path,
            fnode,
            file,
            database: flags & ffi::SQLITE_OPEN_MAIN_DB != 0,
        }))
    }

    fn delete(&self, path: &str) -> c_int {
        if let Err(code) = self.check(ffi::SQLITE_IOERR_DELETE) {
            return code;
        }
        match fs::remove_file(self.root.join(path)) {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::NotFound => return ffi::SQLITE_IOERR_DELETE_NOENT,
            Err(source) => {
                let error = FileError::local("delete", path, source);
                return self.fail(error, ffi::SQLITE_IOERR_DELETE);
            }
        }
        let recorded = lock(&self.log).unlink(path);
        match recorded {
            Ok(()) => ffi::SQLITE_OK,
            Err(source) => {
                let error = FileError::record("delete", path, source);
                self.fail(error, ffi::SQLITE_IOERR_DELETE)
            }
        }
    }

    fn access(&self, path: &str, flags: c_int) -> Result<bool, c_int> {
        self.check(ffi::SQLITE_IOERR_ACCESS)?;
        match fs::metadata(self.root.join(path)) {
            // As SQLite's unix VFS: an empty file does not exist, so an
            // empty journal is never hot.
            Ok(meta) => Ok(flags != ffi::SQLITE_ACCESS_EXISTS || !meta.is_file() || meta.len() > 0),
            Err(e) if e.kind() == ErrorKind::NotFound => Ok(false),
            Err(_) => Err(ffi::SQLITE_IOERR_ACCESS),
        }
    }
}

impl Drop for Dir {
    fn drop(&mut self) {
        let mut dirs = lock(&DIRS);
        // A store opened in the same directory since then holds the entry.
        if dirs
            .get(&self.root)
            .is_some_and(|dir| dir.strong_count() == 0)
        {
            dirs.remove(&self.root);
        }
    }
}

/// An open SQLite file.
pub(crate) enum Handle {
    Recorded(Recorded),
    /// A temporary file, deleted already: nobody else can open it.
    Temp(File),
}

pub(crate) struct Recorded {
    dir: Arc<Dir>,
    path: String,
    fnode: Fnode,
    file: File,
    /// A main database, which SQLite locks (journals it does not).
    database: bool,
}

impl Drop for Recorded {
    fn drop(&mut self) {
        lock(&self.dir.state).open.remove(&self.path);
    }
}

/// Opens the file SQLite names `name` (`None` for a temporary file).
pub(crate) fn open(name: Option<&str>, flags: c_int) -> Result<Handle, c_int> {
    let recorded = flags & RECORDED_KINDS != 0 && flags & ffi::SQLITE_OPEN_DELETEONCLOSE == 0;
    match name {
        Some(name) if recorded => {
            let (dir, path) = Dir::find(Path::new(name)).ok_or(ffi::SQLITE_CANTOPEN)?;
            dir.open(path, flags)
        }
        _ => temp_file()
            .map(Handle::Temp)
            .map_err(|_| ffi::SQLITE_CANTOPEN),
    }
}

/// A new anonymous file: created in the system's temporary directory and
/// removed at once, so it lives as long as its handle.
fn temp_file() -> std::io::Result<File> {
    static SEQ: AtomicU64 = AtomicU64::new(0);
    let name = format!(
        "rotary-sqlite-{}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed)
    );
    let path = std::env::temp_dir().join(name);
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .open(&path)?;
    fs::remove_file(&path)?;
    Ok(file)
}

/// Deletes the file `name`.
pub(crate) fn delete(name: &str) -> c_int {
    match Dir::find(Path::new(name)) {
        Some((dir, path)) => dir.delete(&path),
        None => ffi::SQLITE_IOERR_DELETE,
    }
}

/// Whether the file `name` exists (and is not empty, for
/// `SQLITE_ACCESS_EXISTS`). Files outside every store do not.
pub(crate) fn access(name: &str, flags: c_int) -> Result<bool, c_int> {
    match Dir::find(Path::new(name)) {
        Some((dir, path)) => dir.access(&path, flags),
        None => Ok(false),
    }
}

/// `name` as an absolute path: relative names are the working
/// directory's, as in SQLite's unix VFS (a store names its files
/// absolutely).
pub(crate) fn full_pathname(name: &str) -> Result<String, c_int> {
    if Path::new(name).is_absolute() {
        return Ok(name.to_owned());
    }
    let cwd = std::env::current_dir().map_err(|_| ffi::SQLITE_CANTOPEN)?;
    let full = cwd.join(name);
    full.to_str().map(str::to_owned).ok_or(ffi::SQLITE_CANTOPEN)
}

/// Refuses the pragmas that would change files outside a rollback
/// journal's DELETE cycle, so that no committed change escapes a barrier:
/// any `journal_mode` but DELETE (WAL, TRUNCATE and PERSIST never delete
/// the journal; MEMORY and OFF write the database without one) and
/// `locking_mode=EXCLUSIVE` (which keeps the journal between
/// transactions). Other pragmas are SQLite's to run.
pub(crate) fn pragma(name: &str, value: Option<&str>) -> Result<(), String> {
    let value = value.map(str::to_ascii_lowercase);
    match (name.to_ascii_lowercase().as_str(), value.as_deref()) {
        ("journal_mode", Some(mode)) if mode != "delete" => Err(format!(
            "journal_mode={mode} is refused: a recorded store keeps journal_mode=DELETE, \
             whose journal deletions end its transactions in the recovery log"
        )),
        ("locking_mode", Some(mode)) if mode != "normal" => Err(format!(
            "locking_mode={mode} is refused: a recorded store deletes its journal after \
             every transaction, which exclusive locking would not"
        )),
        _ => Ok(()),
    }
}

impl Handle {
    /// Reads `buf.len()` bytes at `offset`; past the end of the file, the
    /// rest of `buf` is zeroed and the read is short, as SQLite expects.
    pub(crate) fn read(&self, buf: &mut [u8], offset: u64) -> c_int {
        let file = match self {
            Handle::Recorded(rec) => {
                if let Err(code) = rec.dir.check(ffi::SQLITE_IOERR_READ) {
                    return code;
                }
                &rec.file
            }
            Handle::Temp(file) => file,
        };
        let mut done = 0;
        while done < buf.len() {
            match file.read_at(&mut buf[done..], offset + done as u64) {
                Ok(0) => break,
                Ok(n) => done += n,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                // A failed read changes no file: the log still matches.
                Err(_) => return ffi::SQLITE_IOERR_READ,
            }
        }
        if done < buf.len() {
            buf[done..].fill(0);
            return ffi::SQLITE_IOERR_SHORT_READ;
        }
        ffi::SQLITE_OK
    }

    pub(crate) fn write(&self, data: &[u8], offset: u64) -> c_int {
        let code = ffi::SQLITE_IOERR_WRITE;
        let rec = match self {
            Handle::Recorded(rec) => rec,
            Handle::Temp(file) => return result_code(file.write_all_at(data, offset), code),
        };
        rec.change(
            "write",
            code,
            |file| file.write_all_at(data, offset),
            |log| log.write(rec.fnode, offset, data),
        )
    }

    pub(crate) fn truncate(&self, length: u64) -> c_int {
        let code = ffi::SQLITE_IOERR_TRUNCATE;
        let rec = match self {
            Handle::Recorded(rec) => rec,
            Handle::Temp(file) => return result_code(file.set_len(length), code),
        };
        rec.change(
            "truncate",
            code,
            |file| file.set_len(length),
            |log| log.truncate(rec.fnode, length),
        )
    }

    /// SQLite lowers its lock on a database to `level`. Lowered to shared
    /// or none, the write transaction has ended, committed or rolled back:
    /// its journal is deleted and the database file holds the outcome,
    /// truncated to its size. If a file changed since the last barrier, a
    /// barrier is recorded now, and SQLite's `COMMIT` (or `ROLLBACK`)
    /// fails with this call if it cannot be.
    pub(crate) fn unlock(&self, level: c_int) -> c_int {
        let code = ffi::SQLITE_IOERR_UNLOCK;
        let rec = match self {
            Handle::Recorded(rec) if rec.database && level <= ffi::SQLITE_LOCK_SHARED => rec,
            _ => return ffi::SQLITE_OK,
        };
        if let Err(code) = rec.dir.check(code) {
            return code;
        }
        let mut log = lock(&rec.dir.log);
        if !log.transaction_open() {
            return ffi::SQLITE_OK;
        }
        let recorded = log.barrier();
        drop(log);
        match recorded {
            Ok(()) => ffi::SQLITE_OK,
            Err(source) => rec
                .dir
                .fail(FileError::record("barrier", &rec.path, source), code),
        }
    }

    pub(crate) fn size(&self) -> Result<u64, c_int> {
        let file = match self {
            Handle::Recorded(rec) => {
                rec.dir.check(ffi::SQLITE_IOERR_FSTAT)?;
                &rec.file
            }
            Handle::Temp(file) => file,
        };
        file.metadata()
            .map(|meta| meta.len())
            .map_err(|_| ffi::SQLITE_IOERR_FSTAT)
    }
}

impl Recorded {
    /// Changes the local file with `local`, then records the change with
    /// `record`; either failing fails the directory.
    fn change(
        &self,
        op: &'static str,
        code: c_int,
        local: impl FnOnce(&File) -> std::io::Result<()>,
        record: impl FnOnce(&mut dyn FileLog) -> Result<(), Error>,
    ) -> c_int {
        if let Err(code) = self.dir.check(code) {
            return code;
        }
        if let Err(source) = local(&self.file) {
            return self
                .dir
                .fail(FileError::local(op, &self.path, source), code);
        }
        let recorded = record(&mut *lock(&self.dir.log));
        match recorded {
            Ok(()) => ffi::SQLITE_OK,
            Err(source) => self
                .dir
                .fail(FileError::record(op, &self.path, source), code),
        }
    }
}

fn result_code(result: std::io::Result<()>, code: c_int) -> c_int {
    match result {
        Ok(()) => ffi::SQLITE_OK,
        Err(_) => code,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pragmas_that_escape_the_journal_are_refused() {
        for (name, value) in [
            ("journal_mode", "wal"),
            ("JOURNAL_MODE", "WAL"),
            ("journal_mode", "Truncate"),
            ("journal_mode", "persist"),
            ("journal_mode", "memory"),
            ("journal_mode", "off"),
            ("locking_mode", "exclusive"),
            ("Locking_Mode", "EXCLUSIVE"),
        ] {
            let refused = pragma(name, Some(value)).unwrap_err();
            assert!(refused.contains("refused"), "{name}={value}: {refused}");
        }
        for (name, value) in [
            ("journal_mode", None),
            ("journal_mode", Some("DELETE")),
            ("locking_mode", None),
            ("locking_mode", Some("normal")),
            ("cache_size", Some("4")),
            ("synchronous", Some("off")),
        ] {
            assert_eq!(pragma(name, value), Ok(()), "{name}={value:?}");
        }
    }

    #[test]
    fn files_outside_every_store_are_not_found() {
        assert!(Dir::find(Path::new("/nowhere/store.db")).is_none());
        assert_eq!(
            access("/nowhere/store.db", ffi::SQLITE_ACCESS_EXISTS),
            Ok(false)
        );
        assert_eq!(delete("/nowhere/store.db"), ffi::SQLITE_IOERR_DELETE);
        let flags = ffi::SQLITE_OPEN_MAIN_DB | ffi::SQLITE_OPEN_CREATE;
        assert!(matches!(
            open(Some("/nowhere/store.db"), flags),
            Err(ffi::SQLITE_CANTOPEN)
        ));
    }
}
