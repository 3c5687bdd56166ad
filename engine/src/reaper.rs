//! Deleting files off the shard's thread.
//!
//! Freeing a large file's blocks is slow, and it happens in whichever call
//! drops the file's last name or last open descriptor: `unlink`, `rename`
//! over it, or `close`. On a filesystem mounted with `discard`, ext4 waits
//! there for the device to discard every freed extent: 28-32 ms on this
//! project's test machine for a spool closed after its directory was
//! removed, with the shard's thread in uninterruptible sleep the whole time.
//! A shard therefore never deletes a fragment or a journal's files itself:
//! it opens one more descriptor of each file (so that none of its own
//! closes is the last one) and hands names and descriptors to the reaper
//! thread, which unlinks the names and then closes the descriptors.
//!
//! That work still takes a CPU, in bursts of milliseconds (a replaced
//! 64 MiB commit log), so the reaper runs at `SCHED_IDLE`: a shard that
//! wakes on the same core preempts it at once instead of waiting out its
//! time slice. The broker starts it ([`start`]) before any shard is pinned,
//! so that it may run on any of the broker's cores, not only on the core of
//! the shard that first needed it.
//! The price: while every one of those cores is kept busy, it waits, and
//! the blocks of the files it holds stay allocated until a core idles.
//!
//! Off the shard's thread is not enough, though. Freeing a file's blocks
//! holds the filesystem's journal while the device discards them, and the
//! shard's own writes wait for that journal: on the test machine one
//! `unlink` of a 4 GiB spool held every append of another journal for
//! 60-80 ms. So a file that nothing else has open any more is freed a
//! step at a time: once its name is gone, the reaper cuts [`FREE_STEP`]
//! bytes off its end, pauses [`FREE_PAUSE`], and goes on, and only then
//! closes it. A file that something may still read (a fragment with reads
//! of its journal in flight) is only unlinked: its last reader frees it.
#![allow(unsafe_code)] // sched_setscheduler: std cannot make a thread SCHED_IDLE

use std::collections::VecDeque;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// Bytes of a file's blocks freed at a time: small enough that the
/// filesystem's journal is held for well under a millisecond.
pub const FREE_STEP: u64 = 4 << 20;
/// The pause between two steps, in which the shards' writes go through:
/// a file is freed at up to about 4 GB/s.
const FREE_PAUSE: Duration = Duration::from_millis(1);

/// Set while [`flush`] waits: files are then freed at once.
static HURRY: AtomicUsize = AtomicUsize::new(0);

/// How long the reaper holds a deleted journal's files (or a replaced
/// commit log) open before it closes them: long enough for the shard to
/// drop its own descriptors, so that the last close is the reaper's.
const JOURNAL_GRACE: Duration = Duration::from_secs(2);

enum Job {
    /// A file to unlink, with a descriptor that keeps its blocks until the
    /// reaper closes it, and whether nothing else has it open (its blocks
    /// are then freed a step at a time).
    File(PathBuf, Option<std::fs::File>, bool),
    /// A directory to remove with everything in it, and descriptors of the
    /// files it held.
    Dir(PathBuf, Vec<std::fs::File>),
    /// Descriptors to free and close once the grace has passed.
    Hold(Vec<std::fs::File>),
    /// Sent by [`flush`]; answered once every earlier job is done.
    Flush(crossbeam_channel::Sender<()>),
    /// Asks the reaper for its scheduling policy.
    #[cfg(test)]
    Policy(crossbeam_channel::Sender<i32>),
}

fn jobs() -> &'static crossbeam_channel::Sender<Job> {
    static JOBS: OnceLock<crossbeam_channel::Sender<Job>> = OnceLock::new();
    JOBS.get_or_init(|| {
        let (tx, rx) = crossbeam_channel::unbounded::<Job>();
        std::thread::Builder::new()
            .name("rotary-reaper".into())
            .spawn(move || {
                yield_to_everything();
                reap(rx)
            })
            .expect("spawning the reaper thread");
        tx
    })
}

/// Starts the reaper thread now, on the calling thread's cores.
pub fn start() {
    jobs();
}

/// Puts the calling thread in `SCHED_IDLE`: it runs only when nothing else
/// on its core wants to.
pub(crate) fn yield_to_everything() {
    let param = libc::sched_param { sched_priority: 0 };
    // SAFETY: plain syscall on the calling thread with a valid parameter.
    let rc = unsafe { libc::sched_setscheduler(0, libc::SCHED_IDLE, &param) };
    if rc != 0 {
        tracing::debug!(error = %std::io::Error::last_os_error(), "reaper stays at the normal priority");
    }
}

/// The calling thread's scheduling policy.
#[cfg(test)]
fn policy() -> i32 {
    // SAFETY: plain syscall on the calling thread.
    unsafe { libc::sched_getscheduler(0) }
}

fn reap(rx: crossbeam_channel::Receiver<Job>) {
    // Descriptors of deleted journals, closed once their grace has passed.
    let mut held: VecDeque<(Instant, Vec<std::fs::File>)> = VecDeque::new();
    loop {
        let job = match held.front() {
            Some((until, _)) => {
                match rx.recv_timeout(until.saturating_duration_since(crate::clock::now())) {
                    Ok(job) => Some(job),
                    Err(crossbeam_channel::RecvTimeoutError::Timeout) => None,
                    Err(crossbeam_channel::RecvTimeoutError::Disconnected) => return,
                }
            }
            None => match rx.recv() {
                Ok(job) => Some(job),
                Err(_) => return,
            },
        };
        match job {
            Some(Job::File(path, keep, idle)) => {
                remove(&path, std::fs::remove_file(&path));
                if let Some(f) = keep.as_ref().filter(|_| idle) {
                    free_gradually(f);
                }
                drop(keep);
            }
            Some(Job::Dir(path, keep)) => {
                remove(&path, std::fs::remove_dir_all(&path));
                held.push_back((crate::clock::now() + JOURNAL_GRACE, keep));
            }
            Some(Job::Hold(keep)) => held.push_back((crate::clock::now() + JOURNAL_GRACE, keep)),
            Some(Job::Flush(done)) => {
                let _ = done.send(());
            }
            #[cfg(test)]
            Some(Job::Policy(tell)) => {
                let _ = tell.send(policy());
            }
            None => {}
        }
        while held
            .front()
            .is_some_and(|(until, _)| *until <= crate::clock::now())
        {
            let (_, files) = held.pop_front().expect("front");
            for f in &files {
                free_gradually(f);
            }
        }
    }
}

/// Frees all but the first [`FREE_STEP`] bytes of an unlinked file's
/// blocks, a step at a time from its end; closing it frees the rest.
/// Needs a descriptor open for writing; with another, or on an error, the
/// close frees everything at once.
fn free_gradually(file: &std::fs::File) {
    use std::os::unix::fs::MetadataExt;
    let Ok(meta) = file.metadata() else { return };
    let mut len = meta.len().max(meta.blocks() * 512);
    while len > FREE_STEP && HURRY.load(Ordering::Relaxed) == 0 {
        len -= FREE_STEP;
        if file.set_len(len).is_err() {
            return;
        }
        std::thread::sleep(FREE_PAUSE);
    }
}

/// A descriptor of `path` that may shrink it; read-only if that is all
/// there is.
fn open_to_free(path: &std::path::Path) -> Option<std::fs::File> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .or_else(|_| std::fs::File::open(path))
        .ok()
}

fn remove(path: &std::path::Path, res: std::io::Result<()>) {
    if let Err(e) = res {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!(path = %path.display(), error = %e, "removing failed");
        }
    }
}

/// Removes the file at `path` on the reaper thread. Call it before the
/// caller drops its own descriptors of the file. Something else may still
/// read it through a descriptor of its own: the last close frees it.
pub fn remove_file(path: PathBuf) {
    let keep = std::fs::File::open(&path).ok();
    let _ = jobs().send(Job::File(path, keep, false));
}

/// [`remove_file`] of a file that nothing else reads or writes any more
/// (or will: its name is no longer handed out): its blocks are freed a
/// step at a time.
pub fn free_file(path: PathBuf) {
    let keep = open_to_free(&path);
    let _ = jobs().send(Job::File(path, keep, true));
}

/// Removes the directory `path` and everything below it on the reaper
/// thread, keeping its files' blocks until the reaper is done with them:
/// after a grace for the caller's own descriptors to close, they are freed
/// a step at a time.
pub fn remove_dir_all(path: PathBuf) {
    let mut keep = Vec::new();
    let mut stack = vec![path.clone()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            match entry.file_type() {
                Ok(t) if t.is_dir() => stack.push(entry.path()),
                Ok(t) if t.is_file() => keep.extend(open_to_free(&entry.path())),
                _ => {}
            }
        }
    }
    let _ = jobs().send(Job::Dir(path, keep));
}

/// Closes `files` on the reaper thread, a grace period from now: hand it a
/// descriptor (open for writing) of a file whose last name is about to go
/// (a rename over it), and the blocks are freed here, a step at a time,
/// once the shard has closed its own.
pub fn close_later(files: Vec<std::fs::File>) {
    let _ = jobs().send(Job::Hold(files));
}

/// Removes the name `path` at once, on the calling thread, and leaves the
/// file's blocks to the reaper, freed a step at a time once the grace of
/// [`close_later`] has passed. For a file that nothing reads any more
/// whose name the next file may take right away, so that the reaper must
/// not remove it by name later. Removing a name that an open descriptor
/// still holds is quick: the blocks are freed by the last close, here the
/// reaper's.
pub fn unlink_now_free_later(path: &std::path::Path) -> std::io::Result<()> {
    let keep = open_to_free(path);
    std::fs::remove_file(path)?;
    close_later(keep.into_iter().collect());
    Ok(())
}

/// Waits until every removal asked for so far is done (tests, shutdown),
/// freeing files at once rather than a step at a time meanwhile.
/// Descriptors of deleted journals may still be held for their grace.
pub fn flush() {
    let (tx, rx) = crossbeam_channel::bounded(1);
    HURRY.fetch_add(1, Ordering::Relaxed);
    if jobs().send(Job::Flush(tx)).is_ok() {
        let _ = rx.recv();
    }
    HURRY.fetch_sub(1, Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn removes_files_and_directories_and_reports_when_done() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("a.raw");
        std::fs::write(&file, b"bytes").unwrap();
        let held = std::fs::File::open(&file).unwrap();
        remove_file(file.clone());
        let tree = dir.path().join("journal");
        std::fs::create_dir_all(tree.join("@/sub")).unwrap();
        std::fs::write(tree.join("@/sub/x.spool"), b"spool").unwrap();
        remove_dir_all(tree.clone());
        flush();
        assert!(!file.exists(), "file removed");
        assert!(!tree.exists(), "directory removed");
        // A descriptor opened before the removal still reads the bytes.
        let mut out = String::new();
        std::io::Read::read_to_string(&mut &held, &mut out).unwrap();
        assert_eq!(out, "bytes");
        // Removing what is already gone is not an error.
        remove_file(file);
        flush();
    }

    #[test]
    fn the_reaper_yields_its_core_to_everything_else() {
        start();
        let (tx, rx) = crossbeam_channel::bounded(1);
        jobs().send(Job::Policy(tx)).unwrap();
        assert_eq!(rx.recv().unwrap(), libc::SCHED_IDLE);
        assert_ne!(policy(), libc::SCHED_IDLE, "only the reaper thread");
    }
}
