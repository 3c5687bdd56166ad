//! Sound assignments: an item never has one member at two slots, and
//! never two primaries (two slot-0 keys).
//!
//! Every write of an assignment is guarded so that etcd keeps this (the
//! allocator's and a rejoining member's transactions hold only if none of
//! the item's assignments changed since the revision their decision
//! read: see [`super::GuardKey::Assignments`]). Keys written before those
//! guards existed, or by hand, may still break it, so whoever reads
//! assignments sorts them out the same way, with [`sort_out`]: the members
//! route by its `kept` keys alone, and the allocator's plan repairs etcd
//! (deletes the `dropped` keys, moves the `demoted` ones to free replica
//! slots) before it plans anything else for the item.
//!
//! Which key is kept, and why:
//! - of several slot-0 keys, the primary is the one whose value records a
//!   route it synchronized as that route's primary (its copy holds every
//!   byte acknowledged on that route); among several such, or none, the
//!   oldest key (lowest create revision): a later slot-0 key was written
//!   from a view that did not yet hold the first one;
//! - a member at several slots keeps one key: its slot-0 key if it is the
//!   primary kept, else its lowest replica slot; its other keys are
//!   dropped (they hold no copy the kept key does not);
//! - a slot-0 key that is not the primary kept, of a member with no
//!   replica slot, is demoted to a free replica slot: its member's copy
//!   stays on the route, where the primary synchronizes it (and copies
//!   from it what it holds beyond the primary's head).

use super::keys::{AssignmentKey, MemberKey};
use super::state::{Assignment, MemberValue, Snapshot};

/// One item's assignments, sorted out.
#[derive(Debug, Default)]
pub struct SortedOut<'a> {
    /// One key per member; at most one at slot 0.
    pub kept: Vec<(&'a AssignmentKey, &'a Assignment)>,
    /// Keys of members that keep another key of the item.
    pub dropped: Vec<(&'a AssignmentKey, &'a Assignment)>,
    /// Slot-0 keys that are not the primary, of members with no other key:
    /// each with the free replica slot it moves to.
    pub demoted: Vec<(&'a AssignmentKey, &'a Assignment, u32)>,
}

impl SortedOut<'_> {
    /// Whether the item's keys were sound as they were.
    pub fn is_sound(&self) -> bool {
        self.dropped.is_empty() && self.demoted.is_empty()
    }
}

/// Whether `a`, at key `k`, records a route its member synchronized as
/// that route's primary.
fn records_itself_primary(k: &AssignmentKey, a: &Assignment) -> bool {
    a.route
        .as_ref()
        .is_some_and(|r| r.primary.as_ref() == Some(&k.member) && r.contains(&k.member))
}

/// Sorts out one item's assignments (see the module's comment).
pub fn sort_out<'a>(
    assignments: impl IntoIterator<Item = (&'a AssignmentKey, &'a Assignment)>,
) -> SortedOut<'a> {
    let all: Vec<(&AssignmentKey, &Assignment)> = assignments.into_iter().collect();
    debug_assert!(
        all.windows(2).all(|w| w[0].0.item == w[1].0.item),
        "one item's assignments"
    );
    let primary = all
        .iter()
        .filter(|(k, _)| k.slot == 0)
        .min_by_key(|(k, a)| (!records_itself_primary(k, a), a.create_revision, *k))
        .map(|(k, _)| *k);
    let mut out = SortedOut::default();
    let mut members: Vec<&MemberKey> = all.iter().map(|(k, _)| &k.member).collect();
    members.sort();
    members.dedup();
    let mut orphans = Vec::new();
    for m in members {
        let mut own: Vec<(&AssignmentKey, &Assignment)> = all
            .iter()
            .filter(|(k, _)| &k.member == m)
            .copied()
            .collect();
        own.sort_by_key(|(k, _)| k.slot);
        let keep = if primary.is_some_and(|p| &p.member == m) {
            Some(0)
        } else {
            own.iter().position(|(k, _)| k.slot != 0)
        };
        match keep {
            Some(i) => {
                for (n, kv) in own.into_iter().enumerate() {
                    if n == i {
                        out.kept.push(kv);
                    } else {
                        out.dropped.push(kv);
                    }
                }
            }
            // Only slot-0 keys (one: the key names the slot), not the primary.
            None => orphans.push(own[0]),
        }
    }
    let mut used: Vec<u32> = out.kept.iter().map(|(k, _)| k.slot).collect();
    for (k, a) in orphans {
        let slot = (1..).find(|s| !used.contains(s)).expect("a free slot");
        used.push(slot);
        out.demoted.push((k, a, slot));
    }
    assert_sound(out.kept.iter().map(|(k, _)| *k));
    out
}

/// Asserts that `keys` (one item's) are sound: distinct members and
/// distinct slots (so at most one primary).
pub fn assert_sound<'a>(keys: impl IntoIterator<Item = &'a AssignmentKey>) {
    let keys: Vec<&AssignmentKey> = keys.into_iter().collect();
    for (i, a) in keys.iter().enumerate() {
        for b in &keys[i + 1..] {
            assert!(
                a.member != b.member && a.slot != b.slot,
                "unsound assignments: {a} and {b}"
            );
        }
    }
}

/// Whether `keys` (one item's) are sound.
pub fn is_sound<'a>(keys: impl IntoIterator<Item = &'a AssignmentKey>) -> bool {
    let keys: Vec<&AssignmentKey> = keys.into_iter().collect();
    keys.iter().enumerate().all(|(i, a)| {
        keys[i + 1..]
            .iter()
            .all(|b| a.member != b.member && a.slot != b.slot)
    })
}

/// Where member `m`, which held `item` at `slot` until its lease was
/// lost, puts its assignment back, given the item's assignments in
/// `snapshot`: `None` when there is nothing to put back (the item is
/// gone, or `m` holds it again); else `slot` if no key of the item is
/// at it (so slot 0 only while the item has no primary), else the
/// lowest replica slot no key is at. The write is guarded by the
/// item's assignments unchanged since `snapshot`'s revision, so what it
/// lands on is what this decided on, and it stays sound.
pub fn place_again<M: MemberValue>(
    snapshot: &Snapshot<M>,
    item: &str,
    m: &MemberKey,
    slot: u32,
) -> Option<u32> {
    if !snapshot.items.contains_key(item) {
        return None;
    }
    let used: Vec<u32> = snapshot.assignments_of(item).map(|(k, _)| k.slot).collect();
    if snapshot.assignments_of(item).any(|(k, _)| &k.member == m) {
        return None;
    }
    if !used.contains(&slot) {
        return Some(slot);
    }
    (1..).find(|s| !used.contains(s))
}

#[cfg(test)]
mod tests {
    use super::super::state::Route;
    use super::*;

    fn key(s: &str) -> AssignmentKey {
        let p: Vec<&str> = s.split('#').collect();
        AssignmentKey::new(
            p[0],
            MemberKey::new(p[1], p[2]).unwrap(),
            p[3].parse().unwrap(),
        )
        .unwrap()
    }

    fn at(create: i64, route: Option<Route>) -> Assignment {
        Assignment {
            route,
            create_revision: create,
            mod_revision: create,
        }
    }

    fn names(v: &[(&AssignmentKey, &Assignment)]) -> Vec<String> {
        v.iter().map(|(k, _)| k.to_string()).collect()
    }

    #[test]
    fn a_member_at_several_slots_keeps_one() {
        // The route of the fault: one broker at every slot.
        let keys = [key("J#z4#b4#0"), key("J#z4#b4#1"), key("J#z4#b4#2")];
        let vals = [at(9, None), at(8, None), at(7, None)];
        let s = sort_out(keys.iter().zip(&vals));
        assert_eq!(names(&s.kept), ["J#z4#b4#0"]);
        assert_eq!(names(&s.dropped), ["J#z4#b4#1", "J#z4#b4#2"]);
        assert!(s.demoted.is_empty() && !s.is_sound());
        // Not the primary: its lowest replica slot.
        let keys = [key("J#a#p#0"), key("J#b#r#2"), key("J#b#r#1")];
        let vals = [at(5, None), at(6, None), at(7, None)];
        let s = sort_out(keys.iter().zip(&vals));
        assert_eq!(names(&s.kept), ["J#a#p#0", "J#b#r#1"]);
        assert_eq!(names(&s.dropped), ["J#b#r#2"]);
    }

    #[test]
    fn of_several_primaries_the_one_that_synchronized_as_primary_stays() {
        let m = |z: &str, id: &str| MemberKey::new(z, id).unwrap();
        let synced = Route {
            primary: Some(m("z2", "b2")),
            members: vec![m("z1", "b1"), m("z2", "b2")],
        };
        let keys = [key("J#z1#b1#0"), key("J#z2#b2#0"), key("J#z4#b4#0")];
        // b1's key is the oldest, but b2's records b2 as the primary of a
        // route it synchronized; b1's value names b2 as primary.
        let vals = [
            at(3, Some(synced.clone())),
            at(5, Some(synced)),
            at(4, None),
        ];
        let s = sort_out(keys.iter().zip(&vals));
        assert_eq!(names(&s.kept), ["J#z2#b2#0"]);
        let demoted: Vec<(String, u32)> = s
            .demoted
            .iter()
            .map(|(k, _, slot)| (k.to_string(), *slot))
            .collect();
        assert_eq!(
            demoted,
            [("J#z1#b1#0".to_string(), 1), ("J#z4#b4#0".to_string(), 2)]
        );
        // None synchronized: the oldest key is the primary.
        let vals = [at(6, None), at(5, None), at(9, None)];
        let s = sort_out(keys.iter().zip(&vals));
        assert_eq!(names(&s.kept), ["J#z2#b2#0"]);
        // A sound item is kept whole.
        let keys = [key("J#a#p#0"), key("J#b#r#1")];
        let s = sort_out(keys.iter().zip(&vals));
        assert!(s.is_sound());
        assert_eq!(s.kept.len(), 2);
    }
}
