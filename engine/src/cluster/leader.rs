//! The allocator's driver on the leader: its plan, as guarded etcd writes.

use super::io::{Guard, Write};
use crate::allocator::{self, MemberKey, Snapshot};

/// The allocator's changes for `snapshot`, as transactions of guards and
/// writes (each journal's changes in one, [`allocator::TXN_OPS_MAX`] at
/// most). Every transaction is also guarded by the leader's own member key
/// at the revision the plan read, so a leader that lost its place (its
/// lease expired, another member leads) writes nothing.
pub fn plan_writes(snapshot: &Snapshot, leader: &MemberKey) -> Vec<(Vec<Guard>, Vec<Write>)> {
    let changes = allocator::plan(snapshot);
    if changes.is_empty() {
        return Vec::new();
    }
    let Some(mine) = snapshot
        .leader_guard()
        .filter(|_| snapshot.leader() == Some(leader))
    else {
        return Vec::new();
    };
    let guard =
        |g: allocator::Guard| Guard::ModRevision(g.key.to_key(&snapshot.prefix), g.mod_revision);
    // One compare is the leader's own.
    allocator::transactions(&changes, allocator::TXN_OPS_MAX - 1)
        .into_iter()
        .map(|batch| {
            let mut guards = vec![guard(mine.clone())];
            let mut writes = Vec::new();
            for c in batch {
                guards.extend(c.guards().into_iter().map(guard));
                writes.extend(c.ops(&snapshot.prefix).into_iter().map(|op| match op {
                    allocator::Op::Put { key, value, lease } => Write::Put { key, value, lease },
                    allocator::Op::Delete { key } => Write::Delete { key },
                }));
            }
            (guards, writes)
        })
        .collect()
}
