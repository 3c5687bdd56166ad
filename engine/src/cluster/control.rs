//! The control thread: this broker's etcd session.
//!
//! Runs on a thread of its own (`rotary-etcd`) with a current-thread tokio
//! runtime, never on a shard's core. It owns the [`Keyspace`] and the lease.
//! Shards reach it through [`ControlHandle`] (APPLY, DELETE, synchronized
//! routes, drain) and hear from it through the [`Topology`] and the
//! [`SpecStore`].

use super::fence::Fence;
use super::member::MemberSpec;
use super::state::{Keyspace, Kv, SpecChange};
use super::EtcdConfig;
use crate::specs::{Deletion, Revised, SpecStore};
use rotary_net::spec::JournalSpec;
use std::sync::Arc;
use std::time::Duration;

/// Requests a control thread takes; each waits for the answer on `reply`.
pub enum Request {
    /// Write specs, each guarded by the revision the client expects of its
    /// item (`Some(0)`: must not exist), all or none.
    Apply {
        specs: Vec<(JournalSpec, Option<i64>)>,
        reply: async_channel::Sender<Result<i64, ControlError>>,
    },
    /// Delete a journal's item, guarded like APPLY.
    Delete {
        name: String,
        expect: Option<i64>,
        reply: async_channel::Sender<Result<i64, ControlError>>,
    },
    /// A primary synchronized `route` for `journal`: the assignments
    /// record it, which makes its members consistent for the allocator.
    Synced { journal: String, route: Vec<String> },
    /// Mark this member exiting: the allocator moves its journals away.
    Drain {
        reply: async_channel::Sender<Result<i64, ControlError>>,
    },
    /// How many assignments this member holds.
    Holding {
        reply: async_channel::Sender<Result<usize, ControlError>>,
    },
    /// Every member, with what it holds.
    Members {
        reply: async_channel::Sender<Result<Vec<MemberInfo>, ControlError>>,
    },
    /// Mark member `id` (of any zone) exiting.
    DrainMember {
        id: String,
        reply: async_channel::Sender<Result<i64, ControlError>>,
    },
}

/// One member as `rotary brokers list` shows it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MemberInfo {
    pub id: String,
    pub zone: String,
    pub endpoint: String,
    pub journal_limit: u32,
    /// Journals it holds, as primary or replica.
    pub journals: usize,
    pub primaries: usize,
    pub exiting: bool,
}

/// Why a request to the control thread failed.
#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    /// A guard of the transaction did not hold: the item's revision was
    /// not the one expected.
    #[error("etcd transaction failed: {0}")]
    TxnFailed(String),
    /// etcd could not be reached or refused the request.
    #[error(transparent)]
    Etcd(#[from] rotary_etcd::Error),
    /// What the request names does not exist.
    #[error("{0}")]
    NotFound(String),
    /// The control thread is gone (the broker is stopping).
    #[error("the broker's etcd session has ended")]
    Gone,
}

impl ControlError {
    /// Whether the same request may succeed later: etcd was away or busy,
    /// or the broker is between sessions. A failed guard, a missing item
    /// and an etcd error no retry cures (a bad argument, a compacted
    /// revision) are final.
    pub fn is_retryable(&self) -> bool {
        match self {
            ControlError::TxnFailed(_) | ControlError::NotFound(_) => false,
            ControlError::Etcd(e) => e.is_retryable(),
            ControlError::Gone => true,
        }
    }
}

/// How shards reach the control thread. Cheap to clone.
#[derive(Clone)]
pub struct ControlHandle {
    requests: async_channel::Sender<Request>,
    pub fence: Arc<Fence>,
}

/// Requests queued to the control thread at most; a shard that finds the
/// queue full waits (these are admin requests, never on the data path).
pub const REQUESTS_QUEUED_MAX: usize = 1024;

impl ControlHandle {
    pub fn new(requests: async_channel::Sender<Request>, fence: Arc<Fence>) -> ControlHandle {
        ControlHandle { requests, fence }
    }

    /// Closes the requests channel: the control thread's loop ends.
    pub fn close(&self) {
        self.requests.close();
    }

    async fn ask<T>(
        &self,
        make: impl FnOnce(async_channel::Sender<Result<T, ControlError>>) -> Request,
    ) -> Result<T, ControlError> {
        let (tx, rx) = async_channel::bounded(1);
        self.requests
            .send(make(tx))
            .await
            .map_err(|_| ControlError::Gone)?;
        rx.recv().await.map_err(|_| ControlError::Gone)?
    }

    pub async fn apply(&self, specs: Vec<(JournalSpec, Option<i64>)>) -> Result<i64, ControlError> {
        self.ask(|reply| Request::Apply { specs, reply }).await
    }

    pub async fn delete(&self, name: String, expect: Option<i64>) -> Result<i64, ControlError> {
        self.ask(|reply| Request::Delete {
            name,
            expect,
            reply,
        })
        .await
    }

    pub async fn drain(&self) -> Result<i64, ControlError> {
        self.ask(|reply| Request::Drain { reply }).await
    }

    pub async fn holding(&self) -> Result<usize, ControlError> {
        self.ask(|reply| Request::Holding { reply }).await
    }

    pub async fn members(&self) -> Result<Vec<MemberInfo>, ControlError> {
        self.ask(|reply| Request::Members { reply }).await
    }

    pub async fn drain_member(&self, id: String) -> Result<i64, ControlError> {
        self.ask(|reply| Request::DrainMember { id, reply }).await
    }

    /// Tells the control thread a primary synchronized `route`; never
    /// waits (a full queue drops it: the next sync says it again).
    pub fn synced(&self, journal: &str, route: Vec<String>) {
        let _ = self.requests.try_send(Request::Synced {
            journal: journal.into(),
            route,
        });
    }
}

/// Mirrors etcd's items into the spec store: each change at its etcd
/// revision (etcd's revisions only grow, so the store's newer-wins rule
/// holds).
pub fn apply_spec_changes(specs: &SpecStore, changes: Vec<SpecChange>) {
    let mut set = Vec::new();
    let mut gone = Vec::new();
    for c in changes {
        match c {
            SpecChange::Set(spec, rev) => set.push(Revised {
                revision: rev as u64,
                spec,
            }),
            SpecChange::Deleted(name, rev) => gone.push(Deletion {
                name,
                revision: rev as u64,
            }),
        }
    }
    if !set.is_empty() {
        if let Err(e) = specs.apply_each(set) {
            tracing::error!(error = %e, "could not record journal specs from etcd");
        }
    }
    if !gone.is_empty() {
        if let Err(e) = specs.delete_each(gone) {
            tracing::error!(error = %e, "could not record journal deletions from etcd");
        }
    }
}

/// The member key's value for this broker.
pub fn member_spec(config: &EtcdConfig, shards: u32, exiting: bool) -> MemberSpec {
    MemberSpec {
        endpoint: config.advertise.to_string(),
        shards,
        journal_limit: config.journal_limit,
        exiting,
    }
}

/// Turns a range read into a keyspace and the spec changes it implies for
/// a store that holds `local` (names of specs it has): specs etcd has are
/// set, specs it lacks are deleted at the read's revision.
pub fn keyspace_from(
    prefix: &str,
    kvs: &[Kv],
    revision: i64,
    local: &[String],
) -> (Keyspace, Vec<SpecChange>) {
    let mut ks = Keyspace::new(prefix);
    let mut changes: Vec<SpecChange> = kvs.iter().filter_map(|kv| ks.put(kv)).collect();
    ks.snapshot.revision = revision;
    for name in local {
        if !ks.specs.contains_key(name) {
            changes.push(SpecChange::Deleted(name.clone(), revision));
        }
    }
    (ks, changes)
}

/// How long to wait before trying etcd again after a failure.
pub const RETRY_PAUSE: Duration = Duration::from_millis(250);
