//! [`plan`]: from a snapshot, the changes that bring the assignments closer
//! to a balanced, fully replicated, zone-spread allocation, never taking a
//! item below its replication while a replacement catches up.
//!
//! It works in two steps. First a *desired* allocation: which members
//! should hold each item. It keeps what is assigned wherever that is
//! allowed (the member takes items, the item's zones are spread, the
//! member is within its fair share), then fills what is missing, greedily,
//! item by item in name order, in tiers of decreasing preference:
//!
//! 1. a member under its fair share, in a zone the item is short of;
//! 2. a member that held the item already (taking it back moves nothing),
//!    in a zone the item is short of, under its limit;
//! 3. any member under its limit, in a zone the item is short of;
//! 4. a former holder under its limit, any zone;
//! 5. a member under its fair share, any zone (the fewest copies per zone first);
//! 6. a member under its limit, any zone.
//!
//! Within a tier: former holders first, then the member with the lowest
//! ratio of items to fair share, then the lower key. That order is what
//! makes Gazette's initial scenario come out as it does there.
//!
//! The desired allocation depends on the current one only through which
//! member holds what, and how loaded each member is: once the additions
//! it asked for are made, it asks for the same allocation again, so the
//! plan converges instead of oscillating.
//!
//! Second, per item, the steps toward it, as Gazette takes them: add
//! what is missing (members under their limit counting every assignment
//! they hold now); remove what is not desired only while the item keeps
//! at least `replication` consistent copies (an unsynchronized replacement
//! does not count); promote a replica at once when there is no primary
//! (a consistent one first, then one that was part of a synchronized
//! route, which holds every acknowledged byte); and, when nothing else
//! changes, pack the replica slots one at a time.
//!
//! The fill is greedy, not a maximum flow as Gazette's: where member slots
//! are short, it may leave a copy unplaced that moving another item
//! would make room for (Gazette's scale-up scenario: three members of
//! limits 1, 2, 3 and items of replication 1, 2, 3 end with 5 copies,
//! not 6). With slots to spare it places every copy. Likewise, rebalancing
//! moves copies one hop (from a member above its share to one with room
//! that lacks the item): a member may stay one copy above its share
//! rounded up where only a chain of two moves would relieve it.
//!
//! Cost: O(A log A) to index the A assignments, then O(J · R · M) for J
//! items of replication R over M members.

use super::keys::{AssignmentKey, MemberKey};
use super::sound;
use super::state::{route_matches, Assignment, Change, MemberValue, Snapshot};
use std::cmp::Ordering;

/// A member, as the plan sees it.
struct Mem<'a> {
    key: &'a MemberKey,
    zone: u32,
    /// Items it may be given (0 when exiting).
    capacity: u64,
    /// Its hard limit.
    limit: u64,
    /// Its fair share of the item copies, at most `capacity`.
    share: u64,
    /// Assignments it holds now (every item, any slot).
    held: u64,
    /// Primaries it holds now, kept up to date as the plan promotes.
    primaries: u64,
    /// Copies it has in the desired allocation so far.
    desired: u64,
    mod_revision: i64,
    lease: i64,
}

/// One current assignment of an item.
struct Cur<'a> {
    key: &'a AssignmentKey,
    a: &'a Assignment,
    /// Index of its member, if the member exists.
    member: Option<u32>,
    consistent: bool,
    /// The member was part of a route the primary synchronized and has
    /// held the assignment since: it holds every acknowledged byte.
    synced: bool,
    /// The first assignment of its member for this item that the member
    /// may keep (exists and takes items).
    usable: bool,
}

struct Jour<'a> {
    name: &'a str,
    /// `None` for assignments of an item that no longer exists.
    item: Option<(u64, i64)>,
    /// Range into the flat list of current assignments.
    cur: (usize, usize),
    want: Vec<u32>,
}

/// The changes that move `snapshot` toward its desired allocation, grouped
/// by item, in item order. Empty when there is nothing to do: an idle
/// cluster writes nothing.
pub fn plan<M: MemberValue>(snapshot: &Snapshot<M>) -> Vec<Change> {
    let mut p = Planner::new(snapshot);
    p.keep();
    p.fill();
    p.changes()
}

struct Planner<'a> {
    /// The revision the snapshot was read at.
    revision: i64,
    mems: Vec<Mem<'a>>,
    curs: Vec<Cur<'a>>,
    jours: Vec<Jour<'a>>,
    /// Zones with a member that takes items.
    zones_usable: u64,
}

impl<'a> Planner<'a> {
    fn new<M: MemberValue>(s: &'a Snapshot<M>) -> Planner<'a> {
        let (mut mems, zones_usable) = Self::members(s);
        let (curs, jours) = Self::join(s, &mut mems);
        // Fair shares: the copies wanted (or as many as fit), spread in
        // proportion to capacity, rounded up.
        let demand: u64 = jours.iter().filter_map(|j| j.item).map(|(r, _)| r).sum();
        let capacity: u64 = mems.iter().map(|m| m.capacity).sum();
        let placed = demand.min(capacity);
        if capacity > 0 {
            for m in &mut mems {
                m.share = (m.capacity * placed).div_ceil(capacity).min(m.capacity);
            }
        }
        Planner {
            revision: s.revision,
            mems,
            curs,
            jours,
            zones_usable,
        }
    }

    /// The members in key order (so by zone), their zones numbered, and how
    /// many zones have a member that takes items.
    fn members<M: MemberValue>(s: &'a Snapshot<M>) -> (Vec<Mem<'a>>, u64) {
        let mut mems = Vec::with_capacity(s.members.len());
        let mut zone = 0u32;
        let mut last_zone: Option<&str> = None;
        let mut zones_usable = 0u64;
        let mut zone_counted = false;
        for (key, m) in &s.members {
            if last_zone.is_some_and(|z| z != key.zone) {
                zone += 1;
                zone_counted = false;
            }
            last_zone = Some(&key.zone);
            let capacity = u64::from(m.spec.capacity());
            if capacity > 0 && !zone_counted {
                zones_usable += 1;
                zone_counted = true;
            }
            mems.push(Mem {
                key,
                zone,
                capacity,
                limit: u64::from(m.spec.limit()),
                share: 0,
                held: 0,
                primaries: 0,
                desired: 0,
                mod_revision: m.mod_revision,
                lease: m.lease,
            });
        }
        (mems, zones_usable)
    }

    /// Joins items with their assignments (both in item order): the flat
    /// list of current assignments and the items with their ranges in
    /// it, counting what each member holds.
    fn join<M: MemberValue>(
        s: &'a Snapshot<M>,
        mems: &mut [Mem<'a>],
    ) -> (Vec<Cur<'a>>, Vec<Jour<'a>>) {
        let member_keys: Vec<&MemberKey> = s.members.keys().collect();
        let index =
            |k: &MemberKey| -> Option<u32> { member_keys.binary_search(&k).ok().map(|i| i as u32) };
        let mut curs: Vec<Cur<'a>> = Vec::with_capacity(s.assignments.len());
        let mut jours: Vec<Jour<'a>> = Vec::with_capacity(s.items.len());
        let mut items = s.items.iter().peekable();
        let mut asg = s.assignments.iter().peekable();
        loop {
            let next_item = items.peek().map(|(j, _)| j.as_str());
            let next_asg = asg.peek().map(|(k, _)| k.item.as_str());
            let (name, item) = match (next_item, next_asg) {
                (None, None) => break,
                (Some(j), Some(a)) if a < j => (a, None),
                (None, Some(a)) => (a, None),
                (Some(_), _) => {
                    let (j, it) = items.next().expect("peeked");
                    (
                        j.as_str(),
                        Some((u64::from(it.replication), it.mod_revision)),
                    )
                }
            };
            let start = curs.len();
            while let Some((k, a)) = asg.peek() {
                if k.item != name {
                    break;
                }
                let member = index(&k.member);
                curs.push(Cur {
                    key: k,
                    a,
                    member,
                    consistent: false,
                    synced: false,
                    usable: false,
                });
                asg.next();
            }
            let end = curs.len();
            Self::mark(&mut curs[start..end], mems, item.is_some());
            jours.push(Jour {
                name,
                item,
                cur: (start, end),
                want: Vec::new(),
            });
        }
        (curs, jours)
    }

    /// Marks one item's current assignments consistent, synced and
    /// usable, and counts them for their members.
    fn mark(curs: &mut [Cur<'a>], mems: &mut [Mem<'a>], exists: bool) {
        let flags: Vec<(bool, bool)> = {
            let keys = curs.iter().map(|c| c.key);
            curs.iter()
                .map(|c| match &c.a.route {
                    None => (false, false),
                    Some(r) => (route_matches(r, keys.clone()), r.contains(&c.key.member)),
                })
                .collect()
        };
        let mut seen: Vec<u32> = Vec::new();
        for (c, (consistent, synced)) in curs.iter_mut().zip(flags) {
            c.consistent = consistent;
            c.synced = synced;
            if let Some(m) = c.member {
                let mem = &mut mems[m as usize];
                mem.held += 1;
                if c.key.slot == 0 {
                    mem.primaries += 1;
                }
                if exists && mem.capacity > 0 && !seen.contains(&m) {
                    seen.push(m);
                    c.usable = true;
                }
            }
        }
    }

    /// Copies of an item of replication `r` one zone should hold at most.
    fn zone_cap(&self, r: u64) -> u64 {
        r.div_ceil(self.zones_usable.max(1))
    }

    /// Keeps current assignments where allowed: per item, at most
    /// `replication` of them with the zones spread; then per member, no more
    /// than its fair share.
    ///
    /// Where an item has copies to spare (a replacement was added and the
    /// copy it replaces is still there), the copy dropped is the one on the
    /// member furthest above its fair share, counting the copies already
    /// dropped: so once a plan's additions are made, the next plan drops
    /// from each member as many copies as that member had to give, and
    /// asks for nothing new.
    fn keep(&mut self) {
        let mut excess: Vec<i64> = self
            .mems
            .iter()
            .map(|m| m.held as i64 - m.share as i64)
            .collect();
        let mut want: Vec<u32> = Vec::new();
        for j in 0..self.jours.len() {
            let Some((r, _)) = self.jours[j].item else {
                continue;
            };
            let zone_cap = self.zone_cap(r);
            let (start, end) = self.jours[j].cur;
            want.clear();
            want.extend(
                self.curs[start..end]
                    .iter()
                    .filter(|c| c.usable)
                    .map(|c| c.member.expect("usable")),
            );
            loop {
                let zone_of = |m: u32| self.mems[m as usize].zone;
                let crowded = |m: u32| {
                    want.iter().filter(|&&w| zone_of(w) == zone_of(m)).count() as u64 > zone_cap
                };
                let over_zone = want.iter().any(|&m| crowded(m));
                if !over_zone && want.len() as u64 <= r {
                    break;
                }
                let name = self.jours[j].name;
                let (k, &victim) = want
                    .iter()
                    .enumerate()
                    .filter(|&(_, &m)| !over_zone || crowded(m))
                    .max_by_key(|&(_, &m)| {
                        (excess[m as usize], spread(name, self.mems[m as usize].key))
                    })
                    .expect("not empty");
                excess[victim as usize] -= 1;
                want.swap_remove(k);
            }
            self.jours[j].want = want.clone();
        }

        // Members still above their fair share give up copies: first those a
        // member with room could take (it does not hold the item), from
        // the items that gave up the fewest so far (so that the members
        // with room can take them all), then replicas before primaries, in
        // an order of each member's own.
        let mut kept: Vec<Vec<(bool, u32)>> = vec![Vec::new(); self.mems.len()];
        for (j, jour) in self.jours.iter().enumerate() {
            for &m in &jour.want {
                let primary = self.curs[jour.cur.0..jour.cur.1]
                    .iter()
                    .any(|c| c.member == Some(m) && c.key.slot == 0);
                kept[m as usize].push((primary, j as u32));
            }
        }
        let room: Vec<u32> = (0..self.mems.len() as u32)
            .filter(|&m| (kept[m as usize].len() as u64) < self.mems[m as usize].share)
            .collect();
        let mut gave = vec![0u32; self.jours.len()];
        for (m, list) in kept.iter_mut().enumerate() {
            let share = self.mems[m].share as usize;
            if list.len() > share {
                let key = self.mems[m].key;
                let over = list.len() - share;
                let jours = &self.jours;
                // A copy some member with room could take.
                let movable = |j: u32| room.iter().any(|r| !jours[j as usize].want.contains(r));
                list.sort_by_cached_key(|&(primary, j)| {
                    (
                        !movable(j),
                        gave[j as usize],
                        primary,
                        spread(jours[j as usize].name, key),
                    )
                });
                for &(_, j) in &list[..over] {
                    gave[j as usize] += 1;
                    self.jours[j as usize].want.retain(|&w| w as usize != m);
                }
                list.drain(..over);
            }
            self.mems[m].desired = list.len() as u64;
        }
    }

    /// Fills what is missing: first one copy of every item, then a
    /// second, and so on, so that where capacity is short every item
    /// has a copy before any has two; each round through the tiers.
    fn fill(&mut self) {
        let rounds = self
            .jours
            .iter()
            .filter_map(|j| j.item)
            .map(|(r, _)| r)
            .max()
            .unwrap_or(0);
        for round in 1..=rounds {
            for tier in 1..=6 {
                for j in 0..self.jours.len() {
                    let Some((r, _)) = self.jours[j].item else {
                        continue;
                    };
                    let target = r.min(round);
                    while (self.jours[j].want.len() as u64) < target {
                        match self.pick(j, r, tier) {
                            Some(m) => {
                                self.jours[j].want.push(m);
                                self.mems[m as usize].desired += 1;
                            }
                            None => break,
                        }
                    }
                }
            }
        }
    }

    /// The best member of `tier` (see the module's comment) to take one
    /// more copy of item `j`, if any.
    fn pick(&self, j: usize, r: u64, tier: u32) -> Option<u32> {
        let jour = &self.jours[j];
        let zone_cap = self.zone_cap(r);
        let (start, end) = jour.cur;
        let held_before = |m: u32| {
            self.curs[start..end]
                .iter()
                .any(|c| c.usable && c.member == Some(m))
        };
        let in_zone = |zone: u32| {
            jour.want
                .iter()
                .filter(|&&w| self.mems[w as usize].zone == zone)
                .count() as u64
        };
        let mut best: Option<(u32, bool, u64)> = None;
        for (i, m) in self.mems.iter().enumerate() {
            let i = i as u32;
            if m.capacity == 0 || m.desired >= m.capacity || jour.want.contains(&i) {
                continue;
            }
            let zone_copies = in_zone(m.zone);
            let zone_ok = zone_copies < zone_cap;
            let under_share = m.desired < m.share;
            let former = held_before(i);
            let eligible = match tier {
                1 => zone_ok && under_share,
                2 => zone_ok && former,
                3 => zone_ok,
                4 => former,
                5 => under_share,
                _ => true,
            };
            if !eligible {
                continue;
            }
            let better = match best {
                None => true,
                Some((b, b_former, b_zone)) => {
                    let bm = &self.mems[b as usize];
                    // Former holders first; in the relaxed tiers, the zone
                    // with the fewest copies; then the lowest load.
                    former
                        .cmp(&b_former)
                        .reverse()
                        .then(if tier >= 5 {
                            zone_copies.cmp(&b_zone)
                        } else {
                            Ordering::Equal
                        })
                        .then((m.desired * bm.share.max(1)).cmp(&(bm.desired * m.share.max(1))))
                        .then(i.cmp(&b))
                        == Ordering::Less
                }
            };
            if better {
                best = Some((i, former, zone_copies));
            }
        }
        best.map(|(i, _, _)| i)
    }

    /// Per item, the allowed steps from its current assignments toward
    /// its desired ones.
    fn changes(mut self) -> Vec<Change> {
        let mut out = Vec::new();
        for j in 0..self.jours.len() {
            let (start, end) = self.jours[j].cur;
            let Some((r, item_rev)) = self.jours[j].item else {
                // The item was deleted: its assignments go, as long as it
                // stays deleted.
                for c in &self.curs[start..end] {
                    out.push(Change::Remove {
                        key: c.key.clone(),
                        mod_revision: c.a.mod_revision,
                        item_mod_revision: 0,
                        keep: Vec::new(),
                    });
                }
                continue;
            };
            if self.repair(j, &mut out) {
                continue;
            }
            let mut want = std::mem::take(&mut self.jours[j].want);
            want.sort_unstable();
            let added = self.add(j, &want, &mut out);
            let first_removal = out.len();
            let removed = self.remove(j, r, item_rev, &want, &mut out);
            let removals = out.len() - first_removal;
            // What stays, by slot.
            let curs = &self.curs[start..end];
            let mut stay: Vec<usize> = (0..curs.len()).filter(|&i| !removed[i]).collect();
            stay.sort_by_key(|&i| (curs[i].key.slot, i));
            let promoted = self.promote(j, &stay, &mut out);
            if added == 0 && removals == 0 && !promoted {
                self.pack(j, &stay, &mut out);
            }
        }
        out
    }

    /// Where item `j`'s assignments are unsound (a member at two slots,
    /// two primaries: keys no guarded write makes, but etcd may hold them
    /// from before), the changes that make them sound ([`sound::sort_out`]),
    /// and nothing else for the item this round: the next plan starts
    /// from sound keys. Answers whether it repaired.
    fn repair(&self, j: usize, out: &mut Vec<Change>) -> bool {
        let (start, end) = self.jours[j].cur;
        let curs = &self.curs[start..end];
        let sorted = sound::sort_out(curs.iter().map(|c| (c.key, c.a)));
        if sorted.is_sound() {
            return false;
        }
        let item_rev = self.jours[j].item.map_or(0, |(_, rev)| rev);
        for (k, a) in &sorted.dropped {
            out.push(Change::Remove {
                key: (*k).clone(),
                mod_revision: a.mod_revision,
                item_mod_revision: item_rev,
                keep: Vec::new(),
            });
        }
        for (k, _, slot) in &sorted.demoted {
            let c = curs
                .iter()
                .find(|c| c.key == *k)
                .expect("one of the item's");
            // Moved under its member's lease: one without a member key
            // waits for it (it is joining, or its lease is ending).
            if c.member.is_some() {
                out.push(self.reslot(c, *slot));
            }
        }
        true
    }

    /// Additions of item `j`'s wanted members (`want`, sorted), at slots
    /// above every current one, in key order; only to members under their
    /// limit counting what they hold now. Answers how many were added.
    fn add(&mut self, j: usize, want: &[u32], out: &mut Vec<Change>) -> usize {
        let (start, end) = self.jours[j].cur;
        let curs = &self.curs[start..end];
        let mut next_slot = curs.iter().map(|c| c.key.slot + 1).max().unwrap_or(0);
        let mut added = 0;
        for &m in want {
            if curs.iter().any(|c| c.usable && c.member == Some(m)) {
                continue;
            }
            let slot = next_slot;
            next_slot += 1;
            let mem = &mut self.mems[m as usize];
            if mem.held >= mem.limit {
                continue;
            }
            mem.held += 1;
            if slot == 0 {
                mem.primaries += 1;
            }
            added += 1;
            out.push(Change::Add {
                key: AssignmentKey {
                    item: self.jours[j].name.to_string(),
                    member: mem.key.clone(),
                    slot,
                },
                member_mod_revision: mem.mod_revision,
                lease: mem.lease,
                read_revision: self.revision,
            });
        }
        added
    }

    /// Removals of item `j`'s assignments that are not wanted, most
    /// loaded member first, while `r` consistent copies remain. The first
    /// removal carries the assignments that stay. Answers, per current
    /// assignment, whether it goes.
    fn remove(
        &mut self,
        j: usize,
        r: u64,
        item_rev: i64,
        want: &[u32],
        out: &mut Vec<Change>,
    ) -> Vec<bool> {
        let (start, end) = self.jours[j].cur;
        let curs = &self.curs[start..end];
        let ratio = |c: &Cur| self.load_of(c, |m| m.held);
        let mut remove: Vec<usize> = (0..curs.len())
            .filter(|&i| {
                let c = &curs[i];
                !(c.usable && want.binary_search(&c.member.expect("usable")).is_ok())
            })
            .collect();
        remove.sort_by(|&a, &b| {
            let (na, da) = ratio(&curs[a]);
            let (nb, db) = ratio(&curs[b]);
            // Decreasing na/da (a zero limit is infinitely loaded).
            (nb * da).cmp(&(na * db)).then(a.cmp(&b))
        });
        let mut consistent = curs.iter().filter(|c| c.consistent).count() as u64;
        let mut removed = vec![false; curs.len()];
        for &i in &remove {
            if consistent < r || (curs[i].consistent && consistent == r) {
                continue;
            }
            if curs[i].consistent {
                consistent -= 1;
            }
            removed[i] = true;
        }
        let first_removal = out.len();
        let keep: Vec<(AssignmentKey, i64)> = curs
            .iter()
            .zip(&removed)
            .filter(|(_, &gone)| !gone)
            .map(|(c, _)| (c.key.clone(), c.a.mod_revision))
            .collect();
        for (i, c) in curs.iter().enumerate() {
            if !removed[i] {
                continue;
            }
            if let Some(m) = c.member {
                let mem = &mut self.mems[m as usize];
                if c.key.slot == 0 {
                    mem.primaries -= 1;
                }
            }
            out.push(Change::Remove {
                key: c.key.clone(),
                mod_revision: c.a.mod_revision,
                item_mod_revision: item_rev,
                keep: if out.len() == first_removal {
                    keep.clone()
                } else {
                    Vec::new()
                },
            });
        }
        removed
    }

    /// With no primary among item `j`'s assignments that stay (`stay`,
    /// indices into its current ones by slot), promotes one. Answers
    /// whether it did.
    fn promote(&mut self, j: usize, stay: &[usize], out: &mut Vec<Change>) -> bool {
        let (start, end) = self.jours[j].cur;
        let curs = &self.curs[start..end];
        let Some(&first) = stay.first() else {
            return false;
        };
        if curs[first].key.slot == 0 {
            return false;
        }
        // Moved under its member's lease: one without a member key (it is
        // joining, or its lease is ending) is not promoted.
        let Some(best) = stay
            .iter()
            .copied()
            .filter(|&i| curs[i].member.is_some())
            .min_by(|&a, &b| self.promotion_order(&curs[a], &curs[b]))
        else {
            return false;
        };
        let c = &curs[best];
        if let Some(m) = c.member {
            self.mems[m as usize].primaries += 1;
        }
        out.push(self.reslot(c, 0));
        true
    }

    /// Packs one of item `j`'s replicas that stay (`stay`, by slot) into
    /// the lowest free slot.
    fn pack(&self, j: usize, stay: &[usize], out: &mut Vec<Change>) {
        let (start, end) = self.jours[j].cur;
        let curs = &self.curs[start..end];
        if let Some((k, &i)) = stay
            .iter()
            .enumerate()
            .skip(1)
            .find(|&(k, &i)| curs[i].key.slot != k as u32)
            .filter(|&(_, &i)| curs[i].member.is_some())
        {
            out.push(self.reslot(&curs[i], k as u32));
        }
    }

    /// Which of two assignments to promote first: a consistent one, then one
    /// that holds every acknowledged byte, then the member with the fewest
    /// primaries for its limit, then the lower slot.
    fn promotion_order(&self, a: &Cur, b: &Cur) -> Ordering {
        let tier = |c: &Cur| {
            if c.consistent {
                0
            } else if c.synced {
                1
            } else {
                2
            }
        };
        let load = |c: &Cur| self.load_of(c, |m| m.primaries);
        let ((pa, la), (pb, lb)) = (load(a), load(b));
        tier(a)
            .cmp(&tier(b))
            .then((pa * lb).cmp(&(pb * la)))
            .then(a.key.slot.cmp(&b.key.slot))
            .then(a.key.cmp(b.key))
    }

    /// How loaded the member of `c` is, as a fraction `(count(member),
    /// limit)` to compare by cross-multiplying; a copy without a member,
    /// or one at limit 0, is infinitely loaded (`(1, 0)`).
    fn load_of(&self, c: &Cur, count: impl Fn(&Mem<'_>) -> u64) -> (u64, u64) {
        match c.member.map(|m| &self.mems[m as usize]) {
            Some(mem) if mem.limit > 0 => (count(mem), mem.limit),
            _ => (1, 0),
        }
    }

    fn reslot(&self, c: &Cur, to_slot: u32) -> Change {
        let lease = c.member.map_or(0, |m| self.mems[m as usize].lease);
        Change::Reslot {
            from: c.key.clone(),
            to_slot,
            mod_revision: c.a.mod_revision,
            value: c.a.route.as_ref().map(|r| r.encode()).unwrap_or_default(),
            lease,
            read_revision: self.revision,
        }
    }
}

/// A fixed pseudo-random order of a member's items (FNV-1a of both
/// names), so that members giving up copies give up different items.
fn spread(item: &str, member: &MemberKey) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in item
        .bytes()
        .chain([b'#'])
        .chain(member.zone.bytes())
        .chain([b'#'])
        .chain(member.id.bytes())
    {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}
