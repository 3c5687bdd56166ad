//! Broker-wide counters, shared by all shards (relaxed atomics; each
//! counter is written by its owning shard's thread and read by STATS).

use std::sync::atomic::{AtomicU64, Ordering};

macro_rules! counters {
    ($($name:ident),* $(,)?) => {
        #[derive(Default)]
        pub struct Metrics {
            $(pub $name: AtomicU64,)*
        }

        impl Metrics {
            pub fn to_json(&self, shards: usize) -> serde_json::Value {
                let mut m = serde_json::Map::new();
                m.insert("shards".into(), shards.into());
                $(m.insert(stringify!($name).into(), self.$name.load(Ordering::Relaxed).into());)*
                serde_json::Value::Object(m)
            }
        }
    };
}

counters!(
    appends,
    append_bytes,
    append_failures,
    batches,
    batch_write_bytes,
    // Append bytes staged while the journal's previous batch was written.
    prestaged_bytes,
    fsyncs,
    reads,
    read_bytes,
    tail_cache_reads,
    cross_core_forwards,
    connections,
    fragments_sealed,
    // Spools begun in a spare file (an uploaded fragment's), overwriting
    // written blocks instead of writing fallocated ones.
    spools_recycled,
    // Files of uploaded fragments (or empty spools) kept as spares.
    spares_kept,
    storage_full,
    syncs,
    replicated_batches,
    proxied_requests,
    repl_ack_frames,
    repl_acks,
    // A gauge: append content read from clients and queued, not yet staged.
    append_queued_bytes,
    // Times a connection stopped reading because its shard's append queue
    // budget was spent.
    append_queue_waits,
    // Spool bytes hashed at start to check them against the commit log.
    recovery_hashed_bytes,
    // A gauge: memory held by the tail caches of tailed journals.
    tail_cache_bytes,
    // Comparisons with a peer's specs that listed them all (the digests
    // differed), and those that found the same digest and listed nothing.
    spec_syncs_full,
    spec_syncs_unchanged,
    // Listings of a journal's stores started (one LIST, or a page of them,
    // per store).
    listings,
    // First listings of a journal's stores started ahead of the shard's
    // queue of listings, because a request waited for one.
    listings_hurried,
    // Refreshes of a journal's index skipped because this broker is
    // outside its route and holds none of its bytes (the index let go).
    listings_spared,
    // Append bytes whose own SHA-1 the shard's hasher thread computed.
    hash_offloaded_bytes,
    // Times an append waited for the hasher to catch up.
    hash_waits,
    // Times a journal's appends waited for its `max_append_rate`.
    rate_waits,
    // Brokers of a journal's earlier routes that did not answer its new
    // primary's SYNC in time, and SYNCs not sent to one because it had
    // not answered another moments before.
    takeover_sources_silent,
    takeover_sources_passed_over,
    // Cluster views learned from peers' STATS as the broker started.
    cluster_views_learned,
    // Journal bytes a primary copied from replicas, or brokers a journal
    // left, that were ahead of it.
    copied_bytes,
    // Local fragment files found on disk at start that a read checked
    // whole against their names, and those that did not match.
    fragments_checked,
    fragments_check_failed,
    // Times a primary's shard polled its ring, rather than sleep, while
    // replicas' acks were awaited, and the microseconds it spent so.
    ack_polls,
    ack_poll_micros,
);

pub fn add(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

/// Lowers a gauge.
pub fn sub(c: &AtomicU64, n: u64) {
    c.fetch_sub(n, Ordering::Relaxed);
}
