//! O_DIRECT I/O for device calibration: a closed-loop writer that keeps a
//! fixed number of writes in flight on a raw io_uring, from one of
//! storage's block-aligned buffers ([`AlignedBuf`]).
//!
//! This is the crate's other module that uses `unsafe`. Invariant:
//! * [`Writer`]: every submission entry points into `buf`, and `in_flight`
//!   counts the entries whose completion has not been reaped. The buffer is
//!   handed out mutably and freed only while `in_flight` is zero; if the ring
//!   fails with writes still in flight, the buffer is leaked rather than
//!   freed under the kernel.

#![allow(unsafe_code)]
#![allow(clippy::disallowed_methods)] // The tuning tool measures real devices in real time.

use io_uring::{opcode, types, IoUring};
pub use rotary_storage::aligned::AlignedBuf;
use rotary_storage::aligned::BLOCK;
use std::io;
use std::mem::ManuallyDrop;
use std::os::fd::AsRawFd;
use std::time::Instant;

/// Alignment and granularity of O_DIRECT I/O, in bytes: the largest logical
/// block size in use.
pub const ALIGN: usize = BLOCK;

/// Timestamps of one write: pushed to the ring, and its completion reaped.
#[derive(Clone, Copy, Debug)]
pub struct Completion {
    pub submitted: Instant,
    pub completed: Instant,
}

/// An io_uring that writes from its own aligned buffer, at most `depth_max`
/// writes at a time.
pub struct Writer {
    ring: IoUring,
    buf: ManuallyDrop<AlignedBuf>,
    depth_max: u32,
    in_flight: u32,
    /// Submission time of the write in each slot (`user_data` is the slot).
    slots: Vec<Option<Instant>>,
}

impl Writer {
    pub fn new(buf: AlignedBuf, depth_max: u32) -> io::Result<Self> {
        assert!(depth_max > 0);
        // The submission queue never holds more than `depth_max` entries;
        // the completion queue is twice its size, so it cannot overflow.
        let ring = IoUring::new(depth_max.next_power_of_two().max(8))?;
        Ok(Writer {
            ring,
            buf: ManuallyDrop::new(buf),
            depth_max,
            in_flight: 0,
            slots: vec![None; depth_max as usize],
        })
    }

    /// The whole buffer, to fill before writing or to use for synchronous
    /// I/O between runs.
    pub fn buf_mut(&mut self) -> &mut [u8] {
        assert_eq!(self.in_flight, 0, "buffer borrowed while the ring owns it");
        self.buf.full_mut()
    }

    /// Writes the first `len` bytes of the buffer to `file`, keeping up to
    /// `depth` writes in flight. `next` gives the file offset of each new
    /// write, or `None` to stop issuing; `done` sees every successful write.
    /// Returns once nothing is in flight, with the first error if any write
    /// failed or was short (the remaining writes are still reaped).
    pub fn run(
        &mut self,
        file: &impl AsRawFd,
        len: usize,
        depth: u32,
        next: &mut dyn FnMut() -> Option<u64>,
        done: &mut dyn FnMut(Completion),
    ) -> io::Result<()> {
        assert_eq!(self.in_flight, 0, "a failed ring is not reused");
        assert!(
            len > 0 && len.is_multiple_of(ALIGN) && len <= self.buf.capacity(),
            "write length {len}"
        );
        assert!(depth > 0 && depth <= self.depth_max, "depth {depth}");
        let fd = types::Fd(file.as_raw_fd());
        let len_u32 = u32::try_from(len).expect("write length fits the SQE");
        let mut failed: Option<io::Error> = None;
        let mut stopping = false;
        let mut reaped: Vec<(u64, i32)> = Vec::with_capacity(depth as usize);

        for slot in 0..depth as usize {
            let Some(offset) = next() else {
                stopping = true;
                break;
            };
            self.push(fd, len_u32, offset, slot);
        }
        while self.in_flight > 0 {
            if let Err(e) = self.ring.submit_and_wait(1) {
                if e.kind() == io::ErrorKind::Interrupted {
                    continue;
                }
                // Writes may still be in flight: `in_flight` stays positive,
                // so the buffer is leaked on drop, never freed under them.
                return Err(e);
            }
            reaped.clear();
            reaped.extend(self.ring.completion().map(|c| (c.user_data(), c.result())));
            let now = Instant::now();
            for &(slot, result) in &reaped {
                let slot = slot as usize;
                let submitted = self.slots[slot]
                    .take()
                    .expect("a completion for a write in flight");
                self.in_flight -= 1;
                if result < 0 {
                    failed.get_or_insert(io::Error::from_raw_os_error(-result));
                    stopping = true;
                } else if result as usize != len {
                    failed.get_or_insert(io::Error::new(
                        io::ErrorKind::WriteZero,
                        format!("short O_DIRECT write: {result} of {len} bytes"),
                    ));
                    stopping = true;
                } else {
                    done(Completion {
                        submitted,
                        completed: now,
                    });
                }
                if !stopping {
                    match next() {
                        Some(offset) => self.push(fd, len_u32, offset, slot),
                        None => stopping = true,
                    }
                }
            }
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn push(&mut self, fd: types::Fd, len: u32, offset: u64, slot: usize) {
        assert!(self.slots[slot].is_none(), "slot {slot} already in flight");
        let entry = opcode::Write::new(fd, self.buf.full().as_ptr(), len)
            .offset(offset)
            .build()
            .user_data(slot as u64);
        // SAFETY: the entry points at `len <= buf.capacity()` bytes of `buf`,
        // which stays allocated and is not handed out mutably until this
        // write's completion is reaped (`in_flight` counts it; `buf_mut` and
        // `drop` check it). `fd` is borrowed by `run` for as long.
        let pushed = unsafe { self.ring.submission().push(&entry) };
        assert!(pushed.is_ok(), "submission queue holds depth_max entries");
        self.slots[slot] = Some(Instant::now());
        self.in_flight += 1;
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        if self.in_flight == 0 {
            // SAFETY: nothing in flight refers to the buffer, and it is not
            // used again.
            unsafe { ManuallyDrop::drop(&mut self.buf) }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use std::os::unix::fs::{FileExt, OpenOptionsExt};

    #[test]
    fn buffers_are_aligned_and_zeroed() {
        let mut b = AlignedBuf::new(3 * ALIGN);
        assert_eq!(b.capacity(), 3 * ALIGN);
        assert_eq!(b.full_mut().as_ptr() as usize % ALIGN, 0);
        assert!(b.full_mut().iter().all(|&x| x == 0));
    }

    #[test]
    fn writer_writes_every_offset_it_is_given() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("w");
        let file = fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .custom_flags(libc::O_DIRECT)
            .open(&path)
            .unwrap();
        let mut w = Writer::new(AlignedBuf::new(2 * ALIGN), 4).unwrap();
        for (i, b) in w.buf_mut().iter_mut().enumerate() {
            *b = (i % 253) as u8 + 1;
        }
        let mut offsets = (0..10u64).map(|i| i * 2 * ALIGN as u64);
        let mut completions = 0;
        w.run(&file, 2 * ALIGN, 4, &mut || offsets.next(), &mut |c| {
            assert!(c.completed >= c.submitted);
            completions += 1;
        })
        .unwrap();
        assert_eq!(completions, 10);
        let expected: Vec<u8> = (0..2 * ALIGN).map(|i| (i % 253) as u8 + 1).collect();
        let mut back = AlignedBuf::new(2 * ALIGN);
        for i in 0..10u64 {
            file.read_exact_at(back.full_mut(), i * 2 * ALIGN as u64)
                .unwrap();
            assert_eq!(back.full_mut(), &expected[..], "block {i}");
        }
        assert_eq!(file.metadata().unwrap().len(), 20 * ALIGN as u64);
    }

    #[test]
    fn a_failed_write_is_reported_after_the_rest_are_reaped() {
        let dir = tempfile::tempdir().unwrap();
        // Opened read-only: every write fails with EBADF.
        let path = dir.path().join("r");
        fs::write(&path, b"").unwrap();
        let file = fs::File::open(&path).unwrap();
        let mut w = Writer::new(AlignedBuf::new(ALIGN), 4).unwrap();
        let mut offsets = (0..100u64).map(|i| i * ALIGN as u64);
        let err = w
            .run(&file, ALIGN, 4, &mut || offsets.next(), &mut |_| {
                panic!("no write succeeds")
            })
            .unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EBADF));
        // Nothing is left in flight: the buffer is usable again.
        assert_eq!(w.buf_mut().len(), ALIGN);
    }
}
