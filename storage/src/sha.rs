//! SHA-1 for the append path, able to hash one byte stream into two
//! independent states at once.
//!
//! A primary hashes every appended byte twice: into the open fragment's
//! running SHA-1 and into the append's own SHA-1 (its reply carries it).
//! The two states start at different offsets, so their 64-byte blocks do
//! not line up, but they are independent: with SHA-NI the rounds of one
//! block take a long chain of dependent instructions, and two chains in one
//! loop keep the core busy where one leaves it waiting. [`update_both`]
//! does that; [`Sha1`] is otherwise an ordinary streaming SHA-1.

/// A streaming SHA-1 state.
#[derive(Clone)]
pub struct Sha1 {
    h: [u32; 5],
    buf: [u8; 64],
    buf_len: usize,
    /// Bytes hashed so far.
    len: u64,
}

impl Default for Sha1 {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for Sha1 {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sha1").field("len", &self.len).finish()
    }
}

const H0: [u32; 5] = [0x67452301, 0xEFCDAB89, 0x98BADCFE, 0x10325476, 0xC3D2E1F0];

impl Sha1 {
    pub fn new() -> Sha1 {
        Sha1 {
            h: H0,
            buf: [0; 64],
            buf_len: 0,
            len: 0,
        }
    }

    /// Bytes hashed so far.
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The state at the last whole block: the number of bytes it has
    /// hashed (a multiple of 64) and its words. [`Sha1::resume`] goes on
    /// from there, given the bytes after it.
    pub fn block_state(&self) -> (u64, [u32; 5]) {
        (self.len - self.buf_len as u64, self.h)
    }

    /// The state [`Sha1::block_state`] returned, to go on hashing from.
    /// `None` unless `hashed` is a multiple of 64.
    pub fn resume(hashed: u64, h: [u32; 5]) -> Option<Sha1> {
        hashed.is_multiple_of(64).then_some(Sha1 {
            h,
            buf: [0; 64],
            buf_len: 0,
            len: hashed,
        })
    }

    pub fn update(&mut self, data: &[u8]) {
        let rest = self.fill(data);
        let (blocks, tail) = rest.as_chunks::<64>();
        compress(&mut self.h, blocks);
        self.keep(tail);
    }

    /// Tops up the partial block from `data`; returns what is left.
    fn fill<'a>(&mut self, data: &'a [u8]) -> &'a [u8] {
        self.len += data.len() as u64;
        if self.buf_len == 0 {
            return data;
        }
        let n = (64 - self.buf_len).min(data.len());
        self.buf[self.buf_len..self.buf_len + n].copy_from_slice(&data[..n]);
        self.buf_len += n;
        if self.buf_len == 64 {
            let block = self.buf;
            compress(&mut self.h, &[block]);
            self.buf_len = 0;
        }
        &data[n..]
    }

    /// Keeps the bytes after the last whole block (none if the data
    /// ended inside the partial block `fill` topped up).
    fn keep(&mut self, tail: &[u8]) {
        if tail.is_empty() {
            return;
        }
        debug_assert_eq!(self.buf_len, 0);
        self.buf[..tail.len()].copy_from_slice(tail);
        self.buf_len = tail.len();
    }

    pub fn finalize(mut self) -> [u8; 20] {
        let bits = self.len.wrapping_mul(8);
        let mut pad = [0u8; 72];
        pad[0] = 0x80;
        let zeros = (55usize.wrapping_sub(self.buf_len)) % 64;
        let n = 1 + zeros;
        pad[n..n + 8].copy_from_slice(&bits.to_be_bytes());
        self.update(&pad[..n + 8]);
        debug_assert_eq!(self.buf_len, 0);
        let mut out = [0u8; 20];
        for (i, w) in self.h.iter().enumerate() {
            out[4 * i..4 * i + 4].copy_from_slice(&w.to_be_bytes());
        }
        out
    }
}

/// Hashes `data` into both `a` and `b`, as `a.update(data); b.update(data)`
/// would, sharing the work of the blocks both have whole.
pub fn update_both(a: &mut Sha1, b: &mut Sha1, data: &[u8]) {
    let ra = a.fill(data);
    let rb = b.fill(data);
    let (ba, ta) = ra.as_chunks::<64>();
    let (bb, tb) = rb.as_chunks::<64>();
    let n = ba.len().min(bb.len());
    compress2(&mut a.h, &ba[..n], &mut b.h, &bb[..n]);
    compress(&mut a.h, &ba[n..]);
    compress(&mut b.h, &bb[n..]);
    a.keep(ta);
    b.keep(tb);
}

fn compress(h: &mut [u32; 5], blocks: &[[u8; 64]]) {
    if blocks.is_empty() {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if ni::available() {
        // SAFETY: the CPU has the features `ni` is compiled for.
        #[allow(unsafe_code)]
        unsafe {
            ni::compress2(h, blocks, None)
        };
        return;
    }
    portable(h, blocks);
}

/// The `sha1` crate's compression (its own CPU dispatch), block by block.
fn portable(h: &mut [u32; 5], blocks: &[[u8; 64]]) {
    use sha1::digest::generic_array::GenericArray;
    for b in blocks {
        sha1::compress(h, std::slice::from_ref(GenericArray::from_slice(b)));
    }
}

fn compress2(a: &mut [u32; 5], da: &[[u8; 64]], b: &mut [u32; 5], db: &[[u8; 64]]) {
    debug_assert_eq!(da.len(), db.len());
    if da.is_empty() {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if ni::available() {
        // SAFETY: the CPU has the features `ni` is compiled for.
        #[allow(unsafe_code)]
        unsafe {
            ni::compress2(a, da, Some((b, db)))
        };
        return;
    }
    portable(a, da);
    portable(b, db);
}

#[cfg(target_arch = "x86_64")]
#[allow(unsafe_code)]
mod ni {
    use std::arch::x86_64::*;

    pub fn available() -> bool {
        use std::sync::atomic::{AtomicU8, Ordering};
        static CACHE: AtomicU8 = AtomicU8::new(0);
        match CACHE.load(Ordering::Relaxed) {
            1 => true,
            2 => false,
            _ => {
                let yes = std::arch::is_x86_feature_detected!("sha")
                    && std::arch::is_x86_feature_detected!("sse4.1")
                    && std::arch::is_x86_feature_detected!("ssse3");
                CACHE.store(if yes { 1 } else { 2 }, Ordering::Relaxed);
                yes
            }
        }
    }

    struct Lane {
        abcd: __m128i,
        e: __m128i,
    }

    /// A SHA-1 state into SIMD registers.
    ///
    /// # Safety
    ///
    /// The CPU must have SSE4.1 ([`available`]); called only from
    /// [`compress2`], whose target features include it.
    #[inline(always)]
    unsafe fn load(h: &[u32; 5]) -> Lane {
        Lane {
            abcd: _mm_set_epi32(h[0] as i32, h[1] as i32, h[2] as i32, h[3] as i32),
            e: _mm_set_epi32(h[4] as i32, 0, 0, 0),
        }
    }

    /// A lane's registers back into a SHA-1 state.
    ///
    /// # Safety
    ///
    /// As for [`load`]: SSE4.1 must be available.
    #[inline(always)]
    unsafe fn store(l: &Lane, h: &mut [u32; 5]) {
        h[0] = _mm_extract_epi32(l.abcd, 3) as u32;
        h[1] = _mm_extract_epi32(l.abcd, 2) as u32;
        h[2] = _mm_extract_epi32(l.abcd, 1) as u32;
        h[3] = _mm_extract_epi32(l.abcd, 0) as u32;
        h[4] = _mm_extract_epi32(l.e, 3) as u32;
    }

    macro_rules! rounds4 {
        ($h0:ident, $h1:ident, $wk:expr, $i:expr) => {
            _mm_sha1rnds4_epu32::<$i>($h0, _mm_sha1nexte_epu32($h1, $wk))
        };
    }

    macro_rules! schedule {
        ($v0:expr, $v1:expr, $v2:expr, $v3:expr) => {
            _mm_sha1msg2_epu32(_mm_xor_si128(_mm_sha1msg1_epu32($v0, $v1), $v2), $v3)
        };
    }

    macro_rules! schedule_rounds4 {
        ($h0:ident, $h1:ident, $w0:expr, $w1:expr, $w2:expr, $w3:expr, $w4:expr, $i:expr) => {
            $w4 = schedule!($w0, $w1, $w2, $w3);
            $h1 = rounds4!($h0, $h1, $w4, $i);
        };
    }

    /// One block into one lane.
    ///
    /// # Safety
    ///
    /// The CPU must have the SHA extensions, SSSE3 and SSE4.1
    /// ([`available`]); called only from [`compress2`]. The loads read the
    /// 64 bytes of `block`, unaligned, and nothing else.
    #[inline(always)]
    unsafe fn block(l: &mut Lane, block: &[u8; 64], mask: __m128i) {
        let p = block.as_ptr() as *const __m128i;
        let mut w0 = _mm_shuffle_epi8(_mm_loadu_si128(p), mask);
        let mut w1 = _mm_shuffle_epi8(_mm_loadu_si128(p.add(1)), mask);
        let mut w2 = _mm_shuffle_epi8(_mm_loadu_si128(p.add(2)), mask);
        let mut w3 = _mm_shuffle_epi8(_mm_loadu_si128(p.add(3)), mask);
        let mut w4;
        let mut h0 = l.abcd;
        let mut h1 = _mm_add_epi32(l.e, w0);

        h1 = _mm_sha1rnds4_epu32::<0>(h0, h1);
        h0 = rounds4!(h1, h0, w1, 0);
        h1 = rounds4!(h0, h1, w2, 0);
        h0 = rounds4!(h1, h0, w3, 0);
        schedule_rounds4!(h0, h1, w0, w1, w2, w3, w4, 0);

        schedule_rounds4!(h1, h0, w1, w2, w3, w4, w0, 1);
        schedule_rounds4!(h0, h1, w2, w3, w4, w0, w1, 1);
        schedule_rounds4!(h1, h0, w3, w4, w0, w1, w2, 1);
        schedule_rounds4!(h0, h1, w4, w0, w1, w2, w3, 1);
        schedule_rounds4!(h1, h0, w0, w1, w2, w3, w4, 1);

        schedule_rounds4!(h0, h1, w1, w2, w3, w4, w0, 2);
        schedule_rounds4!(h1, h0, w2, w3, w4, w0, w1, 2);
        schedule_rounds4!(h0, h1, w3, w4, w0, w1, w2, 2);
        schedule_rounds4!(h1, h0, w4, w0, w1, w2, w3, 2);
        schedule_rounds4!(h0, h1, w0, w1, w2, w3, w4, 2);

        schedule_rounds4!(h1, h0, w1, w2, w3, w4, w0, 3);
        schedule_rounds4!(h0, h1, w2, w3, w4, w0, w1, 3);
        schedule_rounds4!(h1, h0, w3, w4, w0, w1, w2, 3);
        schedule_rounds4!(h0, h1, w4, w0, w1, w2, w3, 3);
        schedule_rounds4!(h1, h0, w0, w1, w2, w3, w4, 3);

        l.abcd = _mm_add_epi32(l.abcd, h0);
        l.e = _mm_sha1nexte_epu32(h1, l.e);
    }

    /// Compresses `da` into `a` and, if given, the same number of blocks
    /// `db` into `b`, interleaved block by block.
    ///
    /// # Safety
    ///
    /// The CPU must have the SHA extensions, SSE2, SSSE3 and SSE4.1: call
    /// it only after [`available`] returned true.
    #[target_feature(enable = "sha,sse2,ssse3,sse4.1")]
    pub unsafe fn compress2(
        a: &mut [u32; 5],
        da: &[[u8; 64]],
        b: Option<(&mut [u32; 5], &[[u8; 64]])>,
    ) {
        let mask = _mm_set_epi64x(0x0001_0203_0405_0607, 0x0809_0A0B_0C0D_0E0F);
        let mut la = load(a);
        match b {
            None => {
                for blk in da {
                    block(&mut la, blk, mask);
                }
            }
            Some((b, db)) => {
                let mut lb = load(b);
                for (x, y) in da.iter().zip(db) {
                    block(&mut la, x, mask);
                    block(&mut lb, y, mask);
                }
                store(&lb, b);
            }
        }
        store(&la, a);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use sha1::Digest;

    fn reference(data: &[u8]) -> [u8; 20] {
        sha1::Sha1::digest(data).into()
    }

    #[test]
    fn matches_the_reference_at_every_length_and_split() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let data: Vec<u8> = (0..2000).map(|_| rng.r#gen()).collect();
        for len in 0..300 {
            let mut h = Sha1::new();
            let cut = rng.gen_range(0..=len);
            h.update(&data[..cut]);
            h.update(&data[cut..len]);
            assert_eq!(h.finalize(), reference(&data[..len]), "len {len}");
        }
        assert_eq!(
            hex::encode(Sha1::new().finalize()),
            "da39a3ee5e6b4b0d3255bfef95601890afd80709"
        );
    }

    #[test]
    fn both_states_get_what_separate_updates_would() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(9);
        let data: Vec<u8> = (0..70_000).map(|_| rng.r#gen()).collect();
        for _ in 0..200 {
            // `a` has a history of its own (a fragment); `b` starts fresh
            // (an append), at any alignment.
            let pre = rng.gen_range(0..200);
            let mut a = Sha1::new();
            a.update(&data[..pre]);
            let mut b = Sha1::new();
            let mut at = pre;
            let end = rng.gen_range(pre..data.len());
            while at < end {
                let n = rng.gen_range(1..=(end - at).min(9000));
                update_both(&mut a, &mut b, &data[at..at + n]);
                at += n;
            }
            assert_eq!(a.clone().finalize(), reference(&data[..end]));
            assert_eq!(b.finalize(), reference(&data[pre..end]));
        }
    }

    #[test]
    fn a_block_state_resumes_where_it_stood() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let data: Vec<u8> = (0..1000).map(|_| rng.r#gen()).collect();
        for len in 0..400 {
            let mut h = Sha1::new();
            h.update(&data[..len]);
            let (hashed, words) = h.block_state();
            assert_eq!(hashed, (len / 64 * 64) as u64);
            let mut resumed = Sha1::resume(hashed, words).unwrap();
            resumed.update(&data[hashed as usize..len + 300]);
            assert_eq!(
                resumed.finalize(),
                reference(&data[..len + 300]),
                "len {len}"
            );
        }
        assert!(Sha1::resume(63, H0).is_none());
    }
}

#[cfg(test)]
#[allow(clippy::disallowed_methods)] // Measures real hashing rates.
mod speed {
    use super::*;

    /// Not a test: `cargo test --release -p rotary-storage sha::speed -- --ignored --nocapture`.
    #[test]
    #[ignore]
    fn hashing_rates() {
        use sha1::Digest;
        let data = vec![7u8; 64 << 20];
        let t = std::time::Instant::now();
        let mut r = sha1::Sha1::new();
        r.update(&data);
        std::hint::black_box(r.finalize());
        let crate_rate = data.len() as f64 / t.elapsed().as_secs_f64() / 1e9;
        let t = std::time::Instant::now();
        let mut a = Sha1::new();
        a.update(&data);
        std::hint::black_box(a.finalize());
        let one = data.len() as f64 / t.elapsed().as_secs_f64() / 1e9;
        let t = std::time::Instant::now();
        let (mut a, mut b) = (Sha1::new(), Sha1::new());
        a.update(&data[..13]);
        update_both(&mut a, &mut b, &data[13..]);
        std::hint::black_box((a.finalize(), b.finalize()));
        let both = 2.0 * data.len() as f64 / t.elapsed().as_secs_f64() / 1e9;
        println!("sha1 crate {crate_rate:.2} GB/s; one state {one:.2} GB/s; two states {both:.2} GB/s of hashing");
    }
}
