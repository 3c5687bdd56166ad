//! A cluster member's view of etcd, in a keyspace's own terms: string
//! keys, guards, writes and events. Brokers and consumer processes both
//! keep their cluster's keys (items, members, assignments) in etcd
//! through this layer, so that their sessions read as the cluster's logic.
//! Errors keep their type ([`Error`]), so a caller can tell one that
//! trying again may cure ([`Error::is_retryable`]) from one it cannot.

use crate::{Client, ClientOptions, Compare, CompareOp, Error, LeaseId, Op, Txn, WatchOptions};
use std::time::Duration;

/// How long a watch waits before it resumes a broken stream.
pub const WATCH_RESUME_PAUSE: Duration = Duration::from_millis(250);

/// One key-value as etcd returns it, its key as text.
#[derive(Clone, Debug)]
pub struct Kv {
    /// The key, lossily as UTF-8.
    pub key: String,
    /// The value.
    pub value: Vec<u8>,
    /// The revision that created the key.
    pub create_revision: i64,
    /// The revision of the key's last change.
    pub mod_revision: i64,
    /// The lease the key lives under (0: none).
    pub lease: i64,
}

/// A condition of a transaction.
pub enum Guard {
    /// The key does not exist.
    Absent(String),
    /// The key exists.
    Present(String),
    /// The key's mod revision is this (0: the key does not exist).
    ModRevision(String, i64),
    /// No key with this prefix was created or changed after this revision.
    UnchangedSince(String, i64),
}

/// A write of a transaction.
pub enum Write {
    /// Put under `lease` (0: none).
    Put {
        /// The key.
        key: String,
        /// Its new value.
        value: Vec<u8>,
        /// The lease it lives under (0: none).
        lease: i64,
    },
    /// Put, keeping the key's lease (an assignment's value, written by the
    /// journal's primary under the assigned broker's lease).
    PutKeepLease {
        /// The key.
        key: String,
        /// Its new value.
        value: Vec<u8>,
    },
    /// Delete the key.
    Delete {
        /// The key.
        key: String,
    },
}

/// One change the watch saw.
pub enum Event {
    /// A key created or changed.
    Put(Kv),
    /// A key deleted at a revision (by a client, or by its lease's end).
    Delete(String, i64),
}

/// The etcd client of a cluster member's session.
pub struct Etcd(Client);

/// A watch of the cluster's prefix.
pub struct Watch(crate::Watcher);

fn kv_of(kv: crate::KeyValue) -> Kv {
    Kv {
        key: String::from_utf8_lossy(&kv.key).into_owned(),
        value: kv.value,
        create_revision: kv.create_revision,
        mod_revision: kv.mod_revision,
        lease: kv.lease,
    }
}

impl Watch {
    /// The next batch of events, with the revision through which every
    /// event has been delivered. An error ends this watch (compacted,
    /// canceled): read the keyspace again and watch anew.
    pub async fn next(&mut self) -> Result<(i64, Vec<Event>), Error> {
        loop {
            match self.0.next().await {
                Ok(batch) => {
                    let events = batch
                        .events
                        .into_iter()
                        .map(|e| match e.kind {
                            crate::EventKind::Put => Event::Put(kv_of(e.kv)),
                            crate::EventKind::Delete => Event::Delete(
                                String::from_utf8_lossy(&e.kv.key).into_owned(),
                                e.kv.mod_revision,
                            ),
                        })
                        .collect();
                    return Ok((batch.revision, events));
                }
                // A broken stream reopens itself on the next call.
                Err(e) if e.is_retryable() => {
                    tracing::debug!(error = %e, "the etcd watch broke; resuming");
                    tokio::time::sleep(WATCH_RESUME_PAUSE).await;
                }
                Err(e) => return Err(e),
            }
        }
    }
}

impl Etcd {
    /// Connects to the first of `endpoints` that answers.
    pub async fn connect(endpoints: &[String]) -> Result<Etcd, Error> {
        Client::connect(endpoints, ClientOptions::default())
            .await
            .map(Etcd)
    }

    /// A new lease of `ttl`: its id.
    pub async fn grant(&self, ttl: Duration) -> Result<i64, Error> {
        self.0.lease_grant(ttl).await.map(|l| l.id.0)
    }

    /// One keep-alive: the TTL left, or `None` if the lease is gone.
    pub async fn keep_alive(&self, lease: i64) -> Result<Option<Duration>, Error> {
        match self.0.lease_keep_alive_once(LeaseId(lease)).await {
            Ok(ttl) => Ok(Some(ttl)),
            Err(Error::LeaseNotFound { .. } | Error::LeaseExpired { .. }) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Ends a lease: every key under it is deleted.
    pub async fn revoke(&self, lease: i64) -> Result<(), Error> {
        self.0.lease_revoke(LeaseId(lease)).await
    }

    /// Every key under `prefix`, at one revision.
    pub async fn range(&self, prefix: &str) -> Result<(Vec<Kv>, i64), Error> {
        let r = self.0.range_prefix(prefix.as_bytes().to_vec()).await?;
        Ok((r.kvs.into_iter().map(kv_of).collect(), r.revision))
    }

    /// A transaction: `Some(revision)` if every guard held and the writes
    /// landed, `None` if a guard did not hold (nothing was written).
    pub async fn txn(&self, guards: Vec<Guard>, writes: Vec<Write>) -> Result<Option<i64>, Error> {
        let compares = guards.into_iter().map(|g| match g {
            Guard::Absent(k) => Compare::absent(k.into_bytes()),
            Guard::Present(k) => Compare::create_revision(k.into_bytes(), CompareOp::Greater, 0),
            Guard::ModRevision(k, 0) => Compare::absent(k.into_bytes()),
            Guard::ModRevision(k, r) => Compare::mod_revision(k.into_bytes(), CompareOp::Equal, r),
            Guard::UnchangedSince(p, r) => {
                Compare::mod_revision_of_prefix(p.into_bytes(), CompareOp::Less, r + 1)
            }
        });
        let ops = writes.into_iter().map(|w| match w {
            Write::Put { key, value, lease } => Op::put(
                key.into_bytes(),
                value,
                (lease != 0).then_some(LeaseId(lease)),
            ),
            Write::PutKeepLease { key, value } => Op::put_keep_lease(key.into_bytes(), value),
            Write::Delete { key } => Op::delete(key.into_bytes()),
        });
        let r = self.0.txn(Txn::new().when(compares).and_then(ops)).await?;
        Ok(r.succeeded.then_some(r.revision))
    }

    /// Watches `prefix` from `revision` on (inclusive).
    pub async fn watch(&self, prefix: &str, revision: i64) -> Result<Watch, Error> {
        let options = WatchOptions {
            start_revision: revision,
            ..WatchOptions::default()
        };
        self.0
            .watch_prefix(prefix.as_bytes().to_vec(), options)
            .await
            .map(Watch)
    }
}
