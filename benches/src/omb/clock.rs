//! The runner's one clock and one source of randomness.
//!
//! Payload timestamps are microseconds since the Unix epoch, as OMB stamps
//! them, but read from a monotonic clock anchored to the wall clock once per
//! process: a wall-clock step during a run cannot make an end-to-end latency
//! negative or huge.
#![allow(clippy::disallowed_methods)] // Benchmarks measure real time.

use std::sync::OnceLock;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

static ANCHOR: OnceLock<(Instant, u64)> = OnceLock::new();

fn anchor() -> (Instant, u64) {
    *ANCHOR.get_or_init(|| {
        let unix_us = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_micros() as u64);
        (Instant::now(), unix_us)
    })
}

/// Microseconds since the Unix epoch, monotonic within the process.
pub fn now_us() -> u64 {
    let (at, unix_us) = anchor();
    unix_us + at.elapsed().as_micros() as u64
}

/// `instant` on the same scale as [`now_us`].
pub fn us_of(instant: Instant) -> u64 {
    let (at, unix_us) = anchor();
    match instant.checked_duration_since(at) {
        Some(d) => unix_us + d.as_micros() as u64,
        None => unix_us.saturating_sub(at.duration_since(instant).as_micros() as u64),
    }
}

/// Whole microseconds of `d`, saturating.
pub fn micros(d: Duration) -> u64 {
    u64::try_from(d.as_micros()).unwrap_or(u64::MAX)
}

/// A small, fast generator (xorshift64*) for payload bytes and random
/// partitions; not for anything that needs to be unpredictable.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// Seeded from the clock, so runs differ.
    pub fn from_clock() -> Rng {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        Rng::seeded(nanos ^ u64::from(std::process::id()) << 32)
    }

    pub fn seeded(seed: u64) -> Rng {
        // Zero is xorshift's one fixed point.
        Rng(seed | 1)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in `0..n` (n > 0), with negligible bias for small `n`.
    pub fn below(&mut self, n: usize) -> usize {
        assert!(n > 0);
        (self.next_u64() % n as u64) as usize
    }

    pub fn fill(&mut self, out: &mut [u8]) {
        for chunk in out.chunks_mut(8) {
            let v = self.next_u64().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clock_is_monotonic_and_instants_map_onto_it() {
        let a = now_us();
        let i = Instant::now();
        let b = now_us();
        assert!(a <= b);
        let at = us_of(i);
        assert!(a <= at && at <= b, "{a} <= {at} <= {b}");
    }

    #[test]
    fn rng_below_stays_in_range_and_covers_it() {
        let mut r = Rng::seeded(7);
        let mut seen = [0u32; 5];
        for _ in 0..1000 {
            seen[r.below(5)] += 1;
        }
        assert!(seen.iter().all(|&n| n > 100), "{seen:?}");
    }
}
