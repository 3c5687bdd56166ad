//! What the runner records while a workload runs: HdrHistograms of publish
//! latency, publish delay and end-to-end latency (microseconds, 5
//! significant digits, as OMB keeps them) for the current period, and
//! counters for the whole run.
//!
//! Senders and sinks record into the period's histograms under a mutex; the
//! reporter swaps them out once per period, so recording never waits on
//! percentile arithmetic.

use hdrhistogram::Histogram;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// Significant digits of every histogram (OMB's).
pub const SIGNIFICANT_DIGITS: u8 = 5;
/// Highest publish latency and delay recorded, µs (OMB's: 60 s); longer
/// ones are recorded as this.
pub const PUBLISH_US_MAX: u64 = 60_000_000;
/// Highest end-to-end latency recorded, µs (OMB's: 12 h); a backlog drain
/// reads messages that waited long.
pub const END_TO_END_US_MAX: u64 = 12 * 3600 * 1_000_000;

/// The three latency histograms, in microseconds.
pub struct Histos {
    pub publish_latency_us: Histogram<u64>,
    pub publish_delay_us: Histogram<u64>,
    pub end_to_end_us: Histogram<u64>,
}

fn histogram(high: u64) -> Histogram<u64> {
    Histogram::new_with_bounds(1, high, SIGNIFICANT_DIGITS).expect("valid histogram bounds")
}

impl Histos {
    pub fn new() -> Histos {
        Histos {
            publish_latency_us: histogram(PUBLISH_US_MAX),
            publish_delay_us: histogram(PUBLISH_US_MAX),
            end_to_end_us: histogram(END_TO_END_US_MAX),
        }
    }

    pub fn reset(&mut self) {
        self.publish_latency_us.reset();
        self.publish_delay_us.reset();
        self.end_to_end_us.reset();
    }

    pub fn add(&mut self, other: &Histos) {
        // Same bounds on both sides: addition cannot fail.
        self.publish_latency_us
            .add(&other.publish_latency_us)
            .expect("same bounds");
        self.publish_delay_us
            .add(&other.publish_delay_us)
            .expect("same bounds");
        self.end_to_end_us
            .add(&other.end_to_end_us)
            .expect("same bounds");
    }
}

impl Default for Histos {
    fn default() -> Self {
        Histos::new()
    }
}

/// Totals since the run began (warm-up included).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// Sends the system acknowledged.
    pub sent: u64,
    pub sent_bytes: u64,
    /// Sends that failed (refused, broken connection, timed out).
    pub errors: u64,
    /// Messages handed to sinks, every subscription counted.
    pub received: u64,
    pub received_bytes: u64,
}

/// Shared by the pacer's send tasks, the consumers' sinks and the reporter.
pub struct Stats {
    period: Mutex<Histos>,
    sent: AtomicU64,
    sent_bytes: AtomicU64,
    errors: AtomicU64,
    received: AtomicU64,
    received_bytes: AtomicU64,
    /// Received messages too short to carry a timestamp.
    malformed: AtomicU64,
    first_error: Mutex<Option<String>>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Stats {
    pub fn new() -> Stats {
        Stats {
            period: Mutex::new(Histos::new()),
            sent: AtomicU64::new(0),
            sent_bytes: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            received: AtomicU64::new(0),
            received_bytes: AtomicU64::new(0),
            malformed: AtomicU64::new(0),
            first_error: Mutex::new(None),
        }
    }

    /// A send started `delay_us` after its intended time.
    pub fn record_delay(&self, delay_us: u64) {
        lock(&self.period)
            .publish_delay_us
            .saturating_record(delay_us.max(1));
    }

    /// A send of `bytes` was acknowledged `latency_us` after it started.
    pub fn record_ack(&self, latency_us: u64, bytes: usize) {
        lock(&self.period)
            .publish_latency_us
            .saturating_record(latency_us.max(1));
        self.sent.fetch_add(1, Ordering::Relaxed);
        self.sent_bytes.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    pub fn record_error(&self, why: &anyhow::Error) {
        self.errors.fetch_add(1, Ordering::Relaxed);
        lock(&self.first_error).get_or_insert_with(|| format!("{why:#}"));
    }

    /// A message of `bytes` arrived `end_to_end_us` after it was stamped.
    pub fn record_receive(&self, end_to_end_us: u64, bytes: usize) {
        lock(&self.period)
            .end_to_end_us
            .saturating_record(end_to_end_us.max(1));
        self.received.fetch_add(1, Ordering::Relaxed);
        self.received_bytes
            .fetch_add(bytes as u64, Ordering::Relaxed);
    }

    pub fn record_malformed(&self) {
        self.malformed.fetch_add(1, Ordering::Relaxed);
    }

    pub fn malformed(&self) -> u64 {
        self.malformed.load(Ordering::Relaxed)
    }

    pub fn first_error(&self) -> Option<String> {
        lock(&self.first_error).clone()
    }

    /// Swaps the period's histograms with `into` (which must be empty):
    /// afterwards `into` holds the period just ended.
    pub fn take_period(&self, into: &mut Histos) {
        std::mem::swap(&mut *lock(&self.period), into);
    }

    pub fn counters(&self) -> Counters {
        Counters {
            sent: self.sent.load(Ordering::Relaxed),
            sent_bytes: self.sent_bytes.load(Ordering::Relaxed),
            errors: self.errors.load(Ordering::Relaxed),
            received: self.received.load(Ordering::Relaxed),
            received_bytes: self.received_bytes.load(Ordering::Relaxed),
        }
    }
}

impl Default for Stats {
    fn default() -> Self {
        Stats::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn period_swap_hands_over_what_was_recorded() {
        let s = Stats::new();
        s.record_delay(5);
        s.record_ack(1_000, 10);
        s.record_receive(2_000, 10);
        s.record_ack(PUBLISH_US_MAX * 10, 10);
        let mut h = Histos::new();
        s.take_period(&mut h);
        assert_eq!(h.publish_latency_us.len(), 2);
        // Saturated, not dropped.
        assert!(h.publish_latency_us.max() >= PUBLISH_US_MAX * 99 / 100);
        assert_eq!(h.publish_delay_us.len(), 1);
        assert_eq!(h.end_to_end_us.len(), 1);
        let c = s.counters();
        assert_eq!((c.sent, c.sent_bytes, c.received), (2, 20, 1));
        let mut again = Histos::new();
        s.take_period(&mut again);
        assert_eq!(again.publish_latency_us.len(), 0);
    }
}
