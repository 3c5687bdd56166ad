//! The allocator: which members hold which items (journals on brokers, a
//! consumer application's shards on its processes), as plain logic over a
//! snapshot of etcd's key space (no I/O, no clock, no randomness). One
//! member at a time runs it, the leader ([`Snapshot::leader`]: the member
//! with the lowest create revision); its driver reads the key space, calls
//! [`plan`], and writes the [`Change`]s as etcd transactions
//! ([`transactions`]), each guarded by the revisions the plan read, plus
//! the leader's own member key at its mod revision, so that a plan made
//! stale by any concurrent write (a member's lease expiring, a spec
//! applied, another leader) fails instead of landing. A member key's value
//! is the member kind's own ([`MemberValue`]: a broker's spec, a consumer
//! process's spec); the allocator reads only its limit and whether it is
//! leaving.
//!
//! What the plan guarantees (tested here, and by a seeded simulation of
//! members joining, leaving, pausing and dying in `sim`):
//! - assignments stay sound: an item never has one member at two slots
//!   nor two primaries. Every change that creates a key is guarded by the
//!   item's assignments unchanged since the plan's read
//!   ([`GuardKey::Assignments`]), so a plan from a lagging read lands
//!   only where it is still right; keys that are unsound anyway are
//!   repaired first ([`sound`]);
//! - an item is never taken below its replication in consistent copies
//!   by a removal: replacements are added first, and the old copy goes only
//!   once the primary synchronized the new route and wrote it into the
//!   assignments ([`consistent`]);
//! - an item without a primary (its primary's lease expired) gets one at
//!   once, chosen among the copies that hold every acknowledged byte;
//! - no member is given more items than its limit; exiting members and
//!   members at limit 0 are given none, and lose theirs the add-first way;
//! - replicas go to distinct zones where there are enough zones (else as
//!   evenly spread as the zones allow), members get items in proportion
//!   to their limits (zone spread first), and current assignments are kept
//!   wherever those rules allow (fewest moves);
//! - a snapshot with nothing to do yields no changes: an idle cluster writes
//!   nothing.

pub mod keys;
mod plan;
pub mod sound;
pub mod state;
#[cfg(feature = "keyspace")]
pub mod writes;

#[cfg(test)]
mod scenarios;
#[cfg(test)]
mod sim;

pub use keys::{
    assignment_key, item_key, member_key, parse_key, AssignmentKey, Key, KeyError, MemberKey,
};
pub use plan::plan;
pub use state::{
    apply, consistent, transactions, Assignment, Change, Guard, GuardKey, Item, KvError, Member,
    MemberValue, Op, Route, RouteError, Snapshot, TxnFailed, TXN_OPS_MAX,
};
