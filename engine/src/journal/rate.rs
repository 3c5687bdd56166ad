//! The append rate limiter (`max_append_rate`). Looking at the bucket
//! ([`TokenBucket::available`]) changes nothing, so admission decides from
//! it as a pure function; the flusher then charges the bytes it staged
//! ([`TokenBucket::take`]), and only those.

use super::*;

/// Admits bytes at `rate` per second with one second of burst; zero is
/// unlimited.
pub struct TokenBucket {
    rate: u64,
    /// The tokens held at `last`, at most `rate`.
    tokens: f64,
    last: Instant,
}

impl TokenBucket {
    pub fn new(rate: u64) -> Self {
        TokenBucket {
            rate,
            tokens: rate as f64,
            last: crate::clock::now(),
        }
    }

    pub fn set_rate(&mut self, rate: u64) {
        if rate != self.rate {
            *self = TokenBucket::new(rate);
        }
    }

    /// Zero when unlimited.
    pub fn rate(&self) -> u64 {
        self.rate
    }

    /// How many bytes may go at `now` (`u64::MAX` when unlimited), at
    /// least one; or, if none may, how long until one may. Changes nothing:
    /// the bytes are charged by [`TokenBucket::take`] once staged.
    pub fn available(&self, now: Instant) -> Result<u64, Duration> {
        if self.rate == 0 {
            return Ok(u64::MAX);
        }
        let tokens = self.tokens_at(now);
        if tokens < 1.0 {
            return Err(Duration::from_secs_f64((1.0 - tokens) / self.rate as f64));
        }
        Ok(tokens as u64)
    }

    /// Charges `n` bytes that went at `now`: no more than
    /// [`TokenBucket::available`] allowed at `now` (or earlier).
    pub fn take(&mut self, n: u64, now: Instant) {
        if self.rate == 0 {
            return;
        }
        let tokens = self.tokens_at(now);
        assert!(
            n as f64 <= tokens,
            "charged {n} bytes with {tokens} tokens in the bucket"
        );
        self.tokens = tokens - n as f64;
        self.last = now;
    }

    /// The tokens at `now`: those held at `last` plus the refill since, up
    /// to one second's worth in all.
    fn tokens_at(&self, now: Instant) -> f64 {
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        (self.tokens + elapsed * self.rate as f64).min(self.rate as f64)
    }
}
