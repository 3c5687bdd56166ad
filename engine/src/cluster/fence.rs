//! The lease fence: until when this broker may act as a primary that no
//! replica can overrule.
//!
//! etcd expires a lease `ttl` after the last keep-alive it *received*; a
//! keep-alive is received after it was sent. So `sent + ttl` is no later
//! than the expiry, and a broker that stops acting as a primary at
//! `sent + ttl - margin` has stopped before any other broker can be given
//! its journals. The margin covers clocks that run at slightly different
//! rates and the turn a shard may be in when the moment passes.
//!
//! Journals with replicas need no fence of their own: a replica that has
//! seen the journal's new route refuses a stale primary's proposals, and a
//! new primary is only ever a replica that holds every acknowledged byte.
//! A journal of replication 1 has nobody to refuse its primary, so the
//! control thread takes such journals out of the routes it hands the shards
//! once the fence has passed (see `control`).
//!
//! Written by the control thread, read by it; times are milliseconds on
//! the process's monotonic clock ([`crate::cluster::now_ms`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

pub struct Fence {
    /// Monotonic milliseconds until which the lease surely holds.
    until_ms: AtomicU64,
    ttl: Duration,
}

/// The part of the TTL held back: a fifth of it, at least 500 ms.
pub fn margin(ttl: Duration) -> Duration {
    (ttl / 5).max(Duration::from_millis(500))
}

impl Fence {
    pub fn new(ttl: Duration) -> Fence {
        assert!(
            ttl > margin(ttl),
            "a lease TTL of {ttl:?} leaves no time past its margin"
        );
        Fence {
            until_ms: AtomicU64::new(0),
            ttl,
        }
    }

    /// A keep-alive sent at `sent_ms` was answered: the lease holds until
    /// `sent_ms + ttl - margin` at least. Never moves the fence back.
    pub fn renewed(&self, sent_ms: u64) {
        let until = sent_ms + (self.ttl - margin(self.ttl)).as_millis() as u64;
        self.until_ms.fetch_max(until, Ordering::AcqRel);
    }

    /// Whether the lease surely holds at `now_ms`.
    pub fn holds(&self, now_ms: u64) -> bool {
        now_ms < self.until_ms.load(Ordering::Acquire)
    }

    /// A new lease replaced a lost one: nothing of the old one counts.
    pub fn reset(&self) {
        self.until_ms.store(0, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fence_closes_a_margin_before_the_lease_could_expire() {
        let f = Fence::new(Duration::from_secs(10));
        assert!(!f.holds(0), "no keep-alive answered yet");
        f.renewed(1_000);
        // 10 s TTL, 2 s margin: held until 8 s after the send.
        assert!(f.holds(8_999));
        assert!(!f.holds(9_000));
        // An older keep-alive answered late does not move it back.
        f.renewed(500);
        assert!(f.holds(8_999));
        f.reset();
        assert!(!f.holds(1_001));
        assert_eq!(margin(Duration::from_secs(2)), Duration::from_millis(500));
    }
}
