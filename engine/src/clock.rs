//! The engine's clock: [`rotary_proto::clock`], through which every engine
//! call site reads time (`clock::now()`, `clock::wall()`,
//! `clock::elapsed(t)`), never `Instant::now()`, `SystemTime::now()` or
//! `Instant::elapsed()` itself (`clippy.toml` forbids them).
//!
//! The clock is injected per shard, at the thread: `ServeConfig::clock`
//! goes into each `ShardConfig`, and the thread that runs a shard installs
//! it ([`install`]) before opening the shard, so every time-based decision
//! of that shard (stage, flusher, pipeline, journals, connections) reads it.
//! Call sites then use the module-level functions rather than a `Clock`
//! field on `Shard`: time is read by the shard, the journals, the
//! connections, the pipeline and the reaper, and threading one value
//! through all of their signatures is a refactor of its own. Pure decisions
//! (`journal::admit`, `TokenBucket::available`) take their time as an
//! argument. Threads other than the shards' (reaper, cluster control,
//! hashers) read the real clock.

pub use rotary_proto::clock::{
    elapsed, install, now, unix_nanos, wall, wall_elapsed, Clock, Installed,
};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::journal::TokenBucket;
    use std::time::Duration;

    /// The append rate limit decides from the clock alone: with the clock
    /// standing still nothing refills, and half a second later exactly half
    /// a second's bytes may go.
    #[test]
    fn manual_clock_drives_the_append_rate_limit() {
        let clock = Clock::manual();
        let _installed = install(clock.clone());
        let mut bucket = TokenBucket::new(1000);
        assert_eq!(bucket.available(now()), Ok(1000));
        bucket.take(1000, now());
        let wait = bucket.available(now()).expect_err("the burst is spent");
        assert!(
            wait > Duration::ZERO && wait <= Duration::from_millis(1),
            "{wait:?}"
        );
        // Time stands still: however often asked, nothing more may go.
        assert_eq!(bucket.available(now()), Err(wait));
        clock.advance(Duration::from_millis(500));
        assert_eq!(bucket.available(now()), Ok(500));
        bucket.take(500, now());
        assert!(bucket.available(now()).is_err());
        clock.advance(Duration::from_secs(5));
        // Refill stops at one second's worth.
        assert_eq!(bucket.available(now()), Ok(1000));
    }
}
