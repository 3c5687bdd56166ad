//! Spool write buffers kept for reuse on the shard's thread.
//!
//! A fresh [`AlignedBuf`] costs a page fault per 4 KiB on first touch: a
//! 4 MiB spool buffer took about 2.3 ms to allocate and zero on this
//! project's test machine, paid on the shard's thread by every appender it
//! serves. So a spool starts with a small buffer and grows it only when
//! one batch needs more, and a spool that seals or is dropped leaves its
//! buffer here for the next spool of the same thread. Reused bytes are
//! stale, not secret: a spool only ever writes or exposes bytes it staged
//! (it zeroes the rest of a partial block before writing it).
//!
//! The pool is per thread (a shard's spools never leave its thread) and
//! bounded by [`POOL_BYTES`]; beyond it, returned buffers are freed.

use crate::aligned::AlignedBuf;
use std::cell::RefCell;

/// Most bytes of idle buffers one thread keeps.
pub const POOL_BYTES: usize = 64 << 20;

thread_local! {
    static FREE: RefCell<Vec<AlignedBuf>> = const { RefCell::new(Vec::new()) };
}

/// A buffer whose capacity is within `[min, max]`: the largest idle one in
/// that range, or else a new one of `min` bytes (rounded up to a block).
pub fn take(min: usize, max: usize) -> AlignedBuf {
    let found = FREE.with(|free| {
        let mut free = free.borrow_mut();
        let best = free
            .iter()
            .enumerate()
            .filter(|(_, b)| (min..=max).contains(&b.capacity()))
            .max_by_key(|(_, b)| b.capacity())
            .map(|(i, _)| i);
        best.map(|i| free.swap_remove(i))
    });
    match found {
        Some(mut b) => {
            b.set_len_checked(0);
            b
        }
        None => AlignedBuf::new(min),
    }
}

/// Keeps `buf` for a later [`take`] on this thread, unless the pool is full.
pub fn give(buf: AlignedBuf) {
    FREE.with(|free| {
        let mut free = free.borrow_mut();
        let held: usize = free.iter().map(AlignedBuf::capacity).sum();
        if held + buf.capacity() <= POOL_BYTES {
            free.push(buf);
        }
    });
}

/// Bytes of idle buffers this thread holds.
pub fn idle_bytes() -> usize {
    FREE.with(|free| free.borrow().iter().map(AlignedBuf::capacity).sum())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reuses_the_largest_fitting_buffer_and_stays_bounded() {
        let mut big = take(1 << 20, 1 << 20);
        big.full_mut()[0] = 7;
        let small = take(8192, 8192);
        give(small);
        give(big);
        assert_eq!(idle_bytes(), (1 << 20) + 8192);
        // The largest buffer within the range comes back, with its length
        // reset (its bytes are stale, not cleared).
        let again = take(4096, 1 << 20);
        assert_eq!(again.capacity(), 1 << 20);
        assert_eq!(again.len(), 0);
        assert_eq!(again.capacity() + idle_bytes(), (1 << 20) + 8192);
        // Nothing idle fits: a new buffer of the minimum size.
        let fresh = take(64 << 10, 512 << 10);
        assert_eq!(fresh.capacity(), 64 << 10);
        // Past the bound, returned buffers are freed.
        for _ in 0..(POOL_BYTES >> 20) + 2 {
            give(AlignedBuf::new(1 << 20));
        }
        assert!(idle_bytes() <= POOL_BYTES);
        drop(again);
    }
}
