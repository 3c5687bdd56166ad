//! Append content held in memory: what each connection queued and not
//! yet staged, against its shard's share of `--append-queue-budget`.
//! Connections charge it as chunks arrive; the flusher releases it as it
//! stages them. Runs on the shard's thread.

use crate::metrics;
use event_listener::Event;
use std::cell::Cell;
use std::rc::Rc;
use std::sync::Arc;

/// Append bytes a connection may have queued before the broker stops
/// reading from it.
pub const CONN_APPEND_QUEUE_BYTES_MAX: usize = 64 << 20;

/// Streamed appends (first chunk sent, last not yet) one connection may
/// hold open at once, on this shard or forwarded from it: the APPEND past
/// it is refused `TOO_MANY_REQUESTS` (PROTOCOL.md §6.3).
pub const CONN_OPEN_APPENDS_MAX: usize = 1024;

/// Refused streamed appends whose remaining chunks a connection is still
/// dropping. A client that leaves more than this many unfinished is sent
/// an `ERROR` of `TOO_MANY_REQUESTS` and its connection is closed.
pub const CONN_DISCARDS_MAX: usize = 1024;

/// Reads one connection may hold open at once on a shard: the READ past
/// it is refused `TOO_MANY_REQUESTS` (PROTOCOL.md §7).
pub const CONN_OPEN_READS_MAX: usize = 4096;

/// Replicated appends a primary's connection may hold open at once (their
/// content arrived, their proposal not yet). A primary past it is sent an
/// `ERROR` of `TOO_MANY_REQUESTS` and the connection is closed; it fails
/// those appends `REPLICATION_FAILED` and synchronizes again (§14). Far
/// above what one turn of a primary's flusher stages over all the
/// journals a pipeline carries: a bound on a broken peer, not on load.
pub const CONN_REPLICATED_APPENDS_MAX: usize = 262_144;

/// A connection holding at least this much queued append content stops
/// reading while its shard's [`QueueBudget`] is spent. Below it, it reads
/// on: it may be streaming the append its journal waits for.
pub const CONN_APPEND_QUEUE_BYTES_FREE: usize = 1 << 20;

/// Append bytes queued by all connections of one shard and not yet staged,
/// against the shard's share of `--append-queue-budget`.
pub struct QueueBudget {
    used: Cell<usize>,
    limit: usize,
    event: Event,
    /// Broker-wide gauges and counters (`append_queued_bytes`,
    /// `append_queue_waits`), if this budget reports to them.
    metrics: Option<Arc<crate::metrics::Metrics>>,
}

impl QueueBudget {
    pub fn new(limit: usize, metrics: Option<Arc<crate::metrics::Metrics>>) -> Self {
        QueueBudget {
            used: Cell::new(0),
            limit,
            event: Event::new(),
            metrics,
        }
    }

    fn spent(&self) -> bool {
        self.used.get() >= self.limit
    }
}

/// Append bytes queued by a connection and not yet staged.
pub struct Budget {
    used: Cell<usize>,
    event: Event,
    shard: Rc<QueueBudget>,
    /// Appends of this connection that hold their journal (see
    /// [`Streaming`]): the connection is read on for them.
    streaming: Cell<usize>,
}

/// Held by an append while it holds its journal: its connection is not
/// held back by the shard's budget, since the rest of its content, which
/// the journal waits for, arrives only by reading it.
pub struct Streaming(Rc<Budget>);

impl Streaming {
    pub fn new(budget: Rc<Budget>) -> Self {
        budget.streaming.set(budget.streaming.get() + 1);
        budget.shard.event.notify(usize::MAX);
        Streaming(budget)
    }
}

impl Budget {
    pub fn new(shard: Rc<QueueBudget>) -> Self {
        Budget {
            used: Cell::new(0),
            event: Event::new(),
            shard,
            streaming: Cell::new(0),
        }
    }

    pub fn charge(&self, n: usize) {
        self.used.set(self.used.get() + n);
        self.shard.used.set(self.shard.used.get() + n);
        if let Some(m) = &self.shard.metrics {
            metrics::add(&m.append_queued_bytes, n as u64);
        }
    }

    pub fn release(&self, n: usize) {
        let n = n.min(self.used.get());
        self.used.set(self.used.get() - n);
        self.shard.used.set(self.shard.used.get().saturating_sub(n));
        if let Some(m) = &self.shard.metrics {
            metrics::sub(&m.append_queued_bytes, n as u64);
        }
        self.event.notify(usize::MAX);
        self.shard.event.notify(usize::MAX);
    }

    /// Waits until this connection may read more: it holds less than
    /// `limit` queued, and, if `shared`, less than
    /// [`CONN_APPEND_QUEUE_BYTES_FREE`], or an append of it holds its
    /// journal, or the shard's budget is not spent.
    pub(crate) async fn below(&self, limit: usize, shared: bool) {
        let mut counted = false;
        loop {
            if self.used.get() >= limit {
                let l = self.event.listen();
                if self.used.get() >= limit {
                    l.await;
                }
                continue;
            }
            let gated = || {
                shared
                    && self.used.get() >= CONN_APPEND_QUEUE_BYTES_FREE
                    && self.streaming.get() == 0
                    && self.shard.spent()
            };
            if !gated() {
                return;
            }
            if !counted {
                counted = true;
                if let Some(m) = &self.shard.metrics {
                    metrics::add(&m.append_queue_waits, 1);
                }
            }
            let l = self.shard.event.listen();
            if gated() {
                l.await;
            }
        }
    }
}

impl Drop for Streaming {
    fn drop(&mut self) {
        let b = &self.0;
        b.streaming.set(b.streaming.get().saturating_sub(1));
    }
}

impl Default for Budget {
    /// A budget of its own, bound by no shard's.
    fn default() -> Self {
        Budget::new(Rc::new(QueueBudget::new(usize::MAX, None)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Connections charge their shard's budget with what they queue; one
    /// holding 1 MiB or more waits while the shard's budget is spent, one
    /// holding less reads on, and releases count only what was charged.
    #[test]
    fn a_spent_shard_budget_holds_back_connections_with_much_queued() {
        let shard = Rc::new(QueueBudget::new(3 << 20, None));
        let (a, b) = (Budget::new(shard.clone()), Budget::new(shard.clone()));
        let ready = |budget: &Budget, shared: bool| {
            let fut = std::pin::pin!(budget.below(CONN_APPEND_QUEUE_BYTES_MAX, shared));
            let waker = std::task::Waker::noop();
            std::future::Future::poll(fut, &mut std::task::Context::from_waker(waker)).is_ready()
        };
        a.charge(2 << 20);
        b.charge(512 << 10);
        assert_eq!(shard.used.get(), (2 << 20) + (512 << 10));
        assert!(ready(&a, true) && ready(&b, true));
        b.charge(512 << 10);
        assert!(shard.spent());
        assert!(!ready(&a, true) && !ready(&b, true));
        // Not held back by the shard: a replication stream.
        assert!(ready(&a, false));
        // Releasing more than was charged releases what was.
        b.release(4 << 20);
        assert_eq!((b.used.get(), shard.used.get()), (0, 2 << 20));
        assert!(ready(&a, true) && ready(&b, true));
        a.charge(CONN_APPEND_QUEUE_BYTES_MAX);
        assert!(!ready(&a, false));
    }
}
