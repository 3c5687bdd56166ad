//! The tail cache: a journal's newest committed bytes in memory, for
//! readers at the head.

use super::*;

/// Most bytes one journal's [`TailCache`] keeps (it holds up to twice its
/// window between trims).
pub const TAIL_CACHE_BYTES: usize = 4 << 20;
/// Fewest: a shard of very many tailed journals still serves readers at
/// the head from memory.
pub const TAIL_CACHE_MIN_BYTES: usize = 64 << 10;
/// What the tail caches of one shard's journals hold together, at most
/// (unless the shard has so many journals that each window is at its
/// minimum): every tailed journal of a busy shard keeps a cache, and
/// thousands of 4 MiB windows would not fit in memory.
pub const TAIL_CACHE_SHARD_BYTES: usize = 64 << 20;

/// The window of each tail cache on a shard of `journals` journals.
pub fn tail_window(journals: usize) -> usize {
    (TAIL_CACHE_SHARD_BYTES / 2 / journals.max(1)).clamp(TAIL_CACHE_MIN_BYTES, TAIL_CACHE_BYTES)
}

/// A contiguous window `[begin, begin + len)` of a journal's newest bytes.
/// Bytes beyond the write head are staged, not committed: readers take
/// only what is below the head, and rollbacks truncate.
#[derive(Default)]
pub struct TailCache {
    pub(super) begin: u64,
    buf: Vec<u8>,
    /// Where the buffer's size is counted (`tail_cache_bytes`), from the
    /// first push on.
    counted: Option<Arc<Metrics>>,
}

impl Drop for TailCache {
    fn drop(&mut self) {
        if let Some(m) = &self.counted {
            metrics::sub(&m.tail_cache_bytes, self.buf.capacity() as u64);
        }
    }
}

impl TailCache {
    pub fn end(&self) -> u64 {
        self.begin + self.buf.len() as u64
    }

    /// Adds bytes staged at `offset`; a gap restarts the window there.
    /// Once more than twice `window` bytes would be held, the oldest go,
    /// down to `window`; the buffer never grows past twice `window`.
    pub fn push(&mut self, offset: u64, bytes: &[u8], window: usize, counted: &Arc<Metrics>) {
        let before = self.buf.capacity();
        self.put(offset, bytes, window);
        let m = self.counted.get_or_insert_with(|| counted.clone());
        let after = self.buf.capacity();
        if after > before {
            metrics::add(&m.tail_cache_bytes, (after - before) as u64);
        } else {
            metrics::sub(&m.tail_cache_bytes, (before - after) as u64);
        }
    }

    fn put(&mut self, offset: u64, bytes: &[u8], window: usize) {
        if offset != self.end() {
            self.buf.clear();
            self.begin = offset;
        }
        let total = self.buf.len() + bytes.len();
        let bytes = if total > 2 * window {
            let drop = total - window;
            if drop >= self.buf.len() {
                let skip = drop - self.buf.len();
                self.begin = offset + skip as u64;
                self.buf.clear();
                &bytes[skip..]
            } else {
                self.buf.drain(..drop);
                self.begin += drop as u64;
                bytes
            }
        } else {
            bytes
        };
        let need = self.buf.len() + bytes.len();
        if need > self.buf.capacity() {
            let want = (2 * self.buf.capacity()).clamp(need, 2 * window.max(need / 2));
            self.buf.reserve_exact(want - self.buf.len());
        }
        self.buf.extend_from_slice(bytes);
        if self.buf.capacity() > 2 * window {
            // A window that shrank (more journals on the shard).
            self.buf.shrink_to(2 * window);
        }
    }

    /// Bytes the cache's buffer holds allocated.
    #[cfg(test)]
    pub fn capacity(&self) -> usize {
        self.buf.capacity()
    }

    /// Forgets bytes at and beyond `to` (a rollback).
    pub fn truncate(&mut self, to: u64) {
        if to <= self.begin {
            self.buf.clear();
            self.begin = to;
        } else if to < self.end() {
            self.buf.truncate((to - self.begin) as usize);
        }
    }

    /// The cached bytes of `[from, to)`, if the window starts at or before
    /// `from` and holds at least one of them.
    pub fn get(&self, from: u64, to: u64) -> Option<&[u8]> {
        let to = to.min(self.end());
        (from >= self.begin && from < to)
            .then(|| &self.buf[(from - self.begin) as usize..(to - self.begin) as usize])
    }
}
