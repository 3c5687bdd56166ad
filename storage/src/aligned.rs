//! Block-aligned heap buffers for O_DIRECT I/O.
//!
//! This is one of the two modules where `unsafe` is allowed: it owns a raw
//! allocation so that its address and length meet O_DIRECT's alignment.
//! Invariants: `ptr` is aligned to [`BLOCK`] and, unless `cap` is zero, a
//! live allocation of `cap` bytes; `len <= cap`; bytes `0..len` are
//! initialized.
#![allow(unsafe_code)]

use compio::buf::{IoBuf, IoBufMut, SetLen};
use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::mem::MaybeUninit;
use std::ptr::NonNull;

/// Alignment and granularity of O_DIRECT I/O, in bytes.
pub const BLOCK: usize = 4096;

pub const fn align_down(n: u64) -> u64 {
    n & !(BLOCK as u64 - 1)
}

pub const fn align_up(n: u64) -> u64 {
    (n + BLOCK as u64 - 1) & !(BLOCK as u64 - 1)
}

/// A fixed-capacity buffer aligned to [`BLOCK`]. Zero-filled on creation, so
/// every byte up to `cap` is initialized.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    cap: usize,
    len: usize,
}

impl AlignedBuf {
    /// A zeroed buffer of at least `cap` bytes (rounded up to a block).
    pub fn new(cap: usize) -> Self {
        let cap = align_up(cap.max(BLOCK) as u64) as usize;
        let layout = Layout::from_size_align(cap, BLOCK).expect("valid layout");
        // SAFETY: layout has non-zero size; the pointer is checked for null.
        let raw = unsafe { alloc_zeroed(layout) };
        let ptr = NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        AlignedBuf { ptr, cap, len: 0 }
    }

    /// A buffer of no capacity, which allocates nothing: a placeholder for
    /// one given away.
    pub fn empty() -> Self {
        // An aligned address that is never dereferenced: no byte is in range.
        let ptr = NonNull::new(std::ptr::without_provenance_mut(BLOCK)).expect("non-null");
        AlignedBuf {
            ptr,
            cap: 0,
            len: 0,
        }
    }

    pub fn capacity(&self) -> usize {
        self.cap
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Sets the initialized length. Every byte below `cap` is initialized
    /// (zeroed at allocation), so any `len <= cap` is sound.
    pub fn set_len_checked(&mut self, len: usize) {
        assert!(len <= self.cap, "len {len} > cap {}", self.cap);
        self.len = len;
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is valid for cap >= len initialized bytes.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The whole capacity (every byte is initialized).
    pub fn full(&self) -> &[u8] {
        // SAFETY: ptr is valid for cap initialized bytes.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.cap) }
    }

    /// The whole capacity, initialized or not from the caller's view (all
    /// bytes are in fact initialized).
    pub fn full_mut(&mut self) -> &mut [u8] {
        // SAFETY: ptr is valid for cap initialized bytes, uniquely borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.cap) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if self.cap == 0 {
            return;
        }
        let layout = Layout::from_size_align(self.cap, BLOCK).expect("valid layout");
        // SAFETY: allocated in `new` with this same layout.
        unsafe { dealloc(self.ptr.as_ptr(), layout) }
    }
}

impl IoBuf for AlignedBuf {
    fn as_init(&self) -> &[u8] {
        self.as_slice()
    }
}

impl SetLen for AlignedBuf {
    /// # Safety
    ///
    /// None beyond the trait's: every byte below the capacity is
    /// initialized (zeroed at allocation), and a `len` beyond it panics.
    unsafe fn set_len(&mut self, len: usize) {
        self.set_len_checked(len);
    }
}

impl IoBufMut for AlignedBuf {
    fn as_uninit(&mut self) -> &mut [MaybeUninit<u8>] {
        // SAFETY: ptr is valid for cap bytes; MaybeUninit<u8> has u8's layout.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr().cast(), self.cap) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alignment_and_rounding() {
        let b = AlignedBuf::new(5000);
        assert_eq!(b.capacity(), 8192);
        assert_eq!(b.as_slice().as_ptr() as usize % BLOCK, 0);
        assert_eq!(align_down(4097), 4096);
        assert_eq!(align_up(4097), 8192);
        assert_eq!(align_up(0), 0);
        let e = AlignedBuf::empty();
        assert_eq!((e.capacity(), e.full().len()), (0, 0));
        assert_eq!(e.as_slice().as_ptr() as usize % BLOCK, 0);
    }
}
