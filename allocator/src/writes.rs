//! The leader's plan as guarded etcd writes, in `rotary_etcd::keyspace`'s
//! terms: what a leader's driver (a broker's control thread, a consumer
//! process's session) sends to etcd. Plain logic still: no I/O here.

use crate::{self as allocator, GuardKey, MemberKey, MemberValue, Snapshot};
use rotary_etcd::keyspace::{Guard, Write};

/// The allocator's changes for `snapshot`, as transactions of guards and
/// writes (each item's changes in one, [`allocator::TXN_OPS_MAX`] at
/// most). Every transaction is also guarded by the leader's own member key
/// at the revision the plan read, so a leader that lost its place (its
/// lease expired, another member leads) writes nothing.
///
/// With `hold_back_fresh`, items that have no assignment at all are
/// left alone: a leader that has just (re)joined may see every assignment
/// gone because every member lost its lease at once (etcd was paused or
/// restarted past the TTL), and the members that hold the items' state
/// re-create their own assignments once they rejoin. A fresh route given
/// first would make a member holding nothing the primary.
pub fn plan_writes<M: MemberValue>(
    snapshot: &Snapshot<M>,
    leader: &MemberKey,
    hold_back_fresh: bool,
) -> Vec<(Vec<Guard>, Vec<Write>)> {
    let mut changes = allocator::plan(snapshot);
    if hold_back_fresh {
        changes.retain(|c| snapshot.assignments_of(c.item()).next().is_some());
    }
    if changes.is_empty() {
        return Vec::new();
    }
    let Some(mine) = snapshot
        .leader_guard()
        .filter(|_| snapshot.leader() == Some(leader))
    else {
        return Vec::new();
    };
    let guard = |g: allocator::Guard| match &g.key {
        GuardKey::Assignments(_) => {
            Guard::UnchangedSince(g.key.to_key(&snapshot.prefix), g.mod_revision)
        }
        _ => Guard::ModRevision(g.key.to_key(&snapshot.prefix), g.mod_revision),
    };
    // One compare is the leader's own.
    allocator::transactions(&changes, allocator::TXN_OPS_MAX - 1)
        .into_iter()
        .map(|batch| {
            let mut guards = vec![mine.clone()];
            let mut writes = Vec::new();
            for c in batch {
                for g in c.guards() {
                    if !guards.contains(&g) {
                        guards.push(g);
                    }
                }
                writes.extend(c.ops(&snapshot.prefix).into_iter().map(|op| match op {
                    allocator::Op::Put { key, value, lease } => Write::Put { key, value, lease },
                    allocator::Op::Delete { key } => Write::Delete { key },
                }));
            }
            (guards.into_iter().map(guard).collect(), writes)
        })
        .collect()
}
