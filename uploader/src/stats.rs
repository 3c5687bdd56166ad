//! Per-store figures for operators: upload and listing latency histograms
//! and error counts, by store.
//!
//! A store is named by its [`StoreUrl::label`] (the scheme and bucket of an
//! S3 store, the directory of a file store), at most [`STORE_LABELS_MAX`]
//! of them; the stores beyond share [`OTHER_STORES`], so that journals with
//! many stores cannot multiply the exporter's series. Updated on the
//! uploader's threads (uploads, listings), never on a shard's data path: a
//! lookup takes the map's lock once per upload or listing.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use crate::StoreUrl;

/// Stores with series of their own, at most.
pub const STORE_LABELS_MAX: usize = 64;
/// The label of stores beyond [`STORE_LABELS_MAX`].
pub const OTHER_STORES: &str = "other";
/// The label of a store URL that does not parse.
pub const INVALID_STORE: &str = "invalid";

/// Buckets with an upper bound: 1 ms, doubling up to about 65 s. Beyond
/// the last one, the `+Inf` bucket.
pub const STORE_BUCKETS: usize = 17;
/// Upper bounds of the buckets, in microseconds.
pub const STORE_BOUNDS_MICROS: [u64; STORE_BUCKETS] = doubling_bounds(1000);

/// `N` histogram bucket bounds from `first`, each twice the one before.
pub const fn doubling_bounds<const N: usize>(first: u64) -> [u64; N] {
    let mut b = [0; N];
    let mut i = 0;
    while i < N {
        b[i] = first << i;
        i += 1;
    }
    b
}
const _: () = assert!(STORE_BOUNDS_MICROS[STORE_BUCKETS - 1] == 65_536_000);

/// A latency histogram of fixed buckets, of relaxed atomics.
#[derive(Debug, Default)]
pub struct Histogram {
    /// Observations per bucket (not cumulative), the last one `+Inf`.
    buckets: [AtomicU64; STORE_BUCKETS + 1],
    sum_micros: AtomicU64,
}

impl Histogram {
    pub fn observe(&self, took: Duration) {
        let micros = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
        let bucket = STORE_BOUNDS_MICROS.partition_point(|&upper| upper < micros);
        self.buckets[bucket].fetch_add(1, Ordering::Relaxed);
        self.sum_micros.fetch_add(micros, Ordering::Relaxed);
    }

    /// Observations per bucket (not cumulative, the last one `+Inf`) and
    /// their sum in microseconds.
    pub fn snapshot(&self) -> ([u64; STORE_BUCKETS + 1], u64) {
        (
            std::array::from_fn(|i| self.buckets[i].load(Ordering::Relaxed)),
            self.sum_micros.load(Ordering::Relaxed),
        )
    }
}

/// One store's figures.
#[derive(Debug, Default)]
pub struct StoreStats {
    /// Uploads that wrote and verified a fragment, from the job's start.
    pub uploads: Histogram,
    /// Upload attempts that failed (retried or not).
    pub upload_errors: AtomicU64,
    /// Listings of a journal in the store (every page of it).
    pub listings: Histogram,
    /// Listings that failed.
    pub listing_errors: AtomicU64,
}

/// Every store's figures, by label.
#[derive(Debug, Default)]
pub struct StoresStats {
    by_label: Mutex<BTreeMap<String, Arc<StoreStats>>>,
}

impl StoresStats {
    /// The figures of the store at `url` (created at its first use).
    pub fn of(&self, url: &str) -> Arc<StoreStats> {
        let label = StoreUrl::parse(url).map_or_else(|_| INVALID_STORE.to_string(), |u| u.label());
        let mut map = self.by_label.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(s) = map.get(&label) {
            return s.clone();
        }
        let label = if map.len() >= STORE_LABELS_MAX {
            OTHER_STORES.to_string()
        } else {
            label
        };
        map.entry(label).or_default().clone()
    }

    /// Every store's figures, by label.
    pub fn snapshot(&self) -> Vec<(String, Arc<StoreStats>)> {
        let map = self.by_label.lock().unwrap_or_else(PoisonError::into_inner);
        map.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_observation_lands_in_the_first_bucket_that_holds_it() {
        let h = Histogram::default();
        h.observe(Duration::from_micros(1000));
        h.observe(Duration::from_micros(1001));
        h.observe(Duration::from_secs(100));
        let (b, sum) = h.snapshot();
        assert_eq!(b[0], 1);
        assert_eq!(b[1], 1);
        assert_eq!(b[STORE_BUCKETS], 1);
        assert_eq!(b.iter().sum::<u64>(), 3);
        assert_eq!(sum, 1000 + 1001 + 100_000_000);
    }

    #[test]
    fn stores_are_labelled_by_bucket_and_bounded() {
        let s = StoresStats::default();
        let a = s.of("s3://bucket-a/one/?endpoint=http://127.0.0.1:1");
        let b = s.of("s3://bucket-a/two/");
        assert!(Arc::ptr_eq(&a, &b), "one bucket, one label");
        s.of("file:///tmp/x/");
        s.of("not a url");
        let labels: Vec<String> = s.snapshot().into_iter().map(|(l, _)| l).collect();
        assert_eq!(labels, vec!["file:///tmp/x/", "invalid", "s3://bucket-a/"]);
        for n in 0..STORE_LABELS_MAX * 2 {
            s.of(&format!("file:///tmp/many-{n}/"));
        }
        let snap = s.snapshot();
        assert_eq!(snap.len(), STORE_LABELS_MAX + 1);
        assert!(snap.iter().any(|(l, _)| l == OTHER_STORES));
    }
}
