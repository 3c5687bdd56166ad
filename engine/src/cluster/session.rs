//! The loop of the control thread: lease, watch, allocator, requests.
//!
//! Everything here runs on the control thread's current-thread runtime.
//! The loop owns the keyspace; it hands the shards a new view whenever the
//! members or assignments it routes by change, and the spec store every
//! change of the items.

use super::control::{self, ControlError, Request};
use super::fence::Fence;
use super::state::{Keyspace, SpecChange};
use super::{now_ms, EtcdConfig};
use crate::specs::SpecStore;
use crate::topology::{ClusterView, Topology};
use rotary_allocator::{self as allocator, MemberKey};
use rotary_etcd::keyspace::{Etcd, Event, Guard, Watch, Write};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

pub struct Session {
    pub config: EtcdConfig,
    pub shards: u32,
    pub etcd: Etcd,
    pub lease: i64,
    pub keyspace: Keyspace,
    /// The shards' topology, once they listen.
    pub topology: Option<Arc<Topology>>,
    pub specs: Arc<SpecStore>,
    pub fence: Arc<Fence>,
    pub exiting: bool,
    /// SIGTERM was raised (a drained broker stopping by itself).
    pub stopping: bool,
    /// The view last handed to the shards.
    pub handed: Option<ClusterView>,
    /// This broker's assignments (journal → slot and value) as last seen
    /// while its lease surely held: what it holds the bytes of, and
    /// re-creates if it loses its lease.
    pub mine: BTreeMap<String, (u32, Vec<u8>)>,
    /// Assignments still to re-create after a rejoin, and until when
    /// ([`now_ms`]) to keep trying.
    pub recreate: BTreeMap<String, (u32, Vec<u8>)>,
    pub recreate_until_ms: u64,
    /// The revision the allocator's next plan must read at least (its own
    /// last write, or past the revision of a plan whose guard failed), and
    /// until when it waits for the watch to bring it.
    pub allocate_after: (i64, u64),
    /// When this broker last rejoined with a new lease, if it did.
    pub rejoined_ms: Option<u64>,
    /// The keyspace was read again: the watch restarts after it.
    pub rewatch: bool,
}

/// How long after a rejoin a broker keeps trying to re-create its
/// assignments, in lease TTLs.
const RECREATE_TTLS: u32 = 4;

/// How long after a rejoin a leader gives no fresh route to a journal
/// that has no assignment at all, in lease TTLs: the brokers that hold its
/// bytes rejoin (each finds its lease lost at its next keep-alive, a third
/// of a TTL apart) and re-create their assignments first.
const HOLD_BACK_TTLS: u32 = 2;

impl Session {
    /// Connects (retrying for [`super::CONNECT_TIMEOUT`] while the error is
    /// one a retry may cure), takes a lease and reads the keyspace,
    /// mirroring its items into `specs`.
    pub async fn open(
        config: EtcdConfig,
        shards: u32,
        specs: Arc<SpecStore>,
        fence: Arc<Fence>,
    ) -> Result<Session, ControlError> {
        let give_up = now_ms() + super::CONNECT_TIMEOUT.as_millis() as u64;
        let etcd = loop {
            match Etcd::connect(&config.endpoints).await {
                Ok(e) => break e,
                Err(e) if !e.is_retryable() || now_ms() >= give_up => return Err(e.into()),
                Err(e) => {
                    tracing::warn!(error = %e, "etcd is not reachable yet; trying again");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        };
        let sent = now_ms();
        let lease = etcd.grant(config.lease_ttl).await?;
        fence.renewed(sent);
        let prefix = config.key_prefix();
        let (kvs, rev) = etcd.range(&prefix).await?;
        let local: Vec<String> = specs.all().into_iter().map(|s| s.name).collect();
        let (keyspace, changes) = control::keyspace_from(&prefix, &kvs, rev, &local);
        control::apply_spec_changes(&specs, changes);
        tracing::info!(
            lease,
            revision = rev,
            members = keyspace.snapshot.members.len(),
            journals = keyspace.specs.len(),
            "read the cluster from etcd"
        );
        Ok(Session {
            config,
            shards,
            etcd,
            lease,
            keyspace,
            topology: None,
            specs,
            fence,
            exiting: false,
            stopping: false,
            handed: None,
            mine: BTreeMap::new(),
            recreate: BTreeMap::new(),
            recreate_until_ms: 0,
            allocate_after: (0, 0),
            rejoined_ms: None,
            rewatch: false,
        })
    }

    /// Becomes a member (saying so on `announced`), then runs the loop.
    pub async fn announce_and_run(
        mut self,
        topology: Arc<Topology>,
        announced: std::sync::mpsc::SyncSender<Result<(), ControlError>>,
        requests: async_channel::Receiver<Request>,
    ) {
        self.handed = Some(topology.snapshot().as_ref().clone());
        self.topology = Some(topology);
        let result = self.announce().await;
        let failed = result.is_err();
        let _ = announced.send(result);
        if failed {
            let _ = self.etcd.revoke(self.lease).await;
            return;
        }
        self.run(requests).await;
    }

    fn prefix(&self) -> String {
        self.config.key_prefix()
    }

    fn member(&self) -> MemberKey {
        MemberKey {
            zone: self.config.zone.clone(),
            id: self.config.id.clone(),
        }
    }

    fn my_key(&self) -> String {
        allocator::member_key(&self.prefix(), &self.member())
    }

    /// Creates this broker's member key under its lease, waiting (bounded
    /// by twice the TTL) for the key of an earlier run of the same id to
    /// expire with its lease.
    pub async fn announce(&mut self) -> Result<(), ControlError> {
        let spec = control::member_spec(&self.config, self.shards, self.exiting);
        let value = serde_json::to_vec(&spec).expect("json");
        let give_up = now_ms() + 2 * self.config.lease_ttl.as_millis() as u64 + 1_000;
        loop {
            let key = self.my_key();
            let put = Write::Put {
                key: key.clone(),
                value: value.clone(),
                lease: self.lease,
            };
            match self.etcd.txn(vec![Guard::Absent(key)], vec![put]).await {
                Ok(Some(_)) => return Ok(()),
                Ok(None) if now_ms() < give_up => {
                    tracing::info!(id = %self.config.id, "member key of an earlier run still held; waiting for its lease to expire");
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                Ok(None) => {
                    return Err(ControlError::TxnFailed(format!(
                        "member {:?} of zone {:?} is held by another live broker",
                        self.config.id, self.config.zone
                    )))
                }
                Err(e) => return Err(ControlError::Etcd(e)),
            }
        }
    }

    /// Applies one batch of watch events; hands the shards what changed.
    pub fn take_events(&mut self, revision: i64, events: Vec<Event>) {
        let mut specs: Vec<SpecChange> = Vec::new();
        for e in events {
            let change = match e {
                Event::Put(kv) => self.keyspace.put(&kv),
                Event::Delete(key, rev) => self.keyspace.delete(&key, rev),
            };
            specs.extend(change);
        }
        let snapshot = &mut self.keyspace.snapshot;
        snapshot.revision = revision.max(snapshot.revision);
        control::apply_spec_changes(&self.specs, specs);
        self.hand_view();
        self.note_mine();
    }

    /// Notes this broker's assignments, while its lease surely holds: a
    /// deletion seen then was a deliberate one (the allocator moved the
    /// journal), not the lease's end, which leaves `mine` as it was.
    fn note_mine(&mut self) {
        if !self.fence.holds(now_ms()) {
            return;
        }
        let me = self.member();
        self.mine = self
            .keyspace
            .snapshot
            .assignments
            .iter()
            .filter(|(k, _)| k.member == me)
            .map(|(k, a)| {
                let value = a.route.as_ref().map(|r| r.encode()).unwrap_or_default();
                (k.item.clone(), (k.slot, value))
            })
            .collect();
    }

    /// The view for the shards: etcd's, less the journals of replication 1
    /// this broker leads while its lease may have expired (see `fence`).
    pub fn hand_view(&mut self) {
        let mut view = self.keyspace.view(&self.config.id);
        if !self.fence.holds(now_ms()) {
            fence_solo_primaries(&mut view);
        }
        if self.handed.as_ref() != Some(&view) {
            if let Some(t) = &self.topology {
                t.set(view.clone());
            }
            self.handed = Some(view);
        }
    }

    /// One keep-alive; false if the lease is gone (expired or revoked).
    pub async fn keep_alive(&mut self) -> Result<bool, rotary_etcd::Error> {
        let sent = now_ms();
        match self.etcd.keep_alive(self.lease).await? {
            Some(_) => {
                self.fence.renewed(sent);
                Ok(true)
            }
            None => Ok(false),
        }
    }

    /// After the lease was lost: a new lease, the member key again, and
    /// the assignments this broker held re-created under the new lease
    /// where that keeps them sound (see [`Session::recreate_own`]).
    ///
    /// Every assignment of the old lease went with it. When every broker
    /// lost its lease at once (etcd paused or down past the TTL), nobody
    /// else knows who holds each journal's bytes: each broker puts its own
    /// assignments back, so that the journals' routes come back with the
    /// brokers that hold their bytes, rather than fresh routes of brokers
    /// holding nothing.
    pub async fn rejoin(&mut self) -> Result<(), ControlError> {
        self.fence.reset();
        self.hand_view();
        let sent = now_ms();
        self.lease = self
            .etcd
            .grant(self.config.lease_ttl)
            .await
            .map_err(ControlError::Etcd)?;
        self.fence.renewed(sent);
        let ttl_ms = self.config.lease_ttl.as_millis() as u64;
        for (journal, held) in std::mem::take(&mut self.mine) {
            self.recreate.entry(journal).or_insert(held);
        }
        self.recreate_until_ms = now_ms() + u64::from(RECREATE_TTLS) * ttl_ms;
        self.rejoined_ms = Some(now_ms());
        tracing::warn!(
            lease = self.lease,
            assignments = self.recreate.len(),
            "the broker's lease was lost; re-creating its assignments and rejoining"
        );
        // The keys of the old lease are gone by now: read what stands.
        if self.reload().await {
            self.rewatch = true;
        }
        self.announce().await?;
        self.recreate_own().await;
        Ok(())
    }

    /// Re-creates, under the current lease, the assignments this broker
    /// held before it lost its lease ([`Session::recreate`]), each in a
    /// transaction that holds only if none of the journal's assignments
    /// changed since the revision the decision read
    /// ([`allocator::sound::place_again`]: its old slot if free, never a
    /// second primary, else the lowest free replica slot). One that fails
    /// is tried again once the watch moved; given up after a while.
    pub async fn recreate_own(&mut self) {
        if self.recreate.is_empty() {
            return;
        }
        if now_ms() >= self.recreate_until_ms {
            let left: Vec<&String> = self.recreate.keys().collect();
            tracing::warn!(?left, "gave up re-creating assignments lost with the lease; the allocator assigns those journals");
            self.recreate.clear();
            return;
        }
        let me = self.member();
        let prefix = self.prefix();
        let snapshot = &self.keyspace.snapshot;
        let mut writes = Vec::new();
        let mut settled = Vec::new();
        for (journal, (slot, value)) in &self.recreate {
            match allocator::sound::place_again(snapshot, journal, &me, *slot) {
                None => settled.push(journal.clone()),
                Some(at) => {
                    let key = allocator::AssignmentKey::new(journal, me.clone(), at)
                        .expect("a key of the keyspace");
                    writes.push((journal.clone(), key, value.clone()));
                }
            }
        }
        let revision = snapshot.revision;
        for j in settled {
            self.recreate.remove(&j);
        }
        for (journal, key, value) in writes {
            let text = allocator::assignment_key(&prefix, &key);
            let guards = vec![
                Guard::UnchangedSince(
                    allocator::keys::item_assignments_prefix(&prefix, &journal),
                    revision,
                ),
                Guard::Absent(text.clone()),
                Guard::Present(allocator::item_key(&prefix, &journal)),
            ];
            let put = Write::Put {
                key: text,
                value,
                lease: self.lease,
            };
            match self.etcd.txn(guards, vec![put]).await {
                Ok(Some(_)) => {
                    tracing::info!(assignment = %key, "re-created an assignment lost with the lease");
                    self.recreate.remove(&journal);
                }
                Ok(None) => {
                    tracing::debug!(assignment = %key, "the journal's assignments changed; re-creating later");
                }
                Err(e) => {
                    tracing::warn!(error = %e, "could not re-create an assignment");
                    return;
                }
            }
        }
    }

    /// Carries out one request from a shard.
    pub async fn serve(&mut self, req: Request) {
        match req {
            Request::Apply { specs, reply } => {
                let _ = reply.send(self.apply(specs).await).await;
            }
            Request::Delete {
                name,
                expect,
                reply,
            } => {
                let _ = reply.send(self.delete(name, expect).await).await;
            }
            Request::Drain { reply } => {
                self.exiting = true;
                let spec = control::member_spec(&self.config, self.shards, true);
                let put = Write::Put {
                    key: self.my_key(),
                    value: serde_json::to_vec(&spec).expect("json"),
                    lease: self.lease,
                };
                let r = self.etcd.txn(Vec::new(), vec![put]).await;
                let _ = reply
                    .send(r.map_err(ControlError::Etcd).map(|r| r.unwrap_or(0)))
                    .await;
            }
            Request::Holding { reply } => {
                let me = self.member();
                let n = self
                    .keyspace
                    .snapshot
                    .assignments
                    .keys()
                    .filter(|a| a.member == me)
                    .count();
                let _ = reply.send(Ok(n)).await;
            }
            Request::Members { reply } => {
                let _ = reply.send(Ok(self.members())).await;
            }
            Request::DrainMember { id, reply } => {
                let _ = reply.send(self.drain_member(&id).await).await;
            }
            Request::Synced { journal, route } => self.record_route(&journal, route).await,
        }
    }

    async fn apply(
        &mut self,
        specs: Vec<(rotary_net::spec::JournalSpec, Option<i64>)>,
    ) -> Result<i64, ControlError> {
        let prefix = self.prefix();
        let mut guards = Vec::new();
        let mut writes = Vec::new();
        for (spec, expect) in specs {
            let key = allocator::item_key(&prefix, &spec.name);
            match expect {
                Some(0) => guards.push(Guard::Absent(key.clone())),
                Some(r) => guards.push(Guard::ModRevision(key.clone(), r)),
                None => {}
            }
            writes.push(Write::Put {
                key,
                value: serde_json::to_vec(&spec).expect("json"),
                lease: 0,
            });
        }
        self.write_guarded(guards, writes, "a spec's revision is not the one given")
            .await
    }

    async fn delete(&mut self, name: String, expect: Option<i64>) -> Result<i64, ControlError> {
        let key = allocator::item_key(&self.prefix(), &name);
        let guards = match expect {
            Some(r) => vec![Guard::ModRevision(key.clone(), r)],
            None => vec![Guard::Present(key.clone())],
        };
        self.write_guarded(
            guards,
            vec![Write::Delete { key }],
            "the journal's revision is not the one given, or it does not exist",
        )
        .await
    }

    /// A guarded write, then waits until the watch brought this broker to
    /// its revision, so that the reply's reader finds the change here.
    async fn write_guarded(
        &mut self,
        guards: Vec<Guard>,
        writes: Vec<Write>,
        refused: &str,
    ) -> Result<i64, ControlError> {
        match self.etcd.txn(guards, writes).await {
            Ok(Some(rev)) => Ok(rev),
            Ok(None) => Err(ControlError::TxnFailed(refused.into())),
            Err(e) => Err(ControlError::Etcd(e)),
        }
    }

    /// Every member with the journals and primaries it holds.
    fn members(&self) -> Vec<control::MemberInfo> {
        let snapshot = &self.keyspace.snapshot;
        let mut held: std::collections::HashMap<&MemberKey, (usize, usize)> = Default::default();
        for a in snapshot.assignments.keys() {
            let h = held.entry(&a.member).or_default();
            h.0 += 1;
            h.1 += usize::from(a.slot == 0);
        }
        snapshot
            .members
            .iter()
            .map(|(k, m)| {
                let (journals, primaries) = held.get(k).copied().unwrap_or_default();
                control::MemberInfo {
                    id: k.id.clone(),
                    zone: k.zone.clone(),
                    endpoint: m.spec.endpoint.clone(),
                    journal_limit: m.spec.journal_limit,
                    journals,
                    primaries,
                    exiting: m.spec.exiting,
                }
            })
            .collect()
    }

    /// Marks member `id` exiting: its key keeps its lease (its broker's)
    /// and is written only if unchanged since this broker read it.
    async fn drain_member(&mut self, id: &str) -> Result<i64, ControlError> {
        let snapshot = &self.keyspace.snapshot;
        let Some((key, member)) = snapshot.members.iter().find(|(k, _)| k.id == id) else {
            return Err(ControlError::NotFound(format!(
                "no broker {id:?} is a member"
            )));
        };
        let mut spec = member.spec.clone();
        spec.exiting = true;
        let key_text = allocator::member_key(&snapshot.prefix, key);
        let guards = vec![Guard::ModRevision(key_text.clone(), member.mod_revision)];
        let write = Write::PutKeepLease {
            key: key_text,
            value: serde_json::to_vec(&spec).expect("json"),
        };
        self.write_guarded(
            guards,
            vec![write],
            "the member changed meanwhile; try again",
        )
        .await
    }

    /// A broker drained by an operator (its member key marked exiting by
    /// anyone) stops once the allocator moved every journal away from it:
    /// it signals itself SIGTERM, and the broker stops as on any SIGTERM.
    fn stop_when_drained(&mut self) {
        let me = self.member();
        let snapshot = &self.keyspace.snapshot;
        let marked = snapshot.members.get(&me).is_some_and(|m| m.spec.exiting);
        if !marked || self.stopping {
            return;
        }
        if !self.exiting {
            tracing::info!("this broker was marked exiting; its journals move to other brokers");
            self.exiting = true;
        }
        if snapshot.assignments.keys().all(|a| a.member != me) {
            tracing::info!("this broker holds no journal any more; stopping");
            self.stopping = true;
            let _ = signal_hook::low_level::raise(signal_hook::consts::SIGTERM);
        }
    }

    /// Records in each assignment of `journal` the route its primary
    /// synchronized (`route`, member ids primary first), if that is still
    /// the route the assignments give and an assignment lacks it. Each put
    /// keeps the assignment's lease (the assigned broker's) and is guarded
    /// by the assignment's revision: one that moved meanwhile is left alone.
    async fn record_route(&mut self, journal: &str, route: Vec<String>) {
        let prefix = self.prefix();
        let current: Vec<(allocator::AssignmentKey, allocator::Assignment)> = self
            .keyspace
            .snapshot
            .assignments_of(journal)
            .map(|(k, a)| (k.clone(), a.clone()))
            .collect();
        let mut by_slot: Vec<&allocator::AssignmentKey> = current.iter().map(|(k, _)| k).collect();
        by_slot.sort_by_key(|k| k.slot);
        let ids: Vec<&str> = by_slot.iter().map(|k| k.member.id.as_str()).collect();
        if ids != route || by_slot.first().is_none_or(|k| k.slot != 0) {
            return;
        }
        let implied = allocator::Route::of(current.iter().map(|(k, _)| k));
        let value = implied.encode();
        let mut guards = Vec::new();
        let mut writes = Vec::new();
        for (k, a) in current
            .iter()
            .filter(|(_, a)| a.route.as_ref() != Some(&implied))
        {
            let key = allocator::assignment_key(&prefix, k);
            guards.push(Guard::ModRevision(key.clone(), a.mod_revision));
            writes.push(Write::PutKeepLease {
                key,
                value: value.clone(),
            });
        }
        if writes.is_empty() {
            return;
        }
        if let Err(e) = self.etcd.txn(guards, writes).await {
            tracing::warn!(journal, error = %e, "could not record a synchronized route");
        }
    }
}

/// Empties the routes of journals with a single assignment, this broker's
/// own: nobody else would refuse this broker's appends to them.
pub fn fence_solo_primaries(view: &mut ClusterView) {
    let Some(assigned) = &view.assigned else {
        return;
    };
    let me = view.me.clone();
    let mut fenced = (**assigned).clone();
    fenced.routes.retain(|_, slots| {
        let held: Vec<&String> = slots.iter().flatten().collect();
        !(held.len() == 1 && *held[0] == me)
    });
    view.assigned = Some(Arc::new(fenced));
}

/// What woke the loop.
enum Wake {
    Events(Result<(i64, Vec<Event>), rotary_etcd::Error>),
    Request(Option<Request>),
    Tick,
}

impl Session {
    /// The control thread's loop, until the requests channel closes (the
    /// broker stops) — then the lease is revoked, so the broker's member
    /// key and assignments go at once rather than a TTL later.
    pub async fn run(mut self, requests: async_channel::Receiver<Request>) {
        let tick = (self.config.lease_ttl / 3).min(Duration::from_secs(1));
        let mut watch = self.watch_events(self.keyspace.revision() + 1).await;
        let mut next_keep_alive = now_ms();
        loop {
            if now_ms() >= next_keep_alive {
                next_keep_alive = now_ms() + (self.config.lease_ttl / 3).as_millis() as u64;
                self.renew().await;
                // The fence may have moved either way.
                self.hand_view();
                // A rejoin read the keyspace again: events of the old
                // watch would take it back.
                if std::mem::take(&mut self.rewatch) {
                    watch = self.watch_events(self.keyspace.revision() + 1).await;
                }
            }
            let wake = tokio::select! {
                e = watch.recv() => Wake::Events(
                    e.unwrap_or(Err(rotary_etcd::Error::StreamClosed { op: "watch" })),
                ),
                r = requests.recv() => Wake::Request(r.ok()),
                _ = tokio::time::sleep(tick) => Wake::Tick,
            };
            match wake {
                Wake::Events(Ok((rev, events))) => {
                    self.take_events(rev, events);
                    self.recreate_own().await;
                    self.allocate().await;
                    self.stop_when_drained();
                }
                Wake::Events(Err(e)) => {
                    tracing::warn!(error = %e, "the etcd watch broke; reading the keyspace again");
                    tokio::time::sleep(control::RETRY_PAUSE).await;
                    if self.reload().await {
                        watch = self.watch_events(self.keyspace.revision() + 1).await;
                    }
                }
                Wake::Request(Some(req)) => self.serve(req).await,
                Wake::Request(None) => break,
                Wake::Tick => {
                    self.recreate_own().await;
                    self.allocate().await;
                }
            }
        }
        let _ = self.etcd.revoke(self.lease).await;
    }

    async fn renew(&mut self) {
        match self.keep_alive().await {
            Ok(true) => {}
            Ok(false) => {
                if let Err(e) = self.rejoin().await {
                    tracing::error!(error = %e, "could not rejoin the cluster; trying again");
                }
            }
            // etcd unreachable: keep routing by the last view; the fence
            // closes on its own if this lasts.
            Err(e) => tracing::warn!(error = %e, "could not renew the broker's lease"),
        }
    }

    /// The watch's batches, from a task of their own: a reopening watch
    /// waits (backing off) inside `next`, and the loop's tick would drop
    /// that wait, again and again, before it ever reopened. The task ends
    /// after the first error, or when the receiver is dropped.
    async fn watch_events(
        &mut self,
        revision: i64,
    ) -> tokio::sync::mpsc::Receiver<Result<(i64, Vec<Event>), rotary_etcd::Error>> {
        let mut watch = self.watch_from(revision).await;
        let (tx, rx) = tokio::sync::mpsc::channel(1);
        tokio::spawn(async move {
            loop {
                let batch = watch.next().await;
                let failed = batch.is_err();
                if tx.send(batch).await.is_err() || failed {
                    return;
                }
            }
        });
        rx
    }

    async fn watch_from(&mut self, revision: i64) -> Watch {
        loop {
            match self.etcd.watch(&self.prefix(), revision).await {
                Ok(w) => return w,
                Err(e) => {
                    tracing::warn!(error = %e, "could not watch etcd; trying again");
                    tokio::time::sleep(control::RETRY_PAUSE).await;
                }
            }
        }
    }

    /// Reads the whole keyspace again (after a broken or compacted watch).
    async fn reload(&mut self) -> bool {
        match self.etcd.range(&self.prefix()).await {
            Ok((kvs, rev)) => {
                let local: Vec<String> = self.specs.all().into_iter().map(|s| s.name).collect();
                let (ks, changes) = control::keyspace_from(&self.prefix(), &kvs, rev, &local);
                self.keyspace = ks;
                control::apply_spec_changes(&self.specs, changes);
                self.hand_view();
                self.note_mine();
                true
            }
            Err(e) => {
                tracing::warn!(error = %e, "could not read the keyspace");
                false
            }
        }
    }

    /// While this broker leads: the allocator's changes, written in guarded
    /// batches. A batch whose guard fails was computed from a keyspace that
    /// has moved on; the watch brings the news and the next round replans.
    ///
    /// It plans again only once the watch brought the keyspace to its own
    /// last write (or past the plan a guard refused): a plan from a
    /// keyspace that lacks the allocator's own last changes would make them
    /// again, elsewhere. The guards would refuse it; waiting saves the
    /// round. After a lease TTL without the watch, it plans anyway.
    async fn allocate(&mut self) {
        let leads = self.keyspace.snapshot.leader() == Some(&self.member());
        if !leads {
            return;
        }
        let (after, until) = self.allocate_after;
        if self.keyspace.revision() < after && now_ms() < until {
            return;
        }
        let ttl_ms = self.config.lease_ttl.as_millis() as u64;
        let hold_back = self
            .rejoined_ms
            .is_some_and(|at| now_ms() < at + u64::from(HOLD_BACK_TTLS) * ttl_ms);
        let batches = rotary_allocator::writes::plan_writes(
            &self.keyspace.snapshot,
            &self.member(),
            hold_back,
        );
        let wait_until = now_ms() + ttl_ms;
        for (guards, writes) in batches {
            match self.etcd.txn(guards, writes).await {
                Ok(Some(rev)) => self.allocate_after = (rev, wait_until),
                Ok(None) => {
                    self.allocate_after = (self.keyspace.revision() + 1, wait_until);
                    return;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "the allocator could not write its changes");
                    return;
                }
            }
        }
    }
}
