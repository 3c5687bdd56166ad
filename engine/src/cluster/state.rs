//! What this broker knows of the cluster's keyspace in etcd: the
//! allocator's [`Snapshot`] (members, items, assignments) and the journals'
//! whole specs, kept current from one range read and the watch after it.
//! Plain data, owned by the control thread; it turns into the
//! [`ClusterView`] the shards route by.

use super::member::Snapshot;
use crate::topology::{Assigned, ClusterView, Member};
use rotary_allocator::{self as allocator, Key};
use rotary_net::spec::JournalSpec;
use std::collections::BTreeMap;
use std::sync::Arc;

pub use rotary_etcd::keyspace::Kv;

/// What one event did to the journal specs, for the spec store.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SpecChange {
    Set(JournalSpec, i64),
    Deleted(String, i64),
}

/// The keyspace as far as the watch has brought it.
#[derive(Clone, Debug)]
pub struct Keyspace {
    pub snapshot: Snapshot,
    /// Each item's whole spec (the snapshot keeps what the allocator reads).
    pub specs: BTreeMap<String, JournalSpec>,
}

impl Keyspace {
    /// An empty keyspace under `prefix` (ending in `/`).
    pub fn new(prefix: &str) -> Keyspace {
        Keyspace {
            snapshot: Snapshot::new(prefix, 0),
            specs: BTreeMap::new(),
        }
    }

    pub fn revision(&self) -> i64 {
        self.snapshot.revision
    }

    /// Takes a put; returns the spec change it makes, if any. A value that
    /// does not parse is logged and treated as absent: etcd's contents are
    /// input, never trusted to be well formed.
    pub fn put(&mut self, kv: &Kv) -> Option<SpecChange> {
        let snapshot = &mut self.snapshot;
        let key = match allocator::parse_key(&snapshot.prefix, &kv.key) {
            Ok(k) => k,
            Err(e) => {
                tracing::debug!(error = %e, "a key rotary does not write; ignored");
                return None;
            }
        };
        let (cr, mr) = (kv.create_revision, kv.mod_revision);
        match key {
            Key::Member(m) => {
                if let Err(e) = snapshot.put_member(&kv.key, &kv.value, cr, mr, kv.lease) {
                    tracing::warn!(error = %e, "a member key holds no member spec; ignored");
                    snapshot.members.remove(&m);
                }
                None
            }
            Key::Assignment(_) => {
                if let Err(e) = snapshot.put_assignment(&kv.key, &kv.value, cr, mr) {
                    tracing::warn!(error = %e, "an assignment holds no route; taken as not synchronized");
                }
                None
            }
            Key::Item(journal) => self.put_item(journal, kv),
        }
    }

    fn put_item(&mut self, journal: String, kv: &Kv) -> Option<SpecChange> {
        match parse_item(&journal, &kv.value) {
            Ok(spec) => {
                let item = allocator::Item {
                    replication: spec.replication,
                    mod_revision: kv.mod_revision,
                };
                self.snapshot.items.insert(journal.clone(), item);
                self.specs.insert(journal, spec.clone());
                Some(SpecChange::Set(spec, kv.mod_revision))
            }
            Err(e) => {
                tracing::warn!(key = %kv.key, error = %e, "an item key holds no valid journal spec; ignored");
                self.snapshot.items.remove(&journal);
                self.specs
                    .remove(&journal)
                    .map(|_| SpecChange::Deleted(journal, kv.mod_revision))
            }
        }
    }

    /// Takes a deletion at `revision`.
    pub fn delete(&mut self, key: &str, revision: i64) -> Option<SpecChange> {
        let parsed = allocator::parse_key(&self.snapshot.prefix, key).ok()?;
        self.snapshot.delete(key).ok()?;
        match parsed {
            Key::Item(journal) => self
                .specs
                .remove(&journal)
                .map(|_| SpecChange::Deleted(journal, revision)),
            Key::Member(_) | Key::Assignment(_) => None,
        }
    }

    /// The view the shards route by: every member, and each journal's
    /// assigned members by slot. Members are named by id alone in routes,
    /// so ids are unique across zones.
    pub fn view(&self, me: &str) -> ClusterView {
        let brokers = self
            .snapshot
            .members
            .iter()
            .filter_map(|(k, m)| {
                let endpoint = m.spec.endpoint.parse().ok().or_else(|| {
                    tracing::warn!(member = %k, endpoint = %m.spec.endpoint, "a member's endpoint is not HOST:PORT; left out");
                    None
                })?;
                Some(Member {
                    id: k.id.clone(),
                    zone: k.zone.clone(),
                    endpoint,
                    shards: Some(m.spec.shards),
                })
            })
            .collect();
        let mut routes: BTreeMap<String, Vec<Option<String>>> = BTreeMap::new();
        let assignments = &self.snapshot.assignments;
        let mut rest = assignments.iter().peekable();
        while let Some((first, _)) = rest.peek() {
            let journal = first.item.clone();
            let sorted = allocator::sound::sort_out(std::iter::from_fn(|| {
                rest.next_if(|(k, _)| k.item == journal)
            }));
            if !sorted.is_sound() {
                tracing::warn!(journal = %journal, dropped = ?sorted.dropped.iter().map(|(k, _)| k.to_string()).collect::<Vec<_>>(), demoted = ?sorted.demoted.iter().map(|(k, _, _)| k.to_string()).collect::<Vec<_>>(), "a journal's assignments name a member twice or two primaries; routing by the sound ones until the allocator repairs them");
            }
            let placed = sorted
                .kept
                .iter()
                .map(|(k, _)| (k.slot, &k.member))
                .chain(sorted.demoted.iter().map(|(k, _, slot)| (*slot, &k.member)));
            let slots = routes.entry(journal.clone()).or_default();
            for (slot, member) in placed {
                let slot = slot as usize;
                if slots.len() <= slot {
                    slots.resize(slot + 1, None);
                }
                assert!(slots[slot].is_none(), "{journal}: slot {slot} placed twice");
                slots[slot] = Some(member.id.clone());
            }
        }
        ClusterView {
            me: me.into(),
            brokers,
            assigned: Some(Arc::new(Assigned {
                revision: self.snapshot.revision,
                routes,
            })),
        }
    }
}

fn parse_item(journal: &str, value: &[u8]) -> Result<JournalSpec, String> {
    let spec: JournalSpec = serde_json::from_slice(value).map_err(|e| e.to_string())?;
    if spec.name != journal {
        return Err(format!("the spec names journal {:?}", spec.name));
    }
    spec.validate().map_err(|e| e.to_string())?;
    Ok(spec)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kv(key: &str, value: &[u8], rev: i64) -> Kv {
        Kv {
            key: key.into(),
            value: value.to_vec(),
            create_revision: rev,
            mod_revision: rev,
            lease: 7,
        }
    }

    #[test]
    fn a_keyspace_turns_into_routes_by_slot() {
        let mut ks = Keyspace::new("/rotary/");
        let member = br#"{"endpoint":"127.0.0.1:7401","shards":2,"journal_limit":10}"#;
        ks.put(&kv("/rotary/members/a#b1", member, 2));
        let member = br#"{"endpoint":"127.0.0.1:7411","shards":2,"journal_limit":10}"#;
        ks.put(&kv("/rotary/members/b#b2", member, 3));
        let spec = br#"{"name":"xx/jj","replication":2}"#;
        let change = ks.put(&kv("/rotary/items/xx/jj", spec, 4));
        assert!(matches!(change, Some(SpecChange::Set(ref s, 4)) if s.name == "xx/jj"));
        ks.put(&kv("/rotary/assign/xx/jj#b#b2#0", b"", 5));
        ks.put(&kv("/rotary/assign/xx/jj#a#b1#1", b"", 5));
        ks.snapshot.revision = 5;
        let view = ks.view("b1");
        let route = view.route("xx/jj", 2);
        assert_eq!(route.ids(), vec!["b2".to_string(), "b1".to_string()]);
        assert!(route.is_complete());
        // The primary's key goes with its lease: no primary, no route.
        ks.delete("/rotary/assign/xx/jj#b#b2#0", 6);
        assert!(ks.view("b1").route("xx/jj", 2).members.is_empty());
        // A spec that names another journal is no spec.
        let change = ks.put(&kv("/rotary/items/xx/jj", br#"{"name":"x/other"}"#, 7));
        assert_eq!(change, Some(SpecChange::Deleted("xx/jj".into(), 7)));
        assert_eq!(ks.delete("/rotary/items/xx/jj", 8), None);
    }
}
