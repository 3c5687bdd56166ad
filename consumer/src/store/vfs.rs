//! The recording VFS's C side: a `sqlite3_vfs` whose callbacks turn
//! SQLite's pointers into Rust values and call [`super::files`], which
//! does the work in safe Rust.
//!
//! The VFS is registered once per process, under [`VFS_NAME`], and never
//! unregistered: its struct is leaked, so no connection can outlive it.
//! Each open file is a [`VfsFile`], SQLite's `sqlite3_file` followed by a
//! pointer to a boxed [`Handle`], made by `x_open` and freed by `x_close`.
//! SQLite calls a file's methods only between the two, and from one
//! thread at a time (a connection is used by one thread at a time).
//!
//! What the VFS does not do: shared memory and memory mapping (version 1
//! file methods, so SQLite uses neither: every change of a database goes
//! through `xWrite`), locking (a store's directory is its connection's
//! alone; `xUnlock` only tells where a transaction ends), syncing (the log
//! is what lasts: local files are rebuilt from it) and loading
//! extensions. Randomness and time come from the default VFS.
#![allow(unsafe_code)] // SQLite's VFS is C callbacks on pointers SQLite owns; each block says why it holds

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::ptr;
use std::sync::OnceLock;

use libsqlite3_sys as ffi;

use super::files::{self, Handle};

/// The name connections open the recording VFS by.
pub(crate) const VFS_NAME: &CStr = c"rotary-recorded";

/// Longest path name, in bytes, that SQLite hands the VFS (Linux's
/// `PATH_MAX`).
const PATHNAME_BYTES_MAX: c_int = 4096;

/// The sector size SQLite assumes, as its unix VFS does.
const SECTOR_BYTES: c_int = 4096;

/// An open file as SQLite holds it: SQLite allocates `szOsFile` bytes and
/// sees only `base`.
#[repr(C)]
struct VfsFile {
    base: ffi::sqlite3_file,
    /// Boxed by `x_open`; null before it succeeds and after `x_close`.
    handle: *mut Handle,
}

const _: () = assert!(std::mem::offset_of!(VfsFile, base) == 0);

/// Registers the VFS, once; later calls return the first one's result.
pub(crate) fn register() -> Result<(), c_int> {
    static REGISTERED: OnceLock<Result<(), c_int>> = OnceLock::new();
    *REGISTERED.get_or_init(register_once)
}

fn register_once() -> Result<(), c_int> {
    // SAFETY: a null name asks SQLite for its default VFS (initializing
    // SQLite first); nothing of ours is read.
    let default = unsafe { ffi::sqlite3_vfs_find(ptr::null()) };
    if default.is_null() {
        return Err(ffi::SQLITE_ERROR);
    }
    let vfs = Box::leak(Box::new(ffi::sqlite3_vfs {
        iVersion: 1,
        szOsFile: std::mem::size_of::<VfsFile>() as c_int,
        mxPathname: PATHNAME_BYTES_MAX,
        pNext: ptr::null_mut(),
        zName: VFS_NAME.as_ptr(),
        // The default VFS, for randomness and time: SQLite's own, which
        // stays registered for the life of the process.
        pAppData: default.cast(),
        xOpen: Some(x_open),
        xDelete: Some(x_delete),
        xAccess: Some(x_access),
        xFullPathname: Some(x_full_pathname),
        xDlOpen: Some(x_dl_open),
        xDlError: Some(x_dl_error),
        xDlSym: Some(x_dl_sym),
        xDlClose: Some(x_dl_close),
        xRandomness: Some(x_randomness),
        xSleep: Some(x_sleep),
        xCurrentTime: Some(x_current_time),
        xGetLastError: None,
        xCurrentTimeInt64: None,
        xSetSystemCall: None,
        xGetSystemCall: None,
        xNextSystemCall: None,
    }));
    // SAFETY: `vfs` is leaked, so it outlives every use SQLite makes of
    // it, and its name is a static C string.
    match unsafe { ffi::sqlite3_vfs_register(vfs, 0) } {
        ffi::SQLITE_OK => Ok(()),
        code => Err(code),
    }
}

static IO_METHODS: ffi::sqlite3_io_methods = ffi::sqlite3_io_methods {
    iVersion: 1,
    xClose: Some(x_close),
    xRead: Some(x_read),
    xWrite: Some(x_write),
    xTruncate: Some(x_truncate),
    xSync: Some(x_sync),
    xFileSize: Some(x_file_size),
    xLock: Some(x_lock),
    xUnlock: Some(x_unlock),
    xCheckReservedLock: Some(x_check_reserved_lock),
    xFileControl: Some(x_file_control),
    xSectorSize: Some(x_sector_size),
    xDeviceCharacteristics: Some(x_device_characteristics),
    xShmMap: None,
    xShmLock: None,
    xShmBarrier: None,
    xShmUnmap: None,
    xFetch: None,
    xUnfetch: None,
};

/// `ptr` as a string: `Ok(None)` if null, `Err` if not UTF-8.
///
/// # Safety
/// `ptr` is null or a NUL-terminated string that outlives `'a`.
unsafe fn c_str<'a>(ptr: *const c_char) -> Result<Option<&'a str>, ()> {
    if ptr.is_null() {
        return Ok(None);
    }
    // SAFETY: the caller's promise.
    let name = unsafe { CStr::from_ptr(ptr) };
    name.to_str().map(Some).map_err(|_| ())
}

/// The handle of an open file.
///
/// # Safety
/// `file` is a file `x_open` opened and `x_close` has not closed, as every
/// file SQLite passes a file method is.
unsafe fn handle<'a>(file: *mut ffi::sqlite3_file) -> &'a Handle {
    // SAFETY: the caller's promise: `file` is a `VfsFile` whose handle
    // `x_open` boxed and `x_close` has not yet freed.
    unsafe { &*(*file.cast::<VfsFile>()).handle }
}

/// The default VFS, which `register_once` keeps in our VFS's app data.
///
/// # Safety
/// `vfs` is the recording VFS, as SQLite passes it to its callbacks.
unsafe fn default_vfs(vfs: *mut ffi::sqlite3_vfs) -> *mut ffi::sqlite3_vfs {
    // SAFETY: the caller's promise; the struct is leaked, never freed.
    unsafe { (*vfs).pAppData.cast() }
}

unsafe extern "C" fn x_open(
    _vfs: *mut ffi::sqlite3_vfs,
    name: ffi::sqlite3_filename,
    file: *mut ffi::sqlite3_file,
    flags: c_int,
    out_flags: *mut c_int,
) -> c_int {
    let slot = file.cast::<VfsFile>();
    // SAFETY: SQLite hands `x_open` `szOsFile` bytes (a `VfsFile`),
    // aligned for any type, to initialize. A null `pMethods` tells SQLite
    // not to close a file that failed to open.
    unsafe {
        slot.write(VfsFile {
            base: ffi::sqlite3_file {
                pMethods: ptr::null(),
            },
            handle: ptr::null_mut(),
        })
    };
    // SAFETY: SQLite's file name is null or a C string that lasts while
    // the file is open.
    let Ok(name) = (unsafe { c_str(name) }) else {
        return ffi::SQLITE_CANTOPEN;
    };
    match files::open(name, flags) {
        Ok(handle) => {
            // SAFETY: `slot` was initialized above; `out_flags` is null or
            // SQLite's to write.
            unsafe {
                (*slot).handle = Box::into_raw(Box::new(handle));
                (*slot).base.pMethods = &IO_METHODS;
                if !out_flags.is_null() {
                    *out_flags = flags;
                }
            }
            ffi::SQLITE_OK
        }
        Err(code) => code,
    }
}

unsafe extern "C" fn x_delete(
    _vfs: *mut ffi::sqlite3_vfs,
    name: *const c_char,
    _sync_dir: c_int,
) -> c_int {
    // SAFETY: SQLite passes a C string for the duration of the call.
    match unsafe { c_str(name) } {
        Ok(Some(name)) => files::delete(name),
        _ => ffi::SQLITE_IOERR_DELETE,
    }
}

unsafe extern "C" fn x_access(
    _vfs: *mut ffi::sqlite3_vfs,
    name: *const c_char,
    flags: c_int,
    out: *mut c_int,
) -> c_int {
    // SAFETY: SQLite passes a C string for the duration of the call.
    let exists = match unsafe { c_str(name) } {
        Ok(Some(name)) => files::access(name, flags),
        _ => Ok(false),
    };
    match exists {
        Ok(exists) => {
            // SAFETY: `out` is SQLite's to write.
            unsafe { *out = c_int::from(exists) };
            ffi::SQLITE_OK
        }
        Err(code) => code,
    }
}

unsafe extern "C" fn x_full_pathname(
    _vfs: *mut ffi::sqlite3_vfs,
    name: *const c_char,
    out_bytes: c_int,
    out: *mut c_char,
) -> c_int {
    // SAFETY: SQLite passes a C string for the duration of the call.
    let full = match unsafe { c_str(name) } {
        Ok(Some(name)) => files::full_pathname(name),
        _ => Err(ffi::SQLITE_CANTOPEN),
    };
    let full = match full {
        Ok(full) => full,
        Err(code) => return code,
    };
    let bytes = full.as_bytes();
    if bytes.len() >= usize::try_from(out_bytes).unwrap_or(0) {
        return ffi::SQLITE_CANTOPEN;
    }
    // SAFETY: `out` holds `out_bytes` bytes, more than the name and its NUL.
    unsafe {
        ptr::copy_nonoverlapping(bytes.as_ptr(), out.cast::<u8>(), bytes.len());
        *out.add(bytes.len()) = 0;
    }
    ffi::SQLITE_OK
}

/// Extensions are not loaded through a store: SQLite reports the library
/// as not found, with the message it wrote before asking `x_dl_error`.
extern "C" fn x_dl_open(_vfs: *mut ffi::sqlite3_vfs, _name: *const c_char) -> *mut c_void {
    ptr::null_mut()
}

extern "C" fn x_dl_error(_vfs: *mut ffi::sqlite3_vfs, _bytes: c_int, _out: *mut c_char) {}

extern "C" fn x_dl_sym(
    _vfs: *mut ffi::sqlite3_vfs,
    _lib: *mut c_void,
    _symbol: *const c_char,
) -> Option<unsafe extern "C" fn(*mut ffi::sqlite3_vfs, *mut c_void, *const c_char)> {
    None
}

extern "C" fn x_dl_close(_vfs: *mut ffi::sqlite3_vfs, _lib: *mut c_void) {}

unsafe extern "C" fn x_randomness(
    vfs: *mut ffi::sqlite3_vfs,
    bytes: c_int,
    out: *mut c_char,
) -> c_int {
    // SAFETY: `vfs` is ours, its app data the default VFS; SQLite's
    // buffer is passed on unchanged.
    unsafe {
        let default = default_vfs(vfs);
        match (*default).xRandomness {
            Some(randomness) => randomness(default, bytes, out),
            None => 0,
        }
    }
}

extern "C" fn x_sleep(_vfs: *mut ffi::sqlite3_vfs, micros: c_int) -> c_int {
    let micros = u64::try_from(micros).unwrap_or(0);
    std::thread::sleep(std::time::Duration::from_micros(micros));
    c_int::try_from(micros).unwrap_or(c_int::MAX)
}

unsafe extern "C" fn x_current_time(vfs: *mut ffi::sqlite3_vfs, out: *mut f64) -> c_int {
    // SAFETY: `vfs` is ours, its app data the default VFS; SQLite's
    // output is passed on unchanged.
    unsafe {
        let default = default_vfs(vfs);
        match (*default).xCurrentTime {
            Some(current_time) => current_time(default, out),
            None => ffi::SQLITE_ERROR,
        }
    }
}

unsafe extern "C" fn x_close(file: *mut ffi::sqlite3_file) -> c_int {
    let slot = file.cast::<VfsFile>();
    // SAFETY: SQLite closes an open file once, after its last other call;
    // its handle is the box `x_open` made, taken out here so it is freed
    // once.
    let handle = unsafe { ptr::replace(&raw mut (*slot).handle, ptr::null_mut()) };
    if !handle.is_null() {
        // SAFETY: as above: the box `x_open` made, not yet freed.
        drop(unsafe { Box::from_raw(handle) });
    }
    ffi::SQLITE_OK
}

unsafe extern "C" fn x_read(
    file: *mut ffi::sqlite3_file,
    buf: *mut c_void,
    bytes: c_int,
    offset: ffi::sqlite3_int64,
) -> c_int {
    let (Ok(len), Ok(offset)) = (usize::try_from(bytes), u64::try_from(offset)) else {
        return ffi::SQLITE_IOERR_READ;
    };
    // SAFETY: SQLite reads into `bytes` bytes at `buf` that nothing else
    // touches during the call; `file` is open.
    unsafe {
        let buf = std::slice::from_raw_parts_mut(buf.cast::<u8>(), len);
        handle(file).read(buf, offset)
    }
}

unsafe extern "C" fn x_write(
    file: *mut ffi::sqlite3_file,
    data: *const c_void,
    bytes: c_int,
    offset: ffi::sqlite3_int64,
) -> c_int {
    let (Ok(len), Ok(offset)) = (usize::try_from(bytes), u64::try_from(offset)) else {
        return ffi::SQLITE_IOERR_WRITE;
    };
    // SAFETY: SQLite writes `bytes` bytes from `data`, which it does not
    // change during the call; `file` is open.
    unsafe {
        let data = std::slice::from_raw_parts(data.cast::<u8>(), len);
        handle(file).write(data, offset)
    }
}

unsafe extern "C" fn x_truncate(file: *mut ffi::sqlite3_file, length: ffi::sqlite3_int64) -> c_int {
    let Ok(length) = u64::try_from(length) else {
        return ffi::SQLITE_IOERR_TRUNCATE;
    };
    // SAFETY: SQLite passes an open file.
    unsafe { handle(file) }.truncate(length)
}

/// Local files are not synced: the log holds what lasts, and a barrier's
/// append has returned before SQLite's commit does.
extern "C" fn x_sync(_file: *mut ffi::sqlite3_file, _flags: c_int) -> c_int {
    ffi::SQLITE_OK
}

unsafe extern "C" fn x_file_size(
    file: *mut ffi::sqlite3_file,
    out: *mut ffi::sqlite3_int64,
) -> c_int {
    // SAFETY: SQLite passes an open file.
    match unsafe { handle(file) }.size() {
        Ok(size) => {
            let size = ffi::sqlite3_int64::try_from(size).unwrap_or(ffi::sqlite3_int64::MAX);
            // SAFETY: `out` is SQLite's to write.
            unsafe { *out = size };
            ffi::SQLITE_OK
        }
        Err(code) => code,
    }
}

/// No locks: a store's files are its one connection's.
extern "C" fn x_lock(_file: *mut ffi::sqlite3_file, _level: c_int) -> c_int {
    ffi::SQLITE_OK
}

/// Where a transaction ends, and its barrier is recorded ([`Handle::unlock`]).
unsafe extern "C" fn x_unlock(file: *mut ffi::sqlite3_file, level: c_int) -> c_int {
    // SAFETY: SQLite passes an open file.
    unsafe { handle(file) }.unlock(level)
}

unsafe extern "C" fn x_check_reserved_lock(
    _file: *mut ffi::sqlite3_file,
    out: *mut c_int,
) -> c_int {
    // SAFETY: `out` is SQLite's to write.
    unsafe { *out = 0 };
    ffi::SQLITE_OK
}

/// Answers only `SQLITE_FCNTL_PRAGMA`, to refuse the pragmas
/// [`files::pragma`] names; SQLite runs every other pragma itself.
unsafe extern "C" fn x_file_control(
    _file: *mut ffi::sqlite3_file,
    op: c_int,
    arg: *mut c_void,
) -> c_int {
    if op != ffi::SQLITE_FCNTL_PRAGMA {
        return ffi::SQLITE_NOTFOUND;
    }
    let args = arg.cast::<*mut c_char>();
    // SAFETY: for SQLITE_FCNTL_PRAGMA, `arg` is three C string pointers:
    // the error message out, the pragma's name, its value or null.
    let (name, value) = unsafe { (c_str(*args.add(1)), c_str(*args.add(2))) };
    let (Ok(Some(name)), Ok(value)) = (name, value) else {
        return ffi::SQLITE_NOTFOUND;
    };
    let Err(message) = files::pragma(name, value) else {
        return ffi::SQLITE_NOTFOUND;
    };
    let message = CString::new(message).unwrap_or_default();
    // SAFETY: SQLite frees the message with sqlite3_free, so it is
    // allocated by sqlite3_mprintf, whose "%s" takes the one C string.
    unsafe { *args = ffi::sqlite3_mprintf(c"%s".as_ptr(), message.as_ptr()) };
    ffi::SQLITE_ERROR
}

extern "C" fn x_sector_size(_file: *mut ffi::sqlite3_file) -> c_int {
    SECTOR_BYTES
}

/// Writes do not disturb neighbouring bytes (as SQLite's unix VFS says of
/// local files). No atomic writes: SQLite must journal every change, so
/// that a transaction's changes are whole only once it ends.
extern "C" fn x_device_characteristics(_file: *mut ffi::sqlite3_file) -> c_int {
    ffi::SQLITE_IOCAP_POWERSAFE_OVERWRITE
}
