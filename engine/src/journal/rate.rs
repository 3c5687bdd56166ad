//! The append rate limiter (`max_append_rate`).

use super::*;

/// Admits bytes at `rate` per second with one second of burst; zero is
/// unlimited.
pub struct TokenBucket {
    rate: u64,
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

    /// Returns bytes admitted but not used.
    pub fn give_back(&mut self, n: u64) {
        if self.rate != 0 {
            self.tokens = (self.tokens + n as f64).min(self.rate as f64);
        }
    }

    /// Zero when unlimited.
    pub fn rate(&self) -> u64 {
        self.rate
    }

    /// Takes as many of `n` bytes as may go now (all of them when
    /// unlimited), at least one; or, if none may, says how long until one
    /// may.
    pub fn admit(&mut self, n: u64, now: Instant) -> Result<u64, Duration> {
        if self.rate == 0 {
            return Ok(n);
        }
        let elapsed = now.saturating_duration_since(self.last).as_secs_f64();
        self.last = now;
        self.tokens = (self.tokens + elapsed * self.rate as f64).min(self.rate as f64);
        if self.tokens < 1.0 {
            return Err(Duration::from_secs_f64(
                (1.0 - self.tokens) / self.rate as f64,
            ));
        }
        let take = n.min(self.tokens as u64);
        self.tokens -= take as f64;
        Ok(take)
    }
}
