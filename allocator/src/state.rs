//! What the allocator reads (a [`Snapshot`] of the key space at one etcd
//! revision) and what it writes ([`Change`]s, each with the guards that
//! make it an etcd transaction valid only against the state it was
//! computed from).

use super::keys::{self, AssignmentKey, Key, KeyError, MemberKey};
use std::collections::BTreeMap;
use std::fmt;

/// What the allocator reads of a member key's value (a broker's spec, a
/// consumer process's spec): how many items the member may hold, and
/// whether it is leaving. Each kind of member decodes its own JSON.
pub trait MemberValue: Clone + fmt::Debug + PartialEq + serde::de::DeserializeOwned {
    /// Most items the member holds (primaries and replicas together).
    fn limit(&self) -> u32;
    /// Set when the member is leaving: it is given nothing new and its
    /// items move away, replacements first.
    fn exiting(&self) -> bool;
    /// Items the allocator may give the member: none once it is exiting.
    fn capacity(&self) -> u32 {
        if self.exiting() {
            0
        } else {
            self.limit()
        }
    }
}

/// A member key as read from etcd.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member<M> {
    pub spec: M,
    pub create_revision: i64,
    pub mod_revision: i64,
    /// The etcd lease the member holds; its assignments are written under it.
    pub lease: i64,
}

/// The part of an item's spec the allocator reads.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Item {
    /// Copies the item wants: a primary and `replication - 1` replicas.
    pub replication: u32,
    pub mod_revision: i64,
}

/// The route of an item as its assignments imply it: the member of slot
/// 0 (if any) and every assigned member, sorted. Replica slots are not
/// part of it, so that packing slots does not change a route.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Route {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub primary: Option<MemberKey>,
    pub members: Vec<MemberKey>,
}

/// Route values that cannot be decoded.
#[derive(Debug, thiserror::Error)]
#[error("route value {value:?} does not decode: {error}")]
pub struct RouteError {
    value: String,
    error: serde_json::Error,
}

impl Route {
    /// The route `assignments` (one item's) imply.
    pub fn of<'a>(assignments: impl IntoIterator<Item = &'a AssignmentKey>) -> Route {
        let mut r = Route::default();
        for a in assignments {
            if a.slot == 0 && r.primary.is_none() {
                r.primary = Some(a.member.clone());
            }
            r.members.push(a.member.clone());
        }
        r.members.sort();
        r.members.dedup();
        r
    }

    /// The value a primary writes into its item's assignments once it
    /// synchronized the route: JSON, `{"primary":"zone#id","members":[…]}`.
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a route serializes")
    }

    /// An assignment's value. Empty (a fresh assignment nobody synchronized
    /// yet) is `None`.
    pub fn decode(value: &[u8]) -> Result<Option<Route>, RouteError> {
        if value.is_empty() {
            return Ok(None);
        }
        serde_json::from_slice(value)
            .map(Some)
            .map_err(|error| RouteError {
                value: String::from_utf8_lossy(value).into_owned(),
                error,
            })
    }

    /// Whether `member` is part of the route.
    pub fn contains(&self, member: &MemberKey) -> bool {
        self.members.binary_search(member).is_ok()
    }
}

/// An assignment key's value and revisions.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Assignment {
    /// The route the item's primary wrote when it last synchronized the
    /// route with this member; `None` while nobody has (or if the value did
    /// not decode: such an assignment is never consistent).
    pub route: Option<Route>,
    pub create_revision: i64,
    pub mod_revision: i64,
}

/// The allocator's key space at one etcd revision.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Snapshot<M> {
    /// The key prefix (e.g. `/rotary`).
    pub prefix: String,
    /// The etcd revision the snapshot was read at.
    pub revision: i64,
    pub members: BTreeMap<MemberKey, Member<M>>,
    pub items: BTreeMap<String, Item>,
    pub assignments: BTreeMap<AssignmentKey, Assignment>,
}

/// Whether assignment `a` is consistent: its value names the route that
/// the item's current assignments (`current`, which include `a`) imply,
/// i.e. the primary synchronized exactly this route with it. Gazette's
/// definition, read per assignment.
pub fn consistent<'a>(
    a: &Assignment,
    current: impl IntoIterator<Item = &'a AssignmentKey> + Clone,
) -> bool {
    match &a.route {
        None => false,
        Some(route) => route_matches(route, current),
    }
}

/// Whether `route` is the route `current` implies, without building it.
pub(crate) fn route_matches<'a>(
    route: &Route,
    current: impl IntoIterator<Item = &'a AssignmentKey> + Clone,
) -> bool {
    let mut primary = None;
    let mut n = 0;
    for a in current.clone() {
        if a.slot == 0 && primary.is_none() {
            primary = Some(&a.member);
        }
        if !route.contains(&a.member) {
            return false;
        }
        n += 1;
    }
    if primary != route.primary.as_ref() {
        return false;
    }
    if n == route.members.len() {
        return true;
    }
    // Fewer distinct members than assignments (a member twice): compare sets.
    let mut ms: Vec<&MemberKey> = current.into_iter().map(|a| &a.member).collect();
    ms.sort();
    ms.dedup();
    ms.len() == route.members.len()
}

impl<M: MemberValue> Snapshot<M> {
    /// An empty key space under `prefix` at `revision`.
    pub fn new(prefix: &str, revision: i64) -> Snapshot<M> {
        Snapshot {
            prefix: keys::normalize_prefix(prefix).to_string(),
            revision,
            members: BTreeMap::new(),
            items: BTreeMap::new(),
            assignments: BTreeMap::new(),
        }
    }

    /// The allocator's leader: the member with the lowest create revision
    /// (the longest-standing one); ties, which etcd never makes, go to the
    /// lower key.
    pub fn leader(&self) -> Option<&MemberKey> {
        self.members
            .iter()
            .min_by_key(|(k, m)| (m.create_revision, *k))
            .map(|(k, _)| k)
    }

    /// The compare every transaction of the leader carries: its own member
    /// key unchanged, so that a leader that lost its lease (or changed its
    /// spec) writes nothing more.
    pub fn leader_guard(&self) -> Option<Guard> {
        let leader = self.leader()?;
        Some(Guard {
            key: GuardKey::Member(leader.clone()),
            mod_revision: self.members[leader].mod_revision,
        })
    }

    /// Records a member key read from etcd (a range read or a watch put).
    pub fn put_member(
        &mut self,
        key: &str,
        value: &[u8],
        create_revision: i64,
        mod_revision: i64,
        lease: i64,
    ) -> Result<MemberKey, KvError> {
        let Key::Member(member) = keys::parse_key(&self.prefix, key)? else {
            return Err(KvError::wrong_kind(key, "a member"));
        };
        let spec: M = serde_json::from_slice(value).map_err(|error| KvError::MemberSpec {
            key: key.to_string(),
            error,
        })?;
        self.members.insert(
            member.clone(),
            Member {
                spec,
                create_revision,
                mod_revision,
                lease,
            },
        );
        Ok(member)
    }

    /// Records an assignment key read from etcd. A value that does not
    /// decode is recorded as no route (never consistent: the assignment
    /// still holds its member's place) and reported.
    pub fn put_assignment(
        &mut self,
        key: &str,
        value: &[u8],
        create_revision: i64,
        mod_revision: i64,
    ) -> Result<AssignmentKey, KvError> {
        let Key::Assignment(a) = keys::parse_key(&self.prefix, key)? else {
            return Err(KvError::wrong_kind(key, "an assignment"));
        };
        let (route, bad) = match Route::decode(value) {
            Ok(route) => (route, None),
            Err(e) => (None, Some(e)),
        };
        self.assignments.insert(
            a.clone(),
            Assignment {
                route,
                create_revision,
                mod_revision,
            },
        );
        match bad {
            None => Ok(a),
            Some(e) => Err(KvError::Route(e)),
        }
    }

    /// Forgets a key etcd deleted (a watch delete, a lease expiry).
    pub fn delete(&mut self, key: &str) -> Result<(), KeyError> {
        match keys::parse_key(&self.prefix, key)? {
            Key::Item(j) => {
                self.items.remove(&j);
            }
            Key::Member(m) => {
                self.members.remove(&m);
            }
            Key::Assignment(a) => {
                self.assignments.remove(&a);
            }
        }
        Ok(())
    }

    /// How many assignments a member holds (primaries and replicas).
    pub fn held_by(&self, member: &MemberKey) -> usize {
        let held = self.assignments.keys();
        held.filter(|k| &k.member == member).count()
    }

    /// One item's assignments, in key order.
    pub fn assignments_of<'a>(
        &'a self,
        item: &'a str,
    ) -> impl Iterator<Item = (&'a AssignmentKey, &'a Assignment)> + Clone + 'a {
        let from = AssignmentKey {
            item: item.to_string(),
            member: MemberKey::default(),
            slot: 0,
        };
        self.assignments
            .range(from..)
            .take_while(move |(k, _)| k.item == item)
    }

    /// Applies one etcd transaction: every guard holds, then every change
    /// lands, at the next revision; or nothing changes.
    pub fn apply_txn(&mut self, changes: &[Change]) -> Result<i64, TxnFailed> {
        for c in changes {
            for g in c.guards() {
                let now = self.mod_revision_of(&g.key);
                if !self.holds(&g) {
                    return Err(TxnFailed {
                        key: self.key_string(&g.key),
                        expected: g.mod_revision,
                        found: now,
                    });
                }
            }
        }
        let rev = self.revision + 1;
        for c in changes {
            match c {
                Change::Add { key, .. } => {
                    self.assignments.insert(
                        key.clone(),
                        Assignment {
                            route: None,
                            create_revision: rev,
                            mod_revision: rev,
                        },
                    );
                }
                Change::Remove { key, .. } => {
                    self.assignments.remove(key);
                }
                Change::Reslot { from, to_slot, .. } => {
                    let a = self
                        .assignments
                        .remove(from)
                        .expect("the guard checked the assignment exists");
                    self.assignments.insert(
                        from.with_slot(*to_slot),
                        Assignment {
                            route: a.route,
                            create_revision: rev,
                            mod_revision: rev,
                        },
                    );
                }
            }
        }
        self.revision = rev;
        Ok(rev)
    }

    fn mod_revision_of(&self, key: &GuardKey) -> i64 {
        match key {
            GuardKey::Item(j) => self.items.get(j).map_or(0, |i| i.mod_revision),
            GuardKey::Member(m) => self.members.get(m).map_or(0, |m| m.mod_revision),
            GuardKey::Assignment(a) => self.assignments.get(a).map_or(0, |a| a.mod_revision),
            GuardKey::Assignments(j) => self
                .assignments_of(j)
                .map(|(_, a)| a.mod_revision)
                .max()
                .unwrap_or(0),
        }
    }

    /// Whether guard `g` holds against this key space.
    pub fn holds(&self, g: &Guard) -> bool {
        let now = self.mod_revision_of(&g.key);
        match g.key {
            GuardKey::Assignments(_) => now <= g.mod_revision,
            _ => now == g.mod_revision,
        }
    }

    fn key_string(&self, key: &GuardKey) -> String {
        key.to_key(&self.prefix)
    }
}

/// A key-value from etcd that does not belong in a snapshot as given.
#[derive(Debug, thiserror::Error)]
pub enum KvError {
    #[error(transparent)]
    Key(#[from] KeyError),
    #[error("{key} is not {want} key")]
    WrongKind { key: String, want: &'static str },
    #[error("member {key}: the spec does not decode: {error}")]
    MemberSpec {
        key: String,
        error: serde_json::Error,
    },
    #[error(transparent)]
    Route(#[from] RouteError),
}

impl KvError {
    /// `want` with its article: "a member", "an assignment".
    fn wrong_kind(key: &str, want: &'static str) -> KvError {
        let key = key.to_string();
        KvError::WrongKind { key, want }
    }
}

/// A transaction whose guard did not hold.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("transaction failed: {key} is at mod revision {found}, not {expected}")]
pub struct TxnFailed {
    pub key: String,
    pub expected: i64,
    pub found: i64,
}

/// Applies `changes` to a copy of `snapshot` as one transaction and returns
/// the key space that results (what etcd would hold after it).
pub fn apply<M: MemberValue>(
    snapshot: &Snapshot<M>,
    changes: &[Change],
) -> Result<Snapshot<M>, TxnFailed> {
    let mut next = snapshot.clone();
    next.apply_txn(changes)?;
    Ok(next)
}

/// A key a guard compares.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GuardKey {
    Item(String),
    Member(MemberKey),
    Assignment(AssignmentKey),
    /// Every assignment key of an item (the range of its prefix).
    Assignments(String),
}

impl GuardKey {
    /// The etcd key under `prefix` (for [`GuardKey::Assignments`], the
    /// prefix of the item's assignment keys).
    pub fn to_key(&self, prefix: &str) -> String {
        match self {
            GuardKey::Item(j) => keys::item_key(prefix, j),
            GuardKey::Member(m) => keys::member_key(prefix, m),
            GuardKey::Assignment(a) => keys::assignment_key(prefix, a),
            GuardKey::Assignments(j) => keys::item_assignments_prefix(prefix, j),
        }
    }
}

/// An etcd compare: the key's mod revision equals `mod_revision`; 0 means
/// the key must not exist. For [`GuardKey::Assignments`]: no assignment of
/// the item has a mod revision above `mod_revision` (the revision the
/// decision read), so none was created or changed since: a write that
/// creates an assignment carries it, and lands only on the assignments
/// its decision saw (which it found sound and left sound).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Guard {
    pub key: GuardKey,
    pub mod_revision: i64,
}

/// An etcd operation of a change.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Op {
    /// Put `value` at `key` under `lease` (the assigned member's).
    Put {
        key: String,
        value: Vec<u8>,
        lease: i64,
    },
    Delete {
        key: String,
    },
}

/// One change the allocator asks for. All the changes of one item form
/// one transaction (see [`transactions`]): its guards are the revisions the
/// plan read, so a plan made stale by any concurrent write fails whole.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Change {
    /// Assign the item to a member at a slot, with an empty value, under
    /// the member's lease. Guards: the member unchanged (its limit or
    /// exiting flag may have changed) and the key absent.
    Add {
        key: AssignmentKey,
        member_mod_revision: i64,
        lease: i64,
        /// The revision the plan read: none of the item's assignments
        /// may have changed since.
        read_revision: i64,
    },
    /// Remove an assignment. Guards: the assignment unchanged, the
    /// item's spec unchanged (its replication may have grown; for a
    /// deleted item `item_mod_revision` is 0: still deleted), and the
    /// assignments it leaves in place unchanged.
    Remove {
        key: AssignmentKey,
        mod_revision: i64,
        item_mod_revision: i64,
        /// The item's assignments that stay, at their mod revisions: the
        /// removal counted on their copies, so a concurrent loss of one (its
        /// broker's lease expired) fails it.
        keep: Vec<(AssignmentKey, i64)>,
    },
    /// Move an assignment to another slot, value and lease kept: slot 0
    /// promotes it to primary; a lower slot packs the replicas. Guards: the
    /// assignment unchanged and the new key absent.
    Reslot {
        from: AssignmentKey,
        to_slot: u32,
        mod_revision: i64,
        value: Vec<u8>,
        lease: i64,
        /// As [`Change::Add`]'s.
        read_revision: i64,
    },
}

impl Change {
    /// The item the change is about.
    pub fn item(&self) -> &str {
        match self {
            Change::Add { key, .. } | Change::Remove { key, .. } => &key.item,
            Change::Reslot { from, .. } => &from.item,
        }
    }

    /// The compares of its transaction.
    pub fn guards(&self) -> Vec<Guard> {
        match self {
            Change::Add {
                key,
                member_mod_revision,
                read_revision,
                ..
            } => vec![
                Guard {
                    key: GuardKey::Member(key.member.clone()),
                    mod_revision: *member_mod_revision,
                },
                Guard {
                    key: GuardKey::Assignment(key.clone()),
                    mod_revision: 0,
                },
                Guard {
                    key: GuardKey::Assignments(key.item.clone()),
                    mod_revision: *read_revision,
                },
            ],
            Change::Remove {
                key,
                mod_revision,
                item_mod_revision,
                keep,
            } => {
                let mut g = vec![
                    Guard {
                        key: GuardKey::Item(key.item.clone()),
                        mod_revision: *item_mod_revision,
                    },
                    Guard {
                        key: GuardKey::Assignment(key.clone()),
                        mod_revision: *mod_revision,
                    },
                ];
                g.extend(keep.iter().map(|(k, rev)| Guard {
                    key: GuardKey::Assignment(k.clone()),
                    mod_revision: *rev,
                }));
                g
            }
            Change::Reslot {
                from,
                to_slot,
                mod_revision,
                read_revision,
                ..
            } => vec![
                Guard {
                    key: GuardKey::Assignment(from.clone()),
                    mod_revision: *mod_revision,
                },
                Guard {
                    key: GuardKey::Assignment(from.with_slot(*to_slot)),
                    mod_revision: 0,
                },
                Guard {
                    key: GuardKey::Assignments(from.item.clone()),
                    mod_revision: *read_revision,
                },
            ],
        }
    }

    /// The operations of its transaction, with keys under `prefix`.
    pub fn ops(&self, prefix: &str) -> Vec<Op> {
        match self {
            Change::Add { key, lease, .. } => vec![Op::Put {
                key: keys::assignment_key(prefix, key),
                value: Vec::new(),
                lease: *lease,
            }],
            Change::Remove { key, .. } => vec![Op::Delete {
                key: keys::assignment_key(prefix, key),
            }],
            Change::Reslot {
                from,
                to_slot,
                value,
                lease,
                ..
            } => vec![
                Op::Delete {
                    key: keys::assignment_key(prefix, from),
                },
                Op::Put {
                    key: keys::assignment_key(prefix, &from.with_slot(*to_slot)),
                    value: value.clone(),
                    lease: *lease,
                },
            ],
        }
    }
}

/// Most compares or operations in one etcd transaction (etcd's default
/// `--max-txn-ops`).
pub const TXN_OPS_MAX: usize = 128;

/// Groups `changes` (as [`plan`](super::plan) orders them: by item)
/// into transactions of at most `ops_max` compares and at most `ops_max`
/// operations, never splitting one item's changes; an item whose
/// changes alone exceed the bound gets a transaction of its own.
pub fn transactions(changes: &[Change], ops_max: usize) -> Vec<&[Change]> {
    let mut out = Vec::new();
    let (mut start, mut cmps, mut ops) = (0, 0, 0);
    let mut i = 0;
    while i < changes.len() {
        let mut j = i;
        let (mut c, mut o) = (0, 0);
        while j < changes.len() && changes[j].item() == changes[i].item() {
            c += changes[j].guards().len();
            o += match changes[j] {
                Change::Reslot { .. } => 2,
                _ => 1,
            };
            j += 1;
        }
        if i > start && (cmps + c > ops_max || ops + o > ops_max) {
            out.push(&changes[start..i]);
            start = i;
            cmps = 0;
            ops = 0;
        }
        cmps += c;
        ops += o;
        i = j;
    }
    if start < changes.len() {
        out.push(&changes[start..]);
    }
    out
}

/// The member value of the allocator's tests and simulation: an endpoint
/// and a limit, as brokers and consumer processes both have.
#[cfg(test)]
#[derive(Clone, Debug, PartialEq, Eq, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TestMember {
    pub endpoint: String,
    pub limit: u32,
    #[serde(default)]
    pub exiting: bool,
}

#[cfg(test)]
impl MemberValue for TestMember {
    fn limit(&self) -> u32 {
        self.limit
    }
    fn exiting(&self) -> bool {
        self.exiting
    }
}

/// Writes as the allocator's tests and simulation make them: each at the
/// next revision, as etcd would.
#[cfg(test)]
impl Snapshot<TestMember> {
    pub fn bump(&mut self) -> i64 {
        self.revision += 1;
        self.revision
    }

    /// An item's spec written (created, or its replication changed).
    pub fn write_item(&mut self, name: &str, replication: u32) {
        let mod_revision = self.bump();
        let item = Item {
            replication,
            mod_revision,
        };
        self.items.insert(name.to_string(), item);
    }

    /// A member key written at the member's start, under a lease granted
    /// then: the lease's id (the revision).
    pub fn write_member(&mut self, key: MemberKey, endpoint: String, limit: u32) -> i64 {
        let rev = self.bump();
        let spec = TestMember {
            endpoint,
            limit,
            exiting: false,
        };
        let member = Member {
            spec,
            create_revision: rev,
            mod_revision: rev,
            lease: rev,
        };
        self.members.insert(key, member);
        rev
    }
}
