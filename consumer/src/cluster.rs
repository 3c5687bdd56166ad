//! A consumer process's membership of its application on etcd, and the
//! placement of shards on processes by the allocator brokers use for
//! journals (one allocator, two kinds of items).
//!
//! Keys follow Gazette's layout under the application's prefix:
//! `items/<shard>` (a [`ShardSpec`], JSON, no lease), `members/<zone>#<id>`
//! (a [`ConsumerSpec`], under the process's lease) and
//! `assign/<shard>#<zone>#<id>#<slot>` (under the assigned process's
//! lease; slot 0 is the primary, the others are standbys). A shard wants
//! `hot_standbys + 1` copies, standbys in other zones where there are
//! enough. An assignment's value is empty until its process is *ready* —
//! a primary that finished recovery, a standby tailing the recovery log —
//! and then holds the route the assignments imply, as a journal's primary
//! writes it: the allocator removes an old copy only once its replacement
//! is ready, and promotes only a ready standby.
//!
//! Everything here is async on tokio; [`Session`] is owned by one task.

use crate::spec::{ConsumerSpec, ShardSpec};
use rotary_allocator::{self as allocator, AssignmentKey, Item, Key, MemberKey, Route};
use rotary_etcd::keyspace::{Etcd, Event, Guard, Kv, Watch, Write};
use std::collections::BTreeMap;
use std::time::Duration;

/// The allocator's key space of a consumer application.
pub type Snapshot = rotary_allocator::Snapshot<ConsumerSpec>;

/// How a consumer process joins its application.
#[derive(Clone, Debug)]
pub struct ConsumerConfig {
    /// etcd client URLs.
    pub endpoints: Vec<String>,
    /// The application's key prefix, e.g. `/word-count`.
    pub prefix: String,
    pub zone: String,
    pub id: String,
    /// Where clients reach this process (`HOST:PORT`).
    pub endpoint: String,
    pub shard_limit: u32,
    pub lease_ttl: Duration,
}

/// The application's keys as this process last read them.
pub struct Keyspace {
    pub snapshot: Snapshot,
    /// Each shard's whole spec (the snapshot keeps what the allocator reads).
    pub shards: BTreeMap<String, ShardSpec>,
}

impl Keyspace {
    pub fn new(prefix: &str, revision: i64) -> Keyspace {
        Keyspace {
            snapshot: Snapshot::new(prefix, revision),
            shards: BTreeMap::new(),
        }
    }

    /// Takes a put. A value that does not decode is logged and taken as
    /// absent: etcd's contents are input, never trusted to be well formed.
    pub fn put(&mut self, kv: &Kv) {
        let snap = &mut self.snapshot;
        let Ok(key) = allocator::parse_key(&snap.prefix, &kv.key) else {
            return;
        };
        let (cr, mr) = (kv.create_revision, kv.mod_revision);
        let bad = match key {
            Key::Member(m) => match snap.put_member(&kv.key, &kv.value, cr, mr, kv.lease) {
                Ok(_) => None,
                Err(e) => {
                    snap.members.remove(&m);
                    Some(e.to_string())
                }
            },
            Key::Assignment(_) => {
                let put = snap.put_assignment(&kv.key, &kv.value, cr, mr);
                put.err().map(|e| e.to_string())
            }
            Key::Item(shard) => self.put_shard(shard, kv),
        };
        if let Some(error) = bad {
            tracing::warn!(key = %kv.key, %error, "a key of the application does not decode");
        }
    }

    fn put_shard(&mut self, id: String, kv: &Kv) -> Option<String> {
        let parsed = serde_json::from_slice::<ShardSpec>(&kv.value)
            .map_err(|e| e.to_string())
            .and_then(|mut s| s.validate().map(|()| s).map_err(|e| e.to_string()))
            .and_then(|s| match s.id == id {
                true => Ok(s),
                false => Err(format!("the spec names shard {:?}", s.id)),
            });
        match parsed {
            Ok(spec) => {
                let item = Item {
                    replication: spec.replication(),
                    mod_revision: kv.mod_revision,
                };
                self.snapshot.items.insert(id.clone(), item);
                self.shards.insert(id, spec);
                None
            }
            Err(e) => {
                self.snapshot.items.remove(&id);
                self.shards.remove(&id);
                Some(e)
            }
        }
    }

    /// Takes a deletion (by a client, or a lease's end).
    pub fn delete(&mut self, key: &str) {
        if let Ok(Key::Item(shard)) = allocator::parse_key(&self.snapshot.prefix, key) {
            self.shards.remove(&shard);
        }
        let _ = self.snapshot.delete(key);
    }

    /// The assignments of `me`, by shard: (slot, ready).
    pub fn assigned_to(&self, me: &MemberKey) -> BTreeMap<String, (u32, bool)> {
        let mine = self
            .snapshot
            .assignments
            .iter()
            .filter(|(k, _)| &k.member == me);
        mine.map(|(k, a)| {
            let current = self.snapshot.assignments_of(&k.item).map(|(k, _)| k);
            let ready = allocator::consistent(a, current);
            (k.item.clone(), (k.slot, ready))
        })
        .collect()
    }
}

/// One consumer process's session: its lease, its member key, its mirror
/// of the application's keys, and the allocator while it leads.
pub struct Session {
    etcd: Etcd,
    config: ConsumerConfig,
    me: MemberKey,
    lease: i64,
    pub keyspace: Keyspace,
    watch: Watch,
}

/// Why a session could not start or go on.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error(transparent)]
    Etcd(#[from] rotary_etcd::Error),
    #[error("zone {zone:?}, id {id:?}: {error}")]
    Member {
        zone: String,
        id: String,
        error: allocator::KeyError,
    },
    #[error("member {0} exists already: another process runs with this zone and id")]
    MemberTaken(String),
    /// The lease expired: every assignment of this process went with it.
    #[error("the process's etcd lease expired")]
    LeaseLost,
}

impl Session {
    /// Connects, takes a lease, writes the member key (refused if another
    /// process holds it) and reads the application's keys.
    pub async fn open(config: ConsumerConfig) -> Result<Session, SessionError> {
        let member = |error| SessionError::Member {
            zone: config.zone.clone(),
            id: config.id.clone(),
            error,
        };
        let me = MemberKey::new(&config.zone, &config.id).map_err(member)?;
        let etcd = Etcd::connect(&config.endpoints).await?;
        let lease = etcd.grant(config.lease_ttl).await?;
        let key = allocator::member_key(&config.prefix, &me);
        let spec = ConsumerSpec {
            endpoint: config.endpoint.clone(),
            shard_limit: config.shard_limit,
            exiting: false,
        };
        let value = serde_json::to_vec(&spec).expect("a spec serializes");
        let put = Write::Put {
            key: key.clone(),
            value,
            lease,
        };
        if etcd
            .txn(vec![Guard::Absent(key.clone())], vec![put])
            .await?
            .is_none()
        {
            let _ = etcd.revoke(lease).await;
            return Err(SessionError::MemberTaken(key));
        }
        let prefix = format!("{}/", allocator::keys::normalize_prefix(&config.prefix));
        let (kvs, revision) = etcd.range(&prefix).await?;
        let mut keyspace = Keyspace::new(&config.prefix, revision);
        kvs.iter().for_each(|kv| keyspace.put(kv));
        let watch = etcd.watch(&prefix, revision + 1).await?;
        Ok(Session {
            etcd,
            config,
            me,
            lease,
            keyspace,
            watch,
        })
    }

    pub fn me(&self) -> &MemberKey {
        &self.me
    }

    /// Renews the lease once.
    pub async fn keep_alive(&self) -> Result<(), SessionError> {
        match self.etcd.keep_alive(self.lease).await? {
            Some(_) => Ok(()),
            None => Err(SessionError::LeaseLost),
        }
    }

    /// Waits up to `wait` for changes of the keys and takes them; then,
    /// while this process leads, writes the allocator's plan.
    pub async fn step(&mut self, wait: Duration) -> Result<(), SessionError> {
        if let Ok(batch) = tokio::time::timeout(wait, self.watch.next()).await {
            let (revision, events) = batch?;
            for e in events {
                match e {
                    Event::Put(kv) => self.keyspace.put(&kv),
                    Event::Delete(key, _) => self.keyspace.delete(&key),
                }
            }
            self.keyspace.snapshot.revision = revision;
        }
        self.allocate().await
    }

    async fn allocate(&mut self) -> Result<(), SessionError> {
        let snapshot = &self.keyspace.snapshot;
        if snapshot.leader() != Some(&self.me) {
            return Ok(());
        }
        for (guards, writes) in rotary_allocator::writes::plan_writes(snapshot, &self.me, false) {
            // A guard that failed: the plan was stale; the watch brings the
            // change and the next step plans again.
            if self.etcd.txn(guards, writes).await?.is_none() {
                break;
            }
        }
        Ok(())
    }

    /// This process's shards: slot (0 primary) and whether it is ready.
    pub fn assigned(&self) -> BTreeMap<String, (u32, bool)> {
        self.keyspace.assigned_to(&self.me)
    }

    /// Marks this process's replica of `shard` ready (recovered as
    /// primary, or tailing as standby) under the shard's current route.
    /// Guarded by the assignment's revision: one that moved meanwhile is
    /// left alone. Returns whether it was written.
    pub async fn mark_ready(&self, shard: &str) -> Result<bool, SessionError> {
        let snap = &self.keyspace.snapshot;
        let current: Vec<&AssignmentKey> = snap.assignments_of(shard).map(|(k, _)| k).collect();
        let Some((mine, a)) = snap
            .assignments_of(shard)
            .find(|(k, _)| k.member == self.me)
        else {
            return Ok(false);
        };
        let route = Route::of(current);
        if a.route.as_ref() == Some(&route) {
            return Ok(true);
        }
        let key = allocator::assignment_key(&self.config.prefix, mine);
        let guard = Guard::ModRevision(key.clone(), a.mod_revision);
        let write = Write::PutKeepLease {
            key,
            value: route.encode(),
        };
        Ok(self.etcd.txn(vec![guard], vec![write]).await?.is_some())
    }

    /// Ends the session: the lease goes, and with it the member key and
    /// every assignment of this process.
    pub async fn close(self) {
        let _ = self.etcd.revoke(self.lease).await;
    }
}

/// Applies shard specs as one guarded transaction: each with the revision
/// it was read at (`Some(0)`: must not exist yet; `None`: not checked).
/// `Ok(None)` when a revision did not hold: nothing was applied.
pub async fn apply_shards(
    etcd: &Etcd,
    prefix: &str,
    specs: &[(ShardSpec, Option<i64>)],
) -> Result<Option<i64>, rotary_etcd::Error> {
    let mut guards = Vec::new();
    let mut writes = Vec::new();
    for (spec, revision) in specs {
        let key = allocator::item_key(prefix, &spec.id);
        if let Some(r) = revision {
            guards.push(Guard::ModRevision(key.clone(), *r));
        }
        let value = serde_json::to_vec(spec).expect("a spec serializes");
        writes.push(Write::Put {
            key,
            value,
            lease: 0,
        });
    }
    etcd.txn(guards, writes).await
}
