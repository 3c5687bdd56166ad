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

    /// Empties the histograms. This runs once a period on the load
    /// generator's own cores: clearing would write every counter (about
    /// 40 MB at 5 significant digits) and delay the sends and acks recorded
    /// meanwhile, while fresh histograms cost nothing until recorded into
    /// (their zeroed pages are mapped as they are touched).
    pub fn reset(&mut self) {
        *self = Histos::new();
    }

    pub fn add(&mut self, other: &Histos) {
        add_recorded(&mut self.publish_latency_us, &other.publish_latency_us);
        add_recorded(&mut self.publish_delay_us, &other.publish_delay_us);
        add_recorded(&mut self.end_to_end_us, &other.end_to_end_us);
    }
}

/// `dst += src` for histograms of the same bounds. `Histogram::add` walks
/// every counter of `src`; this walks only up to its largest value, a small
/// part of the range when latencies are short.
fn add_recorded(dst: &mut Histogram<u64>, src: &Histogram<u64>) {
    for v in src.iter_recorded() {
        dst.record_n(v.value_iterated_to(), v.count_at_value())
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

    #[test]
    fn adding_recorded_values_matches_hdr_addition() {
        let mut a = Histos::new();
        let mut b = Histos::new();
        for i in 1..5_000u64 {
            let v = i * i * 37 % 9_000_000 + 1;
            a.publish_latency_us.record(v).unwrap();
            b.publish_delay_us.record(v / 3 + 1).unwrap();
            b.end_to_end_us.record(v * 1_000).unwrap();
            if i % 3 == 0 {
                b.publish_latency_us.record_n(v + 17, i).unwrap();
            }
        }
        let mut want = Histos::new();
        for h in [&a, &b] {
            want.publish_latency_us.add(&h.publish_latency_us).unwrap();
            want.publish_delay_us.add(&h.publish_delay_us).unwrap();
            want.end_to_end_us.add(&h.end_to_end_us).unwrap();
        }
        let mut got = Histos::new();
        got.add(&a);
        got.add(&b);
        for (g, w) in [
            (&got.publish_latency_us, &want.publish_latency_us),
            (&got.publish_delay_us, &want.publish_delay_us),
            (&got.end_to_end_us, &want.end_to_end_us),
        ] {
            assert_eq!(g.len(), w.len());
            assert_eq!(g.max(), w.max());
            assert_eq!(g.min(), w.min());
            for q in [0.0, 0.5, 0.9, 0.99, 0.999, 1.0] {
                assert_eq!(g.value_at_quantile(q), w.value_at_quantile(q), "q {q}");
            }
        }
        got.reset();
        assert!(got.publish_latency_us.is_empty() && got.end_to_end_us.is_empty());
    }
}
