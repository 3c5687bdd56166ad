//! Broker-wide counters, shared by all shards.
//!
//! Each counter keeps one slot per shard (plus one for threads that are not
//! a shard's): a shard's thread adds to its own slot, chosen by the index
//! [`set_thread_shard`] recorded for the thread when it started, so the
//! call sites (`metrics::add(&m.appends, n)`) need not name their shard.
//! The slots of one shard lie together, a cache line apart from the next
//! shard's, so that shards never write to a line another shard writes.
//! STATS reads the sums ([`Counter::load`]); the HTTP server's `/metrics`
//! also reads each slot ([`Counter::slot`]). Every operation is a relaxed
//! atomic: counters, not synchronization.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// Shards a broker may run ([`crate::Broker::start`] refuses more).
pub const SHARDS_MAX: usize = 256;
/// The slot of threads that are not a shard's (uploads, hashers, tests).
pub const OTHER_SLOT: usize = SHARDS_MAX;
const SLOTS: usize = SHARDS_MAX + 1;

thread_local! {
    static SLOT: Cell<usize> = const { Cell::new(OTHER_SLOT) };
}

/// Makes the calling thread count into shard `index`'s slots from now on.
/// Called once, as a shard's thread starts.
pub fn set_thread_shard(index: u32) {
    let index = index as usize;
    assert!(index < SHARDS_MAX, "shard index {index} beyond SHARDS_MAX");
    SLOT.with(|s| s.set(index));
}

fn thread_slot() -> usize {
    SLOT.with(|s| s.get())
}

/// Every counter's slots, shard by shard: `[slot][counter]`, each shard's
/// row padded to whole cache lines.
struct Slots {
    values: Box<[AtomicU64]>,
    /// Counters per row, rounded up to whole 64-byte lines.
    stride: usize,
}

impl Slots {
    fn new(counters: usize) -> Self {
        let stride = counters.div_ceil(8) * 8;
        Slots {
            values: (0..stride * SLOTS).map(|_| AtomicU64::new(0)).collect(),
            stride,
        }
    }

    fn at(&self, slot: usize, counter: usize) -> &AtomicU64 {
        &self.values[slot * self.stride + counter]
    }
}

/// One counter (or gauge) of [`Metrics`], with `AtomicU64`'s methods: the
/// writing ones act on the calling thread's slot, [`Counter::load`] sums
/// every slot.
pub struct Counter {
    slots: Arc<Slots>,
    index: usize,
}

impl Counter {
    pub fn fetch_add(&self, n: u64, order: Ordering) -> u64 {
        self.slots.at(thread_slot(), self.index).fetch_add(n, order)
    }

    /// Lowers the calling thread's slot; a gauge raised on one thread and
    /// lowered on another leaves one slot wrapped below zero, which the
    /// sum (wrapping) cancels.
    pub fn fetch_sub(&self, n: u64, order: Ordering) -> u64 {
        self.slots.at(thread_slot(), self.index).fetch_sub(n, order)
    }

    /// The sum over every slot.
    pub fn load(&self, order: Ordering) -> u64 {
        (0..SLOTS).fold(0u64, |sum, s| {
            sum.wrapping_add(self.slots.at(s, self.index).load(order))
        })
    }

    /// Sets the counter to `v`: the calling thread's slot holds it, the
    /// others are cleared (not atomically as a whole).
    pub fn store(&self, v: u64, order: Ordering) {
        let mine = thread_slot();
        for s in 0..SLOTS {
            let value = if s == mine { v } else { 0 };
            self.slots.at(s, self.index).store(value, order);
        }
    }

    /// What shard `slot` (or [`OTHER_SLOT`]) counted.
    pub fn slot(&self, slot: usize) -> u64 {
        self.slots.at(slot, self.index).load(Ordering::Relaxed)
    }

    /// Sets the calling thread's slot to `v`, leaving the other shards'
    /// alone: a gauge that each shard measures of its own journals.
    pub fn set_own(&self, v: u64) {
        self.slots
            .at(thread_slot(), self.index)
            .store(v, Ordering::Relaxed);
    }
}

/// Buckets of [`LatencyHistogram`] with an upper bound: 50 µs, doubling up
/// to about 3.3 s. Beyond the last one, the `+Inf` bucket.
pub const LATENCY_BUCKETS: usize = 17;
/// Upper bounds of the latency buckets, in microseconds.
pub const LATENCY_BOUNDS_MICROS: [u64; LATENCY_BUCKETS] =
    rotary_uploader::stats::doubling_bounds(50);
const _: () = assert!(LATENCY_BOUNDS_MICROS[LATENCY_BUCKETS - 1] == 3_276_800);

/// The append latency histogram's classes: a journal's durability.
pub const DURABILITIES: [&str; 2] = ["replicated", "fsync"];

/// The class of `d` in [`DURABILITIES`].
pub fn durability_class(d: rotary_net::spec::Durability) -> usize {
    match d {
        rotary_net::spec::Durability::Replicated => 0,
        rotary_net::spec::Durability::Fsync => 1,
    }
}

/// Counters of one class in a row: the buckets, `+Inf`, then the sum.
const CLASS_COUNTERS: usize = LATENCY_BUCKETS + 2;

/// A latency histogram per shard and per class, of fixed buckets
/// ([`LATENCY_BOUNDS_MICROS`]): an observation adds to one bucket and to
/// the sum, in the calling thread's slots (as [`Counter`] does), without a
/// lock or an allocation.
pub struct LatencyHistogram {
    slots: Slots,
    classes: usize,
}

/// One shard's histogram of one class, as read by an exporter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HistogramSnapshot {
    /// Observations per bucket (not cumulative), the last one `+Inf`.
    pub buckets: [u64; LATENCY_BUCKETS + 1],
    pub sum_micros: u64,
}

impl HistogramSnapshot {
    pub fn count(&self) -> u64 {
        self.buckets.iter().sum()
    }
}

impl LatencyHistogram {
    pub fn new(classes: usize) -> Self {
        LatencyHistogram {
            slots: Slots::new(classes * CLASS_COUNTERS),
            classes,
        }
    }

    /// Counts one observation of `micros` in `class`.
    pub fn observe(&self, class: usize, micros: u64) {
        assert!(class < self.classes, "histogram class {class} out of range");
        let slot = thread_slot();
        let bucket = LATENCY_BOUNDS_MICROS.partition_point(|&upper| upper < micros);
        let base = class * CLASS_COUNTERS;
        self.slots
            .at(slot, base + bucket)
            .fetch_add(1, Ordering::Relaxed);
        self.slots
            .at(slot, base + CLASS_COUNTERS - 1)
            .fetch_add(micros, Ordering::Relaxed);
    }

    /// What shard `slot` (or [`OTHER_SLOT`]) observed in `class`.
    pub fn slot(&self, slot: usize, class: usize) -> HistogramSnapshot {
        let base = class * CLASS_COUNTERS;
        let load = |i: usize| self.slots.at(slot, base + i).load(Ordering::Relaxed);
        HistogramSnapshot {
            buckets: std::array::from_fn(load),
            sum_micros: load(CLASS_COUNTERS - 1),
        }
    }
}

/// Whether a counter only grows (a Prometheus counter) or also falls.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
}

/// One counter's description, for exporters.
#[derive(Clone, Copy, Debug)]
pub struct Described {
    pub name: &'static str,
    pub help: &'static str,
    pub kind: Kind,
}

macro_rules! counters {
    ($($(#[doc = $doc:literal])* $kind:ident $name:ident),* $(,)?) => {
        pub struct Metrics {
            $($(#[doc = $doc])* pub $name: Counter,)*
            /// Latency of appends, from their arrival at the broker to
            /// their acknowledgement, by the journal's durability
            /// ([`DURABILITIES`]).
            pub append_latency: LatencyHistogram,
        }

        impl Default for Metrics {
            fn default() -> Self {
                let names: &[&str] = &[$(stringify!($name)),*];
                let slots = Arc::new(Slots::new(names.len()));
                let mut index = 0..;
                Metrics {
                    $($name: Counter {
                        slots: slots.clone(),
                        index: index.next().expect("unbounded"),
                    },)*
                    append_latency: LatencyHistogram::new(DURABILITIES.len()),
                }
            }
        }

        impl Metrics {
            pub fn to_json(&self, shards: usize) -> serde_json::Value {
                let mut m = serde_json::Map::new();
                m.insert("shards".into(), shards.into());
                $(m.insert(stringify!($name).into(), self.$name.load(Ordering::Relaxed).into());)*
                serde_json::Value::Object(m)
            }

            /// Every counter with its description, in declaration order.
            pub fn described(&self) -> Vec<(Described, &Counter)> {
                vec![$((
                    Described {
                        name: stringify!($name),
                        help: concat!($($doc, " ",)* ""),
                        kind: Kind::$kind,
                    },
                    &self.$name,
                ),)*]
            }
        }
    };
}

counters!(
    /// Appends committed.
    Counter appends,
    /// Bytes of committed appends.
    Counter append_bytes,
    /// Appends committed to journals of durability `replicated`.
    Counter appends_replicated,
    /// Their bytes.
    Counter append_bytes_replicated,
    /// Appends committed to journals of durability `fsync`.
    Counter appends_fsync,
    /// Their bytes.
    Counter append_bytes_fsync,
    /// Appends that failed after they began (rolled back).
    Counter append_failures,
    /// Batches of appends written to spools.
    Counter batches,
    /// Bytes written to spools by batches.
    Counter batch_write_bytes,
    /// Append bytes staged while the journal's previous batch was written.
    Counter prestaged_bytes,
    /// Group-committed fdatasyncs of spools.
    Counter fsyncs,
    /// Reads started.
    Counter reads,
    /// Bytes sent to readers.
    Counter read_bytes,
    /// Reads served from a journal's tail cache.
    Counter tail_cache_reads,
    /// Requests that landed on the wrong shard and were forwarded to the
    /// owning one.
    Counter cross_core_forwards,
    /// Client connections accepted.
    Counter connections,
    /// Spools sealed into fragments.
    Counter fragments_sealed,
    /// Spools begun in a spare file (an uploaded fragment's), overwriting
    /// written blocks instead of writing fallocated ones.
    Counter spools_recycled,
    /// Files of uploaded fragments (or empty spools) kept as spares.
    Counter spares_kept,
    /// Appends refused with STORAGE_FULL.
    Counter storage_full,
    /// Journals parked because their disk failed for good (a final I/O
    /// error: EIO, a read-only or corrupt file system); their appends are
    /// refused DISK_FAILED until the broker restarts.
    Counter disk_failed_journals,
    /// SYNCs of journals (a replica joining or a primary taking over).
    Counter syncs,
    /// Requests and SYNCs routed at an etcd revision this broker had not
    /// seen yet, that it waited for.
    Counter route_revision_waits,
    /// Those whose revision the broker's watch did not reach in time
    /// (refused with WRONG_ROUTE).
    Counter route_revision_timeouts,
    /// Replication proposals: batches sent to replicas.
    Counter replicated_batches,
    /// Requests proxied to another broker.
    Counter proxied_requests,
    /// Replication ack frames received from replicas.
    Counter repl_ack_frames,
    /// Appends acknowledged by those frames.
    Counter repl_acks,
    /// Append content read from clients and queued, not yet staged.
    Gauge append_queued_bytes,
    /// Times a connection stopped reading because its shard's append queue
    /// budget was spent.
    Counter append_queue_waits,
    /// Spool bytes hashed at start to check them against the commit log.
    Counter recovery_hashed_bytes,
    /// Journals a start found files or commit-log records of but no spec
    /// for (deleted while the broker was down): their files were handed to
    /// the reaper and the commit log told of their deletion.
    Counter recovery_reaped_journals,
    /// Memory held by the tail caches of tailed journals.
    Gauge tail_cache_bytes,
    /// Listings of a journal's stores started (one LIST, or a page of them,
    /// per store).
    Counter listings,
    /// First listings of a journal's stores started ahead of the shard's
    /// queue of listings, because a request waited for one.
    Counter listings_hurried,
    /// Refreshes of a journal's index skipped because this broker is
    /// outside its route and holds none of its bytes (the index let go).
    Counter listings_spared,
    /// Append bytes whose own SHA-1 the shard's hasher thread computed.
    Counter hash_offloaded_bytes,
    /// Times an append waited for the hasher to catch up.
    Counter hash_waits,
    /// Times a journal's appends waited for its `max_append_rate`.
    Counter rate_waits,
    /// Brokers of a journal's earlier routes that did not answer its new
    /// primary's SYNC in time.
    Counter takeover_sources_silent,
    /// SYNCs not sent to a broker of an earlier route because it had not
    /// answered another moments before.
    Counter takeover_sources_passed_over,
    /// Journal bytes a primary copied from replicas, or brokers a journal
    /// left, that were ahead of it.
    Counter copied_bytes,
    /// Local fragment files found on disk at start that a read checked
    /// whole against their names.
    Counter fragments_checked,
    /// Local fragment files found on disk at start whose bytes did not
    /// match their names.
    Counter fragments_check_failed,
    /// Store fragments found to disagree with their journal's committed
    /// history (overlapping another fragment with other bytes, and judged
    /// not to be the committed one), each counted once by the shard that
    /// owns its journal.
    Counter fragments_conflicting,
    /// Reads that jumped over a gap in their journal's history old enough
    /// to be taken as permanent (`--offset-jump-age`).
    Counter offset_jumps,
    /// Bytes of history those jumps skipped.
    Counter offset_jump_bytes,
    /// Times a primary's shard polled its ring, rather than sleep, while
    /// replicas' acks were awaited.
    Counter ack_polls,
    /// Microseconds a primary's shard spent polling for replicas' acks.
    Counter ack_poll_micros,
    /// Reads blocked at their journal's write head, waiting for appends.
    Gauge tailing_readers,
    /// Bytes of journals held on local disk: open spools and sealed
    /// fragments (uploaded or not), measured once a second.
    Gauge spool_bytes,
    /// Bytes that the slowest replica of any of the shard's journals has
    /// yet to acknowledge (the largest over its journals), measured once
    /// a second.
    Gauge replica_lag_bytes,
    /// Appends answered REPLICATION_FAILED.
    Counter replication_failed,
    /// Bytes a primary committed and then took back because a replica
    /// did not acknowledge them (never visible, sealed or uploaded).
    Counter taken_back_bytes,
    /// Flusher turns that took longer than the slow-turn threshold (50 ms).
    Counter slow_turns,
    /// Journals with stores whose stores this broker has yet to list once
    /// (readiness waits for none), measured once a second.
    Gauge journals_unlisted,
);

pub fn add(c: &Counter, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// Lowers a gauge.
pub fn sub(c: &Counter, n: u64) {
    c.fetch_sub(n, Ordering::Relaxed);
}

/// A gauge raised by one while this is held, lowered when it is dropped
/// (also when the future holding it is).
pub struct GaugeHeld<'a>(&'a Counter);

impl<'a> GaugeHeld<'a> {
    pub fn raise(c: &'a Counter) -> Self {
        add(c, 1);
        GaugeHeld(c)
    }
}

impl Drop for GaugeHeld<'_> {
    fn drop(&mut self) {
        sub(self.0, 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs `f` on a thread of its own as shard `n`.
    fn on_shard(n: u32, m: &Arc<Metrics>, f: impl FnOnce(&Metrics) + Send + 'static) {
        let m = m.clone();
        let t = std::thread::spawn(move || {
            set_thread_shard(n);
            f(&m);
        });
        t.join().expect("the shard's thread");
    }

    /// Each thread counts into its shard's slot; the sum is STATS's value.
    #[test]
    fn shards_count_into_their_own_slots() {
        let m = Arc::new(Metrics::default());
        let threads: Vec<_> = (0..3u32)
            .map(|n| {
                let m = m.clone();
                std::thread::spawn(move || {
                    set_thread_shard(n);
                    add(&m.appends, u64::from(n) + 1);
                    add(&m.append_queued_bytes, 10);
                    sub(&m.append_queued_bytes, 4);
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        add(&m.appends, 100);
        assert_eq!(m.appends.load(Ordering::Relaxed), 1 + 2 + 3 + 100);
        assert_eq!(
            (0..3).map(|s| m.appends.slot(s)).collect::<Vec<_>>(),
            vec![1, 2, 3]
        );
        assert_eq!(m.appends.slot(OTHER_SLOT), 100);
        assert_eq!(m.append_queued_bytes.load(Ordering::Relaxed), 18);
        assert_eq!(m.to_json(3)["appends"], 106);
        assert_eq!(m.append_bytes.load(Ordering::Relaxed), 0);
    }

    /// A gauge raised on one thread and lowered on another sums right.
    #[test]
    fn a_gauge_moved_across_threads_sums_to_its_value() {
        let m = Arc::new(Metrics::default());
        on_shard(1, &m, |m| {
            add(&m.tail_cache_bytes, 50);
        });
        sub(&m.tail_cache_bytes, 20);
        assert_eq!(m.tail_cache_bytes.load(Ordering::Relaxed), 30);
        m.tail_cache_bytes.store(7, Ordering::Relaxed);
        assert_eq!(m.tail_cache_bytes.load(Ordering::Relaxed), 7);
    }

    /// Every counter is described, once, with help text.
    #[test]
    fn every_counter_is_described() {
        let m = Metrics::default();
        let d = m.described();
        let json = m.to_json(1);
        assert_eq!(d.len() + 1, json.as_object().unwrap().len());
        for (desc, _) in &d {
            assert!(!desc.help.trim().is_empty(), "{} has no help", desc.name);
            assert!(json.get(desc.name).is_some());
        }
        let gauges: Vec<_> = d
            .iter()
            .filter(|(x, _)| x.kind == Kind::Gauge)
            .map(|(x, _)| x.name)
            .collect();
        assert_eq!(
            gauges,
            vec![
                "append_queued_bytes",
                "tail_cache_bytes",
                "tailing_readers",
                "spool_bytes",
                "replica_lag_bytes",
                "journals_unlisted"
            ]
        );
    }

    /// An observation lands in the first bucket whose bound holds it, in
    /// the observing shard's slot, per class.
    #[test]
    fn latency_lands_in_its_bucket_and_slot() {
        let m = Arc::new(Metrics::default());
        on_shard(2, &m, |m| {
            m.append_latency.observe(1, 50); // on the first bound
            m.append_latency.observe(1, 51); // just past it
            m.append_latency.observe(1, 10_000_000); // past the last
        });
        m.append_latency.observe(0, 0);
        let s = m.append_latency.slot(2, 1);
        assert_eq!(s.count(), 3);
        assert_eq!(s.sum_micros, 50 + 51 + 10_000_000);
        assert_eq!(s.buckets[0], 1);
        assert_eq!(s.buckets[1], 1);
        assert_eq!(s.buckets[LATENCY_BUCKETS], 1);
        assert_eq!(m.append_latency.slot(2, 0).count(), 0);
        assert_eq!(m.append_latency.slot(OTHER_SLOT, 0).buckets[0], 1);
    }

    /// A shard's own gauge leaves the other shards' values alone.
    #[test]
    fn set_own_sets_only_the_callers_slot() {
        let m = Arc::new(Metrics::default());
        on_shard(0, &m, |m| {
            m.spool_bytes.set_own(40);
        });
        m.spool_bytes.set_own(2);
        m.spool_bytes.set_own(3);
        assert_eq!(m.spool_bytes.slot(0), 40);
        assert_eq!(m.spool_bytes.load(Ordering::Relaxed), 43);
    }
}
