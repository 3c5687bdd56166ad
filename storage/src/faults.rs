//! Injected disk faults: a hook, installed per thread, that decides before
//! each disk operation of this crate whether it fails, and with which OS
//! error.
//!
//! The errors a dying disk gives (`EIO` from a write or an fdatasync, a
//! file system remounted read-only) cannot be produced on demand on every
//! machine: device-mapper and the kernel's fault injection need privileges
//! and kernel options. Tests and simulations install a [`Faults`] on the
//! thread that runs a shard instead, as they install a clock
//! (`rotary_proto::clock::install`), and the operations of that thread fail
//! as the hook says, without reaching the disk. A hook may also hold a
//! spool write or fdatasync back for a while before it answers (a disk
//! that stalls), so that a test can act while the operation is in flight.
//!
//! Nothing is installed in production: each operation then costs one
//! thread-local read.

use std::cell::RefCell;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

/// The disk operations a [`Faults`] is asked about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DiskOp {
    /// A write of a spool's staged bytes (or of bytes recovery puts back).
    SpoolWrite,
    /// An fdatasync of a spool.
    SpoolSync,
    /// A spool's growth by `fallocate`.
    SpoolAllocate,
    /// A spool's seal into a fragment file: asked once per seal, before
    /// the file is cut, synced and renamed.
    Seal,
    /// A write of commit-log records (or of a compaction's snapshot).
    LogWrite,
    /// An fdatasync of the commit log (or of a compaction's snapshot).
    LogSync,
}

/// Decides, before each disk operation of the thread it is installed on, whether it fails.
pub trait Faults: Send + Sync + 'static {
    /// Some(errno) fails the operation with that OS error instead of doing it.
    fn check(&self, op: DiskOp, path: &Path) -> Option<i32>;

    /// Whether `op` on `path` is held back for now: a disk that stalls
    /// before it answers, as a dying one may for seconds before its EIO.
    /// Asked before [`Faults::check`], and again every [`HOLD_POLL`] while
    /// it answers true, by the operations that await the disk anyway
    /// (spool writes and fdatasyncs); the others are never held, since
    /// holding them would hold the thread. Nothing is held unless a hook
    /// says so.
    fn holds(&self, _op: DiskOp, _path: &Path) -> bool {
        false
    }
}

/// How often an operation held by its hook ([`Faults::holds`]) asks again.
pub const HOLD_POLL: Duration = Duration::from_millis(1);

/// Lets configurations that hold a hook derive `Debug`.
impl std::fmt::Debug for dyn Faults {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Faults")
    }
}

thread_local! {
    static THREAD: RefCell<Option<Arc<dyn Faults>>> = const { RefCell::new(None) };
}

/// Makes `faults` decide the calling thread's disk operations until the
/// guard drops, when the hook it replaced (usually none) comes back.
/// `None` installs no hook: operations go to the disk.
#[must_use = "the hook is uninstalled when the guard drops"]
pub fn install(faults: Option<Arc<dyn Faults>>) -> Installed {
    let previous = THREAD.with(|t| std::mem::replace(&mut *t.borrow_mut(), faults));
    Installed {
        previous: Some(previous),
        _not_send: std::marker::PhantomData,
    }
}

/// Restores the thread's previous hook when dropped (on the same thread).
pub struct Installed {
    previous: Option<Option<Arc<dyn Faults>>>,
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Drop for Installed {
    fn drop(&mut self) {
        if let Some(p) = self.previous.take() {
            THREAD.with(|t| *t.borrow_mut() = p);
        }
    }
}

/// Asks the calling thread's hook about `op` on `path`: the OS error it
/// chose, as `std::io::Error::from_raw_os_error`, or `Ok` (always, when no
/// hook is installed). Called before the operation, which is then not done.
#[inline]
pub(crate) fn inject(op: DiskOp, path: &Path) -> std::io::Result<()> {
    let Some(faults) = hook() else {
        return Ok(());
    };
    answer(faults.check(op, path))
}

/// [`inject`] for an operation that awaits the disk: first waits, without
/// holding the thread, while the hook holds it ([`Faults::holds`]).
pub(crate) async fn inject_held(op: DiskOp, path: &Path) -> std::io::Result<()> {
    let Some(faults) = hook() else {
        return Ok(());
    };
    while faults.holds(op, path) {
        compio::time::sleep(HOLD_POLL).await;
    }
    answer(faults.check(op, path))
}

/// The calling thread's hook, cloned out so that it runs with no borrow
/// held: it may install another hook itself.
fn hook() -> Option<Arc<dyn Faults>> {
    THREAD.with(|t| t.borrow().clone())
}

fn answer(errno: Option<i32>) -> std::io::Result<()> {
    match errno {
        Some(errno) => Err(std::io::Error::from_raw_os_error(errno)),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spool::Spool;
    use std::sync::Mutex;

    /// Fails every operation `op` with `errno`, and keeps what it was asked.
    struct Fail {
        op: DiskOp,
        errno: i32,
        asked: Mutex<Vec<(DiskOp, std::path::PathBuf)>>,
    }

    impl Faults for Fail {
        fn check(&self, op: DiskOp, path: &Path) -> Option<i32> {
            self.asked.lock().unwrap().push((op, path.to_path_buf()));
            (op == self.op).then_some(self.errno)
        }
    }

    fn fail(op: DiskOp, errno: i32) -> Arc<Fail> {
        Arc::new(Fail {
            op,
            errno,
            asked: Mutex::new(Vec::new()),
        })
    }

    #[test]
    fn an_installed_fault_fails_a_spool_write_and_nothing_is_written() {
        let rt = compio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let mut spool = Spool::create(dir.path(), 0).await.unwrap();
            spool.ensure_allocated(5000, 0).unwrap();
            let hook = fail(DiskOp::SpoolWrite, libc::EIO);
            let guard = install(Some(hook.clone()));
            assert_eq!(spool.stage(&[7u8; 5000]), 5000);
            let err = spool.write_staged().await.unwrap_err();
            assert!(!err.is_retryable(), "{err}");
            match &err {
                crate::StorageError::Io { source, .. } => {
                    assert_eq!(source.raw_os_error(), Some(libc::EIO), "{err}")
                }
                other => panic!("not an I/O error: {other}"),
            }
            assert_eq!(
                *hook.asked.lock().unwrap(),
                [(DiskOp::SpoolWrite, spool.path().to_path_buf())]
            );
            // The write never reached the file: it holds the fallocated
            // zeros only, and the spool rolled back to its commit.
            let on_disk = std::fs::read(spool.path()).unwrap();
            assert!(on_disk.iter().all(|&b| b == 0), "bytes were written");
            assert_eq!(spool.committed(), 0);
            assert_eq!(spool.staged(), 0);
            drop(guard);

            // Uninstalled, the same write goes through.
            assert_eq!(spool.stage(&[7u8; 5000]), 5000);
            spool.write_staged().await.unwrap();
            spool.commit(spool.commit_point());
            let on_disk = std::fs::read(spool.path()).unwrap();
            assert_eq!(&on_disk[..5000], &[7u8; 5000][..]);
            assert_eq!(hook.asked.lock().unwrap().len(), 1, "asked once installed");
        });
    }

    #[test]
    fn each_operation_asks_its_own_kind_and_a_full_disk_stays_retryable() {
        let rt = compio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let mut spool = Spool::create(dir.path(), 0).await.unwrap();
            // A refused fallocate: ENOSPC is a full disk, retryable.
            let hook = fail(DiskOp::SpoolAllocate, libc::ENOSPC);
            let guard = install(Some(hook.clone()));
            let err = spool.ensure_allocated(100, 0).unwrap_err();
            assert!(err.is_full() && err.is_retryable(), "{err}");
            drop(guard);
            spool.ensure_allocated(100, 0).unwrap();
            assert_eq!(spool.stage(&[1u8; 100]), 100);
            spool.write_staged().await.unwrap();
            spool.commit(spool.commit_point());

            let hook = fail(DiskOp::SpoolSync, libc::EIO);
            let guard = install(Some(hook.clone()));
            let err = spool.sync().await.unwrap_err();
            assert!(!err.is_retryable(), "{err}");
            drop(guard);

            // A failed seal leaves the spool where it was.
            let hook = fail(DiskOp::Seal, libc::EROFS);
            let _guard = install(Some(hook.clone()));
            let path = spool.path().to_path_buf();
            let Err(err) = spool.seal(true).await else {
                panic!("the seal went through");
            };
            assert!(!err.is_retryable(), "{err}");
            assert_eq!(*hook.asked.lock().unwrap(), [(DiskOp::Seal, path.clone())]);
            assert!(path.exists(), "the spool file was moved");
        });
    }

    /// Holds spool writes while `held` is set, then fails them with EIO.
    struct Stall {
        held: std::sync::atomic::AtomicBool,
        asked: std::sync::atomic::AtomicU32,
    }

    impl Faults for Stall {
        fn check(&self, op: DiskOp, _path: &Path) -> Option<i32> {
            (op == DiskOp::SpoolWrite).then_some(libc::EIO)
        }

        fn holds(&self, op: DiskOp, _path: &Path) -> bool {
            use std::sync::atomic::Ordering;
            self.asked.fetch_add(1, Ordering::Relaxed);
            op == DiskOp::SpoolWrite && self.held.load(Ordering::Relaxed)
        }
    }

    /// A held write waits, letting other tasks of the thread run, until
    /// its hook lets it go, and only then gets the hook's answer.
    #[test]
    fn a_held_spool_write_waits_until_released_then_fails() {
        use std::sync::atomic::Ordering;
        let rt = compio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let dir = tempfile::tempdir().unwrap();
            let mut spool = Spool::create(dir.path(), 0).await.unwrap();
            spool.ensure_allocated(4096, 0).unwrap();
            let hook = Arc::new(Stall {
                held: true.into(),
                asked: 0.into(),
            });
            let _guard = install(Some(hook.clone()));
            assert_eq!(spool.stage(&[9u8; 4096]), 4096);
            let path = spool.path().to_path_buf();
            let write = spool.write_staged();
            let mut write = std::pin::pin!(write);
            // Polled for a while: still held, and asked again and again.
            for _ in 0..5 {
                let pending = std::future::poll_fn(|cx| {
                    std::task::Poll::Ready(
                        std::future::Future::poll(write.as_mut(), cx).is_pending(),
                    )
                })
                .await;
                assert!(pending, "a held write completed");
                compio::time::sleep(HOLD_POLL * 2).await;
            }
            assert!(hook.asked.load(Ordering::Relaxed) >= 3);
            hook.held.store(false, Ordering::Relaxed);
            let err = write.await.unwrap_err();
            assert!(!err.is_retryable(), "{err}");
            let on_disk = std::fs::read(&path).unwrap();
            assert!(on_disk.iter().all(|&b| b == 0), "bytes were written");
        });
    }

    #[test]
    fn a_guard_restores_the_hook_it_replaced() {
        let path = Path::new("/d/commit.log");
        let outer = fail(DiskOp::LogWrite, libc::EIO);
        let _outer = install(Some(outer));
        {
            let _inner = install(None);
            assert!(inject(DiskOp::LogWrite, path).is_ok());
        }
        let err = inject(DiskOp::LogWrite, path).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EIO));
        assert!(inject(DiskOp::LogSync, path).is_ok());
        // Another thread has no hook.
        std::thread::spawn(move || assert!(inject(DiskOp::LogWrite, path).is_ok()))
            .join()
            .unwrap();
    }
}
