//! Checks local fragments found on disk against their names, off the
//! shards' threads.
//!
//! A fragment file's name carries its span and the SHA-1 of its bytes. A
//! broker that sealed or copied a fragment hashed every byte as it wrote
//! it; a file it finds on disk at start it has not. Before such a file
//! serves its first read it is read whole and hashed here, on a thread of
//! this module's ([`CHECK_THREADS`] of them, on the broker's cores, started
//! with the broker before any shard pins its thread), and a shard's read
//! waits for the answer. A file that does not match is never served: its
//! span is read from a store's copy, or refused with `IO_ERROR`.
//!
//! The price is one read of each such file, once per start, by the first
//! reader of it (about 0.3 s for a 512 MiB fragment here); files a reader
//! never asks for are never read.

use std::path::PathBuf;
use std::sync::OnceLock;

pub use rotary_storage::fragment::CheckFailed;

/// Threads that read and hash fragment files. Two keep a second reader
/// from waiting behind a large file being checked for the first.
pub const CHECK_THREADS: usize = 2;

/// Checks queued and not yet taken by a thread, beyond which a read waits
/// for room to queue its own.
const CHECK_QUEUE_MAX: usize = 1024;

struct Job {
    path: PathBuf,
    begin: u64,
    end: u64,
    sha1: [u8; 20],
    done: async_channel::Sender<Result<(), CheckFailed>>,
}

fn jobs() -> &'static crossbeam_channel::Sender<Job> {
    static JOBS: OnceLock<crossbeam_channel::Sender<Job>> = OnceLock::new();
    JOBS.get_or_init(|| {
        let (tx, rx) = crossbeam_channel::bounded::<Job>(CHECK_QUEUE_MAX);
        for i in 0..CHECK_THREADS {
            let rx = rx.clone();
            std::thread::Builder::new()
                .name(format!("rotary-check-{i}"))
                .spawn(move || {
                    for job in rx {
                        let res = rotary_storage::fragment::check_file(
                            &job.path, job.begin, job.end, &job.sha1,
                        );
                        // The reader may have gone; nobody is left to tell.
                        let _ = job.done.try_send(res);
                    }
                })
                .expect("spawning a fragment check thread");
        }
        tx
    })
}

/// Starts the check threads now, on the calling thread's cores.
pub fn start() {
    jobs();
}

/// Reads the file at `path` whole on a check thread and says whether it
/// holds exactly the fragment `[begin, end)` with SHA-1 `sha1`.
pub async fn check(path: PathBuf, begin: u64, end: u64, sha1: [u8; 20]) -> Result<(), CheckFailed> {
    let (done, rx) = async_channel::bounded(1);
    let mut job = Job {
        path,
        begin,
        end,
        sha1,
        done,
    };
    // The queue is bounded: a shard never blocks on it, it waits a little
    // and tries again.
    loop {
        match jobs().try_send(job) {
            Ok(()) => break,
            Err(crossbeam_channel::TrySendError::Full(j)) => {
                job = j;
                compio::time::sleep(std::time::Duration::from_millis(1)).await;
            }
            Err(crossbeam_channel::TrySendError::Disconnected(_)) => {
                unreachable!("check threads never exit")
            }
        }
    }
    rx.recv()
        .await
        .expect("a check thread answers every job it takes")
}

#[cfg(test)]
mod tests {
    use super::*;
    use sha1::Digest;

    #[test]
    fn checks_run_off_the_calling_thread_and_answer() {
        let dir = tempfile::tempdir().unwrap();
        let bytes = b"journal bytes".to_vec();
        let sha: [u8; 20] = sha1::Sha1::digest(&bytes).into();
        let good = dir.path().join("good");
        std::fs::write(&good, &bytes).unwrap();
        let bad = dir.path().join("bad");
        std::fs::write(&bad, b"journal bytez").unwrap();
        let rt = compio::runtime::Runtime::new().unwrap();
        rt.block_on(async {
            let n = bytes.len() as u64;
            check(good, 10, 10 + n, sha).await.unwrap();
            assert!(matches!(
                check(bad, 10, 10 + n, sha).await,
                Err(CheckFailed::Mismatch(_))
            ));
            assert!(matches!(
                check(dir.path().join("gone"), 10, 10 + n, sha).await,
                Err(CheckFailed::Io(_))
            ));
        });
    }
}
